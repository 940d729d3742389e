//! A native decoder's ranks: their data-plane control connections, one event subscription per
//! rank routed to the requests waiting on them (reconnected when it breaks), and the decoder's
//! admission queue sized by the buffer the ranks report, at start and on every reconnect (never
//! typed by hand).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_dataplane::transport::{ControlClient, EventStream, TlsClient, TransportError};
use baton_dataplane::wire::RefusalCode;
use baton_dataplane::{PageAddr, PrefixKey, RankEvent, RequestKey};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::admission::SlotQueue;
use crate::endpoints::{Host, HostPort, Names};
use crate::handoff::shared::Backoff;

type Waiters = Arc<Mutex<HashMap<RequestKey, mpsc::UnboundedSender<RankEvent>>>>;

/// How to reach a decoder's ranks: their addresses in rank order, the geometry fingerprint they must
/// report, and the TLS (mTLS) to speak when the data plane is authenticated (`[dataplane_tls]`).
/// A rank given by name is looked up at each new connection (its current addresses, tried in
/// turn); a failed connection asks for the name to be looked up again.
#[derive(Clone, Debug)]
pub struct RankLinks {
    pub addrs: Vec<HostPort>,
    pub fingerprint: u64,
    pub tls: Option<TlsClient>,
    pub names: Names,
}

impl RankLinks {
    /// By IP, without TLS.
    pub fn plain(addrs: Vec<SocketAddr>, fingerprint: u64) -> Self {
        Self {
            addrs: addrs.into_iter().map(HostPort::from).collect(),
            fingerprint,
            tls: None,
            names: Names::default(),
        }
    }

    /// Connects with `f` to `at`'s addresses in turn until one answers.
    async fn first<T, F: Future<Output = Result<T, TransportError>>>(
        &self,
        at: &HostPort,
        f: impl Fn(SocketAddr) -> F,
    ) -> Result<T, TransportError> {
        let addrs = self.names.socket_addrs(at).await.map_err(|e| {
            TransportError::Io(std::io::Error::new(std::io::ErrorKind::NotFound, e.to_string()))
        })?;
        let mut last = TransportError::Closed;
        for a in addrs {
            match f(a).await {
                Ok(c) => return Ok(c),
                Err(e) => last = e,
            }
        }
        if let Host::Name(n) = &at.host {
            self.names.failed(n);
        }
        Err(last)
    }

    async fn control(&self, at: &HostPort, rank: u32) -> Result<ControlClient, TransportError> {
        self.first(at, |a| ControlClient::connect_with(a, self.tls.as_ref(), self.fingerprint, rank)).await
    }

    async fn events(&self, at: &HostPort, rank: u32) -> Result<EventStream, TransportError> {
        self.first(at, |a| EventStream::connect_with(a, self.tls.as_ref(), self.fingerprint, rank)).await
    }
}

/// The data-plane side of one native decoder: a control connection pool and an event feed per
/// rank.
pub struct Ranks {
    pub name: String,
    pub chunk_tokens: u32,
    links: RankLinks,
    controls: Vec<tokio::sync::Mutex<Vec<ControlClient>>>,
    /// Each rank's address as its newest control connection reached it: where a prefiller that
    /// reserves for itself is sent.
    peers: Vec<Mutex<SocketAddr>>,
    waiters: Waiters,
    /// Whether each rank's engine waits for a request's KV itself (its last Welcome).
    waits: Arc<Vec<std::sync::atomic::AtomicBool>>,
    _routers: JoinSet<()>,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ranks").field("name", &self.name).field("addrs", &self.links.addrs).finish()
    }
}

/// The decoder's slots: the smallest rank's buffer, lowered by `max_slots` (0 with no ranks).
fn capacity(caps: &[AtomicU32], max_slots: Option<u32>) -> u32 {
    let c = caps.iter().map(|c| c.load(Ordering::Relaxed)).min().unwrap_or(0);
    max_slots.map_or(c, |m| m.min(c))
}

/// First and longest pause before reconnecting a rank's event feed.
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// One rank's event feed: routes events to the requests waiting on them and, when the feed ends
/// (the rank restarted, the network broke), reconnects and re-reads the rank's buffer size.
struct RankFeed {
    rank: usize,
    addr: HostPort,
    links: RankLinks,
    waiters: Waiters,
    queue: SlotQueue,
    caps: Arc<Vec<AtomicU32>>,
    max_slots: Option<u32>,
    /// The decoder's ranks whose feeds are down now: it admits nothing while any is.
    down: Arc<AtomicU32>,
    waits: Arc<Vec<std::sync::atomic::AtomicBool>>,
}

impl RankFeed {
    /// Closes the feed of every request in flight on the decoder (see `run`).
    fn orphan(&self, why: &'static str) {
        let orphaned = std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|e| e.into_inner()));
        if !orphaned.is_empty() {
            tracing::warn!(rank = self.rank, addr = %self.addr, requests = orphaned.len(), "{why}");
        }
    }

    async fn run(self, mut feed: EventStream) {
        let r32 = u32::try_from(self.rank).unwrap_or(u32::MAX);
        loop {
            while let Ok(Some(e)) = feed.next().await {
                let key = match e {
                    RankEvent::Status(s) => s.key(),
                    RankEvent::Released(r) => r.key,
                };
                let tx = self.waiters.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned();
                if let Some(tx) = tx {
                    let _ = tx.send(e);
                }
            }
            // Every request in flight holds pages on every rank, and whatever this rank said while
            // its feed was down is lost (a restarted rank holds none of them): each request's feed
            // is closed now. One waiting for its KV fails at once rather than at its deadline;
            // one waiting for its pages' release gives its slots back, and the rank, which
            // refuses a reservation that does not fit, stays the truth for what it still holds.
            // Nothing is admitted until the feed is back: a request reserving meanwhile could
            // never hear its rank.
            if self.down.fetch_add(1, Ordering::SeqCst) == 0 {
                self.queue.set_open(false);
            }
            self.orphan("decoder rank's event feed lost: its requests' feeds closed");
            let mut backoff = Backoff::new(RECONNECT_MIN, RECONNECT_MAX);
            feed = loop {
                backoff.wait().await;
                let Ok(mut c) = self.links.control(&self.addr, r32).await else {
                    continue;
                };
                let Ok(info) = c.info().await else { continue };
                let Ok(f) = self.links.events(&self.addr, r32).await else { continue };
                if let Some(cap) = self.caps.get(self.rank) {
                    cap.store(info.pages_total, Ordering::Relaxed);
                }
                // A restarted engine may say otherwise now.
                if let Some(w) = self.waits.get(self.rank) {
                    w.store(c.welcome.decode_waits, Ordering::Relaxed);
                }
                self.queue.resize(capacity(&self.caps, self.max_slots));
                // A request admitted just before the feed was lost that reserved while it was
                // down may have missed its events too.
                self.orphan(
                    "decoder rank's event feed back: requests that reserved while it was down closed",
                );
                if self.down.fetch_sub(1, Ordering::SeqCst) == 1 {
                    self.queue.set_open(true);
                }
                break f;
            };
        }
    }
}

/// A control call.
#[derive(Clone, Copy)]
enum Op<'a> {
    Reserve {
        key: RequestKey,
        chunks: u32,
        lease: Duration,
        prefixes: &'a [PrefixKey],
    },
    Cancel {
        key: RequestKey,
        unsent: bool,
    },
    /// A cancel that asks whether the rank held the key.
    CancelHeld {
        key: RequestKey,
        unsent: bool,
    },
    Info,
}

enum OpOut {
    /// The rank's address the pages were reserved at, and their write addresses.
    Reserved(SocketAddr, Vec<(u32, PageAddr)>),
    Done,
    Held(bool),
    Info(baton_dataplane::transport::RankInfo),
}

/// What a decoder's ranks say about their buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankView {
    pub rank: u32,
    pub pages_total: u32,
    pub pages_free: u32,
}

impl Ranks {
    /// Connects to every rank, reads the buffer size into `queue` and subscribes to events.
    /// `max_slots` may only lower the capacity the ranks report.
    pub async fn connect(
        name: String,
        links: RankLinks,
        chunk_tokens: u32,
        max_slots: Option<u32>,
        queue: SlotQueue,
    ) -> Result<Self, TransportError> {
        let ranks = links.addrs.clone();
        let waiters: Waiters = Arc::default();
        let mut controls = Vec::new();
        let mut peers = Vec::new();
        let mut feeds = Vec::new();
        let caps: Arc<Vec<AtomicU32>> = Arc::new(ranks.iter().map(|_| AtomicU32::new(0)).collect());
        let waits: Arc<Vec<std::sync::atomic::AtomicBool>> =
            Arc::new(ranks.iter().map(|_| std::sync::atomic::AtomicBool::new(false)).collect());
        for (r, addr) in ranks.iter().enumerate() {
            let r32 = u32::try_from(r).unwrap_or(u32::MAX);
            let mut c = links.control(addr, r32).await?;
            if let Some(cap) = caps.get(r) {
                cap.store(c.info().await?.pages_total, Ordering::Relaxed);
            }
            if let Some(w) = waits.get(r) {
                w.store(c.welcome.decode_waits, Ordering::Relaxed);
            }
            peers.push(Mutex::new(c.peer));
            controls.push(tokio::sync::Mutex::new(vec![c]));
            feeds.push(links.events(addr, r32).await?);
        }
        queue.resize(capacity(&caps, max_slots));
        let mut routers = JoinSet::new();
        let down = Arc::new(AtomicU32::new(0));
        for (r, feed) in feeds.into_iter().enumerate() {
            let rank = RankFeed {
                rank: r,
                addr: ranks.get(r).cloned().ok_or(TransportError::Closed)?,
                links: links.clone(),
                waiters: Arc::clone(&waiters),
                queue: queue.clone(),
                caps: Arc::clone(&caps),
                max_slots,
                down: Arc::clone(&down),
                waits: Arc::clone(&waits),
            };
            routers.spawn(rank.run(feed));
        }
        Ok(Self { name, chunk_tokens, links, controls, peers, waiters, waits, _routers: routers })
    }

    /// A control connection for `rank`, and whether it came from the pool (and so may be stale).
    async fn control(&self, rank: usize) -> Result<(ControlClient, bool), TransportError> {
        let pooled = match self.controls.get(rank) {
            Some(m) => m.lock().await.pop(),
            None => None,
        };
        match pooled {
            Some(c) => Ok((c, true)),
            None => {
                let addr = self.links.addrs.get(rank).ok_or(TransportError::Closed)?;
                let c = self.links.control(addr, u32::try_from(rank).unwrap_or(u32::MAX)).await?;
                if let Some(p) = self.peers.get(rank) {
                    *p.lock().unwrap_or_else(|e| e.into_inner()) = c.peer;
                }
                Ok((c, false))
            }
        }
    }

    async fn give_back(&self, rank: usize, c: ControlClient) {
        if let Some(m) = self.controls.get(rank) {
            m.lock().await.push(c);
        }
    }

    /// Runs one control call on `rank`. A pooled connection that fails with a transport error (the
    /// rank restarted, the connection died while idle) is dropped and the call made once more on a
    /// fresh one; refusals are answers, not failures.
    async fn call(&self, rank: usize, op: Op<'_>) -> Result<OpOut, TransportError> {
        let mut retried = false;
        loop {
            let (mut c, pooled) = self.control(rank).await?;
            let res = match op {
                Op::Reserve { key, chunks, lease, prefixes } => {
                    c.reserve(key, chunks, lease, prefixes).await.map(|p| OpOut::Reserved(c.peer, p))
                }
                Op::Cancel { key, unsent } => {
                    if unsent { c.cancel_unsent(key).await } else { c.cancel(key).await }
                        .map(|()| OpOut::Done)
                }
                Op::CancelHeld { key, unsent } => c.cancel_held(key, unsent).await.map(OpOut::Held),
                Op::Info => c.info().await.map(OpOut::Info),
            };
            match res {
                Ok(_) | Err(TransportError::Refused { .. }) => {
                    self.give_back(rank, c).await;
                    return res;
                }
                Err(_) if pooled && !retried => retried = true,
                Err(e) => return Err(e),
            }
        }
    }

    /// Reserves on every rank or none, asking them all at once (one round trip whatever the TP).
    /// `Ok(None)`: some rank has no room right now (another gateway replica holds pages); the
    /// caller retries.
    pub async fn reserve(
        &self,
        key: RequestKey,
        chunks: u32,
        lease: Duration,
        prefixes: &[PrefixKey],
    ) -> Result<Option<Vec<(SocketAddr, Vec<(u32, PageAddr)>)>>, TransportError> {
        let ranks = self.links.addrs.len();
        let answers = futures_util::future::join_all(
            (0..ranks).map(|r| self.call(r, Op::Reserve { key, chunks, lease, prefixes })),
        )
        .await;
        let mut got = Vec::with_capacity(ranks);
        let mut busy = false;
        let mut failed = None;
        // Ranks that may hold pages of this key: those that reserved, and those whose call broke
        // (the Reserve may have landed before it did). A rank that refused holds nothing, and
        // cancelling a key it never reserved would make it refuse that key from then on.
        let mut holding = Vec::with_capacity(ranks);
        for (r, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(OpOut::Reserved(peer, addrs)) => {
                    holding.push(r);
                    got.push((peer, addrs));
                }
                Ok(_) => {
                    holding.push(r);
                    failed.get_or_insert(TransportError::Unexpected(
                        "reserve answered with something else".into(),
                    ));
                }
                Err(TransportError::Refused { code: RefusalCode::Busy, .. }) => busy = true,
                Err(e @ TransportError::Refused { .. }) => failed = Some(e),
                Err(e) => {
                    holding.push(r);
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            // All or none: what the others gave goes back at once (the key is not retried).
            self.cancel_ranks(key, true, holding).await;
            return Err(e);
        }
        if busy {
            // The caller retries with a new epoch of the key.
            self.cancel_ranks(key, true, holding).await;
            return Ok(None);
        }
        Ok(Some(got))
    }

    /// Cancels on every rank (idempotent; a rank that cannot be reached is skipped: its lease ends
    /// the reservation). `unsent`: no prefiller ever had the addresses.
    pub async fn cancel(&self, key: RequestKey, unsent: bool) {
        self.cancel_ranks(key, unsent, 0..self.links.addrs.len()).await;
    }

    /// Cancels on `ranks`, all at once.
    async fn cancel_ranks(&self, key: RequestKey, unsent: bool, ranks: impl IntoIterator<Item = usize>) {
        futures_util::future::join_all(ranks.into_iter().map(|r| self.call(r, Op::Cancel { key, unsent })))
            .await;
    }

    /// Cancels on every rank, all at once, and says which ranks may hold pages of `key` (a
    /// release follows from each): those that said they did, and those that could not be asked.
    pub async fn cancel_held(&self, key: RequestKey, unsent: bool) -> Vec<bool> {
        futures_util::future::join_all(
            (0..self.links.addrs.len()).map(|r| self.call(r, Op::CancelHeld { key, unsent })),
        )
        .await
        .iter()
        .map(|a| !matches!(a, Ok(OpOut::Held(false))))
        .collect()
    }

    /// Every rank as a prefiller that reserves for itself is told of it: its rank and address,
    /// no pages.
    pub fn targets(&self) -> Vec<baton_dataplane::contract::DecoderTarget> {
        self.peers
            .iter()
            .enumerate()
            .map(|(r, p)| baton_dataplane::contract::DecoderTarget {
                rank: u32::try_from(r).unwrap_or(u32::MAX),
                addr: *p.lock().unwrap_or_else(|e| e.into_inner()),
                chunks: Vec::new(),
            })
            .collect()
    }

    /// Routes the events of `key` to the returned receiver until [`DecoderHandle::forget`].
    pub fn listen(&self, key: RequestKey) -> mpsc::UnboundedReceiver<RankEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.waiters.lock().unwrap_or_else(|e| e.into_inner()).insert(key, tx);
        rx
    }

    pub fn forget(&self, key: RequestKey) {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
    }

    /// What every rank reports now.
    pub async fn ranks_view(&self) -> Vec<RankView> {
        let mut out = Vec::new();
        for r in 0..self.links.addrs.len() {
            if let Ok(OpOut::Info(i)) = self.call(r, Op::Info).await {
                out.push(RankView { rank: i.rank, pages_total: i.pages_total, pages_free: i.pages_free });
            }
        }
        out
    }

    /// Slots a prompt of `tokens` takes here: its chunks.
    pub fn slots_for(&self, tokens: usize) -> u32 {
        u32::try_from(tokens.div_ceil(self.chunk_tokens.max(1) as usize)).unwrap_or(u32::MAX)
    }

    /// Whether every rank's engine waits for a request's KV itself (`kv_wait_ms`), as their last
    /// Welcome said.
    pub fn decode_waits(&self) -> bool {
        !self.waits.is_empty() && self.waits.iter().all(|w| w.load(Ordering::Relaxed))
    }

    pub fn rank_count(&self) -> u32 {
        u32::try_from(self.links.addrs.len()).unwrap_or(u32::MAX)
    }
}
