//! Flow control: the gateway-wide queue in front of routing, where requests wait for a decoder with
//! room and are let go in an order an operator chose, not in the order they came.
//!
//! - **Flows and bands.** A request's flow is its tenant (the API key's, the bearer token's name, or
//!   the GIE fairness id when `trust_fairness_header` is set); its band comes from `x-priority` (a
//!   band name) or `x-gateway-inference-objective` (an objective mapped to a band), capped by the
//!   tenant's `max_band` so a tenant cannot promote itself.
//! - **Order.** Strict priority between bands; inside a band, the flow whose tenant has the smallest
//!   virtual token counter (VTC: Sheng et al., OSDI '24): input tokens charged at dispatch, output
//!   tokens as they stream, each divided by the tenant's weight; a tenant that returns from idle is
//!   lifted to the smallest counter of those waiting (or to the last one to leave), so idling
//!   banks no credit. Inside a flow, first come first served or earliest deadline first.
//! - **Late binding.** A request is routed when it is let go, among the decoders that have room
//!   then ([`FlowControl::next`] asks the gateway); the head that does not fit yet is not overtaken.
//! - **Limits.** Per band, requests and bytes waiting (429 `queue_full`); per request, a deadline
//!   (the gateway's wait, the admission plugin's, `x-request-deadline` in ms, the OpenAI SDK's own
//!   `x-stainless-timeout`): past it the request leaves the queue unsent. A sheddable band (negative
//!   priority) never waits: with no room it is refused at once (429 `overloaded`).
//! - **Budgets.** Tokens per minute per tenant (input, output or both), a bucket checked before a
//!   request (its known input must fit) and charged after its answer; a refusal names the budget
//!   and when it refills.
//!
//! - **Replicas.** Alone, everything here is one replica's memory. With `[cluster]` the replicas
//!   share it through the store ([`Fleet`]): a tenant's budget is one bucket in the store, checked
//!   and held per request; its counter adds the service every other replica gave it, synced every
//!   `sync` interval. While the store cannot be reached, each replica checks budgets against its
//!   own share (the budget over the live replicas last counted), and its own recent use of that
//!   share; counters go on with the others' service as last read.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use crate::telemetry::Scrape;

#[cfg(test)]
mod tests;

/// Header naming the request's band.
pub const PRIORITY_HEADER: &str = "x-priority";
/// Gateway API Inference Extension: the `InferenceObjective` a request asks for.
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// Gateway API Inference Extension: the request's fairness id (read only when trusted).
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";
/// The longest the request may wait before it is sent to an engine, in ms from its arrival.
pub const DEADLINE_HEADER: &str = "x-request-deadline";
/// The OpenAI SDKs' own request timeout in seconds: waiting past it serves nobody.
pub const CLIENT_TIMEOUT_HEADER: &str = "x-stainless-timeout";

/// Requests one band may hold waiting by default.
pub const DEFAULT_BAND_MAX_REQUESTS: usize = 1024;
/// Bytes of request bodies one band may hold waiting by default (a few thousand chat requests).
pub const DEFAULT_BAND_MAX_BYTES: u64 = 256 << 20;
/// What an input token costs a tenant's counter (VTC's `w_p`).
pub const DEFAULT_INPUT_COST: f64 = 1.0;
/// What an output token costs (VTC's `w_q`: decoding a token costs more than prefilling one).
pub const DEFAULT_OUTPUT_COST: f64 = 2.0;
/// How long the dispatcher waits for a request it let go to take its decoder's slots before it
/// lets the next one go (a routing plugin's call is within it).
const SETTLE: Duration = Duration::from_millis(100);
/// How often the dispatcher looks again without being woken (engines turning healthy, scraped
/// metrics reopening a decoder).
const TICK: Duration = Duration::from_millis(20);
/// Tenants kept without anything queued or owed before the idle ones are forgotten (a forgotten
/// tenant comes back lifted, as VTC lifts any tenant returning from idle).
const MAX_IDLE_TENANTS: usize = 10_000;
/// What set a deadline that is only the gateway's own longest wait.
const GATEWAY_WAIT: &str = "the gateway's queue timeout";
/// Output tokens charged to a tenant's counter at a time while a request streams (the flow lock
/// is taken once per this many, not once per chunk); the rest when it ends.
const OUTPUT_CHARGE_EVERY: u64 = 16;
/// Tenants whose counters one sync with the other replicas reads back at most, besides those
/// that changed or wait.
pub const SYNCED_TENANTS: usize = 1024;
/// Recent dispatches remembered for the decision records' "served first".
const RECENT: usize = 4096;

/// One priority band.
#[derive(Clone, Debug, PartialEq)]
pub struct Band {
    pub name: String,
    /// Higher first; negative: sheddable.
    pub priority: i32,
    pub max_requests: usize,
    pub max_bytes: u64,
}

impl Band {
    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }
}

/// What a tenant's budget counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Counts {
    Input,
    Output,
    Total,
}

impl Counts {
    fn as_str(self) -> &'static str {
        match self {
            Self::Input => "input",
            Self::Output => "output",
            Self::Total => "input + output",
        }
    }
}

/// Tokens per minute, counted as `counts` says.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BudgetRule {
    pub tokens_per_minute: u64,
    pub counts: Counts,
}

impl BudgetRule {
    /// What a request of `input` tokens and at most `max_output` holds of a bucket of this rule,
    /// and what it must find there (see `Bucket::hold`).
    pub fn hold(&self, input: u64, max_output: u64) -> (f64, f64) {
        let hold = self.cost(input, max_output);
        (hold, hold.clamp(1.0, (self.tokens_per_minute as f64).max(1.0)))
    }

    /// What an answer of `input` and `output` tokens costs.
    pub fn cost(&self, input: u64, output: u64) -> f64 {
        match self.counts {
            Counts::Input => input as f64,
            Counts::Output => output as f64,
            Counts::Total => (input + output) as f64,
        }
    }

    /// Tokens per second.
    pub fn rate(&self) -> f64 {
        self.tokens_per_minute as f64 / 60.0
    }
}

/// [`Fleet::reserve`]'s answer, to come.
pub type Reserve<'a> = Pin<Box<dyn Future<Output = Option<Result<(), u64>>> + Send + 'a>>;

/// The store's answer to a request's hold, awaited by the request. Dropped first (the request
/// gone), it closes the channel: an answer already sent and a hold taken are given back here,
/// and one sent later fails, so the task that took it gives it back. Exactly one side does.
struct StoreAnswer {
    rx: tokio::sync::oneshot::Receiver<Option<Result<(), u64>>>,
    fleet: Arc<dyn Fleet>,
    tenant: Arc<str>,
    rule: BudgetRule,
    hold: f64,
}

impl Drop for StoreAnswer {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok(Some(Ok(()))) = self.rx.try_recv() {
            self.fleet.give_back(&self.tenant, self.rule, self.hold);
        }
    }
}

/// The other gateway replicas, through `[cluster]`'s store.
pub trait Fleet: Send + Sync + std::fmt::Debug {
    /// Takes `hold` of `tenant`'s fleet-wide bucket if `need` is there: `Some(Ok(()))` taken,
    /// `Some(Err(s))` refused (it refills within `s` seconds), `None` the store cannot be reached.
    fn reserve<'a>(&'a self, tenant: &'a str, rule: BudgetRule, hold: f64, need: f64) -> Reserve<'a>;
    /// Gives `tokens` back to the tenant's bucket (negative: takes that many more), in the
    /// background; lost when the store cannot be reached (the bucket keeps less: never more).
    fn give_back(&self, tenant: &str, rule: BudgetRule, tokens: f64);
    /// The live replicas last counted (1 before any count): each one's share of a budget while
    /// the store cannot be reached.
    fn replicas(&self) -> u32;
}

/// A tenant's counter as [`Fleet`] syncs it: this replica's whole service to it (the store keeps
/// each replica's and sums them).
#[derive(Clone, Debug, PartialEq)]
pub struct Unsynced {
    pub tenant: Arc<str>,
    pub served: f64,
}

/// A tenant's share, cap and budget.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantRule {
    pub weight: f64,
    /// The highest band it may ask for (index into the bands).
    pub max_band: Option<usize>,
    /// Its band when the request names none.
    pub default_band: Option<usize>,
    pub budget: Option<BudgetRule>,
}

impl Default for TenantRule {
    fn default() -> Self {
        Self { weight: 1.0, max_band: None, default_band: None, budget: None }
    }
}

/// The order of requests inside one flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Within {
    Fcfs,
    Edf,
}

/// Flow control's settings, checked.
#[derive(Clone, Debug)]
pub struct FlowConfig {
    /// Highest priority first.
    pub bands: Vec<Band>,
    pub default_band: usize,
    /// GIE objective name → band.
    pub objectives: BTreeMap<String, usize>,
    pub tenants: BTreeMap<String, TenantRule>,
    /// For tenants not listed.
    pub tenant_defaults: TenantRule,
    pub trust_fairness_header: bool,
    pub within: Within,
    pub input_cost: f64,
    pub output_cost: f64,
    /// The longest any request waits (the gateway's queue timeout).
    pub max_wait: Duration,
}

impl FlowConfig {
    /// One band, every tenant alike: fair shares and nothing else.
    pub fn fair(max_wait: Duration) -> Self {
        Self {
            bands: vec![Band {
                name: "default".into(),
                priority: 0,
                max_requests: DEFAULT_BAND_MAX_REQUESTS,
                max_bytes: DEFAULT_BAND_MAX_BYTES,
            }],
            default_band: 0,
            objectives: BTreeMap::new(),
            tenants: BTreeMap::new(),
            tenant_defaults: TenantRule::default(),
            trust_fairness_header: false,
            within: Within::Fcfs,
            input_cost: DEFAULT_INPUT_COST,
            output_cost: DEFAULT_OUTPUT_COST,
            max_wait,
        }
    }

    fn rule(&self, tenant: &str) -> &TenantRule {
        self.tenants.get(tenant).unwrap_or(&self.tenant_defaults)
    }

    fn band_named(&self, name: &str) -> Option<usize> {
        self.bands.iter().position(|b| b.name == name)
    }

    /// A line for `baton check-config`.
    pub fn describe(&self) -> String {
        let bands: Vec<String> = self
            .bands
            .iter()
            .map(|b| format!("{} ({}{})", b.name, b.priority, if b.sheddable() { ", sheddable" } else { "" }))
            .collect();
        let budgets = self.tenants.values().filter(|t| t.budget.is_some()).count();
        format!(
            "bands {}; default {}; {} tenants configured ({} with budgets); {} within a flow",
            bands.join(" > "),
            self.bands.get(self.default_band).map_or("?", |b| b.name.as_str()),
            self.tenants.len(),
            budgets,
            match self.within {
                Within::Fcfs => "first come first served",
                Within::Edf => "earliest deadline first",
            }
        )
    }
}

/// Why flow control refused a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// The band holds as many requests (or bytes) waiting as it may.
    #[error("the {band:?} band already holds {limit} waiting")]
    BandFull { band: String, limit: String },
    /// A sheddable band's request found no decoder with room.
    #[error("the fleet is saturated and the {band:?} band is sheddable")]
    Shed { band: String },
    /// The request's own deadline passed while it waited; no engine received it.
    #[error("the request's deadline ({by}) passed {waited:?} after it arrived; no engine received it")]
    Deadline { by: &'static str, waited: Duration },
    /// The gateway's longest wait passed.
    #[error("no decoder had room within {waited:?}")]
    Timeout { waited: Duration },
    /// The tenant is over its token budget.
    #[error(
        "tenant {tenant:?} is over its budget of {tokens_per_minute} tokens per minute ({counts}); \
         it has room for this request again in {refill_s} s"
    )]
    Budget { tenant: String, tokens_per_minute: u64, counts: &'static str, refill_s: u64 },
    /// The request named a band that does not exist.
    #[error("{header}: no band {asked:?} (bands: {known})")]
    UnknownBand { header: &'static str, asked: String, known: String },
}

impl Refused {
    pub fn status(&self) -> u16 {
        match self {
            Self::BandFull { .. } | Self::Shed { .. } | Self::Budget { .. } => 429,
            Self::Deadline { .. } => 504,
            Self::Timeout { .. } => 503,
            Self::UnknownBand { .. } => 400,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::BandFull { .. } => "queue_full",
            Self::Shed { .. } => "overloaded",
            Self::Deadline { .. } => "deadline_exceeded",
            Self::Timeout { .. } => "queue_timeout",
            Self::Budget { .. } => "rate_limit_exceeded",
            Self::UnknownBand { .. } => "invalid_value",
        }
    }

    /// The metric's `reason` label.
    fn reason(&self) -> &'static str {
        match self {
            Self::BandFull { .. } => "band_full",
            Self::Shed { .. } => "shed",
            Self::Deadline { .. } => "deadline",
            Self::Timeout { .. } => "timeout",
            Self::Budget { .. } => "budget",
            Self::UnknownBand { .. } => "unknown_band",
        }
    }

    /// Whether the client caused it (a bad header, its own budget).
    pub fn by_client(&self) -> bool {
        matches!(self, Self::UnknownBand { .. } | Self::Budget { .. })
    }

    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Self::BandFull { .. } | Self::Shed { .. } => Some(1),
            Self::Timeout { .. } => Some(2),
            Self::Budget { refill_s, .. } => Some(*refill_s),
            Self::Deadline { .. } | Self::UnknownBand { .. } => None,
        }
    }
}

/// Who a request is and how long it may wait, read from its headers before it is counted.
#[derive(Clone, Debug)]
pub struct Identity {
    pub tenant: Arc<str>,
    pub band: usize,
    /// What set the deadline, and when it is.
    pub deadline: (&'static str, Instant),
    /// When it arrived.
    pub arrived: Instant,
}

/// A token bucket over a minute.
#[derive(Debug)]
struct Bucket {
    rule: BudgetRule,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(rule: BudgetRule, now: Instant) -> Self {
        Self { rule, level: rule.tokens_per_minute as f64, at: now }
    }

    /// Makes this bucket one of `replicas` equal shares of `rule`: what was used of the old share
    /// stays used of the new one (never fuller than it).
    fn share(&mut self, rule: BudgetRule, replicas: u32, now: Instant) {
        let share =
            BudgetRule { tokens_per_minute: rule.tokens_per_minute / u64::from(replicas.max(1)), ..rule };
        if self.rule != share {
            self.refill(now);
            let (old, new) = (self.rule.tokens_per_minute as f64, share.tokens_per_minute as f64);
            self.rule = share;
            self.level = (self.level + new - old).min(new);
        }
    }

    fn rate(&self) -> f64 {
        (self.rule.tokens_per_minute as f64 / 60.0).max(f64::MIN_POSITIVE)
    }

    fn refill(&mut self, now: Instant) {
        let cap = self.rule.tokens_per_minute as f64;
        self.level =
            (self.level + self.rate() * now.saturating_duration_since(self.at).as_secs_f64()).min(cap);
        self.at = now;
    }

    /// What a request of `input` tokens and at most `max_output` output tokens holds of the
    /// bucket while it runs (what it may cost; output not capped counts nothing until it is
    /// served), and what it must find there: the hold, at most the whole budget (so a large
    /// request still goes when the bucket is full), at least one token.
    fn hold(&self, input: u64, max_output: u64) -> (f64, f64) {
        self.rule.hold(input, max_output)
    }

    fn full(&self, now: Instant) -> bool {
        let since = now.saturating_duration_since(self.at).as_secs_f64();
        self.level + self.rate() * since >= self.rule.tokens_per_minute as f64
    }
}

#[derive(Debug)]
struct TenantState {
    weight: f64,
    /// VTC's counter: cost served, over the weight (this replica's, lifts included).
    counter: f64,
    /// Of `counter`, the service this replica gave (lifts not included), and how much of it the
    /// fleet's store has.
    served: f64,
    published: f64,
    /// The service the other replicas gave, as last read from the store: the tenant's counter
    /// is `counter + others` (`TenantState::fair`).
    others: f64,
    queued: usize,
    budget: Option<Bucket>,
    /// Requests let go and not yet ended (its `Charge` not yet dropped).
    open: usize,
    served_input: u64,
    served_output: u64,
    refused_budget: u64,
}

impl TenantState {
    /// The counter fair shares compare: this replica's and every other one's service.
    fn fair(&self) -> f64 {
        self.counter + self.others
    }

    /// Charges `cost` (already over the weight) served here; negative: a refund.
    fn serve(&mut self, cost: f64) {
        self.counter += cost;
        self.served += cost;
    }
}

/// A waiter's place in its flow: (order key, sequence).
type Key = (u64, u64);

/// What the waiter gets when it is let go: a token to drop once its decoder admitted it.
#[derive(Debug)]
pub struct Go {
    pub settle: Option<oneshot::Sender<()>>,
    /// Requests let go while it waited, by tenant (the largest counts).
    pub served_first: Vec<(Arc<str>, u32)>,
}

#[derive(Debug)]
struct Waiter {
    tokens: usize,
    /// When the request arrived.
    arrived: Instant,
    bytes: u64,
    input_cost: f64,
    /// `RECENT` position when it entered.
    since: u64,
    tx: oneshot::Sender<Go>,
}

/// One band's waiters: per flow, keyed by (order key, sequence).
#[derive(Debug, Default)]
struct BandQ {
    flows: HashMap<Arc<str>, BTreeMap<Key, Waiter>>,
    count: usize,
    bytes: u64,
    dispatched: u64,
    /// Total time its queued requests waited before they were let go.
    waited: Duration,
    refused: BTreeMap<&'static str, u64>,
}

#[derive(Debug)]
struct State {
    bands: Vec<BandQ>,
    tenants: HashMap<Arc<str>, TenantState>,
    seq: u64,
    queued: usize,
    /// The counter of the last tenant whose queue emptied (VTC's lift when nobody waits).
    last_left: f64,
    /// Tenants let go lately and the running count.
    recent: VecDeque<Arc<str>>,
    dispatches: u64,
    /// Requests the dispatcher let go that have not yet taken their slots: no request takes the
    /// fast path past them.
    in_dispatch: usize,
}

/// A request's place in the queue: leaves it when dropped (client gone, deadline), so nobody waits
/// behind a ghost.
#[derive(Debug)]
struct Place {
    flow: Arc<FlowControl>,
    band: usize,
    tenant: Arc<str>,
    key: Key,
    /// False once the dispatcher took it out.
    queued: bool,
    /// Where the dispatcher's go comes.
    rx: Option<oneshot::Receiver<Go>>,
    /// Its input tokens and their cost, to undo a charge the dispatcher made as it left.
    input: u64,
    input_cost: f64,
}

impl Drop for Place {
    fn drop(&mut self) {
        if !self.queued {
            return;
        }
        let mut s = self.flow.lock();
        let left = s.take(self.band, &self.tenant, self.key).is_some();
        if !left && self.rx.as_mut().is_some_and(|rx| rx.try_recv().is_ok()) {
            // Let go as it left (deadline, client gone): never sent, so its charge is undone;
            // the go's token, dropped here, tells the dispatcher to go on.
            self.flow.refund(&mut s, &self.tenant, self.input, self.input_cost, self.band);
        }
        drop(s);
        // The head may have changed.
        self.flow.wake.notify_one();
    }
}

impl State {
    fn tenant(&mut self, cfg: &FlowConfig, t: &Arc<str>, now: Instant) -> &mut TenantState {
        if !self.tenants.contains_key(t) && self.tenants.len() >= MAX_IDLE_TENANTS {
            self.tenants.retain(|_, s| {
                s.queued > 0
                    || s.open > 0
                    || s.served != s.published
                    || s.budget.as_ref().is_some_and(|b| !b.full(now))
            });
        }
        self.tenants.entry(Arc::clone(t)).or_insert_with(|| {
            let rule = cfg.rule(t);
            TenantState {
                weight: rule.weight,
                counter: 0.0,
                served: 0.0,
                published: 0.0,
                others: 0.0,
                queued: 0,
                budget: rule.budget.map(|r| Bucket::new(r, now)),
                open: 0,
                served_input: 0,
                served_output: 0,
                refused_budget: 0,
            }
        })
    }

    /// VTC's lift for a tenant that starts waiting: to the smallest counter of those waiting, or
    /// to the last one's to leave when nobody waits.
    fn lift(&mut self, t: &Arc<str>) {
        let floor = self
            .tenants
            .iter()
            .filter(|(k, s)| s.queued > 0 && *k != t)
            .map(|(_, s)| s.fair())
            .fold(None, |m: Option<f64>, c| Some(m.map_or(c, |m| m.min(c))))
            .unwrap_or(self.last_left);
        if let Some(s) = self.tenants.get_mut(t) {
            s.counter = s.counter.max(floor - s.others);
        }
    }

    /// A waiter still in the queue.
    fn waiter(&self, band: usize, tenant: &Arc<str>, key: Key) -> Option<&Waiter> {
        self.bands.get(band)?.flows.get(tenant)?.get(&key)
    }

    /// Takes a waiter out of the queue, every count with it; `None` when it is not there (the
    /// dispatcher took it already).
    fn take(&mut self, band: usize, tenant: &Arc<str>, key: Key) -> Option<Waiter> {
        let b = self.bands.get_mut(band)?;
        let q = b.flows.get_mut(tenant)?;
        let w = q.remove(&key)?;
        if q.is_empty() {
            b.flows.remove(tenant);
        }
        b.count -= 1;
        b.bytes -= w.bytes;
        self.queued -= 1;
        if let Some(s) = self.tenants.get_mut(tenant) {
            s.queued -= 1;
            if s.queued == 0 {
                self.last_left = s.fair();
            }
        }
        Some(w)
    }

    /// The band and flow whose head goes next: the highest band with waiters, its flow of the
    /// smallest counter. Ties (a tenant back from idle is lifted to the others' counter) go to
    /// the flow with fewer waiting, then to the earliest head: the light tenant's one request is
    /// not put behind a backlog it has not used.
    fn head(&self) -> Option<(usize, Arc<str>, Key)> {
        let (b, band) = self.bands.iter().enumerate().find(|(_, b)| b.count > 0)?;
        // (counter, waiting, head key, tenant)
        type Best<'a> = (f64, usize, Key, &'a Arc<str>);
        let mut best: Option<Best<'_>> = None;
        for (t, q) in &band.flows {
            let Some((k, _)) = q.first_key_value() else { continue };
            let c = self.tenants.get(t).map_or(0.0, TenantState::fair);
            let better = match best {
                None => true,
                Some((bc, bn, bk, _)) => {
                    c < bc || (c == bc && (q.len() < bn || (q.len() == bn && k.1 < bk.1)))
                }
            };
            if better {
                best = Some((c, q.len(), *k, t));
            }
        }
        best.map(|(_, _, k, t)| (b, Arc::clone(t), k))
    }

    fn note_dispatch(&mut self, t: &Arc<str>) {
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(Arc::clone(t));
        self.dispatches += 1;
    }

    /// Tenants let go since `since`, the most first (at most five).
    fn served_since(&self, since: u64) -> Vec<(Arc<str>, u32)> {
        let n = usize::try_from(self.dispatches.saturating_sub(since))
            .unwrap_or(usize::MAX)
            .min(self.recent.len());
        let mut counts: HashMap<&Arc<str>, u32> = HashMap::new();
        for t in self.recent.iter().rev().take(n) {
            *counts.entry(t).or_default() += 1;
        }
        let mut v: Vec<(Arc<str>, u32)> = counts.into_iter().map(|(t, c)| (Arc::clone(t), c)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(5);
        v
    }
}

/// A request let go: its tenant's counter and budget are charged through it, and what it holds
/// is given back when it is dropped, whichever way the request ends.
#[derive(Debug)]
pub struct Charge {
    flow: Arc<FlowControl>,
    tenant: Arc<str>,
    input: u64,
    /// Output tokens counted so far, and those of them charged to the counter.
    seen: u64,
    charged: u64,
    /// What it holds of the tenant's budget (its input and `max_tokens`, as the budget counts).
    held: f64,
    /// The hold is in the fleet's bucket (`[cluster]`'s store), not only this replica's.
    in_store: bool,
    /// Let go: counted in the tenant's requests in flight.
    dispatched: bool,
    /// The answer ended: the budget is charged what was served.
    finished: bool,
}

impl Charge {
    /// Output tokens counted so far; the counter is charged them `OUTPUT_CHARGE_EVERY` at a time
    /// (not on every streamed chunk), and the rest when the request ends.
    pub fn output(&mut self, tokens: u64) {
        self.seen = self.seen.max(tokens);
        if self.seen >= self.charged + OUTPUT_CHARGE_EVERY {
            let more = self.take_output();
            add_output(&mut self.flow.lock(), &self.flow.cfg, &self.tenant, more);
        }
    }

    fn take_output(&mut self) -> u64 {
        let more = self.seen - self.charged;
        self.charged = self.seen;
        more
    }

    /// The answer ended with `tokens` output tokens: the budget is charged what was served (the
    /// hold given back, the cost taken), when it is dropped here.
    pub fn finish(mut self, tokens: u64) {
        self.seen = self.seen.max(tokens);
        self.finished = true;
    }
}

/// Charges `more` output tokens to `tenant`'s counter.
fn add_output(s: &mut State, cfg: &FlowConfig, tenant: &Arc<str>, more: u64) {
    if let Some(t) = s.tenants.get_mut(tenant) {
        t.serve(cfg.output_cost * more as f64 / t.weight);
        t.served_output += more;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let more = self.take_output();
        let mut s = self.flow.lock();
        add_output(&mut s, &self.flow.cfg, &self.tenant, more);
        // Only a tenant with a budget has its rule looked up (not on every request).
        let budgeted = self.in_store || s.tenants.get(&self.tenant).is_some_and(|t| t.budget.is_some());
        let rule = if budgeted { self.flow.cfg.rule(&self.tenant).budget } else { None };
        // Refused or failed before its answer: nothing is charged, the whole hold goes back.
        let back = match rule {
            Some(r) if self.finished => self.held - r.cost(self.input, self.seen),
            _ => self.held,
        };
        if let Some(t) = s.tenants.get_mut(&self.tenant) {
            if self.dispatched {
                t.open = t.open.saturating_sub(1);
            }
            // With a fleet, this replica's share mirrors what it took of the fleet's bucket.
            if let Some(b) = t.budget.as_mut() {
                b.level += back;
            }
        }
        drop(s);
        if self.in_store
            && let (Some(fleet), Some(rule)) = (self.flow.fleet.get(), rule)
            && back != 0.0
        {
            fleet.give_back(&self.tenant, rule, back);
        }
    }
}

/// A request through flow control: its charge, how long it waited, whether it waited at all, and
/// the token to drop once its decoder admitted it (the dispatcher lets the next go then).
#[derive(Debug)]
pub struct Admitted {
    pub charge: Charge,
    pub waited: Duration,
    pub queued: bool,
    /// Its deadline: what is left of it bounds its wait for its decoder's slots.
    pub deadline: Instant,
    pub settle: Option<oneshot::Sender<()>>,
}

/// Gateway-wide flow control (see the module's docs).
#[derive(Debug)]
pub struct FlowControl {
    pub cfg: FlowConfig,
    state: Mutex<State>,
    /// The other replicas (`[cluster]`), when there are.
    fleet: OnceLock<Arc<dyn Fleet>>,
    /// Budget checks made against this replica's share because the store could not be reached.
    budget_local: AtomicU64,
    /// Woken when room may have appeared or the head changed.
    pub wake: Arc<Notify>,
}

/// The request as flow control sees it.
#[derive(Clone, Copy, Debug)]
pub struct Ask {
    pub tokens: usize,
    pub bytes: u64,
    /// The admission plugin's own longest wait, if it set one.
    pub plugin_wait: Option<Duration>,
    /// The request's `max_tokens`, when it set one (held of an output-counting budget).
    pub max_tokens: Option<u32>,
}

impl FlowControl {
    pub fn new(cfg: FlowConfig) -> Arc<Self> {
        let bands = cfg.bands.iter().map(|_| BandQ::default()).collect();
        Arc::new(Self {
            cfg,
            state: Mutex::new(State {
                bands,
                tenants: HashMap::new(),
                seq: 0,
                queued: 0,
                last_left: 0.0,
                recent: VecDeque::with_capacity(RECENT),
                dispatches: 0,
                in_dispatch: 0,
            }),
            fleet: OnceLock::new(),
            budget_local: AtomicU64::new(0),
            wake: Arc::new(Notify::new()),
        })
    }

    /// Shares budgets and counters with the other replicas through `fleet` (once).
    pub fn share_with(&self, fleet: Arc<dyn Fleet>) {
        let _ = self.fleet.set(fleet);
    }

    /// The counters to sync with [`Fleet`]'s store: every tenant with service here the store lacks
    /// and every waiting one (whose others' service orders it), then the rest this replica knows
    /// (read back for `/admin/flow`), [`SYNCED_TENANTS`] at most.
    pub fn unsynced(&self) -> Vec<Unsynced> {
        let s = self.lock();
        let entry = |(k, t): (&Arc<str>, &TenantState)| Unsynced { tenant: Arc::clone(k), served: t.served };
        let urgent = |t: &TenantState| t.served != t.published || t.queued > 0;
        let mut out: Vec<Unsynced> = s.tenants.iter().filter(|(_, t)| urgent(t)).map(entry).collect();
        let room = SYNCED_TENANTS.saturating_sub(out.len());
        out.extend(s.tenants.iter().filter(|(_, t)| !urgent(t)).take(room).map(entry));
        out
    }

    /// The store took `sent` and answered each tenant's fleet-wide service, `totals`.
    pub fn synced(&self, sent: &[Unsynced], totals: &[f64]) {
        let mut s = self.lock();
        for (u, total) in sent.iter().zip(totals) {
            if let Some(t) = s.tenants.get_mut(&u.tenant) {
                t.published = u.served;
                t.others = (total - u.served).max(0.0);
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The request's tenant, band and deadline from its headers; `tenant` is the API key's or the
    /// bearer token's, `arrived` when its first byte came.
    pub fn identify(
        &self,
        headers: &hyper::HeaderMap,
        tenant: Option<&str>,
        arrived: Instant,
    ) -> Result<Identity, Refused> {
        let cfg = &self.cfg;
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
        let fairness =
            cfg.trust_fairness_header.then(|| header(FAIRNESS_HEADER)).flatten().filter(|v| !v.is_empty());
        let tenant: Arc<str> = Arc::from(fairness.or(tenant).unwrap_or(""));
        let rule = cfg.rule(&tenant);
        let asked = match (header(PRIORITY_HEADER), header(OBJECTIVE_HEADER)) {
            (Some(name), _) => Some(cfg.band_named(name).ok_or_else(|| Refused::UnknownBand {
                header: PRIORITY_HEADER,
                asked: name.chars().take(64).collect(),
                known: cfg.bands.iter().map(|b| b.name.as_str()).collect::<Vec<_>>().join(", "),
            })?),
            // An objective nobody mapped has the default priority, as in the GIE.
            (None, Some(obj)) => cfg.objectives.get(obj).copied(),
            (None, None) => None,
        };
        let mut band = asked.or(rule.default_band).unwrap_or(cfg.default_band);
        if let Some(cap) = rule.max_band {
            // Bands are ordered highest first: a smaller index is a higher band.
            band = band.max(cap);
        }
        let mut deadline = (GATEWAY_WAIT, arrived + cfg.max_wait);
        let mut sooner = |by: &'static str, d: Duration| {
            if arrived + d < deadline.1 {
                deadline = (by, arrived + d);
            }
        };
        if let Some(ms) = header(DEADLINE_HEADER).and_then(|v| v.parse::<u64>().ok()) {
            sooner(DEADLINE_HEADER, Duration::from_millis(ms));
        }
        if let Some(s) = header(CLIENT_TIMEOUT_HEADER).and_then(|v| v.parse::<f64>().ok())
            && s.is_finite()
            && s > 0.0
        {
            sooner("the client's timeout (x-stainless-timeout)", Duration::from_secs_f64(s.min(1e6)));
        }
        Ok(Identity { tenant, band, deadline, arrived })
    }

    /// The budget's verdict before the request is let in; what it holds of the bucket when it
    /// is (given back, less what the answer cost, when it ends).
    fn check_budget(&self, s: &mut State, id: &Identity, ask: &Ask, now: Instant) -> Result<f64, Refused> {
        let t = s.tenant(&self.cfg, &id.tenant, now);
        let Some(b) = t.budget.as_mut() else { return Ok(0.0) };
        if let (Some(fleet), Some(rule)) = (self.fleet.get(), self.cfg.rule(&id.tenant).budget) {
            b.share(rule, fleet.replicas(), now);
        }
        b.refill(now);
        let (hold, need) = b.hold(ask.tokens as u64, ask.max_tokens.map_or(0, u64::from));
        if b.level >= need {
            b.level -= hold;
            return Ok(hold);
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let refill_s = ((need - b.level) / b.rate()).ceil().max(1.0) as u64;
        let rule = self.cfg.rule(&id.tenant).budget.unwrap_or(b.rule);
        Err(self.budget_refused(s, id, rule, refill_s))
    }

    /// Counts a budget's refusal.
    fn budget_refused(&self, s: &mut State, id: &Identity, rule: BudgetRule, refill_s: u64) -> Refused {
        if let Some(t) = s.tenants.get_mut(&id.tenant) {
            t.refused_budget += 1;
        }
        if let Some(bq) = s.bands.get_mut(id.band) {
            *bq.refused.entry("budget").or_default() += 1;
        }
        Refused::Budget {
            tenant: id.tenant.to_string(),
            tokens_per_minute: rule.tokens_per_minute,
            counts: rule.counts.as_str(),
            refill_s,
        }
    }

    /// With a fleet: takes the request's hold of its tenant's bucket in the store. `Ok(Some(hold))`
    /// taken there; `Ok(None)`: no budget, no fleet, or the store cannot be reached (this
    /// replica's share is checked instead).
    async fn fleet_budget(&self, id: &Identity, ask: &Ask) -> Result<Option<f64>, Refused> {
        let Some(fleet) = self.fleet.get() else { return Ok(None) };
        let Some(rule) = self.cfg.rule(&id.tenant).budget else { return Ok(None) };
        let (hold, need) = rule.hold(ask.tokens as u64, ask.max_tokens.map_or(0, u64::from));
        // The store's answer is awaited in a task of its own: a request dropped while the call is
        // out (its client gone) would leave a hold the store took and nobody gives back; the
        // task gives it back when nobody is left to take the answer.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (f, tenant) = (Arc::clone(fleet), Arc::clone(&id.tenant));
        tokio::spawn(async move {
            let answer = f.reserve(&tenant, rule, hold, need).await;
            if let Err(Some(Ok(()))) = tx.send(answer) {
                f.give_back(&tenant, rule, hold);
            }
        });
        let mut answer =
            StoreAnswer { rx, fleet: Arc::clone(fleet), tenant: Arc::clone(&id.tenant), rule, hold };
        match (&mut answer.rx).await.unwrap_or(None) {
            Some(Ok(())) => Ok(Some(hold)),
            Some(Err(refill_s)) => {
                let mut s = self.lock();
                s.tenant(&self.cfg, &id.tenant, Instant::now());
                Err(self.budget_refused(&mut s, id, rule, refill_s))
            }
            None => {
                self.budget_local.fetch_add(1, Ordering::Relaxed);
                Ok(None)
            }
        }
    }

    fn waited(&self, band: usize, d: Duration) {
        if let Some(b) = self.lock().bands.get_mut(band) {
            b.waited += d;
        }
    }

    fn count_refused(&self, band: usize, r: &Refused) {
        if let Some(b) = self.lock().bands.get_mut(band) {
            *b.refused.entry(r.reason()).or_default() += 1;
        }
    }

    /// Lets the request in: at once when nobody waits (or is being let go) and `room(tokens)`
    /// says a decoder can take it; otherwise it waits its turn (or is refused: budget, band full,
    /// shed, deadline). `note` is told where it waited and for whom, for the decision record.
    pub async fn enter(
        self: &Arc<Self>,
        id: &Identity,
        ask: Ask,
        room: impl Fn(usize) -> bool,
        note: impl FnOnce(Value),
    ) -> Result<Admitted, Refused> {
        let now = Instant::now();
        let input = ask.tokens as u64;
        let input_cost = self.cfg.input_cost * input as f64;
        let band_name = self.cfg.bands.get(id.band).map_or("", |b| b.name.as_str());
        let (mut deadline_by, mut deadline) = id.deadline;
        if let Some(w) = ask.plugin_wait
            && now + w < deadline
        {
            (deadline_by, deadline) = ("the admission plugin's wait", now + w);
        }
        let refuse = |r: Refused| {
            self.count_refused(id.band, &r);
            Err(r)
        };
        if deadline <= now {
            // It spent its time before it got here (tokenizing, the admission plugin).
            return refuse(Refused::Deadline { by: deadline_by, waited: id.arrived.elapsed() });
        }
        // What the request holds of its tenant's budget from here on, given back by its drop.
        let mut charge = Charge {
            flow: Arc::clone(self),
            tenant: Arc::clone(&id.tenant),
            input,
            seen: 0,
            charged: 0,
            held: 0.0,
            in_store: false,
            dispatched: false,
            finished: false,
        };
        let in_store = match self.fleet_budget(id, &ask).await {
            Ok(held) => held,
            Err(r) => {
                drop(charge);
                return Err(r);
            }
        };
        let entered = {
            let mut s = self.lock();
            let budget = match in_store {
                Some(held) => {
                    // Taken of the fleet's bucket: this replica's share mirrors it, so that its
                    // share holds its own recent use when the store goes away.
                    let now = Instant::now();
                    let fleet_rule = self.cfg.rule(&id.tenant).budget;
                    let replicas = self.fleet.get().map_or(1, |f| f.replicas());
                    if let (Some(b), Some(rule)) =
                        (s.tenant(&self.cfg, &id.tenant, now).budget.as_mut(), fleet_rule)
                    {
                        b.share(rule, replicas, now);
                        b.refill(now);
                        b.level -= held;
                    }
                    charge.in_store = true;
                    Ok(held)
                }
                None => self.check_budget(&mut s, id, &ask, now),
            };
            match budget {
                Err(r) => Err(r),
                Ok(held) => {
                    charge.held = held;
                    self.queue_or_go(&mut s, id, &ask, input_cost, deadline, &room)
                }
            }
        };
        let (mut place, ahead) = match entered {
            Err(r) => return Err(r),
            Ok(None) => {
                charge.dispatched = true;
                note(json!({"tenant": &*id.tenant, "band": band_name, "queued": false}));
                return Ok(Admitted {
                    charge,
                    waited: Duration::ZERO,
                    queued: false,
                    deadline,
                    settle: None,
                });
            }
            Ok(Some(queued)) => queued,
        };
        self.wake.notify_one();
        let got = match place.rx.as_mut() {
            Some(rx) => tokio::time::timeout_at(deadline, rx).await.ok().and_then(Result::ok),
            None => None,
        };
        let waited = now.elapsed();
        match got {
            Some(go) => {
                // The dispatcher took it out of the queue and charged it already.
                place.queued = false;
                drop(place);
                charge.dispatched = true;
                self.waited(id.band, waited);
                let served: Vec<Value> =
                    go.served_first.iter().map(|(t, n)| json!({"tenant": &**t, "requests": n})).collect();
                note(json!({"tenant": &*id.tenant, "band": band_name, "queued": true,
                            "waiting_ahead": ahead, "waited_ms": crate::telemetry::metrics::ms(waited),
                            "why": "no decoder had room for it, or others were ahead",
                            "served_first": served}));
                Ok(Admitted { charge, waited, queued: true, deadline, settle: go.settle })
            }
            None => {
                // Leaves the queue (or, let go just as its deadline passed, is undone): never sent.
                drop(place);
                drop(charge);
                if deadline_by == GATEWAY_WAIT {
                    refuse(Refused::Timeout { waited })
                } else {
                    refuse(Refused::Deadline { by: deadline_by, waited: id.arrived.elapsed() })
                }
            }
        }
    }

    /// Under the lock: lets the request go now (`None`), refuses it, or queues it (its receiver,
    /// its place, and the requests ahead of it).
    fn queue_or_go(
        self: &Arc<Self>,
        s: &mut State,
        id: &Identity,
        ask: &Ask,
        input_cost: f64,
        deadline: Instant,
        room: &impl Fn(usize) -> bool,
    ) -> Result<Option<(Place, usize)>, Refused> {
        let now = Instant::now();
        if s.queued == 0 && s.in_dispatch == 0 && room(ask.tokens) {
            self.dispatch_now(s, &id.tenant, ask.tokens as u64, input_cost, id.band);
            return Ok(None);
        }
        let Some(band) = self.cfg.bands.get(id.band) else {
            return Err(Refused::Shed { band: String::new() });
        };
        let (count, bytes) = s.bands.get(id.band).map_or((0, 0), |b| (b.count, b.bytes));
        let refused = if band.sheddable() {
            Some(Refused::Shed { band: band.name.clone() })
        } else if count >= band.max_requests {
            Some(Refused::BandFull {
                band: band.name.clone(),
                limit: format!("{} requests", band.max_requests),
            })
        } else if bytes + ask.bytes > band.max_bytes {
            Some(Refused::BandFull { band: band.name.clone(), limit: format!("{} bytes", band.max_bytes) })
        } else {
            None
        };
        if let Some(r) = refused {
            if let Some(b) = s.bands.get_mut(id.band) {
                *b.refused.entry(r.reason()).or_default() += 1;
            }
            return Err(r);
        }
        s.seq += 1;
        let seq = s.seq;
        let order = match self.cfg.within {
            Within::Fcfs => seq,
            Within::Edf => {
                u64::try_from(deadline.saturating_duration_since(base()).as_micros()).unwrap_or(u64::MAX)
            }
        };
        let key = (order, seq);
        let (tx, rx) = oneshot::channel();
        let since = s.dispatches;
        let ahead: usize = s.bands.iter().take(id.band + 1).map(|b| b.count).sum();
        if s.tenant(&self.cfg, &id.tenant, now).queued == 0 {
            s.lift(&id.tenant);
        }
        if let Some(t) = s.tenants.get_mut(&id.tenant) {
            t.queued += 1;
        }
        s.queued += 1;
        if let Some(b) = s.bands.get_mut(id.band) {
            b.count += 1;
            b.bytes += ask.bytes;
            let w =
                Waiter { tokens: ask.tokens, arrived: id.arrived, bytes: ask.bytes, input_cost, since, tx };
            b.flows.entry(Arc::clone(&id.tenant)).or_default().insert(key, w);
        }
        let place = Place {
            flow: Arc::clone(self),
            band: id.band,
            tenant: Arc::clone(&id.tenant),
            key,
            queued: true,
            rx: Some(rx),
            input: ask.tokens as u64,
            input_cost,
        };
        Ok(Some((place, ahead)))
    }

    /// Charges and counts a request let go (the fast path's or the dispatcher's).
    fn dispatch_now(&self, s: &mut State, tenant: &Arc<str>, input: u64, input_cost: f64, band: usize) {
        let now = Instant::now();
        let t = s.tenant(&self.cfg, tenant, now);
        t.serve(input_cost / t.weight);
        t.served_input += input;
        t.open += 1;
        if let Some(b) = s.bands.get_mut(band) {
            b.dispatched += 1;
        }
        s.note_dispatch(tenant);
    }

    /// Undoes [`FlowControl::dispatch_now`] for a request let go that was gone by then.
    fn refund(&self, s: &mut State, tenant: &Arc<str>, input: u64, input_cost: f64, band: usize) {
        if let Some(t) = s.tenants.get_mut(tenant) {
            t.serve(-input_cost / t.weight);
            t.served_input = t.served_input.saturating_sub(input);
            t.open = t.open.saturating_sub(1);
        }
        if let Some(b) = s.bands.get_mut(band) {
            b.dispatched = b.dispatched.saturating_sub(1);
        }
    }

    /// The request to be let go next: its prompt tokens and how long it has waited (the cluster
    /// asks the store for room for it).
    pub fn head(&self) -> Option<(usize, Duration)> {
        let s = self.lock();
        let (band, tenant, key) = s.head()?;
        let w = s.waiter(band, &tenant, key)?;
        Some((w.tokens, w.arrived.elapsed()))
    }

    /// Lets the next waiter go if `room(tokens)` says a decoder can take it; the receiver is told
    /// when it took its slots (or gave up). `None`: nobody waits, or the head does not fit yet.
    pub fn next(&self, room: impl Fn(usize) -> bool) -> Option<oneshot::Receiver<()>> {
        let mut s = self.lock();
        loop {
            let (band, tenant, key) = s.head()?;
            let fits = s.waiter(band, &tenant, key).is_some_and(|w| room(w.tokens));
            if !fits {
                return None;
            }
            let w = s.take(band, &tenant, key)?;
            let served_first = s.served_since(w.since);
            self.dispatch_now(&mut s, &tenant, w.tokens as u64, w.input_cost, band);
            let (settle, settled) = oneshot::channel();
            match w.tx.send(Go { settle: Some(settle), served_first }) {
                Ok(()) => {
                    s.in_dispatch += 1;
                    return Some(settled);
                }
                // It left as it was chosen: undo its charge and look again.
                Err(_) => self.refund(&mut s, &tenant, w.tokens as u64, w.input_cost, band),
            }
        }
    }

    /// Lets waiters go while `room` says a decoder has room for them, until `gateway` is gone.
    pub async fn run<G: Send + Sync + 'static>(
        self: Arc<Self>,
        gateway: std::sync::Weak<G>,
        room: impl Fn(&G, usize) -> bool,
    ) {
        loop {
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(TICK) => {}
            }
            let Some(g) = gateway.upgrade() else { return };
            while let Some(settled) = self.next(|tokens| room(&g, tokens)) {
                let _ = tokio::time::timeout(SETTLE, settled).await;
                self.settled();
            }
        }
    }

    /// A request [`FlowControl::next`] let go took its slots (or gave up, or `SETTLE` passed).
    pub fn settled(&self) {
        let mut s = self.lock();
        s.in_dispatch = s.in_dispatch.saturating_sub(1);
    }

    /// Requests waiting, in all bands.
    pub fn queued(&self) -> usize {
        self.lock().queued
    }

    /// `/admin/flow`: bands, their flows, tenants' counters and budgets.
    pub fn view(&self) -> Value {
        let s = self.lock();
        let now = Instant::now();
        let bands: Vec<Value> = self
            .cfg
            .bands
            .iter()
            .zip(&s.bands)
            .map(|(cfg, b)| {
                let mut flows: Vec<Value> =
                    b.flows.iter().map(|(t, q)| json!({"tenant": &**t, "queued": q.len()})).collect();
                flows.sort_by(|a, b| a["tenant"].as_str().cmp(&b["tenant"].as_str()));
                json!({"name": cfg.name, "priority": cfg.priority, "sheddable": cfg.sheddable(),
                       "queued": b.count, "queued_bytes": b.bytes, "max_requests": cfg.max_requests,
                       "max_bytes": cfg.max_bytes, "dispatched": b.dispatched, "refused": b.refused,
                       "waited_s": b.waited.as_secs_f64(),
                       "flows": flows})
            })
            .collect();
        let mut tenants: Vec<Value> = s
            .tenants
            .iter()
            .map(|(t, st)| {
                let budget = st.budget.as_ref().map(|b| {
                    let since = now.saturating_duration_since(b.at).as_secs_f64();
                    let level = (b.level + b.rate() * since).min(b.rule.tokens_per_minute as f64);
                    json!({"tokens_per_minute": b.rule.tokens_per_minute, "counts": b.rule.counts.as_str(),
                           "available": level.round(), "refused": st.refused_budget})
                });
                json!({"tenant": &**t, "weight": st.weight, "virtual_counter": st.fair(),
                       "other_replicas_counter": st.others,
                       "queued": st.queued, "in_flight": st.open, "served_input_tokens": st.served_input,
                       "served_output_tokens": st.served_output, "budget": budget})
            })
            .collect();
        tenants.sort_by(|a, b| a["tenant"].as_str().cmp(&b["tenant"].as_str()));
        json!({"queued": s.queued, "within_flow": match self.cfg.within { Within::Fcfs => "fcfs", Within::Edf => "edf" },
               "input_cost": self.cfg.input_cost, "output_cost": self.cfg.output_cost,
               "bands": bands, "tenants": tenants})
    }

    /// The `baton_flow_*` series; `tenant_label` caps the tenant label values.
    pub fn metrics(&self, out: &mut Scrape, tenant_label: impl Fn(&str) -> Arc<str>) {
        let s = self.lock();
        for (cfg, b) in self.cfg.bands.iter().zip(&s.bands) {
            let l = [("band", cfg.name.as_str())];
            out.gauge("baton_flow_queued_requests", "Requests waiting in the band.", &l, b.count as f64);
            out.gauge("baton_flow_queued_bytes", "Request bytes waiting in the band.", &l, b.bytes as f64);
            out.counter(
                "baton_flow_dispatched_total",
                "Requests the band let go to an engine.",
                &l,
                b.dispatched as f64,
            );
            out.counter(
                "baton_flow_wait_seconds_total",
                "Time the band's queued requests waited before they were let go (over dispatched: the mean).",
                &l,
                b.waited.as_secs_f64(),
            );
            for reason in ["band_full", "shed", "deadline", "timeout", "budget", "unknown_band"] {
                let n = b.refused.get(reason).copied().unwrap_or(0);
                out.counter(
                    "baton_flow_refused_total",
                    "Requests flow control refused, by why (none reached an engine).",
                    &[("band", cfg.name.as_str()), ("reason", reason)],
                    n as f64,
                );
            }
        }
        if self.fleet.get().is_some() {
            out.counter(
                "baton_flow_budget_local_total",
                "Budget checks made against this replica's share because the cluster store could not be reached.",
                &[],
                self.budget_local.load(Ordering::Relaxed) as f64,
            );
        }
        let mut by_label: BTreeMap<Arc<str>, (f64, f64, f64)> = BTreeMap::new();
        for (t, st) in &s.tenants {
            let e = by_label.entry(tenant_label(t)).or_default();
            e.0 += st.queued as f64;
            e.1 +=
                self.cfg.input_cost * st.served_input as f64 + self.cfg.output_cost * st.served_output as f64;
            e.2 += st.refused_budget as f64;
        }
        for (t, (queued, served, refused)) in by_label {
            let l = [("tenant", &*t)];
            out.gauge("baton_flow_tenant_queued_requests", "Requests the tenant has waiting.", &l, queued);
            out.counter(
                "baton_flow_tenant_served_cost_total",
                "Service the tenant received: input tokens × input_cost + output tokens × output_cost.",
                &l,
                served,
            );
            out.counter(
                "baton_flow_budget_refusals_total",
                "Requests refused for the tenant's token budget.",
                &l,
                refused,
            );
        }
    }
}

/// The zero of EDF's order keys.
fn base() -> Instant {
    static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *BASE.get_or_init(Instant::now)
}
