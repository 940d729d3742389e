//! The `lmcache` handoff end to end: simulated engines speaking LMCache's PD backend protocol (ZMQ
//! REQ/REP allocation, msgpack `ProxyNotif` over PUSH/PULL) behind the gateway.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use baton_gateway::demo::{Demo, DemoConfig, GatewaySetup, start};
use baton_gateway::handoff::Limits;
use baton_gateway::handoff::Mode;
use baton_sim::faults::FaultConfig;
use baton_sim::kv::output_text;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use super::{answer_text, deadlock_scenario, disconnect_storm, drains, drains_in, four_shapes, http, prompt};

async fn lmcache_demo(tp: u32, pages: u32, faults: FaultConfig, setup: GatewaySetup) -> Demo {
    start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp,
        pages,
        handoff: Mode::Lmcache,
        prefill_faults: faults,
        gateway: setup,
        ..DemoConfig::default()
    })
    .await
    .unwrap()
}

/// No slot held by the gateway and no chunk left in any decoder's PD buffer; `strict`: nothing was
/// recomputed or written late either.
async fn assert_lmcache_clean(d: &Demo, strict: bool) {
    let start = Instant::now();
    loop {
        let slots: u32 = d.gateway.decoders.iter().map(|x| x.queue.stats().in_use).sum();
        let mut used = 0;
        let mut odd = Vec::new();
        for e in &d.engines {
            let s = e.engine.stats();
            for r in s["lmcache"]["ranks"].as_array().into_iter().flatten() {
                used += r["used_chunks"].as_u64().unwrap();
                if r["recomputed"] != 0 || r["late_writes"] != 0 {
                    odd.push(r.clone());
                }
            }
        }
        if slots == 0 && used == 0 {
            if strict {
                assert!(odd.is_empty(), "recomputed or late writes: {odd:?}");
            }
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "not clean: {slots} slots, {used} chunks held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Completions and chat, streamed and not, with and without first token from prefill: the text is
/// what one engine would have produced and usage counts the prompt once and every token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_mode_serves_completions_and_chat_streamed_and_not() {
    for no_first_token in [false, true] {
        let setup = GatewaySetup { no_first_token, ..GatewaySetup::default() };
        let d = lmcache_demo(2, 64, FaultConfig::default(), setup).await;
        four_shapes(d.addr, 100, 5, &format!("first_token={}", !no_first_token)).await;
        // max_tokens 1 with first token: the prefill's token is the whole answer, and the decoder's
        // buffer is still drained.
        let (status, b) =
            http(d.addr, "/v1/completions", Some(&json!({"prompt": prompt(40, 1), "max_tokens": 1}))).await;
        assert_eq!(status, 200);
        assert_eq!(
            answer_text(&b, false, false).0,
            output_text(&prompt(40, 1).bytes().map(u32::from).collect::<Vec<_>>(), 1)
        );
        assert_lmcache_clean(&d, true).await;
        d.shutdown().await;
    }
}

/// A prefiller's first token that is the whole answer (`max_tokens` 1) goes to the client at once:
/// it waits neither for the notifications nor for the decoder. Here no notification ever comes
/// (before, the client got a 502 at the notification deadline for an answer it already had); the
/// decoder's buffer is still drained after the deadline, counted apart from the drains of failed
/// requests, and only then do the slots come back. Streamed too: the stream ends with the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_answers_a_one_token_request_from_the_prefill_and_drains_after() {
    let limits = Limits { ready_timeout: Duration::from_secs(2), ..Limits::default() };
    let faults = FaultConfig { drop_notify: true, ..FaultConfig::default() };
    let d = lmcache_demo(2, 64, faults, GatewaySetup { limits, ..GatewaySetup::default() }).await;
    let want = output_text(&prompt(40, 1).bytes().map(u32::from).collect::<Vec<_>>(), 1);
    for stream in [false, true] {
        let t = Instant::now();
        let (status, b) = http(
            d.addr,
            "/v1/completions",
            Some(&json!({"prompt": prompt(40, 1), "max_tokens": 1, "stream": stream})),
        )
        .await;
        let took = t.elapsed();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
        assert_eq!(answer_text(&b, false, stream).0, want, "stream={stream}");
        assert!(took < Duration::from_millis(1500), "stream={stream}: answered in {took:?}");
        if stream {
            let body = String::from_utf8_lossy(&b);
            assert!(
                body.contains("\"finish_reason\":\"length\"") && body.ends_with("data: [DONE]\n\n"),
                "{body}"
            );
        }
    }
    // Held until the drains (after the deadline) are answered.
    let slots: u32 = d.gateway.decoders.iter().map(|x| x.queue.stats().in_use).sum();
    assert!(slots > 0, "the slots came back before the decoder's buffer was drained");
    assert_lmcache_clean(&d, false).await;
    assert_eq!(drains_in(&d, "baton_drains_after_answer_total", "lmcache", "sent").await, 2.0);
    assert_eq!(drains_in(&d, "baton_drains_after_answer_total", "lmcache", "failed").await, 0.0);
    assert_eq!(drains(&d, "lmcache", "sent").await, 0.0, "no request failed");
    d.shutdown().await;
}

/// The deadlock scenario in `lmcache` mode: 64-chunk buffers, TP 2, 300 concurrent mixed requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_deadlock_scenario_completes_and_leaves_no_slot_held() {
    let d = lmcache_demo(2, 64, FaultConfig::default(), GatewaySetup::default()).await;
    let done = Arc::default();
    let mut tasks = deadlock_scenario(d.addr, &done);
    let started = Instant::now();
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    assert_eq!(done.load(Ordering::Relaxed), 300);
    assert!(started.elapsed() < Duration::from_secs(60), "took {:?}", started.elapsed());
    assert_lmcache_clean(&d, true).await;
    let hub = d.lmcache.as_ref().unwrap();
    assert_eq!(hub.stats.counted.load(Ordering::Relaxed), 600, "one notification per rank per request");
    assert_eq!(hub.waiting(), 0);
    d.shutdown().await;
}

/// A notification that never comes fails the request by its deadline with a clear error; the
/// decoder's buffer is drained and the slots come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_missing_notification_fails_by_its_deadline_and_frees_the_slots() {
    let limits = Limits { ready_timeout: Duration::from_millis(300), ..Limits::default() };
    let faults = FaultConfig { drop_notify: true, ..FaultConfig::default() };
    let d = lmcache_demo(2, 64, faults, GatewaySetup { limits, ..GatewaySetup::default() }).await;
    for stream in [false, true] {
        let t = Instant::now();
        let (status, b) = http(
            d.addr,
            "/v1/completions",
            Some(&json!({"prompt": prompt(50, 2), "max_tokens": 4, "stream": stream})),
        )
        .await;
        let body = String::from_utf8_lossy(&b).into_owned();
        if stream {
            // The first token went out before the wait; the failure ends the stream with an error event.
            assert_eq!(status, 200);
            assert!(body.contains("kv_transfer_failed") && body.ends_with("data: [DONE]\n\n"), "{body}");
        } else {
            assert_eq!(status, 502, "{body}");
            assert!(body.contains("kv_transfer_failed"), "{body}");
        }
        assert!(body.contains("0 of 2 prefill ranks reported the kv"), "{body}");
        assert!(
            t.elapsed() >= Duration::from_millis(300) && t.elapsed() < Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
    }
    assert_lmcache_clean(&d, false).await;
    assert_eq!(drains(&d, "lmcache", "sent").await, 2.0);
    assert_eq!(drains(&d, "lmcache", "failed").await, 0.0);
    let lingered: u64 = d.gateway.decoders.iter().map(|x| x.queue.stats().lingered).sum();
    assert_eq!(lingered, 0, "a drain answered in full held its slots for the grace");
    d.shutdown().await;
}

/// Prefillers that answer before writing (LMCache's asynchronous backend): rank 0 notifies twice
/// while rank 1 is still writing. The duplicate is recognised (same connection) and the decode waits
/// for rank 1; released early, the decoder would find rank 1's chunks allocated but unwritten and
/// fail the request (checked: with duplicates counted, this test fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_duplicate_notifications_do_not_release_a_request_early() {
    let faults = FaultConfig {
        duplicate_notify_rank: Some(0),
        slow_rank: Some(1),
        slow_ms: 150,
        ..FaultConfig::default()
    };
    let d = start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp: 2,
        pages: 64,
        handoff: Mode::Lmcache,
        prefill_faults: faults,
        lmcache_async_send: true,
        ..DemoConfig::default()
    })
    .await
    .unwrap();
    let mut tasks = JoinSet::new();
    for i in 0..8usize {
        let addr = d.addr;
        tasks.spawn(async move {
            let text = prompt(40, i);
            let (status, b) =
                http(addr, "/v1/completions", Some(&json!({"prompt": text, "max_tokens": 3}))).await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
            assert_eq!(
                answer_text(&b, false, false).0,
                output_text(&text.bytes().map(u32::from).collect::<Vec<_>>(), 3)
            );
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let hub = d.lmcache.as_ref().unwrap();
    assert_eq!(hub.stats.duplicate.load(Ordering::Relaxed), 8);
    assert_eq!(hub.stats.counted.load(Ordering::Relaxed), 16);
    let (_, m) = http(d.admin, "/metrics", None).await;
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains("baton_lmcache_notifications_total{outcome=\"duplicate\"} 8"), "{m}");
    assert!(m.contains("baton_lmcache_notifications_total{outcome=\"counted\"} 16"), "{m}");
    assert_lmcache_clean(&d, true).await;
    d.shutdown().await;
}

/// 200 clients that leave at random points: afterwards no slot is held and no chunk is left in the
/// decoders' buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_random_disconnects_leave_nothing_held() {
    let d = start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp: 2,
        pages: 16,
        token_delay: Duration::from_millis(3),
        handoff: Mode::Lmcache,
        ..DemoConfig::default()
    })
    .await
    .unwrap();
    disconnect_storm(d.addr, |x| (1 + (x % 12) as usize) * 16 - 3, 150).await;
    assert_lmcache_clean(&d, false).await;
    let (s, _) =
        http(d.addr, "/v1/completions", Some(&json!({"prompt": "still here", "max_tokens": 2}))).await;
    assert_eq!(s, 200);
    d.shutdown().await;
}

/// `baton serve` from a TOML file naming an LMCache decoder by its YAML: the gateway reads ports,
/// buffer size and chunk size from it, listens for notifications, and serves end to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_an_lmcache_pool_from_config_and_yaml() {
    use baton_sim::{LmcacheSimConfig, SimConfig, SimRole, launch, tiny_geometry};
    let g = tiny_geometry(2).unwrap();
    let mut dc = SimConfig::new(SimRole::Decode, g);
    dc.lmcache = Some(LmcacheSimConfig {
        pd_buffer_bytes: 32 * g.page_bytes_per_rank(),
        ..LmcacheSimConfig::default()
    });
    let decode = launch(dc).await.unwrap();
    let ranks = decode.engine.stats()["lmcache"]["ranks"].as_array().unwrap().clone();
    let port = |r: &Value, k: &str| r[k].as_str().unwrap().parse::<std::net::SocketAddr>().unwrap().port();
    let dir = std::env::temp_dir().join(format!("baton-lmcache-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("decoder.yaml"),
        format!(
            "enable_pd: True\npd_role: \"receiver\"\npd_peer_host: \"127.0.0.1\"\npd_peer_init_port: [{}, {}]\npd_peer_alloc_port: [{}, {}]\npd_buffer_size: {}\nchunk_size: 16\n",
            port(&ranks[0], "init_addr"),
            port(&ranks[1], "init_addr"),
            port(&ranks[0], "alloc_addr"),
            port(&ranks[1], "alloc_addr"),
            32 * g.page_bytes_per_rank()
        ),
    )
    .unwrap();
    // The prefiller's HTTP port is picked first (outside the ephemeral range, so that no client's
    // socket takes it meanwhile); it starts once the gateway's listener exists.
    let prefill_at = std::net::SocketAddr::from(([127, 0, 0, 1], super::ports::free_port()));
    // The lmcache handoff sends the model's token ids: a real tokenizer (Qwen3's), which the
    // simulated engines take as they come.
    let tokenizer =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3/tokenizer.json");
    assert!(
        tokenizer.exists(),
        "{} is missing: run scripts/fetch-tokenizers (scripts/test does)",
        tokenizer.display()
    );
    let qwen3 = baton_gateway::tokenize::Tokenizer::load(&tokenizer, None).unwrap();
    let toml = format!(
        r#"[[listeners]]
address = "127.0.0.1:0"
plain_http = true
[admin]
listen = "127.0.0.1:0"
[model]
name = "baton-sim"
context_length = 32768
chunk_tokens = 16
geometry = {{ layers = 2, kv_heads = 2, head_dim = 16, dtype_bytes = 2 }}
tokenizer = {tokenizer:?}
[[prefill]]
name = "p0"
url = "http://{prefill_at}"
[[decode]]
name = "d0"
url = "http://{}"
handoff = "lmcache"
lmcache = {{ config = "decoder.yaml" }}
[lmcache]
notify_listen = "127.0.0.1:0"
[routing]
health_check_interval_ms = 50
"#,
        decode.addr
    );
    std::fs::write(dir.join("gw.toml"), toml).unwrap();
    let checked = baton_gateway::config::load(&dir.join("gw.toml")).unwrap();
    let baton_gateway::config::CheckedMode::Lmcache(pool) = &checked.decoders[0].mode else {
        panic!("an lmcache pool")
    };
    assert_eq!(pool.lmcache.capacity, 32);
    let serving = baton_gateway::serve::start(checked).await.unwrap();
    let hub = serving.lmcache.as_ref().unwrap().addr;
    let mut pc = SimConfig::new(SimRole::Prefill, g);
    pc.listen = prefill_at;
    pc.lmcache = Some(LmcacheSimConfig { proxy: Some(hub), ..LmcacheSimConfig::default() });
    let prefill = launch(pc).await.unwrap();
    // The gateway's first health check may run before or after the prefiller exists (and a
    // healthy() read before it has ended says nothing): until a check has found it, the gateway
    // answers 503 no_healthy_endpoint, so the request is sent again until then.
    let started = Instant::now();
    let text = prompt(70, 3);
    let b = loop {
        let (status, b) =
            http(serving.addrs[0], "/v1/completions", Some(&json!({"prompt": text, "max_tokens": 4}))).await;
        if status == 200 {
            break b;
        }
        let waiting = status == 503 && String::from_utf8_lossy(&b).contains("no_healthy_endpoint");
        assert!(
            waiting && started.elapsed() < Duration::from_secs(10),
            "{status} {}",
            String::from_utf8_lossy(&b)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let ids = qwen3.encode(&text, true).unwrap();
    assert_eq!(answer_text(&b, false, false).0, output_text(&ids, 4));
    assert_eq!(
        decode.engine.stats()["lmcache"]["ranks"][1]["retrieved_chunks"],
        ids.len().div_ceil(16) as u64
    );
    serving.shutdown().await;
    prefill.shutdown().await;
    decode.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Tools in `lmcache` mode: the gateway renders them into the prompt with the model's own template
/// (the prefiller gets the ids of the chat with its tools, as the gateway's tokenizer renders it)
/// and parses the calls out of the decoder's text (`[lmcache] tool_call_parser`); a streamed
/// answer comes in one piece, a well-formed SSE stream. Without a parser the request is refused
/// naming the setting; `tool_choice = "required"` is refused (it needs guided decoding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_are_rendered_into_the_prompt_and_their_calls_parsed() {
    use baton_gateway::api::{Endpoint, GenRequest};
    use baton_gateway::handoff::lmcache::tools::ToolParser;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3");
    let tok = Arc::new(
        baton_gateway::tokenize::Tokenizer::load(
            &dir.join("tokenizer.json"),
            Some(&dir.join("tokenizer_config.json")),
        )
        .expect("run scripts/fetch-tokenizers"),
    );
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let chat = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "max_tokens": 6});
    let setup = |parser| GatewaySetup {
        tokenizer: Some(Arc::clone(&tok)),
        tool_call_parser: parser,
        ..GatewaySetup::default()
    };

    let d = lmcache_demo(1, 64, FaultConfig::default(), setup(None)).await;
    let (s, b) = http(d.addr, "/v1/chat/completions", Some(&chat)).await;
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("tools")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("[lmcache] tool_call_parser"), "{v}");
    d.shutdown().await;

    let d = lmcache_demo(1, 64, FaultConfig::default(), setup(Some(ToolParser::Hermes))).await;
    let (s, b) = http(d.addr, "/v1/chat/completions", Some(&chat)).await;
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["choices"][0]["message"]["content"].is_string(), "no call in the simulator's text: {v}");
    // The prefiller got the chat with its tools, rendered by the model's template.
    let want =
        tok.token_ids(&GenRequest::parse(Endpoint::Chat, chat.to_string().as_bytes()).unwrap()).unwrap();
    let without = tok
        .token_ids(
            &GenRequest::parse(Endpoint::Chat, json!({"messages": chat["messages"]}).to_string().as_bytes())
                .unwrap(),
        )
        .unwrap();
    assert!(want.len() > without.len() + 20, "the template rendered the tools");
    let prefilled = d
        .engines
        .iter()
        .flat_map(|e| e.engine.received().as_array().cloned().unwrap_or_default())
        .find(|r| r["body"]["max_tokens"] == 1 && r["body"].get("kv_transfer_params").is_some());
    let prefilled = prefilled.expect("the prefill leg");
    let got: Vec<u32> = prefilled["body"]["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| u32::try_from(i.as_u64().unwrap()).unwrap())
        .collect();
    assert_eq!(got, want, "the prefiller's ids are the chat with its tools");
    assert!(prefilled["body"].get("tools").is_none(), "tools are not sent to the completions leg");
    // Streamed: one piece, a stream a client can read to [DONE].
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (s, b) = http(d.addr, "/v1/chat/completions", Some(&streamed)).await;
    let text = String::from_utf8_lossy(&b);
    assert_eq!(s, 200, "{text}");
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant", "{text}");
    assert!(events[1]["choices"][0]["delta"]["content"].is_string(), "{text}");
    assert!(events[1]["choices"][0]["finish_reason"].is_string(), "{text}");
    assert!(events.last().unwrap()["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{text}");
    // Forcing a call needs guided decoding.
    let mut forced = chat.clone();
    forced["tool_choice"] = json!("required");
    let (s, b) = http(d.addr, "/v1/chat/completions", Some(&forced)).await;
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("tool_choice")), "{v}");
    assert_lmcache_clean(&d, true).await;
    d.shutdown().await;
}
