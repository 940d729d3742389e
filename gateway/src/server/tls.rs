//! TLS on the gateway's listener: the acceptor of the rustls configuration the configuration made
//! (`config::FrontTlsConfig`: versions, ALPN, mTLS).

use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use tokio_rustls::TlsAcceptor;

use crate::config::{FrontTlsConfig, FrontTlsFileError, TlsFiles};
use crate::endpoints::{CertFiles, TlsReloads};

/// How often a listener's certificate files are checked for a change.
pub const TLS_POLL: Duration = Duration::from_secs(1);

/// A listener's TLS settings: the acceptor new connections get, swapped when its files change.
/// Cheap to clone (a handle).
#[derive(Clone)]
pub struct FrontTls {
    inner: Arc<Inner>,
}

struct Inner {
    acceptor: RwLock<TlsAcceptor>,
    /// Clients must present a certificate (mTLS).
    client_auth: bool,
    /// The files it was read from, watched (none when it was made in memory).
    files: Option<(TlsFiles, CertFiles)>,
}

impl std::fmt::Debug for FrontTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrontTls")
    }
}

impl From<FrontTlsConfig> for FrontTls {
    fn from(c: FrontTlsConfig) -> Self {
        let files = c.files.map(|f| {
            let watch = CertFiles::new(f.paths());
            (f, watch)
        });
        Self {
            inner: Arc::new(Inner {
                acceptor: RwLock::new(TlsAcceptor::from(c.server)),
                client_auth: c.client_auth,
                files,
            }),
        }
    }
}

impl FrontTls {
    /// Clients must present a certificate from the client CA.
    pub fn client_auth(&self) -> bool {
        self.inner.client_auth
    }

    /// The acceptor for a new connection (connections already open keep the certificate they
    /// were made with).
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        self.inner.acceptor.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Reads the files again when any changed since they were last read (always with `force`:
    /// SIGHUP): `Some(Ok(()))` when new connections now get the new certificate, `None` when
    /// nothing changed. A set that does not load (a key that does not match the certificate, a
    /// file half written) is refused and the certificate in force stays.
    pub fn reload(&self, force: bool) -> Option<Result<(), FrontTlsFileError>> {
        let (files, watch) = self.inner.files.as_ref()?;
        Some(watch.reload(force, || files.load())?.map(|c| {
            *self.inner.acceptor.write().unwrap_or_else(PoisonError::into_inner) =
                TlsAcceptor::from(c.server);
        }))
    }

    /// Its reloads so far (for `/metrics`); `None` when it has no files.
    pub fn counts(&self) -> Option<Arc<TlsReloads>> {
        self.inner.files.as_ref().map(|(_, w)| Arc::clone(&w.counts))
    }

    /// Reads every listener's files, the engine client's (`[engine_tls]`) and the data plane's
    /// (`[dataplane_tls]`, pools' own), again when they change (checked every [`TLS_POLL`]) and
    /// on SIGHUP; ends with the gateway. Each outcome is
    /// logged: a refused file as a warning naming what and why.
    pub fn spawn_watcher(
        gateway: Weak<crate::pipeline::Gateway>,
        listeners: Vec<(String, FrontTls)>,
    ) -> tokio::task::JoinHandle<()> {
        let listeners: Vec<(String, FrontTls)> =
            listeners.into_iter().filter(|(_, t)| t.inner.files.is_some()).collect();
        tokio::spawn(async move {
            let engines = gateway
                .upgrade()
                .is_some_and(|g| g.shared.client.watches_files() || !g.dataplane_certs().is_empty());
            if listeners.is_empty() && !engines {
                return;
            }
            let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "no SIGHUP handler: certificates are reloaded when their files change only");
                    None
                }
            };
            let mut tick = tokio::time::interval(TLS_POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let force = tokio::select! {
                    _ = tick.tick() => false,
                    Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => true,
                };
                let Some(g) = gateway.upgrade() else { return };
                // The same words as /metrics' `tls` label: a listener's address, `admin`,
                // `engines`, `dataplane[:decode[N]]`.
                for (name, tls) in &listeners {
                    logged(name, tls.reload(force));
                }
                logged("engines", g.shared.client.reload(force));
                for certs in g.dataplane_certs() {
                    logged(certs.name(), certs.reload(force));
                }
            }
        })
    }
}

/// Logs what one set of certificate files' reload did: nothing (unchanged), swapped for new
/// connections, or refused (a warning naming why; the set in force stays).
fn logged<E: std::fmt::Display>(tls: &str, reloaded: Option<Result<(), E>>) {
    match reloaded {
        None => {}
        Some(Ok(())) => tracing::info!(tls, "TLS certificates reloaded: new connections use them"),
        Some(Err(e)) => {
            tracing::warn!(tls, error = %e, "TLS certificate files refused; the certificates in force stay")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_is_built_from_its_configured_tls() {
        let dir = std::env::temp_dir().join(format!("baton-front-tls-server-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let (cert, key) = (dir.join("a.pem"), dir.join("a.key"));
        std::fs::write(&cert, c.cert.pem()).unwrap();
        std::fs::write(&key, c.signing_key.serialize_pem()).unwrap();
        for client_ca in [None, Some(cert.as_path())] {
            let config = FrontTlsConfig::from_pem_files(&cert, &key, client_ca).unwrap();
            let tls = FrontTls::from(config);
            assert_eq!(tls.client_auth(), client_ca.is_some());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A reload swaps only when a file changed (or when forced), refuses a key that does not
    /// match its certificate and keeps the acceptor in force, and counts both.
    #[test]
    fn a_reload_swaps_changed_files_and_refuses_a_bad_set() {
        let dir = std::env::temp_dir().join(format!("baton-front-tls-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |c: &rcgen::CertifiedKey<rcgen::KeyPair>,
                     key_of: &rcgen::CertifiedKey<rcgen::KeyPair>| {
            std::fs::write(dir.join("a.pem"), c.cert.pem()).unwrap();
            std::fs::write(dir.join("a.key"), key_of.signing_key.serialize_pem()).unwrap();
        };
        let one = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        write(&one, &one);
        let tls = FrontTls::from(
            FrontTlsConfig::from_pem_files(&dir.join("a.pem"), &dir.join("a.key"), None).unwrap(),
        );
        assert!(tls.reload(false).is_none());
        assert!(matches!(tls.reload(true), Some(Ok(()))));
        let two = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        write(&two, &one);
        let before = Arc::as_ptr(tls.acceptor().config());
        assert!(matches!(tls.reload(true), Some(Err(_))));
        assert_eq!(Arc::as_ptr(tls.acceptor().config()), before, "the acceptor in force stays");
        // Not tried again until a file changes.
        assert!(tls.reload(false).is_none());
        // (a different length, so the change shows even within the file system's time resolution)
        std::fs::write(dir.join("a.key"), format!("{}\n", two.signing_key.serialize_pem())).unwrap();
        assert!(matches!(tls.reload(false), Some(Ok(()))));
        assert_ne!(Arc::as_ptr(tls.acceptor().config()), before);
        let c = tls.counts().unwrap();
        use std::sync::atomic::Ordering;
        assert_eq!((c.swapped.load(Ordering::Relaxed), c.refused.load(Ordering::Relaxed)), (2, 1));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
