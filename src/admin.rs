//! The admin listener: `/healthz` (alive), `/readyz` (ready, [`Health`], and with
//! `--ready-upstream` the upstream reachable) and `/metrics` (the
//! gateway's Prometheus exposition, classic text or OpenMetrics as the scraper asks), one
//! HTTP/1.1 task per connection, until its shutdown future resolves ([`Shutdown::drained`] in
//! `main`: it outlives the drain, so probes and scrapes see it through).
//!
//! Knows [`Health`] and the gateway's metrics; nothing of the proxy listener, sessions or
//! the drain's phases.
//!
//! [`Shutdown::drained`]: crate::shutdown::Shutdown::drained

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::proxy::Gateway;
use crate::shutdown::Health;

/// How long an admin client may take to send a request's headers.
const ADMIN_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

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
                async move { Ok::<_, Infallible>(admin_response(&req, &health, &gateway).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(ADMIN_HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
    }
}

async fn admin_response(
    req: &Request<Incoming>,
    health: &Health,
    gateway: &Gateway,
) -> Response<Full<Bytes>> {
    let get = matches!(*req.method(), Method::GET | Method::HEAD);
    let (status, content_type, body) = match req.uri().path() {
        "/healthz" if get => (StatusCode::OK, "text/plain", Bytes::from_static(b"ok\n")),
        "/readyz" if get && health.is_ready() => {
            if gateway.upstream_ready().await {
                (StatusCode::OK, "text/plain", Bytes::from_static(b"ready\n"))
            } else {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    Bytes::from_static(b"upstream unreachable\n"),
                )
            }
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
