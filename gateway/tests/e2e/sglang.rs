//! The `sglang` handoff end to end: simulated engines speaking SGLang's PD fields (`bootstrap_host`,
//! `bootstrap_port`, `bootstrap_room`, `rid`), both legs sent at once, the decoder pulling its room
//! from the prefill's bootstrap server and checking every byte, admission from the decoder's
//! `/metrics`, aborts through `/abort_request`.

use std::time::{Duration, Instant};

use baton_gateway::demo::{Demo, DemoConfig, GatewaySetup, start};
use baton_gateway::handoff::Mode;
use baton_gateway::handoff::scrape::LoadTarget;
use baton_sim::faults::FaultConfig;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use super::{disconnect_storm, four_shapes, http, prompt};

async fn sglang_demo(token_delay: Duration, prefill_faults: FaultConfig) -> Demo {
    start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp: 2,
        token_delay,
        handoff: Mode::Sglang,
        prefill_faults,
        gateway: GatewaySetup {
            nixl: LoadTarget { scrape_interval: Duration::from_millis(20), ..LoadTarget::default() },
            ..GatewaySetup::default()
        },
        ..DemoConfig::default()
    })
    .await
    .unwrap()
}

/// The SGLang side of an engine's stats.
fn sglang(d: &Demo, engine: usize) -> Value {
    d.engines[engine].engine.stats()["sglang"].clone()
}

/// Nothing held anywhere within `within`: no slot, no room on the prefill, no request in flight on
/// either engine.
async fn assert_sglang_clean(d: &Demo, within: Duration) {
    let start = Instant::now();
    loop {
        let slots: u32 = d.gateway.decoders.iter().map(|x| x.queue.stats().in_use).sum();
        let (p, dec) = (sglang(d, 0), sglang(d, 1));
        if slots == 0 && p["rooms_held"] == 0 && p["in_flight"] == 0 && dec["in_flight"] == 0 {
            return;
        }
        assert!(
            start.elapsed() < within,
            "not clean after {within:?}: {slots} slots; prefill {p}; decode {dec}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Completions and chat, streamed and not, with TP 2 on the decode side: every room is paired
/// (the decoder checks every byte it pulled), the answer is the model's with exact usage; `n = 2`
/// sends a room per choice; nothing is held afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_mode_serves_completions_and_chat_streamed_and_not() {
    let d = sglang_demo(Duration::ZERO, FaultConfig::default()).await;
    four_shapes(d.addr, 90, 6, "sglang").await;
    let (s, b) =
        http(d.addr, "/v1/completions", Some(&json!({"prompt": prompt(40, 1), "max_tokens": 3, "n": 2})))
            .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_sglang_clean(&d, Duration::from_secs(5)).await;
    let (p, dec) = (sglang(&d, 0), sglang(&d, 1));
    // Four requests and one with two choices: six rooms, each paired on both sides.
    assert_eq!(
        (dec["paired"].as_u64(), p["paired"].as_u64()),
        (Some(6), Some(6)),
        "prefill {p}; decode {dec}"
    );
    for side in [&p, &dec] {
        assert_eq!((side["unpaired"].as_u64(), side["mismatched"].as_u64()), (Some(0), Some(0)), "{side}");
        assert_eq!(side["abandoned"], 0, "{side}");
        // Every answer ended whole: nothing to abort, and no slot waited out the cancel grace.
        assert_eq!(side["abort_requests"], 0, "{side}");
    }
    let lingered: u64 = d.gateway.decoders.iter().map(|x| x.queue.stats().lingered).sum();
    assert_eq!(lingered, 0, "slots held on after answers that ended whole");
    // The bootstrap port came from the prefill's /get_server_info.
    let (_, v) = http(d.admin, "/admin/decoders", None).await;
    let v: Value = serde_json::from_slice(&v).unwrap();
    let port = p["bootstrap"].as_str().unwrap().rsplit(':').next().unwrap().parse::<u64>().unwrap();
    let learned = &v["decoders"][0]["learned_bootstrap_ports"];
    assert_eq!(learned.as_object().unwrap().values().next().and_then(Value::as_u64), Some(port), "{v}");
    assert_eq!(v["decoders"][0]["handoff"], "sglang");
    d.shutdown().await;
}

/// A prefill that answers 400: the client gets that 400 and the engine's message (not a retryable
/// 502), and the decode leg, which was sent at the same time and waits for its room, is gone within
/// 100 ms; nothing is held afterwards (sglang PR #24159, sglang#9726).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_refusal_reaches_the_client_and_aborts_the_decode_leg() {
    let faults = FaultConfig { fail_status: Some(400), ..FaultConfig::default() };
    let d = sglang_demo(Duration::ZERO, faults).await;
    for stream in [false, true] {
        let body = json!({"prompt": prompt(60, 3), "max_tokens": 5, "stream": stream});
        let (s, b) = http(d.addr, "/v1/completions", Some(&body)).await;
        let answered = Instant::now();
        assert_eq!(s, 400, "stream={stream}: {}", String::from_utf8_lossy(&b));
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains("fail_status"),
            "the engine's own message: {v}"
        );
        // The engine's own type, passed on (the simulator answers errors as vLLM 0.32 does).
        assert_eq!(v["error"]["type"], "BadRequestError", "{v}");
        // The decode leg's slot is held until the abort was answered and the grace after it
        // (`cancel_grace_ms`, 100 ms): the decoder's time to drop the request.
        assert_sglang_clean(&d, Duration::from_millis(100) + baton_gateway::handoff::DEFAULT_CANCEL_GRACE)
            .await;
        eprintln!("stream={stream}: decode leg gone {:?} after the 400", answered.elapsed());
    }
    // Every decode leg that reached the decoder was ended by /abort_request: the clean check above
    // finds none in flight within 100 ms, where one not aborted would wait for its room. How many
    // reached it is timing: one baton dropped before sending it never did (seen under load).
    let dec = sglang(&d, 1);
    eprintln!("{} of 2 decode legs reached the decoder and were aborted", dec["aborted"]);
    assert_eq!(dec["unpaired"], 0, "no decode leg waited out its room: {dec}");
    d.shutdown().await;
}

/// A prefill whose answer comes after the decoder's answer has ended (SGLang's prefiller answers
/// once its KV has gone to the decoder, and that answer may come later still): the client has its
/// answer without waiting for it, and the prefill's time is recorded when it answers, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_answering_after_the_response_ended_is_still_timed() {
    const LATE: Duration = Duration::from_millis(1500);
    let faults = FaultConfig { answer_delay_ms: 1500, ..FaultConfig::default() };
    let d = sglang_demo(Duration::ZERO, faults).await;
    let prefill = |m: &[u8]| {
        let m = String::from_utf8_lossy(m);
        let sample = |name: &str| {
            super::sample_or_zero(&m, &format!("baton_phase_seconds_{name}{{phase=\"prefill\"}} "))
        };
        (sample("count"), sample("sum"))
    };
    // The prefiller holds its answer: it is in flight there until it answers.
    let prefilling = || sglang(&d, 0)["in_flight"] == 1;
    let sent = Instant::now();
    let (s, b) =
        http(d.addr, "/v1/completions", Some(&json!({"prompt": prompt(40, 5), "max_tokens": 3}))).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert!(prefilling(), "the answer waited for the prefill's ({:?})", sent.elapsed());
    let (_, m) = http(d.admin, "/metrics", None).await;
    if prefilling() {
        assert_eq!(prefill(&m).0, 0.0, "timed before the prefill answered");
    }
    loop {
        let (_, m) = http(d.admin, "/metrics", None).await;
        let (count, sum) = prefill(&m);
        if count > 0.0 {
            assert_eq!(count, 1.0);
            assert!(sum >= LATE.as_secs_f64(), "the prefill's whole time: {sum} s");
            break;
        }
        assert!(sent.elapsed() < LATE + Duration::from_secs(5), "the late prefill was never timed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_sglang_clean(&d, Duration::from_secs(1)).await;
    d.shutdown().await;
}

/// A client that leaves mid-stream: `/abort_request` reaches both engines (the decoder's ends the
/// stream there), the slot comes back, nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_aborts_both_legs() {
    let d = sglang_demo(Duration::from_millis(20), FaultConfig::default()).await;
    let addr = d.addr;
    let body = json!({"prompt": prompt(50, 4), "max_tokens": 200, "stream": true});
    // Leaves about 150 ms in: the answer has started and has seconds to go.
    let left =
        tokio::time::timeout(Duration::from_millis(150), http(addr, "/v1/completions", Some(&body))).await;
    assert!(left.is_err(), "the stream should still be running when the client leaves");
    assert_sglang_clean(&d, Duration::from_secs(2)).await;
    let started = Instant::now();
    while sglang(&d, 0)["abort_requests"] != 1 || sglang(&d, 1)["abort_requests"] != 1 {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "/abort_request did not reach both engines: prefill {}, decode {}",
            sglang(&d, 0),
            sglang(&d, 1)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let dec = sglang(&d, 1);
    assert_eq!(dec["aborted"], 1, "the decoder's stream was ended by the abort: {dec}");
    assert_eq!((dec["paired"].as_u64(), dec["unpaired"].as_u64()), (Some(1), Some(0)), "{dec}");
    let (s, b) = http(addr, "/v1/completions", Some(&json!({"prompt": "still here", "max_tokens": 2}))).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    d.shutdown().await;
}

/// 200 clients that leave at random points: no slot, room or in-flight request stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_random_disconnects_leave_nothing_held() {
    let d = sglang_demo(Duration::from_millis(3), FaultConfig::default()).await;
    disconnect_storm(d.addr, |x| 5 + (x % 180) as usize, 40).await;
    assert_sglang_clean(&d, Duration::from_secs(10)).await;
    let (s, _) =
        http(d.addr, "/v1/completions", Some(&json!({"prompt": "still here", "max_tokens": 2}))).await;
    assert_eq!(s, 200);
    d.shutdown().await;
}

/// Admission follows the decoder's SGLang metrics (token usage, reported by each TP rank): closed
/// while it reports 99 %, open again after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_admission_follows_the_decoders_metrics() {
    let d = sglang_demo(Duration::ZERO, FaultConfig::default()).await;
    let decode = d.decode_addrs()[0];
    let (s, _) = http(decode, "/sim/faults", Some(&json!({"report_kv_usage_pct": 99}))).await;
    assert_eq!(s, 200);
    let dec = &d.gateway.decoders[0];
    let started = Instant::now();
    while dec.queue.stats().open {
        assert!(started.elapsed() < Duration::from_secs(2), "admission never closed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (_, m) = http(d.admin, "/metrics", None).await;
    let m = String::from_utf8_lossy(&m);
    // Two TP ranks report 0.99 each: the decoder's usage is 0.99, not their sum.
    assert!(m.contains("baton_decoder_reported_kv_usage{decoder=\"decode-0\",mode=\"sglang\"} 0.99"), "{m}");
    // Closed admits none, not even one request when nothing is in flight: both wait.
    let mut tasks = JoinSet::new();
    for i in 0..2usize {
        let addr = d.addr;
        tasks.spawn(async move {
            let body = json!({"prompt": format!("closed {i}"), "max_tokens": 2});
            let (s, b) = http(addr, "/v1/completions", Some(&body)).await;
            assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        });
    }
    let waited = Instant::now();
    while dec.queue.stats().waiting < 2 {
        assert!(waited.elapsed() < Duration::from_secs(2), "requests did not queue: {:?}", dec.queue.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(dec.queue.stats().in_use, 0, "admitted while the decoder says it is full");
    }
    for e in &d.engines {
        assert_eq!(e.engine.received(), json!([]), "an engine got a request while admission was closed");
    }
    let (s, _) = http(decode, "/sim/faults", Some(&json!({}))).await;
    assert_eq!(s, 200);
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    assert!(dec.queue.stats().open, "admission never reopened");
    assert_eq!(dec.queue.stats().capacity, LoadTarget::default().max_in_flight);
    d.shutdown().await;
}
