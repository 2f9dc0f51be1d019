//! The frame one poll of an attached client writes: the retained events of its stream after
//! its cursor, each under its gateway id, with the stream's oversized event in its place,
//! within the bounds it is given, in one allocation sized up front.
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
    /// How many events it holds.
    pub events: usize,
    /// The position of its last event (the cursor it was collected after, when empty).
    pub last: u64,
}

impl Batch {
    /// The events of `stream` in `window` after `cursor`, in order, and `overflow` (the
    /// stream's event too large for the window, if it comes after the cursor) in its place:
    /// at most `max_events` events, and none more once `max_bytes` (at most [`BATCH_BYTES`])
    /// are written. `prefix` is the session's [`id_prefix`].
    pub fn collect(
        prefix: &[u8; 21],
        window: &Window,
        stream: u32,
        cursor: u64,
        overflow: Option<&Entry>,
        (max_events, max_bytes): (usize, usize),
    ) -> Batch {
        let max_bytes = max_bytes.min(BATCH_BYTES);
        let mut overflow = overflow.filter(|o| o.seq > cursor);
        // Sized once for the batch: growing it by doubling copied every event again.
        let mut size = 0;
        for (n, e) in window.after(stream, cursor).enumerate() {
            if size >= max_bytes || n >= max_events {
                break;
            }
            size += ENTRY_OVERHEAD + e.body.len();
        }
        size += overflow.map_or(0, |o| ENTRY_OVERHEAD + o.body.len());
        let mut b = Batch {
            out: BytesMut::with_capacity(size),
            events: 0,
            last: cursor,
        };
        let full = |b: &Batch| b.out.len() >= max_bytes || b.events >= max_events;
        for e in window.after(stream, cursor) {
            if full(&b) {
                break;
            }
            if let Some(o) = overflow.filter(|o| o.seq < e.seq) {
                b.add(prefix, o);
                overflow = None;
                if full(&b) {
                    break;
                }
            }
            b.add(prefix, e);
        }
        if let Some(o) = overflow.filter(|o| o.seq > b.last && !full(&b)) {
            b.add(prefix, o);
        }
        b
    }

    fn add(&mut self, prefix: &[u8; 21], e: &Entry) {
        write_entry(prefix, e, &mut self.out);
        self.events += 1;
        self.last = e.seq;
    }
}

/// Writes a retained event as sent on the wire: its gateway id, then its body.
fn write_entry(prefix: &[u8; 21], e: &Entry, out: &mut BytesMut) {
    out.reserve(ENTRY_OVERHEAD + e.body.len());
    out.put_slice(prefix);
    cursor::write_position(e.stream, e.seq, out);
    out.put_u8(b'\n');
    if e.message {
        out.put_slice(b"event: message\n");
    }
    out.put_slice(&e.body);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(stream: u32, seq: u64, body: &str) -> Entry {
        Entry {
            seq,
            stream,
            message: seq % 2 == 0,
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
        Batch::collect(&id_prefix(EPOCH), w, 1, cursor, overflow, limits)
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
}
