//! Loopback chunk-write bandwidth of the data plane, next to a plain memcpy of the same bytes
//! measured in the same run.
//!
//! `cargo bench -p baton-dataplane --bench transport -- --out bench/dataplane-transport.json`
//!
//! 1P1D on 127.0.0.1: a producer writes 8 chunks of Llama-3.1-8B geometry (256-token chunks, bf16,
//! TP 1: 32 MiB pages) into a decoder rank's reserved pages over TCP, then the pages are freed; this
//! repeats. Only the writes are timed (reserve and free are the bookkeeping the core bench measures).
//! The memcpy figure copies the same number of bytes from one 32 MiB page into 8 distinct 32 MiB
//! pages in turn (the buffer's access pattern), in the same process, right after.
//! `BATON_BENCH_QUICK=1` runs one small round so the benchmark cannot rot.

#![allow(
    clippy::print_stdout,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_dataplane::device::Device;
use baton_dataplane::device::cpu::CpuDevice;
use baton_dataplane::device::shm::ShmDevice;
use baton_dataplane::transport::{ControlClient, ProducerClient, RankServer};
use baton_dataplane::{BufferOptions, KvGeometry, RankBuffer, RequestId, RequestKey, SystemClock};

fn memcpy_gbps(page: usize, pages: usize, bytes: u64) -> f64 {
    // Same access pattern as the writes: one source page copied into `pages` distinct destination
    // pages in turn, so the destination is as cold as the PD buffer's pages are.
    let src = vec![0xA5u8; page];
    let mut dst: Vec<Vec<u8>> = (0..pages).map(|_| vec![0u8; page]).collect();
    for d in dst.iter_mut() {
        d.copy_from_slice(&src); // page faults are not timed
    }
    let rounds = bytes / page as u64;
    let start = Instant::now();
    for i in 0..rounds {
        let d = &mut dst[(i as usize) % pages];
        d.copy_from_slice(&src);
        std::hint::black_box(d);
    }
    bytes as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// The same bytes through a plain loopback socket, read into a 1 MiB buffer and dropped: what TCP
/// alone costs here, the ceiling for any protocol on top of it.
async fn raw_tcp_gbps(page: usize, bytes: u64) -> f64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        while got < bytes {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got += n as u64;
        }
    });
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let data = vec![0x3Cu8; page];
    let start = Instant::now();
    let mut sent = 0u64;
    while sent < bytes {
        s.write_all(&data).await.unwrap();
        sent += page as u64;
    }
    reader.await.unwrap();
    bytes as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Writes `rounds` requests of `chunks` pages into a rank on `device` and returns (GB/s, bytes,
/// seconds) of the timed writes. `shm`: the producer writes through the rank's shared-memory export.
async fn chunk_writes<D: Device>(
    device: Arc<D>,
    geometry: KvGeometry,
    chunks: u32,
    rounds: u64,
    shm: bool,
) -> (f64, u64, f64) {
    let page = geometry.page_bytes_per_rank() as usize;
    let (sink, tx) = RankServer::<D>::sink();
    let buf =
        RankBuffer::new(device, geometry, 0, chunks, BufferOptions::default(), Arc::new(SystemClock), sink)
            .unwrap();
    let srv = RankServer::new(buf, 1, tx);
    let h = srv.start(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let fp = geometry.fingerprint();
    let mut ctl = ControlClient::connect(h.addr, fp, 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp, 0).await.unwrap();
    if shm {
        prod.use_shared_memory().unwrap();
    }
    let data = vec![0x3Cu8; page];
    let mut timed = Duration::ZERO;
    let mut bytes = 0u64;
    for round in 0..=rounds {
        let key = RequestKey::new(RequestId(u128::from(round)), 0);
        let addrs = ctl.reserve(key, chunks, Duration::from_secs(600), &[]).await.unwrap();
        let start = Instant::now();
        for (c, a) in &addrs {
            prod.write_chunk(key, *c, *a, &data).await.unwrap();
        }
        // Round 0 warms up (first touch of the buffer's pages) and is not counted.
        if round > 0 {
            timed += start.elapsed();
            bytes += page as u64 * u64::from(chunks);
        }
        let Ok(ready) = srv.take(key).unwrap().try_ready() else { panic!("not ready") };
        drop(ready);
    }
    assert_eq!(srv.buffer().stats().pages.free, chunks);
    h.shutdown().await;
    (bytes as f64 / timed.as_secs_f64() / 1e9, bytes, timed.as_secs_f64())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    // Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, bf16; 256-token chunks; TP 1 → 32 MiB.
    let geometry =
        if quick { KvGeometry::new(2, 8, 128, 2, 16, 1) } else { KvGeometry::new(32, 8, 128, 2, 256, 1) }
            .unwrap();
    let page = geometry.page_bytes_per_rank() as usize;
    let chunks: u32 = 8;
    let rounds: u64 = if quick { 2 } else { 8 };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (gbps, bytes, secs) = rt.block_on(chunk_writes(Arc::new(CpuDevice), geometry, chunks, rounds, false));
    let (shm_gbps, _, _) =
        rt.block_on(chunk_writes(Arc::new(ShmDevice::default()), geometry, chunks, rounds, true));
    let raw = rt.block_on(raw_tcp_gbps(page, bytes));
    let memcpy = memcpy_gbps(page, chunks as usize, bytes);
    let ratio = gbps / memcpy;
    let shm_ratio = shm_gbps / memcpy;
    println!("page {page} bytes, {bytes} bytes written in {secs:.3} s");
    println!("loopback chunk writes  {gbps:>7.2} GB/s   (TCP)");
    println!("same-host chunk writes {shm_gbps:>7.2} GB/s   (shared-memory export, grant/commit over TCP)");
    println!("raw loopback TCP       {raw:>7.2} GB/s");
    println!("memcpy (same run)      {memcpy:>7.2} GB/s");
    println!("TCP / memcpy           {:>7.1} %", ratio * 100.0);
    println!("shared / memcpy        {:>7.1} %", shm_ratio * 100.0);
    if let Some(path) = out {
        let json = format!(
            "{{\n  \"bench\": \"dataplane-transport\",\n  \"quick\": {quick},\n  \"page_bytes\": {page},\n  \"bytes\": {bytes},\n  \"seconds\": {secs:.6},\n  \"loopback_gbps\": {gbps:.3},\n  \"raw_tcp_gbps\": {raw:.3},\n  \"memcpy_gbps\": {memcpy:.3},\n  \"ratio\": {ratio:.3},\n  \"shm_gbps\": {shm_gbps:.3},\n  \"shm_ratio\": {shm_ratio:.3}\n}}\n"
        );
        std::fs::write(&path, json).unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        println!("wrote {path}");
    }
}
