//! Cache-aware routing end to end: simulated engines that are prefix caches and publish
//! vLLM-format KV events, the gateway subscribed to them, routing by where a prompt's prefix is.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use baton_gateway::config::cache::CacheRouting;
use baton_gateway::demo::{Demo, DemoConfig, GatewaySetup, start, start_engines, start_gateway};
use baton_gateway::handoff::Mode;
use baton_gateway::routing::{Builtin, CacheParams};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use super::http;

/// A JSON answer of the admin listener.
async fn admin_json(admin: SocketAddr, path: &str) -> Value {
    let (status, body) = http(admin, path, None).await;
    assert_eq!(status, 200, "{path}");
    serde_json::from_slice(&body).unwrap()
}

/// The admin listener's `/metrics` text.
async fn metrics_text(admin: SocketAddr) -> String {
    String::from_utf8(http(admin, "/metrics", None).await.1.to_vec()).unwrap()
}

fn caches(fixed_ms: u64, us_per_token: u64) -> baton_sim::cache::CacheConfig {
    baton_sim::cache::CacheConfig {
        blocks: 4096,
        block_size: baton_sim::DEFAULT_SIM_BLOCK_SIZE,
        prefill_fixed: Duration::from_millis(fixed_ms),
        prefill_per_token: Duration::from_micros(us_per_token),
        prefill_lanes: 0,
        events: Some(baton_sim::cache::EventsConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            replay: Some("127.0.0.1:0".parse().unwrap()),
            topic: String::new(),
        }),
    }
}

fn config(handoff: Mode, token_delay: Duration) -> DemoConfig {
    DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        prefills: 2,
        decoders: 2,
        token_delay,
        handoff,
        pages: 512,
        prefix_cache: Some(caches(2, 10)),
        gateway: GatewaySetup {
            routing: Builtin::CacheAware(CacheParams::default()),
            explain: true,
            ..GatewaySetup::default()
        },
        ..DemoConfig::default()
    }
}

/// A completion with its decision record (`x-baton-explain`) and its answer.
async fn explained(addr: SocketAddr, body: Value) -> (u16, Value, Value) {
    let res =
        super::client::send_with(addr, "/v1/completions", Some(&body), &[("x-baton-explain", "1")]).await;
    let status = res.status().as_u16();
    let record = res
        .headers()
        .get("x-baton-explain")
        .map_or(Value::Null, |v| serde_json::from_str(v.to_str().unwrap()).unwrap());
    let answer =
        serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap_or(Value::Null);
    (status, record, answer)
}

/// Waits until every feed of the demo's gateway is live.
async fn feeds_live(d: &Demo) {
    let started = Instant::now();
    loop {
        let v = admin_json(d.admin, "/admin/cache").await;
        let feeds = v["feeds"].as_array().cloned().unwrap_or_default();
        if !feeds.is_empty() && feeds.iter().all(|f| f["state"] == "live") {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "feeds not live: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A conversation's turns (each the last one's prompt and more) go where the last turn's blocks
/// are, as the engines' own KV events say; the engine reports the prefix cached, and the record
/// names the cached tokens that decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_of_a_conversation_follow_their_cache() {
    for handoff in [Mode::Native, Mode::VllmNixl] {
        let d = start(config(handoff, Duration::ZERO)).await.unwrap();
        feeds_live(&d).await;
        let mut conversation = String::from("system: you answer briefly. ");
        let mut prefill = None;
        for turn in 0..5 {
            conversation.push_str(&format!("user: question number {turn} about the topic at hand. "));
            conversation.push_str(&"more context words ".repeat(20));
            let (status, record, answer) =
                explained(d.addr, json!({"prompt": conversation, "max_tokens": 4})).await;
            assert_eq!(status, 200, "{answer}");
            let chosen = record["route"]["prefill"].as_str().unwrap().to_owned();
            let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap();
            if let Some(p) = &prefill {
                assert_eq!(&chosen, p, "{handoff:?} turn {turn} went elsewhere: {record}");
                let won = record["route"]["prefills"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|p| p["won"] == true)
                    .unwrap();
                let cached = won["cached_tokens"].as_u64().unwrap();
                // Every whole block of the last turn's prompt is cached.
                assert!(cached >= prompt / 2 && cached % 16 == 0, "{handoff:?} turn {turn}: {record}");
                let reported = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
                assert!(reported >= cached, "the decoder holds the prefix too: {answer}");
            }
            prefill = Some(chosen);
            // The engines' events arrive asynchronously; the next turn waits for them.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let v = admin_json(d.admin, "/admin/cache").await;
        assert_eq!(v["routed_entries"], 0, "every engine is exact: {v}");
        let metrics = metrics_text(d.admin).await;
        assert!(metrics.contains("baton_route_cached_tokens_total{pool=\"prefill\"}"), "{metrics}");
        d.shutdown().await;
    }
}

/// An engine whose events never come (its publisher is there but says nothing) is marked silent
/// once it was sent requests, in `/admin/cache` and the metrics, and is matched by what was
/// routed to it; routing goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_publishes_nothing_falls_back_and_is_reported() {
    let c = config(Mode::Native, Duration::ZERO);
    let mut e = start_engines(&c).await.unwrap();
    // A publisher nobody publishes on, in place of prefill-0's.
    let mut quiet = <zeromq::PubSocket as zeromq::Socket>::new();
    let at = match zeromq::Socket::bind(&mut quiet, "tcp://127.0.0.1:0").await.unwrap() {
        zeromq::Endpoint::Tcp(h, p) => format!("{h}:{p}").parse::<SocketAddr>().unwrap(),
        other => panic!("{other}"),
    };
    e.kv_events[0] = Some((at, None));
    let setup = GatewaySetup {
        cache: CacheRouting { silent_after_ms: 300, ..CacheRouting::default() },
        ..c.gateway.clone()
    };
    let g = start_gateway(&e, "127.0.0.1:0".parse().unwrap(), setup).await.unwrap();
    for i in 0..6 {
        let (status, _, answer) =
            explained(g.addr, json!({"prompt": super::prompt(200, i), "max_tokens": 2})).await;
        assert_eq!(status, 200, "{answer}");
    }
    let started = Instant::now();
    // Silence is a matter of time; the engine stops counting as exact within a second of it.
    let v = loop {
        let v = admin_json(g.admin, "/admin/cache").await;
        if v["feeds"][0]["state"] == "silent" && v["engines"][0]["exact"] == false {
            break v;
        }
        assert!(started.elapsed() < Duration::from_secs(8), "never silent: {v}");
        // Requests keep arriving for it.
        let _ = explained(g.addr, json!({"prompt": super::prompt(200, 9), "max_tokens": 2})).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(v["feeds"][1]["state"], "live", "{v}");
    let metrics = metrics_text(g.admin).await;
    assert!(
        metrics.contains("baton_kv_events_feed_state{engine=\"prefill-0\",rank=\"0\",state=\"silent\"} 1"),
        "{metrics}"
    );
    // Its requests now leave approximate entries (requests one at a time tie on load, and the
    // first prefiller wins ties).
    let before = admin_json(g.admin, "/admin/cache").await["routed_entries"].as_u64().unwrap();
    let mut to_it = 0;
    for i in 20..28 {
        let (_, record, _) =
            explained(g.addr, json!({"prompt": super::prompt(200, i), "max_tokens": 2})).await;
        to_it += usize::from(record["route"]["prefill"] == "prefill-0");
    }
    assert!(to_it > 0, "no request went to prefill-0");
    let v = admin_json(g.admin, "/admin/cache").await;
    assert!(v["routed_entries"].as_u64().unwrap() > before, "{v}");
    g.stop().await;
    drop(e);
}

/// Nine requests in ten share one long prefix: the engines that hold it are preferred only within
/// the load guard, so the prefill work pending (tokens routed, not yet answered) never passes the
/// guard at a decision, and every request is served as least-loaded would serve it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prefix_stays_within_the_load_guard() {
    let mut c = config(Mode::Native, Duration::from_millis(2));
    c.prefix_cache = Some(caches(5, 20));
    let params = CacheParams::default();
    let d = start(c).await.unwrap();
    feeds_live(&d).await;
    let hot = "a shared system prompt that every agent sends first. ".repeat(30);
    let mut tasks = JoinSet::new();
    for i in 0..120usize {
        let prompt = if i % 10 == 0 { super::prompt(1500, i) } else { format!("{hot} user {i}: go on.") };
        let addr = d.addr;
        tasks.spawn(async move { explained(addr, json!({"prompt": prompt, "max_tokens": 8})).await });
        if i % 16 == 15 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut spread = std::collections::BTreeMap::<String, usize>::new();
    while let Some(r) = tasks.join_next().await {
        let (status, record, answer) = r.unwrap();
        assert_eq!(status, 200, "{answer}");
        let prefills = record["route"]["prefills"].as_array().unwrap();
        let prompt = u32::try_from(record["prompt_tokens"].as_u64().unwrap()).unwrap();
        let load = |p: &Value| p["pending_tokens"].as_u64().unwrap();
        let least = prefills.iter().map(load).min().unwrap();
        let won = prefills.iter().find(|p| p["won"] == true).unwrap();
        assert!(load(won) <= params.guard_limit_tokens(least, prompt), "past the guard: {record}");
        *spread.entry(won["name"].as_str().unwrap().to_owned()).or_default() += 1;
    }
    assert_eq!(spread.len(), 2, "both prefillers served: {spread:?}");
    // Every prefill answered: no work is left counted on any prefiller.
    let metrics = metrics_text(d.admin).await;
    let pending: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("baton_endpoint_pending_prompt_tokens{endpoint=\"prefill-"))
        .collect();
    assert_eq!(pending.len(), 2, "{metrics}");
    assert!(pending.iter().all(|l| l.ends_with(" 0")), "{pending:?}");
    d.shutdown().await;
}

/// A decoder that holds all but `skip_prefill_within` (256) of a prompt gets it alone in
/// vllm-nixl: no prefill leg (`x-baton-route: prefill=none`), in the decision record and the
/// metrics, and the decoder answers from its own cache. A turn that adds more than that, or a
/// mode whose decoders cannot compute a prompt (native), keeps its prefill leg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_that_holds_the_prompt_gets_it_alone() {
    for handoff in [Mode::VllmNixl, Mode::Native] {
        let d = start(config(handoff, Duration::ZERO)).await.unwrap();
        feeds_live(&d).await;
        let words = |n: usize, from: usize| (from..from + n).map(|i| format!("w{i} ")).collect::<String>();
        let first = words(300, 0);
        let turns = [
            (first.clone(), false),
            // 180 more tokens (the demo counts bytes): within 256 of what the decoder holds.
            (format!("{first}{}", words(30, 1000)), true),
            // 1800 more: a prefill leg again.
            (format!("{first}{}{}", words(30, 1000), words(300, 2000)), false),
        ];
        let mut skipped = 0;
        for (turn, (prompt, alone)) in turns.iter().enumerate() {
            let alone = *alone;
            let body = json!({"prompt": prompt, "max_tokens": 4});
            let res =
                super::client::send_with(d.addr, "/v1/completions", Some(&body), &[("x-baton-explain", "1")])
                    .await;
            assert_eq!(res.status(), 200, "{handoff:?} turn {turn}");
            let route = res.headers()["x-baton-route"].to_str().unwrap().to_owned();
            let record: Value =
                serde_json::from_str(res.headers()["x-baton-explain"].to_str().unwrap()).unwrap();
            let answer: Value =
                serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
            let tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
            let reported = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            if alone {
                skipped += 1;
                assert!(
                    route.starts_with("prefill=none, decode="),
                    "{handoff:?} turn {turn}: {route} {record}"
                );
                assert_eq!(record["prefill"]["skipped"], true, "{record}");
                let held = record["prefill"]["decoder_cached_tokens"].as_u64().unwrap();
                assert!(tokens - held <= 256 && held > 0, "{record}");
                assert_eq!(record["prefill"]["computed_by_decoder"], tokens - held, "{record}");
                assert!(reported >= held, "the decoder computed only what it did not hold: {answer}");
            } else {
                assert!(!route.starts_with("prefill=none"), "{handoff:?} turn {turn}: {route}");
                assert_eq!(record.get("prefill"), None, "{handoff:?} turn {turn}: {record}");
            }
            // The engines' events arrive asynchronously; the next turn waits for them.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let metrics = metrics_text(d.admin).await;
        assert!(
            metrics.contains(&format!("baton_prefill_skipped_total {skipped}")),
            "{handoff:?}: {metrics}"
        );
        assert_eq!(skipped, 1, "{handoff:?}");
        d.shutdown().await;
    }
}
