#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use hyper::HeaderMap;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::*;

fn bands3() -> FlowConfig {
    let mut c = FlowConfig::fair(Duration::from_secs(30));
    let band = |name: &str, priority| Band {
        name: name.into(),
        priority,
        max_requests: DEFAULT_BAND_MAX_REQUESTS,
        max_bytes: DEFAULT_BAND_MAX_BYTES,
    };
    c.bands = vec![band("high", 10), band("low", 0), band("shed", -1)];
    c.default_band = 1;
    c
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, v.parse().unwrap());
    }
    h
}

fn id(f: &FlowControl, tenant: &str, pairs: &[(&'static str, &str)]) -> Identity {
    f.identify(&headers(pairs), Some(tenant), Instant::now()).unwrap()
}

/// Queues a request that finds no room; it resolves to its tenant once let go.
fn queue(f: &Arc<FlowControl>, ident: Identity, tokens: usize) -> JoinHandle<Result<Admitted, Refused>> {
    let f = Arc::clone(f);
    tokio::spawn(async move {
        let ask = Ask { tokens, bytes: 100, plugin_wait: None, max_tokens: None };
        f.enter(&ident, ask, |_| false, |_| {}).await
    })
}

/// Lets go every waiter, one at a time, in the order flow control picks; returns the tenants in
/// that order.
async fn drain(
    f: &Arc<FlowControl>,
    handles: Vec<(String, JoinHandle<Result<Admitted, Refused>>)>,
) -> Vec<String> {
    tokio::task::yield_now().await;
    let mut order = Vec::new();
    let mut pending = handles;
    while f.next(|_| true).is_some() {
        tokio::task::yield_now().await;
        let done = pending.iter().position(|(_, h)| h.is_finished()).expect("one was let go");
        let (tenant, h) = pending.remove(done);
        let admitted = h.await.unwrap().unwrap();
        assert!(admitted.queued);
        order.push(tenant);
    }
    assert!(pending.is_empty());
    order
}

#[tokio::test(start_paused = true)]
async fn a_higher_band_goes_first_and_a_sheddable_one_never_waits() {
    let f = FlowControl::new(bands3());
    let mut hs = Vec::new();
    for i in 0..3 {
        hs.push((format!("low{i}"), queue(&f, id(&f, "a", &[]), 10)));
    }
    tokio::task::yield_now().await;
    hs.push(("high".to_owned(), queue(&f, id(&f, "b", &[("x-priority", "high")]), 10)));
    // Sheddable: no room, so refused at once with a retry hint.
    let shed = id(&f, "c", &[("x-priority", "shed")]);
    let r = f
        .enter(&shed, Ask { tokens: 1, bytes: 1, plugin_wait: None, max_tokens: None }, |_| false, |_| {})
        .await
        .unwrap_err();
    assert_eq!((r.status(), r.code(), r.retry_after()), (429, "overloaded", Some(1)));
    let order = drain(&f, hs).await;
    assert_eq!(order, ["high", "low0", "low1", "low2"]);
    // An unknown band is the client's mistake.
    let e = f.identify(&headers(&[("x-priority", "gold")]), None, Instant::now()).unwrap_err();
    assert_eq!(e.status(), 400);
    assert!(e.to_string().contains("high, low, shed"), "{e}");
}

#[tokio::test(start_paused = true)]
async fn the_head_that_does_not_fit_is_not_overtaken() {
    let f = FlowControl::new(bands3());
    let big = queue(&f, id(&f, "a", &[("x-priority", "high")]), 1000);
    let small = queue(&f, id(&f, "b", &[]), 1);
    tokio::task::yield_now().await;
    // Room for the small one only: nothing goes, not even from the lower band.
    assert!(f.next(|t| t < 100).is_none());
    assert_eq!(f.queued(), 2);
    assert!(f.next(|_| true).is_some());
    tokio::task::yield_now().await;
    assert!(big.is_finished() && !small.is_finished());
    assert!(f.next(|_| true).is_some());
    small.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_tenant_cannot_promote_itself_past_its_cap() {
    let mut c = bands3();
    c.tenants.insert("capped".into(), TenantRule { max_band: Some(1), ..TenantRule::default() });
    let f = FlowControl::new(c);
    assert_eq!(id(&f, "capped", &[("x-priority", "high")]).band, 1);
    assert_eq!(id(&f, "other", &[("x-priority", "high")]).band, 0);
    // An objective maps to a band; one nobody mapped has the default.
    let mut c = bands3();
    c.objectives.insert("premium".into(), 0);
    let f = FlowControl::new(c);
    assert_eq!(id(&f, "x", &[("x-gateway-inference-objective", "premium")]).band, 0);
    assert_eq!(id(&f, "x", &[("x-gateway-inference-objective", "unknown")]).band, 1);
    // The fairness id is the flow only when trusted.
    let fid = [("x-gateway-inference-fairness-id", "team-7")];
    assert_eq!(&*id(&f, "key-tenant", &fid).tenant, "key-tenant");
    let mut c = bands3();
    c.trust_fairness_header = true;
    let f = FlowControl::new(c);
    assert_eq!(&*id(&f, "key-tenant", &fid).tenant, "team-7");
}

#[tokio::test(start_paused = true)]
async fn tenants_of_equal_weight_alternate_whatever_their_backlog() {
    let f = FlowControl::new(FlowConfig::fair(Duration::from_secs(30)));
    let mut hs = Vec::new();
    // The heavy tenant queues 8 first, the light one 3 after: fair share interleaves them.
    for _ in 0..8 {
        hs.push(("heavy".to_owned(), queue(&f, id(&f, "heavy", &[]), 100)));
    }
    tokio::task::yield_now().await;
    for _ in 0..3 {
        hs.push(("light".to_owned(), queue(&f, id(&f, "light", &[]), 100)));
    }
    let order = drain(&f, hs).await;
    // Tied at first, the light tenant's shorter queue goes first; then they alternate.
    let first_six: Vec<&str> = order.iter().take(6).map(String::as_str).collect();
    assert_eq!(first_six, ["light", "heavy", "light", "heavy", "light", "heavy"], "{order:?}");
}

#[tokio::test(start_paused = true)]
async fn weights_and_output_tokens_move_the_counters() {
    let mut c = FlowConfig::fair(Duration::from_secs(30));
    c.tenants.insert("gold".into(), TenantRule { weight: 3.0, ..TenantRule::default() });
    let f = FlowControl::new(c);
    let mut hs = Vec::new();
    for _ in 0..8 {
        hs.push(("gold".to_owned(), queue(&f, id(&f, "gold", &[]), 100)));
        hs.push(("plain".to_owned(), queue(&f, id(&f, "plain", &[]), 100)));
    }
    let order = drain(&f, hs).await;
    let gold = order.iter().take(8).filter(|t| *t == "gold").count();
    assert_eq!(gold, 6, "weight 3 against 1 gets three of every four: {order:?}");

    // Output is charged as it streams, at its cost (2 a token), 16 tokens or more at a time, and
    // the rest when the request ends.
    let f = FlowControl::new(FlowConfig::fair(Duration::from_secs(30)));
    let t = id(&f, "t", &[]);
    let mut a = f
        .enter(&t, Ask { tokens: 5, bytes: 1, plugin_wait: None, max_tokens: None }, |_| true, |_| {})
        .await
        .unwrap();
    assert!(!a.queued);
    let counted = |f: &FlowControl| {
        let v = f.view();
        (v["tenants"][0]["virtual_counter"].as_f64(), v["tenants"][0]["served_output_tokens"].as_u64())
    };
    a.charge.output(4);
    assert_eq!(counted(&f), (Some(5.0), Some(0)), "4 tokens wait for more");
    a.charge.output(20);
    assert_eq!(counted(&f), (Some(45.0), Some(20)));
    a.charge.output(25);
    a.charge.finish(25);
    assert_eq!(counted(&f), (Some(55.0), Some(25)));
}

#[tokio::test(start_paused = true)]
async fn a_tenant_back_from_idle_is_lifted_to_the_others() {
    let f = FlowControl::new(FlowConfig::fair(Duration::from_secs(30)));
    // "busy" is served a lot while "idle" sends nothing.
    for _ in 0..5 {
        let busy = id(&f, "busy", &[]);
        let a = f
            .enter(
                &busy,
                Ask { tokens: 1000, bytes: 1, plugin_wait: None, max_tokens: None },
                |_| true,
                |_| {},
            )
            .await;
        a.unwrap().charge.finish(0);
    }
    let mut hs = vec![("busy".to_owned(), queue(&f, id(&f, "busy", &[]), 1000))];
    tokio::task::yield_now().await;
    for _ in 0..3 {
        hs.push(("idle".to_owned(), queue(&f, id(&f, "idle", &[]), 1000)));
    }
    // Without the lift "idle" would take the next 5 turns with its counter at 0.
    let order = drain(&f, hs).await;
    assert_eq!(order, ["busy", "idle", "idle", "idle"], "ties go to the shorter queue");
    let v = f.view();
    let idle = v["tenants"].as_array().unwrap().iter().find(|t| t["tenant"] == "idle").unwrap();
    assert!(idle["virtual_counter"].as_f64().unwrap() >= 5000.0, "{v}");
}

#[tokio::test(start_paused = true)]
async fn a_deadline_that_passes_in_the_queue_refuses_the_request_and_frees_its_place() {
    let f = FlowControl::new(bands3());
    let started = Instant::now();
    let h = queue(&f, id(&f, "a", &[("x-request-deadline", "250")]), 10);
    let other = queue(&f, id(&f, "a", &[("x-stainless-timeout", "0.5")]), 10);
    let r = h.await.unwrap().unwrap_err();
    assert_eq!((r.status(), r.code()), (504, "deadline_exceeded"));
    assert!(r.to_string().contains("x-request-deadline"), "{r}");
    assert_eq!(started.elapsed(), Duration::from_millis(250));
    let r = other.await.unwrap().unwrap_err();
    assert!(r.to_string().contains("client's timeout"), "{r}");
    assert_eq!(f.queued(), 0);
    assert!(f.next(|_| true).is_none(), "nothing is let go after its deadline");
    let v = f.view();
    assert_eq!(v["bands"][1]["refused"]["deadline"], 2, "{v}");
    // The gateway's own wait is a 503 queue timeout.
    let mut c = bands3();
    c.max_wait = Duration::from_millis(100);
    let f = FlowControl::new(c);
    let r = queue(&f, id(&f, "a", &[]), 10).await.unwrap().unwrap_err();
    assert_eq!((r.status(), r.code()), (503, "queue_timeout"));
}

#[tokio::test(start_paused = true)]
async fn earliest_deadline_first_within_a_flow() {
    let mut c = bands3();
    c.within = Within::Edf;
    let f = FlowControl::new(c);
    let hs = vec![
        ("late".to_owned(), queue(&f, id(&f, "a", &[("x-request-deadline", "9000")]), 1)),
        ("soon".to_owned(), queue(&f, id(&f, "a", &[("x-request-deadline", "1000")]), 1)),
        ("none".to_owned(), queue(&f, id(&f, "a", &[]), 1)),
    ];
    assert_eq!(drain(&f, hs).await, ["soon", "late", "none"]);
}

#[tokio::test(start_paused = true)]
async fn a_band_holds_no_more_than_its_limits() {
    let mut c = bands3();
    c.bands[1].max_requests = 2;
    let f = FlowControl::new(c);
    let a = queue(&f, id(&f, "a", &[]), 1);
    let b = queue(&f, id(&f, "a", &[]), 1);
    tokio::task::yield_now().await;
    let r = queue(&f, id(&f, "a", &[]), 1).await.unwrap().unwrap_err();
    assert_eq!((r.status(), r.code()), (429, "queue_full"));
    // Another band still takes requests.
    let h = queue(&f, id(&f, "a", &[("x-priority", "high")]), 1);
    tokio::task::yield_now().await;
    assert_eq!(f.queued(), 3);
    drop((a, b, h));
}

#[tokio::test(start_paused = true)]
async fn a_budget_is_checked_before_and_charged_after() {
    let mut c = FlowConfig::fair(Duration::from_secs(30));
    let rule = BudgetRule { tokens_per_minute: 600, counts: Counts::Total };
    c.tenants.insert("metered".into(), TenantRule { budget: Some(rule), ..TenantRule::default() });
    let f = FlowControl::new(c);
    let ask = |tokens| Ask { tokens, bytes: 1, plugin_wait: None, max_tokens: None };
    let (metered, free) = (id(&f, "metered", &[]), id(&f, "free", &[]));
    let a = f.enter(&metered, ask(400), |_| true, |_| {}).await.unwrap();
    // Checked before: the next one's input fits what is left until the first is charged.
    let b = f.enter(&metered, ask(100), |_| true, |_| {}).await.unwrap();
    a.charge.finish(260);
    b.charge.finish(0);
    // 600 - 660 - 100 = -160 left: 160 + 100 to refill at 10 per second.
    let r = f.enter(&metered, ask(100), |_| true, |_| {}).await.unwrap_err();
    assert_eq!((r.status(), r.code(), r.retry_after()), (429, "rate_limit_exceeded", Some(26)));
    assert!(r.to_string().contains("600 tokens per minute (input + output)"), "{r}");
    // Other tenants have no budget.
    f.enter(&free, ask(100_000), |_| true, |_| {}).await.unwrap();
    tokio::time::advance(Duration::from_secs(26)).await;
    f.enter(&metered, ask(100), |_| true, |_| {}).await.unwrap();
    // A request refused or failed before its answer charges nothing.
    let v = f.view();
    let m = v["tenants"].as_array().unwrap().iter().find(|t| t["tenant"] == "metered").unwrap();
    assert_eq!(m["budget"]["refused"], 1, "{v}");
}

#[tokio::test(start_paused = true)]
async fn a_budget_holds_what_requests_in_flight_may_cost() {
    let mut c = FlowConfig::fair(Duration::from_secs(30));
    let rule = BudgetRule { tokens_per_minute: 600, counts: Counts::Total };
    c.tenants.insert("metered".into(), TenantRule { budget: Some(rule), ..TenantRule::default() });
    let f = FlowControl::new(c);
    let metered = id(&f, "metered", &[]);
    let ask = |tokens, max_tokens| Ask { tokens, bytes: 1, plugin_wait: None, max_tokens };
    // 300 + 200 held by the first: the second's 100 fits what is left, a third's 100 does not.
    let a = f.enter(&metered, ask(300, Some(200)), |_| true, |_| {}).await.unwrap();
    let b = f.enter(&metered, ask(50, Some(50)), |_| true, |_| {}).await.unwrap();
    let r = f.enter(&metered, ask(100, None), |_| true, |_| {}).await.unwrap_err();
    assert_eq!(r.code(), "rate_limit_exceeded");
    // The first used 20 of its 200: 180 come back; the second failed before its answer: all of
    // its 100 come back.
    a.charge.finish(20);
    drop(b);
    let v = f.view();
    let m = &v["tenants"][0];
    assert_eq!((m["budget"]["available"].as_f64(), m["in_flight"].as_u64()), (Some(280.0), Some(0)), "{v}");
}

#[tokio::test(start_paused = true)]
async fn a_request_let_go_as_it_leaves_is_not_charged_and_blocks_nothing() {
    let f = FlowControl::new(FlowConfig::fair(Duration::from_secs(30)));
    let h = queue(&f, id(&f, "gone", &[]), 100);
    tokio::task::yield_now().await;
    let settled = f.next(|_| true).expect("let go");
    // The client leaves before its task sees the go.
    h.abort();
    let _ = h.await;
    tokio::time::timeout(Duration::from_secs(1), settled).await.unwrap().unwrap_err();
    f.settled();
    let v = f.view();
    let t = &v["tenants"][0];
    assert_eq!((t["in_flight"].as_u64(), t["served_input_tokens"].as_u64()), (Some(0), Some(0)), "{v}");
    assert_eq!(t["virtual_counter"].as_f64(), Some(0.0), "{v}");
    assert_eq!(v["bands"][0]["dispatched"], 0, "{v}");
}

#[tokio::test(start_paused = true)]
async fn no_request_takes_the_fast_path_past_one_being_let_go() {
    let f = FlowControl::new(FlowConfig::fair(Duration::from_secs(30)));
    let first = queue(&f, id(&f, "a", &[]), 10);
    tokio::task::yield_now().await;
    let _settle = f.next(|_| true).expect("let go");
    // Room, nobody waiting, but the first has not taken its slots yet: the next one waits.
    let second = queue(&f, id(&f, "b", &[]), 10);
    tokio::task::yield_now().await;
    assert_eq!(f.queued(), 1, "the second queued behind the one being let go");
    f.settled();
    assert!(f.next(|_| true).is_some());
    f.settled();
    assert!(first.await.unwrap().is_ok() && second.await.unwrap().is_ok());
    // With nothing in flight the fast path is open again.
    let c = id(&f, "c", &[]);
    let a = f.enter(&c, Ask { tokens: 1, bytes: 1, plugin_wait: None, max_tokens: None }, |_| true, |_| {});
    assert!(!a.await.unwrap().queued);
}

#[tokio::test(start_paused = true)]
async fn a_deadline_already_past_is_refused_before_it_waits() {
    let f = FlowControl::new(bands3());
    let late = f.identify(&headers(&[("x-request-deadline", "50")]), Some("a"), Instant::now()).unwrap();
    tokio::time::advance(Duration::from_millis(80)).await;
    let r =
        f.enter(&late, Ask { tokens: 1, bytes: 1, plugin_wait: None, max_tokens: None }, |_| true, |_| {});
    let r = r.await.unwrap_err();
    assert_eq!(r.code(), "deadline_exceeded");
    assert!(r.to_string().contains("80ms after it arrived"), "{r}");
}

/// A fleet whose store is a bucket in memory, or down.
#[derive(Debug, Default)]
struct FakeFleet {
    /// The fleet-wide bucket's level; `None`: the store cannot be reached.
    level: Mutex<Option<f64>>,
    replicas: u32,
    given_back: Mutex<Vec<f64>>,
    /// How long the store's answer takes to come back (it takes the hold at once, as a script
    /// run by the store does once the call is sent).
    delay: Duration,
}

impl Fleet for FakeFleet {
    fn reserve<'a>(&'a self, _: &'a str, _: BudgetRule, hold: f64, need: f64) -> Reserve<'a> {
        Box::pin(async move {
            let answer = {
                let mut l = self.level.lock().unwrap();
                let level = l.as_mut()?;
                if *level < need {
                    Err(7)
                } else {
                    *level -= hold;
                    Ok(())
                }
            };
            tokio::time::sleep(self.delay).await;
            Some(answer)
        })
    }

    fn give_back(&self, _: &str, _: BudgetRule, tokens: f64) {
        self.given_back.lock().unwrap().push(tokens);
        if let Some(l) = self.level.lock().unwrap().as_mut() {
            *l += tokens;
        }
    }

    fn replicas(&self) -> u32 {
        self.replicas
    }
}

#[tokio::test(start_paused = true)]
async fn with_a_fleet_the_store_holds_the_budget_and_a_replica_keeps_its_share_when_it_is_down() {
    let mut c = FlowConfig::fair(Duration::from_secs(30));
    let rule = BudgetRule { tokens_per_minute: 600, counts: Counts::Input };
    c.tenants.insert("metered".into(), TenantRule { budget: Some(rule), ..TenantRule::default() });
    let f = FlowControl::new(c);
    let fleet = Arc::new(FakeFleet { level: Mutex::new(Some(250.0)), replicas: 3, ..FakeFleet::default() });
    f.share_with(Arc::clone(&fleet) as Arc<dyn Fleet>);
    let ask = |tokens| Ask { tokens, bytes: 1, plugin_wait: None, max_tokens: None };
    let metered = id(&f, "metered", &[]);
    // The store's bucket decides: 250 left fleet-wide, though this replica took nothing yet.
    let a = f.enter(&metered, ask(200), |_| true, |_| {}).await.unwrap();
    let r = f.enter(&metered, ask(100), |_| true, |_| {}).await.unwrap_err();
    assert_eq!((r.status(), r.retry_after()), (429, Some(7)), "{r}");
    assert!(r.to_string().contains("600 tokens per minute"), "{r}");
    // Its answer cost what it held: nothing to give back. One that failed gives its hold back.
    a.charge.finish(0);
    let b = f.enter(&metered, ask(50), |_| true, |_| {}).await.unwrap();
    drop(b);
    assert_eq!(*fleet.given_back.lock().unwrap(), [50.0]);
    // The store goes down: this replica's share is 600 / 3 = 200 a minute, less the 200 it
    // took while the store was up (its share mirrors its own use): refused until it refills.
    *fleet.level.lock().unwrap() = None;
    let r = f.enter(&metered, ask(100), |_| true, |_| {}).await.unwrap_err();
    assert_eq!(r.status(), 429, "{r}");
    // At 200 a minute, 100 tokens are back after 30 s; never more than the share (200).
    tokio::time::advance(Duration::from_secs(30)).await;
    let metered = id(&f, "metered", &[]);
    f.enter(&metered, ask(100), |_| true, |_| {}).await.unwrap().charge.finish(0);
    tokio::time::advance(Duration::from_secs(600)).await;
    let metered = id(&f, "metered", &[]);
    f.enter(&metered, ask(200), |_| true, |_| {}).await.unwrap().charge.finish(0);
    assert_eq!(f.enter(&metered, ask(1), |_| true, |_| {}).await.unwrap_err().status(), 429);
    let mut scrape = Scrape::default();
    f.metrics(&mut scrape, |t: &str| Arc::from(t));
    let text = scrape.encode();
    assert!(text.contains("baton_flow_budget_local_total 4"), "{text}");
}

#[tokio::test(start_paused = true)]
async fn the_other_replicas_service_counts_in_a_tenants_turn() {
    let f = FlowControl::new(FlowConfig::fair(Duration::from_secs(30)));
    let mut hs = Vec::new();
    for _ in 0..3 {
        hs.push(("served-elsewhere".to_owned(), queue(&f, id(&f, "served-elsewhere", &[]), 100)));
    }
    tokio::task::yield_now().await;
    for _ in 0..3 {
        hs.push(("new".to_owned(), queue(&f, id(&f, "new", &[]), 100)));
    }
    tokio::task::yield_now().await;
    // The store says another replica served the first tenant 1000 (and the second nothing).
    let sent = f.unsynced();
    assert_eq!(sent.len(), 2, "{sent:?}");
    let totals: Vec<f64> =
        sent.iter().map(|u| if &*u.tenant == "served-elsewhere" { 1000.0 } else { 0.0 }).collect();
    f.synced(&sent, &totals);
    let order = drain(&f, hs).await;
    assert_eq!(order[..3], ["new", "new", "new"], "{order:?}");
    // This replica sends its whole service (the store keeps each replica's): 300 each.
    let sent = f.unsynced();
    let served: f64 = sent.iter().map(|u| u.served).sum();
    assert!((served - 600.0).abs() < 1e-9, "{sent:?}");
    let totals: Vec<f64> =
        sent.iter().map(|u| u.served + if &*u.tenant == "served-elsewhere" { 1000.0 } else { 0.0 }).collect();
    f.synced(&sent, &totals);
    // A sync whose answer was lost sends the same again: nothing counted twice.
    f.synced(&sent, &totals);
    let v = f.view();
    let t = v["tenants"].as_array().unwrap().iter().find(|t| t["tenant"] == "served-elsewhere").unwrap();
    assert_eq!(t["other_replicas_counter"], 1000.0, "{v}");
}

/// A request dropped while the store's answer to its hold is still out (its client left) leaves
/// nothing taken: the hold the store took is given back once the answer comes.
#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_the_store_answers_leaves_no_hold_behind() {
    let mut c = FlowConfig::fair(Duration::from_secs(30));
    let rule = BudgetRule { tokens_per_minute: 600, counts: Counts::Input };
    c.tenants.insert("metered".into(), TenantRule { budget: Some(rule), ..TenantRule::default() });
    let f = FlowControl::new(c);
    let fleet = Arc::new(FakeFleet {
        level: Mutex::new(Some(250.0)),
        replicas: 1,
        delay: Duration::from_millis(100),
        ..FakeFleet::default()
    });
    f.share_with(Arc::clone(&fleet) as Arc<dyn Fleet>);
    let ask = Ask { tokens: 200, bytes: 1, plugin_wait: None, max_tokens: None };
    let metered = id(&f, "metered", &[]);
    let gone =
        tokio::time::timeout(Duration::from_millis(20), f.enter(&metered, ask, |_| true, |_| {})).await;
    assert!(gone.is_err(), "the client left before the store answered");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(*fleet.given_back.lock().unwrap(), [200.0]);
    assert_eq!(*fleet.level.lock().unwrap(), Some(250.0));
    // The store still has the whole budget for the next request.
    let ask = Ask { tokens: 200, bytes: 1, plugin_wait: None, max_tokens: None };
    f.enter(&id(&f, "metered", &[]), ask, |_| true, |_| {}).await.unwrap().charge.finish(0);
}
