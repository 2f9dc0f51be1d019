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
mod fleet;
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

use http::header::HeaderName;
use http::{Method, Request, Response};
use tracing::Instrument;

use self::inbound::{classify, Inbound, Route};
use crate::access::{AccessLog, Observed, Requested};
use crate::config::Config;
use crate::error::{ProxyError, Refusal};

use crate::metrics::Metrics;
use crate::session::{hash_id, Registry};
use crate::store::Store;
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
        registry.on_end(fleet::on_end(
            store.clone(),
            fleet::end_upstream(upstream.clone(), cfg.upstream_header_timeout),
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
        // The session the request names, held here or adopted from the fleet's store (the
        // fleet layer, `fleet.rs`); a stranger's claim in the fleet is held until the head.
        let (held, _strangers_claim) = self.find(&mut inb).await?;
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
