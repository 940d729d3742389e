//! `[[decode]]`: a decode pool, its common keys (`name`, `url`, `handoff`) and the keys of its
//! handoff mode. Each mode's keys are a struct of their own with `deny_unknown_fields`, so a key of
//! one mode on a pool of another is refused by the parser ("unknown field `dataplane`, expected
//! `nixl`"), and each mode is checked and started by its own arm here.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use baton_dataplane::KvGeometry;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer};

use super::lmcache::{CheckedLmcache, LmcachePool, check_lmcache};
use super::{ConfigError, err, ms, parse_url};
use crate::admission::{QueueConfig, SlotQueue};
use crate::endpoints::{EngineUrl, HostPort};
use crate::handoff::decoder::Decoder;
use crate::handoff::lmcache::{Lmcache, Notifications};
use crate::handoff::native::{Native, RankLinks};
use crate::handoff::nixl::Nixl;
use crate::handoff::scrape::LoadTarget;
use crate::handoff::sglang::Sglang;
use crate::handoff::{Handoff, Shared};

/// The handoff mode when a pool names none.
pub const DEFAULT_HANDOFF: &str = "native";

/// A decode pool as written.
#[derive(Debug)]
pub struct DecodePool {
    pub name: String,
    pub url: String,
    pub mode: PoolMode,
}

/// A pool's mode and its keys, tagged by `handoff`.
#[derive(Debug, Deserialize)]
#[serde(tag = "handoff", rename_all = "kebab-case")]
pub enum PoolMode {
    /// baton's data plane.
    Native(NativePool),
    /// vLLM with LMCache's PD backend.
    Lmcache(LmcacheMode),
    /// vLLM's NIXL connector.
    VllmNixl(NixlMode),
    /// SGLang's PD disaggregation.
    Sglang(SglangMode),
}

impl<'de> Deserialize<'de> for DecodePool {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut t = toml::Table::deserialize(d)?;
        let mut text = |key: &'static str| match t.remove(key) {
            Some(toml::Value::String(s)) => Ok(s),
            Some(v) => Err(D::Error::custom(format!("{key}: expected a string, found {}", v.type_str()))),
            None => Err(D::Error::missing_field(key)),
        };
        let (name, url) = (text("name")?, text("url")?);
        t.entry("handoff").or_insert_with(|| toml::Value::String(DEFAULT_HANDOFF.into()));
        let mode = PoolMode::deserialize(toml::Value::Table(t)).map_err(|e| D::Error::custom(e.message()))?;
        Ok(Self { name, url, mode })
    }
}

/// `handoff = "native"` (the default): the decoder's data-plane ranks.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NativePool {
    /// Data-plane address of each rank, in rank order; their count is the TP size.
    pub dataplane: Vec<HostPort>,
    /// Lowers the slots the data plane reports (never raises them).
    pub max_slots: Option<u32>,
}

/// `handoff = "lmcache"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LmcacheMode {
    /// The decoder's PD backend: its YAML, or its ports and buffer size.
    pub lmcache: LmcachePool,
    /// Lowers the slots the PD buffer holds (never raises them).
    pub max_slots: Option<u32>,
}

/// `handoff = "vllm-nixl"`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct NixlMode {
    /// Admission from the decoder's metrics.
    #[serde(default)]
    pub nixl: LoadPool,
}

/// `handoff = "sglang"`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SglangMode {
    /// The prefill servers' `--disaggregation-bootstrap-port` (mini_lb's `--prefill-bootstrap-ports`
    /// with one value). Without it each prefill server's `GET /get_server_info` is asked once.
    pub bootstrap_port: Option<u16>,
    /// Admission from the decoder's metrics (SGLang's `--enable-metrics`).
    #[serde(default)]
    pub sglang: LoadPool,
}

/// Admission of a decoder from its own metrics (`[decode.nixl]`, `[decode.sglang]`).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoadPool {
    /// Requests in flight when its metrics allow (default [`crate::handoff::scrape::DEFAULT_MAX_IN_FLIGHT`]).
    pub max_in_flight: u32,
    /// KV cache usage (0..1) that closes admission (default [`crate::handoff::scrape::DEFAULT_KV_USAGE_HIGH`]).
    pub kv_usage_high: f64,
    /// Waiting requests that close admission (default [`crate::handoff::scrape::DEFAULT_MAX_WAITING`]).
    pub max_waiting: u64,
    /// How often `/metrics` is read, ms (default [`crate::handoff::scrape::DEFAULT_SCRAPE_INTERVAL`]).
    pub scrape_interval_ms: u64,
}

impl Default for LoadPool {
    fn default() -> Self {
        let t = LoadTarget::default();
        Self {
            max_in_flight: t.max_in_flight,
            kv_usage_high: t.kv_usage_high,
            max_waiting: t.max_waiting,
            scrape_interval_ms: ms(t.scrape_interval),
        }
    }
}

impl LoadPool {
    /// Checked, under `f` (the table's path).
    pub fn check(&self, f: &str) -> Result<LoadTarget, ConfigError> {
        if self.max_in_flight == 0 {
            return Err(err(format!("{f}.max_in_flight"), "must be greater than 0"));
        }
        if !(self.kv_usage_high > 0.0 && self.kv_usage_high <= 1.0) {
            return Err(err(
                format!("{f}.kv_usage_high"),
                format!("{} must be in (0, 1]", self.kv_usage_high),
            ));
        }
        if self.scrape_interval_ms == 0 {
            return Err(err(format!("{f}.scrape_interval_ms"), "must be greater than 0"));
        }
        Ok(LoadTarget {
            max_in_flight: self.max_in_flight,
            kv_usage_high: self.kv_usage_high,
            max_waiting: self.max_waiting,
            scrape_interval: Duration::from_millis(self.scrape_interval_ms),
        })
    }
}

/// A decode pool, checked.
#[derive(Debug, Clone)]
pub struct CheckedDecoder {
    pub name: String,
    pub http: EngineUrl,
    pub mode: CheckedMode,
}

/// A pool's mode, checked.
#[derive(Debug, Clone)]
pub enum CheckedMode {
    Native {
        ranks: Vec<HostPort>,
        /// The pool's geometry (its TP is its rank count).
        geometry: KvGeometry,
        max_slots: Option<u32>,
    },
    Lmcache {
        lmcache: CheckedLmcache,
        geometry: KvGeometry,
        max_slots: Option<u32>,
    },
    VllmNixl(LoadTarget),
    Sglang {
        target: LoadTarget,
        bootstrap_port: Option<u16>,
    },
}

/// What the pools of one gateway share at start.
#[derive(Debug)]
pub struct StartContext {
    pub shared: Arc<Shared>,
    pub queue: QueueConfig,
    /// The `lmcache` notification listener (bound when a pool uses the mode).
    pub lmcache: Option<Arc<Notifications>>,
    /// `[lmcache] first_token`.
    pub first_token: bool,
    /// `[dataplane_tls]`: how to reach `native` decoders' ranks when the data plane is authenticated.
    pub dataplane_tls: Option<baton_dataplane::transport::TlsClient>,
}

/// Why a pool could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("decoder {decoder}: data plane: {source}")]
    DataPlane { decoder: String, source: baton_dataplane::transport::TransportError },
    #[error("decoder {decoder}: {reason}")]
    Decoder { decoder: String, reason: String },
    #[error("listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("lmcache notifications: {0}")]
    Lmcache(String),
    #[error("plugins: {0}")]
    Plugins(String),
    #[error("metrics: {0}")]
    Metrics(String),
    #[error("tracing: {0}")]
    Tracing(String),
}

/// Checks the pools; `geometry_for(tp)` is the model's geometry at a TP size.
pub(super) fn check(
    pools: &[DecodePool],
    path: &dyn Fn(&Path) -> PathBuf,
    model_chunk: u32,
    geometry_for: &dyn Fn(u32) -> Result<KvGeometry, ConfigError>,
) -> Result<Vec<CheckedDecoder>, ConfigError> {
    if pools.is_empty() {
        return Err(err("decode", "at least one decode pool is required"));
    }
    let mut out = Vec::new();
    for (i, d) in pools.iter().enumerate() {
        let f = format!("decode[{i}]");
        let http = parse_url(&format!("{f}.url"), &d.url)?;
        let geometry = |tp: u32| geometry_for(tp).map_err(|e| err(format!("{f} ({})", e.field), e.reason));
        let max = |m: Option<u32>| match m {
            Some(0) => Err(err(format!("{f}.max_slots"), "must be greater than 0")),
            m => Ok(m),
        };
        let mode = match &d.mode {
            PoolMode::Native(n) => {
                if n.dataplane.is_empty() {
                    return Err(err(format!("{f}.dataplane"), "list one data-plane address per rank"));
                }
                let tp = u32::try_from(n.dataplane.len())
                    .map_err(|_| err(format!("{f}.dataplane"), "too many ranks"))?;
                CheckedMode::Native {
                    ranks: n.dataplane.clone(),
                    geometry: geometry(tp)?,
                    max_slots: max(n.max_slots)?,
                }
            }
            PoolMode::Lmcache(l) => {
                let lm = check_lmcache(&format!("{f}.lmcache"), &l.lmcache, path, model_chunk, geometry_for)?;
                let tp = u32::try_from(lm.target.alloc_ports.len()).unwrap_or(u32::MAX);
                CheckedMode::Lmcache { geometry: geometry(tp)?, lmcache: lm, max_slots: max(l.max_slots)? }
            }
            PoolMode::VllmNixl(n) => {
                geometry(1)?;
                CheckedMode::VllmNixl(n.nixl.check(&format!("{f}.nixl"))?)
            }
            PoolMode::Sglang(s) => {
                geometry(1)?;
                if s.bootstrap_port == Some(0) {
                    return Err(err(format!("{f}.bootstrap_port"), "must be a port, not 0"));
                }
                CheckedMode::Sglang {
                    target: s.sglang.check(&format!("{f}.sglang"))?,
                    bootstrap_port: s.bootstrap_port,
                }
            }
        };
        out.push(CheckedDecoder { name: d.name.clone(), http, mode });
    }
    Ok(out)
}

impl CheckedMode {
    /// The mode's name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Native { .. } => crate::handoff::native::MODE,
            Self::Lmcache { .. } => crate::handoff::lmcache::MODE,
            Self::VllmNixl(_) => crate::handoff::nixl::MODE,
            Self::Sglang { .. } => crate::handoff::sglang::MODE,
        }
    }

    /// A pool's mode in one line, for `baton check-config`.
    pub fn describe(&self) -> String {
        match self {
            Self::Native { ranks, geometry, max_slots } => format!(
                "native, TP {}, {} KV bytes per token, page {} bytes per rank{}",
                ranks.len(),
                geometry.kv_bytes_per_token(),
                geometry.page_bytes_per_rank(),
                max_slots.map_or(String::new(), |m| format!(", at most {m} slots"))
            ),
            Self::Lmcache { lmcache: lm, geometry, .. } => format!(
                "lmcache, receiver {} init {:?} alloc {:?}, {} chunk slots ({} bytes per rank / {} tokens × {} KV bytes per token / TP {})",
                lm.target.receiver_host,
                lm.target.init_ports,
                lm.target.alloc_ports,
                lm.capacity,
                lm.pd_buffer_size,
                lm.chunk_size,
                geometry.kv_bytes_per_token(),
                lm.target.alloc_ports.len()
            ),
            Self::VllmNixl(n) => format!(
                "vllm-nixl, up to {} in flight while KV usage < {} and waiting < {} (metrics every {:?})",
                n.max_in_flight, n.kv_usage_high, n.max_waiting, n.scrape_interval
            ),
            Self::Sglang { target: n, bootstrap_port } => format!(
                "sglang, bootstrap port {}, up to {} in flight while KV usage < {} and waiting < {} (metrics every {:?})",
                bootstrap_port.map_or("from each prefill's /get_server_info".to_owned(), |p| p.to_string()),
                n.max_in_flight,
                n.kv_usage_high,
                n.max_waiting,
                n.scrape_interval
            ),
        }
    }
}

impl CheckedDecoder {
    /// Connects to the decoder as its mode needs and returns it, ready to serve.
    pub async fn start(self, ctx: &StartContext) -> Result<Arc<Decoder>, StartError> {
        let queue = SlotQueue::new(0, ctx.queue.clone());
        let shared = Arc::clone(&ctx.shared);
        let handoff: Box<dyn Handoff> = match self.mode {
            CheckedMode::Native { ranks, geometry, max_slots } => Box::new(
                Native::connect(
                    shared,
                    self.name.clone(),
                    RankLinks {
                        addrs: ranks,
                        fingerprint: geometry.fingerprint(),
                        tls: ctx.dataplane_tls.clone(),
                        names: ctx.shared.client.names().clone(),
                    },
                    geometry.chunk_tokens,
                    max_slots,
                    queue.clone(),
                )
                .await
                .map_err(|source| StartError::DataPlane { decoder: self.name.clone(), source })?,
            ),
            CheckedMode::Lmcache { lmcache, max_slots, .. } => {
                let hub = ctx.lmcache.clone().ok_or_else(|| StartError::Decoder {
                    decoder: self.name.clone(),
                    reason: "lmcache decoder without a notification listener ([lmcache] notify_listen)"
                        .into(),
                })?;
                queue.resize(max_slots.map_or(lmcache.capacity, |m| m.min(lmcache.capacity)));
                Box::new(Lmcache::new(shared, hub, lmcache.target, lmcache.chunk_size, ctx.first_token))
            }
            CheckedMode::VllmNixl(target) => Box::new(Nixl::new(shared, self.http.clone(), target, &queue)),
            CheckedMode::Sglang { target, bootstrap_port } => {
                Box::new(Sglang::new(shared, self.http.clone(), target, bootstrap_port, &queue))
            }
        };
        Ok(Arc::new(Decoder::new(self.name, self.http, queue, handoff)))
    }
}
