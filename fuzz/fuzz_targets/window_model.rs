//! Fuzz target: the bounded window against a plain `Vec` model. The input decoding, the
//! properties and the check are in `fuzz/checks/window_model.rs`, which `tests/fast/fuzz_corpora.rs`
//! also runs over this target's corpus.
#![no_main]

#[path = "../checks/window_model.rs"]
mod check;

use libfuzzer_sys::{fuzz_target, Corpus};

fuzz_target!(|input: &[u8]| -> Corpus {
    if check::check(input) {
        Corpus::Keep
    } else {
        // Not a `Case`: nothing checked, as a typed `fuzz_target!` rejects it.
        Corpus::Reject
    }
});
