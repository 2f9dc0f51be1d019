//! The SSE decoder (and encoder) against arbitrary bytes.
//!
//! Input: `[mode][limit][split seeds...][0xFF separator][stream bytes]` (see `Case`).
//!
//! Properties:
//! 1. No panic, whatever the bytes and the limit.
//! 2. Split invariance: feeding the stream in arbitrary pieces gives the same events, and the
//!    same error (at the same point), as feeding it whole.
//! 3. Bounded memory: after each `feed`, the bytes the decoder holds (measured with a counting
//!    global allocator, emitted events dropped) stay within a small multiple of the limit.
//! 4. No emitted event is larger than the limit.
//! 5. Round trip: events built from the input, encoded with `sse::encode` (LF, or with every
//!    LF rewritten to CRLF or CR), decode to the same events with the gateway's id, even with
//!    a limit equal to the largest encoded block, and in any split.
//! 6. The window's compact form (`write_id` + implied `event: message` + the event's `body`,
//!    built as it was decoded) is byte-identical to `encode`.
//!
//! Shared by the fuzz target (`fuzz/fuzz_targets/sse_decoder.rs`) and the corpus replay
//! (`tests/fast/fuzz_corpora.rs`), so every input the fuzzer ever kept stays a regression test.

use std::sync::atomic::{AtomicIsize, Ordering};

use bytes::BytesMut;
use mcp_reattach::internals::{encode, write_id, Decoder, Event, SseError};

/// Live heap bytes, kept by the fuzz target's counting global allocator (unsafe code, so it
/// lives in the target: the main crate forbids `unsafe`). In the corpus replay nothing counts
/// and property 3 is not checked; the fuzz smoke checks it.
pub static LIVE: AtomicIsize = AtomicIsize::new(0);

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Feeds `chunks` in order, stopping at the first error. Returns the events and the error.
fn decode(limit: usize, chunks: &[&[u8]]) -> (Vec<Event>, Option<SseError>) {
    let mut d = Decoder::new(limit);
    let mut out = Vec::new();
    for c in chunks {
        if let Err(e) = d.feed(c, &mut out) {
            return (out, Some(e));
        }
    }
    (out, None)
}

/// Splits `data` at points derived from `seeds` (sorted, deduplicated, in range), none of
/// them inside the first `keep_head` bytes.
fn split<'a>(data: &'a [u8], seeds: &[u8], keep_head: usize) -> Vec<&'a [u8]> {
    let mut points: Vec<usize> = seeds
        .chunks(2)
        .map(|c| {
            let v = c.iter().fold(0usize, |a, &b| (a << 8) | b as usize);
            if data.is_empty() {
                0
            } else {
                v % (data.len() + 1)
            }
        })
        .collect();
    points.retain(|&p| p == 0 || p >= keep_head);
    points.sort_unstable();
    points.dedup();
    let mut out = Vec::new();
    let mut prev = 0;
    for p in points.into_iter().chain(std::iter::once(data.len())) {
        out.push(&data[prev..p]);
        prev = p;
    }
    out
}

fn size_of_event(e: &Event) -> usize {
    e.id().map_or(0, str::len) + e.event().map_or(0, str::len) + e.data().map_or(0, |s| s.len())
}

/// A limit from one byte: often tiny (so limits are hit), sometimes effectively unlimited.
fn limit_from(b: u8) -> usize {
    match b {
        0..=199 => 1 + b as usize,
        200..=249 => 256 + (b as usize - 200) * 64,
        _ => 1 << 20,
    }
}

fn raw_mode(limit: usize, seeds: &[u8], data: &[u8]) {
    let whole = decode(limit, &[data]);
    for e in &whole.0 {
        assert!(
            size_of_event(e) <= limit,
            "event over the limit {limit}: {e:?}"
        );
    }

    // Split invariance, against a few splits: the given one and a byte-at-a-time one.
    // No split point inside the first bytes is special: a BOM-like prefix held back across
    // chunks counts toward the limit like any other byte (a bug this target found, fixed in
    // e60bd98; the regression test is in tests/slow/cut_schedule.rs).
    let keep_head = 0;
    let pieces = split(data, seeds, keep_head);
    let got = decode(limit, &pieces);
    assert_eq!(got, whole, "split {pieces:?} differs from whole feed");
    if data.len() <= 512 {
        let head = keep_head.min(data.len());
        let bytes: Vec<&[u8]> = std::iter::once(&data[..head])
            .chain(data[head..].chunks(1))
            .collect();
        let got = decode(limit, &bytes);
        assert_eq!(got, whole, "byte-at-a-time differs from whole feed");
    }

    // Bounded memory: what the decoder holds between feeds, outputs dropped.
    let base = live();
    let mut d = Decoder::new(limit);
    for c in &pieces {
        let mut out = Vec::new();
        let r = d.feed(c, &mut out);
        drop(out);
        let held = live() - base;
        // The current line plus the fields of the event being built, each at most `limit`
        // bytes of content, with Vec growth slack.
        let bound = 8 * limit as isize + 4096;
        assert!(
            held <= bound,
            "decoder holds {held} bytes with limit {limit} (bound {bound})"
        );
        if r.is_err() {
            break;
        }
    }
    drop(d);
}

/// Builds events from the input, encodes them, and decodes them back.
fn round_trip(seeds: &[u8], data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    // Up to 8 events; fields from '|'-separated pieces of the text, CR removed (the decoder
    // never produces CR in a field; LF only in data).
    let mut events = Vec::new();
    for (i, part) in text.split('\u{1}').take(8).enumerate() {
        let mut f = part.split('|');
        let clean = |s: &str| s.replace(['\r', '\n'], "");
        let data = f.next().map(|s| s.replace('\r', ""));
        let event = f.next().map(clean).filter(|s| !s.is_empty());
        let retry = f.next().and_then(|s| s.trim().parse::<u64>().ok());
        let data = data.filter(|d| !(i % 3 == 2 && d.is_empty()));
        events.push(Event::new(None, event.as_deref(), data.as_deref(), retry));
    }
    let mut lf = BytesMut::new();
    let mut biggest = 0;
    let mut expected = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let id = format!("00000000000000ab.0.{i}");
        let before = lf.len();
        encode(&id, e, &mut lf);
        // Bytes of the block the decoder counts: its lines without their line ends.
        let block = &lf[before..];
        // The compact form the window keeps: id line + implied `event: message` + body.
        assert_eq!(e.message(), e.event() == Some("message"));
        let mut rebuilt = BytesMut::new();
        write_id(&id, &mut rebuilt);
        if e.message() {
            rebuilt.extend_from_slice(b"event: message\n");
        }
        rebuilt.extend_from_slice(e.body());
        assert_eq!(&rebuilt[..], block, "compact form differs from encode()");
        let counted = block.iter().filter(|&&b| b != b'\n').count();
        biggest = biggest.max(counted);
        expected.push(Event::new(
            Some(&id),
            e.event(),
            e.data().as_deref(),
            e.retry(),
        ));
    }
    let variant = seeds.first().copied().unwrap_or(0) % 3;
    let wire: Vec<u8> = match variant {
        0 => lf.to_vec(),
        1 => lf
            .iter()
            .flat_map(|&b| {
                if b == b'\n' {
                    vec![b'\r', b'\n']
                } else {
                    vec![b]
                }
            })
            .collect(),
        _ => lf
            .iter()
            .map(|&b| if b == b'\n' { b'\r' } else { b })
            .collect(),
    };
    // Every block fits a limit equal to the biggest block: no error, same events, any split.
    let limit = biggest.max(1);
    let pieces = split(&wire, seeds.get(1..).unwrap_or(&[]), 0);
    let (got, err) = decode(limit, &pieces);
    assert_eq!(
        err, None,
        "limit {limit} refused blocks of at most {biggest} bytes"
    );
    assert_eq!(got, expected);
}

/// Checks every property above on one input; panics on a violation. Called by the fuzz
/// target and by the corpus replay in `tests/fast/fuzz_corpora.rs`.
pub fn check(input: &[u8]) {
    let [mode, limit, rest @ ..] = input else {
        return;
    };
    let sep = rest.iter().position(|&b| b == 0xFF).unwrap_or(0).min(32);
    let (seeds, data) = rest.split_at(sep);
    let data = data.strip_prefix(&[0xFF]).unwrap_or(data);
    if mode % 4 == 3 {
        round_trip(seeds, data);
    } else {
        raw_mode(limit_from(*limit), seeds, data);
    }
}
