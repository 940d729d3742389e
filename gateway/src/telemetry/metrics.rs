//! The gateway's metrics, `baton_` prefixed, with bounded labels, recorded as requests run into the
//! Prometheus client's registry (histograms, counters), plus the requests in flight, read at scrape
//! time. The label values that come from outside (tenants) are capped: past
//! [`DEFAULT_TENANT_SERIES`] distinct tenants, the rest are counted as [`OTHER_TENANT`].

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use serde_json::{Map, Value, json};

use super::Phase;
use super::request_id::{self, RequestId};
use super::scrape::Scrape;

/// Histogram bounds in seconds: 100 µs to 60 s.
pub const BUCKETS: [f64; 16] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];

/// Finished requests whose decision records are kept for `GET /admin/requests/{id}`.
pub const DEFAULT_RECORDS: usize = 1024;

/// Distinct tenants given their own `baton_tokens_total` series; the others share [`OTHER_TENANT`].
pub const DEFAULT_TENANT_SERIES: usize = 100;
/// The tenant label of the tenants past the cap.
pub const OTHER_TENANT: &str = "other";

/// The gateway's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `baton_phase_seconds`, one child per [`Phase`] (indexed by it).
    phases: Vec<Histogram>,
    answered: IntCounterVec,
    first_token: HistogramVec,
    inter_token: HistogramVec,
    duration: HistogramVec,
    kv_transfer: HistogramVec,
    cancelled: IntCounterVec,
    engine_errors: IntCounterVec,
    lease_expirations: IntCounterVec,
    refusals: IntCounterVec,
    retries: IntCounterVec,
    tokens: IntCounterVec,
    tenants: Tenants,
    flight: Flight,
    /// The decision records of the last finished requests, newest last.
    records: Mutex<std::collections::VecDeque<Arc<Kept>>>,
    keep_records: usize,
    /// Every family registered, whether or not it has a sample yet.
    names: Vec<String>,
}

impl Metrics {
    /// Every family registered; `tenant_series` caps the tenants with series of their own, `records`
    /// the finished requests whose decision records are kept.
    pub fn new(tenant_series: usize, records: usize) -> prometheus::Result<Self> {
        let registry = Registry::new();
        let names = std::cell::RefCell::new(Vec::new());
        let hist = |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<HistogramVec> {
            let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(BUCKETS.to_vec()), labels)?;
            registry.register(Box::new(h.clone()))?;
            names.borrow_mut().push(name.to_owned());
            Ok(h)
        };
        let counter = |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<IntCounterVec> {
            let c = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(c.clone()))?;
            names.borrow_mut().push(name.to_owned());
            Ok(c)
        };
        let phase = hist(
            "baton_phase_seconds",
            "Time spent in each phase of a request (route: plugin admission and routing; total: to the response headers; stream: headers to the last byte).",
            &["phase"],
        )?;
        let mut m = Self {
            phases: Phase::ALL.iter().map(|p| phase.with_label_values(&[p.as_str()])).collect(),
            answered: counter("baton_requests_total", "Requests answered, by HTTP status.", &["status"])?,
            first_token: hist(
                "baton_time_to_first_token_seconds",
                "From the parsed request (before its tokens are counted) to the first streamed chunk sent to the client.",
                &["mode"],
            )?,
            inter_token: hist(
                "baton_inter_token_seconds",
                "Between successive streamed chunks sent to the client (one token per chunk from vLLM and SGLang).",
                &["mode"],
            )?,
            duration: hist(
                "baton_request_duration_seconds",
                "A generation request from its parsing (before its tokens are counted) to the last byte sent (or the client leaving), by outcome.",
                &["mode", "outcome"],
            )?,
            kv_transfer: hist(
                "baton_kv_transfer_seconds",
                "From the prefill's answer until every decoder rank holds the KV (modes where the gateway sees it).",
                &["mode"],
            )?,
            cancelled: counter(
                "baton_cancellations_total",
                "Requests whose client left before the answer ended, by the phase they were in.",
                &["phase"],
            )?,
            engine_errors: counter(
                "baton_engine_errors_total",
                "Engine calls that failed, by leg and status: the engine's HTTP status, timeout, error (no usable answer), stream (the answer broke off); leg kv: the KV never arrived.",
                &["leg", "status"],
            )?,
            lease_expirations: counter(
                "baton_lease_expirations_total",
                "Requests whose pages a decoder rank reclaimed at the lease deadline before the KV was complete.",
                &["decoder"],
            )?,
            refusals: counter(
                "baton_reservation_refusals_total",
                "Page reservations a decoder's ranks refused for lack of room.",
                &["decoder"],
            )?,
            retries: counter(
                "baton_reservation_retries_total",
                "Page reservations tried again after a refusal.",
                &["decoder"],
            )?,
            tokens: counter(
                "baton_tokens_total",
                "Tokens by tenant (prompt: counted by the gateway; completion: the engine's usage, else streamed events).",
                &["tenant", "kind"],
            )?,
            tenants: Tenants { cap: tenant_series, seen: RwLock::default() },
            flight: Flight::default(),
            records: Mutex::default(),
            keep_records: records,
            names: Vec::new(),
            registry,
        };
        m.names = names.into_inner();
        // Every phase's series from the start, so a rate over the first cancellation has a zero
        // before it.
        for p in Phase::LIVE {
            m.cancelled.with_label_values(&[p.as_str()]);
        }
        Ok(m)
    }

    /// The families recorded as requests run (a family appears in a scrape from its first sample;
    /// the in-flight gauges, always there, are not listed).
    pub fn family_names(&self) -> &[String] {
        &self.names
    }

    /// Records a phase duration.
    pub fn phase(&self, phase: Phase, d: Duration) {
        if let Some(h) = self.phases.get(phase as usize) {
            h.observe(d.as_secs_f64());
        }
    }

    /// Records every phase of a request.
    /// A request's phases; the wait for the KV also as the KV transfer of the decoder's `mode`.
    pub fn record(&self, timing: &super::Timing, mode: &str) {
        for (p, d) in timing.phases() {
            self.phase(*p, *d);
            if *p == super::Phase::KvReady {
                self.kv_transfer(mode, *d);
            }
        }
    }

    pub fn answered(&self, status: u16) {
        // The status's own text (`StatusCode::as_str`), not one formatted for each request.
        match hyper::StatusCode::from_u16(status) {
            Ok(s) => self.answered.with_label_values(&[s.as_str()]).inc(),
            Err(_) => self.answered.with_label_values(&[status.to_string()]).inc(),
        }
    }

    pub fn first_token(&self, mode: &str, d: Duration) {
        self.first_token.with_label_values(&[mode]).observe(d.as_secs_f64());
    }

    pub fn inter_token(&self, mode: &str, d: Duration) {
        self.inter_token.with_label_values(&[mode]).observe(d.as_secs_f64());
    }

    /// A request's end: `outcome` is `ok`, `error` (the engine's stream broke) or `cancelled`.
    pub fn ended(&self, mode: &str, outcome: &str, d: Duration) {
        self.duration.with_label_values(&[mode, outcome]).observe(d.as_secs_f64());
    }

    pub fn kv_transfer(&self, mode: &str, d: Duration) {
        self.kv_transfer.with_label_values(&[mode]).observe(d.as_secs_f64());
    }

    /// An engine call that failed: `status` is the engine's HTTP status, `timeout` or `error`.
    pub fn engine_error(&self, leg: &str, status: &str) {
        self.engine_errors.with_label_values(&[leg, status]).inc();
    }

    pub fn lease_expired(&self, decoder: &str) {
        self.lease_expirations.with_label_values(&[decoder]).inc();
    }

    /// A reservation refused for room; `retried` when it is tried again.
    pub fn reservation_refused(&self, decoder: &str, retried: bool) {
        self.refusals.with_label_values(&[decoder]).inc();
        if retried {
            self.retries.with_label_values(&[decoder]).inc();
        }
    }

    /// The `tenant` label value for a tenant: its name, or [`OTHER_TENANT`] past the cap.
    pub fn tenant_label(&self, tenant: &str) -> Arc<str> {
        self.tenants.label(tenant)
    }

    /// A request's tokens, under its tenant (empty when auth is off; [`OTHER_TENANT`] past the cap).
    pub fn tokens(&self, tenant: Option<&str>, prompt: u64, completion: u64) {
        let t = self.tenants.label(tenant.unwrap_or(""));
        let t: &str = &t;
        self.tokens.with_label_values(&[t, "prompt"]).inc_by(prompt);
        self.tokens.with_label_values(&[t, "completion"]).inc_by(completion);
    }

    /// A request from now until the returned guard drops: counted in the in-flight gauges, its
    /// phase kept in its [`Live`]. A guard dropped before [`Tracked::settle`] is a cancellation in
    /// the phase it was in.
    pub fn track(self: &Arc<Self>) -> Tracked {
        let live = Arc::new(Live {
            id: request_id::current(),
            started: Instant::now(),
            decoder: AtomicU32::new(NOT_ROUTED),
            phase: AtomicU8::new(Phase::Route as u8),
            since_us: AtomicU64::new(0),
            record: (self.keep_records > 0).then(|| Mutex::new(Vec::with_capacity(PARTS))),
        });
        let key = self.flight.next.fetch_add(1, Ordering::Relaxed);
        self.flight.table().insert(key, Arc::clone(&live));
        Tracked { metrics: Arc::clone(self), key, live, settled: false }
    }

    /// A request's decision record: in flight (so far) or among the last finished.
    pub fn record_of(&self, id: &str) -> Option<Value> {
        let named = |i: &Option<RequestId>| i.as_ref().is_some_and(|i| i.as_str() == id);
        let live = self.flight.table().values().find(|l| named(&l.id)).cloned();
        if let Some(l) = live {
            return Some(l.record());
        }
        let kept = {
            let kept = self.records.lock().unwrap_or_else(PoisonError::into_inner);
            kept.iter().rev().find(|r| named(&r.id)).cloned()
        };
        // Rendered outside the ring's lock.
        kept.map(|k| render(k.id.as_ref(), &k.parts, [("duration_ms", json!(k.duration_ms))]))
    }

    fn keep(&self, record: Kept) {
        let record = Arc::new(record);
        let oldest = {
            let mut kept = self.records.lock().unwrap_or_else(PoisonError::into_inner);
            let oldest = if kept.len() >= self.keep_records { kept.pop_front() } else { None };
            kept.push_back(record);
            oldest
        };
        // Freed outside the lock.
        drop(oldest);
    }

    /// The requests in flight now, oldest first.
    pub fn in_flight(&self) -> Vec<Arc<Live>> {
        let mut v: Vec<Arc<Live>> = self.flight.table().values().cloned().collect();
        v.sort_by_key(|l| l.started);
        v
    }

    /// The registry's families and the in-flight gauges.
    pub fn scrape(&self, s: &mut Scrape) {
        s.extend(self.registry.gather());
        let now = Instant::now();
        let mut by_phase: HashMap<Phase, (u64, Duration)> = HashMap::new();
        for l in self.flight.table().values() {
            let e = by_phase.entry(l.phase()).or_default();
            e.0 += 1;
            e.1 = e.1.max(now.saturating_duration_since(l.started));
        }
        for p in Phase::LIVE {
            let (n, oldest) = by_phase.get(&p).copied().unwrap_or_default();
            let labels = [("phase", p.as_str())];
            s.gauge(
                "baton_requests_in_phase",
                "Requests in flight, by the phase they are in.",
                &labels,
                n as f64,
            );
            s.gauge(
                "baton_oldest_request_age_seconds",
                "Age of the oldest request in flight in each phase (0 when none).",
                &labels,
                oldest.as_secs_f64(),
            );
        }
    }
}

/// Whole milliseconds.
pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The tenants given series of their own.
#[derive(Debug)]
struct Tenants {
    cap: usize,
    seen: RwLock<HashSet<Arc<str>>>,
}

impl Tenants {
    fn label(&self, tenant: &str) -> Arc<str> {
        if let Some(t) = self.seen.read().unwrap_or_else(PoisonError::into_inner).get(tenant) {
            return Arc::clone(t);
        }
        let mut seen = self.seen.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = seen.get(tenant) {
            return Arc::clone(t);
        }
        if seen.len() >= self.cap {
            return Arc::from(OTHER_TENANT);
        }
        let t: Arc<str> = Arc::from(tenant);
        seen.insert(Arc::clone(&t));
        t
    }
}

/// The requests in flight.
#[derive(Debug, Default)]
struct Flight {
    next: AtomicU64,
    live: Mutex<HashMap<u64, Arc<Live>>>,
}

impl Flight {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Live>>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One request in flight: its id, age and the phase it is in.
pub struct Live {
    pub id: Option<RequestId>,
    pub started: Instant,
    /// The index of the decoder it was routed to ([`NOT_ROUTED`] before).
    decoder: AtomicU32,
    phase: AtomicU8,
    /// When the phase began, in µs after `started`.
    since_us: AtomicU64,
    /// What was decided for it so far (its decision record's parts, in the order first noted);
    /// `None` when `[telemetry] records` is 0.
    record: Option<Mutex<Parts>>,
}

/// A part of a decision record: what was decided, kept as the values it was decided on and
/// written as JSON only when the record is read (most never are).
pub type Part = Box<dyn Fn() -> Value + Send + Sync>;

/// A record's parts by name.
type Parts = Vec<(&'static str, Part)>;

/// Room for the parts a request notes (its tokens, admission, route, phases, outcome and the
/// mode's own): made once, not grown three times over as they come.
const PARTS: usize = 12;

/// A finished request's decision record.
struct Kept {
    id: Option<RequestId>,
    parts: Parts,
    duration_ms: u64,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept").field("id", &self.id).field("parts", &self.parts.len()).finish()
    }
}

/// The record: the id, then `parts`, then `last`.
fn render<const N: usize>(id: Option<&RequestId>, parts: &Parts, last: [(&str, Value); N]) -> Value {
    let mut r = Map::with_capacity(parts.len() + N + 1);
    r.insert("id".into(), json!(id.map(RequestId::as_str)));
    r.extend(parts.iter().map(|(k, v)| ((*k).to_owned(), v())));
    r.extend(last.into_iter().map(|(k, v)| (k.to_owned(), v)));
    Value::Object(r)
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").field("id", &self.id).field("phase", &self.phase()).finish_non_exhaustive()
    }
}

/// [`Live::decoder`] before the request is routed.
const NOT_ROUTED: u32 = u32::MAX;

impl Live {
    /// The request is in `p` from now.
    pub fn enter(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::Relaxed);
        let us = u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.since_us.store(us, Ordering::Relaxed);
    }

    /// The request was routed to the decoder at `index` (in the gateway's list).
    pub fn routed(&self, index: usize) {
        self.decoder.store(u32::try_from(index).unwrap_or(NOT_ROUTED), Ordering::Relaxed);
    }

    /// The index of the decoder it was routed to, once routed.
    pub fn decoder(&self) -> Option<usize> {
        let i = self.decoder.load(Ordering::Relaxed);
        (i != NOT_ROUTED).then_some(i as usize)
    }

    pub fn phase(&self) -> Phase {
        Phase::ALL.get(usize::from(self.phase.load(Ordering::Relaxed))).copied().unwrap_or(Phase::Route)
    }

    /// Adds a part of the decision record (`route`, `admission`, `queue`, …), replacing one of the
    /// same name: `v` keeps what it needs and writes the JSON when the record is read. Nothing is
    /// kept when records are off.
    pub fn note(&self, part: &'static str, v: impl Fn() -> Value + Send + Sync + 'static) {
        if let Some(r) = &self.record {
            let v: Part = Box::new(v);
            let mut parts = r.lock().unwrap_or_else(PoisonError::into_inner);
            match parts.iter_mut().find(|(k, _)| *k == part) {
                Some(slot) => slot.1 = v,
                None => parts.push((part, v)),
            }
        }
    }

    /// The decision record now: the id, the parts noted, the phase and the age.
    pub fn record(&self) -> Value {
        let now = [("phase", json!(self.phase().as_str())), ("age_ms", json!(ms(self.started.elapsed())))];
        match &self.record {
            Some(r) => render(self.id.as_ref(), &r.lock().unwrap_or_else(PoisonError::into_inner), now),
            None => render(self.id.as_ref(), &Vec::new(), now),
        }
    }

    /// How long the request has been in its phase.
    pub fn in_phase(&self) -> Duration {
        self.started.elapsed().saturating_sub(Duration::from_micros(self.since_us.load(Ordering::Relaxed)))
    }
}

/// A request's place in the in-flight table (see [`Metrics::track`]).
#[derive(Debug)]
pub struct Tracked {
    metrics: Arc<Metrics>,
    key: u64,
    live: Arc<Live>,
    settled: bool,
}

impl Tracked {
    pub fn live(&self) -> &Arc<Live> {
        &self.live
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The request ended (answered, failed or finished streaming): not a cancellation.
    pub fn settle(&mut self) {
        self.settled = true;
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.metrics.flight.table().remove(&self.key);
        if !self.settled {
            let phase = self.live.phase().as_str();
            self.metrics.cancelled.with_label_values(&[phase]).inc();
            self.live.note("outcome", move || json!({"end": "cancelled", "phase": phase}));
        }
        if let Some(r) = &self.live.record {
            // Taken, not copied: nothing is noted once the request has ended.
            let parts = std::mem::take(&mut *r.lock().unwrap_or_else(PoisonError::into_inner));
            let duration_ms = ms(self.live.started.elapsed());
            self.metrics.keep(Kept { id: self.live.id.clone(), parts, duration_ms });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &Metrics) -> String {
        let mut s = Scrape::default();
        m.scrape(&mut s);
        s.encode()
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_counts_add_up() -> prometheus::Result<()> {
        let m = Metrics::new(DEFAULT_TENANT_SERIES, DEFAULT_RECORDS)?;
        m.phase(Phase::Queue, Duration::from_micros(50));
        m.phase(Phase::Queue, Duration::from_millis(3));
        m.answered(200);
        m.answered(200);
        m.answered(413);
        let text = text(&m);
        assert!(text.contains("baton_phase_seconds_bucket{phase=\"queue\",le=\"0.0001\"} 1"), "{text}");
        assert!(text.contains("baton_phase_seconds_bucket{phase=\"queue\",le=\"0.005\"} 2"), "{text}");
        assert!(text.contains("baton_phase_seconds_count{phase=\"queue\"} 2"));
        assert!(text.contains("baton_phase_seconds_count{phase=\"total\"} 0"));
        assert!(text.contains("baton_requests_total{status=\"200\"} 2"));
        assert!(text.contains("baton_requests_total{status=\"413\"} 1"));
        Ok(())
    }

    #[test]
    fn tenants_past_the_cap_are_other() -> prometheus::Result<()> {
        let m = Metrics::new(2, 0)?;
        for t in ["a", "b", "c", "a", "d"] {
            m.tokens(Some(t), 10, 1);
        }
        let text = text(&m);
        assert!(text.contains("baton_tokens_total{kind=\"prompt\",tenant=\"a\"} 20"), "{text}");
        assert!(text.contains("baton_tokens_total{kind=\"prompt\",tenant=\"other\"} 20"), "{text}");
        assert!(!text.contains("tenant=\"c\""), "{text}");
        Ok(())
    }

    #[test]
    fn records_are_kept_for_the_last_n_and_none_when_off() -> prometheus::Result<()> {
        let id = |s: &'static str| RequestId::from_header(Some(&hyper::header::HeaderValue::from_static(s)));
        for keep in [0, 2] {
            let m = Arc::new(Metrics::new(DEFAULT_TENANT_SERIES, keep)?);
            for n in ["r1", "r2", "r3"] {
                let mut t = super::request_id::scope_sync(id(n), || m.track());
                t.live().note("queue", || json!({"wait_ms": 1}));
                // In flight: found, with its parts only when records are on.
                let r = m.record_of(n);
                assert_eq!(r.as_ref().map(|r| r.get("queue").is_some()), Some(keep > 0), "{n} in flight");
                t.settle();
            }
            // Ended: the last two kept, or none.
            let kept = |n| m.record_of(n).map(|r| r["queue"]["wait_ms"] == 1);
            let want = if keep > 0 { [None, Some(true), Some(true)] } else { [None, None, None] };
            assert_eq!([kept("r1"), kept("r2"), kept("r3")], want, "keep {keep}");
        }
        Ok(())
    }

    #[test]
    fn a_guard_dropped_unsettled_is_a_cancellation_in_its_phase() -> prometheus::Result<()> {
        let m = Arc::new(Metrics::new(DEFAULT_TENANT_SERIES, DEFAULT_RECORDS)?);
        let a = m.track();
        a.live().enter(Phase::KvReady);
        let mut b = m.track();
        b.live().enter(Phase::Decode);
        let t = text(&m);
        assert!(t.contains("baton_requests_in_phase{phase=\"kv_ready\"} 1"), "{t}");
        assert!(t.contains("baton_requests_in_phase{phase=\"decode\"} 1"), "{t}");
        assert_eq!(m.in_flight().len(), 2);
        drop(a);
        b.settle();
        drop(b);
        let t = text(&m);
        assert!(t.contains("baton_cancellations_total{phase=\"kv_ready\"} 1"), "{t}");
        assert!(t.contains("baton_cancellations_total{phase=\"decode\"} 0"), "{t}");
        assert!(t.contains("baton_requests_in_phase{phase=\"kv_ready\"} 0"), "{t}");
        assert!(m.in_flight().is_empty());
        Ok(())
    }
}
