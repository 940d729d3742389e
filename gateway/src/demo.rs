//! `baton demo`: the gateway in front of simulated engines (1P1D by default) on loopback, with no
//! GPU, no download and no file to edit.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use baton_sim::DeviceKind;
use baton_sim::{LmcacheSimConfig, Running, SimConfig, SimRole, launch, tiny_geometry};

use crate::admission::{QueueConfig, SlotQueue};
use crate::handoff::decoder::Decoder;
use crate::handoff::lmcache::{Lmcache, LmcacheTarget, Notifications};
use crate::handoff::native::{Native, RankLinks};
use crate::handoff::nixl::Nixl;
use crate::handoff::scrape::LoadTarget;
use crate::handoff::sglang::Sglang;
use crate::handoff::{Handoff, Limits, Prefiller, Shared};
use crate::pipeline::{Access, Gateway, ModelInfo};
use crate::routing::{Builtin, HealthConfig, Router};
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
    pub handoff: DemoHandoff,
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
    /// The gateway in front (its limits, tokenizer, routing).
    pub gateway: GatewaySetup,
}

/// The handoff the demo's engines and gateway use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DemoHandoff {
    /// baton's data plane.
    #[default]
    Native,
    /// LMCache's PD backend (ZMQ side channels, msgpack notifications).
    Lmcache,
    /// vLLM's NIXL connector (the decoder pulls; admission from the decoder's metrics).
    VllmNixl,
    /// SGLang's PD mode (both legs at once, paired by a bootstrap room; the decoder pulls).
    Sglang,
}

impl DemoHandoff {
    pub const ALL: [Self; 4] = [Self::Native, Self::Lmcache, Self::VllmNixl, Self::Sglang];
    pub const NAMES: [&'static str; 4] = [
        crate::handoff::native::MODE,
        crate::handoff::lmcache::MODE,
        crate::handoff::nixl::MODE,
        crate::handoff::sglang::MODE,
    ];

    /// The mode's name, as in a configuration's `handoff`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Native => crate::handoff::native::MODE,
            Self::Lmcache => crate::handoff::lmcache::MODE,
            Self::VllmNixl => crate::handoff::nixl::MODE,
            Self::Sglang => crate::handoff::sglang::MODE,
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// How a gateway in front of engines is set up.
#[derive(Clone, Debug, Default)]
pub struct GatewaySetup {
    pub limits: Limits,
    pub tls: Option<crate::server::tls::FrontTls>,
    /// The fallback (byte-level) unless a real tokenizer is given.
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub routing: Builtin,
    pub health: HealthConfig,
    /// TEST ONLY: admission off and pages taken chunk by chunk ([`Native::unprotected`]).
    pub unprotected: bool,
    pub http: HttpTimeouts,
    /// `lmcache` mode: the notification listener (bound before the prefillers start, which need its
    /// address) and whether to ask for the first token from prefill.
    pub lmcache: Option<Arc<Notifications>>,
    pub no_first_token: bool,
    /// `vllm-nixl` and `sglang` modes: the decoders' admission settings.
    pub nixl: LoadTarget,
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
            handoff: DemoHandoff::Native,
            device: baton_sim::DeviceKind::Cpu,
            prefill_faults: Default::default(),
            lmcache_async_send: false,
            nixl_abort_timeout: baton_sim::nixl::DEFAULT_NIXL_ABORT_TIMEOUT,
            sglang: baton_sim::SglangSimConfig::default(),
            gateway: GatewaySetup::default(),
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

fn parse_addr(v: &serde_json::Value) -> Option<SocketAddr> {
    v.as_str()?.parse().ok()
}

/// The engines of a demo, without a gateway.
#[derive(Debug)]
pub struct Engines {
    pub prefills: Vec<Prefiller>,
    /// `(name, HTTP address, rank data-plane addresses)` per decoder.
    pub decoders: Vec<(String, SocketAddr, Vec<SocketAddr>)>,
    pub fingerprint: u64,
    pub chunk_tokens: u32,
    /// `lmcache` mode: each decoder's PD backend ports and capacity in chunks (parallel to
    /// `decoders`; empty in native mode).
    pub lmcache: Vec<(LmcacheTarget, u32)>,
    /// The engines play vLLM's NIXL connector.
    pub nixl: bool,
    /// The engines play SGLang's PD mode.
    pub sglang: bool,
    pub running: Vec<Running>,
}

/// Starts the simulated engines; `lmcache_proxy` is where LMCache prefillers send notifications.
pub async fn start_engines(c: &DemoConfig) -> Result<Engines, String> {
    start_engines_with(c, None).await
}

/// [`start_engines`], with the LMCache notification address for `lmcache` mode.
pub async fn start_engines_with(
    c: &DemoConfig,
    lmcache_proxy: Option<SocketAddr>,
) -> Result<Engines, String> {
    let tiny = tiny_geometry(c.tp).map_err(|e| e.to_string())?;
    let [layers, kv_heads, head_dim, dtype_bytes] =
        c.shape.unwrap_or([tiny.layers, tiny.kv_heads, tiny.head_dim, tiny.dtype_bytes]);
    let geometry =
        baton_dataplane::KvGeometry::new(layers, kv_heads, head_dim, dtype_bytes, c.chunk_tokens, c.tp)
            .map_err(|e| e.to_string())?;
    let mut running = Vec::new();
    let mut prefills = Vec::new();
    for i in 0..c.prefills {
        let mut sc = SimConfig::new(SimRole::Prefill, geometry);
        sc.cache_blocks = c.cache_blocks;
        sc.device = c.device;
        sc.token_delay = c.token_delay;
        sc.faults = c.prefill_faults.clone();
        if c.handoff == DemoHandoff::VllmNixl {
            sc.nixl = Some(c.nixl_abort_timeout);
        }
        if c.handoff == DemoHandoff::Sglang {
            sc.sglang = Some(c.sglang.clone());
        }
        if c.handoff == DemoHandoff::Lmcache {
            sc.lmcache = Some(LmcacheSimConfig {
                proxy: lmcache_proxy,
                async_send: c.lmcache_async_send,
                ..LmcacheSimConfig::default()
            });
        }
        let r = launch(sc).await.map_err(|e| e.to_string())?;
        prefills.push(Prefiller::new(format!("prefill-{i}"), r.addr));
        running.push(r);
    }
    let mut decoders = Vec::new();
    let mut lmcache = Vec::new();
    for i in 0..c.decoders {
        let mut sc = SimConfig::new(SimRole::Decode, geometry);
        sc.cache_blocks = c.cache_blocks;
        sc.pages = c.pages;
        sc.device = c.device;
        sc.token_delay = c.token_delay;
        if c.handoff == DemoHandoff::VllmNixl {
            sc.nixl = Some(c.nixl_abort_timeout);
        }
        if c.handoff == DemoHandoff::Sglang {
            sc.sglang = Some(c.sglang.clone());
        }
        if c.handoff == DemoHandoff::Lmcache {
            sc.lmcache = Some(LmcacheSimConfig {
                pd_buffer_bytes: u64::from(c.pages) * geometry.page_bytes_per_rank(),
                ..LmcacheSimConfig::default()
            });
        }
        let r = launch(sc).await.map_err(|e| e.to_string())?;
        let stats = r.engine.stats();
        if c.handoff == DemoHandoff::Lmcache {
            let ranks = stats["lmcache"]["ranks"].as_array().cloned().unwrap_or_default();
            let port = |v: &serde_json::Value| parse_addr(v).map(|a| a.port());
            lmcache.push((
                LmcacheTarget {
                    receiver_host: "127.0.0.1".into(),
                    init_ports: ranks.iter().filter_map(|r| port(&r["init_addr"])).collect(),
                    alloc_ports: ranks.iter().filter_map(|r| port(&r["alloc_addr"])).collect(),
                },
                ranks
                    .iter()
                    .filter_map(|r| r["capacity_chunks"].as_u64())
                    .min()
                    .map_or(0, |c| u32::try_from(c).unwrap_or(u32::MAX)),
            ));
        }
        let ranks: Vec<SocketAddr> = stats["ranks"]
            .as_array()
            .map(|a| a.iter().filter_map(|r| parse_addr(&r["addr"])).collect())
            .unwrap_or_default();
        decoders.push((format!("decode-{i}"), r.addr, ranks));
        running.push(r);
    }
    Ok(Engines {
        prefills,
        decoders,
        fingerprint: geometry.fingerprint(),
        chunk_tokens: geometry.chunk_tokens,
        lmcache,
        nixl: c.handoff == DemoHandoff::VllmNixl,
        sglang: c.handoff == DemoHandoff::Sglang,
        running,
    })
}

/// A gateway in front of `engines`, serving on `listen` (over TLS when `setup.tls` is given). Its
/// health checks run until the gateway is dropped.
pub async fn start_gateway(
    e: &Engines,
    listen: SocketAddr,
    setup: GatewaySetup,
) -> Result<GatewayRun, String> {
    let shared = Shared::new(setup.limits, setup.health).map_err(|e| format!("metrics: {e}"))?;
    let tracing = match &setup.trace {
        Some(t) => Some(Arc::new(
            crate::telemetry::trace::Tracing::start(t, shared.client.clone()).map_err(|e| e.to_string())?,
        )),
        None => None,
    };
    let mut decoders = Vec::new();
    for (i, (name, http, ranks)) in e.decoders.iter().enumerate() {
        let queue = SlotQueue::new(0, QueueConfig::default());
        let handoff: Box<dyn Handoff> = if e.sglang {
            // The bootstrap port is read from each prefill engine's /get_server_info.
            Box::new(Sglang::new(Arc::clone(&shared), (*http).into(), setup.nixl.clone(), None, &queue))
        } else if e.nixl {
            Box::new(Nixl::new(Arc::clone(&shared), (*http).into(), setup.nixl.clone(), &queue))
        } else if let Some((target, capacity)) = e.lmcache.get(i) {
            let hub =
                setup.lmcache.clone().ok_or("lmcache engines need the gateway's notification listener")?;
            queue.resize(*capacity);
            Box::new(Lmcache::new(
                Arc::clone(&shared),
                hub,
                target.clone(),
                e.chunk_tokens,
                !setup.no_first_token,
            ))
        } else {
            let mut n = Native::connect(
                Arc::clone(&shared),
                name.clone(),
                RankLinks::plain(ranks.clone(), e.fingerprint),
                e.chunk_tokens,
                None,
                queue.clone(),
            )
            .await
            .map_err(|err| format!("{name}: {err}"))?;
            n.unprotected = setup.unprotected;
            Box::new(n)
        };
        decoders.push(Arc::new(Decoder::new(name.clone(), (*http).into(), queue, handoff)));
    }
    let tokenizer = setup.tokenizer.unwrap_or_else(|| Arc::new(Tokenizer::fallback()));
    let model = ModelInfo { name: "baton-sim".into(), context_length: DEMO_CONTEXT_LENGTH, tokenizer };
    // Each gateway keeps its own view of the prefillers' health.
    let prefills = e.prefills.iter().map(|p| Prefiller::new(p.name.clone(), p.http.clone())).collect();
    let gateway = Gateway::new(
        model,
        prefills,
        decoders,
        shared,
        Router::new(setup.routing),
        setup.http,
        Access {
            plugins: None,
            keys: None,
            tenants: crate::policy::TenantNames::new(setup.tenants.clone()),
            explain: setup.explain,
            tracing,
        },
    );
    let _health = gateway.start_health_checks();
    let admin_listen = setup.admin_listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let admin = (admin_listen, None, Surface::Admin { token_sha256: setup.admin_token_sha256 });
    let listeners = Listeners::start(&gateway, vec![(listen, setup.tls)], admin)
        .await
        .map_err(|(at, err)| format!("listen on {at}: {err}"))?;
    let addr = listeners.addrs.first().copied().ok_or("no listener")?;
    Ok(GatewayRun { addr, admin: listeners.admin_addr, gateway, listeners })
}

/// Starts the engines and the gateway.
pub async fn start(mut c: DemoConfig) -> Result<Demo, String> {
    let mut proxy = None;
    if c.handoff == DemoHandoff::Lmcache && c.gateway.lmcache.is_none() {
        let hub = Notifications::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        proxy = Some(hub.addr);
        c.gateway.lmcache = Some(hub);
    } else if let Some(h) = &c.gateway.lmcache {
        proxy = Some(h.addr);
    }
    let engines = start_engines_with(&c, proxy).await?;
    let lmcache = c.gateway.lmcache.clone();
    let run = start_gateway(&engines, c.listen, c.gateway).await?;
    Ok(Demo {
        addr: run.addr,
        admin: run.admin,
        gateway: Arc::clone(&run.gateway),
        lmcache,
        engines: engines.running,
        run,
    })
}
