//! Engine KV cache events: the wire format vLLM and SGLang publish (ZeroMQ PUB, `[topic, seq,
//! payload]`) decoded into typed batches, and a subscriber that reads them off one engine.
//!
//! The wire, as vLLM 0.32 sends it (`vllm/distributed/kv_events.py`; checked against a real
//! server by `tests/vllm.rs`, and against vLLM 0.32's and 0.9.2's own `ZmqEventPublisher`, whose
//! frames `scripts/capture-kv-events` captured; all kept in `gateway/tests/fixtures/`):
//! - three frames: the topic (the publisher's `topic`, `""` by default: a subscriber on another
//!   prefix silently gets nothing), the sequence number as 8 big-endian bytes (counting from 0 at
//!   every engine start), and a msgpack `EventBatch`;
//! - the batch is an array `[ts, events, data_parallel_rank]` (a map with those names is read
//!   too);
//! - each event is a map tagged by `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`; older
//!   vLLM, 0.9.2 for one, and older SGLang releases send the same events as arrays whose first element
//!   is the tag);
//! - block hashes are integers (vLLM's default `builtin` hash, 64-bit, possibly negative) or bytes
//!   (`sha256` hashes); `medium` says where the block is (`"GPU"` even on a CPU build).
//!
//! An event type this reader does not know is kept as [`KvEvent::Other`] with its name, never an
//! error: an engine upgrade must not stop the stream. Nothing here decides routing; it only reads.
//!
//! The sockets are the `zeromq` crate's (a maintained native implementation of ZeroMQ), which puts
//! no bound on a message's size: an engine's publisher is trusted as its HTTP API is, and is
//! reached on the engines' network only.

use std::net::SocketAddr;

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use rmpv::Value;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqError, ZmqMessage,
};

/// A block's hash as the engine computed it: compared for equality only, never recomputed here.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// An integer hash (its two's-complement bits when negative).
    Int(u64),
    /// A byte-string hash (`sha256`, `sha256_cbor`).
    Bytes(Vec<u8>),
}

/// One event of a batch.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// Blocks entered the engine's prefix cache: `token_ids` hold `block_size` tokens per hash.
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u64>,
        medium: Option<String>,
        /// The adapter's name (vLLM 0.12 on, SGLang).
        lora_name: Option<String>,
        /// Per block: whether the engine hashed more than its tokens into it (vLLM's
        /// `extra_keys`: multimodal inputs, a cache salt, an adapter). Empty when none did.
        extra_keys: Vec<bool>,
        /// The KV cache group's kind (vLLM 0.33's `kv_cache_spec_kind`: `full_attention`,
        /// `sliding_window`, `mamba`, …); `None` when the engine does not say.
        kind: Option<String>,
    },
    /// Blocks left it.
    BlockRemoved { block_hashes: Vec<BlockHash>, medium: Option<String> },
    /// The whole cache was emptied (`/reset_prefix_cache`).
    AllBlocksCleared,
    /// An event type this reader does not know, by name.
    Other(String),
}

/// One published batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// The engine's wall clock when it published the batch (seconds since the epoch).
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that published it, when the engine says.
    pub dp_rank: Option<u32>,
}

/// One message: its topic, sequence number and batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub batch: EventBatch,
}

/// Why a message could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EventError {
    /// The message is not the three frames a publisher sends.
    #[error("expected 3 frames (topic, seq, payload), got {0}")]
    Frames(usize),
    /// The sequence number is not 8 bytes (big-endian u64).
    #[error("the sequence frame has {0} bytes, not 8")]
    Seq(usize),
    /// The payload is not msgpack at all.
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    /// The payload is msgpack but not an event batch as vLLM or SGLang writes one.
    #[error("payload: {0}")]
    Shape(String),
    /// The SUB connection failed.
    /// The ZeroMQ socket failed (connect, receive, send).
    #[error("zeromq: {0}")]
    Zmq(#[from] ZmqError),
    /// The publisher went away (the subscription may miss what it publishes until it is back).
    #[error("the publisher disconnected")]
    Disconnected,
    /// The replay socket did not finish within its time.
    #[error("the replay did not end within {0:?}")]
    ReplayTimeout(Duration),
}

fn shape(m: impl Into<String>) -> EventError {
    EventError::Shape(m.into())
}

/// Decodes one message's frames.
pub fn decode<F: AsRef<[u8]>>(frames: &[F]) -> Result<Message, EventError> {
    let [topic, seq, payload] = frames else { return Err(EventError::Frames(frames.len())) };
    let seq: [u8; 8] = seq.as_ref().try_into().map_err(|_| EventError::Seq(seq.as_ref().len()))?;
    let value =
        rmpv::decode::read_value(&mut payload.as_ref()).map_err(|e| EventError::Msgpack(e.to_string()))?;
    Ok(Message { topic: topic.as_ref().to_vec(), seq: u64::from_be_bytes(seq), batch: batch(&value)? })
}

/// `[ts, events, dp_rank]`, or a map with `ts`, `events` and `data_parallel_rank`.
fn batch(v: &Value) -> Result<EventBatch, EventError> {
    let (ts, events, rank) = match v {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(_) => (field(v, "ts"), field(v, "events"), field(v, "data_parallel_rank")),
        other => return Err(shape(format!("a batch is an array or a map, not {other}"))),
    };
    let ts = ts.and_then(Value::as_f64).ok_or_else(|| shape("batch without a timestamp"))?;
    let events = events
        .and_then(Value::as_array)
        .ok_or_else(|| shape("batch without an event list"))?
        .iter()
        // An event that does not decode is kept by name with why, the rest of the batch applies.
        .map(|e| event(e).unwrap_or_else(|err| KvEvent::Other(format!("undecodable: {err}"))))
        .collect();
    let dp_rank = rank.and_then(Value::as_u64).and_then(|r| u32::try_from(r).ok());
    Ok(EventBatch { ts, events, dp_rank })
}

/// A map's value at a string key.
fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.as_map()?.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
}

/// An event's fields: by name (map form) or by position after the tag (array form).
/// The position of a field that only the map encoding has (newer than the array one).
const NAME_ONLY: usize = usize::MAX;

enum Fields<'a> {
    Map(&'a Value),
    Array(&'a [Value]),
}

impl<'a> Fields<'a> {
    /// The field `name`, at `at` in the array form; `None` when absent or nil.
    fn get(&self, name: &str, at: usize) -> Option<&'a Value> {
        match self {
            Self::Map(v) => field(v, name),
            Self::Array(a) => a.get(at.checked_add(1)?),
        }
        .filter(|v| !v.is_nil())
    }
}

/// One event, a map tagged `type` or an array led by its tag.
fn event(v: &Value) -> Result<KvEvent, EventError> {
    let (tag, fields) = match v {
        Value::Map(_) => (
            field(v, "type").and_then(Value::as_str).ok_or_else(|| shape("event map without a type"))?,
            Fields::Map(v),
        ),
        Value::Array(a) => (
            a.first().and_then(Value::as_str).ok_or_else(|| shape("event array without a tag"))?,
            Fields::Array(a),
        ),
        other => return Err(shape(format!("an event is a map or an array, not {other}"))),
    };
    let present = |name, at| fields.get(name, at);
    let hashes = |name, at| -> Result<Vec<BlockHash>, EventError> {
        present(name, at)
            .and_then(Value::as_array)
            .ok_or_else(|| shape(format!("{tag} without {name}")))?
            .iter()
            .map(hash)
            .collect()
    };
    let medium = |at| present("medium", at).and_then(Value::as_str).map(str::to_owned);
    Ok(match tag {
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: hashes("block_hashes", 0)?,
            parent_block_hash: present("parent_block_hash", 1).map(hash).transpose()?,
            token_ids: present("token_ids", 2)
                .and_then(Value::as_array)
                .ok_or_else(|| shape("BlockStored without token_ids"))?
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| shape(format!("token id {t}")))
                })
                .collect::<Result<_, _>>()?,
            block_size: present("block_size", 3)
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or_else(|| shape("BlockStored without block_size"))?,
            lora_id: present("lora_id", 4).and_then(Value::as_u64),
            medium: medium(5),
            // Fields newer than the array encoding are read by name only.
            lora_name: present("lora_name", NAME_ONLY).and_then(Value::as_str).map(str::to_owned),
            extra_keys: present("extra_keys", NAME_ONLY)
                .and_then(Value::as_array)
                .map(|a| a.iter().map(|k| !k.is_nil()).collect())
                .unwrap_or_default(),
            kind: present("kv_cache_spec_kind", NAME_ONLY).and_then(Value::as_str).map(str::to_owned),
        },
        "BlockRemoved" => {
            KvEvent::BlockRemoved { block_hashes: hashes("block_hashes", 0)?, medium: medium(1) }
        }
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => KvEvent::Other(other.to_owned()),
    })
}

fn hash(v: &Value) -> Result<BlockHash, EventError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(i64::cast_unsigned))
            .map(BlockHash::Int)
            .ok_or_else(|| shape(format!("block hash {i}"))),
        Value::Binary(b) => Ok(BlockHash::Bytes(b.clone())),
        other => Err(shape(format!("a block hash is an integer or bytes, not {other}"))),
    }
}

/// A subscription to one engine's publisher (a ZeroMQ SUB socket, from the `zeromq` crate, that
/// reconnects by itself when the publisher restarts).
///
/// It subscribes to every topic and checks the topic itself, so that a publisher on another
/// topic is seen ([`Next::OtherTopic`]) rather than silently filtered out.
pub struct Subscriber {
    socket: SubSocket,
    /// The socket's connection events: a publisher that goes away is seen here (the socket itself
    /// reconnects and its receive just waits).
    monitor: futures_util::stream::BoxStream<'static, SocketEvent>,
    topic: Vec<u8>,
    next_seq: Option<u64>,
    /// Messages below this were had otherwise (a replay): skipped until one at or past it.
    skip_below: Option<u64>,
    /// Messages the sequence numbers say were published but not received, since connecting.
    pub missed: u64,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("topic", &String::from_utf8_lossy(&self.topic))
            .field("next_seq", &self.next_seq)
            .field("missed", &self.missed)
            .finish_non_exhaustive()
    }
}

/// What a subscriber read next.
#[derive(Debug)]
pub enum Next {
    /// A message in order, or after a gap (`missed` messages published between the last one read
    /// and this one), or after the publisher started again (its sequence went back: it counts
    /// from 0 at every start, and its cache started empty).
    Message { message: Message, missed: u64, restarted: bool },
    /// A message on another topic than the subscription's (its topic, lossily as text).
    OtherTopic(String),
}

/// `tcp://host:port` for an endpoint written `host:port` or already a ZeroMQ endpoint.
pub fn endpoint(addr: &str) -> String {
    if addr.contains("://") { addr.to_owned() } else { format!("tcp://{addr}") }
}

impl Subscriber {
    /// Subscribes to `addr` (`host:port` or `tcp://host:port`), waiting at most `timeout` for
    /// the first connection.
    pub async fn connect_to(addr: &str, topic: &[u8], timeout: Duration) -> Result<Self, EventError> {
        let mut options = SocketOptions::default();
        options.connect_timeout(timeout);
        let mut socket = SubSocket::with_options(options);
        let monitor = socket.monitor().boxed();
        socket.connect(&endpoint(addr)).await?;
        socket.subscribe("").await?;
        Ok(Self { socket, monitor, topic: topic.to_vec(), next_seq: None, skip_below: None, missed: 0 })
    }

    /// Subscribes to a publisher at `addr`.
    pub async fn connect(addr: SocketAddr, topic: &[u8]) -> Result<Self, EventError> {
        Self::connect_to(&addr.to_string(), topic, Duration::from_secs(5)).await
    }

    /// Messages before `seq` were had from a replay: they are skipped when they also arrive
    /// here, and `seq` is the next one expected (a later one is a gap).
    pub fn expect(&mut self, seq: u64) {
        self.next_seq = Some(seq);
        self.skip_below = Some(seq);
    }

    /// The next message on the subscription's topic (other topics are skipped).
    pub async fn next(&mut self) -> Result<Option<Message>, EventError> {
        loop {
            if let Next::Message { message, .. } = self.next_any().await? {
                return Ok(Some(message));
            }
        }
    }

    /// The next message, with what its sequence number says.
    pub async fn next_any(&mut self) -> Result<Next, EventError> {
        let message = loop {
            let frames: Vec<Bytes> = tokio::select! {
                m = self.socket.recv() => m?.into_vec(),
                e = self.monitor.next() => match e {
                    Some(SocketEvent::Disconnected(_)) | None => return Err(EventError::Disconnected),
                    Some(_) => continue,
                },
            };
            if frames.first().is_some_and(|t| t.as_ref() != self.topic.as_slice()) {
                let topic =
                    frames.first().map(|t| String::from_utf8_lossy(t).into_owned()).unwrap_or_default();
                return Ok(Next::OtherTopic(topic));
            }
            let message = decode(&frames)?;
            match self.skip_below {
                // Had from the replay (an engine that starts again in this moment is taken for
                // these, until its sequence passes the replay's).
                Some(below) if message.seq < below => continue,
                Some(_) => self.skip_below = None,
                None => {}
            }
            break message;
        };
        let (missed, restarted) = match self.next_seq {
            Some(want) if message.seq > want => (message.seq - want, false),
            Some(want) if message.seq < want => (0, true),
            _ => (0, false),
        };
        self.missed += missed;
        self.next_seq = Some(message.seq.wrapping_add(1));
        Ok(Next::Message { message, missed, restarted })
    }
}

/// The sequence number vLLM's replay socket ends a replay with (`-1`, 8 bytes big-endian).
pub const END_OF_REPLAY: [u8; 8] = [0xff; 8];

/// One answer from a replay socket.
#[derive(Debug)]
pub enum Answer {
    /// A message it still held, with the subscription's topic.
    Message(Message),
    /// A message whose payload does not decode.
    Undecodable(EventError),
    /// The end of the replay (seq -1).
    End,
}

/// Reads one answer as a DEALER receives it: the ROUTER's empty delimiter, then
/// `[topic, seq, payload]` (vLLM 0.26 on, SGLang) or `[seq, payload]` (before); the end is the
/// same with seq -1 and an empty payload. The message gets `topic` (the subscription's), whatever
/// topic frame the answer had.
pub fn replay_answer<F: AsRef<[u8]>>(frames: &[F], topic: &[u8]) -> Result<Answer, EventError> {
    let body = match frames.first() {
        Some(f) if f.as_ref().is_empty() => frames.get(1..).unwrap_or_default(),
        _ => frames,
    };
    let (seq, payload) = match body {
        [_, seq, payload] | [seq, payload] => (seq.as_ref(), payload.as_ref()),
        _ => return Err(EventError::Frames(body.len())),
    };
    if seq == END_OF_REPLAY {
        return Ok(Answer::End);
    }
    Ok(match decode(&[topic, seq, payload]) {
        Ok(m) => Answer::Message(m),
        Err(e) => Answer::Undecodable(e),
    })
}

/// Asks a publisher's replay socket (ZeroMQ ROUTER; vLLM's and SGLang's `replay_endpoint`) for
/// every message it still holds from `from` on, as their `ZmqEventPublisher` serves it: the
/// request is `["", from as 8 bytes big-endian]` from a DEALER; each answer is
/// `["", topic, seq, payload]` (vLLM before 0.26: `["", seq, payload]`), the last one with seq
/// `-1`. The messages come back with the subscription's `topic`. At most `max` messages, and
/// `timeout` in all.
pub async fn replay(
    addr: &str,
    from: u64,
    topic: &[u8],
    max: usize,
    timeout: Duration,
) -> Result<Vec<Message>, EventError> {
    let run = async {
        let mut options = SocketOptions::default();
        // A replay socket that is down should not hold the live stream for the whole timeout.
        options.connect_timeout(timeout.min(Duration::from_secs(2)));
        let mut socket = DealerSocket::with_options(options);
        socket.connect(&endpoint(addr)).await?;
        let mut ask = ZmqMessage::from(Bytes::new());
        ask.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        socket.send(ask).await?;
        let mut out = Vec::new();
        loop {
            match replay_answer(&socket.recv().await?.into_vec(), topic)? {
                Answer::End => return Ok(out),
                Answer::Message(m) => out.push(m),
                // One batch that does not decode is left out (the caller sees its sequence missing).
                Answer::Undecodable(_) => {}
            }
            if out.len() >= max {
                return Ok(out);
            }
        }
    };
    tokio::time::timeout(timeout, run).await.map_err(|_| EventError::ReplayTimeout(timeout))?
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    /// Frames a real vLLM 0.32 server published (`tests/vllm.rs` captures them with
    /// `BATON_CAPTURE_KV_EVENTS`): one JSON array of hex frames a line.
    const VLLM_0_32: &str = include_str!("../tests/fixtures/vllm-0.32-kv-events.jsonl");

    fn frames(line: &str) -> Vec<Vec<u8>> {
        let hex: Vec<String> = serde_json::from_str(line).unwrap();
        hex.iter()
            .map(|h| (0..h.len()).step_by(2).map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap()).collect())
            .collect()
    }

    #[test]
    fn vllm_0_32_frames_decode() {
        let mut stored = 0;
        let mut cleared = 0;
        for line in VLLM_0_32.lines().filter(|l| !l.is_empty()) {
            let m = decode(&frames(line)).unwrap();
            assert_eq!(m.topic, b"kv");
            assert!(m.batch.ts > 1.7e9, "{m:?}");
            for e in &m.batch.events {
                match e {
                    KvEvent::BlockStored { block_hashes, token_ids, block_size, medium, .. } => {
                        assert_eq!(*block_size, 32);
                        assert_eq!(token_ids.len(), block_hashes.len() * 32, "{e:?}");
                        assert_eq!(medium.as_deref(), Some("GPU"));
                        assert!(block_hashes.iter().all(|h| matches!(h, BlockHash::Int(_))));
                        stored += block_hashes.len();
                    }
                    KvEvent::AllBlocksCleared => cleared += 1,
                    other => panic!("unexpected event in the fixture: {other:?}"),
                }
            }
        }
        assert!(stored >= 2, "{stored} blocks stored");
        assert_eq!(cleared, 1);
    }

    /// What vLLM's own `ZmqEventPublisher` sent (0.32: events as maps; 0.9.2: events as arrays),
    /// captured by `scripts/capture-kv-events`, decodes to what it was given in every field this
    /// reader keeps (`extra_keys` as present or not per block), live and from its replay socket (whose answers differ between the two: 0.32 adds a topic frame).
    #[test]
    fn vllm_publisher_code_decodes_exactly() {
        use serde_json::Value as J;
        fn hex(s: &str) -> Vec<u8> {
            (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
        }
        fn frames(v: &J) -> Vec<Vec<u8>> {
            v.as_array().unwrap().iter().map(|f| hex(f.as_str().unwrap())).collect()
        }
        fn hash(v: &J) -> BlockHash {
            match v {
                J::Object(o) => BlockHash::Bytes(hex(o["hex"].as_str().unwrap())),
                n => BlockHash::Int(n.as_u64().unwrap_or_else(|| n.as_i64().unwrap().cast_unsigned())),
            }
        }
        let hashes = |e: &J| e["block_hashes"].as_array().unwrap().iter().map(hash).collect::<Vec<_>>();
        let text = |e: &J, k: &str| e.get(k).and_then(J::as_str).map(str::to_owned);
        let expected = |b: &J| EventBatch {
            ts: b["ts"].as_f64().unwrap(),
            dp_rank: b["data_parallel_rank"].as_u64().map(|r| u32::try_from(r).unwrap()),
            events: b["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| match e["type"].as_str().unwrap() {
                    "BlockStored" => KvEvent::BlockStored {
                        block_hashes: hashes(e),
                        parent_block_hash: e.get("parent_block_hash").filter(|p| !p.is_null()).map(hash),
                        token_ids: e["token_ids"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
                            .collect(),
                        block_size: u32::try_from(e["block_size"].as_u64().unwrap()).unwrap(),
                        lora_id: e["lora_id"].as_u64(),
                        medium: text(e, "medium"),
                        lora_name: text(e, "lora_name"),
                        extra_keys: e
                            .get("extra_keys")
                            .and_then(J::as_array)
                            .map(|k| k.iter().map(|k| !k.is_null()).collect())
                            .unwrap_or_default(),
                        kind: text(e, "kv_cache_spec_kind"),
                    },
                    "BlockRemoved" => {
                        KvEvent::BlockRemoved { block_hashes: hashes(e), medium: text(e, "medium") }
                    }
                    "AllBlocksCleared" => KvEvent::AllBlocksCleared,
                    other => panic!("{other}"),
                })
                .collect(),
        };
        for (version, fixture, topic, array_events) in [
            ("0.32", include_str!("../tests/fixtures/vllm-publisher-0.32.0.json"), &b""[..], false),
            ("0.9.2", include_str!("../tests/fixtures/vllm-publisher-0.9.2.json"), &b"kv"[..], true),
        ] {
            let f: J = serde_json::from_str(fixture).unwrap();
            let live = f["live"].as_array().unwrap();
            for (seq, entry) in live.iter().enumerate() {
                let raw = frames(&entry["frames"]);
                // The encoding really is the one this fixture stands for.
                let payload = rmpv::decode::read_value(&mut &raw[2][..]).unwrap();
                let first_event = &payload.as_array().unwrap()[1].as_array().unwrap()[0];
                assert_eq!(first_event.is_array(), array_events, "{version}: {first_event}");
                let m = decode(&raw).unwrap();
                assert_eq!(m.topic, topic, "{version}");
                assert_eq!(m.seq, seq as u64, "{version}");
                assert_eq!(m.batch, expected(&entry["batch"]), "{version} batch {seq}");
            }
            let from = usize::try_from(f["replay_from"].as_u64().unwrap()).unwrap();
            let answers = f["replay"].as_array().unwrap();
            assert_eq!(answers.len(), live.len() - from + 1, "{version}");
            for (i, a) in answers.iter().enumerate() {
                match replay_answer(&frames(a), topic).unwrap() {
                    Answer::Message(m) => {
                        assert_eq!(m.seq, (from + i) as u64, "{version}");
                        assert_eq!(m.batch, expected(&live[from + i]["batch"]), "{version} replay {i}");
                    }
                    Answer::End => assert_eq!(i, answers.len() - 1, "{version}: early end"),
                    Answer::Undecodable(e) => panic!("{version} replay {i}: {e}"),
                }
            }
        }
    }

    /// The older array form (vLLM before 0.12, SGLang) and the map form read the same, unknown
    /// events are kept by name, and malformed messages are errors, not panics.
    #[test]
    fn both_encodings_and_malformed_messages() {
        use rmpv::Value as V;
        let enc = |v: &V| {
            let mut b = Vec::new();
            rmpv::encode::write_value(&mut b, v).unwrap();
            b
        };
        let msg = |payload: Vec<u8>| vec![b"kv".to_vec(), 7u64.to_be_bytes().to_vec(), payload];
        let array_form = V::Array(vec![
            V::from(1.5),
            V::Array(vec![
                V::Array(vec![
                    V::from("BlockStored"),
                    V::Array(vec![V::from(-3i64), V::Binary(vec![1, 2])]),
                    V::Nil,
                    V::Array((0..4).map(V::from).collect()),
                    V::from(2),
                    V::Nil,
                    V::from("cpu"),
                ]),
                V::Array(vec![V::from("BlockRemoved"), V::Array(vec![V::from(9)]), V::Nil]),
                V::Array(vec![V::from("SomethingNew"), V::from(1)]),
            ]),
            V::Nil,
        ]);
        let m = decode(&msg(enc(&array_form))).unwrap();
        assert_eq!(m.seq, 7);
        assert_eq!(
            m.batch.events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![BlockHash::Int((-3i64).cast_unsigned()), BlockHash::Bytes(vec![1, 2])],
                    parent_block_hash: None,
                    token_ids: vec![0, 1, 2, 3],
                    block_size: 2,
                    lora_id: None,
                    medium: Some("cpu".into()),
                    lora_name: None,
                    extra_keys: Vec::new(),
                    kind: None,
                },
                KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(9)], medium: None },
                KvEvent::Other("SomethingNew".into()),
            ]
        );
        let map_form = V::Map(vec![
            (V::from("ts"), V::from(2.0)),
            (
                V::from("events"),
                V::Array(vec![V::Map(vec![
                    (V::from("type"), V::from("BlockRemoved")),
                    (V::from("block_hashes"), V::Array(vec![V::from(9)])),
                ])]),
            ),
            (V::from("data_parallel_rank"), V::from(1)),
        ]);
        let m = decode(&msg(enc(&map_form))).unwrap();
        assert_eq!(m.batch.dp_rank, Some(1));
        assert_eq!(
            m.batch.events,
            vec![KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(9)], medium: None }]
        );
        // (case, frames)
        let bad: Vec<(&str, Vec<Vec<u8>>)> = vec![
            ("two frames", vec![b"kv".to_vec(), vec![0; 8]]),
            ("short seq", vec![b"kv".to_vec(), vec![0; 4], enc(&V::Nil)]),
            ("not msgpack", vec![b"kv".to_vec(), vec![0; 8], vec![0xc1]]),
            ("a string batch", msg(enc(&V::from("x")))),
            ("no events", msg(enc(&V::Array(vec![V::from(1.0)])))),
        ];
        // A malformed event is kept by name with why; the rest of its batch still applies.
        let bad_events = [
            V::Array(vec![V::from("BlockStored"), V::Array(vec![])]),
            V::Array(vec![V::from("BlockRemoved"), V::Array(vec![V::from(0.5)])]),
        ];
        for e in bad_events {
            let good = V::Array(vec![V::from("AllBlocksCleared")]);
            let m =
                decode(&msg(enc(&V::Array(vec![V::from(1.0), V::Array(vec![e.clone(), good])])))).unwrap();
            assert!(
                matches!(&m.batch.events[0], KvEvent::Other(why) if why.starts_with("undecodable")),
                "{e}: {m:?}"
            );
            assert_eq!(m.batch.events[1], KvEvent::AllBlocksCleared);
        }
        for (case, f) in bad {
            assert!(decode(&f).is_err(), "{case}");
        }
    }
}
