//! The real upstream libraries (pyzmq with libzmq 4.3, msgspec) as test peers: `upstream_peer.py`
//! run by the test venv's Python. Shared by the data plane's and the simulator's tests.
//!
//! Without the venv (a first `cargo test` on a fresh clone) the tests that need it skip with one
//! line naming what to run; `scripts/test` builds the venv and sets `BATON_REQUIRE_VENV=1`, so there
//! a missing venv fails instead.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

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

/// Spawns a peer that binds (`pull`, `pub`, `proxy` on 127.0.0.1) with its stdin and stdout piped,
/// and reads its first line, `bound PORT`: the child, the address its socket is bound on (a port the
/// OS picked, so no other test can take it first) and the rest of its output.
pub(crate) async fn spawn_bound(cmd: &mut Command) -> (Child, SocketAddr, Lines<BufReader<ChildStdout>>) {
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next_line().await.unwrap().unwrap_or_default();
    let Some(port) = first.strip_prefix("bound ").and_then(|p| p.parse::<u16>().ok()) else {
        // Its traceback, where the caller piped its stderr.
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = tokio::io::AsyncReadExt::read_to_string(&mut e, &mut err).await;
        }
        panic!("the peer printed {first:?}, not `bound PORT`; its stderr: {err}");
    };
    (child, SocketAddr::from(([127, 0, 0, 1], port)), lines)
}
