//! The HTTP layer: classifies each client request (resume, live attach, legacy forward,
//! modern pass-through), forwards to the upstream over pooled connections, turns upstream
//! SSE responses into tagged streams, and maps every error to one response in one place.
//!
//! Knows HTTP and the session API; the rules of tagging, retention and re-attach live in
//! `session`.

use std::convert::Infallible;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::sync::Notify;
use tracing::Instrument;

use crate::access::{AccessLog, Observed, StreamStats};
use crate::attach::AttachBody;
use crate::config::{Config, Priming, PrincipalSource, ResumeAuth};
use crate::cursor::Cursor;
use crate::error::Refusal;
pub use crate::error::{codes, ProxyError};
use crate::jsonrpc::{self, PostInfo};
use crate::metrics::Metrics;
use crate::session::{
    hash_id, Eviction, OpenStream, Reattach, Registry, Resume, Retransmission, Session, StreamKind,
};
use crate::upstream::{
    full_body, hold_standalone, is_sse, read_stream, strip_hop_by_hop, Source, UpBody, Upstream,
};
pub use crate::upstream::{BoxError, LAST_EVENT_ID};

/// Body of every response the gateway sends.
pub type ResBody = UnsyncBoxBody<Bytes, BoxError>;

pub const MCP_SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");
pub const MCP_PROTOCOL_VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");
const X_ACCEL_BUFFERING: HeaderName = HeaderName::from_static("x-accel-buffering");

/// Why a resume GET was not answered as a resume.
enum Fallback {
    /// A standalone cursor that re-attaches to the session (a live or new standalone stream).
    Reattach(Reattach),
    /// Refused with this error.
    Refused(ProxyError),
}

impl From<ProxyError> for Fallback {
    fn from(e: ProxyError) -> Fallback {
        Fallback::Refused(e)
    }
}

/// Per-connection facts the handler needs.
#[derive(Clone, Debug)]
pub struct Conn {
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
    hurry: Notify,
    /// Random per process: principals are hashed with it, never stored in the clear.
    principal_key: std::collections::hash_map::RandomState,
}

impl Gateway {
    pub fn new(cfg: Config) -> Arc<Gateway> {
        let cfg = Arc::new(cfg);
        let metrics = Arc::new(Metrics::new());
        metrics
            .memory_budget_bytes
            .set(i64::try_from(cfg.memory_budget).unwrap_or(i64::MAX));
        Arc::new(Gateway {
            registry: Arc::new(Registry::new(cfg.clone(), metrics)),
            upstream: Arc::new(Upstream::new(cfg.clone())),
            cfg,
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
            .map(|v| hash_id(&String::from_utf8_lossy(v.as_bytes())));
        // One span per request (inside its connection's span), so a debug log of one session
        // can be followed; a session the upstream creates now is recorded once known.
        let span = tracing::debug_span!(
            "request",
            http.method = %method,
            mcp.session = session.as_deref().map(tracing::field::display),
        );
        let routed = if method == Method::POST {
            // A POST's exchange with the upstream must not hang on the client's connection:
            // dropped with it (a client that goes away or half-closes before the upstream's
            // response head), it would cancel a request the upstream already started, and the
            // client's retransmission would run the tool again. Dropped early, it finishes in
            // a task of its own; a stream it opens is read into the window, where the
            // retransmission finds it.
            let (me, conn) = (self.clone(), conn.clone());
            FinishOnDrop::new(async move { me.route(req, &conn).await }.instrument(span.clone()))
                .await
        } else {
            self.route(req, &conn).instrument(span.clone()).await
        };
        let mut resp = match routed {
            Ok(r) => r,
            Err(refusal) => span.in_scope(|| {
                refusal
                    .respond(&method, self.registry.metrics())
                    .map(full_body)
            }),
        };
        let stream = resp.extensions_mut().remove::<Arc<StreamStats>>();
        let session = session.or_else(|| {
            let created = resp
                .headers()
                .get(MCP_SESSION_ID)
                .map(|v| hash_id(&String::from_utf8_lossy(v.as_bytes())));
            if let Some(h) = &created {
                span.record("mcp.session", tracing::field::display(h));
            }
            created
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

    async fn route(
        self: &Arc<Self>,
        req: Request<Incoming>,
        conn: &Conn,
    ) -> Result<Response<ResBody>, Refusal> {
        let session_id = match req.headers().get(MCP_SESSION_ID) {
            None => None,
            Some(v) if is_visible_ascii(v.as_bytes()) => {
                Some(String::from_utf8_lossy(v.as_bytes()).into_owned())
            }
            Some(_) => return Err(ProxyError::BadSessionHeader.into()),
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
                    return Err(ProxyError::OriginNotAllowed.into());
                }
            }
        }
        let principal = self.principal(req.headers(), conn);

        // A standalone cursor that cannot be resumed exactly re-attaches to the session.
        let mut reattach: Option<Reattach> = None;
        if !modern && req.method() == Method::GET {
            if let Some(sid) = &session_id {
                if let Some(cursor) = req.headers().get(LAST_EVENT_ID) {
                    match self
                        .resume(sid, cursor.as_bytes(), &req, principal, conn)
                        .await
                    {
                        Ok(resp) => return Ok(resp),
                        Err(Fallback::Reattach(r)) => reattach = Some(r),
                        Err(Fallback::Refused(e)) => return Err(e.into()),
                    }
                }
                if let Some(s) = self.registry.get(sid) {
                    // The gateway may be opening the stream it holds for this client; if it
                    // holds none, it opens one now (the client's own GET is forwarded only
                    // when that fails, so the upstream's answer reaches the client).
                    s.hold_settled(self.cfg.upstream_connect_timeout).await;
                    if self.cfg.hold_standalone
                        && !s.has_standalone()
                        && self.authorized(&s, &req, principal).await
                    {
                        let source = Source {
                            upstream: self.upstream.clone(),
                            uri: req.uri().clone(),
                            headers: req.headers().clone(),
                            remote: conn.remote,
                        };
                        hold_standalone(self.registry.clone(), s.clone(), source, false).await;
                    }
                    if s.has_standalone() && self.authorized(&s, &req, principal).await {
                        let prime = self.prime(
                            header_version
                                .as_deref()
                                .or(s.protocol_version().as_deref()),
                        );
                        if let Some(attachment) =
                            s.attach_standalone(prime, reattach.as_ref(), Some(conn.kill.clone()))
                        {
                            if reattach.is_some() {
                                self.registry.metrics().resume("reattached");
                            }
                            tracing::debug!(mcp.session = %hash_id(sid), mcp.stream = attachment.stream, "attached live to held standalone stream");
                            let body = AttachBody::new(s, attachment, self.cfg.keepalive);
                            return Ok(self.sse_response(StatusCode::OK, None, sid, body));
                        }
                    }
                }
            }
        }

        let (mut parts, body) = req.into_parts();
        let (body, info): (UpBody, PostInfo) = if parts.method == Method::POST {
            // A slow body is cut like a slow head: both are bounded by --header-read-timeout.
            let collect = Limited::new(body, self.cfg.max_request_bytes).collect();
            let bytes = match tokio::time::timeout(self.cfg.header_read_timeout, collect).await {
                Err(_) => return Err(ProxyError::BodyTimeout(self.cfg.header_read_timeout).into()),
                Ok(Ok(c)) => c.to_bytes(),
                Ok(Err(e))
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some() =>
                {
                    return Err(ProxyError::BodyTooLarge(self.cfg.max_request_bytes).into())
                }
                Ok(Err(e)) => return Err(ProxyError::BodyRead(e).into()),
            };
            let info = jsonrpc::inspect_post(&bytes);
            (full_body(bytes), info)
        } else {
            (
                body.map_err(BoxError::from).boxed_unsync(),
                PostInfo::default(),
            )
        };
        let single_id = info.single_id.clone();
        // `initialize` exists only in the legacy eras, whatever version it asks for.
        let modern = !info.initialize && (modern || info.modern());
        let reservation = if !modern && info.initialize && session_id.is_none() {
            Some(
                self.registry
                    .reserve()
                    .map_err(|e| ProxyError::AtCapacity(e).for_request(single_id.clone()))?,
            )
        } else {
            None
        };
        // Held until this request's stream opened (or it ended otherwise): a retransmission
        // arriving meanwhile waits for it instead of being forwarded a second time.
        let mut _forwarding = None;
        if let Some(s) = session_id
            .as_deref()
            .filter(|_| !modern)
            .and_then(|sid| self.registry.get(sid))
        {
            s.touch();
            if let Some(v) = &header_version {
                s.set_protocol_version(v);
            }
            if parts.method == Method::POST && !info.request_ids.is_empty() {
                let sid = session_id.as_deref().unwrap_or_default();
                loop {
                    if let Some(r) = self
                        .retransmission(sid, &s, &parts, &info, principal, conn)
                        .await
                    {
                        return r.map_err(|e| e.for_request(single_id));
                    }
                    match s.begin_forward(&info.request_ids) {
                        Some(f) => {
                            _forwarding = Some(f);
                            break;
                        }
                        None => s.forward_settled(&info.request_ids).await,
                    }
                }
            }
        }
        if !modern {
            // Legacy `Last-Event-ID`s are the gateway's: the upstream never sees them.
            parts.headers.remove(LAST_EVENT_ID);
        }

        // Requests that cannot get a stream back must be answered promptly; anything that may
        // stream (a GET, a POST carrying requests) has no upstream timeout.
        let can_stream = parts.method == Method::GET
            || (parts.method == Method::POST && !info.request_ids.is_empty());
        // Kept to resume the upstream stream if the upstream closes it early.
        let forwarded = parts.headers.clone();
        let upstream_req = self.upstream.request(
            parts.method.clone(),
            parts.uri.clone(),
            parts.headers,
            body,
            Some(conn.remote),
        );
        let pending = self.upstream.send(upstream_req);
        let resp = if can_stream {
            pending
                .await
                .map_err(|e| ProxyError::Upstream(e).for_request(single_id.clone()))?
        } else {
            match tokio::time::timeout(self.cfg.upstream_header_timeout, pending).await {
                Ok(r) => r.map_err(|e| ProxyError::Upstream(e).for_request(single_id.clone()))?,
                Err(_) => {
                    return Err(
                        ProxyError::UpstreamTimeout(self.cfg.upstream_header_timeout)
                            .for_request(single_id),
                    )
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
        let created = match reservation {
            Some(r) => Ok(self.registry.create_reserved(&sid, principal, r)),
            None => self.registry.get_or_create(&sid, principal),
        };
        let session = match created {
            Ok(s) => s,
            Err(_) => {
                tracing::warn!("session cap reached with every session in use; passing the response through untagged");
                return Ok(pass_through(resp));
            }
        };
        if let Some(v) = header_version.as_deref().or(info.version.as_deref()) {
            session.set_protocol_version(v);
        }
        if info.initialized
            && parts.method == Method::POST
            && self.cfg.hold_standalone
            && session.begin_hold()
        {
            // The session is initialized: hold its standalone stream from now on, so nothing
            // the server sends there is lost to the race with the client's own GET. The 202
            // waits (bounded) until the upstream has the stream, so no request the client
            // sends after it can reach the server first.
            let source = Source {
                upstream: self.upstream.clone(),
                uri: parts.uri.clone(),
                headers: forwarded.clone(),
                remote: conn.remote,
            };
            tokio::spawn(hold_standalone(
                self.registry.clone(),
                session.clone(),
                source,
                true,
            ));
            session
                .hold_settled(self.cfg.upstream_connect_timeout)
                .await;
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
        let reattach = reattach.filter(|_| kind == StreamKind::Standalone);
        if reattach.is_some() {
            self.registry.metrics().resume("reattached");
        }
        let attachment = session.open_stream(OpenStream {
            kind,
            requests: info.request_ids,
            initialize: info.initialize,
            prime,
            reattach: reattach.as_ref(),
            kill: Some(conn.kill.clone()),
        });
        let stream = attachment.stream;
        let (resp_parts, upstream_body) = resp.into_parts();
        let source = Source {
            upstream: self.upstream.clone(),
            uri: parts.uri.clone(),
            headers: forwarded,
            remote: conn.remote,
        };
        let reader = tokio::spawn(read_stream(
            self.registry.clone(),
            session.clone(),
            stream,
            upstream_body,
            source,
        ));
        session.set_reader(stream, reader.abort_handle());
        let body = AttachBody::new(session, attachment, self.cfg.keepalive);
        Ok(self.sse_response(resp_parts.status, Some(resp_parts.headers), &sid, body))
    }

    /// A `GET` with `Last-Event-ID`: re-attaches the client at its cursor. A standalone
    /// cursor that cannot be resumed exactly is handed back as a [`Fallback::Reattach`].
    async fn resume(
        &self,
        sid: &str,
        cursor: &[u8],
        req: &Request<Incoming>,
        principal: u64,
        conn: &Conn,
    ) -> Result<Response<ResBody>, Fallback> {
        let session = self.registry.get(sid).ok_or(ProxyError::UnknownSession)?;
        if !self.authorized(&session, req, principal).await {
            // Exactly the answer for an unknown session: a caller who may not resume learns
            // nothing, not even that the session exists.
            self.registry.metrics().resume("unauthorized");
            tracing::warn!(mcp.session = %hash_id(sid), "resume refused: principal mismatch");
            return Err(ProxyError::UnknownSession.into());
        }
        let cursor = Cursor::parse(cursor).map_err(ProxyError::MalformedCursor)?;
        match session.resume(cursor, Some(conn.kill.clone())) {
            Ok(r) => Ok(self.resumed(sid, session, r, "resumed")),
            Err(e) => match session.standalone_reattach(&cursor, e) {
                Some(r) => {
                    tracing::debug!(mcp.session = %hash_id(sid), reason = r.reason, "standalone cursor re-attaches to the session");
                    Err(Fallback::Reattach(r))
                }
                None => Err(ProxyError::Resume(e).into()),
            },
        }
    }

    /// A POST carrying a request id that a retained stream of the session already carried:
    /// answered as a resume of that stream (exact with a `Last-Event-ID` of that stream,
    /// from the stream's start without one), never forwarded. `None`: not a retransmission.
    async fn retransmission(
        &self,
        sid: &str,
        session: &Arc<Session>,
        parts: &http::request::Parts,
        info: &PostInfo,
        principal: u64,
        conn: &Conn,
    ) -> Option<Result<Response<ResBody>, ProxyError>> {
        let (headers, uri) = (&parts.headers, &parts.uri);
        // A cursor that does not parse is as good as none: the duplicate id decides.
        let cursor = headers
            .get(LAST_EVENT_ID)
            .and_then(|c| Cursor::parse(c.as_bytes()).ok());
        if !session.carries_any(&info.request_ids) {
            return None;
        }
        if !self
            .authorized_headers(session, headers, uri, principal)
            .await
        {
            self.registry.metrics().resume("unauthorized");
            return Some(Err(ProxyError::UnknownSession));
        }
        let kill = Some(conn.kill.clone());
        let found = match session.retransmission(&info.request_ids, cursor, kill) {
            Retransmission::NotOne => return None,
            Retransmission::Resumed(r) => Ok(r),
            Retransmission::Refused(e) => Err(ProxyError::Resume(e)),
            Retransmission::Duplicate(dup) => Err(ProxyError::DuplicateRequest(dup)),
        };
        tracing::info!(mcp.session = %hash_id(sid), "retransmitted request answered as a resume");
        Some(found.map(|r| self.resumed(sid, session.clone(), r, "retransmission")))
    }

    /// The response to a resume the session accepted.
    fn resumed(
        &self,
        sid: &str,
        session: Arc<Session>,
        r: Resume,
        outcome: &'static str,
    ) -> Response<ResBody> {
        match r {
            Resume::Attached { attachment, replay } => {
                self.registry.metrics().resume(outcome);
                tracing::debug!(mcp.session = %hash_id(sid), mcp.stream = attachment.stream, replay, "resumed");
                let body =
                    AttachBody::new(session, attachment, self.cfg.keepalive).with_replayed(replay);
                self.sse_response(StatusCode::OK, None, sid, body)
            }
            Resume::GapWithErrors { frames } => {
                self.registry.metrics().resume("gap");
                let mut resp = Response::new(full_body(frames));
                sse_headers(resp.headers_mut(), sid);
                resp
            }
        }
    }

    /// The caller's principal: a keyed hash of its principal header (`Authorization` unless
    /// `--principal-header`), absent header included. The key is random per process.
    fn principal(&self, headers: &HeaderMap, conn: &Conn) -> u64 {
        if self.cfg.principal_source == PrincipalSource::ClientCert {
            // The verified certificate's subject; the connection was refused without one.
            let mut h = self.principal_key.build_hasher();
            h.write_u8(2);
            h.write(conn.client_subject.as_deref().unwrap_or("").as_bytes());
            return h.finish();
        }
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
        self.authorized_headers(session, req.headers(), req.uri(), principal)
            .await
    }

    /// [`Gateway::authorized`] for a request already taken apart.
    async fn authorized_headers(
        &self,
        session: &Session,
        headers: &HeaderMap,
        uri: &http::Uri,
        principal: u64,
    ) -> bool {
        match self.cfg.resume_auth {
            ResumeAuth::None => true,
            ResumeAuth::Principal => session.principal() == principal,
            ResumeAuth::Upstream => {
                let ok = self.upstream_accepts(headers, uri).await;
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
    async fn upstream_accepts(&self, headers: &HeaderMap, uri: &http::Uri) -> bool {
        const PING_ID: &str = "mcp-reattach-resume-auth";
        let mut headers = headers.clone();
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
        let body = full_body(Bytes::from(body));
        let upstream = self
            .upstream
            .request(Method::POST, uri.clone(), headers, body, None);
        let check = async {
            let resp = self.upstream.send(upstream).await.ok()?;
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

fn is_visible_ascii(b: &[u8]) -> bool {
    !b.is_empty() && b.iter().all(|c| (0x21..=0x7e).contains(c))
}

/// A future that, dropped before it is done, is not cancelled: it finishes in a task of its
/// own and its output is dropped there. Costs one allocation while the caller waits for it:
/// `bench/callgrind` JSON POST 75.8 k -> 77.6 k Ir; spawning every POST and joining it cost
/// 82.0 k.
struct FinishOnDrop<F: Future + Send + 'static>(Option<Pin<Box<F>>>)
where
    F::Output: Send + 'static;

impl<F: Future + Send + 'static> FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    fn new(fut: F) -> Self {
        FinishOnDrop(Some(Box::pin(fut)))
    }
}

impl<F: Future + Send + 'static> Future for FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let fut = self
            .0
            .as_mut()
            .expect("FinishOnDrop polled after completion");
        let out = std::task::ready!(fut.as_mut().poll(cx));
        self.0 = None;
        Poll::Ready(out)
    }
}

impl<F: Future + Send + 'static> Drop for FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(fut) = self.0.take() {
            // Outside a runtime (it is being torn down) there is nothing left to finish on.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    drop(fut.await);
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_future_dropped_before_it_is_done_finishes_in_its_own_task() {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let fut = FinishOnDrop::new(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            d.store(true, Ordering::SeqCst);
        });
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
        assert_eq!(FinishOnDrop::new(async { 7 }).await, 7);
    }
}
