//! The in-flight reserve of a session: the batches most recently written to its clients (any
//! stream), oldest first, whose events count as delivered only once later writes push them
//! out of the reserve's bounds, or once they are [`INFLIGHT_AGE`] old with their client still
//! reading.
//!
//! Pure bookkeeping under the session's lock: no locks, no I/O, no clock of its own (the
//! caller says when). Of streams it knows only what [`Delivery`] answers; nothing of the
//! window, of clients or of the wire.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// How long a written batch stays in the in-flight reserve while its client stays attached,
/// when no later sends push it out: on a live connection, bytes written this long ago have
/// reached the client. (A connection that dies silently stops taking writes; its client is
/// then detached as stalled.)
pub(super) const INFLIGHT_AGE: Duration = Duration::from_secs(1);

/// What the reserve asks of the streams its batches were written to.
pub(super) trait Delivery {
    /// Whether the client of `stream` is still attached and reading at `now`: taking writes
    /// (one within the last [`INFLIGHT_AGE`]) or caught up. A client whose connection stopped
    /// taking writes holds its batches: bytes stuck on a path that is being cut were lost
    /// when the age alone released them (tests/slow/flow_control.rs saw it under a loaded CI).
    fn reading(&self, stream: u32, now: Instant) -> bool;
    /// Every event of `stream` up to `last` counts as delivered from now on; returns whether
    /// the stream's delivered mark moved.
    fn delivered(&mut self, stream: u32, last: u64) -> bool;
}

/// One batch handed to a client, kept in the reserve until later sends push it out, or until
/// it is [`INFLIGHT_AGE`] old with its client still attached.
#[derive(Debug)]
struct Sent {
    stream: u32,
    last: u64,
    events: usize,
    bytes: usize,
    at: Instant,
}

/// Written bytes may still sit in kernel buffers, in a hop in between or in the client's
/// receive buffer when a connection dies, so the batches written last stay protected until
/// later sends push them out (see [`Reserve::new`] for the bounds).
#[derive(Debug)]
pub(super) struct Reserve {
    batches: VecDeque<Sent>,
    events: usize,
    bytes: usize,
    max_events: usize,
    max_bytes: usize,
}

impl Reserve {
    /// The reserve of a window of `window_events` events and `window_bytes` bytes. Its bounds:
    /// three quarters of the window, and always at least one event short of it. Written
    /// events stay protected until this much was written after them; the rest of the window
    /// is the read-ahead of events not yet written, so the upstream can always move while a
    /// client reads.
    pub(super) fn new(window_events: usize, window_bytes: usize) -> Reserve {
        let (n, b) = (window_events, window_bytes);
        Reserve {
            batches: VecDeque::new(),
            events: 0,
            bytes: 0,
            max_events: (n - n / 4).min(n.saturating_sub(1)).max(1),
            max_bytes: (b - b / 4).max(1),
        }
    }

    /// The bounds (events, bytes): one batch is never larger, so everything written stays
    /// protected until it is delivered.
    pub(super) fn limits(&self) -> (usize, usize) {
        (self.max_events, self.max_bytes)
    }

    /// Puts a batch of `events` events and `bytes` bytes, up to `last` of `stream`, just
    /// written at `at`, into the reserve, and pushes the oldest batches out of it past its
    /// bounds: their events count as delivered from now on. Returns whether any stream's
    /// delivered mark moved (room may have been made).
    pub(super) fn record(
        &mut self,
        stream: u32,
        last: u64,
        events: usize,
        bytes: usize,
        at: Instant,
        streams: &mut impl Delivery,
    ) -> bool {
        self.batches.push_back(Sent {
            stream,
            last,
            events,
            bytes,
            at,
        });
        self.events += events;
        self.bytes += bytes;
        let mut moved = false;
        while self.events > self.max_events || self.bytes > self.max_bytes {
            match self.release_oldest(streams) {
                Some(m) => moved |= m,
                None => break,
            }
        }
        moved
    }

    /// Takes the oldest batch out of the reserve: its events count as delivered. `None` when
    /// the reserve is empty, else whether a stream's delivered mark moved.
    fn release_oldest(&mut self, streams: &mut impl Delivery) -> Option<bool> {
        let b = self.batches.pop_front()?;
        self.events -= b.events;
        self.bytes -= b.bytes;
        Some(streams.delivered(b.stream, b.last))
    }

    /// Releases the batches at least [`INFLIGHT_AGE`] old at `now` whose client is still
    /// reading (oldest first, stopping at the first that is not): they were delivered.
    /// Returns whether any stream's delivered mark moved.
    pub(super) fn age(&mut self, now: Instant, streams: &mut impl Delivery) -> bool {
        let mut moved = false;
        while let Some(b) = self.batches.front() {
            if now.duration_since(b.at) < INFLIGHT_AGE || !streams.reading(b.stream, now) {
                break;
            }
            moved |= self.release_oldest(streams).unwrap_or(false);
        }
        moved
    }

    /// Drops the batches of `stream` without delivering them: its client said where it is (a
    /// resume), so nothing of the stream is in flight any more.
    pub(super) fn forget(&mut self, stream: u32) {
        let before = self.batches.len();
        self.batches.retain(|b| b.stream != stream);
        if self.batches.len() != before {
            self.events = self.batches.iter().map(|b| b.events).sum();
            self.bytes = self.batches.iter().map(|b| b.bytes).sum();
        }
    }

    /// Drops every batch (the session closed).
    pub(super) fn clear(&mut self) {
        self.batches.clear();
        self.events = 0;
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn every_window_the_flags_allow_keeps_room_to_read_ahead() {
        // `--window-events` is at least 2: the reserve then always leaves the window at
        // least one event to read ahead into, so the upstream can move while a client reads.
        for n in 2..2000 {
            let (events, _) = Reserve::new(n, 1 << 20).limits();
            assert!(events >= 1 && events < n, "window {n}: reserve {events}");
        }
        // A window of one (refused by the flags) has none: the reserve is the window.
        assert_eq!(Reserve::new(1, 1 << 20).limits().0, 1);
    }

    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    /// Streams as the reserve sees them: a delivered mark each, and which are reading.
    #[derive(Default)]
    struct Fake {
        acked: BTreeMap<u32, u64>,
        reading: BTreeSet<u32>,
    }

    impl Delivery for Fake {
        fn reading(&self, stream: u32, _now: Instant) -> bool {
            self.reading.contains(&stream)
        }
        fn delivered(&mut self, stream: u32, last: u64) -> bool {
            self.acked.get_mut(&stream).is_some_and(|a| {
                let moved = last > *a;
                *a = (*a).max(last);
                moved
            })
        }
    }

    fn streams(n: u32) -> Fake {
        Fake {
            acked: (0..n).map(|s| (s, 0)).collect(),
            reading: (0..n).collect(),
        }
    }

    #[test]
    fn bounds_are_three_quarters_of_the_window_and_one_event_short_of_it() {
        assert_eq!(Reserve::new(8, 4096).limits(), (6, 3072));
        assert_eq!(Reserve::new(4, 100).limits(), (3, 75));
        assert_eq!(Reserve::new(2, 1).limits(), (1, 1));
        assert_eq!(Reserve::new(1, 0).limits(), (1, 1));
        assert_eq!(Reserve::new(1000, 1 << 20).limits(), (750, 786_432));
    }

    #[tokio::test(start_paused = true)]
    async fn later_writes_push_the_oldest_batches_out_as_delivered() {
        let mut s = streams(2);
        let mut r = Reserve::new(8, 1 << 20); // 6 events
        let now = Instant::now();
        assert!(!r.record(0, 3, 3, 30, now, &mut s), "within the bounds");
        assert!(!r.record(1, 5, 3, 30, now, &mut s));
        assert_eq!(s.acked, BTreeMap::from([(0, 0), (1, 0)]));
        // One more event: the oldest batch (stream 0, up to 3) is out, delivered.
        assert!(r.record(1, 6, 1, 10, now, &mut s));
        assert_eq!(s.acked, BTreeMap::from([(0, 3), (1, 0)]));
        // A batch over the bounds by itself pushes everything out, itself last.
        assert!(r.record(0, 9, 7, 70, now, &mut s));
        assert_eq!(s.acked, BTreeMap::from([(0, 9), (1, 6)]));
        assert!(!r.record(0, 10, 1, 10, now, &mut s), "empty again");
    }

    #[tokio::test(start_paused = true)]
    async fn the_byte_bound_counts_too_and_a_release_that_moves_nothing_says_so() {
        let mut s = streams(1);
        let mut r = Reserve::new(1000, 100); // 75 bytes
        let now = Instant::now();
        assert!(!r.record(0, 4, 1, 50, now, &mut s));
        assert!(
            r.record(0, 5, 1, 50, now, &mut s),
            "100 bytes: the first is out"
        );
        assert_eq!(s.acked[&0], 4);
        assert!(r.record(7, 1, 1, 50, now, &mut s));
        assert_eq!(s.acked[&0], 5);
        // Releasing a batch of a stream that is gone, or one already delivered, moves no mark.
        assert!(!r.record(0, 2, 1, 50, now, &mut s), "stream 7 is gone");
        assert!(
            !r.record(0, 3, 1, 50, now, &mut s),
            "0 is delivered up to 5"
        );
        assert_eq!(s.acked[&0], 5);
    }

    #[tokio::test(start_paused = true)]
    async fn aged_batches_of_reading_clients_are_released_oldest_first() {
        let mut s = streams(3);
        let mut r = Reserve::new(1000, 1 << 20);
        let t0 = Instant::now();
        r.record(0, 2, 1, 10, t0, &mut s);
        r.record(1, 3, 1, 10, t0, &mut s);
        r.record(2, 4, 1, 10, t0 + INFLIGHT_AGE, &mut s);
        assert!(!r.age(t0 + INFLIGHT_AGE / 2, &mut s), "too young");
        // Stream 1's client left: its batch, and every later one, stays.
        s.reading.remove(&1);
        assert!(r.age(t0 + INFLIGHT_AGE * 2, &mut s));
        assert_eq!(s.acked, BTreeMap::from([(0, 2), (1, 0), (2, 0)]));
        s.reading.insert(1);
        assert!(r.age(t0 + INFLIGHT_AGE * 2, &mut s));
        assert_eq!(s.acked, BTreeMap::from([(0, 2), (1, 3), (2, 4)]));
        assert!(!r.age(t0 + INFLIGHT_AGE * 9, &mut s), "nothing left");
    }

    #[tokio::test(start_paused = true)]
    async fn a_forgotten_stream_leaves_the_reserve_and_its_counts() {
        let mut s = streams(2);
        let mut r = Reserve::new(8, 1 << 20); // 6 events
        let now = Instant::now();
        r.record(0, 5, 5, 50, now, &mut s);
        r.record(1, 1, 1, 10, now, &mut s);
        r.forget(0);
        // Stream 0's 5 events no longer count: 5 more fit before stream 1's batch is out.
        assert!(!r.record(1, 6, 5, 50, now, &mut s));
        assert!(r.record(1, 7, 1, 10, now, &mut s));
        assert_eq!(s.acked, BTreeMap::from([(0, 0), (1, 1)]));
        r.forget(9);
        r.clear();
        assert!(!r.record(1, 8, 6, 60, now, &mut s), "cleared");
    }
}
