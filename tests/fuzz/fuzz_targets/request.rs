//! Request validation: a completions or chat body as a client sends it (the first input byte
//! picks the endpoint), parsed and checked as the gateway does before it counts a token. A body
//! that passes is read as the gateway then reads it.
#![no_main]

use baton_gateway::api::{Endpoint, GenRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    let endpoint = if which & 1 == 0 { Endpoint::Completions } else { Endpoint::Chat };
    if let Ok(req) = GenRequest::parse(endpoint, body) {
        let _ = req.messages();
        let _ = req.fields.max_tokens();
    }
});
