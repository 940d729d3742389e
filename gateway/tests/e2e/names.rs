//! Engines by DNS name, against a real DNS server: dnsmasq (Debian's `dnsmasq-base`, installed by
//! `scripts/test`) on loopback, authoritative for `baton.test`, its records in a hosts file it
//! re-reads on SIGHUP; the gateway asks it (`[resolver] nameservers`). A decoder name with two
//! addresses gets traffic on both, one whose address leaves gets none after the refresh, a moved
//! record takes the traffic with it, and no request fails meanwhile. Ranks and prefills by name,
//! `https://` engines checked against `[engine_tls] ca`, and `check-config` on a name with no address.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_gateway::endpoints::{Names, ResolverSettings};
use baton_sim::{SimConfig, SimRole, launch, tiny_geometry};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use super::certs::Ca;

/// A dnsmasq serving `records` (name → addresses) for `baton.test` on a loopback port.
struct Dns {
    child: Child,
    hosts: PathBuf,
    log: PathBuf,
    addr: SocketAddr,
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[track_caller]
fn dnsmasq() -> Option<PathBuf> {
    super::system_tool("dnsmasq", "dnsmasq-base")
}

fn hosts_text(records: &[(&str, &[&str])]) -> String {
    let mut t = String::new();
    for (name, ips) in records {
        for ip in *ips {
            t.push_str(&format!("{ip} {name}\n"));
        }
    }
    t
}

impl Dns {
    /// Started and answering, or `None` without dnsmasq (outside `scripts/test`).
    async fn start(dir: &Path, records: &[(&str, &[&str])]) -> Option<Self> {
        let bin = dnsmasq()?;
        let hosts = dir.join("hosts");
        std::fs::write(&hosts, hosts_text(records)).unwrap();
        let log = dir.join("dnsmasq.log");
        // dnsmasq takes the port over UDP and TCP. The port is outside the ephemeral range, which
        // the tests' own sockets take from; should another process take it first all the same,
        // dnsmasq exits, and another port is tried.
        for _ in 0..10 {
            let port = super::ports::free_port();
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let child = Command::new(&bin)
                .args([
                    "--keep-in-foreground",
                    "--conf-file=/dev/null",
                    "--pid-file=",
                    "--no-resolv",
                    "--no-hosts",
                    "--bind-interfaces",
                    "--listen-address=127.0.0.1",
                    "--local=/baton.test/",
                    "--local-ttl=0",
                    "--log-queries",
                ])
                .arg(format!("--port={port}"))
                .arg(format!("--addn-hosts={}", hosts.display()))
                .arg(format!("--log-facility={}", log.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let mut dns = Self { child, hosts: hosts.clone(), addr, log: log.clone() };
            let (first, ips) = records[0];
            if dns.answers(first, ips, Duration::from_secs(10)).await {
                return Some(dns);
            }
            assert!(
                dns.child.try_wait().unwrap().is_some(),
                "dnsmasq at {addr} runs but never answered {first}: its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        panic!(
            "dnsmasq did not start on any of 10 ports; its log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// Answers `name` with `ips` within `limit` (false at once when dnsmasq has exited).
    async fn answers(&mut self, name: &str, ips: &[&str], limit: Duration) -> bool {
        let mut want: Vec<IpAddr> = ips.iter().map(|i| i.parse().unwrap()).collect();
        want.sort_unstable();
        let start = Instant::now();
        while start.elapsed() < limit {
            if self.child.try_wait().unwrap().is_some() {
                return false;
            }
            // A resolver of its own each time: no cache between the tries.
            let names = Names::new(ResolverSettings { nameservers: vec![self.addr], ..Default::default() });
            if names.lookup(name).await.ok().as_ref() == Some(&want) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Rewrites the records and has dnsmasq re-read them; returns once it answers with them.
    async fn set(&mut self, records: &[(&str, &[&str])]) {
        std::fs::write(&self.hosts, hosts_text(records)).unwrap();
        let pid = rustix::process::Pid::from_child(&self.child);
        rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
        for (name, ips) in records {
            self.wait_for(name, ips).await;
        }
    }

    async fn wait_for(&mut self, name: &str, ips: &[&str]) {
        if !self.answers(name, ips, Duration::from_secs(10)).await {
            panic!(
                "dnsmasq at {} never answered {name} with {ips:?}; its log:\n{}",
                self.addr,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("baton-names-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A completion with `x-request-id: id`.
async fn complete(addr: SocketAddr, id: &str) -> (u16, Bytes) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let body = json!({"prompt": super::prompt(40, 1), "max_tokens": 2});
    let req = Request::post("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    let status = res.status().as_u16();
    (status, res.into_body().collect().await.unwrap().to_bytes())
}

/// `workers` clients sending completions back to back, each tagged with the phase it was sent in,
/// until the phase is "stop". Any answer other than 200 is kept.
struct Traffic {
    phase: Arc<Mutex<String>>,
    sent: Arc<AtomicUsize>,
    failures: Arc<Mutex<Vec<String>>>,
    tasks: JoinSet<()>,
}

impl Traffic {
    fn start(addr: SocketAddr, workers: usize, phase: &str) -> Self {
        let phase = Arc::new(Mutex::new(phase.to_owned()));
        let (sent, failures) = (Arc::new(AtomicUsize::new(0)), Arc::new(Mutex::new(Vec::new())));
        let mut tasks = JoinSet::new();
        for w in 0..workers {
            let (phase, sent, failures) = (Arc::clone(&phase), Arc::clone(&sent), Arc::clone(&failures));
            tasks.spawn(async move {
                for n in 0.. {
                    let p = phase.lock().unwrap().clone();
                    if p == "stop" {
                        return;
                    }
                    let (s, b) = complete(addr, &format!("{p}-{w}-{n}")).await;
                    sent.fetch_add(1, Ordering::Relaxed);
                    if s != 200 {
                        failures.lock().unwrap().push(format!("{p}: {s} {}", String::from_utf8_lossy(&b)));
                    }
                }
            });
        }
        Self { phase, sent, failures, tasks }
    }

    fn phase(&self, p: &str) {
        *self.phase.lock().unwrap() = p.to_owned();
    }

    async fn stop(mut self) -> usize {
        self.phase("stop");
        while self.tasks.join_next().await.is_some() {}
        let failures = self.failures.lock().unwrap();
        assert!(
            failures.is_empty(),
            "{} of {} requests failed: {:?}",
            failures.len(),
            self.sent.load(Ordering::Relaxed),
            &failures[..failures.len().min(5)]
        );
        self.sent.load(Ordering::Relaxed)
    }
}

/// How many of the last requests `engine` received were sent in `phase`.
fn received_in(engine: &baton_sim::Running, phase: &str) -> usize {
    let got = engine.engine.received();
    got.as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            r["headers"]["x-request-id"].as_str().is_some_and(|id| id.starts_with(&format!("{phase}-")))
        })
        .count()
}

fn nixl_engine(role: SimRole, listen: SocketAddr) -> SimConfig {
    let mut c = SimConfig::new(role, tiny_geometry(1).unwrap());
    c.listen = listen;
    c.nixl = Some(Duration::from_secs(30));
    c
}

/// A NIXL prefill on 127.0.0.1, and decoders A on 127.0.0.2 and B on 127.0.0.3 on one port.
async fn nixl_trio() -> (baton_sim::Running, baton_sim::Running, baton_sim::Running) {
    let prefill = launch(nixl_engine(SimRole::Prefill, "127.0.0.1:0".parse().unwrap())).await.unwrap();
    let a = launch(nixl_engine(SimRole::Decode, "127.0.0.2:0".parse().unwrap())).await.unwrap();
    let at_b = SocketAddr::from(([127, 0, 0, 3], a.addr.port()));
    let b = launch(nixl_engine(SimRole::Decode, at_b)).await.unwrap();
    (prefill, a, b)
}

/// A `baton serve` file for the vLLM NIXL mode with the prefill at `prefill.baton.test:pp` and the
/// decoder at `decode.baton.test:dp`, names asked of `dns` every `refresh_ms`.
fn nixl_by_name(dir: &Path, dns: SocketAddr, refresh_ms: u64, pp: u16, dp: u16) -> PathBuf {
    let text = format!(
        r#"{head}
[resolver]
nameservers = ["{dns}"]
refresh_ms = {refresh_ms}

[[prefill]]
name = "p"
url = "http://prefill.baton.test:{pp}"

[[decode]]
name = "d"
url = "http://decode.baton.test:{dp}"
handoff = "vllm-nixl"
nixl = {{ scrape_interval_ms = 50, max_in_flight = 64 }}
"#,
        head = super::SERVE_HEAD,
    );
    let file = dir.join("baton.toml");
    std::fs::write(&file, text).unwrap();
    file
}

/// vLLM NIXL mode (the decoder is HTTP only): decoders A (127.0.0.2) and B (127.0.0.3) on one port
/// behind `decode.baton.test`. Both addresses: both get traffic. A leaves the record: after the
/// refresh A gets nothing. The record moves to A: B gets nothing. No request fails throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_follows_a_decoder_record_with_no_request_lost() {
    let dir = tempdir("follow");
    let (prefill, a, b) = nixl_trio().await;
    let port = a.addr.port();
    let Some(mut dns) = Dns::start(
        &dir,
        &[("prefill.baton.test", &["127.0.0.1"]), ("decode.baton.test", &["127.0.0.2", "127.0.0.3"])],
    )
    .await
    else {
        return;
    };
    let file = nixl_by_name(&dir, dns.addr, 200, prefill.addr.port(), port);
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    let gw = serving.addrs[0];

    // Both addresses: new connections alternate between them.
    let traffic = Traffic::start(gw, 8, "both");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        received_in(&a, "both") > 0 && received_in(&b, "both") > 0,
        "both addresses serve: A {} B {}",
        received_in(&a, "both"),
        received_in(&b, "both")
    );

    // A leaves the record: its kept-alive connections are not used again, new ones go to B.
    dns.set(&[("prefill.baton.test", &["127.0.0.1"]), ("decode.baton.test", &["127.0.0.3"])]).await;
    // Within two refreshes (200 ms each).
    traffic.phase("settle-b");
    tokio::time::sleep(Duration::from_millis(500)).await;
    traffic.phase("only-b");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // Checked now: the engines keep their last 256 requests, and the next phases' push these out.
    assert_eq!(received_in(&a, "only-b"), 0, "A got requests after it left the record");
    assert!(received_in(&b, "only-b") > 0, "B served nothing while it alone had the name");

    // The record moves to A.
    dns.set(&[("prefill.baton.test", &["127.0.0.1"]), ("decode.baton.test", &["127.0.0.2"])]).await;
    traffic.phase("settle-a");
    tokio::time::sleep(Duration::from_millis(500)).await;
    traffic.phase("only-a");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let sent = traffic.stop().await;

    assert_eq!(received_in(&b, "only-a"), 0, "B got requests after the record moved to A");
    assert!(received_in(&a, "only-a") > 0, "A served nothing after the record moved to it");
    eprintln!("{sent} requests, none failed");
    // The operator sees the name, its address now and its lookups; the metrics too.
    let (_, body) = super::http(serving.admin_addr, "/admin/names", None).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    let decode = v["names"].as_array().unwrap().iter().find(|n| n["name"] == "decode.baton.test").unwrap();
    assert_eq!(decode["addrs"], json!(["127.0.0.2"]), "{v}");
    assert!(decode["lookups"].as_u64().unwrap() >= 3, "{v}");
    let (_, metrics) = super::http(serving.admin_addr, "/metrics", None).await;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains("baton_dns_addresses{name=\"decode.baton.test\"} 1"), "{metrics}");
    serving.shutdown().await;
}

/// A native prefill and decode engine (TP 2) on 127.0.0.1, and dnsmasq answering `name` with it.
async fn native_pair(dir: &Path, name: &str) -> Option<(baton_sim::Running, baton_sim::Running, Dns)> {
    let g = tiny_geometry(2).unwrap();
    let prefill = launch(SimConfig::new(SimRole::Prefill, g)).await.unwrap();
    let decode = launch(SimConfig::new(SimRole::Decode, g)).await.unwrap();
    let dns = Dns::start(dir, &[(name, &["127.0.0.1"])]).await?;
    Some((prefill, decode, dns))
}

/// The native handoff with the prefill, the decoder and its ranks all given by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_mode_reaches_engines_and_ranks_by_name() {
    let dir = tempdir("native");
    let Some((prefill, decode, dns)) = native_pair(&dir, "engines.baton.test").await else { return };
    let ranks: Vec<String> = decode.engine.stats()["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let a: SocketAddr = r["addr"].as_str().unwrap().parse().unwrap();
            format!("\"engines.baton.test:{}\"", a.port())
        })
        .collect();
    // Ranks by name: the gateway cannot know they are on loopback, so plain TCP is said.
    let text = super::serve_toml(
        &prefill,
        &decode,
        "dataplane_plaintext = true",
        &format!("[resolver]\nnameservers = [\"{}\"]\n", dns.addr),
    )
    .replace(
        &format!("http://{}", prefill.addr),
        &format!("http://engines.baton.test:{}", prefill.addr.port()),
    )
    .replace(&format!("http://{}", decode.addr), &format!("http://engines.baton.test:{}", decode.addr.port()))
    .replace(&super::toml_ranks(&decode), &ranks.join(", "));
    assert!(!text.contains(&decode.addr.to_string()) && !text.contains(&prefill.addr.to_string()), "{text}");
    let file = dir.join("baton.toml");
    std::fs::write(&file, &text).unwrap();
    // check-config passes it and says what each name resolves to.
    let check = Command::new(env!("CARGO_BIN_EXE_baton")).arg("check-config").arg(&file).output().unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{out}{}", String::from_utf8_lossy(&check.stderr));
    for field in ["prefill[0].url", "decode[0].url", "decode[0].dataplane[0]", "decode[0].dataplane[1]"] {
        assert!(
            out.contains(&format!("{field}: engines.baton.test resolves to [127.0.0.1]")),
            "{field}: {out}"
        );
    }
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    super::four_shapes(serving.addrs[0], 70, 4, "native by name").await;
    super::assert_clean_at(serving.admin_addr).await;
    serving.shutdown().await;
}

/// A TLS front for an engine: accepts TLS with `chain`/`key`, forwards the bytes to `to`.
async fn tls_front(
    chain: rustls::pki_types::CertificateDer<'static>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
    to: SocketAddr,
) -> SocketAddr {
    tls_front_with(chain, key, to, None).await
}

/// [`tls_front`], requiring a client certificate from `client_ca` when given (an engine behind
/// mTLS).
async fn tls_front_with(
    chain: rustls::pki_types::CertificateDer<'static>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
    to: SocketAddr,
    client_ca: Option<rustls::pki_types::CertificateDer<'static>>,
) -> SocketAddr {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let b = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .unwrap();
    let b = match client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(ca).unwrap();
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .unwrap();
            b.with_client_cert_verifier(verifier)
        }
        None => b.with_no_client_auth(),
    };
    let config = b.with_single_cert(vec![chain], key).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(s).await else { return };
                let Ok(mut plain) = TcpStream::connect(to).await else { return };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    addr
}

/// `baton serve` in front of `prefill` and `decode` reached as `https://engines.baton.test` through
/// their TLS fronts, names from `dns`, `[engine_tls]` as given; one completion sent, which must be
/// `served` (200, the prefiller saw it) or refused at the handshake (502 from the call, or 503 once
/// the health checks, which fail the same way, have taken the prefill out; no engine saw it).
async fn through_fronts(
    dir: &Path,
    (prefill, decode, dns): (&baton_sim::Running, &baton_sim::Running, &Dns),
    fronts: (SocketAddr, SocketAddr),
    engine_tls: &str,
    served: bool,
) -> baton_gateway::serve::Serving {
    let before = prefill.engine.received().as_array().unwrap().len();
    let text = super::serve_toml(
        prefill,
        decode,
        "",
        &format!("[resolver]\nnameservers = [\"{}\"]\n\n[engine_tls]\n{engine_tls}", dns.addr),
    )
    .replace(&format!("http://{}", prefill.addr), &format!("https://engines.baton.test:{}", fronts.0.port()))
    .replace(&format!("http://{}", decode.addr), &format!("https://engines.baton.test:{}", fronts.1.port()));
    let file = dir.join("baton.toml");
    std::fs::write(&file, &text).unwrap();
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    let (s, b) =
        super::http(serving.addrs[0], "/v1/completions", Some(&json!({"prompt": "hello", "max_tokens": 3})))
            .await;
    let received = prefill.engine.received().as_array().unwrap().len() - before;
    let what = format!("[engine_tls] {engine_tls:?}: {s} {}", String::from_utf8_lossy(&b));
    if served {
        assert_eq!((s, received), (200, 1), "{what}");
    } else {
        assert!(s == 502 || s == 503, "{what}");
        let e: Value = serde_json::from_slice(&b).unwrap();
        // The native decoder waits for the KV itself, so both legs go out at once: whichever
        // handshake failed first names its leg.
        let m = e["error"]["message"].as_str().unwrap();
        assert!(m.contains("prefill") || m.contains("decode"), "{e}");
        assert_eq!(
            received, 0,
            "a request reached an engine the gateway could not verify or was refused by: {what}"
        );
    }
    serving
}

/// `https://` engines by name: served with `[engine_tls] ca` naming the CA of their certificates;
/// the same engines with a CA that did not sign them are refused at the handshake (502).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_engines_are_verified_against_the_configured_ca() {
    let dir = tempdir("https");
    let Some((prefill, decode, dns)) = native_pair(&dir, "engines.baton.test").await else { return };
    let ca = Ca::new("engines CA");
    let (_, _, cert, key) = ca.leaf(&["engines.baton.test"]);
    let p_front = tls_front(cert.clone(), key.clone_key(), prefill.addr).await;
    let d_front = tls_front(cert, key, decode.addr).await;
    std::fs::write(dir.join("ca.pem"), &ca.pem).unwrap();
    std::fs::write(dir.join("other-ca.pem"), Ca::new("another CA").pem).unwrap();
    for (ca_file, trusted) in [("ca.pem", true), ("other-ca.pem", false)] {
        let engines = (&prefill, &decode, &dns);
        let serving =
            through_fronts(&dir, engines, (p_front, d_front), &format!("ca = \"{ca_file}\"\n"), trusted)
                .await;
        super::assert_clean_at(serving.admin_addr).await;
        serving.shutdown().await;
    }
}

/// TLS fronts for both engines (as `engines.baton.test`) that require client certificates from
/// a CA made here, whose certificate is written to `dir/ca.pem`.
async fn mtls_fronts(
    dir: &Path,
    prefill: &baton_sim::Running,
    decode: &baton_sim::Running,
) -> (Ca, SocketAddr, SocketAddr) {
    let ca = Ca::new("engines CA");
    let (_, _, cert, key) = ca.leaf(&["engines.baton.test"]);
    let p_front = tls_front_with(cert.clone(), key.clone_key(), prefill.addr, Some(ca.der.clone())).await;
    let d_front = tls_front_with(cert, key, decode.addr, Some(ca.der.clone())).await;
    std::fs::write(dir.join("ca.pem"), &ca.pem).unwrap();
    (ca, p_front, d_front)
}

/// Engines behind mTLS: the gateway presents `[engine_tls] cert`/`key` and is served; with a
/// certificate from another CA, or none, the handshake is refused and no engine sees the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_that_require_client_certificates_get_the_gateways() {
    let dir = tempdir("engine-mtls");
    let Some((prefill, decode, dns)) = native_pair(&dir, "engines.baton.test").await else { return };
    let (ca, p_front, d_front) = mtls_fronts(&dir, &prefill, &decode).await;
    let (gw_cert, gw_key, _, _) = ca.leaf(&["baton-gateway"]);
    std::fs::write(dir.join("gateway.pem"), gw_cert).unwrap();
    std::fs::write(dir.join("gateway.key"), gw_key).unwrap();
    let (other_cert, other_key, _, _) = Ca::new("another CA").leaf(&["baton-gateway"]);
    std::fs::write(dir.join("other.pem"), other_cert).unwrap();
    std::fs::write(dir.join("other.key"), other_key).unwrap();
    for (client, served) in [
        ("cert = \"gateway.pem\"\nkey = \"gateway.key\"\n", true),
        ("cert = \"other.pem\"\nkey = \"other.key\"\n", false),
        ("", false),
    ] {
        let engines = (&prefill, &decode, &dns);
        let serving =
            through_fronts(&dir, engines, (p_front, d_front), &format!("ca = \"ca.pem\"\n{client}"), served)
                .await;
        super::assert_clean_at(serving.admin_addr).await;
        serving.shutdown().await;
    }
}

/// `check-config` looks every name up: one with no address fails the check naming its field; the
/// others are printed with their addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_names_the_field_of_a_name_without_an_address() {
    let dir = tempdir("check");
    let Some((prefill, decode, dns)) = native_pair(&dir, "prefill.baton.test").await else { return };
    let base =
        super::serve_toml(&prefill, &decode, "", &format!("[resolver]\nnameservers = [\"{}\"]\n", dns.addr))
            .replace(
                &format!("http://{}", prefill.addr),
                &format!("http://prefill.baton.test:{}", prefill.addr.port()),
            );
    let run = |text: &str| {
        let file = dir.join("check.toml");
        std::fs::write(&file, text).unwrap();
        Command::new(env!("CARGO_BIN_EXE_baton")).args(["check-config"]).arg(&file).output().unwrap()
    };
    let ok = run(&base);
    let out = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{out}{}", String::from_utf8_lossy(&ok.stderr));
    assert!(out.contains("prefill[0].url: prefill.baton.test resolves to [127.0.0.1]"), "{out}");

    let missing = base.replace(
        &format!("http://{}", decode.addr),
        &format!("http://decode-9.baton.test:{}", decode.addr.port()),
    );
    let bad = run(&missing);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success(), "{}", String::from_utf8_lossy(&bad.stdout));
    assert!(
        err.contains("decode[0].url") && err.contains("decode-9.baton.test") && err.contains("no address"),
        "{err}"
    );
}

/// A failed connection has the name looked up at once, not at the next refresh: with a refresh of a
/// minute, the record moves from A to B and A stops; requests reach B within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connection_looks_the_name_up_at_once() {
    let dir = tempdir("failed");
    let (prefill, a, b) = nixl_trio().await;
    let port = a.addr.port();
    let Some(mut dns) =
        Dns::start(&dir, &[("prefill.baton.test", &["127.0.0.1"]), ("decode.baton.test", &["127.0.0.2"])])
            .await
    else {
        return;
    };
    let file = nixl_by_name(&dir, dns.addr, 60_000, prefill.addr.port(), port);
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    let gw = serving.addrs[0];
    assert_eq!(complete(gw, "to-a-0").await.0, 200);
    assert_eq!(received_in(&a, "to-a"), 1);

    dns.set(&[("prefill.baton.test", &["127.0.0.1"]), ("decode.baton.test", &["127.0.0.3"])]).await;
    a.shutdown().await;
    let start = Instant::now();
    let mut failed = 0;
    loop {
        let (s, body) = complete(gw, &format!("to-b-{failed}")).await;
        if s == 200 {
            break;
        }
        failed += 1;
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "no request reached B within 2 s ({failed} failed, the last: {s} {})",
            String::from_utf8_lossy(&body)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(received_in(&b, "to-b") >= 1);
    eprintln!("B reached after {:?} and {failed} failed requests (refresh 60 s)", start.elapsed());
    serving.shutdown().await;
}

/// `deploy/kubernetes/`: the ConfigMap's `baton.toml` passes `baton check-config` with the
/// engines' headless-Service names resolved (dnsmasq standing in for the cluster's DNS) and the
/// Secrets' files where the Deployment mounts them; the Deployment's ports and probes are the
/// file's listeners, its grace period covers the preStop sleep and the drain, and the
/// ServiceMonitor scrapes a port and a Secret that exist. (`scripts/check-deploy` validates every
/// manifest against the Kubernetes schemas.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_manifests_agree_with_each_other_and_their_config_checks() {
    use serde_yaml_ng::Value as Yaml;
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let docs = |file: &str| -> Vec<Yaml> {
        let text = std::fs::read_to_string(deploy.join(file)).unwrap();
        serde_yaml_ng::Deserializer::from_str(&text)
            .map(|d| serde::Deserialize::deserialize(d).unwrap())
            .collect()
    };
    let cm = &docs("configmap.yaml")[0];
    let toml_text = cm["data"]["baton.toml"].as_str().unwrap().to_owned();
    let config: toml::Table = toml::from_str(&toml_text).unwrap();
    // The engines' names, served by a dnsmasq on loopback.
    let hosts: Vec<String> = toml_text
        .lines()
        .filter_map(|l| l.split("url = \"http://").nth(1))
        .map(|rest| rest.split(':').next().unwrap().to_owned())
        .collect();
    assert_eq!(hosts.len(), 4, "{hosts:?}");
    let dir = tempdir("kubernetes");
    let records: Vec<(&str, &[&str])> = hosts.iter().map(|h| (h.as_str(), &["127.0.0.1"][..])).collect();
    let Some(dns) = Dns::start(&dir, &records).await else { return };
    // The Secrets' files, where the Deployment mounts them.
    let ca = Ca::new("k8s");
    let (cert, key, _, _) = ca.leaf(&["baton.baton.svc"]);
    std::fs::create_dir_all(dir.join("tls")).unwrap();
    std::fs::create_dir_all(dir.join("keys")).unwrap();
    std::fs::write(dir.join("tls/tls.crt"), cert).unwrap();
    std::fs::write(dir.join("tls/tls.key"), key).unwrap();
    std::fs::write(
        dir.join("keys/keys.toml"),
        format!("[[keys]]\nsha256 = \"{}\"\ntenant = \"team-a\"\n", "ab".repeat(32)),
    )
    .unwrap();
    let text = format!(
        "{}\n[resolver]\nnameservers = [\"{}\"]\n",
        toml_text.replace("/etc/baton/", &format!("{}/", dir.display())),
        dns.addr
    );
    let file = dir.join("baton.toml");
    std::fs::write(&file, text).unwrap();
    let check = Command::new(env!("CARGO_BIN_EXE_baton")).arg("check-config").arg(&file).output().unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{out}{}", String::from_utf8_lossy(&check.stderr));
    assert!(out.contains("cluster: replica"), "{out}");
    for h in &hosts {
        assert!(out.contains(&format!("{h} resolves to [127.0.0.1]")), "{h}: {out}");
    }

    // The Deployment: its ports are the file's listeners, its probes the public one, its grace
    // period the preStop sleep plus the drain (and slack), its config mounted where args say.
    let dep = &docs("deployment.yaml")[0];
    let pod = &dep["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let port_of = |addr: &str| addr.rsplit(':').next().unwrap().parse::<u64>().unwrap();
    let listener = port_of(config["listeners"][0]["address"].as_str().unwrap());
    let admin = port_of(config["admin"]["listen"].as_str().unwrap());
    let ports: Vec<(String, u64)> = c["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap().to_owned(), p["containerPort"].as_u64().unwrap()))
        .collect();
    assert_eq!(ports, vec![("https".to_owned(), listener), ("admin".to_owned(), admin)]);
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(c[probe]["httpGet"]["port"].as_str(), Some("https"), "{probe}");
        assert_eq!(c[probe]["httpGet"]["scheme"].as_str(), Some("HTTPS"), "{probe}");
    }
    assert_eq!(c["readinessProbe"]["httpGet"]["path"].as_str(), Some("/ready"));
    assert_eq!(c["livenessProbe"]["httpGet"]["path"].as_str(), Some("/health"));
    let drain_s = config["shutdown"]["drain_timeout_ms"].as_integer().unwrap() as u64 / 1000;
    let pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"].as_u64().unwrap();
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace > pre_stop + drain_s,
        "grace {grace} s must exceed preStop {pre_stop} s + drain {drain_s} s"
    );
    let args: Vec<&str> = c["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let mounted =
        c["volumeMounts"].as_sequence().unwrap().iter().any(|m| m["mountPath"].as_str() == Some(args[2]));
    assert!(mounted, "{args:?} names a file no volume mounts");
    // The ServiceMonitor scrapes the admin Service's port with a Secret that exists.
    let sm = &docs("servicemonitor.yaml")[0];
    let services = docs("service.yaml");
    let admin_svc = services.iter().find(|s| s["metadata"]["name"].as_str() == Some("baton-admin")).unwrap();
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_mapping().unwrap() {
        assert_eq!(&admin_svc["metadata"]["labels"][k.as_str().unwrap()], v, "the ServiceMonitor's selector");
    }
    let endpoint = &sm["spec"]["endpoints"][0];
    assert_eq!(admin_svc["spec"]["ports"][0]["name"], endpoint["port"]);
    let secret = endpoint["authorization"]["credentials"]["name"].as_str().unwrap();
    let secrets = docs("secret.yaml");
    assert!(secrets.iter().any(|s| s["metadata"]["name"].as_str() == Some(secret)
        && !s["stringData"][endpoint["authorization"]["credentials"]["key"].as_str().unwrap()].is_null()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `[engine_tls]` rotated under a running gateway: engines that require client certificates
/// refuse the gateway's first one (another CA's); once its files hold a certificate of their CA,
/// the file watch swaps the engine client and requests are served, with no restart. A pair that
/// does not load (a key that is not the certificate's) is refused and counted, and the
/// certificates in force keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_client_certificates_are_reloaded_when_their_files_change() {
    let dir = tempdir("engine-rotation");
    let Some((prefill, decode, dns)) = native_pair(&dir, "engines.baton.test").await else { return };
    let (ca, p_front, d_front) = mtls_fronts(&dir, &prefill, &decode).await;
    let (other_cert, other_key, _, _) = Ca::new("another CA").leaf(&["baton-gateway"]);
    let install = |cert: &str, key: &str| {
        for (name, text) in [("gateway.key", key), ("gateway.pem", cert)] {
            std::fs::write(dir.join(format!("{name}.new")), text).unwrap();
            std::fs::rename(dir.join(format!("{name}.new")), dir.join(name)).unwrap();
        }
    };
    install(&other_cert, &other_key);
    let serving = through_fronts(
        &dir,
        (&prefill, &decode, &dns),
        (p_front, d_front),
        "ca = \"ca.pem\"\ncert = \"gateway.pem\"\nkey = \"gateway.key\"\n",
        false,
    )
    .await;
    let reloads = |result: &'static str| {
        let admin = serving.admin_addr;
        async move {
            let (_, m) = super::http(admin, "/metrics", None).await;
            super::sample_or_zero(
                &String::from_utf8_lossy(&m),
                &format!("baton_tls_reloads_total{{result=\"{result}\",tls=\"engines\"}} "),
            )
        }
    };
    let complete = || async {
        super::http(serving.addrs[0], "/v1/completions", Some(&json!({"prompt": "hello", "max_tokens": 3})))
            .await
            .0
    };
    // Rotated to a certificate of the engines' CA: served once the watch has read it (and the
    // health checks found the engines again).
    let (gw_cert, gw_key, _, _) = ca.leaf(&["baton-gateway"]);
    install(&gw_cert, &gw_key);
    let start = Instant::now();
    while complete().await != 200 {
        assert!(start.elapsed() < Duration::from_secs(10), "never served after the rotation");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(reloads("swapped").await >= 1.0);
    // A key that is not the certificate's: refused, counted, and the certificates in force serve.
    let (_, stray_key, _, _) = ca.leaf(&["baton-gateway"]);
    install(&gw_cert, &stray_key);
    let start = Instant::now();
    while reloads("refused").await < 1.0 {
        assert!(start.elapsed() < Duration::from_secs(5), "the bad pair was never read");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(complete().await, 200);
    serving.shutdown().await;
}
