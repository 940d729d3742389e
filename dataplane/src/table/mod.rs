//! The page table of one rank's PD buffer: which page belongs to which request, in which state, with
//! which generation; the requests' lifecycles; and the deadline-ordered timers for leases and
//! quarantines. Pure bookkeeping: no bytes, no locks, no I/O. [`crate::buffer`] wraps it in a lock and
//! the owned guards that drive it.
//!
//! Page states: free → reserved → filled → consuming → free; cancelled pages that a producer may still
//! write go to quarantined until the producer fences or the quarantine deadline passes. The invariant
//! `free + reserved + filled + quarantined + consuming == total` holds after every operation, and
//! counters are changed only by [`Table::set_state`], which refuses to go below zero instead of
//! clamping (an underflow is counted as an accounting error and shows in [`Table::check`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use thiserror::Error;

mod check;
mod release;

pub use check::InvariantError;

use crate::events::{RankEvent, RankStatus, ReleaseReason, TerminalState};
use crate::ids::{PageAddr, PrefixKey, Rank, RequestKey};

pub(crate) type Events = SmallVec<[RankEvent; 4]>;

/// Why a reservation was refused. Never blocks: the caller queues and retries.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
#[non_exhaustive]
pub enum ReserveError {
    /// The request needs more pages than the buffer holds: it can never fit.
    #[error("request needs {need} pages but the buffer holds {capacity}")]
    TooLarge { need: u32, capacity: u32 },
    /// Not enough pages are free now; the caller retries.
    #[error("request needs {need} free pages but only {free} are free")]
    Busy { need: u32, free: u32 },
    /// The request already holds a reservation here.
    #[error("request {key} already holds a reservation on this rank")]
    Duplicate { key: RequestKey },
    /// The rank tracks as many requests as it may.
    #[error("{limit} requests already hold reservations on this rank")]
    TooManyRequests { limit: usize },
    /// The lease's deadline has already passed.
    #[error("lease deadline has already passed")]
    LeaseInPast,
}

/// Why a chunk write was refused. None of these changes the buffer.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
#[non_exhaustive]
pub enum WriteError {
    /// A page index beyond the buffer.
    #[error("page {page} out of range (buffer has {pages} pages)")]
    NoSuchPage { page: u32, pages: u32 },
    /// The address names an earlier generation of the page (it was freed and reused since).
    #[error("stale address: page {page} is at generation {current}, write names {got}")]
    Stale { page: u32, current: u32, got: u32 },
    /// The page belongs to another request.
    #[error("page {page} does not belong to request {key}")]
    NotOwner { page: u32, key: RequestKey },
    /// The chunk index is not the one this page was reserved for.
    #[error("chunk {chunk} of request {key} is not page {page}")]
    WrongChunk { chunk: u32, page: u32, key: RequestKey },
    /// The request's lease ran out.
    #[error("request {key} expired")]
    Expired { key: RequestKey },
    /// The request was cancelled.
    #[error("request {key} was cancelled")]
    Cancelled { key: RequestKey },
    /// Another writer holds the page.
    #[error("page {page} is already being written")]
    InProgress { page: u32 },
    /// The write goes past the end of the page.
    #[error("write of {len} bytes at offset {offset} overruns a page of {page_bytes} bytes")]
    Overrun { offset: usize, len: usize, page_bytes: usize },
    /// A commit before the whole page was written.
    #[error("commit after {written} of {page_bytes} bytes")]
    Incomplete { written: usize, page_bytes: usize },
    /// The device failed the copy.
    #[error("device: {0}")]
    Device(String),
    /// A write by chunk ([`PageAddr::BY_CHUNK`]) for a request this rank holds no reservation of
    /// (never reserved here, its Reserve refused, or already closed and forgotten).
    #[error("no reservation of request {key} on this rank")]
    Unreserved { key: RequestKey },
    /// A write by chunk for a chunk the reservation does not hold a page of its own for.
    #[error("request {key} has no page of its own for chunk {chunk}")]
    NoChunk { chunk: u32, key: RequestKey },
}

/// Why a lifecycle call on a reservation failed.
#[derive(Debug, Error, PartialEq, Eq, Clone, Copy)]
#[non_exhaustive]
pub enum LeaseError {
    /// The lease ran out.
    #[error("lease expired")]
    Expired,
    /// The reservation already ended in this state.
    #[error("reservation is closed ({})", .0.as_str())]
    Closed(TerminalState),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum PageState {
    Free,
    Reserved,
    Filled,
    Quarantined,
    Consuming,
}

#[derive(Debug)]
struct Page {
    generation: u32,
    state: PageState,
    owner: Option<Handle>,
    shares: u32,
    /// A local writer is copying into the page; it may not be freed until the writer is gone.
    writing: bool,
    prefix: Option<PrefixKey>,
}

/// A request slot, with the slab generation that tells reuses apart. Opaque outside the crate: it
/// shows only in [`InvariantError::WrongOwner`], to tell a stale owner from another live one.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Handle {
    slot: u32,
    sgen: u32,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Filling,
    Ready,
    Consuming,
    /// Terminal reached; may still hold quarantined pages.
    Closed(TerminalState),
}

#[derive(Clone, Copy, Debug)]
enum Chunk {
    Own { page: u32, prefix: Option<PrefixKey> },
    Shared { page: u32 },
    Gone,
}

#[derive(Debug)]
struct Entry {
    key: RequestKey,
    phase: Phase,
    chunks: SmallVec<[Chunk; 8]>,
    own: u32,
    arrived: u32,
    /// Owned pages not yet handed back.
    held: u32,
    published: bool,
    fenced: bool,
    /// The owning guard is alive.
    guard: bool,
    lease: Instant,
    timer_seq: u32,
    bytes: u64,
    released_sent: bool,
}

#[derive(Debug)]
struct Slot {
    sgen: u32,
    entry: Option<Entry>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum TimerKind {
    Lease,
    Quarantine,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
struct Timer {
    at: Instant,
    slot: u32,
    sgen: u32,
    seq: u32,
    kind: TimerKind,
}

/// Page counts by state; a query never changes them.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Counts {
    pub free: u32,
    pub reserved: u32,
    pub filled: u32,
    pub quarantined: u32,
    pub consuming: u32,
}

impl Counts {
    fn slot(&mut self, s: PageState) -> &mut u32 {
        match s {
            PageState::Free => &mut self.free,
            PageState::Reserved => &mut self.reserved,
            PageState::Filled => &mut self.filled,
            PageState::Quarantined => &mut self.quarantined,
            PageState::Consuming => &mut self.consuming,
        }
    }

    /// `free + reserved + filled + quarantined + consuming`.
    pub fn sum(&self) -> u64 {
        [self.free, self.reserved, self.filled, self.quarantined, self.consuming]
            .iter()
            .map(|c| u64::from(*c))
            .sum()
    }
}

/// Limits of one rank's table.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub quarantine_ttl: Duration,
    pub max_requests: usize,
}

/// A reservation attempt.
#[derive(Debug)]
pub(crate) struct Reserve<'a> {
    pub key: RequestKey,
    pub chunks: u32,
    pub prefixes: &'a [PrefixKey],
    pub lease: Instant,
}

/// Outcome of a write's start.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Begin {
    Write,
    Duplicate,
}

#[derive(Debug)]
pub(crate) struct Table {
    rank: Rank,
    page_bytes: u64,
    limits: Limits,
    pages: Vec<Page>,
    free: Vec<u32>,
    counts: Counts,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    live: usize,
    by_key: FxHashMap<RequestKey, Handle>,
    prefixes: FxHashMap<PrefixKey, u32>,
    timers: BinaryHeap<Reverse<Timer>>,
    external_shares: u64,
    accounting_errors: u64,
}

impl Table {
    pub(crate) fn new(rank: Rank, pages: u32, page_bytes: u64, limits: Limits) -> Self {
        Self {
            rank,
            page_bytes,
            limits,
            pages: (0..pages)
                .map(|_| Page {
                    generation: 0,
                    state: PageState::Free,
                    owner: None,
                    shares: 0,
                    writing: false,
                    prefix: None,
                })
                .collect(),
            // Pop order = ascending page index, so a fresh buffer hands out pages 0, 1, 2...
            free: (0..pages).rev().collect(),
            counts: Counts { free: pages, ..Counts::default() },
            slots: Vec::new(),
            free_slots: Vec::new(),
            live: 0,
            by_key: FxHashMap::default(),
            prefixes: FxHashMap::default(),
            timers: BinaryHeap::new(),
            external_shares: 0,
            accounting_errors: 0,
        }
    }

    pub(crate) fn total(&self) -> u32 {
        u32::try_from(self.pages.len()).unwrap_or(u32::MAX)
    }

    pub(crate) fn counts(&self) -> Counts {
        self.counts
    }

    pub(crate) fn requests(&self) -> usize {
        self.live
    }

    pub(crate) fn external_shares(&self) -> u64 {
        self.external_shares
    }

    pub(crate) fn accounting_errors(&self) -> u64 {
        self.accounting_errors
    }

    fn entry(&self, h: Handle) -> Option<&Entry> {
        self.slots.get(h.slot as usize).filter(|s| s.sgen == h.sgen).and_then(|s| s.entry.as_ref())
    }

    fn entry_mut(&mut self, h: Handle) -> Option<&mut Entry> {
        self.slots.get_mut(h.slot as usize).filter(|s| s.sgen == h.sgen).and_then(|s| s.entry.as_mut())
    }

    /// Moves a page to a new state, keeping the counters balanced. Never clamps: an underflow is an
    /// accounting error, counted and left visible to [`Table::check`].
    fn set_state(&mut self, page: u32, to: PageState) {
        let Some(p) = self.pages.get_mut(page as usize) else {
            self.accounting_errors += 1;
            return;
        };
        let from = std::mem::replace(&mut p.state, to);
        match self.counts.slot(from).checked_sub(1) {
            Some(v) => *self.counts.slot(from) = v,
            None => self.accounting_errors += 1,
        }
        *self.counts.slot(to) += 1;
    }

    fn bump(&mut self, page: u32) {
        if let Some(p) = self.pages.get_mut(page as usize) {
            p.generation = p.generation.wrapping_add(1);
        }
    }

    fn page_state(&self, page: u32) -> Option<PageState> {
        self.pages.get(page as usize).map(|p| p.state)
    }

    /// Returns a page to the pool (or leaves it, orphaned and quarantined, to a writer still copying
    /// into it, whose drop frees it).
    fn free_page(&mut self, page: u32) {
        let Some(p) = self.pages.get_mut(page as usize) else {
            self.accounting_errors += 1;
            return;
        };
        p.owner = None;
        if p.writing {
            if p.state != PageState::Quarantined {
                self.set_state(page, PageState::Quarantined);
                self.bump(page);
            }
            return;
        }
        if let Some(k) = p.prefix.take()
            && self.prefixes.get(&k) == Some(&page)
        {
            self.prefixes.remove(&k);
        }
        self.set_state(page, PageState::Free);
        self.bump(page);
        self.free.push(page);
    }

    fn unshare(&mut self, page: u32) {
        let Some(p) = self.pages.get_mut(page as usize) else {
            self.accounting_errors += 1;
            return;
        };
        match p.shares.checked_sub(1) {
            Some(v) => p.shares = v,
            None => {
                self.accounting_errors += 1;
                return;
            }
        }
        if p.shares == 0 && p.owner.is_none() {
            self.free_page(page);
        }
    }

    fn push_timer(&mut self, h: Handle, at: Instant, kind: TimerKind) {
        let Some(e) = self.entry_mut(h) else { return };
        e.timer_seq = e.timer_seq.wrapping_add(1);
        let seq = e.timer_seq;
        self.timers.push(Reverse(Timer { at, slot: h.slot, sgen: h.sgen, seq, kind }));
        // Renewals and closes leave stale timers behind; keep the heap bounded by the live requests.
        if self.timers.len() > 2 * self.live + 64 {
            let slots = &self.slots;
            self.timers.retain(|Reverse(t)| {
                slots
                    .get(t.slot as usize)
                    .and_then(|s| s.entry.as_ref().filter(|_| s.sgen == t.sgen))
                    .is_some_and(|e| e.timer_seq == t.seq)
            });
        }
    }

    fn cancel_timer(&mut self, h: Handle) {
        if let Some(e) = self.entry_mut(h) {
            e.timer_seq = e.timer_seq.wrapping_add(1);
        }
    }

    fn status(&self, e: &Entry, state: TerminalState) -> RankEvent {
        RankEvent::Status(RankStatus {
            request: e.key.request,
            epoch: e.key.epoch,
            rank: self.rank,
            state,
            chunks: u32::try_from(e.chunks.len()).unwrap_or(u32::MAX),
            bytes: e.bytes,
        })
    }

    // ----- reservation -----

    /// All-or-nothing reservation of every page a request needs. Chunks whose prefix key names a
    /// filled page are shared instead of reserved.
    pub(crate) fn reserve(
        &mut self,
        r: &Reserve<'_>,
        now: Instant,
        out: &mut Events,
    ) -> Result<Handle, ReserveError> {
        let total = self.total();
        if r.chunks > total {
            return Err(ReserveError::TooLarge { need: r.chunks, capacity: total });
        }
        if self.by_key.contains_key(&r.key) {
            return Err(ReserveError::Duplicate { key: r.key });
        }
        if r.lease <= now {
            return Err(ReserveError::LeaseInPast);
        }
        if self.live >= self.limits.max_requests {
            return Err(ReserveError::TooManyRequests { limit: self.limits.max_requests });
        }
        let shared: SmallVec<[Option<u32>; 8]> = (0..r.chunks as usize)
            .map(|i| r.prefixes.get(i).and_then(|k| self.readable_prefix(*k)))
            .collect();
        let own = u32::try_from(shared.iter().filter(|s| s.is_none()).count()).unwrap_or(u32::MAX);
        if own > self.counts.free {
            return Err(ReserveError::Busy { need: own, free: self.counts.free });
        }

        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot { sgen: 0, entry: None });
                u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
            }
        };
        let sgen = self.slots.get(slot as usize).map_or(0, |s| s.sgen);
        let h = Handle { slot, sgen };
        let mut chunks = SmallVec::with_capacity(shared.len());
        for (i, s) in shared.iter().enumerate() {
            match s {
                Some(page) => {
                    if let Some(p) = self.pages.get_mut(*page as usize) {
                        p.shares += 1;
                    }
                    chunks.push(Chunk::Shared { page: *page });
                }
                None => {
                    let Some(page) = self.free.pop() else {
                        // Unreachable while the counters balance; counted, never a panic.
                        self.accounting_errors += 1;
                        chunks.push(Chunk::Gone);
                        continue;
                    };
                    self.set_state(page, PageState::Reserved);
                    if let Some(p) = self.pages.get_mut(page as usize) {
                        p.owner = Some(h);
                    }
                    chunks.push(Chunk::Own { page, prefix: r.prefixes.get(i).copied() });
                }
            }
        }
        let entry = Entry {
            key: r.key,
            phase: if own == 0 { Phase::Ready } else { Phase::Filling },
            chunks,
            own,
            arrived: 0,
            held: own,
            published: false,
            fenced: false,
            guard: true,
            lease: r.lease,
            timer_seq: 0,
            bytes: 0,
            released_sent: false,
        };
        if own == 0 {
            // Nothing to write: ready at once, so a short prompt can never wait for a signal that
            // no write will ever produce.
            out.push(self.status(&entry, TerminalState::Ready));
        }
        if let Some(s) = self.slots.get_mut(slot as usize) {
            s.entry = Some(entry);
        }
        self.live += 1;
        self.by_key.insert(r.key, h);
        self.push_timer(h, r.lease, TimerKind::Lease);
        Ok(h)
    }

    fn readable_prefix(&self, key: PrefixKey) -> Option<u32> {
        let page = *self.prefixes.get(&key)?;
        let p = self.pages.get(page as usize)?;
        (matches!(p.state, PageState::Filled | PageState::Consuming) && p.prefix == Some(key)).then_some(page)
    }

    /// Whether a filled chunk with this prefix key is present. Changes nothing.
    pub(crate) fn has_prefix(&self, key: PrefixKey) -> bool {
        self.readable_prefix(key).is_some()
    }

    /// Takes one counted share of a filled chunk; released by [`Table::unshare_external`].
    pub(crate) fn share_external(&mut self, key: PrefixKey) -> Option<u32> {
        let page = self.readable_prefix(key)?;
        let p = self.pages.get_mut(page as usize)?;
        p.shares += 1;
        self.external_shares += 1;
        Some(page)
    }

    pub(crate) fn unshare_external(&mut self, page: u32) {
        match self.external_shares.checked_sub(1) {
            Some(v) => self.external_shares = v,
            None => self.accounting_errors += 1,
        }
        self.unshare(page);
    }

    /// Write addresses of the request's own chunks, as `(chunk index, address)`. From now on a
    /// producer may be writing, so a cancel quarantines unfilled pages until it fences.
    pub(crate) fn publish(&mut self, h: Handle) -> Vec<(u32, PageAddr)> {
        let Some(e) = self.entry_mut(h) else {
            return Vec::new();
        };
        e.published = true;
        let chunks = e.chunks.clone();
        chunks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match c {
                Chunk::Own { page, .. } => {
                    let generation = self.pages.get(*page as usize)?.generation;
                    Some((u32::try_from(i).ok()?, PageAddr { page: *page, generation }))
                }
                _ => None,
            })
            .collect()
    }

    /// The page holding chunk `chunk` of a request (owned or shared). A query.
    pub(crate) fn chunk_page(&self, h: Handle, chunk: u32) -> Option<u32> {
        match self.entry(h)?.chunks.get(chunk as usize)? {
            Chunk::Own { page, .. } | Chunk::Shared { page } => Some(*page),
            Chunk::Gone => None,
        }
    }

    fn lease_check(&mut self, h: Handle, now: Instant, out: &mut Events) -> Result<(), LeaseError> {
        let Some(e) = self.entry(h) else {
            return Err(LeaseError::Closed(TerminalState::Cancelled));
        };
        match e.phase {
            Phase::Closed(s) => {
                Err(if s == TerminalState::Expired { LeaseError::Expired } else { LeaseError::Closed(s) })
            }
            Phase::Filling | Phase::Ready if e.lease <= now => {
                self.expire(h, now, out);
                Err(LeaseError::Expired)
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn renew(
        &mut self,
        h: Handle,
        lease: Instant,
        now: Instant,
        out: &mut Events,
    ) -> Result<(), LeaseError> {
        self.lease_check(h, now, out)?;
        let Some(e) = self.entry_mut(h) else {
            return Err(LeaseError::Closed(TerminalState::Cancelled));
        };
        if e.phase == Phase::Consuming {
            return Ok(());
        }
        e.lease = lease;
        self.push_timer(h, lease, TimerKind::Lease);
        Ok(())
    }

    /// Whether the request is ready (every chunk in the buffer). A query.
    pub(crate) fn phase_ready(&self, h: Handle) -> Result<bool, LeaseError> {
        match self.entry(h).map(|e| e.phase) {
            Some(Phase::Filling) => Ok(false),
            Some(Phase::Ready | Phase::Consuming) => Ok(true),
            Some(Phase::Closed(s)) => {
                Err(if s == TerminalState::Expired { LeaseError::Expired } else { LeaseError::Closed(s) })
            }
            None => Err(LeaseError::Closed(TerminalState::Cancelled)),
        }
    }

    /// Ready → consuming: the decoder starts moving the pages out. The lease stops here: consuming
    /// is local work of the rank that owns the buffer.
    pub(crate) fn consume(&mut self, h: Handle, now: Instant, out: &mut Events) -> Result<(), LeaseError> {
        self.lease_check(h, now, out)?;
        let Some(e) = self.entry_mut(h) else {
            return Err(LeaseError::Closed(TerminalState::Cancelled));
        };
        if e.phase != Phase::Ready {
            return Ok(());
        }
        e.phase = Phase::Consuming;
        let pages: SmallVec<[u32; 8]> = e
            .chunks
            .iter()
            .filter_map(|c| if let Chunk::Own { page, .. } = c { Some(*page) } else { None })
            .collect();
        for page in pages {
            if self.page_state(page) == Some(PageState::Filled) {
                self.set_state(page, PageState::Consuming);
            } else {
                self.accounting_errors += 1;
            }
        }
        self.cancel_timer(h);
        Ok(())
    }

    // ----- writes -----

    /// `addr`, or for [`PageAddr::BY_CHUNK`] the address of the page `key`'s reservation holds for
    /// `chunk`. A query.
    pub(crate) fn resolve(
        &self,
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
    ) -> Result<PageAddr, WriteError> {
        if addr != PageAddr::BY_CHUNK {
            return Ok(addr);
        }
        let &h = self.by_key.get(&key).ok_or(WriteError::Unreserved { key })?;
        match self.entry(h).and_then(|e| e.chunks.get(chunk as usize)) {
            Some(Chunk::Own { page, .. }) => {
                let generation = self.pages.get(*page as usize).map_or(0, |p| p.generation);
                Ok(PageAddr { page: *page, generation })
            }
            _ => Err(WriteError::NoChunk { chunk, key }),
        }
    }

    pub(crate) fn begin_write(
        &mut self,
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
        now: Instant,
        out: &mut Events,
    ) -> Result<Begin, WriteError> {
        let total = self.total();
        let p = self
            .pages
            .get(addr.page as usize)
            .ok_or(WriteError::NoSuchPage { page: addr.page, pages: total })?;
        if p.generation != addr.generation {
            return Err(WriteError::Stale { page: addr.page, current: p.generation, got: addr.generation });
        }
        let (state, writing) = (p.state, p.writing);
        let h = p.owner.ok_or(WriteError::NotOwner { page: addr.page, key })?;
        let e = self.entry(h).ok_or(WriteError::NotOwner { page: addr.page, key })?;
        if e.key != key {
            return Err(WriteError::NotOwner { page: addr.page, key });
        }
        match e.chunks.get(chunk as usize) {
            Some(Chunk::Own { page, .. }) if *page == addr.page => {}
            _ => {
                return Err(WriteError::WrongChunk { chunk, page: addr.page, key });
            }
        }
        match self.lease_check(h, now, out) {
            Err(LeaseError::Expired) => return Err(WriteError::Expired { key }),
            Err(LeaseError::Closed(_)) => return Err(WriteError::Cancelled { key }),
            Ok(()) => {}
        }
        match state {
            PageState::Reserved if writing => Err(WriteError::InProgress { page: addr.page }),
            PageState::Reserved => {
                if let Some(p) = self.pages.get_mut(addr.page as usize) {
                    p.writing = true;
                }
                Ok(Begin::Write)
            }
            PageState::Filled | PageState::Consuming => Ok(Begin::Duplicate),
            PageState::Quarantined | PageState::Free => Err(WriteError::Cancelled { key }),
        }
    }

    /// Ends a local write. `complete` is false for an aborted write. READY is emitted here, from the
    /// completion path, once the last chunk's bytes are in the buffer.
    pub(crate) fn end_write(
        &mut self,
        key: RequestKey,
        addr: PageAddr,
        complete: bool,
        out: &mut Events,
    ) -> Result<bool, WriteError> {
        let Some(p) = self.pages.get_mut(addr.page as usize) else {
            return Err(WriteError::NoSuchPage { page: addr.page, pages: self.total() });
        };
        p.writing = false;
        let (state, generation, owner) = (p.state, p.generation, p.owner);
        if state == PageState::Quarantined && owner.is_none() {
            // Orphaned while we were copying: nobody else will free it.
            self.free_page(addr.page);
        }
        if generation != addr.generation || state != PageState::Reserved {
            return Err(WriteError::Cancelled { key });
        }
        if !complete {
            return Ok(false);
        }
        let Some(h) = owner else {
            return Err(WriteError::Cancelled { key });
        };
        self.set_state(addr.page, PageState::Filled);
        let page_bytes = self.page_bytes;
        let Some(e) = self.entry_mut(h) else {
            return Err(WriteError::Cancelled { key });
        };
        e.arrived += 1;
        e.bytes += page_bytes;
        let prefix = e.chunks.iter().find_map(|c| match c {
            Chunk::Own { page, prefix } if *page == addr.page => *prefix,
            _ => None,
        });
        let ready = e.arrived == e.own && e.phase == Phase::Filling;
        if ready {
            e.phase = Phase::Ready;
        }
        if let Some(k) = prefix {
            self.prefixes.entry(k).or_insert(addr.page);
            if let Some(p) = self.pages.get_mut(addr.page as usize) {
                p.prefix = Some(k);
            }
        }
        if ready && let Some(e) = self.entry(h) {
            out.push(self.status(e, TerminalState::Ready));
        }
        Ok(ready)
    }

    /// The producer says it will write nothing more for this request: quarantined pages come back.
    pub(crate) fn fence(&mut self, key: RequestKey, out: &mut Events) -> bool {
        let Some(&h) = self.by_key.get(&key) else {
            return false;
        };
        let Some(e) = self.entry_mut(h) else { return false };
        e.fenced = true;
        if matches!(e.phase, Phase::Closed(_)) && e.held > 0 {
            self.end_quarantine(h, ReleaseReason::Fenced, out);
        }
        true
    }
}
