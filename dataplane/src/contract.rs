//! The engine contract of the native handoff: the `baton` object the gateway adds to a completion
//! or chat request it sends to an engine, typed once for both sides (the gateway writes it, an
//! engine embedding this crate reads it).
//!
//! - to a prefill engine: `{"request_id": "<32 hex>", "epoch": N, "decoders": [{"rank": r, "addr":
//!   "host:port", "chunks": [[chunk, page, generation], ...]}, ...], "prompt_token_ids": [...]}`:
//!   write the prompt's KV chunks into those decoder ranks' reserved pages;
//! - to a prefill engine whose gateway leaves the reservation to it (`reserve = "prefiller"` on the
//!   decode pool): the same, each decoder's `chunks` empty and `"reserve": {"chunks": N,
//!   "lease_ms": L}` added: reserve `N` pages on each of those ranks on the connection that writes
//!   them, write them by chunk, and answer HTTP 507 ([`KV_BUSY_STATUS`]) when a rank has no room;
//! - to a decode engine: `{"request_id": ..., "epoch": N, "prompt_token_ids": [...]}`: the KV is in
//!   this engine's PD buffer under that request; consume it and generate;
//! - to a decode engine whose ranks said they wait for the KV (`RankServer::set_decode_waits`),
//!   `"kv_wait_ms": N` added: sent alongside the prefill, so the KV may still be arriving; take it
//!   with `RankServer::take_ready` within `N` ms and answer nothing before it is in;
//! - to a decode engine, `"local_prefill": true` added: no KV comes (nothing was reserved, no
//!   prefill ran): compute the prompt from the engine's own prefix cache, as a plain request, and
//!   generate. The gateway sends this only to a decoder whose KV events say it holds nearly all of
//!   the prompt (conditional disaggregation, `[routing.cache] skip_prefill`).
//!
//! `prompt_token_ids` are the gateway's count of the prompt; both legs use them instead of
//! tokenizing again, so they agree on every token. They are a JSON array of the ids, or, where the
//! decode pool says `token_ids = "base64"`, a string: the ids as little-endian `u32`s in standard,
//! padded base64 (RFC 4648), four bytes an id ([`ids_base64`]). The string is about as long as the
//! array and about 3.4 times cheaper to read (`bench/README.md`, "The contract's token ids").
//! [`BatonParams`] reads either.
//!
//! [`Generation`] is the part of an OpenAI completion or chat request both sides read (the rest of
//! the request passes through untouched).

use std::net::SocketAddr;
use std::num::ParseIntError;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::ids::{PageAddr, RequestId, RequestKey};

/// The request field's name.
pub const FIELD: &str = "baton";

/// A request's prompt as the client sent it: text, or token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// One chat message: its role and its content (a string or a list of content parts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: serde_json::Value,
}

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields of a `/v1/completions` or `/v1/chat/completions` request the gateway and an engine
/// both read.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    pub model: Option<String>,
    /// Completions.
    pub prompt: Option<Prompt>,
    /// Chat.
    pub messages: Option<Vec<ChatMessage>>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
}

impl Generation {
    /// The token limit the request sets (`max_completion_tokens` wins, as in OpenAI's API).
    pub fn max_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

/// A message's text: a string, or the text parts of a content list.
pub fn content_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(parts) => {
            parts.iter().filter_map(|p| p.get("text").and_then(serde_json::Value::as_str)).collect()
        }
        _ => String::new(),
    }
}

/// The fallback chat template: `<|role|>\ncontent\n` per message, then `<|assistant|>\n`. The
/// gateway renders a chat with it for a model configured without its tokenizer, and baton-sim's
/// model is this template, so the demo counts exactly what its engines count.
pub fn fallback_chat(messages: &[(String, String)]) -> String {
    let mut s =
        String::with_capacity(messages.iter().map(|(r, c)| r.len() + c.len() + 5).sum::<usize>() + 14);
    for (role, content) in messages {
        s.push_str("<|");
        s.push_str(role);
        s.push_str("|>\n");
        s.push_str(content);
        s.push('\n');
    }
    s.push_str("<|assistant|>\n");
    s
}

/// One decoder rank's reserved pages, as a prefiller writes to them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecoderTarget {
    pub rank: u32,
    pub addr: SocketAddr,
    /// `(chunk, page, generation)` triples.
    pub chunks: Vec<(u32, u32, u32)>,
}

impl DecoderTarget {
    /// The target of rank `rank` at `addr` from its reservation's write addresses.
    pub fn new(rank: u32, addr: SocketAddr, pages: &[(u32, PageAddr)]) -> Self {
        Self { rank, addr, chunks: pages.iter().map(|(c, p)| (*c, p.page, p.generation)).collect() }
    }
}

/// The `baton` object of an engine request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatonParams {
    /// The request id in hex (up to 32 digits).
    pub request_id: String,
    #[serde(default)]
    pub epoch: u32,
    /// Prefill only: where to write.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decoders: Vec<DecoderTarget>,
    /// Written as a JSON array; read from an array or from the base64 string ([`ids_base64`]).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "read_ids")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Decode only: no KV comes through the PD buffer; compute the prompt locally.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub local_prefill: bool,
    /// Decode only: the KV may still be arriving (the gateway sent this request alongside the
    /// prefill): wait up to this many milliseconds for every rank's, and answer nothing before it
    /// is in. Sent only to ranks whose Welcome said they wait (`RankServer::set_decode_waits`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_wait_ms: Option<u32>,
    /// Prefill only: the gateway reserved nothing; reserve the pages on every rank of `decoders`
    /// (whose `chunks` are then empty) on the connection that writes them
    /// (`ProducerClient::queue_reserve`), and write each chunk by chunk (`PageAddr::BY_CHUNK`).
    /// A rank that refuses for room (`Busy`) is answered with HTTP [`KV_BUSY_STATUS`], so the
    /// gateway retries the request later instead of failing it, after fencing every rank (the
    /// pages the other ranks reserved are quarantined until then, outside the gateway's count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve: Option<ReserveOrder>,
}

/// What a prefiller that reserves for itself reserves on each decoder rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReserveOrder {
    /// Pages (chunks) of the request on each rank.
    pub chunks: u32,
    /// The reservation's lease, from when the rank takes it.
    pub lease_ms: u32,
}

/// The HTTP status a prefiller answers when a decoder rank refused the reservation it made for
/// itself for lack of room (`Busy`): 507 Insufficient Storage, which no engine answers otherwise.
/// The gateway cancels the attempt everywhere and retries it as a new epoch.
pub const KV_BUSY_STATUS: u16 = 507;

impl BatonParams {
    /// The fields for `key`.
    pub fn new(key: RequestKey, decoders: Vec<DecoderTarget>, prompt_token_ids: Option<Vec<u32>>) -> Self {
        Self {
            request_id: format!("{:032x}", key.request.0),
            epoch: key.epoch,
            decoders,
            prompt_token_ids,
            local_prefill: false,
            kv_wait_ms: None,
            reserve: None,
        }
    }

    /// The request key the fields name.
    pub fn key(&self) -> Result<RequestKey, ContractError> {
        let id = u128::from_str_radix(&self.request_id, 16).map_err(|source| {
            // A prefix is enough to recognise the value; the rest of an oversized id is not echoed.
            let got = self.request_id.chars().take(40).collect();
            ContractError::RequestId { got, source }
        })?;
        Ok(RequestKey::new(RequestId(id), self.epoch))
    }
}

/// `ids` as the contract's compact `prompt_token_ids`: little-endian `u32`s, standard padded base64.
pub fn ids_base64(ids: &[u32]) -> String {
    let mut out = String::with_capacity(ids_base64_len(ids));
    ids_base64_into(ids, &mut out);
    out
}

/// [`ids_base64`] appended to `out` (a writer that quotes it as a JSON string, which its alphabet
/// lets go unescaped, writes it once).
pub fn ids_base64_into(ids: &[u32], out: &mut String) {
    let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    // SIMD where the CPU has it (chosen at run time; scalar otherwise).
    base64_simd::STANDARD.encode_append(bytes, out);
}

/// The length of [`ids_base64`]`(ids)` (0 past `usize`, which no prompt reaches).
pub fn ids_base64_len(ids: &[u32]) -> usize {
    ids.len().checked_mul(4).and_then(|n| n.checked_add(2)).map_or(0, |n| n / 3 * 4)
}

/// The ids of a compact `prompt_token_ids` ([`ids_base64`]).
pub fn ids_from_base64(text: &str) -> Result<Vec<u32>, String> {
    let bytes = base64_simd::STANDARD
        .decode_to_vec(text)
        .map_err(|e| format!("prompt_token_ids is a string but not standard padded base64: {e}"))?;
    if bytes.len() % 4 != 0 {
        return Err(format!(
            "prompt_token_ids decodes to {} bytes, not a whole number of 4-byte ids",
            bytes.len()
        ));
    }
    Ok(bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

/// `prompt_token_ids` from a JSON array of ids or their base64 string; `null` is none.
fn read_ids<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<u32>>, D::Error> {
    struct Ids;
    impl<'de> serde::de::Visitor<'de> for Ids {
        type Value = Option<Vec<u32>>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an array of token ids or their base64 string")
        }

        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            ids_from_base64(v).map(Some).map_err(E::custom)
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut ids = Vec::new();
            while let Some(id) = seq.next_element::<u32>()? {
                ids.push(id);
            }
            Ok(Some(ids))
        }
    }
    d.deserialize_option(Ids)
}

/// Why the `baton` object of a request is unusable.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
#[non_exhaustive]
pub enum ContractError {
    /// `request_id` is not a hex number of at most 32 digits; `got` is its first 40 characters.
    #[error("baton.request_id must be up to 32 hex digits, got {got:?}")]
    RequestId {
        got: String,
        #[source]
        source: ParseIntError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fields_round_trip_and_omit_what_a_decoder_does_not_need() {
        let key = RequestKey::new(RequestId(0xabc), 3);
        let addr: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        let p = BatonParams::new(
            key,
            vec![DecoderTarget { rank: 0, addr, chunks: vec![(0, 5, 1)] }],
            Some(vec![1]),
        );
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["request_id"], "00000000000000000000000000000abc");
        assert_eq!(v["decoders"][0]["chunks"], serde_json::json!([[0, 5, 1]]));
        let back: BatonParams = serde_json::from_value(v).unwrap();
        assert_eq!(back.key(), Ok(key));
        let d = serde_json::to_value(BatonParams::new(key, Vec::new(), None)).unwrap();
        assert_eq!(d, serde_json::json!({"request_id": "00000000000000000000000000000abc", "epoch": 3}));
        let mut local = BatonParams::new(key, Vec::new(), Some(vec![1, 2]));
        local.local_prefill = true;
        let v = serde_json::to_value(&local).unwrap();
        assert_eq!(v["local_prefill"], true);
        assert_eq!(serde_json::from_value::<BatonParams>(v).unwrap(), local);
        let mut own = BatonParams::new(key, vec![DecoderTarget { rank: 0, addr, chunks: Vec::new() }], None);
        own.reserve = Some(ReserveOrder { chunks: 4, lease_ms: 30_000 });
        let v = serde_json::to_value(&own).unwrap();
        assert_eq!(v["reserve"], serde_json::json!({"chunks": 4, "lease_ms": 30_000}));
        assert_eq!(v["decoders"][0]["chunks"], serde_json::json!([]));
        assert_eq!(serde_json::from_value::<BatonParams>(v).unwrap(), own);
    }

    /// Every length through the encoder's SIMD blocks and their tails, against base64 written out
    /// six bits at a time (RFC 4648), and back.
    #[test]
    fn prompt_token_ids_of_any_length_are_rfc_4648_base64() {
        const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let reference = |bytes: &[u8]| -> String {
            let mut out = String::new();
            for c in bytes.chunks(3) {
                let n = u32::from(c[0]) << 16
                    | u32::from(c.get(1).copied().unwrap_or(0)) << 8
                    | u32::from(c.get(2).copied().unwrap_or(0));
                for k in 0..4 {
                    let six = (n >> (18 - 6 * k)) & 63;
                    out.push(if k <= c.len() { char::from(ALPHABET[six as usize]) } else { '=' });
                }
            }
            out
        };
        let mut x = 0x9e37_79b9_u32;
        let ids: Vec<u32> = (0..300)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x
            })
            .collect();
        for n in 0..=ids.len() {
            let bytes: Vec<u8> = ids[..n].iter().flat_map(|id| id.to_le_bytes()).collect();
            let text = ids_base64(&ids[..n]);
            assert_eq!(text, reference(&bytes), "{n} ids");
            assert_eq!(text.len(), ids_base64_len(&ids[..n]), "{n} ids");
            assert_eq!(ids_from_base64(&text).unwrap(), &ids[..n], "{n} ids");
        }
        // A byte outside the alphabet, anywhere in a long string (the SIMD loop's part, not only
        // its tail), is refused.
        let text = ids_base64(&ids[..75]);
        assert_eq!(text.len(), 400);
        for at in [0, 1, 37, 64, 150, 333, 397] {
            for bad in ["-", " ", "\n", "=", "é"] {
                let mut t = text.clone();
                t.replace_range(at..=at, bad);
                assert!(ids_from_base64(&t).is_err(), "{bad:?} at {at}");
            }
        }
    }

    #[test]
    fn prompt_token_ids_are_read_from_an_array_or_their_base64_string() {
        let ids = [1, 0x0102_0304, u32::MAX, 0];
        assert_eq!(ids_base64(&ids[..2]), "AQAAAAQDAgE=", "little-endian u32s, standard padded base64");
        for n in 0..=ids.len() {
            assert_eq!(ids_base64(&ids[..n]).len(), ids_base64_len(&ids[..n]), "{n} ids");
        }
        let read = |v: serde_json::Value| {
            serde_json::from_value::<BatonParams>(
                serde_json::json!({"request_id": "ab", "epoch": 1, "prompt_token_ids": v}),
            )
        };
        for v in [serde_json::json!(ids), serde_json::json!(ids_base64(&ids))] {
            assert_eq!(read(v.clone()).unwrap().prompt_token_ids.as_deref(), Some(&ids[..]), "{v}");
        }
        assert_eq!(read(serde_json::json!("")).unwrap().prompt_token_ids, Some(Vec::new()));
        assert_eq!(read(serde_json::Value::Null).unwrap().prompt_token_ids, None);
        let absent: BatonParams = serde_json::from_str(r#"{"request_id": "ab"}"#).unwrap();
        assert_eq!(absent.prompt_token_ids, None);
        // From the text a prefiller or decoder gets: the same ids either way.
        let text = format!(r#"{{"request_id": "ab", "prompt_token_ids": "{}"}}"#, ids_base64(&ids));
        assert_eq!(
            serde_json::from_str::<BatonParams>(&text).unwrap().prompt_token_ids.as_deref(),
            Some(&ids[..])
        );
        for (bad, says) in [
            (serde_json::json!("AQAAAAQDAgE"), "not standard padded base64"),
            (serde_json::json!("AQAAAAQDAg=="), "7 bytes, not a whole number of 4-byte ids"),
            (serde_json::json!("AQAA-AQDAgE="), "not standard padded base64"),
            (serde_json::json!("AQAAAAQDAgF="), "not standard padded base64"),
            (serde_json::json!([1, -2]), "invalid value"),
            (serde_json::json!(7), "an array of token ids or their base64 string"),
            (serde_json::json!({"ids": [1]}), "an array of token ids or their base64 string"),
        ] {
            let e = read(bad.clone()).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_fallback_chat_template_marks_each_role_and_the_answer() {
        let m = [("system".to_owned(), "be brief".to_owned()), ("user".to_owned(), "héllo".to_owned())];
        assert_eq!(fallback_chat(&m), "<|system|>\nbe brief\n<|user|>\nhéllo\n<|assistant|>\n");
        assert_eq!(fallback_chat(&[]), "<|assistant|>\n");
    }

    #[test]
    fn a_request_id_that_is_not_hex_is_refused_with_a_short_prefix() {
        let long = "z".repeat(100);
        let e = BatonParams {
            request_id: long,
            epoch: 0,
            decoders: Vec::new(),
            prompt_token_ids: None,
            local_prefill: false,
            kv_wait_ms: None,
            reserve: None,
        }
        .key()
        .unwrap_err();
        let ContractError::RequestId { got, .. } = &e;
        assert_eq!(got.len(), 40);
        assert_eq!(
            e.to_string(),
            format!("baton.request_id must be up to 32 hex digits, got {:?}", "z".repeat(40))
        );
    }
}
