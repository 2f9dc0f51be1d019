//! Re-attachment done right (issue 9), against the scriptable mock upstream on real sockets:
//!
//! - flow control: a client reading at a tenth of the upstream's rate for ~20 s gets every
//!   event and the result, the upstream is paused instead, nothing undelivered is evicted;
//! - a fast upstream and a cut: reconnecting after 200 ms is exactly once; reconnecting after
//!   `--stall-timeout` is the explicit gap;
//! - the seed's POST retransmission is answered as a resume and never reaches the upstream;
//!   `Last-Event-ID` never reaches the upstream;
//! - a standalone stream the upstream closed: the client's reconnect re-attaches to the
//!   session (a new upstream GET, without `Last-Event-ID`), later notifications arrive;
//! - an `initialize` asking for a modern version is still tagged.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::time::Duration;

use http::Request;
use http_body_util::Full;
use mcp_reattach::Priming;
use support::*;
use tokio::time::Instant;

const SID: &str = "sess-fc";

fn padded_progress(i: u64, pad: usize) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","method":"notifications/progress","params":{{"progressToken":1,"progress":{i},"message":"{}"}}}}"#,
        "x".repeat(pad)
    )
}

fn progress_of(data: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(data).ok()?;
    v["params"]["progress"].as_u64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_at_a_tenth_of_the_upstream_rate_gets_everything() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    init_session(&gw, &mut mock, SID).await;
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 1).await;
    // The client reads ~1 MB/s for ~20 s; the upstream offers everything at once (it alone
    // writes ~20 MB in well under 2 s when nothing holds it back).
    const N: u64 = 10_000;
    const PAD: usize = 2000;
    const CLIENT_BYTES_PER_SEC: f64 = 1_000_000.0;
    let upstream = tokio::spawn(async move {
        let start = Instant::now();
        for i in 1..=N {
            writer.message(&padded_progress(i, PAD)).await;
        }
        writer.message(&result(1)).await;
        start.elapsed()
    });
    let start = Instant::now();
    let mut seen = Vec::new();
    let mut got_result = false;
    let mut bytes = 0usize;
    while let Some(e) = reader.next().await {
        let Some(data) = e.data.as_deref() else {
            continue;
        };
        bytes += data.len() + 40;
        if let Some(p) = progress_of(data) {
            seen.push(p);
        } else if data.contains("\"result\"") {
            got_result = true;
            break;
        }
        // Pace the reader: never ahead of CLIENT_BYTES_PER_SEC.
        let due = Duration::from_secs_f64(bytes as f64 / CLIENT_BYTES_PER_SEC);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
    let took = start.elapsed();
    let upstream_took = upstream.await.unwrap();
    let pauses = gw
        .metric("mcp_reattach_upstream_pauses_total")
        .expect("metric exported");
    let paused = gw
        .metric("mcp_reattach_upstream_paused_seconds_total")
        .expect("metric exported");
    let undelivered = gw
        .metric("mcp_reattach_events_evicted_undelivered_total")
        .expect("metric exported");
    eprintln!(
        "slow client: {} of {N} progress events, result={got_result}, client {took:?}, upstream held back for {upstream_took:?}, pauses={pauses}, paused={paused:.1}s, evicted undelivered={undelivered}",
        seen.len()
    );
    assert_eq!(
        seen,
        (1..=N).collect::<Vec<_>>(),
        "every event, once, in order"
    );
    assert!(got_result, "the result arrives");
    assert!(pauses > 0.0, "the upstream was paused");
    assert_eq!(undelivered, 0.0);
    assert!(paused >= 1.0, "paused for a real share of the run");
}

/// A fast upstream, a client reading as fast as it can through a relay that cuts the
/// connection mid-stream (losing whatever was in flight on the path); the client reconnects
/// after `wait`. What it gets depends only on whether it came back within the stall budget
/// (`stall`), which runs from the gateway's last hand-over to the client, not from the
/// client's end of the stream: before the cut the client may still be draining megabytes the
/// path holds, for seconds on a loaded machine (CI saw a 2 s budget pass that way with a
/// 200 ms `wait`).
async fn cut_and_reconnect_after(wait: Duration, stall: Duration) -> (Vec<u64>, Vec<Event>) {
    /// The client asks the relay for the cut once it has read this many progress events.
    const CUT_AFTER: usize = 300;
    let mut mock = Mock::start().await;
    // The window's in-flight reserve (¾ of it) must cover what the path holds in flight (the
    // gateway's send buffer, the relay's two sockets, the client's receive buffer;
    // docs/design.md, "in-flight reserve"). On loopback, autotuned buffers grow to megabytes
    // (a receive buffer to 32 MiB here): a loaded CI once saw more than the 3 MiB reserve of
    // this 4 MiB window in flight at the cut, and the resume found a gap. The relay's and the
    // client's buffers are small and fixed instead, so the path holds ~0.3 MiB.
    let gw = gateway(mock.addr, |c| {
        c.priming = Priming::Always;
        c.stall_timeout = stall;
        c.window_events = 100_000;
        c.window_bytes = 4 << 20;
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    let relay = std::sync::Arc::new(support::Relay::start_with(
        gw.addr,
        RelayOptions {
            small_buffers: true,
            ..RelayOptions::default()
        },
    ));
    let pending = tokio::spawn(send_small_window(relay.addr(), post(&call(7), Some(SID))));
    let writer = mock.next().await.respond_sse(Some(SID));
    let mut reader = SseReader::new(pending.await.unwrap());
    let mut cursor = reader.next().await.unwrap().id.unwrap();
    const N: u64 = 20_000;
    let upstream = tokio::spawn(async move {
        for i in 1..=N {
            writer.message(&padded_progress(i, 400)).await;
        }
        writer.message(&result(7)).await;
    });
    let mut got = Vec::new();
    loop {
        let Some(e) = reader.next().await else {
            break;
        };
        cursor = e.id.clone().unwrap();
        got.extend(e.data.as_deref().and_then(progress_of));
        if got.len() == CUT_AFTER {
            // The relay's cut waits for its sockets to close: off this runtime's thread.
            let r = relay.clone();
            tokio::task::spawn_blocking(move || r.cut_all());
        }
    }
    let read_before_cut = got.len();
    tokio::time::sleep(wait).await;
    let mut r = SseReader::new(send(gw.addr, get(SID, Some(&cursor))).await);
    let events = r.rest().await;
    for e in &events {
        got.extend(e.data.as_deref().and_then(progress_of));
    }
    upstream.abort();
    eprintln!(
        "cut asked after {CUT_AFTER} events, {read_before_cut} read before it took effect, reconnect after {wait:?}: first event {:?}, {} progress events in all",
        events[0].event,
        got.len()
    );
    eprintln!(
        "  detached={} stalled={} pauses={} evicted_undelivered={}",
        gw.metric("mcp_reattach_streams_detached_total")
            .expect("metric exported"),
        gw.metric("mcp_reattach_slow_consumer_detaches_total")
            .expect("metric exported"),
        gw.metric("mcp_reattach_upstream_pauses_total")
            .expect("metric exported"),
        gw.metric("mcp_reattach_events_evicted_undelivered_total")
            .expect("metric exported"),
    );
    eprintln!("  first event data: {:?}", events[0].data);
    (got, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_with_a_fast_upstream_is_exactly_once_within_the_stall_budget() {
    // Back after 200 ms, well within a budget no machine stall reaches.
    let (got, events) =
        cut_and_reconnect_after(Duration::from_millis(200), Duration::from_secs(20)).await;
    assert_eq!(events[0].event.as_deref(), Some("mcp-reattach/resumed"));
    assert_eq!(
        got,
        (1..=20_000).collect::<Vec<_>>(),
        "exactly once, in order"
    );
    assert!(
        messages(&events).last().unwrap().contains("\"id\":7"),
        "the result"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_longer_than_the_stall_budget_is_an_explicit_gap() {
    // Back after 4 s, twice the budget.
    let (got, events) =
        cut_and_reconnect_after(Duration::from_millis(4000), Duration::from_secs(2)).await;
    assert_eq!(
        events[0].event.as_deref(),
        Some("mcp-reattach/resumption-failed")
    );
    let errs = messages(&events);
    let err: serde_json::Value = serde_json::from_str(errs.last().unwrap()).unwrap();
    assert_eq!(err["id"], 7);
    assert_eq!(err["error"]["code"], -32010);
    let unique: std::collections::BTreeSet<u64> = got.iter().copied().collect();
    assert_eq!(unique.len(), got.len(), "nothing twice");
    assert!(
        !events
            .iter()
            .any(|e| e.data.as_deref().and_then(progress_of).is_some()),
        "no silent partial replay"
    );
}

fn retransmit(id: u64, cursor: Option<&str>) -> Request<Full<bytes::Bytes>> {
    let mut req = post(&call(id), Some(SID));
    if let Some(c) = cursor {
        req.headers_mut()
            .insert("last-event-id", c.parse().unwrap());
    }
    req
}

/// The client's connection drops after the upstream got the POST but before its response
/// head: the upstream's exchange goes on (not cancelled: the upstream never sees its
/// connection close), its stream is read into the window, and the client's retransmission
/// gets every event of it without the tool running again.
#[tokio::test]
async fn a_client_gone_before_the_response_head_cancels_nothing_and_its_retransmission_gets_it_all()
{
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw, &mut mock, SID).await;
    let client = tokio::spawn(send(gw.addr, post(&call(7), Some(SID))));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["id"], 7);
    // The client goes away while the upstream is still working on the head.
    client.abort();
    let _ = client.await;
    eventually_connections(&gw, 0).await;
    let base = gw.tagged();
    let writer = seen.respond_sse(Some(SID));
    writer.message(&progress(1)).await;
    writer.message(&result(7)).await;
    gw.tagged_at_least(base + 2).await;
    assert!(
        !writer.closed_within(Duration::from_millis(100)).await,
        "the upstream's stream stays open: a client gone is never a cancel"
    );
    drop(writer);
    let mut r = SseReader::new(send(gw.addr, retransmit(7, None)).await);
    let events = r.rest().await;
    assert_eq!(events[0].event.as_deref(), Some("mcp-reattach/resumed"));
    assert_eq!(messages(&events), vec![progress(1), result(7)]);
    assert!(
        mock.nothing_within(Duration::from_millis(200)).await,
        "the retransmission was not forwarded: the tool runs once"
    );
}

/// The client retries its POST while the first one is still waiting for the upstream's
/// response head: the retry waits for it and is answered from its stream, never forwarded
/// (forwarded, the tool would run twice), whether the first client is gone by then or not.
#[tokio::test]
async fn a_retransmission_before_the_response_head_waits_for_it_and_is_not_forwarded() {
    for first_client_leaves in [true, false] {
        let mut mock = Mock::start().await;
        let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
        init_session(&gw, &mut mock, SID).await;
        let first = tokio::spawn(send(gw.addr, post(&call(8), Some(SID))));
        let seen = mock.next().await;
        assert_eq!(seen.json_body()["id"], 8);
        if first_client_leaves {
            first.abort();
        }
        let retry = tokio::spawn(send(gw.addr, retransmit(8, None)));
        assert!(
            mock.nothing_within(Duration::from_millis(300)).await,
            "the retransmission waits for the first exchange: the tool runs once \
             (first client gone: {first_client_leaves})"
        );
        let writer = seen.respond_sse(Some(SID));
        writer.message(&progress(1)).await;
        writer.message(&result(8)).await;
        drop(writer);
        let mut r = SseReader::new(retry.await.unwrap());
        let events = r.rest().await;
        assert_eq!(events[0].event.as_deref(), Some("mcp-reattach/resumed"));
        assert_eq!(messages(&events), vec![progress(1), result(8)]);
        if !first_client_leaves {
            // One client per stream: the retry took the stream over from the first response
            // (a client retries because it gave that one up), which ends without the events.
            let got = SseReader::new(first.await.unwrap()).rest().await;
            assert_eq!(messages(&got), Vec::<String>::new());
        }
        assert!(mock.nothing_within(Duration::from_millis(100)).await);
    }
}

/// Waits until the gateway holds at most `n` client connections (its connection gauge).
async fn eventually_connections(gw: &Gw, n: u64) {
    let gauge = || {
        gw.metric("mcp_reattach_connections")
            .expect("gauge exported") as u64
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    while gauge() > n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gateway still holds {} client connections",
            gauge()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_retransmitted_post_is_a_resume_and_never_reaches_the_upstream() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw, &mut mock, SID).await;
    // The seed's reproduction: the client saw an event, the connection dropped, the tool
    // finished meanwhile.
    let (mut reader, writer) = start_call(&gw, &mut mock, SID, 5).await;
    writer.message(&progress(1)).await;
    let _priming = reader.next().await.unwrap();
    let first = reader.next().await.unwrap();
    drop(reader);
    let base = gw.tagged();
    writer.message(&progress(2)).await;
    writer.message(&result(5)).await;
    drop(writer);
    gw.tagged_at_least(base + 2).await;
    let cursor = first.id.clone().unwrap();
    let mut r = SseReader::new(send(gw.addr, retransmit(5, Some(&cursor))).await);
    let events = r.rest().await;
    assert_eq!(events[0].event.as_deref(), Some("mcp-reattach/resumed"));
    assert_eq!(events[0].id.as_deref(), Some(cursor.as_str()));
    assert_eq!(messages(&events), vec![progress(2), result(5)]);
    assert!(
        mock.nothing_within(Duration::from_millis(200)).await,
        "the retransmission was not forwarded: the tool runs once"
    );
    // Without a cursor: the whole stream again, still not forwarded.
    let mut r = SseReader::new(send(gw.addr, retransmit(5, None)).await);
    let events = r.rest().await;
    assert_eq!(events[0].event.as_deref(), Some("mcp-reattach/resumed"));
    assert_eq!(messages(&events), vec![progress(1), progress(2), result(5)]);
    assert!(mock.nothing_within(Duration::from_millis(200)).await);
    // A new id with a (stale) Last-Event-ID is forwarded, without that header.
    let pending = tokio::spawn(send(gw.addr, retransmit(6, Some(&cursor))));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["id"], 6);
    assert!(
        !seen.headers.contains_key("last-event-id"),
        "the gateway's cursor never reaches the upstream"
    );
    seen.respond_sse(Some(SID)).message(&result(6)).await;
    assert_eq!(pending.await.unwrap().status(), 200);
}

#[tokio::test]
async fn a_retransmission_whose_stream_lost_events_gets_an_explicit_error() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.priming = Priming::Always;
        c.window_events = 2;
        c.stall_timeout = Duration::from_millis(100);
    })
    .await;
    init_session(&gw, &mut mock, SID).await;
    let (reader, writer) = start_call(&gw, &mut mock, SID, 3).await;
    drop(reader);
    // Away for longer than the stall budget.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let base = gw.tagged();
    for i in 1..=5 {
        writer.message(&progress(i)).await;
    }
    writer.message(&result(3)).await;
    drop(writer);
    gw.tagged_at_least(base + 6).await;
    // The stream lost events: the call ends at once with the explicit gap error.
    let mut r = SseReader::new(send(gw.addr, retransmit(3, None)).await);
    let events = r.rest().await;
    assert_eq!(
        events[0].event.as_deref(),
        Some("mcp-reattach/resumption-failed")
    );
    let err: serde_json::Value = serde_json::from_str(&messages(&events)[0]).unwrap();
    assert_eq!(err["id"], 3);
    assert_eq!(err["error"]["code"], -32010);
    // Asked again after that: a 409 naming the duplicate id, still never forwarded.
    let resp = send(gw.addr, retransmit(3, None)).await;
    assert_eq!(resp.status(), 409);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["id"], 3);
    assert_eq!(v["error"]["data"]["reason"], "duplicate-request");
    assert!(mock.nothing_within(Duration::from_millis(200)).await);
}

#[tokio::test]
async fn a_standalone_stream_closed_upstream_reattaches_to_the_session() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    init_session(&gw, &mut mock, SID).await;
    let pending = tokio::spawn(send(gw.addr, get(SID, None)));
    let seen = mock.next().await;
    let writer = seen.respond_sse(Some(SID));
    let mut reader = SseReader::new(pending.await.unwrap());
    let _priming = reader.next().await.unwrap();
    writer
        .message(r#"{"jsonrpc":"2.0","method":"notifications/message","params":{"n":1}}"#)
        .await;
    let n1 = reader.next().await.unwrap();
    // The server closes its standalone stream (no ids of its own: nothing to resume upstream).
    drop(writer);
    assert!(reader.rest().await.is_empty(), "the client's stream ends");
    // The client reconnects with its last id: a new upstream GET, without Last-Event-ID.
    let pending = tokio::spawn(send(gw.addr, get(SID, n1.id.as_deref())));
    let seen = mock.next().await;
    assert_eq!(seen.method, http::Method::GET);
    assert!(!seen.headers.contains_key("last-event-id"));
    let writer = seen.respond_sse(Some(SID));
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut r = SseReader::new(resp);
    let first = r.next().await.unwrap();
    assert_eq!(first.event.as_deref(), Some("mcp-reattach/resumed"));
    assert!(first.id.is_some(), "an id-bearing first event");
    let info: serde_json::Value = serde_json::from_str(first.data.as_deref().unwrap()).unwrap();
    assert_eq!(info["previous"], n1.id.clone().unwrap());
    assert_eq!(info["lost"], false);
    writer
        .message(r#"{"jsonrpc":"2.0","method":"notifications/message","params":{"n":2}}"#)
        .await;
    let n2 = r.next().await.unwrap();
    assert!(n2.data.unwrap().contains("\"n\":2"));
    // And the new stream resumes like any other.
    let before = n2.id.unwrap();
    drop(r);
    writer
        .message(r#"{"jsonrpc":"2.0","method":"notifications/message","params":{"n":3}}"#)
        .await;
    let mut again = SseReader::new(send(gw.addr, get(SID, Some(&before))).await);
    assert_eq!(
        again.next().await.unwrap().event.as_deref(),
        Some("mcp-reattach/resumed")
    );
    assert!(again
        .next()
        .await
        .unwrap()
        .data
        .unwrap()
        .contains("\"n\":3"));
}

#[tokio::test]
async fn initialize_asking_for_a_modern_version_is_still_tagged() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| c.priming = Priming::Always).await;
    let pending = tokio::spawn(send(
        gw.addr,
        post(
            r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2026-07-28","capabilities":{},"clientInfo":{"name":"t","version":"0"}}}"#,
            None,
        ),
    ));
    let seen = mock.next().await;
    let writer = seen.respond_sse(Some(SID));
    writer
        .message(r#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-11-25","capabilities":{},"serverInfo":{"name":"m","version":"0"}}}"#)
        .await;
    drop(writer);
    let mut r = SseReader::new(pending.await.unwrap());
    let events = r.rest().await;
    assert!(events.iter().all(|e| e.id.is_some()), "tagged: {events:?}");
    assert_eq!(gw.gateway.registry().len(), 1);
}
