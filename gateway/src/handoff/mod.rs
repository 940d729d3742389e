//! The native PD handoff: admit (slots) → reserve on every decoder rank (all or nothing, retried
//! while another replica holds pages) → prefill with the write addresses → wait for READY from every
//! rank (deadline, fail fast) → decode, streamed back → slots returned when every rank reports its
//! pages released.
//!
//! Everything a request holds (slots, the reservation, the event subscription) lives in one
//! [`Lifecycle`]; its `Drop` runs on every path, including a client that disconnects at any await
//! point: it cancels what is still reserved (quarantine-free when the prefiller never saw the
//! addresses) and returns the slots once the decoder has freed the pages (or a bound passes).

pub mod decoder;
pub mod lmcache;
pub mod nixl;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use baton_dataplane::readiness::{Aggregator, Outcome, Progress};
use baton_dataplane::{RankEvent, RequestId, RequestKey};
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::admission::{AdmissionError, SlotGuard};
use crate::api::{GatewayError, GenRequest};
use crate::routing::{Health, HealthConfig};
use decoder::DecoderHandle;

/// A reservation's lease on the decoder: long enough for a long prefill and the decode request to
/// arrive, short enough that a vanished gateway strands pages for at most this long.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(120);
/// Longest wait for every decoder rank to hold the whole KV after the prefill returned.
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest an upstream leg may take to answer (headers, for a streamed decode).
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest the slots of a finished or abandoned request wait for the decoder to report its pages
/// free before they are returned anyway: the decoder's lease and quarantine end them by then.
pub const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(30);
/// First pause before retrying a reservation refused for lack of room.
const RESERVE_BACKOFF: Duration = Duration::from_millis(2);

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type RespBody = BoxBody<Bytes, BoxError>;
/// The gateway's client to the engines.
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// POSTs `body` as JSON within `timeout`. `detach`: the call runs to its end even if the caller
/// stops waiting (a client that leaves does not abort an engine mid-transfer).
pub(crate) async fn post_json(
    client: &HttpClient,
    addr: SocketAddr,
    path: &str,
    body: &Value,
    timeout: Duration,
    detach: bool,
) -> Result<Response<hyper::body::Incoming>, PostError> {
    let req = Request::post(format!("http://{addr}{path}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| PostError { message: e.to_string(), unsent: true })?;
    let call = tokio::time::timeout(timeout, client.request(req));
    let answer = if detach {
        tokio::spawn(call)
            .await
            .map_err(|e| PostError { message: format!("upstream call task: {e}"), unsent: false })?
    } else {
        call.await
    };
    match answer {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(PostError { message: e.to_string(), unsent: e.is_connect() }),
        Err(_) => Err(PostError { message: format!("no answer within {timeout:?}"), unsent: false }),
    }
}

/// Counters of the one-token *drain* decodes sent for requests that ended between their prefill and
/// their decode, so the engines free what the prefill left them (`lmcache` and `vllm-nixl`).
#[derive(Debug, Default)]
pub struct Drains {
    pub sent: AtomicU64,
    /// The engine no longer held anything (a decode it raced with had taken it): nothing left.
    pub already_free: AtomicU64,
    pub failed: AtomicU64,
}

/// Sends a drain decode and drops its answer.
pub(crate) async fn send_drain(
    client: &HttpClient,
    decoder: SocketAddr,
    path: &str,
    body: &Value,
    timeout: Duration,
    counters: &Drains,
) {
    counters.sent.fetch_add(1, Ordering::Relaxed);
    let status = match post_json(client, decoder, path, body, timeout, false).await {
        Ok(r) => {
            let s = r.status().as_u16();
            let _ = r.into_body().collect().await;
            s
        }
        Err(_) => 0,
    };
    if status == 410 {
        counters.already_free.fetch_add(1, Ordering::Relaxed);
    } else if !(200..300).contains(&status) {
        counters.failed.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(decoder = %decoder, status, "drain decode failed; the engines keep what the request left until their own timeouts");
    }
}

/// Counts a failure against an endpoint (passive health).
pub(crate) fn count_failure(cfg: &HealthConfig, name: &str, h: &Health) {
    if h.failure(cfg) {
        tracing::warn!(endpoint = name, "ejected after consecutive failures");
    }
}

/// Posts the prefill to the first prefiller, then the next ones while a prefiller cannot even be
/// connected to (it never saw the request, so another may take it). `sent` is set while the request
/// may have reached an engine.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn prefill_in_turn<'a, P: std::borrow::Borrow<Prefiller>>(
    client: &HttpClient,
    timeout: Duration,
    health: &HealthConfig,
    prefills: &'a [P],
    path: &str,
    body: &Value,
    sent: &mut bool,
    detach: bool,
) -> Result<(&'a Prefiller, Response<hyper::body::Incoming>, crate::routing::InFlight<'a>), GatewayError> {
    for (attempt, prefill) in prefills.iter().map(std::borrow::Borrow::borrow).enumerate() {
        *sent = true;
        let in_flight = prefill.health.start();
        match post_json(client, prefill.http, path, body, timeout, detach).await {
            Ok(resp) => return Ok((prefill, resp, in_flight)),
            Err(e) => {
                count_failure(health, &prefill.name, &prefill.health);
                *sent = !e.unsent;
                if !e.unsent || attempt + 1 >= prefills.len() {
                    return Err(GatewayError::Upstream { leg: "prefill", message: e.message });
                }
                tracing::debug!(
                    prefill = prefill.name,
                    error = e.message,
                    "prefill unreachable, trying the next"
                );
            }
        }
    }
    Err(GatewayError::NoEndpoint("prefill"))
}

/// Timing limits of the handoff.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub lease: Duration,
    pub queue_timeout: Duration,
    pub ready_timeout: Duration,
    pub upstream_timeout: Duration,
    pub release_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            lease: DEFAULT_LEASE,
            queue_timeout: crate::admission::DEFAULT_QUEUE_TIMEOUT,
            ready_timeout: DEFAULT_READY_TIMEOUT,
            upstream_timeout: DEFAULT_UPSTREAM_TIMEOUT,
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
        }
    }
}

/// A prefill engine.
#[derive(Clone, Debug)]
pub struct Prefiller {
    pub name: String,
    pub http: SocketAddr,
    pub health: Arc<Health>,
}

impl Prefiller {
    pub fn new(name: String, http: SocketAddr) -> Self {
        Self { name, http, health: Arc::default() }
    }
}

/// Request ids unique across restarts and replicas: 64 random bits per process (the std hasher's
/// random keys), then a counter.
#[derive(Debug)]
pub struct KeyGen {
    high: u64,
    next: AtomicU64,
}

impl Default for KeyGen {
    fn default() -> Self {
        let mut h = RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        Self { high: h.finish(), next: AtomicU64::new(1) }
    }
}

impl KeyGen {
    pub fn next(&self) -> RequestKey {
        RequestKey::new(
            RequestId(u128::from(self.high) << 64 | u128::from(self.next.fetch_add(1, Ordering::Relaxed))),
            0,
        )
    }
}

/// Per-phase durations of one request, sent back as a `Server-Timing` header (milliseconds):
/// `queue` (admission), `reserve` (pages on every rank), `prefill` (the prefill leg), `kv_ready`
/// (until every rank holds the KV), `decode` (until the decoder's response headers).
#[derive(Debug)]
struct Timing {
    last: Instant,
    phases: Vec<(&'static str, Duration)>,
}

impl Timing {
    fn start() -> Self {
        Self { last: Instant::now(), phases: Vec::with_capacity(5) }
    }

    fn mark(&mut self, phase: &'static str) {
        let now = Instant::now();
        self.phases.push((phase, now - self.last));
        self.last = now;
    }

    /// Time since the start.
    fn total(&self) -> Duration {
        self.phases.iter().map(|(_, d)| *d).sum::<Duration>() + self.last.elapsed()
    }

    fn header(&self) -> String {
        self.phases
            .iter()
            .map(|(n, d)| format!("{n};dur={:.3}", d.as_secs_f64() * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What a request holds; released in `Drop`, on every path.
struct Lifecycle {
    dec: Arc<DecoderHandle>,
    key: RequestKey,
    slots: Option<SlotGuard>,
    rx: Option<mpsc::UnboundedReceiver<RankEvent>>,
    reserved: bool,
    sent: bool,
    /// Set once the decoder took the request: no cancel, only wait for the release.
    decoded: bool,
    released: u32,
    release_timeout: Duration,
}

impl Drop for Lifecycle {
    fn drop(&mut self) {
        let dec = Arc::clone(&self.dec);
        let (key, slots, rx) = (self.key, self.slots.take(), self.rx.take());
        let (reserved, sent, decoded, seen, bound) =
            (self.reserved, self.sent, self.decoded, self.released, self.release_timeout);
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(async move {
            if reserved && !decoded {
                dec.cancel(key, !sent).await;
            }
            // Never sent: the rank freed the pages before answering the cancel (and a reservation
            // that was never made sends no release), so there is nothing to wait for.
            let wait = !(reserved && !decoded && !sent);
            if let Some(mut rx) = rx.filter(|_| wait) {
                let ranks = dec.rank_count();
                let mut released = seen;
                let deadline = tokio::time::Instant::now() + bound;
                while released < ranks {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(RankEvent::Released(_))) => released += 1,
                        Ok(Some(_)) => {}
                        _ => break,
                    }
                }
            }
            dec.forget(key);
            // The slots go back only now: the decoder has freed the pages (or its lease will).
            drop(slots);
        });
    }
}

/// Single-chunk reservations held by [`Native::hold_chunk_by_chunk`]; cancelled on drop.
struct ChunkHolds {
    dec: Arc<DecoderHandle>,
    keys: Vec<RequestKey>,
}

impl Drop for ChunkHolds {
    fn drop(&mut self) {
        let (dec, keys) = (Arc::clone(&self.dec), std::mem::take(&mut self.keys));
        if keys.is_empty() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                for k in keys {
                    dec.cancel(k, true).await;
                }
            });
        }
    }
}

/// An upstream call that got no response.
#[derive(Debug)]
pub(crate) struct PostError {
    message: String,
    /// The request never left (no connection): the engine cannot have seen it.
    unsent: bool,
}

/// The native handoff.
pub struct Native {
    client: HttpClient,
    pub limits: Limits,
    pub health: HealthConfig,
    /// TEST ONLY: the protections off, to show what they prevent. No admission, and decoder pages
    /// taken one chunk at a time as the chunks would arrive (as LMCache's PD buffer allocates),
    /// each held while the next is awaited. Never set by configuration.
    pub unprotected: bool,
    keys: KeyGen,
    pub metrics: std::sync::Arc<crate::telemetry::Metrics>,
    /// The `lmcache` mode's notification listener (when a decoder uses that mode).
    pub lmcache: Option<Arc<lmcache::Notifications>>,
    /// `lmcache`: drains sent so decoders free PD-buffer chunks of requests that never decoded.
    pub lmcache_drains: Arc<Drains>,
    /// Ask `lmcache` prefillers for the first token (`ret_first_tok`) and send it to the client at once.
    pub first_token: bool,
    /// `vllm-nixl`: drains sent for requests that ended between their prefill and their decode.
    pub nixl_drains: Arc<Drains>,
}

impl std::fmt::Debug for Native {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Native").field("limits", &self.limits).finish()
    }
}

fn admission_error(e: AdmissionError) -> GatewayError {
    match e {
        AdmissionError::TooLarge { need, capacity } => GatewayError::TooLarge { need, capacity },
        e @ AdmissionError::QueueFull { .. } => GatewayError::QueueFull(e.to_string()),
        e @ AdmissionError::Timeout { .. } => GatewayError::QueueTimeout(e.to_string()),
    }
}

fn short_body(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    s.chars().take(300).collect()
}

impl Native {
    pub fn new(limits: Limits) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client =
            Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(60)).build(connector);
        Self {
            client,
            limits,
            health: HealthConfig::default(),
            unprotected: false,
            keys: KeyGen::default(),
            metrics: Default::default(),
            lmcache: None,
            lmcache_drains: Arc::default(),
            first_token: true,
            nixl_drains: Arc::default(),
        }
    }

    /// Listens for LMCache prefill notifications on `addr` (the proxy port of LMCache's YAML).
    pub async fn listen_lmcache(&mut self, addr: SocketAddr) -> Result<SocketAddr, String> {
        let hub = lmcache::Notifications::bind(addr).await?;
        let at = hub.addr;
        self.lmcache = Some(hub);
        Ok(at)
    }

    /// [`prefill_in_turn`] with this handoff's client, deadline and health settings.
    async fn send_prefill<'a>(
        &self,
        prefills: &'a [&'a Prefiller],
        path: &str,
        body: &Value,
        sent: &mut bool,
        detach: bool,
    ) -> Result<(&'a Prefiller, Response<hyper::body::Incoming>, crate::routing::InFlight<'a>), GatewayError>
    {
        let timeout = self.limits.upstream_timeout;
        prefill_in_turn(&self.client, timeout, &self.health, prefills, path, body, sent, detach).await
    }

    async fn post(
        &self,
        addr: SocketAddr,
        path: &str,
        body: &Value,
        detach: bool,
    ) -> Result<Response<hyper::body::Incoming>, PostError> {
        post_json(&self.client, addr, path, body, self.limits.upstream_timeout, detach).await
    }

    /// An engine's non-200 answer as the client's error; a 5xx counts against the engine.
    async fn refused(
        &self,
        leg: &'static str,
        name: &str,
        health: &Health,
        resp: Response<hyper::body::Incoming>,
    ) -> GatewayError {
        let status = resp.status().as_u16();
        if status >= 500 {
            self.failed(name, health);
        }
        let b = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        GatewayError::Upstream { leg, message: format!("{status}: {}", short_body(&b)) }
    }

    /// Records a finished request's phases.
    fn record(&self, timing: &Timing) {
        for (phase, d) in &timing.phases {
            self.metrics.phase(phase, *d);
        }
    }

    /// Counts a failure against an endpoint (passive health).
    fn failed(&self, name: &str, h: &Health) {
        count_failure(&self.health, name, h);
    }

    /// `GET /health` answered 200 within `timeout`.
    pub async fn health_check(&self, addr: SocketAddr, timeout: Duration) -> bool {
        let Ok(req) = Request::get(format!("http://{addr}/health")).body(Full::new(Bytes::new())) else {
            return false;
        };
        match tokio::time::timeout(timeout, self.client.request(req)).await {
            Ok(Ok(r)) => {
                let ok = r.status() == 200;
                let _ = r.into_body().collect().await;
                ok
            }
            _ => false,
        }
    }

    /// TEST ONLY ([`Native::unprotected`]): takes the request's pages one chunk at a time, holding
    /// each while waiting for the next (hold and wait: the deadlock's precondition), then gives
    /// them back to reserve the request as a whole. Under contention every request ends up holding
    /// part of the buffer and waiting for pages nobody will free.
    async fn hold_chunk_by_chunk(&self, dec: &Arc<DecoderHandle>, chunks: u32) -> Result<(), GatewayError> {
        let mut held = ChunkHolds { dec: Arc::clone(dec), keys: Vec::new() };
        let give_up = Instant::now() + self.limits.queue_timeout;
        while held.keys.len() < chunks as usize {
            let key = self.keys.next();
            // Marked held before the call, so a client that leaves mid-call still cancels it.
            held.keys.push(key);
            match dec.reserve(key, 1, self.limits.lease, &[]).await {
                Ok(Some(_)) => {}
                Ok(None) if Instant::now() < give_up => {
                    // `reserve` gave back what it got: nothing of `key` is held.
                    held.keys.pop();
                    tokio::time::sleep(RESERVE_BACKOFF).await;
                }
                Ok(None) => {
                    return Err(GatewayError::QueueTimeout(format!(
                        "decoder {} never had the pages",
                        dec.name
                    )));
                }
                Err(e) => {
                    return Err(GatewayError::Upstream { leg: "decoder data plane", message: e.to_string() });
                }
            }
        }
        // Given back one by one, each forgotten only once cancelled: a client that leaves part-way
        // leaves the rest to the guard's Drop.
        while let Some(&k) = held.keys.last() {
            dec.cancel(k, true).await;
            held.keys.pop();
        }
        Ok(())
    }

    /// Runs one request through the handoff and returns the decoder's response, streamed.
    pub async fn run(
        &self,
        prefills: &[&Prefiller],
        dec: &Arc<DecoderHandle>,
        req: &GenRequest,
        ids: &[u32],
        ticket: crate::admission::Ticket,
    ) -> Result<Response<RespBody>, GatewayError> {
        let chunks = dec.slots_for(ids.len());
        let mut timing = Timing::start();
        let slots = if self.unprotected {
            self.hold_chunk_by_chunk(dec, chunks).await?;
            None
        } else {
            Some(
                dec.queue
                    .acquire(chunks, ticket.class, ticket.wait(self.limits.queue_timeout))
                    .await
                    .map_err(admission_error)?,
            )
        };
        timing.mark("queue");
        let mut key = self.keys.next();
        let mut life = Lifecycle {
            dec: Arc::clone(dec),
            key,
            slots,
            rx: None,
            reserved: false,
            sent: false,
            decoded: false,
            released: 0,
            release_timeout: self.limits.release_timeout,
        };

        // Reserve on every rank; a refusal for room (another replica's pages) waits and retries.
        let give_up = Instant::now() + self.limits.queue_timeout;
        let mut backoff = RESERVE_BACKOFF;
        life.rx = Some(dec.listen(key));
        // Marked before the call: a client that leaves while a Reserve frame is in flight must still
        // cancel it (cancel is idempotent), or the pages would wait out the whole lease.
        life.reserved = true;
        let addrs = loop {
            match dec.reserve(key, chunks, self.limits.lease, &[]).await {
                Ok(Some(a)) => break a,
                Ok(None) if Instant::now() < give_up => {
                    // The ranks that had reserved this attempt were cancelled and report the key
                    // as cancelled, possibly after the next attempt succeeded: the next attempt is
                    // a new epoch of the request, so no report of this one can reach it.
                    dec.forget(key);
                    key = RequestKey::new(key.request, key.epoch.wrapping_add(1));
                    life.key = key;
                    life.rx = Some(dec.listen(key));
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                }
                Ok(None) => {
                    return Err(GatewayError::QueueTimeout(format!(
                        "decoder {} had no free pages in time",
                        dec.name
                    )));
                }
                Err(e) => {
                    self.failed(&dec.name, &dec.health);
                    return Err(GatewayError::Upstream { leg: "decoder data plane", message: e.to_string() });
                }
            }
        };
        timing.mark("reserve");

        // Prefill: the engines agree on the token ids; the prefill leg is never streamed.
        let rid = format!("{:032x}", key.request.0);
        let decoders: Vec<Value> = addrs
            .iter()
            .enumerate()
            .map(|(r, a)| {
                let chunks: Vec<Value> = a.iter().map(|(c, p)| json!([c, p.page, p.generation])).collect();
                json!({"rank": r, "addr": dec.ranks.get(r).map(ToString::to_string), "chunks": chunks})
            })
            .collect();
        let mut body = Value::Object(req.raw.clone());
        body["stream"] = json!(false);
        if let Some(o) = body.as_object_mut() {
            o.remove("stream_options");
        }
        body["baton"] =
            json!({"request_id": rid, "epoch": key.epoch, "decoders": decoders, "prompt_token_ids": ids});
        // The first prefiller, then the fallbacks while a prefiller cannot be connected to; one that
        // never saw the addresses leaves the pages free at once (no quarantine).
        let (prefill, resp, in_flight) =
            self.send_prefill(prefills, req.endpoint.path(), &body, &mut life.sent, false).await?;
        if resp.status() != 200 {
            return Err(self.refused("prefill", &prefill.name, &prefill.health, resp).await);
        }
        // The prefill's own answer (one token) is not used; drain it so the connection is reused.
        let _ = resp.into_body().collect().await;
        prefill.health.success();
        drop(in_flight);
        timing.mark("prefill");

        // Every rank must hold the whole KV.
        let deadline = Instant::now() + self.limits.ready_timeout;
        let mut agg = Aggregator::new(key, dec.rank_count(), deadline)
            .map_err(|e| GatewayError::Internal(e.to_string()))?;
        let outcome = loop {
            let Some(rx) = life.rx.as_mut() else {
                return Err(GatewayError::Internal("no event subscription".into()));
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, rx.recv()).await {
                Ok(Some(RankEvent::Status(s))) => match agg.observe(&s, Instant::now()) {
                    Ok(Progress::Done(o)) => break o,
                    Ok(Progress::Pending { .. }) | Err(_) => {}
                },
                Ok(Some(RankEvent::Released(_))) => life.released += 1,
                Ok(None) => return Err(GatewayError::KvTransfer("decoder event feed closed".into())),
                Err(_) => break agg.poll(Instant::now()).unwrap_or(Outcome::TimedOut { missing: 0 }),
            }
        };
        match outcome {
            Outcome::Ready => {}
            Outcome::Failed { rank, state } => {
                return Err(GatewayError::KvTransfer(format!(
                    "decoder rank {rank} reported {}",
                    state.as_str()
                )));
            }
            Outcome::TimedOut { missing } => {
                return Err(GatewayError::KvTransfer(format!(
                    "{missing} decoder ranks did not hold the kv within {:?}",
                    self.limits.ready_timeout
                )));
            }
        }

        timing.mark("kv_ready");

        // Decode, streamed straight back.
        let mut body = Value::Object(req.raw.clone());
        body["baton"] = json!({"request_id": rid, "epoch": key.epoch, "prompt_token_ids": ids});
        let resp = self.post(dec.http, req.endpoint.path(), &body, false).await.map_err(|e| {
            self.failed(&dec.name, &dec.health);
            GatewayError::Upstream { leg: "decode", message: e.message }
        })?;
        if resp.status() != 200 {
            return Err(self.refused("decode", &dec.name, &dec.health, resp).await);
        }
        dec.health.success();
        life.decoded = true;
        drop(life);
        timing.mark("decode");
        self.record(&timing);
        let (mut parts, body) = resp.into_parts();
        if let Ok(v) = hyper::header::HeaderValue::from_str(&timing.header()) {
            parts.headers.insert("server-timing", v);
        }
        Ok(Response::from_parts(parts, body.map_err(|e| Box::new(e) as BoxError).boxed()))
    }
}
