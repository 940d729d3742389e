use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_dataplane::readiness::Outcome;
use baton_dataplane::transport::ProducerClient;
use baton_dataplane::{KvGeometry, RankEvent, TerminalState};
use baton_sim::faults::FaultConfig;
use baton_sim::kv::output_text;
use baton_sim::{Running, SimConfig, SimRole, launch, tiny_geometry};
use serde_json::json;
use tokio::task::JoinSet;

use crate::harness::{
    Decoder, Handoff, Job, Limits, assert_decoder_clean, assert_prefill_clean, handoff, http, new_key,
};

const CLEAN: Duration = Duration::from_secs(5);

struct Cluster {
    prefill: Vec<Running>,
    decode: Vec<Running>,
    decoders: Vec<Arc<Decoder>>,
    geometry: KvGeometry,
}

async fn cluster(p: usize, d: usize, tp: u32, pages: u32, tweak: impl Fn(&mut SimConfig)) -> Cluster {
    let geometry = tiny_geometry(tp).unwrap();
    let mut prefill = Vec::new();
    for _ in 0..p {
        let mut c = SimConfig::new(SimRole::Prefill, geometry);
        tweak(&mut c);
        prefill.push(launch(c).await.unwrap());
    }
    let mut decode = Vec::new();
    let mut decoders = Vec::new();
    for _ in 0..d {
        let mut c = SimConfig::new(SimRole::Decode, geometry);
        c.pages = pages;
        tweak(&mut c);
        let r = launch(c).await.unwrap();
        decoders.push(Decoder::connect(r.addr).await);
        decode.push(r);
    }
    Cluster { prefill, decode, decoders, geometry }
}

impl Cluster {
    async fn assert_clean(&self) {
        for d in &self.decode {
            assert_decoder_clean(d.addr, CLEAN).await;
        }
        for p in &self.prefill {
            assert_prefill_clean(p.addr, CLEAN).await;
        }
    }

    async fn shutdown(self) {
        for r in self.prefill.into_iter().chain(self.decode) {
            r.shutdown().await;
        }
    }
}

/// The system prompt the mix's prompts start with (a part of it).
const SYSTEM: &str = "You are baton, a careful assistant for disaggregated serving. ";

/// Prompts that share a system prefix and differ after it, 1 to ~10 chunks long.
fn jobs(n: usize) -> Vec<Job> {
    let system = SYSTEM;
    (0..n)
        .map(|i| Job {
            chat: i % 2 == 0,
            stream: i % 3 == 0,
            text: format!("{}question {i}: {}", &system[..(i * 7) % system.len()], "why? ".repeat(i % 17)),
            max_tokens: 1 + (i % 9) as u32,
            hold: Duration::ZERO,
        })
        .collect()
}

/// How long the leaders keep their KV ready: longer than any mix takes.
const LEADER_HOLD: Duration = Duration::from_secs(5);

async fn run_mix(p: usize, d: usize, tp: u32, requests: usize) {
    // A small buffer (24 pages of 16 tokens) so requests really queue for room.
    let c = cluster(p, d, tp, 24, |_| {}).await;
    // On every decoder, two leaders (a chat and a completion) whose prompt is the whole system
    // prefix hold their KV ready while the mix runs: every full chunk a mix request has in common
    // with its leader must be shared, whatever the timing.
    let mut leaders = JoinSet::new();
    let lead = |chat: bool| Job {
        chat,
        stream: false,
        text: format!("{SYSTEM}and the leader's own question"),
        max_tokens: 1,
        hold: LEADER_HOLD,
    };
    for (i, dec) in c.decoders.iter().enumerate() {
        for chat in [false, true] {
            let (prefill, dec, g, job) = (c.prefill[i % p].addr, Arc::clone(dec), c.geometry, lead(chat));
            leaders.spawn(async move { handoff(prefill, &dec, &g, &job, Limits::default()).await });
        }
    }
    // The leaders' KV is in the buffers well before this.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let chunk = c.geometry.chunk_tokens as usize;
    let mut tasks = JoinSet::new();
    let mut expected = 0;
    for (i, job) in jobs(requests).into_iter().enumerate() {
        let (leader, ids) = (lead(job.chat).ids(), job.ids());
        let common = leader.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        expected += common / chunk * tp as usize;
        let prefill = c.prefill[i % p].addr;
        let dec = Arc::clone(&c.decoders[i % d]);
        let g = c.geometry;
        tasks.spawn(async move {
            let out = handoff(prefill, &dec, &g, &job, Limits::default()).await;
            (job, out)
        });
    }
    let mut ok = 0;
    let mut shared_total = 0;
    while let Some(r) = tasks.join_next().await {
        let (job, out) = r.unwrap();
        let ids = job.ids();
        match out {
            Handoff::Done { status: 200, text, prompt_tokens, completion_tokens, shared } => {
                shared_total += shared;
                assert_eq!(text, output_text(&ids, job.max_tokens), "{job:?}");
                assert_eq!(prompt_tokens, ids.len() as u64, "{job:?}");
                assert_eq!(completion_tokens, u64::from(job.max_tokens), "{job:?}");
                ok += 1;
            }
            other => panic!("{job:?}: {other:?}"),
        }
    }
    assert_eq!(ok, requests);
    assert!(started.elapsed() < LEADER_HOLD, "the mix outlasted the leaders: {:?}", started.elapsed());
    // Shared with the leaders at least; requests of the mix may share with each other on top.
    assert!(expected > 0, "the mix has prefixes in common with its leaders");
    assert!(
        shared_total >= expected,
        "{p}P{d}D TP{tp}: {shared_total} chunks shared, at least {expected} expected"
    );
    while let Some(r) = leaders.join_next().await {
        assert!(matches!(r.unwrap(), Handoff::Done { status: 200, .. }));
    }
    c.assert_clean().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p1d1_tp1_concurrent_requests_sharing_prefixes() {
    run_mix(1, 1, 1, 48).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p1d1_tp2_concurrent_requests_sharing_prefixes() {
    run_mix(1, 1, 2, 48).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2d2_tp1_concurrent_requests_sharing_prefixes() {
    run_mix(2, 2, 1, 48).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2d2_tp2_concurrent_requests_sharing_prefixes() {
    run_mix(2, 2, 2, 48).await;
}

fn long_job() -> Job {
    Job { chat: false, stream: false, text: "x".repeat(16 * 4), max_tokens: 3, hold: Duration::ZERO }
}

/// A request whose KV is READY on the decoder (held there for a second) and a second request with
/// the same prompt: the second shares every full chunk instead of receiving it again, and both
/// decode with byte-exact KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_chunks_are_shared_on_the_decoder() {
    let c = cluster(1, 1, 2, 24, |_| {}).await;
    let text = "shared system prompt, then the question: ".repeat(2); // 82 tokens: 5 full chunks
    let leader =
        Job { chat: false, stream: false, text: text.clone(), max_tokens: 4, hold: Duration::from_secs(1) };
    let follower = Job { hold: Duration::ZERO, ..leader.clone() };
    let (p, d, g) = (c.prefill[0].addr, Arc::clone(&c.decoders[0]), c.geometry);
    let lead = tokio::spawn(async move { handoff(p, &d, &g, &leader, Limits::default()).await });
    // The leader's KV is in the buffer well before this.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = handoff(c.prefill[0].addr, &c.decoders[0], &c.geometry, &follower, Limits::default()).await;
    let ids = follower.ids();
    match out {
        Handoff::Done { status: 200, text, shared, .. } => {
            assert_eq!(text, output_text(&ids, 4));
            assert_eq!(shared, 5 * 2, "every full chunk on both ranks is shared");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(lead.await.unwrap(), Handoff::Done { status: 200, .. }));
    c.assert_clean().await;
    c.shutdown().await;
}

/// Sends the prefill for `key` and returns the task; the orchestration steps are up to the test.
async fn start_prefill(
    prefill: SocketAddr,
    d: &Decoder,
    key: baton_dataplane::RequestKey,
    chunks: u32,
    lease: Duration,
    job: &Job,
) -> tokio::task::JoinHandle<Option<u16>> {
    let addrs = d.reserve(key, chunks, lease).await.unwrap().expect("room");
    let decoders: Vec<_> = addrs
        .iter()
        .enumerate()
        .map(|(r, a)| json!({"rank": r, "addr": d.ranks[r].to_string(), "chunks": a.iter().map(|(c, p)| json!([c, p.page, p.generation])).collect::<Vec<_>>()}))
        .collect();
    let body = json!({"prompt": job.text, "max_tokens": 1, "baton": {"request_id": format!("{:032x}", key.request.0), "epoch": key.epoch, "decoders": decoders}});
    tokio::spawn(async move {
        let stream = tokio::net::TcpStream::connect(prefill).await.ok()?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.ok()?;
        tokio::spawn(conn);
        let req = hyper::Request::post("/v1/completions")
            .header("host", prefill.to_string())
            .body(http_body_util::Full::new(bytes::Bytes::from(body.to_string())))
            .ok()?;
        Some(send.send_request(req).await.ok()?.status().as_u16())
    })
}

async fn next_status(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<RankEvent>,
    within: Duration,
) -> TerminalState {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some(RankEvent::Status(s))) => return s.state,
            Ok(Some(_)) => {}
            _ => panic!("no terminal status within {within:?}"),
        }
    }
}

/// A prefiller process killed (SIGKILL) mid-request: the decoder's lease expires the request, its
/// pages come back after the quarantine, and nothing waits past its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefiller_killed_mid_request() {
    let geometry = tiny_geometry(1).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_baton-sim"))
        .args([
            "--role",
            "prefill",
            "--listen",
            "127.0.0.1:0",
            "--faults",
            r#"{"stall_chunk":2,"stall_ms":60000}"#,
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    tokio::io::AsyncBufReadExt::read_line(&mut out, &mut line).await.unwrap();
    let hello: serde_json::Value = serde_json::from_str(&line).unwrap();
    let prefill: SocketAddr = hello["listen"].as_str().unwrap().parse().unwrap();

    let mut c = SimConfig::new(SimRole::Decode, geometry);
    c.quarantine_ttl = Duration::from_millis(300);
    let dec = launch(c).await.unwrap();
    let d = Decoder::connect(dec.addr).await;
    let key = new_key();
    let mut rx = d.listen(key);
    let lease = Duration::from_millis(1500);
    let started = Instant::now();
    let _req = start_prefill(prefill, &d, key, 4, lease, &long_job()).await;
    // Wait until chunks 0 and 1 landed (the prefiller stalls before chunk 2), then kill it.
    while crate::harness::stats(dec.addr).await["ranks"][0]["pages_filled"] != 2 {
        assert!(started.elapsed() < Duration::from_secs(5), "chunks never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    assert_eq!(next_status(&mut rx, Duration::from_secs(5)).await, TerminalState::Expired);
    assert!(started.elapsed() >= lease, "expired before its lease");
    // Lease 1.5 s + quarantine 0.3 s: all pages back well within the bound.
    assert_decoder_clean(dec.addr, Duration::from_secs(3)).await;
    dec.shutdown().await;
}

/// A READY status that never arrives: the orchestrator's deadline fails the request, its cancel
/// returns every page, and the next request goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_readiness_event_fails_by_deadline_and_cleans_up() {
    let c = cluster(1, 1, 2, 24, |c| {
        if c.role == SimRole::Decode {
            c.faults =
                FaultConfig { drop_ready_rank: Some(1), drop_ready_events: 1, ..FaultConfig::default() };
        }
    })
    .await;
    let limits = Limits { ready_deadline: Duration::from_millis(500), ..Limits::default() };
    let started = Instant::now();
    let out = handoff(c.prefill[0].addr, &c.decoders[0], &c.geometry, &long_job(), limits).await;
    assert!(matches!(out, Handoff::NotReady(Outcome::TimedOut { missing: 1 })), "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "waited past the deadline");
    c.assert_clean().await;
    let out = handoff(c.prefill[0].addr, &c.decoders[0], &c.geometry, &long_job(), Limits::default()).await;
    assert!(matches!(out, Handoff::Done { status: 200, .. }), "{out:?}");
    c.assert_clean().await;
    c.shutdown().await;
}

/// The gateway cancels while chunks are in flight: the prefiller's next write is refused, it
/// fences, the decoder's pages come back at once (not at the 30 s quarantine deadline) and the
/// prefiller's blocks are freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_cancel_mid_transfer() {
    let c = cluster(1, 1, 1, 24, |c| {
        c.quarantine_ttl = Duration::from_secs(30);
        if c.role == SimRole::Prefill {
            c.faults = FaultConfig { stall_chunk: Some(1), stall_ms: 400, ..FaultConfig::default() };
        }
    })
    .await;
    let d = &c.decoders[0];
    let key = new_key();
    let mut rx = d.listen(key);
    let req = start_prefill(c.prefill[0].addr, d, key, 4, Duration::from_secs(20), &long_job()).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    d.cancel(key).await;
    assert_eq!(next_status(&mut rx, Duration::from_secs(2)).await, TerminalState::Cancelled);
    assert_eq!(req.await.unwrap(), Some(502), "the prefill must fail, not report success");
    assert_decoder_clean(c.decode[0].addr, Duration::from_secs(2)).await;
    assert_prefill_clean(c.prefill[0].addr, Duration::from_secs(2)).await;
    c.shutdown().await;
}

/// A crashed decoder rank: reservations fail fast, the surviving rank's pages come back, and the
/// engine reports itself unhealthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_rank_fails_fast() {
    let c = cluster(1, 1, 2, 24, |_| {}).await;
    let (s, _) = http(c.decode[0].addr, "/sim/faults", Some(&json!({"crash_rank": 1}))).await;
    assert_eq!(s, 200);
    let (s, _) = http(c.decode[0].addr, "/health", None).await;
    assert_eq!(s, 503);
    let started = Instant::now();
    let r = c.decoders[0].reserve(new_key(), 2, Duration::from_secs(20)).await;
    assert!(r.is_err(), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    let s = crate::harness::stats(c.decode[0].addr).await;
    assert_eq!(s["ranks"][0]["pages_free"], s["ranks"][0]["pages_total"], "{s}");
    c.shutdown().await;
}

/// KV bytes that are not what the prompt produces: the decoder refuses to generate (a 500 naming
/// the mismatch, never a silent 200) and still frees the pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_kv_is_an_error_never_a_silent_200() {
    let c = cluster(1, 1, 1, 24, |_| {}).await;
    let d = &c.decoders[0];
    let job = long_job();
    let key = new_key();
    let mut rx = d.listen(key);
    let addrs = d.reserve(key, 4, Duration::from_secs(20)).await.unwrap().unwrap();
    let mut p = ProducerClient::connect(d.ranks[0], c.geometry.fingerprint(), 0).await.unwrap();
    for (chunk, addr) in &addrs[0] {
        p.write_chunk(key, *chunk, *addr, &vec![0x5A; c.geometry.page_bytes_per_rank() as usize])
            .await
            .unwrap();
    }
    assert_eq!(next_status(&mut rx, Duration::from_secs(2)).await, TerminalState::Ready);
    let body = json!({"prompt": job.text, "max_tokens": 3, "baton": {"request_id": format!("{:032x}", key.request.0), "epoch": key.epoch}});
    let (status, body) = http(c.decode[0].addr, "/v1/completions", Some(&body)).await;
    assert_eq!(status, 500);
    let msg = String::from_utf8_lossy(&body);
    assert!(msg.contains("kv mismatch on rank 0, chunk 0"), "{msg}");
    assert_decoder_clean(c.decode[0].addr, Duration::from_secs(2)).await;
    c.shutdown().await;
}

/// One slow decoder rank (every chunk written to it takes 30 ms longer): the request still
/// completes with the right tokens, READY from the fast rank simply waits for the slow one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_rank_delays_but_completes() {
    let c = cluster(1, 1, 2, 24, |c| {
        c.faults = FaultConfig { slow_rank: Some(1), slow_ms: 30, ..FaultConfig::default() };
    })
    .await;
    let job = long_job();
    let started = Instant::now();
    let out = handoff(c.prefill[0].addr, &c.decoders[0], &c.geometry, &job, Limits::default()).await;
    match out {
        Handoff::Done { status: 200, text, .. } => assert_eq!(text, output_text(&job.ids(), job.max_tokens)),
        other => panic!("{other:?}"),
    }
    // 4 chunks to the slow rank at 30 ms each, plus its 30 ms consume delay.
    assert!(started.elapsed() >= Duration::from_millis(150), "the slow switch did nothing");
    c.assert_clean().await;
    c.shutdown().await;
}

/// A decoder that never takes the chunks (the prefiller stalls past its hold TTL): the prefiller
/// gives up at the TTL with 504, frees its cache blocks and fences, so the decoder's pages come back
/// at once too. Stranded producer blocks cannot outlive the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_blocks_are_released_at_the_hold_ttl() {
    let c = cluster(1, 1, 1, 24, |c| {
        c.quarantine_ttl = Duration::from_secs(30);
        if c.role == SimRole::Prefill {
            c.hold_ttl = Duration::from_millis(300);
            c.faults = FaultConfig { stall_chunk: Some(1), stall_ms: 10_000, ..FaultConfig::default() };
        }
    })
    .await;
    let d = &c.decoders[0];
    let key = new_key();
    let started = Instant::now();
    let req = start_prefill(c.prefill[0].addr, d, key, 4, Duration::from_secs(20), &long_job()).await;
    assert_eq!(req.await.unwrap(), Some(504));
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
    assert_prefill_clean(c.prefill[0].addr, Duration::from_secs(1)).await;
    // The gateway cancels after the failed prefill; the prefiller's fence already ended the quarantine.
    d.cancel(key).await;
    assert_decoder_clean(c.decode[0].addr, Duration::from_secs(1)).await;
    c.shutdown().await;
}
