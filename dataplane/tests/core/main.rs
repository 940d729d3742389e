//! The data plane's integration tests, one binary (linking is slow on small machines).

mod common;
mod device_cpu;
mod failure_classes;
mod properties;
