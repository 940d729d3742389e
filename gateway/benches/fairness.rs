//! Fair share between tenants: flow control (`[flow]`, VTC inside one band) against the first-come
//! queue baton had before it (no `[flow]`), on the same saturated simulated fleet.
//!
//! ```text
//! cargo bench -p baton-gateway --features demo --bench fairness -- --out bench/gateway-fairness.json
//! (a relative `--out` is from the workspace's root)
//! ```
//!
//! One process on loopback: the load generator, the gateway (in process, `baton demo`'s wiring)
//! and 1P1D simulated engines in the `native` mode. The decoder's PD buffer holds `PAGES` pages of
//! 16 tokens: `PAGES × 16 / PROMPT_TOKENS` (8) prompts at once, each holding its pages through
//! its prefill (`PREFILL_FIXED` + `PREFILL_PER_TOKEN` per token, about 200 ms, as a prompt of a
//! few thousand tokens on a busy GPU) until the decoder took its KV; the decoder then takes
//! `TOKEN_DELAY` per output token. So the fleet serves about 40 requests a second, and no more.
//! Two tenants of equal weight (two bearer tokens named in `[admission.tenants]`) send streamed
//! completions of `OUTPUT_TOKENS` output tokens: `light` of `PROMPT_TOKENS` prompt tokens, `heavy`
//! of half to one and a half times that (spread evenly; the same mean), all distinct.
//!
//! - **Latency (open loop).** `light` sends Poisson arrivals at `LIGHT_RATE`, `heavy` at ten times
//!   that: together more than the fleet serves, so `heavy`'s backlog grows while it sends. The
//!   light tenant's TTFT (to the first SSE event with text) p50/p90, measured over requests sent
//!   after the first `WARMUP`: alone; beside heavy with flow control; beside heavy without.
//! - **Service (closed loop, both backlogged).** `heavy` keeps `HEAVY_CLIENTS` requests
//!   outstanding, `light` a tenth of that: both always have requests waiting. Service is VTC's
//!   measure, input tokens + 2 × output tokens, counted by the client for every request answered
//!   inside the window (after `WARMUP`, until the senders stop), and, with flow control, by the
//!   gateway itself from `/admin/flow` (what it charged each tenant) between the window's ends.
//!   VTC's bound (Sheng et al., OSDI '24, Theorem 4.4) for two continuously backlogged clients
//!   is `2 × max(w_in × L_in, w_out × M)`, `L_in` the longest prompt, `M` the output tokens in flight at once; here a request
//!   holds its pages until its prompt is in the decoder and then decodes, so at most every
//!   request in flight (`IN_FLIGHT_BOUND`) decodes at once, and `M = IN_FLIGHT_BOUND ×
//!   OUTPUT_TOKENS`.
//!
//! `BATON_BENCH_QUICK=1`: 3 s runs, five of them (the suite's smoke run: 27 s in all on 2 cores).

#![allow(
    clippy::print_stdout,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss,
    clippy::cast_sign_loss,
    unreachable_pub
)]

#[path = "../../tests/support/http.rs"]
mod client;
mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use baton_gateway::demo::{Demo, DemoConfig, GatewaySetup, start};
use baton_gateway::flow::FlowConfig;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::net::TcpStream;

const PAGES: u32 = 256;
const PROMPT_TOKENS: usize = 512;
const OUTPUT_TOKENS: u64 = 32;
const PREFILL_FIXED: Duration = Duration::from_millis(20);
const PREFILL_PER_TOKEN: Duration = Duration::from_micros(350);
const TOKEN_DELAY: Duration = Duration::from_millis(2);
const LIGHT_RATE: f64 = 4.0;
const HEAVY_CLIENTS: usize = 100;
const WARMUP: Duration = Duration::from_secs(2);
/// Requests in flight at most (both tenants' closed-loop clients): VTC's `M` in requests.
const IN_FLIGHT_BOUND: u64 = (HEAVY_CLIENTS + HEAVY_CLIENTS / 10) as u64;

/// One answered request: who sent it, when (from the run's start), its TTFT, when it ended, its
/// service (input + 2 × output).
#[derive(Clone, Copy, Debug)]
struct Done {
    light: bool,
    sent: Duration,
    ttft: Duration,
    ended: Duration,
    service: u64,
    /// Its wait in flow control (`Server-Timing: flow`), when it waited there.
    flow_wait: Duration,
}

async fn fleet(flow: bool) -> Demo {
    start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        pages: PAGES,
        token_delay: TOKEN_DELAY,
        prefix_cache: Some(baton_sim::cache::CacheConfig {
            blocks: 1 << 20,
            block_size: baton_sim::DEFAULT_SIM_BLOCK_SIZE,
            prefill_fixed: PREFILL_FIXED,
            prefill_per_token: PREFILL_PER_TOKEN,
            prefill_lanes: 0,
            events: None,
        }),
        gateway: GatewaySetup {
            flow: flow.then(|| FlowConfig::fair(Duration::from_secs(120))),
            tenants: [("sk-light", "light"), ("sk-heavy", "heavy")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            limits: baton_gateway::handoff::Limits {
                queue_timeout: Duration::from_secs(120),
                ..baton_gateway::handoff::Limits::default()
            },
            ..GatewaySetup::default()
        },
        ..DemoConfig::default()
    })
    .await
    .unwrap()
}

/// A streamed completion: TTFT and the output tokens counted from the stream.
async fn request(addr: SocketAddr, light: bool, seq: u64, start: Instant) -> Option<Done> {
    let tag = if light { "light" } else { "heavy" };
    let head = format!("{tag} {seq}: ");
    // The heavy tenant's prompts spread over half to one and a half times the light one's (a
    // fixed spread by sequence number), as real prompts do; the mean is the same.
    let tokens = if light {
        PROMPT_TOKENS
    } else {
        PROMPT_TOKENS / 2 + (seq.wrapping_mul(7919) % (PROMPT_TOKENS as u64 + 1)) as usize
    };
    let prompt: String = head.chars().chain("the baton passes. ".chars().cycle()).take(tokens).collect();
    let body = json!({"model": "baton-sim", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "stream": true,
                      "stream_options": {"include_usage": true}});
    let stream = TcpStream::connect(addr).await.ok()?;
    stream.set_nodelay(true).ok()?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(conn);
    let req = Request::post("/v1/completions")
        .header("host", "bench")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer sk-{tag}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let sent = start.elapsed();
    let t = Instant::now();
    let res = send.send_request(req).await.ok()?;
    if res.status() != 200 {
        return None;
    }
    let flow_wait = res
        .headers()
        .get("server-timing")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(", ").find_map(|p| p.strip_prefix("flow;dur=")))
        .and_then(|d| d.parse::<f64>().ok())
        .map_or(Duration::ZERO, |ms| Duration::from_secs_f64(ms / 1e3));
    let mut body = res.into_body();
    let (mut ttft, mut buf) = (None, Vec::new());
    while let Some(f) = body.frame().await {
        let Ok(data) = f.ok()?.into_data() else { continue };
        buf.extend_from_slice(&data);
        if ttft.is_none() && String::from_utf8_lossy(&buf).contains("\"text\":\"") {
            ttft = Some(t.elapsed());
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let usage = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64())?;
    Some(Done {
        light,
        sent,
        ttft: ttft?,
        ended: start.elapsed(),
        service: tokens as u64 + 2 * usage,
        flow_wait,
    })
}

/// Open loop: `light` at `LIGHT_RATE`, `heavy` at ten times that (or not at all), for `secs`.
async fn open_loop(addr: SocketAddr, heavy: bool, secs: Duration) -> Vec<Done> {
    let start = Instant::now();
    let mut rng = StdRng::seed_from_u64(7);
    let rate = LIGHT_RATE * if heavy { 11.0 } else { 1.0 };
    let mut at = 0.0;
    let mut tasks = tokio::task::JoinSet::new();
    let mut seq = 0u64;
    while at < secs.as_secs_f64() {
        at += -(1.0 - rng.random::<f64>()).ln() / rate;
        // One in eleven arrivals is the light tenant's: light at LIGHT_RATE, heavy at ten times it.
        let light = !heavy || rng.random_range(0..11) == 0;
        tokio::time::sleep_until(tokio::time::Instant::from_std(start + Duration::from_secs_f64(at))).await;
        seq += 1;
        tasks.spawn(request(addr, light, seq, start));
    }
    let mut out = Vec::new();
    while let Some(r) = tasks.join_next().await {
        out.extend(r.unwrap());
    }
    out
}

/// Closed loop: `HEAVY_CLIENTS` heavy clients and a tenth as many light ones, each sending its
/// next request when its last is answered, for `secs`; with flow control, `/admin/flow` is read
/// at the window's ends.
async fn closed_loop(d: &Demo, secs: Duration, flow: bool) -> (Vec<Done>, Option<(Value, Value)>) {
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..HEAVY_CLIENTS + HEAVY_CLIENTS / 10 {
        let (addr, stop) = (d.addr, Arc::clone(&stop));
        let light = c >= HEAVY_CLIENTS;
        tasks.spawn(async move {
            let mut out = Vec::new();
            let mut seq = (c as u64) << 32;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                out.extend(request(addr, light, seq, start).await);
            }
            out
        });
    }
    tokio::time::sleep(WARMUP).await;
    let read = |admin: SocketAddr| async move {
        let (_, body) = client::http(admin, "/admin/flow", None).await;
        serde_json::from_slice::<Value>(&body).unwrap()
    };
    let first = if flow { Some(read(d.admin).await) } else { None };
    tokio::time::sleep(secs.saturating_sub(WARMUP)).await;
    let views = match first {
        Some(first) => Some((first, read(d.admin).await)),
        None => None,
    };
    stop.store(true, Ordering::Relaxed);
    let mut out = Vec::new();
    while let Some(r) = tasks.join_next().await {
        out.extend(r.unwrap());
    }
    (out, views)
}

/// Light TTFT p50/p90, the count, and its wait in flow control p50/p90, over requests sent after
/// the warmup.
fn light_ttft(done: &[Done]) -> (f64, f64, usize, f64, f64) {
    let light = || done.iter().filter(|d| d.light && d.sent >= WARMUP);
    let mut v: Vec<Duration> = light().map(|d| d.ttft).collect();
    let mut w: Vec<Duration> = light().map(|d| d.flow_wait).collect();
    v.sort();
    w.sort();
    let p = |v: &[Duration], q| common::ms(common::percentile(v, q));
    (p(&v, 0.5), p(&v, 0.9), v.len(), p(&w, 0.5), p(&w, 0.9))
}

/// Service per tenant `(light, heavy)` from the requests answered in `[WARMUP, end]`.
fn service(done: &[Done], end: Duration) -> (u64, u64) {
    let inside = done.iter().filter(|d| d.ended >= WARMUP && d.ended <= end);
    inside.fold((0, 0), |(l, h), d| if d.light { (l + d.service, h) } else { (l, h + d.service) })
}

/// The gateway's own service per tenant between two `/admin/flow` views.
fn gateway_service(first: &Value, last: &Value) -> (u64, u64) {
    let get = |v: &Value, t: &str| {
        let e = v["tenants"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["tenant"] == t))
            .cloned()
            .unwrap_or_default();
        e["served_input_tokens"].as_u64().unwrap_or(0) + 2 * e["served_output_tokens"].as_u64().unwrap_or(0)
    };
    (get(last, "light") - get(first, "light"), get(last, "heavy") - get(first, "heavy"))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let secs = Duration::from_secs(if quick { 3 } else { 15 });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let bound = 2 * (PROMPT_TOKENS as u64 * 3 / 2).max(2 * IN_FLIGHT_BOUND * OUTPUT_TOKENS);
    let json = rt.block_on(async {
        let mut latency = Vec::new();
        for (name, flow, heavy) in [("light alone", false, false), ("flow control", true, true), ("first-come", false, true)] {
            let d = fleet(flow).await;
            let done = open_loop(d.addr, heavy, secs).await;
            let (p50, p90, n, w50, w90) = light_ttft(&done);
            let heavy_n = done.iter().filter(|d| !d.light).count();
            println!(
                "latency  {name:<13} light TTFT p50 {p50:>8.1} ms  p90 {p90:>8.1} ms  ({n} light, {heavy_n} heavy answered){}",
                if flow { format!("; its wait in flow control p50 {w50:.1} ms, p90 {w90:.1} ms") } else { String::new() }
            );
            latency.push(json!({"run": name, "light_ttft_p50_ms": p50, "light_ttft_p90_ms": p90,
                                "light_requests": n, "heavy_requests": heavy_n,
                                "light_flow_wait_p50_ms": flow.then_some(w50), "light_flow_wait_p90_ms": flow.then_some(w90)}));
            d.shutdown().await;
        }
        let alone = latency[0]["light_ttft_p90_ms"].as_f64().unwrap();
        for l in &latency[1..] {
            let p90 = l["light_ttft_p90_ms"].as_f64().unwrap();
            println!("         {:<13} light p90 is {:.2}× its p90 alone (target ≤ 1.5× with flow control)", l["run"].as_str().unwrap(), p90 / alone);
        }
        let mut fairness = Vec::new();
        for (name, flow) in [("flow control", true), ("first-come", false)] {
            let d = fleet(flow).await;
            let (done, views) = closed_loop(&d, secs, flow).await;
            let (l, h) = service(&done, secs);
            let gw = views.as_ref().map(|(a, b)| gateway_service(a, b));
            let diff = l.abs_diff(h);
            println!(
                "service  {name:<13} light {l:>8}  heavy {h:>8}  |diff| {diff:>8} (client, answered in the window){}",
                gw.map_or(String::new(), |(gl, gh)| format!("; gateway charged light {gl}, heavy {gh}, |diff| {}", gl.abs_diff(gh)))
            );
            fairness.push(json!({"run": name, "light_service": l, "heavy_service": h, "diff": diff,
                                 "gateway_light_service": gw.map(|g| g.0), "gateway_heavy_service": gw.map(|g| g.1),
                                 "gateway_diff": gw.map(|g| g.0.abs_diff(g.1))}));
            d.shutdown().await;
        }
        println!("         VTC bound for two backlogged tenants: {bound} (2 × max(input {}, 2 × {IN_FLIGHT_BOUND} in flight × {OUTPUT_TOKENS} output))", PROMPT_TOKENS * 3 / 2);
        json!({"bench": "gateway-fairness", "quick": quick, "seconds": secs.as_secs(),
               "fleet": {"pages": PAGES, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                         "prefill_ms": (PREFILL_FIXED + PREFILL_PER_TOKEN * PROMPT_TOKENS as u32).as_secs_f64() * 1e3,
                         "token_delay_ms": TOKEN_DELAY.as_secs_f64() * 1e3},
               "light_rate": LIGHT_RATE, "heavy_rate": LIGHT_RATE * 10.0, "heavy_clients": HEAVY_CLIENTS,
               "light_clients": HEAVY_CLIENTS / 10, "vtc_bound": bound,
               "latency": latency, "service": fairness})
    });
    if let Some(path) = out {
        // Relative to the workspace (cargo runs a bench in its package's directory).
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
        std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap() + "\n")
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        println!("wrote {}", path.display());
    }
}
