//! Deterministic tokens and KV bytes, so every byte a decoder receives can be verified.
//!
//! Token ids are the prompt's UTF-8 bytes (byte-level, so never more tokens than bytes, the bound the
//! gateway uses when a model has no tokenizer). The KV of token `t` on layer `l`, K or V, head `h` of
//! rank `r` is derived from a hash of every token id up to and including `t` (as in a real model, the
//! same prefix gives the same KV), `l`, K/V, `r` and `h`.

use std::sync::atomic::{AtomicBool, Ordering};

use baton_dataplane::device::{CacheLayout, Device, DeviceError};
use baton_dataplane::geometry::KvGeometry;

/// Neutral engines (`baton-sim --neutral`; the proxy benchmark's): no KV is derived, gathered,
/// checked or scattered into the engines' caches,
/// pages move as zeros. Process-wide, so set it only in a process of its own.
static NEUTRAL: AtomicBool = AtomicBool::new(false);

/// Makes every engine in this process neutral: the KV bytes are not derived from the tokens (pages
/// stay zero) and a decoder does not check them; where the gateway takes no part in moving the KV
/// (vLLM NIXL's and SGLang's pulls, LMCache's chunk writes) nothing moves at all, only what the
/// gateway sees is said (LMCache's notifications). An engine then costs what its protocol with the
/// gateway costs. For measuring what sits in front of the engines, never for testing them.
pub fn set_neutral(on: bool) {
    NEUTRAL.store(on, Ordering::Relaxed);
}

/// Whether this process's engines are neutral ([`set_neutral`]).
pub fn neutral() -> bool {
    NEUTRAL.load(Ordering::Relaxed)
}

/// Words the simulated model speaks; output token `i` of a request is one of them.
const WORDS: [&str; 32] = [
    " the",
    " baton",
    " passes",
    " between",
    " prefill",
    " and",
    " decode",
    " ranks",
    " without",
    " losing",
    " a",
    " single",
    " page",
    " of",
    " cache",
    " while",
    " queues",
    " stay",
    " fair",
    " under",
    " load",
    " so",
    " every",
    " request",
    " finishes",
    " on",
    " time",
    " with",
    " its",
    " tokens",
    " intact",
    ".",
];

/// The simulated model's chat template: the gateway's fallback one.
pub use baton_dataplane::contract::fallback_chat as render_chat;

/// Byte-level token ids of a text.
pub fn tokenize(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// FNV-1a offset basis: the hash of the empty prefix.
const PREFIX_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// Extends a prefix hash by one token id.
fn extend(mut h: u64, id: u32) -> u64 {
    for b in id.to_le_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// `h[t]` = hash of token ids `0..=t`.
pub fn prefix_hashes(ids: &[u32]) -> Vec<u64> {
    let mut h = PREFIX_BASIS;
    ids.iter()
        .map(|id| {
            h = extend(h, *id);
            h
        })
        .collect()
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The bytes of one head of one token (K or V) on one layer and rank.
pub fn head_bytes(prefix: u64, layer: u32, kv: u32, rank: u32, head: u32, out: &mut [u8]) {
    let mut s =
        mix(prefix
            ^ mix(u64::from(layer) << 40 | u64::from(kv) << 32 | u64::from(rank) << 16 | u64::from(head)));
    for chunk in out.chunks_mut(8) {
        s = mix(s);
        let b = s.to_le_bytes();
        chunk.copy_from_slice(b.get(..chunk.len()).unwrap_or_default());
    }
}

/// Writes the KV of every token of a request into an engine's paged cache (one tensor per layer).
///
/// Each block's K (or V) is laid out on the host and written with one copy; the slots past the
/// prompt in its last block are read first and written back as they were. On a GPU a copy is a
/// driver call and a stream wait, so a copy per head per token would cost a request thousands.
pub fn write_kv<D: Device>(
    dev: &D,
    cache: &[D::Tensor],
    layout: &CacheLayout,
    block_table: &[u32],
    hashes: &[u64],
    rank: u32,
) -> Result<(), DeviceError> {
    if neutral() {
        return Ok(());
    }
    let bs = layout.block_size as usize;
    let block_bytes = bs * layout.heads as usize * layout.head_bytes();
    let mut image = vec![0u8; block_bytes];
    for (layer, tensor) in cache.iter().enumerate() {
        let layer = u32::try_from(layer).unwrap_or(u32::MAX);
        for (b, tokens) in hashes.chunks(bs).enumerate() {
            let block = *block_table
                .get(b)
                .ok_or_else(|| DeviceError::Layout(format!("block table too short for token {}", b * bs)))?;
            for kv in 0..2 {
                let base = layout.offset(kv, block, 0, 0);
                if tokens.len() < bs {
                    dev.read_tensor(tensor, base, &mut image)?;
                }
                for (slot, prefix) in tokens.iter().enumerate() {
                    let slot = u32::try_from(slot).unwrap_or(0);
                    for head in 0..layout.heads {
                        let at = layout.offset(kv, block, slot, head) - base;
                        let out = image.get_mut(at..at + layout.head_bytes()).ok_or_else(|| {
                            DeviceError::Layout("a block's heads are not contiguous".into())
                        })?;
                        head_bytes(*prefix, layer, kv, rank, head, out);
                    }
                }
                dev.write_tensor(tensor, base, &image)?;
            }
        }
    }
    Ok(())
}

/// Checks a received chunk page byte for byte against what the prefix must produce. Only the
/// chunk's valid tokens are compared (the last chunk of a prompt may be partial).
pub fn verify_chunk(
    g: &KvGeometry,
    rank: u32,
    hashes: &[u64],
    chunk: u32,
    page: &[u8],
) -> Result<(), String> {
    if neutral() {
        return Ok(());
    }
    let cl = g.chunk_layout();
    let first = chunk as usize * cl.chunk_tokens as usize;
    let valid = hashes.len().saturating_sub(first).min(cl.chunk_tokens as usize);
    let n = cl.head_bytes();
    let mut want = vec![0u8; n];
    for layer in 0..cl.layers {
        for kv in 0..2 {
            for t in 0..valid {
                let prefix = hashes.get(first + t).copied().unwrap_or(0);
                let t32 = u32::try_from(t).unwrap_or(u32::MAX);
                for head in 0..cl.heads {
                    head_bytes(prefix, layer, kv, rank, head, &mut want);
                    let at = cl.offset(layer, kv, t32) + head as usize * n;
                    if page.get(at..at + n) != Some(&want[..]) {
                        return Err(format!(
                            "kv mismatch on rank {rank}, chunk {chunk}, layer {layer}, {}, token {}, head {head}",
                            if kv == 0 { "K" } else { "V" },
                            first + t
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The first `n` output tokens of a request (ids and texts), generated autoregressively: each token
/// depends on the whole sequence before it, so a decoder given the prompt plus the first token (the
/// prefiller's, with first token from prefill) continues exactly where a single engine would.
pub fn output_tokens(ids: &[u32], n: u32) -> Vec<(u32, &'static str)> {
    choice_tokens(ids, n, 0)
}

/// The first `n` output tokens of choice `choice` of a request that asks for several (`n` in the
/// API): choice 0 is [`output_tokens`], each other one a sequence of its own.
pub fn choice_tokens(ids: &[u32], n: u32, choice: u32) -> Vec<(u32, &'static str)> {
    let mut h = ids.iter().fold(PREFIX_BASIS, |h, id| extend(h, *id));
    if choice > 0 {
        h = extend(h, u32::MAX - choice);
    }
    (0..n)
        .map(|_| {
            let w = usize::try_from(mix(h) % WORDS.len() as u64).unwrap_or(0);
            let id = u32::try_from(w).unwrap_or(0);
            h = extend(h, id);
            (id, WORDS.get(w).copied().unwrap_or("."))
        })
        .collect()
}

/// The whole output text of `n` tokens.
pub fn output_text(ids: &[u32], n: u32) -> String {
    output_tokens(ids, n).into_iter().map(|(_, t)| t).collect()
}

/// The whole output text of `n` tokens of choice `choice`.
pub fn choice_text(ids: &[u32], n: u32, choice: u32) -> String {
    choice_tokens(ids, n, choice).into_iter().map(|(_, t)| t).collect()
}

/// The log-probability the simulated model gives token `id` at output position `pos`: a fixed
/// function of both, so a test can check every value it receives.
pub fn token_logprob(id: u32, pos: u32) -> f64 {
    let x = mix(u64::from(id) << 32 | u64::from(pos)) % 4000;
    -((x as f64) / 1000.0) - 0.001
}

/// The `k` most likely tokens at a position whose sampled token is `id`: the sampled one first,
/// then other words, each less likely than the one before.
pub fn top_tokens(id: u32, pos: u32, k: u32) -> Vec<(&'static str, f64)> {
    let lp = token_logprob(id, pos);
    (0..k)
        .map(|j| {
            let w = (id as usize + j as usize) % WORDS.len();
            (WORDS.get(w).copied().unwrap_or("."), lp - f64::from(j))
        })
        .collect()
}

/// A chunk page as a prefiller rank produces it: the KV of the chunk's valid tokens in chunk layout,
/// zeros after a partial chunk's last token.
pub fn chunk_page(g: &KvGeometry, rank: u32, hashes: &[u64], chunk: u32) -> Vec<u8> {
    let cl = g.chunk_layout();
    let mut page = vec![0u8; cl.page_bytes()];
    if neutral() {
        return page;
    }
    let first = chunk as usize * cl.chunk_tokens as usize;
    let valid = hashes.len().saturating_sub(first).min(cl.chunk_tokens as usize);
    let n = cl.head_bytes();
    for layer in 0..cl.layers {
        for kv in 0..2 {
            for t in 0..valid {
                let prefix = hashes.get(first + t).copied().unwrap_or(0);
                for head in 0..cl.heads {
                    let at = cl.offset(layer, kv, u32::try_from(t).unwrap_or(u32::MAX)) + head as usize * n;
                    if let Some(out) = page.get_mut(at..at + n) {
                        head_bytes(prefix, layer, kv, rank, head, out);
                    }
                }
            }
        }
    }
    page
}
