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
