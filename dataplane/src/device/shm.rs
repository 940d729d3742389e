//! A PD buffer in a shared-memory file (tmpfs, `/dev/shm` by default), so producers on the same
//! host write pages with one kernel copy (`pwrite` into the file) instead of through a socket: the
//! CPU counterpart of exporting GPU memory with CUDA IPC.
//!
//! The rank's side uses positional file I/O (safe Rust). A producer maps the export and copies each
//! page straight into it ([`ShmWriter`], the one `unsafe` copy). The file is created `0600` with a
//! unique name, sized to the buffer, and removed when the buffer is dropped. Who may write which page is
//! still decided by the page table: a producer gets a grant (generation-checked) before it writes
//! and commits after, exactly as over TCP.
//!
//! A process killed outright (SIGKILL, a crash) cannot remove its file, and tmpfs would keep the
//! memory. So the owner holds a shared `flock` on its file for as long as the buffer lives (taken
//! before the file appears under its name), and every new buffer first removes the files in the
//! directory whose exclusive lock can be taken: those no live process owns. The lock is on the file,
//! so this holds across processes and PID namespaces alike. The file's permissions are the trust boundary, as a CUDA
//! IPC handle's is: a process that can open the file can write any page, so only run producers you
//! trust as the same user on the same host.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::cpu::{CpuDevice, CpuEvent, CpuTensor};
use super::{Device, DeviceError, KvSpan};
use crate::geometry::ChunkLayout;

static NEXT: AtomicU64 = AtomicU64::new(0);

/// Every buffer file's name starts with it.
const PREFIX: &str = "baton-pd-";

/// Removes the buffer files in `dir` that no live process owns (their owner's shared lock is gone,
/// so an exclusive one can be taken). Best effort: a file it cannot open or lock is left.
fn sweep(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if !entry.file_name().to_str().is_some_and(|n| n.starts_with(PREFIX)) {
            continue;
        }
        let path = entry.path();
        if let Ok(f) = File::open(&path)
            && f.try_lock().is_ok()
        {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Host memory shared through a tmpfs file.
#[derive(Debug, Clone)]
pub struct ShmDevice {
    dir: PathBuf,
}

impl ShmDevice {
    /// Buffers are created in `dir` (a tmpfs, or the bytes go to disk).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// `/dev/shm` when present, else the temp directory.
    pub fn default_dir() -> PathBuf {
        let shm = Path::new("/dev/shm");
        if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() }
    }
}

impl Default for ShmDevice {
    fn default() -> Self {
        Self::new(Self::default_dir())
    }
}

/// A PD buffer backed by a shared file, removed on drop.
#[derive(Debug)]
pub struct ShmBuffer {
    file: File,
    path: PathBuf,
    pages: u32,
    page_bytes: usize,
}

impl Drop for ShmBuffer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl ShmBuffer {
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn at(&self, page: u32, offset: usize, len: usize) -> Result<u64, DeviceError> {
        if page >= self.pages {
            return Err(DeviceError::NoSuchPage { page, pages: self.pages });
        }
        if offset.checked_add(len).is_none_or(|end| end > self.page_bytes) {
            return Err(DeviceError::OutOfBounds { offset, len, size: self.page_bytes });
        }
        Ok(page as u64 * self.page_bytes as u64 + offset as u64)
    }
}

fn io(e: std::io::Error) -> DeviceError {
    DeviceError::Backend(e.to_string())
}

impl Device for ShmDevice {
    type Buffer = ShmBuffer;
    type Tensor = CpuTensor;
    type Event = CpuEvent;

    fn name(&self) -> &'static str {
        "shm"
    }

    fn alloc_buffer(&self, pages: u32, page_bytes: usize) -> Result<ShmBuffer, DeviceError> {
        sweep(&self.dir);
        let bytes = pages as u64 * page_bytes as u64;
        let name = format!("{PREFIX}{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let path = self.dir.join(&name);
        // Created and locked under a name the sweep ignores, then renamed: a file under its real
        // name always has its owner's lock.
        let staging = self.dir.join(format!(".{name}.new"));
        let alloc = |e: std::io::Error| DeviceError::Alloc {
            bytes: usize::try_from(bytes).unwrap_or(usize::MAX),
            reason: format!("{}: {e}", path.display()),
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&staging)
            .map_err(alloc)?;
        let ready = file
            .lock_shared()
            .and_then(|()| file.set_len(bytes))
            .and_then(|()| std::fs::rename(&staging, &path));
        if let Err(e) = ready {
            let _ = std::fs::remove_file(&staging);
            return Err(alloc(e));
        }
        Ok(ShmBuffer { file, path, pages, page_bytes })
    }

    fn alloc_tensor(&self, bytes: usize) -> Result<CpuTensor, DeviceError> {
        CpuDevice.alloc_tensor(bytes)
    }

    fn write_page(&self, buf: &ShmBuffer, page: u32, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        let at = buf.at(page, offset, src.len())?;
        buf.file.write_all_at(src, at).map_err(io)
    }

    fn read_page(
        &self,
        buf: &ShmBuffer,
        page: u32,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        let at = buf.at(page, offset, dst.len())?;
        buf.file.read_exact_at(dst, at).map_err(io)
    }

    fn write_tensor(&self, t: &CpuTensor, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        CpuDevice.write_tensor(t, offset, src)
    }

    fn read_tensor(&self, t: &CpuTensor, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        CpuDevice.read_tensor(t, offset, dst)
    }

    fn gather(
        &self,
        cache: &[CpuTensor],
        span: &KvSpan<'_>,
        chunk: &ChunkLayout,
        dst: &ShmBuffer,
        page: u32,
    ) -> Result<(), DeviceError> {
        let staging = CpuDevice.alloc_buffer(1, chunk.page_bytes())?;
        CpuDevice.gather(cache, span, chunk, &staging, 0)?;
        let mut bytes = vec![0u8; chunk.page_bytes()];
        CpuDevice.read_page(&staging, 0, 0, &mut bytes)?;
        self.write_page(dst, page, 0, &bytes)
    }

    fn scatter(
        &self,
        src: &ShmBuffer,
        page: u32,
        chunk: &ChunkLayout,
        cache: &[CpuTensor],
        span: &KvSpan<'_>,
    ) -> Result<(), DeviceError> {
        let mut bytes = vec![0u8; chunk.page_bytes()];
        self.read_page(src, page, 0, &mut bytes)?;
        let staging = CpuDevice.alloc_buffer(1, chunk.page_bytes())?;
        CpuDevice.write_page(&staging, 0, 0, &bytes)?;
        CpuDevice.scatter(&staging, 0, chunk, cache, span)
    }

    fn record_event(&self) -> Result<CpuEvent, DeviceError> {
        Ok(CpuEvent)
    }

    fn wait_event(&self, _event: &CpuEvent) -> Result<(), DeviceError> {
        Ok(())
    }

    fn export(&self, buf: &ShmBuffer) -> Option<String> {
        Some(buf.path.display().to_string())
    }
}

/// A producer's mapping of a rank's export: one memcpy per page into the rank's buffer.
#[derive(Debug)]
pub struct ShmWriter {
    map: memmap2::MmapRaw,
}

impl ShmWriter {
    /// Maps the export at `path` (same host, same user) for writing.
    pub fn open(path: &str) -> Result<Self, DeviceError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| DeviceError::Backend(format!("{path}: {e}")))?;
        let map =
            memmap2::MmapRaw::map_raw(&file).map_err(|e| DeviceError::Backend(format!("map {path}: {e}")))?;
        Ok(Self { map })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Copies `src` to `offset` of the export.
    #[allow(unsafe_code)]
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), DeviceError> {
        let size = self.map.len();
        let start = usize::try_from(offset).map_err(|_| DeviceError::OutOfBounds {
            offset: usize::MAX,
            len: src.len(),
            size,
        })?;
        if start.checked_add(src.len()).is_none_or(|end| end > size) {
            return Err(DeviceError::OutOfBounds { offset: start, len: src.len(), size });
        }
        // SAFETY: `start..start + src.len()` lies inside the mapping (checked above), which lives as
        // long as `self`. No Rust reference into the mapping is ever formed, so another process
        // writing the same bytes (which the grant protocol forbids) can only leave garbage in that
        // page, never break this process's memory safety. `src` is ordinary process memory and
        // cannot overlap a fresh shared mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(start), src.len());
        }
        Ok(())
    }
}
