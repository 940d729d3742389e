//! `baton serve`: a checked configuration brought up: decoders connected (their buffer sizes read
//! from the data plane), every listener bound.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::Notify;

use crate::admission::QueueConfig;
use crate::config::Checked;
use crate::handoff::decoder::DecoderHandle;
use crate::handoff::{Native, Prefiller};
use crate::routing::Router;
use crate::server::{Gateway, HttpTimeouts, ModelInfo};

/// A serving gateway.
#[derive(Debug)]
pub struct Serving {
    pub addrs: Vec<SocketAddr>,
    pub gateway: Arc<Gateway>,
    stop: Vec<Arc<Notify>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    health: tokio::task::JoinHandle<()>,
    watcher: Option<tokio::task::JoinHandle<()>>,
}

impl Serving {
    pub async fn shutdown(self) {
        self.health.abort();
        if let Some(w) = &self.watcher {
            w.abort();
        }
        for s in &self.stop {
            s.notify_one();
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Connects and binds everything the configuration names.
pub async fn start(c: Checked) -> Result<Serving, String> {
    let mut decoders = Vec::new();
    for d in c.decoders {
        let queue = QueueConfig { max_queue: c.max_queue, ..QueueConfig::default() };
        if let Some(t) = d.nixl {
            decoders.push(DecoderHandle::nixl(d.name, d.http, t, queue));
            continue;
        }
        if let Some(lm) = d.lmcache {
            let capacity = d.max_slots.map_or(lm.capacity, |m| m.min(lm.capacity));
            decoders.push(DecoderHandle::lmcache(d.name, d.http, lm.target, capacity, lm.chunk_size, queue));
            continue;
        }
        let (g, name) = (d.geometry, d.name);
        let d = DecoderHandle::connect(
            name.clone(),
            d.http,
            d.ranks,
            g.fingerprint(),
            g.chunk_tokens,
            d.max_slots,
            queue,
        )
        .await
        .map_err(|e| format!("decoder {name}: data plane: {e}"))?;
        decoders.push(d);
    }
    let prefills = c.prefills.into_iter().map(|(name, http)| Prefiller::new(name, http)).collect();
    if !c.tokenizer.is_exact() {
        tracing::warn!(
            "model {} has no tokenizer configured: prompts are counted by the byte-level upper bound, which over-counts slots",
            c.model
        );
    }
    let model = ModelInfo { name: c.model, context_length: c.context_length, tokenizer: c.tokenizer };
    let mut native = Native::new(c.limits);
    native.health = c.health;
    native.first_token = c.first_token;
    if let Some(addr) = c.lmcache_listen {
        let at = native.listen_lmcache(addr).await?;
        tracing::info!(%at, "listening for LMCache prefill notifications");
    }
    let plugins = match &c.plugins {
        Some(p) => Some(crate::policy::Plugins::start(p, c.tenants.clone(), c.source.clone())?),
        None => None,
    };
    let watcher = plugins.as_ref().map(crate::policy::Plugins::spawn_watcher);
    let gateway = Gateway::new(
        model,
        prefills,
        decoders,
        native,
        Router::new(c.routing),
        HttpTimeouts::default(),
        plugins,
    );
    let health_task = gateway.start_health_checks();
    let (mut addrs, mut stop, mut tasks) = (Vec::new(), Vec::new(), Vec::new());
    for (addr, tls) in c.listeners {
        let listener = crate::server::bind(addr).await.map_err(|e| format!("listen on {addr}: {e}"))?;
        addrs.push(listener.local_addr().map_err(|e| e.to_string())?);
        let s = Arc::new(Notify::new());
        tasks.push(tokio::spawn(Arc::clone(&gateway).serve(listener, tls, Arc::clone(&s))));
        stop.push(s);
    }
    Ok(Serving { addrs, gateway, stop, tasks, health: health_task, watcher })
}
