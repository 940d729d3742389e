//! A decode engine as the gateway sees it: its HTTP address, its ranks' data-plane control
//! connections, one event subscription per rank routed to the requests waiting on them, and the
//! admission queue sized by the buffer the ranks report (never typed by hand).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_dataplane::transport::{ControlClient, EventStream, TransportError};
use baton_dataplane::wire::RefusalCode;
use baton_dataplane::{PageAddr, PrefixKey, RankEvent, RequestKey};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::admission::{QueueConfig, SlotQueue};

type Waiters = Arc<Mutex<HashMap<RequestKey, mpsc::UnboundedSender<RankEvent>>>>;

/// One decode engine.
pub struct DecoderHandle {
    pub name: String,
    pub http: SocketAddr,
    pub ranks: Vec<SocketAddr>,
    pub chunk_tokens: u32,
    fingerprint: u64,
    controls: Vec<tokio::sync::Mutex<Vec<ControlClient>>>,
    waiters: Waiters,
    pub queue: SlotQueue,
    _routers: JoinSet<()>,
}

impl std::fmt::Debug for DecoderHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecoderHandle").field("name", &self.name).field("ranks", &self.ranks).finish()
    }
}

/// What a decoder's ranks say about their buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankView {
    pub rank: u32,
    pub pages_total: u32,
    pub pages_free: u32,
}

impl DecoderHandle {
    /// Connects to every rank, reads the buffer size and subscribes to events. `max_slots` may only
    /// lower the capacity the ranks report.
    pub async fn connect(
        name: String,
        http: SocketAddr,
        ranks: Vec<SocketAddr>,
        fingerprint: u64,
        chunk_tokens: u32,
        max_slots: Option<u32>,
        queue: QueueConfig,
    ) -> Result<Arc<Self>, TransportError> {
        let waiters: Waiters = Arc::default();
        let mut routers = JoinSet::new();
        let mut capacity = u32::MAX;
        let mut controls = Vec::new();
        for (r, addr) in ranks.iter().enumerate() {
            let r32 = u32::try_from(r).unwrap_or(u32::MAX);
            let mut c = ControlClient::connect(*addr, fingerprint, r32).await?;
            capacity = capacity.min(c.info().await?.pages_total);
            controls.push(tokio::sync::Mutex::new(vec![c]));
            let mut ev = EventStream::connect(*addr, fingerprint, r32).await?;
            let w = Arc::clone(&waiters);
            routers.spawn(async move {
                while let Ok(Some(e)) = ev.next().await {
                    let key = match e {
                        RankEvent::Status(s) => s.key(),
                        RankEvent::Released(r) => r.key,
                    };
                    let tx = w.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned();
                    if let Some(tx) = tx {
                        let _ = tx.send(e);
                    }
                }
            });
        }
        if ranks.is_empty() {
            capacity = 0;
        }
        let capacity = max_slots.map_or(capacity, |m| m.min(capacity));
        Ok(Arc::new(Self {
            name,
            http,
            ranks,
            chunk_tokens,
            fingerprint,
            controls,
            waiters,
            queue: SlotQueue::new(capacity, queue),
            _routers: routers,
        }))
    }

    async fn control(&self, rank: usize) -> Result<ControlClient, TransportError> {
        let pooled = match self.controls.get(rank) {
            Some(m) => m.lock().await.pop(),
            None => None,
        };
        match pooled {
            Some(c) => Ok(c),
            None => {
                let addr = self.ranks.get(rank).copied().ok_or(TransportError::Closed)?;
                ControlClient::connect(addr, self.fingerprint, u32::try_from(rank).unwrap_or(u32::MAX)).await
            }
        }
    }

    async fn give_back(&self, rank: usize, c: ControlClient) {
        if let Some(m) = self.controls.get(rank) {
            m.lock().await.push(c);
        }
    }

    /// Reserves on every rank or none. `Ok(None)`: some rank has no room right now (another gateway
    /// replica holds pages); the caller retries.
    pub async fn reserve(
        &self,
        key: RequestKey,
        chunks: u32,
        lease: Duration,
        prefixes: &[PrefixKey],
    ) -> Result<Option<Vec<Vec<(u32, PageAddr)>>>, TransportError> {
        let mut got = Vec::with_capacity(self.ranks.len());
        for r in 0..self.ranks.len() {
            let res = match self.control(r).await {
                Ok(mut c) => {
                    let res = c.reserve(key, chunks, lease, prefixes).await;
                    if res.is_ok() || matches!(res, Err(TransportError::Refused { .. })) {
                        self.give_back(r, c).await;
                    }
                    res
                }
                Err(e) => Err(e),
            };
            match res {
                Ok(addrs) => got.push(addrs),
                Err(TransportError::Refused { code: RefusalCode::Busy, .. }) => {
                    self.cancel(key, true).await;
                    return Ok(None);
                }
                Err(e) => {
                    // All or none: what other ranks granted goes back at once.
                    self.cancel(key, true).await;
                    return Err(e);
                }
            }
        }
        Ok(Some(got))
    }

    /// Cancels on every rank (idempotent; a rank that cannot be reached is skipped: its lease ends
    /// the reservation). `unsent`: no prefiller ever had the addresses.
    pub async fn cancel(&self, key: RequestKey, unsent: bool) {
        for r in 0..self.ranks.len() {
            let Ok(mut c) = self.control(r).await else { continue };
            let res = if unsent { c.cancel_unsent(key).await } else { c.cancel(key).await };
            if res.is_ok() {
                self.give_back(r, c).await;
            }
        }
    }

    /// Routes the events of `key` to the returned receiver until [`DecoderHandle::forget`].
    pub fn listen(&self, key: RequestKey) -> mpsc::UnboundedReceiver<RankEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.waiters.lock().unwrap_or_else(|e| e.into_inner()).insert(key, tx);
        rx
    }

    pub fn forget(&self, key: RequestKey) {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
    }

    /// What every rank reports now.
    pub async fn ranks_view(&self) -> Vec<RankView> {
        let mut out = Vec::new();
        for r in 0..self.ranks.len() {
            if let Ok(mut c) = self.control(r).await
                && let Ok(i) = c.info().await
            {
                out.push(RankView { rank: i.rank, pages_total: i.pages_total, pages_free: i.pages_free });
                self.give_back(r, c).await;
            }
        }
        out
    }

    pub fn rank_count(&self) -> u32 {
        u32::try_from(self.ranks.len()).unwrap_or(u32::MAX)
    }
}
