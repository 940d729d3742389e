//! Micro-benchmark of the data plane's bookkeeping on one core.
//!
//! `cargo bench -p baton-dataplane --bench core -- --out bench/dataplane-core.json`
//!
//! - reserve+release: reserve an 8-page request on a 1024-page buffer and drop the reservation.
//! - arrive+seal: reserve 8 pages, publish, write 8 chunks (64-byte pages, so bookkeeping dominates),
//!   become ready, consume, finish.
//! - the contract's ids: an engine reading the `baton` object of a native request (a 1,000-byte
//!   prompt, its 1,000 token ids) from the whole body, the ids as a JSON array, then as their
//!   base64 string (`token_ids = "base64"`).
//!
//! Single-threaded, real clock, events discarded. `BATON_BENCH_QUICK=1` runs a few iterations only
//! (the test script uses it so the benchmark cannot rot).

// A benchmark aborts loudly when the code under measurement misbehaves.
#![allow(clippy::print_stdout, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_dataplane::contract::{BatonParams, ids_base64};
use baton_dataplane::device::cpu::CpuDevice;
use baton_dataplane::events::DiscardSink;
use baton_dataplane::{
    BufferOptions, KvGeometry, RankBuffer, RequestId, RequestKey, ReserveRequest, SystemClock,
};

struct Result {
    name: &'static str,
    iterations: u64,
    seconds: f64,
    per_second: f64,
    ns_per_op: f64,
}

fn measure(name: &'static str, iterations: u64, mut f: impl FnMut(u64)) -> Result {
    // Warm up caches and the allocator.
    for i in 0..iterations / 10 {
        f(u64::MAX - i);
    }
    let start = Instant::now();
    for i in 0..iterations {
        f(i);
    }
    let seconds = start.elapsed().as_secs_f64();
    let per_second = iterations as f64 / seconds;
    Result { name, iterations, seconds, per_second, ns_per_op: 1e9 / per_second }
}

fn buffer(pages: u32) -> RankBuffer<CpuDevice> {
    // 1 layer, 1 head of 8 bytes, 4 tokens per chunk: 64-byte pages.
    let geometry = KvGeometry::new(1, 1, 8, 1, 4, 1).unwrap_or_else(|e| panic!("{e}"));
    RankBuffer::new(
        Arc::new(CpuDevice),
        geometry,
        0,
        pages,
        BufferOptions::default(),
        Arc::new(SystemClock),
        Arc::new(DiscardSink),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let n = if quick { 10_000 } else { 5_000_000 };

    let buf = buffer(1024);
    let lease = Instant::now() + Duration::from_secs(3600);
    let reserve_release = measure("reserve+release (8 pages)", n, |i| {
        let key = RequestKey::new(RequestId(u128::from(i)), 0);
        let r = buf.reserve(ReserveRequest { key, chunks: 8, prefixes: &[], lease });
        assert!(r.is_ok());
        drop(r);
    });
    assert_eq!(buf.stats().pages.free, 1024);

    let page = vec![7u8; buf.page_bytes()];
    let arrive = measure("arrive+seal (8 chunks, reserve to free)", n / 8, |i| {
        let key = RequestKey::new(RequestId(u128::from(i)), 1);
        let Ok(mut r) = buf.reserve(ReserveRequest { key, chunks: 8, prefixes: &[], lease }) else {
            panic!("reserve failed")
        };
        for (chunk, addr) in r.publish() {
            assert!(buf.write_chunk(key, chunk, addr, &page).is_ok());
        }
        let Ok(ready) = r.try_ready() else { panic!("not ready") };
        let Ok(c) = ready.consume() else { panic!("consume failed") };
        c.finish();
    });
    assert_eq!(buf.stats().pages.free, 1024);
    assert!(buf.check_invariants().is_ok());

    // What an engine reads of a native request: the `baton` object, the rest skipped.
    #[derive(serde::Deserialize)]
    struct EngineRequest {
        baton: BatonParams,
    }
    let ids: Vec<u32> = (0..1000u32).map(|i| i * 7919 % 151_000).collect();
    let body = |prompt_token_ids: serde_json::Value| {
        serde_json::to_vec(&serde_json::json!({
            "model": "m", "prompt": "x".repeat(1000), "max_tokens": 1,
            "baton": {"request_id": format!("{:032x}", 0xabc), "epoch": 0, "prompt_token_ids": prompt_token_ids},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let read = |name, body: Vec<u8>| {
        measure(name, n / 100, |_| {
            let r: EngineRequest = serde_json::from_slice(&body).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(r.baton.prompt_token_ids.as_deref().map(<[u32]>::len), Some(1000));
        })
    };
    let json_ids = read("contract: 1,000 ids as a JSON array", body(serde_json::json!(ids)));
    let base64_ids = read("contract: 1,000 ids in base64", body(serde_json::json!(ids_base64(&ids))));

    let results = [reserve_release, arrive, json_ids, base64_ids];
    for r in &results {
        println!(
            "{:<42} {:>12.0} /s  {:>8.1} ns/op  ({} iterations in {:.3} s)",
            r.name, r.per_second, r.ns_per_op, r.iterations, r.seconds
        );
    }
    if let Some(path) = out {
        let rows: Vec<String> = results
            .iter()
            .map(|r| {
                format!(
                    "    {{\"name\": \"{}\", \"iterations\": {}, \"seconds\": {:.6}, \"per_second\": {:.0}, \"ns_per_op\": {:.1}}}",
                    r.name, r.iterations, r.seconds, r.per_second, r.ns_per_op
                )
            })
            .collect();
        let json = format!(
            "{{\n  \"bench\": \"dataplane-core\",\n  \"quick\": {quick},\n  \"results\": [\n{}\n  ]\n}}\n",
            rows.join(",\n")
        );
        if let Err(e) = std::fs::write(&path, json) {
            eprintln!("cannot write {path}: {e}");
            std::process::exit(1);
        }
        println!("wrote {path}");
    }
}
