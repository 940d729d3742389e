//! A simulated engine that embeds the real data plane and speaks an OpenAI-compatible HTTP API, so
//! the gateway can be built and tested without GPUs. It is also the reference integration for engine
//! authors: `prefill.rs` and `decode.rs` are the code an engine writes to adopt baton.
//!
//! - prefill role: derives KV bytes from (token ids, layer, rank), gathers them into chunks through
//!   the device trait and writes them to the decoder ranks named in the request;
//! - decode role: a data-plane decoder (ranks as tasks, each with its own buffer and server) that
//!   verifies every byte before producing deterministic tokens;
//! - fault switches (crash a rank, drop a readiness event, stall a chunk, slow a rank).
//!
//! Run it with the `baton-sim` binary; the gateway starts it for `baton demo` (its `demo` feature).

pub mod api;
pub mod blocks;
pub mod cache;
pub mod decode;
pub mod faults;
pub mod http;
pub mod kv;
pub mod lmcache;
pub mod nixl;
pub mod prefill;
pub mod sglang;

pub use baton_dataplane::device::any::DeviceKind;

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Notify;

use baton_dataplane::buffer::DEFAULT_QUARANTINE_TTL;
use baton_dataplane::geometry::KvGeometry;
use decode::DecodeEngine;
use faults::{FaultConfig, Faults};
use http::{LmcacheRole, NixlRole, Protocols, Role, SimEngine};
use prefill::{DEFAULT_PRODUCER_HOLD_TTL, PrefillEngine};

/// Which side of a PD pair the engine plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimRole {
    Prefill,
    Decode,
}

/// Decode buffer pages when not given: room for a few concurrent mid-size prompts.
pub const DEFAULT_SIM_PAGES: u32 = 64;
/// Engine cache blocks per rank when not given.
pub const DEFAULT_SIM_CACHE_BLOCKS: u32 = 4096;
/// Tokens per engine cache block (vLLM's default).
pub const DEFAULT_SIM_BLOCK_SIZE: u32 = 16;

/// The simulator's small default model: 2 layers, 2 KV heads of 16 bf16 values, 16-token chunks.
pub fn tiny_geometry(tp_size: u32) -> Result<KvGeometry, baton_dataplane::geometry::GeometryError> {
    KvGeometry::new(2, 2, 16, 2, 16, tp_size)
}

/// A mutex's guard, also after a panic elsewhere poisoned it (the state stays consistent: every
/// critical section here is a few assignments).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Background tasks of a protocol side, aborted with it.
#[derive(Debug, Default)]
pub(crate) struct Tasks(pub(crate) Vec<tokio::task::JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Accepts connections on `listener` until the calling task ends, serving each on its own task
/// (the side channels of the LMCache and NIXL protocols).
pub(crate) async fn serve_each<F, Fut>(listener: TcpListener, serve: F)
where
    F: Fn(tokio::net::TcpStream) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                conns.spawn(serve(stream));
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Everything a simulated engine needs to start.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub role: SimRole,
    pub listen: SocketAddr,
    pub model: String,
    pub geometry: KvGeometry,
    /// Decode: PD buffer pages per rank.
    pub pages: u32,
    pub cache_blocks: u32,
    pub block_size: u32,
    pub token_delay: Duration,
    /// Where decode ranks' data-plane servers listen.
    pub dp_host: IpAddr,
    /// Rank `r` listens on `dp_base_port + r`; ephemeral ports when `None`.
    pub dp_base_port: Option<u16>,
    pub quarantine_ttl: Duration,
    pub hold_ttl: Duration,
    pub faults: FaultConfig,
    /// Also play LMCache's PD backend (decode: receiver; prefill: sender).
    pub lmcache: Option<LmcacheSimConfig>,
    /// Also play vLLM's NIXL connector (prefill: producer with this abort timeout; decode: consumer).
    pub nixl: Option<Duration>,
    /// Where the engine's cache and PD buffer live (`cuda`: GPU 0).
    pub device: DeviceKind,
    /// Also play SGLang's PD mode (prefill: bootstrap server and rooms; decode: pulls its room).
    pub sglang: Option<SglangSimConfig>,
    /// mTLS on baton's data plane: decode ranks serve it and require client certificates from the
    /// CA; a prefiller connects to them with it.
    pub dp_tls: Option<DpTls>,
    /// The engine as a prefix cache (prefill time by uncached tokens, `cached_tokens` in usage,
    /// KV events); `None`: every prompt computed in no time, as before.
    pub prefix_cache: Option<cache::CacheConfig>,
    /// Decode: the ranks say in their Welcome that a decode request with `kv_wait_ms` waits here
    /// for its KV, so the gateway sends it alongside the prefill (`false`: the gateway waits for
    /// every rank's READY first, as with an engine that cannot wait).
    pub decode_waits: bool,
}

/// An engine's data-plane identity: one certificate and key, used to serve its ranks (peers must
/// present a certificate from `ca`) and to connect to other ranks (whose name is checked).
#[derive(Clone, Debug)]
pub struct DpTls {
    pub server: baton_dataplane::transport::TlsServer,
    pub client: baton_dataplane::transport::TlsClient,
}

impl DpTls {
    /// From PEM files: the CA, this engine's certificate and key, and the name ranks present.
    pub fn from_pem_files(
        ca: &std::path::Path,
        cert: &std::path::Path,
        key: &std::path::Path,
        server_name: &str,
    ) -> Result<Self, baton_dataplane::transport::TlsError> {
        Ok(Self {
            server: baton_dataplane::transport::TlsServer::from_pem_files(cert, key, Some(ca))?,
            client: baton_dataplane::transport::TlsClient::from_pem_files(
                ca,
                server_name,
                Some((cert, key)),
            )?,
        })
    }
}

/// The SGLang PD settings of a simulated engine.
#[derive(Clone, Debug)]
pub struct SglangSimConfig {
    /// Prefill: the bootstrap server's port (`--disaggregation-bootstrap-port`); ephemeral when `None`.
    pub bootstrap_port: Option<u16>,
    /// How long a decoder waits for its room, and a prefill keeps a room nobody asked for.
    pub room_wait: Duration,
    /// Prefill: how long after its room is held it answers (zero: at once). A real SGLang prefill
    /// answers once its KV has gone to the decoder, which for a short answer may be after the
    /// decoder's whole answer; tests set this to make that order certain.
    pub answer_delay: Duration,
}

impl Default for SglangSimConfig {
    fn default() -> Self {
        Self { bootstrap_port: None, room_wait: sglang::DEFAULT_ROOM_WAIT, answer_delay: Duration::ZERO }
    }
}

/// The LMCache PD backend settings of a simulated engine (the `pd_*` keys of LMCache's YAML).
#[derive(Clone, Debug, Default)]
pub struct LmcacheSimConfig {
    /// Decode: PD buffer bytes per rank (`pd_buffer_size`).
    pub pd_buffer_bytes: u64,
    /// Decode: each rank's alloc and init ports (`pd_peer_alloc_port`, `pd_peer_init_port`); empty:
    /// ephemeral.
    pub alloc_ports: Vec<u16>,
    pub init_ports: Vec<u16>,
    /// Prefill: where to PUSH notifications (`pd_proxy_host:pd_proxy_port`).
    pub proxy: Option<SocketAddr>,
    /// Prefill: answer before the chunks are written (LMCache's asynchronous PD backend).
    pub async_send: bool,
}

impl SimConfig {
    pub fn new(role: SimRole, geometry: KvGeometry) -> Self {
        Self {
            role,
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            model: "baton-sim".into(),
            geometry,
            pages: DEFAULT_SIM_PAGES,
            cache_blocks: DEFAULT_SIM_CACHE_BLOCKS,
            block_size: DEFAULT_SIM_BLOCK_SIZE,
            token_delay: Duration::ZERO,
            dp_host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            dp_base_port: None,
            quarantine_ttl: DEFAULT_QUARANTINE_TTL,
            hold_ttl: DEFAULT_PRODUCER_HOLD_TTL,
            faults: FaultConfig::default(),
            lmcache: None,
            nixl: None,
            device: DeviceKind::Cpu,
            sglang: None,
            dp_tls: None,
            prefix_cache: None,
            decode_waits: true,
        }
    }
}

/// A running simulated engine.
#[derive(Debug)]
pub struct Running {
    /// The HTTP address.
    pub addr: SocketAddr,
    pub engine: Arc<SimEngine>,
    stop: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops serving HTTP and waits for open connections to close.
    pub async fn shutdown(self) {
        self.stop.notify_one();
        let _ = self.task.await;
    }
}

/// Starts a simulated engine.
pub async fn launch(c: SimConfig) -> Result<Running, SimError> {
    let faults = Arc::new(Faults::default());
    faults.set(c.faults.clone());
    let device = c.device.open().map_err(|e| SimError::internal(format!("device {:?}: {e}", c.device)))?;
    let role = match c.role {
        SimRole::Prefill => Role::Prefill(PrefillEngine::new(
            &device,
            c.geometry,
            c.cache_blocks,
            c.block_size,
            Arc::clone(&faults),
            c.hold_ttl,
            c.dp_tls.as_ref().map(|t| t.client.clone()),
        )?),
        SimRole::Decode => {
            let d = DecodeEngine::start(&c, &device, Arc::clone(&faults)).await?;
            d.apply_faults().await;
            Role::Decode(d)
        }
    };
    let lmcache = match (&c.lmcache, c.role) {
        (None, _) => None,
        (Some(l), SimRole::Prefill) => Some(LmcacheRole::Sender(Arc::new(lmcache::Sender::new(
            c.geometry,
            c.model.clone(),
            lmcache::SenderConfig { proxy: l.proxy, async_send: l.async_send },
            Arc::clone(&faults),
        )))),
        (Some(l), SimRole::Decode) => Some(LmcacheRole::Receiver(Arc::new(
            lmcache::Receiver::start(
                c.geometry,
                c.model.clone(),
                c.dp_host,
                l.pd_buffer_bytes,
                &l.alloc_ports,
                &l.init_ports,
            )
            .await?,
        ))),
    };
    let nixl = match (c.nixl, c.role) {
        (None, _) => None,
        (Some(abort), SimRole::Prefill) => Some(NixlRole::Producer(Arc::new(
            nixl::Producer::start(c.geometry, c.dp_host, c.cache_blocks, c.block_size, abort).await?,
        ))),
        (Some(_), SimRole::Decode) => Some(NixlRole::Consumer),
    };
    let sglang = match (&c.sglang, c.role) {
        (None, _) => None,
        (Some(s), SimRole::Prefill) => {
            let mut p = sglang::Sglang::prefill(c.geometry, c.dp_host, s.bootstrap_port, s.room_wait).await?;
            p.answer_delay = s.answer_delay;
            Some(Arc::new(p))
        }
        (Some(s), SimRole::Decode) => Some(Arc::new(sglang::Sglang::decode(c.geometry, s.room_wait))),
    };
    let cache = match c.prefix_cache {
        Some(p) => Some(
            cache::PrefixCache::start(p)
                .await
                .map_err(|e| SimError::internal(format!("KV event publisher: {e}")))?,
        ),
        None => None,
    };
    let engine =
        SimEngine::new(role, Protocols { lmcache, nixl, sglang, cache }, c.model, faults, c.token_delay);
    let listener = TcpListener::bind(c.listen)
        .await
        .map_err(|e| SimError::internal(format!("bind {}: {e}", c.listen)))?;
    let addr = listener.local_addr().map_err(SimError::internal)?;
    let stop = Arc::new(Notify::new());
    let task = tokio::spawn(Arc::clone(&engine).serve(listener, Arc::clone(&stop)));
    Ok(Running { addr, engine, stop, task })
}

/// The `code` of a [`SimError::plain`] refusal.
pub const PLAIN: &str = "plain";

/// An error of the simulated engine, with the HTTP status it maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimError {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

impl SimError {
    fn new(status: u16, code: &'static str, message: impl fmt::Display) -> Self {
        Self { status, code, message: message.to_string() }
    }
    pub fn bad(m: impl fmt::Display) -> Self {
        Self::new(400, "invalid_request", m)
    }
    pub fn conflict(m: impl fmt::Display) -> Self {
        Self::new(409, "kv_not_ready", m)
    }
    pub fn gone(m: impl fmt::Display) -> Self {
        Self::new(410, "kv_gone", m)
    }
    pub fn busy(m: impl fmt::Display) -> Self {
        Self::new(503, "engine_busy", m)
    }
    /// A decoder rank refused the reservation this prefiller made for itself for lack of room:
    /// the contract's status, which the gateway retries.
    pub fn kv_busy(m: impl fmt::Display) -> Self {
        Self::new(baton_dataplane::contract::KV_BUSY_STATUS, "kv_busy", m)
    }
    pub fn upstream(m: impl fmt::Display) -> Self {
        Self::new(502, "kv_transfer_failed", m)
    }
    pub fn timeout(m: impl fmt::Display) -> Self {
        Self::new(504, "kv_transfer_timeout", m)
    }
    pub fn internal(m: impl fmt::Display) -> Self {
        Self::new(500, "internal_error", m)
    }
    /// A refusal with any status in plain text, not from the engine's API (a fault switch
    /// playing a proxy or load balancer in front of the engine that turns the request away).
    pub fn plain(status: u16, m: impl fmt::Display) -> Self {
        Self::new(status, PLAIN, m)
    }
    /// An error with any status (a fault switch playing an engine that refuses).
    pub fn status(status: u16, m: impl fmt::Display) -> Self {
        let code = if status < 500 { "invalid_request" } else { "engine_error" };
        Self::new(status, code, m)
    }
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for SimError {}
