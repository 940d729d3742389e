//! The data plane over TLS: mTLS peers with certificates from the rank's CA get in; peers without a
//! certificate, with one from another CA, or speaking plain TCP are refused before they reach the
//! buffer. Certificates are made at test time and loaded from PEM files, as operators provide them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baton_dataplane::device::cpu::CpuDevice;
use baton_dataplane::transport::{
    ControlClient, EventStream, ProducerClient, RankServer, ServerHandle, TlsClient, TlsServer,
};
use baton_dataplane::{BufferOptions, RankBuffer, RankEvent, SystemClock, TerminalState};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tokio::net::TcpListener;

use crate::common::{content, key, tiny};

/// PEM files of a test PKI: a CA, a server certificate for "localhost" and a client certificate.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("baton-tls-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, format!("baton test CA {tag}"));
        ca.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        for (name, usage) in
            [("server", ExtendedKeyUsagePurpose::ServerAuth), ("client", ExtendedKeyUsagePurpose::ClientAuth)]
        {
            let k = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
            p.extended_key_usages = vec![usage];
            let cert = p.signed_by(&k, &issuer).unwrap();
            std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
            std::fs::write(dir.join(format!("{name}.key")), k.serialize_pem()).unwrap();
        }
        Self { dir }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn client(&self, with_cert: bool) -> TlsClient {
        let id = with_cert.then(|| (self.file("client.pem"), self.file("client.key")));
        TlsClient::from_pem_files(
            &self.file("ca.pem"),
            "localhost",
            id.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
        )
        .unwrap()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Pki {
    fn server(&self, mtls: bool) -> TlsServer {
        let ca = self.file("ca.pem");
        TlsServer::from_pem_files(
            &self.file("server.pem"),
            &self.file("server.key"),
            mtls.then_some(ca.as_path()),
        )
        .unwrap()
    }
}

async fn tls_server(pki: &Pki, mtls: bool) -> (Arc<RankServer<CpuDevice>>, ServerHandle) {
    let (srv, h, _) = tls_server_with(pki.server(mtls)).await;
    (srv, h)
}

/// A rank serving `tls`; the handle it serves with, to replace its certificates.
async fn tls_server_with(tls: TlsServer) -> (Arc<RankServer<CpuDevice>>, ServerHandle, TlsServer) {
    let (sink, tx) = RankServer::<CpuDevice>::sink();
    let buf = RankBuffer::new(
        Arc::new(CpuDevice),
        tiny(),
        0,
        8,
        BufferOptions::default(),
        Arc::new(SystemClock),
        sink,
    )
    .unwrap();
    let srv = RankServer::new(buf, 1, tx);
    let h = srv.start_tls(TcpListener::bind("127.0.0.1:0").await.unwrap(), tls.clone()).unwrap();
    (srv, h, tls)
}

/// Certificates rotated on both ends while connections are open: a rank moved to a new CA (its
/// certificate and the client CA it trusts) serves new handshakes with the new ones only, and a
/// client handle moved to the new CA connects with it; connections opened before keep working.
#[tokio::test]
async fn replaced_certificates_serve_new_connections_and_open_ones_keep_theirs() {
    let (old, new) = (Pki::new("rotate-old"), Pki::new("rotate-new"));
    let (_srv, h, tls) = tls_server_with(old.server(true)).await;
    let fp = tiny().fingerprint();
    let client = old.client(true);
    let mut open = ControlClient::connect_with(h.addr, Some(&client), fp, 0).await.unwrap();
    // The rank moves to the new CA: new handshakes with the old CA's client fail, the new CA's pass.
    tls.replace(&new.server(true));
    assert!(ControlClient::connect_with(h.addr, Some(&client), fp, 0).await.is_err(), "the old CA got in");
    assert!(ControlClient::connect_with(h.addr, Some(&new.client(true)), fp, 0).await.is_ok());
    // A clone of the client handle (as a connection pool keeps one) follows its replacement.
    let pooled = client.clone();
    client.replace(&new.client(true));
    let mut fresh = ControlClient::connect_with(h.addr, Some(&pooled), fp, 0).await.unwrap();
    assert_eq!(fresh.info().await.unwrap().pages_total, 8);
    // The connection made before both replacements still serves.
    assert_eq!(open.info().await.unwrap().pages_total, 8);
    h.shutdown().await;
}

#[tokio::test]
async fn mtls_serves_known_peers_and_refuses_strangers() {
    let pki = Pki::new("mtls");
    let (srv, h) = tls_server(&pki, true).await;
    let fp = tiny().fingerprint();
    let client = pki.client(true);
    let mut events = EventStream::connect_with(h.addr, Some(&client), fp, 0).await.unwrap();
    let mut ctl = ControlClient::connect_with(h.addr, Some(&client), fp, 0).await.unwrap();
    let mut prod = ProducerClient::connect_with(h.addr, Some(&client), fp, 0).await.unwrap();
    let k = key(1);
    let addrs = ctl.reserve(k, 2, Duration::from_secs(30), &[]).await.unwrap();
    let page = srv.buffer().page_bytes();
    for (c, a) in &addrs {
        prod.write_chunk(k, *c, *a, &content(u64::from(*c), 0, page)).await.unwrap();
    }
    let e = tokio::time::timeout(Duration::from_secs(5), events.next()).await.unwrap().unwrap().unwrap();
    assert!(matches!(e, RankEvent::Status(s) if s.state == TerminalState::Ready && s.key() == k), "{e:?}");
    let before = srv.buffer().stats();

    // No client certificate: the handshake (or the first read after it) fails.
    let r = ControlClient::connect_with(h.addr, Some(&pki.client(false)), fp, 0).await;
    assert!(r.is_err(), "a peer without a certificate got in");
    // A certificate from another CA.
    let other = Pki::new("other");
    let r = ControlClient::connect_with(h.addr, Some(&other.client(true)), fp, 0).await;
    assert!(r.is_err(), "a peer with a foreign certificate got in");
    // Plain TCP to a TLS port.
    let r = ControlClient::connect(h.addr, fp, 0).await;
    assert!(r.is_err(), "a plaintext peer got in");
    assert_eq!(srv.buffer().stats(), before, "a refused peer changed the buffer");
    // The legitimate peer still works.
    assert_eq!(ctl.info().await.unwrap().pages_free, 6);
    h.shutdown().await;
}

#[tokio::test]
async fn tls_without_client_auth_checks_the_server() {
    let pki = Pki::new("server-only");
    let (_srv, h) = tls_server(&pki, false).await;
    let fp = tiny().fingerprint();
    let mut ctl = ControlClient::connect_with(h.addr, Some(&pki.client(false)), fp, 0).await.unwrap();
    assert_eq!(ctl.info().await.unwrap().pages_total, 8);
    // A client that trusts another CA refuses this server.
    let other = Pki::new("wrong-ca");
    assert!(ControlClient::connect_with(h.addr, Some(&other.client(false)), fp, 0).await.is_err());
    // Bad PEM inputs are refused with the file named.
    let missing =
        TlsServer::from_pem_files(&pki.file("nope.pem"), &pki.file("server.key"), None).unwrap_err();
    assert!(missing.to_string().contains("nope.pem"), "{missing}");
    h.shutdown().await;
}
