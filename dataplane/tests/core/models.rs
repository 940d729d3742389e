//! The model geometries shipped in `configs/models/` parse to the published KV shapes.

use baton_dataplane::KvGeometry;

#[test]
fn shipped_model_geometries() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/models");
    // (file, chunk tokens, tp, kv bytes per token, page bytes per rank)
    let cases = [
        ("llama-3.1-8b.config.json", 256, 1, 131_072u64, 32u64 << 20),
        ("llama-3.1-70b.config.json", 256, 8, 327_680, 10 << 20),
        ("qwen3-8b.config.json", 256, 1, 147_456, 36 << 20),
    ];
    for (file, chunk, tp, per_token, page) in cases {
        let json = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
        let g = KvGeometry::from_hf_config(&json, chunk, tp, None).unwrap();
        assert_eq!(g.kv_bytes_per_token(), per_token, "{file}");
        assert_eq!(g.page_bytes_per_rank(), page, "{file}");
    }
}
