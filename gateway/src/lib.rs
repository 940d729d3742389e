//! baton's gateway: the OpenAI-compatible front door of a PD-disaggregated fleet.
//!
//! A request flows `server` (listeners, routes) → `pipeline` (the request driver: parsed by `api`,
//! counted by `tokenize`, admitted by a `policy` plugin, routed by `routing`, queued by `admission`)
//! → `handoff` (the decoder's mode runs its legs over the engines' client in `endpoints`) → back
//! through `pipeline` (timing, headers, usage) and `server`. `config` reads the TOML file (each
//! decode pool's own keys through `handoff`'s list of modes); `serve` and `demo` assemble a gateway
//! from it or from simulated engines; `cluster` shares decoders' slots with other replicas through a
//! store; `telemetry` (metrics, traces, request ids) and `auth` are
//! used across.
//!
//! Imports follow that order: the leaves (`routing`, `admission`, `endpoints`, `kv_events`) import
//! no module of the crate; `api` only `admission`; `auth` only `api`; `handoff` nothing above it
//! (each mode's configuration keys live in its module and are checked with `handoff::KeyError`,
//! which `config` reports as its own error); `pipeline` nothing of `server`, `config`, `serve` or
//! `demo`.

pub mod admission;
pub mod api;
pub mod auth;
pub mod cluster;
pub mod config;
#[cfg(feature = "demo")]
pub mod demo;
pub mod endpoints;
pub mod flow;
pub mod handoff;
pub mod kv_events;
pub mod pipeline;
pub mod policy;
pub mod prefix;
pub mod routing;
pub mod serve;
pub mod server;
pub mod telemetry;
pub mod tokenize;
