//! The upgrade route (`--json-upgrade`): a legacy POST carrying requests, from a client that
//! accepts SSE, is answered with a tagged SSE stream of the gateway's whatever the upstream
//! answers with, so a cut during the call is an ordinary re-attach even in front of a server
//! that answers with JSON.
//!
//! Into a known session the upstream gets `--upgrade-grace` to answer: an answer within it
//! is served as on the forward route (an error keeps its status, an SSE stream is tagged, a
//! JSON body becomes the stream's events). Past it the gateway commits: the client gets the
//! stream at once (an id first, keep-alives), and the answer, when it comes, is fed into it
//! by a task of its own (`feed::answer_to_come`).
//!
//! Knows the upstream client and the session API; what the answer becomes lives in `feed`.

use std::sync::Arc;

use http::{HeaderMap, Response, StatusCode};

use super::forward::{Prepared, Ready};
use super::inbound::Inbound;
use super::{Gateway, ResBody};
use crate::attach::AttachBody;
use crate::config::ResumeAuth;
use crate::error::{ProxyError, Refusal};
use crate::feed::{self, Answer, Upgraded};
use crate::session::{OpenStream, Session, StreamKind};

impl Gateway {
    /// [`Route::Upgrade`](super::inbound::Route::Upgrade).
    pub(super) async fn upgrade(
        &self,
        mut inb: Box<Inbound>,
        session: Option<Arc<Session>>,
    ) -> Result<Response<ResBody>, Refusal> {
        let Ready {
            reservation,
            _forwarding,
            _claimed,
        } = match self.ready(&mut inb, &session).await? {
            Prepared::Ready(r) => r,
            Prepared::Retransmission(s) => return Box::pin(self.retransmission(inb, s)).await,
            Prepared::Elsewhere(s, stream) => {
                return Box::pin(self.retransmitted_elsewhere(inb, s, stream)).await
            }
        };
        let Some(s) = session.clone() else {
            // No session yet (an `initialize`): the stream needs the session the answer
            // names, so the gateway waits for it.
            let resp = self.send(&mut inb).await?;
            return self.answered(inb, None, resp, reservation, None).await;
        };
        let mut answer = self.answer(&mut inb);
        match tokio::time::timeout(self.cfg.upgrade_grace, &mut answer).await {
            Ok(Ok(resp)) => self.answered(inb, session, resp, reservation, None).await,
            Ok(Err(e)) => Err(ProxyError::upstream(e).for_request(inb.info.single_id.clone())),
            Err(_) => {
                let answer: Answer =
                    Box::pin(async move { answer.await.map_err(|e| e.to_string()) });
                Ok(self.commit(inb, s, None, Upgraded::ToCome(answer)))
            }
        }
    }

    /// Answers `inb` with a new tagged stream of `session` now, and feeds the upstream's
    /// answer into it: a JSON body already whole at once, else when it comes.
    /// `upstream_headers`: the answer's headers, when it is already here (its events then
    /// follow at once, each with an id, so the stream needs no opening event of its own
    /// beyond priming).
    pub(super) fn commit(
        &self,
        mut inb: Box<Inbound>,
        session: Arc<Session>,
        upstream_headers: Option<HeaderMap>,
        feed: Upgraded,
    ) -> Response<ResBody> {
        // Only an answer still to come is read by a task that may reopen its stream upstream.
        let source = matches!(feed, Upgraded::ToCome(_)).then(|| inb.take_source(&self.upstream));
        let version = inb
            .header_version
            .clone()
            .or_else(|| inb.info.version.clone())
            .or_else(|| session.protocol_version());
        // Committed before the answer, the client must hold an id before anything else: it
        // resumes only a stream that gave it one.
        let announce = upstream_headers.is_none();
        let open = OpenStream {
            kind: StreamKind::Post,
            requests: inb.info.request_ids,
            principal: inb.principal,
            initialize: inb.info.initialize,
            prime: self.prime(version.as_deref()),
            announce,
            reattach: None,
            kill: Some(inb.kill),
            trace: crate::telemetry::current(),
        };
        let answer = match feed {
            // The usual answer: its stream is served whole, with its length.
            Upgraded::Whole(body) => {
                let max = self.cfg.max_event_bytes;
                let whole = feed::json(&self.registry, &session, open, &body, max);
                return self.whole_response(
                    &inb.facts,
                    StatusCode::OK,
                    upstream_headers,
                    session,
                    whole,
                );
            }
            Upgraded::ToCome(answer) => answer,
        };
        // The upstream's 404 ends the session only when the request was the session's own.
        let own = !session.minted()
            && inb.authorized.unwrap_or_else(|| {
                self.cfg.resume_auth == ResumeAuth::None || session.principal() == inb.principal
            });
        let source = source.expect("taken for an answer to come");
        let attachment = feed::answer_to_come(&self.registry, &session, open, answer, source, own);
        let s = session.clone();
        let body = AttachBody::new(session, attachment, self.cfg.keepalive);
        self.sse_response(&inb.facts, StatusCode::OK, upstream_headers, s.id(), body)
    }
}
