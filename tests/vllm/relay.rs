//! A TCP relay that records what passes: put between baton and an engine, it shows the exact
//! bytes of every request baton sent and every answer the engine gave, with nothing changed.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What went up (to the engine) and down (back) on one connection.
type Conversation = (Vec<u8>, Vec<u8>);

/// Both directions of every connection, in the order connections were accepted.
#[derive(Clone, Debug, Default)]
pub struct Recorded(Arc<Mutex<Vec<Conversation>>>);

impl Recorded {
    /// The JSON bodies of every request sent through the relay (HTTP/1.1 with Content-Length).
    pub fn request_bodies(&self) -> Vec<serde_json::Value> {
        self.0.lock().unwrap().iter().flat_map(|(up, _)| bodies(up)).collect()
    }

    /// The JSON bodies of every answer (non-streamed answers only).
    pub fn answer_bodies(&self) -> Vec<serde_json::Value> {
        self.0.lock().unwrap().iter().flat_map(|(_, down)| bodies(down)).collect()
    }
}

/// Splits a byte stream of HTTP/1.1 messages and parses each body (`Content-Length` or chunked)
/// as JSON; bodies that are not JSON (an SSE stream) are left out.
fn bodies(mut b: &[u8]) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    while let Some(end) = b.windows(4).position(|w| w == b"\r\n\r\n") {
        let head = String::from_utf8_lossy(&b[..end]).to_ascii_lowercase();
        let rest = &b[end + 4..];
        let (body, used) = if head.contains("transfer-encoding: chunked") {
            dechunk(rest)
        } else {
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0)
                .min(rest.len());
            (rest[..len].to_vec(), len)
        };
        if let Ok(v) = serde_json::from_slice(&body) {
            out.push(v);
        }
        b = &rest[used..];
    }
    out
}

/// A chunked body's bytes and how many bytes of `b` it took.
fn dechunk(b: &[u8]) -> (Vec<u8>, usize) {
    let mut body = Vec::new();
    let mut at = 0;
    while let Some(eol) = b[at..].windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&b[at..at + eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
            .unwrap_or(0);
        at += eol + 2;
        if size == 0 {
            return (body, (at + 2).min(b.len()));
        }
        let end = (at + size).min(b.len());
        body.extend_from_slice(&b[at..end]);
        at = (end + 2).min(b.len());
    }
    (body, b.len())
}

/// Starts a relay to `upstream`; its address and what it records.
pub async fn start(upstream: SocketAddr) -> (SocketAddr, Recorded) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let rec = Recorded::default();
    let r = rec.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else { continue };
            let idx = {
                let mut v = r.0.lock().unwrap();
                v.push((Vec::new(), Vec::new()));
                v.len() - 1
            };
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(pipe(cr, sw, r.clone(), idx, true));
            tokio::spawn(pipe(sr, cw, r.clone(), idx, false));
        }
    });
    (addr, rec)
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    rec: Recorded,
    idx: usize,
    up: bool,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        {
            let mut v = rec.0.lock().unwrap();
            let side = if up { &mut v[idx].0 } else { &mut v[idx].1 };
            side.extend_from_slice(&buf[..n]);
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// An HTTP proxy to `upstream` that answers the first `refuse` POSTs itself with a 503 and an HTML
/// page (as a load balancer in front of an engine that is restarting does: the engine never sees
/// the request) and forwards everything else (metrics scrapes, health checks, later POSTs) unchanged.
pub async fn refusing(
    upstream: SocketAddr,
    refuse: usize,
) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{BodyExt, Full, combinators::BoxBody};
    use hyper::body::{Bytes, Incoming};
    use hyper_util::rt::TokioIo;

    type Body = BoxBody<Bytes, hyper::Error>;
    async fn forward(
        upstream: SocketAddr,
        req: hyper::Request<Incoming>,
    ) -> Result<hyper::Response<Body>, hyper::Error> {
        let stream = TcpStream::connect(upstream).await.unwrap();
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(tx.send_request(req).await?.map(BodyExt::boxed))
    }

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let refused = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&refused);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let count = Arc::clone(&count);
                async move {
                    if req.method() == hyper::Method::POST
                        && count
                            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                                (n < refuse).then_some(n + 1)
                            })
                            .is_ok()
                    {
                        let body = "<html><body><h1>503 Service Temporarily Unavailable</h1></body></html>";
                        let resp = hyper::Response::builder()
                            .status(503)
                            .header("content-type", "text/html")
                            .body(Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed())
                            .unwrap();
                        return Ok(resp);
                    }
                    forward(upstream, req).await
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(client), svc),
            );
        }
    });
    (addr, refused)
}
