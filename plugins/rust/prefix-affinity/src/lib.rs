//! Routing by prefix affinity: requests whose prompts start alike go to the same decoder. With
//! `baton:policy@0.2.0`, when the gateway knows where the prompt is cached (`cached-tokens`), that
//! is the decoder holding the most of it, and the prefiller holding the most of it (ties: fewest in
//! flight). Otherwise, or where nothing is cached, the decoder is picked by rendezvous hashing of
//! the `prefix-hash` over the healthy decoders that can hold the request, so the choice moves as
//! little as possible when decoders come and go, and the prefiller is the one with the fewest
//! requests in flight. When the affine decoder has no room now (fewer free slots than needed plus
//! `min_free_slots`, or a queue), the freest decoder serves instead.
//!
//! Built with the `wit-0-1` feature it is a component for the frozen `baton:policy@0.1.0`, which
//! has no `cached-tokens` (the gateway's tests check that such plugins still run).

use std::cell::Cell;

use serde::Deserialize;

#[cfg(not(feature = "wit-0-1"))]
wit_bindgen::generate!({ world: "routing", path: "../../../wit" });
#[cfg(feature = "wit-0-1")]
wit_bindgen::generate!({ world: "routing", path: "../../../wit/0.1.0" });

/// The tokens of the prompt each prefiller and each decoder holds (empty when not known).
#[cfg(not(feature = "wit-0-1"))]
fn cached(p: &PrefillView, d: &DecodeView) -> (Vec<u32>, Vec<u32>) {
    (p.cached_tokens.clone(), d.cached_tokens.clone())
}

/// 0.1.0 tells nothing of caches.
#[cfg(feature = "wit-0-1")]
fn cached(_: &PrefillView, _: &DecodeView) -> (Vec<u32>, Vec<u32>) {
    (Vec::new(), Vec::new())
}

use baton::policy::host;
use baton::policy::types::Request;
use exports::baton::policy::routing_policy::{Decision, DecodeView, Guest, Pair, PrefillView};

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct Config {
    /// Slots to keep free on the affine decoder before spilling to the freest one.
    min_free_slots: u32,
}

fn parse(json: &str) -> Result<Config, String> {
    serde_json::from_str(json).map_err(|e| format!("prefix-affinity config: {e}"))
}

thread_local! {
    static MIN_FREE: Cell<Option<u32>> = const { Cell::new(None) };
}

fn min_free() -> u32 {
    MIN_FREE.with(|m| {
        *m.get().get_or_insert_with(|| parse(&host::config()).map(|c| c.min_free_slots).unwrap_or(0))
    })
}

/// A 32-bit mix of the prefix and the endpoint index (murmur3's finaliser).
fn score(prefix: u32, endpoint: u32) -> u32 {
    let mut h = prefix ^ endpoint.wrapping_mul(0x9e37_79b9);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

fn at(v: &[u32], i: usize) -> u32 {
    v.get(i).copied().unwrap_or(0)
}

struct Policy;

impl Guest for Policy {
    fn validate_config(config: String) -> Result<(), String> {
        parse(&config).map(|_| ())
    }

    fn route(req: Request, p: PrefillView, d: DecodeView) -> Decision {
        let (p_cached, d_cached) = cached(&p, &d);
        let prefill = (0..p.healthy.len())
            .filter(|&i| p.healthy[i])
            .min_by_key(|&i| (u32::MAX - at(&p_cached, i), at(&p.in_flight, i)));
        let fits = |i: &usize| d.healthy[*i] && at(&d.slots_needed, *i) <= at(&d.capacity_slots, *i);
        let candidates: Vec<usize> = (0..d.healthy.len()).filter(fits).collect();
        let (Some(prefill), false) = (prefill, candidates.is_empty()) else {
            return Decision::UseDefault;
        };
        let idx = |i: usize| u32::try_from(i).unwrap_or(u32::MAX);
        let holds =
            candidates.iter().copied().filter(|&i| at(&d_cached, i) > 0).max_by_key(|&i| at(&d_cached, i));
        let affine =
            holds.or_else(|| candidates.iter().copied().max_by_key(|&i| (score(req.prefix_hash, idx(i)), i)));
        let freest = candidates
            .iter()
            .copied()
            .min_by_key(|&i| (at(&d.waiting_slots, i), u32::MAX - at(&d.free_slots, i), i));
        let roomy = |i: usize| {
            at(&d.waiting_slots, i) == 0
                && at(&d.free_slots, i) >= at(&d.slots_needed, i).saturating_add(min_free())
        };
        let mut order: Vec<usize> = Vec::with_capacity(2);
        for i in [affine.filter(|&i| roomy(i)), freest, affine].into_iter().flatten() {
            if !order.contains(&i) {
                order.push(i);
            }
        }
        Decision::Pairs(order.into_iter().map(|i| Pair { prefill: idx(prefill), decode: idx(i) }).collect())
    }
}

export!(Policy);
