//! The engine contract of the native handoff: the `baton` object the gateway adds to a completion
//! or chat request it sends to an engine, typed once for both sides (the gateway writes it, an
//! engine embedding this crate reads it).
//!
//! - to a prefill engine: `{"request_id": "<32 hex>", "epoch": N, "decoders": [{"rank": r, "addr":
//!   "host:port", "chunks": [[chunk, page, generation], ...]}, ...], "prompt_token_ids": [...]}`:
//!   write the prompt's KV chunks into those decoder ranks' reserved pages;
//! - to a decode engine: `{"request_id": ..., "epoch": N, "prompt_token_ids": [...]}`: the KV is in
//!   this engine's PD buffer under that request; consume it and generate.
//!
//! `prompt_token_ids` are the gateway's count of the prompt; both legs use them instead of
//! tokenizing again, so they agree on every token.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::ids::{PageAddr, RequestId, RequestKey};

/// The request field's name.
pub const FIELD: &str = "baton";

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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

impl BatonParams {
    /// The fields for `key`.
    pub fn new(key: RequestKey, decoders: Vec<DecoderTarget>, prompt_token_ids: Option<Vec<u32>>) -> Self {
        Self { request_id: format!("{:032x}", key.request.0), epoch: key.epoch, decoders, prompt_token_ids }
    }

    /// The request key the fields name.
    pub fn key(&self) -> Result<RequestKey, String> {
        let id = u128::from_str_radix(&self.request_id, 16).map_err(|_| {
            let short: String = self.request_id.chars().take(40).collect();
            format!("baton.request_id must be up to 32 hex digits, got {short:?}")
        })?;
        Ok(RequestKey::new(RequestId(id), self.epoch))
    }
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
    }
}
