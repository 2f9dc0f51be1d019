//! The HTTP layer: each client request is read once ([`inbound::Inbound`]), classified by a
//! pure function into a [`inbound::Route`], and served by that route's handler:
//!
//! | route | handler | module |
//! |---|---|---|
//! | pass-through (modern era) | `Gateway::pass_through` | [`forward`] |
//! | resume (`GET` + `Last-Event-ID`) | `Gateway::resume` | [`resume`] |
//! | live attach (`GET` of a known session) | `Gateway::attach` | [`live`] |
//! | retransmission (a POST repeating a retained request id) | `Gateway::retransmission` | [`resume`] |
//! | upgrade (a legacy POST with requests from a client accepting SSE) | `Gateway::upgrade` | [`upgrade`] |
//! | end a minted session (`DELETE`) | `Gateway::end_minted` | [`forward`] |
//! | a minted id the gateway no longer holds | 404, in `route` | |
//! | forward-and-tag (every other legacy request) | `Gateway::forward` | [`forward`] |
//!
//! A route falls through to the next only where the protocol says so: a standalone cursor
//! that cannot be resumed exactly attaches live, a live attach with no stream to hold is
//! forwarded. Who the caller is and whether it may attach: [`auth`]. Errors become responses
//! in one place (`error`).
//!
//! Knows HTTP and the session API; the rules of tagging, retention and re-attach live in
//! `session`.

mod auth;
mod bodies;
mod forward;
mod inbound;
mod live;
mod operator;
mod orphans;
mod respond;
mod resume;
mod upgrade;
mod warn_limit;

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use http::header::HeaderName;
use http::{Method, Request, Response};
use tracing::Instrument;

use self::inbound::{classify, Inbound, Route};
use crate::access::{AccessLog, Observed, Requested};
use crate::config::Config;
use crate::error::{ProxyError, Refusal};

use crate::metrics::Metrics;
use crate::session::{hash_id, Owner, Registry, Session};
use crate::store::{Adoption, Store};
use crate::upstream::{full_body, Upstream};

// The exchange's types under the names the route handlers use (`super::...`).
pub(crate) use self::operator::Asked;
pub(crate) use self::orphans::Facts;
use self::orphans::{FinishOnDrop, Orphans};
pub(crate) use crate::exchange::{ClientBody, Conn, ResBody, MCP_PROTOCOL_VERSION, MCP_SESSION_ID};

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The gateway: configuration, the session registry and the upstream client.
pub struct Gateway {
    cfg: Arc<Config>,
    registry: Arc<Registry>,
    upstream: Arc<Upstream>,
    /// Principals are hashed with it, never stored in the clear: random per process, or the
    /// fleet's binding key with a store (the same caller, the same principal everywhere).
    principal_key: [u8; 32],
    /// Refused resumes are a WARN each, at most one a second (a prober cannot flood the log).
    refused_warn: warn_limit::WarnLimit,
    /// POSTs whose client left before the upstream's head, finishing on their own.
    orphans: Arc<Orphans>,
    /// `--upstream`'s authority, for the access lines.
    upstream_address: Arc<str>,
    /// The bytes of all request bodies held at once (`--max-buffered-request-bytes`).
    bodies: Arc<bodies::Bodies>,
    /// The fleet's shared store (`--store`), or `Off`.
    store: Store,
    /// The store's background tasks: stopped when the gateway drops.
    _store_tasks: crate::store::Tasks,
}

impl Gateway {
    pub fn new(cfg: Config) -> Arc<Gateway> {
        let cfg = Arc::new(cfg);
        let orphans = Arc::new(Orphans::new(cfg.max_connections, cfg.session_ttl));
        let metrics = Arc::new(Metrics::new());
        metrics
            .memory_budget_bytes
            .set(i64::try_from(cfg.memory_budget).unwrap_or(i64::MAX));
        metrics.set_tool_names(cfg.metrics_tool_names);
        let upstream_address: Arc<str> =
            cfg.upstream.authority().map_or("-", |a| a.as_str()).into();
        let registry = Arc::new(Registry::new(cfg.clone(), metrics));
        let upstream = Arc::new(Upstream::new(cfg.clone()));
        let (store, store_tasks) = Store::new(&cfg, &registry);
        registry.on_end(on_end(
            store.clone(),
            end_upstream(upstream.clone(), cfg.upstream_header_timeout),
        ));
        if let Some(key) = store.label_key() {
            crate::session::set_label_key(key);
        }
        if let Some(key) = store.mint_key() {
            registry.set_mint_key(key);
        }
        if store.is_on() {
            let publishing = store.clone();
            registry.on_publish(crate::session::Publisher(Box::new(move |s, stream| {
                publishing.publish(s, stream);
            })));
        }
        let principal_key = store.binding_key().unwrap_or_else(|| {
            // At startup, before any request: a gateway without OS randomness cannot bind
            // sessions to anyone safely, so it does not start.
            let mut key = [0u8; 32];
            getrandom::getrandom(&mut key)
                .expect("the OS random number generator, for the principal key");
            key
        });
        Arc::new(Gateway {
            store,
            _store_tasks: store_tasks,
            registry,
            upstream,
            bodies: Arc::new(bodies::Bodies::new(cfg.max_buffered_request_bytes)),
            cfg,
            principal_key,
            refused_warn: warn_limit::WarnLimit::new(std::time::Duration::from_secs(1)),
            orphans,
            upstream_address,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Closes the upstream connections that idled too long, in a task the caller owns.
    pub(crate) fn spawn_upstream_reaper(&self) -> tokio::task::JoinHandle<()> {
        self.upstream.spawn_reaper()
    }

    /// Whether `/readyz` may answer ready as far as the upstream is concerned: always,
    /// unless `--ready-upstream` asks that the upstream accept a connection (within 1 s).
    pub async fn upstream_ready(&self) -> bool {
        !self.cfg.ready_upstream
            || self
                .upstream
                .reachable(std::time::Duration::from_secs(1))
                .await
    }

    /// The Prometheus text exposition of the gateway's metrics, gauges refreshed.
    pub fn render_metrics(&self) -> String {
        self.registry.refresh_gauges();
        let metrics = self.registry.metrics();
        let (open, max) = self.upstream.connections();
        metrics
            .upstream_connections
            .set(i64::try_from(open).unwrap_or(i64::MAX));
        metrics
            .upstream_connections_max
            .set(i64::try_from(max).unwrap_or(i64::MAX));
        metrics
            .buffered_request_bytes
            .set(i64::try_from(self.bodies.used()).unwrap_or(i64::MAX));
        metrics.encode()
    }

    /// Handles one client request. Never fails: errors become responses.
    pub(crate) async fn handle(
        self: Arc<Self>,
        req: Request<ClientBody>,
        conn: Conn,
    ) -> Result<Response<Observed<ResBody>>, Infallible> {
        let start = tokio::time::Instant::now();
        let method = req.method().clone();
        let requested = Requested {
            method: method.clone(),
            start,
            // A GET's line is written when its stream ends, often much later: what it keeps
            // of the request is copied (`upstream::owned_value`).
            target: req.uri().path_and_query().and_then(|pq| {
                if method == Method::GET {
                    crate::upstream::owned_target(pq)
                } else {
                    Some(pq.clone())
                }
            }),
            user_agent: keep(&method, req.headers().get(http::header::USER_AGENT)),
            traceparent: keep(&method, req.headers().get(TRACEPARENT)),
            client: self.client_ip(req.headers(), conn.remote.ip()),
            span: tracing::Span::none(),
        };
        // Hashed only for a span that is recorded, or a line whose session the route did not
        // find: a known session's hashed id is made once (`Session::hashed_id`).
        let sid = req.headers().get(MCP_SESSION_ID).cloned();
        // One span per request (inside its connection's span), so a debug log of one session
        // can be followed; a session the upstream creates now is recorded once known.
        let span = tracing::debug_span!(
            "request",
            otel.name = tracing::field::Empty,
            otel.kind = "server",
            http.request.method = %method,
            mcp.session.id = sid.as_ref().map(|v| tracing::field::display(hash_id(v.as_bytes()))),
            url.path = tracing::field::Empty,
            http.response.status_code = tracing::field::Empty,
            mcp.method.name = tracing::field::Empty,
            gen_ai.tool.name = tracing::field::Empty,
            error.type = tracing::field::Empty,
            events = tracing::field::Empty,
            bytes = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        if crate::telemetry::enabled() && !span.is_disabled() {
            // The client's trace continues here (its traceparent is replaced upstream).
            crate::telemetry::continue_from(&span, req.headers());
            span.record("otel.name", format!("{method} {}", req.uri().path()));
            span.record("url.path", req.uri().path());
        }
        let facts = Arc::new(Facts::default());
        let routed = if method == Method::POST {
            // A POST's exchange with the upstream must not hang on the client's connection:
            // dropped with it (a client that goes away or half-closes before the upstream's
            // response head), it would cancel a request the upstream already started, and the
            // client's retransmission would run the tool again. Dropped early, it finishes in
            // a task of its own, for at most --session-ttl; a stream it opens is read into the
            // window, where the retransmission finds it. A modern-era POST is cancelled with
            // its client instead (its route says so).
            let (me, conn, routed_facts) = (self.clone(), conn.clone(), facts.clone());
            //
            // Both routes' futures are bound (boxed) before they are awaited, in statements of
            // their own: a temporary of the awaiting statement keeps its room in this future
            // even once moved into the box, which the connection makes per request
            // (bench/notes.md, "Figure: boxed futures").
            let finishing = {
                // Boxed before it is instrumented: the large future is then copied once,
                // into the box (instrumented first, it was copied into the wrapper, then the
                // wrapper into the box).
                let routing = Box::pin(async move { me.route(req, &conn, &routed_facts).await })
                    .instrument(span.clone());
                FinishOnDrop::new(routing, facts.clone(), self.orphans.clone())
            };
            finishing.await
        } else {
            let routing = Box::pin(self.route(req, &conn, &facts).instrument(span.clone()));
            routing.await
        };
        let mut refused = None;
        let resp = match routed {
            Ok(r) => r,
            Err(refusal) => span.in_scope(|| {
                refused = Some(refusal.error.class().reason);
                refusal
                    .respond(&method, self.registry.metrics())
                    .map(full_body)
            }),
        };
        let stream = facts.stream.get().cloned();
        let named = facts.session.get().and_then(Weak::upgrade);
        let session = named
            .map(|s| s.hashed_id().clone())
            .or_else(|| sid.map(|v| hash_id(v.as_bytes()).into()));
        let session = session.or_else(|| {
            let created: Option<Arc<str>> = resp
                .headers()
                .get(MCP_SESSION_ID)
                .map(|v| hash_id(v.as_bytes()).into());
            if let Some(h) = &created {
                span.record("mcp.session.id", tracing::field::display(h));
            }
            created
        });
        let get_stream = method == Method::GET && crate::upstream::is_sse(resp.headers());
        // The request's span lives as long as its response: a stream's whole life.
        let mut requested = requested;
        requested.span = span;
        let log = AccessLog::new(
            requested,
            resp.status(),
            session,
            stream,
            get_stream,
            refused,
            facts,
            self.upstream_address.clone(),
            self.registry.metrics().clone(),
        );
        Ok(resp.map(|b| Observed::new(b, log)))
    }

    /// Classify, then dispatch: the request read once, the route decided by a pure
    /// function, one handler per route. `facts` learns what becomes of the request if its
    /// client leaves before the upstream's head (see [`Facts`]).
    async fn route(
        self: &Arc<Self>,
        req: Request<ClientBody>,
        conn: &Conn,
        facts: &Arc<Facts>,
    ) -> Result<Response<ResBody>, Refusal> {
        let mut inb = Inbound::read(req, &self.cfg, conn, &self.bodies, facts, |h, creates| {
            self.principal_and_share(h, conn, creates)
        })
        .await?;
        if let Some(m) = inb.info.method {
            let _ = facts.call.set((m, inb.info.tool.take().map(Into::into)));
        }
        // A session is only named on its own endpoint: elsewhere its id is just a header.
        let held = inb
            .sid
            .as_deref()
            .filter(|_| !inb.modern)
            .and_then(|sid| self.registry.get(sid));
        // A stranger's POST into a session of the fleet this replica does not hold: its ids
        // claimed in the store all the same (held until the answer's head), so an id in
        // flight in the session is nobody else's here either.
        let mut _strangers_claim = None;
        let held = match held {
            None if self.store.is_on() && !inb.modern => match inb.sid.clone() {
                Some(sid) => match self.adopt(&sid, Caller::of(&inb)).await {
                    Ok(Adopted::Held(s)) => Some(s),
                    Ok(Adopted::NotYours) => {
                        // A minted session's stranger is answered 404 as for an id nobody
                        // holds (its stateless upstream never knew it): nothing to claim.
                        let minted = crate::session::is_minted_form(&sid);
                        _strangers_claim = if carries_requests(&inb) && !minted {
                            let single_id = inb.info.single_id.clone();
                            let ids = &inb.info.request_ids;
                            self.strangers_claim(&sid, inb.principal, ids, single_id)
                                .await?
                        } else {
                            None
                        };
                        None
                    }
                    // Right after the store's return, a session it does not have may be one
                    // whose record its holder has not written again yet: a POST that may be a
                    // retransmission is not forwarded as a stranger's on that account.
                    Ok(Adopted::None) if carries_requests(&inb) && self.store.just_recovered() => {
                        return Err(
                            ProxyError::StoreUnanswered.for_request(inb.info.single_id.clone())
                        );
                    }
                    Ok(Adopted::None) => None,
                    // A resume the store could not say anything about: not a session this
                    // gateway never saw (404 ends a client's session), but a busy one: the
                    // client comes back after `Retry-After` (every client of a lost replica
                    // resuming here at once is paced so).
                    Err(Unanswered)
                        if inb.parts.method == Method::GET && inb.cursor().is_some() =>
                    {
                        return Err(ProxyError::StoreUnanswered.into());
                    }
                    // Nor is a POST carrying requests forwarded as into a session nobody
                    // knows: it may be a retransmission of a call another replica runs, and
                    // forwarded raw it would run again (STYLE 19: refused, never the unsafe
                    // action).
                    Err(Unanswered) if carries_requests(&inb) => {
                        return Err(
                            ProxyError::StoreUnanswered.for_request(inb.info.single_id.clone())
                        );
                    }
                    Err(Unanswered) => None,
                },
                None => None,
            },
            held => held,
        };
        let session = held.filter(|s| s.endpoint() == inb.parts.uri.path());
        // A minted session is nobody's but its owner's: the stateless upstream never knew it,
        // so anyone else is answered exactly as for a minted id the gateway does not hold
        // (whether a session exists is not told).
        let session = match session {
            Some(s) if s.minted() && !self.authorized(&mut inb, &s).await => None,
            other => other,
        };
        if let Some(s) = &session {
            let _ = facts.session.set(Arc::downgrade(s));
            if s.principal() == inb.principal {
                // Its owner's request counts in the session's share (an anonymous caller's
                // address), as its upstream connection does.
                inb.share = s.share();
            }
        }
        if session.as_ref().is_some_and(|s| s.minted()) {
            // The gateway's own id: the stateless upstream never sees it.
            inb.parts.headers.remove(MCP_SESSION_ID);
        }
        match classify(&inb, session.as_deref()) {
            Route::Asterisk => Ok(respond::asterisk()),
            Route::PassThrough => {
                facts.cancel.store(true, Ordering::Relaxed);
                self.pass_through(inb).await
            }
            // Boxed: the stream routes' futures are the largest, and a future is as large as
            // its largest route (see `handle`).
            Route::Resume => Box::pin(self.resume(inb, session)).await,
            Route::Attach => Box::pin(self.attach(inb, session, None)).await,
            Route::Retransmission => match session {
                Some(s) => Box::pin(self.retransmission(inb, s)).await,
                None => self.forward(inb, None, None).await,
            },
            Route::Upgrade => self.upgrade(inb, session).await,
            Route::EndMinted => match session {
                Some(s) => Box::pin(self.end_minted(inb, s)).await,
                None => Err(ProxyError::UnknownSession.into()),
            },
            Route::MintedGone => Err(ProxyError::UnknownSession.into()),
            Route::Forward => self.forward(inb, session, None).await,
        }
    }
}

/// The fleet's store said nothing of a session (see [`Adoption::Unanswered`]).
struct Unanswered;

/// Who asks for a session this replica does not hold, and where.
struct Caller<'a> {
    principal: crate::session::Principal,
    share: crate::session::Principal,
    path: &'a str,
    version: Option<&'a str>,
}

impl Caller<'_> {
    fn of(inb: &Inbound) -> Caller<'_> {
        Caller {
            principal: inb.principal,
            share: inb.share,
            path: inb.parts.uri.path(),
            version: inb
                .parts
                .headers
                .get(MCP_PROTOCOL_VERSION)
                .and_then(|v| v.to_str().ok()),
        }
    }
}

/// What the fleet's store made of a session this replica did not hold.
enum Adopted {
    /// Adopted: held from now on.
    Held(Arc<Session>),
    /// A live session of someone else's: not adopted for this caller.
    NotYours,
    /// No such session (or none that can be adopted).
    None,
}

/// Whether `inb` is a POST carrying requests (ids the upstream answers by).
fn carries_requests(inb: &Inbound) -> bool {
    inb.parts.method == Method::POST && !inb.info.request_ids.is_empty()
}

impl Gateway {
    /// A session this replica does not hold, adopted from the fleet's store when it is there,
    /// live and the caller's (any caller's with `--resume-auth none`): held from now on, with
    /// the epoch it was created with and stream numbers of a block of this replica's.
    async fn adopt(&self, sid: &str, caller: Caller<'_>) -> Result<Adopted, Unanswered> {
        let principal =
            (self.cfg.resume_auth != crate::config::ResumeAuth::None).then_some(caller.principal);
        let (record, first_stream) = match self.store.adopt(sid, principal).await {
            Adoption::Adopt(record, first_stream) => (record, first_stream),
            Adoption::None => return Ok(Adopted::None),
            Adoption::NotYours => return Ok(Adopted::NotYours),
            // A minted id certifies itself under the fleet's key: one that does not for this
            // caller is not its session, whatever the store would say (404, as a minted id's
            // stranger gets on the replica holding it).
            Adoption::Unanswered => {
                return match self.rebuild_minted(sid, &caller) {
                    Some(s) => Ok(Adopted::Held(s)),
                    None if crate::session::is_minted_form(sid) => Ok(Adopted::None),
                    None => Err(Unanswered),
                }
            }
        };
        let owner = Owner::new(record.principal, &record.endpoint)
            .in_share(record.share)
            .adopted(record.epoch, first_stream);
        let Ok(s) = self
            .registry
            .adopt(sid, owner, record.minted)
            .inspect_err(|_| tracing::warn!("session cap reached with every session in use: a session of the fleet is not adopted"))
        else {
            return Ok(Adopted::None);
        };
        if let Some(v) = &record.protocol_version {
            s.set_protocol_version(v);
        }
        tracing::debug!(mcp.session = %s.hashed_id(), "session adopted from the fleet's store");
        Ok(Adopted::Held(s))
    }

    /// A stranger's POST into session `sid` of the fleet (not adopted for it): its request
    /// ids claimed in the session as any POST's are ([`Store::claim`], the rule
    /// [`crate::session::verdict`]): refused while another's request with one of them is in
    /// flight, as the replica holding the session refuses it, never answered from another's
    /// stream; forwarded (untagged) with the claim held until the answer's head otherwise.
    async fn strangers_claim(
        &self,
        sid: &str,
        principal: crate::session::Principal,
        ids: &[String],
        single_id: Option<serde_json::Value>,
    ) -> Result<Option<crate::store::IdsHeld>, Refusal> {
        use crate::store::IdClaim;
        let limit = self.cfg.upstream_header_timeout;
        match self.store.claim(sid, None, principal, ids, limit).await {
            IdClaim::Ours(held) => Ok(Some(held)),
            IdClaim::Unknown => Ok(None),
            IdClaim::Carried(_) | IdClaim::InFlight => {
                Err(forward::in_flight(single_id.as_ref(), ids).for_request(single_id))
            }
            IdClaim::Pending | IdClaim::Unanswered => {
                Err(ProxyError::StoreUnanswered.for_request(single_id))
            }
        }
    }

    /// A minted session the store said nothing of (down, or restarted empty moments ago),
    /// held from its id alone when the id certifies itself under the fleet's key for this
    /// caller on this endpoint (`session::mint_fleet_id`): its epoch is in it, its streams
    /// numbered from a block of this replica's, and its record written once the store answers.
    fn rebuild_minted(&self, sid: &str, caller: &Caller<'_>) -> Option<Arc<Session>> {
        let epoch = self
            .registry
            .minted_epoch(sid, caller.principal, caller.path)?;
        let owner = Owner::new(caller.principal, caller.path)
            .in_share(caller.share)
            .adopted(epoch, Store::rebuilt_block());
        let s = self.registry.adopt(sid, owner, true).ok()?;
        if let Some(v) = caller.version {
            s.set_protocol_version(v);
        }
        self.store.rebuilt(&s);
        tracing::debug!(mcp.session = %s.hashed_id(), "minted session held from its id: the store did not say");
        Some(s)
    }

    /// The fleet's hand-over at the end of a drain: with a store, the calls this replica
    /// still reads upstream go on into the store (their clients resume on other replicas, from
    /// it) until they end, at most `--store-drain-timeout`; without one, nothing.
    pub(crate) async fn hand_over(&self) {
        let Some(limit) = self.cfg.store.as_ref().map(|s| s.drain_timeout) else {
            return;
        };
        let deadline = tokio::time::Instant::now() + limit;
        let mut running = self.registry.running_calls();
        if running > 0 {
            tracing::info!(
                calls = running,
                ?limit,
                "drained: reading the calls still running into the fleet's store"
            );
        }
        while running > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(HAND_OVER_POLL).await;
            running = self.registry.running_calls();
        }
        if running > 0 {
            tracing::warn!(calls = running, "--store-drain-timeout: calls still running are left (their followers get owner-lost)");
        }
    }

    /// The replica stops accepting: the clients it serves from the fleet's store resume
    /// elsewhere at once.
    pub(crate) fn drain_followers(&self) {
        self.store.drain_followers();
    }

    /// Ends `session` (DELETE, an operator's end): here, and through the registry's
    /// [`on_end`], upstream and in the fleet.
    pub(super) fn end_session(&self, session: &Session, why: crate::session::Eviction) {
        self.registry.remove(session.id(), why);
    }
}

/// How often the hand-over looks whether the calls it reads have ended.
const HAND_OVER_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Shed DELETEs in flight at most: beyond, a shed session is left to the upstream's own
/// expiry (a flood of sheds must not become a flood of upstream requests).
const MAX_SHED_DELETES: usize = 64;

/// What follows every end of a session here, whatever ended it (the registry's one hook):
/// the fleet learns of it ([`Store::ended`]: a tombstone and an announcement, unless another
/// replica announced it), and a session the gateway alone ended is ended upstream too. With a
/// store, a session that only idled out here may live on through another replica: the store
/// says whether the fleet let it idle out too before the upstream is asked ([`Store::idled`]).
fn on_end(store: Store, shed: crate::session::EndUpstream) -> crate::session::OnEnd {
    crate::session::OnEnd(Box::new(move |s, why| {
        let upstream_too = why.ends_upstream() && !s.minted();
        if why == crate::session::Eviction::Ttl && store.is_on() {
            store.idled(s, upstream_too.then(|| shed.clone()));
            return;
        }
        store.ended(s, why);
        if upstream_too {
            shed(s);
        }
    }))
}

/// A `DELETE` to the upstream for a session the gateway ended alone (the cap, the budget, its
/// TTL, an operator), so the upstream does not keep a session the gateway dropped (its
/// client's next request then gets the upstream's 404 and initializes again). It carries the
/// session id and protocol version, not the client's credentials (the gateway keeps none): an
/// upstream that wants them on DELETE refuses it and keeps the session until its own expiry.
fn end_upstream(
    upstream: Arc<Upstream>,
    limit: std::time::Duration,
) -> crate::session::EndUpstream {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_SHED_DELETES));
    Arc::new(move |s: &Session| {
        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
            tracing::debug!(mcp.session = %s.hashed_id(), "too many shed sessions being ended upstream: left to the upstream's expiry");
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut headers = http::HeaderMap::new();
        let (Ok(sid), Ok(uri)) = (
            http::HeaderValue::from_str(s.id()),
            s.endpoint().parse::<http::Uri>(),
        ) else {
            return;
        };
        headers.insert(MCP_SESSION_ID, sid);
        if let Some(v) = s
            .protocol_version()
            .and_then(|v| http::HeaderValue::from_str(&v).ok())
        {
            headers.insert(MCP_PROTOCOL_VERSION, v);
        }
        let req = upstream.request(
            &Method::DELETE,
            &uri,
            &headers,
            None,
            full_body(Bytes::new()),
            None,
        );
        let (upstream, session) = (upstream.clone(), s.hashed_id().clone());
        rt.spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(limit, upstream.send(req)).await {
                Ok(Ok(resp)) => tracing::debug!(mcp.session = %session, status = resp.status().as_u16(), "shed session ended upstream"),
                _ => tracing::debug!(mcp.session = %session, "shed session: the upstream did not answer its DELETE"),
            }
        });
    })
}

fn is_visible_ascii(b: &[u8]) -> bool {
    !b.is_empty() && b.iter().all(|c| (0x21..=0x7e).contains(c))
}

/// A request header value for its access line: a GET's copied (see [`Gateway::handle`]).
fn keep(method: &Method, value: Option<&http::HeaderValue>) -> Option<http::HeaderValue> {
    if *method == Method::GET {
        value.map(crate::upstream::owned_value)
    } else {
        value.cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_client_address_believes_only_trusted_proxies() {
        let mut cfg = Config::new("http://127.0.0.1:1".parse().unwrap());
        cfg.trusted_proxies = vec![crate::config::parse_net("10.0.0.0/8").unwrap()];
        let gw = Gateway::new(cfg);
        let xff = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert("x-forwarded-for", v.parse().unwrap());
            h
        };
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        let proxy = ip("10.1.1.1");
        // Through two trusted hops: the right-most untrusted address.
        assert_eq!(
            gw.client_ip(&xff("6.6.6.6, 1.2.3.4, 10.2.2.2"), proxy),
            ip("1.2.3.4")
        );
        // An untrusted peer's header is not believed.
        assert_eq!(gw.client_ip(&xff("1.2.3.4"), ip("8.8.8.8")), ip("8.8.8.8"));
        // Garbage ends the walk at the last believed hop.
        assert_eq!(gw.client_ip(&xff("1.2.3.4, junk"), proxy), proxy);
        assert_eq!(gw.client_ip(&http::HeaderMap::new(), proxy), proxy);
        let plain = Gateway::new(Config::new("http://127.0.0.1:1".parse().unwrap()));
        assert_eq!(
            plain.client_ip(&xff("1.2.3.4"), proxy),
            proxy,
            "none trusted by default"
        );
    }
}
