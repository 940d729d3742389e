//! What the handoff modes share: the engines' HTTP client, the limits and health settings, request
//! ids, the prefill fallback order, engine refusals as errors, drains.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use baton_dataplane::{RequestId, RequestKey};
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use serde::Serialize;
use serde::ser::SerializeMap;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::admission::AdmissionError;
use crate::api::GatewayError;
use crate::endpoints::{EngineClient, EngineUrl};
use crate::routing::{Health, HealthConfig, InFlight};
use crate::telemetry::{Metrics, Scrape};

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

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type RespBody = BoxBody<Bytes, BoxError>;

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

/// What every mode of one gateway shares: the client to the engines, the limits, the health
/// settings, request ids and the metrics.
#[derive(Debug)]
pub struct Shared {
    pub(crate) client: EngineClient,
    pub limits: Limits,
    pub health: HealthConfig,
    pub keys: KeyGen,
    pub metrics: Arc<Metrics>,
}

impl Shared {
    /// Engines by IP, or by name with the system's resolver, `https://` checked against the
    /// system's roots.
    pub fn new(limits: Limits, health: HealthConfig) -> prometheus::Result<Arc<Self>> {
        let client = EngineClient::new(crate::endpoints::Names::default(), None);
        let metrics = Metrics::new(
            crate::telemetry::metrics::DEFAULT_TENANT_SERIES,
            crate::telemetry::metrics::DEFAULT_RECORDS,
        )?;
        Ok(Self::with_client(limits, health, client, Arc::new(metrics)))
    }

    /// With `client` (`[resolver]`, `[engine_tls]`) and `metrics`.
    pub fn with_client(
        limits: Limits,
        health: HealthConfig,
        client: EngineClient,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        Arc::new(Self { client, limits, health, keys: KeyGen::default(), metrics })
    }

    /// POSTs `body` within the upstream timeout.
    pub(crate) async fn post<B: Serialize + ?Sized>(
        &self,
        to: &EngineUrl,
        leg: &'static str,
        path: &str,
        body: &B,
    ) -> Result<Response<hyper::body::Incoming>, PostError> {
        post_json(&self.client, to, leg, path, body, self.limits.upstream_timeout, false).await
    }

    /// [`prefill_in_turn`] with this gateway's client, deadline and health settings.
    pub(crate) async fn prefill<'a, B: Serialize + Sync + ?Sized>(
        &self,
        prefills: &'a [&'a Prefiller],
        path: &str,
        body: &B,
        sent: &mut bool,
        detach: bool,
    ) -> Result<(&'a Prefiller, Response<hyper::body::Incoming>, InFlight<'a>), GatewayError> {
        let timeout = self.limits.upstream_timeout;
        prefill_in_turn(&self.client, timeout, &self.health, prefills, path, body, sent, detach).await
    }

    /// Counts a failure against an endpoint (passive health).
    pub(crate) fn failed(&self, name: &str, h: &Health) {
        count_failure(&self.health, name, h);
    }

    /// An engine's non-200 answer as the client's error; a 5xx counts against the engine.
    pub(crate) async fn refused(
        &self,
        leg: &'static str,
        name: &str,
        health: &Health,
        resp: Response<hyper::body::Incoming>,
    ) -> GatewayError {
        let status = resp.status().as_u16();
        let b = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        refusal(&self.health, leg, name, health, status, &b)
    }

    /// `GET /health` answered 200 within `timeout`.
    pub async fn health_check(&self, to: &EngineUrl, timeout: Duration) -> bool {
        let Ok(req) = Request::get(to.uri("/health")).body(Full::new(Bytes::new())) else {
            return false;
        };
        match tokio::time::timeout(timeout, self.client.send(to, req)).await {
            Ok(Ok(r)) => {
                let ok = r.status() == 200;
                let _ = r.into_body().collect().await;
                ok
            }
            _ => false,
        }
    }
}

/// The client's request as an engine leg's body: its fields in their order, some replaced or added
/// (`set`, already JSON) and some left out, written straight from the request without copying it.
/// (In the proxy benchmark's profile the NIXL exchange, mostly copying the request's map three
/// times and building the legs' values, was 14.7% of the gateway's CPU samples.)
pub(crate) struct Patched<'a> {
    base: &'a Map<String, Value>,
    set: smallvec::SmallVec<[(&'static str, Box<RawValue>); 8]>,
    omit: &'a [&'a str],
}

impl<'a> Patched<'a> {
    /// `base` as it is, less the fields in `omit`.
    pub(crate) fn new(base: &'a Map<String, Value>, omit: &'a [&'a str]) -> Self {
        Self { base, set: smallvec::SmallVec::new(), omit }
    }

    /// `field` is `value`: in the request's place if it has one, else after its fields. A value
    /// that cannot be written as JSON (none of the gateway's) is written as `null`.
    pub(crate) fn set(mut self, field: &'static str, value: &(impl Serialize + ?Sized)) -> Self {
        let v = serde_json::value::to_raw_value(value)
            .unwrap_or_else(|_| serde_json::value::to_raw_value(&()).unwrap_or_default());
        match self.set.iter_mut().find(|(f, _)| *f == field) {
            Some(slot) => slot.1 = v,
            None => self.set.push((field, v)),
        }
        self
    }

    /// Leaves out the fields in `omit` instead of those given to [`Patched::new`].
    pub(crate) fn omit(mut self, omit: &'a [&'a str]) -> Self {
        self.omit = omit;
        self
    }

    /// [`Patched::set`] only where the request has the field.
    pub(crate) fn replace(self, field: &'static str, value: &(impl Serialize + ?Sized)) -> Self {
        if self.base.contains_key(field) { self.set(field, value) } else { self }
    }
}

impl Serialize for Patched<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        for (k, v) in self.base {
            if self.omit.contains(&k.as_str()) {
                continue;
            }
            match self.set.iter().find(|(f, _)| *f == k) {
                Some((_, new)) => m.serialize_entry(k, new)?,
                None => m.serialize_entry(k, v)?,
            }
        }
        for (f, v) in &self.set {
            if !self.base.contains_key(*f) || self.omit.contains(f) {
                m.serialize_entry(f, v)?;
            }
        }
        m.end()
    }
}

/// POSTs `body` as JSON within `timeout`. `detach`: the call runs to its end even if the caller
/// stops waiting (a client that leaves does not abort an engine mid-transfer).
///
/// `leg` (`prefill`, `decode`, `drain`, `abort`) names the call in the request's trace: a traced
/// request's call is a span of its own, whose `traceparent` the engine gets.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn post_json<B: Serialize + ?Sized>(
    client: &EngineClient,
    to: &EngineUrl,
    leg: &'static str,
    path: &str,
    body: &B,
    timeout: Duration,
    detach: bool,
) -> Result<Response<hyper::body::Incoming>, PostError> {
    let mut req = Request::post(to.uri(path)).header(hyper::header::CONTENT_TYPE, "application/json");
    // Every engine call made for a request names it, as vLLM's and SGLang's proxies do.
    if let Some(id) = crate::telemetry::request_id::current() {
        req = req.header(crate::telemetry::request_id::HEADER, id.as_str());
    }
    let span = match (crate::telemetry::trace::current(), req.headers_mut()) {
        (Some(t), Some(h)) => Some(t.leg(leg, to, path, h)),
        _ => None,
    };
    // `to_vec` writes straight into the buffer; `to_string` goes through `fmt::Write` a piece at a
    // time, which cost 15% of the gateway's CPU with a 1,024-token `prompt_token_ids` (the proxy
    // benchmark's profile).
    let bytes = serde_json::to_vec(body).map_err(|e| PostError {
        message: format!("request body: {e}"),
        unsent: true,
        timed_out: None,
    })?;
    let req = req.body(Full::new(Bytes::from(bytes))).map_err(|e| PostError {
        message: e.to_string(),
        unsent: true,
        timed_out: None,
    })?;
    let answer = if detach {
        let (client, to) = (client.clone(), to.clone());
        let call = async move { tokio::time::timeout(timeout, client.send(&to, req)).await };
        tokio::spawn(call).await.map_err(|e| PostError {
            message: format!("upstream call task: {e}"),
            unsent: false,
            timed_out: None,
        })?
    } else {
        tokio::time::timeout(timeout, client.send(to, req)).await
    };
    let answer = match answer {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(PostError { message: e.to_string(), unsent: e.is_connect(), timed_out: None }),
        Err(_) => Err(PostError {
            message: format!("no answer within {timeout:?}"),
            unsent: false,
            timed_out: Some(timeout),
        }),
    };
    if let Some(span) = span {
        match &answer {
            Ok(r) => span.answered(r.status().as_u16()),
            Err(e) => span.failed(if e.timed_out.is_some() { "timeout" } else { "error" }, &e.message),
        }
    }
    answer
}

/// An upstream call that got no response.
#[derive(Debug)]
pub(crate) struct PostError {
    pub(crate) message: String,
    /// The request never left (no connection): the engine cannot have seen it.
    pub(crate) unsent: bool,
    /// No answer within this limit.
    pub(crate) timed_out: Option<Duration>,
}

impl PostError {
    /// The client's error for a call on `leg` that got no response: a 504 when it timed out, else
    /// a 502.
    pub(crate) fn on(self, leg: &'static str) -> GatewayError {
        match self.timed_out {
            Some(limit) => GatewayError::UpstreamTimeout { leg, limit },
            None => GatewayError::Upstream { leg, message: self.message },
        }
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

impl Drains {
    /// Adds `baton_drains_total{decoder,mode,result}`.
    pub(crate) fn metrics(&self, decoder: &str, mode: &str, out: &mut Scrape) {
        for (result, c) in
            [("sent", &self.sent), ("already_free", &self.already_free), ("failed", &self.failed)]
        {
            out.counter(
                "baton_drains_total",
                "One-token decodes sent for requests that ended between prefill and decode, by result.",
                &[("decoder", decoder), ("mode", mode), ("result", result)],
                c.load(Ordering::Relaxed) as f64,
            );
        }
    }
}

/// Sends a drain decode and drops its answer.
pub(crate) async fn send_drain<B: Serialize + ?Sized>(
    client: &EngineClient,
    decoder: &EngineUrl,
    path: &str,
    body: &B,
    timeout: Duration,
    counters: &Drains,
) {
    counters.sent.fetch_add(1, Ordering::Relaxed);
    let status = match post_json(client, decoder, "drain", path, body, timeout, false).await {
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
pub(crate) async fn prefill_in_turn<'a, P: std::borrow::Borrow<Prefiller>, B: Serialize + Sync + ?Sized>(
    client: &EngineClient,
    timeout: Duration,
    health: &HealthConfig,
    prefills: &'a [P],
    path: &str,
    body: &B,
    sent: &mut bool,
    detach: bool,
) -> Result<(&'a Prefiller, Response<hyper::body::Incoming>, InFlight<'a>), GatewayError> {
    for (attempt, prefill) in prefills.iter().map(std::borrow::Borrow::borrow).enumerate() {
        *sent = true;
        let in_flight = prefill.health.start();
        match post_json(client, &prefill.http, "prefill", path, body, timeout, detach).await {
            Ok(resp) => return Ok((prefill, resp, in_flight)),
            Err(e) => {
                count_failure(health, &prefill.name, &prefill.health);
                *sent = !e.unsent;
                if !e.unsent || attempt + 1 >= prefills.len() {
                    return Err(e.on("prefill"));
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

/// A task aborted when this is dropped (with what owns it: a decoder, a request).
#[derive(Debug)]
pub struct AbortOnDrop<T = ()>(pub tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A prefill engine.
#[derive(Clone, Debug)]
pub struct Prefiller {
    pub name: String,
    pub http: EngineUrl,
    pub health: Arc<Health>,
}

impl Prefiller {
    pub fn new(name: String, http: impl Into<EngineUrl>) -> Self {
        Self { name, http: http.into(), health: Arc::default() }
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

pub(crate) fn admission_error(e: AdmissionError) -> GatewayError {
    match e {
        AdmissionError::TooLarge { need, capacity } => GatewayError::TooLarge { need, capacity },
        e @ AdmissionError::QueueFull { .. } => GatewayError::QueueFull(e.to_string()),
        e @ AdmissionError::Timeout { .. } => GatewayError::QueueTimeout(e.to_string()),
    }
}

/// An engine's refusal (`status` is not 200) as the client's error; a 5xx counts against the
/// engine.
pub(crate) fn refusal(
    cfg: &HealthConfig,
    leg: &'static str,
    name: &str,
    health: &Health,
    status: u16,
    body: &[u8],
) -> GatewayError {
    if status >= 500 {
        count_failure(cfg, name, health);
    }
    engine_error(leg, status, body)
}

/// An engine's whole answer: its body when it said 200 (a success for the engine), else its
/// refusal as the client's error.
pub(crate) async fn answer_body(
    cfg: &HealthConfig,
    leg: &'static str,
    name: &str,
    health: &Health,
    resp: Response<hyper::body::Incoming>,
) -> Result<Bytes, GatewayError> {
    let status = resp.status().as_u16();
    let b = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    if status != 200 {
        return Err(refusal(cfg, leg, name, health, status, &b));
    }
    health.success();
    Ok(b)
}

/// An engine's non-200 answer as the client's error: a 4xx keeps its status and the engine's OpenAI
/// error body (one is made from its text when it sent none); anything else is the gateway's 502.
pub(crate) fn engine_error(leg: &'static str, status: u16, body: &[u8]) -> GatewayError {
    if !(400..500).contains(&status) {
        return GatewayError::Upstream { leg, message: format!("{status}: {}", short_body(body)) };
    }
    let body = match serde_json::from_slice::<Value>(body) {
        Ok(v) if v.get("error").is_some_and(Value::is_object) => v,
        _ => serde_json::json!({"error": {"message": short_body(body), "type": "invalid_request_error",
                                          "param": null, "code": "engine_refused"}}),
    };
    GatewayError::EngineRefused { leg, status, body }
}

/// A short prefix of an engine's answer for an error message.
pub(crate) fn short_body(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    s.chars().take(300).collect()
}

/// An engine answer's body as the gateway's.
pub(crate) fn boxed(body: hyper::body::Incoming) -> RespBody {
    body.map_err(|e| Box::new(e) as BoxError).boxed()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    /// A patched body is what cloning the map and inserting and removing its fields gives, in
    /// the same order, byte for byte.
    #[test]
    fn a_patched_body_is_the_edited_request() {
        let raw = map(json!({"model": "m", "prompt": "a \"quoted\"\nprompt", "stream": true,
                             "stream_options": {"include_usage": true}, "max_tokens": 50, "n": 1}));
        let omit = ["stream_options", "min_tokens"];
        let patched = Patched::new(&raw, &omit)
            .set("stream", &false)
            .set("kv_transfer_params", &json!({"do_remote_decode": true}))
            .set("max_tokens", &7)
            .set("max_tokens", &1)
            .replace("max_completion_tokens", &1)
            .replace("n", &2);
        let mut edited = raw.clone();
        edited.insert("stream".into(), json!(false));
        edited.insert("kv_transfer_params".into(), json!({"do_remote_decode": true}));
        edited.insert("max_tokens".into(), json!(1));
        edited.insert("n".into(), json!(2));
        // (`shift_remove`: `remove` would move the last field into the hole.)
        edited.shift_remove("stream_options");
        assert_eq!(
            serde_json::to_string(&patched).unwrap_or_default(),
            serde_json::to_string(&edited).unwrap_or_default()
        );
        // A field both set and left out is set (after the request's fields).
        let both = Patched::new(&raw, &["stream"]).set("stream", &false);
        assert_eq!(
            serde_json::to_value(&both).unwrap_or_default(),
            json!({"model": "m", "prompt": "a \"quoted\"\nprompt", "stream_options": {"include_usage": true},
                   "max_tokens": 50, "n": 1, "stream": false})
        );
        let keys: Vec<String> =
            serde_json::from_slice::<Map<String, Value>>(&serde_json::to_vec(&both).unwrap_or_default())
                .unwrap_or_default()
                .keys()
                .cloned()
                .collect();
        assert_eq!(keys.last().map(String::as_str), Some("stream"));
    }
}
