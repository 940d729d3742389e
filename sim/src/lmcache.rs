//! The simulated engine as vLLM with LMCache's PD backend (`pd_backend.py`, LMCache 0.3.x), so the
//! gateway's `lmcache` mode is tested against the real message formats:
//!
//! - decoder ("receiver"): per TP rank, a ZMQ REP socket on the rank's *alloc port* answering
//!   msgpack `AllocRequest` with `AllocResponse` from a fixed PD buffer of `pd_buffer_size` bytes in
//!   chunk-sized objects. Like LMCache it busy-waits (10 ms) while the buffer is full, which is where
//!   the classic deadlock comes from. Objects are freed when a decode request retrieves them.
//! - prefiller ("sender"): for a request whose `kv_transfer_params.disagg_spec` names a receiver, each
//!   rank asks that decoder rank for room, writes its chunks, then PUSHes `ProxyNotif{req_id}` to the
//!   proxy (`pd_proxy_host:pd_proxy_port` in LMCache's YAML; here [`SenderConfig::proxy`]). With
//!   `ret_first_tok` the response carries `kv_transfer_params.first_tok`.
//!
//! The one part that is not LMCache's: the bytes travel over a plain TCP channel on the rank's *init
//! port* (LMCache uses NIXL/RDMA there): `u32 index, u16 key length, key, u32 length, bytes`, each
//! answered by one byte (1 stored, 0 refused because that object was freed or reused).
//!
//! Keys follow LMCache's `CacheEngineKey` string shape, `fmt@model@world_size@worker_id@hash`, with the
//! hash of the token prefix up to the chunk's end (the last chunk may be partial).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::SimError;
use super::faults::Faults;
use super::kv::{chunk_page, prefix_hashes, verify_chunk};
use baton_dataplane::compat::lmcache::{AllocRequest, AllocResponse, PdMsg, ProxyNotif};
use baton_dataplane::compat::zmtp::{Connection, RepServer, SocketType};
use baton_dataplane::geometry::KvGeometry;

/// LMCache's pause between allocation attempts while the PD buffer is full (`pd_backend.py`).
const ALLOC_RETRY: Duration = Duration::from_millis(10);
/// LMCache waits forever; the simulator gives up after this and answers index -1, so a broken test
/// ends instead of hanging.
const ALLOC_GIVE_UP: Duration = Duration::from_secs(60);
/// Largest message on the allocation channel.
const MAX_ALLOC_MESSAGE: usize = 4 << 20;
/// Longest a retrieval waits for a chunk another request's transfer is still writing.
const SHARED_WRITE_WAIT: Duration = Duration::from_secs(5);
/// `MemoryFormat.KV_2LTD` in LMCache: `[2, layers, tokens, hidden]`.
const FMT_KV_2LTD: i64 = 1;

/// The `disagg_spec` of a prefill request (`kv_transfer_params.disagg_spec`).
#[derive(Clone, Debug, Deserialize)]
pub struct DisaggSpec {
    pub req_id: String,
    pub receiver_host: String,
    pub receiver_init_port: Vec<u16>,
    pub receiver_alloc_port: Vec<u16>,
}

/// LMCache's request fields inside `kv_transfer_params`.
#[derive(Clone, Debug, Deserialize)]
pub struct LmcacheParams {
    #[serde(default)]
    pub ret_first_tok: bool,
    pub disagg_spec: Option<DisaggSpec>,
}

/// The key of each chunk of `ids` on `rank`.
pub fn chunk_keys(model: &str, g: &KvGeometry, rank: u32, ids: &[u32]) -> Vec<String> {
    let hashes = prefix_hashes(ids);
    let c = g.chunk_tokens.max(1) as usize;
    (0..ids.len().div_ceil(c))
        .map(|i| {
            let end = ((i + 1) * c).min(ids.len());
            let h = hashes.get(end - 1).copied().unwrap_or(0);
            format!("vllm@{model}@{}@{rank}@{h:016x}", g.tp_size)
        })
        .collect()
}

#[derive(Debug)]
struct Obj {
    key: String,
    data: Option<Vec<u8>>,
    /// Requests that will retrieve it: LMCache pins an object a second request asks for again
    /// (`contains(key, pin=True)`) instead of allocating it twice.
    refs: u32,
}

#[derive(Debug, Default)]
struct Store {
    free: Vec<u32>,
    objs: HashMap<u32, Obj>,
    by_key: HashMap<String, u32>,
}

/// Counters of one receiver rank.
#[derive(Debug, Default)]
pub struct ReceiverStats {
    pub alloc_waits: AtomicU64,
    pub late_writes: AtomicU64,
    pub retrieved: AtomicU64,
    pub recomputed: AtomicU64,
}

/// One decoder rank's PD buffer and its two listeners.
#[derive(Debug)]
pub struct ReceiverRank {
    pub rank: u32,
    pub capacity: u32,
    pub alloc_addr: SocketAddr,
    pub init_addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    pub stats: Arc<ReceiverStats>,
    _alloc: RepServer,
    _init: tokio::task::JoinHandle<()>,
}

impl Drop for ReceiverRank {
    fn drop(&mut self) {
        self._init.abort();
    }
}

impl ReceiverRank {
    pub fn used(&self) -> u32 {
        let s = self.store.lock().unwrap_or_else(|e| e.into_inner());
        u32::try_from(s.objs.len()).unwrap_or(u32::MAX)
    }
}

fn lock(s: &Mutex<Store>) -> std::sync::MutexGuard<'_, Store> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// Answers one `AllocRequest`: keys already held are reported sent; the others get an object each,
/// waiting (like LMCache) while the buffer is full.
async fn allocate(store: Arc<Mutex<Store>>, stats: Arc<ReceiverStats>, req: AllocRequest) -> AllocResponse {
    let mut out = AllocResponse { already_sent_indexes: Vec::new(), remote_indexes: Vec::new() };
    let give_up = tokio::time::Instant::now() + ALLOC_GIVE_UP;
    for (i, key) in req.keys.into_iter().enumerate() {
        loop {
            {
                let mut s = lock(&store);
                if let Some(&idx) = s.by_key.get(&key) {
                    if let Some(o) = s.objs.get_mut(&idx) {
                        o.refs += 1;
                    }
                    out.already_sent_indexes.push(i64::try_from(i).unwrap_or(i64::MAX));
                    break;
                }
                if let Some(idx) = s.free.pop() {
                    s.by_key.insert(key.clone(), idx);
                    s.objs.insert(idx, Obj { key, data: None, refs: 1 });
                    out.remote_indexes.push(i64::from(idx));
                    break;
                }
            }
            if tokio::time::Instant::now() >= give_up {
                out.remote_indexes.push(-1);
                break;
            }
            stats.alloc_waits.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(ALLOC_RETRY).await;
        }
    }
    out
}

async fn serve_init(listener: TcpListener, store: Arc<Mutex<Store>>, stats: Arc<ReceiverStats>, max: usize) {
    super::serve_each(listener, move |stream| {
        let (store, stats) = (Arc::clone(&store), Arc::clone(&stats));
        async move {
            let mut io = BufReader::new(stream);
            loop {
                let Ok(idx) = io.read_u32_le().await else { return };
                let Ok(klen) = io.read_u16_le().await else { return };
                let mut key = vec![0u8; usize::from(klen)];
                if io.read_exact(&mut key).await.is_err() {
                    return;
                }
                let Ok(len) = io.read_u32_le().await else { return };
                if len as usize > max {
                    return;
                }
                let mut data = vec![0u8; len as usize];
                if io.read_exact(&mut data).await.is_err() {
                    return;
                }
                let stored = {
                    let mut s = lock(&store);
                    match s.objs.get_mut(&idx) {
                        Some(o) if o.key.as_bytes() == key.as_slice() => {
                            o.data = Some(data);
                            true
                        }
                        _ => false,
                    }
                };
                if !stored {
                    stats.late_writes.fetch_add(1, Ordering::Relaxed);
                }
                if io.get_mut().write_all(&[u8::from(stored)]).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
}

/// The decoder side: one [`ReceiverRank`] per TP rank.
#[derive(Debug)]
pub struct Receiver {
    pub geometry: KvGeometry,
    pub model: String,
    pub ranks: Vec<ReceiverRank>,
}

/// What a decode request found in the PD buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retrieved {
    /// Chunks taken (on every rank).
    pub chunks: usize,
    /// The prompt tokens they cover.
    pub tokens: usize,
}

impl Receiver {
    /// Binds each rank's alloc and init listeners on `host` (`alloc_ports`/`init_ports` when given,
    /// else ephemeral), with `buffer_bytes` of PD buffer per rank.
    pub async fn start(
        geometry: KvGeometry,
        model: String,
        host: std::net::IpAddr,
        buffer_bytes: u64,
        alloc_ports: &[u16],
        init_ports: &[u16],
    ) -> Result<Self, SimError> {
        let page = geometry.page_bytes_per_rank().max(1);
        let capacity = u32::try_from(buffer_bytes / page).unwrap_or(u32::MAX);
        let mut ranks = Vec::new();
        for r in 0..geometry.tp_size {
            let store =
                Arc::new(Mutex::new(Store { free: (0..capacity).rev().collect(), ..Store::default() }));
            let stats = Arc::new(ReceiverStats::default());
            let port = |ports: &[u16]| ports.get(r as usize).copied().unwrap_or(0);
            let (s2, st2) = (Arc::clone(&store), Arc::clone(&stats));
            let alloc =
                RepServer::bind(SocketAddr::new(host, port(alloc_ports)), MAX_ALLOC_MESSAGE, move |body| {
                    let (store, stats) = (Arc::clone(&s2), Arc::clone(&st2));
                    async move {
                        let reply = match PdMsg::decode(&body) {
                            Ok(PdMsg::AllocRequest(req)) => allocate(store, stats, req).await,
                            _ => AllocResponse { already_sent_indexes: Vec::new(), remote_indexes: vec![-1] },
                        };
                        PdMsg::AllocResponse(reply).encode().unwrap_or_default()
                    }
                })
                .await
                .map_err(|e| SimError::internal(format!("alloc listener of rank {r}: {e}")))?;
            let at = SocketAddr::new(host, port(init_ports));
            let listener =
                TcpListener::bind(at).await.map_err(|e| SimError::internal(format!("bind {at}: {e}")))?;
            let init_addr = listener.local_addr().map_err(SimError::internal)?;
            let max = usize::try_from(page).unwrap_or(usize::MAX);
            let init = tokio::spawn(serve_init(listener, Arc::clone(&store), Arc::clone(&stats), max));
            ranks.push(ReceiverRank {
                rank: r,
                capacity,
                alloc_addr: alloc.addr,
                init_addr,
                store,
                stats,
                _alloc: alloc,
                _init: init,
            });
        }
        Ok(Self { geometry, model, ranks })
    }

    /// Takes the KV of the longest stored prefix of `ids` (all of it, or all but the last token: the
    /// first token a prefiller returned is appended to the prompt) from every rank, checking each
    /// byte, and releases the objects (freed when no other request pinned them). Nothing stored: the
    /// engine would recompute (counted). A chunk of this request allocated but never written, or
    /// wrong bytes, is an error, never a silent answer. A chunk shared with another request may
    /// still be in that request's transfer (LMCache has the same window); it is waited for briefly.
    pub async fn retrieve(&self, ids: &[u32]) -> Result<Retrieved, SimError> {
        let candidates = [ids.len(), ids.len().saturating_sub(1)];
        let Some(&n) = candidates.iter().find(|&&n| {
            n > 0
                && self.ranks.iter().all(|rk| {
                    let s = lock(&rk.store);
                    chunk_keys(&self.model, &self.geometry, rk.rank, &ids[..n])
                        .iter()
                        .all(|k| s.by_key.contains_key(k))
                })
        }) else {
            for rk in &self.ranks {
                rk.stats.recomputed.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(Retrieved { chunks: 0, tokens: 0 });
        };
        let prompt = &ids[..n];
        let hashes = prefix_hashes(prompt);
        let mut result = Ok(());
        let mut chunks = 0;
        for rk in &self.ranks {
            let keys = chunk_keys(&self.model, &self.geometry, rk.rank, prompt);
            chunks = keys.len();
            for (c, k) in keys.iter().enumerate() {
                let give_up = tokio::time::Instant::now() + SHARED_WRITE_WAIT;
                let page = loop {
                    // `None`: wait for another request's write; `Some(None)`: not stored.
                    let step: Option<Option<Option<Vec<u8>>>> = {
                        let mut s = lock(&rk.store);
                        match s.by_key.get(k).copied() {
                            None => Some(None),
                            Some(idx) => match s.objs.get_mut(&idx) {
                                None => Some(None),
                                Some(o)
                                    if o.data.is_none()
                                        && o.refs > 1
                                        && tokio::time::Instant::now() < give_up =>
                                {
                                    None
                                }
                                Some(o) => {
                                    o.refs -= 1;
                                    if o.refs == 0 {
                                        let data = s.objs.remove(&idx).and_then(|o| o.data);
                                        s.by_key.remove(k);
                                        s.free.push(idx);
                                        Some(Some(data))
                                    } else {
                                        Some(Some(o.data.clone()))
                                    }
                                }
                            },
                        }
                    };
                    match step {
                        Some(found) => break found,
                        None => tokio::time::sleep(Duration::from_millis(1)).await,
                    }
                };
                let Some(page) = page else { continue };
                if result.is_err() {
                    continue;
                }
                let c32 = u32::try_from(c).unwrap_or(u32::MAX);
                result = match page {
                    None => Err(SimError::conflict(format!(
                        "chunk {c} on rank {} was allocated but never written",
                        rk.rank
                    ))),
                    Some(page) => {
                        verify_chunk(&self.geometry, rk.rank, &hashes, c32, &page).map_err(SimError::internal)
                    }
                };
            }
            rk.stats.retrieved.fetch_add(keys.len() as u64, Ordering::Relaxed);
        }
        result.map(|()| Retrieved { chunks, tokens: n })
    }

    pub fn used(&self) -> u32 {
        self.ranks.iter().map(ReceiverRank::used).sum()
    }
}

/// Where a prefiller sends its notifications.
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// The proxy's PULL address (`pd_proxy_host:pd_proxy_port`).
    pub proxy: Option<SocketAddr>,
    /// Answer the prefill before the chunks are written (LMCache's `PDBackendAsync`): writes and
    /// notifications follow in the background, so a notification may come long after the answer.
    pub async_send: bool,
}

type Pool<T> = Mutex<HashMap<SocketAddr, Vec<T>>>;

/// A background transfer failed: nobody waits for it, so it goes to stderr (the simulator has no
/// logger of its own).
#[allow(clippy::print_stderr)]
fn tracing_free_log(e: &SimError) {
    eprintln!("baton-sim: background lmcache transfer failed: {e}");
}

/// The prefiller side.
#[derive(Debug)]
pub struct Sender {
    pub geometry: KvGeometry,
    pub model: String,
    config: SenderConfig,
    faults: Arc<Faults>,
    alloc: Pool<Connection>,
    data: Pool<BufReader<TcpStream>>,
    /// One PUSH connection per rank, as each LMCache worker has its own socket.
    notify: Vec<tokio::sync::Mutex<Option<Connection>>>,
    pub notifications_sent: AtomicU64,
}

fn take<T>(pool: &Pool<T>, addr: SocketAddr) -> Option<T> {
    pool.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&addr).and_then(Vec::pop)
}

fn put<T>(pool: &Pool<T>, addr: SocketAddr, v: T) {
    pool.lock().unwrap_or_else(|e| e.into_inner()).entry(addr).or_default().push(v);
}

impl Sender {
    pub fn new(geometry: KvGeometry, model: String, config: SenderConfig, faults: Arc<Faults>) -> Self {
        let notify = (0..geometry.tp_size).map(|_| tokio::sync::Mutex::new(None)).collect();
        Self {
            geometry,
            model,
            config,
            faults,
            alloc: Mutex::default(),
            data: Mutex::default(),
            notify,
            notifications_sent: AtomicU64::new(0),
        }
    }

    /// Sends the prompt's KV to the receiver named in `spec`, every rank in parallel, each rank
    /// notifying the proxy once its chunks are written.
    pub async fn send(self: &Arc<Self>, spec: &DisaggSpec, ids: &[u32]) -> Result<(), SimError> {
        let tp = self.geometry.tp_size as usize;
        if spec.receiver_alloc_port.len() != tp || spec.receiver_init_port.len() != tp {
            return Err(SimError::bad(format!(
                "disagg_spec names {} alloc and {} init ports for {tp} ranks",
                spec.receiver_alloc_port.len(),
                spec.receiver_init_port.len()
            )));
        }
        let host: std::net::IpAddr = spec.receiver_host.parse().map_err(|_| {
            SimError::bad(format!("receiver_host must be an IP address: {:?}", spec.receiver_host))
        })?;
        let ids: Arc<[u32]> = ids.into();
        let mut tasks = JoinSet::new();
        for r in 0..self.geometry.tp_size {
            let this = Arc::clone(self);
            let (ids, spec) = (Arc::clone(&ids), spec.clone());
            let alloc = SocketAddr::new(host, spec.receiver_alloc_port[r as usize]);
            let init = SocketAddr::new(host, spec.receiver_init_port[r as usize]);
            tasks.spawn(async move { this.send_rank(r, alloc, init, &spec.req_id, &ids).await });
        }
        if self.config.async_send {
            tokio::spawn(async move {
                while let Some(r) = tasks.join_next().await {
                    if let Ok(Err(e)) = r {
                        tracing_free_log(&e);
                    }
                }
            });
            return Ok(());
        }
        while let Some(r) = tasks.join_next().await {
            r.map_err(|e| SimError::internal(format!("transfer task: {e}")))??;
        }
        Ok(())
    }

    async fn send_rank(
        &self,
        rank: u32,
        alloc_addr: SocketAddr,
        init_addr: SocketAddr,
        req_id: &str,
        ids: &[u32],
    ) -> Result<(), SimError> {
        if super::kv::neutral() {
            // Only what the gateway sees: the notification.
            return self.notify_proxy(rank, req_id).await;
        }
        let g = &self.geometry;
        let keys = chunk_keys(&self.model, g, rank, ids);
        let c = g.chunk_tokens as usize;
        let last = ids.len() - (keys.len().saturating_sub(1)) * c;
        let cl = g.chunk_layout();
        let req = PdMsg::AllocRequest(AllocRequest {
            keys: keys.clone(),
            fmt: FMT_KV_2LTD,
            shape: vec![
                2,
                i64::from(cl.layers),
                i64::from(cl.chunk_tokens),
                i64::from(cl.heads * cl.head_dim),
            ],
            dtype: "bfloat16".into(),
            last_chunk_toks: i64::try_from(last).unwrap_or(0),
            transpose: None,
        });
        let bytes = req.encode().map_err(SimError::internal)?;
        let mut conn =
            match take(&self.alloc, alloc_addr) {
                Some(c) => c,
                None => Connection::connect(alloc_addr, SocketType::Req, MAX_ALLOC_MESSAGE).await.map_err(
                    |e| SimError::upstream(format!("alloc channel of rank {rank} at {alloc_addr}: {e}")),
                )?,
            };
        let reply = conn
            .request(&bytes)
            .await
            .map_err(|e| SimError::upstream(format!("alloc request to rank {rank}: {e}")))?;
        put(&self.alloc, alloc_addr, conn);
        let resp = match PdMsg::decode(&reply).map_err(SimError::upstream)? {
            PdMsg::AllocResponse(r) => r,
            other => return Err(SimError::upstream(format!("alloc answer was {other:?}"))),
        };
        let to_send: Vec<usize> = (0..keys.len())
            .filter(|i| !resp.already_sent_indexes.contains(&i64::try_from(*i).unwrap_or(-1)))
            .collect();
        if to_send.len() != resp.remote_indexes.len() || resp.remote_indexes.iter().any(|i| *i < 0) {
            return Err(SimError::upstream(format!(
                "rank {rank}: receiver could not allocate ({} of {} chunks)",
                resp.remote_indexes.iter().filter(|i| **i >= 0).count(),
                to_send.len()
            )));
        }
        let hashes = prefix_hashes(ids);
        let mut io = match take(&self.data, init_addr) {
            Some(io) => io,
            None => {
                let s = TcpStream::connect(init_addr).await.map_err(|e| {
                    SimError::upstream(format!("init channel of rank {rank} at {init_addr}: {e}"))
                })?;
                let _ = s.set_nodelay(true);
                BufReader::new(s)
            }
        };
        for (&chunk, &remote) in to_send.iter().zip(&resp.remote_indexes) {
            let f = self.faults.get();
            if f.slow_rank == Some(rank) {
                tokio::time::sleep(Duration::from_millis(f.slow_ms)).await;
            }
            let page = chunk_page(g, rank, &hashes, u32::try_from(chunk).unwrap_or(u32::MAX));
            let key = keys.get(chunk).map(String::as_bytes).unwrap_or_default();
            let mut frame = Vec::with_capacity(page.len() + key.len() + 10);
            frame.extend_from_slice(&u32::try_from(remote).unwrap_or(u32::MAX).to_le_bytes());
            frame.extend_from_slice(&u16::try_from(key.len()).unwrap_or(u16::MAX).to_le_bytes());
            frame.extend_from_slice(key);
            frame.extend_from_slice(&u32::try_from(page.len()).unwrap_or(u32::MAX).to_le_bytes());
            frame.extend_from_slice(&page);
            let ack = async {
                io.get_mut().write_all(&frame).await?;
                io.read_u8().await
            }
            .await
            .map_err(|e| SimError::upstream(format!("writing chunk {chunk} to rank {rank}: {e}")))?;
            if ack != 1 {
                return Err(SimError::upstream(format!("rank {rank} refused chunk {chunk} (object gone)")));
            }
        }
        put(&self.data, init_addr, io);
        self.notify_proxy(rank, req_id).await
    }

    async fn notify_proxy(&self, rank: u32, req_id: &str) -> Result<(), SimError> {
        let Some(proxy) = self.config.proxy else { return Ok(()) };
        let f = self.faults.get();
        if f.drop_notify {
            return Ok(());
        }
        let copies = if f.duplicate_notify_rank == Some(rank) { 2 } else { 1 };
        if f.delay_notify_rank == Some(rank) {
            tokio::time::sleep(Duration::from_millis(f.delay_notify_ms)).await;
        }
        let msg = PdMsg::ProxyNotif(ProxyNotif { req_id: req_id.to_owned() })
            .encode()
            .map_err(SimError::internal)?;
        let slot = self.notify.get(rank as usize).ok_or_else(|| SimError::internal("no such rank"))?;
        let mut sock = slot.lock().await;
        for _ in 0..copies {
            if sock.is_none() {
                *sock = Some(
                    Connection::connect(proxy, SocketType::Push, 1 << 20)
                        .await
                        .map_err(|e| SimError::upstream(format!("proxy at {proxy}: {e}")))?,
                );
            }
            let sent = match sock.as_mut() {
                Some(c) => c.send(&[&msg]).await,
                None => continue,
            };
            if let Err(e) = sent {
                *sock = None;
                return Err(SimError::upstream(format!("notifying the proxy at {proxy}: {e}")));
            }
            self.notifications_sent.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}
