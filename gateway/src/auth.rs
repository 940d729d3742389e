//! API keys: each key stored as its SHA-256 in a file, bound to a tenant name. With `[auth]` on, a
//! generation request needs `Authorization: Bearer <key>` with a known key (else 401
//! `invalid_api_key`), and the tenant the key is bound to is what plugins see: a client cannot pick
//! its own tenant by inventing keys. The key itself is never stored, logged or passed on.
//!
//! The file is read again when it changes (checked every [`KEYS_POLL`]) and on
//! `POST /admin/keys/reload`; a file that does not check keeps the keys in force.
//!
//! ```toml
//! # printf %s "$KEY" | sha256sum
//! [[keys]]
//! sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
//! tenant = "alice"
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use crate::api::GatewayError;

/// How often the keys file is checked for a change: a revoked key stops working within this.
pub const KEYS_POLL: Duration = Duration::from_secs(1);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    keys: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    sha256: String,
    tenant: String,
}

/// The keys in force.
#[derive(Debug)]
pub struct ApiKeys {
    file: PathBuf,
    by_digest: RwLock<HashMap<[u8; 32], Arc<str>>>,
    /// The file's modification time and length when last read.
    seen: Mutex<Option<(SystemTime, u64)>>,
}

/// The token of an `Authorization: Bearer <token>` header.
pub fn bearer(headers: &hyper::HeaderMap) -> Option<&str> {
    let v = headers.get(hyper::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

/// SHA-256 of `bytes`: how API keys and the admin token are stored and compared.
pub fn digest(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// A hex SHA-256 as bytes.
pub fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let bytes: Option<Vec<u8>> =
        (0..32).map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()).collect();
    bytes.and_then(|b| <[u8; 32]>::try_from(b).ok())
}

fn stamp(file: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(file).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Why a keys file was refused (whole: the keys in force stay).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeysError {
    /// The file could not be read.
    #[error("{}: {source}", file.display())]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not TOML of the expected shape.
    #[error("{}: {}", file.display(), source.message())]
    Parse {
        file: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    /// An entry's `sha256` is not 64 hex digits (often the key itself was pasted).
    #[error("{}: keys[{index}].sha256 must be 64 hex digits: the key's SHA-256, not the key", file.display())]
    Digest { file: PathBuf, index: usize },
    /// An entry's tenant is empty, too long, or has a character outside `[A-Za-z0-9._-]`.
    #[error("{}: keys[{index}].tenant {tenant:?} must be 1-64 of [A-Za-z0-9._-]", file.display())]
    Tenant { file: PathBuf, index: usize, tenant: String },
    /// Two entries have the same digest.
    #[error("{}: keys[{index}]: the same key is listed twice", file.display())]
    Duplicate { file: PathBuf, index: usize },
}

/// Reads and checks a keys file: digest to tenant.
fn read(file: &Path) -> Result<HashMap<[u8; 32], Arc<str>>, KeysError> {
    let text =
        std::fs::read_to_string(file).map_err(|source| KeysError::Read { file: file.to_owned(), source })?;
    let f: File =
        toml::from_str(&text).map_err(|source| KeysError::Parse { file: file.to_owned(), source })?;
    let mut map = HashMap::with_capacity(f.keys.len());
    for (index, k) in f.keys.into_iter().enumerate() {
        let digest =
            parse_digest(&k.sha256).ok_or_else(|| KeysError::Digest { file: file.to_owned(), index })?;
        if k.tenant.is_empty()
            || k.tenant.len() > 64
            || !k.tenant.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(KeysError::Tenant { file: file.to_owned(), index, tenant: k.tenant });
        }
        if map.insert(digest, Arc::from(k.tenant)).is_some() {
            return Err(KeysError::Duplicate { file: file.to_owned(), index });
        }
    }
    Ok(map)
}

impl ApiKeys {
    /// Loads `file` (refused whole if any entry does not check).
    pub fn load(file: &Path) -> Result<Arc<Self>, KeysError> {
        let seen = stamp(file);
        let map = read(file)?;
        Ok(Arc::new(Self { file: file.to_owned(), by_digest: RwLock::new(map), seen: Mutex::new(seen) }))
    }

    /// Reads the file again: the number of keys now in force, or why the old ones stay.
    pub fn reload(&self) -> Result<usize, KeysError> {
        let seen = stamp(&self.file);
        *self.seen.lock().unwrap_or_else(PoisonError::into_inner) = seen;
        let map = read(&self.file)?;
        let n = map.len();
        *self.by_digest.write().unwrap_or_else(PoisonError::into_inner) = map;
        Ok(n)
    }

    /// Keys in force.
    pub fn len(&self) -> usize {
        self.by_digest.read().unwrap_or_else(PoisonError::into_inner).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tenants the keys are bound to.
    pub fn tenants(&self) -> usize {
        let map = self.by_digest.read().unwrap_or_else(PoisonError::into_inner);
        map.values().collect::<std::collections::HashSet<_>>().len()
    }

    /// The tenant of the request's bearer key, or 401.
    pub fn tenant_of(&self, headers: &hyper::HeaderMap) -> Result<Arc<str>, GatewayError> {
        let key = bearer(headers).ok_or(GatewayError::InvalidApiKey)?;
        let digest = digest(key.as_bytes());
        self.by_digest
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&digest)
            .cloned()
            .ok_or(GatewayError::InvalidApiKey)
    }

    /// Reloads the file whenever its modification time or length changes, until `self` is dropped.
    pub fn spawn_watcher(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(KEYS_POLL);
            loop {
                tick.tick().await;
                let Some(keys) = weak.upgrade() else { return };
                let now = stamp(&keys.file);
                let changed = *keys.seen.lock().unwrap_or_else(PoisonError::into_inner) != now;
                if changed {
                    match keys.reload() {
                        Ok(n) => tracing::info!(keys = n, file = %keys.file.display(), "API keys reloaded"),
                        Err(e) => tracing::warn!(error = %e, "API keys file refused; the keys in force stay"),
                    }
                }
            }
        })
    }
}

/// The SHA-256 of `bytes` in lowercase hex: how API keys, the admin token and plugin files are
/// named without their contents.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("baton-keys-{}-{name}.toml", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    fn entry(key: &str, tenant: &str) -> String {
        format!("[[keys]]\nsha256 = \"{}\"\ntenant = \"{tenant}\"\n", sha256_hex(key.as_bytes()))
    }

    fn bearer(key: &str) -> hyper::HeaderMap {
        let mut h = hyper::HeaderMap::new();
        h.insert(hyper::header::AUTHORIZATION, format!("Bearer {key}").parse().unwrap());
        h
    }

    #[test]
    fn keys_map_to_tenants_and_a_bad_file_keeps_the_old_keys() {
        let p = file("map", &(entry("k1", "alice") + &entry("k2", "alice") + &entry("k3", "bob")));
        let keys = ApiKeys::load(&p).unwrap();
        assert_eq!((keys.len(), keys.tenants()), (3, 2));
        assert_eq!(&*keys.tenant_of(&bearer("k2")).unwrap(), "alice");
        assert_eq!(keys.tenant_of(&bearer("nope")).unwrap_err().status(), 401);
        assert_eq!(keys.tenant_of(&hyper::HeaderMap::new()).unwrap_err().code(), "invalid_api_key");
        std::fs::write(&p, "[[keys]]\nsha256 = \"k1\"\ntenant = \"alice\"\n").unwrap();
        let e = keys.reload().unwrap_err();
        assert!(matches!(e, KeysError::Digest { index: 0, .. }), "{e}");
        assert!(
            e.to_string().ends_with("keys[0].sha256 must be 64 hex digits: the key's SHA-256, not the key"),
            "{e}"
        );
        assert_eq!(&*keys.tenant_of(&bearer("k3")).unwrap(), "bob", "the old keys stay");
        for (case, text) in [
            ("a bad tenant", entry("k", "a b")),
            ("a key twice", entry("k", "a") + &entry("k", "b")),
            ("an unknown field", entry("k", "a") + "extra = 1\n"),
        ] {
            std::fs::write(&p, text).unwrap();
            assert!(keys.reload().is_err(), "{case}");
        }
        let _ = std::fs::remove_file(&p);
    }
}
