//! TLS on the gateway's listener: the acceptor of the rustls configuration the configuration made
//! (`config::FrontTlsConfig`: versions, ALPN, mTLS).

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

impl From<FrontTlsConfig> for FrontTls {
    fn from(c: FrontTlsConfig) -> Self {
        Self { acceptor: TlsAcceptor::from(c.server), client_auth: c.client_auth }
    }
}

impl FrontTls {
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
            let tls = FrontTls::from(config);
            assert_eq!(tls.client_auth(), client_ca.is_some());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
