//! Idle connections: an IO wrapper that stamps every read and write, so the connection task can
//! close a connection that has had no traffic and no request in flight for
//! [`super::DEFAULT_IDLE_TIMEOUT`] (hyper's header read timeout does not cover the wait between
//! keep-alive requests in every version, and HTTP/2 has none).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Activity of one connection, shared by its IO and its service.
#[derive(Debug)]
pub struct Activity {
    epoch: Instant,
    last_ms: AtomicU64,
    in_flight: AtomicU32,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Self { epoch: Instant::now(), last_ms: AtomicU64::new(0), in_flight: AtomicU32::new(0) })
    }

    fn touch(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// No request in flight and no byte in either direction for `limit`.
    pub fn idle_for(&self, limit: Duration) -> bool {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        let quiet = now.saturating_sub(self.last_ms.load(Ordering::Relaxed));
        self.in_flight.load(Ordering::Relaxed) == 0 && u128::from(quiet) >= limit.as_millis()
    }

    /// Counts a request in flight until the guard drops.
    pub fn request(self: &Arc<Self>) -> RequestGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        RequestGuard(Arc::clone(self))
    }
}

#[derive(Debug)]
pub struct RequestGuard(Arc<Activity>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// IO that stamps its [`Activity`] on every byte moved.
#[derive(Debug)]
pub struct Stamped<I> {
    inner: I,
    activity: Arc<Activity>,
}

impl<I> Stamped<I> {
    pub fn new(inner: I, activity: Arc<Activity>) -> Self {
        activity.touch();
        Self { inner, activity }
    }
}

impl<I: hyper::rt::Read + Unpin> hyper::rt::Read for Stamped<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if r.is_ready() {
            self.activity.touch();
        }
        r
    }
}

impl<I: hyper::rt::Write + Unpin> hyper::rt::Write for Stamped<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if r.is_ready() {
            self.activity.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if r.is_ready() {
            self.activity.touch();
        }
        r
    }
}
