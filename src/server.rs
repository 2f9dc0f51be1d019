//! Accept loops: the proxy listener (HTTP/1.1 and h2c, one task per connection, each able to
//! be closed by the session layer when its client stalls) and the admin listener
//! (`/healthz`, `/readyz`). Takes listeners and a shutdown future; binding and signals are
//! `main`'s job, so tests run the real server on `127.0.0.1:0`.

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
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::config::Config;
use crate::proxy::{Conn, Gateway};

/// How long a client may take to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the gateway on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_gateway(listener, Gateway::new(config), shutdown).await
}

/// Serves an existing [`Gateway`] (tests keep a handle to inspect its sessions).
pub async fn serve_gateway(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let _sweeper = AbortOnDrop(gateway.registry().spawn_sweeper());
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
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
        let gateway = gateway.clone();
        let builder = builder.clone();
        tokio::spawn(async move {
            let kill = Arc::new(Notify::new());
            let conn = Conn {
                remote,
                kill: kill.clone(),
            };
            let svc =
                service_fn(move |req: Request<Incoming>| gateway.clone().handle(req, conn.clone()));
            let serving = builder.serve_connection(TokioIo::new(tcp), svc);
            tokio::select! {
                res = serving => {
                    if let Err(e) = res {
                        tracing::debug!(error = %e, "client connection ended with an error");
                    }
                }
                () = kill.notified() => tracing::info!(%remote, "closed a stalled client connection"),
            }
        });
    }
    Ok(())
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

/// Serves `/healthz` and `/readyz` on `listener` until `shutdown` resolves.
pub async fn serve_admin(
    listener: TcpListener,
    health: Arc<Health>,
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
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let health = health.clone();
                async move { Ok::<_, Infallible>(admin_response(&req, &health)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
    }
}

fn admin_response(req: &Request<Incoming>, health: &Health) -> Response<Full<Bytes>> {
    let (status, body) = match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/healthz") => (StatusCode::OK, "ok\n"),
        (&Method::GET | &Method::HEAD, "/readyz") if health.is_ready() => {
            (StatusCode::OK, "ready\n")
        }
        (&Method::GET | &Method::HEAD, "/readyz") => {
            (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
        }
        _ => (StatusCode::NOT_FOUND, "not found\n"),
    };
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
