//! Token counting. This build has the conservative fallback only: byte-level token ids (a byte-level
//! BPE never makes more tokens than bytes, so slots are never under-counted), with chat messages
//! rendered by the simple template `<|role|>\ncontent\n ... <|assistant|>\n`. The engines receive
//! the ids (`baton.prompt_token_ids`), so both legs agree on them. Real tokenizers and chat templates
//! (`tokenizers`, minijinja) come next.

use crate::api::{Endpoint, GenRequest, Prompt};

/// Renders chat messages with the fallback template: the simulated model's own template, so the
/// gateway and the engines count the same tokens.
pub use baton_dataplane::sim::kv::render_chat;

/// The prompt's token ids under the fallback tokenizer.
pub fn token_ids(req: &GenRequest) -> Vec<u32> {
    match (req.endpoint, &req.fields.prompt) {
        (Endpoint::Completions, Some(Prompt::Tokens(ids))) => ids.clone(),
        (Endpoint::Completions, Some(Prompt::Text(t))) => t.bytes().map(u32::from).collect(),
        (Endpoint::Completions, None) => Vec::new(),
        (Endpoint::Chat, _) => render_chat(&req.messages()).bytes().map(u32::from).collect(),
    }
}
