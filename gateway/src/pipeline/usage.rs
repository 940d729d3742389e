//! The admission plugin's `on-complete`: a response body wrapper that counts the completion tokens
//! on their way to the client and reports them once, when the body ends or the client leaves.
//!
//! The count is the `usage.completion_tokens` the engine reported when the answer carries one
//! (every non-streamed answer; a stream with `include_usage`); otherwise the number of SSE `data:`
//! events, one token each for the engines baton fronts (a stream cut short counts what was sent).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use crate::handoff::{BoxError, RespBody};
use crate::policy::{AdmissionPlugin, PolicyRequest, Usage};

/// Bytes carried from the end of one chunk, to find a marker (or a count's digits) split across two.
const TAIL: usize = 32;
const KEY: &[u8] = b"\"completion_tokens\":";
const EVENT: &[u8] = b"data: ";
const DONE: &[u8] = b"data: [DONE]";

/// A request the admission plugin admitted: told its usage exactly once, in `Drop`.
#[derive(Debug)]
pub struct Completion {
    plugin: Arc<AdmissionPlugin>,
    req: Arc<PolicyRequest>,
    pub status: u16,
    counting: Counting,
}

impl Completion {
    pub fn new(plugin: Arc<AdmissionPlugin>, req: Arc<PolicyRequest>) -> Self {
        Self { plugin, req, status: 0, counting: Counting::default() }
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.req.prompt_tokens,
            completion_tokens: self.counting.tokens(),
            status: self.status,
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        self.plugin.complete(Arc::clone(&self.req), self.usage());
    }
}

/// Passes the body through unchanged while counting.
#[derive(Debug)]
pub struct UsageBody {
    pub inner: RespBody,
    pub completion: Completion,
}

/// Completion tokens seen so far: the last `usage.completion_tokens`, else the SSE events.
#[derive(Debug, Default)]
struct Counting {
    events: usize,
    done: usize,
    usage: Option<u32>,
    /// The last bytes seen (at most [`TAIL`]).
    tail: Vec<u8>,
}

/// Where `needle` starts in `hay`.
fn starts<'a>(hay: &'a [u8], needle: &'a [u8]) -> impl Iterator<Item = usize> + 'a {
    hay.windows(needle.len()).enumerate().filter(move |(_, w)| *w == needle).map(|(i, _)| i)
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
        let split = |i: usize, len: usize| i < carried && i + len > carried;
        self.count(&edge, split, |i| i < carried);
        self.count(data, |_, _| true, |_| true);
        self.tail = if data.len() >= TAIL {
            data.get(data.len() - TAIL..).unwrap_or_default().to_vec()
        } else {
            edge.split_off(edge.len().saturating_sub(TAIL))
        };
    }

    fn count(&mut self, hay: &[u8], event_at: impl Fn(usize, usize) -> bool, key_at: impl Fn(usize) -> bool) {
        // Each marker is counted once, in the chunk where it ends; `[DONE]` is not a token.
        self.events =
            self.events.saturating_add(starts(hay, EVENT).filter(|&i| event_at(i, EVENT.len())).count());
        self.done = self.done.saturating_add(starts(hay, DONE).filter(|&i| event_at(i, DONE.len())).count());
        for at in starts(hay, KEY).filter(|&i| key_at(i)) {
            let rest = hay.get(at + KEY.len()..).unwrap_or_default();
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            let digits = rest.iter().take_while(|b| b.is_ascii_digit());
            if rest.first().is_some_and(u8::is_ascii_digit) {
                let n = digits.fold(0u64, |n, d| n.saturating_mul(10).saturating_add(u64::from(d - b'0')));
                self.usage = Some(u32::try_from(n).unwrap_or(u32::MAX));
            }
        }
    }
}

impl Body for UsageBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &polled
            && let Some(d) = f.data_ref()
        {
            self.completion.counting.scan(d);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
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

    fn counted(chunks: &[&[u8]]) -> u32 {
        let mut c = Counting::default();
        for ch in chunks {
            c.scan(ch);
        }
        c.tokens()
    }
}
