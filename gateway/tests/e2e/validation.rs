//! Validation at the gateway: one row per rule, each a valid request with one field broken, sent
//! over HTTP to both endpoints; every row must come back 400 with its `param` and `code`, and none
//! may reach an engine (the simulated engines' received logs stay empty).

use serde_json::{Map, Value, json};

use super::*;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ep {
    Completions,
    Chat,
    Both,
}

/// `(endpoint, fields set on the valid base request, fields removed, expected param, expected code)`.
type Row = (Ep, Value, &'static [&'static str], &'static str, &'static str);

const VALUE: &str = "invalid_value";
const TYPE: &str = "invalid_type";
const MISSING: &str = "missing_required_parameter";

fn user(content: Value) -> Value {
    json!([{"role": "user", "content": content}])
}

fn with_assistant(a: Value) -> Value {
    json!([{"role": "user", "content": "hi"}, a])
}

fn call(f: Value) -> Value {
    with_assistant(json!({"role": "assistant", "content": null, "tool_calls": [f]}))
}

fn tool(f: Value) -> Value {
    json!([{"type": "function", "function": f}])
}

fn rows() -> Vec<Row> {
    let weather = tool(json!({"name": "weather", "parameters": {"type": "object"}}));
    let good_call =
        json!({"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}});
    let mut rows: Vec<Row> = vec![
        // Sampling, both endpoints.
        (Ep::Both, json!({"temperature": 7}), &[], "temperature", VALUE),
        (Ep::Both, json!({"temperature": -0.1}), &[], "temperature", VALUE),
        (Ep::Both, json!({"temperature": "hot"}), &[], "temperature", TYPE),
        (Ep::Both, json!({"top_p": 0}), &[], "top_p", VALUE),
        (Ep::Both, json!({"top_p": 1.5}), &[], "top_p", VALUE),
        (Ep::Both, json!({"top_p": "x"}), &[], "top_p", TYPE),
        (Ep::Both, json!({"top_k": -2}), &[], "top_k", VALUE),
        (Ep::Both, json!({"top_k": 1.5}), &[], "top_k", TYPE),
        (Ep::Both, json!({"min_p": 2}), &[], "min_p", VALUE),
        (Ep::Both, json!({"presence_penalty": 3}), &[], "presence_penalty", VALUE),
        (Ep::Both, json!({"presence_penalty": -2.5}), &[], "presence_penalty", VALUE),
        (Ep::Both, json!({"frequency_penalty": 2.01}), &[], "frequency_penalty", VALUE),
        (Ep::Both, json!({"frequency_penalty": true}), &[], "frequency_penalty", TYPE),
        (Ep::Both, json!({"repetition_penalty": 0}), &[], "repetition_penalty", VALUE),
        (Ep::Both, json!({"repetition_penalty": -1}), &[], "repetition_penalty", VALUE),
        (Ep::Both, json!({"n": 0}), &[], "n", VALUE),
        (Ep::Both, json!({"n": 129}), &[], "n", VALUE),
        (Ep::Both, json!({"n": 2.5}), &[], "n", TYPE),
        (Ep::Both, json!({"n": 2, "temperature": 0}), &[], "n", VALUE),
        (Ep::Both, json!({"n": 2, "temperature": 0.000_001}), &[], "n", VALUE),
        (Ep::Both, json!({"seed": "abc"}), &[], "seed", TYPE),
        (Ep::Both, json!({"seed": 1e30}), &[], "seed", TYPE),
        (Ep::Both, json!({"seed": u64::MAX}), &[], "seed", VALUE),
        (Ep::Both, json!({"max_tokens": -5}), &[], "max_tokens", VALUE),
        (Ep::Both, json!({"max_tokens": 0}), &[], "max_tokens", VALUE),
        (Ep::Both, json!({"max_tokens": "many"}), &[], "max_tokens", TYPE),
        (Ep::Both, json!({"max_tokens": 4_294_967_296_u64}), &[], "max_tokens", VALUE),
        (Ep::Both, json!({"min_tokens": -1}), &[], "min_tokens", VALUE),
        (Ep::Both, json!({"min_tokens": 10}), &[], "min_tokens", VALUE),
        (Ep::Both, json!({"stop": ""}), &[], "stop", VALUE),
        (Ep::Both, json!({"stop": [""]}), &[], "stop[0]", VALUE),
        (Ep::Both, json!({"stop": ["a", 3]}), &[], "stop[1]", TYPE),
        (Ep::Both, json!({"stop": 5}), &[], "stop", TYPE),
        (Ep::Both, json!({"stop_token_ids": [1, -2]}), &[], "stop_token_ids[1]", VALUE),
        (Ep::Both, json!({"stop_token_ids": ["a"]}), &[], "stop_token_ids[0]", TYPE),
        (Ep::Both, json!({"stop_token_ids": 5}), &[], "stop_token_ids", TYPE),
        (Ep::Both, json!({"logit_bias": {"abc": 1}}), &[], "logit_bias.abc", VALUE),
        (Ep::Both, json!({"logit_bias": {"50256": "x"}}), &[], "logit_bias.50256", TYPE),
        (Ep::Both, json!({"logit_bias": [1]}), &[], "logit_bias", TYPE),
        (Ep::Both, json!({"response_format": {"type": "yaml"}}), &[], "response_format.type", VALUE),
        (Ep::Both, json!({"response_format": {}}), &[], "response_format.type", MISSING),
        (
            Ep::Both,
            json!({"response_format": {"type": "json_schema"}}),
            &[],
            "response_format.json_schema",
            MISSING,
        ),
        (
            Ep::Both,
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
            &[],
            "response_format.json_schema.name",
            MISSING,
        ),
        (Ep::Both, json!({"response_format": "json"}), &[], "response_format", TYPE),
        (Ep::Both, json!({"stream": "yes"}), &[], "stream", TYPE),
        (Ep::Both, json!({"stream_options": {"include_usage": true}}), &[], "stream_options", VALUE),
        (
            Ep::Both,
            json!({"stream": true, "stream_options": {"include_usage": "y"}}),
            &[],
            "stream_options.include_usage",
            TYPE,
        ),
        (Ep::Both, json!({"stream": true, "prompt_logprobs": 1}), &[], "prompt_logprobs", VALUE),
        (Ep::Both, json!({"prompt_logprobs": 50}), &[], "prompt_logprobs", VALUE),
        (Ep::Both, json!({"model": 5}), &[], "model", TYPE),
        (Ep::Both, json!({"ignore_eos": "no"}), &[], "ignore_eos", TYPE),
        (Ep::Both, json!({"user": 5}), &[], "user", TYPE),
        // Completions.
        (Ep::Completions, json!({}), &["prompt"], "prompt", MISSING),
        (Ep::Completions, json!({"prompt": null}), &[], "prompt", MISSING),
        (Ep::Completions, json!({"prompt": 5}), &[], "prompt", TYPE),
        (Ep::Completions, json!({"prompt": []}), &[], "prompt", VALUE),
        (Ep::Completions, json!({"prompt": [1, "a"]}), &[], "prompt[1]", TYPE),
        (Ep::Completions, json!({"prompt": [1, -1]}), &[], "prompt[1]", VALUE),
        (Ep::Completions, json!({"prompt": ["a", 1]}), &[], "prompt[1]", TYPE),
        (Ep::Completions, json!({"prompt": [[1, 2], [3, "x"]]}), &[], "prompt[1][1]", TYPE),
        (Ep::Completions, json!({"prompt": [[1], []]}), &[], "prompt[1]", VALUE),
        (Ep::Completions, json!({"prompt": [[1], "a"]}), &[], "prompt[1]", TYPE),
        (Ep::Completions, json!({"prompt": vec!["a"; 65]}), &[], "prompt", VALUE),
        (Ep::Completions, json!({"logprobs": 21}), &[], "logprobs", VALUE),
        (Ep::Completions, json!({"logprobs": true}), &[], "logprobs", TYPE),
        (Ep::Completions, json!({"logprobs": -2}), &[], "logprobs", VALUE),
        (Ep::Completions, json!({"n": 2, "best_of": 1}), &[], "best_of", VALUE),
        (Ep::Completions, json!({"best_of": 0}), &[], "best_of", VALUE),
        (Ep::Completions, json!({"echo": "yes"}), &[], "echo", TYPE),
        (Ep::Completions, json!({"suffix": 5}), &[], "suffix", TYPE),
        // Chat: messages and their parts.
        (Ep::Chat, json!({}), &["messages"], "messages", MISSING),
        (Ep::Chat, json!({"messages": []}), &[], "messages", VALUE),
        (Ep::Chat, json!({"messages": "hi"}), &[], "messages", TYPE),
        (Ep::Chat, json!({"messages": [5]}), &[], "messages[0]", TYPE),
        (Ep::Chat, json!({"messages": [{"content": "x"}]}), &[], "messages[0].role", MISSING),
        (Ep::Chat, json!({"messages": [{"role": "wizard", "content": "x"}]}), &[], "messages[0].role", VALUE),
        (Ep::Chat, json!({"messages": [{"role": 5, "content": "x"}]}), &[], "messages[0].role", TYPE),
        (Ep::Chat, json!({"messages": [{"role": "user"}]}), &[], "messages[0].content", MISSING),
        (Ep::Chat, json!({"messages": user(Value::Null)}), &[], "messages[0].content", MISSING),
        (Ep::Chat, json!({"messages": user(json!(5))}), &[], "messages[0].content", TYPE),
        (Ep::Chat, json!({"messages": user(json!([5]))}), &[], "messages[0].content[0]", TYPE),
        (
            Ep::Chat,
            json!({"messages": user(json!([{"text": "a"}]))}),
            &[],
            "messages[0].content[0].type",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": user(json!([{"type": "bogus"}]))}),
            &[],
            "messages[0].content[0].type",
            VALUE,
        ),
        (
            Ep::Chat,
            json!({"messages": user(json!([{"type": "text"}]))}),
            &[],
            "messages[0].content[0].text",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": user(json!([{"type": "text", "text": "a"}, {"type": "text", "text": 5}]))}),
            &[],
            "messages[0].content[1].text",
            TYPE,
        ),
        (
            Ep::Chat,
            json!({"messages": user(json!([{"type": "image_url"}]))}),
            &[],
            "messages[0].content[0].image_url",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": user(json!([{"type": "image_url", "image_url": {}}]))}),
            &[],
            "messages[0].content[0].image_url.url",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": user(json!([{"type": "input_audio", "input_audio": {"data": "x"}}]))}),
            &[],
            "messages[0].content[0].input_audio.format",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": [{"role": "system"}, {"role": "user", "content": "x"}]}),
            &[],
            "messages[0].content",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": with_assistant(json!({"role": "assistant"}))}),
            &[],
            "messages[1].content",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "tool", "tool_call_id": "c"}]}),
            &[],
            "messages[2].content",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": [{"role": "user", "content": "x", "name": 5}]}),
            &[],
            "messages[0].name",
            TYPE,
        ),
        // Chat: tool calls in the history.
        (
            Ep::Chat,
            json!({"messages": with_assistant(json!({"role": "assistant", "tool_calls": "x"}))}),
            &[],
            "messages[1].tool_calls",
            TYPE,
        ),
        (
            Ep::Chat,
            json!({"messages": call(json!({"type": "function", "function": {"name": "f", "arguments": "{}"}}))}),
            &[],
            "messages[1].tool_calls[0].id",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": call(json!({"id": "c", "type": "x", "function": {"name": "f", "arguments": "{}"}}))}),
            &[],
            "messages[1].tool_calls[0].type",
            VALUE,
        ),
        (
            Ep::Chat,
            json!({"messages": call(json!({"id": "c", "type": "function"}))}),
            &[],
            "messages[1].tool_calls[0].function",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": call(json!({"id": "c", "type": "function", "function": {"arguments": "{}"}}))}),
            &[],
            "messages[1].tool_calls[0].function.name",
            MISSING,
        ),
        (
            Ep::Chat,
            json!({"messages": call(json!({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}))}),
            &[],
            "messages[1].tool_calls[0].function.arguments",
            VALUE,
        ),
        (
            Ep::Chat,
            json!({"messages": call(json!({"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}))}),
            &[],
            "messages[1].tool_calls[0].function.arguments",
            TYPE,
        ),
        // Chat: tools and tool_choice.
        (Ep::Chat, json!({"tools": "x"}), &[], "tools", TYPE),
        (Ep::Chat, json!({"tools": [5]}), &[], "tools[0]", TYPE),
        (Ep::Chat, json!({"tools": [{"type": "retrieval"}]}), &[], "tools[0].type", VALUE),
        (Ep::Chat, json!({"tools": [{"type": "function"}]}), &[], "tools[0].function", MISSING),
        (Ep::Chat, json!({"tools": tool(json!({}))}), &[], "tools[0].function.name", MISSING),
        (
            Ep::Chat,
            json!({"tools": tool(json!({"name": "f", "parameters": "x"}))}),
            &[],
            "tools[0].function.parameters",
            TYPE,
        ),
        (
            Ep::Chat,
            json!({"tools": tool(json!({"name": "f", "description": 5}))}),
            &[],
            "tools[0].function.description",
            TYPE,
        ),
        (Ep::Chat, json!({"tools": weather, "tool_choice": "sometimes"}), &[], "tool_choice", VALUE),
        (Ep::Chat, json!({"tool_choice": "required"}), &[], "tool_choice", VALUE),
        (
            Ep::Chat,
            json!({"tools": weather, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            &[],
            "tool_choice.function.name",
            VALUE,
        ),
        (
            Ep::Chat,
            json!({"tools": weather, "tool_choice": {"type": "function"}}),
            &[],
            "tool_choice.function",
            MISSING,
        ),
        (Ep::Chat, json!({"tools": weather, "tool_choice": 5}), &[], "tool_choice", TYPE),
        // Chat: logprobs, template inputs, token limits.
        (Ep::Chat, json!({"logprobs": 1}), &[], "logprobs", TYPE),
        (Ep::Chat, json!({"top_logprobs": 5}), &[], "top_logprobs", VALUE),
        (Ep::Chat, json!({"logprobs": true, "top_logprobs": 21}), &[], "top_logprobs", VALUE),
        (Ep::Chat, json!({"logprobs": true, "top_logprobs": -1}), &[], "top_logprobs", VALUE),
        (Ep::Chat, json!({"continue_final_message": true}), &[], "continue_final_message", VALUE),
        (
            Ep::Chat,
            json!({"continue_final_message": true, "add_generation_prompt": false}),
            &[],
            "continue_final_message",
            VALUE,
        ),
        (Ep::Chat, json!({"add_generation_prompt": "y"}), &[], "add_generation_prompt", TYPE),
        (Ep::Chat, json!({"chat_template": "{{ messages }}"}), &[], "chat_template", VALUE),
        (Ep::Chat, json!({"chat_template_kwargs": []}), &[], "chat_template_kwargs", TYPE),
        (Ep::Chat, json!({"parallel_tool_calls": "y"}), &[], "parallel_tool_calls", TYPE),
        (Ep::Chat, json!({"max_completion_tokens": 0}), &[], "max_completion_tokens", VALUE),
        (Ep::Chat, json!({"max_completion_tokens": "x"}), &[], "max_completion_tokens", TYPE),
        (Ep::Chat, json!({"max_completion_tokens": 3, "min_tokens": 5}), &[], "min_tokens", VALUE),
    ];
    // A tool call of the right shape passes: the rows above fail for their one broken field.
    rows.push((Ep::Chat, json!({"messages": call(good_call), "tools": "x"}), &[], "tools", TYPE));
    rows
}

fn base(ep: Ep) -> Map<String, Value> {
    let v = match ep {
        Ep::Completions => json!({"model": "baton-sim", "prompt": "hello", "max_tokens": 4}),
        _ => json!({"model": "baton-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    };
    let Value::Object(m) = v else { unreachable!() };
    m
}

/// The table, run against the gateway: each row is a 400 naming its field, nothing reaches an
/// engine, and the valid base requests still pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_refused_naming_the_field_before_any_engine_sees_them() {
    let d = demo(1, 64).await;
    let mut sent = 0;
    for (i, (ep, set, remove, param, code)) in rows().into_iter().enumerate() {
        let eps: &[Ep] = match ep {
            Ep::Both => &[Ep::Completions, Ep::Chat],
            _ => std::slice::from_ref(&ep),
        };
        for &e in eps {
            let mut body = base(e);
            for (k, v) in set.as_object().unwrap() {
                body.insert(k.clone(), v.clone());
            }
            for k in remove {
                body.remove(*k);
            }
            let path = if e == Ep::Completions { "/v1/completions" } else { "/v1/chat/completions" };
            let (status, b) = http(d.addr, path, Some(&Value::Object(body.clone()))).await;
            let row = format!("row {i} {path} {}", Value::Object(body));
            assert_eq!(status, 400, "{row}: {}", String::from_utf8_lossy(&b));
            let v: Value = serde_json::from_slice(&b).unwrap();
            let err = &v["error"];
            assert_eq!(err["param"], param, "{row}: {v}");
            assert_eq!(err["code"], code, "{row}: {v}");
            assert_eq!(
                (err["origin"].as_str(), err["retry"].as_str()),
                (Some("client"), Some("never")),
                "{row}"
            );
            assert_eq!(err["type"], "invalid_request_error", "{row}");
            let message = err["message"].as_str().unwrap();
            assert!(
                message.starts_with(&format!("{param}: ")),
                "{row}: the message names the field: {message}"
            );
            assert!(message.len() < 200, "{row}: a short message: {message}");
            sent += 1;
        }
    }
    println!("{sent} invalid requests refused");
    assert!(sent >= 120, "{sent} rows");
    for e in &d.engines {
        assert_eq!(e.engine.received(), json!([]), "no invalid request reached an engine");
    }
    // The bases themselves are valid, and a request with every optional field passes.
    for ep in [Ep::Completions, Ep::Chat] {
        let path = if ep == Ep::Completions { "/v1/completions" } else { "/v1/chat/completions" };
        let (status, b) = http(d.addr, path, Some(&Value::Object(base(ep)))).await;
        assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&b));
    }
    assert_clean(&d).await;
    d.shutdown().await;
}
