//! The tests' HTTP client: hyper over loopback, one connection a request (so dropping a request
//! closes its connection, as a client that leaves does), and a blocking GET for readiness polls.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// A blocking `GET` with `Connection: close`: the status and the body.
pub fn get_blocking(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Ok((status, body))
}

/// Sends a request; the response head and its body still to read.
pub async fn send(addr: SocketAddr, path: &str, body: Option<&Value>) -> hyper::Response<Incoming> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let req = match body {
        Some(b) => Request::post(path)
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(b.to_string())))
            .unwrap(),
        None => Request::get(path).header("host", addr.to_string()).body(Full::new(Bytes::new())).unwrap(),
    };
    tx.send_request(req).await.unwrap()
}

/// A whole request: the status and the body.
pub async fn http(addr: SocketAddr, path: &str, body: Option<&Value>) -> (u16, Bytes) {
    let res = send(addr, path, body).await;
    let status = res.status().as_u16();
    (status, res.into_body().collect().await.unwrap().to_bytes())
}

/// A JSON answer: the status and the body parsed (panics naming the body when it is not JSON).
pub async fn json(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (s, b) = http(addr, path, Some(body)).await;
    let v = serde_json::from_slice(&b).unwrap_or_else(|e| {
        panic!("{path} answered {s} with no JSON ({e}): {}", String::from_utf8_lossy(&b))
    });
    (s, v)
}

/// The `data:` payloads of an SSE body, `[DONE]` included.
pub fn sse_events(body: &[u8]) -> Vec<String> {
    std::str::from_utf8(body)
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data event: {e:?}")).to_owned()
        })
        .collect()
}
