//! The typed calls of each world, with the checks on what a plugin answers.

use std::sync::Arc;
use std::time::Duration;

use wasmtime::Store;

use super::worlds::admission::exports::baton::policy::admission_policy as wa;
use super::worlds::routing::exports::baton::policy::routing_policy as wr;
use super::worlds::v0_1::admission::baton::policy::types as t0_1;
use super::worlds::v0_1::admission::exports::baton::policy::admission_policy as wa0_1;
use super::worlds::v0_1::routing::exports::baton::policy::routing_policy as wr0_1;
use super::worlds::{Admission, Ctx, Routing};
use super::{AdmissionWorld, Direct, Fault, Plugin, RoutingWorld};
use crate::routing::{Candidates, Decision, Route};

pub use super::worlds::admission::baton::policy::types::{Header, Request as PolicyRequest};
pub use wa::{QueueState, Usage};

/// A loaded admission plugin.
pub type AdmissionPlugin = Plugin<AdmissionWorld>;
/// A loaded routing plugin.
pub type RoutingPlugin = Plugin<RoutingWorld>;

/// Longest rejection message passed to a client (bytes); longer ones are cut.
pub const MAX_MESSAGE_BYTES: usize = 512;

/// An admission decision, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Into the queue, in this class, waiting at most `max_wait` (the gateway's timeout when `None`).
    Queue {
        class: u8,
        max_wait: Option<Duration>,
    },
    Reject {
        status: u16,
        message: String,
        retry_after_s: Option<u32>,
    },
}

/// Why a plugin's admission answer is refused (a fault: the built-in decides instead).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum InvalidAdmit {
    /// A rejection must be a client or server error, which the gateway sends as it is.
    #[error("reject status {status} is outside 400-599")]
    RejectStatus { status: u16 },
}

/// Checks a plugin's admission answer; `Err` names what was out of range.
fn check_admit(d: wa::Decision) -> Result<Admit, InvalidAdmit> {
    Ok(match d {
        wa::Decision::Admit(class) => Admit::Queue { class, max_wait: None },
        wa::Decision::Queue(q) => {
            Admit::Queue { class: q.priority, max_wait: Some(Duration::from_millis(q.max_wait_ms.into())) }
        }
        wa::Decision::Reject(r) => {
            if !(400..=599).contains(&r.status) {
                return Err(InvalidAdmit::RejectStatus { status: r.status });
            }
            let end = r.message.floor_char_boundary(MAX_MESSAGE_BYTES);
            let message = r.message.get(..end).unwrap_or("").to_owned();
            Admit::Reject { status: r.status, message, retry_after_s: r.retry_after_s }
        }
    })
}

fn to_decision(d: wr::Decision) -> Decision {
    match d {
        wr::Decision::UseDefault => Decision::Default,
        wr::Decision::Pairs(p) => Decision::Route(
            p.into_iter()
                .map(|r| Route {
                    prefill: usize::try_from(r.prefill).unwrap_or(usize::MAX),
                    decode: usize::try_from(r.decode).unwrap_or(usize::MAX),
                })
                .collect(),
        ),
    }
}

fn u32s<T: Copy + TryInto<u32>>(v: &[T]) -> Vec<u32> {
    v.iter().map(|&x| x.try_into().unwrap_or(u32::MAX)).collect()
}

/// The candidate lists in the WIT's shape.
pub fn views(c: &Candidates) -> (wr::PrefillView, wr::DecodeView) {
    (
        wr::PrefillView {
            healthy: c.prefill.healthy.to_vec(),
            in_flight: c.prefill.in_flight.to_vec(),
            latency_us: c.prefill.latency_us.to_vec(),
            cached_tokens: c.prefill.cached_tokens.to_vec(),
            pending_tokens: c.prefill.pending_tokens.to_vec(),
        },
        wr::DecodeView {
            healthy: c.decode.healthy.to_vec(),
            slots_needed: c.decode.slots_needed.to_vec(),
            capacity_slots: c.decode.capacity_slots.to_vec(),
            free_slots: c.decode.free_slots.to_vec(),
            waiting_slots: u32s(&c.decode.waiting_slots),
            in_flight: c.decode.in_flight.to_vec(),
            cached_tokens: c.decode.cached_tokens.to_vec(),
        },
    )
}

/// A request as a 0.1.0 plugin sees it (the same fields).
fn request_0_1(r: &PolicyRequest) -> t0_1::Request {
    t0_1::Request {
        model: r.model.clone(),
        endpoint: r.endpoint.clone(),
        tenant: r.tenant.clone(),
        prompt_tokens: r.prompt_tokens,
        slots: r.slots,
        max_tokens: r.max_tokens,
        priority: r.priority.clone(),
        prefix_hash: r.prefix_hash,
        headers: r
            .headers
            .iter()
            .map(|h| t0_1::Header { name: h.name.clone(), value: h.value.clone() })
            .collect(),
    }
}

/// The calls of the admission world, in the component's version.
impl Admission {
    fn admit(
        &self,
        s: &mut Store<Ctx>,
        req: &PolicyRequest,
        q: QueueState,
    ) -> wasmtime::Result<wa::Decision> {
        let b = match self {
            Self::Current(b) => return b.baton_policy_admission_policy().call_admit(s, req, q),
            Self::V0_1(b) => b.baton_policy_admission_policy(),
        };
        let q = wa0_1::QueueState {
            capacity_slots: q.capacity_slots,
            free_slots: q.free_slots,
            waiting_requests: q.waiting_requests,
            waiting_slots: q.waiting_slots,
        };
        Ok(match b.call_admit(s, &request_0_1(req), q)? {
            wa0_1::Decision::Admit(class) => wa::Decision::Admit(class),
            wa0_1::Decision::Queue(q) => {
                wa::Decision::Queue(wa::Queued { priority: q.priority, max_wait_ms: q.max_wait_ms })
            }
            wa0_1::Decision::Reject(r) => wa::Decision::Reject(wa::Rejection {
                status: r.status,
                message: r.message,
                retry_after_s: r.retry_after_s,
            }),
        })
    }

    fn on_complete(&self, s: &mut Store<Ctx>, req: &PolicyRequest, u: Usage) -> wasmtime::Result<()> {
        match self {
            Self::Current(b) => b.baton_policy_admission_policy().call_on_complete(s, req, u),
            Self::V0_1(b) => {
                let u = wa0_1::Usage {
                    prompt_tokens: u.prompt_tokens,
                    completion_tokens: u.completion_tokens,
                    status: u.status,
                };
                b.baton_policy_admission_policy().call_on_complete(s, &request_0_1(req), u)
            }
        }
    }
}

/// The calls of the routing world, in the component's version (0.1.0 sees no `cached-tokens` nor
/// `pending-tokens`).
impl Routing {
    fn route(
        &self,
        s: &mut Store<Ctx>,
        req: &PolicyRequest,
        p: &wr::PrefillView,
        d: &wr::DecodeView,
    ) -> wasmtime::Result<wr::Decision> {
        let b = match self {
            Self::Current(b) => return b.baton_policy_routing_policy().call_route(s, req, p, d),
            Self::V0_1(b) => b.baton_policy_routing_policy(),
        };
        let p0 = wr0_1::PrefillView {
            healthy: p.healthy.clone(),
            in_flight: p.in_flight.clone(),
            latency_us: p.latency_us.clone(),
        };
        let d0 = wr0_1::DecodeView {
            healthy: d.healthy.clone(),
            slots_needed: d.slots_needed.clone(),
            capacity_slots: d.capacity_slots.clone(),
            free_slots: d.free_slots.clone(),
            waiting_slots: d.waiting_slots.clone(),
            in_flight: d.in_flight.clone(),
        };
        Ok(match b.call_route(s, &request_0_1(req), &p0, &d0)? {
            wr0_1::Decision::UseDefault => wr::Decision::UseDefault,
            wr0_1::Decision::Pairs(pairs) => wr::Decision::Pairs(
                pairs.into_iter().map(|x| wr::Pair { prefill: x.prefill, decode: x.decode }).collect(),
            ),
        })
    }
}

impl Plugin<AdmissionWorld> {
    /// The plugin's decision, or `None` when the built-in decides.
    pub async fn admit(self: &Arc<Self>, req: Arc<PolicyRequest>, q: QueueState) -> Option<Admit> {
        let d = self.call(move |b, s| b.admit(s, &req, q)).await?;
        self.checked(d)
    }

    fn checked(&self, d: wa::Decision) -> Option<Admit> {
        match check_admit(d) {
            Ok(a) => Some(a),
            Err(e) => {
                self.fault(&self.version(), Fault::Invalid, &e.to_string());
                None
            }
        }
    }

    /// Tells the plugin a request it admitted has ended: on the plugin's threads without waiting
    /// (dropped when it is busy or off, and counted), or inline.
    pub fn complete(self: &Arc<Self>, req: Arc<PolicyRequest>, usage: Usage) {
        let v = self.version();
        if v.disabled.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if v.spec.inline {
            self.call_inline(&v, |b, s| b.on_complete(s, &req, usage));
            return;
        }
        let me = Arc::clone(self);
        self.send(Box::new(move |live| {
            me.run(&v, live, |b, s| b.on_complete(s, &req, usage));
        }));
    }
}

impl Direct<AdmissionWorld> {
    pub fn admit(&mut self, req: &PolicyRequest, q: QueueState) -> Option<Admit> {
        let d = self.run(|b, s| b.admit(s, req, q))?;
        self.plugin.checked(d)
    }

    pub fn complete(&mut self, req: &PolicyRequest, usage: Usage) -> Option<()> {
        self.run(|b, s| b.on_complete(s, req, usage))
    }
}

impl Plugin<RoutingWorld> {
    /// The plugin's decision (not yet checked against the candidates: the router does that and
    /// reports an invalid one back with [`Plugin::invalid`]), or `None` when the built-in decides.
    pub async fn route(self: &Arc<Self>, req: Arc<PolicyRequest>, c: &Candidates) -> Option<Decision> {
        let (p, d) = views(c);
        let r = self.call(move |b, s| b.route(s, &req, &p, &d)).await?;
        Some(to_decision(r))
    }
}

impl Direct<RoutingWorld> {
    pub fn route(
        &mut self,
        req: &PolicyRequest,
        p: &wr::PrefillView,
        d: &wr::DecodeView,
    ) -> Option<Decision> {
        self.run(|b, s| b.route(s, req, p, d)).map(to_decision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reject(status: u16, message: String) -> wa::Decision {
        wa::Decision::Reject(wa::Rejection { status, message, retry_after_s: Some(3) })
    }

    #[test]
    fn a_long_rejection_message_is_cut_at_a_character_boundary() {
        // 3-byte characters: 512 bytes fall inside the 171st, so 170 are kept (510 bytes).
        let a = check_admit(reject(429, "€".repeat(300)));
        assert_eq!(a, Ok(Admit::Reject { status: 429, message: "€".repeat(170), retry_after_s: Some(3) }));
        let short = check_admit(reject(503, "later".into()));
        assert_eq!(short, Ok(Admit::Reject { status: 503, message: "later".into(), retry_after_s: Some(3) }));
    }

    #[test]
    fn a_status_outside_the_client_and_server_errors_is_refused() {
        for status in [42, 302, 600] {
            assert_eq!(check_admit(reject(status, "bad".into())), Err(InvalidAdmit::RejectStatus { status }));
        }
        assert_eq!(
            InvalidAdmit::RejectStatus { status: 302 }.to_string(),
            "reject status 302 is outside 400-599"
        );
    }
}
