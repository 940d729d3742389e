//! KV-cache geometry: how many bytes one token's KV cache takes, how a chunk of tokens is laid out in
//! one page of the PD buffer, and how big that page is on each tensor-parallel rank.
//!
//! Capacity is derived here and nowhere else: the gateway reads page counts from the decoder's data
//! plane instead of typing them twice.
//!
//! Page layout (per rank, "chunk layout"): `[layer][k|v][token][head][head_dim]` bytes, with the token
//! dimension always `chunk_tokens` long so the offset of any element is fixed; the last chunk of a
//! prompt may be partial, its unused tokens are left as they are.
//!
//! MLA (DeepSeek-V2/V3: one latent vector per token and layer, no K/V split) is not modelled yet:
//! [`KvGeometry::from_hf_config`] refuses such configs with a clear error instead of guessing. It will
//! be added as a second layout of this type.

use serde::Deserialize;
use thiserror::Error;

/// Errors building a geometry.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum GeometryError {
    /// A dimension is 0.
    #[error("{field} must be greater than 0")]
    Zero { field: &'static str },
    /// The KV heads cannot be split evenly over the TP ranks.
    #[error("kv_heads {kv_heads} cannot be split over tp_size {tp_size}: one must divide the other")]
    HeadsNotDivisible { kv_heads: u32, tp_size: u32 },
    /// A page (one chunk's KV on one rank) is larger than the limit.
    #[error("page of {bytes} bytes per rank is too large (limit {limit})")]
    PageTooLarge { bytes: u64, limit: u64 },
    /// `config.json` is not JSON of a model config.
    #[error("config.json: {0}")]
    Json(String),
    /// `config.json` lacks a field the geometry needs.
    #[error("config.json: missing field {0}")]
    Missing(&'static str),
    /// `config.json` names a dtype the geometry has no size for.
    #[error("config.json: unsupported dtype {0:?} (expected bfloat16, float16, float32 or float8 variants)")]
    Dtype(String),
    /// Multi-head latent attention, whose KV is not heads × head_dim.
    #[error(
        "config.json: multi-head latent attention (kv_lora_rank) is not supported yet; describe the \
         geometry explicitly"
    )]
    Mla,
}

/// Largest page one rank may have: 4 GiB keeps every in-page offset in a `u32` on the wire.
pub const MAX_PAGE_BYTES: u64 = 1 << 32;

/// The KV-cache shape of a model, chunked for PD transfer and split over `tp_size` ranks.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct KvGeometry {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: u32,
    pub chunk_tokens: u32,
    pub tp_size: u32,
}

impl KvGeometry {
    /// Builds and validates a geometry.
    pub fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        chunk_tokens: u32,
        tp_size: u32,
    ) -> Result<Self, GeometryError> {
        let g = Self { layers, kv_heads, head_dim, dtype_bytes, chunk_tokens, tp_size };
        g.validate()?;
        Ok(g)
    }

    fn validate(&self) -> Result<(), GeometryError> {
        for (field, v) in [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
            ("chunk_tokens", self.chunk_tokens),
            ("tp_size", self.tp_size),
        ] {
            if v == 0 {
                return Err(GeometryError::Zero { field });
            }
        }
        if !self.kv_heads.is_multiple_of(self.tp_size) && !self.tp_size.is_multiple_of(self.kv_heads) {
            return Err(GeometryError::HeadsNotDivisible { kv_heads: self.kv_heads, tp_size: self.tp_size });
        }
        let bytes = self.page_bytes_per_rank();
        if bytes > MAX_PAGE_BYTES {
            return Err(GeometryError::PageTooLarge { bytes, limit: MAX_PAGE_BYTES });
        }
        Ok(())
    }

    /// KV bytes of one token over all ranks: `2 × layers × kv_heads × head_dim × dtype_bytes`.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }

    /// KV heads each rank holds. When `tp_size > kv_heads` engines replicate heads, one per rank.
    pub fn heads_per_rank(&self) -> u32 {
        (self.kv_heads / self.tp_size).max(1)
    }

    /// Bytes of one token's KV on one rank.
    pub fn kv_bytes_per_token_per_rank(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.heads_per_rank())
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }

    /// One page on one rank: `chunk_tokens × kv_bytes_per_token / tp_size` (when `tp_size` divides
    /// `kv_heads`; with replicated heads each rank holds one head).
    pub fn page_bytes_per_rank(&self) -> u64 {
        u64::from(self.chunk_tokens) * self.kv_bytes_per_token_per_rank()
    }

    /// Pages (chunks) a prompt of `tokens` tokens needs: `ceil(tokens / chunk_tokens)`.
    pub fn pages_for_tokens(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.chunk_tokens))
    }

    /// The in-page layout of one rank's chunk.
    pub fn chunk_layout(&self) -> ChunkLayout {
        ChunkLayout {
            layers: self.layers,
            heads: self.heads_per_rank(),
            head_dim: self.head_dim,
            dtype_bytes: self.dtype_bytes,
            chunk_tokens: self.chunk_tokens,
        }
    }

    /// A stable hash of the geometry (FNV-1a over the fields), checked when two peers connect so a
    /// prefiller can never write chunks of one shape into a decoder expecting another.
    pub fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for v in
            [self.layers, self.kv_heads, self.head_dim, self.dtype_bytes, self.chunk_tokens, self.tp_size]
        {
            for b in v.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }

    /// Reads the geometry from a HuggingFace `config.json` (Llama, Qwen2/3, Mistral shapes).
    /// `dtype_bytes` is taken from `torch_dtype`/`dtype` unless `dtype_override` is given (for an FP8 KV
    /// cache on a BF16 model, say).
    pub fn from_hf_config(
        json: &str,
        chunk_tokens: u32,
        tp_size: u32,
        dtype_override: Option<u32>,
    ) -> Result<Self, GeometryError> {
        let c: HfConfig = serde_json::from_str(json).map_err(|e| GeometryError::Json(e.to_string()))?;
        // Multimodal wrappers keep the language model's fields under text_config.
        let c = match c.text_config {
            Some(inner) => *inner,
            None => c,
        };
        if c.kv_lora_rank.is_some() {
            return Err(GeometryError::Mla);
        }
        let layers = c.num_hidden_layers.ok_or(GeometryError::Missing("num_hidden_layers"))?;
        let heads = c.num_attention_heads.ok_or(GeometryError::Missing("num_attention_heads"))?;
        let kv_heads = c.num_key_value_heads.unwrap_or(heads);
        let head_dim = match c.head_dim {
            Some(d) => d,
            None => {
                let hidden = c.hidden_size.ok_or(GeometryError::Missing("hidden_size or head_dim"))?;
                if heads == 0 {
                    return Err(GeometryError::Zero { field: "num_attention_heads" });
                }
                hidden / heads
            }
        };
        let dtype_bytes = match dtype_override {
            Some(b) => b,
            None => {
                let name = c.torch_dtype.or(c.dtype).unwrap_or_else(|| "bfloat16".to_owned());
                dtype_size(&name).ok_or(GeometryError::Dtype(name))?
            }
        };
        Self::new(layers, kv_heads, head_dim, dtype_bytes, chunk_tokens, tp_size)
    }
}

fn dtype_size(name: &str) -> Option<u32> {
    match name {
        "bfloat16" | "float16" | "half" | "bf16" | "fp16" => Some(2),
        "float32" | "float" | "fp32" => Some(4),
        n if n.starts_with("float8") || n.starts_with("fp8") => Some(1),
        _ => None,
    }
}

#[derive(Deserialize)]
struct HfConfig {
    num_hidden_layers: Option<u32>,
    num_attention_heads: Option<u32>,
    num_key_value_heads: Option<u32>,
    head_dim: Option<u32>,
    hidden_size: Option<u32>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    kv_lora_rank: Option<u32>,
    text_config: Option<Box<HfConfig>>,
}

/// Byte offsets inside one rank's chunk page: `[layer][k|v][token][head][head_dim]`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ChunkLayout {
    pub layers: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: u32,
    pub chunk_tokens: u32,
}

impl ChunkLayout {
    /// Bytes of one head of one token (the contiguous unit every copy moves).
    #[inline]
    pub fn head_bytes(&self) -> usize {
        self.head_dim as usize * self.dtype_bytes as usize
    }

    /// Bytes of one token's heads in one layer, K or V.
    #[inline]
    pub fn token_bytes(&self) -> usize {
        self.heads as usize * self.head_bytes()
    }

    #[inline]
    pub fn page_bytes(&self) -> usize {
        self.layers as usize * 2 * self.chunk_tokens as usize * self.token_bytes()
    }

    /// Offset of `(layer, kv, token)`'s first head; `kv` is 0 for K, 1 for V.
    #[inline]
    pub fn offset(&self, layer: u32, kv: u32, token: u32) -> usize {
        ((layer as usize * 2 + kv as usize) * self.chunk_tokens as usize + token as usize)
            * self.token_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_size_follows_the_design_formula() {
        // Llama-3.1-8B, bf16, 256-token chunks: 128 KiB per token, 32 MiB per page at TP 1.
        let g = KvGeometry::new(32, 8, 128, 2, 256, 1).unwrap();
        assert_eq!(g.kv_bytes_per_token(), 131_072);
        assert_eq!(g.page_bytes_per_rank(), 32 << 20);
        let g2 = KvGeometry::new(32, 8, 128, 2, 256, 2).unwrap();
        assert_eq!(g2.page_bytes_per_rank(), 16 << 20);
        assert_eq!(g2.chunk_layout().page_bytes() as u64, g2.page_bytes_per_rank());
    }

    #[test]
    fn replicated_heads_when_tp_exceeds_kv_heads() {
        let g = KvGeometry::new(2, 2, 4, 2, 8, 4).unwrap();
        assert_eq!(g.heads_per_rank(), 1);
        assert_eq!(g.page_bytes_per_rank(), 8 * 2 * 2 * 4 * 2);
    }

    #[test]
    fn invalid_geometries_are_refused_with_the_field() {
        let cases = [
            ("zero layers", KvGeometry::new(0, 8, 128, 2, 256, 1), GeometryError::Zero { field: "layers" }),
            (
                "heads not divisible",
                KvGeometry::new(32, 8, 128, 2, 256, 3),
                GeometryError::HeadsNotDivisible { kv_heads: 8, tp_size: 3 },
            ),
            (
                "zero chunk",
                KvGeometry::new(32, 8, 128, 2, 0, 1),
                GeometryError::Zero { field: "chunk_tokens" },
            ),
        ];
        for (name, got, want) in cases {
            assert_eq!(got.unwrap_err(), want, "{name}");
        }
    }

    #[test]
    fn pages_for_tokens_rounds_up() {
        let g = KvGeometry::new(1, 1, 1, 1, 256, 1).unwrap();
        for (tokens, pages) in [(0, 0), (1, 1), (256, 1), (257, 2), (1024, 4)] {
            assert_eq!(g.pages_for_tokens(tokens), pages, "{tokens} tokens");
        }
    }

    #[test]
    fn hf_config_shapes() {
        let llama = r#"{"model_type":"llama","hidden_size":4096,"num_attention_heads":32,
            "num_hidden_layers":32,"num_key_value_heads":8,"torch_dtype":"bfloat16"}"#;
        let g = KvGeometry::from_hf_config(llama, 256, 1, None).unwrap();
        assert_eq!((g.layers, g.kv_heads, g.head_dim, g.dtype_bytes), (32, 8, 128, 2));
        let fp8 = KvGeometry::from_hf_config(llama, 256, 1, Some(1)).unwrap();
        assert_eq!(fp8.kv_bytes_per_token(), g.kv_bytes_per_token() / 2);
        let mla = r#"{"num_hidden_layers":61,"num_attention_heads":128,"kv_lora_rank":512}"#;
        assert_eq!(KvGeometry::from_hf_config(mla, 256, 1, None).unwrap_err(), GeometryError::Mla);
        let nested = r#"{"text_config":{"num_hidden_layers":2,"num_attention_heads":4,"head_dim":8}}"#;
        assert_eq!(KvGeometry::from_hf_config(nested, 16, 1, None).unwrap().kv_heads, 4);
        assert!(matches!(
            KvGeometry::from_hf_config(r#"{"num_attention_heads":4}"#, 16, 1, None),
            Err(GeometryError::Missing("num_hidden_layers"))
        ));
    }

    #[test]
    fn fingerprint_distinguishes_geometries() {
        let a = KvGeometry::new(32, 8, 128, 2, 256, 1).unwrap();
        let b = KvGeometry::new(32, 8, 128, 2, 256, 2).unwrap();
        assert_eq!(a.fingerprint(), a.fingerprint());
        assert_ne!(a.fingerprint(), b.fingerprint());
    }
}
