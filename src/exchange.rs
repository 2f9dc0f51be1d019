//! The types one exchange is made of, shared by the listener, the HTTP handler and the
//! upstream client: a client's request body ([`ClientBody`]: hyper's or the gateway's own
//! HTTP/1.1's [`ReqBody`]), the per-connection facts a handler is given ([`Conn`]), the body
//! types of the gateway's responses and upstream requests, [`BoxError`], and the MCP header
//! names. A leaf: it imports no other module of the crate, so the layers above it (`http1`,
//! `server`, `proxy`, `upstream`, `error`) share these types without importing each other.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::header::HeaderName;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use tokio::sync::Notify;

/// The error of the bodies the gateway passes along, whatever their source.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Body of every response the gateway sends.
pub(crate) type ResBody = UnsyncBoxBody<Bytes, BoxError>;

/// Body of every request the gateway sends upstream.
pub(crate) type UpBody = UnsyncBoxBody<Bytes, BoxError>;

pub(crate) const MCP_SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");
pub(crate) const MCP_PROTOCOL_VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");

/// Per-connection facts the handler needs.
#[derive(Clone, Debug)]
pub(crate) struct Conn {
    pub remote: std::net::SocketAddr,
    /// Notified to close the client connection (a stalled client whose body cannot be polled).
    pub kill: Arc<Notify>,
    /// The subject of the client's verified TLS certificate (mTLS), if any.
    pub client_subject: Option<Arc<str>>,
}

/// A client's request body: hyper's (HTTP/2) or read by the gateway's own HTTP/1.1
/// ([`ReqBody`]).
#[derive(Debug)]
pub(crate) enum ClientBody {
    Hyper(Incoming),
    Own(ReqBody),
}

impl ClientBody {
    /// The body, when it came whole with its head (the gateway's own HTTP/1.1 only).
    pub(crate) fn take_whole(&mut self) -> Option<Bytes> {
        match self {
            ClientBody::Hyper(_) => None,
            ClientBody::Own(b) => b.take_whole(),
        }
    }
}

impl HttpBody for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            ClientBody::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            ClientBody::Own(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ClientBody::Hyper(b) => b.is_end_stream(),
            ClientBody::Own(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ClientBody::Hyper(b) => b.size_hint(),
            ClientBody::Own(b) => b.size_hint(),
        }
    }
}

/// A request body as the gateway's handler reads it, from the gateway's own HTTP/1.1: whole
/// (it came with its head), or fed by the connection as the handler asks for it
/// ([`BodyFeed`]).
#[derive(Debug)]
pub(crate) struct ReqBody(Inner);

#[derive(Debug)]
enum Inner {
    /// Whole already (it came with its head), or none.
    Whole(Option<Bytes>),
    /// Still arriving: the connection feeds it.
    Streamed(Arc<Mutex<Pipe>>),
}

/// A streamed body between the connection (writer) and the handler (reader).
#[derive(Debug, Default)]
pub(crate) struct Pipe {
    chunks: VecDeque<Bytes>,
    queued: usize,
    done: bool,
    /// Why the body cannot be read to its end, until the reader is told; `failed` stays set.
    error: Option<BoxError>,
    failed: bool,
    /// The reader waits for more.
    wants: bool,
    waker: Option<Waker>,
}

impl Pipe {
    /// Wakes the reader, if it waits.
    pub(crate) fn wake(&mut self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// One more piece of the body's data.
    pub(crate) fn push(&mut self, data: Bytes) {
        self.queued += data.len();
        self.chunks.push_back(data);
    }

    /// The body's data is all pushed.
    pub(crate) fn finish(&mut self) {
        self.done = true;
    }

    /// The body cannot be read to its end, for `why` (made only if it had not ended already);
    /// the reader is woken.
    pub(crate) fn fail(&mut self, why: impl FnOnce() -> BoxError) {
        if !self.done && !self.failed {
            self.error = Some(why());
            self.failed = true;
            self.wake();
        }
    }

    /// Whether the body ended, read to its end or failed.
    pub(crate) fn ended(&self) -> bool {
        self.done || self.failed
    }

    /// Whether the reader waits for more, and the bytes queued and not read yet.
    pub(crate) fn demand(&self) -> (bool, usize) {
        (self.wants, self.queued)
    }
}

/// The connection's handle on a streamed [`ReqBody`].
#[derive(Debug, Clone)]
pub(crate) struct BodyFeed(Arc<Mutex<Pipe>>);

impl BodyFeed {
    /// The body's state, under its (short) lock.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Pipe> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the body was read to its end without an error.
    pub(crate) fn read_whole(&self) -> bool {
        let s = self.lock();
        s.done && !s.failed
    }
}

impl ReqBody {
    /// A body that came whole with its head (`None`: no body).
    pub(crate) fn whole(body: Option<Bytes>) -> ReqBody {
        ReqBody(Inner::Whole(body))
    }

    /// A body still arriving, and the connection's handle to feed it.
    pub(crate) fn streamed() -> (ReqBody, BodyFeed) {
        let pipe = Arc::new(Mutex::new(Pipe::default()));
        (ReqBody(Inner::Streamed(pipe.clone())), BodyFeed(pipe))
    }

    /// The body, when it came whole with its head (taken: the body is then at its end).
    pub(crate) fn take_whole(&mut self) -> Option<Bytes> {
        match &mut self.0 {
            Inner::Whole(b) => b.take(),
            Inner::Streamed(_) => None,
        }
    }
}

impl HttpBody for ReqBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.0 {
            Inner::Whole(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Inner::Streamed(shared) => {
                let mut s = shared.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(c) = s.chunks.pop_front() {
                    s.queued -= c.len();
                    return Poll::Ready(Some(Ok(Frame::data(c))));
                }
                if s.failed {
                    return Poll::Ready(s.error.take().map(Err));
                }
                if s.done {
                    return Poll::Ready(None);
                }
                s.wants = true;
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Inner::Whole(b) => b.is_none(),
            Inner::Streamed(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Inner::Whole(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Inner::Streamed(_) => SizeHint::default(),
        }
    }
}
