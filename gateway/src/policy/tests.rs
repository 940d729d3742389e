//! Host tests on the real example plugins (built from source by `scripts/build-plugins` into
//! `.cache/plugins/`, which `scripts/test` runs first).

use std::sync::atomic::AtomicU64;

use smallvec::smallvec;

use super::calls::views;
use super::*;
use crate::routing::{Candidates, Decision, DecodeView, PerEndpoint, PrefillView, Route};

pub(crate) fn plugin_path(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/plugins").join(format!("{name}.wasm"));
    assert!(p.is_file(), "{} is missing: run scripts/build-plugins (scripts/test does)", p.display());
    p
}

fn cache_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/plugin-cache-tests")
}

fn manual_host() -> (Arc<AtomicU64>, Arc<Host>) {
    let t = Arc::new(AtomicU64::new(1_000_000));
    let host = Host::new(Some(&cache_dir()), Clock::Manual(Arc::clone(&t))).unwrap();
    (t, host)
}

fn req(tenant: &str, prompt: u32, max: u32, slots: u32, priority: Option<&str>) -> PolicyRequest {
    PolicyRequest {
        model: "m".into(),
        endpoint: "completions".into(),
        tenant: tenant.into(),
        prompt_tokens: prompt,
        slots,
        max_tokens: max,
        priority: priority.map(Into::into),
        band: None,
        flow: None,
        prefix_hash: 7,
        headers: Vec::new(),
    }
}

fn queue(free: u32) -> QueueState {
    QueueState { capacity_slots: 64, free_slots: free, waiting_requests: 0, waiting_slots: 0 }
}

const BUDGET: &str = r#"{"tokens_per_minute": 1000, "default_max_tokens": 100, "low_priority_max_wait_ms": 1500,
  "tenants": {"gold": {"tokens_per_minute": 5000, "priority": 3}, "tiny": {"tokens_per_minute": 50}},
  "unmetered_bands": ["free"]}"#;

/// One table of requests through one admission plugin; every decision, in order.
fn run_table(name: &str) -> Vec<String> {
    let (t, host) = manual_host();
    let mut spec = Spec::new(name, plugin_path(name));
    spec.config_json = BUDGET.into();
    // Interpreted guests: generous deadlines, the table checks decisions, not speed.
    spec.deadline = Duration::from_secs(1);
    spec.memory_mib = 256;
    let p = AdmissionPlugin::load(&host, spec).unwrap();
    let mut d = p.direct();
    let mut out = Vec::new();
    let mut admit = |d: &mut Direct<AdmissionWorld>, r: &PolicyRequest, free: u32| {
        out.push(format!("{:?}", d.admit(r, queue(free))));
    };
    let first = req("alice", 200, 100, 1, None);
    admit(&mut d, &first, 10);
    admit(&mut d, &req("alice", 300, 0, 1, None), 10);
    admit(&mut d, &req("alice", 250, 100, 1, None), 10);
    d.complete(&first, Usage { prompt_tokens: 200, completion_tokens: 20, status: 200 }).unwrap();
    admit(&mut d, &req("alice", 250, 100, 2, None), 0);
    // Flow control's band "free" is not metered, nor given back; 30 tokens are left.
    let mut free = req("alice", 900, 100, 1, None);
    free.band = Some("free".into());
    free.flow = Some("alice".into());
    admit(&mut d, &free, 10);
    d.complete(&free, Usage { prompt_tokens: 900, completion_tokens: 0, status: 200 }).unwrap();
    admit(&mut d, &req("alice", 20, 20, 1, None), 10);
    admit(&mut d, &req("gold", 1000, 500, 4, None), 0);
    admit(&mut d, &req("gold", 10, 10, 1, Some("low")), 0);
    admit(&mut d, &req("tiny", 40, 20, 1, None), 10);
    admit(&mut d, &req("", 10, 10, 1, None), 10);
    t.fetch_add(60_000_000, Ordering::Relaxed);
    admit(&mut d, &req("alice", 900, 100, 1, None), 10);
    assert_eq!(p.stats.total_faults(), 0, "{name}: no faults");
    out
}

#[test]
fn the_three_example_admission_plugins_decide_alike() {
    let rust = run_table("token_budget");
    let expected = [
        "Some(Queue { class: 0, max_wait: None })",
        "Some(Queue { class: 0, max_wait: None })",
        // 300 left, 350 asked: 50 more at 1000 a minute is 3 s.
        "Some(Reject { status: 429, message: \"tenant alice is over its budget of 1000 tokens per minute\", retry_after_s: Some(3) })",
        // 80 unused tokens came back: 380 left.
        "Some(Queue { class: 0, max_wait: Some(1.5s) })",
        // The free band: admitted in class 0 whatever it costs.
        "Some(Queue { class: 0, max_wait: None })",
        // 40 asked, 30 left (nothing came back from the free one): 10 more is under a second.
        "Some(Reject { status: 429, message: \"tenant alice is over its budget of 1000 tokens per minute\", retry_after_s: Some(1) })",
        "Some(Queue { class: 3, max_wait: None })",
        "Some(Queue { class: 0, max_wait: Some(1.5s) })",
        "Some(Reject { status: 400, message: \"request needs 60 tokens, more than tenant tiny's budget of 50 tokens per minute\", retry_after_s: None })",
        "Some(Queue { class: 0, max_wait: None })",
        "Some(Queue { class: 0, max_wait: None })",
    ];
    assert_eq!(rust, expected);
    assert_eq!(run_table("token_budget_js"), rust, "JavaScript");
    assert_eq!(run_table("token_budget_py"), rust, "Python");
}

#[test]
fn a_config_the_plugin_refuses_refuses_the_plugin_in_every_language() {
    let (_t, host) = manual_host();
    for name in ["token_budget", "token_budget_js", "token_budget_py"] {
        for bad in [r#"{"tokens_per_minute": 0}"#, r#"{"nope": 1}"#, r#"{"tenants": {"a": {"priority": 9}}}"#]
        {
            let mut spec = Spec::new(name, plugin_path(name));
            spec.config_json = bad.into();
            spec.memory_mib = 256;
            match AdmissionPlugin::load(&host, spec) {
                Err(LoadError::Config { error, .. }) => {
                    assert!(error.contains("token-budget config"), "{error}")
                }
                other => panic!("{name} with {bad}: {other:?}"),
            }
        }
    }
}

fn faulty(host: &Arc<Host>, max_faults: u32) -> Arc<AdmissionPlugin> {
    faulty_within(host, max_faults, Duration::from_millis(20))
}

fn faulty_within(host: &Arc<Host>, max_faults: u32, deadline: Duration) -> Arc<AdmissionPlugin> {
    let mut spec = Spec::new("faulty", plugin_path("faulty"));
    spec.deadline = deadline;
    spec.memory_mib = 16;
    spec.max_faults = max_faults;
    AdmissionPlugin::load(host, spec).unwrap()
}

#[test]
fn an_infinite_loop_is_cut_at_the_deadline() {
    let host = Host::new(None, Clock::monotonic()).unwrap();
    let p = faulty(&host, 100);
    let mut d = p.direct();
    let t = Instant::now();
    assert_eq!(d.admit(&req("loop", 1, 1, 1, None), queue(1)), None);
    let took = t.elapsed();
    assert!(took < Duration::from_millis(500), "cut after {took:?}");
    // The budget is CPU time; up to two ticks before the first check are estimated, not measured.
    let least = Duration::from_millis(20) - EPOCH_TICK * 2;
    assert!(took >= least, "not before the deadline: {took:?}");
    assert_eq!(p.stats.fault_count(Fault::Deadline), 1);
    // The instance was discarded; a fresh one answers.
    assert_eq!(d.admit(&req("ok", 1, 1, 1, None), queue(1)), Some(Admit::Queue { class: 3, max_wait: None }));
}

#[test]
fn runaway_memory_growth_traps_at_the_limit() {
    let host = Host::new(None, Clock::monotonic()).unwrap();
    // Filling 16 MiB a megabyte at a time took more than faulty()'s 20 ms of CPU on CI's loaded 2
    // cores (counted a deadline fault; 10-14 ms here): the limit, not the clock, must end this
    // call, as in the e2e test.
    let p = faulty_within(&host, 100, Duration::from_millis(250));
    let mut d = p.direct();
    assert_eq!(d.admit(&req("grow", 1, 1, 1, None), queue(1)), None);
    let counts: Vec<u64> = Fault::ALL.iter().map(|f| p.stats.fault_count(*f)).collect();
    assert_eq!(
        p.stats.fault_count(Fault::Memory),
        1,
        "counted as a memory fault: {:?} {counts:?}",
        Fault::ALL
    );
    assert_eq!(d.admit(&req("ok", 1, 1, 1, None), queue(1)), Some(Admit::Queue { class: 3, max_wait: None }));
}

#[test]
fn a_trap_and_an_out_of_range_answer_are_faults_and_repeated_faults_switch_the_plugin_off() {
    let host = Host::new(None, Clock::monotonic()).unwrap();
    let p = faulty(&host, 3);
    let mut d = p.direct();
    assert_eq!(d.admit(&req("trap", 1, 1, 1, None), queue(1)), None);
    assert_eq!(p.stats.fault_count(Fault::Trap), 1);
    assert_eq!(d.admit(&req("bad-status", 1, 1, 1, None), queue(1)), None);
    assert_eq!(p.stats.fault_count(Fault::Invalid), 1);
    // A good answer resets the run of faults.
    assert!(d.admit(&req("ok", 1, 1, 1, None), queue(1)).is_some());
    for _ in 0..3 {
        assert_eq!(d.admit(&req("trap", 1, 1, 1, None), queue(1)), None);
    }
    assert!(p.info().disabled);
    assert_eq!(d.admit(&req("ok", 1, 1, 1, None), queue(1)), None, "off: the built-in decides");
    assert_eq!(p.stats.disabled_skips.load(Ordering::Relaxed), 1);
    // A reload switches it back on.
    p.reload(None).unwrap();
    assert!(!p.info().disabled);
    assert!(d.admit(&req("ok", 1, 1, 1, None), queue(1)).is_some());
}

#[test]
fn reload_checks_the_pin_and_keeps_the_old_version_on_error() {
    let host = Host::new(None, Clock::monotonic()).unwrap();
    let p = faulty(&host, 5);
    let v1 = p.info();
    let mut spec = p.spec();
    spec.sha256 = Some("00".repeat(32));
    assert!(matches!(p.reload(Some(spec.clone())), Err(LoadError::Pin { .. })));
    spec.sha256 = None;
    spec.config_json = r#"{"refuse": true}"#.into();
    assert!(matches!(p.reload(Some(spec.clone())), Err(LoadError::Config { .. })));
    assert_eq!(p.info().version, v1.version, "still the old version");
    spec.sha256 = Some(v1.sha256.clone());
    spec.config_json = "{}".into();
    assert!(p.reload(Some(spec)).unwrap().version > v1.version);
    assert_eq!(p.stats.reload_failures.load(Ordering::Relaxed), 2);
}

#[test]
fn compiled_components_come_from_the_disk_cache_the_second_time() {
    let dir = cache_dir().join(format!("cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = Host::new(Some(&dir), Clock::monotonic()).unwrap();
    AdmissionPlugin::load(&first, Spec::new("tb", plugin_path("token_budget"))).unwrap();
    assert_eq!(first.cache_counts(), (0, 1));
    let second = Host::new(Some(&dir), Clock::monotonic()).unwrap();
    AdmissionPlugin::load(&second, Spec::new("tb", plugin_path("token_budget"))).unwrap();
    assert_eq!(second.cache_counts(), (1, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

fn cands(free: Vec<u32>, waiting: Vec<u64>) -> Candidates {
    let n = free.len();
    Candidates {
        prefill: PrefillView {
            healthy: smallvec![true, true],
            in_flight: smallvec![3, 1],
            latency_us: smallvec![900, 800],
            cached_tokens: PerEndpoint::new(),
            pending_tokens: PerEndpoint::new(),
        },
        decode: DecodeView {
            healthy: smallvec![true; n],
            slots_needed: smallvec![2; n],
            capacity_slots: smallvec![64; n],
            free_slots: free.into(),
            waiting_slots: waiting.into(),
            in_flight: smallvec![0; n],
            cached_tokens: PerEndpoint::new(),
        },
    }
}

#[test]
fn prefix_affinity_keeps_a_prefix_on_one_decoder_and_spills_to_the_freest() {
    let host = Host::new(None, Clock::monotonic()).unwrap();
    let p = RoutingPlugin::load(&host, Spec::new("pa", plugin_path("prefix_affinity"))).unwrap();
    let mut d = p.direct();
    let mut pick = |prefix: u32, c: &Candidates| {
        let mut r = req("t", 10, 1, 2, None);
        r.prefix_hash = prefix;
        let (pv, dv) = views(c);
        match d.route(&r, &pv, &dv) {
            Some(Decision::Route(routes)) => routes,
            other => panic!("{other:?}"),
        }
    };
    let roomy = cands(vec![30, 40, 50, 60], vec![0; 4]);
    let mut homes = std::collections::HashSet::new();
    for prefix in 0..64u32 {
        let a = pick(prefix, &roomy);
        assert_eq!(a, pick(prefix, &roomy), "stable");
        assert_eq!(a[0].prefill, 1, "fewest in flight");
        homes.insert(a[0].decode);
    }
    assert_eq!(homes.len(), 4, "prefixes spread over every decoder");
    // The affine decoder of prefix 5 fills up: the freest serves, the affine one stays a fallback.
    let home = pick(5, &roomy)[0].decode;
    let mut full = roomy.clone();
    full.decode.free_slots[home] = 1;
    let freest = if home == 3 { 2 } else { 3 };
    assert_eq!(
        pick(5, &full),
        vec![Route { prefill: 1, decode: freest }, Route { prefill: 1, decode: home }]
    );
}

/// With `baton:policy@0.2.0` the plugin sees where the prompt is cached and follows it; the same
/// source built for 0.1.0 still loads and runs, sees no cache, and routes by the prefix hash alone.
#[test]
fn routing_plugins_see_cached_tokens_from_0_2_and_0_1_plugins_still_run() {
    let host = Host::new(None, Clock::monotonic()).unwrap();
    let current = RoutingPlugin::load(&host, Spec::new("pa", plugin_path("prefix_affinity"))).unwrap();
    let old = RoutingPlugin::load(&host, Spec::new("pa01", plugin_path("prefix_affinity_0_1"))).unwrap();
    assert_eq!((current.info().wit, old.info().wit), ("0.2.0", "0.1.0"));
    let route = |p: &Arc<RoutingPlugin>, c: &Candidates| {
        let mut r = req("t", 10, 1, 2, None);
        r.prefix_hash = 7;
        let (pv, dv) = views(c);
        match p.direct().route(&r, &pv, &dv) {
            Some(Decision::Route(routes)) => routes[0],
            other => panic!("{other:?}"),
        }
    };
    let blind = cands(vec![30, 40, 50, 60], vec![0; 4]);
    let by_hash = route(&current, &blind);
    assert_eq!(route(&old, &blind), by_hash, "one source, one choice without a cache");
    let mut cached = blind.clone();
    let holder = (by_hash.decode + 1) % 4;
    cached.decode.cached_tokens = smallvec![0; 4];
    cached.decode.cached_tokens[holder] = 512;
    cached.prefill.cached_tokens = smallvec![256, 0];
    assert_eq!(route(&current, &cached), Route { prefill: 0, decode: holder }, "where the prompt is");
    assert_eq!(route(&old, &cached), by_hash, "0.1.0 is told nothing of caches");
    // The 0.1.0 admission plugin (faulty) and the 0.2.0 one both run.
    assert_eq!(faulty(&host, 0).info().wit, "0.1.0");
    let tb = AdmissionPlugin::load(&host, Spec::new("tb", plugin_path("token_budget"))).unwrap();
    assert_eq!(tb.info().wit, "0.2.0");
}

/// A component of the other world (or of a version the gateway does not run) is refused, naming the
/// versions it runs.
#[test]
fn a_component_without_a_known_export_is_refused_with_the_versions_run() {
    let host = Host::new(None, Clock::monotonic()).unwrap();
    let e = AdmissionPlugin::load(&host, Spec::new("pa", plugin_path("prefix_affinity"))).unwrap_err();
    assert!(
        e.to_string().contains("the component exports no baton:policy/admission-policy@0.2.0 or @0.1.0"),
        "{e}"
    );
}

/// Blocking WASI calls trap (wasmtime-wasi's sync shims would panic on a runtime thread), so an
/// inline call on a request thread is safe; and any host panic would be caught as a trap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_io_traps_inline_on_a_runtime_thread() {
    let host = Host::new(None, Clock::monotonic()).unwrap();
    let mut spec = Spec::new("faulty", plugin_path("faulty"));
    spec.inline = true;
    let p = AdmissionPlugin::load(&host, spec).unwrap();
    assert_eq!(p.admit(Arc::new(req("print", 1, 1, 1, None)), queue(1)).await, None);
    assert_eq!(p.stats.fault_count(Fault::Trap), 1);
    assert_eq!(
        p.admit(Arc::new(req("ok", 1, 1, 1, None)), queue(1)).await,
        Some(Admit::Queue { class: 3, max_wait: None })
    );
    // The same on the plugin's own threads.
    let p = faulty(&host, 5);
    assert_eq!(p.admit(Arc::new(req("print", 1, 1, 1, None)), queue(1)).await, None);
    assert_eq!(p.stats.fault_count(Fault::Trap), 1);
}

#[test]
fn plugin_check_names_the_world_and_refuses_what_the_gateway_would() {
    let a = check_component(&plugin_path("token_budget"), r#"{"tokens_per_minute": 5}"#).unwrap();
    assert_eq!(a.world, WorldKind::Admission);
    assert_eq!(a.sha256, sha256_hex(&std::fs::read(plugin_path("token_budget")).unwrap()));
    assert_eq!(check_component(&plugin_path("prefix_affinity"), "{}").unwrap().world, WorldKind::Routing);
    let e = check_component(&plugin_path("token_budget"), r#"{"tokens_per_minute": 0}"#).unwrap_err();
    assert!(matches!(e, CheckError::Load(LoadError::Config { .. })), "{e}");
    assert!(e.to_string().contains("tokens_per_minute must be above 0"), "{e}");
    let e = check_component(&Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"), "{}").unwrap_err();
    assert!(matches!(e, CheckError::World(WorldError::NotComponent { .. })), "{e}");
    assert!(e.to_string().starts_with("not a component: "), "{e}");
}
