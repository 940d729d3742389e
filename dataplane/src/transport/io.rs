//! Reading and writing frames on a byte stream.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::TransportError;
use crate::wire::{Decoded, Frame, decode, encode};

/// A framed connection: reads whole frames (refusing bad ones as soon as their header shows it) and
/// writes frames.
#[derive(Debug)]
pub struct FrameIo<S> {
    stream: S,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> FrameIo<S> {
    pub fn new(stream: S) -> Self {
        Self {
            stream,
            rbuf: Vec::with_capacity(64 << 10),
            wbuf: Vec::with_capacity(4 << 10),
        }
    }

    /// The next frame, or `None` when the peer closed cleanly between frames.
    pub async fn read(&mut self) -> Result<Option<Frame>, TransportError> {
        loop {
            match decode(&self.rbuf)? {
                Decoded::Frame(f, used) => {
                    self.rbuf.drain(..used);
                    return Ok(Some(f));
                }
                Decoded::Incomplete(need) => {
                    self.rbuf
                        .reserve(need.saturating_sub(self.rbuf.len()).max(64 << 10));
                    let n = self.stream.read_buf(&mut self.rbuf).await?;
                    if n == 0 {
                        return if self.rbuf.is_empty() {
                            Ok(None)
                        } else {
                            Err(TransportError::Closed)
                        };
                    }
                }
            }
        }
    }

    /// Sends one frame.
    pub async fn write(&mut self, frame: &Frame) -> Result<(), TransportError> {
        self.wbuf.clear();
        encode(frame, &mut self.wbuf);
        self.stream.write_all(&self.wbuf).await?;
        Ok(())
    }

    pub fn into_inner(self) -> S {
        self.stream
    }
}
