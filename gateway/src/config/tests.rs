//! The configuration's checks, one named case per rule.

use super::*;

const GOOD: &str = r#"
[[listeners]]
address = "127.0.0.1:8080"
plain_http = true

[model]
name = "baton-sim"
context_length = 32768
chunk_tokens = 16
geometry = { layers = 2, kv_heads = 2, head_dim = 16, dtype_bytes = 2 }

[[prefill]]
name = "p0"
url = "http://127.0.0.1:8100"

[[decode]]
name = "d0"
url = "http://127.0.0.1:8200"
dataplane = ["127.0.0.1:9000", "127.0.0.1:9001"]
"#;

/// KV-event keys on any engine, and the cache-aware policy's settings, reach the checked
/// configuration; what is usable but probably not meant is a warning.
#[test]
fn kv_events_and_the_cache_aware_policy() {
    let events = GOOD
        .replace("name = \"p0\"", "name = \"p0\"\nkv_events = \"p0.pd:5557\"\nkv_events_replay = \"p0.pd:5558\"\ndata_parallel_size = 2")
        .replace("name = \"d0\"", "name = \"d0\"\nkv_events = \"tcp://10.0.0.2:6000\"\nkv_events_topic = \"kv\"");
    let text = format!(
        "{events}\n[routing]\npolicy = \"cache-aware\"\n[routing.cache]\nguard_ratio = 2.0\nguard_slack = 0\n"
    );
    let c = Config::parse(&text).unwrap().check(Path::new(".")).unwrap();
    assert_eq!(
        c.routing,
        crate::routing::Builtin::CacheAware(crate::routing::CacheParams {
            guard_ratio_pct: 200,
            guard_slack: 0,
            cache_weight_pct: 100
        })
    );
    let p = c.prefix.unwrap();
    let feeds: Vec<(usize, u16, &str, Option<&str>, &str)> = p
        .feeds
        .iter()
        .map(|f| (f.engine, f.rank, f.endpoint.as_str(), f.replay.as_deref(), f.topic.as_str()))
        .collect();
    assert_eq!(
        feeds,
        vec![
            (0, 0, "tcp://p0.pd:5557", Some("tcp://p0.pd:5558"), ""),
            (0, 1, "tcp://p0.pd:5558", Some("tcp://p0.pd:5559"), ""),
            (1, 0, "tcp://10.0.0.2:6000", None, "kv"),
        ]
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // Cache-aware without events: usable (approximate), with a warning.
    let c = Config::parse(&format!("{GOOD}\n[routing]\npolicy = \"cache-aware\"\n"))
        .unwrap()
        .check(Path::new("."))
        .unwrap();
    assert!(c.prefix.is_some_and(|p| p.feeds.is_empty()));
    assert!(c.warnings.iter().any(|w| w.contains("no engine has kv_events")), "{:?}", c.warnings);
    // Events without the policy: the index is kept for /admin, with a warning.
    let c = Config::parse(&events).unwrap().check(Path::new(".")).unwrap();
    assert!(c.prefix.is_some());
    assert!(c.warnings.iter().any(|w| w.contains("does not route")), "{:?}", c.warnings);
    // Neither: no index.
    assert!(Config::parse(GOOD).unwrap().check(Path::new(".")).unwrap().prefix.is_none());
}

#[test]
fn a_good_file_checks_with_defaults() {
    let c = Config::parse(GOOD).unwrap().check(Path::new(".")).unwrap();
    let CheckedMode::Native(crate::handoff::native::Checked { geometry, .. }) = &c.decoders[0].mode else {
        panic!("native")
    };
    assert_eq!(geometry.tp_size, 2);
    assert_eq!(c.limits.lease, DEFAULT_LEASE);
    assert_eq!(c.max_queue, DEFAULT_MAX_QUEUE);
    assert_eq!(c.trace, None, "no tracing unless an endpoint is given");
    assert_eq!(c.limits.engine_idle, crate::handoff::DEFAULT_ENGINE_IDLE);
    assert!(c.warnings.iter().all(|w| !w.contains("engine_idle_timeout_ms")), "{:?}", c.warnings);
    // Read as given; at uvicorn's keep-alive or beyond, warned about.
    for (ms, warned) in [(1_500, false), (5_000, true)] {
        let text = format!("{GOOD}\n[admission]\nengine_idle_timeout_ms = {ms}\n");
        let c = Config::parse(&text).unwrap().check(Path::new(".")).unwrap();
        assert_eq!(c.limits.engine_idle, std::time::Duration::from_millis(ms));
        assert_eq!(
            c.warnings.iter().any(|w| w.contains("engine_idle_timeout_ms")),
            warned,
            "{:?}",
            c.warnings
        );
    }
    let text = format!("{GOOD}\n[telemetry]\notlp_endpoint = \"http://otel.local:4318\"\n");
    let c = Config::parse(&text).unwrap().check(Path::new(".")).unwrap();
    let t = c.trace.unwrap();
    assert_eq!((t.sampling_ratio, t.service_name.as_str()), (1.0, "baton"));
}

const LMCACHE: &str = r#"
[[decode]]
name = "d1"
url = "http://127.0.0.1:8300"
handoff = "lmcache"
lmcache = { receiver_host = "127.0.0.1", init_ports = [7300, 7301], alloc_ports = [7400, 7401], pd_buffer_size = 65536 }

[lmcache]
notify_listen = "127.0.0.1:7500"
"#;

/// A real (tiny) `tokenizer.json`, for the pools that need the model's tokenizer.
fn tiny_tokenizer() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-tiny-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("tokenizer.json");
    std::fs::write(
        &p,
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
            "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hi":1},"unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    p
}

/// `text` with `model.tokenizer` set to the tiny tokenizer.
fn with_tokenizer(text: &str) -> String {
    text.replace("chunk_tokens = 16", &format!("chunk_tokens = 16\ntokenizer = {:?}", tiny_tokenizer()))
}

#[test]
fn an_lmcache_pool_gets_its_slots_from_buffer_chunk_and_geometry() {
    let c =
        Config::parse(&with_tokenizer(&format!("{GOOD}{LMCACHE}"))).unwrap().check(Path::new(".")).unwrap();
    let CheckedMode::Lmcache(crate::handoff::lmcache::Checked { lmcache: lm, .. }) = &c.decoders[1].mode
    else {
        panic!("lmcache")
    };
    // 2 layers × 2 KV × 2 heads × 16 dims × 2 bytes = 256 bytes per token, 128 per rank at TP 2:
    // 16-token chunks are 2 KiB per rank, 64 KiB hold 32.
    assert_eq!((lm.capacity, lm.chunk_size, lm.target.alloc_ports.len()), (32, 16, 2));
    assert_eq!(c.lmcache_listen, Some("127.0.0.1:7500".parse().unwrap()));
    assert!(c.first_token);
    // The same from an LMCache YAML, older key names included; explicit values win.
    let dir = std::env::temp_dir().join(format!("baton-lmcache-yaml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("d.yaml"),
        "enable_nixl: True\nnixl_role: \"receiver\"\nnixl_peer_host: \"10.1.1.1\"\nnixl_peer_init_port: 7301\nnixl_peer_alloc_port: 7401\nnixl_buffer_size: 131072 # 128 KiB\nchunk_size: 32\n",
    )
    .unwrap();
    let text = with_tokenizer(&format!("{GOOD}{LMCACHE}")).replace(
        r#"lmcache = { receiver_host = "127.0.0.1", init_ports = [7300, 7301], alloc_ports = [7400, 7401], pd_buffer_size = 65536 }"#,
        r#"lmcache = { config = "d.yaml", pd_buffer_size = 262144 }"#,
    );
    let c = Config::parse(&text).unwrap().check(&dir).unwrap();
    let CheckedMode::Lmcache(crate::handoff::lmcache::Checked { lmcache: lm, .. }) = &c.decoders[1].mode
    else {
        panic!("lmcache")
    };
    assert_eq!(lm.target.receiver_host, "10.1.1.1");
    assert_eq!((lm.target.init_ports.clone(), lm.target.alloc_ports.clone()), (vec![7301], vec![7401]));
    // TP 1, 32-token chunks: 8 KiB per chunk; 256 KiB (the TOML's value, not the YAML's) hold 32.
    assert_eq!((lm.chunk_size, lm.capacity, lm.pd_buffer_size), (32, 32, 262_144));
    std::fs::write(dir.join("p.yaml"), "pd_role: \"sender\"\npd_proxy_port: 7500\n").unwrap();
    let bad = Config::parse(&text.replace("d.yaml", "p.yaml")).unwrap().check(&dir).unwrap_err();
    assert_eq!(bad.field, "decode[1].lmcache.config", "{bad}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_key_of_another_mode_is_refused_at_its_pool_with_line_and_column() {
    let text = GOOD.replace(
        "url = \"http://127.0.0.1:8200\"",
        "url = \"http://127.0.0.1:8200\"\nhandoff = \"vllm-nixl\"",
    );
    let e = Config::parse(&text).unwrap_err();
    assert!(e.reason.contains("unknown field `dataplane`, expected `nixl`"), "{e}");
    let pool = text.lines().position(|l| l == "[[decode]]").unwrap() + 1;
    assert_eq!(e.at, Some((pool, 1)), "{e}");
    assert!(e.to_string().starts_with(&format!("line {pool}, column 1: ")), "{e}");
    // A syntax error points at its own line.
    let e = Config::parse("[model]\nname = \"m\"\ncontext_length = = 3\n").unwrap_err();
    assert_eq!(e.at.map(|a| a.0), Some(3), "{e}");
}

#[test]
fn bad_files_name_the_field() {
    // (name, edit of GOOD, field the error must name)
    let cases: Vec<(&str, String, &str)> = vec![
        ("unknown field", GOOD.replace("plain_http = true", "plain_http = true\ncolour = 1"), "config"),
        ("no tls and not plain", GOOD.replace("plain_http = true", ""), "listeners[0]"),
        ("bad url", GOOD.replace("http://127.0.0.1:8100", "127.0.0.1:8100"), "prefill[0].url"),
        (
            "no ranks",
            GOOD.replace(r#"dataplane = ["127.0.0.1:9000", "127.0.0.1:9001"]"#, "dataplane = []"),
            "decode[0].dataplane",
        ),
        (
            "tp does not divide heads",
            GOOD.replace(
                r#"["127.0.0.1:9000", "127.0.0.1:9001"]"#,
                r#"["127.0.0.1:9000", "127.0.0.1:9001", "127.0.0.1:9002"]"#,
            ),
            "decode[0] (model.geometry)",
        ),
        ("half a geometry", GOOD.replace("layers = 2, ", ""), "decode[0] (model.geometry)"),
        (
            "zero context",
            GOOD.replace("context_length = 32768", "context_length = 0"),
            "model.context_length",
        ),
        (
            "engine connections never idle",
            format!("{GOOD}\n[admission]\nengine_idle_timeout_ms = 0\n"),
            "admission.engine_idle_timeout_ms",
        ),
        (
            "lease shorter than ready wait",
            format!("{GOOD}\n[admission]\nlease_ms = 1000\nready_timeout_ms = 2000\n"),
            "admission.lease_ms",
        ),
        (
            "missing tls file",
            GOOD.replace(
                "plain_http = true",
                r#"tls_cert = "nope.pem"
tls_key = "nope.key""#,
            ),
            "listeners[0].tls",
        ),
        ("unknown routing", format!("{GOOD}\n[routing]\npolicy = \"random\"\n"), "routing.policy"),
        (
            "kv_events bound to every interface",
            GOOD.replace("name = \"p0\"", "name = \"p0\"\nkv_events = \"*:5557\""),
            "prefill[0].kv_events",
        ),
        (
            "replay without a publisher",
            GOOD.replace("name = \"d0\"", "name = \"d0\"\nkv_events_replay = \"127.0.0.1:5558\""),
            "decode[0].kv_events_replay",
        ),
        (
            "no data-parallel ranks",
            GOOD.replace(
                "name = \"p0\"",
                "name = \"p0\"\nkv_events = \"127.0.0.1:5557\"\ndata_parallel_size = 0",
            ),
            "prefill[0].data_parallel_size",
        ),
        (
            "guard ratio below 1",
            format!("{GOOD}\n[routing]\npolicy = \"cache-aware\"\n[routing.cache]\nguard_ratio = 0.5\n"),
            "routing.cache.guard_ratio",
        ),
        ("no tries at all", format!("{GOOD}\n[routing.retries]\nattempts = 0\n"), "routing.retries.attempts"),
        (
            "retry budget above every request",
            format!("{GOOD}\n[routing.retries]\nbudget_ratio = 1.5\n"),
            "routing.retries.budget_ratio",
        ),
        (
            "retry backoff cap below its start",
            format!("{GOOD}\n[routing.retries]\nbackoff_ms = 100\nbackoff_max_ms = 50\n"),
            "routing.retries.backoff_max_ms",
        ),
        (
            "zero health interval",
            format!("{GOOD}\n[routing]\nhealth_check_interval_ms = 0\n"),
            "routing.health_check_interval_ms",
        ),
        ("bad log format", format!("{GOOD}\n[telemetry]\nlog_format = \"xml\"\n"), "telemetry.log_format"),
        ("bad log filter", format!("{GOOD}\n[telemetry]\nlog_level = \"a=b=c\"\n"), "telemetry.log_level"),
        (
            "otlp endpoint without a port",
            format!("{GOOD}\n[telemetry]\notlp_endpoint = \"http://collector\"\n"),
            "telemetry.otlp_endpoint",
        ),
        (
            "sampling ratio above 1",
            format!("{GOOD}\n[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318\"\nsampling_ratio = 2.0\n"),
            "telemetry.sampling_ratio",
        ),
        (
            "sampling ratio without an endpoint",
            format!("{GOOD}\n[telemetry]\nsampling_ratio = 0.5\n"),
            "telemetry.otlp_endpoint",
        ),
        (
            "missing tokenizer",
            GOOD.replace("chunk_tokens = 16", "chunk_tokens = 16\ntokenizer = \"nope/tokenizer.json\""),
            "model.tokenizer",
        ),
        (
            "nixl with a dataplane",
            GOOD.replace(
                "url = \"http://127.0.0.1:8200\"",
                "url = \"http://127.0.0.1:8200\"\nhandoff = \"vllm-nixl\"",
            ),
            "config",
        ),
        (
            "nixl usage above 1",
            GOOD.replace(
                "url = \"http://127.0.0.1:8200\"\ndataplane = [\"127.0.0.1:9000\", \"127.0.0.1:9001\"]",
                "url = \"http://127.0.0.1:8200\"\nhandoff = \"vllm-nixl\"\nnixl = { kv_usage_high = 1.5 }",
            ),
            "decode[0].nixl.kv_usage_high",
        ),
        (
            "unknown handoff",
            GOOD.replace(
                "url = \"http://127.0.0.1:8200\"",
                "url = \"http://127.0.0.1:8200\"\nhandoff = \"mooncake\"",
            ),
            "config",
        ),
        ("lmcache without the model's tokenizer", format!("{GOOD}{LMCACHE}"), "model.tokenizer"),
        (
            "lmcache without a listener",
            format!("{GOOD}{LMCACHE}").replace("[lmcache]\nnotify_listen = \"127.0.0.1:7500\"", ""),
            "lmcache.notify_listen",
        ),
        (
            "lmcache ports mismatch",
            format!("{GOOD}{LMCACHE}").replace("alloc_ports = [7400, 7401]", "alloc_ports = [7400]"),
            "decode[1].lmcache.alloc_ports",
        ),
        (
            "lmcache buffer below one chunk",
            format!("{GOOD}{LMCACHE}").replace("pd_buffer_size = 65536", "pd_buffer_size = 100"),
            "decode[1].lmcache.pd_buffer_size",
        ),
        (
            "lmcache without its section",
            format!("{GOOD}{LMCACHE}").replace("lmcache = { receiver_host", "colour = { receiver_host"),
            "config",
        ),
        (
            "lmcache section on a native pool",
            GOOD.replace("dataplane = [", "lmcache = { pd_buffer_size = 1 }\ndataplane = ["),
            "config",
        ),
        (
            "sglang with a dataplane",
            GOOD.replace(
                "url = \"http://127.0.0.1:8200\"",
                "url = \"http://127.0.0.1:8200\"\nhandoff = \"sglang\"",
            ),
            "config",
        ),
        (
            "sglang bootstrap port 0",
            GOOD.replace(
                "url = \"http://127.0.0.1:8200\"\ndataplane = [\"127.0.0.1:9000\", \"127.0.0.1:9001\"]",
                "url = \"http://127.0.0.1:8200\"\nhandoff = \"sglang\"\nbootstrap_port = 0",
            ),
            "decode[0].bootstrap_port",
        ),
        (
            "sglang usage above 1",
            GOOD.replace(
                "url = \"http://127.0.0.1:8200\"\ndataplane = [\"127.0.0.1:9000\", \"127.0.0.1:9001\"]",
                "url = \"http://127.0.0.1:8200\"\nhandoff = \"sglang\"\nsglang = { kv_usage_high = 2.0 }",
            ),
            "decode[0].sglang.kv_usage_high",
        ),
        (
            "a nixl table on an sglang pool",
            GOOD.replace(
                "url = \"http://127.0.0.1:8200\"\ndataplane = [\"127.0.0.1:9000\", \"127.0.0.1:9001\"]",
                "url = \"http://127.0.0.1:8200\"\nhandoff = \"sglang\"\nnixl = { max_in_flight = 2 }",
            ),
            "config",
        ),
        (
            "template without tokenizer",
            GOOD.replace("chunk_tokens = 16", "chunk_tokens = 16\ntokenizer_config = \"x.json\""),
            "model.tokenizer_config",
        ),
    ];
    for (name, text, field) in cases {
        let got = Config::parse(&text).and_then(|c| c.check(Path::new("."))).map(|_| ()).unwrap_err();
        assert_eq!(got.field, field, "{name}: {got}");
    }
}

#[test]
fn the_admin_listener_defaults_to_loopback_and_checks_its_token_and_address() {
    let c = Config::parse(GOOD).unwrap().check(Path::new(".")).unwrap();
    assert_eq!(c.admin.addr.to_string(), DEFAULT_ADMIN_LISTEN);
    assert!(c.admin.open() && c.admin.token_sha256.is_none());
    let hash = crate::policy::sha256_hex(b"tok");
    let with = format!("{GOOD}\n[admin]\nlisten = \"0.0.0.0:9091\"\ntoken_sha256 = \"{hash}\"\n");
    let c = Config::parse(&with).unwrap().check(Path::new(".")).unwrap();
    assert_eq!(c.admin.token_sha256, Some(crate::auth::digest(b"tok")));
    assert!(!c.admin.open());
    // (case, [admin] table, the field named)
    let cases = [
        ("the token itself, not its hash", "token_sha256 = \"tok\"", "admin.token_sha256"),
        ("not hex", &format!("token_sha256 = \"{}\"", "z".repeat(64)), "admin.token_sha256"),
        ("the public listener's address", "listen = \"127.0.0.1:8080\"", "admin.listen"),
        ("a client CA without TLS", "client_ca = \"ca.pem\"", "admin.client_ca"),
        ("a certificate without its key", "tls_cert = \"c.pem\"", "admin"),
    ];
    for (case, table, field) in cases {
        let text = format!("{GOOD}\n[admin]\n{table}\n");
        let e = Config::parse(&text).unwrap().check(Path::new(".")).unwrap_err();
        assert_eq!(e.field, field, "{case}: {e}");
    }
}

/// `[cluster]`: its defaults, and each rule naming its key; an lmcache pool is refused with it.
#[test]
fn the_cluster_table_checks_its_store_lease_sync_and_modes() {
    let text =
        format!("{GOOD}\n[cluster]\nstore = \"redis://:secret@127.0.0.1:6379/2\"\nreplica = \"gw-a\"\n");
    let c = Config::parse(&text).unwrap().check(Path::new(".")).unwrap().cluster.unwrap();
    assert_eq!(
        (c.lease, c.sync, c.key_prefix.as_str()),
        (crate::cluster::DEFAULT_LEASE, crate::cluster::DEFAULT_SYNC, "baton")
    );
    // The configured name is a prefix: replicas sharing one file never share a name.
    assert!(c.replica.starts_with(&format!("gw-a-{}-", std::process::id())), "{}", c.replica);
    // Without a name, one unique to the process.
    let text = format!("{GOOD}\n[cluster]\nstore = \"redis://127.0.0.1:6379\"\n");
    let a = Config::parse(&text).unwrap().check(Path::new(".")).unwrap().cluster.unwrap().replica;
    let b = Config::parse(&text).unwrap().check(Path::new(".")).unwrap().cluster.unwrap().replica;
    assert_ne!(a, b);
    assert!(a.contains(&format!("-{}-", std::process::id())), "{a}");
    for (cluster, field) in [
        ("store = \"http://127.0.0.1:6379\"", "cluster.store"),
        ("store = \"redis://127.0.0.1:6379\"\nlease_ms = 100", "cluster.lease_ms"),
        ("store = \"redis://127.0.0.1:6379\"\nlease_ms = 1000\nsync_ms = 300", "cluster.sync_ms"),
        ("store = \"redis://127.0.0.1:6379\"\nsync_ms = 0", "cluster.sync_ms"),
        ("store = \"redis://127.0.0.1:6379\"\nreplica = \"a b\"", "cluster.replica"),
        ("store = \"redis://127.0.0.1:6379\"\nkey_prefix = \"a{b}\"", "cluster.key_prefix"),
    ] {
        let e = Config::parse(&format!("{GOOD}\n[cluster]\n{cluster}\n"))
            .unwrap()
            .check(Path::new("."))
            .unwrap_err();
        assert_eq!(e.field, field, "{cluster}: {e}");
    }
    let text = with_tokenizer(&format!("{GOOD}{LMCACHE}\n[cluster]\nstore = \"redis://127.0.0.1:6379\"\n"));
    let e = Config::parse(&text).unwrap().check(Path::new(".")).unwrap_err();
    assert_eq!(e.field, "decode[1].handoff", "{e}");
    assert!(e.reason.contains("pd_proxy_host"), "{e}");
}

#[test]
fn retries_are_read_with_their_defaults() {
    use crate::routing::retry::RetryConfig;
    let c = Config::parse(GOOD).unwrap().check(Path::new(".")).unwrap();
    assert_eq!(c.health.retries, RetryConfig::default());
    let text = format!(
        "{GOOD}\n[routing.retries]\nattempts = 1\nbudget_ratio = 0.5\nmin_per_second = 0\nbackoff_ms = 0\nbackoff_max_ms = 0\n"
    );
    let c = Config::parse(&text).unwrap().check(Path::new(".")).unwrap();
    assert_eq!(
        c.health.retries,
        RetryConfig {
            attempts: 1,
            budget_ratio: 0.5,
            min_per_second: 0,
            backoff: Duration::ZERO,
            backoff_max: Duration::ZERO
        }
    );
    assert!(
        Config::parse(&format!("{GOOD}\n[routing.retries]\ntries = 2\n")).is_err(),
        "unknown keys refused"
    );
}
