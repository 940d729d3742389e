//! `[[decode]]`: a decode pool, its common keys (`name`, `url`, `handoff`) and the keys of its
//! handoff mode. Each mode's keys are a struct of its own module with `deny_unknown_fields`, so a
//! key of one mode on a pool of another is refused by the parser ("unknown field `dataplane`,
//! expected `nixl`"); the list of modes (`crate::handoff`) picks the struct by `handoff`.

use std::path::{Path, PathBuf};

use baton_dataplane::KvGeometry;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer};

use super::{ConfigError, err, parse_url};
pub use crate::handoff::CheckedDecoder;
use crate::handoff::{CheckContext, KeyError, Mode, PoolMode};

/// A decode pool as written.
#[derive(Debug)]
pub struct DecodePool {
    pub name: String,
    pub url: String,
    pub mode: PoolMode,
    /// Its KV-event publisher.
    pub events: super::cache::KvEventsKeys,
}

impl<'de> Deserialize<'de> for DecodePool {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut t = toml::Table::deserialize(d)?;
        let mut text = |key: &'static str| match t.remove(key) {
            Some(toml::Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(D::Error::custom(format!("{key}: expected a string, found {}", v.type_str()))),
            None => Ok(None),
        };
        let name = text("name")?.ok_or_else(|| D::Error::missing_field("name"))?;
        let url = text("url")?.ok_or_else(|| D::Error::missing_field("url"))?;
        let mode = match text("handoff")? {
            None => Mode::default(),
            Some(h) => Mode::parse(&h).ok_or_else(|| {
                let names: Vec<String> = Mode::ALL.iter().map(|m| format!("`{}`", m.name())).collect();
                D::Error::custom(format!("unknown variant `{h}`, expected one of {}", names.join(", ")))
            })?,
        };
        let events = super::cache::KvEventsKeys::take(&mut t).map_err(D::Error::custom)?;
        let mode = mode.keys(t).map_err(|e| D::Error::custom(e.message()))?;
        Ok(Self { name, url, mode, events })
    }
}

/// Checks the pools; `geometry_for(tp)` is the model's geometry at a TP size.
pub(super) fn check(
    pools: &[DecodePool],
    path: &dyn Fn(&Path) -> PathBuf,
    model_chunk: u32,
    geometry_for: &dyn Fn(u32) -> Result<KvGeometry, ConfigError>,
    dataplane_tls_default: bool,
) -> Result<Vec<CheckedDecoder>, ConfigError> {
    if pools.is_empty() {
        return Err(err("decode", "at least one decode pool is required"));
    }
    // The model's geometry as the modes check it (their errors carry no line of their own).
    let geometry = |tp: u32| geometry_for(tp).map_err(|e| KeyError { field: e.field, reason: e.reason });
    let mut out = Vec::new();
    for (i, d) in pools.iter().enumerate() {
        let field = format!("decode[{i}]");
        let http = parse_url(&format!("{field}.url"), &d.url)?;
        let cx =
            CheckContext { field: &field, path, model_chunk, geometry_for: &geometry, dataplane_tls_default };
        out.push(CheckedDecoder { name: d.name.clone(), http, mode: d.mode.check(&cx)? });
    }
    Ok(out)
}
