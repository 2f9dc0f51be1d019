//! The gateway in this test's runtime ([`Gw`]), a raw HTTP/1.1 client whose connections can be
//! dropped at will ([`send`]), and the JSON-RPC messages the tests send and answer.

use super::*;

/// The gateway under test, serving on a loopback port in this test's runtime.
pub struct Gw {
    pub addr: SocketAddr,
    pub gateway: Arc<Gateway>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// A gateway in front of the mock (or any upstream) at `upstream`, sweeping every 20 ms so TTL
/// tests need not wait for the default sweep; `tweak` adjusts the rest of the config.
pub async fn gateway(upstream: SocketAddr, tweak: impl FnOnce(&mut Config)) -> Gw {
    Gw::start(&format!("http://{upstream}"), |cfg| {
        cfg.sweep_interval = Duration::from_millis(20);
        tweak(cfg);
    })
    .await
}

impl Gw {
    /// A gateway with the default config (adjusted by `tweak`) in front of `upstream`
    /// (`http://host:port`).
    pub async fn start(upstream: &str, tweak: impl FnOnce(&mut Config)) -> Gw {
        let mut cfg = Config::new(upstream.parse().expect("upstream URI"));
        tweak(&mut cfg);
        let gateway = Gateway::new(cfg);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(mcp_reattach::serve_gateway(
            listener,
            gateway.clone(),
            std::future::pending(),
        ));
        Gw {
            addr,
            gateway,
            task,
        }
    }

    /// `http://<gateway addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// A note for failure messages: the gateway must serve until shutdown.
    pub fn state(&self) -> &'static str {
        if self.task.is_finished() {
            "the gateway's serve task has ENDED (it must run until shutdown)"
        } else {
            "the gateway's serve task is running"
        }
    }

    /// The value of one series of the gateway's metrics (`name` or `name{labels}` exactly as
    /// exported), `None` when it is not exported.
    pub fn metric(&self, series: &str) -> Option<f64> {
        self.gateway.render_metrics().lines().find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
    }

    /// Upstream events the gateway has tagged so far (`events_tagged_total`).
    pub fn tagged(&self) -> u64 {
        self.metric("mcp_reattach_events_tagged_total")
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
    send_on(TcpStream::connect(addr).await.unwrap(), req).await
}

/// The body of `resp` as JSON (a refusal's JSON-RPC error); panics with the body when it is
/// not.
pub async fn body_json(resp: Response<Incoming>) -> serde_json::Value {
    use http_body_util::BodyExt;
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&b)
        .unwrap_or_else(|_| panic!("JSON body, got {:?}", String::from_utf8_lossy(&b)))
}

/// Receive buffer a [`send_small_window`] client asks for (the kernel doubles it).
const SMALL_RECEIVE_BUFFER: u32 = 32 * 1024;

/// [`send`] from a socket with a small fixed receive buffer (no autotuning): behind a relay
/// with small buffers, what the path to this client holds in flight stays in kilobytes.
pub async fn send_small_window(addr: SocketAddr, req: Request<Full<Bytes>>) -> Response<Incoming> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(SMALL_RECEIVE_BUFFER).unwrap();
    send_on(socket.connect(addr).await.unwrap(), req).await
}

async fn send_on(tcp: TcpStream, mut req: Request<Full<Bytes>>) -> Response<Incoming> {
    // As every HTTP/1.1 client does (hyper's connection-level client does not add it).
    if !req.headers().contains_key("host") {
        req.headers_mut()
            .insert("host", http::HeaderValue::from_static("mcp.example"));
    }
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

/// A client's `initialize` request (id 0).
pub const INITIALIZE: &str = r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"0"}}}"#;

/// Where requests go: an in-process [`Gw`] or the address of a gateway process.
pub trait Target {
    fn target(&self) -> SocketAddr;
}

impl Target for Gw {
    fn target(&self) -> SocketAddr {
        self.addr
    }
}

impl Target for SocketAddr {
    fn target(&self) -> SocketAddr {
        *self
    }
}

/// Initializes a session through the gateway at `gw` (in front of `mock`) with a JSON answer;
/// returns the session id.
pub async fn init_session(gw: &impl Target, mock: &mut Mock, sid: &str) -> String {
    let pending = tokio::spawn(send(gw.target(), post(INITIALIZE, None)));
    mock.next().await.respond_initialized(sid);
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["mcp-session-id"], sid);
    sid.to_owned()
}

/// Starts tool call `id` of session `sid` through the gateway at `gw`: the POST reaches `mock`
/// (asserted: with that id), which answers with an SSE stream; the client's answer is asserted
/// 200 `text/event-stream`. Returns the client's reader and the upstream's writer.
pub async fn start_call(
    gw: &impl Target,
    mock: &mut Mock,
    sid: &str,
    id: u64,
) -> (SseReader, SseWriter) {
    let pending = tokio::spawn(send(gw.target(), post(&call(id), Some(sid))));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["id"], id);
    let writer = seen.respond_sse(Some(sid));
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    (SseReader::new(resp), writer)
}
