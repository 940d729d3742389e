//! `baton demo`: the gateway in front of simulated engines (1P1D by default) on loopback, with no
//! GPU, no download and no file to edit.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use baton_sim::DeviceKind;
use baton_sim::{Running, SimConfig, SimRole, launch, tiny_geometry};

use crate::admission::QueueConfig;
use crate::config::CheckedDecoder;
use crate::handoff::lmcache::Notifications;
use crate::handoff::scrape::LoadTarget;
use crate::handoff::{BoxFuture, Decoder, DemoDecoder, Limits, Mode, Prefiller, Shared, StartContext};
use crate::pipeline::{Access, Gateway, ModelInfo};
use crate::routing::{Builtin, HealthConfig, Router};
use crate::serve::StartError;
use crate::server::{HttpTimeouts, Listeners, Surface};
use crate::tokenize::Tokenizer;

/// The demo's listen address by default.
pub const DEFAULT_DEMO_LISTEN: &str = "127.0.0.1:8080";
/// Context length of the simulated model.
pub const DEMO_CONTEXT_LENGTH: u64 = 32_768;
/// `baton demo`'s PD buffer pages per decoder rank: at its 16-token chunks, 65,536 tokens, so one
/// prompt of the whole advertised context fits, and a few dozen chat-sized ones at once.
pub const DEMO_PAGES: u32 = 4096;
/// `baton demo`'s engine cache blocks (16 tokens each, 262,144 tokens): the decoder keeps a
/// request's blocks while it generates, after its PD-buffer pages are free again, so it needs more
/// than the buffer holds.
pub const DEMO_CACHE_BLOCKS: u32 = 16_384;

/// What to start.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    pub listen: SocketAddr,
    pub prefills: usize,
    pub decoders: usize,
    pub tp: u32,
    /// PD buffer pages per decoder rank.
    pub pages: u32,
    /// Engine cache blocks per rank (`baton_sim::DEFAULT_SIM_CACHE_BLOCKS` unless set).
    pub cache_blocks: u32,
    /// Tokens per chunk (page) of the simulated model.
    pub chunk_tokens: u32,
    /// The model's KV shape `[layers, kv_heads, head_dim, dtype_bytes]` (baton-sim's tiny model
    /// unless set).
    pub shape: Option<[u32; 4]>,
    pub token_delay: Duration,
    /// How the KV reaches the decoders.
    pub handoff: Mode,
    /// Where the simulated engines keep their caches and PD buffers (`cuda`: GPU 0).
    pub device: baton_sim::DeviceKind,
    /// Fault switches the simulated prefillers start with.
    pub prefill_faults: baton_sim::faults::FaultConfig,
    /// `lmcache` mode: prefillers answer before their chunks are written (LMCache's async backend).
    pub lmcache_async_send: bool,
    /// `vllm-nixl` mode: how long prefillers keep blocks nobody read (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`).
    pub nixl_abort_timeout: Duration,
    /// `sglang` mode: the engines' bootstrap settings.
    pub sglang: baton_sim::SglangSimConfig,
    /// The engines as prefix caches (each gets a copy; an `events` listen port of 0 binds an
    /// ephemeral one per engine), and the gateway subscribed to their KV events.
    pub prefix_cache: Option<baton_sim::cache::CacheConfig>,
    /// The gateway in front (its limits, tokenizer, routing).
    pub gateway: GatewaySetup,
    /// `native` mode: the decoders wait for a request's KV themselves, so the gateway sends the
    /// decode alongside the prefill (`false`: engines that cannot, the gateway waiting for every
    /// rank's READY first).
    pub decode_waits: bool,
}

/// How a gateway in front of engines is set up.
#[derive(Clone, Debug, Default)]
pub struct GatewaySetup {
    pub limits: Limits,
    pub tls: Option<crate::server::tls::FrontTls>,
    /// The fallback (byte-level) unless a real tokenizer is given.
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// The model's context in tokens ([`DEMO_CONTEXT_LENGTH`] unless set).
    pub context_length: Option<u64>,
    pub routing: Builtin,
    pub health: HealthConfig,
    pub http: HttpTimeouts,
    /// `lmcache` mode: the notification listener (bound before the prefillers start, which need its
    /// address) and whether to ask for the first token from prefill.
    pub lmcache: Option<Arc<Notifications>>,
    pub no_first_token: bool,
    /// `lmcache` mode: `[lmcache] tool_call_parser`.
    pub tool_call_parser: Option<crate::handoff::lmcache::tools::ToolParser>,
    /// `vllm-nixl` and `sglang` modes: the decoders' admission settings.
    pub nixl: LoadTarget,
    /// `native` mode: the gateway reserves the decoders' pages before the prefill (`reserve =
    /// "gateway"`) instead of the simulated prefillers with their writes (the demo's default).
    pub gateway_reserves: bool,
    /// `native` mode: the prompt's ids go to the engines as a JSON array (`token_ids = "json"`)
    /// instead of in base64 (the demo's default).
    pub json_token_ids: bool,
    /// The admin listener (`/metrics`, `/admin/*`): loopback on an ephemeral port unless set.
    pub admin_listen: Option<SocketAddr>,
    /// The admin listener's bearer token, as its SHA-256.
    pub admin_token_sha256: Option<[u8; 32]>,
    /// `[admission.tenants]`: bearer tokens' tenant names (the token metrics count by them).
    pub tenants: std::collections::BTreeMap<String, String>,
    /// `[telemetry] explain`: `x-baton-explain: 1` gets the request's decision record.
    pub explain: bool,
    /// `[telemetry] otlp_endpoint` and the rest: requests are traced.
    pub trace: Option<crate::telemetry::trace::TraceConfig>,
    /// `[routing.cache]`: the block index's settings (the policy's come with `routing`).
    pub cache: crate::config::cache::CacheRouting,
    /// `[flow]`: flow control in front of routing (off unless set).
    pub flow: Option<crate::flow::FlowConfig>,
    /// `[cluster]`: share the decoder with other replicas through a store (off unless set).
    pub cluster: Option<crate::cluster::ClusterConfig>,
}

/// A gateway serving: its public and admin listeners.
#[derive(Debug)]
pub struct GatewayRun {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub gateway: Arc<Gateway>,
    listeners: Listeners,
}

impl GatewayRun {
    /// Stops both listeners now.
    pub async fn stop(self) {
        self.listeners.stop().await;
        crate::serve::flush_traces(&self.gateway).await;
    }

    /// Drains the listeners ([`Listeners::drain`]), then sends the spans still held.
    pub async fn drain(self, timeout: Duration) {
        self.listeners.drain(&self.gateway, timeout).await;
        crate::serve::flush_traces(&self.gateway).await;
    }
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            prefills: 1,
            decoders: 1,
            tp: 1,
            pages: 64,
            cache_blocks: baton_sim::DEFAULT_SIM_CACHE_BLOCKS,
            chunk_tokens: 16,
            shape: None,
            token_delay: Duration::ZERO,
            handoff: Mode::default(),
            device: baton_sim::DeviceKind::Cpu,
            prefill_faults: Default::default(),
            lmcache_async_send: false,
            nixl_abort_timeout: baton_sim::nixl::DEFAULT_NIXL_ABORT_TIMEOUT,
            sglang: baton_sim::SglangSimConfig::default(),
            prefix_cache: None,
            gateway: GatewaySetup::default(),
            decode_waits: true,
        }
    }
}

/// A running demo.
#[derive(Debug)]
pub struct Demo {
    pub addr: SocketAddr,
    /// The admin listener: `/metrics`, `/admin/*`.
    pub admin: SocketAddr,
    pub gateway: Arc<Gateway>,
    /// The `lmcache` notification listener, in that mode.
    pub lmcache: Option<Arc<Notifications>>,
    pub engines: Vec<Running>,
    run: GatewayRun,
}

impl Demo {
    /// HTTP addresses of the decode engines.
    pub fn decode_addrs(&self) -> Vec<SocketAddr> {
        self.gateway.decoders.iter().filter_map(|d| d.http.socket_addr()).collect()
    }

    /// Drains the gateway ([`Listeners::drain`]), then stops the engines.
    pub async fn drain(self, timeout: Duration) {
        self.run.drain(timeout).await;
        for e in self.engines {
            e.shutdown().await;
        }
    }

    pub async fn shutdown(self) {
        self.run.stop().await;
        for e in self.engines {
            e.shutdown().await;
        }
    }
}

/// Why a demo could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// The simulated model's KV geometry is not valid (its shape, chunk or TP).
    #[error("geometry: {0}")]
    Geometry(#[from] baton_dataplane::geometry::GeometryError),
    /// A simulated engine could not start.
    #[error("engine: {0}")]
    Engine(#[from] baton_sim::SimError),
    /// The gateway in front could not start.
    #[error(transparent)]
    Gateway(#[from] StartError),
}

/// The engines of a demo, without a gateway.
#[derive(Debug)]
pub struct Engines {
    pub prefills: Vec<Prefiller>,
    /// `(name, HTTP address, the engine's stats)` per decoder.
    pub decoders: Vec<(String, SocketAddr, serde_json::Value)>,
    /// The model's KV geometry, as every engine has it.
    pub geometry: baton_dataplane::KvGeometry,
    /// The mode the engines play.
    pub mode: Mode,
    pub running: Vec<Running>,
    /// Each engine's KV-event publisher and replay socket (prefills first, then decoders), when
    /// it publishes; and the engines' block size.
    pub kv_events: Vec<Option<(SocketAddr, Option<SocketAddr>)>>,
    pub block_size: u32,
}

/// Starts the simulated engines.
pub async fn start_engines(c: &DemoConfig) -> Result<Engines, DemoError> {
    start_engines_with(c, None).await
}

/// [`start_engines`]; `notify`: where LMCache prefillers send notifications (the gateway's
/// listener), for a mode that has them.
pub async fn start_engines_with(c: &DemoConfig, notify: Option<SocketAddr>) -> Result<Engines, DemoError> {
    let tiny = tiny_geometry(c.tp)?;
    let [layers, kv_heads, head_dim, dtype_bytes] =
        c.shape.unwrap_or([tiny.layers, tiny.kv_heads, tiny.head_dim, tiny.dtype_bytes]);
    let geometry =
        baton_dataplane::KvGeometry::new(layers, kv_heads, head_dim, dtype_bytes, c.chunk_tokens, c.tp)?;
    let engine = |role: SimRole| {
        let mut sc = SimConfig::new(role, geometry);
        sc.cache_blocks = c.cache_blocks;
        sc.device = c.device;
        sc.token_delay = c.token_delay;
        sc.prefix_cache = c.prefix_cache.clone().map(|mut p| {
            p.block_size = sc.block_size;
            p
        });
        if role == SimRole::Decode {
            sc.pages = c.pages;
            sc.decode_waits = c.decode_waits;
        } else {
            sc.faults = c.prefill_faults.clone();
        }
        c.handoff.sim(crate::handoff::SimSetup {
            engine: &mut sc,
            notify,
            pages: c.pages,
            lmcache_async_send: c.lmcache_async_send,
            nixl_abort_timeout: c.nixl_abort_timeout,
            sglang: &c.sglang,
        });
        sc
    };
    let mut running = Vec::new();
    let mut prefills = Vec::new();
    for i in 0..c.prefills {
        let r = launch(engine(SimRole::Prefill)).await?;
        prefills.push(Prefiller::new(format!("prefill-{i}"), r.addr));
        running.push(r);
    }
    let mut decoders = Vec::new();
    for i in 0..c.decoders {
        let r = launch(engine(SimRole::Decode)).await?;
        decoders.push((format!("decode-{i}"), r.addr, r.engine.stats()));
        running.push(r);
    }
    let kv_events = running.iter().map(|r| r.engine.cache.as_ref().and_then(|c| c.published_at)).collect();
    let block_size = baton_sim::DEFAULT_SIM_BLOCK_SIZE;
    Ok(Engines { prefills, decoders, geometry, mode: c.handoff, running, kv_events, block_size })
}

/// How a checked decoder is started: [`CheckedDecoder::start`], or a test's own.
pub type StartDecoder = for<'a> fn(
    CheckedDecoder,
    &'a StartContext,
) -> BoxFuture<'a, Result<Arc<Decoder>, crate::handoff::StartError>>;

fn start_decoder(
    d: CheckedDecoder,
    ctx: &StartContext,
) -> BoxFuture<'_, Result<Arc<Decoder>, crate::handoff::StartError>> {
    Box::pin(d.start(ctx))
}

/// A gateway in front of `engines`, serving on `listen` (over TLS when `setup.tls` is given). Its
/// health checks run until the gateway is dropped.
pub async fn start_gateway(
    e: &Engines,
    listen: SocketAddr,
    setup: GatewaySetup,
) -> Result<GatewayRun, DemoError> {
    start_gateway_with(e, listen, setup, start_decoder).await
}

/// [`start_gateway`], each decoder started by `start`: the same checked pools, as the
/// configuration would give them, through the same start as `baton serve`'s unless a test swaps it.
pub async fn start_gateway_with(
    e: &Engines,
    listen: SocketAddr,
    setup: GatewaySetup,
    start: StartDecoder,
) -> Result<GatewayRun, DemoError> {
    let shared = Shared::new(setup.limits, setup.health).map_err(StartError::Metrics)?;
    let tracing = match &setup.trace {
        Some(t) => Some(Arc::new(
            crate::telemetry::trace::Tracing::start(t, shared.client.clone()).map_err(StartError::Tracing)?,
        )),
        None => None,
    };
    let ctx = StartContext {
        shared: Arc::clone(&shared),
        queue: QueueConfig::default(),
        lmcache: setup.lmcache.clone(),
        first_token: !setup.no_first_token,
        tool_call_parser: setup.tool_call_parser,
        dataplane_tls: None,
    };
    let mut decoders = Vec::new();
    for (name, http, stats) in &e.decoders {
        let d = DemoDecoder {
            stats,
            geometry: e.geometry,
            load: &setup.nixl,
            gateway_reserves: setup.gateway_reserves,
            json_token_ids: setup.json_token_ids,
        };
        let checked = CheckedDecoder { name: name.clone(), http: (*http).into(), mode: e.mode.demo(&d) };
        decoders.push(start(checked, &ctx).await.map_err(StartError::from)?);
    }
    let tokenizer = setup.tokenizer.unwrap_or_else(|| Arc::new(Tokenizer::fallback()));
    let context_length = setup.context_length.unwrap_or(DEMO_CONTEXT_LENGTH);
    let model = ModelInfo { name: "baton-sim".into(), context_length, tokenizer };
    // Each gateway keeps its own view of the prefillers' health.
    let prefills: Vec<Prefiller> =
        e.prefills.iter().map(|p| Prefiller::new(p.name.clone(), p.http.clone())).collect();
    let mut router = Router::new(setup.routing);
    let feeds: Vec<crate::prefix::feed::FeedConfig> = (e.kv_events.iter().enumerate())
        .filter_map(|(engine, ev)| {
            ev.map(|(at, replay)| crate::prefix::feed::FeedConfig {
                engine,
                rank: 0,
                endpoint: at.to_string(),
                replay: replay.map(|r| r.to_string()),
                topic: String::new(),
            })
        })
        .collect();
    if matches!(setup.routing, Builtin::CacheAware(_)) || !feeds.is_empty() {
        // Engines that publish no KV events are matched by what was routed to them.
        let c = &setup.cache;
        let settings = crate::config::cache::PrefixSettings {
            block_size: e.block_size,
            routed_ttl: Duration::from_millis(c.routed_ttl_ms),
            max_blocks: c.max_blocks,
            silent_after: Duration::from_millis(c.silent_after_ms.max(1)),
            skip_prefill_within: c.skip_within(),
            feeds,
        };
        let engines = prefills.iter().map(|p| p.name.clone()).chain(decoders.iter().map(|d| d.name.clone()));
        router.prefix = Some(crate::prefix::feed::Feeds::start_with(engines.collect(), settings));
    }
    let access = Access {
        plugins: None,
        keys: None,
        models_open: false,
        tenants: crate::policy::TenantNames::new(setup.tenants.clone()),
        explain: setup.explain,
        tracing,
        flow: setup.flow.clone(),
        cluster: setup
            .cluster
            .clone()
            .map(|cfg| crate::cluster::Cluster::start(cfg, &decoders))
            .transpose()
            .map_err(StartError::Cluster)?,
    };
    let admin_listen = setup.admin_listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let admin = (admin_listen, None, Surface::Admin { token_sha256: setup.admin_token_sha256 });
    let parts = crate::serve::Parts {
        model,
        prefills,
        decoders,
        shared,
        router,
        http: setup.http,
        access,
        listeners: vec![(listen, setup.tls)],
        admin,
    };
    let (gateway, listeners, _health) = crate::serve::assemble(parts).await?;
    // One address was given, and `Listeners` binds every one it is given or fails.
    let addr = listeners.addrs.first().copied().unwrap_or(listen);
    Ok(GatewayRun { addr, admin: listeners.admin_addr, gateway, listeners })
}

/// Starts the engines and the gateway.
pub async fn start(c: DemoConfig) -> Result<Demo, DemoError> {
    start_with(c, start_decoder).await
}

/// [`start`], each decoder started by `start` ([`start_gateway_with`]).
pub async fn start_with(mut c: DemoConfig, start: StartDecoder) -> Result<Demo, DemoError> {
    if c.handoff.notifications() && c.gateway.lmcache.is_none() {
        c.gateway.lmcache =
            Some(Notifications::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await.map_err(StartError::from)?);
    }
    let notify = c.gateway.lmcache.as_ref().map(|h| h.addr);
    let engines = start_engines_with(&c, notify).await?;
    let lmcache = c.gateway.lmcache.clone();
    let run = start_gateway_with(&engines, c.listen, c.gateway, start).await?;
    Ok(Demo {
        addr: run.addr,
        admin: run.admin,
        gateway: Arc::clone(&run.gateway),
        lmcache,
        engines: engines.running,
        run,
    })
}
