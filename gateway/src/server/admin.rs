//! The operator's routes: `/metrics`, `/admin/decoders`, `/admin/engines`, `/admin/names`, `/admin/plugins/reload`. Each decoder's
//! mode contributes its own part through the [`crate::handoff::Handoff`] trait; nothing here knows
//! a mode.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, header};
use serde_json::{Value, json};

use super::{error_response, full};
use crate::admission::QueueStats;
use crate::api::GatewayError;
use crate::handoff::{BoxError, RespBody};
use crate::pipeline::Gateway;
use crate::routing::Breaker;
use crate::telemetry::Scrape;
use crate::telemetry::scrape::CONTENT_TYPE;

/// `GET /metrics`: the Prometheus text exposition: the recorded families, then what is read now
/// (each decoder's queue, each engine's health, what each mode reports, names, plugins).
pub fn metrics(g: &Gateway) -> Response<RespBody> {
    let mut s = Scrape::default();
    g.shared.metrics.scrape(&mut s);
    type DecoderGauge = (&'static str, &'static str, fn(&QueueStats) -> f64);
    let gauges: [DecoderGauge; 5] = [
        ("baton_decoder_slots_capacity", "Slots (PD buffer pages) the decoder's data plane reports.", |q| {
            f64::from(q.capacity)
        }),
        ("baton_decoder_slots_reserved", "Slots held by admitted requests.", |q| f64::from(q.in_use)),
        ("baton_decoder_waiting_requests", "Requests waiting for slots.", |q| q.waiting as f64),
        ("baton_decoder_waiting_slots", "Slots the waiting requests need.", |q| q.waiting_slots as f64),
        ("baton_decoder_oldest_wait_seconds", "How long the oldest waiter has waited.", |q| {
            q.oldest_wait.map_or(0.0, |w| w.as_secs_f64())
        }),
    ];
    if let Some(f) = &g.flow {
        f.metrics(&mut s, |t| g.shared.metrics.tenant_label(t));
    }
    if let Some(c) = &g.cluster {
        c.metrics(&mut s);
    }
    let engines = g.shared.client.reloads().map(|c| ("engines".to_owned(), c));
    let dataplane = g.dataplane_certs().into_iter().map(|c| (c.name().to_owned(), c.counts()));
    let listeners = g.tls.get().into_iter().flatten().map(|(l, c)| (l.clone(), std::sync::Arc::clone(c)));
    for (tls, c) in listeners.chain(engines).chain(dataplane) {
        let tls = tls.as_str();
        for (result, n) in [("swapped", &c.swapped), ("refused", &c.refused)] {
            let n = n.load(Ordering::Relaxed);
            s.counter(
                "baton_tls_reloads_total",
                "Reloads of certificate files (on change or SIGHUP), by whose (a listener's address, admin, engines): swapped for new connections, or refused (the certificates in force stay).",
                &[("tls", tls), ("result", result)],
                n as f64,
            );
        }
    }
    for d in &g.decoders {
        let q = d.queue.stats();
        for (name, help, get) in gauges {
            s.gauge(name, help, &[("decoder", &d.name)], get(&q));
        }
        s.counter(
            "baton_decoder_slots_lingered_total",
            "Slots held on after their request was abandoned while the engine ran it (admission.cancel_grace_ms), so the engine never runs more than it holds.",
            &[("decoder", &d.name)],
            q.lingered as f64,
        );
    }
    let engines = g.prefills.iter().map(|p| ("prefill", &p.name, &*p.health));
    for (pool, name, h) in engines.chain(g.decoders.iter().map(|d| ("decode", &d.name, &d.health))) {
        let labels = [("pool", pool), ("endpoint", name.as_str())];
        s.gauge(
            "baton_endpoint_healthy",
            "1 when the engine is routable (not ejected, health check passing).",
            &labels,
            f64::from(u8::from(h.healthy())),
        );
        s.gauge(
            "baton_endpoint_in_flight",
            "Prefill requests in flight on the engine.",
            &labels,
            f64::from(h.in_flight()),
        );
        if pool == "prefill" {
            s.gauge(
                "baton_endpoint_pending_prompt_tokens",
                "Prompt tokens routed to the engine to compute (uncached) whose prefill has not answered.",
                &labels,
                h.pending_tokens() as f64,
            );
        }
        s.counter(
            "baton_endpoint_ejections_total",
            "Passive ejections after consecutive failures (the breaker opened).",
            &labels,
            h.ejected_total.load(Ordering::Relaxed) as f64,
        );
        let now = h.breaker();
        for state in Breaker::ALL {
            s.gauge(
                "baton_endpoint_breaker",
                "1 for the state the engine's circuit breaker is in: closed, open (ejected: no request routed to it) or half_open (one probe at a time).",
                &[("pool", pool), ("endpoint", name.as_str()), ("state", state.as_str())],
                f64::from(u8::from(state == now)),
            );
        }
    }
    g.shared.retries.metrics(&mut s);
    for d in &g.decoders {
        d.handoff.metrics(&d.name, &mut s);
    }
    for (name, ips, lookups, failures) in g.shared.client.names().snapshot() {
        let labels = [("name", name.as_str())];
        s.gauge(
            "baton_dns_addresses",
            "Addresses an engine or rank name has now.",
            &labels,
            ips.len() as f64,
        );
        s.counter("baton_dns_lookups_total", "Lookups of an engine or rank name.", &labels, lookups as f64);
        s.counter(
            "baton_dns_lookup_failures_total",
            "Lookups of a name that found no address or got no answer.",
            &labels,
            failures as f64,
        );
    }
    if let Some(p) = &g.plugins {
        p.scrape(&mut s);
    }
    if let Some(f) = &g.router.prefix {
        f.scrape(&mut s);
    }
    g.model.tokenizer.scrape(&mut s);
    g.tokenizers.scrape(&mut s);
    let text = s.encode();
    let mut r = Response::new(Full::new(Bytes::from(text)).map_err(|e| -> BoxError { match e {} }).boxed());
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static(CONTENT_TYPE));
    r
}

/// `GET /admin/requests?older_than_ms=N`: the requests in flight for longer than N ms (default 0:
/// all), oldest first, each with the phase it is in: where a stuck request is stuck.
pub fn requests(g: &Gateway, query: Option<&str>) -> Response<RespBody> {
    let mut older_than = std::time::Duration::ZERO;
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match (k.as_ref(), v.parse::<u64>()) {
            ("older_than_ms", Ok(ms)) => older_than = std::time::Duration::from_millis(ms),
            ("older_than_ms", Err(_)) => {
                return error_response(&GatewayError::Invalid {
                    param: "older_than_ms".into(),
                    problem: crate::api::Problem::Value,
                    reason: format!("{v:?} is not a whole number of milliseconds"),
                });
            }
            _ => {}
        }
    }
    let ms = crate::telemetry::metrics::ms;
    let list: Vec<Value> = g
        .shared
        .metrics
        .in_flight()
        .into_iter()
        .filter(|l| l.started.elapsed() >= older_than)
        .map(|l| {
            json!({
                "id": l.id.as_ref().map(|i| i.as_str()),
                "phase": l.phase().as_str(),
                "age_ms": ms(l.started.elapsed()),
                "in_phase_ms": ms(l.in_phase()),
                "decoder": l.decoder().and_then(|i| g.decoders.get(i)).map(|d| &d.name),
            })
        })
        .collect();
    full(200, &json!({"older_than_ms": ms(older_than), "requests": list}))
}

/// `GET /admin/requests/{id}`: one request's decision record, in flight or among the last
/// `[telemetry] records` finished.
pub fn request(g: &Gateway, id: &str) -> Response<RespBody> {
    match g.shared.metrics.record_of(id) {
        Some(r) => full(200, &r),
        None => error_response(&GatewayError::NotFound(format!(
            "request {:?}: not in flight and not among the records kept",
            id.chars().take(128).collect::<String>()
        ))),
    }
}

/// `GET /admin/flow`: flow control's bands, the flows waiting in each, and every tenant's fair-share
/// counter, service and budget; 404 when `[flow]` is off.
pub fn flow(g: &Gateway) -> Response<RespBody> {
    match &g.flow {
        Some(f) => full(200, &f.view()),
        None => error_response(&GatewayError::NotFound("flow control is off ([flow] is not set)".into())),
    }
}

/// `/admin/cluster`: this replica's shares of the decoders and the store's state.
pub fn cluster(g: &Gateway) -> Response<RespBody> {
    match &g.cluster {
        Some(c) => full(200, &c.view()),
        None => {
            error_response(&GatewayError::NotFound("this replica runs alone ([cluster] is not set)".into()))
        }
    }
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

/// `/admin/engines`: every engine's circuit breaker and health check, and the retry budget.
pub fn engines(g: &Gateway) -> Value {
    let prefills = g.prefills.iter().map(|p| ("prefill", &p.name, &p.http, &*p.health));
    let decoders = g.decoders.iter().map(|d| ("decode", &d.name, &d.http, &d.health));
    let engines: Vec<Value> = prefills
        .chain(decoders)
        .map(|(pool, name, http, h)| {
            json!({
                "pool": pool, "name": name, "http": http.to_string(), "breaker": h.breaker().as_str(),
                "consecutive_failures": h.failures(), "open_for_ms": h.open_for_ms(),
                "ejections_total": h.ejected_total.load(Ordering::Relaxed),
                "health_check": if h.check_failing() { "failing" } else { "passing" },
                "in_flight": h.in_flight(),
            })
        })
        .collect();
    json!({"engines": engines, "retries": g.shared.retries.view()})
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
        Ok(Err(e)) => return full(422, &json!({"reloaded": false, "error": e.to_string()})),
        Err(_) => {
            return error_response(&GatewayError::Internal(crate::api::Internal::TaskLost {
                task: "plugin reload",
            }));
        }
    };
    let ok = results.iter().all(Result::is_ok);
    let list: Vec<Value> = results
        .into_iter()
        .map(|r| match r {
            Ok(i) => json!({"name": i.name, "world": i.world, "wit": format!("baton:policy@{}", i.wit), "sha256": i.sha256, "version": i.version}),
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
                    &json!({"error": {"message": e.to_string(), "type": "invalid_request_error", "param": null, "code": "invalid_keys_file"}}),
                )
            }
        },
    }
}
