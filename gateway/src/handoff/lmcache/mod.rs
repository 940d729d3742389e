//! The `lmcache` handoff: vLLM with LMCache's PD backend, the prefiller pushing KV into the decoder's
//! PD buffer. The wire follows LMCache's own proxy (`examples/disagg_prefill/disagg_proxy_server.py`,
//! LMCache 0.3.x) and PD backend (`lmcache/v1/storage_backend/pd_backend.py`):
//!
//! 1. admit: `ceil(prompt / chunk_size)` slots of the decoder's `pd_buffer_size / (chunk_size ×
//!    kv_bytes_per_token)`, FIFO per decoder, with the queue deadline;
//! 2. prefill on `/v1/completions` with the token ids, `max_tokens = 1`, and `kv_transfer_params =
//!    {ret_first_tok, disagg_spec: {req_id, receiver_host, receiver_init_port, receiver_alloc_port}}`;
//! 3. wait for one `ProxyNotif{req_id}` per decoder TP rank on the PULL socket, counting each sending
//!    connection once (a duplicate never releases a request early), until `ready_timeout`;
//! 4. decode on `/v1/completions` with the token ids (plus the prefiller's first token), streamed or
//!    not as the client asked, converted back to the client's endpoint and usage.
//!
//! Unlike the original proxy: request ids are unique (`baton-<128 bits>`), every wait has a deadline,
//! slots are released exactly once on every path and only once the decoder has taken the request.
//! If the request ends before its decode was dispatched (client gone, prefill failed, notification
//! late) after the prefiller may have written into the decoder's buffer, the gateway waits out the
//! notifications and then sends a one-token *drain* decode so the decoder retrieves, and so frees,
//! what was written; the slots come back after it. LMCache frees buffer objects only on retrieval.

pub mod notify;
mod shape;

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Response;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::decoder::{BoxFuture, Decoder, Handoff, Leg};
use super::shared::{
    BoxError, Drains, RespBody, Shared, answer_body, count_failure, post_json, refusal, send_drain,
};
use crate::admission::SlotGuard;
use crate::api::sse::{ChannelBody, SseSplitter};
use crate::api::{Endpoint, GatewayError, GenRequest};
use crate::endpoints::{EngineClient, EngineUrl};
use crate::routing::HealthConfig;
use crate::telemetry::request_id;
use crate::telemetry::trace::RequestTrace;
use crate::telemetry::{Live, Metrics, Phase, Scrape, Timing};
pub use notify::{Expect, Notifications, NotifyStats};
use shape::{Shaper, now_secs, sse};

/// The mode's name in the configuration.
pub const MODE: &str = "lmcache";

/// Where a decoder's LMCache PD backend listens (`pd_peer_host`, `pd_peer_init_port`,
/// `pd_peer_alloc_port` of its LMCache YAML), one port of each per TP rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LmcacheTarget {
    pub receiver_host: String,
    pub init_ports: Vec<u16>,
    pub alloc_ports: Vec<u16>,
}

/// An `lmcache` decoder.
#[derive(Debug)]
pub struct Lmcache {
    shared: Arc<Shared>,
    /// The gateway's notification listener (one for every `lmcache` decoder).
    pub hub: Arc<Notifications>,
    pub target: LmcacheTarget,
    /// LMCache's chunk size in tokens: a slot is one chunk of the decoder's PD buffer.
    pub chunk_tokens: u32,
    /// Ask prefillers for the first token (`ret_first_tok`) and send it to the client at once.
    pub first_token: bool,
    /// Drains sent so the decoder frees PD-buffer chunks of requests that never decoded.
    pub drains: Arc<Drains>,
}

impl Lmcache {
    pub fn new(
        shared: Arc<Shared>,
        hub: Arc<Notifications>,
        target: LmcacheTarget,
        chunk_tokens: u32,
        first_token: bool,
    ) -> Self {
        Self { shared, hub, target, chunk_tokens, first_token, drains: Arc::default() }
    }
}

/// Chat request fields the legs do not carry (both go to `/v1/completions` over the prompt's token
/// ids, which the chat template's inputs already made; `logprobs`/`top_logprobs` are converted).
const CHAT_ONLY: [&str; 13] = [
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "logprobs",
    "top_logprobs",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
];

/// What a request holds until its decode is dispatched; released in `Drop` on every path.
struct Life {
    slots: Option<SlotGuard>,
    expect: Option<Expect>,
    /// Set once the prefill may have reached the prefiller: a drain is owed unless the decode runs.
    sent: bool,
    /// Set once the decoder has taken the request.
    dispatched: bool,
    drain: Option<Drain>,
    /// When the prefill answered: the notifications are due by then plus `ready_timeout`.
    notify_deadline: Option<Instant>,
}

/// The one-token decode that makes the decoder retrieve (and free) what a prefiller wrote.
struct Drain {
    client: EngineClient,
    http: EngineUrl,
    /// The request as a completion over the prompt's ids, shared with the prefill; the drain body is
    /// built from it only when a drain is sent.
    base: Arc<Value>,
    upstream_timeout: Duration,
    /// Longest wait for the notifications while the prefill has not answered yet (it is never
    /// aborted): its own deadline plus the notification wait.
    ready_timeout: Duration,
    counters: Arc<Drains>,
}

impl Drop for Life {
    fn drop(&mut self) {
        let (slots, expect, drain) = (self.slots.take(), self.expect.take(), self.drain.take());
        let notify_deadline = self.notify_deadline;
        if self.dispatched || !self.sent {
            return;
        }
        let Some(d) = drain else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(request_id::carry(async move {
            // Let the prefiller finish writing first: a drain that came before the writes would
            // free objects the prefiller is still writing into.
            if let Some(mut e) = expect {
                let _ = e.wait(notify_deadline.unwrap_or_else(|| Instant::now() + d.ready_timeout)).await;
            }
            let mut body = (*d.base).clone();
            set_max_tokens(&mut body, Some(1));
            if let Some(o) = body.as_object_mut() {
                o.insert("stream".into(), json!(false));
                o.remove("stream_options");
            }
            send_drain(&d.client, &d.http, "/v1/completions", &body, d.upstream_timeout, &d.counters).await;
            // The slots go back only now: the decoder has retrieved (freed) the chunks.
            drop(slots);
        }));
    }
}

/// The prefill leg's answer.
struct PrefillOut {
    first_tok: Option<u32>,
    first_text: String,
    model: Value,
}

/// The client's request as a `/v1/completions` body over token ids: chat-only fields dropped, chat's
/// `logprobs: true, top_logprobs: k` as completions' `logprobs: k`; every other field as it came.
fn completion_body(req: &GenRequest, ids: &[u32]) -> Value {
    let mut o = (*req.raw).clone();
    if req.endpoint == Endpoint::Chat {
        let logprobs = (o.get("logprobs").and_then(Value::as_bool) == Some(true))
            .then(|| o.get("top_logprobs").and_then(Value::as_u64).unwrap_or(0));
        for f in CHAT_ONLY {
            o.remove(f);
        }
        if let Some(k) = logprobs {
            o.insert("logprobs".into(), json!(k));
        }
    }
    o.insert("prompt".into(), json!(ids));
    Value::Object(o)
}

/// Whether the answer can start with the prefiller's first token: only for one choice without
/// logprobs (the prefiller samples one sequence and scores nothing the client asked for).
fn first_token_usable(req: &GenRequest) -> bool {
    let n = req.raw.get("n").and_then(Value::as_u64).unwrap_or(1);
    let logprobs = req.raw.get("logprobs").is_some_and(|l| !l.is_null() && *l != json!(false));
    n <= 1 && !logprobs
}

fn set_max_tokens(body: &mut Value, n: Option<u32>) {
    let Some(o) = body.as_object_mut() else { return };
    o.remove("max_completion_tokens");
    match n {
        Some(n) => {
            o.insert("max_tokens".into(), json!(n));
        }
        None => {
            o.remove("max_tokens");
        }
    }
}

impl Lmcache {
    async fn exchange(&self, leg: Leg<'_>) -> Result<Response<RespBody>, GatewayError> {
        let Leg { dec, prefills, req, ids, slots, timing } = leg;
        timing.enter(Phase::Prefill);
        let (shared, target) = (&*self.shared, &self.target);
        let req_id = format!("baton-{:032x}", shared.keys.next().request.0);
        let mut life = Life {
            slots,
            expect: Some(self.hub.expect(req_id.clone(), target.alloc_ports.len())),
            sent: false,
            dispatched: false,
            drain: None,
            notify_deadline: None,
        };
        let first_token = self.first_token && first_token_usable(req);
        let base = Arc::new(completion_body(req, ids));
        let mut prefill_body = (*base).clone();
        set_max_tokens(&mut prefill_body, Some(1));
        if let Some(o) = prefill_body.as_object_mut() {
            o.insert("stream".into(), json!(false));
            o.remove("stream_options");
            // The prefill only writes the KV: one sequence, nothing scored.
            for f in ["n", "best_of", "logprobs", "prompt_logprobs"] {
                o.remove(f);
            }
            o.insert(
                "kv_transfer_params".into(),
                json!({
                    "ret_first_tok": first_token,
                    "disagg_spec": {
                        "req_id": req_id, "receiver_host": target.receiver_host,
                        "receiver_init_port": target.init_ports, "receiver_alloc_port": target.alloc_ports,
                    },
                }),
            );
        }
        life.drain = Some(Drain {
            client: shared.client.clone(),
            http: dec.http.clone(),
            base: Arc::clone(&base),
            upstream_timeout: shared.limits.upstream_timeout,
            ready_timeout: shared.limits.upstream_timeout + shared.limits.ready_timeout,
            counters: Arc::clone(&self.drains),
        });

        let (prefill, resp, in_flight) =
            shared.prefill(prefills, "/v1/completions", &prefill_body, &mut life.sent, true).await?;
        life.notify_deadline = Some(Instant::now() + shared.limits.ready_timeout);
        let bytes = match answer_body(&shared.health, "prefill", &prefill.name, &prefill.health, resp).await {
            Ok(b) => b,
            Err(e @ GatewayError::EngineRefused { .. }) => {
                // vLLM refuses a request (4xx) before scheduling it: nothing was written into the
                // decoder's buffer, so no drain is owed and the slots come back at once.
                life.sent = false;
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        drop(in_flight);
        let out: Value = serde_json::from_slice(&bytes).map_err(|e| GatewayError::Upstream {
            leg: "prefill",
            message: format!("answer is not JSON: {e}"),
        })?;
        let pre = PrefillOut {
            first_tok: if first_token {
                out.pointer("/kv_transfer_params/first_tok")
                    .and_then(Value::as_u64)
                    .and_then(|t| u32::try_from(t).ok())
            } else {
                None
            },
            first_text: out.pointer("/choices/0/text").and_then(Value::as_str).unwrap_or_default().to_owned(),
            model: out.get("model").cloned().unwrap_or_else(|| json!(req.model())),
        };
        if first_token && pre.first_tok.is_none() {
            tracing::warn!(
                prefill = prefill.name,
                "prefill answered without kv_transfer_params.first_tok; decoding from the prompt"
            );
        }
        timing.mark(Phase::Prefill);

        // The decode leg: the prompt plus the first token, one token fewer to generate.
        let client_max = req.fields.max_tokens();
        let extra = u32::from(pre.first_tok.is_some());
        let mut decode_ids = ids.to_vec();
        if let Some(t) = pre.first_tok {
            decode_ids.push(t);
        }
        let remaining = client_max.map(|n| n.saturating_sub(extra));
        let mut decode_body = (*base).clone();
        decode_body["prompt"] = json!(decode_ids);
        set_max_tokens(&mut decode_body, remaining.map(|n| n.max(1)));
        if let Some(o) = decode_body.as_object_mut() {
            o.insert("stream".into(), json!(req.fields.stream));
            if req.fields.stream {
                o.insert("stream_options".into(), json!({"include_usage": true}));
            }
        }
        let prefix = if req.endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
        let shaper = Shaper {
            ep: req.endpoint,
            id: format!("{prefix}-{}", req_id.trim_start_matches("baton-")),
            model: pre.model.clone(),
            created: now_secs(),
            prompt_tokens: ids.len(),
            extra,
        };
        let first_text = if pre.first_tok.is_some() { pre.first_text.clone() } else { String::new() };
        let include_usage = req.fields.include_usage();
        let choices = req.raw.get("n").and_then(Value::as_u64).unwrap_or(1).max(1);
        let finished_early = remaining == Some(0);
        let ctx = DecodeCtx {
            client: shared.client.clone(),
            dec: Arc::clone(dec),
            health: shared.health,
            decode_body,
            upstream_timeout: shared.limits.upstream_timeout,
            ready_timeout: shared.limits.ready_timeout,
            finished_early,
            metrics: Arc::clone(&shared.metrics),
            live: timing.live(),
            trace: timing.trace(),
        };

        if req.fields.stream {
            // Headers and the first token go out now; the rest follows from the decoder.
            let (tx, rx) = mpsc::channel::<Bytes>(32);
            if req.endpoint == Endpoint::Chat {
                let _ = tx.send(sse(&shaper.role_chunk(choices))).await;
            }
            if !first_text.is_empty() {
                let _ = tx.send(sse(&shaper.chunk(&first_text, &Value::Null))).await;
            }
            timing.mark(Phase::FirstToken);
            request_id::spawn(async move {
                let mut life = life;
                let r = ctx.stream(&mut life, &shaper, &tx, include_usage).await;
                if let Err(e) = r {
                    tracing::warn!(error = %e, "lmcache decode failed after the response started");
                    let _ = tx.send(sse(&e.body())).await;
                }
                let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            });
            let mut r = Response::new(ChannelBody(rx).boxed());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/event-stream"),
            );
            r.headers_mut()
                .insert(hyper::header::CACHE_CONTROL, hyper::header::HeaderValue::from_static("no-cache"));
            return Ok(r);
        }
        let decoded = ctx.whole(&mut life, timing).await?;
        timing.mark(Phase::Decode);
        let body = shaper.full(decoded.as_ref(), &first_text);
        let mut r = Response::new(
            Full::new(Bytes::from(body.to_string())).map_err(|e| -> BoxError { match e {} }).boxed(),
        );
        r.headers_mut()
            .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
        Ok(r)
    }
}

impl Handoff for Lmcache {
    fn mode(&self) -> &'static str {
        MODE
    }

    fn shared(&self) -> &Shared {
        &self.shared
    }

    fn slots_for(&self, prompt_tokens: usize) -> u32 {
        u32::try_from(prompt_tokens.div_ceil(self.chunk_tokens.max(1) as usize)).unwrap_or(u32::MAX)
    }

    fn accepts(&self, req: &GenRequest) -> Result<(), GatewayError> {
        // vLLM parses tool calls only on its chat endpoint, and LMCache's PD decode runs on
        // completions over token ids: the calls would come back as plain text.
        if req.endpoint == Endpoint::Chat
            && req.raw.get("tools").and_then(Value::as_array).is_some_and(|t| !t.is_empty())
        {
            return Err(GatewayError::invalid(
                "tools",
                "tool calls are not served by this model's lmcache pool (its decode runs on /v1/completions)",
            ));
        }
        Ok(())
    }

    fn run<'a>(&'a self, leg: Leg<'a>) -> BoxFuture<'a, Result<Response<RespBody>, GatewayError>> {
        Box::pin(self.exchange(leg))
    }

    fn view(&self) -> BoxFuture<'_, Value> {
        Box::pin(async move {
            let t = &self.target;
            json!({"receiver_host": t.receiver_host, "init_ports": t.init_ports, "alloc_ports": t.alloc_ports,
                   "chunk_tokens": self.chunk_tokens, "notifications": self.hub.addr.to_string()})
        })
    }

    fn metrics(&self, decoder: &str, out: &mut Scrape) {
        self.hub.metrics(out);
        self.drains.metrics(decoder, MODE, out);
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The decode leg of one request.
struct DecodeCtx {
    client: EngineClient,
    dec: Arc<Decoder>,
    health: HealthConfig,
    decode_body: Value,
    upstream_timeout: Duration,
    ready_timeout: Duration,
    /// The prefill's first token was all the client asked for: the decode only drains.
    finished_early: bool,
    /// A streamed answer's later phases (the KV wait, the decode) end after the response started.
    metrics: Arc<Metrics>,
    /// The request's in-flight entry: those phases are shown there too.
    live: Option<Arc<Live>>,
    trace: Option<Arc<RequestTrace>>,
}

impl DecodeCtx {
    /// Waits for every rank's notification, then sends the decode; the slots go back once the decoder
    /// has taken it.
    async fn dispatch(
        &self,
        life: &mut Life,
        timing: &mut Timing,
    ) -> Result<Response<hyper::body::Incoming>, GatewayError> {
        timing.enter(Phase::KvReady);
        if let Some(e) = life.expect.as_mut() {
            let need = e.need();
            let deadline = life.notify_deadline.unwrap_or_else(|| Instant::now() + self.ready_timeout);
            e.wait(deadline).await.map_err(|got| {
                GatewayError::KvTransfer(format!(
                    "{got} of {need} prefill ranks reported the kv for decoder {} within {:?}",
                    self.dec.name, self.ready_timeout
                ))
            })?;
        }
        self.metrics.kv_transfer(MODE, timing.mark(Phase::KvReady));
        timing.enter(Phase::Decode);
        let dec = &self.dec;
        let resp = post_json(
            &self.client,
            &dec.http,
            "decode",
            "/v1/completions",
            &self.decode_body,
            self.upstream_timeout,
            false,
        )
        .await
        .map_err(|e| {
            count_failure(&self.health, &dec.name, &dec.health);
            e.on("decode")
        })?;
        // The decoder has the request: it retrieves the KV whatever the status, so no drain is owed.
        life.dispatched = true;
        life.expect = None;
        life.slots = None;
        if resp.status() != 200 {
            let status = resp.status().as_u16();
            let b = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
            return Err(refusal(&self.health, "decode", &dec.name, &dec.health, status, &b));
        }
        dec.health.success();
        Ok(resp)
    }

    /// Non-streaming: the decoder's answer (`None` when it only drained).
    async fn whole(&self, life: &mut Life, timing: &mut Timing) -> Result<Option<Value>, GatewayError> {
        let resp = self.dispatch(life, timing).await?;
        let b = resp
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| GatewayError::Upstream { leg: "decode", message: e.to_string() })?;
        if self.finished_early {
            return Ok(None);
        }
        let v: Value = serde_json::from_slice(&b).map_err(|e| GatewayError::Upstream {
            leg: "decode",
            message: format!("answer is not JSON: {e}"),
        })?;
        Ok(Some(v))
    }

    /// Streaming: relays the decoder's completion chunks in the client's shape.
    async fn stream(
        &self,
        life: &mut Life,
        shaper: &Shaper,
        tx: &mpsc::Sender<Bytes>,
        include_usage: bool,
    ) -> Result<(), GatewayError> {
        // The response started at the first token: the KV wait and the decode are timed from there.
        let mut timing = Timing::tracked(self.live.clone(), self.trace.clone());
        let resp = self.dispatch(life, &mut timing).await?;
        timing.mark(Phase::Decode);
        timing.enter(Phase::Stream);
        self.metrics.record(&timing);
        let mut body = resp.into_body();
        let mut split = SseSplitter::default();
        let mut events = Vec::new();
        let mut decoded = 0u64;
        if self.finished_early {
            let _ = body.collect().await;
            let _ = tx.send(sse(&shaper.chunk("", &json!("length")))).await;
            if include_usage {
                let _ = tx.send(sse(&shaper.usage_chunk(0))).await;
            }
            return Ok(());
        }
        while let Some(frame) = body.frame().await {
            let frame =
                frame.map_err(|e| GatewayError::Upstream { leg: "decode", message: e.to_string() })?;
            let Ok(data) = frame.into_data() else { continue };
            split.push(&data, &mut events);
            for e in events.drain(..) {
                if e == "[DONE]" {
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(&e) else { continue };
                if v.get("choices").and_then(Value::as_array).is_some_and(|c| !c.is_empty()) {
                    if let Some(chunk) = shaper.chunk_of(&v, "")
                        && tx.send(sse(&chunk)).await.is_err()
                    {
                        return Ok(());
                    }
                } else if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    decoded = u.get("completion_tokens").and_then(Value::as_u64).unwrap_or(0);
                }
            }
        }
        if include_usage {
            let _ = tx.send(sse(&shaper.usage_chunk(decoded))).await;
        }
        Ok(())
    }
}
