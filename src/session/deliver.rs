//! Delivering to an attached client: each poll of its body takes the next batch of its
//! stream after its cursor (or finds nothing and waits, or ends the body with the reason),
//! hands an oversized event over piece by piece, records what was written in the in-flight
//! reserve; and a client's detach.

use std::task::Waker;

use bytes::Bytes;
use tokio::time::Instant;

use super::batch::Batch;
use super::reserve::{self, Delivery};
use super::state::{Consts, State};
use super::stream::{End, Stream, StreamKind, Streams};
use super::{control, Budget, Outcome};
use crate::cursor::Cursor;
use crate::metrics::Metrics;

/// One step of an attached client's body.
#[derive(Debug)]
pub enum Step {
    /// Bytes to send (holding this many events); more may follow.
    Data(Bytes, u64),
    /// Final bytes (possibly empty); the stream ends after them, for this reason.
    Finish(Bytes, Outcome),
    /// Nothing to send yet; the waker is registered.
    Pending,
}

/// The client of `s` was handed a frame: every event of it up to `last` (`whole` of them),
/// and `partial`, the piece of the oversized event it ends with, if it does.
fn handed(s: &mut Stream, last: u64, whole: bool, partial: Option<(u64, usize)>, now: Instant) {
    if let Some(sub) = s.sub.as_mut() {
        if whole {
            sub.cursor = last;
            sub.has_id = true;
        }
        sub.partial = partial;
    }
    s.sent = s.sent.max(last);
    // Progress: the stall clock restarts. It stops only when the body is polled again and
    // finds nothing to send (`idle_step`): until then the frame may sit unflushed in hyper,
    // which polls again only once it could write most of it. So a client that never takes
    // its last frame is detached like any other that stopped reading.
    s.stall_since = Some(now);
}

/// What the in-flight reserve needs of the session's streams.
impl Delivery for Streams {
    fn reading(&self, stream: u32, now: Instant) -> bool {
        self.get(&stream).is_some_and(|s| {
            s.sub.as_ref().is_some_and(|sub| sub.detach.is_none())
                && s.stall_since
                    .is_none_or(|t| now.duration_since(t) < reserve::INFLIGHT_AGE)
        })
    }

    fn delivered(&mut self, stream: u32, last: u64) -> bool {
        self.get_mut(&stream).is_some_and(|s| {
            let moved = last > s.acked;
            s.acked = s.acked.max(last);
            moved
        })
    }
}

impl State {
    /// The next step for the client `generation` attached to `stream`, at `now`.
    pub(super) fn step(
        &mut self,
        budget: &Budget,
        stream: u32,
        generation: u64,
        waker: &Waker,
        now: Instant,
    ) -> Step {
        if self.closed {
            let last = self
                .closing
                .iter()
                .position(|&(s, g, _)| s == stream && g == generation)
                .map_or_else(Bytes::new, |i| self.closing.swap_remove(i).2);
            return Step::Finish(last, Outcome::SessionClosed);
        }
        let Some(s) = self.streams.get_mut(&stream) else {
            return Step::Finish(Bytes::new(), Outcome::SessionClosed);
        };
        let Some(sub) = s.sub.as_ref().filter(|sub| sub.generation == generation) else {
            return Step::Finish(Bytes::new(), Outcome::Replaced);
        };
        let (cursor, has_id, partial) = (sub.cursor, sub.has_id, sub.partial);
        if let Some((_, why)) = sub.detach {
            s.sub = None;
            self.last_activity = now;
            if partial.is_some() {
                // Part-way through an event: anything written now would be read as its rest.
                // The body just ends; the client resumes from its last whole event.
                return Step::Finish(Bytes::new(), why);
            }
            let here = self.consts.cursor(stream, cursor);
            let frame = control::resumption_required(&here, why, self.consts.retry_hint);
            return Step::Finish(frame, why);
        }
        if s.lost_upto > cursor {
            s.sub = None;
            if partial.is_some() {
                return Step::Finish(Bytes::new(), Outcome::Gap);
            }
            // This client fell behind the window: the same explicit failure as a late resume.
            let ids = s.fail_unanswered(cursor);
            let frames = control::gap(&self.consts.cursor(stream, cursor), has_id, &ids);
            return Step::Finish(frames, Outcome::Gap);
        }
        // Polled again after the frame that ended the oversized event: hyper took it, so its
        // slot's bytes leave the budget now, not when it was handed over.
        let room = hand_over_overflow(budget, s, cursor);
        let from = match (partial, s.overflow.as_ref()) {
            (None, _) => 0,
            (Some((seq, at)), Some(o)) if o.seq == seq => at,
            // Part-way through an event that is no longer held: it cannot be finished.
            (Some(_), _) => {
                s.sub = None;
                return Step::Finish(Bytes::new(), Outcome::Gap);
            }
        };
        let (overflow, limits) = (s.overflow.as_ref(), self.inflight.limits());
        // Nothing of this stream after the cursor (the usual poll after a batch was written:
        // no event is later than the stream's last): no batch to look for (an empty one cost
        // every resume: bench/notes.md, "Figure: a client body's steps").
        let nothing_new = partial.is_none() && cursor >= s.last_seq;
        let batch = (!nothing_new)
            .then(|| {
                Batch::collect(
                    &self.consts.id_prefix,
                    &self.window,
                    stream,
                    cursor,
                    overflow.map(|o| (o, from)),
                    limits,
                )
            })
            .filter(|b| !b.out.is_empty());
        let Some(batch) = batch else {
            let step = idle_step(&self.consts, s, stream, cursor, has_id, waker);
            if room {
                self.wake_readers();
            }
            return step;
        };
        handed(s, batch.last, batch.events > 0, batch.partial, now);
        let moved = self.inflight.record(
            stream,
            batch.last,
            batch.events,
            batch.out.len(),
            now,
            &mut self.streams,
        );
        if room || moved {
            self.wake_readers();
        }
        Step::Data(batch.out.freeze(), batch.events as u64)
    }

    /// Tells every attached client of streams of `kind` (all, if `None`) to resume elsewhere.
    pub(super) fn end_clients(&mut self, kind: Option<StreamKind>, now: Instant) {
        for s in self
            .streams
            .values_mut()
            .filter(|s| kind.is_none_or(|k| k == s.kind))
        {
            if let Some(sub) = s.sub.as_mut().filter(|sub| sub.detach.is_none()) {
                sub.detach = Some((now, Outcome::Shutdown));
                if let Some(w) = sub.waker.take() {
                    w.wake();
                }
            }
        }
    }

    /// The client `generation` of `stream` went away (its body was dropped). Its stream's
    /// undelivered events stay guarded for `--stall-timeout` from its last progress.
    pub(super) fn detach(&mut self, metrics: &Metrics, stream: u32, generation: u64, now: Instant) {
        metrics.streams_detached.inc();
        self.last_activity = now;
        if let Some(s) = self.streams.get_mut(&stream) {
            if s.sub
                .as_ref()
                .is_some_and(|sub| sub.generation == generation)
            {
                s.sub = None;
                s.stall_since.get_or_insert(now);
            }
        }
    }
}

/// Empties the overflow slot of `s` once its client at `cursor` was handed all of its event
/// and its body was polled again: from now on a resume before it is a gap. Returns whether it
/// did (room was made).
fn hand_over_overflow(budget: &Budget, s: &mut Stream, cursor: u64) -> bool {
    let Some(o) = s.overflow.as_ref().filter(|o| o.seq <= cursor) else {
        return false;
    };
    s.lost_upto = s.lost_upto.max(o.seq);
    s.set_overflow(None, budget);
    true
}

/// The step of a client at `cursor` of `s` (number `stream`) with nothing to send: it waits
/// for more, or, when the upstream ended the stream, its body ends (with an error for each
/// request the client has not seen answered, at the end's position [`Cursor::END`]).
fn idle_step(
    consts: &Consts,
    s: &mut Stream,
    stream: u32,
    cursor: u64,
    has_id: bool,
    waker: &Waker,
) -> Step {
    s.stall_since = None;
    let Some(end) = s.end.clone() else {
        if let Some(sub) = s.sub.as_mut() {
            sub.waker = Some(waker.clone());
        }
        return Step::Pending;
    };
    s.sub = None;
    // Not marked as told: the frames carry the end's own position, so a client whose
    // connection died with them unread comes back before it and is told again.
    let ids = s.unanswered_ids(cursor);
    if matches!(end, End::Complete) && ids.is_empty() {
        return Step::Finish(Bytes::new(), Outcome::Completed);
    }
    let here = consts.cursor(stream, Cursor::END);
    let frames = control::upstream_ended(&here, has_id, &end, &ids);
    Step::Finish(frames, Outcome::UpstreamFailed)
}
