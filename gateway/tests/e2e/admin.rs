//! The admin listener: `/metrics` and `/admin/*` are served there only (404 on the public port),
//! behind the bearer token whose SHA-256 is configured (401 without it); probes answer on both.

use baton_gateway::demo::{DemoConfig, GatewaySetup, start_engines, start_gateway};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::net::SocketAddr;
use tokio::net::TcpStream;

async fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, Option<String>, Bytes) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req = Request::get(path).header("host", addr.to_string());
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let res = send.send_request(req.body(Full::new(Bytes::new())).unwrap()).await.unwrap();
    let status = res.status().as_u16();
    let auth = res.headers().get("www-authenticate").map(|v| v.to_str().unwrap().to_owned());
    (status, auth, res.into_body().collect().await.unwrap().to_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_only_on_the_admin_listener_behind_the_token() {
    let engines = start_engines(&DemoConfig::default()).await.unwrap();
    let token = "s3cret-admin-token";
    let run = start_gateway(
        &engines,
        "127.0.0.1:0".parse().unwrap(),
        GatewaySetup {
            admin_token_sha256: Some(baton_gateway::auth::digest(token.as_bytes())),
            ..GatewaySetup::default()
        },
    )
    .await
    .unwrap();
    for path in ["/metrics", "/admin/decoders", "/admin/plugins"] {
        let (s, _, _) = get(run.addr, path, Some(token)).await;
        assert_eq!(s, 404, "{path} is not served on the public listener");
        let (s, auth, b) = get(run.admin, path, None).await;
        assert_eq!((s, auth.as_deref()), (401, Some("Bearer")), "{path} without the token");
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], "unauthorized", "{v}");
        let (s, _, _) = get(run.admin, path, Some("not-the-token")).await;
        assert_eq!(s, 401, "{path} with another token");
        let (s, _, b) = get(run.admin, path, Some(token)).await;
        assert_eq!(s, 200, "{path} with the token: {}", String::from_utf8_lossy(&b));
    }
    let (s, _, b) = get(run.admin, "/metrics", Some(token)).await;
    assert_eq!(s, 200);
    assert!(String::from_utf8_lossy(&b).contains("baton_phase_seconds_count"), "the exposition");
    // Probes answer on both, with no token.
    for addr in [run.addr, run.admin] {
        assert_eq!(get(addr, "/health", None).await.0, 200);
        assert_eq!(get(addr, "/ready", None).await.0, 200);
    }
    // The OpenAI API is not on the admin listener.
    assert_eq!(get(run.admin, "/v1/models", Some(token)).await.0, 404);
    assert_eq!(get(run.addr, "/v1/models", None).await.0, 200);
    run.stop().await;
    for e in engines.running {
        e.shutdown().await;
    }
}

/// The admin listener over mTLS (`[admin] tls_cert`, `tls_key`, `client_ca`): an operator with a
/// certificate from the CA reads `/metrics`; a client without one, or with one from another CA, is
/// refused at the handshake; plain HTTP gets no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listener_over_mtls_serves_only_certified_clients() {
    use std::sync::Arc;

    use rustls::pki_types::ServerName;

    use super::certs::Ca;
    let g = baton_sim::tiny_geometry(1).unwrap();
    let prefill = baton_sim::launch(baton_sim::SimConfig::new(baton_sim::SimRole::Prefill, g)).await.unwrap();
    let decode = baton_sim::launch(baton_sim::SimConfig::new(baton_sim::SimRole::Decode, g)).await.unwrap();
    let dir = std::env::temp_dir().join(format!("baton-admin-mtls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = Ca::new("admin CA");
    let (server_pem, server_key, _, _) = ca.leaf(&["localhost"]);
    std::fs::write(dir.join("admin.pem"), server_pem).unwrap();
    std::fs::write(dir.join("admin.key"), server_key).unwrap();
    std::fs::write(dir.join("ca.pem"), &ca.pem).unwrap();
    let text = super::serve_toml(&prefill, &decode, "", "").replace(
        "[admin]\nlisten = \"127.0.0.1:0\"\n",
        "[admin]\nlisten = \"127.0.0.1:0\"\ntls_cert = \"admin.pem\"\ntls_key = \"admin.key\"\nclient_ca = \"ca.pem\"\n",
    );
    assert!(text.contains("client_ca"), "the admin table moved: {text}");
    let file = dir.join("baton.toml");
    std::fs::write(&file, &text).unwrap();
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    let admin = serving.admin_addr;
    let metrics = |client: Option<(
        Vec<rustls::pki_types::CertificateDer<'static>>,
        rustls::pki_types::PrivateKeyDer<'static>,
    )>| {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der.clone()).unwrap();
        async move {
            let b = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
            let c = match client {
                Some((chain, key)) => b.with_client_auth_cert(chain, key).unwrap(),
                None => b.with_no_client_auth(),
            };
            let tcp = TcpStream::connect(admin).await.ok()?;
            let tls = tokio_rustls::TlsConnector::from(Arc::new(c))
                .connect(ServerName::try_from("localhost").unwrap(), tcp)
                .await
                .ok()?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.ok()?;
            tokio::spawn(conn);
            let req =
                Request::get("/metrics").header("host", "localhost").body(Full::new(Bytes::new())).unwrap();
            let res = send.send_request(req).await.ok()?;
            let status = res.status().as_u16();
            let body = res.into_body().collect().await.ok()?.to_bytes();
            Some((status, body))
        }
    };
    let (_, _, cert, key) = ca.leaf(&["operator"]);
    let (status, body) = metrics(Some((vec![cert], key))).await.expect("a certified client is served");
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&body).contains("baton_requests_in_phase"), "not the metrics");
    assert!(metrics(None).await.is_none(), "a client without a certificate was served");
    let (_, _, other, other_key) = Ca::new("another CA").leaf(&["operator"]);
    assert!(
        metrics(Some((vec![other], other_key))).await.is_none(),
        "a certificate from another CA was accepted"
    );
    // Plain HTTP to the TLS port gets no HTTP answer.
    let plain = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        let stream = TcpStream::connect(admin).await.ok()?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.ok()?;
        tokio::spawn(conn);
        let req = Request::get("/metrics").header("host", "x").body(Full::new(Bytes::new())).unwrap();
        send.send_request(req).await.ok().map(|r| r.status().as_u16())
    })
    .await
    .ok()
    .flatten();
    assert_eq!(plain, None, "plain HTTP answered on the mTLS admin port");
    serving.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
