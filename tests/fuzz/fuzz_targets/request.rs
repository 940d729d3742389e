//! Request validation: a completions or chat body as a client sends it (the first input byte
//! picks the endpoint), parsed and checked as the gateway does before it counts a token. A body
//! that passes is read as the gateway then reads it. The gateway's parse of a body's object
//! (`api::object`: two passes, its large fields' text kept, a large string taken from its text) must
//! read what serde_json reads from the body whole.
#![no_main]

use baton_gateway::api::object::Object;
use baton_gateway::api::{Endpoint, GenRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    let endpoint = if which & 1 == 0 { Endpoint::Completions } else { Endpoint::Chat };
    let whole = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body);
    match (Object::parse(body), whole) {
        (Ok(o), Ok(w)) => {
            assert_eq!(*o, w, "the object read differs from serde_json's");
            assert!(o.iter().eq(w.iter()), "the fields' order differs from serde_json's");
        }
        (Err(_), Err(_)) => {}
        // Depth counts from each top-level field in the kept parse: one level deeper passes.
        (Ok(_), Err(e)) => assert!(e.to_string().contains("recursion limit"), "serde_json refused: {e}"),
        (Err(e), Ok(_)) => panic!("the gateway refused what serde_json reads: {e}"),
    }
    if let Ok(req) = GenRequest::parse(endpoint, body) {
        let _ = req.messages();
        let _ = req.fields.max_tokens();
    }
});
