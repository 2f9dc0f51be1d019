//! The HTTP layer: classifies each client request (resume, live attach, legacy forward,
//! modern pass-through), forwards to the upstream over pooled connections, turns upstream
//! SSE responses into tagged streams, and maps every error to one response in one place.
//!
//! Knows HTTP and the session API; the rules of tagging, retention and re-attach live in
//! `session`.

use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Notify;

use crate::access::{AccessLog, Observed, StreamStats};
use crate::attach::AttachBody;
use crate::config::{Config, Priming, ResumeAuth};
use crate::cursor::{Cursor, CursorError};
use crate::jsonrpc::{self, PostInfo};
use crate::metrics::Metrics;
use crate::session::{
    AtCapacity, End, Eviction, Registry, Resume, ResumeError, Session, StreamKind,
};
use crate::sse::Decoder;

/// Boxed error of bodies flowing through the gateway.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Body of every response the gateway sends.
pub type ResBody = UnsyncBoxBody<Bytes, BoxError>;
type UpBody = UnsyncBoxBody<Bytes, BoxError>;

pub const MCP_SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");
pub const MCP_PROTOCOL_VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");
pub const LAST_EVENT_ID: HeaderName = HeaderName::from_static("last-event-id");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_ACCEL_BUFFERING: HeaderName = HeaderName::from_static("x-accel-buffering");

/// JSON-RPC error codes the gateway writes in its own error bodies.
pub mod codes {
    /// Generic gateway/transport error (as the SDKs use for transport problems).
    pub const GATEWAY: i64 = -32000;
    /// Session not found (the code the SDKs use for it).
    pub const SESSION_NOT_FOUND: i64 = -32001;
    /// Resumption failed (also used inside streams, see `session`).
    pub const RESUMPTION_FAILED: i64 = crate::session::ERROR_CODE_RESUMPTION_FAILED;
    /// Upstream unavailable or failed.
    pub const UPSTREAM: i64 = crate::session::ERROR_CODE_UPSTREAM_FAILED;
}

/// Everything a request can fail with before a normal response exists. One exhaustive
/// mapping to status and body: [`ProxyError::into_response`].
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("Mcp-Session-Id must be visible ASCII")]
    BadSessionHeader,
    #[error("malformed Last-Event-ID: {0}")]
    MalformedCursor(CursorError),
    #[error("session not found: it expired, was deleted, or was never seen by this gateway")]
    UnknownSession,
    #[error("resumption failed: {0}")]
    Resume(ResumeError),
    #[error("request body larger than {0} bytes")]
    BodyTooLarge(usize),
    #[error("could not read the request body: {0}")]
    BodyRead(BoxError),
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(std::time::Duration),
    #[error("{0}")]
    AtCapacity(AtCapacity),
    #[error("upstream unavailable: {0}")]
    Upstream(hyper_util::client::legacy::Error),
    #[error("the upstream did not answer within {0:?}")]
    UpstreamTimeout(std::time::Duration),
    #[error("Origin not allowed")]
    OriginNotAllowed,
}

impl ProxyError {
    fn reason(&self) -> &'static str {
        match self {
            ProxyError::BadSessionHeader => "bad-session-header",
            ProxyError::MalformedCursor(_) => "malformed-cursor",
            ProxyError::UnknownSession => "unknown-session",
            ProxyError::Resume(ResumeError::ForeignCursor) => "foreign-cursor",
            ProxyError::Resume(ResumeError::CursorAhead) => "cursor-ahead",
            ProxyError::Resume(ResumeError::Gap) => "gap",
            ProxyError::Resume(ResumeError::StreamExpired) => "stream-expired",
            ProxyError::Resume(ResumeError::StreamEnded) => "stream-ended",
            ProxyError::BodyTooLarge(_) => "body-too-large",
            ProxyError::BodyRead(_) => "body-read",
            ProxyError::BodyTimeout(_) => "body-timeout",
            ProxyError::AtCapacity(_) => "session-cap",
            ProxyError::Upstream(_) => "upstream-unavailable",
            ProxyError::UpstreamTimeout(_) => "upstream-timeout",
            ProxyError::OriginNotAllowed => "origin-not-allowed",
        }
    }

    /// The response for this error, with a JSON-RPC error body naming the cause.
    pub fn into_response(self, id: Option<&serde_json::Value>) -> Response<ResBody> {
        let (status, code) = match &self {
            ProxyError::BadSessionHeader => (StatusCode::BAD_REQUEST, codes::GATEWAY),
            ProxyError::MalformedCursor(_) => (StatusCode::BAD_REQUEST, codes::RESUMPTION_FAILED),
            ProxyError::UnknownSession => (StatusCode::NOT_FOUND, codes::SESSION_NOT_FOUND),
            ProxyError::Resume(_) => (StatusCode::CONFLICT, codes::RESUMPTION_FAILED),
            ProxyError::BodyTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, codes::GATEWAY),
            ProxyError::BodyRead(_) => (StatusCode::BAD_REQUEST, codes::GATEWAY),
            ProxyError::BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, codes::GATEWAY),
            ProxyError::AtCapacity(_) => (StatusCode::SERVICE_UNAVAILABLE, codes::GATEWAY),
            ProxyError::Upstream(_) => (StatusCode::BAD_GATEWAY, codes::UPSTREAM),
            ProxyError::UpstreamTimeout(_) => (StatusCode::GATEWAY_TIMEOUT, codes::UPSTREAM),
            ProxyError::OriginNotAllowed => (StatusCode::FORBIDDEN, codes::GATEWAY),
        };
        let message = format!("mcp-reattach: {self}");
        let body = jsonrpc::error_body(id, code, &message, self.reason());
        let mut resp = Response::new(full(body));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

fn full(b: Bytes) -> ResBody {
    Full::new(b).map_err(|never| match never {}).boxed_unsync()
}

/// Per-connection facts the handler needs.
#[derive(Clone, Debug)]
pub struct Conn {
    pub remote: SocketAddr,
    /// Notified to close the client connection (a stalled client whose body cannot be polled).
    pub kill: Arc<Notify>,
}

/// The gateway: configuration, the session registry and the upstream client.
pub struct Gateway {
    cfg: Arc<Config>,
    registry: Arc<Registry>,
    client: Client<HttpConnector, UpBody>,
    hurry: Notify,
    /// Random per process: principals are hashed with it, never stored in the clear.
    principal_key: std::collections::hash_map::RandomState,
}

impl Gateway {
    pub fn new(cfg: Config) -> Arc<Gateway> {
        let cfg = Arc::new(cfg);
        let metrics = Arc::new(Metrics::new());
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(cfg.upstream_connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(std::time::Duration::from_secs(60))
            // Without a timer the idle timeout is never applied and idle upstream
            // connections stay open at the peak concurrency.
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(connector);
        Arc::new(Gateway {
            registry: Arc::new(Registry::new(cfg.clone(), metrics)),
            cfg,
            client,
            hurry: Notify::new(),
            principal_key: std::collections::hash_map::RandomState::new(),
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Cuts a drain short (SIGINT): remaining streams are ended at once.
    pub fn hurry(&self) {
        self.hurry.notify_one();
    }

    pub(crate) async fn hurried(&self) {
        self.hurry.notified().await;
    }

    /// The Prometheus text exposition of the gateway's metrics, gauges refreshed.
    pub fn render_metrics(&self) -> String {
        self.registry.refresh_gauges();
        self.registry.metrics().encode()
    }

    /// Handles one client request. Never fails: errors become responses.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        conn: Conn,
    ) -> Result<Response<Observed<ResBody>>, Infallible> {
        let start = tokio::time::Instant::now();
        let method = req.method().clone();
        let session = req
            .headers()
            .get(MCP_SESSION_ID)
            .map(|v| crate::session::hash_id(&String::from_utf8_lossy(v.as_bytes())));
        let mut resp = match self.route(req, &conn).await {
            Ok(r) => r,
            Err((e, id)) => {
                self.count_failure(&e);
                tracing::warn!(http.method = %method, error = %e, "request failed");
                e.into_response(id.as_ref())
            }
        };
        let stream = resp.extensions_mut().remove::<Arc<StreamStats>>();
        let session = session.or_else(|| {
            resp.headers()
                .get(MCP_SESSION_ID)
                .map(|v| crate::session::hash_id(&String::from_utf8_lossy(v.as_bytes())))
        });
        let log = AccessLog::new(
            method,
            resp.status(),
            start,
            session,
            stream,
            self.registry.metrics().clone(),
        );
        Ok(resp.map(|b| Observed::new(b, log)))
    }

    fn count_failure(&self, e: &ProxyError) {
        let m = self.registry.metrics();
        match e {
            ProxyError::MalformedCursor(_) => m.resume("malformed_cursor"),
            ProxyError::UnknownSession => m.resume("unknown_session"),
            ProxyError::Resume(r) => m.resume(match r {
                ResumeError::ForeignCursor => "foreign_cursor",
                ResumeError::CursorAhead => "cursor_ahead",
                ResumeError::Gap => "gap",
                ResumeError::StreamExpired => "stream_expired",
                ResumeError::StreamEnded => "stream_ended",
            }),
            ProxyError::Upstream(e) if e.is_connect() => m.upstream_error("connect"),
            ProxyError::Upstream(_) => m.upstream_error("request"),
            ProxyError::UpstreamTimeout(_) => m.upstream_error("timeout"),
            ProxyError::BadSessionHeader => m.rejected("bad_session_header"),
            ProxyError::BodyTooLarge(_) => m.rejected("body_too_large"),
            ProxyError::BodyRead(_) => m.rejected("body_read"),
            ProxyError::BodyTimeout(_) => m.rejected("body_timeout"),
            ProxyError::AtCapacity(_) => m.rejected("at_capacity"),
            ProxyError::OriginNotAllowed => m.rejected("origin_not_allowed"),
        }
    }

    async fn route(
        self: &Arc<Self>,
        req: Request<Incoming>,
        conn: &Conn,
    ) -> Result<Response<ResBody>, (ProxyError, Option<serde_json::Value>)> {
        let session_id = match req.headers().get(MCP_SESSION_ID) {
            None => None,
            Some(v) if is_visible_ascii(v.as_bytes()) => {
                Some(String::from_utf8_lossy(v.as_bytes()).into_owned())
            }
            Some(_) => return Err((ProxyError::BadSessionHeader, None)),
        };
        let header_version = req
            .headers()
            .get(MCP_PROTOCOL_VERSION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let modern = header_version.as_deref().is_some_and(jsonrpc::is_modern);

        if !self.cfg.allowed_origins.is_empty() {
            if let Some(origin) = req.headers().get(header::ORIGIN) {
                let ok = self
                    .cfg
                    .allowed_origins
                    .iter()
                    .any(|o| o.as_bytes() == origin.as_bytes());
                if !ok {
                    return Err((ProxyError::OriginNotAllowed, None));
                }
            }
        }
        let principal = self.principal(req.headers());

        if !modern && req.method() == Method::GET {
            if let Some(sid) = &session_id {
                if let Some(cursor) = req.headers().get(LAST_EVENT_ID) {
                    return self
                        .resume(sid, cursor.as_bytes(), &req, principal, conn)
                        .await
                        .map_err(|e| (e, None));
                }
                if let Some(s) = self.registry.get(sid) {
                    if s.has_standalone() && self.authorized(&s, &req, principal).await {
                        let prime = self.prime(
                            header_version
                                .as_deref()
                                .or(s.protocol_version().as_deref()),
                        );
                        if let Some((stream, generation, priming)) =
                            s.attach_standalone(prime, Some(conn.kill.clone()))
                        {
                            tracing::debug!(mcp.session = %crate::session::hash_id(sid), mcp.stream = stream, "attached live to held standalone stream");
                            let body =
                                AttachBody::new(s, stream, generation, priming, self.cfg.keepalive);
                            return Ok(self.sse_response(StatusCode::OK, None, sid, body));
                        }
                    }
                }
            }
        }

        let (parts, body) = req.into_parts();
        let (body, info): (UpBody, PostInfo) = if parts.method == Method::POST {
            // A slow body is cut like a slow head: both are bounded by --header-read-timeout.
            let collect = Limited::new(body, self.cfg.max_request_bytes).collect();
            let bytes = match tokio::time::timeout(self.cfg.header_read_timeout, collect).await {
                Err(_) => {
                    return Err((ProxyError::BodyTimeout(self.cfg.header_read_timeout), None))
                }
                Ok(Ok(c)) => c.to_bytes(),
                Ok(Err(e))
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some() =>
                {
                    return Err((ProxyError::BodyTooLarge(self.cfg.max_request_bytes), None))
                }
                Ok(Err(e)) => return Err((ProxyError::BodyRead(e), None)),
            };
            let info = jsonrpc::inspect_post(&bytes);
            (
                Full::new(bytes)
                    .map_err(|never| match never {})
                    .boxed_unsync(),
                info,
            )
        } else {
            (
                body.map_err(BoxError::from).boxed_unsync(),
                PostInfo::default(),
            )
        };
        let single_id = info.single_id.clone();
        let modern = modern || info.version.as_deref().is_some_and(jsonrpc::is_modern);
        if !modern && info.initialize && session_id.is_none() {
            self.registry
                .reserve()
                .map_err(|e| (ProxyError::AtCapacity(e), single_id.clone()))?;
        }
        if let Some(s) = session_id
            .as_deref()
            .filter(|_| !modern)
            .and_then(|sid| self.registry.get(sid))
        {
            s.touch();
            if let Some(v) = &header_version {
                s.set_protocol_version(v);
            }
        }

        // Requests that cannot get a stream back must be answered promptly; anything that may
        // stream (a GET, a POST carrying requests) has no upstream timeout.
        let can_stream = parts.method == Method::GET
            || (parts.method == Method::POST && !info.request_ids.is_empty());
        // Kept to resume the upstream stream if the upstream closes it early.
        let forwarded = parts.headers.clone();
        let upstream_req = self.upstream_request(
            parts.method.clone(),
            parts.uri.clone(),
            parts.headers,
            body,
            Some(conn.remote),
        );
        let pending = self.client.request(upstream_req);
        let resp = if can_stream {
            pending
                .await
                .map_err(|e| (ProxyError::Upstream(e), single_id.clone()))?
        } else {
            match tokio::time::timeout(self.cfg.upstream_header_timeout, pending).await {
                Ok(r) => r.map_err(|e| (ProxyError::Upstream(e), single_id.clone()))?,
                Err(_) => {
                    return Err((
                        ProxyError::UpstreamTimeout(self.cfg.upstream_header_timeout),
                        single_id,
                    ))
                }
            }
        };

        if modern {
            return Ok(pass_through(resp));
        }
        let status = resp.status();
        if let Some(sid) = &session_id {
            if status == StatusCode::NOT_FOUND {
                self.registry.remove(sid, Eviction::Upstream404);
            } else if parts.method == Method::DELETE && status.is_success() {
                self.registry.remove(sid, Eviction::Delete);
            }
        }
        let resp_sid = resp
            .headers()
            .get(MCP_SESSION_ID)
            .filter(|v| is_visible_ascii(v.as_bytes()))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .or(session_id);
        let Some(sid) = resp_sid.filter(|_| status.is_success() && parts.method != Method::DELETE)
        else {
            return Ok(pass_through(resp));
        };
        let session = match self.registry.get_or_create(&sid, principal) {
            Ok(s) => s,
            Err(_) => {
                tracing::warn!("session cap reached with every session in use; passing the response through untagged");
                return Ok(pass_through(resp));
            }
        };
        if let Some(v) = header_version.as_deref().or(info.version.as_deref()) {
            session.set_protocol_version(v);
        }
        let tag = status == StatusCode::OK
            && is_sse(resp.headers())
            && matches!(parts.method, Method::POST | Method::GET);
        if !tag {
            return Ok(pass_through(resp));
        }
        let kind = if parts.method == Method::POST {
            StreamKind::Post
        } else {
            StreamKind::Standalone
        };
        let prime = self.prime(session.protocol_version().as_deref());
        let (stream, generation, priming) = session.open_stream(
            kind,
            info.request_ids,
            info.initialize,
            prime,
            Some(conn.kill.clone()),
        );
        let (resp_parts, upstream_body) = resp.into_parts();
        let up = Upstream {
            gateway: self.clone(),
            uri: parts.uri.clone(),
            headers: forwarded,
            remote: conn.remote,
        };
        let reader = tokio::spawn(read_upstream(session.clone(), stream, upstream_body, up));
        session.set_reader(stream, reader.abort_handle());
        let body = AttachBody::new(session, stream, generation, priming, self.cfg.keepalive);
        Ok(self.sse_response(resp_parts.status, Some(resp_parts.headers), &sid, body))
    }

    async fn resume(
        &self,
        sid: &str,
        cursor: &[u8],
        req: &Request<Incoming>,
        principal: u64,
        conn: &Conn,
    ) -> Result<Response<ResBody>, ProxyError> {
        let session = self.registry.get(sid).ok_or(ProxyError::UnknownSession)?;
        if !self.authorized(&session, req, principal).await {
            // Exactly the answer for an unknown session: a caller who may not resume learns
            // nothing, not even that the session exists.
            self.registry.metrics().resume("unauthorized");
            tracing::warn!(mcp.session = %crate::session::hash_id(sid), "resume refused: principal mismatch");
            return Err(ProxyError::UnknownSession);
        }
        let cursor = Cursor::parse(cursor).map_err(ProxyError::MalformedCursor)?;
        match session
            .resume(cursor, Some(conn.kill.clone()))
            .map_err(ProxyError::Resume)?
        {
            Resume::Attached {
                stream,
                generation,
                prelude,
                replay,
            } => {
                self.registry.metrics().resume("resumed");
                tracing::debug!(mcp.session = %crate::session::hash_id(sid), mcp.stream = stream, replay, "resumed");
                let body = AttachBody::new(
                    session,
                    stream,
                    generation,
                    Some(prelude),
                    self.cfg.keepalive,
                )
                .with_replayed(replay);
                Ok(self.sse_response(StatusCode::OK, None, sid, body))
            }
            Resume::GapWithErrors { frames } => {
                self.registry.metrics().resume("gap");
                let mut resp = Response::new(full(frames));
                sse_headers(resp.headers_mut(), sid);
                Ok(resp)
            }
        }
    }

    /// The caller's principal: a keyed hash of its principal header (`Authorization` unless
    /// `--principal-header`), absent header included. The key is random per process.
    fn principal(&self, headers: &HeaderMap) -> u64 {
        let name = self
            .cfg
            .principal_header
            .as_ref()
            .unwrap_or(&header::AUTHORIZATION);
        let mut h = self.principal_key.build_hasher();
        match headers.get(name) {
            Some(v) => {
                h.write_u8(1);
                h.write(v.as_bytes());
            }
            None => h.write_u8(0),
        }
        h.finish()
    }

    /// Whether the caller may attach to `session`'s streams, per `--resume-auth`.
    async fn authorized(&self, session: &Session, req: &Request<Incoming>, principal: u64) -> bool {
        match self.cfg.resume_auth {
            ResumeAuth::None => true,
            ResumeAuth::Principal => session.principal() == principal,
            ResumeAuth::Upstream => {
                let ok = self.upstream_accepts(req).await;
                if ok {
                    // Credentials rotate (token refresh): bind to the latest accepted one.
                    session.set_principal(principal);
                }
                ok
            }
        }
    }

    /// Asks the upstream whether the caller's credentials are good for this session: a
    /// JSON-RPC `ping` with the caller's headers must succeed.
    async fn upstream_accepts(&self, req: &Request<Incoming>) -> bool {
        const PING_ID: &str = "mcp-reattach-resume-auth";
        let mut headers = req.headers().clone();
        headers.remove(LAST_EVENT_ID);
        headers.remove(header::CONTENT_LENGTH);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream"),
        );
        let body = format!(r#"{{"jsonrpc":"2.0","id":"{PING_ID}","method":"ping"}}"#);
        let body = Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed_unsync();
        let upstream = self.upstream_request(Method::POST, req.uri().clone(), headers, body, None);
        let check = async {
            let resp = self.client.request(upstream).await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let bytes = Limited::new(resp.into_body(), 1 << 20)
                .collect()
                .await
                .ok()?
                .to_bytes();
            // JSON or SSE: either way the answer is a response to our id with a result.
            let text = String::from_utf8_lossy(&bytes);
            let answered = text.lines().any(|l| {
                let json = l.strip_prefix("data:").map_or(l, str::trim_start);
                serde_json::from_str::<serde_json::Value>(json)
                    .is_ok_and(|v| v["id"] == PING_ID && v.get("result").is_some())
            });
            answered.then_some(())
        };
        matches!(
            tokio::time::timeout(self.cfg.upstream_header_timeout, check).await,
            Ok(Some(()))
        )
    }

    fn prime(&self, version: Option<&str>) -> bool {
        match self.cfg.priming {
            Priming::Always => true,
            Priming::Never => false,
            Priming::Auto => version.is_some_and(jsonrpc::primes),
        }
    }

    fn sse_response(
        &self,
        status: StatusCode,
        upstream_headers: Option<HeaderMap>,
        sid: &str,
        body: AttachBody,
    ) -> Response<ResBody> {
        let stats = body.stats();
        let mut resp = Response::new(body.map_err(|never| match never {}).boxed_unsync());
        resp.extensions_mut().insert(stats);
        *resp.status_mut() = status;
        if let Some(mut h) = upstream_headers {
            strip_hop_by_hop(&mut h);
            h.remove(header::CONTENT_LENGTH);
            *resp.headers_mut() = h;
        }
        sse_headers(resp.headers_mut(), sid);
        resp
    }

    fn upstream_request(
        &self,
        method: Method,
        uri: Uri,
        mut headers: HeaderMap,
        body: UpBody,
        remote: Option<SocketAddr>,
    ) -> Request<UpBody> {
        let pq = uri.path_and_query().map_or("/", |pq| pq.as_str());
        let base = &self.cfg.upstream;
        let target = format!(
            "{}://{}{}",
            base.scheme_str().unwrap_or("http"),
            base.authority().map_or("", |a| a.as_str()),
            pq
        );
        if !headers.contains_key(header::HOST) {
            // HTTP/2 clients send :authority instead; forward it as Host, unchanged.
            if let Some(a) = uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            {
                headers.insert(header::HOST, a);
            }
        }
        strip_hop_by_hop(&mut headers);
        if let Some(remote) = remote {
            let ip = remote.ip().to_string();
            let xff = match headers.get(X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
                Some(prev) => format!("{prev}, {ip}"),
                None => ip,
            };
            if let Ok(v) = HeaderValue::from_str(&xff) {
                headers.insert(X_FORWARDED_FOR, v);
            }
        }
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        // Upstream connections are HTTP/1.1 whatever the client spoke (the request's
        // version is left at its default).
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = target.parse().unwrap_or_else(|_| base.clone());
        *req.headers_mut() = headers;
        req
    }
}

/// What the gateway needs to reconnect to an upstream stream that closed early.
struct Upstream {
    gateway: Arc<Gateway>,
    uri: Uri,
    headers: HeaderMap,
    remote: SocketAddr,
}

/// Most upstream bytes the reader takes in one go before tagging them.
const READ_BATCH_BYTES: usize = 256 * 1024;

/// The next frame of `body` if it is ready now, without waiting.
async fn ready_frame(
    body: &mut Incoming,
) -> Option<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(
            match http_body::Body::poll_frame(std::pin::Pin::new(&mut *body), cx) {
                std::task::Poll::Ready(f) => Some(f),
                std::task::Poll::Pending => None,
            },
        )
    })
    .await
}

/// Consecutive failed reconnects to an upstream stream before the gateway gives up on it.
const UPSTREAM_RESUME_ATTEMPTS: u32 = 3;
/// The longest `retry:` wait the gateway honours before reconnecting upstream.
const MAX_UPSTREAM_RETRY: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads a tagged upstream stream to its end, whether or not a client is attached.
///
/// An upstream that sets its own ids may close a stream before it is done (2025-11-25 "SSE
/// polling"); the gateway then resumes it upstream with `Last-Event-ID` (honouring `retry:`),
/// the way a client would, and keeps appending to the same stream: while a POST stream still
/// has unanswered requests, and for the standalone stream while the session lives.
async fn read_upstream(session: Arc<Session>, stream: u32, mut body: Incoming, up: Upstream) {
    let registry = up.gateway.registry.clone();
    let metrics = registry.metrics().clone();
    let max_event_bytes = up.gateway.cfg.max_event_bytes;
    let mut last_upstream_id: Option<String> = None;
    let mut retry: Option<u64> = None;
    let mut failures = 0;
    let end = 'outer: loop {
        let mut decoder = Decoder::new(max_event_bytes);
        let mut events = Vec::new();
        let end = loop {
            // Take every frame that is already here before tagging: one lock, one wake of
            // the client and one write for a burst, instead of one per upstream chunk.
            let mut next = body.frame().await;
            let mut taken = 0;
            let mut ended = None;
            loop {
                match next {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            taken += data.len();
                            if let Err(e) = decoder.feed(&data, &mut events) {
                                metrics.upstream_error("invalid_event");
                                ended = Some(End::UpstreamFailed(e.to_string()));
                                break;
                            }
                        }
                    }
                    Some(Err(e)) => {
                        metrics.upstream_error("stream");
                        ended = Some(End::UpstreamFailed(format!(
                            "upstream connection failed: {e}"
                        )));
                        break;
                    }
                    None => {
                        ended = Some(End::Complete);
                        break;
                    }
                }
                if taken >= READ_BATCH_BYTES {
                    break;
                }
                match ready_frame(&mut body).await {
                    Some(f) => next = f,
                    None => break,
                }
            }
            for e in &events {
                if e.id.is_some() {
                    last_upstream_id.clone_from(&e.id);
                }
                retry = e.retry.or(retry);
            }
            if !events.is_empty() {
                failures = 0;
            }
            session.push_events(stream, &mut events);
            if registry.over_budget() {
                registry.enforce_budget(&session);
            }
            if let Some(end) = ended {
                break end;
            }
        };
        let Some(last_id) = last_upstream_id
            .clone()
            .filter(|_| session.wants_more(stream))
        else {
            break end;
        };
        if matches!(end, End::UpstreamFailed(ref c) if !c.starts_with("upstream connection failed"))
        {
            break end; // a protocol error will not heal by reconnecting
        }
        // Reconnect upstream, as a client of a polling server would.
        loop {
            if failures >= UPSTREAM_RESUME_ATTEMPTS {
                break 'outer End::UpstreamFailed(format!(
                    "the upstream closed the stream and refused {UPSTREAM_RESUME_ATTEMPTS} attempts to resume it"
                ));
            }
            failures += 1;
            let wait =
                std::time::Duration::from_millis(retry.unwrap_or(1000)).min(MAX_UPSTREAM_RETRY);
            tokio::time::sleep(wait).await;
            tracing::debug!(mcp.session = %crate::session::hash_id(session.id()), mcp.stream = stream, "resuming the upstream stream");
            match up.resume(&last_id).await {
                Some(b) => {
                    body = b;
                    continue 'outer;
                }
                None => metrics.upstream_error("resume"),
            }
        }
    };
    if let End::UpstreamFailed(cause) = &end {
        tracing::warn!(mcp.session = %crate::session::hash_id(session.id()), mcp.stream = stream, cause = %cause, "upstream stream failed");
    }
    session.end_stream(stream, end);
}

impl Upstream {
    /// `GET` with `Last-Event-ID` to the upstream; the new body if it answered with a stream.
    async fn resume(&self, last_id: &str) -> Option<Incoming> {
        let mut headers = self.headers.clone();
        headers.remove(header::CONTENT_TYPE);
        headers.remove(header::CONTENT_LENGTH);
        headers.insert(
            header::ACCEPT,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(LAST_EVENT_ID, HeaderValue::from_str(last_id).ok()?);
        let body = Full::new(Bytes::new())
            .map_err(|never| match never {})
            .boxed_unsync();
        let req = self.gateway.upstream_request(
            Method::GET,
            self.uri.clone(),
            headers,
            body,
            Some(self.remote),
        );
        let resp = self.gateway.client.request(req).await.ok()?;
        (resp.status() == StatusCode::OK && is_sse(resp.headers())).then(|| resp.into_body())
    }
}

fn pass_through(resp: Response<Incoming>) -> Response<ResBody> {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body.map_err(BoxError::from).boxed_unsync())
}

fn sse_headers(h: &mut HeaderMap, sid: &str) {
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

fn is_sse(h: &HeaderMap) -> bool {
    let ct = h
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let identity = h
        .get(header::CONTENT_ENCODING)
        .is_none_or(|v| v.as_bytes().eq_ignore_ascii_case(b"identity"));
    ct.split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"))
        && identity
}

fn is_visible_ascii(b: &[u8]) -> bool {
    !b.is_empty() && b.iter().all(|c| (0x21..=0x7e).contains(c))
}

/// Removes hop-by-hop headers (RFC 9110 §7.6.1), including those named in `Connection`.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        h.remove(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        h.insert(MCP_SESSION_ID, HeaderValue::from_static("abc"));
        strip_hop_by_hop(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(h.contains_key(header::AUTHORIZATION));
        assert!(h.contains_key(MCP_SESSION_ID));
    }

    #[test]
    fn sse_detection() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        assert!(is_sse(&h));
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert!(!is_sse(&h));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.remove(header::CONTENT_ENCODING);
        assert!(!is_sse(&h));
    }
}
