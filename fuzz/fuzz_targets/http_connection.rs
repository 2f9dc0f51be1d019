//! Fuzz target: a whole client connection through the real gateway in front of a stub
//! upstream. The harness, the properties and the check are in `fuzz/checks/http_connection.rs`,
//! which `tests/fast/fuzz_corpora.rs` also runs over this target's corpus. Ignoring SIGPIPE is here:
//! it is unsafe code, which the main crate's tests forbid (and do not need: Rust's own `main`
//! already ignores it).
#![no_main]

#[path = "../checks/http_connection.rs"]
mod check;

use std::sync::Once;

libfuzzer_sys::fuzz_target!(|input: &[u8]| {
    static SIGPIPE: Once = Once::new();
    SIGPIPE.call_once(|| {
        // libFuzzer's C++ main skips Rust's runtime setup, which ignores SIGPIPE: a write to a
        // connection the peer reset would kill the process (the real binary ignores it).
        // SAFETY: setting a signal disposition to SIG_IGN before the check starts any thread.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    });
    check::check(input)
});
