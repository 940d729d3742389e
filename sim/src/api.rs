//! The slice of the OpenAI API the simulated engine speaks, plus the `baton` request field of the
//! native handoff.
//!
//! The native handoff's `baton` field is the data plane's engine contract
//! ([`baton_dataplane::contract`]); `prompt_token_ids` in it overrides the engine's own tokenization.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::{Value, json};

use super::kv::{render_chat, tokenize};
use baton_dataplane::contract::content_text;

/// Default `max_tokens` when a request gives none.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

pub use baton_dataplane::contract::{
    BatonParams, ChatMessage, DecoderTarget, Generation, Prompt, StreamOptions,
};

/// A completion or chat request: the shape the gateway reads too, and the engine's own fields.
#[derive(Debug, Deserialize)]
pub struct GenRequest {
    #[serde(flatten)]
    pub openai: Generation,
    pub baton: Option<BatonParams>,
    /// vLLM's KV connector parameters (LMCache `disagg_spec` / `ret_first_tok`; NIXL's remote fields).
    pub kv_transfer_params: Option<Value>,
    /// SGLang's PD fields (a value each, or lists with `n > 1`) and its request id.
    pub bootstrap_host: Option<Value>,
    pub bootstrap_port: Option<Value>,
    pub bootstrap_room: Option<Value>,
    pub rid: Option<Value>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl GenRequest {
    /// The prompt's token ids.
    pub fn token_ids(&self, ep: Endpoint) -> Result<Vec<u32>, String> {
        if let Some(ids) = self.baton.as_ref().and_then(|b| b.prompt_token_ids.clone()) {
            return Ok(ids);
        }
        match ep {
            Endpoint::Completions => match &self.openai.prompt {
                Some(Prompt::Text(t)) => Ok(tokenize(t)),
                Some(Prompt::Tokens(ids)) => Ok(ids.clone()),
                None => Err("prompt is required".into()),
            },
            Endpoint::Chat => {
                let msgs = self.openai.messages.as_ref().ok_or("messages is required")?;
                let rendered: Vec<(String, String)> =
                    msgs.iter().map(|m| (m.role.clone(), content_text(&m.content))).collect();
                Ok(tokenize(&render_chat(&rendered)))
            }
        }
    }

    pub fn max_tokens(&self) -> u32 {
        self.openai.max_tokens().unwrap_or(DEFAULT_MAX_TOKENS)
    }

    /// NIXL's fields of `kv_transfer_params`, if any.
    pub fn nixl_params(&self) -> Result<Option<super::nixl::NixlParams>, super::SimError> {
        match &self.kv_transfer_params {
            Some(v) if v.get("do_remote_decode").is_some() || v.get("do_remote_prefill").is_some() => {
                serde_json::from_value(v.clone())
                    .map(Some)
                    .map_err(|e| super::SimError::bad(format!("kv_transfer_params: {e}")))
            }
            _ => Ok(None),
        }
    }

    /// LMCache's fields of `kv_transfer_params`, if any.
    pub fn lmcache_params(&self) -> Result<Option<super::lmcache::LmcacheParams>, super::SimError> {
        match &self.kv_transfer_params {
            Some(v) if v.get("disagg_spec").is_some() || v.get("ret_first_tok").is_some() => {
                serde_json::from_value(v.clone())
                    .map(Some)
                    .map_err(|e| super::SimError::bad(format!("kv_transfer_params: {e}")))
            }
            _ => Ok(None),
        }
    }

    /// SGLang's PD fields, if any.
    pub fn sglang_params(&self) -> Result<Option<super::sglang::SglangParams>, super::SimError> {
        super::sglang::SglangParams::of(
            self.bootstrap_host.as_ref(),
            self.bootstrap_port.as_ref(),
            self.bootstrap_room.as_ref(),
        )
    }

    /// The request id SGLang's `/abort_request` names it by.
    pub fn rid(&self) -> Option<&str> {
        self.rid.as_ref().and_then(Value::as_str)
    }

    pub fn include_usage(&self) -> bool {
        self.openai.include_usage()
    }
}

pub fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Usage object.
pub fn usage(prompt: usize, completion: u32) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion as usize})
}

/// A whole (non-streaming) response.
pub fn full_response(
    ep: Endpoint,
    id: &str,
    model: &str,
    text: &str,
    prompt: usize,
    completion: u32,
) -> Value {
    match ep {
        Endpoint::Completions => json!({
            "id": format!("cmpl-{id}"), "object": "text_completion", "created": now_secs(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
            "usage": usage(prompt, completion),
        }),
        Endpoint::Chat => json!({
            "id": format!("chatcmpl-{id}"), "object": "chat.completion", "created": now_secs(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "length"}],
            "usage": usage(prompt, completion),
        }),
    }
}

/// One streamed chunk: a token (`Some`) or the final chunk with the finish reason (`None`).
pub fn stream_chunk(ep: Endpoint, id: &str, model: &str, token: Option<&str>, first: bool) -> Value {
    let finish = if token.is_none() { json!("length") } else { Value::Null };
    match ep {
        Endpoint::Completions => json!({
            "id": format!("cmpl-{id}"), "object": "text_completion", "created": now_secs(), "model": model,
            "choices": [{"index": 0, "text": token.unwrap_or(""), "logprobs": null, "finish_reason": finish}],
        }),
        Endpoint::Chat => {
            let delta = match (token, first) {
                (Some(t), true) => json!({"role": "assistant", "content": t}),
                (Some(t), false) => json!({"content": t}),
                (None, _) => json!({}),
            };
            json!({
                "id": format!("chatcmpl-{id}"), "object": "chat.completion.chunk", "created": now_secs(), "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            })
        }
    }
}

/// The usage-only chunk sent last when `stream_options.include_usage` is set.
pub fn usage_chunk(ep: Endpoint, id: &str, model: &str, prompt: usize, completion: u32) -> Value {
    let (prefix, object) = match ep {
        Endpoint::Completions => ("cmpl", "text_completion"),
        Endpoint::Chat => ("chatcmpl", "chat.completion.chunk"),
    };
    json!({"id": format!("{prefix}-{id}"), "object": object, "created": now_secs(), "model": model,
           "choices": [], "usage": usage(prompt, completion)})
}

/// The OpenAI error body.
pub fn error_body(message: &str, kind: &str, code: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}
