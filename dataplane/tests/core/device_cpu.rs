//! Gather/scatter on the CPU device round-trip bytes exactly, for several layouts.

use baton_dataplane::KvGeometry;
use baton_dataplane::device::cpu::{CpuDevice, CpuTensor};
use baton_dataplane::device::{CacheLayout, Device, DeviceError, KvSpan};

use crate::common::content;

struct Case {
    name: &'static str,
    hnd_src: bool,
    hnd_dst: bool,
    block_size: u32,
    tokens: u32,
    first_token: u32,
}

fn cache(dev: &CpuDevice, layers: u32, layout: &CacheLayout, seed: u64) -> Vec<CpuTensor> {
    (0..layers)
        .map(|l| {
            let t = dev.alloc_tensor(layout.min_tensor_bytes()).unwrap();
            dev.write_tensor(&t, 0, &content(seed + u64::from(l), 0, layout.min_tensor_bytes())).unwrap();
            t
        })
        .collect()
}

fn read_elem(
    dev: &CpuDevice,
    t: &CpuTensor,
    l: &CacheLayout,
    kv: u32,
    block: u32,
    slot: u32,
    head: u32,
) -> Vec<u8> {
    let mut v = vec![0; l.head_bytes()];
    dev.read_tensor(t, l.offset(kv, block, slot, head), &mut v).unwrap();
    v
}

#[test]
fn gather_scatter_round_trips_exactly() {
    let cases = [
        Case {
            name: "nhd->nhd bs16 full",
            hnd_src: false,
            hnd_dst: false,
            block_size: 16,
            tokens: 32,
            first_token: 0,
        },
        Case {
            name: "hnd->hnd bs32 full",
            hnd_src: true,
            hnd_dst: true,
            block_size: 32,
            tokens: 32,
            first_token: 32,
        },
        Case {
            name: "nhd->hnd bs16 partial",
            hnd_src: false,
            hnd_dst: true,
            block_size: 16,
            tokens: 13,
            first_token: 64,
        },
        Case {
            name: "hnd->nhd bs32 partial",
            hnd_src: true,
            hnd_dst: false,
            block_size: 32,
            tokens: 1,
            first_token: 96,
        },
        Case {
            name: "nhd bs16 unaligned start",
            hnd_src: false,
            hnd_dst: false,
            block_size: 16,
            tokens: 20,
            first_token: 7,
        },
    ];
    // 3 layers, 4 KV heads over TP 2 (2 per rank), head_dim 8, bf16, 32-token chunks.
    let g = KvGeometry::new(3, 4, 8, 2, 32, 2).unwrap();
    let chunk = g.chunk_layout();
    let dev = CpuDevice;
    for c in cases {
        let mk = |hnd: bool| {
            if hnd {
                CacheLayout::hnd(16, c.block_size, 2, 8, 2)
            } else {
                CacheLayout::nhd(16, c.block_size, 2, 8, 2)
            }
        };
        let (ls, ld) = (mk(c.hnd_src), mk(c.hnd_dst));
        let src = cache(&dev, 3, &ls, 1);
        let dst = cache(&dev, 3, &ld, 1000);
        // Scrambled block tables, different on each side.
        let bt_src: Vec<u32> = (0..16).map(|i| (i * 7 + 3) % 16).collect();
        let bt_dst: Vec<u32> = (0..16).map(|i| (i * 5 + 1) % 16).collect();
        let page = dev.alloc_buffer(1, chunk.page_bytes()).unwrap();
        let span_src =
            KvSpan { layout: &ls, block_table: &bt_src, first_token: c.first_token, tokens: c.tokens };
        let span_dst =
            KvSpan { layout: &ld, block_table: &bt_dst, first_token: c.first_token, tokens: c.tokens };
        dev.gather(&src, &span_src, &chunk, &page, 0).unwrap();
        dev.scatter(&page, 0, &chunk, &dst, &span_dst).unwrap();
        for layer in 0..3u32 {
            for kv in 0..2 {
                for t in 0..c.tokens {
                    let abs = c.first_token + t;
                    for head in 0..2 {
                        let a = read_elem(
                            &dev,
                            &src[layer as usize],
                            &ls,
                            kv,
                            bt_src[(abs / c.block_size) as usize],
                            abs % c.block_size,
                            head,
                        );
                        let b = read_elem(
                            &dev,
                            &dst[layer as usize],
                            &ld,
                            kv,
                            bt_dst[(abs / c.block_size) as usize],
                            abs % c.block_size,
                            head,
                        );
                        assert_eq!(a, b, "{}: layer {layer} kv {kv} token {abs} head {head}", c.name);
                        let mut p = vec![0; chunk.head_bytes()];
                        dev.read_page(
                            &page,
                            0,
                            chunk.offset(layer, kv, t) + head as usize * chunk.head_bytes(),
                            &mut p,
                        )
                        .unwrap();
                        assert_eq!(a, p, "{}: page layout", c.name);
                    }
                }
            }
        }
        // Tokens outside the span were not touched on the destination.
        let untouched = cache(&dev, 3, &ld, 1000);
        if c.first_token > 0 {
            let abs = c.first_token - 1;
            let blk = bt_dst[(abs / c.block_size) as usize];
            assert_eq!(
                read_elem(&dev, &dst[0], &ld, 0, blk, abs % c.block_size, 0),
                read_elem(&dev, &untouched[0], &ld, 0, blk, abs % c.block_size, 0),
                "{}: token before the span",
                c.name
            );
        }
    }
}

#[test]
fn bad_spans_are_refused_before_any_byte_moves() {
    let g = KvGeometry::new(2, 2, 8, 2, 16, 1).unwrap();
    let chunk = g.chunk_layout();
    let dev = CpuDevice;
    let l = CacheLayout::nhd(4, 16, 2, 8, 2);
    let cache: Vec<CpuTensor> = (0..2).map(|_| dev.alloc_tensor(l.min_tensor_bytes()).unwrap()).collect();
    let page = dev.alloc_buffer(1, chunk.page_bytes()).unwrap();
    let cases: Vec<(&str, Vec<u32>, u32, u32)> = vec![
        ("block out of range", vec![0, 9], 0, 16),
        ("table too short", vec![0], 10, 16),
        ("span longer than chunk", vec![0, 1], 0, 17),
    ];
    for (name, bt, first, tokens) in cases {
        let span = KvSpan { layout: &l, block_table: &bt, first_token: first, tokens };
        assert!(matches!(dev.gather(&cache, &span, &chunk, &page, 0), Err(DeviceError::Layout(_))), "{name}");
    }
    let wrong_heads = CacheLayout::nhd(4, 16, 1, 8, 2);
    let span = KvSpan { layout: &wrong_heads, block_table: &[0], first_token: 0, tokens: 1 };
    assert!(dev.gather(&cache, &span, &chunk, &page, 0).is_err());
    assert_eq!(dev.write_page(&page, 1, 0, &[0]), Err(DeviceError::NoSuchPage { page: 1, pages: 1 }));
    assert!(matches!(
        dev.write_page(&page, 0, chunk.page_bytes(), &[0]),
        Err(DeviceError::OutOfBounds { .. })
    ));
}

/// A buffer file whose owner died without removing it (killed: no `Drop` ran) is removed when the
/// next buffer is made in the directory; a live owner's file, and files that are not buffers, stay.
#[test]
fn a_dead_owners_shared_memory_file_is_swept_and_a_live_ones_kept() {
    use baton_dataplane::device::shm::ShmDevice;
    let dir = std::env::temp_dir().join(format!("baton-shm-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dev = ShmDevice::new(&dir);
    let live = dev.alloc_buffer(2, 64).unwrap();
    // What a killed process leaves: a buffer file nobody holds a lock on.
    let dead = dir.join("baton-pd-4000000-0");
    std::fs::write(&dead, vec![0u8; 128]).unwrap();
    let other = dir.join("notes.txt");
    std::fs::write(&other, b"not a buffer").unwrap();
    let next = dev.alloc_buffer(2, 64).unwrap();
    assert!(!dead.exists(), "the dead owner's file was left");
    assert!(live.path().exists(), "a live buffer's file was removed");
    assert!(other.exists());
    let names = |d: &std::path::Path| -> usize {
        std::fs::read_dir(d).unwrap().filter(|e| e.as_ref().unwrap().file_name() != "notes.txt").count()
    };
    assert_eq!(names(&dir), 2, "only the two live buffers' files");
    drop((live, next));
    assert_eq!(names(&dir), 0, "a dropped buffer removes its file");
    std::fs::remove_dir_all(&dir).unwrap();
}
