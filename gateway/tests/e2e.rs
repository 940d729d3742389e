//! The gateway end to end over loopback, in front of simulated engines that embed the real data
//! plane.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation,
    unreachable_pub
)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use baton_dataplane::sim::kv::output_text;
use baton_gateway::demo::{Demo, DemoConfig, start};
use baton_gateway::tokenize::render_chat;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

async fn http(addr: SocketAddr, path: &str, body: Option<&Value>) -> (u16, Bytes) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let req = match body {
        Some(b) => Request::post(path)
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(b.to_string())))
            .unwrap(),
        None => Request::get(path).header("host", addr.to_string()).body(Full::new(Bytes::new())).unwrap(),
    };
    let res = send.send_request(req).await.unwrap();
    let status = res.status().as_u16();
    (status, res.into_body().collect().await.unwrap().to_bytes())
}

async fn demo(tp: u32, pages: u32) -> Demo {
    start(DemoConfig { listen: "127.0.0.1:0".parse().unwrap(), tp, pages, ..DemoConfig::default() })
        .await
        .unwrap()
}

/// Waits until every decoder rank has all pages free and the gateway holds no slots.
async fn assert_clean(d: &Demo) {
    let start = Instant::now();
    loop {
        let (_, body) = http(d.addr, "/admin/decoders", None).await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        let clean = v["decoders"].as_array().unwrap().iter().all(|d| {
            d["reserved_slots"] == 0
                && d["waiting_requests"] == 0
                && d["ranks"].as_array().unwrap().iter().all(|r| r["pages_free"] == r["pages_total"])
        });
        if clean {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "not clean: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A completion prompt of exactly `tokens` byte-level tokens.
fn prompt(tokens: usize, seed: usize) -> String {
    let base = format!("request {seed}: ");
    let mut s = base.repeat(tokens / base.len() + 1);
    s.truncate(tokens);
    s
}

/// Extracts the text of a JSON or SSE answer, checking SSE framing and usage.
fn answer_text(body: &[u8], chat: bool, stream: bool) -> (String, Option<(u64, u64)>) {
    let pick = |v: &Value| -> String {
        let c = &v["choices"][0];
        let t = if chat {
            c["message"]["content"].as_str().or(c["delta"]["content"].as_str())
        } else {
            c["text"].as_str()
        };
        t.unwrap_or("").to_owned()
    };
    if !stream {
        let v: Value = serde_json::from_slice(body).unwrap();
        return (
            pick(&v),
            Some((
                v["usage"]["prompt_tokens"].as_u64().unwrap(),
                v["usage"]["completion_tokens"].as_u64().unwrap(),
            )),
        );
    }
    let mut text = String::new();
    let mut usage = None;
    let mut done = false;
    for event in std::str::from_utf8(body).unwrap().split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect("SSE data line");
        assert!(!done, "data after [DONE]");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        match v.get("usage") {
            Some(u) if !u.is_null() => {
                usage = Some((u["prompt_tokens"].as_u64().unwrap(), u["completion_tokens"].as_u64().unwrap()))
            }
            _ => text.push_str(&pick(&v)),
        }
    }
    assert!(done, "stream not closed with [DONE]");
    (text, usage)
}

/// The deadlock scenario: a 64-page buffer, TP 2, 300 concurrent requests needing 1 to 60 pages each.
/// Every request completes with the right tokens; afterwards every page is free and no slot held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlock_scenario_completes_and_leaves_the_buffer_clean() {
    let d = demo(2, 64).await;
    let chunk = 16usize;
    let mut tasks = JoinSet::new();
    for i in 0..300usize {
        let pages = 1 + (i * 37) % 60;
        let tokens = pages * chunk - (i % chunk);
        let (chat, stream) = (i % 4 == 1, i % 3 == 0);
        let text = prompt(tokens, i);
        let max_tokens = 1 + (i % 5) as u32;
        let addr = d.addr;
        tasks.spawn(async move {
            let (path, body, ids) = if chat {
                let ids: Vec<u32> = render_chat(&[("user".into(), text.clone())]).bytes().map(u32::from).collect();
                ("/v1/chat/completions", json!({"model": "baton-sim", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream, "stream_options": {"include_usage": true}}), ids)
            } else {
                let ids: Vec<u32> = text.bytes().map(u32::from).collect();
                ("/v1/completions", json!({"model": "baton-sim", "prompt": text, "max_tokens": max_tokens, "stream": stream, "stream_options": {"include_usage": true}}), ids)
            };
            let (status, body) = http(addr, path, Some(&body)).await;
            assert_eq!(status, 200, "request {i}: {}", String::from_utf8_lossy(&body));
            let (got, usage) = answer_text(&body, chat, stream);
            assert_eq!(got, output_text(&ids, max_tokens), "request {i}");
            assert_eq!(usage, Some((ids.len() as u64, u64::from(max_tokens))), "request {i} usage");
        });
    }
    let started = Instant::now();
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    assert!(started.elapsed() < Duration::from_secs(60), "took {:?}", started.elapsed());
    assert_clean(&d).await;
    d.shutdown().await;
}

/// A request needing more pages than the buffer holds is refused at once naming both numbers; one
/// needing exactly the whole buffer completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_is_refused_exact_fit_completes() {
    let d = demo(1, 64).await;
    let (status, body) =
        http(d.addr, "/v1/completions", Some(&json!({"prompt": prompt(64 * 16 + 1, 0), "max_tokens": 2})))
            .await;
    assert_eq!(status, 413);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["message"], "prompt needs 65 slots but the decoder buffer holds 64");
    assert_eq!(v["error"]["code"], "prompt_too_large_for_kv_buffer");
    let (status, body) =
        http(d.addr, "/v1/completions", Some(&json!({"prompt": prompt(64 * 16, 1), "max_tokens": 2}))).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_clean(&d).await;
    d.shutdown().await;
}

/// Bad requests get the OpenAI error shape with a precise status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_precise_errors() {
    let d = demo(1, 16).await;
    let cases: Vec<(&str, &str, Value, u16, &str)> = vec![
        (
            "unknown model",
            "/v1/completions",
            json!({"model": "gpt-7", "prompt": "x"}),
            404,
            "model_not_found",
        ),
        ("no prompt", "/v1/completions", json!({"model": "baton-sim"}), 400, "invalid_value"),
        (
            "context length",
            "/v1/completions",
            json!({"prompt": prompt(40_000, 0)}),
            400,
            "context_length_exceeded",
        ),
        ("empty chat", "/v1/chat/completions", json!({"messages": []}), 400, "invalid_value"),
    ];
    for (name, path, body, status, code) in cases {
        let (s, b) = http(d.addr, path, Some(&body)).await;
        assert_eq!(s, status, "{name}");
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], code, "{name}");
    }
    let (s, _) = http(d.addr, "/v1/nothing", None).await;
    assert_eq!(s, 404);
    let (s, b) = http(d.addr, "/v1/models", None).await;
    assert_eq!(s, 200);
    assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["data"][0]["id"], "baton-sim");
    d.shutdown().await;
}
