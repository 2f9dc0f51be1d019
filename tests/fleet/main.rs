//! A fleet sharing its sessions through a real `redis-server` (`--store`): the mock upstream,
//! three replicas behind HAProxy, the real SDKs through the fleet.
//!
//! One test crate per tier, each file a module (linkerd2-proxy's integration crate): the
//! support harness is compiled once per tier, not once per file. Run one file's tests with
//! `cargo test --test fleet <file>::`.

#[path = "../support/mod.rs"]
mod support;

mod fleet_interop;
mod scale_out;
mod store;
