//! The KV event decoder (vLLM's and SGLang's msgpack batches on a ZeroMQ SUB socket) and the
//! replay answer reader. The input is split into frames at each `0xFF 0x00` pair, so the fuzzer
//! controls the frame count as well as each frame.
#![no_main]

use baton_gateway::kv_events::{decode, replay_answer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut frames: Vec<&[u8]> = Vec::new();
    let mut rest = data;
    while let Some(at) = rest.windows(2).position(|w| w == [0xFF, 0x00]) {
        frames.push(&rest[..at]);
        rest = &rest[at + 2..];
    }
    frames.push(rest);
    let _ = decode(&frames);
    let _ = replay_answer(&frames, b"");
});
