//! Log lines name the request they are logged in: `request{id=…}:` in text, `span` and `spans`
//! in JSON, the lines `tracing-subscriber` wrote when each request ran inside a `tracing` span
//! named `request` with an `id` field. The id is now read from the task-local the request runs in
//! ([`request_id::current`]) when a line is written, and no span is made.
//!
//! Why: the span cost every request 2.1k instructions whether a line was logged in it or not (in
//! the proxy benchmark, at the default `info`, none is): made in the registry's slab, its fields
//! formatted into a string when made, entered and left at each poll of the request, closed
//! (`scripts/count-instructions`, vllm-nixl at 138k a request).
//!
//! A line logged outside a request is written by `tracing-subscriber`'s own formatters, as
//! before; inside one, a unit test compares the lines with those the span gave, byte for byte
//! (colours aside: on a terminal, the request's name is bold and the level coloured, as there).

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::registry::LookupSpan;

use super::request_id;

/// Text lines: `tracing-subscriber`'s `Full` format, with the request's `request{id=…}:` after
/// the level.
#[derive(Debug)]
pub struct Text<T = SystemTime> {
    timer: T,
    /// Outside a request: the whole line.
    whole: format::Format<format::Full, T>,
    /// Inside one: what follows the request's name.
    rest: format::Format<format::Full, ()>,
}

impl Text {
    pub fn new() -> Self {
        Self::with_timer(SystemTime)
    }
}

impl Default for Text {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: FormatTime + Clone> Text<T> {
    pub fn with_timer(timer: T) -> Self {
        Self {
            whole: format::format().with_timer(timer.clone()),
            rest: format::format().without_time().with_level(false),
            timer,
        }
    }
}

impl<S, N, T> FormatEvent<S, N> for Text<T>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    T: FormatTime,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let Some(id) = in_request(event) else { return self.whole.format_event(ctx, w, event) };
        let ansi = w.has_ansi_escapes();
        if ansi {
            w.write_str("\x1b[2m")?;
        }
        if self.timer.format_time(&mut w).is_err() {
            w.write_str("<unknown time>")?;
        }
        if ansi {
            w.write_str("\x1b[0m")?;
        }
        w.write_char(' ')?;
        w.write_str(level(event.metadata().level(), ansi))?;
        if ansi {
            write!(
                w,
                " \x1b[1mrequest{{\x1b[0m\x1b[3mid\x1b[0m\x1b[2m=\x1b[0m{id}\x1b[1m}}\x1b[0m\x1b[2m:\x1b[0m"
            )?;
        } else {
            write!(w, " request{{id={id}}}:")?;
        }
        // Spans entered inside the request (h2's, at `trace`) follow it, as they did inside its
        // span: `request{id=…}:send_data{sz=5}: `; the rest writes them and the space.
        if ctx.event_scope().is_none() {
            w.write_char(' ')?;
        }
        self.rest.format_event(ctx, w, event)
    }
}

/// The id of the request `event` is logged in: none for an event made a root of its own
/// (`parent: None`), which the text format wrote without the request's span either.
fn in_request(event: &Event<'_>) -> Option<request_id::RequestId> {
    if event.is_root() { None } else { request_id::current() }
}

/// A level as `tracing-subscriber` writes it: five characters, coloured on a terminal.
fn level(l: &Level, ansi: bool) -> &'static str {
    match (*l, ansi) {
        (Level::TRACE, false) => "TRACE",
        (Level::DEBUG, false) => "DEBUG",
        (Level::INFO, false) => " INFO",
        (Level::WARN, false) => " WARN",
        (Level::ERROR, false) => "ERROR",
        (Level::TRACE, true) => "\x1b[35mTRACE\x1b[0m",
        (Level::DEBUG, true) => "\x1b[34mDEBUG\x1b[0m",
        (Level::INFO, true) => "\x1b[32m INFO\x1b[0m",
        (Level::WARN, true) => "\x1b[33m WARN\x1b[0m",
        (Level::ERROR, true) => "\x1b[31mERROR\x1b[0m",
    }
}

/// JSON lines: `tracing-subscriber`'s JSON format with the event's fields flattened, and inside a
/// request its `"span":{"id":…,"name":"request"}` and `"spans":[…]` last, where that format put
/// the current span and the list of them.
#[derive(Debug)]
pub struct Json<T = SystemTime> {
    whole: format::Format<format::Json, T>,
    /// Inside a request: the line less its spans.
    rest: format::Format<format::Json, T>,
}

impl Json {
    pub fn new() -> Self {
        Self::with_timer(SystemTime)
    }
}

impl Default for Json {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: FormatTime + Clone> Json<T> {
    pub fn with_timer(timer: T) -> Self {
        let json = || format::format().with_timer(timer.clone()).json().flatten_event(true);
        Self { whole: json(), rest: json().with_current_span(false).with_span_list(false) }
    }
}

impl<S, N, T> FormatEvent<S, N> for Json<T>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    T: FormatTime,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        // Not `in_request`: `tracing-subscriber`'s JSON gives an event made a root the spans
        // current where it is logged, the request's among them.
        let Some(id) = request_id::current() else { return self.whole.format_event(ctx, w, event) };
        let id = serde_json::to_string(id.as_str()).map_err(|_| fmt::Error)?;
        let span = format!(r#"{{"id":{id},"name":"request"}}"#);
        let mut line = String::new();
        if event.parent().is_some() || ctx.lookup_current().is_some() {
            // Spans entered inside the request (h2's, at `trace`): the innermost is `span`, and
            // the request heads `spans`, as when it was a span too. A key's quotes are never
            // escaped, and `spans` is the last key: its list is found from the end.
            // (A parent span already closed, with none current, gives no list: then as below.)
            self.whole.format_event(ctx, Writer::new(&mut line), event)?;
            const LIST: &str = r#""spans":["#;
            if let Some(at) = line.rfind(LIST) {
                line.insert_str(at + LIST.len(), &format!("{span},"));
                return w.write_str(&line);
            }
            line.clear();
        }
        self.rest.format_event(ctx, Writer::new(&mut line), event)?;
        // The object is closed last, then the line: the spans go before its `}`.
        let open = line.strip_suffix("}\n").ok_or(fmt::Error)?;
        let comma = if open.ends_with('{') { "" } else { "," };
        writeln!(w, r#"{open}{comma}"span":{span},"spans":[{span}]}}"#)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::MakeWriter;

    use super::*;
    use crate::telemetry::request_id::{RequestId, scope_sync};

    /// The same time in every line.
    #[derive(Clone)]
    struct Fixed;

    impl FormatTime for Fixed {
        fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
            w.write_str("2026-11-29T10:00:00.000000Z")
        }
    }

    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(b);
            Ok(b.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Lines {
        type Writer = Self;

        fn make_writer(&'a self) -> Self {
            self.clone()
        }
    }

    impl Lines {
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)).into()
        }
    }

    /// Lines logged outside a request, then in request `id`, as the gateway logs them.
    fn log(id: &'static str) {
        tracing::info!(port = 8000, "outside");
        let id = RequestId::from_header(Some(&hyper::header::HeaderValue::from_static(id)));
        scope_sync(id, || {
            tracing::info!(status = 200, ms = 1.5, "answered");
            tracing::warn!(reason = "a \"quoted\" reason", "request refused");
            tracing::debug!(tenant = %"t-1", "queued");
            tracing::error!("no fields");
            inner();
        });
    }

    /// Lines in a span inside the request, and one made a root of its own.
    fn inner() {
        let span = tracing::debug_span!("send_data", sz = 5);
        let _in = span.enter();
        tracing::debug!(frame = "data", "queued frame");
        tracing::info!(parent: None, "a root");
    }

    /// The same lines with the request's `tracing` span, as before.
    fn log_in_span(id: &str) {
        tracing::info!(port = 8000, "outside");
        let span = tracing::info_span!("request", id = %id);
        let _in = span.enter();
        tracing::info!(status = 200, ms = 1.5, "answered");
        tracing::warn!(reason = "a \"quoted\" reason", "request refused");
        tracing::debug!(tenant = %"t-1", "queued");
        tracing::error!("no fields");
        inner();
    }

    #[test]
    fn text_lines_are_those_the_span_gave() {
        let (now, before) = (Lines::default(), Lines::default());
        let sub =
            |w: Lines| tracing_subscriber::fmt().with_max_level(Level::DEBUG).with_ansi(false).with_writer(w);
        tracing::subscriber::with_default(
            sub(now.clone()).event_format(Text::with_timer(Fixed)).finish(),
            || {
                log("plain-1");
            },
        );
        tracing::subscriber::with_default(sub(before.clone()).with_timer(Fixed).finish(), || {
            log_in_span("plain-1");
        });
        assert_eq!(now.text(), before.text());
        assert!(now.text().contains(" INFO request{id=plain-1}: "), "{}", now.text());
        assert!(now.text().contains("DEBUG request{id=plain-1}:send_data{sz=5}: "), "{}", now.text());
    }

    #[test]
    fn json_lines_are_those_the_span_gave() {
        let (now, before) = (Lines::default(), Lines::default());
        let sub =
            |w: Lines| tracing_subscriber::fmt().with_max_level(Level::DEBUG).with_ansi(false).with_writer(w);
        tracing::subscriber::with_default(
            sub(now.clone()).json().flatten_event(true).event_format(Json::with_timer(Fixed)).finish(),
            || log("log-me-1"),
        );
        tracing::subscriber::with_default(
            sub(before.clone()).with_timer(Fixed).json().flatten_event(true).finish(),
            || log_in_span("log-me-1"),
        );
        assert_eq!(now.text(), before.text());
        let lines: Vec<serde_json::Value> =
            now.text().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 7);
        assert!(lines[0].get("span").is_none());
        assert_eq!(lines[1]["span"], serde_json::json!({"id": "log-me-1", "name": "request"}));
        assert_eq!(lines[5]["span"], serde_json::json!({"name": "send_data", "sz": 5}));
        assert_eq!(lines[5]["spans"][0], lines[1]["span"]);
        assert_eq!(lines[6]["spans"][0], lines[1]["span"], "a root, in JSON, in the spans current");
    }

    /// On a terminal the level is coloured and the request's name bold; the words are the same.
    #[test]
    fn coloured_text_lines_say_the_same() {
        let out = Lines::default();
        let sub = tracing_subscriber::fmt()
            .with_ansi(true)
            .with_writer(out.clone())
            .event_format(Text::with_timer(Fixed))
            .finish();
        tracing::subscriber::with_default(sub, || log("colour-1"));
        let text = out.text();
        assert!(text.contains("\x1b[32m INFO\x1b[0m"), "{text:?}");
        let plain: String = {
            let mut s = String::new();
            let mut esc = false;
            for c in text.chars() {
                match (esc, c) {
                    (false, '\x1b') => esc = true,
                    (true, 'm') => esc = false,
                    (false, c) => s.push(c),
                    _ => {}
                }
            }
            s
        };
        assert!(plain.contains("2026-11-29T10:00:00.000000Z  INFO request{id=colour-1}: "), "{plain}");
    }
}
