//! The KV-event feeds: one task per engine publisher (an engine with data-parallel ranks has one
//! per rank, on its port + rank) that keeps the [`PrefixIndex`] true to what the engine holds.
//!
//! A feed is *live* while its messages arrive in order on its topic. It is not, and its engine
//! falls back to approximate entries (what the gateway routed there), when:
//! - it cannot connect (**lost**), with the error kept for `/admin`;
//! - messages arrive on another topic than the configured one (**other topic**: vLLM publishes on
//!   `""` by default, and a subscriber on another prefix would otherwise get nothing, silently);
//! - requests with whole blocks were sent to the engine and nothing came within `silent_after`
//!   (**silent**: events not enabled, prefix caching off, or another port).
//!
//! Messages lost in between (their sequence numbers skip) are asked of the engine's replay socket
//! when one is configured; a gateway that starts late asks it for everything it still holds. When
//! the gap cannot be replayed, or the engine started again (its sequence went back to 0), what
//! the feed had said is forgotten, since the engine's cache is no longer known.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use super::PrefixIndex;
use crate::kv_events::{EventError, Message, Next, Subscriber, replay};

/// How long a connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a replay may take in all.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(10);
/// Most messages one replay applies (vLLM keeps 10,000 batches by default).
pub const MAX_REPLAY: usize = 100_000;
/// Longest wait between connection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// One publisher to subscribe to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedConfig {
    /// The engine's number in the index.
    pub engine: usize,
    /// Its data-parallel rank.
    pub rank: u16,
    /// `host:port` or `tcp://host:port`.
    pub endpoint: String,
    /// The replay socket, if the engine has one.
    pub replay: Option<String>,
    pub topic: String,
}

/// Where a feed stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FeedState {
    Connecting = 0,
    Live = 1,
    Lost = 2,
    Silent = 3,
    OtherTopic = 4,
}

impl FeedState {
    pub const ALL: [Self; 5] = [Self::Connecting, Self::Live, Self::Lost, Self::Silent, Self::OtherTopic];

    pub fn name(self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::Live => "live",
            Self::Lost => "lost",
            Self::Silent => "silent",
            Self::OtherTopic => "other_topic",
        }
    }

    fn from_u8(v: u8) -> Self {
        Self::ALL.get(usize::from(v)).copied().unwrap_or(Self::Lost)
    }
}

/// One feed's state and counters (shared by its task, the ticker, `/admin` and metrics).
#[derive(Debug)]
pub struct FeedStatus {
    pub config: FeedConfig,
    state: AtomicU8,
    pub messages: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_removed: AtomicU64,
    pub orphaned: AtomicU64,
    /// Messages the sequence numbers say were lost.
    pub missed: AtomicU64,
    pub replays: AtomicU64,
    pub replay_failures: AtomicU64,
    /// Messages applied from replays.
    pub replayed: AtomicU64,
    /// Times the engine's sequence went back (it started again).
    pub restarts: AtomicU64,
    pub other_topic_messages: AtomicU64,
    /// Messages that did not decode.
    pub decode_errors: AtomicU64,
    /// Milliseconds after the feeds' start of the last message (0: none yet).
    last_message_ms: AtomicU64,
    /// When a request with whole blocks was first sent to the engine after its last message
    /// (0: none waiting).
    routed_since_ms: AtomicU64,
    /// The last connection or decoding error, and the other topic last seen.
    pub last_error: Mutex<Option<String>>,
    pub other_topic: Mutex<Option<String>>,
}

impl FeedStatus {
    fn new(config: FeedConfig) -> Self {
        Self {
            config,
            state: AtomicU8::new(FeedState::Connecting as u8),
            messages: AtomicU64::new(0),
            blocks_stored: AtomicU64::new(0),
            blocks_removed: AtomicU64::new(0),
            orphaned: AtomicU64::new(0),
            missed: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            replay_failures: AtomicU64::new(0),
            replayed: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            other_topic_messages: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            last_message_ms: AtomicU64::new(0),
            routed_since_ms: AtomicU64::new(0),
            last_error: Mutex::new(None),
            other_topic: Mutex::new(None),
        }
    }

    /// The state the feed's task last set (not counting silence; see [`Feeds::state`]).
    fn task_state(&self) -> FeedState {
        FeedState::from_u8(self.state.load(Ordering::Relaxed))
    }

    fn set(&self, s: FeedState) {
        self.state.store(s as u8, Ordering::Relaxed);
    }

    fn error(&self, e: impl ToString) {
        *self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e.to_string());
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    pub fn seen_topic(&self) -> Option<String> {
        self.other_topic.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// Every feed, the index they fill, and their tasks (aborted when this is dropped).
#[derive(Debug)]
pub struct Feeds {
    pub index: Arc<PrefixIndex>,
    feeds: Vec<Arc<FeedStatus>>,
    epoch: Instant,
    silent_after: Duration,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Feeds {
    fn drop(&mut self) {
        for t in self.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).drain(..) {
            t.abort();
        }
    }
}

impl Feeds {
    /// The feeds, not started (no task runs; [`Feeds::start`] starts them).
    pub fn new(index: Arc<PrefixIndex>, configs: Vec<FeedConfig>, silent_after: Duration) -> Arc<Self> {
        Arc::new(Self {
            index,
            feeds: configs.into_iter().map(|c| Arc::new(FeedStatus::new(c))).collect(),
            epoch: Instant::now(),
            silent_after,
            tasks: Mutex::new(Vec::new()),
        })
    }

    /// Starts a task per feed, and one that marks silent feeds, updates which engines are exact
    /// and sweeps expired approximate entries. Must run inside a Tokio runtime.
    pub fn start(self: &Arc<Self>, sweep_every: Duration) {
        let mut tasks = self.tasks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for f in &self.feeds {
            tasks.push(tokio::spawn(run(Arc::downgrade(self), Arc::clone(f))));
        }
        let weak = Arc::downgrade(self);
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            let mut last_sweep = Instant::now();
            loop {
                tick.tick().await;
                let Some(feeds) = weak.upgrade() else { return };
                feeds.refresh_exact();
                if last_sweep.elapsed() >= sweep_every {
                    feeds.index.sweep();
                    last_sweep = Instant::now();
                }
            }
        }));
    }

    pub fn feeds(&self) -> &[Arc<FeedStatus>] {
        &self.feeds
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX).max(1)
    }

    /// The feed's state, silence included.
    pub fn state(&self, f: &FeedStatus) -> FeedState {
        let s = f.task_state();
        let since = f.routed_since_ms.load(Ordering::Relaxed);
        let silent = since != 0
            && self.now_ms().saturating_sub(since)
                > u64::try_from(self.silent_after.as_millis()).unwrap_or(u64::MAX);
        match s {
            FeedState::Live | FeedState::Connecting if silent => FeedState::Silent,
            s => s,
        }
    }

    /// Whether the engine has feeds at all.
    pub fn has_feed(&self, engine: usize) -> bool {
        self.feeds.iter().any(|f| f.config.engine == engine)
    }

    /// A request whose prompt has whole blocks was sent to `engine`: its publisher should speak
    /// within `silent_after`.
    pub fn routed(&self, engine: usize) {
        let now = self.now_ms();
        for f in self.feeds.iter().filter(|f| f.config.engine == engine) {
            let _ = f.routed_since_ms.compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// Marks each engine with feeds exact when every one of them is live.
    pub fn refresh_exact(&self) {
        for e in 0..self.index.engines().len() {
            let mut mine = self.feeds.iter().filter(|f| f.config.engine == e).peekable();
            if mine.peek().is_none() {
                continue;
            }
            let live = mine.all(|f| self.state(f) == FeedState::Live);
            self.index.set_exact(e, live);
        }
    }

    fn heard(&self, f: &FeedStatus) {
        f.last_message_ms.store(self.now_ms(), Ordering::Relaxed);
        f.routed_since_ms.store(0, Ordering::Relaxed);
    }

    fn apply(&self, f: &FeedStatus, m: &Message) {
        let a = self.index.apply(f.config.engine, f.config.rank, &m.batch);
        f.messages.fetch_add(1, Ordering::Relaxed);
        f.blocks_stored.fetch_add(a.stored, Ordering::Relaxed);
        f.blocks_removed.fetch_add(a.removed + a.cleared, Ordering::Relaxed);
        f.orphaned.fetch_add(a.orphaned, Ordering::Relaxed);
    }

    /// Replays from `from` (up to, not including, `until` when given) and applies what came;
    /// false when no replay socket is configured or the replay failed.
    async fn replay(&self, f: &FeedStatus, from: u64, until: Option<u64>) -> Option<u64> {
        let addr = f.config.replay.as_deref()?;
        f.replays.fetch_add(1, Ordering::Relaxed);
        match replay(addr, from, f.config.topic.as_bytes(), MAX_REPLAY, REPLAY_TIMEOUT).await {
            Ok(messages) => {
                let mut last = None;
                for m in messages.iter().filter(|m| m.seq >= from && until.is_none_or(|u| m.seq < u)) {
                    self.apply(f, m);
                    f.replayed.fetch_add(1, Ordering::Relaxed);
                    last = Some(m.seq);
                }
                self.heard(f);
                Some(last.map_or(from, |l| l + 1))
            }
            Err(e) => {
                f.replay_failures.fetch_add(1, Ordering::Relaxed);
                f.error(format!("replay from {from}: {e}"));
                None
            }
        }
    }
}

async fn run(feeds: std::sync::Weak<Feeds>, f: Arc<FeedStatus>) {
    let mut backoff = Duration::from_millis(200);
    loop {
        f.set(FeedState::Connecting);
        let sub =
            Subscriber::connect_to(&f.config.endpoint, f.config.topic.as_bytes(), CONNECT_TIMEOUT).await;
        let Some(this) = feeds.upgrade() else { return };
        let mut sub = match sub {
            Ok(s) => s,
            Err(e) => {
                f.error(format!("connecting to {}: {e}", f.config.endpoint));
                f.set(FeedState::Lost);
                drop(this);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        // What this gateway missed before subscribing (it started after the engine, or the
        // connection was lost): what the engine still holds comes from its replay socket.
        // Without one, what the feed said before can no longer be trusted.
        this.index.clear_feed(f.config.engine, f.config.rank);
        let mut replayed_to = this.replay(&f, 0, None).await;
        f.set(FeedState::Live);
        drop(this);
        loop {
            let next = sub.next_any().await;
            let Some(this) = feeds.upgrade() else { return };
            match next {
                Ok(Next::Message { message, missed, restarted }) => {
                    // Live messages that the first replay already applied.
                    if let Some(to) = replayed_to {
                        if message.seq < to && !restarted {
                            continue;
                        }
                        replayed_to = None;
                    }
                    this.heard(&f);
                    if f.task_state() != FeedState::Live {
                        f.set(FeedState::Live);
                    }
                    if restarted {
                        f.restarts.fetch_add(1, Ordering::Relaxed);
                        this.index.clear_feed(f.config.engine, f.config.rank);
                    } else if missed > 0 {
                        f.missed.fetch_add(missed, Ordering::Relaxed);
                        let from = message.seq - missed;
                        if this.replay(&f, from, Some(message.seq)).await.is_none() {
                            this.index.clear_feed(f.config.engine, f.config.rank);
                        }
                    }
                    this.apply(&f, &message);
                }
                Ok(Next::OtherTopic(topic)) => {
                    f.other_topic_messages.fetch_add(1, Ordering::Relaxed);
                    *f.other_topic.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(topic);
                    if f.messages.load(Ordering::Relaxed) == 0 {
                        f.set(FeedState::OtherTopic);
                    }
                }
                Err(e @ EventError::Zmq(_)) => {
                    f.error(e);
                    f.set(FeedState::Lost);
                    break;
                }
                // A message that does not decode is lost, and the next one's sequence number
                // shows the gap (replayed, or the feed's entries forgotten).
                Err(e) => {
                    f.decode_errors.fetch_add(1, Ordering::Relaxed);
                    f.error(e);
                }
            }
        }
    }
}
