//! `[cluster]`: replicas sharing decoders through a store, as written, and its check into
//! [`ClusterConfig`].

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, err};
use crate::cluster::{ClusterConfig, DEFAULT_LEASE, DEFAULT_SYNC};
use crate::handoff::{CheckedDecoder, Sharing};

/// The shortest lease: a replica syncs several times within it.
const MIN_LEASE: Duration = Duration::from_millis(500);
/// The longest: a killed replica's share is gone this long.
const MAX_LEASE: Duration = Duration::from_secs(600);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// `redis://[user:password@]host:port[/db]`.
    pub store: String,
    /// What this replica's name in the store starts with (default: the host name); the process id
    /// and a random suffix follow, so that replicas sharing one file are never one name.
    pub replica: Option<String>,
    /// A replica's lease (default 5000): a replica that stops syncing loses its shares this long
    /// after its last sync.
    pub lease_ms: Option<u64>,
    /// How often a replica syncs when nothing asks sooner (default 50).
    pub sync_ms: Option<u64>,
    /// What the keys start with (default `baton`): gateways of different fleets on one store
    /// need different prefixes.
    pub key_prefix: Option<String>,
}

impl Cluster {
    pub fn check(&self, decoders: &[CheckedDecoder]) -> Result<ClusterConfig, ConfigError> {
        let url = self.store.trim();
        if !url.starts_with("redis://") {
            return Err(err("cluster.store", format!("{url:?} is not a redis:// URL")));
        }
        redis::Client::open(url).map_err(|e| err("cluster.store", e.to_string()))?;
        let lease = self.lease_ms.map_or(DEFAULT_LEASE, Duration::from_millis);
        if !(MIN_LEASE..=MAX_LEASE).contains(&lease) {
            return Err(err(
                "cluster.lease_ms",
                format!(
                    "{} is outside {}..={}",
                    lease.as_millis(),
                    MIN_LEASE.as_millis(),
                    MAX_LEASE.as_millis()
                ),
            ));
        }
        let sync = self.sync_ms.map_or(DEFAULT_SYNC, Duration::from_millis);
        if sync.is_zero() || sync * 4 > lease {
            return Err(err(
                "cluster.sync_ms",
                format!(
                    "{} must be above 0 and at most a quarter of lease_ms ({}): a replica renews its lease with every sync",
                    sync.as_millis(),
                    lease.as_millis()
                ),
            ));
        }
        if let Some(r) = &self.replica
            && (r.trim().is_empty() || r.contains(' '))
        {
            return Err(err("cluster.replica", format!("{r:?}: give a name without spaces")));
        }
        let replica = ClusterConfig::replica_name(self.replica.as_deref());
        let key_prefix = self.key_prefix.clone().unwrap_or_else(|| "baton".into());
        if key_prefix.is_empty() || key_prefix.contains(['{', '}', ' ']) {
            return Err(err(
                "cluster.key_prefix",
                format!("{key_prefix:?}: give a name without braces or spaces"),
            ));
        }
        for (i, d) in decoders.iter().enumerate() {
            if d.mode.mode().sharing() == Sharing::Single {
                return Err(err(
                    format!("decode[{i}].handoff"),
                    format!(
                        "{} cannot run behind several gateway replicas: the decoder's LMCache notifies one proxy address \
                         (pd_proxy_host), so the other replicas never learn their requests' KV arrived; remove [cluster] \
                         or run one replica",
                        d.mode.mode().name()
                    ),
                ));
            }
        }
        Ok(ClusterConfig { store: url.to_owned(), replica, lease, sync, key_prefix })
    }
}
