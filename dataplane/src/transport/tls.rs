//! Optional TLS for data-plane connections (rustls, ring provider), with client-certificate (mTLS)
//! verification when the rank is given a client CA.
//!
//! Both ends are baton, so the defaults are strict: TLS 1.3 only (no reason to speak older versions
//! to ourselves) and the ALPN protocol `baton-dp/1`, so a data-plane port is never mistaken for an
//! HTTPS endpoint.
//!
//! Certificates rotate: [`TlsServer::replace`] and [`TlsClient::replace`] swap the configuration
//! every clone of the handle shares. New handshakes use the new one; connections already open
//! keep the one they were made with. Which files to watch, and when, is the embedder's to say.

use std::path::Path;
use std::sync::{Arc, PoisonError, RwLock};

use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use thiserror::Error;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The ALPN protocol of the data plane.
pub const ALPN: &[u8] = b"baton-dp/1";

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
    /// rustls refused the configuration.
    #[error("tls configuration: {0}")]
    Config(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(cas: Vec<CertificateDer<'static>>) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for ca in cas {
        store.add(ca).map_err(|e| TlsError::Config(format!("bad CA certificate: {e}")))?;
    }
    if store.is_empty() {
        return Err(TlsError::Config("no CA certificate given".into()));
    }
    Ok(store)
}

/// The certificates of a PEM file (at least one).
pub fn pem_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file = |reason: String| TlsError::File { path: path.display().to_string(), reason };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file(e.to_string()))?;
    if certs.is_empty() {
        return Err(file("no certificate in the file".into()));
    }
    Ok(certs)
}

/// The private key of a PEM file.
pub fn pem_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| TlsError::File { path: path.display().to_string(), reason: e.to_string() })
}

/// A configuration every clone of a handle shares, swapped whole.
#[derive(Debug)]
struct Shared<T>(Arc<RwLock<Arc<T>>>);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T> Shared<T> {
    fn new(config: T) -> Self {
        Self(Arc::new(RwLock::new(Arc::new(config))))
    }

    fn get(&self) -> Arc<T> {
        Arc::clone(&self.0.read().unwrap_or_else(PoisonError::into_inner))
    }

    fn set(&self, config: Arc<T>) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = config;
    }
}

/// A rank's TLS identity and, for mTLS, the CA its peers' certificates must chain to. Clones share
/// it: [`TlsServer::replace`] on one changes what every clone's new handshakes present.
#[derive(Debug, Clone)]
pub struct TlsServer {
    config: Shared<ServerConfig>,
}

impl TlsServer {
    pub fn new(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        client_ca: Option<Vec<CertificateDer<'static>>>,
    ) -> Result<Self, TlsError> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let builder = match client_ca {
            Some(cas) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots(cas)?), provider())
                    .build()
                    .map_err(|e| TlsError::Config(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key).map_err(|e| TlsError::Config(e.to_string()))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(Self { config: Shared::new(config) })
    }

    /// From now on, new handshakes (on this handle and every clone of it) use `new`'s identity and
    /// client CA; connections already open keep theirs.
    pub fn replace(&self, new: &TlsServer) {
        self.config.set(new.config.get());
    }

    /// From PEM files: certificate chain, private key, and optionally the client CA (mTLS).
    pub fn from_pem_files(cert: &Path, key_file: &Path, client_ca: Option<&Path>) -> Result<Self, TlsError> {
        Self::new(pem_certs(cert)?, pem_key(key_file)?, client_ca.map(pem_certs).transpose()?)
    }

    /// The acceptor for a new connection, with the configuration in force now.
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.config.get())
    }
}

/// How a peer connects to a rank over TLS: the CA to trust, the name to check, and for mTLS its own
/// identity. Clones share it: [`TlsClient::replace`] on one changes every clone's new connections.
#[derive(Debug, Clone)]
pub struct TlsClient {
    config: Shared<(Arc<ClientConfig>, ServerName<'static>)>,
}

impl TlsClient {
    pub fn new(
        cas: Vec<CertificateDer<'static>>,
        server_name: &str,
        identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    ) -> Result<Self, TlsError> {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_root_certificates(roots(cas)?);
        let mut config = match identity {
            Some((chain, key)) => {
                builder.with_client_auth_cert(chain, key).map_err(|e| TlsError::Config(e.to_string()))?
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![ALPN.to_vec()];
        let server_name = ServerName::try_from(server_name.to_owned())
            .map_err(|e| TlsError::Config(format!("server name {server_name:?}: {e}")))?;
        Ok(Self { config: Shared::new((Arc::new(config), server_name)) })
    }

    /// From now on, new connections (on this handle and every clone of it) trust `new`'s CA,
    /// check its server name and present its identity; connections already open keep theirs.
    pub fn replace(&self, new: &TlsClient) {
        self.config.set(new.config.get());
    }

    /// From PEM files: the CA, the rank's name, and optionally this peer's certificate and key.
    pub fn from_pem_files(
        ca: &Path,
        server_name: &str,
        identity: Option<(&Path, &Path)>,
    ) -> Result<Self, TlsError> {
        let identity = match identity {
            Some((c, k)) => Some((pem_certs(c)?, pem_key(k)?)),
            None => None,
        };
        Self::new(pem_certs(ca)?, server_name, identity)
    }

    /// The connector for a new connection, with the configuration in force now.
    pub(crate) fn connector(&self) -> (TlsConnector, ServerName<'static>) {
        let c = self.config.get();
        (TlsConnector::from(Arc::clone(&c.0)), c.1.clone())
    }
}
