//! A byte-level BPE's token ids without `tokenizers`' pipeline: the same ids, a fraction of the CPU.
//!
//! `tokenizers::Tokenizer::encode_fast` builds a whole `Encoding`: offsets and alignments through
//! every step, a `String` per token, split records sized by the input (24 bytes per input byte at
//! each split), and a word cache that hands out clones. On a 1 KB English prompt that is about 0.1 ms
//! of the gateway's CPU, and the gateway needs only the ids. Oniguruma adds a malloc and a copy of
//! its match stack at every search, one search per word.
//!
//! For the shapes of Llama 3's and Qwen 2/2.5/3's `tokenizer.json` (a `Split` regex, `Isolated`,
//! then `ByteLevel` without its own regex) and of GPT-2's (`ByteLevel` with its regex, as the vLLM
//! tests' tiny model has), with a BPE model and any normalizer, this runs the same steps, with the
//! tokenizer's own parts where it has them:
//!
//! 1. the text is cut at added tokens: leftmost-longest Aho-Corasick over the tokens matched before
//!    normalizing, the automaton `tokenizers` builds ([`Added`]);
//! 2. each piece between them goes through the tokenizer's own normalizer (skipped for ASCII under
//!    NFC, NFD, NFKC or NFKD, which leave ASCII as it is);
//! 3. it is split by the pattern, matches and the gaps between them each a word: ASCII text of
//!    the three patterns these tokenizers use ([`AUDITED_PATTERNS`]) by a split written out for
//!    each (below), any other with the tokenizer's own Oniguruma regex (GPT-2's compiled here as
//!    `ByteLevel` compiles it: its own is private);
//! 4. each word's bytes are mapped to GPT-2's byte-level alphabet and encoded by the tokenizer's own
//!    BPE model (its merges, its cache); the ids of short words are kept in a bounded, sharded map
//!    ([`WORD_CACHE_WORDS`]), a word of up to 16 bytes keyed by its bytes packed into two integers,
//!    and those of up to four ids also in a table read without a lock ([`super::hot`]), where a
//!    word is looked up first; the ASCII split looks each word up as it finds it (no list of words,
//!    no call a word);
//! 5. the post-processor's special tokens (`<|begin_of_text|>`) go around them: found at load by
//!    running the post-processor on a one-token encoding.
//!
//! The written-out split takes each pattern's alternatives in order at each word's start, each
//! repeat as long as the rest allows, as Oniguruma (a backtracking engine) does; the look-ahead
//! tail `\s+(?!\S)|\s+` leaves a run of whitespace before a non-space without its last character
//! (which then leads the next word: `" word"`), unless it is that one character. Only ASCII takes
//! it: Oniguruma's Unicode tables (`\p{L}`, case folding) are its own to match. And only the three
//! patterns read for it: another is split by Oniguruma whatever its text.
//!
//! Any other shape keeps `tokenizers`' own pipeline ([`Off`]). A self-check at load compares both on
//! probes (whitespace runs, contractions, digits, added tokens, Unicode that normalizes, and every
//! string of three characters from a small alphabet of each class) and turns this path off at the
//! first difference. Tests compare them on random text and the repository's
//! docs for the real Llama 3.1 and Qwen3 tokenizers and small ones of each shape ([`super::toy`]),
//! and the `tokenize` fuzz target on anything.

use std::sync::{RwLock, RwLockReadGuard};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::utils::SysRegex;
use tokenizers::{
    Model, ModelWrapper, NormalizedString, Normalizer, NormalizerWrapper, PostProcessor, PreTokenizerWrapper,
    SplitDelimiterBehavior,
};

/// Distinct words whose ids are kept, each at most [`WORD_CACHE_BYTES`] long: by arithmetic about
/// 16 MB in the worst case (64-byte words of 64 ids each, with the map's and allocator's overhead,
/// and a shard's table of packed words keeping its buckets, 3 MB in all, when it is emptied).
/// A shard of the map is emptied when full, so words common now are kept rather than the first ones
/// seen.
pub const WORD_CACHE_WORDS: usize = 32_768;
/// Words longer than this (bytes) are encoded each time.
const WORD_CACHE_BYTES: usize = 64;
/// The word map's shards, each behind its own lock, chosen by the word's hash: threads tokenizing
/// at once rarely share a lock's cache line, and a new word finds its shard's lock free to insert.
const WORD_SHARDS: usize = 16;
/// Words looked up under a shard's read lock before it is let go (and every shard is let go at a
/// word not in the map): a lock taken and given back per word was a third of a 1 KB prompt's time
/// (two atomic read-modify-writes a word), while a shard held for a whole piece would keep other
/// threads' new words out of the map (a word is inserted only when its shard's write lock is free
/// at once).
const HOLD_WORDS: u32 = 64;

/// Llama 3's split pattern (`tokenizer.json`), digits in threes.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2/2.5/3's, digits one by one.
pub const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-2's, which `ByteLevel` splits with when `use_regex` is set (`tokenizers`' `byte_level.rs`).
pub const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The patterns whose ASCII text is split by [`AsciiSplit`], written out alternative by
/// alternative. Each is also checked at load, as every pattern is.
pub const AUDITED_PATTERNS: &[&str] = &[LLAMA3_PATTERN, QWEN_PATTERN, GPT2_PATTERN];

/// The tokenizer's added tokens matched before normalizing, as `tokenizers` matches them.
#[derive(Debug)]
pub struct Added {
    pub trie: AhoCorasick,
    /// Each pattern's token id.
    pub ids: Vec<u32>,
    /// The tokens, by content.
    pub tokens: Vec<tokenizers::AddedToken>,
}

impl Added {
    /// The added tokens `tokenizers` splits on before normalizing (`normalized = false`), in one
    /// leftmost-longest automaton.
    pub fn of(tok: &tokenizers::Tokenizer) -> Result<Self, String> {
        let mut added: Vec<(u32, tokenizers::AddedToken)> =
            tok.get_added_tokens_decoder().into_iter().filter(|(_, t)| !t.normalized).collect();
        added.sort_by(|a, b| a.1.content.cmp(&b.1.content));
        let trie = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|(_, t)| &t.content))
            .map_err(|e| e.to_string())?;
        let (ids, tokens) = added.into_iter().unzip();
        Ok(Self { trie, ids, tokens })
    }
}

/// Why a tokenizer keeps `tokenizers`' own pipeline.
#[derive(Debug, PartialEq, Eq)]
pub enum Off {
    /// Its steps are not the ones this path runs: which one.
    Shape(String),
    /// The self-check found a text encoded differently (`add_special_tokens` with it).
    Mismatch(String, bool),
}

impl std::fmt::Display for Off {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Shape(why) => f.write_str(why),
            Self::Mismatch(t, special) => {
                write!(f, "the self-check encoded {t:?} (add_special_tokens = {special}) differently")
            }
        }
    }
}

/// The parts of the tokenizer this path runs, borrowed from it.
struct Parts<'t> {
    normalizer: Option<&'t NormalizerWrapper>,
    regex: &'t SysRegex,
    bpe: &'t tokenizers::models::bpe::BPE,
}

/// How the tokenizer splits text into words.
enum Words<'t> {
    /// A `Split` pre-tokenizer, then `ByteLevel` without its regex (Llama 3, Qwen 2/2.5/3).
    Split(&'t Split),
    /// `ByteLevel` with GPT-2's regex (GPT-2's own tokenizer and those trained like it).
    Gpt2,
}

fn words(tok: &tokenizers::Tokenizer) -> Result<Words<'_>, String> {
    let words = match tok.get_pre_tokenizer() {
        Some(PreTokenizerWrapper::Sequence(seq)) => match seq.as_ref() {
            [PreTokenizerWrapper::Split(_), PreTokenizerWrapper::ByteLevel(bl)] if bl.add_prefix_space => {
                return Err("its ByteLevel pre-tokenizer adds a prefix space".into());
            }
            [PreTokenizerWrapper::Split(split), PreTokenizerWrapper::ByteLevel(bl)] if !bl.use_regex => {
                Words::Split(split)
            }
            _ => return Err("its pre-tokenizer is not a Split then a ByteLevel without its regex".into()),
        },
        Some(PreTokenizerWrapper::ByteLevel(bl)) if bl.add_prefix_space => {
            return Err("its ByteLevel pre-tokenizer adds a prefix space".into());
        }
        Some(PreTokenizerWrapper::ByteLevel(bl)) if bl.use_regex => Words::Gpt2,
        _ => return Err("its pre-tokenizer is not a Split then a ByteLevel, or a ByteLevel alone".into()),
    };
    if let Words::Split(split) = words
        && (split.invert || !matches!(split.behavior, SplitDelimiterBehavior::Isolated))
    {
        return Err("its Split pre-tokenizer does not isolate its matches".into());
    }
    Ok(words)
}

/// The split of ASCII text for each audited pattern ([`AUDITED_PATTERNS`]), written out as a
/// backtracking engine takes the pattern's alternatives at each word's start (leftmost-first, greedy
/// repeats). A general regex engine pays for its generality at every word (setting up a search and
/// its cache; with the `regex` crate's lazy DFA the proxy bench's prompt took 2.7 times as long): a
/// table of byte classes does the same work in a few comparisons a byte. Checked against Oniguruma
/// on every string of up to four characters from an alphabet of each class, on random ASCII, and at
/// load with the rest of the path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AsciiSplit {
    /// Llama 3's: digits in runs of at most three.
    Llama3,
    /// Qwen 2/2.5/3's: digits one by one.
    Qwen,
    /// GPT-2's: contractions in lower case only, a space the only character led into a word.
    Gpt2,
    /// Llama 3's without the look-ahead (`\s+(?!\S)` matched as `\s+`): only for showing that
    /// the self-check refuses a path that differs.
    #[cfg(test)]
    Llama3NoLookAhead,
}

/// ASCII byte classes as the patterns tell them apart (a byte past the text has none).
const LETTER: u8 = 1;
const DIGIT: u8 = 2;
/// `\s`: Unicode's White_Space in ASCII, `\t \n \v \f \r` and the space.
const SPACE: u8 = 4;
/// `\r` and `\n` (also [`SPACE`]).
const LINE: u8 = 8;
/// None of the others: punctuation and control characters.
const OTHER: u8 = 16;

/// By byte: a table of 256 so a byte indexes it unchecked. The split runs on ASCII text only, so
/// the upper half (which would be wrong for Unicode's letters) is never read.
static CLASSES: [u8; 256] = {
    let mut t = [OTHER; 256];
    let mut b: u8 = 0;
    while b < 128 {
        t[b as usize] = match b {
            b'a'..=b'z' | b'A'..=b'Z' => LETTER,
            b'0'..=b'9' => DIGIT,
            b'\n' | b'\r' => SPACE | LINE,
            b'\t' | 0x0b | 0x0c | b' ' => SPACE,
            _ => OTHER,
        };
        b += 1;
    }
    t
};

/// Each byte's top bit.
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// The top bit of each byte of `w` (eight ASCII bytes) that is a letter, `[A-Za-z]`: one whose
/// lowercase (`| 0x20`) lies in `a..=z`, found by adding to each byte what carries `a` (0x61) and
/// `{` (0x7b, just past `z`) into its top bit. An ASCII byte is at most 0x7f, so no sum carries into
/// the next byte. (Byte by byte, each letter cost a bounds check, a table load and a branch.)
fn letters(w: u64) -> u64 {
    let lower = w | 0x2020_2020_2020_2020;
    let from_a = lower + 0x1f1f_1f1f_1f1f_1f1f;
    let past_z = lower + 0x0505_0505_0505_0505;
    from_a & !past_z & HIGH_BITS
}

impl AsciiSplit {
    /// The split for an audited pattern; `None` for any other.
    fn new(pattern: &str) -> Option<Self> {
        match pattern {
            LLAMA3_PATTERN => Some(Self::Llama3),
            QWEN_PATTERN => Some(Self::Qwen),
            GPT2_PATTERN => Some(Self::Gpt2),
            _ => None,
        }
    }

    /// `each(start, end)` for each word of ASCII `b`, in order (the encoder looks each up as it
    /// is found; the tests collect them).
    #[inline(always)]
    #[allow(clippy::inline_always)]
    fn each_word<E>(self, b: &[u8], mut each: impl FnMut(usize, usize) -> Result<(), E>) -> Result<(), E> {
        let mut at = 0;
        while at < b.len() {
            let end = self.word_end(b, at);
            each(at, end)?;
            at = end;
        }
        Ok(())
    }

    /// Each word of ASCII `text` into `spans`, in order.
    #[cfg(test)]
    fn split(self, text: &str, spans: &mut Vec<(usize, usize)>) {
        let _ = self.each_word::<()>(text.as_bytes(), |start, end| {
            spans.push((start, end));
            Ok(())
        });
    }

    /// Where the word that starts at `i` (`i < b.len()`, ASCII) ends: the first alternative of the
    /// pattern that matches there, each repeat as long as the rest allows.
    fn word_end(self, b: &[u8], i: usize) -> usize {
        let class = |k: usize| if k < b.len() { CLASSES[usize::from(b[k])] } else { 0 };
        let run = |mut k: usize, of: u8| {
            // Letters, the most of any text, eight at a time while eight remain.
            if of == LETTER {
                while let Some(eight) = b.get(k..k + 8).and_then(|c| <[u8; 8]>::try_from(c).ok()) {
                    let others = !letters(u64::from_le_bytes(eight)) & HIGH_BITS;
                    if others != 0 {
                        return k + (others.trailing_zeros() / 8) as usize;
                    }
                    k += 8;
                }
            }
            while class(k) & of != 0 {
                k += 1;
            }
            k
        };
        let c = class(i);
        let gpt2 = self == Self::Gpt2;
        // 's|'t|'re|'ve|'m|'ll|'d, in either case but GPT-2's.
        if b.get(i) == Some(&b'\'') {
            let at = |k: usize| b.get(k).map(|&c| if gpt2 { c } else { c.to_ascii_lowercase() });
            match (at(i + 1), at(i + 2)) {
                (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
                (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return i + 3,
                _ => {}
            }
        }
        if gpt2 {
            // ` ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+`: a space leads a word of any of the three.
            let (k, lead) = if b.get(i) == Some(&b' ') { (i + 1, class(i + 1)) } else { (i, c) };
            for of in [LETTER, DIGIT, OTHER] {
                if lead & of != 0 {
                    return run(k, of);
                }
            }
        } else {
            // `[^\r\n\p{L}\p{N}]?\p{L}+`
            if c & LETTER != 0 {
                return run(i, LETTER);
            }
            if c & (LINE | DIGIT) == 0 && class(i + 1) & LETTER != 0 {
                return run(i + 1, LETTER);
            }
            // `\p{N}{1,3}` (Llama 3's), `\p{N}` (Qwen's)
            if c & DIGIT != 0 {
                let most = if self == Self::Qwen { 1 } else { 3 };
                return run(i, DIGIT).min(i + most);
            }
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
            let lead = if b.get(i) == Some(&b' ') && class(i + 1) & OTHER != 0 {
                Some(i + 1)
            } else {
                (c & OTHER != 0).then_some(i)
            };
            if let Some(k) = lead {
                return run(run(k, OTHER), LINE);
            }
            // `\s*[\r\n]+`: the whitespace up to and with its last line end.
            let spaces = run(i, SPACE);
            if let Some(k) = (i..spaces).rev().find(|&k| class(k) & LINE != 0) {
                return k + 1;
            }
        }
        // `\s+(?!\S)|\s+`: whitespace before a non-space leaves its last character to lead the
        // next word (` word`), unless it is that one character.
        let spaces = run(i, SPACE);
        #[cfg(test)]
        if self == Self::Llama3NoLookAhead {
            return spaces;
        }
        if spaces == b.len() || spaces - i < 2 { spaces } else { spaces - 1 }
    }
}

/// GPT-2's map of bytes to printable characters (`bytes_to_unicode`), as `ByteLevel` uses.
pub(crate) fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        out[usize::from(b)] = if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\0');
            next += 1;
            c
        };
    }
    out
}

/// A tokenizer's vocabulary and added tokens counted, cheaply (`Tokenizer::get_vocab_size(true)`
/// copies the whole vocabulary into a map to count it).
fn sizes(tok: &tokenizers::Tokenizer) -> (usize, usize) {
    (tok.get_vocab_size(false), tok.get_added_vocabulary().len())
}

/// Each word of `text` into `spans` as `tokenizers`' `Split` makes them with `Isolated`: the
/// matches and the gaps between them, empty ones left out.
fn onig_split(regex: &SysRegex, text: &str, spans: &mut Vec<(usize, usize)>) {
    let mut prev = 0;
    for (start, end) in regex.find_iter(text) {
        if prev != start {
            spans.push((prev, start));
        }
        if start != end {
            spans.push((start, end));
        }
        prev = end;
    }
    if prev != text.len() {
        spans.push((prev, text.len()));
    }
}

/// The direct path for one tokenizer (the `tokenizers::Tokenizer` it was made from is passed to
/// each call: its model and regex are used, not copied).
pub struct Fast {
    /// GPT-2's regex compiled as `ByteLevel` compiles it, for that shape (its own is private).
    gpt2: Option<SysRegex>,
    added: Added,
    ascii: Option<AsciiSplit>,
    /// The normalizer leaves ASCII as it is (a Unicode normal form).
    ascii_normal: bool,
    chars: [char; 256],
    /// Ids the post-processor puts before and after the text's (with `add_special_tokens`).
    prefix: Vec<u32>,
    suffix: Vec<u32>,
    /// The sizes of the tokenizer's vocabulary and added tokens: a call with another is refused.
    sizes: (usize, usize),
    /// Hashes long words; its seeds, drawn again, hash packed ones.
    hasher: ahash::RandomState,
    seeds: [u64; 3],
    /// Where a short word is looked up first, without a lock ([`super::hot`]).
    hot: super::hot::Hot,
    words: [RwLock<WordMap>; WORD_SHARDS],
}

/// A shard of the map of words' ids, by a hash of the word's bytes ([`Packed::hash`], or
/// [`Fast::hasher`]'s for a long word; one hash a word, for its shard and its place in the shard):
/// words of up to [`PACKED_BYTES`] bytes by their bytes packed into two integers (compared in two
/// comparisons, no call), longer ones by their bytes.
#[derive(Default)]
struct WordMap {
    packed: hashbrown::HashTable<(Packed, Ids)>,
    long: hashbrown::HashTable<(Box<[u8]>, Ids)>,
}

/// A word as the map looks it up.
#[derive(Clone, Copy)]
enum Key<'w> {
    Packed(Packed),
    Long(&'w [u8]),
}

impl WordMap {
    fn len(&self) -> usize {
        self.packed.len() + self.long.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline(always)]
    #[allow(clippy::inline_always)]
    fn find(&self, hash: u64, key: Key<'_>) -> Option<&[u32]> {
        match key {
            Key::Packed(k) => self.packed.find(hash, |(p, _)| *p == k).map(|(_, ids)| ids.get()),
            Key::Long(w) => self.long.find(hash, |(l, _)| **l == *w).map(|(_, ids)| ids.get()),
        }
    }

    /// Keeps `ids` for `key` (not there), emptying the shard first when it is full.
    fn insert(&mut self, hash: u64, key: Key<'_>, ids: &[u32], fast: &Fast) {
        if self.len() >= WORD_CACHE_WORDS / WORD_SHARDS {
            self.packed.clear();
            self.long.clear();
        }
        match key {
            Key::Packed(k) => {
                let rehash = |(p, _): &(Packed, Ids)| p.hash(&fast.seeds);
                self.packed.insert_unique(hash, (k, Ids::new(ids)), rehash);
            }
            Key::Long(w) => {
                let rehash = |(l, _): &(Box<[u8]>, Ids)| fast.hasher.hash_one(&**l);
                self.long.insert_unique(hash, (w.into(), Ids::new(ids)), rehash);
            }
        }
    }
}

/// Words up to this many bytes are kept packed ([`Packed`]): most words of most text.
const PACKED_BYTES: usize = 16;

/// A word of 1 to [`PACKED_BYTES`] bytes: its bytes little-endian in two integers, zero past its
/// end, and its length (a word ending in zero bytes is told from a shorter one by it); the key of
/// the map and of the lock-free table alike.
use super::hot::Word as Packed;

/// By a word's length: the masks of its bytes in [`Packed`]'s two integers.
static MASKS: [(u64, u64); PACKED_BYTES + 1] = {
    let mut m = [(0, 0); PACKED_BYTES + 1];
    let mut len = 1;
    while len <= PACKED_BYTES {
        m[len] =
            if len <= 8 { (u64::MAX >> (64 - 8 * len), 0) } else { (u64::MAX, u64::MAX >> (128 - 8 * len)) };
        len += 1;
    }
    m
};

impl Packed {
    /// The word `t[start..end]` (`end - start <= PACKED_BYTES`); the bytes after it in `t`, when
    /// there are 16, are read with it and masked off rather than copied out first.
    fn of(t: &[u8], start: usize, end: usize) -> Self {
        let len = end - start;
        debug_assert!(len <= PACKED_BYTES, "a word of {len} bytes is not packed");
        match t.get(start..start + PACKED_BYTES) {
            Some(w) => Self::masked(w, len),
            // A word near the text's end, copied out first (here only: the copy's room, made and
            // zeroed before the branch, cost every word five instructions).
            None => {
                let mut at = [0u8; PACKED_BYTES];
                if let (Some(to), Some(w)) = (at.get_mut(..len), t.get(start..end)) {
                    to.copy_from_slice(w);
                }
                Self::masked(&at, len)
            }
        }
    }

    /// The first `len` bytes of `from` (16 of them).
    #[inline(always)]
    #[allow(clippy::inline_always)]
    fn masked(from: &[u8], len: usize) -> Self {
        let half =
            |i: usize| from.get(i..i + 8).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
        let (lo, hi) = MASKS.get(len).copied().unwrap_or_default();
        Self { lo: half(0) & lo, hi: half(8) & hi, len: u8::try_from(len).unwrap_or(u8::MAX) }
    }

    /// Two multiplies folded (foldhash's step) under the map's random seeds.
    #[allow(clippy::cast_possible_truncation)] // the product's two halves, folded
    fn hash(&self, seeds: &[u64; 3]) -> u64 {
        let fold = |a: u64, b: u64| {
            let p = u128::from(a) * u128::from(b);
            (p as u64) ^ ((p >> 64) as u64)
        };
        fold(fold(self.lo ^ seeds[0], self.hi ^ seeds[1]) ^ u64::from(self.len), seeds[2])
    }
}

/// A word's ids: up to three in place (most words are one or two tokens), more on the heap.
enum Ids {
    Few(u8, [u32; 3]),
    Many(Box<[u32]>),
}

impl Ids {
    fn new(ids: &[u32]) -> Self {
        match *ids {
            [a] => Self::Few(1, [a, 0, 0]),
            [a, b] => Self::Few(2, [a, b, 0]),
            [a, b, c] => Self::Few(3, [a, b, c]),
            _ => Self::Many(ids.into()),
        }
    }

    fn get(&self) -> &[u32] {
        match self {
            Self::Few(n, ids) => ids.get(..usize::from(*n)).unwrap_or_default(),
            Self::Many(ids) => ids,
        }
    }
}

/// The word map's shards one call has read-locked, each taken at its first word and all given
/// back every [`HOLD_WORDS`] words and at a word not in the map.
struct Held<'a> {
    guards: [Option<RwLockReadGuard<'a, WordMap>>; WORD_SHARDS],
    words: u32,
}

impl Held<'_> {
    fn new() -> Self {
        Self { guards: std::array::from_fn(|_| None), words: 0 }
    }
}

impl std::fmt::Debug for Fast {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fast")
            .field("added", &self.added.ids.len())
            .field("ascii_split", &self.ascii)
            .field("prefix", &self.prefix)
            .field("suffix", &self.suffix)
            .finish_non_exhaustive()
    }
}

impl Fast {
    /// The direct path for `tok`, checked against `tok.encode_fast` on probes.
    pub fn new(tok: &tokenizers::Tokenizer) -> Result<Box<Self>, Off> {
        let fast = Box::new(Self::unchecked(tok)?);
        fast.self_check(tok)?;
        Ok(fast)
    }

    fn unchecked(tok: &tokenizers::Tokenizer) -> Result<Self, Off> {
        if tok.get_encode_special_tokens() {
            return Err(Off::Shape("it encodes special tokens as text".into()));
        }
        if tok.get_truncation().is_some() || tok.get_padding().is_some() {
            return Err(Off::Shape("tokenizer.json sets truncation or padding".into()));
        }
        if let Some((_, t)) = tok.get_added_tokens_decoder().into_iter().find(|(_, t)| t.normalized) {
            return Err(Off::Shape(format!("the added token {:?} is matched after normalizing", t.content)));
        }
        let (pattern, gpt2) = match words(tok).map_err(Off::Shape)? {
            Words::Split(split) => match &split.pattern {
                SplitPattern::Regex(r) => (Some(r.as_str()), None),
                SplitPattern::String(_) => (None, None),
            },
            Words::Gpt2 => {
                let regex = SysRegex::new(GPT2_PATTERN).map_err(|e| Off::Shape(e.to_string()))?;
                (Some(GPT2_PATTERN), Some(regex))
            }
        };
        let ModelWrapper::BPE(bpe) = tok.get_model() else {
            return Err(Off::Shape("its model is not a BPE".into()));
        };
        if bpe.dropout.is_some_and(|p| p > 0.0) {
            return Err(Off::Shape("its BPE has dropout".into()));
        }
        let added = Added::of(tok).map_err(Off::Shape)?;
        if let Some(t) = added.tokens.iter().find(|t| t.lstrip || t.rstrip || t.single_word) {
            return Err(Off::Shape(format!(
                "the added token {:?} strips whitespace or must be a word",
                t.content
            )));
        }
        let ascii = pattern.and_then(AsciiSplit::new);
        let normalizer = tok.get_normalizer();
        let ascii_normal = matches!(
            normalizer,
            None | Some(
                NormalizerWrapper::NFC(_)
                    | NormalizerWrapper::NFD(_)
                    | NormalizerWrapper::NFKC(_)
                    | NormalizerWrapper::NFKD(_)
            )
        );
        let (prefix, suffix) = match tok.get_post_processor() {
            None => (Vec::new(), Vec::new()),
            Some(pp) => {
                // One token no vocabulary has: what the post-processor puts around it is what it
                // puts around any text's ids.
                let one = tokenizers::Encoding::from_tokens(
                    vec![tokenizers::Token::new(u32::MAX, String::new(), (0, 0))],
                    0,
                );
                let out = pp
                    .process(one, None, true)
                    .map_err(|e| Off::Shape(format!("its post-processor: {e}")))?;
                let ids = out.get_ids();
                match ids.iter().position(|&i| i == u32::MAX) {
                    Some(at) if ids.iter().filter(|&&i| i == u32::MAX).count() == 1 => {
                        (ids[..at].to_vec(), ids[at + 1..].to_vec())
                    }
                    _ => {
                        return Err(Off::Shape(
                            "its post-processor does not keep the text's ids whole".into(),
                        ));
                    }
                }
            }
        };
        Ok(Self {
            gpt2,
            added,
            ascii,
            ascii_normal,
            chars: byte_chars(),
            prefix,
            suffix,
            sizes: sizes(tok),
            hasher: ahash::RandomState::new(),
            seeds: {
                let r = ahash::RandomState::new();
                [r.hash_one(1u8), r.hash_one(2u8), r.hash_one(3u8) | 1]
            },
            hot: super::hot::Hot::default(),
            words: std::array::from_fn(|_| RwLock::new(WordMap::default())),
        })
    }

    /// Compares with `tokenizers` on probes made to find where the paths could part: whitespace
    /// runs before words, punctuation, digits and line ends, contractions in either case, Unicode
    /// that normalizes or that only Oniguruma's tables class, and the tokenizer's added tokens.
    fn self_check(&self, tok: &tokenizers::Tokenizer) -> Result<(), Off> {
        let mut probes: Vec<String> = [
            "",
            " ",
            "  ",
            "a",
            " a",
            "a ",
            "a  b",
            "a   b",
            "a \tb",
            "a\t\tb",
            " \n ",
            "a\n\n b",
            "a \r\n\r\n  b",
            "x\u{b}\u{c} y",
            "  trailing  ",
            "It's 'S 'LL they'Re I'd we've 'm",
            "1 12 123 1234 12345 v1.2.3",
            "hello, world!!  ...\n\n\tdone;\n",
            "(a)[b]{c} <d> \"e\" `f` --g ==h",
            "e\u{301}t\u{e9} \u{212b}ngstr\u{f6}m",
            "日本語のテキスト、句読点。",
            "🎉 emoji 🎉🎉\u{200d}",
            "\u{a0}nbsp\u{2003}em\u{3000}ideo",
            "\u{17f}s long s, \u{212a}elvin",
            "مرحبا بالعالم",
            "Ünïcödé  wörds\r\n",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        for (i, t) in self.added.tokens.iter().take(64).enumerate() {
            let s = &t.content;
            probes.push(s.clone());
            probes.push(format!("a {s} b{s}{s}\n{s}  x"));
            if i < 8 {
                let half: String = s.chars().take(s.chars().count() / 2).collect();
                probes.push(format!("{half}{s}é {half}"));
            }
        }
        // Every string of three from a character of each class the pattern tells apart.
        let alphabet = ['a', 'S', '1', ' ', '\n', '\r', '\t', '\u{b}', '\'', '.', 'é', '\u{a0}'];
        for a in alphabet {
            for b in alphabet {
                for c in alphabet {
                    probes.push(String::from_iter([a, b, c]));
                }
            }
        }
        for p in &probes {
            for special in [false, true] {
                let want = tok.encode_fast(p.as_str(), special).map(|e| e.get_ids().to_vec()).ok();
                let got = self.encode(tok, p, special).ok();
                if want.is_none() || want != got {
                    return Err(Off::Mismatch(p.clone(), special));
                }
            }
        }
        Ok(())
    }

    /// The parts of `tok` each call runs (checked at load: an error here means another tokenizer).
    fn parts<'t>(&'t self, tok: &'t tokenizers::Tokenizer) -> tokenizers::Result<Parts<'t>> {
        if sizes(tok) != self.sizes {
            return Err("not the tokenizer this direct path was made for".into());
        }
        let regex = match (words(tok)?, &self.gpt2) {
            (Words::Split(split), None) => &split.regex,
            (Words::Gpt2, Some(gpt2)) => gpt2,
            _ => return Err("not the tokenizer this direct path was made for".into()),
        };
        let ModelWrapper::BPE(bpe) = tok.get_model() else { return Err("its model is not a BPE".into()) };
        Ok(Parts { normalizer: tok.get_normalizer(), regex, bpe })
    }

    /// The ids of `text`, as `tok.encode_fast(text, add_special_tokens)` gives them. `tok` is the
    /// tokenizer this was made from.
    pub fn encode(
        &self,
        tok: &tokenizers::Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> tokenizers::Result<Vec<u32>> {
        let p = self.parts(tok)?;
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        if add_special_tokens {
            out.extend_from_slice(&self.prefix);
        }
        // Room for the words' spans from the start (a word has a few bytes): grown from empty,
        // the list was seven allocations for a 1 KB prompt.
        let (mut buf, mut spans, mut held) =
            (String::new(), Vec::with_capacity(text.len() / 4 + 4), Held::new());
        let mut prev = 0;
        for m in self.added.trie.find_iter(text) {
            if prev != m.start() {
                self.piece(&p, &text[prev..m.start()], &mut out, &mut buf, &mut spans, &mut held)?;
            }
            out.push(self.added.ids[m.pattern().as_usize()]);
            prev = m.end();
        }
        if prev != text.len() {
            self.piece(&p, &text[prev..], &mut out, &mut buf, &mut spans, &mut held)?;
        }
        if add_special_tokens {
            out.extend_from_slice(&self.suffix);
        }
        Ok(out)
    }

    /// A piece between added tokens: normalized, split, each word encoded.
    fn piece<'s>(
        &'s self,
        p: &Parts<'_>,
        text: &str,
        out: &mut Vec<u32>,
        buf: &mut String,
        spans: &mut Vec<(usize, usize)>,
        held: &mut Held<'s>,
    ) -> tokenizers::Result<()> {
        let normalized;
        let text = match p.normalizer {
            Some(n) if !(self.ascii_normal && text.is_ascii()) => {
                let mut s = NormalizedString::from(text);
                // Its error is not looked at, as `tokenizers` does not look at it: the text is
                // what the normalizer made of it either way.
                let _ = n.normalize(&mut s);
                normalized = s.get().to_owned();
                normalized.as_str()
            }
            _ => text,
        };
        let t = text.as_bytes();
        match self.ascii {
            // Each word looked up as it is found: no list of spans, no `str` slicing.
            Some(ascii) if text.is_ascii() => {
                ascii.each_word(t, |start, end| self.word(p, t, start, end, out, buf, held))?;
            }
            _ => {
                spans.clear();
                onig_split(p.regex, text, spans);
                for &(start, end) in spans.iter() {
                    self.word(p, t, start, end, out, buf, held)?;
                }
            }
        }
        Ok(())
    }

    /// One word's ids, `t[start..end]` (whole characters): from the map, or its byte-level form
    /// through the BPE model ([`Self::miss`]). Inlined into the split's loop: a call a word, its
    /// seven arguments and its saved registers, was a fifth of the word's time.
    #[inline(always)]
    #[allow(clippy::too_many_arguments, clippy::inline_always)]
    fn word<'s>(
        &'s self,
        p: &Parts<'_>,
        t: &[u8],
        start: usize,
        end: usize,
        out: &mut Vec<u32>,
        buf: &mut String,
        held: &mut Held<'s>,
    ) -> tokenizers::Result<()> {
        let w = t.get(start..end).ok_or("a word outside its text")?;
        // Every word counts, those found in the lock-free table too: a call whose words are all
        // there would otherwise keep the shards it took for its whole text.
        if held.words >= HOLD_WORDS {
            *held = Held::new();
        }
        held.words += 1;
        let (key, hash) = if w.len() <= PACKED_BYTES {
            let k = Packed::of(t, start, end);
            let hash = k.hash(&self.seeds);
            if self.hot.get(hash, k, out) {
                return Ok(());
            }
            (Key::Packed(k), hash)
        } else {
            (Key::Long(w), self.hasher.hash_one(w))
        };
        // Bits the shard's table does not use for a place (its low bits) nor for its tags (its
        // top seven), so each shard's words spread over all of its places.
        let s = (hash >> 32) as usize % WORD_SHARDS;
        let (Some(guard), Some(shard)) = (held.guards.get_mut(s), self.words.get(s)) else {
            return Err("no such shard".into());
        };
        if guard.is_none() {
            *guard = shard.try_read().ok();
        }
        if let Some(ids) = guard.as_ref().and_then(|words| words.find(hash, key)) {
            if let Key::Packed(k) = key {
                self.hot.put(hash, k, ids);
            }
            for &id in ids {
                out.push(id);
            }
            return Ok(());
        }
        self.miss(p, w, hash, key, shard, out, buf, held)
    }

    /// A word not in the map: its ids from the BPE model, kept when its shard is free.
    #[cold]
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn miss<'s>(
        &'s self,
        p: &Parts<'_>,
        w: &[u8],
        hash: u64,
        key: Key<'_>,
        shard: &RwLock<WordMap>,
        out: &mut Vec<u32>,
        buf: &mut String,
        held: &mut Held<'s>,
    ) -> tokenizers::Result<()> {
        // A miss lets every shard go: the word's BPE takes far longer than taking the locks again,
        // and a shard this call holds keeps other threads' new words out of it.
        *held = Held::new();
        let first = out.len();
        buf.clear();
        buf.extend(w.iter().map(|&b| self.chars[usize::from(b)]));
        out.extend(p.bpe.tokenize(buf)?.iter().map(|t| t.id));
        let ids = out.get(first..).unwrap_or_default();
        if let Key::Packed(k) = key {
            self.hot.put(hash, k, ids);
        }
        if w.len() <= WORD_CACHE_BYTES
            && let Ok(mut words) = shard.try_write()
            // Another call may have put it there since this one looked: then the shard is left
            // as it is (not emptied for a word it has).
            && words.find(hash, key).is_none()
        {
            words.insert(hash, key, ids, self);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    use proptest::prelude::*;

    use super::*;

    fn load(name: &str) -> tokenizers::Tokenizer {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../.cache/tokenizers")
            .join(name)
            .join("tokenizer.json");
        assert!(path.exists(), "{} is missing: run scripts/fetch-tokenizers", path.display());
        tokenizers::Tokenizer::from_file(&path).unwrap()
    }

    /// Llama 3.1's and Qwen3's real tokenizers and a small one of each shape ([`super::super::toy`]),
    /// each with its direct path (checked at load).
    fn real() -> &'static [(&'static str, tokenizers::Tokenizer, Box<Fast>)] {
        use super::super::toy::{Shape, tokenizer};
        static REAL: OnceLock<Vec<(&str, tokenizers::Tokenizer, Box<Fast>)>> = OnceLock::new();
        REAL.get_or_init(|| {
            [
                ("llama3_1", load("llama3_1")),
                ("qwen3", load("qwen3")),
                ("gpt2-shaped", tokenizer(Shape::Gpt2).unwrap()),
                ("qwen3-shaped", tokenizer(Shape::Qwen3).unwrap()),
                ("llama3-shaped", tokenizer(Shape::Llama3).unwrap()),
            ]
            .into_iter()
            .map(|(name, tok)| {
                let fast = Fast::new(&tok).unwrap_or_else(|e| panic!("{name}: {e}"));
                (name, tok, fast)
            })
            .collect()
        })
    }

    fn same(text: &str) -> Result<(), TestCaseError> {
        for (name, tok, fast) in real() {
            for special in [false, true] {
                let want = tok.encode_fast(text, special).unwrap().get_ids().to_vec();
                let got = fast.encode(tok, text, special).unwrap();
                prop_assert_eq!(got, want, "{} {:?} add_special_tokens = {}", name, text, special);
            }
        }
        Ok(())
    }

    /// Pieces that part the two paths if anything does: whitespace of every kind and length,
    /// contractions, digit runs, punctuation, Unicode that normalizes or that Oniguruma classes by
    /// its own tables, and added tokens whole and cut.
    const FRAGMENTS: &[&str] = &[
        "a",
        "Z",
        "the",
        "word",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        "\r",
        "\u{b}",
        "\u{c}",
        "'",
        "'s",
        "'S",
        "'ll",
        "'Re",
        "'d",
        "'m",
        "'ve",
        "'t",
        "1",
        "12",
        "1234",
        "0.5",
        ".",
        "...",
        "!?",
        "-",
        "_",
        "(",
        ")",
        "\"",
        "`",
        "#",
        "@",
        "/",
        "\\",
        "é",
        "e\u{301}",
        "\u{212b}",
        "ß",
        "İ",
        "\u{17f}",
        "\u{212a}",
        "日本",
        "。",
        "🎉",
        "\u{200d}",
        "\u{fe0f}",
        "\u{a0}",
        "\u{2003}",
        "\u{3000}",
        "\u{2028}",
        "\u{85}",
        "ع",
        "٣",
        "Ⅻ",
        "<|",
        "|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<think>",
        "<|start_header_id|>",
        "<tool_call>",
    ];

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

        #[test]
        fn the_ids_are_tokenizers_own_on_text_made_to_part_them(
            parts in prop::collection::vec(prop::sample::select(FRAGMENTS), 0..48)
        ) {
            same(&parts.concat())?;
        }

        #[test]
        fn the_ids_are_tokenizers_own_on_ascii(text in "[ -~\t\n\r\u{b}\u{c}]{0,200}") {
            same(&text)?;
        }

        #[test]
        fn the_ids_are_tokenizers_own_on_any_ascii(text in "[\x00-\x7f]{0,200}") {
            same(&text)?;
        }

        #[test]
        fn the_ids_are_tokenizers_own_on_any_text(text in any::<String>()) {
            same(&text)?;
        }
    }

    /// English and Markdown at length: the repository's README and docs, whole and line by line.
    #[test]
    fn the_ids_are_tokenizers_own_on_the_docs() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        files.push(root.join("README.md"));
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            same(&text).unwrap();
            for line in text.lines().take(200) {
                same(line).unwrap();
            }
        }
    }

    /// The self-check is not vacuous: Llama 3.1's direct path without the look-ahead correction,
    /// or splitting its ASCII with Qwen's pattern (digits one by one), is refused; as is another
    /// tokenizer's.
    #[test]
    fn the_self_check_refuses_a_path_that_differs() {
        let (qwen, llama) = (load("qwen3"), load("llama3_1"));
        let mut fast = Fast::unchecked(&llama).unwrap();
        assert_eq!(fast.self_check(&llama), Ok(()));
        fast.ascii = Some(AsciiSplit::Llama3NoLookAhead);
        assert!(matches!(fast.self_check(&llama), Err(Off::Mismatch(..))), "{:?}", fast.self_check(&llama));
        fast.ascii = AsciiSplit::new(QWEN_PATTERN);
        assert!(matches!(fast.self_check(&llama), Err(Off::Mismatch(..))), "{:?}", fast.self_check(&llama));
        let other = Fast::unchecked(&qwen).unwrap();
        assert!(matches!(other.self_check(&llama), Err(Off::Mismatch(..))));
        assert!(other.encode(&llama, "a", false).is_err(), "a call with another tokenizer is refused");
    }

    /// Eight bytes at a time, each ASCII byte in each place is a letter exactly when the class
    /// table says so, whatever its neighbours (no lane's sum reaches the next); and runs of
    /// letters longer than eight, cut at each place, split as Oniguruma splits them.
    #[test]
    fn letters_eight_at_a_time_are_the_tables() {
        let neighbours = [b'a', b'Z', b'@', b'[', b'`', b'{', 0x7f, 0, b' ', b'9'];
        for b in 0..128u8 {
            for place in 0..8 {
                for &n in &neighbours {
                    let mut w = [n; 8];
                    w[place] = b;
                    let found = letters(u64::from_le_bytes(w)).to_le_bytes();
                    for (i, &x) in w.iter().enumerate() {
                        let letter = CLASSES[usize::from(x)] & LETTER != 0;
                        assert_eq!(found[i] == 0x80, letter, "byte {x:#04x} in place {i} of {w:?}");
                        assert!(found[i] == 0 || found[i] == 0x80, "{w:?}");
                    }
                }
            }
        }
        let long = "Supercalifragilisticexpialidocious";
        for cut in 0..=long.len() {
            for sep in [" ", "'", "1", ".", "\n", "_"] {
                let text = format!(" {}{sep}{}x", &long[..cut], &long[cut..]);
                for pattern in AUDITED_PATTERNS {
                    let (mut ours, mut onig) = (Vec::new(), Vec::new());
                    AsciiSplit::new(pattern).unwrap().split(&text, &mut ours);
                    onig_split(&SysRegex::new(pattern).unwrap(), &text, &mut onig);
                    assert_eq!(ours, onig, "{pattern} on {text:?}");
                }
            }
        }
    }

    /// The written-out split of ASCII is used (not left to Oniguruma) and makes Oniguruma's words.
    #[test]
    fn ascii_is_split_into_onigurumas_words() {
        let text = "Hello  world\n\n  it's 12345 OK'S  (x)...\r\n\t y   ";
        for pattern in AUDITED_PATTERNS {
            let (mut ours, mut onig) = (Vec::new(), Vec::new());
            AsciiSplit::new(pattern).unwrap().split(text, &mut ours);
            onig_split(&SysRegex::new(pattern).unwrap(), text, &mut onig);
            assert_eq!(ours, onig, "{pattern}");
        }
        let mut words = Vec::new();
        AsciiSplit::new(LLAMA3_PATTERN).unwrap().split("a  b   ", &mut words);
        assert_eq!(words, [(0, 1), (1, 2), (2, 4), (4, 7)], "\"a\", \" \", \" b\", \"   \"");
        assert!(AsciiSplit::new(r"\w+|\s+").is_none(), "a pattern not audited is Oniguruma's");
    }

    /// Characters of every class the patterns tell apart, and the ones that lead or end their
    /// alternatives: letters of contractions in both cases, digits, each kind of whitespace, the
    /// apostrophe, punctuation and control characters.
    const SPLIT_ALPHABET: &[u8] = b"asStTmMdDlLrRvVeEx01 \t\n\r\x0b\x0c'.!\x00\x1c\x7f";

    fn same_split(text: &str) -> Result<(), String> {
        for pattern in AUDITED_PATTERNS {
            let (mut ours, mut onig) = (Vec::new(), Vec::new());
            AsciiSplit::new(pattern).ok_or("not audited")?.split(text, &mut ours);
            onig_split(&SysRegex::new(pattern).map_err(|e| e.to_string())?, text, &mut onig);
            if ours != onig {
                return Err(format!("{pattern}: {text:?}: {ours:?} against Oniguruma's {onig:?}"));
            }
        }
        Ok(())
    }

    /// Every string of up to four characters from [`SPLIT_ALPHABET`] is split into Oniguruma's words,
    /// for each pattern.
    #[test]
    fn every_short_ascii_string_is_split_as_oniguruma_splits_it() {
        let regexes: Vec<(AsciiSplit, SysRegex)> = AUDITED_PATTERNS
            .iter()
            .map(|p| (AsciiSplit::new(p).unwrap(), SysRegex::new(p).unwrap()))
            .collect();
        let n = SPLIT_ALPHABET.len();
        let (mut ours, mut onig) = (Vec::new(), Vec::new());
        let mut text = String::new();
        for len in 1..=4u32 {
            for mut k in 0..n.pow(len) {
                text.clear();
                for _ in 0..len {
                    text.push(char::from(SPLIT_ALPHABET[k % n]));
                    k /= n;
                }
                for (split, regex) in &regexes {
                    ours.clear();
                    onig.clear();
                    split.split(&text, &mut ours);
                    onig_split(regex, &text, &mut onig);
                    assert_eq!(ours, onig, "{split:?} {text:?}");
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

        #[test]
        fn ascii_is_split_as_oniguruma_splits_it(text in "[\x00-\x7f]{0,96}") {
            same_split(&text).map_err(TestCaseError::fail)?;
        }

        #[test]
        fn ascii_made_of_the_classes_is_split_as_oniguruma_splits_it(
            text in prop::collection::vec(prop::sample::select(SPLIT_ALPHABET), 0..64)
        ) {
            same_split(&String::from_utf8(text).unwrap()).map_err(TestCaseError::fail)?;
        }
    }

    /// Parts of the shapes the real files do not have: a normalizer that changes ASCII, a
    /// post-processor that puts a token after the text, a `Split` on a string.
    #[test]
    fn other_parts_of_the_shapes_match_too() {
        use super::super::toy::{Shape, tokenizer};
        use tokenizers::normalizers::{Lowercase, NFC, Sequence};
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::processors::template::TemplateProcessing;
        let mut lower = tokenizer(Shape::Qwen3).unwrap();
        lower.with_normalizer(Some(Sequence::new(vec![NFC.into(), Lowercase.into()])));
        let mut suffix = tokenizer(Shape::Llama3).unwrap();
        let ids = ["<|begin_of_text|>", "<|eot_id|>"].map(|t| (t, suffix.token_to_id(t).unwrap()));
        let template = TemplateProcessing::builder()
            .try_single("<|begin_of_text|> $A <|eot_id|>")
            .unwrap()
            .special_tokens(ids.to_vec())
            .build()
            .unwrap();
        suffix.with_post_processor(Some(template));
        let mut string = tokenizer(Shape::Llama3).unwrap();
        let split =
            Split::new(SplitPattern::String(" ".into()), SplitDelimiterBehavior::Isolated, false).unwrap();
        string.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::sequence::Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, false, false).into(),
        ])));
        let texts: Vec<String> = (FRAGMENTS.iter())
            .flat_map(|a| FRAGMENTS.iter().map(move |b| format!("{a}{b} {b}{a}")))
            .chain(
                std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
                    .unwrap()
                    .lines()
                    .map(str::to_owned),
            )
            .collect();
        for (name, tok) in [("lowercase", lower), ("suffix", suffix), ("string split", string)] {
            let fast = Fast::new(&tok).unwrap_or_else(|e| panic!("{name}: {e}"));
            for text in &texts {
                for special in [false, true] {
                    let want = tok.encode_fast(text.as_str(), special).unwrap().get_ids().to_vec();
                    assert_eq!(fast.encode(&tok, text, special).unwrap(), want, "{name} {text:?} {special}");
                }
            }
            match name {
                "lowercase" => assert!(!fast.ascii_normal),
                "suffix" => assert_eq!(fast.suffix.len(), 1),
                _ => assert!(fast.ascii.is_none()),
            }
        }
    }

    #[test]
    fn what_the_post_processors_put_around_the_text() {
        let [(_, _, llama), (_, _, qwen), (_, gpt2_tok, gpt2), ..] = real() else { panic!() };
        assert_eq!((llama.prefix.as_slice(), llama.suffix.as_slice()), (&[128_000][..], &[][..]));
        assert_eq!((qwen.prefix.as_slice(), qwen.suffix.as_slice()), (&[][..], &[][..]));
        assert_eq!(gpt2.prefix, [gpt2_tok.token_to_id("<|begin_of_text|>").unwrap()]);
        for f in [llama, qwen, gpt2].map(|f| &**f) {
            assert!(f.ascii.is_some(), "the pattern is split without Oniguruma");
        }
        assert!(gpt2.gpt2.is_some() && llama.gpt2.is_none());
    }

    #[test]
    fn other_shapes_keep_tokenizers_pipeline() {
        let word_level = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1}, "unk_token": "[UNK]"}}"#;
        let tok: tokenizers::Tokenizer = word_level.parse().unwrap();
        assert_eq!(
            Fast::new(&tok).unwrap_err(),
            Off::Shape("its pre-tokenizer is not a Split then a ByteLevel, or a ByteLevel alone".into())
        );
        let mut qwen = load("qwen3");
        qwen.with_truncation(Some(tokenizers::TruncationParams::default())).unwrap();
        assert_eq!(
            Fast::new(&qwen).unwrap_err(),
            Off::Shape("tokenizer.json sets truncation or padding".into())
        );
    }

    /// A word's packed key is its bytes whether read ahead in its text or copied from its end, and
    /// words that differ only by trailing zero bytes or by one byte anywhere have different keys.
    #[test]
    fn packed_words_are_their_bytes() {
        let text = b"abcdefghijklmnopqrstuvwxyz\0\0";
        let n = text.len();
        for len in 1..=PACKED_BYTES {
            // The same bytes at the text's end (copied) and before 16 more (read ahead).
            let mut t = text[..n - 2].to_vec();
            t.truncate(len);
            let tail = Packed::of(&t, 0, len);
            let ahead = Packed::of(text, 0, len);
            assert!(tail == ahead, "{len}");
            let seeds = [1, 2, 3];
            assert_eq!(tail.hash(&seeds), ahead.hash(&seeds), "{len}");
            for at in 0..len {
                let mut other = t.clone();
                other[at] ^= 1;
                assert!(Packed::of(&other, 0, len) != tail, "{len} {at}");
            }
        }
        // "yz", "yz\0" and "yz\0\0" are three words.
        let keys =
            [Packed::of(text, n - 4, n - 2), Packed::of(text, n - 4, n - 1), Packed::of(text, n - 4, n)];
        assert!(keys[0] != keys[1] && keys[1] != keys[2] && keys[0] != keys[2]);
    }

    #[test]
    fn ids_are_kept_whole() {
        for n in 0..6u32 {
            let ids: Vec<u32> = (0..n).map(|i| 1000 + i).collect();
            assert_eq!(Ids::new(&ids).get(), ids.as_slice());
        }
    }

    /// Words of every length around the packed ones' limit, ending in and mid-text, get
    /// `tokenizers`' ids from the map as from the model.
    #[test]
    fn words_of_every_length_come_back_from_the_map() {
        let [(_, tok, fast), ..] = real() else { panic!() };
        for len in 1..=WORD_CACHE_BYTES + 2 {
            let w: String = "xylophonequartzjumbleflick".chars().cycle().take(len).collect();
            for text in [format!(" {w}"), format!(" {w} tail"), format!("{w},{w}")] {
                let want = tok.encode_fast(text.as_str(), false).unwrap().get_ids().to_vec();
                // Three times: the second from the lock-free table (words of up to 16 bytes and
                // four ids) or the map, the third from the map alone.
                assert_eq!(fast.encode(tok, &text, false).unwrap(), want, "{text:?}");
                assert_eq!(fast.encode(tok, &text, false).unwrap(), want, "{text:?}");
                fast.hot.clear();
                assert_eq!(fast.encode(tok, &text, false).unwrap(), want, "{text:?}");
            }
        }
    }

    /// A shard of the map of words' ids is emptied when full, and ids stay right across it.
    #[test]
    fn the_word_map_is_bounded() {
        let tok = super::super::toy::tokenizer(super::super::toy::Shape::Qwen3).unwrap();
        let fast = Fast::new(&tok).unwrap();
        // Words of letters only (Qwen's pattern cuts digits one by one): base 26.
        let word = |mut i: usize| {
            let mut w = String::from("q");
            while i > 0 {
                w.push(char::from(b'a' + u8::try_from(i % 26).unwrap()));
                i /= 26;
            }
            w
        };
        let n = WORD_CACHE_WORDS * 2;
        for i in 0..n {
            fast.encode(&tok, &word(i), false).unwrap();
        }
        let held: Vec<usize> = fast.words.iter().map(|s| s.read().unwrap().len()).collect();
        assert!(held.iter().all(|&h| h <= WORD_CACHE_WORDS / WORD_SHARDS), "{held:?}");
        assert!(held.iter().sum::<usize>() < WORD_CACHE_WORDS, "shards were emptied: {held:?}");
        for i in [0, 1, 27, n / 2, n - 1] {
            let w = word(i);
            assert_eq!(
                fast.encode(&tok, &w, false).unwrap(),
                tok.encode_fast(w.as_str(), false).unwrap().get_ids()
            );
        }
    }

    /// Threads encoding at once, each holding shards' read locks while others insert their new
    /// words, get `tokenizers`' ids, and the map fills.
    #[test]
    fn threads_encoding_at_once_get_the_same_ids() {
        let [(_, tok, fast), ..] = real() else { panic!() };
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let text = ["README.md", "docs/gateway.md", "docs/routing.md", "docs/dataplane.md"]
            .map(|f| std::fs::read_to_string(root.join(f)).unwrap())
            .concat();
        let lines: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
        std::thread::scope(|scope| {
            for t in 0..4 {
                let lines = &lines;
                scope.spawn(move || {
                    // Each thread its own order, so they meet on new words.
                    for line in lines.iter().skip(t * 97).chain(lines.iter().take(t * 97)).take(600) {
                        let want = tok.encode_fast(*line, false).unwrap().get_ids().to_vec();
                        assert_eq!(fast.encode(tok, line, false).unwrap(), want, "{line:?}");
                    }
                });
            }
        });
        assert!(fast.words.iter().any(|s| !s.read().unwrap().is_empty()), "no word was kept");
    }
}
