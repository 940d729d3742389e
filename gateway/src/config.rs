//! The gateway's one TOML file: listeners, the model and its KV geometry, the prefill and decode
//! pools, admission limits. Unknown fields are refused; every default is a named constant; a bad file
//! is refused with the field, the value and the reason. Relative paths are relative to the file.
//!
//! Buffer sizes are not configured here: each decoder's data plane reports them at start. A decode
//! pool may only lower the slots it is given (`max_slots`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use baton_dataplane::KvGeometry;
use serde::Deserialize;

use crate::admission::{DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT};
use crate::handoff::{
    DEFAULT_LEASE, DEFAULT_READY_TIMEOUT, DEFAULT_RELEASE_TIMEOUT, DEFAULT_UPSTREAM_TIMEOUT, Limits,
};
use crate::routing::{
    Builtin, DEFAULT_EJECT_AFTER_FAILURES, DEFAULT_EJECT_FOR, DEFAULT_HEALTH_CHECK_INTERVAL,
    DEFAULT_HEALTH_CHECK_TIMEOUT, HealthConfig,
};
use crate::server::tls::FrontTls;
use crate::telemetry::LogConfig;
use crate::tokenize::Tokenizer;

pub mod plugins;

/// Tokens per KV chunk when the model section names none (LMCache's and vLLM's common choice).
pub const DEFAULT_CHUNK_TOKENS: u32 = 256;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub listeners: Vec<Listener>,
    pub model: Model,
    pub prefill: Vec<Endpoint>,
    pub decode: Vec<DecodePool>,
    #[serde(default)]
    pub admission: Admission,
    #[serde(default)]
    pub routing: Routing,
    #[serde(default)]
    pub telemetry: Telemetry,
    /// The `lmcache` handoff's gateway side (needed when a decode pool uses it).
    pub lmcache: Option<LmcacheGateway>,
    /// Admission and routing policy plugins.
    #[serde(default)]
    pub plugins: plugins::Plugins,
}

/// How the KV reaches a decode pool.
#[derive(Debug, Deserialize, Clone, Copy, Default, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum HandoffMode {
    /// baton's data plane (`dataplane` addresses).
    #[default]
    Native,
    /// vLLM with LMCache's PD backend (`[decode.lmcache]`).
    Lmcache,
    /// vLLM's NIXL connector (`[decode.nixl]` optional).
    VllmNixl,
}

/// `[decode.nixl]`: admission of a `vllm-nixl` decoder from its own metrics.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NixlPool {
    /// Requests in flight when its metrics allow (default [`crate::handoff::nixl::DEFAULT_MAX_IN_FLIGHT`]).
    pub max_in_flight: u32,
    /// KV cache usage (0..1) that closes admission (default [`crate::handoff::nixl::DEFAULT_KV_USAGE_HIGH`]).
    pub kv_usage_high: f64,
    /// Waiting requests that close admission (default [`crate::handoff::nixl::DEFAULT_MAX_WAITING`]).
    pub max_waiting: u64,
    /// How often `/metrics` is read, ms (default [`crate::handoff::nixl::DEFAULT_SCRAPE_INTERVAL`]).
    pub scrape_interval_ms: u64,
}

impl Default for NixlPool {
    fn default() -> Self {
        let t = crate::handoff::nixl::NixlTarget::default();
        Self {
            max_in_flight: t.max_in_flight,
            kv_usage_high: t.kv_usage_high,
            max_waiting: t.max_waiting,
            scrape_interval_ms: ms(t.scrape_interval),
        }
    }
}

/// `[lmcache]`: where LMCache prefillers notify the gateway.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LmcacheGateway {
    /// The PULL socket's `IP:PORT`: the prefillers' `pd_proxy_host:pd_proxy_port`.
    pub notify_listen: SocketAddr,
    /// Ask prefillers for the first token (`ret_first_tok`) and send it to the client at once
    /// (default true).
    #[serde(default = "yes")]
    pub first_token: bool,
}

fn yes() -> bool {
    true
}

/// `[decode.lmcache]`: a decoder's LMCache PD backend. Values given here win over its YAML.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LmcachePool {
    /// The decoder's LMCache YAML (`pd_peer_host`, `pd_peer_init_port`, `pd_peer_alloc_port`,
    /// `pd_buffer_size`, `chunk_size` are read from it).
    pub config: Option<PathBuf>,
    pub receiver_host: Option<String>,
    pub init_ports: Option<Vec<u16>>,
    pub alloc_ports: Option<Vec<u16>>,
    /// PD buffer bytes per decoder rank.
    pub pd_buffer_size: Option<u64>,
    /// LMCache's chunk size in tokens (default `model.chunk_tokens`).
    pub chunk_size: Option<u32>,
}

/// The keys of an LMCache YAML the gateway reads (the rest are LMCache's business).
#[derive(Debug, Deserialize, Default)]
struct LmcacheYaml {
    chunk_size: Option<u32>,
    #[serde(alias = "nixl_buffer_size")]
    pd_buffer_size: Option<u64>,
    #[serde(alias = "nixl_role")]
    pd_role: Option<String>,
    #[serde(alias = "nixl_peer_host")]
    pd_peer_host: Option<String>,
    #[serde(alias = "nixl_peer_init_port")]
    pd_peer_init_port: Option<Ports>,
    #[serde(alias = "nixl_peer_alloc_port")]
    pd_peer_alloc_port: Option<Ports>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Ports {
    One(u16),
    Many(Vec<u16>),
}

impl Ports {
    fn list(self) -> Vec<u16> {
        match self {
            Self::One(p) => vec![p],
            Self::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listener {
    pub address: SocketAddr,
    /// Serve plain HTTP on this listener. Off unless said: TLS is the default.
    #[serde(default)]
    pub plain_http: bool,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// With it, clients must present a certificate from this CA (mTLS).
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    pub name: String,
    pub context_length: u64,
    /// Tokens per KV chunk (default [`DEFAULT_CHUNK_TOKENS`]).
    pub chunk_tokens: Option<u32>,
    pub geometry: Geometry,
    /// The model's HuggingFace `tokenizer.json`. Without it prompts are counted by the byte-level
    /// upper bound (with a warning at start).
    pub tokenizer: Option<PathBuf>,
    /// The model's `tokenizer_config.json`, for its chat template (and BOS/EOS tokens).
    pub tokenizer_config: Option<PathBuf>,
}

/// The KV geometry: a HuggingFace `config.json`, or the numbers.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Geometry {
    pub hf_config: Option<PathBuf>,
    pub layers: Option<u32>,
    pub kv_heads: Option<u32>,
    pub head_dim: Option<u32>,
    pub dtype_bytes: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    pub name: String,
    /// `http://host:port`
    pub url: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodePool {
    pub name: String,
    pub url: String,
    /// `native` (default) or `lmcache`.
    #[serde(default)]
    pub handoff: HandoffMode,
    /// Native: data-plane address of each rank, in rank order; their count is the TP size.
    #[serde(default)]
    pub dataplane: Vec<SocketAddr>,
    /// Lowers the slots the data plane reports (never raises them).
    pub max_slots: Option<u32>,
    /// `lmcache`: the decoder's PD backend.
    pub lmcache: Option<LmcachePool>,
    /// `vllm-nixl`: admission settings.
    pub nixl: Option<NixlPool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Admission {
    /// Requests waiting per decoder (default [`DEFAULT_MAX_QUEUE`]).
    pub max_queue: usize,
    /// Longest wait for room, ms (default [`DEFAULT_QUEUE_TIMEOUT`]).
    pub queue_timeout_ms: u64,
    /// Reservation lease on the decoder, ms (default [`DEFAULT_LEASE`]).
    pub lease_ms: u64,
    /// Longest wait for every rank to hold the KV, ms (default [`DEFAULT_READY_TIMEOUT`]).
    pub ready_timeout_ms: u64,
    /// Longest an upstream leg may take to answer, ms (default [`DEFAULT_UPSTREAM_TIMEOUT`]).
    pub upstream_timeout_ms: u64,
    /// API key → tenant name, for policy plugins (a key not listed is its own tenant).
    pub tenants: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Routing {
    /// `round-robin`, `least-loaded` or `kv-aware` (the default).
    pub policy: String,
    /// Consecutive failures that eject an endpoint (default [`DEFAULT_EJECT_AFTER_FAILURES`]).
    pub eject_after_failures: u32,
    /// First ejection, ms (default [`DEFAULT_EJECT_FOR`]); repeated ones double up to a minute.
    pub eject_ms: u64,
    /// Active `GET /health` period, ms (default [`DEFAULT_HEALTH_CHECK_INTERVAL`]).
    pub health_check_interval_ms: u64,
    /// Health check answer deadline, ms (default [`DEFAULT_HEALTH_CHECK_TIMEOUT`]).
    pub health_check_timeout_ms: u64,
}

impl Default for Routing {
    fn default() -> Self {
        Self {
            policy: Builtin::default().name().to_owned(),
            eject_after_failures: DEFAULT_EJECT_AFTER_FAILURES,
            eject_ms: ms(DEFAULT_EJECT_FOR),
            health_check_interval_ms: ms(DEFAULT_HEALTH_CHECK_INTERVAL),
            health_check_timeout_ms: ms(DEFAULT_HEALTH_CHECK_TIMEOUT),
        }
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Telemetry {
    /// `text` (the default) or `json`, one object per line.
    pub log_format: Option<String>,
    /// A `tracing` filter such as `info` or `baton_gateway=debug` (default `info`; `RUST_LOG` wins).
    pub log_level: Option<String>,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_queue: DEFAULT_MAX_QUEUE,
            queue_timeout_ms: ms(DEFAULT_QUEUE_TIMEOUT),
            lease_ms: ms(DEFAULT_LEASE),
            ready_timeout_ms: ms(DEFAULT_READY_TIMEOUT),
            upstream_timeout_ms: ms(DEFAULT_UPSTREAM_TIMEOUT),
            tenants: std::collections::BTreeMap::new(),
        }
    }
}

/// A refused configuration: which field, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}

fn err(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), reason: reason.into() }
}

/// A decode pool, checked.
#[derive(Debug, Clone)]
pub struct CheckedDecoder {
    pub name: String,
    pub http: SocketAddr,
    pub ranks: Vec<SocketAddr>,
    /// The pool's geometry (its TP is its rank count).
    pub geometry: KvGeometry,
    pub max_slots: Option<u32>,
    /// `lmcache` mode: where its PD backend listens and its capacity in chunks.
    pub lmcache: Option<CheckedLmcache>,
    /// `vllm-nixl` mode: its admission settings.
    pub nixl: Option<crate::handoff::nixl::NixlTarget>,
}

/// A decoder's LMCache PD backend, checked.
#[derive(Debug, Clone)]
pub struct CheckedLmcache {
    pub target: crate::handoff::lmcache::LmcacheTarget,
    /// `pd_buffer_size / (chunk_size × kv_bytes_per_token / tp)`.
    pub capacity: u32,
    pub chunk_size: u32,
    pub pd_buffer_size: u64,
}

/// A checked configuration, ready to serve.
#[derive(Debug)]
pub struct Checked {
    pub listeners: Vec<(SocketAddr, Option<FrontTls>)>,
    pub model: String,
    pub context_length: u64,
    pub decoders: Vec<CheckedDecoder>,
    pub prefills: Vec<(String, SocketAddr)>,
    pub max_queue: usize,
    pub limits: Limits,
    pub tokenizer: std::sync::Arc<Tokenizer>,
    pub routing: Builtin,
    pub health: HealthConfig,
    pub log: LogConfig,
    /// `[lmcache]`: the notification listener and whether to ask for the first token.
    pub lmcache_listen: Option<SocketAddr>,
    pub first_token: bool,
    pub plugins: Option<plugins::CheckedPlugins>,
    pub tenants: std::collections::BTreeMap<String, String>,
    /// The file it was loaded from (plugin reloads re-read their tables from it).
    pub source: Option<PathBuf>,
}

/// `http://host:port` → the socket address.
pub fn parse_url(field: &str, url: &str) -> Result<SocketAddr, ConfigError> {
    let rest =
        url.strip_prefix("http://").ok_or_else(|| err(field, format!("{url:?} must start with http://")))?;
    let host = rest.trim_end_matches('/');
    host.parse().map_err(|_| err(field, format!("{url:?} must be http://IP:PORT")))
}

impl Config {
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let msg = e.message().to_owned();
            err("config", msg)
        })
    }

    /// Validates everything that can be checked without the network: addresses, TLS files,
    /// geometry. `base` is the directory relative paths start from.
    pub fn check(&self, base: &Path) -> Result<Checked, ConfigError> {
        let path = |p: &Path| if p.is_absolute() { p.to_path_buf() } else { base.join(p) };
        if self.listeners.is_empty() {
            return Err(err("listeners", "at least one listener is required"));
        }
        let mut listeners = Vec::new();
        for (i, l) in self.listeners.iter().enumerate() {
            let f = format!("listeners[{i}]");
            let tls = match (l.plain_http, &l.tls_cert, &l.tls_key) {
                (true, None, None) => {
                    if l.client_ca.is_some() {
                        return Err(err(format!("{f}.client_ca"), "needs TLS (tls_cert and tls_key)"));
                    }
                    None
                }
                (true, _, _) => {
                    return Err(err(
                        format!("{f}.plain_http"),
                        "plain_http and tls_cert/tls_key exclude each other",
                    ));
                }
                (false, Some(c), Some(k)) => Some(
                    FrontTls::from_pem_files(&path(c), &path(k), l.client_ca.as_deref().map(path).as_deref())
                        .map_err(|e| err(format!("{f}.tls"), e))?,
                ),
                (false, _, _) => {
                    return Err(err(
                        f,
                        "needs tls_cert and tls_key, or plain_http = true to serve without TLS",
                    ));
                }
            };
            listeners.push((l.address, tls));
        }
        if self.model.name.is_empty() {
            return Err(err("model.name", "must not be empty"));
        }
        if self.model.context_length == 0 {
            return Err(err("model.context_length", "must be greater than 0"));
        }
        let chunk = self.model.chunk_tokens.unwrap_or(DEFAULT_CHUNK_TOKENS);
        let g = &self.model.geometry;
        let geometry_for = |tp: u32| -> Result<KvGeometry, ConfigError> {
            match (&g.hf_config, g.layers, g.kv_heads, g.head_dim, g.dtype_bytes) {
                (Some(p), None, None, None, _) => {
                    let json = std::fs::read_to_string(path(p)).map_err(|e| {
                        err("model.geometry.hf_config", format!("{}: {e}", path(p).display()))
                    })?;
                    KvGeometry::from_hf_config(&json, chunk, tp, g.dtype_bytes)
                        .map_err(|e| err("model.geometry", e.to_string()))
                }
                (None, Some(l), Some(h), Some(d), Some(b)) => {
                    KvGeometry::new(l, h, d, b, chunk, tp).map_err(|e| err("model.geometry", e.to_string()))
                }
                _ => Err(err(
                    "model.geometry",
                    "give hf_config (optionally with dtype_bytes), or layers, kv_heads, head_dim and dtype_bytes",
                )),
            }
        };
        if self.prefill.is_empty() {
            return Err(err("prefill", "at least one prefill endpoint is required"));
        }
        let mut prefills = Vec::new();
        for (i, p) in self.prefill.iter().enumerate() {
            prefills.push((p.name.clone(), parse_url(&format!("prefill[{i}].url"), &p.url)?));
        }
        if self.decode.is_empty() {
            return Err(err("decode", "at least one decode pool is required"));
        }
        let mut decoders = Vec::new();
        for (i, d) in self.decode.iter().enumerate() {
            let http = parse_url(&format!("decode[{i}].url"), &d.url)?;
            if d.max_slots == Some(0) {
                return Err(err(format!("decode[{i}].max_slots"), "must be greater than 0"));
            }
            match d.handoff {
                HandoffMode::Native => {
                    if d.lmcache.is_some() {
                        return Err(err(format!("decode[{i}].lmcache"), "needs handoff = \"lmcache\""));
                    }
                    if d.nixl.is_some() {
                        return Err(err(format!("decode[{i}].nixl"), "needs handoff = \"vllm-nixl\""));
                    }
                    if d.dataplane.is_empty() {
                        return Err(err(
                            format!("decode[{i}].dataplane"),
                            "list one data-plane address per rank",
                        ));
                    }
                    let tp = u32::try_from(d.dataplane.len())
                        .map_err(|_| err(format!("decode[{i}].dataplane"), "too many ranks"))?;
                    let geometry =
                        geometry_for(tp).map_err(|e| err(format!("decode[{i}] ({})", e.field), e.reason))?;
                    decoders.push(CheckedDecoder {
                        name: d.name.clone(),
                        http,
                        ranks: d.dataplane.clone(),
                        geometry,
                        max_slots: d.max_slots,
                        lmcache: None,
                        nixl: None,
                    });
                }
                HandoffMode::Lmcache => {
                    if !d.dataplane.is_empty() {
                        return Err(err(format!("decode[{i}].dataplane"), "is for the native handoff only"));
                    }
                    let f = format!("decode[{i}].lmcache");
                    let pool = d.lmcache.as_ref().ok_or_else(|| {
                        err(&f, "handoff = \"lmcache\" needs [decode.lmcache] (its YAML, or ports and buffer size)")
                    })?;
                    let lm = check_lmcache(&f, pool, &path, chunk, &geometry_for)?;
                    let geometry =
                        geometry_for(u32::try_from(lm.target.alloc_ports.len()).unwrap_or(u32::MAX))
                            .map_err(|e| err(format!("decode[{i}] ({})", e.field), e.reason))?;
                    decoders.push(CheckedDecoder {
                        name: d.name.clone(),
                        http,
                        ranks: Vec::new(),
                        geometry,
                        max_slots: d.max_slots,
                        lmcache: Some(lm),
                        nixl: None,
                    });
                }
                HandoffMode::VllmNixl => {
                    let f = format!("decode[{i}]");
                    if !d.dataplane.is_empty() || d.lmcache.is_some() || d.max_slots.is_some() {
                        return Err(err(
                            &f,
                            "handoff = \"vllm-nixl\" takes [decode.nixl] only (no dataplane, lmcache or max_slots)",
                        ));
                    }
                    let n = d.nixl.unwrap_or_default();
                    if n.max_in_flight == 0 {
                        return Err(err(format!("{f}.nixl.max_in_flight"), "must be greater than 0"));
                    }
                    if !(n.kv_usage_high > 0.0 && n.kv_usage_high <= 1.0) {
                        return Err(err(format!("{f}.nixl.kv_usage_high"), "must be in (0, 1]"));
                    }
                    if n.scrape_interval_ms == 0 {
                        return Err(err(format!("{f}.nixl.scrape_interval_ms"), "must be greater than 0"));
                    }
                    let geometry =
                        geometry_for(1).map_err(|e| err(format!("{f} ({})", e.field), e.reason))?;
                    decoders.push(CheckedDecoder {
                        name: d.name.clone(),
                        http,
                        ranks: Vec::new(),
                        geometry,
                        max_slots: None,
                        lmcache: None,
                        nixl: Some(crate::handoff::nixl::NixlTarget {
                            max_in_flight: n.max_in_flight,
                            kv_usage_high: n.kv_usage_high,
                            max_waiting: n.max_waiting,
                            scrape_interval: Duration::from_millis(n.scrape_interval_ms),
                        }),
                    });
                }
            }
        }
        let lmcache_used = decoders.iter().any(|d| d.lmcache.is_some());
        if lmcache_used && self.lmcache.is_none() {
            return Err(err(
                "lmcache.notify_listen",
                "a decode pool uses handoff = \"lmcache\": say where its prefillers notify (their pd_proxy_host:pd_proxy_port)",
            ));
        }
        let a = &self.admission;
        for (field, v) in [
            ("admission.queue_timeout_ms", a.queue_timeout_ms),
            ("admission.lease_ms", a.lease_ms),
            ("admission.ready_timeout_ms", a.ready_timeout_ms),
            ("admission.upstream_timeout_ms", a.upstream_timeout_ms),
        ] {
            if v == 0 {
                return Err(err(field, "must be greater than 0"));
            }
        }
        if a.max_queue == 0 {
            return Err(err("admission.max_queue", "must be greater than 0"));
        }
        if a.lease_ms <= a.ready_timeout_ms {
            return Err(err(
                "admission.lease_ms",
                format!(
                    "{} must exceed ready_timeout_ms {}: a lease shorter than the wait expires every slow request",
                    a.lease_ms, a.ready_timeout_ms
                ),
            ));
        }
        let limits = Limits {
            lease: Duration::from_millis(a.lease_ms),
            queue_timeout: Duration::from_millis(a.queue_timeout_ms),
            ready_timeout: Duration::from_millis(a.ready_timeout_ms),
            upstream_timeout: Duration::from_millis(a.upstream_timeout_ms),
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
        };
        let tokenizer = match (&self.model.tokenizer, &self.model.tokenizer_config) {
            (None, None) => Tokenizer::fallback(),
            (None, Some(_)) => {
                return Err(err("model.tokenizer_config", "needs model.tokenizer (the tokenizer.json)"));
            }
            (Some(t), c) => Tokenizer::load(&path(t), c.as_deref().map(path).as_deref()).map_err(|e| {
                err(if e.in_config { "model.tokenizer_config" } else { "model.tokenizer" }, e.to_string())
            })?,
        };
        let r = &self.routing;
        let routing = Builtin::parse(&r.policy).ok_or_else(|| {
            err("routing.policy", format!("{:?} is not one of {}", r.policy, Builtin::NAMES.join(", ")))
        })?;
        for (field, v) in [
            ("routing.eject_after_failures", u64::from(r.eject_after_failures)),
            ("routing.health_check_interval_ms", r.health_check_interval_ms),
            ("routing.health_check_timeout_ms", r.health_check_timeout_ms),
        ] {
            if v == 0 {
                return Err(err(field, "must be greater than 0"));
            }
        }
        let health = HealthConfig {
            eject_after_failures: r.eject_after_failures,
            eject_for: Duration::from_millis(r.eject_ms),
            check_interval: Duration::from_millis(r.health_check_interval_ms),
            check_timeout: Duration::from_millis(r.health_check_timeout_ms),
        };
        let log = LogConfig::parse(self.telemetry.log_format.as_deref(), self.telemetry.log_level.as_deref())
            .map_err(|(field, reason)| err(format!("telemetry.{field}"), reason))?;
        Ok(Checked {
            listeners,
            model: self.model.name.clone(),
            context_length: self.model.context_length,
            decoders,
            prefills,
            max_queue: a.max_queue,
            limits,
            tokenizer: std::sync::Arc::new(tokenizer),
            routing,
            health,
            log,
            lmcache_listen: self.lmcache.as_ref().map(|l| l.notify_listen),
            first_token: self.lmcache.as_ref().is_none_or(|l| l.first_token),
            plugins: self.plugins.check(base)?,
            tenants: a.tenants.clone(),
            source: None,
        })
    }
}

/// Merges `[decode.lmcache]` with the YAML it names and computes the slots.
fn check_lmcache(
    f: &str,
    pool: &LmcachePool,
    path: &dyn Fn(&Path) -> PathBuf,
    model_chunk: u32,
    geometry_for: &dyn Fn(u32) -> Result<KvGeometry, ConfigError>,
) -> Result<CheckedLmcache, ConfigError> {
    let yaml = match &pool.config {
        None => LmcacheYaml::default(),
        Some(p) => {
            let p = path(p);
            let text = std::fs::read_to_string(&p)
                .map_err(|e| err(format!("{f}.config"), format!("{}: {e}", p.display())))?;
            let y: LmcacheYaml = serde_yaml_ng::from_str(&text)
                .map_err(|e| err(format!("{f}.config"), format!("{}: {e}", p.display())))?;
            if let Some(role) = y.pd_role.as_deref().filter(|r| *r != "receiver") {
                return Err(err(
                    format!("{f}.config"),
                    format!(
                        "{} has pd_role {role:?}: give the decoder's (receiver's) LMCache config",
                        p.display()
                    ),
                ));
            }
            y
        }
    };
    // The TOML's value wins over the YAML's; one of them must be there.
    fn pick<T>(f: &str, toml: Option<T>, yaml: Option<T>, field: &str, key: &str) -> Result<T, ConfigError> {
        toml.or(yaml).ok_or_else(|| err(format!("{f}.{field}"), format!("needed (or {key} in its YAML)")))
    }
    let receiver_host =
        pick(f, pool.receiver_host.clone(), yaml.pd_peer_host, "receiver_host", "pd_peer_host")?;
    let init_ports = pick(
        f,
        pool.init_ports.clone(),
        yaml.pd_peer_init_port.map(Ports::list),
        "init_ports",
        "pd_peer_init_port",
    )?;
    let alloc_ports = pick(
        f,
        pool.alloc_ports.clone(),
        yaml.pd_peer_alloc_port.map(Ports::list),
        "alloc_ports",
        "pd_peer_alloc_port",
    )?;
    if alloc_ports.is_empty() || alloc_ports.len() != init_ports.len() {
        return Err(err(
            format!("{f}.alloc_ports"),
            format!(
                "one alloc and one init port per decoder rank ({} and {} given)",
                alloc_ports.len(),
                init_ports.len()
            ),
        ));
    }
    let pd_buffer_size =
        pick(f, pool.pd_buffer_size, yaml.pd_buffer_size, "pd_buffer_size", "pd_buffer_size")?;
    let chunk_size = pool.chunk_size.or(yaml.chunk_size).unwrap_or(model_chunk);
    if chunk_size == 0 {
        return Err(err(format!("{f}.chunk_size"), "must be greater than 0"));
    }
    let tp =
        u32::try_from(alloc_ports.len()).map_err(|_| err(format!("{f}.alloc_ports"), "too many ranks"))?;
    let g = geometry_for(tp).map_err(|e| err(format!("{f} ({})", e.field), e.reason))?;
    let g = KvGeometry::new(g.layers, g.kv_heads, g.head_dim, g.dtype_bytes, chunk_size, tp)
        .map_err(|e| err(format!("{f}.chunk_size"), e.to_string()))?;
    let chunk_bytes = g.page_bytes_per_rank().max(1);
    let capacity = u32::try_from(pd_buffer_size / chunk_bytes).unwrap_or(u32::MAX);
    if capacity == 0 {
        return Err(err(
            format!("{f}.pd_buffer_size"),
            format!(
                "{pd_buffer_size} bytes hold no chunk of {chunk_bytes} bytes per rank ({chunk_size} tokens)"
            ),
        ));
    }
    Ok(CheckedLmcache {
        target: crate::handoff::lmcache::LmcacheTarget { receiver_host, init_ports, alloc_ports },
        capacity,
        chunk_size,
        pd_buffer_size,
    })
}

/// Reads and checks a file.
pub fn load(file: &Path) -> Result<Checked, ConfigError> {
    let text = std::fs::read_to_string(file).map_err(|e| err(file.display().to_string(), e.to_string()))?;
    let base = file.parent().unwrap_or(Path::new("."));
    let mut c = Config::parse(&text)?.check(base)?;
    c.source = Some(file.to_path_buf());
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[[listeners]]
address = "127.0.0.1:8080"
plain_http = true

[model]
name = "baton-sim"
context_length = 32768
chunk_tokens = 16
geometry = { layers = 2, kv_heads = 2, head_dim = 16, dtype_bytes = 2 }

[[prefill]]
name = "p0"
url = "http://127.0.0.1:8100"

[[decode]]
name = "d0"
url = "http://127.0.0.1:8200"
dataplane = ["127.0.0.1:9000", "127.0.0.1:9001"]
"#;

    #[test]
    fn a_good_file_checks_with_defaults() {
        let c = Config::parse(GOOD).unwrap().check(Path::new(".")).unwrap();
        assert_eq!(c.decoders[0].geometry.tp_size, 2);
        assert_eq!(c.limits.lease, DEFAULT_LEASE);
        assert_eq!(c.max_queue, DEFAULT_MAX_QUEUE);
    }

    const LMCACHE: &str = r#"
[[decode]]
name = "d1"
url = "http://127.0.0.1:8300"
handoff = "lmcache"
lmcache = { receiver_host = "127.0.0.1", init_ports = [7300, 7301], alloc_ports = [7400, 7401], pd_buffer_size = 65536 }

[lmcache]
notify_listen = "127.0.0.1:7500"
"#;

    #[test]
    fn an_lmcache_pool_gets_its_slots_from_buffer_chunk_and_geometry() {
        let c = Config::parse(&format!("{GOOD}{LMCACHE}")).unwrap().check(Path::new(".")).unwrap();
        let lm = c.decoders[1].lmcache.as_ref().unwrap();
        // 2 layers × 2 KV × 2 heads × 16 dims × 2 bytes = 256 bytes per token, 128 per rank at TP 2:
        // 16-token chunks are 2 KiB per rank, 64 KiB hold 32.
        assert_eq!((lm.capacity, lm.chunk_size, lm.target.alloc_ports.len()), (32, 16, 2));
        assert_eq!(c.lmcache_listen, Some("127.0.0.1:7500".parse().unwrap()));
        assert!(c.first_token);
        // The same from an LMCache YAML, older key names included; explicit values win.
        let dir = std::env::temp_dir().join(format!("baton-lmcache-yaml-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("d.yaml"),
            "enable_nixl: True\nnixl_role: \"receiver\"\nnixl_peer_host: \"10.1.1.1\"\nnixl_peer_init_port: 7301\nnixl_peer_alloc_port: 7401\nnixl_buffer_size: 131072 # 128 KiB\nchunk_size: 32\n",
        )
        .unwrap();
        let text = format!("{GOOD}{LMCACHE}").replace(
            r#"lmcache = { receiver_host = "127.0.0.1", init_ports = [7300, 7301], alloc_ports = [7400, 7401], pd_buffer_size = 65536 }"#,
            r#"lmcache = { config = "d.yaml", pd_buffer_size = 262144 }"#,
        );
        let c = Config::parse(&text).unwrap().check(&dir).unwrap();
        let lm = c.decoders[1].lmcache.as_ref().unwrap();
        assert_eq!(lm.target.receiver_host, "10.1.1.1");
        assert_eq!((lm.target.init_ports.clone(), lm.target.alloc_ports.clone()), (vec![7301], vec![7401]));
        // TP 1, 32-token chunks: 8 KiB per chunk; 256 KiB (the TOML's value, not the YAML's) hold 32.
        assert_eq!((lm.chunk_size, lm.capacity, lm.pd_buffer_size), (32, 32, 262_144));
        std::fs::write(dir.join("p.yaml"), "pd_role: \"sender\"\npd_proxy_port: 7500\n").unwrap();
        let bad = Config::parse(&text.replace("d.yaml", "p.yaml")).unwrap().check(&dir).unwrap_err();
        assert_eq!(bad.field, "decode[1].lmcache.config", "{bad}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_files_name_the_field() {
        // (name, edit of GOOD, field the error must name)
        let cases: Vec<(&str, String, &str)> = vec![
            ("unknown field", GOOD.replace("plain_http = true", "plain_http = true\ncolour = 1"), "config"),
            ("no tls and not plain", GOOD.replace("plain_http = true", ""), "listeners[0]"),
            ("bad url", GOOD.replace("http://127.0.0.1:8100", "127.0.0.1:8100"), "prefill[0].url"),
            (
                "no ranks",
                GOOD.replace(r#"dataplane = ["127.0.0.1:9000", "127.0.0.1:9001"]"#, "dataplane = []"),
                "decode[0].dataplane",
            ),
            (
                "tp does not divide heads",
                GOOD.replace(
                    r#"["127.0.0.1:9000", "127.0.0.1:9001"]"#,
                    r#"["127.0.0.1:9000", "127.0.0.1:9001", "127.0.0.1:9002"]"#,
                ),
                "decode[0] (model.geometry)",
            ),
            ("half a geometry", GOOD.replace("layers = 2, ", ""), "decode[0] (model.geometry)"),
            (
                "zero context",
                GOOD.replace("context_length = 32768", "context_length = 0"),
                "model.context_length",
            ),
            (
                "lease shorter than ready wait",
                format!("{GOOD}\n[admission]\nlease_ms = 1000\nready_timeout_ms = 2000\n"),
                "admission.lease_ms",
            ),
            (
                "missing tls file",
                GOOD.replace(
                    "plain_http = true",
                    r#"tls_cert = "nope.pem"
tls_key = "nope.key""#,
                ),
                "listeners[0].tls",
            ),
            ("unknown routing", format!("{GOOD}\n[routing]\npolicy = \"random\"\n"), "routing.policy"),
            (
                "zero health interval",
                format!("{GOOD}\n[routing]\nhealth_check_interval_ms = 0\n"),
                "routing.health_check_interval_ms",
            ),
            (
                "bad log format",
                format!("{GOOD}\n[telemetry]\nlog_format = \"xml\"\n"),
                "telemetry.log_format",
            ),
            (
                "bad log filter",
                format!("{GOOD}\n[telemetry]\nlog_level = \"a=b=c\"\n"),
                "telemetry.log_level",
            ),
            (
                "missing tokenizer",
                GOOD.replace("chunk_tokens = 16", "chunk_tokens = 16\ntokenizer = \"nope/tokenizer.json\""),
                "model.tokenizer",
            ),
            (
                "nixl with a dataplane",
                GOOD.replace("url = \"http://127.0.0.1:8200\"", "url = \"http://127.0.0.1:8200\"\nhandoff = \"vllm-nixl\""),
                "decode[0]",
            ),
            (
                "nixl usage above 1",
                GOOD.replace(
                    "url = \"http://127.0.0.1:8200\"\ndataplane = [\"127.0.0.1:9000\", \"127.0.0.1:9001\"]",
                    "url = \"http://127.0.0.1:8200\"\nhandoff = \"vllm-nixl\"\nnixl = { kv_usage_high = 1.5 }",
                ),
                "decode[0].nixl.kv_usage_high",
            ),
            (
                "unknown handoff",
                GOOD.replace("url = \"http://127.0.0.1:8200\"", "url = \"http://127.0.0.1:8200\"\nhandoff = \"mooncake\""),
                "config",
            ),
            (
                "lmcache without a listener",
                format!("{GOOD}{LMCACHE}").replace("[lmcache]\nnotify_listen = \"127.0.0.1:7500\"", ""),
                "lmcache.notify_listen",
            ),
            (
                "lmcache ports mismatch",
                format!("{GOOD}{LMCACHE}").replace("alloc_ports = [7400, 7401]", "alloc_ports = [7400]"),
                "decode[1].lmcache.alloc_ports",
            ),
            (
                "lmcache buffer below one chunk",
                format!("{GOOD}{LMCACHE}").replace("pd_buffer_size = 65536", "pd_buffer_size = 100"),
                "decode[1].lmcache.pd_buffer_size",
            ),
            (
                "lmcache without its section",
                format!("{GOOD}{LMCACHE}").replace("lmcache = { receiver_host", "colour = { receiver_host"),
                "config",
            ),
            (
                "lmcache section on a native pool",
                GOOD.replace("dataplane = [", "lmcache = { pd_buffer_size = 1 }\ndataplane = ["),
                "decode[0].lmcache",
            ),
            (
                "template without tokenizer",
                GOOD.replace("chunk_tokens = 16", "chunk_tokens = 16\ntokenizer_config = \"x.json\""),
                "model.tokenizer_config",
            ),
        ];
        for (name, text, field) in cases {
            let got = Config::parse(&text).and_then(|c| c.check(Path::new("."))).map(|_| ()).unwrap_err();
            assert_eq!(got.field, field, "{name}: {got}");
        }
    }
}
