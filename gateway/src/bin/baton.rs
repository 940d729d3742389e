//! `baton`: the PD gateway.
//!
//! `baton serve --config FILE`, `baton check-config FILE`, `baton plugin check FILE.wasm`, and with
//! the `demo` feature (on by default) `baton demo`. The command line is clap's: unknown flags are
//! refused, every subcommand has its own `--help`, `baton --version` says the version.

#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A line on stdout for the operator, while the gateway serves. `println!` panics when stdout
/// cannot be written (a pipe whose reader went away: a log shipper restarted, `| head`), and on a
/// signal that panic would come instead of the drain; a lost line is not a reason to stop.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// mimalloc instead of glibc's malloc: a proxy allocates and frees small buffers on every request
/// (headers, bodies, JSON), and glibc's `malloc`/`free` were a fifth of the gateway's CPU samples in
/// the proxy benchmark (`bench/README.md`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(name = "baton", version, about = "baton: a gateway for prefill/decode disaggregated LLM serving")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway from a TOML configuration (see configs/)
    Serve {
        /// The configuration file
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Validate a configuration (addresses, TLS files, geometry) and print what it describes
    CheckConfig {
        /// The configuration file
        file: PathBuf,
    },
    /// Policy plugins (WebAssembly components)
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
    /// The gateway in front of simulated prefill/decode engines on loopback (no GPU, no files)
    #[cfg(feature = "demo")]
    // Boxed: its flags make it far larger than the other commands.
    Demo(Box<demo::DemoArgs>),
}

#[derive(Debug, Subcommand)]
enum PluginCommand {
    /// Which policy world (admission or routing) a component implements, and whether it accepts a
    /// config table
    Check {
        /// The component
        file: PathBuf,
        /// A TOML table as [plugins.*.config] would pass it (default {})
        #[arg(long, value_name = "TABLE.toml")]
        config: Option<PathBuf>,
    },
}

async fn check(file: &Path) -> ExitCode {
    // Every engine and rank name must have an address now (the refresh follows it later).
    let loaded = match baton_gateway::config::load(file) {
        Ok(c) => {
            let names = baton_gateway::endpoints::Names::new(c.resolver.clone());
            c.resolve(&names).await.map(|found| (c, found))
        }
        Err(e) => Err(e),
    };
    match loaded {
        Ok((c, found)) => {
            println!("{}: ok", file.display());
            println!(
                "  model {} (context {} tokens, tokenizer: {})",
                c.model,
                c.context_length,
                c.tokenizer.describe()
            );
            println!("  routing {}, logs {:?} at {:?}", c.routing.name(), c.log.format, c.log.filter);
            if let Some(p) = &c.prefix {
                println!(
                    "  block index: {} KV-event feeds; engines without events keyed by {}-token blocks of what was routed to them, for {} s",
                    p.feeds.len(),
                    p.block_size,
                    p.routed_ttl.as_secs()
                );
                let names: Vec<&str> = c
                    .prefills
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .chain(c.decoders.iter().map(|d| d.name.as_str()))
                    .collect();
                for f in &p.feeds {
                    let name = names.get(f.engine).copied().unwrap_or("?");
                    let replay =
                        f.replay.as_deref().map_or(String::from("no replay"), |r| format!("replay {r}"));
                    println!("    {name} rank {}: {} topic {:?}, {replay}", f.rank, f.endpoint, f.topic);
                }
            }
            for w in &c.warnings {
                println!("  warning: {w}");
            }
            match &c.trace {
                Some(t) => println!(
                    "  traces to {} (OTLP/HTTP, {} of requests, service {:?})",
                    t.endpoint, t.sampling_ratio, t.service_name
                ),
                None => println!("  traces: off (no [telemetry] otlp_endpoint)"),
            }
            for (addr, tls) in &c.listeners {
                println!("  listener {addr} ({})", if tls.is_some() { "TLS" } else { "plain HTTP" });
            }
            match &c.keys {
                Some(k) => println!("  auth: {} API keys for {} tenants", k.len(), k.tenants()),
                None => {
                    println!("  auth: off (no [auth] keys_file): every request is served");
                    if let Some((addr, _)) = c.listeners.iter().find(|(a, _)| !a.ip().is_loopback()) {
                        println!(
                            "  warning: {addr} serves anyone who reaches it, and quotas see whatever bearer token a client sends: set [auth] keys_file"
                        );
                    }
                }
            }
            let a = &c.admin;
            let guard = match (a.token_sha256.is_some(), a.tls.as_ref().is_some_and(|t| t.client_auth())) {
                (true, true) => "bearer token and client certificates",
                (true, false) => "bearer token",
                (false, true) => "client certificates",
                (false, false) => "no authentication",
            };
            let scheme = if a.tls.is_some() { "TLS" } else { "plain HTTP" };
            println!("  admin listener {} ({scheme}, {guard}): /metrics, /admin/*", a.addr);
            if a.open() && !a.addr.ip().is_loopback() {
                println!(
                    "  warning: the admin listener on {} is open to the network with no authentication: set admin.token_sha256 or admin.client_ca",
                    a.addr
                );
            }
            for (name, http) in &c.prefills {
                println!("  prefill {name} at {http}");
            }
            if let Some(a) = c.lmcache_listen {
                println!("  lmcache notifications on {a} (first token from prefill: {})", c.first_token);
            }
            for d in &c.decoders {
                println!("  decode {} at {}: {}", d.name, d.http, d.mode.describe());
            }
            match &c.flow {
                Some(f) => println!("  flow control: {}", f.describe()),
                None => println!("  flow control: off (each decoder's own queue, first come first served)"),
            }
            match &c.cluster {
                Some(k) => println!("  cluster: {}", k.describe()),
                None => println!("  cluster: off (this replica counts only its own slots: run one replica)"),
            }
            let servers = if c.resolver.nameservers.is_empty() {
                "the system's DNS servers".to_owned()
            } else {
                format!("{:?}", c.resolver.nameservers)
            };
            for (field, name, ips) in &found {
                println!(
                    "  {field}: {name} resolves to {ips:?} ({servers}, looked up every {:?})",
                    c.resolver.refresh
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}: {e}", file.display());
            ExitCode::FAILURE
        }
    }
}

async fn serve(file: &Path) -> ExitCode {
    let checked = match baton_gateway::config::load(file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}: {e}", file.display());
            return ExitCode::FAILURE;
        }
    };
    checked.log.install();
    let signals = match signals() {
        Ok(s) => s,
        Err(code) => return code,
    };
    let serving = match baton_gateway::serve::start(checked).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("baton serve: {e}");
            return ExitCode::FAILURE;
        }
    };
    for a in &serving.addrs {
        say!("baton: serving on {a}");
    }
    say!("baton: admin (/metrics, /admin/*) on {}", serving.admin_addr);
    let timeout = serving.drain_timeout;
    drain_on_signal(signals, serving.drain(), timeout).await
}

/// SIGTERM and SIGINT, listened for from the start so that a second one is caught too.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self { term: signal(SignalKind::terminate())?, int: signal(SignalKind::interrupt())? })
    }

    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// SIGTERM and SIGINT, listened for before anything starts: a signal sent as soon as the process
/// says where it listens is a drain, not the default action's kill.
fn signals() -> Result<Signals, ExitCode> {
    Signals::new().map_err(|e| {
        eprintln!("baton: cannot listen for signals: {e}");
        ExitCode::FAILURE
    })
}

/// Waits for SIGTERM or SIGINT, then runs `drain` (exit 0 when it is done); a second signal during
/// the drain exits at once with 130.
async fn drain_on_signal(
    mut signals: Signals,
    drain: impl std::future::Future<Output = ()>,
    timeout: std::time::Duration,
) -> ExitCode {
    let sig = signals.next().await;
    say!("baton: {sig}: draining (requests in flight have {timeout:?}); a second signal stops at once");
    tokio::select! {
        () = drain => {
            say!("baton: drained");
            ExitCode::SUCCESS
        }
        sig = signals.next() => {
            say!("baton: {sig} again: stopping now");
            ExitCode::from(130)
        }
    }
}

fn plugin_check(file: &Path, config: Option<&Path>) -> ExitCode {
    let config = match config {
        None => "{}".to_owned(),
        Some(f) => match std::fs::read_to_string(f)
            .map_err(|e| e.to_string())
            .and_then(|t| toml::from_str::<toml::Table>(&t).map_err(|e| e.to_string()))
            .and_then(|t| serde_json::to_string(&t).map_err(|e| e.to_string()))
        {
            Ok(j) => j,
            Err(e) => {
                eprintln!("baton plugin check: --config {}: {e}", f.display());
                return ExitCode::from(2);
            }
        },
    };
    match baton_gateway::policy::check_component(file, &config) {
        Ok(r) => {
            println!("{}: implements baton:policy/{}@{}", file.display(), r.world.name(), r.wit);
            println!(
                "  sha256 {} ({} bytes, compiled or read from the cache in {:?})",
                r.sha256, r.bytes, r.compile
            );
            println!("  config accepted: {config}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}: {e}", file.display());
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // One core: tokio's current-thread scheduler (`baton_gateway::serve::runtime`).
    match baton_gateway::serve::runtime() {
        Ok(rt) => rt.block_on(run(cli)),
        Err(e) => {
            eprintln!("the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Serve { config } => serve(&config).await,
        Command::CheckConfig { file } => check(&file).await,
        Command::Plugin { command: PluginCommand::Check { file, config } } => {
            plugin_check(&file, config.as_deref())
        }
        #[cfg(feature = "demo")]
        Command::Demo(args) => demo::run(*args).await,
    }
}

#[cfg(feature = "demo")]
mod demo {
    use std::net::SocketAddr;
    use std::path::PathBuf;
    use std::process::ExitCode;
    use std::sync::Arc;
    use std::time::Duration;

    use baton_gateway::demo::{
        DEFAULT_DEMO_LISTEN, DEMO_CACHE_BLOCKS, DEMO_PAGES, DemoConfig, DeviceKind, start,
    };
    use baton_gateway::handoff::Mode;
    use baton_gateway::routing::Builtin;
    use baton_gateway::telemetry::LogConfig;
    use baton_gateway::tokenize::Tokenizer;

    /// `baton demo`'s flags.
    #[derive(Debug, clap::Args)]
    pub(super) struct DemoArgs {
        /// Where the gateway listens
        #[arg(long, default_value = DEFAULT_DEMO_LISTEN)]
        listen: SocketAddr,
        /// Where /metrics and /admin/* are served
        #[arg(long, default_value = baton_gateway::config::DEFAULT_ADMIN_LISTEN)]
        admin_listen: SocketAddr,
        /// On SIGTERM or SIGINT, how long requests in flight may run before they are cut, ms
        #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
        drain_timeout_ms: u64,
        /// Prefill engines
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
        prefill: u64,
        /// Decode engines
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
        decode: u64,
        /// Tensor-parallel ranks per decode engine
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
        tp: u32,
        /// PD buffer pages per decoder rank (the default holds the model's whole context)
        #[arg(long, default_value_t = DEMO_PAGES, value_parser = clap::value_parser!(u32).range(1..))]
        pages: u32,
        /// Engine cache blocks per rank (16 tokens each)
        #[arg(long, default_value_t = DEMO_CACHE_BLOCKS, value_parser = clap::value_parser!(u32).range(1..))]
        cache_blocks: u32,
        /// Tokens per KV chunk (page)
        #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
        chunk_tokens: u32,
        /// Time per generated token, ms
        #[arg(long, default_value_t = 0)]
        token_delay_ms: u64,
        /// Count with DIR/tokenizer.json and DIR/tokenizer_config.json's chat template
        #[arg(long, value_name = "DIR")]
        tokenizer: Option<PathBuf>,
        /// Routing policy
        #[arg(long, value_parser = routing, default_value = "kv-aware")]
        routing: Builtin,
        /// Make each engine a prefix cache of N blocks publishing vLLM-format KV events, which the
        /// gateway subscribes to (with --routing cache-aware, it routes by them)
        #[arg(long, value_name = "N")]
        prefix_cache_blocks: Option<usize>,
        /// With --prefix-cache-blocks: a prefill's fixed time, ms
        #[arg(long, value_name = "MS", default_value_t = 0, requires = "prefix_cache_blocks")]
        prefill_fixed_ms: u64,
        /// With --prefix-cache-blocks: a prefill's time per prompt token not cached, µs
        #[arg(long, value_name = "US", default_value_t = 0, requires = "prefix_cache_blocks")]
        prefill_us_per_token: u64,
        /// With --prefix-cache-blocks: prefills an engine computes at once, later ones queue (0: no
        /// limit)
        #[arg(long, value_name = "N", default_value_t = 0, requires = "prefix_cache_blocks")]
        prefill_lanes: usize,
        /// Log format: text or json
        #[arg(long, value_name = "FORMAT")]
        log_format: Option<String>,
        /// How the KV reaches the decoders (the engines speak that protocol)
        #[arg(long, value_parser = handoff, default_value = "native")]
        handoff: Mode,
        /// Where the engines keep their caches and PD buffers: cpu or cuda (GPU 0)
        #[arg(long, value_parser = device, default_value = "cpu")]
        device: DeviceKind,
        /// Trace requests to this OpenTelemetry collector (OTLP/HTTP), e.g. http://127.0.0.1:4318
        #[arg(long, value_name = "URL")]
        otlp_endpoint: Option<String>,
        /// With --otlp-endpoint: the share of requests traced, 0 to 1
        #[arg(long, default_value_t = baton_gateway::telemetry::trace::DEFAULT_SAMPLING_RATIO, requires = "otlp_endpoint")]
        sampling_ratio: f64,
        /// With --otlp-endpoint: the spans' service.name
        #[arg(long, default_value = baton_gateway::telemetry::trace::DEFAULT_SERVICE_NAME, requires = "otlp_endpoint")]
        service_name: String,
    }

    fn routing(s: &str) -> Result<Builtin, String> {
        Builtin::parse(s).ok_or_else(|| format!("not one of {}", Builtin::NAMES.join(", ")))
    }

    fn handoff(s: &str) -> Result<Mode, String> {
        Mode::parse(s).ok_or_else(|| {
            format!("not one of {}", Mode::ALL.iter().map(|m| m.name()).collect::<Vec<_>>().join(", "))
        })
    }

    fn device(s: &str) -> Result<DeviceKind, String> {
        DeviceKind::parse(s).ok_or_else(|| "not cpu or cuda".to_owned())
    }

    impl DemoArgs {
        fn config(self) -> Result<DemoConfig, String> {
            let mut c = DemoConfig {
                listen: self.listen,
                prefills: usize::try_from(self.prefill).map_err(|e| e.to_string())?,
                decoders: usize::try_from(self.decode).map_err(|e| e.to_string())?,
                tp: self.tp,
                pages: self.pages,
                cache_blocks: self.cache_blocks,
                chunk_tokens: self.chunk_tokens,
                token_delay: Duration::from_millis(self.token_delay_ms),
                handoff: self.handoff,
                device: self.device,
                ..DemoConfig::default()
            };
            if let Some(dir) = self.tokenizer {
                let t =
                    Tokenizer::load(&dir.join("tokenizer.json"), Some(&dir.join("tokenizer_config.json")))
                        .map_err(|e| format!("--tokenizer: {e}"))?;
                c.gateway.tokenizer = Some(Arc::new(t));
            }
            c.gateway.routing = self.routing;
            c.prefix_cache = self.prefix_cache_blocks.map(|blocks| baton_sim::cache::CacheConfig {
                blocks,
                block_size: baton_sim::DEFAULT_SIM_BLOCK_SIZE,
                prefill_fixed: Duration::from_millis(self.prefill_fixed_ms),
                prefill_per_token: Duration::from_micros(self.prefill_us_per_token),
                prefill_lanes: self.prefill_lanes,
                events: Some(baton_sim::cache::EventsConfig {
                    listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                    replay: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
                    topic: String::new(),
                }),
            });
            if let Some(endpoint) = self.otlp_endpoint {
                let t = baton_gateway::telemetry::trace::TraceConfig {
                    endpoint,
                    sampling_ratio: self.sampling_ratio,
                    service_name: self.service_name,
                };
                t.check().map_err(|(field, reason)| format!("--{}: {reason}", field.replace('_', "-")))?;
                c.gateway.trace = Some(t);
            }
            c.gateway.admin_listen = Some(self.admin_listen);
            LogConfig::parse(self.log_format.as_deref(), None)
                .map_err(|(_, reason)| format!("--log-format: {reason}"))?
                .install();
            Ok(c)
        }
    }

    pub(super) async fn run(args: DemoArgs) -> ExitCode {
        let drain_timeout = Duration::from_millis(args.drain_timeout_ms);
        let config = match args.config() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("baton demo: {e}");
                return ExitCode::from(2);
            }
        };
        let signals = match super::signals() {
            Ok(s) => s,
            Err(code) => return code,
        };
        let demo = match start(config.clone()).await {
            Ok(d) => d,
            Err(e) => {
                eprintln!("baton demo: {e}");
                return ExitCode::FAILURE;
            }
        };
        say!(
            "baton demo: gateway on http://{} in front of {} prefill and {} decode simulated engines (TP {}, {} pages per rank, {} handoff)",
            demo.addr,
            config.prefills,
            config.decoders,
            config.tp,
            config.pages,
            config.handoff.name()
        );
        say!("baton demo: admin (/metrics, /admin/*) on {}", demo.admin);
        say!(
            "try:\n  curl -s http://{}/v1/completions -H 'content-type: application/json' -d '{{\"model\":\"baton-sim\",\"prompt\":\"hello\",\"max_tokens\":8}}'",
            demo.addr
        );
        say!(
            "  curl -s http://{}/admin/decoders    # the admin listener: /metrics, /admin/*\nCtrl-C stops it.",
            demo.admin
        );
        super::drain_on_signal(signals, demo.drain(drain_timeout), drain_timeout).await
    }
}
