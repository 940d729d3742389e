//! The threads that tokenize large prompts, bounded: at most one job per core runs on the blocking
//! pool, at most `max_waiting` more wait for a thread, and beyond that a request is refused at
//! once (503 `tokenizer_busy`, `Retry-After: 1`). A burst of huge prompts then costs the gateway
//! its tokenizer threads at most, never its request threads, and never an unbounded queue of work
//! that would answer long after the clients gave up. Small prompts do not come here: they are
//! tokenized inline ([`super::INLINE_TOKENIZE_BYTES`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::sync::Semaphore;

use crate::api::{GatewayError, Internal};
use crate::telemetry::Scrape;

/// Jobs that may wait for a tokenizer thread, per thread.
pub const WAITING_PER_THREAD: usize = 4;

/// Bounded tokenizer threads.
#[derive(Debug)]
pub struct Pool {
    permits: Arc<Semaphore>,
    threads: usize,
    max_waiting: usize,
    waiting: AtomicUsize,
    refused: AtomicU64,
}

/// Counts a job out of the waiting line however its wait ends (granted, or the client gone).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Pool {
    /// `threads` jobs at once (at least one), `max_waiting` more queued.
    pub fn new(threads: usize, max_waiting: usize) -> Self {
        let threads = threads.max(1);
        Self {
            permits: Arc::new(Semaphore::new(threads)),
            threads,
            max_waiting,
            waiting: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// One thread per core, [`WAITING_PER_THREAD`] waiting per thread.
    pub fn per_core() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        Self::new(cores, cores * WAITING_PER_THREAD)
    }

    /// Runs `job` on a tokenizer thread, or refuses it when the line is full.
    pub async fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, GatewayError> {
        let permit = match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // A place in the line, taken only when there is one (a refused request never
                // counts itself, so it cannot make another's refusal spurious).
                let max = self.max_waiting;
                let placed = self
                    .waiting
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < max).then_some(n + 1));
                if placed.is_err() {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(GatewayError::TokenizerBusy { limit: self.threads + self.max_waiting });
                }
                let _line = Waiting(&self.waiting);
                Arc::clone(&self.permits)
                    .acquire_owned()
                    .await
                    .map_err(|_| GatewayError::Internal(Internal::TaskLost { task: "tokenizer" }))?
            }
        };
        // The permit goes with the job: a client that leaves does not free the thread its prompt
        // still occupies.
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            job()
        })
        .await
        .map_err(|_| GatewayError::Internal(Internal::TaskLost { task: "tokenizer" }))
    }

    /// The pool's gauges and refusals, for `/metrics`.
    pub fn scrape(&self, s: &mut Scrape) {
        let running = self.threads - self.permits.available_permits();
        s.gauge(
            "baton_tokenize_pool_running",
            "Large prompts being tokenized now (at most one per core).",
            &[],
            running as f64,
        );
        s.gauge(
            "baton_tokenize_pool_waiting",
            "Large prompts waiting for a tokenizer thread.",
            &[],
            self.waiting.load(Ordering::Relaxed) as f64,
        );
        s.counter(
            "baton_tokenize_pool_refused_total",
            "Requests refused 503 tokenizer_busy: every tokenizer thread busy and the waiting line full.",
            &[],
            self.refused.load(Ordering::Relaxed) as f64,
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    /// One thread, one waiting: a third job is refused at once, and the line frees as jobs end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_line_is_refused_at_once() {
        let pool = Arc::new(Pool::new(1, 1));
        let (release, hold) = mpsc::channel::<()>();
        let p = Arc::clone(&pool);
        let first = tokio::spawn(async move { p.run(move || hold.recv().is_ok()).await });
        while pool.permits.available_permits() != 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let p = Arc::clone(&pool);
        let second = tokio::spawn(async move { p.run(|| 2).await });
        while pool.waiting.load(Ordering::Relaxed) != 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let third = pool.run(|| 3).await.unwrap_err();
        assert_eq!((third.status(), third.code(), third.retry_after()), (503, "tokenizer_busy", Some(1)));
        release.send(()).unwrap();
        assert!(first.await.unwrap().unwrap());
        assert_eq!(second.await.unwrap().unwrap(), 2);
        assert_eq!(pool.waiting.load(Ordering::Relaxed), 0);
        assert_eq!(pool.run(|| 4).await.unwrap(), 4);
        let mut s = Scrape::default();
        pool.scrape(&mut s);
        let text = s.encode();
        assert!(text.contains("baton_tokenize_pool_refused_total 1"), "{text}");
    }
}
