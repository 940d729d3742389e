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

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use baton_dataplane::compat::lmcache::PdMsg;
use baton_dataplane::compat::zmtp::{DEFAULT_MAX_MESSAGE, DEFAULT_MAX_PEERS, PullServer, Pulled};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Response;
use hyper::body::{Body, Frame};
use serde_json::{Value, json};
use smallvec::SmallVec;
use tokio::sync::{mpsc, oneshot};

use super::decoder::DecoderHandle;
use super::{
    BoxError, Drains, HttpClient, Native, Prefiller, RespBody, Timing, admission_error, count_failure,
    post_json, send_drain, short_body,
};
use crate::admission::SlotGuard;
use crate::api::{Endpoint, GatewayError, GenRequest};
use crate::routing::HealthConfig;

/// Where a decoder's LMCache PD backend listens (`pd_peer_host`, `pd_peer_init_port`,
/// `pd_peer_alloc_port` of its LMCache YAML), one port of each per TP rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LmcacheTarget {
    pub receiver_host: String,
    pub init_ports: Vec<u16>,
    pub alloc_ports: Vec<u16>,
}

/// Request fields the prefill leg may not carry over from a chat request (it goes to completions).
const CHAT_ONLY: [&str; 14] = [
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "logprobs",
    "top_logprobs",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
];

/// Counters of the notification listener.
#[derive(Debug, Default)]
pub struct NotifyStats {
    /// A rank's first notification for a request being waited for.
    pub counted: AtomicU64,
    /// A second notification from the same connection for the same request (ignored).
    pub duplicate: AtomicU64,
    /// For no request being waited for (late, after its deadline, or not ours).
    pub unmatched: AtomicU64,
    /// Not a `ProxyNotif`.
    pub malformed: AtomicU64,
}

struct Pending {
    need: usize,
    peers: SmallVec<[u64; 8]>,
    done: Option<oneshot::Sender<()>>,
}

/// The PULL socket LMCache prefillers notify (`pd_proxy_host:pd_proxy_port` in their YAML), and the
/// requests waiting on it.
#[derive(Debug)]
pub struct Notifications {
    pub addr: SocketAddr,
    pub stats: NotifyStats,
    pending: Mutex<HashMap<String, Pending>>,
    server: PullServer,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("need", &self.need).field("peers", &self.peers.len()).finish()
    }
}

impl Drop for Notifications {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Notifications {
    /// Binds the PULL socket on `addr`.
    pub async fn bind(addr: SocketAddr) -> Result<Arc<Self>, String> {
        let (tx, mut rx) = mpsc::channel::<Pulled>(4096);
        let server = PullServer::bind(addr, tx, DEFAULT_MAX_PEERS, DEFAULT_MAX_MESSAGE)
            .await
            .map_err(|e| format!("lmcache notifications on {addr}: {e}"))?;
        Ok(Arc::new_cyclic(|weak: &Weak<Self>| {
            let weak = weak.clone();
            let task = tokio::spawn(async move {
                while let Some(p) = rx.recv().await {
                    let Some(this) = weak.upgrade() else { return };
                    this.observe(&p);
                }
            });
            Self { addr: server.addr, stats: NotifyStats::default(), pending: Mutex::default(), server, task }
        }))
    }

    fn observe(&self, p: &Pulled) {
        let id = match p.frames.as_slice() {
            [one] => match PdMsg::decode(one) {
                Ok(PdMsg::ProxyNotif(n)) => n.req_id,
                _ => {
                    self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            },
            _ => {
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let Some(e) = pending.get_mut(&id) else {
            self.stats.unmatched.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if e.peers.contains(&p.peer) {
            self.stats.duplicate.fetch_add(1, Ordering::Relaxed);
            return;
        }
        e.peers.push(p.peer);
        self.stats.counted.fetch_add(1, Ordering::Relaxed);
        if e.peers.len() >= e.need
            && let Some(tx) = e.done.take()
        {
            let _ = tx.send(());
        }
    }

    /// Starts waiting for `need` notifications of `req_id` (before the prefill is sent, so none is
    /// missed). The registration ends when the returned value is dropped.
    pub fn expect(self: &Arc<Self>, req_id: String, need: usize) -> Expect {
        let (tx, rx) = oneshot::channel();
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.insert(req_id.clone(), Pending { need, peers: SmallVec::new(), done: Some(tx) });
        Expect { hub: Arc::clone(self), req_id, rx: Some(rx), need }
    }

    /// Requests being waited for now.
    pub fn waiting(&self) -> usize {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn listener_stats(&self) -> &baton_dataplane::compat::zmtp::ListenerStats {
        &self.server.stats
    }
}

/// One request's wait for its notifications.
#[derive(Debug)]
pub struct Expect {
    hub: Arc<Notifications>,
    req_id: String,
    rx: Option<oneshot::Receiver<()>>,
    need: usize,
}

impl Drop for Expect {
    fn drop(&mut self) {
        self.hub.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.req_id);
    }
}

impl Expect {
    /// Waits until every rank notified or `deadline`; `Err(got)` with how many did by then.
    pub async fn wait(&mut self, deadline: Instant) -> Result<(), usize> {
        let Some(rx) = self.rx.as_mut() else { return Ok(()) };
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx).await {
            Ok(Ok(())) => {
                self.rx = None;
                Ok(())
            }
            _ => {
                let pending = self.hub.pending.lock().unwrap_or_else(|e| e.into_inner());
                Err(pending.get(&self.req_id).map_or(0, |p| p.peers.len()))
            }
        }
    }

    pub fn need(&self) -> usize {
        self.need
    }
}

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
    client: HttpClient,
    http: SocketAddr,
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
        rt.spawn(async move {
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
            send_drain(&d.client, d.http, "/v1/completions", &body, d.upstream_timeout, &d.counters).await;
            // The slots go back only now: the decoder has retrieved (freed) the chunks.
            drop(slots);
        });
    }
}

/// The prefill leg's answer.
struct PrefillOut {
    first_tok: Option<u32>,
    first_text: String,
    model: Value,
}

/// Streams a channel as a response body.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// Splits an SSE byte stream into `data:` payloads.
#[derive(Default)]
struct SseSplitter {
    buf: Vec<u8>,
}

impl SseSplitter {
    fn push(&mut self, bytes: &[u8], out: &mut Vec<String>) {
        self.buf.extend_from_slice(bytes);
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    out.push(d.trim_start().to_owned());
                }
            }
        }
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Shapes the answer for the client's endpoint.
struct Shaper {
    ep: Endpoint,
    id: String,
    model: Value,
    created: u64,
    prompt_tokens: usize,
    /// Tokens the client got from the prefill (the first token).
    extra: u32,
}

impl Shaper {
    fn chunk(&self, text: &str, finish: &Value) -> Value {
        match self.ep {
            Endpoint::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
            }),
            Endpoint::Chat => json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish}],
            }),
        }
    }

    fn role_chunk(&self) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
        })
    }

    fn usage(&self, decoded: u64) -> Value {
        let completion = decoded + u64::from(self.extra);
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
               "total_tokens": self.prompt_tokens as u64 + completion})
    }

    fn usage_chunk(&self, decoded: u64) -> Value {
        let object = match self.ep {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": self.usage(decoded)})
    }

    fn full(&self, text: &str, finish: &Value, decoded: u64) -> Value {
        match self.ep {
            Endpoint::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
                "usage": self.usage(decoded),
            }),
            Endpoint::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish}],
                "usage": self.usage(decoded),
            }),
        }
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The client's request as a `/v1/completions` body over token ids (chat-only fields dropped).
fn completion_body(req: &GenRequest, ids: &[u32]) -> Value {
    let mut o = req.raw.clone();
    for f in CHAT_ONLY {
        o.remove(f);
    }
    o.insert("prompt".into(), json!(ids));
    Value::Object(o)
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

impl Native {
    /// Runs one request through the `lmcache` handoff.
    pub async fn run_lmcache(
        &self,
        prefills: &[&Prefiller],
        dec: &Arc<DecoderHandle>,
        target: &LmcacheTarget,
        req: &GenRequest,
        ids: &[u32],
        ticket: crate::admission::Ticket,
    ) -> Result<Response<RespBody>, GatewayError> {
        let hub = self.lmcache.as_ref().ok_or_else(|| {
            GatewayError::Internal(
                "lmcache decoder without a notification listener ([lmcache] notify_listen)".into(),
            )
        })?;
        let chunks = dec.slots_for(ids.len());
        let mut timing = Timing::start();
        let slots = dec
            .queue
            .acquire(chunks, ticket.class, ticket.wait(self.limits.queue_timeout))
            .await
            .map_err(admission_error)?;
        timing.mark("queue");
        let req_id = format!("baton-{:032x}", self.keys.next().request.0);
        let mut life = Life {
            slots: Some(slots),
            expect: Some(hub.expect(req_id.clone(), target.alloc_ports.len())),
            sent: false,
            dispatched: false,
            drain: None,
            notify_deadline: None,
        };
        let first_token = self.first_token;
        let base = Arc::new(completion_body(req, ids));
        let mut prefill_body = (*base).clone();
        set_max_tokens(&mut prefill_body, Some(1));
        if let Some(o) = prefill_body.as_object_mut() {
            o.insert("stream".into(), json!(false));
            o.remove("stream_options");
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
            client: self.client.clone(),
            http: dec.http,
            base: Arc::clone(&base),
            upstream_timeout: self.limits.upstream_timeout,
            ready_timeout: self.limits.upstream_timeout + self.limits.ready_timeout,
            counters: Arc::clone(&self.lmcache_drains),
        });

        let (prefill, resp, in_flight) =
            self.send_prefill(prefills, "/v1/completions", &prefill_body, &mut life.sent, true).await?;
        life.notify_deadline = Some(Instant::now() + self.limits.ready_timeout);
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        if status != 200 {
            if status >= 500 {
                self.failed(&prefill.name, &prefill.health);
            }
            return Err(GatewayError::Upstream {
                leg: "prefill",
                message: format!("{status}: {}", short_body(&bytes)),
            });
        }
        prefill.health.success();
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
        timing.mark("prefill");

        // The decode leg: the prompt plus the first token, one token fewer to generate.
        let client_max = req.fields.max_completion_tokens.or(req.fields.max_tokens);
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
        let include_usage = req.fields.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let finished_early = remaining == Some(0);
        let ctx = DecodeCtx {
            client: self.client.clone(),
            dec: Arc::clone(dec),
            health: self.health,
            decode_body,
            upstream_timeout: self.limits.upstream_timeout,
            ready_timeout: self.limits.ready_timeout,
            finished_early,
        };

        if req.fields.stream {
            // Headers and the first token go out now; the rest follows from the decoder.
            let (tx, rx) = mpsc::channel::<Bytes>(32);
            if req.endpoint == Endpoint::Chat {
                let _ = tx.send(sse(&shaper.role_chunk())).await;
            }
            if !first_text.is_empty() {
                let _ = tx.send(sse(&shaper.chunk(&first_text, &Value::Null))).await;
            }
            self.metrics.phase("first_token", timing.total());
            self.record(&timing);
            tokio::spawn(async move {
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
            if let Ok(v) = hyper::header::HeaderValue::from_str(&timing.header()) {
                r.headers_mut().insert("server-timing", v);
            }
            return Ok(r);
        }
        let (text, finish, decoded) = ctx.whole(&mut life).await?;
        timing.mark("decode");
        self.record(&timing);
        let body = shaper.full(&format!("{first_text}{text}"), &finish, decoded);
        let mut r = Response::new(
            Full::new(Bytes::from(body.to_string())).map_err(|e| -> BoxError { match e {} }).boxed(),
        );
        r.headers_mut()
            .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
        if let Ok(v) = hyper::header::HeaderValue::from_str(&timing.header()) {
            r.headers_mut().insert("server-timing", v);
        }
        Ok(r)
    }
}

/// The decode leg of one request.
struct DecodeCtx {
    client: HttpClient,
    dec: Arc<DecoderHandle>,
    health: HealthConfig,
    decode_body: Value,
    upstream_timeout: Duration,
    ready_timeout: Duration,
    /// The prefill's first token was all the client asked for: the decode only drains.
    finished_early: bool,
}

impl DecodeCtx {
    /// Waits for every rank's notification, then sends the decode; the slots go back once the decoder
    /// has taken it.
    async fn dispatch(&self, life: &mut Life) -> Result<Response<hyper::body::Incoming>, GatewayError> {
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
        let dec = &self.dec;
        let resp = post_json(
            &self.client,
            dec.http,
            "/v1/completions",
            &self.decode_body,
            self.upstream_timeout,
            false,
        )
        .await
        .map_err(|e| {
            count_failure(&self.health, &dec.name, &dec.health);
            GatewayError::Upstream { leg: "decode", message: e.message }
        })?;
        // The decoder has the request: it retrieves the KV whatever the status, so no drain is owed.
        life.dispatched = true;
        life.expect = None;
        life.slots = None;
        if resp.status() != 200 {
            let status = resp.status().as_u16();
            if status >= 500 {
                count_failure(&self.health, &dec.name, &dec.health);
            }
            let b = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
            return Err(GatewayError::Upstream {
                leg: "decode",
                message: format!("{status}: {}", short_body(&b)),
            });
        }
        dec.health.success();
        Ok(resp)
    }

    /// Non-streaming: the decoder's text, finish reason and completion tokens.
    async fn whole(&self, life: &mut Life) -> Result<(String, Value, u64), GatewayError> {
        let resp = self.dispatch(life).await?;
        let b = resp
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| GatewayError::Upstream { leg: "decode", message: e.to_string() })?;
        if self.finished_early {
            return Ok((String::new(), json!("length"), 0));
        }
        let v: Value = serde_json::from_slice(&b).map_err(|e| GatewayError::Upstream {
            leg: "decode",
            message: format!("answer is not JSON: {e}"),
        })?;
        let text = v.pointer("/choices/0/text").and_then(Value::as_str).unwrap_or_default().to_owned();
        let finish = v.pointer("/choices/0/finish_reason").cloned().unwrap_or(Value::Null);
        let decoded = v.pointer("/usage/completion_tokens").and_then(Value::as_u64).unwrap_or(0);
        Ok((text, finish, decoded))
    }

    /// Streaming: relays the decoder's completion chunks in the client's shape.
    async fn stream(
        &self,
        life: &mut Life,
        shaper: &Shaper,
        tx: &mpsc::Sender<Bytes>,
        include_usage: bool,
    ) -> Result<(), GatewayError> {
        let resp = self.dispatch(life).await?;
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
                if let Some(c) = v.pointer("/choices/0") {
                    let text = c.get("text").and_then(Value::as_str).unwrap_or_default();
                    let finish = c.get("finish_reason").cloned().unwrap_or(Value::Null);
                    if tx.send(sse(&shaper.chunk(text, &finish))).await.is_err() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_splitter_handles_events_split_anywhere() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut s = SseSplitter::default();
            let mut out = Vec::new();
            s.push(&stream[..cut], &mut out);
            s.push(&stream[cut..], &mut out);
            assert_eq!(out, vec!["{\"a\":1}", "{\"b\":2}", "[DONE]"], "cut at {cut}");
        }
    }
}
