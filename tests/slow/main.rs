//! The slower in-process suites: faults, cut schedules, flow control, smuggling, sessions'
//! owners and principals, the upstream's framing.
//!
//! One test crate per tier, each file a module (linkerd2-proxy's integration crate): the
//! support harness is compiled once per tier, not once per file. Run one file's tests with
//! `cargo test --test slow <file>::`.

#[path = "../support/mod.rs"]
mod support;

mod cut_schedule;
mod faults;
mod flow_control;
mod principals;
mod session_ownership;
mod smuggling;
mod upstream_framing;
