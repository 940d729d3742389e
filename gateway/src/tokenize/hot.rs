//! The words a tokenizer met lately, read without a lock: the first place [`super::fast`] looks a
//! word up.
//!
//! A table of [`HOT_SLOTS`] slots, each holding one short word (its bytes packed into two
//! integers, as [`super::fast`] packs them) and up to [`HOT_IDS`] ids, at the place its hash (the
//! sharded map's) names; a word put where another was replaces it. A slot is guarded by a
//! sequence number, odd while it is written (a seqlock made of atomics, so no `unsafe`): a reader
//! loads the number, the slot, then the number again, and takes the slot only if both were the
//! same even number; a writer takes the slot by moving the number to odd (a compare-and-swap: a slot being written is
//! left alone) and gives it back at the next even one. A lookup that finds its word writes
//! nothing, so threads reading the same words share their cache lines. On x86 a read is plain
//! loads: no atomic read-modify-write, no lock's cache line bounced between cores. (Two frequent
//! words that share a place put each other back in turn, each put a compare-and-swap.)
//!
//! A word not found here is looked up in the sharded map behind it (bounded, by words; longer words
//! and words of more ids only there), then encoded: both put it here. Bounded by construction:
//! `HOT_SLOTS` × 64 bytes (512 KB) a tokenizer.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

/// Slots: 64 bytes each (a power of two: a place is the top bits of a product).
pub const HOT_SLOTS: usize = 1 << HOT_BITS;
const HOT_BITS: u32 = 13;
/// The most ids a word here has (most words are one or two tokens).
pub const HOT_IDS: usize = 4;

/// One word and its ids, on a cache line of its own.
#[repr(align(64))]
#[derive(Default)]
struct Slot {
    /// Even when the slot is whole; odd while a writer fills it. 64 bits: a reader would have to
    /// stall through 2⁶³ writes of its slot to see the same number again.
    seq: AtomicU64,
    /// The word's length in bytes (the low byte; 0: an empty slot, as no word is empty) and how
    /// many ids it has (the next byte).
    shape: AtomicU32,
    lo: AtomicU64,
    hi: AtomicU64,
    /// The ids, two to an integer, the first in the low half.
    ids: [AtomicU64; HOT_IDS / 2],
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
    slots: Box<[Slot; HOT_SLOTS]>,
}

impl Default for Hot {
    fn default() -> Self {
        let slots: Box<[Slot]> = (0..HOT_SLOTS).map(|_| Slot::default()).collect();
        Self { slots: slots.try_into().unwrap_or_else(|_| unreachable!("HOT_SLOTS slots were made")) }
    }
}

impl std::fmt::Debug for Hot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hot").field("slots", &self.slots.len()).finish()
    }
}

impl Hot {
    /// The slot at `hash`'s top bits: the word's hash, the one the sharded map keys it by (seeded,
    /// two folded 128-bit multiplies). (One 64-bit or one folded multiply of the word's integers
    /// put 1,000 words differing in a few low bits into 551–771 places under some seeds.)
    #[inline(always)]
    #[allow(clippy::inline_always, clippy::cast_possible_truncation)] // HOT_BITS bits
    fn slot(&self, hash: u64) -> &Slot {
        &self.slots[(hash >> (64 - HOT_BITS)) as usize]
    }

    /// Appends `word`'s ids to `out` and says so, when its place (by `hash`) holds it. `word` is not empty
    /// (an empty slot has length 0).
    #[inline(always)]
    #[allow(clippy::inline_always, clippy::cast_possible_truncation)] // once a word; ids' halves
    pub fn get(&self, hash: u64, word: Word, out: &mut Vec<u32>) -> bool {
        debug_assert!(word.len > 0, "an empty word");
        let s = self.slot(hash);
        let seq = s.seq.load(Ordering::Acquire);
        let shape = s.shape.load(Ordering::Relaxed);
        let (lo, hi) = (s.lo.load(Ordering::Relaxed), s.hi.load(Ordering::Relaxed));
        let (ab, cd) = (s.ids[0].load(Ordering::Relaxed), s.ids[1].load(Ordering::Relaxed));
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
        let ids = [ab as u32, (ab >> 32) as u32, cd as u32, (cd >> 32) as u32];
        for &id in ids.iter().take(((shape >> 8) & 0xff) as usize) {
            out.push(id);
        }
        true
    }

    /// Puts `word` with its `ids` at its place (by `hash`), in place of what was there; not when it has none
    /// or more than [`HOT_IDS`], or when another thread is writing that place.
    pub fn put(&self, hash: u64, word: Word, ids: &[u32]) {
        if ids.is_empty() || ids.len() > HOT_IDS || word.len == 0 {
            return;
        }
        let s = self.slot(hash);
        let seq = s.seq.load(Ordering::Relaxed);
        // Acquire: this writer's stores come after the last writer's, whose seq+2 it reads here.
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
        let id = |i: usize| u64::from(ids.get(i).copied().unwrap_or(0));
        s.ids[0].store(id(0) | id(1) << 32, Ordering::Relaxed);
        s.ids[1].store(id(2) | id(3) << 32, Ordering::Relaxed);
        s.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// Words held now (a scan, for tests).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.slots.iter().filter(|s| s.shape.load(Ordering::Relaxed) & 0xff != 0).count()
    }

    /// Empties every slot (for tests; a lookup meanwhile only misses: no word has length 0).
    #[cfg(test)]
    pub(crate) fn clear(&self) {
        for s in self.slots.iter() {
            s.shape.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // small test numbers
mod tests {
    use super::*;

    fn word(i: u64) -> Word {
        Word { lo: i, hi: 0, len: 9 }
    }

    /// Every test word at one place (hash 0) but in `words_spread_over_the_table`.
    fn got(hot: &Hot, w: Word) -> Option<Vec<u32>> {
        got_at(hot, 0, w)
    }

    fn got_at(hot: &Hot, hash: u64, w: Word) -> Option<Vec<u32>> {
        let mut out = vec![7];
        hot.get(hash, w, &mut out).then(|| out.split_off(1))
    }

    #[test]
    fn a_word_put_comes_back_with_its_ids_and_replaces_the_one_at_its_place() {
        let hot = Hot::default();
        assert_eq!(got(&hot, word(1)), None);
        for n in 1..=HOT_IDS {
            let ids: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
            hot.put(0, word(n as u64), &ids);
            assert_eq!(got(&hot, word(n as u64)), Some(ids));
        }
        // The last word put is there, the others it replaced are not.
        assert_eq!(got(&hot, word(1)), None);
        assert_eq!(got(&hot, word(HOT_IDS as u64)), Some(vec![100, 101, 102, 103]));
        // A word differing in its length alone, its first integer alone or its second alone is
        // another word.
        let last = word(HOT_IDS as u64);
        for other in [Word { len: 8, ..last }, Word { lo: 0, ..last }, Word { hi: 1, ..last }] {
            assert_eq!(got(&hot, other), None, "{other:?}");
        }
        assert_eq!(hot.held(), 1);
    }

    /// Words put at their hashes' places come back from there (a hash's top bits name the place).
    #[test]
    fn words_spread_over_the_table() {
        let (hot, seeds) = (Hot::default(), ahash::RandomState::new());
        let hash = |w: Word| seeds.hash_one((w.lo, w.hi, w.len));
        for i in 0..1000 {
            hot.put(hash(word(i)), word(i), &[i as u32]);
        }
        // 1,000 words over 8,192 places: some 60 share one, by chance.
        assert!(hot.held() > 900, "{} places for 1,000 words", hot.held());
        let back =
            (0..1000).filter(|&i| got_at(&hot, hash(word(i)), word(i)) == Some(vec![i as u32])).count();
        assert_eq!(back, hot.held());
        assert_eq!(got_at(&hot, hash(word(5)) ^ (1 << 63), word(5)), None, "another place");
    }

    #[test]
    fn words_of_no_ids_or_too_many_are_not_kept() {
        let hot = Hot::default();
        hot.put(0, word(1), &[]);
        hot.put(0, word(2), &[1, 2, 3, 4, 5]);
        hot.put(0, Word { lo: 0, hi: 0, len: 0 }, &[1]);
        assert_eq!(hot.held(), 0);
    }

    #[test]
    fn a_slot_being_written_is_neither_read_nor_written() {
        let hot = Hot::default();
        hot.put(0, word(1), &[1]);
        let s = hot.slot(0);
        s.seq.fetch_add(1, Ordering::Relaxed);
        assert_eq!(got(&hot, word(1)), None);
        hot.put(0, word(2), &[2]);
        s.seq.fetch_add(1, Ordering::Relaxed);
        assert_eq!(got(&hot, word(1)), Some(vec![1]));
        assert_eq!(got(&hot, word(2)), None);
    }

    /// Threads writing two words to one place while others read them: a word read always has its
    /// own ids (each word's ids are made from it), never another's or a mix.
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
                        let i = (r * 7 + t) % 2;
                        hot.put(0, word(i), &ids(i));
                    }
                });
            }
            for t in 0..2u64 {
                let (hot, hits) = (&hot, &hits);
                scope.spawn(move || {
                    for r in 0..200_000u64 {
                        let i = (r * 13 + t) % 2;
                        if let Some(got) = got(hot, word(i)) {
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
