//! `baton_dataplane._native`: the data plane for engine ranks written in Python: a rank's PD buffer
//! in host memory (a shared-memory file, so same-host producers can write into it directly), the
//! guards of a request's life on it, the rank's server and a prefill rank's producer connection
//! (`net`), and the copies between a chunk page and an engine's paged cache (`cache`).
//!
//! Each guard holds its Rust typestate in a `Mutex<Option<_>>`: a transition takes it out (so a
//! guard is used at most once), `close()` and the end of a `with` block drop it, and so does Python's
//! garbage collector when the object goes: the pages are released exactly once whichever comes
//! first. Copies run with the GIL released.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

mod cache;
mod net;

use ::baton_dataplane as dp;
use dp::device::shm::ShmDevice;
use dp::events::{DiscardSink, EventSink};
use dp::{
    BufferOptions, Clock, Consuming as DpConsuming, KvGeometry, NotReady, PageAddr, Ready as DpReady,
    RequestId, RequestKey, Reservation as DpReservation, ReserveRequest, SystemClock, WriteOutcome,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

create_exception!(baton_dataplane, DataPlaneError, PyException, "A data-plane operation was refused.");
create_exception!(
    baton_dataplane,
    ReserveError,
    DataPlaneError,
    "No room, a duplicate or a lease already past."
);
create_exception!(
    baton_dataplane,
    WriteError,
    DataPlaneError,
    "A chunk write refused: a stale generation, a page of another request, an ended request."
);
create_exception!(
    baton_dataplane,
    LeaseError,
    DataPlaneError,
    "The request's lease expired or it was closed."
);
create_exception!(baton_dataplane, DeviceError, DataPlaneError, "The device could not copy.");
create_exception!(baton_dataplane, GuardClosed, DataPlaneError, "The guard was already used or closed.");
create_exception!(
    baton_dataplane,
    WaitTimeout,
    DataPlaneError,
    "A request's KV was not all in within the time given."
);
create_exception!(
    baton_dataplane,
    TransportError,
    DataPlaneError,
    "A data-plane connection failed: refused at the handshake, closed, or timed out."
);

type Device = ShmDevice;

fn err<E: std::fmt::Display>(kind: fn(String) -> PyErr) -> impl Fn(E) -> PyErr {
    move |e| kind(e.to_string())
}

/// Takes the guard's state out, or says it is gone.
fn take<T>(slot: &Mutex<Option<T>>) -> PyResult<T> {
    slot.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .ok_or_else(|| GuardClosed::new_err("guard already used or closed"))
}

fn key(request_id: u128, epoch: u32) -> RequestKey {
    RequestKey::new(RequestId(request_id), epoch)
}

/// A model's KV-cache shape, chunked for PD transfer and split over `tp_size` ranks: what every
/// rank, producer and the gateway must agree on (checked by fingerprint when they connect).
#[pyclass(module = "baton_dataplane", name = "KvGeometry", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash)]
struct Geometry {
    inner: KvGeometry,
}

#[pymethods]
impl Geometry {
    #[new]
    #[pyo3(signature = (*, layers, kv_heads, head_dim, dtype_bytes, chunk_tokens, tp_size = 1))]
    fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        chunk_tokens: u32,
        tp_size: u32,
    ) -> PyResult<Self> {
        KvGeometry::new(layers, kv_heads, head_dim, dtype_bytes, chunk_tokens, tp_size)
            .map(|inner| Self { inner })
            .map_err(err(PyValueError::new_err))
    }

    /// From a Hugging Face `config.json` (its text): layers, KV heads, head size and dtype.
    #[staticmethod]
    #[pyo3(signature = (config_json, *, chunk_tokens, tp_size = 1))]
    fn from_hf_config(config_json: &str, chunk_tokens: u32, tp_size: u32) -> PyResult<Self> {
        KvGeometry::from_hf_config(config_json, chunk_tokens, tp_size, None)
            .map(|inner| Self { inner })
            .map_err(err(PyValueError::new_err))
    }

    #[getter]
    fn layers(&self) -> u32 {
        self.inner.layers
    }
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.inner.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim
    }
    #[getter]
    fn dtype_bytes(&self) -> u32 {
        self.inner.dtype_bytes
    }
    #[getter]
    fn chunk_tokens(&self) -> u32 {
        self.inner.chunk_tokens
    }
    #[getter]
    fn tp_size(&self) -> u32 {
        self.inner.tp_size
    }
    /// KV heads on each rank.
    #[getter]
    fn heads_per_rank(&self) -> u32 {
        self.inner.heads_per_rank()
    }
    /// Bytes of one page (one chunk) on one rank.
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.inner.page_bytes_per_rank()
    }
    /// What peers compare when they connect.
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }
    /// Chunks (pages) a prompt of `tokens` tokens needs.
    fn chunks_for(&self, tokens: u64) -> u64 {
        self.inner.pages_for_tokens(tokens)
    }
    /// Byte offset in a chunk page of `(layer, kv, token)`: `[layer][k|v][token][head][head_dim]`.
    fn page_offset(&self, layer: u32, kv: u32, token: u32) -> usize {
        self.inner.chunk_layout().offset(layer, kv, token)
    }
    fn __repr__(&self) -> String {
        let g = &self.inner;
        format!(
            "KvGeometry(layers={}, kv_heads={}, head_dim={}, dtype_bytes={}, chunk_tokens={}, tp_size={})",
            g.layers, g.kv_heads, g.head_dim, g.dtype_bytes, g.chunk_tokens, g.tp_size
        )
    }
}

/// A rank's buffer of `pages` pages in a shared-memory file, its events going to `sink`.
fn make_buffer(
    g: KvGeometry,
    rank: u32,
    pages: u32,
    quarantine_ms: Option<u64>,
    sink: Arc<dyn EventSink>,
) -> PyResult<dp::RankBuffer<Device>> {
    if rank >= g.tp_size {
        return Err(PyValueError::new_err(format!("rank {rank} is not below tp_size {}", g.tp_size)));
    }
    let mut options = BufferOptions::default();
    if let Some(ms) = quarantine_ms {
        options.quarantine_ttl = Duration::from_millis(ms);
    }
    dp::RankBuffer::new(Arc::new(ShmDevice::default()), g, rank, pages, options, Arc::new(SystemClock), sink)
        .map_err(err(DeviceError::new_err))
}

/// A buffer's pages by state and the requests it holds.
fn stats_dict<'py>(py: Python<'py>, b: &dp::RankBuffer<Device>) -> PyResult<Bound<'py, PyDict>> {
    let s = b.stats();
    let d = PyDict::new(py);
    d.set_item("rank", s.rank)?;
    d.set_item("total", s.total)?;
    d.set_item("free", s.pages.free)?;
    d.set_item("reserved", s.pages.reserved)?;
    d.set_item("filled", s.pages.filled)?;
    d.set_item("quarantined", s.pages.quarantined)?;
    d.set_item("consuming", s.pages.consuming)?;
    d.set_item("requests", s.requests)?;
    d.set_item("accounting_errors", s.accounting_errors)?;
    Ok(d)
}

/// One rank's paged PD buffer in host memory (a shared-memory file). Standalone, the engine itself
/// reserves and writes; behind a [`net::RankServer`] the gateway and producers do.
#[pyclass(module = "baton_dataplane", frozen)]
struct RankBuffer {
    inner: dp::RankBuffer<Device>,
}

#[pymethods]
impl RankBuffer {
    /// A buffer of `pages` pages for rank `rank` of `geometry`, each page one chunk of the rank's
    /// share of the KV; pages a cancel quarantined come back after `quarantine_ms` at the latest.
    #[new]
    #[pyo3(signature = (geometry, *, pages, rank = 0, quarantine_ms = None))]
    fn new(geometry: &Geometry, pages: u32, rank: u32, quarantine_ms: Option<u64>) -> PyResult<Self> {
        Ok(Self { inner: make_buffer(geometry.inner, rank, pages, quarantine_ms, Arc::new(DiscardSink))? })
    }

    /// The geometry it was made for.
    #[getter]
    fn geometry(&self) -> Geometry {
        Geometry { inner: self.inner.geometry() }
    }

    /// The shared-memory file producers on this host may write pages into.
    #[getter]
    fn export(&self) -> Option<String> {
        self.inner.export()
    }

    /// Bytes of one page (one chunk of this rank's KV).
    #[getter]
    fn page_bytes(&self) -> usize {
        self.inner.page_bytes()
    }

    /// Reserves `chunks` pages for the request, all or nothing, until `lease_ms` from now.
    #[pyo3(signature = (request_id, chunks, lease_ms, *, epoch = 0))]
    fn reserve(&self, request_id: u128, chunks: u32, lease_ms: u64, epoch: u32) -> PyResult<Reservation> {
        let lease = SystemClock.now() + Duration::from_millis(lease_ms);
        let r = self
            .inner
            .reserve(ReserveRequest { key: key(request_id, epoch), chunks, prefixes: &[], lease })
            .map_err(err(ReserveError::new_err))?;
        Ok(Reservation { inner: Mutex::new(Some(r)), layout: self.inner.chunk_layout() })
    }

    /// Writes one whole chunk (`data`: `page_bytes` bytes; a numpy array's `.tobytes()`) at the address
    /// `publish()` gave; `True` when it was the request's last. A write naming an old generation,
    /// another request's page or an ended request is refused with nothing changed.
    #[pyo3(signature = (request_id, chunk, page, generation, data, *, epoch = 0))]
    #[allow(clippy::too_many_arguments)]
    fn write_chunk(
        &self,
        py: Python<'_>,
        request_id: u128,
        chunk: u32,
        page: u32,
        generation: u32,
        data: &[u8],
        epoch: u32,
    ) -> PyResult<bool> {
        let addr = PageAddr { page, generation };
        let buffer = &self.inner;
        let outcome = py
            .detach(|| buffer.write_chunk(key(request_id, epoch), chunk, addr, data))
            .map_err(err(WriteError::new_err))?;
        Ok(matches!(outcome, WriteOutcome::Stored { ready: true }))
    }

    /// The producer will write nothing more for the request: its quarantined pages come back now
    /// instead of at the quarantine deadline. Whether the request was known.
    #[pyo3(signature = (request_id, *, epoch = 0))]
    fn fence(&self, request_id: u128, epoch: u32) -> bool {
        self.inner.fence(key(request_id, epoch))
    }

    /// Ends the leases that have passed; how many requests it ended.
    fn reap(&self) -> usize {
        self.inner.reap()
    }

    /// Pages by state and the requests held.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner)
    }
}

/// A request's pages while its chunks arrive. Closing it (or dropping it) cancels the request.
#[pyclass(module = "baton_dataplane", frozen)]
struct Reservation {
    inner: Mutex<Option<DpReservation<Device>>>,
    /// For the copies of the guards after it (the pages themselves are held by the guard).
    layout: dp::geometry::ChunkLayout,
}

#[pymethods]
impl Reservation {
    /// The write addresses of the chunks to receive: `[(chunk, page, generation)]`.
    fn publish(&self) -> PyResult<Vec<(u32, u32, u32)>> {
        let mut slot = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let r = slot.as_mut().ok_or_else(|| GuardClosed::new_err("guard already used or closed"))?;
        Ok(r.publish().into_iter().map(|(c, a)| (c, a.page, a.generation)).collect())
    }

    /// Chunks (pages) the request holds.
    #[getter]
    fn chunks(&self) -> PyResult<u32> {
        let slot = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(slot.as_ref().ok_or_else(|| GuardClosed::new_err("guard already used or closed"))?.chunks())
    }

    /// Whether every chunk has arrived (the reservation stays); `LeaseError` once it expired or
    /// was cancelled.
    fn is_ready(&self) -> PyResult<bool> {
        let slot = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let r = slot.as_ref().ok_or_else(|| GuardClosed::new_err("guard already used or closed"))?;
        r.is_ready().map_err(err(LeaseError::new_err))
    }

    /// The ready state once every chunk has arrived (this reservation is then used up); `None`
    /// while chunks are missing; `LeaseError` once the request expired or was cancelled.
    fn try_ready(&self) -> PyResult<Option<Ready>> {
        let r = take(&self.inner)?;
        match r.try_ready() {
            Ok(ready) => Ok(Some(Ready { inner: Mutex::new(Some(ready)), layout: self.layout })),
            Err(NotReady::Pending(r)) => {
                *self.inner.lock().unwrap_or_else(PoisonError::into_inner) = Some(r);
                Ok(None)
            }
            Err(NotReady::Closed(e)) => Err(LeaseError::new_err(e.to_string())),
        }
    }
}

/// Every chunk of the request is in the buffer. Closing it frees the pages unconsumed.
#[pyclass(module = "baton_dataplane", frozen)]
pub(crate) struct Ready {
    pub(crate) inner: Mutex<Option<DpReady<Device>>>,
    pub(crate) layout: dp::geometry::ChunkLayout,
}

#[pymethods]
impl Ready {
    /// Chunks (pages) the request holds.
    #[getter]
    fn chunks(&self) -> PyResult<u32> {
        let slot = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(slot.as_ref().ok_or_else(|| GuardClosed::new_err("guard already used or closed"))?.chunks())
    }

    /// Starts moving the pages into the engine's cache (this guard is then used up); `LeaseError`
    /// if the lease passed while the request waited.
    fn consume(&self) -> PyResult<Consuming> {
        let c = take(&self.inner)?.consume().map_err(err(LeaseError::new_err))?;
        Ok(Consuming { inner: Mutex::new(Some(c)), layout: self.layout })
    }
}

/// The engine is moving the request's pages out; closing it (after the last copy) frees them.
#[pyclass(module = "baton_dataplane", frozen)]
struct Consuming {
    inner: Mutex<Option<DpConsuming<Device>>>,
    layout: dp::geometry::ChunkLayout,
}

#[pymethods]
impl Consuming {
    /// A copy of chunk `chunk`'s page.
    fn read_chunk<'py>(&self, py: Python<'py>, chunk: u32) -> PyResult<Bound<'py, PyBytes>> {
        let slot = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let c = slot.as_ref().ok_or_else(|| GuardClosed::new_err("guard already used or closed"))?;
        let mut out = vec![0u8; self.layout.page_bytes()];
        py.detach(|| c.read_chunk(chunk, &mut out)).map_err(err(DeviceError::new_err))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Writes chunk `chunk` into the engine's paged cache: its tokens are the request's
    /// `first_token .. first_token + tokens`, whose cache blocks are `block_table` (the whole
    /// request's, in order).
    #[pyo3(signature = (chunk, cache, block_table, first_token, tokens))]
    fn scatter_chunk(
        &self,
        py: Python<'_>,
        chunk: u32,
        cache: &cache::PagedCache,
        block_table: Vec<u32>,
        first_token: u32,
        tokens: u32,
    ) -> PyResult<()> {
        let slot = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let c = slot.as_ref().ok_or_else(|| GuardClosed::new_err("guard already used or closed"))?;
        let cl = self.layout;
        let mut page = vec![0u8; self.layout.page_bytes()];
        py.detach(|| {
            c.read_chunk(chunk, &mut page)?;
            cache.copy(&cl, &block_table, first_token, tokens, &mut page, cache::Direction::Scatter)
        })
        .map_err(err(DeviceError::new_err))
    }
}

/// What every guard has: `close()` (releases what it holds now; twice does nothing; what
/// dropping a Reservation does is cancel, a Ready free the pages unconsumed, a Consuming free them
/// after the copies, a Producer or Control close its connection), `closed`, and the `with`
/// protocol, which closes it at the block's end.
macro_rules! guard {
    ($t:ty) => {
        #[pymethods]
        impl $t {
            fn close(&self) {
                drop(self.inner.lock().unwrap_or_else(PoisonError::into_inner).take());
            }

            #[getter]
            fn closed(&self) -> bool {
                self.inner.lock().unwrap_or_else(PoisonError::into_inner).is_none()
            }

            fn __enter__(slf: Py<Self>) -> Py<Self> {
                slf
            }

            fn __exit__(&self, _t: Py<PyAny>, _v: Py<PyAny>, _tb: Py<PyAny>) -> bool {
                self.close();
                false
            }
        }
    };
}

guard!(Reservation);
guard!(Ready);
guard!(Consuming);
guard!(net::Producer);
guard!(net::Control);

#[pymodule(name = "_native")]
fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Geometry>()?;
    m.add_class::<RankBuffer>()?;
    m.add_class::<net::RankServer>()?;
    m.add_class::<net::Events>()?;
    m.add_class::<net::Producer>()?;
    m.add_class::<net::Control>()?;
    m.add_class::<cache::PagedCache>()?;
    m.add_class::<Reservation>()?;
    m.add_class::<Ready>()?;
    m.add_class::<Consuming>()?;
    m.add("DataPlaneError", py.get_type::<DataPlaneError>())?;
    m.add("ReserveError", py.get_type::<ReserveError>())?;
    m.add("WriteError", py.get_type::<WriteError>())?;
    m.add("LeaseError", py.get_type::<LeaseError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("GuardClosed", py.get_type::<GuardClosed>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("WaitTimeout", py.get_type::<WaitTimeout>())?;
    Ok(())
}
