//! The client side of the gateway's HTTP/1.1: a request written on a connection
//! ([`write_request`]), its answer's head read ([`read_answer`]; interim heads bounded, a
//! `HEAD`'s body none), and the answer's body read on that connection by whoever polls it
//! ([`Answer`]: as [`http_body::Body`] frames, or decoded in place with [`Answer::read`]), each
//! read on the stack and decoded at once. Where a connection goes once its answer has ended is
//! the caller's policy ([`Release`]: the upstream's pool and its bound on connections); this
//! says only whether it may carry another request: its answer ended exactly at its framing's
//! end with nothing after it, HTTP/1.1 without `Connection: close`, not an answer to `HEAD`.

use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{Method, Response};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::body::{BodyDecoder, Framing};
use super::error::{Error, Kind, Peer};
use super::head::{take_head_after, Interim};
use super::read::{poll_fill, Fill};
use crate::exchange::BoxError;

/// Bytes of one read from the upstream socket (on the stack: nothing is kept between reads).
const READ_BYTES: usize = 32 * 1024;
/// Bytes of one read of a body handed out as frames (a pass-through, a JSON answer).
const FRAME_READ_BYTES: usize = 16 * 1024;

/// Where a connection goes once its answer's body has ended as its framing says: called once,
/// with the connection when it may carry another request, `None` when it is to be closed.
/// Dropped unused when the body fails or is dropped part-way (the connection is closed).
pub(crate) trait Release<IO> {
    fn release(self, io: Option<Box<IO>>);
}

/// Writes a request's head and body on `io` (with the head in one write when `together`:
/// the body is then already at the end of `head`).
pub(crate) async fn write_request<IO: AsyncWrite + Unpin>(
    io: &mut IO,
    head: &[u8],
    body: &[u8],
    together: bool,
) -> std::io::Result<()> {
    io.write_all(head).await?;
    if !together {
        io.write_all(body).await?;
    }
    io.flush().await
}

/// Reads the head of the answer to a `method` request on `io` and makes the response: its
/// body an [`Answer`] on `io`, released by the [`Release`] `release` makes (told whether the
/// connection may carry another request after this answer).
pub(crate) async fn read_answer<IO, R>(
    mut io: Box<IO>,
    method: &Method,
    release: impl FnOnce(bool) -> R,
) -> Result<Response<Answer<IO, R>>, Error>
where
    IO: AsyncRead + Unpin,
    R: Release<IO>,
{
    let mut buf = BytesMut::with_capacity(4096);
    let mut interim = Interim::default();
    loop {
        if let Some(head) = take_head_after(&mut buf, &mut interim)? {
            // What followed the head: the body's first bytes. None: nothing is kept, for an
            // empty `buf` still holds the rest of the read buffer (an idle held stream would
            // keep its read buffer for nothing).
            let early = if buf.is_empty() { BytesMut::new() } else { buf };
            // A response to HEAD has no body, whatever its framing headers say.
            let framing = if method == Method::HEAD {
                Framing::Length(0)
            } else {
                head.framing
            };
            // Nor is a `HEAD`'s connection used again: its upstream may yet write the body
            // its head announced, which would read as the next request's answer.
            let reusable = head.keep_alive && framing != Framing::Close && method != Method::HEAD;
            let mut body = Answer {
                io: Some(io),
                decoder: BodyDecoder::new(framing),
                early,
                reusable,
                release: Some(release(reusable)),
            };
            if body.decoder.is_done() && !body.early.is_empty() {
                // Bytes after a body that had none: not a connection to use again.
                body.reusable = false;
            }
            let mut resp = Response::new(body);
            *resp.status_mut() = head.status;
            *resp.headers_mut() = head.headers;
            return Ok(resp);
        }
        let read = std::future::poll_fn(|cx| poll_fill(&mut *io, cx, &mut buf, Fill::InPlace));
        match read.await {
            Ok(0) => {
                return Err(Error::new(
                    Kind::Closed,
                    Peer::Upstream,
                    "before its response head",
                ))
            }
            Ok(_) => {}
            Err(e) => return Err(Error::io(Peer::Upstream, e)),
        }
    }
}

/// The body of an answer, read on its connection by whoever polls it: as
/// [`http_body::Body`] frames (a pass-through, a JSON answer) or decoded in place
/// ([`Answer::read`], a tagged SSE stream).
pub(crate) struct Answer<IO, R: Release<IO>> {
    /// `None` once the body ended (the connection released or closed).
    io: Option<Box<IO>>,
    decoder: BodyDecoder,
    /// Body bytes that came in with the head, fed before the next read.
    early: BytesMut,
    /// The connection may carry another request once the body has ended.
    reusable: bool,
    /// Where the connection goes when the body ends cleanly (taken then).
    release: Option<R>,
}

/// How a read of an [`Answer`] ended.
#[derive(Debug)]
pub(crate) enum ReadEnd {
    /// More may come.
    More,
    /// The body ended as its framing says.
    Done,
    /// The connection failed or ended too early.
    Connection(Error),
    /// The upstream's bytes are not a valid HTTP/1.1 body.
    Framing(Error),
}

impl<IO, R: Release<IO>> Answer<IO, R> {
    /// Whether body bytes came in with the head (the reader has data before any read).
    pub(crate) fn has_early(&self) -> bool {
        !self.early.is_empty()
    }

    /// The whole body, when its `Content-Length` bytes all came with the head (a short JSON
    /// answer usually does): the connection is done with at once (pooled or closed). `None`,
    /// and nothing taken, otherwise.
    pub(crate) fn take_whole(&mut self) -> Option<Bytes> {
        // Known only for a `Content-Length` (or an ended body): a chunked one is not taken.
        let n = usize::try_from(self.decoder.remaining()?).ok()?;
        if self.early.len() < n {
            return None;
        }
        let mut early = std::mem::take(&mut self.early);
        let body = early.split_to(n).freeze();
        // The decoder counts the same bytes (a length-delimited body cannot fail); bytes
        // after them mean the connection is not used again.
        if self.decode(&body, &mut |_| {}).is_err() || !early.is_empty() {
            self.reusable = false;
        }
        debug_assert!(self.decoder.is_done());
        self.finish();
        Some(body)
    }

    /// The body's data, when the bytes that came with the head hold all of it (a short
    /// answer's usual case, chunked or not): handed to `data` in order, nothing taken; and
    /// how many of those bytes are the body's, for [`Answer::finish_early`]. `None`
    /// otherwise (`data` may have had a part of it).
    pub(crate) fn peek_whole<'a>(&'a self, data: impl FnMut(&'a [u8])) -> Option<usize> {
        let mut probe = self.decoder.clone();
        let used = probe.decode(&self.early, data).ok()?;
        probe.is_done().then_some(used)
    }

    /// Done with a body [`Answer::peek_whole`] found whole in its first `used` bytes: its
    /// connection goes back to the pool (closed if bytes followed the body).
    pub(crate) fn finish_early(&mut self, used: usize) {
        if used < self.early.len() {
            self.reusable = false;
        }
        self.early = BytesMut::new();
        self.decoder = BodyDecoder::new(Framing::Length(0));
        self.finish();
    }

    /// The body has ended: its connection goes back to the pool when it may, else closes, and
    /// the client's share has its place back.
    fn finish(&mut self) {
        let io = self.io.take().filter(|_| self.reusable);
        if let Some(release) = self.release.take() {
            release.release(io);
        }
    }

    /// Feeds `bytes` to the decoder, handing the body's data to `data`; bytes after the
    /// body's end mean the connection is not used again.
    fn decode(&mut self, bytes: &[u8], data: &mut impl FnMut(&[u8])) -> Result<(), Error> {
        let used = self.decoder.decode(bytes, &mut *data)?;
        if used < bytes.len() {
            self.reusable = false;
        }
        Ok(())
    }
}

impl<IO: AsyncRead + Unpin, R: Release<IO>> Answer<IO, R> {
    /// Waits for the upstream's next bytes, then takes every read that is ready now, up to
    /// about `max` bytes, handing the body's data to `data` as it is decoded. A `data` error
    /// stops the read (the caller has it); what the reads held after it is dropped with the
    /// stream.
    pub(crate) async fn read<E>(
        &mut self,
        max: usize,
        mut data: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<ReadEnd, E> {
        let mut failed: Option<E> = None;
        let mut sink = |s: &[u8], failed: &mut Option<E>| {
            if failed.is_none() {
                if let Err(e) = data(s) {
                    *failed = Some(e);
                }
            }
        };
        let early = std::mem::take(&mut self.early);
        let mut taken = early.len();
        let decoded = self.decode(&early, &mut |s| sink(s, &mut failed));
        // Not kept while the read below waits: it shares the read buffer of the head.
        drop(early);
        if let Err(e) = decoded {
            self.io = None;
            return match failed {
                Some(f) => Err(f),
                None => Ok(ReadEnd::Framing(e)),
            };
        }
        let end = std::future::poll_fn(|cx| loop {
            if failed.is_some() {
                return Poll::Ready(ReadEnd::More);
            }
            if self.decoder.is_done() {
                self.finish();
                return Poll::Ready(ReadEnd::Done);
            }
            if taken >= max {
                return Poll::Ready(ReadEnd::More);
            }
            let Some(io) = self.io.as_mut() else {
                return Poll::Ready(ReadEnd::Done);
            };
            let mut buf = [MaybeUninit::<u8>::uninit(); READ_BYTES];
            let mut rb = ReadBuf::uninit(&mut buf);
            match Pin::new(&mut **io).poll_read(cx, &mut rb) {
                Poll::Pending if taken > 0 => return Poll::Ready(ReadEnd::More),
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    self.io = None;
                    return Poll::Ready(ReadEnd::Connection(Error::io(Peer::Upstream, e)));
                }
                Poll::Ready(Ok(())) => {}
            }
            let read = rb.filled();
            if read.is_empty() {
                self.io = None;
                return Poll::Ready(match self.decoder.at_eof() {
                    Ok(()) => ReadEnd::Done,
                    Err(e) => ReadEnd::Connection(e),
                });
            }
            taken += read.len();
            if let Err(e) = self.decode(read, &mut |s| sink(s, &mut failed)) {
                self.io = None;
                return Poll::Ready(ReadEnd::Framing(e));
            }
        })
        .await;
        match failed {
            Some(e) => {
                // The reader stops here: the connection is not read to its end.
                self.io = None;
                Err(e)
            }
            None => Ok(end),
        }
    }
}

impl<IO: AsyncRead + Unpin, R: Release<IO> + Unpin> Body for Answer<IO, R> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            let mut out = Vec::new();
            let mut sink = |s: &[u8]| out.extend_from_slice(s);
            if !this.early.is_empty() {
                let early = std::mem::take(&mut this.early);
                if let Err(e) = this.decode(&early, &mut sink) {
                    this.io = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
            } else if this.decoder.is_done() {
                this.finish();
                return Poll::Ready(None);
            } else {
                let Some(io) = this.io.as_mut() else {
                    return Poll::Ready(None);
                };
                let mut buf = [MaybeUninit::<u8>::uninit(); FRAME_READ_BYTES];
                let mut rb = ReadBuf::uninit(&mut buf);
                match Pin::new(&mut **io).poll_read(cx, &mut rb) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(e)) => {
                        this.io = None;
                        return Poll::Ready(Some(Err(e.into())));
                    }
                    Poll::Ready(Ok(())) => {}
                }
                let read = rb.filled();
                if read.is_empty() {
                    this.io = None;
                    return Poll::Ready(match this.decoder.at_eof() {
                        Ok(()) => None,
                        Err(e) => Some(Err(e.into())),
                    });
                }
                if let Err(e) = this.decode(read, &mut sink) {
                    this.io = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.early.is_empty() && self.decoder.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder.remaining() {
            Some(n) if self.early.is_empty() => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

impl<IO, R: Release<IO>> Drop for Answer<IO, R> {
    fn drop(&mut self) {
        // A body nobody read (a 202, a small error) may have come whole with its head.
        if !self.early.is_empty() && self.io.is_some() {
            let early = std::mem::take(&mut self.early);
            if self.decode(&early, &mut |_| {}).is_err() {
                return;
            }
        }
        if self.decoder.is_done() {
            self.finish();
        }
    }
}

#[cfg(test)]
impl<IO, R: Release<IO>> Answer<IO, R> {
    /// The body bytes that came with the head and are not read yet.
    pub(crate) fn early(&self) -> &BytesMut {
        &self.early
    }

    /// Whether the body is done with its connection (released or closed).
    pub(crate) fn let_go(&self) -> bool {
        self.io.is_none()
    }
}
