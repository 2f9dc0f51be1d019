//! The upstream side: the pooled HTTP client to the MCP server, how a forwarded request is
//! built (target URL, hop-by-hop headers, `X-Forwarded-*`), and the reader of a tagged
//! upstream stream: it decodes events, hands them to the session, pauses (stops polling the
//! body, so TCP pushes back on the server) while the session's window has no room, and
//! resumes the upstream stream itself when a polling server closes it early.
//!
//! Knows HTTP and the session API; the rules of what may be evicted live in `session`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use crate::config::Config;
use crate::metrics::UpstreamErrorKind;
use crate::session::{hash_id, End, Registry, Session, UpstreamFailure};
use crate::sse::Decoder;

/// Boxed error of bodies flowing through the gateway.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Body of requests sent upstream.
pub type UpBody = UnsyncBoxBody<Bytes, BoxError>;

/// A body holding `b` whole (requests the gateway writes itself, its own error responses).
pub fn full_body(b: Bytes) -> UpBody {
    Full::new(b).map_err(|never| match never {}).boxed_unsync()
}

pub const LAST_EVENT_ID: HeaderName = HeaderName::from_static("last-event-id");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Most upstream bytes the reader takes in one go before tagging them. While the window has
/// no room these wait in the reader, so this also bounds what a paused upstream costs
/// beyond its connection.
const READ_BATCH_BYTES: usize = 64 * 1024;

/// Consecutive failed reconnects to an upstream stream before the gateway gives up on it.
const UPSTREAM_RESUME_ATTEMPTS: u32 = 3;
/// The longest `retry:` wait the gateway honours before reconnecting upstream.
const MAX_UPSTREAM_RETRY: Duration = Duration::from_secs(30);

/// The pooled client to the upstream MCP server.
pub struct Upstream {
    cfg: Arc<Config>,
    client: Client<HttpsConnector<HttpConnector>, UpBody>,
}

impl Upstream {
    pub fn new(cfg: Arc<Config>) -> Upstream {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(cfg.upstream_connect_timeout));
        http.enforce_http(false);
        // http:// upstreams connect in the clear; https:// ones with the configured roots and
        // SNI from the URL's host (hyper-rustls' default).
        let tls = match &cfg.upstream_tls {
            Some(c) => (**c).clone(),
            None if cfg.upstream.scheme_str() == Some("https") => {
                crate::tls::platform_client_config()
            }
            // Never used for an http:// upstream; no need to load the platform's roots.
            None => crate::tls::no_roots_client_config(),
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            // Without a timer the idle timeout is never applied and idle upstream
            // connections stay open at the peak concurrency.
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(connector);
        Upstream { cfg, client }
    }

    /// Sends a request built by [`Upstream::request`].
    pub async fn send(
        &self,
        req: Request<UpBody>,
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        self.client.request(req).await
    }

    /// The upstream request for a client request: same method, path, query and headers
    /// (`Host` unchanged), hop-by-hop headers removed, the client's address appended to
    /// `X-Forwarded-For`.
    pub fn request(
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
        // What the hop in front said (an ingress terminating TLS says `https`) stays.
        if !headers.contains_key(X_FORWARDED_PROTO) {
            let proto = if self.cfg.tls.is_some() {
                "https"
            } else {
                "http"
            };
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
        }
        // Upstream connections are HTTP/1.1 whatever the client spoke (the request's
        // version is left at its default).
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = target.parse().unwrap_or_else(|_| base.clone());
        *req.headers_mut() = headers;
        req
    }
}

/// Removes hop-by-hop headers (RFC 9110 §7.6.1), including those named in `Connection`.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    // Usually there is nothing to strip: one pass over the names instead of a hashed
    // lookup per hop-by-hop name.
    if !h.keys().any(is_hop_by_hop) {
        return;
    }
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
    for n in HOP_BY_HOP {
        h.remove(n);
    }
}

const HOP_BY_HOP: [HeaderName; 9] = [
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

fn is_hop_by_hop(n: &HeaderName) -> bool {
    HOP_BY_HOP.contains(n)
}

/// Whether a response is an uncompressed SSE stream.
pub fn is_sse(h: &HeaderMap) -> bool {
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

/// Where a tagged stream came from, so the reader can reconnect to it upstream.
#[derive(Clone)]
pub struct Source {
    pub upstream: Arc<Upstream>,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub remote: SocketAddr,
}

impl Source {
    /// `GET` to the upstream with the source's headers (no body), `Last-Event-ID` set to
    /// `last_id` or absent. The stream if the upstream answered with one, else its status
    /// (`None`: no answer at all).
    async fn get(&self, last_id: Option<&str>) -> Result<Incoming, Option<StatusCode>> {
        let mut headers = self.headers.clone();
        headers.remove(header::CONTENT_TYPE);
        headers.remove(header::CONTENT_LENGTH);
        headers.remove(LAST_EVENT_ID);
        headers.insert(
            header::ACCEPT,
            HeaderValue::from_static("text/event-stream"),
        );
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
            Method::GET,
            self.uri.clone(),
            headers,
            body,
            Some(self.remote),
        );
        let send = self.upstream.send(req);
        let resp = match tokio::time::timeout(self.upstream.cfg.upstream_header_timeout, send).await
        {
            Ok(Ok(r)) => r,
            _ => return Err(None),
        };
        if resp.status() == StatusCode::OK && is_sse(resp.headers()) {
            Ok(resp.into_body())
        } else {
            Err(Some(resp.status()))
        }
    }

    /// `GET` with `Last-Event-ID` to the upstream; the new body if it answered with a stream.
    async fn resume(&self, last_id: &str) -> Option<Incoming> {
        self.get(Some(last_id)).await.ok()
    }
}

/// Attempts to open the held standalone stream before giving up until the next trigger.
const HOLD_ATTEMPTS: u32 = 4;

/// Opens the session's standalone stream upstream (`GET` without `Last-Event-ID`, with the
/// headers of `source`) and holds it for the session's client: tagged and retained like any
/// stream, so what the server sends on it before the client's own `GET` arrives is delivered
/// when it does. A 405 means the upstream has none (the client's `GET` then gets the 405);
/// 404 and other refusals end the attempt; a 409 (the upstream already has one), a 5xx or no
/// answer is retried after 250 ms, 500 ms, 1 s, then left to the next trigger.
///
/// `begun`: the caller already won [`Session::begin_hold`] for the first attempt (so it
/// can wait for it to settle). Boxed: the reader it starts may start the next one when the
/// stream ends.
pub fn hold_standalone(
    registry: Arc<Registry>,
    session: Arc<Session>,
    source: Source,
    begun: bool,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let mut wait = Duration::from_millis(250);
        for attempt in 1..=HOLD_ATTEMPTS {
            let ours = (begun && attempt == 1) || session.begin_hold();
            if !ours {
                return;
            }
            match source.get(None).await {
                Ok(body) => {
                    let Some(stream) = session.open_held_standalone() else {
                        return;
                    };
                    tracing::debug!(mcp.session = %hash_id(session.id()), mcp.stream = stream, "holding the standalone stream");
                    let reader =
                        tokio::spawn(read_stream(registry, session.clone(), stream, body, source));
                    session.set_reader(stream, reader.abort_handle());
                    return;
                }
                Err(Some(StatusCode::METHOD_NOT_ALLOWED)) => {
                    session.end_hold(true);
                    return;
                }
                Err(status) => {
                    session.end_hold(false);
                    registry.metrics().upstream_error(UpstreamErrorKind::Hold);
                    let retry = match status {
                        None => true,
                        Some(s) => s == StatusCode::CONFLICT || s.is_server_error(),
                    };
                    tracing::debug!(mcp.session = %hash_id(session.id()), ?status, attempt, "could not hold the standalone stream");
                    if !retry || attempt == HOLD_ATTEMPTS {
                        return;
                    }
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
            }
        }
    })
}

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

/// Hands `events` to the session, waiting while its window has no room (flow control: the
/// body is not polled meanwhile, so the upstream's TCP window closes). Counts pauses.
async fn deliver(
    registry: &Registry,
    session: &Session,
    stream: u32,
    events: &mut Vec<crate::sse::Event>,
) {
    let mut paused: Option<Instant> = None;
    std::future::poll_fn(|cx| {
        if session.push_events(stream, events, Some(cx.waker())) {
            std::task::Poll::Ready(())
        } else {
            if paused.is_none() {
                registry.metrics().upstream_pauses.inc();
                paused = Some(Instant::now());
            }
            std::task::Poll::Pending
        }
    })
    .await;
    if let Some(since) = paused {
        registry
            .metrics()
            .upstream_paused_seconds
            .inc_by(since.elapsed().as_secs_f64());
        tracing::trace!(mcp.session = %hash_id(session.id()), mcp.stream = stream, paused = ?since.elapsed(), "upstream resumed after a pause");
    }
    if registry.over_budget() {
        registry.enforce_budget(session);
    }
}

/// Reads a tagged upstream stream to its end, whether or not a client is attached.
///
/// An upstream that sets its own ids may close a stream before it is done (2025-11-25 "SSE
/// polling"); the gateway then resumes it upstream with `Last-Event-ID` (honouring `retry:`),
/// the way a client would, and keeps appending to the same stream: while a POST stream still
/// has unanswered requests, and for the standalone stream while the session lives.
pub async fn read_stream(
    registry: Arc<Registry>,
    session: Arc<Session>,
    stream: u32,
    mut body: Incoming,
    source: Source,
) {
    let metrics = registry.metrics().clone();
    let max_event_bytes = source.upstream.cfg.max_event_bytes;
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
                                metrics.upstream_error(UpstreamErrorKind::InvalidEvent);
                                ended = Some(End::Failed(UpstreamFailure::InvalidStream(
                                    e.to_string(),
                                )));
                                break;
                            }
                        }
                    }
                    Some(Err(e)) => {
                        metrics.upstream_error(UpstreamErrorKind::Stream);
                        ended = Some(End::Failed(UpstreamFailure::Connection(e.to_string())));
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
                next = match ready_frame(&mut body).await {
                    Some(f) => f,
                    // hyper hands the body over one HTTP chunk at a time (a one-slot channel
                    // from its connection task), so a burst already read from the socket is
                    // not "ready" yet: let the connection task run once and look again.
                    None => {
                        tokio::task::yield_now().await;
                        match ready_frame(&mut body).await {
                            Some(f) => f,
                            None => break,
                        }
                    }
                };
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
            deliver(&registry, &session, stream, &mut events).await;
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
        if matches!(end, End::Failed(UpstreamFailure::InvalidStream(_))) {
            break end; // a protocol error will not heal by reconnecting
        }
        // Reconnect upstream, as a client of a polling server would.
        loop {
            if failures >= UPSTREAM_RESUME_ATTEMPTS {
                break 'outer End::Failed(UpstreamFailure::ResumeRefused(UPSTREAM_RESUME_ATTEMPTS));
            }
            failures += 1;
            let wait = Duration::from_millis(retry.unwrap_or(1000)).min(MAX_UPSTREAM_RETRY);
            tokio::time::sleep(wait).await;
            tracing::debug!(mcp.session = %hash_id(session.id()), mcp.stream = stream, "resuming the upstream stream");
            match source.resume(&last_id).await {
                Some(b) => {
                    body = b;
                    continue 'outer;
                }
                None => metrics.upstream_error(UpstreamErrorKind::Resume),
            }
        }
    };
    if let End::Failed(cause) = &end {
        tracing::warn!(mcp.session = %hash_id(session.id()), mcp.stream = stream, cause = ?cause, "upstream stream failed");
    }
    session.end_stream(stream, end);
    // The session outlives its standalone stream: hold a new one for the client.
    if source.upstream.cfg.hold_standalone {
        if let Some(delay) = session.rehold_after(stream) {
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                hold_standalone(registry, session, source, false).await;
            });
        }
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
        h.insert("mcp-session-id", HeaderValue::from_static("abc"));
        strip_hop_by_hop(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(h.contains_key(header::AUTHORIZATION));
        assert!(h.contains_key("mcp-session-id"));
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
