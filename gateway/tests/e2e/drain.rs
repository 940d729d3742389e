//! Draining on SIGTERM, on the real binaries: `baton serve` with 200 streams in flight finishes
//! every one, refuses new connections, answers `/ready` 503 meanwhile and exits 0 with the decoders
//! clean; with a 1 s drain timeout and 10 s streams, the streams are cut, nothing stays held and it
//! still exits 0; `baton demo` drains the same way.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use baton_sim::{Running, SimConfig, SimRole, launch, tiny_geometry};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpStream;

/// Killed however the test ends.
pub(super) use super::procs::Proc;
use super::procs::Stdout;

pub(super) fn spawn(args: &[&str]) -> (Proc, SocketAddr, SocketAddr) {
    spawn_with(args, Stdio::null())
}

/// [`spawn`], its log (stderr) written to `stderr`.
pub(super) fn spawn_with(args: &[&str], stderr: Stdio) -> (Proc, SocketAddr, SocketAddr) {
    super::procs::spawn_baton(std::path::Path::new(env!("CARGO_BIN_EXE_baton")), args, stderr)
}

/// `n` streams of `tokens` tokens each, once every one has its headers.
async fn started_streams(
    public: SocketAddr,
    n: usize,
    tokens: u32,
) -> Vec<tokio::task::JoinHandle<Result<String, String>>> {
    let started = Arc::new(AtomicUsize::new(0));
    let streams: Vec<_> =
        (0..n).map(|_| tokio::spawn(stream(public, tokens, Arc::clone(&started)))).collect();
    let t = Instant::now();
    while started.load(Ordering::SeqCst) < n {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} of {n} streams started",
            started.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    streams
}

/// A streamed completion: the whole SSE text, or an error once the connection is cut.
async fn stream(addr: SocketAddr, max_tokens: u32, started: Arc<AtomicUsize>) -> Result<String, String> {
    let s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(s)).await.map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let body = json!({"prompt": "drain me gently", "max_tokens": max_tokens, "stream": true});
    let req = Request::post("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = send.send_request(req).await.map_err(|e| e.to_string())?;
    started.fetch_add(1, Ordering::SeqCst);
    let b = res.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(String::from_utf8_lossy(&b).into_owned())
}

async fn get(addr: SocketAddr, path: &str) -> Result<u16, String> {
    let s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(s)).await.map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::get(path).header("host", addr.to_string()).body(Full::new(Bytes::new())).unwrap();
    Ok(send.send_request(req).await.map_err(|e| e.to_string())?.status().as_u16())
}

/// A prefill and a decode engine (TP 2) whose tokens take `token_delay` each.
pub(super) async fn engines(token_delay: Duration) -> (Running, Running) {
    let g = tiny_geometry(2).unwrap();
    let mut p = SimConfig::new(SimRole::Prefill, g);
    p.token_delay = token_delay;
    let mut d = SimConfig::new(SimRole::Decode, g);
    d.token_delay = token_delay;
    d.pages = 1024;
    (launch(p).await.unwrap(), launch(d).await.unwrap())
}

/// `baton serve` in front of them, draining for `drain_ms`.
fn serve(
    dir: &std::path::Path,
    prefill: &Running,
    decode: &Running,
    drain_ms: u64,
) -> (Proc, SocketAddr, SocketAddr) {
    serve_then(dir, prefill, decode, drain_ms, Stdout::Drained)
}

/// [`serve`], its stdout then `stdout`.
fn serve_then(
    dir: &std::path::Path,
    prefill: &Running,
    decode: &Running,
    drain_ms: u64,
    stdout: Stdout,
) -> (Proc, SocketAddr, SocketAddr) {
    serve_env(dir, prefill, decode, drain_ms, &[], stdout)
}

/// [`serve_then`] with `env` added to the gateway's environment.
fn serve_env(
    dir: &std::path::Path,
    prefill: &Running,
    decode: &Running,
    drain_ms: u64,
    env: &[(&str, &str)],
    stdout: Stdout,
) -> (Proc, SocketAddr, SocketAddr) {
    // Closed pipes: lines to write into them, a request's among them.
    let logs =
        if stdout == Stdout::Closed { "\n[telemetry]\nlog_level = \"baton_gateway=debug\"\n" } else { "" };
    let text = super::serve_toml(
        prefill,
        decode,
        "",
        &format!("[shutdown]\ndrain_timeout_ms = {drain_ms}\n\n[admission]\nmax_queue = 1000\n{logs}"),
    );
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("baton.toml");
    std::fs::write(&file, text).unwrap();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_baton"));
    let stderr = if stdout == Stdout::Closed { Stdio::piped() } else { Stdio::null() };
    super::procs::spawn_baton_env(bin, &["serve", "--config", file.to_str().unwrap()], env, stderr, stdout)
}

/// The decoder holds no page and no engine block within `within`.
async fn decoder_clean(decode: &Running, within: Duration) {
    let start = Instant::now();
    loop {
        let s = decode.engine.stats();
        let pages_free = s["ranks"].as_array().unwrap().iter().all(|r| r["pages_free"] == r["pages_total"]);
        if pages_free && s["engine_blocks_held"] == 0 {
            return;
        }
        assert!(start.elapsed() < within, "decoder not clean after {within:?}: {s}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn tempdir(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("baton-drain-{name}-{}", std::process::id()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_200_streams_finish_refuses_new_connections_and_exits_0() {
    two_hundred_streams_finish("finish", &[]).await;
}

/// The same on one core (`TOKIO_WORKER_THREADS=1`): the gateway on tokio's current-thread
/// scheduler (`baton_gateway::serve::runtime`), as a one-CPU container or `taskset` runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_core_200_streams_finish_and_it_exits_0() {
    two_hundred_streams_finish("one-core", &[("TOKIO_WORKER_THREADS", "1")]).await;
}

async fn two_hundred_streams_finish(name: &str, env: &[(&str, &str)]) {
    let (prefill, decode) = engines(Duration::from_millis(10)).await;
    let dir = tempdir(name);
    let (mut baton, public, admin) = serve_env(&dir, &prefill, &decode, 20_000, env, Stdout::Drained);
    let started = Arc::new(AtomicUsize::new(0));
    let streams: Vec<_> = (0..200).map(|_| tokio::spawn(stream(public, 80, Arc::clone(&started)))).collect();
    let t = Instant::now();
    while started.load(Ordering::SeqCst) < 200 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "only {} streams started",
            started.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(get(admin, "/ready").await, Ok(200));
    baton.term();
    // Not ready at once, and no new connection is taken, while the streams run on.
    let t = Instant::now();
    let mut saw_503 = false;
    let mut refused = false;
    while !(saw_503 && refused) {
        assert!(t.elapsed() < Duration::from_secs(5), "ready 503: {saw_503}, refused: {refused}");
        saw_503 |= get(admin, "/ready").await == Ok(503);
        refused |= TcpStream::connect(public).await.is_err();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut done = 0;
    for s in streams {
        let text = s.await.unwrap().expect("a stream in flight is answered whole");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        done += 1;
    }
    assert_eq!(done, 200);
    assert_eq!(baton.exit_code(Duration::from_secs(20)).await, 0);
    decoder_clean(&decode, Duration::from_secs(2)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_timeout_cuts_long_streams_and_releases_everything() {
    // 100 tokens at 100 ms: 10 s streams.
    let (prefill, decode) = engines(Duration::from_millis(100)).await;
    let dir = tempdir("cut");
    let (mut baton, public, _admin) = serve(&dir, &prefill, &decode, 1_000);
    let streams = started_streams(public, 20, 100).await;
    let signalled = Instant::now();
    baton.term();
    // The drain timeout, then at most RELEASE_WAIT for slots, then the admin listener.
    assert_eq!(
        baton
            .exit_code(Duration::from_secs(1) + baton_gateway::server::RELEASE_WAIT + Duration::from_secs(3))
            .await,
        0
    );
    let exit_after = signalled.elapsed();
    assert!(exit_after >= Duration::from_millis(900), "it waited for the drain timeout: {exit_after:?}");
    for s in streams {
        // Cut: an error, or a body without its end.
        if let Ok(text) = s.await.unwrap() {
            assert!(!text.contains("[DONE]"), "a 10 s stream was cut: {text}");
        }
    }
    // Released at once, not after the 120 s lease.
    decoder_clean(&decode, Duration::from_secs(2)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A second signal during the drain stops at once: exit 130 within a second, not after the 20 s
/// drain; the streams are cut, and nothing stays held on the engines (their connections closed
/// with the process, the decoder frees what they held, the prefiller holds nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_stops_at_once_with_130_and_leaks_nothing() {
    let (prefill, decode) = engines(Duration::from_millis(100)).await;
    let dir = tempdir("twice");
    let (mut baton, public, admin) = serve(&dir, &prefill, &decode, 20_000);
    let streams = started_streams(public, 20, 100).await;
    baton.term();
    let t = Instant::now();
    while get(admin, "/ready").await != Ok(503) {
        assert!(t.elapsed() < Duration::from_secs(5), "the drain never began");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let again = Instant::now();
    baton.term();
    assert_eq!(baton.exit_code(Duration::from_secs(5)).await, 130);
    assert!(
        again.elapsed() < Duration::from_secs(1),
        "stopped {:?} after the second signal",
        again.elapsed()
    );
    for s in streams {
        if let Ok(text) = s.await.unwrap() {
            assert!(!text.contains("[DONE]"), "a 10 s stream was cut: {text}");
        }
    }
    decoder_clean(&decode, Duration::from_secs(5)).await;
    assert_eq!(prefill.engine.stats()["engine_blocks_held"], 0, "{}", prefill.engine.stats());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Its stdout and stderr closed once it has said where it listens (the pipes' reader gone: a log
/// shipper restarted, `baton serve 2>&1 | head`), the gateway still serves and drains on SIGTERM:
/// the lines it says and logs (at `debug`, each request's) are lost, the streams in flight finish
/// and it exits 0, the decoder clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_does_not_stop_the_drain() {
    let (prefill, decode) = engines(Duration::from_millis(10)).await;
    let dir = tempdir("stdout");
    let (mut baton, public, _admin) = serve_then(&dir, &prefill, &decode, 20_000, Stdout::Closed);
    let streams = started_streams(public, 10, 40).await;
    baton.term();
    for s in streams {
        let text = s.await.unwrap().expect("a stream in flight is answered whole");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
    assert_eq!(baton.exit_code(Duration::from_secs(10)).await, 0, "drained, not a panic's 101");
    decoder_clean(&decode, Duration::from_secs(2)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM the moment the binary says where it listens (an orchestrator stopping a process it just
/// started): a drain and exit 0, not the default action's kill, for `serve` and `demo` alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_as_soon_as_it_listens_is_a_drain() {
    let (prefill, decode) = engines(Duration::ZERO).await;
    let dir = std::env::temp_dir().join(format!("baton-early-signal-{}", std::process::id()));
    for round in 0..3 {
        let (mut p, _, _) = serve(&dir, &prefill, &decode, 1000);
        p.term();
        assert_eq!(p.exit_code(Duration::from_secs(10)).await, 0, "serve, round {round}");
        let (mut d, _, _) = spawn(&["demo", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]);
        d.term();
        assert_eq!(d.exit_code(Duration::from_secs(10)).await, 0, "demo, round {round}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn baton_demo_drains_on_sigterm() {
    let (mut demo, public, admin) = spawn(&[
        "demo",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--token-delay-ms",
        "20",
    ]);
    let started = Arc::new(AtomicUsize::new(0));
    let s = tokio::spawn(stream(public, 40, Arc::clone(&started)));
    while started.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    demo.term();
    let t = Instant::now();
    while get(admin, "/ready").await == Ok(200) {
        assert!(t.elapsed() < Duration::from_secs(5), "/ready stays 200");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let text = s.await.unwrap().unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(demo.exit_code(Duration::from_secs(10)).await, 0);
}
