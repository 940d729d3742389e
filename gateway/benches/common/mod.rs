//! What the gateway's benches share (`mod common;` in each; a directory, so cargo does not take it
//! for a bench of its own).

// Each bench uses part of this.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

/// The `q` quantile (0..=1) of sorted samples, nearest rank; `None` without samples.
pub(crate) fn percentile(sorted: &[Duration], q: f64) -> Option<Duration> {
    let last = sorted.len().checked_sub(1)?;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let i = ((last as f64) * q).round() as usize;
    sorted.get(i).copied()
}

/// Milliseconds of a percentile; NaN without samples.
pub(crate) fn ms(d: Option<Duration>) -> f64 {
    d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

/// The proxy bench's prompt: `bytes` of one English sentence repeated (the tokenize bench times
/// its ids too).
pub(crate) fn sentence_prompt(bytes: usize) -> String {
    let base = "the quick brown fox jumps over the lazy dog and hands the baton on; ";
    let mut s = base.repeat(bytes / base.len() + 1);
    s.truncate(bytes);
    s
}

/// A loopback port free now (bound and released: another process could take it first, which a
/// bench on its own machine does not meet).
pub(crate) fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free loopback port")
}
