//! `baton-sim`: a simulated prefill or decode engine (OpenAI-compatible HTTP, real data plane).
//!
//! ```text
//! baton-sim --role decode  --listen 127.0.0.1:8200 --tp 2 --pages 64
//! baton-sim --role prefill --listen 127.0.0.1:8100 --tp 2
//! ```
//! On start it prints one JSON line with its HTTP address and, for a decoder, each rank's data-plane
//! address; `GET /sim/stats` says the same and more.

#![allow(clippy::print_stdout)]

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use baton_dataplane::KvGeometry;
use baton_dataplane::buffer::DEFAULT_QUARANTINE_TTL;
use baton_dataplane::device::any::DeviceKind;
use baton_sim::faults::FaultConfig;
use baton_sim::nixl::DEFAULT_NIXL_ABORT_TIMEOUT;
use baton_sim::prefill::DEFAULT_PRODUCER_HOLD_TTL;
use baton_sim::sglang::DEFAULT_ROOM_WAIT;
use baton_sim::{
    DEFAULT_SIM_BLOCK_SIZE, DEFAULT_SIM_CACHE_BLOCKS, DEFAULT_SIM_PAGES, DpTls, LmcacheSimConfig,
    SglangSimConfig, SimConfig, SimRole, launch, tiny_geometry,
};
use clap::Parser;

/// The flags. Where a default is the library's, the field takes the library's constant or is an
/// `Option` that leaves `SimConfig::new`'s value alone, so the binary cannot drift from the library
/// (for those `Option`s the help text repeats the value).
#[derive(Debug, Parser)]
#[command(
    name = "baton-sim",
    about = "A simulated prefill or decode engine: OpenAI-compatible HTTP in front of baton's real data plane",
    after_help = "On start it prints one JSON line with its HTTP address and, for a decoder, each rank's \
                  data-plane address; GET /sim/stats says the same and more."
)]
struct Cli {
    /// Which side of the PD pair this engine plays
    #[arg(long, value_enum)]
    role: Role,
    /// HTTP listen address (default 127.0.0.1:0, an ephemeral port)
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Model name the engine answers to (default baton-sim)
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// Tensor-parallel ranks
    #[arg(long, value_name = "N", default_value_t = 1)]
    tp: u32,
    /// KV geometry: the built-in tiny model, or a Hugging Face config.json to derive it from
    #[arg(long, value_name = "tiny|CONFIG.json", default_value = "tiny")]
    geometry: String,
    /// Tokens per KV chunk (page)
    #[arg(long, value_name = "N", default_value_t = 16)]
    chunk_tokens: u32,
    /// Decode: PD buffer pages per rank
    #[arg(long, value_name = "N", default_value_t = DEFAULT_SIM_PAGES)]
    pages: u32,
    /// Engine cache blocks per rank
    #[arg(long, value_name = "N", default_value_t = DEFAULT_SIM_CACHE_BLOCKS,
          value_parser = clap::value_parser!(u32).range(1..))]
    cache_blocks: u32,
    /// Tokens per engine cache block
    #[arg(long, value_name = "N", default_value_t = DEFAULT_SIM_BLOCK_SIZE,
          value_parser = clap::value_parser!(u32).range(1..))]
    block_size: u32,
    /// Time per generated token, microseconds
    #[arg(long, value_name = "N", default_value_t = 0)]
    token_delay_us: u64,
    /// Decode: the IP the ranks' data-plane servers listen on (default 127.0.0.1)
    #[arg(long, value_name = "IP")]
    dp_host: Option<IpAddr>,
    /// Decode: rank r's data plane listens on BASE + r (ephemeral ports if not given)
    #[arg(long, value_name = "BASE")]
    dp_port: Option<u16>,
    /// Decode: how long cancelled pages stay quarantined when the producer never fences, ms
    #[arg(long, value_name = "N", default_value_t = millis(DEFAULT_QUARANTINE_TTL))]
    quarantine_ms: u64,
    /// Decode: whether a decode request that arrives before its KV waits for it (said to the
    /// gateway in the ranks' Welcome); `false` plays an engine that cannot
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    decode_waits: bool,
    /// Prefill: how long a request's KV blocks wait for the decoder to take them, ms
    #[arg(long, value_name = "N", default_value_t = millis(DEFAULT_PRODUCER_HOLD_TTL))]
    hold_ttl_ms: u64,
    /// Fault switches as a JSON object (crash a rank, drop a readiness event, stall a chunk, slow a rank)
    #[arg(long, value_name = "JSON", value_parser = faults)]
    faults: Option<FaultConfig>,
    /// Also speak LMCache's PD backend (any --lmcache-* flag turns it on too)
    #[arg(long)]
    lmcache: bool,
    /// LMCache decode: PD buffer bytes per rank (default: room for --pages pages)
    #[arg(long, value_name = "BYTES")]
    lmcache_buffer: Option<u64>,
    /// LMCache decode: each rank's alloc port, comma-separated (ephemeral if not given)
    #[arg(long, value_name = "P,P", value_parser = ports)]
    lmcache_alloc_ports: Option<Ports>,
    /// LMCache decode: each rank's init port, comma-separated (ephemeral if not given)
    #[arg(long, value_name = "P,P", value_parser = ports)]
    lmcache_init_ports: Option<Ports>,
    /// LMCache prefill: where to push notifications
    #[arg(long, value_name = "ADDR")]
    lmcache_proxy: Option<SocketAddr>,
    /// LMCache prefill: answer before the chunks are written (LMCache's asynchronous PD backend)
    #[arg(long)]
    lmcache_async: bool,
    /// Also speak vLLM's NIXL connector (--nixl-abort-timeout-s turns it on too)
    #[arg(long)]
    nixl: bool,
    /// NIXL prefill: seconds the producer keeps blocks nobody read (default 480)
    #[arg(long, value_name = "N")]
    nixl_abort_timeout_s: Option<u64>,
    /// Also speak SGLang's PD mode (any --sglang-* flag turns it on too)
    #[arg(long)]
    sglang: bool,
    /// SGLang prefill: the bootstrap server's port (ephemeral if not given)
    #[arg(long, value_name = "P")]
    sglang_bootstrap_port: Option<u16>,
    /// SGLang: how long a room waits for its other leg, ms (default 10000)
    #[arg(long, value_name = "N")]
    sglang_room_wait_ms: Option<u64>,
    /// Where the cache and PD buffer live: cpu or cuda (GPU 0)
    #[arg(long, value_name = "cpu|cuda", value_parser = device, default_value = "cpu")]
    device: DeviceKind,
    /// Data-plane mTLS: the CA whose certificates peers must present
    #[arg(long, value_name = "CA.pem", requires_all = ["dp_tls_cert", "dp_tls_key"])]
    dp_tls_ca: Option<PathBuf>,
    /// Data-plane mTLS: this engine's certificate, served by decode ranks and presented by a prefiller
    #[arg(long, value_name = "CERT.pem", requires_all = ["dp_tls_ca", "dp_tls_key"])]
    dp_tls_cert: Option<PathBuf>,
    /// Data-plane mTLS: the key of --dp-tls-cert
    #[arg(long, value_name = "KEY.pem", requires_all = ["dp_tls_ca", "dp_tls_cert"])]
    dp_tls_key: Option<PathBuf>,
    /// Data-plane mTLS: the name a prefiller checks that decode ranks present
    #[arg(long, value_name = "NAME", default_value = "localhost")]
    dp_tls_server_name: String,
    /// Derive and check no KV (pages move as zeros): an engine that costs only its protocol, for
    /// measuring a proxy in front of it
    #[arg(long)]
    neutral: bool,
    /// Model a prefix cache of N blocks (LRU): a prefill costs --prefill-fixed-ms plus
    /// --prefill-us-per-token for each token not cached, and usage reports cached_tokens
    #[arg(long, value_name = "N")]
    prefix_cache_blocks: Option<usize>,
    /// With --prefix-cache-blocks: a prefill's fixed time, ms
    #[arg(long, value_name = "MS", default_value_t = 0)]
    prefill_fixed_ms: u64,
    /// With --prefix-cache-blocks: a prefill's time per token not cached, µs
    #[arg(long, value_name = "US", default_value_t = 0)]
    prefill_us_per_token: u64,
    /// With --prefix-cache-blocks: prefills computed at once, later ones queue (0: no limit)
    #[arg(long, value_name = "N", default_value_t = 0)]
    prefill_lanes: usize,
    /// With --prefix-cache-blocks: publish KV events as vLLM does (ZeroMQ PUB) on ADDR
    #[arg(long, value_name = "ADDR", requires = "prefix_cache_blocks")]
    kv_events: Option<SocketAddr>,
    /// With --kv-events: the replay socket (ZeroMQ ROUTER) on ADDR
    #[arg(long, value_name = "ADDR", requires = "kv_events")]
    kv_events_replay: Option<SocketAddr>,
    /// With --kv-events: the topic (vLLM's default: empty)
    #[arg(long, value_name = "TOPIC", default_value = "", requires = "kv_events")]
    kv_events_topic: String,
}

/// `--role`: clap's own enum, as the library's `SimRole` knows nothing of clap.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Role {
    /// Computes the prompt's KV and writes it to the decoder's ranks
    Prefill,
    /// Receives the KV into its PD buffer and generates the tokens
    Decode,
}

/// A comma-separated port list. A newtype because clap reads a bare `Vec` as a repeated flag.
#[derive(Clone, Debug)]
struct Ports(Vec<u16>);

fn ports(v: &str) -> Result<Ports, String> {
    v.split(',')
        .map(|p| p.trim().parse().map_err(|_| format!("not a port list: {v:?}")))
        .collect::<Result<_, _>>()
        .map(Ports)
}

fn faults(v: &str) -> Result<FaultConfig, String> {
    serde_json::from_str(v).map_err(|e| e.to_string())
}

fn device(v: &str) -> Result<DeviceKind, String> {
    DeviceKind::parse(v).ok_or_else(|| "not cpu or cuda".to_owned())
}

/// A default duration in whole milliseconds, saturating where it would not fit.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Cli {
    /// The engine's configuration: what clap could not check (the geometry file, the TLS files,
    /// defaults that depend on other flags) is checked here.
    fn config(self) -> Result<SimConfig, String> {
        let role = match self.role {
            Role::Prefill => SimRole::Prefill,
            Role::Decode => SimRole::Decode,
        };
        let (tp, chunk) = (self.tp, self.chunk_tokens);
        let geometry = match self.geometry.as_str() {
            "tiny" => {
                let g = tiny_geometry(tp).map_err(|e| e.to_string())?;
                KvGeometry::new(g.layers, g.kv_heads, g.head_dim, g.dtype_bytes, chunk, tp)
                    .map_err(|e| e.to_string())?
            }
            path => {
                let json = std::fs::read_to_string(path).map_err(|e| format!("--geometry {path}: {e}"))?;
                KvGeometry::from_hf_config(&json, chunk, tp, None)
                    .map_err(|e| format!("--geometry {path}: {e}"))?
            }
        };
        let mut c = SimConfig::new(role, geometry);
        if let Some(blocks) = self.prefix_cache_blocks {
            c.prefix_cache = Some(baton_sim::cache::CacheConfig {
                blocks,
                block_size: c.block_size,
                prefill_fixed: Duration::from_millis(self.prefill_fixed_ms),
                prefill_per_token: Duration::from_micros(self.prefill_us_per_token),
                prefill_lanes: self.prefill_lanes,
                events: self.kv_events.map(|listen| baton_sim::cache::EventsConfig {
                    listen,
                    replay: self.kv_events_replay,
                    topic: self.kv_events_topic.clone(),
                }),
            });
        }
        if let Some(l) = self.listen {
            c.listen = l;
        }
        if let Some(m) = self.model {
            c.model = m;
        }
        if let Some(h) = self.dp_host {
            c.dp_host = h;
        }
        c.dp_base_port = self.dp_port;
        // clap's `requires_all` has made sure the three come together or not at all.
        if let (Some(ca), Some(cert), Some(key)) = (&self.dp_tls_ca, &self.dp_tls_cert, &self.dp_tls_key) {
            let tls = DpTls::from_pem_files(ca, cert, key, &self.dp_tls_server_name)
                .map_err(|e| format!("--dp-tls-*: {e}"))?;
            c.dp_tls = Some(tls);
        }
        c.pages = self.pages;
        c.cache_blocks = self.cache_blocks;
        c.block_size = self.block_size;
        c.token_delay = Duration::from_micros(self.token_delay_us);
        c.quarantine_ttl = Duration::from_millis(self.quarantine_ms);
        c.decode_waits = self.decode_waits;
        c.hold_ttl = Duration::from_millis(self.hold_ttl_ms);
        // Each protocol is on when any of its flags is given, as scripts have always relied on
        // (`--lmcache-proxy ADDR` alone makes an LMCache prefiller).
        let lmcache = self.lmcache
            || self.lmcache_buffer.is_some()
            || self.lmcache_alloc_ports.is_some()
            || self.lmcache_init_ports.is_some()
            || self.lmcache_proxy.is_some()
            || self.lmcache_async;
        if lmcache {
            c.lmcache = Some(LmcacheSimConfig {
                pd_buffer_bytes: self
                    .lmcache_buffer
                    .unwrap_or_else(|| u64::from(c.pages) * c.geometry.page_bytes_per_rank()),
                alloc_ports: self.lmcache_alloc_ports.map(|p| p.0).unwrap_or_default(),
                init_ports: self.lmcache_init_ports.map(|p| p.0).unwrap_or_default(),
                proxy: self.lmcache_proxy,
                async_send: self.lmcache_async,
            });
        }
        if self.nixl || self.nixl_abort_timeout_s.is_some() {
            let secs = self.nixl_abort_timeout_s.unwrap_or(DEFAULT_NIXL_ABORT_TIMEOUT.as_secs());
            c.nixl = Some(Duration::from_secs(secs));
        }
        if self.sglang || self.sglang_bootstrap_port.is_some() || self.sglang_room_wait_ms.is_some() {
            c.sglang = Some(SglangSimConfig {
                bootstrap_port: self.sglang_bootstrap_port,
                room_wait: self.sglang_room_wait_ms.map_or(DEFAULT_ROOM_WAIT, Duration::from_millis),
                ..SglangSimConfig::default()
            });
        }
        c.device = self.device;
        if let Some(f) = self.faults {
            c.faults = f;
        }
        Ok(c)
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // On a bad flag clap prints the error and usage and exits 2; on --help it exits 0.
    let cli = Cli::parse();
    if cli.neutral {
        baton_sim::kv::set_neutral(true);
    }
    let config = match cli.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("baton-sim: {e}\n(see baton-sim --help)");
            return ExitCode::from(2);
        }
    };
    let running = match launch(config).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("baton-sim: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut hello = running.engine.stats();
    if let Some(o) = hello.as_object_mut() {
        o.insert("listen".into(), serde_json::Value::String(running.addr.to_string()));
    }
    println!("{hello}");
    let _ = tokio::signal::ctrl_c().await;
    running.shutdown().await;
    ExitCode::SUCCESS
}
