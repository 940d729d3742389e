//! The `vllm-nixl` handoff: vLLM's NIXL connector, the decoder pulling the KV from the prefiller.
//! The wire follows vLLM's own toy proxy (`tests/v1/kv_connector/nixl_integration/
//! toy_proxy_server.py`) and connector (`vllm/distributed/kv_transfer/kv_connector/v1/
//! nixl_connector.py`, vLLM 0.10-0.11; checked against vLLM 0.32 itself by `tests/vllm.rs`):
//!
//! 1. admit: one slot of the decoder's `max_in_flight`, closed while the decoder's own metrics say
//!    its KV cache is nearly full or requests wait (`vllm:kv_cache_usage_perc`, falling back to
//!    `vllm:gpu_cache_usage_perc`, and `vllm:num_requests_waiting`, scraped from `/metrics`);
//! 2. prefill on the client's endpoint with `max_tokens = 1`, no streaming and `kv_transfer_params =
//!    {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`;
//! 3. decode on the client's endpoint with the `kv_transfer_params` the prefiller returned, streamed
//!    straight back; the slot is held until the decoder's answer ends.
//!
//! The producer keeps the prompt's blocks until a decoder reads them or its hold runs out (vLLM
//! 0.10-0.11: `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s; 0.32: a lease, `kv_lease_duration` in the
//! connector's extra config, 30 s). So when a request ends after its prefill but before the
//! decoder took it (client gone, gateway deadline, a refusal of the decode by something in front of
//! the decoder), the gateway sends the decode anyway
//! with `max_tokens = 1` and drops the answer: the decoder pulls the blocks and the producer frees
//! them at once. The prefill call itself runs to its end even if the client leaves, so its answer
//! (and the blocks it names) is never lost.

use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use hyper::Response;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::decoder::{BoxFuture, Handoff, Leg, Unstarted};
use super::legs::{
    Drains, Encoded, Held, Json, LegError, Patched, RespBody, Retrying, encode, engine_has_it,
};
use super::scrape::{Gauges, LoadKeys, LoadTarget, Scraped};
use super::shared::{Prefiller, Shared};
use super::{CheckContext, ModeSpec, Pool, PoolKeys};
use super::{KeyError, StartContext, StartError};
use crate::admission::SlotGuard;
use crate::api::{GatewayError, Internal, Object, Problem};
use crate::endpoints::EngineUrl;
use crate::telemetry::{Phase, Scrape};

/// vLLM's gauges: KV cache usage (`kv_cache_usage_perc` since 0.10, `gpu_cache_usage_perc`
/// before) and requests waiting in its scheduler.
pub const VLLM_GAUGES: Gauges = Gauges {
    usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    waiting: "vllm:num_requests_waiting",
};

/// `handoff = "vllm-nixl"`.
#[derive(Debug, serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Keys {
    /// Admission from the decoder's metrics.
    #[serde(default)]
    pub nixl: LoadKeys,
}

/// A `vllm-nixl` decoder.
#[derive(Debug)]
pub struct Nixl {
    shared: Arc<Shared>,
    /// Its address, its admission settings and what its metrics said last.
    pub scraped: Scraped,
    /// Drains sent for requests that ended between their prefill and their decode.
    pub drains: Arc<Drains>,
}

impl PoolKeys for Keys {
    type Checked = LoadTarget;

    fn check(&self, cx: &CheckContext<'_>) -> Result<LoadTarget, KeyError> {
        // The decoder's own scheduler owns its KV: the model's geometry is checked, not used.
        cx.geometry(1)?;
        self.nixl.check(cx, "nixl")
    }
}

impl ModeSpec for Nixl {
    const NAME: &'static str = "vllm-nixl";
    type Keys = Keys;

    fn describe(t: &LoadTarget) -> String {
        t.describe()
    }

    async fn start(
        target: LoadTarget,
        pool: Pool<'_>,
        ctx: &StartContext,
    ) -> Result<Box<dyn Handoff>, StartError> {
        let shared = Arc::clone(&ctx.shared);
        let scraped = Scraped::start(Arc::clone(&shared), pool.http.clone(), target, VLLM_GAUGES, pool.queue);
        Ok(Box::new(Nixl { shared, scraped, drains: Arc::default() }))
    }

    #[cfg(feature = "demo")]
    fn sim(s: super::SimSetup<'_>) {
        s.engine.nixl = Some(s.nixl_abort_timeout);
    }

    #[cfg(feature = "demo")]
    fn demo(d: &super::DemoDecoder<'_>) -> LoadTarget {
        d.load.clone()
    }
}

/// Sends the decode with `params` and one token, drops the answer: the decoder pulls the blocks
/// and the producer frees them.
async fn drain(shared: Arc<Shared>, to: Arc<Owing>, params: Json) {
    // The prefill's own fields: a body the engines took once already, so a field of the client's
    // that the prefill left out cannot get the drain refused.
    let body = Patched::new(&to.request, PREFILL_OMIT)
        .text("kv_transfer_params", &params)
        .flag("stream", false)
        .count("max_tokens", 1)
        .replace("max_completion_tokens", &1);
    // The request's slot, if it never reached the decoder: the drain is a request the decoder
    // runs, and holds it while it does.
    let mut slot = to.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(s) = slot.as_mut()
        && to.calling.load(std::sync::atomic::Ordering::Relaxed)
    {
        // The decode call was cut off (its client left) or turned away by something in front of
        // the decoder: the decoder may still run it until it notices, in this same slot.
        s.wait_out(shared.limits.cancel_grace).await;
    }
    shared.drain(&to.decoder, to.path, &body, &to.counters, &mut slot).await;
    drop(slot);
}

/// Where a drain goes and what it is made of.
struct Owing {
    decoder: EngineUrl,
    path: &'static str,
    /// The client's request, shared: a drain body is built from it only when one is sent.
    request: Arc<Object>,
    counters: Arc<Drains>,
    /// The request's slot of the decoder until its decode is sent: a drain sent instead holds it
    /// (and a request abandoned while its prefill runs keeps it until the prefill ends).
    slot: std::sync::Mutex<Option<SlotGuard>>,
    /// The decode call was made and may have reached the decoder, which may still run it.
    calling: std::sync::atomic::AtomicBool,
}

/// A drain owed to the producer until the decoder has taken the request; paid in `Drop`.
struct Owed {
    shared: Arc<Shared>,
    to: Arc<Owing>,
    params: Option<Json>,
}

impl Drop for Owed {
    fn drop(&mut self) {
        let Some(params) = self.params.take() else { return };
        self.shared.spawn_from_drop(drain(Arc::clone(&self.shared), Arc::clone(&self.to), params));
    }
}

/// The wait for the prefill leg's answer. Dropped before it was read, it closes the channel (so a
/// later answer is drained by the leg, run on alone) and drains an answer already sent. (The leg
/// runs in the request's task and the wait reads its answer as soon as it is sent, so the second
/// is a safeguard: nothing between them can drop the request today.)
struct PrefillWait<'a> {
    rx: Option<oneshot::Receiver<PrefillResult>>,
    owed: &'a mut Owed,
}

impl PrefillWait<'_> {
    async fn recv(mut self) -> PrefillResult {
        let Some(rx) = self.rx.as_mut() else {
            return Err(GatewayError::Internal(Internal::TaskLost { task: "prefill" }));
        };
        let r = rx.await.map_err(|_| GatewayError::Internal(Internal::TaskLost { task: "prefill" }));
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

/// The prefill's outcome, delivered to the waiting request (or drained if it has left): the
/// producer's `kv_transfer_params` as it wrote them (passed on to the decoder as written).
type PrefillResult = Result<Json, GatewayError>;

impl Nixl {
    async fn exchange(&self, leg: Leg<'_>) -> Result<Response<RespBody>, GatewayError> {
        let Leg { dec, prefills, req, mut slots, timing, work, retry, retried, .. } = leg;
        let grace = self.shared.limits.cancel_grace;
        let alone = work.is_none();
        let path = req.endpoint.path();
        if alone {
            // The decoder holds nearly all of the prompt: the client's request as it came, with no
            // `kv_transfer_params`, is a plain request it computes (and answers) by itself. No KV
            // moves: a decoder never reached, refusing (503) or cut off before answering may be
            // replaced.
            timing.enter(Phase::Decode);
            let body = Patched::new(&req.raw, &[]);
            engine_has_it(&mut slots, Some(grace));
            let resp = self.shared.call("decode", &**dec, path, &body).await.inspect_err(|e| {
                if e.retryable(true) {
                    let _ = retry.set(Unstarted::Decode);
                }
            });
            if resp.as_ref().is_err_and(|e| !e.may_run_on()) {
                engine_has_it(&mut slots, None);
            }
            let resp = resp?;
            timing.mark(Phase::Decode);
            return Ok(resp.map(|inner| Held::body(inner, slots)));
        }
        if let Some(n) = req.raw.get("n").and_then(Value::as_u64).filter(|n| *n > 1) {
            // vLLM 0.32's decoder forks the choices of one request, and each pulls the same
            // remote blocks: the producer frees them after the first read, so the others read
            // blocks it may already have reused ("Potentially invalid KV blocks for unrecognized
            // request", seen against vLLM 0.32 in tests/vllm.rs). Refused until choices
            // get a prefill each.
            return Err(GatewayError::Invalid {
                param: "n".into(),
                problem: Problem::Value,
                reason: format!(
                    "{n} is not served by a vllm-nixl decoder: every choice would pull the same prefill's \
                     KV, which vLLM frees after the first; send one request per choice"
                ),
            });
        }
        timing.enter(Phase::Prefill);
        let prefill_body = encode(&prefill_body(&req.raw))?;
        // Until the decoder has the request, the producer's blocks are ours to free: an `Owed` with
        // the params drains them when dropped.
        let to = Arc::new(Owing {
            decoder: self.scraped.http.clone(),
            path,
            request: Arc::clone(&req.raw),
            counters: Arc::clone(&self.drains),
            slot: std::sync::Mutex::new(slots.take()),
            calling: std::sync::atomic::AtomicBool::new(false),
        });
        let mut owed = Owed { shared: Arc::clone(&self.shared), to: Arc::clone(&to), params: None };
        // The prefill runs to its end even if the client leaves (in a task of its own from then
        // on): its answer still arrives and the blocks it names are drained instead of waiting out
        // the producer's timeout. Dropped after the answer was sent but before it was read, the
        // wait hands it to `owed`; before it was sent, the prefill drains it.
        let (tx, rx) = oneshot::channel::<PrefillResult>();
        let order: Vec<Prefiller> = prefills.iter().map(|p| (*p).clone()).collect();
        let (shared, retried) = (Arc::clone(&self.shared), Arc::clone(retried));
        let mut prefill = self.shared.detachable(async move {
            let r = prefill_task(&shared, &order, path, &prefill_body, &retried).await;
            drop(work);
            if let Err(Ok(params)) = tx.send(r) {
                drain(shared, to, params).await;
            }
        });
        let wait = PrefillWait { rx: Some(rx), owed: &mut owed };
        (&mut prefill).await;
        let params = wait.recv().await?;
        timing.mark(Phase::Prefill);
        timing.enter(Phase::Decode);

        owed.params = Some(params.clone());
        let body = Patched::new(&req.raw, &[]).text("kv_transfer_params", &params);
        // The slot stays with what is owed while the call runs: a client that leaves mid-call
        // leaves a drain holding it, sent once the decoder had time to drop the abandoned call.
        owed.to.calling.store(true, std::sync::atomic::Ordering::Relaxed);
        let resp = self.shared.call("decode", &**dec, path, &body).await;
        // A drain sent now follows no call the decoder may still run only if the call never
        // reached it: a refusal from a proxy in front of it may come while it runs the request.
        if resp.as_ref().is_err_and(|e| !e.maybe_sent()) {
            owed.to.calling.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        slots = owed.to.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        engine_has_it(&mut slots, Some(grace));
        let resp = resp.inspect_err(|e| {
            // Never reached, or refused (503) by vLLM itself, which refuses before it pulls: the
            // request may be run again elsewhere, with a prefill of its own (these blocks are
            // freed below or by the decoder). A 503 from something in front of the decoder (a
            // proxy's "reset before headers") may come after the decoder began to pull, as may a
            // connection cut mid-call: never.
            let replaceable = match e {
                LegError::Refused { status: 503, body, .. } => vllm_refused(body),
                e => e.retryable(false),
            };
            if replaceable {
                let _ = retry.set(Unstarted::Decode);
            }
        });
        if resp.as_ref().is_err_and(|e| !e.may_run_on()) {
            engine_has_it(&mut slots, None);
        }
        let resp = resp.inspect_err(|e| match e {
            // It may have reached the decoder, which then pulls (or times out) itself.
            LegError::Unanswered { .. } if e.maybe_sent() => owed.params = None,
            // vLLM's own refusal: since 0.32 its decoder tells the producer to free the blocks
            // itself (`notify_kv_transfer_request_rejected`), and a drain would pull blocks the
            // producer may already have given to another request.
            LegError::Refused { body, .. } if vllm_refused(body) => owed.params = None,
            // Otherwise nothing reached the decoder, or something in front of it turned the
            // request away (a proxy, a load balancer): nobody told the producer, and `owed` drains
            // the blocks when this returns instead of leaving them to the producer's lease.
            _ => {}
        });
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                if owed.params.is_some() {
                    // The drain `owed` sends as this returns is a request on the decoder: it
                    // holds this slot.
                    *owed.to.slot.lock().unwrap_or_else(|e| e.into_inner()) = slots.take();
                }
                return Err(e.into());
            }
        };
        owed.params = None;
        timing.mark(Phase::Decode);
        Ok(resp.map(|inner| Held::body(inner, slots)))
    }
}

impl Handoff for Nixl {
    /// A vLLM decoder (`kv_role = "kv_both"`, as NIXL's PD setups start it) serves a plain request
    /// as any vLLM server does, from its own prefix cache.
    fn serves_alone(&self) -> bool {
        true
    }

    fn run<'a>(&'a self, leg: Leg<'a>) -> BoxFuture<'a, Result<Response<RespBody>, GatewayError>> {
        Box::pin(self.exchange(leg))
    }

    fn view(&self) -> BoxFuture<'_, Value> {
        Box::pin(async move { json!({"max_in_flight": self.scraped.target.max_in_flight}) })
    }

    fn metrics(&self, decoder: &str, out: &mut Scrape) {
        self.scraped.metrics(decoder, Self::NAME, out);
        self.drains.metrics(decoder, Self::NAME, out);
    }
}

/// Whether an error answer is vLLM's own (its `ErrorResponse`: `{"error": {.., "code": STATUS}}`
/// with the status as a number), as opposed to one from something in front of the decoder.
fn vllm_refused(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct ErrorResponse {
        error: ErrorInfo,
    }
    #[derive(serde::Deserialize)]
    struct ErrorInfo {
        code: Option<Value>,
    }
    serde_json::from_slice::<ErrorResponse>(body).is_ok_and(|a| a.error.code.is_some_and(|c| c.is_u64()))
}

/// Fields of the client's request a one-token prefill leaves out: not supported by a producer
/// (vLLM's proxy drops them for the prefill too), or meaningless with one token, unstreamed.
const PREFILL_OMIT: &[&str] = &["stream_options", "min_tokens", "min_completion_tokens"];

/// The prefill leg's body: the client's request with one token, not streamed, asking the producer to
/// keep the KV for a remote decode (as vLLM's toy proxy sends it).
fn prefill_body(raw: &Object) -> Patched<'_> {
    /// The same for every prefill: written once.
    static REMOTE_DECODE: std::sync::LazyLock<Box<RawValue>> = std::sync::LazyLock::new(|| {
        serde_json::value::to_raw_value(&json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}))
        .unwrap_or_default()
    });
    Patched::new(raw, PREFILL_OMIT)
        .raw("kv_transfer_params", &REMOTE_DECODE)
        .flag("stream", false)
        .count("max_tokens", 1)
        .replace("max_completion_tokens", &1)
}

/// Whether a producer's `kv_transfer_params` are for a remote decode: an object (serde would read
/// a struct from an array too) whose `do_remote_prefill` is `true`. The other fields are the
/// decoder's, passed on as written.
fn for_remote_decode(params: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct Remote {
        do_remote_prefill: Option<bool>,
    }
    const FIRST: &str = r#"{"do_remote_prefill":true,"#;
    let text = params.trim_start();
    // vLLM's producer writes this field first, compactly: its answer is read there, with no parse
    // of the dozen fields after it (that parse was 3% of the gateway's instructions for a request
    // in the proxy benchmark), unless the key comes again (a parse refuses that).
    static AGAIN: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new("\"do_remote_prefill\""));
    text.strip_prefix(FIRST).is_some_and(|rest| AGAIN.find(rest.as_bytes()).is_none())
        || text.starts_with('{')
            && serde_json::from_str::<Remote>(text).is_ok_and(|r| r.do_remote_prefill == Some(true))
}

/// Posts the prefill (the next prefiller only while one cannot be connected to) and returns the
/// `kv_transfer_params` it answered with.
async fn prefill_task(
    shared: &Shared,
    order: &[Prefiller],
    path: &'static str,
    body: &Encoded,
    retried: &AtomicU32,
) -> PrefillResult {
    /// The one field of the prefill's answer the decode needs, kept as written; the rest is
    /// skipped unread (checked as JSON by the scan, or by serde_json where the scan is not sure).
    #[derive(serde::Deserialize)]
    struct PrefillAnswer {
        kv_transfer_params: Option<Box<RawValue>>,
    }
    let mut sent = false;
    let retry = Retrying { answered: true, retried };
    let (p, resp, in_flight) = shared.prefill(order, path, body, &mut sent, false, retry).await?;
    let b = shared.answer("prefill", p, resp, in_flight.since()).await;
    drop(in_flight);
    let b = b?;
    let params = match crate::api::scan::top_field(&b, "kv_transfer_params") {
        Ok(found) => found.map(Json::checked),
        Err(crate::api::scan::Unsure) => {
            let a: PrefillAnswer = serde_json::from_slice(&b).map_err(|e| GatewayError::Upstream {
                leg: "prefill",
                message: format!("answer is not a completion object: {e}"),
            })?;
            a.kv_transfer_params.map(|p| Json::checked(p.get()))
        }
    };
    params.filter(|p| for_remote_decode(p.get())).ok_or_else(|| GatewayError::Upstream {
        leg: "prefill",
        message:
            "the answer has no kv_transfer_params for a remote decode: is the prefiller a NIXL kv_producer?"
                .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only an object saying `do_remote_prefill: true` is for a remote decode; its other fields
    /// are not read (the decoder gets them as the producer wrote them).
    #[test]
    fn only_params_for_a_remote_decode_pass() {
        let vllm = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],
                       "remote_engine_id":"e","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}"#;
        assert!(for_remote_decode(vllm));
        assert!(for_remote_decode(r#" {"do_remote_prefill": true}"#));
        assert!(for_remote_decode(r#"{ "tp_size": 1, "do_remote_prefill": true }"#));

        for no in [
            r#"{"do_remote_prefill":false}"#,
            r#"{"do_remote_prefill":false,"do_remote_decode":true}"#,
            // A second copy of the key is refused, read first or not.
            r#"{"do_remote_prefill":true,"do_remote_prefill":false}"#,
            r#"{"do_remote_prefill":true,"x":{"do_remote_prefill":true},"do_remote_prefill":true}"#,
            r#"{"do_remote_prefill":"true"}"#,
            r#"{"do_remote_prefill":null}"#,
            r#"{"do_remote_decode":true}"#,
            r#"{}"#,
            r#"[true]"#,
            r#"true"#,
            r#""do_remote_prefill""#,
        ] {
            assert!(!for_remote_decode(no), "{no}");
        }
    }
}
