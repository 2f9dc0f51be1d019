//! The real MCP SDKs (TypeScript, Python, Rust) as clients and servers through the gateway,
//! every server shape, and the MCP conformance suite.
//!
//! One test crate per tier, each file a module (linkerd2-proxy's integration crate): the
//! support harness is compiled once per tier, not once per file. Run one file's tests with
//! `cargo test --test sdk <file>::`.

#[path = "../support/mod.rs"]
mod support;

mod e2e_ts_sdk;
mod interop_conformance;
mod interop_matrix;
mod interop_reattach;
mod interop_shapes;
mod interop_standalone_race;
