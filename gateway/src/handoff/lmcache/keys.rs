//! `[decode.lmcache]`: a decoder's LMCache PD backend, merged with the LMCache YAML it names, and its
//! capacity in chunk slots.

use std::path::{Path, PathBuf};

use baton_dataplane::KvGeometry;
use serde::Deserialize;

use crate::handoff::KeyError;

fn err(field: impl Into<String>, reason: impl Into<String>) -> KeyError {
    KeyError { field: field.into(), reason: reason.into() }
}

/// `[decode.lmcache]`: a decoder's LMCache PD backend. Values given here win over its YAML.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LmcachePool {
    /// The decoder's LMCache YAML (`pd_peer_host`, `pd_peer_init_port`, `pd_peer_alloc_port`,
    /// `pd_buffer_size`, `chunk_size` are read from it).
    pub config: Option<PathBuf>,
    pub receiver_host: Option<String>,
    pub init_ports: Option<Vec<u16>>,
    pub alloc_ports: Option<Vec<u16>>,
    /// PD buffer bytes per decoder rank.
    pub pd_buffer_size: Option<u64>,
    /// LMCache's chunk size in tokens (default `model.chunk_tokens`).
    pub chunk_size: Option<u32>,
}

/// The keys of an LMCache YAML the gateway reads (the rest are LMCache's business).
#[derive(Debug, Deserialize, Default)]
struct LmcacheYaml {
    chunk_size: Option<u32>,
    #[serde(alias = "nixl_buffer_size")]
    pd_buffer_size: Option<u64>,
    #[serde(alias = "nixl_role")]
    pd_role: Option<String>,
    #[serde(alias = "nixl_peer_host")]
    pd_peer_host: Option<String>,
    #[serde(alias = "nixl_peer_init_port")]
    pd_peer_init_port: Option<Ports>,
    #[serde(alias = "nixl_peer_alloc_port")]
    pd_peer_alloc_port: Option<Ports>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Ports {
    One(u16),
    Many(Vec<u16>),
}

impl Ports {
    fn list(self) -> Vec<u16> {
        match self {
            Self::One(p) => vec![p],
            Self::Many(v) => v,
        }
    }
}

/// A decoder's LMCache PD backend, checked.
#[derive(Debug, Clone)]
pub struct CheckedLmcache {
    pub target: crate::handoff::lmcache::LmcacheTarget,
    /// `pd_buffer_size / (chunk_size × kv_bytes_per_token / tp)`.
    pub capacity: u32,
    pub chunk_size: u32,
    pub pd_buffer_size: u64,
}

/// Merges `[decode.lmcache]` with the YAML it names and computes the slots.
pub(crate) fn check_lmcache(
    f: &str,
    pool: &LmcachePool,
    path: &dyn Fn(&Path) -> PathBuf,
    model_chunk: u32,
    geometry_for: &dyn Fn(u32) -> Result<KvGeometry, KeyError>,
) -> Result<CheckedLmcache, KeyError> {
    let yaml = match &pool.config {
        None => LmcacheYaml::default(),
        Some(p) => {
            let p = path(p);
            let text = std::fs::read_to_string(&p)
                .map_err(|e| err(format!("{f}.config"), format!("{}: {e}", p.display())))?;
            let y: LmcacheYaml = serde_yaml_ng::from_str(&text)
                .map_err(|e| err(format!("{f}.config"), format!("{}: {e}", p.display())))?;
            if let Some(role) = y.pd_role.as_deref().filter(|r| *r != "receiver") {
                return Err(err(
                    format!("{f}.config"),
                    format!(
                        "{} has pd_role {role:?}: give the decoder's (receiver's) LMCache config",
                        p.display()
                    ),
                ));
            }
            y
        }
    };
    // The TOML's value wins over the YAML's; one of them must be there.
    fn pick<T>(f: &str, toml: Option<T>, yaml: Option<T>, field: &str, key: &str) -> Result<T, KeyError> {
        toml.or(yaml).ok_or_else(|| err(format!("{f}.{field}"), format!("needed (or {key} in its YAML)")))
    }
    let receiver_host =
        pick(f, pool.receiver_host.clone(), yaml.pd_peer_host, "receiver_host", "pd_peer_host")?;
    let ports = |toml: &Option<Vec<u16>>, yaml: Option<Ports>, field: &str, key: &str| {
        pick(f, toml.clone(), yaml.map(Ports::list), field, key)
    };
    let init_ports = ports(&pool.init_ports, yaml.pd_peer_init_port, "init_ports", "pd_peer_init_port")?;
    let alloc_ports = ports(&pool.alloc_ports, yaml.pd_peer_alloc_port, "alloc_ports", "pd_peer_alloc_port")?;
    if alloc_ports.is_empty() || alloc_ports.len() != init_ports.len() {
        return Err(err(
            format!("{f}.alloc_ports"),
            format!(
                "one alloc and one init port per decoder rank ({} and {} given)",
                alloc_ports.len(),
                init_ports.len()
            ),
        ));
    }
    let pd_buffer_size =
        pick(f, pool.pd_buffer_size, yaml.pd_buffer_size, "pd_buffer_size", "pd_buffer_size")?;
    let chunk_size = pool.chunk_size.or(yaml.chunk_size).unwrap_or(model_chunk);
    if chunk_size == 0 {
        return Err(err(format!("{f}.chunk_size"), "must be greater than 0"));
    }
    let tp =
        u32::try_from(alloc_ports.len()).map_err(|_| err(format!("{f}.alloc_ports"), "too many ranks"))?;
    let g = geometry_for(tp).map_err(|e| err(format!("{f} ({})", e.field), e.reason))?;
    let g = KvGeometry::new(g.layers, g.kv_heads, g.head_dim, g.dtype_bytes, chunk_size, tp)
        .map_err(|e| err(format!("{f}.chunk_size"), e.to_string()))?;
    let chunk_bytes = g.page_bytes_per_rank().max(1);
    let capacity = u32::try_from(pd_buffer_size / chunk_bytes).unwrap_or(u32::MAX);
    if capacity == 0 {
        return Err(err(
            format!("{f}.pd_buffer_size"),
            format!(
                "{pd_buffer_size} bytes hold no chunk of {chunk_bytes} bytes per rank ({chunk_size} tokens)"
            ),
        ));
    }
    Ok(CheckedLmcache {
        target: super::LmcacheTarget { receiver_host, init_ports, alloc_ports },
        capacity,
        chunk_size,
        pd_buffer_size,
    })
}
