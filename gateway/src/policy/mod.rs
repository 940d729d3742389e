//! Policy plugins: WebAssembly components that implement `wit/policy.wit` (`admission` or
//! `routing`), run sandboxed so that no plugin can take the gateway down.
//!
//! - One [`wasmtime::Engine`] for every plugin, with the pooling allocator and epoch interruption; a
//!   component is compiled once and kept on disk (wasmtime's cache, keyed by the component's bytes
//!   and the engine's settings), then pre-linked once per version ([`World::Pre`]).
//! - Calls run on the plugin's own bounded pool of threads, each keeping one instance of the
//!   current version, or (`inline`) on the request's thread with an instance from an idle pool. Every call is bounded by a deadline in CPU
//!   time, checked at epoch ticks ([`budget`]), and a memory limit; instantiation has its own,
//!   larger deadline. No files, no network.
//! - A trap, a deadline, a failed instantiation or an invalid answer is a *fault*: the built-in
//!   policy decides that request, the fault is counted and logged, the instance is discarded. After
//!   `max_faults` faults in a row the plugin is switched off until it is reloaded. A full call queue
//!   is not a fault: the built-in decides and `busy` is counted.
//! - [`Plugin::reload`] builds and checks a new version (sha256 pin, `validate-config`) and swaps it
//!   in atomically; calls already running finish on the old one.
//!
//! This module never decides for a request itself: callers get `None` and apply the built-in.

pub mod budget;
pub mod state;
pub mod worlds;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use wasmtime::component::Component;
use wasmtime::{Cache, CacheConfig, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store};

pub use crate::auth::sha256_hex;
pub use state::{Clock, SharedState};
use worlds::Ctx;
pub use worlds::{AdmissionWorld, RoutingWorld, ValidateError, World, WorldKind};

/// CPU time a call may use: a policy decision that takes longer costs more than it can save.
pub const DEFAULT_CALL_DEADLINE: Duration = Duration::from_millis(5);
/// CPU time an instantiation may use (interpreted languages initialise their runtime then).
pub const DEFAULT_INSTANTIATE_DEADLINE: Duration = Duration::from_secs(2);
/// Linear memory one instance may use: the example plugins need under 40 MiB (Python the most).
pub const DEFAULT_MEMORY_MIB: u32 = 64;
/// Largest `memory_mib` accepted: the pooling allocator reserves address space for it.
pub const MAX_MEMORY_MIB: u32 = 1024;
/// Threads (and so instances) per plugin: two keep one slow call from stalling all decisions.
pub const DEFAULT_THREADS: usize = 2;
/// Most threads per plugin.
pub const MAX_THREADS: usize = 16;
/// Calls waiting for a plugin thread; beyond it the built-in decides (`busy`).
pub const DEFAULT_QUEUE: usize = 256;
/// Faults in a row that switch a plugin off until reload.
pub const DEFAULT_MAX_FAULTS: u32 = 5;
/// Period of the epoch ticker: deadlines are rounded up to it.
pub const EPOCH_TICK: Duration = Duration::from_micros(250);
/// Plugin log lines allowed per second; the rest are dropped (and counted).
pub const LOG_LINES_PER_SEC: u64 = 100;
/// Idle instances kept for inline calls (one per request thread is enough; more are dropped).
pub const MAX_IDLE_INSTANCES: usize = 64;
/// How often a watched plugin file is checked for changes.
pub const DEFAULT_WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// Largest component accepted (bytes).
pub const MAX_COMPONENT_BYTES: u64 = 64 << 20;

/// One plugin as configured.
#[derive(Clone, Debug)]
pub struct Spec {
    /// A name for logs and metrics (the world's name unless set).
    pub name: String,
    pub path: PathBuf,
    /// Lower-case hex; when set, a file with another hash is refused (at start and on reload).
    pub sha256: Option<String>,
    /// The plugin's own config table as JSON.
    pub config_json: String,
    pub deadline: Duration,
    pub instantiate_deadline: Duration,
    pub memory_mib: u32,
    pub threads: usize,
    pub queue: usize,
    pub max_faults: u32,
    /// Reload when the file changes.
    pub watch: bool,
    /// Call on the request's own thread (with a pooled instance) instead of the plugin's threads:
    /// no hand-off, but a slow call holds a request thread for up to `deadline`. For plugins
    /// compiled ahead of time (Rust, C, Go); interpreted ones belong on the pool.
    pub inline: bool,
}

impl Spec {
    pub fn new(name: impl Into<String>, path: impl Into<PathBuf>) -> Self {
        Self {
            name: name.into(),
            path: path.into(),
            sha256: None,
            config_json: "{}".into(),
            deadline: DEFAULT_CALL_DEADLINE,
            instantiate_deadline: DEFAULT_INSTANTIATE_DEADLINE,
            memory_mib: DEFAULT_MEMORY_MIB,
            threads: DEFAULT_THREADS,
            queue: DEFAULT_QUEUE,
            max_faults: DEFAULT_MAX_FAULTS,
            watch: false,
            inline: false,
        }
    }
}

/// Why a plugin could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The plugin file could not be read.
    #[error("plugin {name}: read {path}: {error}")]
    Read { name: String, path: String, error: String },
    /// The plugin file is larger than the host loads.
    #[error("plugin {name}: {path} is {bytes} bytes, more than the limit of {limit}")]
    TooLarge { name: String, path: String, bytes: u64, limit: u64 },
    /// The file's SHA-256 is not the one the configuration pins.
    #[error("plugin {name}: sha256 of {path} is {actual}, the config pins {pinned}")]
    Pin { name: String, path: String, actual: String, pinned: String },
    /// The file is not a component of the plugin's world.
    #[error("plugin {name}: {path} is not a {world} component: {error}")]
    Component { name: String, path: String, world: &'static str, error: String },
    /// The component could not be instantiated (a missing import, a trap in its start).
    #[error("plugin {name}: instantiation failed: {error}")]
    Instantiate { name: String, error: String },
    /// The plugin refused its configuration in `init`.
    #[error("plugin {name}: config refused by the plugin: {error}")]
    Config { name: String, error: String },
}

/// Why the plugins' engine could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostError {
    /// The compile cache's directory could not be created.
    #[error("plugin cache {}: {source}", dir.display())]
    CacheDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// wasmtime refused the compile cache in that directory.
    #[error("plugin cache {}: {source}", dir.display())]
    Cache {
        dir: PathBuf,
        #[source]
        source: wasmtime::Error,
    },
    /// wasmtime refused the engine's settings.
    #[error("wasm engine: {source}")]
    Engine {
        #[source]
        source: wasmtime::Error,
    },
    /// The thread that ticks the epochs (the calls' deadlines) could not be started.
    #[error("epoch thread: {source}")]
    EpochThread {
        #[source]
        source: std::io::Error,
    },
}

/// Why bytes are not a policy plugin.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorldError {
    /// Not a WebAssembly component (a core module, or not WebAssembly at all).
    #[error("not a component: {source:#}")]
    NotComponent {
        #[source]
        source: wasmtime::Error,
    },
    /// A component, but it links against neither world. Both reasons are kept: neither is the
    /// one cause.
    #[error("neither world: admission: {admission:#}; routing: {routing:#}")]
    NeitherWorld { admission: wasmtime::Error, routing: wasmtime::Error },
}

/// Why `baton plugin check` refused a component.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// The plugins' engine could not start.
    #[error(transparent)]
    Host(#[from] HostError),
    /// The file could not be read.
    #[error("read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a component of either world.
    #[error(transparent)]
    World(#[from] WorldError),
    /// The gateway would not load it (compile, instantiate, or its config refused).
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// The engine and what every plugin shares. Dropping it stops the epoch ticker.
#[derive(Debug)]
pub struct Host {
    engine: Engine,
    clock: Clock,
    stop: Arc<AtomicBool>,
    cache: Option<Cache>,
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The pooling allocator's limits: room for every plugin thread's instance plus reloads in flight.
fn pooling() -> PoolingAllocationConfig {
    let mut p = PoolingAllocationConfig::default();
    p.total_component_instances(256)
        .total_core_instances(4096)
        .total_memories(512)
        .total_tables(2048)
        .max_core_instances_per_component(64)
        .max_memories_per_component(16)
        .max_tables_per_component(64)
        .max_memory_size((MAX_MEMORY_MIB as usize) << 20);
    p
}

impl Host {
    /// An engine caching compiled components under `cache_dir` (none: compile on every load).
    pub fn new(cache_dir: Option<&Path>, clock: Clock) -> Result<Arc<Self>, HostError> {
        let mut cfg = wasmtime::Config::new();
        cfg.wasm_component_model(true)
            .epoch_interruption(true)
            .max_wasm_stack(1 << 20)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pooling()));
        let mut cache = None;
        if let Some(dir) = cache_dir {
            std::fs::create_dir_all(dir)
                .map_err(|source| HostError::CacheDir { dir: dir.to_owned(), source })?;
            let mut cc = CacheConfig::new();
            cc.with_directory(dir);
            let c = Cache::new(cc).map_err(|source| HostError::Cache { dir: dir.to_owned(), source })?;
            cfg.cache(Some(c.clone()));
            cache = Some(c);
        }
        let engine = Engine::new(&cfg).map_err(|source| HostError::Engine { source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let (e, s) = (engine.clone(), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("baton-epoch".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    e.increment_epoch();
                }
            })
            .map_err(|source| HostError::EpochThread { source })?;
        Ok(Arc::new(Self { engine, clock, stop, cache }))
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Compiled components found in, and written to, the on-disk cache.
    pub fn cache_counts(&self) -> (usize, usize) {
        self.cache.as_ref().map_or((0, 0), |c| (c.cache_hits(), c.cache_misses()))
    }

    /// Which world `bytes` implement (admission first).
    pub fn world_of(&self, bytes: &[u8]) -> Result<WorldKind, WorldError> {
        let c = Component::new(&self.engine, bytes).map_err(|source| WorldError::NotComponent { source })?;
        let a = AdmissionWorld::linker(&self.engine).and_then(|l| AdmissionWorld::pre(&l, &c).map(|_| ()));
        let r = RoutingWorld::linker(&self.engine).and_then(|l| RoutingWorld::pre(&l, &c).map(|_| ()));
        match (a, r) {
            (Ok(()), _) => Ok(WorldKind::Admission),
            (_, Ok(())) => Ok(WorldKind::Routing),
            (Err(admission), Err(routing)) => Err(WorldError::NeitherWorld { admission, routing }),
        }
    }
}

/// Starts a call's CPU budget (see [`budget`]).
fn arm(store: &mut Store<Ctx>, cpu: Duration) {
    store.data_mut().budget = budget::Budget::new(cpu);
    store.set_epoch_deadline(budget::Budget::FIRST_TICKS);
}

/// What a plugin's stores share: its name, config and state (across versions).
#[derive(Debug)]
pub struct PluginShared {
    pub name: String,
    pub config_json: String,
    pub state: Arc<SharedState>,
    log_window: AtomicU64,
    log_lines: AtomicU64,
    pub logs_dropped: AtomicU64,
}

impl PluginShared {
    fn log_allowed(&self) -> bool {
        let sec = self.state.clock().now_us() / 1_000_000;
        if self.log_window.swap(sec, Ordering::Relaxed) != sec {
            self.log_lines.store(0, Ordering::Relaxed);
        }
        let ok = self.log_lines.fetch_add(1, Ordering::Relaxed) < LOG_LINES_PER_SEC;
        if !ok {
            self.logs_dropped.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }
}

/// Kinds of fault, for the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Trap,
    Deadline,
    Memory,
    Instantiate,
    Invalid,
}

impl Fault {
    pub const ALL: [Fault; 5] =
        [Fault::Trap, Fault::Deadline, Fault::Memory, Fault::Instantiate, Fault::Invalid];

    pub fn name(self) -> &'static str {
        match self {
            Self::Trap => "trap",
            Self::Deadline => "deadline",
            Self::Memory => "memory",
            Self::Instantiate => "instantiate",
            Self::Invalid => "invalid",
        }
    }

    fn of(e: &wasmtime::Error) -> Self {
        match e.downcast_ref::<wasmtime::Trap>() {
            Some(wasmtime::Trap::Interrupt) => Self::Deadline,
            // The store's limiter refused a `memory.grow` (`trap_on_grow_failure`).
            _ if format!("{e:#}").contains("forcing trap when growing memory") => Self::Memory,
            _ => Self::Trap,
        }
    }
}

/// A plugin's counters (cumulative across versions).
#[derive(Debug)]
pub struct Stats {
    pub calls: AtomicU64,
    /// `baton_plugin_call_seconds{plugin,world}`: call times, queue wait included.
    pub call_seconds: prometheus::Histogram,
    pub faults: [AtomicU64; 5],
    /// Decisions left to the built-in: the plugin was off or busy.
    pub disabled_skips: AtomicU64,
    pub busy: AtomicU64,
    pub reloads: AtomicU64,
    pub reload_failures: AtomicU64,
}

impl Stats {
    fn new(plugin: &str, world: &str) -> prometheus::Result<Self> {
        let opts = prometheus::HistogramOpts::new(
            "baton_plugin_call_seconds",
            "Time a policy plugin call took, the wait for a plugin thread included.",
        )
        .const_label("plugin", plugin)
        .const_label("world", world)
        .buckets(crate::telemetry::metrics::BUCKETS.to_vec());
        Ok(Self {
            calls: AtomicU64::new(0),
            call_seconds: prometheus::Histogram::with_opts(opts)?,
            faults: Default::default(),
            disabled_skips: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
        })
    }

    /// One call, begun at `started`.
    fn called(&self, started: Instant) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.call_seconds.observe(started.elapsed().as_secs_f64());
    }

    pub fn fault_count(&self, f: Fault) -> u64 {
        self.faults.get(f as usize).map_or(0, |a| a.load(Ordering::Relaxed))
    }
    pub fn total_faults(&self) -> u64 {
        Fault::ALL.iter().map(|&f| self.fault_count(f)).sum()
    }
}

/// One loaded version of a plugin.
struct Version<W: World> {
    id: u64,
    sha256: String,
    pre: W::Pre,
    shared: Arc<PluginShared>,
    spec: Spec,
    /// Faults in a row (reset by a good call).
    in_a_row: AtomicU32,
    disabled: AtomicBool,
}

/// One instance, owned by one plugin thread (or a direct caller).
struct Live<W: World> {
    version: u64,
    store: Store<Ctx>,
    bindings: W::Bindings,
}

/// A call to run on a plugin thread.
type Job<W> = Box<dyn FnOnce(&mut Option<Live<W>>) + Send>;

/// A plugin: its current version, its threads, its counters.
pub struct Plugin<W: World> {
    host: Arc<Host>,
    linker: wasmtime::component::Linker<Ctx>,
    state: Arc<SharedState>,
    current: RwLock<Arc<Version<W>>>,
    tx: Mutex<Option<SyncSender<Job<W>>>>,
    /// Instances for inline calls, taken and returned around each call.
    idle: Mutex<Vec<Live<W>>>,
    next_id: AtomicU64,
    pub stats: Arc<Stats>,
    /// (len, mtime) of the file last loaded, for the watcher.
    seen: Mutex<Option<(u64, std::time::SystemTime)>>,
}

impl<W: World> std::fmt::Debug for Plugin<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.version();
        f.debug_struct("Plugin").field("name", &v.spec.name).field("sha256", &v.sha256).finish()
    }
}

impl<W: World> Drop for Plugin<W> {
    fn drop(&mut self) {
        // Closing the queue ends the threads once they finish what they hold.
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
    }
}

/// A snapshot for `/admin/plugins` and the metrics.
#[derive(Clone, Debug)]
pub struct PluginInfo {
    pub name: String,
    pub world: &'static str,
    /// The `baton:policy` version the component was built for.
    pub wit: &'static str,
    pub path: String,
    pub sha256: String,
    pub version: u64,
    pub disabled: bool,
}

fn file_stamp(p: &Path) -> Option<(u64, std::time::SystemTime)> {
    let m = std::fs::metadata(p).ok()?;
    Some((m.len(), m.modified().ok()?))
}

impl<W: World> Plugin<W> {
    /// Loads, checks and starts a plugin.
    pub fn load(host: &Arc<Host>, spec: Spec) -> Result<Arc<Self>, LoadError> {
        let linker = W::linker(&host.engine).map_err(|e| LoadError::Component {
            name: spec.name.clone(),
            path: spec.path.display().to_string(),
            world: W::KIND.name(),
            error: format!("{e:#}"),
        })?;
        let stats = Stats::new(&spec.name, W::KIND.name())
            .map_err(|e| LoadError::Instantiate { name: spec.name.clone(), error: e.to_string() })?;
        let state = Arc::new(SharedState::new(host.clock.clone()));
        let stamp = file_stamp(&spec.path);
        let version = Self::build(host, &linker, &state, spec.clone(), 1)?;
        let (tx, rx) = sync_channel::<Job<W>>(spec.queue.max(1));
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..spec.threads.clamp(1, MAX_THREADS) {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("baton-plugin-{}-{i}", spec.name))
                .spawn(move || {
                    let mut live: Option<Live<W>> = None;
                    loop {
                        let job = match rx.lock() {
                            Ok(r) => r.recv(),
                            Err(_) => return,
                        };
                        match job {
                            Ok(job) => job(&mut live),
                            Err(_) => return,
                        }
                    }
                })
                .map_err(|e| LoadError::Instantiate { name: spec.name.clone(), error: e.to_string() })?;
        }
        Ok(Arc::new(Self {
            host: Arc::clone(host),
            linker,
            state,
            current: RwLock::new(Arc::new(version)),
            tx: Mutex::new(Some(tx)),
            idle: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(2),
            stats: Arc::new(stats),
            seen: Mutex::new(stamp),
        }))
    }

    /// Reads, pins, compiles and validates one version.
    fn build(
        host: &Arc<Host>,
        linker: &wasmtime::component::Linker<Ctx>,
        state: &Arc<SharedState>,
        spec: Spec,
        id: u64,
    ) -> Result<Version<W>, LoadError> {
        let (name, path) = (spec.name.clone(), spec.path.display().to_string());
        let read_err = |error: String| LoadError::Read { name: name.clone(), path: path.clone(), error };
        let len = std::fs::metadata(&spec.path).map_err(|e| read_err(e.to_string()))?.len();
        if len > MAX_COMPONENT_BYTES {
            return Err(LoadError::TooLarge { name, path, bytes: len, limit: MAX_COMPONENT_BYTES });
        }
        let bytes = std::fs::read(&spec.path).map_err(|e| read_err(e.to_string()))?;
        let sha = sha256_hex(&bytes);
        if let Some(pin) = &spec.sha256
            && !pin.eq_ignore_ascii_case(&sha)
        {
            return Err(LoadError::Pin { name, path, actual: sha, pinned: pin.clone() });
        }
        let comp_err = |e: wasmtime::Error| LoadError::Component {
            name: name.clone(),
            path: path.clone(),
            world: W::KIND.name(),
            error: format!("{e:#}"),
        };
        let component = Component::new(&host.engine, &bytes).map_err(comp_err)?;
        let pre = W::pre(linker, &component).map_err(comp_err)?;
        let shared = Arc::new(PluginShared {
            name: spec.name.clone(),
            config_json: spec.config_json.clone(),
            state: Arc::clone(state),
            log_window: AtomicU64::new(0),
            log_lines: AtomicU64::new(0),
            logs_dropped: AtomicU64::new(0),
        });
        let v = Version {
            id,
            sha256: sha,
            pre,
            shared,
            spec,
            in_a_row: AtomicU32::new(0),
            disabled: AtomicBool::new(false),
        };
        // A version serves only once one instance of it came up and accepted its config.
        let mut live = Self::instantiate(host, &v)
            .map_err(|e| LoadError::Instantiate { name: name.clone(), error: format!("{e:#}") })?;
        arm(&mut live.store, v.spec.instantiate_deadline);
        match W::validate(&live.bindings, &mut live.store, &v.spec.config_json) {
            Ok(()) => Ok(v),
            Err(ValidateError::Refused { reason }) => Err(LoadError::Config { name, error: reason }),
            Err(e) => Err(LoadError::Instantiate { name, error: e.to_string() }),
        }
    }

    fn instantiate(host: &Host, v: &Version<W>) -> wasmtime::Result<Live<W>> {
        let limits = wasmtime::StoreLimitsBuilder::new()
            .memory_size((v.spec.memory_mib.min(MAX_MEMORY_MIB) as usize) << 20)
            .trap_on_grow_failure(true)
            .build();
        let mut store = Store::new(&host.engine, Ctx::new(Arc::clone(&v.shared), limits));
        store.limiter(|c| &mut c.limits);
        store.epoch_deadline_callback(|mut cx| Ok(cx.data_mut().budget.check()));
        arm(&mut store, v.spec.instantiate_deadline);
        let bindings = W::instantiate(&v.pre, &mut store)?;
        Ok(Live { version: v.id, store, bindings })
    }

    fn version(&self) -> Arc<Version<W>> {
        match self.current.read() {
            Ok(g) => Arc::clone(&g),
            Err(e) => Arc::clone(&e.into_inner()),
        }
    }

    pub fn info(&self) -> PluginInfo {
        let v = self.version();
        PluginInfo {
            name: v.spec.name.clone(),
            world: W::KIND.name(),
            wit: W::wit_version(&v.pre),
            path: v.spec.path.display().to_string(),
            sha256: v.sha256.clone(),
            version: v.id,
            disabled: v.disabled.load(Ordering::Relaxed),
        }
    }

    pub fn spec(&self) -> Spec {
        self.version().spec.clone()
    }

    /// The state shared by this plugin's instances (tests read it).
    pub fn state(&self) -> &Arc<SharedState> {
        &self.state
    }

    /// Loads `spec` (or the current one again) as a new version and swaps it in; on error the
    /// current version keeps serving.
    pub fn reload(&self, spec: Option<Spec>) -> Result<PluginInfo, LoadError> {
        let spec = spec.unwrap_or_else(|| self.spec());
        let stamp = file_stamp(&spec.path);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        match Self::build(&self.host, &self.linker, &self.state, spec, id) {
            Ok(v) => {
                let v = Arc::new(v);
                match self.current.write() {
                    Ok(mut g) => *g = v,
                    Err(e) => *e.into_inner() = v,
                }
                if let Ok(mut s) = self.seen.lock() {
                    *s = stamp;
                }
                if let Ok(mut idle) = self.idle.lock() {
                    idle.clear();
                }
                self.stats.reloads.fetch_add(1, Ordering::Relaxed);
                let info = self.info();
                tracing::info!(
                    plugin = info.name,
                    sha256 = info.sha256,
                    version = info.version,
                    "plugin loaded"
                );
                Ok(info)
            }
            Err(e) => {
                self.stats.reload_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "plugin reload refused; the current version keeps serving");
                Err(e)
            }
        }
    }

    /// Reloads when the file changed since it was last loaded (the watcher calls this).
    pub fn reload_if_changed(&self) -> Option<Result<PluginInfo, LoadError>> {
        let spec = self.spec();
        let now = file_stamp(&spec.path);
        let changed = self.seen.lock().map(|s| *s != now).unwrap_or(false);
        (changed && now.is_some()).then(|| {
            if let Ok(mut s) = self.seen.lock() {
                // Marked first: a file that fails to load is not retried until it changes again.
                *s = now;
            }
            self.reload(None)
        })
    }

    fn fault(&self, v: &Version<W>, kind: Fault, detail: &str) {
        if let Some(c) = self.stats.faults.get(kind as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        let n = v.in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(
            plugin = v.spec.name,
            fault = kind.name(),
            detail,
            "plugin fault; the built-in policy decides"
        );
        if n >= v.spec.max_faults.max(1) && !v.disabled.swap(true, Ordering::Relaxed) {
            tracing::error!(plugin = v.spec.name, faults = n, "plugin switched off until reload");
        }
    }

    /// Counts an answer the caller found invalid (for example a route to an ejected endpoint).
    pub fn invalid(&self, detail: &str) {
        self.fault(&self.version(), Fault::Invalid, detail);
    }

    /// Runs `f` on this thread's instance of `v`, (re)instantiating it when needed; a fault
    /// discards the instance.
    fn run<R>(
        &self,
        v: &Version<W>,
        live: &mut Option<Live<W>>,
        f: impl FnOnce(&W::Bindings, &mut Store<Ctx>) -> wasmtime::Result<R>,
    ) -> Option<R> {
        if live.as_ref().is_none_or(|l| l.version != v.id) {
            *live = None;
            match Self::instantiate(&self.host, v) {
                Ok(l) => *live = Some(l),
                Err(e) => {
                    self.fault(v, Fault::Instantiate, &format!("{e:#}"));
                    return None;
                }
            }
        }
        let l = live.as_mut()?;
        arm(&mut l.store, v.spec.deadline);
        match f(&l.bindings, &mut l.store) {
            Ok(r) => {
                v.in_a_row.store(0, Ordering::Relaxed);
                Some(r)
            }
            Err(e) => {
                *live = None;
                self.fault(v, Fault::of(&e), &format!("{e:#}"));
                None
            }
        }
    }

    /// Sends a call to the plugin's threads and waits for its answer; `None` when the built-in
    /// must decide (off, busy, fault).
    async fn call<R: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&W::Bindings, &mut Store<Ctx>) -> wasmtime::Result<R> + Send + 'static,
    ) -> Option<R> {
        let v = self.version();
        if v.disabled.load(Ordering::Relaxed) {
            self.stats.disabled_skips.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let started = Instant::now();
        if v.spec.inline {
            let r = self.call_inline(&v, f);
            self.stats.called(started);
            return r;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let me = Arc::clone(self);
        let wait = budget::wall_cap(v.spec.instantiate_deadline)
            + budget::wall_cap(v.spec.deadline)
            + Duration::from_millis(100);
        let job: Job<W> = Box::new(move |live| {
            let _ = tx.send(me.run(&v, live, f));
        });
        if !self.send(job) {
            return None;
        }
        let r = tokio::time::timeout(wait, rx).await.ok().and_then(Result::ok).flatten();
        self.stats.called(started);
        r
    }

    /// One call on this thread with an idle instance (or a new one), returned afterwards unless it
    /// faulted or belongs to an older version. A host panic inside the call (a WASI shim not
    /// meant for a runtime thread) is caught and counted as a trap.
    fn call_inline<R>(
        &self,
        v: &Version<W>,
        f: impl FnOnce(&W::Bindings, &mut Store<Ctx>) -> wasmtime::Result<R>,
    ) -> Option<R> {
        let mut live = self.idle.lock().ok().and_then(|mut i| i.pop());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run(v, &mut live, f)));
        match r {
            Ok(r) => {
                if let Some(l) = live.filter(|l| l.version == v.id)
                    && let Ok(mut idle) = self.idle.lock()
                    && idle.len() < MAX_IDLE_INSTANCES
                {
                    idle.push(l);
                }
                r
            }
            Err(_) => {
                self.fault(v, Fault::Trap, "host panic during the call; instance discarded");
                None
            }
        }
    }

    fn send(&self, job: Job<W>) -> bool {
        let sent = match self.tx.lock() {
            Ok(tx) => tx.as_ref().map(|tx| tx.try_send(job)),
            Err(_) => None,
        };
        match sent {
            Some(Ok(())) => true,
            Some(Err(TrySendError::Full(_))) | None | Some(Err(TrySendError::Disconnected(_))) => {
                self.stats.busy.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// A caller that owns one instance and calls it on the current thread (benchmarks, tests and
    /// `baton plugin check`; the gateway uses the threads).
    pub fn direct(self: &Arc<Self>) -> Direct<W> {
        Direct { plugin: Arc::clone(self), live: None }
    }
}

/// Calls a plugin on the caller's thread, with the same deadline, limits and fault handling.
pub struct Direct<W: World> {
    plugin: Arc<Plugin<W>>,
    live: Option<Live<W>>,
}

impl<W: World> std::fmt::Debug for Direct<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Direct").field("plugin", &self.plugin).finish()
    }
}

impl<W: World> Direct<W> {
    fn run<R>(&mut self, f: impl FnOnce(&W::Bindings, &mut Store<Ctx>) -> wasmtime::Result<R>) -> Option<R> {
        let v = self.plugin.version();
        if v.disabled.load(Ordering::Relaxed) {
            self.plugin.stats.disabled_skips.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        self.plugin.run(&v, &mut self.live, f)
    }
}

pub mod calls;
pub mod runtime;
pub use calls::{AdmissionPlugin, Admit, PolicyRequest, QueueState, RoutingPlugin, Usage};
pub use runtime::{
    CheckedPlugins, PluginStartError, Plugins, ReloadError, Reread, RereadError, Sender, TenantNames,
    opaque_tenant,
};

#[cfg(test)]
mod tests;

/// What `baton plugin check` reports.
#[derive(Clone, Debug)]
pub struct CheckReport {
    pub world: WorldKind,
    /// The `baton:policy` version it was built for.
    pub wit: &'static str,
    pub sha256: String,
    pub bytes: usize,
    pub compile: Duration,
}

/// Which world a component implements and whether it accepts `config_json`: compiled, linked,
/// instantiated and asked to `validate-config`, as the gateway would at start.
pub fn check_component(path: &Path, config_json: &str) -> Result<CheckReport, CheckError> {
    // A cache of its own, so the load below reuses the compile that found the world.
    let host = Host::new(Some(&std::env::temp_dir().join("baton-plugin-check")), Clock::monotonic())?;
    let bytes = std::fs::read(path).map_err(|source| CheckError::Read { path: path.to_owned(), source })?;
    let started = Instant::now();
    let world = host.world_of(&bytes)?;
    let compile = started.elapsed();
    let mut spec = Spec::new(path.file_stem().and_then(|s| s.to_str()).unwrap_or("plugin"), path);
    spec.config_json = config_json.to_owned();
    spec.threads = 1;
    let info = match world {
        WorldKind::Admission => AdmissionPlugin::load(&host, spec).map(|p| p.info()),
        WorldKind::Routing => RoutingPlugin::load(&host, spec).map(|p| p.info()),
    }?;
    Ok(CheckReport { world, wit: info.wit, sha256: sha256_hex(&bytes), bytes: bytes.len(), compile })
}
