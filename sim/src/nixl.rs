//! The simulated engine as vLLM with its NIXL connector (`vllm/distributed/kv_transfer/
//! kv_connector/v1/nixl_connector.py`, vLLM 0.10-0.11), so the gateway's `vllm-nixl` mode is tested
//! against the real request fields:
//!
//! - producer (prefill): a request whose `kv_transfer_params` has `do_remote_decode: true` keeps its
//!   KV blocks after finishing and answers `kv_transfer_params = {do_remote_prefill: true,
//!   do_remote_decode: false, remote_block_ids, remote_engine_id, remote_request_id, remote_host,
//!   remote_port, tp_size, dcp_size, pp_size, remote_num_tokens, remote_blocks_expiry_time,
//!   transfer_mode, remote_prefill_cached_tokens}`, as vLLM 0.32 does (checked against it by
//!   `tests/vllm.rs`). The blocks stay held until a consumer has read them, or
//!   `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` (480 s by default in vLLM 0.10-0.11; 0.32 holds them on a
//!   30 s lease instead) passes, or a consumer that refused the request says `FREE`.
//! - consumer (decode): a request with `do_remote_prefill: true` pulls the blocks from
//!   `remote_host:remote_port` before decoding, which lets the producer free them.
//!
//! Not vLLM's: the pull travels over a plain TCP side channel instead of NIXL/RDMA. A line
//! `READ <request id> <rank>` is answered by a `u32` length (`u32::MAX`: unknown or already freed) and
//! that rank's KV as chunk pages; `DONE <request id>` frees the blocks and is answered by one byte.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use super::blocks::{BlockPool, Blocks};
use super::kv::{chunk_page, prefix_hashes, verify_chunk};
use super::{SimError, lock};
use baton_dataplane::geometry::KvGeometry;

/// vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` default: how long a producer keeps blocks nobody read.
pub const DEFAULT_NIXL_ABORT_TIMEOUT: Duration = Duration::from_secs(480);
/// How often expired transfers are reaped.
const REAP_EVERY: Duration = Duration::from_millis(20);
const UNKNOWN: u32 = u32::MAX;

/// NIXL's fields inside `kv_transfer_params`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct NixlParams {
    #[serde(default)]
    pub do_remote_decode: bool,
    #[serde(default)]
    pub do_remote_prefill: bool,
    pub remote_engine_id: Option<String>,
    /// One list of block ids per KV cache group (vLLM 0.32; a flat list before).
    pub remote_block_ids: Option<Value>,
    pub remote_host: Option<String>,
    pub remote_port: Option<u16>,
    pub remote_request_id: Option<String>,
    pub tp_size: Option<u32>,
}

struct Transfer {
    ids: Arc<[u32]>,
    _blocks: Blocks,
    expires: Instant,
}

/// The producer side of a prefill engine.
pub struct Producer {
    pub engine_id: String,
    pub side: SocketAddr,
    geometry: KvGeometry,
    block_size: u32,
    pool: Arc<BlockPool>,
    pending: Arc<Mutex<HashMap<String, Transfer>>>,
    abort_timeout: Duration,
    next: AtomicU64,
    pub expired: Arc<AtomicU64>,
    pub read: Arc<AtomicU64>,
    /// Transfers freed unread because the consumer refused the request (`FREE`).
    pub released: Arc<AtomicU64>,
    _tasks: super::Tasks,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer").field("engine_id", &self.engine_id).field("side", &self.side).finish()
    }
}

impl Producer {
    /// Starts the side channel on `host` (ephemeral port) and the reaper.
    pub async fn start(
        geometry: KvGeometry,
        host: IpAddr,
        cache_blocks: u32,
        block_size: u32,
        abort_timeout: Duration,
    ) -> Result<Self, SimError> {
        let listener = TcpListener::bind(SocketAddr::new(host, 0))
            .await
            .map_err(|e| SimError::internal(format!("side channel: {e}")))?;
        let side = listener.local_addr().map_err(SimError::internal)?;
        let pending: Arc<Mutex<HashMap<String, Transfer>>> = Arc::default();
        let (expired, read) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let released = Arc::new(AtomicU64::new(0));
        let reaper = {
            let (pending, expired) = (Arc::clone(&pending), Arc::clone(&expired));
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(REAP_EVERY).await;
                    let now = Instant::now();
                    let mut p = lock(&pending);
                    let before = p.len();
                    p.retain(|_, t| t.expires > now);
                    expired.fetch_add((before - p.len()) as u64, Ordering::Relaxed);
                }
            })
        };
        let counters = (Arc::clone(&read), Arc::clone(&released));
        let server = tokio::spawn(serve_side(listener, Arc::clone(&pending), geometry, counters));
        let engine_id = format!(
            "baton-sim-{:016x}",
            super::kv::prefix_hashes(&[side.port().into(), std::process::id()]).last().copied().unwrap_or(0)
        );
        Ok(Self {
            engine_id,
            side,
            geometry,
            block_size: block_size.max(1),
            pool: BlockPool::new(cache_blocks),
            pending,
            abort_timeout,
            next: AtomicU64::new(1),
            expired,
            read,
            released,
            _tasks: super::Tasks(vec![reaper, server]),
        })
    }

    /// Keeps the prompt's blocks for a remote decode and returns the `kv_transfer_params` to answer.
    pub fn hold(&self, ids: &[u32]) -> Result<Value, SimError> {
        let id = format!("{}-{}", self.engine_id, self.next.fetch_add(1, Ordering::Relaxed));
        let mut block_ids = Vec::new();
        // Neutral engines keep nothing: no pull will come.
        if !super::kv::neutral() {
            let need = ids.len().div_ceil(self.block_size as usize);
            let blocks = self.pool.alloc(need).ok_or_else(|| {
                SimError::busy(format!("no room for {need} KV blocks ({} held)", self.pool.held()))
            })?;
            block_ids = blocks.ids().to_vec();
            lock(&self.pending).insert(
                id.clone(),
                Transfer { ids: ids.into(), _blocks: blocks, expires: Instant::now() + self.abort_timeout },
            );
        }
        // Every field vLLM 0.32's producer answers, in its order: the block ids one list per KV
        // cache group (one here), the prompt's token count, a pull transfer.
        Ok(json!({
            "do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine_id, "remote_request_id": id,
            "remote_host": self.side.ip().to_string(), "remote_port": self.side.port(),
            "tp_size": self.geometry.tp_size, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": ids.len(),
            "remote_blocks_expiry_time": null, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
        }))
    }

    /// Blocks held for remote decodes right now.
    pub fn held_blocks(&self) -> u32 {
        self.pool.held()
    }

    pub fn pending(&self) -> usize {
        lock(&self.pending).len()
    }
}

async fn serve_side(
    listener: TcpListener,
    pending: Arc<Mutex<HashMap<String, Transfer>>>,
    g: KvGeometry,
    (read, released): (Arc<AtomicU64>, Arc<AtomicU64>),
) {
    super::serve_each(listener, move |stream| {
        let (pending, read, released) = (Arc::clone(&pending), Arc::clone(&read), Arc::clone(&released));
        async move {
            let mut io = BufReader::new(stream);
            let mut line = String::new();
            loop {
                line.clear();
                match io.read_line(&mut line).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let mut parts = line.split_whitespace();
                let reply: Vec<u8> = match (parts.next(), parts.next(), parts.next()) {
                    (Some("READ"), Some(id), Some(rank)) => {
                        let ids = lock(&pending).get(id).map(|t| Arc::clone(&t.ids));
                        match (ids, rank.parse::<u32>()) {
                            (Some(ids), Ok(rank)) if rank < g.tp_size => {
                                let hashes = prefix_hashes(&ids);
                                let chunks = ids.len().div_ceil(g.chunk_tokens.max(1) as usize);
                                let mut out = Vec::new();
                                for c in 0..chunks {
                                    out.extend(chunk_page(
                                        &g,
                                        rank,
                                        &hashes,
                                        u32::try_from(c).unwrap_or(u32::MAX),
                                    ));
                                }
                                let mut v =
                                    u32::try_from(out.len()).unwrap_or(UNKNOWN).to_le_bytes().to_vec();
                                v.extend(out);
                                v
                            }
                            _ => UNKNOWN.to_le_bytes().to_vec(),
                        }
                    }
                    (Some("FREE"), Some(id), None) => {
                        let found = lock(&pending).remove(id).is_some();
                        if found {
                            released.fetch_add(1, Ordering::Relaxed);
                        }
                        vec![u8::from(found)]
                    }
                    (Some("DONE"), Some(id), None) => {
                        let found = lock(&pending).remove(id).is_some();
                        if found {
                            read.fetch_add(1, Ordering::Relaxed);
                        }
                        vec![u8::from(found)]
                    }
                    _ => return,
                };
                if io.get_mut().write_all(&reply).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
}

/// The consumer side: pulls a request's KV from its producer, checks every byte and tells the
/// producer it may free the blocks.
pub async fn pull(g: &KvGeometry, ids: &[u32], p: &NixlParams) -> Result<(), SimError> {
    let (Some(host), Some(port), Some(id)) = (&p.remote_host, p.remote_port, &p.remote_request_id) else {
        return Err(SimError::bad(
            "kv_transfer_params: do_remote_prefill needs remote_host, remote_port and remote_request_id",
        ));
    };
    if let Some(tp) = p.tp_size
        && tp != g.tp_size
    {
        return Err(SimError::bad(format!("producer has TP {tp}, this consumer {}", g.tp_size)));
    }
    let host: IpAddr =
        host.parse().map_err(|_| SimError::bad(format!("remote_host must be an IP: {host:?}")))?;
    let stream = TcpStream::connect(SocketAddr::new(host, port))
        .await
        .map_err(|e| SimError::upstream(format!("producer side channel {host}:{port}: {e}")))?;
    let _ = stream.set_nodelay(true);
    let mut io = BufReader::new(stream);
    let hashes = prefix_hashes(ids);
    let page = usize::try_from(g.page_bytes_per_rank()).unwrap_or(usize::MAX);
    for rank in 0..g.tp_size {
        let io_err = |e: std::io::Error| SimError::upstream(format!("reading KV from the producer: {e}"));
        io.get_mut().write_all(format!("READ {id} {rank}\n").as_bytes()).await.map_err(io_err)?;
        let len = io.read_u32_le().await.map_err(io_err)?;
        if len == UNKNOWN {
            return Err(SimError::gone(format!("producer no longer holds the KV of {id} (expired or read)")));
        }
        let mut data = vec![0u8; len as usize];
        io.read_exact(&mut data).await.map_err(io_err)?;
        for (c, chunk) in data.chunks(page.max(1)).enumerate() {
            verify_chunk(g, rank, &hashes, u32::try_from(c).unwrap_or(u32::MAX), chunk)
                .map_err(SimError::internal)?;
        }
    }
    io.get_mut()
        .write_all(format!("DONE {id}\n").as_bytes())
        .await
        .map_err(|e| SimError::upstream(format!("notifying the producer: {e}")))?;
    let _ = io.read_u8().await;
    Ok(())
}

/// The consumer refused a remote-prefill request: tells the producer to free the blocks it kept
/// (vLLM 0.32's `notify_kv_transfer_request_rejected`). Best effort, as there: a producer that
/// cannot be reached frees them when they expire.
pub async fn release(p: &NixlParams) {
    let (Some(host), Some(port), Some(id)) = (&p.remote_host, p.remote_port, &p.remote_request_id) else {
        return;
    };
    let Ok(host) = host.parse::<IpAddr>() else { return };
    let Ok(mut stream) = TcpStream::connect(SocketAddr::new(host, port)).await else { return };
    if stream.write_all(format!("FREE {id}\n").as_bytes()).await.is_ok() {
        let _ = stream.read_u8().await;
    }
}
