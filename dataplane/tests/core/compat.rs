//! baton's ZMTP and LMCache msgpack against the real libraries: pyzmq (libzmq 4.3) and msgspec, from
//! the test venv that `scripts/test` builds (`tests/support/upstream_peer.py`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use baton_dataplane::compat::lmcache::{AllocRequest, AllocResponse, PdMsg, ProxyNotif};
use baton_dataplane::compat::zmtp::{Connection, DEFAULT_MAX_MESSAGE, PullServer, RepServer, SocketType};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

fn python() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = std::env::var_os("BATON_TEST_PYTHON")
        .map_or_else(|| root.join(".cache/venv/bin/python"), PathBuf::from);
    assert!(p.exists(), "{} is missing: scripts/test creates it (pyzmq, msgspec)", p.display());
    p
}

fn peer(args: &[&str]) -> Command {
    let mut c = Command::new(python());
    c.arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support/upstream_peer.py"))
        .args(args)
        .kill_on_drop(true);
    c
}

fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// Two libzmq PUSH sockets (as two prefiller ranks) notify baton's PULL listener; msgspec's bytes
/// decode as `ProxyNotif`, and the two senders are told apart by connection.
#[tokio::test]
async fn libzmq_push_with_msgspec_notifications_reach_the_pull_listener() {
    let (tx, mut rx) = mpsc::channel(16);
    let server = PullServer::bind("127.0.0.1:0".parse().unwrap(), tx, 16, DEFAULT_MAX_MESSAGE).await.unwrap();
    let addr = server.addr.to_string();
    let a = peer(&["push", &addr, "req-7", "2"]).status().await.unwrap();
    let b = peer(&["push", &addr, "req-7", "1"]).status().await.unwrap();
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
    let addr = free_port();
    let mut child = peer(&["pull", &addr.to_string(), "2"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("bound"));
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
    let out = peer(&["req", &rep.addr.to_string()]).output().await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"type": "AllocResponse", "already_sent_indexes": [], "remote_indexes": [5, 15]})
    );
}

/// The request flow of LMCache's own proxy (a Python replica using pyzmq and msgspec: `/tokenize`,
/// prefill with `disagg_spec` and `ret_first_tok`, one `ProxyNotif` per decoder rank, decode from the
/// prompt plus the first token) drives the simulated engines: they speak what LMCache's proxy speaks.
#[cfg(feature = "sim")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcaches_proxy_flow_drives_the_simulated_engines() {
    use baton_dataplane::sim::kv::output_text;
    use baton_dataplane::sim::{LmcacheSimConfig, SimConfig, SimRole, launch, tiny_geometry};
    let g = tiny_geometry(2).unwrap();
    let pull = free_port();
    let mut dc = SimConfig::new(SimRole::Decode, g);
    dc.lmcache = Some(LmcacheSimConfig {
        pd_buffer_bytes: 16 * g.page_bytes_per_rank(),
        ..LmcacheSimConfig::default()
    });
    let decode = launch(dc).await.unwrap();
    let mut pc = SimConfig::new(SimRole::Prefill, g);
    pc.lmcache = Some(LmcacheSimConfig { proxy: Some(pull), ..LmcacheSimConfig::default() });
    let prefill = launch(pc).await.unwrap();
    let ranks = decode.engine.stats()["lmcache"]["ranks"].as_array().unwrap().clone();
    let ports = |k: &str| {
        ranks
            .iter()
            .map(|r| r[k].as_str().unwrap().rsplit(':').next().unwrap().to_owned())
            .collect::<Vec<_>>()
            .join(",")
    };
    let prompt = "the proxy from LMCache's examples, replayed against baton-sim";
    let out = peer(&[
        "proxy",
        &pull.to_string(),
        &format!("http://{}", prefill.addr),
        &format!("http://{}", decode.addr),
        "127.0.0.1",
        &ports("init_addr"),
        &ports("alloc_addr"),
        prompt,
        "5",
    ])
    .output()
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
    assert_eq!(v["text"], output_text(&ids, 5));
    let s = decode.engine.stats();
    for r in s["lmcache"]["ranks"].as_array().unwrap() {
        assert_eq!((r["used_chunks"].as_u64(), r["recomputed"].as_u64()), (Some(0), Some(0)), "{s}");
        assert_eq!(r["retrieved_chunks"], ids.len().div_ceil(16) as u64);
    }
    prefill.shutdown().await;
    decode.shutdown().await;
}

/// The request flow of vLLM's NIXL `toy_proxy_server.py` (a Python replica with the same fields)
/// drives the simulated engines: the prefiller answers the `remote_*` fields, the decoder pulls with
/// them and the producer's blocks are freed.
#[cfg(feature = "sim")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_nixl_proxy_flow_drives_the_simulated_engines() {
    use baton_dataplane::sim::kv::output_text;
    use baton_dataplane::sim::nixl::DEFAULT_NIXL_ABORT_TIMEOUT;
    use baton_dataplane::sim::{SimConfig, SimRole, launch, tiny_geometry};
    let g = tiny_geometry(2).unwrap();
    let mut dc = SimConfig::new(SimRole::Decode, g);
    dc.nixl = Some(DEFAULT_NIXL_ABORT_TIMEOUT);
    let decode = launch(dc).await.unwrap();
    let mut pc = SimConfig::new(SimRole::Prefill, g);
    pc.nixl = Some(DEFAULT_NIXL_ABORT_TIMEOUT);
    let prefill = launch(pc).await.unwrap();
    let prompt = "the toy proxy from vLLM's NIXL tests, replayed against baton-sim";
    let out = peer(&[
        "nixl-proxy",
        &format!("http://{}", prefill.addr),
        &format!("http://{}", decode.addr),
        prompt,
        "6",
    ])
    .output()
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
    assert_eq!(v["text"], output_text(&ids, 6));
    let p = &v["params"];
    assert_eq!(
        (p["do_remote_prefill"].as_bool(), p["do_remote_decode"].as_bool()),
        (Some(true), Some(false))
    );
    assert_eq!(p["remote_block_ids"].as_array().unwrap().len(), ids.len().div_ceil(16), "{p}");
    assert_eq!(p["tp_size"], 2);
    let s = prefill.engine.stats();
    assert_eq!((s["nixl"]["blocks_held"].as_u64(), s["nixl"]["read"].as_u64()), (Some(0), Some(1)), "{s}");
    prefill.shutdown().await;
    decode.shutdown().await;
}
