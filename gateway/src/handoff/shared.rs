//! What the handoff modes share: the engines' HTTP client, the limits and health settings, request
//! ids, the tasks a request leaves behind, the prefill engines.

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use baton_dataplane::{RequestId, RequestKey};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use tokio_util::task::TaskTracker;

use crate::admission::AdmissionError;
use crate::api::GatewayError;
use crate::endpoints::{EngineClient, EngineUrl};
use crate::routing::{Health, HealthConfig};
use crate::telemetry::{Metrics, request_id};

/// A reservation's lease on the decoder: long enough for a long prefill and the decode request to
/// arrive, short enough that a vanished gateway strands pages for at most this long.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(120);
/// Longest wait for every decoder rank to hold the whole KV after the prefill returned.
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest an upstream leg may take to answer (headers, for a streamed decode).
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(300);
/// Idle keep-alive connections to the engines are not used again after this long: well under the
/// 5 s after which uvicorn (vLLM's and SGLang's HTTP server) closes an idle connection, counted from
/// when it finished writing its answer, which a slow client reading a stream can leave unread for
/// a while. A request written to a connection the engine is closing at that moment is lost
/// unanswered, and the gateway cannot know whether the engine read it (a decode whose KV then
/// waits out the producer's timeout).
pub const DEFAULT_ENGINE_IDLE: Duration = Duration::from_secs(3);
/// Longest the slots of a finished or abandoned request wait for the decoder to report its pages
/// free before they are returned anyway: the decoder's lease and quarantine end them by then.
pub const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a `vllm-nixl` or `sglang` decoder's slot stays held after its request was abandoned
/// while the engine ran it (the client left, a wait timed out): the engine's time to notice the
/// closed connection and free the request (vLLM aborts it at its next step).
pub const DEFAULT_CANCEL_GRACE: Duration = Duration::from_millis(100);

/// Timing limits of the handoff.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub lease: Duration,
    pub queue_timeout: Duration,
    pub ready_timeout: Duration,
    pub upstream_timeout: Duration,
    pub release_timeout: Duration,
    /// [`DEFAULT_CANCEL_GRACE`].
    pub cancel_grace: Duration,
    /// [`DEFAULT_ENGINE_IDLE`].
    pub engine_idle: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            lease: DEFAULT_LEASE,
            queue_timeout: crate::admission::DEFAULT_QUEUE_TIMEOUT,
            ready_timeout: DEFAULT_READY_TIMEOUT,
            upstream_timeout: DEFAULT_UPSTREAM_TIMEOUT,
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
            cancel_grace: DEFAULT_CANCEL_GRACE,
            engine_idle: DEFAULT_ENGINE_IDLE,
        }
    }
}

/// A future from [`Shared::detachable`]: awaited, it runs in the awaiting task; dropped before it
/// finished, what is left of it runs on in a task of its own, its output dropped there.
pub(crate) struct Detachable<T: Send + 'static> {
    work: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    tasks: TaskTracker,
}

impl<T: Send + 'static> Detachable<T> {
    /// Ends the work where it is, unfinished (as aborting a spawned task would): dropping a call
    /// to an engine closes its connection.
    pub(crate) fn cancel(mut self) {
        self.work = None;
    }
}

impl<T: Send + 'static> Future for Detachable<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(work) = self.work.as_mut() else {
            // Polled again after it finished (no caller does: each awaits it once, and `select!`
            // branches on it are disabled once it is ready): its output was taken.
            return Poll::Pending;
        };
        // A leg that panics panics the request, as the request's own code would; what is left of
        // it cannot be polled again, so it is not handed to a task when the request is dropped.
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => {
                self.work = None;
                Poll::Ready(out)
            }
            Err(panic) => {
                self.work = None;
                std::panic::resume_unwind(panic)
            }
        }
    }
}

impl<T: Send + 'static> Drop for Detachable<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else { return };
        // Dropped with the request, inside its scope (tokio and tracing drop a scoped future
        // within its scope): the task carries the request's id and trace.
        spawn_from_drop(&self.tasks, async move { drop(work.await) });
    }
}

/// `work` in a task of `tasks` with the current request's id and trace, from a `Drop`: nothing is
/// spawned once the runtime is gone (the process is ending, and the engines' own leases end what
/// the request held).
fn spawn_from_drop(tasks: &TaskTracker, work: impl Future<Output = ()> + Send + 'static) {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        tasks.spawn_on(request_id::carry(work), &rt);
    }
}

impl<T: Send + 'static> std::fmt::Debug for Detachable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detachable").field("finished", &self.work.is_none()).finish_non_exhaustive()
    }
}

/// What every mode of one gateway shares: the client to the engines, the limits, the health
/// settings, request ids and the metrics.
#[derive(Debug)]
pub struct Shared {
    pub(crate) client: EngineClient,
    pub limits: Limits,
    pub health: HealthConfig,
    pub keys: KeyGen,
    pub metrics: Arc<Metrics>,
    /// The retry budget (`[routing.retries]`) every request's legs draw on.
    pub retries: crate::routing::retry::Retries,
    /// Every task a request spawns (a leg that runs on after its client left, a drain, a cancel, a
    /// release wait): a drain of the gateway waits for them, so nothing a request owes an engine is
    /// cut off by a shutdown.
    tasks: TaskTracker,
}

impl Shared {
    /// Engines by IP, or by name with the system's resolver, `https://` checked against the
    /// system's roots.
    pub fn new(limits: Limits, health: HealthConfig) -> prometheus::Result<Arc<Self>> {
        let client = EngineClient::new(crate::endpoints::Names::default(), None, limits.engine_idle);
        let metrics = Metrics::new(
            crate::telemetry::metrics::DEFAULT_TENANT_SERIES,
            crate::telemetry::metrics::DEFAULT_RECORDS,
        )?;
        Ok(Self::with_client(limits, health, client, Arc::new(metrics)))
    }

    /// With `client` (`[resolver]`, `[engine_tls]`) and `metrics`.
    pub fn with_client(
        limits: Limits,
        health: HealthConfig,
        client: EngineClient,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let retries = crate::routing::retry::Retries::new(health.retries);
        Arc::new(Self {
            client,
            limits,
            health,
            keys: KeyGen::default(),
            metrics,
            retries,
            tasks: TaskTracker::new(),
        })
    }

    /// Runs `work` in a task of its own that carries the request's id and trace, tracked so a
    /// drain of the gateway waits for it.
    pub(crate) fn spawn<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.tasks.spawn(request_id::carry(work))
    }

    /// [`Shared::spawn`] from a `Drop`: nothing is spawned once the runtime is gone (the process
    /// is ending, and the engines' own leases end what the request held).
    pub(crate) fn spawn_from_drop(&self, work: impl Future<Output = ()> + Send + 'static) {
        spawn_from_drop(&self.tasks, work);
    }

    /// `work` run as part of the request that awaits it, and handed to a task of its own
    /// ([`Shared::spawn`]'s: tracked, with the request's id and trace) only if the request drops
    /// it unfinished: a leg runs to its end whatever the client does, as a spawned one would,
    /// without a task, its wake-ups and its polls on every request that is not cut short (the
    /// proxy benchmark counted two task polls a request for NIXL's prefill task alone).
    pub(crate) fn detachable<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> Detachable<T> {
        Detachable { work: Some(Box::pin(work)), tasks: self.tasks.clone() }
    }

    /// Tasks requests left behind that have not ended yet.
    pub fn tasks_running(&self) -> usize {
        self.tasks.len()
    }

    /// Waits until every task requests left behind has ended, at most `timeout`; whether they all
    /// did.
    pub async fn wait_for_tasks(&self, timeout: Duration) -> bool {
        self.tasks.close();
        let done = tokio::time::timeout(timeout, self.tasks.wait()).await.is_ok();
        self.tasks.reopen();
        done
    }

    /// `GET /health` answered 200 within `timeout`.
    pub async fn health_check(&self, to: &EngineUrl, timeout: Duration) -> bool {
        let Ok(req) = Request::get(to.uri("/health")).body(Full::new(Bytes::new())) else {
            return false;
        };
        match tokio::time::timeout(timeout, self.client.send(to, req)).await {
            Ok(Ok(r)) => {
                let ok = r.status() == 200;
                let _ = r.into_body().collect().await;
                ok
            }
            _ => false,
        }
    }
}

/// A task aborted when this is dropped (with what owns it: a decoder, a request).
#[derive(Debug)]
pub struct AbortOnDrop<T = ()>(pub tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An engine a leg is sent to: its name, its address, its passive health.
#[derive(Clone, Copy, Debug)]
pub struct Peer<'a> {
    pub name: &'a str,
    pub http: &'a EngineUrl,
    pub health: &'a Health,
}

/// Something a leg can be sent to.
pub trait Engine {
    fn peer(&self) -> Peer<'_>;
}

/// A prefill engine.
#[derive(Clone, Debug)]
pub struct Prefiller {
    pub name: String,
    pub http: EngineUrl,
    pub health: Arc<Health>,
}

impl Engine for Prefiller {
    fn peer(&self) -> Peer<'_> {
        Peer { name: &self.name, http: &self.http, health: &self.health }
    }
}

impl Prefiller {
    pub fn new(name: String, http: impl Into<EngineUrl>) -> Self {
        Self { name, http: http.into(), health: Arc::default() }
    }
}

/// Request ids unique across restarts and replicas: 64 random bits per process (the std hasher's
/// random keys), then a counter.
#[derive(Debug)]
pub struct KeyGen {
    high: u64,
    next: AtomicU64,
}

impl Default for KeyGen {
    fn default() -> Self {
        let mut h = RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        Self { high: h.finish(), next: AtomicU64::new(1) }
    }
}

impl KeyGen {
    pub fn next(&self) -> RequestKey {
        RequestKey::new(
            RequestId(u128::from(self.high) << 64 | u128::from(self.next.fetch_add(1, Ordering::Relaxed))),
            0,
        )
    }
}

pub(crate) fn admission_error(e: AdmissionError) -> GatewayError {
    match e {
        AdmissionError::TooLarge { need, capacity } => GatewayError::TooLarge { need, capacity },
        e @ AdmissionError::QueueFull { .. } => GatewayError::QueueFull(e),
        e @ AdmissionError::Timeout { .. } => GatewayError::QueueTimeout(crate::api::Waited::Slots(e)),
    }
}

/// Pauses between retries that double up to a ceiling, each drawn at random from the upper half
/// of its step ("equal jitter"): requests refused together do not all come back together.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Self { next: first, max }
    }

    /// The next pause.
    pub(crate) fn pause(&mut self) -> Duration {
        let step = self.next;
        self.next = (step * 2).min(self.max);
        step / 2 + step.mul_f64(rand::random::<f64>() / 2.0)
    }

    /// Sleeps for the next pause.
    pub(crate) async fn wait(&mut self) {
        tokio::time::sleep(self.pause()).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// Awaited, a detachable runs in the awaiting task and leaves none behind; dropped unfinished
    /// (a client that left), the rest of it runs to its end in a tracked task that still carries
    /// the request's id; cancelled, it stops where it is; panicked, it is not run on.
    #[tokio::test]
    async fn a_detachable_runs_here_and_on_alone_only_when_dropped() {
        let shared =
            Shared::new(Limits::default(), HealthConfig::default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(shared.detachable(async { 7 }).await, 7);
        assert_eq!(shared.tasks_running(), 0, "nothing was spawned for a leg that was waited for");

        let id = request_id::RequestId::new();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let leg = shared.detachable(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = tx.send(request_id::current().map(|i| i.as_str().to_owned()));
        });
        let request = request_id::scope(id.clone(), leg);
        assert!(tokio::time::timeout(Duration::from_millis(5), request).await.is_err(), "the client left");
        assert_eq!(shared.tasks_running(), 1, "the rest of the leg runs in a task of its own");
        let ran = tokio::time::timeout(Duration::from_secs(5), rx).await;
        assert_eq!(ran.ok().and_then(Result::ok).flatten().as_deref(), Some(id.as_str()));
        assert!(shared.wait_for_tasks(Duration::from_secs(5)).await);

        let done = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&done);
        let mut leg = shared.detachable(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            flag.store(true, Ordering::Relaxed);
        });
        assert!(tokio::time::timeout(Duration::from_millis(5), &mut leg).await.is_err());
        leg.cancel();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!done.load(Ordering::Relaxed), "a cancelled leg does not run on");
        assert_eq!(shared.tasks_running(), 0);

        // A leg that panics panics its request, and what is left of it is not run on.
        let mut leg = shared.detachable(async { panic!("a leg's bug") });
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let polled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Pin::new(&mut leg).poll(&mut cx)));
        assert!(polled.is_err());
        drop(leg);
        assert_eq!(shared.tasks_running(), 0, "a panicked leg is not handed to a task");
    }

    /// A drain waits for what requests left running, within its bound, and says when the bound
    /// passed first; the tracker takes new tasks again afterwards.
    #[tokio::test]
    async fn the_drain_waits_for_request_tasks() {
        let shared =
            Shared::new(Limits::default(), HealthConfig::default()).unwrap_or_else(|e| panic!("{e}"));
        let done = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&done);
        shared.spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            flag.store(true, Ordering::Relaxed);
        });
        assert_eq!(shared.tasks_running(), 1);
        assert!(!shared.wait_for_tasks(Duration::from_millis(10)).await, "the task is still running");
        assert!(shared.wait_for_tasks(Duration::from_secs(5)).await);
        assert!(done.load(Ordering::Relaxed), "the wait ended only once the task had");
        assert_eq!(shared.tasks_running(), 0);
        let again = shared.spawn(async {});
        assert!(again.await.is_ok());
    }
}
