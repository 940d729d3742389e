//! How the KV of a request reaches its decoder: one strategy per handoff mode behind the
//! [`Handoff`] trait, and what the modes share (the engines' HTTP client, limits, request ids,
//! the legs' calls, the prefill fallback order, drains).
//!
//! The request driver (the `pipeline` module) owns everything common to the modes: parsing, counting,
//! plugin admission, routing, the admission slots' acquisition, phase timing, metrics and the
//! response headers. A mode implements only what differs: how many slots a prompt takes, its
//! legs, how it waits for the KV and what it gives back when a request ends early.
//!
//! Each mode lives in its own module, which also holds its configuration keys, their checks, how
//! it starts and how the demo's simulated engines play it ([`ModeSpec`]). The list at the foot of
//! this file is the one place that names them all: the configuration's `handoff = "…"`, the
//! demo's `--handoff`, [`Mode::ALL`] and the docs' checks derive from it. Adding a mode adds a
//! module and a line to that list.

pub mod decoder;
pub mod legs;
pub mod scrape;
pub mod shared;

pub mod lmcache;
pub mod native;
pub mod nixl;
pub mod sglang;

pub use decoder::{BoxFuture, Decoder, Handoff, Leg, Unstarted};
pub use legs::{BoxError, Drains, RespBody};
pub use shared::{
    DEFAULT_CANCEL_GRACE, DEFAULT_ENGINE_IDLE, DEFAULT_LEASE, DEFAULT_READY_TIMEOUT, DEFAULT_RELEASE_TIMEOUT,
    DEFAULT_UPSTREAM_TIMEOUT, Engine, KeyGen, Limits, Prefiller, Shared,
};

use std::sync::Arc;

use crate::admission::{QueueConfig, SlotQueue};
use crate::endpoints::{EngineUrl, Host};

/// A decode pool, checked: its name, its HTTP address, its mode with the mode's keys.
#[derive(Debug, Clone)]
pub struct CheckedDecoder {
    pub name: String,
    pub http: EngineUrl,
    pub mode: CheckedMode,
}

impl CheckedDecoder {
    /// Connects to the decoder as its mode needs and returns it, ready to serve.
    pub async fn start(self, ctx: &StartContext) -> Result<Arc<Decoder>, StartError> {
        let queue = SlotQueue::new(0, ctx.queue.clone());
        let mode = self.mode.name();
        let pool = Pool { name: &self.name, http: &self.http, queue: &queue };
        let handoff = self.mode.start(pool, ctx).await?;
        Ok(Arc::new(Decoder::new(self.name, self.http, queue, mode, handoff)))
    }
}

/// A pool key that fails its check: its path in the file (`decode[1].nixl.max_in_flight`) and
/// why. The configuration reports it as its own error, with the line when it has one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct KeyError {
    pub field: String,
    pub reason: String,
}

/// What the pools of one gateway share at start.
#[derive(Debug)]
pub struct StartContext {
    pub shared: Arc<Shared>,
    pub queue: QueueConfig,
    /// The `lmcache` notification listener (bound when a pool uses the mode).
    pub lmcache: Option<Arc<lmcache::Notifications>>,
    /// `[lmcache] first_token`.
    pub first_token: bool,
    /// `[lmcache] tool_call_parser`.
    pub tool_call_parser: Option<lmcache::tools::ToolParser>,
    /// `[dataplane_tls]`: how to reach `native` decoders' ranks when the data plane is authenticated.
    pub dataplane_tls: Option<crate::endpoints::DataplaneCerts>,
}

/// Why a decode pool could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A native decoder's data-plane ranks could not be reached or refused the handshake.
    #[error("decoder {decoder}: data plane: {source}")]
    DataPlane {
        decoder: String,
        #[source]
        source: baton_dataplane::transport::TransportError,
    },
    /// A decoder's mode cannot start as configured.
    #[error("decoder {decoder}: {reason}")]
    Decoder { decoder: String, reason: String },
}

/// What a mode's keys are checked against: the pool's place in the file, the model.
pub struct CheckContext<'a> {
    /// The pool's table path (`decode[2]`), for errors.
    pub field: &'a str,
    /// A path as written, made absolute against the configuration's directory.
    pub path: &'a dyn Fn(&std::path::Path) -> std::path::PathBuf,
    /// `model.chunk_tokens`.
    pub model_chunk: u32,
    /// The model's KV geometry at a TP size.
    pub geometry_for: &'a dyn Fn(u32) -> Result<baton_dataplane::KvGeometry, KeyError>,
    /// A global `[dataplane_tls]` is configured (the default of pools without their own).
    pub dataplane_tls_default: bool,
}

impl std::fmt::Debug for CheckContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckContext")
            .field("field", &self.field)
            .field("model_chunk", &self.model_chunk)
            .finish()
    }
}

impl CheckContext<'_> {
    /// An error at `key` of this pool.
    pub fn err(&self, key: &str, reason: impl Into<String>) -> KeyError {
        KeyError { field: format!("{}.{key}", self.field), reason: reason.into() }
    }

    /// `max_slots`, which lowers a pool's slots: not 0.
    pub fn max_slots(&self, m: Option<u32>) -> Result<Option<u32>, KeyError> {
        match m {
            Some(0) => Err(self.err("max_slots", "must be greater than 0")),
            m => Ok(m),
        }
    }

    /// The model's geometry at `tp`, its errors named for this pool.
    pub fn geometry(&self, tp: u32) -> Result<baton_dataplane::KvGeometry, KeyError> {
        (self.geometry_for)(tp)
            .map_err(|e| KeyError { field: format!("{} ({})", self.field, e.field), reason: e.reason })
    }
}

/// One decode pool as its mode starts it: its name, its HTTP address, its admission queue (the
/// mode sizes it).
#[derive(Debug)]
pub struct Pool<'a> {
    pub name: &'a str,
    pub http: &'a EngineUrl,
    pub queue: &'a SlotQueue,
}

/// A simulated engine of the demo, before it starts: the engine's own configuration, which the
/// mode completes, and the demo's settings for the modes.
#[cfg(feature = "demo")]
#[derive(Debug)]
pub struct SimSetup<'a> {
    pub engine: &'a mut baton_sim::SimConfig,
    /// The gateway's LMCache notification listener, when the mode has one.
    pub notify: Option<std::net::SocketAddr>,
    /// PD buffer pages per decoder rank.
    pub pages: u32,
    /// `lmcache`: prefillers answer before their chunks are written.
    pub lmcache_async_send: bool,
    /// `vllm-nixl`: how long prefillers keep blocks nobody read.
    pub nixl_abort_timeout: std::time::Duration,
    /// `sglang`: the engines' bootstrap settings.
    pub sglang: &'a baton_sim::SglangSimConfig,
}

/// A decoder of the demo: the simulated engine as started, for its mode to describe.
#[cfg(feature = "demo")]
#[derive(Debug)]
pub struct DemoDecoder<'a> {
    /// The engine's `stats()` (its ranks, its PD backend's ports).
    pub stats: &'a serde_json::Value,
    pub geometry: baton_dataplane::KvGeometry,
    /// Admission settings for the modes that admit from the decoder's metrics.
    pub load: &'a scrape::LoadTarget,
    /// `native`: the gateway reserves the pages (`reserve = "gateway"`), not the prefillers.
    pub gateway_reserves: bool,
    /// `native`: the prompt's ids go to the engines as a JSON array (`token_ids = "json"`), not
    /// in base64 (the demo's default: its engines read both).
    pub json_token_ids: bool,
}

/// A pool's keys beside `name`, `url` and `handoff`, as written.
pub trait PoolKeys: serde::de::DeserializeOwned + std::fmt::Debug {
    /// The keys, checked.
    type Checked: Clone + std::fmt::Debug;

    fn check(&self, cx: &CheckContext<'_>) -> Result<Self::Checked, KeyError>;
}

/// A mode's checked keys.
pub type Checked<M> = <<M as ModeSpec>::Keys as PoolKeys>::Checked;

/// How several gateway replicas keep from admitting more than a mode's decoder holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// The decoder's own state is the truth: its data plane refuses a reservation that does not
    /// fit, whoever asks (`native`). Replicas need nothing more.
    Engine,
    /// Each replica holds a share of the decoder's slots, granted by the `[cluster]` store so that
    /// the shares never sum past the capacity (`vllm-nixl`, `sglang`).
    Store,
    /// The mode cannot run behind several replicas: `lmcache` (the decoder's LMCache notifies one
    /// proxy address, `pd_proxy_host`, so the others never learn their requests' KV arrived).
    Single,
}

/// A handoff mode as the configuration, the gateway's start and the demo see it.
pub trait ModeSpec {
    /// Its name in the configuration (`handoff = "…"`) and in metric labels.
    const NAME: &'static str;
    /// Whether the mode needs the gateway's LMCache notification listener.
    const NOTIFICATIONS: bool = false;
    /// How several gateway replicas in front of the mode's decoders keep from over-committing them.
    const SHARING: Sharing = Sharing::Store;
    type Keys: PoolKeys;

    /// The pool's settings in one line, for `baton check-config` (after the mode's name).
    fn describe(c: &Checked<Self>) -> String;

    /// Host names the mode connects to beyond the pool's URL, with their keys (`dataplane[0]`).
    fn names(_c: &Checked<Self>) -> Vec<(String, &Host)> {
        Vec::new()
    }

    /// Connects as the mode needs; the decoder's handoff, ready to serve.
    fn start(
        c: Checked<Self>,
        pool: Pool<'_>,
        ctx: &StartContext,
    ) -> impl std::future::Future<Output = Result<Box<dyn Handoff>, StartError>> + Send;

    /// How the demo's simulated engine plays the mode (by default as it comes).
    #[cfg(feature = "demo")]
    fn sim(_s: SimSetup<'_>) {}

    /// The demo's decoder as a checked pool of the mode.
    #[cfg(feature = "demo")]
    fn demo(d: &DemoDecoder<'_>) -> Checked<Self>;
}

/// Declares the list of modes: [`Mode`], [`PoolMode`] and [`CheckedMode`], each dispatching to
/// the mode's [`ModeSpec`].
macro_rules! modes {
    ($($(#[$doc:meta])* $variant:ident => $spec:ty,)+) => {
        /// A handoff mode, by name.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Mode {
            $($(#[$doc])* $variant,)+
        }

        impl Mode {
            /// Every mode, in the list's order.
            pub const ALL: &'static [Mode] = &[$(Mode::$variant,)+];

            /// Its name, as in a configuration's `handoff`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Mode::$variant => <$spec as ModeSpec>::NAME,)+
                }
            }

            /// How replicas share its decoders (`[cluster]`).
            pub fn sharing(self) -> Sharing {
                match self {
                    $(Mode::$variant => <$spec as ModeSpec>::SHARING,)+
                }
            }

            /// Whether it needs the gateway's LMCache notification listener.
            pub fn notifications(self) -> bool {
                match self {
                    $(Mode::$variant => <$spec as ModeSpec>::NOTIFICATIONS,)+
                }
            }

            /// The mode named `name`.
            pub fn parse(name: &str) -> Option<Self> {
                Self::ALL.iter().copied().find(|m| m.name() == name)
            }

            /// The pool keys of this mode, read from a pool's table (less `name`, `url`, `handoff`).
            pub fn keys(self, t: toml::Table) -> Result<PoolMode, toml::de::Error> {
                Ok(match self {
                    $(Mode::$variant => PoolMode::$variant(serde::Deserialize::deserialize(t)?),)+
                })
            }

            /// How the demo's simulated engines play this mode.
            #[cfg(feature = "demo")]
            pub fn sim(self, s: SimSetup<'_>) {
                match self {
                    $(Mode::$variant => <$spec as ModeSpec>::sim(s),)+
                }
            }

            /// The demo's decoder as a checked pool of this mode.
            #[cfg(feature = "demo")]
            pub fn demo(self, d: &DemoDecoder<'_>) -> CheckedMode {
                match self {
                    $(Mode::$variant => CheckedMode::$variant(<$spec as ModeSpec>::demo(d)),)+
                }
            }
        }

        /// A pool's mode and its keys, as written.
        #[derive(Debug)]
        pub enum PoolMode {
            $($variant(<$spec as ModeSpec>::Keys),)+
        }

        impl PoolMode {
            pub fn check(&self, cx: &CheckContext<'_>) -> Result<CheckedMode, KeyError> {
                Ok(match self {
                    $(PoolMode::$variant(k) => CheckedMode::$variant(k.check(cx)?),)+
                })
            }
        }

        /// A pool's mode and its keys, checked.
        #[derive(Clone, Debug)]
        pub enum CheckedMode {
            $($variant(Checked<$spec>),)+
        }

        impl CheckedMode {
            pub fn mode(&self) -> Mode {
                match self {
                    $(CheckedMode::$variant(_) => Mode::$variant,)+
                }
            }

            /// The mode's name.
            pub fn name(&self) -> &'static str {
                self.mode().name()
            }

            /// The pool in one line, for `baton check-config`.
            pub fn describe(&self) -> String {
                match self {
                    $(CheckedMode::$variant(c) => format!("{}, {}", self.name(), <$spec as ModeSpec>::describe(c)),)+
                }
            }

            /// Host names the mode connects to beyond the pool's URL, with their keys.
            pub fn names(&self) -> Vec<(String, &Host)> {
                match self {
                    $(CheckedMode::$variant(c) => <$spec as ModeSpec>::names(c),)+
                }
            }

            /// Connects as the mode needs.
            pub async fn start(self, pool: Pool<'_>, ctx: &StartContext) -> Result<Box<dyn Handoff>, StartError> {
                match self {
                    $(CheckedMode::$variant(c) => <$spec as ModeSpec>::start(c, pool, ctx).await,)+
                }
            }
        }
    };
}

modes! {
    /// baton's data plane: reservations on every decoder rank, readiness events.
    Native => native::Native,
    /// vLLM with LMCache's PD backend: the prefiller pushes, ZMQ notifications.
    Lmcache => lmcache::Lmcache,
    /// vLLM's NIXL connector: the decoder pulls; admission from the decoder's metrics.
    VllmNixl => nixl::Nixl,
    /// SGLang's PD disaggregation: both legs at once, paired by a bootstrap room.
    Sglang => sglang::Sglang,
}

impl Default for Mode {
    /// The first in the list: a pool that names no mode has it.
    fn default() -> Self {
        Mode::ALL[0]
    }
}

#[cfg(test)]
mod tests {
    use super::Mode;

    /// The docs name every mode of the list: the configuration reference's `handoff` row, the
    /// gateway guide, and its `baton demo --handoff` line. A mode added to the list and not to the
    /// docs fails here.
    #[test]
    fn the_docs_name_every_mode() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
        let (reference, guide) = (read("configs/README.md"), read("docs/gateway.md"));
        let row = reference.lines().find(|l| l.contains("| `handoff` |")).expect("the handoff row");
        let demo = guide.lines().find(|l| l.starts_with("`baton demo --handoff ")).expect("the demo line");
        for m in Mode::ALL {
            let name = format!("`{}`", m.name());
            assert!(row.contains(&name), "configs/README.md's handoff row lacks {name}");
            assert!(guide.contains(&name), "docs/gateway.md does not describe {name}");
            assert!(*m == Mode::default() || demo.contains(m.name()), "the demo line lacks {name}");
        }
        assert!(
            row.contains(&format!("| `{}` |", Mode::default().name())),
            "the default is the list's first"
        );
    }
}
