//! An engine's paged KV cache, given as one array per layer (anything with numpy's
//! `__array_interface__`: numpy arrays, `torch_tensor.numpy()` on the CPU), and the two copies
//! between it and a chunk page: gather (a prefill rank reads a chunk of a request's KV out of its
//! cache) and scatter (a decode rank writes a received chunk into its cache).
//!
//! The arrays are read through their data pointer and byte strides; what keeps that sound is
//! checked once, when the cache is described: five dimensions in a known order, non-negative
//! strides, the head dimension contiguous, every layer alike, and (for scatter) writable. Every
//! copy is then bounds-checked by the data plane's own `check_span` against each array's extent,
//! and the arrays are kept alive by the cache object for as long as it exists.

use ::baton_dataplane as dp;
use dp::device::{CacheLayout, KvSpan, check_span, for_each_element};
use dp::geometry::ChunkLayout;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::{DeviceError, Geometry, err};

/// One layer's memory: its first byte and how many bytes from there the array spans.
#[derive(Clone, Copy, Debug)]
struct Region {
    addr: usize,
    extent: usize,
}

/// What `__array_interface__` says about one array.
struct Described {
    region: Region,
    shape: Vec<usize>,
    strides: Vec<usize>,
    typestr: String,
    readonly: bool,
}

fn describe(a: &Bound<'_, PyAny>) -> PyResult<Described> {
    let iface = a.getattr("__array_interface__").map_err(|_| {
        PyTypeError::new_err("a cache layer must support __array_interface__ (a numpy array)")
    })?;
    let iface =
        iface.cast::<PyDict>().map_err(|_| PyTypeError::new_err("__array_interface__ is not a dict"))?;
    let item = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        iface.get_item(k)?.ok_or_else(|| PyTypeError::new_err(format!("__array_interface__ has no {k:?}")))
    };
    let (addr, readonly): (usize, bool) = item("data")?.extract()?;
    let shape: Vec<usize> = item("shape")?.extract()?;
    let typestr: String = item("typestr")?.extract()?;
    let itemsize: usize = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .filter(|n| *n > 0)
        .ok_or_else(|| PyTypeError::new_err(format!("unsupported dtype {typestr:?}")))?;
    let strides: Vec<usize> = match iface.get_item("strides")? {
        Some(s) if !s.is_none() => {
            let s: Vec<isize> = s.extract()?;
            s.into_iter()
                .map(|v| {
                    usize::try_from(v)
                        .map_err(|_| PyValueError::new_err("negative strides are not supported"))
                })
                .collect::<PyResult<_>>()?
        }
        // C order.
        _ => {
            let mut st = vec![0usize; shape.len()];
            let mut acc = itemsize;
            for (i, d) in shape.iter().enumerate().rev() {
                if let Some(x) = st.get_mut(i) {
                    *x = acc;
                }
                acc = acc.saturating_mul(*d);
            }
            st
        }
    };
    if strides.len() != shape.len() {
        return Err(PyValueError::new_err("strides and shape differ in length"));
    }
    if strides.last() != Some(&itemsize) {
        return Err(PyValueError::new_err("the last (head_dim) dimension must be contiguous"));
    }
    let extent = if shape.contains(&0) {
        0
    } else {
        shape
            .iter()
            .zip(&strides)
            .try_fold(itemsize, |acc, (d, s)| (d - 1).checked_mul(*s).and_then(|x| x.checked_add(acc)))
            .ok_or_else(|| PyValueError::new_err("array too large"))?
    };
    if addr == 0 && extent > 0 {
        return Err(PyValueError::new_err("array has no data"));
    }
    Ok(Described { region: Region { addr, extent }, shape, strides, typestr, readonly })
}

/// An engine's paged KV cache: one array per layer, each `[2, num_blocks, block_size, heads,
/// head_dim]` (`order="nhd"`, vLLM's FlashAttention layout) or `[2, num_blocks, heads, block_size,
/// head_dim]` (`order="hnd"`), K then V. The arrays are kept alive by this object.
#[pyclass(module = "baton_dataplane", frozen)]
pub(crate) struct PagedCache {
    regions: Vec<Region>,
    pub(crate) layout: CacheLayout,
    writable: bool,
    _arrays: Vec<Py<PyAny>>,
}

#[pymethods]
impl PagedCache {
    #[new]
    #[pyo3(signature = (layers, *, order = "nhd"))]
    fn new(layers: Vec<Bound<'_, PyAny>>, order: &str) -> PyResult<Self> {
        let first = layers.first().ok_or_else(|| PyValueError::new_err("no layers"))?;
        let d = describe(first)?;
        let (num_blocks, block_size, heads, head_dim, strides) =
            match (order, d.shape.as_slice(), d.strides.as_slice()) {
                ("nhd", [2, nb, bs, h, hd], [sk, sb, st, sh, _]) => (*nb, *bs, *h, *hd, (*sk, *sb, *st, *sh)),
                ("hnd", [2, nb, h, bs, hd], [sk, sb, sh, st, _]) => (*nb, *bs, *h, *hd, (*sk, *sb, *st, *sh)),
                ("nhd" | "hnd", shape, _) => {
                    return Err(PyValueError::new_err(format!(
                        "a layer must have shape [2, num_blocks, {}, head_dim], got {shape:?}",
                        if order == "nhd" { "block_size, heads" } else { "heads, block_size" }
                    )));
                }
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "order must be \"nhd\" or \"hnd\", got {order:?}"
                    )));
                }
            };
        let itemsize = d.strides.last().copied().unwrap_or(1);
        let n = |v: usize| u32::try_from(v).map_err(|_| PyValueError::new_err("dimension too large"));
        let layout = CacheLayout {
            num_blocks: n(num_blocks)?,
            block_size: n(block_size)?,
            heads: n(heads)?,
            head_dim: n(head_dim)?,
            dtype_bytes: n(itemsize)?,
            kv_stride: strides.0,
            block_stride: strides.1,
            token_stride: strides.2,
            head_stride: strides.3,
        };
        let mut regions = Vec::with_capacity(layers.len());
        let mut writable = true;
        for (i, a) in layers.iter().enumerate() {
            let x = describe(a)?;
            if x.shape != d.shape || x.strides != d.strides || x.typestr != d.typestr {
                return Err(PyValueError::new_err(format!(
                    "layer {i} differs from layer 0 in shape, strides or dtype"
                )));
            }
            writable &= !x.readonly;
            regions.push(x.region);
        }
        Ok(Self { regions, layout, writable, _arrays: layers.iter().map(|a| a.clone().unbind()).collect() })
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.regions.len()
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.layout.num_blocks
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.layout.block_size
    }

    /// Tokens `first_token .. first_token + tokens` of a request whose blocks are `block_table`,
    /// gathered into one chunk page of `geometry` (bytes after the last token are zero).
    #[pyo3(signature = (geometry, block_table, first_token, tokens))]
    fn gather<'py>(
        &self,
        py: Python<'py>,
        geometry: &Geometry,
        block_table: Vec<u32>,
        first_token: u32,
        tokens: u32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let cl = geometry.inner.chunk_layout();
        let mut page = vec![0u8; cl.page_bytes()];
        py.detach(|| self.copy(&cl, &block_table, first_token, tokens, &mut page, Direction::Gather))
            .map_err(err(DeviceError::new_err))?;
        Ok(PyBytes::new(py, &page))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Cache → page.
    Gather,
    /// Page → cache.
    Scatter,
}

impl PagedCache {
    /// Moves one span between the cache and `page` (a chunk page of `cl`), after checking every
    /// offset it will touch lies inside its array.
    pub(crate) fn copy(
        &self,
        cl: &ChunkLayout,
        block_table: &[u32],
        first_token: u32,
        tokens: u32,
        page: &mut [u8],
        dir: Direction,
    ) -> Result<(), dp::device::DeviceError> {
        if dir == Direction::Scatter && !self.writable {
            return Err(dp::device::DeviceError::Layout("the cache arrays are read-only".into()));
        }
        if page.len() != cl.page_bytes() {
            return Err(dp::device::DeviceError::Layout(format!(
                "page of {} bytes, the chunk layout's is {}",
                page.len(),
                cl.page_bytes()
            )));
        }
        let span = KvSpan { layout: &self.layout, block_table, first_token, tokens };
        let extents: Vec<usize> = self.regions.iter().map(|r| r.extent).collect();
        check_span(cl, self.regions.len(), &extents, &span)?;
        let n = cl.head_bytes();
        for_each_element(cl, &span, |layer, at_page, at_cache| {
            let r = self
                .regions
                .get(layer)
                .ok_or_else(|| dp::device::DeviceError::Layout("no such layer".into()))?;
            let p = page.get_mut(at_page..at_page + n).ok_or(dp::device::DeviceError::OutOfBounds {
                offset: at_page,
                len: n,
                size: cl.page_bytes(),
            })?;
            if at_cache.checked_add(n).is_none_or(|end| end > r.extent) {
                return Err(dp::device::DeviceError::OutOfBounds {
                    offset: at_cache,
                    len: n,
                    size: r.extent,
                });
            }
            let at = (r.addr + at_cache) as *mut u8;
            // SAFETY: `at .. at + n` lies inside the array (checked just above against the extent
            // computed from its shape and strides), which `_arrays` keeps alive; `p` is a distinct
            // Rust buffer, so the two ranges do not overlap.
            unsafe {
                match dir {
                    Direction::Gather => std::ptr::copy_nonoverlapping(at.cast_const(), p.as_mut_ptr(), n),
                    Direction::Scatter => std::ptr::copy_nonoverlapping(p.as_ptr(), at, n),
                }
            }
            Ok(())
        })
    }
}
