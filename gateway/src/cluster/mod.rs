//! `[cluster]`: several gateway replicas in front of one fleet, never admitting more than a decoder
//! holds between them.
//!
//! How each mode keeps the truth ([`Sharing`]):
//! - `native`: the decoder's own data plane. Its ranks refuse a reservation that does not fit,
//!   whichever replica asks; a refused replica waits and tries again within the queue timeout.
//!   A replica killed mid-request leaves reservations whose lease runs out on the ranks.
//! - `vllm-nixl`, `sglang`: a share of the decoder's `max_in_flight` per replica, granted by the
//!   store (Redis) in one atomic script, so the live replicas' shares never sum past the capacity.
//!   A replica's slot queue admits only within its share. Each replica renews a lease with every
//!   sync; a replica that stops (killed, cut off) loses its share when the lease runs out, and
//!   the others may take it then.
//! - `lmcache`: refused with `[cluster]` (the decoder's LMCache notifies one proxy address).
//!
//! The share follows demand: a replica with requests waiting asks at once; one with nobody waiting
//! keeps up to a fair share (capacity / live replicas) spare, so a request that reaches it goes at
//! once. While any replica waits, the one whose oldest waiter has waited longest may grow and the
//! others shrink toward a fair share (less when its next request needs more), as their requests
//! end: nobody starves, a request needing the whole buffer included.
//!
//! Flow control, when on, is shared too ([`crate::flow::Fleet`]): each tenant's token budget is
//! one bucket in the store, taken from per request in one atomic script (the store's clock refills
//! it) and given back, less what the answer cost, when it ends; tenants' fair-share counters add
//! every replica's service, synced every `sync` interval, so a tenant served by one replica waits
//! its turn at the others. While the store is down, each replica checks a budget against its own
//! share of it (over the live replicas last counted, its own recent use included), and orders
//! tenants by the others' service as last read.
//!
//! When the store cannot be reached a replica keeps the share it last held and never grows it
//! (failing closed: the shares last granted sum to at most the capacity). A replica that never
//! reached the store holds nothing. Both are logged and counted (`baton_cluster_store_up`,
//! `baton_cluster_store_errors_total`). When the store comes back having lost its data (a restart),
//! the first replica to say it holds slots makes everyone hold still for one lease, until every
//! live replica has re-registered what it holds.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::handoff::{Decoder, Mode, Sharing};
use crate::telemetry::Scrape;

/// A replica's lease in the store when none is configured: a killed replica's share comes back to
/// the others within it.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(5);

/// How often a replica renews its lease and settles its share when nothing asks sooner.
pub const DEFAULT_SYNC: Duration = Duration::from_millis(50);

/// The longest a call to the store may take before it counts as down (less with a short lease:
/// an eighth of it, so a reachable replica renews well within its lease).
const STORE_TIMEOUT: Duration = Duration::from_millis(500);

/// Retry of a store that could not be reached, at most this often per decoder (or an eighth of
/// the lease).
const RECONNECT_EVERY: Duration = Duration::from_millis(250);

/// The least time between two syncs of one decoder, however fast requests start waiting.
const MIN_SYNC_GAP: Duration = Duration::from_millis(5);

/// `[cluster]`, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterConfig {
    /// The store's URL (`redis://[user:password@]host:port[/db]`).
    pub store: String,
    /// This replica's name in the store: unique per live process.
    pub replica: String,
    /// The lease each sync renews.
    pub lease: Duration,
    /// How often a replica syncs when nothing asks sooner.
    pub sync: Duration,
    /// What every key this gateway writes starts with.
    pub key_prefix: String,
}

impl ClusterConfig {
    /// One line for `baton check-config`.
    pub fn describe(&self) -> String {
        format!(
            "replica {} sharing vllm-nixl and sglang decoders through {} (lease {} ms, sync {} ms, keys {}:*); native decoders' own ranks are their truth",
            self.replica,
            redacted(&self.store),
            self.lease.as_millis(),
            self.sync.as_millis(),
            self.key_prefix
        )
    }

    /// A replica name unique to this process: `prefix` (default: the host's name, a Kubernetes
    /// pod's), the process id and a random suffix. Always unique, even when every replica's file
    /// says the same `replica` (two replicas under one name would be counted as one, and together
    /// granted twice what the decoder holds); a restarted process is a new replica, and the old
    /// one's lease runs out.
    pub fn replica_name(prefix: Option<&str>) -> String {
        let host = prefix
            .map(str::to_owned)
            .or_else(|| std::env::var("HOSTNAME").ok())
            .filter(|h| !h.is_empty())
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|h| h.trim().to_owned()))
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "baton".into());
        format!("{host}-{}-{:08x}", std::process::id(), rand::random::<u32>())
    }

    /// The longest a call to the store may take.
    fn store_timeout(&self) -> Duration {
        STORE_TIMEOUT.min(self.lease / 8)
    }

    /// How often a store found down is tried again.
    fn reconnect_every(&self) -> Duration {
        RECONNECT_EVERY.min(self.lease / 8)
    }
}

/// One decoder the store shares (the share granted is its queue's).
struct Member {
    decoder: Arc<Decoder>,
    /// Told when a request starts waiting here.
    demand: Arc<Notify>,
    replicas: AtomicU32,
    settling: AtomicBool,
    /// Whether the store ever granted this replica a share of the decoder.
    synced: AtomicBool,
    /// Rises with every call: the store ignores a call that arrives after a later one.
    seq: AtomicU64,
}

/// The replicas' shared truth, as this replica sees it.
pub struct Cluster {
    cfg: ClusterConfig,
    client: redis::Client,
    conn: tokio::sync::Mutex<Option<redis::aio::MultiplexedConnection>>,
    script: redis::Script,
    members: Vec<Member>,
    up: AtomicBool,
    /// The store's being down was logged (once per outage).
    warned: AtomicBool,
    errors: AtomicU64,
    /// When the store was last found down (for reconnect pacing), in ms since `epoch`.
    down_at: AtomicU64,
    epoch: tokio::time::Instant,
    /// Decoders whose own state is the truth (native), by name: listed in the view.
    engine_truth: Vec<String>,
    /// Flow control, when on: its next request counts as waiting for every shared decoder.
    flow: std::sync::OnceLock<Weak<crate::flow::FlowControl>>,
    flow_script: redis::Script,
    budget_script: redis::Script,
    /// Replicas flow control counted in the store (0: never counted).
    flow_replicas: AtomicU32,
    /// Budget calls to the store: taken, refused, failed.
    budget_calls: [AtomicU64; 3],
    /// Itself, for the budget's give-backs made in the background.
    me: std::sync::OnceLock<Weak<Cluster>>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("replica", &self.cfg.replica)
            .field("store_up", &self.store_up())
            .finish()
    }
}

/// Why `[cluster]` cannot start.
#[derive(Debug, thiserror::Error)]
#[error("cluster.store: {0}")]
pub struct ClusterError(#[from] redis::RedisError);

impl Cluster {
    /// Shares `decoders` through the store: each one the store shares admits nothing until the
    /// store granted this replica a share. Starts one sync task per such decoder; they end when
    /// the cluster is dropped.
    pub fn start(cfg: ClusterConfig, decoders: &[Arc<Decoder>]) -> Result<Arc<Self>, ClusterError> {
        let client = redis::Client::open(cfg.store.as_str())?;
        let mut members = Vec::new();
        let mut engine_truth = Vec::new();
        for d in decoders {
            match Mode::parse(d.mode()).map_or(Sharing::Store, Mode::sharing) {
                Sharing::Engine => engine_truth.push(d.name.clone()),
                // Refused by the configuration's check; a replica alone in the store then.
                Sharing::Store | Sharing::Single => {
                    let demand = Arc::new(Notify::new());
                    d.queue.watch_demand(Arc::clone(&demand));
                    d.queue.set_share(Some(0));
                    members.push(Member {
                        decoder: Arc::clone(d),
                        demand,
                        replicas: AtomicU32::new(0),
                        settling: AtomicBool::new(false),
                        synced: AtomicBool::new(false),
                        seq: AtomicU64::new(0),
                    });
                }
            }
        }
        let cluster = Arc::new(Self {
            cfg,
            client,
            conn: tokio::sync::Mutex::new(None),
            script: redis::Script::new(include_str!("share.lua")),
            members,
            up: AtomicBool::new(false),
            warned: AtomicBool::new(false),
            errors: AtomicU64::new(0),
            down_at: AtomicU64::new(0),
            epoch: tokio::time::Instant::now(),
            engine_truth,
            flow: std::sync::OnceLock::new(),
            flow_script: redis::Script::new(include_str!("flow.lua")),
            budget_script: redis::Script::new(include_str!("budget.lua")),
            flow_replicas: AtomicU32::new(0),
            budget_calls: Default::default(),
            me: std::sync::OnceLock::new(),
        });
        let _ = cluster.me.set(Arc::downgrade(&cluster));
        for i in 0..cluster.members.len() {
            tokio::spawn(sync_loop(Arc::downgrade(&cluster), i));
        }
        tracing::info!(
            replica = %cluster.cfg.replica,
            store = %redacted(&cluster.cfg.store),
            shared = cluster.members.len(),
            "cluster: decoders' slots shared with the other replicas through the store"
        );
        Ok(cluster)
    }

    /// Has flow control's next request count as waiting for the shared decoders (with flow
    /// control on, requests wait there rather than in the decoders' queues); the syncs read it
    /// every `sync` interval.
    ///
    /// Shares flow control's budgets and counters with the other replicas too (one sync task,
    /// ended when flow control or the cluster is gone).
    pub fn attach_flow(self: &Arc<Self>, flow: &Arc<crate::flow::FlowControl>) {
        if self.flow.set(Arc::downgrade(flow)).is_ok() {
            flow.share_with(Arc::clone(self) as Arc<dyn crate::flow::Fleet>);
            tokio::spawn(flow_loop(Arc::downgrade(self), Arc::downgrade(flow)));
        }
    }

    fn flow_key(&self, what: &str) -> String {
        // One hash tag for flow control's keys (a Redis Cluster keeps them in one slot).
        format!("{}:{{flow}}:{what}", self.cfg.key_prefix)
    }

    /// One sync of flow control's counters: this replica's service in, the fleet's out.
    async fn sync_flow(&self, flow: &crate::flow::FlowControl) -> Result<(), redis::RedisError> {
        let sent = flow.unsynced();
        let mut conn = self.connection().await?;
        let mut call = self.flow_script.prepare_invoke();
        call.key(self.flow_key("served:"))
            .key(self.flow_key("replicas"))
            .arg(&self.cfg.replica)
            .arg(ms(self.cfg.lease))
            .arg(ms(COUNTERS_KEPT));
        for u in &sent {
            call.arg(&*u.tenant).arg(u.served.to_string());
        }
        let answer: Vec<String> = call.invoke_async(&mut conn).await?;
        let parsed: Option<Vec<f64>> = answer.iter().map(|v| v.parse().ok()).collect();
        let (Some(replicas), Some(totals)) = (answer.first().and_then(|r| r.parse().ok()), parsed) else {
            return Err(script_answer("the flow script", &answer));
        };
        if totals.len() != sent.len() + 1 {
            return Err(script_answer("the flow script", &answer));
        }
        self.flow_replicas.store(replicas, Ordering::Relaxed);
        flow.synced(&sent, &totals[1..]);
        Ok(())
    }

    /// Whether a call to the store may be made now: it is up, or was last found down long
    /// enough ago to be tried again.
    fn store_callable(&self) -> bool {
        let down = self.down_at.load(Ordering::Relaxed);
        self.store_up()
            || down == 0
            || self.since_epoch_ms().saturating_sub(down) >= ms(self.cfg.reconnect_every())
    }

    /// A call to the store within its timeout, its failure recorded.
    async fn call<T>(
        &self,
        f: impl Future<Output = Result<T, redis::RedisError>>,
    ) -> Result<T, redis::RedisError> {
        let limit = self.cfg.store_timeout();
        let r = match tokio::time::timeout(limit, f).await {
            Ok(r) => r,
            Err(_) => Err(redis::RedisError::from((
                redis::ErrorKind::Io,
                "timed out",
                format!("no answer within {limit:?}"),
            ))),
        };
        self.outcome(r.as_ref().map(|_| ())).await;
        r
    }

    /// One call of the budget script: `take` of the tenant's bucket if `need` is there (or, with
    /// a negative `take`, given back).
    async fn budget(
        &self,
        tenant: &str,
        rule: crate::flow::BudgetRule,
        take: f64,
        need: f64,
    ) -> Result<Result<(), u64>, redis::RedisError> {
        let mut conn = self.connection().await?;
        let answer: (u8, String) = self
            .budget_script
            .key(self.flow_key(&format!("budget:{tenant}")))
            .arg(rule.tokens_per_minute)
            .arg(take.to_string())
            .arg(need.to_string())
            .invoke_async(&mut conn)
            .await?;
        match answer {
            (1, _) => Ok(Ok(())),
            (0, refill) => match refill.parse::<f64>() {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                Ok(s) if s.is_finite() => Ok(Err(s.max(1.0) as u64)),
                _ => Err(script_answer("the budget script", &[refill])),
            },
            (n, v) => Err(script_answer("the budget script", &[n.to_string(), v])),
        }
    }

    /// What this replica wants of a decoder: its queue's demand, and, when nobody waits there,
    /// flow control's next request (on every shared decoder: any of them may take it).
    fn demand(&self, m: &Member) -> crate::admission::Demand {
        let q = &m.decoder.queue;
        let mut d = q.demand();
        let head = self.flow.get().and_then(Weak::upgrade).and_then(|f| f.head());
        if let Some((tokens, age)) = head {
            let need = m.decoder.slots_for(tokens);
            if d.head == 0 && need <= q.load().capacity {
                d.want += u64::from(need);
                d.head = need;
                d.head_age = age;
            }
        }
        d
    }

    /// Whether the last call to the store succeeded.
    pub fn store_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Whether the last call to the store failed (not before a first call has answered).
    fn store_known_down(&self) -> bool {
        !self.store_up() && self.down_at.load(Ordering::Relaxed) != 0
    }

    fn key(&self, decoder: &str, what: &str) -> String {
        // One hash tag per decoder: a Redis Cluster keeps a decoder's keys in one slot, as the
        // script needs.
        format!("{}:{{{}}}:{what}", self.cfg.key_prefix, decoder)
    }

    async fn connection(&self) -> Result<redis::aio::MultiplexedConnection, redis::RedisError> {
        let mut conn = self.conn.lock().await;
        if let Some(c) = conn.as_ref() {
            return Ok(c.clone());
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.cfg.store_timeout()))
            .set_response_timeout(Some(self.cfg.store_timeout()));
        let c = self.client.get_multiplexed_async_connection_with_config(&config).await?;
        *conn = Some(c.clone());
        Ok(c)
    }

    /// One sync of decoder `i`: renews the lease and sets the share the store grants.
    async fn sync(&self, i: usize) -> Result<(), redis::RedisError> {
        let m = &self.members[i];
        let crate::admission::Demand { in_use, want, head, head_age } = self.demand(m);
        let load = m.decoder.queue.load();
        let mut conn = self.connection().await?;
        let granted: Vec<u64> = self
            .script
            .key(self.key(&m.decoder.name, "replicas"))
            .key(self.key(&m.decoder.name, "leases"))
            .key(self.key(&m.decoder.name, "settling"))
            .key(self.key(&m.decoder.name, "last"))
            .arg(&self.cfg.replica)
            .arg(load.capacity)
            .arg(in_use)
            .arg(want)
            .arg(head)
            .arg(ms(head_age))
            .arg(ms(self.cfg.lease))
            .arg(load.share.unwrap_or(0))
            .arg(m.seq.fetch_add(1, Ordering::Relaxed) + 1)
            .invoke_async(&mut conn)
            .await?;
        let [share, replicas, settling] = granted[..] else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Parse,
                "the share script answered",
                format!("{granted:?}"),
            )));
        };
        m.replicas.store(u32::try_from(replicas).unwrap_or(u32::MAX), Ordering::Relaxed);
        m.settling.store(settling == 1, Ordering::Relaxed);
        m.synced.store(true, Ordering::Relaxed);
        m.decoder.queue.set_share(Some(u32::try_from(share).unwrap_or(u32::MAX)));
        Ok(())
    }

    fn since_epoch_ms(&self) -> u64 {
        ms(self.epoch.elapsed())
    }

    /// Records a sync's outcome; logs when the store goes down or comes back.
    async fn outcome(&self, r: Result<(), &redis::RedisError>) {
        match r {
            Ok(()) => {
                self.warned.store(false, Ordering::Relaxed);
                if !self.up.swap(true, Ordering::Relaxed) {
                    tracing::info!(store = %redacted(&self.cfg.store), "cluster: store reached");
                }
            }
            Err(e) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                self.down_at.store(self.since_epoch_ms().max(1), Ordering::Relaxed);
                // A connection that failed is made again next time (a script's own error leaves
                // it be: the connection is fine).
                if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
                {
                    *self.conn.lock().await = None;
                }
                let was_up = self.up.swap(false, Ordering::Relaxed);
                if was_up || !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        store = %redacted(&self.cfg.store),
                        error = %e,
                        "cluster: store unreachable; each decoder keeps the share this replica last held and never grows it, and tenants' budgets are checked against this replica's share"
                    );
                }
            }
        }
    }

    /// `GET /admin/cluster`.
    pub fn view(&self) -> Value {
        let shared: Vec<Value> = self
            .members
            .iter()
            .map(|m| {
                let l = m.decoder.queue.load();
                json!({
                    "decoder": m.decoder.name, "capacity": l.capacity, "share": l.share.unwrap_or(0),
                    "in_use": l.in_use, "waiting": l.waiting, "replicas": m.replicas.load(Ordering::Relaxed),
                    "settling": m.settling.load(Ordering::Relaxed), "synced": m.synced.load(Ordering::Relaxed),
                })
            })
            .collect();
        json!({
            "replica": self.cfg.replica, "store": redacted(&self.cfg.store), "store_up": self.store_up(),
            "lease_ms": ms(self.cfg.lease), "sync_ms": ms(self.cfg.sync),
            "shared": shared, "engine_truth": self.engine_truth,
            "flow": self.flow.get().map(|_| json!({
                "replicas": self.flow_replicas.load(Ordering::Relaxed),
                "budget_calls": {
                    "taken": self.budget_calls[0].load(Ordering::Relaxed),
                    "refused": self.budget_calls[1].load(Ordering::Relaxed),
                    "failed": self.budget_calls[2].load(Ordering::Relaxed),
                },
            })),
        })
    }

    /// `baton_cluster_*`.
    pub fn metrics(&self, out: &mut Scrape) {
        let flow = self.flow.get().is_some();
        if self.members.is_empty() && !flow {
            // Only decoders whose ranks are their own truth: the store is never called.
            return;
        }
        out.gauge(
            "baton_cluster_store_up",
            "Whether this replica's last call to the cluster store succeeded (0: shares frozen at the last granted).",
            &[],
            if self.store_up() { 1.0 } else { 0.0 },
        );
        out.counter(
            "baton_cluster_store_errors_total",
            "Calls to the cluster store that failed or timed out.",
            &[],
            self.errors.load(Ordering::Relaxed) as f64,
        );
        if flow {
            for (i, outcome) in ["taken", "refused", "failed"].into_iter().enumerate() {
                out.counter(
                    "baton_cluster_budget_calls_total",
                    "Calls to the store for a tenant's fleet-wide token budget, by outcome (failed: this replica's share was checked instead).",
                    &[("outcome", outcome)],
                    self.budget_calls[i].load(Ordering::Relaxed) as f64,
                );
            }
            out.gauge(
                "baton_cluster_flow_replicas",
                "Live replicas sharing flow control's budgets and counters, as the store last counted.",
                &[],
                f64::from(self.flow_replicas.load(Ordering::Relaxed)),
            );
        }
        for m in &self.members {
            let l = [("decoder", m.decoder.name.as_str())];
            out.gauge(
                "baton_cluster_share_slots",
                "Slots of the decoder this replica may hold, as the store last granted.",
                &l,
                f64::from(m.decoder.queue.load().share.unwrap_or(0)),
            );
            out.gauge(
                "baton_cluster_replicas",
                "Live replicas sharing the decoder, as the store last counted.",
                &l,
                f64::from(m.replicas.load(Ordering::Relaxed)),
            );
        }
    }
}

/// Keeps decoder `i`'s share: at once when a request starts waiting, else every sync interval;
/// ends when the cluster is dropped.
async fn sync_loop(cluster: Weak<Cluster>, i: usize) {
    let (demand, sync) = match cluster.upgrade() {
        Some(c) => (Arc::clone(&c.members[i].demand), c.cfg.sync),
        None => return,
    };
    loop {
        {
            let Some(c) = cluster.upgrade() else { return };
            if c.store_callable() {
                let _ = c.call(c.sync(i)).await;
            }
        }
        // However fast requests start waiting, one call per MIN_SYNC_GAP at most.
        tokio::time::sleep(MIN_SYNC_GAP.min(sync)).await;
        tokio::select! {
            _ = demand.notified() => {}
            _ = tokio::time::sleep(sync.saturating_sub(MIN_SYNC_GAP)) => {}
        }
    }
}

impl crate::flow::Fleet for Cluster {
    fn reserve<'a>(
        &'a self,
        tenant: &'a str,
        rule: crate::flow::BudgetRule,
        hold: f64,
        need: f64,
    ) -> crate::flow::Reserve<'a> {
        Box::pin(async move {
            // While the store is down only the sync task probes it: requests never wait on it.
            // Before any call has answered (a replica just started, its first sync still out)
            // the store is not known to be down: the request asks it, within the store's
            // timeout, rather than take this replica for the whole fleet.
            if self.store_known_down() {
                self.budget_calls[2].fetch_add(1, Ordering::Relaxed);
                return None;
            }
            match self.call(self.budget(tenant, rule, hold, need)).await {
                Ok(r) => {
                    self.budget_calls[usize::from(r.is_err())].fetch_add(1, Ordering::Relaxed);
                    Some(r)
                }
                Err(_) => {
                    self.budget_calls[2].fetch_add(1, Ordering::Relaxed);
                    None
                }
            }
        })
    }

    fn give_back(&self, tenant: &str, rule: crate::flow::BudgetRule, tokens: f64) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let Some(me) = self.me.get().and_then(Weak::upgrade) else { return };
        let tenant = tenant.to_owned();
        rt.spawn(async move {
            if me.store_callable() {
                let _ = me.call(me.budget(&tenant, rule, -tokens, 0.0)).await;
            }
        });
    }

    fn replicas(&self) -> u32 {
        self.flow_replicas.load(Ordering::Relaxed).max(1)
    }
}

/// How long the store keeps tenants' counters after the last replica's sync: a fleet idle this
/// long starts them afresh (VTC's counters only order tenants against each other).
const COUNTERS_KEPT: Duration = Duration::from_secs(3600);

/// An answer a script should not give.
fn script_answer(script: &str, answer: &[String]) -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Parse, "unexpected answer", format!("{script}: {answer:?}")))
}

/// Syncs flow control's counters every `sync` interval, until flow control or the cluster is gone.
async fn flow_loop(cluster: Weak<Cluster>, flow: Weak<crate::flow::FlowControl>) {
    loop {
        let sync = {
            let (Some(c), Some(f)) = (cluster.upgrade(), flow.upgrade()) else { return };
            if c.store_callable() {
                let _ = c.call(c.sync_flow(&f)).await;
            }
            c.cfg.sync
        };
        tokio::time::sleep(sync).await;
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The store's URL without its password (`redis://user:***@host`).
fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{path}"),
            None => format!("{scheme}://***@{host}{path}"),
        },
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use super::{Cluster, ClusterConfig};
    use crate::flow::{BudgetRule, Counts, Fleet};

    /// A replica just started, none of its calls answered yet, asks the store for a tenant's
    /// budget rather than take itself for the whole fleet (its first sync may still be out: it
    /// let a request through on a budget the store had spent, under CI's load); once a call
    /// failed, requests stop waiting on the store.
    #[tokio::test]
    async fn a_budget_asks_the_store_until_it_is_known_down() {
        // A store that takes connections and never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&accepted);
        let store = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                seen.fetch_add(1, Ordering::Relaxed);
                held.push(s);
            }
        });
        let cfg = ClusterConfig {
            store: format!("redis://{addr}"),
            replica: "r".into(),
            // The store's timeout: an eighth of it, 100 ms.
            lease: Duration::from_millis(800),
            sync: Duration::from_millis(50),
            key_prefix: "t".into(),
        };
        let c = Cluster::start(cfg, &[]).unwrap();
        assert!(!c.store_known_down());
        let rule = BudgetRule { tokens_per_minute: 600, counts: Counts::Input };
        let t = Instant::now();
        assert_eq!(c.reserve("a", rule, 150.0, 150.0).await, None);
        assert!(t.elapsed() >= Duration::from_millis(100), "{:?}", t.elapsed());
        assert_eq!(accepted.load(Ordering::Relaxed), 1, "the first request asked the store");
        assert!(c.store_known_down());
        let t = Instant::now();
        assert_eq!(c.reserve("a", rule, 150.0, 150.0).await, None);
        assert!(t.elapsed() < Duration::from_millis(100), "{:?}", t.elapsed());
        assert_eq!(accepted.load(Ordering::Relaxed), 1, "a store known down is not asked again");
        assert_eq!(c.budget_calls[2].load(Ordering::Relaxed), 2);
        store.abort();
    }

    #[test]
    fn a_store_password_is_never_shown() {
        for (url, shown) in [
            ("redis://:secret@h:6379/0", "redis://:***@h:6379/0"),
            ("redis://user:secret@h", "redis://user:***@h"),
            ("redis://h:6379", "redis://h:6379"),
            ("redis://secret@h/1", "redis://***@h/1"),
        ] {
            assert_eq!(super::redacted(url), shown);
        }
    }
}
