//! The feed layer: the one owner of whatever fills a session's streams. A few entry points,
//! each called by a route once it has the upstream's answer (or wants the standalone stream):
//!
//! - [`sse`]: a tagged SSE answer (a POST's or a GET's): served at once when a POST's answer
//!   came whole with its head, else read into its stream by a reader task;
//! - [`json`]: an upgraded POST's JSON answer that came whole, served at once;
//! - [`answer_to_come`]: an upgraded POST's answer still to come, fed into the stream its
//!   client already has by a task of its own;
//! - [`hold`] / [`hold_settle_limit`]: the session's one holder of its standalone stream.
//!
//! Inside: `read` (the flow-controlled reader of an SSE body and its upstream resume, the
//! budgeted read of a JSON body), `whole` (an answer that came whole, as events), `answer`
//! (what an upgraded POST's answer becomes), `hold` (the holder's loop). The tasks are
//! spawned here (the holder's by `hold`, its owner): the files below are what they run, and
//! return how their stream ended; the spawner ends the stream and decides what follows.
//!
//! Knows the HTTP client (`upstream`) and the session API; nothing of client requests. The
//! rules of what may be evicted live in `session`.

mod answer;
mod hold;
mod read;
mod whole;

use std::collections::VecDeque;
use std::sync::Arc;

use crate::session::{Attachment, Eviction, OpenStream, Registry, Session, StreamKind, Whole};
use crate::sse::Event;
use crate::upstream::{OwnBody, Source};

pub(crate) use self::answer::Answer;
pub(crate) use self::hold::{settle_limit as hold_settle_limit, start as hold};

/// What a tagged answer became: served whole at once, or a stream its reader fills.
pub(crate) enum Fed {
    Whole(Whole),
    Stream(Attachment),
}

/// Tags the upstream's SSE answer `body` as the stream `open` opens: a POST's answer that
/// came whole with its head is served at once, without a reader; any other is read into
/// the stream by a task of its own, which the session stops when it closes. When a client's
/// own standalone stream ends, the session's holder takes over (after its rest).
pub(crate) fn sse(
    registry: &Arc<Registry>,
    session: &Arc<Session>,
    open: OpenStream<'_>,
    mut body: OwnBody,
    source: Source,
) -> Fed {
    if open.kind == StreamKind::Post {
        let max_event_bytes = source.upstream.cfg.max_event_bytes;
        if let Some(answer) = whole::sse(&mut body, max_event_bytes) {
            return Fed::Whole(serve_whole(registry, session, open, answer));
        }
    }
    let attachment = session.open_stream(open);
    let stream = attachment.stream;
    let (r, s) = (registry.clone(), session.clone());
    // Boxed: the task's cell then holds a pointer, not the large future it would copy in
    // and out of its stages (bench/notes.md, "Figure: boxed futures").
    let reader = tokio::spawn(Box::pin(async move {
        let end = read::stream(&r, &s, stream, body, &source).await;
        s.end_stream(stream, end);
        if source.upstream.cfg.hold_standalone {
            hold::after_client_stream(&r, &s, stream, source);
        }
    }));
    session.set_reader(stream, reader.abort_handle());
    Fed::Stream(attachment)
}

/// Serves an upgraded POST's JSON answer `body`, whole with its head, as the stream `open`
/// opens.
pub(crate) fn json(
    registry: &Arc<Registry>,
    session: &Arc<Session>,
    open: OpenStream<'_>,
    body: &[u8],
    max_event_bytes: usize,
) -> Whole {
    let answer = whole::json(registry.metrics(), body, max_event_bytes);
    serve_whole(registry, session, open, answer)
}

/// Opens the stream `open` of an upgraded POST whose answer is still to come, and feeds the
/// answer into it when it comes, in a task of its own that the session stops when it closes.
/// The upstream's 404 ends the session when `evict_on_404` (the request was the session's
/// own).
pub(crate) fn answer_to_come(
    registry: &Arc<Registry>,
    session: &Arc<Session>,
    open: OpenStream<'_>,
    answer: Answer,
    source: Source,
    evict_on_404: bool,
) -> Attachment {
    let attachment = session.open_stream(open);
    let stream = attachment.stream;
    let (r, s) = (registry.clone(), session.clone());
    let task = tokio::spawn(async move {
        let answered = answer::read(&r, &s, stream, answer, &source).await;
        s.end_stream(stream, answered.end);
        if answered.not_found && evict_on_404 {
            r.remove(s.id(), Eviction::Upstream404);
        }
    });
    session.set_reader(stream, task.abort_handle());
    attachment
}

/// Serves `answer` as the stream `open` opens, here and now, without a task (a short call's
/// usual case): [`Session::open_whole`]. Only when the window has no room for its events at
/// once does a task deliver the rest, then end the stream.
fn serve_whole(
    registry: &Arc<Registry>,
    session: &Arc<Session>,
    open: OpenStream<'_>,
    answer: whole::WholeAnswer,
) -> Whole {
    let whole::WholeAnswer {
        mut events,
        answers,
        end,
    } = answer;
    let whole = session.open_whole(open, &mut events, answers.as_deref(), end.clone());
    if registry.over_budget() {
        registry.enforce_budget(session);
    }
    if let Whole::Attached { attachment, .. } = &whole {
        if !events.is_empty() {
            deliver_rest(registry, session, attachment.stream, events, end);
        }
    }
    whole
}

/// Delivers what did not fit of an answer that came whole, then ends its stream.
fn deliver_rest(
    registry: &Arc<Registry>,
    session: &Arc<Session>,
    stream: u32,
    mut events: VecDeque<Event>,
    end: crate::session::End,
) {
    let (r, s) = (registry.clone(), session.clone());
    let task = tokio::spawn(async move {
        let mut charge = r.budget().charge();
        read::deliver(&r, &s, stream, &mut events, &mut charge, 0).await;
        s.end_stream(stream, end);
    });
    session.set_reader(stream, task.abort_handle());
}

/// What feeds an upgraded POST's stream.
pub(crate) enum Upgraded {
    /// The upstream's JSON answer, whole: its events go into the stream at once ([`json`]).
    Whole(bytes::Bytes),
    /// The upstream's answer, when it comes ([`answer_to_come`]).
    ToCome(Answer),
}
