//! Flow control end to end: priority bands under a saturating load, sheddable requests, deadlines
//! that pass in the queue, and tenants' token budgets through the official OpenAI SDK.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use baton_gateway::demo::{Demo, DemoConfig, GatewaySetup, start};
use baton_gateway::flow::{Band, BudgetRule, Counts, FlowConfig, TenantRule};
use http_body_util::BodyExt;
use serde_json::{Value, json};

use super::client::{http, send_with};
use super::prompt;

/// Bands `interactive` (10) > `batch` (0, the default) > `scavenger` (-1, sheddable).
fn bands() -> FlowConfig {
    let mut c = FlowConfig::fair(Duration::from_secs(30));
    let band =
        |name: &str, priority| Band { name: name.into(), priority, max_requests: 1024, max_bytes: 64 << 20 };
    c.bands = vec![band("interactive", 10), band("batch", 0), band("scavenger", -1)];
    c.default_band = 1;
    c
}

/// 1P1D native, a PD buffer of 64 pages of 16 tokens (four 256-token prompts at once), prefills
/// of 50 ms: a dozen clients saturate it (few enough not to starve the tests beside it).
async fn fleet(flow: Option<FlowConfig>, tenants: &[(&str, &str)]) -> Demo {
    start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        pages: 64,
        prefix_cache: Some(baton_sim::cache::CacheConfig {
            blocks: 1 << 16,
            block_size: baton_sim::DEFAULT_SIM_BLOCK_SIZE,
            prefill_fixed: Duration::from_millis(50),
            prefill_per_token: Duration::ZERO,
            prefill_lanes: 0,
            events: None,
        }),
        gateway: GatewaySetup {
            flow,
            explain: true,
            tenants: tenants.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            ..GatewaySetup::default()
        },
        ..DemoConfig::default()
    })
    .await
    .unwrap()
}

/// A completion of one token: its status, `Retry-After`, body and how long it took.
async fn complete(
    addr: SocketAddr,
    tokens: usize,
    seed: usize,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, Value, Duration) {
    let t = Instant::now();
    let body = json!({"model": "baton-sim", "prompt": prompt(tokens, seed), "max_tokens": 1});
    let res = send_with(addr, "/v1/completions", Some(&body), headers).await;
    let status = res.status().as_u16();
    let retry = res.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
    let b = res.into_body().collect().await.unwrap().to_bytes();
    (status, retry, serde_json::from_slice(&b).unwrap_or(Value::Null), t.elapsed())
}

/// `clients` closed-loop clients sending prompts of 128 to 383 tokens in the `batch` band until
/// `stop`.
fn saturate(addr: SocketAddr, clients: usize, stop: &Arc<AtomicBool>) -> tokio::task::JoinSet<usize> {
    let mut set = tokio::task::JoinSet::new();
    for c in 0..clients {
        let stop = Arc::clone(stop);
        set.spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                // 128 to 383 tokens: requests of different sizes free their pages at different
                // times, as real ones do (all alike, they free them in waves).
                let tokens = 128 + (c * 37 + n * 101) % 256;
                let (s, ..) =
                    complete(addr, tokens, 100_000 + c * 1000 + n, &[("authorization", "Bearer sk-batch")])
                        .await;
                assert!(s == 200 || s == 503, "a batch request got {s}");
                n += 1;
            }
            n
        });
    }
    set
}

/// p90 of the `interactive` band's latency over `n` sequential one-token requests.
async fn interactive_p90(addr: SocketAddr, n: usize, seed: usize) -> Duration {
    let mut v = Vec::new();
    for i in 0..n {
        let (s, _, b, took) = complete(
            addr,
            256,
            seed + i,
            &[("authorization", "Bearer sk-ui"), ("x-priority", "interactive")],
        )
        .await;
        assert_eq!(s, 200, "{b}");
        v.push(took);
    }
    v.sort();
    v[(v.len() * 9).div_ceil(10) - 1]
}

/// Alone, then beside 16 saturating clients: the interactive band's p90 with flow control stays
/// near its p90 alone, while with the first-come queue (no `[flow]`) it waits behind the load
/// (the same load, measured the same way: the test fails if flow control stops doing its job).
/// Under saturation a sheddable request is refused at once with 429 and `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_band_is_unaffected_by_a_saturating_low_band_and_a_sheddable_one_is_shed() {
    let tenants = [("sk-batch", "batch-team"), ("sk-ui", "ui-team")];
    let mut p90 = BTreeMap::new();
    for with_flow in [true, false] {
        let d = fleet(with_flow.then(bands), &tenants).await;
        // A sheddable request with room goes through.
        let (s, ..) = complete(d.addr, 64, 1, &[("x-priority", "scavenger")]).await;
        assert_eq!(s, 200);
        let alone = interactive_p90(d.addr, 20, 1000).await;
        let stop = Arc::new(AtomicBool::new(false));
        let mut load = saturate(d.addr, 16, &stop);
        tokio::time::sleep(Duration::from_millis(500)).await;
        if with_flow {
            let (_, m) = http(d.admin, "/admin/flow", None).await;
            let v: Value = serde_json::from_slice(&m).unwrap();
            assert!(v["bands"][1]["queued"].as_u64().unwrap() > 0, "the load saturates: {v}");
            for i in 0..5 {
                let (s, retry, b, took) =
                    complete(d.addr, 64, 2000 + i, &[("x-priority", "scavenger")]).await;
                assert_eq!((s, retry.as_deref()), (429, Some("1")), "{b}");
                assert_eq!(b["error"]["code"], "overloaded", "{b}");
                assert!(took < Duration::from_millis(500), "refused at once, not after a wait: {took:?}");
            }
        }
        let loaded = interactive_p90(d.addr, 20, 3000).await;
        if with_flow {
            // The decision record says who the request was to flow control and where it went.
            let body = json!({"model": "baton-sim", "prompt": prompt(256, 5000), "max_tokens": 1});
            let h =
                [("authorization", "Bearer sk-ui"), ("x-priority", "interactive"), ("x-baton-explain", "1")];
            let res = send_with(d.addr, "/v1/completions", Some(&body), &h).await;
            assert_eq!(res.status(), 200);
            let timing = res.headers()["server-timing"].to_str().unwrap().to_owned();
            let rec: Value =
                serde_json::from_str(res.headers()["x-baton-explain"].to_str().unwrap()).unwrap();
            assert_eq!(
                (rec["flow"]["tenant"].as_str(), rec["flow"]["band"].as_str()),
                (Some("ui-team"), Some("interactive")),
                "{rec}"
            );
            assert!(timing.starts_with("flow;dur="), "{timing}");
        }
        stop.store(true, Ordering::Relaxed);
        let mut served = 0;
        while let Some(n) = load.join_next().await {
            served += n.unwrap();
        }
        assert!(served > 50, "the load ran: {served}");
        p90.insert(with_flow, (alone, loaded));
        if with_flow {
            let (_, m) = http(d.admin, "/metrics", None).await;
            let m = String::from_utf8_lossy(&m);
            let shed =
                super::sample_or_zero(&m, "baton_flow_refused_total{band=\"scavenger\",reason=\"shed\"} ");
            assert_eq!(shed, 5.0, "{m}");
            assert!(super::sample_or_zero(&m, "baton_flow_dispatched_total{band=\"interactive\"} ") >= 40.0);
        }
        super::assert_clean(&d).await;
        if with_flow {
            flow_clean(&d).await;
        }
        d.shutdown().await;
    }
    let (alone, loaded) = p90[&true];
    let (fifo_alone, fifo_loaded) = p90[&false];
    eprintln!(
        "interactive p90: flow {alone:?} alone, {loaded:?} loaded; first-come {fifo_alone:?} alone, {fifo_loaded:?} loaded"
    );
    assert!(
        loaded <= alone * 2 + Duration::from_millis(60),
        "the interactive band waited behind the batch band: p90 {loaded:?} loaded against {alone:?} alone"
    );
    assert!(
        fifo_loaded > loaded * 2,
        "without flow control the same load should delay it: first-come p90 {fifo_loaded:?}, flow {loaded:?}"
    );
}

/// Nothing waits in flow control and no tenant has a request in flight (charges all settled).
async fn flow_clean(d: &Demo) {
    let started = Instant::now();
    loop {
        let (_, b) = http(d.admin, "/admin/flow", None).await;
        let v: Value = serde_json::from_slice(&b).unwrap();
        let busy = v["tenants"].as_array().unwrap().iter().any(|t| t["in_flight"] != 0 || t["queued"] != 0);
        if v["queued"] == 0 && !busy {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "flow control still holds requests: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A request whose deadline passes while it waits is answered 504 `deadline_exceeded` and no
/// engine ever receives it; the gateway's own longest wait still answers 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_passing_in_the_queue_is_answered_and_never_sent() {
    let d = fleet(Some(bands()), &[]).await;
    // One prompt of the whole buffer, stalled 1.5 s in its prefill: nothing else fits meanwhile.
    let faults = json!({"stall_chunk": 0, "stall_ms": 1500});
    let (s, _) = http(d.engines[0].addr, "/sim/faults", Some(&faults)).await;
    assert_eq!(s, 200);
    let blocker = tokio::spawn(complete(d.addr, 1024, 7, &[]));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let marker = prompt(64, 424_242);
    let body = json!({"model": "baton-sim", "prompt": &marker, "max_tokens": 1});
    let t = Instant::now();
    let res = send_with(d.addr, "/v1/completions", Some(&body), &[("x-request-deadline", "300")]).await;
    let status = res.status().as_u16();
    let b: Value = serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let took = t.elapsed();
    assert_eq!(status, 504, "{b}");
    assert_eq!(b["error"]["code"], "deadline_exceeded", "{b}");
    assert!(b["error"]["message"].as_str().unwrap().contains("x-request-deadline"), "{b}");
    assert!(took >= Duration::from_millis(300) && took < Duration::from_millis(1200), "{took:?}");
    let (s, ..) = blocker.await.unwrap();
    assert_eq!(s, 200);
    // Neither engine saw it.
    let (_, faults_off) = http(d.engines[0].addr, "/sim/faults", Some(&json!({}))).await;
    assert!(!faults_off.is_empty());
    for addr in [d.engines[0].addr, d.decode_addrs()[0]] {
        let (_, seen) = http(addr, "/sim/received", None).await;
        let seen = String::from_utf8_lossy(&seen);
        assert!(!seen.contains(&marker[..40]), "an engine received the expired request");
        assert!(seen.contains("request 7: "), "the engine lists what it received: {seen:.200}");
    }
    let (_, m) = http(d.admin, "/metrics", None).await;
    let m = String::from_utf8_lossy(&m);
    assert_eq!(
        super::sample_or_zero(&m, "baton_flow_refused_total{band=\"batch\",reason=\"deadline\"} "),
        1.0
    );
    super::assert_clean(&d).await;
    flow_clean(&d).await;
    d.shutdown().await;
}

/// A tenant over its tokens-per-minute budget is refused with 429, a message naming the budget
/// and `Retry-After`, as the official OpenAI SDK sees it (`RateLimitError`); another tenant is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_budget_is_refused_naming_it_through_the_openai_sdk() {
    let mut flow = bands();
    let rule = BudgetRule { tokens_per_minute: 300, counts: Counts::Total };
    flow.tenants.insert("metered".into(), TenantRule { budget: Some(rule), ..TenantRule::default() });
    let d = fleet(Some(flow), &[("sk-metered", "metered"), ("sk-other", "other")]).await;
    let script = r#"
import json, sys, openai
base = sys.argv[1]
out = {}
def ask(key, n):
    c = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    try:
        r = c.completions.with_raw_response.create(model="baton-sim", prompt="x" * n, max_tokens=20)
        return {"status": r.status_code, "usage": r.parse().usage.total_tokens}
    except openai.RateLimitError as e:
        return {"status": e.status_code, "type": type(e).__name__, "message": e.message,
                "retry_after": e.response.headers.get("retry-after"), "code": e.code}
out["first"] = ask("sk-metered", 200)
out["second"] = ask("sk-metered", 100)
out["other"] = ask("sk-other", 200)
print(json.dumps(out))
"#;
    let out = tokio::process::Command::new(super::real_tokenizers::python())
        .arg("-c")
        .arg(script)
        .arg(format!("http://{}/v1", d.addr))
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["first"]["status"], 200, "{v}");
    let used = v["first"]["usage"].as_u64().unwrap();
    assert!((200..300).contains(&used), "{v}");
    let second = &v["second"];
    assert_eq!(
        (second["status"].as_u64(), second["type"].as_str()),
        (Some(429), Some("RateLimitError")),
        "{v}"
    );
    assert_eq!(second["code"], "rate_limit_exceeded", "{v}");
    let msg = second["message"].as_str().unwrap();
    assert!(msg.contains("\"metered\"") && msg.contains("300 tokens per minute (input + output)"), "{msg}");
    // The first held its input and max_tokens, and was charged what it used: 300 - used left;
    // the second must find its 100 + 20; the bucket refills 5 a second.
    let retry: u64 = second["retry_after"].as_str().unwrap().parse().unwrap();
    let want = (120 - (300 - used as i64)) as f64 / 5.0;
    assert!((retry as f64 - want.ceil()).abs() <= 1.0, "retry after {retry} s, expected about {want}: {v}");
    assert_eq!(v["other"]["status"], 200, "{v}");
    let (_, f) = http(d.admin, "/admin/flow", None).await;
    let f: Value = serde_json::from_slice(&f).unwrap();
    let metered = f["tenants"].as_array().unwrap().iter().find(|t| t["tenant"] == "metered").unwrap();
    assert_eq!(metered["budget"]["refused"], 1, "{f}");
    flow_clean(&d).await;
    d.shutdown().await;
}
