//! The scriptable mock upstream ([`Mock`]): each request is handed to the test, which answers it
//! with a full body (a JSON one: [`Seen::respond_json`], [`json_response`]) or with raw SSE
//! bytes it writes whenever it likes ([`SseWriter`]).

use super::*;

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

    /// Whether the gateway gave up on this request (its connection to the mock closed, so
    /// the answer can no longer be sent) within `d`.
    pub async fn closed_within(&mut self, d: Duration) -> bool {
        tokio::time::timeout(d, self.respond.closed()).await.is_ok()
    }

    pub fn respond(self, resp: Response<Full<Bytes>>) {
        let (p, b) = resp.into_parts();
        let _ = self.respond.send(Response::from_parts(p, b.boxed()));
    }

    /// Answers 200 `application/json` with the JSON-RPC message `body` ([`json_response`]).
    pub fn respond_json(self, body: impl Into<Bytes>) {
        self.respond(json_response(200, &[], body));
    }

    /// Answers an `initialize` with a JSON result that opens session `sid`.
    pub fn respond_initialized(self, sid: &str) {
        self.respond(json_response(
            200,
            &[("mcp-session-id", sid)],
            r#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-06-18","capabilities":{},"serverInfo":{"name":"mock","version":"0"}}}"#,
        ));
    }

    /// Answers with a `text/event-stream` 200 carrying `session` (if any); the test writes the
    /// body through the returned writer, and dropping the writer ends the response.
    pub fn respond_sse(self, session: Option<&str>) -> SseWriter {
        let mut headers = vec![("cache-control", "no-cache")];
        headers.extend(session.map(|s| ("mcp-session-id", s)));
        self.respond_streamed("text/event-stream", &headers)
    }

    /// Answers 200 with `content_type` and `headers` at once; the test writes the body
    /// through the returned writer (chunked, unless `headers` give a `content-length`), and
    /// dropping the writer ends the response.
    pub fn respond_streamed(self, content_type: &str, headers: &[(&str, &str)]) -> SseWriter {
        let (tx, rx) = mpsc::channel(1024);
        let body = ChannelBody { rx };
        let mut resp = Response::new(body.boxed());
        resp.headers_mut()
            .insert("content-type", content_type.parse().unwrap());
        for (name, value) in headers {
            resp.headers_mut().append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        let _ = self.respond.send(resp);
        SseWriter { tx }
    }
}

/// An upstream's JSON answer: `status`, `content-type: application/json`, then `headers` in
/// order, and the JSON-RPC message `body` (e.g. `{"jsonrpc":"2.0","id":1,"result":{}}`).
pub fn json_response(
    status: u16,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut b = Response::builder()
        .status(status)
        .header("content-type", "application/json");
    for (name, value) in headers {
        b = b.header(*name, *value);
    }
    b.body(Full::new(body.into())).expect("a JSON response")
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
                // Without it, a small write while an earlier one is unacknowledged waits for
                // the peer's delayed ACK (Nagle): ~40 ms of real time, which a paused clock
                // skips past in an instant (its timers fire as if the upstream were silent).
                let _ = tcp.set_nodelay(true);
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
