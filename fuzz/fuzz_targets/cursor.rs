//! Fuzz target: the cursor (event id) codec. The properties and the check are in
//! `fuzz/checks/cursor.rs`, which `tests/fast/fuzz_corpora.rs` also runs over this target's corpus.
#![no_main]

#[path = "../checks/cursor.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|input: &[u8]| check::check(input));
