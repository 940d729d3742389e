//! The gateway's plugins as configured: both worlds, the facts they are given, reload (admin call
//! and file watcher) and their metrics.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use hyper::HeaderMap;
use serde_json::{Value, json};

use super::{
    AdmissionPlugin, Clock, Fault, Host, HostError, LoadError, Plugin, PluginInfo, PolicyRequest,
    RoutingPlugin, World,
};
use crate::telemetry::Scrape;

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

/// Why the configuration could not be read again: the loader's own error (this module does not
/// know the configuration's types).
pub type RereadError = Box<dyn std::error::Error + Send + Sync>;

/// Reads the plugins' part of the configuration again (for a reload); given by whoever loaded it.
pub struct Reread(pub Box<dyn Fn() -> Result<Reloaded, RereadError> + Send + Sync>);

impl std::fmt::Debug for Reread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reread")
    }
}

/// Why the plugins could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PluginStartError {
    /// The plugins' engine could not start.
    #[error(transparent)]
    Host(#[from] HostError),
    /// A configured plugin could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// Why a reload was refused as a whole (each plugin's own result is separate).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReloadError {
    /// The configuration could not be read again, or no longer checks.
    #[error("{0}")]
    Reread(#[source] RereadError),
    /// The configuration names other plugins than the running ones.
    #[error("adding or removing a plugin needs a restart")]
    PluginSetChanged,
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

/// The tenant a plugin sees for a bearer token that `[admission.tenants]` does not name:
/// `anon-` and 16 hex digits of the token's SHA-256 (domain-separated). The same token is the same
/// tenant in every replica and after a restart, so budgets and shares still apply to it; the token
/// itself cannot be read back from it (a guessable token could be confirmed by hashing guesses:
/// name tenants with `[auth]` keys or `[admission.tenants]`).
pub fn opaque_tenant(token: &str) -> String {
    let hex = crate::auth::sha256_hex(&[b"baton tenant id v1\0".as_slice(), token.as_bytes()].concat());
    format!("anon-{}", &hex[..16])
}

/// `[admission.tenants]`: a bearer token's tenant name, for the plugins and the token metrics;
/// replaced by a plugin reload.
#[derive(Clone, Debug, Default)]
pub struct TenantNames(Arc<std::sync::RwLock<BTreeMap<String, String>>>);

impl TenantNames {
    pub fn new(names: BTreeMap<String, String>) -> Self {
        Self(Arc::new(std::sync::RwLock::new(names)))
    }

    fn set(&self, names: BTreeMap<String, String>) {
        *self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner) = names;
    }

    /// The name given to the request's bearer token, if any.
    pub fn of(&self, headers: &HeaderMap) -> Option<String> {
        let key = crate::auth::bearer(headers)?;
        self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(key).cloned()
    }

    /// The tenant policies know a request by: with API keys on, the key's (`key_tenant`); else the
    /// bearer token's name here, or an opaque id made from a token not listed (never the token:
    /// plugins log it, put it in messages, and their decisions are recorded); "" without a token.
    pub fn tenant(&self, headers: &HeaderMap, key_tenant: Option<&str>) -> String {
        match key_tenant {
            Some(t) => t.to_owned(),
            None => self
                .of(headers)
                .unwrap_or_else(|| crate::auth::bearer(headers).map(opaque_tenant).unwrap_or_default()),
        }
    }
}

/// The admission and routing plugins of one gateway.
#[derive(Debug)]
pub struct Plugins {
    pub host: Arc<Host>,
    pub admission: Option<Arc<AdmissionPlugin>>,
    pub routing: Option<Arc<RoutingPlugin>>,
    headers: Vec<String>,
    tenants: TenantNames,
    watch_interval: std::time::Duration,
    /// Re-reads the gateway TOML for [`Plugins::reload`]: the plugins' tables and the tenants.
    source: Option<Reread>,
}

/// Who sent a request: its headers, and its tenant when known: the API key's when `[auth]` is
/// on, or already resolved by [`TenantNames::tenant`] (otherwise it is resolved from the headers).
#[derive(Clone, Copy, Debug)]
pub struct Sender<'a> {
    pub headers: &'a HeaderMap,
    pub tenant: Option<&'a str>,
    /// Flow control's `(band, flow)` for the request, when it is on.
    pub flow: Option<(&'a str, &'a str)>,
}

impl Plugins {
    /// Compiles, checks and starts every configured plugin; any error refuses the start.
    pub fn start(
        c: &CheckedPlugins,
        tenants: TenantNames,
        source: Option<Reread>,
    ) -> Result<Arc<Self>, PluginStartError> {
        let host = Host::new(Some(&c.cache_dir), Clock::monotonic())?;
        let admission = c.admission.clone().map(|s| AdmissionPlugin::load(&host, s)).transpose()?;
        let routing = c.routing.clone().map(|s| RoutingPlugin::load(&host, s)).transpose()?;
        for info in admission.iter().map(|p| p.info()).chain(routing.iter().map(|p| p.info())) {
            tracing::info!(
                plugin = info.name,
                world = info.world,
                wit = info.wit,
                sha256 = info.sha256,
                "plugin loaded"
            );
        }
        Ok(Arc::new(Self {
            host,
            admission,
            routing,
            headers: c.headers.clone(),
            tenants,
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
        let Sender { headers, tenant, flow } = from;
        let tenant = self.tenants.tenant(headers, tenant);
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
            band: flow.map(|(band, _)| band.to_owned()),
            flow: flow.map(|(_, f)| f.to_owned()),
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
    pub fn reload(&self) -> Result<Vec<Result<PluginInfo, LoadError>>, ReloadError> {
        let (mut adm, mut rt) = (None, None);
        if let Some(reread) = &self.source {
            let (plugins, tenants) = (reread.0)().map_err(ReloadError::Reread)?;
            (adm, rt) = plugins.map_or((None, None), |p| (p.admission, p.routing));
            if adm.is_some() != self.admission.is_some() || rt.is_some() != self.routing.is_some() {
                return Err(ReloadError::PluginSetChanged);
            }
            self.tenants.set(tenants);
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

    /// Each plugin's series.
    pub fn scrape(&self, s: &mut Scrape) {
        if let Some(p) = &self.admission {
            scrape_of(p, s);
        }
        if let Some(p) = &self.routing {
            scrape_of(p, s);
        }
    }
}

fn scrape_of<W: World>(p: &Plugin<W>, s: &mut Scrape) {
    let i = p.info();
    let st = &p.stats;
    let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed) as f64;
    let l = [("plugin", i.name.as_str()), ("world", i.world)];
    let with = |k: &'static str, v: &'static str| [l[0], l[1], (k, v)];
    s.counter("baton_plugin_calls_total", "Calls made to a policy plugin.", &l, n(&st.calls));
    s.extend(prometheus::core::Collector::collect(&st.call_seconds));
    let builtin = "Decisions left to the built-in policy because the plugin was busy or switched off.";
    s.counter("baton_plugin_builtin_decisions_total", builtin, &with("reason", "busy"), n(&st.busy));
    s.counter(
        "baton_plugin_builtin_decisions_total",
        builtin,
        &with("reason", "disabled"),
        n(&st.disabled_skips),
    );
    let reloads = "Plugin reloads by result.";
    s.counter("baton_plugin_reloads_total", reloads, &with("result", "ok"), n(&st.reloads));
    s.counter("baton_plugin_reloads_total", reloads, &with("result", "refused"), n(&st.reload_failures));
    s.gauge(
        "baton_plugin_disabled",
        "1 while a plugin is switched off after repeated faults.",
        &l,
        f64::from(u8::from(i.disabled)),
    );
    for f in Fault::ALL {
        s.counter(
            "baton_plugin_faults_total",
            "Plugin faults by kind; each made the built-in policy decide.",
            &with("kind", f.name()),
            st.fault_count(f) as f64,
        );
    }
}

fn view_of<W: World>(p: &Plugin<W>) -> Value {
    let i = p.info();
    let s = &p.stats;
    let faults: serde_json::Map<String, Value> =
        Fault::ALL.iter().map(|&f| (f.name().to_owned(), json!(s.fault_count(f)))).collect();
    json!({
        "name": i.name, "world": i.world, "wit": format!("baton:policy@{}", i.wit), "path": i.path, "sha256": i.sha256, "version": i.version,
        "disabled": i.disabled, "calls": s.calls.load(Ordering::Relaxed), "faults": faults,
        "busy": s.busy.load(Ordering::Relaxed), "skipped_while_disabled": s.disabled_skips.load(Ordering::Relaxed),
        "reloads": s.reloads.load(Ordering::Relaxed), "reload_failures": s.reload_failures.load(Ordering::Relaxed),
    })
}

#[cfg(test)]
mod tests {
    /// The id is what `docs/plugins.md` tells an operator to compute:
    /// `printf 'baton tenant id v1\0%s' "$TOKEN" | sha256sum | cut -c1-16`.
    #[test]
    fn an_unlisted_tokens_tenant_is_the_documented_hash() {
        assert_eq!(super::opaque_tenant("sk-example"), "anon-6b54fab4856cfe3e");
        assert_ne!(super::opaque_tenant("sk-other"), super::opaque_tenant("sk-example"));
    }
}
