//! What an operator reads: `/metrics` after traffic through every handoff mode, checked by
//! Prometheus' own `promtool` (Debian's `prometheus`, installed by `scripts/test`), with a tenant
//! whose name needs escaping; the stream latency, token and cancellation series.

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use baton_gateway::demo::{DemoConfig, GatewaySetup, start};
use baton_gateway::flow::FlowConfig;
use baton_gateway::handoff::Mode;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpStream;

use super::plugins::{metric, post};
use super::{http, prompt, system_tool};

/// A tenant name with a quote, a backslash and a newline.
const AWKWARD: &str = "acme \"eu\"\\prod\nblue";

/// `text` through `promtool check metrics`: its findings (empty when it passes).
fn promtool_check(promtool: &std::path::Path, text: &str) -> Result<(), String> {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() && said.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("{}: {said}", out.status))
    }
}

/// Reads a streamed answer's headers and first chunk, then leaves.
async fn leave_mid_stream(addr: std::net::SocketAddr, key: &str) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    let conn = tokio::spawn(conn);
    let body = json!({"prompt": prompt(40, 9), "max_tokens": 400, "stream": true});
    let req = Request::post("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let res = send.send_request(req).await.unwrap();
    assert_eq!(res.status(), 200);
    let mut b = res.into_body();
    let first = b.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some_and(|d| !d.is_empty()));
    drop(b);
    drop(send);
    conn.abort();
}

/// Every mode's `/metrics` after completions and chat, streamed and whole, one client leaving a
/// stream part-way, and a refused request: promtool finds nothing to say; the tenant's tokens are
/// counted under its escaped name; each streamed answer's time to first token and the gaps after
/// it, each answer's end with its outcome, the KV transfer where the gateway sees it, and the
/// cancellation in the phase it happened in are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_exposes_metrics_promtool_accepts() {
    let Some(promtool) = system_tool("promtool", "prometheus") else { return };
    // `[admission.tenants]`: bearer tokens' names (no API keys: any token is let in).
    let tenants = [("tok-awkward", AWKWARD), ("tok-plain", "plain")];
    let tenants: std::collections::BTreeMap<String, String> =
        tenants.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    let escaped = AWKWARD.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");

    // Every family some mode's scrape had, and those recorded only once something happens.
    let mut exported: BTreeSet<String> =
        baton_gateway::telemetry::Metrics::new(1, 0).unwrap().family_names().iter().cloned().collect();
    for handoff in [Mode::Native, Mode::Lmcache, Mode::VllmNixl, Mode::Sglang] {
        let mode = handoff.name();
        // Flow control on in one mode: its series (tenant labels included) go through promtool too.
        let flow = matches!(handoff, Mode::Native).then(|| FlowConfig::fair(Duration::from_secs(30)));
        let setup = GatewaySetup { tenants: tenants.clone(), flow, ..GatewaySetup::default() };
        let d = start(DemoConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            tp: 2,
            handoff,
            token_delay: Duration::from_millis(2),
            gateway: setup,
            ..DemoConfig::default()
        })
        .await
        .unwrap();
        for (path, stream) in [
            ("/v1/completions", false),
            ("/v1/completions", true),
            ("/v1/chat/completions", false),
            ("/v1/chat/completions", true),
        ] {
            // Streams ask for usage: the completion tokens are then the engine's count, not the
            // events (a chat stream's role chunk is an event).
            let mut body = if path.contains("chat") {
                json!({"messages": [{"role": "user", "content": prompt(30, 1)}], "max_tokens": 4, "stream": stream})
            } else {
                json!({"prompt": prompt(40, 2), "max_tokens": 4, "stream": stream})
            };
            if stream {
                body["stream_options"] = super::usage_opt(true);
            }
            for key in ["tok-awkward", "tok-plain"] {
                let a = post(d.addr, path, Some(key), &body).await;
                assert_eq!(a.status, 200, "{mode} {path}: {}", String::from_utf8_lossy(&a.body));
            }
        }
        leave_mid_stream(d.addr, "tok-plain").await;
        let refused =
            post(d.addr, "/v1/completions", Some("tok-plain"), &json!({"prompt": "x", "max_tokens": -1}))
                .await;
        assert_eq!(refused.status, 400);

        // The stream left part-way ends when the gateway notices; its series follow.
        let started = Instant::now();
        let m = loop {
            let (_, m) = http(d.admin, "/metrics", None).await;
            let m = String::from_utf8(m.to_vec()).unwrap();
            // In the stream, or (lmcache, whose headers and first token go out before its
            // decode) in the KV wait or decode the stream was still waiting on.
            let cancelled: f64 = ["stream", "kv_ready", "decode"]
                .iter()
                .map(|p| metric(&m, &format!("baton_cancellations_total{{phase=\"{p}\"}} ")))
                .sum();
            if cancelled == 1.0 {
                break m;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "{mode}: no cancellation counted:\n{m}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        exported
            .extend(m.lines().filter_map(|l| Some(l.strip_prefix("# TYPE ")?.split(' ').next()?.to_owned())));
        if let Err(e) = promtool_check(&promtool, &m) {
            panic!("{mode}: promtool check metrics: {e}\n{m}");
        }
        // 4 answers of 4 tokens each per tenant; the plain one also has the stream it left.
        let completion = |tenant: &str| {
            metric(&m, &format!("baton_tokens_total{{kind=\"completion\",tenant=\"{tenant}\"}} "))
        };
        assert_eq!(completion(&escaped), 16.0, "{mode}:\n{m}");
        assert!(completion("plain") >= 16.0, "{mode}:\n{m}");
        assert!(metric(&m, &format!("baton_tokens_total{{kind=\"prompt\",tenant=\"{escaped}\"}} ")) > 0.0);
        let count = |name: &str, labels: &str| metric(&m, &format!("{name}_count{{{labels}}} "));
        let mode_label = format!("mode=\"{mode}\"");
        // 4 streamed answers and the one left part-way.
        assert_eq!(count("baton_time_to_first_token_seconds", &mode_label), 5.0, "{mode}:\n{m}");
        assert!(count("baton_inter_token_seconds", &mode_label) >= 4.0, "{mode}:\n{m}");
        assert_eq!(count("baton_request_duration_seconds", &format!("{mode_label},outcome=\"ok\"")), 8.0);
        assert_eq!(
            count("baton_request_duration_seconds", &format!("{mode_label},outcome=\"cancelled\"")),
            1.0
        );
        if matches!(handoff, Mode::Native | Mode::Lmcache) {
            assert!(count("baton_kv_transfer_seconds", &mode_label) >= 8.0, "{mode}:\n{m}");
        }
        assert_eq!(metric(&m, "baton_requests_in_phase{phase=\"stream\"} "), 0.0);
        assert_eq!(metric(&m, "baton_requests_total{status=\"400\"} "), 1.0);
        if matches!(handoff, Mode::Native) {
            // Every request was let go by flow control, and each tenant's service counted.
            assert_eq!(metric(&m, "baton_flow_dispatched_total{band=\"default\"} "), 9.0, "{m}");
            let served = format!("baton_flow_tenant_served_cost_total{{tenant=\"{escaped}\"}} ");
            assert!(metric(&m, &served) > 0.0, "{m}");
        }
        drop(d);
    }
    // The dashboard and the alert rules ask only for what the gateway exports.
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    for file in ["grafana/baton-dashboard.json", "prometheus/baton-alerts.yml"] {
        let text = std::fs::read_to_string(deploy.join(file)).unwrap();
        let asked = metric_names(&text);
        assert!(asked.len() >= 5, "{file}: {asked:?}");
        let unknown: Vec<&String> = asked.iter().filter(|n| !exported.contains(family_of(n))).collect();
        assert!(
            unknown.is_empty(),
            "{file} asks for metrics the gateway does not export: {unknown:?}\nexported: {exported:?}"
        );
    }
}

/// The `baton_*` names in a dashboard's or a rule file's queries.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("baton_") {
        let name: String =
            rest[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        rest = &rest[at + name.len()..];
        out.insert(name);
    }
    out
}

/// A histogram's sample name's family (`_bucket`, `_sum`, `_count` taken off).
fn family_of(sample: &str) -> &str {
    ["_bucket", "_sum", "_count"].iter().find_map(|s| sample.strip_suffix(s)).unwrap_or(sample)
}

/// The alert rules load in Prometheus' own checker, and their unit tests (alerts that fire on a
/// stuck request, a lease expiration, an engine error rate, a full buffer, and stay quiet
/// otherwise) pass.
#[test]
fn alert_rules_check_and_their_tests_pass() {
    let Some(promtool) = system_tool("promtool", "prometheus") else { return };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus");
    for args in [["check", "rules", "baton-alerts.yml"], ["test", "rules", "baton-alerts.test.yml"]] {
        let out = Command::new(&promtool).args(args).current_dir(&dir).output().unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A request held in the KV wait (a decoder rank drops its READY) is listed by
/// `GET /admin/requests?older_than_ms=N` with its phase, age and decoder while it waits, counted in
/// the in-flight gauges, and gone once its wait times out; a younger threshold hides it. The
/// decoders cannot wait for the KV themselves here: the gateway's own wait is the one held (a
/// decoder that waits finds its KV in whatever the feed said).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stuck_view_lists_a_request_held_in_the_kv_wait() {
    let limits = baton_gateway::handoff::Limits {
        ready_timeout: Duration::from_secs(3),
        ..baton_gateway::handoff::Limits::default()
    };
    let d = start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp: 2,
        decode_waits: false,
        gateway: GatewaySetup { limits, ..GatewaySetup::default() },
        ..DemoConfig::default()
    })
    .await
    .unwrap();
    let decoder = d.decode_addrs()[0];
    let (s, b) =
        http(decoder, "/sim/faults", Some(&json!({"drop_ready_rank": 1, "drop_ready_events": 1}))).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let addr = d.addr;
    let held = tokio::spawn(async move {
        http(addr, "/v1/completions", Some(&json!({"prompt": prompt(40, 3), "max_tokens": 2}))).await
    });
    let started = Instant::now();
    let listed = loop {
        let (s, b) = http(d.admin, "/admin/requests?older_than_ms=500", None).await;
        assert_eq!(s, 200);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        if let Some(r) = v["requests"].as_array().and_then(|l| l.first()) {
            break r.clone();
        }
        assert!(started.elapsed() < Duration::from_secs(2), "never listed: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(listed["phase"], "kv_ready", "{listed}");
    assert_eq!(listed["decoder"], "decode-0", "{listed}");
    assert!(listed["age_ms"].as_u64().unwrap() >= 500, "{listed}");
    assert!(listed["in_phase_ms"].as_u64().unwrap() <= listed["age_ms"].as_u64().unwrap(), "{listed}");
    assert_eq!(listed["id"].as_str().map(str::len), Some(32), "{listed}");
    let (_, m) = http(d.admin, "/metrics", None).await;
    let m = String::from_utf8(m.to_vec()).unwrap();
    assert_eq!(metric(&m, "baton_requests_in_phase{phase=\"kv_ready\"} "), 1.0, "{m}");
    assert!(metric(&m, "baton_oldest_request_age_seconds{phase=\"kv_ready\"} ") >= 0.5, "{m}");
    // A threshold past its age hides it.
    let (_, b) = http(d.admin, "/admin/requests?older_than_ms=60000", None).await;
    let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["requests"], json!([]), "{v}");
    let (s, _) = http(d.admin, "/admin/requests?older_than_ms=soon", None).await;
    assert_eq!(s, 400);
    // The wait times out: 502, and the request leaves the view.
    let (s, b) = held.await.unwrap();
    assert_eq!(s, 502, "{}", String::from_utf8_lossy(&b));
    let (_, b) = http(d.admin, "/admin/requests", None).await;
    let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["requests"], json!([]), "{v}");
    let (_, m) = http(d.admin, "/metrics", None).await;
    let m = String::from_utf8(m.to_vec()).unwrap();
    assert_eq!(metric(&m, "baton_engine_errors_total{leg=\"kv\",status=\"error\"} "), 1.0, "{m}");
    super::assert_clean(&d).await;
}

/// A request's decision record from `GET /admin/requests/{id}`.
async fn record(admin: std::net::SocketAddr, id: &str) -> serde_json::Value {
    let (s, b) = http(admin, &format!("/admin/requests/{id}"), None).await;
    assert_eq!(s, 200, "{id}: {}", String::from_utf8_lossy(&b));
    serde_json::from_slice(&b).unwrap()
}

/// Prefills that wait before their first chunk, so a request holds its decoder's pages for a while.
fn stalling_prefills(ms: u64) -> baton_sim::faults::FaultConfig {
    baton_sim::faults::FaultConfig { stall_chunk: Some(0), stall_ms: ms, ..Default::default() }
}

/// Sends `body` as request `first`, then `after_ms` later as request `second`; both must answer 200.
async fn one_behind_another(
    d: &baton_gateway::demo::Demo,
    body: &serde_json::Value,
    first: &str,
    second: &str,
    after_ms: u64,
) {
    let held = {
        let (addr, body, id) = (d.addr, body.clone(), first.to_owned());
        tokio::spawn(async move { super::request_ids::post(addr, "/v1/completions", &body, Some(&id)).await })
    };
    tokio::time::sleep(Duration::from_millis(after_ms)).await;
    let (s, id, b) = super::request_ids::post(d.addr, "/v1/completions", body, Some(second)).await;
    assert_eq!((s, id.as_str()), (200, second), "{}", String::from_utf8_lossy(&b));
    assert_eq!(held.await.unwrap().0, 200);
}

/// A request that waited for its decoder's room: its record says the built-in admission queued it,
/// how long it waited and who was ahead, the reservation, its phases and its outcome; a request
/// unknown here is a 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_of_a_request_queued_then_admitted() {
    // 16 pages of 16 tokens per rank; each request needs 10, so the second waits for the first.
    let d = start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tp: 2,
        pages: 16,
        prefill_faults: stalling_prefills(300),
        ..DemoConfig::default()
    })
    .await
    .unwrap();
    one_behind_another(&d, &json!({"prompt": prompt(150, 4), "max_tokens": 2}), "held-1", "queued-1", 100)
        .await;

    let r = record(d.admin, "queued-1").await;
    assert_eq!(r["id"], "queued-1", "{r}");
    assert_eq!(r["admission"]["verdict"], "queue", "{r}");
    assert_eq!(r["admission"]["by"], "built-in", "{r}");
    assert_eq!(r["queue"]["decoder"], "decode-0", "{r}");
    assert_eq!(r["queue"]["slots"], 10, "{r}");
    assert!(r["queue"]["wait_ms"].as_f64().unwrap() >= 100.0, "waited for the first: {r}");
    assert_eq!(r["reservation"]["pages_per_rank"], 10, "{r}");
    assert_eq!(r["reservation"]["ranks"], 2, "{r}");
    // The demo's prefillers reserve with their writes: no reserve phase in the gateway.
    assert_eq!(r["reservation"]["by"], "prefiller", "{r}");
    assert_eq!(r["reservation"]["refusals"], 0, "{r}");
    assert!(r["phases_ms"]["reserve"].is_null(), "{r}");
    assert_eq!(r["route"]["decode"], "decode-0", "{r}");
    assert_eq!(r["prompt_tokens"], 150, "{r}");
    for phase in ["route", "queue", "prefill", "kv_ready", "decode"] {
        assert!(r["phases_ms"][phase].is_number(), "{phase}: {r}");
    }
    assert_eq!(r["outcome"]["end"], "ok", "{r}");
    assert_eq!(r["outcome"]["status"], 200, "{r}");
    assert_eq!(r["outcome"]["completion_tokens"], 2, "{r}");
    assert!(r["duration_ms"].as_u64().unwrap() >= r["queue"]["wait_ms"].as_f64().unwrap() as u64, "{r}");
    // The first did not wait behind anyone.
    let h = record(d.admin, "held-1").await;
    assert_eq!(h["queue"]["waiting_ahead"], 0, "{h}");
    assert!(h["queue"]["wait_ms"].as_f64().unwrap() < 100.0, "{h}");
    let (s, _) = http(d.admin, "/admin/requests/nobody", None).await;
    assert_eq!(s, 404);
}

/// Three decoders, one holding a request's pages: the next request's record names the decoder it
/// went to and why each of the other two lost, in the numbers the built-in kv-aware policy compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_among_three_decoders_says_why_two_lost() {
    let d = start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        decoders: 3,
        tp: 1,
        pages: 64,
        prefill_faults: stalling_prefills(400),
        ..DemoConfig::default()
    })
    .await
    .unwrap();
    one_behind_another(&d, &json!({"prompt": prompt(150, 5), "max_tokens": 2}), "a", "b", 150).await;
    let a = record(d.admin, "a").await;
    assert_eq!(a["route"]["decode"], "decode-0", "{a}");
    let r = record(d.admin, "b").await;
    let route = &r["route"];
    assert_eq!(route["policy"], "kv-aware", "{r}");
    assert_eq!(route["decode"], "decode-1", "{r}");
    let decoders = route["decoders"].as_array().unwrap();
    assert_eq!(decoders.len(), 3, "{r}");
    let by_name = |n: &str| decoders.iter().find(|d| d["name"] == n).unwrap();
    assert_eq!(by_name("decode-1")["won"], true);
    assert!(by_name("decode-1")["why_not"].is_null(), "{r}");
    assert_eq!(by_name("decode-0")["free_slots"], 54, "{r}");
    assert_eq!(by_name("decode-0")["why_not"], "fewer slots free: 54 against 64", "{r}");
    assert_eq!(by_name("decode-2")["why_not"], "tied with the chosen one, which comes first", "{r}");
    for n in ["decode-0", "decode-2"] {
        assert_eq!(by_name(n)["won"], false, "{r}");
    }
}

/// `x-baton-explain: 1`: a whole answer carries its decision record in the response header, a stream
/// as an SSE comment just before `data: [DONE]`, the answer itself unchanged; without
/// `[telemetry] explain` the header is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_sends_the_record_only_when_allowed() {
    for allowed in [true, false] {
        let d = start(DemoConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            tp: 2,
            gateway: GatewaySetup { explain: allowed, ..GatewaySetup::default() },
            ..DemoConfig::default()
        })
        .await
        .unwrap();
        for stream in [false, true] {
            let body = json!({"prompt": prompt(40, 6), "max_tokens": 3, "stream": stream});
            let id = format!("explain-{stream}");
            let headers = [("x-request-id", id.as_str()), ("x-baton-explain", "1")];
            let res = super::client::send_with(d.addr, "/v1/completions", Some(&body), &headers).await;
            assert_eq!(res.status(), 200);
            let header = res.headers().get("x-baton-explain").map(|v| v.to_str().unwrap().to_owned());
            let text =
                String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
            let comment = text.lines().find_map(|l| l.strip_prefix(": baton-explain ")).map(str::to_owned);
            if !allowed {
                assert!(header.is_none() && comment.is_none(), "explain is off: {header:?} {text}");
                continue;
            }
            let json = if stream {
                assert!(header.is_none());
                let at = text.find(": baton-explain ").unwrap();
                assert!(at < text.find("data: [DONE]").unwrap(), "the record comes before [DONE]: {text}");
                comment.unwrap()
            } else {
                assert!(comment.is_none());
                header.unwrap()
            };
            let r: serde_json::Value = serde_json::from_str(&json).unwrap();
            assert_eq!(r["id"], format!("explain-{stream}"), "{r}");
            assert_eq!(r["route"]["decode"], "decode-0", "{r}");
            assert!(r["phases_ms"]["prefill"].is_number(), "{r}");
            // The whole answer still parses as what the client asked for.
            if !stream {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert!(v["choices"][0]["text"].is_string(), "{v}");
            }
        }
    }
}
