//! Fuzz target: the client side's request reader (head and body framing) against arbitrary
//! bytes. The properties and the check are in `fuzz/checks/h1_request.rs`, which
//! `tests/fast/fuzz_corpora.rs` also runs over this target's corpus.
#![no_main]

#[path = "../checks/h1_request.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|input: &[u8]| {
    let _ = check::check(input);
});
