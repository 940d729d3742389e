use std::time::Duration;

use proptest::prelude::*;
use tokio::task::JoinHandle;

use super::*;

const LONG: Duration = Duration::from_secs(3600);

fn q(capacity: u32) -> SlotQueue {
    SlotQueue::new(capacity, QueueConfig::default())
}

fn spawn_acquire(
    q: &SlotQueue,
    slots: u32,
    class: u8,
    timeout: Duration,
) -> JoinHandle<Result<SlotGuard, AdmissionError>> {
    let q = q.clone();
    tokio::spawn(async move { q.acquire(slots, class, timeout).await })
}

/// Lets spawned tasks run until they block.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn too_large_is_refused_at_once_exact_fit_waits() {
    let q = q(10);
    assert_eq!(
        q.acquire(11, 0, LONG).await.unwrap_err(),
        AdmissionError::TooLarge { need: 11, capacity: 10 }
    );
    assert_eq!(
        AdmissionError::TooLarge { need: 11, capacity: 10 }.to_string(),
        "request needs 11 slots but the decoder buffer holds 10"
    );
    let small = q.acquire(1, 0, LONG).await.unwrap();
    let whole = spawn_acquire(&q, 10, 0, LONG);
    settle().await;
    assert_eq!(q.stats().waiting, 1, "a request needing the whole buffer waits");
    drop(small);
    let whole = whole.await.unwrap().unwrap();
    assert_eq!(q.stats().in_use, 10);
    drop(whole);
    assert_eq!(q.stats().in_use, 0);
}

#[tokio::test(start_paused = true)]
async fn the_head_is_never_overtaken() {
    let q = q(10);
    let a = q.acquire(8, 0, LONG).await.unwrap();
    let big = spawn_acquire(&q, 5, 0, LONG);
    settle().await;
    // One slot would fit now, but the 5-slot request is ahead of it.
    let small = spawn_acquire(&q, 1, 0, LONG);
    settle().await;
    assert_eq!(q.stats().waiting, 2);
    assert_eq!(q.stats().in_use, 8);
    drop(a);
    let big = big.await.unwrap().unwrap();
    let small = small.await.unwrap().unwrap();
    assert_eq!((big.slots(), small.slots(), q.stats().in_use), (5, 1, 6));
}

#[tokio::test(start_paused = true)]
async fn queue_length_and_wait_are_bounded() {
    let q = SlotQueue::new(1, QueueConfig { max_queue: 2, ..QueueConfig::default() });
    let held = q.acquire(1, 0, LONG).await.unwrap();
    let w1 = spawn_acquire(&q, 1, 0, Duration::from_secs(5));
    let w2 = spawn_acquire(&q, 1, 0, LONG);
    settle().await;
    assert_eq!(q.acquire(1, 0, LONG).await.unwrap_err(), AdmissionError::QueueFull { limit: 2 });
    tokio::time::advance(Duration::from_secs(5)).await;
    let e = w1.await.unwrap().unwrap_err();
    assert!(matches!(e, AdmissionError::Timeout { need: 1, .. }) && e.retryable(), "{e:?}");
    // The timed-out waiter left the queue: the one behind it is next.
    assert_eq!(q.stats().waiting, 1);
    drop(held);
    assert!(w2.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_leaves_unblocks_those_behind_it() {
    let q = q(4);
    let held = q.acquire(3, 0, LONG).await.unwrap();
    let big = spawn_acquire(&q, 4, 0, LONG);
    settle().await;
    let small = spawn_acquire(&q, 1, 0, LONG);
    settle().await;
    assert_eq!(q.stats().waiting, 2);
    // The client of the big request disconnects: its acquire future is dropped.
    big.abort();
    let _ = big.await;
    let small = small.await.unwrap().unwrap();
    assert_eq!(q.stats().in_use, 4);
    assert_eq!(q.stats().waiting, 0);
    drop((held, small));
    assert_eq!(q.stats().in_use, 0);
}

#[tokio::test(start_paused = true)]
async fn classes_share_by_weight() {
    let q = SlotQueue::new(1, QueueConfig { weights: vec![(1, 2.0), (0, 1.0)], ..QueueConfig::default() });
    let held = q.acquire(1, 0, LONG).await.unwrap();
    let mut waiters = Vec::new();
    for i in 0..30 {
        waiters.push((1u8, spawn_acquire(&q, 1, 1, LONG)));
        waiters.push((0u8, spawn_acquire(&q, 1, 0, LONG)));
        if i == 0 {
            settle().await;
        }
    }
    settle().await;
    drop(held);
    // Serve 30 grants one at a time and count who got them.
    let mut order = Vec::new();
    let mut pending: Vec<_> = waiters;
    for _ in 0..30 {
        settle().await;
        let at = pending.iter().position(|(_, h)| h.is_finished()).expect("someone was granted");
        let (class, h) = pending.remove(at);
        let guard = h.await.unwrap().unwrap();
        order.push(class);
        drop(guard);
    }
    let high = order.iter().filter(|c| **c == 1).count();
    assert!((18..=22).contains(&high), "weight 2:1 should give about 20 of 30, got {high}: {order:?}");
    for (_, h) in pending {
        h.abort();
    }
}

#[tokio::test(start_paused = true)]
async fn shrinking_capacity_refuses_waiters_that_no_longer_fit() {
    let q = q(10);
    let held = q.acquire(6, 0, LONG).await.unwrap();
    let w = spawn_acquire(&q, 8, 0, LONG);
    settle().await;
    q.resize(7);
    assert_eq!(w.await.unwrap().unwrap_err(), AdmissionError::TooLarge { need: 8, capacity: 7 });
    let w = spawn_acquire(&q, 4, 0, LONG);
    settle().await;
    q.resize(12);
    assert!(w.await.unwrap().is_ok());
    drop(held);
}

#[derive(Debug, Clone)]
struct Req {
    slots: u32,
    class: u8,
    hold_ms: u64,
    timeout_ms: u64,
    start_ms: u64,
}

fn run_random(capacity: u32, reqs: Vec<Req>) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
    rt.block_on(async move {
        let q = SlotQueue::new(capacity, QueueConfig { max_queue: 64, weights: vec![(2, 3.0)] });
        let mut tasks = Vec::new();
        for r in reqs.clone() {
            let q = q.clone();
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(r.start_ms)).await;
                match q.acquire(r.slots, r.class, Duration::from_millis(r.timeout_ms)).await {
                    Ok(g) => {
                        tokio::time::sleep(Duration::from_millis(r.hold_ms)).await;
                        drop(g);
                        Ok(true)
                    }
                    Err(AdmissionError::TooLarge { .. }) if r.slots > capacity => Ok(false),
                    Err(AdmissionError::TooLarge { .. }) => {
                        Err("fitting request refused as too large".to_owned())
                    }
                    Err(_) => Ok(false),
                }
            }));
        }
        // Watch the invariant while everything runs.
        for _ in 0..2000 {
            let s = q.stats();
            prop_assert!(s.in_use <= s.capacity, "over-committed: {s:?}");
            // The counter routing reads agrees with the waiters actually queued.
            prop_assert_eq!(q.load().waiting_slots, s.waiting_slots);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        for t in tasks {
            t.await.unwrap().map_err(TestCaseError::fail)?;
        }
        let s = q.stats();
        prop_assert_eq!((s.in_use, s.waiting, s.accounting_errors), (0, 0, 0));
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Random arrivals, sizes, classes, holds and deadlines: never over capacity, every slot back,
    /// nobody left waiting.
    #[test]
    fn random_load_never_over_commits_or_leaks(
        capacity in 1u32..16,
        reqs in proptest::collection::vec(
            (1u32..20, 0u8..3, 0u64..50, 1u64..200, 0u64..300)
                .prop_map(|(slots, class, hold_ms, timeout_ms, start_ms)| Req { slots, class, hold_ms, timeout_ms, start_ms }),
            1..40,
        ),
    ) {
        run_random(capacity, reqs)?;
    }
}

#[tokio::test(start_paused = true)]
async fn load_counts_the_requests_holding_slots() {
    let q = SlotQueue::new(10, QueueConfig::default());
    let a = q.acquire(3, 0, LONG).await.unwrap();
    let b = q.acquire(7, 0, LONG).await.unwrap();
    let c = spawn_acquire(&q, 2, 0, LONG);
    tokio::task::yield_now().await;
    assert_eq!(
        q.load(),
        QueueLoad {
            capacity: 10,
            in_use: 10,
            waiting_slots: 2,
            holders: 2,
            open: true,
            waiting: 1,
            share: None
        }
    );
    drop(a);
    let c = c.await.unwrap().unwrap();
    assert_eq!(q.load().holders, 2, "the waiter took the freed room");
    drop((b, c));
    assert_eq!(
        q.load(),
        QueueLoad {
            capacity: 10,
            in_use: 0,
            waiting_slots: 0,
            holders: 0,
            open: true,
            waiting: 0,
            share: None
        }
    );
}

/// A closed queue admits nothing, not even one request with nothing in flight; its waiters keep
/// their places and their order, and opening it admits them.
#[tokio::test(start_paused = true)]
async fn a_closed_queue_admits_none_until_opened() {
    let q = q(10);
    q.set_open(false);
    assert_eq!(q.load().free(), 0);
    assert!(!q.stats().open);
    let err = q.acquire(1, 0, Duration::from_millis(50)).await.unwrap_err();
    assert!(matches!(err, AdmissionError::Timeout { need: 1, .. }), "{err:?}");
    assert_eq!(q.stats().in_use, 0);
    let (a, b) = (q.clone(), q.clone());
    let first = tokio::spawn(async move { a.acquire(4, 0, Duration::from_secs(60)).await });
    tokio::task::yield_now().await;
    let second = tokio::spawn(async move { b.acquire(8, 0, Duration::from_secs(60)).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!((q.stats().waiting, q.stats().in_use), (2, 0));
    // Closing does not refuse a request the open buffer could hold.
    assert_eq!(q.stats().capacity, 10);
    q.set_open(true);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.slots(), 4);
    assert_eq!((q.stats().waiting, q.stats().in_use), (1, 4), "the second waits for room, in order");
    drop(first);
    assert_eq!(second.await.unwrap().unwrap().slots(), 8);
}

/// A replica's share of the decoder (`[cluster]`) bounds what it admits, below the buffer: a
/// request larger than the share waits (it is not refused as too large), the demand says what it
/// needs, a smaller share keeps what is held and admits nothing more until it drains, and a larger
/// one admits the waiter at once.
#[tokio::test(start_paused = true)]
async fn a_share_bounds_admission_below_the_buffer_and_growing_it_admits_waiters() {
    let q = q(10);
    let demand = Arc::new(tokio::sync::Notify::new());
    q.watch_demand(Arc::clone(&demand));
    q.set_share(Some(4));
    assert_eq!((q.load().free(), q.load().limit()), (4, 4));
    let held = q.acquire(3, 0, Duration::from_secs(1)).await.unwrap();
    let waiter = spawn_acquire(&q, 6, 0, Duration::from_secs(60));
    settle().await;
    // Told, so the cluster asks the store for more at once.
    tokio::time::timeout(Duration::from_millis(1), demand.notified()).await.unwrap();
    let d = q.demand();
    assert_eq!((d.in_use, d.want, d.head), (3, 9, 6));
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(q.demand().head_age, Duration::from_millis(250));
    // Shrunk below what is held: the slots stay held, nothing more is admitted.
    q.set_share(Some(2));
    assert_eq!(q.load().free(), 0);
    assert!(q.acquire(1, 0, Duration::from_millis(10)).await.is_err());
    // Grown: the waiter goes at once.
    q.set_share(Some(9));
    let w = waiter.await.unwrap().unwrap();
    assert_eq!((q.stats().in_use, q.stats().share), (9, Some(9)));
    drop((held, w));
    assert_eq!(q.demand(), Demand { in_use: 0, want: 0, head: 0, head_age: Duration::ZERO });
    // No share: the whole buffer.
    q.set_share(None);
    assert_eq!(q.load().free(), 10);
}

#[tokio::test(start_paused = true)]
async fn a_slot_the_engine_may_still_run_is_held_its_grace_after_it_is_dropped() {
    let q = q(2);
    let grace = Duration::from_millis(100);
    // Abandoned while the engine ran it: held the grace longer, and counted.
    let mut a = q.acquire(2, 0, LONG).await.unwrap();
    a.engine_has_it(grace);
    drop(a);
    assert_eq!(q.stats().in_use, 2);
    assert_eq!(q.stats().lingered, 1);
    tokio::time::sleep(grace - Duration::from_millis(1)).await;
    assert_eq!(q.stats().in_use, 2);
    tokio::time::sleep(Duration::from_millis(2)).await;
    assert_eq!(q.stats().in_use, 0);
    // Its answer ended (or it never reached the engine): released at once.
    let mut b = q.acquire(2, 0, LONG).await.unwrap();
    b.engine_has_it(grace);
    b.engine_done();
    drop(b);
    assert_eq!(q.stats().in_use, 0);
    assert_eq!(q.stats().lingered, 1);
    // Held the grace first (a drain after a cut-off call), then dropped while an engine may run
    // it again: held both times, counted once.
    let mut c = q.acquire(2, 0, LONG).await.unwrap();
    c.wait_out(grace).await;
    assert_eq!((q.stats().in_use, q.stats().lingered), (2, 2));
    c.engine_has_it(grace);
    drop(c);
    assert_eq!((q.stats().in_use, q.stats().lingered), (2, 2));
    tokio::time::sleep(grace + Duration::from_millis(1)).await;
    assert_eq!(q.stats().in_use, 0);
}
