//! Integration tests for the embedded legacy MCP demo upstream (`mcp_reattach::serve_demo_upstream`), driven
//! with hand-written HTTP/1.1 over plain TCP so every byte on the wire is visible.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const IO_TIMEOUT: Duration = Duration::from_secs(5);
const ACCEPT_BOTH: (&str, &str) = ("Accept", "application/json, text/event-stream");
const JSON: (&str, &str) = ("Content-Type", "application/json");

struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

async fn start() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(mcp_reattach::serve_demo_upstream(listener, async move {
        let _ = stopped.await;
    }));
    Server {
        addr,
        stop: Some(stop),
        task,
    }
}

impl Server {
    async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let res = tokio::time::timeout(IO_TIMEOUT, &mut self.task)
            .await
            .expect("serve_upstream did not return after shutdown")
            .expect("serve_upstream panicked");
        res.expect("serve_upstream returned an error");
    }
}

#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The JSON payloads of the SSE events in the body, asserting the SSE shape on the way:
    /// every event is `event: message` + one `data:` line, and no `id:` line appears anywhere.
    fn sse_messages(&self) -> Vec<Value> {
        assert_eq!(self.header("content-type"), Some("text/event-stream"));
        let text = String::from_utf8(self.body.clone()).expect("SSE body is UTF-8");
        sse_messages(&text)
    }
}

fn sse_messages(text: &str) -> Vec<Value> {
    assert!(
        text.is_empty() || text.ends_with("\n\n"),
        "SSE stream must end on an event boundary: {text:?}"
    );
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.is_empty()) {
        let lines: Vec<&str> = block.lines().collect();
        for line in &lines {
            assert!(
                !line.starts_with("id:") && *line != "id",
                "demo upstream must never send SSE ids, got {line:?}"
            );
        }
        if lines.iter().all(|l| l.starts_with(':')) {
            continue; // comment-only block (keepalive / ping)
        }
        assert_eq!(lines.len(), 2, "unexpected event shape: {block:?}");
        assert_eq!(lines[0], "event: message");
        let data = lines[1]
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("expected a data line: {block:?}"));
        out.push(serde_json::from_str(data).expect("event data is JSON"));
    }
    out
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

fn parse_head(head: &[u8]) -> (u16, Vec<(String, String)>) {
    let text = std::str::from_utf8(head).expect("head is UTF-8");
    let mut lines = text.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers = lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (n, v) = l.split_once(':').expect("header line");
            (n.trim().to_owned(), v.trim().to_owned())
        })
        .collect();
    (status, headers)
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size line");
        let size_text = std::str::from_utf8(&raw[..line_end]).expect("chunk size");
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .expect("hex chunk size");
        raw = &raw[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[..size]);
        assert_eq!(&raw[size..size + 2], b"\r\n", "chunk terminator");
        raw = &raw[size + 2..];
    }
}

fn request_bytes(method: &str, headers: &[(&str, &str)], body: &str, close: bool) -> Vec<u8> {
    let mut req = format!("{method} /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    if close {
        req.push_str("Connection: close\r\n");
    }
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    req.push_str(body);
    req.into_bytes()
}

/// Sends one request with `Connection: close` and reads the whole response.
async fn send(addr: SocketAddr, method: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let mut sock = TcpStream::connect(addr).await.expect("connect");
    sock.write_all(&request_bytes(method, headers, body, true))
        .await
        .expect("write request");
    let mut raw = Vec::new();
    tokio::time::timeout(IO_TIMEOUT, sock.read_to_end(&mut raw))
        .await
        .expect("response did not finish in time")
        .expect("read response");
    let head_end = find_head_end(&raw).expect("complete response head");
    let (status, headers) = parse_head(&raw[..head_end]);
    let mut resp = Resp {
        status,
        headers,
        body: Vec::new(),
    };
    let rest = &raw[head_end..];
    resp.body = match resp.header("transfer-encoding") {
        Some(te) if te.eq_ignore_ascii_case("chunked") => dechunk(rest),
        _ => rest.to_vec(),
    };
    if let Some(len) = resp.header("content-length") {
        assert_eq!(len.parse::<usize>().ok(), Some(resp.body.len()));
    }
    resp
}

/// An open response whose head has been read; the connection stays open until dropped.
struct OpenStream {
    sock: TcpStream,
    status: u16,
    headers: Vec<(String, String)>,
    /// Raw (still chunk-framed) body bytes read so far.
    raw: Vec<u8>,
}

impl OpenStream {
    async fn open(addr: SocketAddr, method: &str, headers: &[(&str, &str)], body: &str) -> Self {
        let mut sock = TcpStream::connect(addr).await.expect("connect");
        sock.write_all(&request_bytes(method, headers, body, false))
            .await
            .expect("write request");
        let mut buf = Vec::new();
        let head_end = loop {
            if let Some(end) = find_head_end(&buf) {
                break end;
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(IO_TIMEOUT, sock.read(&mut chunk))
                .await
                .expect("response head did not arrive in time")
                .expect("read");
            assert!(n > 0, "connection closed before the response head");
            buf.extend_from_slice(&chunk[..n]);
        };
        let (status, headers) = parse_head(&buf[..head_end]);
        OpenStream {
            sock,
            status,
            headers,
            raw: buf[head_end..].to_vec(),
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Reads until `needle` appears in the raw body bytes.
    async fn read_until(&mut self, needle: &str) {
        while !contains(&self.raw, needle) {
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(IO_TIMEOUT, self.sock.read(&mut chunk))
                .await
                .unwrap_or_else(|_| panic!("{needle:?} did not arrive in time"))
                .expect("read");
            assert!(n > 0, "stream closed before {needle:?} arrived");
            self.raw.extend_from_slice(&chunk[..n]);
        }
    }
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

fn rpc(id: u64, method: &str, params: Value) -> String {
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string()
}

/// Initializes a session and returns its id.
async fn initialize(addr: SocketAddr) -> String {
    let body = rpc(
        1,
        "initialize",
        json!({"protocolVersion": "2025-06-18", "capabilities": {},
               "clientInfo": {"name": "test", "version": "0"}}),
    );
    let resp = send(addr, "POST", &[ACCEPT_BOTH, JSON], &body).await;
    assert_eq!(resp.status, 200);
    resp.header("mcp-session-id")
        .expect("initialize returns Mcp-Session-Id")
        .to_owned()
}

async fn post_in_session(addr: SocketAddr, session: &str, body: &str) -> Resp {
    send(
        addr,
        "POST",
        &[ACCEPT_BOTH, JSON, ("Mcp-Session-Id", session)],
        body,
    )
    .await
}

/// The single JSON-RPC message of a one-event SSE response.
fn only_message(resp: &Resp) -> Value {
    let mut messages = resp.sse_messages();
    assert_eq!(
        messages.len(),
        1,
        "expected exactly one message: {messages:?}"
    );
    messages.remove(0)
}

#[tokio::test]
async fn initialize_creates_session_and_answers_with_sse_without_ids() {
    let server = start().await;
    let body = rpc(
        7,
        "initialize",
        json!({"protocolVersion": "2025-03-26", "capabilities": {},
               "clientInfo": {"name": "test", "version": "0"}}),
    );
    let resp = send(server.addr, "POST", &[ACCEPT_BOTH, JSON], &body).await;
    assert_eq!(resp.status, 200);
    let session = resp.header("mcp-session-id").expect("session header");
    assert_eq!(session.len(), 32, "hex of 16 random bytes: {session:?}");
    assert!(session.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(resp.header("cache-control"), Some("no-cache"));
    assert!(!contains(&resp.body, "id:"), "no SSE id lines");

    let msg = only_message(&resp);
    assert_eq!(msg["jsonrpc"], "2.0");
    assert_eq!(msg["id"], 7);
    let result = &msg["result"];
    assert_eq!(result["protocolVersion"], "2025-03-26");
    assert_eq!(result["capabilities"], json!({"tools": {}, "logging": {}}));
    assert_eq!(result["serverInfo"]["name"], "mcp-reattach-demo");
    assert!(result["serverInfo"]["version"].is_string());

    // An unsupported requested version falls back to the latest legacy one; ids differ.
    let body = rpc(
        1,
        "initialize",
        json!({"protocolVersion": "1999-01-01", "capabilities": {}}),
    );
    let resp2 = send(server.addr, "POST", &[ACCEPT_BOTH, JSON], &body).await;
    assert_eq!(
        only_message(&resp2)["result"]["protocolVersion"],
        "2025-11-25"
    );
    assert_ne!(resp2.header("mcp-session-id"), Some(session));
    server.shutdown().await;
}

#[tokio::test]
async fn countdown_streams_progress_then_result_in_order() {
    let server = start().await;
    let session = initialize(server.addr).await;
    let body = rpc(
        42,
        "tools/call",
        json!({"name": "countdown", "arguments": {"steps": 3, "interval_ms": 20},
               "_meta": {"progressToken": "tok-1"}}),
    );
    let started = Instant::now();
    let resp = post_in_session(server.addr, &session, &body).await;
    let elapsed = started.elapsed();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("cache-control"), Some("no-cache"));
    assert_eq!(resp.header("x-accel-buffering"), Some("no"));
    assert_eq!(resp.header("mcp-session-id"), Some(session.as_str()));
    assert!(!contains(&resp.body, "id:"), "no SSE id lines");
    assert!(
        elapsed >= Duration::from_millis(55),
        "3 steps of 20 ms cannot finish in {elapsed:?}"
    );

    let messages = resp.sse_messages();
    assert_eq!(messages.len(), 4, "3 progress + 1 result: {messages:?}");
    for (i, msg) in messages[..3].iter().enumerate() {
        let step = i as u64 + 1;
        assert_eq!(msg["method"], "notifications/progress");
        assert!(msg.get("id").is_none());
        assert_eq!(
            msg["params"],
            json!({"progressToken": "tok-1", "progress": step, "total": 3,
                   "message": format!("step {step} of 3")})
        );
    }
    assert_eq!(
        messages[3],
        json!({"jsonrpc": "2.0", "id": 42, "result": {"content": [
            {"type": "text", "text": "countdown finished after 3 steps"}]}})
    );
    server.shutdown().await;
}

#[tokio::test]
async fn countdown_without_progress_token_sends_only_the_result() {
    let server = start().await;
    let session = initialize(server.addr).await;
    let body = rpc(
        3,
        "tools/call",
        json!({"name": "countdown", "arguments": {"steps": 2, "interval_ms": 5}}),
    );
    let resp = post_in_session(server.addr, &session, &body).await;
    let msg = only_message(&resp);
    assert_eq!(
        msg["result"]["content"][0]["text"],
        "countdown finished after 2 steps"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn countdown_events_are_flushed_as_they_happen() {
    let server = start().await;
    let session = initialize(server.addr).await;
    let body = rpc(
        5,
        "tools/call",
        json!({"name": "countdown", "arguments": {"steps": 2, "interval_ms": 300},
               "_meta": {"progressToken": 9}}),
    );
    let mut stream = OpenStream::open(
        server.addr,
        "POST",
        &[ACCEPT_BOTH, JSON, ("Mcp-Session-Id", session.as_str())],
        &body,
    )
    .await;
    assert_eq!(stream.status, 200);
    assert_eq!(stream.header("content-type"), Some("text/event-stream"));
    stream.read_until("\"progress\":1").await;
    assert!(
        !contains(&stream.raw, "\"result\""),
        "the result must not arrive together with the first progress event"
    );
    stream.read_until("\"result\"").await;
    stream.read_until("0\r\n\r\n").await; // the stream ends after the result
    server.shutdown().await;
}

#[tokio::test]
async fn notifications_and_responses_get_202_with_empty_body() {
    let server = start().await;
    let session = initialize(server.addr).await;
    let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string();
    let resp = post_in_session(server.addr, &session, &note).await;
    assert_eq!(resp.status, 202);
    assert!(resp.body.is_empty(), "202 body must be empty: {resp:?}");
    assert_eq!(resp.header("mcp-session-id"), Some(session.as_str()));

    // A batch (2025-03-26) of a notification and a client response: also 202.
    let batch = json!([
        {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}},
        {"jsonrpc": "2.0", "id": "s-1", "result": {}}
    ])
    .to_string();
    let resp = post_in_session(server.addr, &session, &batch).await;
    assert_eq!(resp.status, 202);
    assert!(resp.body.is_empty());
    server.shutdown().await;
}

#[tokio::test]
async fn batch_of_requests_answers_each_on_one_stream() {
    let server = start().await;
    let session = initialize(server.addr).await;
    let batch = json!([
        {"jsonrpc": "2.0", "id": 1, "method": "ping"},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
         "params": {"name": "echo", "arguments": {"text": "hi"}}}
    ])
    .to_string();
    let resp = post_in_session(server.addr, &session, &batch).await;
    assert_eq!(resp.status, 200);
    let mut messages = resp.sse_messages();
    messages.sort_by_key(|m| m["id"].as_u64());
    assert_eq!(
        messages,
        vec![
            json!({"jsonrpc": "2.0", "id": 1, "result": {}}),
            json!({"jsonrpc": "2.0", "id": 2, "result": {"content": [{"type": "text", "text": "hi"}]}}),
        ]
    );
    server.shutdown().await;
}

#[tokio::test]
async fn simple_methods_and_errors() {
    let server = start().await;
    let session = initialize(server.addr).await;

    let msg =
        only_message(&post_in_session(server.addr, &session, &rpc(2, "ping", json!({}))).await);
    assert_eq!(msg, json!({"jsonrpc": "2.0", "id": 2, "result": {}}));

    let msg = only_message(
        &post_in_session(server.addr, &session, &rpc(3, "tools/list", json!({}))).await,
    );
    let tools = msg["result"]["tools"].as_array().expect("tools array");
    let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
    assert_eq!(names, ["countdown", "echo"]);
    let props = &tools[0]["inputSchema"]["properties"];
    assert_eq!(tools[0]["inputSchema"]["type"], "object");
    assert_eq!(props["steps"]["type"], "integer");
    assert_eq!(props["steps"]["default"], 10);
    assert_eq!(props["interval_ms"]["type"], "integer");
    assert_eq!(props["interval_ms"]["default"], 500);
    assert_eq!(
        tools[1]["inputSchema"]["properties"]["text"]["type"],
        "string"
    );

    let body = rpc(
        4,
        "tools/call",
        json!({"name": "echo", "arguments": {"text": "a\nb"}}),
    );
    let msg = only_message(&post_in_session(server.addr, &session, &body).await);
    assert_eq!(msg["result"]["content"][0]["text"], "a\nb");

    let body = rpc(5, "tools/call", json!({"name": "nope", "arguments": {}}));
    let msg = only_message(&post_in_session(server.addr, &session, &body).await);
    assert_eq!(msg["id"], 5);
    assert_eq!(msg["error"]["code"], -32602);

    let msg =
        only_message(&post_in_session(server.addr, &session, &rpc(6, "no/such", json!({}))).await);
    assert_eq!(msg["error"]["code"], -32601);

    let body = rpc(7, "logging/setLevel", json!({"level": "warning"}));
    let msg = only_message(&post_in_session(server.addr, &session, &body).await);
    assert_eq!(msg["result"], json!({}));
    server.shutdown().await;
}

#[tokio::test]
async fn accept_content_type_and_method_checks() {
    let server = start().await;
    let init = rpc(1, "initialize", json!({"protocolVersion": "2025-06-18"}));

    let resp = send(
        server.addr,
        "POST",
        &[("Accept", "application/json"), JSON],
        &init,
    )
    .await;
    assert_eq!(resp.status, 406);
    assert_eq!(resp.json()["error"]["code"], -32000);
    assert!(resp.header("mcp-session-id").is_none());

    let resp = send(
        server.addr,
        "POST",
        &[ACCEPT_BOTH, ("Content-Type", "text/plain")],
        &init,
    )
    .await;
    assert_eq!(resp.status, 415);
    assert_eq!(resp.json()["jsonrpc"], "2.0");

    let resp = send(server.addr, "POST", &[ACCEPT_BOTH, JSON], "{not json").await;
    assert_eq!(resp.status, 400);
    assert_eq!(resp.json()["error"]["code"], -32700);

    let resp = send(server.addr, "PUT", &[ACCEPT_BOTH], "").await;
    assert_eq!(resp.status, 405);
    assert_eq!(resp.header("allow"), Some("GET, POST, DELETE"));
    assert!(resp.header("mcp-session-id").is_none());

    // Rejections of requests that name a live session still echo its id.
    let session = initialize(server.addr).await;
    let sid = ("Mcp-Session-Id", session.as_str());
    let resp = send(server.addr, "PUT", &[ACCEPT_BOTH, sid], "").await;
    assert_eq!(resp.status, 405);
    assert_eq!(resp.header("mcp-session-id"), Some(session.as_str()));
    let ping = rpc(2, "ping", json!({}));
    let resp = send(
        server.addr,
        "POST",
        &[("Accept", "text/event-stream"), JSON, sid],
        &ping,
    )
    .await;
    assert_eq!(resp.status, 406);
    assert_eq!(resp.header("mcp-session-id"), Some(session.as_str()));
    server.shutdown().await;
}

#[tokio::test]
async fn missing_and_unknown_sessions() {
    let server = start().await;
    let ping = rpc(1, "ping", json!({}));

    let resp = send(server.addr, "POST", &[ACCEPT_BOTH, JSON], &ping).await;
    assert_eq!(resp.status, 400);
    assert_eq!(
        resp.json(),
        json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32000,
               "message": "Bad Request: No valid session ID provided"}})
    );

    let resp = post_in_session(server.addr, "deadbeef", &ping).await;
    assert_eq!(resp.status, 404);
    assert_eq!(resp.json()["error"]["code"], -32001);
    assert_eq!(resp.json()["error"]["message"], "Session not found");

    let resp = send(
        server.addr,
        "GET",
        &[
            ("Accept", "text/event-stream"),
            ("Mcp-Session-Id", "deadbeef"),
        ],
        "",
    )
    .await;
    assert_eq!(resp.status, 404);
    server.shutdown().await;
}

#[tokio::test]
async fn second_get_conflicts_until_the_first_is_dropped() {
    let server = start().await;
    let session = initialize(server.addr).await;
    let get_headers = [
        ("Accept", "text/event-stream"),
        ("Mcp-Session-Id", session.as_str()),
    ];

    let first = OpenStream::open(server.addr, "GET", &get_headers, "").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("content-type"), Some("text/event-stream"));
    assert_eq!(first.header("mcp-session-id"), Some(session.as_str()));

    let second = send(server.addr, "GET", &get_headers, "").await;
    assert_eq!(second.status, 409);
    assert_eq!(second.json()["jsonrpc"], "2.0");
    assert!(second.json()["error"]["code"].is_i64());

    // Dropping the first stream frees the slot (detected asynchronously by the server).
    drop(first);
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        let third = OpenStream::open(server.addr, "GET", &get_headers, "").await;
        if third.status == 200 {
            break;
        }
        assert_eq!(third.status, 409);
        assert!(Instant::now() < deadline, "GET slot never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.shutdown().await;
}

#[tokio::test]
async fn delete_forgets_the_session_and_ends_its_streams() {
    let server = start().await;
    let session = initialize(server.addr).await;
    let sid = ("Mcp-Session-Id", session.as_str());

    let mut get = OpenStream::open(
        server.addr,
        "GET",
        &[("Accept", "text/event-stream"), sid],
        "",
    )
    .await;
    assert_eq!(get.status, 200);

    let resp = send(server.addr, "DELETE", &[sid], "").await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("mcp-session-id"), Some(session.as_str()));

    // The standalone stream ends (terminating chunk) once the session is gone.
    get.read_until("0\r\n\r\n").await;

    let resp = send(server.addr, "DELETE", &[sid], "").await;
    assert_eq!(resp.status, 404);
    assert_eq!(resp.json()["error"]["code"], -32001);

    let resp = post_in_session(server.addr, &session, &rpc(1, "ping", json!({}))).await;
    assert_eq!(resp.status, 404);
    server.shutdown().await;
}

#[tokio::test]
async fn shutdown_returns_even_with_open_streams() {
    let server = start().await;
    let session = initialize(server.addr).await;
    let mut get = OpenStream::open(
        server.addr,
        "GET",
        &[
            ("Accept", "text/event-stream"),
            ("Mcp-Session-Id", session.as_str()),
        ],
        "",
    )
    .await;
    assert_eq!(get.status, 200);
    let body = rpc(
        9,
        "tools/call",
        json!({"name": "countdown", "arguments": {"steps": 100, "interval_ms": 1000}}),
    );
    let _call = OpenStream::open(
        server.addr,
        "POST",
        &[ACCEPT_BOTH, JSON, ("Mcp-Session-Id", session.as_str())],
        &body,
    )
    .await;
    let started = Instant::now();
    server.shutdown().await;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "shutdown took {:?}",
        started.elapsed()
    );
    get.read_until("0\r\n\r\n").await;
}
