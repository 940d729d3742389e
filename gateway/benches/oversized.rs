//! Huge prompts beside small ones: what 3.6 MB completion prompts far beyond the context (the
//! issue's "lorem ipsum " × 300,000 against a 512-token model) cost the gateway, and what they cost
//! the small requests served beside them.
//!
//! `cargo bench -p baton-gateway --features demo --bench oversized -- --out bench/gateway-oversized.json`
//! (after `scripts/fetch-tokenizers`, which `scripts/test` runs).
//!
//! One process on loopback (2 worker threads): the gateway with Llama 3.1's real tokenizer and a
//! 512-token context in front of simulated native engines, and the clients. Four clients send
//! small completions (about 60 tokens, 4 generated) one after another on their own connections,
//! first alone, then while 16 huge prompts are sent at once (each on its own connection) every
//! second of the window. Reported: the small requests' p50 and p99 in both runs and their ratio, and each
//! huge prompt's time to its 400. `BATON_BENCH_QUICK=1` runs a short window.

#![allow(
    clippy::print_stdout,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_precision_loss,
    unreachable_pub
)]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use baton_gateway::demo::{DemoConfig, GatewaySetup, start};
use baton_gateway::tokenize::Tokenizer;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpStream;

use common::percentile;

const SMALL_CLIENTS: usize = 4;
const BURST: usize = 16;
/// A burst of [`BURST`] huge prompts at once, every this often.
const BURST_EVERY: Duration = Duration::from_secs(1);

/// Sends `body` on one connection until `stop`, returning each request's latency; every answer
/// must have status `want`.
async fn client(addr: std::net::SocketAddr, body: Bytes, stop: Arc<AtomicBool>) -> Vec<Duration> {
    let stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut out = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let req = Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))
            .unwrap();
        let t = Instant::now();
        let res = send.send_request(req).await.unwrap();
        let status = res.status().as_u16();
        let _ = res.into_body().collect().await.unwrap();
        out.push(t.elapsed());
        assert_eq!(status, 200);
    }
    out
}

/// One huge prompt on its own connection: the time to its 400.
async fn once(addr: std::net::SocketAddr, body: Bytes) -> Duration {
    let t = Instant::now();
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let req = Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    assert_eq!(res.status(), 400);
    let _ = res.into_body().collect().await.unwrap();
    t.elapsed()
}

/// The small clients for `window`, with `huge` bursts beside them when given; the small requests'
/// sorted latencies and the huge ones'.
async fn run(
    addr: std::net::SocketAddr,
    window: Duration,
    huge: Option<Bytes>,
) -> (Vec<Duration>, Vec<Duration>) {
    let stop = Arc::new(AtomicBool::new(false));
    let small = Bytes::from(
        json!({"prompt": "The baton passes between the ranks. ".repeat(8), "max_tokens": 4}).to_string(),
    );
    let smalls: Vec<_> =
        (0..SMALL_CLIENTS).map(|_| tokio::spawn(client(addr, small.clone(), Arc::clone(&stop)))).collect();
    let mut h: Vec<Duration> = Vec::new();
    let end = Instant::now() + window;
    let mut next = Instant::now() + BURST_EVERY / 2;
    while next < end {
        tokio::time::sleep_until(next.into()).await;
        if let Some(body) = &huge {
            let burst: Vec<_> = (0..BURST).map(|_| tokio::spawn(once(addr, body.clone()))).collect();
            for t in burst {
                h.push(t.await.unwrap());
            }
        }
        next += BURST_EVERY;
    }
    tokio::time::sleep_until(end.into()).await;
    stop.store(true, Ordering::Relaxed);
    let mut s: Vec<Duration> = Vec::new();
    for t in smalls {
        s.extend(t.await.unwrap());
    }
    s.sort();
    h.sort();
    (s, h)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let window = if quick { Duration::from_millis(1500) } else { Duration::from_secs(20) };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/llama3_1");
    let tok = Tokenizer::load(&dir.join("tokenizer.json"), Some(&dir.join("tokenizer_config.json")))
        .expect("run scripts/fetch-tokenizers first");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let d = start(DemoConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            gateway: GatewaySetup {
                tokenizer: Some(Arc::new(tok)),
                context_length: Some(512),
                ..GatewaySetup::default()
            },
            ..DemoConfig::default()
        })
        .await
        .unwrap();
        let huge = Bytes::from(json!({"prompt": "lorem ipsum ".repeat(300_000), "max_tokens": 1}).to_string());
        let (alone, _) = run(d.addr, window, None).await;
        let (beside, huge_lat) = run(d.addr, window, Some(huge)).await;
        let (p50a, p99a) = (common::ms(percentile(&alone, 0.5)), common::ms(percentile(&alone, 0.99)));
        let (p50b, p99b) = (common::ms(percentile(&beside, 0.5)), common::ms(percentile(&beside, 0.99)));
        let (h50, h99) = (common::ms(percentile(&huge_lat, 0.5)), common::ms(percentile(&huge_lat, 0.99)));
        println!(
            "small alone: n={} p50 {p50a:.2} ms p99 {p99a:.2} ms | beside {BURST} huge at once: n={} p50 {p50b:.2} ms p99 {p99b:.2} ms (p99 ×{:.2})",
            alone.len(),
            beside.len(),
            p99b / p99a
        );
        println!("huge (3.6 MB, refused 400): n={} p50 {h50:.2} ms p99 {h99:.2} ms", huge_lat.len());
        if let Some(path) = out {
            let v = json!({
                "bench": "oversized", "window_s": window.as_secs_f64(), "small_clients": SMALL_CLIENTS, "burst": BURST,
                "small_alone": {"n": alone.len(), "p50_ms": p50a, "p99_ms": p99a},
                "small_beside_huge": {"n": beside.len(), "p50_ms": p50b, "p99_ms": p99b, "p99_ratio": p99b / p99a},
                "huge": {"n": huge_lat.len(), "p50_ms": h50, "p99_ms": h99},
            });
            std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap() + "\n").unwrap();
        }
        d.shutdown().await;
    });
}
