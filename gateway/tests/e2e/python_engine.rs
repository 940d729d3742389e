//! `baton serve` in front of the reference Python engine (`examples/python-engine`, embedding the
//! data plane's Python package): completions and chat, streamed and not, with the model's exact
//! text and usage; the deadlock scenario; clients that leave at random; and pairs of one Python and
//! one simulated engine either way round, each decoder checking every byte of KV it received.
//!
//! The engines run in the test venv (`scripts/test` builds the wheel into it). Without the venv the
//! tests skip, unless `BATON_REQUIRE_VENV` is set (as `scripts/test` does).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton_sim::{Running, SimConfig, SimRole, launch, tiny_geometry};
use serde_json::Value;

use super::drain::{Proc, spawn};
use super::{SERVE_HEAD, assert_clean_at, deadlock_scenario, disconnect_storm, four_shapes, http};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The venv's Python when it has the package; `None` (skip) without it outside `scripts/test`.
#[track_caller]
fn python() -> Option<PathBuf> {
    let p = std::env::var_os("BATON_TEST_PYTHON")
        .map_or_else(|| repo().join(".cache/venv/bin/python"), PathBuf::from);
    let ok = p.exists()
        && Command::new(&p)
            .args(["-c", "import baton_dataplane, numpy"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("BATON_REQUIRE_VENV").is_none(),
            "{} cannot import baton_dataplane and numpy: scripts/test builds the wheel into the venv",
            p.display()
        );
        super::skip::skipped("tool", "no venv with baton_dataplane (scripts/test builds it)");
        return None;
    }
    Some(p)
}

/// A Python engine process, killed however the test ends.
struct PyEngine {
    child: Child,
    /// What it printed on start: `listen`, and for a decoder `ranks[].addr`.
    hello: Value,
}

impl Drop for PyEngine {
    /// SIGTERM (the engine stops its ranks and removes their shared-memory files), then SIGKILL
    /// if it is still there after 5 s.
    fn drop(&mut self) {
        let pid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl PyEngine {
    fn start(python: &PathBuf, args: &[&str]) -> Self {
        let mut child = Command::new(python)
            .arg(repo().join("examples/python-engine/engine.py"))
            .args(["--model", "baton-sim", "--tp", "2"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next().expect("the engine printed its hello").unwrap();
        let hello: Value = serde_json::from_str(&line).unwrap();
        Self { child, hello }
    }

    fn addr(&self) -> SocketAddr {
        self.hello["listen"].as_str().unwrap().parse().unwrap()
    }

    fn ranks(&self) -> Vec<String> {
        self.hello["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["addr"].as_str().unwrap().to_owned())
            .collect()
    }
}

/// `baton serve` in front of `prefill` and `decode` (its ranks at `ranks`).
fn serve(
    dir: &std::path::Path,
    prefill: SocketAddr,
    decode: SocketAddr,
    ranks: &[String],
) -> (Proc, SocketAddr, SocketAddr) {
    serve_with(dir, prefill, decode, ranks, "")
}

/// [`serve`], with `extra` appended to its file.
fn serve_with(
    dir: &std::path::Path,
    prefill: SocketAddr,
    decode: SocketAddr,
    ranks: &[String],
    extra: &str,
) -> (Proc, SocketAddr, SocketAddr) {
    serve_file(dir, prefill, decode, ranks, "", extra)
}

/// [`serve_with`], with `decode_extra` in the `[[decode]]` table.
fn serve_file(
    dir: &std::path::Path,
    prefill: SocketAddr,
    decode: SocketAddr,
    ranks: &[String],
    decode_extra: &str,
    extra: &str,
) -> (Proc, SocketAddr, SocketAddr) {
    let ranks: Vec<String> = ranks.iter().map(|r| format!("{r:?}")).collect();
    let text = format!(
        "{SERVE_HEAD}\n[[prefill]]\nname = \"p\"\nurl = \"http://{prefill}\"\n\n[[decode]]\nname = \"d\"\nurl = \"http://{decode}\"\ndataplane = [{}]\n{decode_extra}\n\n[admission]\nmax_queue = 1000\n{extra}",
        ranks.join(", ")
    );
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("baton.toml");
    std::fs::write(&file, text).unwrap();
    spawn(&["serve", "--config", file.to_str().unwrap()])
}

/// Waits until a Python engine holds nothing: every PD page free, no cache block, no request
/// running, no accounting error.
async fn assert_engine_clean(engine: SocketAddr) {
    let start = Instant::now();
    loop {
        let (_, body) = http(engine, "/engine/stats", None).await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        let ranks_clean = v["ranks"].as_array().is_none_or(|rs| {
            rs.iter().all(|r| {
                r["pages_free"] == r["pages_total"] && r["requests"] == 0 && r["accounting_errors"] == 0
            })
        });
        if ranks_clean && v["engine_blocks_held"] == 0 && v["running"] == 0 {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "engine not clean: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn sim_ranks(sim: &Running) -> Vec<String> {
    sim.engine.stats()["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["addr"].as_str().unwrap().to_owned())
        .collect()
}

/// Python prefill and Python decode (TP 2, a 64-page buffer per rank, every chunk written through
/// the ranks' shared-memory exports): the four request shapes with the model's text and usage, then
/// the deadlock scenario (300 concurrent requests of 1 to 60 pages) completes; afterwards the
/// gateway and both engines hold nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_engines_serve_every_shape_and_the_deadlock_scenario() {
    let Some(py) = python() else { return };
    let decode = PyEngine::start(&py, &["--role", "decode", "--pages", "64"]);
    // The chunks go through the decode ranks' shared-memory exports (same host).
    let prefill = PyEngine::start(&py, &["--role", "prefill", "--shared-memory"]);
    let dir = std::env::temp_dir().join(format!("baton-pyengine-{}", std::process::id()));
    let (_gw, public, admin) = serve(&dir, prefill.addr(), decode.addr(), &decode.ranks());
    four_shapes(public, 200, 6, "python engines").await;
    four_shapes(public, 16, 1, "python engines, one chunk").await;
    let done = std::sync::Arc::default();
    let started = Instant::now();
    let mut tasks = deadlock_scenario(public, &done);
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    assert_eq!(done.load(std::sync::atomic::Ordering::Relaxed), 300);
    eprintln!("deadlock scenario behind the Python engines: {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(120), "took {:?}", started.elapsed());
    assert_clean_at(admin).await;
    assert_engine_clean(decode.addr()).await;
    assert_engine_clean(prefill.addr()).await;
    let (_, body) = http(prefill.addr(), "/engine/stats", None).await;
    let written = &serde_json::from_slice::<Value>(&body).unwrap()["chunks_written"];
    assert_eq!(written["socket"], 0, "{written}");
    assert!(written["shared_memory"].as_u64().unwrap() > 300, "{written}");
    // Its ranks said the decoder waits for the KV: every decode came with its prefill.
    let (_, body) = http(decode.addr(), "/engine/stats", None).await;
    let decodes = &serde_json::from_slice::<Value>(&body).unwrap()["decodes"];
    assert_eq!(decodes["ready"], 0, "{decodes}");
    assert!(decodes["waited"].as_u64().unwrap() >= 300, "{decodes}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// 200 clients that leave at random points (queued, during the prefill, waiting for the KV,
/// mid-stream) in front of Python engines with a 16-page buffer and slow tokens: afterwards nothing
/// is held anywhere, and the gateway still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_engines_leave_nothing_held_after_random_disconnects() {
    let Some(py) = python() else { return };
    let decode = PyEngine::start(&py, &["--role", "decode", "--pages", "16", "--token-delay-ms", "3"]);
    let prefill = PyEngine::start(&py, &["--role", "prefill", "--token-delay-ms", "3"]);
    let dir = std::env::temp_dir().join(format!("baton-pyengine-storm-{}", std::process::id()));
    let (_gw, public, admin) = serve(&dir, prefill.addr(), decode.addr(), &decode.ranks());
    disconnect_storm(public, |x| (1 + (x % 12) as usize) * 16 - 3, 150).await;
    assert_clean_at(admin).await;
    assert_engine_clean(decode.addr()).await;
    assert_engine_clean(prefill.addr()).await;
    four_shapes(public, 40, 3, "after the storm").await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// One Python and one simulated engine, either way round: the decoder (Rust or Python) checks every
/// byte the other wrote into its buffer, and the text is the same model's, so neither side can tell
/// the other apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_and_simulated_engines_pair_either_way() {
    let Some(py) = python() else { return };
    let g = tiny_geometry(2).unwrap();
    let dir = std::env::temp_dir().join(format!("baton-pyengine-mixed-{}", std::process::id()));

    // A decoder that does not wait for the KV: the gateway sends each decode once every rank is
    // ready (the other tests here take the overlapped path).
    let py_decode = PyEngine::start(&py, &["--role", "decode", "--pages", "64", "--no-decode-waits"]);
    let sim_prefill = launch(SimConfig::new(SimRole::Prefill, g)).await.unwrap();
    let (gw, public, admin) = serve(&dir.join("a"), sim_prefill.addr, py_decode.addr(), &py_decode.ranks());
    four_shapes(public, 200, 6, "baton-sim prefill, Python decode").await;
    assert_clean_at(admin).await;
    assert_engine_clean(py_decode.addr()).await;
    let (_, body) = http(py_decode.addr(), "/engine/stats", None).await;
    let decodes = &serde_json::from_slice::<Value>(&body).unwrap()["decodes"];
    assert_eq!(decodes["waited"], 0, "{decodes}");
    assert!(decodes["ready"].as_u64().unwrap() > 0, "{decodes}");
    drop(gw);

    let py_prefill = PyEngine::start(&py, &["--role", "prefill"]);
    let mut d = SimConfig::new(SimRole::Decode, g);
    d.pages = 64;
    let sim_decode = launch(d).await.unwrap();
    let (_gw, public, admin) =
        serve(&dir.join("b"), py_prefill.addr(), sim_decode.addr, &sim_ranks(&sim_decode));
    four_shapes(public, 200, 6, "Python prefill, baton-sim decode").await;
    assert_clean_at(admin).await;
    assert_engine_clean(py_prefill.addr()).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The data plane over mTLS with a Python engine on either side: a Python decoder's ranks serve
/// TLS with a client CA to a `baton-sim` prefiller and `baton serve` (`[dataplane_tls]`), a
/// Python prefiller writes over TLS to a `baton-sim` decoder's ranks; and a Python rank refuses a
/// peer without a certificate, counting it, its pages untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_engines_serve_the_data_plane_over_mtls() {
    use baton_dataplane::transport::{ControlClient, TlsClient};
    let Some(py) = python() else { return };
    let dir = std::env::temp_dir().join(format!("baton-pyengine-mtls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = super::certs::Ca::new("baton data plane CA");
    let (engine_pem, engine_key, ..) = ca.leaf(&["localhost"]);
    let (gateway_pem, gateway_key, ..) = ca.leaf(&["localhost"]);
    for (name, text) in [
        ("ca.pem", ca.pem.as_str()),
        ("engine.pem", &engine_pem),
        ("engine.key", &engine_key),
        ("gateway.pem", &gateway_pem),
        ("gateway.key", &gateway_key),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let path = |f: &str| dir.join(f).to_str().unwrap().to_owned();
    let tls_args = [
        "--dp-tls-cert",
        &path("engine.pem"),
        "--dp-tls-key",
        &path("engine.key"),
        "--dp-tls-ca",
        &path("ca.pem"),
    ];
    let gateway_tls = format!(
        "\n[dataplane_tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\nserver_name = \"localhost\"\n",
        path("ca.pem"),
        path("gateway.pem"),
        path("gateway.key")
    );
    let g = tiny_geometry(2).unwrap();
    let sim_tls = baton_sim::DpTls::from_pem_files(
        &dir.join("ca.pem"),
        &dir.join("engine.pem"),
        &dir.join("engine.key"),
        "localhost",
    )
    .unwrap();

    let py_decode =
        PyEngine::start(&py, &[&["--role", "decode", "--pages", "64"][..], &tls_args[..]].concat());
    let mut p = SimConfig::new(SimRole::Prefill, g);
    p.dp_tls = Some(sim_tls.clone());
    let sim_prefill = launch(p).await.unwrap();
    let (gw, public, admin) =
        serve_with(&dir.join("a"), sim_prefill.addr, py_decode.addr(), &py_decode.ranks(), &gateway_tls);
    four_shapes(public, 200, 6, "baton-sim prefill, Python decode, mTLS").await;
    assert_clean_at(admin).await;
    assert_engine_clean(py_decode.addr()).await;
    // A peer without a certificate: refused by the Python rank, at the handshake or its first call.
    let rank0: SocketAddr = py_decode.ranks()[0].parse().unwrap();
    let stranger = TlsClient::new(vec![ca.der.clone()], "localhost", None).unwrap();
    for client in [None, Some(&stranger)] {
        let refused = match ControlClient::connect_with(rank0, client, g.fingerprint(), 0).await {
            Err(_) => true,
            Ok(mut c) => {
                let key = baton_dataplane::RequestKey::new(baton_dataplane::RequestId(7), 0);
                c.reserve(key, 3, Duration::from_secs(60), &[]).await.is_err()
            }
        };
        assert!(refused, "the Python rank served a peer without a certificate (tls: {})", client.is_some());
    }
    assert_engine_clean(py_decode.addr()).await;
    drop(gw);

    let py_prefill = PyEngine::start(&py, &[&["--role", "prefill"][..], &tls_args[..]].concat());
    let mut d = SimConfig::new(SimRole::Decode, g);
    d.pages = 64;
    d.dp_tls = Some(sim_tls);
    let sim_decode = launch(d).await.unwrap();
    let (_gw, public, admin) =
        serve_with(&dir.join("b"), py_prefill.addr(), sim_decode.addr, &sim_ranks(&sim_decode), &gateway_tls);
    four_shapes(public, 200, 6, "Python prefill over mTLS, baton-sim decode").await;
    assert_clean_at(admin).await;
    assert_engine_clean(py_prefill.addr()).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The native contract's `local_prefill` (conditional disaggregation): a Python decoder given it
/// computes the prompt itself, answers with the model's text for those ids, and takes nothing
/// from its PD buffer, which a request naming KV that never came could not do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decoder_computes_a_local_prefill_itself() {
    let Some(py) = python() else { return };
    let decode = PyEngine::start(&py, &["--role", "decode", "--pages", "16"]);
    let ids: Vec<u32> = (0..100).map(|i| 100 + i % 50).collect();
    let body = |local: bool| {
        let mut baton =
            serde_json::json!({"request_id": format!("{:032x}", 7), "epoch": 0, "prompt_token_ids": ids});
        if local {
            baton["local_prefill"] = true.into();
        }
        serde_json::json!({"model": "baton-sim", "prompt": ids, "max_tokens": 5, "baton": baton})
    };
    let (status, answer) = http(decode.addr(), "/v1/completions", Some(&body(true))).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let v: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 100, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    // The same ids as a plain request (no baton): the same text.
    let plain = serde_json::json!({"model": "baton-sim", "prompt": ids, "max_tokens": 5});
    let (_, plain) = http(decode.addr(), "/v1/completions", Some(&plain)).await;
    let plain: Value = serde_json::from_slice(&plain).unwrap();
    assert_eq!(v["choices"][0]["text"], plain["choices"][0]["text"]);
    assert_engine_clean(decode.addr()).await;
    // Without local_prefill the decoder looks for a reservation nobody made, and refuses.
    let (status, _) = http(decode.addr(), "/v1/completions", Some(&body(false))).await;
    assert_ne!(status, 200);
    assert_engine_clean(decode.addr()).await;
}

/// A Python prefiller without the cache blocks a prompt needs refuses it (503 `engine_busy`)
/// and holds nothing after: its blocks are freed, the decoder's pages come back (the ranks it
/// was told about are fenced, and the gateway cancels), and the gateway serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_prefiller_out_of_cache_blocks_refuses_and_holds_nothing() {
    let Some(py) = python() else { return };
    let g = tiny_geometry(2).unwrap();
    let dir = std::env::temp_dir().join(format!("baton-pyengine-busy-{}", std::process::id()));
    // 4 blocks of 16 tokens a rank: 64 tokens fit, 200 do not.
    let py_prefill = PyEngine::start(&py, &["--role", "prefill", "--cache-blocks", "4"]);
    let mut d = SimConfig::new(SimRole::Decode, g);
    d.pages = 64;
    let sim_decode = launch(d).await.unwrap();
    let (_gw, public, admin) = serve(&dir, py_prefill.addr(), sim_decode.addr, &sim_ranks(&sim_decode));
    let body = serde_json::json!({"prompt": "x".repeat(200), "max_tokens": 2});
    let (status, answer) = http(public, "/v1/completions", Some(&body)).await;
    let text = String::from_utf8_lossy(&answer);
    assert!(status >= 500, "{status}: {text}");
    assert!(text.contains("cache blocks"), "the prefiller's own refusal: {status} {text}");
    assert_clean_at(admin).await;
    assert_engine_clean(py_prefill.addr()).await;
    let start = Instant::now();
    while sim_decode.engine.stats()["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["pages_free"] != r["pages_total"])
    {
        assert!(start.elapsed() < Duration::from_secs(5), "{}", sim_decode.engine.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let body = serde_json::json!({"prompt": "x".repeat(40), "max_tokens": 2});
    let (status, answer) = http(public, "/v1/completions", Some(&body)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    assert_engine_clean(py_prefill.addr()).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// `reserve = "prefiller"` in front of Python engines, two gateway replicas sharing one decoder of
/// 16 pages a rank: the Python prefiller reserves each request's pages with its first chunks; a
/// rank without room (the other replica holds pages) is its 507, which the gateway retries as a
/// new epoch. Every request gets the model's text, the refusals were all retried, and nothing is
/// held anywhere after. Replica `b` sends the prompt's ids in base64 (`token_ids = "base64"`),
/// `a` as a JSON array: the same engines read both (a misread id would fail the decoder's check of
/// the KV bytes, or give other text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_prefillers_reserve_for_themselves_and_a_full_rank_is_retried() {
    let Some(py) = python() else { return };
    let decode = PyEngine::start(&py, &["--role", "decode", "--pages", "16"]);
    let prefill = PyEngine::start(&py, &["--role", "prefill"]);
    let dir = std::env::temp_dir().join(format!("baton-pyengine-reserve-{}", std::process::id()));
    let replica = |name: &str, ids: &str| {
        serve_file(
            &dir.join(name),
            prefill.addr(),
            decode.addr(),
            &decode.ranks(),
            &format!("reserve = \"prefiller\"\ntoken_ids = \"{ids}\""),
            "",
        )
    };
    let (_ga, a, admin_a) = replica("a", "json");
    let (_gb, b, admin_b) = replica("b", "base64");
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..60usize {
        let addr = if i % 2 == 0 { a } else { b };
        let pages = 1 + (i * 7) % 12;
        tasks.spawn(async move {
            let text = super::prompt(pages * 16 - 1, i);
            let ids: Vec<u32> = text.bytes().map(u32::from).collect();
            let body = serde_json::json!({"prompt": text, "max_tokens": 3});
            let (s, answer) = http(addr, "/v1/completions", Some(&body)).await;
            assert_eq!(s, 200, "{}", String::from_utf8_lossy(&answer));
            assert_eq!(super::answer_text(&answer, false, false).0, baton_sim::kv::output_text(&ids, 3));
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let (mut refused, mut retried, mut reserved_by_gateway) = (0.0, 0.0, 0.0);
    for admin in [admin_a, admin_b] {
        let (_, m) = http(admin, "/metrics", None).await;
        let m = String::from_utf8_lossy(&m);
        refused += super::sample_or_zero(&m, "baton_reservation_refusals_total{decoder=\"d\"} ");
        retried += super::sample_or_zero(&m, "baton_reservation_retries_total{decoder=\"d\"} ");
        reserved_by_gateway += super::sample_or_zero(&m, "baton_phase_seconds_count{phase=\"reserve\"} ");
    }
    assert!(refused > 0.0, "no rank was ever full: the test did not over-commit the replicas");
    assert_eq!(retried, refused, "every refusal was retried");
    assert_eq!(reserved_by_gateway, 0.0, "the gateways reserved nothing themselves");
    assert_clean_at(admin_a).await;
    assert_clean_at(admin_b).await;
    assert_engine_clean(decode.addr()).await;
    assert_engine_clean(prefill.addr()).await;
    // Both forms reached both engines (each request's legs, retries included).
    for engine in [prefill.addr(), decode.addr()] {
        let (_, body) = http(engine, "/engine/stats", None).await;
        let forms = &serde_json::from_slice::<Value>(&body).unwrap()["prompt_ids"];
        let (json, base64) = (forms["json"].as_u64().unwrap_or(0), forms["base64"].as_u64().unwrap_or(0));
        assert!(json >= 30 && base64 >= 30, "{engine}: the ids came as {forms}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
