//! The upstream side of the HTTP/1.1 framing the gateway reads itself (its own `GET`s: the held
//! standalone stream, `src/http1/`; and a call's answer that came whole in one read, fed at
//! once): a raw TCP upstream answers the held `GET` with scripted
//! bytes (conflicting or differing lengths, odd transfer codings, bad chunk sizes, bare LF,
//! trailers, an early close, bytes written after the end of the body). Each case either
//! delivers exactly the events of the well-framed body and nothing after it, or fails
//! explicitly (the head refused, the stream failed after the events before the fault); the
//! gateway closes every such connection, and uses again only one whose body ended cleanly.

// Real sockets on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SID: &str = "framing-session";

/// What the raw upstream saw of the held `GET`s: how many came, and whether the gateway
/// closed the connection of the first (the one that got the script).
#[derive(Default)]
struct Seen {
    gets: usize,
    first_closed: bool,
    /// The gateway sent its next request on the first `GET`'s connection.
    first_reused: bool,
    /// Connections the upstream accepted.
    connections: usize,
    /// Requests the upstream read.
    requests: usize,
}

/// Reads one request head and its `Content-Length` body; the head, or `None` at EOF.
async fn read_request(tcp: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
            let len = head
                .to_ascii_lowercase()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("content-length:")
                        .map(|v| v.trim().to_owned())
                })
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let mut b = [0u8; 4096];
                let n = tcp.read(&mut b).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&b[..n]);
            }
            buf.drain(..end + 4 + len);
            return Some(head);
        }
        let mut b = [0u8; 4096];
        let n = tcp.read(&mut b).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&b[..n]);
    }
}

/// The raw upstream: answers `initialize` (JSON, with the session id) and the initialized
/// notification (202) like a stateful server; the first `GET` gets `script`, written in
/// `pieces` (20 ms apart, so reads see every cut; the last piece 300 ms after the one before,
/// once the client's `GET` is attached), then the connection is closed
/// (`close`: an early close) or left open until the gateway closes it; every later `GET` gets
/// 405 (no more standalone stream).
async fn raw_upstream(
    script: Vec<u8>,
    pieces: Vec<usize>,
    close: bool,
) -> (SocketAddr, Arc<Mutex<Seen>>) {
    counting_upstream(move |mut tcp, seen| {
        let script = script.clone();
        let pieces = pieces.clone();
        async move {
            let mut buf = Vec::new();
            let mut carried: Option<String> = None;
            loop {
                let head = match carried.take() {
                    Some(h) => h,
                    None => match read_request(&mut tcp, &mut buf).await {
                        Some(h) => h,
                        None => return,
                    },
                };
                seen.lock().unwrap().requests += 1;
                if head.starts_with("GET") {
                    let first = {
                        let mut s = seen.lock().unwrap();
                        s.gets += 1;
                        s.gets == 1
                    };
                    if !first {
                        let _ = tcp
                            .write_all(
                                b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n",
                            )
                            .await;
                        continue;
                    }
                    let mut at = 0;
                    let last = pieces.len();
                    for (i, cut) in pieces.iter().copied().chain([script.len()]).enumerate() {
                        // The last piece (the end or the fault) once the client is there.
                        let pause = if i == last { 300 } else { 20 };
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                        let cut = cut.min(script.len()).max(at);
                        let _ = tcp.write_all(&script[at..cut]).await;
                        at = cut;
                    }
                    if close {
                        return;
                    }
                    // The upstream keeps the connection: the gateway closes it, or sends
                    // its next request on it (only after a body that ended cleanly).
                    match tokio::time::timeout(
                        Duration::from_secs(5),
                        read_request(&mut tcp, &mut buf),
                    )
                    .await
                    {
                        Ok(Some(next)) => {
                            seen.lock().unwrap().first_reused = true;
                            carried = Some(next);
                            continue;
                        }
                        Ok(None) => {
                            seen.lock().unwrap().first_closed = true;
                            return;
                        }
                        Err(_) => return,
                    }
                }
                // A POST: initialize gets its result and the session id, anything else 202.
                let answer = if head.contains("mcp-session-id") {
                    format!("HTTP/1.1 202 Accepted\r\nMcp-Session-Id: {SID}\r\nContent-Length: 0\r\n\r\n")
                } else {
                    initialize_answer()
                };
                if tcp.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

/// A raw upstream on a free port: each connection it accepts is counted and handed to `conn`
/// (with what the upstream saw) in a task of its own.
async fn counting_upstream<F, Fut>(conn: F) -> (SocketAddr, Arc<Mutex<Seen>>)
where
    F: Fn(TcpStream, Arc<Mutex<Seen>>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = l.accept().await.unwrap();
            s.lock().unwrap().connections += 1;
            tokio::spawn(conn(tcp, s.clone()));
        }
    });
    (addr, seen)
}

/// The raw upstream's answer to `initialize`: its result and the session id.
fn initialize_answer() -> String {
    let body = r#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-06-18","capabilities":{},"serverInfo":{"name":"raw","version":"0"}}}"#;
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nMcp-Session-Id: {SID}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn note(n: u64) -> String {
    format!(r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"n":{n}}}}}"#)
}

fn sse_event(n: u64) -> String {
    format!("event: message\ndata: {}\n\n", note(n))
}

/// `body` as one chunk per event plus `tail` (the test's own ending of the chunked body).
fn chunked(events: &[String], tail: &str) -> String {
    let mut out = String::new();
    for e in events {
        out.push_str(&format!("{:x}\r\n{e}\r\n", e.len()));
    }
    out.push_str(tail);
    out
}

const SSE_HEAD: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n";

/// Runs one case: a session through the gateway, the held `GET` answered with `script` (cut
/// at `pieces`), then a client `GET` attached to the held stream. The messages the client
/// got, whether it saw an `upstream-failed` event, and what the upstream saw.
async fn run(script: String, pieces: Vec<usize>) -> (Vec<String>, bool, Arc<Mutex<Seen>>) {
    run_with(script, pieces, false).await
}

async fn run_with(
    script: String,
    pieces: Vec<usize>,
    close: bool,
) -> (Vec<String>, bool, Arc<Mutex<Seen>>) {
    let (up, seen) = raw_upstream(script.into_bytes(), pieces, close).await;
    let gw = gateway(up, |_| {}).await;
    let init = send(gw.addr, post(INITIALIZE, None)).await;
    assert_eq!(init.status(), 200);
    let done = send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            Some(SID),
        ),
    )
    .await;
    assert_eq!(done.status(), 202);
    let resp = send(gw.addr, get(SID, None)).await;
    let mut events = Vec::new();
    if resp.status() == 200 {
        let mut r = SseReader::new(resp);
        while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(800), r.next()).await {
            events.push(e);
        }
    }
    let failed = events
        .iter()
        .any(|e| e.event.as_deref() == Some("mcp-reattach/upstream-failed"));
    // Give the upstream's side a moment to see the close (or the next request).
    for _ in 0..50 {
        if seen.lock().unwrap().first_closed || seen.lock().unwrap().first_reused {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (messages(&events), failed, seen)
}

#[tokio::test]
async fn a_well_framed_chunked_stream_is_delivered_exactly_whatever_the_cuts() {
    let events = [sse_event(1), sse_event(2), sse_event(3)];
    let trailers = "0\r\nx-checksum: 1\r\nx-other: 2\r\n\r\n";
    let body = chunked(&events, trailers);
    // Cut inside the head, inside a size line, inside data, between CR and LF, in trailers.
    let script = format!("{SSE_HEAD}Transfer-Encoding: chunked\r\n\r\n{body}");
    let head_len = script.len() - body.len();
    let pieces = vec![
        10,
        head_len - 1,
        head_len + 1,
        head_len + 30,
        head_len + 93,
        script.len() - 12,
    ];
    let (got, failed, seen) = run(script, pieces).await;
    assert_eq!(got, vec![note(1), note(2), note(3)]);
    assert!(!failed);
    let seen = seen.lock().unwrap();
    assert!(
        !seen.first_closed,
        "a connection whose body ended cleanly is kept for the next request"
    );
}

#[tokio::test]
async fn bytes_after_the_end_of_the_body_are_never_delivered() {
    // The upstream keeps writing after the last chunk: an event, then a whole response.
    let after = format!(
        "{}HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n{}",
        sse_event(9),
        sse_event(10)
    );
    let good = format!(
        "{SSE_HEAD}Transfer-Encoding: chunked\r\n\r\n{}",
        chunked(&[sse_event(1)], "")
    );
    let script = format!("{good}0\r\n\r\n{after}");
    let (got, failed, seen) = run(script, vec![good.len()]).await;
    assert_eq!(got, vec![note(1)]);
    assert!(!failed);
    assert!(seen.lock().unwrap().first_closed);

    // The same with a Content-Length body.
    // The length ends one byte into the last piece; an event follows it.
    let e = sse_event(1);
    let good = format!("{SSE_HEAD}Content-Length: {}\r\n\r\n{e}", e.len() + 1);
    let script = format!("{good}\n{}", sse_event(2));
    let (got, _, seen) = run(script, vec![good.len()]).await;
    assert_eq!(got, vec![note(1)]);
    assert!(seen.lock().unwrap().first_closed);
}

#[tokio::test]
async fn a_broken_chunked_body_fails_explicitly_after_the_events_before_it() {
    let good = chunked(&[sse_event(1)], "");
    for (case, broken) in [
        ("size not hex", format!("zz\r\n{}\r\n", sse_event(2))),
        (
            "size overflows",
            format!("10000000000000000\r\n{}\r\n", sse_event(2)),
        ),
        (
            "bare LF after the size",
            format!("{:x}\n{}\r\n", sse_event(2).len(), sse_event(2)),
        ),
        (
            "data longer than its size",
            format!("5\r\n{}\r\n", sse_event(2)),
        ),
        ("bare LF in the trailers", "0\r\nx-a: 1\n\r\n".to_owned()),
    ] {
        let before = format!("{SSE_HEAD}Transfer-Encoding: chunked\r\n\r\n{good}");
        let script = format!("{before}{broken}");
        let (got, failed, seen) = run(script, vec![before.len()]).await;
        assert_eq!(
            got,
            vec![note(1)],
            "{case}: the event before the fault, nothing of it"
        );
        assert!(failed, "{case}: the client is told the upstream failed");
        assert!(
            seen.lock().unwrap().first_closed,
            "{case}: connection closed"
        );
    }
}

#[tokio::test]
async fn an_early_close_fails_the_stream_explicitly() {
    for (case, script) in [
        (
            "inside a chunk",
            format!(
                "{SSE_HEAD}Transfer-Encoding: chunked\r\n\r\n{}40\r\nevent: mess",
                chunked(&[sse_event(1)], "")
            ),
        ),
        (
            "short of Content-Length",
            format!("{SSE_HEAD}Content-Length: 10000\r\n\r\n{}", sse_event(1)),
        ),
    ] {
        // Everything before the cut event first; the rest, and the close, once the client is there.
        let cut = script.find("40\r\n").unwrap_or(script.len());
        let (got, failed, seen) = run_with(script, vec![cut], true).await;
        assert_eq!(
            got,
            vec![note(1)],
            "{case}: the event before the close, nothing of the cut one"
        );
        assert!(failed, "{case}: the failure is explicit");
        assert!(seen.lock().unwrap().gets >= 1);
    }
}

#[tokio::test]
async fn ambiguous_heads_are_refused_and_their_bodies_never_read() {
    let e = sse_event(1);
    let n = e.len();
    for (case, head) in [
        (
            "CL and TE",
            format!("Content-Length: {n}\r\nTransfer-Encoding: chunked\r\n"),
        ),
        (
            "TE and CL",
            format!("Transfer-Encoding: chunked\r\nContent-Length: {n}\r\n"),
        ),
        (
            "differing lengths",
            format!("Content-Length: {n}\r\nContent-Length: {}\r\n", n + 1),
        ),
        (
            "a length list that differs",
            format!("Content-Length: {n}, {}\r\n", n + 1),
        ),
        (
            "gzip then chunked",
            "Transfer-Encoding: gzip, chunked\r\n".to_owned(),
        ),
        (
            "chunked twice",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n".to_owned(),
        ),
        (
            "obs-fold",
            "Transfer-Encoding: chunked\r\n x-folded: 1\r\n".to_owned(),
        ),
        ("signed length", format!("Content-Length: +{n}\r\n")),
    ] {
        let script = format!(
            "{SSE_HEAD}{head}\r\n{}",
            chunked(std::slice::from_ref(&e), "0\r\n\r\n")
        );
        let (got, _, seen) = run(script, vec![]).await;
        assert!(
            got.is_empty(),
            "{case}: nothing of the body reaches the client: {got:?}"
        );
        let seen = seen.lock().unwrap();
        assert!(
            seen.first_closed,
            "{case}: the refused connection is closed"
        );
        assert!(
            seen.gets >= 2,
            "{case}: the held GET was tried again, on a new connection"
        );
    }
}

#[tokio::test]
async fn requests_one_after_another_share_one_upstream_connection() {
    let (up, seen) = raw_upstream(Vec::new(), Vec::new(), false).await;
    let gw = gateway(up, |c| c.hold_standalone = false).await;
    let init = send(gw.addr, post(INITIALIZE, None)).await;
    assert_eq!(init.status(), 200);
    let _ = http_body_util::BodyExt::collect(init.into_body()).await;
    for _ in 0..3 {
        let done = send(
            gw.addr,
            post(
                r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
                Some(SID),
            ),
        )
        .await;
        assert_eq!(done.status(), 202);
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.requests, 4);
    assert_eq!(
        seen.connections, 1,
        "each answer ended cleanly: the next request went on the same connection"
    );
}

/// A raw upstream for the answer to a call: `initialize` gets its result and the session id,
/// the request after it (the call) `script` in one write (its head and body, and whatever the
/// script adds), any other a 202. Counts the connections it accepted.
async fn raw_call_upstream(script: String) -> (SocketAddr, Arc<Mutex<Seen>>) {
    counting_upstream(move |mut tcp, seen| {
        let script = script.clone();
        async move {
            let mut buf = Vec::new();
            while let Some(head) = read_request(&mut tcp, &mut buf).await {
                seen.lock().unwrap().requests += 1;
                let answer = if !head.contains("mcp-session-id") {
                    initialize_answer()
                } else if seen.lock().unwrap().requests == 2 {
                    // The second request: the call.
                    script.clone()
                } else {
                    "HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n".to_owned()
                };
                if tcp.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

/// A call's SSE answer that comes whole in one read is fed at once (written to the client with
/// its length), with the framing rules of any other body: its trailers read, bytes after its
/// end never delivered and its connection then closed, a broken chunked body failing the call
/// explicitly after the events before the fault.
#[tokio::test]
async fn a_call_answer_whole_in_one_read_keeps_the_framing_rules() {
    let result = r#"{"jsonrpc":"2.0","id":7,"result":{"content":[]}}"#;
    let answer = format!("event: message\ndata: {result}\n\n");
    let events = [sse_event(1), sse_event(2), answer];
    let well = format!(
        "{SSE_HEAD}Transfer-Encoding: chunked\r\n\r\n{}",
        chunked(&events, "0\r\nx-checksum: 1\r\n\r\n")
    );
    let after = format!("{well}{}", sse_event(9));
    let broken = format!(
        "{SSE_HEAD}Transfer-Encoding: chunked\r\n\r\n{}zz\r\n{}\r\n",
        chunked(&events[..1], ""),
        sse_event(2)
    );
    for (case, script) in [
        ("well framed", well),
        ("bytes after", after),
        ("broken", broken),
    ] {
        let (up, seen) = raw_call_upstream(script).await;
        let gw = gateway(up, |c| c.hold_standalone = false).await;
        assert_eq!(send(gw.addr, post(INITIALIZE, None)).await.status(), 200);
        let call = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"t","arguments":{}}}"#;
        let resp = send(gw.addr, post(call, Some(SID))).await;
        assert_eq!(resp.status(), 200, "{case}");
        let whole = resp.headers().contains_key("content-length");
        let got = SseReader::new(resp).rest().await;
        let failed = got
            .iter()
            .any(|e| e.event.as_deref() == Some("mcp-reattach/upstream-failed"));
        // Another request: on the same upstream connection only after a clean end.
        let ping = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;
        assert_eq!(
            send(gw.addr, post(ping, Some(SID))).await.status(),
            202,
            "{case}"
        );
        let connections = seen.lock().unwrap().connections;
        match case {
            "well framed" | "bytes after" => {
                assert!(whole, "{case}: fed at once, written with its length");
                assert_eq!(
                    messages(&got),
                    vec![note(1), note(2), result.to_owned()],
                    "{case}"
                );
                assert!(!failed, "{case}");
                let want = if case == "well framed" { 1 } else { 2 };
                assert_eq!(connections, want, "{case}: connections");
            }
            _ => {
                assert!(!whole, "{case}: read by the stream's reader");
                assert_eq!(messages(&got).first(), Some(&note(1)), "{case}: {got:?}");
                assert!(failed, "{case}: the call fails explicitly: {got:?}");
                assert_eq!(connections, 2, "{case}: connections");
            }
        }
    }
}

/// An upstream that answers with interim (`1xx`) heads and never a final one: the gateway
/// reads a bounded number of them, answers 502 (counted as an upstream request error), and
/// closes the connection, which the upstream sees.
#[tokio::test]
async fn an_endless_stream_of_interim_heads_is_a_502_and_its_connection_closed() {
    let (up, seen) = counting_upstream(|mut tcp, seen| async move {
        let mut buf = Vec::new();
        if read_request(&mut tcp, &mut buf).await.is_none() {
            return;
        }
        seen.lock().unwrap().requests += 1;
        // Until the gateway closes the connection (bounded here in time, past the client's
        // wait for its answer, and in count far beyond what that time allows).
        let started = std::time::Instant::now();
        for _ in 0..u32::MAX {
            if started.elapsed() > Duration::from_secs(15) {
                return;
            }
            if tcp
                .write_all(b"HTTP/1.1 102 Processing\r\n\r\n")
                .await
                .is_err()
            {
                seen.lock().unwrap().first_closed = true;
                return;
            }
        }
    })
    .await;
    let gw = gateway(up, |c| {
        c.hold_standalone = false;
        c.json_upgrade = false;
    })
    .await;
    let resp = send(gw.addr, post(INITIALIZE, None)).await;
    assert_eq!(resp.status(), 502);
    let errors = gw
        .metric(r#"mcp_reattach_upstream_errors_total{kind="request"}"#)
        .unwrap_or(0.0);
    assert!(errors >= 1.0, "upstream request errors: {errors}");
    for _ in 0..250 {
        if seen.lock().unwrap().first_closed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        seen.lock().unwrap().first_closed,
        "the gateway still reads the flood"
    );
}

/// The answer to a `HEAD` announces a body its upstream may yet write: the connection is not
/// used again, so a late body never becomes the next request's answer.
#[tokio::test]
async fn a_head_answers_connection_is_not_used_again() {
    let (up, seen) = counting_upstream(|mut tcp, seen| async move {
        let mut buf = Vec::new();
        let mut after_head = false;
        while let Some(head) = read_request(&mut tcp, &mut buf).await {
            seen.lock().unwrap().requests += 1;
            let mut answer = Vec::new();
            if after_head {
                // The body the HEAD's answer announced, late: before the next answer.
                seen.lock().unwrap().first_reused = true;
                answer.extend_from_slice(b"hello");
            }
            after_head = head.starts_with("HEAD");
            if after_head {
                answer.extend_from_slice(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\n",
                );
            } else {
                answer.extend_from_slice(initialize_answer().as_bytes());
            }
            if tcp.write_all(&answer).await.is_err() {
                return;
            }
        }
    })
    .await;
    let gw = gateway(up, |c| c.hold_standalone = false).await;
    let head = http::Request::builder()
        .method("HEAD")
        .uri("/mcp")
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let resp = send(gw.addr, head).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-length"], "5");
    let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
    let init = send(gw.addr, post(INITIALIZE, None)).await;
    assert_eq!(init.status(), 200, "the next request got the late body");
    let seen = seen.lock().unwrap();
    assert!(!seen.first_reused, "the HEAD's connection was used again");
    assert_eq!((seen.requests, seen.connections), (2, 2));
}
