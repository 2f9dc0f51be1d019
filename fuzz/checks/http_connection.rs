//! A whole client connection through the real gateway (HTTP/1.1, or h2c when the bytes start
//! with the HTTP/2 preface) in front of a stub upstream, all in this process on 127.0.0.1:0.
//!
//! Input: `[mode][bytes written on a fresh TCP connection to the gateway...]`. Mode bit 0:
//! half-close the connection after writing (else keep it open); bits 1-2: write in one
//! piece, in 7-byte pieces, or in pieces at each LF.
//!
//! Then read what the gateway sends until its outcome is known: the gateway closed the
//! connection, or it fell silent for 50 ms while still holding it (an open connection waiting
//! for a next request, or an SSE stream, which the gateway keeps open after the client's
//! half-close by design, so no close will come); 2 s at most.
//!
//! Properties: no panic anywhere in the gateway (libFuzzer's panic hook aborts on a panic in
//! any task; outside libFuzzer, where tokio would catch a task's panic, the check counts the
//! panics on the gateway's runtime threads), no response that is not HTTP, and after every
//! input the gateway still answers a normal `initialize` on a new connection within 5 s.
//!
//! Shared by the fuzz target (`fuzz/fuzz_targets/http_connection.rs`) and the corpus replay
//! (`tests/fast/fuzz_corpora.rs`), so every input the fuzzer ever kept stays a regression test.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

struct Harness {
    rt: tokio::runtime::Runtime,
    gateway: SocketAddr,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// The name of the gateway's runtime threads (workers and blocking pool).
const GATEWAY_THREAD: &str = "fuzz-gateway";

/// Panics on the gateway's runtime threads since the harness started.
static GATEWAY_PANICS: AtomicUsize = AtomicUsize::new(0);

/// The stub upstream: POST `initialize` → JSON with a session id; other POST and GET → a
/// short SSE response (CRLF, an upstream id, a comment) that ends; DELETE → 200; else 200 JSON.
async fn upstream(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let sid = parts
        .headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("fz-{}", COUNTER.fetch_add(1, Ordering::Relaxed) % 32));
    let text = String::from_utf8_lossy(&body);
    let mut b = Response::builder().header("mcp-session-id", sid.as_str());
    let resp = match parts.method {
        http::Method::POST if text.contains("\"initialize\"") => b
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(
                br#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-11-25","capabilities":{},"serverInfo":{"name":"stub","version":"0"}}}"#,
            ))),
        http::Method::POST | http::Method::GET => b
            .header("content-type", "text/event-stream")
            .body(Full::new(Bytes::from_static(
                b": hello\r\nid: up-1\r\nevent: message\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progressToken\":1,\"progress\":1}}\r\n\r\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\r\n\r\n",
            ))),
        http::Method::DELETE => b.body(Full::new(Bytes::new())),
        _ => {
            b = b.header("content-type", "application/json");
            b.body(Full::new(Bytes::from_static(b"{}")))
        }
    };
    Ok(resp.unwrap())
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        // Count the gateway's panics, then do whatever the hook before did (under libFuzzer:
        // abort; in a test: print the message).
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some(GATEWAY_THREAD) {
                GATEWAY_PANICS.fetch_add(1, Ordering::SeqCst);
            }
            before(info);
        }));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(GATEWAY_THREAD)
            .enable_all()
            .build()
            .unwrap();
        let gateway = rt.block_on(async {
            let up = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let up_addr = up.local_addr().unwrap();
            tokio::spawn(async move {
                loop {
                    let Ok((tcp, _)) = up.accept().await else {
                        continue;
                    };
                    tokio::spawn(
                        hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(tcp), service_fn(upstream)),
                    );
                }
            });
            let mut cfg = mcp_reattach::Config::new(format!("http://{up_addr}").parse().unwrap());
            cfg.keepalive = None;
            cfg.session_ttl = Duration::from_secs(1);
            cfg.sweep_interval = Duration::from_millis(50);
            cfg.stall_timeout = Duration::from_secs(1);
            cfg.max_sessions = 256;
            cfg.max_request_bytes = 64 << 10;
            cfg.max_event_bytes = 64 << 10;
            cfg.priming = mcp_reattach::Priming::Always;
            let gw = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = gw.local_addr().unwrap();
            tokio::spawn(mcp_reattach::serve_gateway(
                gw,
                mcp_reattach::Gateway::new(cfg),
                std::future::pending(),
            ));
            addr
        });
        Harness { rt, gateway }
    })
}

const INIT: &str = r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"fuzz","version":"0"}}}"#;

/// A normal request on a new connection: the gateway must still serve.
async fn still_serving(addr: SocketAddr) {
    let check = async {
        let mut tcp = TcpStream::connect(addr).await.expect("gateway accepts");
        let req = format!(
            "POST /mcp HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{INIT}",
            INIT.len()
        );
        tcp.write_all(req.as_bytes()).await.expect("write");
        let mut resp = Vec::new();
        tcp.read_to_end(&mut resp).await.expect("read");
        resp
    };
    let resp = tokio::time::timeout(Duration::from_secs(5), check)
        .await
        .expect("the gateway still answers a normal request within 5 s");
    assert!(
        resp.starts_with(b"HTTP/1.1 200 "),
        "normal request after a fuzz input: {:?}",
        String::from_utf8_lossy(&resp[..resp.len().min(200)])
    );
}

/// Whether the gateway has answered with an SSE stream: a response head (the first, or one
/// after pipelined answers) with `content-type: text/event-stream`.
fn sse_answer(got: &[u8]) -> bool {
    String::from_utf8_lossy(got)
        .to_ascii_lowercase()
        .contains("\r\ncontent-type: text/event-stream")
}

async fn one(addr: SocketAddr, mode: u8, data: &[u8]) {
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    let pieces: Vec<&[u8]> = match (mode >> 1) % 3 {
        0 => vec![data],
        1 => data.chunks(7).collect(),
        _ => data.split_inclusive(|&b| b == b'\n').collect(),
    };
    let write = async {
        for p in pieces {
            tcp.write_all(p).await?;
            tcp.flush().await?;
        }
        if mode & 1 == 1 {
            tcp.shutdown().await?;
        }
        Ok::<_, std::io::Error>(())
    };
    // The gateway may stop reading (a rejected request): that is fine.
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        // After a half-close the gateway ends the connection itself, unless it answered with
        // an SSE stream: until then, wait for the close, not for silence.
        let idle = if mode & 1 == 1 && !sse_answer(&got) {
            Duration::from_secs(2)
        } else {
            Duration::from_millis(50)
        };
        let wait = idle.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
        match tokio::time::timeout(wait, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
    if !got.is_empty() && !data.starts_with(b"PRI * HTTP/2.0") {
        assert!(
            got.starts_with(b"HTTP/1.1 ") || got.starts_with(b"HTTP/1.0 "),
            "the gateway answered with something that is not HTTP/1.x: {:?}",
            String::from_utf8_lossy(&got[..got.len().min(200)])
        );
    }
}

/// Checks every property above on one input; panics on a violation. Bounded: at most 1 s of
/// writing, 2 s of reading and 5 s for the normal request. Called by the fuzz target and by
/// the corpus replay in `tests/fast/fuzz_corpora.rs`.
pub fn check(input: &[u8]) {
    let h = harness();
    let panics = GATEWAY_PANICS.load(Ordering::SeqCst);
    let (mode, data) = match input.split_first() {
        Some((m, d)) => (*m, d),
        None => (0, input),
    };
    h.rt.block_on(async {
        one(h.gateway, mode, data).await;
        still_serving(h.gateway).await;
    });
    assert_eq!(
        GATEWAY_PANICS.load(Ordering::SeqCst),
        panics,
        "the gateway panicked on this input (message above)"
    );
}
