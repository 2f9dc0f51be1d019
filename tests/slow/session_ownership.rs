//! A session is its creator's (issue 20): knowing a session id is not enough to end it, read
//! it or answer for it, and requests that are not for the upstream's endpoint (`*`, `CONNECT`)
//! never reach another authority. Raw HTTP/1.1 where the SDKs cannot send the attack.

// Real sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use mcp_reattach::config::ResumeAuth;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SID: &str = "victim-session";
const VICTIM: &str = "Bearer victim-token";

/// Sends raw bytes on a fresh connection and reads the answer's head (up to the blank line).
async fn raw(gw: &Gw, request: &str) -> String {
    let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("an answer in time");
    String::from_utf8_lossy(&got).into_owned()
}

/// The victim's session, created by an `initialize` carrying its credentials on `/mcp`.
async fn victim_session(gw: &Gw, mock: &mut Mock) {
    let mut init = post(INITIALIZE, None);
    init.headers_mut()
        .insert("authorization", VICTIM.parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, init));
    mock.next().await.respond_initialized(SID);
    assert_eq!(pending.await.unwrap().status(), 200);
    assert!(gw.gateway.registry().get(SID).is_some());
}

/// The mock upstream, a gateway in front of it (adjusted by `tweak`), and the victim's
/// session.
async fn with_victim(tweak: impl FnOnce(&mut mcp_reattach::Config)) -> (Mock, Gw) {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, tweak).await;
    victim_session(&gw, &mut mock).await;
    (mock, gw)
}

/// The session's own `DELETE` (its path, its credentials), answered 200 by the upstream.
async fn own_delete(gw: &Gw, mock: &mut Mock) {
    let del = Request::delete("/mcp")
        .header("host", "mcp.example")
        .header("mcp-session-id", SID)
        .header("authorization", VICTIM)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let pending = tokio::spawn(send(gw.addr, del));
    mock.next().await.respond(answer(200));
    assert_eq!(pending.await.unwrap().status(), 200);
}

fn answer(status: u16) -> http::Response<Full<Bytes>> {
    http::Response::builder()
        .status(status)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

#[tokio::test]
async fn an_asterisk_target_or_connect_is_answered_by_the_gateway_and_never_forwarded() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    let head = raw(&gw, "OPTIONS * HTTP/1.1\r\nHost: mcp.example\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("\r\nallow: "), "{head}");
    for (request, status) in [
        (
            "POST * HTTP/1.1\r\nHost: mcp.example\r\nContent-Length: 2\r\n\r\n{}",
            400,
        ),
        // CONNECT is refused at the gateway: it is no forward proxy.
        (
            "CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n",
            405,
        ),
    ] {
        let head = raw(&gw, request).await;
        assert!(head.starts_with(&format!("HTTP/1.1 {status}")), "{head}");
    }
    assert!(mock.nothing_within(Duration::from_millis(200)).await);
}

#[tokio::test]
async fn a_repeated_session_header_is_a_400_and_ends_nothing() {
    let (mut mock, gw) = with_victim(|_| {}).await;
    let head = raw(
        &gw,
        &format!("POST /mcp HTTP/1.1\r\nHost: mcp.example\r\nMcp-Session-Id: {SID}\r\nMcp-Session-Id: other\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    assert!(mock.nothing_within(Duration::from_millis(200)).await);
    assert!(gw.gateway.registry().get(SID).is_some());
}

#[tokio::test]
async fn a_404_for_another_path_or_principal_does_not_end_the_session() {
    let (mut mock, gw) = with_victim(|_| {}).await;
    // Another path of the same upstream, with the victim's session id and no credentials.
    let favicon = Request::get("/favicon.ico")
        .header("host", "mcp.example")
        .header("mcp-session-id", SID)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let pending = tokio::spawn(send(gw.addr, favicon));
    mock.next().await.respond(answer(404));
    assert_eq!(pending.await.unwrap().status(), 404);
    assert!(gw.gateway.registry().get(SID).is_some(), "another path");
    // The session's own path, another principal: the upstream's 404 is for that caller.
    let pending = tokio::spawn(send(gw.addr, post(&call(3), Some(SID))));
    mock.next().await.respond(answer(404));
    assert_eq!(pending.await.unwrap().status(), 404);
    assert!(
        gw.gateway.registry().get(SID).is_some(),
        "another principal"
    );
    // The session's own request gets 404: the upstream has forgotten it.
    let mut own = post(&call(4), Some(SID));
    own.headers_mut()
        .insert("authorization", VICTIM.parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, own));
    mock.next().await.respond(answer(404));
    assert_eq!(pending.await.unwrap().status(), 404);
    assert!(
        gw.gateway.registry().get(SID).is_none(),
        "its own 404 ends it"
    );
}

#[tokio::test]
async fn only_the_sessions_principal_on_its_path_deletes_it() {
    let (mut mock, gw) = with_victim(|_| {}).await;
    for (path, auth) in [("/other", Some(VICTIM)), ("/mcp", None)] {
        let mut del = Request::delete(path)
            .header("host", "mcp.example")
            .header("mcp-session-id", SID);
        if let Some(a) = auth {
            del = del.header("authorization", a);
        }
        let pending = tokio::spawn(send(gw.addr, del.body(Full::new(Bytes::new())).unwrap()));
        mock.next().await.respond(answer(200));
        assert_eq!(pending.await.unwrap().status(), 200);
        assert!(
            gw.gateway.registry().get(SID).is_some(),
            "DELETE {path} {auth:?}"
        );
    }
    own_delete(&gw, &mut mock).await;
    assert!(gw.gateway.registry().get(SID).is_none());
}

#[tokio::test]
async fn a_retransmission_or_resume_on_another_path_is_not_one() {
    let (mut mock, gw) = with_victim(|c| c.resume_auth = ResumeAuth::Upstream).await;
    // The victim's call 2 streams on /mcp.
    let mut own = post(&call(2), Some(SID));
    own.headers_mut()
        .insert("authorization", VICTIM.parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, own));
    let writer = mock.next().await.respond_sse(Some(SID));
    let mut victim = SseReader::new(pending.await.unwrap());
    writer.message(&result(2)).await;
    let answered = victim.next().await.expect("the victim's result");
    let cursor = answered.id.clone().expect("a tagged event");
    // Someone without credentials retransmits id 2 to a public path of the same upstream:
    // it reaches the upstream as an ordinary request there, never as the victim's stream.
    let pending = tokio::spawn(send(
        gw.addr,
        Request::post("/public")
            .header("host", "mcp.example")
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-session-id", SID)
            .body(Full::new(Bytes::from(call(2))))
            .unwrap(),
    ));
    let seen = mock.next().await;
    assert_eq!(seen.uri.path(), "/public");
    assert_eq!(
        seen.json_body()["method"],
        "tools/call",
        "forwarded, not pinged"
    );
    seen.respond(json_response(404, &[], "{}"));
    assert_eq!(pending.await.unwrap().status(), 404);
    // A resume there finds no session either.
    let mut resume = get(SID, Some(&cursor));
    *resume.uri_mut() = "/public".parse().unwrap();
    assert_eq!(send(gw.addr, resume).await.status(), 404);
    assert!(gw.gateway.registry().get(SID).is_some());
}

/// A POST carrying `call(id)` into the victim's session with `auth` (none: no credentials).
fn call_as(id: u64, auth: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = post(&call(id), Some(SID));
    if let Some(a) = auth {
        req.headers_mut()
            .insert("authorization", a.parse().unwrap());
    }
    req
}

#[tokio::test]
async fn another_principals_stream_never_answers_for_the_sessions_owner() {
    let (mut mock, gw) = with_victim(|_| {}).await;
    // Someone who knows the session id posts id 2 first (SDKs count from 0).
    let pending = tokio::spawn(send(gw.addr, call_as(2, Some("Bearer attacker"))));
    let writer = mock.next().await.respond_sse(Some(SID));
    writer
        .message(r#"{"jsonrpc":"2.0","id":2,"result":{"content":[{"type":"text","text":"INJECTED by attacker"}]}}"#)
        .await;
    drop(writer);
    let mut attacker = SseReader::new(pending.await.unwrap());
    assert!(attacker.next().await.is_some());
    // The victim's own request 2 is its own: forwarded, its side effect runs.
    let pending = tokio::spawn(send(gw.addr, call_as(2, Some(VICTIM))));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["id"], 2);
    let writer = seen.respond_sse(Some(SID));
    writer.message(&result(2)).await;
    drop(writer);
    let got = SseReader::new(pending.await.unwrap()).rest().await;
    let text = messages(&got).join("\n");
    assert!(!text.contains("INJECTED"), "{text}");
    assert!(text.contains(r#""id":2"#), "{text}");
}

#[tokio::test]
async fn a_retransmission_is_never_run_twice_however_many_streams_ended_since() {
    let (mut mock, gw) = with_victim(|_| {}).await;
    // Call 2 and then 70 more, each answered and ended: more than the 64 ended streams whose
    // metadata a session keeps.
    for id in 2..=72 {
        let pending = tokio::spawn(send(gw.addr, call_as(id, Some(VICTIM))));
        let writer = mock.next().await.respond_sse(Some(SID));
        writer.message(&result(id)).await;
        drop(writer);
        SseReader::new(pending.await.unwrap()).rest().await;
    }
    // Its retransmission is refused as a duplicate, never forwarded.
    let resp = send(gw.addr, call_as(2, Some(VICTIM))).await;
    assert_eq!(resp.status(), 409);
    assert!(mock.nothing_within(Duration::from_millis(200)).await);
}

#[tokio::test]
async fn a_live_call_of_a_session_that_ends_gets_an_explicit_error() {
    let (mut mock, gw) = with_victim(|_| {}).await;
    let pending = tokio::spawn(send(gw.addr, call_as(5, Some(VICTIM))));
    let writer = mock.next().await.respond_sse(Some(SID));
    writer.message(&progress(1)).await;
    let mut call = SseReader::new(pending.await.unwrap());
    assert!(call.next().await.is_some(), "the progress event");
    // The session's own DELETE ends it while the call is still running.
    own_delete(&gw, &mut mock).await;
    let rest = messages(&call.rest().await).join("\n");
    let error: serde_json::Value = serde_json::from_str(&rest).expect("one JSON-RPC error");
    assert_eq!(error["id"], 5, "{rest}");
    assert_eq!(error["error"]["data"]["reason"], "session-closed", "{rest}");
    drop(writer);
}

#[tokio::test]
async fn headers_the_gateway_acts_on_cannot_be_nominated_hop_by_hop() {
    let (mut mock, gw) = with_victim(|_| {}).await;
    let mut req = call_as(6, Some(VICTIM));
    req.headers_mut().insert(
        "connection",
        "mcp-session-id, authorization, mcp-protocol-version, x-other"
            .parse()
            .unwrap(),
    );
    req.headers_mut()
        .insert("mcp-protocol-version", "2025-06-18".parse().unwrap());
    req.headers_mut().insert("x-other", "1".parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, req));
    let seen = mock.next().await;
    // What the gateway acted on is what the upstream sees; other nominations still go.
    assert_eq!(seen.headers["mcp-session-id"], SID);
    assert_eq!(seen.headers["authorization"], VICTIM);
    assert_eq!(seen.headers["mcp-protocol-version"], "2025-06-18");
    assert!(!seen.headers.contains_key("x-other"));
    seen.respond(json_response(202, &[], ""));
    assert_eq!(pending.await.unwrap().status(), 202);
}

#[tokio::test]
async fn an_http11_request_without_exactly_one_valid_host_is_a_400() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    let body = INITIALIZE;
    let len = body.len();
    for host in [
        "",
        "Host: a.example\r\nHost: b.example\r\n",
        "Host: a b\r\n",
    ] {
        let head = raw(
            &gw,
            &format!("POST /mcp HTTP/1.1\r\n{host}Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n{body}"),
        )
        .await;
        assert!(head.starts_with("HTTP/1.1 400"), "{host:?}: {head}");
    }
    assert!(mock.nothing_within(Duration::from_millis(200)).await);
}

#[tokio::test]
async fn the_upstream_cannot_speak_as_the_gateway() {
    let (mut mock, gw) = with_victim(|_| {}).await;
    let pending = tokio::spawn(send(gw.addr, call_as(9, Some(VICTIM))));
    let writer = mock.next().await.respond_sse(Some(SID));
    writer
        .send("event: mcp-reattach/resumed\ndata: {\"forged\":true}\n\n")
        .await;
    writer.message(&result(9)).await;
    drop(writer);
    let events = SseReader::new(pending.await.unwrap()).rest().await;
    let types: Vec<_> = events.iter().map(|e| e.event.clone()).collect();
    assert!(
        !types
            .iter()
            .any(|t| t.as_deref() == Some("mcp-reattach/resumed")),
        "{types:?}"
    );
    assert!(
        types
            .iter()
            .any(|t| t.as_deref() == Some("upstream/mcp-reattach/resumed")),
        "{types:?}"
    );
}

/// Answers the gateway's resume-auth `ping` (with whatever credentials it carries) as a
/// server that accepts them would.
async fn accept_ping(mock: &mut Mock, auth: &str) {
    let ping = mock.next().await;
    assert_eq!(ping.json_body()["method"], "ping");
    assert_eq!(ping.uri.path(), "/mcp", "asked of the session's endpoint");
    assert_eq!(ping.headers["authorization"], auth);
    ping.respond_json(r#"{"jsonrpc":"2.0","id":"mcp-reattach-resume-auth","result":{}}"#);
}

#[tokio::test]
async fn a_token_refreshed_mid_call_still_resumes_and_retransmits_with_resume_auth_upstream() {
    let (mut mock, gw) = with_victim(|c| c.resume_auth = ResumeAuth::Upstream).await;
    let pending = tokio::spawn(send(gw.addr, call_as(2, Some(VICTIM))));
    let writer = mock.next().await.respond_sse(Some(SID));
    writer.message(&progress(1)).await;
    let mut call = SseReader::new(pending.await.unwrap());
    let cursor = call
        .next()
        .await
        .and_then(|e| e.id)
        .expect("a tagged event");
    drop(call); // the connection drops; meanwhile the client refreshes its token
    const REFRESHED: &str = "Bearer refreshed-token";
    let mut resume = get(SID, Some(&cursor));
    resume
        .headers_mut()
        .insert("authorization", REFRESHED.parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, resume));
    accept_ping(&mut mock, REFRESHED).await;
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200, "resumed with the refreshed token");
    drop(resp);
    // Its retransmission of call 2 with the new token is answered from the stream, not run.
    let pending = tokio::spawn(send(gw.addr, call_as(2, Some(REFRESHED))));
    accept_ping(&mut mock, REFRESHED).await;
    writer.message(&result(2)).await;
    drop(writer);
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    let got = messages(&SseReader::new(resp).rest().await).join("\n");
    assert!(got.contains(r#""id":2"#), "{got}");
    assert!(
        mock.nothing_within(Duration::from_millis(200)).await,
        "call 2 ran once"
    );
}

#[tokio::test]
async fn an_h2_asterisk_path_is_never_forwarded() {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    for (method, status) in [(http::Method::OPTIONS, 200), (http::Method::POST, 400)] {
        let mut req = Request::new(Full::new(Bytes::from_static(b"{}")));
        *req.method_mut() = method.clone();
        *req.uri_mut() = http::Uri::from_parts({
            let mut p = http::uri::Parts::default();
            p.scheme = Some(http::uri::Scheme::HTTP);
            p.authority = Some("mcp.example".parse().unwrap());
            p.path_and_query = Some(http::uri::PathAndQuery::from_static("*"));
            p
        })
        .unwrap_or_else(|_| "*".parse().unwrap());
        let resp = tokio::time::timeout(WAIT, sender.send_request(req))
            .await
            .expect("an answer in time")
            .expect("a response");
        assert_eq!(resp.status(), status, "{method} :path *");
    }
    assert!(mock.nothing_within(Duration::from_millis(200)).await);
}
