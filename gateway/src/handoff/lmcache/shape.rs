//! The answer in the client's shape: a decoder's `/v1/completions` answers and chunks turned back
//! into the client's endpoint (completions or chat), every choice kept with its index and logprobs
//! (completions' `{tokens, token_logprobs, top_logprobs}` become chat's `content[{token, logprob,
//! bytes, top_logprobs}]`), with the prefiller's first token and corrected usage.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use crate::api::Endpoint;
use crate::handoff::legs::write_str;

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

/// A completions `logprobs` object as chat's: one entry per token with its bytes and alternatives.
pub(super) fn chat_logprobs(lp: &Value) -> Value {
    let Some(tokens) = lp.get("tokens").and_then(Value::as_array) else { return Value::Null };
    let logprobs = lp.get("token_logprobs").and_then(Value::as_array);
    let tops = lp.get("top_logprobs").and_then(Value::as_array);
    let entry =
        |token: &str, logprob: &Value| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
    let content: Vec<Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let token = t.as_str().unwrap_or_default();
            let logprob = logprobs.and_then(|l| l.get(i)).cloned().unwrap_or(Value::Null);
            let top: Vec<Value> = tops
                .and_then(|l| l.get(i))
                .and_then(Value::as_object)
                .map(|m| m.iter().map(|(t, lp)| entry(t, lp)).collect())
                .unwrap_or_default();
            let mut e = entry(token, &logprob);
            e["top_logprobs"] = json!(top);
            e
        })
        .collect();
    json!({"content": content})
}

impl Shaper {
    fn envelope(&self, choices: Vec<Value>, streamed: bool) -> Value {
        let object = match (self.ep, streamed) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices})
    }

    /// One of the decoder's completion choices in the client's shape; `prefix` goes before its text.
    fn choice(&self, c: &Map<String, Value>, prefix: &str, streamed: bool) -> Value {
        let text = c.get("text").and_then(Value::as_str).unwrap_or_default();
        let text = if prefix.is_empty() { text.to_owned() } else { format!("{prefix}{text}") };
        let mut out = c.clone();
        match self.ep {
            Endpoint::Completions => {
                out.insert("text".into(), json!(text));
            }
            Endpoint::Chat => {
                out.remove("text");
                let key = if streamed { "delta" } else { "message" };
                let body = if streamed {
                    json!({"content": text})
                } else {
                    json!({"role": "assistant", "content": text})
                };
                out.insert(key.into(), body);
                let lp =
                    out.get("logprobs").filter(|l| !l.is_null()).map(chat_logprobs).unwrap_or(Value::Null);
                out.insert("logprobs".into(), lp);
            }
        }
        Value::Object(out)
    }

    /// A chunk of the decoder's stream in the client's shape; `prefix` goes before choice 0's text.
    pub(super) fn chunk_of(&self, decoded: &Value, prefix: &str) -> Option<Value> {
        let choices = decoded.get("choices").and_then(Value::as_array)?;
        let list = choices
            .iter()
            .filter_map(Value::as_object)
            .map(|c| {
                let first = c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0;
                self.choice(c, if first { prefix } else { "" }, true)
            })
            .collect();
        Some(self.envelope(list, true))
    }

    /// A chunk of one choice (index 0) with `text` and no logprobs.
    pub(super) fn chunk(&self, text: &str, finish: &Value) -> Value {
        let c = json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish});
        self.chunk_of(&json!({"choices": [c]}), "").unwrap_or(Value::Null)
    }

    pub(super) fn role_chunk(&self, choices: u64) -> Value {
        let list = (0..choices)
            .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
            .collect();
        self.envelope(list, true)
    }

    fn usage(&self, decoded: u64) -> Value {
        let completion = decoded.saturating_add(u64::from(self.extra));
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
               "total_tokens": (self.prompt_tokens as u64).saturating_add(completion)})
    }

    pub(super) fn usage_chunk(&self, decoded: u64) -> Value {
        let mut v = self.envelope(Vec::new(), true);
        v["usage"] = self.usage(decoded);
        v
    }

    /// The whole answer from the decoder's (`None`: nothing decoded, `prefix` is all the text).
    pub(super) fn full(&self, decoded: Option<&Value>, prefix: &str) -> Value {
        let fallback = json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"});
        let choices: Vec<Value> = match decoded.and_then(|d| d.get("choices")).and_then(Value::as_array) {
            Some(list) => list
                .iter()
                .filter_map(Value::as_object)
                .map(|c| {
                    let first = c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0;
                    self.choice(c, if first { prefix } else { "" }, false)
                })
                .collect(),
            None => fallback.as_object().map(|c| vec![self.choice(c, prefix, false)]).unwrap_or_default(),
        };
        let tokens = decoded.and_then(|d| d.pointer("/usage/completion_tokens")).and_then(Value::as_u64);
        let mut v = self.envelope(choices, false);
        v["usage"] = self.usage(tokens.unwrap_or(0));
        v
    }
}

impl Shaper {
    /// What [`Shaper::full`] gives for the decoder's answer `decoded` (its text; `None`: nothing
    /// decoded, `prefix` is all the text), written straight from that text rather than through
    /// `Value`s: the envelope, each choice's fields as the decoder wrote them with the text
    /// (`prefix` before choice 0's) in the client's shape, and the usage. The same JSON (nested
    /// values as the decoder wrote them, so not always the same bytes, and a key given twice inside
    /// one kept twice). `None` where the answer is anything but a plain completion object, where
    /// the scan is not sure of it (`api::scan`), or where a chat choice has logprobs to convert:
    /// `full` is for those, as are answers serde_json would refuse as a `Value`. (Building the
    /// client's answer as `Value`s and writing it cost an lmcache request of one token, nothing
    /// decoded, 16.9k of its 215.3k instructions: `scripts/count-instructions lmcache`,
    /// 2026-11-29.)
    pub(super) fn full_written(&self, decoded: Option<&[u8]>, prefix: &str) -> Option<Vec<u8>> {
        /// Nothing decoded: `full`'s one choice.
        const NOTHING: &[(&str, &[u8])] =
            &[("index", b"0"), ("text", b"\"\""), ("logprobs", b"null"), ("finish_reason", b"\"length\"")];
        let (choices, tokens) = match decoded {
            None => (vec![NOTHING.to_vec()], 0),
            Some(decoded) => read_answer(decoded)?,
        };
        let chat = self.ep == Endpoint::Chat;
        let mut out = Vec::with_capacity(decoded.map_or(0, <[u8]>::len) + 256);
        out.extend_from_slice(b"{\"id\":");
        write_str(&mut out, &self.id).ok()?;
        out.extend_from_slice(if chat {
            b",\"object\":\"chat.completion\",\"created\":"
        } else {
            b",\"object\":\"text_completion\",\"created\":"
        });
        out.extend_from_slice(itoa::Buffer::new().format(self.created).as_bytes());
        out.extend_from_slice(b",\"model\":");
        serde_json::to_writer(&mut out, &self.model).ok()?;
        out.extend_from_slice(b",\"choices\":[");
        for (n, fields) in choices.iter().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            let get = |key: &str| fields.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
            if chat && get("logprobs").is_some_and(|l| l != b"null") {
                return None;
            }
            // As `full`: choice 0 (by its `index`, a missing or odd one read as 0) gets the prefix.
            let first = get("index").is_none_or(|i| {
                std::str::from_utf8(i).ok().and_then(|i| i.parse::<u64>().ok()).is_none_or(|i| i == 0)
            });
            let text = |out: &mut Vec<u8>| write_text(out, get("text"), if first { prefix } else { "" });
            let message = |out: &mut Vec<u8>| {
                out.extend_from_slice(b"{\"role\":\"assistant\",\"content\":");
                text(out)?;
                out.push(b'}');
                Some(())
            };
            let mut sep = b'{';
            let mut key = |out: &mut Vec<u8>, k: &str| {
                out.push(std::mem::replace(&mut sep, b','));
                write_str(out, k).ok();
                out.push(b':');
            };
            for (k, v) in fields {
                match (*k, chat) {
                    ("text", false) => {
                        key(&mut out, k);
                        text(&mut out)?;
                    }
                    ("text", true) => {}
                    ("message", true) => {
                        key(&mut out, k);
                        message(&mut out)?;
                    }
                    ("logprobs", true) => {
                        key(&mut out, k);
                        out.extend_from_slice(b"null");
                    }
                    _ => {
                        key(&mut out, k);
                        out.extend_from_slice(v);
                    }
                }
            }
            if !chat && get("text").is_none() {
                key(&mut out, "text");
                text(&mut out)?;
            }
            if chat && get("message").is_none() {
                key(&mut out, "message");
                message(&mut out)?;
            }
            if chat && get("logprobs").is_none() {
                key(&mut out, "logprobs");
                out.extend_from_slice(b"null");
            }
            if sep == b'{' {
                out.push(b'{');
            }
            out.push(b'}');
        }
        let completion = tokens.saturating_add(u64::from(self.extra));
        let prompt = self.prompt_tokens as u64;
        let mut n = itoa::Buffer::new();
        out.extend_from_slice(b"],\"usage\":{\"prompt_tokens\":");
        out.extend_from_slice(n.format(prompt).as_bytes());
        out.extend_from_slice(b",\"completion_tokens\":");
        out.extend_from_slice(n.format(completion).as_bytes());
        out.extend_from_slice(b",\"total_tokens\":");
        out.extend_from_slice(n.format(prompt.saturating_add(completion)).as_bytes());
        out.extend_from_slice(b"}}");
        Some(out)
    }
}

/// A JSON object's fields: each key and its value's text.
type Fields<'a> = Vec<(&'a str, &'a [u8])>;

/// Each choice's fields (none given twice) and the count of tokens decoded, from a decoder's
/// answer; `None` where the scan is not sure of it.
fn read_answer(decoded: &[u8]) -> Option<(Vec<Fields<'_>>, u64)> {
    use crate::api::scan;
    // What serde_json refuses as a `Value` though it skips it, left to it: text that is not UTF-8,
    // an escaped surrogate (`\ud800`: bytes of `\ud` and `\uD` whether or not one), and nesting
    // deeper than its limit (counted here as every `{` and `[`, in strings too). Numbers that may
    // be out of range the scan leaves to it itself.
    std::str::from_utf8(decoded).ok()?;
    if memchr::memmem::find(decoded, br"\ud").is_some()
        || memchr::memmem::find(decoded, br"\uD").is_some()
        || decoded.iter().filter(|&&b| b == b'{' || b == b'[').count() >= 127
    {
        return None;
    }
    let top = scan::top_fields(decoded).ok()?;
    let mut choices = Vec::with_capacity(1);
    for choice in scan::items(once(&top, "choices")??).ok()? {
        let fields = scan::top_fields(choice).ok()?;
        if fields.iter().enumerate().any(|(i, (k, _))| fields.iter().skip(i + 1).any(|(j, _)| j == k)) {
            return None;
        }
        choices.push(fields);
    }
    let tokens = match once(&top, "usage")? {
        // Not an object (`null`, say): no count.
        Some(usage) if usage.first() != Some(&b'{') => 0,
        None => 0,
        Some(usage) => match scan::top_field(usage, "completion_tokens") {
            Ok(n) => n.and_then(|n| n.parse::<u64>().ok()).unwrap_or(0),
            Err(scan::Unsure) => return None,
        },
    };
    Some((choices, tokens))
}

/// The value of the field `key` of `fields`: `Some(None)` where there is none, `None` where it is
/// there twice (serde_json's `Value` keeps the last; the caller leaves such an answer to it).
fn once<'a>(fields: &[(&str, &'a [u8])], key: &str) -> Option<Option<&'a [u8]>> {
    let mut found = fields.iter().filter(|(k, _)| *k == key).map(|(_, v)| *v);
    let first = found.next();
    if found.next().is_some() { None } else { Some(first) }
}

/// A choice's text as `full` writes it: `prefix`, then the decoder's `text` when it is a string
/// (its JSON text as written: the two strings are joined inside one pair of quotes).
fn write_text(out: &mut Vec<u8>, text: Option<&[u8]>, prefix: &str) -> Option<()> {
    match text.filter(|t| t.first() == Some(&b'"')) {
        Some(t) if prefix.is_empty() => out.extend_from_slice(t),
        Some(t) => {
            write_str(out, prefix).ok()?;
            out.pop();
            out.extend_from_slice(t.get(1..)?);
        }
        None => write_str(out, prefix).ok()?,
    }
    Some(())
}

impl Shaper {
    /// A whole chat answer as a stream (the answer with tool calls, parsed once it has ended):
    /// the role, each choice's content and tool calls in one delta with its finish reason, the
    /// usage when asked, `[DONE]`.
    pub(super) fn stream_whole(&self, full: &Value, include_usage: bool) -> Vec<Bytes> {
        let choices = full.get("choices").and_then(Value::as_array).cloned().unwrap_or_default();
        let mut out = vec![sse(&self.role_chunk(choices.len() as u64))];
        for c in &choices {
            let mut delta = serde_json::Map::new();
            if let Some(text) = c.pointer("/message/content").and_then(Value::as_str) {
                delta.insert("content".into(), json!(text));
            }
            if let Some(calls) = c.pointer("/message/tool_calls").and_then(Value::as_array) {
                let indexed: Vec<Value> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, call)| {
                        let mut call = call.clone();
                        call["index"] = json!(i);
                        call
                    })
                    .collect();
                delta.insert("tool_calls".into(), Value::Array(indexed));
            }
            let choice = json!({"index": c["index"], "delta": delta, "logprobs": c["logprobs"],
                                "finish_reason": c["finish_reason"]});
            out.push(sse(&self.envelope(vec![choice], true)));
        }
        if include_usage {
            let mut v = self.envelope(Vec::new(), true);
            v["usage"] = full["usage"].clone();
            out.push(sse(&v));
        }
        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }
}

pub(super) fn sse(v: &Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    json_into(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// `v` as compact JSON onto `out`: through serde_json's writer, not `Display` (which goes through
/// `core::fmt`, a call for every piece).
pub(super) fn json_into(out: &mut Vec<u8>, v: &Value) {
    // A `Value` has string keys only, and a `Vec` takes every write: this cannot fail.
    let _ = serde_json::to_writer(out, v);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_logprobs_become_chat_entries() {
        let lp = json!({"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0],
                        "top_logprobs": [{"a": -0.5, "x": -2.0}, {"b": -1.0}], "text_offset": [0, 1]});
        let c = chat_logprobs(&lp);
        assert_eq!(
            c["content"][0],
            json!({"token": "a", "logprob": -0.5, "bytes": [97],
            "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "x", "logprob": -2.0, "bytes": [120]}]})
        );
        assert_eq!(c["content"][1]["logprob"], -1.0);
    }

    fn chat_shaper() -> Shaper {
        Shaper {
            ep: Endpoint::Chat,
            id: "chatcmpl-1".into(),
            model: json!("m"),
            created: 0,
            prompt_tokens: 3,
            extra: 0,
        }
    }

    #[test]
    fn every_choice_is_kept_in_the_chat_shape() {
        let s = chat_shaper();
        let decoded = json!({"choices": [
            {"index": 0, "text": "x", "logprobs": null, "finish_reason": "length"},
            {"index": 1, "text": "y", "logprobs": {"tokens": ["y"], "token_logprobs": [-1.0], "top_logprobs": [{}]}, "finish_reason": "stop"}],
            "usage": {"completion_tokens": 2}});
        let v = s.full(Some(&decoded), "");
        assert_eq!(v["choices"][1]["message"]["content"], "y");
        assert_eq!(v["choices"][1]["finish_reason"], "stop");
        assert_eq!(v["choices"][1]["logprobs"]["content"][0]["token"], "y");
        assert_eq!(v["usage"]["total_tokens"], 5);
    }

    /// `full_written` gives `full`'s JSON for every answer it takes, and takes the plain ones:
    /// completions and chat, with and without a prefix to join, whatever the choices hold.
    #[test]
    fn an_answer_written_from_its_text_is_the_one_built_from_values() {
        let answers = [
            r#"{"id":"cmpl-x","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":null}],"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1},"kv_transfer_params":null}"#,
            r#" { "choices" : [ { "index" : 1 , "text" : "a\"b\\u00e9\n" } , {"text":"c","index":0} ] , "usage" : { "completion_tokens" : 7 } } "#,
            r#"{"choices":[{"text":"é ☃","extra":{"a":[1,2.5e3,-0.0,true,null]}}],"usage":null}"#,
            r#"{"choices":[{"index":"0","text":5},{"index":-1,"text":null},{"index":2.0}],"usage":{"completion_tokens":1.5}}"#,
            r#"{"choices":[{"index":0,"text":"x","message":{"role":"user"},"logprobs":null}],"usage":{"completion_tokens":-1}}"#,
            r#"{"choices":[{}],"usage":{}}"#,
            r#"{"choices":[]}"#,
            r#"{"choices":[{"text":"b"}],"usage":[3]}"#,
            // Left to `full` (or refused by both):
            r#"{"choices":[{"index":0,"text":"x","logprobs":{"tokens":["x"],"token_logprobs":[-1.0],"top_logprobs":[{}]}}]}"#,
            r#"{"choices":[{"text":"a","text":"b"}]}"#,
            r#"{"choices":[],"choices":[{"text":"b"}]}"#,
            r#"{"choices":[1,{"text":"b"}]}"#,
            r#"{"choices":{"text":"b"}}"#,
            r#"{"usage":{"completion_tokens":3}}"#,
            r#"{"choices":[{"te\u0078t":"b"}]}"#,
            r#"[{"choices":[]}]"#,
            r#"{"choices":[{"text":"b"}]"#,
            // What serde_json skips but refuses as a `Value` (or may: numbers near `f64`'s limits,
            // nesting near its depth limit) is left to it.
            r#"{"choices":[{"text":"\ud800"}]}"#,
            r#"{"choices":[{"text":"b","x":1e400}]}"#,
            r#"{"choices":[{"text":"b","x":1e-400,"y":-0,"z":1.5e300}]}"#,
        ];
        let near_limits = [
            format!(r#"{{"choices":[{{"text":"b","x":{}1{}}}]}}"#, "[".repeat(124), "]".repeat(124)),
            format!(r#"{{"choices":[{{"text":"b","x":{}1{}}}]}}"#, "[".repeat(125), "]".repeat(125)),
            format!(r#"{{"choices":[{{"text":"b","x":1{}}}]}}"#, "0".repeat(320)),
        ];
        let mut written = 0;
        for ep in [Endpoint::Completions, Endpoint::Chat] {
            for prefix in ["", "Hello", "q\"\\\u{1}é"] {
                let s = Shaper { ep, extra: u32::from(!prefix.is_empty()), ..chat_shaper() };
                // Not UTF-8: refused by both.
                assert_eq!(s.full_written(Some(b"{\"choices\":[{\"text\":\"\xff\"}]}"), prefix), None);
                // Nothing decoded.
                let got: Value = serde_json::from_slice(&s.full_written(None, prefix).unwrap()).unwrap();
                assert_eq!(got, s.full(None, prefix));
                for a in answers.iter().copied().chain(near_limits.iter().map(String::as_str)) {
                    let got = s.full_written(Some(a.as_bytes()), prefix);
                    let Ok(parsed) = serde_json::from_str::<Value>(a) else {
                        assert_eq!(got, None, "{a}");
                        continue;
                    };
                    let Some(got) = got else { continue };
                    written += 1;
                    let got: Value = serde_json::from_slice(&got).unwrap();
                    assert_eq!(got, s.full(Some(&parsed), prefix), "{ep:?} {prefix:?} {a}");
                }
            }
        }
        // The first eight answers, in both shapes, each with three prefixes; the one with logprobs
        // too, but only for completions.
        assert_eq!(written, 8 * 6 + 3, "answers written from their text");
    }

    /// A chat answer with tool calls, parsed (hermes) and streamed in one piece: the calls in the
    /// message with ids, no content left, `finish_reason` `tool_calls`; the stream's delta carries
    /// them indexed, then the usage and `[DONE]`.
    #[test]
    fn tool_calls_parsed_whole_and_streamed_in_one_piece() {
        let s = chat_shaper();
        let text =
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let decoded = json!({"choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "stop"}],
                             "usage": {"completion_tokens": 9}});
        let mut full = s.full(Some(&decoded), "");
        super::super::tools::apply(super::super::tools::ToolParser::Hermes, &mut full, "baton-7");
        let m = &full["choices"][0]["message"];
        assert_eq!(m["content"], Value::Null, "{full}");
        assert_eq!(
            m["tool_calls"][0]["function"],
            json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"})
        );
        assert_eq!(m["tool_calls"][0]["id"], "chatcmpl-tool-7-0-0");
        assert_eq!(full["choices"][0]["finish_reason"], "tool_calls");
        let chunks: Vec<String> =
            s.stream_whole(&full, true).iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
        assert_eq!(chunks.len(), 4, "{chunks:?}");
        let delta: Value = serde_json::from_str(chunks[1].trim().trim_start_matches("data: ")).unwrap();
        assert_eq!(delta["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
        assert_eq!(delta["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(delta["choices"][0]["finish_reason"], "tool_calls");
        assert!(chunks[2].contains("\"total_tokens\":12"), "{}", chunks[2]);
        assert_eq!(chunks[3], "data: [DONE]\n\n");
    }
}
