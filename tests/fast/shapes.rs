//! Every legacy server shape (issue 21), against the scriptable mock upstream: a stateless
//! upstream gets a session the gateway mints (and never forwards), and a JSON answer becomes a
//! tagged SSE stream (`--json-upgrade`), resumable from its first event whenever the cut comes.
//! The same shapes with the real SDK servers and clients: tests/sdk/interop_shapes.rs.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use support::*;

const SID: &str = "sess-1";
/// Protocol versions with and without priming events.
const PRIMING_VERSION: &str = "2025-11-25";
const OLD_VERSION: &str = "2025-06-18";

fn with_version(mut req: Request<Full<Bytes>>, version: &str) -> Request<Full<Bytes>> {
    req.headers_mut()
        .insert("mcp-protocol-version", version.parse().unwrap());
    req
}

fn delete(session: &str) -> Request<Full<Bytes>> {
    Request::delete("/mcp")
        .header("host", "mcp.example")
        .header("mcp-session-id", session)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

fn is_minted(id: &str) -> bool {
    id.strip_prefix("mra-").is_some_and(|h| {
        h.len() == 32
            && h.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    })
}

/// An `initialize` answered by a stateless upstream (JSON, no session id): the client's
/// answer names the session the gateway minted.
async fn init_stateless(gw: &Gw, mock: &mut Mock) -> String {
    let pending = tokio::spawn(send(gw.addr, post(INITIALIZE, None)));
    let seen = mock.next().await;
    assert!(!seen.headers.contains_key("mcp-session-id"));
    seen.respond(json_response(
        200,
        &[],
        r#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-11-25","capabilities":{},"serverInfo":{"name":"stateless","version":"0"}}}"#,
    ));
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    let sid = resp.headers()["mcp-session-id"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(is_minted(&sid), "a minted id: {sid}");
    let events = SseReader::new(resp).rest().await;
    let msgs = messages(&events);
    assert_eq!(
        msgs.len(),
        1,
        "the initialize result, as an SSE event: {events:?}"
    );
    assert!(msgs[0].contains("\"serverInfo\""));
    sid
}

/// A gateway with a short `--upgrade-grace` (and no held standalone stream, so the mock
/// sees only the test's requests) in front of the mock, with session [`SID`] initialized.
async fn upgrading() -> (Mock, Gw) {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.hold_standalone = false;
        c.upgrade_grace = Duration::from_millis(50);
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    (mock, gw)
}

/// A POST of `req` the gateway commits to past the grace: the client's stream (its first,
/// id-bearing event read) and the upstream's request, not answered yet.
async fn committed(
    gw: &Gw,
    mock: &mut Mock,
    req: Request<Full<Bytes>>,
) -> (SseReader, Event, Seen) {
    let pending = tokio::spawn(send(gw.addr, req));
    let seen = mock.next().await;
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200, "committed before the answer");
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut client = SseReader::new(resp);
    let first = client.next().await.unwrap();
    assert!(first.id.is_some(), "an id first: {first:?}");
    (client, first, seen)
}

#[tokio::test]
async fn a_stateless_upstream_gets_a_minted_session_the_upstream_never_sees() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = mcp_reattach::Priming::Always).await;
    let sid = init_stateless(&gw, &mut mock).await;
    assert_eq!(gw.metric("mcp_reattach_sessions_minted_total"), Some(1.0));

    // `notifications/initialized`: forwarded without the id; no standalone stream is held.
    let pending = tokio::spawn(send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            Some(&sid),
        ),
    ));
    let seen = mock.next().await;
    assert!(
        !seen.headers.contains_key("mcp-session-id"),
        "never forwarded"
    );
    seen.respond(json_response(202, &[], ""));
    assert_eq!(pending.await.unwrap().status(), 202);

    // A call answered with SSE (no ids, as stateless SDK servers do), cut after one event.
    let pending = tokio::spawn(send(gw.addr, post(&call(1), Some(&sid))));
    let seen = mock.next().await;
    assert!(
        !seen.headers.contains_key("mcp-session-id"),
        "no GET was held and the call carries no id: {:?}",
        seen.method
    );
    assert_eq!(seen.json_body()["id"], 1);
    let up = seen.respond_sse(None);
    let resp = pending.await.unwrap();
    assert_eq!(resp.headers()["mcp-session-id"], sid.as_str());
    let mut client = SseReader::new(resp);
    let priming = client.next().await.unwrap();
    up.message(&progress(1)).await;
    let first = client.next().await.unwrap();
    assert_eq!(first.data.as_deref(), Some(progress(1).as_str()));
    drop(client);
    up.message(&progress(2)).await;
    up.message(&result(1)).await;
    drop(up);
    gw.tagged_at_least(2).await;
    // The resume names the minted session and is served by the gateway.
    let resp = send(gw.addr, get(&sid, first.id.as_deref())).await;
    assert_eq!(resp.status(), 200);
    let rest = messages(&SseReader::new(resp).rest().await);
    assert_eq!(rest, vec![progress(2), result(1)]);
    assert!(priming.id.is_some());

    // A GET without a cursor is forwarded without the id (stateless servers answer 405).
    let pending = tokio::spawn(send(gw.addr, get(&sid, None)));
    let seen = mock.next().await;
    assert_eq!(seen.method, http::Method::GET);
    assert!(!seen.headers.contains_key("mcp-session-id"));
    seen.respond(
        Response::builder()
            .status(405)
            .header("allow", "POST")
            .body(Full::new(Bytes::new()))
            .unwrap(),
    );
    assert_eq!(pending.await.unwrap().status(), 405);

    // DELETE ends the minted session at the gateway; the upstream is not asked.
    let resp = send(gw.addr, delete(&sid)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(gw.gateway.registry().len(), 0);
    assert!(mock.nothing_within(Duration::from_millis(200)).await);
    // Afterwards the id is gone: 404, still never forwarded.
    let resp = send(gw.addr, get(&sid, first.id.as_deref())).await;
    assert_eq!(resp.status(), 404);
    assert_eq!(
        body_json(resp).await["error"]["data"]["reason"],
        "unknown-session"
    );
    let resp = send(gw.addr, post(&call(2), Some(&sid))).await;
    assert_eq!(resp.status(), 404);
    assert!(mock.nothing_within(Duration::from_millis(200)).await);
}

/// Issue 46 item 10: a stateless upstream answers without a session id; a client that sends
/// an id of its own choosing (not of the minted form) gets the upstream's answer passed
/// through, and no session is created under the id it chose (before: the gateway created
/// one, bound to whoever named that id first).
#[tokio::test]
async fn a_stateless_upstream_gets_no_session_under_an_id_the_client_chose() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.hold_standalone = false).await;
    let pending = tokio::spawn(send(gw.addr, post(&call(3), Some("chosen-by-client"))));
    let writer = mock.next().await.respond_sse(None);
    writer.message(&result(3)).await;
    drop(writer);
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    let events = SseReader::new(resp).rest().await;
    assert_eq!(messages(&events), vec![result(3)]);
    assert!(
        events.iter().all(|e| e.id.is_none()),
        "untagged: {events:?}"
    );
    assert!(
        gw.gateway.registry().is_empty(),
        "no session under the chosen id"
    );
}

#[tokio::test]
async fn a_minted_session_is_its_creators_and_keeps_its_id() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.hold_standalone = false).await;
    let sid = init_stateless(&gw, &mut mock).await;
    // Someone else's DELETE gets exactly the answer for an unknown session; nothing ends.
    let mut other = delete(&sid);
    other
        .headers_mut()
        .insert("authorization", "Bearer mallory".parse().unwrap());
    let resp = send(gw.addr, other).await;
    assert_eq!(resp.status(), 404);
    assert_eq!(gw.gateway.registry().len(), 1);
    // A stateless upstream that starts naming sessions of its own cannot change the client's.
    let pending = tokio::spawn(send(gw.addr, post(&call(3), Some(&sid))));
    mock.next().await.respond(json_response(
        200,
        &[("mcp-session-id", "upstream-7")],
        result(3),
    ));
    let resp = pending.await.unwrap();
    assert_eq!(resp.headers()["mcp-session-id"], sid.as_str());
    assert_eq!(
        messages(&SseReader::new(resp).rest().await),
        vec![result(3)]
    );
    assert!(gw.gateway.registry().get("upstream-7").is_none());
    // An upstream 404 does not end a session the upstream never knew.
    let pending = tokio::spawn(send(gw.addr, post(&call(4), Some(&sid))));
    mock.next().await.respond(json_response(
        404,
        &[],
        r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32001,"message":"Not found"}}"#,
    ));
    assert_eq!(pending.await.unwrap().status(), 404);
    assert_eq!(gw.gateway.registry().len(), 1);
}

#[tokio::test]
async fn a_json_answer_becomes_a_tagged_stream_with_an_id_first() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.hold_standalone = false).await;
    init_session(&gw, &mut mock, SID).await;
    // Answered within the grace: priming where the version has it, else the tagged result
    // is the first event (no event of the gateway's, which rmcp refuses on `initialize`).
    for (id, version, primed) in [(1, PRIMING_VERSION, true), (2, OLD_VERSION, false)] {
        let pending = tokio::spawn(send(
            gw.addr,
            with_version(post(&call(id), Some(SID)), version),
        ));
        mock.next()
            .await
            .respond(json_response(200, &[("x-custom", "kept")], result(id)));
        let resp = pending.await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        assert_eq!(resp.headers()["x-custom"], "kept");
        // All of it was here: written with its length, not as a chunked stream.
        assert!(
            resp.headers().get("content-length").is_some()
                && resp.headers().get("transfer-encoding").is_none(),
            "{version}: {:?}",
            resp.headers()
        );
        let events = SseReader::new(resp).rest().await;
        assert!(
            events.iter().all(|e| e.id.is_some()),
            "{version}: every event has an id: {events:?}"
        );
        assert!(
            events
                .iter()
                .all(|e| e.event.as_deref().is_none_or(|t| t == "message")),
            "{version}: {events:?}"
        );
        assert_eq!(
            events.len(),
            1 + usize::from(primed),
            "{version}: {events:?}"
        );
        assert_eq!(
            events[0].data.as_deref() == Some(""),
            primed,
            "{version}: {events:?}"
        );
        assert_eq!(messages(&events), vec![result(id)], "{version}");
    }
    // A batch answer: one event per message.
    let pending = tokio::spawn(send(
        gw.addr,
        post(&format!("[{},{}]", call(5), call(6)), Some(SID)),
    ));
    mock.next()
        .await
        .respond_json(format!("[{},{}]", result(5), result(6)));
    let resp = pending.await.unwrap();
    assert_eq!(
        messages(&SseReader::new(resp).rest().await),
        vec![result(5), result(6)]
    );
    // The `initialize`'s JSON answer was one too.
    assert_eq!(
        gw.metric("mcp_reattach_json_upgrades_total{answer=\"json\"}"),
        Some(4.0)
    );
    // A client that does not accept SSE gets the JSON as it came.
    let mut json_only = post(&call(7), Some(SID));
    json_only
        .headers_mut()
        .insert("accept", "application/json".parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, json_only));
    mock.next().await.respond_json(result(7));
    let resp = pending.await.unwrap();
    assert_eq!(resp.headers()["content-type"], "application/json");
    assert_eq!(
        resp.into_body().collect().await.unwrap().to_bytes(),
        result(7)
    );
}

/// A JSON answer whose body comes after its head (chunked, or its `Content-Length` bytes
/// later) is read into the stream when it comes, as one that came whole with its head is.
#[tokio::test]
async fn a_json_answer_whose_body_follows_its_head_becomes_the_streams_events() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.hold_standalone = false;
        c.upgrade_grace = Duration::from_secs(10);
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    for (id, framed) in [(1, false), (2, true)] {
        let pending = tokio::spawn(send(gw.addr, post(&call(id), Some(SID))));
        let body = result(id);
        let len = body.len().to_string();
        let headers: &[(&str, &str)] = if framed {
            &[("content-length", &len)]
        } else {
            &[]
        };
        let writer = mock
            .next()
            .await
            .respond_streamed("application/json", headers);
        let resp = pending.await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let (first, rest) = body.split_at(body.len() / 2);
        writer.send(first.to_owned()).await;
        writer.send(rest.to_owned()).await;
        drop(writer);
        let events = SseReader::new(resp).rest().await;
        assert!(events.iter().all(|e| e.id.is_some()), "{events:?}");
        assert_eq!(messages(&events), vec![result(id)], "framed: {framed}");
    }
    assert_eq!(
        gw.metric("mcp_reattach_json_upgrades_total{answer=\"json\"}"),
        Some(3.0)
    );
}

/// A JSON answer that came whole but whose events do not all fit the session's window before
/// its client reads: the rest follow as the client reads them (flow control), none lost.
#[tokio::test]
async fn a_whole_json_answer_larger_than_the_window_reaches_its_client_whole() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.hold_standalone = false;
        c.window_events = 2;
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    let ids = 10..16;
    let batch =
        |f: fn(u64) -> String| format!("[{}]", ids.clone().map(f).collect::<Vec<_>>().join(","));
    let pending = tokio::spawn(send(gw.addr, post(&batch(call), Some(SID))));
    mock.next().await.respond_json(batch(result));
    let resp = pending.await.unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    // Not all of it fits at once: it streams.
    assert_eq!(resp.headers()["transfer-encoding"], "chunked");
    let events = SseReader::new(resp).rest().await;
    assert_eq!(messages(&events), ids.map(result).collect::<Vec<_>>());
    assert!(
        gw.metric("mcp_reattach_upstream_pauses_total") >= Some(1.0),
        "the answer waited for room"
    );
}

#[tokio::test]
async fn a_slow_json_answer_is_resumed_across_a_cut_and_retransmissions_are_not_forwarded() {
    let (mut mock, gw) = upgrading().await;
    // At a version before priming, the stream opens with the gateway's id-bearing
    // `mcp-reattach/stream` event instead.
    let req = with_version(post(&call(9), Some(SID)), OLD_VERSION);
    let (mut client, opening, seen) = committed(&gw, &mut mock, req).await;
    assert_eq!(opening.event.as_deref(), Some("mcp-reattach/stream"));
    seen.respond_json(result(9));
    assert_eq!(messages(&client.rest().await), vec![result(9)]);

    // Past the grace the client has the stream and its first id before the upstream answers.
    let req = with_version(post(&call(1), Some(SID)), PRIMING_VERSION);
    let (client, priming, seen) = committed(&gw, &mut mock, req).await;
    assert_eq!(priming.data.as_deref(), Some(""));
    let cursor = priming.id.expect("an id first");
    // The cut; the client retransmits the call (the seed's recovery): answered from the
    // stream.
    drop(client);
    let retransmitted = tokio::spawn(send(gw.addr, post(&call(1), Some(SID))));
    tokio::time::sleep(Duration::from_millis(100)).await;
    seen.respond_json(result(1));
    let resp = retransmitted.await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        messages(&SseReader::new(resp).rest().await),
        vec![result(1)]
    );
    assert!(
        mock.nothing_within(Duration::from_millis(100)).await,
        "never forwarded twice"
    );
    // And the resume at the cursor gets exactly the result.
    let resp = send(gw.addr, get(SID, Some(&cursor))).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        messages(&SseReader::new(resp).rest().await),
        vec![result(1)]
    );
}

#[tokio::test]
async fn errors_keep_their_status_within_the_grace_and_become_json_rpc_errors_after_it() {
    let (mut mock, gw) = upgrading().await;
    // A fast 401: the client learns it as it would directly.
    let pending = tokio::spawn(send(gw.addr, post(&call(1), Some(SID))));
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
    // Late answers that are no result: an explicit JSON-RPC error for the request.
    let late: [(u16, &str, &str); 3] = [
        (
            500,
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"boom"}}"#,
            "HTTP 500: boom",
        ),
        (200, r#"{"not":"json-rpc"}"#, "not a JSON-RPC message"),
        (200, "not json", "not JSON"),
    ];
    for (i, (status, body, says)) in late.into_iter().enumerate() {
        let id = 10 + i as u64;
        let (mut client, _, seen) = committed(&gw, &mut mock, post(&call(id), Some(SID))).await;
        seen.respond(json_response(status, &[], body.to_owned()));
        let rest = client.rest().await;
        let errors = messages(&rest);
        assert_eq!(errors.len(), 1, "{rest:?}");
        let e: serde_json::Value = serde_json::from_str(&errors[0]).unwrap();
        assert_eq!(e["id"], id);
        assert_eq!(e["error"]["code"], -32011);
        assert!(
            e["error"]["message"].as_str().unwrap().contains(says),
            "{e}"
        );
    }
    assert_eq!(
        gw.metric("mcp_reattach_json_upgrades_total{answer=\"status\"}"),
        Some(1.0)
    );
    // A late 404 is the session's end, as on any route.
    let (mut client, _, seen) = committed(&gw, &mut mock, post(&call(20), Some(SID))).await;
    seen.respond(json_response(
        404,
        &[],
        r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32001,"message":"Session not found"}}"#,
    ));
    let rest = client.rest().await;
    assert!(
        messages(&rest).iter().any(|m| m.contains("\"id\":20")),
        "{rest:?}"
    );
    assert_eq!(gw.gateway.registry().len(), 0);
}

#[tokio::test]
async fn an_upstream_that_dies_during_an_upgraded_call_ends_it_explicitly() {
    let (mut mock, gw) = upgrading().await;
    let (mut client, _, seen) = committed(&gw, &mut mock, post(&call(1), Some(SID))).await;
    drop(seen);
    drop(mock); // its connections close without an answer
    let rest = client.rest().await;
    let errors = messages(&rest);
    assert_eq!(errors.len(), 1, "{rest:?}");
    assert!(
        errors[0].contains("-32011") && errors[0].contains("\"id\":1"),
        "{errors:?}"
    );
}

#[tokio::test]
async fn with_the_upgrade_off_a_json_answer_passes_through() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.hold_standalone = false;
        c.json_upgrade = false;
    })
    .await;
    let pending = tokio::spawn(send(gw.addr, post(INITIALIZE, None)));
    mock.next().await.respond_json(result(0));
    let resp = pending.await.unwrap();
    // A stateless upstream still gets a minted session, named on the JSON answer.
    assert_eq!(resp.headers()["content-type"], "application/json");
    assert!(is_minted(
        resp.headers()["mcp-session-id"].to_str().unwrap()
    ));
    assert_eq!(
        resp.into_body().collect().await.unwrap().to_bytes(),
        result(0)
    );
}
