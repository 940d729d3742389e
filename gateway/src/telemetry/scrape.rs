//! One scrape of `/metrics`: the registry's families (recorded as requests run) and the series read
//! at scrape time (queue depths, health, the modes' atomic counters, the requests in flight), merged
//! by name and written by the Prometheus client's text encoder, which escapes label values and help
//! text and writes every type's lines. Nothing here formats exposition text.

use std::collections::BTreeMap;

use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Encoder, TextEncoder};

/// The media type of [`Scrape::encode`]'s text.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

/// Families gathered for one scrape.
#[derive(Debug, Default)]
pub struct Scrape {
    families: BTreeMap<String, MetricFamily>,
}

impl Scrape {
    /// A gauge sample. A sample with the same name and labels added again replaces the first (a
    /// value several sources share, such as one listener behind many decoders, is written once).
    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        let mut g = Gauge::default();
        g.set_value(v);
        let mut m = metric(labels);
        m.set_gauge(g);
        self.sample(name, help, MetricType::GAUGE, m);
    }

    /// A counter sample (replaces one with the same name and labels, as [`Scrape::gauge`]).
    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        let mut c = Counter::default();
        c.set_value(v);
        let mut m = metric(labels);
        m.set_counter(c);
        self.sample(name, help, MetricType::COUNTER, m);
    }

    fn sample(&mut self, name: &str, help: &str, kind: MetricType, m: Metric) {
        let f = self.families.entry(name.to_owned()).or_insert_with(|| {
            let mut f = MetricFamily::default();
            f.set_name(name.to_owned());
            f.set_help(help.to_owned());
            f.set_field_type(kind);
            f
        });
        let same = f.get_metric().iter().position(|o| o.get_label() == m.get_label());
        match same {
            Some(i) => {
                if let Some(o) = f.mut_metric().get_mut(i) {
                    *o = m;
                }
            }
            None => f.mut_metric().push(m),
        }
    }

    /// Whole families (a registry's or a collector's); one whose name is already here adds its
    /// samples to it.
    pub fn extend(&mut self, families: impl IntoIterator<Item = MetricFamily>) {
        for mut f in families {
            match self.families.get_mut(f.name()) {
                Some(have) => have.mut_metric().extend(f.take_metric()),
                None => {
                    self.families.insert(f.name().to_owned(), f);
                }
            }
        }
    }

    /// The names of the families gathered, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.families.keys().map(String::as_str)
    }

    /// The Prometheus text exposition (format 0.0.4, [`CONTENT_TYPE`]).
    pub fn encode(self) -> String {
        let families: Vec<MetricFamily> = self.families.into_values().collect();
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&families, &mut out) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// A sample's labels, sorted by name.
fn metric(labels: &[(&str, &str)]) -> Metric {
    let mut pairs: Vec<LabelPair> = labels
        .iter()
        .map(|(k, v)| {
            let mut p = LabelPair::default();
            p.set_name((*k).to_owned());
            p.set_value((*v).to_owned());
            p
        })
        .collect();
    pairs.sort_by(|a, b| a.name().cmp(b.name()));
    let mut m = Metric::default();
    m.set_label(pairs);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_merge_by_name_and_labels_and_values_are_escaped() {
        let mut s = Scrape::default();
        s.counter("baton_x_total", "X.", &[("b", "2"), ("a", "1")], 1.0);
        s.counter("baton_x_total", "X.", &[("a", "1"), ("b", "2")], 5.0);
        s.counter("baton_x_total", "X.", &[("a", "q\"\\\n")], 2.0);
        s.gauge("baton_y", "Y.", &[], 3.0);
        let text = s.encode();
        assert!(text.contains("baton_x_total{a=\"1\",b=\"2\"} 5\n"), "{text}");
        assert!(text.contains("baton_x_total{a=\"q\\\"\\\\\\n\"} 2\n"), "{text}");
        assert_eq!(text.matches("# TYPE baton_x_total counter").count(), 1, "{text}");
        assert!(text.contains("baton_y 3\n"), "{text}");
    }
}
