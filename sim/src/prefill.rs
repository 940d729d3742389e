//! The prefill role: computes (derives) the prompt's KV into its own paged cache, gathers it into
//! chunk pages through the device trait and writes them into the decoder ranks' reserved pages.
//!
//! The engine's cache blocks for a request are a guard held until every decoder rank has
//! acknowledged every chunk, the transfer fails, or the hold TTL passes (a decoder that went silent
//! cannot strand them), whichever comes first. After any outcome it fences every decoder rank it
//! was told about, so pages quarantined by a cancel come back at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;

use super::SimError;
use super::api::DecoderTarget;
use super::blocks::BlockPool;
use super::faults::Faults;
use super::kv::{prefix_hashes, write_kv};
use baton_dataplane::contract::ReserveOrder;
use baton_dataplane::device::any::{AnyDevice, AnyTensor};
use baton_dataplane::device::{CacheLayout, Device, KvSpan};
use baton_dataplane::geometry::KvGeometry;
use baton_dataplane::ids::{PageAddr, RequestKey};
use baton_dataplane::transport::{ProducerClient, TransportError};
use baton_dataplane::wire::RefusalCode;

/// How long a prefiller holds a request's KV blocks waiting for the decoder to take them. Past it the
/// transfer is abandoned and the blocks freed: a dead decoder or gateway cannot strand them.
pub const DEFAULT_PRODUCER_HOLD_TTL: Duration = Duration::from_secs(30);

/// Fences every target when a prefill is abandoned mid-way (its future dropped).
struct FenceOnDrop {
    engine: Arc<PrefillEngine>,
    key: RequestKey,
    targets: Vec<DecoderTarget>,
    armed: bool,
}

impl Drop for FenceOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (engine, key, targets) = (Arc::clone(&self.engine), self.key, std::mem::take(&mut self.targets));
        rt.spawn(async move {
            for t in targets {
                engine.fence(t.addr, t.rank, key).await;
            }
        });
    }
}

struct Rank {
    cache: Vec<AnyTensor>,
    layout: CacheLayout,
    pool: Arc<BlockPool>,
}

/// What one prefill wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillReport {
    pub chunks: u32,
    pub bytes: u64,
}

/// A prefill engine with `tp_size` ranks (from the geometry), each with its own paged cache.
pub struct PrefillEngine {
    geometry: KvGeometry,
    device: Arc<AnyDevice>,
    ranks: Vec<Rank>,
    producers: Mutex<HashMap<(SocketAddr, u32), Vec<ProducerClient>>>,
    faults: Arc<Faults>,
    hold_ttl: Duration,
    /// mTLS to the decoder ranks, when their data plane requires it.
    tls: Option<baton_dataplane::transport::TlsClient>,
}

impl std::fmt::Debug for PrefillEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillEngine")
            .field("geometry", &self.geometry)
            .field("held_blocks", &self.held_blocks())
            .finish()
    }
}

impl PrefillEngine {
    pub fn new(
        device: &AnyDevice,
        geometry: KvGeometry,
        cache_blocks: u32,
        block_size: u32,
        faults: Arc<Faults>,
        hold_ttl: Duration,
        tls: Option<baton_dataplane::transport::TlsClient>,
    ) -> Result<Arc<Self>, SimError> {
        let device = Arc::new(device.clone());
        let cl = geometry.chunk_layout();
        let ranks = (0..geometry.tp_size)
            .map(|_| {
                // The prefiller's cache is NHD; the decoder's is HND, so every transfer crosses layouts.
                let layout =
                    CacheLayout::nhd(cache_blocks, block_size, cl.heads, cl.head_dim, cl.dtype_bytes);
                let cache = (0..cl.layers)
                    .map(|_| device.alloc_tensor(layout.min_tensor_bytes()))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Rank { cache, layout, pool: BlockPool::new(cache_blocks) })
            })
            .collect::<Result<Vec<_>, baton_dataplane::device::DeviceError>>()
            .map_err(SimError::internal)?;
        Ok(Arc::new(Self {
            geometry,
            device,
            ranks,
            producers: Mutex::new(HashMap::new()),
            faults,
            hold_ttl,
            tls,
        }))
    }

    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// Engine cache blocks held by requests right now (0 when idle).
    pub fn held_blocks(&self) -> u32 {
        self.ranks.iter().map(|r| r.pool.held()).sum()
    }

    /// Prefills `ids` and writes the chunks to `targets`: to the pages they name, or, with
    /// `reserve`, to pages this prefiller reserves on each of them itself, in the same write.
    pub async fn prefill(
        self: &Arc<Self>,
        key: RequestKey,
        ids: &[u32],
        targets: &[DecoderTarget],
        reserve: Option<ReserveOrder>,
    ) -> Result<PrefillReport, SimError> {
        // Neutral engines derive no KV, so they need no prefix hashes either.
        let hashes = if super::kv::neutral() { Vec::new() } else { prefix_hashes(ids) };
        let bs = self.ranks.first().map_or(1, |r| r.layout.block_size as usize);
        let need = ids.len().div_ceil(bs);
        let mut held = Vec::with_capacity(self.ranks.len());
        for (r, rank) in self.ranks.iter().enumerate() {
            let blocks = rank.pool.alloc(need).ok_or_else(|| {
                SimError::busy(format!(
                    "prefill rank {r} has no room for {need} cache blocks ({} total)",
                    rank.pool.total()
                ))
            })?;
            write_kv(
                &*self.device,
                &rank.cache,
                &rank.layout,
                blocks.ids(),
                &hashes,
                u32::try_from(r).unwrap_or(0),
            )
            .map_err(SimError::internal)?;
            held.push(blocks);
        }
        let chunks_needed =
            u32::try_from(ids.len().div_ceil(self.geometry.chunk_tokens as usize)).unwrap_or(u32::MAX);
        for t in targets {
            if t.rank >= self.geometry.tp_size {
                return Err(SimError::bad(format!(
                    "decoder rank {} but this prefiller has {} ranks",
                    t.rank, self.geometry.tp_size
                )));
            }
            if t.chunks.len() > chunks_needed as usize {
                return Err(SimError::bad(format!(
                    "{} chunk addresses for a prompt of {chunks_needed} chunks",
                    t.chunks.len()
                )));
            }
            if reserve.is_some() && !t.chunks.is_empty() {
                return Err(SimError::bad("chunk addresses and a reservation to make: one or the other"));
            }
        }
        if let Some(r) = reserve
            && r.chunks != chunks_needed
        {
            return Err(SimError::bad(format!(
                "a reservation of {} chunks for a prompt of {chunks_needed} chunks",
                r.chunks
            )));
        }

        // If this future is dropped (the caller gave up), the decoders still learn at once that no
        // more writes will come, instead of waiting out their quarantine.
        let mut fence_guard =
            FenceOnDrop { engine: Arc::clone(self), key, targets: targets.to_vec(), armed: true };
        let mut tasks = JoinSet::new();
        for t in targets.iter().cloned() {
            let this = Arc::clone(self);
            let blocks: Vec<u32> = held.get(t.rank as usize).map(|b| b.ids().to_vec()).unwrap_or_default();
            let tokens = ids.len();
            tasks.spawn(async move { this.send_rank(key, &t, &blocks, tokens, reserve).await });
        }
        let outcome = tokio::time::timeout(self.hold_ttl, async {
            let mut report = PrefillReport { chunks: 0, bytes: 0 };
            while let Some(r) = tasks.join_next().await {
                let r = r.map_err(|e| SimError::internal(format!("transfer task: {e}")))??;
                report.chunks += r.chunks;
                report.bytes += r.bytes;
            }
            Ok(report)
        })
        .await
        .unwrap_or_else(|_| {
            Err(SimError::timeout(format!("kv transfer not confirmed within {:?}", self.hold_ttl)))
        });
        tasks.shutdown().await;
        // Whatever happened, the decoders learn that nothing more will come for this request (a
        // transfer that succeeded fenced with its chunks).
        fence_guard.armed = false;
        if outcome.is_err() {
            for t in targets {
                self.fence(t.addr, t.rank, key).await;
            }
        }
        drop(held);
        outcome
    }

    async fn producer(&self, addr: SocketAddr, rank: u32) -> Result<ProducerClient, SimError> {
        let pooled = self
            .producers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&(addr, rank))
            .and_then(Vec::pop);
        match pooled {
            Some(p) => Ok(p),
            None => ProducerClient::connect_with(addr, self.tls.as_ref(), self.geometry.fingerprint(), rank)
                .await
                .map_err(|e| SimError::upstream(format!("decoder rank {rank} at {addr}: {e}"))),
        }
    }

    fn give_back(&self, addr: SocketAddr, rank: u32, p: ProducerClient) {
        self.producers.lock().unwrap_or_else(|e| e.into_inner()).entry((addr, rank)).or_default().push(p);
    }

    async fn send_rank(
        &self,
        key: RequestKey,
        t: &DecoderTarget,
        blocks: &[u32],
        tokens: usize,
        reserve: Option<ReserveOrder>,
    ) -> Result<PrefillReport, SimError> {
        let rank = self
            .ranks
            .get(t.rank as usize)
            .ok_or_else(|| SimError::bad(format!("no prefill rank {}", t.rank)))?;
        let cl = self.geometry.chunk_layout();
        let staging = self.device.alloc_buffer(1, cl.page_bytes()).map_err(SimError::internal)?;
        let mut page = vec![0u8; cl.page_bytes()];
        let mut producer = self.producer(t.addr, t.rank).await?;
        let mut report = PrefillReport { chunks: 0, bytes: 0 };
        let failed = |chunk: u32, e: TransportError| transfer_error(t.rank, &format!("chunk {chunk}"), &e);
        // Given the pages, or reserving them: the Reserve leaves with the chunks, which name
        // their page by chunk.
        let pages: Vec<(u32, PageAddr)> = match reserve {
            Some(r) => {
                producer.queue_reserve(key, r.chunks, Duration::from_millis(u64::from(r.lease_ms)));
                (0..r.chunks).map(|c| (c, PageAddr::BY_CHUNK)).collect()
            }
            None => {
                t.chunks.iter().map(|&(c, page, generation)| (c, PageAddr { page, generation })).collect()
            }
        };
        for (chunk, addr) in pages {
            let f = self.faults.get();
            let pauses = [
                (f.stall_chunk == Some(chunk)).then_some(f.stall_ms),
                (f.slow_rank == Some(t.rank)).then_some(f.slow_ms),
            ];
            if pauses.iter().any(Option::is_some) {
                // The chunks before a pause are at the rank while it lasts.
                producer.flush().await.map_err(|e| failed(chunk, e))?;
            }
            for ms in pauses.into_iter().flatten() {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            let first = chunk as usize * cl.chunk_tokens as usize;
            let count = tokens.saturating_sub(first).min(cl.chunk_tokens as usize);
            let span = KvSpan {
                layout: &rank.layout,
                block_table: blocks,
                first_token: u32::try_from(first).unwrap_or(u32::MAX),
                tokens: u32::try_from(count).unwrap_or(0),
            };
            // Neutral engines move zero pages: no KV was computed to gather.
            if !super::kv::neutral() {
                self.device.gather(&rank.cache, &span, &cl, &staging, 0).map_err(SimError::internal)?;
                self.device.read_page(&staging, 0, 0, &mut page).map_err(SimError::internal)?;
            }
            // Pipelined, small chunks sharing writes (the gathered ones are computed together
            // here): the rank's answers are read once the window is full or every chunk is sent.
            producer.queue_chunk(key, chunk, addr, &page).await.map_err(|e| failed(chunk, e))?;
            report.chunks += 1;
            report.bytes += page.len() as u64;
        }
        // The fence rides with the last chunks: one round trip for a small transfer.
        producer
            .finish(Some(key))
            .await
            .map_err(|e| transfer_error(t.rank, &format!("{key}'s chunks"), &e))?;
        self.give_back(t.addr, t.rank, producer);
        Ok(report)
    }

    async fn fence(&self, addr: SocketAddr, rank: u32, key: RequestKey) {
        // A failed fence is harmless: the decoder's quarantine deadline covers it.
        if let Ok(mut p) = self.producer(addr, rank).await
            && p.fence(key).await.is_ok()
        {
            self.give_back(addr, rank, p);
        }
    }
}

/// A failed write to decoder rank `rank`: the contract's busy answer when the rank refused the
/// reservation this prefiller made for lack of room, else a transfer failure.
fn transfer_error(rank: u32, what: &str, e: &TransportError) -> SimError {
    let m = format!("writing {what} to decoder rank {rank}: {e}");
    match e {
        TransportError::Refused { code: RefusalCode::Busy, .. } => SimError::kv_busy(m),
        _ => SimError::upstream(m),
    }
}
