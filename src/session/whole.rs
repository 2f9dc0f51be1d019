//! An answer that came whole with its head (a short call's SSE answer, an upgraded JSON
//! answer): its stream opened, its events tagged, its end and its first client's whole body
//! made under one hold of the session's lock, as the usual steps would make them one by one
//! (open, push, end, then the attached body's polls and its detach), so the client gets it
//! with its length, in one piece. The rule is `State`'s; `Session::open_whole` locks for it.

use std::collections::VecDeque;
use std::task::Waker;

use bytes::Bytes;
use tokio::time::Instant;

use super::deliver::Step;
use super::open::OpenStream;
use super::state::{Books, State};
use super::{Attachment, End, Outcome};
use crate::sse::Event;

/// Most steps a whole body is made of: the events, then the end.
const WHOLE_STEPS: usize = 2;

/// What [`State::open_whole`] made of an answer.
#[derive(Debug)]
pub enum Whole {
    /// The client's whole body: its stream's opening, events and end.
    Served {
        body: Bytes,
        /// How many events it holds.
        events: u64,
        outcome: Outcome,
    },
    /// The client attaches as to any stream: the window had no room for every event at
    /// once (those left are still in `events`: the caller delivers them, then ends the
    /// stream), or the body is longer than one frame. `handed`: events already in the
    /// attachment's opening.
    Attached { attachment: Attachment, handed: u64 },
}

impl State {
    /// Opens a stream as [`State::open`] does, tags `events` into it and ends it with `end`
    /// (`answers[i]`: the ids of the responses `events[i]` is, when read already, so tagging
    /// does not read them again), then makes its first client's whole body, detached.
    pub(super) fn open_whole(
        &mut self,
        books: Books<'_>,
        open: OpenStream<'_>,
        events: &mut VecDeque<Event>,
        answers: Option<&[Vec<String>]>,
        end: End,
        now: Instant,
    ) -> Whole {
        let opened = self.open(books, open, now);
        let mut attachment = opened.attachment();
        let (stream, generation) = (opened.stream, opened.generation);
        if !events.is_empty() && !self.push(books, stream, events, None, answers, now) {
            return Whole::Attached {
                attachment,
                handed: 0,
            };
        }
        self.end(books.budget, stream, end);
        let mut parts: Vec<Bytes> = attachment.opening.take().into_iter().collect();
        let mut handed = 0;
        for _ in 0..WHOLE_STEPS {
            match self.step(books.budget, stream, generation, Waker::noop(), now) {
                Step::Data(b, n) => {
                    parts.push(b);
                    handed += n;
                }
                Step::Finish(b, outcome) => {
                    parts.push(b);
                    self.detach(books.metrics, stream, generation, now);
                    return Whole::Served {
                        body: concat(parts),
                        events: handed,
                        outcome,
                    };
                }
                // Not after the end; the noop waker left is replaced by the body's first poll.
                Step::Pending => break,
            }
        }
        attachment.opening = Some(concat(parts)).filter(|b| !b.is_empty());
        Whole::Attached { attachment, handed }
    }
}

/// `parts` as one buffer (copied only when more than one is not empty).
fn concat(mut parts: Vec<Bytes>) -> Bytes {
    parts.retain(|b| !b.is_empty());
    match parts.len() {
        0 => Bytes::new(),
        1 => parts.pop().unwrap_or_default(),
        _ => parts.concat().into(),
    }
}
