//! A test-side orchestrator doing the native handoff the gateway will do: reserve on every decoder
//! rank (all or none, retrying while busy), prefill with the write addresses, wait for READY from
//! every rank, decode, then wait for every rank's "pages released".

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_dataplane::readiness::{Aggregator, Outcome, Progress};
use baton_dataplane::transport::{ControlClient, EventStream, TransportError};
use baton_dataplane::wire::RefusalCode;
use baton_dataplane::{KvGeometry, PageAddr, PrefixKey, RankEvent, RequestId, RequestKey};
use baton_sim::kv::prefix_hashes;
use baton_sim::kv::{render_chat, tokenize};
use serde_json::{Value, json};
use tokio::sync::mpsc;

// The suite's HTTP client (one new connection a request), shared with the gateway's tests.
#[path = "../../../tests/support/http.rs"]
mod client;
pub use client::http;

pub async fn stats(addr: SocketAddr) -> Value {
    let (status, body) = http(addr, "/sim/stats", None).await;
    assert_eq!(status, 200);
    serde_json::from_slice(&body).unwrap()
}

/// A decoder as the orchestrator sees it: its HTTP address, its ranks' control connections and an
/// event router per rank.
pub struct Decoder {
    pub http: SocketAddr,
    pub ranks: Vec<SocketAddr>,
    controls: Vec<tokio::sync::Mutex<Vec<ControlClient>>>,
    waiters: Arc<Mutex<HashMap<RequestKey, mpsc::UnboundedSender<RankEvent>>>>,
    fingerprint: u64,
}

impl Decoder {
    pub async fn connect(http: SocketAddr) -> Arc<Self> {
        let s = stats(http).await;
        let fingerprint = s["geometry_fingerprint"].as_u64().unwrap();
        let ranks: Vec<SocketAddr> = s["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["addr"].as_str().unwrap().parse().unwrap())
            .collect();
        let waiters: Arc<Mutex<HashMap<RequestKey, mpsc::UnboundedSender<RankEvent>>>> = Arc::default();
        for (r, addr) in ranks.iter().enumerate() {
            let mut ev = EventStream::connect(*addr, fingerprint, r as u32).await.unwrap();
            let w = Arc::clone(&waiters);
            tokio::spawn(async move {
                while let Ok(Some(e)) = ev.next().await {
                    let key = match e {
                        RankEvent::Status(s) => s.key(),
                        RankEvent::Released(r) => r.key,
                    };
                    if let Some(tx) = w.lock().unwrap().get(&key) {
                        let _ = tx.send(e);
                    }
                }
            });
        }
        let controls = ranks.iter().map(|_| tokio::sync::Mutex::new(Vec::new())).collect();
        Arc::new(Self { http, ranks, controls, waiters, fingerprint })
    }

    async fn control(&self, rank: usize) -> Result<ControlClient, TransportError> {
        if let Some(c) = self.controls[rank].lock().await.pop() {
            return Ok(c);
        }
        ControlClient::connect(self.ranks[rank], self.fingerprint, rank as u32).await
    }

    async fn give_back(&self, rank: usize, c: ControlClient) {
        self.controls[rank].lock().await.push(c);
    }

    /// Reserves on every rank or none. `Ok(None)` when some rank is busy (the caller retries).
    pub async fn reserve(
        &self,
        key: RequestKey,
        chunks: u32,
        lease: Duration,
    ) -> Result<Option<Vec<Vec<(u32, PageAddr)>>>, TransportError> {
        self.reserve_shared(key, chunks, lease, &[]).await
    }

    /// Like `reserve`, offering prefix keys of the leading chunks: chunks already filled for another
    /// request are shared, and only the others come back as write addresses.
    pub async fn reserve_shared(
        &self,
        key: RequestKey,
        chunks: u32,
        lease: Duration,
        prefixes: &[PrefixKey],
    ) -> Result<Option<Vec<Vec<(u32, PageAddr)>>>, TransportError> {
        let mut got = Vec::new();
        for r in 0..self.ranks.len() {
            let mut c = match self.control(r).await {
                Ok(c) => c,
                Err(e) => {
                    // All or none: what the ranks before granted goes back (rank `r` was never asked).
                    self.cancel_ranks(key, true, 0..r).await;
                    return Err(e);
                }
            };
            let res = c.reserve(key, chunks, lease, prefixes).await;
            self.give_back(r, c).await;
            match res {
                Ok(addrs) => got.push(addrs),
                // Only the ranks that granted (the caller retries as a new epoch: a rank refuses a
                // key it saw cancelled).
                Err(TransportError::Refused { code: RefusalCode::Busy, .. }) => {
                    self.cancel_ranks(key, true, 0..r).await;
                    return Ok(None);
                }
                Err(e) => {
                    self.cancel_ranks(key, true, 0..=r).await;
                    return Err(e);
                }
            }
        }
        Ok(Some(got))
    }

    /// Cancels on every rank (idempotent; a rank that is down is skipped).
    pub async fn cancel(&self, key: RequestKey) {
        self.cancel_with(key, false).await;
    }

    async fn cancel_with(&self, key: RequestKey, unsent: bool) {
        self.cancel_ranks(key, unsent, 0..self.ranks.len()).await;
    }

    async fn cancel_ranks(&self, key: RequestKey, unsent: bool, ranks: impl IntoIterator<Item = usize>) {
        for r in ranks {
            let Ok(mut c) = self.control(r).await else {
                continue;
            };
            let res = if unsent { c.cancel_unsent(key).await } else { c.cancel(key).await };
            if res.is_ok() {
                self.give_back(r, c).await;
            }
        }
    }

    pub fn listen(&self, key: RequestKey) -> mpsc::UnboundedReceiver<RankEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.waiters.lock().unwrap().insert(key, tx);
        rx
    }

    pub fn forget(&self, key: RequestKey) {
        self.waiters.lock().unwrap().remove(&key);
    }
}

/// A request to drive through the handoff.
#[derive(Clone, Debug)]
pub struct Job {
    pub chat: bool,
    pub stream: bool,
    pub text: String,
    pub max_tokens: u32,
    /// Time to keep the READY KV in the decoder's buffer before decoding.
    pub hold: Duration,
}

impl Job {
    pub fn ids(&self) -> Vec<u32> {
        if self.chat {
            tokenize(&render_chat(&[("user".into(), self.text.clone())]))
        } else {
            tokenize(&self.text)
        }
    }

    fn body(&self, baton: Value) -> Value {
        let mut b = if self.chat {
            json!({"model": "baton-sim", "messages": [{"role": "user", "content": self.text}], "max_tokens": self.max_tokens})
        } else {
            json!({"model": "baton-sim", "prompt": self.text, "max_tokens": self.max_tokens})
        };
        if self.stream {
            b["stream"] = json!(true);
            b["stream_options"] = json!({"include_usage": true});
        }
        b["baton"] = baton;
        b
    }

    fn path(&self) -> &'static str {
        if self.chat { "/v1/chat/completions" } else { "/v1/completions" }
    }
}

/// What a handoff ended with.
#[derive(Debug)]
pub enum Handoff {
    /// The decoder's answer (status, body); text and usage extracted.
    /// `shared`: chunks (summed over ranks) served from another request's pages instead of sent.
    Done { status: u16, text: String, prompt_tokens: u64, completion_tokens: u64, shared: usize },
    /// The prefill failed with this status.
    PrefillFailed(#[allow(dead_code)] u16, #[allow(dead_code)] String),
    /// Readiness did not complete: the outcome.
    NotReady(Outcome),
}

static NEXT: AtomicU64 = AtomicU64::new(1);

/// Prefix keys of a prompt's full chunks: the hash of every token up to the chunk's end, so equal
/// keys mean equal KV. A partial last chunk gets none.
pub fn prefix_keys(ids: &[u32], chunk_tokens: usize) -> Vec<PrefixKey> {
    let h = prefix_hashes(ids);
    (1..=ids.len() / chunk_tokens).map(|c| PrefixKey(h[c * chunk_tokens - 1])).collect()
}

pub fn new_key() -> RequestKey {
    // Unique across the test run; the high bits mark the process so parallel tests never collide.
    RequestKey::new(
        RequestId(u128::from(std::process::id()) << 64 | u128::from(NEXT.fetch_add(1, Ordering::Relaxed))),
        0,
    )
}

/// Timing knobs of the orchestrator.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub lease: Duration,
    pub ready_deadline: Duration,
    pub queue_deadline: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(20),
            ready_deadline: Duration::from_secs(20),
            queue_deadline: Duration::from_secs(60),
        }
    }
}

/// Drives one request through reserve → prefill → READY → decode → released.
pub async fn handoff(prefill: SocketAddr, d: &Decoder, g: &KvGeometry, job: &Job, limits: Limits) -> Handoff {
    let mut key = new_key();
    let ids = job.ids();
    let chunks = ids.len().div_ceil(g.chunk_tokens as usize) as u32;
    let queued = Instant::now();
    let prefixes = prefix_keys(&ids, g.chunk_tokens as usize);
    let addrs = loop {
        match d.reserve_shared(key, chunks, limits.lease, &prefixes).await.unwrap() {
            Some(a) => break a,
            None => {
                assert!(queued.elapsed() < limits.queue_deadline, "queued past the deadline");
                tokio::time::sleep(Duration::from_millis(2)).await;
                // The ranks that granted were cancelled, and a rank refuses a key it saw end:
                // each try is a new epoch of the request, as the gateway's are.
                key = RequestKey::new(key.request, key.epoch + 1);
            }
        }
    };
    let mut events = d.listen(key);
    let decoders: Vec<Value> = addrs
        .iter()
        .enumerate()
        .map(|(r, a)| {
            let chunks: Vec<Value> = a.iter().map(|(c, p)| json!([c, p.page, p.generation])).collect();
            json!({"rank": r, "addr": d.ranks[r].to_string(), "chunks": chunks})
        })
        .collect();
    let rid = format!("{:032x}", key.request.0);
    let (status, body) = http(
        prefill,
        job.path(),
        Some(&job.body(json!({"request_id": rid, "epoch": key.epoch, "decoders": decoders}))),
    )
    .await;
    if status != 200 {
        d.cancel(key).await;
        d.forget(key);
        return Handoff::PrefillFailed(status, String::from_utf8_lossy(&body).into_owned());
    }
    let ranks = d.ranks.len() as u32;
    let deadline = Instant::now() + limits.ready_deadline;
    let mut agg = Aggregator::new(key, ranks, deadline).unwrap();
    let mut released = 0;
    let outcome = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, events.recv()).await {
            Ok(Some(RankEvent::Status(s))) => {
                if let Progress::Done(o) = agg.observe(&s, Instant::now()).unwrap() {
                    break o;
                }
            }
            Ok(Some(RankEvent::Released(_))) => released += 1,
            Ok(None) => panic!("event router closed"),
            Err(_) => break agg.poll(Instant::now()).unwrap(),
        }
    };
    if outcome != Outcome::Ready {
        d.cancel(key).await;
        d.forget(key);
        return Handoff::NotReady(outcome);
    }
    tokio::time::sleep(job.hold).await;
    let (status, body) =
        http(d.http, job.path(), Some(&job.body(json!({"request_id": rid, "epoch": key.epoch})))).await;
    let (text, prompt_tokens, completion_tokens) = if status == 200 {
        parse_answer(job, &body)
    } else {
        (String::from_utf8_lossy(&body).into_owned(), 0, 0)
    };
    // The decoder frees its pages after consuming them; every rank says so once.
    while released < ranks && status == 200 {
        match tokio::time::timeout(Duration::from_secs(10), events.recv()).await {
            Ok(Some(RankEvent::Released(_))) => released += 1,
            Ok(Some(_)) => {}
            _ => panic!("rank did not release pages of {key}"),
        }
    }
    d.forget(key);
    let shared = addrs.iter().map(|r| chunks as usize - r.len()).sum();
    Handoff::Done { status, text, prompt_tokens, completion_tokens, shared }
}

/// Extracts text and usage from a JSON or SSE answer, checking the SSE framing on the way.
pub fn parse_answer(job: &Job, body: &[u8]) -> (String, u64, u64) {
    let pick = |v: &Value| -> String {
        let c = &v["choices"][0];
        if job.chat {
            c["message"]["content"].as_str().or(c["delta"]["content"].as_str()).unwrap_or("").to_owned()
        } else {
            c["text"].as_str().unwrap_or("").to_owned()
        }
    };
    if !job.stream {
        let v: Value = serde_json::from_slice(body).unwrap();
        return (
            pick(&v),
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["usage"]["completion_tokens"].as_u64().unwrap(),
        );
    }
    let s = std::str::from_utf8(body).unwrap();
    let mut text = String::new();
    let mut usage = (0, 0);
    let mut done = false;
    for event in s.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect("every SSE event is a data line");
        assert!(!done, "event after [DONE]");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if let Some(u) = v.get("usage") {
            usage = (u["prompt_tokens"].as_u64().unwrap(), u["completion_tokens"].as_u64().unwrap());
        } else {
            text.push_str(&pick(&v));
        }
    }
    assert!(done, "stream did not end with [DONE]");
    (text, usage.0, usage.1)
}

/// Waits until a decoder's ranks are all free with nothing tracked, and its engine holds no blocks.
pub async fn assert_decoder_clean(http: SocketAddr, within: Duration) {
    let start = Instant::now();
    loop {
        let s = stats(http).await;
        let clean = s["engine_blocks_held"] == 0
            && s["ranks"].as_array().unwrap().iter().all(|r| {
                r["pages_free"] == r["pages_total"] && r["requests"] == 0 && r["accounting_errors"] == 0
            });
        if clean {
            return;
        }
        assert!(start.elapsed() < within, "decoder not clean after {within:?}: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn assert_prefill_clean(http: SocketAddr, within: Duration) {
    let start = Instant::now();
    loop {
        let s = stats(http).await;
        if s["engine_blocks_held"] == 0 {
            return;
        }
        assert!(start.elapsed() < within, "prefiller still holds blocks after {within:?}: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
