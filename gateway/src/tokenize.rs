//! Token counting. This build has the conservative fallback only: byte-level token ids (a byte-level
//! BPE never makes more tokens than bytes, so slots are never under-counted), with chat messages
//! rendered by the simple template `<|role|>\ncontent\n ... <|assistant|>\n`. The engines receive
//! the ids (`baton.prompt_token_ids`), so both legs agree on them. Real tokenizers and chat templates
//! (`tokenizers`, minijinja) come next.

use crate::api::{Endpoint, GenRequest, Prompt};

/// Renders chat messages with the fallback template.
pub fn render_chat(messages: &[(String, String)]) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str("<|");
        s.push_str(role);
        s.push_str("|>\n");
        s.push_str(content);
        s.push('\n');
    }
    s.push_str("<|assistant|>\n");
    s
}

/// The prompt's token ids under the fallback tokenizer.
pub fn token_ids(req: &GenRequest) -> Vec<u32> {
    match (req.endpoint, &req.fields.prompt) {
        (Endpoint::Completions, Some(Prompt::Tokens(ids))) => ids.clone(),
        (Endpoint::Completions, Some(Prompt::Text(t))) => t.bytes().map(u32::from).collect(),
        (Endpoint::Completions, None) => Vec::new(),
        (Endpoint::Chat, _) => render_chat(&req.messages()).bytes().map(u32::from).collect(),
    }
}
