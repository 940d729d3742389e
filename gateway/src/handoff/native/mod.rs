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

#[cfg(feature = "demo")]
pub mod unprotected;

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_dataplane::contract::{self, DecoderTarget};
use baton_dataplane::readiness::{Aggregator, Outcome, Progress};
use baton_dataplane::{KvGeometry, RankEvent, RequestKey};
use http_body_util::BodyExt;
use hyper::Response;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::decoder::{BoxFuture, Decoder, Handoff, Leg};
use super::legs::{
    Json, LegError, Patched, RespBody, Retrying, WriteJson, boxed, hex_name, write_ids, write_str,
};
use super::shared::{Backoff, Engine, Shared};
use super::{CheckContext, ModeSpec, Pool, PoolKeys};
use super::{KeyError, StartContext, StartError};
use crate::admission::{SlotGuard, SlotQueue};
use crate::api::{GatewayError, GenRequest, Internal, KvFailure, Waited};
use crate::endpoints::{Host, HostPort};
use crate::telemetry::{Phase, Timing};
pub use ranks::{RankLinks, Ranks};

/// First pause before retrying a reservation refused for lack of room.
const RESERVE_BACKOFF: Duration = Duration::from_millis(2);
/// Longest pause between reservation retries.
const RESERVE_BACKOFF_MAX: Duration = Duration::from_millis(50);
/// How long a decoder's "the request's pages are gone" waits for the rank's own status on the
/// event feed, to say whether the lease expired.
const STATUS_AFTER_ANSWER: Duration = Duration::from_millis(200);
/// How long a decoder's answer waits for the prefill's, which is due once the decoder holds the
/// KV (read so the prefiller's connection is reused; past it, dropped and logged).
const PREFILL_AFTER_DECODE: Duration = Duration::from_secs(1);

/// `handoff = "native"` (the default): the decoder's data-plane ranks.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Keys {
    /// Data-plane address of each rank, in rank order; their count is the TP size.
    pub dataplane: Vec<HostPort>,
    /// Lowers the slots the data plane reports (never raises them).
    pub max_slots: Option<u32>,
    /// `[decode.dataplane_tls]`: this pool's mTLS to its ranks (else the global `[dataplane_tls]`).
    pub dataplane_tls: Option<crate::config::DataplaneTls>,
    /// Ranks off loopback may be reached in plain TCP (a network the operator trusts): without
    /// it, and without TLS, the configuration is refused.
    #[serde(default)]
    pub dataplane_plaintext: bool,
    /// Who reserves a request's pages on the ranks: the gateway before the prefill (the default,
    /// any native prefiller), or the prefiller with its writes (one round trip less; prefillers
    /// that read the contract's `reserve`).
    #[serde(default)]
    pub reserve: ReserveBy,
    /// How the contract's `prompt_token_ids` are written to this pool's prefillers and decoder: a
    /// JSON array (the default, any native engine), or their base64 string (several times cheaper
    /// for an engine to read; engines on a data plane that reads it).
    #[serde(default)]
    pub token_ids: TokenIds,
}

/// How a native pool's engines are sent the prompt's ids (`token_ids` on the pool).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenIds {
    /// A JSON array: `[9707, 11, 1879]`.
    #[default]
    Json,
    /// Little-endian `u32`s in standard base64 (`contract::ids_base64`): an engine built on a data
    /// plane older than this refuses it, and one that reads the array itself may misread it, so
    /// this is the operator's choice.
    Base64,
}

impl TokenIds {
    /// `ids` as this pool's engines read them, written once for both legs.
    fn write(self, ids: &[u32]) -> Result<Json, GatewayError> {
        let text = match self {
            Self::Json => {
                let mut text = Vec::new();
                write_ids(&mut text, ids);
                String::from_utf8(text).map_err(|e| e.to_string())
            }
            Self::Base64 => {
                // The standard alphabet (`A-Z a-z 0-9 + / =`) needs no escape in JSON: the string
                // is written between its quotes, and is JSON by construction (not scanned again).
                let mut quoted = String::with_capacity(contract::ids_base64_len(ids) + 2);
                quoted.push('"');
                contract::ids_base64_into(ids, &mut quoted);
                quoted.push('"');
                Ok(quoted)
            }
        };
        text.map(Json::written).map_err(|reason| {
            GatewayError::Internal(crate::api::Internal::Encode { what: "the prompt's token ids", reason })
        })
    }
}

/// Who reserves a native request's pages on the decoder's ranks (`reserve` on the pool).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReserveBy {
    /// The gateway, on every rank before it sends the prefill the write addresses.
    #[default]
    Gateway,
    /// The prefiller, on the connection it writes on, its chunks right behind: the prefill goes
    /// out at once (the contract's `reserve`; a prefiller built on an older data plane would
    /// write nothing, so this is the operator's choice).
    Prefiller,
}

/// How one attempt of a native request's legs ended, short of an error.
enum Attempt {
    Answered(Response<RespBody>),
    /// The prefiller's reservation found a rank without room: retried as a new epoch.
    Busy,
}

/// The prefill leg's outcome, short of an error.
enum Prefilled {
    Done,
    /// `reserve = "prefiller"`: a decoder rank had no room (the prefiller's 507).
    Busy,
}

/// A native pool, checked.
#[derive(Clone, Debug)]
pub struct Checked {
    pub ranks: Vec<HostPort>,
    /// The pool's geometry (its TP is its rank count).
    pub geometry: KvGeometry,
    pub max_slots: Option<u32>,
    /// The pool's own data-plane TLS (`None`: the global one, if any).
    pub tls: Option<crate::endpoints::DataplaneCerts>,
    pub reserve: ReserveBy,
    pub token_ids: TokenIds,
}

/// A native decoder.
#[derive(Debug)]
pub struct Native {
    shared: Arc<Shared>,
    pub ranks: Arc<Ranks>,
    /// The data-plane TLS its rank links use, reloaded by the gateway's certificate watcher.
    certs: Option<crate::endpoints::DataplaneCerts>,
    reserve: ReserveBy,
    token_ids: TokenIds,
}

impl PoolKeys for Keys {
    type Checked = Checked;

    fn check(&self, cx: &CheckContext<'_>) -> Result<Checked, KeyError> {
        if self.dataplane.is_empty() {
            return Err(cx.err("dataplane", "list one data-plane address per rank"));
        }
        let tp = u32::try_from(self.dataplane.len()).map_err(|_| cx.err("dataplane", "too many ranks"))?;
        let geometry = cx.geometry(tp)?;
        let tls = match &self.dataplane_tls {
            Some(t) => Some(
                t.load(format!("dataplane:{}", cx.field), cx.path)
                    .map_err(|e| cx.err("dataplane_tls", e.to_string()))?,
            ),
            None => None,
        };
        // A rank's port lets whoever reaches it reserve every page, cancel requests and write into
        // their KV (docs/dataplane.md, "Who may talk to a rank"): off loopback it needs TLS, or
        // the operator's word that the network is trusted.
        let plain = tls.is_none() && !cx.dataplane_tls_default && !self.dataplane_plaintext;
        if let Some(open) = self.dataplane.iter().find(|r| plain && !r.host.is_loopback()) {
            return Err(cx.err(
                "dataplane",
                format!(
                    "rank {open} is not on loopback (a name other than localhost may be anywhere) and its data \
                     plane would be plain TCP, which lets anyone who \
                     reaches it reserve every page, cancel requests and write into their KV: give the pool \
                     mTLS ([decode.dataplane_tls], or [dataplane_tls] for every pool), or set \
                     dataplane_plaintext = true on a network you trust"
                ),
            ));
        }
        Ok(Checked {
            ranks: self.dataplane.clone(),
            geometry,
            max_slots: cx.max_slots(self.max_slots)?,
            tls,
            reserve: self.reserve,
            token_ids: self.token_ids,
        })
    }
}

impl ModeSpec for Native {
    const NAME: &'static str = "native";
    const SHARING: super::Sharing = super::Sharing::Engine;
    type Keys = Keys;

    fn describe(c: &Checked) -> String {
        format!(
            "TP {}, {} KV bytes per token, page {} bytes per rank{}{}{}",
            c.ranks.len(),
            c.geometry.kv_bytes_per_token(),
            c.geometry.page_bytes_per_rank(),
            c.max_slots.map_or(String::new(), |m| format!(", at most {m} slots")),
            if c.reserve == ReserveBy::Prefiller { ", pages reserved by the prefillers" } else { "" },
            if c.token_ids == TokenIds::Base64 { ", token ids in base64" } else { "" }
        )
    }

    fn names(c: &Checked) -> Vec<(String, &Host)> {
        c.ranks.iter().enumerate().map(|(r, hp)| (format!("dataplane[{r}]"), &hp.host)).collect()
    }

    async fn start(c: Checked, pool: Pool<'_>, ctx: &StartContext) -> Result<Box<dyn Handoff>, StartError> {
        let native = Native::connect(pool.name.to_owned(), c, ctx, pool.queue)
            .await
            .map_err(|source| StartError::DataPlane { decoder: pool.name.to_owned(), source })?;
        Ok(Box::new(native))
    }

    #[cfg(feature = "demo")]
    fn demo(d: &super::DemoDecoder<'_>) -> Checked {
        let addr = |r: &Value| r["addr"].as_str()?.parse::<std::net::SocketAddr>().ok();
        let ranks = d.stats["ranks"].as_array().map(|a| a.iter().filter_map(addr).collect::<Vec<_>>());
        Checked {
            ranks: ranks.unwrap_or_default().into_iter().map(HostPort::from).collect(),
            geometry: d.geometry,
            max_slots: None,
            tls: None,
            reserve: if d.gateway_reserves { ReserveBy::Gateway } else { ReserveBy::Prefiller },
            token_ids: if d.json_token_ids { TokenIds::Json } else { TokenIds::Base64 },
        }
    }
}

impl Native {
    /// Connects to every rank; `queue` is sized from the pages they report (lowered to
    /// `max_slots`).
    pub async fn connect(
        name: String,
        c: Checked,
        ctx: &StartContext,
        queue: &SlotQueue,
    ) -> Result<Self, baton_dataplane::transport::TransportError> {
        let certs = c.tls.or_else(|| ctx.dataplane_tls.clone());
        let links = RankLinks {
            addrs: c.ranks,
            fingerprint: c.geometry.fingerprint(),
            tls: certs.as_ref().map(|c| c.client.clone()),
            names: ctx.shared.client.names().clone(),
        };
        let ranks = Ranks::connect(name, links, c.geometry.chunk_tokens, c.max_slots, queue.clone()).await?;
        Ok(Self {
            shared: Arc::clone(&ctx.shared),
            ranks: Arc::new(ranks),
            certs,
            reserve: c.reserve,
            token_ids: c.token_ids,
        })
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
        let mut backoff = Backoff::new(RESERVE_BACKOFF, RESERVE_BACKOFF_MAX);
        life.rx = Some(self.ranks.listen(life.key));
        // Marked before the call: a client that leaves while a Reserve frame is in flight must still
        // cancel it (cancel is idempotent), or the pages would wait out the whole lease.
        life.reserved = true;
        loop {
            let asked = Instant::now();
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
                    backoff.wait().await;
                }
                Ok(None) => {
                    self.shared.metrics.reservation_refused(&dec.name, false);
                    *refusals += 1;
                    return Err(GatewayError::QueueTimeout(Waited::Pages { decoder: dec.name.clone() }));
                }
                Err(e) => {
                    self.shared.failed(dec, asked);
                    return Err(GatewayError::Upstream { leg: "decoder data plane", message: e.to_string() });
                }
            }
        }
    }

    /// The expiry a rank has already reported for this request, if one has: counted, as the error
    /// the client gets.
    fn expired(&self, dec: &Decoder, life: &mut Lifecycle) -> Option<GatewayError> {
        loop {
            let event = life.rx.as_mut()?.try_recv().ok()?;
            if let Some(e) = self.expiry(dec, life, event) {
                return Some(e);
            }
        }
    }

    /// [`Native::expired`], waiting up to `wait` for a rank's status to arrive.
    async fn expired_within(
        &self,
        dec: &Decoder,
        life: &mut Lifecycle,
        wait: Duration,
    ) -> Option<GatewayError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let event = match tokio::time::timeout_at(deadline, life.rx.as_mut()?.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) | Err(_) => return self.expired(dec, life),
            };
            if let Some(e) = self.expiry(dec, life, event) {
                return Some(e);
            }
        }
    }

    /// One event of the request's feed: its expiry as the client's error (counted), if it is one.
    fn expiry(&self, dec: &Decoder, life: &mut Lifecycle, event: RankEvent) -> Option<GatewayError> {
        match event {
            RankEvent::Status(s) if s.state == baton_dataplane::events::TerminalState::Expired => {
                self.shared.metrics.lease_expired(&dec.name);
                Some(GatewayError::KvTransfer(KvFailure::RankFailed {
                    rank: s.rank,
                    state: s.state.as_str(),
                }))
            }
            RankEvent::Released(r) => {
                life.seen.released(r.rank);
                None
            }
            RankEvent::Status(s) => {
                life.seen.reported(s.rank);
                None
            }
        }
    }

    /// The ranks whose READY for this request is on its feed now (the rest of the feed's events
    /// are taken as [`Native::expired`] would).
    fn ready_seen(&self, life: &mut Lifecycle) -> u32 {
        let mut ready = 0;
        while let Some(event) = life.rx.as_mut().and_then(|rx| rx.try_recv().ok()) {
            match event {
                RankEvent::Status(s) => {
                    life.seen.reported(s.rank);
                    if s.state == baton_dataplane::events::TerminalState::Ready {
                        ready += 1;
                    }
                }
                RankEvent::Released(r) => life.seen.released(r.rank),
            }
        }
        ready
    }

    /// Waits until every rank holds the whole KV (or one fails, or the deadline passes).
    async fn wait_ready(&self, dec: &Decoder, life: &mut Lifecycle) -> Result<(), GatewayError> {
        let ready_timeout = self.shared.limits.ready_timeout;
        let deadline = Instant::now() + ready_timeout;
        let mut agg = Aggregator::new(life.key, self.ranks.rank_count(), deadline)
            .map_err(|e| GatewayError::Internal(Internal::Readiness(e.to_string())))?;
        let outcome = loop {
            let Some(rx) = life.rx.as_mut() else {
                return Err(GatewayError::Internal(Internal::Unsubscribed));
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, rx.recv()).await {
                Ok(Some(RankEvent::Status(s))) => {
                    life.seen.reported(s.rank);
                    match agg.observe(&s, Instant::now()) {
                        Ok(Progress::Done(o)) => break o,
                        Ok(Progress::Pending { .. }) | Err(_) => {}
                    }
                }
                Ok(Some(RankEvent::Released(r))) => life.seen.released(r.rank),
                Ok(None) => return Err(GatewayError::KvTransfer(KvFailure::FeedClosed)),
                Err(_) => break agg.poll(Instant::now()).unwrap_or(Outcome::TimedOut { missing: 0 }),
            }
        };
        match outcome {
            Outcome::Ready => Ok(()),
            Outcome::Failed { rank, state } => {
                if state == baton_dataplane::events::TerminalState::Expired {
                    self.shared.metrics.lease_expired(&dec.name);
                }
                Err(GatewayError::KvTransfer(KvFailure::RankFailed { rank, state: state.as_str() }))
            }
            Outcome::TimedOut { missing } => {
                Err(GatewayError::KvTransfer(KvFailure::RanksLate { missing, within: ready_timeout }))
            }
        }
    }

    async fn exchange(&self, leg: Leg<'_>) -> Result<Response<RespBody>, GatewayError> {
        let Leg { dec, prefills, req, ids, slots, timing, work, retried, .. } = leg;
        let alone = work.is_none();
        let shared = &*self.shared;
        if alone {
            return self.alone(dec, req, ids, slots, timing).await;
        }
        let chunks = self.ranks.slots_for(ids.len());
        let by_prefiller = self.reserve == ReserveBy::Prefiller;
        let mut life = Lifecycle {
            shared: Arc::clone(&self.shared),
            ranks: Arc::clone(&self.ranks),
            key: shared.keys.next(),
            slots,
            rx: None,
            reserved: false,
            by_prefiller,
            sent: false,
            decoded: false,
            seen: Seen::new(self.ranks.rank_count()),
            release_timeout: shared.limits.release_timeout,
        };
        let ids = self.token_ids.write(ids)?;
        let mut work = work;
        if by_prefiller {
            return self
                .reserved_by_prefiller(dec, prefills, req, &ids, chunks, life, timing, work, retried)
                .await;
        }
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
        let targets: Vec<DecoderTarget> = addrs
            .iter()
            .enumerate()
            // Each rank's address the pages were reserved at: a named rank that moved since is
            // not where these pages are.
            .filter_map(|(r, (addr, a))| Some(DecoderTarget::new(u32::try_from(r).ok()?, *addr, a)))
            .collect();
        let p = params(life.key, &targets, &ids);
        let body =
            Patched::new(&req.raw, &["stream_options"]).flag("stream", false).with(contract::FIELD, &p);
        match self.attempt(dec, prefills, req, &ids, body, &mut life, timing, &mut work, retried).await? {
            Attempt::Answered(resp) => Ok(resp),
            // Never: only a prefiller asked to reserve is heard saying it could not.
            Attempt::Busy => Err(GatewayError::Upstream {
                leg: "prefill",
                message: "a decoder rank without room for pages the gateway had reserved".into(),
            }),
        }
    }

    /// `reserve = "prefiller"`: no round trip to the ranks before the prefill. The prefill carries
    /// the order to reserve (the contract's `reserve`), and the prefiller's Reserve leaves with its
    /// chunks on each rank. A rank without room makes the prefiller answer 507: the attempt is
    /// cancelled on every rank and retried as a new epoch (as a refused gateway reservation is),
    /// until the queue timeout. The lifecycle cancels on every path; its release wait counts only
    /// the ranks that say they held the request.
    #[allow(clippy::too_many_arguments)]
    async fn reserved_by_prefiller(
        &self,
        dec: &Decoder,
        prefills: &[&crate::handoff::shared::Prefiller],
        req: &GenRequest,
        ids: &Json,
        chunks: u32,
        mut life: Lifecycle,
        timing: &mut Timing,
        mut work: Option<crate::routing::Work>,
        retried: &Arc<std::sync::atomic::AtomicU32>,
    ) -> Result<Response<RespBody>, GatewayError> {
        let limits = &self.shared.limits;
        let give_up = Instant::now() + limits.queue_timeout;
        let mut backoff = Backoff::new(RESERVE_BACKOFF, RESERVE_BACKOFF_MAX);
        let order = contract::ReserveOrder {
            chunks,
            lease_ms: u32::try_from(limits.lease.as_millis()).unwrap_or(u32::MAX).max(1),
        };
        let mut refusals = 0u32;
        // From here a prefill may reserve: whatever ends the request cancels (cancel is idempotent).
        life.reserved = true;
        timing.enter(Phase::Prefill);
        let outcome = loop {
            life.rx = Some(self.ranks.listen(life.key));
            let targets = self.ranks.targets();
            let mut p = params(life.key, &targets, ids);
            p.reserve = Some(order);
            let body =
                Patched::new(&req.raw, &["stream_options"]).flag("stream", false).with(contract::FIELD, &p);
            match self.attempt(dec, prefills, req, ids, body, &mut life, timing, &mut work, retried).await {
                Ok(Attempt::Busy) => {
                    refusals += 1;
                    let retry = Instant::now() < give_up;
                    self.shared.metrics.reservation_refused(&dec.name, retry);
                    if !retry {
                        // The lifecycle cancels this attempt as it drops.
                        break Err(GatewayError::QueueTimeout(Waited::Pages { decoder: dec.name.clone() }));
                    }
                    // What the ranks with room reserved goes back (quarantined until the
                    // prefiller fences, as it does after a failure); the next attempt is a new
                    // epoch, so nothing said of this one can reach it.
                    self.ranks.cancel_held(life.key, false).await;
                    self.ranks.forget(life.key);
                    life.key = RequestKey::new(life.key.request, life.key.epoch.wrapping_add(1));
                    (life.sent, life.seen) = (false, Seen::new(self.ranks.rank_count()));
                    backoff.wait().await;
                }
                Ok(Attempt::Answered(resp)) => break Ok(resp),
                Err(e) => break Err(e),
            }
        };
        let ranks = self.ranks.rank_count();
        let ok = outcome.is_ok();
        timing.note("reservation", move || {
            json!({"by": "prefiller", "pages_per_rank": chunks, "ranks": ranks, "refusals": refusals, "reserved": ok})
        });
        drop(life);
        outcome
    }

    /// One attempt of the legs once the prefill's body is written: the prefill and the decode at
    /// once for decoders that wait for the KV themselves, else prefill, every rank's READY, then
    /// decode. `life` is left to the caller to drop (it cancels unless the decoder took the KV).
    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        dec: &Decoder,
        prefills: &[&crate::handoff::shared::Prefiller],
        req: &GenRequest,
        ids: &Json,
        body: Patched<'_, Params<'_>>,
        life: &mut Lifecycle,
        timing: &mut Timing,
        work: &mut Option<crate::routing::Work>,
        retried: &Arc<std::sync::atomic::AtomicU32>,
    ) -> Result<Attempt, GatewayError> {
        if self.ranks.decode_waits() {
            return self.overlapped(dec, prefills, req, ids, body, life, timing, work, retried).await;
        }
        let prefilled = self.prefill(prefills, req.endpoint.path(), &body, &mut life.sent, retried).await;
        match prefilled {
            Ok(Prefilled::Busy) => return Ok(Attempt::Busy),
            Ok(Prefilled::Done) => drop(work.take()),
            // A prefill that failed because a rank's lease ran out (its writes refused as stale)
            // is that expiry: said as the rank said it, and counted.
            Err(e) => return Err(self.expired(dec, life).unwrap_or(e)),
        }
        timing.mark(Phase::Prefill);
        timing.enter(Phase::KvReady);

        self.wait_ready(dec, life).await?;
        timing.mark(Phase::KvReady);
        timing.enter(Phase::Decode);

        // Decode, streamed straight back.
        let p = params(life.key, &[], ids);
        let body = Patched::new(&req.raw, &[]).with(contract::FIELD, &p);
        let resp = self.shared.call("decode", dec, req.endpoint.path(), &body).await?;
        life.decoded = true;
        timing.mark(Phase::Decode);
        Ok(Attempt::Answered(resp.map(boxed)))
    }

    /// The prefill leg: the first prefiller, then the fallbacks while a prefiller cannot be
    /// connected to (one that never saw the addresses leaves the pages free at once, no
    /// quarantine). Its own answer (one token) is not used; it is read so the connection is
    /// reused. `sent`: the addresses may have reached a prefiller. With `reserve = "prefiller"`,
    /// its 507 is a decoder rank without room ([`Prefilled::Busy`]), not the prefiller's failure.
    async fn prefill(
        &self,
        prefills: &[&crate::handoff::shared::Prefiller],
        path: &'static str,
        body: &Patched<'_, Params<'_>>,
        sent: &mut bool,
        retried: &Arc<std::sync::atomic::AtomicU32>,
    ) -> Result<Prefilled, GatewayError> {
        let shared = &*self.shared;
        let (prefill, resp, in_flight) =
            shared.prefill(prefills, path, body, sent, false, Retrying { answered: false, retried }).await?;
        if self.reserve == ReserveBy::Prefiller && resp.status().as_u16() == contract::KV_BUSY_STATUS {
            // Read so the connection is reused; neither a success nor a failure of the prefiller.
            let _ = resp.into_body().collect().await;
            drop(in_flight);
            return Ok(Prefilled::Busy);
        }
        let answered = shared.answer("prefill", prefill, resp, in_flight.since()).await;
        drop(in_flight);
        answered.map(|_| Prefilled::Done).map_err(GatewayError::from)
    }

    /// The prefill and the decode at once, for a decoder whose engine waits for the KV itself: the
    /// decode request (with `kv_wait_ms`) goes out with the prefill, and the decoder answers once
    /// its ranks hold the whole KV, with no READY round trip through the gateway and no decode
    /// request after it. Every guard stays: the pages are reserved first (or by the prefiller, with
    /// its writes), a failed prefill cancels them (which ends the decoder's wait at once), the
    /// decoder's wait has the gateway's readiness deadline, and the slots go back only when every
    /// rank has released.
    #[allow(clippy::too_many_arguments)]
    async fn overlapped(
        &self,
        dec: &Decoder,
        prefills: &[&crate::handoff::shared::Prefiller],
        req: &GenRequest,
        ids: &Json,
        body: Patched<'_, Params<'_>>,
        life: &mut Lifecycle,
        timing: &mut Timing,
        work: &mut Option<crate::routing::Work>,
        retried: &Arc<std::sync::atomic::AtomicU32>,
    ) -> Result<Attempt, GatewayError> {
        let shared = &*self.shared;
        let ready_timeout = shared.limits.ready_timeout;
        // The decoder's own bound, a backstop for a gateway that vanished: the prefill's time and
        // then the readiness deadline, which the gateway itself holds the decoder to once the
        // prefill has answered.
        let backstop = shared.limits.upstream_timeout + ready_timeout;
        let mut p = params(life.key, &[], ids);
        p.kv_wait_ms = Some(u32::try_from(backstop.as_millis()).unwrap_or(u32::MAX).max(1));
        let decode_body = Patched::new(&req.raw, &[]).with(contract::FIELD, &p);
        let path = req.endpoint.path();
        enum Ended {
            Decoded(Response<crate::endpoints::EngineBody>),
            PrefillFailed(GatewayError),
            DecodeFailed(LegError),
            /// The prefiller's reservation found no room on a rank.
            Busy,
            /// The prefill answered and the decoder did not within the readiness deadline.
            Late,
        }
        let ended = {
            let sent = &mut life.sent;
            let prefill = self.prefill(prefills, path, &body, sent, retried);
            let decode = async {
                let decode_sent = Instant::now();
                match shared.post_within(dec.peer().http, "decode", path, &decode_body, backstop, false).await
                {
                    // The decoder's word on the KV it waited for: the transfer's failure, not the
                    // decoder's, so it does not count against its health.
                    Ok(resp) if matches!(resp.status().as_u16(), 409 | 410 | 504) => {
                        let status = resp.status().as_u16();
                        let body = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                        Err(LegError::Refused { leg: "decode", status, body })
                    }
                    Ok(resp) => shared.accept("decode", dec, resp, decode_sent).await,
                    Err(source) => {
                        shared.failed(dec, decode_sent);
                        Err(LegError::Unanswered { leg: "decode", source })
                    }
                }
            };
            tokio::pin!(prefill, decode);
            let late = tokio::time::sleep(backstop);
            tokio::pin!(late);
            let mut prefilled = false;
            loop {
                tokio::select! {
                    r = &mut prefill, if !prefilled => match r {
                        Ok(Prefilled::Done) => {
                            prefilled = true;
                            // Its pending tokens leave the prefiller's load as it answers.
                            drop(work.take());
                            late.as_mut().reset(tokio::time::Instant::now() + ready_timeout);
                            timing.mark(Phase::Prefill);
                            timing.enter(Phase::KvReady);
                        }
                        // The decode request is dropped with this attempt; the cancel that
                        // follows would end its wait anyway.
                        Ok(Prefilled::Busy) => break Ended::Busy,
                        Err(e) => break Ended::PrefillFailed(e),
                    },
                    r = &mut decode => match r {
                        Ok(resp) => {
                            if !prefilled {
                                // The decoder holds the KV, so the prefill wrote all of it: its
                                // answer is due now, and read (within a bound) so its connection
                                // is reused.
                                match tokio::time::timeout(PREFILL_AFTER_DECODE, prefill).await {
                                    Ok(Ok(_)) => {}
                                    Ok(Err(e)) => tracing::warn!(error = %e, "the prefill failed after the decoder took its kv"),
                                    Err(_) => tracing::warn!("the prefill did not answer within {PREFILL_AFTER_DECODE:?} of the decoder taking its kv"),
                                }
                                timing.mark(Phase::Prefill);
                            }
                            // From the prefill's answer to the decoder's: the KV's last leg as
                            // the gateway sees it.
                            timing.mark(Phase::KvReady);
                            timing.enter(Phase::Decode);
                            break Ended::Decoded(resp);
                        }
                        // The decoder's word that the KV will not come, before the prefill's
                        // answer, when the prefiller reserves: a rank without room ends the
                        // decoder's wait by the prefiller's fence, and the prefill's 507 says so.
                        // It is read first, within a bound, so the attempt is retried, not failed.
                        Err(e @ LegError::Refused { status: 409 | 410 | 504, .. })
                            if !prefilled && self.reserve == ReserveBy::Prefiller =>
                        {
                            match tokio::time::timeout(PREFILL_AFTER_DECODE, &mut prefill).await {
                                Ok(Ok(Prefilled::Busy)) => break Ended::Busy,
                                _ => break Ended::DecodeFailed(e),
                            }
                        }
                        Err(e) => break Ended::DecodeFailed(e),
                    },
                    () = &mut late => break Ended::Late,
                }
            }
        };
        match ended {
            Ended::Decoded(resp) => {
                drop(work.take());
                life.decoded = true;
                timing.mark(Phase::Decode);
                Ok(Attempt::Answered(resp.map(boxed)))
            }
            Ended::Busy => Ok(Attempt::Busy),
            // A prefill that failed because a rank's lease ran out is that expiry. Dropping the
            // lifecycle cancels the pages, which ends the decoder's wait.
            Ended::PrefillFailed(e) => Err(self.expired(dec, life).unwrap_or(e)),
            Ended::Late => {
                // Dropping the lifecycle cancels the pages, which ends the decoder's wait.
                if let Some(expired) = self.expired(dec, life) {
                    return Err(expired);
                }
                let ready = self.ready_seen(life);
                Err(GatewayError::KvTransfer(KvFailure::RanksLate {
                    missing: self.ranks.rank_count().saturating_sub(ready),
                    within: ready_timeout,
                }))
            }
            Ended::DecodeFailed(e) => {
                // A decoder that gave up on a request its rank expired: the expiry, as the rank
                // reported it on the feed (which may come a moment after the decoder's answer).
                let closed = matches!(e, LegError::Refused { status: 410, .. });
                let wait = if closed { STATUS_AFTER_ANSWER } else { Duration::ZERO };
                if let Some(expired) = self.expired_within(dec, life, wait).await {
                    return Err(expired);
                }
                Err(match e {
                    // The decoder's own word on the KV it waited for (409, 410, 504): a transfer
                    // failure, not a refusal of the client's request.
                    LegError::Refused { status: status @ (409 | 410 | 504), body, .. } => {
                        GatewayError::KvTransfer(KvFailure::DecoderWait {
                            status,
                            message: crate::handoff::legs::short_body(&body),
                        })
                    }
                    other => other.into(),
                })
            }
        }
    }
}
impl Native {
    /// The decoder holds nearly all of the prompt: no reservation, no prefill; the decode request
    /// says `local_prefill`, and the engine computes what it lacks from its own cache. Native slots
    /// are PD-buffer pages, of which this request takes none: they go back at once.
    async fn alone(
        &self,
        dec: &Decoder,
        req: &GenRequest,
        ids: &[u32],
        slots: Option<SlotGuard>,
        timing: &mut Timing,
    ) -> Result<Response<RespBody>, GatewayError> {
        timing.enter(Phase::Decode);
        let ids = self.token_ids.write(ids)?;
        let mut p = params(self.shared.keys.next(), &[], &ids);
        p.local_prefill = true;
        let body = Patched::new(&req.raw, &[]).with(contract::FIELD, &p);
        let resp = self.shared.call("decode", dec, req.endpoint.path(), &body).await?;
        timing.mark(Phase::Decode);
        drop(slots);
        Ok(resp.map(boxed))
    }
}

/// The `baton` field of an engine request, written as [`BatonParams`] is, the prompt's ids given as
/// JSON (an array or a base64 string, [`TokenIds`]) written once per request: both legs' bodies
/// copy the text (writing 1,024 ids as JSON for each leg was 6% of the gateway's CPU on a native
/// request in the proxy benchmark's profile).
struct Params<'a> {
    request_id: String,
    epoch: u32,
    decoders: &'a [DecoderTarget],
    prompt_token_ids: &'a Json,
    local_prefill: bool,
    kv_wait_ms: Option<u32>,
    reserve: Option<contract::ReserveOrder>,
}

/// Written as the contract's `BatonParams` is (its fields in its order, the same left out when
/// empty), by hand: the ids' text goes in as it is (serde_json writes raw text only from a
/// `RawValue`, which it makes only by parsing the text again: 3k instructions a request for
/// base64 ids), and the field names need no escaping.
impl WriteJson for Params<'_> {
    fn write_json(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        let mut n = itoa::Buffer::new();
        out.extend_from_slice(b"{\"request_id\":");
        write_str(out, &self.request_id)?;
        out.extend_from_slice(b",\"epoch\":");
        out.extend_from_slice(n.format(self.epoch).as_bytes());
        if !self.decoders.is_empty() {
            out.extend_from_slice(b",\"decoders\":");
            serde_json::to_writer(&mut *out, self.decoders)?;
        }
        out.extend_from_slice(b",\"prompt_token_ids\":");
        out.extend_from_slice(self.prompt_token_ids.get().as_bytes());
        if self.local_prefill {
            out.extend_from_slice(b",\"local_prefill\":true");
        }
        if let Some(ms) = self.kv_wait_ms {
            out.extend_from_slice(b",\"kv_wait_ms\":");
            out.extend_from_slice(n.format(ms).as_bytes());
        }
        if let Some(r) = &self.reserve {
            out.extend_from_slice(b",\"reserve\":");
            serde_json::to_writer(&mut *out, r)?;
        }
        out.push(b'}');
        Ok(())
    }
}

/// [`Params`] for `key`, its ids (`ids`: as the pool writes them, [`TokenIds::write`]).
fn params<'a>(key: RequestKey, decoders: &'a [DecoderTarget], ids: &'a Json) -> Params<'a> {
    Params {
        request_id: hex_name("", key.request.0),
        epoch: key.epoch,
        decoders,
        prompt_token_ids: ids,
        local_prefill: false,
        kv_wait_ms: None,
        reserve: None,
    }
}

impl Handoff for Native {
    /// A decode engine given `local_prefill` computes the prompt from its own cache (the contract,
    /// `baton_dataplane::contract`; baton-sim and the Python reference engine do).
    fn serves_alone(&self) -> bool {
        true
    }

    fn slots_for(&self, prompt_tokens: usize) -> u32 {
        self.ranks.slots_for(prompt_tokens)
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

    fn dataplane_certs(&self) -> Option<&crate::endpoints::DataplaneCerts> {
        self.certs.as_ref()
    }
}

/// What a request holds; released in `Drop`, on every path.
struct Lifecycle {
    shared: Arc<Shared>,
    ranks: Arc<Ranks>,
    key: RequestKey,
    slots: Option<SlotGuard>,
    rx: Option<mpsc::UnboundedReceiver<RankEvent>>,
    reserved: bool,
    /// The prefiller reserves (`reserve = "prefiller"`): a rank may hold nothing of the request.
    by_prefiller: bool,
    sent: bool,
    /// Set once the decoder took the request: no cancel, only wait for the release.
    decoded: bool,
    /// What the ranks have said of the request on their feeds.
    seen: Seen,
    release_timeout: Duration,
}

/// Which ranks have said anything of a request on their feeds, and which have released it.
#[derive(Clone, Debug)]
struct Seen {
    reported: Vec<bool>,
    released: Vec<bool>,
}

impl Seen {
    fn new(ranks: u32) -> Self {
        Self { reported: vec![false; ranks as usize], released: vec![false; ranks as usize] }
    }

    fn reported(&mut self, rank: u32) {
        if let Some(r) = self.reported.get_mut(rank as usize) {
            *r = true;
        }
    }

    fn released(&mut self, rank: u32) {
        self.reported(rank);
        if let Some(r) = self.released.get_mut(rank as usize) {
            *r = true;
        }
    }

    fn note(&mut self, event: &RankEvent) {
        match event {
            RankEvent::Status(s) => self.reported(s.rank),
            RankEvent::Released(r) => self.released(r.rank),
        }
    }

    /// Notes the events already queued on `rx` (never waiting for more): whether every rank has
    /// released the request now. With no feed (`None`), there is nothing to wait for.
    fn caught_up(&mut self, rx: Option<&mut mpsc::UnboundedReceiver<RankEvent>>) -> bool {
        let Some(rx) = rx else { return true };
        while let Ok(e) = rx.try_recv() {
            self.note(&e);
        }
        // `due` empty: every rank's release is due.
        self.all_released(&[])
    }

    /// Whether every rank in `due` (and every rank that reported the request: it held it) has
    /// released it.
    fn all_released(&self, due: &[bool]) -> bool {
        (0..self.released.len()).all(|r| {
            let owed = due.get(r).copied().unwrap_or(true) || self.reported.get(r).copied().unwrap_or(false);
            !owed || self.released.get(r).copied().unwrap_or(false)
        })
    }
}

impl Drop for Lifecycle {
    fn drop(&mut self) {
        let (key, mut rx) = (self.key, self.rx.take());
        let (reserved, by_prefiller, sent, decoded, bound) =
            (self.reserved, self.by_prefiller, self.sent, self.decoded, self.release_timeout);
        if !reserved || decoded {
            // Nothing to cancel. Every rank's release may be here already (a decoder that took the
            // KV may free the pages before its answer comes): then it all ends now, with no task
            // to wait for them.
            if self.seen.caught_up(rx.as_mut()) {
                self.ranks.forget(key);
                drop(self.slots.take());
                return;
            }
        }
        let dec = Arc::clone(&self.ranks);
        let slots = self.slots.take();
        let mut seen = std::mem::replace(&mut self.seen, Seen::new(0));
        self.shared.spawn_from_drop(async move {
            // The ranks whose release is due: every one once the decoder took the KV.
            let ranks = dec.rank_count() as usize;
            let mut due = vec![true; ranks];
            if reserved && !decoded {
                if by_prefiller {
                    // The ranks the prefiller's Reserve reached: those that still hold the
                    // request, and those that reported it (one the decoder took, say, before it
                    // gave up on another rank).
                    due = dec.cancel_held(key, !sent).await;
                } else {
                    dec.cancel(key, !sent).await;
                    // Never sent: the rank freed the pages before answering the cancel, so
                    // there is nothing to wait for.
                    if !sent {
                        due = vec![false; ranks];
                    }
                }
            }
            if let Some(mut rx) = rx {
                let deadline = tokio::time::Instant::now() + bound;
                while !seen.all_released(&due) {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(e)) => seen.note(&e),
                        _ => break,
                    }
                }
            }
            dec.forget(key);
            // The slots go back only now: the decoder has freed the pages (or its lease will).
            drop(slots);
        });
    }
}

#[cfg(test)]
mod tests {
    use baton_dataplane::contract::BatonParams;
    use baton_dataplane::ids::{PageAddr, RequestId};

    use super::*;

    /// What the gateway writes is what the contract's own type writes (and reads back), for a
    /// prefill (with its decoders), a waiting decode and a decode computed alone.
    #[test]
    fn params_are_written_as_the_contract_writes_them() {
        let key = RequestKey::new(RequestId(0xabc_def0_1234), 3);
        let ids = [1u32, 0, 151_643, u32::MAX];
        let raw = TokenIds::Json.write(&ids).unwrap_or_else(|e| panic_any(e));
        let target = DecoderTarget::new(
            1,
            "127.0.0.1:9000".parse().unwrap_or_else(|e| panic_any(e)),
            &[(0, PageAddr { page: 5, generation: 2 }), (1, PageAddr { page: 9, generation: 1 })],
        );
        // Byte for byte: the fields in the contract's order, the same ones left out.
        let written = |p: &Params<'_>| {
            let mut out = Vec::new();
            p.write_json(&mut out).unwrap_or_else(|e| panic_any(e));
            String::from_utf8(out).unwrap_or_else(|e| panic_any(e))
        };
        let contract = |p: &BatonParams| serde_json::to_string(p).unwrap_or_else(|e| panic_any(e));

        let targets = [target.clone()];
        let mut want = BatonParams::new(key, vec![target.clone()], Some(ids.to_vec()));
        // A field added to the contract breaks this until `Params` writes it too.
        let BatonParams {
            request_id: _,
            epoch: _,
            decoders: _,
            prompt_token_ids: _,
            local_prefill: _,
            kv_wait_ms: _,
            reserve: _,
        } = &want;
        assert_eq!(written(&params(key, &targets, &raw)), contract(&want));

        // A prefill whose prefiller reserves: its decoders without pages, and the order.
        let order = contract::ReserveOrder { chunks: 2, lease_ms: 30_000 };
        let bare = [DecoderTarget { rank: 1, addr: target.addr, chunks: Vec::new() }];
        let mut own = BatonParams::new(key, bare.to_vec(), Some(ids.to_vec()));
        own.reserve = Some(order);
        let mut p = params(key, &bare, &raw);
        p.reserve = Some(order);
        assert_eq!(written(&p), contract(&own));

        want.decoders.clear();
        want.kv_wait_ms = Some(330_000);
        let mut p = params(key, &[], &raw);
        p.kv_wait_ms = Some(330_000);
        assert_eq!(written(&p), contract(&want));

        want.kv_wait_ms = None;
        want.local_prefill = true;
        let mut p = params(key, &[], &raw);
        p.local_prefill = true;
        let text = written(&p);
        assert_eq!(text, contract(&want));
        let back: BatonParams = serde_json::from_str(&text).unwrap_or_else(|e| panic_any(e));
        assert_eq!(back.key().ok(), Some(key));
        assert_eq!(back.prompt_token_ids.as_deref(), Some(&ids[..]));

        // `token_ids = "base64"`: the same params, the ids as their string in the array's place;
        // the contract reads them back as the same ids.
        let b64 = TokenIds::Base64.write(&ids).unwrap_or_else(|e| panic_any(e));
        assert_eq!(raw.get(), serde_json::to_string(&ids).unwrap_or_default());
        assert_eq!(TokenIds::Json.write(&[]).unwrap_or_else(|e| panic_any(e)).get(), "[]");
        assert_eq!(b64.get(), format!("{:?}", contract::ids_base64(&ids)));
        let text = written(&params(key, &targets, &b64));
        let plain = BatonParams::new(key, vec![target], Some(ids.to_vec()));
        let mut v = serde_json::to_value(&plain).unwrap_or_else(|e| panic_any(e));
        v["prompt_token_ids"] = contract::ids_base64(&ids).into();
        assert_eq!(text, v.to_string());
        let back: BatonParams = serde_json::from_str(&text).unwrap_or_else(|e| panic_any(e));
        assert_eq!(back, plain);
    }

    /// The release wait when the prefiller reserved: a rank whose cancel found nothing is still
    /// owed a release when it reported the request (the decoder took its KV, then failed on another
    /// rank), and one that never heard of it is not.
    #[test]
    fn the_release_wait_counts_every_rank_that_held_the_request() {
        use baton_dataplane::events::{PagesReleased, RankStatus, ReleaseReason, TerminalState};
        let key = RequestKey::new(RequestId(7), 0);
        let ready = |rank| {
            RankEvent::Status(RankStatus {
                request: key.request,
                epoch: key.epoch,
                rank,
                state: TerminalState::Ready,
                chunks: 2,
                bytes: 0,
            })
        };
        let released = |rank| {
            RankEvent::Released(PagesReleased { key, rank, pages: 2, reason: ReleaseReason::Consumed })
        };
        // Rank 0 was taken by the decoder (its READY seen), rank 1 still held when cancelled.
        let mut seen = Seen::new(3);
        seen.note(&ready(0));
        let due = [false, true, false];
        assert!(!seen.all_released(&due));
        seen.note(&released(1));
        assert!(!seen.all_released(&due), "rank 0 reported the request: its release is owed too");
        seen.note(&released(0));
        assert!(seen.all_released(&due), "rank 2 never heard of it");
        // Nothing held anywhere and nothing reported: nothing to wait for.
        assert!(Seen::new(2).all_released(&[false, false]));
        // The gateway reserved (or the decoder took every rank): every rank is owed.
        let mut seen = Seen::new(2);
        seen.note(&released(1));
        assert!(!seen.all_released(&[true, true]));
        seen.note(&released(0));
        assert!(seen.all_released(&[true, true]));
    }

    /// The lifecycle's end without a task: only once every rank's release is queued, read without
    /// waiting; a READY alone, or one rank of two, leaves the wait to the task.
    #[test]
    fn a_lifecycle_ends_at_once_only_when_every_rank_released() {
        use baton_dataplane::events::{PagesReleased, RankStatus, ReleaseReason, TerminalState};
        let key = RequestKey::new(RequestId(9), 1);
        let released = |rank| {
            RankEvent::Released(PagesReleased { key, rank, pages: 1, reason: ReleaseReason::Consumed })
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut seen = Seen::new(2);
        assert!(!seen.caught_up(Some(&mut rx)), "nothing heard yet");
        tx.send(RankEvent::Status(RankStatus {
            request: key.request,
            epoch: key.epoch,
            rank: 0,
            state: TerminalState::Ready,
            chunks: 1,
            bytes: 0,
        }))
        .unwrap_or_else(|e| panic_any(e));
        tx.send(released(1)).unwrap_or_else(|e| panic_any(e));
        assert!(!seen.caught_up(Some(&mut rx)), "rank 0 is ready, not released");
        tx.send(released(0)).unwrap_or_else(|e| panic_any(e));
        assert!(seen.caught_up(Some(&mut rx)));
        // A feed closed with a rank's release missing: still not all released.
        let (tx, mut rx) = mpsc::unbounded_channel();
        tx.send(released(0)).unwrap_or_else(|e| panic_any(e));
        drop(tx);
        assert!(!Seen::new(2).caught_up(Some(&mut rx)));
        // No feed: nothing to wait for.
        assert!(Seen::new(2).caught_up(None));
    }

    #[allow(clippy::panic)]
    fn panic_any(e: impl std::fmt::Display) -> ! {
        panic!("{e}")
    }
}
