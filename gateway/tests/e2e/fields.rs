//! Every field intact in every mode: a completion and a chat with every optional field set go
//! through each handoff mode; the decode engine's received body holds each of the client's fields
//! unchanged (lmcache: only its documented conversions), both choices come back with their
//! logprobs, whole and streamed alike. And a prefill engine's 400 reaches the client as it is, with
//! nothing left held.

use std::time::{Duration, Instant};

use baton_gateway::demo::{Demo, DemoConfig, start};
use baton_gateway::handoff::Mode;
use baton_sim::faults::FaultConfig;
use baton_sim::kv::choice_text;
use serde_json::{Value, json};

use super::http;

const MODES: [Mode; 4] = [Mode::Native, Mode::Lmcache, Mode::VllmNixl, Mode::Sglang];

async fn mode_demo(handoff: Mode, prefill_faults: FaultConfig) -> Demo {
    start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp: 2,
        handoff,
        prefill_faults,
        ..DemoConfig::default()
    })
    .await
    .unwrap()
}

/// The fields both endpoints take, every one set.
fn common() -> Value {
    json!({
        "model": "baton-sim", "max_tokens": 5, "n": 2, "temperature": 0.7, "top_p": 0.9, "seed": 42,
        "stop": ["\n\n", "END"], "presence_penalty": 0.1, "frequency_penalty": 0.2,
        "logit_bias": {"50256": -100, "13": 2.5},
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}},
        "user": "tenant-7",
        // vLLM's sampling extras and a field nobody here knows, nested.
        "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": true, "skip_special_tokens": false,
        "min_tokens": 1, "stop_token_ids": [7, 9],
        "my_engine_extension": {"level": 3, "tags": ["a", {"b": null}]},
    })
}

fn completion() -> Value {
    let mut v = common();
    v["prompt"] = json!("The baton passes between prefill and decode ranks.");
    v["logprobs"] = json!(3);
    v["echo"] = json!(false);
    v
}

fn chat(tools: bool) -> Value {
    let mut v = common();
    v["messages"] = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Weather?"}]}]);
    v["logprobs"] = json!(true);
    v["top_logprobs"] = json!(3);
    v["chat_template_kwargs"] = json!({"enable_thinking": false});
    v["parallel_tool_calls"] = json!(false);
    if tools {
        v["tools"] = json!([{"type": "function", "function": {"name": "weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        v["tool_choice"] = json!({"type": "function", "function": {"name": "weather"}});
    }
    v
}

/// The last generation request the decode engine received.
fn decode_received(d: &Demo) -> Value {
    let addr = d.decode_addrs()[0];
    let e = d.engines.iter().find(|e| e.addr == addr).unwrap();
    let got = e.engine.received();
    got.as_array().unwrap().last().cloned().unwrap()["body"].clone()
}

/// The prompt token ids the simulated engines count (byte-level, the demo's fallback tokenizer).
fn prompt_ids(req: &Value) -> Vec<u32> {
    let text = match req.get("prompt") {
        Some(p) => p.as_str().unwrap().to_owned(),
        None => {
            let m: Vec<(String, String)> = req["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    (m["role"].as_str().unwrap().to_owned(), baton_gateway::api::content_text(&m["content"]))
                })
                .collect();
            baton_gateway::tokenize::render_chat(&m)
        }
    };
    text.bytes().map(u32::from).collect()
}

/// Per choice index: the text and the number of logprob entries, from a whole or streamed answer.
fn choices(body: &[u8], chat: bool, stream: bool) -> Vec<(String, usize)> {
    let mut out: Vec<(String, usize)> = Vec::new();
    let mut add = |c: &Value| {
        let i = c["index"].as_u64().unwrap() as usize;
        if out.len() <= i {
            out.resize(i + 1, (String::new(), 0));
        }
        let text = if chat {
            c["message"]["content"].as_str().or(c["delta"]["content"].as_str())
        } else {
            c["text"].as_str()
        };
        out[i].0.push_str(text.unwrap_or(""));
        let lp = &c["logprobs"];
        out[i].1 += if chat {
            lp["content"].as_array().map_or(0, Vec::len)
        } else {
            lp["tokens"].as_array().map_or(0, Vec::len)
        };
        if chat {
            for e in lp["content"].as_array().into_iter().flatten() {
                assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 3, "{e}");
                assert!(e["bytes"].is_array() && e["logprob"].is_number(), "{e}");
            }
        } else if let Some(tops) = lp["top_logprobs"].as_array() {
            assert!(tops.iter().all(|t| t.as_object().unwrap().len() == 3), "{lp}");
        }
    };
    if stream {
        let text = std::str::from_utf8(body).unwrap();
        for e in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"].as_array().unwrap().iter().for_each(&mut add);
        }
    } else {
        let v: Value = serde_json::from_slice(body).unwrap();
        // Five tokens a choice.
        assert_eq!(v["usage"]["completion_tokens"], 5 * v["choices"].as_array().unwrap().len(), "{v}");
        v["choices"].as_array().unwrap().iter().for_each(&mut add);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_optional_field_reaches_the_decoder_and_every_choice_comes_back_in_every_mode() {
    for mode in MODES {
        let d = mode_demo(mode, FaultConfig::default()).await;
        let lmcache = mode == Mode::Lmcache;
        // vllm-nixl serves one choice a request (every choice would pull the same KV: the mode
        // refuses `n > 1`, checked below).
        let nixl = mode == Mode::VllmNixl;
        for (path, mut req) in [("/v1/completions", completion()), ("/v1/chat/completions", chat(!lmcache))] {
            if nixl {
                req["n"] = json!(1);
            }
            let is_chat = path.contains("chat");
            let case = format!("{} {path}", mode.name());
            let ids = prompt_ids(&req);
            let mut answers = Vec::new();
            for stream in [false, true] {
                let mut body = req.clone();
                body["stream"] = json!(stream);
                let (s, b) = http(d.addr, path, Some(&body)).await;
                assert_eq!(s, 200, "{case} stream={stream}: {}", String::from_utf8_lossy(&b));
                let got = choices(&b, is_chat, stream);
                for (c, (text, logprobs)) in got.iter().enumerate() {
                    assert_eq!(text, &choice_text(&ids, 5, c as u32), "{case} stream={stream} choice {c}");
                    assert_eq!(*logprobs, 5, "{case} stream={stream} choice {c}: a logprob entry per token");
                }
                if nixl {
                    assert_eq!(got.len(), 1, "{case}");
                } else {
                    assert_ne!(got[0].0, got[1].0, "{case}: two distinct choices");
                }
                answers.push(got);
                if stream {
                    continue;
                }
                // What the decoder received, field by field.
                let received = decode_received(&d);
                for (k, v) in req.as_object().unwrap() {
                    let converted = lmcache
                        && (["prompt", "messages", "chat_template_kwargs", "parallel_tool_calls"]
                            .contains(&k.as_str())
                            || (is_chat && ["logprobs", "top_logprobs"].contains(&k.as_str())));
                    if !converted {
                        assert_eq!(&received[k], v, "{case}: field {k} reached the decoder unchanged");
                    }
                }
                if lmcache {
                    // The documented conversions: the prompt's token ids; chat's logprobs as completions'.
                    assert_eq!(received["prompt"], json!(ids), "{case}");
                    if is_chat {
                        assert_eq!(received["logprobs"], 3, "{case}");
                        assert!(
                            received.get("messages").is_none() && received.get("top_logprobs").is_none(),
                            "{case}"
                        );
                    }
                }
            }
            assert_eq!(answers[0], answers[1], "{case}: whole and streamed answers agree");
        }
        if nixl {
            let (s, b) = http(d.addr, "/v1/completions", Some(&completion())).await;
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!((s, v["error"]["param"].as_str()), (400, Some("n")), "{v}");
        }
        if lmcache {
            // Tool calls cannot be served over LMCache's completions-only decode: refused, naming tools.
            let (s, b) = http(d.addr, "/v1/chat/completions", Some(&chat(true))).await;
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!((s, v["error"]["param"].as_str()), (400, Some("tools")), "{v}");
        }
        assert_nothing_held(&d, Duration::from_secs(5)).await;
        d.shutdown().await;
    }
}

/// Nothing held anywhere within `within`: no slot at the gateway, no page on a decoder rank, no
/// engine cache block.
async fn assert_nothing_held(d: &Demo, within: Duration) {
    let start = Instant::now();
    loop {
        let slots: u32 = d.gateway.decoders.iter().map(|x| x.queue.stats().in_use).sum();
        let engines: Vec<Value> = d.engines.iter().map(|e| e.engine.stats()).collect();
        let held = engines.iter().any(|s| {
            s["engine_blocks_held"].as_u64().unwrap_or(0) > 0
                || s["ranks"].as_array().into_iter().flatten().any(|r| r["pages_free"] != r["pages_total"])
        });
        if slots == 0 && !held {
            return;
        }
        assert!(start.elapsed() < within, "still held after {within:?}: {slots} slots; {engines:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A prefill engine that refuses (400) in every mode: the client gets that 400 with the engine's
/// message, marked as the engine's and never worth a retry; the decoders end clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_400_reaches_the_client_and_the_decoders_end_clean_in_every_mode() {
    for mode in MODES {
        let d = mode_demo(mode, FaultConfig { fail_status: Some(400), ..FaultConfig::default() }).await;
        for stream in [false, true] {
            let body = json!({"prompt": "hello there", "max_tokens": 4, "stream": stream});
            let (s, b) = http(d.addr, "/v1/completions", Some(&body)).await;
            let v: Value = serde_json::from_slice(&b)
                .unwrap_or_else(|_| panic!("{}: {}", mode.name(), String::from_utf8_lossy(&b)));
            assert_eq!(s, 400, "{}: {v}", mode.name());
            assert!(
                v["error"]["message"].as_str().unwrap().contains("fail_status"),
                "{}: the engine's message: {v}",
                mode.name()
            );
            assert_eq!(
                (v["error"]["origin"].as_str(), v["error"]["retry"].as_str()),
                (Some("engine"), Some("never")),
                "{v}"
            );
        }
        // The native mode's reservation was cancelled after the prefiller had its addresses: its
        // pages stay quarantined (a late write must find them unusable) until the quarantine ends.
        assert_nothing_held(&d, baton_dataplane::buffer::DEFAULT_QUARANTINE_TTL + Duration::from_secs(5))
            .await;
        d.shutdown().await;
    }
}
