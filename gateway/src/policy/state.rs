//! Host-owned state that a plugin's instances share: counters and token buckets, each with an
//! expiry. It belongs to the plugin's name, not to a version, so it survives reloads; a plugin never
//! holds it in its own memory, so discarding a faulty instance loses nothing.
//!
//! The clock is injected: the gateway uses a monotonic one, tests a manual one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// An entry nobody touched for this long is dropped (counters: from their creation).
pub const DEFAULT_STATE_TTL_MS: u64 = 3_600_000;
/// Most counters and buckets one plugin may keep: beyond it the oldest expired ones are swept, and
/// if none has expired new keys are refused (a bucket refuses, a counter reads 0).
pub const MAX_STATE_ENTRIES: usize = 100_000;
/// Longest key kept (bytes); longer keys are refused the same way.
pub const MAX_KEY_BYTES: usize = 256;

/// Microseconds on a monotonic clock.
#[derive(Clone, Debug)]
pub enum Clock {
    Monotonic(Instant),
    /// Set by hand (tests, benchmarks).
    Manual(Arc<AtomicU64>),
}

impl Clock {
    pub fn monotonic() -> Self {
        Self::Monotonic(Instant::now())
    }

    pub fn now_us(&self) -> u64 {
        match self {
            Self::Monotonic(t) => u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX),
            Self::Manual(v) => v.load(Ordering::Relaxed),
        }
    }
}

#[derive(Debug)]
struct Counter {
    value: i32,
    expires_us: u64,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    capacity: u32,
    refill_per_min: u32,
    at_us: u64,
}

impl Bucket {
    fn refill(&mut self, now: u64) {
        let dt_min = now.saturating_sub(self.at_us) as f64 / 60e6;
        self.tokens = (self.tokens + dt_min * f64::from(self.refill_per_min)).min(f64::from(self.capacity));
        self.at_us = now;
    }
}

/// What `bucket-take` answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Take {
    pub taken: bool,
    pub remaining: u32,
    pub retry_after_ms: u32,
}

#[derive(Debug, Default)]
struct Inner {
    counters: HashMap<String, Counter>,
    buckets: HashMap<String, Bucket>,
}

/// One plugin's shared state.
#[derive(Debug)]
pub struct SharedState {
    clock: Clock,
    inner: Mutex<Inner>,
}

fn to_u32(v: f64) -> u32 {
    // Clamped first, so the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let v = v.clamp(0.0, f64::from(u32::MAX)) as u32;
    v
}

impl SharedState {
    pub fn new(clock: Clock) -> Self {
        Self { clock, inner: Mutex::new(Inner::default()) }
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn room(inner: &mut Inner, now: u64) -> bool {
        if inner.counters.len() + inner.buckets.len() < MAX_STATE_ENTRIES {
            return true;
        }
        inner.counters.retain(|_, c| c.expires_us > now);
        let idle = DEFAULT_STATE_TTL_MS * 1000;
        inner.buckets.retain(|_, b| now.saturating_sub(b.at_us) < idle);
        inner.counters.len() + inner.buckets.len() < MAX_STATE_ENTRIES
    }

    /// Adds `delta` to a counter; returns the new value (saturating).
    pub fn counter_add(&self, key: &str, delta: i32, ttl_ms: u32) -> i32 {
        let now = self.clock.now_us();
        let ttl = if ttl_ms == 0 { DEFAULT_STATE_TTL_MS } else { u64::from(ttl_ms) };
        let mut g = self.lock();
        if let Some(c) = g.counters.get_mut(key) {
            if c.expires_us > now {
                c.value = c.value.saturating_add(delta);
                return c.value;
            }
            g.counters.remove(key);
        }
        if key.len() > MAX_KEY_BYTES || !Self::room(&mut g, now) {
            return 0;
        }
        g.counters
            .insert(key.to_owned(), Counter { value: delta, expires_us: now.saturating_add(ttl * 1000) });
        delta
    }

    /// Takes `amount` tokens if the bucket holds them.
    pub fn bucket_take(&self, key: &str, capacity: u32, refill_per_min: u32, amount: u32) -> Take {
        let now = self.clock.now_us();
        let mut g = self.lock();
        if !g.buckets.contains_key(key) && (key.len() > MAX_KEY_BYTES || !Self::room(&mut g, now)) {
            return Take { taken: false, remaining: 0, retry_after_ms: 0 };
        }
        let b = g.buckets.entry(key.to_owned()).or_insert(Bucket {
            tokens: f64::from(capacity),
            capacity,
            refill_per_min,
            at_us: now,
        });
        b.refill(now);
        // A reloaded plugin may change the budget: a raise is granted at once (as if the bucket had
        // always been that large), a cut caps what is left.
        if capacity > b.capacity {
            b.tokens += f64::from(capacity - b.capacity);
        }
        b.capacity = capacity;
        b.refill_per_min = refill_per_min;
        b.tokens = b.tokens.min(f64::from(capacity));
        let want = f64::from(amount);
        if b.tokens + 1e-9 >= want {
            b.tokens = (b.tokens - want).max(0.0);
            return Take { taken: true, remaining: to_u32(b.tokens.floor()), retry_after_ms: 0 };
        }
        let retry_after_ms = if amount > capacity || refill_per_min == 0 {
            0
        } else {
            to_u32(((want - b.tokens) / f64::from(refill_per_min) * 60_000.0).ceil()).max(1)
        };
        Take { taken: false, remaining: to_u32(b.tokens.floor()), retry_after_ms }
    }

    /// Gives tokens back (never above the capacity); a bucket that does not exist is left alone.
    pub fn bucket_give(&self, key: &str, amount: u32) {
        let now = self.clock.now_us();
        let mut g = self.lock();
        if let Some(b) = g.buckets.get_mut(key) {
            b.refill(now);
            b.tokens = (b.tokens + f64::from(amount)).min(f64::from(b.capacity));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manual() -> (Arc<AtomicU64>, SharedState) {
        let t = Arc::new(AtomicU64::new(0));
        (Arc::clone(&t), SharedState::new(Clock::Manual(t)))
    }

    #[test]
    fn bucket_takes_refills_and_names_the_wait() {
        let (t, s) = manual();
        assert_eq!(
            s.bucket_take("a", 600, 600, 500),
            Take { taken: true, remaining: 100, retry_after_ms: 0 }
        );
        // 200 needed, 100 held: 100 more at 10 a second is 10 s.
        assert_eq!(
            s.bucket_take("a", 600, 600, 200),
            Take { taken: false, remaining: 100, retry_after_ms: 10_000 }
        );
        t.store(10_000_000, Ordering::Relaxed);
        assert!(s.bucket_take("a", 600, 600, 200).taken);
        s.bucket_give("a", 10_000);
        assert_eq!(s.bucket_take("a", 600, 600, 0).remaining, 600, "never above capacity");
        assert_eq!(s.bucket_take("a", 600, 600, 601).retry_after_ms, 0, "never fits");
        assert!(s.bucket_take("a", 600, 600, 600).taken);
        assert_eq!(s.bucket_take("a", 1000, 600, 0).remaining, 400, "a raise is granted at once");
        assert_eq!(s.bucket_take("a", 100, 600, 0).remaining, 100, "a cut caps what is left");
    }

    #[test]
    fn counters_expire_and_keys_are_bounded() {
        let (t, s) = manual();
        assert_eq!(s.counter_add("c", 2, 1000), 2);
        assert_eq!(s.counter_add("c", 3, 1000), 5);
        t.store(1_000_000, Ordering::Relaxed);
        assert_eq!(s.counter_add("c", 1, 1000), 1, "expired after its ttl");
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        assert_eq!(s.counter_add(&long, 7, 0), 0);
        assert!(!s.bucket_take(&long, 10, 10, 1).taken);
    }
}
