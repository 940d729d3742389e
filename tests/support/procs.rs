//! The test binaries' child processes (`e2e`, `soak`): one killed when its handle is dropped, and
//! a `baton serve` started with the addresses it printed.

// Each binary uses what it needs of this file.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process, killed (SIGKILL) when dropped.
pub(crate) struct Proc(pub(crate) Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    pub(crate) fn term(&self) {
        self.signal(rustix::process::Signal::TERM);
    }

    pub(crate) fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_child(&self.0);
        rustix::process::kill_process(pid, signal).unwrap();
    }

    /// The exit code within `limit`.
    pub(crate) async fn exit_code(&mut self, limit: Duration) -> i32 {
        let start = Instant::now();
        loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                return s.code().unwrap_or(-1);
            }
            assert!(start.elapsed() < limit, "still running after {limit:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Runs the `baton` binary at `bin` with `args`, its log (stderr) to `stderr`; the process and
/// the public and admin addresses it printed.
pub(crate) fn spawn_baton(bin: &Path, args: &[&str], stderr: Stdio) -> (Proc, SocketAddr, SocketAddr) {
    spawn_baton_then(bin, args, stderr, Stdout::Drained)
}

/// What becomes of a spawned `baton`'s stdout once it has printed its addresses.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stdout {
    /// Read to its end, so the process never blocks on a full pipe.
    Drained,
    /// Closed, and stderr with it when it is piped: every later write to them fails (`EPIPE`),
    /// as when a log shipper goes away.
    Closed,
}

/// [`spawn_baton`], its stdout then `stdout`.
pub(crate) fn spawn_baton_then(
    bin: &Path,
    args: &[&str],
    stderr: Stdio,
    stdout: Stdout,
) -> (Proc, SocketAddr, SocketAddr) {
    spawn_baton_env(bin, args, &[], stderr, stdout)
}

/// [`spawn_baton_then`] with `env` added to its environment.
pub(crate) fn spawn_baton_env(
    bin: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    stderr: Stdio,
    stdout: Stdout,
) -> (Proc, SocketAddr, SocketAddr) {
    let mut child = Command::new(bin)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut proc = Proc(child);
    let (mut public, mut admin) = (None, None);
    while public.is_none() || admin.is_none() {
        let line = lines.next().expect("the binary printed its addresses").unwrap();
        let after = |marker: &str| {
            line.split(marker)
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .map(|a| a.parse::<SocketAddr>().unwrap())
        };
        public = public.or(after("serving on ")).or(after("gateway on http://"));
        admin = admin.or(after("admin (/metrics, /admin/*) on "));
    }
    match stdout {
        Stdout::Drained => drop(std::thread::spawn(move || lines.for_each(drop))),
        Stdout::Closed => {
            drop(lines);
            drop(proc.0.stderr.take());
        }
    }
    (proc, public.unwrap(), admin.unwrap())
}
