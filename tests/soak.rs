//! The faulted soak (issue 28): three `baton serve` replicas in front of simulated engines run as
//! their own processes (two prefillers; a `native` decoder and a `vllm-nixl` one, whose slots the
//! replicas share through a real Redis), under a closed-loop load of `BATON_SOAK_REQUESTS`
//! requests (default 3,000; the figures in `bench/README.md` are of 100,000), with faults:
//!
//! - **client aborts**: one request in ten is dropped by its client at a random moment (before
//!   its answer or mid-stream);
//! - **engine crashes**: every `BATON_SOAK_CRASH_EVERY` requests served (default 300) one engine, in
//!   turn, is killed with SIGKILL and started again on the same ports 200 ms later; the requests
//!   in flight on it when it died are counted;
//! - **lost readiness**: the native decoder drops one READY signal in every 200 (two ranks, so
//!   about one native request in a hundred never hears that its KV arrived);
//! - **a replica killed**: half-way through, one replica is killed with SIGKILL and started
//!   again a second later.
//!
//! A client told to come back later (`Retry-After`, as on a `503 no_healthy_endpoint` while every
//! engine of one side is out) waits before its next request, as the OpenAI SDKs do, but at most
//! `BACKOFF_CAP` (200 ms, an engine's downtime) to keep the pace.
//!
//! Checked, and the run fails otherwise:
//! - **no over-commit at any instant**: the engines' own counts, sampled every 10 ms and read
//!   (their peaks) before every kill and at the end: the native decoder's ranks never hold more
//!   pages than they have and never count an accounting error; the `vllm-nixl` decoder never runs
//!   more than its `max_in_flight`;
//! - **no request past its deadline**: every answer within the gateway's longest request
//!   (queue wait + upstream timeout, and a second of slack); the client gives up at twice that
//!   and counts the request hung;
//! - **errors only of the expected classes** (`EXPECTED`): what an engine crash, a lost
//!   readiness signal or a killed replica can cause, and nothing else;
//! - **everything free afterwards**: every decoder rank's pages, the engines' cache blocks and
//!   running requests, the NIXL producers' held blocks, and every replica's decoder slots, within
//!   a few leases of the load's end;
//! - **a restarted engine back in routing**: the two replicas never killed offer it requests
//!   again (breaker not open, health check passing) within `READMIT_WITHIN` of its restart;
//! - **most requests served**: at least half complete (85-92 % do here).
//!
//! The figures go to stdout as JSON (and to `BATON_SOAK_OUT` when set). The binaries are the
//! workspace's own (`baton`, `baton-sim`), built beforehand
//! (`cargo build -p baton-gateway -p baton-sim --bins`); Redis is Debian's (`scripts/test`
//! installs it). Without either, the soak fails under `scripts/test` (`BATON_REQUIRE_REDIS`) and
//! says so otherwise.
//!
//! ```text
//! cargo build -p baton-gateway -p baton-sim --bins
//! BATON_SOAK_REQUESTS=100000 cargo test -p baton-tests --test soak
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout, clippy::print_stderr)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

#[path = "support/ports.rs"]
mod ports;
#[path = "support/procs.rs"]
mod procs;
#[path = "support/skip.rs"]
mod skip;

use procs::Proc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

/// Clients sending at once.
const CLIENTS: usize = 48;
/// The `vllm-nixl` decoder's capacity (`max_in_flight`), shared by the replicas.
const NIXL_CAPACITY: u64 = 8;
/// Pages per native decoder rank.
const PAGES: u64 = 64;
/// The gateway's timeouts: a request's longest life is the queue wait and the upstream timeout.
const QUEUE_TIMEOUT_MS: u64 = 5000;
const UPSTREAM_TIMEOUT_MS: u64 = 10_000;
const READY_TIMEOUT_MS: u64 = 1000;
/// The native reservations' lease: a killed replica's pages come back within it.
const LEASE_MS: u64 = 3000;
/// How long a crashed engine stays down.
const DOWN: Duration = Duration::from_millis(200);
/// One READY in this many is lost.
const DROP_READY_EVERY: u32 = 200;
/// The longest a client waits after an answer with `Retry-After` before its next request: it
/// honours the header, as the OpenAI SDKs do, but no longer than an engine stays down, to keep the
/// soak's pace (the gateway asks for 1–2 s).
const BACKOFF_CAP: Duration = DOWN;
/// A restarted engine is offered requests again (breaker not open, health check passing) by every
/// replica never killed within this: ten health-check intervals.
const READMIT_WITHIN: Duration = Duration::from_millis(2000);

/// What a request may end as, besides a completion: the class and why it is expected.
const EXPECTED: &[(&str, &str)] = &[
    ("cut", "a stream cut mid-answer: its engine was killed, or the replica serving it"),
    ("connect", "the killed replica's connections, refused or reset"),
    ("502 upstream_error", "an engine killed mid-request, or refusing while it restarts"),
    ("503 no_healthy_endpoint", "every engine of one side down or ejected at that moment"),
    ("503 queue_timeout", "no room while a decoder was down"),
    ("503 service_unavailable", "no room while a decoder was down"),
    (
        "502 kv_transfer_failed",
        "a lost readiness signal (the wait for it timed out), or the native decoder killed mid-transfer",
    ),
    ("504 upstream_timeout", "an engine killed while the gateway waited"),
];

fn main() -> ExitCode {
    let args = libtest_mimic::Arguments::from_args();
    let trial = libtest_mimic::Trial::test("faulted_soak", || {
        let requests: u64 = env_or("BATON_SOAK_REQUESTS", 3000);
        let crash_every: u64 = env_or("BATON_SOAK_CRASH_EVERY", 300);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        match rt.block_on(soak(requests, crash_every)) {
            Ok(report) => {
                let text = serde_json::to_string_pretty(&report)?;
                println!("{text}");
                if let Ok(out) = std::env::var("BATON_SOAK_OUT") {
                    std::fs::write(&out, text + "\n")?;
                }
                Ok(())
            }
            Err(Skip(why)) if std::env::var_os("BATON_REQUIRE_REDIS").is_some() => Err(why.into()),
            Err(Skip(why)) => {
                skip::skipped("tool", &why);
                Ok(())
            }
        }
    });
    libtest_mimic::run(&args, vec![trial]).exit_code()
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name}={v}: a number")))
}

/// Why the soak could not run (a missing tool).
struct Skip(String);

/// The workspace's binaries, beside this test's own.
fn bin(name: &str) -> Result<PathBuf, Skip> {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let p = dir.join(name);
    if p.exists() {
        Ok(p)
    } else {
        Err(Skip(format!(
            "no {} (build it first: cargo build -p baton-gateway -p baton-sim --bins)",
            p.display()
        )))
    }
}

/// A simulated engine as its own process, started again on the same ports after a crash.
struct Engine {
    name: String,
    decode: bool,
    args: Vec<String>,
    proc: Option<Proc>,
    http: SocketAddr,
    ranks: Vec<SocketAddr>,
    crashes: u64,
    /// Requests running on it when it was killed, over its crashes.
    cut: u64,
    /// Its highest count of requests running at once, over every life.
    peak_running: u64,
}

impl Engine {
    fn new(bin: &Path, name: &str, decode: bool, extra: &[String]) -> Self {
        let http: SocketAddr = format!("127.0.0.1:{}", ports::free_port()).parse().unwrap();
        let mut args: Vec<String> =
            ["--role", if decode { "decode" } else { "prefill" }, "--tp", "2", "--listen"]
                .iter()
                .map(|s| (*s).to_owned())
                .collect();
        args.push(http.to_string());
        if decode {
            args.extend([
                "--dp-port".into(),
                ports::free_ports(2).to_string(),
                "--pages".into(),
                PAGES.to_string(),
            ]);
        }
        args.extend(extra.iter().cloned());
        args.insert(0, bin.display().to_string());
        let mut e = Self {
            name: name.into(),
            decode,
            args,
            proc: None,
            http,
            ranks: Vec::new(),
            crashes: 0,
            cut: 0,
            peak_running: 0,
        };
        e.start();
        e
    }

    fn start(&mut self) {
        // A port of the killed process may still be held a moment (its sockets closing).
        let started = Instant::now();
        let (proc, line, lines) = loop {
            let mut child = Command::new(&self.args[0])
                .args(&self.args[1..])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            let stderr = child.stderr.take().unwrap();
            let proc = Proc(child);
            if let Some(Ok(line)) = lines.next() {
                std::thread::spawn(move || BufReader::new(stderr).lines().for_each(drop));
                break (proc, line, lines);
            }
            let why: Vec<String> = BufReader::new(stderr).lines().map_while(Result::ok).collect();
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{} did not start: {}",
                self.name,
                why.join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        std::thread::spawn(move || lines.for_each(drop));
        let v: Value = serde_json::from_str(&line).unwrap();
        self.ranks = v["ranks"]
            .as_array()
            .map(|rs| rs.iter().map(|r| r["addr"].as_str().unwrap().parse().unwrap()).collect())
            .unwrap_or_default();
        self.proc = Some(proc);
    }
}

/// A `baton serve` replica.
struct Replica {
    _proc: Proc,
    public: SocketAddr,
    admin: SocketAddr,
}

fn replica(file: &Path) -> Replica {
    let baton = bin("baton").ok().unwrap();
    let (proc, public, admin) =
        procs::spawn_baton(&baton, &["serve", "--config", file.to_str().unwrap()], Stdio::null());
    Replica { _proc: proc, public, admin }
}

/// Debian's `redis-server` on a free port.
fn redis() -> Result<(Proc, String), Skip> {
    let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/redis/bin/redis-server");
    let bin = if local.exists() {
        local
    } else {
        std::env::var_os("PATH")
            .and_then(|p| std::env::split_paths(&p).map(|d| d.join("redis-server")).find(|f| f.exists()))
            .ok_or_else(|| Skip("no redis-server (scripts/test installs Debian's redis-tools)".into()))?
    };
    let port = ports::free_port();
    let child = Command::new(bin)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "redis-server did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((Proc(child), format!("redis://127.0.0.1:{port}/0")))
}

fn config(dir: &Path, prefill: &[&Engine], native: &Engine, nixl: &Engine, store: &str) -> PathBuf {
    let ranks: Vec<String> = native.ranks.iter().map(|r| format!("\"{r}\"")).collect();
    let mut text = String::from(
        r#"[[listeners]]
address = "127.0.0.1:0"
plain_http = true

[admin]
listen = "127.0.0.1:0"

[model]
name = "baton-sim"
context_length = 4096
chunk_tokens = 16
geometry = { layers = 2, kv_heads = 2, head_dim = 16, dtype_bytes = 2 }
"#,
    );
    for p in prefill {
        text += &format!("\n[[prefill]]\nname = \"{}\"\nurl = \"http://{}\"\n", p.name, p.http);
    }
    text += &format!(
        "\n[[decode]]\nname = \"{}\"\nurl = \"http://{}\"\ndataplane = [{}]\n\n\
         [[decode]]\nname = \"{}\"\nurl = \"http://{}\"\nhandoff = \"vllm-nixl\"\n\
         nixl = {{ scrape_interval_ms = 50, max_in_flight = {NIXL_CAPACITY} }}\n\n\
         [admission]\nqueue_timeout_ms = {QUEUE_TIMEOUT_MS}\nlease_ms = {LEASE_MS}\n\
         ready_timeout_ms = {READY_TIMEOUT_MS}\nupstream_timeout_ms = {UPSTREAM_TIMEOUT_MS}\n\n\
         [routing]\nhealth_check_interval_ms = 200\nhealth_check_timeout_ms = 500\neject_ms = 200\n\n\
         [cluster]\nstore = \"{store}\"\nlease_ms = 1000\nsync_ms = 20\n",
        native.name,
        native.http,
        ranks.join(", "),
        nixl.name,
        nixl.http
    );
    let file = dir.join("baton.toml");
    std::fs::write(&file, text).unwrap();
    file
}

/// A deterministic draw for request `i`, `salt` picking the question.
fn draw(i: u64, salt: u64, n: u64) -> u64 {
    let mut z = i.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(salt.wrapping_mul(0xBF58_476D_1CE4_E5B9));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) % n
}

/// How one request ended.
#[derive(Debug)]
enum End {
    Ok,
    Aborted,
    /// Its class (`EXPECTED`'s first column, or something else), and the answer's `Retry-After`.
    Failed(String, Option<Duration>),
    Hung,
}

/// Sends request `i` to `addr`: streamed or not, completions or chat, an abort for one in ten.
async fn one(addr: SocketAddr, i: u64, limit: Duration, abort_every: u64) -> End {
    let stream = draw(i, 1, 2) == 0;
    let chat = draw(i, 2, 2) == 0;
    let tokens = 16 + usize::try_from(draw(i, 3, 150)).unwrap_or(0);
    let max_tokens = 1 + draw(i, 4, 16);
    let abort = abort_every > 0 && draw(i, 5, abort_every) == 0;
    let text = format!("soak request {i}: ").repeat(tokens / 16 + 1);
    let text = &text[..tokens];
    let (path, mut body) = if chat {
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": text}]}))
    } else {
        ("/v1/completions", json!({"prompt": text}))
    };
    body["max_tokens"] = json!(max_tokens);
    if stream {
        body["stream"] = json!(true);
    }
    let work = async {
        let s = tokio::net::TcpStream::connect(addr).await.map_err(|_| ("connect".to_owned(), None))?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
            .await
            .map_err(|_| ("connect".to_owned(), None))?;
        tokio::spawn(conn);
        let req = hyper::Request::post(path)
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let res = send.send_request(req).await.map_err(|_| ("connect".to_owned(), None))?;
        let status = res.status().as_u16();
        let retry_after = res
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .map(Duration::from_secs);
        let bytes = res.into_body().collect().await.map(|b| b.to_bytes());
        match (status, bytes) {
            (200, Ok(b)) => {
                let whole = if stream {
                    b.ends_with(b"data: [DONE]\n\n")
                } else {
                    serde_json::from_slice::<Value>(&b).is_ok_and(|v| v["choices"].is_array())
                };
                if whole { Ok(()) } else { Err(("cut".to_owned(), None)) }
            }
            (200, Err(_)) => Err(("cut".to_owned(), None)),
            (s, Ok(b)) => {
                let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
                Err((format!("{s} {}", v["error"]["code"].as_str().unwrap_or("(no code)")), retry_after))
            }
            (s, Err(_)) => Err((format!("{s} (body cut)"), retry_after)),
        }
    };
    if abort {
        // Gone at a random moment: before its headers, or while it streams.
        let after = Duration::from_millis(draw(i, 6, 40));
        return match tokio::time::timeout(after, work).await {
            Ok(Ok(())) => End::Ok,
            Ok(Err((class, retry))) => End::Failed(class, retry),
            Err(_) => End::Aborted,
        };
    }
    match tokio::time::timeout(limit * 2, work).await {
        Ok(Ok(())) => End::Ok,
        Ok(Err((class, retry))) => End::Failed(class, retry),
        Err(_) => End::Hung,
    }
}

/// How long after its restart engine `i` is offered requests by every replica in `admins` (its
/// breaker not open, its health check passing): `Some(None)` past `READMIT_WITHIN`, `None` when
/// it was killed again first.
async fn readmitted(
    admins: [SocketAddr; 2],
    engines: Arc<Mutex<Vec<Engine>>>,
    i: usize,
) -> (String, Option<Option<Duration>>) {
    let t = Instant::now();
    let (name, crashes) = {
        let e = &engines.lock().unwrap()[i];
        (e.name.clone(), e.crashes)
    };
    while t.elapsed() < READMIT_WITHIN {
        if engines.lock().unwrap()[i].crashes != crashes {
            return (name, None);
        }
        let mut all = true;
        for a in admins {
            let v = get_json(a, "/admin/engines").await;
            let e =
                v.as_ref().and_then(|v| v["engines"].as_array()?.iter().find(|e| e["name"] == name.as_str()));
            all &= e.is_some_and(|e| e["breaker"] != "open" && e["health_check"] == "passing");
        }
        if all {
            return (name, Some(Some(t.elapsed())));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (name, Some(None))
}

/// A GET's JSON (or its text), `None` when it fails or takes over 2 s (an engine just killed).
async fn get_json(addr: SocketAddr, path: &str) -> Option<Value> {
    tokio::time::timeout(Duration::from_secs(2), get_json_now(addr, path)).await.ok().flatten()
}

async fn get_json_now(addr: SocketAddr, path: &str) -> Option<Value> {
    let s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await.ok()?;
    tokio::spawn(conn);
    let req =
        hyper::Request::get(path).header("host", addr.to_string()).body(Full::new(Bytes::new())).unwrap();
    let res = send.send_request(req).await.ok()?;
    let b = res.into_body().collect().await.ok()?.to_bytes();
    serde_json::from_slice(&b).ok().or_else(|| Some(Value::String(String::from_utf8_lossy(&b).into_owned())))
}

/// What the engines' own counts showed: the most pages a native rank held, the most requests the
/// `vllm-nixl` decoder ran, and every violation seen.
#[derive(Debug, Default)]
struct Watch {
    most_pages: AtomicU64,
    most_nixl_running: AtomicU64,
    samples: AtomicU64,
    violations: Mutex<Vec<String>>,
}

impl Watch {
    fn check(&self, name: &str, nixl: bool, v: &Value) {
        let mut bad = Vec::new();
        for r in v["ranks"].as_array().into_iter().flatten() {
            let used: u64 = ["pages_reserved", "pages_filled", "pages_quarantined", "pages_consuming"]
                .iter()
                .map(|k| r[*k].as_u64().unwrap_or(0))
                .sum();
            let total = r["pages_total"].as_u64().unwrap_or(0);
            if r["accounting_errors"] != 0 {
                bad.push(format!("{name}: accounting errors {r}"));
            }
            if used + r["pages_free"].as_u64().unwrap_or(0) != total || used > total {
                bad.push(format!("{name}: pages do not add up: {r}"));
            }
            self.most_pages.fetch_max(used, Ordering::Relaxed);
        }
        if nixl {
            let peak = v["peak_running"].as_u64().unwrap_or(0).max(v["running"].as_u64().unwrap_or(0));
            self.most_nixl_running.fetch_max(peak, Ordering::Relaxed);
            if peak > NIXL_CAPACITY {
                bad.push(format!("{name}: ran {peak} requests at once, holding {NIXL_CAPACITY}"));
            }
        }
        self.samples.fetch_add(1, Ordering::Relaxed);
        if !bad.is_empty() {
            self.violations.lock().unwrap().extend(bad);
        }
    }
}

/// Whether the engine holds nothing: pages, cache blocks, requests, producer blocks.
fn idle(v: &Value) -> bool {
    let ranks_free = v["ranks"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|r| r["pages_free"] == r["pages_total"] && r["accounting_errors"] == 0);
    ranks_free
        && v["running"] == 0
        && v["engine_blocks_held"] == 0
        && v["nixl"]["blocks_held"].as_u64().unwrap_or(0) == 0
}

/// Sums the samples of `name` in a Prometheus text.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[allow(clippy::too_many_lines)]
async fn soak(requests: u64, crash_every: u64) -> Result<Value, Skip> {
    let abort_every: u64 = env_or("BATON_SOAK_ABORT_EVERY", 10);
    let sim = bin("baton-sim")?;
    bin("baton")?;
    let (_redis, store) = redis()?;
    let dir = std::env::temp_dir().join(format!("baton-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let started = Instant::now();

    let nixl_prefill = ["--nixl-abort-timeout-s".to_owned(), "5".to_owned()];
    let decode_common =
        ["--token-delay-us".to_owned(), "1000".to_owned(), "--quarantine-ms".to_owned(), "1000".to_owned()];
    let mut native_args = decode_common.to_vec();
    native_args.extend(["--faults".into(), json!({"drop_ready_every": DROP_READY_EVERY}).to_string()]);
    let mut nixl_args = decode_common.to_vec();
    nixl_args.push("--nixl".into());
    let engines: Vec<Engine> = vec![
        Engine::new(&sim, "p0", false, &nixl_prefill),
        Engine::new(&sim, "p1", false, &nixl_prefill),
        Engine::new(&sim, "native", true, &native_args),
        Engine::new(&sim, "nixl", true, &nixl_args),
    ];
    let file = config(&dir, &[&engines[0], &engines[1]], &engines[2], &engines[3], &store);
    let engines = Arc::new(Mutex::new(engines));
    let mut replicas: Vec<Replica> = (0..3).map(|_| replica(&file)).collect();
    // The replicas never killed (1 is), whose view of a restarted engine is timed.
    let steady = [replicas[0].admin, replicas[2].admin];
    let publics: Arc<Mutex<Vec<Option<SocketAddr>>>> =
        Arc::new(Mutex::new(replicas.iter().map(|r| Some(r.public)).collect()));
    let limit = Duration::from_millis(QUEUE_TIMEOUT_MS + UPSTREAM_TIMEOUT_MS + 1000);
    // The store starts empty: the replicas hold the shared decoder still for its first lease.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // The engines' own counts, every 10 ms.
    let watch = Arc::new(Watch::default());
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (watch, watching) = (Arc::clone(&watch), Arc::clone(&watching));
        let targets: Vec<(String, SocketAddr, bool)> = engines
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.decode)
            .map(|e| (e.name.clone(), e.http, e.name == "nixl"))
            .collect();
        tokio::spawn(async move {
            while watching.load(Ordering::Relaxed) {
                for (name, addr, nixl) in &targets {
                    if let Some(v) = get_json(*addr, "/sim/stats").await {
                        watch.check(name, *nixl, &v);
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };

    // The load, with its tallies.
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let classes: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let longest = Arc::new(AtomicU64::new(0));
    let mut latencies_ms: Vec<u64> = Vec::new();
    let lat = Arc::new(Mutex::new(Vec::with_capacity(usize::try_from(requests).unwrap_or(0))));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (next, done, classes, longest, lat, publics) = (
            Arc::clone(&next),
            Arc::clone(&done),
            Arc::clone(&classes),
            Arc::clone(&longest),
            Arc::clone(&lat),
            Arc::clone(&publics),
        );
        clients.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    return;
                }
                // Round robin over the replicas up, as a load balancer would.
                let addr = {
                    let p = publics.lock().unwrap();
                    let up: Vec<SocketAddr> = p.iter().flatten().copied().collect();
                    up[usize::try_from(i).unwrap_or(0) % up.len()]
                };
                let t = Instant::now();
                let end = one(addr, i, limit, abort_every).await;
                let took = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
                let mut wait = None;
                let class = match end {
                    End::Ok => {
                        lat.lock().unwrap().push(took);
                        "ok".to_owned()
                    }
                    End::Aborted => "aborted by the client".to_owned(),
                    End::Failed(c, retry) => {
                        wait = retry.map(|r| r.min(BACKOFF_CAP));
                        c
                    }
                    End::Hung => "hung".to_owned(),
                };
                longest.fetch_max(took, Ordering::Relaxed);
                *classes.lock().unwrap().entry(class).or_default() += 1;
                done.fetch_add(1, Ordering::Relaxed);
                // Told to come back later: not before the next request (without it, a moment
                // with every engine of a side out burns thousands of requests on fast 503s).
                if let Some(w) = wait {
                    tokio::time::sleep(w).await;
                }
            }
        }));
    }

    // The faults: an engine crash every `crash_every` requests, in turn; one replica killed
    // half-way and started again a second later.
    let mut crash_no = 0u64;
    let mut readmits = Vec::new();
    let mut replica_killed = false;
    let mut replica_down_for = Duration::ZERO;
    loop {
        let issued = next.load(Ordering::Relaxed).min(requests);
        if done.load(Ordering::Relaxed) >= requests {
            break;
        }
        // Counted in requests served, not sent: requests failing fast while engines are down do
        // not bring the next kill sooner.
        let served = u64::try_from(lat.lock().unwrap().len()).unwrap_or(u64::MAX);
        if crash_every > 0 && served >= (crash_no + 1) * crash_every && issued < requests {
            crash_no += 1;
            let engines = Arc::clone(&engines);
            let i = usize::try_from(crash_no).unwrap_or(0) % 4;
            let (addr, nixl) = {
                let e = &engines.lock().unwrap()[i];
                (e.http, e.name == "nixl")
            };
            let before = get_json(addr, "/sim/stats").await;
            if let Some(v) = &before
                && engines.lock().unwrap()[i].decode
            {
                watch.check(&format!("engine {i}"), nixl, v);
            }
            {
                let mut es = engines.lock().unwrap();
                let e = &mut es[i];
                let running = before.as_ref().and_then(|v| v["running"].as_u64()).unwrap_or(0);
                e.peak_running =
                    e.peak_running.max(before.as_ref().and_then(|v| v["peak_running"].as_u64()).unwrap_or(0));
                e.cut += running;
                e.crashes += 1;
                e.proc = None; // SIGKILL
            }
            tokio::time::sleep(DOWN).await;
            let es = Arc::clone(&engines);
            tokio::task::spawn_blocking(move || es.lock().unwrap()[i].start()).await.unwrap();
            readmits.push(tokio::spawn(readmitted(steady, Arc::clone(&engines), i)));
        }
        if !replica_killed && issued >= requests / 2 {
            replica_killed = true;
            let t = Instant::now();
            publics.lock().unwrap()[1] = None;
            drop(replicas.remove(1)); // SIGKILL
            tokio::time::sleep(Duration::from_secs(1)).await;
            let f = file.clone();
            let r = tokio::task::spawn_blocking(move || replica(&f)).await.unwrap();
            publics.lock().unwrap()[1] = Some(r.public);
            replicas.insert(1, r);
            replica_down_for = t.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for c in clients {
        c.await.unwrap();
    }
    let mut readmit_ms = Vec::new();
    let mut not_readmitted = Vec::new();
    for r in readmits {
        match r.await.unwrap() {
            (_, Some(Some(took))) => readmit_ms.push(u64::try_from(took.as_millis()).unwrap_or(u64::MAX)),
            (name, Some(None)) => not_readmitted.push(name),
            (_, None) => {} // killed again first
        }
    }
    readmit_ms.sort_unstable();
    let load_took = started.elapsed();
    let load_end = Instant::now();

    // Everything free: pages, blocks, running requests, producers' blocks, replicas' slots.
    let mut free_after = None;
    while free_after.is_none() {
        let addrs: Vec<SocketAddr> = engines.lock().unwrap().iter().map(|e| e.http).collect();
        let mut all = true;
        for a in &addrs {
            all &= get_json(*a, "/sim/stats").await.is_some_and(|v| idle(&v));
        }
        for r in &replicas {
            let m = get_json(r.admin, "/metrics").await;
            let text = m.as_ref().and_then(Value::as_str).unwrap_or("");
            all &= !text.is_empty() && metric_sum(text, "baton_decoder_slots_reserved") == 0.0;
        }
        if all {
            free_after = Some(load_end.elapsed());
        } else if load_end.elapsed() > Duration::from_millis(3 * LEASE_MS + 6000) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    watching.store(false, Ordering::Relaxed);
    watcher.await.unwrap();
    let mut end_stats = Vec::new();
    {
        let addrs: Vec<(String, SocketAddr, bool)> =
            engines.lock().unwrap().iter().map(|e| (e.name.clone(), e.http, e.decode)).collect();
        for (name, a, decode) in addrs {
            let v = get_json(a, "/sim/stats").await.unwrap_or(Value::Null);
            if decode {
                watch.check(&name, name == "nixl", &v);
            }
            let mut es = engines.lock().unwrap();
            if let Some(e) = es.iter_mut().find(|e| e.name == name) {
                e.peak_running = e.peak_running.max(v["peak_running"].as_u64().unwrap_or(0));
            }
            end_stats.push(json!({"engine": name, "stats": v}));
        }
    }
    let mut replica_metrics = Vec::new();
    for r in &replicas {
        let text = get_json(r.admin, "/metrics")
            .await
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| {
                l.starts_with("baton_decoder_slots_reserved{")
                    || l.starts_with("baton_decoder_slots_lingered_total{")
            })
            .collect();
        replica_metrics.push(json!({
            "slots": lines,
            "slots_reserved": metric_sum(&text, "baton_decoder_slots_reserved"),
            "retries": metric_sum(&text, "baton_retries_total"),
        }));
    }

    // The verdicts.
    let classes = classes.lock().unwrap().clone();
    latencies_ms.extend(lat.lock().unwrap().iter().copied());
    latencies_ms.sort_unstable();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let pct = |p: f64| {
        latencies_ms
            .get(((latencies_ms.len() as f64 * p) as usize).min(latencies_ms.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let mut failures = Vec::new();
    let unexpected: Vec<(&String, &u64)> = classes
        .iter()
        .filter(|(c, _)| {
            !matches!(c.as_str(), "ok" | "aborted by the client") && !EXPECTED.iter().any(|(e, _)| e == c)
        })
        .collect();
    if !unexpected.is_empty() {
        failures.push(format!("errors of unexpected classes: {unexpected:?}"));
    }
    let longest_ms = longest.load(Ordering::Relaxed);
    if longest_ms > u64::try_from(limit.as_millis()).unwrap_or(u64::MAX) {
        failures.push(format!("a request took {longest_ms} ms, past the gateway's longest ({limit:?})"));
    }
    let violations = watch.violations.lock().unwrap().clone();
    if !violations.is_empty() {
        failures
            .push(format!("over-commit or accounting errors: {:?}", &violations[..violations.len().min(5)]));
    }
    if free_after.is_none() {
        failures.push(format!(
            "not everything free {:?} after the load: {end_stats:?} {replica_metrics:?}",
            load_end.elapsed()
        ));
    }
    if !not_readmitted.is_empty() {
        failures.push(format!(
            "restarted engines not offered requests again within {READMIT_WITHIN:?}: {not_readmitted:?}"
        ));
    }
    let ok = classes.get("ok").copied().unwrap_or(0);
    // Each fault costs some requests (a tenth are aborted by their clients besides); with the
    // clients honouring `Retry-After`, a run here completes 85-92 % of them.
    if ok < requests / 2 {
        failures.push(format!("only {ok} of {requests} requests completed"));
    }
    let es = engines.lock().unwrap();
    let crashes: Vec<Value> = es
        .iter()
        .map(|e| {
            json!({"engine": e.name, "crashes": e.crashes, "requests_running_when_killed": e.cut,
                        "peak_running": e.peak_running})
        })
        .collect();
    let cut_by_crashes: u64 = es.iter().map(|e| e.cut).sum();
    let crash_count: u64 = es.iter().map(|e| e.crashes).sum();
    drop(es);
    let report = json!({
        "requests": requests,
        "clients": CLIENTS,
        "took_s": load_took.as_secs_f64(),
        "requests_per_s": requests as f64 / load_took.as_secs_f64(),
        "ends": classes,
        "expected_error_classes": EXPECTED.iter().map(|(c, why)| json!({"class": c, "why": why})).collect::<Vec<_>>(),
        "completed_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": latencies_ms.last().copied().unwrap_or(0)},
        "longest_request_ms": longest_ms,
        "deadline_ms": u64::try_from(limit.as_millis()).unwrap_or(0),
        "faults": {
            "client_aborts_share": 0.1,
            "engine_crashes": crash_count,
            "engine_crash_every_requests": crash_every,
            "requests_running_on_killed_engines": cut_by_crashes,
            "requests_running_on_killed_engines_share": cut_by_crashes as f64 / requests as f64,
            "ready_signals_dropped": format!("1 in {DROP_READY_EVERY} (two ranks)"),
            "replica_killed_and_back_after_s": replica_down_for.as_secs_f64(),
            "per_engine": crashes,
        },
        "no_over_commit": {
            "samples": watch.samples.load(Ordering::Relaxed),
            "most_pages_held_by_a_native_rank": watch.most_pages.load(Ordering::Relaxed),
            "native_rank_pages": PAGES,
            "most_nixl_running": watch.most_nixl_running.load(Ordering::Relaxed),
            "nixl_capacity": NIXL_CAPACITY,
            "violations": violations.len(),
        },
        "everything_free_after_s": free_after.map(|d| d.as_secs_f64()),
        "restarted_engine_routed_again_ms": {
            "restarts": readmit_ms.len() + not_readmitted.len(),
            "p50": readmit_ms.get(readmit_ms.len() / 2),
            "max": readmit_ms.last(),
            "not_within_limit": not_readmitted,
            "limit_ms": u64::try_from(READMIT_WITHIN.as_millis()).unwrap_or(0),
        },
        "replicas": replica_metrics,
        "failures": failures,
    });
    assert!(failures.is_empty(), "{}", serde_json::to_string_pretty(&report).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(report)
}
