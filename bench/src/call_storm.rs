//! The worst minute (issue 50): N sessions, each with a tool call in flight whose upstream
//! streams progress events for seconds; once every session has read a few of them, every
//! client connection is cut at once (reset, as a load balancer that loses its state does; a
//! hook runs first, to kill a replica); then every session resumes at once with `GET` +
//! `Mcp-Session-Id` + `Last-Event-ID`, as every SDK client does, and again after any later
//! cut, until it has the call's result or an explicit error. It honours `Retry-After` on a 503
//! or 429 and the SSE `retry:` field, and counts everything else as the clients would feel it.
//!
//! Per call it checks every progress event exactly once, in order, then the result (or, for a
//! call whose replica was killed, the explicit JSON-RPC error); it counts duplicates, silent
//! gaps, lost calls and every HTTP status, times the resumes (from each `GET` to its
//! `mcp-reattach/resumed` event, and from the cut to the last one served), and samples the
//! RSS and CPU of the gateway processes it is told about from `/proc`.
//!
//! Self-contained (std, tokio, serde_json; its own HTTP/1.1 reader and SSE parser): the load
//! client's `call-storm` mode (`bench/src/bin/load.rs`) and the CI test (`tests/storm.rs`,
//! which includes this file) run the same code. The upstream must answer `tools/call` with
//! `arguments` `{events, size, gap_us}` by an SSE stream of `events` progress notifications
//! carrying `params.data.seq` 0, 1, … (`gap_us` apart), then the result: what
//! `bench/src/bin/mock-upstream.rs` does, and the test's upstream with [`progress_data`] and
//! [`result_data`].

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{watch, Semaphore};

/// The gateway's event that opens a re-attached stream.
pub const RESUMED: &str = "mcp-reattach/resumed";
/// The protocol version the sessions speak (no priming events: the gateway's first event on a
/// call's stream is its first progress event).
pub const PROTOCOL_VERSION: &str = "2025-06-18";

/// What a storm does, and its bounds.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where sessions go: session `i` is created and calls through `targets[i % len]`; each
    /// resume goes to the next target in the list (a refused connection moves on at once), so
    /// with several replicas no call is resumed on the replica that runs it.
    pub targets: Vec<SocketAddr>,
    pub path: String,
    pub sessions: usize,
    /// Progress events per call, and the upstream's pause before each (and before the result).
    pub events: u64,
    pub gap_us: u64,
    /// `data` bytes per progress event (the mock pads to it).
    pub size: usize,
    /// The cut comes once every session has read this many progress events.
    pub cut_after: u64,
    /// Sessions being set up at once.
    pub concurrency: usize,
    /// The cut comes after this long at the latest, ready or not.
    pub setup_ms: u64,
    /// Every session has its outcome within this long after the cut, or its call is lost.
    pub max_ms: u64,
    /// Resume requests (GETs sent) per session at most.
    pub max_attempts: u32,
    /// Wait before a reconnect when the server gave no `retry:` (real SDK clients wait 1 s;
    /// 0 is the worst case: everyone at once).
    pub reconnect_ms: u64,
    /// The target killed by the cut hook, if any: its calls may end in the explicit error.
    pub killed: Option<usize>,
    /// The target has no resumption (nginx): lost calls are reported, not failed.
    pub no_resumption: bool,
    /// Fail when the last `resumed` comes later than this after the cut.
    pub bound_ms: Option<u64>,
    /// Gateway processes to sample (RSS, CPU), with the target each serves (`None`: all).
    pub watch: Vec<(u32, Option<usize>)>,
    /// Each session its own principal (`Authorization: Bearer storm-<i>`), as users are;
    /// otherwise every session is the same anonymous caller.
    pub principals: bool,
}

impl Config {
    pub fn new(targets: Vec<SocketAddr>) -> Config {
        Config {
            targets,
            path: "/mcp".into(),
            sessions: 1000,
            events: 40,
            gap_us: 150_000,
            size: 200,
            cut_after: 2,
            concurrency: 64,
            setup_ms: 30_000,
            max_ms: 20_000,
            max_attempts: 20,
            reconnect_ms: 0,
            killed: None,
            no_resumption: false,
            bound_ms: None,
            watch: Vec::new(),
            principals: true,
        }
    }
}

/// `data` of progress event `seq` as the mock writes it (a `notifications/message`).
pub fn progress_data(seq: u64) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"level":"info","data":{{"seq":{seq},"ts":0,"pad":""}}}}}}"#
    )
}

/// `data` of the result of request `id` (JSON text) after `events` progress events.
pub fn result_data(id: &str, events: u64) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[],"seq":{events},"ts":0}}}}"#)
}

// ---------------------------------------------------------------------------------------------
// HTTP/1.1: requests, response heads, bodies
// ---------------------------------------------------------------------------------------------

fn request(
    method: &str,
    path: &str,
    host: SocketAddr,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Vec<u8> {
    let accept = if method == "GET" {
        "text/event-stream"
    } else {
        "application/json, text/event-stream"
    };
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nAccept: {accept}\r\n");
    if method == "POST" {
        r.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    r.push_str("\r\n");
    let mut out = r.into_bytes();
    out.extend_from_slice(body);
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(usize),
    Chunked,
    Close,
}

#[derive(Debug)]
struct Head {
    status: u16,
    headers: Vec<(String, String)>,
    framing: Framing,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn is_sse(&self) -> bool {
        self.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"))
    }
}

fn parse_head(text: &str) -> io::Result<Head> {
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or("");
    let status = first
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::other(format!("bad status line {first:?}")))?;
    let mut headers = Vec::new();
    let mut framing = Framing::Close;
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim().to_owned(), v.trim().to_owned());
            if k.eq_ignore_ascii_case("content-length") {
                if let Ok(n) = v.parse() {
                    framing = Framing::Length(n);
                }
            } else if k.eq_ignore_ascii_case("transfer-encoding")
                && v.to_ascii_lowercase().contains("chunked")
            {
                framing = Framing::Chunked;
            }
            headers.push((k, v));
        }
    }
    if status == 204 || status == 304 || (100..200).contains(&status) {
        framing = Framing::Length(0);
    }
    Ok(Head {
        status,
        headers,
        framing,
    })
}

/// Where a body's decoder is.
#[derive(Debug, Clone, Copy)]
enum Body {
    /// Bytes left of a `Content-Length` body.
    Length(usize),
    /// Chunked: before a size line, inside a chunk (bytes left), at a chunk's CRLF, in the
    /// trailer.
    Size,
    Data(usize),
    DataEnd,
    Trailer,
    Close,
    Done,
}

impl Body {
    fn new(f: Framing) -> Body {
        match f {
            Framing::Length(0) => Body::Done,
            Framing::Length(n) => Body::Length(n),
            Framing::Chunked => Body::Size,
            Framing::Close => Body::Close,
        }
    }
}

struct Conn {
    tcp: TcpStream,
    buf: Vec<u8>,
    pos: usize,
}

impl Conn {
    async fn connect(addr: SocketAddr) -> io::Result<Conn> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        Ok(Conn {
            tcp,
            buf: Vec::with_capacity(8192),
            pos: 0,
        })
    }

    async fn send(&mut self, req: &[u8]) -> io::Result<()> {
        self.tcp.write_all(req).await
    }

    /// One read into the buffer; false at EOF.
    async fn fill(&mut self) -> io::Result<bool> {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.reserve(8192);
        Ok(self.tcp.read_buf(&mut self.buf).await? > 0)
    }

    async fn head(&mut self) -> io::Result<Head> {
        loop {
            let avail = &self.buf[self.pos..];
            if let Some(end) = avail.windows(4).position(|w| w == b"\r\n\r\n") {
                let text = String::from_utf8_lossy(&avail[..end]).into_owned();
                self.pos += end + 4;
                return parse_head(&text);
            }
            if !self.fill().await? {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed before a response head",
                ));
            }
        }
    }

    /// Decodes what is buffered of the body into `out`; reads once first when nothing is.
    /// Ok(false) at the body's end.
    async fn body(&mut self, st: &mut Body, out: &mut Vec<u8>) -> io::Result<bool> {
        if matches!(st, Body::Done) {
            return Ok(false);
        }
        if self.pos == self.buf.len() && !self.fill().await? {
            if matches!(st, Body::Close) {
                *st = Body::Done;
                return Ok(false);
            }
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed inside a body",
            ));
        }
        loop {
            let avail = &self.buf[self.pos..];
            if avail.is_empty() {
                return Ok(true);
            }
            match *st {
                Body::Done => return Ok(false),
                Body::Close => {
                    out.extend_from_slice(avail);
                    self.pos = self.buf.len();
                }
                Body::Length(left) => {
                    let n = avail.len().min(left);
                    out.extend_from_slice(&avail[..n]);
                    self.pos += n;
                    *st = if left == n {
                        Body::Done
                    } else {
                        Body::Length(left - n)
                    };
                }
                Body::Size => {
                    let Some(nl) = avail.iter().position(|&b| b == b'\n') else {
                        return Ok(true);
                    };
                    let line = String::from_utf8_lossy(&avail[..nl]);
                    let hex = line.trim().split(';').next().unwrap_or("").trim();
                    let n = usize::from_str_radix(hex, 16)
                        .map_err(|_| io::Error::other(format!("bad chunk size {line:?}")))?;
                    self.pos += nl + 1;
                    *st = if n == 0 { Body::Trailer } else { Body::Data(n) };
                }
                Body::Data(left) => {
                    let n = avail.len().min(left);
                    out.extend_from_slice(&avail[..n]);
                    self.pos += n;
                    *st = if left == n {
                        Body::DataEnd
                    } else {
                        Body::Data(left - n)
                    };
                }
                Body::DataEnd | Body::Trailer => {
                    let Some(nl) = avail.iter().position(|&b| b == b'\n') else {
                        return Ok(true);
                    };
                    let empty = avail[..nl].iter().all(|&b| b == b'\r');
                    self.pos += nl + 1;
                    *st = match *st {
                        Body::DataEnd => Body::Size,
                        _ if empty => Body::Done,
                        _ => Body::Trailer,
                    };
                }
            }
        }
    }

    /// The whole body (at most 1 MiB).
    async fn body_to_end(&mut self, framing: Framing) -> io::Result<Vec<u8>> {
        let mut st = Body::new(framing);
        let mut out = Vec::new();
        while self.body(&mut st, &mut out).await? {
            if out.len() > 1 << 20 {
                return Err(io::Error::other("a body over 1 MiB"));
            }
        }
        Ok(out)
    }

    /// Closes with a reset (SO_LINGER 0), as a load balancer that lost its state does.
    fn reset(self) {
        #[allow(deprecated)] // set_linger(0) closes with RST: exactly what is wanted here
        let _ = self.tcp.set_linger(Some(Duration::ZERO));
        drop(self.tcp);
    }
}

// ---------------------------------------------------------------------------------------------
// SSE
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Event {
    id: Option<String>,
    event: Option<String>,
    data: Option<String>,
    retry: Option<u64>,
}

/// An SSE stream over a response body.
struct Sse {
    conn: Conn,
    body: Body,
    parser: Parser,
}

impl Sse {
    fn new(conn: Conn, head: &Head) -> Sse {
        Sse {
            conn,
            body: Body::new(head.framing),
            parser: Parser::default(),
        }
    }

    /// The next event; Ok(None) when the body ends.
    async fn next(&mut self) -> io::Result<Option<Event>> {
        loop {
            if let Some(ev) = self.parser.parse_one() {
                return Ok(Some(ev));
            }
            if !self
                .conn
                .body(&mut self.body, &mut self.parser.pending)
                .await?
            {
                return Ok(self.parser.parse_one());
            }
        }
    }
}

/// The SSE parser: LF, CRLF or CR line ends, multi-line data, comments.
#[derive(Default)]
struct Parser {
    /// Decoded body bytes not yet parsed into lines.
    pending: Vec<u8>,
    ev: Event,
    /// The previous line ended with CR (a following LF belongs to it).
    after_cr: bool,
}

impl Parser {
    /// Parses buffered lines until an event is complete.
    fn parse_one(&mut self) -> Option<Event> {
        let mut start = 0;
        let mut out = None;
        while out.is_none() {
            let rest = &self.pending[start..];
            if self.after_cr && rest.first() == Some(&b'\n') {
                start += 1;
                self.after_cr = false;
                continue;
            }
            let Some(end) = rest.iter().position(|&b| b == b'\n' || b == b'\r') else {
                break;
            };
            self.after_cr = rest[end] == b'\r';
            let line = String::from_utf8_lossy(&rest[..end]).into_owned();
            start += end + 1;
            if line.is_empty() {
                let ev = std::mem::take(&mut self.ev);
                if ev.id.is_some() || ev.event.is_some() || ev.data.is_some() || ev.retry.is_some()
                {
                    out = Some(ev);
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (name, value) = match line.split_once(':') {
                Some((n, v)) => (n.to_owned(), v.strip_prefix(' ').unwrap_or(v).to_owned()),
                None => (line.clone(), String::new()),
            };
            match name.as_str() {
                "id" => self.ev.id = Some(value),
                "event" => self.ev.event = Some(value),
                "data" => match &mut self.ev.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(&value);
                    }
                    None => self.ev.data = Some(value),
                },
                "retry" => self.ev.retry = value.parse().ok(),
                _ => {}
            }
        }
        self.pending.drain(..start);
        out
    }
}

// ---------------------------------------------------------------------------------------------
// One session
// ---------------------------------------------------------------------------------------------

/// How a call ended for its client.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    /// The result, after every progress event.
    Result,
    /// A JSON-RPC error for the call: code, `data.reason`, message.
    Error {
        code: i64,
        reason: String,
        message: String,
    },
    /// A resume refused with this status (and the JSON-RPC error's reason, if any).
    Refused { status: u16, reason: String },
    /// Nothing by the deadline (or the attempts ran out).
    Lost(String),
    /// The session or its call did not start.
    SetupFailed(String),
    /// The call ended before the cut: the storm did not cover it.
    FinishedBeforeCut,
}

#[derive(Debug)]
struct Session {
    i: usize,
    home: usize,
    principal: Option<String>,
    sid: String,
    call_id: u64,
    cursor: Option<String>,
    retry_ms: Option<u64>,
    next_seq: u64,
    progress: u64,
    duplicates: u64,
    skipped: u64,
    result_seq: Option<u64>,
    outcome: Option<Outcome>,
    control: BTreeMap<String, u64>,
    statuses: BTreeMap<u16, u64>,
    unexpected_5xx: u64,
    retry_after_honoured: u64,
    retry_after_missing: u64,
    retry_hints: u64,
    refused_connects: u64,
    connection_errors: u64,
    gets: u32,
    /// GETs answered 200 with an SSE body that did not begin with `resumed` (the gateway never
    /// answers a resume so), and GETs that got no head at all (their connection failed).
    sse_without_resumed: u64,
    headless: u64,
    /// (GET sent → its `resumed` event) for every resume served, in ns.
    resume_ns: Vec<u64>,
    /// When the first and the last `resumed` event after the cut arrived.
    first_resumed: Option<Instant>,
    last_resumed: Option<Instant>,
    done_at: Option<Instant>,
}

/// What one event did to the call.
enum Seen {
    Nothing,
    Resumed,
    Progress,
    Done,
}

impl Session {
    fn headers(&self) -> Vec<(&str, &str)> {
        let mut h = vec![
            ("Mcp-Session-Id", self.sid.as_str()),
            ("MCP-Protocol-Version", PROTOCOL_VERSION),
        ];
        if let Some(p) = &self.principal {
            h.push(("Authorization", p.as_str()));
        }
        h
    }

    fn on_event(&mut self, ev: Event) -> Seen {
        if let Some(id) = ev.id {
            // Every id is the cursor, whatever the event (as the SDK clients keep it).
            self.cursor = Some(id);
        }
        if let Some(r) = ev.retry {
            self.retry_ms = Some(r);
            self.retry_hints += 1;
        }
        let kind = ev.event.as_deref().unwrap_or("message");
        if kind != "message" {
            *self.control.entry(kind.to_owned()).or_default() += 1;
            return if kind == RESUMED {
                Seen::Resumed
            } else {
                Seen::Nothing
            };
        }
        let Some(data) = ev.data.filter(|d| !d.is_empty()) else {
            return Seen::Nothing;
        };
        let v: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
        if let Some(method) = v.get("method").and_then(Value::as_str) {
            let Some(seq) = v.pointer("/params/data/seq").and_then(Value::as_u64) else {
                *self
                    .control
                    .entry(format!("notification {method}"))
                    .or_default() += 1;
                return Seen::Nothing;
            };
            if seq < self.next_seq {
                self.duplicates += 1;
            } else {
                self.skipped += seq - self.next_seq;
                self.next_seq = seq + 1;
                self.progress += 1;
            }
            return Seen::Progress;
        }
        if v.get("id").and_then(Value::as_u64) != Some(self.call_id) {
            *self.control.entry("unexpected message".into()).or_default() += 1;
            return Seen::Nothing;
        }
        if self.outcome.is_some() {
            // A second answer to the call.
            self.duplicates += 1;
            return Seen::Done;
        }
        if let Some(r) = v.get("result") {
            self.result_seq = r.get("seq").and_then(Value::as_u64);
            self.outcome = Some(Outcome::Result);
        } else {
            let e = &v["error"];
            self.outcome = Some(Outcome::Error {
                code: e["code"].as_i64().unwrap_or(0),
                reason: e
                    .pointer("/data/reason")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
                message: e["message"].as_str().unwrap_or("").to_owned(),
            });
        }
        Seen::Done
    }
}

/// The run's shared signals.
struct Shared {
    cfg: Config,
    sem: Semaphore,
    /// Sessions that have read `cut_after` events (or will never: their setup failed, their
    /// call ended).
    ready: AtomicUsize,
    /// Sessions out of their first stream (cut, or it ended by itself).
    out: AtomicUsize,
    cut: watch::Receiver<bool>,
    go: watch::Receiver<bool>,
    t0: Instant,
    /// Ns after `t0` of the cut (0: not yet).
    cut_ns: AtomicU64,
}

impl Shared {
    fn cut_at(&self) -> Instant {
        self.t0 + Duration::from_nanos(self.cut_ns.load(Ordering::Acquire))
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn rpc(method: &str, params: Value) -> (u64, Vec<u8>) {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
    (id, serde_json::to_vec(&body).unwrap_or_default())
}

/// Initialize, then the call; returns its stream once the head is in.
async fn setup(sh: &Shared, s: &mut Session) -> Result<Sse, String> {
    let cfg = &sh.cfg;
    let target = cfg.targets[s.home];
    let mut c = Conn::connect(target)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (_, body) = rpc(
        "initialize",
        json!({"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
            "clientInfo": {"name": "call-storm", "version": "0"}}),
    );
    let mut h: Vec<(&str, &str)> = Vec::new();
    if let Some(p) = &s.principal {
        h.push(("Authorization", p));
    }
    c.send(&request("POST", &cfg.path, target, &h, &body))
        .await
        .map_err(|e| format!("initialize: {e}"))?;
    let head = c.head().await.map_err(|e| format!("initialize: {e}"))?;
    *s.statuses.entry(head.status).or_default() += 1;
    let sid = head
        .header("mcp-session-id")
        .ok_or_else(|| format!("initialize: status {} without a session", head.status))?
        .to_owned();
    c.body_to_end(head.framing)
        .await
        .map_err(|e| format!("initialize body: {e}"))?;
    s.sid = sid;
    let (id, body) = rpc(
        "tools/call",
        json!({"name": "stream", "arguments":
            {"events": cfg.events, "size": cfg.size, "gap_us": cfg.gap_us}}),
    );
    s.call_id = id;
    c.send(&request("POST", &cfg.path, target, &s.headers(), &body))
        .await
        .map_err(|e| format!("call: {e}"))?;
    let head = c.head().await.map_err(|e| format!("call: {e}"))?;
    *s.statuses.entry(head.status).or_default() += 1;
    if head.status != 200 || !head.is_sse() {
        return Err(format!("call: status {} (not an SSE stream)", head.status));
    }
    Ok(Sse::new(c, &head))
}

/// The session's whole life: setup, its first stream until the cut, then resumes until the
/// call's outcome.
async fn session(sh: Arc<Shared>, i: usize) -> Session {
    let cfg = &sh.cfg;
    let n = cfg.targets.len();
    let mut s = Session {
        i,
        home: i % n,
        principal: cfg.principals.then(|| format!("Bearer storm-{i}")),
        sid: String::new(),
        call_id: 0,
        cursor: None,
        retry_ms: None,
        next_seq: 0,
        progress: 0,
        duplicates: 0,
        skipped: 0,
        result_seq: None,
        outcome: None,
        control: BTreeMap::new(),
        statuses: BTreeMap::new(),
        unexpected_5xx: 0,
        retry_after_honoured: 0,
        retry_after_missing: 0,
        retry_hints: 0,
        refused_connects: 0,
        connection_errors: 0,
        gets: 0,
        sse_without_resumed: 0,
        headless: 0,
        resume_ns: Vec::new(),
        first_resumed: None,
        last_resumed: None,
        done_at: None,
    };
    let mut ready = false;
    let mark_ready = |ready: &mut bool| {
        if !*ready {
            *ready = true;
            sh.ready.fetch_add(1, Ordering::AcqRel);
        }
    };
    // Setup, a bounded number at a time.
    let stream = {
        let _permit = sh.sem.acquire().await;
        tokio::time::timeout(Duration::from_millis(cfg.setup_ms), setup(&sh, &mut s))
            .await
            .unwrap_or_else(|_| Err("setup timed out".into()))
    };
    let mut stream = match stream {
        Ok(st) => Some(st),
        Err(e) => {
            s.outcome = Some(Outcome::SetupFailed(e));
            None
        }
    };
    // The first stream, until the cut.
    let mut cut = sh.cut.clone();
    if let Some(st) = stream.as_mut() {
        loop {
            if *cut.borrow_and_update() {
                break;
            }
            tokio::select! {
                biased;
                _ = cut.changed() => break,
                r = st.next() => match r {
                    Ok(Some(ev)) => {
                        if let Seen::Done = s.on_event(ev) {
                            break;
                        }
                        if s.progress >= cfg.cut_after {
                            mark_ready(&mut ready);
                        }
                    }
                    // It ended, or the replica was killed: resumed with everyone else.
                    Ok(None) | Err(_) => break,
                },
            }
        }
    }
    if let Some(st) = stream.take() {
        st.conn.reset();
    }
    if s.outcome == Some(Outcome::Result) || matches!(s.outcome, Some(Outcome::Error { .. })) {
        if sh.cut_ns.load(Ordering::Acquire) == 0 {
            s.outcome = Some(Outcome::FinishedBeforeCut);
        }
        s.done_at = Some(Instant::now());
    }
    mark_ready(&mut ready);
    sh.out.fetch_add(1, Ordering::AcqRel);
    if s.outcome.is_some() {
        return s;
    }
    // Every session resumes together.
    let mut go = sh.go.clone();
    while !*go.borrow_and_update() {
        if go.changed().await.is_err() {
            break;
        }
    }
    resume(&sh, &mut s).await;
    s
}

/// Resumes until the call's outcome, the deadline, or the attempts run out.
async fn resume(sh: &Shared, s: &mut Session) {
    let cfg = &sh.cfg;
    let n = cfg.targets.len();
    let deadline = sh.cut_at() + Duration::from_millis(cfg.max_ms);
    let mut k = 0usize;
    let mut refused_in_a_row = 0usize;
    // The wait before the next attempt.
    let mut wait = Duration::ZERO;
    loop {
        if s.outcome.is_some() {
            s.done_at = Some(Instant::now());
            return;
        }
        if !wait.is_zero() {
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(wait.min(left)).await;
            wait = Duration::ZERO;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            s.outcome = Some(Outcome::Lost(format!(
                "no outcome {} ms after the cut",
                cfg.max_ms
            )));
            return;
        }
        if s.gets >= cfg.max_attempts {
            s.outcome = Some(Outcome::Lost(format!("{} resumes", s.gets)));
            return;
        }
        k += 1;
        let target = cfg.targets[(s.home + k) % n];
        let mut c = match tokio::time::timeout(left, Conn::connect(target)).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                // A dead replica refuses; the next one is tried at once (a load balancer's
                // retry), and after a full round the reconnect wait applies.
                if e.kind() == io::ErrorKind::ConnectionRefused {
                    s.refused_connects += 1;
                } else {
                    s.connection_errors += 1;
                }
                refused_in_a_row += 1;
                if refused_in_a_row >= n {
                    refused_in_a_row = 0;
                    wait = Duration::from_millis(s.retry_ms.unwrap_or(cfg.reconnect_ms).max(100));
                }
                continue;
            }
            Err(_) => continue,
        };
        refused_in_a_row = 0;
        s.gets += 1;
        let mut h = s.headers();
        let cursor = s.cursor.clone();
        if let Some(c) = &cursor {
            h.push(("Last-Event-ID", c));
        }
        let req = request("GET", &cfg.path, target, &h, b"");
        let sent = Instant::now();
        let head = match tokio::time::timeout(left, async {
            c.send(&req).await?;
            c.head().await
        })
        .await
        {
            Ok(Ok(head)) => head,
            Ok(Err(_)) => {
                s.connection_errors += 1;
                s.headless += 1;
                wait = Duration::from_millis(s.retry_ms.unwrap_or(cfg.reconnect_ms));
                continue;
            }
            Err(_) => {
                s.headless += 1;
                continue;
            }
        };
        *s.statuses.entry(head.status).or_default() += 1;
        match head.status {
            200 if head.is_sse() => {
                let mut st = Sse::new(c, &head);
                let deadline_left = deadline.saturating_duration_since(Instant::now());
                // Whether this answer began with `resumed`, as every resume the gateway
                // serves does; one that did not is counted once.
                let mut resumed_here = false;
                let read = tokio::time::timeout(deadline_left, async {
                    loop {
                        match st.next().await {
                            Ok(Some(ev)) => match s.on_event(ev) {
                                Seen::Resumed => {
                                    resumed_here = true;
                                    let now = Instant::now();
                                    s.resume_ns.push((now - sent).as_nanos() as u64);
                                    s.first_resumed.get_or_insert(now);
                                    s.last_resumed = Some(now);
                                }
                                Seen::Done => return true,
                                Seen::Progress if !resumed_here => {
                                    s.sse_without_resumed += 1;
                                    resumed_here = true;
                                }
                                Seen::Nothing | Seen::Progress => {}
                            },
                            Ok(None) => return false,
                            Err(_) => {
                                s.connection_errors += 1;
                                return false;
                            }
                        }
                    }
                })
                .await;
                if !resumed_here {
                    s.sse_without_resumed += 1;
                }
                if !matches!(read, Ok(true)) {
                    // Cut again, or the stream ended without the answer: resume again.
                    wait = Duration::from_millis(s.retry_ms.unwrap_or(cfg.reconnect_ms));
                }
            }
            503 | 429 => {
                match head
                    .header("retry-after")
                    .and_then(|v| v.trim().parse::<u64>().ok())
                {
                    Some(secs) => {
                        s.retry_after_honoured += 1;
                        wait = Duration::from_secs(secs);
                    }
                    None => {
                        s.retry_after_missing += 1;
                        wait = Duration::from_secs(1);
                    }
                }
            }
            st if st >= 500 => {
                s.unexpected_5xx += 1;
                wait = Duration::from_millis(s.retry_ms.unwrap_or(1000));
            }
            status => {
                let body =
                    tokio::time::timeout(Duration::from_secs(2), c.body_to_end(head.framing))
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .unwrap_or_default();
                let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let reason = v
                    .pointer("/error/data/reason")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                s.outcome = Some(Outcome::Refused { status, reason });
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// /proc
// ---------------------------------------------------------------------------------------------

/// `VmRSS` of a process in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// On-CPU ns of a process's live threads (`/proc/PID/task/*/schedstat`).
pub fn cpu_ns(pid: u32) -> Option<u64> {
    let rd = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    Some(
        rd.flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum(),
    )
}

#[derive(Debug, Clone, Default)]
struct Sample {
    rss_cut: Option<u64>,
    rss_peak: u64,
    rss_end: Option<u64>,
    cpu_cut: Option<u64>,
    cpu_end: Option<u64>,
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

fn pct(v: &mut [u64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    v[i] as f64 / 1e6
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}

/// Runs the storm; `on_cut` runs at the cut, just before the client's own sockets are reset
/// (kill a replica there). Returns one JSON object; `checks.ok` says whether it held.
pub async fn run(cfg: Config, on_cut: Box<dyn FnOnce() + Send>) -> Value {
    assert!(!cfg.targets.is_empty(), "call-storm: no target");
    let (cut_tx, cut_rx) = watch::channel(false);
    let (go_tx, go_rx) = watch::channel(false);
    let t0 = Instant::now();
    let sh = Arc::new(Shared {
        sem: Semaphore::new(cfg.concurrency.max(1)),
        ready: AtomicUsize::new(0),
        out: AtomicUsize::new(0),
        cut: cut_rx,
        go: go_rx,
        t0,
        cut_ns: AtomicU64::new(0),
        cfg: cfg.clone(),
    });
    let tasks: Vec<_> = (0..cfg.sessions)
        .map(|i| tokio::spawn(session(sh.clone(), i)))
        .collect();
    // The cut: when every session has read its first events, or at the setup's bound.
    let setup_deadline = t0 + Duration::from_millis(cfg.setup_ms);
    while sh.ready.load(Ordering::Acquire) < cfg.sessions && Instant::now() < setup_deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ready_at_cut = sh.ready.load(Ordering::Acquire);
    let setup_s = t0.elapsed().as_secs_f64();
    let mut samples: Vec<Sample> = cfg
        .watch
        .iter()
        .map(|&(pid, _)| Sample {
            rss_cut: rss_kib(pid),
            rss_peak: rss_kib(pid).unwrap_or(0),
            cpu_cut: cpu_ns(pid),
            ..Sample::default()
        })
        .collect();
    let cut_at = Instant::now();
    sh.cut_ns
        .store((cut_at - t0).as_nanos().max(1) as u64, Ordering::Release);
    on_cut();
    let _ = cut_tx.send(true);
    // Every connection is reset before anyone reconnects (bounded: 2 s).
    let out_deadline = Instant::now() + Duration::from_secs(2);
    while sh.out.load(Ordering::Acquire) < cfg.sessions && Instant::now() < out_deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let all_cut_ms = ms(cut_at.elapsed());
    let _ = go_tx.send(true);
    // Sample the gateways while the sessions resume.
    let mut results = Vec::with_capacity(tasks.len());
    let mut pending = tasks.into_iter();
    let mut next = pending.next();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    while let Some(t) = next.as_mut() {
        tokio::select! {
            r = t => {
                if let Ok(s) = r {
                    results.push(s);
                }
                next = pending.next();
            }
            _ = tick.tick() => {
                for (smp, &(pid, _)) in samples.iter_mut().zip(&cfg.watch) {
                    if let Some(r) = rss_kib(pid) {
                        smp.rss_peak = smp.rss_peak.max(r);
                    }
                }
            }
        }
    }
    for (smp, &(pid, _)) in samples.iter_mut().zip(&cfg.watch) {
        smp.rss_end = rss_kib(pid);
        smp.cpu_end = cpu_ns(pid);
        if let Some(r) = smp.rss_end {
            smp.rss_peak = smp.rss_peak.max(r);
        }
    }
    report(
        &cfg,
        &results,
        cut_at,
        setup_s,
        ready_at_cut,
        all_cut_ms,
        &samples,
    )
}

fn report(
    cfg: &Config,
    results: &[Session],
    cut_at: Instant,
    setup_s: f64,
    ready_at_cut: usize,
    all_cut_ms: f64,
    samples: &[Sample],
) -> Value {
    let since_cut = |t: Option<Instant>| t.map(|t| ms(t.saturating_duration_since(cut_at)));
    let mut outcomes: BTreeMap<&str, u64> = BTreeMap::new();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut refusals: BTreeMap<String, u64> = BTreeMap::new();
    let mut statuses: BTreeMap<String, u64> = BTreeMap::new();
    let mut control: BTreeMap<String, u64> = BTreeMap::new();
    let mut resume_ns: Vec<u64> = Vec::new();
    let mut examples: Vec<String> = Vec::new();
    let (mut progress, mut duplicates, mut skipped, mut bad_result) = (0, 0, 0, 0);
    let (mut unexpected_5xx, mut ra_honoured, mut ra_missing, mut hints) = (0, 0, 0, 0);
    let (mut refused_connects, mut conn_errors, mut gets, mut max_gets) = (0, 0, 0, 0);
    let (mut live_not_delivered, mut killed_delivered, mut killed_errors) = (0, 0, 0);
    let (mut last_resumed, mut last_first_resumed, mut last_done) = (None, None, None);
    let mut last_error = None;
    let mut not_resumed = 0;
    let (mut sse_without_resumed, mut headless) = (0, 0);
    for s in results {
        sse_without_resumed += s.sse_without_resumed;
        headless += s.headless;
        progress += s.progress;
        duplicates += s.duplicates;
        skipped += s.skipped;
        unexpected_5xx += s.unexpected_5xx;
        ra_honoured += s.retry_after_honoured;
        ra_missing += s.retry_after_missing;
        hints += s.retry_hints;
        refused_connects += s.refused_connects;
        conn_errors += s.connection_errors;
        gets += u64::from(s.gets);
        max_gets = max_gets.max(s.gets);
        resume_ns.extend(&s.resume_ns);
        for (k, v) in &s.statuses {
            *statuses.entry(k.to_string()).or_default() += v;
        }
        for (k, v) in &s.control {
            *control.entry(k.clone()).or_default() += v;
        }
        last_resumed = last_resumed.max(s.last_resumed);
        last_first_resumed = last_first_resumed.max(s.first_resumed);
        last_done = last_done.max(s.done_at);
        let on_killed = cfg.killed == Some(s.home);
        let key = match &s.outcome {
            Some(Outcome::Result) => {
                if s.progress != cfg.events || s.result_seq != Some(cfg.events) {
                    bad_result += 1;
                }
                if on_killed {
                    killed_delivered += 1;
                }
                "delivered"
            }
            Some(Outcome::Error {
                code,
                reason,
                message,
            }) => {
                let cause = if message.contains("owner-lost") {
                    " owner-lost"
                } else {
                    ""
                };
                *errors.entry(format!("{code} {reason}{cause}")).or_default() += 1;
                last_error = last_error.max(s.done_at);
                if on_killed {
                    killed_errors += 1;
                } else {
                    live_not_delivered += 1;
                }
                "explicit_error"
            }
            Some(Outcome::Refused { status, reason }) => {
                *refusals.entry(format!("{status} {reason}")).or_default() += 1;
                "refused"
            }
            Some(Outcome::Lost(why)) => {
                if examples.len() < 3 {
                    examples.push(format!("session {} lost: {why}", s.i));
                }
                "lost"
            }
            Some(Outcome::SetupFailed(why)) => {
                if examples.len() < 3 {
                    examples.push(format!("session {} setup: {why}", s.i));
                }
                "setup_failed"
            }
            Some(Outcome::FinishedBeforeCut) => "finished_before_cut",
            None => "none",
        };
        *outcomes.entry(key).or_default() += 1;
        if s.gets > 0 && s.resume_ns.is_empty() {
            not_resumed += 1;
        }
    }
    let mut failures: Vec<String> = Vec::new();
    let count = |k: &str| outcomes.get(k).copied().unwrap_or(0);
    if results.len() < cfg.sessions {
        failures.push(format!(
            "error: {} session task(s) panicked",
            cfg.sessions - results.len()
        ));
    }
    for (k, what) in [
        ("setup_failed", "session(s) did not start their call"),
        ("finished_before_cut", "call(s) ended before the cut"),
        ("none", "session(s) without an outcome"),
    ] {
        if count(k) > 0 {
            failures.push(format!("setup: {} {what}", count(k)));
        }
    }
    if !cfg.no_resumption {
        if count("lost") > 0 {
            failures.push(format!(
                "lost: {} call(s) without an outcome",
                count("lost")
            ));
        }
        if count("refused") > 0 {
            failures.push(format!("refused: {refusals:?}"));
        }
    }
    if duplicates > 0 {
        failures.push(format!(
            "duplicate: {duplicates} event(s) or answer(s) twice"
        ));
    }
    if skipped > 0 {
        failures.push(format!("gap: {skipped} event(s) skipped without an error"));
    }
    if bad_result > 0 {
        failures.push(format!(
            "missing events: {bad_result} result(s) without every event before them"
        ));
    }
    if sse_without_resumed > 0 {
        failures.push(format!(
            "answers: {sse_without_resumed} resume(s) answered 200 without `resumed` first"
        ));
    }
    if unexpected_5xx > 0 || ra_missing > 0 {
        failures.push(format!(
            "5xx: {unexpected_5xx} other than 503 + Retry-After, {ra_missing} 503/429 without \
             Retry-After ({statuses:?})"
        ));
    }
    if live_not_delivered > 0 {
        failures.push(format!(
            "error: {live_not_delivered} call(s) of live replicas ended in an error ({errors:?})"
        ));
    }
    let last_resumed_ms = since_cut(last_resumed);
    if let (Some(bound), Some(last)) = (cfg.bound_ms, last_resumed_ms) {
        if last > bound as f64 {
            failures.push(format!(
                "slow: the last resume was served {last} ms after the cut (bound {bound} ms)"
            ));
        }
    }
    if !failures.is_empty() {
        failures.extend(examples.iter().map(|e| format!("example: {e}")));
    }
    let gateways: Vec<Value> = samples
        .iter()
        .zip(&cfg.watch)
        .map(|(s, &(pid, target))| {
            let killed = target.is_some() && target == cfg.killed;
            json!({
                "pid": pid,
                "target": target.map(|t| cfg.targets[t].to_string()),
                "killed": killed,
                "rss_kib_at_cut": s.rss_cut,
                "rss_kib_peak": s.rss_peak,
                "rss_kib_end": s.rss_end,
                // A killed process's threads are gone: nothing to tell.
                "cpu_ms_cut_to_end": match (s.cpu_cut, s.cpu_end) {
                    (Some(a), Some(b)) if !killed => Some((b.saturating_sub(a)) as f64 / 1e6),
                    _ => None,
                },
            })
        })
        .collect();
    let n = resume_ns.len();
    json!({
        "mode": "call-storm",
        "sessions": cfg.sessions,
        "targets": cfg.targets.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "killed_target": cfg.killed,
        "events_per_call": cfg.events,
        "gap_us": cfg.gap_us,
        "cut_after": cfg.cut_after,
        "setup_s": (setup_s * 1e3).round() / 1e3,
        "ready_at_cut": ready_at_cut,
        "all_connections_cut_ms": all_cut_ms,
        "outcomes": outcomes,
        "explicit_errors": errors,
        "refusals": refusals,
        "killed_calls": {"delivered": killed_delivered, "explicit_error": killed_errors},
        "progress_events": progress,
        "duplicates": duplicates,
        "skipped": skipped,
        "statuses": statuses,
        "unexpected_5xx": unexpected_5xx,
        "retry_after_honoured": ra_honoured,
        "retry_after_missing": ra_missing,
        "retry_hints": hints,
        "refused_connects": refused_connects,
        "connection_errors": conn_errors,
        "resume_gets": gets,
        "max_gets_per_session": max_gets,
        "gets_without_resumed": not_resumed,
        "sse_without_resumed": sse_without_resumed,
        "gets_without_head": headless,
        "control_events": control,
        "resumes_served": n,
        "resume_ms": {
            "p50": pct(&mut resume_ns, 0.50),
            "p99": pct(&mut resume_ns, 0.99),
            "max": pct(&mut resume_ns, 1.0),
        },
        "cut_to_last_resumed_ms": last_resumed_ms,
        "cut_to_every_session_resumed_ms": since_cut(last_first_resumed),
        "cut_to_last_outcome_ms": since_cut(last_done),
        "cut_to_last_explicit_error_ms": since_cut(last_error),
        "gateways": gateways,
        "examples": examples,
        "checks": {"ok": failures.is_empty(), "failures": failures},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(pieces: &[&[u8]]) -> Vec<(Option<String>, Option<String>, Option<String>)> {
        let mut p = Parser::default();
        let mut out = Vec::new();
        for piece in pieces {
            p.pending.extend_from_slice(piece);
            while let Some(ev) = p.parse_one() {
                out.push((ev.id, ev.event, ev.data));
            }
        }
        out
    }

    #[test]
    fn sse_any_split_and_line_end() {
        for nl in ["\n", "\r\n", "\r"] {
            let text = format!(
                ": ka{nl}{nl}id: 1.2.3{nl}event: mcp-reattach/resumed{nl}data: {{}}{nl}{nl}data: a{nl}data: b{nl}{nl}"
            );
            let b = text.as_bytes();
            let whole = events(&[b]);
            assert_eq!(whole.len(), 2, "{nl:?}");
            assert_eq!(whole[0].0.as_deref(), Some("1.2.3"));
            assert_eq!(whole[1].2.as_deref(), Some("a\nb"));
            for i in 0..=b.len() {
                assert_eq!(events(&[&b[..i], &b[i..]]), whole, "{nl:?} split at {i}");
            }
        }
    }
}
