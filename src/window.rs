//! The per-session window: the most recent encoded events of a session, bounded by a count
//! and a byte budget, in sequence order.
//!
//! Pure: no clocks, no locks, no I/O. The session layer decides what an eviction means for a
//! stream (see `session`); TTL is the session's, not the window's.

use std::collections::VecDeque;

/// One retained event: its session-wide sequence number, its stream, and its encoded body.
/// The body is what follows the `id:` line on the wire (which is rebuilt from `seq` and
/// `stream` when the event is sent); when `message` is set the `event: message` line is
/// implied too. Kept small: the window holds many (its size: bench/notes.md, "Figure: the
/// window's entries").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    pub stream: u32,
    pub message: bool,
    pub body: Box<[u8]>,
}

impl Entry {
    /// Bytes this entry counts against the window's byte bound.
    pub fn len(&self) -> usize {
        self.body.len()
    }

    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }
}

/// Bounded ring of [`Entry`]s with strictly increasing `seq`.
#[derive(Debug)]
pub struct Window {
    entries: VecDeque<Entry>,
    bytes: usize,
    max_events: usize,
    max_bytes: usize,
}

impl Window {
    pub fn new(max_events: usize, max_bytes: usize) -> Window {
        Window {
            entries: VecDeque::new(),
            bytes: 0,
            max_events: max_events.max(1),
            max_bytes,
        }
    }

    /// Appends `entry`, evicting the oldest entries (each passed to `evicted`) until both
    /// bounds hold. An entry larger than the whole byte budget is not retained: it is handed
    /// back as `Err` and nothing else is evicted for it.
    pub fn push(&mut self, entry: Entry, mut evicted: impl FnMut(Entry)) -> Result<(), Entry> {
        debug_assert!(self.entries.back().is_none_or(|e| e.seq < entry.seq));
        if entry.len() > self.max_bytes {
            return Err(entry);
        }
        // Evict before pushing, so the ring never holds more than `max_events` entries and
        // its allocation never grows past them.
        while !self.entries.is_empty()
            && (self.entries.len() >= self.max_events || self.bytes + entry.len() > self.max_bytes)
        {
            let Some(old) = self.entries.pop_front() else {
                break;
            };
            self.bytes -= old.len();
            evicted(old);
        }
        if self.entries.len() == self.entries.capacity() {
            // Grow by doubling, but never past `max_events` slots.
            let want = (self.entries.capacity() * 2).max(4).min(self.max_events);
            self.entries.reserve_exact(want - self.entries.len());
        }
        self.bytes += entry.len();
        self.entries.push_back(entry);
        Ok(())
    }

    /// Whether an entry of `len` bytes can be retained at all (fits the byte bound alone).
    pub fn retains(&self, len: usize) -> bool {
        len <= self.max_bytes
    }

    /// Whether an entry of `len` bytes can be pushed now without evicting anything.
    pub fn fits(&self, len: usize) -> bool {
        self.entries.len() < self.max_events && self.bytes + len <= self.max_bytes
    }

    /// The oldest entry: the next to be evicted.
    pub fn front(&self) -> Option<&Entry> {
        self.entries.front()
    }

    /// Retained entries of `stream` with `seq` strictly greater than `after`, oldest first.
    pub fn after(&self, stream: u32, after: u64) -> impl Iterator<Item = &Entry> {
        let start = self.entries.partition_point(|e| e.seq <= after);
        self.entries
            .range(start..)
            .filter(move |e| e.stream == stream)
    }

    /// Removes and returns the oldest entry.
    pub fn evict_oldest(&mut self) -> Option<Entry> {
        let e = self.entries.pop_front()?;
        self.bytes -= e.len();
        Some(e)
    }

    /// Removes and returns the oldest entry from position `from` on that `evictable` accepts,
    /// with its position (the entries before it stay, in order). A caller that knows the
    /// first `from` entries must stay (none accepted by an earlier call with the same verdicts)
    /// passes that: they are not looked at again. `upto`, asked only when the entry at `from`
    /// must stay: no entry after that position is evictable (entries after it are not
    /// looked at).
    pub fn evict_first(
        &mut self,
        from: usize,
        upto: impl FnOnce() -> u64,
        mut evictable: impl FnMut(&Entry) -> bool,
    ) -> Option<(usize, Entry)> {
        // Mostly the first one looked at: that one without the iterator's machinery (its
        // adapters cost every eviction: bench/notes.md, "Figure: the window's entries").
        let first = self.entries.get(from)?;
        let (i, e) = if evictable(first) {
            // The oldest, the usual one: `remove(0)` still called the general shift.
            let e = if from == 0 {
                self.entries.pop_front()
            } else {
                self.entries.remove(from)
            };
            (from, e)
        } else {
            // A full window of one stream behind its client: none is, and the scan that
            // found none went over the whole window each time the reader met a full window
            // (~4 verdicts an event, `bench/callgrind` sse-200-burst).
            let upto = upto();
            let end = self.entries.partition_point(|e| e.seq <= upto);
            let i = from
                + 1
                + self
                    .entries
                    .range(from + 1..end.max(from + 1))
                    .position(&mut evictable)?;
            (i, self.entries.remove(i))
        };
        let e = e?;
        self.bytes -= e.len();
        Some((i, e))
    }

    /// Removes every entry of `stream`, whose positions all lie in `seqs` (its state is being
    /// forgotten). Only that range is looked at: the stream forgotten is an old one, and the
    /// whole window behind it would be scanned for nothing (a `retain` over the window was a
    /// visible part of every call: bench/notes.md, "Figure: the window's entries").
    pub fn remove_stream(&mut self, stream: u32, seqs: std::ops::RangeInclusive<u64>) {
        let lo = self.entries.partition_point(|e| e.seq < *seqs.start());
        let hi = self.entries.partition_point(|e| e.seq <= *seqs.end());
        // Stable compaction of [lo, hi): the entries kept move forward in order, the removed
        // ones end up in [keep, hi).
        let mut keep = lo;
        for i in lo..hi {
            if self.entries[i].stream == stream {
                self.bytes -= self.entries[i].len();
            } else {
                self.entries.swap(keep, i);
                keep += 1;
            }
        }
        self.entries.drain(keep..hi);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes retained (the sum of entry bodies).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Every retained entry, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(seq: u64, stream: u32, len: usize) -> Entry {
        Entry {
            seq,
            stream,
            message: true,
            body: vec![b'x'; len].into_boxed_slice(),
        }
    }

    #[test]
    fn evicts_by_count_then_bytes() {
        let mut w = Window::new(3, 100);
        let mut gone = Vec::new();
        for s in 1..=5 {
            w.push(entry(s, 0, 10), |e| gone.push(e.seq)).unwrap();
        }
        assert_eq!(gone, vec![1, 2]);
        assert_eq!(w.len(), 3);
        w.push(entry(6, 0, 90), |e| gone.push(e.seq)).unwrap();
        assert_eq!(gone, vec![1, 2, 3, 4]);
        assert_eq!(w.bytes(), 100);
    }

    #[test]
    fn oversized_entry_is_handed_back_and_evicts_nothing() {
        let mut w = Window::new(10, 100);
        w.push(entry(1, 0, 50), |_| panic!("no eviction")).unwrap();
        let back = w
            .push(entry(2, 0, 101), |_| panic!("no eviction"))
            .unwrap_err();
        assert_eq!(back.seq, 2);
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn evict_first_skips_what_must_stay() {
        let mut w = Window::new(10, 1000);
        for (seq, stream) in [(1, 0), (2, 1), (3, 0), (4, 1)] {
            w.push(entry(seq, stream, 5), |_| {}).unwrap();
        }
        let seq = |r: Option<(usize, Entry)>| r.map(|(i, e)| (i, e.seq));
        assert_eq!(
            seq(w.evict_first(0, || u64::MAX, |e| e.stream == 1)),
            Some((1, 2))
        );
        assert_eq!(seq(w.evict_first(0, || u64::MAX, |e| e.stream == 2)), None);
        let left: Vec<u64> = w.entries.iter().map(|e| e.seq).collect();
        assert_eq!(left, vec![1, 3, 4]);
        assert_eq!(w.bytes(), 15);
        assert_eq!(w.after(1, 0).map(|e| e.seq).collect::<Vec<_>>(), vec![4]);
        // From a position on: the entries before it are not looked at.
        let mut looked = Vec::new();
        let all = |e: &Entry| {
            looked.push(e.seq);
            true
        };
        assert_eq!(seq(w.evict_first(1, || u64::MAX, all)), Some((1, 3)));
        assert_eq!(looked, vec![3]);
        assert_eq!(seq(w.evict_first(5, || u64::MAX, |_| true)), None);
        assert_eq!(w.bytes(), 10);
        // Past `upto` nothing is looked at (4 would be taken, but lies past it); it is asked
        // only when the first entry must stay.
        let mut looked = Vec::new();
        let four = |e: &Entry| {
            looked.push(e.seq);
            e.seq == 4
        };
        assert_eq!(seq(w.evict_first(0, || 1, four)), None);
        assert_eq!(looked, vec![1]);
        assert_eq!(seq(w.evict_first(0, || 4, |e| e.seq == 4)), Some((1, 4)));
        let asked = std::cell::Cell::new(false);
        let upto = || {
            asked.set(true);
            0
        };
        assert_eq!(seq(w.evict_first(0, upto, |_| true)), Some((0, 1)));
        assert!(!asked.get());
    }

    #[test]
    fn after_is_strict_and_per_stream() {
        let mut w = Window::new(10, 1000);
        for (seq, stream) in [(1, 0), (2, 1), (3, 0), (4, 1), (5, 0)] {
            w.push(entry(seq, stream, 1), |_| {}).unwrap();
        }
        let seqs = |s, a| w.after(s, a).map(|e| e.seq).collect::<Vec<_>>();
        assert_eq!(seqs(0, 1), vec![3, 5]);
        assert_eq!(seqs(0, 0), vec![1, 3, 5]);
        assert_eq!(seqs(1, 2), vec![4]);
        assert_eq!(seqs(1, 4), Vec::<u64>::new());
        w.remove_stream(0, 1..=5);
        assert_eq!(w.len(), 2);
        assert_eq!(w.bytes(), 2);
    }

    proptest! {
        /// Removing a stream over the range of its positions leaves exactly what removing it
        /// from the whole window would, in order, with the bytes counted.
        #[test]
        fn remove_stream_over_its_range_is_a_whole_removal(
            streams in proptest::collection::vec((0u32..4, 1usize..9), 1..80),
            gone in 0u32..4,
            evicted in 0usize..20,
        ) {
            let mut w = Window::new(1000, 1 << 20);
            for (i, &(stream, len)) in streams.iter().enumerate() {
                w.push(entry(i as u64 + 1, stream, len), |_| {}).unwrap();
            }
            for _ in 0..evicted.min(streams.len()) {
                w.evict_oldest();
            }
            let seqs: Vec<u64> = (1..=streams.len() as u64).filter(|&q| streams[q as usize - 1].0 == gone).collect();
            // A stream with no event: its opening position alone (nothing to remove).
            let range = match (seqs.first(), seqs.last()) {
                (Some(&a), Some(&b)) => a..=b,
                _ => 0..=0,
            };
            let mut want: Vec<Entry> = w.entries.iter().filter(|e| e.stream != gone).cloned().collect();
            let want_bytes: usize = want.iter().map(Entry::len).sum();
            w.remove_stream(gone, range);
            let got: Vec<Entry> = w.entries.iter().cloned().collect();
            prop_assert_eq!(got, std::mem::take(&mut want));
            prop_assert_eq!(w.bytes(), want_bytes);
        }
    }

    proptest! {
        /// Against a model: the window always holds the longest suffix of the retainable
        /// entries that fits both bounds, and every entry is either retained, evicted once,
        /// or handed back.
        #[test]
        fn matches_model(
            max_events in 1usize..8,
            max_bytes in 1usize..64,
            ops in proptest::collection::vec((0u32..3, 0usize..40), 0..60),
        ) {
            let mut w = Window::new(max_events, max_bytes);
            let mut all = Vec::new();
            let mut evicted = Vec::new();
            let mut handed_back = Vec::new();
            for (i, (stream, len)) in ops.into_iter().enumerate() {
                let e = entry(i as u64 + 1, stream, len);
                all.push(e.clone());
                if let Err(e) = w.push(e, |old| evicted.push(old.seq)) {
                    handed_back.push(e.seq);
                }
                // Model: longest suffix of retainable entries within bounds.
                let retainable: Vec<&Entry> = all.iter().filter(|e| e.len() <= max_bytes).collect();
                let mut keep = Vec::new();
                let mut bytes = 0;
                for e in retainable.iter().rev() {
                    if keep.len() + 1 > max_events || bytes + e.len() > max_bytes { break; }
                    bytes += e.len();
                    keep.push(e.seq);
                }
                keep.reverse();
                let got: Vec<u64> = w.entries.iter().map(|e| e.seq).collect();
                prop_assert!(w.entries.capacity() <= max_events.max(4));
                prop_assert_eq!(&got, &keep);
                prop_assert_eq!(w.bytes(), bytes);
                let mut accounted: Vec<u64> = got.iter().chain(&evicted).chain(&handed_back).copied().collect();
                accounted.sort_unstable();
                let expect: Vec<u64> = all.iter().map(|e| e.seq).collect();
                prop_assert_eq!(accounted, expect);
                for s in 0..3 {
                    for a in 0..=all.len() as u64 {
                        let want: Vec<u64> = keep.iter().copied().filter(|&q| q > a && all[q as usize - 1].stream == s).collect();
                        let got: Vec<u64> = w.after(s, a).map(|e| e.seq).collect();
                        prop_assert_eq!(got, want);
                    }
                }
            }
        }
    }
}
