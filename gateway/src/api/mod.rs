//! The OpenAI-compatible surface: typed requests, and the closed set of errors with their status,
//! stable `code` and retry advice. One function ([`GatewayError::status`] with
//! [`GatewayError::body`]) maps every error to its HTTP response.

pub mod object;
pub mod scan;
pub mod sse;
pub mod validate;

pub use object::Object;

use serde::Deserialize;
use serde_json::{Value, json};
use thiserror::Error;

/// Largest request body read: prompts of a few hundred thousand tokens fit.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Self::Completions => "/v1/completions",
            Self::Chat => "/v1/chat/completions",
        }
    }
}

/// Where an error came from (the body's `origin`: `client`, `engine`, `policy`, `gateway`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The request itself: sending it again unchanged fails again.
    Client,
    /// A prefill or decode engine (its refusal, its 5xx, no answer in time).
    Upstream,
    /// A policy plugin's decision (its status, its message).
    Plugin,
    /// The gateway: its own capacity (queue, endpoints) or a fault of its own.
    Internal,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Upstream => "engine",
            Self::Plugin => "policy",
            Self::Internal => "gateway",
        }
    }
}

/// Whether sending the same request again can succeed (the body's `retry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// It cannot: the request is refused as it is.
    Never,
    /// It can, and no engine did any work for it (queue full, no endpoint, a rate limit).
    Safe,
    /// It may: an engine may have worked on it before the failure (a 502, a 504).
    Maybe,
}

impl Retry {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Never => "never",
            Self::Safe => "safe",
            Self::Maybe => "maybe",
        }
    }
}

/// What is wrong with a field, as the error's `code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Problem {
    Missing,
    Type,
    Value,
}

/// Every way a request can fail, each with a fixed status and stable code (`status`, `code`,
/// `origin`, `retry` below).
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum GatewayError {
    /// The body is not JSON, or not an object.
    #[error("invalid request body: {0}")]
    BadJson(String),
    /// A field that breaks a rule: `param` is its path (`messages[3].content[0].type`).
    #[error("{param}: {reason}")]
    Invalid { param: String, problem: Problem, reason: String },
    /// The request names a model this gateway does not serve.
    #[error("model {0:?} is not served here")]
    UnknownModel(String),
    /// The prompt is longer than the model's context. `param`: the field that holds the prompt
    /// (`prompt` or `messages`). `at_least`: `tokens` is a lower bound, known before tokenizing
    /// (the prompt was refused on its length in bytes).
    #[error("this model's maximum context length is {limit} tokens, the prompt has {}{tokens}", at_least_word(*.at_least))]
    ContextLength { tokens: u64, limit: u64, param: &'static str, at_least: bool },
    /// The prompt needs more admission slots than the decoder has in all.
    #[error("prompt needs {need} slots but the decoder buffer holds {capacity}")]
    TooLarge { need: u32, capacity: u32 },
    /// The body is larger than the gateway reads.
    #[error("request body larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// The body did not arrive in time.
    #[error("request body not received within {limit:?}")]
    BodyTimeout { limit: std::time::Duration },
    /// The body is not declared as JSON.
    #[error("content-type must be application/json")]
    ContentType,
    /// The decoder's queue is full: the request was refused without waiting.
    #[error("{0}")]
    QueueFull(crate::admission::AdmissionError),
    /// The request waited for room on its decoder for as long as it may.
    #[error("{0}")]
    QueueTimeout(Waited),
    /// Every tokenizer thread is busy with large prompts and as many wait as may.
    #[error("the gateway is tokenizing {limit} large prompts already; try again shortly")]
    TokenizerBusy { limit: usize },
    /// No healthy engine of this leg (`prefill`, `decode`).
    #[error("no healthy {0} endpoint")]
    NoEndpoint(&'static str),
    /// An engine's leg failed without an answer the client can use.
    #[error("upstream {leg}: {message}")]
    Upstream { leg: &'static str, message: String },
    /// An engine's leg did not answer within the gateway's limit.
    #[error("upstream {leg}: no answer within {limit:?}")]
    UpstreamTimeout { leg: &'static str, limit: std::time::Duration },
    /// The KV did not reach the decoder.
    #[error("kv transfer: {0}")]
    KvTransfer(KvFailure),
    /// No such route.
    #[error("not found: {0}")]
    NotFound(String),
    /// The admin surface's bearer token is missing or wrong.
    #[error("unauthorized: {0}")]
    Unauthorized(&'static str),
    /// `[auth]` is on and the request has no valid API key.
    #[error("a valid API key is required (Authorization: Bearer <key>)")]
    InvalidApiKey,
    /// A failure inside the gateway itself.
    #[error("internal error: {0}")]
    Internal(Internal),
    /// Refused by flow control (a budget, a full or sheddable band, a deadline), before any engine.
    #[error("{0}")]
    Flow(crate::flow::Refused),
    /// Refused by the admission plugin, with the plugin's status (400-599) and message.
    #[error("{message}")]
    PolicyRejected { status: u16, message: String, retry_after: Option<u32> },
    /// An engine refused the request (4xx): the client gets the engine's status and its OpenAI error
    /// body (built from its text when it sent none), so a request that can never succeed is not
    /// retried as a gateway failure.
    #[error("{leg} engine answered {status}: {}", body["error"]["message"].as_str().unwrap_or(""))]
    EngineRefused { leg: &'static str, status: u16, body: Value },
}

/// What a request waited for in vain.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Waited {
    /// Admission slots on its decoder.
    #[error("{0}")]
    Slots(crate::admission::AdmissionError),
    /// Free pages on every rank of a native decoder (another gateway replica held them).
    #[error("decoder {decoder} had no free pages in time")]
    Pages { decoder: String },
}

/// How the KV failed to reach the decoder.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum KvFailure {
    /// A decoder rank reported a terminal state other than ready (`failed`, `expired`, …).
    #[error("decoder rank {rank} reported {state}")]
    RankFailed { rank: u32, state: &'static str },
    /// Decoder ranks had not reported the whole KV by the deadline.
    #[error("{missing} decoder ranks did not hold the kv within {within:?}")]
    RanksLate { missing: u32, within: std::time::Duration },
    /// The decoder's event feed closed before the KV was ready.
    #[error("decoder event feed closed")]
    FeedClosed,
    /// The decoder, sent the request alongside the prefill to wait for the KV itself, gave up on
    /// it (its wait timed out, or the request's pages were cancelled or expired meanwhile).
    #[error("the decoder waiting for the kv answered {status}: {message}")]
    DecoderWait { status: u16, message: String },
    /// Prefill ranks had not reported their writes into the decoder's buffer by the deadline.
    #[error("{got} of {need} prefill ranks reported the kv for decoder {decoder} within {within:?}")]
    NotNotified { got: usize, need: usize, decoder: String, within: std::time::Duration },
}

/// A failure inside the gateway itself.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Internal {
    /// A task the request ran part of itself in ended without its result (it panicked, or the
    /// runtime is stopping).
    #[error("the {task} task ended without its result")]
    TaskLost { task: &'static str },
    /// A body the gateway writes could not be written as JSON.
    #[error("{what} could not be written: {reason}")]
    Encode { what: &'static str, reason: String },
    /// The tokenizer failed on the request.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The readiness aggregator refused the decoder's rank count.
    #[error("readiness: {0}")]
    Readiness(String),
    /// A native request waited for readiness without its event subscription (never: the
    /// reservation makes it first).
    #[error("no event subscription")]
    Unsubscribed,
}

fn at_least_word(at_least: bool) -> &'static str {
    if at_least { "at least " } else { "" }
}

impl GatewayError {
    /// For an engine call that failed: its leg and what became of it (the engine's HTTP status,
    /// `timeout`, or `error` when no usable answer came); the KV's arrival counts as leg `kv`.
    pub fn engine_failure(&self) -> Option<(&'static str, std::borrow::Cow<'static, str>)> {
        match self {
            Self::Upstream { leg, .. } => Some((leg, "error".into())),
            Self::UpstreamTimeout { leg, .. } => Some((leg, "timeout".into())),
            Self::EngineRefused { leg, status, .. } => Some((leg, status.to_string().into())),
            Self::KvTransfer(_) => Some(("kv", "error".into())),
            _ => None,
        }
    }

    pub fn status(&self) -> u16 {
        match self {
            Self::BadJson(_) | Self::Invalid { .. } | Self::ContextLength { .. } => 400,
            Self::UnknownModel(_) | Self::NotFound(_) => 404,
            Self::Unauthorized(_) | Self::InvalidApiKey => 401,
            Self::TooLarge { .. } | Self::BodyTooLarge { .. } => 413,
            Self::ContentType => 415,
            Self::BodyTimeout { .. } => 408,
            Self::QueueFull(_) => 429,
            Self::Upstream { .. } | Self::KvTransfer(_) => 502,
            Self::UpstreamTimeout { .. } => 504,
            Self::QueueTimeout(_) | Self::NoEndpoint(_) | Self::TokenizerBusy { .. } => 503,
            Self::Internal(_) => 500,
            Self::PolicyRejected { status, .. } | Self::EngineRefused { status, .. } => *status,
            Self::Flow(r) => r.status(),
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::BadJson(_) => "invalid_json",
            Self::Invalid { problem: Problem::Missing, .. } => "missing_required_parameter",
            Self::Invalid { problem: Problem::Type, .. } => "invalid_type",
            Self::Invalid { problem: Problem::Value, .. } => "invalid_value",
            Self::UnknownModel(_) => "model_not_found",
            Self::ContextLength { .. } => "context_length_exceeded",
            Self::TooLarge { .. } => "prompt_too_large_for_kv_buffer",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::ContentType => "unsupported_media_type",
            Self::BodyTimeout { .. } => "request_timeout",
            Self::QueueFull(_) => "queue_full",
            Self::QueueTimeout(_) => "queue_timeout",
            Self::TokenizerBusy { .. } => "tokenizer_busy",
            Self::NoEndpoint(_) => "no_healthy_endpoint",
            Self::Upstream { .. } => "upstream_error",
            Self::UpstreamTimeout { .. } => "upstream_timeout",
            Self::KvTransfer(_) => "kv_transfer_failed",
            Self::NotFound(_) => "not_found",
            Self::Unauthorized(_) => "unauthorized",
            Self::InvalidApiKey => "invalid_api_key",
            Self::Internal(_) => "internal_error",
            Self::PolicyRejected { .. } => "rejected_by_policy",
            Self::EngineRefused { .. } => "engine_refused",
            Self::Flow(r) => r.code(),
        }
    }

    pub fn origin(&self) -> Origin {
        match self {
            Self::BadJson(_)
            | Self::Invalid { .. }
            | Self::UnknownModel(_)
            | Self::ContextLength { .. }
            | Self::TooLarge { .. }
            | Self::BodyTooLarge { .. }
            | Self::BodyTimeout { .. }
            | Self::ContentType
            | Self::NotFound(_)
            | Self::Unauthorized(_)
            | Self::InvalidApiKey => Origin::Client,
            Self::Upstream { .. }
            | Self::UpstreamTimeout { .. }
            | Self::KvTransfer(_)
            | Self::EngineRefused { .. } => Origin::Upstream,
            Self::PolicyRejected { .. } => Origin::Plugin,
            Self::Flow(r) if r.by_client() => Origin::Client,
            Self::Flow(_) => Origin::Internal,
            Self::QueueFull(_)
            | Self::QueueTimeout(_)
            | Self::NoEndpoint(_)
            | Self::TokenizerBusy { .. }
            | Self::Internal(_) => Origin::Internal,
        }
    }

    /// Whether the same request can succeed if sent again.
    pub fn retry(&self) -> Retry {
        match self {
            // Refused before any engine saw it, for want of room or of an endpoint.
            Self::QueueFull(_)
            | Self::QueueTimeout(_)
            | Self::NoEndpoint(_)
            | Self::TokenizerBusy { .. }
            | Self::BodyTimeout { .. } => Retry::Safe,
            Self::Flow(crate::flow::Refused::UnknownBand { .. }) => Retry::Never,
            Self::Flow(_) => Retry::Safe,
            Self::EngineRefused { status: 429, .. } => Retry::Safe,
            Self::PolicyRejected { status, .. } if *status == 429 || *status == 503 => Retry::Safe,
            Self::PolicyRejected { status, .. } if *status >= 500 => Retry::Maybe,
            Self::Upstream { .. }
            | Self::UpstreamTimeout { .. }
            | Self::KvTransfer(_)
            | Self::Internal(_) => Retry::Maybe,
            _ => Retry::Never,
        }
    }

    /// A field's value breaks a rule.
    pub fn invalid(param: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid { param: param.into(), problem: Problem::Value, reason: reason.into() }
    }

    /// Seconds a client should wait before retrying, when a retry can help.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Self::QueueFull(_) | Self::TokenizerBusy { .. } => Some(1),
            Self::QueueTimeout(_) | Self::NoEndpoint(_) => Some(2),
            Self::EngineRefused { status: 429, .. } => Some(1),
            Self::PolicyRejected { retry_after, .. } => retry_after.map(u64::from),
            Self::Flow(r) => r.retry_after(),
            _ => None,
        }
    }

    /// The OpenAI error body, with `origin` and `retry` beside its fields (an engine's own body is
    /// passed as it came, with those two added).
    pub fn body(&self) -> Value {
        let mut v = if let Self::EngineRefused { body, .. } = self {
            body.clone()
        } else {
            let kind = match self.origin() {
                Origin::Client => "invalid_request_error",
                Origin::Upstream | Origin::Plugin | Origin::Internal if self.status() < 500 => {
                    "invalid_request_error"
                }
                Origin::Plugin | Origin::Upstream | Origin::Internal => "server_error",
            };
            let param = match self {
                Self::Invalid { param, .. } => json!(param),
                Self::ContextLength { param, .. } => json!(param),
                Self::Flow(crate::flow::Refused::UnknownBand { header, .. }) => json!(header),
                _ => Value::Null,
            };
            json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": self.code()}})
        };
        if let Some(e) = v.get_mut("error").and_then(Value::as_object_mut) {
            e.insert("origin".into(), json!(self.origin().as_str()));
            e.insert("retry".into(), json!(self.retry().as_str()));
        }
        v
    }
}

pub use baton_dataplane::contract::{StreamOptions, content_text};

/// The fields the gateway reads as typed values: the engine contract's (`contract::Generation`)
/// less the prompt and the messages, which are read in place from the request's object
/// ([`GenRequest::prompt`], [`GenRequest::chat`]) rather than copied out of it (a 1 KB
/// prompt was an allocation and 1 KB written of every request's; a chat's messages were copied
/// whole). The whole JSON object is forwarded to the engines untouched apart from the handoff
/// fields.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct GenFields {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
}

impl GenFields {
    /// The token limit the request sets (`max_completion_tokens` wins, as in OpenAI's API).
    pub fn max_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

/// A completion's one prompt, read in place: text, or token ids (their JSON values, checked by
/// [`validate::check`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PromptRef<'a> {
    Text(&'a str),
    Tokens(&'a [Value]),
}

/// A `Tokens` prompt's ids; one that is not a token id (the checks refuse it before) is the
/// client's 400.
pub fn prompt_ids(ids: &[Value]) -> Result<Vec<u32>, GatewayError> {
    ids.iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| GatewayError::BadJson("prompt: a token id is not an integer from 0".into()))
}

/// A parsed generation request.
#[derive(Debug)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    pub fields: GenFields,
    /// The original JSON object, shared: a leg that outlives the request (a NIXL drain) keeps it
    /// without a copy.
    pub raw: std::sync::Arc<Object>,
    /// The tenant of the request's API key, when `[auth]` is on.
    pub tenant: Option<std::sync::Arc<str>>,
    /// The request body's size in bytes (its share, for one prompt of a list): what it holds of
    /// the gateway's memory while it waits.
    pub bytes: u64,
}

impl GenRequest {
    /// Parses and validates a request body (a copy of it: the server's path,
    /// `Gateway::generate_body`, parses the body it read without one).
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, GatewayError> {
        Self::from_map(endpoint, Object::parse(&bytes::Bytes::copy_from_slice(body))?)
    }

    /// Validates a request already parsed as a JSON object.
    pub fn from_map(endpoint: Endpoint, raw: Object) -> Result<Self, GatewayError> {
        validate::check(endpoint, &raw)?;
        Self::from_checked(endpoint, raw)
    }

    /// A request [`validate::check`] has passed: its typed fields read from the object in place.
    pub fn from_checked(endpoint: Endpoint, raw: Object) -> Result<Self, GatewayError> {
        let fields = GenFields::deserialize(raw.map()).map_err(|e| GatewayError::BadJson(e.to_string()))?;
        Ok(Self { endpoint, fields, raw: std::sync::Arc::new(raw), tenant: None, bytes: 0 })
    }

    /// A completion's prompt, when it is one text or one list of token ids (a list of prompts is
    /// split into requests of one before it gets here, `pipeline::batch`).
    pub fn prompt(&self) -> Option<PromptRef<'_>> {
        match self.raw.get("prompt")? {
            Value::String(t) => Some(PromptRef::Text(t)),
            Value::Array(ids) if !ids.first().is_some_and(|v| v.is_string() || v.is_array()) => {
                Some(PromptRef::Tokens(ids))
            }
            _ => None,
        }
    }

    /// A chat's messages, as the client sent them (checked by [`validate::check`]).
    pub fn chat(&self) -> Option<&[Value]> {
        self.raw.get("messages").and_then(Value::as_array).map(Vec::as_slice)
    }

    /// The chat's messages as (role, text) pairs, for the simulated/simple template.
    pub fn messages(&self) -> Vec<(String, String)> {
        self.chat()
            .unwrap_or_default()
            .iter()
            .map(|m| {
                let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
                (role.to_owned(), m.get("content").map(content_text).unwrap_or_default())
            })
            .collect()
    }

    pub fn model(&self) -> Option<&str> {
        self.fields.model.as_deref()
    }
}

/// Bytes of [`content_text`], without building it.
pub fn content_len(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len(),
        Value::Array(parts) => {
            parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).map(str::len).sum()
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt and the messages are read from the request's object where they are, as the
    /// contract's types read them: one text, one list of ids, the chat's roles and texts.
    #[test]
    fn prompt_and_messages_are_read_in_place() {
        let text = "x".repeat(200);
        let req = GenRequest::parse(Endpoint::Completions, format!(r#"{{"prompt": "{text}"}}"#).as_bytes())
            .unwrap();
        let Some(PromptRef::Text(t)) = req.prompt() else { panic!("{:?}", req.prompt()) };
        let Some(Value::String(held)) = req.raw.get("prompt") else { panic!() };
        assert!(std::ptr::eq(t, held.as_str()), "the object's own string, not a copy");
        let req = GenRequest::parse(Endpoint::Completions, br#"{"prompt": [1, 4294967295]}"#).unwrap();
        let Some(PromptRef::Tokens(ids)) = req.prompt() else { panic!("{:?}", req.prompt()) };
        assert_eq!(prompt_ids(ids).unwrap(), [1, u32::MAX]);
        assert!(prompt_ids(&[json!(-1)]).is_err());
        assert!(req.chat().is_none());
        let chat = br#"{"messages": [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls":
                [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}"#;
        let req = GenRequest::parse(Endpoint::Chat, chat).unwrap();
        assert!(req.prompt().is_none());
        assert_eq!(req.chat().map(<[Value]>::len), Some(3));
        let want = [("system", "be brief"), ("user", "ab"), ("assistant", "")];
        assert_eq!(req.messages(), want.map(|(r, c)| (r.to_owned(), c.to_owned())));
    }

    #[test]
    fn parse_table() {
        // (name, endpoint, body, expected error code or None)
        let cases: Vec<(&str, Endpoint, &str, Option<&str>)> = vec![
            ("completion ok", Endpoint::Completions, r#"{"model":"m","prompt":"hi"}"#, None),
            ("token prompt ok", Endpoint::Completions, r#"{"prompt":[1,2,3]}"#, None),
            ("chat ok", Endpoint::Chat, r#"{"messages":[{"role":"user","content":"hi"}]}"#, None),
            ("not json", Endpoint::Completions, "{", Some("invalid_json")),
            ("not an object", Endpoint::Completions, "[1]", Some("invalid_json")),
            ("no prompt", Endpoint::Completions, r#"{"model":"m"}"#, Some("missing_required_parameter")),
            ("no messages", Endpoint::Chat, r#"{"model":"m"}"#, Some("missing_required_parameter")),
            ("empty messages", Endpoint::Chat, r#"{"messages":[]}"#, Some("invalid_value")),
            (
                "bad role",
                Endpoint::Chat,
                r#"{"messages":[{"role":"wizard","content":"x"}]}"#,
                Some("invalid_value"),
            ),
            (
                "zero max_tokens",
                Endpoint::Completions,
                r#"{"prompt":"x","max_tokens":0}"#,
                Some("invalid_value"),
            ),
            (
                "wrong type",
                Endpoint::Completions,
                r#"{"prompt":"x","max_tokens":"many"}"#,
                Some("invalid_type"),
            ),
        ];
        for (name, ep, body, want) in cases {
            let got = GenRequest::parse(ep, body.as_bytes()).err().map(|e| e.code());
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn errors_map_to_status_code_and_retry() {
        let e = GatewayError::TooLarge { need: 70, capacity: 64 };
        assert_eq!((e.status(), e.code(), e.retry_after()), (413, "prompt_too_large_for_kv_buffer", None));
        assert_eq!(e.body()["error"]["message"], "prompt needs 70 slots but the decoder buffer holds 64");
        let e = GatewayError::QueueFull(crate::admission::AdmissionError::QueueFull { limit: 8 });
        assert_eq!(
            (e.status(), e.retry_after(), e.origin(), e.retry()),
            (429, Some(1), Origin::Internal, Retry::Safe)
        );
        assert_eq!(
            (e.body()["error"]["origin"].as_str(), e.body()["error"]["retry"].as_str()),
            (Some("gateway"), Some("safe"))
        );
        let e = GatewayError::UpstreamTimeout { leg: "decode", limit: std::time::Duration::from_secs(3) };
        assert_eq!((e.status(), e.code(), e.retry()), (504, "upstream_timeout", Retry::Maybe));
        let e = GatewayError::invalid("temperature", "7 is not in [0, 2]");
        assert_eq!((e.origin(), e.retry()), (Origin::Client, Retry::Never));
        let e = GatewayError::ContextLength { tokens: 9000, limit: 8192, param: "prompt", at_least: false };
        assert_eq!((e.status(), e.code()), (400, "context_length_exceeded"));
        let e = GatewayError::Upstream { leg: "prefill", message: "503".into() };
        assert_eq!(
            (e.status(), e.origin(), e.body()["error"]["type"].as_str()),
            (502, Origin::Upstream, Some("server_error"))
        );
        let bad = GenRequest::parse(Endpoint::Chat, br#"{"messages":[{"role":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA","content":"x"}]}"#).unwrap_err();
        assert!(
            !bad.to_string().contains(&"A".repeat(41)),
            "client input is echoed only as a short prefix: {bad}"
        );
        assert_eq!(bad.body()["error"]["param"], "messages[0].role");
    }
}
