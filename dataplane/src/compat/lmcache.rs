//! LMCache's PD backend messages, as its sender (prefiller), receiver (decoder) and proxy exchange
//! them: msgpack maps of `msgspec.Struct`s tagged by class name in a `type` field.
//!
//! Source: LMCache `lmcache/v1/storage_backend/pd_backend.py` (`PDMsgBase(msgspec.Struct, tag=True)`,
//! `AllocRequest`, `AllocResponse`, `ProxyNotif`; LMCache 0.3.x), and the proxy
//! `examples/disagg_prefill/disagg_proxy_server.py`, which PULLs `ProxyNotif` on `--proxy-port` and
//! waits for one per decoder TP rank (`len(receiver_init_port)`) before it sends the decode.
//!
//! `ProxyNotif` carries only the request id; which rank sent it is known only from the connection it
//! came on (each rank's PUSH socket is its own connection), which is how the gateway tells a
//! duplicate from a second rank.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// `AllocRequest`: the prefiller asks a decoder rank for buffer room for `keys` (one per chunk).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocRequest {
    pub keys: Vec<String>,
    pub fmt: i64,
    pub shape: Vec<i64>,
    pub dtype: String,
    pub last_chunk_toks: i64,
    /// Newer LMCache senders add it; older receivers do not know it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transpose: Option<bool>,
}

/// `AllocResponse`: which chunks the decoder already has, and where to write the others.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocResponse {
    #[serde(default)]
    pub already_sent_indexes: Vec<i64>,
    pub remote_indexes: Vec<i64>,
}

/// `ProxyNotif`: one prefiller rank finished writing a request's KV.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyNotif {
    pub req_id: String,
}

/// `PDMsg = Union[AllocRequest, AllocResponse, ProxyNotif]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum PdMsg {
    AllocRequest(AllocRequest),
    AllocResponse(AllocResponse),
    ProxyNotif(ProxyNotif),
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MsgError {
    /// The bytes are not one of LMCache's PD messages.
    #[error("not a PD message: {0}")]
    Decode(String),
    /// A message could not be written as msgpack.
    #[error("cannot encode: {0}")]
    Encode(String),
}

impl PdMsg {
    /// msgpack, fields by name (as msgspec writes structs), the `type` tag first.
    pub fn encode(&self) -> Result<Vec<u8>, MsgError> {
        rmp_serde::to_vec_named(self).map_err(|e| MsgError::Encode(e.to_string()))
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, MsgError> {
        rmp_serde::from_slice(bytes).map_err(|e| MsgError::Decode(e.to_string()))
    }
}

impl ProxyNotif {
    /// The request id of a `ProxyNotif`, read where it lies in `bytes`; an error for any other
    /// message, as [`PdMsg::decode`] would give. What the proxy reads once a rank a request: the
    /// tagged enum first buffers the whole map (the tag, each key and value) to find its variant,
    /// and then copies the id.
    pub fn req_id(bytes: &[u8]) -> Result<&str, MsgError> {
        #[derive(Deserialize)]
        struct Tagged<'a> {
            #[serde(rename = "type", borrow)]
            ty: &'a str,
            #[serde(borrow)]
            req_id: &'a str,
        }
        let t: Tagged<'_> = rmp_serde::from_slice(bytes).map_err(|e| MsgError::Decode(e.to_string()))?;
        if t.ty == "ProxyNotif" {
            Ok(t.req_id)
        } else {
            Err(MsgError::Decode(format!("a {} where a ProxyNotif was expected", t.ty)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_notif_is_the_msgspec_encoding() {
        // msgspec.msgpack.encode(ProxyNotif(req_id="r1")) with tag=True: a 2-entry map, tag first.
        let want = [
            0x82, 0xa4, b't', b'y', b'p', b'e', 0xaa, b'P', b'r', b'o', b'x', b'y', b'N', b'o', b't', b'i',
            b'f', 0xa6, b'r', b'e', b'q', b'_', b'i', b'd', 0xa2, b'r', b'1',
        ];
        let m = PdMsg::ProxyNotif(ProxyNotif { req_id: "r1".into() });
        assert_eq!(m.encode().unwrap(), want);
        assert_eq!(PdMsg::decode(&want).unwrap(), m);
        assert_eq!(ProxyNotif::req_id(&want).unwrap(), "r1");
    }

    /// The id read in place is the decoded message's: fields in either order, a field a newer
    /// sender adds, and every message that is not a `ProxyNotif` refused.
    #[test]
    fn a_proxy_notifs_id_is_read_in_place_as_decoded() {
        #[derive(Serialize)]
        struct Later<'a> {
            req_id: &'a str,
            extra: u32,
            #[serde(rename = "type")]
            ty: &'a str,
        }
        let later = rmp_serde::to_vec_named(&Later { req_id: "r2", extra: 7, ty: "ProxyNotif" }).unwrap();
        assert_eq!(PdMsg::decode(&later).unwrap(), PdMsg::ProxyNotif(ProxyNotif { req_id: "r2".into() }));
        assert_eq!(ProxyNotif::req_id(&later).unwrap(), "r2");
        let other =
            PdMsg::AllocResponse(AllocResponse { already_sent_indexes: vec![], remote_indexes: vec![1] });
        for bad in [other.encode().unwrap(), b"\x81\xa4type\xaaProxyNotif".to_vec(), b"not msgpack".to_vec()]
        {
            assert!(PdMsg::decode(&bad).map_or(true, |m| !matches!(m, PdMsg::ProxyNotif(_))));
            assert!(ProxyNotif::req_id(&bad).is_err());
        }
    }

    #[test]
    fn alloc_messages_round_trip_and_garbage_is_an_error() {
        let req = PdMsg::AllocRequest(AllocRequest {
            keys: vec!["vllm@m@2@0@abc".into(), "vllm@m@2@0@def".into()],
            fmt: 1,
            shape: vec![2, 32, 256, 1024],
            dtype: "bfloat16".into(),
            last_chunk_toks: 17,
            transpose: None,
        });
        assert_eq!(PdMsg::decode(&req.encode().unwrap()).unwrap(), req);
        let resp =
            PdMsg::AllocResponse(AllocResponse { already_sent_indexes: vec![1], remote_indexes: vec![5] });
        assert_eq!(PdMsg::decode(&resp.encode().unwrap()).unwrap(), resp);
        assert!(PdMsg::decode(b"\x81\xa4type\xa4Nope").is_err());
        assert!(PdMsg::decode(b"not msgpack").is_err());
    }
}
