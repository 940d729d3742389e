//! `baton-sim`: a simulated prefill or decode engine (OpenAI-compatible HTTP, real data plane).
//!
//! ```text
//! baton-sim --role decode  --listen 127.0.0.1:8200 --tp 2 --pages 64
//! baton-sim --role prefill --listen 127.0.0.1:8100 --tp 2
//! ```
//! On start it prints one JSON line with its HTTP address and, for a decoder, each rank's data-plane
//! address; `GET /sim/stats` says the same and more.

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Duration;

use baton_dataplane::KvGeometry;
use baton_dataplane::device::any::DeviceKind;
use baton_sim::faults::FaultConfig;
use baton_sim::nixl::DEFAULT_NIXL_ABORT_TIMEOUT;
use baton_sim::{LmcacheSimConfig, SimConfig, SimRole, launch, tiny_geometry};

const USAGE: &str = "usage: baton-sim --role prefill|decode [--listen ADDR] [--model NAME] [--tp N]
       [--geometry tiny|CONFIG.json] [--chunk-tokens N] [--pages N] [--cache-blocks N] [--block-size N]
       [--token-delay-us N] [--dp-host IP] [--dp-port BASE] [--quarantine-ms N] [--hold-ttl-ms N] [--faults JSON]
       [--lmcache] [--lmcache-buffer BYTES] [--lmcache-alloc-ports P,P] [--lmcache-init-ports P,P]
       [--lmcache-proxy ADDR] [--lmcache-async] [--nixl] [--nixl-abort-timeout-s N]
       [--sglang] [--sglang-bootstrap-port P] [--sglang-room-wait-ms N] [--device cpu|cuda]
       [--dp-tls-ca CA.pem --dp-tls-cert CERT.pem --dp-tls-key KEY.pem [--dp-tls-server-name NAME]]
       [--neutral]

  --lmcache*   also speak LMCache's PD backend: a decoder gets a PD buffer of BYTES per rank and
               alloc/init ports per rank (ephemeral if not given); a prefiller notifies ADDR
  --nixl       also speak vLLM's NIXL connector (producer keeps blocks N seconds unless read)
  --sglang*    also speak SGLang's PD mode: a prefiller runs a bootstrap server on P (ephemeral if
               not given); rooms wait N ms for their other leg
  --dp-tls-*   mTLS on baton's data plane: decode ranks serve TLS with CERT/KEY and require client
               certificates from CA; a prefiller connects with CERT/KEY and checks that ranks present
               NAME (default localhost)
  --neutral    derive and check no KV (pages move as zeros): an engine that costs only its protocol,
               for measuring a proxy in front of it";

fn parse() -> Result<SimConfig, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| -> Option<String> {
        let i = args.iter().position(|a| a == name)?;
        args.get(i + 1).cloned()
    };
    let num = |v: Option<String>, name: &str, default: u64| -> Result<u64, String> {
        v.map_or(Ok(default), |s| s.parse().map_err(|_| format!("{name}: not a number: {s:?}")))
    };
    let role = match get("--role").as_deref() {
        Some("prefill") => SimRole::Prefill,
        Some("decode") => SimRole::Decode,
        other => return Err(format!("--role must be prefill or decode, got {other:?}")),
    };
    let tp = u32::try_from(num(get("--tp"), "--tp", 1)?).map_err(|e| e.to_string())?;
    let chunk =
        u32::try_from(num(get("--chunk-tokens"), "--chunk-tokens", 16)?).map_err(|e| e.to_string())?;
    let geometry = match get("--geometry").as_deref() {
        None | Some("tiny") => {
            let g = tiny_geometry(tp).map_err(|e| e.to_string())?;
            KvGeometry::new(g.layers, g.kv_heads, g.head_dim, g.dtype_bytes, chunk, tp)
                .map_err(|e| e.to_string())?
        }
        Some(path) => {
            let json = std::fs::read_to_string(path).map_err(|e| format!("--geometry {path}: {e}"))?;
            KvGeometry::from_hf_config(&json, chunk, tp, None)
                .map_err(|e| format!("--geometry {path}: {e}"))?
        }
    };
    let mut c = SimConfig::new(role, geometry);
    if let Some(l) = get("--listen") {
        c.listen = l.parse().map_err(|_| format!("--listen: not an address: {l:?}"))?;
    }
    if let Some(m) = get("--model") {
        c.model = m;
    }
    if let Some(h) = get("--dp-host") {
        c.dp_host = h.parse().map_err(|_| format!("--dp-host: not an IP: {h:?}"))?;
    }
    if let Some(p) = get("--dp-port") {
        c.dp_base_port = Some(p.parse().map_err(|_| format!("--dp-port: not a port: {p:?}"))?);
    }
    match (get("--dp-tls-ca"), get("--dp-tls-cert"), get("--dp-tls-key")) {
        (Some(ca), Some(cert), Some(key)) => {
            let name = get("--dp-tls-server-name").unwrap_or_else(|| "localhost".into());
            let tls = baton_sim::DpTls::from_pem_files(ca.as_ref(), cert.as_ref(), key.as_ref(), &name)
                .map_err(|e| format!("--dp-tls-*: {e}"))?;
            c.dp_tls = Some(tls);
        }
        (None, None, None) => {}
        _ => return Err("--dp-tls-ca, --dp-tls-cert and --dp-tls-key go together".into()),
    }
    c.pages =
        u32::try_from(num(get("--pages"), "--pages", u64::from(c.pages))?).map_err(|e| e.to_string())?;
    c.cache_blocks = u32::try_from(num(get("--cache-blocks"), "--cache-blocks", u64::from(c.cache_blocks))?)
        .map_err(|e| e.to_string())?;
    c.block_size = u32::try_from(num(get("--block-size"), "--block-size", u64::from(c.block_size))?)
        .map_err(|e| e.to_string())?;
    c.token_delay = Duration::from_micros(num(get("--token-delay-us"), "--token-delay-us", 0)?);
    c.quarantine_ttl = Duration::from_millis(num(
        get("--quarantine-ms"),
        "--quarantine-ms",
        u64::try_from(c.quarantine_ttl.as_millis()).unwrap_or(u64::MAX),
    )?);
    c.hold_ttl = Duration::from_millis(num(
        get("--hold-ttl-ms"),
        "--hold-ttl-ms",
        u64::try_from(c.hold_ttl.as_millis()).unwrap_or(u64::MAX),
    )?);
    let ports = |name: &str| -> Result<Vec<u16>, String> {
        get(name).map_or(Ok(Vec::new()), |v| {
            v.split(',')
                .map(|p| p.trim().parse().map_err(|_| format!("{name}: not a port list: {v:?}")))
                .collect()
        })
    };
    if args.iter().any(|a| a.starts_with("--lmcache")) {
        let proxy = match get("--lmcache-proxy") {
            Some(p) => Some(p.parse().map_err(|_| format!("--lmcache-proxy: not an address: {p:?}"))?),
            None => None,
        };
        c.lmcache = Some(LmcacheSimConfig {
            pd_buffer_bytes: num(
                get("--lmcache-buffer"),
                "--lmcache-buffer",
                u64::from(c.pages) * c.geometry.page_bytes_per_rank(),
            )?,
            alloc_ports: ports("--lmcache-alloc-ports")?,
            init_ports: ports("--lmcache-init-ports")?,
            proxy,
            async_send: args.iter().any(|a| a == "--lmcache-async"),
        });
    }
    if args.iter().any(|a| a.starts_with("--nixl")) {
        c.nixl = Some(Duration::from_secs(num(
            get("--nixl-abort-timeout-s"),
            "--nixl-abort-timeout-s",
            DEFAULT_NIXL_ABORT_TIMEOUT.as_secs(),
        )?));
    }
    if args.iter().any(|a| a.starts_with("--sglang")) {
        let port = match get("--sglang-bootstrap-port") {
            Some(p) => Some(p.parse().map_err(|_| format!("--sglang-bootstrap-port: not a port: {p:?}"))?),
            None => None,
        };
        let wait = num(
            get("--sglang-room-wait-ms"),
            "--sglang-room-wait-ms",
            u64::try_from(baton_sim::sglang::DEFAULT_ROOM_WAIT.as_millis()).unwrap_or(u64::MAX),
        )?;
        c.sglang =
            Some(baton_sim::SglangSimConfig { bootstrap_port: port, room_wait: Duration::from_millis(wait) });
    }
    if let Some(d) = get("--device") {
        c.device = DeviceKind::parse(&d).ok_or_else(|| format!("--device: {d:?} is not cpu or cuda"))?;
    }
    if let Some(f) = get("--faults") {
        c.faults = serde_json::from_str::<FaultConfig>(&f).map_err(|e| format!("--faults: {e}"))?;
    }
    if c.block_size == 0 || c.cache_blocks == 0 {
        return Err("--block-size and --cache-blocks must be greater than 0".into());
    }
    Ok(c)
}

#[tokio::main]
async fn main() -> ExitCode {
    if std::env::args().any(|a| a == "--neutral") {
        baton_sim::kv::set_neutral(true);
    }
    let config = match parse() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("baton-sim: {e}\n{USAGE}");
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
