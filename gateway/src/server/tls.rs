//! TLS on the gateway's listener (rustls, ring provider): TLS 1.2 and 1.3 only (1.0 and 1.1 are
//! refused: deprecated by RFC 8996), ALPN `h2` and `http/1.1`, and client-certificate verification
//! (mTLS) when a client CA is configured.

use std::sync::Arc;

use rustls::server::{VerifierBuilderError, WebPkiClientVerifier};
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::config::FrontTlsConfig;

/// A listener's TLS settings.
#[derive(Clone)]
pub struct FrontTls {
    acceptor: TlsAcceptor,
    /// Clients must present a certificate (mTLS).
    client_auth: bool,
}

impl std::fmt::Debug for FrontTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrontTls")
    }
}

/// Why a listener's TLS could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrontTlsError {
    /// rustls refused the protocol versions (never with the ring provider, which has both).
    #[error("{source}")]
    Versions {
        #[source]
        source: rustls::Error,
    },
    /// A client CA certificate is not a usable trust anchor.
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

impl FrontTls {
    pub fn new(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        client_ca: Option<Vec<CertificateDer<'static>>>,
    ) -> Result<Self, FrontTlsError> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|source| FrontTlsError::Versions { source })?;
        let client_auth = client_ca.is_some();
        let builder = match client_ca {
            Some(cas) => {
                let mut roots = RootCertStore::empty();
                for ca in cas {
                    roots.add(ca).map_err(|source| FrontTlsError::ClientCa { source })?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                    .build()
                    .map_err(|source| FrontTlsError::ClientVerifier { source })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config =
            builder.with_single_cert(chain, key).map_err(|source| FrontTlsError::Identity { source })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self { acceptor: TlsAcceptor::from(Arc::new(config)), client_auth })
    }

    /// The listener's TLS as configured (its files already read and checked there).
    pub fn from_config(c: FrontTlsConfig) -> Result<Self, FrontTlsError> {
        Self::new(c.chain, c.key, c.client_ca)
    }

    /// Clients must present a certificate from the client CA.
    pub fn client_auth(&self) -> bool {
        self.client_auth
    }

    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
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
            let tls = FrontTls::from_config(config).unwrap();
            assert_eq!(tls.client_auth(), client_ca.is_some());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
