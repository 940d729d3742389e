//! An authenticated data plane: decoder ranks serving mTLS (`baton-sim`'s data-plane TLS), a
//! prefiller and `baton serve` (`[dataplane_tls]`) reaching them with certificates from the ranks'
//! CA. Traffic flows; a plain TCP client, a TLS client without a certificate and one with a
//! certificate from another CA are refused at the handshake, and nothing they sent reached the
//! rank's pages.

use baton_dataplane::transport::{ControlClient, TlsClient};
use baton_sim::{DpTls, SimConfig, SimRole, kv::output_text, launch, tiny_geometry};

use super::certs::Ca;
use serde_json::json;

/// A prefiller and a decoder of TP `tp` whose data planes serve mTLS with a certificate from one
/// CA, and the gateway's certificate and key from the same CA, as PEM files (`ca.pem`,
/// `gateway.pem`, `gateway.key`) in a folder of the test's own.
struct Mtls {
    dir: std::path::PathBuf,
    ca: Ca,
    prefill: baton_sim::Running,
    decode: baton_sim::Running,
}

impl Mtls {
    async fn start(tag: &str, tp: u32) -> Self {
        let dir = std::env::temp_dir().join(format!("baton-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = Ca::new("baton data plane CA");
        let (engine_pem, engine_key, ..) = ca.leaf(&["localhost"]);
        let (gateway_pem, gateway_key, ..) = ca.leaf(&["localhost"]);
        for (name, text) in [
            ("ca.pem", &ca.pem),
            ("engine.pem", &engine_pem),
            ("engine.key", &engine_key),
            ("gateway.pem", &gateway_pem),
            ("gateway.key", &gateway_key),
        ] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let g = tiny_geometry(tp).unwrap();
        let tls = DpTls::from_pem_files(
            &dir.join("ca.pem"),
            &dir.join("engine.pem"),
            &dir.join("engine.key"),
            "localhost",
        )
        .unwrap();
        let mut p = SimConfig::new(SimRole::Prefill, g);
        p.dp_tls = Some(tls.clone());
        let mut d = SimConfig::new(SimRole::Decode, g);
        d.dp_tls = Some(tls);
        let (prefill, decode) = (launch(p).await.unwrap(), launch(d).await.unwrap());
        Self { dir, ca, prefill, decode }
    }

    fn write(&self, name: &str, text: &str) -> std::path::PathBuf {
        let p = self.dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_data_plane_serves_the_gateway_and_refuses_strangers() {
    let m = Mtls::start("dptls", 2).await;
    let (dir, ca, prefill, decode) = (&m.dir, &m.ca, &m.prefill, &m.decode);
    let write = |name: &str, text: &str| m.write(name, text);
    let g = tiny_geometry(2).unwrap();
    let tls = "[dataplane_tls]\nca = \"ca.pem\"\ncert = \"gateway.pem\"\nkey = \"gateway.key\"\nserver_name = \"localhost\"\n";
    let text = super::serve_toml(prefill, decode, "", tls);
    let file = write("baton.toml", &text);
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    // The gateway's control connections, its event feeds and the prefiller's writes all pass.
    let prompt = super::prompt(100, 3);
    let (s, b) =
        super::http(serving.addrs[0], "/v1/completions", Some(&json!({"prompt": prompt, "max_tokens": 4})))
            .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
    assert_eq!(super::answer_text(&b, false, false).0, output_text(&ids, 4));

    let rank0: std::net::SocketAddr =
        decode.engine.stats()["ranks"][0]["addr"].as_str().unwrap().parse().unwrap();
    let before = decode.engine.stats()["ranks"][0].clone();
    let fp = g.fingerprint();
    let other = Ca::new("someone else's CA");
    let (_, _, rogue_cert, rogue_key) = other.leaf(&["localhost"]);
    let strangers: [(&str, Option<TlsClient>); 3] = [
        ("plain TCP", None),
        ("TLS without a certificate", Some(TlsClient::new(vec![ca.der.clone()], "localhost", None).unwrap())),
        (
            "a certificate from another CA",
            Some(
                TlsClient::new(vec![ca.der.clone()], "localhost", Some((vec![rogue_cert], rogue_key)))
                    .unwrap(),
            ),
        ),
    ];
    for (who, client) in &strangers {
        let r = ControlClient::connect_with(rank0, client.as_ref(), fp, 0).await;
        let refused = match r {
            Err(_) => true,
            // Under TLS 1.3 the server's verdict on a client certificate can arrive after the
            // client's side of the handshake: the first call then fails.
            Ok(mut c) => {
                let key = baton_dataplane::RequestKey::new(baton_dataplane::RequestId(7), 0);
                c.reserve(key, 3, std::time::Duration::from_secs(60), &[]).await.is_err()
            }
        };
        assert!(refused, "{who} was served");
    }
    // The rank counts a refusal when its side of the handshake ends, which can come just after the
    // client has seen the failure.
    let t = std::time::Instant::now();
    let after = loop {
        let after = decode.engine.stats()["ranks"][0].clone();
        if after["handshakes_refused"].as_u64().unwrap() >= 3
            || t.elapsed() > std::time::Duration::from_secs(5)
        {
            break after;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    assert!(
        after["handshakes_refused"].as_u64().unwrap() >= 3,
        "the rank counted (and logged) the refusals: {after}"
    );
    assert_eq!(after["pages_free"], after["pages_total"], "nothing the strangers sent took a page: {after}");
    assert_eq!(after["requests"], before["requests"], "{after}");
    serving.shutdown().await;

    // The same TLS given to the pool itself (`[decode.dataplane_tls]`) instead of to every pool.
    let pool_tls = tls.replace("[dataplane_tls]", "[decode.dataplane_tls]");
    let file = write("pool.toml", &super::serve_toml(prefill, decode, &pool_tls, ""));
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    let (s, b) = super::http(
        serving.addrs[0],
        "/v1/completions",
        Some(&json!({"prompt": "per pool", "max_tokens": 2})),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    serving.shutdown().await;
    // Without any TLS the gateway cannot reach the ranks at all.
    let file = write("none.toml", &super::serve_toml(prefill, decode, "", ""));
    let refused = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await;
    assert!(refused.is_err(), "a gateway without the data plane's TLS reached its ranks");
    let _ = std::fs::remove_dir_all(dir);
}

/// A rank off loopback in plain TCP is refused by `check-config` and `baton serve`, naming the
/// pool, the rank and both ways out (`dataplane_tls`, `dataplane_plaintext`); the operator's
/// `dataplane_plaintext = true` lets the check pass.
#[test]
fn a_plaintext_rank_off_loopback_is_refused_unless_the_pool_says_so() {
    let dir = std::env::temp_dir().join(format!("baton-dpplain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = |extra: &str| {
        format!(
            "{}\n[[prefill]]\nname = \"p\"\nurl = \"http://127.0.0.1:1\"\n\n[[decode]]\nname = \"d\"\n\
             url = \"http://10.255.255.1:8000\"\ndataplane = [\"127.0.0.1:9000\", \"10.255.255.1:9001\"]\n{extra}",
            super::SERVE_HEAD
        )
    };
    let run = |args: &[&str], body: &str| {
        let file = dir.join("plain.toml");
        std::fs::write(&file, body).unwrap();
        std::process::Command::new(env!("CARGO_BIN_EXE_baton")).args(args).arg(&file).output().unwrap()
    };
    for args in [&["check-config"][..], &["serve", "--config"][..]] {
        let out = run(args, &text(""));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stdout));
        for want in
            ["decode[0].dataplane", "10.255.255.1:9001", "dataplane_tls", "dataplane_plaintext = true"]
        {
            assert!(err.contains(want), "{args:?}: {want} not in {err}");
        }
    }
    let out = run(&["check-config"], &text("dataplane_plaintext = true\n"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `[dataplane_tls]` reloaded live: the gateway's certificate for the ranks is rotated while it
/// serves. A mismatched pair is refused and counted, and the certificate in force keeps opening
/// new connections; a new pair is swapped in, and the ranks see it on the gateway's next new
/// connections (one from a CA they do not trust is refused at their handshake) while the
/// connections already open keep serving; a good pair again mends it, with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_data_plane_certificates_serve_new_connections() {
    let m = Mtls::start("dptls-rotate", 1).await;
    let (dir, ca, prefill, decode) = (&m.dir, &m.ca, &m.prefill, &m.decode);
    let write = |name: &str, text: &str| m.write(name, text);
    // The decoder's breaker opens while the ranks refuse the gateway (below): a short span, so
    // the mended gateway probes it again soon.
    let conf = "[dataplane_tls]\nca = \"ca.pem\"\ncert = \"gateway.pem\"\nkey = \"gateway.key\"\nserver_name = \"localhost\"\n\n[routing]\neject_ms = 100\n";
    let file = write("baton.toml", &super::serve_toml(prefill, decode, "", conf));
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    let (addr, admin) = (serving.addrs[0], serving.admin_addr);
    // `n` requests at once: more than the control connections pooled so far open new ones.
    let burst = |n: usize, seed: usize| async move {
        let mut set = tokio::task::JoinSet::new();
        for i in 0..n {
            let body = json!({"prompt": super::prompt(60, seed + i), "max_tokens": 2});
            set.spawn(async move { super::http(addr, "/v1/completions", Some(&body)).await.0 });
        }
        set.join_all().await
    };
    let reloads = |result: &'static str| async move {
        let (_, m) = super::http(admin, "/metrics", None).await;
        super::plugins::metric(
            &String::from_utf8_lossy(&m),
            &format!("baton_tls_reloads_total{{result=\"{result}\",tls=\"dataplane\"}} "),
        )
    };
    let wait_for = |result: &'static str, n: f64| async move {
        let t = std::time::Instant::now();
        while reloads(result).await < n {
            assert!(t.elapsed() < std::time::Duration::from_secs(5), "no {result} reload within 5 s");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };
    let refused_by_rank = || decode.engine.stats()["ranks"][0]["handshakes_refused"].as_u64().unwrap();
    assert_eq!(burst(3, 0).await, vec![200; 3]);

    // A key that does not match its certificate: refused, the pair in force stays.
    let (other_pem, ..) = ca.leaf(&["localhost"]);
    write("gateway.pem", &other_pem);
    wait_for("refused", 1.0).await;
    assert_eq!(burst(4, 10).await, vec![200; 4], "the certificate in force still opens connections");
    assert_eq!(refused_by_rank(), 0);

    // A valid pair from a CA the ranks do not trust: swapped in, and the ranks refuse the
    // gateway's new connections, the proof that they carry it.
    let rogue = super::certs::Ca::new("a CA the ranks do not trust");
    let (rogue_pem, rogue_key, ..) = rogue.leaf(&["localhost"]);
    write("gateway.key", &rogue_key);
    write("gateway.pem", &rogue_pem);
    wait_for("swapped", 1.0).await;
    // Bursts until one needs more control connections than the pool kept (bounded).
    let mut statuses = Vec::new();
    for round in 0..5 {
        statuses.extend(burst(12, 20 + 20 * round).await);
        let t = std::time::Instant::now();
        while refused_by_rank() == 0 && t.elapsed() < std::time::Duration::from_millis(500) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        if refused_by_rank() > 0 {
            break;
        }
    }
    assert!(refused_by_rank() > 0, "new connections presented the new certificate: {statuses:?}");
    assert!(statuses.contains(&200), "connections open before the rotation kept serving: {statuses:?}");

    // A good pair again: swapped, and every request is served.
    let (mended_pem, mended_key, ..) = ca.leaf(&["localhost"]);
    write("gateway.key", &mended_key);
    write("gateway.pem", &mended_pem);
    wait_for("swapped", 2.0).await;
    let t = std::time::Instant::now();
    loop {
        let (s, b) =
            super::http(addr, "/v1/completions", Some(&json!({"prompt": "mended", "max_tokens": 2}))).await;
        if s == 200 {
            break;
        }
        // (503 while the decoder's breaker is still open)
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "{s}: {}", String::from_utf8_lossy(&b));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let refused = refused_by_rank();
    assert_eq!(burst(12, 200).await, vec![200; 12]);
    assert_eq!(refused_by_rank(), refused, "no handshake refused after the mend");
    serving.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
