//! Embedded legacy-era MCP demo upstream (Streamable HTTP, protocol 2025-03-26 … 2025-11-25)
//! used by `mcp-reattach demo`: sessions on, SSE without `id:` fields, no event store, and a
//! slow progress-streaming `countdown` tool, like a typical deployed server.
//!
//! Behaviour, in the order the checks run:
//!
//! - POST: `Accept` must list `application/json` and `text/event-stream` (else 406), the
//!   `Content-Type` must be `application/json` (else 415), the body must be one JSON-RPC message
//!   or a non-empty batch (else 400). `initialize` creates a session and is answered as a
//!   one-event SSE stream carrying `Mcp-Session-Id`. Everything else needs a known session
//!   (missing header → 400, unknown → 404). Only notifications/responses → 202, empty body.
//!   Requests → `text/event-stream`, one `event: message` per JSON-RPC message, never an `id:`.
//! - GET: standalone SSE stream (`: keepalive` every 5 s, a `notifications/message` tick every
//!   10 s); a second concurrent GET for the same session → 409. `Last-Event-ID` is ignored.
//! - DELETE: forgets the session (200), ending its streams; unknown → 404.
//! - Any other method → 405 with `Allow: GET, POST, DELETE`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

const SESSION_HEADER: &str = "mcp-session-id";
const SUPPORTED_VERSIONS: [&str; 3] = ["2025-03-26", "2025-06-18", "2025-11-25"];
const LATEST_VERSION: &str = "2025-11-25";
/// Largest accepted POST body.
const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// A POST-started stream that has been silent this long gets a `: ping` comment.
const POST_PING_AFTER: Duration = Duration::from_secs(15);
/// Standalone (GET) stream: `: keepalive` comment period.
const GET_KEEPALIVE: Duration = Duration::from_secs(5);
/// Standalone (GET) stream: `notifications/message` tick period.
const GET_TICK: Duration = Duration::from_secs(10);
/// How long open connections get to finish after shutdown before they are dropped.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// Events buffered per SSE response before the producer waits for the client.
const STREAM_BUFFER: usize = 32;
const MAX_STEPS: u64 = 10_000;
const MAX_INTERVAL_MS: u64 = 60_000;
/// MCP logging levels, lowest first (RFC 5424 order).
const LOG_LEVELS: [&str; 8] = [
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
];
const LEVEL_INFO: usize = 1;

/// Serves the demo MCP server on `listener` (any path; conventionally /mcp) until `shutdown` resolves.
pub async fn serve_upstream(
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let state = Arc::new(State::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);

    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    tracing::debug!(%peer, "demo upstream: connection accepted");
                    conns.spawn(serve_connection(state.clone(), stream, stop_rx.clone()));
                }
                Err(err) => {
                    tracing::warn!(error = %err, "demo upstream: accept failed");
                    if !is_per_connection_error(&err) {
                        // e.g. EMFILE: back off instead of spinning.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            },
        }
    }

    drop(listener);
    // End every SSE stream, then let connections finish their in-flight responses.
    state.close_all();
    stop_tx.send_replace(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

fn is_per_connection_error(err: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        err.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock
    )
}

async fn serve_connection(state: Arc<State>, stream: TcpStream, mut stop: watch::Receiver<bool>) {
    // SSE events are small and latency matters more than packet count.
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let state = state.clone();
        async move { Ok::<_, Infallible>(handle(state, req).await) }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new());
    builder.http2().timer(TokioTimer::new());
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);

    tokio::select! {
        res = conn.as_mut() => {
            if let Err(err) = res {
                tracing::debug!(error = %err, "demo upstream: connection ended with error");
            }
        }
        () = async { let _ = stop.wait_for(|stopped| *stopped).await; } => {
            conn.as_mut().graceful_shutdown();
            if tokio::time::timeout(SHUTDOWN_GRACE, conn.as_mut()).await.is_err() {
                tracing::debug!("demo upstream: connection dropped after shutdown grace");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Session table
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct State {
    sessions: Mutex<HashMap<String, SessionEntry>>,
}

struct SessionEntry {
    /// Flipped to `true` (or dropped) when the session ends; every stream of the session stops.
    closed: watch::Sender<bool>,
    /// A standalone GET stream is open.
    get_open: bool,
    /// Index into [`LOG_LEVELS`]; messages below it are not sent.
    log_level: usize,
}

enum ClaimError {
    Unknown,
    Busy,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, SessionEntry>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn create_session(&self) -> std::io::Result<(String, watch::Receiver<bool>)> {
        let id = new_session_id()?;
        let (closed, closed_rx) = watch::channel(false);
        let entry = SessionEntry {
            closed,
            get_open: false,
            log_level: 0,
        };
        self.lock().insert(id.clone(), entry);
        tracing::debug!(session = %id, "demo upstream: session created");
        Ok((id, closed_rx))
    }

    fn lookup(&self, id: &str) -> Option<watch::Receiver<bool>> {
        self.lock().get(id).map(|entry| entry.closed.subscribe())
    }

    fn remove(&self, id: &str) -> bool {
        let removed = self.lock().remove(id);
        match removed {
            Some(entry) => {
                entry.closed.send_replace(true);
                tracing::debug!(session = %id, "demo upstream: session deleted");
                true
            }
            None => false,
        }
    }

    fn close_all(&self) {
        let drained: Vec<SessionEntry> = self.lock().drain().map(|(_, entry)| entry).collect();
        for entry in drained {
            entry.closed.send_replace(true);
        }
    }

    fn claim_get(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<(GetSlot, watch::Receiver<bool>), ClaimError> {
        let mut sessions = self.lock();
        let entry = sessions.get_mut(id).ok_or(ClaimError::Unknown)?;
        if entry.get_open {
            return Err(ClaimError::Busy);
        }
        entry.get_open = true;
        let closed = entry.closed.subscribe();
        drop(sessions);
        let slot = GetSlot {
            state: self.clone(),
            session: id.to_owned(),
        };
        Ok((slot, closed))
    }

    fn set_log_level(&self, id: &str, level: usize) {
        if let Some(entry) = self.lock().get_mut(id) {
            entry.log_level = level;
        }
    }

    fn log_level(&self, id: &str) -> usize {
        self.lock().get(id).map_or(0, |entry| entry.log_level)
    }
}

/// Holds a session's standalone-stream slot; frees it when the GET response body is dropped.
struct GetSlot {
    state: Arc<State>,
    session: String,
}

impl Drop for GetSlot {
    fn drop(&mut self) {
        if let Some(entry) = self.state.lock().get_mut(&self.session) {
            entry.get_open = false;
        }
    }
}

/// 16 random bytes as lowercase hex: visible ASCII, as the spec requires.
fn new_session_id() -> std::io::Result<String> {
    let mut raw = [0u8; 16];
    getrandom::getrandom(&mut raw).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(raw.iter().map(|b| format!("{b:02x}")).collect())
}

/// Resolves once the session ends (explicitly or because its entry was dropped).
async fn session_closed(closed: &mut watch::Receiver<bool>) {
    let _ = closed.wait_for(|c| *c).await;
}

// ---------------------------------------------------------------------------------------------
// Response body: either a fixed buffer or a channel of SSE chunks flushed as they arrive
// ---------------------------------------------------------------------------------------------

struct DemoBody {
    kind: BodyKind,
}

enum BodyKind {
    Full(Option<Bytes>),
    Stream {
        rx: mpsc::Receiver<Bytes>,
        _slot: Option<GetSlot>,
    },
}

impl DemoBody {
    fn empty() -> Self {
        Self {
            kind: BodyKind::Full(None),
        }
    }

    fn full(bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        let kind = if bytes.is_empty() {
            BodyKind::Full(None)
        } else {
            BodyKind::Full(Some(bytes))
        };
        Self { kind }
    }

    fn stream(rx: mpsc::Receiver<Bytes>, slot: Option<GetSlot>) -> Self {
        Self {
            kind: BodyKind::Stream { rx, _slot: slot },
        }
    }
}

impl Body for DemoBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.get_mut().kind {
            BodyKind::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            BodyKind::Stream { rx, .. } => rx
                .poll_recv(cx)
                .map(|chunk| chunk.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.kind, BodyKind::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            BodyKind::Full(None) => SizeHint::with_exact(0),
            BodyKind::Full(Some(bytes)) => SizeHint::with_exact(bytes.len() as u64),
            BodyKind::Stream { .. } => SizeHint::default(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Response helpers
// ---------------------------------------------------------------------------------------------

fn set_session_header(resp: &mut Response<DemoBody>, session: &str) {
    if let Ok(value) = HeaderValue::from_str(session) {
        resp.headers_mut().insert(SESSION_HEADER, value);
    }
}

/// An HTTP error answered with a JSON-RPC error object (`id: null`), like the SDKs do.
fn http_error(status: StatusCode, code: i64, message: &str) -> Response<DemoBody> {
    let body = json!({"jsonrpc": "2.0", "id": null, "error": {"code": code, "message": message}});
    let mut resp = Response::new(DemoBody::full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn sse_response(session: &str, body: DemoBody) -> Response<DemoBody> {
    let mut resp = Response::new(body);
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    set_session_header(&mut resp, session);
    resp
}

/// One SSE event carrying a JSON-RPC message. Deliberately no `id:` line.
fn sse_event(message: &Value) -> Bytes {
    // serde_json escapes newlines inside strings, so the payload is always one `data:` line.
    Bytes::from(format!("event: message\ndata: {message}\n\n"))
}

fn result_message(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

fn error_message(id: &Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

/// True when every media type in `wanted` appears in the request's `Accept` header(s).
fn accepts_all(headers: &HeaderMap, wanted: &[&str]) -> bool {
    let mut found = vec![false; wanted.len()];
    for value in headers.get_all(header::ACCEPT) {
        let Ok(value) = value.to_str() else { continue };
        for part in value.split(',') {
            let media = part.split(';').next().unwrap_or_default().trim();
            for (slot, want) in found.iter_mut().zip(wanted) {
                if media.eq_ignore_ascii_case(want) {
                    *slot = true;
                }
            }
        }
    }
    found.iter().all(|f| *f)
}

fn is_json_content_type(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or_default().trim())
        .is_some_and(|media| media.eq_ignore_ascii_case("application/json"))
}

/// Why a request's `Mcp-Session-Id` was rejected.
enum SessionError {
    /// No header: 400.
    Missing,
    /// Not a session we know (never was, or deleted): 404.
    Unknown,
}

impl SessionError {
    fn into_response(self) -> Response<DemoBody> {
        match self {
            SessionError::Missing => http_error(
                StatusCode::BAD_REQUEST,
                -32000,
                "Bad Request: No valid session ID provided",
            ),
            SessionError::Unknown => session_not_found(),
        }
    }
}

/// Validates `Mcp-Session-Id`: missing → 400, unknown → 404.
fn require_session(
    state: &State,
    headers: &HeaderMap,
) -> Result<(String, watch::Receiver<bool>), SessionError> {
    let raw = headers.get(SESSION_HEADER).ok_or(SessionError::Missing)?;
    raw.to_str()
        .ok()
        .and_then(|id| state.lookup(id).map(|closed| (id.to_owned(), closed)))
        .ok_or(SessionError::Unknown)
}

fn session_not_found() -> Response<DemoBody> {
    http_error(StatusCode::NOT_FOUND, -32001, "Session not found")
}

// ---------------------------------------------------------------------------------------------
// Request handling
// ---------------------------------------------------------------------------------------------

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<DemoBody> {
    let claimed_session = req
        .headers()
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut resp = match *req.method() {
        Method::POST => handle_post(state.clone(), req).await,
        Method::GET => handle_get(&state, req.headers()),
        Method::DELETE => handle_delete(&state, req.headers()),
        _ => {
            let mut resp = http_error(
                StatusCode::METHOD_NOT_ALLOWED,
                -32000,
                "Method not allowed.",
            );
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, POST, DELETE"));
            resp
        }
    };
    // Every response that belongs to a live session echoes its id, whichever check answered.
    if let Some(session) = claimed_session {
        if !resp.headers().contains_key(SESSION_HEADER) && state.lookup(&session).is_some() {
            set_session_header(&mut resp, &session);
        }
    }
    resp
}

/// One classified JSON-RPC message from a POST body.
enum Message {
    Request {
        id: Value,
        method: String,
        params: Value,
    },
    /// Notifications and responses: accepted and otherwise ignored.
    Other,
}

fn classify(value: Value) -> Option<Message> {
    let Value::Object(mut obj) = value else {
        return None;
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return None;
    }
    match (obj.remove("method"), obj.remove("id")) {
        (Some(Value::String(method)), Some(id)) if id.is_string() || id.is_number() => {
            let params = obj.remove("params").unwrap_or(Value::Null);
            Some(Message::Request { id, method, params })
        }
        (Some(Value::String(_)), None) => Some(Message::Other),
        (None, Some(_)) if obj.contains_key("result") || obj.contains_key("error") => {
            Some(Message::Other)
        }
        _ => None,
    }
}

async fn handle_post(state: Arc<State>, req: Request<Incoming>) -> Response<DemoBody> {
    let (parts, body) = req.into_parts();
    if !accepts_all(&parts.headers, &["application/json", "text/event-stream"]) {
        return http_error(
            StatusCode::NOT_ACCEPTABLE,
            -32000,
            "Not Acceptable: Client must accept both application/json and text/event-stream",
        );
    }
    if !is_json_content_type(&parts.headers) {
        return http_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            -32000,
            "Unsupported Media Type: Content-Type must be application/json",
        );
    }
    let bytes = match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => {
            return http_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                -32000,
                "Payload Too Large: request body exceeds 4 MiB",
            );
        }
        Err(err) => {
            tracing::debug!(error = %err, "demo upstream: reading request body failed");
            return http_error(StatusCode::BAD_REQUEST, -32700, "Parse error");
        }
    };
    let Ok(parsed) = serde_json::from_slice::<Value>(&bytes) else {
        return http_error(StatusCode::BAD_REQUEST, -32700, "Parse error");
    };
    let raw_messages = match parsed {
        Value::Array(items) if !items.is_empty() => items,
        single @ Value::Object(_) => vec![single],
        _ => {
            return http_error(StatusCode::BAD_REQUEST, -32600, "Invalid Request");
        }
    };
    let Some(messages) = raw_messages
        .into_iter()
        .map(classify)
        .collect::<Option<Vec<_>>>()
    else {
        return http_error(StatusCode::BAD_REQUEST, -32600, "Invalid Request");
    };

    let is_initialize =
        |m: &Message| matches!(m, Message::Request { method, .. } if method == "initialize");
    if messages.iter().any(is_initialize) {
        if messages.len() > 1 {
            return http_error(
                StatusCode::BAD_REQUEST,
                -32600,
                "Invalid Request: Only one initialization request is allowed",
            );
        }
        return match messages.into_iter().next() {
            Some(Message::Request { id, params, .. }) => initialize(&state, &id, &params),
            _ => http_error(StatusCode::BAD_REQUEST, -32600, "Invalid Request"),
        };
    }

    let (session, closed) = match require_session(&state, &parts.headers) {
        Ok(found) => found,
        Err(err) => return err.into_response(),
    };

    let requests: Vec<(Value, String, Value)> = messages
        .into_iter()
        .filter_map(|m| match m {
            Message::Request { id, method, params } => Some((id, method, params)),
            Message::Other => None,
        })
        .collect();
    if requests.is_empty() {
        let mut resp = Response::new(DemoBody::empty());
        *resp.status_mut() = StatusCode::ACCEPTED;
        set_session_header(&mut resp, &session);
        return resp;
    }

    // One producer task per request, all writing to this response's stream; the stream ends
    // when the last of them finishes and drops its sender.
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    for (id, method, params) in requests {
        let writer = SseWriter::new(tx.clone(), closed.clone());
        let ctx = RequestCtx {
            state: state.clone(),
            session: session.clone(),
        };
        tokio::spawn(run_request(ctx, writer, id, method, params));
    }
    drop(tx);
    sse_response(&session, DemoBody::stream(rx, None))
}

fn initialize(state: &State, id: &Value, params: &Value) -> Response<DemoBody> {
    let requested = params.get("protocolVersion").and_then(Value::as_str);
    let version = requested
        .filter(|v| SUPPORTED_VERSIONS.contains(v))
        .unwrap_or(LATEST_VERSION);
    let (session, _closed) = match state.create_session() {
        Ok(created) => created,
        Err(err) => {
            tracing::warn!(error = %err, "demo upstream: cannot generate a session id");
            return http_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                -32603,
                "Internal error: cannot create session",
            );
        }
    };
    let result = json!({
        "protocolVersion": version,
        "capabilities": {"tools": {}, "logging": {}},
        "serverInfo": {"name": "mcp-reattach-demo", "version": env!("CARGO_PKG_VERSION")},
    });
    let event = sse_event(&result_message(id, result));
    sse_response(&session, DemoBody::full(event))
}

fn handle_get(state: &Arc<State>, headers: &HeaderMap) -> Response<DemoBody> {
    if !accepts_all(headers, &["text/event-stream"]) {
        return http_error(
            StatusCode::NOT_ACCEPTABLE,
            -32000,
            "Not Acceptable: Client must accept text/event-stream",
        );
    }
    let (session, _) = match require_session(state, headers) {
        Ok(found) => found,
        Err(err) => return err.into_response(),
    };
    // Like the TS SDK without an event store: `Last-Event-ID` is ignored and this is simply a
    // new standalone stream.
    let (slot, closed) = match state.claim_get(&session) {
        Ok(claimed) => claimed,
        Err(ClaimError::Unknown) => return session_not_found(),
        Err(ClaimError::Busy) => {
            let mut resp = http_error(
                StatusCode::CONFLICT,
                -32000,
                "Conflict: Only one SSE stream is allowed per session",
            );
            set_session_header(&mut resp, &session);
            return resp;
        }
    };
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let writer = SseWriter::new(tx, closed);
    tokio::spawn(run_standalone_stream(
        state.clone(),
        session.clone(),
        writer,
    ));
    sse_response(&session, DemoBody::stream(rx, Some(slot)))
}

fn handle_delete(state: &State, headers: &HeaderMap) -> Response<DemoBody> {
    let (session, _) = match require_session(state, headers) {
        Ok(found) => found,
        Err(err) => return err.into_response(),
    };
    if !state.remove(&session) {
        return session_not_found();
    }
    let mut resp = Response::new(DemoBody::empty());
    set_session_header(&mut resp, &session);
    resp
}

// ---------------------------------------------------------------------------------------------
// Stream producers
// ---------------------------------------------------------------------------------------------

/// Writes SSE chunks to one response; every write reports whether the stream is still alive
/// (client connected and session not ended).
struct SseWriter {
    tx: mpsc::Sender<Bytes>,
    closed: watch::Receiver<bool>,
    last_write: Instant,
}

impl SseWriter {
    fn new(tx: mpsc::Sender<Bytes>, closed: watch::Receiver<bool>) -> Self {
        Self {
            tx,
            closed,
            last_write: Instant::now(),
        }
    }

    async fn write(&mut self, chunk: Bytes) -> bool {
        let sent = tokio::select! {
            res = self.tx.send(chunk) => res.is_ok(),
            () = session_closed(&mut self.closed) => false,
        };
        self.last_write = Instant::now();
        sent
    }

    async fn message(&mut self, message: &Value) -> bool {
        self.write(sse_event(message)).await
    }

    /// Waits until `deadline`, sending `: ping` whenever the stream has been silent for
    /// [`POST_PING_AFTER`]. Returns false as soon as the stream is gone.
    async fn wait_until(&mut self, deadline: Instant) -> bool {
        loop {
            let ping_at = self.last_write + POST_PING_AFTER;
            let wake = deadline.min(ping_at);
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = self.tx.closed() => return false,
                () = session_closed(&mut self.closed) => return false,
            }
            if wake == deadline {
                return true;
            }
            if !self.write(Bytes::from_static(b": ping\n\n")).await {
                return false;
            }
        }
    }
}

struct RequestCtx {
    state: Arc<State>,
    session: String,
}

async fn run_request(
    ctx: RequestCtx,
    mut out: SseWriter,
    id: Value,
    method: String,
    params: Value,
) {
    let reply = match method.as_str() {
        "ping" => result_message(&id, json!({})),
        "tools/list" => result_message(&id, tools_list()),
        "logging/setLevel" => {
            let level = params.get("level").and_then(Value::as_str);
            match level.and_then(|l| LOG_LEVELS.iter().position(|known| *known == l)) {
                Some(index) => {
                    ctx.state.set_log_level(&ctx.session, index);
                    result_message(&id, json!({}))
                }
                None => error_message(&id, -32602, "Invalid params: unknown logging level"),
            }
        }
        "tools/call" => match call_tool(&mut out, &id, &params).await {
            Some(reply) => reply,
            // The stream went away mid-call; nothing left to write to.
            None => return,
        },
        _ => error_message(&id, -32601, &format!("Method not found: {method}")),
    };
    out.message(&reply).await;
}

fn tools_list() -> Value {
    json!({
        "tools": [
            {
                "name": "countdown",
                "description": "Counts down slowly, sending a progress notification per step \
                                (when the call carries a progressToken), then returns.",
                "inputSchema": {
                    "type": "object",
                    "properties": {
                        "steps": {
                            "type": "integer",
                            "description": "Number of steps",
                            "default": 10,
                            "minimum": 0,
                            "maximum": MAX_STEPS,
                        },
                        "interval_ms": {
                            "type": "integer",
                            "description": "Milliseconds between steps",
                            "default": 500,
                            "minimum": 0,
                            "maximum": MAX_INTERVAL_MS,
                        },
                    },
                },
            },
            {
                "name": "echo",
                "description": "Returns the given text.",
                "inputSchema": {
                    "type": "object",
                    "properties": {"text": {"type": "string", "description": "Text to echo"}},
                    "required": ["text"],
                },
            },
        ]
    })
}

fn text_result(text: &str) -> Value {
    json!({"content": [{"type": "text", "text": text}]})
}

fn int_arg(args: &Value, key: &str, default: u64, max: u64) -> Result<u64, String> {
    match args.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(value) => value
            .as_u64()
            .filter(|n| *n <= max)
            .ok_or_else(|| format!("Invalid params: `{key}` must be an integer from 0 to {max}")),
    }
}

/// Runs a `tools/call`; returns the final JSON-RPC response, or `None` if the stream died
/// while the tool was still running.
async fn call_tool(out: &mut SseWriter, id: &Value, params: &Value) -> Option<Value> {
    let name = params
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let args = params.get("arguments").unwrap_or(&Value::Null);
    match name {
        "echo" => Some(match args.get("text").and_then(Value::as_str) {
            Some(text) => result_message(id, text_result(text)),
            None => error_message(id, -32602, "Invalid params: `text` must be a string"),
        }),
        "countdown" => {
            let steps = int_arg(args, "steps", 10, MAX_STEPS);
            let interval = int_arg(args, "interval_ms", 500, MAX_INTERVAL_MS);
            let (steps, interval_ms) = match (steps, interval) {
                (Ok(s), Ok(i)) => (s, i),
                (Err(msg), _) | (_, Err(msg)) => return Some(error_message(id, -32602, &msg)),
            };
            let token = params
                .get("_meta")
                .and_then(|meta| meta.get("progressToken"))
                .filter(|t| t.is_string() || t.is_number());
            let interval = Duration::from_millis(interval_ms);
            let mut deadline = Instant::now();
            for step in 1..=steps {
                deadline += interval;
                if !out.wait_until(deadline).await {
                    return None;
                }
                if let Some(token) = token {
                    let progress = json!({
                        "jsonrpc": "2.0",
                        "method": "notifications/progress",
                        "params": {
                            "progressToken": token,
                            "progress": step,
                            "total": steps,
                            "message": format!("step {step} of {steps}"),
                        },
                    });
                    if !out.message(&progress).await {
                        return None;
                    }
                }
            }
            let text = format!("countdown finished after {steps} steps");
            Some(result_message(id, text_result(&text)))
        }
        _ => Some(error_message(
            id,
            -32602,
            &format!("Invalid params: unknown tool `{name}`"),
        )),
    }
}

/// The standalone GET stream: `: keepalive` every [`GET_KEEPALIVE`], an info-level
/// `notifications/message` every [`GET_TICK`], until the client or the session goes away.
async fn run_standalone_stream(state: Arc<State>, session: String, mut out: SseWriter) {
    let start = Instant::now();
    let mut keepalive = tokio::time::interval_at(start + GET_KEEPALIVE, GET_KEEPALIVE);
    let mut ticks = tokio::time::interval_at(start + GET_TICK, GET_TICK);
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut closed = out.closed.clone();
    let mut n: u64 = 0;
    loop {
        let chunk = tokio::select! {
            _ = keepalive.tick() => Bytes::from_static(b": keepalive\n\n"),
            _ = ticks.tick() => {
                n += 1;
                if state.log_level(&session) > LEVEL_INFO {
                    continue;
                }
                sse_event(&json!({
                    "jsonrpc": "2.0",
                    "method": "notifications/message",
                    "params": {"level": "info", "logger": "demo", "data": format!("tick {n}")},
                }))
            }
            () = out.tx.closed() => break,
            () = session_closed(&mut closed) => break,
        };
        if !out.write(chunk).await {
            break;
        }
    }
}
