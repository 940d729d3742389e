//! The data plane's wire format: versioned, length-prefixed binary frames between a decoder rank and
//! its peers (the gateway's control connection, prefiller ranks writing chunks, event subscribers).
//!
//! ```text
//! frame  = len:u32le  version:u8  kind:u8  flags:u16le  body
//! ```
//! `len` counts everything after itself. Integers are little-endian; byte strings and lists carry a
//! `u32` length. A decoder of frames never trusts a length: every read is bounds-checked, frames over
//! the limit for their kind are refused before their body is read, unknown versions and kinds are
//! refused, and trailing bytes are an error. Nothing here panics on any input.
//!
//! The transport (TCP, optional TLS) lives in its own module and only moves these frames.

mod codec;

pub use codec::{
    CANCEL_REPORT, CHUNK_HEAD_LEN, ChunkHead, Decoded, DecodedHead, Frame, FrameError, HEADER_LEN, Hello,
    MAX_CONTROL_FRAME, MAX_DATA_FRAME, PROTOCOL_VERSION, RefusalCode, Role, WELCOME_DECODE_WAITS, decode,
    decode_head, encode, encode_chunk_head,
};
