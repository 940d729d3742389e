//! The PULL socket LMCache prefillers notify (`ProxyNotif{req_id}`, one per decoder TP rank), and
//! the requests waiting on it. Each sending connection counts once per request, so a duplicate
//! never releases a request early; a notification for nobody is counted and dropped.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use baton_dataplane::compat::lmcache::ProxyNotif;
use baton_dataplane::compat::zmtp::{DEFAULT_MAX_MESSAGE, DEFAULT_MAX_PEERS, PullServer, Pulled};
use smallvec::SmallVec;
use tokio::sync::{mpsc, oneshot};

use crate::telemetry::Scrape;

/// Counters of the notification listener.
#[derive(Debug, Default)]
pub struct NotifyStats {
    /// A rank's first notification for a request being waited for.
    pub counted: AtomicU64,
    /// A second notification from the same connection for the same request (ignored).
    pub duplicate: AtomicU64,
    /// For no request being waited for (late, after its deadline, or not ours).
    pub unmatched: AtomicU64,
    /// Not a `ProxyNotif`.
    pub malformed: AtomicU64,
}

struct Pending {
    need: usize,
    peers: SmallVec<[u64; 8]>,
    done: Option<oneshot::Sender<()>>,
}

/// The PULL socket LMCache prefillers notify (`pd_proxy_host:pd_proxy_port` in their YAML), and the
/// requests waiting on it.
#[derive(Debug)]
pub struct Notifications {
    pub addr: SocketAddr,
    pub stats: NotifyStats,
    pending: Mutex<HashMap<String, Pending>>,
    server: PullServer,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("need", &self.need).field("peers", &self.peers.len()).finish()
    }
}

impl Drop for Notifications {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The notification listener could not listen.
#[derive(Debug, thiserror::Error)]
#[error("lmcache notifications on {addr}: {source}")]
pub struct BindError {
    pub addr: SocketAddr,
    #[source]
    pub source: baton_dataplane::compat::zmtp::ZmtpError,
}

impl Notifications {
    /// Binds the PULL socket on `addr`.
    pub async fn bind(addr: SocketAddr) -> Result<Arc<Self>, BindError> {
        let (tx, mut rx) = mpsc::channel::<Pulled>(4096);
        let server = PullServer::bind(addr, tx, DEFAULT_MAX_PEERS, DEFAULT_MAX_MESSAGE)
            .await
            .map_err(|source| BindError { addr, source })?;
        Ok(Arc::new_cyclic(|weak: &Weak<Self>| {
            let weak = weak.clone();
            let task = tokio::spawn(async move {
                while let Some(p) = rx.recv().await {
                    let Some(this) = weak.upgrade() else { return };
                    this.observe(&p);
                }
            });
            Self { addr: server.addr, stats: NotifyStats::default(), pending: Mutex::default(), server, task }
        }))
    }

    fn observe(&self, p: &Pulled) {
        let id = match p.frames.as_slice() {
            [one] => match ProxyNotif::req_id(one) {
                Ok(id) => id,
                Err(_) => {
                    self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            },
            _ => {
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let Some(e) = pending.get_mut(id) else {
            self.stats.unmatched.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if e.peers.contains(&p.peer) {
            self.stats.duplicate.fetch_add(1, Ordering::Relaxed);
            return;
        }
        e.peers.push(p.peer);
        self.stats.counted.fetch_add(1, Ordering::Relaxed);
        if e.peers.len() >= e.need
            && let Some(tx) = e.done.take()
        {
            let _ = tx.send(());
        }
    }

    /// Starts waiting for `need` notifications of `req_id` (before the prefill is sent, so none is
    /// missed). The registration ends when the returned value is dropped.
    pub fn expect(self: &Arc<Self>, req_id: String, need: usize) -> Expect {
        let (tx, rx) = oneshot::channel();
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.insert(req_id.clone(), Pending { need, peers: SmallVec::new(), done: Some(tx) });
        Expect { hub: Arc::clone(self), req_id, rx: Some(rx), need }
    }

    /// Requests being waited for now.
    pub fn waiting(&self) -> usize {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn listener_stats(&self) -> &baton_dataplane::compat::zmtp::ListenerStats {
        &self.server.stats
    }
}

/// One request's wait for its notifications.
#[derive(Debug)]
pub struct Expect {
    hub: Arc<Notifications>,
    req_id: String,
    rx: Option<oneshot::Receiver<()>>,
    need: usize,
}

impl Drop for Expect {
    fn drop(&mut self) {
        self.hub.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.req_id);
    }
}

impl Expect {
    /// Waits until every rank notified or `deadline`; `Err(got)` with how many did by then.
    pub async fn wait(&mut self, deadline: Instant) -> Result<(), usize> {
        let Some(rx) = self.rx.as_mut() else { return Ok(()) };
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx).await {
            Ok(Ok(())) => {
                self.rx = None;
                Ok(())
            }
            _ => {
                let pending = self.hub.pending.lock().unwrap_or_else(|e| e.into_inner());
                Err(pending.get(&self.req_id).map_or(0, |p| p.peers.len()))
            }
        }
    }

    pub fn need(&self) -> usize {
        self.need
    }
}

impl Notifications {
    /// Adds the listener's series.
    pub fn metrics(&self, out: &mut Scrape) {
        let st = &self.stats;
        for (k, c) in [
            ("counted", &st.counted),
            ("duplicate", &st.duplicate),
            ("unmatched", &st.unmatched),
            ("malformed", &st.malformed),
        ] {
            out.counter(
                "baton_lmcache_notifications_total",
                "LMCache ProxyNotif messages received, by what became of them.",
                &[("outcome", k)],
                c.load(Ordering::Relaxed) as f64,
            );
        }
        out.gauge(
            "baton_lmcache_waiting_requests",
            "Requests waiting for their prefill ranks' notifications.",
            &[],
            self.waiting() as f64,
        );
    }
}
