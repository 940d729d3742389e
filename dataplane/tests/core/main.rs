//! The data plane's integration tests, one binary (linking is slow on small machines).

// Test code: panicking on a broken expectation is the point.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::cast_possible_truncation)]

mod common;
mod compat;
mod device_cpu;
#[cfg(feature = "cuda")]
mod device_cuda;
mod failure_classes;
mod models;
mod properties;
#[path = "../../../tests/support/skip.rs"]
mod skip;
mod tls;
mod transport;
#[path = "../support/upstream.rs"]
mod upstream;
