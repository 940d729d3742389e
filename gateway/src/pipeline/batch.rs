//! Prompt lists in `/v1/completions` (a list of strings, or of token-id lists), as vLLM and
//! OpenAI accept them: each prompt is its own PD request (its own admission, slots and
//! reservation, scheduled independently), run at once; the answers are merged into one, each
//! choice's `index` offset by its prompt's place (`prompt × n + choice`), usage summed, streams
//! interleaved as their events come.
//!
//! A prompt that fails fails the request with its error; the others are dropped, which releases
//! what they hold. A client that leaves drops them all the same way.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, header};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::Gateway;
use crate::api::sse::{ChannelBody, SseSplitter, event};
use crate::api::{Endpoint, GatewayError, GenRequest};
use crate::handoff::shared::AbortOnDrop;
use crate::handoff::{BoxError, RespBody, Shared};

/// Most prompts one request may list: each is a PD request of its own, holding slots and pages.
pub const MAX_PROMPTS: usize = 64;

/// The request's prompts when `prompt` is a list of prompts (strings or token-id lists), each as
/// a request of its own; `None` for a single prompt. `raw` has been validated.
pub fn split(raw: &Map<String, Value>) -> Result<Option<Vec<Map<String, Value>>>, GatewayError> {
    let Some(Value::Array(list)) = raw.get("prompt") else { return Ok(None) };
    // A list of numbers is one prompt of token ids.
    if !list.first().is_some_and(|p| p.is_string() || p.is_array()) {
        return Ok(None);
    }
    if list.len() > MAX_PROMPTS {
        return Err(GatewayError::invalid(
            "prompt",
            format!("{} prompts is more than the {MAX_PROMPTS} a request may list", list.len()),
        ));
    }
    Ok(Some(
        list.iter()
            .map(|p| {
                let mut one = raw.clone();
                one.insert("prompt".into(), p.clone());
                one
            })
            .collect(),
    ))
}

impl Gateway {
    /// Runs each prompt of a list as its own request and merges the answers; each holds its share
    /// of the `bytes` the body took.
    pub(super) async fn generate_list(
        self: &Arc<Self>,
        prompts: Vec<Map<String, Value>>,
        headers: &hyper::HeaderMap,
        tenant: Option<Arc<str>>,
        bytes: u64,
    ) -> Result<Response<RespBody>, GatewayError> {
        let share = bytes / (prompts.len().max(1) as u64);
        let stream = prompts.first().and_then(|p| p.get("stream")).and_then(Value::as_bool) == Some(true);
        let include_usage = prompts
            .first()
            .and_then(|p| p.get("stream_options"))
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true);
        let choices = prompts.first().and_then(|p| p.get("n")).and_then(Value::as_u64).unwrap_or(1).max(1);
        // Each prompt is checked before any runs: one bad prompt refuses the request.
        let reqs = prompts
            .into_iter()
            .map(|m| {
                GenRequest::from_checked(Endpoint::Completions, m.into()).map(|mut r| {
                    r.tenant = tenant.clone();
                    r.bytes = share;
                    r
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Aborted when the request ends (answered, failed or abandoned).
        let mut legs = Vec::with_capacity(reqs.len());
        for req in reqs {
            let (this, headers) = (Arc::clone(self), headers.clone());
            let leg = self.shared.spawn(async move { this.track(req, &headers).await });
            legs.push(AbortOnDrop(leg));
        }
        let mut answers = Vec::with_capacity(legs.len());
        for leg in &mut legs {
            let r = (&mut leg.0)
                .await
                .map_err(|_| GatewayError::Internal(crate::api::Internal::TaskLost { task: "prompt" }))??;
            answers.push(r);
        }
        if stream {
            return Ok(merge_streams(&self.shared, answers, choices, include_usage));
        }
        merge_whole(answers, choices).await
    }
}

/// Offsets every choice's index by its prompt's place.
fn reindex(v: &mut Value, prompt: usize, choices: u64) {
    if let Some(list) = v.get_mut("choices").and_then(Value::as_array_mut) {
        for c in list {
            let own = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            c["index"] = json!(prompt as u64 * choices + own);
        }
    }
}

/// Adds `usage` into `total`.
fn add_usage(total: &mut [u64; 3], usage: &Value) {
    for (i, k) in ["prompt_tokens", "completion_tokens", "total_tokens"].iter().enumerate() {
        if let Some(t) = total.get_mut(i) {
            *t += usage.get(*k).and_then(Value::as_u64).unwrap_or(0);
        }
    }
}

fn usage_json(total: &[u64; 3]) -> Value {
    json!({"prompt_tokens": total[0], "completion_tokens": total[1], "total_tokens": total[2]})
}

/// Whole answers: one body with every prompt's choices and the summed usage.
async fn merge_whole(
    answers: Vec<Response<RespBody>>,
    choices: u64,
) -> Result<Response<RespBody>, GatewayError> {
    let mut merged: Option<Value> = None;
    let mut all = Vec::new();
    let mut usage = [0u64; 3];
    for (i, r) in answers.into_iter().enumerate() {
        let b = r
            .into_body()
            .collect()
            .await
            .map_err(|e| GatewayError::Upstream { leg: "decode", message: e.to_string() })?;
        let mut v: Value = serde_json::from_slice(&b.to_bytes()).map_err(|e| GatewayError::Upstream {
            leg: "decode",
            message: format!("answer is not JSON: {e}"),
        })?;
        reindex(&mut v, i, choices);
        if let Some(u) = v.get("usage") {
            add_usage(&mut usage, u);
        }
        if let Some(Value::Array(c)) = v.get_mut("choices").map(Value::take) {
            all.extend(c);
        }
        merged.get_or_insert(v);
    }
    let mut v = merged.unwrap_or_else(|| json!({"object": "text_completion"}));
    v["choices"] = Value::Array(all);
    v["usage"] = usage_json(&usage);
    let mut r =
        Response::new(Full::new(Bytes::from(v.to_string())).map_err(|e| -> BoxError { match e {} }).boxed());
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    Ok(r)
}

/// Streamed answers: their events interleaved as they come, each choice reindexed; one usage
/// event (summed) and one `[DONE]` at the end.
fn merge_streams(
    shared: &Shared,
    answers: Vec<Response<RespBody>>,
    choices: u64,
    include_usage: bool,
) -> Response<RespBody> {
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    let usage = Arc::new(std::sync::Mutex::new(([0u64; 3], None::<Value>)));
    let mut readers = Vec::with_capacity(answers.len());
    for (i, r) in answers.into_iter().enumerate() {
        let (tx, usage) = (tx.clone(), Arc::clone(&usage));
        readers.push(shared.spawn(async move {
            let mut body = r.into_body();
            let (mut split, mut events) = (SseSplitter::default(), Vec::new());
            while let Some(Ok(frame)) = body.frame().await {
                let Ok(data) = frame.into_data() else { continue };
                split.push(&data, &mut events);
                for e in events.drain(..) {
                    if e == "[DONE]" {
                        continue;
                    }
                    let Ok(mut v) = serde_json::from_str::<Value>(&e) else {
                        if tx.send(event(&e)).await.is_err() {
                            return;
                        }
                        continue;
                    };
                    let only_usage = v.get("choices").and_then(Value::as_array).is_some_and(Vec::is_empty);
                    if only_usage {
                        if let Some(u) = v.get("usage") {
                            let mut g = usage.lock().unwrap_or_else(|e| e.into_inner());
                            add_usage(&mut g.0, u);
                            g.1.get_or_insert_with(|| v.clone());
                        }
                        continue;
                    }
                    reindex(&mut v, i, choices);
                    if tx.send(event(&v.to_string())).await.is_err() {
                        return;
                    }
                }
            }
        }));
    }
    shared.spawn(async move {
        for r in readers {
            let _ = r.await;
        }
        let (total, template) = {
            let g = usage.lock().unwrap_or_else(|e| e.into_inner());
            (g.0, g.1.clone())
        };
        if include_usage {
            let mut v = template.unwrap_or_else(|| json!({"object": "text_completion", "choices": []}));
            v["usage"] = usage_json(&total);
            let _ = tx.send(event(&v.to_string())).await;
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    let mut r = Response::new(ChannelBody(rx).boxed());
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(header::CACHE_CONTROL, header::HeaderValue::from_static("no-cache"));
    r
}
