//! Sessions: per session, its streams, its window and the clients attached to its streams.
//!
//! This is where the product's rules live: tagging (session-wide sequence numbers), bounded
//! retention, flow control (an event a client may still need is never evicted; the upstream
//! reader waits instead), detach without loss, re-attach strictly after a cursor, explicit
//! gaps, stall detection. It knows the SSE codec, the cursor format and the window; it knows
//! nothing of HTTP requests or sockets (the proxy layer calls it, the attach body reads from
//! it).
//!
//! Rules on the state, locks on the shell: [`Session`] (this file) holds a session's
//! identity, its shared handles, its one `std::sync::Mutex<State>` and its wakers (`Notify`s);
//! each of its methods locks, calls one rule of `State`, unlocks and wakes. The lock is held
//! briefly and never across an `.await`. `State` and its rules need no runtime:
//!
//! - `state`: the `State` struct, its invariants, and the constants it is built from;
//! - `open`: opening a stream with its first client, the held standalone stream and the
//!   holder's phases;
//! - `tag`: tagging and retaining upstream events, making room, the overflow slot, pausing
//!   the reader (flow control);
//! - `resume`: re-attach after a cursor, stale standalone cursors, retransmitted POSTs, a
//!   cursorless `GET` on the held stream, and the in-flight checks of forwarded ids;
//! - `deliver`: a client body's steps (batches, oversized events handed over in pieces,
//!   idle waits, ends), shutdown's detach of clients, and a client's detach;
//! - `life`: streams ending and ended ones forgotten, the sweep, trimming, idleness, close;
//! - `whole`: an answer that came whole, its stream opened, tagged, ended and its client's
//!   whole body made under one hold of the lock.
//!
//! Below them, pure parts with no locks and no I/O: `decide` (the one resume decision: what
//! a cursor gets from what is known of its stream, which `resume` and `store::follow` both
//! act on), `stream` (one stream's bookkeeping and
//! the flow-control predicates), `reserve` (the in-flight reserve of written batches),
//! `batch` (the frame one poll writes), `dedup` (POST de-duplication), `control` (the
//! gateway's own events: priming, resumed, resumption-failed / -required) and `hold` (the
//! held standalone stream's state machine, with the holder's entry points on `Session`).
//! Beside them, `registry`: all sessions, the cap, the memory budget, the TTL sweep.

mod batch;
mod control;
mod decide;
mod dedup;
mod deliver;
mod hold;
mod life;
mod open;
mod publish;
mod registry;
mod reserve;
mod resume;
mod state;
mod stream;
mod tag;
mod view;
mod whole;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

pub(crate) use self::control::{
    gap as gap_frames, opening as opening_frame, resumed as resumed_frame,
    upstream_ended as upstream_ended_frames,
};
pub(crate) use self::deliver::Step;
#[cfg(test)]
use self::hold::Phase;
pub(crate) use self::hold::{Attempt, HoldStart};
use self::life::Swept;
pub use self::open::OpenStream;
pub(crate) use self::publish::Published;
pub(crate) use self::view::unix_ms;
pub(crate) use self::view::{host_name, merge, page};
pub(crate) use self::view::{Listing, SessionView};

/// The last frame of a client that must resume from `here` elsewhere (the store stopped
/// answering its follower).
pub(crate) fn resumption_required_frame(here: &str) -> Bytes {
    control::resumption_required(here, Outcome::Shutdown, None)
}
pub(crate) use self::decide::{decide, Decision, Known, Stored};
pub(crate) use self::dedup::{verdict, IdHolder, IdVerdict};
pub(crate) use self::registry::set_label_key;
pub(crate) use self::registry::Publisher;
pub use self::registry::{hash_id, Owner, Principal, Registry};
pub(crate) use self::registry::{
    is_minted_form, AtCapacity, Budget, Charge, EndUpstream, Eviction, OnEnd, Reservation,
};
pub(crate) use self::resume::{InFlight, Resume, ResumeError, Retransmission};
use self::state::{Books, Consts, State};
pub use self::stream::StreamKind;
pub(crate) use self::stream::{End, UpstreamFailure};
pub(crate) use self::whole::Whole;
use crate::config::Config;
use crate::cursor::{new_epoch, Cursor};
use crate::metrics::Metrics;
use crate::sse::Event;

/// Ids of sessions that stopped being quiet since the registry's last sweep (see
/// [`State::stir`]): the sweeper visits them again at its next round.
#[derive(Debug, Default)]
pub(crate) struct Stirred(Mutex<Vec<String>>);

impl Stirred {
    /// The ids gathered since the last call.
    pub(crate) fn take(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.0))
    }
}

/// One MCP session as the gateway sees it: the shell around its [`State`].
#[derive(Debug)]
pub struct Session {
    id: String,
    /// The id as logs and metrics show it ([`hash_id`]), made once.
    hashed_id: Arc<str>,
    /// Every cursor the session issues names it; a cursor of another is refused unlocked.
    epoch: u64,
    metrics: Arc<Metrics>,
    budget: Arc<Budget>,
    /// The path the session was created on: the only one that is the session's.
    endpoint: Box<str>,
    /// Whose share of the session cap and memory budget the session counts against.
    share: Principal,
    /// The gateway minted the id (the upstream is stateless): it is never sent upstream.
    minted: bool,
    /// The one lock: everything that changes after the session is made (the principal too).
    state: Mutex<State>,
    /// Woken when an attempt to open the held standalone stream settles.
    hold_settled: Notify,
    /// Cuts the holder's wait short (a client's `GET` wants the stream now).
    hold_kick: Arc<Notify>,
    /// Woken when a forwarded POST settles (see [`Session::begin_forward`]).
    forward_settled: Notify,
    /// Woken when the session closes (see [`Session::closed`]).
    closed_signal: Notify,
    /// Where the session says it needs the sweeper again (see [`State::stir`]).
    stirred: Arc<Stirred>,
    /// Told of each change to a stream's content (the fleet's store); `None` without one.
    publisher: Option<Arc<Publisher>>,
    /// The fleet's store's name for the session (a keyed hash of its id), made once.
    store_tag: std::sync::OnceLock<Arc<str>>,
    /// When this replica made or adopted it (Unix ms), for operators (`view`).
    created_ms: u64,
}

/// A forwarded POST's request ids, in flight until this drops (see [`Session::begin_forward`]).
#[derive(Debug)]
pub struct Forwarding {
    session: Arc<Session>,
    principal: Principal,
    ids: Vec<String>,
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        lock(&self.session.state).settle_forward(self.principal, &self.ids);
        self.session.forward_settled.notify_waiters();
    }
}

/// A client attached to a tagged stream: what its body pulls from the session with.
#[derive(Debug)]
pub struct Attachment {
    pub stream: u32,
    /// Which client of the stream this is: a later attachment to the stream replaces it.
    pub generation: u64,
    /// What the body sends first (the priming event, the resumed or re-attach control
    /// event), if anything.
    pub opening: Option<Bytes>,
}

/// The trace context (W3C ids) of the request that opened a stream, kept so that a resume of
/// the stream can join its trace. The gateway's tracing fills it; the session only keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: u128,
    pub span_id: u64,
    pub sampled: bool,
}

/// A client's standalone-stream cursor that cannot be resumed exactly: it re-attaches to the
/// session at an indeterminate position, told so by an id-bearing control event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reattach {
    /// The client's cursor.
    pub previous: String,
    /// Events after the cursor may have been lost (evicted, or the stream is forgotten).
    pub lost: bool,
    /// Why the cursor could not be resumed exactly.
    pub reason: &'static str,
}

/// Why an attached client's stream ended (for logs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The upstream's stream ended and the client got all of it.
    Completed,
    /// A newer attachment took over the stream.
    Replaced,
    /// The session was dropped (TTL, DELETE, upstream 404, cap).
    SessionClosed,
    /// The client stalled and was told to resume.
    SlowConsumer,
    /// The gateway is shutting down and told the client to resume.
    Shutdown,
    /// Events the client needed were evicted.
    Gap,
    /// The upstream's stream failed.
    UpstreamFailed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Replaced => "replaced",
            Outcome::SessionClosed => "session-closed",
            Outcome::SlowConsumer => "slow-consumer",
            Outcome::Shutdown => "shutdown",
            Outcome::Gap => "gap",
            Outcome::UpstreamFailed => "upstream-failed",
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Session {
    fn new(
        id: String,
        cfg: Arc<Config>,
        metrics: Arc<Metrics>,
        budget: Arc<Budget>,
        owner: Owner,
        minted: bool,
    ) -> Session {
        let (epoch, first_stream) = owner.adopted.unwrap_or_else(|| (new_epoch(), 0));
        let consts = Consts::new(&cfg, epoch);
        let mut state = State::new(consts, owner.principal, Instant::now());
        state.next_stream = first_stream;
        Session {
            hashed_id: hash_id(&id).into(),
            id,
            epoch,
            state: Mutex::new(state),
            metrics,
            budget,
            endpoint: owner.endpoint,
            share: owner.share,
            minted,
            hold_settled: Notify::new(),
            hold_kick: Arc::new(Notify::new()),
            forward_settled: Notify::new(),
            closed_signal: Notify::new(),
            stirred: Arc::default(),
            publisher: None,
            store_tag: std::sync::OnceLock::new(),
            created_ms: unix_ms(std::time::SystemTime::now()),
        }
    }

    /// The fleet's store's name for the session, made by `make` the first time.
    pub(crate) fn store_tag(&self, make: impl FnOnce() -> Arc<str>) -> Arc<str> {
        self.store_tag.get_or_init(make).clone()
    }

    /// The session, telling `publisher` of each change to a stream's content.
    pub(crate) fn publishing(self, publisher: Option<Arc<Publisher>>) -> Session {
        Session { publisher, ..self }
    }

    /// Tells the publisher, if any, that `stream` changed (outside the lock).
    fn published(&self, stream: u32) {
        if let Some(p) = &self.publisher {
            (p.0)(self, stream);
        }
    }

    /// The session, telling `stirred` when it needs the sweeper again.
    pub(crate) fn stirring(self, stirred: Arc<Stirred>) -> Session {
        Session { stirred, ..self }
    }

    /// The shell's handles the rules count in, lent for one call.
    fn books(&self) -> Books<'_> {
        Books {
            metrics: &self.metrics,
            budget: &self.budget,
        }
    }

    /// Locks the state for one rule `f` that may stir a quiet session ([`State::stir`]): the
    /// registry's sweeper is then told, still under the lock, so it visits the session at its
    /// next round.
    fn with_state<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut st = lock(&self.state);
        let quiet = st.quiet;
        let r = f(&mut st);
        if quiet && !st.quiet {
            lock(&self.stirred.0).push(self.id.clone());
        }
        r
    }

    /// Resolves once the session is closed (TTL, DELETE, upstream 404, shed).
    pub async fn closed(&self) {
        loop {
            let notified = self.closed_signal.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if lock(&self.state).closed {
                return;
            }
            notified.await;
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The id as logs and metrics show it: [`hash_id`] of [`Session::id`].
    pub fn hashed_id(&self) -> &Arc<str> {
        &self.hashed_id
    }

    /// The path the session was created on.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whose share of the session cap and memory budget the session counts against.
    pub fn share(&self) -> Principal {
        self.share
    }

    /// Whether the gateway minted this session's id (its upstream is stateless).
    pub fn minted(&self) -> bool {
        self.minted
    }

    /// The epoch every cursor of this session names.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The principal (keyed MAC) this session is bound to.
    pub fn principal(&self) -> Principal {
        lock(&self.state).principal
    }

    /// Rebinds the session (after the upstream accepted the caller's new credentials), and
    /// with it what its owner sent.
    pub fn set_principal(&self, p: Principal) {
        lock(&self.state).set_principal(p);
    }

    /// Records client activity (a request): the TTL counts from the latest one.
    pub fn touch(&self) {
        let now = Instant::now();
        lock(&self.state).touch(now);
    }

    pub fn protocol_version(&self) -> Option<String> {
        lock(&self.state).protocol_version.clone()
    }

    pub fn set_protocol_version(&self, v: &str) {
        lock(&self.state).set_protocol_version(v);
    }

    /// Whether an upstream stream that closed should be resumed upstream: a POST stream with
    /// requests still unanswered, or the standalone stream, while the session lives.
    pub fn wants_more(&self, stream: u32) -> bool {
        lock(&self.state).wants_more(stream)
    }

    /// Calls (POST streams) of this session still read from the upstream with no client
    /// attached: each holds an upstream connection until it ends (`--max-detached-calls`).
    /// Counted per principal: the quota belongs to whoever left the calls, so nobody else
    /// who knows the session id can use up its owner's.
    pub fn detached_calls(&self, principal: Principal) -> usize {
        lock(&self.state).detached_calls(principal)
    }

    /// Whether `principal` may resume at `cursor`: a call's stream is only its sender's (the
    /// session's standalone stream is the session's, whose owner the caller was checked to
    /// be). A cursor of no stream the session retains is left to [`Session::resume`] to
    /// refuse.
    pub fn may_resume(&self, cursor: &Cursor, principal: Principal) -> bool {
        cursor.epoch != self.epoch || lock(&self.state).may_resume(cursor, principal)
    }

    /// The trace of the request that opened `stream`, if it was traced.
    pub fn stream_trace(&self, stream: u32) -> Option<TraceParent> {
        lock(&self.state).stream_trace(stream)
    }

    /// Whether the session still holds a live standalone upstream stream.
    pub fn has_standalone(&self) -> bool {
        lock(&self.state).live_standalone()
    }

    /// Opens a tagged stream and attaches its first client at the opening position. The
    /// attachment opens with the priming event if asked, or the re-attach event for a
    /// standalone stream opened to serve a client's stale cursor.
    pub fn open_stream(&self, open: OpenStream<'_>) -> Attachment {
        let now = Instant::now();
        let opened = self.with_state(|st| st.open(self.books(), open, now));
        let attachment = opened.attachment();
        self.published(attachment.stream);
        attachment
    }

    /// Opens a stream as [`Session::open_stream`] does, tags `events` into it and ends it
    /// with `end` (`answers[i]`: the ids of the responses `events[i]` is, when read already,
    /// so tagging does not read them again), then makes its first client's whole body,
    /// detached (see [`Whole`]).
    pub fn open_whole(
        &self,
        open: OpenStream<'_>,
        events: &mut VecDeque<Event>,
        answers: Option<&[Vec<String>]>,
        end: End,
    ) -> Whole {
        let now = Instant::now();
        let (stream, whole) = self.with_state(|st| {
            // The number the stream opens with.
            let stream = st.next_stream;
            let whole = st.open_whole(self.books(), open, events, answers, end, now);
            (stream, whole)
        });
        self.published(stream);
        whole
    }

    /// Remembers the task reading the upstream for `stream`, so closing the session stops it.
    pub fn set_reader(&self, stream: u32, handle: AbortHandle) {
        lock(&self.state).set_reader(stream, handle);
    }

    /// Tags and retains decoded upstream events of `stream` (draining them from `events`),
    /// then wakes its client. Flow control: stops at the first event for which the window
    /// has no room without evicting an event some client may still need, leaves it and the
    /// rest in `events`, registers `reader` to be woken when room may have been made, and
    /// returns `false`; the caller then stops reading the upstream until woken.
    pub fn push_events(
        &self,
        stream: u32,
        events: &mut VecDeque<Event>,
        reader: Option<&Waker>,
    ) -> bool {
        if events.is_empty() {
            return true;
        }
        let now = Instant::now();
        let before = events.len();
        let done = self.with_state(|st| st.push(self.books(), stream, events, reader, None, now));
        if events.len() < before {
            self.published(stream);
        }
        done
    }

    /// What the fleet's store does not have yet of `stream`: each event after the last one
    /// published goes to `event` (position, `event: message` flag, body), in order; `None`
    /// when there is nothing new (see [`State::unpublished`]).
    pub(crate) fn unpublished(
        &self,
        stream: u32,
        event: impl FnMut(u64, bool, &[u8]),
    ) -> Option<Published> {
        lock(&self.state).unpublished(stream, event)
    }

    /// The fleet's store restarted empty: `stream` is published again from its opening (what
    /// the window still holds of it), as if it had never been. `false` when it is not held or
    /// its end was published.
    pub(crate) fn republish(&self, stream: u32) -> bool {
        lock(&self.state).republish(stream)
    }

    /// `stream`'s facts again, for a store that came back (see [`State::republished`]).
    pub(crate) fn republished(&self, stream: u32) -> Option<Published> {
        lock(&self.state).republished(stream)
    }

    /// A client following `stream` on another replica reached `acked`, `age` ago (the fleet's
    /// store says): guarded like a local client's position. Whether the stream still runs here.
    pub(crate) fn remote_progress(
        &self,
        stream: u32,
        acked: u64,
        age: std::time::Duration,
    ) -> bool {
        let now = Instant::now();
        let at = now.checked_sub(age).unwrap_or(now);
        self.with_state(|st| {
            st.remote_progress(stream, acked, at)
                && st.streams.get(&stream).is_some_and(|s| s.end.is_none())
        })
    }

    /// Whether a client of this replica is attached to `stream`.
    pub(crate) fn attached_here(&self, stream: u32) -> bool {
        lock(&self.state)
            .streams
            .get(&stream)
            .is_some_and(|s| s.sub.is_some())
    }

    /// Whether this replica holds `stream` of the session (it opened it and still retains it).
    pub fn holds_stream(&self, stream: u32) -> bool {
        lock(&self.state).streams.get(&stream).is_some()
    }

    /// Marks `stream` ended by its upstream and wakes its client.
    pub fn end_stream(&self, stream: u32, end: End) {
        lock(&self.state).end(&self.budget, stream, end);
        self.published(stream);
    }

    /// Re-attaches a client to the stream of `cursor` (a `GET` with `Last-Event-ID`).
    pub fn resume(&self, cursor: Cursor, kill: Option<Arc<Notify>>) -> Result<Resume, ResumeError> {
        if cursor.epoch != self.epoch {
            return Err(ResumeError::ForeignCursor);
        }
        let now = Instant::now();
        self.with_state(|st| st.resume(&self.metrics, cursor, kill, now))
    }

    /// A standalone-stream cursor that [`Session::resume`] refused: when the
    /// session outlives that stream (it ended, was forgotten, or lost the events after the
    /// cursor), the client re-attaches to the session instead (see [`Reattach`]). `None`
    /// when the cursor is not a standalone cursor of this session, or the refusal stands.
    pub fn standalone_reattach(&self, cursor: &Cursor) -> Option<Reattach> {
        if cursor.epoch != self.epoch {
            return None;
        }
        lock(&self.state).standalone_reattach(cursor)
    }

    /// Marks a POST carrying `ids` as forwarded until the returned guard drops (after its
    /// stream opened, so the ids are carried, or it ended otherwise). `None` while a POST
    /// carrying one of `ids` is still in flight: the caller waits for it
    /// ([`Session::forward_settled`]) and then takes it as a retransmission, so a client that
    /// retries before the upstream's response head does not run the tool twice.
    ///
    /// A request id in flight for another principal (being forwarded, or carried by a stream
    /// still waiting for its answer) is never forwarded for this one: upstreams route answers
    /// by request id within a session, so the later POST would take the earlier's answer
    /// ([`InFlight::Another`]).
    pub fn begin_forward(
        self: &Arc<Self>,
        principal: Principal,
        ids: &[String],
    ) -> Result<Forwarding, InFlight> {
        lock(&self.state).begin_forward(principal, ids)?;
        Ok(Forwarding {
            session: self.clone(),
            principal,
            ids: ids.to_vec(),
        })
    }

    /// What a POST of `principal` carrying `ids` may do here ([`verdict`], every holder
    /// this replica knows of).
    #[cfg(test)]
    pub(crate) fn id_verdict(&self, principal: Principal, ids: &[String]) -> IdVerdict {
        lock(&self.state).id_verdict(principal, ids)
    }

    /// Waits until no POST of `principal` carrying one of `ids` is in flight.
    pub async fn forward_settled(&self, principal: Principal, ids: &[String]) {
        loop {
            let settled = self.forward_settled.notified();
            if !lock(&self.state).forwarding(principal, ids) {
                return;
            }
            settled.await;
        }
    }

    /// Whether `principal` already sent one of `ids` in this session: a retained stream was
    /// started by its POST carrying one, or a forgotten one was.
    pub fn carries_any(&self, principal: Principal, ids: &[String]) -> bool {
        lock(&self.state).carries_any(principal, ids)
    }

    /// A POST whose request ids include one already carried by a retained stream of this
    /// session is a retransmission (MCP forbids reusing an id within a session): it is
    /// answered as a resume of that stream, never forwarded (see [`Retransmission`]).
    pub fn retransmission(
        &self,
        principal: Principal,
        ids: &[String],
        cursor: Option<Cursor>,
        kill: Option<Arc<Notify>>,
    ) -> Retransmission {
        let now = Instant::now();
        self.with_state(|st| st.retransmission(&self.metrics, principal, ids, cursor, kill, now))
    }

    /// Attaches a client without a cursor to the held standalone stream, replacing any
    /// older client: it gets every retained event of the stream that was never written to a
    /// client, then the live tail. The first event is the priming event (if `prime`) or, for
    /// a client re-attaching with a stale cursor, the control event saying so. Returns
    /// `None` when no standalone stream is held.
    pub fn attach_standalone(
        &self,
        prime: bool,
        reattach: Option<&Reattach>,
        kill: Option<Arc<Notify>>,
    ) -> Option<Attachment> {
        let now = Instant::now();
        self.with_state(|st| st.attach_standalone(&self.metrics, prime, reattach, kill, now))
    }

    /// The next step for the client `generation` attached to `stream`.
    pub fn poll_step(&self, stream: u32, generation: u64, waker: &Waker) -> Step {
        let now = Instant::now();
        lock(&self.state).step(&self.budget, stream, generation, waker, now)
    }

    /// Tells every attached client of standalone streams (or of all streams) to resume
    /// elsewhere.
    fn end_clients(&self, standalone_only: bool) {
        let kind = standalone_only.then_some(StreamKind::Standalone);
        let now = Instant::now();
        lock(&self.state).end_clients(kind, now);
    }

    /// The client `generation` of `stream` went away (its body was dropped). Its stream's
    /// undelivered events stay guarded for `--stall-timeout` from its last progress.
    pub fn detach(&self, stream: u32, generation: u64) {
        let now = Instant::now();
        lock(&self.state).detach(&self.metrics, stream, generation, now);
    }

    /// Drops all state: stops upstream readers, ends attached clients, frees the window.
    fn close(&self) {
        lock(&self.state).close(&self.budget);
        self.closed_signal.notify_waiters();
    }

    /// Sweep work for one session (see [`State::sweep`]).
    fn sweep(&self, now: Instant) -> Swept {
        lock(&self.state).sweep(self.books(), now)
    }

    /// Retained window events and bytes (for tests and metrics).
    pub fn window_usage(&self) -> (usize, usize) {
        let st = lock(&self.state);
        (st.window.len(), st.window.bytes())
    }

    /// Evicts this session's oldest events until `excess` bytes are freed (the global budget
    /// is exceeded and no idle session is left to shed). Evicted events become gaps.
    fn trim(&self, excess: usize) {
        lock(&self.state).trim(self.books(), excess);
    }

    /// Since when the session has had no client attached (`None`: one is), and whether a
    /// client may still come back for something (see [`State::idle_since`]).
    fn idle_since(&self) -> Option<(bool, Instant)> {
        let now = Instant::now();
        lock(&self.state).idle_since(now)
    }

    /// Clients attached to this session's streams now.
    /// Its calls (POST streams) still read from the upstream.
    pub fn running_calls(&self) -> usize {
        let st = lock(&self.state);
        st.running
            .iter()
            .filter(|n| {
                st.streams
                    .get(n)
                    .is_some_and(|s| s.kind == StreamKind::Post)
            })
            .count()
    }

    pub fn attached_clients(&self) -> usize {
        lock(&self.state).attached_clients()
    }
}

#[cfg(test)]
mod tests;
