//! Certificates rotated under a running `baton serve` (the real binary): new connections get the
//! new certificate, a stream open on the old one finishes on it, a bad new file is refused and
//! the certificate in force stays; on SIGHUP at once and, without it, when the files change.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;
use tokio::net::TcpStream;

use super::certs::Ca;
use super::drain::{engines, spawn};

fn connector(ca: &Ca) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der.clone()).unwrap();
    let mut c =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(c))
}

/// A TLS connection to `addr`, and the certificate the server presented.
async fn connect(
    tls: &tokio_rustls::TlsConnector,
    addr: SocketAddr,
) -> (tokio_rustls::client::TlsStream<TcpStream>, CertificateDer<'static>) {
    let s = tls
        .connect(ServerName::try_from("localhost").unwrap(), TcpStream::connect(addr).await.unwrap())
        .await
        .unwrap();
    let cert = s.get_ref().1.peer_certificates().unwrap()[0].clone().into_owned();
    (s, cert)
}

/// The certificate a new connection gets.
async fn presented(tls: &tokio_rustls::TlsConnector, addr: SocketAddr) -> CertificateDer<'static> {
    connect(tls, addr).await.1
}

/// Writes a certificate and key the way a rotation does: each file replaced whole (written
/// beside it, then renamed over it), the key first.
fn install(dir: &std::path::Path, cert: &str, key: &str) {
    for (name, text) in [("server.key", key), ("server.pem", cert)] {
        let tmp = dir.join(format!("{name}.new"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

async fn reloads(admin: SocketAddr, result: &str) -> f64 {
    let (_, m) = super::http(admin, "/metrics", None).await;
    let m = String::from_utf8_lossy(&m);
    m.lines()
        .filter(|l| l.starts_with("baton_tls_reloads_total{") && l.contains(&format!("result=\"{result}\"")))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum::<f64>()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_serves_new_connections_while_open_streams_finish_on_the_old() {
    let (prefill, decode) = engines(Duration::from_millis(10)).await;
    let dir = std::env::temp_dir().join(format!("baton-rotation-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = Ca::new("rotation CA");
    let (old_pem, old_key, old_der, _) = ca.leaf(&["localhost"]);
    install(&dir, &old_pem, &old_key);
    let tls_keys = format!(
        "tls_cert = {:?}\ntls_key = {:?}",
        dir.join("server.pem").display().to_string(),
        dir.join("server.key").display().to_string()
    );
    let text = super::serve_toml(&prefill, &decode, "", "").replacen("plain_http = true", &tls_keys, 1);
    let file = dir.join("baton.toml");
    std::fs::write(&file, text).unwrap();
    let (baton, public, admin) = spawn(&["serve", "--config", file.to_str().unwrap()]);
    let tls = connector(&ca);
    assert_eq!(presented(&tls, public).await, old_der);

    // A stream opened on the old certificate: 200 tokens at 10 ms, about 2 s.
    let (conn, cert) = connect(&tls, public).await;
    assert_eq!(cert, old_der);
    let (mut send, c) = hyper::client::conn::http1::handshake(TokioIo::new(conn)).await.unwrap();
    tokio::spawn(c);
    let body = json!({"prompt": "rotate under me", "max_tokens": 200, "stream": true,
                      "stream_options": {"include_usage": true}});
    let req = Request::post("/v1/completions")
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    assert_eq!(res.status(), 200);
    let stream = tokio::spawn(async move { res.into_body().collect().await.map(|b| b.to_bytes()) });

    // Rotated and SIGHUP: new connections get the new certificate at once.
    let (new_pem, new_key, new_der, _) = ca.leaf(&["localhost"]);
    install(&dir, &new_pem, &new_key);
    baton.signal(rustix::process::Signal::HUP);
    let start = Instant::now();
    while presented(&tls, public).await != new_der {
        assert!(start.elapsed() < Duration::from_secs(2), "the new certificate was not served");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(reloads(admin, "swapped").await >= 1.0);
    assert!(!stream.is_finished(), "the stream ended before the rotation: the test proves nothing");
    // The stream open on the old certificate finishes, whole.
    let text = String::from_utf8_lossy(&stream.await.unwrap().unwrap()).into_owned();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    assert!(text.contains("\"completion_tokens\":200"), "{text}");

    // A bad new file (a key that is not the certificate's) is refused, counted, and the
    // certificate in force stays; found without SIGHUP, by the file watch.
    let refused = reloads(admin, "refused").await;
    let (other_pem, _, _, _) = ca.leaf(&["localhost"]);
    install(&dir, &other_pem, &new_key);
    let start = Instant::now();
    while reloads(admin, "refused").await == refused {
        assert!(start.elapsed() < Duration::from_secs(5), "the bad file was never read");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(presented(&tls, public).await, new_der);
    // Mended: served again within the watch's period.
    let (last_pem, last_key, last_der, _) = ca.leaf(&["localhost"]);
    install(&dir, &last_pem, &last_key);
    let start = Instant::now();
    while presented(&tls, public).await != last_der {
        assert!(start.elapsed() < Duration::from_secs(5), "the mended files were not served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(baton);
    let _ = std::fs::remove_dir_all(&dir);
}
