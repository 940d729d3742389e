//! `baton`: the PD gateway.
//!
//! `baton serve --config FILE`, `baton check-config FILE`, `baton plugin check FILE.wasm`, `baton demo`.

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Duration;

use baton_gateway::demo::{DEFAULT_DEMO_LISTEN, DemoConfig, DemoHandoff, start};
use baton_gateway::routing::Builtin;
use baton_gateway::telemetry::LogConfig;
use baton_gateway::tokenize::Tokenizer;

const USAGE: &str = "usage: baton serve --config FILE
       baton check-config FILE
       baton plugin check FILE.wasm [--config TABLE.toml]
       baton demo [--listen ADDR] [--prefill N] [--decode N] [--tp N] [--pages N] [--chunk-tokens N] [--token-delay-ms N]
                  [--tokenizer DIR] [--routing round-robin|least-loaded|kv-aware] [--log-format text|json]
                  [--handoff native|lmcache|vllm-nixl] [--device cpu|cuda]

  serve          run the gateway from a TOML configuration (see configs/)
  check-config   validate a configuration (addresses, TLS files, geometry) and print what it describes
  plugin check   which policy world (admission or routing) a component implements, and whether it
                 accepts the config table in TABLE.toml (as [plugins.*.config] would pass it; default {})
  demo           the gateway in front of simulated prefill/decode engines on loopback (no GPU, no files);
                 --tokenizer DIR counts with DIR/tokenizer.json and DIR/tokenizer_config.json's chat template;
                 --handoff lmcache runs the engines as vLLM with LMCache's PD backend (ZMQ side channels),
                 --handoff vllm-nixl as vLLM with its NIXL connector (the decoder pulls);
                 --device cuda keeps the engines' caches and PD buffers on GPU 0 (gather/scatter kernels)";

fn check(file: &str) -> ExitCode {
    match baton_gateway::config::load(std::path::Path::new(file)) {
        Ok(c) => {
            println!("{file}: ok");
            println!(
                "  model {} (context {} tokens, tokenizer: {})",
                c.model,
                c.context_length,
                c.tokenizer.describe()
            );
            println!("  routing {}, logs {:?} at {:?}", c.routing.name(), c.log.format, c.log.filter);
            for (addr, tls) in &c.listeners {
                println!("  listener {addr} ({})", if tls.is_some() { "TLS" } else { "plain HTTP" });
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
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{file}: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(file: &str) -> ExitCode {
    let checked = match baton_gateway::config::load(std::path::Path::new(file)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{file}: {e}");
            return ExitCode::FAILURE;
        }
    };
    checked.log.install();
    let serving = match baton_gateway::serve::start(checked).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("baton serve: {e}");
            return ExitCode::FAILURE;
        }
    };
    for a in &serving.addrs {
        println!("baton: serving on {a}");
    }
    let _ = tokio::signal::ctrl_c().await;
    serving.shutdown().await;
    ExitCode::SUCCESS
}

fn flag(args: &[String], name: &str) -> Option<String> {
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

fn parse(args: &[String]) -> Result<DemoConfig, String> {
    let mut c = DemoConfig::default();
    let num = |name: &str, default: u64| -> Result<u64, String> {
        flag(args, name)
            .map_or(Ok(default), |v| v.parse().map_err(|_| format!("{name}: not a number: {v:?}")))
    };
    let listen = flag(args, "--listen").unwrap_or_else(|| DEFAULT_DEMO_LISTEN.to_owned());
    c.listen = listen.parse().map_err(|_| format!("--listen: not an address: {listen:?}"))?;
    c.prefills = usize::try_from(num("--prefill", 1)?).map_err(|e| e.to_string())?;
    c.decoders = usize::try_from(num("--decode", 1)?).map_err(|e| e.to_string())?;
    c.tp = u32::try_from(num("--tp", 1)?).map_err(|e| e.to_string())?;
    c.pages = u32::try_from(num("--pages", 64)?).map_err(|e| e.to_string())?;
    c.chunk_tokens = u32::try_from(num("--chunk-tokens", 16)?).map_err(|e| e.to_string())?;
    c.token_delay = Duration::from_millis(num("--token-delay-ms", 0)?);
    if let Some(dir) = flag(args, "--tokenizer") {
        let dir = std::path::Path::new(&dir);
        let t = Tokenizer::load(&dir.join("tokenizer.json"), Some(&dir.join("tokenizer_config.json")))
            .map_err(|e| format!("--tokenizer: {e}"))?;
        c.gateway.tokenizer = Some(std::sync::Arc::new(t));
    }
    if let Some(h) = flag(args, "--handoff") {
        c.handoff = DemoHandoff::parse(&h)
            .ok_or_else(|| format!("--handoff: {h:?} is not native, lmcache or vllm-nixl"))?;
    }
    if let Some(d) = flag(args, "--device") {
        c.device = baton_gateway::demo::DeviceKind::parse(&d)
            .ok_or_else(|| format!("--device: {d:?} is not cpu or cuda"))?;
    }
    if let Some(r) = flag(args, "--routing") {
        c.gateway.routing = Builtin::parse(&r)
            .ok_or_else(|| format!("--routing: {r:?} is not one of {}", Builtin::NAMES.join(", ")))?;
    }
    LogConfig::parse(flag(args, "--log-format").as_deref(), None)
        .map_err(|(_, reason)| format!("--log-format: {reason}"))?
        .install();
    if c.prefills == 0 || c.decoders == 0 || c.tp == 0 || c.pages == 0 || c.chunk_tokens == 0 {
        return Err("--prefill, --decode, --tp, --pages and --chunk-tokens must be at least 1".into());
    }
    Ok(c)
}

fn plugin_check(args: &[String]) -> ExitCode {
    let Some(file) = args.get(2).filter(|a| !a.starts_with("--")) else {
        eprintln!("baton plugin check: FILE.wasm is required\n{USAGE}");
        return ExitCode::from(2);
    };
    let config = match flag(args, "--config") {
        None => "{}".to_owned(),
        Some(f) => match std::fs::read_to_string(&f)
            .map_err(|e| e.to_string())
            .and_then(|t| toml::from_str::<toml::Table>(&t).map_err(|e| e.to_string()))
            .and_then(|t| serde_json::to_string(&t).map_err(|e| e.to_string()))
        {
            Ok(j) => j,
            Err(e) => {
                eprintln!("baton plugin check: --config {f}: {e}");
                return ExitCode::from(2);
            }
        },
    };
    match baton_gateway::policy::check_component(std::path::Path::new(file), &config) {
        Ok(r) => {
            println!("{file}: implements baton:policy/{}@0.1.0", r.world.name());
            println!(
                "  sha256 {} ({} bytes, compiled or read from the cache in {:?})",
                r.sha256, r.bytes, r.compile
            );
            println!("  config accepted: {config}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{file}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("demo") => {}
        Some("check-config") => {
            return match args.get(1) {
                Some(f) => check(f),
                None => {
                    eprintln!("{USAGE}");
                    ExitCode::from(2)
                }
            };
        }
        Some("plugin") if args.get(1).map(String::as_str) == Some("check") => return plugin_check(&args),
        Some("serve") => {
            return match flag(&args, "--config") {
                Some(f) => serve(&f).await,
                None => {
                    eprintln!("baton serve: --config FILE is required\n{USAGE}");
                    ExitCode::from(2)
                }
            };
        }
        Some("-h" | "--help") | None => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => {
            eprintln!("baton: unknown command {other:?}\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    let config = match parse(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("baton: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let demo = match start(config.clone()).await {
        Ok(d) => d,
        Err(e) => {
            eprintln!("baton demo: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "baton demo: gateway on http://{} in front of {} prefill and {} decode simulated engines (TP {}, {} pages per rank, {:?} handoff)",
        demo.addr, config.prefills, config.decoders, config.tp, config.pages, config.handoff
    );
    println!(
        "try:\n  curl -s http://{}/v1/completions -H 'content-type: application/json' -d '{{\"model\":\"baton-sim\",\"prompt\":\"hello\",\"max_tokens\":8}}'",
        demo.addr
    );
    println!("  curl -s http://{}/admin/decoders\nCtrl-C stops it.", demo.addr);
    let _ = tokio::signal::ctrl_c().await;
    demo.shutdown().await;
    ExitCode::SUCCESS
}
