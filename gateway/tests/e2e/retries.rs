//! Retries and circuit breakers, on the demo's simulated engines: a leg that failed before anything
//! depended on it (the engine refused the connection, or answered 503) runs again on another
//! engine within the retry budget; the failing engine's breaker opens, turns half-open and closes
//! again; and nothing is ever retried once a byte of the answer reached the client.

use baton_gateway::demo::GatewaySetup;
use baton_gateway::handoff::Mode;
use baton_gateway::routing::retry::RetryConfig;
use baton_gateway::routing::{Builtin, HealthConfig};
use http_body_util::BodyExt;

use super::*;

/// Two prefillers and two decoders of `mode`, routed in turn, with passive health and retries as
/// given (the active health check too slow to matter). In `sglang` mode every token takes 30 ms,
/// so a prefill answers after a decoder's refusal, as SGLang's prefill answers only once its KV
/// went to a decoder (a decoder's 503 after the prefill answered is never retried).
async fn pairs(mode: Mode, eject_after_failures: u32, eject_for: Duration, retries: RetryConfig) -> Demo {
    let health = HealthConfig {
        eject_after_failures,
        eject_for,
        check_interval: Duration::from_secs(3600),
        retries,
        ..HealthConfig::default()
    };
    start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        prefills: 2,
        decoders: 2,
        handoff: mode,
        token_delay: if mode == Mode::Sglang { Duration::from_millis(30) } else { Duration::ZERO },
        // A nixl producer's blocks for a decoder that was never reached are drained through that
        // decoder, which fails while it is down: the producer's own timeout frees them.
        nixl_abort_timeout: Duration::from_secs(1),
        gateway: GatewaySetup { routing: Builtin::RoundRobin, health, ..GatewaySetup::default() },
        ..DemoConfig::default()
    })
    .await
    .unwrap()
}

/// Retries without a budget to speak of and without backoff, so only the engines decide.
fn generous() -> RetryConfig {
    RetryConfig {
        min_per_second: 1000,
        backoff: Duration::ZERO,
        backoff_max: Duration::ZERO,
        ..RetryConfig::default()
    }
}

/// Engine `i` of the demo (prefillers first, then decoders): the generation requests it received.
fn received(d: &Demo, i: usize) -> u64 {
    d.engines[i].engine.stats()["generation_requests"].as_u64().unwrap()
}

async fn faults(d: &Demo, i: usize, f: Value) {
    assert_eq!(http(d.engines[i].addr, "/sim/faults", Some(&f)).await.0, 200);
}

async fn metrics(d: &Demo) -> String {
    String::from_utf8(http(d.admin, "/metrics", None).await.1.to_vec()).unwrap()
}

/// `/admin/engines`' entry for the engine named `name`.
async fn engine(d: &Demo, name: &str) -> Value {
    let (s, b) = http(d.admin, "/admin/engines", None).await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_slice(&b).unwrap();
    v["engines"].as_array().unwrap().iter().find(|e| e["name"] == name).cloned().unwrap()
}

async fn complete(d: &Demo, i: usize) -> (u16, String) {
    let body = json!({"prompt": prompt(40, i), "max_tokens": 3});
    let (s, b) = http(d.addr, "/v1/completions", Some(&body)).await;
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// Slots and the engines' held KV all back (every mode's own accounting).
async fn settled(d: &Demo) {
    let start = Instant::now();
    loop {
        let slots: u32 = d.gateway.decoders.iter().map(|x| x.queue.stats().in_use).sum();
        let held: u64 = d
            .engines
            .iter()
            .map(|e| {
                let s = e.engine.stats();
                s["nixl"]["blocks_held"].as_u64().unwrap_or(0) + s["running"].as_u64().unwrap_or(0)
            })
            .sum();
        if slots == 0 && held == 0 {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "slots {slots}, engines' held {held}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A decoder that answers 503 and then one that refuses connections: every request is served by
/// the other decoder, the failing one's breaker opens after 3 failures (no request reaches it while
/// open), turns half-open when the span ends, and a good probe closes it.
async fn a_failing_decoder_is_retried_around_and_its_breaker_cycles(mode: Mode) {
    // Open long enough for the requests below on any machine; the test waits for half-open.
    let d = pairs(mode, 3, Duration::from_secs(3), generous()).await;
    let (dec0, dec1) = (2, 3);
    faults(&d, dec1, json!({"fail_status": 503})).await;
    let mut records = Vec::new();
    for i in 0..12 {
        let id = format!("retried-{i}");
        let body = json!({"prompt": prompt(40, i), "max_tokens": 3});
        let resp = client::send_with(d.addr, "/v1/completions", Some(&body), &[("x-request-id", &id)]).await;
        assert_eq!(resp.status(), 200, "{mode:?} request {i}");
        assert!(resp.headers()["x-baton-route"].to_str().unwrap().ends_with("decode=decode-0"));
        let (_, r) = http(d.admin, &format!("/admin/requests/{id}"), None).await;
        records.push(serde_json::from_slice::<Value>(&r).unwrap());
    }
    // Each retried request's decision record says where and why.
    let retried: Vec<&Value> = records.iter().filter_map(|r| r.get("retries")).collect();
    assert_eq!(retried.len(), 3, "{records:?}");
    for r in retried {
        assert_eq!(r[0]["leg"], "decode", "{r}");
        assert_eq!(r[0]["engine"], "decode-1", "{r}");
        assert!(r[0]["error"].as_str().unwrap().contains("503"), "{r}");
    }
    // Round robin sent it every other request until its third 503 opened the breaker.
    assert_eq!(received(&d, dec1), 3, "{mode:?}: no request reaches an open breaker's engine");
    assert_eq!(received(&d, dec0), 12, "{mode:?}: the rest, and each retry, on decoder-0");
    let m = metrics(&d).await;
    for line in [
        "baton_retries_total{leg=\"decode\"} 3",
        "baton_endpoint_breaker{endpoint=\"decode-1\",pool=\"decode\",state=\"open\"} 1",
        "baton_endpoint_breaker{endpoint=\"decode-1\",pool=\"decode\",state=\"closed\"} 0",
        "baton_endpoint_breaker{endpoint=\"decode-0\",pool=\"decode\",state=\"closed\"} 1",
        "baton_endpoint_ejections_total{endpoint=\"decode-1\",pool=\"decode\"} 1",
        "baton_retries_denied_total{leg=\"decode\",why=\"budget\"} 0",
    ] {
        assert!(m.contains(line), "{mode:?}: {line} in\n{m}");
    }
    let e = engine(&d, "decode-1").await;
    assert_eq!(e["breaker"], "open", "{e}");
    assert!(e["open_for_ms"].as_u64().unwrap() > 0, "{e}");
    // The span ends: half-open. The engine is mended; the next request that is offered it probes
    // it, and the probe's success closes the breaker.
    let t = Instant::now();
    while engine(&d, "decode-1").await["breaker"] != "half_open" {
        assert!(t.elapsed() < Duration::from_secs(6), "{mode:?}: never half-open");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    faults(&d, dec1, json!({})).await;
    let before = received(&d, dec1);
    for i in 0..4 {
        assert_eq!(complete(&d, 100 + i).await.0, 200);
    }
    assert!(received(&d, dec1) > before, "{mode:?}: the half-open engine was probed");
    assert_eq!(engine(&d, "decode-1").await["breaker"], "closed");

    // Now it refuses connections: the requests it was routed still succeed, on decoder-0.
    let dead = d.engines[dec1].addr;
    let mut d = d;
    d.engines.remove(dec1).shutdown().await;
    for i in 0..6 {
        let (s, b) = complete(&d, 200 + i).await;
        assert_eq!(s, 200, "{mode:?} request {i} with decode-1 down: {b}");
    }
    assert!(tokio::net::TcpStream::connect(dead).await.is_err(), "decode-1 refuses connections");
    let m = metrics(&d).await;
    assert!(
        m.contains("baton_endpoint_breaker{endpoint=\"decode-1\",pool=\"decode\",state=\"open\"} 1"),
        "{mode:?}: {m}"
    );
    settled(&d).await;
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_decode_retried_around_a_failing_decoder() {
    a_failing_decoder_is_retried_around_and_its_breaker_cycles(Mode::VllmNixl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_decode_retried_around_a_failing_decoder() {
    a_failing_decoder_is_retried_around_and_its_breaker_cycles(Mode::Sglang).await;
}

/// A prefiller that refuses connections is skipped in every mode; one that answers 503 is skipped
/// where its refusal cannot have moved KV (vllm-nixl, sglang: the decoder pulls, and nothing was
/// pulled from a refusal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefiller_is_retried_around_in_every_mode() {
    for mode in [Mode::Native, Mode::Lmcache, Mode::VllmNixl, Mode::Sglang] {
        let mut d = pairs(mode, 1000, Duration::from_secs(60), generous()).await;
        if matches!(mode, Mode::VllmNixl | Mode::Sglang) {
            faults(&d, 1, json!({"fail_status": 503})).await;
            for i in 0..6 {
                let (s, b) = complete(&d, i).await;
                assert_eq!(s, 200, "{mode:?} request {i}, prefill-1 answering 503: {b}");
            }
            assert_eq!(received(&d, 1), 3, "{mode:?}: every other request tried prefill-1 first");
            let m = metrics(&d).await;
            assert!(m.contains("baton_retries_total{leg=\"prefill\"} 3"), "{mode:?}: {m}");
            faults(&d, 1, json!({})).await;
        }
        d.engines.remove(1).shutdown().await;
        for i in 0..6 {
            let (s, b) = complete(&d, 100 + i).await;
            assert_eq!(s, 200, "{mode:?} request {i}, prefill-1 down: {b}");
        }
        settled(&d).await;
        d.shutdown().await;
    }
}

/// SGLang's decoder can fail before the prefill leg it depends on: here a decoder refuses the
/// request (500) at once, and the prefiller's refusal (503, before any KV work) comes 100 ms later.
/// The decoder cannot have generated anything without that prefill's KV, so the request runs
/// again without that prefiller (the decoder's failure used to end it: a 502, whenever a refusing
/// or unreachable prefiller lost the race with the decoder that could not bootstrap from it).
/// The failure is the prefiller's, not the decoder's: with breakers opening at the first failure,
/// the prefiller's opens and the decoder's stays closed (one prefiller down used to count against
/// the decoders bootstrapping from it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_decoder_failing_before_its_refusing_prefiller_runs_again() {
    let d = pairs(Mode::Sglang, 1, Duration::from_secs(60), generous()).await;
    assert_eq!(complete(&d, 0).await.0, 200);
    // Round robin: the next request goes to the prefiller and the decoder this one did not.
    let prefill = if received(&d, 0) == 1 { 1 } else { 0 };
    let decoder = if received(&d, 2) == 1 { 3 } else { 2 };
    faults(&d, prefill, json!({"fail_status": 503, "fail_delay_ms": 100})).await;
    faults(&d, decoder, json!({"fail_status": 500, "fail_requests": 1})).await;
    let (s, b) = complete(&d, 1).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(received(&d, prefill), 1, "the refusing prefiller was tried");
    // (It may take the request again: its one refusal is spent.)
    assert!(received(&d, decoder) >= 1, "the refusing decoder was tried");
    let m = metrics(&d).await;
    assert!(m.contains("baton_retries_total{leg=\"prefill\"} 1"), "{m}");
    let ejections = |pool: &str| -> f64 {
        let pool = format!("pool=\"{pool}\"");
        m.lines()
            .filter(|l| l.starts_with("baton_endpoint_ejections_total{") && l.contains(&pool))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    assert_eq!(ejections("prefill"), 1.0, "{m}");
    assert_eq!(ejections("decode"), 0.0, "the decoder was blamed for its prefiller's refusal:\n{m}");
    faults(&d, prefill, json!({})).await;
    settled(&d).await;
    d.shutdown().await;
}

/// Retries are bounded by the budget: with no floor and a quarter of recent requests, a decoder
/// that always answers 503 (and whose breaker never opens) costs the clients the requests the
/// budget could not retry, each a 502 naming the 503, and each counted as denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_stay_within_the_budget() {
    let budget = RetryConfig { min_per_second: 0, budget_ratio: 0.25, ..generous() };
    let d = pairs(Mode::VllmNixl, 1000, Duration::from_secs(60), budget).await;
    faults(&d, 3, json!({"fail_status": 503})).await;
    let (mut ok, mut failed) = (0u32, 0u32);
    for i in 0..20 {
        match complete(&d, i).await {
            (200, _) => ok += 1,
            (502, b) => {
                assert!(b.contains("503"), "{b}");
                failed += 1;
            }
            (s, b) => panic!("{s}: {b}"),
        }
    }
    let m = metrics(&d).await;
    let retried = plugins::metric(&m, "baton_retries_total{leg=\"decode\"} ");
    let denied = plugins::metric(&m, "baton_retries_denied_total{leg=\"decode\",why=\"budget\"} ");
    // Half the 20 went to decode-1 first; a quarter of 20 at most could be retried.
    assert_eq!(received(&d, 3), 10);
    assert!((1.0..=5.0).contains(&retried), "retried {retried}\n{m}");
    assert_eq!(f64::from(failed), denied, "every request the budget did not retry failed, and only those");
    assert_eq!(f64::from(ok), 10.0 + retried);
    assert_eq!(ok + failed, 20);
    let v: Value = serde_json::from_slice(&http(d.admin, "/admin/engines", None).await.1).unwrap();
    assert_eq!(v["retries"]["window_requests"], 20, "{v}");
    assert_eq!(v["retries"]["window_retries"].as_f64(), Some(retried), "{v}");
    settled(&d).await;
    d.shutdown().await;
}

/// A decoder that crashes mid-stream: the client has its first tokens and then the failure, and
/// the request is not run again anywhere (the other decoder receives nothing, no retry is
/// counted), whatever the budget would allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_retried_after_the_first_streamed_byte() {
    for mode in [Mode::VllmNixl, Mode::Sglang, Mode::Native] {
        let d = pairs(mode, 1000, Duration::from_secs(60), generous()).await;
        for dec in [2, 3] {
            faults(&d, dec, json!({"cut_stream_after": 2})).await;
        }
        let body = json!({"prompt": prompt(40, 7), "max_tokens": 12, "stream": true});
        let resp = client::send(d.addr, "/v1/completions", Some(&body)).await;
        assert_eq!(resp.status(), 200, "{mode:?}");
        let mut body = resp.into_body();
        let mut got = Vec::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => got.extend_from_slice(f.data_ref().map_or(&[][..], |b| &b[..])),
                Err(_) => break,
            }
        }
        let text = String::from_utf8_lossy(&got);
        let chunks = text.matches("\"text\":").count();
        assert!(chunks >= 2, "{mode:?}: the first tokens reached the client: {text}");
        assert!(!text.contains("[DONE]"), "{mode:?}: the stream did not end well: {text}");
        assert_eq!(received(&d, 2) + received(&d, 3), 1, "{mode:?}: one decode, never a second: {text}");
        let m = metrics(&d).await;
        assert!(m.contains("baton_retries_total{leg=\"decode\"} 0"), "{mode:?}: {m}");
        settled(&d).await;
        d.shutdown().await;
    }
}
