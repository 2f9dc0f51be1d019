//! HTTP/1.1 heads, pure: the response head the gateway reads from the upstream
//! ([`parse_head`], [`take_head`]; interim heads bounded), the request head it reads from a
//! client ([`take_request`]), the response head it writes ([`response_head`]), the lines of a
//! request head it writes ([`request_line`], [`header_line`], [`end_request_head`]; what goes
//! in them is the upstream request builder's policy), and the body framing a head says
//! (RFC 9112 §6.3), refusing every ambiguity. No I/O, no clocks.

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;

use super::body::Framing;
use super::error::{Error, Kind, Peer};
use super::limits::{MAX_HEADERS, MAX_HEAD_BYTES, MAX_INTERIM_HEADS};

/// Headers the gateway may add to an upstream answer's head.
const ADDED_HEADERS: usize = 4;

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// Whether the connection may carry another request after this response's body: an
    /// HTTP/1.1 response without `Connection: close`.
    pub keep_alive: bool,
}

/// A header's name: one MCP traffic carries on most requests and answers as a static name
/// (`HeaderName::from_bytes` copies a name outside `http`'s standard table into an
/// allocation of its own, and frees it with the head), any other as `from_bytes` makes it.
fn header_name(bytes: &[u8]) -> Result<HeaderName, http::header::InvalidHeaderName> {
    const SESSION: HeaderName = HeaderName::from_static("mcp-session-id");
    const VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");
    const CURSOR: HeaderName = HeaderName::from_static("last-event-id");
    const TRACE: HeaderName = HeaderName::from_static("traceparent");
    const FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    const PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
    let known = match bytes.len() {
        14 => SESSION,
        20 => VERSION,
        13 => CURSOR,
        11 => TRACE,
        15 => FOR,
        17 => PROTO,
        _ => return HeaderName::from_bytes(bytes),
    };
    if known.as_str().as_bytes().eq_ignore_ascii_case(bytes) {
        Ok(known)
    } else {
        HeaderName::from_bytes(bytes)
    }
}

/// Writes a request line for `method` and `path_and_query` into `out`.
pub(crate) fn request_line(out: &mut Vec<u8>, method: &http::Method, path_and_query: &str) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path_and_query.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
}

/// Writes one header line into `out` (a `HeaderValue` cannot hold a line break).
pub(crate) fn header_line(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Ends a request head (`upstream::head::request_head` starts one): a `Content-Length` of
/// `body_len` when it is `Some`, and the empty line.
pub(crate) fn end_request_head(out: &mut Vec<u8>, body_len: Option<usize>) {
    if let Some(n) = body_len {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// The interim (`1xx`) heads of one response read so far, before its final head: at most
/// [`MAX_INTERIM_HEADS`] of them, and their bytes with the final head's within
/// [`MAX_HEAD_BYTES`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Interim {
    heads: usize,
    bytes: usize,
}

impl Interim {
    /// One more interim head of `len` bytes.
    fn add(&mut self, len: usize) -> Result<(), Error> {
        self.heads += 1;
        if self.heads > MAX_INTERIM_HEADS {
            return Err(Error::new(
                Kind::Head,
                Peer::Upstream,
                "too many interim (1xx) responses",
            ));
        }
        self.fits(len)?;
        self.bytes += len;
        Ok(())
    }

    /// Whether `more` bytes of head fit after the interim heads.
    fn fits(&self, more: usize) -> Result<(), Error> {
        if self.bytes + more > MAX_HEAD_BYTES {
            return Err(Error::new(Kind::HeadTooLarge, Peer::Upstream, ""));
        }
        Ok(())
    }
}

/// Parses the response head at the start of `buf`: the head and its length, `None` while it
/// is incomplete. Informational (1xx) heads before it are skipped (their bytes are counted in
/// the length), at most [`MAX_INTERIM_HEADS`] of them and within [`MAX_HEAD_BYTES`] with the
/// final head; a `101` is an error, the gateway never asks to switch protocols. Header
/// values are copied out of `buf`; [`take_head`] is the same parse on a read buffer without
/// the copies.
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, Error> {
    parse_after(buf, Interim::default())
}

/// [`parse_head`] after the interim heads `seen` (already taken off the buffer).
fn parse_after(buf: &[u8], seen: Interim) -> Result<Option<(Head, usize)>, Error> {
    let mut seen = seen;
    let mut at = 0;
    loop {
        match one_head(&buf[at..], HeaderValue::from_bytes)? {
            Parsed::Partial => {
                seen.fits(buf.len() - at)?;
                return Ok(None);
            }
            Parsed::Informational(len) => {
                seen.add(len)?;
                at += len;
            }
            Parsed::Final(head, len) => {
                seen.fits(len)?;
                return Ok(Some((head, at + len)));
            }
        }
    }
}

/// [`parse_head`] on the read buffer `buf`: a complete head's bytes are split off it (it keeps
/// what followed them: the body's first bytes), and its header values are slices of those
/// bytes, not copies (an upstream answer's four or five values were an allocation each).
/// Found by its empty line, then parsed; where that shortcut and httparse disagree (empty
/// lines before the status line), the result is [`parse_head`]'s.
pub fn take_head(buf: &mut bytes::BytesMut) -> Result<Option<Head>, Error> {
    take_head_after(buf, &mut Interim::default())
}

/// [`take_head`] on one read after another of the same response: `interim` counts the
/// interim heads taken off `buf` so far (their bound holds over all the reads).
pub(crate) fn take_head_after(
    buf: &mut bytes::BytesMut,
    interim: &mut Interim,
) -> Result<Option<Head>, Error> {
    loop {
        let Some(end) = head_end(buf) else {
            return take_parsed(buf, *interim);
        };
        let bytes = buf.split_to(end).freeze();
        let value = |v: &[u8]| HeaderValue::from_maybe_shared(bytes.slice_ref(v));
        match one_head(&bytes, value)? {
            Parsed::Informational(len) if len == end => interim.add(len)?,
            Parsed::Final(head, len) if len == end => {
                interim.fits(len)?;
                return Ok(Some(head));
            }
            _ => {
                // The shortcut misread the head's end: parse it all again, copying.
                let mut whole = bytes::BytesMut::from(&bytes[..]);
                whole.extend_from_slice(buf);
                *buf = whole;
                return take_parsed(buf, *interim);
            }
        }
    }
}

/// [`parse_after`] on `buf`, the head's bytes split off it when complete.
fn take_parsed(buf: &mut bytes::BytesMut, seen: Interim) -> Result<Option<Head>, Error> {
    Ok(parse_after(buf, seen)?.map(|(head, len)| {
        let _ = buf.split_to(len);
        head
    }))
}

/// Where the first empty line of `buf` ends (`\n\n` or `\n\r\n`): a head's end.
fn head_end(buf: &[u8]) -> Option<usize> {
    memchr::memchr_iter(b'\n', buf).find_map(|i| match buf.get(i + 1..i + 3) {
        Some([b'\n', _]) => Some(i + 2),
        Some([b'\r', b'\n']) => Some(i + 3),
        None if buf.get(i + 1) == Some(&b'\n') => Some(i + 2),
        _ => None,
    })
}

/// One head parsed from the start of a buffer.
enum Parsed {
    Partial,
    /// A 1xx head of this many bytes; the response's head follows it.
    Informational(usize),
    Final(Head, usize),
}

/// Parses the one head at the start of `buf`, its header values made by `value`.
fn one_head<E>(
    buf: &[u8],
    value: impl Fn(&[u8]) -> Result<HeaderValue, E>,
) -> Result<Parsed, Error> {
    // Not initialised: zeroing every slot was kilobytes of stores per response head, most
    // of them cache misses (bench/notes.md, "Figure: the client side's HTTP/1.1").
    let mut slots =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, buf, &mut slots)
    {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Error::new(Kind::HeadTooLarge, Peer::Upstream, ""))
        }
        Err(_) => {
            return Err(Error::new(
                Kind::Head,
                Peer::Upstream,
                "not an HTTP/1.x response head",
            ))
        }
    };
    if len > MAX_HEAD_BYTES {
        return Err(Error::new(Kind::HeadTooLarge, Peer::Upstream, ""));
    }
    let code = resp
        .code
        .ok_or(Error::new(Kind::Head, Peer::Upstream, "no status"))?;
    let status = StatusCode::from_u16(code)
        .map_err(|_| Error::new(Kind::Head, Peer::Upstream, "invalid status"))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(Error::new(
            Kind::Head,
            Peer::Upstream,
            "101 Switching Protocols to a request without Upgrade",
        ));
    }
    if status.is_informational() {
        return Ok(Parsed::Informational(len));
    }
    let http10 = resp.version == Some(0);
    // Room for the headers the gateway adds to an answer it serves as its own stream
    // (`proxy::respond::sse_headers`): growing the map there rehashed it.
    let mut headers = HeaderMap::with_capacity(resp.headers.len() + ADDED_HEADERS);
    for h in resp.headers.iter() {
        let name = header_name(h.name.as_bytes())
            .map_err(|_| Error::new(Kind::Head, Peer::Upstream, "invalid header name"))?;
        let value = value(h.value)
            .map_err(|_| Error::new(Kind::Head, Peer::Upstream, "invalid header value"))?;
        headers.append(name, value);
    }
    let framing = framing(status, &headers, http10, Peer::Upstream)?;
    let close = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
    Ok(Parsed::Final(
        Head {
            status,
            headers,
            framing,
            keep_alive: !http10 && !close,
        },
        len,
    ))
}

/// The body framing of a response (RFC 9112 §6.3), refusing every ambiguity.
fn framing(
    status: StatusCode,
    headers: &HeaderMap,
    http10: bool,
    peer: Peer,
) -> Result<Framing, Error> {
    let te = headers.get_all(http::header::TRANSFER_ENCODING);
    let cl = headers.get_all(http::header::CONTENT_LENGTH);
    let has_te = te.iter().next().is_some();
    let has_cl = cl.iter().next().is_some();
    if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        if has_te {
            return Err(Error::new(
                Kind::Framing,
                peer,
                "Transfer-Encoding on a response without a body",
            ));
        }
        return Ok(Framing::Length(0));
    }
    if has_te {
        if has_cl {
            return Err(Error::new(
                Kind::Framing,
                peer,
                "both Transfer-Encoding and Content-Length",
            ));
        }
        if http10 {
            return Err(Error::new(
                Kind::Framing,
                peer,
                "Transfer-Encoding in an HTTP/1.0 response",
            ));
        }
        let mut codings = te
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .map(|c| c.trim_ascii())
            .filter(|c| !c.is_empty());
        return match (codings.next(), codings.next()) {
            (Some(c), None) if c.eq_ignore_ascii_case(b"chunked") => Ok(Framing::Chunked),
            _ => Err(Error::new(
                Kind::Framing,
                peer,
                "a transfer coding other than chunked alone",
            )),
        };
    }
    if !has_cl {
        return Ok(Framing::Close);
    }
    let mut length: Option<u64> = None;
    for part in cl
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(|p| p.trim_ascii())
    {
        if part.is_empty() || part.len() > 19 || !part.iter().all(u8::is_ascii_digit) {
            return Err(Error::new(Kind::Framing, peer, "invalid Content-Length"));
        }
        let n = part.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        if length.is_some_and(|l| l != n) {
            return Err(Error::new(
                Kind::Framing,
                peer,
                "differing Content-Length values",
            ));
        }
        length = Some(n);
    }
    length
        .map(Framing::Length)
        .ok_or(Error::new(Kind::Framing, peer, "invalid Content-Length"))
}

// ---- The client side: the requests the gateway reads and the response heads it writes ----

/// A client's parsed request head.
#[derive(Debug)]
pub struct RequestHead {
    pub parts: http::request::Parts,
    /// How its body ends: `Length` (0 without a body) or `Chunked`, never `Close`.
    pub framing: Framing,
    /// Whether the connection may carry another request after this one: HTTP/1.1 without
    /// `Connection: close`, HTTP/1.0 with `Connection: keep-alive`.
    pub keep_alive: bool,
    /// `Expect: 100-continue` (HTTP/1.1): the client waits for a `100 Continue` before the
    /// body, sent when the body is first asked for.
    pub expect_continue: bool,
}

/// Most headers a request head may have before httparse needs a heap slot array.
const STACK_HEADERS: usize = 100;

/// Parses the request head at the start of `buf` and splits its bytes off it (it keeps what
/// followed them: the body's first bytes, a next request), `None` while it is incomplete. At
/// most `max_headers` headers; `buf`'s own bound (the caller's `--max-header-bytes`) is the
/// caller's. Header values are slices of the head's bytes, not copies. Empty lines before the
/// request line are skipped (RFC 9112 §2.2). Strict where a reverse proxy must be (RFC 9112
/// §6.1, §6.3): a `Transfer-Encoding` with a `Content-Length` or in HTTP/1.0, a transfer coding
/// other than `chunked` alone, invalid or differing lengths, obs-fold and bare CR are errors.
pub(crate) fn take_request(
    buf: &mut bytes::BytesMut,
    max_headers: usize,
) -> Result<Option<RequestHead>, Error> {
    use std::mem::MaybeUninit;
    let mut stack = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; STACK_HEADERS];
    let mut heap;
    let slots: &mut [MaybeUninit<httparse::Header<'_>>] = if max_headers <= STACK_HEADERS {
        &mut stack[..max_headers]
    } else {
        heap = Vec::with_capacity(max_headers);
        heap.resize_with(max_headers, MaybeUninit::uninit);
        &mut heap
    };
    let mut req = httparse::Request::new(&mut []);
    let len = match req.parse_with_uninit_headers(buf, slots) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Error::new(Kind::HeadTooLarge, Peer::Client, ""))
        }
        Err(httparse::Error::Version) => {
            return Err(Error::new(Kind::Head, Peer::Client, "unknown HTTP version"))
        }
        Err(_) => {
            return Err(Error::new(
                Kind::Head,
                Peer::Client,
                "not an HTTP/1.x request head",
            ))
        }
    };
    let (Some(method), Some(path), Some(version)) = (req.method, req.path, req.version) else {
        return Err(Error::new(
            Kind::Head,
            Peer::Client,
            "incomplete request line",
        ));
    };
    let method = http::Method::from_bytes(method.as_bytes())
        .map_err(|_| Error::new(Kind::Head, Peer::Client, "invalid method"))?;
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| {
        let from = s.as_ptr() as usize - base;
        from..from + s.len()
    };
    let path = at(path.as_bytes());
    // The names now, the values once the head's bytes are split off (slices of them); the
    // framing headers noted on the way, not looked up again.
    let mut names = Vec::with_capacity(req.headers.len());
    let mut seen = Seen::default();
    for h in req.headers.iter() {
        let name = header_name(h.name.as_bytes())
            .map_err(|_| Error::new(Kind::Head, Peer::Client, "invalid header name"))?;
        seen.note(&name);
        names.push((name, at(h.value)));
    }
    let head = buf.split_to(len).freeze();
    let uri = http::Uri::from_maybe_shared(head.slice(path))
        .map_err(|_| Error::new(Kind::Head, Peer::Client, "invalid request target"))?;
    let mut headers = HeaderMap::with_capacity(names.len());
    for (name, value) in names {
        let value = HeaderValue::from_maybe_shared(head.slice(value))
            .map_err(|_| Error::new(Kind::Head, Peer::Client, "invalid header value"))?;
        headers.append(name, value);
    }
    let http10 = version == 0;
    let framing = if seen.framing {
        request_framing(&headers, http10)?
    } else {
        Framing::Length(0)
    };
    let connection = |token: &[u8]| {
        seen.connection
            && headers
                .get_all(http::header::CONNECTION)
                .iter()
                .flat_map(|v| v.as_bytes().split(|&b| b == b','))
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
    };
    let keep_alive = if http10 {
        connection(b"keep-alive")
    } else {
        !connection(b"close")
    };
    let expect_continue = !http10
        && seen.expect
        && headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = method;
    parts.uri = uri;
    parts.version = if http10 {
        http::Version::HTTP_10
    } else {
        http::Version::HTTP_11
    };
    parts.headers = headers;
    Ok(Some(RequestHead {
        parts,
        framing,
        keep_alive,
        expect_continue,
    }))
}

/// [`take_request`] on a copy of `buf`: the head and its length, `buf` left as it is.
pub fn parse_request(
    buf: &[u8],
    max_headers: usize,
) -> Result<Option<(RequestHead, usize)>, Error> {
    let mut copy = bytes::BytesMut::from(buf);
    Ok(take_request(&mut copy, max_headers)?.map(|head| (head, buf.len() - copy.len())))
}

/// Which of the headers that decide a request's framing and its connection's fate it has.
#[derive(Default)]
struct Seen {
    framing: bool,
    connection: bool,
    expect: bool,
}

impl Seen {
    fn note(&mut self, name: &HeaderName) {
        if name == http::header::TRANSFER_ENCODING || name == http::header::CONTENT_LENGTH {
            self.framing = true;
        } else if name == http::header::CONNECTION {
            self.connection = true;
        } else if name == http::header::EXPECT {
            self.expect = true;
        }
    }
}

/// The body framing of a request (RFC 9112 §6.3): as a response's, but a request without
/// either header has no body (never close-delimited), and a `Content-Length` list (`5, 5`,
/// which RFC 9112 lets a recipient refuse) is refused, as hyper's server does: a client's
/// request is never read more leniently than hyper would (`fuzz/checks/h1_differential.rs`).
fn request_framing(headers: &HeaderMap, http10: bool) -> Result<Framing, Error> {
    if headers
        .get_all(http::header::CONTENT_LENGTH)
        .iter()
        .any(|v| v.as_bytes().contains(&b','))
    {
        return Err(Error::new(
            Kind::Framing,
            Peer::Client,
            "a Content-Length list",
        ));
    }
    match framing(StatusCode::OK, headers, http10, Peer::Client)? {
        Framing::Close => Ok(Framing::Length(0)),
        f => Ok(f),
    }
}

/// How a response's body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResponseFraming {
    /// `Content-Length`.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the connection closes (a body of unknown length to an HTTP/1.0 client).
    Close,
    /// No body and no framing header (1xx, 204, 304), or the answer to a `HEAD`, whose
    /// framing headers are the response's own.
    None,
}

/// Writes a response head: the status line, `headers` (their framing headers replaced by
/// `framing`'s, unless it is [`ResponseFraming::None`]), `Connection: close` when the
/// connection ends after it, and `date` when `headers` have none.
pub(crate) fn response_head(
    status: StatusCode,
    headers: &HeaderMap,
    framing: ResponseFraming,
    close: bool,
    date: &[u8],
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let own_framing = framing != ResponseFraming::None;
    for (name, value) in headers {
        if name == http::header::CONNECTION
            || (own_framing
                && (name == http::header::CONTENT_LENGTH
                    || name == http::header::TRANSFER_ENCODING))
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        ResponseFraming::Length(n) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        ResponseFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        ResponseFraming::Close | ResponseFraming::None => {}
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    if !headers.contains_key(http::header::DATE) {
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(date);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TOO_LARGE: Error = Error::new(Kind::HeadTooLarge, Peer::Upstream, "");
    const REQUEST_TOO_LARGE: Error = Error::new(Kind::HeadTooLarge, Peer::Client, "");

    #[test]
    fn a_request_head_is_split_off_its_buffer_with_what_it_says() {
        let mut buf = bytes::BytesMut::from(
            &b"\r\nPOST /mcp?x=1 HTTP/1.1\r\nHost: a\r\nConnection: close\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhe"[..],
        );
        let whole = buf.clone();
        for cut in 1..whole.len() - 12 {
            let mut part = bytes::BytesMut::from(&whole[..cut]);
            assert!(take_request(&mut part, 100).unwrap().is_none(), "{cut}");
            assert_eq!(part.len(), cut, "an incomplete head leaves its bytes");
        }
        let head = take_request(&mut buf, 100).unwrap().expect("complete");
        assert_eq!(&buf[..], b"5\r\nhe", "the body's first bytes stay");
        assert_eq!(head.parts.method, http::Method::POST);
        assert_eq!(head.parts.uri, "/mcp?x=1");
        assert_eq!(head.parts.headers["host"], "a");
        assert_eq!(head.framing, Framing::Chunked);
        assert!(!head.keep_alive && head.expect_continue);
        let mut plain =
            bytes::BytesMut::from(&b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"[..]);
        let head = take_request(&mut plain, 100).unwrap().unwrap();
        assert_eq!(
            (head.framing, head.keep_alive, head.expect_continue),
            (Framing::Length(0), true, false)
        );
        let mut many =
            bytes::BytesMut::from(&b"GET / HTTP/1.1\r\na: 1\r\nb: 2\r\nc: 3\r\n\r\n"[..]);
        assert_eq!(take_request(&mut many, 2).unwrap_err(), REQUEST_TOO_LARGE);
    }

    fn head(raw: &str) -> Result<Option<(Head, usize)>, Error> {
        parse_head(raw.as_bytes())
    }

    fn framing_of(raw: &str) -> Result<Framing, Error> {
        head(raw).map(|h| h.expect("complete").0.framing)
    }

    #[test]
    fn heads_and_their_framing() {
        let ok = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\nrest";
        let (h, n) = head(ok).unwrap().unwrap();
        assert_eq!(h.status, StatusCode::OK);
        assert_eq!(h.framing, Framing::Chunked);
        assert_eq!(&ok[n..], "rest");
        assert_eq!(h.headers["content-type"], "text/event-stream");
        assert!(head("HTTP/1.1 200 OK\r\nContent-Type: text/ev")
            .unwrap()
            .is_none());
        for (raw, want) in [
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
                Framing::Length(5),
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\nContent-Length: 5\r\n\r\n",
                Framing::Length(5),
            ),
            ("HTTP/1.1 200 OK\r\n\r\n", Framing::Close),
            ("HTTP/1.0 200 OK\r\n\r\n", Framing::Close),
            (
                "HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n",
                Framing::Length(0),
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: ChUnKeD\r\n\r\n",
                Framing::Chunked,
            ),
        ] {
            assert_eq!(framing_of(raw), Ok(want), "{raw:?}");
        }
        // Informational heads are skipped.
        let raw = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
        let (h, n) = head(&format!("{raw}body")).unwrap().unwrap();
        assert_eq!((h.status, n), (StatusCode::NOT_FOUND, raw.len()));
        assert!(head("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 2")
            .unwrap()
            .is_none());
    }

    #[test]
    fn ambiguous_or_malformed_heads_are_errors() {
        for raw in [
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 0x5\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length:\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
            "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            "HTTP/2 200 OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n",
            "HTTP/1.1 200 OK\r\n folded: x\r\n\r\n",
            "SSH-2.0-OpenSSH\r\n\r\n",
        ] {
            assert!(head(raw).is_err(), "{raw:?}");
        }
        let many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: v\r\n")).collect();
        assert_eq!(
            head(&format!("HTTP/1.1 200 OK\r\n{many}\r\n")).unwrap_err(),
            TOO_LARGE
        );
        let long = format!("HTTP/1.1 200 OK\r\nx: {}", "v".repeat(MAX_HEAD_BYTES));
        assert_eq!(head(&long).unwrap_err(), TOO_LARGE);
    }

    #[test]
    fn interim_heads_are_bounded_in_number_and_bytes_over_every_read() {
        const CONTINUE: &str = "HTTP/1.1 100 Continue\r\n\r\n";
        const OK: &str = "HTTP/1.1 204 No Content\r\n\r\n";
        // At the bound: the answer is read, in one buffer or one read at a time.
        let most = format!("{}{OK}", CONTINUE.repeat(MAX_INTERIM_HEADS));
        assert_eq!(head(&most).unwrap().unwrap().0.status, 204);
        let mut interim = Interim::default();
        for _ in 0..MAX_INTERIM_HEADS {
            let mut buf = bytes::BytesMut::from(CONTINUE);
            assert!(take_head_after(&mut buf, &mut interim).unwrap().is_none());
        }
        let mut buf = bytes::BytesMut::from(OK);
        assert!(take_head_after(&mut buf, &mut interim).unwrap().is_some());
        // One more, however the reads cut them: refused, never skipped for as long as an
        // upstream writes them.
        let flood = CONTINUE.repeat(MAX_INTERIM_HEADS + 1);
        assert!(
            matches!(head(&flood), Err(e) if e.kind() == Kind::Head),
            "{:?}",
            head(&flood)
        );
        let mut buf = bytes::BytesMut::from(flood.as_str());
        assert!(take_head(&mut buf).is_err());
        let mut interim = Interim::default();
        let mut refused = None;
        for i in 0..=MAX_INTERIM_HEADS {
            let mut buf = bytes::BytesMut::from(CONTINUE);
            if let Err(e) = take_head_after(&mut buf, &mut interim) {
                refused = Some((i, e));
                break;
            }
        }
        assert!(
            matches!(refused, Some((i, ref e)) if i == MAX_INTERIM_HEADS && e.kind() == Kind::Head),
            "{refused:?}"
        );
        // Their bytes count with the final head's.
        let big = format!(
            "HTTP/1.1 103 Early Hints\r\nlink: {}\r\n\r\n",
            "v".repeat(MAX_HEAD_BYTES / 2)
        );
        let mut interim = Interim::default();
        let mut buf = bytes::BytesMut::from(big.as_str());
        assert!(take_head_after(&mut buf, &mut interim).unwrap().is_none());
        let mut buf = bytes::BytesMut::from(big.as_str());
        assert_eq!(
            take_head_after(&mut buf, &mut interim).unwrap_err(),
            TOO_LARGE
        );
        assert_eq!(head(&format!("{big}{big}{OK}")).unwrap_err(), TOO_LARGE);
    }

    #[test]
    fn a_known_name_is_the_name_from_bytes_makes() {
        for name in [
            "Mcp-Session-Id",
            "mcp-session-id",
            "MCP-PROTOCOL-VERSION",
            "Last-Event-ID",
            "traceparent",
            "X-Forwarded-For",
            "x-forwarded-proto",
            "accept-charset",
            "mcp-session-iD",
            "mcp_session-id",
            "mcp-session-ix",
            "content-type",
            "x",
        ] {
            assert_eq!(
                header_name(name.as_bytes()).unwrap(),
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                "{name}"
            );
        }
        for bad in ["mcp-session id", "mcp-session-i\u{e9}", "traceparen\n", ""] {
            assert!(header_name(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn keep_alive_is_http11_without_connection_close() {
        for (raw, want) in [
            ("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", true),
            (
                "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 0\r\n\r\n",
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nConnection: x-a, close\r\nContent-Length: 0\r\n\r\n",
                false,
            ),
            ("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", false),
        ] {
            assert_eq!(head(raw).unwrap().unwrap().0.keep_alive, want, "{raw}");
        }
    }

    /// What [`take_head`] made of `wire`: the head (status, headers in order, framing,
    /// keep-alive) and the bytes left in the buffer; what [`parse_head`] made of it, the same way.
    type Taken = Result<Option<Summary>, Error>;
    type Summary = (u16, Vec<(String, Vec<u8>)>, Framing, bool, Vec<u8>);

    fn summary(h: &Head, rest: &[u8]) -> Summary {
        let headers = h
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect();
        (
            h.status.as_u16(),
            headers,
            h.framing,
            h.keep_alive,
            rest.to_vec(),
        )
    }

    fn taken(wire: &[u8]) -> Taken {
        let mut buf = bytes::BytesMut::from(wire);
        Ok(take_head(&mut buf)?.map(|h| summary(&h, &buf)))
    }

    fn parsed(wire: &[u8]) -> Taken {
        Ok(parse_head(wire)?.map(|(h, len)| summary(&h, &wire[len..])))
    }

    #[test]
    fn a_head_taken_from_a_read_buffer_is_the_parsed_head() {
        for wire in [
            &b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nMcp-Session-Id: abc\r\n\r\ndata"[..],
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
            b"HTTP/1.1 200 OK\nContent-Length: 0\n\nnext",
            b"\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n",
            b"HTTP/1.1 200 OK\r\nX: a\r\n\r",
            b"HTTP/1.1 200 OK\r\nBad Name: a\r\n\r\n",
            b"nonsense\n\n",
        ] {
            assert_eq!(taken(wire), parsed(wire), "{:?}", String::from_utf8_lossy(wire));
        }
        let (_, headers, ..) = taken(b"HTTP/1.1 200 OK\r\nA: 1\r\nA: 2\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            headers,
            [("a".into(), b"1".to_vec()), ("a".into(), b"2".to_vec())]
        );
    }

    proptest! {
        /// A head taken from a read buffer is the head `parse_head` finds, and the buffer
        /// keeps exactly the bytes after it, for heads of every shape and arbitrary bytes.
        #[test]
        fn taking_a_head_agrees_with_parsing_it(
            informational: bool,
            lf_only: bool,
            leading_empty: bool,
            headers in proptest::collection::vec(("[a-zA-Z-]{1,12}", "[ -~]{0,20}"), 0..6),
            after in proptest::collection::vec(any::<u8>(), 0..20),
            garbage in proptest::collection::vec(any::<u8>(), 0..80),
        ) {
            let eol = if lf_only { "\n" } else { "\r\n" };
            let mut wire = String::new();
            if leading_empty {
                wire.push_str(eol);
            }
            if informational {
                wire.push_str(&format!("HTTP/1.1 100 Continue{eol}{eol}"));
            }
            wire.push_str(&format!("HTTP/1.1 200 OK{eol}"));
            for (n, v) in &headers {
                wire.push_str(&format!("{n}: {v}{eol}"));
            }
            wire.push_str(eol);
            let mut wire = wire.into_bytes();
            wire.extend_from_slice(&after);
            prop_assert_eq!(taken(&wire), parsed(&wire));
            prop_assert_eq!(taken(&garbage), parsed(&garbage));
        }

    }
}
