//! The real upstream libraries (pyzmq with libzmq 4.3, msgspec) as test peers: `upstream_peer.py`
//! run by the test venv's Python. Shared by the data plane's and the simulator's tests.
//!
//! Without the venv (a first `cargo test` on a fresh clone) the tests that need it skip with one
//! line naming what to run; `scripts/test` builds the venv and sets `BATON_REQUIRE_VENV=1`, so there
//! a missing venv fails instead.

use std::path::PathBuf;

use tokio::process::Command;

/// The venv's Python, when it exists.
#[track_caller]
fn python() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = std::env::var_os("BATON_TEST_PYTHON")
        .map_or_else(|| root.join(".cache/venv/bin/python"), PathBuf::from);
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("BATON_REQUIRE_VENV").is_none(),
        "{} is missing: scripts/test creates it (pyzmq, msgspec)",
        p.display()
    );
    crate::skip::skipped(
        "tool",
        &format!("{} is missing; run scripts/test (it builds the venv with pyzmq and msgspec)", p.display()),
    );
    None
}

/// `upstream_peer.py ARGS…`, or `None` (the test skips) without the venv.
#[track_caller]
pub(crate) fn peer(args: &[&str]) -> Option<Command> {
    let mut c = Command::new(python()?);
    c.arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dataplane/tests/support/upstream_peer.py"))
        .args(args)
        .kill_on_drop(true);
    Some(c)
}

/// A free loopback port.
pub(crate) fn free_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap_or_else(|e| panic!("no free port: {e}"))
}
