//! Fuzz target: the upstream response reader (head and body framing) against arbitrary bytes.
//! The properties and the check are in `fuzz/checks/h1_response.rs`, which
//! `tests/fast/fuzz_corpora.rs` also runs over this target's corpus.
#![no_main]

#[path = "../checks/h1_response.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|input: &[u8]| check::check(input));
