//! Tagging upstream events: each decoded event of a stream gets the session's next position
//! and is retained (in the window, or in its stream's one-slot overflow when too large for
//! it), making room by evicting only events no client may still need; when there is none to
//! evict, the upstream reader is paused instead (flow control).

use std::collections::VecDeque;
use std::task::Waker;

use tokio::time::Instant;

use super::state::{Books, State};
use super::stream::{Stream, Streams};
use crate::jsonrpc;
use crate::metrics::Metrics;
use crate::sse::Event;
use crate::window::Entry;

/// What one [`State::tag_events`] call learns of the window while it makes room, valid for
/// the whole call (the lock is held and one `now` used, so no stream's verdict changes, until
/// batches are aged): how many entries at the front were found needed (not looked at again),
/// and the last stream looked up with the position after which its events must stay (the
/// entries scanned are mostly of one stream). Without it every eviction looked its stream up
/// in the map again and scanned past another stream's needed events again (bench/notes.md,
/// "Figure: eviction scans").
#[derive(Default)]
struct Scan {
    kept: usize,
    last: Option<(u32, Option<u64>)>,
}

/// Records the eviction of `old` against its stream: a resume before it is now a gap.
pub(super) fn note_eviction(metrics: &Metrics, streams: &mut Streams, old: &Entry) {
    metrics.window_evictions.inc();
    if let Some(o) = streams.get_mut(&old.stream) {
        if old.seq > o.sent {
            metrics.events_evicted_undelivered.inc();
        }
        o.lost_upto = o.lost_upto.max(old.seq);
    }
}

impl State {
    /// Makes room in the window for an event of `len` bytes by evicting the oldest events
    /// that no client still needs (skipping over those that some client does). `false` when
    /// every retained event is still needed: the caller must wait (flow control) instead.
    /// `scan` carries what earlier calls of the same [`State::tag_events`] learned.
    fn make_room(&mut self, metrics: &Metrics, len: usize, now: Instant, scan: &mut Scan) -> bool {
        let stall = self.consts.stall;
        let mut aged = false;
        while !self.window.fits(len) {
            let streams = &self.streams;
            let last = &mut scan.last;
            let evictable = |e: &Entry| {
                let needed_after = match *last {
                    Some((id, n)) if id == e.stream => n,
                    _ => {
                        let n = streams
                            .get(&e.stream)
                            .and_then(|s| s.needed_after(now, stall));
                        *last = Some((e.stream, n));
                        n
                    }
                };
                needed_after.is_none_or(|acked| e.seq <= acked)
            };
            // Past the highest position any stream lets go, nothing is evictable: its
            // `acked` when it guards its events, else its last (a stream's entries are no
            // later than that; every entry's stream is in `streams`, which a stream leaves
            // with its entries).
            let upto = || {
                streams
                    .values()
                    .map(|s| {
                        s.needed_after(now, stall)
                            .unwrap_or(s.last_seq)
                            .min(s.last_seq)
                    })
                    .max()
                    .unwrap_or(u64::MAX)
            };
            match self.window.evict_first(scan.kept, upto, evictable) {
                Some((at, old)) => {
                    scan.kept = at;
                    note_eviction(metrics, &mut self.streams, &old);
                }
                // Batches written long enough ago to a live client count as delivered.
                None if !aged => {
                    self.inflight.age(now, &mut self.streams);
                    aged = true;
                    *scan = Scan::default();
                }
                None => return false,
            }
        }
        true
    }

    /// Tags and retains decoded upstream events of `stream` (draining them from `events`),
    /// then wakes its client. Flow control: stops at the first event for which the window
    /// has no room without evicting an event some client may still need, leaves it and the
    /// rest in `events`, registers `reader` to be woken when room may have been made, and
    /// returns `false`; the caller then stops reading the upstream until woken. `answers`:
    /// the ids of the responses each event is (`answers[i]`: those of `events[i]`) when read
    /// already, so tagging does not parse the events again for them.
    pub(super) fn push(
        &mut self,
        books: Books<'_>,
        stream: u32,
        events: &mut VecDeque<Event>,
        reader: Option<&Waker>,
        answers: Option<&[Vec<String>]>,
        now: Instant,
    ) -> bool {
        if self.closed || !self.streams.contains_key(&stream) {
            events.clear();
            return true;
        }
        let bytes_before = self.window.bytes();
        let (pushed, learned_version) = self.tag_events(books, stream, events, answers, now);
        events.drain(..pushed);
        books.metrics.events_tagged.inc_by(pushed as u64);
        books.budget.adjust(bytes_before, self.window.bytes());
        if let Some(v) = learned_version {
            self.protocol_version = Some(v);
        }
        let Some(s) = self.streams.get_mut(&stream) else {
            return true;
        };
        let done = wake_or_pause(s, pushed > 0, events.is_empty(), reader, now);
        if !done && reader.is_some() {
            self.stir();
            if !self.paused.contains(&stream) {
                self.paused.push(stream);
            }
        }
        done
    }

    /// Tags `events` of `stream` in order and retains each (in the window, or in the
    /// stream's overflow slot when too large for it) until one finds no room. Returns how
    /// many were taken, and the protocol version an `initialize` answer among them told.
    /// `answers`: the response ids of each event, if already read.
    fn tag_events(
        &mut self,
        books: Books<'_>,
        stream: u32,
        events: &mut VecDeque<Event>,
        answers: Option<&[Vec<String>]>,
        now: Instant,
    ) -> (usize, Option<String>) {
        let mut learned_version = None;
        let mut scan = Scan::default();
        for (pushed, ev) in events.iter_mut().enumerate() {
            // The event came in its wire form: room first, then it moves into the window.
            let len = ev.body().len();
            let retained = self.window.retains(len);
            let room = if retained {
                self.make_room(books.metrics, len, now, &mut scan)
            } else {
                // Too large for the window: it waits in the stream's one-slot overflow for
                // the attached client, which must first be free, and the memory budget must
                // have room for it (else the reader waits: the sweep wakes it).
                let stall = self.consts.stall;
                let Some(s) = self.streams.get_mut(&stream) else {
                    return (pushed, learned_version);
                };
                free_overflow(books, s, now, stall) && books.budget.admits_oversized(len)
            };
            if !room {
                return (pushed, learned_version);
            }
            self.last_seq += 1;
            let seq = self.last_seq;
            let Some(s) = self.streams.get_mut(&stream) else {
                return (pushed, learned_version);
            };
            s.tagged(seq);
            let known = answers.and_then(|a| a.get(pushed)).map(Vec::as_slice);
            learned_version = note_answers(s, ev, known, seq).or(learned_version);
            let entry = Entry {
                seq,
                stream,
                message: ev.message(),
                body: ev.take_body().into_boxed_slice(),
            };
            if retained {
                let (streams, metrics) = (&mut self.streams, books.metrics);
                let _ = self
                    .window
                    .push(entry, |old| note_eviction(metrics, streams, &old));
            } else {
                s.set_overflow(Some(entry), books.budget);
                self.stir();
            }
        }
        (events.len(), learned_version)
    }
}

/// Empties `s`'s overflow slot for a new oversized event, unless the event in it may still be
/// needed by the stream's client (`false`: the new one waits). An event dropped from it is
/// lost: a resume before it is a gap.
fn free_overflow(
    books: Books<'_>,
    s: &mut Stream,
    now: Instant,
    stall: std::time::Duration,
) -> bool {
    match &s.overflow {
        Some(prev) if s.needs(prev.seq, now, stall) => false,
        Some(_) => {
            drop_overflow(books, s);
            true
        }
        None => true,
    }
}

/// Drops the event in `s`'s overflow slot, which no client still needs: it is lost (a resume
/// before it is a gap), and counted if it was never written whole to a client.
pub(super) fn drop_overflow(books: Books<'_>, s: &mut Stream) {
    let Some(prev) = s.overflow.as_ref() else {
        return;
    };
    if prev.seq > s.sent {
        books.metrics.events_evicted_undelivered.inc();
    }
    s.lost_upto = s.lost_upto.max(prev.seq);
    s.set_overflow(None, books.budget);
}

/// Marks the requests of `s` that the event `ev`, tagged `seq`, answers (`known`: the ids of
/// the responses it is, if already read; else they are read from its data). Returns the
/// protocol version it tells, if it answers the stream's `initialize`.
fn note_answers(s: &mut Stream, ev: &Event, known: Option<&[String]>, seq: u64) -> Option<String> {
    if !s.requests.iter().any(|r| r.answered_at.is_none()) {
        return None;
    }
    let mut answered = |rid: &str| {
        if let Some(r) = s
            .requests
            .iter_mut()
            .find(|r| r.id == rid && r.answered_at.is_none())
        {
            r.answered_at = Some(seq);
        }
    };
    if let Some(ids) = known.filter(|_| !s.initialize) {
        ids.iter().for_each(|rid| answered(rid));
        return None;
    }
    // Only now the data: joining a multi-line event's lines is for a stream that waits.
    let data = ev.data_bytes()?;
    let data = &*data;
    for rid in jsonrpc::response_ids(data) {
        answered(&rid);
    }
    if s.initialize {
        jsonrpc::initialize_version(data)
    } else {
        None
    }
}

/// After events of `s` were tagged (`pushed`): its stall clock runs and its client is woken.
/// When some are left (not `done`), registers `reader` to be woken when room may have been
/// made, and returns `false`.
fn wake_or_pause(
    s: &mut Stream,
    pushed: bool,
    done: bool,
    reader: Option<&Waker>,
    now: Instant,
) -> bool {
    if pushed {
        s.stall_since.get_or_insert(now);
        if let Some(w) = s.sub.as_mut().and_then(|sub| sub.waker.take()) {
            w.wake();
        }
    }
    if done {
        return true;
    }
    if let Some(w) = reader {
        s.paused_reader = Some(w.clone());
    }
    false
}
