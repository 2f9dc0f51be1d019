//! The gateway's HTTP/1.1 exchanges with the upstream, written and read on the upstream
//! socket by the task that wants the answer (a route, a stream's reader): no connection task,
//! no body channel, no cross-task wake-up per chunk, and no buffer while a stream is idle (each
//! read goes into a buffer on the stack and is decoded at once, framing and SSE in one pass).
//! The protocol is [`crate::http1::client`]'s; here is the HTTP client's policy: the
//! dialer, the pool, the bound on connections ([`Ending`] releases both), a body sent
//! whole.
//!
//! A connection whose answer ended cleanly (its framing's end, nothing after it, HTTP/1.1
//! without `Connection: close`, not an answer to `HEAD`) goes back to a small pool of idle
//! ones, newest first; one that ended any other way, or was dropped part-way, is closed. A
//! connection with anything unread (bytes, a close) is neither pooled nor used again, so a
//! late extra answer is never the next request's; a pooled connection is used again only if
//! it idled less than [`IDLE_TIMEOUT`], which is shorter than the common servers' own
//! keep-alive timeouts. Interim (`1xx`) heads before an answer are bounded
//! ([`http1::MAX_INTERIM_HEADS`], and with the final head in [`http1::MAX_HEAD_BYTES`]).
//!
//! Knows the dialer and [`crate::http1`]; nothing of sessions.

use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Waker};
use std::time::Duration;

use http::{Method, Response};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::time::Instant;

use super::io::UpIo;
use super::limit::CountedIo;
use super::{BoxError, UpRequest, Upstream};
pub(crate) use crate::http1::client::ReadEnd;
use crate::http1::client::{read_answer, write_request, Answer, Release};
use crate::http1::{self};

/// The longest a connection idles in the pool: below the keep-alive timeouts of Node.js and
/// uvicorn (5 s), so the gateway gives a connection up before the server does, not while a
/// request is on its way.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// A body up to this size is written with its head in one write.
const COALESCE_BODY_BYTES: usize = 64 * 1024;

/// An upstream connection, holding its place under the bound until it closes.
pub(crate) type Conn = CountedIo<UpIo>;

/// The idle connections, newest last, and how many it keeps at most.
pub(crate) struct Pool {
    idle: Mutex<Vec<(Box<Conn>, Instant)>>,
    max_idle: usize,
}

impl Pool {
    pub(crate) fn new(max_idle: usize) -> Pool {
        Pool {
            idle: Mutex::new(Vec::new()),
            max_idle,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Box<Conn>, Instant)>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The newest idle connection still open, if any (older ones past the timeout, and any
    /// the upstream closed or wrote to meanwhile, are dropped on the way).
    fn checkout(&self) -> Option<Box<Conn>> {
        let now = Instant::now();
        let mut idle = self.lock();
        while let Some((mut io, since)) = idle.pop() {
            if now.duration_since(since) < IDLE_TIMEOUT && quiet(&mut io) {
                return Some(io);
            }
        }
        None
    }

    /// Keeps `io`, whose answer has ended, for a next request: unless anything is left to
    /// read on it (then it is closed), or the pool is full.
    fn checkin(&self, mut io: Box<Conn>) {
        if !quiet(&mut io) {
            return;
        }
        let mut idle = self.lock();
        if idle.len() < self.max_idle {
            idle.push((io, Instant::now()));
        }
    }

    /// Closes the connections idle past the timeout (the upstream sweeper calls it).
    pub(crate) fn purge(&self) {
        let now = Instant::now();
        let expired: Vec<_> = {
            let mut idle = self.lock();
            let keep = idle
                .iter()
                .position(|(_, since)| now.duration_since(*since) < IDLE_TIMEOUT)
                .unwrap_or(idle.len());
            idle.drain(..keep).collect()
        };
        drop(expired);
    }
}

/// Whether a connection between answers is open and has nothing to read: a close, a reset,
/// or bytes the upstream should not have sent (a late extra answer, a `HEAD`'s body) all mean
/// it is not, whether the transport holds them already (TLS keeps what it decrypted) or the
/// socket does.
fn quiet(io: &mut Conn) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    let mut byte = [MaybeUninit::<u8>::uninit(); 1];
    let mut rb = ReadBuf::uninit(&mut byte);
    Pin::new(&mut *io).poll_read(&mut cx, &mut rb).is_pending() && io.get_ref().socket_quiet()
}

/// The body of an upstream response, read on its connection by whoever polls it
/// ([`Answer`]): its connection goes back to the pool when it may, and the client's share has
/// its place back, when it ends ([`Ending`]).
pub(crate) type OwnBody = Answer<Conn, Ending>;

/// What an upstream answer holds until its body ends: where its connection goes then (the
/// pool, when it may carry another request), and the place of the client's share.
pub(crate) struct Ending {
    /// `None`: the connection is closed.
    reuse: Option<Arc<Pool>>,
    /// The place of the client's share the exchange holds until the body ends.
    admitted: Option<super::limit::Admitted>,
}

impl Release<Conn> for Ending {
    fn release(self, io: Option<Box<Conn>>) {
        drop(self.admitted);
        if let (Some(io), Some(pool)) = (io, self.reuse) {
            pool.checkin(io);
        }
    }
}

/// Why a request got no response head.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    #[error("cannot connect to the upstream: {0}")]
    Connect(BoxError),
    #[error("could not read the request body: {0}")]
    Body(BoxError),
    #[error("upstream connection failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the upstream closed the connection before its response head")]
    Closed,
    #[error(transparent)]
    Head(http1::Error),
}

impl From<http1::Error> for SendError {
    fn from(e: http1::Error) -> SendError {
        match e.kind() {
            http1::Kind::Closed => SendError::Closed,
            http1::Kind::Io => match e.into_io() {
                Ok(io) => SendError::Io(io),
                Err(e) => SendError::Head(e),
            },
            _ => SendError::Head(e),
        }
    }
}

impl SendError {
    /// Whether no connection could be opened.
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, SendError::Connect(_))
    }

    /// The bound on upstream connections, if that is why no connection was opened.
    pub(crate) fn at_limit(&self) -> Option<usize> {
        match self {
            SendError::Connect(e) => super::limit::AtLimit::find(e.as_ref()),
            _ => None,
        }
    }
}

/// Sends `req` (built by [`Upstream::request`]; its body is sent whole, with a
/// `Content-Length`) on a pooled or new connection and reads the response head. A client's
/// request over its share's part of the connections is refused before either (`limit`).
pub(crate) async fn send(up: &Upstream, req: UpRequest) -> Result<Response<OwnBody>, SendError> {
    let UpRequest {
        method,
        target,
        mut head,
        body,
        share,
    } = req;
    let body = body.collect().await.map_err(SendError::Body)?.to_bytes();
    // Methods that carry a body say its length even when it is empty, as hyper does.
    let framed = !body.is_empty()
        || !matches!(
            method,
            Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
        );
    http1::end_request_head(&mut head, framed.then_some(body.len()));
    let together = body.len() <= COALESCE_BODY_BYTES;
    if together {
        head.extend_from_slice(&body);
    }
    // A client's request first takes its share's place, pooled connection or new.
    let admitted = match share {
        Some(share) => Some(
            up.conns
                .admit(share)
                .map_err(|e| SendError::Connect(e.into()))?,
        ),
        None => None,
    };
    let io = match up.pool.checkout() {
        // A pooled connection that fails while the request is written never delivered it
        // whole: the request is sent again on a new connection.
        Some(mut io) => match write_request(&mut io, &head, &body, together).await {
            Ok(()) => io,
            Err(_) => connect_and_write(up, target, &head, &body, together).await?,
        },
        None => connect_and_write(up, target, &head, &body, together).await?,
    };
    let answer = read_answer(io, &method, |reusable| Ending {
        reuse: reusable.then(|| up.pool.clone()),
        admitted,
    });
    Ok(answer.await?)
}

async fn connect_and_write(
    up: &Upstream,
    uri: http::Uri,
    head: &[u8],
    body: &[u8],
    together: bool,
) -> Result<Box<Conn>, SendError> {
    let mut io = Box::new(
        up.conns
            .connect(&up.dialer, &uri)
            .await
            .map_err(SendError::Connect)?,
    );
    write_request(&mut io, head, body, together).await?;
    Ok(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body::Body;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An upstream on a loopback port that answers its first request with `answer` and then
    /// keeps the connection open.
    async fn answering(answer: &'static [u8]) -> std::net::SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut tcp, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = tcp.read(&mut buf).await;
            tcp.write_all(answer).await.unwrap();
            let _ = tcp.read(&mut buf).await;
        });
        addr
    }

    async fn get(addr: std::net::SocketAddr) -> Response<OwnBody> {
        let uri: http::Uri = format!("http://{addr}/mcp").parse().unwrap();
        let up = Upstream::new(Arc::new(crate::Config::new(uri.clone())));
        let req = up.request(
            &Method::GET,
            &uri,
            &http::HeaderMap::new(),
            None,
            super::super::full_body(Bytes::new()),
            None,
        );
        send(&up, req).await.unwrap()
    }

    #[tokio::test]
    async fn a_connection_with_unread_bytes_is_neither_pooled_nor_reused() {
        use std::io::Write;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let uri: http::Uri = format!("http://{}/mcp", l.local_addr().unwrap())
            .parse()
            .unwrap();
        let up = Upstream::new(Arc::new(crate::Config::new(uri.clone())));
        let connect = || async { Box::new(up.conns.connect(&up.dialer, &uri).await.unwrap()) };
        let mut io = connect().await;
        let (mut upstream, _) = l.accept().unwrap();
        // An answer read to its end: tokio then takes the socket for drained.
        upstream
            .write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
            .unwrap();
        let mut buf = [0u8; 256];
        let n = AsyncReadExt::read(&mut *io, &mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"HTTP/1.1 204 No Content\r\n\r\n");
        // A late extra answer, in the socket before the connection goes back to the pool
        // (and before tokio's driver has run to learn of it).
        upstream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nforeign")
            .unwrap();
        let pool = Pool::new(4);
        pool.checkin(io);
        assert!(
            pool.checkout().is_none(),
            "a connection with unread bytes was handed out again"
        );
        assert!(pool.lock().is_empty());
        // A quiet one is pooled and handed out.
        let io = connect().await;
        let (_upstream, _) = l.accept().unwrap();
        pool.checkin(io);
        assert!(pool.checkout().is_some());
    }

    #[tokio::test]
    async fn a_head_that_came_alone_keeps_no_read_buffer() {
        let addr = answering(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").await;
        let resp = get(addr).await;
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        assert!(!resp.body().has_early());
        // An idle held stream waits on this body for as long as its session lives.
        assert_eq!(resp.body().early().capacity(), 0);
    }

    #[tokio::test]
    async fn a_body_is_taken_whole_only_when_its_length_came_with_the_head() {
        let json =
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        let mut resp = get(answering(json).await).await;
        assert_eq!(resp.body_mut().take_whole().as_deref(), Some(&b"{}"[..]));
        assert!(resp.body().is_end_stream());
        assert!(resp.body().let_go(), "the connection is pooled or closed");
        // Part of it still to come: nothing is taken, the body reads on.
        let part =
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4\r\n\r\n{}";
        let mut resp = get(answering(part).await).await;
        assert_eq!(resp.body_mut().take_whole(), None);
        assert_eq!(&resp.body().early()[..], b"{}");
        // A chunked body is never taken whole, even when all of it is here.
        let chunked = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n";
        let mut resp = get(answering(chunked).await).await;
        assert_eq!(resp.body_mut().take_whole(), None);
        assert!(resp.body().has_early());
    }

    #[tokio::test]
    async fn body_bytes_that_came_with_the_head_are_read_first() {
        let addr = answering(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n").await;
        let mut resp = get(addr).await;
        assert!(resp.body().has_early());
        let mut data = Vec::new();
        let end = resp
            .body_mut()
            .read(1 << 20, |s| {
                data.extend_from_slice(s);
                Ok::<_, ()>(())
            })
            .await
            .unwrap();
        assert!(matches!(end, ReadEnd::More), "{end:?}");
        assert_eq!(data, b"hello");
        assert_eq!(resp.body().early().capacity(), 0);
    }
}
