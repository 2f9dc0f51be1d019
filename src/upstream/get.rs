//! The gateway's own `GET`s to the upstream (the held standalone stream, upstream resumes),
//! read on the upstream socket by the reader's task itself: no connection task, no body
//! channel, no cross-task wake-up per chunk, and no buffer while the stream is idle (each read
//! goes into a buffer on the stack and is decoded at once, framing and SSE in one pass). Each
//! stream has its own connection (from the same counted connector as the pooled client), never
//! reused: it is closed when the stream ends, however it ended.
//!
//! Knows the connector and [`crate::h1`]; nothing of sessions.

use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::Poll;

use http::{HeaderMap, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tower_service::Service;

use super::{Connector, UpBody, Upstream};
use crate::h1::{self, BodyDecoder, H1Error};

/// Bytes of one read from the upstream socket (on the stack: nothing is kept between reads).
const READ_BYTES: usize = 32 * 1024;

type Conn = TokioIo<<Connector as Service<http::Uri>>::Response>;

/// The body of a response to one of the gateway's own `GET`s, on its own connection.
pub(crate) struct OwnBody {
    io: Conn,
    decoder: BodyDecoder,
    /// Body bytes that came in with the head, fed before the next read.
    early: Vec<u8>,
}

/// How a read of an [`OwnBody`] ended.
#[derive(Debug)]
pub(crate) enum ReadEnd {
    /// More may come.
    More,
    /// The body ended as its framing says.
    Done,
    /// The connection failed or ended too early.
    Connection(String),
    /// The upstream's bytes are not a valid HTTP/1.1 body.
    Framing(H1Error),
}

/// Why a `GET` got no response head.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    #[error("cannot connect to the upstream: {0}")]
    Connect(super::BoxError),
    #[error("upstream connection failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the upstream closed the connection before its response head")]
    Closed,
    #[error(transparent)]
    Head(#[from] H1Error),
}

/// Sends `req` (a `GET` built by [`Upstream::request`]; its body is not sent) on a new
/// connection and reads the response head: the status, the headers and the body.
pub(crate) async fn send(
    up: &Upstream,
    req: Request<UpBody>,
) -> Result<(StatusCode, HeaderMap, OwnBody), OpenError> {
    let (parts, _) = req.into_parts();
    let mut headers = parts.headers;
    if !headers.contains_key(http::header::HOST) {
        if let Some(v) = parts
            .uri
            .authority()
            .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
        {
            headers.insert(http::header::HOST, v);
        }
    }
    let pq = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let head = h1::get_head(pq, &headers);
    let mut connector = up.connector.clone();
    std::future::poll_fn(|cx| connector.poll_ready(cx))
        .await
        .map_err(OpenError::Connect)?;
    let mut io = TokioIo::new(
        connector
            .call(parts.uri)
            .await
            .map_err(OpenError::Connect)?,
    );
    io.write_all(&head).await?;
    io.flush().await?;
    let mut buf = Vec::with_capacity(4096);
    loop {
        if let Some((head, len)) = h1::parse_head(&buf)? {
            let early = buf.split_off(len);
            let body = OwnBody {
                io,
                decoder: BodyDecoder::new(head.framing),
                early,
            };
            return Ok((head.status, head.headers, body));
        }
        if buf.len() == buf.capacity() {
            buf.reserve(buf.len());
        }
        let n = tokio::io::AsyncReadExt::read_buf(&mut io, &mut buf).await?;
        if n == 0 {
            return Err(OpenError::Closed);
        }
    }
}

impl OwnBody {
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
        let early = std::mem::take(&mut self.early);
        let mut taken = early.len();
        if let Err(e) = decode_into(&mut self.decoder, &early, &mut data, &mut failed) {
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
                // Bytes after the end are ignored: the connection is closed with the stream.
                return Poll::Ready(ReadEnd::Done);
            }
            if taken >= max {
                return Poll::Ready(ReadEnd::More);
            }
            let mut buf = [MaybeUninit::<u8>::uninit(); READ_BYTES];
            let mut rb = ReadBuf::uninit(&mut buf);
            match Pin::new(&mut self.io).poll_read(cx, &mut rb) {
                Poll::Pending if taken > 0 => return Poll::Ready(ReadEnd::More),
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(ReadEnd::Connection(e.to_string())),
                Poll::Ready(Ok(())) => {}
            }
            let read = rb.filled();
            if read.is_empty() {
                return Poll::Ready(match self.decoder.at_eof() {
                    Ok(()) => ReadEnd::Done,
                    Err(e) => ReadEnd::Connection(e.to_string()),
                });
            }
            taken += read.len();
            if let Err(e) = decode_into(&mut self.decoder, read, &mut data, &mut failed) {
                return Poll::Ready(ReadEnd::Framing(e));
            }
        })
        .await;
        match failed {
            Some(e) => Err(e),
            None => Ok(end),
        }
    }
}

/// Decodes `bytes` with `decoder`, handing the data to `data` until it fails (its error is
/// kept in `failed`).
fn decode_into<E>(
    decoder: &mut BodyDecoder,
    bytes: &[u8],
    data: &mut impl FnMut(&[u8]) -> Result<(), E>,
    failed: &mut Option<E>,
) -> Result<usize, H1Error> {
    decoder.decode(bytes, |s| {
        if failed.is_none() {
            if let Err(e) = data(s) {
                *failed = Some(e);
            }
        }
    })
}
