//! Fuzz target: the gateway's HTTP/1.1 request reader against hyper's HTTP/1.1 server on the
//! same bytes: they agree, or the gateway's is the stricter. The property and the check are in
//! `fuzz/checks/h1_differential.rs`, which `tests/fast/fuzz_corpora.rs` also runs over the
//! `h1_request` corpus (run this target on that corpus: `cargo +nightly fuzz run
//! h1_differential corpus/h1_request`).
#![no_main]

#[path = "../checks/h1_differential.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|input: &[u8]| {
    let _ = check::check(input);
});
