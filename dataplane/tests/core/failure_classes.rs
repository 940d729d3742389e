//! One test per failure class in DESIGN.md's table. Each says which construction it checks and is
//! written so that removing that construction makes it fail.

use std::time::{Duration, Instant};

use baton_dataplane::readiness::{Aggregator, Outcome, Progress};
use baton_dataplane::{
    BeginWrite, LeaseError, NotReady, PrefixKey, ReleaseReason, ReserveError, ReserveRequest, TerminalState,
    WriteError, WriteOutcome,
};

use crate::common::{QUARANTINE, Rig, content, key};

fn req(rig: &Rig, k: u128, chunks: u32) -> ReserveRequest<'static> {
    ReserveRequest { key: key(k), chunks, prefixes: &[], lease: rig.lease(30) }
}

/// Writes every published chunk of a reservation with its deterministic bytes.
fn fill(rig: &Rig, res: &mut baton_dataplane::Reservation<baton_dataplane::device::cpu::CpuDevice>) {
    let k = res.key();
    for (chunk, addr) in res.publish() {
        let bytes = content(u64::from(chunk) + 1000 * k.request.0 as u64, 0, rig.buf.page_bytes());
        rig.buf.write_chunk(k, chunk, addr, &bytes).unwrap();
    }
}

/// Buffer deadlock. Construction: all-or-nothing reservation of every page before the first byte
/// moves. Three producers each need 5 of 8 pages and deliver chunks interleaved. If pages were taken
/// one at a time as chunks arrive (LMCache's allocator), two requests would each hold some pages and
/// neither could finish; here a refused reservation takes nothing and every request completes.
#[test]
fn buffer_deadlock_all_or_nothing_reservation() {
    let rig = Rig::new(8);
    let mut waiting: Vec<u128> = vec![1, 2, 3];
    let mut active = Vec::new();
    let mut completed = Vec::new();
    for _round in 0..20 {
        // Admit whatever fits, in order; a refusal must leave the free count untouched.
        while let Some(&k) = waiting.first() {
            let before = rig.free();
            match rig.buf.reserve(req(&rig, k, 5)) {
                Ok(mut r) => {
                    let addrs = r.publish();
                    active.push((r, addrs, 0usize));
                    waiting.remove(0);
                }
                Err(ReserveError::Busy { need: 5, free }) => {
                    assert_eq!(free, before);
                    assert_eq!(rig.free(), before, "a refused reservation must take no page");
                    break;
                }
                Err(e) => panic!("unexpected {e}"),
            }
        }
        // Producers deliver one chunk each per round, interleaved.
        for (r, addrs, next) in active.iter_mut() {
            if let Some((chunk, addr)) = addrs.get(*next) {
                let bytes = content(u64::from(*chunk), 0, rig.buf.page_bytes());
                rig.buf.write_chunk(r.key(), *chunk, *addr, &bytes).unwrap();
                *next += 1;
            }
        }
        // Ready requests are consumed and release their pages.
        let mut still = Vec::new();
        for (r, addrs, next) in active.drain(..) {
            match r.try_ready() {
                Ok(ready) => {
                    completed.push(ready.key());
                    ready.consume().unwrap().finish();
                }
                Err(NotReady::Pending(r)) => still.push((r, addrs, next)),
                Err(NotReady::Closed(e)) => panic!("closed: {e}"),
            }
        }
        active = still;
        if waiting.is_empty() && active.is_empty() {
            break;
        }
    }
    assert_eq!(completed, vec![key(1), key(2), key(3)], "every request completes, in order");
    assert_eq!(rig.free(), 8);
    rig.buf.check_invariants().unwrap();
}

/// Oversized request. Construction: the reservation compares the need with the whole buffer first
/// and answers `TooLarge` at once, naming both numbers; a request that needs exactly the whole
/// buffer is admitted (alone).
#[test]
fn oversized_request_rejected_at_once_exact_fit_admitted() {
    let rig = Rig::new(16);
    let err = rig.buf.reserve(req(&rig, 1, 17)).unwrap_err();
    assert_eq!(err, ReserveError::TooLarge { need: 17, capacity: 16 });
    assert_eq!(err.to_string(), "request needs 17 pages but the buffer holds 16");
    // While something else holds pages, a fitting request is Busy (retry), never TooLarge.
    let small = rig.buf.reserve(req(&rig, 2, 1)).unwrap();
    assert_eq!(rig.buf.reserve(req(&rig, 3, 16)).unwrap_err(), ReserveError::Busy { need: 16, free: 15 });
    drop(small);
    let mut whole = rig.buf.reserve(req(&rig, 3, 16)).unwrap();
    fill(&rig, &mut whole);
    let Ok(ready) = whole.try_ready() else { panic!("whole-buffer request not ready") };
    ready.consume().unwrap().finish();
    assert_eq!(rig.free(), 16);
}

/// Slot leak on cancel. Construction: every state is an owned guard whose `Drop` releases. Dropping at
/// each point of the lifecycle (including while unwinding from a panic, the equivalent of a cancelled
/// future at an await point) returns every page, with exactly one terminal status and one release.
#[test]
fn slot_leak_on_cancel_every_state_releases_once() {
    #[derive(Debug, Clone, Copy)]
    enum Point {
        Unpublished,
        PublishedNothingWritten,
        HalfWritten,
        MidWrite,
        Ready,
        Consuming,
        Panic,
    }
    for point in [
        Point::Unpublished,
        Point::PublishedNothingWritten,
        Point::HalfWritten,
        Point::MidWrite,
        Point::Ready,
        Point::Consuming,
        Point::Panic,
    ] {
        let rig = Rig::new(8);
        let k = key(1);
        let mut res = rig.buf.reserve(req(&rig, 1, 4)).unwrap();
        let page_bytes = rig.buf.page_bytes();
        match point {
            Point::Unpublished => drop(res),
            Point::PublishedNothingWritten => {
                res.publish();
                drop(res);
            }
            Point::HalfWritten => {
                let addrs = res.publish();
                for (c, a) in &addrs[..2] {
                    rig.buf.write_chunk(k, *c, *a, &vec![1; page_bytes]).unwrap();
                }
                drop(res);
            }
            Point::MidWrite => {
                let addrs = res.publish();
                let BeginWrite::Write(mut w) = rig.buf.begin_write(k, addrs[0].0, addrs[0].1).unwrap() else {
                    panic!("duplicate")
                };
                w.write(&vec![1; page_bytes / 2]).unwrap();
                drop(res); // cancelled while a write is in flight
                // The page being written cannot be freed under the writer.
                assert!(rig.free() < 8);
                rig.buf.fence(k);
                assert!(rig.free() < 8, "a page with a writer in flight went back to the pool");
                // The producer finishes its copy: the commit is refused, the orphaned page goes back.
                w.write(&vec![1; page_bytes - page_bytes / 2]).unwrap();
                assert!(matches!(w.commit(), Err(WriteError::Cancelled { .. })));
            }
            Point::Ready | Point::Consuming => {
                fill(&rig, &mut res);
                let ready = res.try_ready().map_err(|_| "not ready").unwrap();
                if let Point::Consuming = point {
                    let c = ready.consume().unwrap();
                    drop(c);
                } else {
                    drop(ready);
                }
            }
            Point::Panic => {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                    let _held = res;
                    panic!("handler failed");
                }));
                assert!(r.is_err());
            }
        }
        // Producers fence after a cancel; quarantined pages come back then.
        rig.buf.fence(k);
        assert_eq!(rig.free(), 8, "{point:?}: pages leaked");
        assert_eq!(rig.buf.stats().requests, 0, "{point:?}: request still tracked");
        let (statuses, releases) = rig.drain();
        assert_eq!(statuses.len(), 1, "{point:?}: {statuses:?}");
        assert_eq!(releases.len(), 1, "{point:?}: {releases:?}");
        let want = if matches!(point, Point::Ready | Point::Consuming) {
            TerminalState::Ready
        } else {
            TerminalState::Cancelled
        };
        assert_eq!(statuses[0].state, want, "{point:?}");
        rig.buf.check_invariants().unwrap();
    }
}

/// Double pin / missing unpin / double unpin. Construction: lookups are `&self` and change nothing;
/// a share is an owned handle (not `Clone`), returned by `Drop` exactly once.
#[test]
fn pins_are_owned_guards_and_lookups_have_no_side_effect() {
    let rig = Rig::new(4);
    let prefix = [PrefixKey(42)];
    let mut a = rig
        .buf
        .reserve(ReserveRequest { key: key(1), chunks: 1, prefixes: &prefix, lease: rig.lease(30) })
        .unwrap();
    fill(&rig, &mut a);
    let before = rig.buf.stats();
    for _ in 0..1000 {
        assert!(rig.buf.has_prefix(PrefixKey(42)));
    }
    assert_eq!(rig.buf.stats(), before, "a lookup changed the accounting (the LMCache pin-on-lookup leak)");

    let share = rig.buf.share_prefix(PrefixKey(42)).unwrap();
    assert_eq!(rig.buf.stats().shared_handles, 1);
    // The owner finishes; the shared page must stay (missing unpin would free it under the reader).
    a.try_ready().map_err(|_| "not ready").unwrap().consume().unwrap().finish();
    assert_eq!(rig.free(), 3, "a shared page was freed while shared");
    let mut got = vec![0; rig.buf.page_bytes()];
    share.read(&mut got).unwrap();
    assert_eq!(got, content(1000, 0, rig.buf.page_bytes()));
    drop(share); // released exactly once; there is no second call to make
    assert_eq!(rig.free(), 4);
    assert_eq!(rig.buf.stats().shared_handles, 0);
    rig.buf.check_invariants().unwrap();

    // None of the guards can be cloned: a clone would be a second release.
    struct Probe<T>(std::marker::PhantomData<T>);
    trait NotClone {
        fn is_clone(&self) -> bool {
            false
        }
    }
    impl<T> NotClone for Probe<T> {}
    #[allow(dead_code)]
    impl<T: Clone> Probe<T> {
        fn is_clone(&self) -> bool {
            true
        }
    }
    type D = baton_dataplane::device::cpu::CpuDevice;
    use baton_dataplane::{Consuming, PageWriter, Ready, Reservation, SharedChunk};
    assert!(!Probe::<SharedChunk<D>>(std::marker::PhantomData).is_clone());
    assert!(!Probe::<Reservation<D>>(std::marker::PhantomData).is_clone());
    assert!(!Probe::<Ready<D>>(std::marker::PhantomData).is_clone());
    assert!(!Probe::<Consuming<D>>(std::marker::PhantomData).is_clone());
    assert!(!Probe::<PageWriter<D>>(std::marker::PhantomData).is_clone());
    assert!(Probe::<String>(std::marker::PhantomData).is_clone(), "the probe itself works");
}

/// Stranded blocks. Construction: every reservation is a lease reaped by a deadline-ordered timer,
/// and expiry bumps page generations. Leases are inserted out of deadline order; a reaper that walked
/// insertion order (and stopped at the first live lease) would miss the expired one. A late write to
/// an expired request's page fails loudly instead of landing in a reused page.
#[test]
fn stranded_blocks_reaped_in_deadline_order_and_late_writes_fail() {
    let rig = Rig::new(8);
    let now = rig.buf.now();
    let lease = |s| now + Duration::from_secs(s);
    let _a =
        rig.buf.reserve(ReserveRequest { key: key(1), chunks: 2, prefixes: &[], lease: lease(10) }).unwrap();
    let mut b =
        rig.buf.reserve(ReserveRequest { key: key(2), chunks: 2, prefixes: &[], lease: lease(5) }).unwrap();
    let _c =
        rig.buf.reserve(ReserveRequest { key: key(3), chunks: 2, prefixes: &[], lease: lease(20) }).unwrap();
    let addrs = b.publish();
    rig.clock.advance(Duration::from_secs(6));
    assert_eq!(rig.buf.reap(), 1);
    let (statuses, _) = rig.drain();
    assert_eq!(statuses.len(), 1);
    assert_eq!((statuses[0].key(), statuses[0].state), (key(2), TerminalState::Expired));
    // The late producer: its address is stale now.
    let late = rig.buf.write_chunk(key(2), addrs[0].0, addrs[0].1, &vec![0; rig.buf.page_bytes()]);
    assert!(matches!(late, Err(WriteError::Stale { .. })), "{late:?}");
    assert!(matches!(b.renew(lease(100)), Err(LeaseError::Expired)));
    // Quarantined until the deadline (the producer never fences: it is dead), then free.
    assert_eq!(rig.buf.stats().pages.quarantined, 2);
    rig.clock.advance(QUARANTINE);
    rig.buf.reap();
    assert_eq!(rig.buf.stats().pages.quarantined, 0);
    assert_eq!(rig.free(), 4);
    let (_, releases) = rig.drain();
    assert_eq!(releases.len(), 1);
    assert_eq!(releases[0].reason, ReleaseReason::QuarantineTimeout);
    drop(b);
    assert_eq!(rig.drain(), (vec![], vec![]), "a dropped expired guard says nothing twice");

    // A ready request that nobody consumes (the gateway died): its lease frees it too.
    let mut d = rig
        .buf
        .reserve(ReserveRequest { key: key(4), chunks: 1, prefixes: &[], lease: rig.lease(3) })
        .unwrap();
    fill(&rig, &mut d);
    rig.clock.advance(Duration::from_secs(4));
    rig.buf.reap();
    let ready = d.try_ready();
    assert!(matches!(ready, Err(NotReady::Closed(LeaseError::Expired))));
    rig.clock.advance(Duration::from_secs(30));
    rig.buf.reap();
    assert_eq!(rig.free(), 8);
    rig.buf.check_invariants().unwrap();
}

/// Cross-rank barrier deadlock. Construction: no barrier; each rank emits exactly one terminal status
/// on its own schedule and the aggregator is idempotent and order-independent. Four ranks fill in
/// different orders; every arrival order of their statuses, with duplicates, gives Ready exactly once.
#[test]
fn cross_rank_readiness_is_order_independent_without_barriers() {
    let clock = std::sync::Arc::new(baton_dataplane::ManualClock::new());
    let ranks: Vec<Rig> = (0..4).map(|r| Rig::with_clock(8, r, clock.clone())).collect();
    let k = key(9);
    let mut reservations = Vec::new();
    for (r, rig) in ranks.iter().enumerate() {
        let mut res = rig
            .buf
            .reserve(ReserveRequest { key: k, chunks: 3, prefixes: &[], lease: rig.lease(30) })
            .unwrap();
        let mut addrs = res.publish();
        // Each rank receives its chunks in a different order.
        addrs.rotate_left(r % 3);
        if r % 2 == 1 {
            addrs.reverse();
        }
        for (c, a) in addrs {
            rig.buf.write_chunk(k, c, a, &vec![r as u8; rig.buf.page_bytes()]).unwrap();
        }
        reservations.push(res);
    }
    let statuses: Vec<_> = ranks.iter().flat_map(|r| r.drain().0).collect();
    assert_eq!(statuses.len(), 4, "exactly one terminal status per rank");
    assert!(statuses.iter().all(|s| s.state == TerminalState::Ready && s.chunks == 3));

    fn permutations(n: usize) -> Vec<Vec<usize>> {
        if n == 0 {
            return vec![vec![]];
        }
        let mut out = Vec::new();
        for p in permutations(n - 1) {
            for i in 0..=p.len() {
                let mut q = p.clone();
                q.insert(i, n - 1);
                out.push(q);
            }
        }
        out
    }
    let t0 = Instant::now();
    for order in permutations(4) {
        let mut agg = Aggregator::new(k, 4, t0 + Duration::from_secs(1)).unwrap();
        // Each status twice in a row: duplicates arrive before the request is complete, so one
        // counted twice would complete it early.
        let mut distinct = 0;
        for (n, &i) in order.iter().flat_map(|i| [i, i]).enumerate() {
            if n % 2 == 0 {
                distinct += 1;
            }
            let p = agg.observe(&statuses[i], t0).unwrap();
            if distinct < 4 {
                assert_eq!(p, Progress::Pending { ready: distinct, ranks: 4 }, "{order:?}, delivery {n}");
            } else {
                assert_eq!(p, Progress::Done(Outcome::Ready), "{order:?}, delivery {n}");
            }
        }
        // Stable through more duplicates once done.
        for &i in &order {
            assert_eq!(agg.observe(&statuses[i], t0), Ok(Progress::Done(Outcome::Ready)), "{order:?}");
        }
    }
}

/// Lost or absent readiness. Construction: a zero-chunk request is ready at once (no write would ever
/// signal it); the aggregator has a deadline and fails fast on any rank's failure.
#[test]
fn lost_or_absent_readiness_zero_chunk_ready_and_deadlines() {
    let rig = Rig::new(4);
    let res = rig.buf.reserve(req(&rig, 1, 0)).unwrap();
    let (statuses, _) = rig.drain();
    assert_eq!(statuses.len(), 1, "a zero-chunk request signals READY at once");
    assert_eq!(statuses[0].state, TerminalState::Ready);
    assert!(res.try_ready().is_ok());

    let t0 = Instant::now();
    let k = key(2);
    let mut agg = Aggregator::new(k, 2, t0 + Duration::from_secs(5)).unwrap();
    let ready0 = baton_dataplane::RankStatus {
        request: k.request,
        epoch: 0,
        rank: 0,
        state: TerminalState::Ready,
        chunks: 1,
        bytes: 64,
    };
    assert_eq!(agg.observe(&ready0, t0).unwrap(), Progress::Pending { ready: 1, ranks: 2 });
    assert_eq!(agg.poll(t0 + Duration::from_millis(4999)), None);
    assert_eq!(
        agg.poll(t0 + Duration::from_secs(5)),
        Some(Outcome::TimedOut { missing: 1 }),
        "a silent rank times out"
    );

    let mut agg = Aggregator::new(k, 8, t0 + Duration::from_secs(5)).unwrap();
    let failed = baton_dataplane::RankStatus { rank: 3, state: TerminalState::Failed, ..ready0 };
    assert_eq!(
        agg.observe(&failed, t0).unwrap(),
        Progress::Done(Outcome::Failed { rank: 3, state: TerminalState::Failed }),
        "one rank's failure fails the request without waiting for the other seven"
    );
}

/// Early release. Construction: pages are held from READY until the decoder's `Consuming` guard is
/// dropped; "pages released" is emitted only then. READY frees nothing.
#[test]
fn early_release_pages_held_until_consumed() {
    let rig = Rig::new(8);
    let mut res = rig.buf.reserve(req(&rig, 1, 3)).unwrap();
    let addrs = res.publish();
    for (i, (c, a)) in addrs.iter().enumerate() {
        let out = rig.buf.write_chunk(key(1), *c, *a, &vec![7; rig.buf.page_bytes()]).unwrap();
        assert_eq!(out, WriteOutcome::Stored { ready: i == 2 });
    }
    // Duplicate delivery is idempotent.
    assert_eq!(
        rig.buf.write_chunk(key(1), addrs[0].0, addrs[0].1, &vec![7; rig.buf.page_bytes()]).unwrap(),
        WriteOutcome::Duplicate
    );
    let (statuses, releases) = rig.drain();
    assert_eq!(statuses.len(), 1);
    assert_eq!(statuses[0].state, TerminalState::Ready);
    assert!(releases.is_empty(), "released at READY");
    assert_eq!(rig.free(), 5, "READY must not free pages: the decoder has not moved them out");
    let consuming = res.try_ready().map_err(|_| "not ready").unwrap().consume().unwrap();
    assert_eq!(rig.buf.stats().pages.consuming, 3);
    let mut page = vec![0; rig.buf.page_bytes()];
    consuming.read_chunk(2, &mut page).unwrap();
    assert_eq!(page, vec![7; rig.buf.page_bytes()]);
    assert_eq!(rig.free(), 5);
    consuming.finish();
    assert_eq!(rig.free(), 8);
    let (_, releases) = rig.drain();
    assert_eq!(releases.len(), 1);
    assert_eq!(releases[0].reason, ReleaseReason::Consumed);
    assert_eq!(releases[0].pages, 3);
}
