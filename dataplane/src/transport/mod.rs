//! The data plane over TCP: one server per decoder rank, and the clients the gateway (control),
//! prefiller ranks (producer) and event subscribers use. Frames are those of [`crate::wire`].
//!
//! Every connection starts with `Hello {role, geometry fingerprint, rank}`; a peer with another
//! protocol version, another geometry or the wrong rank gets an `Error` frame and is closed before it
//! can touch the buffer. A frame that does not decode closes its connection the same way; the buffer
//! is never changed by a frame that was not fully valid.
//!
//! What a connection holds is released when it closes: reservations made over a control connection
//! stay until cancelled or expired (the gateway may reconnect), chunk writes in flight on a producer
//! connection are aborted (their `PageWriter`s drop).

mod client;
mod io;
mod server;
mod tls;

use std::time::Duration;

use thiserror::Error;

pub use client::{ControlClient, EventStream, PIPELINE_WINDOW, ProducerClient, RankInfo, Welcome};
pub use io::{FrameIo, Incoming};
pub use server::{BroadcastSink, RankServer, ServerHandle, WaitError};
pub use tls::{ALPN, TlsClient, TlsError, TlsServer, pem_certs, pem_key};

/// A data-plane connection: plain TCP or TLS over TCP.
pub trait Conn: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Conn for T {}

/// A boxed connection, so plain and TLS peers share every code path.
pub type BoxConn = Box<dyn Conn>;

use crate::wire::{FrameError, RefusalCode};

/// Bytes of one chunk segment on the wire: large enough to amortise framing, small enough that a
/// receiver never buffers much per connection.
pub const DEFAULT_SEGMENT_BYTES: usize = 4 << 20;

/// How long a new connection may take to say hello before it is closed.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a client waits for the answer to one request before giving up on the connection.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Events one subscriber may fall behind by before it is disconnected (it reconnects and
/// reconciles through `Info`; statuses are never silently skipped).
pub const DEFAULT_EVENT_BACKLOG: usize = 65_536;

/// Errors of the transport.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The connection failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent a frame that does not decode.
    #[error("bad frame: {0}")]
    Frame(#[from] FrameError),
    /// The peer closed the connection.
    #[error("peer closed the connection")]
    Closed,
    /// The peer closed the connection with an `Error` frame.
    #[error("peer closed the connection with an error ({code:?}): {message}")]
    Remote { code: RefusalCode, message: String },
    /// The rank refused the request (room, a duplicate, an expired lease).
    #[error("refused ({code:?}, need {need}, have {have}): {message}")]
    Refused { code: RefusalCode, need: u32, have: u32, message: String },
    /// The peer sent a frame that does not belong here.
    #[error("unexpected frame: {0}")]
    Unexpected(String),
    /// The TLS handshake or its configuration failed.
    #[error("tls: {0}")]
    Tls(String),
    /// No answer within the limit.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
}
