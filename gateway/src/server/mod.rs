//! The HTTP front door (HTTP/1.1 and HTTP/2, plain or over TLS): routes, limits, and the one place
//! errors become responses.

pub mod idle;
pub mod tls;
pub mod usage;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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

use crate::admission::Ticket;
use crate::api::{Endpoint, GatewayError, GenRequest, MAX_BODY_BYTES, Origin};
use crate::handoff::decoder::{DecodeMode, DecoderHandle};
use crate::handoff::{BoxError, Native, Prefiller, RespBody};
use crate::policy::{Admit, Plugins, QueueState};
use crate::routing::{Candidates, DecodeView, NoRoute, PrefillView, RouteFacts, Router};
use crate::tokenize::{INLINE_TOKENIZE_BYTES, Tokenizer};
use usage::{Completion, UsageBody};

/// How long a client may take to send its request headers (hyper enforces it only with a timer).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send its request body once the headers are in (then 408).
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// A connection with no request in flight and no traffic for this long is closed.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// Response header naming the prefill and decode endpoints a request was routed to (the prefiller
/// first in line: a fallback may have served the prefill).
pub const ROUTE_HEADER: &str = "x-baton-route";

/// The front door's time limits.
#[derive(Clone, Copy, Debug)]
pub struct HttpTimeouts {
    pub header_read: Duration,
    pub body_read: Duration,
    pub idle: Duration,
}

impl Default for HttpTimeouts {
    fn default() -> Self {
        Self {
            header_read: DEFAULT_HEADER_READ_TIMEOUT,
            body_read: DEFAULT_BODY_READ_TIMEOUT,
            idle: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// The model this gateway serves.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub name: String,
    pub context_length: u64,
    pub tokenizer: Arc<Tokenizer>,
}

/// The gateway: one model, its prefill and decode pools, the handoff.
#[derive(Debug)]
pub struct Gateway {
    pub model: ModelInfo,
    pub prefills: Vec<Prefiller>,
    pub decoders: Vec<Arc<DecoderHandle>>,
    pub native: Native,
    pub router: Router,
    pub http: HttpTimeouts,
    /// Admission and routing plugins, when configured.
    pub plugins: Option<Arc<Plugins>>,
    seq: AtomicU64,
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
        router: Router,
        http: HttpTimeouts,
        plugins: Option<Arc<Plugins>>,
    ) -> Arc<Self> {
        Arc::new(Self { model, prefills, decoders, native, router, http, plugins, seq: AtomicU64::new(0) })
    }

    /// Every endpoint's state, one list per metric, for the routing policy.
    pub fn candidates(&self, tokens: usize) -> Candidates {
        let mut c = Candidates {
            prefill: PrefillView {
                healthy: self.prefills.iter().map(|p| p.health.healthy()).collect(),
                in_flight: self.prefills.iter().map(|p| p.health.in_flight()).collect(),
                latency_us: self.prefills.iter().map(|p| p.health.latency_us()).collect(),
            },
            decode: DecodeView::default(),
        };
        for d in &self.decoders {
            let l = d.queue.load();
            c.decode.healthy.push(d.health.healthy());
            c.decode.slots_needed.push(d.slots_for(tokens));
            c.decode.capacity_slots.push(l.capacity);
            c.decode.free_slots.push(l.capacity.saturating_sub(l.in_use));
            c.decode.waiting_slots.push(l.waiting_slots);
            c.decode.in_flight.push(l.holders);
        }
        c
    }

    /// Checks every endpoint's `GET /health` each `check_interval` until the gateway is dropped.
    pub fn start_health_checks(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let cfg = self.native.health;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(cfg.check_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(this) = weak.upgrade() else { return };
                // All engines at once: one that hangs until the timeout delays no other check.
                let n = this.prefills.len() + this.decoders.len();
                let mut checks = JoinSet::new();
                for i in 0..n {
                    let this = Arc::clone(&this);
                    checks.spawn(async move {
                        let (addr, health) = match this.prefills.get(i) {
                            Some(p) => (p.http, &*p.health),
                            None => match this.decoders.get(i - this.prefills.len()) {
                                Some(d) => (d.http, &d.health),
                                None => return,
                            },
                        };
                        let ok = this.native.health_check(addr, cfg.check_timeout).await;
                        if health.healthy() != ok {
                            tracing::warn!(endpoint = %addr, healthy = ok, "health check changed");
                        }
                        health.checked(ok);
                    });
                }
                while checks.join_next().await.is_some() {}
            }
        })
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
                                if let Ok(Ok(s)) = tokio::time::timeout(this.http.header_read, t.acceptor().accept(stream)).await {
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
        let limits = self.http;
        let activity = idle::Activity::new();
        let io = idle::Stamped::new(io, Arc::clone(&activity));
        let act = Arc::clone(&activity);
        let svc = service_fn(move |req| {
            let this = Arc::clone(&self);
            let guard = act.request();
            async move {
                let r = this.handle(req).await;
                drop(guard);
                Ok::<_, Infallible>(r)
            }
        });
        let mut b = auto::Builder::new(TokioExecutor::new());
        b.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read);
        b.http2().timer(TokioTimer::new());
        let conn = b.serve_connection(io, svc);
        tokio::pin!(conn);
        let mut tick = tokio::time::interval(limits.idle / 8);
        let mut closing = false;
        loop {
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = tick.tick(), if !closing => {
                    if activity.idle_for(limits.idle) {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
        }
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
            (&Method::GET, "/admin/plugins") => {
                return full(200, &self.plugins.as_ref().map_or(json!({"plugins": []}), |p| p.view()));
            }
            (&Method::POST, "/admin/plugins/reload") => return self.reload_plugins().await,
            (&Method::GET, "/metrics") => return self.metrics(),
            _ => return error_response(&GatewayError::NotFound(format!("{method} {path}"))),
        };
        let started = std::time::Instant::now();
        let r = match self.generate(ep, req).await {
            Ok(r) => r,
            Err(e) => {
                if e.origin() == Origin::Client {
                    tracing::debug!(path, status = e.status(), code = e.code(), error = %e, "request refused");
                } else {
                    tracing::warn!(path, status = e.status(), code = e.code(), error = %e, "request failed");
                }
                error_response(&e)
            }
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
        let mut text = self.native.metrics.render(&gauges);
        let endpoints: Vec<crate::telemetry::EndpointHealth> = self
            .prefills
            .iter()
            .map(|p| ("prefill", &p.name, &*p.health))
            .chain(self.decoders.iter().map(|d| ("decode", &d.name, &d.health)))
            .map(|(pool, name, h)| crate::telemetry::EndpointHealth {
                pool,
                name: name.clone(),
                healthy: h.healthy(),
                in_flight: h.in_flight(),
                ejections: h.ejected_total.load(Ordering::Relaxed),
            })
            .collect();
        crate::telemetry::render_endpoints(&mut text, &endpoints);
        self.render_handoffs(&mut text);
        if let Some(p) = &self.plugins {
            p.render(&mut text);
        }
        let mut r =
            Response::new(Full::new(Bytes::from(text)).map_err(|e| -> BoxError { match e {} }).boxed());
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
        let (parts, body) = req.into_parts();
        let headers = parts.headers;
        let body = tokio::time::timeout(self.http.body_read, Limited::new(body, MAX_BODY_BYTES).collect())
            .await
            .map_err(|_| GatewayError::BodyTimeout { limit: self.http.body_read })?
            .map_err(|_| GatewayError::BodyTooLarge { limit: MAX_BODY_BYTES })?
            .to_bytes();
        let req = GenRequest::parse(ep, &body)?;
        if let Some(m) = req.model()
            && m != self.model.name
        {
            return Err(GatewayError::UnknownModel(m.chars().take(64).collect()));
        }
        if Tokenizer::work(&req) <= INLINE_TOKENIZE_BYTES {
            let ids = self.model.tokenizer.token_ids(&req)?;
            return self.dispatch(req, ids, &headers).await;
        }
        let tok = Arc::clone(&self.model.tokenizer);
        let (req, ids) = tokio::task::spawn_blocking(move || {
            let ids = tok.token_ids(&req);
            (req, ids)
        })
        .await
        .map_err(|e| GatewayError::Internal(format!("tokenizer task: {e}")))?;
        self.dispatch(req, ids?, &headers).await
    }

    async fn dispatch(
        &self,
        req: GenRequest,
        ids: Vec<u32>,
        headers: &hyper::HeaderMap,
    ) -> Result<Response<RespBody>, GatewayError> {
        if ids.len() as u64 > self.model.context_length {
            return Err(GatewayError::ContextLength {
                tokens: ids.len() as u64,
                limit: self.model.context_length,
            });
        }
        // The first decoder's count; each decoder's own is in the candidates.
        let need = self.decoders.first().map_or(0, |d| d.slots_for(ids.len()));
        let max_tokens = req.fields.max_tokens.or(req.fields.max_completion_tokens);
        let facts = RouteFacts {
            model: &self.model.name,
            prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            slots: need,
            max_tokens,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
        };
        let plugins = self.plugins.as_ref();
        let preq = plugins.map(|p| {
            let ep = match req.endpoint {
                Endpoint::Completions => "completions",
                Endpoint::Chat => "chat",
            };
            Arc::new(p.request(&self.model.name, ep, headers, &ids, need, max_tokens))
        });
        // Admission: the plugin's decision, or the built-in one (class 0, the gateway's wait).
        let mut ticket = Ticket::default();
        let mut owed = None;
        if let (Some(p), Some(preq)) = (plugins.and_then(|p| p.admission.as_ref()), &preq) {
            match p.admit(Arc::clone(preq), self.queue_state()).await {
                Some(Admit::Reject { status, message, retry_after_s }) => {
                    return Err(GatewayError::PolicyRejected { status, message, retry_after: retry_after_s });
                }
                Some(Admit::Queue { class, max_wait }) => {
                    ticket = Ticket { class, max_wait };
                    owed = Some(Completion::new(Arc::clone(p), Arc::clone(preq)));
                }
                None => {}
            }
        }
        let cands = self.candidates(ids.len());
        let routed = match (plugins.and_then(|p| p.routing.as_ref()), &preq) {
            (Some(p), Some(preq)) => {
                let decision = p.route(Arc::clone(preq), &cands).await;
                self.router.route_decided(decision, &facts, &cands, |why| p.invalid(why))
            }
            _ => self.router.route(&facts, &cands),
        };
        let routes = routed.map_err(|e| match e {
            NoRoute::Prefill => GatewayError::NoEndpoint("prefill"),
            NoRoute::Decode => GatewayError::NoEndpoint("decode"),
        })?;
        let route = routes.first().ok_or(GatewayError::NoEndpoint("decode"))?;
        // The chosen prefiller, then the policy's fallbacks, then every other healthy one: tried in
        // turn only while a prefiller cannot be connected to.
        let mut order: Vec<usize> = Vec::with_capacity(self.prefills.len());
        let healthy =
            (0..self.prefills.len()).filter(|&i| self.prefills.get(i).is_some_and(|p| p.health.healthy()));
        for i in routes.iter().map(|r| r.prefill).chain(healthy) {
            if !order.contains(&i) {
                order.push(i);
            }
        }
        let prefills: Vec<&Prefiller> = order.iter().filter_map(|&i| self.prefills.get(i)).collect();
        let dec = self.decoders.get(route.decode).ok_or(GatewayError::NoEndpoint("decode"))?;
        let mut r = match &dec.mode {
            DecodeMode::Native => self.native.run(&prefills, dec, &req, &ids, ticket).await,
            DecodeMode::Lmcache(t) => self.native.run_lmcache(&prefills, dec, t, &req, &ids, ticket).await,
            DecodeMode::VllmNixl(_) => self.native.run_nixl(&prefills, dec, &req, ticket).await,
        };
        if let (Ok(resp), Some(p)) = (&mut r, prefills.first())
            && let Ok(v) = header::HeaderValue::from_str(&format!("prefill={}, decode={}", p.name, dec.name))
        {
            resp.headers_mut().insert(ROUTE_HEADER, v);
        }
        match (r, owed) {
            (Ok(resp), Some(mut c)) => {
                c.status = resp.status().as_u16();
                Ok(resp.map(|b| UsageBody { inner: b, completion: c }.boxed()))
            }
            (Err(e), Some(mut c)) => {
                c.status = e.status();
                Err(e)
            }
            (r, None) => r,
        }
    }

    /// Every decoder's admission queue, summed, for the admission plugin.
    fn queue_state(&self) -> QueueState {
        let mut q = QueueState { capacity_slots: 0, free_slots: 0, waiting_requests: 0, waiting_slots: 0 };
        for d in &self.decoders {
            let l = d.queue.load();
            q.capacity_slots = q.capacity_slots.saturating_add(l.capacity);
            q.free_slots = q.free_slots.saturating_add(l.capacity.saturating_sub(l.in_use));
            q.waiting_slots =
                q.waiting_slots.saturating_add(u32::try_from(l.waiting_slots).unwrap_or(u32::MAX));
        }
        q.waiting_requests = self.decoders.iter().map(|d| d.queue.waiting()).fold(0u32, u32::saturating_add);
        q
    }

    /// `POST /admin/plugins/reload`: every plugin from its file; 200 when all loaded, else 422 with
    /// each error (the plugins that failed keep their old version).
    async fn reload_plugins(&self) -> Response<RespBody> {
        let Some(p) = self.plugins.clone() else {
            return full(
                404,
                &json!({"error": {"message": "no plugins configured", "type": "invalid_request_error", "param": null, "code": "not_found"}}),
            );
        };
        let results = match tokio::task::spawn_blocking(move || p.reload()).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return full(422, &json!({"reloaded": false, "error": e})),
            Err(e) => return error_response(&GatewayError::Internal(format!("reload task: {e}"))),
        };
        let ok = results.iter().all(Result::is_ok);
        let list: Vec<Value> = results
            .into_iter()
            .map(|r| match r {
                Ok(i) => json!({"name": i.name, "world": i.world, "sha256": i.sha256, "version": i.version}),
                Err(e) => json!({"error": e.to_string()}),
            })
            .collect();
        full(if ok { 200 } else { 422 }, &json!({"reloaded": ok, "plugins": list}))
    }

    /// The `lmcache` and `vllm-nixl` handoffs' own counters and gauges.
    fn render_handoffs(&self, o: &mut String) {
        use crate::telemetry::family;
        let n = &self.native;
        if let Some(hub) = &n.lmcache {
            let st = &hub.stats;
            let outcomes = [
                ("counted", &st.counted),
                ("duplicate", &st.duplicate),
                ("unmatched", &st.unmatched),
                ("malformed", &st.malformed),
            ];
            family(
                o,
                "baton_lmcache_notifications_total",
                "counter",
                "LMCache ProxyNotif messages received, by what became of them.",
                outcomes.map(|(k, c)| (format!("outcome=\"{k}\""), c.load(Ordering::Relaxed))),
            );
            family(
                o,
                "baton_lmcache_waiting_requests",
                "gauge",
                "Requests waiting for their prefill ranks' notifications.",
                [(String::new(), hub.waiting())],
            );
        }
        let drains = [("lmcache", &n.lmcache_drains), ("vllm-nixl", &n.nixl_drains)].into_iter().flat_map(
            |(mode, d)| {
                [("sent", &d.sent), ("already_free", &d.already_free), ("failed", &d.failed)]
                    .map(|(r, c)| (format!("mode=\"{mode}\",result=\"{r}\""), c.load(Ordering::Relaxed)))
            },
        );
        family(
            o,
            "baton_drains_total",
            "counter",
            "One-token decodes sent for requests that ended between prefill and decode, by result.",
            drains,
        );
        let nixl: Vec<_> =
            self.decoders.iter().filter_map(|d| d.nixl_load.as_ref().map(|l| (&d.name, l))).collect();
        if nixl.is_empty() {
            return;
        }
        type Family<'a> = (&'a str, &'a str, &'a str, &'a dyn Fn(&crate::handoff::nixl::NixlLoad) -> f64);
        let families: [Family<'_>; 4] = [
            (
                "baton_nixl_decoder_kv_usage",
                "gauge",
                "KV cache usage a vllm-nixl decoder reported last (0..1).",
                &|l| f64::from(l.kv_usage_bp.load(Ordering::Relaxed)) / 10_000.0,
            ),
            (
                "baton_nixl_decoder_waiting",
                "gauge",
                "Requests a vllm-nixl decoder reported waiting last.",
                &|l| l.waiting.load(Ordering::Relaxed) as f64,
            ),
            (
                "baton_nixl_decoder_admitting",
                "gauge",
                "1 while a vllm-nixl decoder's metrics allow new requests.",
                &|l| f64::from(u8::from(l.open.load(Ordering::Relaxed))),
            ),
            (
                "baton_nixl_scrape_failures_total",
                "counter",
                "Failed reads of a vllm-nixl decoder's /metrics.",
                &|l| l.scrape_failures.load(Ordering::Relaxed) as f64,
            ),
        ];
        for (name, kind, help, get) in families {
            family(o, name, kind, help, nixl.iter().map(|(d, l)| (format!("decoder=\"{d}\""), get(l))));
        }
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
            let mode = match &d.mode {
                DecodeMode::Native => "native",
                DecodeMode::Lmcache(_) => "lmcache",
                DecodeMode::VllmNixl(_) => "vllm-nixl",
            };
            out.push(json!({
                "name": d.name, "handoff": mode, "http": d.http.to_string(), "capacity_slots": s.capacity, "reserved_slots": s.in_use,
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
