//! Three `baton serve` replicas in front of one decoder, on the real binaries and a real Redis
//! (Debian's, started here): never more requests on the decoder than it holds, counted by the
//! engine itself; a replica killed with SIGKILL gives its share back within its lease; Redis
//! stopped and restarted empty under load over-commits nothing. The native mode needs no store:
//! its decoder's ranks refuse what does not fit, and a killed replica's reservations lapse.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use baton_sim::{Running, SglangSimConfig, SimConfig, SimRole, launch, tiny_geometry};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use super::drain::{Proc, spawn};
use super::{http, prompt};

/// Requests the decoder holds at once (`max_in_flight`).
const CAPACITY: u64 = 4;
/// The replicas' lease: a killed replica's share is back within it (plus one sync).
const LEASE_MS: u64 = 1000;

/// A Redis server on a free loopback port, killed when dropped.
struct Redis {
    child: Option<Child>,
    port: u16,
    bin: PathBuf,
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Redis {
    /// Debian's `redis-server` (`scripts/test` installs it); `None` when it is missing, which
    /// fails the test under `scripts/test` (`BATON_REQUIRE_REDIS`).
    fn start() -> Option<Self> {
        let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/redis/bin/redis-server");
        let bin = if local.exists() {
            local
        } else if let Some(p) = std::env::var_os("PATH")
            .and_then(|p| std::env::split_paths(&p).map(|d| d.join("redis-server")).find(|f| f.exists()))
        {
            p
        } else {
            let why = "no redis-server (scripts/test installs Debian's redis-tools)";
            assert!(std::env::var_os("BATON_REQUIRE_REDIS").is_none(), "{why}");
            super::skip::skipped("tool", why);
            return None;
        };
        // Outside the ephemeral range: a restart binds it again, after the tests' clients have
        // opened many connections meanwhile.
        let port = super::ports::free_port();
        let mut r = Self { child: None, port, bin };
        r.restart();
        Some(r)
    }

    /// Starts it (again, empty: no snapshot, no append-only file) and waits until it answers.
    fn restart(&mut self) {
        let child = Command::new(&self.bin)
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let start = Instant::now();
        let client = redis::Client::open(self.url()).unwrap();
        while client.get_connection().and_then(|mut c| redis::cmd("PING").query::<String>(&mut c)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(10), "redis-server did not answer");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Nixl,
    Sglang,
}

/// A prefill and a decode engine playing `kind`, the decode one taking 30 ms per token.
async fn engines(kind: Kind) -> (Running, Running) {
    let g = tiny_geometry(1).unwrap();
    let mut out = Vec::new();
    for role in [SimRole::Prefill, SimRole::Decode] {
        let mut c = SimConfig::new(role, g);
        c.listen = "127.0.0.1:0".parse().unwrap();
        c.token_delay = Duration::from_millis(if role == SimRole::Decode { 30 } else { 0 });
        match kind {
            Kind::Nixl => c.nixl = Some(Duration::from_secs(30)),
            Kind::Sglang => c.sglang = Some(SglangSimConfig::default()),
        }
        out.push(launch(c).await.unwrap());
    }
    let decode = out.pop().unwrap();
    (out.pop().unwrap(), decode)
}

/// The replicas' file: the decoder holds [`CAPACITY`] requests, shared through `redis`.
fn config(dir: &Path, kind: Kind, prefill: &Running, decode: &Running, redis: &Redis) -> PathBuf {
    let (mode, table) = match kind {
        Kind::Nixl => ("vllm-nixl", "nixl"),
        Kind::Sglang => ("sglang", "sglang"),
    };
    let text = format!(
        "{}\n[[prefill]]\nname = \"p\"\nurl = \"http://{}\"\n\n[[decode]]\nname = \"d\"\nurl = \"http://{}\"\n\
         handoff = \"{mode}\"\n{table} = {{ scrape_interval_ms = 50, max_in_flight = {CAPACITY} }}\n\n\
         [cluster]\nstore = \"{}\"\nlease_ms = {LEASE_MS}\nsync_ms = 20\n",
        super::SERVE_HEAD,
        prefill.addr,
        decode.addr,
        redis.url()
    );
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("baton.toml");
    std::fs::write(&file, text).unwrap();
    file
}

struct Replica {
    proc: Proc,
    public: SocketAddr,
    admin: SocketAddr,
}

fn replicas(file: &Path, n: usize) -> Vec<Replica> {
    (0..n)
        .map(|_| {
            let (proc, public, admin) = spawn(&["serve", "--config", file.to_str().unwrap()]);
            Replica { proc, public, admin }
        })
        .collect()
}

async fn cluster_view(admin: SocketAddr) -> Value {
    let (s, b) = http(admin, "/admin/cluster", None).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    serde_json::from_slice(&b).unwrap()
}

/// What the load saw.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    /// Connections cut (the killed replica's).
    cut: AtomicU64,
    other: std::sync::Mutex<Vec<String>>,
}

/// A completion: its status and body, or why the connection failed.
async fn complete(addr: SocketAddr, body: &Value) -> Result<(u16, Bytes), String> {
    let s = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(s)).await.map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::post("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = res.status().as_u16();
    Ok((status, res.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes()))
}

/// `clients` closed-loop clients per replica, until `stop` (or their replica is marked dead).
fn load(
    addrs: &[SocketAddr],
    tokens: usize,
    clients: usize,
    stop: &Arc<AtomicBool>,
    dead: &Arc<Vec<AtomicBool>>,
    tally: &Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for (a, addr) in addrs.iter().copied().enumerate() {
        for c in 0..clients {
            let (stop, dead, tally) = (Arc::clone(stop), Arc::clone(dead), Arc::clone(tally));
            tasks.push(tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) && !dead[a].load(Ordering::Relaxed) {
                    i += 1;
                    let body = json!({"prompt": prompt(tokens, a * 100_000 + c * 1000 + i), "max_tokens": 4});
                    match complete(addr, &body).await {
                        Ok((200, _)) => _ = tally.ok.fetch_add(1, Ordering::Relaxed),
                        Ok((s, b)) => {
                            tally.other.lock().unwrap().push(format!("{s} {}", String::from_utf8_lossy(&b)))
                        }
                        Err(_) if dead[a].load(Ordering::Relaxed) => {
                            _ = tally.cut.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(e) => tally.other.lock().unwrap().push(format!("connection: {e}")),
                    }
                }
            }));
        }
    }
    tasks
}

fn peak(decode: &Running) -> u64 {
    decode.engine.stats()["peak_running"].as_u64().unwrap()
}

/// The survivors' shares of the decoder sum to its capacity, the store counting `live`
/// replicas, within `within`; how long it took.
async fn shares_settle(admins: &[SocketAddr], live: u64, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let mut sum = 0;
        let mut counted = true;
        for a in admins {
            let v = cluster_view(*a).await;
            sum += v["shared"][0]["share"].as_u64().unwrap();
            counted &= v["shared"][0]["replicas"] == live;
        }
        if counted && sum == CAPACITY {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "shares sum to {sum} of {CAPACITY}, {live} replicas counted: {counted}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn three_replicas(kind: Kind) {
    let Some(mut redis) = Redis::start() else { return };
    let (prefill, decode) = engines(kind).await;
    let dir = std::env::temp_dir().join(format!("baton-cluster-{kind:?}-{}", std::process::id()));
    let file = config(&dir, kind, &prefill, &decode, &redis);
    let mut rs = replicas(&file, 3);
    let publics: Vec<SocketAddr> = rs.iter().map(|r| r.public).collect();

    // 1. Under load through all three (8 clients each, 24 at once against a decoder of 4).
    let stop = Arc::new(AtomicBool::new(false));
    let dead = Arc::new((0..3).map(|_| AtomicBool::new(false)).collect::<Vec<_>>());
    let tally = Arc::new(Tally::default());
    let tasks = load(&publics, 20, 8, &stop, &dead, &tally);
    // (The store starts empty: the replicas hold still for the first lease.)
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 2000)).await;
    let before_kill = tally.ok.load(Ordering::Relaxed);
    assert!(before_kill > 20, "only {before_kill} requests answered");
    assert!(
        peak(&decode) <= CAPACITY,
        "the decoder ran {} requests at once, holding {CAPACITY}",
        peak(&decode)
    );
    assert_eq!(peak(&decode), CAPACITY, "the load never filled the decoder: the test proves nothing");

    // 2. One replica killed (SIGKILL: no drain, no goodbye to the store) while the others stay
    // under load: its share is theirs within the lease.
    let killed = rs.remove(0);
    dead[0].store(true, Ordering::Relaxed);
    drop(killed.proc);
    let admins: Vec<SocketAddr> = rs.iter().map(|r| r.admin).collect();
    let back = shares_settle(&admins, 2, Duration::from_millis(LEASE_MS + 2000)).await;
    eprintln!("{kind:?}: the killed replica's share came back in {back:?} (lease {LEASE_MS} ms)");
    assert!(peak(&decode) <= CAPACITY, "over-committed after the kill: {}", peak(&decode));

    // 3. Redis stopped under load: the replicas keep the shares they held, over-commit nothing,
    // and count the store down.
    redis.stop();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for r in &rs {
        let v = cluster_view(r.admin).await;
        assert_eq!(v["store_up"], false, "{v}");
        let (_, m) = http(r.admin, "/metrics", None).await;
        let m = String::from_utf8_lossy(&m);
        assert!(m.contains("baton_cluster_store_up 0"), "{m}");
        assert!(super::sample_or_zero(&m, "baton_cluster_store_errors_total ") > 0.0, "{m}");
    }
    let during = tally.ok.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(tally.ok.load(Ordering::Relaxed) > during, "nothing answered while the store was down");
    assert!(peak(&decode) <= CAPACITY, "over-committed with the store down: {}", peak(&decode));

    // 4. Redis back, empty (its data lost): the replicas say again what they hold, hold still one
    // lease, and share the decoder again without over-committing it.
    redis.restart();
    let settled = shares_settle(&admins, 2, Duration::from_millis(3 * LEASE_MS + 2000)).await;
    eprintln!("{kind:?}: shares settled {settled:?} after the store came back empty");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    assert!(peak(&decode) <= CAPACITY, "over-committed after the store came back: {}", peak(&decode));
    // Every answer was a completion, or a connection to the killed replica cut.
    let other = tally.other.lock().unwrap().clone();
    assert!(other.is_empty(), "{} answers other than 200: {:?}", other.len(), &other[..other.len().min(5)]);
    eprintln!(
        "{kind:?}: {} completions, {} cut by the kill",
        tally.ok.load(Ordering::Relaxed),
        tally.cut.load(Ordering::Relaxed)
    );
    for r in &rs {
        let v = cluster_view(r.admin).await;
        assert_eq!(v["store_up"], true, "{v}");
    }
    // Nothing left on the decoder.
    let start = Instant::now();
    while decode.engine.stats()["running"] != 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "{}", decode.engine.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_vllm_nixl_replicas_never_over_commit_a_decoder_and_survive_a_kill_and_a_store_outage() {
    three_replicas(Kind::Nixl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sglang_replicas_never_over_commit_a_decoder_and_survive_a_kill_and_a_store_outage() {
    three_replicas(Kind::Sglang).await;
}

/// Native: the decoder's ranks are the truth. Three replicas, each believing it has the whole
/// buffer, never reserve more pages than the ranks hold (the ranks' own count, sampled); a replica
/// killed mid-load leaves pages that come back within the reservation lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_native_replicas_never_over_commit_and_a_killed_ones_pages_come_back_within_the_lease() {
    let Some(redis) = Redis::start() else { return };
    let g = tiny_geometry(2).unwrap();
    // Each chunk to rank 0 takes 20 ms, so a request holds its pages for about 80 ms: the load
    // fills the buffer whichever path the decode takes (with the decode sent alongside the
    // prefill, pages are otherwise held only for the transfer's microseconds).
    let mut pc = SimConfig::new(SimRole::Prefill, g);
    pc.faults.slow_rank = Some(0);
    pc.faults.slow_ms = 20;
    let prefill = launch(pc).await.unwrap();
    let mut dc = SimConfig::new(SimRole::Decode, g);
    dc.pages = 16;
    dc.token_delay = Duration::from_millis(30);
    // Pages a killed replica's prefill was writing when its lease ran out wait for the producer's
    // fence, which a prefill cut off with the replica never sends: free after the quarantine.
    dc.quarantine_ttl = Duration::from_millis(1000);
    let decode = launch(dc).await.unwrap();
    let dir = std::env::temp_dir().join(format!("baton-cluster-native-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("baton.toml");
    let text = super::serve_toml(
        &prefill,
        &decode,
        "",
        &format!(
            "[admission]\nlease_ms = {LEASE_MS}\nready_timeout_ms = 500\n\n[cluster]\nstore = \"{}\"\n",
            redis.url()
        ),
    );
    std::fs::write(&file, text).unwrap();
    let mut rs = replicas(&file, 3);
    let v = cluster_view(rs[0].admin).await;
    assert_eq!((v["engine_truth"].clone(), v["shared"].clone()), (json!(["d"]), json!([])), "{v}");
    let publics: Vec<SocketAddr> = rs.iter().map(|r| r.public).collect();
    let watching = Arc::new(AtomicBool::new(true));
    let (w, sim) = (Arc::clone(&watching), Arc::clone(&decode.engine));
    // The ranks' own accounting, sampled under load: never an error, never more than they hold.
    let watch = tokio::spawn(async move {
        let mut most = 0;
        while w.load(Ordering::Relaxed) {
            let v = sim.stats();
            for r in v["ranks"].as_array().unwrap() {
                assert_eq!(r["accounting_errors"], 0, "{v}");
                let used: u64 = ["pages_reserved", "pages_filled", "pages_quarantined", "pages_consuming"]
                    .iter()
                    .map(|k| r[*k].as_u64().unwrap())
                    .sum();
                assert_eq!(
                    used + r["pages_free"].as_u64().unwrap(),
                    r["pages_total"].as_u64().unwrap(),
                    "{v}"
                );
                most = most.max(used);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        most
    });
    // 4-page prompts (63 tokens at 16 a page): 4 fit the 16 pages; 24 clients want them.
    let stop = Arc::new(AtomicBool::new(false));
    let dead = Arc::new((0..3).map(|_| AtomicBool::new(false)).collect::<Vec<_>>());
    let tally = Arc::new(Tally::default());
    let tasks = load(&publics, 63, 8, &stop, &dead, &tally);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    dead[0].store(true, Ordering::Relaxed);
    drop(rs.remove(0).proc);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let killed_at = Instant::now();
    watching.store(false, Ordering::Relaxed);
    let most = watch.await.unwrap();
    assert_eq!(most, 16, "the load never filled the buffer: the test proves nothing");
    let other = tally.other.lock().unwrap().clone();
    assert!(other.is_empty(), "{} answers other than 200: {:?}", other.len(), &other[..other.len().min(5)]);
    // Every page back, the killed replica's included, within the lease (and the quarantine of
    // pages it was writing).
    loop {
        let v = decode.engine.stats();
        if super::ranks_clean(&v) {
            break;
        }
        assert!(killed_at.elapsed() < Duration::from_millis(LEASE_MS + 1000 + 2000), "{v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "native: {} completions, {} cut by the kill; every page free {:?} after the load stopped",
        tally.ok.load(Ordering::Relaxed),
        tally.cut.load(Ordering::Relaxed),
        killed_at.elapsed()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The share script alone, on a real Redis, driven as replicas would drive it: the granted
/// shares never sum past the capacity; the longest waiter gets room even when it needs the whole
/// decoder; a smaller grant is recorded only once applied; a call overtaken by a later one
/// changes nothing; a replica whose lease runs out loses its share; a store that starts empty,
/// or that nobody reached for a lease, holds everyone still for one lease, and a replica that
/// re-registers keeps what it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_share_script_never_grants_past_capacity_and_serves_the_longest_waiter() {
    let Some(mut redis) = Redis::start() else { return };
    let script = redis::Script::new(include_str!("../../src/cluster/share.lua"));
    let client = redis::Client::open(redis.url()).unwrap();
    const CAP: u64 = 8;
    const LEASE: u64 = 300;
    static SEQ: AtomicU64 = AtomicU64::new(1);
    // (in_use, want, head, head_age_ms, held) of replica `r` -> (share, live, settling); `seq`:
    // the call's place in the replica's order (None: the next).
    async fn call_seq(
        script: &redis::Script,
        client: &redis::Client,
        r: &str,
        (in_use, want, head, age, held): (u64, u64, u64, u64, u64),
        seq: Option<u64>,
    ) -> (u64, u64, u64) {
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let v: Vec<u64> = script
            .key("t:{d}:replicas")
            .key("t:{d}:leases")
            .key("t:{d}:settling")
            .key("t:{d}:last")
            .arg(r)
            .arg(CAP)
            .arg(in_use)
            .arg(want)
            .arg(head)
            .arg(age)
            .arg(LEASE)
            .arg(held)
            .arg(seq.unwrap_or_else(|| SEQ.fetch_add(1, Ordering::Relaxed)))
            .invoke_async(&mut c)
            .await
            .unwrap();
        (v[0], v[1], v[2])
    }
    let call = |r: &'static str, d: (u64, u64, u64, u64, u64)| {
        let (script, client) = (script.clone(), client.clone());
        async move { call_seq(&script, &client, r, d, None).await }
    };
    const IDLE: (u64, u64, u64, u64, u64) = (0, 0, 0, 0, 0);
    // An empty store: everyone holds still (nothing held, nothing granted) for one lease, while
    // both keep syncing.
    assert_eq!(call("a", (0, 3, 3, 10, 0)).await, (0, 1, 1));
    assert_eq!(call("b", IDLE).await, (0, 2, 1));
    let start = Instant::now();
    while call("a", IDLE).await.2 == 1 {
        call("b", IDLE).await;
        assert!(start.elapsed() < Duration::from_millis(3 * LEASE));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    // a re-asserts: a fair share spare each (its first post-settling call may have been granted
    // 4 or all 8; it applies 4 here).
    assert_eq!(call("a", (0, 0, 0, 0, 4)).await.0, 4);
    assert_eq!(call("b", IDLE).await.0, 4);
    // a's next request needs all 8: a grows into what is free, and b, told to give up its 4,
    // is still counted at 4 until it says it applied that; then a gets all 8.
    assert_eq!(call("a", (0, 8, 8, 1, 4)).await.0, 4);
    assert_eq!(call("b", (0, 0, 0, 0, 4)).await.0, 0);
    assert_eq!(call("a", (0, 8, 8, 2, 4)).await.0, 4, "b has not applied its 0 yet");
    assert_eq!(call("b", IDLE).await.0, 0);
    assert_eq!(call("a", (0, 8, 8, 3, 4)).await.0, 8);
    // Served; nobody waits: a keeps a fair share spare, and the rest is b's once a applied it.
    assert_eq!(call("a", (0, 0, 0, 0, 8)).await.0, 4);
    assert_eq!(call("b", IDLE).await.0, 0);
    assert_eq!(call("a", (0, 0, 0, 0, 4)).await.0, 4);
    assert_eq!(call("b", IDLE).await.0, 4);
    // a has waiters (its next needs 6), and has waited longest; b gets requests too: b yields
    // toward 8 - 6 = 2 (keeping what it holds), and a grows once b has applied that.
    assert_eq!(call("a", (0, 6, 6, 10, 4)).await.0, 4);
    assert_eq!(call("b", (1, 5, 4, 5, 4)).await.0, 2);
    assert_eq!(call("a", (4, 10, 6, 20, 4)).await.0, 4, "b has not applied its 2 yet");
    assert_eq!(call("b", (1, 5, 4, 5, 2)).await.0, 2);
    assert_eq!(call("a", (4, 10, 6, 30, 4)).await.0, 6);
    // a's next request needs the whole decoder and has waited longest: b gives up everything.
    assert_eq!(call("a", (0, 8, 8, 40, 6)).await.0, 6);
    assert_eq!(call("b", (0, 3, 3, 1, 2)).await.0, 0);
    assert_eq!(call("b", (0, 3, 3, 1, 0)).await.0, 0);
    assert_eq!(call("a", (0, 8, 8, 50, 6)).await.0, 8);
    // Never past the capacity, however long b has waited and however much it asks.
    assert_eq!(call("b", (0, 100, 1, 1000, 0)).await.0, 0);
    // A call of a's overtaken by a later one (an old retry arriving late) changes nothing.
    assert_eq!(call_seq(&script, &client, "a", IDLE, Some(1)).await.0, 8);
    assert_eq!(call("b", (0, 100, 1, 1000, 0)).await.0, 0, "a's stale call gave nothing back");
    // a stops syncing (killed): one lease later its 8 are b's (b syncing all along).
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(LEASE + 100) {
        call("b", (0, 100, 1, 1000, 0)).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert_eq!(call("b", (0, 100, 1, 1000, 0)).await, (CAP, 1, 0));
    // Nobody reaches the store for a lease (b's own lease runs out too); b, holding 8, and then a
    // newcomer: everyone holds still.
    tokio::time::sleep(Duration::from_millis(LEASE + 100)).await;
    assert_eq!(call("b", (5, 9, 4, 10, 8)).await, (8, 1, 1));
    assert_eq!(call("c", (0, 4, 4, 500, 0)).await, (0, 2, 1), "a newcomer waits out the settling");
    // The store restarts empty while b holds 5 of its 8: b keeps 8 (what it may admit on), the
    // newcomer gets nothing, for one lease.
    redis.stop();
    redis.restart();
    assert_eq!(call("b", (5, 9, 4, 10, 8)).await, (8, 1, 1));
    assert_eq!(call("c", (0, 4, 4, 500, 0)).await, (0, 2, 1));
}

/// A completion for `tenant` (its fairness id): its status and body.
async fn complete_as(addr: SocketAddr, tenant: &str, body: &Value) -> (u16, Value) {
    let s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await.unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::post("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .header("x-gateway-inference-fairness-id", tenant)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    let status = res.status().as_u16();
    let b = res.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

/// Flow control with `[cluster]`: one tenant's token budget is one bucket for both replicas (not
/// one each), its counter adds the other replica's service, and with the store stopped each
/// replica keeps to its own share, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_a_tenants_budget_and_counter_and_keep_to_their_share_without_the_store() {
    const BUDGET: u64 = 600;
    let Some(mut redis) = Redis::start() else { return };
    let g = tiny_geometry(1).unwrap();
    let prefill = launch(SimConfig::new(SimRole::Prefill, g)).await.unwrap();
    let decode = launch(SimConfig::new(SimRole::Decode, g)).await.unwrap();
    let dir = std::env::temp_dir().join(format!("baton-cluster-flow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("baton.toml");
    let text = super::serve_toml(
        &prefill,
        &decode,
        "",
        &format!(
            "[flow]\ntrust_fairness_header = true\n\n[flow.tenants.metered]\ntokens_per_minute = {BUDGET}\n\
             budget_counts = \"input\"\n\n[cluster]\nstore = \"{}\"\nlease_ms = {LEASE_MS}\nsync_ms = 20\n",
            redis.url()
        ),
    );
    std::fs::write(&file, text).unwrap();
    let rs = replicas(&file, 2);
    let start = Instant::now();
    // Alternating between the replicas: the shared bucket lets about BUDGET tokens through in
    // all (one bucket each would let twice as many).
    let body = json!({"prompt": prompt(150, 1), "max_tokens": 2});
    let (mut served, mut tokens, mut refused) = (0u64, 0u64, Vec::new());
    for i in 0..10 {
        let (s, v) = complete_as(rs[i % 2].public, "metered", &body).await;
        match s {
            200 => {
                served += 1;
                tokens += v["usage"]["prompt_tokens"].as_u64().unwrap();
            }
            429 => refused.push(v),
            _ => panic!("{s} {v}"),
        }
    }
    let refill = start.elapsed().as_secs_f64() * BUDGET as f64 / 60.0;
    let one = tokens / served.max(1);
    eprintln!("shared budget: {served} served ({tokens} tokens), {} refused", refused.len());
    assert!((tokens as f64) <= BUDGET as f64 + refill, "{tokens} tokens served of a {BUDGET} budget");
    assert!(tokens + one > BUDGET, "only {tokens} tokens served of a {BUDGET} budget");
    assert!(!refused.is_empty());
    for r in &refused {
        assert_eq!(r["error"]["code"], "rate_limit_exceeded", "{r}");
    }
    // Each replica's counter for the tenant holds the other's service, synced within a moment.
    let waited = Instant::now();
    loop {
        let mut others = Vec::new();
        for r in &rs {
            let (_, f) = http(r.admin, "/admin/flow", None).await;
            let f: Value = serde_json::from_slice(&f).unwrap();
            let t = f["tenants"].as_array().unwrap().iter().find(|t| t["tenant"] == "metered").cloned();
            let other = t.as_ref().map_or(0.0, |t| t["other_replicas_counter"].as_f64().unwrap());
            let mine = t.as_ref().map_or(0.0, |t| t["virtual_counter"].as_f64().unwrap()) - other;
            others.push((mine, other));
        }
        if others[0].1 == others[1].0 && others[1].1 == others[0].0 && others[0].0 > 0.0 {
            break;
        }
        assert!(waited.elapsed() < Duration::from_secs(5), "counters not shared: {others:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let v = cluster_view(rs[0].admin).await;
    assert_eq!(v["flow"]["replicas"], 2, "{v}");

    // The store stopped: each replica checks its own share (BUDGET / 2, less what it used), so
    // the tenant is still refused; the checks are counted.
    redis.stop();
    for r in &rs {
        let (s, v) = complete_as(r.public, "metered", &body).await;
        assert_eq!((s, v["error"]["code"].as_str()), (429, Some("rate_limit_exceeded")), "{v}");
        let (_, m) = http(r.admin, "/metrics", None).await;
        let m = String::from_utf8_lossy(&m);
        assert!(super::sample_or_zero(&m, "baton_flow_budget_local_total ") >= 1.0, "{m}");
        assert!(
            super::sample_or_zero(&m, "baton_cluster_budget_calls_total{outcome=\"failed\"} ") >= 1.0,
            "{m}"
        );
        // Other tenants have no budget and are served.
        let (s, v) = complete_as(r.public, "free", &body).await;
        assert_eq!(s, 200, "{v}");
    }
    // The store back, empty: the fleet's bucket is full again.
    redis.restart();
    let back = Instant::now();
    loop {
        let (s, v) = complete_as(rs[0].public, "metered", &body).await;
        if s == 200 {
            break;
        }
        assert!(back.elapsed() < Duration::from_secs(5), "{s} {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The budget script alone, on a real Redis: a hold is taken only if it is there; an answer's
/// cost beyond its hold is charged even below zero (a request with no `max_tokens` held only its
/// input); what a request held beyond its cost goes back, never past full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_script_charges_every_answer_and_never_fills_past_the_budget() {
    let Some(redis) = Redis::start() else { return };
    let script = redis::Script::new(include_str!("../../src/cluster/budget.lua"));
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut call = async |take: f64, need: f64| -> (u8, f64) {
        let (ok, v): (u8, String) = script
            .key("t:{flow}:budget:a")
            .arg(600)
            .arg(take.to_string())
            .arg(need.to_string())
            .invoke_async(&mut conn)
            .await
            .unwrap();
        (ok, v.parse().unwrap())
    };
    // A hold of 500: there.
    assert_eq!(call(500.0, 500.0).await.0, 1);
    // Its answer cost 700: 200 more, charged though the bucket goes below zero.
    let (ok, level) = call(200.0, 0.0).await;
    assert_eq!(ok, 1);
    assert!((-100.5..-99.0).contains(&level), "{level}");
    // Another answer's extra 50, charged below zero too.
    let (ok, level) = call(50.0, 0.0).await;
    assert_eq!(ok, 1);
    assert!((-150.5..-149.0).contains(&level), "{level}");
    // Nothing more fits: refused, with the seconds until 1 token is there (151 at 10 a second).
    let (ok, refill) = call(1.0, 1.0).await;
    assert_eq!((ok, refill), (0, 16.0));
    // Given back: never past the budget.
    let (ok, level) = call(-10_000.0, 0.0).await;
    assert_eq!((ok, level), (1, 600.0));
}
