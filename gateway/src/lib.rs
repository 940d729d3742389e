//! baton's gateway: the OpenAI-compatible front door of a PD-disaggregated fleet.
//!
//! Data flows one way: api → tokenize → routing/admission → handoff → endpoints. Lower layers never
//! import higher ones.

pub mod admission;
pub mod api;
pub mod auth;
pub mod config;
#[cfg(feature = "demo")]
pub mod demo;
pub mod endpoints;
pub mod handoff;
pub mod kv_events;
pub mod pipeline;
pub mod policy;
pub mod routing;
pub mod serve;
pub mod server;
pub mod telemetry;
pub mod tokenize;
