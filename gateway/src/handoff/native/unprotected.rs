//! TEST SUPPORT, never reachable from configuration: the native mode with its protections off, to
//! show what they prevent. No admission, and decoder pages taken one chunk at a time as the chunks
//! would arrive (as LMCache's PD buffer allocates), each held while the next is awaited: hold and
//! wait, the deadlock's precondition. Under contention every request ends up holding part of the
//! buffer and waiting for pages nobody will free (`gateway/tests/e2e.rs` shows the wedge).

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_dataplane::RequestKey;
use hyper::Response;
use serde_json::Value;

use super::{Native, RESERVE_BACKOFF, Ranks};
use crate::admission::{SlotGuard, SlotQueue, Ticket};
use crate::api::{GatewayError, Waited};

use crate::handoff::{
    BoxFuture, CheckedDecoder, CheckedMode, Decoder, Handoff, Leg, ModeSpec, RespBody, Shared,
};
use crate::handoff::{StartContext, StartError};

/// A native decoder whose requests take their pages chunk by chunk, without admission.
#[derive(Debug)]
pub struct Unprotected(Native);

/// Starts `d` (a native pool) with its protections off; the demo's
/// `crate::demo::start_gateway_with` takes this in place of [`CheckedDecoder::start`].
pub fn start(d: CheckedDecoder, ctx: &StartContext) -> BoxFuture<'_, Result<Arc<Decoder>, StartError>> {
    Box::pin(async move {
        let CheckedMode::Native(c) = d.mode else {
            return Err(StartError::Decoder {
                decoder: d.name,
                reason: "only a native decoder can run unprotected".into(),
            });
        };
        let queue = SlotQueue::new(0, ctx.queue.clone());
        let native = Native::connect(d.name.clone(), c, ctx, &queue)
            .await
            .map_err(|source| StartError::DataPlane { decoder: d.name.clone(), source })?;
        Ok(Arc::new(Decoder::new(d.name, d.http, queue, Native::NAME, Box::new(Unprotected(native)))))
    })
}

impl Unprotected {
    /// Takes the request's pages one chunk at a time, holding each while waiting for the next,
    /// then gives them back for the native leg to reserve the request as a whole.
    async fn hold_chunk_by_chunk(&self, chunks: u32) -> Result<(), GatewayError> {
        let (shared, dec) = (&self.0.shared, &self.0.ranks);
        let mut held = ChunkHolds { shared: Arc::clone(shared), ranks: Arc::clone(dec), keys: Vec::new() };
        let give_up = Instant::now() + shared.limits.queue_timeout;
        while held.keys.len() < chunks as usize {
            let key = shared.keys.next();
            // Marked held before the call, so a client that leaves mid-call still cancels it.
            held.keys.push(key);
            match dec.reserve(key, 1, shared.limits.lease, &[]).await {
                Ok(Some(_)) => {}
                Ok(None) if Instant::now() < give_up => {
                    // `reserve` gave back what it got: nothing of `key` is held.
                    held.keys.pop();
                    tokio::time::sleep(RESERVE_BACKOFF).await;
                }
                Ok(None) => {
                    return Err(GatewayError::QueueTimeout(Waited::Pages { decoder: dec.name.clone() }));
                }
                Err(e) => {
                    return Err(GatewayError::Upstream { leg: "decoder data plane", message: e.to_string() });
                }
            }
        }
        // Given back one by one, each forgotten only once cancelled: a client that leaves part-way
        // leaves the rest to the guard's Drop.
        while let Some(&k) = held.keys.last() {
            dec.cancel(k, true).await;
            held.keys.pop();
        }
        Ok(())
    }
}

impl Handoff for Unprotected {
    fn slots_for(&self, prompt_tokens: usize) -> u32 {
        self.0.slots_for(prompt_tokens)
    }

    fn admit<'a>(
        &'a self,
        _dec: &'a Decoder,
        need: u32,
        _ticket: Ticket,
        _queue_timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<SlotGuard>, GatewayError>> {
        Box::pin(async move { self.hold_chunk_by_chunk(need).await.map(|()| None) })
    }

    fn run<'a>(&'a self, leg: Leg<'a>) -> BoxFuture<'a, Result<Response<RespBody>, GatewayError>> {
        self.0.run(leg)
    }

    fn view(&self) -> BoxFuture<'_, Value> {
        self.0.view()
    }
}

/// Single-chunk reservations held by [`Unprotected::hold_chunk_by_chunk`]; cancelled on drop.
struct ChunkHolds {
    shared: Arc<Shared>,
    ranks: Arc<Ranks>,
    keys: Vec<RequestKey>,
}

impl Drop for ChunkHolds {
    fn drop(&mut self) {
        let (dec, keys) = (Arc::clone(&self.ranks), std::mem::take(&mut self.keys));
        if keys.is_empty() {
            return;
        }
        self.shared.spawn_from_drop(async move {
            for k in keys {
                dec.cancel(k, true).await;
            }
        });
    }
}
