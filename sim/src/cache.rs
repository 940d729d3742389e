//! The simulated engine as a prefix cache: its full blocks of prompt tokens in an LRU sized in
//! blocks, a prefill that costs a fixed part plus a part per token not cached, and the KV events a
//! vLLM engine publishes about them (`--kv-events-config`), replay included.
//!
//! The engine's block hashes are its own (chained over the block's tokens and its parent's hash,
//! as vLLM's are, with another function than the gateway's keys), so a subscriber has to key
//! blocks by their tokens as it would with a real engine.
//!
//! The wire is vLLM 0.32's (`vllm/distributed/kv_events.py`): a PUB socket sending
//! `[topic, seq as 8 bytes big-endian, msgpack [ts, [events], null]]`, events as maps tagged
//! `type`; a ROUTER replay socket answering `["", start seq]` with `["", topic, seq, batch]` for
//! every batch it still holds from there, then `["", "", -1, ""]`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::{Semaphore, mpsc};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::lock;

/// Batches a publisher keeps for replay (vLLM's `buffer_steps` default).
pub const REPLAY_BUFFER: usize = 10_000;

/// How the engine caches and publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Blocks the cache holds (its pages); the least recently used leave first.
    pub blocks: usize,
    /// Tokens per block.
    pub block_size: u32,
    /// A prefill's fixed time.
    pub prefill_fixed: Duration,
    /// A prefill's time per prompt token not cached.
    pub prefill_per_token: Duration,
    /// Prefills the engine computes at once (its compute: later ones wait for a lane, as a real
    /// engine's queue does); 0 for no limit.
    pub prefill_lanes: usize,
    /// Where to publish KV events, if anywhere.
    pub events: Option<EventsConfig>,
}

/// The publisher's sockets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventsConfig {
    pub listen: SocketAddr,
    pub replay: Option<SocketAddr>,
    pub topic: String,
}

/// One event, as the engine publishes it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Event {
    Stored { hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32> },
    Removed { hashes: Vec<u64> },
}

#[derive(Debug, Default)]
struct Lru {
    /// Block hash → its last use.
    used: HashMap<u64, u64>,
    /// Last use → block hash (oldest first).
    order: BTreeMap<u64, u64>,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, h: u64) {
        self.tick += 1;
        if let Some(old) = self.used.insert(h, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, h);
    }
}

/// What the engine computed: prompts, their tokens and how many of those were cached.
#[derive(Debug, Default)]
struct Computed {
    prompts: AtomicU64,
    tokens: AtomicU64,
    cached: AtomicU64,
}

/// The engine's prefix cache.
#[derive(Debug)]
pub struct PrefixCache {
    config: CacheConfig,
    lru: Mutex<Lru>,
    /// The compute lanes, when limited.
    lanes: Option<Arc<Semaphore>>,
    computed: Computed,
    events: Option<Publisher>,
    /// Where the publisher listens (the bound ports, when 0 was asked for).
    pub published_at: Option<(SocketAddr, Option<SocketAddr>)>,
}

/// The publisher's tasks (they own its sockets, whose ports they free when aborted with the
/// cache) and the channel into them.
#[derive(Debug)]
struct Publisher {
    tx: mpsc::UnboundedSender<Vec<Event>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The engine's hash of a block: its tokens and its parent's hash (vLLM's shape; not its function).
/// Unsigned 64-bit, as vLLM 0.32 publishes them by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`:
/// the digest's low 64 bits).
fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h: u64 = parent.unwrap_or(0x9e37_79b9_7f4a_7c15);
    for t in tokens {
        h ^= u64::from(*t);
        h = h.wrapping_mul(0x0100_0000_01b3).rotate_left(29) ^ 0xcbf2_9ce4_8422_2325;
    }
    h
}

impl PrefixCache {
    /// The cache, and its publisher started when configured. Must run inside a Tokio runtime.
    pub async fn start(config: CacheConfig) -> std::io::Result<Arc<Self>> {
        let (events, published_at) = match &config.events {
            Some(e) => {
                let (tx, at) = publish(e, config.block_size).await?;
                (Some(tx), Some(at))
            }
            None => (None, None),
        };
        let lanes = (config.prefill_lanes > 0).then(|| Arc::new(Semaphore::new(config.prefill_lanes)));
        Ok(Arc::new(Self {
            config,
            lru: Mutex::new(Lru::default()),
            lanes,
            computed: Computed::default(),
            events,
            published_at,
        }))
    }

    /// Computes a prompt as the engine's prefill does: waits for a compute lane (when lanes are
    /// limited), looks the prompt up and caches it, and takes the prefill's time for what was not
    /// cached. Returns the tokens that were cached.
    pub async fn compute(&self, ids: &[u32]) -> usize {
        let _lane = match &self.lanes {
            Some(l) => Some(Arc::clone(l).acquire_owned().await),
            None => None,
        };
        let cached = self.admit(ids);
        let c = &self.computed;
        c.prompts.fetch_add(1, Ordering::Relaxed);
        c.tokens.fetch_add(ids.len() as u64, Ordering::Relaxed);
        c.cached.fetch_add(cached as u64, Ordering::Relaxed);
        let t = self.prefill_time(ids.len(), cached);
        if !t.is_zero() {
            tokio::time::sleep(t).await;
        }
        cached
    }

    /// The cache's state and what the engine computed, for `/sim/stats`.
    pub fn stats(&self) -> serde_json::Value {
        let c = &self.computed;
        serde_json::json!({
            "blocks": self.blocks(),
            "capacity_blocks": self.config.blocks,
            "computed_prompts": c.prompts.load(Ordering::Relaxed),
            "computed_prompt_tokens": c.tokens.load(Ordering::Relaxed),
            "computed_cached_tokens": c.cached.load(Ordering::Relaxed),
        })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// A prompt arrives: the tokens at its start already cached, and its full blocks now cached
    /// (stored ones published, evicted ones published as removed).
    pub fn admit(&self, ids: &[u32]) -> usize {
        let bs = usize::try_from(self.config.block_size).unwrap_or(16).max(1);
        let mut lru = lock(&self.lru);
        let mut parent = None;
        let mut cached = 0;
        // Each run of blocks not held is one store, chained to the block before it.
        let mut batch = Vec::new();
        let mut run: Option<(Option<u64>, Vec<u64>, Vec<u32>)> = None;
        let mut hashes = Vec::new();
        for (i, block) in ids.chunks_exact(bs).enumerate() {
            let h = block_hash(parent, block);
            if lru.used.contains_key(&h) {
                if run.is_none() && i == cached {
                    cached = i + 1;
                }
                if let Some((p, hs, tokens)) = run.take() {
                    batch.push(Event::Stored { hashes: hs, parent: p, tokens });
                }
            } else {
                let (_, hs, tokens) = run.get_or_insert_with(|| (parent, Vec::new(), Vec::new()));
                hs.push(h);
                tokens.extend_from_slice(block);
            }
            hashes.push(h);
            parent = Some(h);
        }
        if let Some((p, hs, tokens)) = run.take() {
            batch.push(Event::Stored { hashes: hs, parent: p, tokens });
        }
        // As vLLM frees a request's blocks, the last block goes first: the prompt's start, which
        // later prompts share most, stays longest.
        for h in hashes.iter().rev() {
            lru.touch(*h);
        }
        let mut removed = Vec::new();
        while lru.used.len() > self.config.blocks {
            let Some((_, h)) = lru.order.pop_first() else { break };
            lru.used.remove(&h);
            removed.push(h);
        }
        drop(lru);
        if !removed.is_empty() {
            batch.push(Event::Removed { hashes: removed });
        }
        if let Some(p) = &self.events
            && !batch.is_empty()
        {
            let _ = p.tx.send(batch);
        }
        cached * bs
    }

    /// How long computing a prompt of `prompt` tokens takes with `cached` of them cached.
    pub fn prefill_time(&self, prompt: usize, cached: usize) -> Duration {
        let uncached = u32::try_from(prompt.saturating_sub(cached)).unwrap_or(u32::MAX);
        self.config.prefill_fixed + self.config.prefill_per_token * uncached
    }

    /// Blocks held now.
    pub fn blocks(&self) -> usize {
        lock(&self.lru).used.len()
    }
}

fn encode(events: &[Event], block_size: u32) -> Vec<u8> {
    let s = |v: &str| Value::from(v);
    let list = events
        .iter()
        .map(|e| match e {
            Event::Stored { hashes, parent, tokens } => Value::Map(vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), Value::Array(hashes.iter().map(|h| Value::from(*h)).collect())),
                (s("parent_block_hash"), parent.map_or(Value::Nil, Value::from)),
                (s("token_ids"), Value::Array(tokens.iter().map(|t| Value::from(*t)).collect())),
                (s("block_size"), Value::from(block_size)),
                (s("lora_id"), Value::Nil),
                (s("medium"), s("GPU")),
                (s("lora_name"), Value::Nil),
            ]),
            Event::Removed { hashes } => Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), Value::Array(hashes.iter().map(|h| Value::from(*h)).collect())),
                (s("medium"), s("GPU")),
            ]),
        })
        .collect();
    let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::from(ts), Value::Array(list), Value::Nil]),
    );
    out
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Binds the PUB (and replay) sockets and starts the task that publishes what the cache sends.
async fn publish(
    e: &EventsConfig,
    block_size: u32,
) -> std::io::Result<(Publisher, (SocketAddr, Option<SocketAddr>))> {
    let io = |e: zeromq::ZmqError| std::io::Error::other(e.to_string());
    let addr = |ep: zeromq::Endpoint| match ep {
        zeromq::Endpoint::Tcp(host, port) => {
            format!("{host}:{port}").parse::<SocketAddr>().map_err(std::io::Error::other)
        }
        other => Err(std::io::Error::other(format!("not a tcp endpoint: {other}"))),
    };
    let mut pub_socket = PubSocket::new();
    let at = addr(pub_socket.bind(&format!("tcp://{}", e.listen)).await.map_err(io)?)?;
    let buffer: Buffer = Arc::default();
    let topic = Bytes::from(e.topic.clone());
    let mut tasks = Vec::new();
    let replay_at = match e.replay {
        Some(r) => {
            let mut router = RouterSocket::new();
            let at = addr(router.bind(&format!("tcp://{r}")).await.map_err(io)?)?;
            tasks.push(tokio::spawn(serve_replay(router, Arc::clone(&buffer), topic.clone())));
            Some(at)
        }
        None => None,
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<Event>>();
    tasks.push(tokio::spawn(async move {
        let mut seq: u64 = 0;
        while let Some(events) = rx.recv().await {
            let payload = Bytes::from(encode(&events, block_size));
            {
                let mut b = lock(&buffer);
                b.push_back((seq, payload.clone()));
                while b.len() > REPLAY_BUFFER {
                    b.pop_front();
                }
            }
            let mut m = ZmqMessage::from(topic.clone());
            m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            m.push_back(payload);
            // No subscriber is not an error: the batch stays for replay.
            let _ = pub_socket.send(m).await;
            seq += 1;
        }
    }));
    Ok((Publisher { tx, tasks }, (at, replay_at)))
}

async fn serve_replay(mut router: RouterSocket, buffer: Buffer, topic: Bytes) {
    while let Ok(m) = router.recv().await {
        let frames = m.into_vec();
        let [id, _, start] = &frames[..] else { continue };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else { continue };
        let held: Vec<(u64, Bytes)> = lock(&buffer).iter().filter(|(s, _)| *s >= start).cloned().collect();
        for (seq, payload) in held {
            let mut out = ZmqMessage::from(id.clone());
            out.push_back(Bytes::new());
            out.push_back(topic.clone());
            out.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            out.push_back(payload);
            if router.send(out).await.is_err() {
                break;
            }
        }
        let mut end = ZmqMessage::from(id.clone());
        for f in [Bytes::new(), Bytes::new(), Bytes::from_static(&[0xff; 8]), Bytes::new()] {
            end.push_back(f);
        }
        let _ = router.send(end).await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn cache(blocks: usize) -> PrefixCache {
        PrefixCache {
            config: CacheConfig {
                blocks,
                block_size: 4,
                prefill_fixed: Duration::from_millis(1),
                prefill_per_token: Duration::from_micros(10),
                prefill_lanes: 0,
                events: None,
            },
            lru: Mutex::new(Lru::default()),
            lanes: None,
            computed: Computed::default(),
            events: None,
            published_at: None,
        }
    }

    #[test]
    fn prefixes_are_cached_and_the_start_of_a_prompt_is_evicted_last() {
        let c = cache(4);
        let a: Vec<u32> = (0..16).collect();
        assert_eq!(c.admit(&a), 0);
        assert_eq!(c.admit(&a), 16);
        let mut b = a.clone();
        b[9] = 99;
        assert_eq!(c.admit(&b[..14]), 8, "the first two blocks are shared; a partial block is never cached");
        // 4 blocks held of 5 admitted (b's third block is new): the oldest tail went first, so
        // the shared start is still there.
        assert_eq!(c.blocks(), 4);
        assert_eq!(c.admit(&a[..8]), 8);
        assert_eq!(c.prefill_time(100, 40), Duration::from_millis(1) + Duration::from_micros(600));
    }
}
