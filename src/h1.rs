//! HTTP/1.1 framing, both sides, pure. Upstream: the request head the gateway writes, the
//! response head ([`parse_head`], httparse), and the body's framing ([`BodyDecoder`]:
//! `Content-Length`, `chunked` or close-delimited), one pass over each read, the data handed
//! out as slices of the read. Client side (`server::h1` does the I/O): a client's request head
//! ([`take_request`]; its body through the same decoder) and the response head the gateway
//! writes ([`response_head`]).
//!
//! Strict where a reverse proxy must be (RFC 9112 §6.3, §7.1): `Transfer-Encoding` with
//! `Content-Length`, differing lengths, a transfer coding other than `chunked` alone, a chunk
//! size that is not hex or overflows, a missing CRLF, a trailer line that is not a header
//! line (a name token, a colon, a value without control bytes), and oversized heads, extensions
//! or trailers are errors, never guesses. Pure: no I/O, no clocks (see `docs/design.md`, "The
//! upstream streams the gateway reads itself").

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;

/// Headers the gateway may add to an upstream answer's head.
const ADDED_HEADERS: usize = 4;

/// Most bytes of a response head (status line and headers).
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers in a response head.
pub(crate) const MAX_HEADERS: usize = 100;
/// Most bytes of chunk extensions over one body (they carry nothing the gateway uses).
pub(crate) const MAX_EXTENSION_BYTES: usize = 16 * 1024;
/// Most bytes of trailers after the last chunk (read and dropped); a client's request body
/// is held to the smaller of this and its head bound ([`BodyDecoder::with_trailer_limit`]).
pub(crate) const MAX_TRAILER_BYTES: usize = 16 * 1024;
/// Most interim (`1xx`) heads before a response's final head: an upstream that sends more
/// (an endless stream of them) is refused, not read for as long as it writes.
pub(crate) const MAX_INTERIM_HEADS: usize = 16;

/// Why a response cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum H1Error {
    #[error("malformed response head: {0}")]
    Head(&'static str),
    #[error("response head larger than {MAX_HEAD_BYTES} bytes or {MAX_HEADERS} headers")]
    HeadTooLarge,
    #[error("ambiguous body framing: {0}")]
    Framing(&'static str),
    #[error("malformed chunked body: {0}")]
    Chunk(&'static str),
    #[error("the upstream closed the connection before the end of the body")]
    EarlyClose,
}

/// How the body of a response ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Exactly this many bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// At the end of the connection.
    Close,
}

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

/// What a proxy adds to the head of a request it forwards, as the head is written: the
/// client's address appended to the first `X-Forwarded-For` (which replaces any others; a
/// value that is not visible ASCII is replaced by the address alone), and
/// `X-Forwarded-Proto` unless the hop in front set one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Forwarded<'a> {
    /// The client's address; `None`: `X-Forwarded-For` is left as it is.
    pub for_addr: Option<&'a str>,
    /// `http` or `https`: how the client reached the gateway.
    pub proto: &'static str,
}

/// What the head of a forwarded request gets beside the client's headers.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Added<'a> {
    /// `Host`, when the client's headers have none (an HTTP/2 client's `:authority`).
    pub host: Option<&'a str>,
    /// Headers of the gateway's own (a trace context), written after the client's; a client
    /// header of the same name is left out.
    pub own: Option<&'a HeaderMap>,
    pub forwarded: Option<Forwarded<'a>>,
}

/// Writes the start of a request's head: the request line for `method` and
/// `path_and_query`, then `headers` (their values cannot hold a line break: `HeaderValue`
/// refuses them) less those `skip` names, then what `added` adds. The gateway sends every
/// body whole and frames it itself ([`end_request_head`]), so the framing headers of
/// `headers` are left out, and so is `Expect` (nothing waits for a `100 Continue`).
pub(crate) fn request_head(
    method: &http::Method,
    path_and_query: &str,
    headers: &HeaderMap,
    skip: impl Fn(&HeaderName) -> bool,
    added: Added<'_>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path_and_query.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let line = |out: &mut Vec<u8>, name: &[u8], value: &[u8]| {
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    };
    let (mut for_written, mut proto_seen, mut host_seen) = (false, false, false);
    for (name, value) in headers {
        if name == http::header::CONTENT_LENGTH
            || name == http::header::TRANSFER_ENCODING
            || name == http::header::EXPECT
            || skip(name)
            || added.own.is_some_and(|own| own.contains_key(name))
        {
            continue;
        }
        host_seen |= name == http::header::HOST;
        if let Some(f) = added.forwarded {
            match name.as_str() {
                "x-forwarded-for" => {
                    if let Some(addr) = f.for_addr {
                        if !for_written {
                            out.extend_from_slice(b"x-forwarded-for: ");
                            if value.to_str().is_ok() {
                                out.extend_from_slice(value.as_bytes());
                                out.extend_from_slice(b", ");
                            }
                            out.extend_from_slice(addr.as_bytes());
                            out.extend_from_slice(b"\r\n");
                            for_written = true;
                        }
                        continue;
                    }
                }
                "x-forwarded-proto" => proto_seen = true,
                _ => {}
            }
        }
        line(&mut out, name.as_str().as_bytes(), value.as_bytes());
    }
    if let (Some(host), false) = (added.host, host_seen) {
        line(&mut out, b"host", host.as_bytes());
    }
    for (name, value) in added.own.into_iter().flatten() {
        line(&mut out, name.as_str().as_bytes(), value.as_bytes());
    }
    if let Some(f) = added.forwarded {
        if let (Some(addr), false) = (f.for_addr, for_written) {
            line(&mut out, b"x-forwarded-for", addr.as_bytes());
        }
        if !proto_seen {
            line(&mut out, b"x-forwarded-proto", f.proto.as_bytes());
        }
    }
    out
}

/// Ends a head [`request_head`] started: a `Content-Length` of `body_len` when it is
/// `Some`, and the empty line.
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
    fn add(&mut self, len: usize) -> Result<(), H1Error> {
        self.heads += 1;
        if self.heads > MAX_INTERIM_HEADS {
            return Err(H1Error::Head("too many interim (1xx) responses"));
        }
        self.fits(len)?;
        self.bytes += len;
        Ok(())
    }

    /// Whether `more` bytes of head fit after the interim heads.
    fn fits(&self, more: usize) -> Result<(), H1Error> {
        if self.bytes + more > MAX_HEAD_BYTES {
            return Err(H1Error::HeadTooLarge);
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
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, H1Error> {
    parse_after(buf, Interim::default())
}

/// [`parse_head`] after the interim heads `seen` (already taken off the buffer).
fn parse_after(buf: &[u8], seen: Interim) -> Result<Option<(Head, usize)>, H1Error> {
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
pub fn take_head(buf: &mut bytes::BytesMut) -> Result<Option<Head>, H1Error> {
    take_head_after(buf, &mut Interim::default())
}

/// [`take_head`] on one read after another of the same response: `interim` counts the
/// interim heads taken off `buf` so far (their bound holds over all the reads).
pub(crate) fn take_head_after(
    buf: &mut bytes::BytesMut,
    interim: &mut Interim,
) -> Result<Option<Head>, H1Error> {
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
fn take_parsed(buf: &mut bytes::BytesMut, seen: Interim) -> Result<Option<Head>, H1Error> {
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
) -> Result<Parsed, H1Error> {
    // Not initialised: zeroing 100 slots was 3.2 KB of stores per response head, most of
    // them cache misses (`bench/callgrind` with `--cache-sim=yes`).
    let mut slots =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, buf, &mut slots)
    {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(httparse::Error::TooManyHeaders) => return Err(H1Error::HeadTooLarge),
        Err(_) => return Err(H1Error::Head("not an HTTP/1.x response head")),
    };
    if len > MAX_HEAD_BYTES {
        return Err(H1Error::HeadTooLarge);
    }
    let code = resp.code.ok_or(H1Error::Head("no status"))?;
    let status = StatusCode::from_u16(code).map_err(|_| H1Error::Head("invalid status"))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(H1Error::Head(
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
        let name =
            header_name(h.name.as_bytes()).map_err(|_| H1Error::Head("invalid header name"))?;
        let value = value(h.value).map_err(|_| H1Error::Head("invalid header value"))?;
        headers.append(name, value);
    }
    let framing = framing(status, &headers, http10)?;
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
fn framing(status: StatusCode, headers: &HeaderMap, http10: bool) -> Result<Framing, H1Error> {
    let te = headers.get_all(http::header::TRANSFER_ENCODING);
    let cl = headers.get_all(http::header::CONTENT_LENGTH);
    let has_te = te.iter().next().is_some();
    let has_cl = cl.iter().next().is_some();
    if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        if has_te {
            return Err(H1Error::Framing(
                "Transfer-Encoding on a response without a body",
            ));
        }
        return Ok(Framing::Length(0));
    }
    if has_te {
        if has_cl {
            return Err(H1Error::Framing(
                "both Transfer-Encoding and Content-Length",
            ));
        }
        if http10 {
            return Err(H1Error::Framing(
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
            _ => Err(H1Error::Framing(
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
            return Err(H1Error::Framing("invalid Content-Length"));
        }
        let n = part.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        if length.is_some_and(|l| l != n) {
            return Err(H1Error::Framing("differing Content-Length values"));
        }
        length = Some(n);
    }
    length
        .map(Framing::Length)
        .ok_or(H1Error::Framing("invalid Content-Length"))
}

/// Hands the next up to `left` bytes of `input` from `*i` to `data`, moves `*i` past them, and
/// returns how many bytes are left after them.
fn take<'a>(left: u64, input: &'a [u8], i: &mut usize, data: &mut impl FnMut(&'a [u8])) -> u64 {
    let n = usize::try_from(left)
        .unwrap_or(usize::MAX)
        .min(input.len() - *i);
    data(&input[*i..*i + n]);
    *i += n;
    left - n as u64
}

/// Where a chunked body's decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// In a chunk-size line: the size so far and its digit count.
    Size(u64, u8),
    /// After the size: whitespace before `;` or CR.
    SizeWs(u64),
    /// In a chunk extension (dropped).
    Ext(u64),
    /// After the size line's CR.
    SizeLf(u64),
    /// In a chunk's data, this many bytes left.
    Data(u64),
    /// After a chunk's data: its CR, then its LF.
    DataCr,
    DataLf,
    /// After the last chunk: at the start of a trailer line (or of the final CRLF).
    TrailerStart,
    /// In a trailer line's name.
    TrailerName,
    /// In a trailer line's value (after its colon).
    TrailerValue,
    /// After a trailer line's CR.
    TrailerLf,
    /// After the final CR.
    EndLf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Length(u64),
    Chunked(Chunk),
    Close,
    Done,
}

/// A whole chunk-size line without extensions at the start of `input` (1 to 16 hex digits,
/// then CRLF): the size and the line's length. `None` for anything else, complete or not: the
/// byte-by-byte path decides those (and gives the errors).
fn size_line(input: &[u8]) -> Option<(u64, usize)> {
    let mut n = 0u64;
    for (k, &b) in input.iter().enumerate().take(17) {
        match b {
            b'\r' if k > 0 => return (input.get(k + 1) == Some(&b'\n')).then_some((n, k + 2)),
            _ if k < 16 => n = n << 4 | u64::from((b as char).to_digit(16)?),
            _ => return None,
        }
    }
    None
}

/// Whether `b` may be in a header (or trailer) name: RFC 9110 §5.6.2's `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The incremental decoder of a response body: feed it each read, get the data as slices of
/// it. Bounded: it keeps a few integers, never bytes.
#[derive(Debug, Clone)]
pub struct BodyDecoder {
    state: State,
    /// Extension bytes seen so far (bounded).
    extension: usize,
    /// Trailer bytes still allowed.
    trailer_left: usize,
}

impl BodyDecoder {
    pub fn new(framing: Framing) -> BodyDecoder {
        BodyDecoder::with_trailer_limit(framing, MAX_TRAILER_BYTES)
    }

    /// A decoder whose trailers may have at most `max` bytes (and at most
    /// [`MAX_TRAILER_BYTES`]): a request's trailers are held to the request head's bound.
    pub fn with_trailer_limit(framing: Framing, max: usize) -> BodyDecoder {
        let state = match framing {
            Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(Chunk::Size(0, 0)),
            Framing::Close => State::Close,
        };
        BodyDecoder {
            state,
            extension: 0,
            trailer_left: max.min(MAX_TRAILER_BYTES),
        }
    }

    /// One more byte of trailers.
    fn trailer_byte(&mut self) -> Result<(), H1Error> {
        self.trailer_left = self
            .trailer_left
            .checked_sub(1)
            .ok_or(H1Error::Chunk("trailers too large"))?;
        Ok(())
    }

    /// The bytes of body data still to come, when the framing says (`Content-Length`).
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// Whether the body has ended (its length read, its last chunk and trailers read).
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Decodes `input`, handing each piece of body data to `data` in order. Returns how many
    /// bytes of `input` belong to the body: fewer than `input.len()` only once the body has
    /// ended (the rest is bytes the upstream wrote after it).
    pub fn decode<'a>(
        &mut self,
        input: &'a [u8],
        mut data: impl FnMut(&'a [u8]),
    ) -> Result<usize, H1Error> {
        let mut i = 0;
        while i < input.len() {
            match self.state {
                State::Done => return Ok(i),
                State::Close => {
                    data(&input[i..]);
                    return Ok(input.len());
                }
                State::Length(left) => {
                    let left = take(left, input, &mut i, &mut data);
                    self.state = if left == 0 {
                        State::Done
                    } else {
                        State::Length(left)
                    };
                }
                State::Chunked(Chunk::Data(left)) => {
                    let left = take(left, input, &mut i, &mut data);
                    self.state = State::Chunked(if left == 0 {
                        Chunk::DataCr
                    } else {
                        Chunk::Data(left)
                    });
                }
                // The common framing in one step when it is whole in this read: a bare size
                // line, the CRLF after a chunk's data. Anything else goes byte by byte.
                State::Chunked(Chunk::Size(0, 0))
                    if let Some((n, used)) = size_line(&input[i..]) =>
                {
                    // The usual small chunk whole in this read, the CRLF after its data too:
                    // taken at once, back at the next size line (one pass of this loop a
                    // chunk, not three).
                    let data_at = i + used;
                    let end = usize::try_from(n)
                        .ok()
                        .filter(|&len| len > 0)
                        .and_then(|len| data_at.checked_add(len))
                        .filter(|&end| {
                            end.checked_add(2).and_then(|e| input.get(end..e)) == Some(b"\r\n")
                        });
                    if let Some(end) = end {
                        data(&input[data_at..end]);
                        i = end + 2;
                        continue;
                    }
                    self.state = State::Chunked(if n == 0 {
                        Chunk::TrailerStart
                    } else {
                        Chunk::Data(n)
                    });
                    i += used;
                }
                State::Chunked(Chunk::DataCr) if input[i..].starts_with(b"\r\n") => {
                    self.state = State::Chunked(Chunk::Size(0, 0));
                    i += 2;
                }
                State::Chunked(c) => {
                    self.state = self.chunk_byte(c, input[i])?;
                    i += 1;
                }
            }
        }
        Ok(i)
    }

    /// One byte of chunked framing (everything but chunk data).
    fn chunk_byte(&mut self, c: Chunk, b: u8) -> Result<State, H1Error> {
        let next = match (c, b) {
            (Chunk::Size(n, digits), _) if b.is_ascii_hexdigit() => {
                if digits >= 16 {
                    return Err(H1Error::Chunk("chunk size too large"));
                }
                let d = (b as char).to_digit(16).unwrap_or(0);
                Chunk::Size(n << 4 | u64::from(d), digits + 1)
            }
            (Chunk::Size(_, 0), _) => return Err(H1Error::Chunk("chunk size is not hex")),
            (Chunk::Size(n, _) | Chunk::SizeWs(n), b' ' | b'\t') => Chunk::SizeWs(n),
            (Chunk::Size(n, _) | Chunk::SizeWs(n), b';') => Chunk::Ext(n),
            (Chunk::Size(n, _) | Chunk::SizeWs(n) | Chunk::Ext(n), b'\r') => Chunk::SizeLf(n),
            (Chunk::Size(..) | Chunk::SizeWs(_), _) => {
                return Err(H1Error::Chunk("invalid byte in the chunk size line"))
            }
            (Chunk::Ext(_), b'\n') => return Err(H1Error::Chunk("bare LF in a chunk extension")),
            (Chunk::Ext(n), _) => {
                self.extension += 1;
                if self.extension > MAX_EXTENSION_BYTES {
                    return Err(H1Error::Chunk("chunk extensions too large"));
                }
                Chunk::Ext(n)
            }
            (Chunk::SizeLf(0), b'\n') => Chunk::TrailerStart,
            (Chunk::SizeLf(n), b'\n') => Chunk::Data(n),
            (Chunk::SizeLf(_), _) => {
                return Err(H1Error::Chunk("CR without LF after the chunk size"))
            }
            (Chunk::DataCr, b'\r') => Chunk::DataLf,
            (Chunk::DataCr, _) => return Err(H1Error::Chunk("chunk data longer than its size")),
            (Chunk::DataLf, b'\n') => Chunk::Size(0, 0),
            (Chunk::DataLf, _) => return Err(H1Error::Chunk("CR without LF after chunk data")),
            // Trailer lines are header lines (RFC 9112 §7.1.2, §5): a name token, a colon, a
            // value without control bytes but HTAB; no obs-fold, no bare CR or LF.
            (Chunk::TrailerStart, b'\r') => Chunk::EndLf,
            (Chunk::TrailerStart | Chunk::TrailerName | Chunk::TrailerValue, b'\n') => {
                return Err(H1Error::Chunk("bare LF in the trailers"))
            }
            (Chunk::TrailerValue, b'\r') => Chunk::TrailerLf,
            (Chunk::TrailerName, b':') => {
                self.trailer_byte()?;
                Chunk::TrailerValue
            }
            (Chunk::TrailerStart | Chunk::TrailerName, _) if is_tchar(b) => {
                self.trailer_byte()?;
                Chunk::TrailerName
            }
            (Chunk::TrailerStart | Chunk::TrailerName, _) => {
                return Err(H1Error::Chunk(
                    "a trailer line without a valid name and colon",
                ))
            }
            (Chunk::TrailerValue, _) if b == b'\t' || (b >= b' ' && b != 0x7f) => {
                self.trailer_byte()?;
                Chunk::TrailerValue
            }
            (Chunk::TrailerValue, _) => {
                return Err(H1Error::Chunk("a control byte in a trailer value"))
            }
            (Chunk::TrailerLf, b'\n') => Chunk::TrailerStart,
            (Chunk::TrailerLf, _) => return Err(H1Error::Chunk("CR without LF in the trailers")),
            (Chunk::EndLf, b'\n') => return Ok(State::Done),
            (Chunk::EndLf, _) => return Err(H1Error::Chunk("CR without LF at the end")),
            (Chunk::Data(_), _) => unreachable!("chunk data is taken in bulk"),
        };
        Ok(State::Chunked(next))
    }

    /// The connection ended: fine for a close-delimited body or one that had ended, an
    /// [`H1Error::EarlyClose`] otherwise.
    pub fn at_eof(&self) -> Result<(), H1Error> {
        match self.state {
            State::Close | State::Done => Ok(()),
            _ => Err(H1Error::EarlyClose),
        }
    }
}

// ---- The client side: the requests the gateway reads and the response heads it writes ----

/// Why a client's request head cannot be served; the answer is [`RequestError::status`] and
/// the connection closes after it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("malformed request head: {0}")]
    Head(&'static str),
    #[error("request head larger than the limits (--max-header-bytes, --max-headers)")]
    HeadTooLarge,
    #[error("ambiguous request body framing: {0}")]
    Framing(&'static str),
}

impl RequestError {
    /// The status a client gets for it (RFC 9110 §15.5.1, RFC 6585 §5); an unknown version
    /// is a malformed head, as hyper answered it.
    pub fn status(&self) -> StatusCode {
        match self {
            RequestError::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            RequestError::Head(_) | RequestError::Framing(_) => StatusCode::BAD_REQUEST,
        }
    }

    /// Why, as the access line's `error.type` says it.
    pub fn reason(&self) -> &'static str {
        match self {
            RequestError::Head(_) => "malformed-head",
            RequestError::HeadTooLarge => "head-too-large",
            RequestError::Framing(_) => "ambiguous-framing",
        }
    }
}

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
) -> Result<Option<RequestHead>, RequestError> {
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
        Err(httparse::Error::TooManyHeaders) => return Err(RequestError::HeadTooLarge),
        Err(httparse::Error::Version) => return Err(RequestError::Head("unknown HTTP version")),
        Err(_) => return Err(RequestError::Head("not an HTTP/1.x request head")),
    };
    let (Some(method), Some(path), Some(version)) = (req.method, req.path, req.version) else {
        return Err(RequestError::Head("incomplete request line"));
    };
    let method = http::Method::from_bytes(method.as_bytes())
        .map_err(|_| RequestError::Head("invalid method"))?;
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
            .map_err(|_| RequestError::Head("invalid header name"))?;
        seen.note(&name);
        names.push((name, at(h.value)));
    }
    let head = buf.split_to(len).freeze();
    let uri = http::Uri::from_maybe_shared(head.slice(path))
        .map_err(|_| RequestError::Head("invalid request target"))?;
    let mut headers = HeaderMap::with_capacity(names.len());
    for (name, value) in names {
        let value = HeaderValue::from_maybe_shared(head.slice(value))
            .map_err(|_| RequestError::Head("invalid header value"))?;
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
) -> Result<Option<(RequestHead, usize)>, RequestError> {
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
fn request_framing(headers: &HeaderMap, http10: bool) -> Result<Framing, RequestError> {
    if headers
        .get_all(http::header::CONTENT_LENGTH)
        .iter()
        .any(|v| v.as_bytes().contains(&b','))
    {
        return Err(RequestError::Framing("a Content-Length list"));
    }
    match framing(StatusCode::OK, headers, http10) {
        Ok(Framing::Close) => Ok(Framing::Length(0)),
        Ok(f) => Ok(f),
        Err(H1Error::Framing(why)) => Err(RequestError::Framing(why)),
        Err(_) => Err(RequestError::Framing("invalid framing")),
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

/// The size line of one chunk of `n` bytes (`<hex>\r\n`) in `out`; its length.
pub(crate) fn chunk_size_line(n: usize, out: &mut [u8; 18]) -> usize {
    let digits = if n == 0 {
        1
    } else {
        (usize::BITS - n.leading_zeros()).div_ceil(4) as usize
    };
    for (i, d) in out[..digits].iter_mut().rev().enumerate() {
        *d = b"0123456789abcdef"[(n >> (4 * i)) & 0xf];
    }
    out[digits] = b'\r';
    out[digits + 1] = b'\n';
    digits + 2
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(
            take_request(&mut many, 2).unwrap_err(),
            RequestError::HeadTooLarge
        );
    }
    use proptest::prelude::*;

    fn head(raw: &str) -> Result<Option<(Head, usize)>, H1Error> {
        parse_head(raw.as_bytes())
    }

    fn framing_of(raw: &str) -> Result<Framing, H1Error> {
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
            H1Error::HeadTooLarge
        );
        let long = format!("HTTP/1.1 200 OK\r\nx: {}", "v".repeat(MAX_HEAD_BYTES));
        assert_eq!(head(&long).unwrap_err(), H1Error::HeadTooLarge);
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
            matches!(head(&flood), Err(H1Error::Head(_))),
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
            matches!(refused, Some((i, H1Error::Head(_))) if i == MAX_INTERIM_HEADS),
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
            H1Error::HeadTooLarge
        );
        assert_eq!(
            head(&format!("{big}{big}{OK}")).unwrap_err(),
            H1Error::HeadTooLarge
        );
    }

    /// A whole request head: [`request_head`] then [`end_request_head`].
    fn whole_head(
        method: http::Method,
        h: &HeaderMap,
        skip: impl Fn(&HeaderName) -> bool,
        added: Added<'_>,
        body_len: Option<usize>,
    ) -> String {
        let mut out = request_head(&method, "/mcp?x=1", h, skip, added);
        end_request_head(&mut out, body_len);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn the_request_head_has_only_its_own_framing_and_one_line_per_header() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("up:3000"));
        h.append("x-a", HeaderValue::from_static("1"));
        h.append("x-a", HeaderValue::from_static("2"));
        h.insert("content-length", HeaderValue::from_static("9"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("expect", HeaderValue::from_static("100-continue"));
        let none = Added::default();
        assert_eq!(
            whole_head(http::Method::GET, &h, |_| false, none, None),
            "GET /mcp?x=1 HTTP/1.1\r\nhost: up:3000\r\nx-a: 1\r\nx-a: 2\r\n\r\n"
        );
        assert_eq!(
            whole_head(http::Method::POST, &h, |_| false, none, Some(42)),
            "POST /mcp?x=1 HTTP/1.1\r\nhost: up:3000\r\nx-a: 1\r\nx-a: 2\r\ncontent-length: 42\r\n\r\n"
        );
        // Skipped names are left out; Host only when the client sent none.
        let host = Added {
            host: Some("other:1"),
            ..none
        };
        assert_eq!(
            whole_head(http::Method::GET, &h, |n| n == "x-a", host, None),
            "GET /mcp?x=1 HTTP/1.1\r\nhost: up:3000\r\n\r\n"
        );
        h.remove("host");
        assert_eq!(
            whole_head(http::Method::GET, &h, |n| n == "x-a", host, None),
            "GET /mcp?x=1 HTTP/1.1\r\nhost: other:1\r\n\r\n"
        );
        // The gateway's own headers replace the client's of the same name, after the rest.
        let mut own = HeaderMap::new();
        own.insert("x-a", HeaderValue::from_static("mine"));
        h.insert("x-b", HeaderValue::from_static("b"));
        let own = Added {
            own: Some(&own),
            ..none
        };
        assert_eq!(
            whole_head(http::Method::GET, &h, |_| false, own, None),
            "GET /mcp?x=1 HTTP/1.1\r\nx-b: b\r\nx-a: mine\r\n\r\n"
        );
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
    fn the_forwarded_headers_are_added_as_the_head_is_written() {
        let head = |pairs: &[(&str, &[u8])], forwarded| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(
                    HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    HeaderValue::from_bytes(v).unwrap(),
                );
            }
            let added = Added {
                forwarded,
                ..Added::default()
            };
            let mut out = request_head(&http::Method::GET, "/", &h, |_| false, added);
            end_request_head(&mut out, None);
            String::from_utf8_lossy(&out).into_owned()
        };
        let from = Some(Forwarded {
            for_addr: Some("10.0.0.7"),
            proto: "http",
        });
        // None there: both added, after the client's own headers.
        assert_eq!(
            head(&[("host", b"up")], from),
            "GET / HTTP/1.1\r\nhost: up\r\nx-forwarded-for: 10.0.0.7\r\nx-forwarded-proto: http\r\n\r\n"
        );
        // The hop in front's: the address appended to the first, in its place; the others
        // dropped; its proto kept.
        assert_eq!(
            head(
                &[
                    ("x-forwarded-for", b"1.1.1.1"),
                    ("x-forwarded-proto", b"https"),
                    ("x-forwarded-for", b"2.2.2.2"),
                    ("host", b"up"),
                ],
                from
            ),
            "GET / HTTP/1.1\r\nx-forwarded-for: 1.1.1.1, 10.0.0.7\r\nx-forwarded-proto: https\r\nhost: up\r\n\r\n"
        );
        // A value that is not visible ASCII is replaced by the address alone.
        assert_eq!(
            head(&[("x-forwarded-for", b"caf\xc3\xa9")], from),
            "GET / HTTP/1.1\r\nx-forwarded-for: 10.0.0.7\r\nx-forwarded-proto: http\r\n\r\n"
        );
        // A request the gateway sends on its own: the client's X-Forwarded-For as it is.
        let own = Some(Forwarded {
            for_addr: None,
            proto: "https",
        });
        assert_eq!(
            head(&[("x-forwarded-for", b"1.1.1.1")], own),
            "GET / HTTP/1.1\r\nx-forwarded-for: 1.1.1.1\r\nx-forwarded-proto: https\r\n\r\n"
        );
        assert_eq!(
            head(&[("x-forwarded-for", b"1.1.1.1")], None),
            "GET / HTTP/1.1\r\nx-forwarded-for: 1.1.1.1\r\n\r\n"
        );
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

    /// Decodes `input` fed in pieces cut at `cuts`: the data, the bytes after the end, done.
    fn decode_split(
        framing: Framing,
        input: &[u8],
        cuts: &[usize],
    ) -> Result<(Vec<u8>, usize, bool), H1Error> {
        let mut d = BodyDecoder::new(framing);
        let mut out = Vec::new();
        let mut at = 0;
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        points.push(input.len());
        points.sort_unstable();
        for p in points {
            let piece = &input[at..p];
            let used = d.decode(piece, |s| out.extend_from_slice(s))?;
            if used < piece.len() {
                return Ok((out, input.len() - (at + used), d.is_done()));
            }
            at = p;
        }
        Ok((out, 0, d.is_done()))
    }

    #[test]
    fn a_whole_bare_size_line_is_taken_in_one_step_and_nothing_else_is() {
        assert_eq!(size_line(b"c8\r\ndata"), Some((0xc8, 4)));
        assert_eq!(size_line(b"0\r\n\r\n"), Some((0, 3)));
        assert_eq!(size_line(b"FFFFFFFFFFFFFFFF\r\n"), Some((u64::MAX, 18)));
        // Left to the byte-by-byte path: incomplete, extended, padded, too long, empty, bad.
        for line in [
            &b"c8"[..],
            b"c8\r",
            b"c8;x=1\r\n",
            b"c8 \r\n",
            b"1FFFFFFFFFFFFFFFF\r\n",
            b"\r\n",
            b"g\r\n",
            b"c8\rx",
        ] {
            assert_eq!(size_line(line), None, "{:?}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn chunked_bodies() {
        let body = b"5;name=v\r\nhello\r\n1 \r\n \r\n0\r\nx-t: 1\r\n\r\nAFTER";
        let (data, after, done) = decode_split(Framing::Chunked, body, &[]).unwrap();
        assert_eq!((data.as_slice(), after, done), (&b"hello "[..], 5, true));
        for bad in [
            &b"g\r\n"[..],
            b"\r\n",
            b"5\nhello\r\n",
            b"5\r\nhelloX\r\n",
            b"5\r\nhello\rX",
            b"11111111111111111\r\n",
            b"5 5\r\n",
            b"0\r\nx-t: 1\n\r\n",
            b"0\r\n\rX",
            b"-1\r\n",
            b"5;a\nb\r\n",
            // Trailer lines that are not header lines.
            b"0\r\nbad name: 1\r\n\r\n",
            b"0\r\nx-t : 1\r\n\r\n",
            b"0\r\n: 1\r\n\r\n",
            b"0\r\nno-colon\r\n\r\n",
            b"0\r\nx-t: 1\r\n folded\r\n\r\n",
            b"0\r\n\tx-t: 1\r\n\r\n",
            b"0\r\nx-t: a\0b\r\n\r\n",
            b"0\r\nx-t: a\rb\r\n\r\n",
            b"0\r\nx-t: a\x7fb\r\n\r\n",
            b"0\r\nx\xfft: 1\r\n\r\n",
        ] {
            assert!(
                decode_split(Framing::Chunked, bad, &[]).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Sixteen hex digits is the most a size may have.
        let mut d = BodyDecoder::new(Framing::Chunked);
        assert!(d.decode(b"ffffffffffffffff\r\n", |_| {}).is_ok());
        assert_eq!(d.at_eof(), Err(H1Error::EarlyClose));
        let ext = format!("1;{}\r\n", "e".repeat(MAX_EXTENSION_BYTES + 1));
        assert!(decode_split(Framing::Chunked, ext.as_bytes(), &[]).is_err());
        let trailer = format!("0\r\nx: {}\r\n\r\n", "t".repeat(MAX_TRAILER_BYTES));
        assert!(decode_split(Framing::Chunked, trailer.as_bytes(), &[]).is_err());
        // Header lines are trailer lines: values with spaces, tabs and non-ASCII bytes, empty
        // values, several lines; within a smaller bound when one is given.
        let good = b"0\r\nx-t: a b\tc \xe9\r\nx-empty:\r\nX_Odd.Name~!: 1\r\n\r\nAFTER";
        let (data, after, done) = decode_split(Framing::Chunked, good, &[]).unwrap();
        assert_eq!((data.len(), after, done), (0, 5, true));
        let mut d = BodyDecoder::with_trailer_limit(Framing::Chunked, 8);
        assert!(d.decode(b"0\r\nx: 12345\r\n\r\n", |_| {}).is_ok());
        let mut d = BodyDecoder::with_trailer_limit(Framing::Chunked, 8);
        assert!(d.decode(b"0\r\nx: 123456\r\n\r\n", |_| {}).is_err());
    }

    #[test]
    fn length_and_close_bodies_and_early_close() {
        let (data, after, done) = decode_split(Framing::Length(3), b"abcdef", &[1]).unwrap();
        assert_eq!((data.as_slice(), after, done), (&b"abc"[..], 3, true));
        let mut d = BodyDecoder::new(Framing::Length(3));
        d.decode(b"ab", |_| {}).unwrap();
        assert_eq!(d.at_eof(), Err(H1Error::EarlyClose));
        let mut d = BodyDecoder::new(Framing::Close);
        let mut got = Vec::new();
        d.decode(b"any bytes", |s| got.extend_from_slice(s))
            .unwrap();
        assert_eq!((got.as_slice(), d.at_eof()), (&b"any bytes"[..], Ok(())));
        let mut d = BodyDecoder::new(Framing::Chunked);
        d.decode(b"3\r\nab", |_| {}).unwrap();
        assert_eq!(d.at_eof(), Err(H1Error::EarlyClose));
        assert!(BodyDecoder::new(Framing::Length(0)).is_done());
    }

    /// A chunked encoding of `chunks` (empty chunks left out: one would end the body), with
    /// optional extensions and trailers.
    fn chunked(chunks: &[Vec<u8>], ext: bool, trailer: bool, upper: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for c in chunks.iter().filter(|c| !c.is_empty()) {
            let size = if upper {
                format!("{:X}", c.len())
            } else {
                format!("{:x}", c.len())
            };
            out.extend_from_slice(size.as_bytes());
            if ext {
                out.extend_from_slice(b" ;a=\"b\"");
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(c);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n");
        if trailer {
            out.extend_from_slice(b"x-trailer: 1\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    /// What [`take_head`] made of `wire`: the head (status, headers in order, framing,
    /// keep-alive) and the bytes left in the buffer; what [`parse_head`] made of it, the same way.
    type Taken = Result<Option<Summary>, H1Error>;
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
        /// However the reads cut it, a chunked body decodes to exactly its data, ends where
        /// it ends, and leaves the bytes after it alone.
        #[test]
        fn chunked_round_trips_under_any_split(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..8),
            ext: bool,
            trailer: bool,
            upper: bool,
            after in proptest::collection::vec(any::<u8>(), 0..20),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut wire = chunked(&chunks, ext, trailer, upper);
            wire.extend_from_slice(&after);
            let (data, left, done) = decode_split(Framing::Chunked, &wire, &cuts).unwrap();
            prop_assert_eq!(data, chunks.concat());
            prop_assert_eq!(left, after.len());
            prop_assert!(done);
        }

        /// A length-delimited body is exactly its length, however it is cut.
        #[test]
        fn length_round_trips_under_any_split(
            body in proptest::collection::vec(any::<u8>(), 1..600),
            extra in proptest::collection::vec(any::<u8>(), 0..20),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut wire = body.clone();
            wire.extend_from_slice(&extra);
            let (data, left, done) = decode_split(Framing::Length(body.len() as u64), &wire, &cuts).unwrap();
            prop_assert_eq!(data, body);
            prop_assert_eq!(left, extra.len());
            prop_assert!(done);
        }

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

        /// Arbitrary bytes never panic the decoder, and the verdict does not depend on how
        /// the bytes were cut.
        #[test]
        fn arbitrary_bytes_decode_the_same_whatever_the_cuts(
            wire in proptest::collection::vec(any::<u8>(), 0..200),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let whole = decode_split(Framing::Chunked, &wire, &[]);
            let split = decode_split(Framing::Chunked, &wire, &cuts);
            prop_assert_eq!(whole, split);
        }
    }
}
