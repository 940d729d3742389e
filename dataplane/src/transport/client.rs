//! Clients of a decoder rank's server: control (the gateway), producer (a prefiller rank) and events.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;

use super::{BoxConn, DEFAULT_REQUEST_TIMEOUT, DEFAULT_SEGMENT_BYTES, FrameIo, TlsClient, TransportError};
use crate::events::RankEvent;
use crate::ids::{PageAddr, PrefixKey, RequestKey};
use crate::wire::{ChunkHead, Frame, Hello, RefusalCode, Role};

/// What a rank said when the connection was accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    pub rank: u32,
    pub ranks: u32,
    pub pages_total: u32,
    pub page_bytes: u64,
    /// Where a same-host producer may write pages directly (empty when the rank does not export).
    pub export: String,
    /// The engine waits for a request's KV itself when the decode request says `kv_wait_ms`.
    pub decode_waits: bool,
}

async fn connect(
    addr: SocketAddr,
    tls: Option<&TlsClient>,
    role: Role,
    geometry: u64,
    rank: u32,
) -> Result<(FrameIo<BoxConn>, Welcome), TransportError> {
    let stream = tokio::time::timeout(DEFAULT_REQUEST_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| TransportError::Timeout(DEFAULT_REQUEST_TIMEOUT))??;
    stream.set_nodelay(true)?;
    let conn: BoxConn = match tls {
        None => Box::new(stream),
        Some(t) => {
            let (connector, name) = t.connector();
            let s = tokio::time::timeout(DEFAULT_REQUEST_TIMEOUT, connector.connect(name, stream))
                .await
                .map_err(|_| TransportError::Timeout(DEFAULT_REQUEST_TIMEOUT))?
                .map_err(|e| TransportError::Tls(e.to_string()))?;
            Box::new(s)
        }
    };
    let mut io = FrameIo::new(conn);
    io.write(&Frame::Hello(Hello { role, geometry, rank })).await?;
    match answer(&mut io, DEFAULT_REQUEST_TIMEOUT).await? {
        Frame::Welcome { rank, ranks, pages_total, page_bytes, export, decode_waits, .. } => {
            Ok((io, Welcome { rank, ranks, pages_total, page_bytes, export, decode_waits }))
        }
        other => Err(TransportError::Unexpected(format!("{other:?} instead of welcome"))),
    }
}

/// The next frame, with connection-level errors and refusals turned into errors.
async fn answer(io: &mut FrameIo<BoxConn>, within: Duration) -> Result<Frame, TransportError> {
    match tokio::time::timeout(within, io.read()).await {
        Err(_) => Err(TransportError::Timeout(within)),
        Ok(Err(e)) => Err(e),
        Ok(Ok(None)) => Err(TransportError::Closed),
        Ok(Ok(Some(Frame::Error { code, message }))) => Err(TransportError::Remote { code, message }),
        Ok(Ok(Some(Frame::Refused { code, need, have, message, .. }))) => {
            Err(TransportError::Refused { code, need, have, message })
        }
        Ok(Ok(Some(f))) => Ok(f),
    }
}

/// The gateway's control connection to one decoder rank.
#[derive(Debug)]
pub struct ControlClient {
    io: FrameIo<BoxConn>,
    pub welcome: Welcome,
    /// The rank's address this connection went to (a name's current one, when the rank is named).
    pub peer: SocketAddr,
}

/// A rank's buffer as reported by `Info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: u32,
    pub ranks: u32,
    pub pages_total: u32,
    pub pages_free: u32,
    pub page_bytes: u64,
}

impl ControlClient {
    pub async fn connect(addr: SocketAddr, geometry: u64, rank: u32) -> Result<Self, TransportError> {
        Self::connect_with(addr, None, geometry, rank).await
    }

    /// Connects over TLS when `tls` is given (with this peer's certificate for mTLS).
    pub async fn connect_with(
        addr: SocketAddr,
        tls: Option<&TlsClient>,
        geometry: u64,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let (io, welcome) = connect(addr, tls, Role::Control, geometry, rank).await?;
        Ok(Self { io, welcome, peer: addr })
    }

    async fn call(&mut self, f: &Frame) -> Result<Frame, TransportError> {
        self.io.write(f).await?;
        answer(&mut self.io, DEFAULT_REQUEST_TIMEOUT).await
    }

    pub async fn info(&mut self) -> Result<RankInfo, TransportError> {
        match self.call(&Frame::Info).await? {
            Frame::InfoReply { rank, ranks, pages_total, pages_free, page_bytes, .. } => {
                Ok(RankInfo { rank, ranks, pages_total, pages_free, page_bytes })
            }
            other => Err(TransportError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Reserves every page of a request; the write addresses of the chunks to send come back.
    /// Capacity refusals come back as [`TransportError::Refused`] with `need` and `have`.
    pub async fn reserve(
        &mut self,
        key: RequestKey,
        chunks: u32,
        lease: Duration,
        prefixes: &[PrefixKey],
    ) -> Result<Vec<(u32, PageAddr)>, TransportError> {
        let lease_ms = u32::try_from(lease.as_millis()).unwrap_or(u32::MAX);
        let f = Frame::Reserve { key, chunks, lease_ms, prefixes: prefixes.to_vec() };
        match self.call(&f).await? {
            Frame::Reserved { key: k, addrs } if k == key => Ok(addrs),
            other => Err(TransportError::Unexpected(format!("{other:?}"))),
        }
    }

    pub async fn renew(&mut self, key: RequestKey, lease: Duration) -> Result<(), TransportError> {
        let lease_ms = u32::try_from(lease.as_millis()).unwrap_or(u32::MAX);
        self.done(&Frame::Renew { key, lease_ms }, key).await
    }

    /// Cancels a reservation (idempotent). Pages a producer may still be writing stay quarantined
    /// until it fences or the quarantine deadline passes.
    pub async fn cancel(&mut self, key: RequestKey) -> Result<(), TransportError> {
        self.done(&Frame::Cancel { key, unsent: false, report: false }, key).await
    }

    /// Cancels a reservation whose write addresses were never given to any producer: its pages come
    /// back at once.
    pub async fn cancel_unsent(&mut self, key: RequestKey) -> Result<(), TransportError> {
        self.done(&Frame::Cancel { key, unsent: true, report: false }, key).await
    }

    /// Cancels `key` and says whether this rank held a reservation of it (a release of its pages
    /// follows on the event feed) or not (nothing follows; the key is refused from now on). For a
    /// producer that reserves for itself ([`ProducerClient::queue_reserve`]), which may never have
    /// reached this rank. `unsent`: as [`ControlClient::cancel_unsent`].
    pub async fn cancel_held(&mut self, key: RequestKey, unsent: bool) -> Result<bool, TransportError> {
        match self.call(&Frame::Cancel { key, unsent, report: true }).await {
            Ok(Frame::Done { key: k }) if k == key => Ok(true),
            Err(TransportError::Refused { code: RefusalCode::Closed, .. }) => Ok(false),
            Ok(other) => Err(TransportError::Unexpected(format!("{other:?}"))),
            Err(e) => Err(e),
        }
    }

    async fn done(&mut self, f: &Frame, key: RequestKey) -> Result<(), TransportError> {
        match self.call(f).await? {
            Frame::Done { key: k } if k == key => Ok(()),
            other => Err(TransportError::Unexpected(format!("{other:?}"))),
        }
    }
}

/// Chunks a producer sends before it waits for the oldest one's answer: enough to cover a round
/// trip at the data plane's chunk sizes, few enough that the rank's answers never fill its socket
/// while the producer is still writing.
pub const PIPELINE_WINDOW: usize = 16;

/// A frame sent on a producer connection whose answer is still to be read.
#[derive(Clone, Copy, Debug)]
enum Pending {
    Chunk(RequestKey, u32),
    Reserve(RequestKey),
}

/// A prefiller rank's connection to one decoder rank: writes chunks, fences, and reserves when the
/// prefiller reserves for itself ([`ProducerClient::queue_reserve`]).
///
/// Chunks may be pipelined ([`ProducerClient::send_chunk`], then [`ProducerClient::finish`]): the
/// rank answers each in order, and a request's chunks and its fence cost one round trip instead of
/// one each.
#[derive(Debug)]
pub struct ProducerClient {
    io: FrameIo<BoxConn>,
    pub welcome: Welcome,
    segment: usize,
    /// The rank's export, mapped: chunks are copied into it instead of sent over the socket.
    shm: Option<crate::device::shm::ShmWriter>,
    /// Chunks sent whose answers are not read yet, oldest first.
    unanswered: VecDeque<Pending>,
    /// Of the chunks answered since the last [`ProducerClient::finish`], those already there.
    duplicates: u32,
}

impl ProducerClient {
    pub async fn connect(addr: SocketAddr, geometry: u64, rank: u32) -> Result<Self, TransportError> {
        Self::connect_with(addr, None, geometry, rank).await
    }

    /// Connects over TLS when `tls` is given (with this peer's certificate for mTLS).
    pub async fn connect_with(
        addr: SocketAddr,
        tls: Option<&TlsClient>,
        geometry: u64,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let (io, welcome) = connect(addr, tls, Role::Producer, geometry, rank).await?;
        Ok(Self {
            io,
            welcome,
            segment: DEFAULT_SEGMENT_BYTES,
            shm: None,
            unanswered: VecDeque::new(),
            duplicates: 0,
        })
    }

    /// Sets the segment size (bytes per frame) for chunk writes.
    pub fn with_segment(mut self, bytes: usize) -> Self {
        self.segment = bytes.clamp(1, crate::wire::MAX_DATA_FRAME);
        self
    }

    /// Writes chunks through the rank's shared-memory export from now on (same host only). Fails,
    /// leaving the socket path in use, when the rank exports nothing or the export cannot be opened
    /// (another host, another user).
    pub fn use_shared_memory(&mut self) -> Result<(), TransportError> {
        if self.welcome.export.is_empty() {
            return Err(TransportError::Unexpected("the rank does not export its buffer".into()));
        }
        let w = crate::device::shm::ShmWriter::open(&self.welcome.export)
            .map_err(|e| TransportError::Unexpected(e.to_string()))?;
        self.shm = Some(w);
        Ok(())
    }

    /// Whether chunks go through shared memory.
    pub fn is_shared_memory(&self) -> bool {
        self.shm.is_some()
    }

    async fn write_chunk_shm(
        &mut self,
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
        bytes: &[u8],
    ) -> Result<bool, TransportError> {
        self.io.write(&Frame::Grant { key, chunk, addr }).await?;
        let offset = match answer(&mut self.io, DEFAULT_REQUEST_TIMEOUT).await? {
            Frame::Granted { key: k, chunk: c, offset } if k == key && c == chunk => offset,
            Frame::ChunkAck { key: k, chunk: c, duplicate } if k == key && c == chunk => {
                return Ok(duplicate);
            }
            other => return Err(TransportError::Unexpected(format!("{other:?}"))),
        };
        if let Some(w) = &self.shm {
            // One memcpy into the rank's buffer.
            if let Err(e) = w.write_at(offset, bytes) {
                return Err(TransportError::Unexpected(format!("shared-memory write: {e}")));
            }
        }
        self.io.write(&Frame::Written { key, chunk }).await?;
        match answer(&mut self.io, DEFAULT_REQUEST_TIMEOUT).await? {
            Frame::ChunkAck { key: k, chunk: c, duplicate } if k == key && c == chunk => Ok(duplicate),
            other => Err(TransportError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Writes a whole chunk and waits for the rank's answer: `Ok(true)` when it was already there.
    pub async fn write_chunk(
        &mut self,
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
        bytes: &[u8],
    ) -> Result<bool, TransportError> {
        self.send_chunk(key, chunk, addr, bytes).await?;
        Ok(self.finish(None).await? > 0)
    }

    /// Sends a whole chunk without waiting for the rank's answer, which [`ProducerClient::finish`]
    /// reads (or this call, for the oldest, once [`PIPELINE_WINDOW`] are unanswered). A refusal of
    /// any chunk comes back as that call's error; the connection is then in the middle of
    /// answers and must be dropped, not reused.
    pub async fn send_chunk(
        &mut self,
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
        bytes: &[u8],
    ) -> Result<(), TransportError> {
        self.queue_chunk(key, chunk, addr, bytes).await?;
        self.io.flush().await
    }

    /// Writes `chunks` of `key` pipelined, then (with `fence`) its fence, and waits for every
    /// answer: the number of chunks already there. Small chunks (a model with little KV per
    /// chunk) share writes, the fence with them: a small request's whole transfer is one write
    /// each way. For chunks a producer has at hand together; one computed after another goes with
    /// [`ProducerClient::send_chunk`] (sent at once) or [`ProducerClient::queue_chunk`]. Every
    /// chunk's size is checked before any is sent. A refusal is the call's error, and the
    /// connection must then be dropped, as after [`ProducerClient::send_chunk`] (and as after
    /// this call's future is dropped before it ended).
    pub async fn write_chunks(
        &mut self,
        key: RequestKey,
        chunks: &[(u32, PageAddr, &[u8])],
        fence: bool,
    ) -> Result<u32, TransportError> {
        for &(_, _, bytes) in chunks {
            self.check_size(bytes)?;
        }
        for &(chunk, addr, bytes) in chunks {
            self.queue_chunk(key, chunk, addr, bytes).await?;
        }
        self.finish(fence.then_some(key)).await
    }

    fn check_size(&self, bytes: &[u8]) -> Result<(), TransportError> {
        if bytes.len() as u64 == self.welcome.page_bytes {
            return Ok(());
        }
        Err(TransportError::Refused {
            code: RefusalCode::BadRequest,
            need: 0,
            have: 0,
            message: format!("chunk of {} bytes, pages are {}", bytes.len(), self.welcome.page_bytes),
        })
    }

    /// A chunk that leaves with the next one sent, with [`ProducerClient::flush`] or
    /// [`ProducerClient::finish`], or as soon as 64 KiB are queued (a large chunk leaves at once):
    /// small chunks computed one after another share writes. Nothing queued leaves by itself: a
    /// producer that waits between chunks (for its next layer, say) flushes first.
    pub async fn queue_chunk(
        &mut self,
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
        bytes: &[u8],
    ) -> Result<(), TransportError> {
        self.check_size(bytes)?;
        if self.shm.is_some() {
            // Granted, copied, then committed: each step waits for the rank, so nothing pipelines
            // (a Reserve still unanswered is answered first).
            while !self.unanswered.is_empty() {
                self.read_ack().await?;
            }
            let duplicate = self.write_chunk_shm(key, chunk, addr, bytes).await?;
            self.duplicates += u32::from(duplicate);
            return Ok(());
        }
        if self.unanswered.len() >= PIPELINE_WINDOW {
            // The window is full: what is queued leaves, then the answers already here are read
            // (at least the oldest), so the next chunks are queued together again.
            self.read_ack().await?;
            while self.io.has_input() && !self.unanswered.is_empty() {
                self.read_ack().await?;
            }
        }
        let mut offset = 0usize;
        for seg in bytes.chunks(self.segment) {
            let head = ChunkHead { key, chunk, addr, offset: offset as u64, len: seg.len() };
            self.io.queue_chunk(&head, seg).await?;
            offset += seg.len();
        }
        self.unanswered.push_back(Pending::Chunk(key, chunk));
        Ok(())
    }

    /// Reserves `chunks` pages for `key` on this rank (all or nothing, leased for `lease`), for a
    /// producer that reserves for itself instead of being given the addresses: the Reserve
    /// leaves with the chunks queued after it, which name their page by chunk
    /// ([`PageAddr::BY_CHUNK`]), so reserving and writing take one round trip. Its answer is read
    /// with theirs; a refusal (`Busy`: no room now; `Closed`: the key was cancelled, or fenced
    /// before its Reserve came) is the error of the call that reads it ([`ProducerClient::finish`]
    /// or a later `queue_chunk`), after which the connection is not used again. The chunks behind
    /// a refused Reserve find no reservation and are refused too, except after `Duplicate` (the
    /// key is already reserved here), where they are written into that reservation.
    pub fn queue_reserve(&mut self, key: RequestKey, chunks: u32, lease: Duration) {
        let lease_ms = u32::try_from(lease.as_millis()).unwrap_or(u32::MAX);
        self.io.queue(&Frame::Reserve { key, chunks, lease_ms, prefixes: Vec::new() });
        self.unanswered.push_back(Pending::Reserve(key));
    }

    /// Sends every chunk [`ProducerClient::queue_chunk`] left queued.
    pub async fn flush(&mut self) -> Result<(), TransportError> {
        self.io.flush().await
    }

    /// The oldest unanswered chunk's (or Reserve's) answer.
    async fn read_ack(&mut self) -> Result<(), TransportError> {
        let Some(pending) = self.unanswered.pop_front() else { return Ok(()) };
        // What it waits for may still be queued.
        self.io.flush().await?;
        match (pending, answer(&mut self.io, DEFAULT_REQUEST_TIMEOUT).await?) {
            (Pending::Chunk(key, chunk), Frame::ChunkAck { key: k, chunk: c, duplicate })
                if k == key && c == chunk =>
            {
                self.duplicates += u32::from(duplicate);
                Ok(())
            }
            (Pending::Reserve(key), Frame::Reserved { key: k, .. }) if k == key => Ok(()),
            (Pending::Chunk(_, chunk), other) => {
                Err(TransportError::Unexpected(format!("{other:?} instead of chunk {chunk}'s answer")))
            }
            (Pending::Reserve(key), other) => {
                Err(TransportError::Unexpected(format!("{other:?} instead of {key}'s reservation")))
            }
        }
    }

    /// Reads the answer of every chunk sent; with `fence`, fences that request in the same round
    /// trip (after its chunks: see [`ProducerClient::fence`]). Returns how many chunks answered
    /// since the last call were already there.
    pub async fn finish(&mut self, fence: Option<RequestKey>) -> Result<u32, TransportError> {
        if let Some(key) = fence {
            self.io.write(&Frame::Fence { key }).await?;
        }
        while !self.unanswered.is_empty() {
            self.read_ack().await?;
        }
        if let Some(key) = fence {
            self.fenced(key).await?;
        }
        Ok(std::mem::take(&mut self.duplicates))
    }

    /// Tells the rank nothing more will be written for `key` (after a cancel, its quarantined pages
    /// come back at once).
    pub async fn fence(&mut self, key: RequestKey) -> Result<(), TransportError> {
        self.finish(Some(key)).await.map(drop)
    }

    async fn fenced(&mut self, key: RequestKey) -> Result<(), TransportError> {
        match answer(&mut self.io, DEFAULT_REQUEST_TIMEOUT).await? {
            Frame::Done { key: k } if k == key => Ok(()),
            other => Err(TransportError::Unexpected(format!("{other:?}"))),
        }
    }
}

/// A subscription to one rank's statuses and releases.
#[derive(Debug)]
pub struct EventStream {
    io: FrameIo<BoxConn>,
    pub welcome: Welcome,
}

impl EventStream {
    pub async fn connect(addr: SocketAddr, geometry: u64, rank: u32) -> Result<Self, TransportError> {
        Self::connect_with(addr, None, geometry, rank).await
    }

    /// Connects over TLS when `tls` is given (with this peer's certificate for mTLS).
    pub async fn connect_with(
        addr: SocketAddr,
        tls: Option<&TlsClient>,
        geometry: u64,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let (io, welcome) = connect(addr, tls, Role::Events, geometry, rank).await?;
        Ok(Self { io, welcome })
    }

    /// The next event; `None` when the rank closed the feed.
    pub async fn next(&mut self) -> Result<Option<RankEvent>, TransportError> {
        match self.io.read().await? {
            None => Ok(None),
            Some(Frame::Event(e)) => Ok(Some(e)),
            Some(Frame::Error { code, message }) => Err(TransportError::Remote { code, message }),
            Some(other) => Err(TransportError::Unexpected(format!("{other:?}"))),
        }
    }
}
