//! What happens to an answer on its way to the client: a response body wrapper ([`Watched`]) that
//! passes every frame through unchanged while it counts the completion tokens, times the stream
//! (first chunk, gaps between chunks, the end) and, once the body ends or the client leaves,
//! records the request's metrics, takes it out of the in-flight table and tells the admission
//! plugin its usage (`on-complete`).
//!
//! The count is the `usage.completion_tokens` the engine reported when the answer carries one
//! (every non-streamed answer; a stream with `include_usage`); otherwise the number of SSE `data:`
//! events, one token each for the engines baton fronts (a stream cut short counts what was sent).

use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use memchr::memmem::Finder;

use crate::handoff::{BoxError, RespBody};
use crate::policy::{AdmissionPlugin, PolicyRequest, Usage};
use crate::telemetry::trace::{End, RequestTrace};
use crate::telemetry::{Phase, Tracked};

const KEY: &[u8] = b"\"completion_tokens\":";
const EVENT: &[u8] = b"data: ";
const DONE: &[u8] = b"data: [DONE]";
const FINISH: &[u8] = b"\"finish_reason\":";
/// Longest finish reason read (`stop`, `length`, `tool_calls`, `abort`).
const MAX_REASON: usize = 24;
/// Bytes carried from the end of one chunk, to find a marker (or a count's digits, or a finish
/// reason) split across two: the longest of them whole, a finish reason of [`MAX_REASON`] with its
/// space and quotes (43 bytes; `completion_tokens` and ten digits are 31). With fewer, a reason
/// whose marker began before the carried bytes and ended in the next chunk was lost: at 32, any
/// reason over 14 characters could be.
const TAIL: usize = FINISH.len() + 3 + MAX_REASON;

/// A request the admission plugin admitted: told its usage exactly once, in `Drop`.
#[derive(Debug)]
pub struct Completion {
    plugin: Arc<AdmissionPlugin>,
    req: Arc<PolicyRequest>,
    pub status: u16,
    tokens: u32,
}

impl Completion {
    pub fn new(plugin: Arc<AdmissionPlugin>, req: Arc<PolicyRequest>) -> Self {
        Self { plugin, req, status: 0, tokens: 0 }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        let usage = Usage {
            prompt_tokens: self.req.prompt_tokens,
            completion_tokens: self.tokens,
            status: self.status,
        };
        self.plugin.complete(Arc::clone(&self.req), usage);
    }
}

/// What [`Watched`] records when the answer ends.
#[derive(Debug)]
pub struct Answer {
    pub tracked: Tracked,
    pub mode: &'static str,
    pub tenant: Option<Arc<str>>,
    pub prompt_tokens: u64,
    pub stream: bool,
    /// The response's status.
    pub status: u16,
    /// Send the decision record as an SSE comment before `data: [DONE]` (or at the end).
    pub explain: bool,
    /// The admission plugin's `on-complete`, when it admitted the request.
    pub owed: Option<Completion>,
    /// The request's trace, ended with the body.
    pub trace: Option<Arc<RequestTrace>>,
    /// Flow control's charge to the tenant: output tokens as they stream, the budget at the end.
    pub charge: Option<crate::flow::Charge>,
}

/// Passes the body through unchanged while counting and timing it.
#[derive(Debug)]
pub struct Watched {
    inner: RespBody,
    counting: Counting,
    answer: Answer,
    /// When the response headers went out.
    headers_at: Instant,
    /// When the last chunk went out (streams).
    last: Option<Instant>,
    /// `ok` or `error` once the body ended.
    outcome: Option<&'static str>,
    /// The decision record is still to be sent (a stream that asked for it).
    explain: bool,
}

impl Watched {
    pub fn new(inner: RespBody, answer: Answer) -> Self {
        answer.tracked.live().enter(Phase::Stream);
        let now = Instant::now();
        let mut counting = Counting::default();
        if let Some(t) = &answer.trace {
            t.enter(Phase::Stream, now);
            // Read only for the trace's `gen_ai.response.finish_reasons`.
            counting.reasons = Some(Vec::new());
        }
        let explain = answer.explain;
        Self { inner, counting, answer, headers_at: now, last: None, outcome: None, explain }
    }

    /// The decision record as an SSE comment.
    fn explanation(&mut self) -> Bytes {
        self.explain = false;
        let json = ascii_json(&self.answer.tracked.live().record());
        Bytes::from(format!(": baton-explain {json}\n\n"))
    }

    /// A frame with the decision record put before its `data: [DONE]`, if it has one.
    fn explained(&mut self, data: &Bytes) -> Option<Bytes> {
        let at = starts(data, &MARKERS.done).next()?;
        let note = self.explanation();
        let mut out = Vec::with_capacity(data.len() + note.len());
        out.extend_from_slice(data.get(..at).unwrap_or_default());
        out.extend_from_slice(&note);
        out.extend_from_slice(data.get(at..).unwrap_or_default());
        Some(Bytes::from(out))
    }

    fn chunk(&mut self, data: &[u8]) {
        self.counting.scan(data);
        if let Some(c) = self.answer.charge.as_mut() {
            c.output(u64::from(self.counting.tokens()));
        }
        if !self.answer.stream || data.is_empty() {
            return;
        }
        let now = Instant::now();
        let m = self.answer.tracked.metrics();
        match self.last {
            None => {
                m.first_token(self.answer.mode, now - self.answer.tracked.live().started);
                if let Some(t) = &self.answer.trace {
                    t.first_token(now);
                }
            }
            Some(before) => m.inter_token(self.answer.mode, now - before),
        }
        self.last = Some(now);
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let a = &mut self.answer;
        let m = a.tracked.metrics();
        let tokens = self.counting.tokens();
        m.phase(Phase::Stream, self.headers_at.elapsed());
        m.ended(a.mode, self.outcome.unwrap_or("cancelled"), a.tracked.live().started.elapsed());
        m.tokens(a.tenant.as_deref(), a.prompt_tokens, u64::from(tokens));
        if let Some(end) = self.outcome {
            let live = a.tracked.live();
            let (status, stream_ms) = (a.status, crate::telemetry::metrics::ms(self.headers_at.elapsed()));
            live.note("outcome", move || {
                serde_json::json!({"end": end, "status": status, "completion_tokens": tokens,
                                   "stream_ms": stream_ms})
            });
            a.tracked.settle();
        }
        if let Some(c) = a.owed.as_mut() {
            c.tokens = tokens;
        }
        if let Some(c) = a.charge.take() {
            c.finish(u64::from(tokens));
        }
        if let Some(t) = &a.trace {
            let error = match self.outcome {
                Some("ok") => None,
                Some(_) => Some(("stream", "the engine's answer broke off")),
                None => Some(("cancelled", "the client left before the answer ended")),
            };
            let reasons = self.counting.reasons.as_deref().unwrap_or_default();
            t.finish(End { status: a.status, output_tokens: Some(tokens), finish_reasons: reasons, error });
        }
    }
}

/// JSON with every character outside ASCII escaped (`\uXXXX`): a valid HTTP header value.
pub fn ascii_json(v: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let text = v.to_string();
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{u:04x}");
            }
        }
    }
    out
}

/// Completion tokens seen so far: the last `usage.completion_tokens`, else the SSE events.
#[derive(Debug, Default)]
struct Counting {
    events: usize,
    done: usize,
    usage: Option<u32>,
    /// The distinct `finish_reason`s, when they are read.
    reasons: Option<Vec<String>>,
    /// The last bytes seen (at most [`TAIL`]).
    tail: Vec<u8>,
}

/// The markers' searchers, built once. Every chunk of every answer is searched for each marker;
/// comparing a window at each byte, as before, was a fifteenth of the gateway's instructions for a
/// request in the proxy benchmark (`memchr`'s search is vectorised).
struct Markers {
    event: Finder<'static>,
    done: Finder<'static>,
    key: Finder<'static>,
    finish: Finder<'static>,
}

static MARKERS: LazyLock<Markers> = LazyLock::new(|| Markers {
    event: Finder::new(EVENT),
    done: Finder::new(DONE),
    key: Finder::new(KEY),
    finish: Finder::new(FINISH),
});

/// Where the marker starts in `hay`. No marker overlaps itself, so the search's matches, which
/// never overlap, are all of them.
fn starts<'a>(hay: &'a [u8], marker: &'a Finder<'static>) -> impl Iterator<Item = usize> + 'a {
    marker.find_iter(hay)
}

impl Counting {
    fn tokens(&self) -> u32 {
        self.usage.unwrap_or(u32::try_from(self.events.saturating_sub(self.done)).unwrap_or(u32::MAX))
    }

    /// Counts SSE events and reads `completion_tokens` in one chunk, with the bytes carried from the
    /// one before for markers split across the boundary. Allocates only the small boundary window.
    fn scan(&mut self, data: &[u8]) {
        let carried = self.tail.len();
        let mut edge = std::mem::take(&mut self.tail);
        edge.extend_from_slice(data.get(..data.len().min(TAIL)).unwrap_or_default());
        // In the window, only what starts in the carried bytes: the rest is in `data`. An event
        // marker that ended there was counted with the chunk before; a key is read again, since
        // its digits may have been cut.
        // Nothing carried (an answer's first chunk; every unstreamed answer's only one): nothing
        // in the window starts there.
        if carried > 0 {
            let split = |i: usize, len: usize| i < carried && i + len > carried;
            self.count(&edge, split, |i| i < carried);
        }
        self.count(data, |_, _| true, |_| true);
        self.tail = if data.len() >= TAIL {
            data.get(data.len() - TAIL..).unwrap_or_default().to_vec()
        } else {
            edge.split_off(edge.len().saturating_sub(TAIL))
        };
    }

    fn count(&mut self, hay: &[u8], event_at: impl Fn(usize, usize) -> bool, key_at: impl Fn(usize) -> bool) {
        // Each marker is counted once, in the chunk where it ends; `[DONE]` is not a token.
        self.events = self
            .events
            .saturating_add(starts(hay, &MARKERS.event).filter(|&i| event_at(i, EVENT.len())).count());
        self.done =
            self.done.saturating_add(starts(hay, &MARKERS.done).filter(|&i| event_at(i, DONE.len())).count());
        for at in starts(hay, &MARKERS.key).filter(|&i| key_at(i)) {
            let rest = hay.get(at + KEY.len()..).unwrap_or_default();
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            let digits = rest.iter().take_while(|b| b.is_ascii_digit());
            if rest.first().is_some_and(u8::is_ascii_digit) {
                let n = digits.fold(0u64, |n, d| n.saturating_mul(10).saturating_add(u64::from(d - b'0')));
                self.usage = Some(u32::try_from(n).unwrap_or(u32::MAX));
            }
        }
        let Some(reasons) = self.reasons.as_mut() else { return };
        for at in starts(hay, &MARKERS.finish).filter(|&i| key_at(i)) {
            let rest = hay.get(at + FINISH.len()..).unwrap_or_default();
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            let Some(rest) = rest.strip_prefix(b"\"") else { continue };
            // Whole only: a reason cut by the chunk's end is read again from the next window.
            let Some(len) = rest.iter().take(MAX_REASON + 1).position(|&b| b == b'"') else { continue };
            let r = rest.get(..len).unwrap_or_default();
            if r.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'_')
                && !reasons.iter().any(|x| x.as_bytes() == r)
                && let Ok(r) = std::str::from_utf8(r)
            {
                reasons.push(r.to_owned());
            }
        }
    }
}

impl Body for Watched {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut polled = Pin::new(&mut self.inner).poll_frame(cx);
        if self.explain {
            match &polled {
                Poll::Ready(Some(Ok(f))) => {
                    if let Some(with) = f.data_ref().and_then(|d| self.explained(d)) {
                        polled = Poll::Ready(Some(Ok(Frame::data(with))));
                    }
                }
                // `[DONE]` never came whole: the record goes last.
                Poll::Ready(None) => {
                    self.outcome = Some("ok");
                    return Poll::Ready(Some(Ok(Frame::data(self.explanation()))));
                }
                _ => {}
            }
        }
        match &polled {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    self.chunk(d);
                }
                // hyper polls no further once the body says it has ended.
                if self.inner.is_end_stream() {
                    self.outcome = Some("ok");
                }
            }
            Poll::Ready(Some(Err(_))) => {
                self.outcome = Some("error");
                self.answer.tracked.metrics().engine_error("decode", "stream");
            }
            Poll::Ready(None) => self.outcome = Some("ok"),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        !self.explain && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same answer cut at every byte gives the same count as in one piece.
    #[test]
    fn counts_survive_every_chunk_boundary() {
        let sse = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\n\
                    data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1234}}\n\ndata: [DONE]\n\n";
        let plain = b"data: {}\n\ndata: {}\n\ndata: {}\n\ndata: [DONE]\n\n";
        let json = b"{\"usage\":{\"prompt_tokens\":5,\"completion_tokens\": 77}}";
        for (body, want) in [(&sse[..], 1234), (&plain[..], 3), (&json[..], 77)] {
            for cut in 0..=body.len() {
                for second in [cut, (cut + 7).min(body.len())] {
                    let (a, rest) = body.split_at(cut);
                    let (b, c) = rest.split_at(second - cut);
                    let got = counted(&[a, b, c]);
                    assert_eq!(got, want, "cut at {cut} and {second}: {:?}", String::from_utf8_lossy(body));
                }
            }
        }
    }

    /// Finish reasons up to the longest read, cut at every byte and in one-byte chunks, are read
    /// as in one piece; a longer one is not read.
    #[test]
    fn finish_reasons_survive_every_chunk_boundary() {
        let long = "a_reason_of_twenty_four_";
        assert_eq!(long.len(), MAX_REASON);
        let body = format!(
            "data: {{\"choices\":[{{\"index\":0,\"finish_reason\":\"content_filter\"}}]}}\n\n\
             data: {{\"choices\":[{{\"index\":1,\"finish_reason\": \"{long}\"}}]}}\n\n\
             data: {{\"choices\":[{{\"index\":2,\"finish_reason\":\"{long}x\"}}]}}\n\n\
             data: {{\"choices\":[{{\"index\":3,\"finish_reason\":\"stop\"}}]}}\n\ndata: [DONE]\n\n"
        );
        let body = body.as_bytes();
        let want = ["content_filter", long, "stop"];
        let reasons = |chunks: &mut dyn Iterator<Item = &[u8]>| {
            let mut c = Counting { reasons: Some(Vec::new()), ..Counting::default() };
            chunks.for_each(|ch| c.scan(ch));
            c.reasons.unwrap_or_default()
        };
        assert_eq!(reasons(&mut std::iter::once(body)), want);
        assert_eq!(reasons(&mut body.chunks(1)), want, "one byte at a time");
        for cut in 0..=body.len() {
            for second in [cut, (cut + 7).min(body.len()), (cut + 40).min(body.len())] {
                let (a, rest) = body.split_at(cut);
                let (b, c) = rest.split_at(second - cut);
                assert_eq!(reasons(&mut [a, b, c].into_iter()), want, "cut at {cut} and {second}");
            }
        }
    }

    #[test]
    fn ascii_json_is_a_header_value_and_the_same_json() {
        let v = serde_json::json!({"tenant": "café \"😀\"\n"});
        let text = ascii_json(&v);
        assert_eq!(text, r#"{"tenant":"caf\u00e9 \"\ud83d\ude00\"\n"}"#);
        assert!(hyper::header::HeaderValue::from_str(&text).is_ok());
        assert_eq!(serde_json::from_str::<serde_json::Value>(&text).ok(), Some(v));
    }

    fn counted(chunks: &[&[u8]]) -> u32 {
        let mut c = Counting::default();
        for ch in chunks {
            c.scan(ch);
        }
        c.tokens()
    }
}
