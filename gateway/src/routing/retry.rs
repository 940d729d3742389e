//! Retries of a leg that failed before anything of it could matter: within a budget that is a
//! share of recent requests (as linkerd's and Finagle's retry budgets are), with jittered
//! exponential backoff, and never more than `attempts` tries of one request (its retries of every leg
//! together, counted on the request).
//!
//! What may be retried is decided where the failure is known (the handoff modes): a leg whose
//! engine never saw the request, or refused it (`503`), or cut the connection before answering,
//! and only while no byte reached the client and no KV transfer began. This module only says
//! whether the budget allows one more and how long to wait first.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::Rng;

use crate::telemetry::Scrape;

/// Tries of one request (the first and its retries, of any leg).
pub const DEFAULT_ATTEMPTS: u32 = 3;
/// Retries may add this share of the requests of the last [`WINDOW`].
pub const DEFAULT_BUDGET_RATIO: f64 = 0.2;
/// Retries allowed per second on top of the ratio, so a quiet gateway can still retry.
pub const DEFAULT_MIN_PER_SECOND: u32 = 10;
/// The first backoff's upper bound; each retry doubles it.
pub const DEFAULT_BACKOFF: Duration = Duration::from_millis(25);
/// The longest backoff's upper bound.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_millis(250);
/// The span the budget counts requests and retries over.
pub const WINDOW: Duration = Duration::from_secs(10);
/// The budget's buckets: one per second of the window.
const BUCKETS: usize = 10;

/// `[routing.retries]`, checked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryConfig {
    /// Tries of one request, the first included (1: no retries).
    pub attempts: u32,
    pub budget_ratio: f64,
    pub min_per_second: u32,
    pub backoff: Duration,
    pub backoff_max: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            attempts: DEFAULT_ATTEMPTS,
            budget_ratio: DEFAULT_BUDGET_RATIO,
            min_per_second: DEFAULT_MIN_PER_SECOND,
            backoff: DEFAULT_BACKOFF,
            backoff_max: DEFAULT_BACKOFF_MAX,
        }
    }
}

/// Why a retry was not made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denied {
    /// The request had its `attempts`.
    Attempts,
    /// Retries in the window already reached the budget.
    Budget,
}

#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    /// The second (since the budget's start) this bucket counts.
    second: u64,
    requests: u64,
    retries: u64,
}

/// Retry counters by leg (`prefill`, `decode`).
#[derive(Debug, Default)]
struct LegCounts {
    retried: AtomicU64,
    budget: AtomicU64,
    attempts: AtomicU64,
}

/// The gateway's retry budget and counters, shared by every request.
#[derive(Debug)]
pub struct Retries {
    pub cfg: RetryConfig,
    start: Instant,
    buckets: Mutex<[Bucket; BUCKETS]>,
    prefill: LegCounts,
    decode: LegCounts,
}

impl Retries {
    pub fn new(cfg: RetryConfig) -> Self {
        Self {
            cfg,
            start: Instant::now(),
            buckets: Mutex::new([Bucket::default(); BUCKETS]),
            prefill: LegCounts::default(),
            decode: LegCounts::default(),
        }
    }

    fn second(&self) -> u64 {
        self.start.elapsed().as_secs()
    }

    /// The bucket of `second`, emptied if it held an older second.
    fn bucket(buckets: &mut [Bucket; BUCKETS], second: u64) -> &mut Bucket {
        let b = &mut buckets[usize::try_from(second % BUCKETS as u64).unwrap_or(0)];
        if b.second != second {
            *b = Bucket { second, requests: 0, retries: 0 };
        }
        b
    }

    /// A request came: it adds its share to the budget.
    pub fn request(&self) {
        let now = self.second();
        let mut b = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        Self::bucket(&mut b, now).requests += 1;
    }

    fn counts(&self, leg: &str) -> &LegCounts {
        if leg == "prefill" { &self.prefill } else { &self.decode }
    }

    /// Whether a retry of a request that has made `tried` tries so far may go, after its `leg`
    /// failed: within the request's attempts and the budget (counted as spent when it may). The
    /// answer is counted by leg either way.
    pub fn allow(&self, leg: &str, tried: u32) -> Result<(), Denied> {
        let c = self.counts(leg);
        if tried >= self.cfg.attempts {
            c.attempts.fetch_add(1, Ordering::Relaxed);
            return Err(Denied::Attempts);
        }
        let now = self.second();
        let mut b = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let (requests, retries) = Self::window(&b, now);
        if (retries + 1) as f64 > self.allowed(requests) {
            drop(b);
            c.budget.fetch_add(1, Ordering::Relaxed);
            return Err(Denied::Budget);
        }
        Self::bucket(&mut b, now).retries += 1;
        drop(b);
        c.retried.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Requests and retries in the window that ends at `now`.
    fn window(buckets: &[Bucket; BUCKETS], now: u64) -> (u64, u64) {
        buckets
            .iter()
            .filter(|x| x.second + BUCKETS as u64 > now && x.second <= now)
            .fold((0, 0), |(q, r), x| (q + x.requests, r + x.retries))
    }

    /// Retries the window may hold with `requests` in it.
    fn allowed(&self, requests: u64) -> f64 {
        f64::from(self.cfg.min_per_second) * WINDOW.as_secs_f64() + self.cfg.budget_ratio * requests as f64
    }

    /// `/admin/engines`' `retries`: the settings, and the window's requests, retries and budget.
    pub fn view(&self) -> serde_json::Value {
        let now = self.second();
        let (requests, retries) = Self::window(&self.buckets.lock().unwrap_or_else(|e| e.into_inner()), now);
        serde_json::json!({
            "attempts": self.cfg.attempts,
            "budget_ratio": self.cfg.budget_ratio,
            "min_per_second": self.cfg.min_per_second,
            "backoff_ms": self.cfg.backoff.as_millis(),
            "backoff_max_ms": self.cfg.backoff_max.as_millis(),
            "window_s": WINDOW.as_secs(),
            "window_requests": requests,
            "window_retries": retries,
            "window_budget": self.allowed(requests).floor(),
        })
    }

    /// How long to wait before retry number `retry` (1 for the first): uniformly at random up to
    /// `backoff` doubled `retry - 1` times, at most `backoff_max` ("full jitter").
    pub fn backoff(&self, retry: u32) -> Duration {
        let cap = self
            .cfg
            .backoff
            .saturating_mul(1u32 << retry.saturating_sub(1).min(16))
            .min(self.cfg.backoff_max.max(self.cfg.backoff));
        let micros = u64::try_from(cap.as_micros()).unwrap_or(u64::MAX);
        if micros == 0 {
            return Duration::ZERO;
        }
        Duration::from_micros(rand::rng().random_range(0..=micros))
    }

    /// [`Retries::allow`] for the request whose retries so far `retried` counts (one more when
    /// allowed), then its backoff slept: `Err` when no retry may go.
    pub async fn before_retry(&self, leg: &str, retried: &AtomicU32) -> Result<(), Denied> {
        let tried = retried.load(Ordering::Relaxed).saturating_add(1);
        self.allow(leg, tried)?;
        retried.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(self.backoff(tried)).await;
        Ok(())
    }

    /// `baton_retries_total{leg}` and `baton_retries_denied_total{leg,why}`.
    pub fn metrics(&self, out: &mut Scrape) {
        for (leg, c) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            out.counter(
                "baton_retries_total",
                "Legs tried again on another engine after a failure that nothing depended on yet (no byte sent to the client, no KV moved).",
                &[("leg", leg)],
                c.retried.load(Ordering::Relaxed) as f64,
            );
            for (why, n) in [("budget", &c.budget), ("attempts", &c.attempts)] {
                out.counter(
                    "baton_retries_denied_total",
                    "Retryable failures not retried: the retry budget was spent, or the request had its attempts.",
                    &[("leg", leg), ("why", why)],
                    n.load(Ordering::Relaxed) as f64,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_the_floor_plus_a_share_of_recent_requests() {
        let r = Retries::new(RetryConfig { min_per_second: 1, budget_ratio: 0.5, ..RetryConfig::default() });
        // Nothing asked yet: the floor alone, 1 per second over the 10 s window.
        for _ in 0..10 {
            assert_eq!(r.allow("decode", 1), Ok(()));
        }
        assert_eq!(r.allow("decode", 1), Err(Denied::Budget));
        // 20 requests add 10 more.
        for _ in 0..20 {
            r.request();
        }
        for _ in 0..10 {
            assert_eq!(r.allow("prefill", 1), Ok(()));
        }
        assert_eq!(r.allow("prefill", 1), Err(Denied::Budget));
        // A leg's attempts bound it whatever the budget.
        assert_eq!(r.allow("prefill", 3), Err(Denied::Attempts));
        let mut s = Scrape::default();
        r.metrics(&mut s);
        let text = s.encode();
        for line in [
            "baton_retries_total{leg=\"decode\"} 10",
            "baton_retries_total{leg=\"prefill\"} 10",
            "baton_retries_denied_total{leg=\"decode\",why=\"budget\"} 1",
            "baton_retries_denied_total{leg=\"prefill\",why=\"budget\"} 1",
            "baton_retries_denied_total{leg=\"prefill\",why=\"attempts\"} 1",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }

    #[test]
    fn old_seconds_leave_the_window() {
        let r = Retries::new(RetryConfig { min_per_second: 0, budget_ratio: 1.0, ..RetryConfig::default() });
        let mut b = r.buckets.lock().unwrap_or_else(|e| e.into_inner());
        // 100 requests 11 s ago and 100 retries 10 s ago: neither counts now (at second 20).
        b[9] = Bucket { second: 9, requests: 100, retries: 0 };
        b[0] = Bucket { second: 10, requests: 0, retries: 100 };
        b[5] = Bucket { second: 15, requests: 2, retries: 1 };
        drop(b);
        let r =
            Retries { start: Instant::now().checked_sub(Duration::from_secs(20)).unwrap_or(r.start), ..r };
        // Second 15's two requests allow two retries; one was spent.
        assert_eq!(r.allow("decode", 1), Ok(()));
        assert_eq!(r.allow("decode", 1), Err(Denied::Budget));
    }

    #[test]
    fn backoff_is_jittered_within_its_doubling_cap() {
        let r = Retries::new(RetryConfig::default());
        for retry in 1..8u32 {
            let cap = (DEFAULT_BACKOFF * (1 << (retry - 1))).min(DEFAULT_BACKOFF_MAX);
            let waits: Vec<Duration> = (0..200).map(|_| r.backoff(retry)).collect();
            assert!(waits.iter().all(|w| *w <= cap), "retry {retry}: {waits:?}");
            // Jittered: not all the same, and some in the upper half.
            assert!(waits.iter().any(|w| *w != waits[0]));
            assert!(waits.iter().any(|w| *w > cap / 2));
        }
        let none = Retries::new(RetryConfig { backoff: Duration::ZERO, ..RetryConfig::default() });
        assert_eq!(none.backoff(3), Duration::ZERO);
    }
}
