//! Frame encoding and decoding; see the module above for the layout.

use thiserror::Error;

use crate::events::{PagesReleased, RankEvent, RankStatus, ReleaseReason, TerminalState};
use crate::ids::{PageAddr, PrefixKey, RequestId, RequestKey};

/// The protocol version this build speaks. Peers with another version are refused at handshake.
pub const PROTOCOL_VERSION: u8 = 1;

/// `len` + version + kind + flags.
pub const HEADER_LEN: usize = 8;

/// Largest control frame (everything but chunk data): a reservation of 65,536 chunks fits.
pub const MAX_CONTROL_FRAME: usize = 1 << 20;

/// Largest chunk-data frame: pages larger than this travel as several segments, so a peer never has
/// to buffer more than this per connection.
pub const MAX_DATA_FRAME: usize = 16 << 20;

/// Declares an enum sent on the wire as one byte, and its decoder `from_u8`, from one list: a code
/// is one line, and the two directions cannot disagree. `as u8` encodes; `repr(u8)` makes a byte
/// over 255 a compile error, as a byte given twice already is.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $byte:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[repr(u8)]
        $vis enum $name {
            $($(#[$vmeta])* $variant = $byte,)+
        }

        impl $name {
            /// The variant whose byte is `v`; `None` for a byte no variant has.
            fn from_u8(v: u8) -> Option<Self> {
                match v {
                    $($byte => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }
    };
}

/// The wire bytes of an enum defined outside the wire module, both directions from one list. The
/// encoder's match is exhaustive, so a new variant does not compile until it has a byte; a byte given
/// twice is an unreachable pattern in the decoder (a warning, an error under `-D warnings`).
macro_rules! wire_codes {
    ($ty:ident, $encode:ident, $decode:ident { $($variant:ident = $byte:literal,)+ }) => {
        fn $encode(v: $ty) -> u8 {
            match v {
                $($ty::$variant => $byte,)+
            }
        }

        fn $decode(v: u8) -> Option<$ty> {
            match v {
                $($byte => Some($ty::$variant),)+
                _ => None,
            }
        }
    };
}

wire_enum! {
    /// Who is on the other end of a connection.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub enum Role {
        /// The gateway: info, reserve, renew, cancel.
        Control = 1,
        /// A prefiller rank: chunk segments and fences.
        Producer = 2,
        /// A subscriber to a rank's statuses and releases.
        Events = 3,
    }
}

/// The first frame on every connection.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Hello {
    pub role: Role,
    /// `KvGeometry::fingerprint()` of the peer; must match the rank's.
    pub geometry: u64,
    /// The decoder rank the peer wants.
    pub rank: u32,
}

wire_enum! {
    /// Why a reservation (or another request) was refused.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub enum RefusalCode {
        TooLarge = 1,
        Busy = 2,
        Duplicate = 3,
        TooManyRequests = 4,
        Expired = 5,
        Closed = 6,
        BadRequest = 7,
        Stale = 8,
        NotOwner = 9,
        Geometry = 10,
        Version = 11,
        Internal = 12,
    }
}

/// Every frame of the protocol.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Frame {
    Hello(Hello),
    /// Handshake accepted: the rank's buffer as the data plane sees it.
    Welcome {
        rank: u32,
        ranks: u32,
        pages_total: u32,
        page_bytes: u64,
        geometry: u64,
        /// Where a same-host producer can write pages directly (a shared-memory file); empty when the
        /// rank does not export its buffer.
        export: String,
        /// The engine embedding the rank waits for a request's KV itself when its decode request
        /// says so (`kv_wait_ms`, `baton_dataplane::contract`): the gateway may send the decode
        /// request before the KV is in. Carried in the header's flags ([`WELCOME_DECODE_WAITS`]),
        /// so a rank that does not set it sends the frame it always did.
        decode_waits: bool,
    },
    /// Ask for the buffer's current state.
    Info,
    InfoReply {
        rank: u32,
        ranks: u32,
        pages_total: u32,
        pages_free: u32,
        page_bytes: u64,
        geometry: u64,
    },
    /// Reserve every page of a request (all-or-nothing) with a lease of `lease_ms` from now.
    Reserve {
        key: RequestKey,
        chunks: u32,
        lease_ms: u32,
        prefixes: Vec<PrefixKey>,
    },
    /// The write addresses of the chunks to send, `(chunk, page, generation)`.
    Reserved {
        key: RequestKey,
        addrs: Vec<(u32, PageAddr)>,
    },
    Renew {
        key: RequestKey,
        lease_ms: u32,
    },
    /// Cancels a reservation. `unsent`: the write addresses never reached any producer, so no write
    /// can be in flight and the pages need no quarantine. `report` (the header's
    /// [`CANCEL_REPORT`] flag): answer `Refused` (`Closed`) instead of `Done` when the rank held no
    /// reservation of the key, so the caller knows whether a release will follow (a producer
    /// that reserves for itself may never have reached this rank).
    Cancel {
        key: RequestKey,
        unsent: bool,
        report: bool,
    },
    /// A positive answer to renew, cancel or fence.
    Done {
        key: RequestKey,
    },
    /// A refusal with the numbers that explain it (`need`/`have` for capacity refusals).
    Refused {
        key: RequestKey,
        code: RefusalCode,
        need: u32,
        have: u32,
        message: String,
    },
    /// A segment of a chunk: `bytes` at `offset` of the page at `addr`. Segments of one chunk come in
    /// order; the chunk is committed when `offset + bytes.len() == page_bytes`.
    Chunk {
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
        offset: u64,
        bytes: Vec<u8>,
    },
    /// A chunk is in the buffer (`duplicate`: it already was).
    ChunkAck {
        key: RequestKey,
        chunk: u32,
        duplicate: bool,
    },
    /// The producer will write nothing more for the request.
    Fence {
        key: RequestKey,
    },
    /// A same-host producer asks to write a chunk through the rank's export.
    Grant {
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
    },
    /// Write the whole page at `offset` of the export, then send `Written`.
    Granted {
        key: RequestKey,
        chunk: u32,
        offset: u64,
    },
    /// The granted chunk's bytes are in the export; commit it.
    Written {
        key: RequestKey,
        chunk: u32,
    },
    Event(RankEvent),
    /// A connection-level error; the sender closes after it.
    Error {
        code: RefusalCode,
        message: String,
    },
}

/// The fixed part of a chunk frame; its payload (`len` bytes) follows on the wire. Receivers stream
/// the payload into the page instead of buffering the frame.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ChunkHead {
    pub key: RequestKey,
    pub chunk: u32,
    pub addr: PageAddr,
    pub offset: u64,
    pub len: usize,
}

/// Header plus the chunk frame's fixed fields: key (20), chunk, page, generation, offset (8), length.
pub const CHUNK_HEAD_LEN: usize = HEADER_LEN + 20 + 4 + 4 + 4 + 8 + 4;

/// A decoded frame start: a whole frame, or only a chunk's head with its payload still to read.
#[derive(Debug, PartialEq, Eq)]
pub enum DecodedHead {
    Frame(Frame, usize),
    Chunk(ChunkHead, usize),
    Incomplete(usize),
}

/// Why a frame could not be decoded. The connection that sent it is closed with an `Error` frame.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
#[non_exhaustive]
pub enum FrameError {
    /// The frame is larger than its kind's limit.
    #[error("frame of {len} bytes exceeds the limit of {limit} for its kind")]
    Oversized { len: usize, limit: usize },
    /// The declared length is shorter than the header.
    #[error("frame declares {len} bytes, fewer than the {min}-byte header")]
    TooShort { len: usize, min: usize },
    /// The peer speaks another protocol version.
    #[error("unsupported protocol version {got} (this build speaks {PROTOCOL_VERSION})")]
    Version { got: u8 },
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    Kind(u8),
    /// Flags this version does not define.
    #[error("unknown flags {0:#06x}")]
    Flags(u16),
    /// The body ends before a field.
    #[error("frame body truncated reading {field}")]
    Truncated { field: &'static str },
    /// Bytes after the last field.
    #[error("{0} trailing bytes after the frame body")]
    Trailing(usize),
    /// A field holds a value outside its range.
    #[error("bad value for {field}: {value}")]
    Value { field: &'static str, value: u64 },
    /// A text field is not UTF-8 (it is refused, not repaired: a path such as `export` must reach
    /// the peer as it was sent).
    #[error("{field} is not UTF-8 (bad byte at {at})")]
    Utf8 { field: &'static str, at: usize },
}

/// A decoded frame and how many bytes of the input it used.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    Frame(Frame, usize),
    /// More bytes are needed (at least this many in all).
    Incomplete(usize),
}

mod kind {
    pub(super) const HELLO: u8 = 1;
    pub(super) const WELCOME: u8 = 2;
    pub(super) const INFO: u8 = 3;
    pub(super) const INFO_REPLY: u8 = 4;
    pub(super) const RESERVE: u8 = 5;
    pub(super) const RESERVED: u8 = 6;
    pub(super) const RENEW: u8 = 7;
    pub(super) const CANCEL: u8 = 8;
    pub(super) const DONE: u8 = 9;
    pub(super) const REFUSED: u8 = 10;
    pub(super) const CHUNK: u8 = 11;
    pub(super) const CHUNK_ACK: u8 = 12;
    pub(super) const FENCE: u8 = 13;
    pub(super) const EVENT_STATUS: u8 = 14;
    pub(super) const EVENT_RELEASED: u8 = 15;
    pub(super) const ERROR: u8 = 16;
    pub(super) const GRANT: u8 = 17;
    pub(super) const GRANTED: u8 = 18;
    pub(super) const WRITTEN: u8 = 19;
}

fn limit_for(kind: u8) -> usize {
    if kind == kind::CHUNK { MAX_DATA_FRAME + 256 } else { MAX_CONTROL_FRAME }
}

/// Appends one frame to `out`.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_LEN]);
    let k = {
        let mut w = W(out);
        match frame {
            Frame::Hello(h) => {
                w.u8(h.role as u8);
                w.u64(h.geometry);
                w.u32(h.rank);
                kind::HELLO
            }
            Frame::Welcome { rank, ranks, pages_total, page_bytes, geometry, export, decode_waits: _ } => {
                w.u32(*rank);
                w.u32(*ranks);
                w.u32(*pages_total);
                w.u64(*page_bytes);
                w.u64(*geometry);
                w.bytes(export.as_bytes());
                kind::WELCOME
            }
            Frame::Grant { key, chunk, addr } => {
                w.key(key);
                w.u32(*chunk);
                w.u32(addr.page);
                w.u32(addr.generation);
                kind::GRANT
            }
            Frame::Granted { key, chunk, offset } => {
                w.key(key);
                w.u32(*chunk);
                w.u64(*offset);
                kind::GRANTED
            }
            Frame::Written { key, chunk } => {
                w.key(key);
                w.u32(*chunk);
                kind::WRITTEN
            }
            Frame::Info => kind::INFO,
            Frame::InfoReply { rank, ranks, pages_total, pages_free, page_bytes, geometry } => {
                w.u32(*rank);
                w.u32(*ranks);
                w.u32(*pages_total);
                w.u32(*pages_free);
                w.u64(*page_bytes);
                w.u64(*geometry);
                kind::INFO_REPLY
            }
            Frame::Reserve { key, chunks, lease_ms, prefixes } => {
                w.key(key);
                w.u32(*chunks);
                w.u32(*lease_ms);
                w.len(prefixes.len());
                for p in prefixes {
                    w.u64(p.0);
                }
                kind::RESERVE
            }
            Frame::Reserved { key, addrs } => {
                w.key(key);
                w.len(addrs.len());
                for (c, a) in addrs {
                    w.u32(*c);
                    w.u32(a.page);
                    w.u32(a.generation);
                }
                kind::RESERVED
            }
            Frame::Renew { key, lease_ms } => {
                w.key(key);
                w.u32(*lease_ms);
                kind::RENEW
            }
            Frame::Cancel { key, unsent, .. } => {
                w.key(key);
                w.u8(u8::from(*unsent));
                kind::CANCEL
            }
            Frame::Done { key } => {
                w.key(key);
                kind::DONE
            }
            Frame::Refused { key, code, need, have, message } => {
                w.key(key);
                w.u8(*code as u8);
                w.u32(*need);
                w.u32(*have);
                w.bytes(message.as_bytes());
                kind::REFUSED
            }
            Frame::Chunk { key, chunk, addr, offset, bytes } => {
                let h =
                    ChunkHead { key: *key, chunk: *chunk, addr: *addr, offset: *offset, len: bytes.len() };
                write_chunk_fields(&mut w, &h);
                w.0.extend_from_slice(bytes);
                kind::CHUNK
            }
            Frame::ChunkAck { key, chunk, duplicate } => {
                w.key(key);
                w.u32(*chunk);
                w.u8(u8::from(*duplicate));
                kind::CHUNK_ACK
            }
            Frame::Fence { key } => {
                w.key(key);
                kind::FENCE
            }
            Frame::Event(RankEvent::Status(s)) => {
                w.key(&s.key());
                w.u32(s.rank);
                w.u8(terminal_code(s.state));
                w.u32(s.chunks);
                w.u64(s.bytes);
                kind::EVENT_STATUS
            }
            Frame::Event(RankEvent::Released(r)) => {
                w.key(&r.key);
                w.u32(r.rank);
                w.u32(r.pages);
                w.u8(release_code(r.reason));
                kind::EVENT_RELEASED
            }
            Frame::Error { code, message } => {
                w.u8(*code as u8);
                w.bytes(message.as_bytes());
                kind::ERROR
            }
        }
    };
    // The body length is bounded by what the caller built; frames over u32 are impossible by the
    // limits above, and a decoder refuses anything over the limit anyway.
    let len = u32::try_from(out.len() - start - 4).unwrap_or(u32::MAX);
    let flags = match frame {
        Frame::Welcome { decode_waits: true, .. } => WELCOME_DECODE_WAITS,
        Frame::Cancel { report: true, .. } => CANCEL_REPORT,
        _ => 0,
    };
    if let Some(h) = out.get_mut(start..start + HEADER_LEN) {
        h[..4].copy_from_slice(&len.to_le_bytes());
        h[4] = PROTOCOL_VERSION;
        h[5] = k;
        h[6..8].copy_from_slice(&flags.to_le_bytes());
    }
}

fn write_chunk_fields(w: &mut W<'_>, h: &ChunkHead) {
    w.key(&h.key);
    w.u32(h.chunk);
    w.u32(h.addr.page);
    w.u32(h.addr.generation);
    w.u64(h.offset);
    w.len(h.len);
}

/// Appends the head of a chunk frame whose `h.len` payload bytes the caller sends right after.
pub fn encode_chunk_head(h: &ChunkHead, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_LEN]);
    write_chunk_fields(&mut W(out), h);
    let len = u32::try_from(CHUNK_HEAD_LEN - 4 + h.len).unwrap_or(u32::MAX);
    if let Some(hd) = out.get_mut(start..start + HEADER_LEN) {
        hd[..4].copy_from_slice(&len.to_le_bytes());
        hd[4] = PROTOCOL_VERSION;
        hd[5] = kind::CHUNK;
        hd[6..8].copy_from_slice(&0u16.to_le_bytes());
    }
}

/// Welcome's flag: the engine embedding the rank waits for a request's KV itself.
pub const WELCOME_DECODE_WAITS: u16 = 1;

/// Cancel's flag: say whether the rank held a reservation of the key (`Refused` when it did not).
pub const CANCEL_REPORT: u16 = 1;

/// The flags each kind may carry (every other bit is refused).
fn known_flags(kind: u8) -> u16 {
    match kind {
        kind::WELCOME => WELCOME_DECODE_WAITS,
        kind::CANCEL => CANCEL_REPORT,
        _ => 0,
    }
}

/// Checks the 8-byte header: returns (frame length after the `len` field, kind, flags).
fn check_header(buf: &[u8]) -> Result<(usize, u8, u16), FrameError> {
    let mut r = R { buf, pos: 0 };
    let len = r.u32("len")? as usize;
    let version = r.u8("version")?;
    let k = r.u8("kind")?;
    let flags = r.u16("flags")?;
    if version != PROTOCOL_VERSION {
        return Err(FrameError::Version { got: version });
    }
    if len < HEADER_LEN - 4 {
        return Err(FrameError::TooShort { len, min: HEADER_LEN - 4 });
    }
    let limit = limit_for(k);
    if len > limit {
        return Err(FrameError::Oversized { len, limit });
    }
    if flags & !known_flags(k) != 0 {
        return Err(FrameError::Flags(flags));
    }
    Ok((len, k, flags))
}

fn read_chunk_fields(r: &mut R<'_>) -> Result<ChunkHead, FrameError> {
    Ok(ChunkHead {
        key: r.key()?,
        chunk: r.u32("chunk")?,
        addr: PageAddr { page: r.u32("page")?, generation: r.u32("generation")? },
        offset: r.u64("offset")?,
        len: r.u32("bytes")? as usize,
    })
}

/// Like [`decode`], but a chunk frame is returned as soon as its head is in, leaving the payload
/// (`head.len` bytes right after the returned count) to the caller.
pub fn decode_head(buf: &[u8]) -> Result<DecodedHead, FrameError> {
    if buf.len() < HEADER_LEN {
        return Ok(DecodedHead::Incomplete(HEADER_LEN));
    }
    let (len, k, _) = check_header(buf)?;
    if k != kind::CHUNK {
        return Ok(match decode(buf)? {
            Decoded::Frame(f, n) => DecodedHead::Frame(f, n),
            Decoded::Incomplete(n) => DecodedHead::Incomplete(n),
        });
    }
    if len + 4 < CHUNK_HEAD_LEN {
        return Err(FrameError::Truncated { field: "chunk head" });
    }
    if buf.len() < CHUNK_HEAD_LEN {
        return Ok(DecodedHead::Incomplete(CHUNK_HEAD_LEN));
    }
    let mut r = R { buf: buf.get(..CHUNK_HEAD_LEN).unwrap_or_default(), pos: HEADER_LEN };
    let head = read_chunk_fields(&mut r)?;
    if CHUNK_HEAD_LEN + head.len != len + 4 {
        return Err(FrameError::Value { field: "bytes", value: head.len as u64 });
    }
    Ok(DecodedHead::Chunk(head, CHUNK_HEAD_LEN))
}

/// Decodes one frame from the front of `buf`, refusing oversized frames as soon as the header is in.
pub fn decode(buf: &[u8]) -> Result<Decoded, FrameError> {
    if buf.len() < HEADER_LEN {
        return Ok(Decoded::Incomplete(HEADER_LEN));
    }
    let (len, k, flags) = check_header(buf)?;
    let total = len + 4;
    if buf.len() < total {
        return Ok(Decoded::Incomplete(total));
    }
    let mut r = R { buf: buf.get(..total).unwrap_or_default(), pos: HEADER_LEN };
    let frame = match k {
        kind::HELLO => {
            let v = r.u8("role")?;
            let role = Role::from_u8(v).ok_or(FrameError::Value { field: "role", value: u64::from(v) })?;
            Frame::Hello(Hello { role, geometry: r.u64("geometry")?, rank: r.u32("rank")? })
        }
        kind::WELCOME => Frame::Welcome {
            rank: r.u32("rank")?,
            ranks: r.u32("ranks")?,
            pages_total: r.u32("pages_total")?,
            page_bytes: r.u64("page_bytes")?,
            geometry: r.u64("geometry")?,
            export: r.string("export")?,
            decode_waits: flags & WELCOME_DECODE_WAITS != 0,
        },
        kind::GRANT => Frame::Grant {
            key: r.key()?,
            chunk: r.u32("chunk")?,
            addr: PageAddr { page: r.u32("page")?, generation: r.u32("generation")? },
        },
        kind::GRANTED => Frame::Granted { key: r.key()?, chunk: r.u32("chunk")?, offset: r.u64("offset")? },
        kind::WRITTEN => Frame::Written { key: r.key()?, chunk: r.u32("chunk")? },
        kind::INFO => Frame::Info,
        kind::INFO_REPLY => Frame::InfoReply {
            rank: r.u32("rank")?,
            ranks: r.u32("ranks")?,
            pages_total: r.u32("pages_total")?,
            pages_free: r.u32("pages_free")?,
            page_bytes: r.u64("page_bytes")?,
            geometry: r.u64("geometry")?,
        },
        kind::RESERVE => {
            let key = r.key()?;
            let chunks = r.u32("chunks")?;
            let lease_ms = r.u32("lease_ms")?;
            let n = r.count("prefixes", 8)?;
            let prefixes = (0..n).map(|_| r.u64("prefix").map(PrefixKey)).collect::<Result<_, _>>()?;
            Frame::Reserve { key, chunks, lease_ms, prefixes }
        }
        kind::RESERVED => {
            let key = r.key()?;
            let n = r.count("addrs", 12)?;
            let addrs = (0..n)
                .map(|_| {
                    Ok((r.u32("chunk")?, PageAddr { page: r.u32("page")?, generation: r.u32("generation")? }))
                })
                .collect::<Result<_, FrameError>>()?;
            Frame::Reserved { key, addrs }
        }
        kind::RENEW => Frame::Renew { key: r.key()?, lease_ms: r.u32("lease_ms")? },
        kind::CANCEL => {
            let key = r.key()?;
            let unsent = match r.u8("unsent")? {
                0 => false,
                1 => true,
                v => {
                    return Err(FrameError::Value { field: "unsent", value: u64::from(v) });
                }
            };
            Frame::Cancel { key, unsent, report: flags & CANCEL_REPORT != 0 }
        }
        kind::DONE => Frame::Done { key: r.key()? },
        kind::REFUSED => {
            let key = r.key()?;
            let c = r.u8("code")?;
            let code =
                RefusalCode::from_u8(c).ok_or(FrameError::Value { field: "code", value: u64::from(c) })?;
            Frame::Refused {
                key,
                code,
                need: r.u32("need")?,
                have: r.u32("have")?,
                message: r.string("message")?,
            }
        }
        kind::CHUNK => {
            let h = read_chunk_fields(&mut r)?;
            let bytes = r.take(h.len, "bytes")?.to_vec();
            Frame::Chunk { key: h.key, chunk: h.chunk, addr: h.addr, offset: h.offset, bytes }
        }
        kind::CHUNK_ACK => {
            let key = r.key()?;
            let chunk = r.u32("chunk")?;
            let duplicate = match r.u8("duplicate")? {
                0 => false,
                1 => true,
                v => {
                    return Err(FrameError::Value { field: "duplicate", value: u64::from(v) });
                }
            };
            Frame::ChunkAck { key, chunk, duplicate }
        }
        kind::FENCE => Frame::Fence { key: r.key()? },
        kind::EVENT_STATUS => {
            let key = r.key()?;
            let rank = r.u32("rank")?;
            let s = r.u8("state")?;
            let state = terminal_from(s).ok_or(FrameError::Value { field: "state", value: u64::from(s) })?;
            Frame::Event(RankEvent::Status(RankStatus {
                request: key.request,
                epoch: key.epoch,
                rank,
                state,
                chunks: r.u32("chunks")?,
                bytes: r.u64("bytes")?,
            }))
        }
        kind::EVENT_RELEASED => {
            let key = r.key()?;
            let rank = r.u32("rank")?;
            let pages = r.u32("pages")?;
            let c = r.u8("reason")?;
            let reason = release_from(c).ok_or(FrameError::Value { field: "reason", value: u64::from(c) })?;
            Frame::Event(RankEvent::Released(PagesReleased { key, rank, pages, reason }))
        }
        kind::ERROR => {
            let c = r.u8("code")?;
            let code =
                RefusalCode::from_u8(c).ok_or(FrameError::Value { field: "code", value: u64::from(c) })?;
            Frame::Error { code, message: r.string("message")? }
        }
        other => return Err(FrameError::Kind(other)),
    };
    if r.pos != total {
        return Err(FrameError::Trailing(total - r.pos));
    }
    Ok(Decoded::Frame(frame, total))
}

wire_codes!(TerminalState, terminal_code, terminal_from {
    Ready = 1,
    Failed = 2,
    Cancelled = 3,
    Expired = 4,
});

wire_codes!(ReleaseReason, release_code, release_from {
    Consumed = 1,
    Dropped = 2,
    Cancelled = 3,
    Expired = 4,
    Fenced = 5,
    QuarantineTimeout = 6,
});

struct W<'a>(&'a mut Vec<u8>);

impl W<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    fn bytes(&mut self, b: &[u8]) {
        self.len(b.len());
        self.0.extend_from_slice(b);
    }
    fn key(&mut self, k: &RequestKey) {
        self.0.extend_from_slice(&k.request.0.to_le_bytes());
        self.u32(k.epoch);
    }
}

struct R<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], FrameError> {
        let end = self.pos.checked_add(n).ok_or(FrameError::Truncated { field })?;
        let s = self.buf.get(self.pos..end).ok_or(FrameError::Truncated { field })?;
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], FrameError> {
        let s = self.take(N, field)?;
        let mut a = [0; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u8(&mut self, field: &'static str) -> Result<u8, FrameError> {
        Ok(self.arr::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.arr(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.arr(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.arr(field)?))
    }
    fn key(&mut self) -> Result<RequestKey, FrameError> {
        let id = u128::from_le_bytes(self.arr("request")?);
        Ok(RequestKey::new(RequestId(id), self.u32("epoch")?))
    }
    /// A list length, checked against the bytes left so a hostile count cannot make us allocate.
    fn count(&mut self, field: &'static str, elem: usize) -> Result<usize, FrameError> {
        let n = self.u32(field)? as usize;
        let left = self.buf.len() - self.pos;
        if n.checked_mul(elem).is_none_or(|b| b > left) {
            return Err(FrameError::Truncated { field });
        }
        Ok(n)
    }
    fn bytes(&mut self, field: &'static str) -> Result<&'a [u8], FrameError> {
        let n = self.count(field, 1)?;
        self.take(n, field)
    }
    fn string(&mut self, field: &'static str) -> Result<String, FrameError> {
        std::str::from_utf8(self.bytes(field)?)
            .map(str::to_owned)
            .map_err(|e| FrameError::Utf8 { field, at: e.valid_up_to() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> RequestKey {
        RequestKey::new(RequestId(0x0123_4567_89ab_cdef_0011_2233_4455_6677), 9)
    }

    fn all_frames() -> Vec<Frame> {
        let k = key();
        vec![
            Frame::Hello(Hello { role: Role::Producer, geometry: 42, rank: 3 }),
            Frame::Welcome {
                rank: 1,
                ranks: 2,
                pages_total: 64,
                page_bytes: 32 << 20,
                geometry: 42,
                export: "/dev/shm/x".into(),
                decode_waits: true,
            },
            Frame::Grant { key: k, chunk: 1, addr: PageAddr { page: 3, generation: 4 } },
            Frame::Granted { key: k, chunk: 1, offset: 3 << 20 },
            Frame::Written { key: k, chunk: 1 },
            Frame::Info,
            Frame::InfoReply {
                rank: 1,
                ranks: 2,
                pages_total: 64,
                pages_free: 60,
                page_bytes: 1,
                geometry: 7,
            },
            Frame::Reserve {
                key: k,
                chunks: 3,
                lease_ms: 30_000,
                prefixes: vec![PrefixKey(1), PrefixKey(u64::MAX)],
            },
            Frame::Reserved {
                key: k,
                addrs: vec![
                    (0, PageAddr { page: 5, generation: 7 }),
                    (2, PageAddr { page: 9, generation: 0 }),
                ],
            },
            Frame::Renew { key: k, lease_ms: 5 },
            Frame::Cancel { key: k, unsent: true, report: false },
            Frame::Cancel { key: k, unsent: false, report: true },
            Frame::Done { key: k },
            Frame::Refused {
                key: k,
                code: RefusalCode::Busy,
                need: 9,
                have: 3,
                message: "request needs 9 free pages".into(),
            },
            Frame::Chunk {
                key: k,
                chunk: 2,
                addr: PageAddr { page: 9, generation: 1 },
                offset: 64,
                bytes: vec![1, 2, 3],
            },
            Frame::ChunkAck { key: k, chunk: 2, duplicate: true },
            Frame::Fence { key: k },
            Frame::Event(RankEvent::Status(RankStatus {
                request: k.request,
                epoch: k.epoch,
                rank: 1,
                state: TerminalState::Expired,
                chunks: 4,
                bytes: 256,
            })),
            Frame::Event(RankEvent::Released(PagesReleased {
                key: k,
                rank: 1,
                pages: 4,
                reason: ReleaseReason::Fenced,
            })),
            Frame::Error { code: RefusalCode::Geometry, message: "geometry mismatch".into() },
        ]
    }

    #[test]
    fn every_frame_round_trips() {
        for f in all_frames() {
            let mut buf = Vec::new();
            encode(&f, &mut buf);
            assert_eq!(decode(&buf), Ok(Decoded::Frame(f.clone(), buf.len())), "{f:?}");
            // Any strict prefix is incomplete, never an error or a wrong frame.
            for cut in 0..buf.len() {
                assert!(matches!(decode(&buf[..cut]), Ok(Decoded::Incomplete(_))), "{f:?} cut at {cut}");
            }
        }
    }

    /// Checks a code table both ways: each row encodes to its byte, and of all 256 bytes exactly the
    /// rows' bytes decode, each to its row (so a code added without a row here fails too).
    fn pin<T: Copy + PartialEq + std::fmt::Debug>(
        what: &str,
        rows: &[(T, u8)],
        encode: impl Fn(T) -> u8,
        decode: impl Fn(u8) -> Option<T>,
    ) {
        for &(v, byte) in rows {
            assert_eq!(encode(v), byte, "{what} {v:?}");
        }
        for byte in 0..=u8::MAX {
            let want = rows.iter().find(|r| r.1 == byte).map(|r| r.0);
            assert_eq!(decode(byte), want, "{what} byte {byte}");
        }
    }

    /// Every code's byte as the protocol shipped it, written out by hand rather than from the
    /// tables: changing one is a protocol change (and a `PROTOCOL_VERSION` bump), never a refactor.
    #[test]
    fn wire_codes_keep_their_bytes() {
        pin(
            "role",
            &[(Role::Control, 1), (Role::Producer, 2), (Role::Events, 3)],
            |v| v as u8,
            Role::from_u8,
        );
        use RefusalCode as C;
        pin(
            "refusal code",
            &[
                (C::TooLarge, 1),
                (C::Busy, 2),
                (C::Duplicate, 3),
                (C::TooManyRequests, 4),
                (C::Expired, 5),
                (C::Closed, 6),
                (C::BadRequest, 7),
                (C::Stale, 8),
                (C::NotOwner, 9),
                (C::Geometry, 10),
                (C::Version, 11),
                (C::Internal, 12),
            ],
            |v| v as u8,
            C::from_u8,
        );
        use TerminalState as T;
        pin(
            "terminal state",
            &[(T::Ready, 1), (T::Failed, 2), (T::Cancelled, 3), (T::Expired, 4)],
            terminal_code,
            terminal_from,
        );
        use ReleaseReason as R;
        pin(
            "release reason",
            &[
                (R::Consumed, 1),
                (R::Dropped, 2),
                (R::Cancelled, 3),
                (R::Expired, 4),
                (R::Fenced, 5),
                (R::QuarantineTimeout, 6),
            ],
            release_code,
            release_from,
        );
        let kinds = [
            (kind::HELLO, 1),
            (kind::WELCOME, 2),
            (kind::INFO, 3),
            (kind::INFO_REPLY, 4),
            (kind::RESERVE, 5),
            (kind::RESERVED, 6),
            (kind::RENEW, 7),
            (kind::CANCEL, 8),
            (kind::DONE, 9),
            (kind::REFUSED, 10),
            (kind::CHUNK, 11),
            (kind::CHUNK_ACK, 12),
            (kind::FENCE, 13),
            (kind::EVENT_STATUS, 14),
            (kind::EVENT_RELEASED, 15),
            (kind::ERROR, 16),
            (kind::GRANT, 17),
            (kind::GRANTED, 18),
            (kind::WRITTEN, 19),
        ];
        for (i, (got, want)) in kinds.into_iter().enumerate() {
            assert_eq!(got, want, "frame kind row {i}");
        }
    }

    #[test]
    fn chunk_head_streaming_agrees_with_whole_frames() {
        let h = ChunkHead {
            key: key(),
            chunk: 3,
            addr: PageAddr { page: 9, generation: 2 },
            offset: 128,
            len: 5,
        };
        let mut streamed = Vec::new();
        encode_chunk_head(&h, &mut streamed);
        streamed.extend_from_slice(&[1, 2, 3, 4, 5]);
        let mut whole = Vec::new();
        encode(
            &Frame::Chunk { key: h.key, chunk: 3, addr: h.addr, offset: 128, bytes: vec![1, 2, 3, 4, 5] },
            &mut whole,
        );
        assert_eq!(streamed, whole);
        assert_eq!(decode_head(&whole), Ok(DecodedHead::Chunk(h, CHUNK_HEAD_LEN)));
        assert_eq!(decode_head(&whole[..CHUNK_HEAD_LEN - 1]), Ok(DecodedHead::Incomplete(CHUNK_HEAD_LEN)));
        // A payload length that disagrees with the frame length is refused.
        let mut bad = whole.clone();
        bad[CHUNK_HEAD_LEN - 4..CHUNK_HEAD_LEN].copy_from_slice(&6u32.to_le_bytes());
        assert_eq!(decode_head(&bad), Err(FrameError::Value { field: "bytes", value: 6 }));
        let mut fence = Vec::new();
        encode(&Frame::Fence { key: key() }, &mut fence);
        assert_eq!(decode_head(&fence), Ok(DecodedHead::Frame(Frame::Fence { key: key() }, fence.len())));
    }

    #[test]
    fn hostile_frames_are_refused() {
        let mut good = Vec::new();
        encode(&Frame::Cancel { key: key(), unsent: false, report: false }, &mut good);
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            b
        };
        let big = u32::try_from(MAX_CONTROL_FRAME + 1).unwrap();
        let cases: Vec<(&str, Vec<u8>, FrameError)> = vec![
            ("unknown version", with(&|b| b[4] = 9), FrameError::Version { got: 9 }),
            ("unknown kind", with(&|b| b[5] = 200), FrameError::Kind(200)),
            ("flags set", with(&|b| b[6] = 2), FrameError::Flags(2)),
            (
                "declared length below header",
                with(&|b| b[..4].copy_from_slice(&2u32.to_le_bytes())),
                FrameError::TooShort { len: 2, min: 4 },
            ),
            (
                "oversized control frame refused from the header alone",
                with(&|b| {
                    b[..4].copy_from_slice(&big.to_le_bytes());
                    b.truncate(HEADER_LEN);
                }),
                FrameError::Oversized { len: MAX_CONTROL_FRAME + 1, limit: MAX_CONTROL_FRAME },
            ),
            (
                "trailing bytes",
                with(&|b| {
                    b.push(0);
                    let n = u32::try_from(b.len() - 4).unwrap();
                    b[..4].copy_from_slice(&n.to_le_bytes());
                }),
                FrameError::Trailing(1),
            ),
            (
                "body shorter than its fields",
                with(&|b| {
                    b.truncate(b.len() - 2);
                    let n = u32::try_from(b.len() - 4).unwrap();
                    b[..4].copy_from_slice(&n.to_le_bytes());
                }),
                FrameError::Truncated { field: "epoch" },
            ),
        ];
        for (name, bytes, want) in cases {
            assert_eq!(decode(&bytes), Err(want), "{name}");
        }
        // Found by the fuzzer (tests/fuzz, `dataplane_wire`): a `Refused` frame whose message ends
        // in 0xFF decoded to U+FFFD, so the frame re-encoded as other bytes. Text fields are now
        // refused unless UTF-8.
        let found = b"\x26\x00\x00\x00\x01\x0a\x00\x00\x41\x01\x3b\x00\x00\xa8\x00\x00\x00\x00\x00\x01\x0a\x00\x00\x01\x03\x00\x00\x01\x06\xff\xf7\x00\x2b\x00\x00\x00\x00\x01\x00\x00\x00\xff";
        assert_eq!(decode(found), Err(FrameError::Utf8 { field: "message", at: 0 }));
        let mut b = Vec::new();
        encode(&Frame::Error { code: RefusalCode::Geometry, message: "ok".into() }, &mut b);
        let n = b.len();
        b[n - 1] = 0xC3;
        assert_eq!(decode(&b), Err(FrameError::Utf8 { field: "message", at: 1 }));
        // A list count larger than the frame cannot make the decoder allocate it.
        let mut b = Vec::new();
        encode(&Frame::Reserve { key: key(), chunks: 1, lease_ms: 1, prefixes: vec![] }, &mut b);
        let n = b.len();
        b[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&b), Err(FrameError::Truncated { field: "prefixes" }));
        // Bad enum values.
        let mut b = Vec::new();
        encode(&Frame::Hello(Hello { role: Role::Control, geometry: 0, rank: 0 }), &mut b);
        b[HEADER_LEN] = 7;
        assert_eq!(decode(&b), Err(FrameError::Value { field: "role", value: 7 }));
    }

    #[test]
    fn random_bytes_never_panic() {
        // A cheap deterministic fuzz: every outcome is fine except a panic.
        let mut x: u64 = 0x1234_5678;
        for len in 0..2000usize {
            let mut b: Vec<u8> = (0..len % 96)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()[0]
                })
                .collect();
            if b.len() >= HEADER_LEN && len % 3 == 0 {
                // Often make it look plausible so the body decoders get exercised.
                let n = u32::try_from(b.len() - 4).unwrap();
                b[..4].copy_from_slice(&n.to_le_bytes());
                b[4] = PROTOCOL_VERSION;
                b[5] = u8::try_from(len % 17).unwrap();
                b[6] = 0;
                b[7] = 0;
            }
            let _ = decode(&b);
        }
    }
}
