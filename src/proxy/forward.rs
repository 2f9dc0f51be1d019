//! The forwarding routes: pass-through (modern era) and forward-and-tag (every other legacy
//! request), as a flat sequence of steps: reserve a place under the session cap, claim the
//! request ids, send, evict on the upstream's answer, adopt the answered session (minting
//! one for a stateless upstream), hold the standalone stream once the session is
//! initialized, tag an SSE answer. And the end of a minted session (`DELETE`), which is the
//! gateway's alone.
//!
//! Knows the upstream client and the session API; the rules of tagging live in `session`.

use std::sync::Arc;

use http::{Method, Response, StatusCode};
use tracing::Instrument;

use super::fleet::FleetClaim;
use super::inbound::Inbound;
use super::respond::{minted_header, pass_through};
use super::{is_visible_ascii, Gateway, ResBody, MCP_SESSION_ID};
use crate::attach::AttachBody;
use crate::config::ResumeAuth;
use crate::error::{ProxyError, Refusal};
use crate::feed::{self, Answer, Fed, Upgraded};
use crate::metrics::ResumeOutcome;
use crate::session::{
    Eviction, Forwarding, InFlight, OpenStream, Owner, Reattach, Reservation, Session, StreamKind,
};
use crate::store::IdsHeld;
use crate::upstream::{full_body, media, Media, OwnBody, SendError, Source};

/// A request on its way upstream: its answer, once polled to the end.
pub(super) type Pending = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Response<OwnBody>, SendError>> + Send>,
>;

/// A legacy request ready to be sent ([`Gateway::ready`]).
pub(super) struct Ready {
    /// An `initialize`'s place under `--max-sessions`.
    pub reservation: Option<Reservation>,
    /// Held until this request's stream opened (or it ended otherwise): a retransmission
    /// arriving meanwhile waits for it instead of being forwarded a second time.
    pub _forwarding: Option<Forwarding>,
    /// The same in the fleet's store: a retransmission reaching another replica waits for
    /// this request's stream and is answered from it.
    pub _claimed: Option<IdsHeld>,
}

/// Whether the upstream's answer with `status` to `inb` ends `session` at the gateway: its 404
/// for the session, or a successful `DELETE` (if the request was the session's own:
/// [`Gateway::evict_on_answer`]). A minted session's upstream never knew it: its answers
/// cannot end it.
fn eviction(inb: &Inbound, session: &Session, status: StatusCode) -> Option<Eviction> {
    if session.minted() {
        None
    } else if status == StatusCode::NOT_FOUND {
        Some(Eviction::Upstream404)
    } else if inb.parts.method == Method::DELETE && status.is_success() {
        Some(Eviction::Delete)
    } else {
        None
    }
}

/// What [`Gateway::ready`] made of a request. Built once per request and taken apart at
/// once, so the large variant stays unboxed (no allocation per request).
#[allow(clippy::large_enum_variant)]
pub(super) enum Prepared {
    Ready(Ready),
    /// One of its ids is carried by a retained stream now: a retransmission after all.
    Retransmission(Arc<Session>),
    /// One of its ids is carried by this stream of another replica (the fleet's store): a
    /// retransmission, answered from the store.
    Elsewhere(Arc<Session>, u32),
}

/// What the request ids of a POST into a known session turned out to be.
enum Claim {
    /// Forward: the ids are this request's until the guard drops (none to claim: `None`).
    Forward(Option<Forwarding>),
    /// A retained stream carries one of them now: a retransmission after all.
    Retransmission,
    /// One of them is in flight for another principal: never forwarded for this one.
    InFlight,
}

/// The refusal of a POST one of whose ids another principal's request holds in flight.
pub(super) fn in_flight(single_id: Option<&serde_json::Value>, ids: &[String]) -> ProxyError {
    let id = single_id.map_or_else(|| ids.join(", "), ToString::to_string);
    ProxyError::RequestInFlight(id)
}

impl Gateway {
    /// [`Route::PassThrough`](super::inbound::Route::PassThrough): the modern era is the
    /// upstream's; the gateway only forwards.
    pub(super) async fn pass_through(
        &self,
        mut inb: Box<Inbound>,
    ) -> Result<Response<ResBody>, Refusal> {
        let resp = self.send(&mut inb).await?;
        Ok(pass_through(resp))
    }

    /// [`Route::Forward`](super::inbound::Route::Forward), and the live-attach route when no
    /// stream can be held: forwards the request, tags an SSE answer of a POST or GET.
    pub(super) async fn forward(
        &self,
        mut inb: Box<Inbound>,
        session: Option<Arc<Session>>,
        reattach: Option<Reattach>,
    ) -> Result<Response<ResBody>, Refusal> {
        let Ready {
            reservation,
            _forwarding,
            _claimed,
        } = match self.ready(&mut inb, &session).await? {
            Prepared::Ready(r) => r,
            // Rare (the first POST was in flight); boxed, as the routes then call each other.
            Prepared::Retransmission(s) => return Box::pin(self.retransmission(inb, s)).await,
            Prepared::Elsewhere(s, stream) => {
                return Box::pin(self.retransmitted_elsewhere(inb, s, stream)).await
            }
        };
        let resp = self.send(&mut inb).await?;
        self.answered(inb, session, resp, reservation, reattach)
            .await
    }

    /// What follows the upstream's answer `resp` to `inb` (asked in `session`, if known):
    /// the session ends on its 404 or DELETE, the session it creates is adopted (minted for a
    /// stateless upstream), the standalone stream held once initialized, and an SSE answer
    /// tagged (with `--json-upgrade`, a JSON answer becomes a tagged stream too).
    pub(super) async fn answered(
        &self,
        mut inb: Box<Inbound>,
        session: Option<Arc<Session>>,
        mut resp: Response<OwnBody>,
        reservation: Option<Reservation>,
        reattach: Option<Reattach>,
    ) -> Result<Response<ResBody>, Refusal> {
        if let Some((s, why)) = session
            .as_ref()
            .and_then(|s| Some((s, eviction(&inb, s, resp.status())?)))
        {
            // Rare, and its future (an upstream exchange when auth asks the upstream) is
            // large: boxed, so every answer's future is not as large as this one's.
            Box::pin(self.evict_on_answer(&mut inb, s, why)).await;
        }
        let known = session.as_ref().map(|s| Arc::as_ptr(s) as usize);
        let Some(session) = self.answered_session(&inb, &mut resp, session, reservation) else {
            return Ok(pass_through(resp));
        };
        if let Some(v) = inb
            .header_version
            .as_deref()
            .or(inb.info.version.as_deref())
        {
            session.set_protocol_version(v);
        }
        if known != Some(Arc::as_ptr(&session) as usize) && inb.info.initialize {
            // Created now: in the fleet's store before its client hears of it.
            Box::pin(self.store.created(&session)).await;
        }
        let initialized = inb.info.initialized && inb.parts.method == Method::POST;
        if self.hold_once_initialized(initialized, &session, || inb.source(&self.upstream)) {
            session
                .hold_settled(self.cfg.upstream_connect_timeout)
                .await;
        }
        let media = if resp.status() == StatusCode::OK {
            media(resp.headers())
        } else {
            Media::Other
        };
        let mut early = resp.body().has_early();
        let tagged =
            if media == Media::Sse && matches!(inb.parts.method, Method::POST | Method::GET) {
                let (tagged, reading) = self.tag(inb, session, resp, reattach);
                early &= reading;
                tagged
            } else if media == Media::Json && inb.upgrade {
                let (parts, mut body) = resp.into_parts();
                let feed = match body.take_whole() {
                    // Its events are in the stream before its head is written: nothing to wait for.
                    Some(whole) => {
                        early = false;
                        Upgraded::Whole(whole)
                    }
                    None => {
                        let answer: Answer = Box::pin(std::future::ready(Ok(
                            Response::from_parts(parts.clone(), body),
                        )));
                        Upgraded::ToCome(answer)
                    }
                };
                self.commit(inb, session, Some(parts.headers), feed)
            } else {
                let mut out = pass_through(resp);
                if session.minted() {
                    minted_header(out.headers_mut(), &session);
                }
                return Ok(out);
            };
        if early {
            // The answer's first bytes came with its head: one turn for the stream's reader
            // (just spawned, it runs next) to take them before the connection writes the
            // head, so the head, those events and often the end go out in one write, not two.
            tokio::task::yield_now().await;
        }
        Ok(tagged)
    }

    /// An `initialize` without a session takes a place under `--max-sessions` before it is
    /// forwarded: at the cap it is refused, not forwarded.
    fn reserve(&self, inb: &Inbound) -> Result<Option<Reservation>, Refusal> {
        if !inb.info.initialize || inb.sid.is_some() {
            return Ok(None);
        }
        let single_id = || inb.info.single_id.clone();
        let r = self.registry.reserve(inb.share);
        r.map(Some)
            .map_err(|e| ProxyError::AtCapacity(e).for_request(single_id()))
    }

    /// The steps before a legacy request is sent: a place under the cap for an `initialize`,
    /// the request ids claimed in its session (or it turns out to be a retransmission), its
    /// legacy cursor dropped, and the recipe to reopen its stream.
    pub(super) async fn ready(
        &self,
        inb: &mut Inbound,
        session: &Option<Arc<Session>>,
    ) -> Result<Prepared, Refusal> {
        let reservation = self.reserve(inb)?;
        let mut claimed = None;
        let forwarding = match session {
            None => None,
            Some(s) => match self.claim(inb, s).await {
                Claim::Forward(None) => None,
                Claim::Forward(Some(f)) => {
                    // Each call whose client left holds an upstream connection: one session
                    // may not pile them up (its clients resume them, or they end).
                    let detached = s.detached_calls(inb.principal);
                    if detached >= self.cfg.max_detached_calls {
                        return Err(ProxyError::DetachedCalls(detached)
                            .for_request(inb.info.single_id.clone()));
                    }
                    // In the fleet's store too, before it is forwarded (`fleet.rs`).
                    match self.claim_in_fleet(inb, s).await? {
                        FleetClaim::Ours(held) => claimed = held,
                        FleetClaim::Elsewhere(stream) => {
                            return Ok(Prepared::Elsewhere(s.clone(), stream));
                        }
                    }
                    Some(f)
                }
                Claim::Retransmission => return Ok(Prepared::Retransmission(s.clone())),
                Claim::InFlight => {
                    return Err(
                        in_flight(inb.info.single_id.as_ref(), &inb.info.request_ids)
                            .for_request(inb.info.single_id.clone()),
                    );
                }
            },
        };
        inb.drop_legacy_cursor();
        Ok(Prepared::Ready(Ready {
            reservation,
            _forwarding: forwarding,
            _claimed: claimed,
        }))
    }

    /// [`Route::EndMinted`](super::inbound::Route::EndMinted): a session whose id the
    /// gateway minted ends at the gateway (the stateless upstream has nothing to end): 200
    /// for its owner, and for anyone else exactly the answer for an unknown session.
    pub(super) async fn end_minted(
        &self,
        mut inb: Box<Inbound>,
        session: Arc<Session>,
    ) -> Result<Response<ResBody>, Refusal> {
        if !self.authorized(&mut inb, &session).await {
            return Err(ProxyError::UnknownSession.into());
        }
        self.end_session(&session, Eviction::Delete);
        Ok(Response::new(full_body(bytes::Bytes::new())))
    }

    /// Records the request in its known session (TTL, protocol version); a POST carrying
    /// requests claims their ids, waiting while a POST with the same ids is in flight.
    async fn claim(&self, inb: &mut Inbound, s: &Arc<Session>) -> Claim {
        self.note_request(inb, s);
        if inb.parts.method != Method::POST || inb.info.request_ids.is_empty() {
            return Claim::Forward(None);
        }
        // With `--resume-auth upstream`, the session's owner may come back with refreshed
        // credentials: a repeat of the owner's ids is its retransmission once the upstream
        // accepts the caller for the session (which rebinds the session to it).
        let owner = s.principal();
        if self.cfg.resume_auth == ResumeAuth::Upstream
            && inb.principal != owner
            && s.carries_any(owner, &inb.info.request_ids)
            // Boxed: an upstream exchange, as large as one; every POST's future would be.
            && Box::pin(self.authorized(inb, s)).await
        {
            return Claim::Retransmission;
        }
        let ids = &inb.info.request_ids;
        loop {
            match s.begin_forward(inb.principal, ids) {
                Ok(f) => return Claim::Forward(Some(f)),
                Err(InFlight::Another) => return Claim::InFlight,
                Err(InFlight::Own) => {}
            }
            s.forward_settled(inb.principal, ids).await;
            if s.carries_any(inb.principal, ids) {
                return Claim::Retransmission;
            }
        }
    }

    /// A request of a known session counts as its client's activity.
    pub(super) fn note_request(&self, inb: &Inbound, s: &Session) {
        s.touch();
        self.store.touch(s);
        if let Some(v) = &inb.header_version {
            s.set_protocol_version(v);
        }
    }

    /// Sends the request upstream. One that may stream waits for its answer as long as it
    /// takes; any other is bounded by `--upstream-header-timeout`.
    pub(super) async fn send(&self, inb: &mut Inbound) -> Result<Response<OwnBody>, Refusal> {
        let pending = self.answer(inb);
        let single_id = || inb.info.single_id.clone();
        let answer = if inb.can_stream() {
            pending.await
        } else {
            let limit = self.cfg.upstream_header_timeout;
            match tokio::time::timeout(limit, pending).await {
                Ok(r) => r,
                Err(_) => return Err(ProxyError::UpstreamTimeout(limit).for_request(single_id())),
            }
        };
        answer.map_err(|e| ProxyError::upstream(e).for_request(single_id()))
    }

    /// Sends the request upstream (its body taken from `inb`, its head written from `inb`'s
    /// headers, which stay `inb`'s); the answer comes to whoever polls the future (the route,
    /// or after `--upgrade-grace` the answer reader).
    pub(super) fn answer(&self, inb: &mut Inbound) -> Pending {
        let body = inb
            .body
            .take()
            .unwrap_or_else(|| full_body(bytes::Bytes::new()));
        let method = &inb.parts.method;
        let span = if crate::telemetry::enabled() {
            tracing::debug_span!(
                "upstream",
                otel.name = %method,
                otel.kind = "client",
                http.request.method = %method,
                server.address = self.upstream_address.as_ref(),
                http.response.status_code = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        // The upstream's spans are children of the gateway's exchange with it.
        let own = (!span.is_disabled()).then(|| {
            let mut h = http::HeaderMap::new();
            crate::telemetry::inject(&span, &mut h);
            h
        });
        let req = self.upstream.request(
            method,
            &inb.parts.uri,
            &inb.parts.headers,
            own.as_ref(),
            body,
            Some(inb.remote),
        );
        let req = req.in_share(inb.share);
        let upstream = self.upstream.clone();
        let (facts, metrics) = (inb.facts.clone(), self.registry.metrics().clone());
        Box::pin(
            async move {
                let sent = tokio::time::Instant::now();
                let answer = upstream.send(req).await;
                if let Ok(resp) = &answer {
                    let took = sent.elapsed();
                    facts.upstream_answered(took, resp.status());
                    metrics.upstream_answered(took.as_secs_f64());
                    tracing::Span::current()
                        .record("http.response.status_code", resp.status().as_u16());
                }
                answer
            }
            .instrument(span),
        )
    }

    /// Ends `session` for its upstream's answer (`why`) when the request was the session's
    /// own: its endpoint, which `session` is only when named there, and a caller that may
    /// attach to it, per `--resume-auth`. Anyone else's 404 or DELETE is the upstream's answer
    /// to them.
    async fn evict_on_answer(&self, inb: &mut Inbound, session: &Session, why: Eviction) {
        if self.authorized(inb, session).await {
            self.end_session(session, why);
        } else {
            tracing::debug!(mcp.session = %session.hashed_id(), reason = why.as_str(), "not the session's own request: the session stays");
        }
    }

    /// The session a successful answer belongs to (the one it creates, or the request's),
    /// created at the gateway if new: an `initialize` answered without a session id (a
    /// stateless upstream) gets one the gateway mints. `None`: no session, or none can be
    /// kept (the cap is reached with every session in use: the answer passes through
    /// untagged).
    fn answered_session(
        &self,
        inb: &Inbound,
        resp: &mut Response<OwnBody>,
        known: Option<Arc<Session>>,
        reservation: Option<Reservation>,
    ) -> Option<Arc<Session>> {
        let status = resp.status();
        if !status.is_success() || inb.parts.method == Method::DELETE {
            return None;
        }
        if let Some(s) = known.as_ref().filter(|s| s.minted()) {
            // The client holds the gateway's id; an upstream that starts naming sessions of
            // its own mid-session cannot change it.
            if resp.headers_mut().remove(MCP_SESSION_ID).is_some() {
                tracing::warn!(mcp.session = %s.hashed_id(), "the stateless upstream named a session of its own in a minted session; ignored");
            }
            return known;
        }
        let path = inb.parts.uri.path();
        let upstream_sid = resp
            .headers()
            .get(MCP_SESSION_ID)
            .filter(|v| is_visible_ascii(v.as_bytes()))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        // A session is created only by the `initialize` the upstream answered with a new
        // session (or with none: a stateless upstream). An id the gateway does not hold is
        // never adopted for whoever names it first (the gateway forgot it, or never saw it):
        // its requests pass through untagged, so a stranger gets nothing the upstream alone
        // would not give it.
        let creates = inb.info.initialize && inb.parts.method == Method::POST;
        let created = match upstream_sid {
            Some(sid) if sid.as_str() == inb.sid.as_deref().unwrap_or_default() => {
                return known.filter(|s| s.endpoint() == path);
            }
            Some(sid) if creates => {
                let owner = Owner::new(inb.principal, path).in_share(inb.share);
                match reservation {
                    Some(r) => Ok(self.registry.create_reserved(&sid, owner, r)),
                    None => self.registry.get_or_create(&sid, owner),
                }
            }
            // A stateless upstream: the gateway scopes the client's calls itself.
            None if creates && inb.sid.is_none() => {
                let owner = Owner::new(inb.principal, path).in_share(inb.share);
                self.registry.create_minted(owner, reservation)
            }
            // The request's own session, if the gateway holds it.
            None => return known.filter(|s| s.endpoint() == path),
            Some(_) => return None,
        };
        let session = created
            .inspect_err(|_| tracing::warn!("session cap reached with every session in use; passing the response through untagged"))
            .ok()?;
        // Another path's answer is never tagged into the session: it is not the session's.
        (session.endpoint() == path).then_some(session)
    }

    /// Once the session is initialized (a POST of `notifications/initialized`), the gateway holds its standalone stream from then on,
    /// so nothing the server sends there is lost to the race with the client's own GET. The
    /// 202 waits (bounded) until the upstream has the stream, so no request the client sends
    /// after it can reach the server first: whether the hold started (then the caller waits).
    fn hold_once_initialized(
        &self,
        initialized: bool,
        session: &Arc<Session>,
        source: impl FnOnce() -> Source,
    ) -> bool {
        // A stateless upstream has no standalone stream to hold.
        initialized
            && self.cfg.hold_standalone
            && !session.minted()
            && feed::hold(&self.registry, session, source)
    }

    /// Tags the upstream's SSE answer: a new stream of the session, read into its window by
    /// a task of its own (a POST's answer that came whole: at once), and this client attached
    /// to it at its start. With whether a reader was spawned (it may have bytes to take
    /// before the answer's head is written).
    fn tag(
        &self,
        mut inb: Box<Inbound>,
        session: Arc<Session>,
        resp: Response<OwnBody>,
        reattach: Option<Reattach>,
    ) -> (Response<ResBody>, bool) {
        let source = inb.take_source(&self.upstream);
        let kind = if inb.parts.method == Method::POST {
            StreamKind::Post
        } else {
            StreamKind::Standalone
        };
        let prime = self.prime(session.protocol_version().as_deref());
        let reattach = reattach.filter(|_| kind == StreamKind::Standalone);
        if reattach.is_some() {
            self.registry.metrics().resume(ResumeOutcome::Reattached);
        }
        let open = OpenStream {
            kind,
            requests: inb.info.request_ids,
            principal: inb.principal,
            initialize: inb.info.initialize,
            prime,
            announce: false,
            reattach: reattach.as_ref(),
            kill: Some(inb.kill),
            trace: crate::telemetry::current(),
        };
        let (parts, upstream_body) = resp.into_parts();
        let attachment = match feed::sse(&self.registry, &session, open, upstream_body, source) {
            // A POST's answer that came whole with its head: served at once, without a reader.
            Fed::Whole(whole) => {
                let resp = self.whole_response(
                    &inb.facts,
                    parts.status,
                    Some(parts.headers),
                    session,
                    whole,
                );
                return (resp, false);
            }
            Fed::Stream(attachment) => attachment,
        };
        let s = session.clone();
        let body = AttachBody::new(session, attachment, self.cfg.keepalive);
        let resp = self.sse_response(&inb.facts, parts.status, Some(parts.headers), s.id(), body);
        (resp, true)
    }
}
