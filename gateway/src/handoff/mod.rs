//! How the KV of a request reaches its decoder: one strategy per handoff mode behind the
//! [`Handoff`] trait, and what the modes share (the engines' HTTP client, limits, request ids,
//! the prefill fallback order, drains).
//!
//! The request driver (the `pipeline` module) owns everything common to the modes: parsing, counting,
//! plugin admission, routing, the admission slots' acquisition, phase timing, metrics and the
//! response headers. A mode implements only what differs: how many slots a prompt takes, its
//! legs, how it waits for the KV and what it gives back when a request ends early. Each mode lives
//! in its own module and nothing here names one: adding a mode adds a module.
//!
//! - `native`: baton's data plane (reservations on every decoder rank, readiness events);
//! - `lmcache`: vLLM with LMCache's PD backend (the prefiller pushes, ZMQ notifications);
//! - `nixl`: vLLM's NIXL connector (the decoder pulls; admission from the decoder's metrics);
//! - `sglang`: SGLang's PD (both legs at once, paired by a bootstrap room).

pub mod decoder;
pub mod lmcache;
pub mod native;
pub mod nixl;
pub mod scrape;
pub mod sglang;
pub mod shared;

pub use decoder::{BoxFuture, Decoder, Handoff, Leg};
pub use shared::{
    BoxError, DEFAULT_LEASE, DEFAULT_READY_TIMEOUT, DEFAULT_RELEASE_TIMEOUT, DEFAULT_UPSTREAM_TIMEOUT,
    Drains, KeyGen, Limits, Prefiller, RespBody, Shared,
};
