//! Token counting, the way the engines will count.
//!
//! - With the model's HuggingFace `tokenizer.json` (the `tokenizers` crate) and, for chat, the chat
//!   template from its `tokenizer_config.json` rendered by minijinja the way `transformers` does
//!   (`trim_blocks`, `lstrip_blocks`, loop controls, Python string methods, `raise_exception`,
//!   `add_generation_prompt = true`). As vLLM does, a completion prompt is encoded with the
//!   tokenizer's special tokens (BOS) and a rendered chat without them (the template writes them).
//! - Without one, the conservative fallback: byte-level ids (a byte-level BPE never makes more
//!   tokens than bytes, so slots are never under-counted) and a simple fallback chat template.
//!   The gateway logs a warning at start when it runs this way.
//!
//! The engines receive the ids (`baton.prompt_token_ids`), so both legs agree on them and the
//! usage an engine reports is this tokenizer's count.

use std::fmt;
use std::path::Path;

use minijinja::{Environment, ErrorKind, Value as JValue, context};
use serde_json::Value;

use crate::api::{Endpoint, GatewayError, GenRequest, Prompt};

/// Renders chat messages with the fallback template, for a model configured without its
/// tokenizer: `<|role|>\ncontent\n` per message, then `<|assistant|>\n`. It counts a role marker and
/// a newline per message, close to what real templates add; the byte-level count stays an upper
/// bound of a byte-level BPE's either way. (The simulated engine's model uses the same format, so
/// the demo's counts are exact; a test in the e2e suite checks the two agree.)
pub fn render_chat(messages: &[(String, String)]) -> String {
    let mut s =
        String::with_capacity(messages.iter().map(|(r, c)| r.len() + c.len() + 5).sum::<usize>() + 14);
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

/// Template instructions one chat rendering may execute (minijinja fuel): far above any real
/// template over a large conversation, and a bound on a template that loops.
pub const TEMPLATE_FUEL: u64 = 50_000_000;

/// Prompts longer than this (bytes) are tokenized on the blocking pool, off the request threads.
pub const INLINE_TOKENIZE_BYTES: usize = 16 << 10;

const TEMPLATE_NAME: &str = "chat";

/// A model's tokenizer.
pub struct Tokenizer {
    kind: Kind,
}

enum Kind {
    Fallback,
    Hf { tok: Box<tokenizers::Tokenizer>, chat: Option<Box<ChatTemplate>> },
}

struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// Why a tokenizer could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {reason}")]
pub struct LoadError {
    pub file: String,
    pub reason: String,
    /// The failing file is the `tokenizer_config.json` (else the `tokenizer.json`).
    pub in_config: bool,
}

fn load_err(file: &Path, reason: impl fmt::Display) -> LoadError {
    LoadError { file: file.display().to_string(), reason: reason.to_string(), in_config: true }
}

/// `bos_token` and friends are a string or an `AddedToken` object with `content`.
fn special(cfg: &Value, key: &str) -> String {
    match cfg.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_owned(),
        _ => String::new(),
    }
}

impl Tokenizer {
    /// The byte-level fallback.
    pub fn fallback() -> Self {
        Self { kind: Kind::Fallback }
    }

    /// Loads `tokenizer.json` and, when given, the chat template of `tokenizer_config.json`.
    pub fn load(tokenizer_json: &Path, tokenizer_config: Option<&Path>) -> Result<Self, LoadError> {
        let tok = tokenizers::Tokenizer::from_file(tokenizer_json)
            .map_err(|e| LoadError { in_config: false, ..load_err(tokenizer_json, e) })?;
        let chat = match tokenizer_config {
            None => None,
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| load_err(p, e))?;
                let cfg: Value = serde_json::from_str(&text).map_err(|e| load_err(p, e))?;
                let source = match cfg.get("chat_template") {
                    Some(Value::String(s)) => s.clone(),
                    // A list of named templates: the one called "default".
                    Some(Value::Array(list)) => list
                        .iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                        .and_then(|t| t.get("template").and_then(Value::as_str))
                        .map(str::to_owned)
                        .ok_or_else(|| load_err(p, "chat_template list has no \"default\" entry"))?,
                    _ => return Err(load_err(p, "has no chat_template")),
                };
                Some(Box::new(
                    ChatTemplate::new(source, special(&cfg, "bos_token"), special(&cfg, "eos_token"))
                        .map_err(|e| load_err(p, format!("chat_template: {e}")))?,
                ))
            }
        };
        Ok(Self { kind: Kind::Hf { tok: Box::new(tok), chat } })
    }

    /// True when counts come from the model's own tokenizer.
    pub fn is_exact(&self) -> bool {
        matches!(self.kind, Kind::Hf { .. })
    }

    pub fn describe(&self) -> &'static str {
        match &self.kind {
            Kind::Fallback => "byte-level fallback (an upper bound)",
            Kind::Hf { chat: Some(_), .. } => "tokenizer.json with its chat template",
            Kind::Hf { chat: None, .. } => "tokenizer.json (chat uses the fallback template)",
        }
    }

    /// Renders chat messages as the model's template does (the fallback template without one).
    pub fn render_chat(&self, messages: &[(String, String)]) -> Result<String, GatewayError> {
        match &self.kind {
            Kind::Hf { chat: Some(t), .. } => t.render(messages),
            _ => Ok(render_chat(messages)),
        }
    }

    /// Token ids of a text.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, GatewayError> {
        match &self.kind {
            Kind::Fallback => Ok(text.bytes().map(u32::from).collect()),
            Kind::Hf { tok, .. } => tok
                .encode_fast(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| GatewayError::Internal(format!("tokenizer: {e}"))),
        }
    }

    /// The prompt's token ids.
    pub fn token_ids(&self, req: &GenRequest) -> Result<Vec<u32>, GatewayError> {
        match (req.endpoint, &req.fields.prompt) {
            (Endpoint::Completions, Some(Prompt::Tokens(ids))) => Ok(ids.clone()),
            (Endpoint::Completions, Some(Prompt::Text(t))) => self.encode(t, true),
            (Endpoint::Completions, None) => Ok(Vec::new()),
            (Endpoint::Chat, _) => self.encode(&self.render_chat(&req.messages())?, false),
        }
    }

    /// Bytes of text a request asks to tokenize (decides whether it runs inline).
    pub fn work(req: &GenRequest) -> usize {
        match (&req.fields.prompt, &req.fields.messages) {
            (Some(Prompt::Text(t)), _) => t.len(),
            (_, Some(m)) => m.iter().map(|m| crate::api::content_len(&m.content)).sum(),
            _ => 0,
        }
    }
}

impl ChatTemplate {
    fn new(source: String, bos: String, eos: String) -> Result<Self, minijinja::Error> {
        let mut env = Environment::new();
        // As transformers' sandboxed environment: trim_blocks, lstrip_blocks, loop controls.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(TEMPLATE_FUEL));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<JValue, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(TEMPLATE_NAME, source)?;
        Ok(Self { env, bos, eos })
    }

    fn render(&self, messages: &[(String, String)]) -> Result<String, GatewayError> {
        let msgs: Vec<JValue> =
            messages.iter().map(|(role, content)| context! { role => role, content => content }).collect();
        let bad = |e: minijinja::Error| {
            GatewayError::invalid(
                "messages",
                format!("the model's chat template refused them: {}", e.detail().unwrap_or("error")),
            )
        };
        let t = self.env.get_template(TEMPLATE_NAME).map_err(bad)?;
        t.render(context! {
            messages => msgs,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
            tools => JValue::from(()),
        })
        .map_err(bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> GenRequest {
        GenRequest::parse(Endpoint::Chat, body.as_bytes()).unwrap()
    }

    #[test]
    fn fallback_counts_bytes_and_renders_the_sim_template() {
        let t = Tokenizer::fallback();
        assert!(!t.is_exact());
        let r = chat(r#"{"messages":[{"role":"user","content":"héllo"}]}"#);
        let ids = t.token_ids(&r).unwrap();
        assert_eq!(ids.len(), "<|user|>\nhéllo\n<|assistant|>\n".len());
    }

    #[test]
    fn template_errors_are_a_400_naming_messages() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'system' %}{{ raise_exception('first must be system') }}{% endif %}"
                .into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let e = t.render(&[("user".into(), "x".into())]).unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.to_string().contains("first must be system"), "{e}");
    }

    #[test]
    fn a_looping_template_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert_eq!(t.render(&[]).unwrap_err().status(), 400);
    }

    #[test]
    fn python_string_methods_and_trim_blocks_work() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n  {% if m %}{{ m.content.strip().upper() }}|{{ bos_token }}{% endif %}\n{% endfor %}"
                .into(),
            "<s>".into(),
            String::new(),
        )
        .unwrap();
        // lstrip_blocks drops the indent before `{% if %}`, trim_blocks the newlines after block tags.
        assert_eq!(t.render(&[("user".into(), "  hi ".into())]).unwrap(), "HI|<s>");
    }
}
