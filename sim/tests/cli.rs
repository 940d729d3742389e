//! The `baton-sim` binary's flags, run for real: `--help` succeeds and names every flag that
//! scripts and docs use, bad flags are refused with exit status 2 before anything starts, and each
//! protocol turns on with any of its flags (what the hand-written parser did before clap).
//!
//! Running the debug binary also runs clap's own consistency checks on the flag definitions
//! (`Command::debug_assert`), which clap does on every parse in debug builds.

// Test code: panicking on a broken expectation is the point.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};

use serde_json::{Value, json};

const SIM: &str = env!("CARGO_BIN_EXE_baton-sim");

/// Every flag the binary has had; removing or renaming one breaks an invocation somewhere.
const FLAGS: &[&str] = &[
    "--role",
    "--listen",
    "--model",
    "--tp",
    "--geometry",
    "--chunk-tokens",
    "--pages",
    "--cache-blocks",
    "--block-size",
    "--token-delay-us",
    "--dp-host",
    "--dp-port",
    "--quarantine-ms",
    "--hold-ttl-ms",
    "--faults",
    "--lmcache",
    "--lmcache-buffer",
    "--lmcache-alloc-ports",
    "--lmcache-init-ports",
    "--lmcache-proxy",
    "--lmcache-async",
    "--nixl",
    "--nixl-abort-timeout-s",
    "--sglang",
    "--sglang-bootstrap-port",
    "--sglang-room-wait-ms",
    "--device",
    "--dp-tls-ca",
    "--dp-tls-cert",
    "--dp-tls-key",
    "--dp-tls-server-name",
    "--neutral",
];

fn run(args: &[&str]) -> Output {
    Command::new(SIM).args(args).output().unwrap()
}

#[test]
fn help_exits_zero_and_describes_every_flag() {
    // `-h` is clap's one-line-per-flag summary: each flag's line must carry a description.
    let out = run(&["-h"]);
    assert!(out.status.success(), "-h exited {:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in FLAGS {
        let line = help
            .lines()
            .find(|l| l.split_whitespace().next() == Some(*flag))
            .unwrap_or_else(|| panic!("{flag} is missing from -h:\n{help}"));
        // The flag, its value name if any, then at least one word of description.
        let described = line.split_whitespace().filter(|w| !w.starts_with(['-', '<'])).count();
        assert!(described > 0, "{flag} has no description: {line:?}");
    }

    let out = run(&["--help"]);
    assert!(out.status.success(), "--help exited {:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in FLAGS {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(&format!("{flag} ")) || l.trim() == *flag),
            "{flag} is missing from --help"
        );
    }
    assert!(help.contains("prefill") && help.contains("decode"), "--role's values are not listed:\n{help}");
}

#[test]
fn bad_flags_exit_2_and_name_the_flag() {
    // (case, arguments, a piece of the error)
    let cases: &[(&str, &[&str], &str)] = &[
        ("no role", &[], "--role"),
        ("unknown role", &["--role", "middle"], "possible values: prefill, decode"),
        ("not a number", &["--role", "decode", "--tp", "two"], "--tp"),
        ("unknown flag", &["--role", "decode", "--pagez", "8"], "--pagez"),
        ("zero block size", &["--role", "decode", "--block-size", "0"], "--block-size"),
        ("zero cache blocks", &["--role", "decode", "--cache-blocks", "0"], "--cache-blocks"),
        ("bad port list", &["--role", "decode", "--lmcache-alloc-ports", "9000,x"], "not a port list"),
        ("bad device", &["--role", "decode", "--device", "tpu"], "not cpu or cuda"),
        ("bad faults", &["--role", "decode", "--faults", "{\"nope\":1}"], "--faults"),
        ("tls ca alone", &["--role", "decode", "--dp-tls-ca", "ca.pem"], "--dp-tls-cert"),
        ("tls without key", &["--role", "decode", "--dp-tls-ca", "a", "--dp-tls-cert", "b"], "--dp-tls-key"),
        (
            "missing geometry file",
            &["--role", "decode", "--geometry", "/nonexistent/config.json"],
            "--geometry",
        ),
    ];
    for (case, args, needle) in cases {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{case}: exit status {:?}, stderr: {err}", out.status);
        assert!(err.contains(needle), "{case}: {needle:?} not in stderr: {err}");
        assert!(out.stdout.is_empty(), "{case}: the engine started");
    }
}

/// A started engine, killed when the test ends however it ends.
struct Engine(Child);

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the engine and returns its hello line (its stats and HTTP address).
fn hello(args: &[&str]) -> (Engine, Value) {
    let mut child = Command::new(SIM)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let engine = Engine(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let v = serde_json::from_str(&line).unwrap_or_else(|e| panic!("hello line {line:?} for {args:?}: {e}"));
    (engine, v)
}

#[test]
fn flags_reach_the_engine_and_any_protocol_flag_turns_it_on() {
    let (_plain, v) = hello(&["--role", "prefill"]);
    assert_eq!(v["role"], "prefill");
    assert_eq!(v["model"], "baton-sim");
    assert_eq!(v["tp"], 1);
    for p in ["lmcache", "nixl", "sglang"] {
        assert_eq!(v[p], Value::Null, "{p} is on without its flags");
    }

    // Only a value flag of each protocol, never the bare switch.
    let (_dec, v) = hello(&[
        "--role",
        "decode",
        "--tp",
        "2",
        "--pages",
        "8",
        "--model",
        "m",
        "--lmcache-buffer",
        "65536",
        "--nixl-abort-timeout-s",
        "7",
        "--sglang-room-wait-ms",
        "50",
    ]);
    assert_eq!(v["role"], "decode");
    assert_eq!(v["model"], "m");
    assert_eq!(v["chunk_tokens"], 16);
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    assert!(ranks.iter().all(|r| r["pages_total"] == 8), "{ranks:?}");
    // 65536 bytes of 2048-byte pages (the tiny model at TP 2, 16-token chunks).
    assert_eq!(v["page_bytes"], 2048);
    let lmcache = v["lmcache"]["ranks"].as_array().unwrap();
    assert!(lmcache.iter().all(|r| r["capacity_chunks"] == 32), "{lmcache:?}");
    assert_eq!(v["nixl"], json!({"consumer": true}));
    assert_eq!(v["sglang"]["rooms_held"], 0);

    let (_pre, v) = hello(&[
        "--role",
        "prefill",
        "--lmcache-async",
        "--nixl",
        "--sglang-bootstrap-port",
        "0",
        "--neutral",
    ]);
    assert_eq!(v["lmcache"], json!({"notifications_sent": 0}));
    assert_eq!(v["nixl"]["blocks_held"], 0);
    assert!(v["sglang"]["bootstrap"].is_string(), "{v}");
}
