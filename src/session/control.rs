//! The gateway's own events on a tagged stream, as the bytes a client's body sends: the
//! priming event, `mcp-reattach/resumed` (a resume, a standalone re-attach),
//! `mcp-reattach/resumption-failed` (a re-attach that lost events; the JSON-RPC errors of a
//! gap or of an upstream that ended early), `mcp-reattach/resumption-required` (a detach).
//!
//! Builds bytes from the facts it is given (the cursor text, the stream, why): it knows
//! nothing of the session's state, its lock or its window.

use std::time::Duration;

use bytes::Bytes;

use super::{End, Outcome, Reattach, StreamKind};
use crate::jsonrpc::{
    failure_frames, upstream_failure_frames, EVENT_RESUMED, EVENT_RESUMPTION_FAILED,
    EVENT_RESUMPTION_REQUIRED, EVENT_STREAM, GAP_MESSAGE, SESSION_CLOSED_MESSAGE,
    UPSTREAM_ENDED_MESSAGE,
};
use crate::sse;

/// The `retry:` of a detach when `--retry-hint` sets none.
const DEFAULT_RETRY: Duration = Duration::from_secs(1);

fn millis(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// The first event of a stream `stream` a client attaches to at `here`: the priming event
/// (if `prime`), or, for a standalone re-attach, the control event saying so; `retry` is
/// `--retry-hint`.
pub(crate) fn opening(
    here: &str,
    stream: u32,
    prime: bool,
    reattach: Option<&Reattach>,
    retry: Option<Duration>,
) -> Option<Bytes> {
    let retry = retry.map(millis);
    match reattach {
        Some(r) => {
            let data = serde_json::json!({
                "stream": stream,
                "kind": StreamKind::Standalone.as_str(),
                "after": here,
                "replay": 0,
                "reattached": "session",
                "previous": r.previous,
                "reason": r.reason,
                "lost": r.lost,
            });
            let event = if r.lost {
                EVENT_RESUMPTION_FAILED
            } else {
                EVENT_RESUMED
            };
            Some(sse::control(
                Some(here),
                Some(event),
                retry,
                &data.to_string(),
            ))
        }
        None => prime.then(|| sse::control(Some(here), None, retry, "")),
    }
}

/// The first event of a new stream `stream` whose client gets no priming event but must hold
/// an id at once (an upgraded JSON answer at a protocol version before priming): an
/// `mcp-reattach/stream` event at `here`, which clients ignore except for its id.
pub(super) fn announce(here: &str, stream: u32, retry: Option<Duration>) -> Bytes {
    let data = serde_json::json!({
        "stream": stream,
        "kind": StreamKind::Post.as_str(),
        "after": here,
    });
    sse::control(
        Some(here),
        Some(EVENT_STREAM),
        retry.map(millis),
        &data.to_string(),
    )
}

/// The first event of a resumed stream: where it resumes (`here`) and how many retained
/// events follow.
pub(crate) fn resumed(
    here: &str,
    stream: u32,
    kind: StreamKind,
    replay: usize,
    ended: bool,
) -> Bytes {
    // The event's data, its fields in the order `json!` wrote them (sorted), written
    // directly, not through a `Value` map or serde's serializer (bench/notes.md, "Figure:
    // the resumed event"). Nothing in it needs escaping: `here` is a cursor
    // (hex, digits and dots), `kind` a name of ours.
    debug_assert!(here.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.'));
    let mut numbers = itoa::Buffer::new();
    let mut data = String::with_capacity(80 + here.len());
    data.push_str("{\"after\":\"");
    data.push_str(here);
    data.push_str(if ended {
        "\",\"ended\":true,\"kind\":\""
    } else {
        "\",\"ended\":false,\"kind\":\""
    });
    data.push_str(kind.as_str());
    data.push_str("\",\"replay\":");
    data.push_str(numbers.format(replay));
    data.push_str(",\"stream\":");
    data.push_str(numbers.format(stream));
    data.push('}');
    sse::control(Some(here), Some(EVENT_RESUMED), None, &data)
}

/// The last event of a client detached for `why` (a stall, or the gateway shutting down): it
/// resumes from `here`, after `retry` (`--retry-hint`, else a second).
pub(crate) fn resumption_required(here: &str, why: Outcome, retry: Option<Duration>) -> Bytes {
    let reason = match why {
        Outcome::Shutdown => "shutdown",
        _ => "slow-consumer",
    };
    let data = serde_json::json!({ "reason": reason, "resume_from": here });
    sse::control(
        Some(here),
        Some(EVENT_RESUMPTION_REQUIRED),
        Some(millis(retry.unwrap_or(DEFAULT_RETRY))),
        &data.to_string(),
    )
}

/// The events after `here` were evicted: a failure event, and a JSON-RPC error for each of
/// `ids` (requests whose result cannot be delivered). `with_id`: the client already has an
/// id on this stream, so the failure event carries `here`.
pub(crate) fn gap(here: &str, with_id: bool, ids: &[String]) -> Bytes {
    failure_frames(here, with_id, "gap", ids, GAP_MESSAGE)
}

/// The session was dropped while the client was attached at `here`: a failure event, and a
/// JSON-RPC error for each of `ids` (requests whose result will never come).
pub(super) fn session_closed(here: &str, with_id: bool, ids: &[String]) -> Bytes {
    failure_frames(here, with_id, "session-closed", ids, SESSION_CLOSED_MESSAGE)
}

/// The upstream ended the stream (`end`) before answering `ids`: a failure event and a
/// JSON-RPC error for each.
pub(crate) fn upstream_ended(here: &str, with_id: bool, end: &End, ids: &[String]) -> Bytes {
    match end {
        End::Complete => {
            failure_frames(here, with_id, "upstream-ended", ids, UPSTREAM_ENDED_MESSAGE)
        }
        End::Failed(cause) => upstream_failure_frames(here, with_id, &cause.to_string(), ids),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(b: Bytes) -> String {
        String::from_utf8(b.to_vec()).unwrap()
    }

    /// The JSON of the one event in `frame`.
    fn data(frame: &str) -> serde_json::Value {
        let line = frame.lines().find_map(|l| l.strip_prefix("data: "));
        serde_json::from_str(line.expect("a data line")).unwrap()
    }

    #[test]
    fn a_stream_opens_with_a_priming_event_only_when_asked() {
        assert_eq!(opening("e.1.1", 1, false, None, None), None);
        let primed = text(opening("e.1.1", 1, true, None, Some(Duration::from_secs(2))).unwrap());
        assert_eq!(primed, "id: e.1.1\nretry: 2000\ndata: \n\n");
    }

    #[test]
    fn an_announced_stream_opens_with_an_id_bearing_event_of_the_gateway() {
        let t = text(announce("e.4.2", 4, None));
        assert!(
            t.starts_with(&format!("id: e.4.2\nevent: {EVENT_STREAM}\n")),
            "{t}"
        );
        assert_eq!(
            data(&t),
            serde_json::json!({ "stream": 4, "kind": "post", "after": "e.4.2" })
        );
        let t = text(announce("e.4.2", 4, Some(Duration::from_millis(1500))));
        assert!(t.contains("retry: 1500\n"), "{t}");
    }

    #[test]
    fn a_standalone_reattach_says_so_and_whether_events_were_lost() {
        for lost in [false, true] {
            let r = Reattach {
                previous: "e.0.7".into(),
                lost,
                reason: "gap",
            };
            let t = text(opening("e.3.9", 3, false, Some(&r), None).unwrap());
            let event = if lost {
                EVENT_RESUMPTION_FAILED
            } else {
                EVENT_RESUMED
            };
            assert!(
                t.starts_with(&format!("id: e.3.9\nevent: {event}\n")),
                "{t}"
            );
            let d = data(&t);
            assert_eq!(d["kind"], "standalone");
            assert_eq!(d["reattached"], "session");
            assert_eq!(
                (&d["previous"], &d["reason"], &d["lost"]),
                (&"e.0.7".into(), &"gap".into(), &lost.into())
            );
        }
    }

    #[test]
    fn the_resumed_data_is_what_serde_json_writes() {
        for (kind, ended, replay, stream) in [
            (StreamKind::Post, true, 3, 2),
            (StreamKind::Standalone, false, 0, 0),
            (StreamKind::Post, false, usize::MAX, u32::MAX),
        ] {
            let here = format!("0123456789abcdef.{stream}.42");
            let t = text(resumed(&here, stream, kind, replay, ended));
            let want = serde_json::json!({
                "after": here, "ended": ended, "kind": kind.as_str(), "replay": replay, "stream": stream,
            })
            .to_string();
            assert!(t.contains(&format!("\ndata: {want}\n\n")), "{t}");
        }
    }

    #[test]
    fn resumed_and_resumption_required_carry_where_to_go_on() {
        let t = text(resumed("e.2.4", 2, StreamKind::Post, 3, true));
        assert!(
            t.starts_with(&format!("id: e.2.4\nevent: {EVENT_RESUMED}\n")),
            "{t}"
        );
        let d = data(&t);
        assert_eq!(
            (&d["stream"], &d["kind"], &d["after"]),
            (&2.into(), &"post".into(), &"e.2.4".into())
        );
        assert_eq!((&d["replay"], &d["ended"]), (&3.into(), &true.into()));
        for (why, reason) in [
            (Outcome::SlowConsumer, "slow-consumer"),
            (Outcome::Shutdown, "shutdown"),
        ] {
            let t = text(resumption_required("e.2.4", why, None));
            assert!(
                t.contains(EVENT_RESUMPTION_REQUIRED) && t.contains("retry: 1000\n"),
                "{t}"
            );
            assert_eq!(
                data(&t),
                serde_json::json!({ "reason": reason, "resume_from": "e.2.4" })
            );
        }
    }
}
