//! The `vllm-nixl` handoff end to end: simulated engines speaking vLLM's NIXL connector fields
//! (`kv_transfer_params` with `do_remote_decode` / `do_remote_prefill` and the `remote_*` fields
//! the producer returns), the decoder pulling the KV, admission from the decoder's `/metrics`.

use std::time::{Duration, Instant};

use baton_gateway::demo::{Demo, DemoConfig, GatewaySetup, start};
use baton_gateway::handoff::Mode;
use baton_gateway::handoff::scrape::LoadTarget as NixlTarget;
use serde_json::json;
use tokio::task::JoinSet;

use super::{disconnect_storm, drains, four_shapes, http, prompt};

async fn nixl_demo(token_delay: Duration, target: NixlTarget) -> Demo {
    start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp: 2,
        token_delay,
        handoff: Mode::VllmNixl,
        gateway: GatewaySetup { nixl: target, ..GatewaySetup::default() },
        ..DemoConfig::default()
    })
    .await
    .unwrap()
}

fn fast_scrape() -> NixlTarget {
    NixlTarget { scrape_interval: Duration::from_millis(20), ..NixlTarget::default() }
}

/// The producers' blocks (held for remote decodes) and the gateway's slots all come back.
async fn assert_nixl_clean(d: &Demo, within: Duration) {
    let start = Instant::now();
    loop {
        let slots: u32 = d.gateway.decoders.iter().map(|x| x.queue.stats().in_use).sum();
        let held: u64 =
            d.engines.iter().map(|e| e.engine.stats()["nixl"]["blocks_held"].as_u64().unwrap_or(0)).sum();
        if slots == 0 && held == 0 {
            return;
        }
        assert!(
            start.elapsed() < within,
            "not clean after {within:?}: {slots} slots, {held} producer blocks held; drains sent {}; {}",
            drains(d, "vllm-nixl", "sent").await,
            d.engines[0].engine.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Completions and chat, streamed and not: the decoder pulls and verifies every byte, the answer is
/// the model's, usage is right, and the producer frees its blocks as soon as they are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_nixl_mode_serves_completions_and_chat_streamed_and_not() {
    let d = nixl_demo(Duration::ZERO, fast_scrape()).await;
    four_shapes(d.addr, 90, 6, "vllm-nixl").await;
    assert_nixl_clean(&d, Duration::from_secs(5)).await;
    let prefill = d.engines[0].engine.stats();
    assert_eq!(prefill["nixl"]["read"], 4, "every transfer read by the decoder: {prefill}");
    assert_eq!(drains(&d, "vllm-nixl", "sent").await, 0.0);
    // Every answer ended whole, so no slot waited out the cancel grace (an answer of known length
    // ends with its last frame: hyper polls no further).
    let lingered: u64 = d.gateway.decoders.iter().map(|x| x.queue.stats().lingered).sum();
    assert_eq!(lingered, 0, "slots held on after answers that ended whole");
    d.shutdown().await;
}

/// While the decoder's metrics say its KV cache is full, new requests queue (none gets through:
/// the engine would only preempt); once the decoder recovers, they all complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_nixl_admission_follows_the_decoders_metrics() {
    let d = nixl_demo(Duration::from_millis(10), fast_scrape()).await;
    let decode = d.decode_addrs()[0];
    let (s, _) = http(decode, "/sim/faults", Some(&json!({"report_kv_usage_pct": 99}))).await;
    assert_eq!(s, 200);
    let dec = &d.gateway.decoders[0];
    let started = Instant::now();
    while dec.queue.stats().open {
        assert!(started.elapsed() < Duration::from_secs(2), "admission never closed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut tasks = JoinSet::new();
    for i in 0..6usize {
        let addr = d.addr;
        tasks.spawn(async move {
            let (s, b) =
                http(addr, "/v1/completions", Some(&json!({"prompt": prompt(30, i), "max_tokens": 10})))
                    .await;
            assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        });
    }
    let mut most_waiting = 0;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let st = dec.queue.stats();
        assert_eq!(st.in_use, 0, "admitted {} while the decoder is full", st.in_use);
        most_waiting = most_waiting.max(st.waiting);
    }
    assert_eq!(most_waiting, 6, "requests did not queue: at most {most_waiting} waiting");
    let (_, m) = http(d.admin, "/metrics", None).await;
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains("baton_decoder_admitting{decoder=\"decode-0\",mode=\"vllm-nixl\"} 0"), "{m}");
    assert!(
        m.contains("baton_decoder_reported_kv_usage{decoder=\"decode-0\",mode=\"vllm-nixl\"} 0.99"),
        "{m}"
    );
    let (s, _) = http(decode, "/sim/faults", Some(&json!({}))).await;
    assert_eq!(s, 200);
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    assert_eq!(dec.queue.stats().capacity, NixlTarget::default().max_in_flight);
    let (_, m) = http(d.admin, "/metrics", None).await;
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains("baton_decoder_admitting{decoder=\"decode-0\",mode=\"vllm-nixl\"} 1"), "{m}");
    assert_nixl_clean(&d, Duration::from_secs(5)).await;
    d.shutdown().await;
}

/// A decoder whose `/metrics` cannot be read counts as full once what it said last is older than
/// the staleness rule allows (five intervals, at least a second), and admits again once it is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_decoder_metrics_count_as_full_until_read_again() {
    let d = nixl_demo(Duration::ZERO, fast_scrape()).await;
    let decode = d.decode_addrs()[0];
    let dec = &d.gateway.decoders[0];
    assert!(dec.queue.stats().open);
    let (s, _) = http(decode, "/sim/faults", Some(&json!({"metrics_status": 503}))).await;
    assert_eq!(s, 200);
    let started = Instant::now();
    while dec.queue.stats().open {
        assert!(started.elapsed() < Duration::from_secs(3), "stale metrics never closed admission");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let closed_after = started.elapsed();
    assert!(closed_after >= Duration::from_millis(900), "one failed read is not stale yet: {closed_after:?}");
    let (_, m) = http(d.admin, "/metrics", None).await;
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains("baton_decoder_metrics_stale{decoder=\"decode-0\",mode=\"vllm-nixl\"} 1"), "{m}");
    let addr = d.addr;
    let waiter = tokio::spawn(async move {
        http(addr, "/v1/completions", Some(&json!({"prompt": "wait for fresh news", "max_tokens": 2}))).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(dec.queue.stats().in_use, 0, "admitted on stale metrics");
    let (s, _) = http(decode, "/sim/faults", Some(&json!({}))).await;
    assert_eq!(s, 200);
    let (s, b) = waiter.await.unwrap();
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let (_, m) = http(d.admin, "/metrics", None).await;
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains("baton_decoder_metrics_stale{decoder=\"decode-0\",mode=\"vllm-nixl\"} 0"), "{m}");
    d.shutdown().await;
}

/// 200 clients that leave at random points, many right after their prefill: no slot stays held,
/// and no producer block outlives the gateway's own deadline (the producer's own timeout is 480 s:
/// only the gateway's drains can free them this fast).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_nixl_random_disconnects_leave_no_producer_blocks_held() {
    let d = nixl_demo(Duration::from_millis(3), fast_scrape()).await;
    disconnect_storm(d.addr, |x| 5 + (x % 180) as usize, 40).await;
    assert_nixl_clean(&d, Duration::from_secs(10)).await;
    assert_eq!(drains(&d, "vllm-nixl", "failed").await, 0.0);
    eprintln!("{} drains for abandoned requests", drains(&d, "vllm-nixl", "sent").await);
    let (s, _) =
        http(d.addr, "/v1/completions", Some(&json!({"prompt": "still here", "max_tokens": 2}))).await;
    assert_eq!(s, 200);
    d.shutdown().await;
}

/// A prefiller that is not a NIXL producer (its answer carries no `kv_transfer_params` for a remote
/// decode: a plain engine, or vLLM started without `kv_role = kv_producer`) is named in the
/// client's error; the decoder is never asked and the slot comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefiller_that_is_not_a_nixl_producer_is_named_in_the_error() {
    use baton_sim::{SimConfig, SimRole, launch, tiny_geometry};
    let mut plain = SimConfig::new(SimRole::Prefill, tiny_geometry(1).unwrap());
    plain.listen = "127.0.0.1:0".parse().unwrap();
    let plain = launch(plain).await.unwrap();
    let mut dc = SimConfig::new(SimRole::Decode, tiny_geometry(1).unwrap());
    dc.listen = "127.0.0.1:0".parse().unwrap();
    dc.nixl = Some(Duration::from_secs(30));
    let decode = launch(dc).await.unwrap();
    let dir = std::env::temp_dir().join(format!("baton-nixl-plain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("baton.toml");
    std::fs::write(
        &file,
        format!(
            "{}\n[[prefill]]\nname = \"p\"\nurl = \"http://{}\"\n\n[[decode]]\nname = \"d\"\nurl = \"http://{}\"\n\
             handoff = \"vllm-nixl\"\nnixl = {{ scrape_interval_ms = 50, max_in_flight = 4 }}\n",
            super::SERVE_HEAD,
            plain.addr,
            decode.addr
        ),
    )
    .unwrap();
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    let body = json!({"model": "baton-sim", "prompt": prompt(20, 1), "max_tokens": 4});
    let (status, answer) = http(serving.addrs[0], "/v1/completions", Some(&body)).await;
    let text = String::from_utf8_lossy(&answer);
    assert_eq!(status, 502, "{text}");
    assert!(text.contains("is the prefiller a NIXL kv_producer?"), "{text}");
    let start = Instant::now();
    while serving.gateway.decoders.iter().map(|x| x.queue.stats().in_use).sum::<u32>() > 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "the slot never came back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A decode refused after the prefill kept the prompt's blocks. When the decoder itself refuses
/// (its own error answer), it tells the producer to free the blocks, as vLLM 0.32 does, and baton
/// sends no drain (a drain would pull blocks the producer may already have reused). When something
/// in front of the decoder refuses (plain text: a proxy), nobody told the producer, and baton's
/// drain frees the blocks at once instead of leaving them to the producer's timeout (30 s here).
/// Either way the client gets the refusal naming the decode leg. Real vLLM: `tests/vllm.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_decode_frees_the_producers_blocks_once() {
    // A long grace, so the slot's time is told apart from the drain's.
    let grace = Duration::from_secs(1);
    let d = start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp: 2,
        handoff: Mode::VllmNixl,
        gateway: GatewaySetup {
            nixl: fast_scrape(),
            limits: baton_gateway::handoff::Limits { cancel_grace: grace, ..Default::default() },
            ..GatewaySetup::default()
        },
        ..DemoConfig::default()
    })
    .await
    .unwrap();
    let decode = d.decode_addrs()[0];
    // (the decoder's own refusal, drains baton sends)
    for (i, (plain, expected)) in [(false, 0.0), (true, 1.0)].into_iter().enumerate() {
        let faults = json!({"fail_status": 503, "fail_requests": 1, "fail_plain": plain});
        assert_eq!(http(decode, "/sim/faults", Some(&faults)).await.0, 200);
        let body = json!({"prompt": prompt(90, i), "max_tokens": 4, "min_tokens": 2});
        let (s, b) = http(d.addr, "/v1/completions", Some(&body)).await;
        let refused = Instant::now();
        let text = String::from_utf8_lossy(&b);
        assert_eq!(s, 502, "plain={plain}: {text}");
        assert!(text.contains("503"), "plain={plain}: {text}");
        assert_nixl_clean(&d, Duration::from_secs(5)).await;
        if plain {
            // The drain waited the grace (the decoder may have begun the call the proxy
            // refused), then gave the slot back as its own answer ended, not a grace later.
            let back = refused.elapsed();
            assert!(
                back >= grace && back < grace * 2 - Duration::from_millis(300),
                "slot back after {back:?}"
            );
        }
        let sent = drains(&d, "vllm-nixl", "sent").await;
        assert_eq!(sent, expected, "plain={plain}: drains sent");
    }
    let nixl_stats = d.engines[0].engine.stats()["nixl"].clone();
    assert_eq!(
        (nixl_stats["released"].as_u64(), nixl_stats["read"].as_u64()),
        (Some(1), Some(1)),
        "{nixl_stats}"
    );
    assert_eq!(drains(&d, "vllm-nixl", "failed").await, 0.0);
    // The drain after the proxy's refusal (the decoder may have begun the call) waited the grace
    // first, once; its slot went back when its own answer ended, not the grace after (a real
    // vLLM's refusal right after a drain found it still held in CI).
    let lingered: u64 = d.gateway.decoders.iter().map(|x| x.queue.stats().lingered).sum();
    assert_eq!(lingered, 1, "the drain's slot held the grace other than once, before the drain");
    d.shutdown().await;
}

/// A client that leaves while the decoder runs its request: the slot is held `cancel_grace_ms`
/// more, until the engine noticed and let the request go, so the next request never makes the
/// decoder run more than its `max_in_flight` (the faulted soak saw a decoder of 8 run 9 before
/// the grace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_request_keeps_its_slot_until_the_engine_lets_it_go() {
    let target = NixlTarget { max_in_flight: 1, ..fast_scrape() };
    let d = nixl_demo(Duration::from_millis(2), target).await;
    let decode = d.engines.iter().find(|e| e.engine.stats()["role"] == "decode").unwrap();
    for i in 0..10 {
        // 30 tokens at 2 ms: the engine runs ~60 ms; its client leaves after 25 ms, and the
        // engine only notices once its answer is done (within the grace).
        let body = json!({"prompt": prompt(40, i), "max_tokens": 30});
        let left =
            tokio::time::timeout(Duration::from_millis(25), http(d.addr, "/v1/completions", Some(&body)));
        assert!(left.await.is_err(), "answered within 25 ms: the test proves nothing");
        let (s, _) =
            http(d.addr, "/v1/completions", Some(&json!({"prompt": prompt(40, 100 + i), "max_tokens": 2})))
                .await;
        assert_eq!(s, 200);
    }
    let stats = decode.engine.stats();
    assert_eq!(stats["peak_running"], 1, "the decoder ran more than its one slot: {stats}");
    let lingered: u64 = d.gateway.decoders.iter().map(|x| x.queue.stats().lingered).sum();
    assert!(lingered >= 10, "{lingered} slots held on after their clients left");
    assert_nixl_clean(&d, Duration::from_secs(5)).await;
    d.shutdown().await;
}
