//! The proxy listener's accept loop: HTTP/1.1 and h2, in the clear or over TLS, one task per
//! connection; an HTTP/1.1 connection, or a single HTTP/2 stream, can be ended by the session
//! layer when its client stalls. Takes a listener and a stop future; the drain that follows is
//! [`crate::shutdown`]'s, the admin listener [`crate::admin`]'s, binding and signals `main`'s,
//! so tests run the real server on `127.0.0.1:0`.

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;

use http::Request;
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Instrument;

use crate::config::Config;
use crate::exchange::{ClientBody, Conn};
use crate::http1::read::{poll_fill, Fill};
use crate::http1::server as h1;
use crate::metrics::ConnectionErrorKind;
use crate::proxy::Gateway;
use crate::shutdown::{self, Draining};

/// Serves an existing [`Gateway`] (tests keep a handle to inspect its sessions).
///
/// When `shutdown` resolves the gateway stops accepting and drains ([`shutdown::drain`], on
/// the [`Draining`] handle the future resolves to): every connection finishes its in-flight
/// response (keep-alive off), clients of standalone GET streams are told to resume elsewhere
/// at once, POST-started streams run until `drain_timeout` (or until a quick shutdown hurries
/// the drain), then the remaining streams end with a `retry:` hint and this returns.
/// [`crate::shutdown::Shutdown::stop_accepting`] makes the `shutdown` future main uses; a
/// test that never stops passes `std::future::pending()`.
pub async fn serve_gateway(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = Draining> + Send + 'static,
) -> std::io::Result<()> {
    let _sweeper = AbortOnDrop(gateway.registry().spawn_sweeper());
    let _reaper = AbortOnDrop(gateway.spawn_upstream_reaper());
    let cfg = gateway.config().clone();
    let _reloader = cfg.tls.as_ref().map(|t| AbortOnDrop(t.spawn_reloader()));
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    let inherited = set_accepted_options(&listener);
    let graceful = GracefulShutdown::new();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::pin!(shutdown);
    let draining = loop {
        // At --max-connections, stop accepting: new connections wait in the listen backlog.
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                // Never: the semaphore is not closed. Serve nothing more until the stop.
                Err(_) => break (&mut shutdown).await,
            },
            draining = &mut shutdown => break draining,
        };
        let (tcp, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of fds and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            draining = &mut shutdown => break draining,
        };
        if !inherited {
            set_socket_options(socket2::SockRef::from(&tcp));
        }
        let gateway = gateway.clone();
        let watcher = graceful.watcher();
        let stop = stop_rx.clone();
        let metrics = gateway.registry().metrics().clone();
        metrics.connections_accepted.inc();
        metrics.connections.inc();
        // One span per connection: every request span (and HTTP/2 stream task) nests in it.
        let span = tracing::debug_span!("connection", %remote);
        let task = async move {
            // Held until the connection ends (by reference: moved, it would be here twice).
            let _slot = &slot;
            let cfg = gateway.config();
            // TLS first when configured; the handshake counts against --header-read-timeout.
            let (io, read, client_subject, version) = match &cfg.tls {
                None => {
                    // Which HTTP the connection speaks, from its first bytes, peeked (see
                    // `sniff`); within --header-read-timeout like the head itself.
                    let mut tcp = tcp;
                    match tokio::time::timeout(cfg.header_read_timeout, sniff(&mut tcp)).await {
                        Ok(Some((v, read))) => (crate::tls::Stream::Plain(tcp), read, None, v),
                        Ok(None) => {
                            metrics.connection_error(ConnectionErrorKind::ClientGone);
                            metrics.connections.dec();
                            return;
                        }
                        Err(_) => {
                            metrics.connection_error(ConnectionErrorKind::HeaderTimeout);
                            tracing::debug!(%remote, "no request within --header-read-timeout: closed");
                            metrics.connections.dec();
                            return;
                        }
                    }
                }
                Some(tls) => {
                    // Boxed: the handshake's state is large, and inline it would size every
                    // connection's task (plain ones too) for as long as the connection lives
                    // (bench/notes.md, "Figure: boxed futures").
                    match Box::pin(crate::tls::accept(tls, tcp, cfg.header_read_timeout)).await {
                        // ALPN's choice; without one, read from the stream as on a plaintext
                        // port, so every HTTP/1.1 request is the gateway's own engine's.
                        Ok((mut io, subject)) => match io.alpn_protocol() {
                            Some(b"h2") => (io, BytesMut::new(), subject, Version::H2),
                            Some(_) => (io, BytesMut::new(), subject, Version::H1),
                            None => {
                                let sniffed =
                                    tokio::time::timeout(cfg.header_read_timeout, sniff(&mut io))
                                        .await;
                                match sniffed {
                                    Ok(Some((v, read))) => (io, read, subject, v),
                                    Ok(None) => {
                                        metrics.connection_error(ConnectionErrorKind::ClientGone);
                                        metrics.connections.dec();
                                        return;
                                    }
                                    Err(_) => {
                                        metrics
                                            .connection_error(ConnectionErrorKind::HeaderTimeout);
                                        tracing::debug!(%remote, "no request within --header-read-timeout: closed");
                                        metrics.connections.dec();
                                        return;
                                    }
                                }
                            }
                        },
                        Err(e) => {
                            metrics.connection_error(e.kind());
                            tracing::debug!(%remote, error = %e, "TLS connection not established");
                            metrics.connections.dec();
                            return;
                        }
                    }
                }
            };
            let kill = Arc::new(Notify::new());
            let exec = StreamExec {
                pending: Arc::default(),
                metrics: metrics.clone(),
            };
            let conn_kill = kill.clone();
            // What the connection has in flight: until a first request head arrives, it has
            // --header-read-timeout (on every protocol: hyper's own header timer covers
            // HTTP/1.1 heads only after hyper-util's version sniff, and HTTP/2 has none);
            // after that, --idle-timeout whenever nothing is in flight.
            let activity = Arc::new(Activity::new());
            let seen = activity.clone();
            let svc_exec = exec.clone();
            let svc_gateway = gateway.clone();
            let serve_req = move |req: Request<ClientBody>| {
                let in_flight = seen.begin();
                // HTTP/1.1 has one stream per connection: a stall closes the connection. On
                // HTTP/2 a stall ends only its own stream (the stream's task is dropped, h2
                // resets it); the other streams on the connection keep flowing.
                let kill = if req.version() == http::Version::HTTP_2 {
                    svc_exec.next_stream()
                } else {
                    conn_kill.clone()
                };
                let handled = svc_gateway.clone().handle(
                    req,
                    Conn {
                        remote,
                        kill,
                        client_subject: client_subject.clone(),
                    },
                );
                // Boxed: the connection keeps room for the service's future as long as it
                // lives if inline; boxed, only while a request is being answered. The
                // handler's future itself is boxed, not an async block awaiting it (which
                // held it twice over, copied into the box per request: bench/notes.md,
                // "Figure: boxed futures").
                Track {
                    handled: Box::pin(handled),
                    in_flight: Some(in_flight),
                }
            };
            let ending = Ending {
                kill: &kill,
                activity: &activity,
                metrics: &metrics,
                remote: &remote,
                cfg,
            };
            // One engine per protocol: HTTP/1.1 is the gateway's own, inline (the common
            // case); HTTP/2 is hyper's, boxed (its connection is the larger).
            match version {
                // HTTP/1.1: the gateway's own (see `h1`). The watcher is held until the
                // connection ends so the drain counts it; the drain's stop arrives as `stop`.
                Version::H1 => {
                    let _counted = watcher;
                    let own = move |req: Request<crate::exchange::ReqBody>| {
                        serve_req(req.map(ClientBody::Own))
                    };
                    let conn = h1::serve(io, read, h1_settings(cfg), own, stop);
                    ending.serve(pin!(conn)).await
                }
                // HTTP/2: hyper's, boxed.
                Version::H2 => {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        serve_req(req.map(ClientBody::Hyper))
                    });
                    let io = TokioIo::new(Prefixed { read, io });
                    Box::pin(async move {
                        let conn = http2_builder(cfg, exec).serve_connection(io, svc);
                        ending.serve(pin!(watcher.watch(conn))).await
                    })
                    .await
                }
            }
            metrics.connections.dec();
        };
        // Boxed: spawning moves a future by value more than once.
        tokio::spawn(Box::pin(task.instrument(span)));
    };
    drop(listener);
    // Every HTTP/1.1 connection finishes the response in flight and closes (hyper's are told
    // by the drain's graceful shutdown).
    let _ = stop_tx.send(true);
    gateway.drain_followers();
    let hand_over = gateway.hand_over();
    shutdown::drain_then(
        gateway.registry(),
        graceful,
        cfg.drain_timeout,
        draining,
        hand_over,
    )
    .await;
    Ok(())
}

/// What one client connection has in flight: requests being served and responses still being
/// written (a streaming SSE body included).
struct Activity {
    /// Requests the connection has begun.
    requests: AtomicU64,
    in_flight: AtomicUsize,
    /// Notified when nothing is in flight any more.
    quiet: Notify,
    /// Notified when the first request begins.
    began: Notify,
    /// When the connection was accepted, and when a request last ended after it (nanoseconds
    /// since `opened`): the idle clock runs from the later. Kept as a time rather than armed
    /// as a timer per request: the idle watch sleeps until the deadline it last saw, and only
    /// then looks whether it moved (a short call armed and cancelled a timer each).
    opened: Instant,
    last_end: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            requests: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            quiet: Notify::new(),
            began: Notify::new(),
            opened: Instant::now(),
            last_end: AtomicU64::new(0),
        }
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        let first = self.requests.fetch_add(1, Ordering::AcqRel) == 0;
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        if first {
            self.began.notify_one();
        }
        InFlight(self.clone())
    }

    /// When the connection is idle from, if nothing begins: the end of its last request (its
    /// acceptance before any).
    fn quiet_since(&self) -> Instant {
        let ns = self.last_end.load(Ordering::Acquire);
        self.opened + Duration::from_nanos(ns)
    }
}

/// One request in flight until its response is written (it lives in the response body).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        // Before the count falls: whoever sees nothing in flight sees this end too.
        let ns = u64::try_from(a.opened.elapsed().as_nanos()).unwrap_or(u64::MAX);
        a.last_end.fetch_max(ns, Ordering::AcqRel);
        if a.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            a.quiet.notify_one();
        }
    }
}

/// The future of one request's response: the handler's, its body then [`Tracked`].
struct Track<F> {
    handled: Pin<Box<F>>,
    in_flight: Option<InFlight>,
}

impl<F, B> Future for Track<F>
where
    F: Future<Output = Result<http::Response<B>, std::convert::Infallible>>,
{
    type Output = Result<http::Response<Tracked<B>>, std::convert::Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Ok(resp) = std::task::ready!(self.handled.as_mut().poll(cx));
        let in_flight = self
            .in_flight
            .take()
            .expect("Track polled after completion");
        Poll::Ready(Ok(resp.map(|body| Tracked {
            body,
            _in_flight: in_flight,
        })))
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request [`InFlight`] until hyper is done with it.
    struct Tracked<B> {
        #[pin]
        body: B,
        _in_flight: InFlight,
    }
}

impl<B: hyper::body::Body> hyper::body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        self.project().body.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// How a served connection ends besides on its own: killed as stalled, or idle too long.
/// Held by reference: this is in every connection's task for as long as it lives.
struct Ending<'a> {
    kill: &'a Notify,
    activity: &'a Activity,
    metrics: &'a crate::metrics::Metrics,
    remote: &'a std::net::SocketAddr,
    cfg: &'a Config,
}

impl<'a> Ending<'a> {
    /// Runs `serving` (a watched connection) until it ends, the connection's kill switch
    /// fires, or it idles out. Pinned where it was made: the connection is the largest part of
    /// its task and is not moved again. (Not an `async fn`: its arguments would be in its
    /// future twice.)
    #[allow(clippy::manual_async_fn)] // see above: the layout, not the syntax
    fn serve<E: ServedError>(
        self,
        serving: Pin<&'a mut impl Future<Output = Result<(), E>>>,
    ) -> impl Future<Output = ()> + 'a {
        async move {
            tokio::select! {
                res = serving => {
                    if let Err(e) = res {
                        if let Some((status, reason)) = e.refused_head() {
                            crate::access::head_refused(self.remote.ip(), status, reason);
                        }
                        self.metrics.connection_error(e.kind());
                        tracing::debug!(error = %e, "client connection ended with an error");
                    }
                }
                () = self.kill.notified() => {
                    self.metrics.stalled_closes.inc();
                    tracing::info!(remote = %self.remote, "closed a stalled client connection");
                }
                first = idle(self.activity, self.cfg.header_read_timeout, self.cfg.idle_timeout) => {
                    if first {
                        self.metrics.connection_error(ConnectionErrorKind::HeaderTimeout);
                        tracing::debug!(remote = %self.remote, "no request within --header-read-timeout: closed");
                    } else {
                        tracing::debug!(remote = %self.remote, "nothing in flight for --idle-timeout: closed");
                    }
                }
            }
        }
    }
}

/// The error a served connection ended with: hyper's, or hyper-util's boxed one.
trait ServedError: std::fmt::Display {
    /// The `connection_errors_total` kind.
    fn kind(&self) -> ConnectionErrorKind;

    /// The request head the gateway's HTTP/1.1 refused (answered 400 or 431: its status and
    /// reason), which gets an access line; hyper's refusals get none.
    fn refused_head(&self) -> Option<(http::StatusCode, &'static str)> {
        None
    }
}

impl ServedError for crate::http1::Error {
    fn kind(&self) -> ConnectionErrorKind {
        self.connection_error()
    }

    fn refused_head(&self) -> Option<(http::StatusCode, &'static str)> {
        crate::http1::Error::refused_head(self).map(|status| (status, self.reason()))
    }
}

impl ServedError for hyper::Error {
    fn kind(&self) -> ConnectionErrorKind {
        classify(self)
    }
}

impl ServedError for Box<dyn std::error::Error + Send + Sync> {
    fn kind(&self) -> ConnectionErrorKind {
        classify(&**self)
    }
}

/// Resolves once the connection has had nothing in flight for `idle`, or before its first
/// request for `first` (then `true`).
async fn idle(activity: &Activity, first: Duration, idle: Duration) -> bool {
    loop {
        while activity.in_flight.load(Ordering::Acquire) > 0 {
            activity.quiet.notified().await;
        }
        let seen = activity.requests.load(Ordering::Acquire);
        if seen == 0 {
            // Before the first request: its beginning wakes the watch, whose deadline may
            // then come sooner (--idle-timeout from the request's end).
            tokio::select! {
                () = tokio::time::sleep_until(activity.opened + first) => {
                    if activity.requests.load(Ordering::Acquire) == 0 {
                        return true;
                    }
                }
                () = activity.began.notified() => {}
            }
            continue;
        }
        tokio::time::sleep_until(activity.quiet_since() + idle).await;
        // Idle all along only if nothing began since and nothing ended within the limit
        // (else the clock starts again from the end of what did).
        if activity.requests.load(Ordering::Acquire) == seen
            && activity.in_flight.load(Ordering::Acquire) == 0
            && Instant::now() >= activity.quiet_since() + idle
        {
            return false;
        }
    }
}

/// The per-connection protocol settings (HTTP/1.1 and h2c), running HTTP/2 streams on `exec`.
/// The HTTP a plaintext connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    H1,
    H2,
}

/// What an HTTP/2 connection opens with (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Which HTTP a plaintext connection speaks, from its first bytes: HTTP/2 if they are its
/// preface, else HTTP/1.1; with the bytes read, which the connection's reader takes first.
/// `None`: the client closed (or the socket failed) first.
///
/// Read, not peeked: a peek is a `recvfrom` of its own before the read that takes the same
/// bytes again, and one more when the connection is accepted before its first bytes arrive
/// (most are); the gateway's HTTP/1.1 starts from the bytes read here, and hyper's HTTP/2
/// reads them again first ([`Prefixed`]).
async fn sniff<IO: AsyncRead + Unpin>(io: &mut IO) -> Option<(Version, BytesMut)> {
    let mut read = BytesMut::new();
    loop {
        let n = poll_fn(|cx| poll_fill(&mut *io, cx, &mut read, Fill::Append))
            .await
            .ok()?;
        if n == 0 {
            return None;
        }
        let k = read.len().min(H2_PREFACE.len());
        if read[..k] != H2_PREFACE[..k] {
            return Some((Version::H1, read));
        }
        if k == H2_PREFACE.len() {
            return Some((Version::H2, read));
        }
        // A prefix of the preface so far: wait for more.
    }
}

/// A transport some of whose bytes were already read: `read` is read again first.
struct Prefixed<IO> {
    read: BytesMut,
    io: IO,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Prefixed<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.read.is_empty() {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        let n = this.read.len().min(buf.remaining());
        buf.put_slice(&this.read.split_to(n));
        if this.read.is_empty() {
            // Not kept for the connection's life.
            this.read = BytesMut::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Prefixed<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The HTTP/2 settings, on hyper's builder.
macro_rules! http2_settings {
    ($builder:expr, $cfg:expr) => {{
        let cfg: &Config = $cfg;
        $builder
            .timer(TokioTimer::new())
            // Pings find a peer that went away without a word (its streams then detach).
            .keep_alive_interval(cfg.keepalive)
            .keep_alive_timeout(H2_PING_TIMEOUT)
            .max_header_list_size(u32::try_from(cfg.max_header_bytes).unwrap_or(u32::MAX));
    }};
}

/// The gateway's own HTTP/1.1's bounds.
fn h1_settings(cfg: &Config) -> h1::Settings {
    h1::Settings {
        max_head_bytes: cfg
            .max_header_bytes
            .max(crate::config::MIN_HEADER_BYTES as usize),
        max_headers: cfg.max_headers,
        header_read_timeout: cfg.header_read_timeout,
    }
}

/// HTTP/2, its streams run on `exec`.
fn http2_builder(cfg: &Config, exec: StreamExec) -> http2::Builder<StreamExec> {
    let mut builder = http2::Builder::new(exec);
    http2_settings!(builder, cfg);
    builder
}

/// Runs one connection's HTTP/2 streams, each as its own task that the session layer can end
/// alone: hyper calls the service and hands the resulting stream task to the executor in the
/// same step on the connection's task, so the kill switch the service made for that request
/// ([`StreamExec::next_stream`]) is the one waiting in `pending` when the task arrives.
#[derive(Clone)]
struct StreamExec {
    pending: Arc<std::sync::Mutex<Option<Arc<Notify>>>>,
    metrics: Arc<crate::metrics::Metrics>,
}

impl StreamExec {
    /// A kill switch for the HTTP/2 stream whose request is being handed to the service now.
    fn next_stream(&self) -> Arc<Notify> {
        let kill = Arc::new(Notify::new());
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(kill.clone());
        kill
    }
}

impl<F> hyper::rt::Executor<F> for StreamExec
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        let kill = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match kill {
            Some(kill) => {
                let metrics = self.metrics.clone();
                let task = async move {
                    tokio::select! {
                        () = fut => {}
                        () = kill.notified() => {
                            metrics.stalled_closes.inc();
                            // Dropping the stream's task drops its send half: h2 resets
                            // the stream (RST_STREAM) and the body's drop detaches it.
                            tracing::info!("closed a stalled HTTP/2 stream");
                        }
                    }
                };
                // Called on the connection's task: the stream stays in its span.
                tokio::spawn(task.in_current_span());
            }
            None => {
                tokio::spawn(fut.in_current_span());
            }
        }
    }
}

/// How long an HTTP/2 ping may go unanswered before the connection is closed.
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Bytes of written-but-unsent data the kernel keeps per client socket. Flow control wants
/// the backlog of a slow client in the session's window (protected, resumable), not in a
/// kernel queue that a cut loses; hyper stops polling the body once this much is queued.
const NOTSENT_LOWAT: u32 = 16 * 1024;

/// `TCP_NODELAY` (answers go out as written) and `TCP_NOTSENT_LOWAT` (see [`NOTSENT_LOWAT`])
/// on a client socket, or on the listener whose accepted sockets inherit them.
fn set_socket_options(sock: socket2::SockRef<'_>) {
    let _ = sock.set_tcp_nodelay(true);
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Err(e) = sock.set_tcp_notsent_lowat(NOTSENT_LOWAT) {
        tracing::debug!(error = %e, "TCP_NOTSENT_LOWAT not set");
    }
}

/// Sets the client sockets' options once, on the listener, where accepted sockets inherit
/// them (Linux copies a listener's TCP options into each socket it accepts): two
/// `setsockopt` calls fewer per connection. Returns whether they are inherited; elsewhere
/// each connection sets its own.
fn set_accepted_options(listener: &TcpListener) -> bool {
    if cfg!(any(target_os = "linux", target_os = "android")) {
        set_socket_options(socket2::SockRef::from(listener));
        true
    } else {
        false
    }
}

/// The kind of error a client connection ended with, for the metric.
fn classify(e: &(dyn std::error::Error + 'static)) -> ConnectionErrorKind {
    match e.downcast_ref::<hyper::Error>() {
        Some(h) if h.is_timeout() => ConnectionErrorKind::HeaderTimeout,
        Some(h) if h.is_parse_too_large() => ConnectionErrorKind::HeadTooLarge,
        Some(h) if h.is_incomplete_message() || h.is_canceled() => ConnectionErrorKind::ClientGone,
        _ => ConnectionErrorKind::Other,
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// When `idle` resolved (time since the start, paused clock) and what it said, while
    /// `script` begins and ends requests at its times.
    async fn idle_outcome(script: &[(u64, u64)]) -> (Duration, bool) {
        idle_outcome_with(script, 3, 10).await
    }

    async fn idle_outcome_with(script: &[(u64, u64)], first: u64, idle_s: u64) -> (Duration, bool) {
        let t0 = Instant::now();
        let activity = Arc::new(Activity::new());
        for &(begin, end) in script {
            let a = activity.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(t0 + Duration::from_secs(begin)).await;
                let in_flight = a.begin();
                tokio::time::sleep_until(t0 + Duration::from_secs(end)).await;
                drop(in_flight);
            });
        }
        let first = idle(
            &activity,
            Duration::from_secs(first),
            Duration::from_secs(idle_s),
        )
        .await;
        (t0.elapsed(), first)
    }

    #[tokio::test(start_paused = true)]
    async fn the_idle_clock_runs_from_the_end_of_the_last_request() {
        let secs = |(d, first): (Duration, bool)| (d.as_secs(), first);
        // No request: --header-read-timeout after the connection opened.
        assert_eq!(secs(idle_outcome(&[]).await), (3, true));
        // A request before it: --idle-timeout after its end, not after its start.
        assert_eq!(secs(idle_outcome(&[(1, 2)]).await), (12, false));
        // Longer than the idle timeout itself: counted from its end.
        assert_eq!(secs(idle_outcome(&[(1, 30)]).await), (40, false));
        // One beginning while the clock runs, another overlapping it: from the last end.
        assert_eq!(
            secs(idle_outcome(&[(1, 2), (9, 15), (14, 20)]).await),
            (30, false)
        );
        // Ending just before the deadline it would have missed.
        assert_eq!(secs(idle_outcome(&[(1, 2), (11, 12)]).await), (22, false));
        // An idle timeout shorter than the first request's: from that request's end, not
        // at the first-request deadline.
        assert_eq!(secs(idle_outcome_with(&[(1, 2)], 10, 1).await), (3, false));
        assert_eq!(secs(idle_outcome_with(&[], 10, 1).await), (10, true));
    }

    /// A connected pair on loopback: the client's end and the server's.
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        (client, server)
    }

    /// Sends `pieces` with a pause between them; returns what `sniff` made of them.
    async fn sniffed(pieces: &[&[u8]]) -> Option<Version> {
        let (mut client, mut server) = pair().await;
        let sent: Vec<u8> = pieces.concat();
        let pieces: Vec<Vec<u8>> = pieces.iter().map(|p| p.to_vec()).collect();
        let writer = tokio::spawn(async move {
            for p in pieces {
                client.write_all(&p).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            client
        });
        let sniffed = tokio::time::timeout(Duration::from_secs(5), sniff(&mut server))
            .await
            .expect("sniff decides within the pauses");
        let client = writer.await.unwrap();
        let (v, read) = sniffed?;
        // What it read, then the rest from the socket: every byte sent, once, in order.
        let mut io = Prefixed { read, io: server };
        drop(client);
        let mut all = Vec::new();
        io.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, sent);
        Some(v)
    }

    #[tokio::test]
    async fn the_h2_preface_is_h2_even_when_it_comes_in_pieces() {
        assert_eq!(sniffed(&[H2_PREFACE]).await, Some(Version::H2));
        assert_eq!(
            sniffed(&[b"PRI * HT", b"TP/2.0\r\n\r\nSM\r\n\r\n"]).await,
            Some(Version::H2)
        );
    }

    #[tokio::test]
    async fn anything_else_is_http1_as_soon_as_it_differs() {
        assert_eq!(
            sniffed(&[b"POST /mcp HTTP/1.1\r\n"]).await,
            Some(Version::H1)
        );
        // One byte that is also the preface's first, then the rest of an HTTP/1.1 head.
        assert_eq!(
            sniffed(&[b"P", b"OST /mcp HTTP/1.1\r\n"]).await,
            Some(Version::H1)
        );
        assert_eq!(sniffed(&[b"GET / HTTP/1.1\r\n"]).await, Some(Version::H1));
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[tokio::test]
    async fn accepted_sockets_inherit_the_listeners_options() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        assert!(set_accepted_options(&l));
        let _client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        let sock = socket2::SockRef::from(&server);
        assert!(sock.tcp_nodelay().unwrap());
        assert_eq!(sock.tcp_notsent_lowat().unwrap(), NOTSENT_LOWAT);
    }

    #[tokio::test]
    async fn a_client_that_closes_first_is_none() {
        let (client, mut server) = pair().await;
        drop(client);
        assert_eq!(sniff(&mut server).await, None);
    }
}
