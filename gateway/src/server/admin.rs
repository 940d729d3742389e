//! The operator's routes: `/metrics`, `/admin/decoders`, `/admin/names`, `/admin/plugins/reload`. Each decoder's
//! mode contributes its own part through the [`crate::handoff::Handoff`] trait; nothing here knows
//! a mode.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, header};
use serde_json::{Value, json};

use super::{error_response, full};
use crate::api::GatewayError;
use crate::handoff::{BoxError, RespBody};
use crate::pipeline::Gateway;
use crate::telemetry::{DecoderGauges, EndpointHealth, Families, render_endpoints};

/// `GET /metrics`: the Prometheus text exposition.
pub fn metrics(g: &Gateway) -> Response<RespBody> {
    let gauges: Vec<DecoderGauges> = g
        .decoders
        .iter()
        .map(|d| {
            let s = d.queue.stats();
            DecoderGauges {
                name: d.name.clone(),
                capacity: s.capacity,
                reserved: s.in_use,
                waiting: s.waiting,
                waiting_slots: s.waiting_slots,
                oldest_wait: s.oldest_wait,
            }
        })
        .collect();
    let mut text = g.shared.metrics.render(&gauges);
    let endpoints: Vec<EndpointHealth> = g
        .prefills
        .iter()
        .map(|p| ("prefill", &p.name, &*p.health))
        .chain(g.decoders.iter().map(|d| ("decode", &d.name, &d.health)))
        .map(|(pool, name, h)| EndpointHealth {
            pool,
            name: name.clone(),
            healthy: h.healthy(),
            in_flight: h.in_flight(),
            ejections: h.ejected_total.load(Ordering::Relaxed),
        })
        .collect();
    render_endpoints(&mut text, &endpoints);
    let mut families = Families::default();
    for d in &g.decoders {
        d.handoff.metrics(&d.name, &mut families);
    }
    for (name, ips, lookups, failures) in g.shared.client.names().snapshot() {
        let label = format!("name=\"{name}\"");
        families.add(
            "baton_dns_addresses",
            "gauge",
            "Addresses an engine or rank name has now.",
            label.clone(),
            ips.len() as f64,
        );
        families.add(
            "baton_dns_lookups_total",
            "counter",
            "Lookups of an engine or rank name.",
            label.clone(),
            lookups as f64,
        );
        families.add(
            "baton_dns_lookup_failures_total",
            "counter",
            "Lookups of a name that found no address or got no answer.",
            label,
            failures as f64,
        );
    }
    families.render(&mut text);
    if let Some(p) = &g.plugins {
        p.render(&mut text);
    }
    let mut r = Response::new(Full::new(Bytes::from(text)).map_err(|e| -> BoxError { match e {} }).boxed());
    r.headers_mut()
        .insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; version=0.0.4"));
    r
}

/// `/admin/names`: every engine and rank name in use, its addresses now and its lookups.
pub fn names(g: &Gateway) -> Value {
    let names: Vec<Value> = g
        .shared
        .client
        .names()
        .snapshot()
        .into_iter()
        .map(|(name, ips, lookups, failures)| {
            json!({"name": name, "addrs": ips, "lookups": lookups, "lookup_failures": failures})
        })
        .collect();
    json!({"refresh_ms": g.shared.client.names().settings().refresh.as_millis(), "names": names})
}

/// `/admin/decoders`: per decoder, its mode, the admission queue and what the mode reports.
pub async fn decoders(g: &Gateway) -> Value {
    let mut out = Vec::new();
    for d in &g.decoders {
        let s = d.queue.stats();
        let mut v = json!({
            "name": d.name, "handoff": d.mode(), "http": d.http.to_string(), "capacity_slots": s.capacity,
            "reserved_slots": s.in_use, "waiting_requests": s.waiting, "waiting_slots": s.waiting_slots,
            "oldest_wait_ms": s.oldest_wait.map(|w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX)),
        });
        if let (Some(o), Value::Object(mode)) = (v.as_object_mut(), d.handoff.view().await) {
            o.extend(mode);
        }
        out.push(v);
    }
    json!({"decoders": out})
}

/// `POST /admin/plugins/reload`: every plugin from its file; 200 when all loaded, else 422 with
/// each error (the plugins that failed keep their old version).
pub async fn reload_plugins(g: &Gateway) -> Response<RespBody> {
    let Some(p) = g.plugins.clone() else {
        return full(
            404,
            &json!({"error": {"message": "no plugins configured", "type": "invalid_request_error", "param": null, "code": "not_found"}}),
        );
    };
    let results = match tokio::task::spawn_blocking(move || p.reload()).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return full(422, &json!({"reloaded": false, "error": e})),
        Err(e) => return error_response(&GatewayError::Internal(format!("reload task: {e}"))),
    };
    let ok = results.iter().all(Result::is_ok);
    let list: Vec<Value> = results
        .into_iter()
        .map(|r| match r {
            Ok(i) => json!({"name": i.name, "world": i.world, "sha256": i.sha256, "version": i.version}),
            Err(e) => json!({"error": e.to_string()}),
        })
        .collect();
    full(if ok { 200 } else { 422 }, &json!({"reloaded": ok, "plugins": list}))
}

/// `POST /admin/keys/reload`: reads the API keys file again; a file that does not check keeps the
/// keys in force (400 with the reason).
pub fn reload_keys(g: &Gateway) -> Response<RespBody> {
    match &g.keys {
        None => error_response(&GatewayError::NotFound("API keys are off ([auth] keys_file)".into())),
        Some(k) => match k.reload() {
            Ok(n) => {
                tracing::info!(keys = n, "API keys reloaded");
                full(200, &json!({"keys": n}))
            }
            Err(e) => {
                tracing::warn!(error = %e, "API keys file refused; the keys in force stay");
                full(
                    400,
                    &json!({"error": {"message": e, "type": "invalid_request_error", "param": null, "code": "invalid_keys_file"}}),
                )
            }
        },
    }
}
