//! baton's PD data plane, embedded by engine ranks.
//!
//! It owns one rank's paged PD buffer ([`buffer::RankBuffer`]): all-or-nothing reservations with
//! lease deadlines, chunk writes checked against page generations, a typestate lifecycle whose every
//! resource is a guard released in `Drop`, shared prefix chunks as counted handles, a deadline-ordered
//! reaper, per-rank terminal statuses and the readiness aggregator the gateway uses. Bytes move through
//! the [`device::Device`] trait (CPU reference, shared memory; CUDA in its own module). [`wire`] and
//! [`transport`] carry it over TCP (TLS optional); [`contract`] types the `baton` field engines read.
//! The simulated engine that embeds it is the `baton-sim` crate.
//!
//! It never knows about HTTP, the gateway or any engine's scheduler.

pub mod buffer;
pub mod clock;
pub mod compat;
pub mod contract;
pub mod device;
pub mod events;
pub mod geometry;
pub mod ids;
pub mod readiness;
mod table;
pub mod transport;
pub mod wire;

pub use buffer::{
    BeginWrite, BufferOptions, BufferStats, Consuming, NotReady, PageWriter, RankBuffer, Ready, Reservation,
    ReserveRequest, SharedChunk, WriteOutcome,
};
pub use clock::{Clock, ManualClock, SystemClock};
pub use events::{EventSink, PagesReleased, QueueSink, RankEvent, RankStatus, ReleaseReason, TerminalState};
pub use geometry::{ChunkLayout, KvGeometry};
pub use ids::{Epoch, PageAddr, PrefixKey, Rank, RequestId, RequestKey};
pub use table::{Counts, InvariantError, LeaseError, PageState, ReserveError, WriteError};
