//! Integration tests: the real gateway on 127.0.0.1:0 in front of a scriptable mock upstream.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use mcp_reattach::Priming;
use support::*;

const SID: &str = "sess-1";

async fn resume(gw: &Gw, cursor: &str) -> Response<hyper::body::Incoming> {
    send(gw.addr, get(SID, Some(cursor))).await
}

fn expected(n: u64, id: u64) -> Vec<String> {
    (1..n)
        .map(progress)
        .chain(std::iter::once(result(id)))
        .collect()
}

/// Cut the client after every possible number of events (0 ..= all), with the rest of the
/// stream arriving before or after the cut; the resume delivers exactly the remainder.
#[tokio::test]
async fn resume_after_cut_at_every_point_delivers_exactly_the_rest() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw, &mut mock, SID).await;
    const N: u64 = 6;
    for upstream_done_before_cut in [true, false] {
        for k in 0..=N as usize {
            // Request ids are never reused within a session (a reused id is a retransmission).
            let id = 100 + k as u64 + if upstream_done_before_cut { 0 } else { 50 };
            let all = expected(N, id);
            let (mut reader, writer) = start_call(&gw, &mut mock, SID, id).await;
            let priming = reader.next().await.unwrap();
            assert!(
                priming.id.is_some() && priming.data.as_deref() == Some(""),
                "priming first: {priming:?}"
            );
            let first_part = if upstream_done_before_cut {
                all.len()
            } else {
                k
            };
            for m in &all[..first_part] {
                writer.message(m).await;
            }
            let mut cursor = priming.id.clone().unwrap();
            let mut got = Vec::new();
            while got.len() < k {
                let e = reader.next().await.unwrap();
                cursor = e.id.clone().unwrap();
                got.extend(messages(&[e]));
            }
            drop(reader); // the cut
            for m in &all[first_part..] {
                writer.message(m).await;
            }
            drop(writer);
            let resp = resume(&gw, &cursor).await;
            if k == all.len() && resp.status() == 409 {
                // Cut after the result: when the gateway has seen the upstream's end before
                // the resume, nothing more will ever come after the cursor, and it says so.
                let body = body_json(resp).await;
                assert_eq!(body["error"]["data"]["reason"], "stream-ended", "{body}");
                continue;
            }
            assert_eq!(resp.status(), 200, "k={k}");
            let mut r = SseReader::new(resp);
            let resumed = r.next().await.unwrap();
            assert_eq!(resumed.event.as_deref(), Some("mcp-reattach/resumed"));
            assert_eq!(
                resumed.id.as_deref(),
                Some(cursor.as_str()),
                "resumed event carries the cursor position"
            );
            let info: serde_json::Value =
                serde_json::from_str(resumed.data.as_deref().unwrap()).unwrap();
            let rest = r.rest().await;
            got.extend(messages(&rest));
            assert_eq!(
                got, all,
                "k={k} upstream_done_before_cut={upstream_done_before_cut}"
            );
            // Replay counts what the window held at the resume (the upstream may still be arriving).
            assert!(
                info["replay"].as_u64().unwrap() <= (all.len() - k) as u64,
                "{info}"
            );
            // Ids are strictly increasing and unique.
            let seqs: Vec<u64> = rest
                .iter()
                .filter_map(|e| e.id.as_ref())
                .map(|i| i.rsplit('.').next().unwrap().parse().unwrap())
                .collect();
            assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
        }
    }
}

/// A call whose SSE answer comes whole with its head (a short call's usual case) is fed into
/// its stream at once: the client gets it with its length, its events tagged and retained (a
/// resume from the first gets the rest). With ids of the upstream's own (a stream the reader
/// may have to resume upstream) it goes through the stream's reader as any other, chunked.
#[tokio::test]
async fn a_call_answered_whole_is_fed_at_once_and_stays_resumable() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.keepalive = None).await;
    init_session(&gw, &mut mock, SID).await;
    let whole = |messages: &[String], upstream_ids: bool| {
        let body: String = messages
            .iter()
            .enumerate()
            .map(|(i, m)| match upstream_ids {
                true => format!("id: up-{i}\nevent: message\ndata: {m}\n\n"),
                false => format!("event: message\ndata: {m}\n\n"),
            })
            .collect();
        Response::builder()
            .header("content-type", "text/event-stream")
            .header("mcp-session-id", SID)
            .body(Full::new(Bytes::from(body)))
            .unwrap()
    };
    for (id, upstream_ids) in [(1u64, false), (2, true), (3, false)] {
        let all = expected(3, id);
        let pending = tokio::spawn(send(gw.addr, post(&call(id), Some(SID))));
        mock.next().await.respond(whole(&all, upstream_ids));
        let resp = pending.await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        assert_eq!(
            resp.headers().contains_key("content-length"),
            !upstream_ids,
            "id {id}: {:?}",
            resp.headers()
        );
        let events = SseReader::new(resp).rest().await;
        assert_eq!(messages(&events), all, "id {id}");
        let first = events[0].id.clone().expect("a tagged event");
        assert!(!first.starts_with("up-"), "{first}");
        let resp = resume(&gw, &first).await;
        assert_eq!(resp.status(), 200, "id {id}");
        let rest = SseReader::new(resp).rest().await;
        assert_eq!(messages(&rest), all[1..], "id {id}");
    }
}

#[tokio::test]
async fn upstream_ids_are_replaced_comments_dropped_retry_kept() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.keepalive = None).await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    writer.send("id: up-7\r\nevent: message\r\nretry: 2500\r\ndata: {\"jsonrpc\":\"2.0\",\r\ndata: \"method\":\"x\"}\r\n\r\n: ping - 2025-01-01\r\n\r\n").await;
    writer.message(&result(1)).await;
    drop(writer);
    let events = reader.rest().await;
    assert_eq!(events.len(), 2, "{events:?}");
    let id0 = events[0].id.as_deref().unwrap();
    assert_ne!(id0, "up-7");
    assert!(id0.bytes().all(|b| (0x21..=0x7e).contains(&b)));
    assert_eq!(events[0].retry, Some(2500));
    assert_eq!(
        events[0].data.as_deref(),
        Some("{\"jsonrpc\":\"2.0\",\n\"method\":\"x\"}")
    );
    assert!(
        !String::from_utf8_lossy(&reader.raw).contains("ping"),
        "upstream comments are dropped"
    );
}

#[tokio::test]
async fn ids_increase_across_streams_of_a_session() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let (mut a, wa) = start_call(&gw, &mut mock, SID, 1).await;
    let (mut b, wb) = start_call(&gw, &mut mock, SID, 2).await;
    wa.message(&progress(1)).await;
    wb.message(&progress(1)).await;
    wa.message(&result(1)).await;
    wb.message(&result(2)).await;
    drop((wa, wb));
    let ea = a.rest().await;
    let eb = b.rest().await;
    let parse = |id: &str| -> (String, u32, u64) {
        let p: Vec<&str> = id.split('.').collect();
        (
            p[0].to_owned(),
            p[1].parse().unwrap(),
            p[2].parse().unwrap(),
        )
    };
    let ia: Vec<_> = ea.iter().map(|e| parse(e.id.as_deref().unwrap())).collect();
    let ib: Vec<_> = eb.iter().map(|e| parse(e.id.as_deref().unwrap())).collect();
    assert_ne!(ia[0].1, ib[0].1, "ids encode the stream");
    assert_eq!(ia[0].0, ib[0].0, "same session epoch");
    let mut all: Vec<u64> = ia.iter().chain(&ib).map(|x| x.2).collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 4, "unique across streams");
    // A cursor of stream A never resumes B's events.
    let resp = resume(&gw, ea[0].id.as_deref().unwrap()).await;
    let mut r = SseReader::new(resp);
    let rest = r.rest().await;
    assert_eq!(messages(&rest), vec![result(1)]);
}

#[tokio::test]
async fn gap_on_a_post_stream_answers_the_pending_request_with_an_error() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.window_events = 3;
        c.priming = Priming::Always;
        c.stall_timeout = Duration::from_millis(300);
        c.sweep_interval = Duration::from_millis(50);
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 9).await;
    let mut cursor = reader.next().await.unwrap().id.unwrap();
    writer.message(&progress(1)).await;
    cursor = reader.next().await.map(|e| e.id.unwrap()).unwrap_or(cursor);
    drop(reader);
    for i in 2..=8 {
        writer.message(&progress(i)).await;
    }
    // The client stays away longer than the stall budget: the window (3 events) moves on
    // and no longer holds progress 2. Flow control holds the reader until then, so once all
    // eight are tagged, progress 2 has been evicted.
    gw.tagged_at_least(8).await;
    let resp = resume(&gw, &cursor).await;
    assert_eq!(resp.status(), 200);
    let mut r = SseReader::new(resp);
    let events = r.rest().await;
    assert_eq!(
        events[0].event.as_deref(),
        Some("mcp-reattach/resumption-failed")
    );
    let errs = messages(&events);
    assert_eq!(errs.len(), 1, "{events:?}");
    let err: serde_json::Value = serde_json::from_str(&errs[0]).unwrap();
    assert_eq!(err["id"], 9);
    assert_eq!(err["error"]["code"], -32010);
    assert_eq!(err["error"]["data"]["reason"], "gap");
    assert!(
        !events.iter().any(|e| e
            .data
            .as_deref()
            .is_some_and(|d| d.contains("notifications/progress"))),
        "no silent partial replay"
    );
    drop(writer);
}

#[tokio::test]
async fn resumption_failures_are_explicit() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    let good = reader.next().await.unwrap().id.unwrap();
    writer.message(&result(1)).await;
    drop(writer);
    let last = reader.rest().await.last().unwrap().id.clone().unwrap();
    // Everything delivered and the stream ended: nothing to re-attach to.
    let resp = resume(&gw, &last).await;
    assert_eq!(resp.status(), 409);
    assert_eq!(
        body_json(resp).await["error"]["data"]["reason"],
        "stream-ended"
    );

    // Malformed.
    for bad in ["garbage", "1", "", &"9".repeat(200)] {
        let resp = resume(&gw, bad).await;
        assert_eq!(resp.status(), 400, "{bad:?}");
        let j = body_json(resp).await;
        assert_eq!(j["error"]["data"]["reason"], "malformed-cursor");
    }
    // Another session's id (and an earlier run's: same shape, other epoch).
    let (epoch, rest) = good.split_once('.').unwrap();
    let other_epoch = format!(
        "{:016x}.{rest}",
        u64::from_str_radix(epoch, 16).unwrap() ^ 1
    );
    let resp = resume(&gw, &other_epoch).await;
    assert_eq!(resp.status(), 409);
    assert_eq!(
        body_json(resp).await["error"]["data"]["reason"],
        "foreign-cursor"
    );
    // Ahead of what the stream emitted.
    let (stream_part, seq) = rest.split_once('.').unwrap();
    let ahead = format!(
        "{epoch}.{stream_part}.{}",
        seq.parse::<u64>().unwrap() + 100
    );
    let resp = resume(&gw, &ahead).await;
    assert_eq!(resp.status(), 409);
    assert_eq!(
        body_json(resp).await["error"]["data"]["reason"],
        "cursor-ahead"
    );
    let unknown_stream = format!("{epoch}.999.{seq}");
    assert_eq!(resume(&gw, &unknown_stream).await.status(), 409);
    // Unknown session: 404, never forwarded.
    let resp = send(gw.addr, get("no-such-session", Some(&good))).await;
    assert_eq!(resp.status(), 404);
    assert_eq!(
        body_json(resp).await["error"]["data"]["reason"],
        "unknown-session"
    );
    assert!(
        mock.nothing_within(Duration::from_millis(100)).await,
        "resumes are never forwarded"
    );
}

#[tokio::test]
async fn cursor_from_an_earlier_gateway_run_is_foreign() {
    let mut mock = Mock::start().await;
    let gw1 = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw1, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw1, &mut mock, SID, 1).await;
    let old = reader.next().await.unwrap().id.unwrap();
    drop((reader, writer));
    // "Restart": a new gateway that meets the same session id again.
    let gw2 = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw2, &mut mock, SID).await;
    let resp = resume(&gw2, &old).await;
    assert_eq!(resp.status(), 409);
    assert_eq!(
        body_json(resp).await["error"]["data"]["reason"],
        "foreign-cursor"
    );
}

#[tokio::test]
async fn delete_drops_the_session_and_closes_held_upstream_streams() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    let cursor = reader.next().await.unwrap().id.unwrap();
    drop(reader);
    let pending = tokio::spawn(send(
        gw.addr,
        Request::delete("/mcp")
            .header("mcp-session-id", SID)
            .body(Full::new(Bytes::new()))
            .unwrap(),
    ));
    let seen = mock.next().await;
    assert_eq!(seen.method, http::Method::DELETE);
    seen.respond(Response::new(Full::new(Bytes::new())));
    assert_eq!(pending.await.unwrap().status(), 200);
    assert!(
        writer.closed_within(Duration::from_secs(2)).await,
        "held upstream stream closed"
    );
    assert_eq!(gw.gateway.registry().len(), 0);
    let resp = resume(&gw, &cursor).await;
    assert_eq!(resp.status(), 404);
}

#[tokio::test]
async fn upstream_404_drops_the_session() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    assert_eq!(gw.gateway.registry().len(), 1);
    let pending = tokio::spawn(send(gw.addr, post(&call(1), Some(SID))));
    let seen = mock.next().await;
    seen.respond(json_response(
        404,
        &[],
        r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32001,"message":"Session not found"}}"#,
    ));
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(
        body_json(resp).await["error"]["message"],
        "Session not found"
    );
    assert_eq!(gw.gateway.registry().len(), 0);
}

#[tokio::test]
async fn json_202_and_errors_pass_through_byte_identical() {
    let mut mock = Mock::start().await;
    // This script answers requests in order; the held standalone GET that follows
    // `notifications/initialized` is covered by its own tests. With `--json-upgrade false`
    // a JSON answer is the upstream's as it came (with the upgrade on, tests/fast/shapes.rs).
    let gw = gateway(mock.addr, |c| {
        c.hold_standalone = false;
        c.json_upgrade = false;
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    // JSON response, byte-identical, headers kept.
    let body = Bytes::from_static(b"{\"jsonrpc\":\"2.0\",  \"id\":1,\"result\":{\"tools\":[]}}\n");
    let pending = tokio::spawn(send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            Some(SID),
        ),
    ));
    let seen = mock.next().await;
    assert_eq!(
        seen.headers["host"], "mcp.example",
        "Host forwarded unchanged"
    );
    assert_eq!(seen.headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen.headers["x-forwarded-proto"], "http");
    assert_eq!(seen.uri.path(), "/mcp");
    seen.respond(json_response(200, &[("x-custom", "kept")], body.clone()));
    let resp = pending.await.unwrap();
    assert_eq!(resp.headers()["x-custom"], "kept");
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), body);
    // 202 with an empty body.
    let pending = tokio::spawn(send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            Some(SID),
        ),
    ));
    mock.next().await.respond(
        Response::builder()
            .status(202)
            .body(Full::new(Bytes::new()))
            .unwrap(),
    );
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 202);
    assert!(resp
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .is_empty());
    // Errors with their bodies and headers.
    let pending = tokio::spawn(send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#,
            Some(SID),
        ),
    ));
    mock.next().await.respond(
        Response::builder()
            .status(401)
            .header("www-authenticate", "Bearer realm=\"x\"")
            .body(Full::new(Bytes::from_static(b"nope")))
            .unwrap(),
    );
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(resp.headers()["www-authenticate"], "Bearer realm=\"x\"");
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "nope");
    // Query strings are forwarded as received.
    let pending = tokio::spawn(send(
        gw.addr,
        Request::options("/mcp?x=1&y=2")
            .header("origin", "http://evil.example")
            .body(Full::new(Bytes::new()))
            .unwrap(),
    ));
    let seen = mock.next().await;
    assert_eq!(seen.uri.path_and_query().unwrap().as_str(), "/mcp?x=1&y=2");
    assert_eq!(
        seen.headers["origin"], "http://evil.example",
        "Origin forwarded unchanged"
    );
    seen.respond(
        Response::builder()
            .status(403)
            .body(Full::new(Bytes::from_static(b"bad origin")))
            .unwrap(),
    );
    assert_eq!(pending.await.unwrap().status(), 403);
}

#[tokio::test]
async fn modern_era_is_pure_pass_through_and_a_disconnect_cancels() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    let mut req = post(
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}"#,
        None,
    );
    req.headers_mut()
        .insert("mcp-protocol-version", "2026-07-28".parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, req));
    let writer = mock.next().await.respond_sse(None);
    let resp = pending.await.unwrap();
    let mut reader = SseReader::new(resp);
    writer
        .send("id: upstream-1\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"x\"}\n\n")
        .await;
    let e = reader.next().await.unwrap();
    assert_eq!(
        e.id.as_deref(),
        Some("upstream-1"),
        "modern events are not tagged"
    );
    drop(reader);
    assert!(
        writer.closed_within(Duration::from_secs(3)).await,
        "a modern-era disconnect cancels the upstream request"
    );
    assert_eq!(gw.gateway.registry().len(), 0);

    // The era is also read from the body's _meta.
    let pending = tokio::spawn(send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"t","_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}}"#,
            Some("s2"),
        ),
    ));
    let writer = mock.next().await.respond_sse(Some("s2"));
    let mut reader = SseReader::new(pending.await.unwrap());
    writer.send("data: {}\n\n").await;
    assert_eq!(reader.next().await.unwrap().id, None);
    drop(reader);
    assert!(writer.closed_within(Duration::from_secs(3)).await);
}

#[tokio::test]
async fn legacy_disconnect_is_not_a_cancel() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let (reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    drop(reader);
    assert!(
        !writer.closed_within(Duration::from_millis(300)).await,
        "the gateway keeps reading the upstream"
    );
    writer.message(&progress(1)).await;
    writer.message(&result(1)).await;
}

#[tokio::test]
async fn upstream_down_gives_502_with_json_rpc_error() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let gw = gateway(dead, |_| {}).await;
    let resp = send(
        gw.addr,
        post(r#"{"jsonrpc":"2.0","id":5,"method":"ping"}"#, Some(SID)),
    )
    .await;
    assert_eq!(resp.status(), 502);
    let j = body_json(resp).await;
    assert_eq!(j["id"], 5);
    assert_eq!(j["error"]["data"]["reason"], "upstream-unavailable");
    // No internal detail (hyper's error text) reaches the client.
    assert_eq!(j["error"]["message"], "mcp-reattach: upstream unavailable");
}

#[tokio::test]
async fn upstream_stream_failures_end_pending_requests_explicitly_and_keep_serving() {
    for (bad, cause) in [
        (Bytes::from_static(b"data: \xff\xfe\n\n"), "UTF-8"),
        (
            Bytes::from(format!("data: {}\n\n", "x".repeat(2048))),
            "larger than",
        ),
    ] {
        let mut mock = Mock::start().await;
        let gw = gateway(mock.addr, |c| c.max_event_bytes = 1024).await;
        init_session(&gw, &mut mock, SID).await;
        let (mut reader, writer) = start_call(&gw, &mut mock, SID, 3).await;
        writer.message(&progress(1)).await;
        writer.send(bad).await;
        let events = reader.rest().await;
        let msgs = messages(&events);
        assert_eq!(msgs[0], progress(1), "what came before is delivered");
        let err: serde_json::Value = serde_json::from_str(msgs.last().unwrap()).unwrap();
        assert_eq!(err["id"], 3);
        assert_eq!(err["error"]["code"], -32011);
        assert!(
            err["error"]["message"].as_str().unwrap().contains(cause),
            "{err}"
        );
        assert!(
            writer.closed_within(Duration::from_secs(2)).await,
            "the broken upstream stream is closed"
        );
        // The session keeps working.
        let (mut reader, writer) = start_call(&gw, &mut mock, SID, 4).await;
        writer.message(&result(4)).await;
        drop(writer);
        assert_eq!(messages(&reader.rest().await), vec![result(4)]);
    }
}

#[tokio::test]
async fn event_larger_than_the_window_is_forwarded_but_cannot_be_resumed() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.window_bytes = 1024;
        c.priming = Priming::Always;
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    let cursor = reader.next().await.unwrap().id.unwrap();
    let big = format!(
        r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"data":"{}"}}}}"#,
        "y".repeat(4000)
    );
    writer.message(&big).await;
    let e = reader.next().await.unwrap();
    assert_eq!(
        e.data.as_deref(),
        Some(big.as_str()),
        "forwarded to the attached client"
    );
    drop(reader);
    let base = gw.tagged();
    writer.message(&result(1)).await;
    drop(writer);
    gw.tagged_at_least(base + 1).await;
    let resp = resume(&gw, &cursor).await;
    let events = SseReader::new(resp).rest().await;
    assert_eq!(
        events[0].event.as_deref(),
        Some("mcp-reattach/resumption-failed"),
        "a resume needing it fails explicitly: {events:?}"
    );
}

#[tokio::test]
async fn standalone_get_is_held_and_reattached_live_without_409() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw, &mut mock, SID).await;
    let pending = tokio::spawn(send(gw.addr, get(SID, None)));
    let seen = mock.next().await;
    assert_eq!(seen.method, http::Method::GET);
    let writer = seen.respond_sse(Some(SID));
    let mut reader = SseReader::new(pending.await.unwrap());
    let priming = reader.next().await.unwrap();
    writer
        .message(r#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#)
        .await;
    let n1 = reader.next().await.unwrap();
    drop(reader);
    writer
        .message(r#"{"jsonrpc":"2.0","method":"notifications/message","params":{"n":2}}"#)
        .await;
    // Resume from the last id: gets exactly the notification sent while away.
    let mut r = SseReader::new(resume(&gw, n1.id.as_deref().unwrap()).await);
    assert_eq!(
        r.next().await.unwrap().event.as_deref(),
        Some("mcp-reattach/resumed")
    );
    let e = r.next().await.unwrap();
    assert!(e.data.unwrap().contains("\"n\":2"));
    // A plain GET (no Last-Event-ID) attaches live, is not forwarded, replaces the older one.
    let mut live = SseReader::new(send(gw.addr, get(SID, None)).await);
    assert!(
        mock.nothing_within(Duration::from_millis(100)).await,
        "held stream: no second upstream GET"
    );
    let p = live.next().await.unwrap();
    assert!(
        p.id.is_some() && p.data.as_deref() == Some(""),
        "live attach opens with priming"
    );
    writer
        .message(r#"{"jsonrpc":"2.0","method":"notifications/message","params":{"n":3}}"#)
        .await;
    assert!(live.next().await.unwrap().data.unwrap().contains("\"n\":3"));
    assert!(
        r.rest()
            .await
            .iter()
            .all(|e| !e.data.as_deref().unwrap_or("").contains("\"n\":3")),
        "replaced attachment ends"
    );
    let _ = priming;
}

#[tokio::test]
async fn keepalive_comments_on_idle_streams() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.keepalive = Some(Duration::from_millis(50))).await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    writer.message(&result(1)).await;
    drop(writer);
    reader.rest().await;
    let raw = String::from_utf8_lossy(&reader.raw).into_owned();
    assert!(raw.matches(": keepalive\n\n").count() >= 2, "{raw}");
}

#[tokio::test]
async fn priming_auto_follows_the_protocol_version() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await; // auto
    init_session(&gw, &mut mock, SID).await; // 2025-06-18: no priming
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    writer.message(&result(1)).await;
    drop(writer);
    let ev = reader.rest().await;
    assert_eq!(ev.len(), 1);
    assert_eq!(messages(&ev), vec![result(1)]);
    let mut req = post(&call(2), Some(SID));
    req.headers_mut()
        .insert("mcp-protocol-version", "2025-11-25".parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, req));
    let writer = mock.next().await.respond_sse(Some(SID));
    let mut reader = SseReader::new(pending.await.unwrap());
    let first = reader.next().await.unwrap();
    assert_eq!(
        first.data.as_deref(),
        Some(""),
        "2025-11-25 sessions are primed"
    );
    drop(writer);
}

#[tokio::test]
async fn session_cap_sheds_the_least_recently_used_idle_session_else_503() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.max_sessions = 2).await;
    init_session(&gw, &mut mock, "a").await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    init_session(&gw, &mut mock, "b").await;
    // "c" sheds "a", the least recently used idle one, which is ended upstream too.
    let pending = tokio::spawn(send(gw.addr, post(INITIALIZE, None)));
    let mut seen = vec![mock.next().await, mock.next().await];
    seen.sort_by_key(|s| s.method != http::Method::DELETE);
    assert_eq!(seen[0].headers["mcp-session-id"], "a");
    let (delete, init) = (seen.remove(0), seen.remove(0));
    delete.respond(json_response(200, &[], ""));
    init.respond_initialized("c");
    assert_eq!(pending.await.unwrap().status(), 200);
    assert!(gw.gateway.registry().get("a").is_none());
    assert!(gw.gateway.registry().get("b").is_some());
    // Attach a client to every session: nothing idle to shed, initialize gets 503.
    let mut held = Vec::new();
    for s in ["b", "c"] {
        let pending = tokio::spawn(send(gw.addr, post(&call(1), Some(s))));
        let w = mock.next().await.respond_sse(Some(s));
        held.push((pending.await.unwrap(), w));
    }
    let resp = send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{}}"#,
            None,
        ),
    )
    .await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    assert!(
        mock.nothing_within(Duration::from_millis(100)).await,
        "not forwarded: the upstream creates no session"
    );
}

/// Issue 22 item 6: at the cap, a session whose client just dropped mid-call (its call still
/// running upstream, the client about to resume) is shed only after every idle session with
/// nothing to come back for, however recently used those are.
#[tokio::test]
async fn the_cap_sheds_sessions_with_nothing_running_first() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.max_sessions = 2;
        c.hold_standalone = false;
    })
    .await;
    init_session(&gw, &mut mock, "a").await;
    let (mut reader, writer) = start_call(&gw, &mut mock, "a", 1).await;
    writer.message(&progress(1)).await;
    assert!(reader.next().await.is_some());
    drop(reader); // the client's connection drops mid-call
    let a = gw.gateway.registry().get("a").unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while a.attached_clients() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "client detached");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    init_session(&gw, &mut mock, "b").await; // idle, nothing running, more recent than "a"
    init_session(&gw, &mut mock, "c").await;
    assert!(
        gw.gateway.registry().get("a").is_some(),
        "the running call's session stays"
    );
    assert!(
        gw.gateway.registry().get("b").is_none(),
        "the idle one is shed"
    );
    drop(writer);
}

/// Issue 11 bug 3: concurrent `initialize`s at the cap. Each takes its own place before it
/// is forwarded, so exactly `--max-sessions` reach the upstream and are tagged; the others
/// get the documented 503 (`session-cap`, `Retry-After: 1`) without being forwarded.
#[tokio::test]
async fn concurrent_initializes_at_the_cap_reserve_atomically() {
    const CAP: usize = 2;
    const TRIES: usize = 5;
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.max_sessions = CAP).await;
    let (tx, mut answers) = tokio::sync::mpsc::channel(TRIES);
    for i in 0..TRIES {
        let tx = tx.clone();
        let addr = gw.addr;
        tokio::spawn(async move {
            let init = format!(
                r#"{{"jsonrpc":"2.0","id":{i},"method":"initialize","params":{{"protocolVersion":"2025-06-18","capabilities":{{}},"clientInfo":{{"name":"t","version":"0"}}}}}}"#
            );
            let _ = tx.send(send(addr, post(&init, None)).await).await;
        });
    }
    // The upstream holds the winners' requests unanswered; the losers are refused meanwhile.
    let mut forwarded = Vec::new();
    for _ in 0..CAP {
        forwarded.push(mock.next().await);
    }
    for _ in 0..TRIES - CAP {
        let resp = tokio::time::timeout(WAIT, answers.recv())
            .await
            .expect("the losers are refused while the winners are still at the upstream")
            .unwrap();
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()["retry-after"], "1");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["data"]["reason"], "session-cap");
    }
    for (n, seen) in forwarded.into_iter().enumerate() {
        let id = seen.json_body()["id"].clone();
        let writer = seen.respond_sse(Some(&format!("s{n}")));
        writer
            .message(&format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{}}}}"#))
            .await;
    }
    for _ in 0..CAP {
        let resp = tokio::time::timeout(WAIT, answers.recv())
            .await
            .expect("the winners are answered")
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut reader = SseReader::new(resp);
        let first = reader.next().await.expect("the initialize result");
        assert!(first.id.is_some(), "the winner's stream is tagged");
    }
    assert_eq!(gw.gateway.registry().len(), CAP);
    assert!(
        mock.nothing_within(Duration::from_millis(100)).await,
        "only the winners were forwarded"
    );
}

#[tokio::test]
async fn sessions_expire_after_ttl_without_clients_and_close_upstream_streams() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.session_ttl = Duration::from_millis(300)).await;
    init_session(&gw, &mut mock, SID).await;
    let (reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        gw.gateway.registry().len(),
        1,
        "a client is attached: no expiry"
    );
    drop(reader);
    assert!(
        writer.closed_within(Duration::from_secs(3)).await,
        "expired: held upstream stream closed"
    );
    assert_eq!(gw.gateway.registry().len(), 0);
}

#[tokio::test]
async fn oversized_or_invalid_headers_are_rejected_clearly() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.max_request_bytes = 1024).await;
    let resp = send(
        gw.addr,
        post(
            &format!(
                r#"{{"jsonrpc":"2.0","id":1,"method":"x","params":{{"p":"{}"}}}}"#,
                "z".repeat(2000)
            ),
            None,
        ),
    )
    .await;
    assert_eq!(resp.status(), 413);
    assert_eq!(
        body_json(resp).await["error"]["data"]["reason"],
        "body-too-large"
    );
    let resp = send(gw.addr, get("bad id", Some("x"))).await;
    assert_eq!(resp.status(), 400);
    assert!(mock.nothing_within(Duration::from_millis(100)).await);
}

/// A client that stops reading is detached within the stall timeout (its connection is
/// closed if its body cannot even be polled), the upstream is never blocked, and the client
/// re-attaches from its last complete event with nothing lost or doubled. Paused clock: the
/// upstream's whole burst goes through before the stall timeout could even fire.
#[tokio::test(start_paused = true)]
async fn stalled_client_is_detached_and_resumes_without_loss() {
    let mut mock = Mock::start().await;
    let stall = Duration::from_millis(300);
    let gw = gateway(mock.addr, |c| {
        c.stall_timeout = stall;
        c.window_events = 100_000;
        c.window_bytes = 256 << 20;
        c.priming = Priming::Always;
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    let filler = "f".repeat(16 * 1024);
    const N: usize = 800; // ~13 MB: far more than loopback socket buffers hold
    let all: Vec<String> = (0..N)
        .map(|i| format!(r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"i":{i},"pad":"{filler}"}}}}"#))
        .chain(std::iter::once(result(1)))
        .collect();
    let base = gw.tagged();
    let started = tokio::time::Instant::now();
    for m in &all {
        writer.message(m).await;
    }
    drop(writer);
    // The gateway read the whole burst (not just the mock's channel taking it) before the
    // stall timeout could fire: the stalled client never held the upstream back.
    gw.tagged_at_least(base + all.len() as u64).await;
    let took = started.elapsed();
    assert!(
        took < stall,
        "the upstream was never blocked by the stalled client: its burst took {took:?}"
    );
    tokio::time::sleep(2 * stall).await; // the client reads nothing
    let mut got = Vec::new();
    let mut cursor = None;
    let mut signalled = false;
    while let Some(e) = reader.next().await {
        if e.event.as_deref() == Some("mcp-reattach/resumption-required") {
            signalled = true;
            assert!(
                e.retry.is_some(),
                "resumption-required carries a retry hint"
            );
        }
        if e.id.is_some() {
            cursor = e.id.clone();
        }
        got.extend(messages(&[e]));
    }
    assert!(
        got.len() < all.len(),
        "the stalled client was detached before the end ({} events)",
        got.len()
    );
    // The client was told one of the two documented ways: the resumption-required event if
    // its body could still be polled, else its connection was closed (the socket was full).
    let text = gw.gateway.render_metrics();
    let count = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(
        count("mcp_reattach_slow_consumer_detaches_total "),
        1.0,
        "{text}"
    );
    let closed = count("mcp_reattach_stalled_closes_total ");
    assert!(
        signalled != (closed == 1.0),
        "exactly one of: resumption-required seen ({signalled}), connection closed ({closed})"
    );
    eprintln!(
        "stalled client got {} of {} events before detach (signal event seen: {signalled})",
        got.len(),
        all.len()
    );
    let resp = resume(&gw, cursor.as_deref().unwrap()).await;
    assert_eq!(resp.status(), 200);
    got.extend(messages(&SseReader::new(resp).rest().await));
    assert_eq!(got.len(), all.len());
    assert!(got == all, "every event exactly once, in order");
}

/// A 2025-11-25 upstream that sets its own ids may close a stream early ("SSE polling"): the
/// gateway resumes it upstream with the upstream's last id after its `retry:`, and the client
/// sees one uninterrupted stream. Paused clock: the reconnect comes exactly `retry:` later.
#[tokio::test(start_paused = true)]
async fn upstream_that_closes_early_is_resumed_upstream_with_its_own_ids() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 5).await;
    writer.send("id: up-1\nretry: 100\ndata: \n\n").await; // the upstream's own priming
    writer
        .send(format!(
            "id: up-2\nevent: message\ndata: {}\n\n",
            progress(1)
        ))
        .await;
    drop(writer); // closes the stream before answering
    let started = tokio::time::Instant::now();
    let again = mock.next().await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(100) && waited <= Duration::from_millis(105),
        "retry honoured: reconnected after {waited:?}"
    );
    assert_eq!(again.method, http::Method::GET);
    assert_eq!(again.headers["last-event-id"], "up-2");
    assert_eq!(again.headers["mcp-session-id"], SID);
    let writer = again.respond_sse(Some(SID));
    writer
        .send(format!(
            "id: up-3\nevent: message\ndata: {}\n\n",
            progress(2)
        ))
        .await;
    writer
        .send(format!("id: up-4\nevent: message\ndata: {}\n\n", result(5)))
        .await;
    drop(writer);
    let events = reader.rest().await;
    assert_eq!(messages(&events), vec![progress(1), progress(2), result(5)]);
    assert!(
        events
            .iter()
            .all(|e| !e.id.as_deref().unwrap_or("").starts_with("up-")),
        "ids replaced"
    );
    assert!(
        mock.nothing_within(Duration::from_millis(200)).await,
        "no reconnect once answered"
    );
}

/// Issue 22 item 7: an upstream's `retry: 0` does not make the gateway reconnect in a tight
/// loop (it was ~570 a second): reconnects are at least 100 ms apart.
#[tokio::test]
async fn an_upstream_retry_of_zero_is_floored() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.hold_standalone = false).await;
    init_session(&gw, &mut mock, SID).await;
    let (_reader, writer) = start_call(&gw, &mut mock, SID, 5).await;
    writer
        .send(format!(
            "id: up-0\nretry: 0\nevent: message\ndata: {}\n\n",
            progress(1)
        ))
        .await;
    drop(writer);
    // Each reconnect gets one more event and the stream closes again, never answering.
    let started = tokio::time::Instant::now();
    let mut reconnects = 0u32;
    while started.elapsed() < Duration::from_secs(1) {
        let Ok(again) = tokio::time::timeout(Duration::from_millis(500), mock.next()).await else {
            break;
        };
        reconnects += 1;
        let w = again.respond_sse(Some(SID));
        w.send(format!(
            "id: up-{reconnects}\nevent: message\ndata: {}\n\n",
            progress(1)
        ))
        .await;
    }
    assert!(
        (3..=11).contains(&reconnects),
        "{reconnects} reconnects in 1 s (100 ms apart at most 10, and it does reconnect)"
    );
}

#[tokio::test]
async fn upstream_that_refuses_to_resume_ends_the_call_explicitly() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 5).await;
    writer.send("id: up-1\nretry: 10\ndata: \n\n").await;
    drop(writer);
    for _ in 0..3 {
        let again = mock.next().await;
        assert_eq!(again.headers["last-event-id"], "up-1");
        again.respond(
            Response::builder()
                .status(405)
                .body(Full::new(Bytes::new()))
                .unwrap(),
        );
    }
    let events = reader.rest().await;
    let err: serde_json::Value = serde_json::from_str(messages(&events).last().unwrap()).unwrap();
    assert_eq!(err["id"], 5);
    assert_eq!(err["error"]["code"], -32011);
}

#[tokio::test]
async fn x_forwarded_proto_from_the_hop_in_front_is_kept() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    for (sent, want) in [(Some("https"), "https"), (None, "http")] {
        let mut req = post(r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#, None);
        if let Some(p) = sent {
            req.headers_mut()
                .insert("x-forwarded-proto", p.parse().unwrap());
        }
        let pending = tokio::spawn(send(gw.addr, req));
        let seen = mock.next().await;
        assert_eq!(seen.headers["x-forwarded-proto"], want);
        assert_eq!(seen.headers.get_all("x-forwarded-proto").iter().count(), 1);
        seen.respond_json(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
        assert_eq!(pending.await.unwrap().status(), 200);
    }
}

/// The harness: the mock upstream stops when its handle drops (listener and connections),
/// so a test cannot leak a live upstream into the next one.
#[tokio::test]
async fn the_mock_upstream_stops_when_its_handle_drops() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let addr = mock.addr;
    drop(mock);
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the mock's listener closed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The gateway's pooled connection to it is gone too: a request now fails as unavailable.
    let resp = send(
        gw.addr,
        post(r#"{"jsonrpc":"2.0","id":5,"method":"ping"}"#, Some(SID)),
    )
    .await;
    assert_eq!(resp.status(), 502);
}

// The judge of every test above: the harness's own SSE parser (tests/support/sse.rs), checked
// here once rather than in every test crate that includes the harness.
fn all_splits(input: &[u8]) -> Vec<Vec<Event>> {
    (0..=input.len())
        .map(|i| {
            let mut p = SseParser::new();
            let mut out = Vec::new();
            p.feed(&input[..i], &mut out).unwrap();
            p.feed(&input[i..], &mut out).unwrap();
            out
        })
        .collect()
}

#[test]
fn the_harness_sse_parser_follows_the_spec_at_every_split() {
    let input = "\u{feff}: keep-alive\r\nid: 1.2\nevent: message\ndata: a\ndata:b\nretry: 50\n\n\
                 data\n\nid: x\n\n:only a comment\n\nid: 3\ndata: partial";
    for out in all_splits(input.as_bytes()) {
        assert_eq!(out.len(), 3, "{out:?}");
        assert_eq!(out[0].id.as_deref(), Some("1.2"));
        assert_eq!(out[0].event.as_deref(), Some("message"));
        assert_eq!(out[0].data.as_deref(), Some("a\nb"));
        assert_eq!(out[0].retry, Some(50));
        assert_eq!(out[1].data.as_deref(), Some(""));
        assert_eq!(out[1].id, None);
        assert_eq!(out[2].id.as_deref(), Some("x"));
        assert_eq!(out[2].data, None);
    }
    let mut p = SseParser::new();
    assert!(p.feed(b"data: \xff\n\n", &mut Vec::new()).is_err());
}

/// Issue 24: per-method metrics (the MCP method label from the fixed set, `other` beyond it),
/// per-tool counts behind `--metrics-tool-names` with its cap, the upstream's time to the
/// response head, and GET streams' lifetimes apart from request latency.
#[tokio::test]
async fn per_method_and_per_tool_metrics_and_stream_lifetimes() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.metrics_tool_names = 1;
        c.hold_standalone = false;
        c.json_upgrade = false;
    })
    .await;
    init_session(&gw, &mut mock, "s").await;
    for (id, tool) in [(1, "echo"), (2, "echo"), (3, "other-tool")] {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}"}}}}"#
        );
        let pending = tokio::spawn(send(gw.addr, post(&body, Some("s"))));
        mock.next()
            .await
            .respond_json(format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{}}}}"#));
        let resp = pending.await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.unwrap();
    }
    let pending = tokio::spawn(send(
        gw.addr,
        post(r#"{"jsonrpc":"2.0","id":9,"method":"x/custom"}"#, Some("s")),
    ));
    mock.next()
        .await
        .respond_json(r#"{"jsonrpc":"2.0","id":9,"result":{}}"#);
    pending.await.unwrap().into_body().collect().await.unwrap();
    // A GET stream that lives a moment.
    let pending = tokio::spawn(send(gw.addr, get("s", None)));
    let writer = mock.next().await.respond_sse(Some("s"));
    let resp = pending.await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop((resp, writer));
    let deadline = tokio::time::Instant::now() + WAIT;
    let text = loop {
        let text = gw.gateway.render_metrics();
        if text.contains("mcp_reattach_stream_duration_seconds_count 1")
            || tokio::time::Instant::now() > deadline
        {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    for needle in [
        "mcp_reattach_mcp_requests_total{method=\"tools/call\",status_class=\"2xx\"} 3",
        "mcp_reattach_mcp_requests_total{method=\"initialize\",status_class=\"2xx\"} 1",
        "mcp_reattach_mcp_requests_total{method=\"other\",status_class=\"2xx\"} 1",
        "mcp_reattach_mcp_request_duration_seconds_count{method=\"tools/call\"} 3",
        "mcp_reattach_tool_calls_total{tool=\"echo\"} 2",
        "mcp_reattach_tool_calls_total{tool=\"other\"} 1",
        "mcp_reattach_upstream_response_time_seconds_count 6",
        "mcp_reattach_stream_duration_seconds_count 1",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    assert!(
        !text.contains("mcp_reattach_request_duration_seconds_count{method=\"GET\""),
        "GET streams are not request latency:\n{text}"
    );
}
