//! The gateway's request errors and their one table: [`ProxyError::class`] gives, for every
//! error, the HTTP status, the JSON-RPC error code, the `data.reason` clients see, the metric
//! it is counted under, the log level and whose fault it is. The response, the log line and
//! the metric all derive from it; JSON-RPC error objects are built only by
//! [`crate::jsonrpc::error_body`].
//!
//! Client-facing text is the error's own `Display`, which never includes the underlying
//! library error (hyper's text is internal detail); the log line adds the source chain.
//!
//! Knows HTTP status codes and JSON-RPC codes; nothing of sessions beyond their error types.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use serde_json::Value;
use tracing::Level;

use crate::cursor::CursorError;
use crate::exchange::BoxError;
use crate::jsonrpc;
use crate::metrics::{Metrics, RejectReason, ResumeOutcome, UpstreamErrorKind};
use crate::session::{AtCapacity, ResumeError};

/// JSON-RPC error codes the gateway writes in its own error bodies.
pub(crate) mod codes {
    /// Generic gateway/transport error (as the SDKs use for transport problems).
    pub(crate) const GATEWAY: i64 = -32000;
    /// Session not found (the code the SDKs use for it).
    pub(crate) const SESSION_NOT_FOUND: i64 = -32001;
    /// Resumption failed (also used inside streams, see `session`).
    pub(crate) const RESUMPTION_FAILED: i64 = crate::jsonrpc::ERROR_CODE_RESUMPTION_FAILED;
    /// Upstream unavailable or failed.
    pub(crate) const UPSTREAM: i64 = crate::jsonrpc::ERROR_CODE_UPSTREAM_FAILED;
}

/// Everything a request can fail with before a normal response exists.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    #[error("Mcp-Session-Id must be one visible-ASCII value")]
    BadSessionHeader,
    #[error("the request target must be a path")]
    BadTarget,
    #[error("an HTTP/1.1 request carries exactly one Host header, a valid authority")]
    BadHost,
    #[error("CONNECT is not served: this is a reverse proxy for one MCP server")]
    Connect,
    #[error("malformed Last-Event-ID: {0}")]
    MalformedCursor(CursorError),
    #[error("session not found: it expired, was deleted, or was never seen by this gateway")]
    UnknownSession,
    #[error("resumption failed: {0}")]
    Resume(ResumeError),
    #[error("request body larger than {0} bytes")]
    BodyTooLarge(usize),
    #[error("could not read the request body")]
    BodyRead(#[source] BoxError),
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(std::time::Duration),
    #[error("the gateway holds as many request bodies as it may ({0} bytes, --max-buffered-request-bytes); retry shortly")]
    BodiesFull(usize),
    #[error("{0}")]
    AtCapacity(AtCapacity),
    #[error("upstream unavailable")]
    Upstream(#[source] crate::upstream::SendError),
    #[error("the gateway has no upstream connection for this caller: its bound of {0} (--max-upstream-connections) is reached, or the caller holds its fair part of it; retry shortly")]
    UpstreamConnections(usize),
    #[error("this session has {0} calls still running whose clients left (--max-detached-calls); resume or wait for one of them first")]
    DetachedCalls(usize),
    #[error("the upstream did not answer within {0:?}")]
    UpstreamTimeout(std::time::Duration),
    #[error("Origin not allowed")]
    OriginNotAllowed,
    #[error("request id {0} was already sent in this session and its stream cannot be resumed from the start; resume it with the Last-Event-ID of its stream")]
    DuplicateRequest(String),
    #[error("request id {0} is in flight in this session for another caller; use another id")]
    RequestInFlight(String),
    #[error("the fleet's store did not answer in time for this request (--store-timeout, a store that refuses writes, or this replica's requests to it are queued), and it cannot be served safely without it; retry shortly")]
    StoreUnanswered,
}

/// Whose fault an error is (as pingora tags its errors): what an operator should look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The client sent something the gateway cannot serve (4xx; logged at debug).
    Client,
    /// The upstream failed or was too slow (502/504; logged at warn).
    Upstream,
    /// The gateway itself cannot serve it now: a limit of its own (503; logged at warn).
    Gateway,
}

/// The metric an error is counted under: a family and its label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counted {
    /// `resumes_total{outcome}`.
    Resume(ResumeOutcome),
    /// `upstream_errors_total{kind}`.
    Upstream(UpstreamErrorKind),
    /// `requests_rejected_total{reason}`.
    Rejected(RejectReason),
}

/// One row of the error table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Class {
    pub status: StatusCode,
    /// JSON-RPC `error.code`.
    pub code: i64,
    /// JSON-RPC `error.data.reason`: stable, documented in docs/protocol.md.
    pub reason: &'static str,
    pub counted: Counted,
    pub level: Level,
    pub fault: Fault,
}

impl ProxyError {
    /// The error table: one exhaustive match, everything else derives from it.
    pub(crate) fn class(&self) -> Class {
        use Counted::{Rejected, Resume, Upstream};
        use Fault::{Client, Gateway, Upstream as Up};
        let (status, code, reason, counted, fault) = match self {
            ProxyError::BadSessionHeader => (
                StatusCode::BAD_REQUEST,
                codes::GATEWAY,
                "bad-session-header",
                Rejected(RejectReason::BadSessionHeader),
                Client,
            ),
            ProxyError::MalformedCursor(_) => (
                StatusCode::BAD_REQUEST,
                codes::RESUMPTION_FAILED,
                "malformed-cursor",
                Resume(ResumeOutcome::MalformedCursor),
                Client,
            ),
            ProxyError::UnknownSession => (
                StatusCode::NOT_FOUND,
                codes::SESSION_NOT_FOUND,
                "unknown-session",
                Resume(ResumeOutcome::UnknownSession),
                Client,
            ),
            ProxyError::Resume(r) => {
                let (reason, label) = match r {
                    ResumeError::ForeignCursor => ("foreign-cursor", ResumeOutcome::ForeignCursor),
                    ResumeError::CursorAhead => ("cursor-ahead", ResumeOutcome::CursorAhead),
                    ResumeError::Gap => ("gap", ResumeOutcome::Gap),
                    ResumeError::StreamExpired => ("stream-expired", ResumeOutcome::StreamExpired),
                    ResumeError::StreamEnded => ("stream-ended", ResumeOutcome::StreamEnded),
                };
                (
                    StatusCode::CONFLICT,
                    codes::RESUMPTION_FAILED,
                    reason,
                    Resume(label),
                    Client,
                )
            }
            ProxyError::BodyTooLarge(_) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                codes::GATEWAY,
                "body-too-large",
                Rejected(RejectReason::BodyTooLarge),
                Client,
            ),
            ProxyError::BodyRead(_) => (
                StatusCode::BAD_REQUEST,
                codes::GATEWAY,
                "body-read",
                Rejected(RejectReason::BodyRead),
                Client,
            ),
            ProxyError::BodyTimeout(_) => (
                StatusCode::REQUEST_TIMEOUT,
                codes::GATEWAY,
                "body-timeout",
                Rejected(RejectReason::BodyTimeout),
                Client,
            ),
            ProxyError::BodiesFull(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                codes::GATEWAY,
                "request-bodies-full",
                Rejected(RejectReason::BodiesFull),
                Gateway,
            ),
            ProxyError::AtCapacity(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                codes::GATEWAY,
                "session-cap",
                Rejected(RejectReason::AtCapacity),
                Gateway,
            ),
            ProxyError::Upstream(e) => (
                StatusCode::BAD_GATEWAY,
                codes::UPSTREAM,
                "upstream-unavailable",
                Upstream(if e.is_connect() {
                    UpstreamErrorKind::Connect
                } else {
                    UpstreamErrorKind::Request
                }),
                Up,
            ),
            ProxyError::UpstreamConnections(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                codes::GATEWAY,
                "upstream-connections",
                Rejected(RejectReason::UpstreamConnections),
                Gateway,
            ),
            ProxyError::DetachedCalls(_) => (
                StatusCode::TOO_MANY_REQUESTS,
                codes::GATEWAY,
                "detached-calls",
                Rejected(RejectReason::DetachedCalls),
                Client,
            ),
            ProxyError::UpstreamTimeout(_) => (
                StatusCode::GATEWAY_TIMEOUT,
                codes::UPSTREAM,
                "upstream-timeout",
                Upstream(UpstreamErrorKind::Timeout),
                Up,
            ),
            ProxyError::BadTarget => (
                StatusCode::BAD_REQUEST,
                codes::GATEWAY,
                "bad-target",
                Rejected(RejectReason::BadTarget),
                Client,
            ),
            ProxyError::BadHost => (
                StatusCode::BAD_REQUEST,
                codes::GATEWAY,
                "bad-host",
                Rejected(RejectReason::BadHost),
                Client,
            ),
            ProxyError::Connect => (
                StatusCode::METHOD_NOT_ALLOWED,
                codes::GATEWAY,
                "method-not-allowed",
                Rejected(RejectReason::Connect),
                Client,
            ),
            ProxyError::OriginNotAllowed => (
                StatusCode::FORBIDDEN,
                codes::GATEWAY,
                "origin-not-allowed",
                Rejected(RejectReason::OriginNotAllowed),
                Client,
            ),
            ProxyError::DuplicateRequest(_) => (
                StatusCode::CONFLICT,
                codes::RESUMPTION_FAILED,
                "duplicate-request",
                Resume(ResumeOutcome::DuplicateRequest),
                Client,
            ),
            ProxyError::RequestInFlight(_) => (
                StatusCode::CONFLICT,
                codes::GATEWAY,
                "request-in-flight",
                Rejected(RejectReason::RequestInFlight),
                Client,
            ),
            ProxyError::StoreUnanswered => (
                StatusCode::SERVICE_UNAVAILABLE,
                codes::GATEWAY,
                "store-unavailable",
                Rejected(RejectReason::StoreUnanswered),
                Gateway,
            ),
        };
        // Routine client-side answers (unknown session, stale cursor, 413, …) are not
        // operator news; what the upstream or the gateway failed at is.
        let level = match fault {
            Client => Level::DEBUG,
            Up | Gateway => Level::WARN,
        };
        Class {
            status,
            code,
            reason,
            counted,
            level,
            fault,
        }
    }

    /// The error for a request the upstream client could not send: the bound on upstream
    /// connections when that is why, else the upstream's own failure.
    pub(crate) fn upstream(e: crate::upstream::SendError) -> ProxyError {
        match e.at_limit() {
            Some(max) => ProxyError::UpstreamConnections(max),
            None => ProxyError::Upstream(e),
        }
    }

    /// This error as the answer to the JSON-RPC request `id` (if the request had one).
    pub(crate) fn for_request(self, id: Option<Value>) -> Refusal {
        Refusal { error: self, id }
    }

    /// The error with its sources, for the log (never for clients).
    pub(crate) fn detail(&self) -> String {
        let mut out = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            out.push_str(": ");
            out.push_str(&s.to_string());
            source = s.source();
        }
        out
    }
}

/// The methods the gateway serves (its `Allow` header).
pub(crate) const ALLOWED_METHODS: &str = "GET, POST, DELETE, OPTIONS";

/// A request the gateway answers with an error: the error and the JSON-RPC id of the request
/// it answers (a single request; `null` otherwise).
#[derive(Debug)]
pub(crate) struct Refusal {
    pub error: ProxyError,
    pub id: Option<Value>,
}

impl From<ProxyError> for Refusal {
    fn from(error: ProxyError) -> Refusal {
        Refusal { error, id: None }
    }
}

impl Refusal {
    /// Counts the refusal, logs it at its level, and builds its response: status, a
    /// JSON-RPC error body naming the cause, and `Retry-After` for a 503 or 429.
    pub(crate) fn respond(self, method: &http::Method, metrics: &Metrics) -> Response<Bytes> {
        let class = self.error.class();
        match class.counted {
            Counted::Resume(l) => metrics.resume(l),
            Counted::Upstream(l) => metrics.upstream_error(l),
            Counted::Rejected(l) => metrics.rejected(l),
        }
        let detail = self.error.detail();
        let reason = class.reason;
        let fault = format!("{:?}", class.fault).to_lowercase();
        if class.level == Level::WARN {
            tracing::warn!(http.method = %method, error = %detail, reason, fault, "request failed");
        } else {
            tracing::debug!(http.method = %method, error = %detail, reason, fault, "request refused");
        }
        let message = format!("mcp-reattach: {}", self.error);
        let body = jsonrpc::error_body(self.id.as_ref(), class.code, &message, reason);
        let mut resp = Response::new(body);
        *resp.status_mut() = class.status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if class.status == StatusCode::METHOD_NOT_ALLOWED {
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
        }
        if matches!(
            class.status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// One of every variant (and every `ResumeError`), except `Upstream`, whose hyper error
    /// cannot be built outside a failed request (tests/fast/gateway.rs covers it end to end).
    fn every_error() -> Vec<ProxyError> {
        vec![
            ProxyError::BadSessionHeader,
            ProxyError::BadTarget,
            ProxyError::BadHost,
            ProxyError::Connect,
            ProxyError::MalformedCursor(CursorError::Malformed),
            ProxyError::UnknownSession,
            ProxyError::Resume(ResumeError::ForeignCursor),
            ProxyError::Resume(ResumeError::CursorAhead),
            ProxyError::Resume(ResumeError::Gap),
            ProxyError::Resume(ResumeError::StreamExpired),
            ProxyError::Resume(ResumeError::StreamEnded),
            ProxyError::BodyTooLarge(10),
            ProxyError::BodyRead("hyper said: connection reset by peer".into()),
            ProxyError::BodyTimeout(Duration::from_secs(1)),
            ProxyError::BodiesFull(64 << 20),
            ProxyError::AtCapacity(AtCapacity),
            ProxyError::UpstreamTimeout(Duration::from_secs(1)),
            ProxyError::Upstream(crate::upstream::SendError::Closed),
            ProxyError::UpstreamConnections(8),
            ProxyError::DetachedCalls(16),
            ProxyError::OriginNotAllowed,
            ProxyError::DuplicateRequest("7".into()),
            ProxyError::RequestInFlight("5".into()),
            ProxyError::StoreUnanswered,
        ]
    }

    #[test]
    fn status_fault_level_and_code_agree_for_every_error() {
        let mut reasons = std::collections::HashSet::new();
        for e in every_error() {
            let c = e.class();
            match c.fault {
                Fault::Client => {
                    assert!(c.status.is_client_error(), "{e:?}: client fault is 4xx");
                    assert_eq!(c.level, Level::DEBUG, "{e:?}");
                }
                Fault::Upstream => {
                    assert!(
                        matches!(c.status.as_u16(), 502 | 504),
                        "{e:?}: upstream fault is 502/504"
                    );
                    assert_eq!(c.code, codes::UPSTREAM, "{e:?}");
                    assert_eq!(c.level, Level::WARN, "{e:?}");
                    assert!(matches!(c.counted, Counted::Upstream(_)), "{e:?}");
                }
                Fault::Gateway => {
                    assert_eq!(c.status, StatusCode::SERVICE_UNAVAILABLE, "{e:?}");
                    assert_eq!(c.level, Level::WARN, "{e:?}");
                }
            }
            if matches!(c.counted, Counted::Resume(_)) {
                assert!(
                    c.code == codes::RESUMPTION_FAILED || c.code == codes::SESSION_NOT_FOUND,
                    "{e:?}: resume failures carry a resumption code"
                );
            }
            assert!(
                c.reason
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'-'),
                "{e:?}: reason {} is kebab-case",
                c.reason
            );
            assert!(
                reasons.insert(c.reason),
                "{e:?}: reason {} unique",
                c.reason
            );
        }
    }

    #[test]
    fn the_response_carries_the_table_row_the_id_and_no_library_text() {
        let metrics = Metrics::new();
        for e in every_error() {
            let c = e.class();
            let resp = e
                .for_request(Some(Value::from(42)))
                .respond(&http::Method::POST, &metrics);
            assert_eq!(resp.status(), c.status);
            assert_eq!(resp.headers()["content-type"], "application/json");
            assert_eq!(
                resp.headers().contains_key("retry-after"),
                matches!(c.status.as_u16(), 503 | 429)
            );
            let body: Value = serde_json::from_slice(resp.body()).unwrap();
            assert_eq!(body["id"], 42);
            assert_eq!(body["error"]["code"], c.code);
            assert_eq!(body["error"]["data"]["reason"], c.reason);
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.starts_with("mcp-reattach: "));
            assert!(!message.contains("hyper said"), "{message}");
        }
        let text = metrics.encode();
        assert!(
            text.contains(r#"mcp_reattach_requests_rejected_total{reason="body_read"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"resumes_total{outcome="gap"} 1"#), "{text}");
    }

    #[test]
    fn the_log_detail_keeps_the_source() {
        let e = ProxyError::BodyRead("hyper said: connection reset by peer".into());
        assert_eq!(e.to_string(), "could not read the request body");
        assert_eq!(
            e.detail(),
            "could not read the request body: hyper said: connection reset by peer"
        );
    }
}
