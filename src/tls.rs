//! TLS on both sides, with rustls (ring provider): the proxy listener's certificate and key
//! (PEM files, re-read when they change or when asked (SIGHUP), a bad new pair refused and the
//! old one kept), the optional client-certificate check (`--tls-client-ca`) and the subject it
//! yields, the listener's stream type (plain or TLS), and the upstream client's roots (the
//! platform's, or `--upstream-ca`).
//!
//! Knows files, certificates and rustls; nothing of HTTP requests or sessions.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::metrics::ConnectionErrorKind;

/// How often the certificate and key files are checked for changes unless told otherwise
/// (`--tls-reload-interval`'s default, `config::defaults::TLS_RELOAD_INTERVAL`; a config test
/// keeps the two equal).
pub(crate) const RELOAD_INTERVAL: Duration = Duration::from_secs(5);

/// A certificate, key or CA file that cannot be used; names the flag it came from.
#[derive(Debug, thiserror::Error)]
#[error("invalid value for '{flag}' ({path}): {reason}")]
pub struct TlsError {
    pub flag: &'static str,
    pub path: PathBuf,
    pub reason: String,
}

impl TlsError {
    fn new(flag: &'static str, path: &Path, reason: impl Into<String>) -> TlsError {
        TlsError {
            flag,
            path: path.to_owned(),
            reason: reason.into(),
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::new(flag, path, format!("cannot read: {e}")))
}

/// The certificates of a PEM file (at least one), each checked to be valid now.
fn parse_certs(
    flag: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::new(flag, path, format!("not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::new(flag, path, "no PEM certificate in the file"));
    }
    let now = x509_parser::time::ASN1Time::now();
    for (i, der) in certs.iter().enumerate() {
        let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| {
            TlsError::new(
                flag,
                path,
                format!("certificate {} is not X.509: {e}", i + 1),
            )
        })?;
        let validity = cert.validity();
        if validity.not_after < now {
            return Err(TlsError::new(
                flag,
                path,
                format!(
                    "certificate {} ({}) expired on {}",
                    i + 1,
                    cert.subject(),
                    validity.not_after
                ),
            ));
        }
        if validity.not_before > now {
            return Err(TlsError::new(
                flag,
                path,
                format!(
                    "certificate {} ({}) is not valid before {}",
                    i + 1,
                    cert.subject(),
                    validity.not_before
                ),
            ));
        }
    }
    Ok(certs)
}

/// A certificate chain and its private key, checked to belong together.
fn certified_key(
    cert_path: &Path,
    cert_pem: &[u8],
    key_path: &Path,
    key_pem: &[u8],
) -> Result<Arc<CertifiedKey>, TlsError> {
    let certs = parse_certs("--tls-cert", cert_path, cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| TlsError::new("--tls-key", key_path, format!("no PEM private key: {e}")))?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| TlsError::new("--tls-key", key_path, format!("unsupported key: {e}")))?;
    let ck = CertifiedKey::new(certs, signer);
    ck.keys_match().map_err(|_| {
        TlsError::new(
            "--tls-key",
            key_path,
            format!(
                "the key does not match the certificate in --tls-cert ({})",
                cert_path.display()
            ),
        )
    })?;
    Ok(Arc::new(ck))
}

/// Serves the current certificate; [`ServerTls::reload`] (and [`ServerTls::reload_now`]) swaps
/// it when the files change.
#[derive(Debug)]
struct Resolver {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        )
    }
}

/// The proxy listener's TLS: the rustls server configuration and what its certificate
/// reloader needs. Cheap to clone.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: tokio_rustls::TlsAcceptor,
    resolver: Arc<Resolver>,
    cert_path: PathBuf,
    key_path: PathBuf,
    /// The file contents last looked at (loaded, or refused), so a change is acted on once.
    seen: Arc<std::sync::Mutex<Seen>>,
    /// Whether clients must present a certificate signed by `--tls-client-ca`.
    pub client_auth: bool,
    pub reload_interval: Duration,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.cert_path)
            .field("key", &self.key_path)
            .field("client_auth", &self.client_auth)
            .finish()
    }
}

/// The certificate and key files as last looked at.
#[derive(Debug)]
struct Seen {
    cert: Vec<u8>,
    key: Vec<u8>,
    /// They were refused (or unreadable, then both empty): not what is served.
    refused: bool,
}

/// What a reload did.
#[derive(Debug, PartialEq, Eq)]
pub enum Reload {
    /// The files are as last seen.
    Unchanged,
    /// A new certificate is served to new connections.
    Loaded,
    /// The new files were refused; the old certificate is still served.
    Refused,
}

impl ServerTls {
    /// Loads `--tls-cert` and `--tls-key` (and `--tls-client-ca`, which makes client
    /// certificates mandatory). ALPN offers `h2` and `http/1.1`; TLS 1.2 and 1.3.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<ServerTls, TlsError> {
        let (cert_pem, key_pem) = (read("--tls-cert", cert)?, read("--tls-key", key)?);
        let ck = certified_key(cert, &cert_pem, key, &key_pem)?;
        let resolver = Arc::new(Resolver {
            current: RwLock::new(ck),
        });
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| TlsError::new("--tls-cert", cert, e.to_string()))?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let pem = read("--tls-client-ca", ca)?;
                let mut roots = RootCertStore::empty();
                for c in parse_certs("--tls-client-ca", ca, &pem)? {
                    roots
                        .add(c)
                        .map_err(|e| TlsError::new("--tls-client-ca", ca, e.to_string()))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()
                        .map_err(|e| TlsError::new("--tls-client-ca", ca, e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(ServerTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            resolver,
            cert_path: cert.to_owned(),
            key_path: key.to_owned(),
            seen: Arc::new(std::sync::Mutex::new(Seen {
                cert: cert_pem,
                key: key_pem,
                refused: false,
            })),
            client_auth: client_ca.is_some(),
            reload_interval: RELOAD_INTERVAL,
        })
    }

    pub fn acceptor(&self) -> &tokio_rustls::TlsAcceptor {
        &self.acceptor
    }

    /// Re-reads the certificate and key files; when they changed and form a valid pair, new
    /// connections get the new certificate (connections already open keep theirs). A bad
    /// pair is refused with a log line and the old certificate kept; files refused once are not
    /// looked at again (or logged) until they change.
    pub fn reload(&self) -> Reload {
        self.reload_files(false)
    }

    /// [`ServerTls::reload`] now, on request (SIGHUP): the same, except that files refused
    /// before are checked and their refusal logged again, so whoever asked sees why. Unchanged
    /// means the files are the pair being served.
    pub fn reload_now(&self) -> Reload {
        self.reload_files(true)
    }

    fn reload_files(&self, asked: bool) -> Reload {
        let files = std::fs::read(&self.cert_path)
            .map_err(|e| ("--tls-cert", e))
            .and_then(|c| {
                Ok((
                    c,
                    std::fs::read(&self.key_path).map_err(|e| ("--tls-key", e))?,
                ))
            });
        let (cert_pem, key_pem) = match files {
            Ok(f) => f,
            Err((flag, e)) => {
                // Mid-rotation a file may be briefly missing: say so once, keep serving.
                let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
                if asked || !seen.cert.is_empty() || !seen.key.is_empty() {
                    *seen = Seen {
                        cert: Vec::new(),
                        key: Vec::new(),
                        refused: true,
                    };
                    tracing::warn!(flag, error = %e, "TLS files not readable; still serving the previous certificate");
                }
                return Reload::Refused;
            }
        };
        {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if seen.cert == cert_pem && seen.key == key_pem && !(asked && seen.refused) {
                return Reload::Unchanged;
            }
            *seen = Seen {
                cert: cert_pem.clone(),
                key: key_pem.clone(),
                refused: true,
            };
        }
        match certified_key(&self.cert_path, &cert_pem, &self.key_path, &key_pem) {
            Ok(ck) => {
                *self
                    .resolver
                    .current
                    .write()
                    .unwrap_or_else(|e| e.into_inner()) = ck;
                self.seen.lock().unwrap_or_else(|e| e.into_inner()).refused = false;
                tracing::info!(cert = %self.cert_path.display(), "TLS certificate reloaded");
                Reload::Loaded
            }
            Err(e) => {
                tracing::warn!(error = %e, "new TLS certificate refused; still serving the previous one");
                Reload::Refused
            }
        }
    }

    /// Checks the files every `reload_interval` until dropped (the caller aborts the task).
    pub fn spawn_reloader(&self) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(this.reload_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let _ = this.reload();
            }
        })
    }
}

/// The subject of a verified client certificate (RFC 4514 style, e.g. `CN=alice, O=Acme`).
pub(crate) fn client_subject(conn: &rustls::ServerConnection) -> Option<Arc<str>> {
    let der = conn.peer_certificates()?.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(Arc::from(cert.subject().to_string()))
}

fn client_builder() -> rustls::ConfigBuilder<ClientConfig, rustls::WantsVerifier> {
    // TLS 1.2 and 1.3 are always supported by the ring provider.
    ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .unwrap_or_else(|_| ClientConfig::builder())
}

/// The client config for HTTPS upstreams: the CA in `upstream_ca` only, or else the
/// platform's roots ([`platform_client_config`]).
pub fn upstream_client_config(upstream_ca: Option<&Path>) -> Result<ClientConfig, TlsError> {
    let Some(ca) = upstream_ca else {
        return Ok(platform_client_config());
    };
    let pem = read("--upstream-ca", ca)?;
    let mut roots = RootCertStore::empty();
    for c in parse_certs("--upstream-ca", ca, &pem)? {
        roots
            .add(c)
            .map_err(|e| TlsError::new("--upstream-ca", ca, e.to_string()))?;
    }
    Ok(client_builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// A client config that trusts no one (for http:// upstreams, where it is never used).
pub(crate) fn no_roots_client_config() -> ClientConfig {
    client_builder()
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth()
}

/// A client config trusting the platform's CA roots, or Mozilla's (built in) when the
/// platform has none (a scratch container).
pub(crate) fn platform_client_config() -> ClientConfig {
    let native = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(native.certs);
    if added == 0 {
        tracing::debug!(errors = ?native.errors, "no platform CA roots; using the built-in Mozilla roots");
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    client_builder()
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// A client connection on the proxy listener: plain TCP or TLS over it.
pub(crate) enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Stream {
    /// The protocol the TLS handshake agreed on by ALPN (`h2`, `http/1.1`), if any.
    pub(crate) fn alpn_protocol(&self) -> Option<&[u8]> {
        match self {
            Stream::Plain(_) => None,
            Stream::Tls(s) => s.get_ref().1.alpn_protocol(),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Why a TLS connection was not established.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AcceptError {
    /// The client spoke plain HTTP; it was answered 400 and closed.
    #[error("plain HTTP on the TLS port")]
    Plaintext,
    /// The handshake did not finish within the header-read timeout.
    #[error("the handshake did not finish within --header-read-timeout")]
    Timeout,
    /// The handshake failed (bad client certificate, no shared protocol, …).
    #[error("handshake: {0}")]
    Handshake(io::Error),
}

impl AcceptError {
    /// The `connection_errors_total` kind.
    pub(crate) fn kind(&self) -> ConnectionErrorKind {
        match self {
            AcceptError::Plaintext => ConnectionErrorKind::PlaintextOnTls,
            AcceptError::Timeout => ConnectionErrorKind::TlsHandshakeTimeout,
            AcceptError::Handshake(_) => ConnectionErrorKind::TlsHandshake,
        }
    }
}

/// The answer to a plain-HTTP request on the TLS port.
const PLAINTEXT_RESPONSE: &[u8] = b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\n\
connection: close\r\ncontent-length: 47\r\n\r\nthis port speaks TLS: use https:// to reach it\n";

/// Accepts TLS on `tcp` within `timeout`. A client whose first byte cannot begin a TLS
/// handshake (a plain-HTTP request) is answered `400` in plain HTTP and closed, not left
/// hanging until the timeout.
pub(crate) async fn accept(
    tls: &ServerTls,
    mut tcp: TcpStream,
    timeout: Duration,
) -> Result<(Stream, Option<Arc<str>>), AcceptError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let handshake = async {
        let mut first = [0u8; 1];
        let n = tcp.peek(&mut first).await.map_err(AcceptError::Handshake)?;
        // 0x16: a TLS handshake record. Anything printable is someone speaking HTTP.
        if n == 1 && first[0] != 0x16 && first[0].is_ascii_graphic() {
            let mut scratch = [0u8; 8192];
            let _ = tcp.read(&mut scratch).await;
            let _ = tcp.write_all(PLAINTEXT_RESPONSE).await;
            let _ = tcp.shutdown().await;
            return Err(AcceptError::Plaintext);
        }
        let stream = tls
            .acceptor
            .accept(tcp)
            .await
            .map_err(AcceptError::Handshake)?;
        let subject = if tls.client_auth {
            client_subject(stream.get_ref().1)
        } else {
            None
        };
        Ok((Stream::Tls(Box::new(stream)), subject))
    };
    match tokio::time::timeout(timeout, handshake).await {
        Ok(r) => r,
        Err(_) => Err(AcceptError::Timeout),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(cn: &str) -> (String, String) {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().unwrap();
        (params.self_signed(&key).unwrap().pem(), key.serialize_pem())
    }

    /// A loaded pair "one" in a folder of its own (`tag`), and a second pair "two" to write.
    struct Reloading {
        dir: std::path::PathBuf,
        cert: std::path::PathBuf,
        key: std::path::PathBuf,
        next: (String, String),
        tls: ServerTls,
    }

    fn reloading(tag: &str) -> Reloading {
        let dir = std::env::temp_dir().join(format!("mcp-reattach-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        let (c1, k1) = pair("one");
        std::fs::write(&cert, &c1).unwrap();
        std::fs::write(&key, &k1).unwrap();
        let tls = ServerTls::load(&cert, &key, None).unwrap();
        Reloading {
            dir,
            cert,
            key,
            next: pair("two"),
            tls,
        }
    }

    #[test]
    fn reload_takes_good_pairs_refuses_bad_ones_once_and_keeps_the_old() {
        let Reloading {
            dir,
            cert,
            key,
            next: (c2, k2),
            tls,
        } = reloading("tls");
        let current = || tls.resolver.current.read().unwrap().cert[0].to_vec();
        let first = current();
        assert_eq!(tls.reload(), Reload::Unchanged);
        std::fs::write(&cert, &c2).unwrap();
        assert_eq!(tls.reload(), Reload::Refused, "key of another certificate");
        assert_eq!(
            tls.reload(),
            Reload::Unchanged,
            "refused once, not on every look"
        );
        assert_eq!(current(), first);
        std::fs::remove_file(&key).unwrap();
        assert_eq!(tls.reload(), Reload::Refused);
        std::fs::write(&key, &k2).unwrap();
        assert_eq!(tls.reload(), Reload::Loaded);
        assert_ne!(current(), first);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn reload_now_says_again_what_it_refused() {
        let Reloading {
            dir,
            cert,
            key,
            next: (c2, k2),
            tls,
        } = reloading("tls-now");
        let current = || tls.resolver.current.read().unwrap().cert[0].to_vec();
        let first = current();
        assert_eq!(tls.reload_now(), Reload::Unchanged);
        std::fs::write(&cert, &c2).unwrap();
        assert_eq!(tls.reload(), Reload::Refused);
        assert_eq!(tls.reload(), Reload::Unchanged, "the periodic look: once");
        assert_eq!(tls.reload_now(), Reload::Refused, "asked: again");
        assert_eq!(tls.reload_now(), Reload::Refused);
        assert_eq!(current(), first);
        std::fs::write(&key, &k2).unwrap();
        assert_eq!(tls.reload_now(), Reload::Loaded);
        assert_ne!(current(), first);
        assert_eq!(tls.reload_now(), Reload::Unchanged);
        assert_eq!(tls.reload(), Reload::Unchanged);
        std::fs::remove_file(&key).unwrap();
        assert_eq!(tls.reload(), Reload::Refused);
        assert_eq!(tls.reload_now(), Reload::Refused);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn plaintext_response_length_is_right() {
        let text = std::str::from_utf8(PLAINTEXT_RESPONSE).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
    }
}
