//! The gateway's own timers with paused time (no sockets, no wall clock): keep-alive comments
//! on an idle attached stream. TTL and stall detection have their paused-time tests next to
//! the session (`src/session/tests.rs`), the drain next to `src/shutdown.rs`; each keeps one
//! end-to-end smoke test over real sockets (tests/fast/gateway.rs).

use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use mcp_reattach::internals::AttachBody;
use mcp_reattach::internals::{Event, KEEPALIVE};
use mcp_reattach::internals::{OpenStream, Owner, Principal, Registry, StreamKind};
use mcp_reattach::Config;
use tokio::time::Instant;

fn message(data: &str) -> Event {
    Event::message_of(data)
}

/// The next data frame of `body`.
async fn next(body: &mut AttachBody) -> bytes::Bytes {
    body.frame().await.unwrap().unwrap().into_data().unwrap()
}

#[tokio::test(start_paused = true)]
async fn keepalives_come_after_each_idle_interval_and_data_restarts_the_clock() {
    let cfg = Config::new("http://127.0.0.1:1".parse().unwrap());
    let registry = Registry::new(Arc::new(cfg), Arc::default());
    let session = registry
        .get_or_create("s", Owner::new(Principal::default(), "/mcp"))
        .unwrap();
    let attachment = session.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let stream = attachment.stream;
    let mut body = AttachBody::new(session.clone(), attachment, Some(Duration::from_secs(15)));
    let t0 = Instant::now();

    // Idle: a keep-alive after exactly one interval, then after each further interval.
    assert_eq!(&next(&mut body).await[..], KEEPALIVE);
    assert_eq!(t0.elapsed(), Duration::from_secs(15));
    assert_eq!(&next(&mut body).await[..], KEEPALIVE);
    assert_eq!(t0.elapsed(), Duration::from_secs(30));

    // Data at 40 s restarts the clock: the next keep-alive is at 55 s, not 45 s.
    let s2 = session.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(10)).await;
        s2.push_events(stream, &mut [message("{\"n\":1}")].into(), None);
    });
    let data = next(&mut body).await;
    assert!(String::from_utf8_lossy(&data).contains("{\"n\":1}"));
    assert_eq!(t0.elapsed(), Duration::from_secs(40));
    assert_eq!(&next(&mut body).await[..], KEEPALIVE);
    assert_eq!(t0.elapsed(), Duration::from_secs(55));
}

#[tokio::test(start_paused = true)]
async fn no_keepalives_when_disabled() {
    let cfg = Config::new("http://127.0.0.1:1".parse().unwrap());
    let registry = Registry::new(Arc::new(cfg), Arc::default());
    let session = registry
        .get_or_create("s", Owner::new(Principal::default(), "/mcp"))
        .unwrap();
    let attachment = session.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let mut body = AttachBody::new(session, attachment, None);
    assert!(
        tokio::time::timeout(Duration::from_secs(3600), body.frame())
            .await
            .is_err(),
        "nothing in an hour of idle"
    );
}
