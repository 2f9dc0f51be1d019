//! A client request read once: its session header, protocol version, Origin, principal, body
//! (a POST's, within its limit and deadline) and what that body carries, and the era; then
//! [`classify`], a pure decision of which [`Route`] serves it.
//!
//! Knows HTTP requests and the JSON-RPC inspection; nothing of how a route is served.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;

use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Method, Request};
use http_body_util::{BodyExt, Limited};
use tokio::sync::Notify;

use super::bodies::{self, Bodies, Counted, Room};
use super::is_visible_ascii;
use crate::config::Config;
use crate::error::{ProxyError, Refusal};
use crate::exchange::{ClientBody, Conn, MCP_PROTOCOL_VERSION, MCP_SESSION_ID};
use crate::jsonrpc::{self, PostInfo};
use crate::session::{is_minted_form, Principal, Session};
use crate::upstream::{Source, UpBody, Upstream, LAST_EVENT_ID};

/// Everything the gateway needs to know about a client request, read once.
pub(super) struct Inbound {
    /// Method, URI and headers as received (a legacy request's `Last-Event-ID` is taken out
    /// before it is forwarded: [`Inbound::drop_legacy_cursor`]).
    pub parts: Parts,
    /// The request's body, collected (within `--max-request-bytes`,
    /// `--max-buffered-request-bytes` and `--header-read-timeout`), holding its room among
    /// the bodies held until dropped. Taken when sent.
    pub body: Option<UpBody>,
    /// The `Mcp-Session-Id` (visible ASCII).
    pub sid: Option<String>,
    /// The `Mcp-Protocol-Version` header.
    pub header_version: Option<String>,
    /// The caller's principal (a keyed MAC of its credential).
    pub principal: Principal,
    /// Whose share of the session cap and memory budget a session this request creates counts
    /// against (an `initialize`'s: the principal, or an anonymous caller's address), and of the
    /// upstream connections the request's does; for a request of a session's owner the
    /// session's (set by the route), the principal for any other request.
    pub share: Principal,
    /// What a POST's body carries (empty for other methods).
    pub info: PostInfo,
    /// What the route learns of the request for the access line and the metrics.
    pub facts: Arc<super::orphans::Facts>,
    /// The modern era (2026-07-28 and later): passed through, never tagged.
    pub modern: bool,
    /// A POST carrying requests from a client that accepts SSE, with `--json-upgrade`: the
    /// gateway answers it with an SSE stream whatever the upstream answers with.
    pub upgrade: bool,
    /// Whether the caller may attach to the session's streams, once decided (see
    /// `Gateway::authorized`): at most one decision, so one upstream `ping`, per request.
    pub authorized: Option<bool>,
    pub remote: SocketAddr,
    pub kill: Arc<Notify>,
}

impl Inbound {
    /// Reads `req`: the header checks first (a malformed session header is 400, a foreign
    /// Origin 403), then a POST's body within `--max-request-bytes`, the room
    /// `--max-buffered-request-bytes` leaves, and `--header-read-timeout`.
    pub(super) async fn read(
        req: Request<ClientBody>,
        cfg: &Config,
        conn: &Conn,
        bodies: &Arc<Bodies>,
        facts: &Arc<super::orphans::Facts>,
        principal: impl FnOnce(&http::HeaderMap, bool) -> (Principal, Principal),
    ) -> Result<Box<Inbound>, Refusal> {
        let (parts, body) = req.into_parts();
        // Only an MCP endpoint is forwarded: never a tunnel, never the server as a whole.
        if parts.method == Method::CONNECT {
            return Err(ProxyError::Connect.into());
        }
        if is_asterisk(&parts) && parts.method != Method::OPTIONS {
            return Err(ProxyError::BadTarget.into());
        }
        check_host(&parts)?;
        let sid = session_header(&parts.headers)?;
        let header_version = parts
            .headers
            .get(MCP_PROTOCOL_VERSION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        check_origin(cfg, &parts.headers)?;
        // Every method's body, not only a POST's, is read whole within the same bounds: an
        // MCP endpoint streams no request bodies, and an unbounded one would be a way past
        // them (an extension method `post`, a trickled GET).
        let (bytes, room) = collect(body, &parts.headers, cfg, bodies).await?;
        let info = if parts.method == Method::POST {
            jsonrpc::inspect_post(&bytes)
        } else {
            PostInfo::default()
        };
        let (principal, share) = principal(&parts.headers, info.initialize);
        let body = bodies::held(bytes, room);
        let modern = is_modern(header_version.as_deref(), &info);
        let upgrade =
            cfg.json_upgrade && !info.request_ids.is_empty() && accepts_sse(&parts.headers);
        Ok(Box::new(Inbound {
            parts,
            body: Some(body),
            sid,
            header_version,
            principal,
            share,
            info,
            facts: facts.clone(),
            modern,
            upgrade,
            authorized: None,
            remote: conn.remote,
            kill: conn.kill.clone(),
        }))
    }

    /// The raw `Last-Event-ID`.
    pub(super) fn cursor(&self) -> Option<&HeaderValue> {
        self.parts.headers.get(LAST_EVENT_ID)
    }

    /// Before forwarding: a legacy `Last-Event-ID` is the gateway's, and the upstream never
    /// sees it.
    pub(super) fn drop_legacy_cursor(&mut self) {
        if !self.modern {
            self.parts.headers.remove(LAST_EVENT_ID);
        }
    }

    /// The recipe to open a stream upstream again with this request's target and headers
    /// (the held standalone stream, or an upstream resume).
    pub(super) fn source(&self, upstream: &Arc<Upstream>) -> Source {
        Source {
            upstream: upstream.clone(),
            uri: self.parts.uri.clone(),
            headers: self.parts.headers.clone(),
            remote: self.remote,
        }
    }

    /// [`Inbound::source`] with this request's headers moved into it, once its upstream
    /// request is written: a stream's reader keeps them, no copy per request.
    pub(super) fn take_source(&mut self, upstream: &Arc<Upstream>) -> Source {
        Source {
            upstream: upstream.clone(),
            uri: self.parts.uri.clone(),
            headers: std::mem::take(&mut self.parts.headers),
            remote: self.remote,
        }
    }

    /// Whether the upstream may answer with a stream: a GET, or a POST carrying requests.
    /// Anything else must be answered promptly (bounded by `--upstream-header-timeout`).
    pub(super) fn can_stream(&self) -> bool {
        self.parts.method == Method::GET
            || (self.parts.method == Method::POST && !self.info.request_ids.is_empty())
    }
}

/// Whether the client's `Accept` lists `text/event-stream` (every legacy client's POST does).
fn accepts_sse(headers: &http::HeaderMap) -> bool {
    headers.get_all(header::ACCEPT).iter().any(|v| {
        // Each range up to its `,`, its media type up to its `;` (found with memchr: a
        // byte-wise split cost more: bench/notes.md, "Figure: a request's facts").
        let mut rest = v.as_bytes();
        loop {
            let end = memchr::memchr(b',', rest).unwrap_or(rest.len());
            let range = &rest[..end];
            let media = &range[..memchr::memchr(b';', range).unwrap_or(range.len())];
            if media
                .trim_ascii()
                .eq_ignore_ascii_case(b"text/event-stream")
            {
                return true;
            }
            match rest.get(end + 1..) {
                Some(next) => rest = next,
                None => return false,
            }
        }
    })
}

/// The `Mcp-Session-Id`: absent, or one visible-ASCII value (a repeated header would let the
/// gateway and the upstream act on different sessions).
fn session_header(headers: &http::HeaderMap) -> Result<Option<String>, Refusal> {
    let mut all = headers.get_all(MCP_SESSION_ID).iter();
    match (all.next(), all.next()) {
        (None, _) => Ok(None),
        (Some(v), None) if is_visible_ascii(v.as_bytes()) => {
            Ok(Some(String::from_utf8_lossy(v.as_bytes()).into_owned()))
        }
        _ => Err(ProxyError::BadSessionHeader.into()),
    }
}

/// An HTTP/1.1 request carries exactly one `Host`, a valid authority (RFC 9112 §3.2: a server
/// answers 400 otherwise), so the gateway and the upstream agree on whom it is for. HTTP/2
/// has `:authority` instead, and HTTP/1.0 may omit it; neither may repeat it.
fn check_host(parts: &Parts) -> Result<(), Refusal> {
    let mut all = parts.headers.get_all(header::HOST).iter();
    match (all.next(), all.next()) {
        (None, _) if parts.version != http::Version::HTTP_11 => Ok(()),
        (Some(h), None) if http::uri::Authority::try_from(h.as_bytes()).is_ok() => Ok(()),
        _ => Err(ProxyError::BadHost.into()),
    }
}

/// Whether the request target is `*` (asterisk-form, or h2's `:path *`).
pub(super) fn is_asterisk(parts: &Parts) -> bool {
    parts.uri.path() == "*"
}

/// Whether a request is of the modern era, by its version header or its body's `_meta`.
/// `initialize` exists only in the legacy eras, whatever version it asks for.
fn is_modern(header_version: Option<&str>, info: &PostInfo) -> bool {
    !info.initialize && (header_version.is_some_and(jsonrpc::is_modern) || info.modern())
}

/// With `--allowed-origin`, a request whose `Origin` is not listed is refused (none: allowed).
fn check_origin(cfg: &Config, headers: &http::HeaderMap) -> Result<(), Refusal> {
    if cfg.allowed_origins.is_empty() {
        return Ok(());
    }
    match headers.get(header::ORIGIN) {
        Some(origin)
            if !cfg
                .allowed_origins
                .iter()
                .any(|o| o.as_bytes() == origin.as_bytes()) =>
        {
            Err(ProxyError::OriginNotAllowed.into())
        }
        _ => Ok(()),
    }
}

/// A request's body, whole, and the room it holds among all bodies being read. A slow body is
/// cut like a slow head: both are bounded by `--header-read-timeout`. A `Content-Length` over
/// `--max-request-bytes` is refused before the body is polled, so a client that sent
/// `Expect: 100-continue` is not asked for it; so is one that does not fit in what
/// `--max-buffered-request-bytes` leaves (its room is taken up front), and a body without one
/// once its chunks would go over.
async fn collect(
    mut body: ClientBody,
    headers: &http::HeaderMap,
    cfg: &Config,
    bodies: &Arc<Bodies>,
) -> Result<(bytes::Bytes, Room), Refusal> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > cfg.max_request_bytes as u64) {
        return Err(ProxyError::BodyTooLarge(cfg.max_request_bytes).into());
    }
    let mut room = Room::new(bodies);
    let full = || ProxyError::BodiesFull(bodies.limit()).into();
    if declared.is_some_and(|n| !room.cover(n as usize)) {
        return Err(full());
    }
    if http_body::Body::is_end_stream(&body) {
        return Ok((bytes::Bytes::new(), room));
    }
    // Mostly the body came whole with its head: held as it is, no frames to collect.
    if let Some(whole) = body.take_whole() {
        if whole.len() > cfg.max_request_bytes {
            return Err(ProxyError::BodyTooLarge(cfg.max_request_bytes).into());
        }
        if !room.cover(whole.len()) {
            return Err(full());
        }
        return Ok((whole, room));
    }
    let counted = Counted {
        body,
        room: &mut room,
        read: 0,
    };
    let mut collect = std::pin::pin!(Limited::new(counted, cfg.max_request_bytes).collect());
    // Mostly the body came with its head and is whole at the first look: the timer (armed
    // and cancelled, not free) only for a body still on its way.
    let first = std::future::poll_fn(|cx| Poll::Ready(collect.as_mut().poll(cx))).await;
    let timed = match first {
        Poll::Ready(done) => Ok(done),
        Poll::Pending => tokio::time::timeout(cfg.header_read_timeout, collect).await,
    };
    let collected = match timed {
        Err(_) => Err(ProxyError::BodyTimeout(cfg.header_read_timeout).into()),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ProxyError::BodyTooLarge(cfg.max_request_bytes).into())
        }
        Ok(Err(e)) if e.downcast_ref::<bodies::Full>().is_some() => Err(full()),
        Ok(Err(e)) => Err(ProxyError::BodyRead(e).into()),
    };
    collected.map(|bytes| (bytes, room))
}

/// How the gateway serves a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Route {
    /// `OPTIONS *`: about the server as a whole, answered by the gateway.
    Asterisk,
    /// Modern era: forwarded as it is, the answer passed through untagged.
    PassThrough,
    /// A legacy `GET` with a session and `Last-Event-ID`: re-attached at the cursor (a
    /// standalone cursor that cannot be resumed exactly re-attaches live).
    Resume,
    /// A legacy `GET` of a known session without a cursor: attached live to the held
    /// standalone stream (forwarded when the gateway holds none).
    Attach,
    /// A legacy POST into a known session carrying a request id that a retained stream
    /// already carried: answered from that stream, never forwarded.
    Retransmission,
    /// A legacy POST carrying requests, from a client that accepts SSE, with
    /// `--json-upgrade`: forwarded, and answered with a tagged SSE stream whatever the
    /// upstream answers with (a JSON answer becomes its events; into a known session, the
    /// gateway commits to the stream once `--upgrade-grace` passes without an answer).
    Upgrade,
    /// A `DELETE` of a session the gateway minted (its upstream is stateless): ended at the
    /// gateway, never forwarded.
    EndMinted,
    /// A request naming a session id of the gateway's minted form that it does not hold:
    /// 404, never forwarded (the upstream never issued it).
    MintedGone,
    /// Every other legacy request: forwarded, an SSE answer tagged and retained.
    Forward,
}

/// Which route serves `inb`, given the session it names (if the gateway has it and `inb` is
/// on its endpoint). Decides only: reads the session's state, changes nothing.
pub(super) fn classify(inb: &Inbound, session: Option<&Session>) -> Route {
    if is_asterisk(&inb.parts) {
        return Route::Asterisk;
    }
    if inb.modern {
        return Route::PassThrough;
    }
    if session.is_none() && inb.sid.as_deref().is_some_and(is_minted_form) {
        return Route::MintedGone;
    }
    match inb.parts.method {
        Method::GET if inb.sid.is_some() && inb.cursor().is_some() => Route::Resume,
        Method::GET if session.is_some() => Route::Attach,
        Method::POST
            if session.is_some_and(|s| {
                !inb.info.request_ids.is_empty()
                    && s.carries_any(inb.principal, &inb.info.request_ids)
            }) =>
        {
            Route::Retransmission
        }
        Method::POST if inb.upgrade => Route::Upgrade,
        Method::DELETE if session.is_some_and(Session::minted) => Route::EndMinted,
        _ => Route::Forward,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{Owner, Principal, Registry};

    fn inbound(method: Method, headers: &[(&str, &str)], body: &str) -> Inbound {
        let mut req = Request::builder().method(method.clone()).uri("/mcp");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let (parts, ()) = req.body(()).expect("request").into_parts();
        let sid = parts
            .headers
            .get(MCP_SESSION_ID)
            .map(|v| v.to_str().expect("ascii").to_owned());
        let header_version = parts
            .headers
            .get(MCP_PROTOCOL_VERSION)
            .map(|v| v.to_str().expect("ascii").to_owned());
        let info = if method == Method::POST {
            jsonrpc::inspect_post(body.as_bytes())
        } else {
            PostInfo::default()
        };
        let modern = is_modern(header_version.as_deref(), &info);
        let upgrade = !info.request_ids.is_empty() && accepts_sse(&parts.headers);
        Inbound {
            parts,
            body: None,
            sid,
            header_version,
            principal: Principal::default(),
            share: Principal::default(),
            info,
            facts: Arc::default(),
            modern,
            upgrade,
            authorized: None,
            remote: "127.0.0.1:1".parse().expect("addr"),
            kill: Arc::default(),
        }
    }

    const CALL: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"x"}}"#;
    const INIT: &str = r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25"}}"#;

    #[test]
    fn accept_lists_sse_in_any_form() {
        let h = |v: &[&str]| {
            let mut m = http::HeaderMap::new();
            for x in v {
                m.append(header::ACCEPT, HeaderValue::from_str(x).unwrap());
            }
            accepts_sse(&m)
        };
        assert!(h(&["application/json, text/event-stream"]));
        assert!(h(&["application/json", "Text/Event-Stream;q=0.5"]));
        assert!(!h(&["application/json"]));
        assert!(!h(&["text/event-streams"]));
        assert!(h(&["application/json,text/event-stream"]));
        assert!(h(&[" text/event-stream ; q=1 , application/json"]));
        assert!(!h(&["application/json,"]));
        assert!(!h(&[","]));
        assert!(!h(&[""]));
        assert!(!h(&[]));
    }

    #[test]
    fn each_request_has_one_route() {
        let cfg = Arc::new(Config::new("http://127.0.0.1:1".parse().expect("uri")));
        let reg = Registry::new(cfg, Arc::default());
        let s = reg
            .get_or_create("s1", Owner::new(Principal::default(), "/mcp"))
            .expect("session");
        let sid = ("mcp-session-id", "s1");
        let cursor = ("last-event-id", "0000000000000001.0.1");
        let modern = ("mcp-protocol-version", "2026-07-28");
        let cases: [(Inbound, Option<&Session>, Route); 9] = [
            (
                inbound(Method::GET, &[sid, cursor], ""),
                Some(&s),
                Route::Resume,
            ),
            // A cursor for a session the gateway does not have is still a resume (404).
            (
                inbound(Method::GET, &[sid, cursor], ""),
                None,
                Route::Resume,
            ),
            (inbound(Method::GET, &[sid], ""), Some(&s), Route::Attach),
            (inbound(Method::GET, &[sid], ""), None, Route::Forward),
            (inbound(Method::GET, &[], ""), None, Route::Forward),
            (
                inbound(Method::POST, &[sid], CALL),
                Some(&s),
                Route::Forward,
            ),
            (
                inbound(Method::DELETE, &[sid], ""),
                Some(&s),
                Route::Forward,
            ),
            (
                inbound(Method::GET, &[sid, cursor, modern], ""),
                Some(&s),
                Route::PassThrough,
            ),
            (
                inbound(Method::POST, &[modern], CALL),
                None,
                Route::PassThrough,
            ),
        ];
        for (i, (inb, session, want)) in cases.iter().enumerate() {
            assert_eq!(classify(inb, *session), *want, "case {i}");
        }
        // Once a retained stream carries request 7, the same POST is a retransmission.
        let _ = s.open_stream(crate::session::OpenStream::new(
            crate::session::StreamKind::Post,
            vec!["7".into()],
        ));
        let post = inbound(Method::POST, &[sid], CALL);
        assert_eq!(classify(&post, Some(&s)), Route::Retransmission);
        // With the upgrade, a POST carrying requests from a client accepting SSE.
        let accept = ("accept", "application/json, text/event-stream");
        assert_eq!(
            classify(
                &inbound(
                    Method::POST,
                    &[sid, accept],
                    r#"{"jsonrpc":"2.0","id":8,"method":"tools/call"}"#
                ),
                Some(&s)
            ),
            Route::Upgrade
        );
        assert_eq!(
            classify(&inbound(Method::POST, &[accept], INIT), None),
            Route::Upgrade
        );
        let note = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        assert_eq!(
            classify(&inbound(Method::POST, &[sid, accept], note), Some(&s)),
            Route::Forward,
            "nothing to answer"
        );
        assert_eq!(
            classify(
                &inbound(Method::POST, &[sid, ("accept", "application/json")], CALL),
                Some(&s)
            ),
            Route::Retransmission
        );
        // A minted session's DELETE is the gateway's; a minted id it does not hold is 404.
        let minted = reg
            .create_minted(Owner::new(Principal::default(), "/mcp"), None)
            .expect("session");
        let msid = ("mcp-session-id", minted.id());
        assert_eq!(
            classify(&inbound(Method::DELETE, &[msid], ""), Some(&minted)),
            Route::EndMinted
        );
        assert_eq!(
            classify(&inbound(Method::GET, &[msid], ""), Some(&minted)),
            Route::Attach
        );
        let gone = ("mcp-session-id", "mra-0123456789abcdef0123456789abcdef");
        for method in [Method::GET, Method::POST, Method::DELETE] {
            assert_eq!(
                classify(&inbound(method, &[gone, cursor], CALL), None),
                Route::MintedGone
            );
        }
        // `initialize` is legacy whatever version it asks for.
        let init = r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2026-07-28"}}"#;
        assert_eq!(
            classify(&inbound(Method::POST, &[modern], init), None),
            Route::Forward
        );
    }
}
