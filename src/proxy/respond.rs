//! The responses the gateway writes around its streams: an attached client's SSE response,
//! an upstream answer passed through, the SSE headers.
//!
//! Knows HTTP responses and the attach body; nothing of routes.

use std::sync::Arc;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::BodyExt;

use super::orphans::Facts;
use super::Gateway;
use crate::access::StreamStats;
use crate::attach::AttachBody;
use crate::config::Priming;
use crate::error::ALLOWED_METHODS;
use crate::exchange::{BoxError, ResBody, MCP_SESSION_ID};
use crate::jsonrpc;
use crate::session::{Session, Whole};
use crate::upstream::{full_body, strip_hop_by_hop, OwnBody};

const X_ACCEL_BUFFERING: HeaderName = HeaderName::from_static("x-accel-buffering");

impl Gateway {
    /// Whether a client of a session at this protocol version gets a priming event.
    pub(super) fn prime(&self, version: Option<&str>) -> bool {
        match self.cfg.priming {
            Priming::Always => true,
            Priming::Never => false,
            Priming::Auto => version.is_some_and(jsonrpc::primes),
        }
    }

    /// The SSE response of a client attached to a stream of session `sid` (with the
    /// upstream's headers when the stream is the upstream's answer). `facts` learns the
    /// stream's counts for the access line.
    pub(super) fn sse_response(
        &self,
        facts: &Facts,
        status: StatusCode,
        upstream_headers: Option<HeaderMap>,
        sid: &str,
        body: AttachBody,
    ) -> Response<ResBody> {
        facts.stream_stats(body.stats());
        let body = body.map_err(|never| match never {}).boxed_unsync();
        sse_response(status, upstream_headers, sid, body)
    }

    /// The SSE response of a resume served from the fleet's store.
    pub(super) fn followed_response(
        &self,
        sid: &str,
        body: crate::store::FollowBody,
    ) -> Response<ResBody> {
        let body = body.map_err(|never| match never {}).boxed_unsync();
        sse_response(StatusCode::OK, None, sid, body)
    }

    /// The SSE response of the first client of a stream opened whole
    /// ([`Session::open_whole`]): served, it is written with its length, in one piece, with
    /// no keep-alive timer and no attached body to poll; else its body streams as usual.
    pub(super) fn whole_response(
        &self,
        facts: &Facts,
        status: StatusCode,
        upstream_headers: Option<HeaderMap>,
        session: Arc<Session>,
        whole: Whole,
    ) -> Response<ResBody> {
        match whole {
            Whole::Served {
                body,
                events,
                outcome,
            } => {
                let stats = StreamStats::new(0);
                stats.add_events(events);
                stats.set_outcome(outcome);
                facts.stream_stats(stats);
                sse_response(status, upstream_headers, session.id(), full_body(body))
            }
            Whole::Attached { attachment, handed } => {
                let body = AttachBody::new(session.clone(), attachment, self.cfg.keepalive);
                body.stats().add_events(handed);
                self.sse_response(facts, status, upstream_headers, session.id(), body)
            }
        }
    }
}

fn sse_response(
    status: StatusCode,
    upstream_headers: Option<HeaderMap>,
    sid: &str,
    body: ResBody,
) -> Response<ResBody> {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    if let Some(mut h) = upstream_headers {
        strip_hop_by_hop(&mut h);
        h.remove(header::CONTENT_LENGTH);
        *resp.headers_mut() = h;
    }
    sse_headers(resp.headers_mut(), sid);
    resp
}

/// `OPTIONS *`: what the gateway serves, and nothing forwarded.
pub(super) fn asterisk() -> Response<ResBody> {
    let mut resp = Response::new(full_body(bytes::Bytes::new()));
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
    resp
}

/// An upstream answer as it came, less its hop-by-hop headers.
pub(super) fn pass_through(resp: Response<OwnBody>) -> Response<ResBody> {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body.map_err(BoxError::from).boxed_unsync())
}

/// A response in a session the gateway minted names it (the upstream's answer did not).
pub(super) fn minted_header(h: &mut HeaderMap, session: &crate::session::Session) {
    if let Ok(v) = HeaderValue::from_str(session.id()) {
        h.insert(MCP_SESSION_ID, v);
    }
}

/// The headers of an SSE response the gateway serves for session `sid`.
pub(super) fn sse_headers(h: &mut HeaderMap, sid: &str) {
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(X_ACCEL_BUFFERING, HeaderValue::from_static("no"));
    h.remove(header::CONTENT_ENCODING);
    if let Ok(v) = HeaderValue::from_str(sid) {
        h.insert(MCP_SESSION_ID, v);
    }
}
