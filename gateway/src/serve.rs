//! `baton serve`: a checked configuration brought up: decoders connected (their buffer sizes read
//! from the data plane), every listener bound.

use std::net::SocketAddr;
use std::sync::Arc;

use std::time::Duration;

use crate::admission::QueueConfig;
use crate::config::Checked;
use crate::endpoints::{EngineClient, Names};
use crate::handoff::lmcache::Notifications;
use crate::handoff::{Prefiller, Shared, StartContext};
use crate::pipeline::{Access, Gateway, ModelInfo};
use crate::routing::Router;
use crate::server::{HttpTimeouts, Listeners, Surface};
use crate::telemetry::Metrics;

/// Why a gateway could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A decode pool could not be started.
    #[error(transparent)]
    Pool(#[from] crate::handoff::StartError),
    /// A listener could not be bound (or its TLS made).
    #[error("listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The LMCache notification listener could not be bound.
    #[error(transparent)]
    Lmcache(#[from] crate::handoff::lmcache::notify::BindError),
    /// A policy plugin could not be loaded.
    #[error("plugins: {0}")]
    Plugins(#[source] crate::policy::PluginStartError),
    /// The metrics registry refused a series.
    #[error("metrics: {0}")]
    Metrics(#[source] prometheus::Error),
    /// The trace exporter could not start.
    #[error("tracing: {0}")]
    Tracing(#[source] crate::telemetry::trace::TraceError),
    /// The `[cluster]` store's client could not be made.
    #[error(transparent)]
    Cluster(crate::cluster::ClusterError),
}

/// A serving gateway.
#[derive(Debug)]
pub struct Serving {
    pub addrs: Vec<SocketAddr>,
    /// The admin listener's address (`/metrics`, `/admin/*`).
    pub admin_addr: SocketAddr,
    pub gateway: Arc<Gateway>,
    /// The `lmcache` notification listener, when a pool uses the mode.
    pub lmcache: Option<Arc<Notifications>>,
    /// How long [`Serving::drain`] lets requests in flight run (`[shutdown] drain_timeout_ms`).
    pub drain_timeout: Duration,
    listeners: Listeners,
    /// Health checks and the file watchers (plugins, API keys): ended with the listeners.
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl Serving {
    /// Stops now: connections are cut.
    pub async fn shutdown(self) {
        self.background.iter().for_each(tokio::task::JoinHandle::abort);
        self.listeners.stop().await;
        flush_traces(&self.gateway).await;
    }

    /// Drains ([`Listeners::drain`] with [`Serving::drain_timeout`]), then ends the background tasks.
    pub async fn drain(self) {
        self.listeners.drain(&self.gateway, self.drain_timeout).await;
        self.background.iter().for_each(tokio::task::JoinHandle::abort);
        flush_traces(&self.gateway).await;
    }
}

/// Sends the spans still held and stops the exporter (off the runtime's threads: it waits for
/// the export, which runs on them).
pub async fn flush_traces(gateway: &Gateway) {
    if let Some(t) = gateway.tracing.clone() {
        let _ = tokio::task::spawn_blocking(move || t.shutdown()).await;
    }
}

/// Connects and binds everything the configuration names.
pub async fn start(c: Checked) -> Result<Serving, StartError> {
    let names = Names::new(c.resolver.clone());
    // Every name looked up before anything connects: one that has no address yet is said here, and
    // looked up again at every refresh (a health check fails meanwhile).
    for (field, name) in c.names() {
        match names.addrs(&name).await {
            Ok(ips) => tracing::info!(field, name, addrs = ?ips, "engine name resolved"),
            Err(e) => {
                tracing::warn!(field, name, error = %e.reason, "engine name has no address yet; looked up again every refresh")
            }
        }
    }
    let metrics = Metrics::new(c.tenant_series, c.records).map_err(StartError::Metrics)?;
    let client = EngineClient::new(names, c.engine_tls.clone(), c.limits.engine_idle);
    let tracing = match &c.trace {
        Some(t) => {
            let started =
                crate::telemetry::trace::Tracing::start(t, client.clone()).map_err(StartError::Tracing)?;
            tracing::info!(to = t.endpoint, ratio = t.sampling_ratio, "tracing requests (OTLP/HTTP)");
            Some(Arc::new(started))
        }
        None => None,
    };
    let shared = Shared::with_client(c.limits, c.health, client, Arc::new(metrics));
    let lmcache = match c.lmcache_listen {
        Some(addr) => {
            let hub = Notifications::bind(addr).await?;
            tracing::info!(at = %hub.addr, "listening for LMCache prefill notifications");
            Some(hub)
        }
        None => None,
    };
    let ctx = StartContext {
        shared: Arc::clone(&shared),
        queue: QueueConfig { max_queue: c.max_queue, ..QueueConfig::default() },
        lmcache: lmcache.clone(),
        first_token: c.first_token,
        tool_call_parser: c.tool_call_parser,
        dataplane_tls: c.dataplane_tls.clone(),
    };
    let mut decoders = Vec::new();
    for d in c.decoders {
        decoders.push(d.start(&ctx).await?);
    }
    let prefills: Vec<Prefiller> =
        c.prefills.into_iter().map(|(name, http)| Prefiller::new(name, http)).collect();
    for w in &c.warnings {
        tracing::warn!("{w}");
    }
    let mut router = Router::new(c.routing);
    if let Some(settings) = c.prefix {
        let engines = prefills.iter().map(|p| p.name.clone()).chain(decoders.iter().map(|d| d.name.clone()));
        router.prefix = Some(crate::prefix::feed::Feeds::start_with(engines.collect(), settings));
    }
    if !c.tokenizer.is_exact() {
        tracing::warn!(
            "model {} has no tokenizer configured: prompts are counted by the byte-level upper bound, which over-counts slots",
            c.model
        );
        // LMCache pools are refused this at check time; native pools are not, as baton-sim's
        // model is byte-level.
        if let Some(d) = decoders.iter().find(|d| d.mode() == crate::handoff::Mode::Native.name()) {
            tracing::warn!(
                decoder = %d.name,
                "handoff = \"native\" sends the engines the gateway's token ids, which without model.tokenizer are the \
                 prompt's byte values: right for baton-sim's byte-level model, another prompt for any other model's engine"
            );
        }
    }
    let model = ModelInfo { name: c.model, context_length: c.context_length, tokenizer: c.tokenizer };
    let tenants = crate::policy::TenantNames::new(c.tenants.clone());
    let plugins = match &c.plugins {
        Some(p) => Some(
            crate::policy::Plugins::start(p, tenants.clone(), c.source.clone().map(reread))
                .map_err(StartError::Plugins)?,
        ),
        None => None,
    };
    let mut background: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    background.extend(plugins.as_ref().map(crate::policy::Plugins::spawn_watcher));
    background.extend(c.keys.as_ref().map(crate::auth::ApiKeys::spawn_watcher));
    let access = Access {
        plugins,
        keys: c.keys,
        models_open: c.models_open,
        tenants,
        explain: c.explain,
        tracing,
        flow: c.flow,
        cluster: c
            .cluster
            .map(|cfg| crate::cluster::Cluster::start(cfg, &decoders))
            .transpose()
            .map_err(StartError::Cluster)?,
    };
    // The listeners' TLS as the configuration made it (its files were read and checked there).
    let tls = |t: Option<crate::config::FrontTlsConfig>| t.map(crate::server::tls::FrontTls::from);
    let public = c.listeners.into_iter().map(|(a, t)| (a, tls(t))).collect();
    let admin = (c.admin.addr, tls(c.admin.tls), Surface::Admin { token_sha256: c.admin.token_sha256 });
    let parts = Parts {
        model,
        prefills,
        decoders,
        shared,
        router,
        http: HttpTimeouts::default(),
        access,
        listeners: public,
        admin,
    };
    let (gateway, listeners, health) = assemble(parts).await?;
    background.push(health);
    tracing::info!(at = %listeners.admin_addr, "admin listener (/metrics, /admin/*)");
    Ok(Serving {
        addrs: listeners.addrs.clone(),
        admin_addr: listeners.admin_addr,
        gateway,
        lmcache,
        drain_timeout: c.drain_timeout,
        listeners,
        background,
    })
}

/// What a gateway is made of, started: `baton serve` gets it from the configuration, `baton demo`
/// from its simulated engines.
pub(crate) struct Parts {
    pub model: ModelInfo,
    pub prefills: Vec<Prefiller>,
    pub decoders: Vec<Arc<crate::handoff::Decoder>>,
    pub shared: Arc<Shared>,
    pub router: Router,
    pub http: HttpTimeouts,
    pub access: Access,
    /// Public listeners, each with its TLS.
    pub listeners: Vec<(SocketAddr, Option<crate::server::tls::FrontTls>)>,
    pub admin: (SocketAddr, Option<crate::server::tls::FrontTls>, Surface),
}

/// The gateway the parts make, serving: its health checks started (the task is returned), every
/// listener bound.
pub(crate) async fn assemble(
    p: Parts,
) -> Result<(Arc<Gateway>, Listeners, tokio::task::JoinHandle<()>), StartError> {
    let gateway = Gateway::new(p.model, p.prefills, p.decoders, p.shared, p.router, p.http, p.access);
    let health = gateway.start_health_checks();
    let listeners = Listeners::start(&gateway, p.listeners, p.admin)
        .await
        .map_err(|(addr, source)| StartError::Listen { addr, source })?;
    Ok((gateway, listeners, health))
}

/// Reads `file` again for a plugin reload: its plugins and tenants, checked.
fn reread(file: std::path::PathBuf) -> crate::policy::Reread {
    crate::policy::Reread(Box::new(move || {
        let c = crate::config::load(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        Ok((c.plugins, c.tenants))
    }))
}

/// The async runtime `baton` runs on, sized by the cores it may use: with one (a one-CPU
/// container, a process pinned to one core with `taskset`), tokio's current-thread scheduler;
/// otherwise its multi-thread one, a worker a core. On one core the multi-thread scheduler still
/// runs two threads that wake each other (the main thread in `block_on` and its one worker) and
/// pays for stealing work no other worker can take: in the proxy benchmark's layout B (all on one
/// core) it cost the gateway twice the involuntary context switches a request with `vllm-nixl`, a
/// third more with `sglang` (`bench/README.md`). The cores are `TOKIO_WORKER_THREADS` when it is
/// set (tokio's own variable; a positive whole number, anything else is refused here, on every
/// machine alike), otherwise [`std::thread::available_parallelism`] (the affinity mask and a
/// cgroup's CPU quota, rounded down). Blocking work (large prompts' tokenization, plugin reloads)
/// goes to tokio's blocking threads under either.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    // A value that is not UTF-8 is shown as it reads (it cannot be a number either way).
    let configured = std::env::var_os("TOKIO_WORKER_THREADS");
    runtime_for(configured.as_ref().map(|v| v.to_string_lossy()).as_deref())
}

/// [`runtime`] for `TOKIO_WORKER_THREADS` as `configured`.
fn runtime_for(configured: Option<&str>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = match runtime_cores(configured)? {
        1 => tokio::runtime::Builder::new_current_thread(),
        // Said here, so tokio does not read the variable again (it panics on what it cannot parse).
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    };
    builder.enable_all().build()
}

/// The cores [`runtime`] sizes itself by: `configured` (`TOKIO_WORKER_THREADS`) when set,
/// otherwise what this process may run on.
fn runtime_cores(configured: Option<&str>) -> std::io::Result<usize> {
    match configured {
        None => Ok(std::thread::available_parallelism().map_or(1, std::num::NonZero::get)),
        Some(v) => v.trim().parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("TOKIO_WORKER_THREADS is {v:?}: a positive whole number, or unset for every core"),
            )
        }),
    }
}

#[cfg(test)]
mod runtime_tests {
    use tokio::runtime::RuntimeFlavor;

    use super::{runtime_cores, runtime_for};

    #[test]
    fn the_cores_are_tokios_variable_when_set_else_the_machines() {
        let machine = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        assert_eq!(runtime_cores(Some("1")).unwrap(), 1);
        assert_eq!(runtime_cores(Some(" 3 ")).unwrap(), 3);
        assert_eq!(runtime_cores(None).unwrap(), machine);
        for bad in ["0", "many", "", "-1", "t\u{FFFD}o"] {
            let e = runtime_cores(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("TOKIO_WORKER_THREADS") && e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn one_core_is_the_current_thread_scheduler_and_more_the_multi_thread_one() {
        for (configured, flavor, workers) in
            [("1", RuntimeFlavor::CurrentThread, 1), ("3", RuntimeFlavor::MultiThread, 3)]
        {
            let rt = runtime_for(Some(configured)).unwrap();
            assert_eq!(rt.handle().runtime_flavor(), flavor, "{configured}");
            assert_eq!(rt.metrics().num_workers(), workers, "{configured}");
            // Spawned and blocking work both run on it.
            let got = rt.block_on(async {
                let spawned = tokio::spawn(async { 2 });
                let blocking = tokio::task::spawn_blocking(|| 3);
                spawned.await.unwrap() * blocking.await.unwrap()
            });
            assert_eq!(got, 6, "{configured}");
        }
        // What tokio's own builder would panic on is an error here, whatever the machine.
        assert!(runtime_for(Some("0")).is_err());
    }
}
