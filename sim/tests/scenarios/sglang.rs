//! The simulated SGLang PD pair on its own: rooms pair a prefill and a decode, and a room whose
//! other leg never comes, or comes with another prompt, fails loudly within the bounded wait.

use std::time::{Duration, Instant};

use baton_sim::kv::output_text;
use baton_sim::{SglangSimConfig, SimConfig, SimRole, launch, tiny_geometry};
use serde_json::{Value, json};

use crate::harness::http;

const WAIT: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooms_pair_the_legs_and_a_missing_or_foreign_leg_fails_loudly() {
    let g = tiny_geometry(2).unwrap();
    let sg = SglangSimConfig { room_wait: WAIT, ..SglangSimConfig::default() };
    let mut pc = SimConfig::new(SimRole::Prefill, g);
    pc.sglang = Some(sg.clone());
    let prefill = launch(pc).await.unwrap();
    let mut dc = SimConfig::new(SimRole::Decode, g);
    dc.sglang = Some(sg);
    let decode = launch(dc).await.unwrap();
    let (_, info) = http(prefill.addr, "/get_server_info", None).await;
    let info: Value = serde_json::from_slice(&info).unwrap();
    let port = info["disaggregation_bootstrap_port"].as_u64().unwrap();
    let leg = |prompt: &str, room: u64| {
        json!({"prompt": prompt, "max_tokens": 4, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
               "bootstrap_room": room, "rid": format!("r{room}")})
    };
    let sglang = |r: &baton_sim::Running| r.engine.stats()["sglang"].clone();

    // (case, prefill prompt or none, decode prompt, status, text in the error)
    let cases: [(&str, Option<&str>, &str, u16, &str); 3] = [
        ("paired", Some("the same prompt"), "the same prompt", 200, ""),
        ("the prefill leg never arrives", None, "a lonely decode", 504, "never arrived"),
        ("the legs carry other prompts", Some("prompt one"), "prompt two", 500, "another prompt"),
    ];
    for (i, (case, pre, dec, status, why)) in cases.into_iter().enumerate() {
        let room = 1000 + i as u64;
        let d = leg(dec, room);
        let (p, dres) = tokio::join!(
            async {
                match pre {
                    Some(pre) => Some(http(prefill.addr, "/v1/completions", Some(&leg(pre, room))).await),
                    None => None,
                }
            },
            async {
                let started = Instant::now();
                let r = http(decode.addr, "/v1/completions", Some(&d)).await;
                (r, started.elapsed())
            }
        );
        if let Some((s, b)) = p {
            assert_eq!(s, 200, "{case}: prefill {}", String::from_utf8_lossy(&b));
        }
        let ((s, b), took) = dres;
        assert_eq!(s, status, "{case}: {}", String::from_utf8_lossy(&b));
        let v: Value = serde_json::from_slice(&b).unwrap();
        if status == 200 {
            let ids: Vec<u32> = dec.bytes().map(u32::from).collect();
            assert_eq!(v["choices"][0]["text"], output_text(&ids, 4), "{case}");
        } else {
            assert!(v["error"]["message"].as_str().unwrap().contains(why), "{case}: {v}");
            assert!(took < WAIT * 4, "{case}: bounded wait, took {took:?}");
        }
    }
    let (p, d) = (sglang(&prefill), sglang(&decode));
    assert_eq!(
        (d["paired"].as_u64(), d["unpaired"].as_u64(), d["mismatched"].as_u64()),
        (Some(1), Some(1), Some(1)),
        "{d}"
    );
    // The mismatched room is still held by the prefill until its wait ends, then reaped.
    let started = Instant::now();
    while sglang(&prefill)["rooms_held"] != 0 {
        assert!(started.elapsed() < WAIT * 5, "rooms never reaped: {}", sglang(&prefill));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sglang(&prefill)["abandoned"], 1, "{p}");

    // An abort names a waiting decode by its rid and ends it at once.
    let room = 2000;
    let waiting = tokio::spawn({
        let (addr, body) = (decode.addr, leg("waits", room));
        async move { http(addr, "/v1/completions", Some(&body)).await }
    });
    let started = Instant::now();
    while sglang(&decode)["in_flight"] == 0 {
        assert!(started.elapsed() < WAIT, "the decode never registered");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (s, b) = http(decode.addr, "/abort_request", Some(&json!({"rid": format!("r{room}")}))).await;
    assert_eq!((s, serde_json::from_slice::<Value>(&b).unwrap()["aborted"].as_bool()), (200, Some(true)));
    let (s, _) = waiting.await.unwrap();
    assert_eq!(s, 499);
    assert!(started.elapsed() < WAIT, "aborted at once, not by the room's wait");
    assert_eq!(sglang(&decode)["in_flight"], 0);
    prefill.shutdown().await;
    decode.shutdown().await;
}
