//! The real binary, one gateway: SIGTERM's drain, SIGHUP, `/metrics` through promtool,
//! flags, TLS, exhaustion, traces, the operators' sessions and their page, the deploy files.
//!
//! One test crate per tier, each file a module (linkerd2-proxy's integration crate): the
//! support harness is compiled once per tier, not once per file. Run one file's tests with
//! `cargo test --test binary <file>::`.

#[path = "../support/mod.rs"]
mod support;

mod admin;
mod admin_ui;
mod cli;
mod deploy;
mod exhaustion;
mod ops;
mod telemetry;
mod tls;
