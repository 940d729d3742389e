//! Loopback load benchmark: the gateway (full native PD handoff) next to the same request sent
//! straight to the simulated decoder (no PD), at concurrency 1 and 64, ~1 KB prompts.
//!
//! `cargo bench -p baton-gateway --bench load -- --out bench/gateway-load.json`
//!
//! Everything runs in this one process on loopback (2 worker threads): the load generator, the
//! gateway and the simulated prefill and decode engines share the machine's cores. Each client keeps
//! one HTTP/1.1 connection. "direct" is a plain completion on the decode engine; "gateway" adds the
//! whole handoff: admission, reservation on the decoder's data plane, the prefill engine deriving
//! and writing 4 KV chunks (256 tokens each, TP 1), readiness, the decode engine verifying and
//! scattering them, then the same generation. `BATON_BENCH_QUICK=1` runs a few requests only.
//! `BATON_BENCH_TRACE=RATIO` traces that share of the requests (0 to 1), exported as OTLP/HTTP to a
//! collector stand-in in the same process that reads each export and answers 200.

#![allow(
    clippy::print_stdout,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation
)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use baton_gateway::demo::{DemoConfig, start};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpStream;

struct Run {
    name: String,
    concurrency: usize,
    requests: usize,
    seconds: f64,
    p50_us: f64,
    p99_us: f64,
    /// Through the gateway: p50 of the time spent outside the engines' prefill and decode legs.
    own_p50_us: Option<f64>,
    /// Through the gateway: p50 of each `Server-Timing` phase, µs.
    phases_p50_us: Vec<(String, f64)>,
}

/// Each `Server-Timing` phase, µs.
fn phases(h: &hyper::HeaderMap) -> Vec<(String, f64)> {
    let Some(v) = h.get("server-timing").and_then(|v| v.to_str().ok()) else { return Vec::new() };
    v.split(", ")
        .filter_map(|part| {
            let (name, dur) = part.split_once(";dur=")?;
            Some((name.to_owned(), dur.parse::<f64>().ok()? * 1e3))
        })
        .collect()
}

/// Milliseconds the engines' legs took, from the gateway's `Server-Timing` header.
fn engine_ms(h: &hyper::HeaderMap) -> Option<f64> {
    let v = h.get("server-timing")?.to_str().ok()?;
    let mut sum = 0.0;
    for part in v.split(", ") {
        let (name, dur) = part.split_once(";dur=")?;
        if name == "prefill" || name == "decode" {
            sum += dur.parse::<f64>().ok()?;
        }
    }
    Some(sum)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    common::percentile(sorted, p).expect("samples").as_secs_f64() * 1e6
}

type Sample = (Duration, Option<Duration>, Vec<(String, f64)>);

async fn worker(addr: SocketAddr, body: Bytes, n: usize) -> Vec<Sample> {
    let stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let req = Request::post("/v1/completions")
            .header("host", "bench")
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))
            .unwrap();
        send.ready().await.unwrap();
        let t = Instant::now();
        let res = send.send_request(req).await.unwrap();
        assert_eq!(res.status(), 200);
        let engines = engine_ms(res.headers());
        let ph = phases(res.headers());
        let _ = res.into_body().collect().await.unwrap();
        let total = t.elapsed();
        out.push((total, engines.map(|ms| total.saturating_sub(Duration::from_secs_f64(ms / 1e3))), ph));
    }
    out
}

async fn load(name: &str, addr: SocketAddr, concurrency: usize, per_client: usize) -> Run {
    let prompt = "baton passes the kv cache. ".repeat(40);
    let body =
        Bytes::from(json!({"model": "baton-sim", "prompt": &prompt[..1024], "max_tokens": 1}).to_string());
    // Warm-up: connections, pools, first touches.
    let _ = worker(addr, body.clone(), 5).await;
    let t = Instant::now();
    let handles: Vec<_> =
        (0..concurrency).map(|_| tokio::spawn(worker(addr, body.clone(), per_client))).collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    let seconds = t.elapsed().as_secs_f64();
    let mut totals: Vec<Duration> = all.iter().map(|(t, _, _)| *t).collect();
    totals.sort();
    let mut own: Vec<Duration> = all.iter().filter_map(|(_, o, _)| *o).collect();
    own.sort();
    let mut phases_p50_us = Vec::new();
    if let Some((_, _, first)) = all.first() {
        for (i, (name, _)) in first.iter().enumerate() {
            let mut v: Vec<Duration> = all
                .iter()
                .filter_map(|(_, _, p)| p.get(i).map(|(_, us)| Duration::from_secs_f64(us / 1e6)))
                .collect();
            v.sort();
            phases_p50_us.push((name.clone(), pct(&v, 0.5)));
        }
    }
    let own_p50_us = (!own.is_empty()).then(|| pct(&own, 0.5));
    Run {
        name: name.into(),
        concurrency,
        requests: totals.len(),
        seconds,
        p50_us: pct(&totals, 0.5),
        p99_us: pct(&totals, 0.99),
        own_p50_us,
        phases_p50_us,
    }
}

/// Exports the collector stand-in received, and their bytes.
static EXPORTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static EXPORTED_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// An OTLP/HTTP collector stand-in: reads each export whole and answers 200.
async fn collector() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                    let body = req.into_body().collect().await?.to_bytes();
                    EXPORTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    EXPORTED_BYTES.fetch_add(body.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    Ok::<_, hyper::Error>(hyper::Response::new(Full::new(Bytes::new())))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let (n1, n64) = if quick { (10, 2) } else { (1000, 40) };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let runs = rt.block_on(async move {
        let mut config = DemoConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            pages: 512,
            chunk_tokens: 256,
            ..DemoConfig::default()
        };
        if let Some(ratio) = std::env::var("BATON_BENCH_TRACE").ok().and_then(|r| r.parse::<f64>().ok()) {
            config.gateway.trace = Some(baton_gateway::telemetry::trace::TraceConfig {
                endpoint: format!("http://{}", collector().await),
                sampling_ratio: ratio,
                service_name: "baton-bench".into(),
            });
            println!("tracing {ratio} of the requests");
        }
        let demo = start(config).await.unwrap();
        let direct = demo.decode_addrs()[0];
        let mut runs = Vec::new();
        for (c, n) in [(1, n1), (64, n64)] {
            runs.push(load("direct to decoder", direct, c, n).await);
            runs.push(load("through the gateway", demo.addr, c, n).await);
        }
        demo.shutdown().await;
        let exports = EXPORTS.load(std::sync::atomic::Ordering::Relaxed);
        if exports > 0 {
            let bytes = EXPORTED_BYTES.load(std::sync::atomic::Ordering::Relaxed);
            println!("the collector received {exports} exports, {bytes} bytes of spans");
        }
        runs
    });
    let mut rows = Vec::new();
    for r in &runs {
        let rps = r.requests as f64 / r.seconds;
        let mut own =
            r.own_p50_us.map_or(String::new(), |o| format!("  (outside the engines' legs: p50 {o:.0} µs)"));
        if !r.phases_p50_us.is_empty() {
            let ph: Vec<String> = r.phases_p50_us.iter().map(|(n, us)| format!("{n} {us:.0}")).collect();
            own.push_str(&format!("\n{:<31}phase p50s, µs: {}", "", ph.join(", ")));
        }
        println!(
            "{:<22} c={:<3} {:>6} req  {:>9.0} req/s  p50 {:>8.0} µs  p99 {:>8.0} µs{own}",
            r.name, r.concurrency, r.requests, rps, r.p50_us, r.p99_us
        );
        rows.push(format!(
            "    {{\"name\": \"{}\", \"concurrency\": {}, \"requests\": {}, \"seconds\": {:.4}, \"rps\": {:.1}, \"p50_us\": {:.1}, \"p99_us\": {:.1}, \"own_p50_us\": {}, \"phases_p50_us\": {{{}}}}}",
            r.name, r.concurrency, r.requests, r.seconds, rps, r.p50_us, r.p99_us, r.own_p50_us.map_or("null".to_owned(), |o| format!("{o:.1}")),
            r.phases_p50_us.iter().map(|(n, us)| format!("\"{n}\": {us:.1}")).collect::<Vec<_>>().join(", ")
        ));
    }
    for pair in runs.chunks(2) {
        if let [d, g] = pair {
            println!(
                "added by the gateway at c={}: p50 {:.0} µs, p99 {:.0} µs",
                d.concurrency,
                g.p50_us - d.p50_us,
                g.p99_us - d.p99_us
            );
        }
    }
    if let Some(path) = out {
        let json = format!(
            "{{\n  \"bench\": \"gateway-load\",\n  \"quick\": {quick},\n  \"runs\": [\n{}\n  ]\n}}\n",
            rows.join(",\n")
        );
        std::fs::write(&path, json).unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        println!("wrote {path}");
    }
}
