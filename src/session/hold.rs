//! The held standalone stream's state machine: where the gateway stands in holding the
//! session's standalone stream for its client, as one [`Phase`] under the session's lock, and
//! the holder task (the one loop that opens, reads and reopens it, `feed::hold`) that the
//! session owns and `close` aborts.
//!
//! [`Hold`] is pure; its rules that need the session's streams are `State`'s (`open`), and
//! the `Session` methods here only lock, call one, unlock and wake. Knows nothing of HTTP or
//! of how the stream is opened.
//!
//! ```text
//!            start              opened                 stream ended
//!   Idle ──────────▶ Opening ──────────▶ Holding ──────────────────▶ Resting
//!    ▲                 │  ▲  405 ─▶ Unsupported                       │  │
//!    │   gave up /     │  │                                 delay / kick │
//!    └─ a client's ────┤  └──── Backoff ◀── failed, retry ─┐        ▼  │
//!       stream won     └───────────────────────────────────┘     Opening
//! ```
//!
//! A client's `GET` that finds no live standalone stream starts the holder (`Idle`) or cuts
//! its wait short (`Backoff`, `Resting`: a *kick*), then waits for the attempts to settle.

use std::time::Duration;

use tokio::task::AbortHandle;

use super::{lock, Session};

/// The first and the longest delay before reopening a standalone stream the upstream ended.
pub(super) const REHOLD_MIN: Duration = Duration::from_secs(1);
pub(super) const REHOLD_MAX: Duration = Duration::from_secs(60);

/// Where the gateway stands in holding the session's standalone stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// No holder task runs.
    Idle,
    /// An upstream `GET` is in flight; a client's `GET` waits for it.
    Opening,
    /// An attempt failed; the holder waits before the next one.
    Backoff,
    /// The holder reads the held stream.
    Holding,
    /// The held stream ended; the holder waits before reopening it.
    Resting,
    /// The upstream has no standalone stream (405): the client's `GET` is forwarded.
    Unsupported,
}

/// The hold's state, kept in the session's `State`.
#[derive(Debug)]
pub(super) struct Hold {
    pub(super) phase: Phase,
    /// Delay before reopening a standalone stream that ended; doubles while the upstream
    /// keeps ending streams that carried nothing.
    rehold_delay: Duration,
    /// The holder task, aborted when the session closes.
    task: Option<AbortHandle>,
}

impl Hold {
    pub(super) fn new() -> Hold {
        Hold {
            phase: Phase::Idle,
            rehold_delay: REHOLD_MIN,
            task: None,
        }
    }

    /// Remembers the holder task, aborted when the session closes.
    pub(super) fn set_task(&mut self, task: AbortHandle) {
        self.task = Some(task);
    }

    /// The delay before reopening a standalone stream that ended (and carried events, or
    /// not): short when it did, doubling while the upstream keeps ending empty ones.
    pub(super) fn rest(&mut self, carried: bool) -> Duration {
        let delay = if carried {
            REHOLD_MIN
        } else {
            (self.rehold_delay * 2).min(REHOLD_MAX)
        };
        self.rehold_delay = delay;
        delay
    }

    /// Stops the holder task (the session is closing).
    pub(super) fn abort(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        self.phase = Phase::Idle;
    }
}

/// What [`Session::hold_start`] asks of its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldStart {
    /// Spawn the holder now, then hand its handle to [`Session::set_holder`].
    Spawn,
    /// The waiting holder was told to try now.
    Kicked,
    /// Nothing to do: the session is closed, holds a live stream, an attempt is under way,
    /// or the upstream has none.
    Nothing,
}

/// What the holder does after an attempt that did not open a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attempt {
    /// The upstream answered 405: it has no standalone stream.
    Unsupported,
    /// Worth retrying (409, 5xx, no answer) after a backoff.
    Retry,
    /// Give up until the next trigger (another refusal, or the last attempt failed).
    GiveUp,
}

impl Session {
    /// The hold's phase now.
    pub fn hold_phase(&self) -> Phase {
        lock(&self.state).hold.phase
    }

    /// Asks for the held stream now: starts the holder (`Idle`), or cuts a waiting holder's
    /// wait short (`Backoff`, `Resting`). Either way the phase is `Opening` when this returns
    /// something but [`HoldStart::Nothing`], so a client's `GET` that waits next cannot miss
    /// the attempt.
    pub fn hold_start(&self) -> HoldStart {
        let start = lock(&self.state).hold_start();
        if start == HoldStart::Kicked {
            self.hold_kick.notify_one();
        }
        start
    }

    /// After a client's own standalone stream `stream` ended: how long the holder should wait
    /// before opening a new one (it is then `Resting`; spawn it with this delay). `None`: not
    /// a standalone stream, or the session is closed, holds another, or a holder runs.
    pub fn hold_after_client_stream(&self, stream: u32) -> Option<Duration> {
        lock(&self.state).hold_after_client_stream(stream)
    }

    /// Remembers the holder task, so closing the session stops it.
    pub fn set_holder(&self, handle: AbortHandle) {
        lock(&self.state).set_holder(handle);
    }

    /// The holder, at the top of an attempt: `false` when there is nothing left to do (the
    /// session closed, or a client's own standalone stream got there first); the holder then
    /// ends.
    pub fn hold_attempt(&self) -> bool {
        let go = lock(&self.state).hold_attempt();
        self.hold_settled.notify_waiters();
        go
    }

    /// The holder, after an attempt that opened nothing: the phase `attempt` leads to.
    pub fn hold_failed(&self, attempt: Attempt) {
        lock(&self.state).hold_failed(attempt);
        self.hold_settled.notify_waiters();
    }

    /// The holder waits `delay` (backoff or rest), cut short by a client's kick; `true` when it
    /// should attempt now, `false` when it should end (the session closed meanwhile). Holds no
    /// strong reference while it waits: the caller passes a `Weak`.
    pub async fn hold_wait(session: &std::sync::Weak<Session>, delay: Duration) -> bool {
        let Some(kick) = session.upgrade().map(|s| s.hold_kick.clone()) else {
            return false;
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = kick.notified() => {}
        }
        session.upgrade().is_some_and(|s| !lock(&s.state).closed)
    }

    /// Opens the standalone stream the gateway holds for the session's client (none attached
    /// yet: its events are kept for the first client's `GET`). `None` if the session closed
    /// meanwhile or a client's own standalone stream got there first (the holder then ends).
    pub fn open_held_standalone(&self) -> Option<u32> {
        let opened = lock(&self.state).open_held_standalone();
        if let Some(stream) = opened {
            // The fleet learns at once that the stream is held here (a quiet server may send
            // nothing on it for long).
            self.published(stream);
        }
        self.hold_settled.notify_waiters();
        opened
    }

    /// The holder, after its held stream `stream` ended: how long to rest before reopening
    /// it (`None`: the session closed or holds another; the holder then ends).
    pub fn hold_rest(&self, stream: u32) -> Option<Duration> {
        lock(&self.state).hold_rest(stream)
    }

    /// Waits (at most `limit`) until no attempt to open the held stream is in flight, so a
    /// client's `GET` arriving meanwhile attaches to it instead of racing it upstream.
    pub async fn hold_settled(&self, limit: Duration) {
        self.hold_wait_while(limit, |p| p == Phase::Opening).await;
    }

    /// Waits (at most `limit`) until the holder's attempts settled: a stream is held, or the
    /// holder is resting, gave up, or found none. A failed attempt's backoff is waited out.
    pub async fn hold_attempts_settled(&self, limit: Duration) {
        self.hold_wait_while(limit, |p| matches!(p, Phase::Opening | Phase::Backoff))
            .await;
    }

    async fn hold_wait_while(&self, limit: Duration, busy: impl Fn(Phase) -> bool) {
        let _ = tokio::time::timeout(limit, async {
            loop {
                let settled = self.hold_settled.notified();
                if !busy(lock(&self.state).hold.phase) {
                    return;
                }
                settled.await;
            }
        })
        .await;
    }
}
