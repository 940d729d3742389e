//! What the gateway itself adds: `baton serve` in front of neutral engines, beside nginx forwarding
//! one leg to the same engine, and the engine called directly.
//!
//! `cargo bench -p baton-gateway --bench proxy -- [--secs 10] [--modes vllm-nixl,lmcache,native,sglang]
//!  [--layouts A,B] [--phases c1,c1_gap20ms,c64,c64_paced,ttft] [--rounds 5] [--paced-rate 4000]
//!  [--out FILE]` (`--phases`: only those, e.g. to profile one)
//!
//! Processes, each pinned with `taskset`:
//! - the engines (this binary again, in a role of its own): one prefill and one decode `baton-sim`
//!   engine (TP 1) in **neutral** mode (no KV derived or checked; pages move as zeros) with a small
//!   model (1 layer, 1 KV head of 4 one-byte values, 256-token chunks: a 1 KB prompt is one page of 2
//!   KB with Qwen3's tokenizer, four as byte values), on one current-thread runtime, speaking the
//!   mode's protocol;
//! - `baton serve` (the real binary) with a TOML for the mode;
//! - nginx (Debian's, unpacked by `scripts/fetch-nginx` into `.cache/nginx`, or on `PATH`) forwarding
//!   one leg to the decode engine with upstream keep-alive;
//! - the **hyper floor** (this binary again, pinned as the gateway): hyper's server and pooled client
//!   passing each request's body to the prefill engine and then to the decode engine, nothing else
//!   (see [`floor_main`]): what two sequential legs cost with the gateway's HTTP stack alone;
//! - the load generator: this process (one current-thread runtime).
//!
//! Layout A: the gateway and nginx alone on core 1; engines and load on core 0. Layout B: everything
//! on core 0 (no cross-core wake-ups: the gateway's own work).
//!
//! Per mode and layout: c=1 latency p50/p99 of a 1 KB completion of one token straight to the
//! engine, through nginx (one leg) and through baton (two legs), the added p50/p99 over straight; the
//! same with a 20 ms pause between requests (a person with curl), with the gateway's own phases
//! (its `Server-Timing`: the prefill and decode legs as it timed them) for both; c=64 req/s and p99
//! through baton (`secs` in all, in `--rounds` rounds with baton, nginx and the floor in turn in
//! each: this machine's speed drifts by up to 1.5× within minutes, and a target measured once took
//! the drift between it and the floor for its own; each figure is the median over the rounds, p50
//! and p99 over all their latencies, `gateway_cpu_vs_floor` the median of the rounds' ratios, and
//! each round's own figures under `rounds`, with each process's context switches a request,
//! voluntary and involuntary); c=16 streamed time to the first token (4 tokens) straight, through
//! nginx and through baton; and
//! the gateway's CPU time per request (utime + stime from `/proc` over each c=64 round, and each apart),
//! beside nginx's for one leg and the floor's for two under the same load, with the engines' and the
//! load generator's CPU a request in the same round; and the same again with the 64 connections
//! paced to one rate for every target (`c64_paced`, `--paced-rate`, 4,000 req/s unless given), below
//! what each keeps up with. (Back to back in layout B, the core is full and the scheduler takes
//! whichever process needs the most of it off the core each time it wakes another: that one's
//! work, the gateway's or the engines', is cut into runs of about a request each and costs more;
//! paced, the core is not full.) The floor is measured
//! wherever baton is. During each c=16 TTFT run, every process's CPU a request (`cpu_us_per_request`:
//! the front, the engines, the load): in layout B they share one core, so their sum weighs on the
//! TTFT under load, and a mode's engines do their own protocol's work there (`native`'s neutral
//! engines still move their zero pages through the data plane; the other modes' neutral engines
//! move no KV at all, `baton_sim::kv::set_neutral`).
//! `BATON_PROXY_BENCH_BATON=PATH` runs another `baton` binary (before and after a change, in turn);
//! `BATON_PROXY_BENCH_FLOOR_WRAP=CMD` runs the floor as `CMD <this binary>` (a profiler).
//! `native` pools say `reserve = "prefiller"` (the prefillers reserve the pages with their writes)
//! unless `BATON_PROXY_BENCH_RESERVE=gateway`, and `token_ids = "base64"` (the prompt's ids to the
//! engines as their base64 string) unless `BATON_PROXY_BENCH_TOKEN_IDS=json`. `native` and
//! `lmcache` send the engines the gateway's token ids, so the model has Qwen3's tokenizer there
//! (235 ids for the 1 KB prompt); `BATON_PROXY_BENCH_BYTE_IDS=1` gives `native` none, and so the
//! prompt's 1,000 byte values as its ids (what the bench did before 2026-11-28).
//! `BATON_BENCH_QUICK=1` runs each phase for 0.3 s, c=64 in one round (a smoke run); without nginx its columns are
//! empty unless `BATON_REQUIRE_NGINX=1`.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss
)]

mod common;

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton_gateway::demo::{DemoConfig, start_engines_with};
use baton_gateway::handoff::Mode;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;

/// Set in the engines' process: the mode to play.
const ROLE_ENV: &str = "BATON_PROXY_BENCH_ENGINES";
/// Set in the hyper floor's process: the prefill and decode engines' addresses.
const FLOOR_ENV: &str = "BATON_PROXY_BENCH_FLOOR";
/// `inline`: the floor's legs through a minimal inline HTTP/1.1 client (see [`floor_main`]).
const FLOOR_CLIENT_ENV: &str = "BATON_PROXY_BENCH_FLOOR_CLIENT";
/// Set in the engines' process for `lmcache`: where prefillers send their notifications.
const NOTIFY_ENV: &str = "BATON_PROXY_BENCH_NOTIFY";
const CHUNK_TOKENS: u32 = 256;
const SHAPE: [u32; 4] = [1, 1, 4, 1];
const PROMPT_BYTES: usize = 1000;
/// `c64_paced`'s rate unless `--paced-rate`: below what every target keeps up with in layout B on
/// the project's CPU machine (the slowest, a mode through baton back to back, 5,000–7,000 req/s).
const PACED_RATE: f64 = 4000.0;

/// Killed however the bench ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pin(cmd: &mut Command, cpu: u32) -> &mut Command {
    cmd.args(["-c", &cpu.to_string()])
}

/// The engines' role: start them, print their addresses, run until stdin closes.
fn engines_main(mode: &str) {
    baton_sim::kv::set_neutral(true);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let handoff = Mode::parse(mode).expect("a handoff mode");
        let c = DemoConfig {
            handoff,
            pages: 4096,
            cache_blocks: 65_536,
            chunk_tokens: CHUNK_TOKENS,
            shape: Some(SHAPE),
            // `BATON_PROXY_BENCH_DECODE_WAITS=0`: native decoders that cannot wait for the KV
            // (the gateway sends the decode after every rank's READY).
            decode_waits: std::env::var("BATON_PROXY_BENCH_DECODE_WAITS").as_deref() != Ok("0"),
            ..DemoConfig::default()
        };
        let notify: Option<SocketAddr> = std::env::var(NOTIFY_ENV).ok().map(|a| a.parse().unwrap());
        let e = start_engines_with(&c, notify).await.unwrap();
        let (_, decode, stats) = &e.decoders[0];
        let hello = json!({
            "prefill": e.running[0].addr.to_string(), "decode": decode.to_string(), "stats": stats,
        });
        println!("{hello}");
        // Until the bench closes our stdin.
        tokio::task::spawn_blocking(|| {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
        })
        .await
        .unwrap();
        drop(e);
    });
}

/// The hyper floor: hyper's server and pooled client as the gateway uses them (the gateway's own
/// runtime, [`baton_gateway::serve::runtime`]: current-thread on the one core it is pinned to;
/// keep-alive, no delay), each request's body sent to the prefill engine, its answer read
/// whole, then the same body sent to the decode engine and its answer streamed back. No parsing, no
/// routing, no admission: what two sequential legs cost with this stack and nothing else.
///
/// With `BATON_PROXY_BENCH_FLOOR_CLIENT=inline`, the legs go through a minimal HTTP/1.1 client
/// instead, written inline on one kept connection to each engine per client connection (no pool, no
/// connection task): what the engine client costs on top of the server. It reads only what the
/// neutral engines answer (a length, or a chunked body read whole), so its streamed TTFT is the
/// whole answer's time.
fn floor_main(engines: &str) {
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    let (p, d) = engines.split_once(',').unwrap();
    let addrs: (SocketAddr, SocketAddr) = (p.parse().unwrap(), d.parse().unwrap());
    let urls =
        std::sync::Arc::new((format!("http://{p}/v1/completions"), format!("http://{d}/v1/completions")));
    let inline = std::env::var(FLOOR_CLIENT_ENV).as_deref() == Ok("inline");
    let rt = baton_gateway::serve::runtime().unwrap();
    rt.block_on(async move {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", listener.local_addr().unwrap());
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            stream.set_nodelay(true).unwrap();
            let (client, urls) = (client.clone(), urls.clone());
            // The inline client's connections, one to each engine, for this client connection.
            let conns = std::sync::Arc::new(tokio::sync::Mutex::new(None::<(TcpStream, TcpStream)>));
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let (client, urls, conns) = (client.clone(), urls.clone(), conns.clone());
                    async move {
                        let body = req.into_body().collect().await?.to_bytes();
                        if inline {
                            let mut held = conns.lock().await;
                            if held.is_none() {
                                *held = Some((inline_connect(addrs.0).await, inline_connect(addrs.1).await));
                            }
                            let (a, b) = held.as_mut().unwrap();
                            inline_leg(a, &body).await;
                            let answer = Full::new(inline_leg(b, &body).await);
                            return Ok::<_, hyper::Error>(hyper::Response::new(
                                http_body_util::Either::Right(answer),
                            ));
                        }
                        let leg = |url: &str| {
                            Request::post(url)
                                .header("content-type", "application/json")
                                .body(Full::new(body.clone()))
                                .unwrap()
                        };
                        let first = client.request(leg(&urls.0)).await.unwrap();
                        first.into_body().collect().await?;
                        let second = client.request(leg(&urls.1)).await.unwrap();
                        Ok(second.map(http_body_util::Either::Left))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}

async fn inline_connect(at: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(at).await.unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// One POST on `s` by hand, its answer's body back (a chunked one with its framing).
async fn inline_leg(s: &mut TcpStream, body: &Bytes) -> Bytes {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: e\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    s.write_all(&req).await.unwrap();
    let mut buf = Vec::with_capacity(4096);
    loop {
        let mut chunk = [0u8; 8192];
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the engine closed the connection");
        buf.extend_from_slice(&chunk[..n]);
        let Some(h) = buf.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
        let head = std::str::from_utf8(&buf[..h]).unwrap().to_ascii_lowercase();
        if let Some(len) = head.lines().find_map(|l| l.strip_prefix("content-length:")) {
            let end = h + 4 + len.trim().parse::<usize>().unwrap();
            if buf.len() >= end {
                return Bytes::copy_from_slice(&buf[h + 4..end]);
            }
        } else if buf.ends_with(b"0\r\n\r\n") {
            return Bytes::copy_from_slice(&buf[h + 4..]);
        }
    }
}

struct Setup {
    _procs: Vec<Proc>,
    engine: SocketAddr,
    /// nginx's address and process.
    nginx: Option<(SocketAddr, u32)>,
    /// The hyper floor's address and process.
    floor: (SocketAddr, u32),
    baton: SocketAddr,
    baton_pid: u32,
    /// The engines' process (both engines, one runtime).
    engines_pid: u32,
}

fn nginx_binary() -> Option<PathBuf> {
    let cached = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/nginx/usr/sbin/nginx");
    let found = std::iter::once(cached)
        .chain(
            std::env::var_os("PATH")
                .into_iter()
                .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
                .map(|d| d.join("nginx")),
        )
        .chain([PathBuf::from("/usr/sbin/nginx")])
        .find(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var("BATON_REQUIRE_NGINX").as_deref() != Ok("1"),
            "nginx is missing: scripts/fetch-nginx"
        );
        eprintln!("no nginx (scripts/fetch-nginx unpacks Debian's): its columns stay empty");
    }
    found
}

/// `[model]`'s `tokenizer` line for Qwen3's (from scripts/fetch-tokenizers; the neutral engines
/// take any ids).
fn qwen3_tokenizer() -> String {
    let t = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3/tokenizer.json");
    assert!(t.exists(), "{} is missing: scripts/fetch-tokenizers", t.display());
    format!("tokenizer = {:?}\n", t.display().to_string())
}

/// Engines, gateway and nginx for `mode` in `layout`.
fn start(mode: &str, layout: char, dir: &Path, nginx: Option<&Path>) -> Setup {
    let front = if layout == 'A' { 1 } else { 0 };
    std::fs::create_dir_all(dir).unwrap();
    let notify = common::free_port();
    let mut cmd = Command::new("taskset");
    pin(&mut cmd, 0)
        .arg(std::env::current_exe().unwrap())
        .env(ROLE_ENV, mode)
        .env(NOTIFY_ENV, notify.to_string());
    let mut child =
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let engines_pid = child.id();
    let engines = Proc(child);
    let hello: Value = serde_json::from_str(&line).expect("the engines' addresses");
    let s = |k: &str| hello[k].as_str().unwrap().to_owned();
    let mut decode_table = format!("[[decode]]\nname = \"d\"\nurl = \"http://{}\"\n", s("decode"));
    let mut tail = String::new();
    let mut model_extra = String::new();
    match mode {
        "native" => {
            let ranks: Vec<String> = hello["stats"]["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| format!("{:?}", r["addr"].as_str().unwrap()))
                .collect();
            decode_table.push_str(&format!("dataplane = [{}]\n", ranks.join(", ")));
            // `BATON_PROXY_BENCH_RESERVE=gateway`: the gateway reserves the pages before the
            // prefill; by default the simulated prefillers reserve them with their writes.
            let by = std::env::var("BATON_PROXY_BENCH_RESERVE").unwrap_or_else(|_| "prefiller".into());
            decode_table.push_str(&format!("reserve = {by:?}\n"));
            let ids = std::env::var("BATON_PROXY_BENCH_TOKEN_IDS").unwrap_or_else(|_| "base64".into());
            decode_table.push_str(&format!("token_ids = {ids:?}\n"));
            // The mode sends the engines the gateway's token ids, which for a real model are its
            // tokenizer's (235 for the 1 KB prompt with Qwen3's): the model's tokenizer, as for
            // lmcache, unless `BATON_PROXY_BENCH_BYTE_IDS=1` (the byte values, 1,000 ids, which
            // only the simulated engines' byte-level model reads as the prompt).
            if std::env::var_os("BATON_PROXY_BENCH_BYTE_IDS").is_none() {
                model_extra = qwen3_tokenizer();
            }
        }
        "lmcache" => {
            // Each rank of the decoder's PD backend: its ports and its capacity in chunks.
            let ranks = hello["stats"]["lmcache"]["ranks"].as_array().unwrap();
            let list = |k: &str| {
                let port =
                    |r: &Value| r[k].as_str().unwrap().parse::<SocketAddr>().unwrap().port().to_string();
                ranks.iter().map(port).collect::<Vec<_>>().join(", ")
            };
            let capacity = ranks.iter().map(|r| r["capacity_chunks"].as_u64().unwrap()).min().unwrap();
            let page = u64::from(CHUNK_TOKENS) * 2 * u64::from(SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]);
            std::fs::write(
                dir.join("decoder.yaml"),
                format!(
                    "enable_pd: True\npd_role: \"receiver\"\npd_peer_host: \"127.0.0.1\"\npd_peer_init_port: [{}]\npd_peer_alloc_port: [{}]\npd_buffer_size: {}\nchunk_size: {CHUNK_TOKENS}\n",
                    list("init_addr"),
                    list("alloc_addr"),
                    capacity * page
                ),
            )
            .unwrap();
            decode_table.push_str("handoff = \"lmcache\"\nlmcache = { config = \"decoder.yaml\" }\n");
            // The mode sends the gateway's token ids, so it needs the model's tokenizer.
            model_extra = qwen3_tokenizer();
            tail = format!("[lmcache]\nnotify_listen = \"{notify}\"\n");
        }
        other => decode_table.push_str(&format!("handoff = \"{other}\"\n")),
    }
    let toml = format!(
        "[[listeners]]\naddress = \"127.0.0.1:0\"\nplain_http = true\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n\
         [model]\nname = \"baton-sim\"\ncontext_length = 32768\nchunk_tokens = {CHUNK_TOKENS}\n\
         geometry = {{ layers = {}, kv_heads = {}, head_dim = {}, dtype_bytes = {} }}\n{model_extra}\n\
         [[prefill]]\nname = \"p\"\nurl = \"http://{}\"\n\n{decode_table}\n[admission]\nmax_queue = 4096\n\n{tail}",
        SHAPE[0],
        SHAPE[1],
        SHAPE[2],
        SHAPE[3],
        s("prefill")
    );
    let file = dir.join("baton.toml");
    std::fs::write(&file, toml).unwrap();
    let mut cmd = Command::new("taskset");
    // BATON_PROXY_BENCH_BATON: another `baton` binary (a before/after comparison in one build).
    let baton =
        std::env::var("BATON_PROXY_BENCH_BATON").unwrap_or_else(|_| env!("CARGO_BIN_EXE_baton").into());
    pin(&mut cmd, front).args([baton.as_str(), "serve", "--config", file.to_str().unwrap()]);
    let log = std::fs::File::create(dir.join("baton.log")).unwrap();
    let mut child = cmd.stdout(Stdio::piped()).stderr(log).spawn().unwrap();
    let baton_pid = child.id();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let baton = loop {
        let Some(Ok(l)) = lines.next() else {
            panic!(
                "baton serve stopped: {}",
                std::fs::read_to_string(dir.join("baton.log")).unwrap_or_default()
            )
        };
        if let Some(a) = l.split("serving on ").nth(1).and_then(|r| r.split_whitespace().next()) {
            break a.parse::<SocketAddr>().unwrap();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let mut procs = vec![engines, Proc(child)];
    let engine: SocketAddr = s("decode").parse().unwrap();
    let nginx = nginx.map(|bin| {
        let at = common::free_port();
        std::fs::write(
            dir.join("nginx.conf"),
            format!(
                "worker_processes 1;\ndaemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log crit;\n\
                 events {{ worker_connections 4096; }}\n\
                 http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
                 fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
                 upstream engine {{ server {engine}; keepalive 128; keepalive_requests 100000000; }}\n\
                 server {{\n    listen {at};\n    keepalive_requests 100000000;\n    location / {{\n      proxy_pass http://engine;\n\
                 proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n",
                d = dir.display()
            ),
        )
        .unwrap();
        let mut cmd = Command::new("taskset");
        pin(&mut cmd, front).arg(bin).args(["-p", dir.to_str().unwrap(), "-e", "/dev/null", "-c"]).arg(dir.join("nginx.conf"));
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let pid = child.id();
        procs.push(Proc(child));
        (at, pid)
    });
    let mut cmd = Command::new("taskset");
    pin(&mut cmd, front);
    // BATON_PROXY_BENCH_FLOOR_WRAP: a command the floor runs under (`scripts/count-instructions`).
    if let Some(wrap) = std::env::var_os("BATON_PROXY_BENCH_FLOOR_WRAP") {
        cmd.arg(wrap);
    }
    cmd.arg(std::env::current_exe().unwrap()).env(FLOOR_ENV, format!("{},{}", s("prefill"), s("decode")));
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let floor = (line.trim().parse().expect("the floor's address"), child.id());
    procs.push(Proc(child));
    Setup { _procs: procs, engine, nginx, floor, baton, baton_pid, engines_pid }
}

async fn connect(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let start = Instant::now();
    loop {
        if let Ok(stream) = TcpStream::connect(addr).await {
            stream.set_nodelay(true).unwrap();
            let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
            tokio::spawn(conn);
            return send;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{addr} never listened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One request's latency, its time to the first SSE event with text (when streamed), and the
/// gateway's phases from its `Server-Timing` header (name, ms).
type Sample = (Duration, Duration, Vec<(String, f64)>);

fn server_timing(h: &hyper::HeaderMap) -> Vec<(String, f64)> {
    let Some(v) = h.get("server-timing").and_then(|v| v.to_str().ok()) else { return Vec::new() };
    v.split(", ")
        .filter_map(|p| p.split_once(";dur="))
        .filter_map(|(n, d)| Some((n.to_owned(), d.parse::<f64>().ok()?)))
        .collect()
}

/// One request on `send`; `None` when the server closed the connection before it (the caller
/// reconnects).
async fn one(
    send: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    body: &Bytes,
) -> Option<Sample> {
    let req = Request::post("/v1/completions")
        .header("host", "bench")
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .unwrap();
    let t0 = Instant::now();
    send.ready().await.ok()?;
    let res = send.send_request(req).await.ok()?;
    assert_eq!(res.status(), 200);
    let phases = server_timing(res.headers());
    let mut body = res.into_body();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.unwrap();
        if first.is_none() && frame.data_ref().is_some_and(|d| d.windows(6).any(|w| w == b"\"text\"")) {
            first = Some(t0.elapsed());
        }
    }
    let total = t0.elapsed();
    Some((total, first.unwrap_or(total), phases))
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    common::percentile(v, p).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

/// How each of [`run`]'s connections spaces its requests.
#[derive(Clone, Copy)]
enum Pace {
    /// The next request as soon as the answer is read.
    Closed,
    /// This long after each answer (a person with curl).
    Gap(Duration),
    /// All `c` connections together at this many requests a second, each on a schedule of its
    /// own (`c / rate` apart, the connections' starts spread over one such interval); a request
    /// that falls behind its time is sent as soon as the previous answer is read.
    Rate(f64),
}

/// `c` connections sending requests paced by `pace`
/// for `secs`: the latencies and times to first token.
async fn run(
    addr: SocketAddr,
    body: &Bytes,
    c: usize,
    secs: f64,
    pace: Pace,
) -> (Vec<Duration>, Vec<Duration>, f64, Vec<Vec<(String, f64)>>) {
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = tokio::task::JoinSet::new();
    let t0 = Instant::now();
    for i in 0..c {
        let body = body.clone();
        tasks.spawn(async move {
            let mut send = connect(addr).await;
            let mut out = Vec::new();
            let mut schedule = match pace {
                Pace::Rate(rate) => {
                    let every = Duration::from_secs_f64(c as f64 / rate);
                    let first = tokio::time::Instant::now() + every.mul_f64(i as f64 / c as f64);
                    let mut t = tokio::time::interval_at(first, every);
                    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    Some(t)
                }
                Pace::Closed | Pace::Gap(_) => None,
            };
            while Instant::now() < until {
                if let Some(t) = schedule.as_mut() {
                    t.tick().await;
                    // The window may have closed while this connection waited for its time.
                    if Instant::now() >= until {
                        break;
                    }
                }
                match one(&mut send, &body).await {
                    Some(x) => out.push(x),
                    None => send = connect(addr).await,
                }
                if let Pace::Gap(gap) = pace {
                    tokio::time::sleep(gap).await;
                }
            }
            out
        });
    }
    let mut lat = Vec::new();
    let mut ttft = Vec::new();
    let mut phases = Vec::new();
    while let Some(r) = tasks.join_next().await {
        for (l, f, p) in r.unwrap() {
            lat.push(l);
            ttft.push(f);
            phases.push(p);
        }
    }
    let rate = lat.len() as f64 / t0.elapsed().as_secs_f64();
    (lat, ttft, rate, phases)
}

/// The median of each `Server-Timing` phase over the samples, ms.
fn phase_medians(samples: &[Vec<(String, f64)>]) -> Value {
    let mut by: std::collections::BTreeMap<&str, Vec<f64>> = std::collections::BTreeMap::new();
    for s in samples {
        for (n, d) in s {
            by.entry(n.as_str()).or_default().push(*d);
        }
    }
    by.into_iter()
        .map(|(n, mut v)| {
            v.sort_by(f64::total_cmp);
            (n.to_owned(), json!(v[v.len() / 2]))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// utime and stime of `pid`, seconds: the gateway's own work and the kernel's for it (on loopback
/// the kernel's includes delivering what it sends to the receiving socket).
fn cpu_split(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = stat.rsplit_once(')').unwrap().1;
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of stat; `after` starts at field 3.
    (f[11].parse::<f64>().unwrap() / 100.0, f[12].parse::<f64>().unwrap() / 100.0)
}

/// `pid`'s context switches over all its threads: (voluntary, involuntary). An involuntary one is
/// the thread taken off the core while it had work, by another process woken there (in layout B,
/// an engine or the load its own writes woke), and its caches refilled after.
fn switches(pid: u32) -> (u64, u64) {
    let mut sum = (0, 0);
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(t.path().join("status")) else { continue };
        for line in status.lines() {
            let n = |l: &str| l.split_whitespace().last().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
            if line.starts_with("voluntary_ctxt_switches") {
                sum.0 += n(line);
            } else if line.starts_with("nonvoluntary_ctxt_switches") {
                sum.1 += n(line);
            }
        }
    }
    sum
}

/// c=64 against `addr` for `secs`, paced by `pace`: req/s, p50 and p99, and `pid`'s CPU time a
/// request, user and kernel apart (keys `{key}cpu_us_per_request`, `{key}user_us_per_request`,
/// `{key}system_us_per_request`), its context switches a request (`{key}voluntary_switches_per_request`,
/// `{key}involuntary_switches_per_request`), the engines' and the load generator's CPU a request
/// (`engines_cpu_us_per_request`, `load_cpu_us_per_request`), and the latencies. In layout B the
/// three share one core, and whichever of them needs the most of it is the one taken off it each
/// time another is woken: its work is then cut into runs of about one request each, and costs more.
async fn loaded(
    addr: SocketAddr,
    pids: (u32, u32),
    body: &Bytes,
    secs: f64,
    pace: Pace,
    key: &str,
) -> (Value, Vec<Duration>) {
    let (pid, engines) = pids;
    let both = |p: u32| {
        let (user, system) = cpu_split(p);
        user + system
    };
    let others0 = (both(engines), both(std::process::id()));
    let (cpu0, sw0) = (cpu_split(pid), switches(pid));
    let (mut lat, _, rate, _) = run(addr, body, 64, secs, pace).await;
    let (cpu1, sw1) = (cpu_split(pid), switches(pid));
    let others1 = (both(engines), both(std::process::id()));
    let n = lat.len() as f64;
    let per = |s: f64| s / n * 1e6;
    let (user, system) = (per(cpu1.0 - cpu0.0), per(cpu1.1 - cpu0.1));
    let mut v = json!({"n": lat.len(), "req_per_s": rate, "p50_ms": pct(&mut lat, 0.5), "p99_ms": pct(&mut lat, 0.99)});
    v["engines_cpu_us_per_request"] = json!(per(others1.0 - others0.0));
    v["load_cpu_us_per_request"] = json!(per(others1.1 - others0.1));
    v[format!("{key}cpu_us_per_request")] = json!(user + system);
    v[format!("{key}user_us_per_request")] = json!(user);
    v[format!("{key}system_us_per_request")] = json!(system);
    // Summed over the threads alive at each read: one that ended between them takes its count
    // away (the figure is then low, never wrapped).
    v[format!("{key}voluntary_switches_per_request")] = json!(sw1.0.saturating_sub(sw0.0) as f64 / n);
    v[format!("{key}involuntary_switches_per_request")] = json!(sw1.1.saturating_sub(sw0.1) as f64 / n);
    (v, lat)
}

/// The median of the finite values (a round with no request has none).
fn median(v: impl IntoIterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = v.into_iter().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => f64::midpoint(v[n / 2 - 1], v[n / 2]),
    }
}

/// A c=64 phase (`name`: `c64`, back to back; `c64_paced`, at a rate all the targets keep up
/// with): `rounds` rounds of `secs / rounds` each, every target in turn within a round
/// (baton, nginx, the floor), so a drift of the machine's speed during the phase falls on all
/// of them alike. Per target (`{name}_baton`, …): each round's figures (`rounds`), the median of
/// each figure over the rounds, p50 and p99 over all the rounds' latencies; and
/// `gateway_cpu_vs_floor`, the median over the rounds of baton's CPU a request over the floor's
/// in the same round.
async fn loaded_rounds(
    s: &Setup,
    body: &Bytes,
    secs: f64,
    rounds: usize,
    pace: Pace,
    name: &str,
    v: &mut Value,
) {
    let (baton, floor) = (format!("{name}_baton"), format!("{name}_floor"));
    let mut targets = vec![(baton.clone(), s.baton, s.baton_pid, "gateway_")];
    if let Some((at, pid)) = s.nginx {
        targets.push((format!("{name}_nginx"), at, pid, ""));
    }
    targets.push((floor.clone(), s.floor.0, s.floor.1, ""));
    let mut per: Vec<(Vec<Value>, Vec<Duration>)> =
        targets.iter().map(|_| (Vec::new(), Vec::new())).collect();
    for _ in 0..rounds {
        for (i, (_, addr, pid, key)) in targets.iter().enumerate() {
            let pids = (*pid, s.engines_pid);
            let (r, lat) = loaded(*addr, pids, body, secs / rounds as f64, pace, key).await;
            per[i].0.push(r);
            per[i].1.extend(lat);
        }
    }
    for ((name, _, _, _), (rs, mut lat)) in targets.iter().zip(per) {
        let mut t = json!({"n": rs.iter().map(|r| r["n"].as_u64().unwrap()).sum::<u64>(),
            "p50_ms": pct(&mut lat, 0.5), "p99_ms": pct(&mut lat, 0.99)});
        for k in rs[0].as_object().unwrap().keys().filter(|k| k.ends_with("per_request") || *k == "req_per_s")
        {
            t[k] = json!(median(rs.iter().filter_map(|r| r[k].as_f64())));
        }
        t["rounds"] = json!(rs);
        v[name.as_str()] = t;
    }
    let ratios: Vec<f64> = (0..rounds)
        .map(|i| {
            let cpu = |t: &str, k: &str| v[t]["rounds"][i][k].as_f64().unwrap_or(f64::NAN);
            cpu(&baton, "gateway_cpu_us_per_request") / cpu(&floor, "cpu_us_per_request")
        })
        .collect();
    v[baton.as_str()]["gateway_cpu_vs_floor"] =
        json!({"median": median(ratios.iter().copied()), "rounds": ratios});
}

fn prompt() -> String {
    common::sentence_prompt(PROMPT_BYTES)
}

async fn measure(
    mode: &str,
    layout: char,
    secs: f64,
    rounds: usize,
    nginx: Option<&Path>,
    phases: &str,
    paced: f64,
) -> Value {
    let phase = |p: &str| phases == "all" || phases.split(',').any(|x| x == p);
    let dir = std::env::temp_dir().join(format!("baton-proxy-bench-{}-{mode}-{layout}", std::process::id()));
    let s = start(mode, layout, &dir, nginx);
    let plain = Bytes::from(json!({"model": "baton-sim", "prompt": prompt(), "max_tokens": 1}).to_string());
    let stream = Bytes::from(
        json!({"model": "baton-sim", "prompt": prompt(), "max_tokens": 4, "stream": true}).to_string(),
    );
    let warm = (secs / 5.0).max(0.2);
    // The gateway's connections to the engines and its pools are warm before anything is timed.
    let nginx = s.nginx.map(|(a, _)| a);
    for addr in [Some(s.engine), nginx, Some(s.floor.0), Some(s.baton)].into_iter().flatten() {
        run(addr, &plain, 4, warm, Pace::Closed).await;
    }
    let mut v = json!({"mode": mode, "layout": layout.to_string()});
    let targets = [
        ("straight", Some(s.engine)),
        ("nginx", nginx),
        ("floor", Some(s.floor.0)),
        ("baton", Some(s.baton)),
    ];
    for (gap_name, gap) in [("c1", Pace::Closed), ("c1_gap20ms", Pace::Gap(Duration::from_millis(20)))] {
        if !phase(gap_name) {
            continue;
        }
        let mut base = f64::NAN;
        for (name, addr) in targets {
            let Some(addr) = addr else { continue };
            let (mut lat, _, _, phases) = run(addr, &plain, 1, secs, gap).await;
            let (p50, p99) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99));
            if name == "straight" {
                base = p50;
            }
            v[gap_name][name] =
                json!({"n": lat.len(), "p50_ms": p50, "p99_ms": p99, "added_p50_ms": p50 - base});
            if name == "baton" {
                // Where the time of a request goes, by the gateway's own clock.
                v[gap_name][name]["server_timing_p50_ms"] = phase_medians(&phases);
            }
        }
    }
    if phase("c64") {
        // The gateway's CPU a request beside nginx's for one leg and the floor's for two.
        loaded_rounds(&s, &plain, secs, rounds, Pace::Closed, "c64", &mut v).await;
    }
    if phase("c64_paced") {
        // The same at one rate for all, below what each keeps up with: the core is not full in
        // B, so each process sleeps once its work is done and none is left with a backlog.
        loaded_rounds(&s, &plain, secs, rounds, Pace::Rate(paced), "c64_paced", &mut v).await;
    }
    let mut base = f64::NAN;
    for (name, addr) in targets.into_iter().filter(|_| phase("ttft")) {
        let Some(addr) = addr else { continue };
        // Every process's CPU a request while this target streams: in layout B they share one
        // core, so the TTFT under load follows their sum, the engines' protocol work included.
        let front = match name {
            "baton" => Some(s.baton_pid),
            "nginx" => s.nginx.map(|(_, pid)| pid),
            "floor" => Some(s.floor.1),
            _ => None,
        };
        let procs = [("front", front), ("engines", Some(s.engines_pid)), ("load", Some(std::process::id()))];
        let cpu = |p: Option<u32>| p.map(cpu_split).map_or(0.0, |(user, system)| user + system);
        let cpu0 = procs.map(|(_, p)| cpu(p));
        let (_, mut ttft, _, _) = run(addr, &stream, 16, secs, Pace::Closed).await;
        let cpu1 = procs.map(|(_, p)| cpu(p));
        let p50 = pct(&mut ttft, 0.5);
        if name == "straight" {
            base = p50;
        }
        let mut per = json!({});
        for (i, (k, p)) in procs.iter().enumerate() {
            if p.is_some() {
                per[*k] = json!((cpu1[i] - cpu0[i]) / ttft.len() as f64 * 1e6);
            }
        }
        v["c16_stream_ttft"][name] =
            json!({"n": ttft.len(), "p50_ms": p50, "added_p50_ms": p50 - base, "cpu_us_per_request": per});
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
    v
}

fn main() {
    if let Ok(engines) = std::env::var(FLOOR_ENV) {
        floor_main(&engines);
        return;
    }
    if let Ok(mode) = std::env::var(ROLE_ENV) {
        engines_main(&mode);
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let secs: f64 = arg("--secs").map_or(if quick { 0.3 } else { 10.0 }, |s| s.parse().unwrap());
    let default_modes = if quick { "vllm-nixl" } else { "vllm-nixl,lmcache,native,sglang" };
    let modes = arg("--modes").unwrap_or_else(|| default_modes.into());
    let layouts = arg("--layouts").unwrap_or_else(|| if quick { "B".into() } else { "A,B".into() });
    // Which phases (c1, c1_gap20ms, c64, c64_paced, ttft), for profiling one of them.
    let phases = arg("--phases").unwrap_or_else(|| "all".into());
    // `c64_paced`'s rate, requests a second for the 64 connections together.
    let paced: f64 = arg("--paced-rate").map_or(PACED_RATE, |s| s.parse().unwrap());
    assert!(paced > 0.0 && paced.is_finite(), "--paced-rate: a rate above 0");
    // c=64 in rounds of `secs / rounds`, the targets in turn (see `loaded_rounds`).
    let rounds: usize = arg("--rounds").map_or(if quick { 1 } else { 5 }, |s| s.parse().unwrap());
    assert!(rounds >= 1, "--rounds: at least 1");
    let nginx = nginx_binary();
    // The load generator runs on core 0 in both layouts.
    let me = std::process::id().to_string();
    let ok =
        Command::new("taskset").args(["-a", "-p", "-c", "0", &me]).stdout(Stdio::null()).status().unwrap();
    assert!(ok.success(), "taskset");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut results = Vec::new();
    for layout in layouts.split(',').filter_map(|l| l.chars().next()) {
        for mode in modes.split(',') {
            let v = rt.block_on(measure(mode, layout, secs, rounds, nginx.as_deref(), &phases, paced));
            let f = |path: &[&str]| -> String {
                let mut x = &v;
                for p in path {
                    x = &x[*p];
                }
                x.as_f64().map_or_else(|| "-".into(), |n| format!("{n:.3}"))
            };
            println!(
                "layout {layout} {mode:>9}: c=1 added p50 baton {} ms (p99 {} ms), nginx {} ms; with 20 ms gaps baton {} ms, nginx {} ms; \
                 c=64 {} req/s p99 {} ms, gateway CPU {} us/req (user {}, kernel {}; {}x the floor's; nginx {} us/req); c=16 TTFT added baton {} ms, nginx {} ms (straight {} ms)",
                f(&["c1", "baton", "added_p50_ms"]),
                f(&["c1", "baton", "p99_ms"]),
                f(&["c1", "nginx", "added_p50_ms"]),
                f(&["c1_gap20ms", "baton", "added_p50_ms"]),
                f(&["c1_gap20ms", "nginx", "added_p50_ms"]),
                f(&["c64_baton", "req_per_s"]),
                f(&["c64_baton", "p99_ms"]),
                f(&["c64_baton", "gateway_cpu_us_per_request"]),
                f(&["c64_baton", "gateway_user_us_per_request"]),
                f(&["c64_baton", "gateway_system_us_per_request"]),
                f(&["c64_baton", "gateway_cpu_vs_floor", "median"]),
                f(&["c64_nginx", "cpu_us_per_request"]),
                f(&["c16_stream_ttft", "baton", "added_p50_ms"]),
                f(&["c16_stream_ttft", "nginx", "added_p50_ms"]),
                f(&["c16_stream_ttft", "straight", "p50_ms"]),
            );
            println!(
                "    hyper floor (two legs, no gateway work): c=1 added p50 {} ms, 20 ms gaps {} ms, c=64 {} req/s, CPU {} us/req; c=16 TTFT added {} ms",
                f(&["c1", "floor", "added_p50_ms"]),
                f(&["c1_gap20ms", "floor", "added_p50_ms"]),
                f(&["c64_floor", "req_per_s"]),
                f(&["c64_floor", "cpu_us_per_request"]),
                f(&["c16_stream_ttft", "floor", "added_p50_ms"]),
            );
            println!(
                "    c=64, engines' CPU us/req behind baton {}, the floor {}; paced at {paced} req/s: baton {} req/s, gateway CPU {} us/req ({}x the floor's {} us/req at {} req/s)",
                f(&["c64_baton", "engines_cpu_us_per_request"]),
                f(&["c64_floor", "engines_cpu_us_per_request"]),
                f(&["c64_paced_baton", "req_per_s"]),
                f(&["c64_paced_baton", "gateway_cpu_us_per_request"]),
                f(&["c64_paced_baton", "gateway_cpu_vs_floor", "median"]),
                f(&["c64_paced_floor", "cpu_us_per_request"]),
                f(&["c64_paced_floor", "req_per_s"]),
            );
            let cpu = |t: &str| {
                ["front", "engines", "load"]
                    .map(|k| format!("{k} {}", f(&["c16_stream_ttft", t, "cpu_us_per_request", k])))
                    .join(", ")
            };
            println!(
                "    c=16 TTFT, CPU us/req: baton ({}), floor ({}), straight ({})",
                cpu("baton"),
                cpu("floor"),
                cpu("straight")
            );
            println!(
                "    baton's Server-Timing p50 (ms), back to back: {}; with 20 ms gaps: {}",
                v["c1"]["baton"]["server_timing_p50_ms"], v["c1_gap20ms"]["baton"]["server_timing_p50_ms"]
            );
            results.push(v);
        }
    }
    let out = json!({"secs": secs, "prompt_bytes": PROMPT_BYTES, "rounds": rounds, "paced_rate": paced, "results": results});
    if let Some(path) = arg("--out") {
        std::fs::write(&path, serde_json::to_string_pretty(&out).unwrap()).unwrap();
    }
}
