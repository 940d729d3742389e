//! Ports for the servers the test binaries start, and restart, on loopback (`e2e`, `soak`, `vllm`).
//!
//! A port picked by binding port 0 and releasing it is an ephemeral one, which any socket that
//! connects, or binds port 0, may take before the server binds it: the tests' own clients and
//! engines do so all the time, and so do vLLM's ZeroMQ and UCX sockets while it starts (one CI run
//! lost such a race: the NIXL handshake listener found its port taken, its thread died and the
//! server hung). A port outside the kernel's ephemeral range (`ip_local_port_range`) is never
//! handed out by the kernel, so only another process choosing the same number can take it: each
//! process walks a sequence of its own (from its id and the clock, never the same port twice),
//! and each port is checked free before it is returned: over TCP on 127.0.0.1 and on every
//! address (vLLM's publishers bind `tcp://*`), and over UDP (dnsmasq takes both).

// Each binary uses what it needs of this file.
#![allow(dead_code)]

use std::net::{Ipv4Addr, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicU32, Ordering};

/// A loopback port free now, outside the ephemeral range.
pub(crate) fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `n` consecutive loopback ports free now, outside the ephemeral range (for a
/// server that binds `port`, `port + 1`, …).
pub(crate) fn free_ports(n: u16) -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = n.max(1);
    let (low, high) = ephemeral_range();
    // Ports below 10,000 are left to services a machine may run.
    let (from, to) = if low > 12_000 {
        (10_000, u32::from(low))
    } else if high < 60_000 {
        (u32::from(high) + 1, 65_536)
    } else {
        // No room outside the ephemeral range: any free ports, as the kernel gives them.
        return kernel_ports(n);
    };
    let span = to - from - u32::from(n - 1);
    let clock =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let base = std::process::id().wrapping_mul(7919) ^ clock;
    for _ in 0..span {
        let next = NEXT.fetch_add(u32::from(n), Ordering::Relaxed);
        let Ok(port) = u16::try_from(from + base.wrapping_add(next) % span) else { continue };
        if (0..n).all(|k| free(port + k)) {
            return port;
        }
    }
    panic!("no {n} consecutive free ports in {from}..{to}");
}

/// The kernel's ephemeral port range (Linux's default where it cannot be read).
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| {
            let mut it = r.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999))
}

/// Whether `port` can be bound now: TCP on loopback and on every address, and UDP.
fn free(port: u16) -> bool {
    // Each socket is closed before the next is bound (a closure's temporaries end with it).
    let tcp = |ip: Ipv4Addr| TcpListener::bind((ip, port)).is_ok();
    tcp(Ipv4Addr::LOCALHOST)
        && tcp(Ipv4Addr::UNSPECIFIED)
        && UdpSocket::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// `n` consecutive ports from the kernel's ephemeral ones (which others may take first).
fn kernel_ports(n: u16) -> u16 {
    loop {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).and_then(|l| l.local_addr()).map(|a| a.port());
        if let Ok(port) = port
            && u32::from(port) + u32::from(n) <= 65_536
            && (0..n).all(|k| free(port + k))
        {
            return port;
        }
    }
}
