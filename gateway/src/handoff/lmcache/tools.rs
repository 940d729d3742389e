//! Tool calls out of a model's text, for the `lmcache` mode: its decode runs on `/v1/completions`
//! over the gateway's token ids (the chat template, tools included, rendered here), so the engine
//! answers text and the calls in it are parsed here, as vLLM's chat endpoint parses them with the
//! `--tool-call-parser` of the same name:
//!
//! - `hermes` (Qwen2.5/Qwen3, Hermes, and most templates that write `<tool_call>`): each call is
//!   `<tool_call>{"name": …, "arguments": {…}}</tool_call>`; the text outside them is the content.
//! - `llama3_json` (Llama 3.1/3.2/3.3 with JSON tool calling): the answer is the call, a JSON object
//!   `{"name": …, "parameters": {…}}` (or `"arguments"`), optionally after `<|python_tag|>`, several
//!   separated by `;`.
//!
//! Text that does not parse as a call stays content, whole: a model that answers in prose is not
//! turned into an error. Where this parts from vLLM's hermes parser: the text between and after
//! calls is kept as content too (vLLM keeps only what comes before the first), trimmed, and a call
//! that does not parse stays text while the others are still calls (vLLM then returns none).

use serde_json::{Value, json};

/// A parser, by vLLM's name for it (`[lmcache] tool_call_parser`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolParser {
    Hermes,
    #[serde(rename = "llama3_json")]
    Llama3Json,
}

impl ToolParser {
    /// The content left and the calls found in `text`.
    pub fn parse(self, text: &str) -> (Option<String>, Vec<Call>) {
        match self {
            Self::Hermes => hermes(text),
            Self::Llama3Json => llama3_json(text),
        }
    }
}

/// One tool call: the function's name and its arguments as a JSON text (as OpenAI sends them).
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

impl Call {
    /// From a JSON object with `name` and `arguments` (or `parameters`).
    fn of(v: &Value) -> Option<Self> {
        let name = v.get("name")?.as_str()?.to_owned();
        let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or_else(|| json!({}));
        let arguments = match args {
            Value::String(s) => s,
            other => other.to_string(),
        };
        Some(Self { name, arguments })
    }

    /// The OpenAI `tool_calls[]` entry, with its id.
    pub fn json(&self, id: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

fn hermes(text: &str) -> (Option<String>, Vec<Call>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let (mut calls, mut content, mut rest) = (Vec::new(), String::new(), text);
    while let Some(at) = rest.find(OPEN) {
        let after = &rest[at + OPEN.len()..];
        // An unclosed last call (the answer was cut by max_tokens) runs to the end.
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        match serde_json::from_str::<Value>(body.trim()).ok().as_ref().and_then(Call::of) {
            Some(c) => {
                content.push_str(&rest[..at]);
                calls.push(c);
            }
            // Not a call: kept as the model wrote it.
            None => content.push_str(&rest[..rest.len() - next.len()]),
        }
        rest = next;
    }
    content.push_str(rest);
    if calls.is_empty() {
        return (Some(text.to_owned()), calls);
    }
    let content = content.trim();
    (if content.is_empty() { None } else { Some(content.to_owned()) }, calls)
}

fn llama3_json(text: &str) -> (Option<String>, Vec<Call>) {
    let body = text.trim_start();
    let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
    if !body.starts_with('{') {
        return (Some(text.to_owned()), Vec::new());
    }
    // Several calls are separated by `;` (vLLM's llama3_json parser); each must parse, or the
    // whole answer stays text.
    let (mut calls, mut rest) = (Vec::new(), body);
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let Some(call) = values.next().and_then(Result::ok).as_ref().and_then(Call::of) else {
            return (Some(text.to_owned()), Vec::new());
        };
        calls.push(call);
        rest = rest[values.byte_offset()..].trim_start();
        match rest.strip_prefix(';') {
            Some(r) => rest = r.trim_start(),
            None if rest.is_empty() => {}
            None => return (Some(text.to_owned()), Vec::new()),
        }
    }
    (None, calls)
}

/// Parses the calls out of every choice of a whole chat answer: `message.tool_calls` (ids
/// `chatcmpl-tool-<request>-<choice>-<n>`), the content left (or `null`), and `finish_reason`
/// `tool_calls` where the model called one (as vLLM's chat endpoint answers).
pub fn apply(parser: ToolParser, body: &mut Value, request: &str) {
    let Some(choices) = body.get_mut("choices").and_then(Value::as_array_mut) else { return };
    for (i, choice) in choices.iter_mut().enumerate() {
        let Some(text) = choice.pointer("/message/content").and_then(Value::as_str).map(str::to_owned) else {
            continue;
        };
        let (content, calls) = parser.parse(&text);
        if calls.is_empty() {
            continue;
        }
        let request = request.trim_start_matches("baton-");
        let list: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(n, c)| c.json(&format!("chatcmpl-tool-{request}-{i}-{n}")))
            .collect();
        choice["message"]["content"] = content.map_or(Value::Null, Value::String);
        choice["message"]["tool_calls"] = Value::Array(list);
        choice["finish_reason"] = json!("tool_calls");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> Call {
        Call { name: name.into(), arguments: arguments.into() }
    }

    #[test]
    fn hermes_calls_and_the_content_around_them() {
        let p = ToolParser::Hermes;
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(
            p.parse(text),
            (
                Some("Let me check.".into()),
                vec![call("get_weather", r#"{"city":"Paris"}"#), call("now", "{}")]
            )
        );
        assert_eq!(p.parse("just prose"), (Some("just prose".into()), vec![]));
        // Not JSON inside: the text stays as written.
        let bad = "<tool_call>not json</tool_call> after";
        assert_eq!(p.parse(bad), (Some(bad.into()), vec![]));
        // Cut by max_tokens before the close: the call is still read.
        assert_eq!(
            p.parse("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}"),
            (None, vec![call("f", r#"{"a":1}"#)])
        );
    }

    #[test]
    fn llama3_json_calls() {
        let p = ToolParser::Llama3Json;
        assert_eq!(
            p.parse("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"),
            (None, vec![call("get_weather", r#"{"city":"Paris"}"#)])
        );
        assert_eq!(
            p.parse("<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"arguments\": \"{\\\"x\\\":1}\"}"),
            (None, vec![call("a", "{}"), call("b", r#"{"x":1}"#)])
        );
        assert_eq!(p.parse("The weather is fine."), (Some("The weather is fine.".into()), vec![]));
        let not_a_call = "{\"answer\": 42}";
        assert_eq!(p.parse(not_a_call), (Some(not_a_call.into()), vec![]));
        let named = |n: &str| serde_json::from_value::<ToolParser>(json!(n)).ok();
        assert_eq!(named("hermes"), Some(ToolParser::Hermes));
        assert_eq!(named("llama3_json"), Some(ToolParser::Llama3Json));
        assert_eq!(named("mistral"), None);
    }
}
