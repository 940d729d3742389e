//! The tests' HTTP client: the suite's hyper client (`tests/support/http.rs`), a JSON helper, SSE
//! events, and a blocking GET for readiness polls.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

#[path = "../support/http.rs"]
mod shared;
pub use shared::{http, send};

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
