//! Identifiers shared by every layer of the data plane.
//!
//! A request is named by a 128-bit id chosen by the gateway (unique across restarts and replicas) and
//! an epoch: the gateway bumps the epoch when it retries a request, so late messages about an earlier
//! attempt can never be mistaken for the current one.

use std::fmt;

/// A request id, unique across gateway restarts and replicas.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct RequestId(pub u128);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// The attempt number of a request; a retry gets a new epoch.
pub type Epoch = u32;

/// A tensor-parallel rank of an engine.
pub type Rank = u32;

/// A request attempt: what every reservation, write and status names.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct RequestKey {
    pub request: RequestId,
    pub epoch: Epoch,
}

impl RequestKey {
    pub fn new(request: RequestId, epoch: Epoch) -> Self {
        Self { request, epoch }
    }
}

impl fmt::Display for RequestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.request, self.epoch)
    }
}

/// Content key of a filled chunk: a hash of every token id from the start of the prompt to the end of
/// the chunk, so equal keys mean equal KV bytes (for the same model and rank).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct PrefixKey(pub u64);

/// Where a producer may write one chunk: the page and the page's generation when it was reserved.
/// A write naming an older generation is refused, so a late write can never land in a reused page.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct PageAddr {
    pub page: u32,
    pub generation: u32,
}

impl PageAddr {
    /// Not a page: "the page the request's reservation holds for this chunk", resolved by the rank
    /// when the write begins. A producer that reserves for itself on the connection it writes on
    /// sends its chunks right behind the Reserve, before the addresses could come back. No buffer
    /// has `u32::MAX` pages, so no real address is this one.
    pub const BY_CHUNK: PageAddr = PageAddr { page: u32::MAX, generation: u32::MAX };
}
