//! Issue 22 against the real binary: a bounded attacker on loopback tries to exhaust one of the
//! gateway's resources, and a legitimate client is still served during the attack and loses
//! nothing. Each case runs the binary with a small limit (`prlimit --nofile`, a flag) in front of
//! this file's own upstream, which never runs out of anything first.

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

use support::*;

/// A stateful legacy MCP server that never gives up a connection first: `initialize` gets a
/// new session id (JSON answer), `GET` an SSE stream it holds open, a `tools/call` of `slow` an
/// SSE head and then nothing, of `echo` its result on SSE; everything else 202 (a DELETE 200).
/// Counts the connections it has open.
struct Server {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    _task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start() -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let counted = open.clone();
        let task = tokio::spawn(async move {
            let sessions = Arc::new(AtomicU64::new(0));
            while let Ok((tcp, _)) = listener.accept().await {
                let _ = tcp.set_nodelay(true);
                let (sessions, open) = (sessions.clone(), counted.clone());
                tokio::spawn(async move {
                    open.fetch_add(1, Ordering::SeqCst);
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let sessions = sessions.clone();
                        async move { Ok::<_, Infallible>(answer(req, &sessions).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Server {
            addr,
            open,
            _task: task,
        }
    }
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

async fn answer(req: Request<Incoming>, sessions: &AtomicU64) -> Response<Body> {
    let method = req.method().clone();
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let sse = |frames: Option<String>| {
        let body: Body = match frames {
            Some(f) => Full::new(Bytes::from(f)).boxed(),
            // Open until the gateway closes the connection.
            None => http_body_util::StreamBody::new(futures::stream::pending::<
                Result<Frame<Bytes>, Infallible>,
            >())
            .boxed(),
        };
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(body)
            .unwrap()
    };
    if method == Method::GET {
        return sse(None);
    }
    let empty = |status: u16| {
        Response::builder()
            .status(status)
            .body(Full::new(Bytes::new()).boxed())
            .unwrap()
    };
    if method != Method::POST {
        return empty(200);
    }
    let msg: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let id = msg["id"].clone();
    match (msg["method"].as_str(), msg["params"]["name"].as_str()) {
        (Some("initialize"), _) => {
            let n = sessions.fetch_add(1, Ordering::SeqCst);
            let result = serde_json::json!({"jsonrpc":"2.0","id":id,"result":{
                "protocolVersion":"2025-06-18","capabilities":{},
                "serverInfo":{"name":"exhaustion","version":"0"}}});
            Response::builder()
                .header("content-type", "application/json")
                .header("mcp-session-id", format!("up-{n}"))
                .body(Full::new(Bytes::from(result.to_string())).boxed())
                .unwrap()
        }
        (Some("tools/call"), Some("slow")) => sse(None),
        (Some("tools/call"), _) => {
            let result = serde_json::json!({"jsonrpc":"2.0","id":id,"result":{
                "content":[{"type":"text","text":"echoed"}]}});
            sse(Some(format!("event: message\ndata: {result}\n\n")))
        }
        _ => empty(202),
    }
}

/// `initialize` through the gateway at `addr`: its session id, or the status it got.
async fn initialize(addr: SocketAddr) -> Result<String, String> {
    let resp = tokio::time::timeout(WAIT, try_send(addr, post(INITIALIZE, None)))
        .await
        .map_err(|_| "no answer in time".to_owned())??;
    let sid = match resp.headers().get("mcp-session-id") {
        Some(sid) if resp.status() == 200 => sid.to_str().unwrap().to_owned(),
        _ => return Err(format!("status {}", resp.status())),
    };
    // The session starts in earnest (the gateway holds its standalone stream from here).
    let initialized = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
    let resp = tokio::time::timeout(WAIT, try_send(addr, post(initialized, Some(&sid))))
        .await
        .map_err(|_| "no answer to initialized in time".to_owned())??;
    match resp.status().as_u16() {
        202 => Ok(sid),
        status => Err(format!("initialized: status {status}")),
    }
}

/// One request on a fresh connection, or why it got no answer.
async fn try_send(
    addr: SocketAddr,
    req: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, String> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    try_send_on(tcp, req).await
}

/// One request on `tcp`, or why it got no answer.
async fn try_send_on(
    tcp: TcpStream,
    req: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, String> {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    sender
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"))
}

fn tool_call(id: u64, name: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{name}"}}}}"#)
}

/// The legitimate client: a session of its own, a tool call answered in full.
async fn legitimate_call(addr: SocketAddr) -> Result<String, String> {
    let sid = initialize(addr).await?;
    let resp = tokio::time::timeout(
        WAIT,
        try_send(addr, post(&tool_call(7, "echo"), Some(&sid))),
    )
    .await
    .map_err(|_| "the call got no answer in time".to_owned())??;
    if resp.status() != 200 {
        return Err(format!("the call got status {}", resp.status()));
    }
    let body = tokio::time::timeout(WAIT, resp.into_body().collect())
        .await
        .map_err(|_| "the call's stream did not end in time".to_owned())?
        .map_err(|e| format!("reading the call's stream: {e}"))?
        .to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    if body.contains("echoed") {
        Ok(body)
    } else {
        Err(format!("no result in the call's stream: {body}"))
    }
}

/// Issue 22 item 1: upstream connections the gateway holds with no client (each session's held
/// standalone GET, tool calls whose client left after the response head) are bounded, and the
/// bound fits the process's open-file limit: with 256 fds, 300 sessions and 40 abandoned calls
/// used to take every fd (59 of the 300 initializes and the legitimate client's got 502, the
/// upstream saw 242 connections). Now 256 fds give 96 client and 96 upstream connections, the
/// held streams take 72 of those, one session's abandoned calls 8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_streams_and_abandoned_calls_cannot_take_every_fd() {
    let server = Server::start().await;
    let gw = Binary::start_with_nofile(
        server.addr,
        256,
        &["--session-ttl", "2m", "--max-detached-calls", "8"],
    )
    .await;
    let addr = gw.addr;
    // The attack, bounded in count: 300 sessions (each one's standalone stream is held)...
    let mut refused = 0;
    for _ in 0..300 {
        if initialize(addr).await.is_err() {
            refused += 1;
        }
    }
    // ... and 40 slow calls in one session, each client gone once its head arrived.
    let sid = initialize(addr).await;
    let mut heads = Vec::new();
    if let Ok(sid) = &sid {
        for id in 1..=40 {
            let req = post(&tool_call(id, "slow"), Some(sid));
            match tokio::time::timeout(WAIT, try_send(addr, req)).await {
                Ok(Ok(resp)) => heads.push(resp.status().as_u16()),
                _ => heads.push(0),
            }
        }
    }
    let metrics = gw.admin_get("/metrics").await.unwrap_or_default();
    eprintln!(
        "attack done: {refused} of 300 initializes refused, call heads {heads:?}, upstream connections open {}, gateway metrics: upstream_connections {:?}",
        server.open.load(Ordering::SeqCst),
        metric_sum(&metrics, "mcp_reattach_upstream_connections"),
    );
    // The legitimate client is served in full, while all of that is still held.
    let served = legitimate_call(addr).await;
    assert!(served.is_ok(), "the legitimate client: {served:?}");
    // The bound held: the gateway's upstream connections fit its fds.
    let open = metric_sum(&metrics, "mcp_reattach_upstream_connections")
        .expect("the upstream connections gauge");
    let cap = metric_sum(&metrics, "mcp_reattach_upstream_connections_max")
        .expect("the upstream connections cap");
    assert!(open <= cap && cap < 256.0, "open {open}, cap {cap}");
    assert!(
        server.open.load(Ordering::SeqCst) < 256,
        "the upstream saw {} connections",
        server.open.load(Ordering::SeqCst)
    );
    // One session's abandoned calls are bounded on their own: the last ones were refused.
    assert_eq!(heads.first(), Some(&200), "{heads:?}");
    assert_eq!(heads.last(), Some(&429), "{heads:?}");
}

fn with_auth(mut req: Request<Full<Bytes>>, token: &str) -> Request<Full<Bytes>> {
    req.headers_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req
}

/// Issue 22 item 6: one caller holding a client on every session it can get (`--max-sessions`
/// of them, each with an idle GET open) used to make every other caller's `initialize` a 503;
/// now the share over its part loses one of its sessions to a caller within its part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_caller_holding_every_session_cannot_lock_out_another() {
    let server = Server::start().await;
    let gw = Binary::start(server.addr, &["--max-sessions", "10"]).await;
    let addr = gw.addr;
    let init = |token: &'static str| async move {
        let resp = try_send(addr, with_auth(post(INITIALIZE, None), token)).await?;
        let sid = resp
            .headers()
            .get("mcp-session-id")
            .filter(|_| resp.status() == 200)
            .ok_or_else(|| format!("status {}", resp.status()))?
            .to_str()
            .unwrap()
            .to_owned();
        let note = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        try_send(addr, with_auth(post(note, Some(&sid)), token)).await?;
        Ok::<_, String>(sid)
    };
    // The attacker: 10 sessions, an idle GET held open on each (its client attached).
    let mut held = Vec::new();
    for _ in 0..10 {
        let sid = init("attacker").await.expect("the attacker's sessions");
        let resp = try_send(addr, with_auth(get(&sid, None), "attacker"))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        held.push(resp);
    }
    let refused = init("attacker").await;
    assert!(
        refused.as_deref().is_err_and(|e| e.contains("503")),
        "the attacker's own 11th: {refused:?}"
    );
    // Another caller still gets a session, and a call answered in it.
    let sid = init("legit").await;
    assert!(sid.is_ok(), "the legitimate caller's initialize: {sid:?}");
    let resp = try_send(
        addr,
        with_auth(post(&tool_call(7, "echo"), Some(&sid.unwrap())), "legit"),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("echoed"));
    drop(held);
}

/// A caller of the fair-share tests: anonymous on a loopback address of its own (the gateway
/// counts an anonymous caller by its address), or with a bearer token.
#[derive(Clone, Copy, Debug)]
enum Caller {
    Anonymous(std::net::IpAddr),
    Bearer(&'static str),
}

/// One request of `caller` on a fresh connection, or why it got no answer.
async fn send_as(
    addr: SocketAddr,
    caller: Caller,
    req: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, String> {
    let from = match caller {
        Caller::Bearer(token) => return try_send(addr, with_auth(req, token)).await,
        Caller::Anonymous(from) => from,
    };
    let socket = tokio::net::TcpSocket::new_v4().map_err(|e| format!("socket: {e}"))?;
    socket
        .bind(SocketAddr::new(from, 0))
        .map_err(|e| format!("bind {from}: {e}"))?;
    let tcp = socket
        .connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    try_send_on(tcp, req).await
}

/// `caller` initializes a session and gets a call answered in full in it; or the first
/// answer that was not right.
async fn served(addr: SocketAddr, caller: Caller) -> Result<(), String> {
    let step = |what: &'static str, req| async move {
        tokio::time::timeout(WAIT, send_as(addr, caller, req))
            .await
            .map_err(|_| format!("{what}: no answer in time"))?
            .map_err(|e| format!("{what}: {e}"))
    };
    let resp = step("initialize", post(INITIALIZE, None)).await?;
    let sid = match resp.headers().get("mcp-session-id") {
        Some(sid) if resp.status() == 200 => sid.to_str().unwrap().to_owned(),
        _ => return Err(format!("initialize: status {}", resp.status())),
    };
    let note = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
    let resp = step("initialized", post(note, Some(&sid))).await?;
    if resp.status() != 202 {
        return Err(format!("initialized: status {}", resp.status()));
    }
    let resp = step("the call", post(&tool_call(7, "echo"), Some(&sid))).await?;
    if resp.status() != 200 {
        return Err(format!("the call: status {}", resp.status()));
    }
    let body = tokio::time::timeout(WAIT, resp.into_body().collect())
        .await
        .map_err(|_| "the call's stream did not end in time".to_owned())?
        .map_err(|e| format!("reading the call's stream: {e}"))?
        .to_bytes();
    match String::from_utf8_lossy(&body).contains("echoed") {
        true => Ok(()),
        false => Err(format!("no result in the call's stream: {body:?}")),
    }
}

/// Issue 46 item 4: one anonymous caller's slow calls, detached once their heads came, took
/// every upstream connection (4 sessions of 32 calls filled `--max-upstream-connections 100`),
/// and every other caller's initialize and calls got 503 for as long as the tools ran. Now
/// each share (a principal, or an anonymous caller's address) has a fair part of the bound:
/// the attacker's calls past its part get 503, and another anonymous caller and an
/// authenticated one are served in full while all of the attacker's calls still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_caller_cannot_take_every_upstream_connection() {
    let server = Server::start().await;
    let gw = Binary::start(
        server.addr,
        &[
            "--max-upstream-connections",
            "40",
            "--hold-standalone",
            "false",
        ],
    )
    .await;
    let addr = gw.addr;
    let attacker = Caller::Anonymous([127, 0, 0, 1].into());
    // The attack, bounded in count: 2 sessions of 30 slow calls, each client gone once its
    // call's head arrived.
    let mut sids = Vec::new();
    for _ in 0..2 {
        sids.push(initialize(addr).await.expect("the attacker's sessions"));
    }
    let mut heads = Vec::new();
    for sid in &sids {
        for id in 1..=30 {
            let req = post(&tool_call(id, "slow"), Some(sid));
            match tokio::time::timeout(WAIT, send_as(addr, attacker, req)).await {
                Ok(Ok(resp)) => heads.push(resp.status().as_u16()),
                _ => heads.push(0),
            }
        }
    }
    let running = heads.iter().filter(|&&h| h == 200).count();
    eprintln!(
        "attack done: {running} slow calls running, heads {heads:?}, upstream connections open {}",
        server.open.load(Ordering::SeqCst)
    );
    for other in [
        Caller::Anonymous([127, 0, 0, 2].into()),
        Caller::Bearer("legit"),
    ] {
        let got = served(addr, other).await;
        assert!(
            got.is_ok(),
            "{other:?} while the attacker's calls run: {got:?}"
        );
    }
    // The attacker's calls are all still running, and those past its part were refused.
    assert!(
        server.open.load(Ordering::SeqCst) >= running,
        "the upstream holds the attacker's calls"
    );
    assert!(running >= 20, "the attacker's part: {heads:?}");
    assert_eq!(heads.last(), Some(&503), "{heads:?}");
    assert!(heads.iter().all(|&h| h == 200 || h == 503), "{heads:?}");
}

/// Issue 22 item 3: `--max-connections` h2c connections that each sent one request and then
/// nothing held the gateway for good (HTTP/2 had no idle timeout); now each is closed after
/// `--idle-timeout` and a legitimate client waiting in the listen backlog is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_h2c_connections_cannot_hold_every_connection_slot() {
    let server = Server::start().await;
    let gw = Binary::start(
        server.addr,
        &["--max-connections", "4", "--idle-timeout", "1s"],
    )
    .await;
    let addr = gw.addr;
    let ping = r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#;
    let mut idle = Vec::new();
    for _ in 0..4 {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (mut h2, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            TokioIo::new(tcp),
        )
        .await
        .unwrap();
        let conn = tokio::spawn(conn);
        let mut req = post(ping, None);
        *req.version_mut() = http::Version::HTTP_2;
        *req.uri_mut() = format!("http://{addr}/mcp").parse().unwrap();
        req.headers_mut().remove("host");
        let resp = tokio::time::timeout(WAIT, h2.send_request(req)).await;
        assert!(matches!(resp, Ok(Ok(_))), "the attacker's request");
        idle.push((h2, conn));
    }
    // Every slot is taken by an idle connection; the legitimate client waits, then is served.
    let started = tokio::time::Instant::now();
    let served = legitimate_call(addr).await;
    assert!(served.is_ok(), "the legitimate client: {served:?}");
    let waited = started.elapsed();
    eprintln!("the legitimate client was served after {waited:?}");
    assert!(
        waited >= Duration::from_millis(500),
        "it did wait: {waited:?}"
    );
    for (_, conn) in idle {
        let closed = tokio::time::timeout(Duration::from_secs(3), conn).await;
        assert!(closed.is_ok(), "the idle connection was closed");
    }
}

/// A reconnect storm larger than tokio's default listen backlog (1,024): with every
/// `--max-connections` slot taken, 1,500 clients connecting at once all complete the TCP
/// handshake and wait in the backlog (the gateway listens with 4,096, the kernel's default
/// `net.core.somaxconn`); with 1,024 the rest had their SYNs dropped and retried for seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_beyond_a_1024_backlog_waits_in_the_backlog() {
    const STORM: usize = 1_500;
    let somaxconn = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok());
    assert!(
        somaxconn.is_some_and(|n| n > STORM),
        "net.core.somaxconn {somaxconn:?} caps every backlog below the storm"
    );
    // The storm's sockets are this process's fds.
    rlimit::increase_nofile_limit(4 * STORM as u64).unwrap();
    let server = Server::start().await;
    let gw = Binary::start(server.addr, &["--max-connections", "1"]).await;
    // The one slot: a connection that sends nothing (held until --header-read-timeout, 10 s).
    let held = TcpStream::connect(gw.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let storm: Vec<_> = (0..STORM)
        .map(|_| tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(gw.addr)))
        .collect();
    let results = futures::future::join_all(storm).await;
    let connected = results.iter().filter(|r| matches!(r, Ok(Ok(_)))).count();
    assert_eq!(
        connected, STORM,
        "connections that completed their handshake within 3 s"
    );
    drop(held);
}
