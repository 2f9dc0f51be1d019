//! Limits and resume authorization: every bound has a test that can fail.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use mcp_reattach::config::ResumeAuth;
use mcp_reattach::Priming;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn with_auth(mut req: Request<Full<Bytes>>, name: &str, value: &str) -> Request<Full<Bytes>> {
    req.headers_mut().insert(
        http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
        value.parse().unwrap(),
    );
    req
}

async fn body_string(resp: Response<hyper::body::Incoming>) -> String {
    String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes()).into_owned()
}

/// Initializes `sid` as `principal` (header `name`), starts call 1 and returns the cursor of
/// its priming event after cutting the client.
async fn session_with_cut_call(
    gw: &Gw,
    mock: &mut Mock,
    sid: &str,
    name: &str,
    principal: &str,
) -> (String, SseWriter) {
    let init = with_auth(
        post(
            r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18"}}"#,
            None,
        ),
        name,
        principal,
    );
    let pending = tokio::spawn(send(gw.addr, init));
    mock.next().await.respond(json_response(
        200,
        &[("mcp-session-id", sid)],
        r#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-06-18"}}"#,
    ));
    assert_eq!(pending.await.unwrap().status(), 200);
    let pending = tokio::spawn(send(
        gw.addr,
        with_auth(post(&call(1), Some(sid)), name, principal),
    ));
    let writer = mock.next().await.respond_sse(Some(sid));
    let mut reader = SseReader::new(pending.await.unwrap());
    let cursor = reader.next().await.unwrap().id.unwrap();
    drop(reader);
    writer.message(&progress(1)).await;
    (cursor, writer)
}

#[tokio::test]
async fn a_resume_by_another_principal_gets_no_event_and_learns_nothing() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    let (cursor, _writer) =
        session_with_cut_call(&gw, &mut mock, "s1", "authorization", "Bearer alice").await;

    let intruder = send(
        gw.addr,
        with_auth(get("s1", Some(&cursor)), "authorization", "Bearer mallory"),
    )
    .await;
    assert_eq!(intruder.status(), 404);
    let refused = body_string(intruder).await;
    let unknown = body_string(
        send(
            gw.addr,
            with_auth(
                get("no-such", Some(&cursor)),
                "authorization",
                "Bearer mallory",
            ),
        )
        .await,
    )
    .await;
    assert_eq!(
        refused, unknown,
        "a refused resume looks exactly like an unknown session"
    );
    let anonymous = send(gw.addr, get("s1", Some(&cursor))).await;
    assert_eq!(
        anonymous.status(),
        404,
        "no credentials is another principal too"
    );

    let owner = send(
        gw.addr,
        with_auth(get("s1", Some(&cursor)), "authorization", "Bearer alice"),
    )
    .await;
    assert_eq!(owner.status(), 200);
    let events = {
        let mut r = SseReader::new(owner);
        vec![r.next().await.unwrap(), r.next().await.unwrap()]
    };
    assert_eq!(events[0].event.as_deref(), Some("mcp-reattach/resumed"));
    assert_eq!(messages(&events[1..]), vec![progress(1)]);
    assert!(mock.nothing_within(Duration::from_millis(50)).await);
}

#[tokio::test]
async fn principal_header_can_be_set_by_an_ingress() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.priming = Priming::Always;
        c.principal_header = Some(http::HeaderName::from_static("x-user"));
    })
    .await;
    let (cursor, _writer) = session_with_cut_call(&gw, &mut mock, "s1", "x-user", "alice").await;
    // Authorization is irrelevant now; x-user decides.
    let other = with_auth(
        with_auth(get("s1", Some(&cursor)), "x-user", "bob"),
        "authorization",
        "Bearer alice",
    );
    assert_eq!(send(gw.addr, other).await.status(), 404);
    assert_eq!(
        send(
            gw.addr,
            with_auth(get("s1", Some(&cursor)), "x-user", "alice")
        )
        .await
        .status(),
        200
    );
}

#[tokio::test]
async fn resume_auth_upstream_asks_the_upstream_with_the_callers_credentials() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.priming = Priming::Always;
        c.resume_auth = ResumeAuth::Upstream;
    })
    .await;
    let (cursor, _writer) =
        session_with_cut_call(&gw, &mut mock, "s1", "authorization", "Bearer token-1").await;

    // Token refreshed: the upstream accepts the new token, so the resume is served.
    let pending = tokio::spawn(send(
        gw.addr,
        with_auth(get("s1", Some(&cursor)), "authorization", "Bearer token-2"),
    ));
    let ping = mock.next().await;
    assert_eq!(ping.method, http::Method::POST);
    assert_eq!(ping.json_body()["method"], "ping");
    assert_eq!(ping.headers["authorization"], "Bearer token-2");
    assert_eq!(ping.headers["mcp-session-id"], "s1");
    assert!(ping.headers.get("last-event-id").is_none());
    let id = ping.json_body()["id"].clone();
    let answer =
        format!("event: message\ndata: {{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":{{}}}}\n\n");
    ping.respond(
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(Full::new(Bytes::from(answer)))
            .unwrap(),
    );
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut r = SseReader::new(resp);
    assert_eq!(
        r.next().await.unwrap().event.as_deref(),
        Some("mcp-reattach/resumed")
    );

    // The upstream refuses a stranger: no event.
    let pending = tokio::spawn(send(
        gw.addr,
        with_auth(get("s1", Some(&cursor)), "authorization", "Bearer stolen"),
    ));
    let ping = mock.next().await;
    ping.respond(
        Response::builder()
            .status(401)
            .body(Full::new(Bytes::new()))
            .unwrap(),
    );
    assert_eq!(pending.await.unwrap().status(), 404);
}

#[tokio::test]
async fn allowed_origins_refuse_others_with_403() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.allowed_origins = vec!["https://app.example".into()]
    })
    .await;
    let evil = with_auth(
        post(r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#, None),
        "origin",
        "https://evil.example",
    );
    let resp = send(gw.addr, evil).await;
    assert_eq!(resp.status(), 403);
    assert!(body_string(resp).await.contains("origin-not-allowed"));
    assert!(
        mock.nothing_within(Duration::from_millis(50)).await,
        "never forwarded"
    );
    for origin in [Some("https://app.example"), None] {
        let mut req = post(r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#, None);
        if let Some(o) = origin {
            req = with_auth(req, "origin", o);
        }
        let pending = tokio::spawn(send(gw.addr, req));
        mock.next()
            .await
            .respond(Response::new(Full::new(Bytes::from_static(b"{}"))));
        assert_eq!(pending.await.unwrap().status(), 200, "{origin:?}");
    }
}

async fn raw(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// At the default --max-headers (100, hyper's own default, which the gateway then leaves
/// unset): 100 header lines pass, 101 get 431.
#[tokio::test]
async fn the_default_header_count_is_100() {
    let mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    assert_eq!(gw.gateway.config().max_headers, 100);
    for n in [100, 101] {
        // A resume of an unknown session: the gateway answers it itself (404). `host`,
        // `connection`, `mcp-session-id` and `last-event-id` are four of the n.
        let many: String = (4..n).map(|i| format!("x-h{i}: v\r\n")).collect();
        let resp = raw(
            gw.addr,
            format!(
                "GET /mcp HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
                 mcp-session-id: no-such\r\nlast-event-id: 0123456789abcdef.0.1\r\n{many}\r\n"
            )
            .as_bytes(),
        )
        .await;
        let want = if n > 100 {
            "HTTP/1.1 431"
        } else {
            "HTTP/1.1 404"
        };
        assert!(resp.starts_with(want), "{n} headers: {resp}");
    }
}

#[tokio::test]
async fn oversized_heads_get_431() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.max_headers = 20;
        c.max_header_bytes = 16 << 10;
    })
    .await;
    let many: String = (0..40).map(|i| format!("x-h{i}: v\r\n")).collect();
    let resp = raw(
        gw.addr,
        format!("GET /mcp HTTP/1.1\r\nhost: x\r\n{many}\r\n").as_bytes(),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");
    let big = "a".repeat(32 << 10);
    let resp = raw(
        gw.addr,
        format!("GET /mcp HTTP/1.1\r\nhost: x\r\nx-big: {big}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");
    assert!(mock.nothing_within(Duration::from_millis(50)).await);
    let text = gw.gateway.render_metrics();
    assert!(
        text.contains("mcp_reattach_connection_errors_total{kind=\"head_too_large\"} 2"),
        "{text}"
    );
}

/// `--max-header-bytes` bounds the head, not the reads it came in: a head a little over the
/// default 64 KiB, written at once, is refused like a larger one (it was accepted when its
/// last read took it past the bound), and one at the bound is served.
#[tokio::test]
async fn a_head_just_over_the_bound_gets_431() {
    let mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    let max = gw.gateway.config().max_header_bytes;
    assert_eq!(max, 64 << 10);
    // A resume of an unknown session: the gateway answers it itself (404).
    let head = |len: usize| {
        let start = "GET /mcp HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
                     mcp-session-id: no-such\r\nlast-event-id: 0123456789abcdef.0.1\r\nx-pad: ";
        format!("{start}{}\r\n\r\n", "a".repeat(len - start.len() - 4))
    };
    for (len, want) in [
        (max, "HTTP/1.1 404"),
        (max + 1, "HTTP/1.1 431"),
        (70_000, "HTTP/1.1 431"),
    ] {
        let raw_head = head(len);
        assert_eq!(raw_head.len(), len);
        let resp = raw(gw.addr, raw_head.as_bytes()).await;
        assert!(resp.starts_with(want), "a head of {len} bytes: {resp}");
    }
}

/// Every request head the gateway's HTTP/1.1 refuses gets an access line (the real binary's
/// own writer, JSON): its status, the reason, the client's address, method and path `-`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_heads_get_an_access_line() {
    let mock = Mock::start().await;
    let mut gw = Binary::start(mock.addr, &["--log-format", "json"]).await;
    let big = format!(
        "GET /mcp HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
        "a".repeat(70_000)
    );
    for (request, status, reason) in [
        ("GET /mcp HTTP/1.1\r\nbad header\r\n\r\n".to_owned(), 400, "malformed-head"),
        (
            "POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n"
                .to_owned(),
            400,
            "ambiguous-framing",
        ),
        (big, 431, "head-too-large"),
    ] {
        let resp = raw(gw.addr, request.as_bytes()).await;
        assert!(resp.starts_with(&format!("HTTP/1.1 {status} ")), "{resp}");
        let line = loop {
            match gw.proc.next_line(Duration::from_secs(10)).await {
                NextLine::Line(l) if l.contains("request finished") => break l,
                NextLine::Line(_) => {}
                other => panic!("no access line for a refused head ({reason}): {other:?}"),
            }
        };
        let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
        assert_eq!(v["http.response.status_code"], status, "{line}");
        assert_eq!(v["error.type"], reason, "{line}");
        assert_eq!(v["http.request.method"], "-", "{line}");
        assert_eq!(v["url.path"], "-", "{line}");
        assert_eq!(v["client.address"], "127.0.0.1", "{line}");
    }
}

/// Sends part of a head and nothing more; returns how long until the gateway closed the
/// connection, on tokio's clock.
async fn slow_head_closed_after(gw: &Gw) -> Duration {
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /mcp HTTP/1.1\r\nhost: x\r\nx-slow: ")
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut out = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    assert!(r.is_ok(), "connection closed by the gateway");
    started.elapsed()
}

/// Paused clock: the cut comes at the header-read deadline, not before, and within a timer
/// slot or two after.
#[tokio::test(start_paused = true)]
async fn slow_headers_are_cut_at_the_header_read_timeout() {
    let mock = Mock::start().await;
    let timeout = Duration::from_millis(300);
    let gw = gateway(mock.addr, |c| c.header_read_timeout = timeout).await;
    let waited = slow_head_closed_after(&gw).await;
    assert!(
        waited >= timeout && waited <= timeout + Duration::from_millis(5),
        "{waited:?}"
    );
}

/// The real-time smoke of the same timer (hyper's, on tokio's clock): the one wall-clock
/// check that it fires at all outside a paused runtime (wide bounds: real scheduling).
#[tokio::test]
async fn slow_headers_are_cut_in_real_time() {
    let mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.header_read_timeout = Duration::from_millis(300)
    })
    .await;
    let waited = slow_head_closed_after(&gw).await;
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
}

#[tokio::test]
async fn connection_cap_holds_new_connections_until_one_closes() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.max_connections = 2).await;
    let a = TcpStream::connect(gw.addr).await.unwrap();
    let b = TcpStream::connect(gw.addr).await.unwrap();
    // Both are accepted (the gateway's connection gauge says so) before the third comes.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !gw
        .gateway
        .render_metrics()
        .contains("\nmcp_reattach_connections 2\n")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "two connections accepted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let third = tokio::spawn(send(
        gw.addr,
        post(r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#, None),
    ));
    assert!(
        mock.nothing_within(Duration::from_millis(300)).await,
        "the third connection waits"
    );
    drop(a);
    let seen = mock.next().await;
    seen.respond(Response::new(Full::new(Bytes::from_static(b"{}"))));
    assert_eq!(third.await.unwrap().status(), 200);
    drop(b);
}

#[tokio::test]
async fn upstream_that_never_answers_a_delete_gets_504() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.upstream_header_timeout = Duration::from_millis(300)
    })
    .await;
    let pending = tokio::spawn(send(
        gw.addr,
        Request::delete("/mcp")
            .header("mcp-session-id", "s")
            .body(Full::new(Bytes::new()))
            .unwrap(),
    ));
    let _held = mock.next().await; // never answered
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 504);
    assert!(body_string(resp).await.contains("upstream-timeout"));
}

#[tokio::test]
async fn memory_budget_sheds_idle_sessions_then_refuses_new_ones() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.memory_budget = 8 << 10).await;
    let pad = "p".repeat(300); // frames well under 10% of the budget
    let big = |i: u64| {
        format!(
            r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"i":{i},"pad":"{pad}"}}}}"#
        )
    };
    // Session a: fills ~5 KiB, then its client leaves (idle).
    init_session(&gw, &mut mock, "a").await;
    let pending = tokio::spawn(send(gw.addr, post(&call(1), Some("a"))));
    let wa = mock.next().await.respond_sse(Some("a"));
    let ra = SseReader::new(pending.await.unwrap());
    for i in 0..14 {
        wa.message(&big(i)).await;
    }
    gw.tagged_at_least(14).await;
    drop(ra);
    let a = gw.gateway.registry().get("a").unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while a.attached_clients() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "a's client left");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Session b (client attached) pushes past the budget: a, idle, is shed.
    init_session(&gw, &mut mock, "b").await;
    let pending = tokio::spawn(send(gw.addr, post(&call(2), Some("b"))));
    let wb = mock.next().await.respond_sse(Some("b"));
    let mut rb = SseReader::new(pending.await.unwrap());
    for i in 0..40 {
        wb.message(&big(i)).await;
        rb.next().await.unwrap();
        let used = gw.gateway.registry().window_bytes();
        assert!(used <= 8 << 10, "window bytes {used} over the budget");
    }
    assert!(
        gw.gateway.registry().get("a").is_none(),
        "the idle session was shed"
    );
    assert!(
        gw.gateway.registry().get("b").is_some(),
        "the attached one is kept (its own oldest events trimmed)"
    );
    // Every session is attached and the budget is full: a new session gets 503.
    let resp = send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{}}"#,
            None,
        ),
    )
    .await;
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let text = gw.gateway.render_metrics();
    assert!(
        text.contains("mcp_reattach_session_evictions_total{reason=\"memory_budget\"} 1"),
        "{text}"
    );
    drop((wa, wb));
}

/// The `mcp_reattach_memory_used_bytes` gauge (what `--memory-budget` counts).
fn memory_used(gw: &Gw) -> u64 {
    gw.metric("mcp_reattach_memory_used_bytes")
        .expect("memory_used_bytes gauge") as u64
}

/// Issue 11 bug 4: an event too large for the window, held in its stream's overflow slot
/// for the client, is counted in `--memory-budget` while it is held and released once it
/// was handed to the client.
#[tokio::test]
async fn oversized_events_held_for_a_client_count_in_the_memory_budget() {
    const BIG: usize = 64 << 10;
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.window_bytes = 8 << 10;
        c.priming = Priming::Always;
    })
    .await;
    init_session(&gw, &mut mock, "a").await;
    let pending = tokio::spawn(send(gw.addr, post(&call(1), Some("a"))));
    let writer = mock.next().await.respond_sse(Some("a"));
    let mut reader = SseReader::new(pending.await.unwrap());
    let cursor = reader.next().await.unwrap().id.expect("primed");
    drop(reader);
    let session = gw.gateway.registry().get("a").unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while session.attached_clients() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "client detached");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = memory_used(&gw);
    // (The `initialize` answer, upgraded to a stream, is in the window already.)
    let in_window = session.window_usage().0;
    let pad = "o".repeat(BIG);
    let big = format!(
        r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"pad":"{pad}"}}}}"#
    );
    let tagged = gw.tagged();
    writer.message(&big).await;
    gw.tagged_at_least(tagged + 1).await;
    assert_eq!(
        session.window_usage().0,
        in_window,
        "too large for the window"
    );
    let held = memory_used(&gw);
    assert!(
        held >= before + BIG as u64,
        "the held oversized event counts in the budget: {before} -> {held}"
    );
    assert_eq!(gw.gateway.registry().window_bytes() as u64, held);

    // The client resumes and gets it: the slot is freed, and so is its budget share.
    let mut reader = SseReader::new(send(gw.addr, get("a", Some(&cursor))).await);
    let got = loop {
        let e = reader.next().await.expect("the oversized event");
        if let Some(m) = messages(&[e]).pop() {
            break m;
        }
    };
    assert!(
        got == big,
        "the oversized event, whole ({} bytes)",
        got.len()
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    while memory_used(&gw) > before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the budget share was released: {}",
            memory_used(&gw)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(writer);
}

/// Issue 22 item 4: every method's body is bounded in size (`--max-request-bytes`) and in
/// time (`--header-read-timeout`), not only an upper-case `POST`'s; a `Content-Length` over
/// the limit is refused before the body is asked for (no `100 Continue`). Nothing reaches the
/// upstream.
#[tokio::test]
async fn every_methods_body_is_bounded_in_size_and_time() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.max_request_bytes = 1024;
        c.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    let big = "z".repeat(2000);
    // An extension method `post` (methods are case-sensitive) and PUT, with a length...
    for method in ["post", "PUT", "PATCH", "DELETE"] {
        let resp = raw(
            gw.addr,
            format!(
                "{method} /mcp HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{big}",
                big.len()
            )
            .as_bytes(),
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 413"), "{method}: {resp}");
    }
    // ... or chunked, without one.
    let resp = raw(
        gw.addr,
        format!(
            "PUT /mcp HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n",
            big.len()
        )
        .as_bytes(),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 413"), "chunked PUT: {resp}");
    // A declared length over the limit is refused before the client sends the body.
    let resp = raw(
        gw.addr,
        b"POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nexpect: 100-continue\r\ncontent-length: 5000\r\n\r\n",
    )
    .await;
    assert!(
        resp.starts_with("HTTP/1.1 413") && !resp.contains("100 Continue"),
        "{resp}"
    );
    // A trickled body on a GET is cut at the deadline like a POST's.
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /mcp HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nab")
        .await
        .unwrap();
    let mut out = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    assert!(r.is_ok(), "the gateway answered and closed in time");
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(mock.nothing_within(Duration::from_millis(100)).await);
}

/// Issue 22 item 3: a connection that never completes a first request head is closed at
/// `--header-read-timeout`, whatever it sent: nothing, part of the HTTP/2 preface, the whole
/// h2c preface and no request (hyper-util's version sniff runs before hyper's own header timer,
/// and HTTP/2 has none). So silent connections cannot hold `--max-connections` for good.
#[tokio::test]
async fn connections_that_never_send_a_request_are_closed_at_the_header_read_timeout() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.max_connections = 3;
        c.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    let openings: [&[u8]; 3] = [
        b"",
        b"PRI * HTTP/2.0\r\n",
        // The whole client preface and an empty SETTINGS frame, then no request.
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
    ];
    let mut idle = Vec::new();
    for opening in openings {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(opening).await.unwrap();
        idle.push(s);
    }
    let started = tokio::time::Instant::now();
    for (i, s) in idle.iter_mut().enumerate() {
        let mut out = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut out)).await;
        assert!(closed.is_ok(), "connection {i} closed by the gateway");
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // And the cap is free again for a client that sends a request.
    let pending = tokio::spawn(send(
        gw.addr,
        post(r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#, None),
    ));
    mock.next()
        .await
        .respond_json(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
    assert_eq!(pending.await.unwrap().status(), 200);
}

/// A slow tool call of the tests of issue 22 item 2.
const CALL: &str = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}"#;

/// Session `s` (legacy era, `--session-ttl` `session_ttl`) whose client sent [`CALL`] and
/// left before the upstream's head: the upstream has the request (`Seen`), and it is still
/// open 200 ms later (a legacy disconnect is not a cancel).
async fn abandoned_call(session_ttl: Duration) -> (Gw, Mock, Seen) {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.hold_standalone = false;
        c.session_ttl = session_ttl;
        c.json_upgrade = false;
    })
    .await;
    init_session(&gw, &mut mock, "s").await;
    let client = tokio::spawn(send(gw.addr, post(CALL, Some("s"))));
    let mut seen = mock.next().await;
    client.abort();
    assert!(
        !seen.closed_within(Duration::from_millis(200)).await,
        "a legacy disconnect is not a cancel"
    );
    (gw, mock, seen)
}

/// Issue 22 item 2: a POST whose client left before the upstream's response head finishes in
/// a task of its own (a legacy disconnect is not a cancel), but not for good: it may wait for
/// the head `--session-ttl` at most, and then the upstream request is ended. A modern-era
/// POST whose client leaves (an h2 `RST_STREAM(CANCEL)`, a closed connection) is cancelled at
/// once.
#[tokio::test]
async fn a_post_abandoned_before_its_head_is_bounded_and_a_modern_one_cancelled() {
    // Legacy: the client goes away; the upstream request lives on, then ends at the bound.
    let (gw, mut mock, mut seen) = abandoned_call(Duration::from_millis(400)).await;
    assert!(
        seen.closed_within(Duration::from_secs(3)).await,
        "ended once it waited --session-ttl for its head"
    );
    // Modern: cancelled with its client.
    let mut modern = post(CALL, None);
    modern
        .headers_mut()
        .insert("mcp-protocol-version", "2026-07-28".parse().unwrap());
    let client = tokio::spawn(send(gw.addr, modern));
    // The idle session's TTL ran out meanwhile: the gateway ended it upstream too.
    let mut seen = mock.next().await;
    if seen.method == http::Method::DELETE {
        assert_eq!(seen.headers["mcp-session-id"], "s");
        seen.respond(json_response(200, &[], ""));
        seen = mock.next().await;
    }
    client.abort();
    assert!(
        seen.closed_within(Duration::from_millis(300)).await,
        "a modern-era disconnect cancels"
    );
}

/// Issue 22 item 6: a session the gateway sheds (here at `--max-sessions`) is ended upstream
/// too: the upstream gets a `DELETE` with its id, instead of keeping a session whose client
/// the gateway can no longer serve. A session the gateway minted is the gateway's alone.
#[tokio::test]
async fn a_shed_session_is_ended_upstream() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.max_sessions = 1;
        c.hold_standalone = false;
    })
    .await;
    init_session(&gw, &mut mock, "old").await;
    // The next initialize sheds "old" (idle) before it is forwarded.
    let pending = tokio::spawn(send(gw.addr, post(INITIALIZE, None)));
    let mut seen = vec![mock.next().await, mock.next().await];
    seen.sort_by_key(|s| s.method != http::Method::DELETE);
    let delete = seen.remove(0);
    assert_eq!(delete.method, http::Method::DELETE, "{:?}", delete.method);
    assert_eq!(delete.headers["mcp-session-id"], "old");
    assert_eq!(delete.uri.path(), "/mcp");
    delete.respond(json_response(200, &[], ""));
    seen.remove(0).respond_initialized("new");
    assert_eq!(pending.await.unwrap().status(), 200);
    assert!(gw.gateway.registry().get("old").is_none());
    let text = gw.gateway.render_metrics();
    assert!(
        text.contains("mcp_reattach_session_evictions_total{reason=\"session_cap\"} 1"),
        "{text}"
    );
}

/// Issue 22 item 3: a connection that served its requests and then sends nothing more is
/// closed after `--idle-timeout`, on HTTP/1.1 keep-alive and on h2c alike (HTTP/2 had no idle
/// timeout at all: 50 idle h2c connections held a `--max-connections 50` gateway for good);
/// a connection with a response still streaming is not idle.
#[tokio::test]
async fn idle_connections_are_closed_after_the_idle_timeout_and_streaming_ones_are_not() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.idle_timeout = Duration::from_millis(400);
        c.hold_standalone = false;
    })
    .await;
    let ping = r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#;
    let answer = r#"{"jsonrpc":"2.0","id":1,"result":{}}"#;
    // HTTP/1.1 keep-alive: one request answered, then nothing.
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (mut h1, h1_conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    let h1_conn = tokio::spawn(h1_conn);
    let pending = tokio::spawn(h1.send_request(post(ping, None)));
    mock.next().await.respond_json(answer);
    assert_eq!(pending.await.unwrap().unwrap().status(), 200);
    // h2c: the same.
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (mut h2, h2_conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let h2_conn = tokio::spawn(h2_conn);
    let mut req = post(ping, None);
    *req.version_mut() = http::Version::HTTP_2;
    *req.uri_mut() = format!("http://{}/mcp", gw.addr).parse().unwrap();
    req.headers_mut().remove("host");
    let pending = tokio::spawn(h2.send_request(req));
    mock.next().await.respond_json(answer);
    assert_eq!(pending.await.unwrap().unwrap().status(), 200);
    // A third connection keeps a tool call's stream open past the idle timeout.
    init_session(&gw, &mut mock, "s").await;
    let (mut reader, writer) = start_call(&gw, &mut mock, "s", 2).await;
    let started = tokio::time::Instant::now();
    for (name, conn) in [("HTTP/1.1", h1_conn), ("h2c", h2_conn)] {
        let closed = tokio::time::timeout(Duration::from_secs(3), conn).await;
        assert!(closed.is_ok(), "the idle {name} connection was closed");
    }
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    writer.message(&progress(1)).await;
    let ev = tokio::time::timeout(WAIT, reader.next()).await.unwrap();
    assert!(ev.is_some(), "the streaming connection is still open");
}

/// Issue 22 item 2: a POST abandoned before its head ends with its session: after the
/// session's `DELETE`, the upstream request is ended at once, not at `--session-ttl`.
#[tokio::test]
async fn a_post_abandoned_before_its_head_ends_with_its_session() {
    let (gw, mut mock, mut seen) = abandoned_call(Duration::from_secs(60)).await;
    let delete = Request::delete("/mcp")
        .header("host", "mcp.example")
        .header("mcp-session-id", "s")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let pending = tokio::spawn(send(gw.addr, delete));
    mock.next().await.respond(json_response(200, &[], ""));
    assert_eq!(pending.await.unwrap().status(), 200);
    assert!(gw.gateway.registry().get("s").is_none());
    assert!(
        seen.closed_within(Duration::from_secs(2)).await,
        "the abandoned exchange ended with its session"
    );
}

/// The resident set of process `pid` (`VmRSS` of `/proc/<pid>/status`), in bytes.
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmRSS:")
                    .and_then(|v| v.trim().strip_suffix("kB"))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb << 10)
}

const MIB: f64 = (1 << 20) as f64;

/// One series of the real binary's `/metrics` (summed over its labels; 0 when absent).
async fn binary_metric(gw: &Binary, series: &str) -> f64 {
    let text = gw.admin_get("/metrics").await.expect("/metrics");
    metric_sum(&text, series).unwrap_or(0.0)
}

/// Sends `head` and then `body` on a new connection whose client never reads: its receive
/// buffer is small, so the kernel takes little of the answer off the gateway.
async fn unread_request(addr: std::net::SocketAddr, head: &str, body: &[u8]) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(16 << 10).unwrap();
    let mut s = sock.connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    s
}

/// The head of a POST of `len` body bytes into session `sid`.
fn post_head(sid: &str, len: usize) -> String {
    format!(
        "POST /mcp HTTP/1.1\r\nhost: mcp.example\r\ncontent-type: application/json\r\n\
         accept: application/json, text/event-stream\r\nmcp-session-id: {sid}\r\n\
         content-length: {len}\r\n\r\n"
    )
}

/// Issue 22 item 5 and issue 46 item 3, against the real binary: clients that call a tool
/// whose answer is larger than the window (an `echo` of megabytes) and never read it. The
/// answers stay within `--memory-budget` and what the sizing formula adds to it (each counted
/// from its first byte the gateway holds, in its reader or its stream; the rest waiting
/// upstream, which is not read meanwhile), and so does the process's resident set (before:
/// every answer was decoded whole in its reader, outside the budget: RSS grew by ~3 x the
/// answers while `memory_used_bytes` showed less than the budget), each
/// client is closed once it made no progress for `--stall-timeout`, even though the answer is
/// its stream's last event, and the memory comes back; meanwhile a legitimate client of another
/// session gets every event of its calls, in order, and no gateway error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_an_oversized_answer_stay_in_the_budget_and_are_closed() {
    const ATTACKERS: u64 = 24;
    const BIG: usize = 3 << 20;
    const BUDGET: f64 = 8.0 * MIB;
    const MAX_EVENT: f64 = 4.0 * MIB;
    // docs/operations.md's formula for what the budget's accounting may show: the budget, an
    // eighth of it for answers being decoded, one answer decoded past that (the mover) and
    // a read batch per upstream connection reading at that moment (the attackers' and the
    // legitimate calls, twice for a buffer's growth).
    let accounted = BUDGET + BUDGET / 8.0 + MAX_EVENT + (ATTACKERS + 2) as f64 * 128.0 * 1024.0;
    let mut mock = Mock::start().await;
    let gw = Binary::start(
        mock.addr,
        &[
            "--memory-budget",
            "8MiB",
            "--window-bytes",
            "64KiB",
            "--max-event-bytes",
            "4MiB",
            "--stall-timeout",
            "1s",
            "--hold-standalone",
            "false",
        ],
    )
    .await;
    let pid = gw.proc.id();
    init_session(&gw.addr, &mut mock, "legit").await;
    init_session(&gw.addr, &mut mock, "evil").await;
    let baseline = rss(pid);
    let (mut legit, legit_up) = start_call(&gw.addr, &mut mock, "legit", 1).await;
    let mut got = Vec::new();
    let (mut peak_rss, mut peak_used) = (baseline, 0.0f64);
    let text = "o".repeat(BIG);
    let mut attackers = Vec::new();
    for i in 0..ATTACKERS {
        let id = 100 + i;
        let body = call(id);
        attackers
            .push(unread_request(gw.addr, &post_head("evil", body.len()), body.as_bytes()).await);
        let seen = mock.next().await;
        assert_eq!(seen.json_body()["id"], id);
        let up = seen.respond_sse(Some("evil"));
        up.message(&format!(
            r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[{{"type":"text","text":"{text}"}}]}}}}"#
        ))
        .await;
        drop(up);
        // Meanwhile the legitimate client is served.
        legit_up.message(&progress(i)).await;
        got.push(legit.next().await.expect("the legitimate client's event"));
        peak_rss = peak_rss.max(rss(pid));
        peak_used = peak_used.max(binary_metric(&gw, "mcp_reattach_memory_used_bytes").await);
    }
    // A second call of the legitimate client during the attack is answered.
    let (mut second, second_up) = start_call(&gw.addr, &mut mock, "legit", 2).await;
    second_up.message(&result(2)).await;
    drop(second_up);
    assert_eq!(
        messages(&[second.next().await.expect("call 2's answer")]),
        vec![result(2)]
    );
    legit_up.message(&result(1)).await;
    drop(legit_up);
    got.push(legit.next().await.expect("call 1's answer"));
    let want: Vec<String> = (0..ATTACKERS).map(progress).chain([result(1)]).collect();
    assert_eq!(messages(&got), want, "every event of call 1, in order");
    assert!(
        got.iter().all(|e| e.event.as_deref() == Some("message")),
        "no gateway error on the legitimate stream"
    );
    // Every attacker is closed once it made no progress for --stall-timeout.
    let attack_end = std::time::Instant::now();
    let closed = loop {
        let closed = binary_metric(&gw, "mcp_reattach_stalled_closes_total").await;
        peak_rss = peak_rss.max(rss(pid));
        peak_used = peak_used.max(binary_metric(&gw, "mcp_reattach_memory_used_bytes").await);
        if closed >= ATTACKERS as f64 || attack_end.elapsed() > Duration::from_secs(60) {
            break closed;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let recovered_in = attack_end.elapsed();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while binary_metric(&gw, "mcp_reattach_memory_used_bytes").await > MIB
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (used_after, rss_after) = (
        binary_metric(&gw, "mcp_reattach_memory_used_bytes").await,
        rss(pid),
    );
    eprintln!(
        "oversized answers never read ({ATTACKERS} x {} MiB, --memory-budget 8MiB): RSS {:.1} MiB \
         before, peak {:.1} MiB, {:.1} MiB after; memory_used_bytes peak {:.1} MiB, {:.1} MiB \
         after; {closed} of {ATTACKERS} closed as stalled, {recovered_in:.1?} after the attack",
        BIG >> 20,
        baseline as f64 / MIB,
        peak_rss as f64 / MIB,
        rss_after as f64 / MIB,
        peak_used / MIB,
        used_after / MIB,
    );
    assert_eq!(
        closed, ATTACKERS as f64,
        "every client that never read its answer was closed"
    );
    assert!(
        peak_used <= accounted,
        "the answers held stayed within the budget and its formula: {peak_used} > {accounted}"
    );
    // The process holds what its accounting says, give or take the allocator's pages and
    // the connections' buffers: the answers (72 MiB here) never all sit in memory at once.
    let grew = (peak_rss - baseline) as f64;
    assert!(
        grew <= 3.0 * accounted,
        "RSS grew by {:.1} MiB, past three times the formula's {:.1} MiB",
        grew / MIB,
        accounted / MIB
    );
    assert!(used_after <= MIB, "the budget came back: {used_after}");
    drop(attackers);
}

/// A raw HTTP/1.1 request `head` on a new connection, and the response if one comes within
/// `wait` (empty if none: the gateway is waiting for the body).
async fn head_only(addr: std::net::SocketAddr, head: &str, wait: Duration) -> (TcpStream, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = match tokio::time::timeout(wait, s.read(&mut buf)).await {
        Ok(Ok(n)) => n,
        _ => 0,
    };
    (s, String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Issue 22 item 5: the bodies of all requests being read are bounded together
/// (`--max-buffered-request-bytes`), not only each one: a declared `Content-Length` that does
/// not fit is refused with 503 and `Retry-After` at once (its body is never asked for), a
/// chunked body when it grows past the room; a small POST is served meanwhile, and the room
/// comes back when the bodies holding it are gone. Nothing refused reaches the upstream.
#[tokio::test]
async fn the_bodies_being_read_are_bounded_together() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.max_request_bytes = 64 << 10;
        c.max_buffered_request_bytes = 100 << 10;
    })
    .await;
    let declared = |len: usize| {
        format!(
            "POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             connection: close\r\ncontent-length: {len}\r\n\r\n"
        )
    };
    // Two slow bodies of 40 KiB each hold 80 KiB.
    let mut slow = Vec::new();
    for _ in 0..2 {
        let (mut s, answer) =
            head_only(gw.addr, &declared(40 << 10), Duration::from_millis(200)).await;
        assert_eq!(answer, "", "waiting for its body");
        s.write_all(b"{\"jsonrpc\":").await.unwrap();
        slow.push(s);
    }
    // A third does not fit: refused before its body is read.
    let (_third, answer) = head_only(gw.addr, &declared(40 << 10), Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    assert!(answer.contains("request-bodies-full"), "{answer}");
    // A small POST fits and is served.
    let ping = r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#;
    let pending = tokio::spawn(send(gw.addr, post(ping, None)));
    mock.next()
        .await
        .respond_json(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
    assert_eq!(pending.await.unwrap().status(), 200);
    // A chunked body is counted as it arrives: refused once it would go over.
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let chunk = |n: usize| format!("{n:x}\r\n{}\r\n", "x".repeat(n));
    s.write_all(
        format!(
            "POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             transfer-encoding: chunked\r\n\r\n{}",
            chunk(10 << 10)
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(chunk(15 << 10).as_bytes()).await.unwrap();
    let mut out = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut out))
        .await
        .map_or(0, |r| r.unwrap_or(0));
    let answer = String::from_utf8_lossy(&out[..n]);
    assert!(answer.starts_with("HTTP/1.1 503"), "chunked: {answer:?}");
    assert!(mock.nothing_within(Duration::from_millis(100)).await);
    // The slow clients go away: their room comes back, and a 40 KiB body fits again.
    drop(slow);
    drop(s);
    let big = format!(
        r#"{{"jsonrpc":"2.0","id":2,"method":"ping","params":{{"pad":"{}"}}}}"#,
        "p".repeat(40 << 10)
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let resp = tokio::spawn(send(gw.addr, post(&big, None)));
        match tokio::time::timeout(Duration::from_millis(500), mock.next()).await {
            Ok(seen) => {
                seen.respond_json(r#"{"jsonrpc":"2.0","id":2,"result":{}}"#);
                assert_eq!(resp.await.unwrap().status(), 200);
                break;
            }
            Err(_) => {
                assert_eq!(resp.await.unwrap().status(), 503, "refused while held");
                assert!(tokio::time::Instant::now() < deadline, "the room came back");
            }
        }
    }
    let text = gw.gateway.render_metrics();
    assert!(
        text.contains(r#"mcp_reattach_requests_rejected_total{reason="request_bodies_full"} 2"#),
        "{text}"
    );
}

/// Issue 22 item 5, against the real binary: an attacker opening many POSTs that declare
/// 4 MiB bodies and never finish them (the shipped --max-request-bytes) holds at most
/// --max-buffered-request-bytes; the others are refused at once, and a legitimate client's
/// call is served during the attack, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_large_bodies_hold_at_most_the_buffered_bound_and_a_call_is_served() {
    const ATTACKERS: usize = 24;
    const BODY: usize = (4 << 20) - 1024;
    let mut mock = Mock::start().await;
    let gw = Binary::start(
        mock.addr,
        &[
            "--max-buffered-request-bytes",
            "16MiB",
            "--header-read-timeout",
            "60s",
            "--hold-standalone",
            "false",
        ],
    )
    .await;
    let pid = gw.proc.id();
    init_session(&gw.addr, &mut mock, "legit").await;
    let baseline = rss(pid);
    let head = format!(
        "POST /mcp HTTP/1.1\r\nhost: mcp.example\r\ncontent-type: application/json\r\n\
         content-length: {BODY}\r\n\r\n"
    );
    let filler = vec![b' '; BODY - 1];
    let (mut held, mut refused) = (Vec::new(), 0);
    let mut peak = baseline;
    for _ in 0..ATTACKERS {
        let (mut s, answer) = head_only(gw.addr, &head, Duration::from_millis(300)).await;
        if answer.starts_with("HTTP/1.1 503") && answer.contains("request-bodies-full") {
            refused += 1;
            continue;
        }
        assert_eq!(answer, "", "held or refused");
        // All of the body but its last byte, then nothing more.
        s.write_all(&filler).await.unwrap();
        held.push(s);
        tokio::time::sleep(Duration::from_millis(50)).await;
        peak = peak.max(rss(pid));
    }
    // During the attack, a legitimate call is served, whole.
    let (mut reader, writer) = start_call(&gw.addr, &mut mock, "legit", 1).await;
    writer.message(&progress(1)).await;
    writer.message(&result(1)).await;
    drop(writer);
    let got = vec![reader.next().await.unwrap(), reader.next().await.unwrap()];
    assert_eq!(messages(&got), vec![progress(1), result(1)]);
    peak = peak.max(rss(pid));
    let buffered = binary_metric(&gw, "mcp_reattach_buffered_request_bytes").await;
    // The attacker leaves: the room comes back at once.
    drop(held);
    let left = std::time::Instant::now();
    while binary_metric(&gw, "mcp_reattach_buffered_request_bytes").await > 0.0 {
        assert!(
            left.elapsed() < Duration::from_secs(10),
            "the room came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered_in = left.elapsed();
    eprintln!(
        "slow 4 MiB bodies ({ATTACKERS} connections, --max-buffered-request-bytes 16MiB): RSS \
         {:.1} MiB before, peak {:.1} MiB, {:.1} MiB after; {refused} refused with 503; {:.1} \
         MiB buffered at the end of the attack, 0 {recovered_in:.1?} after it",
        baseline as f64 / MIB,
        peak as f64 / MIB,
        rss(pid) as f64 / MIB,
        buffered / MIB,
    );
    assert_eq!(refused, ATTACKERS - 4, "four 4 MiB bodies fit in 16 MiB");
    assert!(buffered <= 16.0 * MIB, "{buffered}");
    assert!(
        peak.saturating_sub(baseline) < 48 << 20,
        "RSS grew {:.1} MiB",
        (peak - baseline) as f64 / MIB
    );
}
