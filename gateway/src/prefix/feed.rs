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

use serde_json::json;
use tokio::task::JoinHandle;

use super::PrefixIndex;
use crate::kv_events::{EventError, Message, Next, Subscriber, replay};
use crate::telemetry::Scrape;

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
    /// Live, but what the engine held before a gap could not be replayed: its exact entries are
    /// incomplete for a while (`routed_ttl`), and what is routed to it counts meanwhile.
    Resyncing = 5,
}

impl FeedState {
    pub const ALL: [Self; 6] =
        [Self::Connecting, Self::Live, Self::Lost, Self::Silent, Self::OtherTopic, Self::Resyncing];

    pub fn name(self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::Live => "live",
            Self::Lost => "lost",
            Self::Silent => "silent",
            Self::OtherTopic => "other_topic",
            Self::Resyncing => "resyncing",
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
    /// Messages received live (not replayed) on the topic.
    pub live_messages: AtomicU64,
    /// Until when (ms after the feeds' start) the feed is resyncing (0: it is not).
    resync_until_ms: AtomicU64,
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
            live_messages: AtomicU64::new(0),
            resync_until_ms: AtomicU64::new(0),
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
    /// Prompt tokens routed, and of them those the chosen engine held, per pool (prefill, decode).
    routed_tokens: [AtomicU64; 2],
    cached_routed_tokens: [AtomicU64; 2],
    /// A decoder holding all but this many of a prompt's tokens gets it alone (no prefill leg).
    pub skip_prefill_within: Option<u32>,
    /// Requests sent to their decoder alone.
    prefill_skipped: AtomicU64,
    epoch: Instant,
    silent_after: Duration,
    /// How long a feed resyncs after a gap it could not replay.
    resync_for: Duration,
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
    pub fn new(
        index: Arc<PrefixIndex>,
        configs: Vec<FeedConfig>,
        silent_after: Duration,
        resync_for: Duration,
        skip_prefill_within: Option<u32>,
    ) -> Arc<Self> {
        Arc::new(Self {
            index,
            feeds: configs.into_iter().map(|c| Arc::new(FeedStatus::new(c))).collect(),
            routed_tokens: Default::default(),
            cached_routed_tokens: Default::default(),
            skip_prefill_within,
            prefill_skipped: AtomicU64::new(0),
            epoch: Instant::now(),
            silent_after,
            resync_for,
            tasks: Mutex::new(Vec::new()),
        })
    }

    /// The index over `engines` (prefills first, then decoders) and its feeds as configured,
    /// started. Must run inside a Tokio runtime.
    pub fn start_with(engines: Vec<String>, s: crate::config::cache::PrefixSettings) -> Arc<Self> {
        let index = Arc::new(PrefixIndex::new(engines, s.block_size, s.max_blocks, s.routed_ttl));
        let feeds = Self::new(index, s.feeds, s.silent_after, s.routed_ttl, s.skip_prefill_within);
        feeds.start((s.routed_ttl / 4).max(Duration::from_secs(1)));
        feeds
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
        let resyncing = f.resync_until_ms.load(Ordering::Relaxed) > self.now_ms();
        match s {
            FeedState::Live | FeedState::Connecting if silent => FeedState::Silent,
            FeedState::Live if resyncing => FeedState::Resyncing,
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

    /// Whether a prompt of `tokens` goes alone to the decoder `engine` (numbered after the
    /// prefills), which holds `cached` of them, while the routed prefiller holds
    /// `prefill_cached`. The decoder must hold at least one block, as its own live events say
    /// (approximate entries are what was routed there, not KV it computed: parallel or retried
    /// requests would go alone on a guess), and all but `skip_prefill_within` tokens; or all but
    /// twice that when the prefiller would compute at least `skip_prefill_within` more than the
    /// decoder alone. A prefiller falls behind on a conversation whose turns went alone: sending
    /// the next one to it would compute every turn it missed, where the decoder computes one.
    pub fn skips_prefill(&self, engine: usize, tokens: usize, cached: u32, prefill_cached: u32) -> bool {
        let exact = self.index.engines().get(engine).is_some_and(super::EngineState::exact);
        self.skip_prefill_within.is_some_and(|within| {
            let within = within as usize;
            let alone = tokens.saturating_sub(cached as usize);
            let with_leg = tokens.saturating_sub(prefill_cached as usize);
            let behind = with_leg >= alone.saturating_add(within);
            exact && cached > 0 && (alone <= within || (behind && alone <= within.saturating_mul(2)))
        })
    }

    /// Counts a request sent to its decoder alone.
    pub fn count_skip(&self) {
        self.prefill_skipped.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a routed prompt of `prompt` tokens, `cached` of which the chosen engine of `pool`
    /// (0 prefill, 1 decode) held.
    pub fn count_route(&self, pool: usize, prompt: usize, cached: u32) {
        if let (Some(r), Some(c)) = (self.routed_tokens.get(pool), self.cached_routed_tokens.get(pool)) {
            r.fetch_add(prompt as u64, Ordering::Relaxed);
            c.fetch_add(u64::from(cached), Ordering::Relaxed);
        }
    }

    /// The index's and the feeds' series for `/metrics`.
    pub fn scrape(&self, s: &mut Scrape) {
        let c = self.index.counts();
        s.counter(
            "baton_prefill_skipped_total",
            "Requests sent to their decoder alone, with no prefill leg: it held all but routing.cache.skip_prefill_within of the prompt.",
            &[],
            self.prefill_skipped.load(Ordering::Relaxed) as f64,
        );
        let help = "(engine, block) entries in the block index, by where they came from.";
        s.gauge(
            "baton_prefix_index_entries",
            help,
            &[("source", "events")],
            (c.entries - c.routed_entries) as f64,
        );
        s.gauge("baton_prefix_index_entries", help, &[("source", "routed")], c.routed_entries as f64);
        s.gauge("baton_prefix_index_keys", "Distinct block keys in the block index.", &[], c.keys as f64);
        s.counter(
            "baton_prefix_index_dropped_total",
            "Entries not indexed because the index was full (routing.cache.max_blocks).",
            &[],
            c.dropped as f64,
        );
        for (pool, i) in [("prefill", 0), ("decode", 1)] {
            let get = |a: &[AtomicU64; 2]| a.get(i).map_or(0.0, |v| v.load(Ordering::Relaxed) as f64);
            s.counter(
                "baton_route_prompt_tokens_total",
                "Prompt tokens of routed requests, per pool.",
                &[("pool", pool)],
                get(&self.routed_tokens),
            );
            s.counter(
                "baton_route_cached_tokens_total",
                "Of them, tokens the chosen engine held in KV cache as the index saw it (the hit ratio is their quotient).",
                &[("pool", pool)],
                get(&self.cached_routed_tokens),
            );
        }
        for (e, engine) in self.index.engines().iter().enumerate() {
            if self.has_feed(e) {
                s.gauge(
                    "baton_prefix_engine_exact",
                    "1 when every KV-event feed of the engine is live (0: it is matched by what was routed to it).",
                    &[("engine", &engine.name)],
                    f64::from(u8::from(engine.exact())),
                );
            }
        }
        for f in &self.feeds {
            let name = self.index.engines().get(f.config.engine).map_or("?", |e| e.name.as_str());
            let rank = f.config.rank.to_string();
            let labels = [("engine", name), ("rank", rank.as_str())];
            let now = self.state(f);
            for st in FeedState::ALL {
                let l = [("engine", name), ("rank", rank.as_str()), ("state", st.name())];
                s.gauge(
                    "baton_kv_events_feed_state",
                    "1 for the state a KV-event feed is in.",
                    &l,
                    f64::from(u8::from(st == now)),
                );
            }
            let n = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
            for (name, help, v) in [
                (
                    "baton_kv_events_messages_total",
                    "KV-event batches applied (live and replayed).",
                    &f.messages,
                ),
                (
                    "baton_kv_events_blocks_stored_total",
                    "Blocks the engine stored, indexed.",
                    &f.blocks_stored,
                ),
                (
                    "baton_kv_events_blocks_removed_total",
                    "Blocks the engine removed or cleared.",
                    &f.blocks_removed,
                ),
                (
                    "baton_kv_events_orphaned_blocks_total",
                    "Blocks stored under a parent the index never saw (not indexed).",
                    &f.orphaned,
                ),
                ("baton_kv_events_missed_total", "Batches the sequence numbers say were lost.", &f.missed),
                (
                    "baton_kv_events_replayed_total",
                    "Batches applied from the engine's replay socket.",
                    &f.replayed,
                ),
                (
                    "baton_kv_events_replay_failures_total",
                    "Replays that failed (the feed's entries were forgotten).",
                    &f.replay_failures,
                ),
                (
                    "baton_kv_events_restarts_total",
                    "Times the engine's sequence went back (it started again).",
                    &f.restarts,
                ),
                (
                    "baton_kv_events_other_topic_total",
                    "Messages on another topic than kv_events_topic.",
                    &f.other_topic_messages,
                ),
                ("baton_kv_events_decode_errors_total", "Messages that did not decode.", &f.decode_errors),
            ] {
                s.counter(name, help, &labels, n(v));
            }
        }
    }

    /// `/admin/cache`: the index's size and every feed's state and counters.
    pub fn view(&self) -> serde_json::Value {
        let c = self.index.counts();
        let exact = self.index.exact_blocks();
        let engines: Vec<serde_json::Value> = (self.index.engines().iter().enumerate())
            .map(|(e, engine)| {
                let media: serde_json::Map<String, serde_json::Value> =
                    exact.get(e).into_iter().flatten().map(|(m, n)| (m.clone(), json!(n))).collect();
                json!({"name": engine.name, "has_kv_events": self.has_feed(e), "exact": engine.exact(),
                       "block_size": self.index.block_size(e), "exact_blocks": media})
            })
            .collect();
        let feeds: Vec<serde_json::Value> = self
            .feeds
            .iter()
            .map(|f| {
                let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
                let last = f.last_message_ms.load(Ordering::Relaxed);
                json!({
                    "engine": self.index.engines().get(f.config.engine).map(|e| e.name.as_str()),
                    "rank": f.config.rank, "endpoint": f.config.endpoint, "replay": f.config.replay,
                    "topic": f.config.topic, "state": self.state(f).name(),
                    "last_message_ago_ms": (last != 0).then(|| self.now_ms().saturating_sub(last)),
                    "messages": n(&f.messages), "blocks_stored": n(&f.blocks_stored),
                    "blocks_removed": n(&f.blocks_removed), "orphaned_blocks": n(&f.orphaned),
                    "missed": n(&f.missed), "replays": n(&f.replays), "replayed": n(&f.replayed),
                    "replay_failures": n(&f.replay_failures), "restarts": n(&f.restarts),
                    "other_topic_messages": n(&f.other_topic_messages), "other_topic": f.seen_topic(),
                    "decode_errors": n(&f.decode_errors), "last_error": f.last_error(),
                })
            })
            .collect();
        json!({"entries": c.entries, "routed_entries": c.routed_entries, "keys": c.keys, "dropped": c.dropped,
               "engines": engines, "feeds": feeds})
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

    /// What the engine held could not all be had again: its entries are incomplete for
    /// `resync_for`, and it is routed as an engine without events meanwhile.
    fn resync(&self, f: &FeedStatus) {
        let until =
            self.now_ms().saturating_add(u64::try_from(self.resync_for.as_millis()).unwrap_or(u64::MAX));
        f.resync_until_ms.store(until, Ordering::Relaxed);
        self.refresh_exact();
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
                let mut next = from;
                let mut whole = true;
                for m in messages.iter().filter(|m| m.seq >= from && until.is_none_or(|u| m.seq < u)) {
                    // The publisher's buffer may have started past `from`, a batch may not have
                    // decoded: a hole means what the engine removed there is not known.
                    whole &= m.seq == next;
                    next = m.seq + 1;
                    self.apply(f, m);
                    f.replayed.fetch_add(1, Ordering::Relaxed);
                    last = Some(m.seq);
                }
                self.heard(f);
                if let Some(u) = until
                    && (!whole || next != u)
                {
                    f.replay_failures.fetch_add(1, Ordering::Relaxed);
                    f.error(format!("the replay from {from} did not hold every batch up to {u}"));
                    return None;
                }
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

/// The feed cannot reach its publisher: marked lost (its engine falls back), then a wait that
/// doubles while it stays so.
async fn lost(feeds: Arc<Feeds>, f: &FeedStatus, why: String, backoff: &mut Duration) {
    f.error(why);
    f.set(FeedState::Lost);
    feeds.refresh_exact();
    drop(feeds);
    tokio::time::sleep(*backoff).await;
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
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
                lost(this, &f, format!("connecting to {}: {e}", f.config.endpoint), &mut backoff).await;
                continue;
            }
        };
        // What this gateway missed before subscribing (it started after the engine, the
        // connection was lost, the engine started again): what the engine still holds comes from
        // its replay socket. Without one, what the feed said before can no longer be trusted.
        this.index.clear_feed(f.config.engine, f.config.rank);
        match this.replay(&f, 0, None).await {
            Some(next) => sub.expect(next),
            None if f.messages.load(Ordering::Relaxed) > 0 => this.resync(&f),
            None => {}
        }
        f.set(FeedState::Live);
        this.refresh_exact();
        drop(this);
        loop {
            let next = sub.next_any().await;
            let Some(this) = feeds.upgrade() else { return };
            match next {
                Ok(Next::Message { message, missed, restarted }) => {
                    this.heard(&f);
                    f.live_messages.fetch_add(1, Ordering::Relaxed);
                    backoff = Duration::from_millis(200);
                    if f.task_state() != FeedState::Live {
                        f.set(FeedState::Live);
                        this.refresh_exact();
                    }
                    if restarted {
                        // The engine started again with an empty cache: what it stored since is
                        // in its replay buffer from 0.
                        f.restarts.fetch_add(1, Ordering::Relaxed);
                        this.index.clear_feed(f.config.engine, f.config.rank);
                        if message.seq > 0 && this.replay(&f, 0, Some(message.seq)).await.is_none() {
                            this.resync(&f);
                        }
                    } else if missed > 0 {
                        f.missed.fetch_add(missed, Ordering::Relaxed);
                        let from = message.seq - missed;
                        if this.replay(&f, from, Some(message.seq)).await.is_none() {
                            this.index.clear_feed(f.config.engine, f.config.rank);
                            this.resync(&f);
                        }
                    }
                    this.apply(&f, &message);
                }
                Ok(Next::OtherTopic(topic)) => {
                    f.other_topic_messages.fetch_add(1, Ordering::Relaxed);
                    *f.other_topic.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(topic);
                    if f.live_messages.load(Ordering::Relaxed) == 0 && f.task_state() != FeedState::OtherTopic
                    {
                        f.set(FeedState::OtherTopic);
                        this.refresh_exact();
                    }
                }
                Err(e @ (EventError::Zmq(_) | EventError::Disconnected)) => {
                    lost(this, &f, e.to_string(), &mut backoff).await;
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::collections::VecDeque;

    use bytes::Bytes;
    use rmpv::Value as V;
    use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

    use super::*;
    use crate::kv_events::END_OF_REPLAY;

    /// Published batches by sequence number, for replay.
    type Buffer = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

    /// A publisher as vLLM 0.32's `ZmqEventPublisher` is: PUB `[topic, seq, batch]`, and a ROUTER
    /// replay socket answering `["", start]` with `["", topic, seq, batch]`… then the end marker.
    struct Publisher {
        pub_socket: PubSocket,
        buffer: Buffer,
        topic: String,
        seq: u64,
        pub_addr: String,
        replay_addr: String,
        replay_task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Publisher {
        fn drop(&mut self) {
            self.replay_task.abort();
        }
    }

    /// Binds `at`, waiting while a socket that was just closed still holds the port.
    async fn bind<S: Socket>(s: &mut S, at: &str) -> String {
        for _ in 0..100 {
            match s.bind(&format!("tcp://{at}")).await {
                Ok(e) => return port(&e),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        panic!("cannot bind {at}");
    }

    fn port(e: &zeromq::Endpoint) -> String {
        match e {
            zeromq::Endpoint::Tcp(h, p) => format!("{h}:{p}"),
            other => panic!("{other:?}"),
        }
    }

    impl Publisher {
        async fn start(topic: &str) -> Self {
            Self::start_at(topic, "127.0.0.1:0", "127.0.0.1:0").await
        }

        async fn start_at(topic: &str, pub_at: &str, replay_at: &str) -> Self {
            let mut pub_socket = PubSocket::new();
            let pub_addr = bind(&mut pub_socket, pub_at).await;
            let mut router = RouterSocket::new();
            let replay_addr = bind(&mut router, replay_at).await;
            let buffer: Buffer = Arc::default();
            let (b, t) = (Arc::clone(&buffer), topic.to_owned());
            let replay_task = tokio::spawn(async move {
                while let Ok(m) = router.recv().await {
                    let frames = m.into_vec();
                    let [id, _, start] = &frames[..] else { continue };
                    let start = u64::from_be_bytes(start.as_ref().try_into().unwrap());
                    let held: Vec<(u64, Vec<u8>)> =
                        b.lock().unwrap().iter().filter(|(s, _)| *s >= start).cloned().collect();
                    for (seq, payload) in held.into_iter().chain([(u64::MAX, Vec::new())]) {
                        let mut out = ZmqMessage::from(id.clone());
                        out.push_back(Bytes::new());
                        out.push_back(if seq == u64::MAX { Bytes::new() } else { Bytes::from(t.clone()) });
                        out.push_back(if seq == u64::MAX {
                            Bytes::copy_from_slice(&END_OF_REPLAY)
                        } else {
                            Bytes::copy_from_slice(&seq.to_be_bytes())
                        });
                        out.push_back(Bytes::from(payload));
                        router.send(out).await.unwrap();
                    }
                }
            });
            Self { pub_socket, buffer, topic: topic.to_owned(), seq: 0, pub_addr, replay_addr, replay_task }
        }

        /// Publishes the next batch (or only keeps it for replay: a message the subscriber loses).
        async fn publish(&mut self, events: Vec<V>, send: bool) {
            let batch = V::Array(vec![V::from(1.7e9), V::Array(events), V::Nil]);
            let mut payload = Vec::new();
            rmpv::encode::write_value(&mut payload, &batch).unwrap();
            self.buffer.lock().unwrap().push_back((self.seq, payload.clone()));
            if send {
                let mut m = ZmqMessage::from(self.topic.clone());
                m.push_back(Bytes::copy_from_slice(&self.seq.to_be_bytes()));
                m.push_back(Bytes::from(payload));
                self.pub_socket.send(m).await.unwrap();
            }
            self.seq += 1;
        }
    }

    fn stored(hash: i64, parent: Option<i64>, tokens: std::ops::Range<u32>) -> V {
        V::Map(vec![
            (V::from("type"), V::from("BlockStored")),
            (V::from("block_hashes"), V::Array(vec![V::from(hash)])),
            (V::from("parent_block_hash"), parent.map_or(V::Nil, V::from)),
            (V::from("token_ids"), V::Array(tokens.map(V::from).collect())),
            (V::from("block_size"), V::from(4)),
            (V::from("lora_id"), V::Nil),
            (V::from("medium"), V::from("GPU")),
            (V::from("lora_name"), V::Nil),
        ])
    }

    async fn until(what: &str, mut ok: impl FnMut() -> bool) {
        for _ in 0..200 {
            if ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("timed out waiting for {what}");
    }

    fn feeds(p: &Publisher, topic: &str, silent_after: Duration) -> Arc<Feeds> {
        let index = Arc::new(PrefixIndex::new(vec!["p".into()], 4, 1000, Duration::from_secs(60)));
        let config = FeedConfig {
            engine: 0,
            rank: 0,
            endpoint: p.pub_addr.clone(),
            replay: Some(p.replay_addr.clone()),
            topic: topic.into(),
        };
        Feeds::new(index, vec![config], silent_after, Duration::from_secs(60), Some(256))
    }

    /// A decoder whose live events say it holds the prompt gets it alone within
    /// `skip_prefill_within` (256) of it, or within twice that when the prefiller is at least as
    /// far behind again; approximate entries never send a prompt alone.
    #[test]
    fn the_decoder_gets_a_prompt_alone_within_the_bound_or_twice_it_when_the_prefiller_is_behind() {
        let index = Arc::new(PrefixIndex::new(vec!["d".into()], 16, 1000, Duration::from_secs(60)));
        let f = Feeds::new(index, Vec::new(), Duration::from_secs(10), Duration::from_secs(60), Some(256));
        // (prompt, decoder holds, prefiller holds) → alone.
        let cases = [
            (3000, 2744, 2744, true),  // 256 to compute
            (3000, 2743, 3000, false), // 257, and the prefiller holds it all
            (3000, 2600, 2400, false), // 400, the prefiller 600: not 256 more
            (3000, 2600, 2344, true),  // 400, the prefiller 656: 256 more
            (3000, 2487, 0, false),    // 513: past twice the bound
            (3000, 0, 0, false),       // nothing held
        ];
        f.index.set_exact(0, true);
        for (tokens, cached, prefill_cached, alone) in cases {
            assert_eq!(
                f.skips_prefill(0, tokens, cached, prefill_cached),
                alone,
                "{tokens} {cached} {prefill_cached}"
            );
        }
        f.index.set_exact(0, false);
        assert!(!f.skips_prefill(0, 3000, 2900, 0), "approximate entries");
        let off = Feeds::new(
            Arc::clone(&f.index),
            Vec::new(),
            Duration::from_secs(10),
            Duration::from_secs(60),
            None,
        );
        f.index.set_exact(0, true);
        assert!(!off.skips_prefill(0, 3000, 3000, 0), "skip_prefill = false");
    }

    /// A gateway that starts after the engine rebuilds from replay; a lost message is replayed;
    /// a publisher that starts again (sequence back to 0) has its old blocks forgotten.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn late_start_gap_and_restart() {
        let prompt: Vec<u32> = (0..16).collect();
        let mut p = Publisher::start("").await;
        p.publish(vec![stored(1, None, 0..4)], true).await;
        p.publish(vec![stored(2, Some(1), 4..8)], true).await;
        let f = feeds(&p, "", Duration::from_secs(60));
        f.start(Duration::from_secs(60));
        let s = Arc::clone(&f.feeds()[0]);
        until("the replay of what came before", || f.index.cached_tokens(&f.index.keys(&prompt)) == vec![8])
            .await;
        assert_eq!(s.replayed.load(Ordering::Relaxed), 2);
        until("live", || f.state(&s) == FeedState::Live).await;
        f.refresh_exact();
        assert!(f.index.engines()[0].exact());
        // Subscriptions reach a PUB socket a moment after connecting: publish until one arrives.
        for _ in 0..100 {
            p.publish(vec![stored(1, None, 0..4)], true).await;
            if s.messages.load(Ordering::Relaxed) > 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(s.messages.load(Ordering::Relaxed) > 2, "no live message arrived");
        // seq n is kept for replay only; n+1 shows the gap, and n comes back from the replay.
        p.publish(vec![stored(3, Some(2), 8..12)], false).await;
        p.publish(vec![stored(4, Some(3), 12..16)], true).await;
        until("the gap replayed", || f.index.cached_tokens(&f.index.keys(&prompt)) == vec![16]).await;
        assert_eq!(s.missed.load(Ordering::Relaxed), 1);
        assert!(s.replays.load(Ordering::Relaxed) >= 2);
        // The engine starts again: its sequence goes back to 0 and its old cache is gone.
        p.seq = 0;
        p.publish(vec![stored(9, None, 100..104)], true).await;
        until("the restart", || s.restarts.load(Ordering::Relaxed) == 1).await;
        assert_eq!(f.index.cached_tokens(&f.index.keys(&prompt)), vec![0]);
        assert_eq!(f.index.cached_tokens(&f.index.keys(&[100, 101, 102, 103])), vec![4]);
    }

    /// The publisher goes away and another starts on its ports (an engine restarted): the feed
    /// sees the disconnection, reconnects, forgets the old blocks and has the new ones from the
    /// new publisher's replay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restarted_publisher_is_resubscribed_and_replayed() {
        let mut p = Publisher::start("").await;
        p.publish(vec![stored(1, None, 0..4)], true).await;
        let f = feeds(&p, "", Duration::from_secs(60));
        f.start(Duration::from_secs(60));
        let s = Arc::clone(&f.feeds()[0]);
        until("the first replay", || f.index.cached_tokens(&f.index.keys(&[0, 1, 2, 3])) == vec![4]).await;
        let (pub_at, replay_at) = (p.pub_addr.clone(), p.replay_addr.clone());
        drop(p);
        until("the disconnection", || f.state(&s) != FeedState::Live).await;
        let mut q = Publisher::start_at("", &pub_at, &replay_at).await;
        q.publish(vec![stored(5, None, 50..54)], true).await;
        until("the new publisher's blocks", || {
            f.index.cached_tokens(&f.index.keys(&[50, 51, 52, 53])) == vec![4]
        })
        .await;
        assert_eq!(
            f.index.cached_tokens(&f.index.keys(&[0, 1, 2, 3])),
            vec![0],
            "the old blocks are forgotten"
        );
        until("live again", || f.state(&s) == FeedState::Live).await;
        assert!(s.last_error().is_some_and(|e| e.contains("disconnected")), "{:?}", s.last_error());
    }

    /// Messages on another topic mark the feed (and its engine falls back); an engine that is
    /// sent requests and says nothing is silent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn other_topic_and_silence_are_reported() {
        let mut p = Publisher::start("kv").await;
        let f = feeds(&p, "", Duration::from_millis(300));
        f.start(Duration::from_secs(60));
        let s = Arc::clone(&f.feeds()[0]);
        until("connected", || f.state(&s) == FeedState::Live).await;
        for _ in 0..50 {
            p.publish(vec![stored(1, None, 0..4)], true).await;
            if s.other_topic_messages.load(Ordering::Relaxed) > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(f.state(&s), FeedState::OtherTopic);
        assert_eq!(s.seen_topic().as_deref(), Some("kv"));
        f.refresh_exact();
        assert!(!f.index.engines()[0].exact());

        // Silence: a publisher nobody publishes on.
        let quiet = Publisher::start("").await;
        let f = feeds(&quiet, "", Duration::from_millis(200));
        f.start(Duration::from_secs(60));
        let s = Arc::clone(&f.feeds()[0]);
        until("connected", || f.state(&s) == FeedState::Live).await;
        f.routed(0);
        until("silent", || f.state(&s) == FeedState::Silent).await;
        f.refresh_exact();
        assert!(!f.index.engines()[0].exact(), "a silent engine falls back to approximate entries");
    }
}
