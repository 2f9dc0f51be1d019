//! The fast tier: the gateway in this process against the mock upstream, in seconds
//! (`./scripts/test --fast`).
//!
//! One test crate per tier, each file a module (linkerd2-proxy's integration crate): the
//! support harness is compiled once per tier, not once per file. Run one file's tests with
//! `cargo test --test fast <file>::`.

#[path = "../support/mod.rs"]
mod support;

mod demo_upstream;
mod fuzz_corpora;
mod gateway;
mod h2;
mod limits;
mod shapes;
mod spans;
mod standalone_hold;
mod timers;
