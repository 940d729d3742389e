//! `[plugins]`: the admission and routing policy plugins, their limits and their own config tables.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, err};
pub use crate::policy::CheckedPlugins;
#[allow(unused_imports)] // named in the field docs
use crate::policy::{
    DEFAULT_CALL_DEADLINE, DEFAULT_INSTANTIATE_DEADLINE, DEFAULT_MAX_FAULTS, DEFAULT_MEMORY_MIB,
    DEFAULT_QUEUE, DEFAULT_THREADS, DEFAULT_WATCH_INTERVAL, MAX_MEMORY_MIB, MAX_THREADS, Spec,
};

/// Where compiled plugins are kept when `cache_dir` is not set (relative to the config file).
pub const DEFAULT_CACHE_DIR: &str = ".baton-cache/plugins";
/// Most headers passed to plugins.
pub const MAX_PLUGIN_HEADERS: usize = 16;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Plugins {
    /// Compiled components are cached here (default [`DEFAULT_CACHE_DIR`], beside the config).
    pub cache_dir: Option<PathBuf>,
    /// How often watched plugin files are checked, ms (default [`DEFAULT_WATCH_INTERVAL`]).
    pub watch_interval_ms: Option<u64>,
    /// Request headers passed to plugins (lower-case names; at most [`MAX_PLUGIN_HEADERS`]).
    pub headers: Vec<String>,
    pub admission: Option<Plugin>,
    pub routing: Option<Plugin>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plugin {
    /// The component (`.wasm`), relative to the config file.
    pub path: PathBuf,
    /// A name for logs and metrics (default: the world's name).
    pub name: Option<String>,
    /// Pin: the component's sha256 (hex); any other file is refused.
    pub sha256: Option<String>,
    /// CPU time a call may use, µs (see [`crate::policy::budget`]) (default [`crate::policy::DEFAULT_CALL_DEADLINE`]).
    pub deadline_us: Option<u64>,
    /// CPU time an instantiation may use, ms (default [`crate::policy::DEFAULT_INSTANTIATE_DEADLINE`]).
    pub instantiate_deadline_ms: Option<u64>,
    /// Linear memory per instance, MiB (default [`crate::policy::DEFAULT_MEMORY_MIB`], at most [`MAX_MEMORY_MIB`]).
    pub memory_mib: Option<u32>,
    /// Threads, one instance each (default [`crate::policy::DEFAULT_THREADS`], at most [`MAX_THREADS`]).
    pub threads: Option<usize>,
    /// Calls waiting for a thread before the built-in decides (default [`crate::policy::DEFAULT_QUEUE`]).
    pub queue: Option<usize>,
    /// Faults in a row that switch the plugin off until reload (default [`crate::policy::DEFAULT_MAX_FAULTS`]).
    pub max_faults: Option<u32>,
    /// Reload when the file changes (default true).
    pub watch: Option<bool>,
    /// Call on the request's thread with a pooled instance instead of the plugin's threads
    /// (default false): for plugins compiled ahead of time (Rust), not interpreted ones.
    pub inline: Option<bool>,
    /// The plugin's own table, handed to it as JSON.
    pub config: Option<toml::Table>,
}

impl Plugin {
    fn check(&self, field: &str, default_name: &str, base: &Path) -> Result<Spec, ConfigError> {
        let path = if self.path.is_absolute() { self.path.clone() } else { base.join(&self.path) };
        if !path.is_file() {
            return Err(err(format!("{field}.path"), format!("{} is not a file", path.display())));
        }
        let name = self.name.clone().unwrap_or_else(|| default_name.to_owned());
        if name.is_empty()
            || name.len() > 64
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(err(format!("{field}.name"), format!("{name:?} must be 1-64 of [A-Za-z0-9_-]")));
        }
        let mut s = Spec::new(name, path);
        if let Some(h) = &self.sha256 {
            if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err(format!("{field}.sha256"), format!("{h:?} is not 64 hex digits")));
            }
            s.sha256 = Some(h.to_ascii_lowercase());
        }
        if let Some(us) = self.deadline_us {
            if !(10..=10_000_000).contains(&us) {
                return Err(err(format!("{field}.deadline_us"), format!("{us} is outside 10-10000000")));
            }
            s.deadline = Duration::from_micros(us);
        }
        if let Some(ms) = self.instantiate_deadline_ms {
            if !(1..=60_000).contains(&ms) {
                return Err(err(
                    format!("{field}.instantiate_deadline_ms"),
                    format!("{ms} is outside 1-60000"),
                ));
            }
            s.instantiate_deadline = Duration::from_millis(ms);
        }
        if let Some(m) = self.memory_mib {
            if !(1..=MAX_MEMORY_MIB).contains(&m) {
                return Err(err(format!("{field}.memory_mib"), format!("{m} is outside 1-{MAX_MEMORY_MIB}")));
            }
            s.memory_mib = m;
        }
        if let Some(t) = self.threads {
            if !(1..=MAX_THREADS).contains(&t) {
                return Err(err(format!("{field}.threads"), format!("{t} is outside 1-{MAX_THREADS}")));
            }
            s.threads = t;
        }
        if let Some(q) = self.queue {
            if q == 0 {
                return Err(err(format!("{field}.queue"), "must be greater than 0"));
            }
            s.queue = q;
        }
        if let Some(f) = self.max_faults {
            if f == 0 {
                return Err(err(format!("{field}.max_faults"), "must be greater than 0"));
            }
            s.max_faults = f;
        }
        s.watch = self.watch.unwrap_or(true);
        s.inline = self.inline.unwrap_or(false);
        s.config_json = serde_json::to_string(self.config.as_ref().unwrap_or(&toml::Table::new()))
            .map_err(|e| err(format!("{field}.config"), e.to_string()))?;
        Ok(s)
    }
}

impl Plugins {
    pub fn check(&self, base: &Path) -> Result<Option<CheckedPlugins>, ConfigError> {
        if self.admission.is_none() && self.routing.is_none() {
            return Ok(None);
        }
        if self.headers.len() > MAX_PLUGIN_HEADERS {
            return Err(err(
                "plugins.headers",
                format!("{} names, at most {MAX_PLUGIN_HEADERS}", self.headers.len()),
            ));
        }
        for h in &self.headers {
            if h.is_empty() || h.bytes().any(|b| !(b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'))
            {
                return Err(err("plugins.headers", format!("{h:?} is not a lower-case header name")));
            }
        }
        let interval = self.watch_interval_ms.map_or(DEFAULT_WATCH_INTERVAL, Duration::from_millis);
        if interval.is_zero() {
            return Err(err("plugins.watch_interval_ms", "must be greater than 0"));
        }
        let cache = self.cache_dir.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_CACHE_DIR));
        Ok(Some(CheckedPlugins {
            cache_dir: if cache.is_absolute() { cache } else { base.join(cache) },
            watch_interval: interval,
            headers: self.headers.clone(),
            admission: self
                .admission
                .as_ref()
                .map(|p| p.check("plugins.admission", "admission", base))
                .transpose()?,
            routing: self
                .routing
                .as_ref()
                .map(|p| p.check("plugins.routing", "routing", base))
                .transpose()?,
        }))
    }
}
