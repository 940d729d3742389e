"""The data plane over mTLS from Python: a RankServer serving TLS with a client CA, the gateway's
Control and a prefill rank's Producer connecting with certificates from that CA (made here, by
trustme), and strangers (plain TCP, TLS without a certificate, a certificate from another CA)
refused at the handshake, their attempts counted by the rank and nothing they sent taking a page."""

import pytest
import trustme

import baton_dataplane as bd

G = bd.KvGeometry(layers=2, kv_heads=2, head_dim=16, dtype_bytes=2, chunk_tokens=16, tp_size=1)


@pytest.fixture
def pki(tmp_path):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    server = ca.issue_cert("localhost", "rank-0.pd.internal")
    server.cert_chain_pems[0].write_to_path(str(tmp_path / "rank.pem"))
    server.private_key_pem.write_to_path(str(tmp_path / "rank.key"))
    peer = ca.issue_cert("gateway.pd.internal")
    peer.cert_chain_pems[0].write_to_path(str(tmp_path / "peer.pem"))
    peer.private_key_pem.write_to_path(str(tmp_path / "peer.key"))
    other = trustme.CA().issue_cert("gateway.pd.internal")
    other.cert_chain_pems[0].write_to_path(str(tmp_path / "other.pem"))
    other.private_key_pem.write_to_path(str(tmp_path / "other.key"))
    return tmp_path


def rank(pki, pages=8):
    return bd.RankServer(
        G, pages=pages, tls_cert=pki / "rank.pem", tls_key=pki / "rank.key", tls_client_ca=pki / "ca.pem"
    )


def test_certified_peers_reserve_and_write_over_mtls(pki):
    with rank(pki) as server:
        tls = {"tls_ca": pki / "ca.pem", "tls_cert": pki / "peer.pem", "tls_key": pki / "peer.key"}
        with bd.Control(server.address, G, **tls) as c, bd.Producer(server.address, G, **tls) as p:
            addrs = c.reserve(7, 2, 60_000)
            assert len(addrs) == 2
            for chunk, page, gen in addrs:
                p.write_chunk(7, chunk, page, gen, bytes([chunk + 1]) * p.page_bytes)
            p.fence(7)
        r = server.take(7)
        assert r is not None
        assert server.stats()["handshakes_refused"] == 0


def test_the_name_is_checked(pki):
    with rank(pki) as server:
        bd.Control(server.address, G, tls_ca=pki / "ca.pem", tls_cert=pki / "peer.pem",
                   tls_key=pki / "peer.key", server_name="rank-0.pd.internal").close()
        with pytest.raises(bd.TransportError):
            bd.Control(server.address, G, tls_ca=pki / "ca.pem", tls_cert=pki / "peer.pem",
                       tls_key=pki / "peer.key", server_name="decode-9.pd.internal")


def refused(make):
    """Whether a connection made by `make` is refused: at the handshake, or (TLS 1.3 reports the
    server's verdict on a client certificate after the client's side is done) at its first call."""
    try:
        c = make()
    except bd.TransportError:
        return True
    try:
        c.reserve(9, 1, 60_000)
    except (bd.TransportError, bd.GuardClosed):
        return True
    return False


def test_strangers_are_refused_and_counted(pki):
    with rank(pki) as server:
        before = server.stats()
        ca = pki / "ca.pem"
        assert refused(lambda: bd.Control(server.address, G)), "plain TCP"
        assert refused(lambda: bd.Control(server.address, G, tls_ca=ca)), "TLS without a certificate"
        assert refused(
            lambda: bd.Control(server.address, G, tls_ca=ca, tls_cert=pki / "other.pem", tls_key=pki / "other.key")
        ), "a certificate from another CA"
        assert refused(lambda: bd.Producer(server.address, G)), "a producer in plain TCP"
        import time

        deadline = time.monotonic() + 5
        while server.stats()["handshakes_refused"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        after = server.stats()
        assert after["handshakes_refused"] >= 4, after
        assert (after["free"], after["requests"]) == (before["free"], before["requests"]), after


def test_tls_arguments_are_checked(pki):
    with pytest.raises(ValueError, match="go together"):
        bd.RankServer(G, pages=2, tls_cert=pki / "rank.pem")
    with pytest.raises(ValueError, match="needs tls_cert"):
        bd.RankServer(G, pages=2, tls_client_ca=pki / "ca.pem")
    with pytest.raises(ValueError, match="needs tls_ca"):
        bd.Control("127.0.0.1:1", G, tls_cert=pki / "peer.pem", tls_key=pki / "peer.key")
    with pytest.raises(ValueError, match="data-plane TLS"):
        bd.RankServer(G, pages=2, tls_cert=pki / "missing.pem", tls_key=pki / "rank.key")
