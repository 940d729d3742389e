//! The `vllm-nixl` handoff: vLLM's NIXL connector, the decoder pulling the KV from the prefiller.
//! The wire follows vLLM's own toy proxy (`tests/v1/kv_connector/nixl_integration/
//! toy_proxy_server.py`) and connector (`vllm/distributed/kv_transfer/kv_connector/v1/
//! nixl_connector.py`, vLLM 0.10-0.11):
//!
//! 1. admit: one slot of the decoder's `max_in_flight`, closed while the decoder's own metrics say
//!    its KV cache is nearly full or requests wait (`vllm:kv_cache_usage_perc`, falling back to
//!    `vllm:gpu_cache_usage_perc`, and `vllm:num_requests_waiting`, scraped from `/metrics`);
//! 2. prefill on the client's endpoint with `max_tokens = 1`, no streaming and `kv_transfer_params =
//!    {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`;
//! 3. decode on the client's endpoint with the `kv_transfer_params` the prefiller returned, streamed
//!    straight back; the slot is held until the decoder's answer ends.
//!
//! The producer keeps the prompt's blocks until a decoder reads them or
//! `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` (480 s) passes. So when a request ends after its prefill but
//! before its decode was sent (client gone, gateway deadline), the gateway sends the decode anyway
//! with `max_tokens = 1` and drops the answer: the decoder pulls the blocks and the producer frees
//! them at once. The prefill call itself runs to its end even if the client leaves, so its answer
//! (and the blocks it names) is never lost.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::{Request, Response};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::decoder::DecoderHandle;
use super::{
    BoxError, Drains, HttpClient, Native, Prefiller, RespBody, Timing, admission_error, count_failure,
    prefill_in_turn, send_drain, short_body,
};
use crate::admission::SlotGuard;
use crate::api::{GatewayError, GenRequest};
use crate::routing::HealthConfig;

/// Requests in flight on one decoder when its metrics allow more.
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 256;
/// KV cache usage (0..1) from which no new request is admitted.
pub const DEFAULT_KV_USAGE_HIGH: f64 = 0.95;
/// Requests waiting in the decoder's own scheduler from which no new request is admitted.
pub const DEFAULT_MAX_WAITING: u64 = 8;
/// How often the decoder's metrics are read.
pub const DEFAULT_SCRAPE_INTERVAL: Duration = Duration::from_millis(200);

/// A `vllm-nixl` decoder's admission settings.
#[derive(Clone, Debug, PartialEq)]
pub struct NixlTarget {
    pub max_in_flight: u32,
    pub kv_usage_high: f64,
    pub max_waiting: u64,
    pub scrape_interval: Duration,
}

impl Default for NixlTarget {
    fn default() -> Self {
        Self {
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            kv_usage_high: DEFAULT_KV_USAGE_HIGH,
            max_waiting: DEFAULT_MAX_WAITING,
            scrape_interval: DEFAULT_SCRAPE_INTERVAL,
        }
    }
}

/// What the last scrape of a decoder's metrics said.
#[derive(Debug, Default)]
pub struct NixlLoad {
    /// KV cache usage in hundredths of a percent.
    pub kv_usage_bp: AtomicU32,
    pub waiting: AtomicU64,
    pub open: AtomicBool,
    pub scrapes: AtomicU64,
    pub scrape_failures: AtomicU64,
}

/// Sums a gauge over its label sets in Prometheus text (`name{...} value` or `name value`).
pub fn gauge(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else { continue };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value {
            found = Some(found.unwrap_or(0.0) + v);
        }
    }
    found
}

/// Reads the decoder's metrics every `interval` and opens or closes its admission.
pub(crate) async fn scrape_loop(
    dec: std::sync::Weak<DecoderHandle>,
    target: NixlTarget,
    load: Arc<NixlLoad>,
) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let mut tick = tokio::time::interval(target.scrape_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(dec) = dec.upgrade() else { return };
        let Ok(req) = Request::get(format!("http://{}/metrics", dec.http)).body(Full::new(Bytes::new()))
        else {
            return;
        };
        let text = async {
            let r = tokio::time::timeout(
                target.scrape_interval.max(Duration::from_millis(500)),
                client.request(req),
            )
            .await
            .ok()?
            .ok()?;
            if r.status() != 200 {
                return None;
            }
            let b = r.into_body().collect().await.ok()?.to_bytes();
            Some(String::from_utf8_lossy(&b).into_owned())
        }
        .await;
        load.scrapes.fetch_add(1, Ordering::Relaxed);
        let Some(text) = text else {
            // Unknown state: keep the last decision; health checks deal with a dead decoder.
            load.scrape_failures.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let usage =
            gauge(&text, "vllm:kv_cache_usage_perc").or_else(|| gauge(&text, "vllm:gpu_cache_usage_perc"));
        let waiting = gauge(&text, "vllm:num_requests_waiting").unwrap_or(0.0);
        let usage = usage.unwrap_or(0.0);
        let open = usage < target.kv_usage_high && waiting < target.max_waiting as f64;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        load.kv_usage_bp.store((usage * 10_000.0).clamp(0.0, 1e9) as u32, Ordering::Relaxed);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        load.waiting.store(waiting.max(0.0) as u64, Ordering::Relaxed);
        load.open.store(open, Ordering::Relaxed);
        let l = dec.queue.load();
        let cap = if open { target.max_in_flight } else { l.capacity.min(l.in_use).max(1) };
        if cap != l.capacity {
            dec.queue.resize(cap);
        }
    }
}

/// A response body that holds the request's slot until it ends.
struct Guarded {
    inner: Incoming,
    _slot: Option<SlotGuard>,
}

impl Body for Guarded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx).map(|o| o.map(|r| r.map_err(|e| Box::new(e) as BoxError)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Sends the decode with `params` and one token, drops the answer: the decoder pulls the blocks
/// and the producer frees them.
async fn drain(
    client: HttpClient,
    decoder: SocketAddr,
    path: &'static str,
    request: Arc<Value>,
    params: Value,
    timeout: Duration,
    counters: Arc<Drains>,
) {
    let mut body = (*request).clone();
    if let Some(o) = body.as_object_mut() {
        o.insert("kv_transfer_params".into(), params);
        o.insert("stream".into(), json!(false));
        o.remove("stream_options");
        o.insert("max_tokens".into(), json!(1));
        if o.contains_key("max_completion_tokens") {
            o.insert("max_completion_tokens".into(), json!(1));
        }
    }
    send_drain(&client, decoder, path, &body, timeout, &counters).await;
}

/// A drain owed to the producer until the decoder has taken the request; paid in `Drop`.
struct Owed {
    client: HttpClient,
    decoder: SocketAddr,
    path: &'static str,
    /// The client's request, shared: a drain body is built from it only when one is sent.
    request: Arc<Value>,
    params: Option<Value>,
    timeout: Duration,
    counters: Arc<Drains>,
}

impl Drop for Owed {
    fn drop(&mut self) {
        let Some(params) = self.params.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(drain(
            self.client.clone(),
            self.decoder,
            self.path,
            Arc::clone(&self.request),
            params,
            self.timeout,
            Arc::clone(&self.counters),
        ));
    }
}

/// The wait for the prefill task's answer. Dropped before it was read, it closes the channel (so a
/// later answer is drained by the task) and drains an answer already sent.
struct PrefillWait<'a> {
    rx: Option<oneshot::Receiver<PrefillResult>>,
    owed: &'a mut Owed,
}

impl PrefillWait<'_> {
    async fn recv(mut self) -> PrefillResult {
        let Some(rx) = self.rx.as_mut() else {
            return Err(GatewayError::Internal("prefill answer read twice".into()));
        };
        let r = rx.await.map_err(|_| GatewayError::Internal("prefill task ended without an answer".into()));
        self.rx = None;
        r?
    }
}

impl Drop for PrefillWait<'_> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        rx.close();
        if let Ok(Ok(params)) = rx.try_recv() {
            // Dropping the `Owed` with these params (at the end of the request) drains them.
            self.owed.params = Some(params);
        }
    }
}

/// The prefill's outcome, delivered to the waiting request (or drained if it has left).
type PrefillResult = Result<Value, GatewayError>;

impl Native {
    /// Runs one request through the `vllm-nixl` handoff.
    pub async fn run_nixl(
        &self,
        prefills: &[&Prefiller],
        dec: &Arc<DecoderHandle>,
        req: &GenRequest,
        ticket: crate::admission::Ticket,
    ) -> Result<Response<RespBody>, GatewayError> {
        let mut timing = Timing::start();
        let slot = dec
            .queue
            .acquire(1, ticket.class, ticket.wait(self.limits.queue_timeout))
            .await
            .map_err(admission_error)?;
        timing.mark("queue");
        let path = req.endpoint.path();
        let request = Arc::new(Value::Object(req.raw.clone()));
        let mut prefill_body = (*request).clone();
        if let Some(o) = prefill_body.as_object_mut() {
            o.insert(
                "kv_transfer_params".into(),
                json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                       "remote_block_ids": null, "remote_host": null, "remote_port": null}),
            );
            o.insert("stream".into(), json!(false));
            o.insert("max_tokens".into(), json!(1));
            if o.contains_key("max_completion_tokens") {
                o.insert("max_completion_tokens".into(), json!(1));
            }
            o.remove("stream_options");
            // Not supported by a producer (vLLM's proxy drops them for the prefill too).
            o.remove("min_tokens");
            o.remove("min_completion_tokens");
        }
        let timeout = self.limits.upstream_timeout;
        // Until the decoder has the request, the producer's blocks are ours to free: an `Owed` with
        // the params drains them when dropped.
        let mut owed = Owed {
            client: self.client.clone(),
            decoder: dec.http,
            path,
            request: Arc::clone(&request),
            params: None,
            timeout,
            counters: Arc::clone(&self.nixl_drains),
        };
        // The prefill runs in its own task: if the client leaves, its answer still arrives and the
        // blocks it names are drained instead of waiting out the producer's timeout. Dropped after
        // the answer was sent but before it was read, the wait hands it to `owed`; before it was
        // sent, the task drains it.
        let (tx, rx) = oneshot::channel::<PrefillResult>();
        let order: Vec<Prefiller> = prefills.iter().map(|p| (*p).clone()).collect();
        let (client, health) = (self.client.clone(), self.health);
        let (decoder, counters, task_request) =
            (dec.http, Arc::clone(&self.nixl_drains), Arc::clone(&request));
        tokio::spawn(async move {
            let r = prefill_task(&client, &order, path, &prefill_body, timeout, &health).await;
            if let Err(Ok(params)) = tx.send(r) {
                drain(client, decoder, path, task_request, params, timeout, counters).await;
            }
        });
        let params = PrefillWait { rx: Some(rx), owed: &mut owed }.recv().await?;
        timing.mark("prefill");

        let mut body = (*request).clone();
        if let Some(o) = body.as_object_mut() {
            o.insert("kv_transfer_params".into(), params.clone());
        }
        owed.params = Some(params);
        let resp = match self.post(dec.http, path, &body, false).await {
            Ok(r) => r,
            Err(e) => {
                self.failed(&dec.name, &dec.health);
                if !e.unsent {
                    // It may have reached the decoder, which then pulls (or times out) itself.
                    owed.params = None;
                }
                return Err(GatewayError::Upstream { leg: "decode", message: e.message });
            }
        };
        owed.params = None;
        if resp.status() != 200 {
            return Err(self.refused("decode", &dec.name, &dec.health, resp).await);
        }
        dec.health.success();
        timing.mark("decode");
        self.record(&timing);
        let (mut parts, inner) = resp.into_parts();
        if let Ok(v) = hyper::header::HeaderValue::from_str(&timing.header()) {
            parts.headers.insert("server-timing", v);
        }
        Ok(Response::from_parts(parts, Guarded { inner, _slot: Some(slot) }.boxed()))
    }
}

/// Posts the prefill (the next prefiller only while one cannot be connected to) and returns the
/// `kv_transfer_params` it answered with.
async fn prefill_task(
    client: &HttpClient,
    order: &[Prefiller],
    path: &str,
    body: &Value,
    timeout: Duration,
    health: &HealthConfig,
) -> PrefillResult {
    let mut sent = false;
    let (p, resp, in_flight) =
        prefill_in_turn(client, timeout, health, order, path, body, &mut sent, false).await?;
    let status = resp.status().as_u16();
    let b = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    drop(in_flight);
    if status != 200 {
        if status >= 500 {
            count_failure(health, &p.name, &p.health);
        }
        return Err(GatewayError::Upstream {
            leg: "prefill",
            message: format!("{status}: {}", short_body(&b)),
        });
    }
    p.health.success();
    let v: Value = serde_json::from_slice(&b).map_err(|e| GatewayError::Upstream {
        leg: "prefill",
        message: format!("answer is not JSON: {e}"),
    })?;
    v.get("kv_transfer_params").filter(|p| p.get("do_remote_prefill") == Some(&json!(true))).cloned().ok_or_else(
        || GatewayError::Upstream {
            leg: "prefill",
            message: "the answer has no kv_transfer_params for a remote decode: is the prefiller a NIXL kv_producer?"
                .into(),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_sum_over_label_sets_and_ignore_longer_names() {
        let text = "# TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2\n\
                    vllm:num_requests_waiting_total 99\n\
                    vllm:kv_cache_usage_perc 0.5\n";
        assert_eq!(gauge(text, "vllm:num_requests_waiting"), Some(5.0));
        assert_eq!(gauge(text, "vllm:kv_cache_usage_perc"), Some(0.5));
        assert_eq!(gauge(text, "vllm:gpu_cache_usage_perc"), None);
    }
}
