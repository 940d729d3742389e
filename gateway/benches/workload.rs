//! The workload benchmark: multi-turn chat with shared system prompts, open-loop arrivals at a sweep
//! of rates, over 2 prefill and 2 decode simulated engines that are prefix caches, behind each
//! router in turn.
//!
//! ```text
//! scripts/fetch-routers
//! cargo bench -p baton-gateway --bench workload -- --out bench/gateway-workload.json
//! ```
//!
//! Routers, each a process of its own in front of the same engines (started afresh for every run,
//! so every router starts from cold caches, then is sent each system prompt once, all at once,
//! and places them as it would; not in the quick run): baton (`baton serve`, vllm-nixl mode) with
//! `round-robin`, `least-loaded`, `cache-aware` without KV events (approximate), `cache-aware`
//! with the engines' KV events (exact), and exact without prefill skipping; SMG 1.13
//! (`--pd-disaggregation --policy cache_aware`, SGLang's PD flow); vllm-router 0.1.17
//! (`--vllm-pd-disaggregation --policy kv_aware --pd-kv-events`, vLLM's NIXL flow). The routers
//! come from `scripts/fetch-routers` (`.cache/routers`).
//!
//! The engines (`baton_sim`, in this process): each a prefix cache of `CACHE_BLOCKS` blocks of 16
//! tokens (LRU) that publishes vLLM-format KV events, whose prefill takes `PREFILL_FIXED` plus
//! `PREFILL_PER_TOKEN` for every token not cached, one prefill at a time (`prefill_lanes = 1`:
//! later ones queue, as in an engine's scheduler), and whose decoder takes `TOKEN_DELAY` per token.
//! Each speaks vLLM's NIXL connector and SGLang's PD protocol at once. Tokens are bytes (the
//! simulator's tokenizer, which baton's fallback matches).
//!
//! The workload, the same for every router (seeded): `SYSTEM_PROMPTS` system prompts of
//! `SYSTEM_TOKENS` tokens shared by the conversations (more than one engine's cache holds with
//! the histories, less than two: where a prefix is computed decides whether it is found again); `rate × THINK` conversations open at a
//! time (at least 4), each `TURNS` turns long (a user message of `USER_TOKENS`, an answer of `ANSWER_TOKENS` kept
//! in the history as fixed text), a finished one replaced by a new one. Requests arrive as a Poisson
//! process at each rate, each the next turn of the next conversation in turn (open loop: nothing
//! waits for an answer), streaming chat completions of `ANSWER_TOKENS` tokens.
//!
//! Measured over the requests that arrive after the first `WARMUP` of a run: TTFT p50/p90 (a
//! request that never got a token counts as `REQUEST_TIMEOUT`), output tokens/s received while
//! requests arrive, the engines' cache hit ratio (cached / computed prompt tokens, from each
//! engine's `/sim/stats` counters), prompts a decoder computed itself (prefill skipped), errors.
//! `BATON_BENCH_QUICK=1`: one rate for 3 s per router (the suite's smoke run: every router must
//! serve). `--rates 1,4,8`, `--seconds N` and `--routers smg,exact` (names containing any) narrow
//! a run.

#![allow(
    clippy::print_stdout,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss,
    clippy::cast_sign_loss
)]

mod common;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use baton_sim::cache::{CacheConfig, EventsConfig};
use baton_sim::{Running, SglangSimConfig, SimConfig, SimRole, launch, tiny_geometry};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

const PREFILLS: usize = 2;
const DECODERS: usize = 2;
const CACHE_BLOCKS: usize = 2048;
const BLOCK_SIZE: u32 = 16;
const PREFILL_FIXED: Duration = Duration::from_millis(4);
const PREFILL_PER_TOKEN: Duration = Duration::from_micros(200);
const TOKEN_DELAY: Duration = Duration::from_millis(4);

/// 12 system prompts of 3000 tokens (36,000) plus the open conversations' histories are more than
/// one engine's cache holds (`CACHE_BLOCKS` × `BLOCK_SIZE` = 32,768 tokens) and less than two
/// do: where a prompt is computed decides whether it is found again.
const SYSTEM_PROMPTS: usize = 12;
const SYSTEM_TOKENS: usize = 3000;
const USER_TOKENS: usize = 120;
const ANSWER_TOKENS: usize = 24;
/// The answer's text as the history keeps it (bytes: tokens).
const ANSWER_TEXT: usize = 100;
const TURNS: usize = 6;
/// Time between a conversation's turns, on average: `rate × THINK` conversations are open at once.
const THINK: f64 = 6.0;
const SEED: u64 = 0x6261_746f_6e21;
/// The share of a run before measuring starts.
const WARMUP: f64 = 0.25;
/// How long a request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A router under test.
#[derive(Clone, Copy, Debug)]
enum Router {
    Baton { policy: &'static str, events: bool, skip_prefill: bool },
    Smg,
    Vllm,
}

impl Router {
    const ALL: [Self; 7] = [
        Self::Baton { policy: "round-robin", events: false, skip_prefill: false },
        Self::Baton { policy: "least-loaded", events: false, skip_prefill: false },
        Self::Baton { policy: "cache-aware", events: false, skip_prefill: false },
        Self::Baton { policy: "cache-aware", events: true, skip_prefill: false },
        Self::Baton { policy: "cache-aware", events: true, skip_prefill: true },
        Self::Smg,
        Self::Vllm,
    ];

    fn name(self) -> String {
        match self {
            Self::Baton { policy: "cache-aware", events: false, .. } => "baton cache-aware approx".into(),
            Self::Baton { policy: "cache-aware", skip_prefill: true, .. } => "baton cache-aware exact".into(),
            Self::Baton { policy: "cache-aware", .. } => "baton cache-aware exact, no skip".into(),
            Self::Baton { policy, .. } => format!("baton {policy}"),
            Self::Smg => "smg 1.13 cache_aware".into(),
            Self::Vllm => "vllm-router 0.1.17 kv_aware".into(),
        }
    }
}

/// One engine and what a router needs to reach it.
struct Engine {
    running: Running,
    url: String,
    /// The KV-event publisher and its replay socket.
    events: (SocketAddr, SocketAddr),
    /// A prefiller's SGLang bootstrap port.
    bootstrap: Option<u16>,
}

async fn start_engine(role: SimRole) -> Engine {
    let mut c = SimConfig::new(role, tiny_geometry(1).unwrap());
    c.token_delay = TOKEN_DELAY;
    c.block_size = BLOCK_SIZE;
    if role == SimRole::Decode {
        c.pages = 4096;
    }
    c.nixl = Some(baton_sim::nixl::DEFAULT_NIXL_ABORT_TIMEOUT);
    c.sglang = Some(SglangSimConfig::default());
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    c.prefix_cache = Some(CacheConfig {
        blocks: CACHE_BLOCKS,
        block_size: BLOCK_SIZE,
        prefill_fixed: PREFILL_FIXED,
        prefill_per_token: PREFILL_PER_TOKEN,
        prefill_lanes: 1,
        events: Some(EventsConfig { listen: any, replay: Some(any), topic: String::new() }),
    });
    let running = launch(c).await.unwrap();
    let (events, replay) = running.engine.cache.as_ref().and_then(|c| c.published_at).unwrap();
    let bootstrap = running.engine.stats()["sglang"]["bootstrap"]
        .as_str()
        .map(|a| a.parse::<SocketAddr>().unwrap().port());
    let url = format!("http://{}", running.addr);
    Engine { running, url, events: (events, replay.unwrap()), bootstrap }
}

/// The engines' summed cache counters: `(computed prompt tokens, of them cached, prompts decoders
/// computed)`.
fn cache_counters(prefills: &[Engine], decoders: &[Engine]) -> (u64, u64, u64) {
    let get = |e: &Engine, k: &str| e.running.engine.stats()["prefix_cache"][k].as_u64().unwrap_or(0);
    let all = prefills.iter().chain(decoders);
    let tokens = all.clone().map(|e| get(e, "computed_prompt_tokens")).sum();
    let cached = all.map(|e| get(e, "computed_cached_tokens")).sum();
    let alone = decoders.iter().map(|e| get(e, "computed_prompts")).sum();
    (tokens, cached, alone)
}

fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/workload-<hash>
    exe.ancestors().nth(3).unwrap().join("bench-workload")
}

fn routers_bin(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let p = root.join(".cache/routers/bin").join(name);
    assert!(p.exists(), "{} is missing: run scripts/fetch-routers", p.display());
    p
}

/// baton's configuration for the run.
fn baton_config(port: u16, policy: &str, events: bool, skip: bool, p: &[Engine], d: &[Engine]) -> String {
    let g = tiny_geometry(1).unwrap();
    let mut s = format!(
        "[[listeners]]\naddress = \"127.0.0.1:{port}\"\nplain_http = true\n\n[model]\nname = \"baton-sim\"\n\
         context_length = 32768\nchunk_tokens = 16\ngeometry = {{ layers = {}, kv_heads = {}, head_dim = {}, \
         dtype_bytes = {} }}\n\n",
        g.layers, g.kv_heads, g.head_dim, g.dtype_bytes
    );
    let ev = |e: &Engine| {
        if events {
            format!("kv_events = \"{}\"\nkv_events_replay = \"{}\"\n", e.events.0, e.events.1)
        } else {
            String::new()
        }
    };
    for (i, e) in p.iter().enumerate() {
        write!(s, "[[prefill]]\nname = \"prefill-{i}\"\nurl = \"{}\"\n{}\n", e.url, ev(e)).unwrap();
    }
    for (i, e) in d.iter().enumerate() {
        write!(
            s,
            "[[decode]]\nname = \"decode-{i}\"\nurl = \"{}\"\nhandoff = \"vllm-nixl\"\n{}\n",
            e.url,
            ev(e)
        )
        .unwrap();
    }
    write!(s, "[admission]\nqueue_timeout_ms = 60000\n\n[routing]\npolicy = \"{policy}\"\n").unwrap();
    if policy == "cache-aware" {
        write!(s, "\n[routing.cache]\nskip_prefill = {skip}\n").unwrap();
    }
    s
}

/// Starts the router in front of the engines: its process and its address.
fn start_router(r: Router, p: &[Engine], d: &[Engine], log: &Path) -> (Child, SocketAddr) {
    let port = common::free_port().port();
    let mut cmd = match r {
        Router::Baton { policy, events, skip_prefill } => {
            let cfg = log.with_extension("toml");
            std::fs::write(&cfg, baton_config(port, policy, events, skip_prefill, p, d)).unwrap();
            let mut c = Command::new(env!("CARGO_BIN_EXE_baton"));
            c.arg("serve").arg("--config").arg(&cfg);
            c
        }
        Router::Smg => {
            let mut c = Command::new(routers_bin("smg"));
            c.args(["launch", "--host", "127.0.0.1", "--port", &port.to_string()]);
            c.args(["--prometheus-port", &common::free_port().port().to_string(), "--pd-disaggregation"]);
            for e in p {
                c.arg("--prefill").arg(&e.url).arg(e.bootstrap.unwrap().to_string());
            }
            for e in d {
                c.arg("--decode").arg(&e.url);
            }
            c.args(["--policy", "cache_aware", "--disable-tokenizer-autoload"]);
            c
        }
        Router::Vllm => {
            let mut c = Command::new(routers_bin("vllm-router"));
            c.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
            c.args([
                "--prometheus-port",
                &common::free_port().port().to_string(),
                "--vllm-pd-disaggregation",
            ]);
            for e in p {
                c.arg("--prefill").arg(&e.url);
            }
            for e in d {
                c.arg("--decode").arg(&e.url);
            }
            c.args(["--policy", "kv_aware", "--kv-event-block-size", &BLOCK_SIZE.to_string()]);
            for e in p {
                c.arg("--pd-kv-events").arg(format!("{}=tcp://{}", e.url, e.events.0));
            }
            c
        }
    };
    let out = std::fs::File::create(log).unwrap();
    let child = cmd.stdout(out.try_clone().unwrap()).stderr(out).stdin(Stdio::null()).spawn().unwrap();
    (child, SocketAddr::from(([127, 0, 0, 1], port)))
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(conn)
}

/// What one request saw.
#[derive(Clone, Copy, Debug, Default)]
struct Outcome {
    /// Time to the first token, or how long it waited without one.
    ttft: Duration,
    got_token: bool,
    ok: bool,
    /// baton sent it to the decoder alone (`x-baton-route: prefill=none`).
    alone: bool,
}

/// Sends one streaming chat completion; counts its tokens into `tokens` while `counting` says so.
async fn send(c: &HttpClient, addr: SocketAddr, body: Bytes, window: Arc<Window>) -> Outcome {
    let t = Instant::now();
    let req = hyper::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let mut out = Outcome::default();
    let run = async {
        let Ok(res) = c.request(req).await else { return };
        if res.status() != 200 {
            return;
        }
        out.alone =
            res.headers().get("x-baton-route").is_some_and(|v| v.as_bytes().starts_with(b"prefill=none"));
        let mut body = res.into_body();
        let mut buf = Vec::new();
        while let Some(Ok(frame)) = body.frame().await {
            let Ok(data) = frame.into_data() else { continue };
            buf.extend_from_slice(&data);
            while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                let Some(d) = event.strip_prefix(b"data: ") else { continue };
                if d.starts_with(b"[DONE]") {
                    out.ok = true;
                    return;
                }
                let Ok(v) = serde_json::from_slice::<Value>(d) else { continue };
                let has = v["choices"][0]["delta"]["content"].as_str().is_some_and(|s| !s.is_empty());
                if has {
                    if !out.got_token {
                        out.got_token = true;
                        out.ttft = t.elapsed();
                    }
                    window.token();
                }
            }
        }
    };
    let _ = tokio::time::timeout(REQUEST_TIMEOUT, run).await;
    if !out.got_token {
        // A request that got no token counts as the longest wait, however fast it was refused.
        out.ttft = REQUEST_TIMEOUT;
    }
    out
}

/// The measuring window: tokens received inside it.
struct Window {
    start: Instant,
    from: Duration,
    to: Duration,
    tokens: AtomicU64,
}

impl Window {
    /// A window that counts nothing (probes and warm-up requests).
    fn uncounted() -> Arc<Self> {
        let now = Instant::now();
        Arc::new(Self { start: now, from: Duration::ZERO, to: Duration::ZERO, tokens: 0.into() })
    }

    fn token(&self) {
        let at = self.start.elapsed();
        if at >= self.from && at < self.to {
            self.tokens.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Seeded filler text of `n` bytes.
fn text(rng: &mut StdRng, n: usize) -> String {
    const WORDS: [&str; 16] = [
        "kv ", "cache ", "prefill ", "decode ", "baton ", "router ", "token ", "block ", "engine ", "page ",
        "queue ", "slot ", "prefix ", "batch ", "model ", "turn ",
    ];
    let mut s = String::with_capacity(n + 8);
    while s.len() < n {
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        if rng.random_bool(0.1) {
            write!(s, "{} ", rng.random_range(0..10_000)).unwrap();
        }
    }
    s.truncate(n);
    s
}

/// The shared system prompts (seeded: the same for every router and rate).
fn system_prompts(rng: &mut StdRng) -> Vec<String> {
    (0..SYSTEM_PROMPTS).map(|i| format!("You are assistant {i}. {}", text(rng, SYSTEM_TOKENS))).collect()
}

/// Each system prompt once, alone (one token asked), to send before a run: a fleet serving these
/// prompts has them in cache somewhere already, where its router put them.
fn warm_requests() -> Vec<Bytes> {
    let mut rng = StdRng::seed_from_u64(SEED);
    system_prompts(&mut rng)
        .into_iter()
        .map(|s| {
            let body = json!({"model": "baton-sim", "messages": [{"role": "system", "content": s}],
                              "max_tokens": 1, "stream": true});
            Bytes::from(body.to_string())
        })
        .collect()
}

/// The requests of a run, at their arrival times: the same for every router.
fn schedule(rate: f64, duration: Duration) -> Vec<(Duration, Bytes)> {
    let mut rng = StdRng::seed_from_u64(SEED);
    let systems = system_prompts(&mut rng);
    let open = ((rate * THINK).ceil() as usize).max(4);
    let mut convs: Vec<Vec<Value>> = Vec::new();
    let new_conv = |rng: &mut StdRng| {
        let s = &systems[rng.random_range(0..SYSTEM_PROMPTS)];
        vec![json!({"role": "system", "content": s})]
    };
    for _ in 0..open {
        convs.push(new_conv(&mut rng));
    }
    let (mut at, mut out, mut next) = (0.0f64, Vec::new(), 0usize);
    loop {
        at += -(1.0 - rng.random::<f64>()).ln() / rate;
        if at >= duration.as_secs_f64() {
            return out;
        }
        let i = next % open;
        next += 1;
        if convs[i].len() > 2 * TURNS {
            convs[i] = new_conv(&mut rng);
        }
        let user = text(&mut rng, USER_TOKENS);
        convs[i].push(json!({"role": "user", "content": user}));
        let body = json!({"model": "baton-sim", "messages": convs[i], "max_tokens": ANSWER_TOKENS,
                          "stream": true});
        out.push((Duration::from_secs_f64(at), Bytes::from(body.to_string())));
        let answer = text(&mut rng, ANSWER_TEXT);
        convs[i].push(json!({"role": "assistant", "content": answer}));
    }
}

/// One router at one rate.
#[derive(Debug)]
struct Point {
    router: String,
    rate: f64,
    requests: usize,
    ttft_p50_ms: f64,
    ttft_p90_ms: f64,
    output_tok_s: f64,
    hit_ratio: f64,
    prefill_skipped: u64,
    /// TTFT p50/p90 of the measured requests baton sent to the decoder alone, and of the others
    /// (NaN where there were none).
    alone_ms: (f64, f64),
    with_leg_ms: (f64, f64),
    errors: usize,
}

/// A figure for the JSON: one decimal, or `null` for none.
fn num(x: f64) -> String {
    if x.is_finite() { format!("{x:.1}") } else { "null".to_owned() }
}

fn pct(sorted: &[Duration], q: f64) -> f64 {
    common::percentile(sorted, q).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

async fn wait_ready(c: &HttpClient, addr: SocketAddr, child: &mut Child, log: &Path) {
    let probe = json!({"model": "baton-sim", "messages": [{"role": "user", "content": "ready?"}],
                       "max_tokens": 1, "stream": true})
    .to_string();
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the router exited ({status}) before it was ready; see {}", log.display());
        }
        let w = Window::uncounted();
        if send(c, addr, Bytes::from(probe.clone()), w).await.ok {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "the router never answered; see {}",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn run(router: Router, rate: f64, duration: Duration, warm_caches: bool) -> Point {
    let mut prefills = Vec::new();
    for _ in 0..PREFILLS {
        prefills.push(start_engine(SimRole::Prefill).await);
    }
    let mut decoders = Vec::new();
    for _ in 0..DECODERS {
        decoders.push(start_engine(SimRole::Decode).await);
    }
    let dir = target_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let slug: String =
        router.name().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    let log = dir.join(format!("{slug}-{rate}.log"));
    let (mut child, addr) = start_router(router, &prefills, &decoders, &log);
    let c = client();
    wait_ready(&c, addr, &mut child, &log).await;
    if warm_caches {
        // The system prompts, all at once, through the router: it places them as it would.
        let w = Window::uncounted();
        let sent = warm_requests().into_iter().map(|body| send(&c, addr, body, Arc::clone(&w)));
        let warmed = futures_util::future::join_all(sent).await;
        assert!(warmed.iter().all(|o| o.ok), "a warm-up request failed; see {}", log.display());
    }
    // KV events from the engines reach every subscriber before traffic starts.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let plan = schedule(rate, duration);
    let warm = duration.mul_f64(WARMUP);
    let start = Instant::now();
    let window = Arc::new(Window { start, from: warm, to: duration, tokens: 0.into() });
    let mut tasks = tokio::task::JoinSet::new();
    let mut before = None;
    for (at, body) in plan {
        if before.is_none() && at >= warm {
            tokio::time::sleep_until((start + warm).into()).await;
            before = Some(cache_counters(&prefills, &decoders));
        }
        tokio::time::sleep_until((start + at).into()).await;
        let (c, w) = (c.clone(), Arc::clone(&window));
        tasks.spawn(async move { (at >= warm, send(&c, addr, body, w).await) });
    }
    tokio::time::sleep_until((start + duration).into()).await;
    let after = cache_counters(&prefills, &decoders);
    let mut outcomes = Vec::new();
    while let Some(r) = tasks.join_next().await {
        let (measured, o) = r.unwrap();
        if measured {
            if std::env::var_os("BATON_BENCH_TRACE").is_some() {
                println!("  ttft {:>8.1} ms  alone {}  ok {}", o.ttft.as_secs_f64() * 1e3, o.alone, o.ok);
            }
            outcomes.push(o);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    for e in prefills.into_iter().chain(decoders) {
        e.running.shutdown().await;
    }
    let before = before.unwrap_or((0, 0, 0));
    let mut ttft: Vec<Duration> = outcomes.iter().map(|o| o.ttft).collect();
    ttft.sort();
    let computed = after.0 - before.0;
    let split = |alone: bool| {
        let mut t: Vec<Duration> = outcomes.iter().filter(|o| o.alone == alone).map(|o| o.ttft).collect();
        t.sort();
        (pct(&t, 0.5), pct(&t, 0.9))
    };
    Point {
        router: router.name(),
        rate,
        requests: outcomes.len(),
        ttft_p50_ms: pct(&ttft, 0.5),
        ttft_p90_ms: pct(&ttft, 0.9),
        output_tok_s: window.tokens.load(Ordering::Relaxed) as f64 / (duration - warm).as_secs_f64(),
        hit_ratio: if computed == 0 { 0.0 } else { (after.1 - before.1) as f64 / computed as f64 },
        prefill_skipped: after.2 - before.2,
        alone_ms: split(true),
        with_leg_ms: split(false),
        errors: outcomes.iter().filter(|o| !o.ok).count(),
    }
}

/// The issue's acceptance, read off the points: at every rate where round-robin's p90 TTFT is at
/// least 4× its value at the lowest rate run, how cache-aware exact compares.
fn verdict(points: &[Point]) {
    let at = |router: &str, rate: f64| points.iter().find(|p| p.router == router && p.rate == rate);
    let mut rr: Vec<&Point> = points.iter().filter(|p| p.router == "baton round-robin").collect();
    rr.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let Some(unloaded) = rr.first() else { return };
    let loaded: Vec<&&Point> = rr.iter().filter(|p| p.ttft_p90_ms >= 4.0 * unloaded.ttft_p90_ms).collect();
    if loaded.is_empty() {
        println!(
            "round-robin's p90 TTFT never reached 4x its {:.1} ms at {} req/s",
            unloaded.ttft_p90_ms, unloaded.rate
        );
    }
    for rr in loaded {
        let rate = rr.rate;
        println!(
            "at {rate} req/s round-robin's p90 TTFT is {:.1} ms, {:.1}x its {:.1} ms at {} req/s:",
            rr.ttft_p90_ms,
            rr.ttft_p90_ms / unloaded.ttft_p90_ms,
            unloaded.ttft_p90_ms,
            unloaded.rate
        );
        let Some(exact) = at("baton cache-aware exact", rate) else { continue };
        let holds = |ok: bool| if ok { "holds" } else { "FAILS" };
        for (name, factor, what) in [
            ("baton least-loaded", 0.5, "<= half of least-loaded's"),
            ("smg 1.13 cache_aware", 1.0, "<= SMG cache_aware's"),
            ("vllm-router 0.1.17 kv_aware", 1.0, "<= vllm-router kv_aware's"),
        ] {
            if let Some(o) = at(name, rate) {
                let ok = exact.ttft_p90_ms <= factor * o.ttft_p90_ms;
                println!(
                    "  exact p90 {:.1} ms {} {what} ({name}: {:.1} ms)",
                    exact.ttft_p90_ms,
                    holds(ok),
                    o.ttft_p90_ms
                );
            }
        }
        println!(
            "  exact output {:.1} tok/s = {:.2}x round-robin's {:.1}: at least 1.25x {}",
            exact.output_tok_s,
            exact.output_tok_s / rr.output_tok_s,
            rr.output_tok_s,
            holds(exact.output_tok_s >= 1.25 * rr.output_tok_s)
        );
        if let Some(no_skip) = at("baton cache-aware exact, no skip", rate) {
            println!(
                "  prefill skipped {} times: p50/p90 TTFT {:.1}/{:.1} ms, against {:.1}/{:.1} ms with every prefill leg",
                exact.prefill_skipped,
                exact.ttft_p50_ms,
                exact.ttft_p90_ms,
                no_skip.ttft_p50_ms,
                no_skip.ttft_p90_ms
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let rates: Vec<f64> = match arg("--rates") {
        Some(r) => r.split(',').map(|x| x.parse().unwrap()).collect(),
        None if quick => vec![8.0],
        None => vec![1.0, 4.0, 8.0, 12.0, 16.0, 20.0],
    };
    let duration =
        Duration::from_secs(arg("--seconds").map_or(if quick { 3 } else { 30 }, |s| s.parse().unwrap()));
    let only = arg("--routers");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut points = Vec::new();
    for router in Router::ALL {
        if only.as_ref().is_some_and(|o| !o.split(',').any(|n| router.name().contains(n))) {
            continue;
        }
        for &rate in &rates {
            let p = rt.block_on(run(router, rate, duration, !quick));
            println!(
                "{:<32} {:>5.1} req/s {:>5} req  TTFT p50 {:>8.1} ms  p90 {:>8.1} ms  out {:>7.1} tok/s  hit {:>5.3}  skipped {:>4}  errors {}",
                p.router,
                p.rate,
                p.requests,
                p.ttft_p50_ms,
                p.ttft_p90_ms,
                p.output_tok_s,
                p.hit_ratio,
                p.prefill_skipped,
                p.errors
            );
            if p.alone_ms.0.is_finite() {
                println!(
                    "{:<32} TTFT p50/p90 sent alone {:.1}/{:.1} ms, with a prefill leg {:.1}/{:.1} ms",
                    "", p.alone_ms.0, p.alone_ms.1, p.with_leg_ms.0, p.with_leg_ms.1
                );
            }
            points.push(p);
        }
    }
    let rows: Vec<String> = points
        .iter()
        .map(|p| {
            format!(
                "    {{\"router\": \"{}\", \"rate\": {}, \"requests\": {}, \"ttft_p50_ms\": {:.1}, \"ttft_p90_ms\": {:.1}, \"output_tok_s\": {:.1}, \"hit_ratio\": {:.3}, \"prefill_skipped\": {}, \"alone_ttft_p50_ms\": {}, \"alone_ttft_p90_ms\": {}, \"with_leg_ttft_p50_ms\": {}, \"with_leg_ttft_p90_ms\": {}, \"errors\": {}}}",
                p.router, p.rate, p.requests, p.ttft_p50_ms, p.ttft_p90_ms, p.output_tok_s, p.hit_ratio, p.prefill_skipped,
                num(p.alone_ms.0), num(p.alone_ms.1), num(p.with_leg_ms.0), num(p.with_leg_ms.1), p.errors
            )
        })
        .collect();
    // `cargo bench` runs a bench in its package's directory: a relative path is the workspace's.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned();
    if let Some(path) = arg("--out").map(|p| root.join(p).display().to_string()) {
        let json = format!(
            "{{\n  \"bench\": \"gateway-workload\",\n  \"quick\": {quick},\n  \"seconds\": {},\n  \"engines\": {{\"prefill\": {PREFILLS}, \"decode\": {DECODERS}, \"cache_blocks\": {CACHE_BLOCKS}, \"block_size\": {BLOCK_SIZE}, \"prefill_fixed_ms\": {}, \"prefill_us_per_token\": {}, \"prefill_lanes\": 1, \"token_delay_ms\": {}}},\n  \"workload\": {{\"system_prompts\": {SYSTEM_PROMPTS}, \"system_tokens\": {SYSTEM_TOKENS}, \"user_tokens\": {USER_TOKENS}, \"answer_text\": {ANSWER_TEXT}, \"answer_tokens\": {ANSWER_TOKENS}, \"turns\": {TURNS}, \"think_s\": {THINK}, \"warmup\": {WARMUP}}},\n  \"points\": [\n{}\n  ]\n}}\n",
            duration.as_secs(),
            PREFILL_FIXED.as_millis(),
            PREFILL_PER_TOKEN.as_micros(),
            TOKEN_DELAY.as_millis(),
            rows.join(",\n")
        );
        std::fs::write(&path, json).unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        println!("wrote {path}");
    }
    verdict(&points);
    // In the smoke run every router must have served: a router that answers nothing fails it.
    for p in &points {
        assert!(p.requests > 0, "{} at {} req/s: no request was measured", p.router, p.rate);
        assert!(p.errors < p.requests, "{}: every request failed", p.router);
    }
}
