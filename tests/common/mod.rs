//! Test support for gateway integration tests: a scriptable mock upstream (each request is
//! handed to the test, which answers it with a full body or with raw SSE bytes it writes
//! whenever it likes), a raw HTTP/1.1 client whose connections can be dropped at will, and
//! an SSE reader built on the crate's own decoder.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use mcp_reattach::sse::{Decoder, Event};
use mcp_reattach::{Config, Gateway};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

pub const WAIT: Duration = Duration::from_secs(10);

type MockBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// A request that reached the mock upstream.
pub struct Seen {
    pub method: Method,
    pub uri: http::Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
    respond: oneshot::Sender<Response<MockBody>>,
}

/// Writes raw bytes of an upstream SSE response.
pub struct SseWriter {
    tx: mpsc::Sender<Bytes>,
}

impl SseWriter {
    pub async fn send(&self, raw: impl Into<Bytes>) {
        self.tx
            .send(raw.into())
            .await
            .expect("gateway dropped the upstream stream");
    }

    /// Like [`SseWriter::message`], for a stream whose connection may already be gone
    /// (after an injected fault): whether the bytes were handed to the body.
    pub async fn try_message(&self, json: &str) -> bool {
        self.tx
            .send(format!("event: message\ndata: {json}\n\n").into())
            .await
            .is_ok()
    }

    /// Sends one `event: message` with JSON `data` and no id.
    pub async fn message(&self, json: &str) {
        self.send(format!("event: message\ndata: {json}\n\n")).await;
    }

    /// Whether the gateway closed this upstream response (its body was dropped).
    pub async fn closed_within(&self, d: Duration) -> bool {
        tokio::time::timeout(d, self.tx.closed()).await.is_ok()
    }
}

impl Seen {
    pub fn json_body(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn respond(self, resp: Response<Full<Bytes>>) {
        let (p, b) = resp.into_parts();
        let _ = self.respond.send(Response::from_parts(p, b.boxed()));
    }

    /// Answers with a `text/event-stream` 200 carrying `session` (if any); the test writes the
    /// body through the returned writer, and dropping the writer ends the response.
    pub fn respond_sse(self, session: Option<&str>) -> SseWriter {
        let (tx, rx) = mpsc::channel(1024);
        let body = ChannelBody { rx };
        let mut resp = Response::new(body.boxed());
        resp.headers_mut()
            .insert("content-type", "text/event-stream".parse().unwrap());
        resp.headers_mut()
            .insert("cache-control", "no-cache".parse().unwrap());
        if let Some(s) = session {
            resp.headers_mut()
                .insert("mcp-session-id", s.parse().unwrap());
        }
        let _ = self.respond.send(resp);
        SseWriter { tx }
    }
}

/// Body fed by a channel: each message is one data frame; the body ends when the sender drops.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// The mock upstream: every request arrives on `requests`. Dropping it stops it: the listener
/// and every connection it accepted are closed.
pub struct Mock {
    pub addr: SocketAddr,
    pub requests: mpsc::Receiver<Seen>,
    tasks: tokio::task::JoinSet<()>,
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

impl Mock {
    pub async fn start() -> Mock {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::channel(64);
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(async move {
            // Connections live in the accept task's own set: aborting it closes them all.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                while connections.try_join_next().is_some() {}
                let tx = tx.clone();
                connections.spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let tx = tx.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body
                                .collect()
                                .await
                                .map(|c| c.to_bytes())
                                .unwrap_or_default();
                            let (respond, answer) = oneshot::channel();
                            let seen = Seen {
                                method: parts.method,
                                uri: parts.uri,
                                headers: parts.headers,
                                body,
                                respond,
                            };
                            if tx.send(seen).await.is_err() {
                                return Ok::<_, Infallible>(Response::new(
                                    Full::new(Bytes::new()).boxed(),
                                ));
                            }
                            Ok(answer.await.unwrap_or_else(|_| {
                                let mut r = Response::new(
                                    Full::new(Bytes::from_static(b"mock: no answer")).boxed(),
                                );
                                *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                                r
                            }))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        Mock {
            addr,
            requests: rx,
            tasks,
        }
    }

    pub async fn next(&mut self) -> Seen {
        tokio::time::timeout(WAIT, self.requests.recv())
            .await
            .expect("upstream request in time")
            .expect("mock alive")
    }

    /// No request reaches the upstream within `d`.
    pub async fn nothing_within(&mut self, d: Duration) -> bool {
        tokio::time::timeout(d, self.requests.recv()).await.is_err()
    }
}

/// A running gateway in front of `upstream`.
pub struct Gw {
    pub addr: SocketAddr,
    pub gateway: Arc<Gateway>,
}

pub async fn gateway(upstream: SocketAddr, tweak: impl FnOnce(&mut Config)) -> Gw {
    let mut cfg = Config::new(format!("http://{upstream}").parse().unwrap());
    cfg.sweep_interval = Duration::from_millis(20);
    tweak(&mut cfg);
    let gateway = Gateway::new(cfg);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(mcp_reattach::serve_gateway(
        listener,
        gateway.clone(),
        std::future::pending(),
    ));
    Gw { addr, gateway }
}

impl Gw {
    /// Upstream events the gateway has tagged so far (`events_tagged_total`).
    pub fn tagged(&self) -> u64 {
        self.gateway
            .render_metrics()
            .lines()
            .find_map(|l| l.strip_prefix("mcp_reattach_events_tagged_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0) as u64
    }

    /// Waits (bounded by [`WAIT`]) until the gateway has tagged at least `n` events in all:
    /// what the mock wrote has reached the session.
    pub async fn tagged_at_least(&self, n: u64) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.tagged() < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the gateway tagged {} of {n} events in time",
                self.tagged()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Sends one request on a fresh connection; the response body streams from that connection
/// and dropping it closes the connection.
pub async fn send(addr: SocketAddr, req: Request<Full<Bytes>>) -> Response<Incoming> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("response in time")
        .expect("response")
}

pub fn post(body: &str, session: Option<&str>) -> Request<Full<Bytes>> {
    let mut b = Request::post("/mcp")
        .header("host", "mcp.example")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    if let Some(s) = session {
        b = b.header("mcp-session-id", s);
    }
    b.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

pub fn get(session: &str, last_event_id: Option<&str>) -> Request<Full<Bytes>> {
    let mut b = Request::get("/mcp")
        .header("host", "mcp.example")
        .header("accept", "text/event-stream")
        .header("mcp-session-id", session);
    if let Some(c) = last_event_id {
        b = b.header("last-event-id", c);
    }
    b.body(Full::new(Bytes::new())).unwrap()
}

pub fn call(id: u64) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","_meta":{{"progressToken":{id}}}}}}}"#
    )
}

pub fn progress(i: u64) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","method":"notifications/progress","params":{{"progressToken":1,"progress":{i}}}}}"#
    )
}

pub fn result(id: u64) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[]}}}}"#)
}

/// Reads SSE events from a response body.
pub struct SseReader {
    body: Incoming,
    decoder: Decoder,
    pending: std::collections::VecDeque<Event>,
    pub raw: Vec<u8>,
    pub ended: bool,
}

impl SseReader {
    pub fn new(resp: Response<Incoming>) -> SseReader {
        SseReader {
            body: resp.into_body(),
            decoder: Decoder::new(64 << 20),
            pending: Default::default(),
            raw: Vec::new(),
            ended: false,
        }
    }

    /// The next event, or `None` when the body ends.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            if self.ended {
                return None;
            }
            match tokio::time::timeout(WAIT, self.body.frame())
                .await
                .expect("SSE event in time")
            {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.raw.extend_from_slice(&d);
                        let mut out = Vec::new();
                        self.decoder
                            .feed(&d, &mut out)
                            .expect("valid SSE from the gateway");
                        self.pending.extend(out);
                    }
                }
                Some(Err(_)) | None => self.ended = true,
            }
        }
    }

    /// All remaining events until the body ends.
    pub async fn rest(&mut self) -> Vec<Event> {
        let mut v = Vec::new();
        while let Some(e) = self.next().await {
            v.push(e);
        }
        v
    }
}

/// Data of `message` events (or untyped events) with non-empty data: what an MCP client acts on.
pub fn messages(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.event.as_deref().is_none_or(|t| t == "message"))
        .filter_map(|e| e.data.clone())
        .filter(|d| !d.is_empty())
        .collect()
}

/// Initializes a session through the gateway with a JSON answer; returns the session id.
pub async fn init_session(gw: &Gw, mock: &mut Mock, sid: &str) -> String {
    let pending = tokio::spawn(send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"0"}}}"#,
            None,
        ),
    ));
    let seen = mock.next().await;
    seen.respond(
        Response::builder()
            .header("content-type", "application/json")
            .header("mcp-session-id", sid)
            .body(Full::new(Bytes::from_static(br#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-06-18","capabilities":{},"serverInfo":{"name":"mock","version":"0"}}}"#)))
            .unwrap(),
    );
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["mcp-session-id"], sid);
    sid.to_owned()
}
