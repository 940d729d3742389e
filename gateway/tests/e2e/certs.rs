//! Certificates for the tests' TLS: a CA made on the spot (rcgen) and leaves it signs.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A CA that issues leaf certificates (PEM chain, PEM key, and both as DER) for the names given,
/// good for servers and clients.
pub(crate) struct Ca {
    pub(crate) pem: String,
    pub(crate) der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    pub(crate) fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let cert = p.self_signed(&key).unwrap();
        Self { pem: cert.pem(), der: cert.der().clone(), issuer: Issuer::new(p, key) }
    }

    pub(crate) fn leaf(
        &self,
        names: &[&str],
    ) -> (String, String, CertificateDer<'static>, PrivateKeyDer<'static>) {
        let k = KeyPair::generate().unwrap();
        let mut p =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).unwrap();
        p.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let c = p.signed_by(&k, &self.issuer).unwrap();
        (c.pem(), k.serialize_pem(), c.der().clone(), PrivateKeyDer::Pkcs8(k.serialize_der().into()))
    }
}
