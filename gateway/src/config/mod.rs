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
use crate::endpoints::{EngineTls, EngineUrl, Host, Names, ResolverSettings, Scheme};
use crate::handoff::{
    DEFAULT_LEASE, DEFAULT_READY_TIMEOUT, DEFAULT_RELEASE_TIMEOUT, DEFAULT_UPSTREAM_TIMEOUT, Limits,
};
use crate::routing::{
    Builtin, DEFAULT_EJECT_AFTER_FAILURES, DEFAULT_EJECT_FOR, DEFAULT_HEALTH_CHECK_INTERVAL,
    DEFAULT_HEALTH_CHECK_TIMEOUT, HealthConfig,
};
use crate::telemetry::LogConfig;
use crate::tokenize::Tokenizer;

pub mod cache;
pub mod cluster;
pub mod decode;
pub mod flow;
pub mod plugins;
mod tls;

pub use crate::handoff::lmcache::{CheckedLmcache, LmcachePool};
pub use crate::handoff::{CheckedMode, PoolMode};
pub use decode::{CheckedDecoder, DecodePool};
pub use tls::{FrontTlsConfig, FrontTlsFileError, TlsFiles};

/// Tokens per KV chunk when the model section names none (LMCache's and vLLM's common choice).
pub const DEFAULT_CHUNK_TOKENS: u32 = 256;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub listeners: Vec<Listener>,
    pub model: Model,
    pub prefill: Vec<PrefillPool>,
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
    /// The operator's listener: `/metrics` and `/admin/*` (default [`DEFAULT_ADMIN_LISTEN`]).
    #[serde(default)]
    pub admin: Admin,
    /// What SIGTERM and SIGINT do.
    #[serde(default)]
    pub shutdown: Shutdown,
    /// API keys (off unless set).
    #[serde(default)]
    pub auth: Auth,
    /// mTLS to the `native` decoders' data-plane ranks (off unless set).
    pub dataplane_tls: Option<DataplaneTls>,
    /// How engine and data-plane names are looked up.
    #[serde(default)]
    pub resolver: Resolver,
    /// How `https://` engines are verified, and the gateway's certificate for them.
    pub engine_tls: Option<EngineTlsConfig>,
    /// Flow control: priority bands, fair shares between tenants, budgets, deadlines (off unless
    /// set).
    pub flow: Option<flow::Flow>,
    /// Replicas sharing the decoders through a store (off unless set: each replica alone).
    pub cluster: Option<cluster::Cluster>,
}

/// `[resolver]`: the DNS servers to ask for engine and data-plane names (default: the system's,
/// from `/etc/resolv.conf`) and how often a name in use is looked up again.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resolver {
    /// `IP:PORT` of each server (UDP, TCP when an answer is truncated).
    #[serde(default)]
    pub nameservers: Vec<SocketAddr>,
    /// Milliseconds between lookups of a name (default [`crate::endpoints::DEFAULT_REFRESH`]); a
    /// failed connection asks for one at once.
    pub refresh_ms: Option<u64>,
}

/// `[engine_tls]`: the CA that `https://` engines' certificates chain to (default: the system's
/// roots), and the gateway's certificate and key when the engines ask for one (mTLS).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineTlsConfig {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// `[dataplane_tls]`: how the gateway reaches decoder ranks whose data plane requires mTLS: the CA
/// their certificates chain to, the name they present, and the gateway's own certificate and key
/// (signed by the CA the ranks trust). Control connections and event feeds both use it,
/// reconnects too.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataplaneTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The name in the ranks' certificates.
    pub server_name: String,
}

impl DataplaneTls {
    /// The client it describes, its files read (`path` makes them absolute) and watched; `name`
    /// is what `/metrics` calls it.
    pub fn load(
        &self,
        name: String,
        path: &dyn Fn(&Path) -> PathBuf,
    ) -> Result<crate::endpoints::DataplaneCerts, baton_dataplane::transport::TlsError> {
        crate::endpoints::DataplaneCerts::load(
            name,
            path(&self.ca),
            path(&self.cert),
            path(&self.key),
            self.server_name.clone(),
        )
    }
}

/// `[auth]`: API keys. Without it every request is served and the tenant plugins see is the
/// bearer token's `[admission.tenants]` name, or an opaque id made from a token not listed (never
/// the token itself).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Auth {
    /// The keys file (`crate::auth`): each key's SHA-256 and its tenant.
    pub keys_file: Option<PathBuf>,
    /// `GET /v1/models` answers without a key (default false: it needs one, as generation does).
    #[serde(default)]
    pub models_open: bool,
}

/// How long requests in flight may run after SIGTERM or SIGINT before they are cut: long enough
/// for a long answer to finish, short enough for a rolling deploy (Kubernetes' default grace
/// period is 30 s; set `terminationGracePeriodSeconds` above this).
pub const DEFAULT_DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `[shutdown]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shutdown {
    /// Milliseconds requests in flight may run after the signal (default [`DEFAULT_DRAIN_TIMEOUT`]).
    pub drain_timeout_ms: Option<u64>,
}

/// Where `/metrics` and `/admin/*` are served when `[admin]` names nowhere: loopback only, so
/// nothing but the host itself (or a sidecar scraper) reaches the operator's routes.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";

/// `[admin]`: the operator's listener. Plain HTTP unless `tls_cert`/`tls_key` are set; with
/// `client_ca`, clients need a certificate from that CA (mTLS); with `token_sha256`, requests need
/// `Authorization: Bearer <token>` whose SHA-256 it is (the token itself is never stored).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    /// `IP:PORT` (default [`DEFAULT_ADMIN_LISTEN`]).
    pub listen: Option<SocketAddr>,
    /// Hex SHA-256 of the bearer token (`printf %s "$TOKEN" | sha256sum`).
    pub token_sha256: Option<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub client_ca: Option<PathBuf>,
}

/// A checked `[admin]`.
#[derive(Debug)]
pub struct CheckedAdmin {
    pub addr: SocketAddr,
    pub tls: Option<FrontTlsConfig>,
    pub token_sha256: Option<[u8; 32]>,
}

impl CheckedAdmin {
    /// Neither a token nor client certificates guard it.
    pub fn open(&self) -> bool {
        self.token_sha256.is_none() && self.tls.as_ref().is_none_or(|t| !t.client_auth())
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
    /// How tool calls are read out of the decoder's text (vLLM's `--tool-call-parser` names:
    /// `hermes`, `llama3_json`); without it a chat with `tools` is refused by `lmcache` pools.
    pub tool_call_parser: Option<crate::handoff::lmcache::tools::ToolParser>,
}

fn yes() -> bool {
    true
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

/// `[[prefill]]`: a prefill engine.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillPool {
    pub name: String,
    /// `http://host:port`
    pub url: String,
    /// Its KV-event publisher (see [`cache::KvEventsKeys`]).
    pub kv_events: Option<String>,
    pub kv_events_replay: Option<String>,
    #[serde(default)]
    pub kv_events_topic: String,
    pub data_parallel_size: Option<u16>,
}

impl PrefillPool {
    /// Its KV-event keys.
    pub fn events(&self) -> cache::KvEventsKeys {
        cache::KvEventsKeys {
            endpoint: self.kv_events.clone(),
            replay: self.kv_events_replay.clone(),
            topic: self.kv_events_topic.clone(),
            ranks: self.data_parallel_size.unwrap_or(1),
        }
    }
}

/// uvicorn's default keep-alive timeout (vLLM's and SGLang's HTTP server), ms.
const UVICORN_KEEP_ALIVE_MS: u64 = 5_000;

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
    /// A `vllm-nixl` or `sglang` decoder's slot held this much longer after its request was
    /// abandoned while the engine ran it, ms (default [`crate::handoff::DEFAULT_CANCEL_GRACE`]).
    pub cancel_grace_ms: u64,
    /// An idle keep-alive connection to an engine is not used again after this long, ms (default
    /// [`crate::handoff::DEFAULT_ENGINE_IDLE`]); keep it under the engines' own keep-alive timeout.
    pub engine_idle_timeout_ms: u64,
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
    /// `[routing.cache]`: the cache-aware policy and the block index.
    pub cache: cache::CacheRouting,
    /// `[routing.retries]`: retries of legs that failed before anything depended on them.
    pub retries: RetryKeys,
}

/// `[routing.retries]`, as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryKeys {
    /// Tries of a request, the first included (1: none): its retries of every leg together.
    pub attempts: u32,
    /// Retries may add this share of the last 10 s of requests.
    pub budget_ratio: f64,
    /// Retries per second allowed on top of the share.
    pub min_per_second: u32,
    /// The first backoff's bound, ms (doubling, jittered).
    pub backoff_ms: u64,
    /// The longest backoff's bound, ms.
    pub backoff_max_ms: u64,
}

impl Default for RetryKeys {
    fn default() -> Self {
        let d = crate::routing::retry::RetryConfig::default();
        Self {
            attempts: d.attempts,
            budget_ratio: d.budget_ratio,
            min_per_second: d.min_per_second,
            backoff_ms: ms(d.backoff),
            backoff_max_ms: ms(d.backoff_max),
        }
    }
}

impl RetryKeys {
    fn check(&self) -> Result<crate::routing::retry::RetryConfig, ConfigError> {
        if !(1..=10).contains(&self.attempts) {
            return Err(err("routing.retries.attempts", "must be from 1 (no retries) to 10"));
        }
        if !(0.0..=1.0).contains(&self.budget_ratio) {
            return Err(err("routing.retries.budget_ratio", "must be from 0 to 1"));
        }
        if self.backoff_max_ms < self.backoff_ms {
            return Err(err("routing.retries.backoff_max_ms", "must be at least backoff_ms"));
        }
        if self.backoff_max_ms > 10_000 {
            return Err(err(
                "routing.retries.backoff_max_ms",
                "must be at most 10000 (a retry waits no longer)",
            ));
        }
        Ok(crate::routing::retry::RetryConfig {
            attempts: self.attempts,
            budget_ratio: self.budget_ratio,
            min_per_second: self.min_per_second,
            backoff: Duration::from_millis(self.backoff_ms),
            backoff_max: Duration::from_millis(self.backoff_max_ms),
        })
    }
}

impl Default for Routing {
    fn default() -> Self {
        Self {
            policy: Builtin::default().name().to_owned(),
            eject_after_failures: DEFAULT_EJECT_AFTER_FAILURES,
            eject_ms: ms(DEFAULT_EJECT_FOR),
            health_check_interval_ms: ms(DEFAULT_HEALTH_CHECK_INTERVAL),
            health_check_timeout_ms: ms(DEFAULT_HEALTH_CHECK_TIMEOUT),
            cache: cache::CacheRouting::default(),
            retries: RetryKeys::default(),
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
    /// Tenants with `baton_tokens_total` series of their own (default
    /// [`crate::telemetry::metrics::DEFAULT_TENANT_SERIES`]); the others are counted as `other`.
    pub tenant_series: Option<usize>,
    /// Finished requests whose decision records `GET /admin/requests/{id}` keeps (default
    /// [`crate::telemetry::metrics::DEFAULT_RECORDS`]; 0: none).
    pub records: Option<usize>,
    /// Lets a client ask for its request's decision record with `x-baton-explain: 1` (default off:
    /// the record names the engines and their load).
    pub explain: Option<bool>,
    /// Traces requests to this OpenTelemetry collector (OTLP/HTTP protobuf), e.g.
    /// `http://127.0.0.1:4318` (`/v1/traces` added when the URL has no path). Unset: no tracing.
    pub otlp_endpoint: Option<String>,
    /// The share of requests traced when the client's `traceparent` did not decide (default
    /// [`crate::telemetry::trace::DEFAULT_SAMPLING_RATIO`]).
    pub sampling_ratio: Option<f64>,
    /// The spans' `service.name` (default [`crate::telemetry::trace::DEFAULT_SERVICE_NAME`]).
    pub service_name: Option<String>,
}

pub(crate) use crate::telemetry::metrics::ms;

impl Telemetry {
    /// The trace settings, checked; `None` without an endpoint (the ratio and name alone say
    /// nothing, and are refused so an operator does not think requests are traced).
    fn trace(&self) -> Result<Option<crate::telemetry::trace::TraceConfig>, ConfigError> {
        use crate::telemetry::trace::{DEFAULT_SAMPLING_RATIO, DEFAULT_SERVICE_NAME, TraceConfig};
        let Some(endpoint) = &self.otlp_endpoint else {
            if self.sampling_ratio.is_some() || self.service_name.is_some() {
                return Err(err(
                    "telemetry.otlp_endpoint",
                    "sampling_ratio and service_name need an otlp_endpoint",
                ));
            }
            return Ok(None);
        };
        let c = TraceConfig {
            endpoint: endpoint.clone(),
            sampling_ratio: self.sampling_ratio.unwrap_or(DEFAULT_SAMPLING_RATIO),
            service_name: self.service_name.clone().unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned()),
        };
        c.check().map_err(|(field, reason)| err(format!("telemetry.{field}"), reason))?;
        Ok(Some(c))
    }
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_queue: DEFAULT_MAX_QUEUE,
            queue_timeout_ms: ms(DEFAULT_QUEUE_TIMEOUT),
            lease_ms: ms(DEFAULT_LEASE),
            ready_timeout_ms: ms(DEFAULT_READY_TIMEOUT),
            upstream_timeout_ms: ms(DEFAULT_UPSTREAM_TIMEOUT),
            cancel_grace_ms: ms(crate::handoff::DEFAULT_CANCEL_GRACE),
            engine_idle_timeout_ms: ms(crate::handoff::DEFAULT_ENGINE_IDLE),
            tenants: std::collections::BTreeMap::new(),
        }
    }
}

/// A refused configuration: which field, and why; where the parser found it, when it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
    /// Line and column (1-based) of the offending text, for errors the TOML parser reports.
    pub at: Option<(usize, usize)>,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.at {
            Some((line, col)) => write!(f, "line {line}, column {col}: {}: {}", self.field, self.reason),
            None => write!(f, "{}: {}", self.field, self.reason),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A mode's key, as the file's error (the modes' checks know no line).
impl From<crate::handoff::KeyError> for ConfigError {
    fn from(e: crate::handoff::KeyError) -> Self {
        Self { field: e.field, reason: e.reason, at: None }
    }
}

pub(crate) fn err(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), reason: reason.into(), at: None }
}

/// A checked configuration, ready to serve.
#[derive(Debug)]
pub struct Checked {
    pub listeners: Vec<(SocketAddr, Option<FrontTlsConfig>)>,
    pub admin: CheckedAdmin,
    /// `[shutdown] drain_timeout_ms`.
    pub drain_timeout: std::time::Duration,
    /// `[auth]`: the API keys, loaded.
    pub keys: Option<std::sync::Arc<crate::auth::ApiKeys>>,
    /// `[auth] models_open`.
    pub models_open: bool,
    /// `[dataplane_tls]`, loaded.
    pub dataplane_tls: Option<crate::endpoints::DataplaneCerts>,
    /// `[resolver]`.
    pub resolver: ResolverSettings,
    /// `[engine_tls]`, loaded (the system's roots without it).
    pub engine_tls: Option<EngineTls>,
    pub model: String,
    pub context_length: u64,
    pub decoders: Vec<CheckedDecoder>,
    pub prefills: Vec<(String, EngineUrl)>,
    pub max_queue: usize,
    pub limits: Limits,
    pub tokenizer: std::sync::Arc<Tokenizer>,
    pub routing: Builtin,
    pub health: HealthConfig,
    /// The block index and its KV-event feeds, when routing is cache-aware or an engine
    /// publishes events.
    pub prefix: Option<cache::PrefixSettings>,
    /// What check-config and the start warn of (the configuration is usable).
    pub warnings: Vec<String>,
    pub log: LogConfig,
    /// `[telemetry] tenant_series`.
    pub tenant_series: usize,
    /// `[telemetry] records`.
    pub records: usize,
    /// `[telemetry] explain`.
    pub explain: bool,
    /// `[telemetry] otlp_endpoint`, `sampling_ratio`, `service_name`: requests are traced.
    pub trace: Option<crate::telemetry::trace::TraceConfig>,
    /// `[lmcache]`: the notification listener and whether to ask for the first token.
    pub lmcache_listen: Option<SocketAddr>,
    pub first_token: bool,
    /// `[lmcache] tool_call_parser`.
    pub tool_call_parser: Option<crate::handoff::lmcache::tools::ToolParser>,
    pub plugins: Option<plugins::CheckedPlugins>,
    pub tenants: std::collections::BTreeMap<String, String>,
    /// `[flow]`.
    pub flow: Option<crate::flow::FlowConfig>,
    /// `[cluster]`.
    pub cluster: Option<crate::cluster::ClusterConfig>,
    /// The file it was loaded from (plugin reloads re-read their tables from it).
    pub source: Option<PathBuf>,
}

/// An engine's `http://HOST:PORT` or `https://HOST:PORT`, the host an IP or a DNS name.
pub fn parse_url(field: &str, url: &str) -> Result<EngineUrl, ConfigError> {
    EngineUrl::parse(url).map_err(|e| err(field, e.to_string()))
}

impl Checked {
    /// Every DNS name in the engines' URLs and the ranks' addresses, with the field that gives it.
    pub fn names(&self) -> Vec<(String, String)> {
        let (prefills, decoders) = (&self.prefills, &self.decoders);
        let mut out = Vec::new();
        let mut add = |field: String, host: &Host| {
            if let Host::Name(n) = host {
                out.push((field, n.clone()));
            }
        };
        for (i, (_, u)) in prefills.iter().enumerate() {
            add(format!("prefill[{i}].url"), &u.host_port().host);
        }
        for (i, d) in decoders.iter().enumerate() {
            add(format!("decode[{i}].url"), &d.http.host_port().host);
            for (key, host) in d.mode.names() {
                add(format!("decode[{i}].{key}"), host);
            }
        }
        out
    }

    /// Looks every name up now; the first that has no address is the error, naming its field.
    pub async fn resolve(
        &self,
        names: &Names,
    ) -> Result<Vec<(String, String, Vec<std::net::IpAddr>)>, ConfigError> {
        let mut out = Vec::new();
        for (field, name) in self.names() {
            let ips = names.lookup(&name).await.map_err(|e| err(field.clone(), e.to_string()))?;
            out.push((field, name, ips));
        }
        Ok(out)
    }
}

/// 1-based line and column of byte `offset` in `text`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let col = before
        .rfind('\n')
        .map_or(before.chars().count(), |i| before.get(i + 1..).unwrap_or("").chars().count())
        + 1;
    (line, col)
}

impl Config {
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError {
            field: "config".into(),
            reason: e.message().to_owned(),
            at: e.span().map(|s| line_col(text, s.start)),
        })
    }

    /// Validates everything that can be checked without the network: addresses, TLS files,
    /// geometry. `base` is the directory relative paths start from.
    pub fn check(&self, base: &Path) -> Result<Checked, ConfigError> {
        let path = |p: &Path| if p.is_absolute() { p.to_path_buf() } else { base.join(p) };
        let listeners = self.check_listeners(&path)?;
        let admin = self.check_admin(&path)?;
        if let Some(ms) = self.shutdown.drain_timeout_ms
            && ms > 3_600_000
        {
            return Err(err("shutdown.drain_timeout_ms", format!("{ms} is more than an hour (3600000)")));
        }
        self.check_model()?;
        let chunk = self.model.chunk_tokens.unwrap_or(DEFAULT_CHUNK_TOKENS);
        let geometry_for = |tp: u32| self.model.geometry.at(chunk, tp, &path);
        let prefills = self.check_prefills()?;
        let decoders =
            decode::check(&self.decode, &path, chunk, &geometry_for, self.dataplane_tls.is_some())?;
        let lmcache_used = decoders.iter().any(|d| d.mode.mode().notifications());
        if lmcache_used && self.lmcache.is_none() {
            return Err(err(
                "lmcache.notify_listen",
                "a decode pool uses handoff = \"lmcache\": say where its prefillers notify (their pd_proxy_host:pd_proxy_port)",
            ));
        }
        let limits = self.admission.check()?;
        let tokenizer = self.model.tokenizer(&path)?;
        if lmcache_used && !tokenizer.is_exact() {
            return Err(err(
                "model.tokenizer",
                "a decode pool uses handoff = \"lmcache\", which sends the engines the gateway's token ids: \
                 give the model's tokenizer.json (without it the ids are byte values, which vLLM would read as another prompt)",
            ));
        }
        let (routing, health) = self.routing.check()?;
        let events: Vec<(String, cache::KvEventsKeys)> = (self.prefill.iter().enumerate())
            .map(|(i, p)| (format!("prefill[{i}]"), p.events()))
            .chain(self.decode.iter().enumerate().map(|(i, d)| (format!("decode[{i}]"), d.events.clone())))
            .collect();
        let events: Vec<(String, &cache::KvEventsKeys)> =
            events.iter().map(|(f, k)| (f.clone(), k)).collect();
        let (prefix, mut warnings) = self.routing.cache.check(routing, &events)?;
        if let Some(why) = tokenizer.reuse_off() {
            warnings.push(format!(
                "model.tokenizer: a chat's token ids are not reused across its turns ({why}): every request is tokenized whole"
            ));
        }
        if let Some(why) = tokenizer.fast_off() {
            warnings.push(format!(
                "model.tokenizer: prompts are tokenized through the tokenizers crate's whole pipeline ({why}), \
                 several times the CPU of the gateway's direct path for byte-level BPEs (docs/gateway.md, Tokenize)"
            ));
        }
        if let Some(why) = tokenizer.bound_off() {
            warnings.push(format!(
                "model.tokenizer: a prompt beyond model.context_length is refused only after it is tokenized ({why}); \
                 large prompts are bounded by the tokenizer pool alone"
            ));
        }
        if self.admission.engine_idle_timeout_ms >= UVICORN_KEEP_ALIVE_MS {
            warnings.push(format!(
                "admission.engine_idle_timeout_ms: {} is not under the {UVICORN_KEEP_ALIVE_MS} ms after which uvicorn \
                 (vLLM's and SGLang's HTTP server; vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE) closes an idle connection: \
                 a request sent as an engine closes one is lost unanswered, unless the engines keep theirs longer",
                self.admission.engine_idle_timeout_ms
            ));
        }
        let resolver = self.check_resolver()?;
        let engine_tls = self.check_engine_tls(&path, &prefills, &decoders)?;

        let log = LogConfig::parse(self.telemetry.log_format.as_deref(), self.telemetry.log_level.as_deref())
            .map_err(|(field, reason)| err(format!("telemetry.{field}"), reason))?;
        let flow = match &self.flow {
            Some(f) => Some(f.check(limits.queue_timeout)?),
            None => None,
        };
        let cluster = match &self.cluster {
            Some(c) => Some(c.check(&decoders)?),
            None => None,
        };
        Ok(Checked {
            listeners,
            admin,
            drain_timeout: self
                .shutdown
                .drain_timeout_ms
                .map_or(DEFAULT_DRAIN_TIMEOUT, std::time::Duration::from_millis),
            dataplane_tls: match &self.dataplane_tls {
                Some(t) => {
                    Some(t.load("dataplane".into(), &path).map_err(|e| err("dataplane_tls", e.to_string()))?)
                }
                None => None,
            },
            resolver,
            engine_tls,
            keys: match &self.auth.keys_file {
                Some(f) => Some(
                    crate::auth::ApiKeys::load(&path(f)).map_err(|e| err("auth.keys_file", e.to_string()))?,
                ),
                None => None,
            },
            models_open: self.auth.models_open,
            model: self.model.name.clone(),
            context_length: self.model.context_length,
            decoders,
            prefills,
            max_queue: self.admission.max_queue,
            limits,
            tokenizer: std::sync::Arc::new(tokenizer),
            routing,
            health,
            prefix,
            warnings,
            log,
            tenant_series: self
                .telemetry
                .tenant_series
                .unwrap_or(crate::telemetry::metrics::DEFAULT_TENANT_SERIES),
            records: self.telemetry.records.unwrap_or(crate::telemetry::metrics::DEFAULT_RECORDS),
            explain: self.telemetry.explain.unwrap_or(false),
            trace: self.telemetry.trace()?,
            lmcache_listen: self.lmcache.as_ref().map(|l| l.notify_listen),
            first_token: self.lmcache.as_ref().is_none_or(|l| l.first_token),
            tool_call_parser: self.lmcache.as_ref().and_then(|l| l.tool_call_parser),
            plugins: self.plugins.check(base)?,
            tenants: self.admission.tenants.clone(),
            flow,
            cluster,
            source: None,
        })
    }

    fn check_listeners(
        &self,
        path: &dyn Fn(&Path) -> PathBuf,
    ) -> Result<Vec<(SocketAddr, Option<FrontTlsConfig>)>, ConfigError> {
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
                    FrontTlsConfig::from_pem_files(
                        &path(c),
                        &path(k),
                        l.client_ca.as_deref().map(path).as_deref(),
                    )
                    .map_err(|e| err(format!("{f}.tls"), e.to_string()))?,
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
        Ok(listeners)
    }

    fn check_admin(&self, path: &dyn Fn(&Path) -> PathBuf) -> Result<CheckedAdmin, ConfigError> {
        let a = &self.admin;
        let addr = match a.listen {
            Some(addr) => addr,
            None => DEFAULT_ADMIN_LISTEN.parse().map_err(|_| err("admin.listen", "bad default"))?,
        };
        let tls = match (&a.tls_cert, &a.tls_key) {
            (Some(c), Some(k)) => Some(
                FrontTlsConfig::from_pem_files(
                    &path(c),
                    &path(k),
                    a.client_ca.as_deref().map(path).as_deref(),
                )
                .map_err(|e| err("admin.tls", e.to_string()))?,
            ),
            (None, None) if a.client_ca.is_some() => {
                return Err(err("admin.client_ca", "needs TLS (tls_cert and tls_key)"));
            }
            (None, None) => None,
            _ => return Err(err("admin", "tls_cert and tls_key go together")),
        };
        let token_sha256 = match &a.token_sha256 {
            None => None,
            Some(h) => Some(crate::auth::parse_digest(h).ok_or_else(|| {
                err("admin.token_sha256", "must be 64 hex digits: the SHA-256 of the token, not the token")
            })?),
        };
        // (Port 0 is a fresh port each time: no clash.)
        if let Some(l) = self.listeners.iter().find(|l| l.address == addr && addr.port() != 0) {
            return Err(err("admin.listen", format!("{} is also a public listener", l.address)));
        }
        Ok(CheckedAdmin { addr, tls, token_sha256 })
    }

    fn check_model(&self) -> Result<(), ConfigError> {
        if self.model.name.is_empty() {
            return Err(err("model.name", "must not be empty"));
        }
        if self.model.context_length == 0 {
            return Err(err("model.context_length", "must be greater than 0"));
        }
        Ok(())
    }

    fn check_resolver(&self) -> Result<ResolverSettings, ConfigError> {
        let refresh = match self.resolver.refresh_ms {
            Some(ms) if !(100..=3_600_000).contains(&ms) => {
                return Err(err("resolver.refresh_ms", format!("{ms} is outside 100..=3600000")));
            }
            Some(ms) => std::time::Duration::from_millis(ms),
            None => crate::endpoints::DEFAULT_REFRESH,
        };
        Ok(ResolverSettings { nameservers: self.resolver.nameservers.clone(), refresh })
    }

    /// `[engine_tls]` loaded; without it, an `https://` engine needs the system's roots.
    fn check_engine_tls(
        &self,
        path: &dyn Fn(&Path) -> PathBuf,
        prefills: &[(String, EngineUrl)],
        decoders: &[CheckedDecoder],
    ) -> Result<Option<EngineTls>, ConfigError> {
        let https = prefills
            .iter()
            .map(|(_, u)| u)
            .chain(decoders.iter().map(|d| &d.http))
            .any(|u| u.scheme() == Scheme::Https);
        let Some(t) = &self.engine_tls else {
            if https {
                EngineTls::from_pem_files(None, None).map_err(|e| {
                    err(
                        "engine_tls.ca",
                        format!("an engine is https:// and {e}: name the CA its certificate chains to"),
                    )
                })?;
            }
            return Ok(None);
        };
        let client = match (&t.cert, &t.key) {
            (Some(c), Some(k)) => Some((path(c), path(k))),
            (None, None) => None,
            _ => return Err(err("engine_tls", "cert and key go together")),
        };
        let ca = t.ca.as_deref().map(path);
        EngineTls::from_pem_files(ca.as_deref(), client.as_ref().map(|(c, k)| (c.as_path(), k.as_path())))
            .map(Some)
            .map_err(|e| err("engine_tls", e.to_string()))
    }

    fn check_prefills(&self) -> Result<Vec<(String, EngineUrl)>, ConfigError> {
        if self.prefill.is_empty() {
            return Err(err("prefill", "at least one prefill endpoint is required"));
        }
        self.prefill
            .iter()
            .enumerate()
            .map(|(i, p)| Ok((p.name.clone(), parse_url(&format!("prefill[{i}].url"), &p.url)?)))
            .collect()
    }
}

impl Geometry {
    /// The model's KV geometry at `tp` ranks with `chunk`-token pages.
    fn at(&self, chunk: u32, tp: u32, path: &dyn Fn(&Path) -> PathBuf) -> Result<KvGeometry, ConfigError> {
        match (&self.hf_config, self.layers, self.kv_heads, self.head_dim, self.dtype_bytes) {
            (Some(p), None, None, None, _) => {
                let json = std::fs::read_to_string(path(p))
                    .map_err(|e| err("model.geometry.hf_config", format!("{}: {e}", path(p).display())))?;
                KvGeometry::from_hf_config(&json, chunk, tp, self.dtype_bytes)
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
    }
}

impl Model {
    /// The model's tokenizer, or the byte-level fallback when none is configured.
    fn tokenizer(&self, path: &dyn Fn(&Path) -> PathBuf) -> Result<Tokenizer, ConfigError> {
        match (&self.tokenizer, &self.tokenizer_config) {
            (None, None) => Ok(Tokenizer::fallback()),
            (None, Some(_)) => {
                Err(err("model.tokenizer_config", "needs model.tokenizer (the tokenizer.json)"))
            }
            (Some(t), c) => Tokenizer::load(&path(t), c.as_deref().map(path).as_deref()).map_err(|e| {
                err(if e.in_config { "model.tokenizer_config" } else { "model.tokenizer" }, e.to_string())
            }),
        }
    }
}

impl Admission {
    fn check(&self) -> Result<Limits, ConfigError> {
        for (field, v) in [
            ("admission.queue_timeout_ms", self.queue_timeout_ms),
            ("admission.lease_ms", self.lease_ms),
            ("admission.ready_timeout_ms", self.ready_timeout_ms),
            ("admission.upstream_timeout_ms", self.upstream_timeout_ms),
            ("admission.engine_idle_timeout_ms", self.engine_idle_timeout_ms),
        ] {
            if v == 0 {
                return Err(err(field, "must be greater than 0"));
            }
        }
        if self.max_queue == 0 {
            return Err(err("admission.max_queue", "must be greater than 0"));
        }
        if self.cancel_grace_ms > 10_000 {
            return Err(err(
                "admission.cancel_grace_ms",
                format!(
                    "{} is over 10000: a slot held that long after its client left is a slot lost",
                    self.cancel_grace_ms
                ),
            ));
        }
        if self.lease_ms <= self.ready_timeout_ms {
            return Err(err(
                "admission.lease_ms",
                format!(
                    "{} must exceed ready_timeout_ms {}: a lease shorter than the wait expires every slow request",
                    self.lease_ms, self.ready_timeout_ms
                ),
            ));
        }
        Ok(Limits {
            lease: Duration::from_millis(self.lease_ms),
            queue_timeout: Duration::from_millis(self.queue_timeout_ms),
            ready_timeout: Duration::from_millis(self.ready_timeout_ms),
            upstream_timeout: Duration::from_millis(self.upstream_timeout_ms),
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
            cancel_grace: Duration::from_millis(self.cancel_grace_ms),
            engine_idle: Duration::from_millis(self.engine_idle_timeout_ms),
        })
    }
}

impl Routing {
    fn check(&self) -> Result<(Builtin, HealthConfig), ConfigError> {
        let routing = match Builtin::parse(&self.policy) {
            Some(Builtin::CacheAware(_)) => Builtin::CacheAware(self.cache.params()?),
            Some(b) => b,
            None => {
                return Err(err(
                    "routing.policy",
                    format!("{:?} is not one of {}", self.policy, Builtin::NAMES.join(", ")),
                ));
            }
        };
        for (field, v) in [
            ("routing.eject_after_failures", u64::from(self.eject_after_failures)),
            ("routing.health_check_interval_ms", self.health_check_interval_ms),
            ("routing.health_check_timeout_ms", self.health_check_timeout_ms),
        ] {
            if v == 0 {
                return Err(err(field, "must be greater than 0"));
            }
        }
        let health = HealthConfig {
            eject_after_failures: self.eject_after_failures,
            eject_for: Duration::from_millis(self.eject_ms),
            check_interval: Duration::from_millis(self.health_check_interval_ms),
            check_timeout: Duration::from_millis(self.health_check_timeout_ms),
            retries: self.retries.check()?,
        };
        Ok((routing, health))
    }
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
mod tests;
