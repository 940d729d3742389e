//! Server-sent events as the engines and the gateway write them: `data: <payload>\n\n`.

/// Splits an SSE byte stream, cut anywhere, into its events' `data` payloads, as the SSE spec
/// reads it: lines end at CRLF, LF or CR (an engine may write any of them), an empty line ends an
/// event, an event's `data:` lines join with `\n`, one space after the colon is dropped, and
/// comments (`:`) and other fields are ignored.
#[derive(Debug, Default)]
pub struct SseSplitter {
    buf: Vec<u8>,
    /// The data of the event being read, once it has a `data:` line.
    data: Option<String>,
    /// The last line ended with a CR at the end of what came: an LF next is its CRLF's.
    skip_lf: bool,
}

impl SseSplitter {
    /// Appends `bytes` and moves every complete event's payload to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<String>) {
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        if self.skip_lf && !self.buf.is_empty() {
            self.skip_lf = false;
            if self.buf[0] == b'\n' {
                start = 1;
            }
        }
        while let Some(i) = self.buf[start..].iter().position(|&b| b == b'\r' || b == b'\n') {
            let end = start + i;
            let eol = match (self.buf[end], self.buf.get(end + 1)) {
                (b'\r', Some(b'\n')) => 2,
                (b'\r', None) => {
                    // A CR that may be the first half of a CRLF cut between two reads.
                    self.skip_lf = true;
                    1
                }
                _ => 1,
            };
            let line = &self.buf[start..end];
            if line.is_empty() {
                out.extend(self.data.take());
            } else if let Some(v) = line.strip_prefix(b"data:") {
                let v = String::from_utf8_lossy(v.strip_prefix(b" ").unwrap_or(v));
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(&v);
                    }
                    None => self.data = Some(v.into_owned()),
                }
            }
            start = end + eol;
        }
        self.buf.drain(..start);
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

/// One event carrying `payload` (a payload of several lines as that many `data:` lines, which a
/// reader joins back with `\n`).
pub fn event(payload: &str) -> bytes::Bytes {
    let mut out = String::with_capacity(payload.len() + 8);
    for line in payload.split('\n') {
        out.push_str("data: ");
        out.push_str(line);
        out.push('\n');
    }
    out.push('\n');
    bytes::Bytes::from(out)
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

    #[test]
    fn sse_splitter_reads_every_line_ending_comments_and_multi_line_data() {
        let expect = vec!["{\"a\":1}", "x\ny", "[DONE]"];
        for eol in ["\n", "\r\n", "\r"] {
            let stream = [
                ": keep-alive",
                "",
                "data: {\"a\":1}",
                "",
                "event: x",
                "data:x",
                "data: y",
                "",
                "data: [DONE]",
                "",
                "",
            ]
            .join(eol);
            let stream = stream.as_bytes();
            for cut in 0..stream.len() {
                let mut s = SseSplitter::default();
                let mut out = Vec::new();
                s.push(&stream[..cut], &mut out);
                s.push(&stream[cut..], &mut out);
                assert_eq!(out, expect, "line ending {eol:?}, cut at {cut}");
            }
        }
        // What `event` writes reads back as it was.
        let mut out = Vec::new();
        SseSplitter::default().push(&event("a\nb"), &mut out);
        SseSplitter::default().push(&event("{}"), &mut out);
        assert_eq!(out, ["a\nb", "{}"]);
        assert_eq!(&event("{}")[..], b"data: {}\n\n");
        // An event not yet ended by an empty line is not given out.
        let (mut s, mut out) = (SseSplitter::default(), Vec::new());
        s.push(b"data: {}\r\n", &mut out);
        assert!(out.is_empty());
    }
}
