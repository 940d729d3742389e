//! The page table's invariants, checked on demand (tests, debug endpoints). Read-only.

use thiserror::Error;

use super::{Chunk, Counts, Handle, PageState, Table};
use crate::ids::RequestKey;

/// The first invariant of the page table found broken. Any of these is a bug in the table, never a
/// consequence of what a peer sent.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
#[non_exhaustive]
pub enum InvariantError {
    /// The per-state counters differ from a recount of the pages.
    #[error("counters {counters:?} disagree with pages {pages:?}")]
    CountersDisagree { counters: Counts, pages: Counts },
    /// The per-state counters do not add up to the number of pages.
    #[error("accounting: {counts:?} does not sum to {total}")]
    Unbalanced { counts: Counts, total: u32 },
    /// A counter would have gone below zero at some point (counted, not clamped).
    #[error("{errors} accounting errors")]
    AccountingErrors { errors: u64 },
    /// The free list is longer or shorter than the free counter.
    #[error("free list has {listed} pages, counters say {counted}")]
    FreeListLength { listed: usize, counted: u32 },
    /// A page on the free list is not free (or does not exist).
    #[error("page {page} on the free list is {state:?}")]
    NotFree { page: u32, state: Option<PageState> },
    /// A request lists a page the table does not have.
    #[error("no page {page}")]
    NoSuchPage { page: u32 },
    /// A request lists a page whose owner is someone else.
    #[error("page {page} listed by {key} but owned by {owner:?}")]
    WrongOwner { page: u32, key: RequestKey, owner: Option<Handle> },
    /// A request holds a page that is free.
    #[error("page {page} held by {key} is free")]
    HeldButFree { page: u32, key: RequestKey },
    /// A request's count of held pages differs from the pages it lists as its own.
    #[error("{key} holds {listed} pages but counts {counted}")]
    HeldMiscounted { key: RequestKey, listed: u32, counted: u32 },
    /// A live request cannot be found by its key.
    #[error("{key} missing from the key index")]
    NotIndexed { key: RequestKey },
    /// The live counter or the key index disagrees with the slots that hold a request.
    #[error("{entries} entries, live {live} keys {keys}")]
    LiveMiscounted { entries: usize, live: usize, keys: usize },
    /// More than one request lists the page as its own.
    #[error("page {page} has {owners} owners")]
    ManyOwners { page: u32, owners: u32 },
    /// The page names an owner, but no request lists it.
    #[error("page {page} points at an owner that does not list it")]
    Unlisted { page: u32 },
    /// A page that is not free has nothing holding it: no owner, share or writer.
    #[error("page {page} is {state:?} with no owner, share or writer")]
    Unheld { page: u32, state: PageState },
    /// The pages' share counts differ from the shares their holders have.
    #[error("pages count {pages} shares, holders {holders} + {external} external")]
    SharesUnbalanced { pages: u64, holders: u64, external: u64 },
}

impl Table {
    /// Checks every invariant of the table; for tests and debug endpoints. A query.
    pub(crate) fn check(&self) -> Result<(), InvariantError> {
        let mut recount = Counts::default();
        for p in &self.pages {
            *recount.slot(p.state) += 1;
        }
        if recount != self.counts {
            return Err(InvariantError::CountersDisagree { counters: self.counts, pages: recount });
        }
        if self.counts.sum() != u64::from(self.total()) {
            return Err(InvariantError::Unbalanced { counts: self.counts, total: self.total() });
        }
        if self.accounting_errors > 0 {
            return Err(InvariantError::AccountingErrors { errors: self.accounting_errors });
        }
        if self.free.len() != self.counts.free as usize {
            return Err(InvariantError::FreeListLength {
                listed: self.free.len(),
                counted: self.counts.free,
            });
        }
        for f in &self.free {
            let state = self.page_state(*f);
            if state != Some(PageState::Free) {
                return Err(InvariantError::NotFree { page: *f, state });
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
                        let p = self
                            .pages
                            .get(*page as usize)
                            .ok_or(InvariantError::NoSuchPage { page: *page })?;
                        if p.owner != Some(h) {
                            return Err(InvariantError::WrongOwner {
                                page: *page,
                                key: e.key,
                                owner: p.owner,
                            });
                        }
                        if p.state == PageState::Free {
                            return Err(InvariantError::HeldButFree { page: *page, key: e.key });
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
                return Err(InvariantError::HeldMiscounted { key: e.key, listed: held, counted: e.held });
            }
            if self.by_key.get(&e.key) != Some(&h) {
                return Err(InvariantError::NotIndexed { key: e.key });
            }
        }
        if live != self.live || self.by_key.len() != live {
            return Err(InvariantError::LiveMiscounted {
                entries: live,
                live: self.live,
                keys: self.by_key.len(),
            });
        }
        for (i, p) in self.pages.iter().enumerate() {
            // Page numbers are u32 everywhere else (`PageAddr`); `total()` saturates the same way.
            let page = u32::try_from(i).unwrap_or(u32::MAX);
            let owned_by = owners.get(i).copied().unwrap_or(0);
            if owned_by > 1 {
                return Err(InvariantError::ManyOwners { page, owners: owned_by });
            }
            if p.owner.is_some() && owned_by == 0 {
                return Err(InvariantError::Unlisted { page });
            }
            if p.owner.is_none() && !matches!(p.state, PageState::Free) && p.shares == 0 && !p.writing {
                return Err(InvariantError::Unheld { page, state: p.state });
            }
        }
        let entry_shares: u64 = share_refs.iter().sum();
        let page_shares: u64 = self.pages.iter().map(|p| u64::from(p.shares)).sum();
        if entry_shares + self.external_shares != page_shares {
            return Err(InvariantError::SharesUnbalanced {
                pages: page_shares,
                holders: entry_shares,
                external: self.external_shares,
            });
        }
        Ok(())
    }
}
