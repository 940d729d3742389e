//! What a decoder rank tells the world about a request: exactly one terminal status, and exactly one
//! "pages released" event once every page the request held is back in the free pool (or handed on to
//! the requests that share it).
//!
//! Events are collected while the buffer's lock is held and delivered to the [`EventSink`] after it is
//! released, so a sink may call back into the buffer without deadlocking.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::ids::{Epoch, Rank, RequestId, RequestKey};

/// The terminal state of a request on one rank.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum TerminalState {
    /// Every chunk is in the buffer; emitted only from the write-completion path (or at once for a
    /// request with nothing to write).
    Ready,
    /// The rank could not hold the request (device error, bad data).
    Failed,
    /// The reservation was cancelled or dropped before it was ready.
    Cancelled,
    /// The lease passed before the request was ready.
    Expired,
}

impl TerminalState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired",
        }
    }
}

/// A rank's terminal status for one request attempt.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RankStatus {
    pub request: RequestId,
    pub epoch: Epoch,
    pub rank: Rank,
    pub state: TerminalState,
    /// Chunks of the request held by this rank when the status was emitted (owned and shared).
    pub chunks: u32,
    /// Bytes written into this rank's pages for the request.
    pub bytes: u64,
}

impl RankStatus {
    pub fn key(&self) -> RequestKey {
        RequestKey::new(self.request, self.epoch)
    }
}

/// Why a request's pages went back.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ReleaseReason {
    /// The decoder consumed the pages (the normal end).
    Consumed,
    /// The request was ready but dropped without being consumed.
    Dropped,
    /// Cancelled before ready, with no write that could still land.
    Cancelled,
    /// The lease passed.
    Expired,
    /// Quarantined pages came back because the producer fenced.
    Fenced,
    /// Quarantined pages came back because the quarantine deadline passed.
    QuarantineTimeout,
}

/// Every page a request held on one rank is back (or handed on to requests sharing it).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PagesReleased {
    pub key: RequestKey,
    pub rank: Rank,
    /// Pages this request owned (shared pages belong to their owner and are not counted).
    pub pages: u32,
    pub reason: ReleaseReason,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RankEvent {
    Status(RankStatus),
    Released(PagesReleased),
}

/// Receives events after the buffer's lock is released. Must not block for long.
pub trait EventSink: Send + Sync + std::fmt::Debug {
    fn emit(&self, event: RankEvent);
}

/// Drops every event; for benchmarks and for embedders that only poll statistics.
#[derive(Debug, Default, Clone, Copy)]
pub struct DiscardSink;

impl EventSink for DiscardSink {
    fn emit(&self, _event: RankEvent) {}
}

/// Keeps events in memory until drained; for tests and simple embedders.
#[derive(Debug, Default)]
pub struct QueueSink {
    events: Mutex<VecDeque<RankEvent>>,
}

impl QueueSink {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes every event emitted so far, oldest first.
    pub fn drain(&self) -> Vec<RankEvent> {
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        q.drain(..).collect()
    }
}

impl EventSink for QueueSink {
    fn emit(&self, event: RankEvent) {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).push_back(event);
    }
}
