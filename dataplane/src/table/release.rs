//! Release paths of the page table: cancel, expiry, quarantine and the deadline-ordered reaper. Each
//! request's pages come back exactly once, with exactly one terminal status and one release event.

use std::cmp::Reverse;
use std::time::Instant;

use super::{Chunk, Events, Handle, PageState, Phase, Table, TimerKind};
use crate::events::{PagesReleased, RankEvent, ReleaseReason, TerminalState};

impl Table {
    // ----- release paths -----

    /// Hands back every page the request holds: filled ones to the pool (or to the requests sharing
    /// them), unfilled ones to quarantine when a producer may still write into them.
    fn release_pages(&mut self, h: Handle) {
        let Some(e) = self.entry_mut(h) else { return };
        let quarantine_unfilled = e.published && !e.fenced;
        let mut chunks = std::mem::take(&mut e.chunks);
        let mut released = 0u32;
        for c in chunks.iter_mut() {
            match *c {
                Chunk::Own { page, .. } => {
                    let Some(p) = self.pages.get_mut(page as usize) else {
                        continue;
                    };
                    match p.state {
                        PageState::Filled | PageState::Consuming => {
                            if p.shares > 0 {
                                p.owner = None;
                                if p.state == PageState::Consuming {
                                    self.set_state(page, PageState::Filled);
                                }
                            } else {
                                self.free_page(page);
                            }
                            released += 1;
                            *c = Chunk::Gone;
                        }
                        PageState::Reserved if quarantine_unfilled || p.writing => {
                            self.set_state(page, PageState::Quarantined);
                            self.bump(page);
                        }
                        PageState::Reserved => {
                            self.free_page(page);
                            released += 1;
                            *c = Chunk::Gone;
                        }
                        PageState::Quarantined | PageState::Free => {}
                    }
                }
                Chunk::Shared { page } => {
                    self.unshare(page);
                    *c = Chunk::Gone;
                }
                Chunk::Gone => {}
            }
        }
        let mut underflow = false;
        if let Some(e) = self.entry_mut(h) {
            e.chunks = chunks;
            match e.held.checked_sub(released) {
                Some(v) => e.held = v,
                None => underflow = true,
            }
        }
        if underflow {
            self.accounting_errors += 1;
        }
    }

    fn finish_release(&mut self, h: Handle, reason: ReleaseReason, out: &mut Events) {
        let rank = self.rank;
        let Some(e) = self.entry_mut(h) else { return };
        if e.held == 0 && !e.released_sent {
            e.released_sent = true;
            let ev = PagesReleased { key: e.key, rank, pages: e.own, reason };
            out.push(RankEvent::Released(ev));
        }
        self.maybe_remove(h);
    }

    fn maybe_remove(&mut self, h: Handle) {
        let Some(e) = self.entry(h) else { return };
        if e.guard || e.held > 0 {
            return;
        }
        let key = e.key;
        if let Some(s) = self.slots.get_mut(h.slot as usize) {
            s.entry = None;
            s.sgen = s.sgen.wrapping_add(1);
        }
        self.free_slots.push(h.slot);
        self.live -= 1;
        self.by_key.remove(&key);
    }

    /// Closes a request that has not reached READY with a terminal state.
    fn close(&mut self, h: Handle, state: TerminalState, now: Instant, out: &mut Events) {
        let Some(e) = self.entry_mut(h) else { return };
        e.phase = Phase::Closed(state);
        if let Some(e) = self.entry(h) {
            out.push(self.status(e, state));
        }
        self.cancel_timer(h);
        self.release_pages(h);
        let held = self.entry(h).map_or(0, |e| e.held);
        if held > 0 {
            self.push_timer(h, now + self.limits.quarantine_ttl, TimerKind::Quarantine);
        } else {
            let reason = if state == TerminalState::Expired {
                ReleaseReason::Expired
            } else {
                ReleaseReason::Cancelled
            };
            self.finish_release(h, reason, out);
        }
    }

    pub(super) fn expire(&mut self, h: Handle, now: Instant, out: &mut Events) {
        match self.entry(h).map(|e| e.phase) {
            Some(Phase::Filling) => self.close(h, TerminalState::Expired, now, out),
            Some(Phase::Ready) => {
                // READY was already this rank's terminal; the pages come back, said once.
                if let Some(e) = self.entry_mut(h) {
                    e.phase = Phase::Closed(TerminalState::Expired);
                }
                self.cancel_timer(h);
                self.release_pages(h);
                self.finish_release(h, ReleaseReason::Expired, out);
            }
            _ => {}
        }
    }

    pub(super) fn end_quarantine(&mut self, h: Handle, reason: ReleaseReason, out: &mut Events) {
        let Some(e) = self.entry_mut(h) else { return };
        let mut chunks = std::mem::take(&mut e.chunks);
        for c in chunks.iter_mut() {
            if let Chunk::Own { page, .. } = *c {
                self.free_page(page);
                *c = Chunk::Gone;
            }
        }
        if let Some(e) = self.entry_mut(h) {
            e.chunks = chunks;
            e.held = 0;
        }
        self.cancel_timer(h);
        self.finish_release(h, reason, out);
    }

    /// The guard of a request went away (dropped or consumed to the end): whatever state it was in,
    /// everything it holds is handed back exactly once.
    pub(crate) fn drop_guard(&mut self, h: Handle, now: Instant, out: &mut Events) {
        let Some(e) = self.entry_mut(h) else { return };
        e.guard = false;
        match e.phase {
            Phase::Filling => self.close(h, TerminalState::Cancelled, now, out),
            Phase::Ready | Phase::Consuming => {
                let reason =
                    if e.phase == Phase::Ready { ReleaseReason::Dropped } else { ReleaseReason::Consumed };
                e.phase = Phase::Closed(TerminalState::Ready);
                self.cancel_timer(h);
                self.release_pages(h);
                self.finish_release(h, reason, out);
            }
            Phase::Closed(_) => self.maybe_remove(h),
        }
    }

    /// Fires every timer whose deadline is at or before `now`, earliest first. Returns how many fired.
    pub(crate) fn reap(&mut self, now: Instant, out: &mut Events) -> usize {
        let mut fired = 0;
        while let Some(Reverse(t)) = self.timers.peek().copied() {
            if t.at > now {
                break;
            }
            self.timers.pop();
            let h = Handle { slot: t.slot, sgen: t.sgen };
            let Some(e) = self.entry(h) else { continue };
            if e.timer_seq != t.seq {
                continue;
            }
            fired += 1;
            match t.kind {
                TimerKind::Lease => self.expire(h, now, out),
                TimerKind::Quarantine => self.end_quarantine(h, ReleaseReason::QuarantineTimeout, out),
            }
        }
        fired
    }

    /// The earliest pending deadline, for a reaper task to sleep until.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse(t)| t.at)
    }
}
