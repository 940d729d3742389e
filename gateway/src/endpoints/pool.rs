//! The gateway's kept-alive HTTP/1 connections to the engines, over hyper's own
//! `client::conn::http1`.
//!
//! hyper-util's pooled client did the same job at a cost every engine call paid: it hashed its
//! pool key (the URI's scheme and authority) with SipHash a byte at a time at each checkout and
//! each return (4.3k instructions a request for two legs, `scripts/count-instructions sglang`),
//! raced a lazy connect against each checkout, and spawned a task per call that waited for the
//! connection to be free again before pooling it. Here a connection is keyed by its [`EngineUrl`]
//! (hashed once, by its base string), taken without a race, and put back by the answer's body
//! itself when its last byte has been read ([`EngineBody`]).
//!
//! What the pooled client did and this does too:
//! - A connection idle longer than `[limits] engine_idle_timeout_ms` is not used again (engines
//!   close theirs after a while: a request sent as one closes is lost).
//! - A request found unsent on a kept-alive connection (closed before the request was written) is
//!   sent again on another, or on a new one; an answer is never asked for twice.
//! - A kept-alive connection not free for a new request is not waited on for long ([`KEPT_READY`]).
//!   hyper-util pooled a connection only once it was free; here the answer's end gives it back,
//!   and hyper marks it free as it reads that end, so a wait is short, but for a connection whose
//!   request was still being written when its answer ended.
//! - A new connection that closes before its first request is written is a failed connect (the
//!   name is looked up again, [`super::EngineClient::send`]), as a failed lookup, TCP connect or
//!   TLS handshake is.
//!
//! One thing it does differently: a connection to a named engine whose address the name no longer
//! has is not used again (hyper-util's `capture_connection` closed it after the request that found
//! it stale had used it).

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response};
use hyper_rustls::MaybeHttpsStream;
use rustc_hash::FxBuildHasher;
use tower_service::Service;

use super::{Connector, EngineUrl, Names};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a kept-alive connection taken from the pool may take to be free for a request before
/// it is closed and another used.
const KEPT_READY: Duration = Duration::from_millis(100);

/// An engine call that got no answer. Its text names the causes (hyper's own is only, say,
/// "connection error"), so they are not also given as its source: a logger walking the chain
/// would print them twice.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// No connection could be made (the lookup, the TCP connect or the TLS handshake failed, or
    /// the new connection closed before the request was written): the engine cannot have seen
    /// the request.
    #[error("connect to {to}: {}", causes(&**.cause))]
    Connect { to: EngineUrl, cause: BoxError },
    /// The exchange failed once the request was on its way: the engine may have seen it.
    #[error("{}", causes(.cause))]
    Exchange { cause: hyper::Error },
}

/// `e` and each of its sources, `: `-separated.
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let part = s.to_string();
        if !text.ends_with(&part) {
            text = format!("{text}: {part}");
        }
        next = s.source();
    }
    text
}

impl SendError {
    /// No connection could be made: the request never reached the engine.
    pub fn is_connect(&self) -> bool {
        matches!(self, Self::Connect { .. })
    }
}

/// Kept-alive connections by engine. Cheap to clone; a clone shares the connections.
#[derive(Clone)]
pub(super) struct Pool(Arc<Inner>);

struct Inner {
    connector: Connector,
    /// A connection idle this long is not used again.
    idle_for: Duration,
    /// Newest last. Hashed by the URL's base string (`EngineUrl`'s `Hash`) with `FxHash`: the key
    /// is the gateway's own configuration, not a client's input.
    idle: Mutex<HashMap<EngineUrl, Vec<Idle>, FxBuildHasher>>,
}

/// A connection and what is checked before it is used again.
struct Conn {
    tx: SendRequest<Full<Bytes>>,
    /// The engine's address when it is named (its name is checked against it); `None` for an IP
    /// literal.
    remote: Option<IpAddr>,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("idle_for", &self.0.idle_for).finish_non_exhaustive()
    }
}

impl Pool {
    pub(super) fn new(connector: Connector, idle_for: Duration) -> Self {
        Self(Arc::new(Inner { connector, idle_for, idle: Mutex::new(HashMap::default()) }))
    }

    /// Sends `req` to `to` on a kept-alive connection, or a new one. `req`'s URI may be absolute
    /// (only its path and query are sent) and gets `to`'s `Host` when it has none. `name`: `to`'s
    /// host when it is a name.
    pub(super) async fn send(
        &self,
        to: &EngineUrl,
        name: Option<&str>,
        names: &Names,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<EngineBody>, SendError> {
        origin_form(req.uri_mut());
        if !req.headers().contains_key(hyper::header::HOST)
            && let Some(host) = to.host_value()
        {
            req.headers_mut().insert(hyper::header::HOST, host);
        }
        loop {
            let (mut conn, kept) = match self.take(to, name, names) {
                Some(c) => (c, true),
                // Boxed: a new connection is the rare case, and its future is large (the
                // TLS handshake's, hyper's); unboxed it would make every call's future, and the
                // futures that hold one, that much larger to move and to box.
                None => (Box::pin(self.connect(to)).await?, false),
            };
            if !conn.tx.is_ready() {
                if kept {
                    // Not free in time: dropped (closed), and another taken.
                    match tokio::time::timeout(KEPT_READY, conn.tx.ready()).await {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) | Err(_) => continue,
                    }
                } else if let Err(cause) = conn.tx.ready().await {
                    return Err(SendError::Connect { to: to.clone(), cause: cause.into() });
                }
            }
            match conn.tx.try_send_request(req).await {
                Ok(resp) => {
                    let back = Back { pool: Arc::clone(&self.0), to: to.clone(), conn };
                    return Ok(resp.map(|inner| EngineBody { inner, back: Some(back) }));
                }
                Err(mut e) => match e.take_message() {
                    // Closed before it was written: another connection may carry it.
                    Some(unsent) if kept => req = unsent,
                    Some(_) => {
                        return Err(SendError::Connect { to: to.clone(), cause: e.into_error().into() });
                    }
                    None => return Err(SendError::Exchange { cause: e.into_error() }),
                },
            }
        }
    }

    /// The newest idle connection to `to` that may still be used; older ones that may not are
    /// dropped.
    fn take(&self, to: &EngineUrl, name: Option<&str>, names: &Names) -> Option<Conn> {
        let mut idle = self.0.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let list = idle.get_mut(to)?;
        while let Some(Idle { conn, since }) = list.pop() {
            if since.elapsed() > self.0.idle_for {
                // The rest are older still.
                list.clear();
                return None;
            }
            if conn.tx.is_closed() {
                continue;
            }
            if let (Some(name), Some(ip)) = (name, conn.remote)
                && !names.current(name, ip)
            {
                continue;
            }
            return Some(conn);
        }
        None
    }

    async fn connect(&self, to: &EngineUrl) -> Result<Conn, SendError> {
        let failed = |cause: BoxError| SendError::Connect { to: to.clone(), cause };
        let mut connector = self.0.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx)).await.map_err(failed)?;
        let uri = to.call_uri("/").map_err(|e| failed(e.into()))?;
        let io = connector.call(uri).await.map_err(failed)?;
        let remote = match &io {
            MaybeHttpsStream::Http(tcp) => tcp.inner().remote,
            MaybeHttpsStream::Https(tls) => tls.inner().get_ref().0.inner().inner().remote,
        };
        let (tx, connection) =
            hyper::client::conn::http1::handshake(io).await.map_err(|e| failed(e.into()))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "engine connection ended");
            }
        });
        Ok(Conn { tx, remote })
    }
}

/// What gives a connection back to its pool.
struct Back {
    pool: Arc<Inner>,
    to: EngineUrl,
    conn: Conn,
}

impl Back {
    fn give(self) {
        let Self { pool, to, conn } = self;
        let now = Instant::now();
        let mut idle = pool.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let list = match idle.get_mut(&to) {
            Some(l) => l,
            None => idle.entry(to).or_default(),
        };
        // The oldest first: a connection to an engine that never closes its own does not stay
        // open past `idle_for` once another call to that engine ends.
        let expired = list.iter().take_while(|i| now.duration_since(i.since) > pool.idle_for).count();
        list.drain(..expired);
        list.push(Idle { conn, since: now });
    }
}

/// An engine's answer. Its connection goes back to the pool when the last byte has been read
/// (seen by the body's end, or by its having ended when dropped); an answer dropped before its end
/// closes its connection.
pub struct EngineBody {
    inner: Incoming,
    back: Option<Back>,
}

impl std::fmt::Debug for EngineBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBody").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl EngineBody {
    fn give_back(&mut self) {
        if let Some(b) = self.back.take() {
            b.give();
        }
    }
}

impl Body for EngineBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let next = Pin::new(&mut self.inner).poll_frame(cx);
        match &next {
            Poll::Ready(None) => self.give_back(),
            // An answer of known length has ended at its last byte, a chunked one at its trailers.
            Poll::Ready(Some(Ok(f))) if f.is_trailers() || self.inner.is_end_stream() => self.give_back(),
            Poll::Ready(Some(Err(_))) => self.back = None,
            _ => {}
        }
        next
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for EngineBody {
    fn drop(&mut self) {
        if self.inner.is_end_stream() {
            self.give_back();
        }
    }
}

/// `uri`'s path and query alone, as a request on a connection to its host is sent (what
/// hyper-util's client did to each request).
fn origin_form(uri: &mut hyper::Uri) {
    if uri.scheme().is_none() && uri.authority().is_none() {
        return;
    }
    *uri = match uri.path_and_query() {
        Some(p) if p.as_str() != "/" => {
            let mut parts = hyper::http::uri::Parts::default();
            parts.path_and_query = Some(p.clone());
            hyper::Uri::from_parts(parts).unwrap_or_default()
        }
        _ => hyper::Uri::default(),
    };
}

#[cfg(test)]
impl Pool {
    /// How many connections to `to` are idle.
    pub(super) fn idle_count(&self, to: &EngineUrl) -> usize {
        self.0.idle.lock().unwrap_or_else(PoisonError::into_inner).get(to).map_or(0, Vec::len)
    }

    /// Puts `tx` in the pool as an idle connection to `to`.
    pub(super) fn keep(&self, to: &EngineUrl, tx: SendRequest<Full<Bytes>>) {
        Back { pool: Arc::clone(&self.0), to: to.clone(), conn: Conn { tx, remote: None } }.give();
    }
}
