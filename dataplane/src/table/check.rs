//! The page table's invariants, checked on demand (tests, debug endpoints). Read-only.

use super::{Chunk, Counts, Handle, PageState, Table};

impl Table {
    /// Checks every invariant of the table; for tests and debug endpoints. A query.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut recount = Counts::default();
        for p in &self.pages {
            *recount.slot(p.state) += 1;
        }
        if recount != self.counts {
            return Err(format!("counters {:?} disagree with pages {:?}", self.counts, recount));
        }
        if self.counts.sum() != u64::from(self.total()) {
            return Err(format!("accounting: {:?} does not sum to {}", self.counts, self.total()));
        }
        if self.accounting_errors > 0 {
            return Err(format!("{} accounting errors", self.accounting_errors));
        }
        if self.free.len() != self.counts.free as usize {
            return Err(format!(
                "free list has {} pages, counters say {}",
                self.free.len(),
                self.counts.free
            ));
        }
        for f in &self.free {
            if self.page_state(*f) != Some(PageState::Free) {
                return Err(format!("page {f} on the free list is {:?}", self.page_state(*f)));
            }
        }
        let mut owners = vec![0u32; self.pages.len()];
        let mut share_refs = vec![0u64; self.pages.len()];
        let mut live = 0;
        for (slot, s) in self.slots.iter().enumerate() {
            let Some(e) = &s.entry else { continue };
            live += 1;
            let h = Handle { slot: u32::try_from(slot).unwrap_or(u32::MAX), sgen: s.sgen };
            let mut held = 0;
            for c in &e.chunks {
                match c {
                    Chunk::Own { page, .. } => {
                        held += 1;
                        let p = self.pages.get(*page as usize).ok_or(format!("no page {page}"))?;
                        if p.owner != Some(h) {
                            return Err(format!(
                                "page {page} listed by {} but owned by {:?}",
                                e.key, p.owner
                            ));
                        }
                        if p.state == PageState::Free {
                            return Err(format!("page {page} held by {} is free", e.key));
                        }
                        if let Some(o) = owners.get_mut(*page as usize) {
                            *o += 1;
                        }
                    }
                    Chunk::Shared { page } => {
                        if let Some(r) = share_refs.get_mut(*page as usize) {
                            *r += 1;
                        }
                    }
                    Chunk::Gone => {}
                }
            }
            if held != e.held {
                return Err(format!("{} holds {held} pages but counts {}", e.key, e.held));
            }
            if self.by_key.get(&e.key) != Some(&h) {
                return Err(format!("{} missing from the key index", e.key));
            }
        }
        if live != self.live || self.by_key.len() != live {
            return Err(format!("{live} entries, live {} keys {}", self.live, self.by_key.len()));
        }
        for (i, p) in self.pages.iter().enumerate() {
            if owners.get(i).copied().unwrap_or(0) > 1 {
                return Err(format!("page {i} has {} owners", owners.get(i).copied().unwrap_or(0)));
            }
            if p.owner.is_some() && owners.get(i).copied().unwrap_or(0) == 0 {
                return Err(format!("page {i} points at an owner that does not list it"));
            }
            if p.owner.is_none() && !matches!(p.state, PageState::Free) && p.shares == 0 && !p.writing {
                return Err(format!("page {i} is {:?} with no owner, share or writer", p.state));
            }
        }
        let entry_shares: u64 = share_refs.iter().sum();
        let page_shares: u64 = self.pages.iter().map(|p| u64::from(p.shares)).sum();
        if entry_shares + self.external_shares != page_shares {
            return Err(format!(
                "pages count {page_shares} shares, holders {entry_shares} + {} external",
                self.external_shares
            ));
        }
        Ok(())
    }
}
