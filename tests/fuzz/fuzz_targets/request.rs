//! Request validation: a completions or chat body as a client sends it (the first input byte
//! picks the endpoint), parsed and checked as the gateway does before it counts a token. A body
//! that passes is read as the gateway then reads it. The gateway's parse of a body's object
//! (`api::object`: its fields found by a scan or a first pass, its large fields' text kept, a large
//! string taken from its text) must read what serde_json reads from the body whole, and keep each
//! large field's text as serde_json finds it. The scan for one field of an engine's answer
//! (`api::scan`) must read what serde_json reads into a struct of that one field, wherever it
//! answers at all (and answer nothing where serde_json refuses the text); its items of an array
//! must be the texts serde_json reads as the array's `RawValue`s.
#![no_main]

use baton_gateway::api::object::Object;
use baton_gateway::api::scan::{items, top_field};
use baton_gateway::api::{Endpoint, GenRequest, PromptRef, prompt_ids};
use libfuzzer_sys::fuzz_target;
use serde_json::value::RawValue;

#[derive(serde::Deserialize)]
struct Params {
    kv_transfer_params: Option<Box<RawValue>>,
}

#[derive(serde::Deserialize)]
struct Prompt {
    prompt: Option<Box<RawValue>>,
}

/// The scan's field against serde_json's, where the scan answers.
fn same_field<T: serde::de::DeserializeOwned>(body: &[u8], key: &str, field: fn(T) -> Option<Box<RawValue>>) {
    let Ok(found) = top_field(body, key) else { return };
    match serde_json::from_slice::<T>(body) {
        Ok(t) => assert_eq!(found, field(t).as_deref().map(RawValue::get), "the scan read another {key}"),
        Err(e) => panic!("the scan read what serde_json refuses: {e}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    let endpoint = if which & 1 == 0 { Endpoint::Completions } else { Endpoint::Chat };
    let whole = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body);
    // The server parses the body it read, and keeps slices of it.
    let read = bytes::Bytes::copy_from_slice(body);
    match (Object::parse(&read), whole) {
        (Ok(o), Ok(w)) => {
            assert_eq!(*o, w, "the object read differs from serde_json's");
            assert!(o.iter().eq(w.iter()), "the fields' order differs from serde_json's");
            // A large field's kept text (what engines get) is the field's JSON text as written.
            let raw = serde_json::from_slice::<std::collections::BTreeMap<String, &RawValue>>(body)
                .unwrap_or_else(|e| panic!("serde_json read the object but not its fields' text: {e}"));
            for (i, k) in o.keys().enumerate() {
                if let Some(text) = o.text_at(i) {
                    assert_eq!(
                        Some(text),
                        raw.get(k).map(|r| r.get().as_bytes()),
                        "the kept text of {k:?} differs"
                    );
                }
            }
        }
        (Err(_), Err(_)) => {}
        // Depth counts from each top-level field in the kept parse: one level deeper passes.
        (Ok(_), Err(e)) => assert!(e.to_string().contains("recursion limit"), "serde_json refused: {e}"),
        (Err(e), Ok(_)) => panic!("the gateway refused what serde_json reads: {e}"),
    }
    same_field::<Params>(body, "kv_transfer_params", |p| p.kv_transfer_params);
    same_field::<Prompt>(body, "prompt", |p| p.prompt);
    if let Ok(found) = items(body) {
        match serde_json::from_slice::<Vec<&RawValue>>(body) {
            Ok(v) => assert!(
                found.iter().map(|i| std::str::from_utf8(i).ok()).eq(v.iter().map(|r| Some(r.get()))),
                "the scan read other items"
            ),
            Err(e) => {
                assert!(std::str::from_utf8(body).is_err(), "the scan read an array serde_json refuses: {e}")
            }
        }
    }
    if let Ok(req) = GenRequest::parse(endpoint, body) {
        let _ = req.messages();
        let _ = req.fields.max_tokens();
        // A list of ids the checks passed is one the gateway reads.
        if let Some(PromptRef::Tokens(ids)) = req.prompt() {
            assert!(prompt_ids(ids).is_ok(), "checked token ids the gateway cannot read");
        }
    }
});
