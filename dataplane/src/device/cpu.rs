//! The CPU reference device: plain host memory, synchronous copies. Every CPU test runs on it and the
//! CUDA device is checked against it byte for byte.
//!
//! Each page has its own lock, so writers of different pages never contend and a logic error above
//! can corrupt bytes but never cause a data race.

use std::sync::RwLock;

use super::{Device, DeviceError, KvSpan, check_span, for_each_element};
use crate::geometry::ChunkLayout;

/// The CPU reference device.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuDevice;

/// A PD buffer in host memory.
#[derive(Debug)]
pub struct CpuBuffer {
    page_bytes: usize,
    pages: Vec<RwLock<Box<[u8]>>>,
}

/// A region of host memory standing in for engine memory.
#[derive(Debug)]
pub struct CpuTensor(RwLock<Box<[u8]>>);

impl CpuTensor {
    pub fn len(&self) -> usize {
        self.0.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// CPU work is done when the call returns.
#[derive(Debug, Clone, Copy)]
pub struct CpuEvent;

fn zeroed(bytes: usize) -> Result<Box<[u8]>, DeviceError> {
    let mut v = Vec::new();
    v.try_reserve_exact(bytes).map_err(|e| DeviceError::Alloc { bytes, reason: e.to_string() })?;
    v.resize(bytes, 0);
    Ok(v.into_boxed_slice())
}

#[inline]
fn range(offset: usize, len: usize, size: usize) -> Result<std::ops::Range<usize>, DeviceError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(offset..end),
        _ => Err(DeviceError::OutOfBounds { offset, len, size }),
    }
}

impl CpuBuffer {
    fn page(&self, page: u32) -> Result<&RwLock<Box<[u8]>>, DeviceError> {
        self.pages.get(page as usize).ok_or(DeviceError::NoSuchPage {
            page,
            pages: u32::try_from(self.pages.len()).unwrap_or(u32::MAX),
        })
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }
}

impl CpuDevice {
    /// [`Device::gather`] over references (for devices that wrap this one).
    pub fn gather_refs<T: std::borrow::Borrow<CpuTensor>>(
        &self,
        cache: &[T],
        span: &KvSpan<'_>,
        chunk: &ChunkLayout,
        dst: &CpuBuffer,
        page: u32,
    ) -> Result<(), DeviceError> {
        let layers: Vec<_> =
            cache.iter().map(|t| t.borrow().0.read().unwrap_or_else(|e| e.into_inner())).collect();
        let sizes: Vec<usize> = layers.iter().map(|l| l.len()).collect();
        check_span(chunk, cache.len(), &sizes, span)?;
        let mut out = dst.page(page)?.write().unwrap_or_else(|e| e.into_inner());
        range(0, chunk.page_bytes(), out.len())?;
        let n = chunk.head_bytes();
        for_each_element(chunk, span, |layer, c, e| {
            let src = layers.get(layer).ok_or_else(|| DeviceError::Layout(format!("no layer {layer}")))?;
            let r = range(c, n, out.len())?;
            out[r].copy_from_slice(&src[range(e, n, src.len())?]);
            Ok(())
        })
    }

    /// [`Device::scatter`] over references.
    pub fn scatter_refs<T: std::borrow::Borrow<CpuTensor>>(
        &self,
        src: &CpuBuffer,
        page: u32,
        chunk: &ChunkLayout,
        cache: &[T],
        span: &KvSpan<'_>,
    ) -> Result<(), DeviceError> {
        let mut layers: Vec<_> =
            cache.iter().map(|t| t.borrow().0.write().unwrap_or_else(|e| e.into_inner())).collect();
        let sizes: Vec<usize> = layers.iter().map(|l| l.len()).collect();
        check_span(chunk, cache.len(), &sizes, span)?;
        let input = src.page(page)?.read().unwrap_or_else(|e| e.into_inner());
        range(0, chunk.page_bytes(), input.len())?;
        let n = chunk.head_bytes();
        for_each_element(chunk, span, |layer, c, e| {
            let dst =
                layers.get_mut(layer).ok_or_else(|| DeviceError::Layout(format!("no layer {layer}")))?;
            let r = range(e, n, dst.len())?;
            dst[r].copy_from_slice(&input[range(c, n, input.len())?]);
            Ok(())
        })
    }
}

impl Device for CpuDevice {
    type Buffer = CpuBuffer;
    type Tensor = CpuTensor;
    type Event = CpuEvent;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc_buffer(&self, pages: u32, page_bytes: usize) -> Result<CpuBuffer, DeviceError> {
        let pages = (0..pages).map(|_| zeroed(page_bytes).map(RwLock::new)).collect::<Result<Vec<_>, _>>()?;
        Ok(CpuBuffer { page_bytes, pages })
    }

    fn alloc_tensor(&self, bytes: usize) -> Result<CpuTensor, DeviceError> {
        Ok(CpuTensor(RwLock::new(zeroed(bytes)?)))
    }

    fn write_page(&self, buf: &CpuBuffer, page: u32, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        let mut p = buf.page(page)?.write().unwrap_or_else(|e| e.into_inner());
        let r = range(offset, src.len(), p.len())?;
        p[r].copy_from_slice(src);
        Ok(())
    }

    fn read_page(
        &self,
        buf: &CpuBuffer,
        page: u32,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        let p = buf.page(page)?.read().unwrap_or_else(|e| e.into_inner());
        let r = range(offset, dst.len(), p.len())?;
        dst.copy_from_slice(&p[r]);
        Ok(())
    }

    #[inline]
    fn write_tensor(&self, t: &CpuTensor, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        let mut m = t.0.write().unwrap_or_else(|e| e.into_inner());
        let r = range(offset, src.len(), m.len())?;
        m[r].copy_from_slice(src);
        Ok(())
    }

    #[inline]
    fn read_tensor(&self, t: &CpuTensor, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        let m = t.0.read().unwrap_or_else(|e| e.into_inner());
        let r = range(offset, dst.len(), m.len())?;
        dst.copy_from_slice(&m[r]);
        Ok(())
    }

    fn gather(
        &self,
        cache: &[CpuTensor],
        span: &KvSpan<'_>,
        chunk: &ChunkLayout,
        dst: &CpuBuffer,
        page: u32,
    ) -> Result<(), DeviceError> {
        self.gather_refs(cache, span, chunk, dst, page)
    }

    fn scatter(
        &self,
        src: &CpuBuffer,
        page: u32,
        chunk: &ChunkLayout,
        cache: &[CpuTensor],
        span: &KvSpan<'_>,
    ) -> Result<(), DeviceError> {
        self.scatter_refs(src, page, chunk, cache, span)
    }

    fn record_event(&self) -> Result<CpuEvent, DeviceError> {
        Ok(CpuEvent)
    }

    fn wait_event(&self, _event: &CpuEvent) -> Result<(), DeviceError> {
        Ok(())
    }
}
