//! The standalone stream held from session start (issue 14), against the scriptable mock
//! upstream: once the client's `notifications/initialized` is accepted the gateway opens the
//! upstream GET itself, so what the server sends there before the client's own GET arrives is
//! delivered when it does; a 405 upstream keeps today's answer; the flag turns it off; a held
//! stream the upstream ends is held again.

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response};
use http_body_util::Full;
use mcp_reattach::Priming;
use support::*;

const SID: &str = "sess-hold";

/// Sends `notifications/initialized` and answers it with 202. The client's 202 waits (bounded)
/// for the gateway's own standalone GET, so it is returned pending, with that GET if one came.
async fn initialized(
    gw: &Gw,
    mock: &mut Mock,
) -> (
    Option<Seen>,
    tokio::task::JoinHandle<http::Response<hyper::body::Incoming>>,
) {
    let pending = tokio::spawn(send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            Some(SID),
        ),
    ));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["method"], "notifications/initialized");
    seen.respond(
        Response::builder()
            .status(202)
            .header("mcp-session-id", SID)
            .body(Full::new(Bytes::new()))
            .unwrap(),
    );
    let held = tokio::time::timeout(Duration::from_millis(500), mock.requests.recv())
        .await
        .ok()
        .flatten();
    (held, pending)
}

async fn accepted(pending: tokio::task::JoinHandle<http::Response<hyper::body::Incoming>>) {
    assert_eq!(pending.await.unwrap().status(), 202);
}

fn note(n: u64) -> String {
    format!(r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"n":{n}}}}}"#)
}

fn gauge(gw: &Gw) -> f64 {
    gw.metric("mcp_reattach_held_standalone_streams")
        .expect("gauge exported")
}

#[tokio::test]
async fn messages_sent_before_the_clients_get_are_delivered_when_it_comes() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw, &mut mock, SID).await;
    let (held, pending) = initialized(&gw, &mut mock).await;
    // The gateway's own GET, with the session's headers and no cursor.
    let held = held.expect("the gateway's GET");
    assert_eq!(held.method, Method::GET);
    assert_eq!(held.headers["mcp-session-id"], SID);
    assert_eq!(held.headers["accept"], "text/event-stream");
    assert!(!held.headers.contains_key("last-event-id"));
    assert!(!held.headers.contains_key("content-type"));
    let writer = held.respond_sse(Some(SID));
    accepted(pending).await;
    // The server sends on its standalone stream before the client has opened its GET.
    let base = gw.tagged();
    writer.message(&note(1)).await;
    writer.message(&note(2)).await;
    gw.tagged_at_least(base + 2).await;
    assert_eq!(gauge(&gw), 1.0);
    let mut r = SseReader::new(send(gw.addr, get(SID, None)).await);
    assert!(
        mock.nothing_within(Duration::from_millis(100)).await,
        "the client's GET is served from the held stream, not forwarded"
    );
    let priming = r.next().await.unwrap();
    assert!(priming.id.is_some() && priming.data.as_deref() == Some(""));
    assert_eq!(messages(&[r.next().await.unwrap()]), vec![note(1)]);
    assert_eq!(messages(&[r.next().await.unwrap()]), vec![note(2)]);
    writer.message(&note(3)).await;
    assert_eq!(messages(&[r.next().await.unwrap()]), vec![note(3)]);
    // A reconnect with the last id resumes exactly; one without gets what it was not sent.
    drop(r);
    let base = gw.tagged();
    writer.message(&note(4)).await;
    gw.tagged_at_least(base + 1).await;
    let mut again = SseReader::new(send(gw.addr, get(SID, None)).await);
    let _priming = again.next().await.unwrap();
    assert_eq!(messages(&[again.next().await.unwrap()]), vec![note(4)]);
}

#[tokio::test]
async fn an_upstream_without_standalone_stream_keeps_its_405() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let (held, pending) = initialized(&gw, &mut mock).await;
    let refuse = |seen: Seen| {
        assert_eq!(seen.method, Method::GET);
        seen.respond(
            Response::builder()
                .status(405)
                .header("allow", "POST, DELETE")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
    };
    refuse(held.expect("the gateway's GET"));
    accepted(pending).await;
    // The client's own GET is forwarded (once: no retries against a 405) and gets the 405.
    let pending = tokio::spawn(send(gw.addr, get(SID, None)));
    refuse(mock.next().await);
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 405);
    assert_eq!(resp.headers()["allow"], "POST, DELETE");
    assert!(mock.nothing_within(Duration::from_millis(300)).await);
    assert_eq!(gauge(&gw), 0.0);
}

#[tokio::test]
async fn the_flag_turns_holding_off() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.hold_standalone = false).await;
    init_session(&gw, &mut mock, SID).await;
    let (held, pending) = initialized(&gw, &mut mock).await;
    assert!(held.is_none(), "no GET of the gateway's own");
    accepted(pending).await;
}

/// Paused clock: the retries come exactly 250, 500 and 1000 ms apart, then stop.
#[tokio::test(start_paused = true)]
async fn a_conflicting_upstream_is_retried_a_bounded_number_of_times() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let (held, pending) = initialized(&gw, &mut mock).await;
    let conflict = || {
        Response::builder()
            .status(409)
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let first = held.expect("the gateway's GET");
    assert_eq!(first.method, Method::GET);
    first.respond(conflict());
    // The client's 202 waited for the first attempt only.
    accepted(pending).await;
    let mut last = tokio::time::Instant::now();
    for backoff in [250, 500, 1000] {
        let seen = mock.next().await;
        assert_eq!(seen.method, Method::GET);
        let waited = last.elapsed();
        assert!(
            waited >= Duration::from_millis(backoff)
                && waited <= Duration::from_millis(backoff + 5),
            "backoff {backoff} ms between attempts: waited {waited:?}"
        );
        last = tokio::time::Instant::now();
        seen.respond(conflict());
    }
    assert!(
        mock.nothing_within(Duration::from_secs(120)).await,
        "then it stops"
    );
}

/// Paused clock: a standalone stream that carried something is held again exactly 1 s after
/// it ended.
#[tokio::test(start_paused = true)]
async fn a_held_stream_the_upstream_ends_is_held_again() {
    let paused = held_again_after().await;
    assert!(
        paused >= Duration::from_secs(1) && paused <= Duration::from_millis(1005),
        "held again after {paused:?}"
    );
}

/// The real-time smoke of the re-hold timer: the one wall-clock run of it (wide bounds: real
/// scheduling).
#[tokio::test]
async fn a_held_stream_is_held_again_in_real_time() {
    let paused = held_again_after().await;
    assert!(
        paused >= Duration::from_millis(800) && paused < Duration::from_secs(5),
        "held again after {paused:?}"
    );
}

/// The upstream ends the held standalone stream after one message; the gateway holds a new
/// one, and a client arriving then gets what the new stream carried. Returns how long
/// (tokio's clock) the gateway paused before holding again.
async fn held_again_after() -> Duration {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw, &mut mock, SID).await;
    let (held, pending) = initialized(&gw, &mut mock).await;
    let first = held.expect("the gateway's GET").respond_sse(Some(SID));
    accepted(pending).await;
    let base = gw.tagged();
    first.message(&note(1)).await;
    gw.tagged_at_least(base + 1).await;
    drop(first); // the server closes its standalone stream
    let started = tokio::time::Instant::now();
    let again = mock.next().await;
    let paused = started.elapsed();
    assert_eq!(again.method, Method::GET);
    let second = again.respond_sse(Some(SID));
    let base = gw.tagged();
    second.message(&note(2)).await;
    gw.tagged_at_least(base + 1).await;
    // A client arriving now gets what the new stream carried; what the ended one carried
    // before any client came is gone with it, and the first event says so.
    let mut r = SseReader::new(send(gw.addr, get(SID, None)).await);
    let first = r.next().await.unwrap();
    assert_eq!(
        first.event.as_deref(),
        Some("mcp-reattach/resumption-failed")
    );
    assert!(first.id.is_some());
    assert!(first
        .data
        .unwrap()
        .contains("\"reason\":\"standalone-ended-unread\""));
    assert_eq!(messages(&[r.next().await.unwrap()]), vec![note(2)]);
    paused
}
