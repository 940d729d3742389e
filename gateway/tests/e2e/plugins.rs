//! Policy plugins through `baton serve`: the example plugins (built by `scripts/build-plugins`)
//! deciding admission and routing, the sandbox under faults, hot reload under load.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use baton_sim::{Running, SimConfig, SimRole, launch, tiny_geometry};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;

pub(super) fn plugin(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/plugins").join(format!("{name}.wasm"));
    assert!(p.is_file(), "{} is missing: run scripts/build-plugins (scripts/test does)", p.display());
    p
}

struct Setup {
    serving: baton_gateway::serve::Serving,
    _sims: Vec<Running>,
    dir: PathBuf,
}

impl Setup {
    fn addr(&self) -> SocketAddr {
        self.serving.addrs[0]
    }

    fn admin(&self) -> SocketAddr {
        self.serving.admin_addr
    }

    async fn stop(self) {
        self.serving.shutdown().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One prefiller and two decoders (`d0`, `d1`) behind `baton serve`, with `plugins` appended to the
/// TOML (plugin paths relative to the config's directory, where the components are copied).
async fn serve(tag: &str, plugins: &str, files: &[(&str, &str)]) -> Setup {
    serve_with(tag, plugins, files, &[]).await
}

/// [`serve`], with `texts` (name, contents) written beside the TOML first.
async fn serve_with(tag: &str, plugins: &str, files: &[(&str, &str)], texts: &[(&str, &str)]) -> Setup {
    let (file, sims, dir) = configure(tag, plugins, files, texts).await;
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    Setup { serving, _sims: sims, dir }
}

/// The engines of [`serve_with`] started and its TOML written: the file, the engines, the directory.
async fn configure(
    tag: &str,
    plugins: &str,
    files: &[(&str, &str)],
    texts: &[(&str, &str)],
) -> (PathBuf, Vec<Running>, PathBuf) {
    let g = tiny_geometry(1).unwrap();
    let prefill = launch(SimConfig::new(SimRole::Prefill, g)).await.unwrap();
    let mut decoders = String::new();
    let mut sims = vec![];
    for i in 0..2 {
        let d = launch(SimConfig::new(SimRole::Decode, g)).await.unwrap();
        decoders += &format!(
            "[[decode]]\nname = \"d{i}\"\nurl = \"http://{}\"\ndataplane = [{}]\n\n",
            d.addr,
            super::toml_ranks(&d)
        );
        sims.push(d);
    }
    let dir = std::env::temp_dir().join(format!("baton-plugins-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (from, to) in files {
        std::fs::copy(plugin(from), dir.join(to)).unwrap();
    }
    for (name, text) in texts {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let text = format!(
        r#"{head}
[[prefill]]
name = "p"
url = "http://{}"

{decoders}
[admission.tenants]
"sk-alice" = "alice"
"sk-bob" = "bob"
"sk-loop" = "loop"
"sk-grow" = "grow"
"sk-trap" = "trap"
"sk-bad" = "bad-status"
"sk-print" = "print"

[plugins]
cache_dir = "{cache}"
{plugins}
"#,
        prefill.addr,
        head = super::SERVE_HEAD,
        cache = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/plugin-cache-tests").display(),
    );
    sims.push(prefill);
    let file = dir.join("baton.toml");
    std::fs::write(&file, text).unwrap();
    (file, sims, dir)
}

pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: hyper::HeaderMap,
    pub(crate) body: Bytes,
}

/// POSTs `body`, with `Authorization: Bearer <key>` when given.
pub(crate) async fn post(addr: SocketAddr, path: &str, key: Option<&str>, body: &Value) -> Answer {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req =
        Request::post(path).header("host", addr.to_string()).header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let res = send.send_request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await.unwrap();
    let (status, headers) = (res.status().as_u16(), res.headers().clone());
    Answer { status, headers, body: res.into_body().collect().await.unwrap().to_bytes() }
}

/// `GET /v1/models`'s status, with `key` as the bearer token when given.
async fn models(addr: SocketAddr, key: Option<&str>) -> u16 {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req = Request::get("/v1/models").header("host", addr.to_string());
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    send.send_request(req.body(Full::new(Bytes::new())).unwrap()).await.unwrap().status().as_u16()
}

/// With `[auth]` off, a bearer token `[admission.tenants]` does not name is a tenant to the
/// plugins by an opaque id, stable from request to request (the token-budget plugin keeps one
/// budget for it), and the token itself appears nowhere: not in the plugin's 429 message, not in
/// `/admin/requests` and its records, not in the binary's debug log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlisted_bearer_token_is_an_opaque_tenant_and_never_shown() {
    let (file, _sims, dir) = configure(
        "opaque",
        "[plugins.admission]\npath = \"token_budget.wasm\"\n[plugins.admission.config]\n\
         tokens_per_minute = 200\ndefault_max_tokens = 16\n[telemetry]\nlog_level = \"debug\"\n",
        &[("token_budget", "token_budget.wasm")],
        &[],
    )
    .await;
    let log = dir.join("baton.log");
    let (mut proc, addr, admin) = super::drain::spawn_with(
        &["serve", "--config", file.to_str().unwrap()],
        std::fs::File::create(&log).unwrap().into(),
    );
    const SECRET: &str = "SECRETtoken9d7f";
    let token = format!("sk-{SECRET}");
    let body = json!({"prompt": "a few words to count", "max_tokens": 60});
    let (mut answers, mut ids) = (Vec::new(), Vec::new());
    let refused = loop {
        let a = post(addr, "/v1/completions", Some(&token), &body).await;
        answers.push(String::from_utf8_lossy(&a.body).into_owned());
        ids.push(a.headers["x-request-id"].to_str().unwrap().to_owned());
        if a.status != 200 {
            break a;
        }
        assert!(answers.len() < 10, "the budget never ran out: the tenant is not stable");
    };
    assert!(answers.len() >= 2, "the first request fits the budget");
    assert_eq!(refused.status, 429, "{}", String::from_utf8_lossy(&refused.body));
    let v: Value = serde_json::from_slice(&refused.body).unwrap();
    let want = format!(
        "tenant {} is over its budget of 200 tokens per minute",
        baton_gateway::policy::opaque_tenant(&token)
    );
    assert_eq!(v["error"]["message"], want.as_str());
    let id = want.trim_start_matches("tenant anon-").split(' ').next().unwrap();
    assert!(id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit()), "{want}");
    // Another unlisted token is another tenant.
    assert_eq!(post(addr, "/v1/completions", Some("sk-other"), &body).await.status, 200);
    let mut seen = get(admin, "/admin/requests").await;
    for id in &ids {
        let record = get(admin, &format!("/admin/requests/{id}")).await;
        let r: Value = serde_json::from_str(&record).unwrap();
        assert!(r["admission"].is_object() || r["outcome"].is_object(), "{id}: no record: {record}");
        seen += &record;
    }
    seen += &answers.concat();
    proc.term();
    assert_eq!(proc.exit_code(Duration::from_secs(10)).await, 0);
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("DEBUG"), "the log is at debug level: {logged}");
    assert!(logged.contains("anon-"), "the plugin's refusal is logged by its tenant id: {logged}");
    for (what, text) in [("log", &logged), ("admin and answers", &seen)] {
        assert!(!text.contains(SECRET), "the token is in the {what}: {text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `[auth] models_open = true` leaves `/v1/models` open while generation needs a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_open_leaves_the_model_list_open() {
    let keys = key_entry("key-a", "acme");
    let s = serve_with(
        "models-open",
        "[auth]\nkeys_file = \"keys.toml\"\nmodels_open = true\n",
        &[],
        &[("keys.toml", &keys)],
    )
    .await;
    assert_eq!(models(s.addr(), None).await, 200);
    let body = json!({"prompt": "hi", "max_tokens": 1});
    assert_eq!(post(s.addr(), "/v1/completions", None, &body).await.status, 401);
    assert_eq!(post(s.addr(), "/v1/completions", Some("key-a"), &body).await.status, 200);
    s.stop().await;
}

async fn get(addr: SocketAddr, path: &str) -> String {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let req = Request::get(path).header("host", addr.to_string()).body(Full::new(Bytes::new())).unwrap();
    let res = send.send_request(req).await.unwrap();
    String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

/// The value of the sample that `line` (name and labels) starts.
pub(crate) fn metric(text: &str, line: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line))
        .unwrap_or_else(|| panic!("no {line} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Sends `body` as `key` until it is refused (at least one admitted, fewer than 10): the refusal.
async fn spend(addr: SocketAddr, key: &str, body: &Value) -> Answer {
    for admitted in 0..10 {
        let a = post(addr, "/v1/completions", Some(key), body).await;
        if a.status != 200 {
            assert!(admitted >= 1, "the first request fits the budget");
            return a;
        }
    }
    panic!("the budget never ran out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_plugin_rejects_a_tenant_over_budget_with_its_status_and_message() {
    let s = serve(
        "budget",
        r#"[plugins.admission]
path = "token_budget.wasm"
[plugins.admission.config]
tokens_per_minute = 200
default_max_tokens = 16
"#,
        &[("token_budget", "token_budget.wasm")],
    )
    .await;
    let body = json!({"prompt": "a few words to count", "max_tokens": 60});
    let refused = spend(s.addr(), "sk-alice", &body).await;
    assert_eq!(refused.status, 429, "{}", String::from_utf8_lossy(&refused.body));
    let v: Value = serde_json::from_slice(&refused.body).unwrap();
    assert_eq!(v["error"]["code"], "rejected_by_policy");
    assert_eq!(v["error"]["message"], "tenant alice is over its budget of 200 tokens per minute");
    let retry: u64 = refused.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "retry-after {retry}");
    // Its decision record: the plugin's verdict and reason, never routed or queued.
    let id = refused.headers["x-request-id"].to_str().unwrap();
    let r: Value = serde_json::from_str(&get(s.admin(), &format!("/admin/requests/{id}")).await).unwrap();
    assert_eq!(r["admission"]["by"], "admission", "{r}");
    assert_eq!(r["admission"]["verdict"], "reject", "{r}");
    assert_eq!(r["admission"]["status"], 429, "{r}");
    assert_eq!(r["admission"]["message"], "tenant alice is over its budget of 200 tokens per minute", "{r}");
    assert_eq!(r["admission"]["retry_after_s"], retry, "{r}");
    assert!(r.get("route").is_none() && r.get("queue").is_none(), "{r}");
    assert_eq!(r["outcome"]["end"], "error", "{r}");
    assert_eq!(r["outcome"]["origin"], "policy", "{r}");
    assert_eq!(r["outcome"]["code"], "rejected_by_policy", "{r}");
    // Another tenant has its own budget.
    assert_eq!(post(s.addr(), "/v1/completions", Some("sk-bob"), &body).await.status, 200);
    // Streamed answers are admitted the same way.
    let streamed = json!({"prompt": "a few words to count", "max_tokens": 4, "stream": true});
    let a = post(s.addr(), "/v1/completions", Some("sk-bob"), &streamed).await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    assert!(String::from_utf8_lossy(&a.body).contains("data: [DONE]"));
    // A prompt bigger than any budget is a 400 from the plugin.
    let big = json!({"prompt": "word ".repeat(300), "max_tokens": 1});
    let a = post(s.addr(), "/v1/completions", Some("sk-bob"), &big).await;
    assert_eq!(a.status, 400, "{}", String::from_utf8_lossy(&a.body));
    let m = get(s.admin(), "/metrics").await;
    assert_eq!(
        metric(&m, "baton_plugin_faults_total{kind=\"trap\",plugin=\"admission\",world=\"admission\"}"),
        0.0
    );
    // The operator raises the budget in the TOML and reloads: the plugin gets its new table.
    let file = s.dir.join("baton.toml");
    let toml = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, toml.replace("tokens_per_minute = 200", "tokens_per_minute = 100000")).unwrap();
    let r = post(s.admin(), "/admin/plugins/reload", None, &json!({})).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(post(s.addr(), "/v1/completions", Some("sk-alice"), &body).await.status, 200);
    // A table the plugin refuses is refused; the version before keeps serving.
    std::fs::write(&file, toml.replace("tokens_per_minute = 200", "tokens_per_minute = 0")).unwrap();
    let r = post(s.admin(), "/admin/plugins/reload", None, &json!({})).await;
    assert_eq!(r.status, 422, "{}", String::from_utf8_lossy(&r.body));
    assert!(String::from_utf8_lossy(&r.body).contains("tokens_per_minute must be above 0"));
    assert_eq!(post(s.addr(), "/v1/completions", Some("sk-alice"), &body).await.status, 200);
    s.stop().await;
}

/// With flow control on, an admission plugin reads the request's band: the token-budget example
/// leaves requests in its `unmetered_bands` out of the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_plugin_reads_the_band_flow_control_gave() {
    let s = serve(
        "bands",
        r#"[plugins.admission]
path = "token_budget.wasm"
[plugins.admission.config]
tokens_per_minute = 200
default_max_tokens = 16
unmetered_bands = ["free"]

[flow]
bands = [{ name = "standard", priority = 5 }, { name = "free", priority = 0 }]
default_band = "standard"
"#,
        &[("token_budget", "token_budget.wasm")],
    )
    .await;
    let body = json!({"prompt": "a few words to count", "max_tokens": 60});
    assert_eq!(spend(s.addr(), "sk-alice", &body).await.status, 429);
    // Over budget in the default band; the free band is not counted.
    let free = |key: &'static str| {
        let (addr, body) = (s.addr(), body.clone());
        async move {
            let stream = TcpStream::connect(addr).await.unwrap();
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
            tokio::spawn(conn);
            let req = Request::post("/v1/completions")
                .header("host", addr.to_string())
                .header("content-type", "application/json")
                .header("authorization", format!("Bearer {key}"))
                .header("x-priority", "free")
                .body(Full::new(Bytes::from(body.to_string())))
                .unwrap();
            let res = send.send_request(req).await.unwrap();
            let status = res.status().as_u16();
            (status, res.into_body().collect().await.unwrap().to_bytes())
        }
    };
    for _ in 0..5 {
        let (status, b) = free("sk-alice").await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    }
    assert_eq!(post(s.addr(), "/v1/completions", Some("sk-alice"), &body).await.status, 429);
    // Another tenant in the free band.
    for _ in 0..5 {
        assert_eq!(free("sk-bob").await.0, 200);
    }
    let v: Value = serde_json::from_str(&get(s.admin(), "/admin/flow").await).unwrap();
    let free_band = v["bands"].as_array().unwrap().iter().find(|b| b["name"] == "free").unwrap();
    assert_eq!(free_band["dispatched"], 10, "{v}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_plugin_choice_is_the_endpoint_that_served() {
    let s = serve(
        "route",
        "[plugins.routing]\npath = \"prefix_affinity.wasm\"\ninline = true\n",
        &[("prefix_affinity", "prefix_affinity.wasm")],
    )
    .await;
    let gw = &s.serving.gateway;
    let plugins = gw.plugins.as_ref().unwrap();
    let mut direct = plugins.routing.as_ref().unwrap().direct();
    let mut served = std::collections::BTreeSet::new();
    for i in 0..12 {
        let body = json!({"prompt": format!("prefix number {i} and then some more words"), "max_tokens": 2});
        // What the plugin picks for this prompt on idle decoders, asked directly.
        let req = baton_gateway::api::GenRequest::parse(
            baton_gateway::api::Endpoint::Completions,
            body.to_string().as_bytes(),
        )
        .unwrap();
        let ids = gw.model.tokenizer.token_ids(&req).unwrap();
        let headers = hyper::HeaderMap::new();
        let sender = baton_gateway::policy::Sender { headers: &headers, tenant: None, flow: None };
        let facts = plugins.request("baton-sim", "completions", sender, &ids, 1, Some(2));
        let (p, d) = baton_gateway::policy::calls::views(&gw.candidates(&ids));
        let want = match direct.route(&facts, &p, &d) {
            Some(baton_gateway::routing::Decision::Route(r)) => format!("d{}", r[0].decode),
            other => panic!("{other:?}"),
        };
        for _ in 0..2 {
            let a = post(s.addr(), "/v1/completions", None, &body).await;
            assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
            let route = a.headers[baton_gateway::pipeline::ROUTE_HEADER].to_str().unwrap().to_owned();
            assert_eq!(route, format!("prefill=p, decode={want}"), "prompt {i}");
            served.insert(want.clone());
        }
    }
    assert_eq!(served.len(), 2, "prefixes spread over both decoders");
    let m = get(s.admin(), "/metrics").await;
    let calls = metric(&m, "baton_plugin_calls_total{plugin=\"routing\",world=\"routing\"}");
    assert!(calls >= 24.0);
    // Every call timed: the histogram counts each, and its sum is a time (above 0, far below the
    // run's length).
    let timed = metric(&m, "baton_plugin_call_seconds_count{plugin=\"routing\",world=\"routing\"}");
    let took = metric(&m, "baton_plugin_call_seconds_sum{plugin=\"routing\",world=\"routing\"}");
    assert_eq!(timed, calls, "{m}");
    assert!(took > 0.0 && took < 10.0, "{took}");
    let inf =
        metric(&m, "baton_plugin_call_seconds_bucket{plugin=\"routing\",world=\"routing\",le=\"+Inf\"}");
    assert_eq!(inf, calls);
    assert_eq!(gw.router.invalid.load(Ordering::Relaxed), 0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_fall_back_to_the_builtin_and_the_gateway_keeps_answering() {
    let s = serve(
        "faults",
        r#"[plugins.admission]
path = "faulty.wasm"
inline = true
deadline_us = 250000
memory_mib = 16
max_faults = 100
"#,
        &[("faulty", "faulty.wasm")],
    )
    .await;
    // The deadline leaves room for the growing plugin to reach its 16 MiB on a loaded machine
    // (it once ran out of time first, under parallel builds, and was counted a deadline fault);
    // the spinning one still ends within it.
    let body = json!({"prompt": "anything", "max_tokens": 2});
    let m0 = get(s.admin(), "/metrics").await;
    let faults = |m: &str, kind: &str| {
        metric(
            m,
            &format!("baton_plugin_faults_total{{kind=\"{kind}\",plugin=\"admission\",world=\"admission\"}}"),
        )
    };
    for (key, kind) in
        [("sk-loop", "deadline"), ("sk-grow", "memory"), ("sk-trap", "trap"), ("sk-bad", "invalid")]
    {
        let before = faults(&get(s.admin(), "/metrics").await, kind);
        let t = std::time::Instant::now();
        let a = post(s.addr(), "/v1/completions", Some(key), &body).await;
        assert_eq!(a.status, 200, "{key}: the built-in admitted it: {}", String::from_utf8_lossy(&a.body));
        assert!(t.elapsed() < Duration::from_secs(2), "{key} took {:?}", t.elapsed());
        let m = get(s.admin(), "/metrics").await;
        let counted: Vec<&str> = m.lines().filter(|l| l.starts_with("baton_plugin_faults_total")).collect();
        assert_eq!(faults(&m, kind), before + 1.0, "{key}: {counted:#?}");
        // Still answering, with the plugin back in charge.
        assert_eq!(post(s.addr(), "/v1/completions", Some("sk-alice"), &body).await.status, 200);
    }
    assert_eq!(faults(&m0, "deadline"), 0.0);
    let v: Value = serde_json::from_str(&get(s.admin(), "/admin/plugins").await).unwrap();
    assert_eq!(v["plugins"][0]["disabled"], false);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_hot_reloads_under_load_fail_no_request() {
    let s = serve(
        "reload",
        r#"watch_interval_ms = 20
[plugins.admission]
path = "policy.wasm"
[plugins.admission.config]
tokens_per_minute = 100000000
"#,
        &[("token_budget", "policy.wasm"), ("token_budget", "a.wasm"), ("faulty", "b.wasm")],
    )
    .await;
    let addr = s.addr();
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..4 {
        let (stop, ok, failed) = (Arc::clone(&stop), Arc::clone(&ok), Arc::clone(&failed));
        clients.spawn(async move {
            let mut i = 0u64;
            // Bounded: stops when told, or after 20 000 requests per client.
            while !stop.load(Ordering::Relaxed) && i < 20_000 {
                let body = json!({"prompt": format!("client {c} request {i}"), "max_tokens": 2});
                let a = post(addr, "/v1/completions", Some("sk-alice"), &body).await;
                if a.status == 200 {
                    ok.fetch_add(1, Ordering::Relaxed)
                } else {
                    failed.fetch_add(1, Ordering::Relaxed)
                };
                i += 1;
            }
        });
    }
    let plugin = Arc::clone(s.serving.gateway.plugins.as_ref().unwrap().admission.as_ref().unwrap());
    for n in 0..50u64 {
        let before = plugin.info().version;
        if n % 2 == 0 {
            let a = post(s.admin(), "/admin/plugins/reload", None, &json!({})).await;
            assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
        } else {
            // A new file moved into place (atomically, as a deploy would), alternating between two
            // different components of the same world; the watcher picks it up.
            let from = if n % 4 == 1 { "b.wasm" } else { "a.wasm" };
            std::fs::copy(s.dir.join(from), s.dir.join("next.wasm")).unwrap();
            std::fs::rename(s.dir.join("next.wasm"), s.dir.join("policy.wasm")).unwrap();
        }
        let t = std::time::Instant::now();
        while plugin.info().version == before {
            assert!(t.elapsed() < Duration::from_secs(10), "reload {n} never happened");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    while clients.join_next().await.is_some() {}
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert_eq!(failed, 0, "{failed} of {} requests failed", ok + failed);
    assert!(ok >= 50, "only {ok} requests during the reloads");
    assert!(plugin.stats.reloads.load(Ordering::Relaxed) >= 50);
    let faults: Vec<_> =
        baton_gateway::policy::Fault::ALL.iter().map(|&f| (f.name(), plugin.stats.fault_count(f))).collect();
    assert_eq!(plugin.stats.total_faults(), 0, "{faults:?}");
    s.stop().await;
}

fn key_entry(key: &str, tenant: &str) -> String {
    format!(
        "[[keys]]\nsha256 = \"{}\"\ntenant = \"{tenant}\"\n",
        baton_gateway::policy::sha256_hex(key.as_bytes())
    )
}

/// API keys: no key or an unknown one is a 401 in the OpenAI shape; two keys of one tenant share
/// that tenant's budget in the token-budget plugin (a client cannot escape it with a second key);
/// keys added to the file work after the admin reload and after the watcher sees the file change,
/// and a removed key stops working, all without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_bind_tenants_and_reload_without_a_restart() {
    let keys = key_entry("key-a1", "acme") + &key_entry("key-a2", "acme") + &key_entry("key-b", "bravo");
    let s = serve_with(
        "keys",
        r#"[plugins.admission]
path = "token_budget.wasm"
[plugins.admission.config]
tokens_per_minute = 200
default_max_tokens = 16

[auth]
keys_file = "keys.toml"
"#,
        &[("token_budget", "token_budget.wasm")],
        &[("keys.toml", &keys)],
    )
    .await;
    let body = json!({"prompt": "a few words to count", "max_tokens": 60});
    for key in [None, Some("key-unknown"), Some("sk-alice")] {
        let a = post(s.addr(), "/v1/completions", key, &body).await;
        assert_eq!(a.status, 401, "{key:?}");
        let v: Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(
            (v["error"]["code"].as_str(), v["error"]["type"].as_str()),
            (Some("invalid_api_key"), Some("invalid_request_error")),
            "{v}"
        );
    }
    // `/v1/models` is under the same keys.
    assert_eq!(models(s.addr(), None).await, 401);
    assert_eq!(models(s.addr(), Some("key-unknown")).await, 401);
    assert_eq!(models(s.addr(), Some("key-b")).await, 200);
    // acme's budget, spent through either of its keys.
    let mut admitted = 0;
    for key in ["key-a1", "key-a2"].iter().cycle() {
        let a = post(s.addr(), "/v1/completions", Some(key), &body).await;
        if a.status != 200 {
            assert_eq!(a.status, 429, "{}", String::from_utf8_lossy(&a.body));
            let v: Value = serde_json::from_slice(&a.body).unwrap();
            assert_eq!(v["error"]["message"], "tenant acme is over its budget of 200 tokens per minute");
            break;
        }
        admitted += 1;
        assert!(admitted < 10, "the budget never ran out");
    }
    for key in ["key-a1", "key-a2"] {
        assert_eq!(
            post(s.addr(), "/v1/completions", Some(key), &body).await.status,
            429,
            "{key}: acme's budget is spent"
        );
    }
    assert_eq!(
        post(s.addr(), "/v1/completions", Some("key-b"), &body).await.status,
        200,
        "bravo has its own"
    );
    // A new key, by the admin call.
    let path = s.dir.join("keys.toml");
    std::fs::write(&path, keys.clone() + &key_entry("key-c", "charlie")).unwrap();
    let r = post(s.admin(), "/admin/keys/reload", None, &json!({})).await;
    assert_eq!((r.status, String::from_utf8_lossy(&r.body).into_owned()), (200, r#"{"keys":4}"#.to_owned()));
    assert_eq!(post(s.addr(), "/v1/completions", Some("key-c"), &body).await.status, 200);
    // A broken file keeps the keys in force.
    std::fs::write(&path, "[[keys]]\nsha256 = \"key-d\"\ntenant = \"d\"\n").unwrap();
    assert_eq!(post(s.admin(), "/admin/keys/reload", None, &json!({})).await.status, 400);
    assert_eq!(post(s.addr(), "/v1/completions", Some("key-c"), &body).await.status, 200);
    // The watcher: key-b removed, key-d added, no call.
    let replaced = key_entry("key-a1", "acme") + &key_entry("key-d", "delta");
    std::fs::write(&path, replaced).unwrap();
    let t = std::time::Instant::now();
    while post(s.addr(), "/v1/completions", Some("key-d"), &body).await.status != 200 {
        assert!(t.elapsed() < Duration::from_secs(5), "the watcher did not pick up the file");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        post(s.addr(), "/v1/completions", Some("key-b"), &body).await.status,
        401,
        "a removed key stops working"
    );
    s.stop().await;
}
