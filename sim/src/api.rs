//! The slice of the OpenAI API the simulated engine speaks, plus the `baton` request field of the
//! native handoff.
//!
//! The native handoff's `baton` field is the data plane's engine contract
//! ([`baton_dataplane::contract`]); `prompt_token_ids` in it overrides the engine's own tokenization.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::{Value, json};

use super::kv::{render_chat, token_logprob, tokenize, top_tokens};
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
    /// Choices to generate.
    pub n: Option<u32>,
    /// Completions: alternatives per token (an integer); chat: whether to return logprobs.
    pub logprobs: Option<Value>,
    /// Chat: alternatives per token.
    pub top_logprobs: Option<u32>,
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

    /// Choices to generate (`n`, at least 1).
    pub fn choices(&self) -> u32 {
        self.n.unwrap_or(1).max(1)
    }

    /// The alternatives per token to return, when logprobs are asked for.
    pub fn logprobs(&self, ep: Endpoint) -> Option<u32> {
        match ep {
            Endpoint::Completions => {
                self.logprobs.as_ref().and_then(Value::as_u64).map(|k| u32::try_from(k).unwrap_or(u32::MAX))
            }
            Endpoint::Chat => (self.logprobs.as_ref().and_then(Value::as_bool) == Some(true))
                .then(|| self.top_logprobs.unwrap_or(0)),
        }
    }
}

pub fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Usage object.
pub fn usage(prompt: usize, completion: u32) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion as usize})
}

/// The logprobs of `tokens` (output positions from `pos`), `top` alternatives each, in the
/// endpoint's shape: completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets from
/// `offset`), chat's `{content: [{token, logprob, bytes, top_logprobs}]}`.
pub fn logprobs(ep: Endpoint, tokens: &[(u32, &str)], pos: u32, offset: usize, top: u32) -> Value {
    let at = |i: usize| pos + u32::try_from(i).unwrap_or(u32::MAX);
    match ep {
        Endpoint::Completions => {
            let mut off = offset;
            let offsets: Vec<usize> = tokens
                .iter()
                .map(|(_, t)| {
                    let o = off;
                    off += t.len();
                    o
                })
                .collect();
            json!({
                "tokens": tokens.iter().map(|(_, t)| *t).collect::<Vec<_>>(),
                "token_logprobs": tokens.iter().enumerate().map(|(i, (id, _))| token_logprob(*id, at(i))).collect::<Vec<_>>(),
                "top_logprobs": tokens.iter().enumerate().map(|(i, (id, _))| {
                    top_tokens(*id, at(i), top).into_iter().map(|(t, lp)| (t.to_owned(), json!(lp))).collect::<serde_json::Map<_, _>>()
                }).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
        Endpoint::Chat => json!({
            "content": tokens.iter().enumerate().map(|(i, (id, t))| json!({
                "token": t, "logprob": token_logprob(*id, at(i)), "bytes": t.as_bytes(),
                "top_logprobs": top_tokens(*id, at(i), top).into_iter()
                    .map(|(t, lp)| json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        }),
    }
}

/// A whole (non-streaming) response: one choice per token list.
pub fn full_response(
    ep: Endpoint,
    id: &str,
    model: &str,
    choices: &[Vec<(u32, &str)>],
    prompt: usize,
    lp: Option<u32>,
) -> Value {
    let completion: usize = choices.iter().map(Vec::len).sum();
    let usage = usage(prompt, u32::try_from(completion).unwrap_or(u32::MAX));
    let list: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, toks)| {
            let text: String = toks.iter().map(|(_, t)| *t).collect();
            let lps = lp.map_or(Value::Null, |k| logprobs(ep, toks, 0, 0, k));
            match ep {
                Endpoint::Completions => {
                    json!({"index": i, "text": text, "logprobs": lps, "finish_reason": "length"})
                }
                Endpoint::Chat => json!({"index": i, "message": {"role": "assistant", "content": text},
                                         "logprobs": lps, "finish_reason": "length"}),
            }
        })
        .collect();
    match ep {
        Endpoint::Completions => json!({
            "id": format!("cmpl-{id}"), "object": "text_completion", "created": now_secs(), "model": model,
            "choices": list, "usage": usage,
        }),
        Endpoint::Chat => json!({
            "id": format!("chatcmpl-{id}"), "object": "chat.completion", "created": now_secs(), "model": model,
            "choices": list, "usage": usage,
        }),
    }
}

/// One streamed token of one choice, or that choice's final chunk.
#[derive(Clone, Copy, Debug)]
pub struct StreamToken<'a> {
    pub choice: usize,
    /// The token and its output position; `None` for the final chunk with the finish reason.
    pub token: Option<((u32, &'a str), u32)>,
    /// Bytes of text before it in its choice (completions' `text_offset`).
    pub offset: usize,
    pub first: bool,
    pub logprobs: Option<u32>,
}

/// One streamed chunk.
pub fn stream_chunk(ep: Endpoint, id: &str, model: &str, t: StreamToken<'_>) -> Value {
    let finish = if t.token.is_none() { json!("length") } else { Value::Null };
    let lps = match (t.token, t.logprobs) {
        (Some((tok, pos)), Some(k)) => logprobs(ep, &[tok], pos, t.offset, k),
        _ => Value::Null,
    };
    let text = t.token.map(|((_, s), _)| s);
    match ep {
        Endpoint::Completions => json!({
            "id": format!("cmpl-{id}"), "object": "text_completion", "created": now_secs(), "model": model,
            "choices": [{"index": t.choice, "text": text.unwrap_or(""), "logprobs": lps, "finish_reason": finish}],
        }),
        Endpoint::Chat => {
            let delta = match (text, t.first) {
                (Some(s), true) => json!({"role": "assistant", "content": s}),
                (Some(s), false) => json!({"content": s}),
                (None, _) => json!({}),
            };
            json!({
                "id": format!("chatcmpl-{id}"), "object": "chat.completion.chunk", "created": now_secs(), "model": model,
                "choices": [{"index": t.choice, "delta": delta, "logprobs": lps, "finish_reason": finish}],
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

/// An error body as vLLM answers one: the OpenAI shape with the HTTP status as its `code`.
pub fn error_body(message: &str, kind: &str, code: u16) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}
