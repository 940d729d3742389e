//! `baton`: the PD gateway.
//!
//! This build has `baton demo`; `serve --config` and `check-config` arrive with the configuration
//! file (see the gateway issue).

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Duration;

use baton_gateway::demo::{DEFAULT_DEMO_LISTEN, DemoConfig, start};

const USAGE: &str =
    "usage: baton demo [--listen ADDR] [--prefill N] [--decode N] [--tp N] [--pages N] [--chunk-tokens N] [--token-delay-ms N]

  demo   the gateway in front of simulated prefill/decode engines on loopback (no GPU, no files)";

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
    if c.prefills == 0 || c.decoders == 0 || c.tp == 0 || c.pages == 0 || c.chunk_tokens == 0 {
        return Err("--prefill, --decode, --tp, --pages and --chunk-tokens must be at least 1".into());
    }
    Ok(c)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("demo") => {}
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
        "baton demo: gateway on http://{} in front of {} prefill and {} decode simulated engines (TP {}, {} pages per rank)",
        demo.addr, config.prefills, config.decoders, config.tp, config.pages
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
