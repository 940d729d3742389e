//! The device layer: where the PD buffer's bytes live and how KV moves between an engine's paged
//! cache and a chunk page.
//!
//! [`Device`] is implemented by [`cpu::CpuDevice`], the reference used by every CPU test, by
//! [`shm::ShmDevice`] (host memory shared through a file) and by `cuda::CudaDevice` (GPU memory,
//! feature `cuda`, on by default: compiled everywhere, used where a driver and a GPU are found). Kernels take strides and a block table, never a
//! hard-coded layout, so NHD (`[block][token][head][dim]`) and HND (`[block][head][token][dim]`)
//! engine caches and any block size are handled by the same code.
//!
//! This layer never interprets requests, pages' owners or generations: the buffer above it decides who
//! may touch a page; the device only moves bytes and checks bounds.

#[cfg(feature = "cuda")]
pub mod any;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod shm;

use std::fmt::Debug;

use thiserror::Error;

use crate::geometry::ChunkLayout;

/// Errors of the device layer.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceError {
    /// A page index beyond the buffer.
    #[error("page {page} out of range (buffer has {pages} pages)")]
    NoSuchPage { page: u32, pages: u32 },
    /// An access past the end of a region.
    #[error("access of {len} bytes at offset {offset} overruns a region of {size} bytes")]
    OutOfBounds { offset: usize, len: usize, size: usize },
    /// The engine's cache layout does not match the geometry.
    #[error("cache layout: {0}")]
    Layout(String),
    /// The device could not allocate the buffer.
    #[error("allocation of {bytes} bytes failed: {reason}")]
    Alloc { bytes: usize, reason: String },
    /// The device backend (CUDA, shared memory) failed.
    #[error("device: {0}")]
    Backend(String),
}

/// One layer of an engine's paged KV cache (K and V), described by byte strides.
///
/// Element `(kv, block, slot, head)` starts at
/// `kv * kv_stride + block * block_stride + slot * token_stride + head * head_stride` and holds
/// `head_dim * dtype_bytes` contiguous bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct CacheLayout {
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: u32,
    pub kv_stride: usize,
    pub block_stride: usize,
    pub token_stride: usize,
    pub head_stride: usize,
}

impl CacheLayout {
    /// vLLM's FlashAttention layout per layer: `[2, num_blocks, block_size, heads, head_dim]`.
    pub fn nhd(num_blocks: u32, block_size: u32, heads: u32, head_dim: u32, dtype_bytes: u32) -> Self {
        let head = head_dim as usize * dtype_bytes as usize;
        let token = heads as usize * head;
        let block = block_size as usize * token;
        Self {
            num_blocks,
            block_size,
            heads,
            head_dim,
            dtype_bytes,
            kv_stride: num_blocks as usize * block,
            block_stride: block,
            token_stride: token,
            head_stride: head,
        }
    }

    /// The head-major layout per layer: `[2, num_blocks, heads, block_size, head_dim]`.
    pub fn hnd(num_blocks: u32, block_size: u32, heads: u32, head_dim: u32, dtype_bytes: u32) -> Self {
        let head_row = head_dim as usize * dtype_bytes as usize;
        let head = block_size as usize * head_row;
        let block = heads as usize * head;
        Self {
            num_blocks,
            block_size,
            heads,
            head_dim,
            dtype_bytes,
            kv_stride: num_blocks as usize * block,
            block_stride: block,
            token_stride: head_row,
            head_stride: head,
        }
    }

    #[inline]
    pub fn head_bytes(&self) -> usize {
        self.head_dim as usize * self.dtype_bytes as usize
    }

    /// Byte offset of element `(kv, block, slot, head)`.
    #[inline]
    pub fn offset(&self, kv: u32, block: u32, slot: u32, head: u32) -> usize {
        kv as usize * self.kv_stride
            + block as usize * self.block_stride
            + slot as usize * self.token_stride
            + head as usize * self.head_stride
    }

    /// Smallest tensor (bytes) that holds every element of the layout.
    pub fn min_tensor_bytes(&self) -> usize {
        if self.num_blocks == 0 || self.block_size == 0 || self.heads == 0 {
            return 0;
        }
        self.offset(1, self.num_blocks - 1, self.block_size - 1, self.heads - 1) + self.head_bytes()
    }
}

/// A run of a request's tokens in an engine's paged cache: tokens `first_token..first_token + tokens`
/// of the request, whose blocks are listed (in order) by `block_table`.
#[derive(Clone, Copy, Debug)]
pub struct KvSpan<'a> {
    pub layout: &'a CacheLayout,
    pub block_table: &'a [u32],
    pub first_token: u32,
    pub tokens: u32,
}

/// Checks a gather/scatter against the chunk layout and the cache, before any byte moves.
pub fn check_span(
    chunk: &ChunkLayout,
    cache_layers: usize,
    tensor_bytes: &[usize],
    span: &KvSpan<'_>,
) -> Result<(), DeviceError> {
    let l = span.layout;
    let bad = |m: String| Err(DeviceError::Layout(m));
    if cache_layers != chunk.layers as usize {
        return bad(format!("cache has {cache_layers} layers, chunk has {}", chunk.layers));
    }
    if l.heads != chunk.heads || l.head_bytes() != chunk.head_bytes() {
        return bad(format!(
            "cache has {} heads of {} bytes, chunk has {} heads of {} bytes",
            l.heads,
            l.head_bytes(),
            chunk.heads,
            chunk.head_bytes()
        ));
    }
    if span.tokens > chunk.chunk_tokens {
        return bad(format!("span of {} tokens exceeds chunk of {}", span.tokens, chunk.chunk_tokens));
    }
    if l.block_size == 0 {
        return bad("block_size must be greater than 0".to_owned());
    }
    if span.tokens > 0 {
        let last = u64::from(span.first_token) + u64::from(span.tokens) - 1;
        let need_blocks = last / u64::from(l.block_size) + 1;
        if need_blocks > span.block_table.len() as u64 {
            return bad(format!(
                "block table has {} blocks, span needs {need_blocks}",
                span.block_table.len()
            ));
        }
    }
    if let Some(b) = span.block_table.iter().find(|b| **b >= l.num_blocks) {
        return bad(format!("block {b} out of range (cache has {} blocks)", l.num_blocks));
    }
    let need = l.min_tensor_bytes();
    if let Some(have) = tensor_bytes.iter().find(|t| **t < need) {
        return bad(format!("layer tensor of {have} bytes is smaller than the layout's {need}"));
    }
    Ok(())
}

/// Calls `f(chunk_offset, cache_offset)` for every head-sized element a span moves, in chunk order.
pub fn for_each_element(
    chunk: &ChunkLayout,
    span: &KvSpan<'_>,
    mut f: impl FnMut(usize, usize, usize) -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    let l = span.layout;
    let head_bytes = chunk.head_bytes();
    for layer in 0..chunk.layers {
        for kv in 0..2 {
            for t in 0..span.tokens {
                let abs = span.first_token + t;
                let idx = (abs / l.block_size) as usize;
                let block = *span
                    .block_table
                    .get(idx)
                    .ok_or_else(|| DeviceError::Layout(format!("block table has no entry {idx}")))?;
                let slot = abs % l.block_size;
                let base = chunk.offset(layer, kv, t);
                for head in 0..chunk.heads {
                    f(layer as usize, base + head as usize * head_bytes, l.offset(kv, block, slot, head))?;
                }
            }
        }
    }
    Ok(())
}

/// Where PD-buffer bytes live and how they move.
pub trait Device: Send + Sync + Debug + 'static {
    /// The PD buffer: `pages` pages of `page_bytes` bytes.
    type Buffer: Send + Sync + Debug;
    /// Engine memory: one layer of a paged KV cache, or any scratch region.
    type Tensor: Send + Sync + Debug;
    /// Marks the completion of the work submitted before it.
    type Event: Send + Debug;

    fn name(&self) -> &'static str;
    fn alloc_buffer(&self, pages: u32, page_bytes: usize) -> Result<Self::Buffer, DeviceError>;
    fn alloc_tensor(&self, bytes: usize) -> Result<Self::Tensor, DeviceError>;

    /// Host bytes into a page at `offset`.
    fn write_page(&self, buf: &Self::Buffer, page: u32, offset: usize, src: &[u8])
    -> Result<(), DeviceError>;
    /// A page's bytes at `offset` to the host.
    fn read_page(
        &self,
        buf: &Self::Buffer,
        page: u32,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), DeviceError>;
    fn write_tensor(&self, t: &Self::Tensor, offset: usize, src: &[u8]) -> Result<(), DeviceError>;
    fn read_tensor(&self, t: &Self::Tensor, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Engine paged cache (one tensor per layer) → chunk page, for all layers at once.
    fn gather(
        &self,
        cache: &[Self::Tensor],
        span: &KvSpan<'_>,
        chunk: &ChunkLayout,
        dst: &Self::Buffer,
        page: u32,
    ) -> Result<(), DeviceError>;

    /// Chunk page → engine paged cache, for all layers at once.
    fn scatter(
        &self,
        src: &Self::Buffer,
        page: u32,
        chunk: &ChunkLayout,
        cache: &[Self::Tensor],
        span: &KvSpan<'_>,
    ) -> Result<(), DeviceError>;

    /// A name by which other processes on this host can open the buffer and write pages into it
    /// directly (a shared-memory path; for GPUs, an IPC handle). `None` when the device cannot share.
    fn export(&self, _buf: &Self::Buffer) -> Option<String> {
        None
    }

    /// An event completed once all work submitted so far is done.
    fn record_event(&self) -> Result<Self::Event, DeviceError>;
    fn wait_event(&self, event: &Self::Event) -> Result<(), DeviceError>;
}
