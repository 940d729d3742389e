//! Python replicas of LMCache's and vLLM's example proxies (the same request fields, the real pyzmq
//! and msgspec) drive the simulated engines: they speak what those proxies speak.

use baton_sim::kv::output_text;

use std::process::Stdio;

use tokio::io::AsyncWriteExt;

use crate::upstream::{peer, spawn_bound};

/// The request flow of LMCache's own proxy (a Python replica using pyzmq and msgspec: `/tokenize`,
/// prefill with `disagg_spec` and `ret_first_tok`, one `ProxyNotif` per decoder rank, decode from the
/// prompt plus the first token) drives the simulated engines: they speak what LMCache's proxy speaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcaches_proxy_flow_drives_the_simulated_engines() {
    use baton_sim::{LmcacheSimConfig, SimConfig, SimRole, launch, tiny_geometry};
    let g = tiny_geometry(2).unwrap();
    let mut dc = SimConfig::new(SimRole::Decode, g);
    dc.lmcache = Some(LmcacheSimConfig {
        pd_buffer_bytes: 16 * g.page_bytes_per_rank(),
        ..LmcacheSimConfig::default()
    });
    let decode = launch(dc).await.unwrap();
    let ranks = decode.engine.stats()["lmcache"]["ranks"].as_array().unwrap().clone();
    let ports = |k: &str| {
        ranks
            .iter()
            .map(|r| r[k].as_str().unwrap().rsplit(':').next().unwrap().to_owned())
            .collect::<Vec<_>>()
            .join(",")
    };
    let prompt = "the proxy from LMCache's examples, replayed against baton-sim";
    let Some(mut proxy) = peer(&[
        "proxy",
        "127.0.0.1",
        &format!("http://{}", decode.addr),
        &ports("init_addr"),
        &ports("alloc_addr"),
        prompt,
        "5",
    ]) else {
        return;
    };
    // The proxy binds its PULL first; the prefiller is launched to push to it.
    let (mut proxy, pull, mut lines) = spawn_bound(proxy.stderr(Stdio::piped())).await;
    let mut pc = SimConfig::new(SimRole::Prefill, g);
    pc.lmcache = Some(LmcacheSimConfig { proxy: Some(pull), ..LmcacheSimConfig::default() });
    let prefill = launch(pc).await.unwrap();
    let mut stdin = proxy.stdin.take().unwrap();
    stdin.write_all(format!("http://{}\n", prefill.addr).as_bytes()).await.unwrap();
    drop(stdin);
    let line = lines.next_line().await.unwrap();
    let out = proxy.wait_with_output().await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&line.unwrap_or_default()).unwrap();
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_nixl_proxy_flow_drives_the_simulated_engines() {
    use baton_sim::nixl::DEFAULT_NIXL_ABORT_TIMEOUT;
    use baton_sim::{SimConfig, SimRole, launch, tiny_geometry};
    let g = tiny_geometry(2).unwrap();
    let mut dc = SimConfig::new(SimRole::Decode, g);
    dc.nixl = Some(DEFAULT_NIXL_ABORT_TIMEOUT);
    let decode = launch(dc).await.unwrap();
    let mut pc = SimConfig::new(SimRole::Prefill, g);
    pc.nixl = Some(DEFAULT_NIXL_ABORT_TIMEOUT);
    let prefill = launch(pc).await.unwrap();
    let prompt = "the toy proxy from vLLM's NIXL tests, replayed against baton-sim";
    let Some(mut proxy) = peer(&[
        "nixl-proxy",
        &format!("http://{}", prefill.addr),
        &format!("http://{}", decode.addr),
        prompt,
        "6",
    ]) else {
        return;
    };
    let out = proxy.output().await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
    assert_eq!(v["text"], output_text(&ids, 6));
    let p = &v["params"];
    assert_eq!(
        (p["do_remote_prefill"].as_bool(), p["do_remote_decode"].as_bool()),
        (Some(true), Some(false))
    );
    assert_eq!(p["remote_block_ids"][0].as_array().unwrap().len(), ids.len().div_ceil(16), "{p}");
    assert_eq!(
        (p["remote_num_tokens"].as_u64(), p["transfer_mode"].as_str()),
        (Some(ids.len() as u64), Some("pull"))
    );
    assert_eq!(p["tp_size"], 2);
    let s = prefill.engine.stats();
    assert_eq!((s["nixl"]["blocks_held"].as_u64(), s["nixl"]["read"].as_u64()), (Some(0), Some(1)), "{s}");
    prefill.shutdown().await;
    decode.shutdown().await;
}
