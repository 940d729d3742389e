//! One top-level field of an engine's JSON answer (or all of them, or an array's items), found by
//! a scan that checks the text as it goes instead of parsing it into values; and whether a string
//! goes into JSON without escapes ([`plain`]).
//!
//! vLLM's prefill answers with a whole completion object, and the gateway needs one field of it
//! (`kv_transfer_params`, passed on to the decoder as written). serde_json read the rest field by
//! field to skip it, and the field itself twice (once to skip it, once more to keep it as a
//! `RawValue`): 9.5k of the 131k instructions a request in `vllm-nixl`'s proxy benchmark
//! (`scripts/count-instructions`), for an answer of some 900 bytes.
//!
//! The scan follows JSON's grammar byte by byte (strings from quote to quote), at most as
//! permissive as serde_json: whatever it takes, serde_json takes too and reads the same field from
//! it. What it is not sure of, it leaves to serde_json, which then gives its own answer or error:
//! a top-level key with an escape or a byte that is not ASCII, the field given twice, nesting deeper
//! than [`DEPTH`], a number that may be out of `f64`'s range, anything serde_json would refuse. The
//! `request` fuzz target compares the two on any input.

/// Nesting the scan follows (serde_json skips a value at any depth): deeper, it gives up.
const DEPTH: u32 = 128;

/// What the scan found: the field's JSON text as written (`None` when the object has no such field,
/// or `null` for it); `Err(Unsure)`: read the text with serde_json.
pub type Found<'a> = Result<Option<&'a str>, Unsure>;

/// The scan is not sure of the text: serde_json is to read it (and may refuse it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsure;

/// The JSON text of the field `key` of the JSON object `text`, as serde_json reads it into a
/// struct whose one field is an `Option<Box<RawValue>>` named `key` (other fields ignored).
pub fn top_field<'a>(text: &'a [u8], key: &str) -> Found<'a> {
    scan_field(text, key).map_err(|()| Unsure)
}

fn scan_field<'a>(text: &'a [u8], key: &str) -> Result<Option<&'a str>, ()> {
    let mut found: Option<&[u8]> = None;
    walk(text, |name, value| {
        // Given twice: serde_json refuses it ("duplicate field").
        if name == key.as_bytes() && found.replace(value).is_some() { Err(()) } else { Ok(()) }
    })?;
    match found {
        None | Some(b"null") => Ok(None),
        // serde_json checks a `RawValue`'s text as UTF-8 (not a skipped string's).
        Some(v) => std::str::from_utf8(v).map(Some).map_err(drop),
    }
}

/// The fields of the JSON object `text`, in order: each key and its value's JSON text as written,
/// as serde_json reads them (a key given twice is there twice). `Err(Unsure)`: a key with an escape
/// or a byte that is not ASCII, or whatever else the scan leaves to serde_json ([`top_field`]).
/// A value's text is not checked as UTF-8.
pub fn top_fields(text: &[u8]) -> Result<Vec<(&str, &[u8])>, Unsure> {
    let mut fields = Vec::with_capacity(8);
    walk(text, |name, value| {
        fields.push((std::str::from_utf8(name).map_err(drop)?, value));
        Ok(())
    })
    .map_err(|()| Unsure)?;
    Ok(fields)
}

/// The items of the JSON array `text`, each its JSON text as written. `Err(Unsure)`: not an array,
/// or whatever else the scan leaves to serde_json ([`top_field`]).
pub fn items(text: &[u8]) -> Result<Vec<&[u8]>, Unsure> {
    let mut s = Scan { b: text, i: 0 };
    let mut items = Vec::with_capacity(1);
    s.ws();
    if s.peek() != Some(b'[') {
        return Err(Unsure);
    }
    s.array(DEPTH, |item| items.push(item)).map_err(|()| Unsure)?;
    s.ws();
    if s.i == text.len() { Ok(items) } else { Err(Unsure) }
}

/// Each field of the JSON object `text` to `each`: its key (plain ASCII) and its value's text.
fn walk<'a>(text: &'a [u8], mut each: impl FnMut(&'a [u8], &'a [u8]) -> Result<(), ()>) -> Result<(), ()> {
    let mut s = Scan { b: text, i: 0 };
    s.ws();
    if s.peek() != Some(b'{') {
        return Err(());
    }
    s.object(DEPTH, |plain, name, value| {
        // A key serde_json would unescape or check as UTF-8 is left to it.
        if plain && name.is_ascii() { each(name, value) } else { Err(()) }
    })?;
    s.ws();
    if s.i == text.len() { Ok(()) } else { Err(()) }
}

struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

const ONES: u64 = u64::from_le_bytes([0x01; 8]);
const HIGHS: u64 = u64::from_le_bytes([0x80; 8]);

/// The bytes of `v` below `n` (`n <= 128`) have their top bit set in the result, and the lowest
/// such bit is exact (a borrow may mark bytes above it too).
const fn below(v: u64, n: u8) -> u64 {
    v.wrapping_sub(ONES * n as u64) & !v
}

/// The bytes of `v` that end a JSON string's plain run (a control character, `"` or `\\`) have
/// their top bit set, the lowest one exactly.
const fn stops(v: u64) -> u64 {
    (below(v, 0x20) | below(v ^ (ONES * 0x22), 1) | below(v ^ (ONES * 0x5c), 1)) & HIGHS
}

/// Whether `s` goes into a JSON string as it is: no control character, quote or backslash
/// (eight bytes at a time; a byte-by-byte check was some 4 instructions a byte).
pub fn plain(s: &[u8]) -> bool {
    let mut chunks = s.chunks_exact(8);
    let clean =
        chunks.by_ref().all(|c| c.try_into().is_ok_and(|c: [u8; 8]| stops(u64::from_le_bytes(c)) == 0));
    clean && chunks.remainder().iter().all(|&b| b >= 0x20 && b != b'"' && b != b'\\')
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Result<u8, ()> {
        let c = self.peek().ok_or(())?;
        self.i += 1;
        Ok(c)
    }

    fn take(&mut self, c: u8) -> bool {
        let is = self.peek() == Some(c);
        self.i += usize::from(is);
        is
    }

    fn eat(&mut self, c: u8) -> Result<(), ()> {
        if self.take(c) { Ok(()) } else { Err(()) }
    }

    /// JSON's whitespace, as serde_json skips it.
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\t' | b'\r')) {
            self.i += 1;
        }
    }

    /// An object, at its `{`, at most `depth` deep: each field to `each`, with whether its key has
    /// no escape, the key's text between its quotes and the value's text.
    fn object(
        &mut self,
        depth: u32,
        mut each: impl FnMut(bool, &'a [u8], &'a [u8]) -> Result<(), ()>,
    ) -> Result<(), ()> {
        let depth = depth.checked_sub(1).ok_or(())?;
        self.i += 1;
        self.ws();
        if self.take(b'}') {
            return Ok(());
        }
        loop {
            if self.peek() != Some(b'"') {
                return Err(());
            }
            let start = self.i + 1;
            let plain = self.string()?;
            let name = self.b.get(start..self.i - 1).ok_or(())?;
            self.ws();
            self.eat(b':')?;
            self.ws();
            let at = self.i;
            self.value(depth)?;
            each(plain, name, self.b.get(at..self.i).ok_or(())?)?;
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b'}' => return Ok(()),
                _ => return Err(()),
            }
        }
    }

    /// A value: whatever serde_json's `ignore_value` takes, at most `depth` deep.
    fn value(&mut self, depth: u32) -> Result<(), ()> {
        match self.peek().ok_or(())? {
            b'"' => self.string().map(drop),
            b'{' => self.object(depth, |_, _, _| Ok(())),
            b'[' => self.array(depth, |_| {}),
            b't' => self.word(b"true"),
            b'f' => self.word(b"false"),
            b'n' => self.word(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(()),
        }
    }

    /// An array, at its `[`, at most `depth` deep: each item's text to `each`.
    fn array(&mut self, depth: u32, mut each: impl FnMut(&'a [u8])) -> Result<(), ()> {
        let depth = depth.checked_sub(1).ok_or(())?;
        self.i += 1;
        self.ws();
        if self.take(b']') {
            return Ok(());
        }
        loop {
            let at = self.i;
            self.value(depth)?;
            each(self.b.get(at..self.i).ok_or(())?);
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b']' => return Ok(()),
                _ => return Err(()),
            }
        }
    }

    fn word(&mut self, w: &[u8]) -> Result<(), ()> {
        if self.b.get(self.i..self.i + w.len()) == Some(w) {
            self.i += w.len();
            Ok(())
        } else {
            Err(())
        }
    }

    fn digits(&mut self) -> usize {
        let from = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        self.i - from
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`. A digit after a leading `0` is left
    /// unread, for the caller to refuse (serde_json refuses it too). A number that may be out of
    /// `f64`'s range (300 digits before the point or more, or an exponent of three digits or
    /// more) is left to serde_json, which refuses one as a value though it skips it.
    fn number(&mut self) -> Result<(), ()> {
        self.take(b'-');
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => {
                if self.digits() >= 299 {
                    return Err(());
                }
            }
            _ => return Err(()),
        }
        if self.take(b'.') && self.digits() == 0 {
            return Err(());
        }
        if self.take(b'e') || self.take(b'E') {
            if !self.take(b'+') {
                self.take(b'-');
            }
            if !matches!(self.digits(), 1 | 2) {
                return Err(());
            }
        }
        Ok(())
    }

    /// A string, at its opening quote: whether it has no escape. A control character, a bad escape
    /// or no closing quote: `Err`, as serde_json refuses them. (Its bytes are not checked as UTF-8,
    /// as serde_json does not check a string it skips.)
    fn string(&mut self) -> Result<bool, ()> {
        self.i += 1;
        let mut plain = true;
        loop {
            // Most strings are short: eight bytes at a time, twice, up to the first quote,
            // backslash or control character (where serde_json's own skip stops), ...
            let mut at = None;
            for _ in 0..2 {
                let Some(chunk) = self.b.get(self.i..self.i + 8) else { break };
                let v = u64::from_le_bytes(chunk.try_into().map_err(drop)?);
                let stop = stops(v);
                if stop != 0 {
                    at = Some((stop.trailing_zeros() / 8) as usize);
                    break;
                }
                self.i += 8;
            }
            // ... and a long one's rest to its next quote or backslash (`memchr2`: vector code
            // where the CPU has it), the run before it checked for control characters by its least
            // byte (vector code too).
            // (A stop found in a chunk has no control character before it: the chunk's test
            // stops at one too.)
            let at = match at {
                Some(at) => at,
                None => {
                    let rest = self.b.get(self.i..).ok_or(())?;
                    let at = memchr::memchr2(b'"', b'\\', rest).ok_or(())?;
                    if rest.get(..at).ok_or(())?.iter().copied().min().is_some_and(|least| least < 0x20) {
                        return Err(());
                    }
                    at
                }
            };
            self.i += at;
            match self.next()? {
                b'"' => return Ok(plain),
                b'\\' => plain = false,
                _ => return Err(()),
            }
            match self.next()? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                b'u' => {
                    let hex = self.b.get(self.i..self.i + 4).ok_or(())?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return Err(());
                    }
                    self.i += 4;
                }
                _ => return Err(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::value::RawValue;

    use super::*;

    #[derive(serde::Deserialize)]
    struct Answer {
        kv_transfer_params: Option<Box<RawValue>>,
    }

    /// serde_json's reading of `text`: the field's text, or `None` for an error.
    fn serde(text: &[u8]) -> Option<Option<String>> {
        serde_json::from_slice::<Answer>(text).ok().map(|a| a.kv_transfer_params.map(|p| p.get().to_owned()))
    }

    /// The scan agrees with serde_json where it answers at all.
    fn agrees(text: &[u8]) -> Result<bool, String> {
        match top_field(text, "kv_transfer_params") {
            Err(Unsure) => Ok(false),
            Ok(found) => match serde(text) {
                Some(s) if s.as_deref() == found => Ok(true),
                other => {
                    Err(format!("{:?}: scan {found:?}, serde_json {other:?}", String::from_utf8_lossy(text)))
                }
            },
        }
    }

    const VLLM: &str = r#"{"id":"cmpl-9d1c","object":"text_completion","created":1764400000,"model":"m",
        "choices":[{"index":0,"text":"\n","logprobs":null,"finish_reason":"length","stop_reason":null,
        "token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null}],"service_tier":null,
        "system_fingerprint":null,"usage":{"prompt_tokens":221,"total_tokens":222,"completion_tokens":1,
        "prompt_tokens_details":null},"kv_transfer_params":{"do_remote_prefill":true,
        "do_remote_decode":false,"remote_block_ids":[[1,2,3,4,5,6,7,8,9,10,11,12,13,14]],
        "remote_engine_id":"0f3c-é","remote_request_id":"cmpl-x-0","remote_host":"127.0.0.1",
        "remote_port":5600,"tp_size":1,"remote_blocks_expiry_time":1.764e9,"x":[-0.5e-3,true,false,{}]}}"#;

    /// A real answer's field is found by the scan, as serde_json finds it.
    #[test]
    fn a_vllm_answer_is_scanned() {
        assert_eq!(agrees(VLLM.as_bytes()), Ok(true));
        let params = top_field(VLLM.as_bytes(), "kv_transfer_params").ok().flatten().unwrap_or_default();
        assert!(params.starts_with(r#"{"do_remote_prefill":true,"#) && params.ends_with("{}]}"), "{params}");
        for (text, want) in [
            (r#"{}"#, Ok(None)),
            (r#" { "a" : [ ] , "kv_transfer_params" : null } "#, Ok(None)),
            (r#"{"kv_transfer_params":[1, "x"]}"#, Ok(Some(r#"[1, "x"]"#))),
            (r#"{"kv_transfer_params":"é\"\u00e9"}"#, Ok(Some(r#""é\"\u00e9""#))),
        ] {
            assert_eq!(top_field(text.as_bytes(), "kv_transfer_params"), want, "{text}");
            assert_eq!(agrees(text.as_bytes()), Ok(true), "{text}");
        }
    }

    /// What serde_json refuses, the scan leaves to it; and what it is not sure of.
    #[test]
    fn what_it_is_not_sure_of_is_left_to_serde_json() {
        for text in [
            "",
            "[]",
            r#"[{"do_remote_prefill":true}]"#,
            r#"{"kv_transfer_params":1,"kv_transfer_params":2}"#,
            r#"{"kv_transfer_params":null,"kv_transfer_params":2}"#,
            r#"{"kv_transfer_p\u0061rams":1}"#,
            r#"{"é":1}"#,
            r#"{"a":01}"#,
            r#"{"a":1.}"#,
            r#"{"a":-}"#,
            r#"{"a":1e}"#,
            r#"{"a":tru}"#,
            r#"{"a":[1,]}"#,
            r#"{"a":1,}"#,
            r#"{"a":"\x"}"#,
            r#"{"a":"\u12g4"}"#,
            "{\"a\":\"\t\"}",
            "{\"a\":\"ab\tcdefghijklmnop\"}",
            "{\"a\":\"0123456789abcdefghij\u{1f}k\"}",
            r#"{"a":1} x"#,
            r#"{"a":{"b"}}"#,
            r#"{"a":"#,
            r#"{"a":"12345678"#,
        ] {
            assert_eq!(top_field(text.as_bytes(), "kv_transfer_params"), Err(Unsure), "{text}");
        }
        let deep = format!(r#"{{"a":{}{}}}"#, "[".repeat(200), "]".repeat(200));
        assert_eq!(top_field(deep.as_bytes(), "kv_transfer_params"), Err(Unsure));
        assert!(serde(deep.as_bytes()).is_some(), "serde_json skips any depth");
        // Not UTF-8 in the field: serde_json refuses it; elsewhere it is skipped unread.
        assert_eq!(top_field(b"{\"kv_transfer_params\":\"\xff\"}", "kv_transfer_params"), Err(Unsure));
        assert_eq!(agrees(b"{\"a\":\"\xff\",\"kv_transfer_params\":1}"), Ok(true));
    }

    /// A quote, an escape or a control character at every offset of a string, among bytes that
    /// are not ASCII, across the eight-byte steps and into the search after them.
    #[test]
    fn every_offset_of_a_string_is_read_as_serde_json_reads_it() {
        for len in 0..40 {
            for at in 0..=len {
                for special in ["\"", "\\n", "\\u00e9", "\u{1f}", "\\", "\\u12", "é"] {
                    let mut inner: String = (0..len).map(|i| if i % 5 == 4 { 'é' } else { 'x' }).collect();
                    let at = inner.char_indices().nth(at).map_or(inner.len(), |(i, _)| i);
                    inner.insert_str(at, special);
                    for text in [
                        format!(r#"{{"kv_transfer_params":"{inner}"}}"#),
                        format!(r#"{{"a":"{inner}","kv_transfer_params":["{inner}"]}}"#),
                    ] {
                        let valid = ["\\n", "\\u00e9", "é"].contains(&special);
                        let got = agrees(text.as_bytes());
                        assert!(if valid { got == Ok(true) } else { got.is_ok() }, "{text:?}: {got:?}");
                    }
                }
            }
        }
        let long = format!(r#"{{"a":"{}","kv_transfer_params":1}}"#, "x".repeat(40));
        assert_eq!(agrees(long.as_bytes()), Ok(true));
    }

    proptest! {
        /// On text made of JSON's pieces, right or wrong, the scan answers as serde_json does
        /// wherever it answers.
        #[test]
        fn the_scan_agrees_with_serde_json(pieces in prop::collection::vec(prop::sample::select(&[
            "{", "}", "[", "]", ",", ":", " ", "\"", "\\", "\\u00e9", "\\n", "a", "é", "\"a\"",
            "\"kv_transfer_params\"", "1", "-0.5e+3", "0", "01", "true", "null", "\u{1}", "12345678",
        ][..]), 0..24)) {
            let text = pieces.concat();
            prop_assert!(agrees(text.as_bytes()).is_ok(), "{:?}", agrees(text.as_bytes()));
            let wrapped = format!(r#"{{"a":{text},"kv_transfer_params":{text}}}"#);
            prop_assert!(agrees(wrapped.as_bytes()).is_ok(), "{:?}", agrees(wrapped.as_bytes()));
        }
    }
}
