//! The table test of the one resume decision: the same cursors against a stream held here
//! (the real `State::resume` on a real session) and the same stream followed from the fleet's
//! store (the owner's real publications, kept as the store's writer keeps them, read as
//! `store::follow` reads them), asserting the same status, reason and frames.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::config::Config;
use crate::error::ProxyError;
use crate::session::{
    control, lock, Attachment, Budget, End, OpenStream, Owner, Principal, Resume, Session,
};
use crate::sse::Event;

/// What a client gets: a refusal's status and reason, a 200's first frames (the resumed
/// event, or the gap's whole body), or a re-attach to the session.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Refused(u16, &'static str),
    Frames(String),
    Reattach(bool, &'static str),
}

fn refused(e: ResumeError) -> Answer {
    let c = ProxyError::Resume(e).class();
    Answer::Refused(c.status.as_u16(), c.reason)
}

/// The fleet's store's view of one stream, kept from the owner's publications as the
/// writer keeps them: an entry per publication with events (named by its last position,
/// chained by `prev`), trimmed to the window's `low` (`MINID`), the meta's facts.
#[derive(Debug, Default)]
struct Kept {
    stream: u32,
    meta: Option<(StreamKind, u64)>,
    end_last: Option<u64>,
    /// (id, prev, the positions of its events)
    entries: Vec<(u64, u64, Vec<u64>)>,
    last_added: Option<u64>,
    requests: Vec<(String, Option<u64>)>,
}

impl Kept {
    /// What the owner publishes of `stream` now.
    fn publish(&mut self, s: &Session, stream: u32) {
        let mut seqs = Vec::new();
        let Some(p) = s.unpublished(stream, |seq, _, _| seqs.push(seq)) else {
            return;
        };
        if p.events > 0 {
            self.entries.retain(|e| e.0 >= p.low);
            self.entries.push((p.last, p.prev, seqs));
            self.last_added = Some(p.last);
        }
        self.stream = stream;
        self.meta = Some((p.kind, p.first_seq));
        self.requests = p.requests;
        if p.end.is_some() {
            self.end_last = Some(p.last);
        }
    }

    /// What `store::follow` makes of a resume at `cursor`: the store's view, the one
    /// decision, and the frames it writes first.
    fn answer(&self, cursor: &Cursor, epoch: u64) -> Answer {
        let seq = cursor.seq;
        let unanswered: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, at)| at.is_none_or(|at| at > seq))
            .map(|(id, _)| id.clone())
            .collect();
        let meta = self.meta.filter(|_| cursor.stream == self.stream);
        let known = match meta {
            // Not in the store: the follower's own session decides, which never issued it.
            None => Known::NotIssued,
            Some((kind, first)) => Known::from_store(
                &Stored {
                    kind,
                    first,
                    end_last: self.end_last,
                    last_added: self.last_added,
                    next_prev: self.entries.iter().find(|e| e.0 > seq).map(|e| e.1),
                    owner_gone: false,
                    unanswered: !unanswered.is_empty(),
                },
                seq,
            ),
        };
        let here = cursor.text();
        match decide(cursor, epoch, &known) {
            Decision::Refuse(e) => refused(e),
            Decision::Reattach { lost, reason, .. } => Answer::Reattach(lost, reason),
            Decision::GapWithErrors => {
                Answer::Frames(text(&control::gap(&here, true, &unanswered)))
            }
            Decision::Attach => {
                let Some((kind, _)) = self.meta else {
                    unreachable!("attached to a stream the store has")
                };
                let replay = self
                    .entries
                    .iter()
                    .flat_map(|e| e.2.iter())
                    .filter(|&&p| p > seq)
                    .count();
                Answer::Frames(text(&control::resumed(
                    &here,
                    cursor.stream,
                    kind,
                    replay,
                    self.end_last.is_some(),
                )))
            }
        }
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8(b.to_vec()).unwrap()
}

/// What the owner's `State::resume` (and its standalone re-attach) answers at `cursor`.
fn held(s: &Session, cursor: Cursor) -> Answer {
    match s.resume(cursor, None) {
        Ok(Resume::Attached { attachment, .. }) => {
            Answer::Frames(text(&attachment.opening.expect("the resumed event")))
        }
        Ok(Resume::GapWithErrors { frames }) => Answer::Frames(text(&frames)),
        Err(e) => match s.standalone_reattach(&cursor) {
            Some(r) => Answer::Reattach(r.lost, r.reason),
            None => refused(e),
        },
    }
}

fn msg(data: &str) -> Event {
    Event::message_of(data)
}

/// A session whose one stream of `kind` (carrying request `1` if a call) got `events`
/// events, its client gone, published to a store after each, the result of request 1 after
/// `result_after` of them (if some), then the end if `end`. `window`: the window's events (a
/// small one evicts). Returns the session, the stream, its events' positions (the result's
/// included) and the store's view.
fn scenario(
    kind: StreamKind,
    events: usize,
    result_after: Option<usize>,
    end: bool,
    window: usize,
) -> (Session, u32, Vec<u64>, Kept) {
    let mut c = Config::new("http://127.0.0.1:1".parse().unwrap());
    c.window_events = window;
    c.stall_timeout = Duration::ZERO;
    let s = Session::new(
        "a".into(),
        Arc::new(c),
        Arc::default(),
        Arc::new(Budget::new(usize::MAX)),
        Owner::new(Principal::default(), "/mcp"),
        false,
    );
    let requests = match kind {
        StreamKind::Post => vec!["1".to_owned()],
        StreamKind::Standalone => vec![],
    };
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(kind, requests));
    s.detach(stream, generation);
    let mut kept = Kept::default();
    kept.publish(&s, stream);
    let mut positions = Vec::new();
    let mut push = |data: String| {
        s.push_events(stream, &mut VecDeque::from([msg(&data)]), None);
        kept.publish(&s, stream);
        positions.push(lock(&s.state).streams.get(&stream).unwrap().last_seq);
    };
    for i in 0..=events {
        if result_after == Some(i) {
            push(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#.to_owned());
        }
        if i < events {
            push(format!(
                r#"{{"jsonrpc":"2.0","method":"p","params":{{"n":{i}}}}}"#
            ));
        }
    }
    if end {
        s.end_stream(stream, End::Complete);
        kept.publish(&s, stream);
    }
    (s, stream, positions, kept)
}

/// One row of a table: its name, its cursor (made from the session's epoch, the stream and
/// its events' positions), and what the answer must be.
type Case = (
    &'static str,
    fn(u64, u32, &[u64]) -> Cursor,
    fn(&Answer) -> bool,
);

/// Runs every cursor of `cursors` (made from the session's epoch, the stream, its events'
/// positions) against the held stream and the followed one, each on a fresh scenario (a
/// resume changes what the next one gets), asserting the same answer and the one expected.
fn same_answers(build: impl Fn() -> (Session, u32, Vec<u64>, Kept), cursors: &[Case]) {
    for (case, make, want) in cursors {
        let (s, stream, positions, kept) = build();
        let cursor = make(s.epoch, stream, &positions);
        let followed = kept.answer(&cursor, s.epoch);
        let held = held(&s, cursor);
        assert_eq!(held, followed, "{case}: held and followed answer alike");
        assert!(want(&held), "{case}: {held:?}");
    }
}

fn at(epoch: u64, stream: u32, seq: u64) -> Cursor {
    Cursor { epoch, stream, seq }
}

fn is(status: u16, reason: &'static str) -> impl Fn(&Answer) -> bool {
    move |a| *a == Answer::Refused(status, reason)
}

fn resumed(a: &Answer) -> bool {
    matches!(a, Answer::Frames(f) if f.contains("event: mcp-reattach/resumed"))
}

fn gap_with_errors(a: &Answer) -> bool {
    matches!(a, Answer::Frames(f) if f.contains("event: mcp-reattach/resumption-failed") && f.contains("\"id\":1"))
}

#[tokio::test(start_paused = true)]
async fn a_call_gets_the_same_answer_held_and_followed() {
    // An ended call: three progress events and the result, everything retained.
    same_answers(
        || scenario(StreamKind::Post, 3, Some(3), true, 100),
        &[
            ("inside", |e, s, p| at(e, s, p[0]), resumed),
            ("the opening", |e, s, p| at(e, s, p[0] - 1), resumed),
            (
                "the last event of an ended call",
                |e, s, p| at(e, s, *p.last().unwrap()),
                |a| is(409, "stream-ended")(a),
            ),
            (
                "the end position",
                |e, s, _| at(e, s, Cursor::END),
                |a| is(409, "stream-ended")(a),
            ),
            (
                "50 ahead",
                |e, s, p| at(e, s, p.last().unwrap() + 50),
                |a| is(409, "cursor-ahead")(a),
            ),
            (
                "another epoch",
                |e, s, p| at(e ^ 1, s, p[0]),
                |a| is(409, "foreign-cursor")(a),
            ),
            (
                "another stream",
                |e, s, p| at(e, s + 7, p[0]),
                |a| is(409, "cursor-ahead")(a),
            ),
            (
                "before its opening",
                |e, s, p| at(e, s, p[0] - 2),
                |a| is(409, "foreign-cursor")(a),
            ),
        ],
    );
    // A call that ended without its result: the end frames again, before the end position.
    same_answers(
        || scenario(StreamKind::Post, 2, None, true, 100),
        &[
            (
                "the last event",
                |e, s, p| at(e, s, *p.last().unwrap()),
                resumed,
            ),
            (
                "the end position",
                |e, s, _| at(e, s, Cursor::END),
                |a| is(409, "stream-ended")(a),
            ),
        ],
    );
    // A running call: caught up, ahead, and its end position before it has one.
    same_answers(
        || scenario(StreamKind::Post, 3, None, false, 100),
        &[
            ("inside", |e, s, p| at(e, s, p[1]), resumed),
            ("caught up", |e, s, p| at(e, s, *p.last().unwrap()), resumed),
            (
                "50 ahead",
                |e, s, p| at(e, s, p.last().unwrap() + 50),
                |a| is(409, "cursor-ahead")(a),
            ),
            (
                "the end position",
                |e, s, _| at(e, s, Cursor::END),
                |a| is(409, "cursor-ahead")(a),
            ),
        ],
    );
    // A window of two: a cursor before it is the explicit gap, with the request's error
    // while it is unanswered, a 409 once it was answered before the cursor.
    same_answers(
        || scenario(StreamKind::Post, 5, None, false, 2),
        &[
            (
                "before the window",
                |e, s, p| at(e, s, p[0]),
                gap_with_errors,
            ),
            (
                "inside the window",
                |e, s, p| at(e, s, p[p.len() - 2]),
                resumed,
            ),
        ],
    );
    same_answers(
        || scenario(StreamKind::Post, 5, Some(0), false, 2),
        &[(
            "before the window, answered",
            |e, s, p| at(e, s, p[0]),
            |a| is(409, "gap")(a),
        )],
    );
}

#[tokio::test(start_paused = true)]
async fn a_standalone_stream_gets_the_same_answer_held_and_followed() {
    same_answers(
        || scenario(StreamKind::Standalone, 3, None, true, 100),
        &[
            ("inside an ended one", |e, s, p| at(e, s, p[0]), resumed),
            (
                "its last event",
                |e, s, p| at(e, s, *p.last().unwrap()),
                |a| *a == Answer::Reattach(false, "stream-ended"),
            ),
            (
                "the end position",
                |e, s, _| at(e, s, Cursor::END),
                |a| *a == Answer::Reattach(false, "stream-ended"),
            ),
            (
                "50 ahead",
                |e, s, p| at(e, s, p.last().unwrap() + 50),
                |a| is(409, "cursor-ahead")(a),
            ),
        ],
    );
    same_answers(
        || scenario(StreamKind::Standalone, 5, None, false, 2),
        &[
            (
                "before the window",
                |e, s, p| at(e, s, p[0]),
                |a| *a == Answer::Reattach(true, "gap"),
            ),
            ("caught up", |e, s, p| at(e, s, *p.last().unwrap()), resumed),
        ],
    );
}

#[test]
fn a_malformed_cursor_is_refused_before_either_path_is_asked() {
    // The route parses once, for both paths: 400 `malformed-cursor` whoever holds the stream.
    for raw in ["", "x", "0123456789abcdef.1", "0123456789abcdef.01.2"] {
        let e = Cursor::parse(raw.as_bytes()).unwrap_err();
        let c = ProxyError::MalformedCursor(e).class();
        assert_eq!((c.status.as_u16(), c.reason), (400, "malformed-cursor"));
    }
}

/// The rule alone, on the facts each path fills.
#[test]
fn the_rule_orders_its_checks_as_documented() {
    let epoch = 7;
    let facts = Facts {
        kind: StreamKind::Post,
        first: 10,
        last: 20,
        ended: true,
        owner_gone: false,
        lost_after: false,
        more: false,
        unanswered: false,
    };
    let c = |seq| Cursor {
        epoch,
        stream: 1,
        seq,
    };
    let d = |seq, f: Facts| decide(&c(seq), epoch, &Known::Stream(f));
    assert_eq!(d(20, facts), Decision::Refuse(ResumeError::StreamEnded));
    assert_eq!(
        d(Cursor::END, facts),
        Decision::Refuse(ResumeError::StreamEnded)
    );
    assert_eq!(d(21, facts), Decision::Refuse(ResumeError::CursorAhead));
    assert_eq!(d(9, facts), Decision::Refuse(ResumeError::ForeignCursor));
    let running = Facts {
        ended: false,
        ..facts
    };
    assert_eq!(d(20, running), Decision::Attach);
    assert_eq!(
        d(Cursor::END, running),
        Decision::Refuse(ResumeError::CursorAhead)
    );
    let lost = Facts {
        lost_after: true,
        unanswered: true,
        ..facts
    };
    assert_eq!(d(12, lost), Decision::GapWithErrors);
    assert_eq!(
        d(
            12,
            Facts {
                unanswered: false,
                ..lost
            }
        ),
        Decision::Refuse(ResumeError::Gap)
    );
    // An owner gone (the store's fact) ends a standalone stream for its cursor, not a call's.
    let gone = Facts {
        owner_gone: true,
        ended: false,
        ..facts
    };
    assert_eq!(d(15, gone), Decision::Attach);
    assert_eq!(
        d(Cursor::END, gone),
        Decision::Refuse(ResumeError::StreamEnded)
    );
    assert_eq!(
        d(
            15,
            Facts {
                kind: StreamKind::Standalone,
                ..gone
            }
        ),
        Decision::Reattach {
            cause: ResumeError::StreamExpired,
            lost: true,
            reason: "stream-expired"
        }
    );
    let forgotten = |standalone, seq| decide(&c(seq), epoch, &Known::Forgotten { standalone });
    assert_eq!(
        forgotten(false, 12),
        Decision::Refuse(ResumeError::StreamExpired)
    );
    assert_eq!(
        forgotten(false, Cursor::END),
        Decision::Refuse(ResumeError::StreamEnded)
    );
    assert!(matches!(
        forgotten(true, 12),
        Decision::Reattach {
            lost: true,
            reason: "stream-expired",
            ..
        }
    ));
    assert_eq!(
        decide(&c(12), epoch + 1, &Known::Stream(facts)),
        Decision::Refuse(ResumeError::ForeignCursor)
    );
    assert_eq!(
        decide(&c(12), epoch, &Known::NotIssued),
        Decision::Refuse(ResumeError::CursorAhead)
    );
}

/// What the store says, read as the rule's facts.
#[test]
fn the_stores_view_reads_as_the_owners_facts() {
    let stored = Stored {
        kind: StreamKind::Post,
        first: 10,
        end_last: None,
        last_added: Some(20),
        next_prev: Some(14),
        owner_gone: false,
        unanswered: true,
    };
    let Known::Stream(f) = Known::from_store(&stored, 14) else {
        panic!()
    };
    assert_eq!(
        (f.last, f.ended, f.lost_after, f.more),
        (20, false, false, true)
    );
    // A hole between the cursor and the next entry.
    let Known::Stream(f) = Known::from_store(&stored, 12) else {
        panic!()
    };
    assert!(f.lost_after);
    // Nothing after the cursor, positions after it published: trimmed.
    let trimmed = Stored {
        next_prev: None,
        ..stored
    };
    let Known::Stream(f) = Known::from_store(&trimmed, 15) else {
        panic!()
    };
    assert!(f.lost_after && !f.more);
    let Known::Stream(f) = Known::from_store(&trimmed, 20) else {
        panic!()
    };
    assert!(!f.lost_after, "caught up");
    // Nothing added yet: its last position is its opening.
    let Known::Stream(f) = Known::from_store(
        &Stored {
            last_added: None,
            next_prev: None,
            ..stored
        },
        10,
    ) else {
        panic!()
    };
    assert_eq!(f.last, 10);
    // Its end says where it ended.
    let Known::Stream(f) = Known::from_store(
        &Stored {
            end_last: Some(25),
            next_prev: None,
            ..stored
        },
        25,
    ) else {
        panic!()
    };
    assert_eq!((f.last, f.ended), (25, true));
}
