//! The TLS of the gateway's own listeners (public and admin) as configured: the PEM files read and
//! made into rustls' server configuration, once, when the configuration is checked, so a bad file
//! is refused with the configuration (`check-config` included), not at start. The server wraps it
//! in its acceptor (`server::tls`); this module never depends on the server.
//!
//! TLS 1.2 and 1.3 only (1.0 and 1.1 are refused: deprecated by RFC 8996), ALPN `h2` and
//! `http/1.1`, and client-certificate verification (mTLS) when a client CA is configured.
//!
//! A configuration made from files remembers them ([`TlsFiles`]): the server reads them again when
//! they change, or on SIGHUP, and swaps the certificate for new connections (`server::tls`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_dataplane::transport::{TlsError, pem_certs, pem_key};
use rustls::server::{VerifierBuilderError, WebPkiClientVerifier};
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// A listener's TLS, ready to accept connections.
#[derive(Clone)]
pub struct FrontTlsConfig {
    pub server: Arc<ServerConfig>,
    /// Clients must present a certificate from the client CA (mTLS).
    pub client_auth: bool,
    /// The files it was read from, when it was (read again on change).
    pub files: Option<TlsFiles>,
}

/// A listener's PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// The files, in a fixed order.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        [Some(self.cert.as_path()), Some(self.key.as_path()), self.client_ca.as_deref()].into_iter().flatten()
    }

    /// Reads them again into a listener's TLS.
    pub fn load(&self) -> Result<FrontTlsConfig, FrontTlsFileError> {
        FrontTlsConfig::from_pem_files(&self.cert, &self.key, self.client_ca.as_deref())
    }
}

impl fmt::Debug for FrontTlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The certificates' bytes say nothing in a log; the key is never shown.
        f.debug_struct("FrontTlsConfig").field("client_auth", &self.client_auth).finish_non_exhaustive()
    }
}

/// Why a listener's TLS is refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrontTlsFileError {
    /// A PEM file could not be read, or holds no certificate or key.
    #[error(transparent)]
    Pem(#[from] TlsError),
    /// rustls refused the protocol versions (never with the ring provider, which has both).
    #[error("{source}")]
    Versions {
        #[source]
        source: rustls::Error,
    },
    /// A certificate of the client CA file is not a usable trust anchor.
    #[error("client CA: {source}")]
    ClientCa {
        #[source]
        source: rustls::Error,
    },
    /// No client certificate verifier could be made from the client CA (no certificate in it).
    #[error("client CA: {source}")]
    ClientVerifier {
        #[source]
        source: VerifierBuilderError,
    },
    /// The key is of a kind that cannot sign, or does not match the certificate.
    #[error("{source}")]
    Identity {
        #[source]
        source: rustls::Error,
    },
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl FrontTlsConfig {
    /// Reads the certificate chain, the key and the client CA from PEM files.
    pub fn from_pem_files(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<Self, FrontTlsFileError> {
        let files =
            TlsFiles { cert: cert.to_owned(), key: key.to_owned(), client_ca: client_ca.map(Path::to_owned) };
        let key = pem_key(key)?;
        let chain = pem_certs(cert)?;
        let client_ca = client_ca.map(pem_certs).transpose()?;
        Ok(Self { files: Some(files), ..Self::new(chain, key, client_ca)? })
    }

    /// A listener's TLS from its chain and key and, for mTLS, the CA certificates that clients'
    /// certificates must chain to.
    pub fn new(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        client_ca: Option<Vec<CertificateDer<'static>>>,
    ) -> Result<Self, FrontTlsFileError> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|source| FrontTlsFileError::Versions { source })?;
        let client_auth = client_ca.is_some();
        let builder = match client_ca {
            Some(cas) => {
                let mut roots = RootCertStore::empty();
                for ca in cas {
                    roots.add(ca).map_err(|source| FrontTlsFileError::ClientCa { source })?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                    .build()
                    .map_err(|source| FrontTlsFileError::ClientVerifier { source })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut server =
            builder.with_single_cert(chain, key).map_err(|source| FrontTlsFileError::Identity { source })?;
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self { server: Arc::new(server), client_auth, files: None })
    }

    /// Clients must present a certificate from the client CA.
    pub fn client_auth(&self) -> bool {
        self.client_auth
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// A self-signed certificate and its key as PEM files in `dir`.
    fn pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let (cert, key) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        std::fs::write(&cert, c.cert.pem()).unwrap();
        std::fs::write(&key, c.signing_key.serialize_pem()).unwrap();
        (cert, key)
    }

    #[test]
    fn the_files_are_refused_here_where_the_server_would_refuse_them() {
        let dir = std::env::temp_dir().join(format!("baton-front-tls-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = pair(&dir, "a");
        let (_, other_key) = pair(&dir, "b");
        let plain = FrontTlsConfig::from_pem_files(&cert, &key, None).unwrap();
        assert!(!plain.client_auth());
        assert_eq!(plain.server.alpn_protocols, [b"h2".to_vec(), b"http/1.1".to_vec()]);
        assert!(FrontTlsConfig::from_pem_files(&cert, &key, Some(&cert)).unwrap().client_auth());
        let e = FrontTlsConfig::from_pem_files(&cert, &other_key, None).unwrap_err();
        assert!(matches!(e, FrontTlsFileError::Identity { .. }), "{e}");
        let missing = dir.join("nope.pem");
        let e = FrontTlsConfig::from_pem_files(&missing, &key, None).unwrap_err();
        assert!(matches!(e, FrontTlsFileError::Pem(_)), "{e}");
        assert!(e.to_string().starts_with(&missing.display().to_string()), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
