//! Fault switches, so tests can make a simulated engine misbehave on purpose.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use serde::{Deserialize, Serialize};

use baton_dataplane::events::{EventSink, RankEvent, TerminalState};
use baton_dataplane::transport::BroadcastSink;

/// What to break. Set with `POST /sim/faults` (JSON) or the command line.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultConfig {
    /// Decode: this rank crashes (stops serving, forgets its reservations, says nothing more).
    pub crash_rank: Option<u32>,
    /// Decode: this rank drops its next `drop_ready_events` READY statuses.
    pub drop_ready_rank: Option<u32>,
    pub drop_ready_events: u32,
    /// Decode: of every this many READY statuses (all ranks together), one is dropped, for as long
    /// as the switch is on (100: 1% of readiness signals lost).
    pub drop_ready_every: Option<u32>,
    /// Prefill: wait `stall_ms` before writing this chunk index.
    pub stall_chunk: Option<u32>,
    pub stall_ms: u64,
    /// Prefill: every chunk written to this decoder rank takes `slow_ms` longer; decode: consuming on
    /// this rank takes `slow_ms` longer.
    pub slow_rank: Option<u32>,
    pub slow_ms: u64,
    /// LMCache prefill: never send the proxy notification.
    pub drop_notify: bool,
    /// LMCache prefill: this rank sends its notification twice.
    pub duplicate_notify_rank: Option<u32>,
    /// LMCache prefill: this rank sends its notification `delay_notify_ms` late.
    pub delay_notify_rank: Option<u32>,
    pub delay_notify_ms: u64,
    /// `/metrics` reports this KV cache usage (percent) instead of the real one.
    pub report_kv_usage_pct: Option<u32>,
    /// `/metrics` reports this many waiting requests.
    pub report_waiting: Option<u64>,
    /// `/metrics` answers this status with no metrics (a scrape that fails).
    pub metrics_status: Option<u16>,
    /// Every generation request is answered with this status and an OpenAI error body (an engine
    /// refusing the request, e.g. 400), before any KV work.
    pub fail_status: Option<u16>,
    /// With `fail_status`: only the next this many generation requests are refused (all of them
    /// when unset), e.g. a decoder that refuses one decode and takes what follows.
    pub fail_requests: Option<u32>,
    /// With `fail_status`: the refusal is plain text from something in front of the engine (a
    /// proxy), which the engine never saw; otherwise it is the engine's own, and a NIXL consumer
    /// refusing a remote-prefill request tells the producer to free its blocks, as vLLM 0.32 does.
    pub fail_plain: bool,
    /// With `fail_status`: the refusal is sent this many milliseconds late (an engine that refuses
    /// after the other leg of the request has already failed).
    pub fail_delay_ms: u64,
    /// A streamed answer stops after this many tokens (of each choice) and its body fails: the
    /// connection is dropped mid-message, as by an engine that crashes while it streams.
    pub cut_stream_after: Option<u32>,
    /// An unstreamed answer is sent this many milliseconds late, after the engine's KV work (an
    /// SGLang prefiller whose answer comes after the decoder's has ended).
    pub answer_delay_ms: u64,
}

/// The live fault switches of one engine.
#[derive(Debug, Default)]
pub struct Faults {
    config: Mutex<FaultConfig>,
    drops_left: AtomicU32,
    /// Refusals left when `fail_requests` is set.
    fails_left: AtomicU32,
    /// READY statuses seen, for `drop_ready_every`.
    ready_seen: AtomicU32,
}

impl Faults {
    pub fn set(&self, c: FaultConfig) {
        self.drops_left.store(c.drop_ready_events, Ordering::SeqCst);
        self.fails_left.store(c.fail_requests.unwrap_or(0), Ordering::SeqCst);
        *self.config.lock().unwrap_or_else(|e| e.into_inner()) = c;
    }

    pub fn get(&self) -> FaultConfig {
        self.config.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The status a generation request is refused with, if the fault switches refuse it.
    pub fn take_failure(&self) -> Option<u16> {
        let c = self.get();
        let status = c.fail_status?;
        if c.fail_requests.is_none() {
            return Some(status);
        }
        self.fails_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .ok()
            .map(|_| status)
    }

    fn take_drop(&self, rank: u32) -> bool {
        if let Some(every) = self.get().drop_ready_every.filter(|e| *e > 0)
            && self.ready_seen.fetch_add(1, Ordering::SeqCst) % every == every - 1
        {
            return true;
        }
        if self.get().drop_ready_rank != Some(rank) {
            return false;
        }
        self.drops_left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }
}

/// A rank's event sink with the fault switches in front of it.
#[derive(Debug)]
pub struct FaultySink {
    pub rank: u32,
    pub inner: std::sync::Arc<BroadcastSink>,
    pub faults: std::sync::Arc<Faults>,
    pub crashed: AtomicBool,
}

impl EventSink for FaultySink {
    fn emit(&self, event: RankEvent) {
        if self.crashed.load(Ordering::SeqCst) {
            return;
        }
        if let RankEvent::Status(s) = &event
            && s.state == TerminalState::Ready
            && self.faults.take_drop(self.rank)
        {
            return;
        }
        self.inner.emit(event);
    }
}
