//! The holder of a session's standalone stream: one task per session that opens the stream
//! upstream (`GET` without `Last-Event-ID`), reads it into the window for the session's
//! client, and reopens it when the upstream ends it, until the session closes (its `close`
//! aborts the task) or the upstream has none. The phases it moves through are the session's
//! (`session::Phase`); this module only does the I/O.
//!
//! Knows the upstream client and the session API; nothing of client requests. Its task is
//! its own: spawned here, aborted by the session's `close`.

use std::sync::{Arc, Weak};
use std::time::Duration;

use http::StatusCode;

use super::read;
use crate::metrics::UpstreamErrorKind;
use crate::session::{Attempt, HoldStart, Registry, Session};
use crate::upstream::{OwnBody, Source};

/// Attempts to open the held standalone stream before giving up until the next trigger.
const HOLD_ATTEMPTS: u32 = 4;
/// The wait after the first failed attempt; it doubles after each further one.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);

/// Asks for the session's held standalone stream now: starts its holder if none runs, or
/// cuts the running holder's wait short; `false` when there is nothing to do (see
/// [`Session::hold_start`]). `source` is built only when a holder starts.
pub(crate) fn start(
    registry: &Arc<Registry>,
    session: &Arc<Session>,
    source: impl FnOnce() -> Source,
) -> bool {
    match session.hold_start() {
        HoldStart::Spawn => spawn(registry, session, source(), None),
        HoldStart::Kicked => {}
        HoldStart::Nothing => return false,
    }
    true
}

/// After a client's own standalone stream `stream` ended: the holder takes over once the
/// session's rest delay has passed (nothing for POST streams).
pub(super) fn after_client_stream(
    registry: &Arc<Registry>,
    session: &Arc<Session>,
    stream: u32,
    source: Source,
) {
    if let Some(delay) = session.hold_after_client_stream(stream) {
        spawn(registry, session, source, Some(delay));
    }
}

/// How long a client's `GET` may wait for the holder's attempts to settle: every attempt
/// bounded by the upstream header timeout, plus the backoffs between them.
pub(crate) fn settle_limit(upstream_header_timeout: Duration) -> Duration {
    let backoffs = FIRST_BACKOFF * ((1 << (HOLD_ATTEMPTS - 1)) - 1);
    upstream_header_timeout * HOLD_ATTEMPTS + backoffs
}

fn spawn(registry: &Arc<Registry>, session: &Arc<Session>, source: Source, rest: Option<Duration>) {
    // Kept as long as the session: copied out of the client's read buffer.
    let source = source.owned();
    let task = tokio::spawn(run(
        Arc::downgrade(registry),
        Arc::downgrade(session),
        source,
        rest,
    ));
    session.set_holder(task.abort_handle());
}

/// The holder's loop: (rest,) open, read to the end, rest, open again. Waits hold only weak
/// references, so a closed session is not kept alive by its holder. (Not an `async fn`: its
/// arguments would be in the task twice, for as long as the session lives.)
#[allow(clippy::manual_async_fn)] // see above: the layout, not the syntax
fn run(
    registry: Weak<Registry>,
    session: Weak<Session>,
    source: Source,
    mut rest: Option<Duration>,
) -> impl std::future::Future<Output = ()> {
    async move {
        loop {
            if let Some(delay) = rest.take() {
                if !Session::hold_wait(&session, delay).await {
                    return;
                }
            }
            // Boxed: opening (connect, request, head) is the largest state of this loop, and
            // inline it would size the task for as long as the stream is held.
            let Some(stream) = Box::pin(open(&registry, &session, &source)).await else {
                return;
            };
            let (Some(registry), Some(session)) = (registry.upgrade(), session.upgrade()) else {
                return;
            };
            let (held, body) = stream;
            let end = read::stream(&registry, &session, held, body, &source).await;
            session.end_stream(held, end);
            match session.hold_rest(held) {
                Some(delay) => rest = Some(delay),
                None => return,
            }
        }
    }
}

/// Opens the held stream: a 405 means the upstream has none (the client's `GET` then gets
/// the 405); 404 and other refusals end the attempts; a 409 (the upstream already has one),
/// a 5xx or no answer is retried after 250 ms, 500 ms, 1 s, then left to the next trigger.
async fn open(
    registry: &Weak<Registry>,
    session: &Weak<Session>,
    source: &Source,
) -> Option<(u32, OwnBody)> {
    let mut wait = FIRST_BACKOFF;
    for attempt in 1..=HOLD_ATTEMPTS {
        let s = session.upgrade()?;
        if !s.hold_attempt() {
            return None;
        }
        if !source.upstream.room_to_hold() {
            // The held streams have their share of --max-upstream-connections: this session's
            // is not held (its client's own GET is forwarded, counted like any request).
            tracing::debug!(mcp.session = %s.hashed_id(), "not holding the standalone stream: the held streams have their share of the upstream connections");
            s.hold_failed(Attempt::GiveUp);
            return None;
        }
        let status = match source.get(None).await {
            Ok(body) => {
                let stream = s.open_held_standalone()?;
                tracing::debug!(mcp.session = %s.hashed_id(), mcp.stream = stream, "holding the standalone stream");
                return Some((stream, body));
            }
            Err(status) => status,
        };
        let next = match status {
            Some(StatusCode::METHOD_NOT_ALLOWED) => Attempt::Unsupported,
            None if attempt < HOLD_ATTEMPTS => Attempt::Retry,
            Some(st)
                if attempt < HOLD_ATTEMPTS
                    && (st == StatusCode::CONFLICT || st.is_server_error()) =>
            {
                Attempt::Retry
            }
            _ => Attempt::GiveUp,
        };
        if next != Attempt::Unsupported {
            if let Some(r) = registry.upgrade() {
                r.metrics().upstream_error(UpstreamErrorKind::Hold);
            }
            tracing::debug!(mcp.session = %s.hashed_id(), ?status, attempt, "could not hold the standalone stream");
        }
        s.hold_failed(next);
        drop(s);
        if next != Attempt::Retry || !Session::hold_wait(session, wait).await {
            return None;
        }
        wait *= 2;
    }
    None
}
