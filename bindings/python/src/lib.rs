//! `baton_dataplane._native`: one rank's PD buffer on the CPU, and the guards of a request's life on
//! it, for engines written in Python.
//!
//! Each guard holds its Rust typestate in a `Mutex<Option<_>>`: a transition takes it out (so a
//! guard is used at most once), `close()` and the end of a `with` block drop it, and so does Python's
//! garbage collector when the object goes: the pages are released exactly once whichever comes
//! first. Copies run with the GIL released.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ::baton_dataplane as dp;
use dp::device::cpu::CpuDevice;
use dp::events::DiscardSink;
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

type Device = CpuDevice;

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

/// One rank's paged PD buffer in host memory.
#[pyclass(module = "baton_dataplane", frozen)]
struct RankBuffer {
    inner: dp::RankBuffer<Device>,
}

#[pymethods]
impl RankBuffer {
    /// A buffer of `pages` pages, each one chunk of `chunk_tokens` tokens of this rank's share of
    /// the KV (`layers` × 2 × `kv_heads / tp_size` × `head_dim` × `dtype_bytes` per token).
    #[new]
    #[pyo3(signature = (*, pages, layers, kv_heads, head_dim, dtype_bytes, chunk_tokens, tp_size = 1, rank = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        pages: u32,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        chunk_tokens: u32,
        tp_size: u32,
        rank: u32,
    ) -> PyResult<Self> {
        let g = KvGeometry::new(layers, kv_heads, head_dim, dtype_bytes, chunk_tokens, tp_size)
            .map_err(err(PyValueError::new_err))?;
        if rank >= tp_size {
            return Err(PyValueError::new_err(format!("rank {rank} is not below tp_size {tp_size}")));
        }
        let inner = dp::RankBuffer::new(
            Arc::new(CpuDevice),
            g,
            rank,
            pages,
            BufferOptions::default(),
            Arc::new(SystemClock),
            Arc::new(DiscardSink),
        )
        .map_err(err(DeviceError::new_err))?;
        Ok(Self { inner })
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
        Ok(Reservation { inner: Mutex::new(Some(r)), page_bytes: self.inner.page_bytes() })
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
        let s = self.inner.stats();
        let d = PyDict::new(py);
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
}

/// A request's pages while its chunks arrive. Closing it (or dropping it) cancels the request.
#[pyclass(module = "baton_dataplane", frozen)]
struct Reservation {
    inner: Mutex<Option<DpReservation<Device>>>,
    /// For the copies of the guards after it (the pages themselves are held by the guard).
    page_bytes: usize,
}

#[pymethods]
impl Reservation {
    /// The write addresses of the chunks to receive: `[(chunk, page, generation)]`.
    fn publish(&self) -> PyResult<Vec<(u32, u32, u32)>> {
        let mut slot = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let r = slot.as_mut().ok_or_else(|| GuardClosed::new_err("guard already used or closed"))?;
        Ok(r.publish().into_iter().map(|(c, a)| (c, a.page, a.generation)).collect())
    }

    /// The ready state once every chunk has arrived (this reservation is then used up); `None`
    /// while chunks are missing; `LeaseError` once the request expired or was cancelled.
    fn try_ready(&self) -> PyResult<Option<Ready>> {
        let r = take(&self.inner)?;
        match r.try_ready() {
            Ok(ready) => Ok(Some(Ready { inner: Mutex::new(Some(ready)), page_bytes: self.page_bytes })),
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
struct Ready {
    inner: Mutex<Option<DpReady<Device>>>,
    page_bytes: usize,
}

#[pymethods]
impl Ready {
    /// Starts moving the pages into the engine's cache (this guard is then used up); `LeaseError`
    /// if the lease passed while the request waited.
    fn consume(&self) -> PyResult<Consuming> {
        let c = take(&self.inner)?.consume().map_err(err(LeaseError::new_err))?;
        Ok(Consuming { inner: Mutex::new(Some(c)), page_bytes: self.page_bytes })
    }
}

/// The engine is moving the request's pages out; closing it (after the last copy) frees them.
#[pyclass(module = "baton_dataplane", frozen)]
struct Consuming {
    inner: Mutex<Option<DpConsuming<Device>>>,
    page_bytes: usize,
}

#[pymethods]
impl Consuming {
    /// A copy of chunk `chunk`'s page.
    fn read_chunk<'py>(&self, py: Python<'py>, chunk: u32) -> PyResult<Bound<'py, PyBytes>> {
        let slot = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let c = slot.as_ref().ok_or_else(|| GuardClosed::new_err("guard already used or closed"))?;
        let mut out = vec![0u8; self.page_bytes];
        py.detach(|| c.read_chunk(chunk, &mut out)).map_err(err(DeviceError::new_err))?;
        Ok(PyBytes::new(py, &out))
    }
}

/// What every guard has: `close()` (releases what it holds now; twice does nothing; what
/// dropping a Reservation does is cancel, a Ready free the pages unconsumed, a Consuming free them
/// after the copies), `closed`, and the `with` protocol, which closes it at the block's end.
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

#[pymodule(name = "_native")]
fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<RankBuffer>()?;
    m.add_class::<Reservation>()?;
    m.add_class::<Ready>()?;
    m.add_class::<Consuming>()?;
    m.add("DataPlaneError", py.get_type::<DataPlaneError>())?;
    m.add("ReserveError", py.get_type::<ReserveError>())?;
    m.add("WriteError", py.get_type::<WriteError>())?;
    m.add("LeaseError", py.get_type::<LeaseError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("GuardClosed", py.get_type::<GuardClosed>())?;
    Ok(())
}
