//! The data plane over TCP: a decode rank's server ([`RankServer`]), a prefill rank's connection to
//! one decoder rank ([`Producer`], over the socket or the rank's shared-memory export), and the
//! gateway's control connection ([`Control`]; engines do not need it, tests and tools do).
//!
//! One tokio runtime per process, started on first use, runs the servers; blocking calls from Python
//! wait on it with the GIL released.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use ::baton_dataplane as dp;
use dp::transport::{
    ControlClient, ProducerClient, ServerHandle, TlsClient, TlsServer, TransportError as DpTransportError,
};
use dp::{PageAddr, RequestKey};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{
    DataPlaneError, Device, GuardClosed, LeaseError, RankBuffer, Ready, Reservation, ReserveError,
    TransportError, WaitTimeout, WriteError, key, make_buffer, stats_dict,
};

/// The process's runtime for the data plane's sockets.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("baton-dataplane")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| DataPlaneError::new_err(format!("cannot start the data plane's runtime: {e}")))
}

/// A peer's TLS to a rank (`tls_ca` given), or `None` for plain TCP: the CA the rank's certificate
/// chains to, the name it must carry, and for mTLS the peer's own certificate and key (together).
fn tls_client(
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    server_name: &str,
) -> PyResult<Option<TlsClient>> {
    let identity = match (&cert, &key) {
        (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
        (None, None) => None,
        _ => return Err(PyValueError::new_err("tls_cert and tls_key go together")),
    };
    let Some(ca) = ca else {
        return match identity {
            Some(_) => Err(PyValueError::new_err("tls_cert needs tls_ca (the CA of the rank's certificate)")),
            None => Ok(None),
        };
    };
    TlsClient::from_pem_files(&ca, server_name, identity)
        .map(Some)
        .map_err(|e| PyValueError::new_err(format!("data-plane TLS: {e}")))
}

fn parse_addr(address: &str) -> PyResult<SocketAddr> {
    address.parse().map_err(|_| PyValueError::new_err(format!("not an IP:port address: {address:?}")))
}

/// One chunk `write_chunks` is given: `(chunk, page, generation, data)`, the page and generation
/// `None` when the producer reserves for itself.
type ChunkToWrite = (u32, Option<u32>, Option<u32>, Vec<u8>);

/// A transport error as Python sees it: a refused write is a `WriteError`, a refused reservation a
/// `ReserveError` (a rank without room, whatever the call), anything else (closed, timed out, a bad
/// peer) a `TransportError`.
fn transport(e: DpTransportError, refused: fn(String) -> PyErr) -> PyErr {
    match e {
        // No room is only ever a reservation's refusal (a producer's own, with its chunks).
        DpTransportError::Refused { code: dp::wire::RefusalCode::Busy, .. } => {
            ReserveError::new_err(e.to_string())
        }
        DpTransportError::Refused { .. } => refused(e.to_string()),
        e => TransportError::new_err(e.to_string()),
    }
}

/// Runs `f` on the runtime, the GIL released, within `limit`.
fn block_on<T: Send>(
    py: Python<'_>,
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, DpTransportError>> + Send,
) -> PyResult<Result<T, DpTransportError>> {
    let rt = runtime()?;
    Ok(py.detach(|| {
        rt.block_on(async {
            tokio::time::timeout(limit, f).await.unwrap_or(Err(DpTransportError::Timeout(limit)))
        })
    }))
}

/// A decode rank's PD buffer served over TCP: the gateway reserves pages through it, prefill ranks
/// write chunks into them (over the socket, or into the shared-memory export on the same host), and
/// the engine takes each request's reservation to consume it. Closing it stops the server.
#[pyclass(module = "baton_dataplane", frozen)]
pub(crate) struct RankServer {
    server: Arc<dp::transport::RankServer<Device>>,
    handle: Mutex<Option<ServerHandle>>,
    addr: SocketAddr,
}

#[pymethods]
impl RankServer {
    /// Rank `rank` of `geometry.tp_size`, with `pages` pages, listening on `host:port` (`port=0`: an
    /// ephemeral port; see `address`). With `tls_cert` and `tls_key` (PEM files) it serves TLS 1.3
    /// only; with `tls_client_ca` too, mTLS: a peer without a certificate from that CA is refused
    /// at the handshake, before a frame is read (counted in `stats()["handshakes_refused"]`).
    /// Without them the port is plain TCP: anyone who reaches it can reserve, cancel and write KV,
    /// so keep it on loopback or a network nobody else reaches (`docs/dataplane.md`).
    /// `decode_waits=True` tells the gateway (in the handshake) that this engine waits for a
    /// request's KV itself ([`RankServer::take_ready`]), so it sends the decode request with the
    /// prefill, `baton.kv_wait_ms` set; an engine that says so must honour that field.
    #[new]
    #[pyo3(signature = (
        geometry, *, pages, rank = 0, host = "127.0.0.1", port = 0, quarantine_ms = None,
        tls_cert = None, tls_key = None, tls_client_ca = None, decode_waits = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        geometry: &crate::Geometry,
        pages: u32,
        rank: u32,
        host: &str,
        port: u16,
        quarantine_ms: Option<u64>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        tls_client_ca: Option<PathBuf>,
        decode_waits: bool,
    ) -> PyResult<Self> {
        let tls = match (&tls_cert, &tls_key, &tls_client_ca) {
            (Some(c), Some(k), ca) => Some(
                TlsServer::from_pem_files(c, k, ca.as_deref())
                    .map_err(|e| PyValueError::new_err(format!("data-plane TLS: {e}")))?,
            ),
            (None, None, None) => None,
            (None, None, Some(_)) => {
                return Err(PyValueError::new_err("tls_client_ca needs tls_cert and tls_key"));
            }
            _ => return Err(PyValueError::new_err("tls_cert and tls_key go together")),
        };
        let (sink, tx) = dp::transport::RankServer::<Device>::sink();
        let buf = make_buffer(geometry.inner, rank, pages, quarantine_ms, sink)?;
        let server = dp::transport::RankServer::new(buf, geometry.inner.tp_size, tx);
        server.set_decode_waits(decode_waits);
        let at =
            parse_addr(&format!("{host}:{port}")).or_else(|_| parse_addr(&format!("[{host}]:{port}")))?;
        let rt = runtime()?;
        let handle = py
            .detach(|| {
                rt.block_on(async {
                    let listener = tokio::net::TcpListener::bind(at).await?;
                    match tls {
                        Some(t) => server.start_tls(listener, t),
                        None => server.start(listener),
                    }
                })
            })
            .map_err(|e| TransportError::new_err(format!("listen on {at}: {e}")))?;
        Ok(Self { server, addr: handle.addr, handle: Mutex::new(Some(handle)) })
    }

    /// `"ip:port"` the rank listens on: what goes in the gateway's `dataplane = [...]` list.
    #[getter]
    fn address(&self) -> String {
        self.addr.to_string()
    }

    /// The rank's buffer (the same pages the server hands out).
    #[getter]
    fn buffer(&self) -> RankBuffer {
        RankBuffer { inner: self.server.buffer().clone() }
    }

    /// The reservation the gateway made for the request on this rank, handed to the engine to
    /// consume (once: a second call returns `None`); `None` when the rank holds none.
    #[pyo3(signature = (request_id, *, epoch = 0))]
    fn take(&self, request_id: u128, epoch: u32) -> Option<Reservation> {
        let layout = self.server.buffer().chunk_layout();
        self.server.take(key(request_id, epoch)).map(|r| Reservation { inner: Mutex::new(Some(r)), layout })
    }

    /// Whether the rank tells the gateway this engine waits for the KV itself (`decode_waits`).
    #[getter]
    fn decode_waits(&self) -> bool {
        self.server.decode_waits()
    }

    /// The request's KV once every chunk of it is in on this rank, waiting up to `timeout_ms` (the
    /// GIL released): what a decode request that came with the prefill (`baton.kv_wait_ms`) does.
    /// `None` when the rank holds no reservation of it (never reserved, already taken, or ended
    /// and forgotten before the call); `LeaseError` as soon as the request is cancelled or its
    /// lease expires while it waits (or before, while the rank still holds it); `WaitTimeout` when
    /// the KV is not all in by then (the reservation stays, for the gateway to cancel). The
    /// request is taken from the rank only when it is ready.
    #[pyo3(signature = (request_id, *, timeout_ms, epoch = 0))]
    fn take_ready(
        &self,
        py: Python<'_>,
        request_id: u128,
        timeout_ms: u64,
        epoch: u32,
    ) -> PyResult<Option<Ready>> {
        use dp::transport::WaitError;
        let rt = runtime()?;
        let (k, within) = (key(request_id, epoch), Duration::from_millis(timeout_ms));
        let server = Arc::clone(&self.server);
        match py.detach(|| rt.block_on(async move { server.take_ready(k, within).await })) {
            Ok(ready) => Ok(Some(Ready {
                inner: Mutex::new(Some(ready)),
                layout: self.server.buffer().chunk_layout(),
            })),
            Err(WaitError::NotReserved(_)) => Ok(None),
            Err(e @ WaitError::Closed(..)) => Err(LeaseError::new_err(e.to_string())),
            Err(e @ WaitError::TimedOut(..)) => Err(WaitTimeout::new_err(e.to_string())),
        }
    }

    /// A subscription to the rank's events from now on: one terminal status per request
    /// (`ready`, `failed`, `cancelled`, `expired`) and one `released` once its pages are back.
    fn events(&self) -> Events {
        Events { rx: Mutex::new(self.server.subscribe()) }
    }

    /// The buffer's pages by state (as `RankBuffer.stats`) and the TLS handshakes refused.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = stats_dict(py, self.server.buffer())?;
        d.set_item("handshakes_refused", self.server.refused_handshakes())?;
        Ok(d)
    }

    /// Stops serving: closes every connection and waits for them. The buffer's pages held by
    /// reservations the engine took stay with their guards.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let handle = self.handle.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(h) = handle {
            let rt = runtime()?;
            py.detach(|| rt.block_on(h.shutdown()));
        }
        Ok(())
    }

    #[getter]
    fn closed(&self) -> bool {
        self.handle.lock().unwrap_or_else(PoisonError::into_inner).is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: Py<PyAny>, _v: Py<PyAny>, _tb: Py<PyAny>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
}

impl Drop for RankServer {
    fn drop(&mut self) {
        let handle = self.handle.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let (Some(h), Ok(rt)) = (handle, runtime()) {
            // Collected without close(): stop it without waiting here.
            rt.spawn(h.shutdown());
        }
    }
}

/// A rank's events, in order, as dicts: `{"type": "status", "request_id", "epoch", "rank", "state",
/// "chunks", "bytes"}` and `{"type": "released", "request_id", "epoch", "rank", "pages", "reason"}`.
/// A subscriber that falls more than 65,536 events behind gets a `TransportError` saying how many
/// it missed (then the next ones); reconcile through `stats()`.
#[pyclass(module = "baton_dataplane", frozen)]
pub(crate) struct Events {
    rx: Mutex<tokio::sync::broadcast::Receiver<dp::events::RankEvent>>,
}

fn event_dict<'py>(py: Python<'py>, e: &dp::events::RankEvent) -> PyResult<Bound<'py, PyDict>> {
    use dp::events::{RankEvent, ReleaseReason};
    let d = PyDict::new(py);
    match e {
        RankEvent::Status(s) => {
            d.set_item("type", "status")?;
            d.set_item("request_id", s.request.0)?;
            d.set_item("epoch", s.epoch)?;
            d.set_item("rank", s.rank)?;
            d.set_item("state", s.state.as_str())?;
            d.set_item("chunks", s.chunks)?;
            d.set_item("bytes", s.bytes)?;
        }
        RankEvent::Released(r) => {
            d.set_item("type", "released")?;
            d.set_item("request_id", r.key.request.0)?;
            d.set_item("epoch", r.key.epoch)?;
            d.set_item("rank", r.rank)?;
            d.set_item("pages", r.pages)?;
            let reason = match r.reason {
                ReleaseReason::Consumed => "consumed",
                ReleaseReason::Dropped => "dropped",
                ReleaseReason::Cancelled => "cancelled",
                ReleaseReason::Expired => "expired",
                ReleaseReason::Fenced => "fenced",
                ReleaseReason::QuarantineTimeout => "quarantine_timeout",
            };
            d.set_item("reason", reason)?;
        }
    }
    Ok(d)
}

#[pymethods]
impl Events {
    /// The next event, waiting up to `timeout_ms` (forever when `None`); `None` when none came.
    #[pyo3(signature = (timeout_ms = None))]
    fn next<'py>(&self, py: Python<'py>, timeout_ms: Option<u64>) -> PyResult<Option<Bound<'py, PyDict>>> {
        use tokio::sync::broadcast::error::RecvError;
        let rt = runtime()?;
        let got = py.detach(|| {
            let mut rx = self.rx.lock().unwrap_or_else(PoisonError::into_inner);
            rt.block_on(async {
                match timeout_ms {
                    Some(ms) => tokio::time::timeout(Duration::from_millis(ms), rx.recv()).await.ok(),
                    None => Some(rx.recv().await),
                }
            })
        });
        match got {
            None => Ok(None),
            Some(Ok(e)) => event_dict(py, &e).map(Some),
            Some(Err(RecvError::Lagged(n))) => {
                Err(TransportError::new_err(format!("fell {n} events behind; reconcile through stats()")))
            }
            Some(Err(RecvError::Closed)) => Err(GuardClosed::new_err("the rank server is gone")),
        }
    }
}

/// A prefill rank's connection to one decoder rank: writes whole chunks to the addresses the
/// gateway gave, and fences a request once nothing more will come for it. Not shared between
/// threads at once (calls queue on it); open one per concurrent transfer, or pool them. `close()`
/// (or the end of a `with` block) closes the connection, aborting a chunk write in flight.
#[pyclass(module = "baton_dataplane", frozen)]
pub(crate) struct Producer {
    pub(crate) inner: Mutex<Option<ProducerClient>>,
    timeout: Duration,
}

/// Runs one call on the connection in `slot`, the GIL released, within `limit`: `f` gets the
/// connection and gives it back with the result. A refusal keeps the connection; any other failure
/// (closed, timed out mid-frame) closes it, as its state is then unknown.
fn call<C: Send, T: Send, F>(
    py: Python<'_>,
    slot: &Mutex<Option<C>>,
    limit: Duration,
    refused: fn(String) -> PyErr,
    f: impl FnOnce(C) -> F + Send,
) -> PyResult<T>
where
    F: std::future::Future<Output = (C, Result<T, DpTransportError>)> + Send,
{
    call_keeping(py, slot, limit, refused, true, f)
}

/// [`call`]; `keep_refused: false` closes the connection on a refusal too (a pipelined call's
/// answers are then out of step), before the slot's lock is let go.
fn call_keeping<C: Send, T: Send, F>(
    py: Python<'_>,
    slot: &Mutex<Option<C>>,
    limit: Duration,
    refused: fn(String) -> PyErr,
    keep_refused: bool,
    f: impl FnOnce(C) -> F + Send,
) -> PyResult<T>
where
    F: std::future::Future<Output = (C, Result<T, DpTransportError>)> + Send,
{
    let rt = runtime()?;
    py.detach(|| {
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        let c = slot.take().ok_or(None)?;
        let r = rt.block_on(async { tokio::time::timeout(limit, f(c)).await });
        match r {
            Ok((c, r)) => {
                if r.is_ok() || (keep_refused && matches!(r, Err(DpTransportError::Refused { .. }))) {
                    *slot = Some(c);
                }
                r.map_err(Some)
            }
            Err(_) => Err(Some(DpTransportError::Timeout(limit))),
        }
    })
    .map_err(|e| match e {
        None => GuardClosed::new_err("the connection is closed"),
        Some(e) => transport(e, refused),
    })
}

#[pymethods]
impl Producer {
    /// Connects to decoder rank `rank` at `address` (`"ip:port"`, as the gateway names it in
    /// `baton.decoders[].addr`). The rank checks the geometry and its rank number before anything
    /// else. `shared_memory=True` writes chunks into the rank's shared-memory export (same host,
    /// same user) and fails if it has none; the socket still carries the grants and acks.
    /// With `tls_ca` the connection is TLS, checking the rank's certificate against that CA and
    /// `server_name`; `tls_cert` and `tls_key` add this peer's own certificate (mTLS).
    #[new]
    #[pyo3(signature = (
        address, geometry, *, rank = 0, shared_memory = false, timeout_ms = 10_000,
        tls_ca = None, tls_cert = None, tls_key = None, server_name = "localhost"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        address: &str,
        geometry: &crate::Geometry,
        rank: u32,
        shared_memory: bool,
        timeout_ms: u64,
        tls_ca: Option<PathBuf>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        server_name: &str,
    ) -> PyResult<Self> {
        let at = parse_addr(address)?;
        let limit = Duration::from_millis(timeout_ms);
        let fp = geometry.inner.fingerprint();
        let tls = tls_client(tls_ca, tls_cert, tls_key, server_name)?;
        let mut c = block_on(py, limit, ProducerClient::connect_with(at, tls.as_ref(), fp, rank))?
            .map_err(|e| transport(e, TransportError::new_err))?;
        if shared_memory {
            c.use_shared_memory().map_err(|e| TransportError::new_err(e.to_string()))?;
        }
        Ok(Self { inner: Mutex::new(Some(c)), timeout: limit })
    }

    /// Whether chunks go through the rank's shared-memory export.
    #[getter]
    fn shared_memory(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|c| c.is_shared_memory())
    }

    /// Bytes of one page on the rank (every chunk written is exactly this long).
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).as_ref().map_or(0, |c| c.welcome.page_bytes)
    }

    /// Writes chunk `chunk` of the request into `(page, generation)` and waits for the rank's ack;
    /// `True` when the rank already had it (a retry). A stale generation, another request's page or
    /// an ended request is refused (`WriteError`) with nothing changed.
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
        let k = key(request_id, epoch);
        let addr = PageAddr { page, generation };
        call(py, &self.inner, self.timeout, WriteError::new_err, move |mut c| async move {
            let r = c.write_chunk(k, chunk, addr, data).await;
            (c, r)
        })
    }

    /// Writes every chunk of `chunks` (`[(chunk, page, generation, data)]`) without waiting for the
    /// rank between them (at most 16 unanswered), then reads every answer; with `fence=True` the
    /// request is fenced in the same round trip, after its chunks. One round trip for a request's
    /// chunks where `write_chunk` takes one each. Returns how many the rank already had (retries).
    /// A refusal of any chunk is a `WriteError` and closes the connection (its answers are then
    /// out of step); any chunk but the refused one may be in. The connection's `timeout_ms`
    /// applies per chunk, as for `write_chunk`. Through shared memory each chunk still waits.
    ///
    /// `reserve=(chunks, lease_ms)`: this prefiller reserves the request's pages itself (the
    /// gateway's `reserve = "prefiller"`, the contract's `baton.reserve`), the Reserve leaving
    /// with the chunks, whose `page` and `generation` are then `None` (each written to the page
    /// the reservation holds for it). A rank without room is a `ReserveError` (answer the request
    /// with HTTP 507), a key the gateway already cancelled a `WriteError`.
    #[pyo3(signature = (request_id, chunks, *, epoch = 0, fence = false, reserve = None))]
    fn write_chunks(
        &self,
        py: Python<'_>,
        request_id: u128,
        chunks: Vec<ChunkToWrite>,
        epoch: u32,
        fence: bool,
        reserve: Option<(u32, u64)>,
    ) -> PyResult<u32> {
        let k = key(request_id, epoch);
        // A page named, or none: only with a reservation of its own.
        let addr = |page: Option<u32>, generation: Option<u32>| match (page, generation, reserve) {
            (Some(page), Some(generation), None) => Ok(PageAddr { page, generation }),
            (None, None, Some(_)) => Ok(PageAddr::BY_CHUNK),
            _ => Err(PyValueError::new_err(
                "each chunk names its page and generation, or (with reserve=) neither",
            )),
        };
        let pages = chunks
            .iter()
            .map(|(chunk, page, generation, _)| addr(*page, *generation).map(|a| (*chunk, a)))
            .collect::<PyResult<Vec<_>>>()?;
        let limit = self.timeout.saturating_mul(u32::try_from(chunks.len().max(1)).unwrap_or(u32::MAX));
        call_keeping(py, &self.inner, limit, WriteError::new_err, false, move |mut c| async move {
            if let Some((n, lease_ms)) = reserve {
                c.queue_reserve(k, n, Duration::from_millis(lease_ms));
            }
            // Small chunks share writes, the fence with them.
            let pages: Vec<(u32, PageAddr, &[u8])> = pages
                .iter()
                .zip(&chunks)
                .map(|(&(chunk, a), (.., data))| (chunk, a, data.as_slice()))
                .collect();
            let r = c.write_chunks(k, &pages, fence).await;
            drop(pages);
            (c, r)
        })
    }

    /// Nothing more will be written for the request: pages its cancel quarantined come back now.
    #[pyo3(signature = (request_id, *, epoch = 0))]
    fn fence(&self, py: Python<'_>, request_id: u128, epoch: u32) -> PyResult<()> {
        let k = key(request_id, epoch);
        call(py, &self.inner, self.timeout, TransportError::new_err, move |mut c| async move {
            let r = c.fence(k).await;
            (c, r)
        })
    }
}

/// The gateway's side of a decoder rank: reserve, renew, cancel. An engine does not use it; tests and
/// tools that play the gateway do.
#[pyclass(module = "baton_dataplane", frozen)]
pub(crate) struct Control {
    pub(crate) inner: Mutex<Option<ControlClient>>,
    timeout: Duration,
}

#[pymethods]
impl Control {
    /// TLS as [`Producer`]'s: `tls_ca` (and `server_name`), with `tls_cert` and `tls_key` for mTLS.
    #[new]
    #[pyo3(signature = (
        address, geometry, *, rank = 0, timeout_ms = 10_000,
        tls_ca = None, tls_cert = None, tls_key = None, server_name = "localhost"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        address: &str,
        geometry: &crate::Geometry,
        rank: u32,
        timeout_ms: u64,
        tls_ca: Option<PathBuf>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        server_name: &str,
    ) -> PyResult<Self> {
        let at = parse_addr(address)?;
        let limit = Duration::from_millis(timeout_ms);
        let tls = tls_client(tls_ca, tls_cert, tls_key, server_name)?;
        let c = block_on(
            py,
            limit,
            ControlClient::connect_with(at, tls.as_ref(), geometry.inner.fingerprint(), rank),
        )?
        .map_err(|e| transport(e, TransportError::new_err))?;
        Ok(Self { inner: Mutex::new(Some(c)), timeout: limit })
    }

    /// Reserves `chunks` pages for the request, all or nothing, for `lease_ms`: the write
    /// addresses `[(chunk, page, generation)]`. No room: `ReserveError`.
    #[pyo3(signature = (request_id, chunks, lease_ms, *, epoch = 0))]
    fn reserve(
        &self,
        py: Python<'_>,
        request_id: u128,
        chunks: u32,
        lease_ms: u64,
        epoch: u32,
    ) -> PyResult<Vec<(u32, u32, u32)>> {
        let k: RequestKey = key(request_id, epoch);
        let lease = Duration::from_millis(lease_ms);
        let addrs = call(py, &self.inner, self.timeout, ReserveError::new_err, move |mut c| async move {
            let r = c.reserve(k, chunks, lease, &[]).await;
            (c, r)
        })?;
        Ok(addrs.into_iter().map(|(c, a)| (c, a.page, a.generation)).collect())
    }

    /// Cancels the request's reservation (idempotent). Its pages stay quarantined until the
    /// producer fences or the quarantine passes, unless `unsent`: the write addresses were never
    /// given to any producer, so they come back at once.
    #[pyo3(signature = (request_id, *, epoch = 0, unsent = false))]
    fn cancel(&self, py: Python<'_>, request_id: u128, epoch: u32, unsent: bool) -> PyResult<()> {
        let k = key(request_id, epoch);
        if unsent {
            return call(py, &self.inner, self.timeout, TransportError::new_err, move |mut c| async move {
                let r = c.cancel_unsent(k).await;
                (c, r)
            });
        }
        call(py, &self.inner, self.timeout, TransportError::new_err, move |mut c| async move {
            let r = c.cancel(k).await;
            (c, r)
        })
    }
}
