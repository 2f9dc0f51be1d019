//! One access-log line and one duration sample per finished request or stream, emitted when
//! the response body ends or is dropped (completed, or cut by the client), never earlier; and
//! a line for each request head the HTTP/1.1 layer refused ([`head_refused`]: no request was
//! made of it, so no sample; `connection_errors_total` counts those).
//!
//! Knows hyper's `Body` trait and the metrics; never sees payloads, raw session ids or
//! credentials.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use http::{Method, StatusCode};
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::session::Outcome;

/// Counters an SSE body updates while it runs, read by its [`AccessLog`] at the end.
#[derive(Debug, Default)]
pub struct StreamStats {
    events: AtomicU64,
    replayed: AtomicU64,
    /// Set once, when the body decides how the stream ends (the first reason wins).
    outcome: OnceLock<Outcome>,
}

impl StreamStats {
    pub fn new(replayed: u64) -> Arc<StreamStats> {
        Arc::new(StreamStats {
            replayed: AtomicU64::new(replayed),
            ..StreamStats::default()
        })
    }

    pub fn add_events(&self, n: u64) {
        self.events.fetch_add(n, Ordering::Relaxed);
    }

    pub fn set_outcome(&self, o: Outcome) {
        let _ = self.outcome.set(o);
    }

    fn outcome(&self) -> Option<Outcome> {
        self.outcome.get().copied()
    }
}

/// What the proxy learned of a request while routing it, read when its line is written: its
/// MCP method and tool, and the upstream's time to the response head (which an upgraded call
/// learns only after its response started).
pub(crate) trait Learned: Send + Sync + std::fmt::Debug {
    /// The MCP method label ([`crate::jsonrpc::METHODS`]) and the tool of a `tools/call`.
    fn call(&self) -> (Option<&'static str>, Option<&str>);
    /// The upstream's time to the response head, if the request was sent upstream.
    fn upstream_time(&self) -> Option<std::time::Duration>;
    /// The upstream answered the request with a success status.
    fn upstream_succeeded(&self) -> bool;
}

/// What is known of a request when it arrives (cheap clones of its parts).
#[derive(Debug)]
pub(crate) struct Requested {
    pub method: Method,
    pub start: Instant,
    /// The request target's path and query (the line shows the path only).
    pub target: Option<http::uri::PathAndQuery>,
    pub user_agent: Option<http::HeaderValue>,
    /// The W3C `traceparent` the client sent, whose trace id the line shows.
    pub traceparent: Option<http::HeaderValue>,
    /// The client's address (the peer's, or per `--trusted-proxies` X-Forwarded-For's).
    pub client: std::net::IpAddr,
    /// The request's span: it ends with the line, and gets the line's outcome fields.
    pub span: tracing::Span,
}

/// What is known of a request when its response starts.
#[derive(Debug)]
pub(crate) struct AccessLog {
    pub requested: Requested,
    pub status: StatusCode,
    /// Hashed session id, if any.
    pub session: Option<Arc<str>>,
    pub stream: Option<Arc<StreamStats>>,
    /// The response is a GET's SSE stream: its duration is a stream's lifetime.
    pub get_stream: bool,
    /// Why the gateway refused the request (the error's `data.reason`), if it did.
    pub refused: Option<&'static str>,
    pub learned: Arc<dyn Learned>,
    /// The upstream's address (`--upstream`'s authority), shown when the request went there.
    pub upstream: Arc<str>,
    pub metrics: Arc<Metrics>,
    bytes: u64,
    ended: bool,
}

impl AccessLog {
    /// The log of a request whose response has started (`status`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        requested: Requested,
        status: StatusCode,
        session: Option<Arc<str>>,
        stream: Option<Arc<StreamStats>>,
        get_stream: bool,
        refused: Option<&'static str>,
        learned: Arc<dyn Learned>,
        upstream: Arc<str>,
        metrics: Arc<Metrics>,
    ) -> AccessLog {
        AccessLog {
            requested,
            status,
            session,
            stream,
            get_stream,
            refused,
            learned,
            upstream,
            metrics,
            bytes: 0,
            ended: false,
        }
    }
}

/// `v` as it may appear inside a quoted field of either format: visible ASCII and spaces,
/// anything else (quotes, backslashes, control bytes, non-ASCII) as `_`, at most `max` bytes.
fn quotable(v: &[u8], max: usize) -> std::borrow::Cow<'_, str> {
    let v = &v[..v.len().min(max)];
    if v.iter()
        .all(|b| (b' '..=b'~').contains(b) && *b != b'"' && *b != b'\\')
    {
        // Checked: ASCII.
        return std::borrow::Cow::Borrowed(std::str::from_utf8(v).unwrap_or("-"));
    }
    std::borrow::Cow::Owned(
        v.iter()
            .map(|&b| {
                if (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\' {
                    b as char
                } else {
                    '_'
                }
            })
            .collect(),
    )
}

/// The trace id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`), if well formed.
fn trace_id(traceparent: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(traceparent).ok()?;
    let mut parts = s.trim().split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |p: &str, n: usize| {
        p.len() == n
            && p.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    };
    (hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && hex(parent, 16)
        && hex(flags, 2)
        && trace.bytes().any(|b| b != b'0'))
    .then_some(trace)
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        let r = &self.requested;
        let elapsed = r.start.elapsed();
        let seconds = elapsed.as_secs_f64();
        if self.get_stream {
            self.metrics.stream_done(seconds);
        } else {
            self.metrics.request_done(&r.method, self.status, seconds);
        }
        let (call, tool) = self.learned.call();
        if let Some(m) = call {
            let succeeded = self.learned.upstream_succeeded();
            self.metrics
                .mcp_request_done(m, tool, succeeded, self.status, seconds);
        }
        let outcome = match (&self.stream, self.ended) {
            (Some(s), _) => s.outcome().map_or("detached", Outcome::as_str),
            (None, true) => "completed",
            (None, false) => "cancelled",
        };
        let (events, replayed) = self.stream.as_ref().map_or((0, 0), |s| {
            (
                s.events.load(Ordering::Relaxed),
                s.replayed.load(Ordering::Relaxed),
            )
        });
        let upstream_time = self.learned.upstream_time();
        let user_agent = r.user_agent.as_ref().map(|v| quotable(v.as_bytes(), 256));
        let tool = tool.map(|t| quotable(t.as_bytes(), 128));
        let path = r
            .target
            .as_ref()
            .map(|t| quotable(t.path().as_bytes(), 512));
        let line = Line {
            method: r.method.as_str(),
            path: path.as_deref().unwrap_or("-"),
            status: self.status.as_u16(),
            duration_ms: elapsed.as_millis() as u64,
            bytes: self.bytes,
            events,
            replayed,
            outcome,
            session: self.session.as_deref().unwrap_or("-"),
            client: r.client,
            user_agent: user_agent.as_deref().unwrap_or("-"),
            mcp_method: call.unwrap_or("-"),
            tool: tool.as_deref().unwrap_or("-"),
            upstream: if upstream_time.is_some() {
                &self.upstream
            } else {
                "-"
            },
            upstream_ms: upstream_time.map(|d| d.as_secs_f64() * 1e3),
            trace_id: r
                .traceparent
                .as_ref()
                .and_then(|t| trace_id(t.as_bytes()))
                .unwrap_or("-"),
            error: self.refused.unwrap_or("-"),
        };
        if !r.span.is_disabled() {
            let span = &r.span;
            span.record("http.response.status_code", line.status);
            span.record("events", line.events);
            span.record("bytes", line.bytes);
            span.record("outcome", line.outcome);
            if let Some(m) = call {
                span.record("mcp.method.name", m);
            }
            if line.tool != "-" {
                span.record("gen_ai.tool.name", line.tool);
            }
            if let Some(e) = self.refused {
                span.record("error.type", e);
            }
        }
        emit(&line);
    }
}

/// The line of a request head the HTTP/1.1 layer refused with `status` (400 or 431, no body,
/// the connection closed after it) for `reason` ([`crate::http1::Error::reason`]): of the
/// request only who sent it is known (the peer's address: its forwarded headers were not
/// read), its method and path are `-`.
pub(crate) fn head_refused(client: std::net::IpAddr, status: StatusCode, reason: &'static str) {
    emit(&Line {
        method: "-",
        path: "-",
        status: status.as_u16(),
        duration_ms: 0,
        bytes: 0,
        events: 0,
        replayed: 0,
        outcome: "completed",
        session: "-",
        client,
        user_agent: "-",
        mcp_method: "-",
        tool: "-",
        upstream: "-",
        upstream_ms: None,
        trace_id: "-",
        error: reason,
    });
}

/// Writes `line` to the sink, or through `tracing` without one.
fn emit(line: &Line<'_>) {
    match SINK.get() {
        Some(sink) if tracing::enabled!(tracing::Level::INFO) => sink.write(line),
        Some(_) => {}
        None => tracing::info!(
            http.request.method = line.method,
            url.path = line.path,
            http.response.status_code = line.status,
            duration_ms = line.duration_ms,
            bytes = line.bytes,
            events = line.events,
            replayed = line.replayed,
            outcome = line.outcome,
            mcp.session.id = line.session,
            mcp.method.name = line.mcp_method,
            gen_ai.tool.name = line.tool,
            client.address = %line.client,
            user_agent.original = line.user_agent,
            upstream.address = line.upstream,
            upstream.duration_ms = line.upstream_ms,
            trace_id = line.trace_id,
            error.type = line.error,
            "request finished"
        ),
    }
}

/// The fields of one access line (names after OpenTelemetry's semantic conventions where
/// one exists: `http.request.method`, `url.path`, `http.response.status_code`,
/// `client.address`, `user_agent.original`, `mcp.method.name`, `mcp.session.id`,
/// `gen_ai.tool.name`, `error.type`, `trace_id`).
struct Line<'a> {
    method: &'a str,
    path: &'a str,
    status: u16,
    duration_ms: u64,
    bytes: u64,
    events: u64,
    replayed: u64,
    outcome: &'static str,
    session: &'a str,
    client: std::net::IpAddr,
    user_agent: &'a str,
    mcp_method: &'a str,
    tool: &'a str,
    upstream: &'a str,
    /// Milliseconds (fractional) to the upstream's response head.
    upstream_ms: Option<f64>,
    trace_id: &'a str,
    error: &'a str,
}

/// Where the binary writes access lines: the log's own writer, formatted here. One line per
/// request through tracing-subscriber's formatter (field visitors, `Debug` of every value)
/// was a sixth of a small POST's CPU; these fields are few, fixed and need no escaping
/// (a method token, numbers, a static outcome, a hex hash). Without a sink (the library in
/// tests) lines go through `tracing` as usual. Either way `--log-level` filters them.
struct Sink {
    writer: crate::logwriter::LogWriter,
    json: bool,
}

static SINK: OnceLock<Sink> = OnceLock::new();

/// Sends access lines to `writer` (the log's batching stdout writer) in the log format.
pub fn set_sink(writer: crate::logwriter::LogWriter, json: bool) {
    let _ = SINK.set(Sink { writer, json });
}

impl Sink {
    fn write(&self, l: &Line<'_>) {
        let out = format_line(self.json, std::time::SystemTime::now(), l);
        self.writer.append(out.as_bytes());
    }
}

/// A value of an access line: how each format writes it.
enum Value<'a> {
    /// A token: bare in text, quoted in JSON (the method).
    Token(&'a str),
    /// Quoted in both (already [`quotable`] or safe by construction).
    Quoted(&'a str),
    Number(u64),
    /// Quoted in both.
    Address(std::net::IpAddr),
    /// Milliseconds to the microsecond, or `-` in text and `null` in JSON.
    Millis(Option<f64>),
}

/// One access line at `now`, in JSON or text, with its newline. Built by appending each
/// piece: through `fmt::write` the line was most of a request's logging (bench/notes.md,
/// "Figure: the access line").
fn format_line(json: bool, now: std::time::SystemTime, l: &Line<'_>) -> String {
    let fields = [
        ("http.request.method", Value::Token(l.method)),
        ("url.path", Value::Quoted(l.path)),
        (
            "http.response.status_code",
            Value::Number(u64::from(l.status)),
        ),
        ("duration_ms", Value::Number(l.duration_ms)),
        ("bytes", Value::Number(l.bytes)),
        ("events", Value::Number(l.events)),
        ("replayed", Value::Number(l.replayed)),
        ("outcome", Value::Quoted(l.outcome)),
        ("mcp.session.id", Value::Quoted(l.session)),
        ("mcp.method.name", Value::Quoted(l.mcp_method)),
        ("gen_ai.tool.name", Value::Quoted(l.tool)),
        ("client.address", Value::Address(l.client)),
        ("user_agent.original", Value::Quoted(l.user_agent)),
        ("upstream.address", Value::Quoted(l.upstream)),
        ("upstream.duration_ms", Value::Millis(l.upstream_ms)),
        ("trace_id", Value::Quoted(l.trace_id)),
        ("error.type", Value::Quoted(l.error)),
    ];
    let mut out = String::with_capacity(512);
    if json {
        out.push_str("{\"timestamp\":\"");
        push_timestamp(&mut out, now);
        out.push_str("\",\"level\":\"INFO\",\"message\":\"request finished\"");
    } else {
        push_timestamp(&mut out, now);
        out.push_str("  INFO request finished");
    }
    for (key, value) in &fields {
        if json {
            out.push_str(",\"");
            out.push_str(key);
            out.push_str("\":");
        } else {
            out.push(' ');
            out.push_str(key);
            out.push('=');
        }
        match *value {
            Value::Token(v) if !json => out.push_str(v),
            Value::Token(v) | Value::Quoted(v) => {
                out.push('"');
                out.push_str(v);
                out.push('"');
            }
            Value::Number(n) => out.push_str(itoa::Buffer::new().format(n)),
            Value::Address(ip) => {
                out.push('"');
                push_ip(&mut out, ip);
                out.push('"');
            }
            Value::Millis(None) => out.push_str(if json { "null" } else { "-" }),
            Value::Millis(Some(ms)) => push_millis(&mut out, ms),
        }
    }
    out.push_str(if json { "}\n" } else { "\n" });
    out
}

/// `now` as RFC 3339 to the microsecond, UTC (`humantime::format_rfc3339_micros`'s text).
/// The part up to the second is formatted once a second per thread and copied after: through
/// `fmt` it was a large part of each line (bench/notes.md, "Figure: the access line").
fn push_timestamp(out: &mut String, now: std::time::SystemTime) {
    use std::cell::RefCell;
    thread_local! {
        static SECOND: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let Ok(since) = now.duration_since(std::time::UNIX_EPOCH) else {
        out.push_str(&humantime::format_rfc3339_micros(now).to_string());
        return;
    };
    let secs = since.as_secs();
    SECOND.with_borrow_mut(|(at, text)| {
        if *at != secs {
            // "YYYY-MM-DDThh:mm:ssZ" without its Z.
            let whole = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
            *text = humantime::format_rfc3339_seconds(whole).to_string();
            text.pop();
            *at = secs;
        }
        out.push_str(text);
    });
    let micros = since.subsec_micros();
    out.push('.');
    let digits = itoa::Buffer::new().format(micros).len();
    for _ in digits..6 {
        out.push('0');
    }
    out.push_str(itoa::Buffer::new().format(micros));
    out.push('Z');
}

/// `ip` as its Display writes it (an IPv4 address without the formatter).
pub(crate) fn push_ip(out: &mut String, ip: std::net::IpAddr) {
    out.push_str(IpText::new(ip).as_str());
}

/// An IP address as its `Display` writes it, on the stack: an IPv4 address without the
/// formatter (the access line's `client`, the upstream request's `X-Forwarded-For`).
pub(crate) struct IpText {
    buf: [u8; IpText::MAX],
    len: usize,
}

impl IpText {
    /// The longest an address's text can be (`ffff:…:255.255.255.255`).
    const MAX: usize = 45;

    pub(crate) fn new(ip: std::net::IpAddr) -> IpText {
        use std::fmt::Write as _;
        let mut text = IpText {
            buf: [0; IpText::MAX],
            len: 0,
        };
        match ip {
            std::net::IpAddr::V4(v4) => {
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        text.push(b".");
                    }
                    text.push(itoa::Buffer::new().format(octet).as_bytes());
                }
            }
            std::net::IpAddr::V6(_) => {
                let _ = write!(text, "{ip}");
            }
        }
        text
    }

    fn push(&mut self, bytes: &[u8]) {
        let end = (self.len + bytes.len()).min(IpText::MAX);
        self.buf[self.len..end].copy_from_slice(&bytes[..end - self.len]);
        self.len = end;
    }

    pub(crate) fn as_str(&self) -> &str {
        // Only ASCII is ever pushed.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or_default()
    }
}

impl std::fmt::Write for IpText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.push(s.as_bytes());
        Ok(())
    }
}

/// `ms` with three decimals (rounded to the microsecond).
fn push_millis(out: &mut String, ms: f64) {
    let us = (ms * 1000.0).round().max(0.0) as u64;
    out.push_str(itoa::Buffer::new().format(us / 1000));
    out.push('.');
    let frac = us % 1000;
    if frac < 100 {
        out.push('0');
    }
    if frac < 10 {
        out.push('0');
    }
    out.push_str(itoa::Buffer::new().format(frac));
}

pin_project_lite::pin_project! {
    /// A response body that logs and measures its request when it ends or is dropped.
    pub struct Observed<B> {
        #[pin]
        inner: B,
        log: AccessLog,
    }
}

impl<B> Observed<B> {
    pub(crate) fn new(inner: B, mut log: AccessLog) -> Observed<B>
    where
        B: Body,
    {
        // An empty body (a 202, a 404 without content) is never polled: it is complete now.
        log.ended = inner.is_end_stream();
        Observed { inner, log }
    }
}

impl<B: Body> Body for Observed<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let mut inner = this.inner;
        let polled = inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    this.log.bytes += bytes::Buf::remaining(d) as u64;
                }
                // hyper stops polling a body that says it has ended.
                if inner.is_end_stream() {
                    this.log.ended = true;
                }
            }
            Poll::Ready(None) => this.log.ended = true,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn an_address_reads_as_display_writes_it(v4 in proptest::prelude::any::<[u8; 4]>(), v6 in proptest::prelude::any::<[u16; 8]>()) {
            for ip in [
                std::net::IpAddr::from(v4),
                std::net::IpAddr::from(v6),
                std::net::IpAddr::from(std::net::Ipv4Addr::from(v4).to_ipv6_mapped()),
            ] {
                let text = IpText::new(ip);
                proptest::prop_assert_eq!(text.as_str(), ip.to_string());
            }
        }
    }

    #[test]
    fn the_longest_addresses_fit() {
        for ip in [
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "::ffff:255.255.255.255",
            "255.255.255.255",
        ] {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            assert_eq!(IpText::new(ip).as_str(), ip.to_string());
        }
    }

    #[test]
    fn the_timestamp_is_humantimes_to_the_microsecond() {
        let epoch = std::time::UNIX_EPOCH;
        let mut out = String::new();
        for (secs, nanos) in [
            (0, 0),
            (1_764_783_680, 5_000),
            (1_764_783_680, 123_456_789),
            (1_764_783_681, 999_999_999),
            (4_102_444_799, 1_000),
        ] {
            let t = epoch + std::time::Duration::new(secs, nanos);
            out.clear();
            push_timestamp(&mut out, t);
            assert_eq!(out, humantime::format_rfc3339_micros(t).to_string());
            // Again within the same second: from the cached part.
            out.clear();
            push_timestamp(&mut out, t);
            assert_eq!(out, humantime::format_rfc3339_micros(t).to_string());
        }
    }

    fn line(upstream_ms: Option<f64>, client: &str) -> Line<'static> {
        Line {
            method: "POST",
            path: "/mcp",
            status: 200,
            duration_ms: 22,
            bytes: 503,
            events: 3,
            replayed: 1,
            outcome: "completed",
            session: "98bed2553bf7fb01",
            client: client.parse().unwrap(),
            user_agent: "curl/7.88.1",
            mcp_method: "tools/call",
            tool: "countdown",
            upstream: if upstream_ms.is_some() {
                "127.0.0.1:41971"
            } else {
                "-"
            },
            upstream_ms,
            trace_id: "4bf92f3577b34da6a3ce929d0e0e4736",
            error: "-",
        }
    }

    #[test]
    fn lines_in_both_formats_are_exactly_these() {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_micros(1_764_640_995_388_330);
        assert_eq!(
            format_line(false, at, &line(Some(0.624), "127.0.0.1")),
            "2025-12-02T02:03:15.388330Z  INFO request finished http.request.method=POST url.path=\"/mcp\" \
             http.response.status_code=200 duration_ms=22 bytes=503 events=3 replayed=1 outcome=\"completed\" \
             mcp.session.id=\"98bed2553bf7fb01\" mcp.method.name=\"tools/call\" gen_ai.tool.name=\"countdown\" \
             client.address=\"127.0.0.1\" user_agent.original=\"curl/7.88.1\" upstream.address=\"127.0.0.1:41971\" \
             upstream.duration_ms=0.624 trace_id=\"4bf92f3577b34da6a3ce929d0e0e4736\" error.type=\"-\"\n"
        );
        assert_eq!(
            format_line(true, at, &line(None, "2001:db8::7")),
            "{\"timestamp\":\"2025-12-02T02:03:15.388330Z\",\"level\":\"INFO\",\"message\":\"request finished\",\
             \"http.request.method\":\"POST\",\"url.path\":\"/mcp\",\"http.response.status_code\":200,\
             \"duration_ms\":22,\"bytes\":503,\"events\":3,\"replayed\":1,\"outcome\":\"completed\",\
             \"mcp.session.id\":\"98bed2553bf7fb01\",\"mcp.method.name\":\"tools/call\",\
             \"gen_ai.tool.name\":\"countdown\",\"client.address\":\"2001:db8::7\",\
             \"user_agent.original\":\"curl/7.88.1\",\"upstream.address\":\"-\",\"upstream.duration_ms\":null,\
             \"trace_id\":\"4bf92f3577b34da6a3ce929d0e0e4736\",\"error.type\":\"-\"}\n"
        );
        // Upstream times to the microsecond, whatever their size.
        for (ms, shown) in [
            (0.0, "0.000"),
            (0.05, "0.050"),
            (12.3456, "12.346"),
            (1500.0, "1500.000"),
        ] {
            let text = format_line(false, at, &line(Some(ms), "10.0.0.1"));
            assert!(
                text.contains(&format!(" upstream.duration_ms={shown} ")),
                "{text}"
            );
        }
    }

    #[test]
    fn quoted_fields_cannot_break_either_format() {
        assert_eq!(quotable(b"curl/8.5.0 (x86_64)", 256), "curl/8.5.0 (x86_64)");
        assert_eq!(quotable(b"a\"b\\c\nd\xffe", 256), "a_b_c_d_e");
        assert_eq!(quotable(b"abcdef", 3), "abc");
    }

    #[test]
    fn trace_ids_come_only_from_well_formed_traceparents() {
        let good = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(trace_id(good), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        for bad in [
            &b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"[..],
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736\"-00f067aa0ba902b7-01",
            b"garbage",
        ] {
            assert_eq!(trace_id(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn every_outcome_reaches_the_log_as_itself_and_the_first_one_wins() {
        let all = [
            Outcome::Completed,
            Outcome::Replaced,
            Outcome::SessionClosed,
            Outcome::SlowConsumer,
            Outcome::Shutdown,
            Outcome::Gap,
            Outcome::UpstreamFailed,
        ];
        for o in all {
            let s = StreamStats::new(0);
            assert_eq!(s.outcome(), None, "none before the stream ends");
            s.set_outcome(o);
            s.set_outcome(Outcome::Completed);
            assert_eq!(s.outcome(), Some(o));
        }
    }
}
