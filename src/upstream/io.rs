//! An upstream connection's transport and how it is opened: TCP to the upstream's host (each
//! of its addresses in turn, within `--upstream-connect-timeout`, `TCP_NODELAY`), under TLS
//! for an `https://` upstream (tokio-rustls, SNI from the URL's host). A plain connection is
//! kept at the size of its socket, a TLS one boxed, so every plain upstream connection (each
//! held standalone stream, each pooled connection) carries no room for a TLS session it never
//! has (bench/notes.md, "Figure: a plain upstream connection").

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::BoxError;

/// One upstream connection's transport.
#[derive(Debug)]
pub(crate) enum UpIo {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// How the upstream is reached: TLS for an `https://` upstream (its client config, ALPN left
/// empty: the gateway speaks HTTP/1.1 to it), and the bound on connecting.
#[derive(Clone)]
pub(crate) struct Dialer {
    tls: TlsConnector,
    timeout: Duration,
}

/// Why no connection was opened.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    #[error("the upstream URL has no host")]
    NoHost,
    #[error("the upstream's host does not resolve: {0}")]
    Resolve(std::io::Error),
    #[error("the upstream's host resolves to no address")]
    NoAddress,
    #[error("connecting timed out after {0:?}")]
    TimedOut(Duration),
    #[error("{0}")]
    Tcp(std::io::Error),
    #[error("the upstream's host is not a TLS server name: {0}")]
    ServerName(String),
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
}

impl Dialer {
    pub(crate) fn new(tls: rustls::ClientConfig, timeout: Duration) -> Dialer {
        Dialer {
            tls: TlsConnector::from(Arc::new(tls)),
            timeout,
        }
    }

    /// A new connection to `uri`'s authority (its scheme's port by default), under TLS when
    /// its scheme is `https`.
    pub(crate) async fn connect(&self, uri: &Uri) -> Result<UpIo, BoxError> {
        let tls = uri.scheme_str() == Some("https");
        let host = uri
            .host()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
            .filter(|h| !h.is_empty())
            .ok_or(ConnectError::NoHost)?;
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let tcp = self.tcp(host, port).await?;
        if !tls {
            return Ok(UpIo::Plain(tcp));
        }
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| ConnectError::ServerName(e.to_string()))?;
        let stream = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(ConnectError::Tls)?;
        Ok(UpIo::Tls(Box::new(stream)))
    }

    /// TCP to `host`: each address it resolves to in turn, each given its part of the
    /// connect timeout (as hyper-util's connector does), the first that accepts.
    async fn tcp(&self, host: &str, port: u16) -> Result<TcpStream, ConnectError> {
        let addrs: Vec<SocketAddr> = match host.parse::<std::net::IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::time::timeout(self.timeout, tokio::net::lookup_host((host, port)))
                .await
                .map_err(|_| ConnectError::TimedOut(self.timeout))?
                .map_err(ConnectError::Resolve)?
                .collect(),
        };
        let each = self.timeout / u32::try_from(addrs.len().max(1)).unwrap_or(u32::MAX);
        let mut last = ConnectError::NoAddress;
        for addr in addrs {
            match tokio::time::timeout(each, TcpStream::connect(addr)).await {
                Ok(Ok(tcp)) => {
                    let _ = tcp.set_nodelay(true);
                    return Ok(tcp);
                }
                Ok(Err(e)) => last = ConnectError::Tcp(e),
                Err(_) => last = ConnectError::TimedOut(self.timeout),
            }
        }
        Err(last)
    }
}

impl UpIo {
    /// The connection's socket, under TLS if any.
    fn tcp(&self) -> &TcpStream {
        match self {
            UpIo::Plain(t) => t,
            UpIo::Tls(t) => t.get_ref().0,
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

impl AsyncRead for UpIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpIo::Plain(t) => Pin::new(t).poll_read(cx, buf),
            UpIo::Tls(t) => Pin::new(&mut **t).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpIo {
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
        assert!(std::mem::size_of::<UpIo>() <= 2 * std::mem::size_of::<TcpStream>());
        assert!(std::mem::size_of::<TlsStream<TcpStream>>() > 8 * std::mem::size_of::<UpIo>());
    }

    fn dialer(timeout: Duration) -> Dialer {
        Dialer::new(crate::tls::no_roots_client_config(), timeout)
    }

    #[tokio::test]
    async fn connects_to_the_urls_authority_in_the_clear_for_http() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: Uri = format!("http://{}/mcp", l.local_addr().unwrap())
            .parse()
            .unwrap();
        let io = dialer(Duration::from_secs(5)).connect(&uri).await.unwrap();
        let (_peer, from) = l.accept().await.unwrap();
        assert!(matches!(io, UpIo::Plain(_)));
        assert_eq!(io.tcp().local_addr().unwrap(), from);
        assert!(io.tcp().nodelay().unwrap());
    }

    #[tokio::test]
    async fn a_refused_or_nameless_upstream_is_a_clear_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let d = dialer(Duration::from_secs(5));
        let refused = d
            .connect(&format!("http://{addr}/").parse().unwrap())
            .await
            .unwrap_err();
        assert!(
            matches!(refused.downcast_ref::<ConnectError>(), Some(ConnectError::Tcp(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused),
            "{refused}"
        );
        let nameless = d.connect(&"/mcp".parse().unwrap()).await.unwrap_err();
        assert!(
            matches!(
                nameless.downcast_ref::<ConnectError>(),
                Some(ConnectError::NoHost)
            ),
            "{nameless}"
        );
    }

    #[tokio::test]
    async fn an_https_upstream_that_is_not_tls_fails_its_handshake() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: Uri = format!("https://{}/mcp", l.local_addr().unwrap())
            .parse()
            .unwrap();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let (mut tcp, _) = l.accept().await.unwrap();
            let _ = tcp.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        });
        let e = dialer(Duration::from_secs(5))
            .connect(&uri)
            .await
            .unwrap_err();
        assert!(
            matches!(e.downcast_ref::<ConnectError>(), Some(ConnectError::Tls(_))),
            "{e}"
        );
    }
}
