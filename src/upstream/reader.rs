//! The reader of a tagged upstream stream: it decodes events, hands them to the session,
//! pauses (stops polling the body, so TCP pushes back on the server) while the session's
//! window has no room, and resumes the upstream stream itself when a polling server closes it
//! early.
//!
//! Knows the upstream body and the session API; the rules of what may be evicted live in
//! `session`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::{hold, Source};
use crate::metrics::UpstreamErrorKind;
use crate::session::{hash_id, End, Registry, Session, UpstreamFailure};
use crate::sse::Decoder;

/// Most upstream bytes the reader takes in one go before tagging them. While the window has
/// no room these wait in the reader, so this also bounds what a paused upstream costs
/// beyond its connection.
const READ_BATCH_BYTES: usize = 64 * 1024;

/// Consecutive failed reconnects to an upstream stream before the gateway gives up on it.
const UPSTREAM_RESUME_ATTEMPTS: u32 = 3;
/// The longest `retry:` wait the gateway honours before reconnecting upstream.
const MAX_UPSTREAM_RETRY: Duration = Duration::from_secs(30);

/// Reads the stream a client's request opened (`stream` of `session`) in a task of its own,
/// which the session stops when it closes. When a client's own standalone stream ends, the
/// session's holder takes over (after its rest).
pub(crate) fn spawn_reader(
    registry: Arc<Registry>,
    session: Arc<Session>,
    stream: u32,
    body: Incoming,
    source: Source,
) {
    let s = session.clone();
    let reader = tokio::spawn(async move {
        read_stream(&registry, &session, stream, body, &source).await;
        if source.upstream.cfg.hold_standalone {
            hold::after_client_stream(&registry, &session, stream, source);
        }
    });
    s.set_reader(stream, reader.abort_handle());
}

/// The next frame of `body` if it is ready now, without waiting.
async fn ready_frame(
    body: &mut Incoming,
) -> Option<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(
            match http_body::Body::poll_frame(std::pin::Pin::new(&mut *body), cx) {
                std::task::Poll::Ready(f) => Some(f),
                std::task::Poll::Pending => None,
            },
        )
    })
    .await
}

/// The event types the gateway writes itself (`mcp-reattach/...`) are its own: an upstream
/// event of such a type reaches the client as `upstream/mcp-reattach/...`, so a client can
/// always tell the gateway's control events from the server's.
fn disown_control_type(e: &mut crate::sse::Event) {
    if let Some(t) = e.event.as_mut().filter(|t| t.starts_with(CONTROL_PREFIX)) {
        t.insert_str(0, "upstream/");
    }
}

/// The prefix of the gateway's own event types.
const CONTROL_PREFIX: &str = "mcp-reattach/";

/// Hands `events` to the session, waiting while its window has no room (flow control: the
/// body is not polled meanwhile, so the upstream's TCP window closes). Counts pauses.
async fn deliver(
    registry: &Registry,
    session: &Session,
    stream: u32,
    events: &mut Vec<crate::sse::Event>,
) {
    let mut paused: Option<Instant> = None;
    std::future::poll_fn(|cx| {
        if session.push_events(stream, events, Some(cx.waker())) {
            std::task::Poll::Ready(())
        } else {
            if paused.is_none() {
                registry.metrics().upstream_pauses.inc();
                paused = Some(Instant::now());
            }
            std::task::Poll::Pending
        }
    })
    .await;
    if let Some(since) = paused {
        registry
            .metrics()
            .upstream_paused_seconds
            .inc_by(since.elapsed().as_secs_f64());
        tracing::trace!(mcp.session = %hash_id(session.id()), mcp.stream = stream, paused = ?since.elapsed(), "upstream resumed after a pause");
    }
    if registry.over_budget() {
        registry.enforce_budget(session);
    }
}

/// Reads a tagged upstream stream to its end, whether or not a client is attached.
///
/// An upstream that sets its own ids may close a stream before it is done (2025-11-25 "SSE
/// polling"); the gateway then resumes it upstream with `Last-Event-ID` (honouring `retry:`),
/// the way a client would, and keeps appending to the same stream: while a POST stream still
/// has unanswered requests, and for the standalone stream while the session lives.
pub(crate) async fn read_stream(
    registry: &Registry,
    session: &Session,
    stream: u32,
    mut body: Incoming,
    source: &Source,
) {
    let metrics = registry.metrics().clone();
    let max_event_bytes = source.upstream.cfg.max_event_bytes;
    let mut last_upstream_id: Option<String> = None;
    let mut retry: Option<u64> = None;
    let mut failures = 0;
    let end = 'outer: loop {
        let mut decoder = Decoder::new(max_event_bytes);
        let mut events = Vec::new();
        let end = loop {
            // Take every frame that is already here before tagging: one lock, one wake of
            // the client and one write for a burst, instead of one per upstream chunk.
            let mut next = body.frame().await;
            let mut taken = 0;
            let mut ended = None;
            loop {
                match next {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            taken += data.len();
                            if let Err(e) = decoder.feed(&data, &mut events) {
                                metrics.upstream_error(UpstreamErrorKind::InvalidEvent);
                                ended = Some(End::Failed(UpstreamFailure::InvalidStream(
                                    e.to_string(),
                                )));
                                break;
                            }
                        }
                    }
                    Some(Err(e)) => {
                        metrics.upstream_error(UpstreamErrorKind::Stream);
                        ended = Some(End::Failed(UpstreamFailure::Connection(e.to_string())));
                        break;
                    }
                    None => {
                        ended = Some(End::Complete);
                        break;
                    }
                }
                if taken >= READ_BATCH_BYTES {
                    break;
                }
                next = match ready_frame(&mut body).await {
                    Some(f) => f,
                    // hyper hands the body over one HTTP chunk at a time (a one-slot channel
                    // from its connection task), so a burst already read from the socket is
                    // not "ready" yet: let the connection task run once and look again.
                    None => {
                        tokio::task::yield_now().await;
                        match ready_frame(&mut body).await {
                            Some(f) => f,
                            None => break,
                        }
                    }
                };
            }
            for e in &mut events {
                disown_control_type(e);
                if e.id.is_some() {
                    last_upstream_id.clone_from(&e.id);
                }
                retry = e.retry.or(retry);
            }
            if !events.is_empty() {
                failures = 0;
            }
            deliver(registry, session, stream, &mut events).await;
            if let Some(end) = ended {
                break end;
            }
        };
        let Some(last_id) = last_upstream_id
            .clone()
            .filter(|_| session.wants_more(stream))
        else {
            break end;
        };
        if matches!(end, End::Failed(UpstreamFailure::InvalidStream(_))) {
            break end; // a protocol error will not heal by reconnecting
        }
        // Reconnect upstream, as a client of a polling server would.
        loop {
            if failures >= UPSTREAM_RESUME_ATTEMPTS {
                break 'outer End::Failed(UpstreamFailure::ResumeRefused(UPSTREAM_RESUME_ATTEMPTS));
            }
            failures += 1;
            let wait = Duration::from_millis(retry.unwrap_or(1000)).min(MAX_UPSTREAM_RETRY);
            tokio::time::sleep(wait).await;
            tracing::debug!(mcp.session = %hash_id(session.id()), mcp.stream = stream, "resuming the upstream stream");
            match source.resume(&last_id).await {
                Some(b) => {
                    body = b;
                    continue 'outer;
                }
                None => metrics.upstream_error(UpstreamErrorKind::Resume),
            }
        }
    };
    if let End::Failed(cause) = &end {
        tracing::warn!(mcp.session = %hash_id(session.id()), mcp.stream = stream, cause = ?cause, "upstream stream failed");
    }
    session.end_stream(stream, end);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jsonrpc::{
        EVENT_RESUMED, EVENT_RESUMPTION_FAILED, EVENT_RESUMPTION_REQUIRED, EVENT_UPSTREAM_FAILED,
    };

    #[test]
    fn every_gateway_event_type_is_disowned_when_the_upstream_sends_it() {
        for t in [
            EVENT_RESUMED,
            EVENT_RESUMPTION_FAILED,
            EVENT_RESUMPTION_REQUIRED,
            EVENT_UPSTREAM_FAILED,
        ] {
            let mut e = crate::sse::Event {
                event: Some(t.to_owned()),
                ..Default::default()
            };
            disown_control_type(&mut e);
            assert_eq!(e.event.as_deref(), Some(format!("upstream/{t}").as_str()));
        }
        let mut e = crate::sse::Event {
            event: Some("message".to_owned()),
            ..Default::default()
        };
        disown_control_type(&mut e);
        assert_eq!(e.event.as_deref(), Some("message"));
    }
}
