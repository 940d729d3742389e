//! GPU gather/scatter bandwidth next to a device-to-device copy of the same bytes, measured in the
//! same run, for Llama-3.1-8B (TP 1) and Llama-3.1-70B (TP 8) geometries (bf16) at 256-token chunks,
//! the engine cache NHD and HND with 16- and 64-token blocks, plus the CUDA IPC write bandwidth (a
//! page copied into an IPC-opened mapping of a buffer).
//!
//! `cargo bench -p baton-dataplane --bench cuda -- --out bench/cuda-gather-scatter.json`
//!
//! Each operation of a batch reads and writes other bytes than the one before, over at least 512 MiB
//! (more than any GPU's L2), so no figure is served from cache.
//! Bandwidth counts bytes read plus bytes written (2 × the page for every operation). Each figure is
//! the median of 5 timed batches of 50 operations (CUDA events around each batch) after a warm-up.
//! The engine's block table is shuffled (reversed). Without a GPU it prints
//! SKIP and exits 0 (`BATON_REQUIRE_GPU=1`: exits 1). `BATON_BENCH_QUICK=1`: 1 batch of 3.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation
)]

use std::process::ExitCode;

use baton_dataplane::device::cuda::{CudaDevice, CudaTensor, IpcBuffer};
use baton_dataplane::device::{CacheLayout, Device, KvSpan};
use baton_dataplane::{ChunkLayout, KvGeometry};

struct Row {
    name: String,
    page_mib: f64,
    gather_gbps: f64,
    scatter_gbps: f64,
    copy_gbps: f64,
    ipc_gbps: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// GB/s of `op` run `per` times per batch, `batches` batches, counting `bytes` per op.
fn time(gpu: &CudaDevice, batches: usize, per: usize, bytes: usize, mut op: impl FnMut()) -> f64 {
    op();
    gpu.synchronize().unwrap();
    let mut rates = Vec::new();
    for _ in 0..batches {
        let start = gpu.record_timed_event().unwrap();
        for _ in 0..per {
            op();
        }
        let end = gpu.record_timed_event().unwrap();
        end.synchronize().unwrap();
        let ms = start.elapsed_ms(&end).unwrap() as f64;
        rates.push((bytes * per) as f64 / (ms / 1e3) / 1e9);
    }
    median(rates)
}

/// How the engine's cache is laid out in a row: NHD or HND, and its block size in tokens.
#[derive(Clone, Copy)]
struct Cache {
    hnd: bool,
    block_size: u32,
}

fn geometry_row(
    gpu: &CudaDevice,
    name: &str,
    g: KvGeometry,
    cache_kind: Cache,
    batches: usize,
    per: usize,
) -> Row {
    let cl: ChunkLayout = g.chunk_layout();
    let Cache { hnd, block_size } = cache_kind;
    let page = cl.page_bytes();
    // Every operation of a batch touches other bytes than the last, and the ring spans 512 MiB or
    // more of buffer and as much of cache: the H100's 50 MiB L2 cannot serve a row from cache.
    let ring = u32::try_from((512usize << 20).div_ceil(page)).unwrap().max(4);
    let blocks_per_chunk = cl.chunk_tokens.div_ceil(block_size);
    let blocks = ring * blocks_per_chunk;
    let layout = if hnd {
        CacheLayout::hnd(blocks, block_size, cl.heads, cl.head_dim, cl.dtype_bytes)
    } else {
        CacheLayout::nhd(blocks, block_size, cl.heads, cl.head_dim, cl.dtype_bytes)
    };
    let name = format!("{name} {} b{block_size}", if hnd { "HND" } else { "NHD" });
    let cache: Vec<CudaTensor> =
        (0..cl.layers).map(|_| gpu.alloc_tensor(layout.min_tensor_bytes()).unwrap()).collect();
    let mut table: Vec<u32> = (0..blocks).collect();
    table.reverse();
    // Chunk `i` of the request whose blocks are `table`: its own blocks, its own page of the buffer.
    let span = |i: u32| KvSpan {
        layout: &layout,
        block_table: &table,
        first_token: i * blocks_per_chunk * block_size,
        tokens: cl.chunk_tokens,
    };
    let buf = gpu.alloc_buffer(ring, page).unwrap();
    let rw = 2 * page;
    let mut i = 0u32;
    let gather = time(gpu, batches, per, rw, || {
        i = (i + 1) % ring;
        gpu.gather_async(&cache, &span(i), &cl, &buf, i).unwrap();
    });
    let scatter = time(gpu, batches, per, rw, || {
        i = (i + 1) % ring;
        gpu.scatter_async(&buf, i, &cl, &cache, &span(i)).unwrap();
    });
    let copy = time(gpu, batches, per, rw, || {
        i = (i + 1) % ring;
        gpu.copy_page_async(&buf, i, &buf, (i + ring / 2) % ring, page).unwrap();
    });
    Row {
        name,
        page_mib: page as f64 / (1 << 20) as f64,
        gather_gbps: gather,
        scatter_gbps: scatter,
        copy_gbps: copy,
        ipc_gbps: None,
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let quick = std::env::var_os("BATON_BENCH_QUICK").is_some();
    let gpu = match CudaDevice::new(0) {
        Ok(g) => g,
        Err(e) => {
            if std::env::var("BATON_REQUIRE_GPU").as_deref() == Ok("1") {
                eprintln!("BATON_REQUIRE_GPU=1 but: {e}");
                return ExitCode::FAILURE;
            }
            println!("SKIP (no GPU): {e}");
            return ExitCode::SUCCESS;
        }
    };
    let (batches, per) = if quick { (1, 3) } else { (5, 50) };
    println!("GPU: {} (kernels: {:?})", gpu.name_of_gpu(), gpu.kernel_source());
    let g8 = KvGeometry::new(32, 8, 128, 2, 256, 1).unwrap();
    let g70 = KvGeometry::new(80, 8, 128, 2, 256, 8).unwrap();
    let mut rows = Vec::new();
    for (name, g) in [("Llama-3.1-8B TP1", g8), ("Llama-3.1-70B TP8", g70)] {
        for hnd in [false, true] {
            for block_size in [16, 64] {
                rows.push(geometry_row(&gpu, name, g, Cache { hnd, block_size }, batches, per));
            }
        }
    }
    // IPC write: this process exports, and (here, the same process) opens the handle and writes
    // pages into the mapping, as a same-node prefiller would.
    if let Some(row) = rows.first_mut() {
        let page = g8.chunk_layout().page_bytes();
        let owner = gpu.alloc_buffer(4, page).unwrap();
        let src = gpu.alloc_buffer(1, page).unwrap();
        let ipc = gpu.export(&owner).and_then(|e| IpcBuffer::open(&gpu, &e).ok());
        row.ipc_gbps = ipc.map(|ipc| {
            let mut i = 0;
            time(&gpu, batches, per, 2 * page, || {
                i = (i + 1) % 4;
                ipc.write_page(&gpu, &src, 0, i, page).unwrap();
            })
        });
    }
    let mut json = Vec::new();
    for r in &rows {
        println!(
            "{:<28} page {:>6.1} MiB  gather {:>7.1} GB/s ({:>5.1} %)  scatter {:>7.1} GB/s ({:>5.1} %)  d2d copy {:>7.1} GB/s{}",
            r.name,
            r.page_mib,
            r.gather_gbps,
            100.0 * r.gather_gbps / r.copy_gbps,
            r.scatter_gbps,
            100.0 * r.scatter_gbps / r.copy_gbps,
            r.copy_gbps,
            r.ipc_gbps.map_or(String::new(), |v| format!("  IPC write {v:.1} GB/s"))
        );
        json.push(format!(
            "    {{\"name\": \"{}\", \"page_mib\": {:.2}, \"gather_gbps\": {:.2}, \"scatter_gbps\": {:.2}, \"copy_gbps\": {:.2}, \"ipc_write_gbps\": {}}}",
            r.name, r.page_mib, r.gather_gbps, r.scatter_gbps, r.copy_gbps,
            r.ipc_gbps.map_or("null".to_owned(), |v| format!("{v:.2}"))
        ));
    }
    if let Some(path) = out {
        let text = format!(
            "{{\n  \"bench\": \"cuda-gather-scatter\",\n  \"gpu\": \"{}\",\n  \"quick\": {quick},\n  \"rows\": [\n{}\n  ]\n}}\n",
            gpu.name_of_gpu(),
            json.join(",\n")
        );
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        println!("wrote {path}");
    }
    ExitCode::SUCCESS
}
