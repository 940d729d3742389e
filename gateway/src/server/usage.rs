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

/// Bytes kept from the end of one chunk to find a key split across two.
const TAIL: usize = 64;
const KEY: &[u8] = b"\"completion_tokens\":";

/// A request the admission plugin admitted: told its usage exactly once, in `Drop`.
#[derive(Debug)]
pub struct Completion {
    plugin: Arc<AdmissionPlugin>,
    req: Arc<PolicyRequest>,
    pub status: u16,
    usage: Option<u32>,
    events: u32,
}

impl Completion {
    pub fn new(plugin: Arc<AdmissionPlugin>, req: Arc<PolicyRequest>) -> Self {
        Self { plugin, req, status: 0, usage: None, events: 0 }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        let usage = Usage {
            prompt_tokens: self.req.prompt_tokens,
            completion_tokens: self.usage.unwrap_or(self.events),
            status: self.status,
        };
        self.plugin.complete(Arc::clone(&self.req), usage);
    }
}

/// Passes the body through unchanged while counting.
#[derive(Debug)]
pub struct UsageBody {
    pub inner: RespBody,
    pub completion: Completion,
    pub tail: Vec<u8>,
}

fn find(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len()).enumerate().filter(|(_, w)| *w == needle).map(|(i, _)| i).collect()
}

impl UsageBody {
    fn scan(&mut self, data: &Bytes) {
        let mut buf = std::mem::take(&mut self.tail);
        let carried = buf.len();
        buf.extend_from_slice(data);
        // SSE events that start in this chunk (a `data: ` split across chunks is counted once).
        let events = find(&buf, b"data: ").into_iter().filter(|&i| i + 6 > carried).count();
        let done = find(&buf, b"data: [DONE]").into_iter().filter(|&i| i + 6 > carried).count();
        let events = u32::try_from(events.saturating_sub(done)).unwrap_or(u32::MAX);
        self.completion.events = self.completion.events.saturating_add(events);
        for at in find(&buf, KEY) {
            let digits: Vec<u8> = buf
                .iter()
                .skip(at + KEY.len())
                .skip_while(|b| **b == b' ')
                .take_while(|b| b.is_ascii_digit())
                .copied()
                .collect();
            if let Some(n) = std::str::from_utf8(&digits).ok().and_then(|s| s.parse().ok()) {
                self.completion.usage = Some(n);
            }
        }
        let keep = buf.len().min(TAIL);
        self.tail = buf.split_off(buf.len() - keep);
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
            let d = d.clone();
            self.scan(&d);
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
