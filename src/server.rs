//! Accept loops: the proxy listener (HTTP/1.1 and h2, in the clear or over TLS, one task per
//! connection; an HTTP/1.1 connection, or a single HTTP/2 stream, can be ended by the session
//! layer when its client stalls) and the admin listener (`/healthz`, `/readyz`, `/metrics`).
//! Takes listeners and a shutdown future; the drain is [`crate::shutdown`]'s, binding and
//! signals are `main`'s, so tests run the real server on `127.0.0.1:0`.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tracing::Instrument;

use crate::config::Config;
use crate::proxy::{Conn, Gateway};
use crate::shutdown;

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
/// When `shutdown` resolves the gateway stops accepting and drains ([`shutdown::drain`]):
/// every connection finishes its in-flight response (keep-alive off), clients of standalone
/// GET streams are told to resume elsewhere at once, POST-started streams run until
/// `drain_timeout` (or until [`Gateway::hurry`]), then the remaining streams end with a
/// `retry:` hint and this returns. [`crate::shutdown::Shutdown::stop_accepting`] makes the
/// `shutdown` future main uses.
pub async fn serve_gateway(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let _sweeper = AbortOnDrop(gateway.registry().spawn_sweeper());
    let cfg = gateway.config().clone();
    let _reloader = cfg.tls.as_ref().map(|t| AbortOnDrop(t.spawn_reloader()));
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    let graceful = GracefulShutdown::new();
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
        let cfg = cfg.clone();
        let watcher = graceful.watcher();
        let metrics = gateway.registry().metrics().clone();
        metrics.connections_accepted.inc();
        metrics.connections.inc();
        // One span per connection: every request span (and HTTP/2 stream task) nests in it.
        let span = tracing::debug_span!("connection", %remote);
        let task = async move {
            let _slot = slot;
            // TLS first when configured; the handshake counts against --header-read-timeout.
            let (io, client_subject) = match &gateway.config().tls {
                None => (crate::tls::Stream::Plain(tcp), None),
                Some(tls) => {
                    let timeout = gateway.config().header_read_timeout;
                    // Boxed: the handshake's state is ~8 KB, and inline it would size every
                    // connection's task (plain ones too) for as long as the connection lives.
                    match Box::pin(crate::tls::accept(tls, tcp, timeout)).await {
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
            let exec = StreamExec {
                pending: Arc::default(),
                metrics: metrics.clone(),
            };
            let builder = connection_builder(&cfg, exec.clone());
            let conn_kill = kill.clone();
            let svc = service_fn(move |req: Request<Incoming>| {
                // HTTP/1.1 has one stream per connection: a stall closes the connection. On
                // HTTP/2 a stall ends only its own stream (the stream's task is dropped, h2
                // resets it); the other streams on the connection keep flowing.
                let kill = if req.version() == http::Version::HTTP_2 {
                    exec.next_stream()
                } else {
                    conn_kill.clone()
                };
                gateway.clone().handle(
                    req,
                    Conn {
                        remote,
                        kill,
                        client_subject: client_subject.clone(),
                    },
                )
            });
            // Watched: the drain tells it to finish gracefully and waits for it.
            let serving = watcher.watch(builder.serve_connection(TokioIo::new(io), svc));
            tokio::select! {
                res = serving => {
                    if let Err(e) = res {
                        metrics.connection_error(classify(&*e));
                        tracing::debug!(error = %e, "client connection ended with an error");
                    }
                }
                () = kill.notified() => {
                    metrics.stalled_closes.inc();
                    tracing::info!(%remote, "closed a stalled client connection");
                }
            }
            metrics.connections.dec();
        };
        // Boxed: spawning moves a future by value more than once, and this one is ~2 KB.
        tokio::spawn(Box::pin(task.instrument(span)));
    }
    drop(listener);
    shutdown::drain(&gateway, graceful, cfg.drain_timeout).await;
    Ok(())
}

/// The per-connection protocol settings (HTTP/1.1 and h2c), running HTTP/2 streams on `exec`.
fn connection_builder(cfg: &Config, exec: StreamExec) -> auto::Builder<StreamExec> {
    let mut builder = auto::Builder::new(exec);
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
