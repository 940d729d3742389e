//! The block index: which engine holds which block key, exact (from its KV events) or approximate
//! (from what the gateway routed there, until a time to live passes).
//!
//! One read-write lock guards the whole index. A lookup holds the read side for one walk along
//! the prompt's keys (a hash probe per block, stopping at the first block no engine holds); events
//! and routed requests take the write side briefly. Memory is bounded by `max_entries` (engine,
//! block) pairs: past it new entries are dropped and counted, never the process's memory.

use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::{BlockKey, block_keys, chain, root, salted};
use crate::kv_events::{BlockHash, EventBatch, KvEvent};

/// The rank an approximate entry is filed under (events come from ranks 0..).
const ROUTED: u16 = u16::MAX;
/// Distinct media names kept (`GPU`, `CPU`, `DISK`, …); more share the last.
const MAX_MEDIA: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    engine: u16,
    rank: u16,
    /// (engine hash, medium) pairs of this publisher that key to this block (a block held on two
    /// media, or stored once per attention group).
    refs: u16,
    /// Milliseconds after the index's start when an approximate entry expires (0: never).
    expires_ms: u64,
}

/// One publisher's blocks by the engine's own hash and medium: what `BlockRemoved` and parents
/// resolve to.
#[derive(Default, Debug)]
struct Feed {
    /// The key, and how many stores of the hash on the medium are not yet removed (an engine
    /// with several attention groups stores and removes a block once per group).
    by_hash: FxHashMap<(BlockHash, u8), (BlockKey, u16)>,
}

impl Feed {
    /// A parent's key, whichever medium holds it.
    fn key_of(&self, hash: &BlockHash, media: usize) -> Option<BlockKey> {
        (0..media).find_map(|m| self.by_hash.get(&(hash.clone(), u8::try_from(m).ok()?)).map(|(k, _)| *k))
    }
}

#[derive(Default, Debug)]
struct Inner {
    blocks: FxHashMap<BlockKey, SmallVec<[Holder; 2]>>,
    feeds: FxHashMap<(u16, u16), Feed>,
    media: Vec<String>,
    entries: usize,
    routed_entries: usize,
}

/// A prompt's block keys, per block size.
#[derive(Debug, Clone, Default)]
pub struct PromptKeys {
    /// The prompt's length in tokens.
    pub tokens: usize,
    by_size: SmallVec<[(u32, Vec<BlockKey>); 1]>,
}

impl PromptKeys {
    /// The keys at block size `bs`, if they were made.
    pub fn of(&self, bs: u32) -> Option<&[BlockKey]> {
        self.by_size.iter().find(|(b, _)| *b == bs).map(|(_, k)| k.as_slice())
    }
}

/// One engine as the index sees it.
#[derive(Debug)]
pub struct EngineState {
    pub name: String,
    /// Every KV-event feed of the engine is live: its exact entries are the truth and routed
    /// requests add no approximate ones.
    exact: AtomicBool,
    /// Its block size in tokens, learned from its events (0: not yet; the configured default
    /// is used).
    block_size: AtomicU32,
}

impl EngineState {
    pub fn exact(&self) -> bool {
        self.exact.load(Ordering::Relaxed)
    }
}

/// What applying one event batch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub stored: u64,
    pub removed: u64,
    /// Blocks whose parent the index never saw (stored before this gateway subscribed and not
    /// replayed): their prefix is unknown, so they cannot be keyed.
    pub orphaned: u64,
    /// Blocks not indexed because the index was full.
    pub dropped: u64,
    pub cleared: u64,
    /// Blocks of caches that are not attention over the whole prefix (sliding window, mamba).
    pub skipped: u64,
}

/// The index's size, for metrics and `/admin`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// (engine, block) entries held, exact and approximate.
    pub entries: u64,
    pub routed_entries: u64,
    /// Distinct block keys.
    pub keys: u64,
    /// Entries refused because the index was full, since start.
    pub dropped: u64,
}

/// Which engines hold which blocks.
#[derive(Debug)]
pub struct PrefixIndex {
    inner: RwLock<Inner>,
    engines: Vec<EngineState>,
    /// Block size used for engines that have published no event (approximate entries).
    default_block_size: u32,
    max_entries: usize,
    ttl: Duration,
    epoch: Instant,
    dropped: AtomicU64,
}

impl PrefixIndex {
    /// An empty index over `engines` (by name; an engine's number is its place in the list).
    pub fn new(engines: Vec<String>, default_block_size: u32, max_entries: usize, ttl: Duration) -> Self {
        Self {
            inner: RwLock::new(Inner::default()),
            engines: engines
                .into_iter()
                .map(|name| EngineState {
                    name,
                    exact: AtomicBool::new(false),
                    block_size: AtomicU32::new(0),
                })
                .collect(),
            default_block_size: default_block_size.max(1),
            max_entries,
            ttl,
            epoch: Instant::now(),
            dropped: AtomicU64::new(0),
        }
    }

    pub fn engines(&self) -> &[EngineState] {
        &self.engines
    }

    /// The block size the engine's entries are keyed with.
    pub fn block_size(&self, engine: usize) -> u32 {
        self.engines
            .get(engine)
            .map(|e| e.block_size.load(Ordering::Relaxed))
            .filter(|b| *b > 0)
            .unwrap_or(self.default_block_size)
    }

    /// Marks whether the engine's events are all arriving (its exact entries are then trusted and
    /// routed requests add no approximate ones).
    pub fn set_exact(&self, engine: usize, exact: bool) {
        if let Some(e) = self.engines.get(engine) {
            e.exact.store(exact, Ordering::Relaxed);
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A prompt's block keys at every block size the engines use (a fleet usually has one),
    /// computed once a request for both the lookup and the routed entries.
    pub fn keys(&self, ids: &[u32]) -> PromptKeys {
        let mut keys = PromptKeys { tokens: ids.len(), by_size: SmallVec::new() };
        for e in 0..self.engines.len() {
            let bs = self.block_size(e);
            if keys.of(bs).is_none() {
                let mut k = Vec::new();
                block_keys(ids, bs, &mut k);
                keys.by_size.push((bs, k));
            }
        }
        keys
    }

    /// For each engine, how many tokens at the start of the prompt it holds in cache (whole
    /// blocks of its block size, consecutive from the first).
    pub fn cached_tokens(&self, keys: &PromptKeys) -> Vec<u32> {
        let mut out = vec![0u32; self.engines.len()];
        let now = self.now_ms();
        for (bs, k) in &keys.by_size {
            let engines: SmallVec<[usize; 16]> =
                (0..self.engines.len()).filter(|&e| self.block_size(e) == *bs).collect();
            let blocks = self.walk(k, &engines, now);
            for (e, n) in engines.iter().zip(blocks) {
                if let Some(slot) = out.get_mut(*e) {
                    *slot = n.saturating_mul(*bs);
                }
            }
        }
        out
    }

    /// How many of `keys`, consecutive from the first, each of `engines` holds.
    fn walk(&self, keys: &[BlockKey], engines: &[usize], now: u64) -> SmallVec<[u32; 16]> {
        let mut runs: SmallVec<[u32; 16]> = engines.iter().map(|_| 0).collect();
        let mut open: SmallVec<[bool; 16]> = engines.iter().map(|_| true).collect();
        let inner = self.read();
        for (i, key) in keys.iter().enumerate() {
            let Some(holders) = inner.blocks.get(key) else { break };
            let mut any = false;
            for (j, e) in engines.iter().enumerate() {
                if open.get(j) != Some(&true) {
                    continue;
                }
                let held = holders
                    .iter()
                    .any(|h| usize::from(h.engine) == *e && (h.expires_ms == 0 || h.expires_ms > now));
                if held {
                    if let Some(r) = runs.get_mut(j) {
                        *r = u32::try_from(i + 1).unwrap_or(u32::MAX);
                    }
                    any = true;
                } else if let Some(o) = open.get_mut(j) {
                    *o = false;
                }
            }
            if !any {
                break;
            }
        }
        runs
    }

    /// Records that a request with `ids` was sent to `engine`, unless the engine's events are
    /// live (then its own events say what it stored): its full blocks become approximate
    /// entries for the time to live, or have it renewed.
    pub fn routed(&self, engine: usize, keys: &PromptKeys) {
        let Some(state) = self.engines.get(engine) else { return };
        if state.exact() || self.ttl.is_zero() {
            return;
        }
        let Ok(e) = u16::try_from(engine) else { return };
        // The engine's block size changed since the keys were made (its first event): next time.
        let Some(keys) = keys.of(self.block_size(engine)) else { return };
        let expires = self.now_ms().saturating_add(u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX));
        let mut inner = self.write();
        for &key in keys {
            let full = inner.entries >= self.max_entries;
            let holders = inner.blocks.entry(key).or_default();
            if let Some(h) = holders.iter_mut().find(|h| h.engine == e && h.rank == ROUTED) {
                h.expires_ms = expires;
                continue;
            }
            if full {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                if holders.is_empty() {
                    inner.blocks.remove(&key);
                }
                break;
            }
            holders.push(Holder { engine: e, rank: ROUTED, refs: 1, expires_ms: expires });
            inner.entries += 1;
            inner.routed_entries += 1;
        }
    }

    /// Removes approximate entries whose time has passed; returns how many.
    pub fn sweep(&self) -> usize {
        let now = self.now_ms();
        if self.read().routed_entries == 0 {
            return 0;
        }
        let mut inner = self.write();
        let mut gone = 0;
        inner.blocks.retain(|_, holders| {
            let before = holders.len();
            holders.retain(|h| h.expires_ms == 0 || h.expires_ms > now);
            gone += before - holders.len();
            !holders.is_empty()
        });
        inner.entries -= gone;
        inner.routed_entries -= gone;
        gone
    }

    /// Applies one batch of the events `engine`'s data-parallel rank `rank` published.
    pub fn apply(&self, engine: usize, rank: u16, batch: &EventBatch) -> Applied {
        let mut done = Applied::default();
        let (Ok(e), Some(state)) = (u16::try_from(engine), self.engines.get(engine)) else { return done };
        let mut inner = self.write();
        for event in &batch.events {
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                    kind,
                } => {
                    let Ok(bs) = usize::try_from(*block_size) else { continue };
                    // Only attention caches hold a prefix a later prompt can reuse whole.
                    let attention =
                        kind.as_deref().is_none_or(|k| k == "full_attention" || k == "mla_attention");
                    if bs == 0 || !attention {
                        done.skipped += u64::try_from(block_hashes.len()).unwrap_or(u64::MAX);
                        continue;
                    }
                    // An offloading tier may use other blocks; the engine's own are its GPU's.
                    if medium.as_deref().is_none_or(|m| m == "GPU") {
                        state.block_size.store(*block_size, Ordering::Relaxed);
                    }
                    let medium = inner.medium(medium.as_deref());
                    let id_bytes = lora_id.map(u64::to_le_bytes);
                    let adapter =
                        lora_name.as_deref().map(str::as_bytes).or(id_bytes.as_ref().map(|b| &b[..]));
                    let mut parent = match parent_block_hash {
                        None => Some(root(adapter)),
                        Some(h) => inner.feeds.get(&(e, rank)).and_then(|f| f.key_of(h, inner.media.len())),
                    };
                    for (i, (hash, tokens)) in block_hashes.iter().zip(token_ids.chunks(bs)).enumerate() {
                        let Some(p) = parent.filter(|_| tokens.len() == bs) else {
                            done.orphaned += 1;
                            continue;
                        };
                        let p = if extra_keys.get(i) == Some(&true) { salted(p) } else { p };
                        let key = chain(p, tokens);
                        parent = Some(key);
                        if inner.insert(e, rank, medium, hash.clone(), key, self.max_entries) {
                            done.stored += 1;
                        } else {
                            done.dropped += 1;
                        }
                    }
                }
                KvEvent::BlockRemoved { block_hashes, medium } => {
                    let medium = inner.medium(medium.as_deref());
                    for hash in block_hashes {
                        done.removed += u64::from(inner.remove(e, rank, hash, medium));
                    }
                }
                KvEvent::AllBlocksCleared => done.cleared += inner.clear(e, rank),
                KvEvent::Other(_) => {}
            }
        }
        self.dropped.fetch_add(done.dropped, Ordering::Relaxed);
        done
    }

    /// Forgets every exact entry one publisher gave (its stream was lost and cannot be
    /// replayed: what it held is no longer known).
    pub fn clear_feed(&self, engine: usize, rank: u16) -> u64 {
        let Ok(e) = u16::try_from(engine) else { return 0 };
        self.write().clear(e, rank)
    }

    pub fn counts(&self) -> Counts {
        let inner = self.read();
        Counts {
            entries: inner.entries as u64,
            routed_entries: inner.routed_entries as u64,
            keys: inner.blocks.len() as u64,
            dropped: self.dropped.load(Ordering::Relaxed),
        }
    }

    /// Exact entries per engine and medium name (for `/admin`), from a walk of the feeds.
    pub fn exact_blocks(&self) -> Vec<Vec<(String, u64)>> {
        let inner = self.read();
        let mut out = vec![Vec::<(String, u64)>::new(); self.engines.len()];
        for ((e, _), feed) in &inner.feeds {
            let Some(per) = out.get_mut(usize::from(*e)) else { continue };
            for (_, medium) in feed.by_hash.keys() {
                let name = inner.media.get(usize::from(*medium)).cloned().unwrap_or_default();
                match per.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, n)) => *n += 1,
                    None => per.push((name, 1)),
                }
            }
        }
        out
    }
}

impl Inner {
    fn medium(&mut self, name: Option<&str>) -> u8 {
        let name = name.unwrap_or("GPU");
        let at = match self.media.iter().position(|m| m == name) {
            Some(i) => i,
            None if self.media.len() < MAX_MEDIA => {
                self.media.push(name.to_owned());
                self.media.len() - 1
            }
            None => MAX_MEDIA - 1,
        };
        u8::try_from(at).unwrap_or(u8::MAX)
    }

    /// Files `hash` on `medium` (keyed `key`) under the publisher; false when the index is full.
    fn insert(&mut self, e: u16, rank: u16, medium: u8, hash: BlockHash, key: BlockKey, max: usize) -> bool {
        let at = (hash, medium);
        match self.feeds.get_mut(&(e, rank)).and_then(|f| f.by_hash.get_mut(&at)) {
            Some((old, stores)) if *old == key => {
                *stores = stores.saturating_add(1);
                if let Some(h) = self
                    .blocks
                    .get_mut(&key)
                    .and_then(|hs| hs.iter_mut().find(|h| h.engine == e && h.rank == rank))
                {
                    h.refs = h.refs.saturating_add(1);
                }
                return true;
            }
            Some(_) => while self.remove(e, rank, &at.0, medium) {},
            None => {}
        }
        let holders = self.blocks.entry(key).or_default();
        if let Some(h) = holders.iter_mut().find(|h| h.engine == e && h.rank == rank) {
            h.refs = h.refs.saturating_add(1);
        } else if self.entries >= max {
            if holders.is_empty() {
                self.blocks.remove(&key);
            }
            return false;
        } else {
            holders.push(Holder { engine: e, rank, refs: 1, expires_ms: 0 });
            self.entries += 1;
        }
        self.feeds.entry((e, rank)).or_default().by_hash.insert(at, (key, 1));
        true
    }

    fn unfile(&mut self, e: u16, rank: u16, key: BlockKey) -> bool {
        let Some(holders) = self.blocks.get_mut(&key) else { return false };
        let Some(at) = holders.iter().position(|h| h.engine == e && h.rank == rank) else { return false };
        let h = holders.get_mut(at).map(|h| {
            h.refs = h.refs.saturating_sub(1);
            h.refs
        });
        if h == Some(0) {
            holders.swap_remove(at);
            if holders.is_empty() {
                self.blocks.remove(&key);
            }
            self.entries -= 1;
        }
        true
    }

    /// Removes one store of `hash` on `medium`.
    fn remove(&mut self, e: u16, rank: u16, hash: &BlockHash, medium: u8) -> bool {
        let at = (hash.clone(), medium);
        let Some(feed) = self.feeds.get_mut(&(e, rank)) else { return false };
        let Some((key, stores)) = feed.by_hash.get_mut(&at) else { return false };
        let key = *key;
        *stores = stores.saturating_sub(1);
        if *stores == 0 {
            feed.by_hash.remove(&at);
        }
        self.unfile(e, rank, key)
    }

    fn clear(&mut self, e: u16, rank: u16) -> u64 {
        let Some(feed) = self.feeds.remove(&(e, rank)) else { return 0 };
        let mut n = 0;
        for (key, stores) in feed.by_hash.into_values() {
            for _ in 0..stores {
                self.unfile(e, rank, key);
            }
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|h| BlockHash::Int(*h)).collect(),
            parent_block_hash: parent.map(BlockHash::Int),
            token_ids: tokens.to_vec(),
            block_size: bs,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: Vec::new(),
            kind: None,
        }
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch { ts: 0.0, events, dp_rank: None }
    }

    fn index(ttl_ms: u64) -> PrefixIndex {
        PrefixIndex::new(vec!["a".into(), "b".into()], 4, 1000, Duration::from_millis(ttl_ms))
    }

    #[test]
    fn events_give_each_engine_its_prefix() {
        let ix = index(0);
        let prompt: Vec<u32> = (0..14).collect();
        // Engine 0 stores blocks 0-1 in one event and block 2 chained by its parent hash.
        let a = ix.apply(0, 0, &batch(vec![stored(&[10, 11], None, &prompt[..8], 4)]));
        assert_eq!(a.stored, 2);
        ix.apply(0, 0, &batch(vec![stored(&[12], Some(11), &prompt[8..12], 4)]));
        // Engine 1 stores block 0 only.
        ix.apply(1, 0, &batch(vec![stored(&[99], None, &prompt[..4], 4)]));
        assert_eq!(ix.cached_tokens(&ix.keys(&prompt)), vec![12, 4]);
        // Another prompt sharing only the first block.
        let mut other = prompt.clone();
        other[5] = 1000;
        assert_eq!(ix.cached_tokens(&ix.keys(&other)), vec![4, 4]);
        // Removal by the engine's own hash breaks the run there.
        let r = ix.apply(
            0,
            0,
            &batch(vec![KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(11)], medium: None }]),
        );
        assert_eq!(r.removed, 1);
        assert_eq!(ix.cached_tokens(&ix.keys(&prompt)), vec![4, 4]);
        let c = ix.apply(0, 0, &batch(vec![KvEvent::AllBlocksCleared]));
        assert_eq!(c.cleared, 2);
        assert_eq!(ix.cached_tokens(&ix.keys(&prompt)), vec![0, 4]);
        assert_eq!(ix.counts().entries, 1);
    }

    #[test]
    fn unknown_parents_are_orphans_and_the_index_is_bounded() {
        let ix = PrefixIndex::new(vec!["a".into()], 4, 3, Duration::ZERO);
        let prompt: Vec<u32> = (0..40).collect();
        let o = ix.apply(0, 0, &batch(vec![stored(&[5], Some(77), &prompt[4..8], 4)]));
        assert_eq!((o.stored, o.orphaned), (0, 1));
        let hashes: Vec<u64> = (0..10).collect();
        let f = ix.apply(0, 0, &batch(vec![stored(&hashes, None, &prompt, 4)]));
        assert_eq!((f.stored, f.dropped), (3, 7));
        assert_eq!(ix.counts().entries, 3);
        assert_eq!(ix.counts().dropped, 7);
        assert_eq!(ix.cached_tokens(&ix.keys(&prompt)), vec![12]);
    }

    #[test]
    fn routed_entries_expire_and_stay_out_of_exact_engines() {
        let ix = index(50);
        let prompt: Vec<u32> = (0..10).collect();
        ix.set_exact(1, true);
        ix.routed(0, &ix.keys(&prompt));
        ix.routed(1, &ix.keys(&prompt));
        assert_eq!(ix.cached_tokens(&ix.keys(&prompt)), vec![8, 0]);
        assert_eq!(ix.counts().routed_entries, 2);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(ix.cached_tokens(&ix.keys(&prompt)), vec![0, 0], "expired entries do not count");
        assert_eq!(ix.sweep(), 2);
        assert_eq!(ix.counts(), Counts { entries: 0, routed_entries: 0, keys: 0, dropped: 0 });
    }

    /// A block stored once per attention group (the same hash twice) stays until removed as often.
    #[test]
    fn a_block_stored_twice_stays_until_removed_twice() {
        let ix = index(0);
        let prompt: Vec<u32> = (0..4).collect();
        let removed =
            || batch(vec![KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(7)], medium: None }]);
        ix.apply(0, 0, &batch(vec![stored(&[7], None, &prompt, 4), stored(&[7], None, &prompt, 4)]));
        assert_eq!(ix.counts().entries, 1);
        ix.apply(0, 0, &removed());
        assert_eq!(ix.cached_tokens(&ix.keys(&prompt)), vec![4, 0]);
        ix.apply(0, 0, &removed());
        assert_eq!(ix.cached_tokens(&ix.keys(&prompt)), vec![0, 0]);
        assert_eq!(ix.counts().entries, 0);
        assert_eq!(ix.sweep(), 0);
    }

    #[test]
    fn engines_of_other_block_sizes_are_keyed_with_theirs() {
        let ix = index(0);
        let prompt: Vec<u32> = (0..32).collect();
        ix.apply(1, 0, &batch(vec![stored(&[1, 2], None, &prompt[..32], 16)]));
        ix.apply(0, 0, &batch(vec![stored(&[1], None, &prompt[..4], 4)]));
        assert_eq!(ix.block_size(1), 16);
        assert_eq!(ix.cached_tokens(&ix.keys(&prompt)), vec![4, 32]);
        assert_eq!(ix.exact_blocks()[1], vec![("GPU".to_owned(), 2)]);
    }
}
