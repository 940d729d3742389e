//! A device chosen at run time (`device = "cpu" | "cuda"`): the simulated engines and the demo are
//! written once against [`AnyDevice`] and run on the CPU reference or on a GPU.

use std::sync::Arc;

use super::cpu::{CpuBuffer, CpuDevice, CpuEvent, CpuTensor};
use super::cuda::{CudaBuffer, CudaDevice, CudaTensor};
use super::{Device, DeviceError, KvSpan};
use crate::geometry::ChunkLayout;

/// Which device to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

impl DeviceKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "cpu" => Some(Self::Cpu),
            "cuda" => Some(Self::Cuda),
            _ => None,
        }
    }

    /// The device itself (GPU 0 for `cuda`; an error naming why when there is none).
    pub fn open(self) -> Result<AnyDevice, DeviceError> {
        match self {
            Self::Cpu => Ok(AnyDevice::Cpu(CpuDevice)),
            Self::Cuda => Ok(AnyDevice::Cuda(Arc::new(CudaDevice::new(0)?))),
        }
    }
}

/// The CPU reference or a GPU.
#[derive(Debug, Clone)]
pub enum AnyDevice {
    Cpu(CpuDevice),
    Cuda(Arc<CudaDevice>),
}

#[derive(Debug)]
pub enum AnyBuffer {
    Cpu(CpuBuffer),
    Cuda(CudaBuffer),
}

#[derive(Debug)]
pub enum AnyTensor {
    Cpu(CpuTensor),
    Cuda(CudaTensor),
}

#[derive(Debug)]
pub enum AnyEvent {
    Cpu(CpuEvent),
    Cuda(cudarc::driver::CudaEvent),
}

fn mixed() -> DeviceError {
    DeviceError::Backend("memory of one device handed to another".into())
}

fn cpu_refs(cache: &[AnyTensor]) -> Result<Vec<&CpuTensor>, DeviceError> {
    cache.iter().map(|t| if let AnyTensor::Cpu(t) = t { Ok(t) } else { Err(mixed()) }).collect()
}

fn cuda_refs(cache: &[AnyTensor]) -> Result<Vec<&CudaTensor>, DeviceError> {
    cache.iter().map(|t| if let AnyTensor::Cuda(t) = t { Ok(t) } else { Err(mixed()) }).collect()
}

impl Device for AnyDevice {
    type Buffer = AnyBuffer;
    type Tensor = AnyTensor;
    type Event = AnyEvent;

    fn name(&self) -> &'static str {
        match self {
            Self::Cpu(d) => d.name(),
            Self::Cuda(d) => d.name(),
        }
    }

    fn alloc_buffer(&self, pages: u32, page_bytes: usize) -> Result<AnyBuffer, DeviceError> {
        Ok(match self {
            Self::Cpu(d) => AnyBuffer::Cpu(d.alloc_buffer(pages, page_bytes)?),
            Self::Cuda(d) => AnyBuffer::Cuda(d.alloc_buffer(pages, page_bytes)?),
        })
    }

    fn alloc_tensor(&self, bytes: usize) -> Result<AnyTensor, DeviceError> {
        Ok(match self {
            Self::Cpu(d) => AnyTensor::Cpu(d.alloc_tensor(bytes)?),
            Self::Cuda(d) => AnyTensor::Cuda(d.alloc_tensor(bytes)?),
        })
    }

    fn write_page(&self, buf: &AnyBuffer, page: u32, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        match (self, buf) {
            (Self::Cpu(d), AnyBuffer::Cpu(b)) => d.write_page(b, page, offset, src),
            (Self::Cuda(d), AnyBuffer::Cuda(b)) => d.write_page(b, page, offset, src),
            _ => Err(mixed()),
        }
    }

    fn read_page(
        &self,
        buf: &AnyBuffer,
        page: u32,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        match (self, buf) {
            (Self::Cpu(d), AnyBuffer::Cpu(b)) => d.read_page(b, page, offset, dst),
            (Self::Cuda(d), AnyBuffer::Cuda(b)) => d.read_page(b, page, offset, dst),
            _ => Err(mixed()),
        }
    }

    #[inline]
    fn write_tensor(&self, t: &AnyTensor, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        match (self, t) {
            (Self::Cpu(d), AnyTensor::Cpu(t)) => d.write_tensor(t, offset, src),
            (Self::Cuda(d), AnyTensor::Cuda(t)) => d.write_tensor(t, offset, src),
            _ => Err(mixed()),
        }
    }

    fn read_tensor(&self, t: &AnyTensor, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        match (self, t) {
            (Self::Cpu(d), AnyTensor::Cpu(t)) => d.read_tensor(t, offset, dst),
            (Self::Cuda(d), AnyTensor::Cuda(t)) => d.read_tensor(t, offset, dst),
            _ => Err(mixed()),
        }
    }

    fn gather(
        &self,
        cache: &[AnyTensor],
        span: &KvSpan<'_>,
        chunk: &ChunkLayout,
        dst: &AnyBuffer,
        page: u32,
    ) -> Result<(), DeviceError> {
        match (self, dst) {
            (Self::Cpu(d), AnyBuffer::Cpu(b)) => d.gather_refs(&cpu_refs(cache)?, span, chunk, b, page),
            (Self::Cuda(d), AnyBuffer::Cuda(b)) => {
                d.copy(true, &cuda_refs(cache)?, span, chunk, b, page)?;
                d.synchronize()
            }
            _ => Err(mixed()),
        }
    }

    fn scatter(
        &self,
        src: &AnyBuffer,
        page: u32,
        chunk: &ChunkLayout,
        cache: &[AnyTensor],
        span: &KvSpan<'_>,
    ) -> Result<(), DeviceError> {
        match (self, src) {
            (Self::Cpu(d), AnyBuffer::Cpu(b)) => d.scatter_refs(b, page, chunk, &cpu_refs(cache)?, span),
            (Self::Cuda(d), AnyBuffer::Cuda(b)) => {
                d.copy(false, &cuda_refs(cache)?, span, chunk, b, page)?;
                d.synchronize()
            }
            _ => Err(mixed()),
        }
    }

    fn export(&self, buf: &AnyBuffer) -> Option<String> {
        match (self, buf) {
            (Self::Cpu(d), AnyBuffer::Cpu(b)) => d.export(b),
            (Self::Cuda(d), AnyBuffer::Cuda(b)) => d.export(b),
            _ => None,
        }
    }

    fn record_event(&self) -> Result<AnyEvent, DeviceError> {
        Ok(match self {
            Self::Cpu(d) => AnyEvent::Cpu(d.record_event()?),
            Self::Cuda(d) => AnyEvent::Cuda(d.record_event()?),
        })
    }

    fn wait_event(&self, event: &AnyEvent) -> Result<(), DeviceError> {
        match (self, event) {
            (Self::Cpu(d), AnyEvent::Cpu(e)) => d.wait_event(e),
            (Self::Cuda(d), AnyEvent::Cuda(e)) => d.wait_event(e),
            _ => Err(mixed()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CacheLayout;

    #[test]
    fn the_cpu_choice_round_trips_and_cuda_names_why_it_is_missing() {
        let d = DeviceKind::parse("cpu").unwrap().open().unwrap();
        let layout = CacheLayout::nhd(2, 4, 1, 4, 1);
        let chunk = ChunkLayout { layers: 1, heads: 1, head_dim: 4, dtype_bytes: 1, chunk_tokens: 4 };
        let t = d.alloc_tensor(layout.min_tensor_bytes()).unwrap();
        let bytes: Vec<u8> = (0..=u8::MAX).take(layout.min_tensor_bytes()).collect();
        d.write_tensor(&t, 0, &bytes).unwrap();
        let b = d.alloc_buffer(1, chunk.page_bytes()).unwrap();
        let span = KvSpan { layout: &layout, block_table: &[1, 0], first_token: 0, tokens: 4 };
        d.gather(std::slice::from_ref(&t), &span, &chunk, &b, 0).unwrap();
        let mut page = vec![0; chunk.page_bytes()];
        d.read_page(&b, 0, 0, &mut page).unwrap();
        // Block 1 first: K of tokens 0-3 are bytes 16..20, 20..24, ...
        assert_eq!(&page[..4], &[16, 17, 18, 19]);
        assert_eq!(DeviceKind::parse("tpu"), None);
        if let Some(why) = crate::device::cuda::unavailable() {
            let e = DeviceKind::Cuda.open().unwrap_err();
            assert!(e.to_string().contains(&why), "{e}");
        }
    }
}
