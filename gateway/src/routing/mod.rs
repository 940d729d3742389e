//! Routing: which prefill engine and which decode engine serve a request.
//!
//! A policy sees the request's facts and the candidates' state, one list per metric (index `i` of
//! every list is endpoint `i`), and returns the chosen pair or [`Decision::Default`]. The built-in
//! policies implement the same trait a WebAssembly policy will: the router checks any decision
//! (indexes in range, endpoints healthy) and falls back to the built-in policy when a decision is
//! invalid or a policy declines.
//!
//! Health is passive and active: [`Health`] ejects an endpoint after
//! [`DEFAULT_EJECT_AFTER_FAILURES`] consecutive failures for [`DEFAULT_EJECT_FOR`] (doubling
//! while failures go on, up to [`MAX_EJECT_FOR`]); a periodic `GET /health` marks an endpoint down
//! when it does not answer 200 within [`DEFAULT_HEALTH_CHECK_TIMEOUT`].

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

pub mod retry;

/// Consecutive failures (connection refused, 5xx, timeouts) that eject an endpoint.
pub const DEFAULT_EJECT_AFTER_FAILURES: u32 = 3;
/// How long a first ejection lasts.
pub const DEFAULT_EJECT_FOR: Duration = Duration::from_secs(5);
/// Longest ejection: repeated ejections double up to it.
pub const MAX_EJECT_FOR: Duration = Duration::from_secs(60);
/// Period of the active health check.
pub const DEFAULT_HEALTH_CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// An endpoint that does not answer its health check within this is marked down.
pub const DEFAULT_HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// The cache-aware policy's load guard and weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheParams {
    /// An engine whose load is above this share of the least loaded candidate's (percent) and
    /// more than `guard_slack` above it is never chosen for its cache.
    pub guard_ratio_pct: u32,
    /// Load any engine may carry above the least loaded one whatever the ratio, in requests (for
    /// a prefiller: requests of this prompt's length), so an idle fleet does not spread a
    /// conversation over every engine.
    pub guard_slack: u32,
    /// How much a cached token counts, percent. A prefiller's cost is the work it has pending
    /// plus the prompt's tokens it would compute, `pending + prompt − weight × cached`; a
    /// decoder's score is `weight × cached/prompt − (load − least)/(guard limit − least + 1)`.
    pub cache_weight_pct: u32,
}

impl Default for CacheParams {
    fn default() -> Self {
        Self { guard_ratio_pct: 150, guard_slack: 2, cache_weight_pct: 100 }
    }
}

impl CacheParams {
    /// The most load (in requests) a candidate may carry and still be chosen for its cache.
    pub fn guard_limit(&self, least: u32) -> u32 {
        // A request is one prompt's worth of load: the token guard with prompts of one token.
        u32::try_from(self.guard_limit_tokens(u64::from(least), 1)).unwrap_or(u32::MAX)
    }

    /// The most pending work (tokens) a prefiller may have and still be chosen for its cache,
    /// for a prompt of `prompt_tokens`: the ratio over the least loaded's, or `guard_slack`
    /// prompts of this length above it, whichever is more.
    pub fn guard_limit_tokens(&self, least: u64, prompt_tokens: u32) -> u64 {
        let by_ratio = least.saturating_mul(u64::from(self.guard_ratio_pct)) / 100;
        let slack = u64::from(self.guard_slack).saturating_mul(u64::from(prompt_tokens.max(1)));
        by_ratio.max(least.saturating_add(slack))
    }

    /// A prefiller's cost: the tokens it must compute before this prompt's prefill is done (its
    /// pending work and the prompt's uncached part), the cache counted by its weight.
    pub fn prefill_cost(&self, pending: u64, cached: u32, prompt_tokens: u32) -> f64 {
        let credit = f64::from(cached.min(prompt_tokens)) * f64::from(self.cache_weight_pct) / 100.0;
        pending as f64 + f64::from(prompt_tokens) - credit
    }

    /// The prefiller with the lowest [`CacheParams::prefill_cost`] among `candidates` within the
    /// token guard (ties: the least pending work, then fewest in flight, then the first).
    fn pick_prefill(&self, candidates: &[usize], p: &PrefillView, prompt_tokens: u32) -> Option<usize> {
        let pending = |i: usize| p.pending(i);
        let least = candidates.iter().map(|&i| pending(i)).min()?;
        let limit = self.guard_limit_tokens(least, prompt_tokens);
        let cost = |i: usize| {
            self.prefill_cost(pending(i), p.cached_tokens.get(i).copied().unwrap_or(0), prompt_tokens)
        };
        let in_flight = |i: usize| p.in_flight.get(i).copied().unwrap_or(0);
        candidates.iter().copied().filter(|&i| pending(i) <= limit).min_by(|&a, &b| {
            cost(a)
                .total_cmp(&cost(b))
                .then(pending(a).cmp(&pending(b)))
                .then(in_flight(a).cmp(&in_flight(b)))
                .then(a.cmp(&b))
        })
    }

    /// The candidate with the best score among `candidates` within the load guard (ties: the
    /// least loaded, then the first).
    fn pick(
        &self,
        candidates: &[usize],
        load: impl Fn(usize) -> u32,
        cached: impl Fn(usize) -> u32,
        prompt_tokens: u32,
    ) -> Option<usize> {
        let least = candidates.iter().map(|&i| load(i)).min()?;
        let limit = self.guard_limit(least);
        let score = |i: usize| {
            let cache = f64::from(cached(i)) / f64::from(prompt_tokens.max(1));
            let over = f64::from(load(i).saturating_sub(least)) / (f64::from(limit - least) + 1.0);
            f64::from(self.cache_weight_pct) / 100.0 * cache - over
        };
        candidates
            .iter()
            .copied()
            .filter(|&i| load(i) <= limit)
            .min_by(|&a, &b| score(b).total_cmp(&score(a)).then(load(a).cmp(&load(b))).then(a.cmp(&b)))
    }
}

/// The built-in policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Builtin {
    /// Each pool in turn, ignoring load.
    RoundRobin,
    /// Fewest requests in flight (prefill), fewest slots held or waiting (decode).
    LeastLoaded,
    /// Decode: among decoders whose buffer can hold the request, fewest slots waiting, then most
    /// slots free; prefill: fewest in flight.
    #[default]
    KvAware,
    /// Where the prompt's prefix is cached: prefill and decode engines scored by the tokens of
    /// the prompt they hold (from their KV events, or from what was routed to them) against
    /// their load, never above the load guard; decoders must fit the request as in `KvAware`.
    CacheAware(CacheParams),
}

impl Builtin {
    pub const NAMES: [&'static str; 4] = ["round-robin", "least-loaded", "kv-aware", "cache-aware"];

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "round-robin" => Some(Self::RoundRobin),
            "least-loaded" => Some(Self::LeastLoaded),
            "kv-aware" => Some(Self::KvAware),
            "cache-aware" => Some(Self::CacheAware(CacheParams::default())),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round-robin",
            Self::LeastLoaded => "least-loaded",
            Self::KvAware => "kv-aware",
            Self::CacheAware(_) => "cache-aware",
        }
    }
}

/// What a policy knows of a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteFacts<'a> {
    pub model: &'a str,
    pub prompt_tokens: u32,
    /// Slots (KV chunk pages) the request needs on a decoder.
    pub slots: u32,
    pub max_tokens: Option<u32>,
    /// A sequence number for round robin.
    pub seq: u64,
}

/// One value for each endpoint of a pool, in the pool's order: inline for up to four endpoints (a
/// request's candidates are made on every request, and most pools are small).
pub type PerEndpoint<T> = SmallVec<[T; 4]>;

/// Prefill candidates, one list per metric.
#[derive(Clone, Debug, Default)]
pub struct PrefillView {
    pub healthy: PerEndpoint<bool>,
    pub in_flight: PerEndpoint<u32>,
    /// Moving average of the prefill leg, µs (0 before the first request).
    pub latency_us: PerEndpoint<u32>,
    /// Tokens at the start of the prompt the engine holds in KV cache (empty: not known).
    pub cached_tokens: PerEndpoint<u32>,
    /// Prompt tokens routed to the engine to compute whose prefill has not answered yet: its
    /// pending work (0 where not given).
    pub pending_tokens: PerEndpoint<u64>,
}

impl PrefillView {
    /// Prefiller `i`'s pending work in tokens.
    pub fn pending(&self, i: usize) -> u64 {
        self.pending_tokens.get(i).copied().unwrap_or(0)
    }
}

/// Decode candidates, one list per metric.
#[derive(Clone, Debug, Default)]
pub struct DecodeView {
    pub healthy: PerEndpoint<bool>,
    /// Slots this request takes on each decoder (its chunk size and handoff decide; `RouteFacts::slots`
    /// when empty).
    pub slots_needed: PerEndpoint<u32>,
    pub capacity_slots: PerEndpoint<u32>,
    pub free_slots: PerEndpoint<u32>,
    pub waiting_slots: PerEndpoint<u64>,
    /// Requests holding slots on the decoder (admitted, not yet released).
    pub in_flight: PerEndpoint<u32>,
    /// Tokens at the start of the prompt the engine holds in KV cache (empty: not known).
    pub cached_tokens: PerEndpoint<u32>,
}

impl DecodeView {
    /// Slots the request needs on decoder `i`.
    fn need(&self, i: usize, f: &RouteFacts<'_>) -> u32 {
        self.slots_needed.get(i).copied().unwrap_or(f.slots)
    }

    /// Whether decoder `i`'s buffer can hold the request at all.
    fn fits(&self, i: usize, f: &RouteFacts<'_>) -> bool {
        self.capacity_slots.get(i).is_some_and(|&c| c >= self.need(i, f))
    }

    /// Decoder `i`'s load in requests: those holding slots, and those waiting (their slots over
    /// this request's).
    pub fn load(&self, i: usize, f: &RouteFacts<'_>) -> u32 {
        let waiting =
            self.waiting_slots.get(i).copied().unwrap_or(0).div_ceil(u64::from(self.need(i, f).max(1)));
        self.in_flight.get(i).copied().unwrap_or(0).saturating_add(u32::try_from(waiting).unwrap_or(u32::MAX))
    }
}

/// Every candidate.
#[derive(Clone, Debug, Default)]
pub struct Candidates {
    pub prefill: PrefillView,
    pub decode: DecodeView,
}

/// A chosen pair (indexes into the candidate lists).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub prefill: usize,
    pub decode: usize,
}

/// A policy's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The preferred pair first, then fallbacks.
    Route(Vec<Route>),
    /// Let the built-in policy decide.
    Default,
}

/// A routing policy: built in, or (later) a WebAssembly component.
pub trait RoutingPolicy: Send + Sync + fmt::Debug {
    fn name(&self) -> &str;
    fn route(&self, facts: &RouteFacts<'_>, c: &Candidates) -> Decision;
}

fn healthy_indexes(h: &[bool]) -> impl Iterator<Item = usize> + '_ {
    h.iter().enumerate().filter(|(_, ok)| **ok).map(|(i, _)| i)
}

fn round_robin(h: &[bool], seq: u64) -> Option<usize> {
    let up: Vec<usize> = healthy_indexes(h).collect();
    let n = up.len() as u64;
    (n > 0).then(|| usize::try_from(seq % n).ok()).flatten().and_then(|i| up.get(i).copied())
}

fn fewest_in_flight(p: &PrefillView) -> Option<usize> {
    healthy_indexes(&p.healthy).min_by_key(|&i| p.in_flight.get(i).copied().unwrap_or(u32::MAX))
}

/// Among decoders whose buffer can hold the request, fewest slots waiting, then most free; when
/// none can, the largest (whose admission refuses with both numbers).
fn kv_aware(f: &RouteFacts<'_>, d: &DecodeView) -> Option<usize> {
    let best = healthy_indexes(&d.healthy).filter(|&i| d.fits(i, f)).min_by_key(|&i| {
        (d.waiting_slots.get(i).copied().unwrap_or(0), u32::MAX - d.free_slots.get(i).copied().unwrap_or(0))
    });
    best.or_else(|| {
        healthy_indexes(&d.healthy).max_by_key(|&i| d.capacity_slots.get(i).copied().unwrap_or(0))
    })
}

impl RoutingPolicy for Builtin {
    fn name(&self) -> &str {
        Builtin::name(*self)
    }

    fn route(&self, f: &RouteFacts<'_>, c: &Candidates) -> Decision {
        let d = &c.decode;
        let held = |i: usize| {
            let cap = d.capacity_slots.get(i).copied().unwrap_or(0);
            u64::from(cap.saturating_sub(d.free_slots.get(i).copied().unwrap_or(0)))
                + d.waiting_slots.get(i).copied().unwrap_or(0)
        };
        let (prefill, decode) = match self {
            Self::RoundRobin => (round_robin(&c.prefill.healthy, f.seq), round_robin(&d.healthy, f.seq)),
            Self::LeastLoaded => {
                (fewest_in_flight(&c.prefill), healthy_indexes(&d.healthy).min_by_key(|&i| held(i)))
            }
            Self::KvAware => (fewest_in_flight(&c.prefill), kv_aware(f, d)),
            Self::CacheAware(params) => {
                let p = &c.prefill;
                let up: SmallVec<[usize; 16]> = healthy_indexes(&p.healthy).collect();
                let prefill = params.pick_prefill(&up, p, f.prompt_tokens);
                let fitting: SmallVec<[usize; 16]> =
                    healthy_indexes(&d.healthy).filter(|&i| d.fits(i, f)).collect();
                let decode = params
                    .pick(
                        &fitting,
                        |i| d.load(i, f),
                        |i| d.cached_tokens.get(i).copied().unwrap_or(0),
                        f.prompt_tokens,
                    )
                    .or_else(|| kv_aware(f, d));
                (prefill, decode)
            }
        };
        match (prefill, decode) {
            (Some(prefill), Some(decode)) => Decision::Route(vec![Route { prefill, decode }]),
            _ => Decision::Route(Vec::new()),
        }
    }
}

impl Builtin {
    /// Why each decoder other than `chosen` lost under this policy, in the numbers it compared
    /// (`None` for the chosen one).
    pub fn why_not(self, f: &RouteFacts<'_>, c: &Candidates, chosen: usize) -> Vec<Option<String>> {
        let d = &c.decode;
        let get = |v: &[u32], i: usize| v.get(i).copied().unwrap_or(0);
        let waiting = |i: usize| d.waiting_slots.get(i).copied().unwrap_or(0);
        let held = |i: usize| {
            u64::from(get(&d.capacity_slots, i).saturating_sub(get(&d.free_slots, i))) + waiting(i)
        };
        let need = |i: usize| d.slots_needed.get(i).copied().unwrap_or(f.slots);
        let cached = |i: usize| d.cached_tokens.get(i).copied().unwrap_or(0);
        let least =
            healthy_indexes(&d.healthy).filter(|&i| d.fits(i, f)).map(|i| d.load(i, f)).min().unwrap_or(0);
        (0..d.healthy.len())
            .map(|i| {
                if i == chosen {
                    return None;
                }
                if d.healthy.get(i) != Some(&true) {
                    return Some("not routable: ejected or failing its health check".to_owned());
                }
                Some(match self {
                    Self::RoundRobin => format!("not its turn (round robin, request {})", f.seq),
                    Self::LeastLoaded if held(i) > held(chosen) => {
                        format!("more slots held or waiting: {} against {}", held(i), held(chosen))
                    }
                    Self::KvAware | Self::CacheAware(_) if get(&d.capacity_slots, i) < need(i) => {
                        format!(
                            "cannot hold the request: it needs {} slots, the buffer has {}",
                            need(i),
                            get(&d.capacity_slots, i)
                        )
                    }
                    Self::KvAware if waiting(i) > waiting(chosen) => {
                        format!("more slots waiting: {} against {}", waiting(i), waiting(chosen))
                    }
                    Self::KvAware if get(&d.free_slots, i) < get(&d.free_slots, chosen) => {
                        format!(
                            "fewer slots free: {} against {}",
                            get(&d.free_slots, i),
                            get(&d.free_slots, chosen)
                        )
                    }
                    Self::CacheAware(p) if d.load(i, f) > p.guard_limit(least) => format!(
                        "over the load guard: {} requests against the least loaded's {} (limit {})",
                        d.load(i, f),
                        least,
                        p.guard_limit(least)
                    ),
                    Self::CacheAware(_) if cached(i) < cached(chosen) => format!(
                        "fewer prompt tokens cached: {} against {} (load {} against {})",
                        cached(i),
                        cached(chosen),
                        d.load(i, f),
                        d.load(chosen, f)
                    ),
                    Self::CacheAware(_) if d.load(i, f) > d.load(chosen, f) => format!(
                        "its load outweighs its cache: {} requests against {}, {} tokens cached against {}",
                        d.load(i, f),
                        d.load(chosen, f),
                        cached(i),
                        cached(chosen)
                    ),
                    _ => "tied with the chosen one, which comes first".to_owned(),
                })
            })
            .collect()
    }
}

/// Why no route was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoRoute {
    Prefill,
    Decode,
}

/// A policy in front of the built-in one.
#[derive(Debug)]
pub struct Router {
    pub builtin: Builtin,
    pub policy: Option<Box<dyn RoutingPolicy>>,
    /// Decisions of `policy` that were invalid and replaced by the built-in one.
    pub invalid: AtomicU64,
    /// The block index and its KV-event feeds (engines numbered prefills first, then decoders),
    /// when kept: the candidates' cached tokens come from it.
    pub prefix: Option<std::sync::Arc<crate::prefix::feed::Feeds>>,
}

impl Router {
    pub fn new(builtin: Builtin) -> Self {
        Self { builtin, policy: None, invalid: AtomicU64::new(0), prefix: None }
    }

    fn valid(r: &Route, c: &Candidates) -> bool {
        c.prefill.healthy.get(r.prefill) == Some(&true) && c.decode.healthy.get(r.decode) == Some(&true)
    }

    /// The pairs to try, best first (never empty), or which pool has no healthy endpoint.
    pub fn route(&self, f: &RouteFacts<'_>, c: &Candidates) -> Result<Vec<Route>, NoRoute> {
        let decided = self.policy.as_ref().map(|p| p.route(f, c));
        self.route_decided(decided, f, c, |_| {})
    }

    /// Checks a decision made elsewhere (a plugin's; `None`: it made none) against the candidates:
    /// a valid one is used, an invalid one is counted, reported to `invalid` and replaced by the
    /// built-in policy's.
    pub fn route_decided(
        &self,
        decided: Option<Decision>,
        f: &RouteFacts<'_>,
        c: &Candidates,
        invalid: impl FnOnce(&str),
    ) -> Result<Vec<Route>, NoRoute> {
        if !c.prefill.healthy.contains(&true) {
            return Err(NoRoute::Prefill);
        }
        if !c.decode.healthy.contains(&true) {
            return Err(NoRoute::Decode);
        }
        if let Some(Decision::Route(routes)) = decided {
            if !routes.is_empty() && routes.iter().all(|r| Self::valid(r, c)) {
                return Ok(routes);
            }
            self.invalid.fetch_add(1, Ordering::Relaxed);
            invalid(&format!("route {routes:?} names no healthy endpoint pair"));
        }
        match self.builtin.route(f, c) {
            Decision::Route(r) if !r.is_empty() && r.iter().all(|r| Self::valid(r, c)) => Ok(r),
            _ => Err(NoRoute::Decode),
        }
    }
}

/// Health settings.
#[derive(Clone, Copy, Debug)]
pub struct HealthConfig {
    pub eject_after_failures: u32,
    pub eject_for: Duration,
    pub check_interval: Duration,
    pub check_timeout: Duration,
    /// `[routing.retries]`.
    pub retries: retry::RetryConfig,
}

impl HealthConfig {
    /// While an engine's breaker is half-open, one request may probe it this often: the first
    /// ejection's span, at most a second.
    pub fn probe_every(&self) -> Duration {
        self.eject_for.min(MAX_PROBE_EVERY)
    }
}

/// The longest gap between probes of a half-open engine.
pub const MAX_PROBE_EVERY: Duration = Duration::from_secs(1);

/// An engine's circuit breaker, as its passive health keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Breaker {
    /// Requests flow; consecutive failures are counted.
    Closed,
    /// Ejected after consecutive failures: no request is routed to it until the span ends, or a
    /// health check sees the engine back after one saw it down ([`Health::checked`]).
    Open,
    /// The span ended (or the engine was seen back): one request at a time probes it (one per
    /// [`HealthConfig::probe_every`]); a success closes the breaker, a failure opens it again for
    /// twice as long.
    HalfOpen,
}

impl Breaker {
    pub const ALL: [Breaker; 3] = [Breaker::Closed, Breaker::Open, Breaker::HalfOpen];

    pub fn as_str(self) -> &'static str {
        match self {
            Breaker::Closed => "closed",
            Breaker::Open => "open",
            Breaker::HalfOpen => "half_open",
        }
    }
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            eject_after_failures: DEFAULT_EJECT_AFTER_FAILURES,
            eject_for: DEFAULT_EJECT_FOR,
            check_interval: DEFAULT_HEALTH_CHECK_INTERVAL,
            check_timeout: DEFAULT_HEALTH_CHECK_TIMEOUT,
            retries: retry::RetryConfig::default(),
        }
    }
}

/// One endpoint's health and load, shared by the requests using it. Lock-free.
#[derive(Debug)]
pub struct Health {
    epoch: Instant,
    failures: AtomicU32,
    ejections: AtomicU32,
    /// Milliseconds after `epoch` until which the endpoint is ejected (0: its breaker is closed;
    /// past: half-open).
    ejected_until: AtomicU64,
    /// While half-open: milliseconds after `epoch` from which the next probe may go.
    next_probe: AtomicU64,
    /// Nanoseconds after `epoch` when its breaker last opened or its name last moved: a request
    /// sent before then says nothing of the engine now, and its success or failure is not counted
    /// ([`Health::stale`]).
    since_ns: AtomicU64,
    /// The last active check failed.
    check_down: AtomicBool,
    in_flight: AtomicU32,
    /// Prompt tokens given to the endpoint to compute, not yet answered ([`Work`]).
    pending_tokens: AtomicU64,
    /// Moving average (1/8 weight) of how long requests stayed in flight, µs.
    latency_us: AtomicU32,
    /// Ejections so far (a metric).
    pub ejected_total: AtomicU64,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            next_probe: AtomicU64::new(0),
            since_ns: AtomicU64::new(0),
            check_down: AtomicBool::new(false),
            in_flight: AtomicU32::new(0),
            pending_tokens: AtomicU64::new(0),
            latency_us: AtomicU32::new(0),
            ejected_total: AtomicU64::new(0),
        }
    }
}

/// Counts a request in flight on an endpoint until dropped, and then its time into the endpoint's
/// moving average.
#[derive(Debug)]
pub struct InFlight<'a> {
    health: &'a Health,
    since: Instant,
}

impl InFlight<'_> {
    /// When the request was sent to the endpoint.
    pub fn since(&self) -> Instant {
        self.since
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let h = self.health;
        h.in_flight.fetch_sub(1, Ordering::Relaxed);
        let took = u32::try_from(self.since.elapsed().as_micros()).unwrap_or(u32::MAX);
        // Racing updates may lose a sample; an average does not need them all.
        let old = h.latency_us.load(Ordering::Relaxed);
        let new = if old == 0 { took } else { old - old / 8 + took / 8 };
        h.latency_us.store(new.max(1), Ordering::Relaxed);
    }
}

/// Prompt tokens a prefiller was routed to compute, counted in its pending work from the route
/// until the prefill leg ends (dropped: by the mode when the prefill answered, or with the request).
#[derive(Debug)]
pub struct Work {
    health: std::sync::Arc<Health>,
    tokens: u64,
}

impl Drop for Work {
    fn drop(&mut self) {
        self.health.pending_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

impl Health {
    /// Counts `tokens` in the endpoint's pending work until the guard is dropped.
    pub fn commit(self: &std::sync::Arc<Self>, tokens: u64) -> Work {
        self.pending_tokens.fetch_add(tokens, Ordering::Relaxed);
        Work { health: std::sync::Arc::clone(self), tokens }
    }

    /// Prompt tokens routed here and not yet answered.
    pub fn pending_tokens(&self) -> u64 {
        self.pending_tokens.load(Ordering::Relaxed)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Neither ejected (its breaker open) nor failing its health check. A half-open engine counts:
    /// it may take a probe.
    pub fn healthy(&self) -> bool {
        !self.check_failing() && self.breaker() != Breaker::Open
    }

    /// Its breaker's state.
    pub fn breaker(&self) -> Breaker {
        self.breaker_at(self.ejected_until.load(Ordering::Relaxed))
    }

    /// The breaker's state when `ejected_until` holds `until`.
    fn breaker_at(&self, until: u64) -> Breaker {
        match until {
            0 => Breaker::Closed,
            // (An ejection made in the epoch's first millisecond is stored as 1, not 0.)
            until if until > self.now_ms().max(1) => Breaker::Open,
            _ => Breaker::HalfOpen,
        }
    }

    /// Whether a request may be routed here now: its health check passing, and its breaker closed,
    /// or half-open with no probe taken within [`HealthConfig::probe_every`]. Nothing is taken:
    /// the request the router sends here takes the probe ([`Health::chosen`]).
    pub fn routable(&self) -> bool {
        if self.check_failing() {
            return false;
        }
        match self.breaker() {
            Breaker::Closed => true,
            Breaker::Open => false,
            Breaker::HalfOpen => self.next_probe.load(Ordering::Relaxed) <= self.now_ms(),
        }
    }

    /// A request was routed here: while the breaker is half-open, it is the probe, and no other
    /// request is offered the engine for [`HealthConfig::probe_every`]. (Two requests routed at
    /// the same instant may both probe; the next are held off.)
    pub fn chosen(&self, cfg: &HealthConfig) {
        if self.breaker() == Breaker::HalfOpen {
            let every = u64::try_from(cfg.probe_every().as_millis()).unwrap_or(u64::MAX);
            self.next_probe.store(self.now_ms().saturating_add(every), Ordering::Relaxed);
        }
    }

    /// Whether its last active health check failed.
    pub fn check_failing(&self) -> bool {
        self.check_down.load(Ordering::Relaxed)
    }

    /// Consecutive failures counted since the last success or ejection.
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Milliseconds until an open breaker turns half-open (0 when it is not open).
    pub fn open_for_ms(&self) -> u64 {
        self.ejected_until.load(Ordering::Relaxed).saturating_sub(self.now_ms())
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn start(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight { health: self, since: Instant::now() }
    }

    /// Moving average of the time requests stayed in flight, µs (0 before the first).
    pub fn latency_us(&self) -> u32 {
        self.latency_us.load(Ordering::Relaxed)
    }

    /// Nanoseconds after `epoch` at `at`.
    fn ns(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Results of requests sent before now are stale.
    fn renewed(&self) {
        self.since_ns.fetch_max(self.ns(Instant::now()), Ordering::Relaxed);
    }

    /// A request sent at `sent` was sent before the engine's breaker last opened or before its name
    /// last moved: its outcome is of what made the breaker open (a request cut off when the engine
    /// died, failing only after it came back) or of the old addresses, and counts neither for nor
    /// against the engine now. (A check that sees the engine back does not make earlier requests
    /// stale: an engine whose `/health` flaps under load would then never be ejected by failures
    /// that span a flap.)
    pub fn stale(&self, sent: Instant) -> bool {
        self.ns(sent) < self.since_ns.load(Ordering::Relaxed)
    }

    /// A request sent at `sent` succeeded on the endpoint: the failures in a row start over, and a
    /// half-open breaker closes. A request sent before the breaker opened ([`Health::stale`])
    /// changes nothing: the probe decides.
    pub fn success(&self, sent: Instant) {
        // The state first, then the staleness: a breaker that opened in between has renewed by
        // the time it is seen open.
        let until = self.ejected_until.load(Ordering::Acquire);
        if self.stale(sent) {
            return;
        }
        match self.breaker_at(until) {
            Breaker::Open => {}
            Breaker::Closed => self.failures.store(0, Ordering::Relaxed),
            Breaker::HalfOpen => {
                // Only the state it saw: a failed probe that opened it meanwhile stands.
                if self.ejected_until.compare_exchange(until, 0, Ordering::Relaxed, Ordering::Relaxed).is_ok()
                {
                    self.failures.store(0, Ordering::Relaxed);
                    self.ejections.store(0, Ordering::Relaxed);
                }
            }
        }
    }

    /// A request sent at `sent` failed because of the endpoint; returns true when this failure
    /// opened its breaker (ejected it): the `eject_after_failures`th in a row, or any while it is
    /// half-open (a failed probe). A request sent before the breaker last opened
    /// ([`Health::stale`]) counts for nothing: its failure is of what opened it, and would
    /// otherwise re-eject, for twice as long, an engine that just came back. Of failures at the
    /// same instant, one opens it.
    pub fn failure(&self, cfg: &HealthConfig, sent: Instant) -> bool {
        let until = self.ejected_until.load(Ordering::Acquire);
        if self.stale(sent) {
            return false;
        }
        let state = self.breaker_at(until);
        if state == Breaker::Open {
            return false;
        }
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n < cfg.eject_after_failures.max(1) && state != Breaker::HalfOpen {
            return false;
        }
        let k = self.ejections.load(Ordering::Relaxed).min(16);
        let span = cfg.eject_for.saturating_mul(1 << k).min(MAX_EJECT_FOR.max(cfg.eject_for));
        // Never 0, which is a closed breaker.
        let open = self.now_ms().saturating_add(u64::try_from(span.as_millis()).unwrap_or(u64::MAX)).max(1);
        // Renewed first, so a thread that sees the breaker open sees what it made stale (a
        // renewal by a failure that then loses the race only makes a few more outcomes stale).
        self.renewed();
        if self.ejected_until.compare_exchange(until, open, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return false;
        }
        self.failures.store(0, Ordering::Relaxed);
        self.ejections.fetch_add(1, Ordering::Relaxed);
        self.ejected_total.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// The engine's name now has other addresses: what passive checks held against the old
    /// ones (failures, an ejection) is forgotten; the active check decides.
    pub fn readdressed(&self) {
        self.renewed();
        self.failures.store(0, Ordering::Relaxed);
        self.ejections.store(0, Ordering::Relaxed);
        self.ejected_until.store(0, Ordering::Relaxed);
    }

    /// The result of an active health check. A check that passes after one failed saw the engine
    /// come back (restarted, most often): an open breaker turns half-open at once, its probe
    /// available now, rather than waiting out the rest of its span (requests sent before it
    /// opened stay stale, [`Health::stale`]). The probe decides: a restarted engine that fails it is ejected again, for twice as long (its
    /// ejections are forgotten when a probe succeeds, or when its name moves to other addresses).
    pub fn checked(&self, ok: bool) {
        let was_down = self.check_down.swap(!ok, Ordering::Relaxed);
        if ok && was_down {
            let until = self.ejected_until.load(Ordering::Relaxed);
            if self.breaker_at(until) == Breaker::Open {
                // Ended now (never 0, which is a closed breaker); a failure that opened it again
                // meanwhile stands.
                let now = self.now_ms().max(1);
                if self
                    .ejected_until
                    .compare_exchange(until, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    self.next_probe.store(0, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use smallvec::smallvec;

    use super::*;

    fn facts(slots: u32, seq: u64) -> RouteFacts<'static> {
        RouteFacts { model: "m", prompt_tokens: slots * 16, slots, max_tokens: None, seq }
    }

    fn cands() -> Candidates {
        Candidates {
            prefill: PrefillView {
                healthy: smallvec![true, true, true],
                in_flight: smallvec![5, 1, 3],
                latency_us: smallvec![0; 3],
                cached_tokens: PerEndpoint::new(),
                pending_tokens: PerEndpoint::new(),
            },
            decode: DecodeView {
                healthy: smallvec![true, true, true],
                slots_needed: PerEndpoint::new(),
                capacity_slots: smallvec![64, 128, 32],
                free_slots: smallvec![60, 10, 32],
                waiting_slots: smallvec![0, 0, 4],
                in_flight: smallvec![0; 3],
                cached_tokens: PerEndpoint::new(),
            },
        }
    }

    fn first(d: Decision) -> Route {
        match d {
            Decision::Route(r) => r[0],
            Decision::Default => panic!("builtin declined"),
        }
    }

    #[test]
    fn round_robin_skips_unhealthy() {
        let mut c = cands();
        c.prefill.healthy[1] = false;
        let picks: Vec<usize> =
            (0..4).map(|s| first(Builtin::RoundRobin.route(&facts(1, s), &c)).prefill).collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
    }

    #[test]
    fn least_loaded_counts_held_and_waiting_slots() {
        let r = first(Builtin::LeastLoaded.route(&facts(1, 0), &cands()));
        // prefill 1 has 1 in flight; decode 2 holds 0 + 4 waiting, decode 0 holds 4 + 0: tie → first.
        assert_eq!(r, Route { prefill: 1, decode: 0 });
    }

    #[test]
    fn kv_aware_prefers_fit_then_fewest_waiting_then_most_free() {
        // 40 slots: decoder 2 (32) cannot hold it; 0 and 1 have nobody waiting; 0 has more free.
        assert_eq!(first(Builtin::KvAware.route(&facts(40, 0), &cands())).decode, 0);
        // 100 slots: only decoder 1 can hold it.
        assert_eq!(first(Builtin::KvAware.route(&facts(100, 0), &cands())).decode, 1);
        // 500 slots: nobody can; the largest, whose admission names both numbers.
        assert_eq!(first(Builtin::KvAware.route(&facts(500, 0), &cands())).decode, 1);
        // Each decoder's own count when given: decoder 2 (a vllm-nixl pool, one slot a request)
        // fits a prompt the chunk-counted pools cannot, and has the most free.
        let mut c = cands();
        c.decode.slots_needed = smallvec![500, 500, 1];
        assert_eq!(first(Builtin::KvAware.route(&facts(500, 0), &c)).decode, 2);
    }

    #[test]
    fn cache_aware_prefers_the_cache_within_the_load_guard() {
        let ca = Builtin::CacheAware(CacheParams::default());
        let f = facts(8, 0); // 128 prompt tokens
        let mut c = cands();
        c.prefill.in_flight = smallvec![1, 0, 1];
        c.prefill.pending_tokens = smallvec![100, 0, 50];
        c.prefill.cached_tokens = smallvec![128, 0, 64];
        c.decode.in_flight = smallvec![1, 0, 0];
        c.decode.cached_tokens = smallvec![0, 0, 96];
        // Prefill 0 holds the whole prompt behind 100 tokens of work (cost 100), prefill 2 half
        // of it behind 50 (cost 114), the idle one none (cost 128); decoder 2 holds most of it.
        assert_eq!(first(ca.route(&f, &c)), Route { prefill: 0, decode: 2 });
        // More work pending than its cache saves: prefill 2 (50 + 128 - 64 = 114) over prefill
        // 0 (200 + 128 - 128 = 200), within the guard (least 0, limit two prompts: 256).
        c.prefill.pending_tokens = smallvec![200, 0, 50];
        assert_eq!(first(ca.route(&f, &c)).prefill, 2);
        // Past the guard (least 0, limit 256): neither engine that holds the prompt is chosen
        // for its cache, whatever the weight.
        c.prefill.pending_tokens = smallvec![300, 0, 500];
        assert_eq!(first(ca.route(&f, &c)).prefill, 1);
        let heavy = Builtin::CacheAware(CacheParams { cache_weight_pct: 1000, ..CacheParams::default() });
        assert_eq!(first(heavy.route(&f, &c)).prefill, 1, "past the guard whatever the weight");
        // The ratio applies at load: least 1000, limit 1500. Half the prompt cached is worth 64
        // tokens of work.
        c.prefill.pending_tokens = smallvec![1600, 1000, 1060];
        assert_eq!(first(ca.route(&f, &c)).prefill, 2);
        c.prefill.pending_tokens = smallvec![1600, 1000, 1070];
        assert_eq!(first(ca.route(&f, &c)).prefill, 1);
        // No cache anywhere: the least pending work.
        c.prefill.cached_tokens = smallvec![0; 3];
        c.prefill.pending_tokens = smallvec![90, 100, 95];
        assert_eq!(first(ca.route(&f, &c)).prefill, 0);
        // Equal work: the fewest requests in flight.
        c.prefill.pending_tokens = smallvec![100, 100, 100];
        c.prefill.in_flight = smallvec![2, 1, 3];
        assert_eq!(first(ca.route(&f, &c)).prefill, 1);
        // A decoder that cannot hold the request is never chosen for its cache: of the two that
        // can, the less loaded.
        c.decode.cached_tokens = smallvec![0, 0, 128];
        assert_eq!(first(ca.route(&facts(40, 0), &c)).decode, 1);
        let why = ca.why_not(&facts(40, 0), &c, 1);
        assert!(why[2].as_deref().unwrap().contains("cannot hold"), "{why:?}");
        // The losers are told in the numbers compared.
        // 9 holding slots and 4 slots waiting (one request of 8): 10 against a limit of 2.
        c.decode.in_flight = smallvec![0, 0, 9];
        let why = ca.why_not(&f, &c, 0);
        assert!(why[2].as_deref().unwrap().contains("over the load guard: 10 requests"), "{why:?}");
        assert!(why[1].as_deref().unwrap().contains("tied"), "{why:?}");
    }

    /// Nine requests in ten share one prefix, which every engine's cache soon holds on one
    /// engine: the guard keeps that engine's pending work within its limit at every choice, and
    /// the others take the rest.
    #[test]
    fn a_hot_prefix_never_pushes_an_engine_past_the_guard() {
        let p = CacheParams::default();
        let ca = Builtin::CacheAware(p);
        // Each engine's requests in flight, by their uncached tokens.
        let mut work: [Vec<u64>; 4] = Default::default();
        let mut cached_on = [false; 4];
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let prompt = 1100u32;
        let mut served = [0u32; 4];
        for seq in 0..10_000u64 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let hot = !rng.is_multiple_of(10);
            let pending: Vec<u64> = work.iter().map(|w| w.iter().sum()).collect();
            let cached: Vec<u32> = cached_on.iter().map(|&h| if hot && h { 1024 } else { 0 }).collect();
            let c = Candidates {
                prefill: PrefillView {
                    healthy: smallvec![true; 4],
                    in_flight: work.iter().map(|w| u32::try_from(w.len()).unwrap()).collect(),
                    latency_us: smallvec![0; 4],
                    cached_tokens: cached.as_slice().into(),
                    pending_tokens: pending.as_slice().into(),
                },
                decode: cands().decode,
            };
            let f = RouteFacts { model: "m", prompt_tokens: prompt, slots: 1, max_tokens: None, seq };
            let chosen = first(ca.route(&f, &c)).prefill;
            let least = *pending.iter().min().unwrap();
            assert!(pending[chosen] <= p.guard_limit_tokens(least, prompt), "{pending:?} chose {chosen}");
            work[chosen].push(u64::from(prompt - cached[chosen]));
            served[chosen] += 1;
            if hot {
                cached_on[chosen] = true;
            }
            // Requests finish at random, oldest first.
            let done = usize::try_from(rng >> 32).unwrap() % 4;
            if !work[done].is_empty() {
                work[done].remove(0);
            }
        }
        assert!(served.iter().all(|&n| n > 100), "every engine served: {served:?}");
    }

    /// The pending work counted by [`Health::commit`] goes when its guard does.
    #[test]
    fn committed_work_is_pending_until_dropped() {
        let h = std::sync::Arc::new(Health::default());
        let a = h.commit(300);
        let b = h.commit(50);
        assert_eq!(h.pending_tokens(), 350);
        drop(a);
        assert_eq!(h.pending_tokens(), 50);
        drop(b);
        assert_eq!(h.pending_tokens(), 0);
    }

    #[derive(Debug)]
    struct Fixed(Decision);
    impl RoutingPolicy for Fixed {
        fn name(&self) -> &str {
            "fixed"
        }
        fn route(&self, _: &RouteFacts<'_>, _: &Candidates) -> Decision {
            self.0.clone()
        }
    }

    #[test]
    fn each_loser_is_told_why_in_the_numbers_compared() {
        let mut c = cands();
        // kv-aware with 40 slots: decoder 2 (32) cannot hold it; 0 has more free than 1.
        let f = facts(40, 0);
        let Decision::Route(r) = Builtin::KvAware.route(&f, &c) else { panic!("no route") };
        assert_eq!(r[0].decode, 0);
        let why = Builtin::KvAware.why_not(&f, &c, 0);
        assert_eq!(why[0], None);
        assert_eq!(why[1].as_deref(), Some("fewer slots free: 10 against 60"));
        assert_eq!(why[2].as_deref(), Some("cannot hold the request: it needs 40 slots, the buffer has 32"));
        // least-loaded: held plus waiting, 4 / 118 / 4; the tie goes to the first.
        let why = Builtin::LeastLoaded.why_not(&facts(1, 0), &c, 0);
        assert_eq!(why[1].as_deref(), Some("more slots held or waiting: 118 against 4"));
        assert_eq!(why[2].as_deref(), Some("tied with the chosen one, which comes first"));
        c.decode.healthy[1] = false;
        let why = Builtin::RoundRobin.why_not(&facts(1, 7), &c, 2);
        assert_eq!(why[0].as_deref(), Some("not its turn (round robin, request 7)"));
        assert_eq!(why[1].as_deref(), Some("not routable: ejected or failing its health check"));
        assert_eq!(why[2], None);
    }

    #[test]
    fn router_checks_a_policy_and_falls_back() {
        let mut c = cands();
        c.decode.healthy[2] = false;
        let mut r = Router::new(Builtin::KvAware);
        let pick = |r: &Router, c: &Candidates| r.route(&facts(1, 0), c).unwrap()[0];
        r.policy = Some(Box::new(Fixed(Decision::Route(vec![Route { prefill: 2, decode: 1 }]))));
        assert_eq!(pick(&r, &c), Route { prefill: 2, decode: 1 });
        // Out of range, unhealthy, empty: the built-in decides and the fault is counted.
        for bad in [vec![Route { prefill: 9, decode: 0 }], vec![Route { prefill: 0, decode: 2 }], vec![]] {
            r.policy = Some(Box::new(Fixed(Decision::Route(bad))));
            assert_eq!(pick(&r, &c), Route { prefill: 1, decode: 0 });
        }
        assert_eq!(r.invalid.load(Ordering::Relaxed), 3);
        r.policy = Some(Box::new(Fixed(Decision::Default)));
        assert_eq!(pick(&r, &c), Route { prefill: 1, decode: 0 });
        assert_eq!(r.invalid.load(Ordering::Relaxed), 3);
        c.decode.healthy = smallvec![false; 3];
        assert_eq!(r.route(&facts(1, 0), &c), Err(NoRoute::Decode));
        c.prefill.healthy = smallvec![false; 3];
        assert_eq!(r.route(&facts(1, 0), &c), Err(NoRoute::Prefill));
    }

    #[test]
    fn passive_ejection_after_consecutive_failures_and_success_resets() {
        let cfg = HealthConfig {
            eject_after_failures: 3,
            eject_for: Duration::from_secs(60),
            ..Default::default()
        };
        let h = Health::default();
        assert!(!h.failure(&cfg, Instant::now()));
        assert!(!h.failure(&cfg, Instant::now()));
        h.success(Instant::now());
        assert!(!h.failure(&cfg, Instant::now()));
        assert!(!h.failure(&cfg, Instant::now()));
        assert!(h.healthy());
        assert!(h.failure(&cfg, Instant::now()));
        assert!(!h.healthy());
        assert_eq!(h.ejected_total.load(Ordering::Relaxed), 1);
        let short = HealthConfig { eject_after_failures: 1, eject_for: Duration::ZERO, ..cfg };
        let h = Health::default();
        assert!(h.failure(&short, Instant::now()));
        assert!(h.healthy(), "a zero ejection ends at once");
        h.checked(false);
        assert!(!h.healthy());
        h.checked(true);
        assert!(h.healthy());
        assert_eq!(h.latency_us(), 0, "no request yet");
        let g = h.start();
        assert_eq!(h.in_flight(), 1);
        std::thread::sleep(Duration::from_millis(2));
        drop(g);
        assert_eq!(h.in_flight(), 0);
        assert!(h.latency_us() >= 2000, "the first request sets the average: {}", h.latency_us());
    }

    /// Closed → open after consecutive failures → half-open when the span ends, where one request
    /// probes at a time: a failed probe opens it again for twice as long, a good one closes it.
    #[test]
    fn the_breaker_opens_probes_half_open_and_closes() {
        let cfg = HealthConfig {
            eject_after_failures: 2,
            eject_for: Duration::from_millis(40),
            ..Default::default()
        };
        let h = Health::default();
        assert_eq!(h.breaker(), Breaker::Closed);
        h.chosen(&cfg);
        assert!(h.routable(), "closed: every request");
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        assert!(!h.failure(&cfg, Instant::now()));
        assert!(h.failure(&cfg, Instant::now()));
        assert_eq!(h.breaker(), Breaker::Open);
        assert!(!h.healthy() && !h.routable());
        assert!(h.open_for_ms() > 0 && h.open_for_ms() <= 40);
        // Requests sent before it opened end while it is open: their failures and successes
        // change nothing (no second ejection, no early close); nor do those of any sent while it
        // is open.
        for sent in [before, Instant::now()] {
            assert!(!h.failure(&cfg, sent));
            assert!(!h.failure(&cfg, sent));
            h.success(sent);
        }
        assert_eq!((h.breaker(), h.ejected_total.load(Ordering::Relaxed)), (Breaker::Open, 1));
        std::thread::sleep(Duration::from_millis(45));
        assert_eq!(h.breaker(), Breaker::HalfOpen);
        assert!(h.healthy(), "half-open counts as healthy: it may take a probe");
        assert!(h.routable() && h.routable(), "offered until a request is routed to it");
        h.chosen(&cfg);
        assert!(!h.routable(), "one probe per probe_every");
        // The probe fails: open again at once (not after two failures), for twice as long.
        assert!(h.failure(&cfg, Instant::now()));
        assert_eq!(h.breaker(), Breaker::Open);
        assert!(h.open_for_ms() > 40, "doubled: {}", h.open_for_ms());
        std::thread::sleep(Duration::from_millis(85));
        assert_eq!(h.breaker(), Breaker::HalfOpen);
        std::thread::sleep(Duration::from_millis(45));
        assert!(h.routable(), "a probe again once probe_every has passed");
        h.chosen(&cfg);
        h.success(Instant::now());
        assert_eq!(h.breaker(), Breaker::Closed);
        h.chosen(&cfg);
        assert!(h.routable());
        // Closed again, the count starts over and the span is the first one's.
        assert!(!h.failure(&cfg, Instant::now()));
        assert!(h.failure(&cfg, Instant::now()));
        assert!(h.open_for_ms() <= 40);
        assert_eq!(h.ejected_total.load(Ordering::Relaxed), 3);
        // A failing health check keeps even a closed breaker's engine out.
        h.readdressed();
        h.checked(false);
        assert!(!h.routable());
    }

    /// An engine ejected for a long span (10 s here) and seen back by the active check after one
    /// saw it down is offered a probe at once; the probe decides, and a failed one ejects it
    /// for twice as long, past the checks that keep passing.
    #[test]
    fn a_check_that_sees_the_engine_back_ends_its_ejection() {
        let cfg = HealthConfig {
            eject_after_failures: 1,
            eject_for: Duration::from_secs(10),
            ..Default::default()
        };
        let h = Health::default();
        assert!(h.failure(&cfg, Instant::now()));
        h.checked(false);
        assert!(!h.routable());
        h.checked(false);
        assert_eq!(h.breaker(), Breaker::Open, "still down: the ejection stands");
        h.checked(true);
        assert_eq!(h.breaker(), Breaker::HalfOpen, "back: half-open now, not in 10 s");
        assert!(h.routable(), "its probe may go at once");
        h.chosen(&cfg);
        assert!(!h.routable(), "one probe");
        // The probe fails: open again for twice the span; passing checks do not end it.
        assert!(h.failure(&cfg, Instant::now()));
        assert!(h.open_for_ms() > 10_000, "doubled: {}", h.open_for_ms());
        h.checked(true);
        h.checked(true);
        assert_eq!(h.breaker(), Breaker::Open, "no down-then-up: the probe's verdict stands");
        // Down and back again: another probe, which succeeds and closes it.
        h.checked(false);
        h.checked(true);
        assert!(h.routable());
        h.chosen(&cfg);
        h.success(Instant::now());
        assert_eq!(h.breaker(), Breaker::Closed);
        assert!(h.failure(&cfg, Instant::now()));
        assert!(h.open_for_ms() <= 10_000, "a good probe forgot the ejections: {}", h.open_for_ms());
        // A breaker opened by passive failures alone, with every check passing: the span stands.
        let h = Health::default();
        h.checked(true);
        assert!(h.failure(&cfg, Instant::now()));
        h.checked(true);
        assert_eq!(h.breaker(), Breaker::Open);
    }

    /// A request sent before the engine died fails late (a transfer that timed out, a 504), after
    /// a health check saw the engine back and while its breaker is half-open: the failure is of
    /// the engine's earlier life and does not re-eject it; nor does a late success close the
    /// breaker. The probe, sent after, decides.
    #[test]
    fn a_late_answer_from_before_the_engine_came_back_is_not_its_probe() {
        let cfg = HealthConfig {
            eject_after_failures: 1,
            eject_for: Duration::from_secs(10),
            ..Default::default()
        };
        let h = Health::default();
        let cut_off = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        assert!(h.failure(&cfg, Instant::now()));
        h.checked(false);
        h.checked(true);
        assert_eq!(h.breaker(), Breaker::HalfOpen);
        assert!(h.stale(cut_off) && !h.stale(Instant::now()));
        assert!(!h.failure(&cfg, cut_off), "a stale failure is not a failed probe");
        assert_eq!(h.breaker(), Breaker::HalfOpen);
        h.success(cut_off);
        assert_eq!(h.breaker(), Breaker::HalfOpen, "a stale success is not a good probe");
        assert!(h.routable());
        h.chosen(&cfg);
        let probe = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        assert!(h.failure(&cfg, probe), "the probe's failure re-opens it");
        assert!(h.open_for_ms() > 10_000, "for twice as long: {}", h.open_for_ms());
        assert!(h.stale(probe), "sent before the breaker last opened");
        // A check that sees the engine back with its breaker closed makes nothing stale: failures
        // of requests that span a flapping `/health` still count towards an ejection.
        let cfg = HealthConfig { eject_after_failures: 2, ..cfg };
        let h = Health::default();
        let before_flap = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        h.checked(false);
        h.checked(true);
        assert!(!h.stale(before_flap));
        assert!(!h.failure(&cfg, before_flap));
        assert!(h.failure(&cfg, before_flap), "the second in a row ejects it");
        // Its name moving to other addresses does: what the old ones answer counts for nothing.
        let h = Health::default();
        let old_address = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        h.readdressed();
        for _ in 0..3 {
            assert!(!h.failure(&cfg, old_address));
        }
        assert_eq!((h.breaker(), h.failures()), (Breaker::Closed, 0));
        assert!(!h.failure(&cfg, Instant::now()));
        assert!(h.failure(&cfg, Instant::now()), "failures sent since count as before");
    }
}
