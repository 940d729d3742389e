//! The answer in the client's shape: a decoder's `/v1/completions` chunks turned back into the
//! client's endpoint (completions or chat), with the prefiller's first token and corrected usage.

use bytes::Bytes;
use serde_json::{Value, json};

use crate::api::Endpoint;

pub(super) fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Shapes the answer for the client's endpoint.
pub(super) struct Shaper {
    pub(super) ep: Endpoint,
    pub(super) id: String,
    pub(super) model: Value,
    pub(super) created: u64,
    pub(super) prompt_tokens: usize,
    /// Tokens the client got from the prefill (the first token).
    pub(super) extra: u32,
}

impl Shaper {
    pub(super) fn chunk(&self, text: &str, finish: &Value) -> Value {
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

    pub(super) fn role_chunk(&self) -> Value {
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

    pub(super) fn usage_chunk(&self, decoded: u64) -> Value {
        let object = match self.ep {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": self.usage(decoded)})
    }

    pub(super) fn full(&self, text: &str, finish: &Value, decoded: u64) -> Value {
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

pub(super) fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}
