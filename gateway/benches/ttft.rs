//! Time to first token in the `lmcache` handoff with and without first token from prefill.
//!
//! `cargo bench -p baton-gateway --bench ttft -- --out bench/gateway-ttft.json`
//!
//! One process on loopback (2 worker threads): the load generator, the gateway and simulated
//! engines speaking LMCache's PD protocol (ZMQ allocation and notifications, TP 2). Each request
//! streams a completion of 8 tokens from a 1,000-token prompt (4 chunks of 256); the engines take
//! `TOKEN_DELAY` per generated token. TTFT is the time from sending the request to the first SSE
//! event that carries text. With `first_token` the prefiller's token is streamed as soon as the
//! prefill returns; without it the first text comes from the decoder, after the hand-off (every
//! rank's notification, the decode request, the decoder retrieving the chunks and producing its
//! first token). The hand-off is measured in the run without first token as TTFT minus the
//! gateway's own `queue` and `prefill` phases (its `Server-Timing` header, sent before the hand-off).
//! `BATON_BENCH_QUICK=1` runs a few requests only.

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

use baton_gateway::demo::{DemoConfig, GatewaySetup, start};
use baton_gateway::handoff::Mode;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;

/// Engine time per generated token (a small model on a fast GPU is a few ms).
const TOKEN_DELAY: Duration = Duration::from_millis(2);

/// `(ttft, total, queue + prefill phases)`.
type Sample = (Duration, Duration, Duration);

fn before_handoff(h: &hyper::HeaderMap) -> Duration {
    let Some(v) = h.get("server-timing").and_then(|v| v.to_str().ok()) else { return Duration::ZERO };
    let ms: f64 = v
        .split(", ")
        .filter_map(|p| p.split_once(";dur="))
        .filter(|(n, _)| *n == "queue" || *n == "prefill")
        .filter_map(|(_, d)| d.parse::<f64>().ok())
        .sum();
    Duration::from_secs_f64(ms / 1e3)
}

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
        let pre = before_handoff(res.headers());
        let mut body = res.into_body();
        let (mut ttft, mut buf) = (None, Vec::new());
        while let Some(f) = body.frame().await {
            let Ok(data) = f.unwrap().into_data() else { continue };
            buf.extend_from_slice(&data);
            if ttft.is_none() {
                let text = String::from_utf8_lossy(&buf);
                let has_text = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).any(|d| {
                    serde_json::from_str::<Value>(d)
                        .ok()
                        .and_then(|v| v["choices"][0]["text"].as_str().map(|s| !s.is_empty()))
                        .unwrap_or(false)
                });
                if has_text {
                    ttft = Some(t.elapsed());
                }
            }
        }
        let total = t.elapsed();
        out.push((ttft.expect("a token"), total, pre));
    }
    out
}

fn p(sorted: &[Duration], q: f64) -> f64 {
    common::percentile(sorted, q).expect("samples").as_secs_f64() * 1e3
}

struct Run {
    first_token: bool,
    concurrency: usize,
    requests: usize,
    ttft: (f64, f64),
    total_p50: f64,
    handoff_p50: Option<f64>,
}

async fn run(first_token: bool, concurrency: usize, per_client: usize) -> Run {
    let demo = start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp: 2,
        pages: 512,
        chunk_tokens: 256,
        token_delay: TOKEN_DELAY,
        handoff: Mode::Lmcache,
        gateway: GatewaySetup { no_first_token: !first_token, ..GatewaySetup::default() },
        ..DemoConfig::default()
    })
    .await
    .unwrap();
    let prompt = "baton passes the kv cache. ".repeat(40);
    let body = Bytes::from(
        json!({"model": "baton-sim", "prompt": &prompt[..1000], "max_tokens": 8, "stream": true}).to_string(),
    );
    let _ = worker(demo.addr, body.clone(), 3).await;
    let handles: Vec<_> =
        (0..concurrency).map(|_| tokio::spawn(worker(demo.addr, body.clone(), per_client))).collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    demo.shutdown().await;
    let mut ttft: Vec<Duration> = all.iter().map(|s| s.0).collect();
    let mut total: Vec<Duration> = all.iter().map(|s| s.1).collect();
    let mut handoff: Vec<Duration> = all.iter().map(|s| s.0.saturating_sub(s.2)).collect();
    ttft.sort();
    total.sort();
    handoff.sort();
    Run {
        first_token,
        concurrency,
        requests: all.len(),
        ttft: (p(&ttft, 0.5), p(&ttft, 0.99)),
        total_p50: p(&total, 0.5),
        handoff_p50: (!first_token).then(|| p(&handoff, 0.5)),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let (n1, n16) = if quick { (5, 1) } else { (400, 25) };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let runs = rt.block_on(async {
        let mut runs = Vec::new();
        for (c, n) in [(1, n1), (16, n16)] {
            runs.push(run(false, c, n).await);
            runs.push(run(true, c, n).await);
        }
        runs
    });
    let mut rows = Vec::new();
    for r in &runs {
        println!(
            "first_token={:<5} c={:<3} {:>5} req  TTFT p50 {:>7.2} ms  p99 {:>7.2} ms  total p50 {:>7.2} ms{}",
            r.first_token,
            r.concurrency,
            r.requests,
            r.ttft.0,
            r.ttft.1,
            r.total_p50,
            r.handoff_p50.map_or(String::new(), |h| format!("  (hand-off p50 {h:.2} ms)"))
        );
        rows.push(format!(
            "    {{\"first_token\": {}, \"concurrency\": {}, \"requests\": {}, \"ttft_p50_ms\": {:.3}, \"ttft_p99_ms\": {:.3}, \"total_p50_ms\": {:.3}, \"handoff_p50_ms\": {}}}",
            r.first_token, r.concurrency, r.requests, r.ttft.0, r.ttft.1, r.total_p50,
            r.handoff_p50.map_or("null".to_owned(), |h| format!("{h:.3}"))
        ));
    }
    for pair in runs.chunks(2) {
        if let [off, on] = pair {
            println!(
                "c={}: TTFT p50 drops by {:.2} ms with first token from prefill; the hand-off it skips is {:.2} ms p50",
                off.concurrency,
                off.ttft.0 - on.ttft.0,
                off.handoff_p50.unwrap_or(f64::NAN)
            );
        }
    }
    if let Some(path) = out {
        let json = format!(
            "{{\n  \"bench\": \"gateway-ttft\",\n  \"quick\": {quick},\n  \"token_delay_ms\": {},\n  \"runs\": [\n{}\n  ]\n}}\n",
            TOKEN_DELAY.as_millis(),
            rows.join(",\n")
        );
        std::fs::write(&path, json).unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        println!("wrote {path}");
    }
}
