//! The simulated engine's HTTP surface: `/v1/completions`, `/v1/chat/completions` (streaming and
//! not), `/v1/models`, `/health`, and for tests `/sim/stats`, `/sim/faults` and `/sim/received`
//! (the last generation requests as they arrived).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;

use super::SimError;
use super::api::{Endpoint, GenRequest, StreamToken, error_body, full_response, stream_chunk, usage_chunk};
use super::decode::DecodeEngine;
use super::faults::{FaultConfig, Faults};
use super::kv::{choice_tokens, output_tokens};
use super::prefill::PrefillEngine;

/// Largest request body the engine reads.
pub const MAX_BODY_BYTES: usize = 16 << 20;

type Resp = Response<BoxBody<Bytes, std::io::Error>>;

/// How long a stream cut by `cut_stream_after` lets its last tokens reach the client first.
const CUT_AFTER_FLUSH: Duration = Duration::from_millis(50);

/// A whole body.
fn full(b: impl Into<Bytes>) -> BoxBody<Bytes, std::io::Error> {
    Full::new(b.into()).map_err(|e| match e {}).boxed()
}

/// A streaming body fed by a channel; the sender is the generation task. When the task set `cut`
/// (the `cut_stream_after` fault switch), the body fails where the channel ends: hyper then drops
/// the connection without ending the message, as an engine that crashes mid-stream does.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
    cut: Arc<std::sync::atomic::AtomicBool>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let polled = self.rx.poll_recv(cx);
        // Read once the channel has ended: the task sets it before it lets go of the channel.
        polled.map(|o| match o {
            Some(b) => Some(Ok(Frame::data(b))),
            None if self.cut.load(Ordering::SeqCst) => {
                Some(Err(std::io::Error::other("stream cut by the cut_stream_after fault switch")))
            }
            None => None,
        })
    }
}

/// Which role the engine plays.
#[derive(Debug)]
pub enum Role {
    Prefill(Arc<PrefillEngine>),
    Decode(Arc<DecodeEngine>),
}

/// The LMCache PD backend side of an engine, when it plays one.
#[derive(Debug)]
pub enum LmcacheRole {
    Sender(Arc<super::lmcache::Sender>),
    Receiver(Arc<super::lmcache::Receiver>),
}

/// The vLLM NIXL connector side of an engine, when it plays one.
#[derive(Debug)]
pub enum NixlRole {
    Producer(Arc<super::nixl::Producer>),
    Consumer,
}

/// Counts a request as running while it lives.
struct Running(Arc<AtomicU64>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The PD protocols an engine also plays, beside baton's native one, and its prefix cache.
#[derive(Debug, Default)]
pub struct Protocols {
    pub lmcache: Option<LmcacheRole>,
    pub nixl: Option<NixlRole>,
    pub sglang: Option<Arc<super::sglang::Sglang>>,
    pub cache: Option<Arc<super::cache::PrefixCache>>,
}

/// A simulated engine behind HTTP.
#[derive(Debug)]
pub struct SimEngine {
    pub role: Role,
    pub lmcache: Option<LmcacheRole>,
    pub nixl: Option<NixlRole>,
    pub sglang: Option<Arc<super::sglang::Sglang>>,
    /// The engine's prefix cache, when it models one.
    pub cache: Option<Arc<super::cache::PrefixCache>>,
    /// Generation requests in progress (vLLM's `num_requests_running`).
    running: Arc<AtomicU64>,
    /// The most generation requests ever in progress at once (a capacity check for tests).
    peak_running: AtomicU64,
    pub model: String,
    pub faults: Arc<Faults>,
    /// Time per generated token.
    pub token_delay: Duration,
    next_id: AtomicU64,
    /// The last generation requests received, for tests (`GET /sim/received`).
    received: Received,
    /// Generation requests received, refused ones included (`/sim/stats` `generation_requests`).
    generation_requests: AtomicU64,
}

/// Generation requests kept by [`Received`]: enough for any one test, bounded for a long demo.
pub const RECEIVED_KEPT: usize = 256;

/// The last [`RECEIVED_KEPT`] generation requests an engine received: path, headers and the body's
/// bytes (parsed only when asked for, so the hot path copies a reference-counted buffer).
#[derive(Debug, Default)]
struct Received(std::sync::Mutex<std::collections::VecDeque<(String, hyper::HeaderMap, Bytes)>>);

impl Received {
    fn keep(&self, path: &str, headers: &hyper::HeaderMap, body: &Bytes) {
        let mut q = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if q.len() >= RECEIVED_KEPT {
            q.pop_front();
        }
        q.push_back((path.to_owned(), headers.clone(), body.clone()));
    }

    /// `[{"path", "headers": {name: value}, "body": <the JSON, or the text when it is none>}]`.
    fn view(&self) -> Value {
        let q = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        q.iter()
            .map(|(path, headers, body)| {
                let h: serde_json::Map<String, Value> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str().to_owned(), json!(String::from_utf8_lossy(v.as_bytes()))))
                    .collect();
                let body = serde_json::from_slice(body)
                    .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()));
                json!({"path": path, "headers": h, "body": body})
            })
            .collect()
    }
}

fn json_response(status: u16, v: &Value) -> Resp {
    let body = full(v.to_string());
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    r
}

/// An error as vLLM 0.32 answers one (`vllm/entrypoints/serve/exception_handling/
/// error_response.py`): `type` named after the status, `code` the status as a number, `param` null.
fn error_response(e: &SimError) -> Resp {
    if e.code == super::PLAIN {
        let mut r = Response::new(full(e.message.clone()));
        *r.status_mut() = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_GATEWAY);
        r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain"));
        return r;
    }
    let kind = match e.status {
        404 => "NotFoundError",
        422 => "UnprocessableEntityError",
        s if s < 500 => "BadRequestError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    json_response(e.status, &error_body(&e.message, kind, e.status))
}

impl SimEngine {
    pub fn new(
        role: Role,
        protocols: Protocols,
        model: String,
        faults: Arc<Faults>,
        token_delay: Duration,
    ) -> Arc<Self> {
        let Protocols { lmcache, nixl, sglang, cache } = protocols;
        Arc::new(Self {
            role,
            lmcache,
            nixl,
            sglang,
            cache,
            running: Arc::default(),
            peak_running: AtomicU64::new(0),
            model,
            faults,
            token_delay,
            next_id: AtomicU64::new(1),
            received: Received::default(),
            generation_requests: AtomicU64::new(0),
        })
    }

    /// vLLM's Prometheus gauges the gateway reads for `vllm-nixl` admission.
    fn prometheus(&self) -> Resp {
        let f = self.faults.get();
        if let Some(status) = f.metrics_status {
            return error_response(&SimError::plain(
                status,
                "metrics refused by the metrics_status fault switch",
            ));
        }
        let (held, total) = match &self.role {
            Role::Prefill(p) => (p.held_blocks(), 1),
            Role::Decode(d) => (d.held_blocks(), d.total_blocks()),
        };
        let usage =
            f.report_kv_usage_pct.map_or(f64::from(held) / f64::from(total.max(1)), |p| f64::from(p) / 100.0);
        let m = &self.model;
        if self.sglang.is_some() {
            return self.sglang_prometheus(usage, f.report_waiting.unwrap_or(0));
        }
        let text = format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{m}\"}} {}\n\
             # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{m}\"}} {}\n\
             # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {usage}\n",
            self.running.load(Ordering::Relaxed),
            f.report_waiting.unwrap_or(0),
        );
        let mut r = Response::new(full(text));
        r.headers_mut()
            .insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; version=0.0.4"));
        r
    }

    /// SGLang's gauges (`--enable-metrics`): one sample per TP rank of the (single) DP rank, as
    /// SGLang reports them.
    fn sglang_prometheus(&self, usage: f64, waiting: u64) -> Resp {
        let tp = match &self.role {
            Role::Prefill(p) => p.geometry().tp_size,
            Role::Decode(d) => d.geometry().tp_size,
        };
        let running = self.running.load(Ordering::Relaxed);
        let mut text = String::new();
        for (name, v) in [
            ("sglang:token_usage", usage.to_string()),
            ("sglang:num_queue_reqs", waiting.to_string()),
            ("sglang:num_running_reqs", running.to_string()),
        ] {
            text.push_str(&format!("# TYPE {name} gauge\n"));
            for r in 0..tp {
                text.push_str(&format!(
                    "{name}{{dp_rank=\"0\",tp_rank=\"{r}\",model_name=\"{}\"}} {v}\n",
                    self.model
                ));
            }
        }
        let mut r = Response::new(full(text));
        r.headers_mut()
            .insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; version=0.0.4"));
        r
    }

    fn sglang_stats(&self) -> Value {
        let Some(s) = &self.sglang else { return Value::Null };
        let st = &s.stats;
        json!({
            "bootstrap": s.bootstrap.map(|a| a.to_string()), "rooms_held": s.rooms_held(), "in_flight": s.in_flight(),
            "paired": st.paired.load(Ordering::Relaxed), "unpaired": st.unpaired.load(Ordering::Relaxed),
            "abandoned": st.abandoned.load(Ordering::Relaxed), "mismatched": st.mismatched.load(Ordering::Relaxed),
            "aborted": st.aborted.load(Ordering::Relaxed), "abort_requests": st.abort_requests.load(Ordering::Relaxed),
        })
    }

    /// SGLang's `GET /get_server_info`: the server's arguments, of which a PD router reads the
    /// bootstrap port.
    fn server_info(&self) -> Resp {
        let (mode, tp) = match &self.role {
            Role::Prefill(p) => ("prefill", p.geometry().tp_size),
            Role::Decode(d) => ("decode", d.geometry().tp_size),
        };
        let port = self.sglang.as_ref().and_then(|s| s.bootstrap).map(|a| a.port());
        json_response(
            200,
            &json!({"model_path": self.model, "tp_size": tp, "disaggregation_mode": mode,
                    "disaggregation_bootstrap_port": port}),
        )
    }

    /// SGLang's `POST /abort_request {"rid"}`.
    async fn abort_request(&self, req: Request<Incoming>) -> Resp {
        let body = match Limited::new(req.into_body(), 64 << 10).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error_response(&SimError::bad(e)),
        };
        let rid = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v.get("rid").and_then(Value::as_str).map(str::to_owned));
        match (&self.sglang, rid) {
            (Some(s), Some(rid)) => json_response(200, &json!({"aborted": s.abort(&rid)})),
            (None, _) => error_response(&SimError::bad("not an SGLang engine")),
            (_, None) => error_response(&SimError::bad("rid is required")),
        }
    }

    fn nixl_stats(&self) -> Value {
        match &self.nixl {
            Some(NixlRole::Producer(p)) => json!({
                "engine_id": p.engine_id, "side_channel": p.side.to_string(), "blocks_held": p.held_blocks(),
                "pending": p.pending(), "read": p.read.load(Ordering::Relaxed), "expired": p.expired.load(Ordering::Relaxed),
                "released": p.released.load(Ordering::Relaxed),
            }),
            Some(NixlRole::Consumer) => json!({"consumer": true}),
            None => Value::Null,
        }
    }

    fn lmcache_stats(&self) -> Value {
        match &self.lmcache {
            None => Value::Null,
            Some(LmcacheRole::Sender(s)) => {
                json!({"notifications_sent": s.notifications_sent.load(Ordering::Relaxed)})
            }
            Some(LmcacheRole::Receiver(r)) => {
                let ranks: Vec<Value> = r
                    .ranks
                    .iter()
                    .map(|k| {
                        json!({
                            "rank": k.rank, "alloc_addr": k.alloc_addr.to_string(), "init_addr": k.init_addr.to_string(),
                            "capacity_chunks": k.capacity, "used_chunks": k.used(),
                            "alloc_waits": k.stats.alloc_waits.load(Ordering::Relaxed),
                            "late_writes": k.stats.late_writes.load(Ordering::Relaxed),
                            "retrieved_chunks": k.stats.retrieved.load(Ordering::Relaxed),
                            "recomputed": k.stats.recomputed.load(Ordering::Relaxed),
                        })
                    })
                    .collect();
                json!({"ranks": ranks})
            }
        }
    }

    /// Serves HTTP/1.1 and HTTP/2 on `listener` until `stop` is notified.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, stop: Arc<Notify>) {
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                _ = stop.notified() => break,
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let this = Arc::clone(&self);
                    conns.spawn(async move {
                        let svc = service_fn(move |req| {
                            let this = Arc::clone(&this);
                            async move { Ok::<_, Infallible>(this.handle(req).await) }
                        });
                        let _ = auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), svc).await;
                    });
                }
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        conns.shutdown().await;
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Resp {
        let (method, path) = (req.method().clone(), req.uri().path().to_owned());
        let ep = match (&method, path.as_str()) {
            (&Method::GET, "/health") => return self.health(),
            (&Method::GET, "/v1/models") => {
                return json_response(
                    200,
                    &json!({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "baton-sim"}]}),
                );
            }
            (&Method::GET, "/sim/stats") => return json_response(200, &self.stats()),
            (&Method::GET, "/sim/received") => return json_response(200, &self.received.view()),
            (&Method::GET, "/metrics") => return self.prometheus(),
            (&Method::GET, "/get_server_info") => return self.server_info(),
            (&Method::POST, "/abort_request") => return self.abort_request(req).await,
            (&Method::POST, "/tokenize") => return self.tokenize(req).await,
            (&Method::POST, "/sim/faults") => return self.set_faults(req).await,
            (&Method::POST, "/v1/completions") => Endpoint::Completions,
            (&Method::POST, "/v1/chat/completions") => Endpoint::Chat,
            _ => {
                return error_response(&SimError {
                    status: 404,
                    code: "not_found",
                    message: format!("no route {method} {path}"),
                });
            }
        };
        let (parts, body) = req.into_parts();
        let body = match Limited::new(body, MAX_BODY_BYTES).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                return error_response(&SimError {
                    status: 413,
                    code: "body_too_large",
                    message: e.to_string(),
                });
            }
        };
        self.received.keep(&path, &parts.headers, &body);
        self.generation_requests.fetch_add(1, Ordering::SeqCst);
        match self.generate(ep, &body).await {
            Ok(r) => r,
            Err(e) => error_response(&e),
        }
    }

    fn health(&self) -> Resp {
        let crashed = self.faults.get().crash_rank.is_some() && matches!(self.role, Role::Decode(_));
        if crashed {
            json_response(503, &json!({"status": "degraded", "reason": "a rank is down"}))
        } else {
            json_response(200, &json!({"status": "ok"}))
        }
    }

    /// vLLM's `POST /tokenize`: `{"prompt": ...}` or `{"messages": [...]}` → `{"count", "max_model_len",
    /// "tokens"}` (LMCache's proxy tokenizes through it).
    async fn tokenize(&self, req: Request<Incoming>) -> Resp {
        let body = match Limited::new(req.into_body(), MAX_BODY_BYTES).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error_response(&SimError::bad(e)),
        };
        let parsed: Result<GenRequest, _> = serde_json::from_slice(&body);
        let ids = match parsed {
            Ok(r) if r.openai.messages.is_some() => r.token_ids(Endpoint::Chat),
            Ok(r) => r.token_ids(Endpoint::Completions),
            Err(e) => Err(format!("invalid request body: {e}")),
        };
        match ids {
            Ok(ids) => {
                json_response(200, &json!({"count": ids.len(), "max_model_len": 32768, "tokens": ids}))
            }
            Err(e) => error_response(&SimError::bad(e)),
        }
    }

    async fn set_faults(&self, req: Request<Incoming>) -> Resp {
        let body = match Limited::new(req.into_body(), 64 << 10).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error_response(&SimError::bad(e)),
        };
        let config: FaultConfig = match serde_json::from_slice(&body) {
            Ok(c) => c,
            Err(e) => return error_response(&SimError::bad(format!("fault config: {e}"))),
        };
        self.faults.set(config);
        if let Role::Decode(d) = &self.role {
            d.apply_faults().await;
        }
        json_response(200, &json!({"ok": true, "faults": self.faults.get()}))
    }

    /// The last generation requests received (`GET /sim/received`): path, headers, body.
    pub fn received(&self) -> Value {
        self.received.view()
    }

    /// The engine's state: for tests and operators poking at the simulator.
    pub fn stats(&self) -> Value {
        let mut v = self.role_stats();
        v["lmcache"] = self.lmcache_stats();
        v["nixl"] = self.nixl_stats();
        v["sglang"] = self.sglang_stats();
        v["prefix_cache"] = self.cache.as_ref().map_or(Value::Null, |c| c.stats());
        v["running"] = self.running.load(Ordering::SeqCst).into();
        v["peak_running"] = self.peak_running.load(Ordering::SeqCst).into();
        v["generation_requests"] = self.generation_requests.load(Ordering::SeqCst).into();
        v
    }

    fn role_stats(&self) -> Value {
        match &self.role {
            Role::Prefill(p) => json!({
                "role": "prefill", "model": self.model, "tp": p.geometry().tp_size,
                "geometry_fingerprint": p.geometry().fingerprint(), "engine_blocks_held": p.held_blocks(),
            }),
            Role::Decode(d) => {
                let ranks: Vec<Value> = d
                    .ranks
                    .iter()
                    .map(|r| {
                        let s = r.server.buffer().stats();
                        json!({
                            "rank": s.rank, "addr": r.addr.to_string(), "pages_total": s.total, "pages_free": s.pages.free,
                            "pages_reserved": s.pages.reserved, "pages_filled": s.pages.filled,
                            "pages_quarantined": s.pages.quarantined, "pages_consuming": s.pages.consuming,
                            "requests": s.requests, "accounting_errors": s.accounting_errors,
                            "handshakes_refused": r.server.refused_handshakes(),
                        })
                    })
                    .collect();
                json!({
                    "role": "decode", "model": self.model, "tp": d.geometry().tp_size,
                    "geometry_fingerprint": d.geometry().fingerprint(), "chunk_tokens": d.geometry().chunk_tokens,
                    "page_bytes": d.geometry().page_bytes_per_rank(), "engine_blocks_held": d.held_blocks(), "ranks": ranks,
                })
            }
        }
    }

    async fn generate(&self, ep: Endpoint, body: &[u8]) -> Result<Resp, SimError> {
        let req: GenRequest =
            serde_json::from_slice(body).map_err(|e| SimError::bad(format!("invalid request body: {e}")))?;
        if let Some(status) = self.faults.take_failure() {
            let message = format!("refused by the fail_status fault switch ({status})");
            let late = self.faults.get().fail_delay_ms;
            if late > 0 {
                tokio::time::sleep(Duration::from_millis(late)).await;
            }
            if self.faults.get().fail_plain {
                return Err(SimError::plain(status, message));
            }
            // vLLM 0.32 (`_with_kv_transfer_rejection_cleanup`): a consumer that refuses a
            // remote-prefill request tells the producer to free the blocks it kept for it.
            if let (Some(NixlRole::Consumer), Ok(Some(np))) = (&self.nixl, req.nixl_params())
                && np.do_remote_prefill
            {
                super::nixl::release(&np).await;
            }
            return Err(SimError::status(status, message));
        }
        let ids = req.token_ids(ep).map_err(SimError::bad)?;
        // The prefix cache: what of the prompt is cached, and the prefill's time when this engine
        // computes the prompt (a prefiller always; a decoder only when no KV comes to it).
        let cached = match &self.cache {
            Some(c) => {
                let computes = matches!(self.role, Role::Prefill(_))
                    || req.baton.as_ref().is_some_and(|b| b.local_prefill)
                    || !(req.baton.is_some()
                        || req.nixl_params()?.is_some_and(|p| p.do_remote_prefill)
                        || req.sglang_params()?.is_some()
                        || req.lmcache_params()?.is_some());
                Some(if computes { c.compute(&ids).await } else { c.admit(&ids) })
            }
            None => None,
        };
        let model = req.openai.model.clone().unwrap_or_else(|| self.model.clone());
        let id = match &req.baton {
            Some(b) => b.request_id.clone(),
            None => format!("{:032x}", self.next_id.fetch_add(1, Ordering::Relaxed)),
        };
        let mut n = req.max_tokens();
        let mut held = Vec::new();
        let mut first_tok = None;
        let now_running = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak_running.fetch_max(now_running, Ordering::SeqCst);
        let running = Running(Arc::clone(&self.running));
        let mut kv_params = None;
        match (&self.nixl, req.nixl_params()?) {
            (Some(NixlRole::Producer(p)), Some(np)) if np.do_remote_decode => {
                // Neutral: the same answer, but no blocks kept for a pull that will not come.
                kv_params = Some(p.hold(&ids)?);
                n = 1;
            }
            (Some(NixlRole::Consumer), Some(np)) if np.do_remote_prefill && !super::kv::neutral() => {
                if let Role::Decode(d) = &self.role {
                    super::nixl::pull(&d.geometry(), &ids, &np).await?;
                }
            }
            _ => {}
        }
        let tracked = self.sglang.as_ref().map(|s| s.track(req.rid()));
        if let (Some(s), Some(p), Some(t)) = (&self.sglang, req.sglang_params()?, &tracked) {
            // Neutral: no room kept for a pull that will not come.
            match &self.role {
                Role::Prefill(_) => {
                    if !super::kv::neutral() {
                        s.hold(&p, &ids, req.rid());
                    }
                    if !s.answer_delay.is_zero() {
                        tokio::time::sleep(s.answer_delay).await;
                    }
                    n = 1;
                }
                Role::Decode(_) if super::kv::neutral() => {}
                Role::Decode(_) => {
                    tokio::select! {
                        r = s.pull(&p, &ids) => r?,
                        () = t.cancel.notified() => return Err(SimError::status(499, "aborted by /abort_request")),
                    }
                }
            }
        }
        match (&self.role, &req.baton) {
            (Role::Prefill(p), Some(b)) if !b.decoders.is_empty() => {
                let key = b.key().map_err(SimError::bad)?;
                p.prefill(key, &ids, &b.decoders, b.reserve).await?;
                // Like a vLLM prefiller in a PD pair: the prompt is processed, one token comes back.
                n = 1;
            }
            // Computed above from the engine's own cache: nothing comes through the PD buffer.
            (Role::Decode(_), Some(b)) if b.local_prefill => {}
            (Role::Decode(d), Some(b)) => {
                let key = b.key().map_err(SimError::bad)?;
                let wait = b.kv_wait_ms.map(|ms| Duration::from_millis(u64::from(ms)));
                held = d.consume(key, &ids, wait).await?;
            }
            _ => {}
        }
        match (&self.lmcache, req.lmcache_params()?) {
            (Some(LmcacheRole::Sender(s)), Some(params)) if params.disagg_spec.is_some() => {
                if let Some(spec) = &params.disagg_spec {
                    s.send(spec, &ids).await?;
                }
                n = 1;
                if params.ret_first_tok {
                    first_tok = output_tokens(&ids, 1).first().map(|t| t.0);
                }
            }
            (Some(LmcacheRole::Receiver(r)), _) if req.baton.is_none() && !super::kv::neutral() => {
                r.retrieve(&ids).await?;
            }
            _ => {}
        }
        let prompt = ids.len();
        let lp = req.logprobs(ep);
        let choices: Vec<Vec<(u32, &'static str)>> =
            (0..req.choices()).map(|c| choice_tokens(&ids, n, c)).collect();
        if !req.openai.stream {
            // A zero sleep would still wait for the next timer tick (about 1 ms).
            if !self.token_delay.is_zero() {
                tokio::time::sleep(self.token_delay * n).await;
            }
            drop(held);
            let mut body = full_response(ep, &id, &model, &choices, prompt, lp);
            if let Some(c) = cached {
                body["usage"]["prompt_tokens_details"] = json!({"cached_tokens": c});
            }
            if let Some(t) = first_tok {
                body["kv_transfer_params"] = json!({"first_tok": t});
            }
            if let Some(p) = kv_params {
                body["kv_transfer_params"] = p;
            }
            let late = self.faults.get().answer_delay_ms;
            if late > 0 {
                tokio::time::sleep(Duration::from_millis(late)).await;
            }
            drop(running);
            drop(tracked);
            return Ok(json_response(200, &body));
        }
        let include_usage = req.include_usage();
        let delay = self.token_delay;
        let cut_after = self.faults.get().cut_stream_after;
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cutting = Arc::clone(&cut);
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        tokio::spawn(async move {
            // The engine's cache blocks stay held while tokens are produced; a client that leaves
            // ends the task and returns them.
            let _held = held;
            let _running = running;
            let event = |v: Value| Bytes::from(format!("data: {v}\n\n"));
            // As vLLM streams several choices: each step's token of every choice, interleaved.
            let mut offsets = vec![0usize; choices.len()];
            for i in 0..n as usize {
                if cut_after.is_some_and(|c| i >= c as usize) {
                    // What was sent goes out first (hyper drops its unwritten buffer with the
                    // connection), then the body fails.
                    tokio::time::sleep(CUT_AFTER_FLUSH).await;
                    cutting.store(true, Ordering::SeqCst);
                    return;
                }
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                // An SGLang engine's `/abort_request` ends the stream (the permit stays if it came
                // between two tokens).
                if let Some(t) = &tracked
                    && tokio::time::timeout(Duration::ZERO, t.cancel.notified()).await.is_ok()
                {
                    return;
                }
                for (c, toks) in choices.iter().enumerate() {
                    let Some(&tok) = toks.get(i) else { continue };
                    let offset = offsets.get(c).copied().unwrap_or(0);
                    let pos = u32::try_from(i).unwrap_or(u32::MAX);
                    let t = StreamToken {
                        choice: c,
                        token: Some((tok, pos)),
                        offset,
                        first: i == 0,
                        logprobs: lp,
                    };
                    if tx.send(event(stream_chunk(ep, &id, &model, t))).await.is_err() {
                        return;
                    }
                    if let Some(o) = offsets.get_mut(c) {
                        *o += tok.1.len();
                    }
                }
            }
            for c in 0..choices.len() {
                let t = StreamToken { choice: c, token: None, offset: 0, first: false, logprobs: lp };
                if tx.send(event(stream_chunk(ep, &id, &model, t))).await.is_err() {
                    return;
                }
            }
            let completion = n.saturating_mul(u32::try_from(choices.len()).unwrap_or(u32::MAX));
            let mut usage = usage_chunk(ep, &id, &model, prompt, completion);
            if let Some(c) = cached {
                usage["usage"]["prompt_tokens_details"] = json!({"cached_tokens": c});
            }
            if include_usage && tx.send(event(usage)).await.is_err() {
                return;
            }
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        let mut r = Response::new(ChannelBody { rx, cut }.boxed());
        r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/event-stream"));
        r.headers_mut().insert(header::CACHE_CONTROL, header::HeaderValue::from_static("no-cache"));
        Ok(r)
    }
}
