//! What the gateway tells its operator: the phases of a request ([`Timing`], sent back as
//! `Server-Timing`), the metrics ([`metrics`], written by [`scrape`]), request ids and logs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

pub mod logs;
pub mod metrics;
pub mod request_id;
pub mod scrape;
pub mod trace;

pub use metrics::{Live, Metrics, Tracked};
pub use scrape::Scrape;

/// Declares [`Phase`] and its tables from one list, one line per phase: its name in metrics and
/// `Server-Timing`, and whether a request in flight can be in it. `ALL` follows the list's order,
/// which is the enum's, so `ALL[p as usize] == p` holds by construction.
macro_rules! phases {
    (
        $(#[$meta:meta])*
        pub enum Phase {
            $($(#[$vmeta:meta])* $variant:ident => $name:literal, live: $live:literal;)+
        }
    ) => {
        $(#[$meta])*
        pub enum Phase {
            $($(#[$vmeta])* $variant,)+
        }

        impl Phase {
            /// In declaration order: `ALL[p as usize] == p`.
            pub const ALL: [Phase; [$(Phase::$variant),+].len()] = [$(Self::$variant),+];

            /// The phases a request in flight can be in, in declaration order.
            pub const LIVE: [Phase; Phase::LIVE_LEN] = {
                let mut live = [Self::ALL[0]; Phase::LIVE_LEN];
                let (mut i, mut n) = (0, 0);
                while i < Self::ALL.len() {
                    if Self::ALL[i].is_live() {
                        live[n] = Self::ALL[i];
                        n += 1;
                    }
                    i += 1;
                }
                live
            };

            const LIVE_LEN: usize = 0 $(+ $live as usize)+;

            const fn is_live(self) -> bool {
                match self {
                    $(Self::$variant => $live,)+
                }
            }

            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }
        }
    };
}

phases! {
    /// The phases of a request. Metrics are indexed by it, so a phase a handoff marks always has its
    /// series (no string that a list could lack).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum Phase {
        /// Tokens counted, the admission plugin asked, the route chosen.
        Route => "route", live: true;
        /// Waiting for the decoder's admission slots.
        Queue => "queue", live: true;
        /// Pages reserved on every decoder rank (native).
        Reserve => "reserve", live: true;
        /// The prefill leg, to its answer.
        Prefill => "prefill", live: true;
        /// From the prefill's answer until every decoder rank holds the KV.
        KvReady => "kv_ready", live: true;
        /// The decode leg, to its response headers.
        Decode => "decode", live: true;
        /// To the first streamed token sent to the client (a handoff that streams before its decode).
        FirstToken => "first_token", live: false;
        /// The whole request, to its response headers.
        Total => "total", live: false;
        /// From the response headers to the last byte of the body.
        Stream => "stream", live: true;
        /// Waiting in the gateway's flow control for a decoder with room and its turn (`[flow]`;
        /// before `route`, listed last so the older phases keep their indexes).
        Flow => "flow", live: true;
    }
}

#[cfg(test)]
mod phase_tests {
    use super::Phase;

    /// The names are metric labels and `Server-Timing` entries that dashboards read: written out
    /// here by hand, so a change to the list above shows up as a failing test.
    #[test]
    fn phases_keep_their_order_names_and_liveness() {
        let names: Vec<&str> = Phase::ALL.iter().map(|p| p.as_str()).collect();
        assert_eq!(
            names,
            [
                "route",
                "queue",
                "reserve",
                "prefill",
                "kv_ready",
                "decode",
                "first_token",
                "total",
                "stream",
                "flow"
            ]
        );
        for (i, p) in Phase::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i, "{p:?}");
        }
        assert_eq!(
            Phase::LIVE,
            [
                Phase::Route,
                Phase::Queue,
                Phase::Reserve,
                Phase::Prefill,
                Phase::KvReady,
                Phase::Decode,
                Phase::Stream,
                Phase::Flow
            ]
        );
    }

    /// `Server-Timing` gives milliseconds to three places, rounded to the nearest microsecond, as
    /// `{:.3}` of the milliseconds as a float did.
    #[test]
    fn server_timing_is_milliseconds_to_three_places() {
        use std::time::Duration;
        let mut t = super::Timing::start();
        for (p, nanos) in [
            (Phase::Route, 0),
            (Phase::Queue, 499),
            (Phase::Prefill, 163_400),
            (Phase::KvReady, 999_600),
            (Phase::Decode, 12_345_678_901),
        ] {
            t.record(p, Duration::from_nanos(nanos));
        }
        let want =
            "route;dur=0.000, queue;dur=0.000, prefill;dur=0.163, kv_ready;dur=1.000, decode;dur=12345.679";
        assert_eq!(t.header(), want);
        for (_, d) in t.phases() {
            let float = format!("{:.3}", d.as_secs_f64() * 1e3);
            assert!(want.contains(&format!("dur={float}")), "{float}");
        }
    }
}

/// Per-phase durations of one request, in the order they were marked; sent back as a
/// `Server-Timing` header and recorded in the metrics.
#[derive(Debug)]
pub struct Timing {
    last: Instant,
    phases: SmallVec<[(Phase, Duration); 8]>,
    /// The request's entry in the in-flight table, told each phase it enters.
    live: Option<Arc<Live>>,
    /// The request's trace, when it is traced: a span per phase.
    trace: Option<Arc<trace::RequestTrace>>,
    /// Where the driver records the phases, and the decoder's mode they are labelled with.
    recorder: Option<(Arc<Metrics>, &'static str)>,
}

impl Default for Timing {
    fn default() -> Self {
        Self::start()
    }
}

impl Timing {
    pub fn start() -> Self {
        Self { last: Instant::now(), phases: SmallVec::new(), live: None, trace: None, recorder: None }
    }

    /// Timing from now for a request in the in-flight table, and in its trace; what runs on after
    /// the response headers ([`Timing::later`]) is recorded in `metrics` under the decoder's `mode`.
    pub fn tracked(
        live: Option<Arc<Live>>,
        trace: Option<Arc<trace::RequestTrace>>,
        recorder: Option<(Arc<Metrics>, &'static str)>,
    ) -> Self {
        Self { live, trace, recorder, ..Self::start() }
    }

    /// The timing of a part of the request that runs on after the response headers (a streamed
    /// decode, a leg that answers later): from now, shown in the same in-flight entry and trace,
    /// and recorded in the metrics when it is dropped. The mode marks its phases; the driver's
    /// recorder records them.
    pub fn later(&self) -> Later {
        Later(Self {
            live: self.live.clone(),
            trace: self.trace.clone(),
            recorder: self.recorder.clone(),
            ..Self::start()
        })
    }

    /// The request is in `phase` from now (what the in-flight gauges and the stuck-request view
    /// show); its duration is still recorded by [`Timing::mark`] when it ends.
    pub fn enter(&self, phase: Phase) {
        if let Some(l) = &self.live {
            l.enter(phase);
        }
        if let Some(t) = &self.trace {
            t.enter(phase, Instant::now());
        }
    }

    /// Adds a part to the request's decision record.
    pub fn note(&self, part: &'static str, v: impl Fn() -> serde_json::Value + Send + Sync + 'static) {
        if let Some(l) = &self.live {
            l.note(part, v);
        }
    }

    /// Ends `phase` now: its duration (returned) is the time since the previous mark.
    pub fn mark(&mut self, phase: Phase) -> Duration {
        let now = Instant::now();
        let d = now - self.last;
        self.phases.push((phase, d));
        if let Some(t) = &self.trace {
            t.mark(phase, self.last, now);
        }
        self.last = now;
        d
    }

    /// Records a phase that ran beside the others (a leg sent concurrently), ending now; in the
    /// trace too when that is after the request's answer ended ([`trace::RequestTrace::beside`]).
    pub fn record(&mut self, phase: Phase, d: Duration) {
        self.phases.push((phase, d));
        if let Some(t) = &self.trace {
            let now = Instant::now();
            t.beside(phase, now.checked_sub(d).unwrap_or(now), now);
        }
    }

    /// Records the phases in the driver's metrics, under the decoder's mode (nothing for a timing
    /// made without a recorder).
    pub fn record_metrics(&self) {
        if let Some((metrics, mode)) = &self.recorder {
            metrics.record(self, mode);
        }
    }

    pub fn phases(&self) -> &[(Phase, Duration)] {
        &self.phases
    }

    /// The `Server-Timing` header value (milliseconds).
    pub fn header(&self) -> String {
        let mut s = String::with_capacity(self.phases.len() * 24);
        for (i, (p, d)) in self.phases.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            // Milliseconds to the microsecond, written from integers: `write!` of the value as
            // an `f64` to three places took about a thousand instructions a phase, of integers
            // with `{:03}` still 700.
            let us = d
                .as_secs()
                .saturating_mul(1_000_000)
                .saturating_add(u64::from(d.subsec_nanos() + 500) / 1000);
            s.push_str(p.as_str());
            s.push_str(";dur=");
            s.push_str(itoa::Buffer::new().format(us / 1000));
            s.push('.');
            let frac = us % 1000;
            for digit in [frac / 100, frac / 10 % 10, frac % 10] {
                s.push(char::from_digit(u32::try_from(digit).unwrap_or(0), 10).unwrap_or('0'));
            }
        }
        s
    }
}

/// The timing of what runs on after the response headers ([`Timing::later`]); recorded in the
/// metrics when dropped.
#[derive(Debug)]
pub struct Later(Timing);

impl std::ops::Deref for Later {
    type Target = Timing;

    fn deref(&self) -> &Timing {
        &self.0
    }
}

impl std::ops::DerefMut for Later {
    fn deref_mut(&mut self) -> &mut Timing {
        &mut self.0
    }
}

impl Drop for Later {
    fn drop(&mut self) {
        self.0.record_metrics();
    }
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Where logs go and how much.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A `tracing` filter directive (`RUST_LOG` takes precedence when set).
    pub filter: String,
}

/// The log filter when nobody set one.
pub const DEFAULT_LOG_FILTER: &str = "info";

impl Default for LogConfig {
    fn default() -> Self {
        Self { format: LogFormat::Text, filter: DEFAULT_LOG_FILTER.to_owned() }
    }
}

impl LogConfig {
    /// Checks the config's `log_format` and `log_level`; on error, the field and the reason.
    pub fn parse(format: Option<&str>, level: Option<&str>) -> Result<Self, (&'static str, String)> {
        let format = match format.unwrap_or("text") {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => return Err(("log_format", format!("{other:?} is not text or json"))),
        };
        let filter = level.unwrap_or(DEFAULT_LOG_FILTER).to_owned();
        tracing_subscriber::EnvFilter::try_new(&filter)
            .map_err(|e| ("log_level", format!("{filter:?} is not a tracing filter: {e}")))?;
        Ok(Self { format, filter })
    }

    /// Installs the global subscriber (stderr). A second call does nothing.
    pub fn install(&self) {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .or_else(|_| tracing_subscriber::EnvFilter::try_new(&self.filter))
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
        // Colours only on a terminal, and never with `NO_COLOR` set: stderr into a file, a pipe,
        // journald or a container's log got escape codes in every line before (and formatting
        // them was work done for each request's span).
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
            && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        // A line that cannot be written (stderr a pipe whose reader went away) is dropped: the
        // formatter's own report of it goes through `eprintln!`, whose panic would come instead
        // of a drain, or cut a connection's streams.
        let b = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .log_internal_errors(false);
        let _ = match self.format {
            LogFormat::Text => b.event_format(logs::Text::new()).try_init(),
            LogFormat::Json => b.json().flatten_event(true).event_format(logs::Json::new()).try_init(),
        };
    }
}
