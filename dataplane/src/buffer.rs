//! One rank's PD buffer: device memory plus the page table, driven through owned guards.
//!
//! Every limited resource is a guard released in `Drop`, so no path can forget or repeat a release:
//!
//! | guard | holds | dropping it |
//! |---|---|---|
//! | [`Reservation`] | the request's pages while chunks arrive | cancels: terminal CANCELLED, pages back (quarantined if a producer may still write) |
//! | [`Ready`] | every chunk in the buffer | pages back, "released (dropped)" |
//! | [`Consuming`] | pages the decoder is moving out | pages back, "released (consumed)" |
//! | [`PageWriter`] | one page being written | write aborted; the page can be written again |
//! | [`SharedChunk`] | one counted share of a filled chunk | share returned |
//!
//! None is `Clone` or `Copy`; transitions take `self`, so a reservation that is not ready has no
//! method that consumes it as ready. Queries (`stats`, `has_prefix`, `is_ready`) take `&self` and never
//! change a count.
//!
//! Events are collected under the lock and handed to the [`EventSink`] after it is released.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::device::{Device, DeviceError, KvSpan};
use crate::events::EventSink;
use crate::geometry::{ChunkLayout, KvGeometry};
use crate::ids::{PageAddr, PrefixKey, Rank, RequestKey};
use crate::table::{
    Begin, Counts, Events, Handle, InvariantError, LeaseError, Limits, Reserve, ReserveError, Table,
    WriteError,
};

/// How long cancelled pages stay quarantined when the producer never fences: long enough for any
/// write already on the wire to land, short enough that a dead producer costs little capacity.
pub const DEFAULT_QUARANTINE_TTL: Duration = Duration::from_secs(5);

/// Most requests one rank tracks at once (reservations, including zero-page ones, and quarantines):
/// bounds the table's memory whatever callers do.
pub const DEFAULT_MAX_REQUESTS: usize = 65_536;

/// Options of one rank's buffer.
#[derive(Clone, Copy, Debug)]
pub struct BufferOptions {
    /// Quarantine deadline for cancelled pages (default [`DEFAULT_QUARANTINE_TTL`]).
    pub quarantine_ttl: Duration,
    /// Most requests tracked at once (default [`DEFAULT_MAX_REQUESTS`]).
    pub max_requests: usize,
}

impl Default for BufferOptions {
    fn default() -> Self {
        Self { quarantine_ttl: DEFAULT_QUARANTINE_TTL, max_requests: DEFAULT_MAX_REQUESTS }
    }
}

/// A snapshot of a rank's accounting.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct BufferStats {
    pub rank: Rank,
    pub total: u32,
    pub pages: Counts,
    /// Requests tracked (reserved, ready, consuming or quarantined).
    pub requests: usize,
    /// Live [`SharedChunk`] handles.
    pub shared_handles: u64,
    /// Counter underflows or impossible transitions seen; always 0 unless there is a bug.
    pub accounting_errors: u64,
}

struct BufferCore<D: Device> {
    table: Mutex<Table>,
    device: Arc<D>,
    memory: D::Buffer,
    sink: Arc<dyn EventSink>,
    clock: Arc<dyn Clock>,
    geometry: KvGeometry,
    rank: Rank,
    page_bytes: usize,
}

impl<D: Device> BufferCore<D> {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the lock cannot leave the table half-updated in a way later calls
        // would trust blindly: `check` would report it. Keep serving.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn emit(&self, events: Events) {
        for e in events {
            self.sink.emit(e);
        }
    }

    /// Runs `f` under the lock, then delivers the events it produced.
    fn with<R>(&self, f: impl FnOnce(&mut Table, Instant, &mut Events) -> R) -> R {
        let mut events = Events::new();
        let now = self.clock.now();
        let r = {
            let mut t = self.lock();
            f(&mut t, now, &mut events)
        };
        self.emit(events);
        r
    }
}

/// One rank's PD buffer. Cheap to clone (a handle); the guards it hands out are not.
pub struct RankBuffer<D: Device> {
    shared: Arc<BufferCore<D>>,
}

impl<D: Device> Clone for RankBuffer<D> {
    fn clone(&self) -> Self {
        Self { shared: Arc::clone(&self.shared) }
    }
}

impl<D: Device> fmt::Debug for RankBuffer<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RankBuffer").field("rank", &self.shared.rank).field("stats", &self.stats()).finish()
    }
}

/// What a reservation asks for.
#[derive(Clone, Copy, Debug)]
pub struct ReserveRequest<'a> {
    pub key: RequestKey,
    /// Chunks (pages) the request needs: `ceil(prompt_tokens / chunk_tokens)`.
    pub chunks: u32,
    /// Prefix keys of the leading chunks; a chunk whose key names a filled page is shared, not
    /// reserved. May be shorter than `chunks` or empty.
    pub prefixes: &'a [PrefixKey],
    /// The lease deadline: not ready by then means expired, pages back.
    pub lease: Instant,
}

/// Result of a chunk write.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WriteOutcome {
    /// The chunk was stored; `ready` is true when it was the request's last one.
    Stored { ready: bool },
    /// The chunk was already there; nothing changed.
    Duplicate,
}

impl<D: Device> RankBuffer<D> {
    /// Allocates a buffer of `pages` pages sized by `geometry` on `device`.
    pub fn new(
        device: Arc<D>,
        geometry: KvGeometry,
        rank: Rank,
        pages: u32,
        options: BufferOptions,
        clock: Arc<dyn Clock>,
        sink: Arc<dyn EventSink>,
    ) -> Result<Self, DeviceError> {
        let page_bytes = usize::try_from(geometry.page_bytes_per_rank()).map_err(|_| DeviceError::Alloc {
            bytes: usize::MAX,
            reason: "page larger than memory".into(),
        })?;
        let memory = device.alloc_buffer(pages, page_bytes)?;
        let limits = Limits { quarantine_ttl: options.quarantine_ttl, max_requests: options.max_requests };
        let table = Mutex::new(Table::new(rank, pages, page_bytes as u64, limits));
        let shared = BufferCore { table, device, memory, sink, clock, geometry, rank, page_bytes };
        Ok(Self { shared: Arc::new(shared) })
    }

    pub fn rank(&self) -> Rank {
        self.shared.rank
    }

    pub fn geometry(&self) -> KvGeometry {
        self.shared.geometry
    }

    pub fn page_bytes(&self) -> usize {
        self.shared.page_bytes
    }

    pub fn chunk_layout(&self) -> ChunkLayout {
        self.shared.geometry.chunk_layout()
    }

    pub fn device(&self) -> &Arc<D> {
        &self.shared.device
    }

    /// Where same-host producers can write pages directly (see [`Device::export`]), if anywhere.
    pub fn export(&self) -> Option<String> {
        self.shared.device.export(&self.shared.memory)
    }

    /// The buffer's clock reading, for computing lease deadlines.
    pub fn now(&self) -> Instant {
        self.shared.clock.now()
    }

    /// Reserves every page the request needs, or none. Never blocks.
    pub fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation<D>, ReserveError> {
        let r = Reserve { key: req.key, chunks: req.chunks, prefixes: req.prefixes, lease: req.lease };
        let h = self.shared.with(|t, now, out| t.reserve(&r, now, out))?;
        Ok(Reservation {
            core: Core { shared: Arc::clone(&self.shared), h, key: req.key, chunks: req.chunks },
        })
    }

    /// Starts writing one chunk at `addr`. Refused, with nothing changed, for a stale generation, a
    /// page of another request, a closed request or a page already being written. A chunk already
    /// present is reported as a duplicate (idempotent). [`PageAddr::BY_CHUNK`] writes to the page
    /// the request's reservation holds for `chunk` ([`PageWriter::addr`] says which).
    pub fn begin_write(
        &self,
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
    ) -> Result<BeginWrite<D>, WriteError> {
        let (begin, addr) = self.shared.with(|t, now, out| {
            let addr = t.resolve(key, chunk, addr)?;
            t.begin_write(key, chunk, addr, now, out).map(|b| (b, addr))
        })?;
        match begin {
            Begin::Duplicate => Ok(BeginWrite::Duplicate),
            Begin::Write => Ok(BeginWrite::Write(PageWriter {
                shared: Arc::clone(&self.shared),
                key,
                addr,
                written: 0,
                done: false,
            })),
        }
    }

    /// Writes a whole chunk page at once (`bytes.len()` must equal the page size).
    pub fn write_chunk(
        &self,
        key: RequestKey,
        chunk: u32,
        addr: PageAddr,
        bytes: &[u8],
    ) -> Result<WriteOutcome, WriteError> {
        if bytes.len() != self.shared.page_bytes {
            return Err(WriteError::Overrun {
                offset: 0,
                len: bytes.len(),
                page_bytes: self.shared.page_bytes,
            });
        }
        match self.begin_write(key, chunk, addr)? {
            BeginWrite::Duplicate => Ok(WriteOutcome::Duplicate),
            BeginWrite::Write(mut w) => {
                w.write(bytes)?;
                w.commit()
            }
        }
    }

    /// The producer will write nothing more for `key`: its quarantined pages come back now instead of
    /// at the quarantine deadline. Returns whether the request was known.
    pub fn fence(&self, key: RequestKey) -> bool {
        self.shared.with(|t, _, out| t.fence(key, out))
    }

    /// Whether a filled chunk with this prefix key is present. A query: it pins nothing.
    pub fn has_prefix(&self, key: PrefixKey) -> bool {
        self.shared.lock().has_prefix(key)
    }

    /// Takes a counted share of a filled chunk, released when the handle drops.
    pub fn share_prefix(&self, key: PrefixKey) -> Option<SharedChunk<D>> {
        let page = self.shared.lock().share_external(key)?;
        Some(SharedChunk { shared: Arc::clone(&self.shared), page })
    }

    /// Expires every lease and quarantine whose deadline has passed, earliest first, and returns how
    /// many fired. Call it from a timer at [`RankBuffer::next_deadline`].
    pub fn reap(&self) -> usize {
        self.shared.with(|t, now, out| t.reap(now, out))
    }

    /// The earliest pending lease or quarantine deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.shared.lock().next_deadline()
    }

    /// The accounting, as a snapshot. A query.
    pub fn stats(&self) -> BufferStats {
        let t = self.shared.lock();
        BufferStats {
            rank: self.shared.rank,
            total: t.total(),
            pages: t.counts(),
            requests: t.requests(),
            shared_handles: t.external_shares(),
            accounting_errors: t.accounting_errors(),
        }
    }

    /// Checks every invariant of the page table (balanced counts, one owner per page, shares
    /// accounted). A query; for tests and debug endpoints.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        self.shared.lock().check()
    }
}

/// The state shared by the three lifecycle guards; its `Drop` is the one release path.
struct Core<D: Device> {
    shared: Arc<BufferCore<D>>,
    h: Handle,
    key: RequestKey,
    chunks: u32,
}

impl<D: Device> Drop for Core<D> {
    fn drop(&mut self) {
        let h = self.h;
        self.shared.with(|t, now, out| t.drop_guard(h, now, out));
    }
}

impl<D: Device> Core<D> {
    fn page_of(&self, chunk: u32) -> Result<u32, DeviceError> {
        self.shared
            .lock()
            .chunk_page(self.h, chunk)
            .ok_or(DeviceError::NoSuchPage { page: chunk, pages: self.chunks })
    }
}

impl<D: Device> fmt::Debug for Core<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("key", &self.key)
            .field("rank", &self.shared.rank)
            .field("chunks", &self.chunks)
            .finish()
    }
}

/// A request's pages on one rank while its chunks arrive. Dropping it cancels the request.
#[derive(Debug)]
pub struct Reservation<D: Device> {
    core: Core<D>,
}

/// Why [`Reservation::try_ready`] did not give a [`Ready`].
#[derive(Debug)]
pub enum NotReady<D: Device> {
    /// Chunks are still missing; here is the reservation back.
    Pending(Reservation<D>),
    /// The request ended (expired or cancelled); its pages are already handled.
    Closed(LeaseError),
}

impl<D: Device> Reservation<D> {
    pub fn key(&self) -> RequestKey {
        self.core.key
    }

    /// Chunks of the request (owned and shared).
    pub fn chunks(&self) -> u32 {
        self.core.chunks
    }

    /// The write addresses of the chunks this rank must receive, as `(chunk index, address)`. Shared
    /// chunks are not listed: they are already here. From now on a cancel quarantines unfilled pages
    /// until the producer fences.
    pub fn publish(&mut self) -> Vec<(u32, PageAddr)> {
        let h = self.core.h;
        self.core.shared.lock().publish(h)
    }

    /// Moves the lease deadline. Fails if it has already passed (the request is expired then).
    pub fn renew(&self, lease: Instant) -> Result<(), LeaseError> {
        let h = self.core.h;
        self.core.shared.with(|t, now, out| t.renew(h, lease, now, out))
    }

    /// Whether every chunk has arrived. A query.
    pub fn is_ready(&self) -> Result<bool, LeaseError> {
        self.core.shared.lock().phase_ready(self.core.h)
    }

    /// The ready state, once every chunk has arrived.
    pub fn try_ready(self) -> Result<Ready<D>, NotReady<D>> {
        match self.is_ready() {
            Ok(true) => Ok(Ready { core: self.core }),
            Ok(false) => Err(NotReady::Pending(self)),
            Err(e) => Err(NotReady::Closed(e)),
        }
    }

    /// Cancels the request: the same as dropping it, spelled out.
    pub fn cancel(self) {}
}

/// Every chunk of the request is in this rank's buffer. Dropping it frees the pages unconsumed.
#[derive(Debug)]
pub struct Ready<D: Device> {
    core: Core<D>,
}

impl<D: Device> Ready<D> {
    pub fn key(&self) -> RequestKey {
        self.core.key
    }

    /// Chunks of the request (owned and shared).
    pub fn chunks(&self) -> u32 {
        self.core.chunks
    }

    /// Starts consuming: the decoder moves the pages into its engine's cache. Fails if the lease
    /// passed while the request waited.
    pub fn consume(self) -> Result<Consuming<D>, LeaseError> {
        let h = self.core.h;
        self.core.shared.with(|t, now, out| t.consume(h, now, out))?;
        Ok(Consuming { core: self.core })
    }
}

/// The decoder is moving the request's pages out. Dropping it (after the last scatter) frees them:
/// slots are held until this point, never released when the KV merely arrived.
#[derive(Debug)]
pub struct Consuming<D: Device> {
    core: Core<D>,
}

impl<D: Device> Consuming<D> {
    pub fn key(&self) -> RequestKey {
        self.core.key
    }

    pub fn chunks(&self) -> u32 {
        self.core.chunks
    }

    /// Copies a chunk's page to the host.
    pub fn read_chunk(&self, chunk: u32, dst: &mut [u8]) -> Result<(), DeviceError> {
        let page = self.core.page_of(chunk)?;
        self.core.shared.device.read_page(&self.core.shared.memory, page, 0, dst)
    }

    /// Scatters a chunk into the engine's paged cache (one tensor per layer).
    pub fn scatter_chunk(
        &self,
        chunk: u32,
        cache: &[D::Tensor],
        span: &KvSpan<'_>,
    ) -> Result<(), DeviceError> {
        let page = self.core.page_of(chunk)?;
        let s = &self.core.shared;
        s.device.scatter(&s.memory, page, &s.geometry.chunk_layout(), cache, span)
    }

    /// Done: the pages go back (the same as dropping it, spelled out).
    pub fn finish(self) {}
}

/// The start of a chunk write.
#[derive(Debug)]
pub enum BeginWrite<D: Device> {
    Write(PageWriter<D>),
    /// The chunk is already in the buffer; nothing to do.
    Duplicate,
}

/// One page being written. Bytes go in order; `commit` needs the whole page. Dropping it uncommitted
/// aborts the write and the page can be written again.
pub struct PageWriter<D: Device> {
    shared: Arc<BufferCore<D>>,
    key: RequestKey,
    addr: PageAddr,
    written: usize,
    done: bool,
}

impl<D: Device> fmt::Debug for PageWriter<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageWriter")
            .field("key", &self.key)
            .field("addr", &self.addr)
            .field("written", &self.written)
            .finish()
    }
}

impl<D: Device> PageWriter<D> {
    /// The page written (resolved when the write named [`PageAddr::BY_CHUNK`]).
    pub fn addr(&self) -> PageAddr {
        self.addr
    }

    /// Appends bytes to the page.
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), WriteError> {
        let page_bytes = self.shared.page_bytes;
        if self.written.checked_add(bytes.len()).is_none_or(|end| end > page_bytes) {
            return Err(WriteError::Overrun { offset: self.written, len: bytes.len(), page_bytes });
        }
        let s = &self.shared;
        s.device
            .write_page(&s.memory, self.addr.page, self.written, bytes)
            .map_err(|e| WriteError::Device(e.to_string()))?;
        self.written += bytes.len();
        Ok(())
    }

    pub fn written(&self) -> usize {
        self.written
    }

    /// Declares the whole page written by a peer through the buffer's export (shared memory, IPC)
    /// rather than through [`PageWriter::write`]. Ownership and generation were checked when this
    /// writer was granted and are checked again at commit; the bytes themselves cannot be.
    pub fn written_externally(&mut self) {
        self.written = self.shared.page_bytes;
    }

    /// Marks the chunk arrived. READY is emitted here when it was the last one.
    pub fn commit(mut self) -> Result<WriteOutcome, WriteError> {
        if self.written != self.shared.page_bytes {
            return Err(WriteError::Incomplete { written: self.written, page_bytes: self.shared.page_bytes });
        }
        self.done = true;
        let (key, addr) = (self.key, self.addr);
        let ready = self.shared.with(|t, _, out| t.end_write(key, addr, true, out))?;
        Ok(WriteOutcome::Stored { ready })
    }
}

impl<D: Device> Drop for PageWriter<D> {
    fn drop(&mut self) {
        if !self.done {
            let (key, addr) = (self.key, self.addr);
            // An aborted write of a cancelled request is not an error worth reporting here.
            let _ = self.shared.with(|t, _, out| t.end_write(key, addr, false, out));
        }
    }
}

/// A counted share of a filled chunk (a shared prefix). The page stays readable and cannot be freed
/// while any share is alive; dropping the handle returns the share, exactly once.
pub struct SharedChunk<D: Device> {
    shared: Arc<BufferCore<D>>,
    page: u32,
}

impl<D: Device> fmt::Debug for SharedChunk<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedChunk").field("page", &self.page).finish()
    }
}

impl<D: Device> SharedChunk<D> {
    pub fn page(&self) -> u32 {
        self.page
    }

    pub fn read(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.shared.device.read_page(&self.shared.memory, self.page, 0, dst)
    }
}

impl<D: Device> Drop for SharedChunk<D> {
    fn drop(&mut self) {
        let page = self.page;
        self.shared.with(|t, _, _| t.unshare_external(page));
    }
}
