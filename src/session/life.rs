//! A session's life beyond single events: streams ending (and ended ones forgotten), the
//! sweep's watch (stalled clients, stuck connections, oversized events no one may come back
//! for), trimming under the memory budget, idleness for the TTL and the cap, and the close.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::state::{Books, State};
use super::stream::End;
use super::tag::{drop_overflow, note_eviction};
use super::{control, Budget, Outcome};
use crate::window::Window;

/// Ended streams whose metadata (pending request ids, loss marks) a session keeps so that a
/// late resume of them still gets an exact answer. Older ended streams are forgotten.
pub(super) const MAX_ENDED_STREAMS: usize = 64;

/// What [`State::sweep`] found.
#[derive(Clone, Copy, Debug)]
pub(super) struct Swept {
    /// No client attached.
    pub idle: bool,
    /// The session's last activity.
    pub since: Instant,
    /// Nothing for a sweep to do until the TTL may have run out.
    pub quiet: bool,
}

impl State {
    /// Records client activity (a request): the TTL counts from the latest one.
    pub(super) fn touch(&mut self, now: Instant) {
        self.last_activity = now;
    }

    /// Marks `stream` ended by its upstream and wakes its client.
    pub(super) fn end(&mut self, budget: &Budget, stream: u32, end: End) {
        let Some(s) = self.streams.get_mut(&stream) else {
            return;
        };
        s.end = Some(end);
        s.reader = None;
        s.paused_reader = None;
        self.running.remove(&stream);
        if let Some(w) = s.sub.as_mut().and_then(|sub| sub.waker.take()) {
            w.wake();
        }
        if self.standalone == Some(stream) {
            self.standalone = None;
        }
        self.ended.push_back(stream);
        while self.ended.len() > MAX_ENDED_STREAMS {
            let Some(old) = self.ended.pop_front() else {
                break;
            };
            if self.streams.get(&old).is_some_and(|s| s.sub.is_some()) {
                // Still being read by a client: keep it, forget it later.
                self.ended.push_back(old);
                break;
            }
            let Some(mut gone) = self.streams.remove(&old) else {
                continue;
            };
            gone.set_overflow(None, budget);
            self.carried.remove(old, &gone);
            self.retired.retire(&gone);
            let before = self.window.bytes();
            self.window
                .remove_stream(old, gone.first_seq..=gone.last_seq);
            budget.adjust(before, self.window.bytes());
            // Its events no longer hold anything back.
            self.wake_readers();
        }
    }

    /// Drops all state: stops upstream readers, ends attached clients (each gets its last
    /// frame from `closing`), frees the window.
    pub(super) fn close(&mut self, budget: &Budget) {
        self.closed = true;
        self.hold.abort();
        budget.adjust(self.window.bytes(), 0);
        self.window = Window::new(1, 0);
        let mut closing = Vec::new();
        for (&n, s) in self.streams.iter_mut() {
            s.set_overflow(None, budget);
            if let Some(r) = s.reader.take() {
                r.abort();
            }
            if let Some(sub) = s.sub.as_ref() {
                let (generation, at, has_id) = (sub.generation, sub.cursor, sub.has_id);
                // Part-way through an event, a client can be given nothing more: its body
                // just ends (see `poll_step`).
                let last = if sub.partial.is_some() {
                    Bytes::new()
                } else {
                    let ids = s.fail_unanswered(at);
                    control::session_closed(&self.consts.cursor(n, at), has_id, &ids)
                };
                closing.push((n, generation, last));
            }
            if let Some(w) = s.sub.as_mut().and_then(|sub| sub.waker.take()) {
                w.wake();
            }
        }
        self.closing = closing;
        self.streams.clear();
        self.carried.clear();
        self.paused.clear();
        self.running.clear();
        self.inflight.clear();
    }

    /// Sweep work for one session: detaches clients that made no progress for the stall
    /// budget, closes connections stuck writing, frees oversized events no client may come
    /// back for any more, and wakes paused upstream readers (a guard may have run out, or the
    /// memory budget have room again). Returns whether the session is idle (no client
    /// attached), since when, and whether it is quiet: no client, no paused reader and no
    /// oversized event held, so nothing for a sweep to do until its TTL may have run out
    /// (the session says when that changes: [`State::stir`]).
    pub(super) fn sweep(&mut self, books: Books<'_>, now: Instant) -> Swept {
        let stall = self.consts.stall;
        let mut attached = false;
        let mut watched = false;
        for s in self.streams.values_mut() {
            watched |= s.paused_reader.is_some();
            s.wake_reader();
            if s.overflow
                .as_ref()
                .is_some_and(|o| !s.needs(o.seq, now, stall))
            {
                drop_overflow(books, s);
            }
            watched |= s.overflow.is_some();
            let stall_since = s.stall_since;
            let Some(sub) = s.sub.as_mut() else { continue };
            attached = true;
            match sub.detach {
                Some((at, _)) if now.duration_since(at) >= Duration::from_secs(1) => {
                    // The body was not polled since it was flagged: the connection is stuck
                    // writing. Close it; the client resumes from its last complete event.
                    if let Some(k) = sub.kill.take() {
                        k.notify_one();
                    }
                }
                Some(_) => {}
                None => {
                    if stall_since.is_some_and(|t| now.duration_since(t) >= stall) {
                        sub.detach = Some((now, Outcome::SlowConsumer));
                        books.metrics.slow_consumer_detaches.inc();
                        if let Some(w) = sub.waker.take() {
                            w.wake();
                        }
                    }
                }
            }
        }
        self.quiet = !attached && !watched;
        Swept {
            idle: !attached,
            since: self.last_activity,
            quiet: self.quiet,
        }
    }

    /// Evicts this session's oldest events until `excess` bytes are freed (the global budget
    /// is exceeded and no idle session is left to shed). Evicted events become gaps.
    pub(super) fn trim(&mut self, books: Books<'_>, excess: usize) {
        let before = self.window.bytes();
        while before - self.window.bytes() < excess {
            let Some(old) = self.window.evict_oldest() else {
                break;
            };
            note_eviction(books.metrics, &mut self.streams, &old);
        }
        books.budget.adjust(before, self.window.bytes());
    }

    /// Since when no client has been attached, or `None` while one is.
    /// Since when the session has had no client attached (`None`: one is), and whether a
    /// client may still come back for something: a call still running upstream, or events
    /// not yet delivered within the stall budget. The session cap sheds the others first.
    pub(super) fn idle_since(&self, now: Instant) -> Option<(bool, Instant)> {
        if self.streams.values().any(|s| s.sub.is_some()) {
            return None;
        }
        let wanted = self.streams.values().any(|s| {
            let running = s.end.is_none() && s.requests.iter().any(|r| r.answered_at.is_none());
            running || s.needs(s.last_seq, now, self.consts.stall)
        });
        Some((wanted, self.last_activity))
    }
}
