//! The words a tokenizer met lately, read without a lock: the first place [`super::fast`] looks a
//! word up.
//!
//! A table of [`HOT_SLOTS`] slots, each holding one short word (its bytes packed into two
//! integers, as [`super::fast`] packs them) and up to [`HOT_IDS`] ids, at the place its hash
//! names; a word put where another was replaces it. A slot is guarded by a sequence number, odd
//! while it is written (a seqlock made of atomics, so no `unsafe`): a reader loads the number, the
//! slot, then the number again, and takes the slot only if both were the same even number; a
//! writer takes the slot by moving the number to odd (a compare-and-swap: a slot being written is
//! left alone) and gives it back at the next even one. Readers write nothing, so threads reading
//! the same words share their cache lines. On x86 a read is plain loads: no atomic
//! read-modify-write, no lock's cache line bounced between cores, none of the sharded map's
//! bookkeeping of which shard locks a call holds.
//!
//! A word not found here is looked up in the sharded map behind it (bounded, by words; longer words
//! and words of more ids only there), then encoded: both put it here. Bounded by construction:
//! `HOT_SLOTS` × 64 bytes (512 KB) a tokenizer.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

/// Slots: 64 bytes each.
pub const HOT_SLOTS: usize = 8192;
/// The most ids a word here has (most words are one or two tokens).
pub const HOT_IDS: usize = 4;

/// One word and its ids, on a cache line of its own.
#[repr(align(64))]
#[derive(Default)]
struct Slot {
    /// Even when the slot is whole; odd while a writer fills it.
    seq: AtomicU32,
    /// The word's length in bytes (the low byte; 0: an empty slot, as no word is empty) and how
    /// many ids it has (the next byte).
    shape: AtomicU32,
    lo: AtomicU64,
    hi: AtomicU64,
    ids: [AtomicU32; HOT_IDS],
}

/// A word's key: its bytes packed little-endian into two integers (zero past its end) and its
/// length.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Word {
    pub lo: u64,
    pub hi: u64,
    pub len: u8,
}

/// The table.
pub struct Hot {
    slots: Box<[Slot]>,
}

impl Default for Hot {
    fn default() -> Self {
        Self { slots: (0..HOT_SLOTS).map(|_| Slot::default()).collect() }
    }
}

impl std::fmt::Debug for Hot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hot").field("slots", &self.slots.len()).finish()
    }
}

impl Hot {
    #[allow(clippy::cast_possible_truncation)] // a place in the table: the hash's low bits
    fn slot(&self, hash: u64) -> Option<&Slot> {
        self.slots.get(hash as usize % HOT_SLOTS)
    }

    /// Appends `word`'s ids to `out` and says so, when its place (by `hash`) holds it. `word` is
    /// not empty (an empty slot has length 0).
    #[inline(always)]
    #[allow(clippy::inline_always)] // once a word, in the tokenizer's loop
    pub fn get(&self, hash: u64, word: Word, out: &mut Vec<u32>) -> bool {
        debug_assert!(word.len > 0, "an empty word");
        let Some(s) = self.slot(hash) else { return false };
        let seq = s.seq.load(Ordering::Acquire);
        let shape = s.shape.load(Ordering::Relaxed);
        let (lo, hi) = (s.lo.load(Ordering::Relaxed), s.hi.load(Ordering::Relaxed));
        let ids = [
            s.ids[0].load(Ordering::Relaxed),
            s.ids[1].load(Ordering::Relaxed),
            s.ids[2].load(Ordering::Relaxed),
            s.ids[3].load(Ordering::Relaxed),
        ];
        // The loads above before the second read of the number: a writer that moved it before
        // any of them (and so may have torn them) is seen there.
        fence(Ordering::Acquire);
        if s.seq.load(Ordering::Relaxed) != seq
            || seq & 1 != 0
            || shape & 0xff != u32::from(word.len)
            || lo != word.lo
            || hi != word.hi
        {
            return false;
        }
        // One push an id (most words have one or two): `extend_from_slice` was a call of
        // `memcpy` a word.
        for &id in ids.iter().take(((shape >> 8) & 0xff) as usize) {
            out.push(id);
        }
        true
    }

    /// Puts `word` with its `ids` at its place (by `hash`), in place of what was there; not when
    /// it has none or more than [`HOT_IDS`], or when another thread is writing that place.
    pub fn put(&self, hash: u64, word: Word, ids: &[u32]) {
        if ids.is_empty() || ids.len() > HOT_IDS || word.len == 0 {
            return;
        }
        let Some(s) = self.slot(hash) else { return };
        let seq = s.seq.load(Ordering::Relaxed);
        if seq & 1 != 0
            || s.seq.compare_exchange(seq, seq.wrapping_add(1), Ordering::Acquire, Ordering::Relaxed).is_err()
        {
            return;
        }
        // The odd number before any of the stores below, for a reader that sees one of them.
        fence(Ordering::Release);
        #[allow(clippy::cast_possible_truncation)] // at most HOT_IDS
        let n = ids.len() as u32;
        s.shape.store(u32::from(word.len) | n << 8, Ordering::Relaxed);
        s.lo.store(word.lo, Ordering::Relaxed);
        s.hi.store(word.hi, Ordering::Relaxed);
        for (to, &id) in s.ids.iter().zip(ids) {
            to.store(id, Ordering::Relaxed);
        }
        s.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// Words held now (a scan, for tests).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.slots.iter().filter(|s| s.shape.load(Ordering::Relaxed) & 0xff != 0).count()
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // small test numbers
mod tests {
    use super::*;

    fn word(i: u64) -> Word {
        Word { lo: i, hi: !i, len: 9 }
    }

    fn got(hot: &Hot, hash: u64, w: Word) -> Option<Vec<u32>> {
        let mut out = vec![7];
        hot.get(hash, w, &mut out).then(|| out.split_off(1))
    }

    #[test]
    fn a_word_put_comes_back_with_its_ids_and_replaces_the_one_at_its_place() {
        let hot = Hot::default();
        assert_eq!(got(&hot, 5, word(1)), None);
        for n in 1..=HOT_IDS {
            let ids: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
            hot.put(5, word(n as u64), &ids);
            assert_eq!(got(&hot, 5, word(n as u64)), Some(ids));
        }
        // Another word at the same place: the last one put is there, the others are not.
        assert_eq!(got(&hot, 5, word(1)), None);
        assert_eq!(got(&hot, 5 + HOT_SLOTS as u64, word(HOT_IDS as u64)), Some(vec![100, 101, 102, 103]));
        // A word of the same bytes but another length is another word.
        assert_eq!(got(&hot, 5, Word { len: 8, ..word(HOT_IDS as u64) }), None);
        assert_eq!(hot.held(), 1);
    }

    #[test]
    fn words_of_no_ids_or_too_many_are_not_kept() {
        let hot = Hot::default();
        hot.put(1, word(1), &[]);
        hot.put(2, word(2), &[1, 2, 3, 4, 5]);
        hot.put(3, Word { lo: 0, hi: 0, len: 0 }, &[1]);
        assert_eq!(hot.held(), 0);
    }

    #[test]
    fn a_slot_being_written_is_neither_read_nor_written() {
        let hot = Hot::default();
        hot.put(9, word(1), &[1]);
        let s = hot.slot(9).unwrap();
        s.seq.fetch_add(1, Ordering::Relaxed);
        assert_eq!(got(&hot, 9, word(1)), None);
        hot.put(9, word(2), &[2]);
        s.seq.fetch_add(1, Ordering::Relaxed);
        assert_eq!(got(&hot, 9, word(1)), Some(vec![1]));
        assert_eq!(got(&hot, 9, word(2)), None);
    }

    /// Threads writing words to the same few places while others read them: a word read always
    /// has its own ids (each word's ids are made from it), never another's or a mix.
    #[test]
    fn readers_never_see_a_slot_half_written() {
        let hot = Hot::default();
        let ids = |i: u64| -> Vec<u32> { (0..=(i % 4) as u32).map(|k| (i as u32) * 10 + k).collect() };
        let hits = AtomicU64::new(0);
        std::thread::scope(|scope| {
            for t in 0..2u64 {
                let hot = &hot;
                scope.spawn(move || {
                    for r in 0..200_000u64 {
                        let i = (r * 7 + t) % 64;
                        hot.put(i % 4, word(i), &ids(i));
                    }
                });
            }
            for t in 0..2u64 {
                let (hot, hits) = (&hot, &hits);
                scope.spawn(move || {
                    for r in 0..200_000u64 {
                        let i = (r * 13 + t) % 64;
                        if let Some(got) = got(hot, i % 4, word(i)) {
                            assert_eq!(got, ids(i), "word {i}");
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert!(hits.load(Ordering::Relaxed) > 0, "no read found its word");
    }
}
