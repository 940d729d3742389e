//! Admission from an engine's own Prometheus metrics, for the modes whose decoder the gateway cannot
//! reserve on (`vllm-nixl`, `sglang`): up to `max_in_flight` requests while the decoder's KV usage
//! is under `kv_usage_high` and fewer than `max_waiting` requests wait in its scheduler; closed
//! (no new request admitted, those in flight finish) otherwise.
//!
//! A decoder URL may front several engines (data parallel: vLLM labels them `engine`, SGLang
//! `dp_rank`) and each engine may report from every tensor-parallel rank (SGLang's `tp_rank`). The
//! usage is the mean over engines (each engine's buffer is its own: summing made a two-engine
//! decoder look full at half its use), the waiting requests the sum over engines, and the samples
//! of one engine's TP ranks count once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;

use super::shared::{AbortOnDrop, Shared};
use crate::admission::SlotQueue;
use crate::endpoints::EngineUrl;
use crate::telemetry::Scrape;

/// Requests in flight on one decoder when its metrics allow more.
pub const DEFAULT_MAX_IN_FLIGHT: u32 = 256;
/// KV cache usage (0..1) from which no new request is admitted.
pub const DEFAULT_KV_USAGE_HIGH: f64 = 0.95;
/// Requests waiting in the decoder's own scheduler from which no new request is admitted.
pub const DEFAULT_MAX_WAITING: u64 = 8;
/// How often the decoder's metrics are read.
pub const DEFAULT_SCRAPE_INTERVAL: Duration = Duration::from_millis(200);
/// Shortest deadline of one read of the metrics.
const MIN_SCRAPE_TIMEOUT: Duration = Duration::from_millis(500);
/// Reads that may fail in a row before what the last one said is too old to admit by: the
/// decoder then counts as full (closed) until a read succeeds, as the Gateway API Inference
/// Extension counts stale metrics as saturated.
pub const STALE_AFTER_INTERVALS: u32 = 5;
/// The least time before metrics are stale, whatever the interval.
const MIN_STALE_AFTER: Duration = Duration::from_secs(1);

impl LoadTarget {
    /// How old the last good read may be before the decoder counts as full.
    pub fn stale_after(&self) -> Duration {
        (self.scrape_interval * STALE_AFTER_INTERVALS).max(MIN_STALE_AFTER)
    }
}

/// A decoder's admission settings.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadTarget {
    pub max_in_flight: u32,
    pub kv_usage_high: f64,
    pub max_waiting: u64,
    pub scrape_interval: Duration,
}

impl Default for LoadTarget {
    fn default() -> Self {
        Self {
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            kv_usage_high: DEFAULT_KV_USAGE_HIGH,
            max_waiting: DEFAULT_MAX_WAITING,
            scrape_interval: DEFAULT_SCRAPE_INTERVAL,
        }
    }
}

/// Admission of a decoder from its own metrics, as written (`[decode.nixl]`, `[decode.sglang]`).
#[derive(Debug, Clone, Copy, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoadKeys {
    /// Requests in flight when its metrics allow (default [`DEFAULT_MAX_IN_FLIGHT`]).
    pub max_in_flight: u32,
    /// KV cache usage (0..1) that closes admission (default [`DEFAULT_KV_USAGE_HIGH`]).
    pub kv_usage_high: f64,
    /// Waiting requests that close admission (default [`DEFAULT_MAX_WAITING`]).
    pub max_waiting: u64,
    /// How often `/metrics` is read, ms (default [`DEFAULT_SCRAPE_INTERVAL`]).
    pub scrape_interval_ms: u64,
}

impl Default for LoadKeys {
    fn default() -> Self {
        let t = LoadTarget::default();
        Self {
            max_in_flight: t.max_in_flight,
            kv_usage_high: t.kv_usage_high,
            max_waiting: t.max_waiting,
            scrape_interval_ms: u64::try_from(t.scrape_interval.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

impl LoadKeys {
    /// Checked, as the pool's table `table` (`nixl`, `sglang`).
    pub fn check(&self, cx: &super::CheckContext<'_>, table: &str) -> Result<LoadTarget, super::KeyError> {
        if self.max_in_flight == 0 {
            return Err(cx.err(&format!("{table}.max_in_flight"), "must be greater than 0"));
        }
        if !(self.kv_usage_high > 0.0 && self.kv_usage_high <= 1.0) {
            return Err(cx.err(
                &format!("{table}.kv_usage_high"),
                format!("{} must be in (0, 1]", self.kv_usage_high),
            ));
        }
        if self.scrape_interval_ms == 0 {
            return Err(cx.err(&format!("{table}.scrape_interval_ms"), "must be greater than 0"));
        }
        Ok(LoadTarget {
            max_in_flight: self.max_in_flight,
            kv_usage_high: self.kv_usage_high,
            max_waiting: self.max_waiting,
            scrape_interval: Duration::from_millis(self.scrape_interval_ms),
        })
    }
}

impl LoadTarget {
    /// The settings in a line, for `baton check-config`.
    pub fn describe(&self) -> String {
        format!(
            "up to {} in flight while KV usage < {} and waiting < {} (metrics every {:?}; none read for {:?}: full)",
            self.max_in_flight,
            self.kv_usage_high,
            self.max_waiting,
            self.scrape_interval,
            self.stale_after()
        )
    }
}

/// The engine's metric names: the usage gauges in order of preference, and the waiting gauge.
#[derive(Clone, Copy, Debug)]
pub struct Gauges {
    pub usage: &'static [&'static str],
    pub waiting: &'static str,
}

/// What the last scrape of a decoder's metrics said.
#[derive(Debug, Default)]
pub struct Load {
    /// KV cache usage in hundredths of a percent.
    pub kv_usage_bp: AtomicU32,
    pub waiting: AtomicU64,
    pub open: AtomicBool,
    /// The last good read is older than [`LoadTarget::stale_after`]: closed until one succeeds.
    pub stale: AtomicBool,
    pub scrapes: AtomicU64,
    pub scrape_failures: AtomicU64,
}

impl Load {
    /// Adds the decoder's `baton_decoder_reported_*` series.
    pub fn metrics(&self, decoder: &str, mode: &str, out: &mut Scrape) {
        let labels = [("decoder", decoder), ("mode", mode)];
        out.gauge(
            "baton_decoder_reported_kv_usage",
            "KV cache usage a decoder's own metrics reported last (0..1; mean over its engines).",
            &labels,
            f64::from(self.kv_usage_bp.load(Ordering::Relaxed)) / 10_000.0,
        );
        out.gauge(
            "baton_decoder_reported_waiting",
            "Requests a decoder's own metrics reported waiting last (sum over its engines).",
            &labels,
            self.waiting.load(Ordering::Relaxed) as f64,
        );
        out.gauge(
            "baton_decoder_admitting",
            "1 while a decoder's own metrics allow new requests.",
            &labels,
            f64::from(u8::from(self.open.load(Ordering::Relaxed))),
        );
        out.gauge(
            "baton_decoder_metrics_stale",
            "1 while a decoder's last good /metrics read is too old to admit by (it counts as full).",
            &labels,
            f64::from(u8::from(self.stale.load(Ordering::Relaxed))),
        );
        out.counter(
            "baton_decoder_scrape_failures_total",
            "Failed reads of a decoder's /metrics.",
            &labels,
            self.scrape_failures.load(Ordering::Relaxed) as f64,
        );
    }
}

/// One sample: its labels and value.
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        let (labels, value) = if let Some(r) = rest.strip_prefix('{') {
            let end = r.rfind('}')?;
            (r.get(..end)?, r.get(end + 1..)?)
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            return None;
        };
        let v = value.split_whitespace().next()?.parse::<f64>().ok()?;
        Some((labels, v))
    })
}

/// The value of label `key` in a label set (`k="v",…`).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// A gauge per engine behind the URL: samples grouped by their `engine` or `dp_rank` label (all in
/// one group without either), the largest of a group's samples (its TP ranks report the same).
fn per_engine(text: &str, name: &str) -> Option<Vec<f64>> {
    let mut groups: BTreeMap<&str, f64> = BTreeMap::new();
    for (labels, v) in samples(text, name) {
        let g = label(labels, "engine").or_else(|| label(labels, "dp_rank")).unwrap_or("");
        let e = groups.entry(g).or_insert(v);
        *e = e.max(v);
    }
    (!groups.is_empty()).then(|| groups.into_values().collect())
}

/// The mean over engines of the first usage gauge the text has.
pub fn usage(text: &str, names: &[&str]) -> Option<f64> {
    names.iter().find_map(|n| per_engine(text, n)).map(|v| v.iter().sum::<f64>() / v.len() as f64)
}

/// The sum over engines of a gauge.
pub fn total(text: &str, name: &str) -> Option<f64> {
    per_engine(text, name).map(|v| v.iter().sum())
}

/// A decoder whose admission follows its own metrics: its address, its settings, what its metrics
/// said last, and the task that reads them (ended when this is dropped).
#[derive(Debug)]
pub struct Scraped {
    pub http: EngineUrl,
    pub target: LoadTarget,
    pub load: Arc<Load>,
    _task: AbortOnDrop,
}

impl Scraped {
    /// `target.max_in_flight` slots of one request each in `queue`, closed while the decoder's
    /// `gauges` say it is full (read every `scrape_interval`).
    pub fn start(
        shared: Arc<Shared>,
        http: EngineUrl,
        target: LoadTarget,
        gauges: Gauges,
        queue: &SlotQueue,
    ) -> Self {
        queue.resize(target.max_in_flight);
        let load = Arc::new(Load::default());
        let task =
            scrape_loop(shared, http.clone(), target.clone(), gauges, queue.clone(), Arc::clone(&load));
        Self { http, target, load, _task: AbortOnDrop(tokio::spawn(task)) }
    }

    /// Adds the decoder's `baton_decoder_reported_*` series.
    pub fn metrics(&self, decoder: &str, mode: &str, out: &mut Scrape) {
        self.load.metrics(decoder, mode, out);
    }
}

async fn scrape_loop(
    shared: Arc<Shared>,
    http: EngineUrl,
    target: LoadTarget,
    gauges: Gauges,
    queue: SlotQueue,
    load: Arc<Load>,
) {
    let mut tick = tokio::time::interval(target.scrape_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_good = tokio::time::Instant::now();
    loop {
        tick.tick().await;
        let Ok(req) = Request::get(http.uri("/metrics")).body(Full::new(Bytes::new())) else {
            return;
        };
        let text = async {
            let r = tokio::time::timeout(
                target.scrape_interval.max(MIN_SCRAPE_TIMEOUT),
                shared.client.send(&http, req),
            )
            .await
            .ok()?
            .ok()?;
            if r.status() != 200 {
                return None;
            }
            let b = r.into_body().collect().await.ok()?.to_bytes();
            Some(String::from_utf8_lossy(&b).into_owned())
        }
        .await;
        load.scrapes.fetch_add(1, Ordering::Relaxed);
        let Some(text) = text else {
            // Unknown state: keep the last decision for a while (one failed read says little);
            // past `stale_after` the decoder counts as full, so nothing is admitted on old news.
            load.scrape_failures.fetch_add(1, Ordering::Relaxed);
            if last_good.elapsed() >= target.stale_after() && !load.stale.swap(true, Ordering::Relaxed) {
                tracing::warn!(decoder = %http, after = ?target.stale_after(), "decoder metrics stale: admitting nothing until a read succeeds");
                load.open.store(false, Ordering::Relaxed);
                queue.set_open(false);
            }
            continue;
        };
        last_good = tokio::time::Instant::now();
        load.stale.store(false, Ordering::Relaxed);
        let usage = usage(&text, gauges.usage).unwrap_or(0.0);
        let waiting = total(&text, gauges.waiting).unwrap_or(0.0);
        let open = usage < target.kv_usage_high && waiting < target.max_waiting as f64;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        load.kv_usage_bp.store((usage * 10_000.0).clamp(0.0, 1e9) as u32, Ordering::Relaxed);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        load.waiting.store(waiting.max(0.0) as u64, Ordering::Relaxed);
        load.open.store(open, Ordering::Relaxed);
        // Closed admits nothing: requests wait in the queue (within their timeouts) until the
        // engine reports room again.
        queue.set_open(open);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_are_read_per_engine_and_ignore_longer_names() {
        // (name, exposition, usage, waiting)
        let cases: [(&str, &str, Option<f64>, Option<f64>); 5] = [
            ("one engine, no labels", "u 0.5\nw 3\nw_total 99\n", Some(0.5), Some(3.0)),
            (
                "vLLM data parallel: usage is the mean, waiting the sum",
                "u{engine=\"0\",model_name=\"m\"} 0.9\nu{engine=\"1\",model_name=\"m\"} 0.1\n\
                 w{engine=\"0\"} 3.0\nw{engine=\"1\"} 2\n",
                Some(0.5),
                Some(5.0),
            ),
            (
                "SGLang: every TP rank of a DP rank reports it once",
                "u{dp_rank=\"0\",tp_rank=\"0\"} 0.4\nu{dp_rank=\"0\",tp_rank=\"1\"} 0.4\n\
                 u{dp_rank=\"1\",tp_rank=\"0\"} 0.2\nu{dp_rank=\"1\",tp_rank=\"1\"} 0.2\n\
                 w{dp_rank=\"0\",tp_rank=\"0\",priority=\"\"} 1\nw{dp_rank=\"0\",tp_rank=\"1\",priority=\"\"} 1\n",
                Some(0.30000000000000004),
                Some(1.0),
            ),
            ("absent", "# TYPE u gauge\nother 1\n", None, None),
            ("a longer name is another metric", "u_total 1\nwaiting 2\n", None, None),
        ];
        for (name, text, u, w) in cases {
            assert_eq!(usage(text, &["u"]), u, "{name}: usage");
            assert_eq!(total(text, "w"), w, "{name}: waiting");
        }
        // The first usage name present wins.
        assert_eq!(usage("b 0.2\na 0.7\n", &["a", "b"]), Some(0.7));
        assert_eq!(usage("b 0.2\n", &["a", "b"]), Some(0.2));
    }
}
