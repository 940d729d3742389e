//! The part of ZeroMQ's wire protocol (ZMTP 3.0, RFC 23/ZMTP, NULL security) that today's engines
//! use for PD side channels: PUSH/PULL (LMCache's prefill-done notifications), REQ/REP (LMCache's
//! buffer allocation requests) and SUB (the KV events vLLM and SGLang publish from a PUB socket). It interoperates with libzmq (pyzmq) peers; the test suite checks it
//! against pyzmq itself.
//!
//! What it does not do: other socket types, CURVE/PLAIN security, reconnection (a caller reconnects),
//! or high-water marks beyond the bounded channel a server delivers into. Every read is bounded by
//! `max_message` so a peer cannot make us allocate without limit.
//!
//! Wire summary: a 64-byte greeting each way (signature `FF 00.. 7F`, version 3.0, mechanism
//! `NULL`), then a `READY` command carrying `Socket-Type`, then frames: one flags byte (`MORE` 0x01,
//! `LONG` 0x02, `COMMAND` 0x04) and a 1- or 8-byte big-endian size. A REQ socket puts an empty
//! delimiter frame before its message; a REP socket answers with the same envelope.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// Longest the greeting and READY exchange may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest message a notification listener accepts (a notification is tens of bytes).
pub const DEFAULT_MAX_MESSAGE: usize = 1 << 20;
/// Most peers one listener serves at once; further connections are closed at accept.
pub const DEFAULT_MAX_PEERS: usize = 4096;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ZmtpError {
    /// The socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the ZMTP 3.1 protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The peer's socket type cannot talk to ours (a PUSH to a PUB, say).
    #[error("peer is a {peer} socket; a {me} socket cannot talk to it")]
    Incompatible { me: &'static str, peer: String },
    /// A message is larger than the limit.
    #[error("message of {size} bytes exceeds the limit of {limit}")]
    TooLarge { size: u64, limit: usize },
    /// The greeting and handshake did not finish in time.
    #[error("handshake did not finish within {0:?}")]
    HandshakeTimeout(Duration),
}

fn proto(m: impl Into<String>) -> ZmtpError {
    ZmtpError::Protocol(m.into())
}

/// The socket types spoken here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    Push,
    Pull,
    Req,
    Rep,
    /// Subscribes to a PUB socket: sends subscriptions, receives what matches them.
    Sub,
}

impl SocketType {
    pub fn name(self) -> &'static str {
        match self {
            Self::Push => "PUSH",
            Self::Pull => "PULL",
            Self::Req => "REQ",
            Self::Rep => "REP",
            Self::Sub => "SUB",
        }
    }

    /// Socket types a peer of this type may be (RFC 28, 30).
    fn accepts(self, peer: &str) -> bool {
        match self {
            Self::Push => peer == "PULL",
            Self::Pull => peer == "PUSH",
            Self::Req => peer == "REP" || peer == "ROUTER",
            Self::Rep => peer == "REQ" || peer == "DEALER",
            Self::Sub => peer == "PUB" || peer == "XPUB",
        }
    }
}

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn check_greeting(g: &[u8; 64]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[9] != 0x7F {
        return Err(proto("not a ZMTP peer (bad signature)"));
    }
    if g[10] < 3 {
        return Err(proto(format!("peer speaks ZMTP {}.{}; 3.0 or later is needed", g[10], g[11])));
    }
    let mech = &g[12..32];
    let end = mech.iter().position(|b| *b == 0).unwrap_or(mech.len());
    if &mech[..end] != b"NULL" {
        return Err(proto(format!(
            "peer asks for security mechanism {:?}; only NULL is supported",
            String::from_utf8_lossy(&mech[..end])
        )));
    }
    Ok(())
}

/// `READY` with `Socket-Type`.
fn ready_command(me: SocketType) -> Vec<u8> {
    let name = b"Socket-Type";
    let value = me.name().as_bytes();
    let mut body = Vec::with_capacity(32);
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
    body.extend_from_slice(name);
    body.extend_from_slice(&u32::try_from(value.len()).unwrap_or(u32::MAX).to_be_bytes());
    body.extend_from_slice(value);
    body
}

/// The `Socket-Type` property of a READY command body (after the command name).
fn socket_type_of(mut props: &[u8]) -> Result<String, ZmtpError> {
    while !props.is_empty() {
        let n = *props.first().ok_or_else(|| proto("truncated property"))? as usize;
        let name = props.get(1..1 + n).ok_or_else(|| proto("truncated property name"))?;
        let len_at = 1 + n;
        let len_bytes: [u8; 4] = props
            .get(len_at..len_at + 4)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| proto("truncated property length"))?;
        let len = u32::from_be_bytes(len_bytes) as usize;
        let value =
            props.get(len_at + 4..len_at + 4 + len).ok_or_else(|| proto("truncated property value"))?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return Ok(String::from_utf8_lossy(value).into_owned());
        }
        props = &props[len_at + 4 + len..];
    }
    Err(proto("READY without Socket-Type"))
}

/// One frame read off the wire.
struct RawFrame {
    more: bool,
    command: bool,
    body: Vec<u8>,
}

/// One ZMTP connection after its handshake.
#[derive(Debug)]
pub struct Connection {
    io: BufReader<TcpStream>,
    me: SocketType,
    peer: String,
    max_message: usize,
}

impl Connection {
    /// Connects to `addr` and handshakes as `me`.
    pub async fn connect(addr: SocketAddr, me: SocketType, max_message: usize) -> Result<Self, ZmtpError> {
        let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| ZmtpError::HandshakeTimeout(HANDSHAKE_TIMEOUT))??;
        Self::handshake(stream, me, max_message).await
    }

    /// Greets the peer on an open stream (either side), within [`HANDSHAKE_TIMEOUT`].
    pub async fn handshake(stream: TcpStream, me: SocketType, max_message: usize) -> Result<Self, ZmtpError> {
        let _ = stream.set_nodelay(true);
        let mut c = Self { io: BufReader::new(stream), me, peer: String::new(), max_message };
        tokio::time::timeout(HANDSHAKE_TIMEOUT, c.greet())
            .await
            .map_err(|_| ZmtpError::HandshakeTimeout(HANDSHAKE_TIMEOUT))??;
        Ok(c)
    }

    async fn greet(&mut self) -> Result<(), ZmtpError> {
        // Our whole greeting at once: libzmq sends its signature and waits for ours before the rest.
        self.io.get_mut().write_all(&greeting()).await?;
        let mut g = [0u8; 64];
        self.io.read_exact(&mut g).await?;
        check_greeting(&g)?;
        self.write_frame(&ready_command(self.me), FLAG_COMMAND).await?;
        self.io.get_mut().flush().await?;
        let f = self.read_frame().await?;
        if !f.command {
            return Err(proto("expected READY, got a message"));
        }
        let (name, data) = command_parts(&f.body)?;
        match name {
            b"READY" => {}
            b"ERROR" => {
                let reason = data.get(1..).map(String::from_utf8_lossy).unwrap_or_default();
                return Err(proto(format!("peer refused the handshake: {reason}")));
            }
            other => return Err(proto(format!("expected READY, got {}", String::from_utf8_lossy(other)))),
        }
        let peer = socket_type_of(data)?;
        if !self.me.accepts(&peer) {
            return Err(ZmtpError::Incompatible { me: self.me.name(), peer });
        }
        self.peer = peer;
        Ok(())
    }

    /// The peer's socket type.
    pub fn peer_type(&self) -> &str {
        &self.peer
    }

    async fn write_frame(&mut self, body: &[u8], flags: u8) -> Result<(), ZmtpError> {
        let w = self.io.get_mut();
        match u8::try_from(body.len()) {
            Ok(short) => w.write_all(&[flags, short]).await?,
            Err(_) => {
                w.write_all(&[flags | FLAG_LONG]).await?;
                w.write_all(&(body.len() as u64).to_be_bytes()).await?;
            }
        }
        w.write_all(body).await?;
        Ok(())
    }

    async fn read_frame(&mut self) -> Result<RawFrame, ZmtpError> {
        let flags = self.io.read_u8().await?;
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(proto(format!("reserved frame flags set: {flags:#04x}")));
        }
        let size = if flags & FLAG_LONG != 0 {
            self.io.read_u64().await?
        } else {
            u64::from(self.io.read_u8().await?)
        };
        if size > self.max_message as u64 {
            return Err(ZmtpError::TooLarge { size, limit: self.max_message });
        }
        let mut body = vec![0u8; usize::try_from(size).unwrap_or(usize::MAX)];
        self.io.read_exact(&mut body).await?;
        Ok(RawFrame { more: flags & FLAG_MORE != 0, command: flags & FLAG_COMMAND != 0, body })
    }

    /// Sends one message of `frames` (a REQ socket's delimiter is added here, as libzmq does).
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        let total: usize = frames.iter().map(|f| f.len()).sum();
        if total > self.max_message {
            return Err(ZmtpError::TooLarge { size: total as u64, limit: self.max_message });
        }
        let envelope = matches!(self.me, SocketType::Req | SocketType::Rep);
        if envelope {
            self.write_frame(&[], FLAG_MORE).await?;
        }
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            self.write_frame(f, more).await?;
        }
        self.io.get_mut().flush().await?;
        Ok(())
    }

    /// Receives one message (its frames, without a REQ/REP envelope). PING commands are answered;
    /// other commands are skipped. `Ok(None)` when the peer closed the connection between messages.
    pub async fn recv(&mut self) -> Result<Option<Vec<Vec<u8>>>, ZmtpError> {
        let mut frames: Vec<Vec<u8>> = Vec::new();
        let mut total = 0usize;
        loop {
            let f = match self.read_frame().await {
                Ok(f) => f,
                Err(ZmtpError::Io(e))
                    if e.kind() == std::io::ErrorKind::UnexpectedEof && frames.is_empty() =>
                {
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            if f.command {
                let (name, data) = command_parts(&f.body)?;
                if name == b"PING" {
                    // PING: 2-byte TTL, then up to 16 bytes of context echoed in the PONG.
                    let mut pong = vec![4];
                    pong.extend_from_slice(b"PONG");
                    pong.extend_from_slice(data.get(2..).unwrap_or_default());
                    self.write_frame(&pong, FLAG_COMMAND).await?;
                    self.io.get_mut().flush().await?;
                }
                continue;
            }
            total += f.body.len();
            if total > self.max_message {
                return Err(ZmtpError::TooLarge { size: total as u64, limit: self.max_message });
            }
            frames.push(f.body);
            if !f.more {
                break;
            }
        }
        if matches!(self.me, SocketType::Req | SocketType::Rep) {
            // Strip the envelope up to and including the empty delimiter.
            let Some(at) = frames.iter().position(Vec::is_empty) else {
                return Err(proto("REQ/REP message without an empty delimiter"));
            };
            frames.drain(..=at);
        }
        Ok(Some(frames))
    }

    /// SUB: asks the publisher for the messages whose first frame starts with `prefix` (every
    /// message for an empty prefix). ZMTP 3.0's form, a message of `0x01` and the prefix, which
    /// ZMTP 3.1 publishers (libzmq 4.3) accept as well.
    pub async fn subscribe(&mut self, prefix: &[u8]) -> Result<(), ZmtpError> {
        if self.me != SocketType::Sub {
            return Err(proto(format!("a {} socket cannot subscribe", self.me.name())));
        }
        let mut body = Vec::with_capacity(1 + prefix.len());
        body.push(1);
        body.extend_from_slice(prefix);
        self.send(&[&body]).await
    }

    /// REQ: sends `body` and waits for the one-frame reply.
    pub async fn request(&mut self, body: &[u8]) -> Result<Vec<u8>, ZmtpError> {
        self.send(&[body]).await?;
        let mut reply = self.recv().await?.ok_or_else(|| proto("peer closed before replying"))?;
        if reply.len() != 1 {
            return Err(proto(format!("expected a one-frame reply, got {} frames", reply.len())));
        }
        Ok(reply.swap_remove(0))
    }
}

fn command_parts(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let n = *body.first().ok_or_else(|| proto("empty command"))? as usize;
    let name = body.get(1..1 + n).ok_or_else(|| proto("truncated command name"))?;
    Ok((name, &body[1 + n..]))
}

/// A message delivered by a [`PullServer`], with the connection it came on (each PUSH peer has its
/// own connection, so this tells senders apart even when the messages are identical).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    pub peer: u64,
    pub frames: Vec<Vec<u8>>,
}

/// Counters of a listener.
#[derive(Debug, Default)]
pub struct ListenerStats {
    pub connections: AtomicU64,
    pub rejected: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub messages: AtomicU64,
}

/// A PULL socket bound to a TCP address: accepts PUSH peers and delivers their messages into a
/// bounded channel (a full channel slows the peers down, as a high-water mark would).
#[derive(Debug)]
pub struct PullServer {
    pub addr: SocketAddr,
    pub stats: Arc<ListenerStats>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PullServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

static NEXT_PEER: AtomicU64 = AtomicU64::new(1);

impl PullServer {
    /// Binds `addr` and starts accepting; messages go to `tx` until it is closed or this is dropped.
    pub async fn bind(
        addr: SocketAddr,
        tx: mpsc::Sender<Pulled>,
        max_peers: usize,
        max_message: usize,
    ) -> Result<Self, ZmtpError> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(ListenerStats::default());
        let task = tokio::spawn(pull_loop(listener, tx, max_peers, max_message, Arc::clone(&stats)));
        Ok(Self { addr, stats, task })
    }
}

async fn pull_loop(
    listener: TcpListener,
    tx: mpsc::Sender<Pulled>,
    max_peers: usize,
    max_message: usize,
    stats: Arc<ListenerStats>,
) {
    let mut peers = JoinSet::new();
    loop {
        tokio::select! {
            _ = tx.closed() => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                if peers.len() >= max_peers {
                    stats.rejected.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                stats.connections.fetch_add(1, Ordering::Relaxed);
                let (tx, stats) = (tx.clone(), Arc::clone(&stats));
                peers.spawn(async move {
                    let peer = NEXT_PEER.fetch_add(1, Ordering::Relaxed);
                    let mut c = match Connection::handshake(stream, SocketType::Pull, max_message).await {
                        Ok(c) => c,
                        Err(_) => {
                            stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    };
                    loop {
                        match c.recv().await {
                            Ok(Some(frames)) => {
                                stats.messages.fetch_add(1, Ordering::Relaxed);
                                if tx.send(Pulled { peer, frames }).await.is_err() {
                                    return;
                                }
                            }
                            Ok(None) => return,
                            Err(_) => {
                                stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
                                return;
                            }
                        }
                    }
                });
            }
            Some(_) = peers.join_next(), if !peers.is_empty() => {}
        }
    }
    peers.shutdown().await;
}

/// A REP socket bound to a TCP address: each REQ peer's requests are answered in order by `handler`
/// (one at a time per peer, as REP requires; peers are served concurrently).
#[derive(Debug)]
pub struct RepServer {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RepServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RepServer {
    pub async fn bind<F, Fut>(addr: SocketAddr, max_message: usize, handler: F) -> Result<Self, ZmtpError>
    where
        F: Fn(Vec<u8>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Vec<u8>> + Send + 'static,
    {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let handler = Arc::new(handler);
        let task = tokio::spawn(async move {
            let mut peers = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        };
                        let handler = Arc::clone(&handler);
                        peers.spawn(async move {
                            let Ok(mut c) = Connection::handshake(stream, SocketType::Rep, max_message).await else {
                                return;
                            };
                            while let Ok(Some(mut frames)) = c.recv().await {
                                if frames.len() != 1 {
                                    return;
                                }
                                let reply = handler(frames.swap_remove(0)).await;
                                if c.send(&[&reply]).await.is_err() {
                                    return;
                                }
                            }
                        });
                    }
                    Some(_) = peers.join_next(), if !peers.is_empty() => {}
                }
            }
        });
        Ok(Self { addr, task })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }

    #[tokio::test]
    async fn push_to_pull_tells_peers_apart_and_keeps_frames() {
        let (tx, mut rx) = mpsc::channel(16);
        let server = PullServer::bind(local(), tx, 8, DEFAULT_MAX_MESSAGE).await.unwrap();
        let mut a = Connection::connect(server.addr, SocketType::Push, 1 << 20).await.unwrap();
        let mut b = Connection::connect(server.addr, SocketType::Push, 1 << 20).await.unwrap();
        assert_eq!(a.peer_type(), "PULL");
        a.send(&[b"one"]).await.unwrap();
        b.send(&[b"two", &[7u8; 300]]).await.unwrap();
        a.send(&[b"one"]).await.unwrap();
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap());
        }
        let from_a: Vec<_> = got.iter().filter(|p| p.frames == vec![b"one".to_vec()]).collect();
        assert_eq!(from_a.len(), 2);
        assert_eq!(from_a[0].peer, from_a[1].peer, "one connection, one peer id");
        let from_b = got.iter().find(|p| p.frames.len() == 2).unwrap();
        assert_ne!(from_b.peer, from_a[0].peer);
        assert_eq!(from_b.frames[1], vec![7u8; 300], "a long frame survives");
        assert_eq!(server.stats.messages.load(Ordering::Relaxed), 3);
    }

    #[tokio::test]
    async fn req_rep_round_trip_and_wrong_socket_types_are_refused() {
        let rep = RepServer::bind(local(), 1 << 20, |mut body: Vec<u8>| async move {
            body.reverse();
            body
        })
        .await
        .unwrap();
        let mut req = Connection::connect(rep.addr, SocketType::Req, 1 << 20).await.unwrap();
        assert_eq!(req.request(b"abc").await.unwrap(), b"cba");
        assert_eq!(req.request(b"").await.unwrap(), b"");
        // A PUSH socket may not talk to a REP socket.
        let err = Connection::connect(rep.addr, SocketType::Push, 1 << 20).await.unwrap_err();
        assert!(matches!(err, ZmtpError::Incompatible { .. } | ZmtpError::Io(_)), "{err}");
    }

    #[tokio::test]
    async fn an_oversized_message_closes_the_connection_and_is_counted() {
        let (tx, mut rx) = mpsc::channel(4);
        let server = PullServer::bind(local(), tx, 8, 64).await.unwrap();
        let mut c = Connection::connect(server.addr, SocketType::Push, 1 << 20).await.unwrap();
        c.send(&[&[0u8; 100]]).await.unwrap();
        c.send(&[b"small"]).await.ok();
        assert!(tokio::time::timeout(Duration::from_millis(300), rx.recv()).await.is_err() || rx.is_empty());
        for _ in 0..50 {
            if server.stats.protocol_errors.load(Ordering::Relaxed) == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("oversized message not counted");
    }

    #[tokio::test]
    async fn a_non_zmtp_peer_is_refused() {
        let (tx, _rx) = mpsc::channel(4);
        let server = PullServer::bind(local(), tx, 8, 64).await.unwrap();
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        s.write_all(&[0u8; 64]).await.unwrap();
        for _ in 0..100 {
            if server.stats.protocol_errors.load(Ordering::Relaxed) == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("bad greeting not counted");
    }
}
