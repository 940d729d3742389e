//! Prometheus metrics with the `baton_` prefix and bounded labels: per-phase latency histograms,
//! requests by status, and (read at scrape time) per-decoder slot gauges. Written by hand: a few
//! atomics per request, no registry to lock.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

pub mod request_id;

/// Histogram bounds in seconds: 100 µs to 60 s.
const BUCKETS: [f64; 16] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0];

/// The phases of a request. Metrics are indexed by it, so a phase a handoff marks always has its
/// series (no string that a list could lack).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Waiting for the decoder's admission slots.
    Queue,
    /// Pages reserved on every decoder rank (native).
    Reserve,
    /// The prefill leg, to its answer.
    Prefill,
    /// From the prefill's answer until every decoder rank holds the KV.
    KvReady,
    /// The decode leg, to its response headers.
    Decode,
    /// To the first streamed token sent to the client (a handoff that streams before its decode).
    FirstToken,
    /// The whole request, to its response headers.
    Total,
}

impl Phase {
    pub const ALL: [Phase; 7] = [
        Self::Queue,
        Self::Reserve,
        Self::Prefill,
        Self::KvReady,
        Self::Decode,
        Self::FirstToken,
        Self::Total,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queue => "queue",
            Self::Reserve => "reserve",
            Self::Prefill => "prefill",
            Self::KvReady => "kv_ready",
            Self::Decode => "decode",
            Self::FirstToken => "first_token",
            Self::Total => "total",
        }
    }
}

/// Per-phase durations of one request, in the order they were marked; sent back as a
/// `Server-Timing` header and recorded in the metrics.
#[derive(Debug)]
pub struct Timing {
    last: Instant,
    phases: SmallVec<[(Phase, Duration); 8]>,
}

impl Default for Timing {
    fn default() -> Self {
        Self::start()
    }
}

impl Timing {
    pub fn start() -> Self {
        Self { last: Instant::now(), phases: SmallVec::new() }
    }

    /// Ends `phase` now: its duration is the time since the previous mark.
    pub fn mark(&mut self, phase: Phase) {
        let now = Instant::now();
        self.phases.push((phase, now - self.last));
        self.last = now;
    }

    /// Records a phase that ran beside the others (a leg sent concurrently).
    pub fn record(&mut self, phase: Phase, d: Duration) {
        self.phases.push((phase, d));
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
            let _ = write!(s, "{};dur={:.3}", p.as_str(), d.as_secs_f64() * 1e3);
        }
        s
    }
}

#[derive(Debug, Default)]
struct Histogram {
    /// Observations per bucket (not cumulative: one increment per observation; summed at render).
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(b) = BUCKETS.iter().position(|bound| s <= *bound).and_then(|i| self.buckets.get(i)) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

/// The gateway's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    phases: [Histogram; Phase::ALL.len()],
    /// Requests answered, by HTTP status (a closed set: the statuses the gateway produces).
    by_status: Mutex<BTreeMap<u16, u64>>,
}

/// Per-decoder values read at scrape time.
#[derive(Debug, Clone)]
pub struct DecoderGauges {
    pub name: String,
    pub capacity: u32,
    pub reserved: u32,
    pub waiting: usize,
    pub waiting_slots: u64,
    pub oldest_wait: Option<Duration>,
}

impl Metrics {
    /// Records a phase duration.
    pub fn phase(&self, phase: Phase, d: Duration) {
        if let Some(h) = self.phases.get(phase as usize) {
            h.observe(d);
        }
    }

    /// Records every phase of a request.
    pub fn record(&self, timing: &Timing) {
        for (p, d) in timing.phases() {
            self.phase(*p, *d);
        }
    }

    pub fn answered(&self, status: u16) {
        *self.by_status.lock().unwrap_or_else(|e| e.into_inner()).entry(status).or_default() += 1;
    }

    /// The Prometheus text exposition.
    pub fn render(&self, decoders: &[DecoderGauges]) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "# HELP baton_phase_seconds Time spent in each phase of a request.");
        let _ = writeln!(o, "# TYPE baton_phase_seconds histogram");
        for (name, h) in Phase::ALL.iter().map(|p| p.as_str()).zip(&self.phases) {
            let mut cumulative = 0;
            for (b, bound) in h.buckets.iter().zip(BUCKETS) {
                cumulative += b.load(Ordering::Relaxed);
                let _ =
                    writeln!(o, "baton_phase_seconds_bucket{{phase=\"{name}\",le=\"{bound}\"}} {cumulative}");
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(o, "baton_phase_seconds_bucket{{phase=\"{name}\",le=\"+Inf\"}} {count}");
            let _ = writeln!(
                o,
                "baton_phase_seconds_sum{{phase=\"{name}\"}} {}",
                h.sum_us.load(Ordering::Relaxed) as f64 / 1e6
            );
            let _ = writeln!(o, "baton_phase_seconds_count{{phase=\"{name}\"}} {count}");
        }
        let _ = writeln!(o, "# HELP baton_requests_total Requests answered, by HTTP status.");
        let _ = writeln!(o, "# TYPE baton_requests_total counter");
        for (status, n) in self.by_status.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(o, "baton_requests_total{{status=\"{status}\"}} {n}");
        }
        type Gauge = (&'static str, &'static str, fn(&DecoderGauges) -> f64);
        let gauges: [Gauge; 5] = [
            (
                "baton_decoder_slots_capacity",
                "Slots (PD buffer pages) the decoder's data plane reports.",
                |d| f64::from(d.capacity),
            ),
            ("baton_decoder_slots_reserved", "Slots held by admitted requests.", |d| f64::from(d.reserved)),
            ("baton_decoder_waiting_requests", "Requests waiting for slots.", |d| d.waiting as f64),
            ("baton_decoder_waiting_slots", "Slots the waiting requests need.", |d| d.waiting_slots as f64),
            ("baton_decoder_oldest_wait_seconds", "How long the oldest waiter has waited.", |d| {
                d.oldest_wait.map_or(0.0, |w| w.as_secs_f64())
            }),
        ];
        for (metric, help, get) in gauges {
            let _ = writeln!(o, "# HELP {metric} {help}");
            let _ = writeln!(o, "# TYPE {metric} gauge");
            for d in decoders {
                let _ = writeln!(o, "{metric}{{decoder=\"{}\"}} {}", d.name, get(d));
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_counts_add_up() {
        let m = Metrics::default();
        m.phase(Phase::Queue, Duration::from_micros(50));
        m.phase(Phase::Queue, Duration::from_millis(3));
        m.answered(200);
        m.answered(200);
        m.answered(413);
        let text = m.render(&[]);
        assert!(text.contains("baton_phase_seconds_bucket{phase=\"queue\",le=\"0.0001\"} 1"), "{text}");
        assert!(text.contains("baton_phase_seconds_bucket{phase=\"queue\",le=\"0.005\"} 2"), "{text}");
        assert!(text.contains("baton_phase_seconds_count{phase=\"queue\"} 2"));
        assert!(text.contains("baton_phase_seconds_count{phase=\"total\"} 0"));
        assert!(text.contains("baton_requests_total{status=\"200\"} 2"));
        assert!(text.contains("baton_requests_total{status=\"413\"} 1"));
    }
}

/// One engine's health, read at scrape time.
#[derive(Clone, Debug)]
pub struct EndpointHealth {
    /// `prefill` or `decode`.
    pub pool: &'static str,
    pub name: String,
    pub healthy: bool,
    pub in_flight: u32,
    pub ejections: u64,
}

/// Appends one metric family to a scrape: its HELP and TYPE lines, then one sample per
/// `(labels, value)` (labels as `k="v",…` without braces; empty for none).
pub fn family<V: std::fmt::Display>(
    o: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    samples: impl IntoIterator<Item = (String, V)>,
) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
    for (labels, v) in samples {
        if labels.is_empty() {
            let _ = writeln!(o, "{name} {v}");
        } else {
            let _ = writeln!(o, "{name}{{{labels}}} {v}");
        }
    }
}

/// Appends the per-endpoint health series to a rendered scrape.
pub fn render_endpoints(o: &mut String, endpoints: &[EndpointHealth]) {
    type Series = (&'static str, &'static str, &'static str, fn(&EndpointHealth) -> f64);
    let series: [Series; 3] = [
        (
            "baton_endpoint_healthy",
            "gauge",
            "1 when the engine is routable (not ejected, health check passing).",
            |e| {
                if e.healthy { 1.0 } else { 0.0 }
            },
        ),
        ("baton_endpoint_in_flight", "gauge", "Prefill requests in flight on the engine.", |e| {
            f64::from(e.in_flight)
        }),
        ("baton_endpoint_ejections_total", "counter", "Passive ejections after consecutive failures.", |e| {
            e.ejections as f64
        }),
    ];
    for (metric, kind, help, get) in series {
        let samples =
            endpoints.iter().map(|e| (format!("pool=\"{}\",endpoint=\"{}\"", e.pool, e.name), get(e)));
        family(o, metric, kind, help, samples);
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
        let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
        let _ = match self.format {
            LogFormat::Text => b.try_init(),
            LogFormat::Json => b.json().flatten_event(true).try_init(),
        };
    }
}

/// Metric families gathered at scrape time from many sources (each decoder's handoff); a sample
/// reported by several of them (a counter they share) is written once.
#[derive(Debug, Default)]
pub struct Families {
    map: BTreeMap<&'static str, Family>,
}

#[derive(Debug)]
struct Family {
    kind: &'static str,
    help: &'static str,
    samples: BTreeMap<String, f64>,
}

impl Families {
    /// One sample (`labels` as `k="v",…` without braces; empty for none).
    pub fn add(
        &mut self,
        name: &'static str,
        kind: &'static str,
        help: &'static str,
        labels: String,
        v: f64,
    ) {
        self.map
            .entry(name)
            .or_insert_with(|| Family { kind, help, samples: BTreeMap::new() })
            .samples
            .insert(labels, v);
    }

    /// Appends every family.
    pub fn render(&self, o: &mut String) {
        for (name, f) in &self.map {
            family(o, name, f.kind, f.help, f.samples.iter().map(|(l, v)| (l.clone(), *v)));
        }
    }
}
