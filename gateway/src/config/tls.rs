//! The TLS of the gateway's own listeners (public and admin) as configured: the PEM files read and
//! checked. The server builds its acceptor from a [`FrontTlsConfig`] (`server::tls`); this module
//! never depends on the server.

use std::fmt;
use std::path::Path;

use baton_dataplane::transport::{TlsError, pem_certs, pem_key};
use rustls::RootCertStore;
use rustls::sign::CertifiedKey;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// A listener's TLS: its certificate chain and key and, for mTLS, the CA certificates that clients'
/// certificates must chain to.
pub struct FrontTlsConfig {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    /// With it, clients must present a certificate from one of these CAs (mTLS).
    pub client_ca: Option<Vec<CertificateDer<'static>>>,
}

impl fmt::Debug for FrontTlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The certificates' bytes say nothing in a log; the key is never shown.
        f.debug_struct("FrontTlsConfig")
            .field("chain", &self.chain.len())
            .field("client_ca", &self.client_ca.as_ref().map(Vec::len))
            .finish_non_exhaustive()
    }
}

/// Why a listener's TLS files are refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrontTlsFileError {
    /// A PEM file could not be read, or holds no certificate or key.
    #[error(transparent)]
    Pem(#[from] TlsError),
    /// The key is of a kind that cannot sign, or does not match the certificate.
    #[error("{source}")]
    Identity {
        #[source]
        source: rustls::Error,
    },
    /// A certificate of the client CA file is not a usable trust anchor.
    #[error("client CA: {source}")]
    ClientCa {
        #[source]
        source: rustls::Error,
    },
}

impl FrontTlsConfig {
    /// Reads the certificate chain, the key and the client CA from PEM files, and checks what the
    /// server would refuse when it builds the listener (with the same messages), so that a bad
    /// file is refused with the configuration (`check-config` included), not at start.
    pub fn from_pem_files(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<Self, FrontTlsFileError> {
        let key = pem_key(key)?;
        let chain = pem_certs(cert)?;
        let client_ca = client_ca.map(pem_certs).transpose()?;
        if let Some(cas) = &client_ca {
            let mut roots = RootCertStore::empty();
            for ca in cas {
                roots.add(ca.clone()).map_err(|source| FrontTlsFileError::ClientCa { source })?;
            }
        }
        let provider = rustls::crypto::ring::default_provider();
        CertifiedKey::from_der(chain.clone(), key.clone_key(), &provider)
            .map_err(|source| FrontTlsFileError::Identity { source })?;
        Ok(Self { chain, key, client_ca })
    }

    /// Clients must present a certificate from the client CA.
    pub fn client_auth(&self) -> bool {
        self.client_ca.is_some()
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
        assert_eq!((plain.chain.len(), plain.client_auth()), (1, false));
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
