//! Admission by token budget: each tenant (API key) may spend `tokens_per_minute` tokens a minute,
//! counted as prompt tokens plus `max_tokens` when admitted; what the answer did not use is given
//! back when it ends. Tenants have priority classes; a class-0 request queues only briefly when the
//! decoders have no room. With the gateway's flow control on, requests in `unmetered_bands` (e.g.
//! a sheddable best-effort band) are admitted in class 0 without touching the budget. The JavaScript and Python versions in `plugins/js` and `plugins/python`
//! decide exactly the same (checked by the gateway's tests).

use std::cell::RefCell;
use std::collections::HashMap;

use serde::Deserialize;

wit_bindgen::generate!({ world: "admission", path: "../../../wit" });

use baton::policy::host;
use baton::policy::types::Request;
use exports::baton::policy::admission_policy::{Decision, Guest, QueueState, Queued, Rejection, Usage};

#[derive(Deserialize, Default, Clone)]
#[serde(deny_unknown_fields)]
struct Tenant {
    tokens_per_minute: Option<u32>,
    priority: Option<u8>,
}

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields, default)]
struct Config {
    tokens_per_minute: u32,
    default_max_tokens: u32,
    low_priority_max_wait_ms: u32,
    tenants: HashMap<String, Tenant>,
    unmetered_bands: Vec<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            tokens_per_minute: 60_000,
            default_max_tokens: 256,
            low_priority_max_wait_ms: 2_000,
            tenants: HashMap::new(),
            unmetered_bands: Vec::new(),
        }
    }
}

fn parse(json: &str) -> Result<Config, String> {
    let c: Config = serde_json::from_str(json).map_err(|e| format!("token-budget config: {e}"))?;
    if c.tokens_per_minute == 0 {
        return Err("token-budget config: tokens_per_minute must be above 0".into());
    }
    for (name, t) in &c.tenants {
        if t.tokens_per_minute == Some(0) {
            return Err(format!("token-budget config: tenant {name}: tokens_per_minute must be above 0"));
        }
        if t.priority.is_some_and(|p| p > 7) {
            return Err(format!("token-budget config: tenant {name}: priority must be 0-7"));
        }
    }
    Ok(c)
}

thread_local! {
    static CONFIG: RefCell<Option<Config>> = const { RefCell::new(None) };
}

/// The config, parsed once per instance (the host hands every instance of a version the same).
fn config() -> Config {
    CONFIG.with(|c| {
        c.borrow_mut()
            .get_or_insert_with(|| match parse(&host::config()) {
                Ok(c) => c,
                Err(e) => {
                    host::log(host::Level::Error, &e);
                    Config::default()
                }
            })
            .clone()
    })
}

fn tenant(req: &Request) -> &str {
    if req.tenant.is_empty() { "anonymous" } else { &req.tenant }
}

/// Whether flow control put the request in a band the budget does not count.
fn unmetered(req: &Request, c: &Config) -> bool {
    req.band.as_ref().is_some_and(|b| c.unmetered_bands.iter().any(|u| u == b))
}

fn max_tokens(req: &Request, c: &Config) -> u32 {
    if req.max_tokens > 0 { req.max_tokens } else { c.default_max_tokens }
}

struct Policy;

impl Guest for Policy {
    fn validate_config(config: String) -> Result<(), String> {
        parse(&config).map(|_| ())
    }

    fn admit(req: Request, queue: QueueState) -> Decision {
        let c = config();
        if unmetered(&req, &c) {
            return Decision::Admit(0);
        }
        let name = tenant(&req);
        let t = c.tenants.get(name).cloned().unwrap_or_default();
        let tpm = t.tokens_per_minute.unwrap_or(c.tokens_per_minute);
        let mut class = t.priority.unwrap_or(0);
        if req.priority.as_deref() == Some("low") {
            class = 0;
        }
        let cost = req.prompt_tokens.saturating_add(max_tokens(&req, &c));
        if cost > tpm {
            return Decision::Reject(Rejection {
                status: 400,
                message: format!(
                    "request needs {cost} tokens, more than tenant {name}'s budget of {tpm} tokens per minute"
                ),
                retry_after_s: None,
            });
        }
        let s = host::bucket_take(&format!("tpm/{name}"), tpm, tpm, cost);
        if !s.taken {
            return Decision::Reject(Rejection {
                status: 429,
                message: format!("tenant {name} is over its budget of {tpm} tokens per minute"),
                retry_after_s: Some(s.retry_after_ms.div_ceil(1000).max(1)),
            });
        }
        if class == 0 && queue.free_slots < req.slots {
            return Decision::Queue(Queued { priority: 0, max_wait_ms: c.low_priority_max_wait_ms });
        }
        Decision::Admit(class)
    }

    fn on_complete(req: Request, usage: Usage) {
        let c = config();
        if unmetered(&req, &c) {
            return;
        }
        let unused = max_tokens(&req, &c).saturating_sub(usage.completion_tokens);
        if unused > 0 {
            host::bucket_give(&format!("tpm/{}", tenant(&req)), unused);
        }
    }
}

export!(Policy);
