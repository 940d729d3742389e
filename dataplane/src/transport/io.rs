//! Reading and writing frames on a byte stream.
//!
//! Chunk payloads are never buffered whole: a sender writes the chunk's head and then the caller's
//! bytes; a receiver gets the head ([`FrameIo::read_head`]) and streams the payload through
//! [`FrameIo::read_payload`] in socket-sized pieces.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::TransportError;
use crate::wire::{ChunkHead, Decoded, DecodedHead, Frame, decode, decode_head, encode, encode_chunk_head};

/// Largest piece of a chunk payload read from the socket at once.
const PAYLOAD_PIECE: usize = 1 << 20;

/// Largest chunk payload copied behind its head to leave in one write (a copy this size costs
/// less than the second system call and segment it saves).
const COALESCE_PAYLOAD: usize = 64 << 10;

/// What [`FrameIo::read_head`] found.
#[derive(Debug)]
pub enum Incoming {
    Frame(Frame),
    /// A chunk whose `len` payload bytes must be read with [`FrameIo::read_payload`] next.
    Chunk(ChunkHead),
}

/// A framed connection: reads whole frames (refusing bad ones as soon as their header shows it) and
/// writes frames.
pub struct FrameIo<S> {
    stream: S,
    rbuf: Vec<u8>,
    /// Encoded frames waiting for [`FrameIo::flush`].
    queued: Vec<u8>,
    scratch: Vec<u8>,
}

impl<S> std::fmt::Debug for FrameIo<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameIo").field("buffered", &self.rbuf.len()).finish()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> FrameIo<S> {
    pub fn new(stream: S) -> Self {
        Self {
            stream,
            rbuf: Vec::with_capacity(64 << 10),
            queued: Vec::with_capacity(1 << 10),
            scratch: Vec::new(),
        }
    }

    async fn fill(&mut self, need: usize) -> Result<bool, TransportError> {
        self.rbuf.reserve(need.saturating_sub(self.rbuf.len()).max(64 << 10));
        let n = self.stream.read_buf(&mut self.rbuf).await?;
        Ok(n > 0)
    }

    /// The next frame, or `None` when the peer closed cleanly between frames. Chunk payloads are
    /// collected into the frame (use [`FrameIo::read_head`] to stream them instead).
    pub async fn read(&mut self) -> Result<Option<Frame>, TransportError> {
        loop {
            match decode(&self.rbuf)? {
                Decoded::Frame(f, used) => {
                    self.rbuf.drain(..used);
                    return Ok(Some(f));
                }
                Decoded::Incomplete(need) => {
                    if !self.fill(need).await? {
                        return if self.rbuf.is_empty() { Ok(None) } else { Err(TransportError::Closed) };
                    }
                }
            }
        }
    }

    /// The next frame, or only the head of a chunk frame.
    pub async fn read_head(&mut self) -> Result<Option<Incoming>, TransportError> {
        loop {
            match decode_head(&self.rbuf)? {
                DecodedHead::Frame(f, used) => {
                    self.rbuf.drain(..used);
                    return Ok(Some(Incoming::Frame(f)));
                }
                DecodedHead::Chunk(h, used) => {
                    self.rbuf.drain(..used);
                    return Ok(Some(Incoming::Chunk(h)));
                }
                DecodedHead::Incomplete(need) => {
                    if !self.fill(need).await? {
                        return if self.rbuf.is_empty() { Ok(None) } else { Err(TransportError::Closed) };
                    }
                }
            }
        }
    }

    /// Reads exactly `len` payload bytes, handing them to `sink` piece by piece, and never a byte of
    /// the next frame.
    pub async fn read_payload(
        &mut self,
        len: usize,
        mut sink: impl FnMut(&[u8]),
    ) -> Result<(), TransportError> {
        let buffered = len.min(self.rbuf.len());
        if buffered > 0 {
            sink(self.rbuf.get(..buffered).unwrap_or_default());
            self.rbuf.drain(..buffered);
        }
        let mut left = len - buffered;
        if left > 0 && self.scratch.len() < PAYLOAD_PIECE {
            self.scratch.resize(PAYLOAD_PIECE, 0);
        }
        while left > 0 {
            let want = left.min(self.scratch.len());
            let n = self.stream.read(self.scratch.get_mut(..want).unwrap_or_default()).await?;
            if n == 0 {
                return Err(TransportError::Closed);
            }
            sink(self.scratch.get(..n).unwrap_or_default());
            left -= n;
        }
        Ok(())
    }

    /// Sends one frame (after any [`FrameIo::queue`]d before it).
    pub async fn write(&mut self, frame: &Frame) -> Result<(), TransportError> {
        encode(frame, &mut self.queued);
        self.flush().await
    }

    /// Holds a frame to send with the next [`FrameIo::flush`] or [`FrameIo::write`]: answers to
    /// frames that arrived together leave together.
    pub fn queue(&mut self, frame: &Frame) {
        encode(frame, &mut self.queued);
    }

    /// Frames [`FrameIo::queue`]d and not yet sent.
    pub fn queued(&self) -> usize {
        self.queued.len()
    }

    /// Sends every queued frame.
    pub async fn flush(&mut self) -> Result<(), TransportError> {
        if !self.queued.is_empty() {
            // Taken out first: a write cut off half-way (its future dropped) leaves nothing queued
            // to be sent again after its first bytes.
            let mut out = std::mem::take(&mut self.queued);
            self.stream.write_all(&out).await?;
            out.clear();
            self.queued = out;
            // A TLS stream may hold written bytes until flushed (rustls takes the plaintext and
            // leaves what the socket would not take yet): what an answer is awaited for must
            // leave. A no-op on TCP.
            self.stream.flush().await?;
        }
        Ok(())
    }

    /// Whether bytes of a next frame are already read (its answer can wait for it).
    pub fn has_input(&self) -> bool {
        !self.rbuf.is_empty()
    }

    /// Sends a chunk frame: its head, then `payload` straight from the caller's memory (a small
    /// one copied behind the head, so the frame leaves in one write and, without Nagle, one
    /// segment).
    pub async fn write_chunk(&mut self, head: &ChunkHead, payload: &[u8]) -> Result<(), TransportError> {
        self.queue_chunk(head, payload).await?;
        self.flush().await
    }

    /// A chunk frame to leave with the next [`FrameIo::flush`] or [`FrameIo::write`]: a small
    /// payload is copied behind its head and waits with the frames queued before it (sent as soon
    /// as they reach `COALESCE_PAYLOAD` bytes), so several small chunks leave in one write; a large
    /// one leaves at once, after what was queued, straight from the caller's memory.
    pub async fn queue_chunk(&mut self, head: &ChunkHead, payload: &[u8]) -> Result<(), TransportError> {
        encode_chunk_head(&ChunkHead { len: payload.len(), ..*head }, &mut self.queued);
        if payload.len() <= COALESCE_PAYLOAD {
            self.queued.extend_from_slice(payload);
            if self.queued.len() >= COALESCE_PAYLOAD {
                self.flush().await?;
            }
            Ok(())
        } else {
            self.flush().await?;
            self.stream.write_all(payload).await?;
            self.stream.flush().await?;
            Ok(())
        }
    }

    pub fn into_inner(self) -> S {
        self.stream
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{PageAddr, RequestId, RequestKey};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A stream that counts the writes made on it.
    struct Counted {
        inner: tokio::io::DuplexStream,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncRead for Counted {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Counted {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.writes.fetch_add(1, Ordering::SeqCst);
            std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
        }
        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_flush(cx)
        }
        fn poll_shutdown(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    /// Queued small chunks leave with the frame written after them, in one write, and are read
    /// back as they were; each `write_chunk` is a write of its own; a queue past
    /// `COALESCE_PAYLOAD` bytes leaves without waiting for the next write.
    #[tokio::test]
    async fn queued_small_chunks_leave_in_one_write_with_the_next_frame() {
        let (a, b) = tokio::io::duplex(1 << 22);
        let writes = Arc::new(AtomicUsize::new(0));
        let mut io = FrameIo::new(Counted { inner: a, writes: Arc::clone(&writes) });
        let mut peer = FrameIo::new(b);
        let key = RequestKey::new(RequestId(7), 0);
        let head = |chunk: u32| ChunkHead {
            key,
            chunk,
            addr: PageAddr { page: chunk, generation: 1 },
            offset: 0,
            len: 0,
        };
        for c in 0..4u8 {
            io.queue_chunk(&head(u32::from(c)), &[c; 2048]).await.expect("queued");
        }
        assert_eq!(writes.load(Ordering::SeqCst), 0, "nothing left before the next write");
        io.write(&Frame::Fence { key }).await.expect("written");
        assert_eq!(writes.load(Ordering::SeqCst), 1);
        for c in 0..4u8 {
            match peer.read().await.expect("a frame") {
                Some(Frame::Chunk { chunk, bytes, .. }) => {
                    assert_eq!(chunk, u32::from(c));
                    assert_eq!(bytes, vec![c; 2048]);
                }
                other => panic!("chunk {c}: {other:?}"),
            }
        }
        assert!(matches!(peer.read().await.expect("a frame"), Some(Frame::Fence { .. })));

        for c in 0..2 {
            io.write_chunk(&head(c), &[1; 2048]).await.expect("written");
        }
        assert_eq!(writes.load(Ordering::SeqCst), 3);
        // Past COALESCE_PAYLOAD queued bytes, the queue leaves by itself.
        for c in 0..=u32::try_from(COALESCE_PAYLOAD / 2048).expect("small") {
            io.queue_chunk(&head(c), &[2; 2048]).await.expect("queued");
        }
        assert_eq!(writes.load(Ordering::SeqCst), 4);
    }
}
