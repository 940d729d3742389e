//! The simulated engines over loopback: 1P1D and 2P2D, TP 1 and 2, concurrent requests sharing
//! prefixes, byte-exact delivery, clean buffers afterwards, and the fault cases.

// Test code: panicking on a broken expectation is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation,
    unreachable_pub
)]

mod flows;
mod harness;
mod scenarios;
mod sglang;
#[path = "../../../tests/support/skip.rs"]
mod skip;
#[path = "../../../dataplane/tests/support/upstream.rs"]
mod upstream;
