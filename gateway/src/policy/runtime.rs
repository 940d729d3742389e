//! The gateway's plugins as configured: both worlds, the facts they are given, reload (admin call
//! and file watcher) and their metrics.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use hyper::HeaderMap;
use serde_json::{Value, json};

use super::{
    AdmissionPlugin, Clock, Fault, Host, LoadError, Plugin, PluginInfo, PolicyRequest, RoutingPlugin, World,
};
use crate::telemetry::family;

/// `[plugins]`, checked.
#[derive(Debug, Clone)]
pub struct CheckedPlugins {
    pub cache_dir: std::path::PathBuf,
    pub watch_interval: std::time::Duration,
    pub headers: Vec<String>,
    pub admission: Option<super::Spec>,
    pub routing: Option<super::Spec>,
}

/// What a reload reads again from the configuration: the plugins and the tenants.
pub type Reloaded = (Option<CheckedPlugins>, BTreeMap<String, String>);

/// Reads the plugins' part of the configuration again (for a reload); given by whoever loaded it.
pub struct Reread(pub Box<dyn Fn() -> Result<Reloaded, String> + Send + Sync>);

impl std::fmt::Debug for Reread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reread")
    }
}

/// Tokens hashed into `prefix-hash`: one chunk, the unit a decoder caches by.
pub const PREFIX_TOKENS: usize = 256;

/// 32-bit FNV-1a over the first [`PREFIX_TOKENS`] token ids.
pub fn prefix_hash(ids: &[u32]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for id in ids.iter().take(PREFIX_TOKENS) {
        for b in id.to_le_bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
    }
    h
}

/// The admission and routing plugins of one gateway.
#[derive(Debug)]
pub struct Plugins {
    pub host: Arc<Host>,
    pub admission: Option<Arc<AdmissionPlugin>>,
    pub routing: Option<Arc<RoutingPlugin>>,
    headers: Vec<String>,
    tenants: std::sync::RwLock<BTreeMap<String, String>>,
    watch_interval: std::time::Duration,
    /// Re-reads the gateway TOML for [`Plugins::reload`]: the plugins' tables and the tenants.
    source: Option<Reread>,
}

/// Who sent a request: its headers, and the tenant of its API key when `[auth]` is on.
#[derive(Clone, Copy, Debug)]
pub struct Sender<'a> {
    pub headers: &'a HeaderMap,
    pub tenant: Option<&'a str>,
}

impl Plugins {
    /// Compiles, checks and starts every configured plugin; any error refuses the start.
    pub fn start(
        c: &CheckedPlugins,
        tenants: BTreeMap<String, String>,
        source: Option<Reread>,
    ) -> Result<Arc<Self>, String> {
        let host = Host::new(Some(&c.cache_dir), Clock::monotonic())?;
        let admission = c
            .admission
            .clone()
            .map(|s| AdmissionPlugin::load(&host, s))
            .transpose()
            .map_err(|e| e.to_string())?;
        let routing = c
            .routing
            .clone()
            .map(|s| RoutingPlugin::load(&host, s))
            .transpose()
            .map_err(|e| e.to_string())?;
        for info in admission.iter().map(|p| p.info()).chain(routing.iter().map(|p| p.info())) {
            tracing::info!(plugin = info.name, world = info.world, sha256 = info.sha256, "plugin loaded");
        }
        Ok(Arc::new(Self {
            host,
            admission,
            routing,
            headers: c.headers.clone(),
            tenants: std::sync::RwLock::new(tenants),
            watch_interval: c.watch_interval,
            source,
        }))
    }

    /// The facts plugins are given about a request.
    pub fn request(
        &self,
        model: &str,
        endpoint: &str,
        from: Sender<'_>,
        ids: &[u32],
        slots: u32,
        max_tokens: Option<u32>,
    ) -> PolicyRequest {
        let Sender { headers, tenant } = from;
        // With API keys on, the key's tenant; else `[admission.tenants]`' name for the bearer
        // token, or the token itself.
        let tenant = tenant.map_or_else(
            || {
                let key = crate::auth::bearer(headers).unwrap_or("");
                self.tenants
                    .read()
                    .ok()
                    .and_then(|t| t.get(key).cloned())
                    .unwrap_or_else(|| key.chars().take(128).collect())
            },
            str::to_owned,
        );
        let text = |name: &str| {
            headers.get(name).and_then(|v| v.to_str().ok()).map(|v| v.chars().take(256).collect())
        };
        PolicyRequest {
            model: model.to_owned(),
            endpoint: endpoint.to_owned(),
            tenant,
            prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            slots,
            max_tokens: max_tokens.unwrap_or(0),
            priority: text("x-priority"),
            prefix_hash: prefix_hash(ids),
            headers: self
                .headers
                .iter()
                .filter_map(|n| text(n).map(|value| super::calls::Header { name: n.clone(), value }))
                .collect(),
        }
    }

    /// Reloads every plugin from its file (the admin call), with its table from the gateway TOML
    /// read again (and `[admission.tenants]`); each plugin keeps its old version on error. A TOML
    /// that no longer checks refuses the whole reload. Which plugins exist, their threads and the
    /// compile cache stay as started.
    pub fn reload(&self) -> Result<Vec<Result<PluginInfo, LoadError>>, String> {
        let (mut adm, mut rt) = (None, None);
        if let Some(reread) = &self.source {
            let (plugins, tenants) = (reread.0)()?;
            (adm, rt) = plugins.map_or((None, None), |p| (p.admission, p.routing));
            if adm.is_some() != self.admission.is_some() || rt.is_some() != self.routing.is_some() {
                return Err("adding or removing a plugin needs a restart".into());
            }
            if let Ok(mut t) = self.tenants.write() {
                *t = tenants;
            }
        }
        let mut out = Vec::new();
        if let Some(p) = &self.admission {
            out.push(p.reload(adm));
        }
        if let Some(p) = &self.routing {
            out.push(p.reload(rt));
        }
        Ok(out)
    }

    /// Reloads watched plugins whose file changed, every `watch_interval`, until `self` is dropped.
    pub fn spawn_watcher(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let every = self.watch_interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(me) = weak.upgrade() else { return };
                // Compiling is slow: off the request threads.
                let _ = tokio::task::spawn_blocking(move || {
                    if let Some(p) = me.admission.as_ref().filter(|p| p.spec().watch) {
                        p.reload_if_changed();
                    }
                    if let Some(p) = me.routing.as_ref().filter(|p| p.spec().watch) {
                        p.reload_if_changed();
                    }
                })
                .await;
            }
        })
    }

    /// `GET /admin/plugins`.
    pub fn view(&self) -> Value {
        let (hits, misses) = self.host.cache_counts();
        let mut list = Vec::new();
        if let Some(p) = &self.admission {
            list.push(view_of(p));
        }
        if let Some(p) = &self.routing {
            list.push(view_of(p));
        }
        json!({"plugins": list, "compile_cache": {"hits": hits, "misses": misses}})
    }

    /// Prometheus lines.
    pub fn render(&self, o: &mut String) {
        let mut rows: Vec<Row> = Vec::new();
        if let Some(p) = &self.admission {
            rows.extend(rows_of(p));
        }
        if let Some(p) = &self.routing {
            rows.extend(rows_of(p));
        }
        for (name, kind, help) in FAMILIES {
            let samples = rows.iter().filter(|r| r.0 == name).map(|r| (r.1.clone(), r.2.clone()));
            family(o, name, kind, help, samples);
        }
    }
}

/// `(family, labels, value)`.
type Row = (&'static str, String, String);

const FAMILIES: [(&str, &str, &str); 6] = [
    ("baton_plugin_calls_total", "counter", "Calls made to a policy plugin."),
    ("baton_plugin_call_seconds_sum", "counter", "Time spent in plugin calls, queue wait included."),
    ("baton_plugin_faults_total", "counter", "Plugin faults by kind; each made the built-in policy decide."),
    (
        "baton_plugin_builtin_decisions_total",
        "counter",
        "Decisions left to the built-in policy because the plugin was busy or switched off.",
    ),
    ("baton_plugin_reloads_total", "counter", "Plugin reloads by result."),
    ("baton_plugin_disabled", "gauge", "1 while a plugin is switched off after repeated faults."),
];

fn rows_of<W: World>(p: &Plugin<W>) -> Vec<Row> {
    let i = p.info();
    let s = &p.stats;
    let l = format!("plugin=\"{}\",world=\"{}\"", i.name, i.world);
    let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed).to_string();
    let mut rows = vec![
        ("baton_plugin_calls_total", l.clone(), n(&s.calls)),
        (
            "baton_plugin_call_seconds_sum",
            l.clone(),
            format!("{:.6}", s.call_us.load(Ordering::Relaxed) as f64 / 1e6),
        ),
        ("baton_plugin_builtin_decisions_total", format!("{l},reason=\"busy\""), n(&s.busy)),
        ("baton_plugin_builtin_decisions_total", format!("{l},reason=\"disabled\""), n(&s.disabled_skips)),
        ("baton_plugin_reloads_total", format!("{l},result=\"ok\""), n(&s.reloads)),
        ("baton_plugin_reloads_total", format!("{l},result=\"refused\""), n(&s.reload_failures)),
        ("baton_plugin_disabled", l.clone(), u8::from(i.disabled).to_string()),
    ];
    for f in Fault::ALL {
        rows.push((
            "baton_plugin_faults_total",
            format!("{l},kind=\"{}\"", f.name()),
            s.fault_count(f).to_string(),
        ));
    }
    rows
}

fn view_of<W: World>(p: &Plugin<W>) -> Value {
    let i = p.info();
    let s = &p.stats;
    let faults: serde_json::Map<String, Value> =
        Fault::ALL.iter().map(|&f| (f.name().to_owned(), json!(s.fault_count(f)))).collect();
    json!({
        "name": i.name, "world": i.world, "path": i.path, "sha256": i.sha256, "version": i.version,
        "disabled": i.disabled, "calls": s.calls.load(Ordering::Relaxed), "faults": faults,
        "busy": s.busy.load(Ordering::Relaxed), "skipped_while_disabled": s.disabled_skips.load(Ordering::Relaxed),
        "reloads": s.reloads.load(Ordering::Relaxed), "reload_failures": s.reload_failures.load(Ordering::Relaxed),
    })
}
