//! Fuzz target: the SSE decoder (and encoder) against arbitrary bytes. The properties and the
//! check are in `fuzz/checks/sse_decoder.rs`, which `tests/fast/fuzz_corpora.rs` also runs over
//! this target's corpus. The counting allocator (for the bounded-memory property) is here:
//! it is unsafe code, which the main crate's tests forbid.
#![no_main]

#[path = "../checks/sse_decoder.rs"]
mod check;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::Ordering;

use check::LIVE;

struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        System.dealloc(p, l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        System.realloc(p, l, new)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

libfuzzer_sys::fuzz_target!(|input: &[u8]| check::check(input));
