//! The upstream side: the gateway's HTTP/1.1 client to the MCP server (`conn`: requests written
//! and answers read on the socket by the task that wants them, a small pool of idle
//! connections), how a forwarded request is built (target URL, hop-by-hop headers,
//! `X-Forwarded-*`), the bound on its connections and each client share's fair part of it
//! (`limit`), the recipe to reopen a stream ([`Source`]). What is done with an answer's body
//! (tagging, reading, holding) is the `feed` layer's.
//!
//! Knows HTTP; of sessions only the client share a connection is counted in.

mod conn;
mod head;
mod io;
mod limit;

pub(crate) use self::conn::{OwnBody, ReadEnd, SendError};

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};

use crate::config::Config;

// The exchange's types under the names this layer's files use (`super::BoxError`).
pub(crate) use crate::exchange::{BoxError, UpBody};

/// A body holding `b` whole (requests the gateway writes itself, its own error responses).
pub(crate) fn full_body(b: Bytes) -> UpBody {
    Full::new(b).map_err(|never| match never {}).boxed_unsync()
}

pub(crate) const LAST_EVENT_ID: HeaderName = HeaderName::from_static("last-event-id");

/// The client to the upstream MCP server: how it connects and its idle connections (`conn`).
pub(crate) struct Upstream {
    pub(crate) cfg: Arc<Config>,
    /// How a connection is opened: TCP, or TLS over it (`io`).
    dialer: io::Dialer,
    pool: Arc<conn::Pool>,
    /// Its open connections and their bound (`--max-upstream-connections`).
    conns: Arc<limit::Conns>,
}

impl Upstream {
    pub(crate) fn new(cfg: Arc<Config>) -> Upstream {
        // http:// upstreams connect in the clear; https:// ones with the configured roots and
        // SNI from the URL's host.
        let tls = match &cfg.upstream_tls {
            Some(c) => (**c).clone(),
            None if cfg.upstream.scheme_str() == Some("https") => {
                crate::tls::platform_client_config()
            }
            // Never used for an http:// upstream; no need to load the platform's roots.
            None => crate::tls::no_roots_client_config(),
        };
        let dialer = io::Dialer::new(tls, cfg.upstream_connect_timeout);
        let conns = Arc::new(limit::Conns::new(cfg.max_upstream_connections));
        // Idle connections kept for the next requests: a quarter of the bound, at least 16
        // (the requests of as many clients back to back), never more than the bound.
        let max = cfg.max_upstream_connections.max(1);
        let pool = Arc::new(conn::Pool::new((max / 4).max(16).min(max)));
        Upstream {
            cfg,
            dialer,
            pool,
            conns,
        }
    }

    /// Whether the upstream accepts a TCP connection within `limit` (its host resolved now).
    pub(crate) async fn reachable(&self, limit: Duration) -> bool {
        let Some(authority) = self.cfg.upstream.authority() else {
            return false;
        };
        let port = authority
            .port_u16()
            .unwrap_or(match self.cfg.upstream.scheme_str() {
                Some("https") => 443,
                _ => 80,
            });
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        matches!(
            tokio::time::timeout(limit, tokio::net::TcpStream::connect((host, port))).await,
            Ok(Ok(_))
        )
    }

    /// Upstream connections open now (pooled idle ones included) and their bound.
    pub(crate) fn connections(&self) -> (usize, usize) {
        (self.conns.open(), self.conns.max())
    }

    /// Whether a held standalone stream may take an upstream connection now (the held
    /// streams leave a quarter of `--max-upstream-connections` to clients' requests).
    pub(crate) fn room_to_hold(&self) -> bool {
        self.conns.room_to_hold()
    }

    /// Sends a request built by [`Upstream::request`]; the answer's head, its body to be read
    /// by whoever wants it.
    pub(crate) async fn send(&self, req: UpRequest) -> Result<Response<OwnBody>, SendError> {
        conn::send(self, req).await
    }

    /// Closes the idle connections every [`conn::IDLE_TIMEOUT`], in a task the caller owns.
    pub(crate) fn spawn_reaper(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let pool = Arc::downgrade(&self.pool);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(conn::IDLE_TIMEOUT);
            loop {
                tick.tick().await;
                match pool.upgrade() {
                    Some(p) => p.purge(),
                    None => return,
                }
            }
        })
    }

    /// The upstream URI for a client request's target: the upstream's scheme and authority,
    /// always, and the request's path and query (`/` for one that has none that is a path).
    /// Built from parts, so no request target can change where the request goes.
    fn target(&self, uri: &Uri) -> Uri {
        let base = &self.cfg.upstream;
        let pq = uri
            .path_and_query()
            .filter(|pq| pq.as_str().starts_with('/'))
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(base.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP));
        parts.authority = base.authority().cloned();
        parts.path_and_query = Some(pq);
        Uri::from_parts(parts).unwrap_or_else(|_| base.clone())
    }

    /// The upstream request for a client request: same method, path, query and headers
    /// (`Host` unchanged), hop-by-hop headers left out, `own` headers (the gateway's trace
    /// context) in place of the client's of the same names, `X-Forwarded-For` (with
    /// `remote`'s address) and `X-Forwarded-Proto` added. Its head is written here: the
    /// client's headers are read, not moved or copied.
    pub(crate) fn request(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        own: Option<&HeaderMap>,
        body: UpBody,
        remote: Option<SocketAddr>,
    ) -> UpRequest {
        let target = self.target(uri);
        // HTTP/2 clients send :authority instead of Host: it goes as Host, unchanged.
        let host = uri.authority().or(target.authority()).map(|a| a.as_str());
        let addr = remote.map(|r| crate::access::IpText::new(r.ip()));
        let added = head::Added {
            host,
            own,
            forwarded: Some(head::Forwarded {
                for_addr: addr.as_ref().map(|a| a.as_str()),
                proto: if self.cfg.tls.is_some() {
                    "https"
                } else {
                    "http"
                },
            }),
        };
        let pq = target.path_and_query().map_or("/", |pq| pq.as_str());
        let named = connection_named(headers);
        let skip = |n: &HeaderName| hop_by_hop(n).is_some() || named.contains(n);
        let head = head::request_head(method, pq, headers, skip, added);
        // Upstream connections are HTTP/1.1 whatever the client spoke.
        UpRequest {
            method: method.clone(),
            target,
            head,
            body,
            share: None,
        }
    }
}

impl UpRequest {
    /// The request is a client's, in `share`: it takes a place of that share's fair part of
    /// the upstream connections (see `limit`). The gateway's own requests are in none.
    pub(crate) fn in_share(mut self, share: crate::session::Principal) -> UpRequest {
        self.share = Some(share);
        self
    }
}

/// A request for the upstream as [`Upstream::request`] built it: its head written but for
/// the body's framing ([`crate::http1::end_request_head`]), its body, and where it goes. The
/// head is written from the client's header map, which stays the client's (a stream's
/// [`Source`] takes it after): no copy of the map per request, no hashed inserts of the
/// `X-Forwarded-*` names (bench/notes.md, "Figure: the upstream request's head").
pub(crate) struct UpRequest {
    method: Method,
    /// The upstream's scheme and authority, the request's path and query.
    target: Uri,
    head: Vec<u8>,
    body: UpBody,
    /// The client's share the request counts in, if it is a client's.
    share: Option<crate::session::Principal>,
}

/// End-to-end headers the gateway acts on or the upstream relies on: a `Connection` header
/// naming one of them is not honoured for it, or the gateway and the upstream would see
/// different requests (a session only one of them knows, a principal computed from a header
/// the upstream never gets, an era split between them, an `Origin` the gateway checked that
/// the upstream's own DNS-rebinding check never sees, a body whose media type or an `Accept`
/// the upstream validates gone). A client must not remove what the upstream checks. A custom
/// `--principal-header` is set by the hop in front, which also owns the `Connection` header
/// the gateway receives. The body's framing (`Content-Length`, `Transfer-Encoding`) is the
/// gateway's own either way: it frames every request it sends itself.
static ACTED_ON: [HeaderName; 8] = [
    header::HOST,
    header::AUTHORIZATION,
    header::ORIGIN,
    header::CONTENT_TYPE,
    header::ACCEPT,
    HeaderName::from_static("mcp-session-id"),
    HeaderName::from_static("mcp-protocol-version"),
    LAST_EVENT_ID,
];

/// The headers of a request the gateway sends on a client's behalf (an upstream resume, the
/// held stream, a resume-auth `ping`): the client's, less its body's framing and cursor, with
/// the gateway's own `Content-Type` (if it sends a body) and `Accept`.
pub(crate) fn own_request_headers(
    client: &HeaderMap,
    content_type: Option<&'static str>,
    accept: &'static str,
) -> HeaderMap {
    let mut headers = client.clone();
    headers.remove(header::CONTENT_TYPE);
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(LAST_EVENT_ID);
    if let Some(ct) = content_type {
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
    }
    headers.insert(header::ACCEPT, HeaderValue::from_static(accept));
    headers
}

/// Removes hop-by-hop headers (RFC 9110 §7.6.1), including those named in `Connection`, except
/// the end-to-end headers the gateway acts on ([`ACTED_ON`]).
pub(crate) fn strip_hop_by_hop(h: &mut HeaderMap) {
    // One pass over the names instead of a hashed lookup per hop-by-hop name: usually
    // there is nothing to strip, or only the upstream's `transfer-encoding`.
    let mut present = [false; 9];
    for name in h.keys() {
        if let Some(i) = hop_by_hop(name) {
            present[i] = true;
        }
    }
    if present[0] {
        for n in connection_named(h) {
            h.remove(n);
        }
    }
    for (n, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, p)| *p) {
        h.remove(n);
    }
}

/// The names `h`'s `Connection` headers list (hop-by-hop too), less the end-to-end headers
/// the gateway acts on ([`ACTED_ON`]). Usually none, and then nothing is allocated.
fn connection_named(h: &HeaderMap) -> Vec<HeaderName> {
    h.get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .filter(|n| !ACTED_ON.contains(n))
        .collect()
}

static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The index in [`HOP_BY_HOP`] of `name`, if it is one: a match on the name (its length, then
/// its bytes) rather than a comparison with each of the nine.
fn hop_by_hop(name: &HeaderName) -> Option<usize> {
    Some(match name.as_str() {
        "connection" => 0,
        "keep-alive" => 1,
        "proxy-connection" => 2,
        "proxy-authenticate" => 3,
        "proxy-authorization" => 4,
        "te" => 5,
        "trailer" => 6,
        "transfer-encoding" => 7,
        "upgrade" => 8,
        _ => return None,
    })
}

/// What an upstream answer's body is, for the gateway: an uncompressed SSE stream, an
/// uncompressed JSON body, or anything else (passed through as it came).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Media {
    Sse,
    Json,
    Other,
}

/// [`Media`] of a response: its headers read once (an answer is either, so asking for each
/// in turn would look them up twice).
pub(crate) fn media(h: &HeaderMap) -> Media {
    let identity = h
        .get(header::CONTENT_ENCODING)
        .is_none_or(|v| v.as_bytes().eq_ignore_ascii_case(b"identity"));
    let Some(ct) = h.get(header::CONTENT_TYPE).filter(|_| identity) else {
        return Media::Other;
    };
    let ct = ct.as_bytes();
    let essence = ct[..memchr::memchr(b';', ct).unwrap_or(ct.len())].trim_ascii();
    if essence.eq_ignore_ascii_case(b"text/event-stream") {
        Media::Sse
    } else if essence.eq_ignore_ascii_case(b"application/json") {
        Media::Json
    } else {
        Media::Other
    }
}

/// Whether a response is an uncompressed SSE stream.
pub(crate) fn is_sse(h: &HeaderMap) -> bool {
    media(h) == Media::Sse
}

/// Whether a response is an uncompressed JSON body.
pub(crate) fn is_json(h: &HeaderMap) -> bool {
    media(h) == Media::Json
}

/// A copy of a value parsed from a client's request, for keeping long: parsed values point
/// into the client connection's read buffer, and one kept value keeps that whole buffer
/// alive beside the one the connection reads into next.
pub(crate) fn owned_value(value: &HeaderValue) -> HeaderValue {
    // Every value a parser let through is valid again; a clone is only the fallback.
    let mut copy = HeaderValue::from_maybe_shared(Bytes::copy_from_slice(value.as_bytes()))
        .unwrap_or_else(|_| value.clone());
    copy.set_sensitive(value.is_sensitive());
    copy
}

/// A request target's path and query, copied ([`owned_value`]).
pub(crate) fn owned_target(pq: &http::uri::PathAndQuery) -> Option<http::uri::PathAndQuery> {
    http::uri::PathAndQuery::from_maybe_shared(Bytes::copy_from_slice(pq.as_str().as_bytes())).ok()
}

/// Where a tagged stream came from, so the reader can reconnect to it upstream.
#[derive(Clone)]
pub(crate) struct Source {
    pub upstream: Arc<Upstream>,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub remote: SocketAddr,
}

impl Source {
    /// The source with its target and header values copied, for a holder that keeps it as
    /// long as its session ([`owned_value`]).
    pub(crate) fn owned(self) -> Source {
        let mut headers = HeaderMap::with_capacity(self.headers.len());
        for (name, value) in &self.headers {
            headers.append(name.clone(), owned_value(value));
        }
        let mut parts = http::uri::Parts::default();
        parts.scheme = self.uri.scheme().cloned();
        parts.authority = self.uri.authority().and_then(|a| a.as_str().parse().ok());
        parts.path_and_query = self.uri.path_and_query().and_then(owned_target);
        let uri = Uri::from_parts(parts).unwrap_or_else(|_| self.uri.clone());
        Source {
            uri,
            headers,
            ..self
        }
    }

    /// `GET` to the upstream with the source's headers (no body), `Last-Event-ID` set to
    /// `last_id` or absent, on a connection of its own that the gateway reads itself. The
    /// stream if the upstream answered with one, else its status (`None`: no answer at all).
    pub(crate) async fn get(&self, last_id: Option<&str>) -> Result<OwnBody, Option<StatusCode>> {
        let mut headers = own_request_headers(&self.headers, None, "text/event-stream");
        // A compressed event stream could not be tagged.
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        if let Some(id) = last_id {
            // The upstream's own id: the one place a `Last-Event-ID` goes upstream.
            headers.insert(LAST_EVENT_ID, HeaderValue::from_str(id).map_err(|_| None)?);
        }
        let body = full_body(Bytes::new());
        let req = self.upstream.request(
            &Method::GET,
            &self.uri,
            &headers,
            None,
            body,
            Some(self.remote),
        );
        let send = self.upstream.send(req);
        let resp = match tokio::time::timeout(self.upstream.cfg.upstream_header_timeout, send).await
        {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "upstream GET failed");
                return Err(None);
            }
            Err(_) => return Err(None),
        };
        if resp.status() == StatusCode::OK && is_sse(resp.headers()) {
            Ok(resp.into_body())
        } else {
            Err(Some(resp.status()))
        }
    }

    /// `GET` with `Last-Event-ID` to the upstream; the new body if it answered with a stream.
    pub(crate) async fn resume(&self, last_id: &str) -> Option<OwnBody> {
        self.get(Some(last_id)).await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hop_by_hop_match_finds_each_name_of_the_table_at_its_index() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop(name), Some(i), "{name}");
        }
        for name in ["host", "accept", "mcp-session-id", "tee", "connections"] {
            assert_eq!(hop_by_hop(&HeaderName::from_static(name)), None, "{name}");
        }
    }

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
        h.insert("mcp-session-id", HeaderValue::from_static("abc"));
        strip_hop_by_hop(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(h.contains_key(header::AUTHORIZATION));
        assert!(h.contains_key("mcp-session-id"));
        // Each one alone, repeated, beside an end-to-end header.
        for name in &HOP_BY_HOP {
            let mut h = HeaderMap::new();
            h.append(name, HeaderValue::from_static("a"));
            h.append(name, HeaderValue::from_static("b"));
            h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
            strip_hop_by_hop(&mut h);
            assert_eq!(h.len(), 1, "{name}: {h:?}");
            assert!(h.contains_key(header::ACCEPT), "{name}");
        }
    }

    #[test]
    fn a_connection_header_cannot_remove_what_the_upstream_checks() {
        let up = Upstream::new(Arc::new(Config::new(
            "http://10.0.0.7:3000".parse().unwrap(),
        )));
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static(
                "origin, content-type, accept, authorization, host, mcp-session-id, \
                 mcp-protocol-version, x-hop",
            ),
        );
        for (name, value) in [
            ("host", "mcp.example"),
            ("origin", "https://app.example"),
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("authorization", "Bearer t"),
            ("mcp-session-id", "abc"),
            ("mcp-protocol-version", "2025-06-18"),
            ("x-hop", "1"),
        ] {
            h.insert(name, HeaderValue::from_static(value));
        }
        let uri: Uri = "/mcp".parse().unwrap();
        let req = up.request(&Method::POST, &uri, &h, None, full_body(Bytes::new()), None);
        let head = String::from_utf8(req.head).unwrap();
        for kept in [
            "host: mcp.example\r\n",
            "origin: https://app.example\r\n",
            "content-type: application/json\r\n",
            "accept: application/json, text/event-stream\r\n",
            "authorization: Bearer t\r\n",
            "mcp-session-id: abc\r\n",
            "mcp-protocol-version: 2025-06-18\r\n",
        ] {
            assert!(head.contains(kept), "{kept:?} removed: {head}");
        }
        assert!(
            !head.contains("x-hop") && !head.contains("connection"),
            "{head}"
        );
    }

    #[test]
    fn the_target_never_changes_the_upstream_authority() {
        let cfg = Config::new("http://10.0.0.7:3000".parse().unwrap());
        let up = Upstream::new(Arc::new(cfg));
        for (client, want) in [
            ("/mcp?x=1", "http://10.0.0.7:3000/mcp?x=1"),
            ("*", "http://10.0.0.7:3000/"),
            ("http://evil.example:81/mcp", "http://10.0.0.7:3000/mcp"),
            ("evil.example:443", "http://10.0.0.7:3000/"),
        ] {
            let uri: Uri = client.parse().unwrap();
            assert_eq!(up.target(&uri).to_string(), want, "{client}");
        }
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

    /// A media type is read by its essence, in any case, with or without parameters and
    /// spaces; a content-coded body is neither SSE nor JSON; a value that is not text is
    /// neither either.
    #[test]
    fn media_of_headers() {
        let of = |ct: &[u8], ce: Option<&str>| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_bytes(ct).unwrap());
            if let Some(ce) = ce {
                h.insert(header::CONTENT_ENCODING, HeaderValue::from_str(ce).unwrap());
            }
            media(&h)
        };
        assert_eq!(of(b"text/event-stream", None), Media::Sse);
        assert_eq!(of(b" Text/Event-Stream ;charset=utf-8", None), Media::Sse);
        assert_eq!(of(b"application/json", Some("identity")), Media::Json);
        assert_eq!(
            of(b"APPLICATION/JSON; charset=utf-8", Some("IDENTITY")),
            Media::Json
        );
        assert_eq!(of(b"application/json", Some("gzip")), Media::Other);
        assert_eq!(of(b"text/event-stream", Some("br")), Media::Other);
        assert_eq!(of(b"application/json-seq", None), Media::Other);
        assert_eq!(of(b"text/event-streams", None), Media::Other);
        assert_eq!(of(b"text/html", None), Media::Other);
        assert_eq!(of(b"application/json\xff", None), Media::Other);
        assert_eq!(media(&HeaderMap::new()), Media::Other);
    }
}
