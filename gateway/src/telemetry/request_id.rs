//! Request ids: the client's `x-request-id` when it is a sane one (1 to 128 characters of
//! `[A-Za-z0-9._:/+=@-]`), else 32 hex digits made here. The id is returned in the response's
//! header and error body, sent to every engine call made for the request (vLLM's and SGLang's
//! proxies send `X-Request-Id` the same way), and named in every log line of the request
//! (`super::logs`: `request{id=…}`, as a span named `request` wrote it).
//!
//! The id travels with the request's task (a task-local) rather than through every function: an
//! engine call and a log line read [`current`]; a task the request spawns must be started through
//! [`carry`] so it carries the id (and the trace) along.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

/// The header's name.
pub const HEADER: &str = "x-request-id";
/// The same as a [`hyper::header::HeaderName`], made once: a name given as text is parsed and,
/// not being one of the standard headers, copied into an allocation of its own each time.
pub const HEADER_NAME: hyper::header::HeaderName = hyper::header::HeaderName::from_static(HEADER);
/// Longest client id kept: ids are log fields and header values, not payloads.
pub const MAX_LEN: usize = 128;

/// A request's id, kept as the header value it is sent as: the response's header and each engine
/// call's share its one allocation, where each had made its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestId(hyper::header::HeaderValue);

/// `id` as 32 lowercase hex digits (`format!("{id:032x}")`'s), without the formatter.
pub(crate) fn hex32(id: u128) -> [u8; 32] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [b'0'; 32];
    for (i, d) in digits.iter_mut().enumerate() {
        let nibble = usize::try_from((id >> (4 * (31 - i))) & 0xf).unwrap_or(0);
        *d = HEX.get(nibble).copied().unwrap_or(b'0');
    }
    digits
}

impl RequestId {
    pub fn as_str(&self) -> &str {
        // Always text: a kept client id is of `valid` characters, a new one hex digits.
        self.0.to_str().unwrap_or_default()
    }

    /// The id as a header value (a clone shares its bytes).
    pub fn header(&self) -> &hyper::header::HeaderValue {
        &self.0
    }

    /// The client's id when it is valid, else a new one. A kept id is copied: the client's value
    /// shares the buffer its request was read into, which a decision record would keep alive.
    pub fn from_header(v: Option<&hyper::header::HeaderValue>) -> Self {
        match v.and_then(|v| v.to_str().ok()) {
            Some(s) if valid(s) => Self::of(s.as_bytes()),
            _ => Self::new(),
        }
    }

    fn of(text: &[u8]) -> Self {
        Self(
            hyper::header::HeaderValue::from_bytes(text)
                .unwrap_or_else(|_| hyper::header::HeaderValue::from_static("invalid")),
        )
    }

    /// `high` then `seq`, each as 16 hex digits, in one block whose clones share it (a `Vec`'s
    /// bytes would be copied into a second block at the first clone).
    fn hex(high: u64, seq: u64) -> Self {
        let hex = hex32((u128::from(high) << 64) | u128::from(seq));
        match hyper::header::HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(hex)) {
            Ok(v) => Self(v),
            Err(_) => Self::of(&hex),
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
        // Written in place: `format!` grew its string three times, then `Arc` copied it.
        Self::hex(high, SEQ.fetch_add(1, Ordering::Relaxed))
    }
}

impl Default for RequestId {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
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

/// Runs `fut` as request `id`'s: its log lines name it (`super::logs`).
pub fn scope<F: Future>(id: RequestId, fut: F) -> impl Future<Output = F::Output> {
    CURRENT.scope(id, fut)
}

/// Runs `f` as request `id`'s (tests of what reads [`current`]).
#[cfg(test)]
pub(crate) fn scope_sync<R>(id: RequestId, f: impl FnOnce() -> R) -> R {
    CURRENT.sync_scope(id, f)
}

/// `fut` made to run as the current request's (its id, which its log lines name, and its trace),
/// wherever it is spawned. `fut` is boxed first: each wrapper here, and the task tracker and cell around them,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new id is this process's half, then its count: the next id counts one more, as hex.
    #[test]
    fn new_ids_count_after_the_process_half() {
        let (a, b) = (RequestId::new(), RequestId::new());
        let (a, b) = (a.as_str(), b.as_str());
        assert!(a.len() == 32 && a.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')), "{a}");
        assert_eq!(a[..16], b[..16]);
        let count = |s: &str| u64::from_str_radix(&s[16..], 16).unwrap();
        // (Other tests make ids too, in between.)
        assert!(count(b) > count(a), "{a} {b}");
        assert_eq!(RequestId::new().header().to_str().ok().map(str::len), Some(32));
        for (h, n) in [(0, 0), (0x0123_4567_89ab_cdef, 1), (u64::MAX, 0xfedc_ba98_7654_3210), (1 << 60, 15)] {
            assert_eq!(RequestId::hex(h, n).as_str(), format!("{h:016x}{n:016x}"));
        }
        // A clone shares the bytes.
        let id = RequestId::hex(1, 2);
        assert_eq!(id.clone().header().as_bytes().as_ptr(), id.header().as_bytes().as_ptr());
    }

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
