//! A request body's JSON object, with its large fields' text kept as the client wrote it.
//!
//! Every engine leg writes the client's object again, less or plus a few fields
//! (`handoff::legs::Patched`). serde_json writes a string a byte at a time through its escape
//! table (`format_escaped_str`: 3.4% of the gateway's user time in the proxy benchmark, with a 1 KB
//! prompt and two legs, behind only memmove and malloc), while reading one it skips a string eight
//! bytes at a time. So each top-level field of at least [`RAW_MIN_BYTES`] keeps its JSON text as the
//! client wrote it (a slice of the body, not a copy: the object holds the body's buffer while it
//! lives), and a leg writes that text as it is; only the small fields are written from their
//! values.
//!
//! Measured before the fields were found by [`scan::top_fields`] (release, the CPU machine,
//! `cargo test --release -p baton-gateway --lib object::timing -- --ignored --nocapture`): a 1.1 KB completion body parses in 0.76 µs instead of 0.56 and each
//! leg's body is written in 0.25 µs instead of 0.59–0.75; a 32 KB one parses in 7.4 µs instead of
//! 4.1 and each leg's body is written in 0.4 µs instead of 9–15. Every mode writes at least two.
//!
//! What an engine reads is the client's JSON: the same fields in the same order, a large one byte
//! for byte. A parser that keeps the last of a key given twice (serde_json, Python's `json`) reads
//! the values the gateway validated; escapes (`\u00e9`) and numbers keep the client's spelling, and
//! a key given twice inside a large field reaches the engine twice, as the client sent it.
//!
//! One difference from parsing the body whole: serde_json's depth limit (128) counts from each
//! top-level field, so a field may nest one level deeper than before.

use std::ops::Deref;

use bytes::Bytes;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{GatewayError, scan};

/// Fields whose JSON text is shorter than this are written from their values.
pub const RAW_MIN_BYTES: usize = 64;

/// A JSON object (see the module's text). It derefs to its [`Map`].
#[derive(Debug, Default, Clone)]
pub struct Object {
    map: Map<String, Value>,
    /// By the field's index in `map`, each large field's JSON text as the client wrote it: a
    /// slice of the body (a copy of a 1 KB prompt was one allocation and 1 KB written of each
    /// request's; of a 100 KB one, 100 KB).
    text: Vec<(usize, Bytes)>,
    /// Each key's [`key_bit`], or'ed: a name whose bit is clear is not a key here.
    keys: u64,
}

impl Object {
    /// Parses a request body, which must be a JSON object. A body refused is refused with
    /// serde_json's own words for it, from a parse of the body whole. The large fields' text is
    /// kept as slices of `body`.
    pub fn parse(body: &Bytes) -> Result<Self, GatewayError> {
        if body.len() < RAW_MIN_BYTES {
            return Self::parse_whole(body);
        }
        match Self::parse_kept(body) {
            Some(o) => Ok(o),
            // Not an object, or not JSON: the whole parse says which, and where, as it always has
            // (a field parsed on its own would name its place in the field, not in the body).
            None => Self::parse_whole(body),
        }
    }

    /// The body as one value, keeping no text.
    fn parse_whole(body: &[u8]) -> Result<Self, GatewayError> {
        match serde_json::from_slice(body).map_err(|e| GatewayError::BadJson(e.to_string()))? {
            Value::Object(map) => Ok(map.into()),
            _ => Err(GatewayError::BadJson("the body must be a JSON object".into())),
        }
    }

    /// The body field by field, keeping the large fields' text; `None` if it is not a JSON object.
    /// The fields are found by [`scan::top_fields`], or by serde_json where the scan is not sure.
    fn parse_kept(body: &Bytes) -> Option<Self> {
        match scan::top_fields(body) {
            Ok(fields) => Self::of_fields(body, fields),
            Err(scan::Unsure) => {
                let Ok(TopLevel(Some(fields))) = serde_json::from_slice::<TopLevel<'_>>(body) else {
                    return None;
                };
                Self::of_fields(body, fields.into_iter().map(|(k, raw)| (k, raw.get().as_bytes())).collect())
            }
        }
    }

    /// The object of these keys and values' texts (slices of `body`), in order.
    fn of_fields<K: AsRef<str> + Into<String>>(body: &Bytes, fields: Vec<(K, &[u8])>) -> Option<Self> {
        let mut map = Map::new();
        let mut text = Vec::new();
        let mut keys = 0;
        for (key, raw) in fields {
            let raw = std::str::from_utf8(raw).ok()?;
            let value = value_of(raw)?;
            // A key given twice keeps its first place and its last value, as serde_json's own map
            // (`preserve_order`: the kept text is found by the field's place in the map).
            let index = match field(&map, key.as_ref()) {
                Some(_) => map.keys().position(|k| k == key.as_ref()).unwrap_or(map.len()),
                None => map.len(),
            };
            text.retain(|(i, _)| *i != index);
            if raw.len() >= RAW_MIN_BYTES {
                text.push((index, body.slice_ref(raw.as_bytes())));
            }
            keys |= key_bit(key.as_ref());
            map.insert(key.into(), value);
        }
        Some(Self { map, text, keys })
    }

    /// The field `key` ([`field`]: scanned for, not hashed, in a small object; not looked for at
    /// all when its [`key_bit`] is clear). It stands before the map's own `get`, which `Deref`
    /// would give.
    #[inline(always)]
    pub fn get(&self, key: &str) -> Option<&Value> {
        if self.keys & key_bit(key) == 0 {
            return None;
        }
        field(&self.map, key)
    }

    /// Whether the field `key` is there ([`Object::get`]).
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// The map. (An `Object` is never changed after it is made: its kept text stays its values'.)
    pub fn map(&self) -> &Map<String, Value> {
        &self.map
    }

    /// The JSON text the client wrote for the field at `index` (in the map's order), if it was
    /// kept.
    pub fn text_at(&self, index: usize) -> Option<&[u8]> {
        self.text.iter().find(|(i, _)| *i == index).map(|(_, t)| &**t)
    }
}

impl From<Map<String, Value>> for Object {
    /// An object made by the gateway, with no text kept.
    fn from(map: Map<String, Value>) -> Self {
        let keys = map.keys().fold(0, |bits, k| bits | key_bit(k));
        Self { map, text: Vec::new(), keys }
    }
}

impl Deref for Object {
    type Target = Map<String, Value>;

    fn deref(&self) -> &Map<String, Value> {
        &self.map
    }
}

/// The value of a field's JSON text, as the first pass kept it. A large string with no escape
/// (a prompt, most often) is its text between the quotes: that pass already refused what a string
/// may not hold (a control character, a bare quote; the caller, bytes that are not UTF-8), and with
/// no `\\` the text is the string. A second parse of it was 1.8% of the gateway's instructions for
/// a request with a 1 KB prompt (`scripts/count-instructions`).
fn value_of(text: &str) -> Option<Value> {
    match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        // `memchr`'s search (AVX2), not `str::contains`'s (core's `memchr`, a word at a time).
        Some(s) if text.len() >= RAW_MIN_BYTES && memchr::memchr(b'\\', s.as_bytes()).is_none() => {
            Some(Value::String(s.to_owned()))
        }
        _ => serde_json::from_str(text).ok(),
    }
}

/// One of 64 bits for a field's name, from its length and its first and last bytes: an
/// [`Object`] keeps its keys' bits, so a lookup of a name that is not there (most of the some
/// thirty names the checks look up, in a request of a handful of fields) ends at one test of a
/// bit. For a literal name the optimiser folds it to a constant where the lookup is inlined. Two
/// names may share a bit: that lookup scans, as every lookup did before.
#[inline(always)]
pub(crate) const fn key_bit(key: &str) -> u64 {
    let b = key.as_bytes();
    let (first, last) = match b {
        [] => (0, 0),
        [f, .., l] => (*f, *l),
        [f] => (*f, *f),
    };
    let h = (b.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (first as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ (last as u64).wrapping_mul(0x1656_67B1_9E37_79F9);
    1 << (h >> 58)
}

/// Objects of up to this many fields are scanned rather than hashed into ([`field`]).
const SCAN_FIELDS: usize = 16;

/// The field `key` of `map`. A request has a handful of fields, and the gateway looks up some
/// thirty names in it (the checks, each leg's body): a scan of the fields in order (most names
/// differ in length, so most comparisons stop there) is cheaper than hashing each name with the
/// map's SipHash (2% of the gateway's user time in the proxy benchmark's profile for the checks;
/// 1.2% of its instructions for the legs' bodies, `scripts/count-instructions`' profile).
pub fn field<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    if map.len() <= SCAN_FIELDS {
        map.iter().find_map(|(k, v)| (k == key).then_some(v))
    } else {
        map.get(key)
    }
}

/// A body's top level: its fields' keys and JSON text when it is an object, else `None`.
struct TopLevel<'a>(Option<Vec<(String, &'a RawValue)>>);

impl<'de> serde::Deserialize<'de> for TopLevel<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TopVisitor)
    }
}

struct TopVisitor;

impl<'de> Visitor<'de> for TopVisitor {
    type Value = TopLevel<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
        let mut fields = Vec::with_capacity(m.size_hint().unwrap_or(8));
        while let Some(entry) = m.next_entry::<String, &'de RawValue>()? {
            fields.push(entry);
        }
        Ok(TopLevel(Some(fields)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Self::Value, A::Error> {
        while s.next_element::<IgnoredAny>()?.is_some() {}
        Ok(TopLevel(None))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// [`Object::parse`] of a copy of `body`.
    pub(super) fn parse(body: &[u8]) -> Result<Object, GatewayError> {
        Object::parse(&Bytes::copy_from_slice(body))
    }

    fn long(c: char) -> String {
        std::iter::repeat_n(c, RAW_MIN_BYTES).collect()
    }

    #[test]
    fn parses_as_serde_json_does_and_keeps_only_large_fields_text() {
        let prompt = format!("caf\\u00e9 {}", long('x'));
        let body = format!(r#"{{"model": "m", "prompt": "{prompt}", "n": 1, "stop": ["{}"]}}"#, long('s'));
        let o = parse(body.as_bytes()).unwrap();
        let want: Map<String, Value> = serde_json::from_str(&body).unwrap();
        assert_eq!(*o, want);
        assert!(o.text_at(0).is_none(), "a short field is written from its value");
        assert_eq!(o.text_at(1).unwrap(), format!("\"{prompt}\"").as_bytes(), "as the client wrote it");
        assert!(o.text_at(2).is_none());
        assert_eq!(o.text_at(3).unwrap(), format!("[\"{}\"]", long('s')).as_bytes());
        // Slices of the body read, not copies of them.
        let read = Bytes::from(body.clone());
        let o = Object::parse(&read).unwrap();
        for text in [o.text_at(1).unwrap(), o.text_at(3).unwrap()] {
            assert!(read.as_ptr_range().contains(&text.as_ptr()), "a copy of the body's text");
        }
        // Keys the scan leaves to serde_json (an escape, a byte that is not ASCII): the same.
        for key in [r#""pr\u006fmpt""#, r#""prompté""#] {
            let body = format!(r#"{{"model": "m", {key}: "{prompt}", "n": 1}}"#);
            assert!(scan::top_fields(body.as_bytes()).is_err(), "{key}");
            let o = parse(body.as_bytes()).unwrap();
            assert_eq!(*o, serde_json::from_str::<Map<String, Value>>(&body).unwrap());
            assert_eq!(o.text_at(1).unwrap(), format!("\"{prompt}\"").as_bytes());
        }
    }

    /// A field's value read from its kept text is what serde_json reads there, a large string
    /// taken between its quotes or parsed; a large string the first pass would refuse is refused.
    #[test]
    fn values_from_kept_text_are_serde_jsons() {
        let l = long('x');
        for text in [
            format!("\"{l}\""),
            format!("\"caf\u{e9} \u{1f600} {l}\""),
            format!("\"{l}\\u00e9\""),
            format!("\"{l}\\\"\""),
            format!("\"{l}\\\\\""),
            "\"short\"".into(),
            format!("[\"{l}\"]"),
            "12".into(),
        ] {
            let want: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(value_of(&text), Some(want), "{text}");
        }
        for bad in [format!("{{\"prompt\": \"{l}\u{1}\"}}"), format!("{{\"prompt\": \"{l}\\q\"}}")] {
            assert!(parse(bad.as_bytes()).is_err(), "{bad:?}");
        }
        let mut not_utf8 = format!("{{\"prompt\": \"{l}\"}}").into_bytes();
        not_utf8[20] = 0xff;
        assert!(parse(&not_utf8).is_err(), "a large string that is not UTF-8");
    }

    /// A field is found as the map finds it, in objects scanned and hashed into alike, made from
    /// a map or parsed (the keys' bits are kept both ways), whatever bits the names share.
    #[test]
    fn fields_are_found_as_the_map_finds_them() {
        let names =
            ["model", "prompt", "messages", "max_tokens", "min_tokens", "temperature", "tools", "n", "é", ""];
        let bits: std::collections::HashSet<u64> = names.iter().map(|k| key_bit(k)).collect();
        assert!(bits.len() < names.len(), "some of these names share a bit");
        for n in 0..=SCAN_FIELDS + 4 {
            let mut map: Map<String, Value> = (0..n).map(|i| (format!("k{i}"), json!(i))).collect();
            map.extend(names.iter().take(n).map(|k| ((*k).to_owned(), json!(k))));
            map.insert("pad".into(), json!(long('p')));
            let parsed = parse(&serde_json::to_vec(&map).unwrap_or_default()).unwrap_or_default();
            for o in [Object::from(map.clone()), parsed] {
                assert_eq!(*o, map);
                let keys = (0..=n).map(|i| format!("k{i}"));
                for key in
                    keys.chain(names.iter().map(|k| (*k).to_owned())).chain(["k".into(), "mode".into()])
                {
                    assert_eq!(o.get(&key), map.get(&key), "{n} fields, {key:?}");
                    assert_eq!(o.contains_key(&key), map.contains_key(&key), "{n} fields, {key:?}");
                }
            }
        }
    }

    #[test]
    fn a_key_given_twice_keeps_its_first_place_and_last_value() {
        let body = format!(r#"{{"prompt": "{}", "n": 2, "prompt": "short"}}"#, long('a'));
        let o = parse(body.as_bytes()).unwrap();
        assert_eq!(*o, serde_json::from_str::<Map<String, Value>>(&body).unwrap());
        assert_eq!(o.keys().collect::<Vec<_>>(), ["prompt", "n"]);
        assert!(o.text_at(0).is_none(), "the long first value is not the field's");
        let body = format!(r#"{{"prompt": "short", "n": 2, "prompt": "{}"}}"#, long('b'));
        let o = parse(body.as_bytes()).unwrap();
        assert_eq!(o.text_at(0).unwrap(), format!("\"{}\"", long('b')).as_bytes());
        assert_eq!(o["prompt"], json!(long('b')));
    }

    /// A body refused is refused in serde_json's words for the whole body, as before the text was
    /// kept: short bodies and long ones, errors found by the scan and errors found in one field.
    #[test]
    fn refuses_what_is_not_an_object_as_before() {
        let pad = format!("\"pad\": \"{}\"", long('p'));
        let long_bodies = [
            format!("[{pad}, 1e400]"),
            format!("{{{pad}, \"a\": 1"),
            format!("{{{pad}, \"a\": 1}} x"),
            format!("{{{pad}, \"a\": tru}}"),
            format!("{{{pad}, \"a\": \"\\ud800\"}}"),
            format!("{{{pad}, \"n\": 1e400}}"),
            format!("{{{pad}, \"stop\": [\"a\",]}}"),
            format!("{{{pad}, \"a\": {{\"b\": 1,}}}}"),
            format!("[{{{pad}}}]"),
        ];
        let short = ["[1, {\"a\": 2}]", "\"x\"", "null", "3.5", "{\"a\": 1", "{\"a\": 1} x", "{\"a\": tru}"];
        for body in short.iter().map(|b| (*b).to_owned()).chain(long_bodies) {
            let want = match serde_json::from_slice::<Value>(body.as_bytes()) {
                Ok(_) => "the body must be a JSON object".to_owned(),
                Err(e) => e.to_string(),
            };
            match parse(body.as_bytes()) {
                Err(GatewayError::BadJson(e)) => assert_eq!(e, want, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
    }
}

/// What the kept text saves (the figures in the module's text): `--ignored --nocapture`, release.
#[cfg(test)]
mod timing {
    use std::hint::black_box;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::handoff::legs::Patched;

    fn per_call(n: u32, mut f: impl FnMut()) -> Duration {
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        t.elapsed() / n
    }

    #[test]
    #[ignore = "a measurement, not a check"]
    fn parse_and_leg_bodies() {
        for sentences in [23, 700] {
            let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(sentences);
            let body = serde_json::to_vec(
                &serde_json::json!({"model": "baton-sim", "prompt": prompt, "max_tokens": 1, "temperature": 0}),
            )
            .unwrap_or_default();
            let n = 4_000_000 / u32::try_from(body.len()).unwrap_or(u32::MAX).max(1);
            let value = per_call(n, || drop(black_box(serde_json::from_slice::<Value>(&body))));
            let read = Bytes::from(body.clone());
            let object = per_call(n, || drop(black_box(Object::parse(&read))));
            let kept = Object::parse(&read).unwrap_or_default();
            let plain = Object::from(kept.map().clone());
            let leg = |o: &Object| {
                per_call(n, || {
                    let mut out = Vec::with_capacity(body.len() + 64);
                    let _ = Patched::new(o, &[]).set("kv_transfer_params", &1).write(&mut out);
                    black_box(out);
                })
            };
            eprintln!(
                "body {} B: parsed in {value:?} as a value, {object:?} as an object; a leg's body written in \
                 {:?} from the values, {:?} from the kept text",
                body.len(),
                leg(&plain),
                leg(&kept)
            );
        }
    }
}
