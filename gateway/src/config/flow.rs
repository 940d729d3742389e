//! `[flow]`: flow control as written, and its check into [`FlowConfig`].

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, err};
use crate::flow::{
    Band, BudgetRule, Counts, DEFAULT_BAND_MAX_BYTES, DEFAULT_BAND_MAX_REQUESTS, DEFAULT_INPUT_COST,
    DEFAULT_OUTPUT_COST, FlowConfig, TenantRule, Within,
};

/// The one band when `[flow]` lists none.
pub const DEFAULT_BAND: &str = "default";

/// `[flow]`: present, flow control is on.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Flow {
    /// The priority bands (default: one band, [`DEFAULT_BAND`]).
    #[serde(default)]
    pub bands: Vec<BandKeys>,
    /// The band of a request that names none (default: the only band, else required).
    pub default_band: Option<String>,
    /// GIE objective name (`x-gateway-inference-objective`) → band.
    #[serde(default)]
    pub objectives: BTreeMap<String, String>,
    /// Tenants by name: the API key's tenant, the `[admission.tenants]` name, or the fairness id.
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantKeys>,
    /// Tenants not listed in `tenants`.
    #[serde(default)]
    pub tenant_defaults: TenantKeys,
    /// The flow is `x-gateway-inference-fairness-id` when a request has it (default false: only
    /// behind a proxy that sets it; a client could otherwise pick its own fair share).
    #[serde(default)]
    pub trust_fairness_header: bool,
    /// `fcfs` (default) or `edf`: the order inside one flow.
    pub within_flow: Option<Within>,
    /// What an input token costs a tenant's fair-share counter (default [`DEFAULT_INPUT_COST`]).
    pub input_cost: Option<f64>,
    /// What an output token costs (default [`DEFAULT_OUTPUT_COST`]).
    pub output_cost: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandKeys {
    pub name: String,
    /// Higher first; negative: sheddable (never queued, refused first when saturated).
    pub priority: i32,
    /// Requests waiting in the band (default [`DEFAULT_BAND_MAX_REQUESTS`]).
    pub max_requests: Option<usize>,
    /// Bytes of request bodies waiting in the band (default [`DEFAULT_BAND_MAX_BYTES`]).
    pub max_bytes: Option<u64>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TenantKeys {
    /// Its share against the others' (default 1).
    pub weight: Option<f64>,
    /// The highest band it may ask for.
    pub max_band: Option<String>,
    /// Its band when a request names none.
    pub default_band: Option<String>,
    /// Its token budget per minute.
    pub tokens_per_minute: Option<u64>,
    /// What the budget counts: `input`, `output` or `total` (default `total`).
    pub budget_counts: Option<Counts>,
}

impl Flow {
    /// Checked; `max_wait` is the gateway's queue timeout.
    pub fn check(&self, max_wait: Duration) -> Result<FlowConfig, ConfigError> {
        let mut bands: Vec<Band> = if self.bands.is_empty() {
            vec![Band {
                name: DEFAULT_BAND.into(),
                priority: 0,
                max_requests: DEFAULT_BAND_MAX_REQUESTS,
                max_bytes: DEFAULT_BAND_MAX_BYTES,
            }]
        } else {
            let mut v = Vec::new();
            for (i, b) in self.bands.iter().enumerate() {
                let f = format!("flow.bands[{i}]");
                if b.name.is_empty() || b.name.len() > 64 {
                    return Err(err(format!("{f}.name"), "must be 1 to 64 characters"));
                }
                if v.iter().any(|x: &Band| x.name == b.name) {
                    return Err(err(format!("{f}.name"), format!("band {:?} is listed twice", b.name)));
                }
                if v.iter().any(|x: &Band| x.priority == b.priority) {
                    return Err(err(
                        format!("{f}.priority"),
                        format!("{} is another band's priority: bands are strictly ordered", b.priority),
                    ));
                }
                let max_requests = b.max_requests.unwrap_or(DEFAULT_BAND_MAX_REQUESTS);
                let max_bytes = b.max_bytes.unwrap_or(DEFAULT_BAND_MAX_BYTES);
                if max_requests == 0 || max_bytes == 0 {
                    return Err(err(f, "max_requests and max_bytes must be greater than 0"));
                }
                v.push(Band { name: b.name.clone(), priority: b.priority, max_requests, max_bytes });
            }
            v
        };
        bands.sort_by_key(|b| std::cmp::Reverse(b.priority));
        let band = |field: &str, name: &str| {
            bands.iter().position(|b| b.name == name).ok_or_else(|| {
                let known: Vec<&str> = bands.iter().map(|b| b.name.as_str()).collect();
                err(field, format!("no band {name:?} (bands: {})", known.join(", ")))
            })
        };
        let default_band = match &self.default_band {
            Some(n) => band("flow.default_band", n)?,
            None if bands.len() == 1 => 0,
            None => return Err(err("flow.default_band", "required when there is more than one band")),
        };
        if bands.get(default_band).is_some_and(Band::sheddable) {
            return Err(err("flow.default_band", "must not be sheddable (negative priority)"));
        }
        let mut objectives = BTreeMap::new();
        for (o, b) in &self.objectives {
            objectives.insert(o.clone(), band(&format!("flow.objectives.{o}"), b)?);
        }
        let tenant = |field: &str, t: &TenantKeys| -> Result<TenantRule, ConfigError> {
            let weight = t.weight.unwrap_or(1.0);
            if !(weight.is_finite() && weight > 0.0) {
                return Err(err(format!("{field}.weight"), format!("{weight} must be greater than 0")));
            }
            let max_band =
                t.max_band.as_deref().map(|n| band(&format!("{field}.max_band"), n)).transpose()?;
            let default_band =
                t.default_band.as_deref().map(|n| band(&format!("{field}.default_band"), n)).transpose()?;
            let budget = match (t.tokens_per_minute, t.budget_counts) {
                (Some(0), _) => {
                    return Err(err(format!("{field}.tokens_per_minute"), "must be greater than 0"));
                }
                (Some(n), c) => Some(BudgetRule { tokens_per_minute: n, counts: c.unwrap_or(Counts::Total) }),
                (None, Some(_)) => {
                    return Err(err(format!("{field}.budget_counts"), "needs tokens_per_minute"));
                }
                (None, None) => None,
            };
            Ok(TenantRule { weight, max_band, default_band, budget })
        };
        let mut tenants = BTreeMap::new();
        for (name, t) in &self.tenants {
            tenants.insert(name.clone(), tenant(&format!("flow.tenants.{name}"), t)?);
        }
        let cost = |field: &str, v: Option<f64>, d: f64| match v.unwrap_or(d) {
            c if c.is_finite() && c >= 0.0 => Ok(c),
            c => Err(err(field, format!("{c} must be 0 or more"))),
        };
        let input_cost = cost("flow.input_cost", self.input_cost, DEFAULT_INPUT_COST)?;
        let output_cost = cost("flow.output_cost", self.output_cost, DEFAULT_OUTPUT_COST)?;
        if input_cost + output_cost <= 0.0 {
            return Err(err("flow.output_cost", "input_cost and output_cost cannot both be 0"));
        }
        let tenant_defaults = tenant("flow.tenant_defaults", &self.tenant_defaults)?;
        Ok(FlowConfig {
            bands,
            default_band,
            objectives,
            tenants,
            tenant_defaults,
            trust_fairness_header: self.trust_fairness_header,
            within: self.within_flow.unwrap_or(Within::Fcfs),
            input_cost,
            output_cost,
            max_wait,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml_text: &str) -> Result<FlowConfig, ConfigError> {
        let f: Flow = toml::from_str(toml_text).map_err(|e| err("flow", e.to_string()))?;
        f.check(Duration::from_secs(30))
    }

    #[test]
    fn bands_are_ordered_and_names_checked() {
        let c = parse(
            r#"
            bands = [{ name = "batch", priority = 0 }, { name = "interactive", priority = 10 },
                     { name = "scavenger", priority = -1 }]
            default_band = "batch"
            objectives = { premium = "interactive" }
            [tenants.acme]
            weight = 2.0
            max_band = "batch"
            tokens_per_minute = 1000
            "#,
        )
        .unwrap_or_else(|e| unreachable!("{e}"));
        let names: Vec<&str> = c.bands.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["interactive", "batch", "scavenger"]);
        assert_eq!(c.default_band, 1);
        assert_eq!(c.objectives.get("premium"), Some(&0));
        let acme = c.tenants.get("acme").cloned().unwrap_or_default();
        assert_eq!(acme.max_band, Some(1));
        assert_eq!(acme.budget, Some(BudgetRule { tokens_per_minute: 1000, counts: Counts::Total }));

        for (bad, field) in [
            (r#"bands = [{ name = "a", priority = 0 }, { name = "b", priority = 1 }]"#, "flow.default_band"),
            (r#"bands = [{ name = "a", priority = 0 }, { name = "a", priority = 1 }]"#, "flow.bands[1].name"),
            (
                r#"bands = [{ name = "a", priority = 0 }, { name = "b", priority = 0 }]"#,
                "flow.bands[1].priority",
            ),
            (r#"default_band = "nope""#, "flow.default_band"),
            (r#"bands = [{ name = "a", priority = -1 }]"#, "flow.default_band"),
            ("[tenants.x]\nweight = 0.0", "flow.tenants.x.weight"),
            ("[tenants.x]\nmax_band = \"gold\"", "flow.tenants.x.max_band"),
            ("[tenants.x]\nbudget_counts = \"input\"", "flow.tenants.x.budget_counts"),
            ("[tenants.x]\ntokens_per_minute = 0", "flow.tenants.x.tokens_per_minute"),
            ("input_cost = -1.0", "flow.input_cost"),
        ] {
            let e = parse(bad).err().unwrap_or_else(|| unreachable!("{bad} was accepted"));
            assert_eq!(e.field, field, "{bad}: {e}");
        }
    }
}
