//! Request ids: the client's `x-request-id` (or one made here) comes back in the response header and
//! in error bodies, reaches both engines of every handoff mode, and is the `id` of the `request`
//! span on the gateway's JSON log lines of that request.

use std::net::SocketAddr;

use baton_gateway::demo::{Demo, DemoConfig, start};
use baton_gateway::handoff::Mode;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;

/// POSTs `body` with an optional `x-request-id`; the status, the id header and the body.
pub(crate) async fn post(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    id: Option<&str>,
) -> (u16, String, Bytes) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req =
        Request::post(path).header("host", addr.to_string()).header("content-type", "application/json");
    if let Some(id) = id {
        req = req.header("x-request-id", id);
    }
    let res = send.send_request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await.unwrap();
    let status = res.status().as_u16();
    let got = res.headers().get("x-request-id").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
    (status, got, res.into_body().collect().await.unwrap().to_bytes())
}

/// The `x-request-id` of every generation request an engine received.
fn received_ids(d: &Demo, engine: usize) -> Vec<String> {
    d.engines[engine]
        .engine
        .received()
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["headers"]["x-request-id"].as_str().unwrap_or("<none>").to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_reach_both_engines_in_every_mode_and_come_back() {
    for mode in [Mode::Native, Mode::Lmcache, Mode::VllmNixl, Mode::Sglang] {
        let d = start(DemoConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            tp: 2,
            handoff: mode,
            ..DemoConfig::default()
        })
        .await
        .unwrap();
        let mut ids = Vec::new();
        for (i, stream) in [false, true].into_iter().enumerate() {
            let body = json!({"prompt": "hello there, engines", "max_tokens": 3, "stream": stream});
            let client_id = format!("client-{}-{i}", mode.name());
            let (s, got, b) = post(d.addr, "/v1/completions", &body, Some(&client_id)).await;
            assert_eq!(s, 200, "{}: {}", mode.name(), String::from_utf8_lossy(&b));
            assert_eq!(got, client_id, "{}", mode.name());
            ids.push(client_id);
            // No id, or one that is not sane: one is made.
            let bad = "has spaces; and more";
            for sent in [None, Some(bad)] {
                let (s, got, _) = post(d.addr, "/v1/completions", &body, sent).await;
                assert_eq!(s, 200);
                assert_eq!(got.len(), 32, "{}: a made id: {got:?}", mode.name());
                assert!(got.bytes().all(|b| b.is_ascii_hexdigit()));
                ids.push(got);
            }
        }
        // Engine 0 is the prefiller, engine 1 the decoder: each of their generation calls (what
        // the simulated engines keep) named its request, and carried the `Host` and
        // `Content-Type` an HTTP/1.1 client sends (built once per engine by the gateway, not by
        // hyper-util per call).
        for engine in [0, 1] {
            for r in d.engines[engine].engine.received().as_array().unwrap() {
                let h = &r["headers"];
                assert_eq!(
                    h["host"],
                    d.engines[engine].addr.to_string(),
                    "{} engine {engine}: {r}",
                    mode.name()
                );
                assert_eq!(h["content-type"], "application/json", "{} engine {engine}: {r}", mode.name());
            }
            let got = received_ids(&d, engine);
            for id in &ids {
                assert!(got.contains(id), "{} engine {engine}: {id} not in {got:?}", mode.name());
            }
            assert!(
                got.iter().all(|g| ids.contains(g)),
                "{} engine {engine}: only these ids: {got:?}",
                mode.name()
            );
        }
        let (s, got, b) =
            post(d.addr, "/v1/completions", &json!({"prompt": "x", "temperature": 9}), Some("bad-req-1"))
                .await;
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            (s, got.as_str(), v["error"]["request_id"].as_str()),
            (400, "bad-req-1", Some("bad-req-1")),
            "{v}"
        );
        d.shutdown().await;
    }
}

/// Runs the `baton demo` binary with `args` (debug logs, stderr to a pipe, `NO_COLOR` unset),
/// makes the requests `run` makes at its address, and returns what it logged.
fn demo_logs<F: std::future::Future<Output = ()>>(
    args: &[&str],
    run: impl FnOnce(SocketAddr) -> F,
) -> String {
    use std::io::{BufRead, BufReader, Read};
    use std::process::{Command, Stdio};

    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["demo", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(args)
        .env("RUST_LOG", "baton_gateway=debug")
        .env_remove("NO_COLOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr: SocketAddr = loop {
        let line = lines.next().expect("the demo printed its address").unwrap();
        if let Some(rest) = line.split("gateway on http://").nth(1) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    tokio::runtime::Runtime::new().unwrap().block_on(run(addr));
    child.kill().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let _ = child.wait();
    err
}

/// The `baton demo` binary with JSON logs: the lines a request logs carry its id in their span.
#[test]
fn json_log_lines_carry_the_request_id() {
    let err = demo_logs(&["--log-format", "json"], |addr| async move {
        let (s, _, _) =
            post(addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}), Some("log-me-1")).await;
        assert_eq!(s, 200);
        let (s, _, _) =
            post(addr, "/v1/completions", &json!({"prompt": "hi", "top_p": 0}), Some("log-me-2")).await;
        assert_eq!(s, 400);
    });
    let logs: Vec<Value> = err.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    for (id, message) in [("log-me-1", "answered"), ("log-me-2", "request refused")] {
        let line = logs
            .iter()
            .find(|l| l["span"]["id"] == id)
            .unwrap_or_else(|| panic!("no log line in request {id}'s span:\n{err}"));
        assert_eq!(line["span"]["name"], "request", "{line}");
        assert_eq!(line["message"], message, "{line}");
    }
}

/// The `baton demo` binary with text logs to a pipe (a file, journald, a container's log): plain
/// lines, no colour escapes, a request's lines in its span with its id.
#[test]
fn text_logs_to_a_pipe_are_plain() {
    let err = demo_logs(&[], |addr| async move {
        let (s, _, _) =
            post(addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}), Some("plain-1")).await;
        assert_eq!(s, 200);
    });
    assert!(!err.contains('\x1b'), "colour escapes in logs to a pipe:\n{err}");
    assert!(
        err.lines().any(|l| l.contains("request{id=plain-1}") && l.contains("answered")),
        "no plain line in request plain-1's span:\n{err}"
    );
}
