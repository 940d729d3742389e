//! The test binaries' HTTP client (`e2e`, `vllm`, the simulator's `scenarios`): hyper over one new connection a request, so
//! dropping a request or its body closes the connection, as a client that leaves does.

// Each binary uses what it needs of this file.
#![allow(dead_code)]

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// Sends a request (a POST of `body` as JSON, or a GET without one); the response head and its
/// body still to read.
pub async fn send(addr: SocketAddr, path: &str, body: Option<&Value>) -> hyper::Response<Incoming> {
    send_with(addr, path, body, &[]).await
}

/// [`send`] with more request headers.
pub async fn send_with(
    addr: SocketAddr,
    path: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> hyper::Response<Incoming> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req = match body {
        Some(_) => Request::post(path).header("content-type", "application/json"),
        None => Request::get(path),
    }
    .header("host", addr.to_string());
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    tx.send_request(req.body(Full::new(body)).unwrap()).await.unwrap()
}

/// A whole request: the status and the body.
pub async fn http(addr: SocketAddr, path: &str, body: Option<&Value>) -> (u16, Bytes) {
    let res = send(addr, path, body).await;
    let status = res.status().as_u16();
    (status, res.into_body().collect().await.unwrap().to_bytes())
}
