//! Accept loops: the proxy listener (HTTP/1.1 and h2, in the clear or over TLS, one task per
//! connection, each able to be closed by the session layer when its client stalls) and the admin listener
//! (`/healthz`, `/readyz`). Takes listeners and a shutdown future; binding and signals are
//! `main`'s job, so tests run the real server on `127.0.0.1:0`.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use crate::config::Config;
use crate::proxy::{Conn, Gateway};

/// How long an admin client may take to send a request's headers.
const ADMIN_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the gateway on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_gateway(listener, Gateway::new(config), shutdown).await
}

/// Serves an existing [`Gateway`] (tests keep a handle to inspect its sessions).
///
/// When `shutdown` resolves the gateway drains: it stops accepting, lets every connection
/// finish its in-flight response (keep-alive off), tells clients of standalone GET streams to
/// resume elsewhere at once, lets POST-started streams run until `drain_timeout` (or until
/// [`Gateway::hurry`]), then ends the remaining streams with a `retry:` hint and returns.
pub async fn serve_gateway(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let _sweeper = AbortOnDrop(gateway.registry().spawn_sweeper());
    let cfg = gateway.config().clone();
    let _reloader = cfg.tls.as_ref().map(|t| AbortOnDrop(t.spawn_reloader()));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        .max_headers(cfg.max_headers)
        .max_buf_size(cfg.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(cfg.max_header_bytes).unwrap_or(u32::MAX));
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    let builder = Arc::new(builder);
    let (drain_tx, drain_rx) = watch::channel(false);
    let live = Arc::new(Live::default());
    tokio::pin!(shutdown);
    loop {
        // At --max-connections, stop accepting: new connections wait in the listen backlog.
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            () = &mut shutdown => break,
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
            () = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        limit_unsent(&tcp);
        let gateway = gateway.clone();
        let builder = builder.clone();
        let mut drain = drain_rx.clone();
        let guard = live.enter();
        let metrics = gateway.registry().metrics().clone();
        metrics.connections_accepted.inc();
        metrics.connections.inc();
        tokio::spawn(async move {
            let _guard = guard;
            let _slot = slot;
            // TLS first when configured; the handshake counts against --header-read-timeout.
            let (io, client_subject) = match &gateway.config().tls {
                None => (crate::tls::Stream::Plain(tcp), None),
                Some(tls) => {
                    let timeout = gateway.config().header_read_timeout;
                    match crate::tls::accept(tls, tcp, timeout).await {
                        Ok(accepted) => accepted,
                        Err(e) => {
                            metrics.connection_error(e.kind());
                            tracing::debug!(%remote, error = ?e, "TLS connection not established");
                            metrics.connections.dec();
                            return;
                        }
                    }
                }
            };
            let kill = Arc::new(Notify::new());
            let conn = Conn {
                remote,
                kill: kill.clone(),
                client_subject,
            };
            let svc =
                service_fn(move |req: Request<Incoming>| gateway.clone().handle(req, conn.clone()));
            let serving = builder.serve_connection(TokioIo::new(io), svc);
            tokio::pin!(serving);
            let mut draining = false;
            loop {
                tokio::select! {
                    res = serving.as_mut() => {
                        if let Err(e) = res {
                            metrics.connection_error(classify(&*e));
                            tracing::debug!(error = %e, "client connection ended with an error");
                        }
                        break;
                    }
                    () = kill.notified() => {
                        tracing::info!(%remote, "closed a stalled client connection");
                        break;
                    }
                    changed = drain.changed(), if !draining => {
                        draining = true;
                        if changed.is_ok() {
                            serving.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
            metrics.connections.dec();
        });
    }
    drop(listener);
    gateway
        .registry()
        .metrics()
        .drain_started(cfg.drain_timeout + FINAL_FLUSH);
    tracing::info!(connections = live.count(), drain_timeout = ?cfg.drain_timeout, "draining");
    let _ = drain_tx.send(true);
    // Standalone GET streams never end on their own: send those clients elsewhere now.
    gateway.registry().end_clients(true);
    tokio::select! {
        () = live.idle() => {}
        () = tokio::time::sleep(cfg.drain_timeout) => {}
        () = gateway.hurried() => {}
    }
    if live.count() > 0 {
        tracing::info!(
            connections = live.count(),
            "drain deadline: ending remaining streams"
        );
        gateway.registry().end_clients(false);
        let _ = tokio::time::timeout(FINAL_FLUSH, live.idle()).await;
    }
    tracing::info!(connections = live.count(), "drained");
    Ok(())
}

/// Bytes of written-but-unsent data the kernel keeps per client socket. Flow control wants
/// the backlog of a slow client in the session's window (protected, resumable), not in a
/// kernel queue that a cut loses; hyper stops polling the body once this much is queued.
const NOTSENT_LOWAT: u32 = 16 * 1024;

#[cfg(any(target_os = "linux", target_os = "android"))]
fn limit_unsent(tcp: &tokio::net::TcpStream) {
    if let Err(e) = socket2::SockRef::from(tcp).set_tcp_notsent_lowat(NOTSENT_LOWAT) {
        tracing::debug!(error = %e, "TCP_NOTSENT_LOWAT not set");
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn limit_unsent(_tcp: &tokio::net::TcpStream) {}

/// The kind of error a client connection ended with, for the metric.
fn classify(e: &(dyn std::error::Error + 'static)) -> &'static str {
    match e.downcast_ref::<hyper::Error>() {
        Some(h) if h.is_timeout() => "header_timeout",
        Some(h) if h.is_parse_too_large() => "head_too_large",
        Some(h) if h.is_incomplete_message() || h.is_canceled() => "client_gone",
        _ => "other",
    }
}

/// How long the last `retry:` hints get to reach clients after the drain deadline.
const FINAL_FLUSH: Duration = Duration::from_secs(2);

/// Counts live client connections, so draining can wait for the last one.
#[derive(Debug, Default)]
struct Live {
    count: AtomicUsize,
    zero: Notify,
}

struct LiveGuard(Arc<Live>);

impl Live {
    fn enter(self: &Arc<Self>) -> LiveGuard {
        self.count.fetch_add(1, Ordering::SeqCst);
        LiveGuard(self.clone())
    }

    fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    async fn idle(&self) {
        loop {
            let notified = self.zero.notified();
            if self.count() == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.zero.notify_waiters();
        }
    }
}

/// Liveness and readiness state shared with the admin listener.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
}

impl Health {
    pub fn new() -> Arc<Health> {
        Arc::new(Health {
            ready: AtomicBool::new(true),
        })
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until `shutdown` resolves.
pub async fn serve_admin(
    listener: TcpListener,
    health: Arc<Health>,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tokio::pin!(shutdown);
    loop {
        let (tcp, _) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(_) => { tokio::time::sleep(Duration::from_millis(50)).await; continue; }
            },
            () = &mut shutdown => return Ok(()),
        };
        let health = health.clone();
        let gateway = gateway.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let health = health.clone();
                let gateway = gateway.clone();
                async move { Ok::<_, Infallible>(admin_response(&req, &health, &gateway)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(ADMIN_HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
    }
}

fn admin_response(
    req: &Request<Incoming>,
    health: &Health,
    gateway: &Gateway,
) -> Response<Full<Bytes>> {
    let get = matches!(*req.method(), Method::GET | Method::HEAD);
    let (status, content_type, body) = match req.uri().path() {
        "/healthz" if get => (StatusCode::OK, "text/plain", Bytes::from_static(b"ok\n")),
        "/readyz" if get && health.is_ready() => {
            (StatusCode::OK, "text/plain", Bytes::from_static(b"ready\n"))
        }
        "/readyz" if get => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            Bytes::from_static(b"draining\n"),
        ),
        "/metrics" if get => {
            let open_metrics = req.headers().get_all(http::header::ACCEPT).iter().any(|v| {
                v.to_str()
                    .is_ok_and(|v| v.contains("application/openmetrics-text"))
            });
            let text = gateway.render_metrics();
            if open_metrics {
                (
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    Bytes::from(text),
                )
            } else {
                let classic = crate::metrics::to_prometheus_text(&text);
                (
                    StatusCode::OK,
                    "text/plain; version=0.0.4; charset=utf-8",
                    Bytes::from(classic),
                )
            }
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            Bytes::from_static(b"not found\n"),
        ),
    };
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    r
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
