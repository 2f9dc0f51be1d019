//! The bounded window against a plain `Vec` model, over arbitrary operation sequences.
//!
//! Input: a [`Case`] decoded from the bytes with the `arbitrary` crate, exactly as
//! `libfuzzer_sys::fuzz_target!` decodes a typed input (`arbitrary_take_rest`, inputs shorter
//! than the type's minimum size skipped).
//!
//! Model: entries in push order; a push of a frame larger than the byte budget is handed
//! back and changes nothing; otherwise it is appended and the oldest entries are evicted (in
//! order, each reported once) until both the count and the byte bound hold. `after(s, a)` is
//! the entries of stream `s` with seq > a, in order; `remove_stream(s)` drops them all.
//!
//! Properties, after every operation: evictions, `after`, `evict_oldest`, `len`, `bytes` as
//! the model says, and both bounds hold; at the end, every stream's retained entries in order.
//!
//! Shared by the fuzz target (`fuzz/fuzz_targets/window_model.rs`) and the corpus replay
//! (`tests/fast/fuzz_corpora.rs`), so every input the fuzzer ever kept stays a regression test.

use arbitrary::{Arbitrary, Unstructured};
use mcp_reattach::internals::{Entry, Window};

/// Checks every property above on one input; panics on a violation. Returns whether the
/// bytes decoded into a [`Case`] (if not, nothing was checked, and the fuzz target tells
/// libFuzzer to reject the input, as a typed `fuzz_target!` does). Called by the fuzz target
/// and by the corpus replay in `tests/fast/fuzz_corpora.rs`.
pub fn check(input: &[u8]) -> bool {
    if input.len() < <Case as Arbitrary>::size_hint(0).0 {
        return false;
    }
    match Case::arbitrary_take_rest(Unstructured::new(input)) {
        Ok(case) => {
            check_case(case);
            true
        }
        Err(_) => false,
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// Push a frame of `len` bytes on `stream`, `gap` seqs after the previous one.
    Push {
        stream: u8,
        len: u16,
        gap: u8,
    },
    /// Compare `after(stream, at)`; `at` is relative to the newest seq.
    After {
        stream: u8,
        back: u16,
    },
    RemoveStream {
        stream: u8,
    },
    /// `evict_oldest()`: the model's first entry, if any.
    EvictOldest,
}

#[derive(Arbitrary, Debug)]
struct Case {
    max_events: u8,
    max_bytes: u16,
    ops: Vec<Op>,
}

struct Model {
    entries: Vec<(u64, u32, usize)>,
    max_events: usize,
    max_bytes: usize,
}

impl Model {
    fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.2).sum()
    }
}

fn check_case(case: Case) {
    let max_events = 1 + case.max_events as usize % 32;
    let max_bytes = case.max_bytes as usize;
    let mut w = Window::new(max_events, max_bytes);
    let mut m = Model {
        entries: Vec::new(),
        max_events,
        max_bytes,
    };
    let mut seq = 0u64;
    // Every position issued to each stream, evicted or not, as the session knows them: a
    // stream is removed over the range of its positions.
    let mut issued: [Option<(u64, u64)>; 5] = [None; 5];
    for op in case.ops.iter().take(512) {
        match *op {
            Op::Push { stream, len, gap } => {
                seq += 1 + gap as u64;
                let stream = stream as u32 % 4;
                let len = len as usize % 2048;
                let range = &mut issued[stream as usize];
                *range = Some((range.map_or(seq, |r| r.0), seq));
                let entry = Entry {
                    seq,
                    stream,
                    message: gap % 2 == 0,
                    body: vec![b'x'; len].into_boxed_slice(),
                };
                let mut evicted = Vec::new();
                let r = w.push(entry, |old| evicted.push(old.seq));
                // Model.
                let mut want_evicted = Vec::new();
                if len > m.max_bytes {
                    let back = r.expect_err("oversized entry is handed back");
                    assert_eq!(back.seq, seq);
                    assert_eq!(back.len(), len);
                } else {
                    assert!(
                        r.is_ok(),
                        "entry of {len} bytes within {max_bytes} retained"
                    );
                    m.entries.push((seq, stream, len));
                    while m.entries.len() > m.max_events || m.bytes() > m.max_bytes {
                        want_evicted.push(m.entries.remove(0).0);
                    }
                }
                assert_eq!(evicted, want_evicted, "evictions");
            }
            Op::After { stream, back } => {
                let stream = stream as u32 % 5; // 4 = a stream never used
                let at = seq.saturating_sub(back as u64 % 64);
                let got: Vec<(u64, usize)> =
                    w.after(stream, at).map(|e| (e.seq, e.len())).collect();
                let want: Vec<(u64, usize)> = m
                    .entries
                    .iter()
                    .filter(|e| e.1 == stream && e.0 > at)
                    .map(|e| (e.0, e.2))
                    .collect();
                assert_eq!(got, want, "after({stream}, {at})");
            }
            Op::EvictOldest => {
                let got = w.evict_oldest().map(|e| (e.seq, e.stream, e.len()));
                let want = (!m.entries.is_empty()).then(|| m.entries.remove(0));
                assert_eq!(got, want, "evict_oldest");
            }
            Op::RemoveStream { stream } => {
                let stream = stream as u32 % 5;
                let (first, last) = issued[stream as usize].unwrap_or((seq, seq));
                w.remove_stream(stream, first..=last);
                m.entries.retain(|e| e.1 != stream);
            }
        }
        assert_eq!(w.len(), m.entries.len());
        assert_eq!(w.is_empty(), m.entries.is_empty());
        assert_eq!(w.bytes(), m.bytes());
        assert!(
            w.len() <= max_events && w.bytes() <= max_bytes,
            "bounds hold"
        );
    }
    // Everything retained, in order, per stream.
    for s in 0..4 {
        let got: Vec<u64> = w.after(s, 0).map(|e| e.seq).collect();
        let want: Vec<u64> = m.entries.iter().filter(|e| e.1 == s).map(|e| e.0).collect();
        assert_eq!(got, want);
    }
}
