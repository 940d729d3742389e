//! The cache-aware routing's configuration: each engine's KV-event publisher (`kv_events` keys
//! of `[[prefill]]` and `[[decode]]`) and `[routing.cache]`.

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, err};
use crate::prefix::feed::FeedConfig;
use crate::routing::{Builtin, CacheParams};

/// An engine's KV-event publisher, as written in its pool.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KvEventsKeys {
    /// `kv_events`: the publisher (`host:port` or `tcp://host:port`; vLLM's and SGLang's
    /// `--kv-events-config` `endpoint`, with the engine's host for `*`).
    pub endpoint: Option<String>,
    /// `kv_events_replay`: its replay socket (`replay_endpoint`).
    pub replay: Option<String>,
    /// `kv_events_topic` (default `""`, vLLM's and SGLang's default).
    pub topic: String,
    /// `data_parallel_size`: the engine's data-parallel ranks, each publishing on the port + its
    /// rank (default 1).
    pub ranks: u16,
}

impl KvEventsKeys {
    /// The keys, taken out of a pool's table.
    pub fn take(t: &mut toml::Table) -> Result<Self, String> {
        let mut text = |key: &str| match t.remove(key) {
            Some(toml::Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(format!("{key}: expected a string, found {}", v.type_str())),
            None => Ok(None),
        };
        let endpoint = text("kv_events")?;
        let replay = text("kv_events_replay")?;
        let topic = text("kv_events_topic")?.unwrap_or_default();
        let ranks = match t.remove("data_parallel_size") {
            None => 1,
            Some(toml::Value::Integer(n)) => {
                u16::try_from(n).map_err(|_| format!("data_parallel_size: {n} is not between 1 and 65535"))?
            }
            Some(v) => {
                return Err(format!("data_parallel_size: expected an integer, found {}", v.type_str()));
            }
        };
        Ok(Self { endpoint, replay, topic, ranks })
    }

    /// One feed per data-parallel rank of engine number `engine`; `field` names the pool.
    pub fn feeds(&self, engine: usize, field: &str) -> Result<Vec<FeedConfig>, ConfigError> {
        if self.ranks == 0 {
            return Err(err(format!("{field}.data_parallel_size"), "must be at least 1"));
        }
        let Some(endpoint) = &self.endpoint else {
            if self.replay.is_some() {
                return Err(err(format!("{field}.kv_events_replay"), "needs kv_events (the publisher) too"));
            }
            return Ok(Vec::new());
        };
        (0..self.ranks)
            .map(|rank| {
                Ok(FeedConfig {
                    engine,
                    rank,
                    endpoint: offset(endpoint, rank).map_err(|e| err(format!("{field}.kv_events"), e))?,
                    replay: match &self.replay {
                        Some(r) => {
                            Some(offset(r, rank).map_err(|e| err(format!("{field}.kv_events_replay"), e))?)
                        }
                        None => None,
                    },
                    topic: self.topic.clone(),
                })
            })
            .collect()
    }
}

/// `host:port` (or `tcp://host:port`) with the port moved up by `rank`, as vLLM and SGLang
/// offset each data-parallel rank's endpoints.
fn offset(endpoint: &str, rank: u16) -> Result<String, String> {
    let (scheme, rest) = match endpoint.split_once("://") {
        Some(("tcp", rest)) => ("tcp://", rest),
        Some((other, _)) => {
            return Err(format!("{endpoint:?}: only tcp:// endpoints are read, not {other}://"));
        }
        None => ("tcp://", endpoint),
    };
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("{endpoint:?} has no port"))?;
    if host.is_empty() || host == "*" {
        return Err(format!(
            "{endpoint:?}: name the engine's host (the engine binds `*`, the gateway connects)"
        ));
    }
    let port: u16 = port.parse().map_err(|_| format!("{endpoint:?}: {port:?} is not a port"))?;
    let port = port
        .checked_add(rank)
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{endpoint:?}: rank {rank} overflows the port"))?;
    Ok(format!("{scheme}{host}:{port}"))
}

/// `[routing.cache]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheRouting {
    /// The load guard: an engine more loaded than this times the least loaded candidate (and more
    /// than `guard_slack` above it) is not chosen for its cache. A prefiller's load is its pending
    /// prompt tokens, a decoder's its requests.
    pub guard_ratio: f64,
    /// Load above the least loaded that any engine may carry whatever the ratio: requests (for a
    /// prefiller, prompts of the routed one's length).
    pub guard_slack: u32,
    /// How much a cached token counts: for a prefiller, against a token of pending work; for a
    /// decoder, a wholly cached prompt against the load guard's span.
    pub cache_weight: f64,
    /// Tokens per block for engines that publish no events (their entries come from routing).
    pub block_size: u32,
    /// How long a routed request's blocks count as cached on an engine without events, ms
    /// (0: engines without events are routed by load only).
    pub routed_ttl_ms: u64,
    /// Most (engine, block) entries the index holds.
    pub max_blocks: usize,
    /// An engine sent requests with whole blocks whose publisher says nothing for this long is
    /// marked silent (and routed as one without events), ms.
    pub silent_after_ms: u64,
    /// Send a request to its decoder alone, with no prefill leg, when the decoder holds all but
    /// `skip_prefill_within` of the prompt's tokens (and at least one block of it): the decoder
    /// computes the rest itself, sooner than a prefill leg and a KV transfer would bring it; or
    /// all but twice that when the routed prefiller would compute `skip_prefill_within` more.
    /// Only modes whose decoders can (vllm-nixl, native); others always prefill.
    pub skip_prefill: bool,
    pub skip_prefill_within: u32,
}

impl Default for CacheRouting {
    fn default() -> Self {
        Self {
            guard_ratio: 1.5,
            guard_slack: 2,
            cache_weight: 1.0,
            block_size: 16,
            routed_ttl_ms: 120_000,
            max_blocks: 1 << 20,
            silent_after_ms: 10_000,
            skip_prefill: true,
            skip_prefill_within: 256,
        }
    }
}

/// The checked settings of the block index and its feeds.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixSettings {
    pub block_size: u32,
    pub routed_ttl: Duration,
    pub max_blocks: usize,
    pub silent_after: Duration,
    /// `skip_prefill_within` when `skip_prefill` is on.
    pub skip_prefill_within: Option<u32>,
    /// Every publisher, engines numbered prefills first, then decoders, in the file's order.
    pub feeds: Vec<FeedConfig>,
}

/// The most tokens `skip_prefill_within` may leave to a decoder (a bound on a typo, not a tuning).
const MAX_SKIP_WITHIN: u32 = 1 << 20;

impl CacheRouting {
    /// How many uncached tokens a decoder computes itself instead of a prefill leg, when on.
    pub fn skip_within(&self) -> Option<u32> {
        self.skip_prefill.then_some(self.skip_prefill_within)
    }

    /// The policy's parameters.
    pub fn params(&self) -> Result<CacheParams, ConfigError> {
        if !(1.0..=100.0).contains(&self.guard_ratio) {
            return Err(err(
                "routing.cache.guard_ratio",
                format!("{} is not between 1 and 100", self.guard_ratio),
            ));
        }
        if self.guard_slack > 1_000_000 {
            return Err(err(
                "routing.cache.guard_slack",
                format!("{} is more than 1000000 requests", self.guard_slack),
            ));
        }
        if !(0.0..=100.0).contains(&self.cache_weight) {
            return Err(err(
                "routing.cache.cache_weight",
                format!("{} is not between 0 and 100", self.cache_weight),
            ));
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let pct = |v: f64| (v * 100.0).round() as u32;
        Ok(CacheParams {
            guard_ratio_pct: pct(self.guard_ratio),
            guard_slack: self.guard_slack,
            cache_weight_pct: pct(self.cache_weight),
        })
    }

    /// The index's settings, when routing is cache-aware or an engine publishes events (`None`
    /// otherwise: no index is kept), and the warnings check-config and the start print.
    pub fn check(
        &self,
        routing: Builtin,
        events: &[(String, &KvEventsKeys)],
    ) -> Result<(Option<PrefixSettings>, Vec<String>), ConfigError> {
        let mut feeds = Vec::new();
        for (engine, (field, keys)) in events.iter().enumerate() {
            feeds.extend(keys.feeds(engine, field)?);
        }
        if self.block_size == 0 {
            return Err(err("routing.cache.block_size", "must be greater than 0"));
        }
        if self.max_blocks == 0 {
            return Err(err("routing.cache.max_blocks", "must be greater than 0"));
        }
        if self.skip_prefill_within > MAX_SKIP_WITHIN {
            return Err(err(
                "routing.cache.skip_prefill_within",
                format!("{} is more than {MAX_SKIP_WITHIN} tokens", self.skip_prefill_within),
            ));
        }
        let cache_aware = matches!(routing, Builtin::CacheAware(_));
        let mut warnings = Vec::new();
        if cache_aware && feeds.is_empty() {
            warnings.push(format!(
                "routing is cache-aware but no engine has kv_events: every engine is matched by what was routed to it \
                 (approximate, for {} s); set kv_events on each [[prefill]] and [[decode]] and start the engines with \
                 --kv-events-config (docs/routing.md)",
                self.routed_ttl_ms / 1000
            ));
        }
        if !cache_aware && !feeds.is_empty() {
            warnings.push(format!(
                "engines have kv_events but routing.policy is {:?}: the index is kept (shown in /admin, and given to a \
                 routing plugin as cached-tokens) but the built-in policy does not route by it",
                routing.name()
            ));
        }
        if !cache_aware && feeds.is_empty() {
            return Ok((None, warnings));
        }
        Ok((
            Some(PrefixSettings {
                block_size: self.block_size,
                routed_ttl: Duration::from_millis(self.routed_ttl_ms),
                max_blocks: self.max_blocks,
                silent_after: Duration::from_millis(self.silent_after_ms.max(1)),
                skip_prefill_within: self.skip_within(),
                feeds,
            }),
            warnings,
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn ranks_publish_on_the_port_plus_their_rank() {
        assert_eq!(offset("10.0.0.5:5557", 0).unwrap(), "tcp://10.0.0.5:5557");
        assert_eq!(offset("tcp://p0.pd:5557", 3).unwrap(), "tcp://p0.pd:5560");
        assert!(offset("tcp://*:5557", 0).unwrap_err().contains("name the engine's host"));
        assert!(offset("ipc:///tmp/x", 0).unwrap_err().contains("only tcp://"));
        assert!(offset("p0:65535", 1).is_err());
        let keys = KvEventsKeys {
            endpoint: Some("p0:5557".into()),
            replay: Some("p0:5600".into()),
            topic: String::new(),
            ranks: 2,
        };
        let f = keys.feeds(3, "prefill[0]").unwrap();
        assert_eq!(f.len(), 2);
        assert_eq!((f[1].engine, f[1].rank, f[1].endpoint.as_str()), (3, 1, "tcp://p0:5558"));
        assert_eq!(f[1].replay.as_deref(), Some("tcp://p0:5601"));
    }
}
