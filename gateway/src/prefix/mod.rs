//! Where a request's prefix already sits in KV cache: the gateway's own block keys, an index of
//! which engine holds which block, and the feeds that keep it true.
//!
//! - [`block_keys`] cuts a request's token ids into blocks of the engine's block size and gives
//!   each block a key chained over every token before it, so equal keys mean equal prefixes. The
//!   keys are the gateway's own (xxh3, seeded only by the LoRA adapter), so nothing depends on an
//!   engine's hash function or its `PYTHONHASHSEED`: an engine's own hash is kept only to resolve
//!   its `BlockRemoved` events and the parents of its `BlockStored` ones.
//! - [`PrefixIndex`] holds, per block key, which engines hold it and on which medium; *exact*
//!   entries come from engine KV events ([`feed`]), *approximate* ones from what the gateway routed
//!   there, with a time to live, for engines whose events are not configured or not arriving.
//! - [`PrefixIndex::cached_tokens`] answers, for each engine, the longest run of consecutive blocks from
//!   the start of the prompt that it holds: the tokens its prefill would not compute again.

pub mod feed;
mod index;

pub use index::{Applied, Counts, EngineState, PrefixIndex, PromptKeys};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A block's key: its tokens and every token before it, hashed.
pub type BlockKey = u64;

/// The chain's start for requests without a LoRA adapter (any fixed value would do; this one
/// keeps key 0 from being a first block's).
const ROOT: u64 = 0x6261_746f_6e2d_6b76;

/// The chain's start for blocks of one LoRA adapter, by its name or id (`None`: the base model).
pub fn root(adapter: Option<&[u8]>) -> u64 {
    match adapter {
        None => ROOT,
        Some(a) => xxh3_64_with_seed(a, ROOT),
    }
}

/// What a block's parent key becomes when the engine hashed more than tokens into the block
/// (multimodal inputs, a cache salt): a chain no text-only prompt reaches.
pub fn salted(parent: u64) -> u64 {
    xxh3_64_with_seed(b"extra_keys", parent)
}

/// The key of the block of `tokens` that follows the block keyed `parent`.
pub fn chain(parent: u64, tokens: &[u32]) -> BlockKey {
    let mut bytes = [0u8; 4 * 64];
    if tokens.len() <= 64 {
        for (b, t) in bytes.chunks_exact_mut(4).zip(tokens) {
            b.copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64_with_seed(bytes.get(..4 * tokens.len()).unwrap_or_default(), parent);
    }
    let owned: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64_with_seed(&owned, parent)
}

/// Appends the keys of every full block of `ids` for the base model (a partial last block is
/// never cached by an engine, so it has no key) to `out`.
pub fn block_keys(ids: &[u32], block_size: u32, out: &mut Vec<BlockKey>) {
    let Ok(bs) = usize::try_from(block_size) else { return };
    if bs == 0 {
        return;
    }
    let mut parent = root(None);
    out.reserve(ids.len() / bs);
    for block in ids.chunks_exact(bs) {
        parent = chain(parent, block);
        out.push(parent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_keys_mean_equal_prefixes() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999;
        let (mut ka, mut kb) = (Vec::new(), Vec::new());
        block_keys(&a, 16, &mut ka);
        block_keys(&b, 16, &mut kb);
        assert_eq!(ka.len(), 4);
        assert_eq!(ka[..2], kb[..2], "blocks before the change keep their keys");
        assert_ne!(ka[2], kb[2]);
        assert_ne!(ka[3], kb[3], "a change reaches every later block through the chain");
        let mut partial = Vec::new();
        block_keys(&a[..63], 16, &mut partial);
        assert_eq!(partial, ka[..3], "a partial last block has no key");
        assert_ne!(chain(root(Some(b"sql")), &a[..16]), ka[0], "an adapter's blocks are its own");
        assert_ne!(chain(salted(root(None)), &a[..16]), ka[0], "so are blocks with extra keys");
        let mut long = Vec::new();
        let big: Vec<u32> = (0..256).collect();
        block_keys(&big, 128, &mut long);
        assert_eq!(long.len(), 2);
        assert_eq!(long[0], chain(root(None), &big[..128]));
    }
}
