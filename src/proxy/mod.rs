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
mod respond;
mod resume;
mod upgrade;
mod warn_limit;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use crate::server::ClientBody;
use bytes::Bytes;
use http::header::HeaderName;
use http::{Method, Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use tokio::sync::Notify;
use tracing::Instrument;

use self::inbound::{classify, Inbound, Route};
use crate::access::{AccessLog, Learned, Observed, Requested, StreamStats};
use crate::config::Config;
use crate::error::{ProxyError, Refusal};

use crate::metrics::Metrics;
use crate::session::{hash_id, Registry};
pub(crate) use crate::upstream::BoxError;
use crate::upstream::{full_body, Upstream};

/// Body of every response the gateway sends.
pub(crate) type ResBody = UnsyncBoxBody<Bytes, BoxError>;

pub(crate) const MCP_SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");
pub(crate) const MCP_PROTOCOL_VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// Per-connection facts the handler needs.
#[derive(Clone, Debug)]
pub(crate) struct Conn {
    pub remote: std::net::SocketAddr,
    /// Notified to close the client connection (a stalled client whose body cannot be polled).
    pub kill: Arc<Notify>,
    /// The subject of the client's verified TLS certificate (mTLS), if any.
    pub client_subject: Option<Arc<str>>,
}

/// The gateway: configuration, the session registry and the upstream client.
pub struct Gateway {
    cfg: Arc<Config>,
    registry: Arc<Registry>,
    upstream: Arc<Upstream>,
    /// Random per process: principals are hashed with it, never stored in the clear.
    principal_key: [u8; 32],
    /// Refused resumes are a WARN each, at most one a second (a prober cannot flood the log).
    refused_warn: warn_limit::WarnLimit,
    /// POSTs whose client left before the upstream's head, finishing on their own.
    orphans: Arc<Orphans>,
    /// `--upstream`'s authority, for the access lines.
    upstream_address: Arc<str>,
    /// The bytes of all request bodies held at once (`--max-buffered-request-bytes`).
    bodies: Arc<bodies::Bodies>,
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
        registry.on_shed(end_upstream(upstream.clone(), cfg.upstream_header_timeout));
        Arc::new(Gateway {
            registry,
            upstream,
            bodies: Arc::new(bodies::Bodies::new(cfg.max_buffered_request_bytes)),
            cfg,
            // At startup, before any request: a gateway without OS randomness cannot bind
            // sessions to anyone safely, so it does not start.
            principal_key: {
                let mut key = [0u8; 32];
                getrandom::getrandom(&mut key)
                    .expect("the OS random number generator, for the principal key");
                key
            },
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
            // even once moved into the box (3,008 bytes where it is 1,024 now, moved into a
            // box of its own per request by the connection).
            let finishing = {
                // Boxed before it is instrumented: the ~1.9 KB future is then copied once,
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
        let session = inb
            .sid
            .as_deref()
            .filter(|_| !inb.modern)
            .and_then(|sid| self.registry.get(sid))
            .filter(|s| s.endpoint() == inb.parts.uri.path());
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

/// Shed DELETEs in flight at most: beyond, a shed session is left to the upstream's own
/// expiry (a flood of sheds must not become a flood of upstream requests).
const MAX_SHED_DELETES: usize = 64;

/// What the registry does with a session it sheds (the cap, the budget): a `DELETE` to the
/// upstream, so the upstream does not keep a session the gateway dropped (its client's next
/// request then gets the upstream's 404 and initializes again). It carries the session id
/// and protocol version, not the client's credentials (the gateway keeps none): an upstream
/// that wants them on DELETE refuses it and keeps the session until its own expiry.
fn end_upstream(upstream: Arc<Upstream>, limit: std::time::Duration) -> crate::session::OnShed {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_SHED_DELETES));
    crate::session::OnShed(Box::new(move |s| {
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
    }))
}

fn is_visible_ascii(b: &[u8]) -> bool {
    !b.is_empty() && b.iter().all(|c| (0x21..=0x7e).contains(c))
}

/// What a request's route learns of it, for what comes after: what becomes of a POST whose
/// client leaves before the upstream's head (cancelled with its client, a modern-era request;
/// or else finishing on its own until its session, if it named one, ends), and for the access
/// line and the per-method metrics its MCP method, its tool and the upstream's time to the
/// response head. One allocation per request, shared by the route and [`Gateway::handle`].
#[derive(Default)]
pub(crate) struct Facts {
    cancel: AtomicBool,
    session: std::sync::OnceLock<std::sync::Weak<crate::session::Session>>,
    /// The MCP method label of a POST ([`crate::jsonrpc::method_label`]) and its tool.
    call: std::sync::OnceLock<(&'static str, Option<Box<str>>)>,
    /// Microseconds from sending the request upstream to its response head, plus one
    /// (0: never sent).
    upstream_us: std::sync::atomic::AtomicU64,
    /// The upstream's answer had a success status.
    upstream_succeeded: AtomicBool,
    /// The counts of the stream the response serves, if it serves one (an SSE response of
    /// the gateway's: [`respond`]). Here, not in the response's extensions: their map is
    /// allocated on the first insert (~400 instructions of every streamed answer).
    stream: std::sync::OnceLock<Arc<StreamStats>>,
}

impl Learned for Facts {
    fn call(&self) -> (Option<&'static str>, Option<&str>) {
        Facts::call(self)
    }

    fn upstream_time(&self) -> Option<std::time::Duration> {
        Facts::upstream_time(self)
    }

    fn upstream_succeeded(&self) -> bool {
        self.upstream_succeeded.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for Facts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Facts")
            .field("call", &self.call.get())
            .field("upstream_time", &self.upstream_time())
            .finish_non_exhaustive()
    }
}

impl Facts {
    /// The response serves a stream of the gateway's with these counts.
    pub(super) fn stream_stats(&self, stats: Arc<StreamStats>) {
        let _ = self.stream.set(stats);
    }

    /// The upstream answered with its head, of `status`, `took` after the request was sent.
    pub(crate) fn upstream_answered(&self, took: std::time::Duration, status: http::StatusCode) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX - 1);
        self.upstream_us.store(us + 1, Ordering::Relaxed);
        self.upstream_succeeded
            .store(status.is_success(), Ordering::Relaxed);
    }

    /// The upstream's time to the response head, if the request was sent.
    pub(crate) fn upstream_time(&self) -> Option<std::time::Duration> {
        match self.upstream_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(std::time::Duration::from_micros(us - 1)),
        }
    }

    /// The MCP method label and tool of the request (a POST's), if any.
    pub(crate) fn call(&self) -> (Option<&'static str>, Option<&str>) {
        match self.call.get() {
            Some((m, t)) => (Some(m), t.as_deref()),
            None => (None, None),
        }
    }
}

/// The bounds of POSTs abandoned before the upstream's head (issue 22): at most `max` at once
/// (`--max-connections`: each stood for a connection), each for at most `limit`
/// (`--session-ttl`). Past either, the exchange is ended (the upstream request cancelled).
struct Orphans {
    count: std::sync::atomic::AtomicUsize,
    max: usize,
    limit: std::time::Duration,
}

impl Orphans {
    fn new(max: usize, limit: std::time::Duration) -> Orphans {
        Orphans {
            count: Default::default(),
            max,
            limit,
        }
    }

    /// Takes a place for one more orphan, if there is one.
    fn adopt(self: &Arc<Self>) -> Option<OrphanPlace> {
        self.count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| OrphanPlace(self.clone()))
    }
}

/// One orphan's place, given back when it ends.
struct OrphanPlace(Arc<Orphans>);

impl Drop for OrphanPlace {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A future that, dropped before it is done, is not cancelled: it finishes in a task of its
/// own, within the [`Orphans`] bounds, and its output is dropped there; unless `cancel` was
/// set by then, in which case dropping it cancels it. The future is `Unpin` (the caller boxes
/// it): one allocation while the caller waits for it (`bench/callgrind` JSON POST 75.8 k ->
/// 77.6 k Ir; spawning every POST and joining it cost 82.0 k).
struct FinishOnDrop<F: Future + Unpin + Send + 'static>
where
    F::Output: Send + 'static,
{
    fut: Option<F>,
    facts: Arc<Facts>,
    orphans: Arc<Orphans>,
}

impl<F: Future + Unpin + Send + 'static> FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    fn new(fut: F, facts: Arc<Facts>, orphans: Arc<Orphans>) -> Self {
        FinishOnDrop {
            fut: Some(fut),
            facts,
            orphans,
        }
    }
}

impl<F: Future + Unpin + Send + 'static> Future for FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let fut = self
            .fut
            .as_mut()
            .expect("FinishOnDrop polled after completion");
        let out = std::task::ready!(Pin::new(fut).poll(cx));
        self.fut = None;
        Poll::Ready(out)
    }
}

impl<F: Future + Unpin + Send + 'static> Drop for FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(fut) = self.fut.take() else { return };
        if self.facts.cancel.load(Ordering::Relaxed) {
            return; // dropped here: cancelled
        }
        let session = self.facts.session.get().and_then(std::sync::Weak::upgrade);
        let Some(place) = self.orphans.adopt() else {
            tracing::warn!(
                max = self.orphans.max,
                "too many requests abandoned before the upstream answered: this one is cancelled"
            );
            return;
        };
        // Outside a runtime (it is being torn down) there is nothing left to finish on.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let limit = self.orphans.limit;
            rt.spawn(async move {
                let _place = place;
                let session_ended = async {
                    match &session {
                        Some(s) => s.closed().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    done = tokio::time::timeout(limit, fut) => if done.is_err() {
                        tracing::debug!(?limit, "an abandoned request's exchange ended at its bound");
                    },
                    () = session_ended => {
                        tracing::debug!("an abandoned request's exchange ended with its session");
                    }
                }
            });
        }
    }
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
    use std::time::Duration;

    fn finish_on_drop<F: Future + Send + 'static>(
        fut: F,
        cancel: bool,
        limit: Duration,
    ) -> FinishOnDrop<Pin<Box<F>>>
    where
        F::Output: Send + 'static,
    {
        let orphans = Arc::new(Orphans::new(usize::MAX, limit));
        let facts = Facts {
            cancel: AtomicBool::new(cancel),
            ..Facts::default()
        };
        FinishOnDrop::new(Box::pin(fut), Arc::new(facts), orphans)
    }

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

    #[tokio::test(start_paused = true)]
    async fn abandoned_futures_beyond_the_cap_are_cancelled_and_places_come_back() {
        let orphans = Arc::new(Orphans::new(1, Duration::from_secs(60)));
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let abandon = |orphans: &Arc<Orphans>| {
            let r = ran.clone();
            let fut = FinishOnDrop::new(
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    r.fetch_add(1, Ordering::SeqCst);
                }),
                Arc::new(Facts::default()),
                orphans.clone(),
            );
            async move {
                let _ = tokio::time::timeout(Duration::from_millis(1), fut).await;
            }
        };
        abandon(&orphans).await;
        abandon(&orphans).await; // over the cap of 1: cancelled
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        assert_eq!(
            orphans.count.load(Ordering::SeqCst),
            0,
            "its place came back"
        );
        abandon(&orphans).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_dropped_before_it_is_done_finishes_in_its_own_task() {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let fut = finish_on_drop(
            async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                d.store(true, Ordering::SeqCst);
            },
            false,
            Duration::from_secs(60),
        );
        // The waiter gives up first (the client's connection closes).
        assert!(tokio::time::timeout(Duration::from_millis(10), fut)
            .await
            .is_err());
        assert!(!done.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(done.load(Ordering::SeqCst), "it ran to the end anyway");
    }

    #[tokio::test]
    async fn a_future_awaited_to_the_end_gives_its_output_once() {
        assert_eq!(
            finish_on_drop(async { 7 }, false, Duration::from_secs(1)).await,
            7
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_future_runs_to_its_limit_and_a_cancellable_one_not_at_all() {
        for (cancel, limit, want) in [(false, 5, false), (false, 60, true), (true, 60, false)] {
            let done = Arc::new(AtomicBool::new(false));
            let d = done.clone();
            let fut = finish_on_drop(
                async move {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    d.store(true, Ordering::SeqCst);
                },
                cancel,
                Duration::from_secs(limit),
            );
            assert!(tokio::time::timeout(Duration::from_millis(10), fut)
                .await
                .is_err());
            tokio::time::sleep(Duration::from_secs(20)).await;
            assert_eq!(
                done.load(Ordering::SeqCst),
                want,
                "cancel {cancel}, limit {limit} s"
            );
        }
    }
}
