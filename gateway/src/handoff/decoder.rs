//! A decode engine as the gateway sees it: the part every handoff mode shares (its name and HTTP
//! address, its admission queue, its health) and the mode that moves the KV to it, a [`Handoff`]
//! behind a box. This registry names no mode.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use hyper::Response;
use serde_json::Value;

use super::legs::RespBody;
use super::shared::Prefiller;
use super::shared::admission_error;
use crate::admission::{SlotGuard, SlotQueue, Ticket};
use crate::api::{GatewayError, GenRequest};
use crate::endpoints::EngineUrl;
use crate::routing::Health;
use crate::telemetry::{Scrape, Timing};

/// `need` slots of the decoder's queue, FIFO within the ticket's class, waiting at most the
/// ticket's wait (never more than `queue_timeout`).
async fn queue_admit(
    dec: &Decoder,
    need: u32,
    ticket: Ticket,
    queue_timeout: std::time::Duration,
) -> Result<Option<SlotGuard>, GatewayError> {
    dec.queue.acquire(need, ticket.class, ticket.wait(queue_timeout)).await.map(Some).map_err(admission_error)
}

/// A boxed future: the trait's methods are called through `dyn Handoff`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One decode engine.
#[derive(Debug)]
pub struct Decoder {
    pub name: String,
    pub http: EngineUrl,
    /// Admission in slots; the mode sizes it (pages the data plane reports, chunks of an LMCache
    /// buffer, requests in flight) and may resize it while serving.
    pub queue: SlotQueue,
    pub health: Health,
    /// The handoff mode's name, as the configuration spells it (`handoff = "…"`); a metric label.
    pub mode: &'static str,
    pub handoff: Box<dyn Handoff>,
}

impl Decoder {
    pub fn new(
        name: String,
        http: EngineUrl,
        queue: SlotQueue,
        mode: &'static str,
        handoff: Box<dyn Handoff>,
    ) -> Self {
        Self { name, http, queue, health: Health::default(), mode, handoff }
    }

    /// Slots a prompt of `tokens` takes here.
    pub fn slots_for(&self, tokens: usize) -> u32 {
        self.handoff.slots_for(tokens)
    }

    /// The handoff mode's name.
    pub fn mode(&self) -> &'static str {
        self.mode
    }
}

impl super::shared::Engine for Decoder {
    fn peer(&self) -> super::shared::Peer<'_> {
        super::shared::Peer { name: &self.name, http: &self.http, health: &self.health }
    }
}

/// One request's passage through a handoff, as the driver hands it over: admitted (its slots, when
/// the mode's admission gives any), routed, counted.
#[derive(Debug)]
pub struct Leg<'a> {
    pub dec: &'a Arc<Decoder>,
    /// The prefillers in the order to try (the first is the routed one).
    pub prefills: &'a [&'a Prefiller],
    pub req: &'a GenRequest,
    /// The prompt's token ids, as the gateway counted them.
    pub ids: &'a [u32],
    /// The admission slots; the mode keeps them until the decoder no longer needs room for the
    /// request (dropping them returns them).
    pub slots: Option<SlotGuard>,
    /// The phases so far; the mode marks its own.
    pub timing: &'a mut Timing,
    /// The prompt's tokens counted in the routed prefiller's pending work: the mode drops it when
    /// the prefill leg has answered. `None`: the request goes to the decoder alone, no prefill leg
    /// (it holds nearly all of the prompt in its KV cache and computes the rest itself; only
    /// where [`Handoff::serves_alone`]).
    pub work: Option<crate::routing::Work>,
    /// Where the mode marks an attempt the driver may run again on other engines ([`Unstarted`]).
    pub retry: &'a std::sync::OnceLock<Unstarted>,
    /// Retries the request has made so far, of every leg and attempt: what
    /// `[routing.retries] attempts` bounds ([`crate::handoff::Shared::prefill`] draws on it too).
    pub retried: &'a Arc<AtomicU32>,
}

/// The engine whose failure ended an attempt that nothing depended on yet: no byte reached the
/// client and no KV transfer began (the engine never saw the request, refused it with a 503, or,
/// where its partial work cannot reach a decoder, cut the connection before answering). The mode
/// marks it ([`Leg::retry`]) where it knows; the driver then routes the request again without
/// that engine, within the retry budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unstarted {
    /// This prefiller (by name).
    Prefill(String),
    /// The request's decoder.
    Decode,
}

/// A handoff mode: the strategy the driver runs a request through once it is admitted and routed.
pub trait Handoff: Send + Sync + std::fmt::Debug {
    /// Slots a prompt of `prompt_tokens` takes on this decoder: by default one per request (the
    /// decoder's own scheduler owns its KV cache).
    fn slots_for(&self, _prompt_tokens: usize) -> u32 {
        1
    }

    /// Refuses, before any room is taken, a request the mode cannot serve as asked (by default it
    /// serves every valid request).
    fn accepts(&self, _req: &GenRequest) -> Result<(), GatewayError> {
        Ok(())
    }

    /// Takes the request's room on the decoder: by default `need` slots of the decoder's queue
    /// (FIFO within the ticket's class, waiting at most its wait and `queue_timeout`).
    fn admit<'a>(
        &'a self,
        dec: &'a Decoder,
        need: u32,
        ticket: Ticket,
        queue_timeout: std::time::Duration,
    ) -> BoxFuture<'a, Result<Option<SlotGuard>, GatewayError>> {
        Box::pin(queue_admit(dec, need, ticket, queue_timeout))
    }

    /// Whether the decoder can serve a request by itself, computing its prompt, when it holds
    /// nearly all of it ([`Leg::alone`]): not by default (the mode's decoders expect their KV from
    /// a prefill leg).
    fn serves_alone(&self) -> bool {
        false
    }

    /// Runs the legs: prefill, wait for the KV, decode; the decoder's answer (streamed or whole).
    fn run<'a>(&'a self, leg: Leg<'a>) -> BoxFuture<'a, Result<Response<RespBody>, GatewayError>>;

    /// What `/admin/decoders` shows of this decoder beyond the common part.
    fn view(&self) -> BoxFuture<'_, Value> {
        Box::pin(async { Value::Null })
    }

    /// The mode's own series for `/metrics` (labelled with `decoder`).
    fn metrics(&self, _decoder: &str, _out: &mut Scrape) {}

    /// The data-plane certificates its connections use, for the gateway's certificate watcher
    /// to reload (`native` with `[dataplane_tls]`).
    fn dataplane_certs(&self) -> Option<&crate::endpoints::DataplaneCerts> {
        None
    }
}
