//! One decoder rank's data-plane server. It owns the rank's [`RankBuffer`] and the reservations made
//! over control connections, and hands a ready reservation to the embedding engine with
//! [`RankServer::take`].

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustc_hash::FxHashMap;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::{Notify, broadcast};
use tokio::task::JoinSet;

use super::{
    BoxConn, DEFAULT_EVENT_BACKLOG, DEFAULT_HANDSHAKE_TIMEOUT, FrameIo, Incoming, TlsServer, TransportError,
};
use crate::buffer::{
    BeginWrite, NotReady, PageWriter, RankBuffer, Ready, Reservation, ReserveRequest, WriteOutcome,
};
use crate::device::Device;
use crate::events::{EventSink, RankEvent, ReleaseReason, TerminalState};
use crate::ids::{Rank, RequestKey};
use crate::table::{LeaseError, ReserveError, WriteError};
use crate::wire::{ChunkHead, Frame, Hello, PROTOCOL_VERSION, RefusalCode, Role};

/// Chunks one producer connection may hold granted (written through the export, not yet
/// committed): a producer pipelines a few; more is a runaway peer holding pages.
const MAX_GRANTS_PER_CONNECTION: usize = 64;

/// Answers to a pipelining producer held back (while its next frames are already read) up to this
/// many bytes before they are sent.
const REPLY_BATCH_BYTES: usize = 4 << 10;

/// Events published together are sent in one write of up to this many bytes.
const EVENT_BATCH_BYTES: usize = 16 << 10;

/// How often the reaper wakes at the latest, so a renewal that moves a deadline earlier is honoured
/// within this bound.
const REAPER_MAX_SLEEP: Duration = Duration::from_millis(50);

/// Why a peer's `Hello` is refused; sent back as the message of an `Error` frame.
#[derive(Debug, Error)]
enum HelloError {
    /// The peer's KV geometry differs from this rank's, so its pages would not fit.
    #[error("geometry fingerprint {theirs:#018x} does not match this rank's {mine:#018x}")]
    Geometry { theirs: u64, mine: u64 },
    /// The peer meant another rank.
    #[error("this is rank {mine}, not rank {theirs}")]
    Rank { theirs: Rank, mine: Rank },
}

/// Forwards a buffer's events to every subscriber.
#[derive(Debug)]
pub struct BroadcastSink(broadcast::Sender<RankEvent>);

impl EventSink for BroadcastSink {
    fn emit(&self, event: RankEvent) {
        // No subscriber is not an error: the statuses are also visible through `Info` and reservations.
        let _ = self.0.send(event);
    }
}

/// A decoder rank served over TCP.
pub struct RankServer<D: Device> {
    buf: RankBuffer<D>,
    ranks: u32,
    held: Mutex<FxHashMap<RequestKey, Reservation<D>>>,
    /// Taken only under `held`'s lock, so a Reserve and a Cancel of one key are ordered.
    cancelled: Mutex<Tombstones>,
    events: broadcast::Sender<RankEvent>,
    /// Connections refused at the TLS handshake.
    refused: std::sync::atomic::AtomicU64,
    /// Said in every Welcome: the embedding engine waits for a request's KV itself.
    decode_waits: std::sync::atomic::AtomicBool,
    /// Requests [`RankServer::take_ready`] waits on, woken by their status.
    waiting: Mutex<FxHashMap<RequestKey, Arc<Waiting>>>,
}

/// What [`RankServer::take_ready`] waits on for one request: a wake-up, and the terminal status
/// that caused it (the janitor forgets a closed reservation before it wakes the waiters, so the
/// reason would be lost with it).
#[derive(Debug, Default)]
struct Waiting {
    notify: Notify,
    ended: Mutex<Option<TerminalState>>,
}

/// Removes a [`RankServer::take_ready`] waiter's entry however the wait ends, its future dropped
/// included.
struct WaitEntry<'a, D: Device> {
    server: &'a RankServer<D>,
    key: RequestKey,
    waiting: Arc<Waiting>,
}

impl<D: Device> Drop for WaitEntry<'_, D> {
    fn drop(&mut self) {
        let mut waiting = self.server.lock_waiting();
        // The last waiter of the key (the map holds one reference, this one another) takes it away.
        if Arc::strong_count(&self.waiting) == 2 {
            waiting.remove(&self.key);
        }
    }
}

/// The longest a [`RankServer::take_ready`] waits between looks at the request's state, whatever
/// its events say (one missed cannot hold it to its deadline).
const WAIT_RECHECK: Duration = Duration::from_millis(50);

/// Why [`RankServer::take_ready`] gave no ready request.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum WaitError {
    /// This rank holds no reservation of the request: never reserved here, cancelled, expired, or
    /// already taken.
    #[error("no reservation for {0} on this rank (never reserved, cancelled, expired or already taken)")]
    NotReserved(RequestKey),
    /// The request ended (cancelled, expired, failed) before or while it waited.
    #[error("{0}: {1}")]
    Closed(RequestKey, LeaseError),
    /// Its KV was not all in within the time given.
    #[error("the kv of {0} was not all in within {1:?}")]
    TimedOut(RequestKey, Duration),
}

/// How long a key that ended (or was cancelled before it was reserved) is remembered.
const TOMBSTONE_TTL: Duration = Duration::from_secs(300);
/// Most keys remembered at once (the oldest go first).
const MAX_TOMBSTONES: usize = 1 << 16;

/// Keys cancelled before their reservation existed, and reservations that ended without being
/// taken (cancelled, expired, failed), with how. A client that gives up while its Reserve is in
/// flight cancels on another connection, and that cancel can arrive first; the Reserve that follows
/// is refused instead of holding pages until its lease ends. A decode request that comes after its
/// reservation ended (or was cancelled before it came) learns at once, instead of waiting for one
/// that will never come. Keys are never reused, so remembering one is always safe; the memory is
/// bounded in time and size.
#[derive(Debug, Default)]
struct Tombstones {
    order: std::collections::VecDeque<(std::time::Instant, RequestKey)>,
    keys: FxHashMap<RequestKey, TerminalState>,
}

impl Tombstones {
    fn expire(&mut self, now: std::time::Instant) {
        while let Some(&(at, key)) = self.order.front() {
            if now.duration_since(at) < TOMBSTONE_TTL && self.order.len() <= MAX_TOMBSTONES {
                break;
            }
            self.order.pop_front();
            self.keys.remove(&key);
        }
    }

    fn add(&mut self, key: RequestKey, how: TerminalState) {
        let now = std::time::Instant::now();
        if self.keys.insert(key, how).is_none() {
            self.order.push_back((now, key));
        }
        self.expire(now);
    }

    /// How `key` ended, if it is remembered.
    fn get(&mut self, key: &RequestKey) -> Option<TerminalState> {
        self.expire(std::time::Instant::now());
        self.keys.get(key).copied()
    }
}

impl<D: Device> std::fmt::Debug for RankServer<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankServer").field("buffer", &self.buf).field("ranks", &self.ranks).finish()
    }
}

/// A running server: its address, and the way to stop it.
#[derive(Debug)]
pub struct ServerHandle {
    pub addr: SocketAddr,
    stop: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl ServerHandle {
    /// Stops accepting, closes every connection and the reaper, and waits for them.
    pub async fn shutdown(self) {
        self.stop.notify_one();
        let _ = self.task.await;
    }
}

fn refusal(key: RequestKey, code: RefusalCode, need: u32, have: u32, message: String) -> Frame {
    Frame::Refused { key, code, need, have, message }
}

fn reserve_refusal(key: RequestKey, e: &ReserveError) -> Frame {
    let (code, need, have) = match *e {
        ReserveError::TooLarge { need, capacity } => (RefusalCode::TooLarge, need, capacity),
        ReserveError::Busy { need, free } => (RefusalCode::Busy, need, free),
        ReserveError::Duplicate { .. } => (RefusalCode::Duplicate, 0, 0),
        ReserveError::TooManyRequests { limit } => {
            (RefusalCode::TooManyRequests, 0, u32::try_from(limit).unwrap_or(u32::MAX))
        }
        ReserveError::LeaseInPast => (RefusalCode::BadRequest, 0, 0),
    };
    refusal(key, code, need, have, e.to_string())
}

fn write_refusal(key: RequestKey, e: &WriteError) -> Frame {
    let code = match e {
        WriteError::Stale { .. } => RefusalCode::Stale,
        WriteError::NotOwner { .. } | WriteError::WrongChunk { .. } => RefusalCode::NotOwner,
        WriteError::Expired { .. } => RefusalCode::Expired,
        WriteError::Cancelled { .. } | WriteError::Unreserved { .. } => RefusalCode::Closed,
        WriteError::NoChunk { .. } => RefusalCode::NotOwner,
        WriteError::NoSuchPage { .. }
        | WriteError::InProgress { .. }
        | WriteError::Overrun { .. }
        | WriteError::Incomplete { .. } => RefusalCode::BadRequest,
        WriteError::Device(_) => RefusalCode::Internal,
    };
    refusal(key, code, 0, 0, e.to_string())
}

fn lease_refusal(key: RequestKey, e: LeaseError) -> Frame {
    let code = if e == LeaseError::Expired { RefusalCode::Expired } else { RefusalCode::Closed };
    refusal(key, code, 0, 0, e.to_string())
}

/// The chunk a producer connection is in the middle of.
enum InFlight<D: Device> {
    Writing {
        key: RequestKey,
        chunk: u32,
        writer: PageWriter<D>,
    },
    /// Already answered (duplicate or refused): the rest of its segments are read and dropped.
    Skipping {
        key: RequestKey,
        chunk: u32,
    },
}

impl<D: Device> RankServer<D> {
    /// A server for `buf`'s rank, one of `ranks`. The buffer must have been built with the sink
    /// returned by [`RankServer::sink`].
    pub fn new(buf: RankBuffer<D>, ranks: u32, events: broadcast::Sender<RankEvent>) -> Arc<Self> {
        Arc::new(Self {
            buf,
            ranks,
            held: Mutex::new(FxHashMap::default()),
            cancelled: Mutex::new(Tombstones::default()),
            events,
            refused: std::sync::atomic::AtomicU64::new(0),
            decode_waits: std::sync::atomic::AtomicBool::new(false),
            waiting: Mutex::new(FxHashMap::default()),
        })
    }

    /// Says in every Welcome from now on that the embedding engine waits for a request's KV itself
    /// when its decode request carries `kv_wait_ms` (with [`RankServer::take_ready`]): the gateway
    /// then sends the decode request while the prefill runs, instead of after every rank's READY.
    /// Said to control connections only (the gateway's); a gateway older than this flag refuses
    /// the Welcome that carries it: upgrade the gateways first.
    pub fn set_decode_waits(&self, on: bool) {
        self.decode_waits.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the Welcome says the engine waits for the KV ([`RankServer::set_decode_waits`]).
    pub fn decode_waits(&self) -> bool {
        self.decode_waits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Takes the reservation of `key` once every chunk of it is in, waiting up to `within` for the
    /// last one: what a decode request that arrived with the prefill does. A reservation not here
    /// yet is waited for too (a producer that reserves for itself sends its Reserve with the
    /// chunks, maybe after the decode request came): `NotReserved` when none came within
    /// `within`, or when the one that was here is gone (taken). Fails as soon as the request
    /// ends (cancelled, before its reservation came included; expired). Its wake-up is the
    /// request's status event, so the server must be started ([`RankServer::start`]).
    pub async fn take_ready(&self, key: RequestKey, within: Duration) -> Result<Ready<D>, WaitError> {
        // A `within` past what an instant can hold (say `Duration::MAX`) waits as good as forever.
        let now = tokio::time::Instant::now();
        let deadline = now.checked_add(within).unwrap_or_else(|| now + Duration::from_secs(1 << 32));
        let waiting = Arc::clone(self.lock_waiting().entry(key).or_default());
        let entry = WaitEntry { server: self, key, waiting };
        // Whether this rank has held the reservation while it waited.
        let mut seen = false;
        loop {
            let woken = entry.waiting.notify.notified();
            tokio::pin!(woken);
            // Registered before the state is read: a status emitted in between still wakes it.
            woken.as_mut().enable();
            let ready = {
                let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
                held.get(&key).map(Reservation::is_ready)
            };
            match ready {
                None => {
                    // Gone: closed (the janitor forgets closed reservations; their status says
                    // why), cancelled before it came, or taken; or not here yet: a producer that
                    // reserves for itself sends the Reserve with its chunks, which may come after
                    // the decode request.
                    // How it ended: said to this waiter, or remembered from before it came.
                    let ended = entry
                        .waiting
                        .ended
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .filter(|s| *s != TerminalState::Ready);
                    let ended =
                        ended.or_else(|| self.cancelled.lock().unwrap_or_else(|e| e.into_inner()).get(&key));
                    match ended {
                        Some(TerminalState::Expired) => {
                            return Err(WaitError::Closed(key, LeaseError::Expired));
                        }
                        Some(state) => return Err(WaitError::Closed(key, LeaseError::Closed(state))),
                        None => {}
                    }
                    if seen {
                        return Err(WaitError::NotReserved(key));
                    }
                }
                Some(Err(e)) => return Err(WaitError::Closed(key, e)),
                Some(Ok(true)) => {
                    return match self.take(key).map(Reservation::try_ready) {
                        Some(Ok(r)) => Ok(r),
                        Some(Err(NotReady::Closed(e))) => Err(WaitError::Closed(key, e)),
                        // Ready stays ready; put back, a reservation the server would lose.
                        Some(Err(NotReady::Pending(r))) => {
                            self.held.lock().unwrap_or_else(|e| e.into_inner()).insert(key, r);
                            continue;
                        }
                        None => Err(WaitError::NotReserved(key)),
                    };
                }
                Some(Ok(false)) => seen = true,
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(if seen {
                    WaitError::TimedOut(key, within)
                } else {
                    WaitError::NotReserved(key)
                });
            }
            let _ = tokio::time::timeout_at(deadline.min(now + WAIT_RECHECK), woken).await;
        }
    }

    fn lock_waiting(&self) -> std::sync::MutexGuard<'_, FxHashMap<RequestKey, Arc<Waiting>>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes whoever waits on `key` for its terminal `state`.
    fn ended(&self, key: RequestKey, state: TerminalState) {
        if let Some(w) = self.lock_waiting().get(&key) {
            *w.ended.lock().unwrap_or_else(|e| e.into_inner()) = Some(state);
            w.notify.notify_waiters();
        }
    }

    /// Wakes every waiter, to look again (events were missed).
    fn wake_all(&self) {
        self.lock_waiting().values().for_each(|w| w.notify.notify_waiters());
    }

    /// Connections refused at the TLS handshake (no certificate, one from another CA, plain TCP).
    pub fn refused_handshakes(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// An event sink for the rank's buffer and the channel the server will publish from.
    pub fn sink() -> (Arc<BroadcastSink>, broadcast::Sender<RankEvent>) {
        let (tx, _) = broadcast::channel(DEFAULT_EVENT_BACKLOG);
        (Arc::new(BroadcastSink(tx.clone())), tx)
    }

    pub fn buffer(&self) -> &RankBuffer<D> {
        &self.buf
    }

    /// Takes the reservation of `key` for the embedding engine (to consume it), if this rank holds it.
    pub fn take(&self, key: RequestKey) -> Option<Reservation<D>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).remove(&key)
    }

    /// Drops every reservation this rank holds (cancelling those not consumed); for a crashed rank.
    pub fn clear(&self) {
        let all: Vec<_> = self.held.lock().unwrap_or_else(|e| e.into_inner()).drain().collect();
        drop(all);
    }

    /// Subscribes to the rank's events in-process.
    pub fn subscribe(&self) -> broadcast::Receiver<RankEvent> {
        self.events.subscribe()
    }

    /// Serves plain TCP on `listener` until the handle is shut down.
    pub fn start(self: &Arc<Self>, listener: TcpListener) -> Result<ServerHandle, std::io::Error> {
        self.start_with(listener, None)
    }

    /// Serves TLS (mTLS when `tls` has a client CA) on `listener` until the handle is shut down.
    pub fn start_tls(
        self: &Arc<Self>,
        listener: TcpListener,
        tls: TlsServer,
    ) -> Result<ServerHandle, std::io::Error> {
        self.start_with(listener, Some(tls))
    }

    fn start_with(
        self: &Arc<Self>,
        listener: TcpListener,
        tls: Option<TlsServer>,
    ) -> Result<ServerHandle, std::io::Error> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(Notify::new());
        let this = Arc::clone(self);
        let stop2 = Arc::clone(&stop);
        let task = tokio::spawn(async move { this.run(listener, tls, stop2).await });
        Ok(ServerHandle { addr, stop, task })
    }

    async fn run(self: Arc<Self>, listener: TcpListener, tls: Option<TlsServer>, stop: Arc<Notify>) {
        // The acceptor is taken per connection: a certificate replaced meanwhile
        // ([`TlsServer::replace`]) serves the next handshake.
        let mut tasks = JoinSet::new();
        let reaper = Arc::clone(&self);
        tasks.spawn(async move { reaper.reap_forever().await });
        let janitor = Arc::clone(&self);
        tasks.spawn(async move { janitor.forget_closed().await });
        loop {
            tokio::select! {
                _ = stop.notified() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nodelay(true);
                        let this = Arc::clone(&self);
                        let acceptor = tls.as_ref().map(TlsServer::acceptor);
                        tasks.spawn(async move {
                            let conn: BoxConn = match acceptor {
                                None => Box::new(stream),
                                // A peer that cannot finish the handshake in time, or whose
                                // certificate does not verify, never reaches the buffer.
                                Some(a) => match tokio::time::timeout(DEFAULT_HANDSHAKE_TIMEOUT, a.accept(stream)).await {
                                    Ok(Ok(s)) => Box::new(s),
                                    refused => {
                                        let why = match refused {
                                            Ok(Err(e)) => e.to_string(),
                                            _ => format!("no handshake within {DEFAULT_HANDSHAKE_TIMEOUT:?}"),
                                        };
                                        this.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                        tracing::warn!(rank = this.buf.rank(), %peer, reason = %why, "data-plane TLS handshake refused");
                                        return;
                                    }
                                },
                            };
                            this.connection(conn).await
                        });
                    }
                    // Out of descriptors and the like: back off rather than spin.
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                },
                Some(_) = tasks.join_next(), if tasks.len() > 1 => {}
            }
        }
        tasks.shutdown().await;
    }

    async fn reap_forever(&self) {
        loop {
            let now = tokio::time::Instant::now();
            let wake = match self.buf.next_deadline() {
                Some(d) => tokio::time::Instant::from_std(d).min(now + REAPER_MAX_SLEEP),
                None => now + REAPER_MAX_SLEEP,
            };
            tokio::time::sleep_until(wake).await;
            self.buf.reap();
        }
    }

    /// Drops held reservations that ended on their own (lease expired before or after READY), so a
    /// request nobody cancels does not stay in the map for the life of the process.
    async fn forget_closed(&self) {
        let mut rx = self.events.subscribe();
        loop {
            match rx.recv().await {
                Ok(RankEvent::Status(s)) => {
                    // The waiters learn why before the reservation is forgotten: one that looks
                    // after that still knows.
                    self.ended(s.key(), s.state);
                    if s.state != TerminalState::Ready {
                        // Remembered, so a decode request that comes later is told at once.
                        self.cancelled.lock().unwrap_or_else(|e| e.into_inner()).add(s.key(), s.state);
                        self.forget_if_closed(s.key());
                    }
                }
                Ok(RankEvent::Released(r)) => {
                    // A ready reservation's lease that ran out says so only here.
                    if r.reason == ReleaseReason::Expired {
                        self.cancelled
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .add(r.key, TerminalState::Expired);
                    }
                    self.forget_if_closed(r.key);
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    // Missed some: sweep everything once.
                    let keys: Vec<RequestKey> =
                        self.held.lock().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
                    for k in keys {
                        self.forget_if_closed(k);
                    }
                    self.wake_all();
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    }

    fn forget_if_closed(&self, key: RequestKey) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.get(&key).is_some_and(|r| r.is_ready().is_err()) {
            let r = held.remove(&key);
            drop(held);
            drop(r);
        }
    }

    async fn connection(self: Arc<Self>, stream: BoxConn) {
        let mut io = FrameIo::new(stream);
        let hello = match tokio::time::timeout(DEFAULT_HANDSHAKE_TIMEOUT, io.read()).await {
            Ok(Ok(Some(Frame::Hello(h)))) => h,
            Ok(Ok(None)) => return,
            Ok(Ok(Some(other))) => {
                return close(&mut io, RefusalCode::BadRequest, format!("expected hello, got {other:?}"))
                    .await;
            }
            Ok(Err(e)) => return close(&mut io, code_of(&e), e.to_string()).await,
            Err(_) => {
                return close(
                    &mut io,
                    RefusalCode::BadRequest,
                    "no hello within the handshake timeout".into(),
                )
                .await;
            }
        };
        if let Err(e) = self.check_hello(&hello) {
            return close(&mut io, RefusalCode::Geometry, e.to_string()).await;
        }
        let stats = self.buf.stats();
        let welcome = Frame::Welcome {
            rank: self.buf.rank(),
            ranks: self.ranks,
            pages_total: stats.total,
            page_bytes: self.buf.page_bytes() as u64,
            geometry: self.buf.geometry().fingerprint(),
            export: self.buf.export().unwrap_or_default(),
            // Said to the gateway's control connections only: a producer does not need it, and an
            // older one would refuse the flag.
            decode_waits: hello.role == Role::Control
                && self.decode_waits.load(std::sync::atomic::Ordering::Relaxed),
        };
        if io.write(&welcome).await.is_err() {
            return;
        }
        let result = match hello.role {
            Role::Control => self.control(&mut io).await,
            Role::Producer => self.producer(&mut io).await,
            Role::Events => self.event_feed(&mut io).await,
        };
        if let Err(e) = result {
            close(&mut io, code_of(&e), e.to_string()).await;
        }
    }

    fn check_hello(&self, h: &Hello) -> Result<(), HelloError> {
        let mine = self.buf.geometry().fingerprint();
        if h.geometry != mine {
            return Err(HelloError::Geometry { theirs: h.geometry, mine });
        }
        if h.rank != self.buf.rank() {
            return Err(HelloError::Rank { theirs: h.rank, mine: self.buf.rank() });
        }
        Ok(())
    }

    /// Reserves `key`'s pages (all or nothing) and answers with their write addresses, or refuses:
    /// a key already cancelled here is refused, never reserved.
    fn reserve(
        &self,
        key: RequestKey,
        chunks: u32,
        lease_ms: u32,
        prefixes: &[crate::ids::PrefixKey],
    ) -> Frame {
        let lease = self.buf.now() + Duration::from_millis(u64::from(lease_ms));
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(how) = self.cancelled.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return refusal(
                key,
                RefusalCode::Closed,
                0,
                0,
                format!("{key} already ended ({})", how.as_str()),
            );
        }
        match self.buf.reserve(ReserveRequest { key, chunks, prefixes, lease }) {
            Ok(mut r) => {
                let addrs = r.publish();
                held.insert(key, r);
                drop(held);
                // A decode request that came before its reservation (the producer reserves for
                // itself) looks again.
                if let Some(w) = self.lock_waiting().get(&key) {
                    w.notify.notify_waiters();
                }
                Frame::Reserved { key, addrs }
            }
            Err(e) => reserve_refusal(key, &e),
        }
    }

    async fn control(&self, io: &mut FrameIo<BoxConn>) -> Result<(), TransportError> {
        while let Some(frame) = io.read().await? {
            let reply = match frame {
                Frame::Info => {
                    let s = self.buf.stats();
                    Frame::InfoReply {
                        rank: self.buf.rank(),
                        ranks: self.ranks,
                        pages_total: s.total,
                        pages_free: s.pages.free,
                        page_bytes: self.buf.page_bytes() as u64,
                        geometry: self.buf.geometry().fingerprint(),
                    }
                }
                Frame::Reserve { key, chunks, lease_ms, prefixes } => {
                    self.reserve(key, chunks, lease_ms, &prefixes)
                }
                Frame::Renew { key, lease_ms } => {
                    let lease = self.buf.now() + Duration::from_millis(u64::from(lease_ms));
                    let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
                    match held.get(&key).map(|r| r.renew(lease)) {
                        Some(Ok(())) => Frame::Done { key },
                        Some(Err(e)) => lease_refusal(key, e),
                        None => refusal(key, RefusalCode::Closed, 0, 0, format!("no reservation for {key}")),
                    }
                }
                Frame::Cancel { key, unsent, report } => {
                    // Dropped outside the lock: the drop emits events.
                    let r = {
                        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
                        let r = held.remove(&key);
                        // Remembered whether held or not: a Reserve that comes later is refused,
                        // and a decode request that comes later is told at once (a reservation
                        // cancelled once ready says nothing more on the feed but its release).
                        self.cancelled
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .add(key, TerminalState::Cancelled);
                        r
                    };
                    let was_held = r.is_some();
                    drop(r);
                    // A decode request waiting learns at once: for a reservation still on its way
                    // (a producer reserving for itself), or one already ready (whose cancel says
                    // nothing more on the feed but its release).
                    self.ended(key, TerminalState::Cancelled);
                    if unsent {
                        // No producer ever had the addresses: nothing to wait for.
                        self.buf.fence(key);
                    }
                    if report && !was_held {
                        refusal(key, RefusalCode::Closed, 0, 0, format!("no reservation of {key} here"))
                    } else {
                        Frame::Done { key }
                    }
                }
                other => {
                    return Err(TransportError::Unexpected(format!("{other:?} on a control connection")));
                }
            };
            io.write(&reply).await?;
        }
        Ok(())
    }

    async fn producer(&self, io: &mut FrameIo<BoxConn>) -> Result<(), TransportError> {
        let mut current: Option<InFlight<D>> = None;
        // Chunks granted to a same-host producer writing through the export; their writers drop
        // (aborting the write) if the connection goes away before `Written`.
        let mut granted: FxHashMap<(RequestKey, u32), PageWriter<D>> = FxHashMap::default();
        while let Some(incoming) = io.read_head().await? {
            match incoming {
                Incoming::Frame(Frame::Grant { key, chunk, addr }) => {
                    let reply = self.grant(&mut granted, key, chunk, addr);
                    io.write(&reply).await?;
                }
                Incoming::Frame(Frame::Written { key, chunk }) => {
                    let reply = match granted.remove(&(key, chunk)) {
                        Some(mut w) => {
                            w.written_externally();
                            match w.commit() {
                                Ok(_) => Frame::ChunkAck { key, chunk, duplicate: false },
                                Err(e) => write_refusal(key, &e),
                            }
                        }
                        None => refusal(
                            key,
                            RefusalCode::BadRequest,
                            0,
                            0,
                            format!("chunk {chunk} was not granted"),
                        ),
                    };
                    io.write(&reply).await?;
                }
                Incoming::Chunk(head) => {
                    let (reply, next) = self.chunk_segment(io, head, current.take()).await?;
                    current = next;
                    if let Some(reply) = reply {
                        io.queue(&reply);
                    }
                    // While a pipelining producer's next frames are already here, answers wait to
                    // leave together; never while the server would wait to read.
                    if !io.has_input() || io.queued() >= REPLY_BATCH_BYTES {
                        io.flush().await?;
                    }
                }
                Incoming::Frame(Frame::Reserve { key, chunks, lease_ms, prefixes }) => {
                    // A producer reserving for itself, its chunks (by chunk, `PageAddr::BY_CHUNK`)
                    // right behind: the answer waits to leave with theirs.
                    io.queue(&self.reserve(key, chunks, lease_ms, &prefixes));
                    if !io.has_input() {
                        io.flush().await?;
                    }
                }
                Incoming::Frame(Frame::Fence { key }) => {
                    current = None;
                    let known = {
                        let _held = self.held.lock().unwrap_or_else(|e| e.into_inner());
                        let known = self.buf.fence(key);
                        if !known {
                            // A producer that gave up before its Reserve came here (it fences on
                            // another connection, which may overtake the Reserve): the Reserve
                            // that follows is refused, not held until its lease ends.
                            self.cancelled
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .add(key, TerminalState::Cancelled);
                        }
                        known
                    };
                    if !known {
                        self.ended(key, TerminalState::Cancelled);
                    }
                    io.write(&Frame::Done { key }).await?;
                }
                Incoming::Frame(other) => {
                    return Err(TransportError::Unexpected(format!("{other:?} on a producer connection")));
                }
            }
        }
        Ok(())
    }

    fn grant(
        &self,
        granted: &mut FxHashMap<(RequestKey, u32), PageWriter<D>>,
        key: RequestKey,
        chunk: u32,
        addr: crate::ids::PageAddr,
    ) -> Frame {
        if self.buf.export().is_none() {
            return refusal(
                key,
                RefusalCode::BadRequest,
                0,
                0,
                "this rank does not export its buffer".into(),
            );
        }
        if granted.len() >= MAX_GRANTS_PER_CONNECTION {
            let msg = format!("{MAX_GRANTS_PER_CONNECTION} chunks already granted on this connection");
            return refusal(key, RefusalCode::BadRequest, 0, 0, msg);
        }
        // A repeated grant for the same chunk replaces (aborts) the earlier one.
        drop(granted.remove(&(key, chunk)));
        match self.buf.begin_write(key, chunk, addr) {
            Ok(BeginWrite::Write(w)) => {
                let page = w.addr().page;
                granted.insert((key, chunk), w);
                Frame::Granted { key, chunk, offset: u64::from(page) * self.buf.page_bytes() as u64 }
            }
            Ok(BeginWrite::Duplicate) => Frame::ChunkAck { key, chunk, duplicate: true },
            Err(e) => write_refusal(key, &e),
        }
    }

    /// Takes one segment of a chunk off the wire (always all of its payload, so framing holds) and
    /// returns the answer to send, if the chunk is finished or refused, and the chunk still in flight.
    async fn chunk_segment(
        &self,
        io: &mut FrameIo<BoxConn>,
        h: ChunkHead,
        mut current: Option<InFlight<D>>,
    ) -> Result<(Option<Frame>, Option<InFlight<D>>), TransportError> {
        let (key, chunk) = (h.key, h.chunk);
        let last = h.offset.saturating_add(h.len as u64) == self.buf.page_bytes() as u64;
        let mut reply = None;
        if h.offset == 0 {
            // A new chunk; anything unfinished before it is aborted first (its writer drops), so a
            // retry of the same page is not refused as in progress.
            drop(current.take());
            current = Some(match self.buf.begin_write(key, chunk, h.addr) {
                Ok(BeginWrite::Write(writer)) => InFlight::Writing { key, chunk, writer },
                Ok(BeginWrite::Duplicate) => {
                    reply = Some(Frame::ChunkAck { key, chunk, duplicate: true });
                    InFlight::Skipping { key, chunk }
                }
                Err(e) => {
                    reply = Some(write_refusal(key, &e));
                    InFlight::Skipping { key, chunk }
                }
            });
        }
        match current {
            Some(InFlight::Writing { key: k, chunk: c, mut writer }) if k == key && c == chunk => {
                if writer.written() as u64 != h.offset {
                    io.read_payload(h.len, |_| {}).await?;
                    let msg = format!("segment at offset {}, expected {}", h.offset, writer.written());
                    return Ok((
                        Some(refusal(key, RefusalCode::BadRequest, 0, 0, msg)),
                        Some(InFlight::Skipping { key, chunk }),
                    ));
                }
                let mut failed = None;
                io.read_payload(h.len, |piece| {
                    if failed.is_none()
                        && let Err(e) = writer.write(piece)
                    {
                        failed = Some(e);
                    }
                })
                .await?;
                if let Some(e) = failed {
                    return Ok((Some(write_refusal(key, &e)), Some(InFlight::Skipping { key, chunk })));
                }
                if !last {
                    return Ok((None, Some(InFlight::Writing { key, chunk, writer })));
                }
                let answer = match writer.commit() {
                    Ok(WriteOutcome::Stored { .. }) => Frame::ChunkAck { key, chunk, duplicate: false },
                    Ok(WriteOutcome::Duplicate) => Frame::ChunkAck { key, chunk, duplicate: true },
                    Err(e) => write_refusal(key, &e),
                };
                Ok((Some(answer), None))
            }
            Some(InFlight::Skipping { key: k, chunk: c }) if k == key && c == chunk => {
                io.read_payload(h.len, |_| {}).await?;
                Ok((reply, (!last).then_some(InFlight::Skipping { key, chunk })))
            }
            _ => {
                io.read_payload(h.len, |_| {}).await?;
                let msg = format!("segment of chunk {chunk} at offset {} without its start", h.offset);
                Ok((Some(refusal(key, RefusalCode::BadRequest, 0, 0, msg)), None))
            }
        }
    }

    async fn event_feed(&self, io: &mut FrameIo<BoxConn>) -> Result<(), TransportError> {
        let mut rx = self.events.subscribe();
        loop {
            match rx.recv().await {
                Ok(ev) => {
                    // Events already published leave in the same write.
                    io.queue(&Frame::Event(ev));
                    while io.queued() < EVENT_BATCH_BYTES {
                        match rx.try_recv() {
                            Ok(ev) => io.queue(&Frame::Event(ev)),
                            Err(broadcast::error::TryRecvError::Lagged(n)) => {
                                return Err(TransportError::Unexpected(format!(
                                    "subscriber fell {n} events behind; reconnect and reconcile"
                                )));
                            }
                            Err(_) => break,
                        }
                    }
                    io.flush().await?;
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    return Err(TransportError::Unexpected(format!(
                        "subscriber fell {n} events behind; reconnect and reconcile"
                    )));
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            }
        }
    }
}

fn code_of(e: &TransportError) -> RefusalCode {
    match e {
        TransportError::Frame(crate::wire::FrameError::Version { .. }) => RefusalCode::Version,
        TransportError::Frame(_) | TransportError::Unexpected(_) => RefusalCode::BadRequest,
        _ => RefusalCode::Internal,
    }
}

async fn close(io: &mut FrameIo<BoxConn>, code: RefusalCode, message: String) {
    let message = if code == RefusalCode::Version {
        format!("{message}; this rank speaks protocol version {PROTOCOL_VERSION}")
    } else {
        message
    };
    let _ = io.write(&Frame::Error { code, message }).await;
}
