//! The HTTP/1.1 layer's one error: what went wrong ([`Kind`]), whose bytes or connection it was
//! ([`Peer`]: the client's, or the upstream's), and a fixed detail or the cause it came with.
//! Each kind and peer maps to one status ([`Error::status`]) and one metric
//! ([`Error::metric`]), in one exhaustive `match` each: the connection answers a refused head
//! with its status and counts its end under its metric, the upstream client hands it to the
//! gateway's error table.

use http::StatusCode;

use super::limits::{MAX_HEADERS, MAX_HEAD_BYTES};
use crate::exchange::BoxError;
use crate::metrics::{ConnectionErrorKind, UpstreamErrorKind};

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A malformed head.
    Head,
    /// A head over its bounds (bytes, headers, interim heads' bytes).
    HeadTooLarge,
    /// Ambiguous body framing: refused, never guessed.
    Framing,
    /// A malformed chunked body.
    Chunk,
    /// The peer closed the connection mid-message.
    Closed,
    /// The connection ended (on the gateway's side) before a request body did: its reader
    /// gets this, not a hang.
    Ended,
    /// A request head not whole within `--header-read-timeout`.
    HeaderTimeout,
    /// The connection's reads or writes failed.
    Io,
    /// The body of a response the gateway writes failed, or disagreed with its length.
    Body,
}

/// Whose message or connection an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// A client's connection to the gateway.
    Client,
    /// The gateway's connection to the upstream.
    Upstream,
}

/// The metric an error is counted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Metric {
    /// `connection_errors_total{kind}`: a client connection's end.
    Connection(ConnectionErrorKind),
    /// `upstream_errors_total{kind}`: an exchange with the upstream.
    Upstream(UpstreamErrorKind),
}

/// What an error says beside its kind.
enum Detail {
    Text(&'static str),
    /// The error it came from (an I/O error, a response body's error): boxed, an error's
    /// path only.
    Cause(Box<BoxError>),
}

/// An HTTP/1.1 error: a kind, a peer, a detail.
pub struct Error {
    kind: Kind,
    peer: Peer,
    detail: Detail,
}

impl Error {
    /// An error of `kind` in `peer`'s bytes, saying `detail`.
    pub(crate) const fn new(kind: Kind, peer: Peer, detail: &'static str) -> Error {
        Error {
            kind,
            peer,
            detail: Detail::Text(detail),
        }
    }

    /// An error of `kind` caused by `cause`.
    pub(crate) fn caused(kind: Kind, peer: Peer, cause: impl Into<BoxError>) -> Error {
        Error {
            kind,
            peer,
            detail: Detail::Cause(Box::new(cause.into())),
        }
    }

    /// A failed read or write of `peer`'s connection.
    pub(crate) fn io(peer: Peer, e: std::io::Error) -> Error {
        Error::caused(Kind::Io, peer, e)
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn peer(&self) -> Peer {
        self.peer
    }

    /// The error's fixed detail (empty when it has a cause instead).
    pub fn detail(&self) -> &'static str {
        match &self.detail {
            Detail::Text(t) => t,
            Detail::Cause(_) => "",
        }
    }

    /// The I/O error it came from, if it is one (else itself).
    pub(crate) fn into_io(self) -> Result<std::io::Error, Error> {
        match self.detail {
            Detail::Cause(cause) if cause.is::<std::io::Error>() => match cause.downcast() {
                Ok(io) => Ok(*io),
                Err(cause) => Err(Error {
                    detail: Detail::Cause(Box::new(cause)),
                    ..self
                }),
            },
            detail => Err(Error { detail, ..self }),
        }
    }

    /// The same error in the other peer's bytes (the body decoder and the framing rules
    /// serve both sides; their caller knows whose bytes they read).
    pub(crate) fn of(mut self, peer: Peer) -> Error {
        self.peer = peer;
        self
    }

    /// The status a client is answered with for it (RFC 9110 §15.5.1, RFC 6585 §5): a client's
    /// malformed or ambiguous message 400, its head too large 431, an upstream's bytes or
    /// connection 502; `None` where nobody is left to answer, or the answer has begun.
    pub fn status(&self) -> Option<StatusCode> {
        match (self.kind, self.peer) {
            (Kind::Head | Kind::Framing | Kind::Chunk, Peer::Client) => {
                Some(StatusCode::BAD_REQUEST)
            }
            (Kind::HeadTooLarge, Peer::Client) => Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
            (
                Kind::Head
                | Kind::HeadTooLarge
                | Kind::Framing
                | Kind::Chunk
                | Kind::Closed
                | Kind::Io,
                Peer::Upstream,
            ) => Some(StatusCode::BAD_GATEWAY),
            (Kind::Closed | Kind::Ended | Kind::HeaderTimeout | Kind::Io | Kind::Body, _) => None,
        }
    }

    /// The metric it is counted under.
    pub(crate) fn metric(&self) -> Metric {
        match (self.kind, self.peer) {
            (Kind::HeaderTimeout, Peer::Client) => {
                Metric::Connection(ConnectionErrorKind::HeaderTimeout)
            }
            (Kind::HeadTooLarge, Peer::Client) => {
                Metric::Connection(ConnectionErrorKind::HeadTooLarge)
            }
            (Kind::Closed, Peer::Client) => Metric::Connection(ConnectionErrorKind::ClientGone),
            (Kind::Io, Peer::Client) if self.io_gone() => {
                Metric::Connection(ConnectionErrorKind::ClientGone)
            }
            (
                Kind::Head | Kind::Framing | Kind::Chunk | Kind::Ended | Kind::Io | Kind::Body,
                Peer::Client,
            ) => Metric::Connection(ConnectionErrorKind::Other),
            (
                Kind::Head | Kind::HeadTooLarge | Kind::Framing | Kind::HeaderTimeout,
                Peer::Upstream,
            ) => Metric::Upstream(UpstreamErrorKind::Request),
            (Kind::Chunk | Kind::Closed | Kind::Ended | Kind::Io | Kind::Body, Peer::Upstream) => {
                Metric::Upstream(UpstreamErrorKind::Stream)
            }
        }
    }

    /// The `connection_errors_total` kind of a client connection that ended with it.
    pub(crate) fn connection_error(&self) -> ConnectionErrorKind {
        match self.metric() {
            Metric::Connection(k) => k,
            Metric::Upstream(_) => ConnectionErrorKind::Other,
        }
    }

    /// The client's head refused: answered with its status, then the connection closes.
    pub fn refused_head(&self) -> Option<StatusCode> {
        match (self.kind, self.peer) {
            (Kind::Head | Kind::HeadTooLarge | Kind::Framing, Peer::Client) => self.status(),
            _ => None,
        }
    }

    /// Why a refused head was refused, as the access line's `error.type` says it.
    pub fn reason(&self) -> &'static str {
        match self.kind {
            Kind::Head => "malformed-head",
            Kind::HeadTooLarge => "head-too-large",
            Kind::Framing => "ambiguous-framing",
            Kind::Chunk => "malformed-chunked-body",
            Kind::Closed => "peer-closed",
            Kind::Ended => "connection-ended",
            Kind::HeaderTimeout => "header-timeout",
            Kind::Io => "io",
            Kind::Body => "body",
        }
    }

    /// Whether an I/O error says the peer went away (reset, broken pipe, an early EOF).
    fn io_gone(&self) -> bool {
        let Detail::Cause(cause) = &self.detail else {
            return false;
        };
        cause.downcast_ref::<std::io::Error>().is_some_and(|e| {
            matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            )
        })
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = DetailText(&self.detail);
        match (self.kind, self.peer) {
            (Kind::Head, Peer::Client) => write!(f, "malformed request head: {d}"),
            (Kind::Head, Peer::Upstream) => write!(f, "malformed response head: {d}"),
            (Kind::HeadTooLarge, Peer::Client) => write!(
                f,
                "request head larger than the limits (--max-header-bytes, --max-headers)"
            ),
            (Kind::HeadTooLarge, Peer::Upstream) => write!(
                f,
                "response head larger than {MAX_HEAD_BYTES} bytes or {MAX_HEADERS} headers"
            ),
            (Kind::Framing, Peer::Client) => write!(f, "ambiguous request body framing: {d}"),
            (Kind::Framing, Peer::Upstream) => write!(f, "ambiguous body framing: {d}"),
            (Kind::Chunk, _) => write!(f, "malformed chunked body: {d}"),
            (Kind::Closed, Peer::Client) => {
                write!(f, "the client closed the connection mid-message")
            }
            (Kind::Closed, Peer::Upstream) => {
                write!(f, "the upstream closed the connection {d}")
            }
            (Kind::Ended, _) => write!(f, "request body: the connection ended before the body did"),
            (Kind::HeaderTimeout, _) => {
                write!(f, "request head not complete within --header-read-timeout")
            }
            (Kind::Io, Peer::Client) => write!(f, "client connection: {d}"),
            (Kind::Io, Peer::Upstream) => write!(f, "{d}"),
            (Kind::Body, _) => write!(f, "response body failed: {d}"),
        }
    }
}

/// A detail as text: the fixed one, or its cause's.
struct DetailText<'a>(&'a Detail);

impl std::fmt::Display for DetailText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Detail::Text(t) => f.write_str(t),
            Detail::Cause(c) => std::fmt::Display::fmt(c, f),
        }
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.kind).field("peer", &self.peer);
        match &self.detail {
            Detail::Text(t) => d.field("detail", t),
            Detail::Cause(c) => d.field("cause", c),
        };
        d.finish()
    }
}

/// Equal when of the same kind, peer and fixed detail (causes are not compared).
impl PartialEq for Error {
    fn eq(&self, other: &Error) -> bool {
        self.kind == other.kind && self.peer == other.peer && self.detail() == other.detail()
    }
}

impl Eq for Error {}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.detail {
            Detail::Text(_) => None,
            Detail::Cause(c) => Some(&***c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_refusal_is_answered_and_counted_as_before() {
        let e = Error::new(Kind::HeadTooLarge, Peer::Client, "");
        assert_eq!(
            e.refused_head(),
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        assert_eq!(e.connection_error(), ConnectionErrorKind::HeadTooLarge);
        assert_eq!(e.reason(), "head-too-large");
        let e = Error::new(Kind::Framing, Peer::Client, "both");
        assert_eq!(e.refused_head(), Some(StatusCode::BAD_REQUEST));
        assert_eq!(e.to_string(), "ambiguous request body framing: both");
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let e = Error::io(Peer::Client, reset);
        assert_eq!(e.connection_error(), ConnectionErrorKind::ClientGone);
        assert_eq!(e.refused_head(), None);
        let e = Error::new(Kind::Head, Peer::Upstream, "no status");
        assert_eq!(e.status(), Some(StatusCode::BAD_GATEWAY));
        assert_eq!(e.to_string(), "malformed response head: no status");
    }

    #[test]
    fn an_error_is_no_larger_than_the_errors_it_replaced() {
        // The body decoder returns it on every read.
        assert!(std::mem::size_of::<Error>() <= 24);
    }
}
