//! The admin listener: `/healthz` (alive), `/readyz` (ready, [`Health`], and with
//! `--ready-upstream` the upstream reachable), `/metrics` (the gateway's Prometheus
//! exposition, classic text or OpenMetrics as the scraper asks), and for operators the
//! sessions (`sessions`: `GET /sessions`, `GET` and `DELETE /sessions/{id}`; `ui`: the same,
//! read-only, as HTML at `/ui`). One HTTP/1.1 task per connection, until its shutdown future
//! resolves ([`Shutdown::drained`] in `main`: it outlives the drain, so probes and scrapes see
//! it through).
//!
//! Knows [`Health`], the gateway's metrics and what the gateway tells operators of its
//! sessions; nothing of the proxy listener or the drain's phases. Who may read and end
//! sessions: `access`.
//!
//! [`Shutdown::drained`]: crate::shutdown::Shutdown::drained

mod access;
pub(crate) mod client;
mod sessions;
mod ui;

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

use crate::config::AdminAccess;
use crate::proxy::Gateway;
use crate::shutdown::Health;

/// How long an admin client may take to send a request's headers.
const ADMIN_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What every admin request may use.
struct Admin {
    health: Arc<Health>,
    gateway: Arc<Gateway>,
    access: access::Access,
}

/// Serves the admin listener on `listener` until `shutdown` resolves; sessions are read and
/// ended as `access` allows.
pub async fn serve_admin(
    listener: TcpListener,
    health: Arc<Health>,
    gateway: Arc<Gateway>,
    access: AdminAccess,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let loopback = listener.local_addr()?.ip().is_loopback();
    let admin = Arc::new(Admin {
        health,
        gateway,
        access: access::Access::new(access, loopback),
    });
    tokio::pin!(shutdown);
    loop {
        let (tcp, _) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(_) => { tokio::time::sleep(Duration::from_millis(50)).await; continue; }
            },
            () = &mut shutdown => return Ok(()),
        };
        let admin = admin.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let admin = admin.clone();
                async move { Ok::<_, Infallible>(admin.respond(&req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(ADMIN_HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
    }
}

/// An admin answer: its status, content type and body, and the headers some need.
struct Answer {
    status: StatusCode,
    content_type: &'static str,
    body: Bytes,
    headers: Vec<(http::header::HeaderName, &'static str)>,
}

impl Answer {
    fn new(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Answer {
        Answer {
            status,
            content_type,
            body: body.into(),
            headers: Vec::new(),
        }
    }

    fn text(status: StatusCode, body: &'static str) -> Answer {
        Answer::new(status, "text/plain", Bytes::from_static(body.as_bytes()))
    }

    /// An error as JSON: `{"error": kind, "message": why}` (the sessions' pages and the
    /// access checks answer with it).
    fn error(status: StatusCode, kind: &str, why: &str) -> Answer {
        Answer::new(
            status,
            "application/json",
            Bytes::from(serde_json::json!({ "error": kind, "message": why }).to_string()),
        )
    }
}

impl Admin {
    async fn respond(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        let a = self.route(req).await;
        let head = req.method() == Method::HEAD;
        let mut r = Response::new(Full::new(if head { Bytes::new() } else { a.body }));
        *r.status_mut() = a.status;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(a.content_type),
        );
        for (name, value) in a.headers {
            r.headers_mut()
                .insert(name, http::HeaderValue::from_static(value));
        }
        r
    }

    async fn route(&self, req: &Request<Incoming>) -> Answer {
        let get = matches!(*req.method(), Method::GET | Method::HEAD);
        let path = req.uri().path();
        if path == "/sessions"
            || path.starts_with("/sessions/")
            || path == "/ui"
            || path.starts_with("/ui/")
        {
            return sessions::route(self, req).await;
        }
        match path {
            "/healthz" if get => Answer::text(StatusCode::OK, "ok\n"),
            "/readyz" if get && self.health.is_ready() => {
                if self.gateway.upstream_ready().await {
                    Answer::text(StatusCode::OK, "ready\n")
                } else {
                    Answer::text(StatusCode::SERVICE_UNAVAILABLE, "upstream unreachable\n")
                }
            }
            "/readyz" if get => Answer::text(StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
            "/metrics" if get => {
                let open_metrics = req.headers().get_all(http::header::ACCEPT).iter().any(|v| {
                    v.to_str()
                        .is_ok_and(|v| v.contains("application/openmetrics-text"))
                });
                let text = self.gateway.render_metrics();
                if open_metrics {
                    Answer::new(
                        StatusCode::OK,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        text,
                    )
                } else {
                    Answer::new(
                        StatusCode::OK,
                        "text/plain; version=0.0.4; charset=utf-8",
                        crate::metrics::to_prometheus_text(&text),
                    )
                }
            }
            _ => Answer::text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }
}
