//! The frame one poll of an attached client writes: the retained events of its stream after
//! its cursor, each under its gateway id, with the stream's oversized event in its place (a
//! piece of it at most [`BATCH_BYTES`] long: the frame ends where the piece does), within the
//! bounds it is given, in one allocation sized up front.
//!
//! Pure: knows the window's entries and the cursor codec; nothing of clients, locks, the
//! in-flight reserve or why the bounds are what they are.

use bytes::{BufMut, BytesMut};

use crate::cursor;
use crate::window::{Entry, Window};

/// Most bytes of retained events one poll of an attached client copies into a single frame.
pub(super) const BATCH_BYTES: usize = 64 * 1024;

/// What [`write_entry`] adds to a body at most: `id: ` + cursor + LF + `event: message` + LF.
const ENTRY_OVERHEAD: usize = 4 + cursor::MAX_CURSOR_LEN + 1 + 15;

/// `id: <epoch hex>.`: how every event id line of a session of `epoch` begins.
pub(super) fn id_prefix(epoch: u64) -> [u8; 21] {
    let mut id_prefix = [0u8; 21];
    id_prefix[..4].copy_from_slice(b"id: ");
    id_prefix[4..20].copy_from_slice(&cursor::epoch_hex(epoch));
    id_prefix[20] = b'.';
    id_prefix
}

/// One batch of events for a client.
#[derive(Debug)]
pub(super) struct Batch {
    /// The frame.
    pub out: BytesMut,
    /// How many whole events it holds.
    pub events: usize,
    /// The position of its last whole event (the cursor it was collected after, when none).
    pub last: u64,
    /// The frame ends part-way through the oversized event at this position: this many bytes
    /// of its wire form have been written to the client, counting earlier frames.
    pub partial: Option<(u64, usize)>,
}

impl Batch {
    /// The events of `stream` in `window` after `cursor`, in order, and `overflow` (the
    /// stream's event too large for the window, if it comes after the cursor, with how many
    /// bytes of its wire form this client already has) in its place: at most `max_events`
    /// events, and none more once `max_bytes` (at most [`BATCH_BYTES`]) are written. The
    /// oversized event goes in pieces: what fits in [`BATCH_BYTES`] after the events before
    /// it, the frame ending with the piece when the rest does not fit. `prefix` is the
    /// session's [`id_prefix`].
    pub(super) fn collect(
        prefix: &[u8; 21],
        window: &Window,
        stream: u32,
        cursor: u64,
        overflow: Option<(&Entry, usize)>,
        (max_events, max_bytes): (usize, usize),
    ) -> Batch {
        let max_bytes = max_bytes.min(BATCH_BYTES);
        let mut overflow = overflow.filter(|(o, _)| o.seq > cursor);
        // Sized once for the batch: growing it by doubling copied every event again.
        let mut size = 0;
        for (n, e) in window.after(stream, cursor).enumerate() {
            if size >= max_bytes || n >= max_events {
                break;
            }
            size += ENTRY_OVERHEAD + e.body.len();
        }
        size += overflow.map_or(0, |(o, from)| {
            (ENTRY_OVERHEAD + o.body.len())
                .saturating_sub(from)
                .min(BATCH_BYTES)
        });
        let mut head = StreamHead::new(prefix, stream);
        let mut b = Batch {
            out: BytesMut::with_capacity(size),
            events: 0,
            last: cursor,
            partial: None,
        };
        let full = |b: &Batch| b.out.len() >= max_bytes || b.events >= max_events;
        for e in window.after(stream, cursor) {
            if full(&b) {
                break;
            }
            if let Some((o, from)) = overflow.filter(|(o, _)| o.seq < e.seq) {
                overflow = None;
                if !b.add_piece(&mut head, o, from) || full(&b) {
                    return b;
                }
            }
            b.add(&mut head, e);
        }
        if let Some((o, from)) = overflow.filter(|(o, _)| o.seq > b.last && !full(&b)) {
            b.add_piece(&mut head, o, from);
        }
        b
    }

    fn add(&mut self, head: &mut StreamHead, e: &Entry) {
        write_entry(head, e, &mut self.out);
        self.events += 1;
        self.last = e.seq;
    }

    /// Writes the next piece of the oversized event `e` (from byte `from` of its wire form),
    /// as much as [`BATCH_BYTES`] leaves room for. Returns whether that was the rest of it.
    fn add_piece(&mut self, stream_head: &mut StreamHead, e: &Entry, from: usize) -> bool {
        let mut head = BytesMut::with_capacity(ENTRY_OVERHEAD);
        write_head(stream_head, e, &mut head);
        let total = head.len() + e.body.len();
        let room = BATCH_BYTES.saturating_sub(self.out.len()).max(1);
        let upto = total.min(from + room);
        if from < head.len() {
            self.out.put_slice(&head[from..upto.min(head.len())]);
        }
        if upto > head.len() {
            self.out
                .put_slice(&e.body[from.saturating_sub(head.len())..upto - head.len()]);
        }
        if upto < total {
            self.partial = Some((e.seq, upto));
            return false;
        }
        self.events += 1;
        self.last = e.seq;
        true
    }
}

/// The `id:` line (and the `event: message` line its flag implies) of each event of one
/// stream, made in one buffer per batch: `id: <epoch hex>.<stream>.` once (not formatted
/// into every event's id), then each event's position, counted on from the one before when
/// it follows it (the usual batch), not divided into digits each time (bench/notes.md,
/// "Figure: a batch's ids").
struct StreamHead {
    /// The prefix, then the last position's digits, its LF and room for `event: message`.
    buf: [u8; StreamHead::MAX],
    /// Where the position's digits start (the prefix's length), and where they end.
    digits: usize,
    end: usize,
    /// The position whose digits are in `buf`.
    seq: Option<u64>,
    stream: u32,
}

const MESSAGE: &[u8] = b"event: message\n";

impl StreamHead {
    /// The session's prefix, the longest stream number and its dot, the longest position,
    /// its LF and the `event: message` line.
    const MAX: usize = 21 + 10 + 1 + 20 + 1 + MESSAGE.len();

    fn new(prefix: &[u8; 21], stream: u32) -> StreamHead {
        let mut buf = [0u8; StreamHead::MAX];
        buf[..21].copy_from_slice(prefix);
        let mut len = 21 + cursor::put_decimal(u64::from(stream), &mut buf[21..]);
        buf[len] = b'.';
        len += 1;
        StreamHead {
            buf,
            digits: len,
            end: len,
            seq: None,
            stream,
        }
    }

    /// The head of `e`: its id line, and its `event: message` line when flagged.
    fn line(&mut self, e: &Entry) -> &[u8] {
        debug_assert_eq!(e.stream, self.stream, "a batch holds one stream's events");
        let next = self.seq.and_then(|s| s.checked_add(1)) == Some(e.seq);
        if !(next && increment(&mut self.buf[self.digits..self.end])) {
            self.end = self.digits + cursor::put_decimal(e.seq, &mut self.buf[self.digits..]);
        }
        self.seq = Some(e.seq);
        let mut n = self.end;
        self.buf[n] = b'\n';
        n += 1;
        if e.message {
            self.buf[n..n + MESSAGE.len()].copy_from_slice(MESSAGE);
            n += MESSAGE.len();
        }
        &self.buf[..n]
    }
}

/// Adds one to the decimal `digits` in place; `false` (and the digits all `0`) when the
/// number needs one digit more.
fn increment(digits: &mut [u8]) -> bool {
    for d in digits.iter_mut().rev() {
        if *d == b'9' {
            *d = b'0';
        } else {
            *d += 1;
            return true;
        }
    }
    false
}

/// Writes a retained event as sent on the wire: its gateway id, then its body.
fn write_entry(head: &mut StreamHead, e: &Entry, out: &mut BytesMut) {
    out.reserve(ENTRY_OVERHEAD + e.body.len());
    write_head(head, e, out);
    out.put_slice(&e.body);
}

/// What goes before a retained event's body on the wire: its `id:` line, and the
/// `event: message` line its flag implies, appended in one piece, not part by part
/// (bench/notes.md, "Figure: a batch's ids").
fn write_head(head: &mut StreamHead, e: &Entry, out: &mut BytesMut) {
    out.put_slice(head.line(e));
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::Just;

    fn entry(stream: u32, seq: u64, body: &str) -> Entry {
        Entry {
            seq,
            stream,
            message: seq.is_multiple_of(2),
            body: format!("data: {body}\n\n").into_bytes().into_boxed_slice(),
        }
    }

    fn window(entries: impl IntoIterator<Item = Entry>) -> Window {
        let mut w = Window::new(100, 1 << 20);
        for e in entries {
            w.push(e, |_| panic!("nothing is evicted")).unwrap();
        }
        w
    }

    const EPOCH: u64 = 0x0123_4567_89ab_cdef;

    fn collect(w: &Window, cursor: u64, overflow: Option<&Entry>, limits: (usize, usize)) -> Batch {
        Batch::collect(
            &id_prefix(EPOCH),
            w,
            1,
            cursor,
            overflow.map(|o| (o, 0)),
            limits,
        )
    }

    fn text(b: &Batch) -> String {
        String::from_utf8(b.out.to_vec()).unwrap()
    }

    #[test]
    fn each_event_goes_under_its_gateway_id() {
        let w = window([entry(1, 2, "a"), entry(0, 3, "x"), entry(1, 5, "b")]);
        let b = collect(&w, 1, None, (10, 1 << 20));
        assert_eq!((b.events, b.last), (2, 5));
        assert_eq!(
            text(&b),
            "id: 0123456789abcdef.1.2\nevent: message\ndata: a\n\n\
             id: 0123456789abcdef.1.5\ndata: b\n\n"
        );
        let after = collect(&w, 5, None, (10, 1 << 20));
        assert_eq!((after.events, after.last, after.out.len()), (0, 5, 0));
    }

    #[test]
    fn the_longest_ids_are_written_whole() {
        let mut w = Window::new(100, 1 << 20);
        for (stream, seq) in [
            (u32::MAX, u64::MAX - 2),
            (u32::MAX, u64::MAX - 1),
            (9, u64::MAX),
        ] {
            w.push(entry(stream, seq, "a"), |_| {}).unwrap();
        }
        let b = Batch::collect(&id_prefix(EPOCH), &w, u32::MAX, 0, None, (10, 1 << 20));
        assert_eq!(b.events, 2);
        assert_eq!(
            text(&b),
            "id: 0123456789abcdef.4294967295.18446744073709551613\ndata: a\n\n\
             id: 0123456789abcdef.4294967295.18446744073709551614\nevent: message\ndata: a\n\n"
        );
    }

    proptest::proptest! {
        /// Every event's id is its position in decimal, whether counted on from the event
        /// before it (a run of consecutive positions, across 9 -> 10 and the like) or
        /// written afresh after a jump.
        #[test]
        fn ids_counted_on_are_the_positions_written_afresh(
            start in proptest::prop_oneof![
                0u64..200,
                Just(9_999_990u64),
                Just(u64::MAX - 500),
            ],
            steps in proptest::collection::vec((proptest::prop_oneof![Just(1u64), Just(1), Just(1), 2u64..15], proptest::bool::ANY), 1..30),
        ) {
            let mut seq = start;
            let mut entries = Vec::new();
            let mut expected = String::new();
            for (step, message) in steps {
                seq += step;
                let mut e = entry(7, seq, "x");
                e.message = message;
                expected.push_str(&format!(
                    "id: {EPOCH:016x}.7.{seq}\n{}data: x\n\n",
                    if message { "event: message\n" } else { "" }
                ));
                entries.push(e);
            }
            let w = window(entries);
            let b = Batch::collect(&id_prefix(EPOCH), &w, 7, start, None, (100, 1 << 20));
            proptest::prop_assert_eq!(text(&b), expected);
        }
    }

    #[test]
    fn the_oversized_event_goes_in_its_place() {
        let w = window([entry(1, 2, "a"), entry(1, 5, "b")]);
        let between = entry(1, 4, "big");
        let b = collect(&w, 1, Some(&between), (10, 1 << 20));
        assert_eq!((b.events, b.last), (3, 5));
        let t = text(&b);
        assert!(t.find("data: a").unwrap() < t.find("data: big").unwrap());
        assert!(t.find("data: big").unwrap() < t.find("data: b\n").unwrap());
        let last = entry(1, 6, "big");
        assert_eq!(collect(&w, 1, Some(&last), (10, 1 << 20)).last, 6);
        let first = entry(1, 1, "big");
        let b = collect(&w, 0, Some(&first), (10, 1 << 20));
        assert!(text(&b).starts_with("id: 0123456789abcdef.1.1\n"));
        let seen = entry(1, 1, "big");
        assert_eq!(
            collect(&w, 1, Some(&seen), (10, 1 << 20)).events,
            2,
            "already sent"
        );
    }

    #[test]
    fn a_batch_stops_at_its_bounds() {
        let w = window((1..11).map(|i| entry(1, 2 * i, "0123456789")));
        let b = collect(&w, 1, None, (3, 1 << 20));
        assert_eq!((b.events, b.last), (3, 6));
        // Bytes: the event that crosses the bound is the last one.
        let one = collect(&w, 1, None, (10, 1)).out.len();
        let b = collect(&w, 1, None, (10, one + 1));
        assert_eq!(b.events, 2);
        // The frame is never larger than BATCH_BYTES and an event.
        let big = window((2..40).map(|seq| entry(1, seq, &"p".repeat(4000))));
        let b = collect(&big, 1, None, (100, usize::MAX));
        assert!(b.out.len() >= BATCH_BYTES && b.out.len() < BATCH_BYTES + 4100);
        // The oversized event counts against the bounds like any other.
        let over = entry(1, 7, "big");
        let b = collect(&w, 1, Some(&over), (5, 1 << 20));
        assert_eq!((b.events, b.last), (5, 8));
        let b = collect(&w, 6, Some(&over), (1, 1 << 20));
        assert_eq!((b.events, b.last), (1, 7));
    }

    #[test]
    fn the_oversized_event_goes_in_pieces_that_make_it_whole() {
        let w = window([entry(1, 2, "a"), entry(1, 9, "b")]);
        let big = entry(1, 5, &"x".repeat(3 * BATCH_BYTES));
        let mut whole = BytesMut::new();
        write_entry(
            &mut StreamHead::new(&id_prefix(EPOCH), big.stream),
            &big,
            &mut whole,
        );
        // The first frame: the event before it, then as much of it as fits.
        let b = collect(&w, 1, Some(&big), (10, 1 << 20));
        assert_eq!((b.events, b.last), (1, 2));
        assert_eq!(b.out.len(), BATCH_BYTES);
        let (seq, mut at) = b.partial.expect("part-way");
        assert_eq!(seq, 5);
        let before = collect(&w, 1, None, (1, 1 << 20)).out.len();
        let mut sent = b.out[before..].to_vec();
        assert_eq!(sent.len(), at);
        // The next frames continue it from where the client is, and the last one goes on
        // with the events after it.
        loop {
            let b = Batch::collect(&id_prefix(EPOCH), &w, 1, 2, Some((&big, at)), (10, 1 << 20));
            assert!(b.out.len() <= BATCH_BYTES);
            match b.partial {
                Some((5, next)) => {
                    assert_eq!(b.events, 0);
                    sent.extend_from_slice(&b.out);
                    assert_eq!(sent.len(), next);
                    at = next;
                }
                None => {
                    assert_eq!((b.events, b.last), (2, 9), "its rest, then b");
                    let rest = whole.len() - at;
                    sent.extend_from_slice(&b.out[..rest]);
                    assert!(String::from_utf8_lossy(&b.out[rest..]).contains("data: b"));
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(sent, whole.to_vec(), "the pieces make the event, once");
    }
}
