//! The live-attach route: a legacy `GET` of a known session attaches to the standalone
//! stream the gateway holds for it (starting or kicking the session's holder when it holds
//! none), and is forwarded only when no stream can be held.
//!
//! Knows the session's standalone API and the holder's entry points; nothing of how the
//! stream is read.

use std::sync::Arc;

use http::{Response, StatusCode};

use super::inbound::Inbound;
use super::{Gateway, ResBody};
use crate::attach::AttachBody;
use crate::error::Refusal;
use crate::feed;
use crate::metrics::ResumeOutcome;
use crate::session::{Reattach, Session};

impl Gateway {
    /// [`Route::Attach`](super::inbound::Route::Attach), and a standalone cursor that
    /// re-attaches to the session (`reattach`): the client gets the held stream's events
    /// never written to a client, then the live tail.
    pub(super) async fn attach(
        &self,
        mut inb: Box<Inbound>,
        session: Option<Arc<Session>>,
        reattach: Option<Reattach>,
    ) -> Result<Response<ResBody>, Refusal> {
        let Some(s) = session else {
            return self.forward(inb, None, reattach).await;
        };
        // The gateway may be opening the stream it holds for this client; if it holds none,
        // it opens one now (the client's own GET is forwarded only when that fails, so the
        // upstream's answer reaches the client).
        s.hold_settled(self.cfg.upstream_connect_timeout).await;
        if let Some(followed) = self
            .follow_held_elsewhere(&mut inb, &s, reattach.as_ref())
            .await
        {
            return Ok(followed);
        }
        // A minted session's upstream is stateless: it has no standalone stream to hold.
        if self.cfg.hold_standalone
            && !s.minted()
            && !s.has_standalone()
            && self.authorized(&mut inb, &s).await
        {
            feed::hold(&self.registry, &s, || inb.source(&self.upstream));
            s.hold_attempts_settled(feed::hold_settle_limit(self.cfg.upstream_header_timeout))
                .await;
            if !s.has_standalone() {
                // The upstream refused a stream to this replica: another may have opened one
                // meanwhile (the fleet learns of it just after), which the client follows.
                if let Some(followed) = self
                    .follow_held_elsewhere(&mut inb, &s, reattach.as_ref())
                    .await
                {
                    return Ok(followed);
                }
            }
        }
        if s.has_standalone() && self.authorized(&mut inb, &s).await {
            let version = inb.header_version.clone().or_else(|| s.protocol_version());
            let prime = self.prime(version.as_deref());
            if let Some(attachment) =
                s.attach_standalone(prime, reattach.as_ref(), Some(inb.kill.clone()))
            {
                if reattach.is_some() {
                    self.registry.metrics().resume(ResumeOutcome::Reattached);
                }
                tracing::debug!(mcp.session = %s.hashed_id(), mcp.stream = attachment.stream, "attached live to held standalone stream");
                let body = AttachBody::new(s.clone(), attachment, self.cfg.keepalive);
                return Ok(self.sse_response(&inb.facts, StatusCode::OK, None, s.id(), body));
            }
        }
        self.forward(inb, Some(s), reattach).await
    }

    /// With the fleet's store: the client follows the session's standalone stream another
    /// replica holds, from its opening, when this replica holds none and the store names one.
    async fn follow_held_elsewhere(
        &self,
        inb: &mut Inbound,
        s: &Arc<Session>,
        reattach: Option<&Reattach>,
    ) -> Option<Response<ResBody>> {
        if !self.store.is_on() || s.has_standalone() || !self.authorized(inb, s).await {
            return None;
        }
        let stream = self.store.held_elsewhere(s).await?;
        let from = crate::cursor::Cursor {
            epoch: s.epoch(),
            stream,
            seq: 0,
        };
        let charge = self.registry.budget().charge();
        // A live attach from the stream's opening: always followed (it is no resume).
        let crate::store::Followed::Body(body, _) = self
            .store
            .follow(
                s,
                from,
                crate::store::Start::Opening,
                None,
                reattach,
                charge,
            )
            .await
            .ok()?
        else {
            return None;
        };
        if reattach.is_some() {
            self.registry.metrics().resume(ResumeOutcome::Reattached);
        }
        tracing::debug!(mcp.session = %s.hashed_id(), mcp.stream = stream, "attached live to the standalone stream another replica holds");
        Some(self.followed_response(s.id(), body))
    }
}
