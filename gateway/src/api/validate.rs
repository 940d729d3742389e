//! Validation of a completion or chat request before anything is reserved: every field the gateway
//! knows, by type and range, after the OpenAI API reference and the checks vLLM applies (its
//! protocol models and `SamplingParams._verify_args`). Where the two differ the engine's rule wins:
//! the gateway must neither refuse what the engine serves nor forward what it refuses (the
//! differences are listed in `docs/gateway.md`, "Validation").
//!
//! Every error names the field's path as `param` (`messages[3].content[0].type`), its value (a short,
//! escaped prefix) and the rule. `null` is the same as an absent field, as in both APIs. Fields the
//! gateway does not know pass untouched: engines add their own (`kv_transfer_params`, vLLM's
//! sampling extras).
//!
//! It reads the JSON object and never changes it.

use serde_json::{Map, Value};

use super::{Endpoint, GatewayError, Object, Problem};

/// Most choices one request may ask for (`n`, `best_of`): OpenAI's limit; each choice is a sequence
/// the decoder runs.
pub const MAX_N: u64 = 128;
/// Temperatures under this are greedy sampling (vLLM's `_SAMPLING_EPS`, which refuses `n > 1`
/// there; `vllm/sampling_params.py`, 0.32).
const GREEDY_BELOW: f64 = 1e-5;
/// Most `logprobs` (completions) or `top_logprobs` (chat): vLLM's default `--max-logprobs`, and
/// OpenAI's limit for chat.
pub const MAX_LOGPROBS: u64 = 20;
/// Characters of a client's value quoted in an error (never echo input whole).
const SHOWN_CHARS: usize = 40;

type Obj = Map<String, Value>;
type Checked = Result<(), GatewayError>;

/// Checks a request body (a JSON object) for `ep`.
pub fn check(ep: Endpoint, body: &Object) -> Checked {
    optional(body, "model", "", Kind::Str)?;
    sampling(body)?;
    streaming(body)?;
    match ep {
        Endpoint::Completions => completions(body),
        Endpoint::Chat => chat(body),
    }
}

/// A short, escaped rendering of a client's value.
fn shown(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() <= SHOWN_CHARS {
        return s;
    }
    let mut out: String = s.chars().take(SHOWN_CHARS).collect();
    out.push('…');
    out
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn join(base: &str, key: &str) -> String {
    if base.is_empty() { key.to_owned() } else { format!("{base}.{key}") }
}

fn missing(param: String) -> GatewayError {
    GatewayError::Invalid { param, problem: Problem::Missing, reason: "is required".into() }
}

fn wrong_type(param: String, want: &str, got: &Value) -> GatewayError {
    let reason = format!("must be {want}, got {} {}", type_name(got), shown(got));
    GatewayError::Invalid { param, problem: Problem::Type, reason }
}

fn bad_value(param: String, got: &Value, rule: impl std::fmt::Display) -> GatewayError {
    GatewayError::Invalid { param, problem: Problem::Value, reason: format!("{} {rule}", shown(got)) }
}

/// The JSON type a field must have.
#[derive(Clone, Copy)]
enum Kind {
    Str,
    Bool,
    Int,
    Num,
    Obj,
    Arr,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Str => "a string",
            Self::Bool => "a boolean",
            Self::Int => "an integer",
            Self::Num => "a number",
            Self::Obj => "an object",
            Self::Arr => "an array",
        }
    }

    fn fits(self, v: &Value) -> bool {
        match self {
            Self::Str => v.is_string(),
            Self::Bool => v.is_boolean(),
            Self::Int => v.is_i64() || v.is_u64(),
            Self::Num => v.is_number(),
            Self::Obj => v.is_object(),
            Self::Arr => v.is_array(),
        }
    }
}

/// An object whose fields the checks look up: the request's top level, an [`Object`] (most names
/// looked up there are not in it, and its keys' bits say so at once), or an object inside it.
trait Fields {
    fn field(&self, key: &str) -> Option<&Value>;
}

impl Fields for Obj {
    /// Scanned for ([`super::object::field`]).
    fn field(&self, key: &str) -> Option<&Value> {
        super::object::field(self, key)
    }
}

impl Fields for Object {
    #[inline(always)]
    fn field(&self, key: &str) -> Option<&Value> {
        self.get(key)
    }
}

/// The field `key` of `obj`.
#[inline(always)]
fn get<'a, O: Fields + ?Sized>(obj: &'a O, key: &str) -> Option<&'a Value> {
    obj.field(key)
}

/// The field `key` of `obj` (at path `base`) when present and not null, checked to be of `kind`.
/// Inlined, so that in the request's top level a literal `key` not there is one test of a bit.
#[inline(always)]
fn optional<'a, O: Fields + ?Sized>(
    obj: &'a O,
    key: &str,
    base: &str,
    kind: Kind,
) -> Result<Option<&'a Value>, GatewayError> {
    match get(obj, key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) if kind.fits(v) => Ok(Some(v)),
        Some(v) => Err(not_of(kind, base, key, v)),
    }
}

/// The error for the field `key` (at path `base`) whose value `v` is not of `kind`.
#[cold]
fn not_of(kind: Kind, base: &str, key: &str, v: &Value) -> GatewayError {
    wrong_type(join(base, key), kind.name(), v)
}

/// The field `key`, which must be present, not null and of `kind`.
fn required<'a, O: Fields + ?Sized>(
    obj: &'a O,
    key: &str,
    base: &str,
    kind: Kind,
) -> Result<&'a Value, GatewayError> {
    optional(obj, key, base, kind)?.ok_or_else(|| missing(join(base, key)))
}

/// A number field in a range; `open_low`: the low end is excluded.
#[inline(always)]
fn number(obj: &Object, key: &str, low: f64, open_low: bool, high: f64) -> Result<Option<f64>, GatewayError> {
    match obj.get(key) {
        None => Ok(None),
        Some(v) => number_in(v, key, low, open_low, high),
    }
}

/// [`number`] for the value `v` of the field `key`.
fn number_in(v: &Value, key: &str, low: f64, open_low: bool, high: f64) -> Result<Option<f64>, GatewayError> {
    match v {
        Value::Null => return Ok(None),
        Value::Number(_) => {}
        _ => return Err(not_of(Kind::Num, "", key, v)),
    }
    let x = v.as_f64().unwrap_or(f64::NAN);
    let below = if open_low { x <= low } else { x < low };
    if below || x > high || !x.is_finite() {
        let open = if open_low { "(" } else { "[" };
        let hi = if high.is_finite() { high.to_string() } else { "inf".into() };
        return Err(bad_value(key.into(), v, format!("is not in {open}{low}, {hi}]")));
    }
    Ok(Some(x))
}

/// An integer field in `[low, high]`.
#[inline(always)]
fn integer(obj: &Object, key: &str, base: &str, low: i64, high: u64) -> Result<Option<i64>, GatewayError> {
    match obj.get(key) {
        None => Ok(None),
        Some(v) => integer_in(v, key, base, low, high),
    }
}

/// [`integer`] for the value `v` of the field `key`.
fn integer_in(v: &Value, key: &str, base: &str, low: i64, high: u64) -> Result<Option<i64>, GatewayError> {
    if v.is_null() {
        return Ok(None);
    }
    if !Kind::Int.fits(v) {
        return Err(not_of(Kind::Int, base, key, v));
    }
    // An integer above i64::MAX is above every high bound used here.
    let x = v.as_i64();
    match x {
        Some(x) if x >= low && (x < 0 || x.unsigned_abs() <= high) => Ok(Some(x)),
        _ => Err(bad_value(join(base, key), v, format!("is not in [{low}, {high}]"))),
    }
}

/// Fields both endpoints share: sampling, penalties, stops, seeds, token limits.
fn sampling(b: &Object) -> Checked {
    number(b, "temperature", 0.0, false, 2.0)?;
    number(b, "top_p", 0.0, true, 1.0)?;
    // vLLM: -1 (or 0) disables it.
    integer(b, "top_k", "", -1, u64::from(u32::MAX))?;
    number(b, "min_p", 0.0, false, 1.0)?;
    number(b, "presence_penalty", -2.0, false, 2.0)?;
    number(b, "frequency_penalty", -2.0, false, 2.0)?;
    number(b, "repetition_penalty", 0.0, true, f64::INFINITY)?;
    let n = integer(b, "n", "", 1, MAX_N)?.unwrap_or(1);
    if n > 1 && get(b, "temperature").and_then(Value::as_f64).is_some_and(|t| t < GREEDY_BELOW) {
        // vLLM: greedy sampling makes every choice the same sequence.
        return Err(bad_value(
            "n".into(),
            &Value::from(n),
            "must be 1 when temperature is under 1e-5 (greedy sampling)",
        ));
    }
    if let Some(best) = integer(b, "best_of", "", 1, MAX_N)?
        && best < n
    {
        return Err(bad_value("best_of".into(), &Value::from(best), format!("must be at least n ({n})")));
    }
    integer(b, "seed", "", i64::MIN, i64::MAX.unsigned_abs())?;
    let max = max_tokens(b)?;
    if let Some(min) = integer(b, "min_tokens", "", 0, u64::from(u32::MAX))?
        && let Some((key, max)) = max
        && min > max
    {
        return Err(bad_value(
            "min_tokens".into(),
            &Value::from(min),
            format!("must be at most {key} ({max})"),
        ));
    }
    stop(b)?;
    if let Some(Value::Array(ids)) = optional(b, "stop_token_ids", "", Kind::Arr)? {
        for (i, id) in ids.iter().enumerate() {
            token_id(id, &format!("stop_token_ids[{i}]"))?;
        }
    }
    if let Some(Value::Object(bias)) = optional(b, "logit_bias", "", Kind::Obj)? {
        for (k, v) in bias {
            let param = format!("logit_bias.{}", k.chars().take(SHOWN_CHARS).collect::<String>());
            if k.parse::<u32>().is_err() {
                return Err(bad_value(param, &Value::String(k.clone()), "is not a token id"));
            }
            // vLLM clamps the bias to [-100, 100]; it refuses only what is no number.
            if !v.is_number() {
                return Err(wrong_type(param, "a number", v));
            }
        }
    }
    for key in ["ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "echo"] {
        optional(b, key, "", Kind::Bool)?;
    }
    optional(b, "user", "", Kind::Str)?;
    if let Some(Value::Object(rf)) = optional(b, "response_format", "", Kind::Obj)? {
        response_format(rf)?;
    }
    Ok(())
}

/// `max_tokens` and `max_completion_tokens` (the one that applies, with its name).
fn max_tokens(b: &Object) -> Result<Option<(&'static str, i64)>, GatewayError> {
    let plain = integer(b, "max_tokens", "", 1, u64::from(u32::MAX))?;
    let completion = integer(b, "max_completion_tokens", "", 1, u64::from(u32::MAX))?;
    Ok(completion.map(|m| ("max_completion_tokens", m)).or(plain.map(|m| ("max_tokens", m))))
}

fn token_id(v: &Value, param: &str) -> Checked {
    match v.as_u64() {
        Some(id) if id <= u64::from(u32::MAX) => Ok(()),
        Some(_) => Err(bad_value(param.into(), v, "is not a token id")),
        None if v.is_number() => Err(bad_value(param.into(), v, "is not a token id (an integer from 0)")),
        None => Err(wrong_type(param.into(), "an integer", v)),
    }
}

/// `stop`: a string or a list of strings, none empty (vLLM refuses an empty stop string).
fn stop(b: &Object) -> Checked {
    match get(b, "stop") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s.is_empty() => Err(bad_value(
            "stop".into(),
            &Value::String(String::new()),
            "is empty; a stop string needs a character",
        )),
        Some(Value::String(_)) => Ok(()),
        Some(Value::Array(list)) => {
            for (i, s) in list.iter().enumerate() {
                match s {
                    Value::String(t) if t.is_empty() => {
                        return Err(bad_value(
                            format!("stop[{i}]"),
                            s,
                            "is empty; a stop string needs a character",
                        ));
                    }
                    Value::String(_) => {}
                    other => return Err(wrong_type(format!("stop[{i}]"), "a string", other)),
                }
            }
            Ok(())
        }
        Some(v) => Err(wrong_type("stop".into(), "a string or an array of strings", v)),
    }
}

fn response_format(rf: &Obj) -> Checked {
    let kind = required(rf, "type", "response_format", Kind::Str)?;
    match kind.as_str() {
        Some("text" | "json_object") => Ok(()),
        Some("json_schema") => {
            let Value::Object(js) = required(rf, "json_schema", "response_format", Kind::Obj)? else {
                return Ok(());
            };
            required(js, "name", "response_format.json_schema", Kind::Str)?;
            optional(js, "schema", "response_format.json_schema", Kind::Obj)?;
            optional(js, "strict", "response_format.json_schema", Kind::Bool)?;
            Ok(())
        }
        // vLLM's own.
        Some("structural_tag") => Ok(()),
        _ => Err(bad_value(
            "response_format.type".into(),
            kind,
            "is not one of text, json_object, json_schema, structural_tag",
        )),
    }
}

/// `stream`, `stream_options` (only with `stream`), `prompt_logprobs` (never with `stream`).
fn streaming(b: &Object) -> Checked {
    let stream = optional(b, "stream", "", Kind::Bool)?.and_then(Value::as_bool).unwrap_or(false);
    if let Some(Value::Object(o)) = optional(b, "stream_options", "", Kind::Obj)? {
        if !stream {
            return Err(GatewayError::invalid("stream_options", "is allowed only when stream is true"));
        }
        optional(o, "include_usage", "stream_options", Kind::Bool)?;
        optional(o, "continuous_usage_stats", "stream_options", Kind::Bool)?;
    }
    if let Some(v) = get(b, "prompt_logprobs").filter(|v| !v.is_null()) {
        if stream {
            return Err(GatewayError::invalid("prompt_logprobs", "is not available when stream is true"));
        }
        if v.as_i64() != Some(-1) {
            integer(b, "prompt_logprobs", "", 0, MAX_LOGPROBS)?;
        }
    }
    Ok(())
}

fn completions(b: &Object) -> Checked {
    prompt(get(b, "prompt").filter(|v| !v.is_null()).ok_or_else(|| missing("prompt".into()))?)?;
    // vLLM's completions take -1 for the whole vocabulary, else at most --max-logprobs.
    if get(b, "logprobs").and_then(Value::as_i64) != Some(-1) {
        integer(b, "logprobs", "", 0, MAX_LOGPROBS)?;
    }
    optional(b, "suffix", "", Kind::Str)?;
    Ok(())
}

/// A completion's `prompt`: a string, a list of token ids, or a list of either.
fn prompt(p: &Value) -> Checked {
    match p {
        Value::String(_) => Ok(()),
        Value::Array(list) if list.is_empty() => Err(bad_value("prompt".into(), p, "is empty")),
        Value::Array(list) => match list.first() {
            Some(Value::String(_)) => list.iter().enumerate().try_for_each(|(i, s)| match s {
                Value::String(_) => Ok(()),
                other => Err(wrong_type(format!("prompt[{i}]"), "a string, as the first prompt", other)),
            }),
            Some(Value::Array(_)) => list.iter().enumerate().try_for_each(|(i, ids)| match ids {
                Value::Array(ids) if ids.is_empty() => Err(bad_value(format!("prompt[{i}]"), p, "is empty")),
                Value::Array(ids) => {
                    ids.iter().enumerate().try_for_each(|(j, id)| token_id(id, &format!("prompt[{i}][{j}]")))
                }
                other => {
                    Err(wrong_type(format!("prompt[{i}]"), "a list of token ids, as the first prompt", other))
                }
            }),
            _ => list.iter().enumerate().try_for_each(|(i, id)| token_id(id, &format!("prompt[{i}]"))),
        },
        other => {
            Err(wrong_type("prompt".into(), "a string, a list of token ids, or a list of prompts", other))
        }
    }
}

const ROLES: &str = "system, developer, user, assistant, tool, function";

fn chat(b: &Object) -> Checked {
    let Value::Array(messages) = required(b, "messages", "", Kind::Arr)? else { return Ok(()) };
    if messages.is_empty() {
        return Err(bad_value(
            "messages".into(),
            &Value::Array(Vec::new()),
            "is empty; a chat needs a message",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        message(m, &format!("messages[{i}]"))?;
    }
    let logprobs = optional(b, "logprobs", "", Kind::Bool)?.and_then(Value::as_bool).unwrap_or(false);
    if let Some(k) = integer(b, "top_logprobs", "", 0, MAX_LOGPROBS)?
        && !logprobs
    {
        return Err(bad_value("top_logprobs".into(), &Value::from(k), "needs logprobs set to true"));
    }
    let tools = tools(b)?;
    tool_choice(b, &tools)?;
    optional(b, "parallel_tool_calls", "", Kind::Bool)?;
    let add = optional(b, "add_generation_prompt", "", Kind::Bool)?.and_then(Value::as_bool).unwrap_or(true);
    let cont =
        optional(b, "continue_final_message", "", Kind::Bool)?.and_then(Value::as_bool).unwrap_or(false);
    if add && cont {
        return Err(GatewayError::invalid(
            "continue_final_message",
            "cannot be true with add_generation_prompt true (the default)",
        ));
    }
    if cont && messages.last().and_then(|m| m.get("role")).and_then(Value::as_str) != Some("assistant") {
        return Err(GatewayError::invalid(
            "continue_final_message",
            "needs the last message to be the assistant's",
        ));
    }
    optional(b, "chat_template_kwargs", "", Kind::Obj)?;
    optional(b, "documents", "", Kind::Arr)?;
    if get(b, "chat_template").is_some_and(|v| !v.is_null()) {
        // vLLM refuses a request's own template unless started with --trust-request-chat-template;
        // the gateway counts tokens with the model's template, so another one would miscount.
        return Err(GatewayError::invalid(
            "chat_template",
            "is not accepted; the model's own chat template is used",
        ));
    }
    Ok(())
}

fn message(m: &Value, at: &str) -> Checked {
    let Value::Object(m) = m else { return Err(wrong_type(at.into(), "an object", m)) };
    let role = required(m, "role", at, Kind::Str)?;
    let content = m.get("content").filter(|c| !c.is_null());
    optional(m, "name", at, Kind::Str)?;
    match role.as_str().unwrap_or_default() {
        "system" | "developer" | "user" | "function" => {
            content_of(content.ok_or_else(|| missing(join(at, "content")))?, at)?;
        }
        "tool" => {
            content_of(content.ok_or_else(|| missing(join(at, "content")))?, at)?;
            optional(m, "tool_call_id", at, Kind::Str)?;
        }
        "assistant" => {
            let calls = tool_calls(m, at)?;
            match content {
                Some(c) => content_of(c, at)?,
                // An assistant turn that only calls tools has no content.
                None if calls || m.get("reasoning_content").is_some() => {}
                None => return Err(missing(join(at, "content"))),
            }
        }
        _ => return Err(bad_value(join(at, "role"), role, format!("is not one of {ROLES}"))),
    }
    Ok(())
}

/// Part types vLLM's chat parser accepts.
const PART_TYPES: &str = "text, input_text, refusal, thinking, image_url, input_image, image_embeds, \
                          input_audio, audio_url, video_url, file";

fn content_of(c: &Value, at: &str) -> Checked {
    let param = join(at, "content");
    let Value::Array(parts) = c else {
        return if c.is_string() {
            Ok(())
        } else {
            Err(wrong_type(param, "a string or an array of parts", c))
        };
    };
    for (i, part) in parts.iter().enumerate() {
        let at = format!("{param}[{i}]");
        let Value::Object(p) = part else { return Err(wrong_type(at, "an object", part)) };
        let kind = required(p, "type", &at, Kind::Str)?;
        match kind.as_str().unwrap_or_default() {
            "text" | "input_text" => drop(required(p, "text", &at, Kind::Str)?),
            "refusal" => drop(required(p, "refusal", &at, Kind::Str)?),
            "thinking" => {}
            "image_url" => url_part(p, "image_url", &at)?,
            "audio_url" => url_part(p, "audio_url", &at)?,
            "video_url" => url_part(p, "video_url", &at)?,
            "input_image" | "image_embeds" | "file" => {}
            "input_audio" => {
                let Value::Object(a) = required(p, "input_audio", &at, Kind::Obj)? else { continue };
                let base = join(&at, "input_audio");
                required(a, "data", &base, Kind::Str)?;
                required(a, "format", &base, Kind::Str)?;
            }
            _ => return Err(bad_value(join(&at, "type"), kind, format!("is not one of {PART_TYPES}"))),
        }
    }
    Ok(())
}

/// `{"image_url": {"url": "..."}}` (vLLM also takes the URL as a bare string).
fn url_part(p: &Obj, key: &str, at: &str) -> Checked {
    match p.get(key) {
        Some(Value::String(_)) => Ok(()),
        Some(Value::Object(u)) => required(u, "url", &join(at, key), Kind::Str).map(drop),
        Some(v) if !v.is_null() => Err(wrong_type(join(at, key), "an object with a url", v)),
        _ => Err(missing(join(at, key))),
    }
}

/// An assistant message's `tool_calls`; true when it has some.
fn tool_calls(m: &Obj, at: &str) -> Result<bool, GatewayError> {
    let Some(Value::Array(calls)) = optional(m, "tool_calls", at, Kind::Arr)? else { return Ok(false) };
    for (i, call) in calls.iter().enumerate() {
        let at = format!("{at}.tool_calls[{i}]");
        let Value::Object(c) = call else { return Err(wrong_type(at, "an object", call)) };
        required(c, "id", &at, Kind::Str)?;
        if let Some(t) = optional(c, "type", &at, Kind::Str)?
            && t != "function"
        {
            return Err(bad_value(join(&at, "type"), t, "is not function"));
        }
        let Value::Object(f) = required(c, "function", &at, Kind::Obj)? else { continue };
        let fat = join(&at, "function");
        required(f, "name", &fat, Kind::Str)?;
        let args = required(f, "arguments", &fat, Kind::Str)?;
        // vLLM decodes them for the chat template; text that is no JSON fails there.
        if serde_json::from_str::<Value>(args.as_str().unwrap_or_default()).is_err() {
            return Err(bad_value(join(&fat, "arguments"), args, "is not JSON text"));
        }
    }
    Ok(!calls.is_empty())
}

/// `tools`; the names of the functions they declare.
fn tools(b: &Object) -> Result<Vec<&str>, GatewayError> {
    let Some(Value::Array(list)) = optional(b, "tools", "", Kind::Arr)? else { return Ok(Vec::new()) };
    let mut names = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(t) = t else { return Err(wrong_type(at, "an object", t)) };
        let kind = required(t, "type", &at, Kind::Str)?;
        if kind != "function" {
            return Err(bad_value(join(&at, "type"), kind, "is not function"));
        }
        let Value::Object(f) = required(t, "function", &at, Kind::Obj)? else { continue };
        let fat = join(&at, "function");
        names.push(required(f, "name", &fat, Kind::Str)?.as_str().unwrap_or_default());
        optional(f, "description", &fat, Kind::Str)?;
        optional(f, "parameters", &fat, Kind::Obj)?;
        optional(f, "strict", &fat, Kind::Bool)?;
    }
    Ok(names)
}

/// `tool_choice`: `none`, `auto`, `required` or a named function, which `tools` must declare.
fn tool_choice(b: &Object, tools: &[&str]) -> Checked {
    let Some(choice) = get(b, "tool_choice").filter(|v| !v.is_null()) else { return Ok(()) };
    let has_tools = get(b, "tools").is_some_and(|t| !t.is_null());
    match choice {
        Value::String(s) if s == "none" => return Ok(()),
        Value::String(s) if s == "auto" || s == "required" => {}
        Value::String(_) => {
            return Err(bad_value(
                "tool_choice".into(),
                choice,
                "is not one of none, auto, required, or a named tool",
            ));
        }
        Value::Object(o) => {
            let t = required(o, "type", "tool_choice", Kind::Str)?;
            if t != "function" {
                return Err(bad_value("tool_choice.type".into(), t, "is not function"));
            }
            let Value::Object(f) = required(o, "function", "tool_choice", Kind::Obj)? else { return Ok(()) };
            let name = required(f, "name", "tool_choice.function", Kind::Str)?;
            if has_tools && !tools.contains(&name.as_str().unwrap_or_default()) {
                return Err(bad_value("tool_choice.function.name".into(), name, "names no tool in tools"));
            }
        }
        other => return Err(wrong_type("tool_choice".into(), "a string or an object", other)),
    }
    if !has_tools {
        return Err(GatewayError::invalid(
            "tool_choice",
            "needs tools (vLLM refuses a tool choice without tools)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check_json(ep: Endpoint, v: Value) -> Result<(), GatewayError> {
        let Value::Object(m) = v else { panic!("not an object") };
        check(ep, &Object::from(m))
    }

    #[test]
    fn errors_name_the_path_the_value_and_the_rule() {
        let e = check_json(
            Endpoint::Chat,
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "bogus"}]}]}),
        )
        .unwrap_err();
        let body = e.body();
        assert_eq!(body["error"]["param"], "messages[0].content[1].type");
        assert_eq!(body["error"]["code"], "invalid_value");
        assert!(e.to_string().contains("\"bogus\""), "{e}");
        let e = check_json(Endpoint::Completions, json!({"prompt": "x", "temperature": 7})).unwrap_err();
        assert_eq!(e.to_string(), "temperature: 7 is not in [0, 2]");
        let e = check_json(Endpoint::Completions, json!({"prompt": "x", "max_tokens": -5})).unwrap_err();
        assert_eq!((e.body()["error"]["param"].as_str(), e.code()), (Some("max_tokens"), "invalid_value"));
    }

    #[test]
    fn long_values_are_cut() {
        let long = "x".repeat(10_000);
        let e =
            check_json(Endpoint::Completions, json!({"prompt": "x", "stop": [1], "user": long})).unwrap_err();
        assert!(e.to_string().len() < 100, "{e}");
        let e =
            check_json(Endpoint::Completions, json!({"prompt": "x", "user": 5, "seed": long})).unwrap_err();
        assert!(e.to_string().len() < 120, "{e}");
    }

    #[test]
    fn nulls_and_unknown_fields_pass() {
        check_json(
            Endpoint::Chat,
            json!({"messages": [{"role": "user", "content": "hi"}], "temperature": null, "tools": null,
                   "kv_transfer_params": {"x": 1}, "my_engine_flag": [1, "two"]}),
        )
        .unwrap();
    }
}
