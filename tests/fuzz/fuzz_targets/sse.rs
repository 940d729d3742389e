//! The SSE splitter the gateway reads engines' streams with, the stream cut anywhere: the first
//! input byte says where. Cut or whole, the same payloads come out.
#![no_main]

use baton_gateway::api::sse::SseSplitter;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, stream)) = data.split_first() else { return };
    let at = usize::from(cut).min(stream.len());
    let (mut whole, mut parts) = (Vec::new(), Vec::new());
    SseSplitter::default().push(stream, &mut whole);
    let mut s = SseSplitter::default();
    s.push(&stream[..at], &mut parts);
    s.push(&stream[at..], &mut parts);
    assert_eq!(whole, parts);
});
