//! vLLM's KV events read by baton's reader.

use std::time::Duration;

use libtest_mimic::Failed;
use serde_json::json;

use super::client::{http, json};
use super::engines::{self, Fleet, MODEL};
use super::{baton, block_on, prompt};

/// vLLM's KV events, read by baton's reader (`baton_gateway::kv_events`, a `zeromq` SUB socket;
/// the raw capture uses baton's own ZMTP connection, a second implementation): a request through baton makes the prefill server store the prompt's full blocks,
/// whose token ids are exactly baton's tokenizer's ids for the prompt, and the decode server
/// store the same blocks once it has pulled them; `/reset_prefix_cache` clears the cache with
/// one `AllBlocksCleared` (published with the engine's next step, not at the reset). With `BATON_CAPTURE_KV_EVENTS=FILE` the prefill server's raw frames
/// are written to FILE (the fixture `gateway/tests/fixtures/vllm-0.32-kv-events.jsonl` was made so).
pub fn kv_events_from_vllm(fleet: &Fleet) -> Result<(), Failed> {
    use baton_dataplane::compat::zmtp::{Connection, SocketType};
    use baton_gateway::kv_events::{KvEvent, Subscriber, decode};
    block_on(async {
        let topic = engines::TOPIC.as_bytes();
        let mut p_events = Subscriber::connect(fleet.prefill.events, topic).await.unwrap();
        let mut d_events = Subscriber::connect(fleet.decode.events, topic).await.unwrap();
        let mut raw = Connection::connect(fleet.prefill.events, SocketType::Sub, 1 << 24).await.unwrap();
        raw.subscribe(topic).await.unwrap();
        // A subscription takes effect once the publisher has read it: until each subscriber has
        // heard something, make each server store a block of its own.
        for (i, (addr, sub)) in
            [(fleet.prefill.http, &mut p_events), (fleet.decode.http, &mut d_events)].into_iter().enumerate()
        {
            let mut tries = 0;
            loop {
                let nudge =
                    json!({"model": MODEL, "prompt": prompt(50, 900 + 10 * i + tries), "max_tokens": 1});
                assert_eq!(json(addr, "/v1/completions", &nudge).await.0, 200);
                if let Ok(m) = tokio::time::timeout(Duration::from_secs(1), sub.next()).await {
                    m.unwrap().unwrap();
                    break;
                }
                tries += 1;
                assert!(tries < 10, "no KV event from {addr} after {tries} requests");
            }
        }
        let b = baton(fleet, fleet.prefill.http, fleet.decode.http, "scrape_interval_ms = 100").await;
        let text = prompt(120, 800);
        let body = json!({"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0});
        let (s, v) = json(b.addrs[0], "/v1/completions", &body).await;
        assert_eq!(s, 200, "{v}");
        let tok =
            baton_gateway::tokenize::Tokenizer::load(&fleet.model.join("tokenizer.json"), None).unwrap();
        let ids = tok.encode(&text, true).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "baton's tokenizer and vLLM count differently");
        let full = ids.len() / engines::BLOCK * engines::BLOCK;
        assert!(full >= 2 * engines::BLOCK, "the prompt fills {full} tokens of blocks");
        // Each server's stored token ids, in order, until they cover the prompt's full blocks.
        for (who, sub) in [("prefill", &mut p_events), ("decode", &mut d_events)] {
            let mut stored: Vec<u32> = Vec::new();
            while stored.len() < full {
                let m = tokio::time::timeout(Duration::from_secs(10), sub.next())
                    .await
                    .unwrap_or_else(|_| panic!("{who}: no BlockStored for the prompt within 10 s"))
                    .unwrap()
                    .unwrap();
                for e in m.batch.events {
                    if let KvEvent::BlockStored { token_ids, block_hashes, block_size, .. } = e {
                        assert_eq!(block_size as usize, engines::BLOCK);
                        assert_eq!(token_ids.len(), block_hashes.len() * engines::BLOCK);
                        stored.extend(token_ids);
                    }
                }
            }
            assert_eq!(&stored[..full], &ids[..full], "{who}: stored blocks are not the prompt's tokens");
            assert_eq!(sub.missed, 0, "{who}");
        }
        let (s, _) = http(fleet.prefill.http, "/reset_prefix_cache", Some(&json!({}))).await;
        assert_eq!(s, 200, "POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1)");
        // vLLM queues the event and publishes it with its scheduler's next step, not at the
        // reset: an idle engine says nothing until its next request.
        let nudge = json!({"model": MODEL, "prompt": "x", "max_tokens": 1});
        assert_eq!(json(fleet.prefill.http, "/v1/completions", &nudge).await.0, 200);
        let cleared = loop {
            let m = tokio::time::timeout(Duration::from_secs(10), p_events.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            if let Some(e) = m.batch.events.iter().find(|e| **e == KvEvent::AllBlocksCleared) {
                break e.clone();
            }
        };
        assert_eq!(cleared, KvEvent::AllBlocksCleared);
        // Every raw frame the publisher sent decodes; kept as the fixture when asked.
        let mut lines = String::new();
        while let Ok(Ok(Some(frames))) = tokio::time::timeout(Duration::from_millis(500), raw.recv()).await {
            decode(&frames).unwrap();
            let hex: Vec<String> =
                frames.iter().map(|f| f.iter().map(|b| format!("{b:02x}")).collect()).collect();
            lines.push_str(&serde_json::to_string(&hex).unwrap());
            lines.push('\n');
        }
        assert!(!lines.is_empty(), "the raw subscriber got nothing");
        if let Some(file) = std::env::var_os("BATON_CAPTURE_KV_EVENTS") {
            std::fs::write(file, lines).unwrap();
        }
        b.shutdown().await;
    })
}
