//! Token ids reused across requests, one segment of a rendered chat at a time.
//!
//! A multi-turn conversation sends its whole history again at every turn, and exact cache-aware
//! routing needs the token ids of all of it before the request is routed. Tokenizing costs
//! 0.05–0.11 µs a token on the direct path ([`super::fast`]; 0.5–1.0 through `tokenizers`'
//! pipeline; `bench/README.md`, "Tokenization"), so a 32k-token chat would pay 1.6–3.6 ms at each turn
//! for text the gateway has tokenized before.
//!
//! Why it is exact: a HuggingFace tokenizer (one without a position-dependent pre-tokenizer, below) first splits its input at its added tokens (`<|eot_id|>`,
//! `<|im_end|>`, …: one Aho-Corasick pass, leftmost-longest, over the tokens that are not
//! normalized), then normalizes, pre-tokenizes and encodes each piece between them on its own.
//! Nothing crosses an added token. So a rendered chat cut right after each added token the
//! tokenizer would match there encodes, piece by piece, to the same ids as it does whole: the
//! pieces are the messages' texts between the template's special tokens, and a conversation's
//! earlier messages are pieces the gateway has seen. Each piece's ids are kept in a bounded cache
//! (moka, weighed in tokens) under a 128-bit hash of its text.
//!
//! What would break it, and is refused at load (reuse is then off, and the whole text encoded):
//! tokens that strip the whitespace on their right or must stand as a word (their match depends on
//! what follows the cut), a tokenizer that encodes special tokens as text, truncation or padding
//! configured in `tokenizer.json`. A self-check at load also compares both ways on probes built
//! from the tokenizer's own added tokens: it turns reuse off for a pre-tokenizer that treats the
//! text's first piece apart (Metaspace with `prepend_scheme = "first"`, SentencePiece conversions),
//! where each piece would be taken for a first one. `gateway/tests/e2e.rs` (`real_tokenizers`)
//! compares both ways on real chats for Llama 3.1 and Qwen3; `baton check-config` and the start
//! say when reuse is off, and why.
//!
//! Only chats (`add_special_tokens = false`: the template writes them) are cut; a completion's
//! prompt is encoded whole.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::AhoCorasick;
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// The cache's default bound, in token ids (4 bytes each, plus moka's per-entry overhead).
pub const DEFAULT_CAPACITY_TOKENS: u64 = 4 << 20;

/// An entry's overhead in the cache's weight, in token ids (4 bytes each).
const ENTRY_OVERHEAD: u32 = 24;

/// Where to cut a rendered chat, and the ids of the pieces seen before.
pub struct Reuse {
    /// Every added token the tokenizer matches before normalizing, as its own trie has them.
    trie: AhoCorasick,
    cache: moka::sync::Cache<u128, Arc<[u32]>>,
    /// The pieces' hash seed, random per process: xxh3 is not collision-resistant, and a client
    /// must not be able to make its piece's key another's.
    seed: u64,
    /// Prompt tokens whose ids came from the cache, and tokens encoded.
    pub reused: AtomicU64,
    pub encoded: AtomicU64,
}

impl std::fmt::Debug for Reuse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reuse")
            .field("patterns", &self.trie.patterns_len())
            .field("reused", &self.reused)
            .field("encoded", &self.encoded)
            .finish_non_exhaustive()
    }
}

/// Why reuse is off for a tokenizer.
#[derive(Debug, PartialEq, Eq)]
pub enum Off {
    /// It has no added tokens to cut at.
    NoAddedTokens,
    /// An added token whose match depends on the text after it (`rstrip`, `single_word`).
    Token(String),
    /// It encodes special tokens as text.
    EncodesSpecialTokens,
    /// `tokenizer.json` sets truncation or padding.
    TruncationOrPadding,
    /// The self-check found a text encoded differently in pieces.
    Mismatch(String),
}

impl std::fmt::Display for Off {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoAddedTokens => f.write_str("the tokenizer has no added tokens"),
            Self::Token(t) => {
                write!(f, "the added token {t:?} strips the whitespace after it or must be a word")
            }
            Self::EncodesSpecialTokens => f.write_str("the tokenizer encodes special tokens as text"),
            Self::TruncationOrPadding => f.write_str("tokenizer.json sets truncation or padding"),
            Self::Mismatch(t) => write!(f, "the self-check encoded {t:?} differently in pieces"),
        }
    }
}

impl Reuse {
    /// Reuse for `tok`, checked; `capacity` bounds the cache in token ids.
    pub fn new(tok: &tokenizers::Tokenizer, capacity: u64) -> Result<Self, Off> {
        if tok.get_encode_special_tokens() {
            return Err(Off::EncodesSpecialTokens);
        }
        if tok.get_truncation().is_some() || tok.get_padding().is_some() {
            return Err(Off::TruncationOrPadding);
        }
        let super::fast::Added { trie, tokens: added, .. } =
            super::fast::Added::of(tok).map_err(Off::Mismatch)?;
        if added.is_empty() {
            return Err(Off::NoAddedTokens);
        }
        if let Some(t) = added.iter().find(|t| t.rstrip || t.single_word) {
            return Err(Off::Token(t.content.clone()));
        }
        let cache = moka::sync::Cache::builder()
            .max_capacity(capacity)
            // An entry's ids plus its overhead (key, `Arc`, moka's node: ~100 bytes, as many as
            // 24 ids), so many tiny pieces cannot hold more memory than the bound says.
            .weigher(|_, ids: &Arc<[u32]>| {
                u32::try_from(ids.len()).unwrap_or(u32::MAX).saturating_add(ENTRY_OVERHEAD)
            })
            .build();
        let seed = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u64);
        let reuse = Self { trie, cache, seed, reused: AtomicU64::new(0), encoded: AtomicU64::new(0) };
        reuse.self_check(tok, &added)?;
        Ok(reuse)
    }

    /// Compares piecewise and whole encodings on texts made of the tokenizer's added tokens, with
    /// whitespace, words and punctuation on either side of them. The cache is left empty.
    fn self_check(&self, tok: &tokenizers::Tokenizer, added: &[tokenizers::AddedToken]) -> Result<(), Off> {
        let specials: Vec<&str> = added.iter().map(|t| t.content.as_str()).take(64).collect();
        let around = ["", " ", "  ", "\n", "\n\n", " x", "x", "héllo, wörld! ", "\t42 ", "'s"];
        let mut probes = Vec::new();
        for (i, s) in specials.iter().enumerate() {
            let next = specials.get((i + 1) % specials.len()).copied().unwrap_or_default();
            for a in around {
                for b in around {
                    probes.push(format!("{a}{s}{b}{next}{a}user{s}{b}"));
                }
            }
            probes.push(format!("{s}{s}"));
            // Half a token (cut at a character: a token may hold `▁` or `｜`), then the token.
            let half: String = s.chars().take(s.chars().count() / 2).collect();
            probes.push(format!("{half}{s}"));
        }
        for p in &probes {
            let whole = tok.encode_fast(p.as_str(), false).map(|e| e.get_ids().to_vec());
            let pieces = self
                .pieces(p)
                .map(|piece| tok.encode_fast(piece, false).map(|e| e.get_ids().to_vec()))
                .try_fold(Vec::new(), |mut all, ids| {
                    all.extend(ids?);
                    Ok::<_, tokenizers::Error>(all)
                });
            match (whole, pieces) {
                (Ok(w), Ok(p)) if w == p => {}
                _ => return Err(Off::Mismatch(p.clone())),
            }
        }
        Ok(())
    }

    /// The text cut right after each added token the tokenizer matches (the last piece may end
    /// without one). Never yields an empty piece.
    fn pieces<'t>(&self, text: &'t str) -> impl Iterator<Item = &'t str> + 't {
        let mut cuts: Vec<usize> = self.trie.find_iter(text).map(|m| m.end()).collect();
        if cuts.last() != Some(&text.len()) {
            cuts.push(text.len());
        }
        let mut start = 0;
        cuts.into_iter().filter_map(move |end| {
            let piece = text.get(start..end).filter(|p| !p.is_empty());
            start = end;
            piece
        })
    }

    /// The ids of a rendered chat (`add_special_tokens = false`), piece by piece; `encode` gives a
    /// piece's ids the cache does not hold.
    pub fn encode<E>(&self, text: &str, encode: impl Fn(&str) -> Result<Vec<u32>, E>) -> Result<Vec<u32>, E> {
        let mut ids = Vec::new();
        let (mut reused, mut encoded) = (0, 0);
        // Every piece is looked up, the short ones too (a role's header, `<|im_start|>`): the
        // same few recur in every chat, and a lookup costs less than a tokenizer call.
        for piece in self.pieces(text) {
            let key = xxh3_128_with_seed(piece.as_bytes(), self.seed);
            if let Some(hit) = self.cache.get(&key) {
                reused += hit.len();
                ids.extend_from_slice(&hit);
                continue;
            }
            let e = encode(piece)?;
            encoded += e.len();
            ids.extend_from_slice(&e);
            self.cache.insert(key, Arc::from(e));
        }
        self.reused.fetch_add(reused as u64, Ordering::Relaxed);
        self.encoded.fetch_add(encoded as u64, Ordering::Relaxed);
        Ok(ids)
    }

    /// Token ids the cache holds now (moka's weighted size, updated lazily).
    pub fn cached_tokens(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.weighted_size()
    }
}
