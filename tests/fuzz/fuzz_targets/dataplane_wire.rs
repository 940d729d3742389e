//! The data plane's frame decoder, as a rank reads what a peer sent: whole frames and chunk heads.
//! Whatever decodes must encode back to the same bytes (nothing a decoder accepts is lost or
//! invented on the way).
#![no_main]

use baton_dataplane::wire::{Decoded, DecodedHead, decode, decode_head, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Decoded::Frame(frame, n)) = decode(data) {
        assert!(n <= data.len(), "consumed {n} of {} bytes", data.len());
        let mut again = Vec::new();
        encode(&frame, &mut again);
        assert_eq!(&again[..], &data[..n], "{frame:?} re-encoded differently");
    }
    match decode_head(data) {
        Ok(DecodedHead::Frame(_, n) | DecodedHead::Chunk(_, n)) => assert!(n <= data.len()),
        Ok(DecodedHead::Incomplete(_)) | Err(_) => {}
    }
});
