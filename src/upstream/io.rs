//! An upstream connection's transport as the gateway keeps it: a plain TCP connection at the
//! size of its socket, a TLS one boxed. hyper-rustls's `MaybeHttpsStream` is an enum as large
//! as its TLS state, so every plain upstream connection (each held standalone stream, each
//! pooled connection) carried room for a TLS session it never had (bench/notes.md, "Figure:
//! a plain upstream connection").

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Uri;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::BoxError;

type Tcp = TokioIo<TcpStream>;

/// One upstream connection's transport.
#[derive(Debug)]
pub(crate) enum UpIo {
    Plain(Tcp),
    Tls(Box<MaybeHttpsStream<Tcp>>),
}

/// The TLS-capable connector, its connections as [`UpIo`].
#[derive(Clone, Debug)]
pub(crate) struct Slim(pub(crate) HttpsConnector<HttpConnector>);

impl tower_service::Service<Uri> for Slim {
    type Response = UpIo;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<UpIo, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.0.call(uri);
        Box::pin(async move {
            Ok(match connecting.await? {
                MaybeHttpsStream::Http(tcp) => UpIo::Plain(tcp),
                tls => UpIo::Tls(Box::new(tls)),
            })
        })
    }
}

impl UpIo {
    /// The connection's socket, under TLS if any.
    fn tcp(&self) -> &TcpStream {
        match self {
            UpIo::Plain(t) => t.inner(),
            UpIo::Tls(t) => match &**t {
                MaybeHttpsStream::Http(t) => t.inner(),
                MaybeHttpsStream::Https(tls) => tls.inner().get_ref().0.inner().inner(),
            },
        }
    }

    /// Whether the socket has nothing to read: no byte, no close, no error waiting in it.
    /// Asked of the socket itself (a peek), not of tokio's readiness, which learns of bytes
    /// that came after the last read only when its driver next runs.
    pub(crate) fn socket_quiet(&self) -> bool {
        let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        matches!(
            socket2::SockRef::from(self.tcp()).peek(&mut byte),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
        )
    }
}

impl Connection for UpIo {
    fn connected(&self) -> Connected {
        match self {
            UpIo::Plain(t) => t.connected(),
            UpIo::Tls(t) => t.connected(),
        }
    }
}

impl hyper::rt::Read for UpIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(t) => Pin::new(t).poll_read(cx, buf),
            UpIo::Tls(t) => Pin::new(&mut **t).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for UpIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpIo::Plain(t) => Pin::new(t).poll_write(cx, buf),
            UpIo::Tls(t) => Pin::new(&mut **t).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(t) => Pin::new(t).poll_flush(cx),
            UpIo::Tls(t) => Pin::new(&mut **t).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(t) => Pin::new(t).poll_shutdown(cx),
            UpIo::Tls(t) => Pin::new(&mut **t).poll_shutdown(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpIo::Plain(t) => t.is_write_vectored(),
            UpIo::Tls(t) => t.is_write_vectored(),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpIo::Plain(t) => Pin::new(t).poll_write_vectored(cx, bufs),
            UpIo::Tls(t) => Pin::new(&mut **t).poll_write_vectored(cx, bufs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_connection_is_the_size_of_its_socket() {
        assert!(std::mem::size_of::<UpIo>() <= 2 * std::mem::size_of::<Tcp>());
        assert!(std::mem::size_of::<MaybeHttpsStream<Tcp>>() > 8 * std::mem::size_of::<UpIo>());
    }
}
