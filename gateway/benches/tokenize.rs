//! What exact cache-aware routing costs a request before it is routed: the chat template rendered,
//! the rendered prompt tokenized, and the token ids cut into chained block keys.
//!
//! `cargo bench -p baton-gateway --bench tokenize -- --out bench/gateway-tokenize.json`
//! (after `scripts/fetch-tokenizers`, which `scripts/test` runs).
//!
//! Chats of about 2k, 8k and 32k tokens for Llama 3.1 and Qwen3 (their real `tokenizer.json` and
//! chat templates): a system prompt, then user and assistant turns of about 400 tokens each, all
//! real English text (this repository's own docs). Each row: the stage's median over `n` runs
//! after a warm-up, in µs and in µs per 1k prompt tokens. `BATON_BENCH_QUICK=1` runs a few only.
//!
//! Columns: `render` the template, `encode` the rendered text encoded whole (no reuse), `keys` the
//! block keys of its ids; then a request's whole cost (template, ids, keys) per 1k prompt tokens
//! in three cases: `new chat`, none of its messages seen before; `next turn`, the chat of the turn
//! before with an assistant answer and a new user message of ~400 tokens; `resend`, the same chat
//! again (a retry, or n parallel requests).
//!
//! First, per model, the proxy bench's 1 KB completion prompt encoded whole (what that bench's
//! gateway tokenizes at every request); `BATON_BENCH_PROMPT_ONLY=1` runs that row alone.

#![allow(
    clippy::print_stdout,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss,
    unreachable_pub
)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use baton_gateway::api::{Endpoint, GenRequest};
use baton_gateway::prefix::block_keys;
use baton_gateway::tokenize::Tokenizer;
use serde_json::json;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Real English text: the repository's README and docs, in a fixed order.
fn corpus() -> String {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.sort();
    files.insert(0, root().join("README.md"));
    files.iter().map(|p| std::fs::read_to_string(p).unwrap()).collect::<Vec<_>>().join("\n")
}

/// A chat of about `target` tokens: a system prompt and alternating turns of ~400 tokens (about
/// 1,700 characters), ending with a user turn; the messages as JSON values.
fn chat(text: &str, tok: &Tokenizer, target: usize) -> Vec<serde_json::Value> {
    let mut at = 0;
    let mut take = |chars: usize| {
        let start = at;
        let mut end = (start + chars).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        at = if end >= text.len() { 0 } else { end };
        text[start..end].to_owned()
    };
    let mut messages = vec![json!({"role": "system", "content": take(2000)})];
    loop {
        let role = if messages.len() % 2 == 1 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": take(1700)}));
        if role == "user" && tok.token_ids(&request(&messages)).unwrap().len() >= target {
            return messages;
        }
    }
}

fn request(messages: &[serde_json::Value]) -> GenRequest {
    GenRequest::parse(Endpoint::Chat, json!({"model": "m", "messages": messages}).to_string().as_bytes())
        .unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median time of `f` over `inputs` (each used once), after a warm-up on the first fifth
/// (not timed).
fn time<I, T>(inputs: &[I], mut f: impl FnMut(&I) -> T) -> f64 {
    let (warm, timed) = inputs.split_at(inputs.len() / 5);
    for i in warm {
        std::hint::black_box(f(i));
    }
    median(
        timed
            .iter()
            .map(|i| {
                let t = Instant::now();
                std::hint::black_box(f(i));
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect(),
    )
}

/// The proxy bench's prompt (`gateway/benches/proxy.rs`: 1,000 bytes of one English sentence
/// repeated, a completion, so encoded whole): its ids' median time, the word map warm, as the
/// proxy bench's gateway pays it at every request.
fn completion_prompt(model: &str, tok: &Tokenizer, quick: bool) -> serde_json::Value {
    let text = common::sentence_prompt(1000);
    let tokens = tok.encode(&text, true).unwrap().len();
    let same = vec![(); if quick { 50 } else { 20_000 }];
    let us = time(&same, |()| tok.encode(&text, true).unwrap());
    println!(
        "{model:<9} completion prompt of 1,000 bytes: {tokens} ids in {us:.2} µs ({:.1} ns an id)",
        us * 1e3 / tokens as f64
    );
    json!({"model": model, "bytes": text.len(), "tokens": tokens, "encode_us": us})
}

/// What a request pays before routing: its ids and their block keys.
fn ids_and_keys(tok: &Tokenizer, req: &GenRequest) -> Vec<u64> {
    let ids = tok.token_ids(req).unwrap();
    let mut k = Vec::new();
    block_keys(&ids, 16, &mut k);
    k
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // Relative to the repository (cargo runs benches in the crate's directory).
    let out = args.iter().position(|a| a == "--out").map(|i| root().join(&args[i + 1]));
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let text = corpus();
    let mut rows = Vec::new();
    println!(
        "{:<9} {:>6} {:>7} {:>7} {:>6} {:>8} | {:>9} {:>9} {:>9} (µs per 1k prompt tokens) {:>8}",
        "model",
        "tokens",
        "render",
        "encode",
        "keys",
        "new chat",
        "new chat",
        "next turn",
        "resend",
        "encoded"
    );
    let mut prompts = Vec::new();
    for model in ["llama3_1", "qwen3"] {
        let dir = root().join(".cache/tokenizers").join(model);
        let t = Instant::now();
        let tok = Tokenizer::load(&dir.join("tokenizer.json"), Some(&dir.join("tokenizer_config.json")))
            .unwrap_or_else(|e| panic!("{model}: {e} (run scripts/fetch-tokenizers)"));
        let load_ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(tok.reuse_off(), None, "{model}");
        prompts.push(completion_prompt(model, &tok, quick));
        if std::env::var_os("BATON_BENCH_PROMPT_ONLY").is_some() {
            continue;
        }
        for target in [2_000, 8_000, 32_000] {
            let base = chat(&text, &tok, target);
            let req = request(&base);
            let rendered = tok.render_chat(&req).unwrap();
            let ids = tok.encode(&rendered, false).unwrap();
            let tokens = ids.len();
            let n = if quick { 5 } else { (500_000 / target).clamp(15, 250) };
            // Each input is used once: a chat none of whose messages were seen (each carries a
            // number of its own), and the base chat with one new user turn of ~400 tokens.
            let fresh: Vec<GenRequest> = (0..n)
                .map(|i| {
                    let m: Vec<_> = base
                        .iter()
                        .map(|m| {
                            json!({"role": m["role"], "content": format!("{target}-{i} {}", m["content"].as_str().unwrap())})
                        })
                        .collect();
                    request(&m)
                })
                .collect();
            let turns: Vec<GenRequest> = (0..n)
                .map(|i| {
                    let mut m = base.clone();
                    let at = (i * 977) % (text.len() - 2000);
                    let at = (at..).find(|&a| text.is_char_boundary(a)).unwrap();
                    let end = (at + 1700..).find(|&a| text.is_char_boundary(a)).unwrap();
                    m.push(json!({"role": "assistant", "content": "Understood."}));
                    m.push(json!({"role": "user", "content": format!("{target}-{i} {}", &text[at..end])}));
                    request(&m)
                })
                .collect();
            let same = vec![&req; n];
            tok.token_ids(&req).unwrap(); // the base chat seen once, as the turn before
            let render = time(&same, |r| tok.render_chat(r).unwrap());
            let encode = time(&same, |_| tok.encode(&rendered, false).unwrap());
            let keys = time(&same, |_| {
                let mut k = Vec::new();
                block_keys(&ids, 16, &mut k);
                k
            });
            let new_chat = time(&fresh, |r| ids_and_keys(&tok, r));
            let r = tok.reuse().unwrap();
            let encoded = r.encoded.load(std::sync::atomic::Ordering::Relaxed);
            let next_turn = time(&turns, |r| ids_and_keys(&tok, r));
            let encoded = (r.encoded.load(std::sync::atomic::Ordering::Relaxed) - encoded) / n as u64;
            let resend = time(&same, |r| ids_and_keys(&tok, r));
            let per_k = |us: f64| us * 1000.0 / tokens as f64;
            println!(
                "{model:<9} {tokens:>6} {render:>7.0} {encode:>7.0} {keys:>6.1} {new_chat:>8.0} | {:>9.1} {:>9.1} {:>9.1} {encoded:>8}",
                per_k(new_chat),
                per_k(next_turn),
                per_k(resend)
            );
            rows.push(json!({
                "model": model, "tokens": tokens, "messages": base.len(), "n": n, "load_ms": load_ms,
                "render_us": render, "encode_whole_us": encode, "block_keys_us": keys,
                "new_chat_us": new_chat, "next_turn_us": next_turn, "next_turn_encoded_tokens": encoded, "resend_us": resend,
                "new_chat_us_per_1k": per_k(new_chat), "next_turn_us_per_1k": per_k(next_turn),
                "resend_us_per_1k": per_k(resend),
            }));
        }
    }
    if let Some(out) = out {
        let all = json!({"rows": rows, "completion_prompt": prompts});
        std::fs::write(&out, serde_json::to_string_pretty(&all).unwrap() + "\n").unwrap();
        println!("wrote {}", out.display());
    }
}
