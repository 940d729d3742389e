//! A leg's call to an engine, written once for every mode: the body (the client's request, some
//! fields set or left out), the POST within its deadline and its trace span, the answer checked
//! (a 200 marks the engine healthy, a refusal is the client's error, a call with no answer counts
//! against the engine), the prefill fallback order and the drains.

use std::borrow::Borrow;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, SizeHint};
use hyper::{Request, Response};
use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

use super::shared::{Engine, Prefiller, Shared};
use crate::api::{GatewayError, Object};
use crate::endpoints::{EngineBody, EngineUrl};
use crate::routing::InFlight;
use crate::telemetry::Scrape;
use crate::telemetry::trace::LegSpan;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type RespBody = BoxBody<Bytes, BoxError>;

/// The client's request as an engine leg's body: its fields in their order, some replaced or added
/// (`set` and its kin: JSON already, or flags, counts and token ids written as the body is) and some
/// left out, written straight from the request without copying it.
/// (In the proxy benchmark's profile the NIXL exchange, mostly copying the request's map three
/// times and building the legs' values, was 14.7% of the gateway's CPU samples.)
pub(crate) struct Patched<'a, X: ?Sized = ()> {
    base: &'a Object,
    set: smallvec::SmallVec<[(&'static str, Val<'a>); 8]>,
    omit: &'a [&'a str],
    /// A second list left out (a mode's own beside the request kind's).
    also: &'a [&'a str],
    /// One field more, any borrowed value, written as the body is ([`Patched::with`]).
    extra: Option<(&'static str, &'a X)>,
}

impl<'a> Patched<'a> {
    /// `base` as it is, less the fields in `omit`.
    pub(crate) fn new(base: &'a Object, omit: &'a [&'a str]) -> Self {
        Self { base, set: smallvec::SmallVec::new(), omit, also: &[], extra: None }
    }
}

/// A value [`Patched::with`] puts into a body: it writes itself as compact JSON.
pub(crate) trait WriteJson {
    fn write_json(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error>;
}

/// No value (a body without [`Patched::with`]).
impl WriteJson for () {
    fn write_json(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        serde_json::to_writer(out, self)
    }
}

impl<'a, X: WriteJson + ?Sized> Patched<'a, X> {
    /// `field` is `value`, borrowed and written as the body is, after the fields `set` adds when
    /// the request has none of that name. For a large value of the gateway's own (`native`'s
    /// parameters, which hold the prompt's ids): `set` writes its value into a string of its own
    /// first, grown from 128 bytes (five allocations for a 1 KB prompt's). One such field a body;
    /// it replaces one set before under its name.
    pub(crate) fn with<Y: WriteJson + ?Sized>(self, field: &'static str, value: &'a Y) -> Patched<'a, Y> {
        let mut set = self.set;
        set.retain(|(f, _)| *f != field);
        Patched { base: self.base, set, omit: self.omit, also: self.also, extra: Some((field, value)) }
    }

    /// `field` is `value`: in the request's place if it has one, else after its fields. A value
    /// that cannot be written as JSON (none of the gateway's) is written as `null`.
    pub(crate) fn set(self, field: &'static str, value: &(impl Serialize + ?Sized)) -> Self {
        let v = serde_json::value::to_raw_value(value)
            .unwrap_or_else(|_| serde_json::value::to_raw_value(&()).unwrap_or_default());
        self.put(field, Val::Raw(v))
    }

    /// `field` is the token ids `ids` (written once for every leg), then `then` if given, as a
    /// JSON array. (A prompt's ids are most of an lmcache body: formatting them for each leg was
    /// 16% of that mode's instructions a request in the proxy benchmark, 2026-11-29.)
    pub(crate) fn ids(self, field: &'static str, ids: &'a IdsText, then: Option<u32>) -> Self {
        self.put(field, Val::Ids(ids, then))
    }

    /// `field` is the string `v` (written as the body is, with no value of its own).
    pub(crate) fn string(self, field: &'static str, v: &'a str) -> Self {
        self.put(field, Val::Str(v))
    }

    /// `field` is `true` or `false` (written as the body is, with no value of its own).
    pub(crate) fn flag(self, field: &'static str, v: bool) -> Self {
        self.put(field, Val::Bool(v))
    }

    /// `field` is the number `n`.
    pub(crate) fn count(self, field: &'static str, n: u64) -> Self {
        self.put(field, Val::Count(n))
    }

    /// `field` is `v`, JSON already, borrowed rather than copied.
    pub(crate) fn raw(self, field: &'static str, v: &'a RawValue) -> Self {
        self.put(field, Val::Ref(v))
    }

    /// `field` is `v`, JSON text already checked ([`Json`]), borrowed rather than copied.
    pub(crate) fn text(self, field: &'static str, v: &'a Json) -> Self {
        self.put(field, Val::Text(v.get()))
    }

    fn put(mut self, field: &'static str, v: Val<'a>) -> Self {
        if self.extra.is_some_and(|(f, _)| f == field) {
            self.extra = None;
        }
        match self.set.iter_mut().find(|(f, _)| *f == field) {
            Some(slot) => slot.1 = v,
            None => self.set.push((field, v)),
        }
        self
    }

    /// Leaves out the fields in `omit` instead of those given to [`Patched::new`].
    pub(crate) fn omit(mut self, omit: &'a [&'a str]) -> Self {
        self.omit = omit;
        self
    }

    /// Leaves out the fields in `also` too.
    pub(crate) fn also_omit(mut self, also: &'a [&'a str]) -> Self {
        self.also = also;
        self
    }

    fn omitted(&self, field: &str) -> bool {
        self.omit.contains(&field) || self.also.contains(&field)
    }

    /// [`Patched::set`] only where the request has the field.
    pub(crate) fn replace(self, field: &'static str, value: &(impl Serialize + ?Sized)) -> Self {
        if self.base.contains_key(field) { self.set(field, value) } else { self }
    }
}

impl<X: WriteJson + ?Sized> Patched<'_, X> {
    /// The body as compact JSON (what serde_json's `to_writer` writes for the edited map), into
    /// `out`. Written here rather than through serde, so that JSON text already checked (a
    /// producer's `kv_transfer_params`, [`Patched::text`]) goes in as it is: serde_json writes raw
    /// text only from a `RawValue`, which it makes only by parsing the text again.
    pub(crate) fn write(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        let mut first = true;
        let mut key = |out: &mut Vec<u8>, k: &str| {
            out.push(if std::mem::take(&mut first) { b'{' } else { b',' });
            let written = write_str(out, k);
            out.push(b':');
            written
        };
        for (i, (k, v)) in self.base.iter().enumerate() {
            if self.omitted(k) {
                continue;
            }
            if let Some((_, x)) = self.extra.filter(|(f, _)| f == k) {
                key(out, k)?;
                x.write_json(out)?;
                continue;
            }
            key(out, k)?;
            match self.set.iter().find(|(f, _)| *f == k) {
                Some((_, new)) => new.write(out)?,
                // A large field as the client wrote it (`api::object`): copied, not escaped again.
                None => match self.base.text_at(i) {
                    Some(text) => out.extend_from_slice(text),
                    None => serde_json::to_writer(&mut *out, v)?,
                },
            }
        }
        for (f, v) in &self.set {
            if !self.base.contains_key(f) || self.omitted(f) {
                key(out, f)?;
                v.write(out)?;
            }
        }
        if let Some((f, x)) = self.extra
            && (!self.base.contains_key(f) || self.omitted(f))
        {
            key(out, f)?;
            x.write_json(out)?;
        }
        if first {
            out.push(b'{');
        }
        out.push(b'}');
        Ok(())
    }
}

impl<X: WriteJson + Sync + ?Sized> LegBody for Patched<'_, X> {
    fn written(&self) -> Result<Vec<u8>, serde_json::Error> {
        buffered(|out| self.write(out))
    }
}

/// A value [`Patched`] sets: already JSON, or written only as the body is (no allocation of its
/// own: a body's small fields each cost one, and a profile of the vllm-nixl leg counted nine a
/// request in `set`).
enum Val<'a> {
    Raw(Box<RawValue>),
    Ref(&'a RawValue),
    /// JSON text checked already ([`Patched::text`]).
    Text(&'a str),
    Str(&'a str),
    Bool(bool),
    Count(u64),
    Ids(&'a IdsText, Option<u32>),
}

impl Val<'_> {
    fn write(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        match self {
            Val::Raw(v) => out.extend_from_slice(v.get().as_bytes()),
            Val::Ref(v) => out.extend_from_slice(v.get().as_bytes()),
            Val::Text(t) => out.extend_from_slice(t.as_bytes()),
            Val::Str(t) => write_str(out, t)?,
            Val::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            Val::Count(n) => out.extend_from_slice(itoa::Buffer::new().format(*n).as_bytes()),
            Val::Ids(ids, then) => ids.write(out, *then),
        }
        Ok(())
    }
}

/// `s` as a JSON string, as serde_json writes it: between quotes as it is when it has nothing to
/// escape (a field's name, an id: most strings a body sets), else through serde_json (a call that
/// looks up each byte in its escape table, some 150 instructions for a short name).
pub(crate) fn write_str(out: &mut Vec<u8>, s: &str) -> Result<(), serde_json::Error> {
    if crate::api::scan::plain(s.as_bytes()) {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
        Ok(())
    } else {
        serde_json::to_writer(out, s)
    }
}

/// `prefix` then `id` as 32 lowercase hex digits: `format!("{prefix}{id:032x}")`, the name a
/// request goes by on the engines, without the formatter (its padding and `fmt::Write` calls were
/// some 1,200 instructions a request, `scripts/count-instructions sglang`'s profile); the digits
/// are a request id's ([`crate::telemetry::request_id::hex32`]).
pub(crate) fn hex_name(prefix: &str, id: u128) -> String {
    let digits = crate::telemetry::request_id::hex32(id);
    let mut name = String::with_capacity(prefix.len() + 32);
    name.push_str(prefix);
    // Hex digits are ASCII: the check cannot fail.
    name.push_str(std::str::from_utf8(&digits).unwrap_or_default());
    name
}

/// `ids` as a JSON array of numbers.
///
/// Each id's digits are written in place, two at a time from a table, into room made for the
/// longest: `itoa` formats into a buffer of its own, and copying each id out of it (a `memcpy` call
/// and the `Vec`'s checks) cost more than the digits: 77 instructions an id in all, against 57 now
/// (an lmcache prompt of 235 ids, `scripts/count-instructions lmcache`'s profile).
pub(crate) fn write_ids(out: &mut Vec<u8>, ids: &[u32]) {
    /// "00" to "99".
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819202122232425262728293031323334353637383940414243444546474849\
        5051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899";
    let start = out.len();
    // `[`, then at most ten digits and a comma an id.
    out.resize(start + 2 + ids.len() * 11, 0);
    let mut at = start;
    out[at] = b'[';
    at += 1;
    for &id in ids {
        let Some(slot) = out.get_mut(at..at + 11) else { break };
        let n = decimal_digits(id);
        let (mut v, mut end) = (id as usize, n);
        while v >= 100 {
            end -= 2;
            slot[end..end + 2].copy_from_slice(&PAIRS[v % 100 * 2..v % 100 * 2 + 2]);
            v /= 100;
        }
        if v >= 10 {
            slot[..2].copy_from_slice(&PAIRS[v * 2..v * 2 + 2]);
        } else {
            slot[0] = b"0123456789"[v];
        }
        slot[n] = b',';
        at += n + 1;
    }
    // The last comma becomes the `]`; or `[]`.
    if ids.is_empty() {
        at += 1;
    }
    out[at - 1] = b']';
    out.truncate(at);
}

/// How many decimal digits `v` has (1 to 10). (`checked_ilog10` cost 11 instructions an id more.)
fn decimal_digits(v: u32) -> usize {
    match v {
        0..=9 => 1,
        10..=99 => 2,
        100..=999 => 3,
        1_000..=9_999 => 4,
        10_000..=99_999 => 5,
        100_000..=999_999 => 6,
        1_000_000..=9_999_999 => 7,
        10_000_000..=99_999_999 => 8,
        100_000_000..=999_999_999 => 9,
        _ => 10,
    }
}

/// Token ids as their JSON array, written once: every leg that sends them copies the text
/// ([`Patched::ids`]), with or without one id more after them.
#[derive(Debug, Clone)]
pub(crate) struct IdsText(String);

impl IdsText {
    pub(crate) fn new(ids: &[u32]) -> Self {
        let mut out = Vec::new();
        write_ids(&mut out, ids);
        // Kept for the request's life: not with room for ten digits an id.
        out.shrink_to_fit();
        // Digits, commas and brackets.
        Self(String::from_utf8(out).unwrap_or_default())
    }

    /// The array, then `then` inside it when given.
    fn write(&self, out: &mut Vec<u8>, then: Option<u32>) {
        let text = self.0.as_bytes();
        let Some(then) = then else { return out.extend_from_slice(text) };
        // `[...]` less its `]`; a comma unless it was `[]`.
        let open = text.get(..text.len().saturating_sub(1)).unwrap_or_default();
        out.extend_from_slice(open);
        if open.len() > 1 {
            out.push(b',');
        }
        out.extend_from_slice(itoa::Buffer::new().format(then).as_bytes());
        out.push(b']');
    }
}

/// An upstream call that got no response.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// The body could not be written as JSON (none of the gateway's bodies): nothing was sent.
    #[error("request body: {0}")]
    Body(#[source] serde_json::Error),
    /// The request could not be built (its URI): nothing was sent.
    #[error("request: {0}")]
    Request(#[source] hyper::http::Error),
    /// The connection or the exchange failed (the error's text names its causes).
    #[error("{0}")]
    Send(crate::endpoints::SendError),
    /// No answer within this limit.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl PostError {
    /// The request never left (no connection): the engine cannot have seen it.
    pub fn unsent(&self) -> bool {
        match self {
            Self::Body(_) | Self::Request(_) => true,
            Self::Send(e) => e.is_connect(),
            Self::Timeout(_) => false,
        }
    }

    /// The client's error for a call on `leg` that got no response: a 504 when it timed out, else
    /// a 502.
    pub(crate) fn on(self, leg: &'static str) -> GatewayError {
        match self {
            Self::Timeout(limit) => GatewayError::UpstreamTimeout { leg, limit },
            e => GatewayError::Upstream { leg, message: e.to_string() },
        }
    }
}

/// A leg's call that ended without a usable answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LegError {
    /// No answer came.
    #[error("upstream {leg}: {source}")]
    Unanswered {
        leg: &'static str,
        #[source]
        source: PostError,
    },
    /// The engine answered with a status other than 200; `body` is its answer.
    #[error("{leg} engine answered {status}")]
    Refused { leg: &'static str, status: u16, body: Bytes },
}

/// An engine's answer other than 200, its body read.
async fn refusal(leg: &'static str, resp: Response<EngineBody>) -> LegError {
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    LegError::Refused { leg, status, body }
}

/// How [`Shared::prefill`] may retry: also after an answer (`answered`: a 503, or a connection
/// that failed before any answer), and the request's count of retries so far.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Retrying<'a> {
    pub answered: bool,
    pub retried: &'a std::sync::atomic::AtomicU32,
}

impl LegError {
    /// Whether the engine's answer counts against its health: a 5xx.
    pub fn engine_failed(&self) -> bool {
        matches!(self, Self::Refused { status, .. } if *status >= 500)
    }

    /// Whether the engine may still be running the request: it may have seen it and gave no
    /// answer (a timeout, a connection cut).
    pub fn may_run_on(&self) -> bool {
        matches!(self, Self::Unanswered { .. }) && self.maybe_sent()
    }

    /// Whether the engine may have seen the request.
    pub fn maybe_sent(&self) -> bool {
        match self {
            Self::Unanswered { source, .. } => !source.unsent(),
            Self::Refused { .. } => true,
        }
    }

    /// Whether another engine may be asked instead, as far as this failure goes: the engine was
    /// never reached, or refused the request with a 503, or (`reset`: where the caller knows the
    /// engine's partial work cannot matter) its connection failed before any answer. A timeout
    /// never is: the engine may still be working, and asking another doubles the load that made
    /// it slow. Whether anything else (a byte to the client, a KV transfer) already depends on the
    /// leg is the caller's to know.
    pub fn retryable(&self, reset: bool) -> bool {
        match self {
            Self::Unanswered { source, .. } => {
                source.unsent() || (reset && matches!(source, PostError::Send(_)))
            }
            Self::Refused { status, .. } => *status == 503,
        }
    }
}

impl From<LegError> for GatewayError {
    fn from(e: LegError) -> Self {
        match e {
            LegError::Unanswered { leg, source } => source.on(leg),
            LegError::Refused { leg, status, body } => engine_error(leg, status, &body),
        }
    }
}

/// The smallest and the largest buffer an engine body is first given ([`Shared::post_within`]):
/// a larger body grows its own, and a small one after large ones leaves at most this much unused
/// until it is sent.
const MIN_BODY_BUFFER: usize = 256;
const MAX_BODY_BUFFER: usize = 32 << 10;

thread_local! {
    /// The size of the large engine bodies this thread wrote lately: the last one, or less by an
    /// eighth for each smaller one since.
    static BODY_SIZE_HINT: std::cell::Cell<usize> = const { std::cell::Cell::new(MIN_BODY_BUFFER) };
}

/// An engine call's body: JSON written when the call is made (anything [`Serialize`]), or written
/// once already ([`Encoded`]) and sent as it is.
pub(crate) trait LegBody: Sync {
    /// The body written, in a buffer that may be larger than it ([`buffered`]).
    fn written(&self) -> Result<Vec<u8>, serde_json::Error>;

    /// The body's bytes, to send.
    fn bytes(&self) -> Result<Bytes, serde_json::Error> {
        self.written().map(Bytes::from)
    }
}

impl<T: Serialize + Sync + ?Sized> LegBody for T {
    fn written(&self) -> Result<Vec<u8>, serde_json::Error> {
        buffered(|out| serde_json::to_writer(out, self))
    }
}

/// A body written once as JSON, for a leg that owns it (one that may run on after its request, or
/// be sent again): each call shares its bytes. (Kept as a `RawValue`, each call wrote it again,
/// and it was written into a string grown from empty first: 7.8k of sglang's 136k instructions a
/// request went to its two bodies, `scripts/count-instructions`.)
#[derive(Clone, Debug)]
pub(crate) struct Encoded(Bytes);

impl Encoded {
    /// The JSON text.
    #[cfg(test)]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl LegBody for Encoded {
    fn written(&self) -> Result<Vec<u8>, serde_json::Error> {
        Ok(self.0.to_vec())
    }

    fn bytes(&self) -> Result<Bytes, serde_json::Error> {
        Ok(self.0.clone())
    }
}

/// `body` written as JSON, once, for a leg that owns it ([`Encoded`]). Kept for as long as the leg
/// runs, so a buffer much larger than the body (the size of the large bodies written before it,
/// up to [`MAX_BODY_BUFFER`]) is fitted to it first.
pub(crate) fn encode(body: &(impl LegBody + ?Sized)) -> Result<Encoded, GatewayError> {
    let mut written = body.written().map_err(|e| {
        GatewayError::Internal(crate::api::Internal::Encode { what: "an engine body", reason: e.to_string() })
    })?;
    if written.capacity() - written.len() > written.len() / 4 {
        written.shrink_to_fit();
    }
    Ok(Encoded(Bytes::from(written)))
}

/// A body written into a buffer by `write`, straight: `to_string` goes through `fmt::Write` a
/// piece at a time, which cost 15% of the gateway's CPU with a 1,024-token `prompt_token_ids` (the
/// proxy benchmark's profile). The buffer starts at the size of the large bodies this thread wrote
/// lately (bounded), not `to_vec`'s 128 bytes, so a body like them is written without growing it
/// six times over (each a copy and a new allocation). An eighth more than the hint: a request's
/// bodies differ by a few fields (a streamed request's `sglang` prefill body has `"stream":false`
/// where its decode body has `true`, and no `stream_options`), and the next one a few bytes over
/// the last grew its buffer to twice the size.
fn buffered(
    write: impl FnOnce(&mut Vec<u8>) -> Result<(), serde_json::Error>,
) -> Result<Vec<u8>, serde_json::Error> {
    let hint = BODY_SIZE_HINT.get();
    let mut bytes = Vec::with_capacity(hint + hint / 8);
    write(&mut bytes)?;
    // A small body (a drain, an abort) between large ones lowers the hint by an eighth only.
    BODY_SIZE_HINT.set(bytes.len().max(hint - hint / 8).clamp(MIN_BODY_BUFFER, MAX_BODY_BUFFER));
    Ok(bytes)
}

/// JSON text put into a body as it is ([`Patched::text`]): an engine's, checked as JSON
/// ([`crate::api::scan`] or serde_json), or the gateway's own, written as JSON
/// ([`Json::written`]). A copy of its own: a slice of an engine's answer would keep the whole read
/// buffer it came in (8 KB and more) for as long as the request runs.
#[derive(Clone, Debug)]
pub(crate) struct Json(Box<str>);

impl Json {
    /// `text`, which the caller checked as JSON.
    pub(crate) fn checked(text: &str) -> Self {
        Self(Box::from(text))
    }

    /// `text`, which the caller wrote as JSON.
    pub(crate) fn written(text: String) -> Self {
        Self(text.into_boxed_str())
    }

    /// The text.
    pub(crate) fn get(&self) -> &str {
        &self.0
    }
}

impl Shared {
    /// POSTs `body` as JSON within the upstream timeout. `detach`: the call runs to its end even
    /// if the caller stops waiting (a client that leaves does not abort an engine mid-transfer).
    /// Not an `async fn`, which would hold [`Shared::post_within`]'s future and its own copy of
    /// the arguments.
    pub(crate) fn post<B: LegBody + ?Sized>(
        &self,
        to: &EngineUrl,
        leg: &'static str,
        path: &'static str,
        body: &B,
        detach: bool,
    ) -> impl Future<Output = Result<Response<EngineBody>, PostError>> {
        self.post_within(to, leg, path, body, self.limits.upstream_timeout, detach)
    }

    /// [`Shared::post`] within `timeout`.
    ///
    /// `leg` (`prefill`, `decode`, `drain`, `abort`) names the call in the request's trace: a traced
    /// request's call is a span of its own, whose `traceparent` the engine gets.
    pub(crate) async fn post_within<B: LegBody + ?Sized>(
        &self,
        to: &EngineUrl,
        leg: &'static str,
        path: &'static str,
        body: &B,
        timeout: Duration,
        detach: bool,
    ) -> Result<Response<EngineBody>, PostError> {
        // Made by a function of its own: made here, the request (and its headers) would keep
        // their room in this future's every state after they were sent (on each leg, boxed and
        // copied whole).
        let (req, span) = Self::request(to, leg, path, body)?;
        let answer = if detach {
            let (client, to) = (self.client.clone(), to.clone());
            let call = async move { tokio::time::timeout(timeout, client.send(&to, req)).await };
            self.detachable(call).await
        } else {
            tokio::time::timeout(timeout, self.client.send(to, req)).await
        };
        let answer = match answer {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(PostError::Send(e)),
            Err(_) => Err(PostError::Timeout(timeout)),
        };
        if let Some(span) = span {
            match &answer {
                Ok(r) => span.answered(r.status().as_u16()),
                Err(e) => span.failed(
                    if matches!(e, PostError::Timeout(_)) { "timeout" } else { "error" },
                    &e.to_string(),
                ),
            }
        }
        answer
    }

    /// The request of a call to `to`: `body` as JSON, with the request's id and, when it is
    /// traced, the leg's span (started here), whose `traceparent` it carries.
    fn request<B: LegBody + ?Sized>(
        to: &EngineUrl,
        leg: &'static str,
        path: &'static str,
        body: &B,
    ) -> Result<(Request<Full<Bytes>>, Option<LegSpan>), PostError> {
        let uri = to.call_uri(path).map_err(PostError::Request)?;
        // A static value: a `&str` would be copied into a new one on each call.
        let json = hyper::header::HeaderValue::from_static("application/json");
        // The headers in a map of their own, put in the request once it is made: `http`'s
        // `Builder` moves the whole request through each `header` call (2.7k instructions a
        // request for two legs, `scripts/count-instructions`, against 1.4k for the inserts).
        let mut headers = hyper::HeaderMap::with_capacity(4);
        headers.insert(hyper::header::CONTENT_TYPE, json);
        if let Some(host) = to.host_header() {
            headers.insert(hyper::header::HOST, host.clone());
        }
        // Every engine call made for a request names it, as vLLM's and SGLang's proxies do.
        if let Some(id) = crate::telemetry::request_id::current() {
            headers.insert(crate::telemetry::request_id::HEADER_NAME, id.header().clone());
        }
        let span = crate::telemetry::trace::current().map(|t| t.leg(leg, to, path, &mut headers));
        let bytes = body.bytes().map_err(PostError::Body)?;
        let mut req = Request::new(Full::new(bytes));
        *req.method_mut() = hyper::Method::POST;
        *req.uri_mut() = uri;
        *req.headers_mut() = headers;
        Ok((req, span))
    }

    /// One leg's call to an engine, its answer checked ([`Shared::accept`]); a call with no
    /// answer counts against the engine.
    pub(crate) async fn call<B: LegBody + ?Sized>(
        &self,
        leg: &'static str,
        to: &(impl Engine + ?Sized),
        path: &'static str,
        body: &B,
    ) -> Result<Response<EngineBody>, LegError> {
        let sent = Instant::now();
        // Not matched around `accept`'s await: the answer's `Result` would keep its room there.
        let resp = match self.post(to.peer().http, leg, path, body, false).await {
            Ok(resp) => resp,
            Err(source) => {
                self.failed(to, sent);
                return Err(LegError::Unanswered { leg, source });
            }
        };
        self.accept(leg, to, resp, sent).await
    }

    /// [`Shared::call`], its answer read whole.
    pub(crate) async fn fetch<B: LegBody + ?Sized>(
        &self,
        leg: &'static str,
        to: &(impl Engine + ?Sized),
        path: &'static str,
        body: &B,
    ) -> Result<Bytes, LegError> {
        let resp = self.call(leg, to, path, body).await?;
        Ok(resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default())
    }

    /// An engine's answer to a call sent at `sent`: a 200 marks the engine healthy; any other
    /// status is its refusal, its body read (a 5xx counts against the engine). Not an `async fn`:
    /// a 200 is taken at once, and the refusal's future (boxed) is made only for a refusal, where
    /// every leg's future would otherwise hold its room and the answer twice. A 200 marks the
    /// engine healthy when this is called, a refusal counts only once awaited: await it at once.
    pub(crate) fn accept<'a>(
        &'a self,
        leg: &'static str,
        to: &'a (impl Engine + ?Sized),
        resp: Response<EngineBody>,
        sent: Instant,
    ) -> impl Future<Output = Result<Response<EngineBody>, LegError>> + 'a {
        let answer = if resp.status() == 200 {
            to.peer().health.success(sent);
            Ok(resp)
        } else {
            Err(Box::pin(self.refused(leg, to, resp, sent)))
        };
        async move {
            match answer {
                Ok(resp) => Ok(resp),
                Err(refused) => Err(refused.await),
            }
        }
    }

    /// A refusal ([`Shared::accept`]): its body read, a 5xx counted against the engine.
    async fn refused(
        &self,
        leg: &'static str,
        to: &(impl Engine + ?Sized),
        resp: Response<EngineBody>,
        sent: Instant,
    ) -> LegError {
        let e = refusal(leg, resp).await;
        if e.engine_failed() {
            self.failed(to, sent);
        }
        e
    }

    /// [`Shared::accept`] for a leg whose refusal may be another engine's fault (an SGLang decoder
    /// that could not bootstrap from its prefiller): a 200 marks the engine healthy; a refusal is
    /// read and left for the caller to count ([`Shared::failed`], when [`LegError::engine_failed`])
    /// once it knows whose it was. Not an `async fn`, as [`Shared::accept`].
    pub(crate) fn accept_uncounted(
        &self,
        leg: &'static str,
        to: &(impl Engine + ?Sized),
        resp: Response<EngineBody>,
        sent: Instant,
    ) -> impl Future<Output = Result<Response<EngineBody>, LegError>> + 'static {
        let answer = if resp.status() == 200 {
            to.peer().health.success(sent);
            Ok(resp)
        } else {
            Err(Box::pin(refusal(leg, resp)))
        };
        async move {
            match answer {
                Ok(resp) => Ok(resp),
                Err(refused) => Err(refused.await),
            }
        }
    }

    /// An engine's whole answer ([`Shared::accept`]ed).
    pub(crate) async fn answer(
        &self,
        leg: &'static str,
        to: &(impl Engine + ?Sized),
        resp: Response<EngineBody>,
        sent: Instant,
    ) -> Result<Bytes, LegError> {
        let resp = self.accept(leg, to, resp, sent).await?;
        Ok(resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default())
    }

    /// Counts the failure of a call sent at `sent` against an engine (passive health; a call sent
    /// before the engine's last ejection or return counts for nothing, [`crate::routing::Health::stale`]).
    pub(crate) fn failed(&self, to: &(impl Engine + ?Sized), sent: Instant) {
        let peer = to.peer();
        if peer.health.failure(&self.health, sent) {
            tracing::warn!(endpoint = peer.name, "ejected after consecutive failures");
        }
    }

    /// Posts the prefill to the first prefiller, then the next ones, within the retry budget and
    /// the request's `attempts` (`retry.retried`, shared with the driver's retries), while a
    /// prefiller cannot even be connected to (it never saw the request, so another may take it).
    /// With `retry.answered`, also after a 503 or a connection that failed before any answer (for a
    /// mode whose prefiller keeps the KV to itself until a decoder asks for it, so its partial work
    /// cannot reach the decoder). `sent` is set while the request may have reached an engine.
    pub(crate) async fn prefill<'a, P: Borrow<Prefiller>, B: LegBody + ?Sized>(
        &self,
        prefills: &'a [P],
        path: &'static str,
        body: &B,
        sent: &mut bool,
        detach: bool,
        retry: Retrying<'_>,
    ) -> Result<(&'a Prefiller, Response<EngineBody>, InFlight<'a>), GatewayError> {
        let mut seen = false;
        for (attempt, prefill) in prefills.iter().map(Borrow::borrow).enumerate() {
            if attempt > 0 {
                // A fallback whose breaker is half-open: this request is its probe.
                prefill.health.chosen(&self.health);
            }
            *sent = true;
            let in_flight = prefill.health.start();
            let failure = match self.post(&prefill.http, "prefill", path, body, detach).await {
                Ok(resp) if retry.answered && resp.status() == 503 => {
                    let body = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                    LegError::Refused { leg: "prefill", status: 503, body }
                }
                Ok(resp) => return Ok((prefill, resp, in_flight)),
                Err(source) => LegError::Unanswered { leg: "prefill", source },
            };
            let sent_at = in_flight.since();
            drop(in_flight);
            self.failed(prefill, sent_at);
            seen |= failure.maybe_sent();
            *sent = seen;
            if attempt + 1 >= prefills.len()
                || !failure.retryable(retry.answered)
                || self.retries.before_retry("prefill", retry.retried).await.is_err()
            {
                return Err(failure.into());
            }
            tracing::debug!(prefill = prefill.name, error = %failure, "prefill failed before it mattered, trying the next");
        }
        Err(GatewayError::NoEndpoint("prefill"))
    }

    /// Sends a drain decode (one token, for a request that ended between its prefill and its
    /// decode) and drops its answer. `slots`, the request's slots of the decoder, are held while
    /// it runs: they go back with the guard at once when the decoder answered in full or never got
    /// the drain, and `cancel_grace` later when it was cut off or timed out (it may still run it).
    pub(crate) async fn drain<B: LegBody + ?Sized>(
        &self,
        decoder: &EngineUrl,
        path: &'static str,
        body: &B,
        counters: &Drains,
        slots: &mut Option<crate::admission::SlotGuard>,
    ) {
        engine_has_it(slots, Some(self.limits.cancel_grace));
        counters.sent.fetch_add(1, Ordering::Relaxed);
        let (status, done) = match self.post(decoder, "drain", path, body, false).await {
            Ok(r) => {
                let s = r.status().as_u16();
                (s, r.into_body().collect().await.is_ok())
            }
            Err(e) => (0, e.unsent()),
        };
        if status == 410 {
            counters.already_free.fetch_add(1, Ordering::Relaxed);
        } else if !(200..300).contains(&status) {
            counters.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(decoder = %decoder, status, "drain decode failed; the engines keep what the request left until their own timeouts");
        }
        if done {
            engine_has_it(slots, None);
        }
    }
}

/// Counters of the one-token *drain* decodes sent for requests that ended between their prefill and
/// their decode, so the engines free what the prefill left them (`lmcache` and `vllm-nixl`).
#[derive(Debug, Default)]
pub struct Drains {
    pub sent: AtomicU64,
    /// The engine no longer held anything (a decode it raced with had taken it): nothing left.
    pub already_free: AtomicU64,
    pub failed: AtomicU64,
}

impl Drains {
    /// Adds `baton_drains_total{decoder,mode,result}`.
    pub(crate) fn metrics(&self, decoder: &str, mode: &str, out: &mut Scrape) {
        self.metrics_as(
            "baton_drains_total",
            "One-token decodes sent for requests that ended between prefill and decode, by result.",
            decoder,
            mode,
            out,
        );
    }

    /// Adds `baton_drains_after_answer_total{decoder,mode,result}`: the drains of requests answered
    /// from the prefiller's first token alone (`lmcache`, `max_tokens` 1), whose decode the client
    /// did not wait for.
    pub(crate) fn metrics_after_answer(&self, decoder: &str, mode: &str, out: &mut Scrape) {
        self.metrics_as(
            "baton_drains_after_answer_total",
            "One-token decodes sent after the client was answered from the prefiller's first token, so the decoder frees what the prefill wrote, by result.",
            decoder,
            mode,
            out,
        );
    }

    fn metrics_as(&self, name: &str, help: &str, decoder: &str, mode: &str, out: &mut Scrape) {
        for (result, c) in
            [("sent", &self.sent), ("already_free", &self.already_free), ("failed", &self.failed)]
        {
            out.counter(
                name,
                help,
                &[("decoder", decoder), ("mode", mode), ("result", result)],
                c.load(Ordering::Relaxed) as f64,
            );
        }
    }
}

/// An engine's non-200 answer as the client's error: a 4xx keeps its status and the engine's OpenAI
/// error body (one is made from its text when it sent none); anything else is the gateway's 502.
pub(crate) fn engine_error(leg: &'static str, status: u16, body: &[u8]) -> GatewayError {
    if !(400..500).contains(&status) {
        return GatewayError::Upstream { leg, message: format!("{status}: {}", short_body(body)) };
    }
    let body = match serde_json::from_slice::<Value>(body) {
        Ok(v) if v.get("error").is_some_and(Value::is_object) => v,
        _ => serde_json::json!({"error": {"message": short_body(body), "type": "invalid_request_error",
                                          "param": null, "code": "engine_refused"}}),
    };
    GatewayError::EngineRefused { leg, status, body }
}

/// A short prefix of an engine's answer for an error message.
pub(crate) fn short_body(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    s.chars().take(300).collect()
}

/// An engine answer's body as the gateway's.
pub(crate) fn boxed(body: EngineBody) -> RespBody {
    body.map_err(|e| Box::new(e) as BoxError).boxed()
}

/// What an engine's answer holds while it streams back to the client (the request's slot, its
/// abort), and what may cut it short (a leg still running).
pub(crate) trait Holds: Send + Sync + Unpin + 'static {
    /// Before each frame of the engine's: `Some(frame)` to send that frame instead and end the
    /// answer after it.
    fn cut(&mut self, _cx: &mut Context<'_>) -> Option<Frame<Bytes>> {
        None
    }

    /// The engine's answer ended whole.
    fn ended(&mut self) {}

    /// Whether the answer's size is the engine's (nothing may be added to it).
    fn sized(&self) -> bool {
        true
    }
}

/// The request's slot, held until its answer ends (and, if the client left first, the engine's
/// time to notice: [`crate::admission::SlotGuard::engine_has_it`]).
impl Holds for Option<crate::admission::SlotGuard> {
    fn ended(&mut self) {
        if let Some(s) = self {
            s.engine_done();
        }
    }
}

/// Marks the request's slot as run by the engine from here on (see
/// [`crate::admission::SlotGuard::engine_has_it`]), or, after an answer that ended, no more.
pub(crate) fn engine_has_it(
    slots: &mut Option<crate::admission::SlotGuard>,
    grace: Option<std::time::Duration>,
) {
    if let Some(s) = slots {
        match grace {
            Some(g) => s.engine_has_it(g),
            None => s.engine_done(),
        }
    }
}

/// An engine's answer, holding `H` until it ends (or the client leaves and it is dropped).
pub(crate) struct Held<H> {
    inner: EngineBody,
    hold: H,
    /// Nothing more comes: the answer ended whole, or was cut short after the frame that cut it.
    over: bool,
}

impl<H: Holds> Held<H> {
    pub(crate) fn body(inner: EngineBody, hold: H) -> RespBody {
        Self { inner, hold, over: false }.boxed()
    }
}

impl<H: Holds> Body for Held<H> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.over {
            return Poll::Ready(None);
        }
        if let Some(frame) = self.hold.cut(cx) {
            self.over = true;
            return Poll::Ready(Some(Ok(frame)));
        }
        let next = Pin::new(&mut self.inner).poll_frame(cx);
        // hyper's server polls a body no further once it says it has ended (an answer of known
        // length, after its last byte) or once it gave its trailers: the end is seen there, not
        // only as `None`. (Missing it held every non-streamed answer's slot for the cancel grace,
        // and aborted its SGLang legs after they succeeded.)
        let whole = match &next {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(f))) => f.is_trailers() || self.inner.is_end_stream(),
            _ => false,
        };
        if whole {
            self.over = true;
            self.hold.ended();
        }
        next.map(|o| o.map(|r| r.map_err(|e| Box::new(e) as BoxError)))
    }

    fn is_end_stream(&self) -> bool {
        self.over || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.hold.sized() { self.inner.size_hint() } else { SizeHint::default() }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Map, json};

    use super::*;

    fn map(v: Value) -> Object {
        match v {
            Value::Object(m) => m.into(),
            _ => Object::default(),
        }
    }

    /// A patched body is what cloning the map and inserting and removing its fields gives, in
    /// the same order, byte for byte.
    #[test]
    fn a_patched_body_is_the_edited_request() {
        let raw = map(json!({"model": "m", "prompt": "a \"quoted\"\nprompt", "stream": true,
                             "stream_options": {"include_usage": true}, "max_tokens": 50, "n": 1}));
        let omit = ["stream_options", "min_tokens"];
        let patched = Patched::new(&raw, &omit)
            .set("stream", &false)
            .set("kv_transfer_params", &json!({"do_remote_decode": true}))
            .set("max_tokens", &7)
            .set("max_tokens", &1)
            .replace("max_completion_tokens", &1)
            .replace("n", &2);
        let mut edited = raw.map().clone();
        edited.insert("stream".into(), json!(false));
        edited.insert("kv_transfer_params".into(), json!({"do_remote_decode": true}));
        edited.insert("max_tokens".into(), json!(1));
        edited.insert("n".into(), json!(2));
        // (`shift_remove`: `remove` would move the last field into the hole.)
        edited.shift_remove("stream_options");
        assert_eq!(text(&patched), serde_json::to_string(&edited).unwrap_or_default());
        // A field both set and left out is set (after the request's fields).
        let both = Patched::new(&raw, &["stream"]).set("stream", &false);
        assert_eq!(
            serde_json::from_str::<Value>(&text(&both)).unwrap_or_default(),
            json!({"model": "m", "prompt": "a \"quoted\"\nprompt", "stream_options": {"include_usage": true},
                   "max_tokens": 50, "n": 1, "stream": false})
        );
        let keys: Vec<String> = serde_json::from_str::<Map<String, Value>>(&text(&both))
            .unwrap_or_default()
            .keys()
            .cloned()
            .collect();
        assert_eq!(keys.last().map(String::as_str), Some("stream"));
    }

    /// The ids' text is serde_json's for every length of number, at each power of ten's edges,
    /// alone, in a list, and after text already in the buffer.
    #[test]
    fn ids_are_written_as_serde_json_writes_them() {
        let mut ids = vec![0u32, 1, u32::MAX - 1, u32::MAX];
        let mut p = 1u64;
        while p <= u64::from(u32::MAX) {
            ids.extend([p - 1, p, p + 1].map(|v| u32::try_from(v).unwrap_or(u32::MAX)));
            p *= 10;
        }
        ids.extend((0..2000u32).map(|i| i.wrapping_mul(2_654_435_761) >> (i % 32)));
        for id in &ids {
            let mut out = Vec::new();
            write_ids(&mut out, std::slice::from_ref(id));
            assert_eq!(out, serde_json::to_vec(&[id]).unwrap_or_default(), "{id}");
        }
        let mut out = b"x".to_vec();
        write_ids(&mut out, &ids);
        assert_eq!(out[1..], serde_json::to_vec(&ids).unwrap_or_default()[..]);
        assert_eq!(out[0], b'x');
        let mut out = b"x".to_vec();
        write_ids(&mut out, &[]);
        assert_eq!(out, b"x[]");
    }

    /// A request's name is the formatter's, every nibble in every place.
    #[test]
    fn hex_names_are_the_formatters() {
        let mut ids = vec![0u128, 1, u128::MAX, u128::MAX - 1, 1 << 127, 0x0123_4567_89ab_cdef];
        ids.extend((0..128).map(|i| 1u128 << i));
        ids.extend((0..16u128).map(|n| n * 0x1111_1111_1111_1111_1111_1111_1111_1111));
        for id in ids {
            assert_eq!(hex_name("baton-", id), format!("baton-{id:032x}"));
            assert_eq!(hex_name("", id), format!("{id:032x}"));
        }
    }

    /// Token ids set with `ids` are the array `set` writes, with the next token after them when
    /// one is given; set again, a field takes its last value in either form.
    #[test]
    fn ids_are_written_as_set_writes_them() {
        let raw = map(json!({"model": "m", "prompt": "p", "n": 1}));
        let ids = [0u32, 7, 151_643, u32::MAX];
        let (all, none, two) = (IdsText::new(&ids), IdsText::new(&[]), IdsText::new(&ids[..2]));
        let written = |p: &Patched<'_>| text(p);
        assert_eq!(
            written(&Patched::new(&raw, &[]).ids("prompt", &all, None)),
            written(&Patched::new(&raw, &[]).set("prompt", &ids))
        );
        assert_eq!(
            written(&Patched::new(&raw, &[]).ids("prompt", &all, Some(9))),
            r#"{"model":"m","prompt":[0,7,151643,4294967295,9],"n":1}"#
        );
        assert_eq!(
            written(&Patched::new(&raw, &[]).ids("prompt", &none, Some(9))),
            r#"{"model":"m","prompt":[9],"n":1}"#
        );
        assert_eq!(
            written(&Patched::new(&raw, &[]).ids("prompt", &none, None).set("tail", &ids[..1])),
            r#"{"model":"m","prompt":[],"n":1,"tail":[0]}"#
        );
        assert_eq!(
            written(&Patched::new(&raw, &[]).ids("prompt", &all, None).set("prompt", &"t")),
            r#"{"model":"m","prompt":"t","n":1}"#
        );
        assert_eq!(
            written(&Patched::new(&raw, &[]).set("prompt", &"t").ids("prompt", &two, None)),
            r#"{"model":"m","prompt":[0,7],"n":1}"#
        );
    }

    /// A field given `with` is written as `set` writes it, in the request's place or after the
    /// set fields, and either form replaces the other under one name.
    #[test]
    fn a_field_with_a_borrowed_value_is_written_as_set() {
        #[derive(Serialize)]
        struct P<'a> {
            id: &'a str,
            ids: &'a [u32],
        }
        impl WriteJson for P<'_> {
            fn write_json(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
                serde_json::to_writer(out, self)
            }
        }
        let p = P { id: "a\"b", ids: &[1, 2] };
        let raw = map(json!({"model": "m", "kv": 0, "stream": true, "n": 1}));
        for omit in [&[][..], &["kv"][..], &["stream", "kv"][..]] {
            for field in ["kv", "extra"] {
                let by_set = Patched::new(&raw, omit).flag("stream", false).set(field, &p);
                let by_with = Patched::new(&raw, omit).flag("stream", false).with(field, &p);
                assert_eq!(text(&by_with), text(&by_set), "{omit:?} {field}");
            }
        }
        // Set after: the set value alone; `with` after `set`: the borrowed one alone.
        let later = Patched::new(&raw, &[]).with("kv", &p).count("kv", 3);
        assert_eq!(text(&later), r#"{"model":"m","kv":3,"stream":true,"n":1}"#);
        let over = Patched::new(&raw, &[]).count("kv", 3).with("kv", &p);
        assert_eq!(text(&over), r#"{"model":"m","kv":{"id":"a\"b","ids":[1,2]},"stream":true,"n":1}"#);
    }

    /// Checked JSON text goes in as written; a string is escaped as `set` escapes it.
    #[test]
    fn text_and_strings_are_written_as_given() {
        let raw = map(json!({"model": "m", "n": 1}));
        let params = Json::checked(r#"{"a": [1, "x"]}"#);
        assert_eq!(
            text(&Patched::new(&raw, &[]).text("kv", &params)),
            r#"{"model":"m","n":1,"kv":{"a": [1, "x"]}}"#
        );
        let s = "a\"b\\c\n\u{1}é";
        assert_eq!(
            text(&Patched::new(&raw, &[]).string("model", s)),
            text(&Patched::new(&raw, &[]).set("model", &s))
        );
        assert_eq!(text(&Patched::new(&Object::default(), &[])), "{}");
    }

    /// A string, a field's name among them, is written as serde_json writes it, whether or not
    /// it has anything to escape.
    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        let alphabet = ["a", "\"", "\\", "\n", "\u{1f}", " ", "\u{7f}", "é", "😀"];
        let mut cases = vec![String::new()];
        for a in alphabet {
            for b in alphabet {
                for c in alphabet {
                    cases.push(format!("{a}{b}{c}"));
                }
            }
        }
        // Each of them at every place of a longer string (checked eight bytes at a time).
        for a in alphabet {
            for at in 0..20 {
                cases.push(format!("{}{a}{}", "x".repeat(at), "y".repeat(19 - at)));
            }
        }
        for t in &cases {
            let mut out = Vec::new();
            write_str(&mut out, t).unwrap_or_default();
            assert_eq!(out, serde_json::to_vec(t).unwrap_or_default(), "{t:?}");
        }
        let raw = map(json!({"a\"b": 1, "é\n": 2}));
        let body = Patched::new(&raw, &[]).count("x\\y", 3);
        assert_eq!(
            serde_json::from_str::<Value>(&text(&body)).ok(),
            Some(json!({"a\"b": 1, "é\n": 2, "x\\y": 3}))
        );
    }

    /// A body written once keeps no more room than a quarter of its size, whatever the bodies
    /// before it were.
    #[test]
    fn an_encoded_body_is_fitted_to_its_size() {
        let large = map(json!({"prompt": "x".repeat(20_000)}));
        let small = map(json!({"prompt": "y"}));
        for _ in 0..2 {
            let _ = encode(&Patched::new(&large, &[]));
        }
        let body = Patched::new(&small, &[]);
        assert!(body.written().unwrap_or_default().capacity() > 10_000, "the hint follows the large bodies");
        let e = encode(&body).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(e.as_bytes(), br#"{"prompt":"y"}"#);
        let kept = Vec::from(e.0);
        assert!(kept.capacity() <= kept.len() + kept.len() / 4, "{} for {}", kept.capacity(), kept.len());
    }

    /// A body as the engine gets it.
    fn text<B: LegBody + ?Sized>(b: &B) -> String {
        String::from_utf8(b.bytes().unwrap_or_default().to_vec()).unwrap_or_default()
    }

    /// A parsed body's large fields are written as the client wrote them, and the body is the
    /// same JSON as the edited request's.
    #[test]
    fn large_fields_are_written_as_they_came() {
        let prompt = format!("caf\\u00e9 \\\"{}\\\"\\n", "x".repeat(80));
        let body = format!(
            r#"{{"model":"m","prompt":"{prompt}","stop":["{}"],"stream":true,"logit_bias":{{"1": 2}}}}"#,
            "y".repeat(70)
        );
        let raw = Object::parse(&Bytes::from(body)).unwrap_or_else(|e| panic!("{e}"));
        let patched = Patched::new(&raw, &["logit_bias"]).set("stream", &false).set("kv", &json!({"a": 1}));
        let text = text(&patched);
        assert!(text.contains(&format!("\"prompt\":\"{prompt}\"")), "{text}");
        let mut edited = raw.map().clone();
        edited.insert("stream".into(), json!(false));
        edited.insert("kv".into(), json!({"a": 1}));
        edited.shift_remove("logit_bias");
        assert_eq!(serde_json::from_str::<Value>(&text).ok(), Some(Value::Object(edited)));
        // A large field the leg replaces or leaves out is not written from the kept text.
        let replaced = Patched::new(&raw, &["stop"]).set("prompt", &[1, 2]);
        let text = super::tests::text(&replaced);
        assert!(!text.contains("caf") && !text.contains("yyy"), "{text}");
        assert!(text.contains("\"prompt\":[1,2]"), "{text}");
    }
}
