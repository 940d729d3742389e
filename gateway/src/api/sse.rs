//! Server-sent events as the engines and the gateway write them: `data: <payload>\n\n`.

/// Splits an SSE byte stream, cut anywhere, into its `data:` payloads.
#[derive(Debug, Default)]
pub struct SseSplitter {
    buf: Vec<u8>,
}

impl SseSplitter {
    /// Appends `bytes` and moves every complete event's payloads to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<String>) {
        self.buf.extend_from_slice(bytes);
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    out.push(d.trim_start().to_owned());
                }
            }
        }
    }
}

/// A response body fed by a channel (a task writes the events).
#[derive(Debug)]
pub struct ChannelBody(pub tokio::sync::mpsc::Receiver<bytes::Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(hyper::body::Frame::data(b))))
    }
}

/// One event carrying `payload`.
pub fn event(payload: &str) -> bytes::Bytes {
    bytes::Bytes::from(format!("data: {payload}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_splitter_handles_events_split_anywhere() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut s = SseSplitter::default();
            let mut out = Vec::new();
            s.push(&stream[..cut], &mut out);
            s.push(&stream[cut..], &mut out);
            assert_eq!(out, vec!["{\"a\":1}", "{\"b\":2}", "[DONE]"], "cut at {cut}");
        }
    }
}
