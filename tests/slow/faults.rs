//! Fault injection on both sides of the gateway with the harness's TCP relay
//! (`support::Relay`, faults armed per direction): client ↔ proxy ↔ gateway and
//! gateway ↔ proxy ↔ upstream.
//! RST, half-close, cuts after N bytes, stalls, 1-byte segments, a client that stops reading,
//! and an upstream process killed with SIGKILL mid-stream. Every outcome is either the exact
//! upstream sequence (after a resume) or the documented explicit failure; never a hang.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::io::BufRead;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use mcp_reattach::Priming;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SID: &str = "fault-session";

fn all_messages(id: u64, n: u64) -> Vec<String> {
    (1..n)
        .map(progress)
        .chain(std::iter::once(result(id)))
        .collect()
}

/// Like `support::send`, but a connection that breaks before the response is `None`.
async fn try_send(addr: SocketAddr, req: Request<Full<Bytes>>) -> Option<Response<Incoming>> {
    let tcp = TcpStream::connect(addr).await.ok()?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .ok()?;
    tokio::spawn(conn);
    tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("response or error in time")
        .ok()
}

/// Reads events until the body ends or breaks, or nothing arrives for `idle`.
async fn events_until_quiet(r: &mut SseReader, idle: Duration) -> Vec<Event> {
    let mut v = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(idle, r.next()).await {
        v.push(e);
    }
    v
}

fn last_id(events: &[Event]) -> Option<String> {
    events.iter().rev().find_map(|e| e.id.clone())
}

/// Resumes from `cursor` directly (no proxy) and returns the messages until the stream ends.
async fn resume_rest(gw: &Gw, cursor: &str) -> Vec<String> {
    let resp = send(gw.addr, get(SID, Some(cursor))).await;
    assert_eq!(resp.status(), 200, "resume from {cursor}");
    let mut r = SseReader::new(resp);
    let first = r.next().await.unwrap();
    assert_eq!(first.event.as_deref(), Some("mcp-reattach/resumed"));
    messages(&r.rest().await)
}

async fn eventually(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn primed_gateway(upstream: SocketAddr, tweak: impl FnOnce(&mut mcp_reattach::Config)) -> Gw {
    gateway(upstream, |c| {
        c.priming = Priming::Always;
        c.keepalive = None;
        tweak(c);
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Client side: client ↔ proxy ↔ gateway
// ---------------------------------------------------------------------------------------------

/// The client's connection is reset (RST both ways) after N bytes of the response, for N in
/// the head, in the priming event and in later events; the client resumes from its last
/// complete id and gets exactly the rest. The upstream is never cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_reset_after_n_bytes_then_exact_resume() {
    let mut mock = Mock::start().await;
    let gw = primed_gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let proxy = Relay::start(gw.addr);
    for (i, n) in [0usize, 60, 230, 250, 300, 420, 600, 5000]
        .into_iter()
        .enumerate()
    {
        let id = 10 + i as u64;
        let all = all_messages(id, 6);
        proxy.arm(Dir::ToClient, Fault::ResetAfter(n));
        let pending = tokio::spawn(try_send(proxy.addr(), post(&call(id), Some(SID))));
        let writer = mock.next().await.respond_sse(Some(SID));
        for m in &all[..3] {
            writer.message(m).await;
        }
        let got = match pending.await.unwrap() {
            Some(resp) => {
                events_until_quiet(&mut SseReader::new(resp), Duration::from_millis(300)).await
            }
            None => Vec::new(),
        };
        assert!(
            !writer.closed_within(Duration::from_millis(50)).await,
            "n={n}: a client reset is a detach, not a cancel"
        );
        for m in &all[3..] {
            writer.message(m).await;
        }
        drop(writer);
        let mut delivered = messages(&got);
        match last_id(&got) {
            Some(cursor) => delivered.extend(resume_rest(&gw, &cursor).await),
            None => {
                // Nothing with an id arrived: the client cannot resume this stream (it retries
                // its call); the gateway still read the upstream to its end.
                assert!(
                    n < 300,
                    "n={n}: the priming id arrives right after the head"
                );
                continue;
            }
        }
        assert_eq!(delivered, all, "n={n}");
    }
}

/// The client half-closes (FIN) right after its request, as `nc -N` or some HTTP/1.0-era
/// clients do. With the gateway's hyper defaults (`half_close(false)`) the client's
/// connection closes at once, unanswered; a POST still reaches the upstream (its exchange
/// runs in its own task) and is not cancelled. The properties, whichever way the timing goes:
/// no hang, no cancel of anything that started, no attached client left behind, and the
/// gateway keeps serving. (Before the POST got its own task, a FIN that hyper saw after it had
/// forwarded the request cancelled the upstream's exchange: this test failed ~2 runs in 3.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_half_close_after_request_is_no_hang_and_no_cancel() {
    let mut mock = Mock::start().await;
    let gw = primed_gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let proxy = Relay::start(gw.addr);
    let body = call(1);
    let req = format!(
        "POST /mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMcp-Session-Id: {SID}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    proxy.arm(Dir::ToTarget, Fault::HalfCloseAfter(req.len()));
    let mut tcp = TcpStream::connect(proxy.addr()).await.unwrap();
    tcp.write_all(req.as_bytes()).await.unwrap();
    let forwarded = tokio::time::timeout(Duration::from_millis(500), mock.requests.recv())
        .await
        .ok()
        .flatten();
    let writer = forwarded.map(|seen| seen.respond_sse(Some(SID)));
    let all = all_messages(1, 4);
    if let Some(w) = &writer {
        for m in &all {
            w.message(m).await;
        }
    }
    // The client's connection ends (with or without a response): no hang.
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(WAIT, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => raw.extend_from_slice(&buf[..n]),
            Err(_) if writer.is_some() => break, // a live stream may stay open
            Err(_) => panic!("a half-closed connection with no request in flight must close"),
        }
    }
    eprintln!(
        "half-close: forwarded={}, the client got {} bytes",
        writer.is_some(),
        raw.len()
    );
    if let Some(w) = &writer {
        assert!(
            !w.closed_within(Duration::from_millis(50)).await,
            "a half-close is never a cancel"
        );
    }
    drop(writer);
    drop(tcp);
    eventually("no attached client left", Duration::from_secs(5), || {
        gw.metric("mcp_reattach_attached_clients").unwrap_or(0.0) == 0.0
    })
    .await;
    // The gateway serves the session normally afterwards.
    let pending = tokio::spawn(send(gw.addr, post(&call(2), Some(SID))));
    let w = mock.next().await.respond_sse(Some(SID));
    w.message(&result(2)).await;
    drop(w);
    assert_eq!(
        messages(&SseReader::new(pending.await.unwrap()).rest().await),
        vec![result(2)]
    );
}

/// A stall timeout of 300 ms and a window that holds every event of [`flood_unblocked`].
fn stall_300ms_huge_window(c: &mut mcp_reattach::Config) {
    c.stall_timeout = Duration::from_millis(300);
    c.window_events = 100_000;
    c.window_bytes = 256 << 20;
}

/// Writes `n` notifications padded to 16 KiB with `pad` and call 1's result through `writer`,
/// ends the stream, and asserts the upstream was never blocked: every event was read by the
/// gateway (tagged, not just taken by the mock's channel) within 5 s. Returns what was written.
async fn flood_unblocked(gw: &Gw, writer: SseWriter, pad: char, n: usize) -> Vec<String> {
    let pad = pad.to_string().repeat(16 * 1024);
    let all: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"i":{i},"pad":"{pad}"}}}}"#))
        .chain(std::iter::once(result(1)))
        .collect();
    let base = gw.tagged();
    let started = Instant::now();
    for m in &all {
        writer.message(m).await;
    }
    drop(writer);
    gw.tagged_at_least(base + all.len() as u64).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the upstream was never blocked"
    );
    all
}

/// The path to the client stalls (a middlebox stops forwarding, sockets stay open): the
/// gateway detaches the client within the stall timeout (closing the stuck connection), the
/// upstream is never blocked, and a resume from the last id the client saw is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_path_to_client_is_detached_and_resumable() {
    let mut mock = Mock::start().await;
    let gw = primed_gateway(mock.addr, stall_300ms_huge_window).await;
    init_session(&gw, &mut mock, SID).await;
    let proxy = Relay::start(gw.addr);
    proxy.arm(Dir::ToClient, Fault::StallAfter(40_000));
    let pending = tokio::spawn(send(proxy.addr(), post(&call(1), Some(SID))));
    let writer = mock.next().await.respond_sse(Some(SID));
    // The stalled path never holds the upstream back (the stall timeout is 300 ms; with the
    // path stalled, only the window could stop the reader, and it holds all 601 events). Wall
    // clock: the relay is real I/O.
    let all = flood_unblocked(&gw, writer, 'p', 600).await;
    let mut r = SseReader::new(pending.await.unwrap());
    let got = events_until_quiet(&mut r, Duration::from_millis(500)).await;
    eventually(
        "the stalled client is detached",
        Duration::from_secs(5),
        || {
            gw.metric("mcp_reattach_slow_consumer_detaches_total")
                .unwrap_or(0.0)
                >= 1.0
                && gw.metric("mcp_reattach_attached_clients").unwrap_or(0.0) == 0.0
        },
    )
    .await;
    drop(r);
    let cursor = last_id(&got).expect("the priming id got through");
    let mut delivered = messages(&got);
    delivered.extend(resume_rest(&gw, &cursor).await);
    assert_eq!(delivered.len(), all.len());
    assert!(delivered == all, "exact sequence after the stall");
}

/// Every byte in its own TCP segment, both ways, on both sides (request, response, and the
/// upstream's CRLF stream): the client gets exactly the upstream's events, and a resume over
/// the same trickling path is exact too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_byte_segments_everywhere() {
    let mut mock = Mock::start().await;
    let up = Relay::start(mock.addr);
    let gw = primed_gateway(up.addr(), |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let down = Relay::start(gw.addr);
    for p in [&up, &down] {
        p.arm(Dir::ToTarget, Fault::Trickle(Duration::ZERO));
        p.arm(Dir::ToClient, Fault::Trickle(Duration::ZERO));
    }
    let pending = tokio::spawn(send(down.addr(), post(&call(1), Some(SID))));
    let seen = mock.next().await;
    assert_eq!(
        seen.json_body()["id"],
        1,
        "the trickled request arrives whole"
    );
    let writer = seen.respond_sse(Some(SID));
    let all = all_messages(1, 5);
    let mut r = SseReader::new(pending.await.unwrap());
    let priming = r.next().await.unwrap();
    for m in &all[..2] {
        writer
            .send(format!("id: u\r\nevent: message\r\ndata: {m}\r\n\r\n"))
            .await;
    }
    let first: Vec<Event> = vec![r.next().await.unwrap(), r.next().await.unwrap()];
    assert_eq!(messages(&first), all[..2]);
    drop(r);
    for m in &all[2..] {
        writer
            .send(format!("event: message\r\ndata: {m}\r\n\r\n"))
            .await;
    }
    drop(writer);
    // Resume over the trickling path.
    let resp = send(down.addr(), get(SID, Some(first[1].id.as_deref().unwrap()))).await;
    let mut r = SseReader::new(resp);
    assert_eq!(
        r.next().await.unwrap().event.as_deref(),
        Some("mcp-reattach/resumed")
    );
    let mut delivered = messages(&first);
    delivered.extend(messages(&r.rest().await));
    assert_eq!(delivered, all);
    assert!(priming.id.is_some());
    assert!(up.down_bytes() > 500 && down.down_bytes() > 500);
}

/// A client that stops reading entirely (its socket buffers fill): detached within the stall
/// timeout, the connection closed, the upstream never blocked; what the client had buffered
/// plus a resume from its last complete id is exactly the upstream's sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_that_stops_reading_is_closed_and_resumes_exactly() {
    let mut mock = Mock::start().await;
    let gw = primed_gateway(mock.addr, stall_300ms_huge_window).await;
    init_session(&gw, &mut mock, SID).await;
    let body = call(1);
    let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
    tcp.write_all(format!(
        "POST /mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMcp-Session-Id: {SID}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ).as_bytes()).await.unwrap();
    let writer = mock.next().await.respond_sse(Some(SID));
    // Wall clock: this is the real-time smoke of the stall timer (tests/fast/gateway.rs has the
    // paused-clock test).
    let all = flood_unblocked(&gw, writer, 'q', 800).await;
    eventually(
        "the reader-less client is detached",
        Duration::from_secs(6),
        || gw.metric("mcp_reattach_attached_clients").unwrap_or(0.0) == 0.0,
    )
    .await;
    // The client wakes up and reads what its socket holds; the connection has been closed.
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf))
            .await
            .expect("the gateway closed the connection (no hang)")
        {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    // What arrived, de-chunked (the last chunk may be partial).
    let (_, sse) = split_chunked_response(&raw).expect("a response head");
    let got = parse_sse(&sse);
    let cursor = last_id(&got).expect("at least the priming event");
    let mut delivered = messages(&got);
    delivered.retain(|m| !m.contains("resumption-required"));
    eprintln!(
        "stopped reader: had {} of {} events in its socket",
        delivered.len(),
        all.len()
    );
    delivered.extend(resume_rest(&gw, &cursor).await);
    assert!(delivered == all, "exact sequence");
}

// ---------------------------------------------------------------------------------------------
// Upstream side: gateway ↔ proxy ↔ upstream
// ---------------------------------------------------------------------------------------------

async fn upstream_failure_is_explicit(fault: impl FnOnce(&Relay)) {
    let mut mock = Mock::start().await;
    let up = Relay::start(mock.addr);
    let gw = primed_gateway(up.addr(), |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let pending = tokio::spawn(send(gw.addr, post(&call(7), Some(SID))));
    let writer = mock.next().await.respond_sse(Some(SID));
    let mut r = SseReader::new(pending.await.unwrap());
    r.next().await.unwrap(); // priming
    writer.message(&progress(1)).await;
    let first = r.next().await.unwrap();
    assert_eq!(messages(std::slice::from_ref(&first)), vec![progress(1)]);
    let started = Instant::now();
    fault(&up);
    // The mock may already have seen the fault and dropped its side of the response.
    writer.try_message(&progress(2)).await;
    let rest = r.rest().await; // each wait bounded by WAIT: a hang fails
                               // Wall clock: a liveness bound on real socket faults, no timer of ours involved.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "explicit end, not a hang"
    );
    let failed = rest
        .iter()
        .find(|e| e.event.as_deref() == Some("mcp-reattach/upstream-failed"))
        .unwrap_or_else(|| panic!("an upstream-failed event: {rest:?}"));
    let info: serde_json::Value = serde_json::from_str(failed.data.as_deref().unwrap()).unwrap();
    assert_eq!(info["reason"], "upstream-failed");
    // The cause names what failed, never the HTTP library's own error text.
    let cause = info["cause"].as_str().unwrap();
    assert!(
        cause == "upstream connection failed"
            || cause.starts_with("the upstream closed the stream and refused"),
        "{cause}"
    );
    let errs: Vec<serde_json::Value> = messages(&rest)
        .iter()
        .filter_map(|m| serde_json::from_str::<serde_json::Value>(m).ok())
        .filter(|j| j.get("error").is_some())
        .collect();
    assert_eq!(errs.len(), 1, "{rest:?}");
    assert_eq!(errs[0]["id"], 7);
    assert_eq!(errs[0]["error"]["code"], -32011);
    // The failure stands at the stream end's own position: a client whose connection died
    // with it unread comes back at its last event and is told again; one that read it has
    // everything.
    let end = failed.id.clone().expect("the failure event carries an id");
    assert!(end.ends_with(".18446744073709551615"), "{end}");
    let again = resume_rest(&gw, first.id.as_deref().unwrap()).await;
    assert_eq!(again.len(), 1, "only the error again: {again:?}");
    let err: serde_json::Value = serde_json::from_str(&again[0]).unwrap();
    assert_eq!(
        (&err["id"], &err["error"]["code"]),
        (&7.into(), &(-32011).into())
    );
    let resp = send(gw.addr, get(SID, Some(&end))).await;
    assert_eq!(resp.status(), 409);
    assert_eq!(
        body_json(resp).await["error"]["data"]["reason"],
        "stream-ended"
    );
    drop(writer);
    // The gateway keeps serving the session over a new upstream connection.
    up.arm(Dir::ToClient, Fault::Pass);
    let pending = tokio::spawn(send(gw.addr, post(&call(8), Some(SID))));
    let w = mock.next().await.respond_sse(Some(SID));
    w.message(&result(8)).await;
    drop(w);
    assert_eq!(
        messages(&SseReader::new(pending.await.unwrap()).rest().await),
        vec![result(8)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_reset_mid_stream_fails_the_pending_request_explicitly() {
    upstream_failure_is_explicit(|up| {
        up.cut_all();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_half_close_mid_stream_fails_the_pending_request_explicitly() {
    // The next upstream bytes are cut after 10 bytes, then FIN: an incomplete chunked body.
    upstream_failure_is_explicit(|up| up.arm(Dir::ToClient, Fault::HalfCloseAfter(10))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_cut_after_n_bytes_fails_the_pending_request_explicitly() {
    upstream_failure_is_explicit(|up| up.arm(Dir::ToClient, Fault::ResetAfter(25))).await;
}

/// The upstream's response is cut inside its head: 502 with a JSON-RPC error for the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_reset_inside_the_response_head_is_a_502() {
    let mut mock = Mock::start().await;
    let up = Relay::start(mock.addr);
    let gw = primed_gateway(up.addr(), |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    for fault in [Fault::ResetAfter(20), Fault::HalfCloseAfter(20)] {
        up.arm(Dir::ToClient, fault);
        let pending = tokio::spawn(send(gw.addr, post(&call(3), Some(SID))));
        let w = mock.next().await.respond_sse(Some(SID));
        w.message(&result(3)).await;
        let resp = pending.await.unwrap();
        assert_eq!(resp.status(), 502, "{fault:?}");
        let b = resp.into_body().collect().await.unwrap().to_bytes();
        let j: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(j["id"], 3);
        assert_eq!(j["error"]["code"], -32011);
        assert_eq!(j["error"]["data"]["reason"], "upstream-unavailable");
        drop(w);
    }
}

/// An upstream that stalls mid-stream (sockets open, nothing sent): the attached client keeps
/// getting keep-alives (so its idle timers and middleboxes see a live stream), and other
/// sessions are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_stall_keeps_clients_alive_and_other_sessions_unaffected() {
    let mut mock = Mock::start().await;
    let up = Relay::start(mock.addr);
    let gw = gateway(up.addr(), |c| {
        c.priming = Priming::Always;
        c.keepalive = Some(Duration::from_millis(100));
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    init_session(&gw, &mut mock, "other").await;
    let pending = tokio::spawn(send(gw.addr, post(&call(1), Some(SID))));
    let writer = mock.next().await.respond_sse(Some(SID));
    let mut r = SseReader::new(pending.await.unwrap());
    r.next().await.unwrap();
    up.arm(Dir::ToClient, Fault::StallAfter(0));
    writer.message(&progress(1)).await; // never arrives
                                        // The stalled connection's pump must hold its bytes before the relay is re-armed for new
                                        // connections.
    eventually("the relay holds the stalled stream", WAIT, || {
        up.stalled() >= 1
    })
    .await;
    // Another session, over a new upstream connection, is served while the first one stalls.
    up.arm(Dir::ToClient, Fault::Pass);
    let pending = tokio::spawn(send(gw.addr, post(&call(2), Some("other"))));
    let w2 = mock.next().await.respond_sse(Some("other"));
    w2.message(&result(2)).await;
    drop(w2);
    assert_eq!(
        messages(&SseReader::new(pending.await.unwrap()).rest().await),
        vec![result(2)]
    );
    // Keep-alives keep flowing to the stalled stream's client: wait until two arrived (no
    // event comes, so each read gives up after a moment and the raw bytes are checked).
    let before = r.raw.len();
    let deadline = Instant::now() + WAIT;
    loop {
        let raw = String::from_utf8_lossy(&r.raw[before..]).into_owned();
        if raw.matches(": keepalive\n\n").count() >= 2 {
            break;
        }
        assert!(Instant::now() < deadline, "keep-alives flow: {raw:?}");
        let _ = tokio::time::timeout(Duration::from_millis(100), r.next()).await;
    }
    drop(writer);
}

// ---------------------------------------------------------------------------------------------
// An upstream process killed with SIGKILL mid-stream
// ---------------------------------------------------------------------------------------------

/// A minimal legacy MCP upstream (Python stdlib): `initialize` → JSON with a session id; a
/// request → an SSE stream (CRLF, chunked) of progress notifications every 50 ms, forever.
const PY_UPSTREAM: &str = r#"
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(n) or b"{}")
        if body.get("method") == "initialize":
            out = json.dumps({"jsonrpc": "2.0", "id": body["id"], "result": {"protocolVersion": "2025-06-18", "capabilities": {}, "serverInfo": {"name": "py", "version": "0"}}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Mcp-Session-Id", "py-session")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Mcp-Session-Id", "py-session")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        i = 0
        while True:
            i += 1
            ev = ("event: message\r\ndata: " + json.dumps({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1, "progress": i}}) + "\r\n\r\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            self.wfile.flush()
            time.sleep(0.05)

srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
print("LISTENING %d" % srv.server_address[1], flush=True)
srv.serve_forever()
"#;

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_process_killed_mid_stream_ends_the_call_explicitly() {
    let mut child = KillOnDrop(
        std::process::Command::new("python3")
            .arg("-c")
            .arg(PY_UPSTREAM)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("python3 runs (CI has it)"),
    );
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("python upstream starts");
    let port: u16 = line.strip_prefix("LISTENING ").unwrap().parse().unwrap();
    let gw = primed_gateway(SocketAddr::from(([127, 0, 0, 1], port)), |_| {}).await;
    let init = send(gw.addr, post(INITIALIZE, None)).await;
    assert_eq!(init.status(), 200);
    let sid = init.headers()["mcp-session-id"]
        .to_str()
        .unwrap()
        .to_owned();
    let mut r = SseReader::new(send(gw.addr, post(&call(42), Some(&sid))).await);
    let mut seen = 0;
    while seen < 3 {
        let e = r.next().await.expect("progress");
        seen += messages(&[e]).len();
    }
    let started = Instant::now();
    let pid = child.0.id();
    // SIGKILL: no FIN handshake from the application, no last chunk.
    let status = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let _ = child.0.wait();
    let rest = r.rest().await; // each wait bounded: a hang fails the test
    let elapsed = started.elapsed();
    eprintln!("upstream killed: explicit end after {elapsed:?}");
    // Wall clock: a real process killed with SIGKILL; a liveness bound, not a timer of ours.
    assert!(elapsed < Duration::from_secs(5), "no hang: {elapsed:?}");
    let failed = rest
        .iter()
        .find(|e| e.event.as_deref() == Some("mcp-reattach/upstream-failed"))
        .unwrap_or_else(|| panic!("an upstream-failed event, got {rest:?}"));
    assert!(failed.id.is_some());
    let err = messages(&rest)
        .into_iter()
        .filter_map(|m| serde_json::from_str::<serde_json::Value>(&m).ok())
        .find(|j| j.get("error").is_some())
        .expect("a JSON-RPC error for the pending request");
    assert_eq!(err["id"], 42);
    assert_eq!(err["error"]["code"], -32011);
    assert_eq!(err["error"]["data"]["reason"], "upstream-failed");
    // A new request finds the upstream gone: 502, not a hang.
    let resp = send(gw.addr, post(&call(43), Some(&sid))).await;
    assert_eq!(resp.status(), 502);
}

// ---------------------------------------------------------------------------------------------
// Slow clients (slowloris): half a request head, then silence
// ---------------------------------------------------------------------------------------------

/// Sends half a request head and then nothing; returns how long until the gateway closed the
/// connection (and what, if anything, it answered), on tokio's clock (paused in the callers).
async fn half_head_closed_after(addr: SocketAddr, bound: Duration) -> (Duration, Vec<u8>) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let started = tokio::time::Instant::now();
    tcp.write_all(b"POST /mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Type: applic")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(bound, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (started.elapsed(), got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("the gateway kept a half-sent head open for more than {bound:?}"),
        }
    }
}

/// The default header-read timeout (10 s) closes a connection whose head never completes, at
/// the deadline on the paused clock, while normal requests are served meanwhile.
#[tokio::test(start_paused = true)]
async fn slowloris_half_head_is_closed_by_the_default_header_timeout() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    let timeout = gw.gateway.config().header_read_timeout;
    assert_eq!(timeout, Duration::from_secs(10));
    let slow = tokio::spawn(half_head_closed_after(gw.addr, Duration::from_secs(13)));
    // Served meanwhile.
    tokio::time::sleep(Duration::from_millis(200)).await;
    init_session(&gw, &mut mock, SID).await;
    let (after, answer) = slow.await.unwrap();
    eprintln!(
        "slowloris: closed after {after:?}, answer {:?}",
        String::from_utf8_lossy(&answer)
    );
    assert!(
        after >= timeout && after <= timeout + EPSILON,
        "closed after {after:?}"
    );
    assert!(
        answer.is_empty() || answer.starts_with(b"HTTP/1.1 408"),
        "{answer:?}"
    );
}

/// How far past its deadline a timer of ours may fire on the paused clock (tokio's timer wheel
/// has 1 ms slots).
const EPSILON: Duration = Duration::from_millis(5);

/// A configured header-read timeout is applied, and each trickled byte does not restart it
/// (a head sent one byte every 200 ms is still cut at the deadline). Paused clock: both cuts
/// come at the deadline.
#[tokio::test(start_paused = true)]
async fn header_read_timeout_is_a_deadline_not_an_idle_timer() {
    let mock = Mock::start().await;
    let timeout = Duration::from_secs(1);
    let gw = gateway(mock.addr, |c| c.header_read_timeout = timeout).await;
    let (after, _) = half_head_closed_after(gw.addr, Duration::from_secs(4)).await;
    assert!(
        after >= timeout && after <= timeout + EPSILON,
        "closed after {after:?}"
    );
    let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
    let started = tokio::time::Instant::now();
    let head = b"GET /mcp HTTP/1.1\r\nHost: mcp.example\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut closed = false;
    let mut sent = 0;
    for b in head {
        if tcp.write_all(std::slice::from_ref(b)).await.is_err() {
            closed = true;
            break;
        }
        sent += 1;
        let mut buf = [0u8; 256];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(200), tcp.read(&mut buf)).await
        {
            closed = true;
            break;
        }
    }
    let after = started.elapsed();
    assert!(closed, "a trickled head was cut");
    // Bytes went out at 0, 200, ..., 1000 ms (the last one racing the deadline): an idle
    // timer would have let all of them through.
    assert!((5..=6).contains(&sent), "{sent} bytes sent before the cut");
    assert!(
        after >= timeout && after <= timeout + EPSILON,
        "cut after {after:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Upstream connection pool
// ---------------------------------------------------------------------------------------------

/// After a burst of concurrent requests, the idle pooled connections to the upstream are
/// closed once the pool's idle timeout (4 s) has passed, so the gateway's fds return to
/// baseline (a bug before 457dca3: the client had no pool timer, so the reaper never ran).
/// `scripts/soak.sh` checks the same thing over a long run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_closed_after_the_pool_idle_timeout() {
    let mut mock = Mock::start().await;
    let up = Relay::start(mock.addr);
    let gw = gateway(up.addr(), |_| {}).await;
    const N: usize = 6;
    let pending: Vec<_> = (0..N)
        .map(|i| {
            tokio::spawn(send(
                gw.addr,
                post(
                    &format!(r#"{{"jsonrpc":"2.0","id":{i},"method":"tools/list"}}"#),
                    Some(SID),
                ),
            ))
        })
        .collect();
    // Hold every request until all have arrived: N upstream connections at once.
    let mut seen = Vec::new();
    for _ in 0..N {
        seen.push(mock.next().await);
    }
    for s in seen {
        s.respond_json(r#"{"jsonrpc":"2.0","id":0,"result":{}}"#);
    }
    for p in pending {
        assert_eq!(p.await.unwrap().status(), 200);
    }
    assert_eq!(
        up.connections(),
        N,
        "one upstream connection per concurrent request"
    );
    // The upstream sweeper closes every 4 s the connections idle for 4 s or more, so a
    // connection that came back a moment after a sweep waits for the next one.
    assert!(
        up.idle_within(Duration::from_secs(12)).await,
        "{} idle upstream connections still open 12 s later (three sweeps)",
        up.live()
    );
}

/// Slow body: a complete head, then a body that never finishes. Before 457dca3 nothing bounded
/// it, so each such client held a connection (and a `--max-connections` slot) as long as it
/// liked (slowhttptest `-B`, docs/reliability.md); now a POST body gets the header-read
/// deadline too, counted from the complete head (paused clock: exactly that long).
#[tokio::test(start_paused = true)]
async fn slow_body_is_cut_like_a_slow_head() {
    let mock = Mock::start().await;
    let timeout = Duration::from_secs(1);
    let gw = gateway(mock.addr, |c| c.header_read_timeout = timeout).await;
    let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
    tcp.write_all(b"POST /mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"jsonrpc\"")
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(Duration::from_secs(6), tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(_)) => continue, // a 408 is fine
            Err(_) => panic!("a body that never completes held the connection for 6 s"),
        }
    }
    let after = started.elapsed();
    assert!(
        after >= timeout && after <= timeout + EPSILON,
        "cut after {after:?}"
    );
}
