//! baton's ZMTP and LMCache msgpack against the real libraries: pyzmq (libzmq 4.3) and msgspec, from
//! the test venv that `scripts/test` builds (`tests/support/upstream_peer.py`).

use std::time::Duration;

use baton_dataplane::compat::lmcache::{AllocRequest, AllocResponse, PdMsg, ProxyNotif};
use baton_dataplane::compat::zmtp::{Connection, DEFAULT_MAX_MESSAGE, PullServer, RepServer, SocketType};
use tokio::sync::mpsc;

use crate::upstream::{peer, spawn_bound};

/// Two libzmq PUSH sockets (as two prefiller ranks) notify baton's PULL listener; msgspec's bytes
/// decode as `ProxyNotif`, and the two senders are told apart by connection.
#[tokio::test]
async fn libzmq_push_with_msgspec_notifications_reach_the_pull_listener() {
    let (tx, mut rx) = mpsc::channel(16);
    let server = PullServer::bind("127.0.0.1:0".parse().unwrap(), tx, 16, DEFAULT_MAX_MESSAGE).await.unwrap();
    let addr = server.addr.to_string();
    let (Some(mut a), Some(mut b)) =
        (peer(&["push", &addr, "req-7", "2"]), peer(&["push", &addr, "req-7", "1"]))
    else {
        return;
    };
    let (a, b) = (a.status().await.unwrap(), b.status().await.unwrap());
    assert!(a.success() && b.success());
    let mut got = Vec::new();
    for _ in 0..3 {
        let p = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.unwrap().unwrap();
        assert_eq!(p.frames.len(), 1);
        assert_eq!(
            PdMsg::decode(&p.frames[0]).unwrap(),
            PdMsg::ProxyNotif(ProxyNotif { req_id: "req-7".into() })
        );
        got.push(p.peer);
    }
    got.sort_unstable();
    got.dedup();
    assert_eq!(got.len(), 2, "two senders, two peers");
}

/// baton's PUSH (what the simulated prefiller sends) is read by a libzmq PULL socket and decodes as
/// LMCache's own `ProxyNotif`, so LMCache's proxy could consume it.
#[tokio::test]
async fn baton_push_is_read_by_libzmq_pull_and_msgspec() {
    let Some(mut pull) = peer(&["pull", "127.0.0.1", "2"]) else { return };
    let (mut child, addr, mut lines) = spawn_bound(&mut pull).await;
    let mut c = Connection::connect(addr, SocketType::Push, 1 << 20).await.unwrap();
    for id in ["a", "b"] {
        let m = PdMsg::ProxyNotif(ProxyNotif { req_id: id.into() }).encode().unwrap();
        c.send(&[&m]).await.unwrap();
    }
    for id in ["a", "b"] {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await.unwrap().unwrap();
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        assert_eq!(v, serde_json::json!({"type": "ProxyNotif", "req_id": id}));
    }
    assert!(child.wait().await.unwrap().success());
}

/// baton's SUB (the KV event reader's socket) subscribes to a libzmq PUB as vLLM's publisher
/// binds it: the messages on topics starting with `kv` arrive, frames intact and in order, and
/// those on other topics are filtered out by the publisher.
#[tokio::test]
async fn baton_sub_receives_what_libzmq_pub_publishes_on_its_topic() {
    let Some(mut publisher) = peer(&["pub", "127.0.0.1"]) else { return };
    let (mut child, addr, _lines) = spawn_bound(&mut publisher).await;
    let mut sub = Connection::connect(addr, SocketType::Sub, 1 << 20).await.unwrap();
    assert_eq!(sub.peer_type(), "PUB");
    sub.subscribe(b"kv").await.unwrap();
    let mut last: Option<u64> = None;
    let mut kv = 0;
    while kv < 5 {
        let frames =
            tokio::time::timeout(Duration::from_secs(10), sub.recv()).await.unwrap().unwrap().unwrap();
        assert_eq!(frames.len(), 3, "{frames:?}");
        assert!(frames[0].starts_with(b"kv"), "a message on {:?} passed the filter", frames[0]);
        assert_eq!(
            frames[2],
            [0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x90, 0xc0],
            "msgpack [1.5, [], None]"
        );
        let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
        if frames[0] == b"kv" {
            assert!(last.is_none_or(|l| seq == l + 1), "kv: {seq} after {last:?}");
            last = Some(seq);
            kv += 1;
        }
    }
    let _ = child.kill().await;
}

/// A libzmq REQ socket sends msgspec's `AllocRequest` to baton's REP server (the simulated decoder's
/// allocation channel) and decodes the `AllocResponse`.
#[tokio::test]
async fn libzmq_req_allocates_through_the_rep_server() {
    let rep = RepServer::bind("127.0.0.1:0".parse().unwrap(), 1 << 20, |body: Vec<u8>| async move {
        let reply = match PdMsg::decode(&body) {
            Ok(PdMsg::AllocRequest(AllocRequest { keys, last_chunk_toks, .. })) => AllocResponse {
                already_sent_indexes: vec![],
                remote_indexes: (0..keys.len() as i64).map(|i| i * 10 + last_chunk_toks).collect(),
            },
            _ => AllocResponse { already_sent_indexes: vec![], remote_indexes: vec![-1] },
        };
        PdMsg::AllocResponse(reply).encode().unwrap()
    })
    .await
    .unwrap();
    let Some(mut req) = peer(&["req", &rep.addr.to_string()]) else { return };
    let out = req.output().await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"type": "AllocResponse", "already_sent_indexes": [], "remote_indexes": [5, 15]})
    );
}
