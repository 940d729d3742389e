//! The HTTP front door (HTTP/1.1 and HTTP/2, plain or over TLS): routes, limits, and the one place
//! errors become responses.

pub mod tls;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::api::{Endpoint, GatewayError, GenRequest, MAX_BODY_BYTES};
use crate::handoff::decoder::DecoderHandle;
use crate::handoff::{BoxError, Native, Prefiller, RespBody};
use crate::tokenize::token_ids;

/// How long a client may take to send its request headers (hyper enforces it only with a timer).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The model this gateway serves.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub name: String,
    pub context_length: u64,
}

/// The gateway: one model, its prefill and decode pools, the handoff.
#[derive(Debug)]
pub struct Gateway {
    pub model: ModelInfo,
    pub prefills: Vec<Prefiller>,
    pub decoders: Vec<Arc<DecoderHandle>>,
    pub native: Native,
    next_prefill: AtomicUsize,
}

fn full(status: u16, v: &Value) -> Response<RespBody> {
    let mut r =
        Response::new(Full::new(Bytes::from(v.to_string())).map_err(|e| -> BoxError { match e {} }).boxed());
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    r
}

/// The one mapping from errors to responses.
pub fn error_response(e: &GatewayError) -> Response<RespBody> {
    let mut r = full(e.status(), &e.body());
    if let Some(secs) = e.retry_after()
        && let Ok(v) = header::HeaderValue::from_str(&secs.to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

impl Gateway {
    pub fn new(
        model: ModelInfo,
        prefills: Vec<Prefiller>,
        decoders: Vec<Arc<DecoderHandle>>,
        native: Native,
    ) -> Arc<Self> {
        Arc::new(Self { model, prefills, decoders, native, next_prefill: AtomicUsize::new(0) })
    }

    /// Round robin over prefillers.
    fn pick_prefill(&self) -> Option<&Prefiller> {
        let n = self.prefills.len();
        (n > 0)
            .then(|| self.next_prefill.fetch_add(1, Ordering::Relaxed) % n)
            .and_then(|i| self.prefills.get(i))
    }

    /// KV-buffer aware: the decoder with the fewest slots waiting, then the most slots free. Reads
    /// each queue once, in constant time.
    fn pick_decoder(&self, need: u32) -> Option<&Arc<DecoderHandle>> {
        let loads: Vec<_> = self.decoders.iter().map(|d| (d, d.queue.load())).collect();
        loads
            .iter()
            .filter(|(_, l)| l.capacity >= need)
            .min_by_key(|(_, l)| (l.waiting_slots, u64::from(l.in_use)))
            .or_else(|| loads.iter().max_by_key(|(_, l)| l.capacity))
            .map(|(d, _)| *d)
    }

    /// Serves until `stop` is notified; over TLS when `tls` is given (plain HTTP only where the
    /// caller chose it).
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Option<tls::FrontTls>,
        stop: Arc<Notify>,
    ) {
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                _ = stop.notified() => break,
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
                            None => this.connection(TokioIo::new(stream)).await,
                            Some(t) => {
                                // A client that cannot finish the handshake in time (or is refused:
                                // old protocol, no certificate) is simply dropped.
                                if let Ok(Ok(s)) = tokio::time::timeout(DEFAULT_HEADER_READ_TIMEOUT, t.acceptor().accept(stream)).await {
                                    this.connection(TokioIo::new(s)).await;
                                }
                            }
                        }
                    });
                }
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        conns.shutdown().await;
    }

    async fn connection<I>(self: Arc<Self>, io: I)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let svc = service_fn(move |req| {
            let this = Arc::clone(&self);
            async move { Ok::<_, Infallible>(this.handle(req).await) }
        });
        let mut b = auto::Builder::new(TokioExecutor::new());
        b.http1().timer(TokioTimer::new()).header_read_timeout(DEFAULT_HEADER_READ_TIMEOUT);
        let _ = b.serve_connection(io, svc).await;
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<RespBody> {
        let (method, path) = (req.method().clone(), req.uri().path().to_owned());
        let ep = match (&method, path.as_str()) {
            (&Method::POST, "/v1/completions") => Endpoint::Completions,
            (&Method::POST, "/v1/chat/completions") => Endpoint::Chat,
            (&Method::GET, "/v1/models") => {
                return full(
                    200,
                    &json!({"object": "list", "data": [{"id": self.model.name, "object": "model", "owned_by": "baton"}]}),
                );
            }
            (&Method::GET, "/health") => return full(200, &json!({"status": "ok"})),
            (&Method::GET, "/ready") => {
                let ready =
                    !self.prefills.is_empty() && self.decoders.iter().any(|d| d.queue.stats().capacity > 0);
                return full(if ready { 200 } else { 503 }, &json!({"ready": ready}));
            }
            (&Method::GET, "/admin/decoders") => return full(200, &self.decoders_view().await),
            (&Method::GET, "/metrics") => return self.metrics(),
            _ => return error_response(&GatewayError::NotFound(format!("{method} {path}"))),
        };
        let started = std::time::Instant::now();
        let r = match self.generate(ep, req).await {
            Ok(r) => r,
            Err(e) => error_response(&e),
        };
        // `total` is the time to the response headers (for a stream, to the first byte).
        self.native.metrics.phase("total", started.elapsed());
        self.native.metrics.answered(r.status().as_u16());
        r
    }

    fn metrics(&self) -> Response<RespBody> {
        let gauges: Vec<crate::telemetry::DecoderGauges> = self
            .decoders
            .iter()
            .map(|d| {
                let s = d.queue.stats();
                crate::telemetry::DecoderGauges {
                    name: d.name.clone(),
                    capacity: s.capacity,
                    reserved: s.in_use,
                    waiting: s.waiting,
                    waiting_slots: s.waiting_slots,
                    oldest_wait: s.oldest_wait,
                }
            })
            .collect();
        let mut r = Response::new(
            Full::new(Bytes::from(self.native.metrics.render(&gauges)))
                .map_err(|e| -> BoxError { match e {} })
                .boxed(),
        );
        r.headers_mut()
            .insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; version=0.0.4"));
        r
    }

    async fn generate(
        &self,
        ep: Endpoint,
        req: Request<Incoming>,
    ) -> Result<Response<RespBody>, GatewayError> {
        if let Some(ct) = req.headers().get(header::CONTENT_TYPE)
            && !ct.to_str().is_ok_and(|v| v.starts_with("application/json"))
        {
            return Err(GatewayError::ContentType);
        }
        let body = Limited::new(req.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|_| GatewayError::BodyTooLarge { limit: MAX_BODY_BYTES })?
            .to_bytes();
        let req = GenRequest::parse(ep, &body)?;
        if let Some(m) = req.model()
            && m != self.model.name
        {
            return Err(GatewayError::UnknownModel(m.chars().take(64).collect()));
        }
        let ids = token_ids(&req);
        if ids.len() as u64 > self.model.context_length {
            return Err(GatewayError::ContextLength {
                tokens: ids.len() as u64,
                limit: self.model.context_length,
            });
        }
        let prefill = self.pick_prefill().ok_or(GatewayError::NoEndpoint("prefill"))?;
        let need = self.decoders.first().map_or(0, |d| {
            u32::try_from(ids.len().div_ceil(d.chunk_tokens.max(1) as usize)).unwrap_or(u32::MAX)
        });
        let dec = self.pick_decoder(need).ok_or(GatewayError::NoEndpoint("decode"))?;
        self.native.run(prefill, dec, &req, &ids, 0).await
    }

    /// `/admin/decoders`: per decoder, the admission queue and what the data plane reports.
    pub async fn decoders_view(&self) -> Value {
        let mut out = Vec::new();
        for d in &self.decoders {
            let s = d.queue.stats();
            let ranks: Vec<Value> = d
                .ranks_view()
                .await
                .into_iter()
                .map(|r| json!({"rank": r.rank, "pages_total": r.pages_total, "pages_free": r.pages_free}))
                .collect();
            out.push(json!({
                "name": d.name, "http": d.http.to_string(), "capacity_slots": s.capacity, "reserved_slots": s.in_use,
                "waiting_requests": s.waiting, "waiting_slots": s.waiting_slots,
                "oldest_wait_ms": s.oldest_wait.map(|w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX)), "ranks": ranks,
            }));
        }
        json!({"decoders": out})
    }
}

/// Binds the listener (plain HTTP).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
