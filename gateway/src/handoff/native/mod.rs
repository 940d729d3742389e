//! The native handoff (`handoff = "native"`): reserve on every decoder rank (all or nothing,
//! retried while another replica holds pages) → prefill with the write addresses → wait for READY
//! from every rank (deadline, fail fast) → decode, streamed back → slots returned when every rank
//! reports its pages released.
//!
//! Everything a request holds past admission (its slots, the reservation, the event subscription)
//! lives in one [`Lifecycle`]; its `Drop` runs on every path, including a client that disconnects
//! at any await point: it cancels what is still reserved (quarantine-free when the prefiller never
//! saw the addresses) and returns the slots once the decoder has freed the pages (or a bound
//! passes).

pub mod ranks;

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_dataplane::contract::{self, BatonParams, DecoderTarget};
use baton_dataplane::readiness::{Aggregator, Outcome, Progress};
use baton_dataplane::{RankEvent, RequestKey};
use http_body_util::BodyExt;
use hyper::Response;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::decoder::{BoxFuture, Decoder, Handoff, Leg, queue_admit};
use super::shared::{Patched, RespBody, Shared, boxed};
use crate::admission::{SlotGuard, SlotQueue, Ticket};
use crate::api::GatewayError;
use crate::telemetry::Phase;
use crate::telemetry::request_id;
pub use ranks::{RankLinks, Ranks};

/// The mode's name in the configuration.
pub const MODE: &str = "native";
/// First pause before retrying a reservation refused for lack of room.
const RESERVE_BACKOFF: Duration = Duration::from_millis(2);
/// Longest pause between reservation retries.
const RESERVE_BACKOFF_MAX: Duration = Duration::from_millis(50);

/// A native decoder.
#[derive(Debug)]
pub struct Native {
    shared: Arc<Shared>,
    pub ranks: Arc<Ranks>,
    /// TEST ONLY: the protections off, to show what they prevent. No admission, and decoder pages
    /// taken one chunk at a time as the chunks would arrive (as LMCache's PD buffer allocates),
    /// each held while the next is awaited. Never set by configuration.
    pub unprotected: bool,
}

impl Native {
    /// Connects to every rank; `queue` is sized from the pages they report (lowered to
    /// `max_slots`).
    pub async fn connect(
        shared: Arc<Shared>,
        name: String,
        links: RankLinks,
        chunk_tokens: u32,
        max_slots: Option<u32>,
        queue: SlotQueue,
    ) -> Result<Self, baton_dataplane::transport::TransportError> {
        let ranks = Ranks::connect(name, links, chunk_tokens, max_slots, queue).await?;
        Ok(Self { shared, ranks: Arc::new(ranks), unprotected: false })
    }

    /// TEST ONLY ([`Native::unprotected`]): takes the request's pages one chunk at a time, holding
    /// each while waiting for the next (hold and wait: the deadlock's precondition), then gives
    /// them back to reserve the request as a whole. Under contention every request ends up holding
    /// part of the buffer and waiting for pages nobody will free.
    async fn hold_chunk_by_chunk(&self, chunks: u32) -> Result<(), GatewayError> {
        let dec = &self.ranks;
        let mut held = ChunkHolds { ranks: Arc::clone(dec), keys: Vec::new() };
        let give_up = Instant::now() + self.shared.limits.queue_timeout;
        while held.keys.len() < chunks as usize {
            let key = self.shared.keys.next();
            // Marked held before the call, so a client that leaves mid-call still cancels it.
            held.keys.push(key);
            match dec.reserve(key, 1, self.shared.limits.lease, &[]).await {
                Ok(Some(_)) => {}
                Ok(None) if Instant::now() < give_up => {
                    // `reserve` gave back what it got: nothing of `key` is held.
                    held.keys.pop();
                    tokio::time::sleep(RESERVE_BACKOFF).await;
                }
                Ok(None) => {
                    return Err(GatewayError::QueueTimeout(format!(
                        "decoder {} never had the pages",
                        dec.name
                    )));
                }
                Err(e) => {
                    return Err(GatewayError::Upstream { leg: "decoder data plane", message: e.to_string() });
                }
            }
        }
        // Given back one by one, each forgotten only once cancelled: a client that leaves part-way
        // leaves the rest to the guard's Drop.
        while let Some(&k) = held.keys.last() {
            dec.cancel(k, true).await;
            held.keys.pop();
        }
        Ok(())
    }

    /// Reserves the request's pages on every rank; a refusal for room (another replica's pages)
    /// waits and retries as a new epoch of the request.
    async fn reserve(
        &self,
        dec: &Decoder,
        life: &mut Lifecycle,
        chunks: u32,
        refusals: &mut u32,
    ) -> Result<Vec<(std::net::SocketAddr, Vec<(u32, baton_dataplane::PageAddr)>)>, GatewayError> {
        let limits = &self.shared.limits;
        let give_up = Instant::now() + limits.queue_timeout;
        let mut backoff = RESERVE_BACKOFF;
        life.rx = Some(self.ranks.listen(life.key));
        // Marked before the call: a client that leaves while a Reserve frame is in flight must still
        // cancel it (cancel is idempotent), or the pages would wait out the whole lease.
        life.reserved = true;
        loop {
            match self.ranks.reserve(life.key, chunks, limits.lease, &[]).await {
                Ok(Some(a)) => return Ok(a),
                Ok(None) if Instant::now() < give_up => {
                    self.shared.metrics.reservation_refused(&dec.name, true);
                    *refusals += 1;
                    // The ranks that had reserved this attempt were cancelled and report the key
                    // as cancelled, possibly after the next attempt succeeded: the next attempt is
                    // a new epoch of the request, so no report of this one can reach it.
                    self.ranks.forget(life.key);
                    life.key = RequestKey::new(life.key.request, life.key.epoch.wrapping_add(1));
                    life.rx = Some(self.ranks.listen(life.key));
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RESERVE_BACKOFF_MAX);
                }
                Ok(None) => {
                    self.shared.metrics.reservation_refused(&dec.name, false);
                    *refusals += 1;
                    return Err(GatewayError::QueueTimeout(format!(
                        "decoder {} had no free pages in time",
                        dec.name
                    )));
                }
                Err(e) => {
                    self.shared.failed(&dec.name, &dec.health);
                    return Err(GatewayError::Upstream { leg: "decoder data plane", message: e.to_string() });
                }
            }
        }
    }

    /// Waits until every rank holds the whole KV (or one fails, or the deadline passes).
    async fn wait_ready(&self, dec: &Decoder, life: &mut Lifecycle) -> Result<(), GatewayError> {
        let ready_timeout = self.shared.limits.ready_timeout;
        let deadline = Instant::now() + ready_timeout;
        let mut agg = Aggregator::new(life.key, self.ranks.rank_count(), deadline)
            .map_err(|e| GatewayError::Internal(e.to_string()))?;
        let outcome = loop {
            let Some(rx) = life.rx.as_mut() else {
                return Err(GatewayError::Internal("no event subscription".into()));
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, rx.recv()).await {
                Ok(Some(RankEvent::Status(s))) => match agg.observe(&s, Instant::now()) {
                    Ok(Progress::Done(o)) => break o,
                    Ok(Progress::Pending { .. }) | Err(_) => {}
                },
                Ok(Some(RankEvent::Released(_))) => life.released += 1,
                Ok(None) => return Err(GatewayError::KvTransfer("decoder event feed closed".into())),
                Err(_) => break agg.poll(Instant::now()).unwrap_or(Outcome::TimedOut { missing: 0 }),
            }
        };
        match outcome {
            Outcome::Ready => Ok(()),
            Outcome::Failed { rank, state } => {
                if state == baton_dataplane::events::TerminalState::Expired {
                    self.shared.metrics.lease_expired(&dec.name);
                }
                Err(GatewayError::KvTransfer(format!("decoder rank {rank} reported {}", state.as_str())))
            }
            Outcome::TimedOut { missing } => Err(GatewayError::KvTransfer(format!(
                "{missing} decoder ranks did not hold the kv within {ready_timeout:?}"
            ))),
        }
    }

    async fn exchange(&self, leg: Leg<'_>) -> Result<Response<RespBody>, GatewayError> {
        let Leg { dec, prefills, req, ids, slots, timing } = leg;
        let shared = &*self.shared;
        let chunks = self.ranks.slots_for(ids.len());
        let mut life = Lifecycle {
            ranks: Arc::clone(&self.ranks),
            key: shared.keys.next(),
            slots,
            rx: None,
            reserved: false,
            sent: false,
            decoded: false,
            released: 0,
            release_timeout: shared.limits.release_timeout,
        };
        timing.enter(Phase::Reserve);
        let mut refusals = 0;
        let reserved = self.reserve(dec, &mut life, chunks, &mut refusals).await;
        let (ranks, ok) = (self.ranks.rank_count(), reserved.is_ok());
        timing.note(
            "reservation",
            move || json!({"pages_per_rank": chunks, "ranks": ranks, "refusals": refusals, "reserved": ok}),
        );
        let addrs = reserved?;
        timing.mark(Phase::Reserve);
        timing.enter(Phase::Prefill);

        // Prefill: the engines agree on the token ids; the prefill leg is never streamed.
        let targets = addrs
            .iter()
            .enumerate()
            // Each rank's address the pages were reserved at: a named rank that moved since is
            // not where these pages are.
            .filter_map(|(r, (addr, a))| Some(DecoderTarget::new(u32::try_from(r).ok()?, *addr, a)))
            .collect();
        let body = Patched::new(&req.raw, &["stream_options"])
            .set("stream", &false)
            .set(contract::FIELD, &params(life.key, targets, ids));
        // The first prefiller, then the fallbacks while a prefiller cannot be connected to; one that
        // never saw the addresses leaves the pages free at once (no quarantine).
        let (prefill, resp, in_flight) =
            shared.prefill(prefills, req.endpoint.path(), &body, &mut life.sent, false).await?;
        if resp.status() != 200 {
            return Err(shared.refused("prefill", &prefill.name, &prefill.health, resp).await);
        }
        // The prefill's own answer (one token) is not used; drain it so the connection is reused.
        let _ = resp.into_body().collect().await;
        prefill.health.success();
        drop(in_flight);
        timing.mark(Phase::Prefill);
        timing.enter(Phase::KvReady);

        self.wait_ready(dec, &mut life).await?;
        shared.metrics.kv_transfer(MODE, timing.mark(Phase::KvReady));
        timing.enter(Phase::Decode);

        // Decode, streamed straight back.
        let body = Patched::new(&req.raw, &[]).set(contract::FIELD, &params(life.key, Vec::new(), ids));
        let resp = shared.post(&dec.http, "decode", req.endpoint.path(), &body).await.map_err(|e| {
            shared.failed(&dec.name, &dec.health);
            e.on("decode")
        })?;
        if resp.status() != 200 {
            return Err(shared.refused("decode", &dec.name, &dec.health, resp).await);
        }
        dec.health.success();
        life.decoded = true;
        drop(life);
        timing.mark(Phase::Decode);
        Ok(resp.map(boxed))
    }
}

/// The `baton` field of an engine request (written as JSON straight from the ids).
fn params(key: RequestKey, decoders: Vec<DecoderTarget>, ids: &[u32]) -> BatonParams {
    BatonParams::new(key, decoders, Some(ids.to_vec()))
}

impl Handoff for Native {
    fn mode(&self) -> &'static str {
        MODE
    }

    fn shared(&self) -> &Shared {
        &self.shared
    }

    fn slots_for(&self, prompt_tokens: usize) -> u32 {
        self.ranks.slots_for(prompt_tokens)
    }

    fn admit<'a>(
        &'a self,
        dec: &'a Decoder,
        need: u32,
        ticket: Ticket,
    ) -> BoxFuture<'a, Result<Option<SlotGuard>, GatewayError>> {
        if self.unprotected {
            return Box::pin(async move { self.hold_chunk_by_chunk(need).await.map(|()| None) });
        }
        Box::pin(queue_admit(dec, need, ticket, self.shared.limits.queue_timeout))
    }

    fn run<'a>(&'a self, leg: Leg<'a>) -> BoxFuture<'a, Result<Response<RespBody>, GatewayError>> {
        Box::pin(self.exchange(leg))
    }

    fn view(&self) -> BoxFuture<'_, Value> {
        Box::pin(async move {
            let ranks: Vec<Value> = self
                .ranks
                .ranks_view()
                .await
                .into_iter()
                .map(|r| json!({"rank": r.rank, "pages_total": r.pages_total, "pages_free": r.pages_free}))
                .collect();
            json!({"ranks": ranks})
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// What a request holds; released in `Drop`, on every path.
struct Lifecycle {
    ranks: Arc<Ranks>,
    key: RequestKey,
    slots: Option<SlotGuard>,
    rx: Option<mpsc::UnboundedReceiver<RankEvent>>,
    reserved: bool,
    sent: bool,
    /// Set once the decoder took the request: no cancel, only wait for the release.
    decoded: bool,
    released: u32,
    release_timeout: Duration,
}

impl Drop for Lifecycle {
    fn drop(&mut self) {
        let dec = Arc::clone(&self.ranks);
        let (key, slots, rx) = (self.key, self.slots.take(), self.rx.take());
        let (reserved, sent, decoded, seen, bound) =
            (self.reserved, self.sent, self.decoded, self.released, self.release_timeout);
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(request_id::carry(async move {
            if reserved && !decoded {
                dec.cancel(key, !sent).await;
            }
            // Never sent: the rank freed the pages before answering the cancel (and a reservation
            // that was never made sends no release), so there is nothing to wait for.
            let wait = !(reserved && !decoded && !sent);
            if let Some(mut rx) = rx.filter(|_| wait) {
                let ranks = dec.rank_count();
                let mut released = seen;
                let deadline = tokio::time::Instant::now() + bound;
                while released < ranks {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(RankEvent::Released(_))) => released += 1,
                        Ok(Some(_)) => {}
                        _ => break,
                    }
                }
            }
            dec.forget(key);
            // The slots go back only now: the decoder has freed the pages (or its lease will).
            drop(slots);
        }));
    }
}

/// Single-chunk reservations held by [`Native::hold_chunk_by_chunk`]; cancelled on drop.
struct ChunkHolds {
    ranks: Arc<Ranks>,
    keys: Vec<RequestKey>,
}

impl Drop for ChunkHolds {
    fn drop(&mut self) {
        let (dec, keys) = (Arc::clone(&self.ranks), std::mem::take(&mut self.keys));
        if keys.is_empty() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(request_id::carry(async move {
                for k in keys {
                    dec.cancel(k, true).await;
                }
            }));
        }
    }
}
