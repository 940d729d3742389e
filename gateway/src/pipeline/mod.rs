//! The request driver: every generation request, whatever its decoder's handoff mode, goes
//! parse → count tokens → plugin admission → route → admit on the decoder → the mode's legs →
//! respond, here and only here.
//!
//! The driver owns what the modes share: the phase timing (a [`Timing`] the mode marks its own
//! phases into, recorded in the metrics and sent back as `Server-Timing`), the mapping of every
//! failure to a [`GatewayError`], the routing headers, the admission plugin's `on-complete`, and
//! the admission slots until it hands them to the mode. A mode ([`Handoff`]) only runs its legs.
//!
//! It knows no mode by name and no connection: `server` calls it, `handoff` implements the modes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub mod batch;
pub mod usage;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response, header};
use opentelemetry::KeyValue;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use crate::admission::Ticket;
use crate::api::{self, Endpoint, GatewayError, GenRequest, MAX_BODY_BYTES, validate};
use crate::auth::ApiKeys;
use crate::flow::{Admitted, Ask, FlowControl};
use crate::handoff::decoder::Decoder;
use crate::handoff::{Leg, Prefiller, RespBody, Shared, Unstarted};
use crate::policy::{Admit, Plugins, PolicyRequest, QueueState, Sender, TenantNames};
use crate::prefix::PromptKeys;
use crate::routing::retry::Denied;
use crate::routing::{
    Candidates, Decision, DecodeView, NoRoute, PerEndpoint, PrefillView, Route, RouteFacts, Router, Work,
};
use crate::telemetry::trace::{self, End, RequestFacts, Tracing};
use crate::telemetry::{Live, Phase, Timing, request_id};
use crate::tokenize::{INLINE_TOKENIZE_BYTES, Tokenizer};
use usage::{Answer, Completion, Watched};

/// Milliseconds to the microsecond.
fn round_ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// A request the mode answered: its response (headers in, body to come) and what its end records.
struct Dispatched {
    resp: Response<RespBody>,
    mode: &'static str,
    prompt_tokens: u64,
    owed: Option<Completion>,
    /// Flow control's charge to the tenant, when it let the request go.
    charge: Option<crate::flow::Charge>,
}

/// How a request enters its decoder's queue: the admission plugin's ticket, and flow control's
/// token to drop once it holds its room (when flow control let it go); and where the mode marks
/// a failure nothing depended on yet ([`Unstarted`]).
struct Pass<'a> {
    ticket: Ticket,
    settle: Option<tokio::sync::oneshot::Sender<()>>,
    retry: &'a std::sync::OnceLock<Unstarted>,
    /// The request's retries so far ([`Leg::retried`]).
    retried: &'a Arc<AtomicU32>,
}

/// What a request's route leaves out: the engines an earlier attempt of it failed on (indexes),
/// and, with `no_room`, the decoders that cannot take it at once (flow control let it go for
/// the room it saw).
#[derive(Debug, Default)]
struct Avoid {
    no_room: bool,
    prefills: Vec<usize>,
    decoders: Vec<usize>,
}

/// What a decision record names the engines by, shared by the records (written when read).
#[derive(Debug)]
struct Roster {
    model: String,
    /// Each decoder's name and mode, in the gateway's order.
    decoders: Vec<(String, &'static str)>,
    prefills: Vec<String>,
    builtin: crate::routing::Builtin,
}

impl Roster {
    /// The route decision's record: every candidate with the numbers the policy compared, which
    /// won, and why each other decoder lost. `facts`: prompt tokens, slots, max tokens, sequence.
    fn route_record(
        &self,
        facts: (u32, u32, Option<u32>, u64),
        c: &Candidates,
        chosen: Route,
        plugin: Option<&str>,
        no_room: &[usize],
    ) -> Value {
        let (prompt_tokens, slots, max_tokens, seq) = facts;
        let f = RouteFacts { model: &self.model, prompt_tokens, slots, max_tokens, seq };
        let why = match plugin {
            Some(_) => Vec::new(),
            None => self.builtin.why_not(&f, c, chosen.decode),
        };
        let d = &c.decode;
        let decoders: Vec<Value> = self
            .decoders
            .iter()
            .enumerate()
            .map(|(i, (name, mode))| {
                let lost = match (i == chosen.decode, plugin) {
                    (true, _) => None,
                    (false, _) if no_room.contains(&i) => Some(
                        "no room now: flow control routes a request it lets go among the decoders that admit it at once"
                            .to_owned(),
                    ),
                    (false, Some(p)) => Some(format!("the routing plugin {p} chose another")),
                    (false, None) => why.get(i).cloned().flatten(),
                };
                json!({"name": name, "mode": mode, "won": i == chosen.decode, "why_not": lost,
                       "healthy": d.healthy.get(i).map(|h| *h || no_room.contains(&i)),
                       "room": !no_room.contains(&i), "slots_needed": d.slots_needed.get(i),
                       "capacity_slots": d.capacity_slots.get(i), "free_slots": d.free_slots.get(i),
                       "waiting_slots": d.waiting_slots.get(i), "in_flight": d.in_flight.get(i),
                       "cached_tokens": d.cached_tokens.get(i)})
            })
            .collect();
        let p = &c.prefill;
        let prefills: Vec<Value> = self
            .prefills
            .iter()
            .enumerate()
            .map(|(i, name)| {
                json!({"name": name, "won": i == chosen.prefill, "healthy": p.healthy.get(i),
                       "in_flight": p.in_flight.get(i), "latency_us": p.latency_us.get(i),
                       "cached_tokens": p.cached_tokens.get(i), "pending_tokens": p.pending_tokens.get(i)})
            })
            .collect();
        json!({
            "policy": plugin.map_or_else(|| self.builtin.name().to_owned(), |p| format!("plugin {p}")),
            "prefill": self.prefills.get(chosen.prefill),
            "decode": self.decoders.get(chosen.decode).map(|d| &d.0),
            "decoders": decoders,
            "prefills": prefills,
        })
    }
}

/// How long a client may take to send its request headers (hyper enforces it only with a timer).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send its request body once the headers are in (then 408).
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// A connection with no request in flight and no traffic for this long is closed.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// Largest request header block (request line and headers): real clients send a few KiB; beyond
/// this hyper answers 431 and closes the connection (HTTP/2: the header list size it advertises).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 << 10;

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

/// Response header naming the prefill and decode endpoints a request was routed to (the prefiller
/// first in line: a fallback may have served the prefill).
pub const ROUTE_HEADER: &str = "x-baton-route";
/// [`ROUTE_HEADER`] and `server-timing` as header names, made once (given as text, each was
/// parsed and copied into an allocation of its own for every answer).
const ROUTE_NAME: header::HeaderName = header::HeaderName::from_static(ROUTE_HEADER);
const SERVER_TIMING: header::HeaderName = header::HeaderName::from_static("server-timing");

/// Request header asking for the request's decision record (`1`), when `[telemetry] explain` allows
/// it: a whole answer gets it in the response header of the same name (JSON, ASCII), a stream as an
/// SSE comment line `: baton-explain {…}` before its `data: [DONE]`.
pub const EXPLAIN_HEADER: &str = "x-baton-explain";

/// The model this gateway serves.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub name: String,
    pub context_length: u64,
    pub tokenizer: Arc<Tokenizer>,
}

/// Who may send what: the policy plugins and the API keys, each when configured, and the names of
/// bearer tokens (`[admission.tenants]`).
#[derive(Debug, Default)]
pub struct Access {
    pub plugins: Option<Arc<Plugins>>,
    pub keys: Option<Arc<ApiKeys>>,
    /// `[auth] models_open`: `GET /v1/models` answers without a key.
    pub models_open: bool,
    pub tenants: TenantNames,
    /// `[telemetry] explain`: a request with `x-baton-explain: 1` gets its decision record.
    pub explain: bool,
    /// `[telemetry] otlp_endpoint`: requests are traced.
    pub tracing: Option<Arc<Tracing>>,
    /// `[flow]`: flow control in front of routing.
    pub flow: Option<crate::flow::FlowConfig>,
    /// `[cluster]`: the decoders' slots shared with other replicas through a store, started.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
}

/// The gateway: one model, its prefill and decode pools (each decoder with its handoff mode), the
/// routing policy and the plugins.
#[derive(Debug)]
pub struct Gateway {
    pub model: ModelInfo,
    pub prefills: Vec<Prefiller>,
    pub decoders: Vec<Arc<Decoder>>,
    /// What every mode shares (client, limits, health settings, metrics).
    pub shared: Arc<Shared>,
    pub router: Router,
    pub http: HttpTimeouts,
    /// Admission and routing plugins, when configured.
    pub plugins: Option<Arc<Plugins>>,
    /// API keys, when `[auth]` is on: a request needs one, and its tenant is the key's.
    pub keys: Option<Arc<ApiKeys>>,
    /// `[auth] models_open`: `GET /v1/models` answers without a key.
    pub models_open: bool,
    /// `[admission.tenants]`: the tenant of a request when API keys are off.
    tenants: TenantNames,
    explain: bool,
    /// The engines' names for the decision records.
    roster: Arc<Roster>,
    /// The tracer, when requests are traced.
    pub tracing: Option<Arc<Tracing>>,
    seq: AtomicU64,
    /// The threads that tokenize large prompts, bounded.
    pub tokenizers: crate::tokenize::pool::Pool,
    /// Set when a drain begins: `/ready` answers 503 from then on.
    draining: std::sync::atomic::AtomicBool,
    /// `[flow]`: where requests wait for a decoder with room, in the order the bands, fair shares
    /// and deadlines say; `None`: each decoder's own queue, first come first served per class.
    pub flow: Option<Arc<FlowControl>>,
    /// `[cluster]`: this replica's shares of the decoders, kept with the other replicas.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
    /// The listeners' TLS, by listener (its address, or `admin`), once they are bound: for the
    /// certificate reloads' metrics.
    pub tls: std::sync::OnceLock<Vec<(String, Arc<crate::endpoints::TlsReloads>)>>,
}

impl Gateway {
    pub fn new(
        model: ModelInfo,
        prefills: Vec<Prefiller>,
        decoders: Vec<Arc<Decoder>>,
        shared: Arc<Shared>,
        router: Router,
        http: HttpTimeouts,
        access: Access,
    ) -> Arc<Self> {
        let roster = Arc::new(Roster {
            model: model.name.clone(),
            decoders: decoders.iter().map(|d| (d.name.clone(), d.mode())).collect(),
            prefills: prefills.iter().map(|p| p.name.clone()).collect(),
            builtin: router.builtin,
        });
        let flow = access.flow.map(FlowControl::new);
        let g = Arc::new(Self {
            roster,
            model,
            prefills,
            decoders,
            shared,
            router,
            http,
            plugins: access.plugins,
            keys: access.keys,
            models_open: access.models_open,
            tenants: access.tenants,
            explain: access.explain,
            tracing: access.tracing,
            seq: AtomicU64::new(0),
            tokenizers: crate::tokenize::pool::Pool::per_core(),
            draining: std::sync::atomic::AtomicBool::new(false),
            flow,
            cluster: access.cluster,
            tls: std::sync::OnceLock::new(),
        });
        if let (Some(c), Some(f)) = (&g.cluster, &g.flow) {
            c.attach_flow(f);
        }
        if let Some(f) = &g.flow {
            for d in &g.decoders {
                d.queue.watch(Arc::clone(&f.wake));
            }
            tokio::spawn(Arc::clone(f).run(Arc::downgrade(&g), |g: &Self, tokens| g.room_or_never(tokens)));
        }
        g
    }

    /// Whether decoder `d` would admit a prompt of `tokens` at once: routable, its queue open with
    /// nobody waiting and the slots free.
    fn has_room(d: &Decoder, tokens: usize) -> bool {
        d.health.routable() && d.queue.load().admits_now(d.slots_for(tokens))
    }

    /// Whether any decoder would admit a prompt of `tokens` at once.
    pub fn room_for(&self, tokens: usize) -> bool {
        self.decoders.iter().any(|d| Self::has_room(d, tokens))
    }

    /// Whether flow control should let a prompt of `tokens` go now: a decoder admits it at once,
    /// or none ever will (it goes on to be refused at once by routing or admission rather than
    /// block the queue behind it, e.g. when the one decoder large enough for it turned unhealthy).
    pub fn room_or_never(&self, tokens: usize) -> bool {
        self.room_for(tokens) || !self.flow_can_serve(tokens)
    }

    /// Whether flow control can ever let a prompt of `tokens` go: some healthy decoder's buffer
    /// holds it. Otherwise it goes straight to routing and admission, which refuse it at once
    /// (too large, no healthy decoder) rather than after a wait.
    fn flow_can_serve(&self, tokens: usize) -> bool {
        self.decoders.iter().any(|d| d.health.routable() && d.slots_for(tokens) <= d.queue.load().capacity)
    }

    /// Every endpoint's state, one list per metric, for the routing policy.
    pub fn candidates(&self, ids: &[u32]) -> Candidates {
        let keys = self.router.prefix.as_ref().map(|f| f.index.keys(ids));
        self.candidates_keyed(ids.len(), keys.as_ref())
    }

    /// [`Gateway::candidates`] for a prompt of `tokens` whose block keys are made.
    fn candidates_keyed(&self, tokens: usize, keys: Option<&PromptKeys>) -> Candidates {
        let cached = match (&self.router.prefix, keys) {
            (Some(f), Some(k)) => f.index.cached_tokens(k),
            _ => Vec::new(),
        };
        let (prefill_cached, decode_cached) = cached.split_at(self.prefills.len().min(cached.len()));
        let mut c = Candidates {
            prefill: PrefillView {
                healthy: self.prefills.iter().map(|p| p.health.routable()).collect(),
                in_flight: self.prefills.iter().map(|p| p.health.in_flight()).collect(),
                latency_us: self.prefills.iter().map(|p| p.health.latency_us()).collect(),
                cached_tokens: PerEndpoint::from_slice(prefill_cached),
                pending_tokens: self.prefills.iter().map(|p| p.health.pending_tokens()).collect(),
            },
            decode: DecodeView {
                cached_tokens: PerEndpoint::from_slice(decode_cached),
                ..DecodeView::default()
            },
        };
        for d in &self.decoders {
            let l = d.queue.load();
            c.decode.healthy.push(d.health.routable());
            c.decode.slots_needed.push(d.slots_for(tokens));
            c.decode.capacity_slots.push(l.capacity);
            c.decode.free_slots.push(l.free());
            c.decode.waiting_slots.push(l.waiting_slots);
            c.decode.in_flight.push(l.holders);
        }
        c
    }

    /// Every decoder's admission queue, summed, for the admission plugin.
    pub fn queue_state(&self) -> QueueState {
        let mut q = QueueState { capacity_slots: 0, free_slots: 0, waiting_requests: 0, waiting_slots: 0 };
        for d in &self.decoders {
            let l = d.queue.load();
            q.capacity_slots = q.capacity_slots.saturating_add(l.capacity);
            q.free_slots = q.free_slots.saturating_add(l.free());
            q.waiting_slots =
                q.waiting_slots.saturating_add(u32::try_from(l.waiting_slots).unwrap_or(u32::MAX));
        }
        q.waiting_requests = self.decoders.iter().map(|d| d.queue.waiting()).fold(0u32, u32::saturating_add);
        q
    }

    /// The data-plane certificates the decoders' connections use, each once (pools without their
    /// own share the global `[dataplane_tls]`).
    pub fn dataplane_certs(&self) -> Vec<&crate::endpoints::DataplaneCerts> {
        let mut out: Vec<&crate::endpoints::DataplaneCerts> = Vec::new();
        for c in self.decoders.iter().filter_map(|d| d.handoff.dataplane_certs()) {
            if !out.iter().any(|o| o.same(c)) {
                out.push(c);
            }
        }
        out
    }

    /// Ready to serve: not draining, and a prefiller and a decoder with room exist.
    pub fn ready(&self) -> bool {
        !self.draining.load(Ordering::Relaxed)
            && !self.prefills.is_empty()
            && self.decoders.iter().any(|d| d.queue.stats().capacity > 0)
    }

    /// From now on `/ready` answers 503, so load balancers send no new request here.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Admission slots held on every decoder.
    pub fn held_slots(&self) -> u32 {
        self.decoders.iter().map(|d| d.queue.stats().in_use).fold(0, u32::saturating_add)
    }

    /// Checks every endpoint's `GET /health` each `check_interval`, and at once when an engine's
    /// name moved (forgetting the passive failures of its old addresses), until the gateway is
    /// dropped.
    pub fn start_health_checks(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let cfg = self.shared.health;
        let mut moves = self.shared.client.names().moves();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(cfg.check_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut seen: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    r = moves.changed() => if r.is_err() { return },
                }
                let Some(this) = weak.upgrade() else { return };
                let names = this.shared.client.names();
                let engines = this.prefills.iter().map(|p| (&p.http, &*p.health));
                for (url, health) in engines.chain(this.decoders.iter().map(|d| (&d.http, &d.health))) {
                    if let crate::endpoints::Host::Name(n) = &url.host_port().host {
                        let g = names.generation(n);
                        if seen.insert(n.clone(), g).is_some_and(|before| before != g) {
                            health.readdressed();
                        }
                    }
                }
                // All engines at once: one that hangs until the timeout delays no other check.
                let n = this.prefills.len() + this.decoders.len();
                let mut checks = JoinSet::new();
                for i in 0..n {
                    let this = Arc::clone(&this);
                    checks.spawn(async move {
                        let (addr, health) = match this.prefills.get(i) {
                            Some(p) => (&p.http, &*p.health),
                            None => match this.decoders.get(i - this.prefills.len()) {
                                Some(d) => (&d.http, &d.health),
                                None => return,
                            },
                        };
                        let ok = this.shared.health_check(addr, cfg.check_timeout).await;
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

    /// A generation request from its HTTP form to its answer: the body read within its limits,
    /// parsed, counted, then [`Gateway::dispatch`]ed. Not an `async fn`: one holds its arguments
    /// twice (as passed, and moved in), here the whole request beside its parts, in every state
    /// of a future that is boxed and copied whole; this one holds the parts it reads on. The
    /// checks before the body ([`Gateway::before_body`]) run when this is called.
    pub fn generate(
        self: &Arc<Self>,
        ep: Endpoint,
        req: Request<Incoming>,
    ) -> impl Future<Output = Result<Response<RespBody>, GatewayError>> {
        let checked = self.before_body(&req).map(|tenant| {
            let (parts, body) = req.into_parts();
            (parts.headers, body, tenant)
        });
        async move {
            let (headers, body, tenant) = checked?;
            let body =
                tokio::time::timeout(self.http.body_read, Limited::new(body, MAX_BODY_BYTES).collect())
                    .await
                    .map_err(|_| GatewayError::BodyTimeout { limit: self.http.body_read })?
                    .map_err(|_| GatewayError::BodyTooLarge { limit: MAX_BODY_BYTES })?
                    .to_bytes();
            self.generate_body(ep, &body, &headers, tenant).await
        }
    }

    /// What is checked of a generation request before its body is read: its API key (the
    /// tenant's, when auth is on), its content type, its declared length.
    fn before_body(&self, req: &Request<Incoming>) -> Result<Option<Arc<str>>, GatewayError> {
        // Before anything is read: a request without a known key costs nothing more.
        let tenant = match &self.keys {
            Some(k) => Some(k.tenant_of(req.headers())?),
            None => None,
        };
        if let Some(ct) = req.headers().get(header::CONTENT_TYPE)
            && !ct.to_str().is_ok_and(|v| v.starts_with("application/json"))
        {
            return Err(GatewayError::ContentType);
        }
        // Refused before the body is read, so a client that sent `Expect: 100-continue` gets the
        // 413 instead of `100 Continue` (hyper sends that only once the body is polled).
        let declared =
            req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
            return Err(GatewayError::BodyTooLarge { limit: MAX_BODY_BYTES });
        }
        Ok(tenant)
    }

    /// [`Gateway::generate`] for a body already read; `tenant`: the API key's, when auth is on.
    pub async fn generate_body(
        self: &Arc<Self>,
        ep: Endpoint,
        body: &Bytes,
        headers: &hyper::HeaderMap,
        tenant: Option<Arc<str>>,
    ) -> Result<Response<RespBody>, GatewayError> {
        let raw = api::Object::parse(body)?;
        validate::check(ep, &raw)?;
        if ep == Endpoint::Completions
            && let Some(prompts) = batch::split(&raw)?
        {
            return Box::pin(self.generate_list(prompts, headers, tenant, body.len() as u64)).await;
        }
        let mut req = GenRequest::from_checked(ep, raw)?;
        req.tenant = tenant;
        req.bytes = body.len() as u64;
        self.track(req, headers).await
    }

    /// A parsed request: its model checked, its tokens counted, then dispatched; in the in-flight
    /// table from here until its answer's body ends (or the client leaves).
    async fn track(
        &self,
        req: GenRequest,
        headers: &hyper::HeaderMap,
    ) -> Result<Response<RespBody>, GatewayError> {
        let metrics = &self.shared.metrics;
        let mut tracked = metrics.track();
        // The API key's tenant, else the bearer token's `[admission.tenants]` name (never the token).
        let tenant = req.tenant.clone().or_else(|| self.tenants.of(headers).map(Arc::from));
        let stream = req.fields.stream;
        let explain = self.explain && headers.get(EXPLAIN_HEADER).is_some_and(|v| v == "1");
        let (path, model, who) = (req.endpoint.path(), req.model().map(str::to_owned), tenant.clone());
        tracked.live().note(
            "request",
            move || json!({"endpoint": path, "model": model, "stream": stream, "tenant": who.as_deref()}),
        );
        let trace = self.tracing.as_ref().map(|t| {
            let id = request_id::current();
            let facts = RequestFacts {
                operation: match req.endpoint {
                    Endpoint::Chat => "chat",
                    Endpoint::Completions => "text_completion",
                },
                model: req.model().unwrap_or(&self.model.name),
                path: req.endpoint.path(),
                request_id: id.as_ref().map_or("", |id| id.as_str()),
                stream,
                max_tokens: req.fields.max_tokens(),
            };
            t.request(headers, facts)
        });
        let unanswered = trace::UntilAnswered::new(trace.clone());
        let dispatched = trace::scope(trace.clone(), self.count(req, headers, tracked.live()));
        let dispatched = dispatched.await;
        unanswered.answered();
        match dispatched {
            Ok(mut d) => {
                if explain
                    && !stream
                    && let Ok(v) = header::HeaderValue::from_str(&usage::ascii_json(&tracked.live().record()))
                {
                    d.resp.headers_mut().insert(EXPLAIN_HEADER, v);
                }
                let answer = Answer {
                    tracked,
                    mode: d.mode,
                    tenant,
                    prompt_tokens: d.prompt_tokens,
                    stream,
                    status: d.resp.status().as_u16(),
                    explain: explain && stream,
                    owed: d.owed,
                    charge: d.charge,
                    trace,
                };
                Ok(d.resp.map(|b| Watched::new(b, answer).boxed()))
            }
            Err(e) => {
                tracked.settle();
                if let Some((leg, status)) = e.engine_failure() {
                    metrics.engine_error(leg, &status);
                }
                let (status, code, origin, message) =
                    (e.status(), e.code(), e.origin().as_str(), e.to_string());
                tracked.live().note("outcome", move || {
                    json!({"end": "error", "status": status, "code": code, "origin": origin, "message": message})
                });
                if let Some(t) = trace {
                    let message = e.to_string();
                    t.finish(End { status: e.status(), error: Some((e.code(), &message)), ..End::default() });
                }
                Err(e)
            }
        }
    }

    async fn count(
        &self,
        req: GenRequest,
        headers: &hyper::HeaderMap,
        live: &Arc<Live>,
    ) -> Result<Dispatched, GatewayError> {
        if let Some(m) = req.model()
            && m != self.model.name
        {
            return Err(GatewayError::UnknownModel(m.chars().take(64).collect()));
        }
        let limit = self.model.context_length;
        if Tokenizer::work(&req) <= INLINE_TOKENIZE_BYTES {
            let ids = self.model.tokenizer.token_ids_within(&req, limit)?;
            // Boxed, here and below: `dispatch` is a 4.2 KB future, and each async fn and wrapper
            // above that held it (the trace's scope, `track`, the id's scope, hyper's box) grew by
            // about as much again and copied it whole (`track`'s was 17.9 KB, 2.1 with the box).
            return Box::pin(self.dispatch(req, ids, headers, live)).await;
        }
        // A completion's text too long for the context whatever it says is refused here, before
        // it waits for a tokenizer thread; a chat's is once rendered, on that thread.
        if let Some(crate::api::PromptRef::Text(t)) = req.prompt() {
            self.model.tokenizer.refuse_beyond(t, limit, "prompt")?;
        }
        let tok = Arc::clone(&self.model.tokenizer);
        let (req, ids) = self
            .tokenizers
            .run(move || {
                let ids = tok.token_ids_within(&req, limit);
                (req, ids)
            })
            .await?;
        Box::pin(self.dispatch(req, ids?, headers, live)).await
    }

    /// A counted request: plugin admission, routing, admission on the chosen decoder, its mode's
    /// legs; phases recorded, headers set.
    async fn dispatch(
        &self,
        req: GenRequest,
        ids: Vec<u32>,
        headers: &hyper::HeaderMap,
        live: &Arc<Live>,
    ) -> Result<Dispatched, GatewayError> {
        self.fits_context(&req, &ids)?;
        // The first decoder's count; each decoder's own is in the candidates.
        let need = self.decoders.first().map_or(0, |d| d.slots_for(ids.len()));
        let max_tokens = req.fields.max_tokens();
        let prompt_tokens = ids.len();
        live.note("prompt_tokens", move || json!(prompt_tokens));
        live.note("max_tokens", move || json!(max_tokens));
        let trace = trace::current();
        if let Some(t) = &trace {
            t.set([KeyValue::new("gen_ai.usage.input_tokens", ids.len() as i64)]);
        }
        let facts = RouteFacts {
            model: &self.model.name,
            prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            slots: need,
            max_tokens,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
        };
        // Who the request is to flow control, read before it waits on anything (a bad band is
        // the client's 400 at once). Its tenant, resolved once, is the plugins' too.
        let tenant = self.flow.as_ref().map(|_| self.tenants.tenant(headers, req.tenant.as_deref()));
        let identity = match &self.flow {
            Some(f) => Some(
                f.identify(headers, tenant.as_deref(), tokio::time::Instant::from_std(live.started))
                    .map_err(GatewayError::Flow)?,
            ),
            None => None,
        };
        let preq = self.plugins.as_ref().map(|p| {
            let ep = match req.endpoint {
                Endpoint::Completions => "completions",
                Endpoint::Chat => "chat",
            };
            let flow = match (&self.flow, &identity) {
                (Some(f), Some(id)) => f.cfg.bands.get(id.band).map(|b| (b.name.as_str(), &*id.tenant)),
                _ => None,
            };
            let from = Sender { headers, tenant: tenant.as_deref().or(req.tenant.as_deref()), flow };
            Arc::new(p.request(&self.model.name, ep, from, &ids, need, max_tokens))
        });
        let (mut ticket, mut owed) = self.admit(preq.as_ref(), live, trace.as_ref()).await?;
        let flowed = match (&self.flow, &identity) {
            (Some(f), Some(id)) if self.flow_can_serve(ids.len()) => {
                live.enter(Phase::Flow);
                let ask =
                    Ask { tokens: ids.len(), bytes: req.bytes, plugin_wait: ticket.max_wait, max_tokens };
                let noted = Arc::clone(live);
                let note = move |v: Value| noted.note("flow", move || v.clone());
                let a =
                    f.enter(id, ask, |t| self.room_or_never(t), note).await.map_err(GatewayError::Flow)?;
                // Its wait for the decoder's slots (none, unless another took the room in
                // between) is within what is left of its deadline.
                let left = a.deadline.saturating_duration_since(tokio::time::Instant::now());
                ticket.max_wait = Some(ticket.max_wait.map_or(left, |w| w.min(left)));
                Some(a)
            }
            _ => None,
        };
        let waited = flowed.as_ref().map_or(Duration::ZERO, |a| a.waited);
        let mut avoid = Avoid { no_room: flowed.is_some(), ..Avoid::default() };
        let (mut routes, mut work) =
            self.route(preq.as_ref(), &facts, &ids, &avoid, live, trace.as_ref()).await?;
        let mode = self
            .decoders
            .get(routes.first().map_or(usize::MAX, |r| r.decode))
            .ok_or(GatewayError::NoEndpoint("decode"))?
            .mode();

        // `route` up to here; then `queue`, the wait for the decoder's room.
        let recorder = Some((Arc::clone(&self.shared.metrics), mode));
        let mut timing = Timing::tracked(Some(Arc::clone(live)), trace.clone(), recorder);
        let (mut settle, charge) = match flowed {
            Some(Admitted { charge, settle, .. }) => {
                timing.record(Phase::Flow, waited);
                (settle, Some(charge))
            }
            None => (None, None),
        };
        timing.record(Phase::Route, live.started.elapsed().saturating_sub(waited));
        self.shared.retries.request();
        // Retries of this request, every leg's (`[routing.retries] attempts` bounds them), and
        // what the decision record says of each failed attempt.
        let retried = Arc::new(AtomicU32::new(0));
        let mut record: Vec<Value> = Vec::new();
        // Every attempt waits for its decoder's room within what the first one was given.
        let wait = ticket.max_wait.unwrap_or(self.shared.limits.queue_timeout);
        let queue_deadline = Instant::now() + wait;
        let (r, dec, prefills) = loop {
            let route = routes.first().ok_or(GatewayError::NoEndpoint("decode"))?;
            let prefills = match work {
                None => PerEndpoint::new(),
                Some(_) => self.prefill_order(routes.iter().map(|r| r.prefill), &avoid),
            };
            let dec = self.decoders.get(route.decode).ok_or(GatewayError::NoEndpoint("decode"))?;
            // Where a breaker is half-open, this request is its probe.
            for h in prefills.first().map(|p| &*p.health).into_iter().chain([&dec.health]) {
                h.chosen(&self.shared.health);
            }
            live.routed(route.decode);
            if let Some(t) = &trace {
                t.routed(dec.mode(), &dec.name, prefills.first().map(|p| p.name.as_str()));
            }
            timing.enter(Phase::Queue);
            let to = work.take().map(|work| (&prefills[..], work));
            let unstarted = std::sync::OnceLock::new();
            let pass = Pass { ticket, settle: settle.take(), retry: &unstarted, retried: &retried };
            let r = self.handoff(dec, to, &req, &ids, pass, &mut timing).await;
            let (e, failed) = match (r, unstarted.into_inner()) {
                (Err(e), Some(failed)) => (e, failed),
                (r, _) => break (r, dec, prefills),
            };
            // Nothing depended on the attempt yet: run it again without the engine that failed,
            // when the budget allows and another engine can take it.
            let (leg, engine) = match failed {
                Unstarted::Prefill(name) => {
                    avoid.prefills.extend(self.prefills.iter().position(|p| p.name == name));
                    ("prefill", name)
                }
                Unstarted::Decode => {
                    avoid.decoders.push(route.decode);
                    ("decode", dec.name.clone())
                }
            };
            record.push(json!({"leg": leg, "engine": engine, "error": e.to_string()}));
            avoid.no_room = false;
            let again = match self.shared.retries.before_retry(leg, &retried).await {
                Ok(()) => self
                    .route(preq.as_ref(), &facts, &ids, &avoid, live, trace.as_ref())
                    .await
                    .map_err(|_| "no other engine to route it to"),
                Err(Denied::Budget) => Err("the retry budget is spent"),
                Err(Denied::Attempts) => Err("the request had its attempts"),
            };
            let again = match again {
                Ok(again) => again,
                Err(why_not) => {
                    if let Some(last) = record.last_mut() {
                        last["retried"] = json!(false);
                        last["why_not"] = json!(why_not);
                    }
                    break (Err(e), dec, prefills);
                }
            };
            tracing::debug!(leg, engine, error = %e, "attempt failed before it mattered, routing it again");
            (routes, work) = again;
            ticket.max_wait = Some(queue_deadline.saturating_duration_since(Instant::now()));
            // The failed attempt and the wait before the next count as routing.
            timing.mark(Phase::Route);
        };
        if !record.is_empty() {
            live.note("retries", move || Value::Array(record.clone()));
        }
        let r = r.map(|mut resp| {
            let h = resp.headers_mut();
            let prefill = prefills.first().map_or("none", |p| p.name.as_str());
            if let Ok(v) = header::HeaderValue::from_str(&format!("prefill={prefill}, decode={}", dec.name)) {
                h.insert(ROUTE_NAME, v);
            }
            if let Ok(v) = header::HeaderValue::from_str(&timing.header()) {
                h.insert(SERVER_TIMING, v);
            }
            resp
        });
        self.record_phases(&timing, live);
        if let Some(c) = owed.as_mut() {
            c.status = r.as_ref().map_or_else(GatewayError::status, |resp| resp.status().as_u16());
        }
        let resp = r?;
        Ok(Dispatched { resp, mode: dec.mode(), prompt_tokens: ids.len() as u64, owed, charge })
    }

    /// Refuses a prompt longer than the model's context.
    fn fits_context(&self, req: &GenRequest, ids: &[u32]) -> Result<(), GatewayError> {
        if ids.len() as u64 <= self.model.context_length {
            return Ok(());
        }
        Err(GatewayError::ContextLength {
            tokens: ids.len() as u64,
            limit: self.model.context_length,
            at_least: false,
            param: match req.endpoint {
                Endpoint::Completions => "prompt",
                Endpoint::Chat => "messages",
            },
        })
    }

    /// Admission: the plugin's verdict (its ticket, and the usage owed to it at the end), or the
    /// built-in one (class 0, the gateway's wait) when there is no plugin or it did not answer.
    async fn admit(
        &self,
        preq: Option<&Arc<PolicyRequest>>,
        live: &Arc<Live>,
        trace: Option<&Arc<trace::RequestTrace>>,
    ) -> Result<(Ticket, Option<Completion>), GatewayError> {
        let (Some(p), Some(preq)) = (self.plugins.as_ref().and_then(|p| p.admission.as_ref()), preq) else {
            live.note("admission", || json!({"by": "built-in", "verdict": "queue"}));
            return Ok((Ticket::default(), None));
        };
        let by = p.info().name;
        let asked = Instant::now();
        let verdict = p.admit(Arc::clone(preq), self.queue_state()).await;
        if let Some(t) = trace {
            t.span("plugin admit", asked, Instant::now(), vec![KeyValue::new("baton.plugin", by.clone())]);
        }
        match verdict {
            Some(Admit::Reject { status, message, retry_after_s }) => {
                let said = message.clone();
                live.note("admission", move || {
                    json!({"by": by, "verdict": "reject", "status": status, "message": said,
                           "retry_after_s": retry_after_s})
                });
                Err(GatewayError::PolicyRejected { status, message, retry_after: retry_after_s })
            }
            Some(Admit::Queue { class, max_wait }) => {
                live.note("admission", move || {
                    json!({"by": by, "verdict": "queue", "class": class,
                           "max_wait_ms": max_wait.map(crate::telemetry::metrics::ms)})
                });
                Ok((Ticket { class, max_wait }, Some(Completion::new(Arc::clone(p), Arc::clone(preq)))))
            }
            None => {
                live.note("admission", || {
                    json!({"by": "built-in", "verdict": "queue", "why": "the plugin was busy, off or faulted"})
                });
                Ok((Ticket::default(), None))
            }
        }
    }

    /// Late binding: a request flow control let go is routed among the decoders that admit it at
    /// once (the others are marked unroutable for this decision, and returned). When none does
    /// any more (another request took the room in between), nothing is marked and it waits in its
    /// decoder's queue.
    fn only_with_room(&self, c: &mut Candidates, tokens: usize) -> Vec<usize> {
        let full: Vec<usize> = self
            .decoders
            .iter()
            .enumerate()
            .filter(|(i, d)| c.decode.healthy.get(*i) == Some(&true) && !Self::has_room(d, tokens))
            .map(|(i, _)| i)
            .collect();
        let left = c.decode.healthy.iter().filter(|h| **h).count();
        if full.len() >= left {
            return Vec::new();
        }
        for &i in &full {
            if let Some(h) = c.decode.healthy.get_mut(i) {
                *h = false;
            }
        }
        full
    }

    /// The routes to try, best first: the routing plugin's choice (checked), or the built-in
    /// policy's; the decision recorded. With them, the prompt's uncached tokens counted in the
    /// routed prefiller's pending work until its prefill answers; or `None` when the chosen
    /// decoder gets the request alone, no prefill leg (it holds all but
    /// `routing.cache.skip_prefill_within` of the prompt, and its mode can).
    async fn route(
        &self,
        preq: Option<&Arc<PolicyRequest>>,
        facts: &RouteFacts<'_>,
        ids: &[u32],
        avoid: &Avoid,
        live: &Arc<Live>,
        trace: Option<&Arc<trace::RequestTrace>>,
    ) -> Result<(Vec<Route>, Option<Work>), GatewayError> {
        let keys = self.router.prefix.as_ref().map(|f| f.index.keys(ids));
        let mut cands = self.candidates_keyed(ids.len(), keys.as_ref());
        for (list, avoided) in
            [(&mut cands.prefill.healthy, &avoid.prefills), (&mut cands.decode.healthy, &avoid.decoders)]
        {
            for &i in avoided {
                if let Some(h) = list.get_mut(i) {
                    *h = false;
                }
            }
        }
        let no_room = if avoid.no_room { self.only_with_room(&mut cands, ids.len()) } else { Vec::new() };
        let mut by_plugin = None;
        let routed = match (self.plugins.as_ref().and_then(|p| p.routing.as_ref()), preq) {
            (Some(p), Some(preq)) => {
                let asked = Instant::now();
                let decision = p.route(Arc::clone(preq), &cands).await;
                if let Some(t) = trace {
                    let name = p.info().name;
                    t.span("plugin route", asked, Instant::now(), vec![KeyValue::new("baton.plugin", name)]);
                }
                let first = match &decision {
                    Some(Decision::Route(r)) => r.first().copied(),
                    _ => None,
                };
                let routed = self.router.route_decided(decision, facts, &cands, |why| p.invalid(why));
                if first.is_some() && routed.as_ref().is_ok_and(|r| r.first().copied() == first) {
                    by_plugin = Some(p.info().name);
                }
                routed
            }
            _ => self.router.route(facts, &cands),
        };
        let routes = routed.map_err(|e| match e {
            NoRoute::Prefill => GatewayError::NoEndpoint("prefill"),
            NoRoute::Decode => GatewayError::NoEndpoint("decode"),
        })?;
        let chosen = *routes.first().ok_or(GatewayError::NoEndpoint("decode"))?;
        let prefill = self.prefills.get(chosen.prefill).ok_or(GatewayError::NoEndpoint("prefill"))?;
        let prefill_cached = cands.prefill.cached_tokens.get(chosen.prefill).copied().unwrap_or(0);
        let mut alone = false;
        if let (Some(keys), Some(feeds)) = (&keys, &self.router.prefix) {
            let cached = cands.decode.cached_tokens.get(chosen.decode).copied().unwrap_or(0);
            alone = self.decoders.get(chosen.decode).is_some_and(|d| d.handoff.serves_alone())
                && feeds.skips_prefill(
                    self.prefills.len() + chosen.decode,
                    ids.len(),
                    cached,
                    prefill_cached,
                );
            if alone {
                feeds.count_skip();
                let computed = ids.len().saturating_sub(cached as usize);
                live.note("prefill", move || {
                    json!({"skipped": true, "decoder_cached_tokens": cached, "computed_by_decoder": computed})
                });
            }
            self.note_routed(chosen, keys, &cands, alone);
        }
        let work =
            (!alone).then(|| prefill.health.commit(ids.len().saturating_sub(prefill_cached as usize) as u64));
        let roster = Arc::clone(&self.roster);
        let facts = (facts.prompt_tokens, facts.slots, facts.max_tokens, facts.seq);
        live.note("route", move || {
            roster.route_record(facts, &cands, chosen, by_plugin.as_deref(), &no_room)
        });
        Ok((routes, work))
    }

    /// Tells the block index where the prompt went: engines without live events get its blocks
    /// as approximate entries, and engines with feeds are expected to publish.
    /// With `alone`, the prefiller gets nothing and is left out.
    fn note_routed(&self, chosen: Route, keys: &PromptKeys, c: &Candidates, alone: bool) {
        let Some(feeds) = &self.router.prefix else { return };
        let tokens = keys.tokens;
        let cached = [
            c.prefill.cached_tokens.get(chosen.prefill).copied().unwrap_or(0),
            c.decode.cached_tokens.get(chosen.decode).copied().unwrap_or(0),
        ];
        if !alone {
            feeds.count_route(0, tokens, cached[0]);
        }
        feeds.count_route(1, tokens, cached[1]);
        let p = self.prefills.len();
        let engines = [(chosen.prefill, cached[0]), (p + chosen.decode, cached[1])];
        for (engine, cached) in engines.into_iter().skip(usize::from(alone)) {
            feeds.index.routed(engine, keys);
            // An engine publishes only blocks it did not hold: a request it holds whole says
            // nothing, and must not count against its feed.
            let new_blocks =
                tokens.saturating_sub(cached as usize) >= feeds.index.block_size(engine) as usize;
            if new_blocks {
                feeds.routed(engine);
            }
        }
    }

    /// The request's phases into the metrics and its in-flight entry.
    fn record_phases(&self, timing: &Timing, live: &Arc<Live>) {
        timing.record_metrics();
        let phases: smallvec::SmallVec<[(Phase, Duration); 8]> = timing.phases().iter().copied().collect();
        live.note("phases_ms", move || {
            let phases = phases.iter().map(|(p, d)| (p.as_str().to_owned(), json!(round_ms(*d))));
            Value::Object(phases.collect())
        });
    }

    /// The routed prefillers, then every other routable one (less those an earlier attempt of the
    /// request failed on): tried in turn only while a prefiller fails before it mattered.
    fn prefill_order(&self, routed: impl Iterator<Item = usize>, avoid: &Avoid) -> PerEndpoint<&Prefiller> {
        let mut order: PerEndpoint<usize> = PerEndpoint::with_capacity(self.prefills.len());
        let healthy =
            (0..self.prefills.len()).filter(|&i| self.prefills.get(i).is_some_and(|p| p.health.routable()));
        for i in routed.chain(healthy) {
            if !order.contains(&i) && !avoid.prefills.contains(&i) {
                order.push(i);
            }
        }
        order.iter().filter_map(|&i| self.prefills.get(i)).collect()
    }

    /// Admission on the decoder, then the mode's legs; `prefills` in the order to try with the
    /// work counted on the first, or `None` when the decoder gets the request alone. `settle`
    /// (flow control's) is dropped once the decoder admitted it.
    async fn handoff(
        &self,
        dec: &Arc<Decoder>,
        prefills: Option<(&[&Prefiller], Work)>,
        req: &GenRequest,
        ids: &[u32],
        pass: Pass<'_>,
        timing: &mut Timing,
    ) -> Result<Response<RespBody>, GatewayError> {
        dec.handoff.accepts(req)?;
        let (need, ahead) = (dec.slots_for(ids.len()), dec.queue.waiting());
        let slots = dec.handoff.admit(dec, need, pass.ticket, self.shared.limits.queue_timeout).await;
        // Flow control lets its next request go once this one holds its room.
        drop(pass.settle);
        let slots = slots?;
        let wait = timing.mark(Phase::Queue);
        let named = Arc::clone(dec);
        timing.note("queue", move || {
            json!({"decoder": named.name, "slots": need, "waiting_ahead": ahead, "wait_ms": round_ms(wait)})
        });
        let (prefills, work) = prefills.map_or((&[][..], None), |(p, w)| (p, Some(w)));
        let (retry, retried) = (pass.retry, pass.retried);
        dec.handoff.run(Leg { dec, prefills, req, ids, slots, timing, work, retry, retried }).await
    }

    /// The time to the response headers (for a stream, its first byte) and the status, once per
    /// request answered.
    pub fn answered(&self, started: Instant, status: u16) {
        self.shared.metrics.phase(Phase::Total, started.elapsed());
        self.shared.metrics.answered(status);
    }
}
