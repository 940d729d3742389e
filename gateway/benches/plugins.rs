//! Per-decision overhead of the example policy plugins, next to the built-in policy, 64 endpoints.
//!
//! `cargo bench -p baton-gateway --bench plugins -- --out bench/gateway-plugins.json`
//! (after `scripts/build-plugins`, which `scripts/test` runs).
//!
//! Three measurements per plugin, each over the same requests:
//! - `direct`: one call on a pooled (already instantiated) instance on the bench thread: the
//!   component call, the host functions it uses and the conversions of its arguments, deadline
//!   and memory limit armed. This is the plugin's own cost.
//! - `inline`: the call as a request pays it with `inline = true`: from a task on a tokio runtime,
//!   an idle instance taken from the plugin's pool and returned, the call guarded for panics.
//! - `pool`: the call as a request pays it by default: from a task on a tokio runtime, through the
//!   plugin's bounded queue to one of its threads and back (a channel and two thread wake-ups).
//!
//! Routing gets 32 prefill and 32 decode endpoints (64 in all), one list per metric; admission gets
//! the queue state. The built-in `kv-aware` routing decides the same candidates in the same run.
//! Admission's built-in has no decision to time (class 0, the gateway's wait). Each row: p50, p99
//! and mean in µs over `n` decisions after a warm-up. `BATON_BENCH_QUICK=1` runs a few only.

#![allow(
    clippy::print_stdout,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation,
    unreachable_pub
)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_gateway::policy::calls::views;
use baton_gateway::policy::{AdmissionPlugin, Clock, Host, PolicyRequest, QueueState, RoutingPlugin, Spec};
use baton_gateway::routing::{Builtin, Candidates, DecodeView, PrefillView, RouteFacts, RoutingPolicy};
use serde_json::json;

const ENDPOINTS: usize = 32;

fn plugin(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/plugins").join(format!("{name}.wasm"));
    assert!(p.is_file(), "{} is missing: run scripts/build-plugins", p.display());
    p
}

fn request(i: u32) -> PolicyRequest {
    PolicyRequest {
        model: "llama-3.1-8b".into(),
        endpoint: "chat".into(),
        tenant: format!("tenant-{}", i % 16),
        prompt_tokens: 900 + i % 200,
        slots: 4,
        max_tokens: 128,
        priority: None,
        band: None,
        flow: None,
        prefix_hash: i.wrapping_mul(2_654_435_761),
        headers: Vec::new(),
    }
}

fn candidates(i: usize) -> Candidates {
    let n = ENDPOINTS;
    Candidates {
        prefill: PrefillView {
            healthy: smallvec::smallvec![true; n],
            in_flight: (0..n).map(|k| ((k + i) % 7) as u32).collect(),
            latency_us: (0..n).map(|k| 40_000 + ((k * 13 + i) % 97) as u32 * 100).collect(),
            cached_tokens: Default::default(),
            pending_tokens: Default::default(),
        },
        decode: DecodeView {
            healthy: (0..n).map(|k| k != 5).collect(),
            slots_needed: smallvec::smallvec![4; n],
            capacity_slots: smallvec::smallvec![512; n],
            free_slots: (0..n).map(|k| ((k * 37 + i) % 512) as u32).collect(),
            waiting_slots: (0..n).map(|k| ((k + i) % 3) as u64).collect(),
            in_flight: (0..n).map(|k| ((k * 5 + i) % 11) as u32).collect(),
            cached_tokens: Default::default(),
        },
    }
}

struct Row {
    plugin: String,
    world: &'static str,
    path: &'static str,
    us: Vec<f64>,
}

fn stats(us: &mut [f64]) -> (f64, f64, f64) {
    us.sort_by(f64::total_cmp);
    let p = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    (p(0.5), p(0.99), us.iter().sum::<f64>() / us.len() as f64)
}

fn time<F: FnMut(usize)>(n: usize, warm: usize, mut f: F) -> Vec<f64> {
    for i in 0..warm {
        f(i);
    }
    (0..n)
        .map(|i| {
            let t = Instant::now();
            f(i);
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let (n, warm) = if quick { (200, 20) } else { (20_000, 2_000) };
    let host = Host::new(
        Some(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/plugin-cache-bench")),
        Clock::monotonic(),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let queue = QueueState { capacity_slots: 8192, free_slots: 4096, waiting_requests: 0, waiting_slots: 0 };
    let reqs: Vec<Arc<PolicyRequest>> = (0..64u32).map(|i| Arc::new(request(i))).collect();
    let cands: Vec<Candidates> = (0..64).map(candidates).collect();
    let mut rows = Vec::new();

    // Built-in routing on the same candidates.
    let us = time(n, warm, |i| {
        let c = &cands[i % 64];
        let f =
            RouteFacts { model: "m", prompt_tokens: 1000, slots: 4, max_tokens: Some(128), seq: i as u64 };
        std::hint::black_box(Builtin::KvAware.route(&f, c));
    });
    rows.push(Row { plugin: "built-in kv-aware".into(), world: "routing", path: "direct", us });

    let spec = |name: &str, inline: bool| {
        let mut s = Spec::new(name, plugin(name));
        s.inline = inline;
        s.config_json = json!({"tokens_per_minute": 4_000_000_000u32}).to_string();
        s.memory_mib = 256;
        s.deadline = Duration::from_millis(50);
        s
    };
    for name in ["token_budget", "token_budget_js", "token_budget_py"] {
        let p = AdmissionPlugin::load(&host, spec(name, false)).unwrap();
        let mut d = p.direct();
        let us = time(n, warm, |i| {
            std::hint::black_box(d.admit(&reqs[i % 64], queue).unwrap());
        });
        rows.push(Row { plugin: name.into(), world: "admission", path: "direct", us });
        for inline in [true, false] {
            let p = AdmissionPlugin::load(&host, spec(name, inline)).unwrap();
            let us = rt.block_on(async {
                let mut v = Vec::with_capacity(n);
                for i in 0..warm + n {
                    let t = Instant::now();
                    std::hint::black_box(p.admit(Arc::clone(&reqs[i % 64]), queue).await.unwrap());
                    if i >= warm {
                        v.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
                v
            });
            rows.push(Row {
                plugin: name.into(),
                world: "admission",
                path: if inline { "inline" } else { "pool" },
                us,
            });
            assert_eq!(p.stats.total_faults(), 0, "{name} faulted");
        }
    }

    let v: Vec<_> = cands.iter().map(views).collect();
    let routing = |inline: bool| {
        let mut s = Spec::new("prefix_affinity", plugin("prefix_affinity"));
        s.deadline = Duration::from_millis(50);
        s.inline = inline;
        RoutingPlugin::load(&host, s).unwrap()
    };
    let mut d = routing(false).direct();
    let us = time(n, warm, |i| {
        let (pv, dv) = &v[i % 64];
        std::hint::black_box(d.route(&reqs[i % 64], pv, dv).unwrap());
    });
    rows.push(Row { plugin: "prefix_affinity".into(), world: "routing", path: "direct", us });
    for inline in [true, false] {
        let p = routing(inline);
        let us = rt.block_on(async {
            let mut out = Vec::with_capacity(n);
            for i in 0..warm + n {
                let t = Instant::now();
                std::hint::black_box(p.route(Arc::clone(&reqs[i % 64]), &cands[i % 64]).await.unwrap());
                if i >= warm {
                    out.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            out
        });
        rows.push(Row {
            plugin: "prefix_affinity".into(),
            world: "routing",
            path: if inline { "inline" } else { "pool" },
            us,
        });
        assert_eq!(p.stats.total_faults(), 0, "prefix_affinity faulted");
    }

    let mut json_rows = Vec::new();
    println!("{} endpoints ({ENDPOINTS} prefill + {ENDPOINTS} decode), {n} decisions per row", 2 * ENDPOINTS);
    for r in &mut rows {
        let (p50, p99, mean) = stats(&mut r.us);
        println!(
            "{:<20} {:<9} {:<7}  p50 {:>8.2} µs  p99 {:>8.2} µs  mean {:>8.2} µs",
            r.plugin, r.world, r.path, p50, p99, mean
        );
        json_rows.push(json!({"plugin": r.plugin, "world": r.world, "path": r.path, "decisions": r.us.len(),
            "p50_us": (p50 * 100.0).round() / 100.0, "p99_us": (p99 * 100.0).round() / 100.0, "mean_us": (mean * 100.0).round() / 100.0}));
    }
    if let Some(path) = out {
        let doc = json!({"bench": "gateway-plugins", "quick": quick, "endpoints": 2 * ENDPOINTS, "rows": json_rows});
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap() + "\n")
            .unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        println!("wrote {path}");
    }
}
