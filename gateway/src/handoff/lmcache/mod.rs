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
//!    not as the client asked, converted back to the client's endpoint and usage. When the
//!    prefiller's first token is all the client asked for (`max_tokens` 1), the client is answered
//!    at once and this decode is the drain below, sent after the answer
//!    (`baton_drains_after_answer_total`).
//!
//! Unlike the original proxy: request ids are unique (`baton-<128 bits>`), every wait has a deadline,
//! slots are released exactly once on every path and only once the decoder has taken the request.
//! If the request ends before its decode was dispatched (client gone, prefill failed, notification
//! late) after the prefiller may have written into the decoder's buffer, the gateway waits out the
//! notifications and then sends a one-token *drain* decode so the decoder retrieves, and so frees,
//! what was written; the slots come back after it. LMCache frees buffer objects only on retrieval.

pub mod keys;
pub mod notify;
mod shape;
pub mod tools;

use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Response;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::decoder::{BoxFuture, Decoder, Handoff, Leg};
use super::legs::{
    BoxError, Drains, Encoded, IdsText, LegError, Patched, RespBody, Retrying, encode, hex_name,
};
use super::shared::Shared;
use super::{CheckContext, ModeSpec, Pool, PoolKeys};
use super::{KeyError, StartContext, StartError};
use crate::admission::SlotGuard;
use crate::api::sse::{ChannelBody, SseSplitter};
use crate::api::{Endpoint, GatewayError, GenRequest, KvFailure, Object};
use crate::endpoints::EngineUrl;
use crate::telemetry::{Later, Phase, Scrape, Timing};
use keys::check_lmcache;
pub use keys::{CheckedLmcache, LmcachePool};
pub use notify::{Expect, Notifications, NotifyStats};
use shape::{Shaper, now_secs, sse};

/// Where a decoder's LMCache PD backend listens (`pd_peer_host`, `pd_peer_init_port`,
/// `pd_peer_alloc_port` of its LMCache YAML), one port of each per TP rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LmcacheTarget {
    pub receiver_host: String,
    pub init_ports: Vec<u16>,
    pub alloc_ports: Vec<u16>,
}

/// `handoff = "lmcache"`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Keys {
    /// The decoder's PD backend: its YAML, or its ports and buffer size.
    pub lmcache: LmcachePool,
    /// Lowers the slots the PD buffer holds (never raises them).
    pub max_slots: Option<u32>,
}

/// An `lmcache` pool, checked.
#[derive(Clone, Debug)]
pub struct Checked {
    pub lmcache: CheckedLmcache,
    pub geometry: baton_dataplane::KvGeometry,
    pub max_slots: Option<u32>,
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
    /// Drains sent after the client was answered from the prefiller's first token alone (its
    /// `max_tokens` was one): the decode the client no longer waits for.
    pub after_answer: Arc<Drains>,
    /// How tool calls are read out of the decoder's text (`[lmcache] tool_call_parser`).
    pub tool_parser: Option<tools::ToolParser>,
}

impl PoolKeys for Keys {
    type Checked = Checked;

    fn check(&self, cx: &CheckContext<'_>) -> Result<Checked, KeyError> {
        let field = format!("{}.lmcache", cx.field);
        let lm = check_lmcache(&field, &self.lmcache, cx.path, cx.model_chunk, cx.geometry_for)?;
        let tp = u32::try_from(lm.target.alloc_ports.len()).unwrap_or(u32::MAX);
        Ok(Checked { geometry: cx.geometry(tp)?, lmcache: lm, max_slots: cx.max_slots(self.max_slots)? })
    }
}

impl ModeSpec for Lmcache {
    const NAME: &'static str = "lmcache";
    const SHARING: super::Sharing = super::Sharing::Single;
    const NOTIFICATIONS: bool = true;
    type Keys = Keys;

    fn describe(c: &Checked) -> String {
        let lm = &c.lmcache;
        format!(
            "receiver {} init {:?} alloc {:?}, {} chunk slots ({} bytes per rank / {} tokens × {} KV bytes per token / TP {})",
            lm.target.receiver_host,
            lm.target.init_ports,
            lm.target.alloc_ports,
            lm.capacity,
            lm.pd_buffer_size,
            lm.chunk_size,
            c.geometry.kv_bytes_per_token(),
            lm.target.alloc_ports.len()
        )
    }

    async fn start(c: Checked, pool: Pool<'_>, ctx: &StartContext) -> Result<Box<dyn Handoff>, StartError> {
        let hub = ctx.lmcache.clone().ok_or_else(|| StartError::Decoder {
            decoder: pool.name.to_owned(),
            reason: "lmcache decoder without a notification listener ([lmcache] notify_listen)".into(),
        })?;
        let lm = c.lmcache;
        pool.queue.resize(c.max_slots.map_or(lm.capacity, |m| m.min(lm.capacity)));
        Ok(Box::new(Lmcache {
            shared: Arc::clone(&ctx.shared),
            hub,
            target: lm.target,
            chunk_tokens: lm.chunk_size,
            first_token: ctx.first_token,
            drains: Arc::default(),
            after_answer: Arc::default(),
            tool_parser: ctx.tool_call_parser,
        }))
    }

    #[cfg(feature = "demo")]
    fn sim(s: super::SimSetup<'_>) {
        let e = &mut *s.engine;
        e.lmcache = Some(match e.role {
            baton_sim::SimRole::Prefill => baton_sim::LmcacheSimConfig {
                proxy: s.notify,
                async_send: s.lmcache_async_send,
                ..baton_sim::LmcacheSimConfig::default()
            },
            baton_sim::SimRole::Decode => baton_sim::LmcacheSimConfig {
                pd_buffer_bytes: u64::from(s.pages) * e.geometry.page_bytes_per_rank(),
                ..baton_sim::LmcacheSimConfig::default()
            },
        });
    }

    #[cfg(feature = "demo")]
    fn demo(d: &super::DemoDecoder<'_>) -> Checked {
        let ranks = d.stats["lmcache"]["ranks"].as_array().cloned().unwrap_or_default();
        let port =
            |v: &Value| v.as_str().and_then(|a| a.parse::<std::net::SocketAddr>().ok()).map(|a| a.port());
        let capacity = ranks
            .iter()
            .filter_map(|r| r["capacity_chunks"].as_u64())
            .min()
            .map_or(0, |c| u32::try_from(c).unwrap_or(u32::MAX));
        let target = LmcacheTarget {
            receiver_host: "127.0.0.1".into(),
            init_ports: ranks.iter().filter_map(|r| port(&r["init_addr"])).collect(),
            alloc_ports: ranks.iter().filter_map(|r| port(&r["alloc_addr"])).collect(),
        };
        let chunk_size = d.geometry.chunk_tokens;
        let pd_buffer_size = u64::from(capacity) * d.geometry.page_bytes_per_rank();
        let lmcache = CheckedLmcache { target, capacity, chunk_size, pd_buffer_size };
        Checked { lmcache, geometry: d.geometry, max_slots: None }
    }
}

/// Chat request fields the legs do not carry (both go to `/v1/completions` over the prompt's token
/// ids, which the chat template's inputs already made; `logprobs`/`top_logprobs` are converted).
const CHAT_ONLY: &[&str] = &[
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

/// Fields the prefill leg leaves out: it writes the KV for one sequence, scores nothing, answers
/// one token unstreamed.
const PREFILL_OMIT: &[&str] =
    &["max_completion_tokens", "stream_options", "n", "best_of", "logprobs", "prompt_logprobs"];
/// Fields a drain leaves out: one token, unstreamed.
const DRAIN_OMIT: &[&str] = &["max_completion_tokens", "stream_options"];
/// A streamed decode's `stream_options`: written once.
static INCLUDE_USAGE: std::sync::LazyLock<Box<RawValue>> = std::sync::LazyLock::new(|| {
    RawValue::from_string(r#"{"include_usage":true}"#.to_owned()).unwrap_or_default()
});

/// Fields the decode leg leaves out (`max_tokens` is set from the client's count).
const DECODE_OMIT: &[&str] = &["max_completion_tokens"];
/// The same when the client set no count (a `max_tokens: null` is left out: vLLM reads a missing
/// count as its default, a null one as "up to the context").
const DECODE_OMIT_UNCOUNTED: &[&str] = &["max_completion_tokens", "max_tokens"];

/// The client's request as a `/v1/completions` body over token ids: chat-only fields dropped, chat's
/// `logprobs: true, top_logprobs: k` as completions' `logprobs: k`; every other field as it came.
#[derive(Debug)]
struct OverIds {
    raw: Arc<Object>,
    chat: bool,
    /// Chat's `top_logprobs` when it asked for logprobs.
    logprobs: Option<u64>,
    /// The prompt's ids, written once for every leg.
    ids: IdsText,
}

impl OverIds {
    fn new(req: &GenRequest, ids: &[u32]) -> Self {
        let chat = req.endpoint == Endpoint::Chat;
        let logprobs = (chat && req.raw.get("logprobs").and_then(Value::as_bool) == Some(true))
            .then(|| req.raw.get("top_logprobs").and_then(Value::as_u64).unwrap_or(0));
        Self { raw: Arc::clone(&req.raw), chat, logprobs, ids: IdsText::new(ids) }
    }

    /// The body over the prompt's ids and `then` after them (the prefiller's first token),
    /// less `omit`; `scored`: the client's logprobs asked for.
    fn body<'a>(&'a self, then: Option<u32>, omit: &'a [&'a str], scored: bool) -> Patched<'a> {
        let body = Patched::new(&self.raw, if self.chat { CHAT_ONLY } else { &[] })
            .also_omit(omit)
            .ids("prompt", &self.ids, then);
        match self.logprobs.filter(|_| scored) {
            Some(k) => body.set("logprobs", &k),
            None => body,
        }
    }
}

/// The prefill leg's `kv_transfer_params`: where the prefiller sends the KV, under which id, and
/// whether it answers with the first token (written from borrowed fields, not built as a map).
#[derive(serde::Serialize)]
struct PrefillParams<'a> {
    ret_first_tok: bool,
    disagg_spec: DisaggSpec<'a>,
}

#[derive(serde::Serialize)]
struct DisaggSpec<'a> {
    req_id: &'a str,
    receiver_host: &'a str,
    receiver_init_port: &'a [u16],
    receiver_alloc_port: &'a [u16],
}

/// What a request holds until its decode is dispatched; released in `Drop` on every path.
struct Holding {
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
    shared: Arc<Shared>,
    http: EngineUrl,
    /// The request over the prompt's ids, shared with the prefill; the drain body is written from
    /// it only when a drain is sent.
    over: Arc<OverIds>,
    counters: Arc<Drains>,
}

impl Drop for Holding {
    fn drop(&mut self) {
        let (slots, expect, drain) = (self.slots.take(), self.expect.take(), self.drain.take());
        let notify_deadline = self.notify_deadline;
        if self.dispatched || !self.sent {
            return;
        }
        let Some(d) = drain else { return };
        let shared = Arc::clone(&d.shared);
        shared.spawn_from_drop(async move {
            // Let the prefiller finish writing first: a drain that came before the writes would
            // free objects the prefiller is still writing into. While the prefill has not answered
            // (it is never aborted), its own deadline plus the notification wait.
            if let Some(mut e) = expect {
                let limits = &d.shared.limits;
                let longest = limits.upstream_timeout + limits.ready_timeout;
                let _ = e.wait(notify_deadline.unwrap_or_else(|| Instant::now() + longest)).await;
            }
            let body = d.over.body(None, DRAIN_OMIT, true).count("max_tokens", 1).flag("stream", false);
            // The slots go back only now: the decoder has retrieved (freed) the chunks.
            let mut slots = slots;
            d.shared.drain(&d.http, "/v1/completions", &body, &d.counters, &mut slots).await;
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

/// What the prefill's answer is read for, its other fields skipped unread. Each is taken apart
/// on its own, so one of an unexpected shape is only missing (as a `Value`'s lookups had it), and
/// the answer is not first built as a `Value` (a map, and a string for each key and text in it).
/// An answer with one of these keys twice is refused (a `Value` kept the last); no engine writes one.
#[derive(serde::Deserialize, Default)]
struct PrefillAnswer<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    choices: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
}

impl<'a> PrefillAnswer<'a> {
    /// The answer's fields; none from JSON that is not an object (serde would read the struct
    /// from an array too).
    fn read(answer: &'a [u8]) -> Result<Self, serde_json::Error> {
        if answer.trim_ascii_start().starts_with(b"{") {
            serde_json::from_slice(answer)
        } else {
            serde_json::from_slice::<serde::de::IgnoredAny>(answer).map(|_| Self::default())
        }
    }

    /// `kv_transfer_params.first_tok`, when it is a token id.
    fn first_tok(&self) -> Option<u32> {
        #[derive(serde::Deserialize)]
        struct Params {
            first_tok: Option<u32>,
        }
        object::<Params>(self.kv_transfer_params?)?.first_tok
    }

    /// `choices[0].text`, or empty: read in one pass over the array (the first choice was cut out
    /// as a `RawValue`, then read again: 3,000 instructions a request,
    /// `scripts/count-instructions lmcache`).
    fn first_text(&self) -> String {
        let first = |c: &RawValue| serde_json::from_str::<First<Text>>(c.get()).ok()?.0?.0;
        self.choices.and_then(first).unwrap_or_default()
    }
}

/// A choice's `text`, from an object only (serde would read a struct from an array too); an error
/// when the key is there twice or is not a string or `null`, as the struct's derive gave.
struct Text(Option<String>);

impl<'de> serde::Deserialize<'de> for Text {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Map;
        impl<'de> serde::de::Visitor<'de> for Map {
            type Value = Text;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Text, A::Error> {
                let mut text: Option<Option<std::borrow::Cow<'de, str>>> = None;
                while let Some(key) = a.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key != "text" {
                        a.next_value::<serde::de::IgnoredAny>()?;
                    } else if text.is_some() {
                        return Err(serde::de::Error::duplicate_field("text"));
                    } else {
                        text = Some(a.next_value()?);
                    }
                }
                Ok(Text(text.flatten().map(std::borrow::Cow::into_owned)))
            }
        }
        d.deserialize_map(Map)
    }
}

/// `raw` read as a `T` when it is an object (serde would read a struct from an array too).
fn object<'a, T: serde::Deserialize<'a>>(raw: &'a RawValue) -> Option<T> {
    raw.get().starts_with('{').then(|| serde_json::from_str(raw.get()).ok()).flatten()
}

/// A JSON array's first element, the rest skipped.
struct First<T>(Option<T>);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for First<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Seq<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for Seq<T> {
            type Value = First<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<First<T>, A::Error> {
                let first = a.next_element()?;
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(First(first))
            }
        }
        d.deserialize_seq(Seq(std::marker::PhantomData))
    }
}

/// A chat whose tools the model may call (`tools` given, `tool_choice` not `none`).
fn with_tools(req: &GenRequest) -> bool {
    req.endpoint == Endpoint::Chat
        && req.raw.get("tools").and_then(Value::as_array).is_some_and(|t| !t.is_empty())
        && req.raw.get("tool_choice").and_then(Value::as_str) != Some("none")
}

/// Whether the answer can start with the prefiller's first token: only for one choice without
/// logprobs (the prefiller samples one sequence and scores nothing the client asked for).
fn first_token_usable(req: &GenRequest) -> bool {
    let n = req.raw.get("n").and_then(Value::as_u64).unwrap_or(1);
    let logprobs = req.raw.get("logprobs").is_some_and(|l| !l.is_null() && *l != json!(false));
    n <= 1 && !logprobs
}

impl Lmcache {
    async fn exchange(&self, leg: Leg<'_>) -> Result<Response<RespBody>, GatewayError> {
        let Leg { dec, prefills, req, ids, slots, timing, work, retried, .. } = leg;
        timing.enter(Phase::Prefill);
        let (shared, target) = (&*self.shared, &self.target);
        let req_id = hex_name("baton-", shared.keys.next().request.0);
        let mut holding = Holding {
            slots,
            expect: Some(self.hub.expect(req_id.clone(), target.alloc_ports.len())),
            sent: false,
            dispatched: false,
            drain: None,
            notify_deadline: None,
        };
        let first_token = self.first_token && first_token_usable(req);
        let over = Arc::new(OverIds::new(req, ids));
        let prefill_body =
            over.body(None, PREFILL_OMIT, false).count("max_tokens", 1).flag("stream", false).set(
                "kv_transfer_params",
                &PrefillParams {
                    ret_first_tok: first_token,
                    disagg_spec: DisaggSpec {
                        req_id: &req_id,
                        receiver_host: &target.receiver_host,
                        receiver_init_port: &target.init_ports,
                        receiver_alloc_port: &target.alloc_ports,
                    },
                },
            );
        holding.drain = Some(Drain {
            shared: Arc::clone(&self.shared),
            http: dec.http.clone(),
            over: Arc::clone(&over),
            counters: Arc::clone(&self.drains),
        });

        let pre = self.prefill(prefills, &prefill_body, &mut holding, first_token, req, retried).await;
        drop(work);
        let pre = pre?;
        timing.mark(Phase::Prefill);

        // The decode leg: the prompt plus the first token, one token fewer to generate.
        let client_max = req.fields.max_tokens();
        let extra = u32::from(pre.first_tok.is_some());
        let remaining = client_max.map(|n| n.saturating_sub(extra));
        let omit = if remaining.is_some() { DECODE_OMIT } else { DECODE_OMIT_UNCOUNTED };
        // With tools the answer is parsed whole (a call is known once its text has ended): the
        // decode is not streamed, and a streamed answer is sent in one piece at its end.
        let parse = self.tool_parser.filter(|_| with_tools(req));
        let stream_decode = req.fields.stream && parse.is_none();
        let mut decode_body = over.body(pre.first_tok, omit, true).flag("stream", stream_decode);
        if let Some(n) = remaining {
            decode_body = decode_body.count("max_tokens", u64::from(n.max(1)));
        }
        if stream_decode {
            decode_body = decode_body.raw("stream_options", &INCLUDE_USAGE);
        }
        // `<tool_call>` is a special token in some models (Hermes 2 Pro): kept in the text so the
        // calls can be found, as vLLM's hermes parser asks of its engine.
        if parse == Some(tools::ToolParser::Hermes) {
            decode_body = decode_body.flag("skip_special_tokens", false);
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
        if finished_early {
            // The prefiller's token is the whole answer: the client has it now, and the decode
            // that frees the decoder's buffer is the drain, sent once the notifications are in
            // (or their deadline passed) by `Holding`'s drop, the slots held until it answers.
            if let Some(d) = holding.drain.as_mut() {
                d.counters = Arc::clone(&self.after_answer);
            }
        }
        let ctx = DecodeLeg {
            shared: Arc::clone(&self.shared),
            dec: Arc::clone(dec),
            // Not written when no decode is sent on the client's path (the drain writes its own).
            body: if finished_early { None } else { Some(encode(&decode_body)?) },
        };

        if stream_decode {
            let opening = Opening { chat: req.endpoint == Endpoint::Chat, choices, first_text: &first_text };
            return Ok(self.streamed(ctx, holding, shaper, opening, include_usage, timing).await);
        }
        let decoded = ctx.whole(&mut holding, timing).await?;
        if !finished_early {
            timing.mark(Phase::Decode);
        }
        // A plain answer, written straight from the decoder's text; with tools, streamed in one
        // piece, or where that cannot be sure of it, through `Value`s.
        let direct = (parse.is_none() && !req.fields.stream)
            .then(|| shaper.full_written(decoded.as_deref(), &first_text))
            .flatten();
        let decoded = match (direct, decoded) {
            (Some(text), _) => return Ok(whole_answer(text, "application/json")),
            (None, Some(d)) => Some(serde_json::from_slice::<Value>(&d).map_err(|e| {
                GatewayError::Upstream { leg: "decode", message: format!("answer is not JSON: {e}") }
            })?),
            (None, None) => None,
        };
        let mut body = shaper.full(decoded.as_ref(), &first_text);
        if let Some(p) = parse {
            tools::apply(p, &mut body, &req_id);
        }
        let (bytes, kind) = if req.fields.stream {
            let chunks: Vec<Bytes> = shaper.stream_whole(&body, include_usage);
            (chunks.concat(), "text/event-stream")
        } else {
            let mut text = Vec::with_capacity(512);
            shape::json_into(&mut text, &body);
            (text, "application/json")
        };
        Ok(whole_answer(bytes, kind))
    }
}

/// An answer sent in one piece.
fn whole_answer(bytes: Vec<u8>, kind: &'static str) -> Response<RespBody> {
    let mut r = Response::new(Full::new(Bytes::from(bytes)).map_err(|e| -> BoxError { match e {} }).boxed());
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(kind));
    r
}

/// What a streamed answer opens with, before the decoder's tokens.
struct Opening<'a> {
    /// Chat's first chunk carries the role.
    chat: bool,
    choices: u64,
    /// The prefiller's first token, when it is used.
    first_text: &'a str,
}

impl Lmcache {
    /// A streamed answer: its headers, the role and the first token go out now; the decode
    /// follows in a task of its own, which holds what the request holds.
    async fn streamed(
        &self,
        ctx: DecodeLeg,
        holding: Holding,
        shaper: Shaper,
        opening: Opening<'_>,
        include_usage: bool,
        timing: &mut Timing,
    ) -> Response<RespBody> {
        let (tx, rx) = mpsc::channel::<Bytes>(32);
        if opening.chat {
            let _ = tx.send(sse(&shaper.role_chunk(opening.choices))).await;
        }
        if !opening.first_text.is_empty() {
            let _ = tx.send(sse(&shaper.chunk(opening.first_text, &Value::Null))).await;
        }
        timing.mark(Phase::FirstToken);
        // The response starts at the first token: the KV wait and the decode are timed from here.
        let later = timing.later();
        self.shared.spawn(async move {
            let mut holding = holding;
            let r = ctx.stream(&mut holding, later, &shaper, &tx, include_usage).await;
            if let Err(e) = r {
                tracing::warn!(error = %e, "lmcache decode failed after the response started");
                let _ = tx.send(sse(&e.body())).await;
            }
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        let mut r = Response::new(ChannelBody(rx).boxed());
        let h = r.headers_mut();
        h.insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/event-stream"));
        h.insert(hyper::header::CACHE_CONTROL, hyper::header::HeaderValue::from_static("no-cache"));
        r
    }

    /// The prefill leg, to its answer: the prefiller writes the KV into the decoder's buffer and
    /// answers with one token (the first of the answer, when `first_token`).
    async fn prefill(
        &self,
        prefills: &[&super::Prefiller],
        body: &Patched<'_>,
        holding: &mut Holding,
        first_token: bool,
        req: &GenRequest,
        retried: &AtomicU32,
    ) -> Result<PrefillOut, GatewayError> {
        let shared = &*self.shared;
        let retry = Retrying { answered: false, retried };
        let (prefill, resp, in_flight) =
            shared.prefill(prefills, "/v1/completions", body, &mut holding.sent, true, retry).await?;
        holding.notify_deadline = Some(Instant::now() + shared.limits.ready_timeout);
        let bytes = shared.answer("prefill", prefill, resp, in_flight.since()).await.inspect_err(|e| {
            if let LegError::Refused { status: 400..=499, .. } = e {
                // vLLM refuses a request (4xx) before scheduling it: nothing was written into the
                // decoder's buffer, so no drain is owed and the slots come back at once.
                holding.sent = false;
            }
        })?;
        drop(in_flight);
        let out = PrefillAnswer::read(&bytes).map_err(|e| GatewayError::Upstream {
            leg: "prefill",
            message: format!("answer is not JSON: {e}"),
        })?;
        let first_tok = out.first_tok().filter(|_| first_token);
        if first_token && first_tok.is_none() {
            tracing::warn!(
                prefill = prefill.name,
                "prefill answered without kv_transfer_params.first_tok; decoding from the prompt"
            );
        }
        Ok(PrefillOut {
            first_tok,
            first_text: out.first_text(),
            model: out
                .model
                .and_then(|m| serde_json::from_str(m.get()).ok())
                .unwrap_or_else(|| json!(req.model())),
        })
    }
}

impl Handoff for Lmcache {
    fn slots_for(&self, prompt_tokens: usize) -> u32 {
        u32::try_from(prompt_tokens.div_ceil(self.chunk_tokens.max(1) as usize)).unwrap_or(u32::MAX)
    }

    fn accepts(&self, req: &GenRequest) -> Result<(), GatewayError> {
        // LMCache's PD decode runs on completions over token ids, where vLLM parses no tool
        // calls: the gateway renders the tools into the prompt and parses the calls out of the
        // answer itself, with the parser the model's template needs.
        if !with_tools(req) {
            return Ok(());
        }
        if self.tool_parser.is_none() {
            return Err(GatewayError::invalid(
                "tools",
                "tool calls are not served by this model's lmcache pool: its decode runs on /v1/completions, \
                 so the gateway parses the calls, and [lmcache] tool_call_parser (hermes, llama3_json) is not set",
            ));
        }
        // `required` and a named function need guided decoding, which completions over ids lack.
        match req.raw.get("tool_choice") {
            None | Some(Value::Null) => Ok(()),
            Some(Value::String(s)) if s == "auto" || s == "none" => Ok(()),
            Some(_) => Err(GatewayError::invalid(
                "tool_choice",
                "only \"auto\" and \"none\" are served by this model's lmcache pool (forcing a call needs guided decoding)",
            )),
        }
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
        self.drains.metrics(decoder, Self::NAME, out);
        self.after_answer.metrics_after_answer(decoder, Self::NAME, out);
    }
}

/// The decode leg of one request.
struct DecodeLeg {
    shared: Arc<Shared>,
    dec: Arc<Decoder>,
    /// The decode's body; `None` when the prefill's first token was all the client asked for:
    /// no decode on the client's path (the drain `Holding` owes frees the decoder's buffer after
    /// the answer).
    body: Option<Encoded>,
}

impl DecodeLeg {
    /// Waits for every rank's notification, then sends the decode; the slots go back once the decoder
    /// has taken it.
    async fn dispatch(
        &self,
        holding: &mut Holding,
        timing: &mut Timing,
    ) -> Result<Response<crate::endpoints::EngineBody>, GatewayError> {
        // Written unless the prefill's token was the whole answer, when this is not called.
        let Some(body) = self.body.as_ref() else {
            return Err(GatewayError::Upstream {
                leg: "decode",
                message: "no decode body was written".into(),
            });
        };
        timing.enter(Phase::KvReady);
        let ready_timeout = self.shared.limits.ready_timeout;
        if let Some(e) = holding.expect.as_mut() {
            let need = e.need();
            let deadline = holding.notify_deadline.unwrap_or_else(|| Instant::now() + ready_timeout);
            e.wait(deadline).await.map_err(|got| {
                GatewayError::KvTransfer(KvFailure::NotNotified {
                    got,
                    need,
                    decoder: self.dec.name.clone(),
                    within: ready_timeout,
                })
            })?;
        }
        timing.mark(Phase::KvReady);
        timing.enter(Phase::Decode);
        let answer = self.shared.call("decode", &*self.dec, "/v1/completions", body).await;
        if answer.as_ref().is_ok() || matches!(answer, Err(LegError::Refused { .. })) {
            // The decoder has the request: it retrieves the KV whatever the status, so no drain is
            // owed.
            holding.dispatched = true;
            holding.expect = None;
            holding.slots = None;
        }
        Ok(answer?)
    }

    /// Non-streaming: the decoder's answer (`None` when the prefill's token was all of it).
    async fn whole(&self, holding: &mut Holding, timing: &mut Timing) -> Result<Option<Bytes>, GatewayError> {
        if self.body.is_none() {
            return Ok(None);
        }
        let resp = self.dispatch(holding, timing).await?;
        let b = resp
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| GatewayError::Upstream { leg: "decode", message: e.to_string() })?;
        Ok(Some(b))
    }

    /// Streaming: relays the decoder's completion chunks in the client's shape.
    async fn stream(
        &self,
        holding: &mut Holding,
        mut timing: Later,
        shaper: &Shaper,
        tx: &mpsc::Sender<Bytes>,
        include_usage: bool,
    ) -> Result<(), GatewayError> {
        if self.body.is_none() {
            let _ = tx.send(sse(&shaper.chunk("", &json!("length")))).await;
            if include_usage {
                let _ = tx.send(sse(&shaper.usage_chunk(0))).await;
            }
            return Ok(());
        }
        let resp = self.dispatch(holding, &mut timing).await?;
        timing.mark(Phase::Decode);
        timing.enter(Phase::Stream);
        let mut body = resp.into_body();
        let mut split = SseSplitter::default();
        let mut events = Vec::new();
        let mut decoded = 0u64;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn read(answer: &str) -> (Option<u32>, String, Option<String>) {
        let a = PrefillAnswer::read(answer.as_bytes()).unwrap_or_else(|e| panic!("{answer}: {e}"));
        (a.first_tok(), a.first_text(), a.model.map(|m| m.get().to_owned()))
    }

    /// The prefill's answer gives its first token, its text and its model as a `Value`'s lookups
    /// gave them: a field of an unexpected shape is missing, the rest still read (a `null` model
    /// is missing too: the answer then names the client's model, not `null`).
    #[test]
    fn a_prefill_answer_is_read_field_by_field() {
        let vllm = r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m",
            "choices":[{"index":0,"text":" caf\u00e9","logprobs":null,"finish_reason":"length"},{"text":"no"}],
            "usage":{"prompt_tokens":3},"kv_transfer_params":{"first_tok":151643,"other":[1]}}"#;
        assert_eq!(read(vllm), (Some(151_643), " café".into(), Some(r#""m""#.into())));
        for (answer, want) in [
            (r#"{}"#, (None, String::new(), None)),
            (
                r#"{"kv_transfer_params":{"first_tok":"7"},"choices":[{"text":7}],"model":null}"#,
                (None, String::new(), None),
            ),
            (
                r#"{"kv_transfer_params":{"first_tok":4294967296},"choices":{"text":"x"}}"#,
                (None, String::new(), None),
            ),
            (r#"{"kv_transfer_params":null,"choices":[]}"#, (None, String::new(), None)),
            (r#"{"kv_transfer_params":{"first_tok":null},"choices":[{}]}"#, (None, String::new(), None)),
            (r#"{"kv_transfer_params":{"first_tok":0},"choices":[["x"]]}"#, (Some(0), String::new(), None)),
            // The first choice's `text` twice, `null`, or its key escaped, as the derive read them.
            (r#"{"choices":[{"text":"a","text":"b"}]}"#, (None, String::new(), None)),
            (r#"{"choices":[{"index":0,"text":null},{"text":"x"}]}"#, (None, String::new(), None)),
            (r#"{"choices":[{"t\u0065xt":"y","n":[{"text":"z"}]},7]}"#, (None, "y".into(), None)),
        ] {
            assert_eq!(read(answer), want, "{answer}");
        }
        // Not an object: nothing read from it; not JSON: refused.
        assert_eq!(read(r#" ["m", [{"text": "x"}], {"first_tok": 1}]"#), (None, String::new(), None));
        assert_eq!(read(r#"{"kv_transfer_params":[5]}"#), (None, String::new(), None));
        assert!(PrefillAnswer::read(b"{\"model\": ").is_err());
        assert!(PrefillAnswer::read(b"").is_err());
        assert!(PrefillAnswer::read(br#"{"model": "a", "model": "b"}"#).is_err());
        // Other keys twice are skipped as any other.
        assert_eq!(read(r#"{"id": 1, "id": 2, "model": "m"}"#), (None, String::new(), Some(r#""m""#.into())));
    }
}
