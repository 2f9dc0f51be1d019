//! Coming back: a client's re-attach to a stream strictly after its cursor (a `GET` with
//! `Last-Event-ID`, or a retransmitted POST), a stale standalone cursor re-attached to the
//! session, a cursorless `GET` attached to the held standalone stream, and the in-flight
//! checks that keep a POST's request ids from being run twice or taken by another principal.

use std::sync::Arc;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::decide::{decide, Decision, Facts, Known};
use super::dedup::{verdict, IdVerdict};
use super::state::State;
use super::stream::{StreamKind, Subscriber};
use super::{control, Attachment, Principal, Reattach};
use crate::cursor::Cursor;
use crate::metrics::Metrics;

/// The answer to a resume request that the gateway can serve.
#[derive(Debug)]
pub enum Resume {
    /// Attached: the body starts with the attachment's opening (the resumed event), then
    /// replays `replay` retained events.
    Attached {
        attachment: Attachment,
        replay: usize,
    },
    /// The stream's successors of the cursor were evicted, and requests are still unanswered:
    /// the body is `frames` (a failure event and a JSON-RPC error per request), then it ends.
    GapWithErrors { frames: bytes::Bytes },
}

/// Why a resume cannot be served. Each maps to a documented response (see `docs/protocol.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResumeError {
    #[error("the cursor belongs to another session or to an earlier run of the gateway")]
    ForeignCursor,
    #[error("the cursor is ahead of what its stream has emitted")]
    CursorAhead,
    #[error("the events after the cursor were evicted from the gateway's window")]
    Gap,
    #[error("the cursor's stream is no longer retained")]
    StreamExpired,
    #[error("the cursor's stream has ended and everything after the cursor was delivered")]
    StreamEnded,
}

/// What [`Session::retransmission`](super::Session::retransmission) makes of a POST's request
/// ids.
#[derive(Debug)]
pub enum Retransmission {
    /// No retained stream carried any of them: not a retransmission.
    NotOne,
    /// Answered as a resume of the stream that carried one.
    Resumed(Resume),
    /// The client's cursor named that stream, and the resume at it was refused.
    Refused(ResumeError),
    /// Without a usable cursor the stream could not be served from its start: this id is a
    /// duplicate of one the session already ran.
    Duplicate(String),
}

/// Why [`Session::begin_forward`](super::Session::begin_forward) did not mark a POST's ids
/// forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFlight {
    /// The same principal's POST with one of the ids is in flight: wait for it
    /// ([`Session::forward_settled`](super::Session::forward_settled)), then it is a
    /// retransmission.
    Own,
    /// Another principal's request with one of the ids is in flight: refused.
    Another,
}

impl State {
    /// Whether `principal` may resume at `cursor`: a call's stream is only its sender's (the
    /// session's standalone stream is the session's, whose owner the caller was checked to
    /// be). A cursor of no stream the session retains is left to [`State::resume`] to refuse.
    pub(super) fn may_resume(&self, cursor: &Cursor, principal: Principal) -> bool {
        cursor.epoch != self.consts.epoch
            || self
                .streams
                .get(&cursor.stream)
                .is_none_or(|s| s.kind == StreamKind::Standalone || s.principal == principal)
    }

    /// What is known here of `cursor`'s stream, seen from its position (see [`decide`]).
    fn known(&self, cursor: &Cursor) -> Known {
        if cursor.epoch != self.consts.epoch {
            return Known::NotIssued;
        }
        let seq = cursor.seq;
        match self.streams.get(&cursor.stream) {
            Some(s) => Known::Stream(Facts {
                kind: s.kind,
                first: s.first_seq,
                last: s.last_seq,
                ended: s.end.is_some(),
                // This replica is the owner.
                owner_gone: false,
                lost_after: s.lost_upto > seq,
                // Asked of an ended stream only (see `Facts::more`): a resume's hot path
                // does not look for it twice.
                more: s.end.is_some()
                    && (self.window.after(cursor.stream, seq).next().is_some()
                        || s.overflow.as_ref().is_some_and(|o| o.seq > seq)),
                unanswered: s.unanswered_after(seq).next().is_some(),
            }),
            None if cursor.stream < self.next_stream => Known::Forgotten {
                standalone: self.standalone_history.contains(&cursor.stream),
            },
            None => Known::NotIssued,
        }
    }

    /// Re-attaches a client to the stream of `cursor` (a `GET` with `Last-Event-ID`), as
    /// [`decide`] says. A standalone cursor it re-attaches to the session is refused here with
    /// what a call's cursor would get; [`State::standalone_reattach`] says how it re-attaches.
    pub(super) fn resume(
        &mut self,
        metrics: &Metrics,
        cursor: Cursor,
        kill: Option<Arc<Notify>>,
        now: Instant,
    ) -> Result<Resume, ResumeError> {
        if cursor.epoch != self.consts.epoch {
            return Err(ResumeError::ForeignCursor);
        }
        self.last_activity = now;
        let decision = decide(&cursor, self.consts.epoch, &self.known(&cursor));
        let Some(s) = self.streams.get_mut(&cursor.stream) else {
            return match decision {
                Decision::Refuse(e) | Decision::Reattach { cause: e, .. } => Err(e),
                // Nothing is attached to a stream this replica does not hold.
                Decision::Attach | Decision::GapWithErrors => Err(ResumeError::StreamExpired),
            };
        };
        if decision.is_gap() {
            // Events written to the client and lost on its way (past the in-flight reserve,
            // in its own buffers) were not counted as undelivered when evicted: they are now.
            let lost = s.lost_in_flight(cursor.seq);
            metrics.events_evicted_undelivered.inc_by(lost);
        }
        match decision {
            Decision::Refuse(e) | Decision::Reattach { cause: e, .. } => return Err(e),
            Decision::GapWithErrors => {
                let here = self.consts.cursor(cursor.stream, cursor.seq);
                let ids = s.fail_unanswered(cursor.seq);
                return Ok(Resume::GapWithErrors {
                    frames: control::gap(&here, true, &ids),
                });
            }
            Decision::Attach => {}
        }
        let here = self.consts.cursor(cursor.stream, cursor.seq);
        let replay = self.window.after(cursor.stream, cursor.seq).count()
            + usize::from(s.overflow.as_ref().is_some_and(|o| o.seq > cursor.seq));
        let generation = self.next_generation;
        self.next_generation += 1;
        metrics.streams_attached.inc();
        metrics.events_replayed.inc_by(replay as u64);
        // The client says where it is: everything after the cursor is needed again, and
        // nothing of this stream is in flight any more.
        s.acked = cursor.seq;
        s.stall_since = Some(now);
        s.awaiting_client = false;
        if let Some(old) = s
            .sub
            .replace(Subscriber::new(generation, cursor.seq, kill, true))
        {
            if let Some(w) = old.waker {
                w.wake();
            }
        }
        let prelude = control::resumed(&here, cursor.stream, s.kind, replay, s.end.is_some());
        self.stir();
        self.inflight.forget(cursor.stream);
        Ok(Resume::Attached {
            attachment: Attachment {
                stream: cursor.stream,
                generation,
                opening: Some(prelude),
            },
            replay,
        })
    }

    /// A standalone-stream cursor that [`State::resume`] refused: when the session outlives
    /// that stream (it ended, was forgotten, or lost the events after the cursor), the client
    /// re-attaches to the session instead (see [`Reattach`]), as [`decide`] says. `None` when
    /// the cursor is not a standalone cursor of this session, or the refusal stands.
    pub(super) fn standalone_reattach(&self, cursor: &Cursor) -> Option<Reattach> {
        match decide(cursor, self.consts.epoch, &self.known(cursor)) {
            Decision::Reattach { lost, reason, .. } => Some(Reattach {
                previous: cursor.to_string(),
                lost,
                reason,
            }),
            Decision::Attach | Decision::GapWithErrors | Decision::Refuse(_) => None,
        }
    }

    /// Marks a POST of `principal` carrying `ids` as forwarded (until
    /// [`State::settle_forward`]). [`InFlight::Own`] while a POST of the same principal
    /// carrying one of `ids` is still in flight; [`InFlight::Another`] while one of `ids` is
    /// in flight for another principal (being forwarded, or carried by a stream still waiting
    /// for its answer): upstreams route answers by request id within a session, so the later
    /// POST would take the earlier's answer.
    pub(super) fn begin_forward(
        &mut self,
        principal: Principal,
        ids: &[String],
    ) -> Result<(), InFlight> {
        match self.id_verdict(principal, ids) {
            IdVerdict::Another => return Err(InFlight::Another),
            IdVerdict::Wait => return Err(InFlight::Own),
            IdVerdict::Free | IdVerdict::Carried(_) => {}
        }
        if !self.forwarded.begin(principal, ids) {
            return Err(InFlight::Own);
        }
        Ok(())
    }

    /// What a POST of `principal` carrying `ids` may do, by the rule the fleet's store keeps
    /// too ([`verdict`]): every holder of each id known here, the strictest verdict.
    pub(super) fn id_verdict(&self, principal: Principal, ids: &[String]) -> IdVerdict {
        ids.iter()
            .flat_map(|id| {
                self.forwarded
                    .holders(id)
                    .chain(self.carried.holders(&self.streams, id))
            })
            .map(|h| verdict(Some(h), principal))
            .max()
            .unwrap_or(IdVerdict::Free)
    }

    /// A forwarded POST's `ids` are no longer in flight.
    pub(super) fn settle_forward(&mut self, principal: Principal, ids: &[String]) {
        self.forwarded.settle(principal, ids);
    }

    /// Whether a POST of `principal` carrying one of `ids` is in flight.
    pub(super) fn forwarding(&self, principal: Principal, ids: &[String]) -> bool {
        self.forwarded.any(principal, ids)
    }

    /// Whether `principal` already sent one of `ids` in this session: a retained stream was
    /// started by its POST carrying one, or a forgotten one was.
    pub(super) fn carries_any(&self, principal: Principal, ids: &[String]) -> bool {
        self.carried
            .carrier(&self.streams, principal, ids)
            .is_some()
            || self.retired.find(principal, ids).is_some()
    }

    /// A POST whose request ids include one already carried by a retained stream of this
    /// session is a retransmission (MCP forbids reusing an id within a session): it is
    /// answered as a resume of that stream, never forwarded. With `cursor` naming that
    /// stream the resume is exact; without a usable cursor it starts at the stream's opening
    /// position, which is only served if nothing of the stream was lost (see
    /// [`Retransmission`]).
    pub(super) fn retransmission(
        &mut self,
        metrics: &Metrics,
        principal: Principal,
        ids: &[String],
        cursor: Option<Cursor>,
        kill: Option<Arc<Notify>>,
        now: Instant,
    ) -> Retransmission {
        let carrier = match self.carried.carrier(&self.streams, principal, ids) {
            Some(c) => c,
            // Its stream is forgotten: refused, never run twice.
            None => match self.retired.find(principal, ids) {
                Some(dup) => return Retransmission::Duplicate(dup.to_owned()),
                None => return Retransmission::NotOne,
            },
        };
        let epoch = self.consts.epoch;
        let exact = cursor.filter(|c| c.epoch == epoch && c.stream == carrier.stream);
        let at = exact.unwrap_or(Cursor {
            epoch,
            stream: carrier.stream,
            seq: carrier.first_seq,
        });
        match self.resume(metrics, at, kill, now) {
            Ok(r) => Retransmission::Resumed(r),
            Err(e) if exact.is_some() => Retransmission::Refused(e),
            Err(_) => Retransmission::Duplicate(carrier.id.to_owned()),
        }
    }

    /// Attaches a client without a cursor to the held standalone stream, replacing any
    /// older client: it gets every retained event of the stream that was never written to a
    /// client (server messages sent before its `GET` arrived, or while no client was
    /// attached), then the live tail. The first event is the priming event (if `prime`) or,
    /// for a client re-attaching with a stale cursor, the control event saying so. Returns
    /// `None` when no standalone stream is held.
    pub(super) fn attach_standalone(
        &mut self,
        metrics: &Metrics,
        prime: bool,
        reattach: Option<&Reattach>,
        kill: Option<Arc<Notify>>,
        now: Instant,
    ) -> Option<Attachment> {
        self.last_activity = now;
        let stream = self.standalone?;
        let s = self.streams.get_mut(&stream)?;
        if s.end.is_some() {
            return None;
        }
        // A held stream the upstream ended before any client came, with messages on it: they
        // are gone with it. Say so (once) instead of opening as if nothing was missed.
        let mut orphaned = None;
        for (&n, o) in self.streams.iter_mut() {
            if o.kind == StreamKind::Standalone
                && o.end.is_some()
                && o.awaiting_client
                && o.last_seq > o.first_seq
            {
                o.awaiting_client = false;
                orphaned = Some(Reattach {
                    previous: self.consts.cursor(n, o.first_seq),
                    lost: true,
                    reason: "standalone-ended-unread",
                });
            }
        }
        let reattach = reattach.or(orphaned.as_ref());
        let s = self.streams.get_mut(&stream)?;
        let generation = self.next_generation;
        self.next_generation += 1;
        // What some client was already sent is not sent again; the new client is the
        // stream's client now, so nothing before that is held back for anyone any more.
        let at = s.sent;
        metrics.streams_attached.inc();
        s.awaiting_client = false;
        s.acked = s.acked.max(at);
        s.stall_since = (s.last_seq > at).then_some(now);
        let has_id = prime || reattach.is_some();
        if let Some(old) = s.sub.replace(Subscriber::new(generation, at, kill, has_id)) {
            if let Some(w) = old.waker {
                w.wake();
            }
        }
        self.stir();
        Some(Attachment {
            stream,
            generation,
            opening: self.consts.opening_event(stream, at, prime, reattach),
        })
    }
}
