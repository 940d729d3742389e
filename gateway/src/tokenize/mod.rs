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

use minijinja::{Environment, ErrorKind, Value as JValue};
use serde_json::{Map, Value};

use crate::api::{Endpoint, GatewayError, GenRequest, PromptRef};

pub mod bound;
pub mod fast;
pub mod hot;
pub mod pool;
pub mod reuse;
#[cfg(any(test, feature = "toy-tokenizers"))]
#[doc(hidden)]
pub mod toy;

/// Renders chat messages with the fallback template (`baton_dataplane::contract::fallback_chat`),
/// for a model configured without its tokenizer. It counts a role marker and a newline per message,
/// close to what real templates add; the byte-level count stays an upper bound of a byte-level BPE's
/// either way.
pub use baton_dataplane::contract::fallback_chat as render_chat;

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
    Hf {
        tok: Box<tokenizers::Tokenizer>,
        /// The direct path to its ids, or why it takes `tokenizers`' own pipeline.
        fast: Result<Box<fast::Fast>, fast::Off>,
        chat: Option<Box<ChatTemplate>>,
        /// A rendered chat's pieces reused across requests, or why not.
        reuse: Result<reuse::Reuse, reuse::Off>,
        /// Bytes one token stands for at most, or why the tokenizer has no such bound.
        bound: Result<bound::Bound, String>,
    },
}

struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// The template loops over a message's content parts (vLLM's "openai" content format): parts
    /// are passed as they came; otherwise their texts are joined with newlines ("string" format).
    parts: bool,
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

    /// Loads `tokenizer.json` and, when given, the chat template of `tokenizer_config.json` (or of the
    /// `chat_template.jinja` beside it when the config holds none).
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
                    // transformers 4.43 and later save the template beside the config as
                    // `chat_template.jinja` (vLLM reads it from there too).
                    _ => {
                        let file = p.with_file_name("chat_template.jinja");
                        std::fs::read_to_string(&file).map_err(|e| {
                            load_err(p, format!("has no chat_template, and {}: {e}", file.display()))
                        })?
                    }
                };
                Some(Box::new(
                    ChatTemplate::new(source, special(&cfg, "bos_token"), special(&cfg, "eos_token"))
                        .map_err(|e| load_err(p, format!("chat_template: {e}")))?,
                ))
            }
        };
        let reuse = reuse::Reuse::new(&tok, reuse::DEFAULT_CAPACITY_TOKENS);
        let bound = bound::Bound::of(&tok);
        let fast = fast::Fast::new(&tok);
        Ok(Self { kind: Kind::Hf { tok: Box::new(tok), fast, chat, reuse, bound } })
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

    /// Renders a chat request as the model's template does (the fallback template without one).
    pub fn render_chat(&self, req: &GenRequest) -> Result<String, GatewayError> {
        match &self.kind {
            Kind::Hf { chat: Some(t), .. } => t.render(&req.raw),
            _ => Ok(render_chat(&req.messages())),
        }
    }

    /// Why a rendered chat's token ids are not reused across requests (`None`: they are).
    pub fn reuse_off(&self) -> Option<String> {
        match &self.kind {
            Kind::Fallback => None,
            Kind::Hf { reuse, .. } => reuse.as_ref().err().map(ToString::to_string),
        }
    }

    /// Why ids take `tokenizers`' own pipeline rather than the direct path ([`fast`]; `None`: they
    /// do not).
    pub fn fast_off(&self) -> Option<String> {
        match &self.kind {
            Kind::Fallback => None,
            Kind::Hf { fast, .. } => fast.as_ref().err().map(ToString::to_string),
        }
    }

    /// The reuse of rendered chats' token ids, when on.
    pub fn reuse(&self) -> Option<&reuse::Reuse> {
        match &self.kind {
            Kind::Hf { reuse: Ok(r), .. } => Some(r),
            _ => None,
        }
    }

    /// The token reuse's counters, for `/metrics`.
    pub fn scrape(&self, s: &mut crate::telemetry::Scrape) {
        let Kind::Hf { reuse: Ok(r), .. } = &self.kind else { return };
        let help =
            "Tokens of rendered chats, by whether their ids were reused from an earlier request or encoded.";
        for (how, n) in [("reused", &r.reused), ("encoded", &r.encoded)] {
            s.counter(
                "baton_tokenize_chat_tokens_total",
                help,
                &[("ids", how)],
                n.load(std::sync::atomic::Ordering::Relaxed) as f64,
            );
        }
        s.gauge(
            "baton_tokenize_reuse_cached_tokens",
            "Token ids the chat reuse cache holds (bounded).",
            &[],
            r.cached_tokens() as f64,
        );
    }

    /// Token ids of a rendered chat: as [`Self::encode`] without special tokens, its pieces
    /// reused when the tokenizer allows ([`reuse`]).
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>, GatewayError> {
        match &self.kind {
            Kind::Hf { reuse: Ok(r), .. } => {
                r.encode(text, |piece| self.ids(piece, false)).map_err(tokenizer_error)
            }
            _ => self.encode(text, false),
        }
    }

    /// Token ids of a text.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, GatewayError> {
        self.ids(text, add_special_tokens).map_err(tokenizer_error)
    }

    /// Token ids of a text: the direct path when the tokenizer has one.
    fn ids(&self, text: &str, add_special_tokens: bool) -> tokenizers::Result<Vec<u32>> {
        match &self.kind {
            Kind::Fallback => Ok(text.bytes().map(u32::from).collect()),
            Kind::Hf { tok, fast: Ok(f), .. } => f.encode(tok, text, add_special_tokens),
            Kind::Hf { tok, .. } => tok.encode_fast(text, add_special_tokens).map(|e| e.get_ids().to_vec()),
        }
    }

    /// The prompt's token ids.
    pub fn token_ids(&self, req: &GenRequest) -> Result<Vec<u32>, GatewayError> {
        self.token_ids_within(req, u64::MAX)
    }

    /// The prompt's token ids, or `ContextLength` (a lower bound, `at_least`) without tokenizing
    /// when its text is too long to fit `limit` tokens whatever it says ([`bound`]).
    pub fn token_ids_within(&self, req: &GenRequest, limit: u64) -> Result<Vec<u32>, GatewayError> {
        let within = |text: &str, param| self.refuse_beyond(text, limit, param);
        match (req.endpoint, req.prompt()) {
            (Endpoint::Completions, Some(PromptRef::Tokens(ids))) => crate::api::prompt_ids(ids),
            (Endpoint::Completions, Some(PromptRef::Text(t))) => {
                within(t, "prompt")?;
                self.encode(t, true)
            }
            (Endpoint::Completions, None) => Ok(Vec::new()),
            (Endpoint::Chat, _) => {
                let text = self.render_chat(req)?;
                within(&text, "messages")?;
                self.encode_chat(&text)
            }
        }
    }

    /// `ContextLength` (a lower bound, `at_least`) when `text` cannot fit `limit` tokens whatever it
    /// says ([`bound`]); `param` names the field that holds it. Takes a division, not a tokenizer.
    pub fn refuse_beyond(&self, text: &str, limit: u64, param: &'static str) -> Result<(), GatewayError> {
        match self.bound().map(|b| b.min_tokens(text.len())) {
            Some(tokens) if tokens > limit => {
                Err(GatewayError::ContextLength { tokens, limit, param, at_least: true })
            }
            _ => Ok(()),
        }
    }

    /// Bytes one token stands for at most (the byte-level fallback: one).
    pub fn bound(&self) -> Option<bound::Bound> {
        match &self.kind {
            Kind::Fallback => Some(bound::Bound { bytes_per_token: 1 }),
            Kind::Hf { bound, .. } => bound.as_ref().ok().copied(),
        }
    }

    /// Why over-long prompts are tokenized before they are refused, when they are.
    pub fn bound_off(&self) -> Option<&str> {
        match &self.kind {
            Kind::Hf { bound: Err(why), .. } => Some(why),
            _ => None,
        }
    }

    /// Bytes of text a request asks to tokenize (decides whether it runs inline).
    pub fn work(req: &GenRequest) -> usize {
        match (req.prompt(), req.chat()) {
            (Some(PromptRef::Text(t)), _) => t.len(),
            (_, Some(m)) => m.iter().filter_map(|m| m.get("content")).map(crate::api::content_len).sum(),
            _ => 0,
        }
    }
}

fn tokenizer_error(e: tokenizers::Error) -> GatewayError {
    GatewayError::Internal(crate::api::Internal::Tokenizer(e.to_string()))
}

/// The local time now in `format` (strftime directives).
fn strftime_now(format: &str) -> Result<String, minijinja::Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        ));
    }
    Ok(chrono::Local::now().format_with_items(items.into_iter()).to_string())
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
        // transformers' `strftime_now(format)`: `datetime.now().strftime(format)`, the local clock
        // (Llama 3.2's and vLLM's tool templates date the system prompt with it). A directive
        // strftime does not know is the template's error, not a panic.
        env.add_function("strftime_now", |format: String| -> Result<JValue, minijinja::Error> {
            strftime_now(&format).map(JValue::from)
        });
        // transformers' own `tojson`: Python's json.dumps (no HTML escaping, `", "` and `": "`).
        env.add_filter(
            "tojson",
            |v: JValue, kwargs: minijinja::value::Kwargs| -> Result<JValue, minijinja::Error> {
                let indent: Option<usize> = kwargs.get("indent")?;
                let v = serde_json::to_value(&v)
                    .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, e.to_string()))?;
                let mut out = String::new();
                py_json(&v, indent, 0, &mut out);
                Ok(JValue::from_safe_string(out))
            },
        );
        let parts = loops_over_content(&source);
        env.add_template_owned(TEMPLATE_NAME, source)?;
        Ok(Self { env, bos, eos, parts })
    }

    /// Renders the request as vLLM asks transformers to: the whole messages (tool calls' arguments
    /// decoded from JSON, content parts flattened or kept by the content format), `tools` as
    /// pydantic dumps them, `documents`, `add_generation_prompt` (default true), the special tokens
    /// and `chat_template_kwargs`; `continue_final_message` cuts after the last message's text.
    fn render(&self, raw: &Map<String, Value>) -> Result<String, GatewayError> {
        let bad = |e: minijinja::Error| {
            GatewayError::invalid(
                "messages",
                format!("the model's chat template refused them: {}", e.detail().unwrap_or("error")),
            )
        };
        let messages: Vec<Value> = raw
            .get("messages")
            .and_then(Value::as_array)
            .map(|m| m.iter().map(|m| self.message(m)).collect())
            .unwrap_or_default();
        let last_text = messages.last().and_then(|m| m.get("content")).map(last_text_of).unwrap_or_default();
        let tools =
            raw.get("tools").and_then(Value::as_array).map(|t| t.iter().map(tool_dump).collect::<Vec<_>>());
        let flag = |k: &str, default: bool| raw.get(k).and_then(Value::as_bool).unwrap_or(default);
        let cont = flag("continue_final_message", false);
        let mut ctx = Map::new();
        if let Some(Value::Object(kw)) = raw.get("chat_template_kwargs") {
            ctx.extend(kw.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert("tools".into(), tools.map_or(Value::Null, Value::Array));
        ctx.insert("documents".into(), raw.get("documents").cloned().unwrap_or(Value::Null));
        ctx.insert("add_generation_prompt".into(), Value::Bool(flag("add_generation_prompt", !cont)));
        ctx.insert("bos_token".into(), Value::String(self.bos.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos.clone()));
        let t = self.env.get_template(TEMPLATE_NAME).map_err(bad)?;
        let rendered = t.render(JValue::from_serialize(&ctx)).map_err(bad)?;
        if !cont {
            return Ok(rendered);
        }
        // As transformers: the text ends where the final message's (stripped) text last appears.
        let tail = last_text.trim();
        match rendered.rfind(tail) {
            Some(at) => Ok(rendered[..at + tail.len()].to_owned()),
            None => Err(GatewayError::invalid(
                "continue_final_message",
                "the final message does not appear in the chat the template rendered",
            )),
        }
    }

    /// A message as vLLM's parser hands it to the template: role and content (a string in the
    /// "string" content format: parts' texts joined with newlines, none as ""; the parts otherwise),
    /// and only `tool_calls` (arguments decoded from JSON), `tool_call_id` and `name` beside.
    fn message(&self, m: &Value) -> Value {
        let role = m.get("role").cloned().unwrap_or(Value::Null);
        let content = match m.get("content") {
            None | Some(Value::Null) if self.parts => Value::Array(Vec::new()),
            None | Some(Value::Null) => Value::String(String::new()),
            Some(Value::Array(parts)) if !self.parts => Value::String(
                parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            Some(c) => c.clone(),
        };
        let mut out = Map::new();
        out.insert("role".into(), role.clone());
        out.insert("content".into(), content);
        if role == "assistant"
            && let Some(Value::Array(calls)) = m.get("tool_calls")
        {
            let mut calls = calls.clone();
            for call in &mut calls {
                if let Some(args) = call.pointer_mut("/function/arguments")
                    && let Some(decoded) = args.as_str().and_then(|s| serde_json::from_str::<Value>(s).ok())
                {
                    *args = decoded;
                }
            }
            out.insert("tool_calls".into(), Value::Array(calls));
        }
        if role == "tool"
            && let Some(id) = m.get("tool_call_id")
        {
            out.insert("tool_call_id".into(), id.clone());
        }
        if let Some(name @ Value::String(_)) = m.get("name") {
            out.insert("name".into(), name.clone());
        }
        Value::Object(out)
    }
}

/// The text of a message's content: the string, or its last text part (as transformers takes it).
fn last_text_of(c: &Value) -> String {
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .rev()
            .find_map(|p| p.get("text").and_then(Value::as_str))
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// A tool as vLLM hands it to the template (pydantic's dump of its model): the fields in the
/// model's order, absent optional ones as null.
fn tool_dump(t: &Value) -> Value {
    let f = t.get("function");
    let field = |k: &str| f.and_then(|f| f.get(k)).cloned().unwrap_or(Value::Null);
    let mut function = Map::new();
    function.insert("name".into(), field("name"));
    function.insert("description".into(), field("description"));
    function.insert("parameters".into(), field("parameters"));
    if let Some(strict) = f.and_then(|f| f.get("strict")) {
        function.insert("strict".into(), strict.clone());
    }
    let mut out = Map::new();
    out.insert("type".into(), t.get("type").cloned().unwrap_or_else(|| Value::String("function".into())));
    out.insert("function".into(), Value::Object(function));
    Value::Object(out)
}

/// Whether a template iterates over a message's content (a `{% for … in ….content %}` tag), as
/// vLLM's content-format detection decides.
fn loops_over_content(source: &str) -> bool {
    source.split("{%").skip(1).filter_map(|tag| tag.split("%}").next()).any(|tag| {
        let tag = tag.trim_start_matches(['-', '+']).trim_start();
        tag.starts_with("for ")
            && tag.split_once(" in ").is_some_and(|(_, over)| {
                over.contains(".content") || over.contains("['content']") || over.contains("[\"content\"]")
            })
    })
}

/// Python's `json.dumps(v, ensure_ascii=False, indent=indent)`: `", "` and `": "` without an
/// indent, `","` and newlines with one.
fn py_json(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                py_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                py_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(m: &[(&str, &str)]) -> Map<String, Value> {
        let list: Vec<Value> = m.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect();
        let mut raw = Map::new();
        raw.insert("messages".into(), Value::Array(list));
        raw
    }

    #[test]
    fn tojson_is_pythons_and_parts_follow_the_content_format() {
        let t = ChatTemplate::new(
            "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let mut raw = msgs(&[("user", "x")]);
        raw.insert("tools".into(), serde_json::json!([{"type": "function", "function": {"name": "f<>", "parameters": {"b": 1, "a": [1, 2]}}}]));
        assert_eq!(
            t.render(&raw).unwrap(),
            "[{\"type\": \"function\", \"function\": {\"name\": \"f<>\", \"description\": null, \"parameters\": {\"b\": 1, \"a\": [1, 2]}}}]|{\n  \"type\": \"function\",\n  \"function\": {\n    \"name\": \"f<>\",\n    \"description\": null,\n    \"parameters\": {\n      \"b\": 1,\n      \"a\": [\n        1,\n        2\n      ]\n    }\n  }\n}"
        );
        let flat =
            ChatTemplate::new("{{ messages[0].content }}".into(), String::new(), String::new()).unwrap();
        let looped = ChatTemplate::new(
            "{%- for p in messages[0].content %}{{ p.text }};{% endfor %}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert!(!flat.parts && looped.parts);
        let mut raw = Map::new();
        raw.insert("messages".into(), serde_json::json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]));
        assert_eq!(flat.render(&raw).unwrap(), "a\nb");
        assert_eq!(looped.render(&raw).unwrap(), "a;b;");
    }

    /// transformers 4.43+ save the template as `chat_template.jinja` beside a config without one;
    /// it is read from there, and a config with neither is refused naming both.
    #[test]
    fn the_chat_template_is_read_from_chat_template_jinja_when_the_config_has_none() {
        let dir = std::env::temp_dir().join(format!("baton-tok-jinja-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vocab = [("[UNK]".to_owned(), 0u32), ("hi".to_owned(), 1)].into_iter().collect();
        let model = tokenizers::models::wordlevel::WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        tokenizers::Tokenizer::new(model).save(dir.join("tokenizer.json"), false).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"bos_token": "<s>"}"#).unwrap();
        let (json, cfg) = (dir.join("tokenizer.json"), dir.join("tokenizer_config.json"));
        let e = Tokenizer::load(&json, Some(&cfg)).unwrap_err();
        assert!(e.in_config && e.reason.contains("chat_template.jinja"), "{e}");
        std::fs::write(
            dir.join("chat_template.jinja"),
            "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}",
        )
        .unwrap();
        let t = Tokenizer::load(&json, Some(&cfg)).unwrap();
        assert_eq!(
            t.render_chat(&chat(r#"{"messages":[{"role":"user","content":"hi"}]}"#)).unwrap(),
            "<s>[hi]"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

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
        let e = t.render(&msgs(&[("user", "x")])).unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.to_string().contains("first must be system"), "{e}");
    }

    /// Llama 3.2's dating of the system prompt, as its template writes it: `strftime_now` is
    /// defined and formats the local clock; a bad directive is the template's 400.
    #[test]
    fn strftime_now_dates_the_prompt_as_transformers_does() {
        let t = ChatTemplate::new(
            "{%- if not date_string is defined %}{%- if strftime_now is defined %}\
             {%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}\
             {%- set date_string = \"26 Jul 2024\" %}{%- endif %}{%- endif %}Today Date: {{ date_string }}"
                .into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let before = chrono::Local::now().format("%d %b %Y").to_string();
        let text = t.render(&msgs(&[("user", "x")])).unwrap();
        let after = chrono::Local::now().format("%d %b %Y").to_string();
        assert!(text == format!("Today Date: {before}") || text == format!("Today Date: {after}"), "{text}");
        assert_eq!(before.len(), 11, "{before}");
        let bad =
            ChatTemplate::new("{{ strftime_now('%Q %') }}".into(), String::new(), String::new()).unwrap();
        let e = bad.render(&msgs(&[("user", "x")])).unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.to_string().contains("strftime_now: invalid format"), "{e}");
    }

    #[test]
    fn a_looping_template_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert_eq!(t.render(&msgs(&[])).unwrap_err().status(), 400);
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
        assert_eq!(t.render(&msgs(&[("user", "  hi ")])).unwrap(), "HI|<s>");
    }
}
