//! The reader of a tagged upstream stream: it decodes events, hands them to the session,
//! pauses (stops polling the body, so TCP pushes back on the server) while the session's
//! window has no room, and resumes the upstream stream itself when a polling server closes it
//! early. Also the whole read of an upgraded POST's JSON answer, counted in the budget.
//!
//! Futures only: the tasks that run them are spawned by the layer (`feed`), which also ends
//! the stream with what they return.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::metrics::{Metrics, UpstreamErrorKind};
use crate::session::{Charge, End, Registry, Session, UpstreamFailure};
use crate::sse::{Decoder, Event};
use crate::upstream::{OwnBody, ReadEnd, Source};

/// Most upstream bytes the reader takes in one go before tagging them. While the window has
/// no room these wait in the reader, so this also bounds what a paused upstream costs
/// beyond its connection.
const READ_BATCH_BYTES: usize = 64 * 1024;

/// Consecutive failed reconnects to an upstream stream before the gateway gives up on it.
const UPSTREAM_RESUME_ATTEMPTS: u32 = 3;
/// The longest `retry:` wait the gateway honours before reconnecting upstream.
const MAX_UPSTREAM_RETRY: Duration = Duration::from_secs(30);
/// The shortest: an upstream's `retry: 0` on a stream it keeps closing after one event would
/// otherwise be reconnected to in a tight loop (~600 a second, seen).
const MIN_UPSTREAM_RETRY: Duration = Duration::from_millis(100);

/// Why [`json`] has no body.
pub(super) enum JsonRead {
    /// Larger than `--max-event-bytes`.
    TooLarge,
    Failed(UpstreamFailure),
}

/// An upgraded POST's JSON answer, read whole (at most `limit` bytes) and counted in the
/// budget from its first byte: past a read batch, more only while the budget has room.
pub(super) async fn json(
    mut body: OwnBody,
    limit: usize,
    charge: &mut Charge,
) -> Result<Vec<u8>, JsonRead> {
    let mut json = Vec::new();
    loop {
        if json.len() >= READ_BATCH_BYTES {
            charge.set(json.capacity(), READ_BATCH_BYTES);
            charge.room_for(READ_BATCH_BYTES).await;
        }
        let read = body.read(READ_BATCH_BYTES, |data| {
            if json.len() + data.len() > limit {
                return Err(JsonRead::TooLarge);
            }
            json.extend_from_slice(data);
            Ok(())
        });
        let end = match read.await {
            Ok(end) => end,
            Err(e) => return Err(e),
        };
        charge.set(json.capacity(), READ_BATCH_BYTES);
        match end {
            ReadEnd::More => {}
            ReadEnd::Done => return Ok(json),
            ReadEnd::Connection(e) => {
                return Err(JsonRead::Failed(UpstreamFailure::Connection(e.to_string())))
            }
            ReadEnd::Framing(e) => {
                return Err(JsonRead::Failed(UpstreamFailure::InvalidStream(
                    e.to_string(),
                )))
            }
        }
    }
}

/// Waits for the body's next bytes, then takes everything that is already here (up to
/// [`READ_BATCH_BYTES`]) into `decoder`, its events into `events`: one lock, one wake of the
/// client and one write for a burst, instead of one per upstream chunk. The end of the stream
/// if it ended.
async fn read_batch(
    body: &mut OwnBody,
    decoder: &mut Decoder,
    events: &mut Vec<Event>,
    metrics: &Metrics,
) -> Option<End> {
    let read = body.read(READ_BATCH_BYTES, |data| decoder.feed(data, events));
    match read.await {
        Ok(ReadEnd::More) => None,
        Ok(ReadEnd::Done) => Some(End::Complete),
        Ok(ReadEnd::Connection(e)) => {
            metrics.upstream_error(UpstreamErrorKind::Stream);
            Some(End::Failed(UpstreamFailure::Connection(e.to_string())))
        }
        Ok(ReadEnd::Framing(e)) => {
            metrics.upstream_error(UpstreamErrorKind::Stream);
            Some(End::Failed(UpstreamFailure::InvalidStream(e.to_string())))
        }
        Err(e) => {
            metrics.upstream_error(UpstreamErrorKind::InvalidEvent);
            Some(End::Failed(UpstreamFailure::InvalidStream(e.to_string())))
        }
    }
}

/// The event types the gateway writes itself (`mcp-reattach/...`) are its own: an upstream
/// event of such a type reaches the client as `upstream/mcp-reattach/...`, so a client can
/// always tell the gateway's control events from the server's.
pub(super) fn disown_control_type(e: &mut crate::sse::Event) {
    if e.event().is_some_and(|t| t.starts_with(CONTROL_PREFIX)) {
        e.prefix_type("upstream/");
    }
}

/// The prefix of the gateway's own event types.
const CONTROL_PREFIX: &str = "mcp-reattach/";

/// Hands `events` to the session, waiting while its window has no room (flow control: the
/// body is not polled meanwhile, so the upstream's TCP window closes). Counts pauses. Events
/// waiting are counted in `charge`, on top of `base` (what the reader holds besides).
pub(super) async fn deliver(
    registry: &Registry,
    session: &Session,
    stream: u32,
    events: &mut VecDeque<Event>,
    charge: &mut Charge,
    base: usize,
) {
    let mut paused: Option<Instant> = None;
    std::future::poll_fn(|cx| {
        // Not counted while the session takes them (it counts what it retains); a reader
        // that is the budget's mover stays it until its events are in the session.
        charge.set(base, 0);
        if session.push_events(stream, events, Some(cx.waker())) {
            std::task::Poll::Ready(())
        } else {
            let waiting: usize = events.iter().map(|e| e.body().len()).sum();
            charge.set(base + waiting, 0);
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
        tracing::trace!(mcp.session = %session.hashed_id(), mcp.stream = stream, paused = ?since.elapsed(), "upstream resumed after a pause");
    }
    if registry.over_budget() {
        registry.enforce_budget(session);
    }
}

/// Reads a tagged upstream stream to its end, whether or not a client is attached, and
/// returns how it ended (its spawner ends the session's stream and decides what follows).
///
/// An upstream that sets its own ids may close a stream before it is done (2025-11-25 "SSE
/// polling"); the gateway then resumes it upstream with `Last-Event-ID` (honouring `retry:`),
/// the way a client would, and keeps appending to the same stream: while a POST stream still
/// has unanswered requests, and for the standalone stream while the session lives.
pub(super) async fn stream(
    registry: &Registry,
    session: &Session,
    stream: u32,
    mut body: OwnBody,
    source: &Source,
) -> End {
    let metrics = registry.metrics().clone();
    let max_event_bytes = source.upstream.cfg.max_event_bytes;
    let mut last_upstream_id: Option<String> = None;
    let mut retry: Option<u64> = None;
    let mut failures = 0;
    let mut charge = registry.budget().charge();
    let end = 'outer: loop {
        let mut decoder = Decoder::new(max_event_bytes);
        let mut events = Vec::new();
        let end = loop {
            if decoder.held() >= READ_BATCH_BYTES {
                // In the middle of a large event: more of it only while the budget has room
                // (else the upstream is not read, and TCP pushes back).
                charge.set(decoder.held(), READ_BATCH_BYTES);
                charge.room_for(READ_BATCH_BYTES).await;
            }
            let ended = read_batch(&mut body, &mut decoder, &mut events, &metrics).await;
            for e in &mut events {
                disown_control_type(e);
                if let Some(id) = e.id() {
                    last_upstream_id = Some(id.to_owned());
                }
                retry = e.retry().or(retry);
            }
            if !events.is_empty() {
                failures = 0;
            }
            // Delivered from a deque: a paused reader's events are taken a window's room at
            // a time, from the front, without moving the rest. (Both conversions keep the
            // buffer and move nothing: the deque is empty when delivered.)
            let mut delivering = VecDeque::from(std::mem::take(&mut events));
            let partial = decoder.held();
            deliver(
                registry,
                session,
                stream,
                &mut delivering,
                &mut charge,
                partial,
            )
            .await;
            charge.set(partial, READ_BATCH_BYTES);
            events = Vec::from(delivering);
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
            let wait = Duration::from_millis(retry.unwrap_or(1000))
                .clamp(MIN_UPSTREAM_RETRY, MAX_UPSTREAM_RETRY);
            tokio::time::sleep(wait).await;
            tracing::debug!(mcp.session = %session.hashed_id(), mcp.stream = stream, "resuming the upstream stream");
            // Boxed: a reconnect's state would otherwise size every reader's task.
            match Box::pin(source.resume(&last_id)).await {
                Some(b) => {
                    body = b;
                    continue 'outer;
                }
                None => metrics.upstream_error(UpstreamErrorKind::Resume),
            }
        }
    };
    if let End::Failed(cause) = &end {
        tracing::warn!(mcp.session = %session.hashed_id(), mcp.stream = stream, cause = ?cause, "upstream stream failed");
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jsonrpc::{
        EVENT_RESUMED, EVENT_RESUMPTION_FAILED, EVENT_RESUMPTION_REQUIRED, EVENT_STREAM,
        EVENT_UPSTREAM_FAILED,
    };

    #[test]
    fn every_gateway_event_type_is_disowned_when_the_upstream_sends_it() {
        for t in [
            EVENT_RESUMED,
            EVENT_RESUMPTION_FAILED,
            EVENT_RESUMPTION_REQUIRED,
            EVENT_UPSTREAM_FAILED,
            EVENT_STREAM,
        ] {
            let mut e = crate::sse::Event::new(Some("7"), Some(t), Some("{}"), Some(5));
            disown_control_type(&mut e);
            assert_eq!(e.event(), Some(format!("upstream/{t}").as_str()));
            let rest = (e.id(), e.data(), e.retry());
            assert_eq!(rest, (Some("7"), Some("{}".into()), Some(5)));
        }
        let mut e = crate::sse::Event::message_of("{}");
        disown_control_type(&mut e);
        assert_eq!(e.event(), Some("message"));
    }
}
