//! The CUDA device against the CPU reference. Without a GPU these tests print SKIP, are counted by
//! `scripts/test` as GPU tests not run, and pass; with `BATON_REQUIRE_GPU=1` they fail instead (run
//! that way on a GPU machine).

use std::sync::Arc;

use baton_dataplane::ChunkLayout;
use baton_dataplane::device::cpu::{CpuDevice, CpuTensor};
use baton_dataplane::device::cuda::{self, CudaDevice, CudaTensor, IpcBuffer};
use baton_dataplane::device::{CacheLayout, Device, KvSpan};

use crate::common::content;

/// The GPU, or `None` (SKIP) without one; a panic when `BATON_REQUIRE_GPU=1`.
#[track_caller]
pub(crate) fn gpu() -> Option<Arc<CudaDevice>> {
    match CudaDevice::new(0) {
        Ok(d) => {
            eprintln!("cuda: {} (kernels: {:?})", d.name_of_gpu(), d.kernel_source());
            Some(Arc::new(d))
        }
        Err(e) => {
            assert!(std::env::var("BATON_REQUIRE_GPU").as_deref() != Ok("1"), "BATON_REQUIRE_GPU=1 but: {e}");
            crate::skip::skipped("gpu", &e.to_string());
            None
        }
    }
}

/// Without a driver or GPU the device is an error naming why, never a panic (dynamic loading).
#[test]
fn no_gpu_is_an_error_not_a_panic() {
    match (cuda::unavailable(), CudaDevice::new(0)) {
        (Some(why), Err(e)) => assert!(e.to_string().contains(&why), "{e} / {why}"),
        (None, Ok(_)) => {}
        (Some(why), Ok(_)) => panic!("unavailable() said {why:?} but the device opened"),
        (None, Err(e)) => panic!("a GPU is present but the device failed: {e}"),
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Timed events measure the work between them (the CUDA bench times with them); the data plane's
/// own events record no time, which the driver refuses to measure.
#[test]
fn gpu_timed_events_measure() {
    let Some(gpu) = gpu() else { return };
    let buf = gpu.alloc_buffer(2, 1 << 20).unwrap();
    let start = gpu.record_timed_event().unwrap();
    gpu.copy_page_async(&buf, 0, &buf, 1, 1 << 20).unwrap();
    let end = gpu.record_timed_event().unwrap();
    end.synchronize().unwrap();
    let ms = start.elapsed_ms(&end).unwrap();
    assert!(ms >= 0.0 && ms.is_finite(), "{ms} ms");
}

/// Random layouts (NHD and HND, block sizes 1-32, 1-4 layers and heads, head bytes 1-512 for fp8,
/// bf16 and fp32, partial chunks, shuffled block tables): gather and scatter on the GPU produce the
/// CPU reference's bytes exactly.
#[test]
fn gpu_gather_and_scatter_match_the_cpu_reference() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuDevice;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for case in 0..80 {
        let layers = 1 + rng.below(3) as u32;
        let heads = 1 + rng.below(4) as u32;
        let head_dim = [1, 3, 8, 16, 64, 128][rng.below(6) as usize];
        let dtype = [1, 2, 4][rng.below(3) as usize];
        let block_size = 1 + rng.below(32) as u32;
        let chunk_tokens = 1 + rng.below(64) as u32;
        let tokens = rng.below(u64::from(chunk_tokens) + 1) as u32;
        let first_token = rng.below(3 * u64::from(chunk_tokens)) as u32;
        let need = (first_token + tokens.max(1)).div_ceil(block_size);
        let num_blocks = need + rng.below(8) as u32;
        let hnd = rng.below(2) == 1;
        let layout = if hnd {
            CacheLayout::hnd(num_blocks, block_size, heads, head_dim, dtype)
        } else {
            CacheLayout::nhd(num_blocks, block_size, heads, head_dim, dtype)
        };
        let mut table: Vec<u32> = (0..num_blocks).collect();
        for i in (1..table.len()).rev() {
            table.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let chunk = ChunkLayout { layers, heads, head_dim, dtype_bytes: dtype, chunk_tokens };
        let span = KvSpan { layout: &layout, block_table: &table, first_token, tokens };
        let name = format!(
            "case {case}: {} layers {layers} heads {heads} head_dim {head_dim} dtype {dtype} block {block_size} chunk {chunk_tokens} tokens {tokens} first {first_token}",
            if hnd { "HND" } else { "NHD" }
        );
        let bytes = layout.min_tensor_bytes();
        let fill: Vec<Vec<u8>> = (0..layers).map(|l| content(case * 10 + u64::from(l), 0, bytes)).collect();
        let c_cache: Vec<CpuTensor> = fill
            .iter()
            .map(|f| {
                let t = cpu.alloc_tensor(bytes).unwrap();
                cpu.write_tensor(&t, 0, f).unwrap();
                t
            })
            .collect();
        let g_cache: Vec<CudaTensor> = fill
            .iter()
            .map(|f| {
                let t = gpu.alloc_tensor(bytes).unwrap();
                gpu.write_tensor(&t, 0, f).unwrap();
                t
            })
            .collect();
        let page = chunk.page_bytes();
        let c_buf = cpu.alloc_buffer(3, page).unwrap();
        let g_buf = gpu.alloc_buffer(3, page).unwrap();
        cpu.gather(&c_cache, &span, &chunk, &c_buf, 1).unwrap();
        gpu.gather(&g_cache, &span, &chunk, &g_buf, 1).unwrap();
        let (mut want, mut got) = (vec![0u8; page], vec![0u8; page]);
        cpu.read_page(&c_buf, 1, 0, &mut want).unwrap();
        gpu.read_page(&g_buf, 1, 0, &mut got).unwrap();
        assert!(want == got, "gather differs, {name}");
        // Scatter a fresh page into both caches: every byte of every layer tensor must agree.
        let fresh = content(case + 1_000_000, 1, page);
        cpu.write_page(&c_buf, 2, 0, &fresh).unwrap();
        gpu.write_page(&g_buf, 2, 0, &fresh).unwrap();
        cpu.scatter(&c_buf, 2, &chunk, &c_cache, &span).unwrap();
        gpu.scatter(&g_buf, 2, &chunk, &g_cache, &span).unwrap();
        for (l, (c, g)) in c_cache.iter().zip(&g_cache).enumerate() {
            let (mut a, mut b) = (vec![0u8; bytes], vec![0u8; bytes]);
            cpu.read_tensor(c, 0, &mut a).unwrap();
            gpu.read_tensor(g, 0, &mut b).unwrap();
            assert!(a == b, "scatter differs on layer {l}, {name}");
        }
    }
}

/// Checks of the device's own bounds: a span past the cache, a page out of range and a short layer
/// tensor are refused before any kernel runs.
#[test]
fn gpu_refuses_out_of_bounds_work() {
    let Some(gpu) = gpu() else { return };
    let layout = CacheLayout::nhd(4, 16, 2, 8, 2);
    let chunk = ChunkLayout { layers: 1, heads: 2, head_dim: 8, dtype_bytes: 2, chunk_tokens: 16 };
    let cache = vec![gpu.alloc_tensor(layout.min_tensor_bytes()).unwrap()];
    let buf = gpu.alloc_buffer(2, chunk.page_bytes()).unwrap();
    let table = [0, 1, 2, 3];
    let past = KvSpan { layout: &layout, block_table: &table, first_token: 60, tokens: 16 };
    assert!(gpu.gather(&cache, &past, &chunk, &buf, 0).is_err());
    let ok = KvSpan { layout: &layout, block_table: &table, first_token: 0, tokens: 16 };
    assert!(gpu.gather(&cache, &ok, &chunk, &buf, 2).is_err());
    let short = vec![gpu.alloc_tensor(8).unwrap()];
    assert!(gpu.gather(&short, &ok, &chunk, &buf, 0).is_err());
    assert!(gpu.gather(&cache, &ok, &chunk, &buf, 1).is_ok());
}

const IPC_ENV: &str = "BATON_TEST_IPC_EXPORT";

/// Two processes: this one owns a PD buffer and exports it; a second process (this test binary,
/// re-run for `ipc_child`) opens the handle and writes a page device to device; the bytes arrive.
#[test]
fn gpu_ipc_write_from_another_process() {
    let Some(gpu) = gpu() else { return };
    let page = 1 << 20;
    let buf = gpu.alloc_buffer(4, page).unwrap();
    let export = gpu.export(&buf).expect("a CUDA buffer exports an IPC handle");
    assert!(export.starts_with(cuda::IPC_PREFIX));
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "device_cuda::ipc_child", "--ignored", "--nocapture"])
        .env(IPC_ENV, &export)
        .output()
        .unwrap();
    assert!(out.status.success(), "child failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child test did not run");
    let mut got = vec![0u8; page];
    gpu.read_page(&buf, 3, 0, &mut got).unwrap();
    assert!(got == content(77, 3, page), "page 3 does not hold what the other process wrote");
    let mut untouched = vec![1u8; page];
    gpu.read_page(&buf, 2, 0, &mut untouched).unwrap();
    assert!(untouched.iter().all(|b| *b == 0), "the other process wrote outside its page");
}

/// The second process of [`gpu_ipc_write_from_another_process`] (run only by it).
#[test]
#[ignore = "run by gpu_ipc_write_from_another_process in a second process"]
fn ipc_child() {
    let Ok(export) = std::env::var(IPC_ENV) else { return };
    let gpu = CudaDevice::new(0).unwrap();
    let remote = IpcBuffer::open(&gpu, &export).unwrap();
    let page = remote.page_bytes();
    let local = gpu.alloc_buffer(1, page).unwrap();
    gpu.write_page(&local, 0, 0, &content(77, 3, page)).unwrap();
    remote.write_page(&gpu, &local, 0, 3, page).unwrap();
    assert!(remote.write_page(&gpu, &local, 0, 4, page).is_err(), "page 4 is out of range");
}

/// The data plane's lifecycle property test (random interleavings of reserve, write, fence,
/// cancel, expire, consume and shared prefixes on two ranks, every byte read back) once more with
/// the buffers in GPU memory.
#[test]
fn gpu_buffer_lifecycle_properties_hold() {
    use proptest::test_runner::{Config, TestRunner};
    let Some(gpu) = gpu() else { return };
    let mut runner = TestRunner::new(Config { cases: 64, ..Config::default() });
    runner
        .run(&proptest::collection::vec(crate::properties::op(), 1..80), |ops| {
            crate::properties::run(&gpu, ops)
        })
        .unwrap();
}
