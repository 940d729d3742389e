//! The CUDA device: the PD buffer in GPU memory, gather and scatter as kernels (`kernels/pd_copy.cu`).
//!
//! cudarc 0.19 with dynamic loading: the crate compiles and links on machines without CUDA, and
//! [`CudaDevice::new`] reports that no driver or GPU is present instead of failing to start. The
//! kernels are compiled at start by NVRTC for the device's own architecture when the NVRTC library
//! is present (and the driver accepts its PTX), otherwise loaded from the committed PTX for sm_90.
//!
//! Memory is plain `cuMemAlloc` allocations owned by types that free them on drop (never the
//! stream-ordered pool: its memory cannot be exported to another process). All work goes on one
//! stream per device; `gather`/`scatter` wait for their kernel before returning, so a page is never
//! released while a kernel still reads it (`gather_async`/`scatter_async` leave that to the caller,
//! for benchmarks). Launch parameters travel by value (`CopyParams`, the same fields as the kernel's
//! struct); the layer base addresses and the block table go through a small device scratch area.
//!
//! Same-node transfer: [`Device::export`] names the buffer by a CUDA IPC handle; a producer process
//! opens it with [`IpcBuffer::open`] and copies chunks device to device, under the same grants and
//! generation checks as any writer.

#![allow(unsafe_code)]

use std::borrow::Borrow;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg, result, sys,
};

use super::{Device, DeviceError, KvSpan, check_span};
use crate::geometry::ChunkLayout;

/// The committed PTX (scripts/gen-ptx, NVRTC 12.4, `compute_90`).
pub const PTX_SM90: &str = include_str!("../../../kernels/ptx/pd_copy.sm_90.ptx");
/// The kernel sources, compiled at run time when NVRTC is present.
pub const KERNEL_SOURCE: &str = include_str!("../../../kernels/pd_copy.cu");
/// NVRTC options besides the architecture (the same as scripts/gen-ptx).
pub const NVRTC_OPTIONS: [&str; 2] = ["-std=c++17", "--fmad=false"];
/// Rows (tokens of one layer's K or V) per thread block: one warp each.
const WARPS_PER_BLOCK: u32 = 8;
/// The widest units first.
const WIDTHS: [usize; 3] = [16, 4, 1];

fn backend(what: &str, e: impl fmt::Display) -> DeviceError {
    DeviceError::Backend(format!("{what}: {e}"))
}

/// Where the kernels came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSource {
    /// Compiled at start by NVRTC for this device.
    Nvrtc,
    /// The committed PTX for sm_90.
    Committed,
}

/// Launch parameters; the field order is the kernel's `CopyParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct CopyParams {
    layers: u64,
    block_table: u64,
    chunk: u64,
    kv_stride: u64,
    block_stride: u64,
    token_stride: u64,
    run_stride: u64,
    row_bytes: u64,
    first_token: u32,
    tokens: u32,
    chunk_tokens: u32,
    block_size: u32,
    rows: u32,
    row_units: u32,
    run_units: u32,
    pad: u32,
}

// SAFETY: plain old data with the kernel's C layout (`#[repr(C)]`, the same fields in the same order,
// only integers), so its bytes are a valid kernel argument.
unsafe impl DeviceRepr for CopyParams {}

/// A device allocation, freed on drop.
struct DevMem {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    bytes: usize,
}

impl fmt::Debug for DevMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevMem").field("bytes", &self.bytes).finish()
    }
}

impl DevMem {
    fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, DeviceError> {
        ctx.bind_to_thread().map_err(|e| backend("bind context", e))?;
        // SAFETY: a plain allocation of `bytes.max(1)` bytes in the bound context; the pointer is
        // owned by the returned value and freed exactly once in its Drop.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|e| DeviceError::Alloc { bytes, reason: e.to_string() })?;
        // SAFETY: `ptr` points to at least `bytes` bytes just allocated in this context.
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }.map_err(|e| backend("zero allocation", e))?;
        Ok(Self { ctx: Arc::clone(ctx), ptr, bytes })
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `malloc_sync` in this context and is freed only here. Work that
            // used it was waited for by the operations that queued it.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A PD buffer in GPU memory: one allocation of `pages × page_bytes`.
#[derive(Debug)]
pub struct CudaBuffer {
    mem: DevMem,
    pages: u32,
    page_bytes: usize,
}

/// Engine memory on the GPU (one layer of a paged cache, or scratch).
#[derive(Debug)]
pub struct CudaTensor {
    mem: DevMem,
}

impl CudaTensor {
    pub fn len(&self) -> usize {
        self.mem.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.mem.bytes == 0
    }
}

fn range(offset: usize, len: usize, size: usize) -> Result<u64, DeviceError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(offset as u64),
        _ => Err(DeviceError::OutOfBounds { offset, len, size }),
    }
}

impl CudaBuffer {
    fn page_ptr(&self, page: u32) -> Result<CUdeviceptr, DeviceError> {
        if page >= self.pages {
            return Err(DeviceError::NoSuchPage { page, pages: self.pages });
        }
        Ok(self.mem.ptr + u64::from(page) * self.page_bytes as u64)
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }
}

struct Kernels {
    gather: [CudaFunction; 3],
    scatter: [CudaFunction; 3],
}

/// The CUDA device (one GPU, one stream).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    source: KernelSource,
    scratch: Mutex<Option<DevMem>>,
    sms: u32,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .field("source", &self.source)
            .finish()
    }
}

/// Why there is no CUDA device here.
pub fn unavailable() -> Option<String> {
    // SAFETY: only probes whether the driver library can be loaded; nothing is called through it.
    if !unsafe { sys::is_culib_present() } {
        return Some("no CUDA driver library (libcuda.so) on this machine".into());
    }
    match result::init().and_then(|()| CudaContext::device_count()) {
        Ok(0) => Some("the CUDA driver reports no GPU".into()),
        Ok(_) => None,
        Err(e) => Some(format!("the CUDA driver did not initialise: {e}")),
    }
}

fn nvrtc_present() -> bool {
    // SAFETY: only probes whether the NVRTC library can be loaded.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

impl CudaDevice {
    /// The GPU `ordinal`, with its kernels loaded. An error (never a panic) when there is no driver or
    /// GPU; [`unavailable`] says why without trying.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        if let Some(why) = unavailable() {
            return Err(DeviceError::Backend(why));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| backend("open GPU", e))?;
        let stream = ctx.default_stream();
        let (major, minor) = ctx.compute_capability().map_err(|e| backend("compute capability", e))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| backend("SM count", e))?;
        let compiled = if nvrtc_present() {
            let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
            let opts = cudarc::nvrtc::CompileOptions {
                arch: Some(arch),
                options: NVRTC_OPTIONS.iter().map(|s| (*s).to_owned()).collect(),
                ..Default::default()
            };
            cudarc::nvrtc::compile_ptx_with_opts(KERNEL_SOURCE, opts)
                .ok()
                .and_then(|ptx| ctx.load_module(ptx).ok())
        } else {
            None
        };
        let (module, source) = match compiled {
            Some(m) => (m, KernelSource::Nvrtc),
            None => (
                ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX_SM90))
                    .map_err(|e| backend("load committed PTX (sm_90)", e))?,
                KernelSource::Committed,
            ),
        };
        let f = |name: &str| module.load_function(name).map_err(|e| backend(name, e));
        let kernels = Kernels {
            gather: [f("baton_gather_16")?, f("baton_gather_4")?, f("baton_gather_1")?],
            scatter: [f("baton_scatter_16")?, f("baton_scatter_4")?, f("baton_scatter_1")?],
        };
        Ok(Self {
            ctx,
            stream,
            kernels,
            source,
            scratch: Mutex::new(None),
            sms: u32::try_from(sms).unwrap_or(1).max(1),
        })
    }

    pub fn kernel_source(&self) -> KernelSource {
        self.source
    }

    pub fn name_of_gpu(&self) -> String {
        self.ctx.name().unwrap_or_else(|e| format!("unknown ({e})"))
    }

    /// Queues a gather without waiting for it (benchmarks); [`Device::gather`] waits.
    pub fn gather_async(
        &self,
        cache: &[CudaTensor],
        span: &KvSpan<'_>,
        chunk: &ChunkLayout,
        dst: &CudaBuffer,
        page: u32,
    ) -> Result<(), DeviceError> {
        self.copy(true, cache, span, chunk, dst, page)
    }

    /// Queues a scatter without waiting for it (benchmarks); [`Device::scatter`] waits.
    pub fn scatter_async(
        &self,
        src: &CudaBuffer,
        page: u32,
        chunk: &ChunkLayout,
        cache: &[CudaTensor],
        span: &KvSpan<'_>,
    ) -> Result<(), DeviceError> {
        self.copy(false, cache, span, chunk, src, page)
    }

    /// Queues a device-to-device copy of `bytes` from `src` page `from` to `dst` page `to` (the
    /// benchmark's reference).
    pub fn copy_page_async(
        &self,
        src: &CudaBuffer,
        from: u32,
        dst: &CudaBuffer,
        to: u32,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        range(0, bytes, src.page_bytes.min(dst.page_bytes))?;
        let (s, d) = (src.page_ptr(from)?, dst.page_ptr(to)?);
        self.ctx.bind_to_thread().map_err(|e| backend("bind context", e))?;
        // SAFETY: both ranges were checked to lie inside live allocations of this context.
        unsafe { result::memcpy_dtod_async(d, s, bytes, self.stream.cu_stream()) }
            .map_err(|e| backend("copy", e))
    }

    /// An event that records a time, for measuring the queued work between two of them with
    /// [`CudaEvent::elapsed_ms`]. [`Device::record_event`]'s events record none (cheaper to wait
    /// on), and the driver refuses to time them.
    pub fn record_timed_event(&self) -> Result<CudaEvent, DeviceError> {
        self.stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| backend("record timed event", e))
    }

    /// Waits for everything queued on the device's stream.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream.synchronize().map_err(|e| backend("synchronize", e))
    }

    /// The unit width every address of this copy allows.
    fn width<T: Borrow<CudaTensor>>(
        cache: &[T],
        span: &KvSpan<'_>,
        chunk: &ChunkLayout,
        run_bytes: usize,
        page: u64,
    ) -> usize {
        let l = span.layout;
        WIDTHS
            .into_iter()
            .find(|&w| {
                [run_bytes, chunk.token_bytes(), l.kv_stride, l.block_stride, l.token_stride, l.head_stride]
                    .iter()
                    .all(|x| x.is_multiple_of(w))
                    && page.is_multiple_of(w as u64)
                    && cache.iter().all(|t| t.borrow().mem.ptr.is_multiple_of(w as u64))
            })
            .unwrap_or(1)
    }

    /// Queues a gather (`gather`) or scatter over layer tensors given by reference.
    pub fn copy<T: Borrow<CudaTensor>>(
        &self,
        gather: bool,
        cache: &[T],
        span: &KvSpan<'_>,
        chunk: &ChunkLayout,
        buf: &CudaBuffer,
        page: u32,
    ) -> Result<(), DeviceError> {
        let sizes: Vec<usize> = cache.iter().map(|t| t.borrow().len()).collect();
        check_span(chunk, cache.len(), &sizes, span)?;
        let page_ptr = buf.page_ptr(page)?;
        range(0, chunk.page_bytes(), buf.page_bytes)?;
        if span.tokens == 0 || chunk.layers == 0 || chunk.heads == 0 {
            return Ok(());
        }
        let l = span.layout;
        let head = chunk.head_bytes();
        // NHD: the token's heads are contiguous, one run per row; otherwise one run per head.
        let contiguous = l.head_stride == head;
        let run_bytes = if contiguous { chunk.token_bytes() } else { head };
        let w = Self::width(cache, span, chunk, run_bytes, page_ptr);
        let last = span.first_token as usize + span.tokens as usize - 1;
        let table = span.block_table.get(..=last / l.block_size as usize).unwrap_or(span.block_table);
        let mut args: Vec<u8> = Vec::with_capacity(cache.len() * 8 + table.len() * 4);
        for t in cache {
            args.extend_from_slice(&t.borrow().mem.ptr.to_le_bytes());
        }
        let table_at = args.len();
        for b in table {
            args.extend_from_slice(&b.to_le_bytes());
        }
        let u32_of = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| DeviceError::Layout(format!("{what} too large")))
        };
        let rows = u32_of(chunk.layers as usize * 2 * span.tokens as usize, "rows")?;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.as_ref().is_none_or(|s| s.bytes < args.len()) {
            // The previous scratch may still be read by queued kernels: wait before freeing it.
            self.synchronize()?;
            *scratch = Some(DevMem::alloc(&self.ctx, args.len().next_power_of_two().max(4096))?);
        }
        let s = scratch.as_ref().ok_or_else(|| backend("scratch", "missing"))?;
        self.ctx.bind_to_thread().map_err(|e| backend("bind context", e))?;
        // SAFETY: `args` fits the scratch allocation (checked above); the copy is queued on the same
        // stream as the kernels, so it cannot overtake a kernel still reading the previous values,
        // and pageable host memory is staged before the call returns.
        unsafe { result::memcpy_htod_async(s.ptr, &args, self.stream.cu_stream()) }
            .map_err(|e| backend("upload launch tables", e))?;
        let params = CopyParams {
            layers: s.ptr,
            block_table: s.ptr + table_at as u64,
            chunk: page_ptr,
            kv_stride: l.kv_stride as u64,
            block_stride: l.block_stride as u64,
            token_stride: l.token_stride as u64,
            run_stride: l.head_stride as u64,
            row_bytes: chunk.token_bytes() as u64,
            first_token: span.first_token,
            tokens: span.tokens,
            chunk_tokens: chunk.chunk_tokens,
            block_size: l.block_size,
            rows,
            row_units: u32_of(chunk.token_bytes() / w, "row")?,
            run_units: u32_of(run_bytes / w, "run")?,
            pad: 0,
        };
        let i = WIDTHS.iter().position(|x| *x == w).unwrap_or(2);
        let set = if gather { &self.kernels.gather } else { &self.kernels.scatter };
        let f = set.get(i).ok_or_else(|| backend("kernel", "missing"))?;
        let blocks = rows.div_ceil(WARPS_PER_BLOCK).min(self.sms * 32).max(1);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32, WARPS_PER_BLOCK, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(f);
        launch.arg(&params);
        // SAFETY: every address the kernel touches was bounds-checked by `check_span` (cache
        // tensors against the layout, the block table against the span) and above (the page); the
        // launch tables were uploaded ahead of it on the same stream and stay allocated (the
        // scratch is only replaced after a synchronize).
        unsafe { launch.launch(cfg) }.map_err(|e| backend("launch", e))?;
        drop(scratch);
        Ok(())
    }

    fn mem(&self, bytes: usize) -> Result<DevMem, DeviceError> {
        DevMem::alloc(&self.ctx, bytes)
    }

    fn htod(&self, ptr: CUdeviceptr, src: &[u8]) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(|e| backend("bind context", e))?;
        // SAFETY: callers check that `ptr..ptr + src.len()` lies inside a live allocation. The copy
        // is queued on the device stream and waited for, so it is ordered after queued kernels.
        unsafe { result::memcpy_htod_async(ptr, src, self.stream.cu_stream()) }
            .map_err(|e| backend("copy to GPU", e))?;
        self.synchronize()
    }

    fn dtoh(&self, dst: &mut [u8], ptr: CUdeviceptr) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(|e| backend("bind context", e))?;
        // SAFETY: as `htod`, for reading; `dst` stays borrowed until the stream is synchronized.
        unsafe { result::memcpy_dtoh_async(dst, ptr, self.stream.cu_stream()) }
            .map_err(|e| backend("copy from GPU", e))?;
        self.synchronize()
    }
}

impl Device for CudaDevice {
    type Buffer = CudaBuffer;
    type Tensor = CudaTensor;
    type Event = CudaEvent;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc_buffer(&self, pages: u32, page_bytes: usize) -> Result<CudaBuffer, DeviceError> {
        let bytes = (pages as usize)
            .checked_mul(page_bytes)
            .ok_or_else(|| DeviceError::Alloc { bytes: usize::MAX, reason: "size overflows".into() })?;
        Ok(CudaBuffer { mem: self.mem(bytes)?, pages, page_bytes })
    }

    fn alloc_tensor(&self, bytes: usize) -> Result<CudaTensor, DeviceError> {
        Ok(CudaTensor { mem: self.mem(bytes)? })
    }

    fn write_page(&self, buf: &CudaBuffer, page: u32, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        let at = buf.page_ptr(page)? + range(offset, src.len(), buf.page_bytes)?;
        self.htod(at, src)
    }

    fn read_page(
        &self,
        buf: &CudaBuffer,
        page: u32,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        let at = buf.page_ptr(page)? + range(offset, dst.len(), buf.page_bytes)?;
        self.dtoh(dst, at)
    }

    fn write_tensor(&self, t: &CudaTensor, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        let at = t.mem.ptr + range(offset, src.len(), t.mem.bytes)?;
        self.htod(at, src)
    }

    fn read_tensor(&self, t: &CudaTensor, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        let at = t.mem.ptr + range(offset, dst.len(), t.mem.bytes)?;
        self.dtoh(dst, at)
    }

    fn gather(
        &self,
        cache: &[CudaTensor],
        span: &KvSpan<'_>,
        chunk: &ChunkLayout,
        dst: &CudaBuffer,
        page: u32,
    ) -> Result<(), DeviceError> {
        self.gather_async(cache, span, chunk, dst, page)?;
        self.synchronize()
    }

    fn scatter(
        &self,
        src: &CudaBuffer,
        page: u32,
        chunk: &ChunkLayout,
        cache: &[CudaTensor],
        span: &KvSpan<'_>,
    ) -> Result<(), DeviceError> {
        self.scatter_async(src, page, chunk, cache, span)?;
        self.synchronize()
    }

    fn export(&self, buf: &CudaBuffer) -> Option<String> {
        IpcBuffer::handle(&self.ctx, buf).ok()
    }

    fn record_event(&self) -> Result<CudaEvent, DeviceError> {
        self.stream.record_event(None).map_err(|e| backend("record event", e))
    }

    fn wait_event(&self, event: &CudaEvent) -> Result<(), DeviceError> {
        event.synchronize().map_err(|e| backend("wait for event", e))
    }
}

/// Prefix of an export string naming a CUDA IPC handle.
pub const IPC_PREFIX: &str = "cuda-ipc:";

/// Another process's PD buffer, opened through its CUDA IPC handle.
pub struct IpcBuffer {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    pages: u32,
    page_bytes: usize,
}

impl fmt::Debug for IpcBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcBuffer").field("pages", &self.pages).field("page_bytes", &self.page_bytes).finish()
    }
}

impl Drop for IpcBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was returned by `cuIpcOpenMemHandle` in this context and is closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

fn check(r: sys::CUresult, what: &str) -> Result<(), DeviceError> {
    if r == sys::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(backend(what, format!("{r:?}"))) }
}

impl IpcBuffer {
    /// `cuda-ipc:<pages>:<page bytes>:<handle, hex>` for `buf`.
    fn handle(ctx: &Arc<CudaContext>, buf: &CudaBuffer) -> Result<String, DeviceError> {
        ctx.bind_to_thread().map_err(|e| backend("bind context", e))?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `buf`'s pointer is the base of a live `cuMemAlloc` allocation in this context, and
        // `h` is a valid place for the handle.
        check(unsafe { sys::cuIpcGetMemHandle(&mut h, buf.mem.ptr) }, "cuIpcGetMemHandle")?;
        #[allow(clippy::cast_sign_loss)]
        let hex: String = h.reserved.iter().map(|b| format!("{:02x}", *b as u8)).collect();
        Ok(format!("{IPC_PREFIX}{}:{}:{hex}", buf.pages, buf.page_bytes))
    }

    /// Opens an export string from another process's [`CudaDevice`] on `device`'s GPU.
    pub fn open(device: &CudaDevice, export: &str) -> Result<Self, DeviceError> {
        let bad = || {
            DeviceError::Backend(format!(
                "not a CUDA IPC export: {:?}",
                export.chars().take(40).collect::<String>()
            ))
        };
        let rest = export.strip_prefix(IPC_PREFIX).ok_or_else(bad)?;
        let mut parts = rest.split(':');
        let pages: u32 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let page_bytes: usize = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let hex = parts.next().filter(|h| h.len() == 128).ok_or_else(bad)?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (i, b) in h.reserved.iter_mut().enumerate() {
            let byte =
                u8::from_str_radix(hex.get(i * 2..i * 2 + 2).ok_or_else(bad)?, 16).map_err(|_| bad())?;
            *b = byte as core::ffi::c_char;
        }
        device.ctx.bind_to_thread().map_err(|e| backend("bind context", e))?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `h` is a handle produced by `cuIpcGetMemHandle` in another process (checked for
        // shape above; the driver validates it); `ptr` receives the mapping, closed in Drop.
        check(
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        Ok(Self { ctx: Arc::clone(&device.ctx), ptr, pages, page_bytes })
    }

    /// Copies `bytes` of `src`'s page `from` (this process's GPU memory) into page `to` of the opened
    /// buffer, device to device, and waits for it. The caller holds a write grant for `to`.
    pub fn write_page(
        &self,
        device: &CudaDevice,
        src: &CudaBuffer,
        from: u32,
        to: u32,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        if to >= self.pages {
            return Err(DeviceError::NoSuchPage { page: to, pages: self.pages });
        }
        range(0, bytes, self.page_bytes.min(src.page_bytes))?;
        let s = src.page_ptr(from)?;
        let d = self.ptr + u64::from(to) * self.page_bytes as u64;
        device.ctx.bind_to_thread().map_err(|e| backend("bind context", e))?;
        // SAFETY: both ranges were checked against their allocations (the remote one by the page
        // count and size in its export string, which came from its owner).
        unsafe { result::memcpy_dtod_async(d, s, bytes, device.stream.cu_stream()) }
            .map_err(|e| backend("IPC copy", e))?;
        device.synchronize()
    }

    pub fn pages(&self) -> u32 {
        self.pages
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }
}
