//! The routes answered from retained streams, never forwarded: a resume (`GET` with
//! `Last-Event-ID`) and a retransmission (a POST repeating a request id a retained stream
//! carried).
//!
//! Knows the session's resume API; the rules of what is replayed live in `session`.

use std::sync::Arc;

use http::{Response, StatusCode};

use super::inbound::Inbound;
use super::respond::sse_headers;
use super::{Gateway, ResBody};
use crate::attach::AttachBody;
use crate::config::ResumeAuth;
use crate::cursor::Cursor;
use crate::error::{ProxyError, Refusal};
use crate::metrics::ResumeOutcome;
use crate::session::{Resume, Retransmission, Session};
use crate::store::{FollowError, Followed, Start};
use crate::upstream::full_body;

impl Gateway {
    /// [`Route::Resume`](super::inbound::Route::Resume): re-attaches the client at its
    /// cursor. A standalone cursor that cannot be resumed exactly re-attaches to the
    /// session's standalone stream instead ([`Gateway::attach`]).
    pub(super) async fn resume(
        &self,
        mut inb: Box<Inbound>,
        session: Option<Arc<Session>>,
    ) -> Result<Response<ResBody>, Refusal> {
        let session = session.ok_or(ProxyError::UnknownSession)?;
        if !self.authorized(&mut inb, &session).await {
            // Exactly the answer for an unknown session: a caller who may not resume learns
            // nothing, not even that the session exists.
            self.registry.metrics().resume(ResumeOutcome::Unauthorized);
            if let Some(suppressed) = self.refused_warn.allow() {
                tracing::warn!(mcp.session = %session.hashed_id(), suppressed, "resume refused: principal mismatch");
            }
            return Err(ProxyError::UnknownSession.into());
        }
        let raw = inb.cursor().map(|c| c.as_bytes()).unwrap_or_default();
        let cursor = Cursor::parse(raw).map_err(ProxyError::MalformedCursor)?;
        if self.cfg.resume_auth != ResumeAuth::None && !session.may_resume(&cursor, inb.principal) {
            // Another principal's call in the session: answered as for an unknown session.
            self.registry.metrics().resume(ResumeOutcome::Unauthorized);
            return Err(ProxyError::UnknownSession.into());
        }
        if self.store.is_on()
            && cursor.epoch == session.epoch()
            && (!session.holds_stream(cursor.stream) || self.store.fenced(&session, cursor.stream))
        {
            // Another replica's stream, perhaps: served from the fleet's store if it is there.
            // So is one of this replica's own that its lease no longer covers: the fleet
            // decided its end, and every replica answers it alike.
            let who = (self.cfg.resume_auth != ResumeAuth::None).then_some(inb.principal);
            let charge = self.registry.budget().charge();
            match self
                .store
                .follow(&session, cursor, Start::After, who, None, charge)
                .await
            {
                Ok(Followed::Body(body, replay)) => {
                    self.registry.metrics().resume(ResumeOutcome::Resumed);
                    tracing::debug!(mcp.session = %session.hashed_id(), mcp.stream = cursor.stream, replay, "resumed from the fleet's store");
                    return Ok(self.followed_response(session.id(), body));
                }
                Ok(Followed::Gap(frames)) => {
                    self.registry.metrics().resume(ResumeOutcome::Gap);
                    return Ok(self.gap_response(session.id(), frames));
                }
                Err(FollowError::NotTheCallers) => {
                    self.registry.metrics().resume(ResumeOutcome::Unauthorized);
                    return Err(ProxyError::UnknownSession.into());
                }
                Err(FollowError::Refused(e)) => {
                    return Err(ProxyError::Resume(e).into());
                }
                Err(FollowError::Reattach { lost, reason }) => {
                    // As for a standalone stream of its own: the client re-attaches to the
                    // session (wherever its standalone stream is held now).
                    let r = crate::session::Reattach {
                        previous: cursor.to_string(),
                        lost,
                        reason,
                    };
                    return Box::pin(self.attach(inb, Some(session), Some(r))).await;
                }
                Err(FollowError::Unanswered) => {
                    // Not told apart from a stream the store does not have, the answer would be
                    // a false `stream-expired`: the client comes back instead.
                    return Err(ProxyError::StoreUnanswered.into());
                }
                Err(FollowError::NotInStore) => {}
            }
        }
        if let Some(opened) = crate::telemetry::enabled()
            .then(|| session.stream_trace(cursor.stream))
            .flatten()
        {
            // The resume belongs to the trace of the call it continues.
            let own = inb.parts.headers.contains_key("traceparent");
            crate::telemetry::join(&tracing::Span::current(), opened, own);
        }
        match session.resume(cursor, Some(inb.kill.clone())) {
            Ok(r) => Ok(self.resumed(&inb.facts, session, r, ResumeOutcome::Resumed)),
            Err(e) => match session.standalone_reattach(&cursor) {
                Some(r) => {
                    tracing::debug!(mcp.session = %session.hashed_id(), reason = r.reason, "standalone cursor re-attaches to the session");
                    self.attach(inb, Some(session), Some(r)).await
                }
                None => Err(ProxyError::Resume(e).into()),
            },
        }
    }

    /// [`Route::Retransmission`](super::inbound::Route::Retransmission): answered as a
    /// resume of the stream that carried the request (exact with a `Last-Event-ID` of that
    /// stream, from the stream's start without one). Forwarded after all when that stream
    /// has gone since the request was classified.
    pub(super) async fn retransmission(
        &self,
        mut inb: Box<Inbound>,
        session: Arc<Session>,
    ) -> Result<Response<ResBody>, Refusal> {
        let single_id = inb.info.single_id.clone();
        self.note_request(&inb, &session);
        if !self.authorized(&mut inb, &session).await {
            self.registry.metrics().resume(ResumeOutcome::Unauthorized);
            return Err(ProxyError::UnknownSession.for_request(single_id));
        }
        // A cursor that does not parse is as good as none: the duplicate id decides.
        let cursor = inb.cursor().and_then(|c| Cursor::parse(c.as_bytes()).ok());
        let kill = Some(inb.kill.clone());
        let found = match session.retransmission(inb.principal, &inb.info.request_ids, cursor, kill)
        {
            Retransmission::NotOne => return self.forward(inb, Some(session), None).await,
            Retransmission::Resumed(r) => Ok(r),
            Retransmission::Refused(e) => Err(ProxyError::Resume(e)),
            Retransmission::Duplicate(dup) => Err(ProxyError::DuplicateRequest(dup)),
        };
        tracing::info!(mcp.session = %session.hashed_id(), "retransmitted request answered as a resume");
        found
            .map(|r| self.resumed(&inb.facts, session, r, ResumeOutcome::Retransmission))
            .map_err(|e| e.for_request(single_id))
    }

    /// A retransmission whose ids a stream of another replica carries (the fleet's store):
    /// answered as a resume of that stream from its opening, served from the store, never
    /// forwarded a second time. A stream the store no longer has is the duplicate's refusal.
    pub(super) async fn retransmitted_elsewhere(
        &self,
        inb: Box<Inbound>,
        session: Arc<Session>,
        stream: u32,
    ) -> Result<Response<ResBody>, Refusal> {
        let single_id = inb.info.single_id.clone();
        // Exact with the client's cursor of that stream, as on the replica that holds it;
        // else from the stream's opening, whatever it is.
        let exact = inb
            .cursor()
            .and_then(|c| Cursor::parse(c.as_bytes()).ok())
            .filter(|c| c.epoch == session.epoch() && c.stream == stream);
        let (from, start) = match exact {
            Some(c) => (c, Start::After),
            None => (
                Cursor {
                    epoch: session.epoch(),
                    stream,
                    seq: 0,
                },
                Start::Opening,
            ),
        };
        let charge = self.registry.budget().charge();
        match self
            .store
            .follow(&session, from, start, Some(inb.principal), None, charge)
            .await
        {
            Ok(Followed::Body(body, replay)) => {
                self.registry
                    .metrics()
                    .resume(ResumeOutcome::Retransmission);
                tracing::info!(mcp.session = %session.hashed_id(), mcp.stream = stream, replay, "retransmitted request answered as a resume from the fleet's store");
                Ok(self.followed_response(session.id(), body))
            }
            Ok(Followed::Gap(frames)) => {
                // As on the owner: the stream lost events, its requests get their errors.
                self.registry.metrics().resume(ResumeOutcome::Gap);
                Ok(self.gap_response(session.id(), frames))
            }
            Err(_) => {
                let id = single_id
                    .as_ref()
                    .map_or_else(|| inb.info.request_ids.join(", "), ToString::to_string);
                Err(ProxyError::DuplicateRequest(id).for_request(single_id))
            }
        }
    }

    /// The response to a resume the session accepted.
    fn resumed(
        &self,
        facts: &super::Facts,
        session: Arc<Session>,
        r: Resume,
        outcome: ResumeOutcome,
    ) -> Response<ResBody> {
        match r {
            Resume::Attached { attachment, replay } => {
                self.registry.metrics().resume(outcome);
                tracing::debug!(mcp.session = %session.hashed_id(), mcp.stream = attachment.stream, replay, "resumed");
                let body = AttachBody::new(session.clone(), attachment, self.cfg.keepalive)
                    .with_replayed(replay);
                self.sse_response(facts, StatusCode::OK, None, session.id(), body)
            }
            Resume::GapWithErrors { frames } => {
                self.registry.metrics().resume(ResumeOutcome::Gap);
                self.gap_response(session.id(), frames)
            }
        }
    }

    /// The explicit gap's whole body (held or followed from the store).
    fn gap_response(&self, session_id: &str, frames: bytes::Bytes) -> Response<ResBody> {
        let mut resp = Response::new(full_body(frames));
        sse_headers(resp.headers_mut(), session_id);
        resp
    }
}
