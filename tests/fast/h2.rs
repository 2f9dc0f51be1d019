//! HTTP/2 (h2c) clients: several sessions' streams share one connection, and what happens to
//! one stream (a stall) stays with that stream.

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use mcp_reattach::Priming;
use support::*;
use tokio::net::TcpStream;

/// One h2c connection to the gateway whose per-stream receive window is small, so a stream
/// the test does not read stalls after a few events while the others keep flowing.
async fn h2_connection(gw: &Gw) -> SendRequest<Full<Bytes>> {
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(16 * 1024)
        .initial_connection_window_size(64 << 20)
        .handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

fn h2_post(gw: &Gw, body: &str, session: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{}/mcp", gw.addr))
        .version(http::Version::HTTP_2)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-session-id", session)
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap()
}

/// Starts tool call `id` of session `sid` as a stream of the shared h2 connection.
async fn h2_call(
    gw: &Gw,
    mock: &mut Mock,
    sender: &mut SendRequest<Full<Bytes>>,
    sid: &str,
    id: u64,
) -> (SseReader, SseWriter) {
    let pending = tokio::spawn(sender.send_request(h2_post(gw, &call(id), sid)));
    let seen = mock.next().await;
    assert_eq!(seen.headers["mcp-session-id"], sid);
    let writer = seen.respond_sse(Some(sid));
    let resp: Response<Incoming> = tokio::time::timeout(WAIT, pending)
        .await
        .expect("response in time")
        .unwrap()
        .expect("response");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    (SseReader::new(resp), writer)
}

fn note(i: usize) -> String {
    let pad = "p".repeat(4096);
    format!(
        r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"i":{i},"pad":"{pad}"}}}}"#
    )
}

/// Issue 11 bug 1: two sessions' streams on one HTTP/2 connection; one client stream stops
/// being read and stalls past the stall budget. The gateway ends that stream only: the
/// other session's stream on the same connection keeps receiving.
#[tokio::test]
async fn a_stalled_h2_stream_ends_alone_and_its_neighbours_keep_flowing() {
    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |c| {
        c.stall_timeout = Duration::from_millis(200);
        c.window_events = 100_000;
        c.window_bytes = 64 << 20;
        c.priming = Priming::Always;
    })
    .await;
    init_session(&gw, &mut mock, "a").await;
    init_session(&gw, &mut mock, "b").await;
    let mut sender = h2_connection(&gw).await;
    let (mut stalled, stalled_writer) = h2_call(&gw, &mut mock, &mut sender, "a", 1).await;
    let (mut healthy, healthy_writer) = h2_call(&gw, &mut mock, &mut sender, "b", 2).await;
    let a = gw.gateway.registry().get("a").unwrap();

    // Far more than the stalled stream's 16 KiB receive window: the gateway cannot write it.
    for i in 0..64 {
        stalled_writer.message(&note(i)).await;
    }
    // The stalled stream is detached, and since its body cannot even be polled (no h2
    // send capacity), its task is ended: the session sees the client gone.
    let deadline = tokio::time::Instant::now() + WAIT;
    while a.attached_clients() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stalled stream was ended in time"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    assert!(
        gw.gateway
            .render_metrics()
            .contains("mcp_reattach_stalled_closes_total 1"),
        "the stalled stream was closed by the gateway"
    );
    // The other session's stream on the same connection still receives, event by event.
    for i in 0..20 {
        healthy_writer.message(&progress(i)).await;
        let got = loop {
            let e = healthy
                .next()
                .await
                .expect("the healthy stream on the shared connection is still open");
            if let Some(d) = e.data.filter(|d| !d.is_empty()) {
                break d;
            }
        };
        assert_eq!(got, progress(i));
    }
    healthy_writer.message(&result(2)).await;
    drop(healthy_writer);
    assert_eq!(messages(&healthy.rest().await), vec![result(2)]);

    // The stalled stream ends (reset) after what was in flight; a new stream on the same
    // connection still works.
    let _ = stalled.rest().await;
    let (mut again, writer) = h2_call(&gw, &mut mock, &mut sender, "b", 3).await;
    writer.message(&result(3)).await;
    drop(writer);
    assert_eq!(messages(&again.rest().await), vec![result(3)]);
}
