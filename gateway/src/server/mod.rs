//! The HTTP front door (HTTP/1.1 and HTTP/2, plain or over TLS): routes, limits, and the one place
//! errors become responses.

pub mod admin;
pub mod idle;
pub mod tls;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::api::{Endpoint, GatewayError, Origin};
use crate::auth::{bearer, digest};
use crate::handoff::{BoxError, RespBody};
use crate::pipeline::Gateway;
use crate::telemetry::request_id::{self, RequestId};

pub use crate::pipeline::{
    DEFAULT_BODY_READ_TIMEOUT, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT, HttpTimeouts,
};

pub(crate) fn full(status: u16, v: &Value) -> Response<RespBody> {
    let mut r =
        Response::new(Full::new(Bytes::from(v.to_string())).map_err(|e| -> BoxError { match e {} }).boxed());
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    r
}

/// The one mapping from errors to responses.
pub fn error_response(e: &GatewayError) -> Response<RespBody> {
    let mut body = e.body();
    // Inside a request: the error names it, as its header does.
    if let (Some(id), Some(err)) =
        (request_id::current(), body.get_mut("error").and_then(Value::as_object_mut))
    {
        err.insert("request_id".into(), json!(id.as_str()));
    }
    let mut r = full(e.status(), &body);
    if let Some(secs) = e.retry_after()
        && let Ok(v) = header::HeaderValue::from_str(&secs.to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

/// Tells a listener to stop: it stops accepting at once, asks every connection to close once its
/// requests in flight are answered (HTTP/1.1: after the response; HTTP/2: GOAWAY), and cuts what is
/// left at the deadline. Dropping a connection drops its requests, which releases what they hold
/// exactly as for a client that leaves.
#[derive(Debug)]
pub struct Stop(tokio::sync::watch::Sender<Option<tokio::time::Instant>>);

impl Default for Stop {
    fn default() -> Self {
        Self(tokio::sync::watch::Sender::new(None))
    }
}

impl Stop {
    /// What a listener watches.
    pub fn watch(&self) -> StopSignal {
        StopSignal(self.0.subscribe())
    }

    /// Drain: requests in flight may run until `deadline`.
    pub fn drain_until(&self, deadline: tokio::time::Instant) {
        self.0.send_replace(Some(deadline));
    }

    /// Stop now: connections are cut.
    pub fn now(&self) {
        self.drain_until(tokio::time::Instant::now());
    }
}

/// A listener's side of [`Stop`].
#[derive(Clone, Debug)]
pub struct StopSignal(tokio::sync::watch::Receiver<Option<tokio::time::Instant>>);

impl StopSignal {
    /// Waits for the stop; the deadline for requests in flight.
    async fn stopped(&mut self) -> tokio::time::Instant {
        match self.0.wait_for(Option::is_some).await {
            Ok(d) => d.unwrap_or_else(tokio::time::Instant::now),
            // The sender is gone: nobody can drain any more, so stop now.
            Err(_) => tokio::time::Instant::now(),
        }
    }
}

/// How long a drain waits, once the connections are closed, for the slots of requests cut at the
/// deadline to come back (cancels sent to the data plane, drains answered).
pub const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// A gateway's listeners: the public ones and the admin one, each with its [`Stop`].
#[derive(Debug)]
pub struct Listeners {
    pub addrs: Vec<SocketAddr>,
    pub admin_addr: SocketAddr,
    public: Vec<(Stop, tokio::task::JoinHandle<()>)>,
    admin: (Stop, tokio::task::JoinHandle<()>),
}

impl Listeners {
    /// Binds and serves `public` and the admin listener; on failure, the address that failed.
    pub async fn start(
        gateway: &Arc<Gateway>,
        public: Vec<(SocketAddr, Option<tls::FrontTls>)>,
        admin: (SocketAddr, Option<tls::FrontTls>, Surface),
    ) -> Result<Self, (SocketAddr, std::io::Error)> {
        let (admin_at, admin_tls, admin_surface) = admin;
        let serve = |listener: TcpListener, tls, surface| {
            let stop = Stop::default();
            let task = tokio::spawn(Arc::clone(gateway).serve(listener, tls, surface, stop.watch()));
            (stop, task)
        };
        let mut addrs = Vec::new();
        let mut running = Vec::new();
        let mut certified = Vec::new();
        for (at, tls) in public {
            let listener = bind(at).await.map_err(|e| (at, e))?;
            let addr = listener.local_addr().map_err(|e| (at, e))?;
            addrs.push(addr);
            certified.extend(tls.clone().map(|t| (addr.to_string(), t)));
            running.push(serve(listener, tls, Surface::Public));
        }
        let listener = bind(admin_at).await.map_err(|e| (admin_at, e))?;
        let admin_addr = listener.local_addr().map_err(|e| (admin_at, e))?;
        certified.extend(admin_tls.clone().map(|t| ("admin".to_owned(), t)));
        let admin = serve(listener, admin_tls, admin_surface);
        // Certificates read again on change and on SIGHUP; counted in /metrics.
        let _ =
            gateway.tls.set(certified.iter().filter_map(|(n, t)| Some((n.clone(), t.counts()?))).collect());
        drop(tls::FrontTls::spawn_watcher(Arc::downgrade(gateway), certified));
        Ok(Self { addrs, admin_addr, public: running, admin })
    }

    /// Drains: `/ready` answers 503 at once; the public listeners stop accepting and their
    /// requests run until `timeout`, then what is left is cut (released as a client that leaves
    /// releases it); the slots that cut requests held are waited for ([`RELEASE_WAIT`] at most);
    /// the admin listener stops last.
    pub async fn drain(self, gateway: &Gateway, timeout: Duration) {
        gateway.begin_drain();
        let deadline = tokio::time::Instant::now() + timeout;
        for (stop, _) in &self.public {
            stop.drain_until(deadline);
        }
        for (_, task) in self.public {
            let _ = task.await;
        }
        let waited = tokio::time::Instant::now();
        while gateway.held_slots() > 0 && waited.elapsed() < RELEASE_WAIT {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let held = gateway.held_slots();
        if held > 0 {
            tracing::warn!(slots = held, "slots still held after the drain; their leases will free them");
        }
        // What requests left running (a prefill that outlives its client, drains, cancels, release
        // waits) ends before the process does, within the same bound.
        let left = RELEASE_WAIT.saturating_sub(waited.elapsed());
        if !gateway.shared.wait_for_tasks(left).await {
            tracing::warn!(
                tasks = gateway.shared.tasks_running(),
                "request tasks still running after the drain; the engines' own leases end what they hold"
            );
        }
        self.admin.0.now();
        let _ = self.admin.1.await;
    }

    /// Stops every listener now: connections are cut.
    pub async fn stop(self) {
        for (stop, _) in self.public.iter().chain([&self.admin]) {
            stop.now();
        }
        for (_, task) in self.public.into_iter().chain([self.admin]) {
            let _ = task.await;
        }
    }
}

/// What a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    /// The OpenAI API, `/health` and `/ready`.
    Public,
    /// `/metrics`, `/admin/*`, `/health` and `/ready`, behind the bearer token whose SHA-256 this
    /// holds, when one is set.
    Admin { token_sha256: Option<[u8; 32]> },
}

impl Surface {
    /// Whether `req` may use the admin routes: no token set, or its `Authorization: Bearer` token
    /// hashes to the one set (compared in constant time).
    fn admits(&self, req: &Request<Incoming>) -> bool {
        let Self::Admin { token_sha256 } = self else { return false };
        let Some(want) = token_sha256 else { return true };
        let Some(token) = bearer(req.headers()) else { return false };
        let got = digest(token.as_bytes());
        got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl Gateway {
    /// Serves `surface` until `stop` says so, then drains ([`Stop`]); over TLS when `tls` is given
    /// (plain HTTP only where the caller chose it).
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Option<tls::FrontTls>,
        surface: Surface,
        mut stop: StopSignal,
    ) {
        let mut conns = JoinSet::new();
        let deadline = loop {
            let conn_stop = stop.clone();
            tokio::select! {
                d = stop.stopped() => break d,
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let this = Arc::clone(&self);
                    let tls = tls.clone();
                    conns.spawn(async move {
                        match tls {
                            None => this.connection(TokioIo::new(stream), surface, conn_stop).await,
                            Some(t) => {
                                // A client that cannot finish the handshake in time (or is refused:
                                // old protocol, no certificate) is simply dropped.
                                if let Ok(Ok(s)) = tokio::time::timeout(this.http.header_read, t.acceptor().accept(stream)).await {
                                    this.connection(TokioIo::new(s), surface, conn_stop).await;
                                }
                            }
                        }
                    });
                }
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        };
        // No new connection from here on; those open finish their requests until the deadline.
        drop(listener);
        let _ = tokio::time::timeout_at(deadline, async { while conns.join_next().await.is_some() {} }).await;
        if !conns.is_empty() {
            tracing::warn!(connections = conns.len(), "drain deadline passed: cutting the connections left");
        }
        conns.shutdown().await;
    }

    async fn connection<I>(self: Arc<Self>, io: I, surface: Surface, mut stop: StopSignal)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let limits = self.http;
        let activity = idle::Activity::new();
        let io = idle::Stamped::new(io, Arc::clone(&activity));
        let act = Arc::clone(&activity);
        let svc = service_fn(move |req| {
            let this = Arc::clone(&self);
            let guard = act.request();
            async move {
                let r = this.handle(req, surface).await;
                drop(guard);
                Ok::<_, Infallible>(r)
            }
        });
        let mut b = auto::Builder::new(TokioExecutor::new());
        b.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read)
            .max_buf_size(crate::pipeline::DEFAULT_MAX_HEADER_BYTES);
        b.http2().timer(TokioTimer::new()).max_header_list_size(
            u32::try_from(crate::pipeline::DEFAULT_MAX_HEADER_BYTES).unwrap_or(u32::MAX),
        );
        let conn = b.serve_connection(io, svc);
        tokio::pin!(conn);
        let mut tick = tokio::time::interval(limits.idle / 8);
        let mut closing = false;
        // Every request on the connection is polled in this task, so this loop runs at each of its
        // wakes: the stop's future is made once, not again at each (its `watch` borrowed, a
        // waiter queued), and the branches are tried in order, with no random start.
        let stopped = stop.stopped();
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                biased;
                _ = conn.as_mut() => return,
                _ = &mut stopped, if !closing => {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
                _ = tick.tick(), if !closing => {
                    if activity.idle_for(limits.idle) {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
        }
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>, surface: Surface) -> Response<RespBody> {
        let (method, path) = (req.method().clone(), req.uri().path().to_owned());
        match (&method, path.as_str()) {
            (&Method::GET, "/health") => return full(200, &json!({"status": "ok"})),
            (&Method::GET, "/ready") => {
                let ready = self.ready();
                return full(if ready { 200 } else { 503 }, &json!({"ready": ready}));
            }
            _ if surface == Surface::Public => {}
            _ if !surface.admits(&req) => {
                let mut r =
                    error_response(&GatewayError::Unauthorized("a valid admin bearer token is required"));
                r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
                return r;
            }
            (&Method::GET, "/admin/decoders") => return full(200, &admin::decoders(&self).await),
            (&Method::GET, "/admin/engines") => return full(200, &admin::engines(&self)),
            (&Method::GET, "/admin/names") => return full(200, &admin::names(&self)),
            (&Method::GET, "/admin/flow") => return admin::flow(&self),
            (&Method::GET, "/admin/cluster") => return admin::cluster(&self),
            (&Method::GET, "/admin/cache") => {
                return match &self.router.prefix {
                    Some(f) => full(200, &f.view()),
                    None => full(
                        404,
                        &serde_json::json!({"error": {"message": "no block index: routing.policy is not cache-aware and no engine has kv_events", "type": "invalid_request_error", "param": null, "code": "not_found"}}),
                    ),
                };
            }
            (&Method::GET, "/admin/requests") => return admin::requests(&self, req.uri().query()),
            (&Method::GET, p) if p.starts_with("/admin/requests/") => {
                return admin::request(&self, p.trim_start_matches("/admin/requests/"));
            }
            (&Method::GET, "/admin/plugins") => {
                return full(200, &self.plugins.as_ref().map_or(json!({"plugins": []}), |p| p.view()));
            }
            (&Method::POST, "/admin/plugins/reload") => return admin::reload_plugins(&self).await,
            (&Method::POST, "/admin/keys/reload") => return admin::reload_keys(&self),
            (&Method::GET, "/metrics") => return admin::metrics(&self),
            _ => return error_response(&GatewayError::NotFound(format!("{method} {path}"))),
        }
        let ep = match (&method, path.as_str()) {
            (&Method::POST, "/v1/completions") => Endpoint::Completions,
            (&Method::POST, "/v1/chat/completions") => Endpoint::Chat,
            (&Method::GET, "/v1/models") => {
                // Under the same keys as generation unless `[auth] models_open`.
                if let (Some(keys), false) = (&self.keys, self.models_open)
                    && let Err(e) = keys.tenant_of(req.headers())
                {
                    return error_response(&e);
                }
                return full(
                    200,
                    &json!({"object": "list", "data": [{"id": self.model.name, "object": "model", "owned_by": "baton"}]}),
                );
            }
            _ => return error_response(&GatewayError::NotFound(format!("{method} {path}"))),
        };
        let started = std::time::Instant::now();
        let id = RequestId::from_header(req.headers().get(request_id::HEADER));
        let header_value = id.header().clone();
        let mut r = request_id::scope(id, async {
            // Boxed: the request's pipeline is a future of 5.6 KB (with `dispatch` boxed inside
            // it), and each wrapper above it (this block, the id's scope, hyper's box of
            // the service's future) would hold and copy it whole: `handle`'s was 16 KB, 1.4 boxed.
            match Box::pin(self.generate(ep, req)).await {
                Ok(r) => {
                    tracing::debug!(path, status = r.status().as_u16(), "answered");
                    r
                }
                Err(e) => {
                    if e.origin() == Origin::Client {
                        tracing::debug!(path, status = e.status(), code = e.code(), error = %e, "request refused");
                    } else {
                        tracing::warn!(path, status = e.status(), code = e.code(), error = %e, "request failed");
                    }
                    error_response(&e)
                }
            }
        })
        .await;
        r.headers_mut().insert(request_id::HEADER_NAME, header_value);
        self.answered(started, r.status().as_u16());
        r
    }
}

/// Binds the listener (plain HTTP).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
