//! The two WIT worlds (`wit/policy.wit`) bound with wasmtime's `bindgen!` (sync), the host
//! functions plugins import, and what the gateway needs of each world to run it generically.

use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Store, StoreLimits};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::PluginShared;

/// The `admission` and `routing` worlds of the WIT package at `$path`, bound: the routing world
/// shares the admission world's `host` and `types`.
macro_rules! bind_worlds {
    ($path:literal) => {
        #[allow(clippy::all, unreachable_pub, missing_debug_implementations, missing_docs)]
        pub mod admission {
            wasmtime::component::bindgen!({ world: "admission", path: $path });
        }

        #[allow(clippy::all, unreachable_pub, missing_debug_implementations, missing_docs)]
        pub mod routing {
            wasmtime::component::bindgen!({
                world: "routing",
                path: $path,
                with: {
                    "baton:policy/host": super::admission::baton::policy::host,
                    "baton:policy/types": super::admission::baton::policy::types,
                },
            });
        }
    };
}

bind_worlds!("../wit");

/// The frozen `baton:policy@0.1.0` (`wit/0.1.0`): components built for it still run, their calls
/// converted to and from the current types (their routing views lack `cached-tokens` and
/// `pending-tokens`).
pub mod v0_1 {
    bind_worlds!("../wit/0.1.0");
}

/// The package versions the gateway runs, newest first.
pub const WIT_VERSIONS: [&str; 2] = ["0.2.0", "0.1.0"];

/// What every store holds: WASI (no files, no network), the memory limit, the plugin's shared part.
pub struct Ctx {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(super) limits: StoreLimits,
    pub(super) shared: std::sync::Arc<PluginShared>,
    /// The running call's CPU budget, checked at each epoch deadline.
    pub(super) budget: super::budget::Budget,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx").field("plugin", &self.shared.name).finish()
    }
}

impl Ctx {
    pub(super) fn new(shared: std::sync::Arc<PluginShared>, limits: StoreLimits) -> Self {
        // No preopened directories, no environment, no arguments, stdio to nowhere, no sockets.
        let wasi = WasiCtx::builder().allow_tcp(false).allow_udp(false).allow_ip_name_lookup(false).build();
        Self {
            wasi,
            table: ResourceTable::new(),
            limits,
            shared,
            budget: super::budget::Budget::new(std::time::Duration::ZERO),
        }
    }
}

impl WasiView for Ctx {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// Longest log line kept from a plugin (bytes).
pub const MAX_LOG_BYTES: usize = 1024;

impl Ctx {
    fn log_line(&self, level: tracing::Level, message: &str) {
        if !self.shared.log_allowed() {
            return;
        }
        let end = message.floor_char_boundary(MAX_LOG_BYTES);
        let (plugin, msg) = (&self.shared.name, message.get(..end).unwrap_or(""));
        match level {
            tracing::Level::DEBUG | tracing::Level::TRACE => tracing::debug!(plugin, "{msg}"),
            tracing::Level::INFO => tracing::info!(plugin, "{msg}"),
            tracing::Level::WARN => tracing::warn!(plugin, "{msg}"),
            tracing::Level::ERROR => tracing::error!(plugin, "{msg}"),
        }
    }
}

/// The `host` interface of one package version: the same functions over that version's types.
macro_rules! host_impl {
    ($($m:ident)::+) => {
        impl $($m)::+::baton::policy::host::Host for Ctx {
            fn log(&mut self, level: $($m)::+::baton::policy::host::Level, message: String) {
                use $($m)::+::baton::policy::host::Level as L;
                let level = match level {
                    L::Debug => tracing::Level::DEBUG,
                    L::Info => tracing::Level::INFO,
                    L::Warn => tracing::Level::WARN,
                    L::Error => tracing::Level::ERROR,
                };
                self.log_line(level, &message);
            }

            fn now_us(&mut self) -> u64 {
                self.shared.state.clock().now_us()
            }

            fn config(&mut self) -> String {
                self.shared.config_json.clone()
            }

            fn counter_add(&mut self, key: String, delta: i32, ttl_ms: u32) -> i32 {
                self.shared.state.counter_add(&key, delta, ttl_ms)
            }

            fn bucket_take(
                &mut self,
                key: String,
                capacity: u32,
                refill_per_min: u32,
                amount: u32,
            ) -> $($m)::+::baton::policy::host::BucketState {
                let t = self.shared.state.bucket_take(&key, capacity, refill_per_min, amount);
                $($m)::+::baton::policy::host::BucketState {
                    taken: t.taken,
                    remaining: t.remaining,
                    retry_after_ms: t.retry_after_ms,
                }
            }

            fn bucket_give(&mut self, key: String, amount: u32) {
                self.shared.state.bucket_give(&key, amount);
            }
        }

        impl $($m)::+::baton::policy::types::Host for Ctx {}
    };
}

host_impl!(admission);
host_impl!(v0_1::admission);

/// Which world a component implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorldKind {
    Admission,
    Routing,
}

impl WorldKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Admission => "admission",
            Self::Routing => "routing",
        }
    }
}

/// A world the host can run: how to link, pre-instantiate, instantiate and validate.
pub trait World: Send + Sync + 'static {
    type Pre: Send + Sync + 'static;
    type Bindings: Send + 'static;
    const KIND: WorldKind;
    fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<Ctx>>;
    fn pre(linker: &Linker<Ctx>, c: &Component) -> wasmtime::Result<Self::Pre>;
    fn instantiate(pre: &Self::Pre, store: &mut Store<Ctx>) -> wasmtime::Result<Self::Bindings>;
    fn validate(b: &Self::Bindings, store: &mut Store<Ctx>, config: &str) -> Result<(), ValidateError>;
    /// The `baton:policy` version the component was built for.
    fn wit_version(pre: &Self::Pre) -> &'static str;
}

/// Why a plugin's `validate-config` did not accept its config.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValidateError {
    /// The plugin refused the config; the reason is the plugin's own.
    #[error("{reason}")]
    Refused { reason: String },
    /// The call did not complete: a trap, the deadline or the memory limit.
    #[error("validate-config: {source:#}")]
    Call {
        #[source]
        source: wasmtime::Error,
    },
}

/// WASI functions whose sync shims block on a Tokio runtime (wasmtime-wasi's `in_tokio`, which
/// panics on a runtime thread): here they trap instead, so a plugin can run on a request thread.
/// Policy plugins get no blocking I/O; they log through `host.log`.
const BLOCKING_WASI: [(&str, &[&str]); 3] = [
    ("wasi:io/poll@0.2.12", &["poll", "[method]pollable.ready", "[method]pollable.block"]),
    (
        "wasi:io/streams@0.2.12",
        &[
            "[method]output-stream.blocking-write-and-flush",
            "[method]output-stream.blocking-write-zeroes-and-flush",
            "[method]output-stream.blocking-flush",
            "[method]output-stream.blocking-splice",
            "[method]input-stream.blocking-read",
            "[method]input-stream.blocking-skip",
        ],
    ),
    ("wasi:sockets/udp-create-socket@0.2.12", &["create-udp-socket"]),
];

fn base_linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<Ctx>> {
    let mut l = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut l)?;
    l.allow_shadowing(true);
    for (iface, funcs) in BLOCKING_WASI {
        let mut i = l.instance(iface)?;
        for &f in funcs {
            i.func_new(f, move |_, _, _, _| {
                Err(wasmtime::format_err!("{f}: blocking I/O is not available to policy plugins"))
            })?;
        }
    }
    l.allow_shadowing(false);
    Ok(l)
}

/// A [`World`] over its two package versions: the pre-instantiated component and the instance are
/// of the version the component exports (the current one tried first), and the calls convert.
macro_rules! world {
    ($(#[$doc:meta])* $name:ident, $kind:ident, $module:ident, $bindings:ident, $pre:ident,
     $export:ident, $export_name:literal) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name;

        /// The component, pre-instantiated, in the version it was built for.
        #[allow(missing_debug_implementations)]
        pub enum $pre {
            Current($module::$pre<Ctx>),
            V0_1(v0_1::$module::$pre<Ctx>),
        }

        /// An instance, in the version it was built for.
        #[allow(missing_debug_implementations)]
        pub enum $bindings {
            Current($module::$bindings),
            V0_1(v0_1::$module::$bindings),
        }

        impl World for $name {
            type Pre = $pre;
            type Bindings = $bindings;
            const KIND: WorldKind = WorldKind::$kind;

            fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<Ctx>> {
                let mut l = base_linker(engine)?;
                $module::$bindings::add_to_linker::<Ctx, HasSelf<Ctx>>(&mut l, |c| c)?;
                v0_1::$module::$bindings::add_to_linker::<Ctx, HasSelf<Ctx>>(&mut l, |c| c)?;
                Ok(l)
            }

            fn pre(linker: &Linker<Ctx>, c: &Component) -> wasmtime::Result<Self::Pre> {
                let pre = linker.instantiate_pre(c).map_err(|e| {
                    e.context(format!(
                        "this gateway runs components built for baton:policy@{}",
                        WIT_VERSIONS.join(" or @")
                    ))
                })?;
                match $module::$pre::new(pre.clone()) {
                    Ok(p) => Ok($pre::Current(p)),
                    Err(current) => match v0_1::$module::$pre::new(pre) {
                        Ok(p) => Ok($pre::V0_1(p)),
                        Err(_) => Err(current.context(format!(
                            "the component exports no {}@{}",
                            $export_name,
                            WIT_VERSIONS.join(" or @")
                        ))),
                    },
                }
            }

            fn instantiate(pre: &Self::Pre, store: &mut Store<Ctx>) -> wasmtime::Result<Self::Bindings> {
                Ok(match pre {
                    $pre::Current(p) => $bindings::Current(p.instantiate(store)?),
                    $pre::V0_1(p) => $bindings::V0_1(p.instantiate(store)?),
                })
            }

            fn validate(b: &Self::Bindings, store: &mut Store<Ctx>, config: &str) -> Result<(), ValidateError> {
                let r = match b {
                    $bindings::Current(b) => b.$export().call_validate_config(store, config),
                    $bindings::V0_1(b) => b.$export().call_validate_config(store, config),
                };
                r.map_err(|source| ValidateError::Call { source })?.map_err(|reason| ValidateError::Refused { reason })
            }

            fn wit_version(pre: &Self::Pre) -> &'static str {
                match pre {
                    $pre::Current(_) => WIT_VERSIONS[0],
                    $pre::V0_1(_) => WIT_VERSIONS[1],
                }
            }
        }
    };
}

world!(
    /// The `admission` world.
    AdmissionWorld, Admission, admission, Admission, AdmissionPre, baton_policy_admission_policy,
    "baton:policy/admission-policy"
);
world!(
    /// The `routing` world.
    RoutingWorld, Routing, routing, Routing, RoutingPre, baton_policy_routing_policy,
    "baton:policy/routing-policy"
);
