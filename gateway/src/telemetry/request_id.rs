//! Request ids: the client's `x-request-id` when it is a sane one (1 to 128 characters of
//! `[A-Za-z0-9._:/+=@-]`), else 32 hex digits made here. The id is returned in the response's
//! header and error body, sent to every engine call made for the request (vLLM's and SGLang's
//! proxies send `X-Request-Id` the same way), and is the `id` field of the `request` span that every
//! log line of the request carries.
//!
//! The id travels with the request's task (a task-local) rather than through every function: an
//! engine call reads [`current`]; a task the request spawns must be started by [`spawn`] so it
//! carries the id and the span along.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::Instrument;

/// The header's name.
pub const HEADER: &str = "x-request-id";
/// Longest client id kept: ids are log fields and header values, not payloads.
pub const MAX_LEN: usize = 128;

/// A request's id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestId(Arc<str>);

impl RequestId {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The client's id when it is valid, else a new one.
    pub fn from_header(v: Option<&hyper::header::HeaderValue>) -> Self {
        match v.and_then(|v| v.to_str().ok()) {
            Some(s) if valid(s) => Self(Arc::from(s)),
            _ => Self::new(),
        }
    }

    /// A new id: 32 hex digits, unique across processes (a per-process random half, then a count).
    pub fn new() -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        static HIGH: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let high = *HIGH.get_or_init(|| {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish()
        });
        Self(Arc::from(format!("{high:016x}{:016x}", SEQ.fetch_add(1, Ordering::Relaxed))))
    }
}

impl Default for RequestId {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether a client's id is kept as it came.
pub fn valid(s: &str) -> bool {
    (1..=MAX_LEN).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b".-_:/+=@".contains(&b))
}

tokio::task_local! {
    static CURRENT: RequestId;
}

/// The id of the request this task serves, if any.
pub fn current() -> Option<RequestId> {
    CURRENT.try_with(Clone::clone).ok()
}

/// Runs `fut` as request `id`'s, inside its `request` span.
pub fn scope<F: Future>(id: RequestId, fut: F) -> impl Future<Output = F::Output> {
    let span = tracing::info_span!("request", id = %id);
    CURRENT.scope(id, fut.instrument(span))
}

/// Runs `f` as request `id`'s (tests of what reads [`current`]).
#[cfg(test)]
pub(crate) fn scope_sync<R>(id: RequestId, f: impl FnOnce() -> R) -> R {
    CURRENT.sync_scope(id, f)
}

/// `fut` made to run as the current request's (its id, its log span and its trace), wherever it is
/// spawned. `fut` is boxed first: each wrapper here, and the task tracker and cell around them,
/// would otherwise hold and copy it whole (a 2.3 KB NIXL prefill task became 7.1 KB).
pub fn carry<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    let (id, trace) = (current(), super::trace::current());
    let fut = Box::pin(fut);
    async move {
        let fut = super::trace::scope(trace, fut);
        match id {
            Some(id) => CURRENT.scope(id, fut).await,
            None => fut.await,
        }
    }
    .instrument(tracing::Span::current())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_are_kept_only_when_sane() {
        let h = |s: &str| hyper::header::HeaderValue::from_str(s).unwrap();
        assert_eq!(RequestId::from_header(Some(&h("abc-1.2_x:y/z+w=v@u"))).as_str(), "abc-1.2_x:y/z+w=v@u");
        for bad in ["", "has space", "semi;colon", "quote\"", &"x".repeat(129)] {
            let id = RequestId::from_header(Some(&h(bad)));
            assert_eq!(id.as_str().len(), 32, "{bad:?} replaced");
            assert!(id.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
        }
        assert_ne!(RequestId::new(), RequestId::new());
    }

    /// A future carried into a task of its own keeps the request's id; one spawned bare has none.
    #[tokio::test]
    async fn carried_tasks_keep_the_id() {
        let id = RequestId::new();
        let got = scope(id.clone(), async { tokio::spawn(carry(async { current() })).await.unwrap() }).await;
        assert_eq!(got, Some(id));
        assert_eq!(tokio::spawn(carry(async { current() })).await.unwrap(), None);
    }
}
