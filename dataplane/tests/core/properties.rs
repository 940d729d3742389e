//! Property tests: random interleavings of reserve (sometimes larger than the whole buffer) /
//! publish / arrive / duplicate arrive / aborted write / cancel / expire / renew / consume / share /
//! prefix lookup / fence across several requests and ranks. After every step each rank's accounting
//! balances and no page has two owners (`check_invariants`); a lookup or a refused reservation
//! changes nothing; "pages released" is never emitted while the request still holds a guard on
//! that rank; every byte read back is the byte written; at the end every request reached exactly
//! one terminal state and one release per rank (by its deadline) and every page is free.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_dataplane::device::Device;
use baton_dataplane::device::cpu::CpuDevice;
use baton_dataplane::{
    BeginWrite, Clock, Consuming, ManualClock, NotReady, PageAddr, PrefixKey, Ready, Reservation,
    ReserveError, ReserveRequest, SharedChunk, TerminalState,
};
use proptest::prelude::*;

use crate::common::{QUARANTINE, Rig, content, key};

const RANKS: usize = 2;
const REQUESTS: u128 = 4;
const PAGES: u32 = 6;

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Reserve {
        req: u128,
        chunks: u32,
        prefixed: bool,
        lease_ms: u64,
        publish: bool,
    },
    Publish {
        req: u128,
    },
    Arrive {
        req: u128,
        rank: usize,
        idx: usize,
    },
    /// Every chunk of the request to one rank, each twice (duplicates must be harmless).
    ArriveAll {
        req: u128,
        rank: usize,
    },
    AbortedWrite {
        req: u128,
        rank: usize,
        idx: usize,
    },
    Cancel {
        req: u128,
    },
    Renew {
        req: u128,
        ms: u64,
    },
    Advance {
        ms: u64,
    },
    Consume {
        req: u128,
        rank: usize,
    },
    Finish {
        req: u128,
        rank: usize,
    },
    Share {
        rank: usize,
        chunk: u64,
    },
    /// The side-effect-free prefix query.
    Lookup {
        rank: usize,
        chunk: u64,
    },
    Unshare {
        rank: usize,
    },
    Fence {
        req: u128,
        rank: usize,
    },
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
    let req = 0..REQUESTS;
    let rank = 0..RANKS;
    prop_oneof![
        // Up to two pages more than the buffer holds: those are refused whole, at once.
        4 => (req.clone(), 0u32..=PAGES + 2, any::<bool>(), 200u64..6000, prop::bool::weighted(0.8))
            .prop_map(|(req, chunks, prefixed, lease_ms, publish)| Op::Reserve { req, chunks, prefixed, lease_ms, publish }),
        1 => req.clone().prop_map(|req| Op::Publish { req }),
        3 => (req.clone(), rank.clone(), 0usize..5).prop_map(|(req, rank, idx)| Op::Arrive { req, rank, idx }),
        4 => (req.clone(), rank.clone()).prop_map(|(req, rank)| Op::ArriveAll { req, rank }),
        1 => (req.clone(), rank.clone(), 0usize..5).prop_map(|(req, rank, idx)| Op::AbortedWrite { req, rank, idx }),
        1 => req.clone().prop_map(|req| Op::Cancel { req }),
        1 => (req.clone(), 50u64..3000).prop_map(|(req, ms)| Op::Renew { req, ms }),
        2 => (1u64..1000).prop_map(|ms| Op::Advance { ms }),
        8 => (req.clone(), rank.clone()).prop_map(|(req, rank)| Op::Consume { req, rank }),
        2 => (req.clone(), rank.clone()).prop_map(|(req, rank)| Op::Finish { req, rank }),
        1 => (rank.clone(), 0u64..3).prop_map(|(rank, chunk)| Op::Share { rank, chunk }),
        1 => (rank.clone(), 0u64..4).prop_map(|(rank, chunk)| Op::Lookup { rank, chunk }),
        1 => rank.clone().prop_map(|rank| Op::Unshare { rank }),
        1 => (req, rank).prop_map(|(req, rank)| Op::Fence { req, rank }),
    ]
}

enum Guard<D: Device> {
    Res(Reservation<D>),
    Ready(Ready<D>),
    Cons(#[allow(dead_code)] Consuming<D>),
}

struct Req<D: Device> {
    epoch: u32,
    chunks: u32,
    prefixed: bool,
    lease: Instant,
    guards: Vec<Option<Guard<D>>>,
    addrs: Vec<Vec<(u32, PageAddr)>>,
}

/// Content id of chunk `c` of request `r`: prefixed requests share their leading chunks' content, so
/// a shared page must read back as the same bytes for everyone.
fn content_id(r: u128, prefixed: bool, c: u32) -> u64 {
    if prefixed { 1_000_000 + u64::from(c) } else { (r as u64) * 100 + u64::from(c) }
}

const PREFIXES: [PrefixKey; 4] = [PrefixKey(1), PrefixKey(2), PrefixKey(3), PrefixKey(4)];

/// Ready → consuming, reading back and checking every byte of every chunk, owned or shared.
fn consume<D: Device>(
    ready: Ready<D>,
    req: u128,
    rank: usize,
    prefixed: bool,
    chunks: u32,
    page_bytes: usize,
) -> Result<Option<Guard<D>>, TestCaseError> {
    let Ok(c) = ready.consume() else { return Ok(None) };
    for chunk in 0..chunks {
        let mut got = vec![0; page_bytes];
        c.read_chunk(chunk, &mut got).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let want = content(content_id(req, prefixed, chunk), rank as u32, page_bytes);
        prop_assert_eq!(got, want, "request {} chunk {} rank {}", req, chunk, rank);
    }
    Ok(Some(Guard::Cons(c)))
}

/// The lifecycle model run against buffers on `device` (the CPU reference, or a GPU).
pub(crate) fn run<D: Device>(device: &Arc<D>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let clock = Arc::new(ManualClock::new());
    let rigs: Vec<Rig<D>> =
        (0..RANKS).map(|r| Rig::with_device(Arc::clone(device), PAGES, r as u32, clock.clone())).collect();
    let page_bytes = rigs[0].buf.page_bytes();
    let mut reqs: HashMap<u128, Req<D>> = HashMap::new();
    let mut epochs: HashMap<u128, u32> = HashMap::new();
    let mut shares: Vec<Vec<SharedChunk<D>>> = (0..RANKS).map(|_| Vec::new()).collect();
    // Terminal statuses and releases seen per (request, epoch, rank).
    let mut terminals: HashMap<(u128, u32, u32), Vec<TerminalState>> = HashMap::new();
    let mut releases: HashMap<(u128, u32, u32), u32> = HashMap::new();
    // Every (request, epoch, rank) that ever held a reservation.
    let mut reserved_on: Vec<(u128, u32, u32)> = Vec::new();

    let collect = |rigs: &[Rig<D>], terminals: &mut HashMap<_, Vec<_>>, releases: &mut HashMap<_, u32>| {
        for rig in rigs {
            let (s, r) = rig.drain();
            for s in s {
                terminals.entry((s.request.0, s.epoch, s.rank)).or_default().push(s.state);
            }
            for r in r {
                *releases.entry((r.key.request.0, r.key.epoch, r.rank)).or_default() += 1;
            }
        }
    };

    for op in ops {
        let now = clock.now();
        match op {
            Op::Reserve { req, chunks, prefixed, lease_ms, publish } => {
                if reqs.contains_key(&req) {
                    continue;
                }
                let epoch = *epochs.entry(req).and_modify(|e| *e += 1).or_insert(0);
                let k = baton_dataplane::RequestKey::new(key(req).request, epoch);
                let lease = now + Duration::from_millis(lease_ms);
                let prefixes: &[PrefixKey] = if prefixed { &PREFIXES } else { &[] };
                // All ranks or none, as the gateway does.
                let mut got = Vec::new();
                for (rank, rig) in rigs.iter().enumerate() {
                    let before = rig.buf.stats();
                    match rig.buf.reserve(ReserveRequest { key: k, chunks, prefixes, lease }) {
                        Ok(r) => {
                            prop_assert!(
                                chunks <= PAGES,
                                "{} chunks reserved in a {}-page buffer",
                                chunks,
                                PAGES
                            );
                            got.push(Some(Guard::Res(r)));
                            reserved_on.push((req, epoch, rank as u32));
                        }
                        Err(e) => {
                            if chunks > PAGES {
                                prop_assert_eq!(e, ReserveError::TooLarge { need: chunks, capacity: PAGES });
                            }
                            // A refusal holds nothing.
                            prop_assert_eq!(rig.buf.stats(), before);
                            break;
                        }
                    }
                }
                if got.len() == RANKS {
                    let mut addrs = vec![Vec::new(); RANKS];
                    if publish {
                        for (rank, g) in got.iter_mut().enumerate() {
                            if let Some(Guard::Res(res)) = g {
                                addrs[rank] = res.publish();
                            }
                        }
                    }
                    reqs.insert(req, Req { epoch, chunks, prefixed, lease, guards: got, addrs });
                }
            }
            Op::Publish { req } => {
                if let Some(r) = reqs.get_mut(&req) {
                    for (rank, g) in r.guards.iter_mut().enumerate() {
                        if let Some(Guard::Res(res)) = g {
                            r.addrs[rank] = res.publish();
                        }
                    }
                }
            }
            Op::Arrive { req, rank, idx } => {
                let Some(r) = reqs.get(&req) else { continue };
                let Some(&(chunk, addr)) = r.addrs[rank].get(idx % r.addrs[rank].len().max(1)) else {
                    continue;
                };
                let k = baton_dataplane::RequestKey::new(key(req).request, r.epoch);
                let bytes = content(content_id(req, r.prefixed, chunk), rank as u32, page_bytes);
                // Errors are fine (expired, cancelled, stale); corruption is not, and is checked below.
                let _ = rigs[rank].buf.write_chunk(k, chunk, addr, &bytes);
            }
            Op::ArriveAll { req, rank } => {
                let Some(r) = reqs.get(&req) else { continue };
                let k = baton_dataplane::RequestKey::new(key(req).request, r.epoch);
                for &(chunk, addr) in r.addrs[rank].iter().chain(r.addrs[rank].iter()) {
                    let bytes = content(content_id(req, r.prefixed, chunk), rank as u32, page_bytes);
                    let _ = rigs[rank].buf.write_chunk(k, chunk, addr, &bytes);
                }
            }
            Op::AbortedWrite { req, rank, idx } => {
                let Some(r) = reqs.get(&req) else { continue };
                let Some(&(chunk, addr)) = r.addrs[rank].get(idx % r.addrs[rank].len().max(1)) else {
                    continue;
                };
                let k = baton_dataplane::RequestKey::new(key(req).request, r.epoch);
                if let Ok(BeginWrite::Write(mut w)) = rigs[rank].buf.begin_write(k, chunk, addr) {
                    let _ = w.write(&vec![0xEE; page_bytes / 2]);
                    // Dropped uncommitted: the chunk did not arrive and may be written again.
                }
            }
            Op::Cancel { req } => {
                reqs.remove(&req);
            }
            Op::Renew { req, ms } => {
                if let Some(r) = reqs.get_mut(&req) {
                    let lease = now + Duration::from_millis(ms);
                    let mut all = true;
                    for g in r.guards.iter().flatten() {
                        if let Guard::Res(res) = g {
                            all &= res.renew(lease).is_ok();
                        }
                    }
                    if all {
                        r.lease = lease;
                    }
                }
            }
            Op::Advance { ms } => {
                clock.advance(Duration::from_millis(ms));
                for rig in &rigs {
                    rig.buf.reap();
                }
                collect(&rigs, &mut terminals, &mut releases);
                // By its deadline: every reservation still filling whose lease passed has a terminal.
                let now = clock.now();
                for (id, r) in &reqs {
                    for (rank, g) in r.guards.iter().enumerate() {
                        if let Some(Guard::Res(_)) = g
                            && r.lease <= now
                        {
                            let t = terminals.get(&(*id, r.epoch, rank as u32));
                            prop_assert!(
                                t.is_some_and(|t| t.len() == 1),
                                "request {id} rank {rank} past its lease without a terminal"
                            );
                        }
                    }
                }
            }
            Op::Consume { req, rank } => {
                let Some(r) = reqs.get_mut(&req) else { continue };
                let (prefixed, chunks) = (r.prefixed, r.chunks);
                let g = r.guards[rank].take();
                r.guards[rank] = match g {
                    Some(Guard::Res(res)) => match res.try_ready() {
                        // Sometimes hold the ready state for a while (its lease still runs).
                        Ok(ready) if req % 2 == 0 => Some(Guard::Ready(ready)),
                        Ok(ready) => consume(ready, req, rank, prefixed, chunks, page_bytes)?,
                        Err(NotReady::Pending(res)) => Some(Guard::Res(res)),
                        Err(NotReady::Closed(_)) => None,
                    },
                    Some(Guard::Ready(ready)) => consume(ready, req, rank, prefixed, chunks, page_bytes)?,
                    other => other,
                };
            }
            Op::Finish { req, rank } => {
                if let Some(r) = reqs.get_mut(&req)
                    && matches!(r.guards[rank], Some(Guard::Cons(_)))
                {
                    r.guards[rank] = None;
                }
            }
            Op::Share { rank, chunk } => {
                if let Some(s) = rigs[rank].buf.share_prefix(PREFIXES[chunk as usize]) {
                    shares[rank].push(s);
                }
            }
            Op::Lookup { rank, chunk } => {
                let before: Vec<_> = rigs.iter().map(|r| r.buf.stats()).collect();
                let found = rigs[rank].buf.has_prefix(PREFIXES[chunk as usize]);
                let after: Vec<_> = rigs.iter().map(|r| r.buf.stats()).collect();
                prop_assert_eq!(before, after, "a lookup changed the accounting");
                // It answers what sharing would find.
                let shared = rigs[rank].buf.share_prefix(PREFIXES[chunk as usize]);
                prop_assert_eq!(found, shared.is_some());
            }
            Op::Unshare { rank } => {
                shares[rank].pop();
            }
            Op::Fence { req, rank } => {
                let epoch = epochs.get(&req).copied().unwrap_or(0);
                rigs[rank].buf.fence(baton_dataplane::RequestKey::new(key(req).request, epoch));
            }
        }
        for rig in &rigs {
            rig.buf.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
            let s = rig.buf.stats();
            prop_assert_eq!(s.pages.sum(), u64::from(PAGES));
        }
        // "Pages released" only once nothing of the request is held on that rank: never while it is
        // being consumed, and while its reservation or readiness guard lives only once its lease
        // has passed (early release: the decoder must be done with the pages).
        let released_before = releases.clone();
        collect(&rigs, &mut terminals, &mut releases);
        let now = clock.now();
        for (k3 @ (id, epoch, rank), n) in &releases {
            if released_before.get(k3) == Some(n) {
                continue;
            }
            if let Some(r) = reqs.get(id).filter(|r| r.epoch == *epoch) {
                let early = match &r.guards[*rank as usize] {
                    None => false,
                    Some(Guard::Cons(_)) => true,
                    Some(Guard::Res(_) | Guard::Ready(_)) => r.lease > now,
                };
                prop_assert!(
                    !early,
                    "request {}#{} released on rank {} while a guard still holds it",
                    id,
                    epoch,
                    rank
                );
            }
        }
    }

    // Drop everything, let every deadline pass, and account.
    reqs.clear();
    shares.clear();
    clock.advance(Duration::from_secs(10) + QUARANTINE);
    for rig in &rigs {
        rig.buf.reap();
        clock.advance(QUARANTINE);
        rig.buf.reap();
    }
    collect(&rigs, &mut terminals, &mut releases);
    for rig in &rigs {
        let s = rig.buf.stats();
        prop_assert_eq!(s.pages.free, PAGES, "rank {} not clean: {:?}", rig.buf.rank(), s);
        prop_assert_eq!(s.requests, 0);
        rig.buf.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    for ((req, epoch, rank), states) in &terminals {
        prop_assert_eq!(states.len(), 1, "request {}#{} rank {}: {:?}", req, epoch, rank, states);
        prop_assert_eq!(
            releases.get(&(*req, *epoch, *rank)).copied(),
            Some(1),
            "request {}#{} rank {} releases",
            req,
            epoch,
            rank
        );
    }
    // Every reservation reached exactly one terminal state and one release on its rank, and nothing
    // else did.
    for k3 in &reserved_on {
        prop_assert_eq!(terminals.get(k3).map(Vec::len), Some(1), "no single terminal for {:?}", k3);
    }
    prop_assert_eq!(terminals.len(), reserved_on.len());
    prop_assert_eq!(releases.len(), reserved_on.len());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_shrink_iters: 2000, ..ProptestConfig::default() })]

    #[test]
    fn lifecycle_interleavings_keep_accounting_and_terminate(ops in proptest::collection::vec(op(), 1..80)) {
        run(&Arc::new(CpuDevice), ops)?;
    }
}

/// The readiness aggregator against a reference model: any arrival order of any rank's (single)
/// terminal status, each possibly repeated, gives the outcome the model predicts: READY only when every
/// rank is READY, otherwise the first non-READY rank to arrive; never a second, different outcome.
fn aggregate(ranks: u32, states: Vec<bool>, order: Vec<(usize, u8)>) -> Result<(), TestCaseError> {
    use baton_dataplane::readiness::{Aggregator, Outcome, Progress};
    use baton_dataplane::{RankStatus, RequestId, RequestKey};
    let key = RequestKey::new(RequestId(1), 3);
    let t0 = Instant::now();
    let mut agg = Aggregator::new(key, ranks, t0 + Duration::from_secs(1))
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut decided: Option<Outcome> = None;
    let mut seen = vec![false; ranks as usize];
    let mut first_failure = None;
    for (pick, repeats) in order {
        let rank = pick % ranks as usize;
        let state = if states[rank] { TerminalState::Ready } else { TerminalState::Failed };
        for _ in 0..=repeats {
            let s = RankStatus {
                request: key.request,
                epoch: key.epoch,
                rank: rank as u32,
                state,
                chunks: 1,
                bytes: 0,
            };
            let p = agg.observe(&s, t0).map_err(|e| TestCaseError::fail(e.to_string()))?;
            if !seen[rank] && !states[rank] && first_failure.is_none() && decided.is_none() {
                first_failure = Some(rank as u32);
            }
            seen[rank] = true;
            if let Progress::Done(o) = p {
                if let Some(d) = decided {
                    prop_assert_eq!(d, o, "the outcome changed");
                }
                decided = Some(o);
            }
        }
    }
    let want = if let Some(rank) = first_failure {
        Some(Outcome::Failed { rank, state: TerminalState::Failed })
    } else if seen.iter().all(|s| *s) {
        Some(Outcome::Ready)
    } else {
        None
    };
    prop_assert_eq!(decided, want);
    prop_assert_eq!(agg.poll(t0), want);
    if want.is_none() {
        let missing = seen.iter().filter(|s| !**s).count() as u32;
        prop_assert_eq!(agg.poll(t0 + Duration::from_secs(1)), Some(Outcome::TimedOut { missing }));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn readiness_is_idempotent_and_order_independent(
        ranks in 1u32..9,
        states in proptest::collection::vec(prop::bool::weighted(0.85), 8),
        order in proptest::collection::vec((0usize..8, 0u8..3), 0..24),
    ) {
        aggregate(ranks, states, order)?;
    }
}
