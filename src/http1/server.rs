//! The client side's HTTP/1.1, read and written by the gateway on the connection's own task
//! (plaintext, or TLS by ALPN or with no protocol named; HTTP/2 stays hyper's): request heads
//! parsed by [`take_request`] (httparse, strict framing), bodies decoded by the same
//! [`BodyDecoder`] as the upstream's, response heads written by [`response_head`], one
//! request at a time. What the connection reads is one named state ([`Reading`]: a head, a
//! body waiting for its `100 Continue`, a body, or nothing for the request in flight).
//!
//! Why not hyper's: its server connection was a fifth of a short tool call's instructions
//! and kept two read buffers per connection while a response streamed (bench/notes.md,
//! "Figure: the client side's HTTP/1.1"). Here a request body that came with its head is handed over
//! whole (no channel, no second task switch), the read buffer is small while a response
//! streams, and a response's head goes out with its first data in one write.
//!
//! What hyper did that this keeps: a client that closes mid-message ends the connection and
//! drops the request's future ([`Kind::Closed`]); bytes that arrive while a response is written
//! are kept for the next request (pipelining), at most `--max-header-bytes` of them (reading
//! pauses there); a request whose body was not read to its end, or that says `Connection:
//! close`, or an HTTP/1.0 one without keep-alive, is the connection's last; `Expect:
//! 100-continue` is answered when the body is first asked for; a bad head gets 400 (431 too
//! large) and the connection closes; `--header-read-timeout` bounds every head after the
//! first one (the first is the accept loop's, see `server::idle`) from its first byte, also
//! when that came while a response was still written: a head not whole by then closes the
//! connection at once, the response in flight cut.

use std::future::{poll_fn, Future};
use std::io::IoSlice;
use std::pin::{pin, Pin};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Method, Request, Response, StatusCode};
use http_body::Body as HttpBody;
use tokio::io::{AsyncRead, AsyncWrite};

use super::body::{encode_chunk, BodyDecoder, Framing, LAST_CHUNK};
use super::error::{Error, Kind, Peer};
use super::head::{response_head, take_request, RequestHead, ResponseFraming};
use super::read::{poll_fill, Fill};
use crate::exchange::{BodyFeed, ReqBody};

/// A failed read or write of the client's connection.
fn client_io(e: std::io::Error) -> Error {
    Error::io(Peer::Client, e)
}

/// The client closed the connection mid-message.
const CLIENT_GONE: Error = Error::new(Kind::Closed, Peer::Client, "");
/// A head not whole within `--header-read-timeout`.
const HEADER_TIMEOUT: Error = Error::new(Kind::HeaderTimeout, Peer::Client, "");
/// A head over `--max-header-bytes` or `--max-headers`.
const HEAD_TOO_LARGE: Error = Error::new(Kind::HeadTooLarge, Peer::Client, "");

/// Response frames ready at once that go out in one write at most.
const GATHER: usize = 4;
/// Most bytes of a streamed request body read ahead of its reader.
const BODY_AHEAD: usize = 64 * 1024;

/// What a connection is held to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// `--max-header-bytes`: the most bytes of a request head.
    pub max_head_bytes: usize,
    /// `--max-headers`.
    pub max_headers: usize,
    /// `--header-read-timeout`, for each head after the first.
    pub header_read_timeout: Duration,
}

/// The connection's side of a streamed request body.
struct Feed {
    body: BodyFeed,
    decoder: BodyDecoder,
}

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

impl Feed {
    fn ended(&self) -> bool {
        self.body.lock().ended()
    }

    fn fail(&self, why: Error) {
        self.body.lock().fail(|| why.into());
    }

    /// Decodes what `rbuf` holds of the body into its chunks (slices of the read), leaving
    /// what follows the body's end for the next request.
    fn decode(&mut self, rbuf: &mut BytesMut) {
        let read = rbuf.split().freeze();
        let mut data = Vec::new();
        let used = self.decoder.decode(&read, |d| data.push(d));
        let mut s = self.body.lock();
        match used {
            Ok(used) => {
                for d in data {
                    s.push(read.slice_ref(d));
                }
                if self.decoder.remaining() == Some(0) {
                    s.finish();
                }
                if used < read.len() {
                    *rbuf = BytesMut::from(&read[used..]);
                }
            }
            Err(e) => s.fail(|| e.of(Peer::Client).into()),
        }
        s.wake();
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        // The connection is gone: a reader still waiting (a request finishing on its own
        // after its client left) gets an error, not a hang.
        self.fail(Error::new(Kind::Ended, Peer::Client, ""));
    }
}

/// What a connection reads, named (hyper's `proto::h1::conn` has the same states): a head,
/// a body whose client waits for `100 Continue`, a body, or nothing for the request in
/// flight. Its rules are [`Conn`]'s methods: [`Conn::read_head`] (`Head`), [`request`]
/// (to `Continue`, `Body` or `Idle`), [`Conn::poll_progress`] (`Continue` → `Body` → `Idle`),
/// [`Conn::poll_eof`] (`Idle`).
enum Reading {
    /// A request head: between requests, or the first.
    Head,
    /// A request's body whose client sent `Expect: 100-continue` and nothing yet: the
    /// `100 Continue` is written when the body is first asked for (this many bytes of it so
    /// far), bytes the client sends anyway are read as the body's.
    Continue(Feed, usize),
    /// A request's body, read as its reader asks for it, at most [`BODY_AHEAD`] ahead.
    Body(Feed),
    /// Nothing for the request in flight (its body read whole, or none): a watch for the
    /// client's close, and the next request's head as far as it comes.
    Idle(Ahead),
}

/// What a connection knows of the next request's head while a request is served.
enum Ahead {
    /// No byte of it yet.
    Nothing,
    /// Begun: its `--header-read-timeout`, from the first byte.
    Begun(Pin<Box<tokio::time::Sleep>>),
    /// Whole in the read buffer (or malformed there: answered when its turn comes), waiting
    /// for the response in flight to end.
    Whole,
}

/// One client connection: its transport and what has been read and not yet used.
struct Conn<IO> {
    io: IO,
    rbuf: BytesMut,
    settings: Settings,
    reading: Reading,
}

impl<IO: AsyncRead + AsyncWrite + Unpin> Conn<IO> {
    /// One read into the read buffer: how many bytes (0: the client closed).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        poll_fill(&mut self.io, cx, &mut self.rbuf, Fill::Append)
    }

    /// Writes all of `bufs`, in order, in as few writes as the transport takes.
    async fn write_all(&mut self, bufs: &mut [IoSlice<'_>]) -> Result<(), Error> {
        let mut bufs = bufs;
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            let n = poll_fn(|cx| Pin::new(&mut self.io).poll_write_vectored(cx, bufs))
                .await
                .map_err(client_io)?;
            if n == 0 {
                return Err(client_io(std::io::ErrorKind::WriteZero.into()));
            }
            IoSlice::advance_slices(&mut bufs, n);
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), Error> {
        poll_fn(|cx| Pin::new(&mut self.io).poll_flush(cx))
            .await
            .map_err(client_io)
    }

    /// The next request head, `None` when the client closed (or `stop` fired) between
    /// requests. `first`: the connection's first request (its head's time is bounded by the
    /// accept loop's watch).
    async fn read_head(
        &mut self,
        first: bool,
        stop: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<Option<RequestHead>, Error> {
        // Empty lines before a request line are skipped (RFC 9112 §2.2). A head begun while
        // the previous request was served keeps the deadline it got at its first byte.
        let mut deadline = match std::mem::replace(&mut self.reading, Reading::Head) {
            Reading::Idle(Ahead::Begun(d)) => Some(d),
            Reading::Idle(Ahead::Nothing | Ahead::Whole)
            | Reading::Head
            | Reading::Continue(..)
            | Reading::Body(_) => None,
        };
        let mut stop_gone = false;
        loop {
            let before = self.rbuf.len();
            if let Some(head) = take_request(&mut self.rbuf, self.settings.max_headers)? {
                // Whole in the last read, a head may have passed the bound by up to a read.
                if before - self.rbuf.len() > self.settings.max_head_bytes {
                    return Err(HEAD_TOO_LARGE);
                }
                return Ok(Some(head));
            }
            if self.rbuf.len() > self.settings.max_head_bytes {
                return Err(HEAD_TOO_LARGE);
            }
            if self.rbuf.is_empty() && *stop.borrow() {
                return Ok(None);
            }
            if !first && !self.rbuf.is_empty() && deadline.is_none() {
                deadline = Some(Box::pin(tokio::time::sleep(
                    self.settings.header_read_timeout,
                )));
            }
            let idle = self.rbuf.is_empty();
            let read = tokio::select! {
                biased;
                () = async { deadline.as_mut().expect("armed").await }, if deadline.is_some() => {
                    return Err(HEADER_TIMEOUT);
                }
                changed = stop.changed(), if idle && !stop_gone => {
                    // A stop between requests ends the connection (checked at the top); a
                    // dropped sender never stops it.
                    stop_gone = changed.is_err();
                    continue;
                }
                read = poll_fn(|cx| self.poll_fill(cx)) => read.map_err(client_io)?,
            };
            match read {
                0 if self.rbuf.is_empty() => return Ok(None),
                0 => return Err(CLIENT_GONE),
                _ => {}
            }
        }
    }

    /// Progress on the connection while the handler works on a request: the `100 Continue`,
    /// the body's bytes as its reader asks for them, and afterwards a watch for the client's
    /// close (bytes of a next request are kept). `Ready(Ok)`: something happened, look again.
    fn poll_progress(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        let Conn {
            io, rbuf, reading, ..
        } = self;
        let (f, continuing) = match reading {
            Reading::Continue(f, written) => (f, Some(written)),
            Reading::Body(f) => (f, None),
            Reading::Head | Reading::Idle(_) => return self.poll_eof(cx),
        };
        let (wants, queued) = f.body.lock().demand();
        if let (Some(written), true) = (continuing.as_deref(), wants) {
            let mut at = *written;
            while at < CONTINUE.len() {
                let n = match Pin::new(&mut *io).poll_write(cx, &CONTINUE[at..]) {
                    Poll::Ready(n) => n.map_err(client_io)?,
                    Poll::Pending => {
                        *reading = match std::mem::replace(reading, Reading::Head) {
                            Reading::Continue(f, _) => Reading::Continue(f, at),
                            other => other,
                        };
                        return Poll::Pending;
                    }
                };
                if n == 0 {
                    return Poll::Ready(Err(client_io(std::io::ErrorKind::WriteZero.into())));
                }
                at += n;
            }
            self.continued();
            return Poll::Ready(Ok(()));
        }
        if !rbuf.is_empty() {
            f.decode(rbuf);
            if f.ended() {
                self.reading = Reading::Idle(Ahead::Nothing);
            }
            return Poll::Ready(Ok(()));
        }
        if continuing.is_some() || queued >= BODY_AHEAD {
            return Poll::Pending;
        }
        let n = ready!(poll_fill(io, cx, rbuf, Fill::Append)).map_err(client_io)?;
        if n == 0 {
            f.fail(CLIENT_GONE);
            return Poll::Ready(Err(CLIENT_GONE));
        }
        Poll::Ready(Ok(()))
    }

    /// `Continue` → `Body`: the `100 Continue` is written.
    fn continued(&mut self) {
        self.reading = match std::mem::replace(&mut self.reading, Reading::Head) {
            Reading::Continue(f, _) => Reading::Body(f),
            other => other,
        };
    }

    /// Done with the request's body, whether it was read to its end or not (a body not read
    /// whole fails its reader, if one is left): `Idle`, a next head's progress kept.
    fn done_with_body(&mut self) {
        if let Reading::Continue(..) | Reading::Body(_) | Reading::Head = self.reading {
            self.reading = Reading::Idle(Ahead::Nothing);
        }
    }

    /// Watches for the client's close while nothing is read for a request: `Ready(Err)` when
    /// it closed; bytes it sends meanwhile stay for the next request, at most the head bound
    /// of them (then the watch pauses), and their head must be whole within
    /// `--header-read-timeout` of its first byte (`Ready(Err(HeaderTimeout))` when it is not:
    /// the connection closes as one whose head is slow between requests does, at once).
    fn poll_eof(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if !self.rbuf.is_empty() {
            if let Reading::Idle(ahead) = &mut self.reading {
                if let Ahead::Nothing = ahead {
                    let timeout = self.settings.header_read_timeout;
                    *ahead = Ahead::Begun(Box::pin(tokio::time::sleep(timeout)));
                }
                if let Ahead::Begun(deadline) = ahead {
                    if deadline.as_mut().poll(cx).is_ready() {
                        // Parsed on a copy, once: the head is taken when its turn comes.
                        let mut probe = self.rbuf.clone();
                        if !matches!(
                            take_request(&mut probe, self.settings.max_headers),
                            Ok(Some(_))
                        ) {
                            return Poll::Ready(Err(HEADER_TIMEOUT));
                        }
                        *ahead = Ahead::Whole;
                    }
                }
            }
        }
        let bound = self.settings.max_head_bytes;
        if self.rbuf.len() >= bound {
            return Poll::Pending;
        }
        match ready!(poll_fill(
            &mut self.io,
            cx,
            &mut self.rbuf,
            Fill::Bounded(bound)
        )) {
            Ok(0) => Poll::Ready(Err(CLIENT_GONE)),
            Ok(_) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(client_io(e))),
        }
    }
}

/// Serves one client connection's HTTP/1.1 requests with `svc`, one at a time, until the
/// client closes between requests, a request or response is the last, or `stop` fires
/// (between requests: the one in flight is answered first, then the connection closes).
/// `read`: what was already read from `io` (the accept loop's first read).
///
/// The connection's future lives as long as the connection, so it is kept small (see
/// docs/design.md, "A connection's future"): what it holds is bound before the `async`
/// block (an `async fn`'s parameters are moved into locals of their own, and the future
/// keeps room for both), and each request's head and response live in blocks that end
/// before the awaits after them (the future keeps room for every local in scope across an
/// await, moved out or not).
pub(crate) fn serve<IO, S, F, B>(
    io: IO,
    read: BytesMut,
    settings: Settings,
    svc: S,
    stop: tokio::sync::watch::Receiver<bool>,
) -> impl Future<Output = Result<(), Error>>
where
    IO: AsyncRead + AsyncWrite + Unpin,
    S: FnMut(Request<ReqBody>) -> F,
    F: Future<Output = Result<Response<B>, std::convert::Infallible>>,
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let mut conn = Conn {
        io,
        rbuf: read,
        settings,
        reading: Reading::Head,
    };
    let mut svc = svc;
    let mut stop = stop;
    async move {
        let mut first = true;
        loop {
            let head = match conn.read_head(first, &mut stop).await {
                Ok(Some(h)) => h,
                Ok(None) => return Ok(()),
                Err(e) => {
                    if let Some(status) = e.refused_head() {
                        refuse(&mut conn, status).await;
                    }
                    return Err(e);
                }
            };
            first = false;
            let Asked {
                req,
                keep_alive,
                head_only,
                http10,
                body_shared,
            } = request(&mut conn, head);
            let resp = {
                let mut handling = pin!(svc(req));
                poll_fn(|cx| loop {
                    if let Poll::Ready(r) = handling.as_mut().poll(cx) {
                        let Ok(r) = r;
                        return Poll::Ready(Ok(r));
                    }
                    match conn.poll_progress(cx) {
                        Poll::Ready(Ok(())) => continue,
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending => return Poll::Pending,
                    }
                })
                .await
            };
            // The request's body was read to its end (else what follows it is not a request).
            let body_read = body_shared.is_none_or(|s| s.read_whole());
            conn.done_with_body();
            let close = !keep_alive || !body_read || *stop.borrow();
            // Made in a statement of its own: the response's `?` would keep its room in the
            // connection's future for as long as the response is written.
            let writing = write_response(&mut conn, resp?, head_only, http10, close);
            let again = writing.await?;
            if !again {
                let _ = poll_fn(|cx| Pin::new(&mut conn.io).poll_shutdown(cx)).await;
                return Ok(());
            }
            // Idle between requests: no read buffer kept (a held stream's connection is idle
            // most of its life).
            if conn.rbuf.is_empty() {
                conn.rbuf = BytesMut::new();
            }
        }
    }
}

/// A request as [`request`] makes it from its head.
struct Asked {
    req: Request<ReqBody>,
    /// The connection may carry another request after it.
    keep_alive: bool,
    head_only: bool,
    http10: bool,
    /// The body's state while it is read as the handler asks for it.
    body_shared: Option<BodyFeed>,
}

/// The request of `head`, its body read from the connection as the handler asks for it: the
/// connection `Continue`, `Body`, or `Idle` when the body is whole (or none).
fn request<IO: AsyncRead + AsyncWrite + Unpin>(conn: &mut Conn<IO>, head: RequestHead) -> Asked {
    let RequestHead {
        parts,
        framing,
        keep_alive,
        expect_continue,
    } = head;
    let (body, body_shared) = match framing {
        Framing::Length(0) => {
            conn.reading = Reading::Idle(Ahead::Nothing);
            (ReqBody::whole(None), None)
        }
        Framing::Length(n) if n <= conn.rbuf.len() as u64 => {
            let whole = conn.rbuf.split_to(n as usize).freeze();
            conn.reading = Reading::Idle(Ahead::Nothing);
            (ReqBody::whole(Some(whole)), None)
        }
        framing => {
            let (body, shared) = ReqBody::streamed();
            let mut feed = Feed {
                body: shared.clone(),
                decoder: BodyDecoder::with_trailer_limit(framing, conn.settings.max_head_bytes),
            };
            let waits = expect_continue && conn.rbuf.is_empty();
            if !conn.rbuf.is_empty() {
                feed.decode(&mut conn.rbuf);
            }
            conn.reading = if feed.ended() {
                Reading::Idle(Ahead::Nothing)
            } else if waits {
                Reading::Continue(feed, 0)
            } else {
                Reading::Body(feed)
            };
            (body, Some(shared))
        }
    };
    Asked {
        head_only: parts.method == Method::HEAD,
        http10: parts.version == http::Version::HTTP_10,
        req: Request::from_parts(parts, body),
        keep_alive,
        body_shared,
    }
}

/// Writes `resp` (its body too, unless `head_only`): whether the connection may carry
/// another request after it.
fn write_response<'c, IO, B>(
    conn: &'c mut Conn<IO>,
    resp: Response<B>,
    head_only: bool,
    http10: bool,
    close: bool,
) -> impl Future<Output = Result<bool, Error>> + 'c
where
    IO: AsyncRead + AsyncWrite + Unpin,
    B: HttpBody<Data = Bytes> + Unpin + 'c,
    B::Error: std::fmt::Display,
{
    // Taken apart before the `async` block: it keeps the status, the headers and the body
    // (in place: `B: Unpin`), not the response they came in as well (see `serve`).
    let (parts, mut body) = resp.into_parts();
    let (status, headers) = (parts.status, parts.headers);
    let mut close = close;
    let bodiless = head_only
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let framing = if bodiless {
        ResponseFraming::None
    } else if let Some(n) = body.size_hint().exact() {
        ResponseFraming::Length(n)
    } else if http10 {
        close = true;
        ResponseFraming::Close
    } else {
        ResponseFraming::Chunked
    };
    async move {
        let mut body = Pin::new(&mut body);
        write_body(conn, status, &headers, body.as_mut(), framing, close).await
    }
}

/// [`write_response`]'s writing: the head (with the first data when it is ready now), then
/// the body in `framing`.
async fn write_body<IO, B>(
    conn: &mut Conn<IO>,
    status: StatusCode,
    headers: &http::HeaderMap,
    mut body: Pin<&mut B>,
    framing: ResponseFraming,
    close: bool,
) -> Result<bool, Error>
where
    IO: AsyncRead + AsyncWrite + Unpin,
    B: HttpBody<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let chunked = framing == ResponseFraming::Chunked;
    // The first data, when it is ready now, goes out with the head in one write.
    let mut next = if framing == ResponseFraming::None {
        Next::End
    } else {
        next_frame(conn, body.as_mut(), true).await?
    };
    let mut head = Vec::with_capacity(256);
    response_head(status, headers, framing, close, &date::now(), &mut head);
    let mut written: u64 = 0;
    loop {
        // What is ready now goes out in one write: up to GATHER frames (a resume's `resumed`
        // event and its replay; a short answer's data and its end).
        let mut data: [Bytes; GATHER] = Default::default();
        let mut frames = 0;
        let end = loop {
            match std::mem::replace(&mut next, Next::NotYet) {
                Next::Data(d) if frames < GATHER => {
                    written += d.len() as u64;
                    data[frames] = d;
                    frames += 1;
                    next = next_frame(conn, body.as_mut(), true).await?;
                }
                // Kept for the next write.
                more @ Next::Data(_) => {
                    next = more;
                    break false;
                }
                Next::End => break true,
                Next::NotYet => break false,
            }
        };
        if matches!(framing, ResponseFraming::Length(n) if written > n) {
            return Err(Error::new(
                Kind::Body,
                Peer::Client,
                "longer than its Content-Length",
            ));
        }
        if end && matches!(framing, ResponseFraming::Length(n) if written != n) {
            return Err(Error::new(
                Kind::Body,
                Peer::Client,
                "shorter than its Content-Length",
            ));
        }
        let mut sizes = [[0u8; 18]; GATHER];
        let mut bufs: [IoSlice<'_>; 2 + 3 * GATHER] = std::array::from_fn(|_| IoSlice::new(&[]));
        bufs[0] = IoSlice::new(&head);
        let mut at = 1;
        for (d, size) in data[..frames].iter().zip(&mut sizes) {
            if chunked {
                let [line, data, end] = encode_chunk(d, size);
                bufs[at] = IoSlice::new(line);
                bufs[at + 1] = IoSlice::new(data);
                bufs[at + 2] = IoSlice::new(end);
                at += 3;
            } else {
                bufs[at] = IoSlice::new(d);
                at += 1;
            }
        }
        if end && chunked {
            bufs[at] = IoSlice::new(LAST_CHUNK);
            at += 1;
        }
        conn.write_all(&mut bufs[..at]).await?;
        // Neither is kept while a stream goes on: the frames written (a resume's replay is
        // one buffer of tens of KB) would otherwise live until the next frame, for a held
        // stream as long as it is idle.
        drop(data);
        head = Vec::new();
        conn.flush().await?;
        if end {
            break;
        }
        if !matches!(next, Next::Data(_)) {
            next = next_frame(conn, body.as_mut(), false).await?;
        }
    }
    Ok(!close && framing != ResponseFraming::Close)
}

/// What a response body has next.
enum Next {
    Data(Bytes),
    /// Its end (after which it is not polled again).
    End,
    /// Nothing ready yet (only asked with `now`).
    NotYet,
}

/// The next data of a response body (trailers are dropped), or its end; with `now`,
/// [`Next::NotYet`] when none is ready (the head then goes first). Watches for the client's
/// close meanwhile.
async fn next_frame<IO, B>(
    conn: &mut Conn<IO>,
    mut body: Pin<&mut B>,
    now: bool,
) -> Result<Next, Error>
where
    IO: AsyncRead + AsyncWrite + Unpin,
    B: HttpBody<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    poll_fn(|cx| loop {
        match body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) if d.is_empty() => continue,
                Ok(d) => return Poll::Ready(Ok(Next::Data(d))),
                Err(_trailers) => continue,
            },
            Poll::Ready(Some(Err(e))) => {
                return Poll::Ready(Err(Error::caused(Kind::Body, Peer::Client, e.to_string())))
            }
            Poll::Ready(None) => return Poll::Ready(Ok(Next::End)),
            Poll::Pending if now => return Poll::Ready(Ok(Next::NotYet)),
            Poll::Pending => {}
        }
        match conn.poll_eof(cx) {
            Poll::Ready(Ok(())) => continue,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        }
    })
    .await
}

/// Answers a request whose head cannot be served, and closes.
async fn refuse<IO: AsyncRead + AsyncWrite + Unpin>(conn: &mut Conn<IO>, status: StatusCode) {
    let mut out = Vec::with_capacity(128);
    response_head(
        status,
        &http::HeaderMap::new(),
        ResponseFraming::Length(0),
        true,
        &date::now(),
        &mut out,
    );
    let _ = conn.write_all(&mut [IoSlice::new(&out)]).await;
    let _ = conn.flush().await;
    let _ = poll_fn(|cx| Pin::new(&mut conn.io).poll_shutdown(cx)).await;
}

/// The `Date` header's value, formatted once a second per thread.
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    pub(super) fn now() -> [u8; 29] {
        thread_local! {
            static CACHED: RefCell<(u64, [u8; 29])> = const { RefCell::new((u64::MAX, [0; 29])) };
        }
        let now = SystemTime::now();
        let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        CACHED.with_borrow_mut(|(at, text)| {
            if *at != secs {
                let formatted = httpdate::fmt_http_date(now);
                let b = formatted.as_bytes();
                if b.len() == text.len() {
                    text.copy_from_slice(b);
                }
                *at = secs;
            }
            *text
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::read::READ_BYTES;
    use super::*;
    use http_body::Frame;
    use http_body_util::{BodyExt, Full, StreamBody};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    fn settings() -> Settings {
        Settings {
            max_head_bytes: 8 * 1024,
            max_headers: 100,
            header_read_timeout: Duration::from_secs(2),
        }
    }

    type TestBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::convert::Infallible>;

    /// Answers each request with `<method> <path> <body>` (the body read whole).
    async fn echo(req: Request<ReqBody>) -> Result<Response<TestBody>, std::convert::Infallible> {
        let (parts, body) = req.into_parts();
        let body = match body.collect().await {
            Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            Err(e) => format!("error: {e}"),
        };
        let text = format!("{} {} {}", parts.method, parts.uri.path(), body);
        Ok(Response::new(Full::new(Bytes::from(text)).boxed_unsync()))
    }

    /// Runs a connection over an in-memory pipe with `svc`; the client's end is returned.
    fn start<S, F>(
        svc: S,
    ) -> (
        DuplexStream,
        tokio::task::JoinHandle<Result<(), Error>>,
        tokio::sync::watch::Sender<bool>,
    )
    where
        S: FnMut(Request<ReqBody>) -> F + Send + 'static,
        F: Future<Output = Result<Response<TestBody>, std::convert::Infallible>> + Send + 'static,
    {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(serve(server, BytesMut::new(), settings(), svc, stop));
        (client, task, stop_tx)
    }

    /// Everything the server writes until it closes.
    async fn read_all(mut c: DuplexStream) -> String {
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    /// The bodies of the responses in `text`, in order (content-length framed).
    fn bodies(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(h) = rest.find("\r\n\r\n") {
            let head = &rest[..h];
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .map_or(0, |n| n.parse::<usize>().unwrap());
            out.push(rest[h + 4..h + 4 + len].to_owned());
            rest = &rest[h + 4 + len..];
        }
        out
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order_on_one_connection() {
        let (mut c, task, _stop) = start(echo);
        c.write_all(
            b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nonePOST /b HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\ntwo\r\n0\r\n\r\nGET /c HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let text = read_all(c).await;
        assert_eq!(
            bodies(&text),
            ["POST /a one", "POST /b two", "GET /c "],
            "{text}"
        );
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.contains("\r\ndate: "), "{text}");
        assert_eq!(text.matches("connection: close").count(), 1, "{text}");
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_body_in_pieces_is_read_whole_and_100_continue_comes_when_it_is_asked_for() {
        let (mut c, task, _stop) = start(echo);
        c.write_all(b"POST /a HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ntransfer-encoding: chunked\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 25];
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 100 Continue\r\n\r\n");
        c.write_all(b"2\r\nab\r\n").await.unwrap();
        tokio::task::yield_now().await;
        c.write_all(b"1\r\nc\r\n0\r\n\r\n").await.unwrap();
        c.shutdown().await.unwrap();
        let text = read_all(c).await;
        assert_eq!(bodies(&text), ["POST /a abc"], "{text}");
        let _ = task.await.unwrap();
    }

    #[tokio::test]
    async fn a_body_the_handler_did_not_read_ends_the_connection_after_the_answer() {
        let (mut c, task, _stop) = start(|_req: Request<ReqBody>| async {
            Ok(Response::new(Full::new(Bytes::from("no")).boxed_unsync()))
        });
        c.write_all(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
            .await
            .unwrap();
        let text = read_all(c).await;
        assert_eq!(bodies(&text), ["no"], "{text}");
        assert!(text.contains("connection: close"), "{text}");
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_client_that_leaves_mid_request_drops_its_handler() {
        let dropped = Arc::new(AtomicUsize::new(0));
        struct Flag(Arc<AtomicUsize>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let d = dropped.clone();
        let started = Arc::new(tokio::sync::Notify::new());
        let st = started.clone();
        let (mut c, task, _stop) = start(move |_req: Request<ReqBody>| {
            let flag = Flag(d.clone());
            st.notify_one();
            async move {
                let _flag = flag;
                std::future::pending::<()>().await;
                unreachable!()
            }
        });
        c.write_all(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        // The request is handed over: its handler is in flight.
        started.notified().await;
        assert_eq!(dropped.load(Ordering::SeqCst), 0, "in flight");
        drop(c);
        let end = task.await.unwrap();
        assert!(
            matches!(end, Err(ref e) if e.kind() == Kind::Closed),
            "{end:?}"
        );
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_connection_future_holds_its_parts_once() {
        // The connection's future lives as long as the connection (a held stream's too):
        // an `async fn`'s arguments moved into locals, or a request's parts kept in scope
        // across the response's writing, made it much larger (bench/notes.md, "Figure:
        // boxed futures").
        let (_client, server) = tokio::io::duplex(64);
        let (_stop_tx, stop) = tokio::sync::watch::channel(false);
        let fut = serve(server, BytesMut::new(), settings(), echo, stop);
        let size = std::mem::size_of_val(&fut);
        assert!(size <= 1_500, "a connection's future is {size} bytes");
    }

    /// A frame's bytes that say when they are dropped.
    struct Owned(Vec<u8>, Arc<AtomicUsize>);
    impl AsRef<[u8]> for Owned {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }
    impl Drop for Owned {
        fn drop(&mut self) {
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn a_frame_written_is_not_kept_while_its_stream_waits_for_the_next() {
        // A resume's replay is one frame of tens of KB; held until the next frame, a storm
        // of resumed streams kept every replay in memory.
        let dropped = Arc::new(AtomicUsize::new(0));
        let d = dropped.clone();
        let (mut c, _task, _stop) = start(move |_req: Request<ReqBody>| {
            let d = d.clone();
            async move {
                let frame = Bytes::from_owner(Owned(b"data: replay\n\n".to_vec(), d));
                let first =
                    futures::stream::iter([Ok::<_, std::convert::Infallible>(Frame::data(frame))]);
                let body =
                    StreamBody::new(futures::StreamExt::chain(first, futures::stream::pending()));
                Ok(Response::new(body.boxed_unsync()))
            }
        });
        c.write_all(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        while !got.ends_with(b"data: replay\n\n\r\n") {
            let mut buf = [0u8; 512];
            let n = c.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        // The stream goes on (its body is pending), and the frame is gone.
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_body_of_unknown_length_is_chunked_and_head_gets_none() {
        let (mut c, task, _stop) = start(|req: Request<ReqBody>| async move {
            let frames = ["ab", "", "cde"]
                .map(|s| Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(s))));
            let _ = req;
            Ok(Response::new(
                StreamBody::new(futures::stream::iter(frames)).boxed_unsync(),
            ))
        });
        c.write_all(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nHEAD /a HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let text = read_all(c).await;
        let first = text.split("HTTP/1.1 200 OK").nth(1).unwrap();
        assert!(first.contains("transfer-encoding: chunked\r\n"), "{text}");
        assert!(
            first.ends_with("\r\n\r\n2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"),
            "{text}"
        );
        let head = text.split("HTTP/1.1 200 OK").nth(2).unwrap();
        assert!(
            head.ends_with("\r\n\r\n") && !head.contains("chunked"),
            "{text}"
        );
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn http_10_without_keep_alive_closes_after_its_answer_and_streams_until_close() {
        let (mut c, task, _stop) = start(|_req: Request<ReqBody>| async {
            let frames = [Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(
                "streamed",
            )))];
            Ok(Response::new(
                StreamBody::new(futures::stream::iter(frames)).boxed_unsync(),
            ))
        });
        c.write_all(b"GET /a HTTP/1.0\r\n\r\n").await.unwrap();
        let text = read_all(c).await;
        assert!(text.ends_with("\r\n\r\nstreamed"), "{text}");
        assert!(
            !text.contains("chunked") && !text.contains("content-length"),
            "{text}"
        );
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn bad_heads_are_answered_and_close_the_connection() {
        for (raw, status) in [
            (&b"GET /a HTTP/1.1\r\nbad header\r\n\r\n"[..], "400"),
            (b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n", "400"),
            (b"GET /a HTTP/1.2\r\n\r\n", "400"),
        ] {
            let (mut c, task, _stop) = start(echo);
            c.write_all(raw).await.unwrap();
            let text = read_all(c).await;
            assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "{text}");
            assert!(matches!(task.await.unwrap(), Err(e) if e.refused_head().is_some()));
        }
        // Whole in one read, a head over the bound is refused too: the bound is the head's,
        // not the reads'.
        let max = settings().max_head_bytes;
        for len in [max, max + 1, max + READ_BYTES - 1] {
            let line = "GET /a HTTP/1.1\r\nx: \r\n\r\n";
            let head = format!(
                "GET /a HTTP/1.1\r\nx: {}\r\n\r\n",
                "a".repeat(len - line.len())
            );
            assert_eq!(head.len(), len);
            let (mut c, task, _stop) = start(echo);
            c.write_all(head.as_bytes()).await.unwrap();
            c.shutdown().await.unwrap();
            let text = read_all(c).await;
            let want = if len > max { "431" } else { "200" };
            assert!(
                text.starts_with(&format!("HTTP/1.1 {want} ")),
                "{len}: {text}"
            );
            let _ = task.await.unwrap();
        }
        let (mut c, task, _stop) = start(echo);
        let big = format!("GET /a HTTP/1.1\r\nx: {}\r\n", "a".repeat(9000));
        c.write_all(big.as_bytes()).await.unwrap();
        let text = read_all(c).await;
        assert!(text.starts_with("HTTP/1.1 431 "), "{text}");
        assert!(matches!(
            task.await.unwrap(),
            Err(e) if e.kind() == Kind::HeadTooLarge
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_head_is_bounded_by_the_header_read_timeout() {
        let (mut c, task, _stop) = start(echo);
        c.write_all(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\n")
            .await
            .unwrap();
        let end = task.await.unwrap();
        assert!(
            matches!(end, Err(ref e) if e.kind() == Kind::HeaderTimeout),
            "{end:?}"
        );
        let text = read_all(c).await;
        assert_eq!(bodies(&text), ["GET /a "], "{text}");
    }

    /// A response that streams `first`, then nothing until `end` fires (or forever).
    fn streaming(
        end: Option<tokio::sync::oneshot::Receiver<()>>,
    ) -> Result<Response<TestBody>, std::convert::Infallible> {
        use futures::StreamExt;
        let first = futures::stream::iter([Ok::<_, std::convert::Infallible>(Frame::data(
            Bytes::from("data: first\n\n"),
        ))]);
        let rest = futures::stream::once(async move {
            match end {
                Some(end) => {
                    let _ = end.await;
                }
                None => std::future::pending().await,
            }
        })
        .filter_map(|()| async { None });
        Ok(Response::new(
            StreamBody::new(first.chain(rest)).boxed_unsync(),
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_begun_while_a_response_streams_has_the_header_read_timeout() {
        // Half a next request behind a stream: closed --header-read-timeout after its first
        // byte, not held for as long as the stream lives.
        let (mut c, task, _stop) = start(|_req: Request<ReqBody>| async { streaming(None) });
        c.write_all(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let end = tokio::time::timeout(Duration::from_secs(600), task).await;
        let end = end.expect("the connection ended").unwrap();
        assert!(
            matches!(end, Err(ref e) if e.kind() == Kind::HeaderTimeout),
            "{end:?}"
        );
        assert_eq!(started.elapsed(), settings().header_read_timeout);
        // A whole next request waits for the stream, however long it lasts.
        let (mut c, task, _stop) = start(|_req: Request<ReqBody>| async { streaming(None) });
        c.write_all(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(!task.is_finished(), "{:?}", task.await);
    }

    #[tokio::test]
    async fn what_is_read_of_a_next_head_while_a_response_streams_is_the_head_bound() {
        // The client writes a next head that never ends while a response streams: the
        // connection takes at most --max-header-bytes of it, the pipe the rest.
        const PIPE: usize = 1024;
        let (end_tx, end_rx) = tokio::sync::oneshot::channel();
        let mut end_rx = Some(end_rx);
        let (mut c, server) = tokio::io::duplex(PIPE);
        let (_stop_tx, stop) = tokio::sync::watch::channel(false);
        let svc = move |_req: Request<ReqBody>| {
            let end = end_rx.take();
            async move { streaming(end) }
        };
        let task = tokio::spawn(serve(server, BytesMut::new(), settings(), svc, stop));
        c.write_all(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        while !got.ends_with(b"data: first\n\n\r\n") {
            let mut buf = [0u8; 512];
            let n = c.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        let mut written = 0;
        let mut head = b"GET /b HTTP/1.1\r\nx: ".to_vec();
        head.resize(64 * 1024, b'a');
        for _ in 0..1000 {
            match tokio::time::timeout(Duration::from_millis(100), c.write(&head[written..])).await
            {
                Ok(Ok(n)) => written += n,
                _ => break,
            }
        }
        let bound = settings().max_head_bytes;
        assert_eq!(written, bound + PIPE, "bytes the client could write");
        // When the stream ends, the head is too large, as on an idle connection.
        end_tx.send(()).unwrap();
        let text = read_all(c).await;
        assert!(text.contains("\r\n\r\nHTTP/1.1 431 "), "{text}");
        assert!(matches!(
            task.await.unwrap(),
            Err(e) if e.kind() == Kind::HeadTooLarge
        ));
    }

    #[tokio::test]
    async fn a_stop_closes_an_idle_connection_and_one_in_flight_after_its_answer() {
        let (c, task, stop) = start(echo);
        stop.send(true).unwrap();
        task.await.unwrap().unwrap();
        drop(c);
        let release = Arc::new(tokio::sync::Notify::new());
        let started = Arc::new(tokio::sync::Notify::new());
        let (r, st) = (release.clone(), started.clone());
        let (mut c, task, stop) = start(move |_req: Request<ReqBody>| {
            let r = r.clone();
            st.notify_one();
            async move {
                r.notified().await;
                Ok(Response::new(Full::new(Bytes::from("last")).boxed_unsync()))
            }
        });
        c.write_all(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        // The stop comes while the request is in flight.
        started.notified().await;
        stop.send(true).unwrap();
        release.notify_one();
        let text = read_all(c).await;
        assert_eq!(bodies(&text), ["last"], "{text}");
        assert!(text.contains("connection: close"), "{text}");
        task.await.unwrap().unwrap();
    }
}
