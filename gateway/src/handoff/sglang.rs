//! The `sglang` handoff: SGLang's PD disaggregation, the decoder pulling the KV from the prefill
//! server's bootstrap endpoint. The wire follows SGLang's own load balancers
//! (`python/sglang/srt/disaggregation/mini_lb.py` and the PD router of its model gateway,
//! `bootstrap_injector.rs`):
//!
//! 1. admit: one slot of the decoder's `max_in_flight`, closed while the decoder's own metrics say
//!    its KV cache is nearly full or requests queue (`sglang:token_usage`, `sglang:num_queue_reqs`;
//!    SGLang needs `--enable-metrics`);
//! 2. both legs at once, the client's request to each with `bootstrap_host` (the prefill server's
//!    host), `bootstrap_port` (its `--disaggregation-bootstrap-port`, from the configuration or its
//!    `GET /get_server_info`) and a random `bootstrap_room` in `[0, 2^63)`: lists of them, one per
//!    choice, when `n > 1`. The prefill leg is not streamed; the answer streams from the decoder.
//!
//! Unlike SGLang's routers, nothing waits forever and nothing is left behind (sglang PR #24159: the
//! router hung when a prefill failed; sglang#9726: the decode was not aborted after a prefill
//! failure). Each request carries an `rid`. A prefill that fails ends the request at once with the
//! prefill's error, drops the decode call (SGLang aborts a request whose client left) and sends
//! `POST /abort_request {"rid"}` to the decoder; a client that leaves before the answer has ended
//! does the same to both legs. A prefill that fails after the decoder's answer started ends the
//! stream with an error event. There is no fallback to another prefill server: the decoder was
//! told which one holds the KV.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Frame;
use hyper::{Request, Response};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::decoder::{BoxFuture, Handoff, Leg, Unstarted};
use super::legs::{
    Encoded, Held, Holds, LegError, Patched, PostError, RespBody, encode, engine_has_it, hex_name,
};
use super::scrape::{Gauges, LoadKeys, LoadTarget, Scraped};
use super::shared::{Backoff, Detachable, Prefiller, Shared};
use super::{CheckContext, ModeSpec, Pool, PoolKeys};
use super::{KeyError, StartContext, StartError};
use crate::admission::SlotGuard;
use crate::api::{GatewayError, Internal, Object};
use crate::endpoints::EngineUrl;
use crate::telemetry::{Later, Phase, Scrape};

/// SGLang's gauges (`--enable-metrics`): token pool usage and requests in its waiting queue, per DP
/// rank and reported by each TP rank.
pub const SGLANG_GAUGES: Gauges = Gauges { usage: &["sglang:token_usage"], waiting: "sglang:num_queue_reqs" };
/// Longest wait for a prefill server's `/get_server_info`.
const INFO_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for an engine to take an `/abort_request`.
const ABORT_TIMEOUT: Duration = Duration::from_secs(2);

/// `handoff = "sglang"`.
#[derive(Debug, serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Keys {
    /// The prefill servers' `--disaggregation-bootstrap-port` (mini_lb's `--prefill-bootstrap-ports`
    /// with one value). Without it each prefill server's `GET /get_server_info` is asked once.
    pub bootstrap_port: Option<u16>,
    /// Admission from the decoder's metrics (SGLang's `--enable-metrics`).
    #[serde(default)]
    pub sglang: LoadKeys,
}

/// An `sglang` pool, checked.
#[derive(Clone, Debug)]
pub struct Checked {
    pub target: LoadTarget,
    pub bootstrap_port: Option<u16>,
}

/// Counters of the aborts sent to the engines.
#[derive(Debug, Default)]
pub struct Aborts {
    pub sent: AtomicU64,
    pub failed: AtomicU64,
}

/// An `sglang` decoder.
#[derive(Debug)]
pub struct Sglang {
    shared: Arc<Shared>,
    /// Its address, its admission settings and what its metrics said last.
    pub scraped: Scraped,
    /// The prefill servers' bootstrap port, when the configuration gives it.
    pub bootstrap_port: Option<u16>,
    /// Bootstrap ports learned from the prefill servers' `/get_server_info`.
    learned: Mutex<HashMap<EngineUrl, u16>>,
    pub aborts: Arc<Aborts>,
}

impl PoolKeys for Keys {
    type Checked = Checked;

    fn check(&self, cx: &CheckContext<'_>) -> Result<Checked, KeyError> {
        cx.geometry(1)?;
        if self.bootstrap_port == Some(0) {
            return Err(cx.err("bootstrap_port", "must be a port, not 0"));
        }
        Ok(Checked { target: self.sglang.check(cx, "sglang")?, bootstrap_port: self.bootstrap_port })
    }
}

impl ModeSpec for Sglang {
    const NAME: &'static str = "sglang";
    type Keys = Keys;

    fn describe(c: &Checked) -> String {
        let port =
            c.bootstrap_port.map_or("from each prefill's /get_server_info".to_owned(), |p| p.to_string());
        format!("bootstrap port {port}, {}", c.target.describe())
    }

    async fn start(c: Checked, pool: Pool<'_>, ctx: &StartContext) -> Result<Box<dyn Handoff>, StartError> {
        let shared = Arc::clone(&ctx.shared);
        let scraped =
            Scraped::start(Arc::clone(&shared), pool.http.clone(), c.target, SGLANG_GAUGES, pool.queue);
        let sglang = Sglang {
            shared,
            scraped,
            bootstrap_port: c.bootstrap_port,
            learned: Mutex::default(),
            aborts: Arc::default(),
        };
        Ok(Box::new(sglang))
    }

    #[cfg(feature = "demo")]
    fn sim(s: super::SimSetup<'_>) {
        s.engine.sglang = Some(s.sglang.clone());
    }

    #[cfg(feature = "demo")]
    fn demo(d: &super::DemoDecoder<'_>) -> Checked {
        // The bootstrap port is read from each prefill engine's /get_server_info.
        Checked { target: d.load.clone(), bootstrap_port: None }
    }
}

impl Sglang {
    /// The prefill server's bootstrap port: configured, learned, or read from its
    /// `/get_server_info` now.
    async fn bootstrap_port(&self, p: &Prefiller) -> Result<u16, GatewayError> {
        if let Some(port) = self.bootstrap_port {
            return Ok(port);
        }
        if let Some(port) = self.learned.lock().unwrap_or_else(|e| e.into_inner()).get(&p.http) {
            return Ok(*port);
        }
        let no_port = |why: String| GatewayError::Upstream {
            leg: "prefill",
            message: format!(
                "no bootstrap port for prefill {}: {why}; set bootstrap_port on the sglang decode pool",
                p.name
            ),
        };
        let req = Request::get(p.http.uri("/get_server_info"))
            .body(Full::new(Bytes::new()))
            .map_err(|e| no_port(e.to_string()))?;
        let resp = tokio::time::timeout(INFO_TIMEOUT, self.shared.client.send(&p.http, req))
            .await
            .map_err(|_| no_port(format!("/get_server_info did not answer within {INFO_TIMEOUT:?}")))?
            .map_err(|e| no_port(format!("/get_server_info: {e}")))?;
        let status = resp.status();
        let b = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        let port = serde_json::from_slice::<Value>(&b)
            .ok()
            .filter(|_| status == 200)
            .and_then(|v| v.get("disaggregation_bootstrap_port").and_then(Value::as_u64))
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| {
                no_port(format!("/get_server_info ({status}) has no disaggregation_bootstrap_port"))
            })?;
        self.learned.lock().unwrap_or_else(|e| e.into_inner()).insert(p.http.clone(), port);
        Ok(port)
    }

    async fn exchange(&self, leg: Leg<'_>) -> Result<Response<RespBody>, GatewayError> {
        let Leg { dec, prefills, req, mut slots, timing, work, retry, .. } = leg;
        // Both legs are sent at once: the request is in its decode from here.
        timing.enter(Phase::Decode);
        let shared = &*self.shared;
        let prefill = prefills.first().ok_or(GatewayError::NoEndpoint("prefill"))?;
        // A prefiller whose bootstrap port cannot be learned got no generation request: another
        // may take it.
        let asked = Instant::now();
        let port = self.bootstrap_port(prefill).await.inspect_err(|_| {
            shared.failed(*prefill, asked);
            let _ = retry.set(Unstarted::Prefill(prefill.name.clone()));
        })?;
        let Bodies { decode: decode_body, prefill: prefill_body, rid } =
            bodies(&req.raw, &prefill.http, port, shared.keys.next().request.0)?;
        let aborter = Arc::new(Aborter {
            shared: Arc::clone(&self.shared),
            rid,
            counters: Arc::clone(&self.aborts),
            abandoned: AtomicBool::new(false),
            decode_answered: AtomicBool::new(false),
            prefill_timing: Mutex::new(None),
        });
        let abort = AbortGuard {
            aborter: Arc::clone(&aborter),
            engines: vec![prefill.http.clone(), dec.http.clone()],
            armed: true,
        };

        // Both legs run side by side in this task; a leg the request stops waiting for runs on
        // to its end in a task of its own (a decode leg is cancelled only by `abort_decode`): the
        // prefill's answer matters after the decoder's has started.
        let (tx, mut prefill_rx) = oneshot::channel();
        let path = req.endpoint.path();
        let leg = PrefillLeg {
            prefill: (*prefill).clone(),
            path,
            body: prefill_body,
            aborter: Arc::clone(&aborter),
            work,
        };
        let mut prefill_leg = shared.detachable(leg.run(tx));
        // The decode leg is detachable too, so a failed prefill can hand it to `abort_decode`.
        engine_has_it(&mut slots, Some(shared.limits.cancel_grace));
        let decoder = Arc::clone(dec);
        let decode_sent = Instant::now();
        let mut decode = shared.detachable(async move {
            // Health is counted by the request that waits for this answer, not here: an answer
            // that comes after the request was abandoned says nothing of the decoder.
            let r = aborter.shared.post(&decoder.http, "decode", path, &decode_body, false).await;
            aborter.decode_answered.store(true, Ordering::Relaxed);
            // Answered after the request was abandoned (an abort that came before it was ignored):
            // abort it now and close the answer.
            if aborter.abandoned() {
                aborter.send(&decoder.http).await;
                return None;
            }
            Some(r)
        });
        let (mut prefill_done, mut prefill_ran) = (false, false);
        let resp = loop {
            tokio::select! {
                () = &mut prefill_leg, if !prefill_ran => prefill_ran = true,
                p = &mut prefill_rx, if !prefill_done => {
                    prefill_done = true;
                    match p {
                        Ok(PrefillOutcome { result: Ok(()), took, .. }) => timing.record(Phase::Prefill, took),
                        Ok(PrefillOutcome { result: Err(e), retryable, .. }) => {
                            // A prefiller never reached, or refusing (503), sent no KV: the
                            // request may run again on another (its decode is aborted here).
                            if retryable {
                                let _ = retry.set(Unstarted::Prefill(prefill.name.clone()));
                            }
                            shared.spawn(abort_decode(decode, abort, slots.take()));
                            return Err(e);
                        }
                        Err(_) => return Err(GatewayError::Internal(Internal::TaskLost { task: "prefill" })),
                    }
                }
                d = &mut decode => break d,
            }
        };
        // The prefill, when the decoder answered first, runs on in a task of its own; its
        // outcome comes with the answer's body.
        drop(prefill_leg);
        // A decode that failed: see `decode_failed` for what may run again.
        let resp = match resp {
            // A refusal counts against the decoder only when its prefiller is not to blame (the
            // decoder cannot bootstrap from a prefiller that is down: one prefiller down must not
            // open the decoders' breakers).
            Some(Ok(answer)) => match shared.accept_uncounted("decode", &**dec, answer, decode_sent).await {
                Ok(resp) => resp,
                Err(e) => {
                    if !e.may_run_on() {
                        engine_has_it(&mut slots, None);
                    }
                    let failed = e.engine_failed();
                    let e =
                        decode_failed(e, &prefill.name, &mut prefill_rx, prefill_done, timing, retry).await;
                    if failed && !matches!(retry.get(), Some(Unstarted::Prefill(_))) {
                        shared.failed(&**dec, decode_sent);
                    }
                    return Err(e);
                }
            },
            Some(Err(e)) => {
                shared.failed(&**dec, decode_sent);
                let e = LegError::Unanswered { leg: "decode", source: e };
                if !e.may_run_on() {
                    engine_has_it(&mut slots, None);
                }
                return Err(
                    decode_failed(e, &prefill.name, &mut prefill_rx, prefill_done, timing, retry).await
                );
            }
            None => {
                return Err(GatewayError::Upstream {
                    leg: "decode",
                    message: "the request was abandoned".into(),
                });
            }
        };
        timing.mark(Phase::Decode);
        let prefill = (!prefill_done).then_some(prefill_rx);
        let timing = prefill.is_some().then(|| timing.later());
        Ok(resp.map(|inner| {
            Held::body(inner, DecodeStream { prefill, timing, slot: slots, abort: Some(abort) })
        }))
    }
}

/// Longest a failed decode waits for the prefill leg's end, when the prefill has not ended yet:
/// one never reached or refusing ends at once (a refused connection, a 503).
const PREFILL_VERDICT: Duration = Duration::from_millis(250);

/// The client's error for a failed decode leg, and whether the request may run again (`retry`).
///
/// SGLang's decoder bootstraps from the prefiller named in its request, so a prefiller never
/// reached (down, refusing connections) or refusing (503) fails the decode too, and the decoder
/// often says so first ("bootstrap server ... Connection refused").
///
/// The decode's own failure decides first: a decoder never reached took no KV; one refusing (503)
/// before the prefill answered did not take it either (an SGLang prefill answers once its KV has
/// gone to the decoder), and the request may run again on another decoder, in a room of its own
/// (this attempt's room is aborted on both engines). A decoder cut off mid-call may have begun to
/// pull: never. Any other failure would end the request; then, when the prefill has not ended
/// yet, its end is awaited for at most [`PREFILL_VERDICT`]: if the prefiller was never reached or
/// refused, no KV moved, and the request runs again without that prefiller (with the prefill's
/// error for the client should it not). Only a request that would fail waits.
async fn decode_failed(
    e: LegError,
    prefiller: &str,
    prefill_rx: &mut oneshot::Receiver<PrefillOutcome>,
    prefill_done: bool,
    timing: &mut crate::telemetry::Timing,
    retry: &std::sync::OnceLock<Unstarted>,
) -> GatewayError {
    if e.retryable(false) && (!prefill_done || !e.maybe_sent()) {
        let _ = retry.set(Unstarted::Decode);
        return e.into();
    }
    // A failure that would end the request: unless the prefill, not yet ended, turns out never
    // reached. (A prefill that answers after the decoder failed says nothing of what the decoder
    // held when it failed.)
    if !prefill_done && let Ok(Ok(outcome)) = tokio::time::timeout(PREFILL_VERDICT, prefill_rx).await {
        match outcome {
            PrefillOutcome { result: Err(prefill_error), retryable: true, .. } => {
                let _ = retry.set(Unstarted::Prefill(prefiller.to_owned()));
                return prefill_error;
            }
            PrefillOutcome { result: Ok(()), took, .. } => timing.record(Phase::Prefill, took),
            PrefillOutcome { result: Err(_), .. } => {}
        }
    }
    e.into()
}

/// Both legs' bodies, written once (each leg owns its own: it may run on after the request),
/// and the `rid` SGLang knows the request by (none with `n > 1`: SGLang names the choices itself).
struct Bodies {
    decode: Encoded,
    prefill: Encoded,
    rid: Option<String>,
}

/// The client's request to both legs with the bootstrap of the prefill server at `prefill` (its
/// `port`): `bootstrap_host`, `bootstrap_port` and a `bootstrap_room` drawn from the request's
/// unique `id`, lists of each with `n > 1`; the prefill leg unstreamed.
fn bodies(raw: &Object, prefill: &EngineUrl, port: u16, id: u128) -> Result<Bodies, GatewayError> {
    // At most validate::MAX_N: the request was validated.
    let choices = raw.get("n").and_then(Value::as_u64).filter(|n| *n > 1);
    // The host as configured, as SGLang's router sends it: a name is resolved by the decoder.
    let host = prefill.host();
    let folded = u64::try_from(id & u128::from(u64::MAX)).unwrap_or(0) ^ u64::try_from(id >> 64).unwrap_or(0);
    let room = |i: u64| splitmix(folded ^ i) & (i64::MAX as u64);
    // SGLang names a request by `rid` (one per choice; with `n > 1` it makes its own).
    let theirs = raw.get("rid").and_then(Value::as_str);
    let ours = (choices.is_none() && theirs.is_none()).then(|| hex_name("baton-", id));
    let mut body = Patched::new(raw, &[]);
    body = match choices {
        Some(n) => {
            let k = usize::try_from(n).unwrap_or(0);
            body.set("bootstrap_host", &vec![host; k])
                .set("bootstrap_port", &vec![port; k])
                .set("bootstrap_room", &(0..n).map(room).collect::<Vec<_>>())
        }
        None => body
            .string("bootstrap_host", host)
            .count("bootstrap_port", port.into())
            .count("bootstrap_room", room(0)),
    };
    if let Some(ours) = &ours {
        body = body.string("rid", ours);
    }
    let decode = encode(&body)?;
    // A request already unstreamed (`stream` absent or `false`, no `stream_options`) is its own
    // prefill body, shared rather than written again: SGLang's own test router (`mini_lb`) posts
    // one body to both legs, and a leg's `stream` is `false` unless asked (the second body was
    // 3.7k of sglang's 107.2k instructions a request, `scripts/count-instructions`).
    let unstreamed =
        raw.get("stream").is_none_or(|s| *s == Value::Bool(false)) && !raw.contains_key("stream_options");
    let prefill = if unstreamed {
        drop(body);
        decode.clone()
    } else {
        encode(&body.flag("stream", false).omit(&["stream_options"]))?
    };
    let rid = match choices {
        None => ours.or_else(|| theirs.map(str::to_owned)),
        Some(_) => None,
    };
    Ok(Bodies { decode, prefill, rid })
}

/// SplitMix64: bootstrap rooms spread over the whole range from the request's unique id.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The prefill leg's end: nothing (its answer is not used) or the client's error, and its time.
#[derive(Debug)]
struct PrefillOutcome {
    result: Result<(), GatewayError>,
    took: Duration,
    /// The prefiller was never reached or refused (503): it holds and sent nothing.
    retryable: bool,
}

/// The prefill leg of one request.
struct PrefillLeg {
    prefill: Prefiller,
    path: &'static str,
    body: Encoded,
    aborter: Arc<Aborter>,
    work: Option<crate::routing::Work>,
}

impl PrefillLeg {
    /// Posts the prefill and reports how it ended (to nobody, when the request is gone).
    async fn run(self, tx: oneshot::Sender<PrefillOutcome>) {
        let Self { prefill: p, path, body, aborter, work } = self;
        let started = Instant::now();
        let in_flight = p.health.start();
        // The answer (one token) is not used; it is read so the connection is reused.
        let result = aborter.shared.fetch("prefill", &p, path, &body).await;
        let retryable = result.as_ref().is_err_and(|e| e.retryable(false));
        let result = result.map(drop).map_err(Into::into);
        drop((in_flight, work));
        // The request was abandoned while this leg ran: the engine may have taken the abort before the
        // request and now holds the KV for a decoder that will not come.
        if result.is_ok() && aborter.abandoned() {
            aborter.send(&p.http).await;
        }
        let (took, ok) = (started.elapsed(), result.is_ok());
        let _ = tx.send(PrefillOutcome { result, took, retryable });
        drop(prefill_ended(&aborter.prefill_timing, ok, took));
    }
}

/// First pause between aborts of a decode call that has not answered, doubling up to
/// [`ABORT_RETRY_MAX`], for at most [`ABORT_FOR`]: an abort that reaches SGLang before the request
/// it names is ignored there.
const ABORT_RETRY: Duration = Duration::from_millis(20);
const ABORT_RETRY_MAX: Duration = Duration::from_millis(500);
const ABORT_FOR: Duration = Duration::from_secs(5);

/// Ends a decode leg whose prefill failed: `/abort_request` until its call answers (bounded), then
/// the call is dropped (SGLang aborts a request whose client left).
async fn abort_decode(
    mut decode: Detachable<Option<Result<Response<crate::endpoints::EngineBody>, PostError>>>,
    mut abort: AbortGuard,
    slot: Option<SlotGuard>,
) {
    abort.armed = false;
    abort.aborter.abandoned.store(true, Ordering::Relaxed);
    if let Some(decoder) = abort.engines.last() {
        // The decode call runs on while the aborts are sent: its answer is what ends them.
        let aborts = abort.aborter.until_answered(decoder);
        tokio::pin!(aborts);
        let mut answered = false;
        loop {
            tokio::select! {
                () = &mut aborts => break,
                _ = &mut decode, if !answered => answered = true,
            }
        }
    }
    decode.cancel();
    // Held until the abort was answered, and `cancel_grace_ms` more (an answer's headers do not
    // say the decoder dropped the request).
    drop(slot);
}

/// Tells SGLang engines to abort one request (`POST /abort_request {"rid"}`), and whether the
/// request was abandoned (the legs still running check it when they end).
struct Aborter {
    shared: Arc<Shared>,
    /// `None` with `n > 1` (SGLang names the choices itself): only dropping the calls aborts.
    rid: Option<String>,
    counters: Arc<Aborts>,
    abandoned: AtomicBool,
    /// The decode call has its answer (headers), or failed.
    decode_answered: AtomicBool,
    /// The request's timing, left here by a response that ended before the prefill answered
    /// ([`response_ended`]), for the prefill leg to record its own time in when it ends
    /// ([`prefill_ended`]): no task waits for the leg only to time it. A leg that ends without an
    /// outcome (cancelled, or panicked) leaves it to be dropped, and recorded without the
    /// prefill, with the last holder of the aborter (at most the abort's retries later).
    prefill_timing: Mutex<Option<Later>>,
}

/// The prefill leg has sent its outcome: the timing a response that ended before it left, if any,
/// taken, with the leg's time recorded in it when it succeeded (looked for after the send: a
/// response that leaves it after this look finds the outcome already sent, [`response_ended`]).
fn prefill_ended(timing: &Mutex<Option<Later>>, ok: bool, took: Duration) -> Option<Later> {
    let mut t = timing.lock().unwrap_or_else(|e| e.into_inner()).take()?;
    if ok {
        t.record(Phase::Prefill, took);
    }
    Some(t)
}

/// A response ended before the prefill's outcome came: its timing left for the leg
/// ([`prefill_ended`]), then the outcome looked for, in case the leg sent it before the timing was
/// left and looked already. Whichever of the two takes the timing first has it (returned here when
/// it is this one, the prefill's time recorded when the leg succeeded).
fn response_ended(
    cell: &Mutex<Option<Later>>,
    timing: Later,
    outcome: &mut oneshot::Receiver<PrefillOutcome>,
) -> Option<Later> {
    *cell.lock().unwrap_or_else(|e| e.into_inner()) = Some(timing);
    let PrefillOutcome { result, took, .. } = outcome.try_recv().ok()?;
    prefill_ended(cell, result.is_ok(), took)
}

impl Aborter {
    fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Aborts on the decoder until its call has answered (pauses doubling), for at most
    /// [`ABORT_FOR`]; at once without an `rid`.
    async fn until_answered(&self, decoder: &EngineUrl) {
        if self.rid.is_none() {
            return;
        }
        let give_up = Instant::now() + ABORT_FOR;
        let mut backoff = Backoff::new(ABORT_RETRY, ABORT_RETRY_MAX);
        while Instant::now() < give_up {
            self.send(decoder).await;
            if self.decode_answered.load(Ordering::Relaxed) {
                return;
            }
            backoff.wait().await;
        }
    }

    /// One `/abort_request`. Boxed: a 1.2 KB future, awaited only for a request that was
    /// abandoned, where every leg that may send one would otherwise hold its room (and copy it
    /// when made and boxed) for every request.
    fn send<'a>(&'a self, engine: &'a EngineUrl) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let Some(rid) = &self.rid else { return };
            self.counters.sent.fetch_add(1, Ordering::Relaxed);
            match self
                .shared
                .post_within(engine, "abort", "/abort_request", &json!({"rid": rid}), ABORT_TIMEOUT, false)
                .await
            {
                Ok(r) if r.status().is_success() => {
                    let _ = r.into_body().collect().await;
                }
                _ => {
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    }
}

/// Abandons the request when dropped armed (it ended before its answer did: a client that left, a
/// failed leg): aborts it on its engines now, and marks it so the legs still running abort it
/// again when they end.
struct AbortGuard {
    aborter: Arc<Aborter>,
    engines: Vec<EngineUrl>,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.aborter.abandoned.store(true, Ordering::Relaxed);
        let (aborter, engines) = (Arc::clone(&self.aborter), std::mem::take(&mut self.engines));
        self.aborter.shared.spawn_from_drop(async move {
            let Some((decoder, others)) = engines.split_last() else { return };
            for e in others {
                aborter.send(e).await;
            }
            // A decode call still waiting (for its room) is told again until it answers.
            aborter.until_answered(decoder).await;
        });
    }
}

/// What the decoder's answer holds until it ends: the request's slot, its abort, and the prefill
/// still running, whose failure while the answer streams ends it with an error event.
struct DecodeStream {
    prefill: Option<oneshot::Receiver<PrefillOutcome>>,
    /// The prefill's time, when it answers after the response started.
    timing: Option<Later>,
    slot: Option<SlotGuard>,
    abort: Option<AbortGuard>,
}

impl Holds for DecodeStream {
    fn cut(&mut self, cx: &mut Context<'_>) -> Option<Frame<Bytes>> {
        let rx = self.prefill.as_mut()?;
        let Poll::Ready(p) = Pin::new(rx).poll(cx) else { return None };
        self.prefill = None;
        match p {
            Ok(PrefillOutcome { result: Ok(()), took, .. }) => {
                if let Some(t) = self.timing.as_mut() {
                    t.record(Phase::Prefill, took);
                }
                None
            }
            Ok(PrefillOutcome { result: Err(e), .. }) => {
                // The decoder waits for KV that will not come: end the answer (the guard aborts it
                // on drop).
                tracing::warn!(error = %e, "sglang prefill failed after the decoder's answer started");
                Some(Frame::data(Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", e.body()))))
            }
            Err(_) => None,
        }
    }

    fn ended(&mut self) {
        if let Some(a) = self.abort.as_mut() {
            // The answer ended whole: nothing to abort.
            a.armed = false;
        }
        engine_has_it(&mut self.slot, None);
    }

    fn sized(&self) -> bool {
        self.prefill.is_none()
    }
}

impl Drop for DecodeStream {
    fn drop(&mut self) {
        // The prefill's answer may come after the decoder's ended; it is still timed, by the leg
        // itself ([`response_ended`]).
        let (Some(mut rx), Some(timing), Some(abort)) =
            (self.prefill.take(), self.timing.take(), &self.abort)
        else {
            return;
        };
        drop(response_ended(&abort.aborter.prefill_timing, timing, &mut rx));
    }
}

impl Handoff for Sglang {
    fn run<'a>(&'a self, leg: Leg<'a>) -> BoxFuture<'a, Result<Response<RespBody>, GatewayError>> {
        Box::pin(self.exchange(leg))
    }

    fn view(&self) -> BoxFuture<'_, Value> {
        Box::pin(async move {
            let learned: HashMap<String, u16> = self
                .learned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(a, p)| (a.to_string(), *p))
                .collect();
            json!({"max_in_flight": self.scraped.target.max_in_flight, "bootstrap_port": self.bootstrap_port,
                   "learned_bootstrap_ports": learned})
        })
    }

    fn metrics(&self, decoder: &str, out: &mut Scrape) {
        self.scraped.metrics(decoder, Self::NAME, out);
        for (result, c) in [("sent", &self.aborts.sent), ("failed", &self.aborts.failed)] {
            out.counter(
                "baton_sglang_aborts_total",
                "POST /abort_request sent to SGLang engines for requests that ended before their answer, by result.",
                &[("decoder", decoder), ("result", result)],
                c.load(Ordering::Relaxed) as f64,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A late prefill's time is recorded once, whichever ends first: the leg (its outcome sent
    /// before the response left its timing) or the response; a failed prefill's is not; a leg
    /// that ends with no outcome leaves the timing where it is.
    #[test]
    fn a_late_prefill_is_timed_once_whichever_ends_first() {
        let took = Duration::from_millis(7);
        let prefill = |t: &Later| t.phases().iter().filter(|(p, _)| *p == Phase::Prefill).count();
        let outcome = |result| PrefillOutcome { result, took, retryable: false };
        let later = || crate::telemetry::Timing::start().later();
        for (leg_first, ok) in [(true, true), (false, true), (true, false), (false, false)] {
            let cell = Mutex::new(None);
            let (tx, mut rx) = oneshot::channel();
            let result = if ok { Ok(()) } else { Err(GatewayError::invalid("x", "y")) };
            let (by_leg, by_response) = if leg_first {
                tx.send(outcome(result)).ok();
                let by_leg = prefill_ended(&cell, ok, took);
                (by_leg, response_ended(&cell, later(), &mut rx))
            } else {
                let by_response = response_ended(&cell, later(), &mut rx);
                tx.send(outcome(result)).ok();
                (prefill_ended(&cell, ok, took), by_response)
            };
            let case = format!("leg first {leg_first}, ok {ok}");
            let t = match (by_leg, by_response) {
                (Some(t), None) if !leg_first => t,
                (None, Some(t)) if leg_first => t,
                other => panic!("{case}: taken by {other:?}"),
            };
            assert_eq!(prefill(&t), usize::from(ok), "{case}");
            assert!(cell.lock().unwrap_or_else(|e| e.into_inner()).is_none(), "{case}");
        }
        let cell = Mutex::new(None);
        let (tx, mut rx) = oneshot::channel::<PrefillOutcome>();
        drop(tx);
        assert!(response_ended(&cell, later(), &mut rx).is_none());
        assert!(cell.lock().unwrap_or_else(|e| e.into_inner()).is_some(), "left for the aborter's drop");
    }

    fn map(v: Value) -> Object {
        v.as_object().cloned().unwrap_or_default().into()
    }

    fn parse(b: &Encoded) -> Value {
        serde_json::from_slice(b.as_bytes()).unwrap_or_default()
    }

    /// One choice: scalars and our `rid` (or the client's); `n > 1`: a list of each, one per choice,
    /// no `rid`. The prefill leg is the same request, unstreamed.
    #[test]
    fn both_legs_carry_the_bootstrap() {
        let prefill = EngineUrl::parse("http://prefill-0:30000").unwrap_or_else(|e| panic!("{e}"));
        let raw = map(json!({"prompt": "p", "stream": true, "stream_options": {"include_usage": true}}));
        let b = bodies(&raw, &prefill, 8998, 7).unwrap_or_else(|e| panic!("{e}"));
        let (d, p) = (parse(&b.decode), parse(&b.prefill));
        assert_eq!(
            (d["bootstrap_host"].clone(), d["bootstrap_port"].clone()),
            (json!("prefill-0"), json!(8998))
        );
        assert!(d["bootstrap_room"].as_u64().is_some_and(|r| r <= i64::MAX as u64));
        assert_eq!(b.rid.as_deref(), Some("baton-00000000000000000000000000000007"));
        assert_eq!(d["rid"], json!(b.rid));
        assert_eq!((d["stream"].clone(), p["stream"].clone()), (json!(true), json!(false)));
        assert!(p.get("stream_options").is_none() && d.get("stream_options").is_some());
        assert_eq!(p["bootstrap_room"], d["bootstrap_room"]);

        let theirs = map(json!({"prompt": "p", "rid": "client-1"}));
        let b = bodies(&theirs, &prefill, 8998, 7).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.rid.as_deref(), Some("client-1"));
        // Unstreamed already: one body for both legs, with no `stream` written.
        assert_eq!(b.prefill.as_bytes(), b.decode.as_bytes());
        assert!(parse(&b.prefill).get("stream").is_none());
        // `stream: false` alone is unstreamed too; `stream: true`, `null`, or any `stream_options`
        // (`null` is all validation lets through beside `stream: false`) are not.
        for (raw, same) in [
            (json!({"prompt": "p", "stream": false}), true),
            (json!({"prompt": "p", "stream": true}), false),
            (json!({"prompt": "p", "stream": null}), false),
            (json!({"prompt": "p", "stream_options": null}), false),
            (json!({"prompt": "p", "stream": false, "stream_options": {"include_usage": true}}), false),
        ] {
            let b = bodies(&map(raw.clone()), &prefill, 8998, 7).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(b.prefill.as_bytes() == b.decode.as_bytes(), same, "{raw}");
            let p = parse(&b.prefill);
            assert_eq!((p["stream"].clone(), p.get("stream_options")), (json!(false), None), "{raw}");
        }

        // `n: 1` is one choice; a `rid` that is not a string is replaced by ours in its place.
        let one = map(json!({"prompt": "p", "n": 1, "rid": 5}));
        let b = bodies(&one, &prefill, 8998, 7).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.rid.as_deref(), Some("baton-00000000000000000000000000000007"));
        let d = parse(&b.decode);
        assert_eq!(d["rid"], json!(b.rid));
        assert_eq!(d.as_object().and_then(|o| o.keys().position(|k| k == "rid")), Some(2));
        assert_eq!(d["bootstrap_port"], json!(8998));
        // With `n > 1`, a client's `rid` goes to SGLang as it is (its list, one per choice).
        let listed = map(json!({"prompt": "p", "n": 2, "rid": ["a", "b"]}));
        let b = bodies(&listed, &prefill, 8998, 7).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.rid, None);
        assert_eq!(parse(&b.decode)["rid"], json!(["a", "b"]));

        let three = map(json!({"prompt": "p", "n": 3}));
        let b = bodies(&three, &prefill, 8998, 7).unwrap_or_else(|e| panic!("{e}"));
        let d = parse(&b.decode);
        assert_eq!(b.rid, None);
        assert!(d.get("rid").is_none());
        assert_eq!(d["bootstrap_port"], json!([8998, 8998, 8998]));
        let rooms = d["bootstrap_room"].as_array().cloned().unwrap_or_default();
        assert_eq!(rooms.len(), 3);
        assert!(rooms[0] != rooms[1] && rooms[1] != rooms[2]);
    }

    #[test]
    fn rooms_are_spread_and_within_sglangs_range() {
        let rooms: Vec<u64> = (0..1000u64).map(|i| splitmix(i) & (i64::MAX as u64)).collect();
        let mut unique = rooms.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), rooms.len());
        assert!(rooms.iter().all(|r| *r <= i64::MAX as u64));
        assert!(rooms.iter().any(|r| *r > 1 << 62), "the high half of the range is used");
    }
}
