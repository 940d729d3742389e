//! The decode role: a data-plane decoder with `tp_size` ranks (tasks in one process, each with its own
//! PD buffer and server). A request's KV is consumed only after every byte of every chunk is checked;
//! a mismatch is an error, never a silent 200. Chunks are then scattered into the rank's own paged
//! cache (HND layout) and the pages freed, which emits "pages released".

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::TcpListener;

use super::SimError;
use super::blocks::{BlockPool, Blocks};
use super::faults::{Faults, FaultySink};
use super::kv::{prefix_hashes, verify_chunk};
use baton_dataplane::buffer::{BufferOptions, NotReady, RankBuffer};
use baton_dataplane::clock::SystemClock;
use baton_dataplane::device::any::{AnyDevice, AnyTensor};
use baton_dataplane::device::{CacheLayout, Device, KvSpan};
use baton_dataplane::geometry::KvGeometry;
use baton_dataplane::ids::RequestKey;
use baton_dataplane::transport::{RankServer, ServerHandle, WaitError};

pub struct DecodeRank {
    pub server: Arc<RankServer<AnyDevice>>,
    pub addr: SocketAddr,
    handle: tokio::sync::Mutex<Option<ServerHandle>>,
    sink: Arc<FaultySink>,
    cache: Vec<AnyTensor>,
    layout: CacheLayout,
    pool: Arc<BlockPool>,
}

impl std::fmt::Debug for DecodeRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeRank").field("addr", &self.addr).field("server", &self.server).finish()
    }
}

/// A decode engine.
pub struct DecodeEngine {
    geometry: KvGeometry,
    pub ranks: Vec<DecodeRank>,
    faults: Arc<Faults>,
}

impl std::fmt::Debug for DecodeEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeEngine")
            .field("geometry", &self.geometry)
            .field("ranks", &self.ranks.len())
            .finish()
    }
}

impl DecodeEngine {
    /// Starts one data-plane server per rank on `host` (ephemeral ports).
    pub async fn start(
        c: &super::SimConfig,
        device: &AnyDevice,
        faults: Arc<Faults>,
    ) -> Result<Arc<Self>, SimError> {
        let (geometry, pages, cache_blocks, block_size, host, base_port) =
            (c.geometry, c.pages, c.cache_blocks, c.block_size, c.dp_host, c.dp_base_port);
        let options = BufferOptions { quarantine_ttl: c.quarantine_ttl, ..BufferOptions::default() };
        let device = Arc::new(device.clone());
        let cl = geometry.chunk_layout();
        let mut ranks = Vec::new();
        for r in 0..geometry.tp_size {
            let (bsink, tx) = RankServer::<AnyDevice>::sink();
            let sink = Arc::new(FaultySink {
                rank: r,
                inner: bsink,
                faults: Arc::clone(&faults),
                crashed: Default::default(),
            });
            let buf = RankBuffer::new(
                Arc::clone(&device),
                geometry,
                r,
                pages,
                options,
                Arc::new(SystemClock),
                sink.clone(),
            )
            .map_err(SimError::internal)?;
            let server = RankServer::new(buf, geometry.tp_size, tx);
            server.set_decode_waits(c.decode_waits);
            let port = match base_port {
                Some(b) => b
                    .checked_add(u16::try_from(r).unwrap_or(u16::MAX))
                    .ok_or_else(|| SimError::bad("data-plane port overflow"))?,
                None => 0,
            };
            let at = SocketAddr::new(host, port);
            let listener =
                TcpListener::bind(at).await.map_err(|e| SimError::internal(format!("bind {at}: {e}")))?;
            let handle = match &c.dp_tls {
                Some(t) => server.start_tls(listener, t.server.clone()),
                None => server.start(listener),
            }
            .map_err(SimError::internal)?;
            let layout = CacheLayout::hnd(cache_blocks, block_size, cl.heads, cl.head_dim, cl.dtype_bytes);
            let cache = (0..cl.layers)
                .map(|_| device.alloc_tensor(layout.min_tensor_bytes()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(SimError::internal)?;
            ranks.push(DecodeRank {
                server,
                addr: handle.addr,
                handle: tokio::sync::Mutex::new(Some(handle)),
                sink,
                cache,
                layout,
                pool: BlockPool::new(cache_blocks),
            });
        }
        Ok(Arc::new(Self { geometry, ranks, faults }))
    }

    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// Engine cache blocks held by requests right now (0 when idle).
    pub fn held_blocks(&self) -> u32 {
        self.ranks.iter().map(|r| r.pool.held()).sum()
    }

    /// Engine cache blocks of all ranks.
    pub fn total_blocks(&self) -> u32 {
        self.ranks.iter().map(|r| r.pool.total()).sum()
    }

    /// Applies the crash switch: the rank stops serving, forgets its reservations and says nothing.
    pub async fn apply_faults(&self) {
        let Some(r) = self.faults.get().crash_rank else {
            return;
        };
        let Some(rank) = self.ranks.get(r as usize) else {
            return;
        };
        rank.sink.crashed.store(true, Ordering::SeqCst);
        if let Some(h) = rank.handle.lock().await.take() {
            h.shutdown().await;
        }
        rank.server.clear();
    }

    /// Takes the request's KV from every rank: checks it is ready and byte-exact, scatters it into
    /// the engine's cache, frees the PD pages. Returns the engine blocks now holding the KV.
    ///
    /// With `wait` (the request's `kv_wait_ms`), a rank whose KV is not all in yet is waited for,
    /// up to that long in all.
    pub async fn consume(
        &self,
        key: RequestKey,
        ids: &[u32],
        wait: Option<Duration>,
    ) -> Result<Vec<Blocks>, SimError> {
        let deadline = wait.map(|w| tokio::time::Instant::now() + w);
        // Neutral engines check nothing (the pages are zeros): no prefix hashes to check against.
        let hashes = if super::kv::neutral() { Vec::new() } else { prefix_hashes(ids) };
        let cl = self.geometry.chunk_layout();
        let chunks = u32::try_from(ids.len().div_ceil(cl.chunk_tokens as usize)).unwrap_or(u32::MAX);
        let mut held = Vec::new();
        for (r, rank) in self.ranks.iter().enumerate() {
            let r32 = u32::try_from(r).unwrap_or(u32::MAX);
            if rank.sink.crashed.load(Ordering::SeqCst) {
                return Err(SimError::upstream(format!("decoder rank {r} is down")));
            }
            let ready = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(tokio::time::Instant::now());
                    match rank.server.take_ready(key, left).await {
                        Ok(ready) => ready,
                        Err(e @ WaitError::NotReserved(_)) => {
                            return Err(SimError::conflict(format!("rank {r}: {e}")));
                        }
                        Err(e @ WaitError::Closed(..)) => {
                            return Err(SimError::gone(format!("rank {r}: {e}")));
                        }
                        Err(e @ WaitError::TimedOut(..)) => {
                            return Err(SimError::timeout(format!("rank {r}: {e}")));
                        }
                    }
                }
                None => {
                    let res = rank
                        .server
                        .take(key)
                        .ok_or_else(|| SimError::conflict(format!("no reservation for {key} on rank {r}")))?;
                    match res.try_ready() {
                        Ok(ready) => ready,
                        // Dropping the reservation cancels it: a decode that came too early fails
                        // cleanly.
                        Err(NotReady::Pending(_)) => {
                            return Err(SimError::conflict(format!("kv of {key} is not ready on rank {r}")));
                        }
                        Err(NotReady::Closed(e)) => {
                            return Err(SimError::gone(format!("kv of {key} on rank {r}: {e}")));
                        }
                    }
                }
            };
            if ready.chunks() != chunks {
                return Err(SimError::bad(format!(
                    "reservation has {} chunks, the prompt needs {chunks}",
                    ready.chunks()
                )));
            }
            let f = self.faults.get();
            if f.slow_rank == Some(r32) {
                tokio::time::sleep(Duration::from_millis(f.slow_ms)).await;
            }
            let bs = rank.layout.block_size as usize;
            let blocks = rank.pool.alloc(ids.len().div_ceil(bs)).ok_or_else(|| {
                SimError::busy(format!("decode rank {r} has no room for the request's cache blocks"))
            })?;
            let consuming =
                ready.consume().map_err(|e| SimError::gone(format!("kv of {key} on rank {r}: {e}")))?;
            let mut page = vec![0u8; cl.page_bytes()];
            // Neutral engines check nothing and keep nothing: the pages are consumed and freed.
            let moved = if super::kv::neutral() { 0 } else { chunks };
            for chunk in 0..moved {
                consuming.read_chunk(chunk, &mut page).map_err(SimError::internal)?;
                verify_chunk(&self.geometry, r32, &hashes, chunk, &page).map_err(SimError::internal)?;
                let first = chunk as usize * cl.chunk_tokens as usize;
                let count = ids.len().saturating_sub(first).min(cl.chunk_tokens as usize);
                let span = KvSpan {
                    layout: &rank.layout,
                    block_table: blocks.ids(),
                    first_token: u32::try_from(first).unwrap_or(u32::MAX),
                    tokens: u32::try_from(count).unwrap_or(0),
                };
                consuming.scatter_chunk(chunk, &rank.cache, &span).map_err(SimError::internal)?;
            }
            drop(consuming);
            held.push(blocks);
        }
        Ok(held)
    }
}
