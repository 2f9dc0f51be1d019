//! What a fleet's shared store learns of a stream this replica owns: the events tagged since
//! its last publication, in order, and once its end. A rule of the session's state like the
//! others (pure, under the session's lock); what becomes of it (the store's wire form, the
//! writer) is `store`'s.

use tokio::time::Instant;

use super::state::State;
use super::stream::{End, StreamKind};
use super::Principal;

/// One publication of a stream: its facts, and where its events fit in its history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Published {
    pub kind: StreamKind,
    /// Who opened the stream: only they may resume a call's stream.
    pub principal: Principal,
    /// The stream's opening position (a cursor there is before any of its events).
    pub first_seq: u64,
    /// The stream's first publication: its facts are not in the store yet.
    pub opened: bool,
    /// Every event of the stream at or before this position is in an earlier publication or
    /// lost: a reader whose cursor is before it has a gap.
    pub prev: u64,
    /// The last position of this publication's events (`prev` when it has none).
    pub last: u64,
    /// The stream's lowest position the window may still hold: the store keeps no less.
    pub low: u64,
    /// How many events it has.
    pub events: usize,
    /// The request ids the stream's POST carried, each with the position of the event that
    /// answered it, if one did.
    pub requests: Vec<(String, Option<u64>)>,
    /// An event of this publication answered one of them (the stream's facts changed).
    pub answered: bool,
    /// The stream ended, and how.
    pub end: Option<End>,
}

impl State {
    /// A client following `stream` on another replica is at `acked`, as of `progressed`: its
    /// events after it are guarded (see [`Stream::remote`](super::stream::Stream)). A later
    /// position wakes the paused reader (room may be made). `false` when the stream is gone.
    pub(super) fn remote_progress(&mut self, stream: u32, acked: u64, progressed: Instant) -> bool {
        let Some(s) = self.streams.get_mut(&stream) else {
            return false;
        };
        let advanced = s.remote.is_none_or(|(a, _)| acked > a);
        let fresher = s.remote.is_none_or(|(_, t)| progressed > t);
        if advanced || fresher {
            s.remote = Some((acked.max(s.remote.map_or(0, |(a, _)| a)), progressed));
        }
        if advanced {
            s.wake_reader();
            self.stir();
        }
        true
    }

    /// `stream` is published again from its opening (the store lost it: restarted empty);
    /// `false` when it is not held, or its end was published already.
    pub(super) fn republish(&mut self, stream: u32) -> bool {
        match self.streams.get_mut(&stream) {
            Some(s) if !s.published_end => {
                s.published = None;
                true
            }
            _ => false,
        }
    }

    /// `stream`'s facts as of its last publication, as if it opened now (no events): what a
    /// store that came back (perhaps empty) is given again of a stream still running here, so
    /// its request ids' claims and its meta are in it once more. `None` when the stream is not
    /// retained, was never published, or its end was.
    pub(super) fn republished(&self, stream: u32) -> Option<Published> {
        let s = self.streams.get(&stream)?;
        let at = s.published.filter(|_| !s.published_end)?;
        Some(Published {
            kind: s.kind,
            principal: s.principal,
            first_seq: s.first_seq,
            opened: true,
            prev: at,
            last: at,
            low: s.lost_upto.max(s.first_seq) + 1,
            events: 0,
            requests: s
                .requests
                .iter()
                .map(|r| (r.id.clone(), r.answered_at.filter(|&a| a <= at)))
                .collect(),
            answered: false,
            end: None,
        })
    }

    /// What the store does not have yet of `stream` (see [`Published`]): each event after the
    /// last publication goes to `event`, in order (the window's, and the stream's overflow
    /// slot's in its place). `None` when there is nothing new: no new event, no end, already
    /// opened; or the stream is not retained, or its end was published.
    pub(super) fn unpublished(
        &mut self,
        stream: u32,
        mut event: impl FnMut(u64, bool, &[u8]),
    ) -> Option<Published> {
        let s = self.streams.get_mut(&stream)?;
        if s.published_end {
            return None;
        }
        let opened = s.published.is_none();
        // Lost before they were published (evicted, an overflow dropped): the chain says so.
        let prev = s.published.unwrap_or(s.first_seq).max(s.lost_upto);
        let mut last = prev;
        let mut events = 0;
        let overflow = s.overflow.as_ref().filter(|o| o.seq > prev);
        let mut overflow_sent = false;
        for e in self.window.after(stream, prev) {
            if let Some(o) = overflow.filter(|o| !overflow_sent && o.seq < e.seq) {
                event(o.seq, o.message, &o.body);
                overflow_sent = true;
                events += 1;
            }
            event(e.seq, e.message, &e.body);
            last = e.seq;
            events += 1;
        }
        if let Some(o) = overflow.filter(|_| !overflow_sent) {
            event(o.seq, o.message, &o.body);
            last = last.max(o.seq);
            events += 1;
        }
        let end = s.end.clone();
        if !opened && events == 0 && end.is_none() {
            return None;
        }
        s.published = Some(last);
        s.published_end = end.is_some();
        Some(Published {
            kind: s.kind,
            principal: s.principal,
            first_seq: s.first_seq,
            opened,
            prev,
            last,
            low: s.lost_upto.max(s.first_seq) + 1,
            events,
            requests: s
                .requests
                .iter()
                .map(|r| (r.id.clone(), r.answered_at))
                .collect(),
            answered: s
                .requests
                .iter()
                .any(|r| r.answered_at.is_some_and(|at| at > prev && at <= last)),
            end,
        })
    }
}
