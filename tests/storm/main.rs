//! The worst minute (issue 50): 1,000 sessions cut at once and resumed together, through one
//! gateway and through a fleet losing a replica. A crate of its own, as it was a binary of its
//! own before the tiers were merged: it loads both cores for seconds, and no other case of a
//! tier that counts on a lease's timing runs beside it.
//!
//! Run with `cargo test --test storm`.

#[path = "../support/mod.rs"]
mod support;

mod storm;
