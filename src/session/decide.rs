//! The one resume decision: what a cursor gets from what is known of its stream, whether the
//! stream is held here (`State::resume`) or read from the fleet's store (`store::follow`, the
//! stream's meta and its entries). Each path fills a [`Known`] and acts on the [`Decision`].
//!
//! Pure: no locks, no runtime, no store, no allocation; it knows nothing of how either path
//! serves a stream.

use super::resume::ResumeError;
use super::stream::StreamKind;
use crate::cursor::Cursor;

/// What is known of a cursor's stream in its session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Known {
    /// No stream of this number was issued in the session (or the cursor is of another epoch).
    NotIssued,
    /// Issued, ended and forgotten; `standalone` when it was the session's standalone stream.
    Forgotten { standalone: bool },
    /// Retained here, or in the fleet's store: its facts as seen from the cursor.
    Stream(Facts),
}

/// A stream's facts, as seen from a cursor's position `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Facts {
    pub kind: StreamKind,
    /// Its opening position.
    pub first: u64,
    /// Its highest position issued (held) or published (in the store): its last event's, or
    /// its opening when it has none.
    pub last: u64,
    /// It ended: nothing more will be added to it.
    pub ended: bool,
    /// Its owner is gone (only a store knows this of another replica's stream): nothing more
    /// will be added, and what it did not publish is lost. A follower tells a call's client so
    /// with end frames at the end position; a standalone cursor re-attaches to the session.
    pub owner_gone: bool,
    /// Events after `seq` can no longer be delivered (evicted, trimmed, a hole in the chain).
    pub lost_after: bool,
    /// Events after `seq` are at hand to replay. Looked at only for an ended stream (a running
    /// one is attached to whether or not): a path may leave it `false` for a running one.
    pub more: bool,
    /// Requests of the stream whose answer the client at `seq` has not seen, and that were
    /// not answered with an error that stands.
    pub unanswered: bool,
}

/// What a resume at a cursor gets. Each path builds the same bytes from it (the resumed
/// event, the gap frames, the refusal's JSON error, the re-attach event).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// 200: attached at the cursor, `mcp-reattach/resumed`, the events after it, the live tail
    /// (and a stream's end frames, told again before its end position).
    Attach,
    /// 200: events after the cursor are lost and requests are unanswered: the gap frames with
    /// an error for each, then the stream ends.
    GapWithErrors,
    /// A documented 4xx (`docs/protocol.md`).
    Refuse(ResumeError),
    /// A standalone cursor that cannot be resumed exactly: the client re-attaches to the
    /// session (the session outlives its standalone stream), told whether events after its
    /// cursor were or may have been lost, and why; `cause` is what a call's cursor would be
    /// refused with (`StreamEnded`, `Gap` or `StreamExpired`).
    Reattach {
        cause: ResumeError,
        lost: bool,
        reason: &'static str,
    },
}

/// The decision for `cursor` in a session of `epoch`, from what is `known` of its stream.
pub(crate) fn decide(cursor: &Cursor, epoch: u64, known: &Known) -> Decision {
    if cursor.epoch != epoch {
        return Decision::Refuse(ResumeError::ForeignCursor);
    }
    let seq = cursor.seq;
    let (standalone, refusal) = match *known {
        Known::NotIssued => return Decision::Refuse(ResumeError::CursorAhead),
        Known::Forgotten { standalone } => (
            standalone,
            // At the end's position the client read the stream's end frames before the
            // stream was forgotten: it has everything.
            if seq == Cursor::END {
                ResumeError::StreamEnded
            } else {
                ResumeError::StreamExpired
            },
        ),
        Known::Stream(f) => {
            let standalone = f.kind == StreamKind::Standalone;
            if seq == Cursor::END && (f.ended || f.owner_gone) {
                // The client read the stream's end frames (a follower writes them there when
                // the owner is gone too): it has all the stream will carry.
                (standalone, ResumeError::StreamEnded)
            } else if seq > f.last {
                return Decision::Refuse(ResumeError::CursorAhead);
            } else if seq < f.first {
                // Not a position of this stream: it cannot have been issued with this number.
                return Decision::Refuse(ResumeError::ForeignCursor);
            } else if standalone && f.owner_gone {
                (standalone, ResumeError::StreamExpired)
            } else if f.lost_after {
                if f.unanswered {
                    return Decision::GapWithErrors;
                }
                (standalone, ResumeError::Gap)
            } else if f.ended && !f.more && !f.unanswered {
                // Nothing more will ever come on this stream. A 200 that ends at once would
                // make clients that reconnect streams ending without a result (the TypeScript
                // SDK) loop; a 409 ends their retries.
                (standalone, ResumeError::StreamEnded)
            } else {
                return Decision::Attach;
            }
        }
    };
    let (lost, reason) = match refusal {
        _ if !standalone => return Decision::Refuse(refusal),
        ResumeError::StreamEnded => (false, "stream-ended"),
        ResumeError::Gap => (true, "gap"),
        ResumeError::StreamExpired => (true, "stream-expired"),
        ResumeError::ForeignCursor | ResumeError::CursorAhead => return Decision::Refuse(refusal),
    };
    Decision::Reattach {
        cause: refusal,
        lost,
        reason,
    }
}

impl Decision {
    /// Events after the cursor were found lost: a gap answered (with errors, refused, or a
    /// standalone re-attach that says so).
    pub(crate) fn is_gap(&self) -> bool {
        matches!(
            self,
            Decision::GapWithErrors
                | Decision::Refuse(ResumeError::Gap)
                | Decision::Reattach {
                    cause: ResumeError::Gap,
                    ..
                }
        )
    }
}

/// What the fleet's store says of a stream another replica owns, in the store's own terms:
/// its meta and the bounds of its entries (an entry is one publication, named by its last
/// event's position, chained to the publication before it by `prev`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stored {
    pub kind: StreamKind,
    /// The meta's opening position.
    pub first: u64,
    /// The meta's end: the last position of the stream's last publication.
    pub end_last: Option<u64>,
    /// The last position any entry of the stream was added at (the stream's last id, which
    /// trimming does not lower); `None`: no entry was ever added.
    pub last_added: Option<u64>,
    /// The `prev` of the first entry after the cursor (`u64::MAX` for one that does not
    /// read), `None` when there is none.
    pub next_prev: Option<u64>,
    /// Its owner is gone.
    pub owner_gone: bool,
    /// The meta lists requests that the client at the cursor has no answer to.
    pub unanswered: bool,
}

impl Known {
    /// What a store's view of a stream says, seen from position `seq`.
    pub(crate) fn from_store(s: &Stored, seq: u64) -> Known {
        let last = match s.end_last {
            Some(end) => end,
            None => s.last_added.unwrap_or(s.first).max(s.first),
        };
        let lost_after = match s.next_prev {
            // A hole between the cursor and the first entry after it.
            Some(prev) => prev > seq,
            // Nothing after the cursor, yet positions after it were published: trimmed.
            None => last > seq,
        };
        Known::Stream(Facts {
            kind: s.kind,
            first: s.first,
            last,
            ended: s.end_last.is_some(),
            owner_gone: s.owner_gone,
            lost_after,
            more: s.next_prev.is_some(),
            unanswered: s.unanswered,
        })
    }
}

#[cfg(test)]
mod tests;
