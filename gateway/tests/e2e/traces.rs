//! Traces as a collector receives them: an OTLP/HTTP receiver of the test's own on loopback decodes
//! the real protobuf (`opentelemetry-proto`), and the span tree of requests through every handoff
//! mode is checked against what the simulated engines received.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_gateway::demo::{DemoConfig, GatewaySetup, start};
use baton_gateway::handoff::Mode;
use baton_gateway::telemetry::trace::TraceConfig;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

use super::prompt;

/// The spans an OTLP/HTTP receiver got, with each export's `service.name`.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<(String, Span)>>>);

impl Received {
    fn spans(&self) -> Vec<Span> {
        self.0.lock().unwrap().iter().map(|(_, s)| s.clone()).collect()
    }
}

/// Listens on loopback for `POST /v1/traces` (protobuf) until dropped.
async fn otlp_receiver() -> (SocketAddr, Received, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let got = Received::default();
    let keep = got.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let keep = keep.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let keep = keep.clone();
                    async move {
                        let ok = req.uri().path() == "/v1/traces"
                            && req
                                .headers()
                                .get("content-type")
                                .is_some_and(|v| v == "application/x-protobuf");
                        let body = req.into_body().collect().await?.to_bytes();
                        let status = match ExportTraceServiceRequest::decode(body) {
                            Ok(r) if ok => {
                                for rs in r.resource_spans {
                                    let service = rs
                                        .resource
                                        .iter()
                                        .flat_map(|r| &r.attributes)
                                        .find(|kv| kv.key == "service.name")
                                        .and_then(|kv| text(kv.value.as_ref()?.value.as_ref()?))
                                        .unwrap_or_default();
                                    for s in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
                                        keep.0.lock().unwrap().push((service.clone(), s));
                                    }
                                }
                                200
                            }
                            _ => 400,
                        };
                        Ok::<_, hyper::Error>(
                            Response::builder()
                                .status(status)
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(Bytes::new()))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, got, task)
}

fn text(v: &Any) -> Option<String> {
    match v {
        Any::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// A span's attribute.
fn attr<'a>(s: &'a Span, key: &str) -> Option<&'a Any> {
    s.attributes.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn attr_str(s: &Span, key: &str) -> Option<String> {
    attr(s, key).and_then(text)
}

fn attr_int(s: &Span, key: &str) -> Option<i64> {
    match attr(s, key)? {
        Any::IntValue(n) => Some(*n),
        _ => None,
    }
}

/// Sends `body` to `path` with `headers`; the status and the whole body.
async fn send(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, Bytes) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req =
        Request::post(path).header("host", addr.to_string()).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let res = tx.send_request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await.unwrap();
    let status = res.status().as_u16();
    (status, res.into_body().collect().await.unwrap().to_bytes())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The `traceparent`s the engines received for generation requests: (trace id, parent id, flags).
fn engine_traceparents(d: &baton_gateway::demo::Demo) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for e in &d.engines {
        for r in e.engine.received().as_array().unwrap() {
            if let Some(tp) = r["headers"]["traceparent"].as_str() {
                let parts: Vec<&str> = tp.split('-').collect();
                assert_eq!(parts.len(), 4, "{tp}");
                assert_eq!(parts[0], "00", "{tp}");
                out.push((parts[1].to_owned(), parts[2].to_owned(), parts[3].to_owned()));
            }
        }
    }
    out
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// Through each handoff mode, a completion sent with the client's `traceparent` and a streamed
/// chat without one: the server span continues the client's trace and carries the GenAI
/// attributes; the phases are its children with the mode and decoder; each engine call is a
/// client span under its phase (or the request), and the `traceparent` each engine received names
/// that span as its parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_follow_each_request_through_every_mode_into_the_engines() {
    for handoff in [Mode::Native, Mode::Lmcache, Mode::VllmNixl, Mode::Sglang] {
        let mode = handoff.name();
        let (collector, got, receiver) = otlp_receiver().await;
        let trace = TraceConfig {
            endpoint: format!("http://{collector}"),
            sampling_ratio: 1.0,
            service_name: "baton-test".into(),
        };
        // SGLang's prefill answers once its KV has gone to the decoder; the simulated one here
        // answers after the decoder's whole (short) answer, so its span is made after the
        // request's ended (RequestTrace::beside), which the checks below look for.
        let late_prefill = handoff == Mode::Sglang;
        let sglang = baton_sim::SglangSimConfig {
            answer_delay: if late_prefill { LATE_PREFILL } else { Duration::ZERO },
            ..baton_sim::SglangSimConfig::default()
        };
        let d = start(DemoConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            tp: 2,
            handoff,
            sglang,
            gateway: GatewaySetup { trace: Some(trace), ..GatewaySetup::default() },
            ..DemoConfig::default()
        })
        .await
        .unwrap();
        let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
        let (status, body) = send(
            d.addr,
            "/v1/completions",
            &[("traceparent", &parent)],
            &json!({"prompt": prompt(40, 3), "max_tokens": 4}),
        )
        .await;
        assert_eq!(status, 200, "{mode}: {}", String::from_utf8_lossy(&body));
        // With usage: the output tokens are then the engine's count, not the events (a chat
        // stream's role chunk is one).
        let chat = json!({"messages": [{"role": "user", "content": prompt(30, 4)}], "max_tokens": 3,
                          "stream": true, "stream_options": {"include_usage": true}});
        let (status, body) = send(d.addr, "/v1/chat/completions", &[], &chat).await;
        assert_eq!(status, 200, "{mode}: {}", String::from_utf8_lossy(&body));
        // Refused before it is routed: its span says why.
        let (status, _) =
            send(d.addr, "/v1/completions", &[], &json!({"model": "nope", "prompt": "x", "max_tokens": 1}))
                .await;
        assert_eq!(status, 404);
        if late_prefill {
            // Both prefills answered and were timed: the span is made before the request's
            // timing is dropped into `baton_phase_seconds` (the metrics read here), and the
            // drain below sends what is made.
            let started = Instant::now();
            while prefills_timed(d.admin).await < 2 {
                assert!(started.elapsed() < Duration::from_secs(10), "{mode}: prefills not timed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let received = engine_traceparents(&d);
        let decoder = d.gateway.decoders[0].name.clone();
        // The drain sends what the exporter holds.
        let engines_at: BTreeSet<String> = d.engines.iter().map(|e| e.addr.port().to_string()).collect();
        d.drain(Duration::from_secs(5)).await;
        let started = Instant::now();
        let spans = loop {
            let s = got.spans();
            if s.iter().filter(|s| s.kind == SpanKind::Server as i32).count() >= 3 {
                break s;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "{mode}: spans: {s:#?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        receiver.abort();
        assert!(got.0.lock().unwrap().iter().all(|(service, _)| service == "baton-test"));
        let by_id: HashMap<String, &Span> = spans.iter().map(|s| (hex(&s.span_id), s)).collect();

        let servers: Vec<&Span> = spans.iter().filter(|s| s.kind == SpanKind::Server as i32).collect();
        assert_eq!(servers.len(), 3, "{mode}: {servers:#?}");
        let refused =
            servers.iter().find(|s| s.name == "text_completion nope").expect("the refused request's span");
        assert_eq!(attr_int(refused, "http.response.status_code"), Some(404));
        assert_eq!(attr_str(refused, "error.type").as_deref(), Some("model_not_found"));
        assert_eq!(refused.status.as_ref().map(|s| s.code), Some(2), "{mode}: status error");
        let completion =
            servers.iter().find(|s| s.name == "text_completion baton-sim").expect("completion span");
        let streamed = servers.iter().find(|s| s.name == "chat baton-sim").expect("chat span");
        // The client's trace continued.
        assert_eq!(hex(&completion.trace_id), CLIENT_TRACE, "{mode}");
        assert_eq!(hex(&completion.parent_span_id), CLIENT_SPAN, "{mode}");
        assert!(streamed.parent_span_id.is_empty(), "{mode}: a root without the client's traceparent");
        assert_ne!(hex(&streamed.trace_id), CLIENT_TRACE);
        for (s, op, max, out, reason) in
            [(completion, "text_completion", 4, 4, "length"), (streamed, "chat", 3, 3, "length")]
        {
            assert_eq!(attr_str(s, "gen_ai.operation.name").as_deref(), Some(op), "{mode}");
            assert_eq!(attr_str(s, "gen_ai.request.model").as_deref(), Some("baton-sim"));
            assert_eq!(attr_int(s, "gen_ai.request.max_tokens"), Some(max), "{mode}");
            assert!(attr_int(s, "gen_ai.usage.input_tokens").is_some_and(|n| n > 10), "{mode}: {s:#?}");
            assert_eq!(attr_int(s, "gen_ai.usage.output_tokens"), Some(out), "{mode}: {s:#?}");
            match attr(s, "gen_ai.response.finish_reasons") {
                Some(Any::ArrayValue(a)) => {
                    let r: Vec<String> = a.values.iter().filter_map(|v| text(v.value.as_ref()?)).collect();
                    assert_eq!(r, [reason], "{mode}");
                }
                other => panic!("{mode}: finish reasons {other:?}"),
            }
            assert_eq!(attr_int(s, "http.response.status_code"), Some(200));
            assert_eq!(attr_str(s, "baton.mode").as_deref(), Some(mode));
            assert_eq!(attr_str(s, "baton.decoder"), Some(decoder.clone()));

            // Its phases: children of it, inside its time, with the mode and the decoder.
            let children: Vec<&Span> = spans.iter().filter(|c| c.parent_span_id == s.span_id).collect();
            let names: BTreeSet<&str> = children.iter().map(|c| c.name.as_str()).collect();
            for phase in ["route", "queue", "prefill", "decode", "stream"] {
                assert!(names.contains(phase), "{mode} {op}: no {phase} span among {names:?}");
            }
            if matches!(handoff, Mode::Native | Mode::Lmcache) {
                assert!(names.contains("kv_ready"), "{mode}: {names:?}");
            }
            // The demo's prefillers reserve native pages with their writes: no reserve span.
            assert!(!names.contains("reserve"), "{mode}: {names:?}");
            if op == "chat" {
                assert!(names.contains("first_token"), "{mode}: {names:?}");
            }
            for c in &children {
                assert_eq!(c.trace_id, s.trace_id);
                assert!(c.start_time_unix_nano >= s.start_time_unix_nano, "{mode}: {} starts before", c.name);
                if late_prefill && (c.name == "prefill" || c.name == "POST prefill") {
                    // Answered after the request's answer ended: the span ends after its parent.
                    assert!(c.end_time_unix_nano > s.end_time_unix_nano, "{mode}: {} ends inside", c.name);
                    let took = c.end_time_unix_nano - c.start_time_unix_nano;
                    assert!(took >= LATE_PREFILL.as_nanos() as u64, "{mode}: {} took {took} ns", c.name);
                    continue;
                }
                assert!(c.end_time_unix_nano <= s.end_time_unix_nano, "{mode}: {} ends after", c.name);
                if c.kind == SpanKind::Internal as i32 && c.name != "route" {
                    assert_eq!(attr_str(c, "baton.mode").as_deref(), Some(mode), "{mode}: {}", c.name);
                    assert_eq!(attr_str(c, "baton.decoder"), Some(decoder.clone()), "{mode}: {}", c.name);
                }
            }
        }

        // Every engine call of the two requests: a client span, its leg's phase (or the request)
        // its parent, the engine's address on it.
        let legs: Vec<&Span> = spans.iter().filter(|s| s.kind == SpanKind::Client as i32).collect();
        for leg in &legs {
            let name = attr_str(leg, "baton.leg").unwrap();
            assert_eq!(leg.name, format!("POST {name}"));
            let parent = by_id.get(&hex(&leg.parent_span_id)).unwrap_or_else(|| panic!("{mode}: {leg:#?}"));
            assert!(
                parent.name == name || parent.kind == SpanKind::Server as i32,
                "{mode}: the {name} call's parent is {}",
                parent.name
            );
            assert_eq!(attr_str(leg, "server.address").as_deref(), Some("127.0.0.1"));
            let port = attr_int(leg, "server.port").unwrap().to_string();
            assert!(engines_at.contains(&port), "{mode}: {port} is no engine's");
            assert!(attr_int(leg, "http.response.status_code").is_some(), "{mode}: {leg:#?}");
        }
        for trace in [&completion.trace_id, &streamed.trace_id] {
            let names: BTreeSet<String> = legs
                .iter()
                .filter(|l| &l.trace_id == trace)
                .filter_map(|l| attr_str(l, "baton.leg"))
                .collect();
            assert!(names.contains("prefill") && names.contains("decode"), "{mode}: legs {names:?}");
        }
        // Each engine got a traceparent naming the client span of its call.
        assert!(received.len() >= 4, "{mode}: {received:?}");
        for (trace_id, parent_id, flags) in &received {
            let leg = by_id.get(parent_id).unwrap_or_else(|| panic!("{mode}: {parent_id} is no span"));
            assert_eq!(leg.kind, SpanKind::Client as i32, "{mode}: the engine's parent is {}", leg.name);
            assert_eq!(&hex(&leg.trace_id), trace_id);
            assert_eq!(flags, "01");
        }
    }
}

/// How long after the decoder's answer the simulated SGLang prefill answers in
/// `spans_follow_each_request_through_every_mode_into_the_engines` (its decode of 3 or 4 tokens
/// takes a few milliseconds).
const LATE_PREFILL: Duration = Duration::from_millis(300);

/// Prefill phases recorded in `baton_phase_seconds` (the demo's admin `/metrics`).
async fn prefills_timed(admin: SocketAddr) -> u64 {
    let (_, m) = super::client::http(admin, "/metrics", None).await;
    String::from_utf8_lossy(&m)
        .lines()
        .find(|l| l.starts_with("baton_phase_seconds_count") && l.contains("phase=\"prefill\""))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// Sampled out (ratio 0, no client decision): nothing is exported, and the engines are told so
/// (`traceparent` flags 00); tracing off: no `traceparent` is sent at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsampled_requests_export_nothing_and_off_sends_nothing() {
    let (collector, got, receiver) = otlp_receiver().await;
    for trace in [
        Some(TraceConfig {
            endpoint: format!("http://{collector}"),
            sampling_ratio: 0.0,
            service_name: "b".into(),
        }),
        None,
    ] {
        let on = trace.is_some();
        let d = start(DemoConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            handoff: Mode::VllmNixl,
            gateway: GatewaySetup { trace, ..GatewaySetup::default() },
            ..DemoConfig::default()
        })
        .await
        .unwrap();
        for _ in 0..3 {
            let (status, _) =
                send(d.addr, "/v1/completions", &[], &json!({"prompt": "hi", "max_tokens": 2})).await;
            assert_eq!(status, 200);
        }
        let received = engine_traceparents(&d);
        d.drain(Duration::from_secs(5)).await;
        if on {
            assert_eq!(received.len(), 6, "{received:?}");
            assert!(received.iter().all(|(_, _, flags)| flags == "00"), "{received:?}");
        } else {
            assert!(received.is_empty(), "{received:?}");
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(got.spans().is_empty());
    receiver.abort();
}

/// The operator's two ways in: `baton serve` with `[telemetry] otlp_endpoint` in its file, and the
/// `baton` binary's `demo --otlp-endpoint --service-name`, stopped by SIGTERM: the spans held at the
/// end are sent before the process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_and_the_binary_send_their_spans_before_they_stop() {
    let (collector, got, receiver) = otlp_receiver().await;
    let (prefill, decode) = super::drain::engines(Duration::ZERO).await;
    let extra = format!(
        "[telemetry]\notlp_endpoint = \"http://{collector}/v1/traces\"\nservice_name = \"from-file\"\n"
    );
    let dir = std::env::temp_dir().join(format!("baton-traces-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("baton.toml");
    std::fs::write(&file, super::serve_toml(&prefill, &decode, "", &extra)).unwrap();
    let serving = baton_gateway::serve::start(baton_gateway::config::load(&file).unwrap()).await.unwrap();
    let (status, _) =
        send(serving.addrs[0], "/v1/completions", &[], &json!({"prompt": prompt(20, 1), "max_tokens": 2}))
            .await;
    assert_eq!(status, 200);
    serving.drain().await;

    let (mut proc, addr, _) = super::drain::spawn(&[
        "demo",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--otlp-endpoint",
        &format!("http://{collector}"),
        "--service-name",
        "from-flags",
    ]);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, _) = send(addr, "/v1/chat/completions", &[], &chat).await;
    assert_eq!(status, 200);
    proc.term();
    assert_eq!(proc.exit_code(Duration::from_secs(20)).await, 0);

    let servers: Vec<(String, String)> = got
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| s.kind == SpanKind::Server as i32)
        .map(|(service, s)| (service.clone(), s.name.clone()))
        .collect();
    assert_eq!(
        servers,
        [
            ("from-file".to_owned(), "text_completion baton-sim".to_owned()),
            ("from-flags".to_owned(), "chat baton-sim".to_owned())
        ],
        "the serve request's span, then the demo's"
    );
    receiver.abort();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client that leaves before the response's headers (its non-streamed answer takes 2 s of
/// tokens): the request's span still ends, as cancelled, without a status code, since no response
/// went out; the next request's span is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_left_before_its_answer_ends_its_span_as_cancelled() {
    let (collector, got, receiver) = otlp_receiver().await;
    let trace = TraceConfig {
        endpoint: format!("http://{collector}"),
        sampling_ratio: 1.0,
        service_name: "baton-test".into(),
    };
    let d = start(DemoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token_delay: Duration::from_millis(100),
        gateway: GatewaySetup { trace: Some(trace), ..GatewaySetup::default() },
        ..DemoConfig::default()
    })
    .await
    .unwrap();
    let slow = json!({"prompt": prompt(40, 5), "max_tokens": 20});
    let left =
        tokio::time::timeout(Duration::from_millis(300), send(d.addr, "/v1/completions", &[], &slow)).await;
    assert!(left.is_err(), "the answer came before the client left");
    let (status, _) = send(d.addr, "/v1/completions", &[], &json!({"prompt": "hi", "max_tokens": 1})).await;
    assert_eq!(status, 200);
    d.drain(Duration::from_secs(10)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let servers = loop {
        let servers: Vec<Span> =
            got.spans().into_iter().filter(|s| s.kind == SpanKind::Server as i32).collect();
        if servers.len() >= 2 || Instant::now() > deadline {
            break servers;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(servers.len(), 2, "{servers:?}");
    let by_tokens =
        |n: i64| servers.iter().find(|s| attr_int(s, "gen_ai.request.max_tokens") == Some(n)).unwrap();
    let gone = by_tokens(20);
    assert_eq!(attr_str(gone, "error.type").as_deref(), Some("cancelled"), "{gone:?}");
    assert_eq!(attr_int(gone, "http.response.status_code"), None, "no response was sent");
    assert_eq!(gone.status.as_ref().map(|s| s.code), Some(2), "error status");
    let ok = by_tokens(1);
    assert_eq!(attr_int(ok, "http.response.status_code"), Some(200));
    assert_eq!(attr_str(ok, "error.type"), None);
    receiver.abort();
}
