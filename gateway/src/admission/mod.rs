//! Admission per decoder: a weighted fair queue in slots, where a request's slots are the pages its
//! KV cache needs in the decoder's PD buffer (`ceil(prompt_tokens / chunk_tokens)`).
//!
//! - A request needing more slots than the whole buffer is refused at once (`TooLarge`, naming both
//!   numbers); one that fits waits, even if it needs the whole buffer.
//! - Waiters are served by start-time fair queuing across priority classes (each class gets slots
//!   in proportion to its weight), FIFO within a class. The chosen head is never overtaken: if it
//!   does not fit yet, nothing behind it is granted, so a large request cannot starve.
//! - Queue length and queue wait are bounded (`QueueFull`, `Timeout`, both retryable).
//! - A queue can be closed ([`SlotQueue::set_open`]: the engine says it is full): it then admits
//!   nothing at all, and its waiters keep their places until it opens or they time out.
//! - Slots are a [`SlotGuard`] released in `Drop`, exactly once; a waiter that gives up (client gone,
//!   deadline) leaves the queue in its own `Drop`, so nobody waits behind a ghost.
//!
//! This module knows nothing of HTTP or of the data plane's wire; the handoff holds a guard until the
//! decoder reports the pages free.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use thiserror::Error;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// Most requests waiting for one decoder: beyond it clients are told to come back (429) rather
/// than queue for longer than any deadline allows.
pub const DEFAULT_MAX_QUEUE: usize = 1024;

/// Longest a request waits for room before it is answered 503 with `Retry-After`.
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(30);

/// Weight of a priority class nobody configured.
pub const DEFAULT_WEIGHT: f64 = 1.0;

/// How a request enters a queue: its priority class and, when a policy set one, its own longest
/// wait (never longer than the gateway's queue timeout).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ticket {
    pub class: u8,
    pub max_wait: Option<Duration>,
}

impl Ticket {
    /// The wait to use, given the gateway's queue timeout.
    pub fn wait(&self, queue_timeout: Duration) -> Duration {
        self.max_wait.map_or(queue_timeout, |w| w.min(queue_timeout))
    }
}

/// Why a request was not admitted.
#[derive(Debug, Error, PartialEq, Clone)]
#[non_exhaustive]
pub enum AdmissionError {
    /// The request needs more slots than the decoder has in all: it can never be admitted.
    #[error("request needs {need} slots but the decoder buffer holds {capacity}")]
    TooLarge { need: u32, capacity: u32 },
    /// The decoder's queue already holds as many waiting requests as it may.
    #[error("{limit} requests are already waiting for this decoder")]
    QueueFull { limit: usize },
    /// The request waited for room as long as it may.
    #[error("no room for {need} slots within {waited:?}")]
    Timeout { need: u32, waited: Duration },
}

impl AdmissionError {
    /// Whether the same request may succeed later.
    pub fn retryable(&self) -> bool {
        !matches!(self, Self::TooLarge { .. })
    }
}

/// Limits and weights of one decoder's queue.
#[derive(Clone, Debug)]
pub struct QueueConfig {
    /// Most waiters (default [`DEFAULT_MAX_QUEUE`]).
    pub max_queue: usize,
    /// `(priority class, weight)`; classes not listed weigh [`DEFAULT_WEIGHT`].
    pub weights: Vec<(u8, f64)>,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self { max_queue: DEFAULT_MAX_QUEUE, weights: Vec::new() }
    }
}

/// The part of a queue's state routing reads on every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLoad {
    pub capacity: u32,
    pub in_use: u32,
    pub waiting_slots: u64,
    /// Requests holding slots (admitted, not yet released).
    pub holders: u32,
    /// Whether the queue admits (false: closed, no slot is free whatever `capacity` says).
    pub open: bool,
    /// Requests waiting.
    pub waiting: u32,
    /// The slots this gateway replica may hold of the decoder's, when replicas share it through a
    /// store (`[cluster]`); `None`: all of `capacity`.
    pub share: Option<u32>,
}

impl QueueLoad {
    /// Whether a request of `need` slots would be admitted now, without waiting.
    pub fn admits_now(&self, need: u32) -> bool {
        self.waiting == 0 && self.free() >= need
    }

    /// Slots a new request could take now: none while the queue is closed.
    pub fn free(&self) -> u32 {
        if self.open { self.limit().saturating_sub(self.in_use) } else { 0 }
    }

    /// The most slots this replica may hold: the capacity, or its share of it.
    pub fn limit(&self) -> u32 {
        limit(self.capacity, self.share)
    }
}

/// The capacity, or a replica's share of it.
fn limit(capacity: u32, share: Option<u32>) -> u32 {
    share.map_or(capacity, |s| s.min(capacity))
}

/// What a queue wants ([`SlotQueue::demand`]): for the share a replica asks of the cluster store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    /// Slots held.
    pub in_use: u32,
    /// Slots held and waited for.
    pub want: u64,
    /// Slots the next waiter to be served needs (0: nobody waits).
    pub head: u32,
    /// How long that waiter has waited.
    pub head_age: Duration,
}

/// A snapshot of a queue.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QueueStats {
    pub capacity: u32,
    pub in_use: u32,
    pub waiting: usize,
    pub waiting_slots: u64,
    pub oldest_wait: Option<Duration>,
    /// Slot releases that found fewer slots in use than they returned; always 0 unless there is a bug.
    pub accounting_errors: u64,
    /// Releases held back for the engine to notice an abandoned request ([`SlotGuard::engine_has_it`]).
    pub lingered: u64,
    /// Whether the queue admits ([`SlotQueue::set_open`]).
    pub open: bool,
    /// This replica's share of the capacity ([`SlotQueue::set_share`]), when replicas share it.
    pub share: Option<u32>,
}

struct Waiter {
    id: u64,
    slots: u32,
    start: f64,
    enqueued: Instant,
    tx: oneshot::Sender<SlotGuard>,
}

struct Class {
    weight: f64,
    queue: VecDeque<Waiter>,
    last_finish: f64,
}

struct State {
    capacity: u32,
    in_use: u32,
    config: QueueConfig,
    classes: BTreeMap<u8, Class>,
    /// Virtual time: the start tag of the last waiter served.
    vtime: f64,
    next_id: u64,
    waiting: usize,
    /// Slots the waiters need, kept up to date so routing can read it without walking the queue.
    waiting_slots: u64,
    /// Guards outstanding.
    holders: u32,
    accounting_errors: u64,
    lingered: u64,
    /// False while the engine says it is full: nothing is admitted, waiters keep their places.
    open: bool,
    /// Told whenever room may have appeared (slots returned, the queue opened or grew).
    watcher: Option<Arc<tokio::sync::Notify>>,
    /// This replica's share of `capacity` when replicas share the decoder (`None`: all of it).
    share: Option<u32>,
    /// Told whenever a request starts waiting (the cluster asks the store for a larger share).
    demand: Option<Arc<tokio::sync::Notify>>,
}

impl State {
    /// The most slots admitted requests may hold: the capacity, or this replica's share of it.
    fn limit(&self) -> u32 {
        limit(self.capacity, self.share)
    }

    fn weight(&self, class: u8) -> f64 {
        self.config.weights.iter().find(|(c, _)| *c == class).map_or(DEFAULT_WEIGHT, |(_, w)| *w).max(1e-6)
    }

    /// The class whose head has the smallest start tag (ties: the higher class).
    fn next_class(&self) -> Option<u8> {
        self.classes
            .iter()
            .rev()
            .filter_map(|(c, k)| k.queue.front().map(|w| (*c, w.start)))
            .fold(None, |best: Option<(u8, f64)>, (c, s)| match best {
                Some((_, bs)) if bs <= s => best,
                _ => Some((c, s)),
            })
            .map(|(c, _)| c)
    }
}

/// One decoder's admission queue. Cheap to clone (a handle).
#[derive(Clone)]
pub struct SlotQueue {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for SlotQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotQueue").field("stats", &self.stats()).finish()
    }
}

/// Slots held by an admitted request; returned to the queue when dropped.
#[must_use = "dropping the guard releases the slots"]
pub struct SlotGuard {
    state: Arc<Mutex<State>>,
    slots: u32,
    /// While an engine runs the request with no way to say it stopped (`engine_has_it`): how
    /// long the slots stay held after the guard is dropped.
    linger: Option<std::time::Duration>,
    /// Counted in `lingered` already ([`SlotGuard::wait_out`]): a slot is counted once.
    counted: bool,
}

impl std::fmt::Debug for SlotGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotGuard").field("slots", &self.slots).finish()
    }
}

impl SlotGuard {
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The engine has the request and counts it until it notices it was abandoned: dropped before
    /// [`SlotGuard::engine_done`], the slots are held `grace` longer (the engine's time to see
    /// the closed connection and free the request), so the engine never runs more than the
    /// slots say.
    pub fn engine_has_it(&mut self, grace: std::time::Duration) {
        self.linger = Some(grace).filter(|g| !g.is_zero());
    }

    /// The engine's answer ended: it holds nothing of the request any more.
    pub fn engine_done(&mut self) {
        self.linger = None;
    }

    /// Waits `grace` holding the slots, for the engine to drop a call that was cut off before the
    /// slots are used again (counted as a linger, as a dropped guard's grace is).
    pub async fn wait_out(&mut self, grace: std::time::Duration) {
        if grace.is_zero() {
            return;
        }
        if !std::mem::replace(&mut self.counted, true) {
            lock(&self.state).lingered += 1;
        }
        tokio::time::sleep(grace).await;
    }
}

/// Returns `slots` to the queue and grants who fits.
fn release(state: &Arc<Mutex<State>>, slots: u32) {
    let grants = {
        let mut s = lock(state);
        s.holders = s.holders.saturating_sub(1);
        match s.in_use.checked_sub(slots) {
            Some(v) => s.in_use = v,
            None => s.accounting_errors += 1,
        }
        if let Some(w) = &s.watcher {
            w.notify_one();
        }
        grant(state, &mut s)
    };
    deliver(grants);
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Grants every head that fits, in fair order, and returns what to deliver once the lock is gone.
fn grant(state: &Arc<Mutex<State>>, s: &mut State) -> Vec<(oneshot::Sender<SlotGuard>, SlotGuard)> {
    let mut out = Vec::new();
    let limit = s.limit();
    while let Some(c) = s.next_class() {
        let Some(class) = s.classes.get_mut(&c) else { break };
        let Some(head) = class.queue.front() else { break };
        if !s.open || u64::from(s.in_use) + u64::from(head.slots) > u64::from(limit) {
            // The head waits and nothing overtakes it.
            break;
        }
        let Some(w) = class.queue.pop_front() else { break };
        s.vtime = w.start;
        s.in_use += w.slots;
        s.holders += 1;
        s.waiting -= 1;
        s.waiting_slots -= u64::from(w.slots);
        out.push((
            w.tx,
            SlotGuard { state: Arc::clone(state), slots: w.slots, linger: None, counted: false },
        ));
    }
    out
}

/// Hands granted guards to their waiters; a waiter that already left gets its guard dropped here,
/// outside the lock, which returns the slots.
fn deliver(grants: Vec<(oneshot::Sender<SlotGuard>, SlotGuard)>) {
    for (tx, guard) in grants {
        if let Err(orphan) = tx.send(guard) {
            drop(orphan);
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(grace) = self.linger
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            if !self.counted {
                lock(&self.state).lingered += 1;
            }
            let (state, slots) = (Arc::clone(&self.state), self.slots);
            rt.spawn(async move {
                tokio::time::sleep(grace).await;
                release(&state, slots);
            });
            return;
        }
        release(&self.state, self.slots);
    }
}

/// Removes a waiter that stopped waiting (deadline, client gone) so nobody waits behind it.
struct Pending {
    state: Arc<Mutex<State>>,
    class: u8,
    id: u64,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let grants = {
            let mut s = lock(&self.state);
            let removed = s.classes.get_mut(&self.class).and_then(|c| {
                let at = c.queue.iter().position(|w| w.id == self.id)?;
                c.queue.remove(at)
            });
            if let Some(w) = removed {
                s.waiting -= 1;
                s.waiting_slots -= u64::from(w.slots);
            }
            grant(&self.state, &mut s)
        };
        deliver(grants);
    }
}

impl SlotQueue {
    /// A queue over `capacity` slots (the decoder's PD buffer pages, as its data plane reports).
    pub fn new(capacity: u32, config: QueueConfig) -> Self {
        let state = State {
            capacity,
            in_use: 0,
            config,
            classes: BTreeMap::new(),
            vtime: 0.0,
            next_id: 0,
            waiting: 0,
            waiting_slots: 0,
            holders: 0,
            accounting_errors: 0,
            lingered: 0,
            open: true,
            watcher: None,
            share: None,
            demand: None,
        };
        Self { state: Arc::new(Mutex::new(state)) }
    }

    /// Admits a request of `slots` slots in priority class `class`, waiting at most `timeout`.
    pub async fn acquire(
        &self,
        slots: u32,
        class: u8,
        timeout: Duration,
    ) -> Result<SlotGuard, AdmissionError> {
        let started = Instant::now();
        let (rx, pending) = {
            let mut s = lock(&self.state);
            if slots > s.capacity {
                return Err(AdmissionError::TooLarge { need: slots, capacity: s.capacity });
            }
            if s.open && s.waiting == 0 && u64::from(s.in_use) + u64::from(slots) <= u64::from(s.limit()) {
                s.in_use += slots;
                s.holders += 1;
                return Ok(SlotGuard { state: Arc::clone(&self.state), slots, linger: None, counted: false });
            }
            if s.waiting >= s.config.max_queue {
                return Err(AdmissionError::QueueFull { limit: s.config.max_queue });
            }
            let weight = s.weight(class);
            let vtime = s.vtime;
            let id = s.next_id;
            s.next_id += 1;
            s.waiting += 1;
            s.waiting_slots += u64::from(slots);
            let (tx, rx) = oneshot::channel();
            let c =
                s.classes.entry(class).or_insert(Class { weight, queue: VecDeque::new(), last_finish: 0.0 });
            let start = vtime.max(c.last_finish);
            c.last_finish = start + f64::from(slots.max(1)) / c.weight;
            c.queue.push_back(Waiter { id, slots, start, enqueued: started, tx });
            if let Some(d) = &s.demand {
                d.notify_one();
            }
            (rx, Pending { state: Arc::clone(&self.state), class, id })
        };
        let result = tokio::time::timeout(timeout, rx).await;
        drop(pending);
        match result {
            Ok(Ok(guard)) => Ok(guard),
            // Dropped without a grant: the capacity shrank below the request.
            Ok(Err(_)) => {
                let capacity = lock(&self.state).capacity;
                Err(AdmissionError::TooLarge { need: slots, capacity })
            }
            Err(_) => Err(AdmissionError::Timeout { need: slots, waited: started.elapsed() }),
        }
    }

    /// Sets the capacity (the decoder reported a new buffer size). Waiters that no longer fit are
    /// refused as too large; a larger capacity admits waiters at once.
    pub fn resize(&self, capacity: u32) {
        let (grants, refused) = {
            let mut s = lock(&self.state);
            s.capacity = capacity;
            let mut refused = Vec::new();
            for c in s.classes.values_mut() {
                let (keep, drop_): (VecDeque<Waiter>, VecDeque<Waiter>) =
                    c.queue.drain(..).partition(|w| w.slots <= capacity);
                c.queue = keep;
                refused.extend(drop_);
            }
            s.waiting -= refused.len();
            s.waiting_slots -= refused.iter().map(|w| u64::from(w.slots)).sum::<u64>();
            if let Some(w) = &s.watcher {
                w.notify_one();
            }
            (grant(&self.state, &mut s), refused)
        };
        drop(refused);
        deliver(grants);
    }

    /// Has `notify` told whenever room may have appeared: slots returned, the queue opened or
    /// resized (the gateway's flow control lets its next waiter go then).
    pub fn watch(&self, notify: Arc<tokio::sync::Notify>) {
        lock(&self.state).watcher = Some(notify);
    }

    /// Sets this replica's share of the capacity (`None`: all of it), as the replicas' store
    /// granted it. Slots already held above a smaller share stay held; nothing more is admitted
    /// until they are returned below it. Waiters keep their places (a share is not the buffer:
    /// nobody is refused as too large for it).
    pub fn set_share(&self, share: Option<u32>) {
        let grants = {
            let mut s = lock(&self.state);
            if s.share == share {
                return;
            }
            let grew = limit(s.capacity, share) > s.limit();
            s.share = share;
            if let Some(w) = s.watcher.as_ref().filter(|_| grew) {
                w.notify_one();
            }
            grant(&self.state, &mut s)
        };
        deliver(grants);
    }

    /// Has `notify` told whenever a request starts waiting (the cluster's store is asked for more).
    pub fn watch_demand(&self, notify: Arc<tokio::sync::Notify>) {
        lock(&self.state).demand = Some(notify);
    }

    /// What this replica wants of the decoder, in constant time.
    pub fn demand(&self) -> Demand {
        let s = lock(&self.state);
        let head = s.next_class().and_then(|c| s.classes.get(&c)?.queue.front());
        Demand {
            in_use: s.in_use,
            want: u64::from(s.in_use) + s.waiting_slots,
            head: head.map_or(0, |w| w.slots),
            head_age: head.map_or(Duration::ZERO, |w| w.enqueued.elapsed()),
        }
    }

    /// Opens or closes the queue. Closed, it admits nothing (not even one request when none is in
    /// flight: an engine that says it is full gets no more work); its waiters stay queued, within
    /// their own timeouts, and opening admits them in their order.
    pub fn set_open(&self, open: bool) {
        let grants = {
            let mut s = lock(&self.state);
            if s.open == open {
                return;
            }
            s.open = open;
            if let Some(w) = s.watcher.as_ref().filter(|_| open) {
                w.notify_one();
            }
            grant(&self.state, &mut s)
        };
        deliver(grants);
    }

    /// What routing needs, in constant time: `(capacity, slots in use, slots waited for)`.
    pub fn load(&self) -> QueueLoad {
        let s = lock(&self.state);
        QueueLoad {
            capacity: s.capacity,
            in_use: s.in_use,
            waiting_slots: s.waiting_slots,
            holders: s.holders,
            open: s.open,
            waiting: u32::try_from(s.waiting).unwrap_or(u32::MAX),
            share: s.share,
        }
    }

    /// Requests waiting, in constant time.
    pub fn waiting(&self) -> u32 {
        u32::try_from(lock(&self.state).waiting).unwrap_or(u32::MAX)
    }

    /// A snapshot (walks the waiters; for admin endpoints and metrics, not per request). A query.
    pub fn stats(&self) -> QueueStats {
        let s = lock(&self.state);
        let now = Instant::now();
        let waiters = s.classes.values().flat_map(|c| c.queue.iter());
        let (mut waiting_slots, mut oldest) = (0u64, None::<Instant>);
        for w in waiters {
            waiting_slots += u64::from(w.slots);
            oldest = Some(oldest.map_or(w.enqueued, |o| o.min(w.enqueued)));
        }
        QueueStats {
            capacity: s.capacity,
            in_use: s.in_use,
            waiting: s.waiting,
            waiting_slots,
            oldest_wait: oldest.map(|o| now.saturating_duration_since(o)),
            accounting_errors: s.accounting_errors,
            lingered: s.lingered,
            open: s.open,
            share: s.share,
        }
    }
}

#[cfg(test)]
mod tests;
