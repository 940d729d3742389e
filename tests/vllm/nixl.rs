//! The `vllm-nixl` handoff in front of the real servers: answers, parameters, refusals, clients
//! that leave, admission from vLLM's metrics.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use libtest_mimic::Failed;
use serde_json::{Value, json};

use super::client::{http, json, send};
use super::engines::{Fleet, MODEL};
use super::{
    assert_engines_clean, baton, baton_metrics, block_on, comparable_body, engine_metrics, prompt, relay,
    sample, shapes, slots_back,
};

/// Completions and chat, streamed and not, through baton (prefill on one server, decode on the
/// other, the KV pulled over NIXL) answer exactly what one server alone answers, apart from `id`
/// and `created`; the decoder computed none of the prompt itself (vLLM's own counters: every
/// prompt token came by KV transfer), and both servers end clean.
pub fn nixl_answers_equal_one_engine(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let b = baton(fleet, fleet.prefill.http, fleet.decode.http, "scrape_interval_ms = 100").await;
        let gw = b.addrs[0];
        for (i, (path, stream, body)) in shapes(&prompt(90, 1), 24).into_iter().enumerate() {
            // A prompt of its own per shape: the decoder must not have any of it cached.
            let mut body = body;
            let text = prompt(90, 100 + i);
            if path.ends_with("chat/completions") {
                body["messages"][1]["content"] = json!(text);
            } else {
                body["prompt"] = json!(text);
            }
            let before = engine_metrics(fleet.decode.http).await;
            let (s1, via) = http(gw, path, Some(&body)).await;
            assert_eq!(s1, 200, "{path} via baton: {}", String::from_utf8_lossy(&via));
            let after = engine_metrics(fleet.decode.http).await;
            let (s2, alone) = http(fleet.prefill.http, path, Some(&body)).await;
            assert_eq!(s2, 200, "{path} alone: {}", String::from_utf8_lossy(&alone));
            let (via, alone) = (comparable_body(&via, stream), comparable_body(&alone, stream));
            assert_eq!(via, alone, "{path} stream={stream}: baton's answer differs from one engine's");
            let delta =
                |name: &str, label: &str| sample(&after, name, &[label]) - sample(&before, name, &[label]);
            let pulled = delta("vllm:prompt_tokens_by_source_total", "source=\"external_kv_transfer\"");
            let computed = delta("vllm:prompt_tokens_by_source_total", "source=\"local_compute\"");
            let prompt_tokens = delta("vllm:prompt_tokens_total", "");
            eprintln!("{path} stream={stream}: prompt {prompt_tokens}, pulled {pulled}, computed {computed}");
            assert!(prompt_tokens > 0.0);
            assert_eq!(
                pulled, prompt_tokens,
                "{path} stream={stream}: the decoder did not pull the whole prompt"
            );
            assert_eq!(computed, 0.0, "{path} stream={stream}: the decoder computed prompt tokens itself");
            assert_eq!(delta("vllm:nixl_num_failed_transfers_total", ""), 0.0);
        }
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}

/// The prefill's `kv_transfer_params`, exactly as vLLM 0.32 answers them (every field), reach the
/// decoder unchanged; the prefill leg asks for a remote decode with one token, unstreamed.
pub fn kv_transfer_params_exact(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let (p, prec) = relay::start(fleet.prefill.http).await;
        let (d, drec) = relay::start(fleet.decode.http).await;
        let b = baton(fleet, p, d, "scrape_interval_ms = 100").await;
        let body = json!({"model": MODEL, "prompt": prompt(70, 2), "max_tokens": 5, "temperature": 0});
        let (s, v) = json(b.addrs[0], "/v1/completions", &body).await;
        assert_eq!(s, 200, "{v}");
        let sent = prec.request_bodies();
        let prefill_req = sent.iter().find(|r| r.get("kv_transfer_params").is_some()).expect("a prefill");
        assert_eq!(prefill_req["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(prefill_req["max_tokens"], 1);
        assert_eq!(prefill_req["stream"], false);
        let answered = prec.answer_bodies();
        let params =
            answered.iter().find_map(|a| a.get("kv_transfer_params").filter(|p| !p.is_null())).unwrap();
        eprintln!("vLLM's prefill answered kv_transfer_params = {params}");
        // Every field vLLM 0.32's NIXL connector answers.
        for field in [
            "do_remote_prefill",
            "do_remote_decode",
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "tp_size",
            "dcp_size",
            "pp_size",
            "remote_num_tokens",
            "remote_blocks_expiry_time",
            "transfer_mode",
            "remote_prefill_cached_tokens",
        ] {
            assert!(params.get(field).is_some(), "vLLM answered no {field}: {params}");
        }
        let decode_req =
            drec.request_bodies().into_iter().find(|r| r.get("kv_transfer_params").is_some()).unwrap();
        assert_eq!(&decode_req["kv_transfer_params"], params, "the decoder got other kv_transfer_params");
        assert_eq!(decode_req["max_tokens"], 5);
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}

/// Request parameters and their answers: through baton as from one engine alone (`n`, `logprobs`,
/// `stop`, `seed` with sampling, `echo`, `top_logprobs`, `max_completion_tokens`, penalties, chat
/// `logprobs`), streamed and not where the parameter allows it.
pub fn parameters_answer_as_one_engine(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let b = baton(fleet, fleet.prefill.http, fleet.decode.http, "scrape_interval_ms = 100").await;
        let gw = b.addrs[0];
        let chat = |extra: Value, i: usize| {
            let mut v = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(60, 300 + i)}], "max_tokens": 12, "temperature": 0});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            ("/v1/chat/completions", v)
        };
        let cmpl = |extra: Value, i: usize| {
            let mut v =
                json!({"model": MODEL, "prompt": prompt(60, 300 + i), "max_tokens": 12, "temperature": 0});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            ("/v1/completions", v)
        };
        let cases: Vec<(&str, (&str, Value))> = vec![
            ("logprobs=3", cmpl(json!({"logprobs": 3}), 2)),
            ("logprobs streamed", cmpl(json!({"logprobs": 2, "stream": true}), 3)),
            ("chat logprobs top_logprobs", chat(json!({"logprobs": true, "top_logprobs": 2}), 4)),
            ("stop strings", cmpl(json!({"stop": ["the", "cache"], "max_tokens": 40}), 5)),
            ("stop streamed chat", chat(json!({"stop": ["the"], "stream": true, "max_tokens": 40}), 6)),
            ("seeded sampling", cmpl(json!({"seed": 7, "temperature": 1.0, "top_p": 0.9}), 7)),
            (
                "seeded sampling chat streamed",
                chat(
                    json!({"seed": 11, "temperature": 0.8, "stream": true, "stream_options": {"include_usage": true}}),
                    8,
                ),
            ),
            ("echo", cmpl(json!({"echo": true}), 9)),
            ("max_completion_tokens", chat(json!({"max_completion_tokens": 5}), 10)),
            (
                "penalties",
                cmpl(
                    json!({"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}),
                    11,
                ),
            ),
            ("ignore_eos min_tokens", cmpl(json!({"ignore_eos": true, "min_tokens": 8}), 12)),
            ("top_k -1", cmpl(json!({"top_k": -1, "temperature": 0.5, "seed": 3}), 14)),
            (
                "continuous usage",
                cmpl(
                    json!({"stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
                    13,
                ),
            ),
        ];
        for (name, (path, body)) in cases {
            let stream = body["stream"] == true;
            let (s1, via) = http(gw, path, Some(&body)).await;
            let (s2, alone) = http(fleet.prefill.http, path, Some(&body)).await;
            assert_eq!(s2, 200, "{name} alone: {}", String::from_utf8_lossy(&alone));
            assert_eq!(s1, 200, "{name} via baton: {}", String::from_utf8_lossy(&via));
            assert_eq!(comparable_body(&via, stream), comparable_body(&alone, stream), "{name}");
        }
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}

/// A client that leaves a streamed answer after a few tokens: the decoder stops the request and
/// frees its blocks, the producer's were freed by the pull, baton's slot comes back.
pub fn client_leaving_mid_stream(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let b = baton(fleet, fleet.prefill.http, fleet.decode.http, "scrape_interval_ms = 100").await;
        for (i, path) in ["/v1/completions", "/v1/chat/completions"].into_iter().enumerate() {
            let body = if i == 0 {
                json!({"model": MODEL, "prompt": prompt(80, 400), "max_tokens": 400, "ignore_eos": true, "stream": true})
            } else {
                json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(80, 401)}], "max_tokens": 400, "ignore_eos": true, "stream": true})
            };
            let res = send(b.addrs[0], path, Some(&body)).await;
            assert_eq!(res.status(), 200);
            let mut body = res.into_body();
            // Three events, then the client is gone.
            let mut events = 0;
            while events < 3 {
                let frame = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
                if let Some(d) = frame.data_ref() {
                    events += d.windows(6).filter(|w| w == b"data: ").count();
                }
            }
            // The decoder is still generating when the client leaves.
            let m = engine_metrics(fleet.decode.http).await;
            assert_eq!(
                sample(&m, "vllm:num_requests_running", &[]),
                1.0,
                "the decode ended before the client left"
            );
            drop(body);
            assert_engines_clean(fleet, Duration::from_secs(10)).await;
        }
        // The slot of a request abandoned while the decoder ran it is held `cancel_grace_ms`
        // (100) after the client left, for the decoder to drop it: back within that.
        let lingered = slots_back(&b, Duration::from_secs(2)).await;
        assert_eq!(lingered, 2, "both abandoned requests' slots were held the grace");
        b.shutdown().await;
    })
}

/// A request the prefill refuses (a parameter vLLM checks and baton passes): the client gets
/// vLLM's own status and error body, no decode is sent, nothing is held anywhere.
pub fn refused_prefill(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let (d, drec) = relay::start(fleet.decode.http).await;
        let b = baton(fleet, fleet.prefill.http, d, "scrape_interval_ms = 100").await;
        // (a request, whether baton refuses it itself before any engine is asked)
        let cases = [
            (
                json!({"model": MODEL, "prompt": prompt(40, 500), "max_tokens": 4, "repetition_penalty": -1}),
                true,
            ),
            (json!({"model": MODEL, "prompt": prompt(40, 501), "max_tokens": 4, "top_k": -7}), true),
            (json!({"model": MODEL, "prompt": prompt(40, 502), "max_tokens": 4, "logprobs": 50}), true),
            // vLLM's own parameters baton does not check: passed on, and vLLM's answer with them.
            (
                json!({"model": MODEL, "prompt": prompt(40, 503), "max_tokens": 4, "allowed_token_ids": [99_999]}),
                false,
            ),
            (
                json!({"model": MODEL, "prompt": prompt(40, 504), "max_tokens": 4, "truncate_prompt_tokens": 100_000}),
                false,
            ),
        ];
        for (body, own) in cases {
            let (s1, via) = json(b.addrs[0], "/v1/completions", &body).await;
            let (s2, alone) = json(fleet.prefill.http, "/v1/completions", &body).await;
            assert_eq!(s2, 400, "vLLM accepted {body}: {alone}");
            assert_eq!(s1, s2, "{body}: {via}");
            if own {
                // baton's own check: the OpenAI shape with a stable code and the parameter named.
                assert_eq!(via["error"]["type"], "invalid_request_error", "{via}");
                assert_eq!(via["error"]["code"], "invalid_value", "{via}");
            } else {
                // vLLM's error object as vLLM wrote it, with baton's three fields added (who
                // refused, whether a retry can help, the request's id).
                let mut ours = via["error"].as_object().unwrap().clone();
                assert_eq!(ours.remove("origin"), Some(json!("engine")), "{via}");
                assert_eq!(ours.remove("retry"), Some(json!("never")), "{via}");
                assert!(ours.remove("request_id").is_some(), "{via}");
                assert_eq!(Value::Object(ours), alone["error"], "{body}: baton changed vLLM's error");
            }
        }
        assert!(drec.request_bodies().is_empty(), "a decode was sent for a refused prefill");
        let slots: u32 = b.gateway.decoders.iter().map(|d| d.queue.stats().in_use).sum();
        assert_eq!(slots, 0);
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}

/// A decode refused after the prefill kept the prompt's blocks.
/// - By something in front of the decoder (a 503 page from a proxy; vLLM never saw the request):
///   the client gets a 502 naming it, and baton's drain frees the producer's blocks within
///   seconds instead of leaving them to the producer's lease (`kv_lease_duration`, 30 s).
/// - By vLLM itself (a 315-token prompt with `max_tokens = 400` and `min_tokens = 300`: vLLM
///   clamps `max_tokens` to the 197 the context leaves, under `min_tokens`; the one-token prefill,
///   which carries no `min_tokens`, passed): the client gets vLLM's 400, vLLM tells its producer to
///   free the blocks, and baton sends no drain, which would read blocks the producer no longer
///   holds for the request.
pub fn refused_decode(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let (d, refused) = relay::refusing(fleet.decode.http, 1).await;
        let b = baton(fleet, fleet.prefill.http, d, "scrape_interval_ms = 100").await;
        let drains = |m: &BTreeMap<String, f64>| sample(m, "baton_drains_total", &["result=\"sent\""]);
        let body = json!({"model": MODEL, "prompt": prompt(150, 600), "max_tokens": 8});
        let (s, v) = json(b.addrs[0], "/v1/completions", &body).await;
        assert_eq!(refused.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(s, 502, "{v}");
        assert!(v["error"]["message"].as_str().unwrap_or("").contains("503"), "{v}");
        // The drain reached the decoder, which pulled the blocks and so let the producer free them.
        assert_engines_clean(fleet, Duration::from_secs(5)).await;
        assert_eq!(drains(&baton_metrics(&b).await), 1.0);
        // The drain holds the request's slot: the grace first (vLLM may have begun the call the
        // proxy refused), then while vLLM runs it; it goes back as its answer ends, not the grace
        // after.
        assert_eq!(
            slots_back(&b, Duration::from_secs(5)).await,
            1,
            "the drain's slot held the grace other than once"
        );

        let log_from = fleet.prefill.log_len();
        let body = json!({"model": MODEL, "prompt": prompt(150, 601), "max_tokens": 400, "min_tokens": 300});
        let (s, v) = json(b.addrs[0], "/v1/completions", &body).await;
        assert_eq!(s, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap_or("").contains("min_tokens"), "{v}");
        assert_eq!(v["error"]["origin"], "engine", "{v}");
        assert_engines_clean(fleet, Duration::from_secs(5)).await;
        assert_eq!(drains(&baton_metrics(&b).await), 1.0, "a drain was sent after vLLM's own refusal");
        let log = fleet.prefill.log_since(log_from);
        assert!(!log.contains("nrecognized"), "the producer saw a read of a request it had freed:\n{log}");
        let slots: u32 = b.gateway.decoders.iter().map(|d| d.queue.stats().in_use).sum();
        assert_eq!(slots, 0);
        b.shutdown().await;
    })
}

/// Admission from vLLM's real `/metrics`: with `kv_usage_high` under one block's share, a running
/// request closes the decoder (baton reports vLLM's own usage), a second request waits in baton's
/// queue, not in vLLM's, and goes as soon as the first ends; no scrape of vLLM's page fails.
pub fn admission_from_vllm_metrics(fleet: &Fleet) -> Result<(), Failed> {
    block_on(async {
        let b = baton(
            fleet,
            fleet.prefill.http,
            fleet.decode.http,
            "scrape_interval_ms = 50, kv_usage_high = 0.00001, max_in_flight = 4",
        )
        .await;
        let dec = &b.gateway.decoders[0];
        let (s, _) = http(b.addrs[0], "/ready", None).await;
        assert_eq!(s, 200, "baton is not ready in front of vLLM");
        let first = json!({"model": MODEL, "prompt": prompt(80, 700), "max_tokens": 400, "ignore_eos": true, "stream": true});
        let res = send(b.addrs[0], "/v1/completions", Some(&first)).await;
        assert_eq!(res.status(), 200);
        let mut body = res.into_body();
        let _ = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
        // The decoder's usage (one request's blocks) is over the threshold: admission closes.
        let start = Instant::now();
        while dec.queue.stats().open {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "admission never closed: {:?}",
                dec.queue.stats()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let m = baton_metrics(&b).await;
        let reported = sample(&m, "baton_decoder_reported_kv_usage", &[]);
        let vllm = sample(&engine_metrics(fleet.decode.http).await, "vllm:kv_cache_usage_perc", &[]);
        assert!(
            reported > 0.0 && (reported - vllm).abs() < 1e-3,
            "baton reports {reported}, vLLM says {vllm}"
        );
        assert_eq!(sample(&m, "baton_decoder_admitting", &[]), 0.0);
        let second = json!({"model": MODEL, "prompt": prompt(40, 701), "max_tokens": 4});
        let gw = b.addrs[0];
        let waiter = tokio::spawn(async move { json(gw, "/v1/completions", &second).await });
        let start = Instant::now();
        while dec.queue.stats().waiting != 1 {
            assert!(start.elapsed() < Duration::from_secs(5), "the second request did not queue in baton");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(dec.queue.stats().waiting, 1, "admitted while vLLM's metrics say the decoder is busy");
        assert_eq!(sample(&engine_metrics(fleet.decode.http).await, "vllm:num_requests_waiting", &[]), 0.0);
        drop(body);
        let (s, v) = tokio::time::timeout(Duration::from_secs(10), waiter).await.unwrap().unwrap();
        assert_eq!(s, 200, "{v}");
        let m = baton_metrics(&b).await;
        assert_eq!(sample(&m, "baton_decoder_scrape_failures_total", &[]), 0.0);
        assert_engines_clean(fleet, Duration::from_secs(10)).await;
        b.shutdown().await;
    })
}
