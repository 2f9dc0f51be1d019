//! Sessions: per session, its streams, its window and the clients attached to its streams.
//!
//! This is where the product's rules live: tagging (session-wide sequence numbers), bounded
//! retention, flow control (an event a client may still need is never evicted; the upstream
//! reader waits instead), detach without loss, re-attach strictly after a cursor, explicit
//! gaps, stall detection. It knows the SSE codec, the cursor format and the window; it knows
//! nothing of HTTP requests or sockets (the proxy layer calls it, the attach body reads from
//! it). Locks are `std::sync::Mutex`, held briefly and never across an `.await`.
//!
//! Submodules: `stream` (one stream's bookkeeping and the flow-control predicates),
//! `reserve` (the in-flight reserve of written batches), `batch` (the frame one poll
//! writes), `dedup` (POST de-duplication), `control` (the gateway's own events: priming,
//! resumed, resumption-failed / -required), `whole` (an answer that came whole: its stream
//! opened, tagged, ended and its client's whole body made under one hold of the lock) and
//! `registry` (all sessions, the cap, the memory budget, the TTL sweep). All but `registry`
//! and `whole` are pure: no locks, no I/O.

mod batch;
mod control;
mod dedup;
mod hold;
mod registry;
mod reserve;
mod stream;
mod whole;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use self::batch::Batch;
use self::dedup::{Carried, Forwarded, Retired};
use self::hold::Hold;
pub use self::hold::{Attempt, HoldStart, Phase};
pub use self::registry::{
    hash_id, is_minted_form, AtCapacity, Budget, Charge, Eviction, OnShed, Owner, Principal,
    Registry, Reservation,
};
use self::reserve::{Delivery, Reserve};
pub use self::stream::{End, StreamKind, UpstreamFailure};
use self::stream::{Stream, Streams, Subscriber};
pub use self::whole::Whole;
use crate::config::Config;
use crate::cursor::{new_epoch, Cursor};
use crate::jsonrpc;
use crate::metrics::Metrics;
use crate::sse::Event;
use crate::window::{Entry, Window};

/// Ended streams whose metadata (pending request ids, loss marks) a session keeps so that a
/// late resume of them still gets an exact answer. Older ended streams are forgotten.
const MAX_ENDED_STREAMS: usize = 64;

/// Standalone stream numbers a session remembers after their metadata is forgotten, so a
/// client's very old standalone cursor still re-attaches to the session.
const STANDALONE_HISTORY: usize = 8;

#[derive(Debug)]
struct State {
    window: Window,
    last_seq: u64,
    next_stream: u32,
    streams: Streams,
    ended: VecDeque<u32>,
    last_activity: Instant,
    protocol_version: Option<String>,
    standalone: Option<u32>,
    standalone_history: VecDeque<u32>,
    hold: Hold,
    closed: bool,
    next_generation: u64,
    /// The in-flight reserve: the most recent batches written to clients (any stream).
    inflight: Reserve,
    /// Request ids of POSTs forwarded and not yet settled.
    forwarded: Forwarded,
    /// Request ids of streams no longer retained.
    retired: Retired,
    /// Which of `streams` carried each request id.
    carried: Carried,
    /// Streams whose upstream reader paused since [`wake_readers`] last ran (some may have
    /// been woken since, or be gone): a session retains many ended streams, which have none.
    paused: Vec<u32>,
    /// The streams of `streams` not ended yet: a session retains many ended ones.
    running: std::collections::BTreeSet<u32>,
    /// The last frames of the clients attached when the session closed, by (stream,
    /// generation): each learns explicitly that its calls will not be answered.
    closing: Vec<(u32, u64, Bytes)>,
    /// The last sweep found nothing to watch (see [`Session::sweep`]): the registry's sweeper
    /// skips the session until its TTL could run out, unless told otherwise ([`Session::stir`]).
    quiet: bool,
}

/// What [`Session::sweep`] found.
#[derive(Clone, Copy, Debug)]
struct Swept {
    /// No client attached.
    idle: bool,
    /// The session's last activity.
    since: Instant,
    /// Nothing for a sweep to do until the TTL may have run out.
    quiet: bool,
}

/// Ids of sessions that stopped being quiet since the registry's last sweep (see
/// [`Session::stir`]): the sweeper visits them again at its next round.
#[derive(Debug, Default)]
pub(crate) struct Stirred(Mutex<Vec<String>>);

impl Stirred {
    /// The ids gathered since the last call.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.0))
    }
}

/// One MCP session as the gateway sees it.
#[derive(Debug)]
pub struct Session {
    id: String,
    /// The id as logs and metrics show it ([`hash_id`]), made once.
    hashed_id: Arc<str>,
    epoch: u64,
    /// `id: <epoch hex>.`: how every event id line this session writes begins.
    id_prefix: [u8; 21],
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    budget: Arc<Budget>,
    /// Keyed hash of the principal the session is bound to (see `proxy`).
    principal: Mutex<Principal>,
    /// The path the session was created on: the only one that is the session's.
    endpoint: Box<str>,
    /// Whose share of the session cap and memory budget the session counts against.
    share: Principal,
    /// The gateway minted the id (the upstream is stateless): it is never sent upstream.
    minted: bool,
    state: Mutex<State>,
    /// Woken when an attempt to open the held standalone stream settles.
    hold_settled: Notify,
    /// Cuts the holder's wait short (a client's `GET` wants the stream now).
    hold_kick: Arc<Notify>,
    /// Woken when a forwarded POST settles (see [`Session::begin_forward`]).
    forward_settled: Notify,
    /// Woken when the session closes (see [`Session::closed`]).
    closed_signal: Notify,
    /// Where the session says it needs the sweeper again (see [`Session::stir`]).
    stirred: Arc<Stirred>,
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
        lock(&self.session.state)
            .forwarded
            .settle(self.principal, &self.ids);
        self.session.forward_settled.notify_waiters();
    }
}

/// Why [`Session::begin_forward`] did not mark a POST's ids forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFlight {
    /// The same principal's POST with one of the ids is in flight: wait for it
    /// ([`Session::forward_settled`]), then it is a retransmission.
    Own,
    /// Another principal's request with one of the ids is in flight: refused.
    Another,
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

/// A stream just opened under the session's lock, its first client's opening event still to
/// be written (formatting it needs no lock).
struct Opened<'a> {
    stream: u32,
    generation: u64,
    /// The opening position.
    seq: u64,
    prime: bool,
    announce: bool,
    reattach: Option<&'a Reattach>,
}

impl Opened<'_> {
    /// The first client's attachment, with its opening event.
    fn attachment(&self, session: &Session) -> Attachment {
        let opening = if self.announce {
            Some(session.announcement(self.stream, self.seq))
        } else {
            session.opening_event(self.stream, self.seq, self.prime, self.reattach)
        };
        Attachment {
            stream: self.stream,
            generation: self.generation,
            opening,
        }
    }
}

/// The trace context (W3C ids) of the request that opened a stream, kept so that a resume of
/// the stream can join its trace. The gateway's tracing fills it; the session only keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: u128,
    pub span_id: u64,
    pub sampled: bool,
}

/// What [`Session::open_stream`] opens, and how its first client is attached.
#[derive(Debug)]
pub struct OpenStream<'a> {
    pub kind: StreamKind,
    /// The request ids (JSON text) of the POST the stream answers.
    pub requests: Vec<String>,
    /// The principal of that POST: only its retransmissions are answered from the stream.
    pub principal: Principal,
    /// That POST was `initialize`: its answer tells the session's protocol version.
    pub initialize: bool,
    /// The client's body starts with a priming event.
    pub prime: bool,
    /// Without a priming event, the client's body starts with an id-bearing
    /// `mcp-reattach/stream` event instead (clients ignore its type but keep its id), so it
    /// can resume before the upstream sends anything (an upgraded JSON answer).
    pub announce: bool,
    /// A standalone stream opened to serve a client's stale cursor: its body starts with the
    /// control event saying so.
    pub reattach: Option<&'a Reattach>,
    /// Closes the client's connection when its body cannot even be polled.
    pub kill: Option<Arc<Notify>>,
    /// The trace of the request that opens it (when traces are exported).
    pub trace: Option<TraceParent>,
}

impl OpenStream<'_> {
    /// The common case: a stream of `kind` for `requests`, not `initialize`, no priming, no
    /// re-attach, no connection to close.
    pub fn new(kind: StreamKind, requests: Vec<String>) -> Self {
        OpenStream {
            kind,
            requests,
            principal: Principal::default(),
            initialize: false,
            prime: false,
            announce: false,
            reattach: None,
            kill: None,
            trace: None,
        }
    }
}

/// The answer to a resume request that the gateway can serve.
#[derive(Debug)]
pub enum Resume {
    /// Attached: the body starts with the attachment's opening (the resumed event), then
    /// replays `replay` retained events.
    Attached {
        attachment: Attachment,
        replay: usize,
    },
    /// The stream's successors of the cursor were evicted, and requests are still unanswered:
    /// the body is `frames` (a failure event and a JSON-RPC error per request), then it ends.
    GapWithErrors { frames: Bytes },
}

/// Why a resume cannot be served. Each maps to a documented response (see `docs/protocol.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResumeError {
    #[error("the cursor belongs to another session or to an earlier run of the gateway")]
    ForeignCursor,
    #[error("the cursor is ahead of what its stream has emitted")]
    CursorAhead,
    #[error("the events after the cursor were evicted from the gateway's window")]
    Gap,
    #[error("the cursor's stream is no longer retained")]
    StreamExpired,
    #[error("the cursor's stream has ended and everything after the cursor was delivered")]
    StreamEnded,
}

/// What [`Session::retransmission`] makes of a POST's request ids.
#[derive(Debug)]
pub enum Retransmission {
    /// No retained stream carried any of them: not a retransmission.
    NotOne,
    /// Answered as a resume of the stream that carried one.
    Resumed(Resume),
    /// The client's cursor named that stream, and the resume at it was refused.
    Refused(ResumeError),
    /// Without a usable cursor the stream could not be served from its start: this id is a
    /// duplicate of one the session already ran.
    Duplicate(String),
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

/// One step of an attached client's body.
#[derive(Debug)]
pub enum Step {
    /// Bytes to send (holding this many events); more may follow.
    Data(Bytes, u64),
    /// Final bytes (possibly empty); the stream ends after them, for this reason.
    Finish(Bytes, Outcome),
    /// Nothing to send yet; the waker is registered.
    Pending,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Wakes every paused upstream reader of the session (room may have been made): those of
/// `paused`, the streams whose readers paused since the last time (the others have none).
fn wake_readers(paused: &mut Vec<u32>, streams: &mut Streams) {
    for n in paused.drain(..) {
        if let Some(s) = streams.get_mut(&n) {
            s.wake_reader();
        }
    }
}

/// The client of `s` was handed a frame: every event of it up to `last` (`whole` of them),
/// and `partial`, the piece of the oversized event it ends with, if it does.
fn handed(s: &mut Stream, last: u64, whole: bool, partial: Option<(u64, usize)>, now: Instant) {
    if let Some(sub) = s.sub.as_mut() {
        if whole {
            sub.cursor = last;
            sub.has_id = true;
        }
        sub.partial = partial;
    }
    s.sent = s.sent.max(last);
    // Progress: the stall clock restarts. It stops only when the body is polled again and
    // finds nothing to send (`idle_step`): until then the frame may sit unflushed in hyper,
    // which polls again only once it could write most of it. So a client that never takes
    // its last frame is detached like any other that stopped reading.
    s.stall_since = Some(now);
}

/// What the in-flight reserve needs of the session's streams.
impl Delivery for Streams {
    fn reading(&self, stream: u32, now: Instant) -> bool {
        self.get(&stream).is_some_and(|s| {
            s.sub.as_ref().is_some_and(|sub| sub.detach.is_none())
                && s.stall_since
                    .is_none_or(|t| now.duration_since(t) < reserve::INFLIGHT_AGE)
        })
    }

    fn delivered(&mut self, stream: u32, last: u64) -> bool {
        self.get_mut(&stream).is_some_and(|s| {
            let moved = last > s.acked;
            s.acked = s.acked.max(last);
            moved
        })
    }
}

/// What one [`Session::tag_events`] call learns of the window while it makes room, valid for
/// the whole call (the lock is held and one `now` used, so no stream's verdict changes, until
/// batches are aged): how many entries at the front were found needed (not looked at again),
/// and the last stream looked up with the position after which its events must stay (the
/// entries scanned are mostly of one stream). Without it every eviction looked its stream up
/// in the map again (~150 instructions a 200 B event, `bench/callgrind` sse-200-burst), and
/// scanned past another stream's needed events again.
#[derive(Default)]
struct Scan {
    kept: usize,
    last: Option<(u32, Option<u64>)>,
}

/// Records the eviction of `old` against its stream: a resume before it is now a gap.
fn note_eviction(metrics: &Metrics, streams: &mut Streams, old: &Entry) {
    metrics.window_evictions.inc();
    if let Some(o) = streams.get_mut(&old.stream) {
        if old.seq > o.sent {
            metrics.events_evicted_undelivered.inc();
        }
        o.lost_upto = o.lost_upto.max(old.seq);
    }
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
        let epoch = new_epoch();
        let carried = Carried::default();
        let retired = Retired::keyed_as(&carried);
        Session {
            hashed_id: hash_id(&id).into(),
            id,
            epoch,
            id_prefix: batch::id_prefix(epoch),
            state: Mutex::new(State {
                window: Window::new(cfg.window_events, cfg.window_bytes),
                last_seq: 0,
                next_stream: 0,
                streams: Streams::default(),
                ended: VecDeque::new(),
                last_activity: Instant::now(),
                protocol_version: None,
                standalone: None,
                standalone_history: VecDeque::new(),
                hold: Hold::new(),
                closed: false,
                next_generation: 0,
                inflight: Reserve::new(cfg.window_events, cfg.window_bytes),
                forwarded: Forwarded::default(),
                retired,
                carried,
                paused: Vec::new(),
                running: Default::default(),
                closing: Vec::new(),
                // Nothing to watch yet: whatever begins stirs it (see `Registry::sweep`).
                quiet: true,
            }),
            cfg,
            metrics,
            budget,
            principal: Mutex::new(owner.principal),
            endpoint: owner.endpoint,
            share: owner.share,
            minted,
            hold_settled: Notify::new(),
            hold_kick: Arc::new(Notify::new()),
            forward_settled: Notify::new(),
            closed_signal: Notify::new(),
            stirred: Arc::default(),
        }
    }

    /// The session, telling `stirred` when it needs the sweeper again.
    pub(crate) fn stirring(self, stirred: Arc<Stirred>) -> Session {
        Session { stirred, ..self }
    }

    /// Something the sweeper watches began (a client attached, an upstream reader paused,
    /// an oversized event held): a session the last sweep found quiet is visited again at
    /// the next one. Called under the state lock, with its `quiet`.
    fn stir(&self, quiet: &mut bool) {
        if std::mem::take(quiet) {
            lock(&self.stirred.0).push(self.id.clone());
        }
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

    /// The principal (keyed MAC) this session is bound to.
    pub fn principal(&self) -> Principal {
        *lock(&self.principal)
    }

    /// Rebinds the session (after the upstream accepted the caller's new credentials), and
    /// with it what its owner sent.
    pub fn set_principal(&self, p: Principal) {
        // The state first, as everywhere: the principal's own lock is only ever taken alone
        // or inside the state's.
        let mut st = lock(&self.state);
        let mut current = lock(&self.principal);
        let old = std::mem::replace(&mut *current, p);
        drop(current);
        if old != p {
            // The owner's credentials were refreshed: its streams and ids go with it.
            for s in st.streams.values_mut().filter(|s| s.principal == old) {
                s.principal = p;
            }
            st.forwarded.rebind(old, p);
            st.retired.rebind(old, p);
        }
    }

    fn cursor(&self, stream: u32, seq: u64) -> String {
        Cursor {
            epoch: self.epoch,
            stream,
            seq,
        }
        .text()
    }

    /// Records client activity (a request): the TTL counts from the latest one.
    pub fn touch(&self) {
        lock(&self.state).last_activity = Instant::now();
    }

    pub fn protocol_version(&self) -> Option<String> {
        lock(&self.state).protocol_version.clone()
    }

    pub fn set_protocol_version(&self, v: &str) {
        let mut st = lock(&self.state);
        if st.protocol_version.as_deref() != Some(v) {
            st.protocol_version = Some(v.to_owned());
        }
    }

    /// Whether an upstream stream that closed should be resumed upstream: a POST stream with
    /// requests still unanswered, or the standalone stream, while the session lives.
    pub fn wants_more(&self, stream: u32) -> bool {
        let st = lock(&self.state);
        !st.closed
            && st.streams.get(&stream).is_some_and(|s| match s.kind {
                StreamKind::Post => s.requests.iter().any(|r| r.answered_at.is_none()),
                StreamKind::Standalone => true,
            })
    }

    /// Calls (POST streams) of this session still read from the upstream with no client
    /// attached: each holds an upstream connection until it ends (`--max-detached-calls`).
    /// Counted per principal: the quota belongs to whoever left the calls, so nobody else
    /// who knows the session id can use up its owner's.
    pub fn detached_calls(&self, principal: Principal) -> usize {
        let st = lock(&self.state);
        st.running
            .iter()
            .filter_map(|n| st.streams.get(n))
            .filter(|s| {
                s.kind == StreamKind::Post
                    && s.end.is_none()
                    && s.sub.is_none()
                    && s.principal == principal
            })
            .count()
    }

    /// Whether `principal` may resume at `cursor`: a call's stream is only its sender's (the
    /// session's standalone stream is the session's, whose owner the caller was checked to
    /// be). A cursor of no stream the session retains is left to [`Session::resume`] to
    /// refuse.
    pub fn may_resume(&self, cursor: &Cursor, principal: Principal) -> bool {
        if cursor.epoch != self.epoch {
            return true;
        }
        let st = lock(&self.state);
        st.streams
            .get(&cursor.stream)
            .is_none_or(|s| s.kind == StreamKind::Standalone || s.principal == principal)
    }

    /// The trace of the request that opened `stream`, if it was traced.
    pub fn stream_trace(&self, stream: u32) -> Option<TraceParent> {
        lock(&self.state).streams.get(&stream).and_then(|s| s.trace)
    }

    /// Whether the session still holds a live standalone upstream stream.
    pub fn has_standalone(&self) -> bool {
        let st = lock(&self.state);
        st.standalone
            .is_some_and(|s| st.streams.get(&s).is_some_and(|s| s.end.is_none()))
    }

    /// The first event of a stream the client attaches to at `stream`/`seq` (see
    /// [`control::opening`]).
    fn opening_event(
        &self,
        stream: u32,
        seq: u64,
        prime: bool,
        reattach: Option<&Reattach>,
    ) -> Option<Bytes> {
        if !prime && reattach.is_none() {
            return None;
        }
        let here = self.cursor(stream, seq);
        control::opening(&here, stream, prime, reattach, self.cfg.retry_hint)
    }

    /// The `mcp-reattach/stream` event that gives a client an id on a new stream without a
    /// priming event (see [`OpenStream::announce`]).
    fn announcement(&self, stream: u32, seq: u64) -> Bytes {
        control::announce(&self.cursor(stream, seq), stream, self.cfg.retry_hint)
    }

    /// Opens a tagged stream and attaches its first client at the opening position. The
    /// attachment opens with the priming event if asked, or the re-attach event for a
    /// standalone stream opened to serve a client's stale cursor.
    pub fn open_stream(&self, open: OpenStream<'_>) -> Attachment {
        let mut st = lock(&self.state);
        let opened = self.open_locked(&mut st, open, Instant::now());
        drop(st);
        opened.attachment(self)
    }

    /// [`Session::open_stream`] with the lock held: the stream opened, its opening event
    /// still to be written ([`Opened::attachment`]).
    fn open_locked<'a>(&self, st: &mut State, open: OpenStream<'a>, now: Instant) -> Opened<'a> {
        let OpenStream {
            kind,
            requests,
            principal,
            initialize,
            prime,
            announce,
            reattach,
            kill,
            trace,
        } = open;
        let announce = announce && !prime && reattach.is_none();
        st.last_seq += 1;
        let seq = st.last_seq;
        let stream = st.next_stream;
        st.next_stream += 1;
        let generation = st.next_generation;
        st.next_generation += 1;
        let sub = Subscriber::new(
            generation,
            seq,
            kill,
            prime || announce || reattach.is_some(),
        );
        let mut opened = Stream::new(kind, seq, requests, initialize, Some(sub));
        opened.principal = principal;
        opened.trace = trace;
        st.carried.add(stream, &mut opened);
        st.running.insert(stream);
        st.streams.insert(stream, Box::new(opened));
        if kind == StreamKind::Standalone {
            Self::set_standalone(st, stream);
        }
        self.metrics.streams_attached.inc();
        st.last_activity = now;
        self.stir(&mut st.quiet);
        Opened {
            stream,
            generation,
            seq,
            prime,
            announce,
            reattach,
        }
    }

    fn set_standalone(st: &mut State, stream: u32) {
        st.standalone = Some(stream);
        st.standalone_history.push_back(stream);
        if st.standalone_history.len() > STANDALONE_HISTORY {
            st.standalone_history.pop_front();
        }
    }

    /// Remembers the task reading the upstream for `stream`, so closing the session stops it.
    pub fn set_reader(&self, stream: u32, handle: AbortHandle) {
        let mut st = lock(&self.state);
        let closed = st.closed;
        match st.streams.get_mut(&stream) {
            Some(s) if !closed => s.reader = Some(handle),
            _ => handle.abort(),
        }
    }

    /// Makes room in the window for an event of `len` bytes by evicting the oldest events
    /// that no client still needs (skipping over those that some client does). `false` when
    /// every retained event is still needed: the caller must wait (flow control) instead.
    /// `scan` carries what earlier calls of the same [`Session::tag_events`] learned.
    fn make_room(&self, st: &mut State, len: usize, now: Instant, scan: &mut Scan) -> bool {
        let stall = self.cfg.stall_timeout;
        let mut aged = false;
        while !st.window.fits(len) {
            let streams = &st.streams;
            let last = &mut scan.last;
            let evictable = |e: &Entry| {
                let needed_after = match *last {
                    Some((id, n)) if id == e.stream => n,
                    _ => {
                        let n = streams
                            .get(&e.stream)
                            .and_then(|s| s.needed_after(now, stall));
                        *last = Some((e.stream, n));
                        n
                    }
                };
                needed_after.is_none_or(|acked| e.seq <= acked)
            };
            // Past the highest position any stream lets go, nothing is evictable: its
            // `acked` when it guards its events, else its last (a stream's entries are no
            // later than that; every entry's stream is in `streams`, which a stream leaves
            // with its entries).
            let upto = || {
                streams
                    .values()
                    .map(|s| {
                        s.needed_after(now, stall)
                            .unwrap_or(s.last_seq)
                            .min(s.last_seq)
                    })
                    .max()
                    .unwrap_or(u64::MAX)
            };
            match st.window.evict_first(scan.kept, upto, evictable) {
                Some((at, old)) => {
                    scan.kept = at;
                    note_eviction(&self.metrics, &mut st.streams, &old);
                }
                // Batches written long enough ago to a live client count as delivered.
                None if !aged => {
                    st.inflight.age(now, &mut st.streams);
                    aged = true;
                    *scan = Scan::default();
                }
                None => return false,
            }
        }
        true
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
        self.push_locked(&mut lock(&self.state), stream, events, reader, None, now)
    }

    /// [`Session::push_events`] with the lock held; `answers`: the ids of the responses each
    /// event is (`answers[i]`: those of `events[i]`) when read already, so tagging does not
    /// parse the events again for them.
    fn push_locked(
        &self,
        st: &mut State,
        stream: u32,
        events: &mut VecDeque<Event>,
        reader: Option<&Waker>,
        answers: Option<&[Vec<String>]>,
        now: Instant,
    ) -> bool {
        if st.closed || !st.streams.contains_key(&stream) {
            events.clear();
            return true;
        }
        let bytes_before = st.window.bytes();
        let (pushed, learned_version) = self.tag_events(st, stream, events, answers, now);
        events.drain(..pushed);
        self.metrics.events_tagged.inc_by(pushed as u64);
        self.budget.adjust(bytes_before, st.window.bytes());
        if let Some(v) = learned_version {
            st.protocol_version = Some(v);
        }
        let Some(s) = st.streams.get_mut(&stream) else {
            return true;
        };
        let done = Self::wake_or_pause(s, pushed > 0, events.is_empty(), reader, now);
        if !done && reader.is_some() {
            self.stir(&mut st.quiet);
            if !st.paused.contains(&stream) {
                st.paused.push(stream);
            }
        }
        done
    }

    /// Tags `events` of `stream` in order and retains each (in the window, or in the
    /// stream's overflow slot when too large for it) until one finds no room. Returns how
    /// many were taken, and the protocol version an `initialize` answer among them told.
    /// `answers`: the response ids of each event, if already read.
    fn tag_events(
        &self,
        st: &mut State,
        stream: u32,
        events: &mut VecDeque<Event>,
        answers: Option<&[Vec<String>]>,
        now: Instant,
    ) -> (usize, Option<String>) {
        let mut learned_version = None;
        let mut scan = Scan::default();
        for (pushed, ev) in events.iter_mut().enumerate() {
            // The event came in its wire form: room first, then it moves into the window.
            let len = ev.body().len();
            let retained = st.window.retains(len);
            let room = if retained {
                self.make_room(st, len, now, &mut scan)
            } else {
                // Too large for the window: it waits in the stream's one-slot overflow for
                // the attached client, which must first be free, and the memory budget must
                // have room for it (else the reader waits: the sweep wakes it).
                let Some(s) = st.streams.get_mut(&stream) else {
                    return (pushed, learned_version);
                };
                self.free_overflow(s, now) && self.budget.admits_oversized(len)
            };
            if !room {
                return (pushed, learned_version);
            }
            st.last_seq += 1;
            let seq = st.last_seq;
            let Some(s) = st.streams.get_mut(&stream) else {
                return (pushed, learned_version);
            };
            s.tagged(seq);
            let known = answers.and_then(|a| a.get(pushed)).map(Vec::as_slice);
            learned_version = Self::note_answers(s, ev, known, seq).or(learned_version);
            let entry = Entry {
                seq,
                stream,
                message: ev.message(),
                body: ev.take_body().into_boxed_slice(),
            };
            if retained {
                let (streams, metrics) = (&mut st.streams, &self.metrics);
                let _ = st
                    .window
                    .push(entry, |old| note_eviction(metrics, streams, &old));
            } else {
                s.set_overflow(Some(entry), &self.budget);
                self.stir(&mut st.quiet);
            }
        }
        (events.len(), learned_version)
    }

    /// Empties `s`'s overflow slot for a new oversized event, unless the event in it may
    /// still be needed by the stream's client (`false`: the new one waits). An event dropped
    /// from it is lost: a resume before it is a gap.
    fn free_overflow(&self, s: &mut Stream, now: Instant) -> bool {
        match &s.overflow {
            Some(prev) if s.needs(prev.seq, now, self.cfg.stall_timeout) => false,
            Some(_) => {
                self.drop_overflow(s);
                true
            }
            None => true,
        }
    }

    /// Drops the event in `s`'s overflow slot, which no client still needs: it is lost (a
    /// resume before it is a gap), and counted if it was never written whole to a client.
    fn drop_overflow(&self, s: &mut Stream) {
        let Some(prev) = s.overflow.as_ref() else {
            return;
        };
        if prev.seq > s.sent {
            self.metrics.events_evicted_undelivered.inc();
        }
        s.lost_upto = s.lost_upto.max(prev.seq);
        s.set_overflow(None, &self.budget);
    }

    /// Marks the requests of `s` that the event `ev`, tagged `seq`, answers (`known`: the
    /// ids of the responses it is, if already read; else they are read from its data).
    /// Returns the protocol version it tells, if it answers the stream's `initialize`.
    fn note_answers(
        s: &mut Stream,
        ev: &Event,
        known: Option<&[String]>,
        seq: u64,
    ) -> Option<String> {
        if !s.requests.iter().any(|r| r.answered_at.is_none()) {
            return None;
        }
        let mut answered = |rid: &str| {
            if let Some(r) = s
                .requests
                .iter_mut()
                .find(|r| r.id == rid && r.answered_at.is_none())
            {
                r.answered_at = Some(seq);
            }
        };
        if let Some(ids) = known.filter(|_| !s.initialize) {
            ids.iter().for_each(|rid| answered(rid));
            return None;
        }
        // Only now the data: joining a multi-line event's lines is for a stream that waits.
        let data = ev.data_bytes()?;
        let data = &*data;
        for rid in jsonrpc::response_ids(data) {
            answered(&rid);
        }
        if s.initialize {
            jsonrpc::initialize_version(data)
        } else {
            None
        }
    }

    /// After events of `s` were tagged (`pushed`): its stall clock runs and its client is
    /// woken. When some are left (not `done`), registers `reader` to be woken when room may
    /// have been made, and returns `false`.
    fn wake_or_pause(
        s: &mut Stream,
        pushed: bool,
        done: bool,
        reader: Option<&Waker>,
        now: Instant,
    ) -> bool {
        if pushed {
            s.stall_since.get_or_insert(now);
            if let Some(w) = s.sub.as_mut().and_then(|sub| sub.waker.take()) {
                w.wake();
            }
        }
        if done {
            return true;
        }
        if let Some(w) = reader {
            s.paused_reader = Some(w.clone());
        }
        false
    }

    /// Marks `stream` ended by its upstream and wakes its client.
    pub fn end_stream(&self, stream: u32, end: End) {
        self.end_locked(&mut lock(&self.state), stream, end);
    }

    /// [`Session::end_stream`] with the lock held.
    fn end_locked(&self, st: &mut State, stream: u32, end: End) {
        let Some(s) = st.streams.get_mut(&stream) else {
            return;
        };
        s.end = Some(end);
        s.reader = None;
        s.paused_reader = None;
        st.running.remove(&stream);
        if let Some(w) = s.sub.as_mut().and_then(|sub| sub.waker.take()) {
            w.wake();
        }
        if st.standalone == Some(stream) {
            st.standalone = None;
        }
        st.ended.push_back(stream);
        while st.ended.len() > MAX_ENDED_STREAMS {
            let Some(old) = st.ended.pop_front() else {
                break;
            };
            if st.streams.get(&old).is_some_and(|s| s.sub.is_some()) {
                // Still being read by a client: keep it, forget it later.
                st.ended.push_back(old);
                break;
            }
            let Some(mut gone) = st.streams.remove(&old) else {
                continue;
            };
            gone.set_overflow(None, &self.budget);
            st.carried.remove(old, &gone);
            st.retired.retire(&gone);
            let before = st.window.bytes();
            st.window.remove_stream(old, gone.first_seq..=gone.last_seq);
            self.budget.adjust(before, st.window.bytes());
            // Its events no longer hold anything back.
            wake_readers(&mut st.paused, &mut st.streams);
        }
    }

    /// Re-attaches a client to the stream of `cursor` (a `GET` with `Last-Event-ID`).
    pub fn resume(&self, cursor: Cursor, kill: Option<Arc<Notify>>) -> Result<Resume, ResumeError> {
        if cursor.epoch != self.epoch {
            return Err(ResumeError::ForeignCursor);
        }
        let now = Instant::now();
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.last_activity = now;
        let Some(s) = st.streams.get_mut(&cursor.stream) else {
            return Err(if cursor.stream < st.next_stream {
                ResumeError::StreamExpired
            } else {
                ResumeError::CursorAhead
            });
        };
        if cursor.seq > s.last_seq {
            return Err(ResumeError::CursorAhead);
        }
        if cursor.seq < s.first_seq {
            // Not a position of this stream: it cannot have been issued with this stream number.
            return Err(ResumeError::ForeignCursor);
        }
        let here = self.cursor(cursor.stream, cursor.seq);
        if s.lost_upto > cursor.seq {
            // Events written to the client and lost on its way (past the in-flight reserve,
            // in its own buffers) were not counted as undelivered when evicted: they are now.
            let lost = s.lost_in_flight(cursor.seq);
            self.metrics.events_evicted_undelivered.inc_by(lost);
            let ids = s.fail_unanswered(cursor.seq);
            if ids.is_empty() {
                return Err(ResumeError::Gap);
            }
            return Ok(Resume::GapWithErrors {
                frames: control::gap(&here, true, &ids),
            });
        }
        let replay = st.window.after(cursor.stream, cursor.seq).count()
            + usize::from(s.overflow.as_ref().is_some_and(|o| o.seq > cursor.seq));
        if s.end.is_some() && replay == 0 && s.unanswered_after(cursor.seq).next().is_none() {
            // Nothing more will ever come on this stream. A 200 that ends at once would make
            // clients that reconnect streams ending without a result (the TypeScript SDK)
            // loop; a 409 ends their retries.
            return Err(ResumeError::StreamEnded);
        }
        let generation = st.next_generation;
        st.next_generation += 1;
        self.metrics.streams_attached.inc();
        self.metrics.events_replayed.inc_by(replay as u64);
        // The client says where it is: everything after the cursor is needed again, and
        // nothing of this stream is in flight any more.
        s.acked = cursor.seq;
        s.stall_since = Some(now);
        s.awaiting_client = false;
        if let Some(old) = s
            .sub
            .replace(Subscriber::new(generation, cursor.seq, kill, true))
        {
            if let Some(w) = old.waker {
                w.wake();
            }
        }
        self.stir(&mut st.quiet);
        let prelude = control::resumed(&here, cursor.stream, s.kind, replay, s.end.is_some());
        st.inflight.forget(cursor.stream);
        Ok(Resume::Attached {
            attachment: Attachment {
                stream: cursor.stream,
                generation,
                opening: Some(prelude),
            },
            replay,
        })
    }

    /// A standalone-stream cursor that [`Session::resume`] refused with `err`: when the
    /// session outlives that stream (it ended, was forgotten, or lost the events after the
    /// cursor), the client re-attaches to the session instead (see [`Reattach`]). `None`
    /// when the cursor is not a standalone cursor of this session, or the refusal stands.
    pub fn standalone_reattach(&self, cursor: &Cursor, err: ResumeError) -> Option<Reattach> {
        if cursor.epoch != self.epoch {
            return None;
        }
        let st = lock(&self.state);
        let standalone = match st.streams.get(&cursor.stream) {
            Some(s) => s.kind == StreamKind::Standalone,
            None => st.standalone_history.contains(&cursor.stream),
        };
        if !standalone {
            return None;
        }
        let (lost, reason) = match err {
            ResumeError::StreamEnded => (false, "stream-ended"),
            ResumeError::Gap => (true, "gap"),
            ResumeError::StreamExpired => (true, "stream-expired"),
            ResumeError::ForeignCursor | ResumeError::CursorAhead => return None,
        };
        Some(Reattach {
            previous: cursor.to_string(),
            lost,
            reason,
        })
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
        let mut st = lock(&self.state);
        let st = &mut *st;
        if st.forwarded.any_other(principal, ids)
            || st.carried.awaited_by_other(&st.streams, principal, ids)
        {
            return Err(InFlight::Another);
        }
        if !st.forwarded.begin(principal, ids) {
            return Err(InFlight::Own);
        }
        Ok(Forwarding {
            session: self.clone(),
            principal,
            ids: ids.to_vec(),
        })
    }

    /// Waits until no POST of `principal` carrying one of `ids` is in flight.
    pub async fn forward_settled(&self, principal: Principal, ids: &[String]) {
        loop {
            let settled = self.forward_settled.notified();
            if !lock(&self.state).forwarded.any(principal, ids) {
                return;
            }
            settled.await;
        }
    }

    /// Whether `principal` already sent one of `ids` in this session: a retained stream was
    /// started by its POST carrying one, or a forgotten one was.
    pub fn carries_any(&self, principal: Principal, ids: &[String]) -> bool {
        let st = lock(&self.state);
        st.carried.carrier(&st.streams, principal, ids).is_some()
            || st.retired.find(principal, ids).is_some()
    }

    /// A POST whose request ids include one already carried by a retained stream of this
    /// session is a retransmission (MCP forbids reusing an id within a session): it is
    /// answered as a resume of that stream, never forwarded. With `cursor` naming that
    /// stream the resume is exact; without a usable cursor it starts at the stream's opening
    /// position, which is only served if nothing of the stream was lost (see
    /// [`Retransmission`]).
    pub fn retransmission(
        &self,
        principal: Principal,
        ids: &[String],
        cursor: Option<Cursor>,
        kill: Option<Arc<Notify>>,
    ) -> Retransmission {
        let carrier = {
            let st = lock(&self.state);
            match st.carried.carrier(&st.streams, principal, ids) {
                Some(c) => c,
                // Its stream is forgotten: refused, never run twice.
                None => match st.retired.find(principal, ids) {
                    Some(dup) => return Retransmission::Duplicate(dup.to_owned()),
                    None => return Retransmission::NotOne,
                },
            }
        };
        let exact = cursor.filter(|c| c.epoch == self.epoch && c.stream == carrier.stream);
        let at = exact.unwrap_or(Cursor {
            epoch: self.epoch,
            stream: carrier.stream,
            seq: carrier.first_seq,
        });
        match self.resume(at, kill) {
            Ok(r) => Retransmission::Resumed(r),
            Err(e) if exact.is_some() => Retransmission::Refused(e),
            Err(_) => Retransmission::Duplicate(carrier.id.to_owned()),
        }
    }

    /// Attaches a client without a cursor to the held standalone stream, replacing any
    /// older client: it gets every retained event of the stream that was never written to a
    /// client (server messages sent before its `GET` arrived, or while no client was
    /// attached), then the live tail. The first event is the priming event (if `prime`) or,
    /// for a client re-attaching with a stale cursor, the control event saying so. Returns
    /// `None` when no standalone stream is held.
    pub fn attach_standalone(
        &self,
        prime: bool,
        reattach: Option<&Reattach>,
        kill: Option<Arc<Notify>>,
    ) -> Option<Attachment> {
        let now = Instant::now();
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.last_activity = now;
        let stream = st.standalone?;
        let s = st.streams.get_mut(&stream)?;
        if s.end.is_some() {
            return None;
        }
        // A held stream the upstream ended before any client came, with messages on it: they
        // are gone with it. Say so (once) instead of opening as if nothing was missed.
        let mut orphaned = None;
        for (&n, o) in st.streams.iter_mut() {
            if o.kind == StreamKind::Standalone
                && o.end.is_some()
                && o.awaiting_client
                && o.last_seq > o.first_seq
            {
                o.awaiting_client = false;
                orphaned = Some(Reattach {
                    previous: self.cursor(n, o.first_seq),
                    lost: true,
                    reason: "standalone-ended-unread",
                });
            }
        }
        let reattach = reattach.or(orphaned.as_ref());
        let s = st.streams.get_mut(&stream)?;
        let generation = st.next_generation;
        st.next_generation += 1;
        // What some client was already sent is not sent again; the new client is the
        // stream's client now, so nothing before that is held back for anyone any more.
        let at = s.sent;
        self.metrics.streams_attached.inc();
        s.awaiting_client = false;
        s.acked = s.acked.max(at);
        s.stall_since = (s.last_seq > at).then_some(now);
        let has_id = prime || reattach.is_some();
        if let Some(old) = s.sub.replace(Subscriber::new(generation, at, kill, has_id)) {
            if let Some(w) = old.waker {
                w.wake();
            }
        }
        self.stir(&mut st.quiet);
        Some(Attachment {
            stream,
            generation,
            opening: self.opening_event(stream, at, prime, reattach),
        })
    }

    /// The next step for the client `generation` attached to `stream`.
    pub fn poll_step(&self, stream: u32, generation: u64, waker: &Waker) -> Step {
        let now = Instant::now();
        self.step_locked(&mut lock(&self.state), stream, generation, waker, now)
    }

    /// [`Session::poll_step`] with the lock held, at `now`.
    fn step_locked(
        &self,
        st: &mut State,
        stream: u32,
        generation: u64,
        waker: &Waker,
        now: Instant,
    ) -> Step {
        if st.closed {
            let last = st
                .closing
                .iter()
                .position(|&(s, g, _)| s == stream && g == generation)
                .map_or_else(Bytes::new, |i| st.closing.swap_remove(i).2);
            return Step::Finish(last, Outcome::SessionClosed);
        }
        let Some(s) = st.streams.get_mut(&stream) else {
            return Step::Finish(Bytes::new(), Outcome::SessionClosed);
        };
        let Some(sub) = s.sub.as_ref().filter(|sub| sub.generation == generation) else {
            return Step::Finish(Bytes::new(), Outcome::Replaced);
        };
        let (cursor, has_id, partial) = (sub.cursor, sub.has_id, sub.partial);
        if let Some((_, why)) = sub.detach {
            s.sub = None;
            st.last_activity = now;
            if partial.is_some() {
                // Part-way through an event: anything written now would be read as its rest.
                // The body just ends; the client resumes from its last whole event.
                return Step::Finish(Bytes::new(), why);
            }
            let here = self.cursor(stream, cursor);
            let frame = control::resumption_required(&here, why, self.cfg.retry_hint);
            return Step::Finish(frame, why);
        }
        if s.lost_upto > cursor {
            s.sub = None;
            if partial.is_some() {
                return Step::Finish(Bytes::new(), Outcome::Gap);
            }
            // This client fell behind the window: the same explicit failure as a late resume.
            let ids = s.fail_unanswered(cursor);
            let frames = control::gap(&self.cursor(stream, cursor), has_id, &ids);
            return Step::Finish(frames, Outcome::Gap);
        }
        // Polled again after the frame that ended the oversized event: hyper took it, so its
        // slot's bytes leave the budget now, not when it was handed over.
        let room = self.hand_over_overflow(s, cursor);
        let from = match (partial, s.overflow.as_ref()) {
            (None, _) => 0,
            (Some((seq, at)), Some(o)) if o.seq == seq => at,
            // Part-way through an event that is no longer held: it cannot be finished.
            (Some(_), _) => {
                s.sub = None;
                return Step::Finish(Bytes::new(), Outcome::Gap);
            }
        };
        let (overflow, limits) = (s.overflow.as_ref(), st.inflight.limits());
        // Nothing of this stream after the cursor (the usual poll after a batch was written:
        // no event is later than the stream's last): no batch to look for (an empty one was
        // ~450 instructions, three a resume, `bench/callgrind` storm).
        let nothing_new = partial.is_none() && cursor >= s.last_seq;
        let batch = (!nothing_new)
            .then(|| {
                Batch::collect(
                    &self.id_prefix,
                    &st.window,
                    stream,
                    cursor,
                    overflow.map(|o| (o, from)),
                    limits,
                )
            })
            .filter(|b| !b.out.is_empty());
        let Some(batch) = batch else {
            let step = self.idle_step(s, stream, cursor, has_id, waker);
            if room {
                wake_readers(&mut st.paused, &mut st.streams);
            }
            return step;
        };
        handed(s, batch.last, batch.events > 0, batch.partial, now);
        let moved = st.inflight.record(
            stream,
            batch.last,
            batch.events,
            batch.out.len(),
            now,
            &mut st.streams,
        );
        if room || moved {
            wake_readers(&mut st.paused, &mut st.streams);
        }
        Step::Data(batch.out.freeze(), batch.events as u64)
    }

    /// Empties the overflow slot of `s` once its client at `cursor` was handed all of its
    /// event and its body was polled again: from now on a resume before it is a gap. Returns
    /// whether it did (room was made).
    fn hand_over_overflow(&self, s: &mut Stream, cursor: u64) -> bool {
        let Some(o) = s.overflow.as_ref().filter(|o| o.seq <= cursor) else {
            return false;
        };
        s.lost_upto = s.lost_upto.max(o.seq);
        s.set_overflow(None, &self.budget);
        true
    }

    /// The step of a client at `cursor` of `s` (number `stream`) with nothing to send: it
    /// waits for more, or, when the upstream ended the stream, its body ends (with an error
    /// for each request the client has not seen answered).
    fn idle_step(
        &self,
        s: &mut Stream,
        stream: u32,
        cursor: u64,
        has_id: bool,
        waker: &Waker,
    ) -> Step {
        s.stall_since = None;
        let Some(end) = s.end.clone() else {
            if let Some(sub) = s.sub.as_mut() {
                sub.waker = Some(waker.clone());
            }
            return Step::Pending;
        };
        s.sub = None;
        let ids = s.fail_unanswered(cursor);
        if matches!(end, End::Complete) && ids.is_empty() {
            return Step::Finish(Bytes::new(), Outcome::Completed);
        }
        let here = self.cursor(stream, cursor);
        let frames = control::upstream_ended(&here, has_id, &end, &ids);
        Step::Finish(frames, Outcome::UpstreamFailed)
    }

    /// Tells every attached client of streams of `kind` (all, if `None`) to resume elsewhere.
    fn end_clients(&self, kind: Option<StreamKind>) {
        let now = Instant::now();
        let mut st = lock(&self.state);
        for s in st
            .streams
            .values_mut()
            .filter(|s| kind.is_none_or(|k| k == s.kind))
        {
            if let Some(sub) = s.sub.as_mut().filter(|sub| sub.detach.is_none()) {
                sub.detach = Some((now, Outcome::Shutdown));
                if let Some(w) = sub.waker.take() {
                    w.wake();
                }
            }
        }
    }

    /// The client `generation` of `stream` went away (its body was dropped). Its stream's
    /// undelivered events stay guarded for `--stall-timeout` from its last progress.
    pub fn detach(&self, stream: u32, generation: u64) {
        self.detach_locked(&mut lock(&self.state), stream, generation, Instant::now());
    }

    /// [`Session::detach`] with the lock held.
    fn detach_locked(&self, st: &mut State, stream: u32, generation: u64, now: Instant) {
        self.metrics.streams_detached.inc();
        st.last_activity = now;
        if let Some(s) = st.streams.get_mut(&stream) {
            if s.sub
                .as_ref()
                .is_some_and(|sub| sub.generation == generation)
            {
                s.sub = None;
                s.stall_since.get_or_insert(now);
            }
        }
    }

    /// Drops all state: stops upstream readers, ends attached clients, frees the window.
    fn close(&self) {
        let mut st = lock(&self.state);
        st.closed = true;
        st.hold.abort();
        self.budget.adjust(st.window.bytes(), 0);
        st.window = Window::new(1, 0);
        let mut closing = Vec::new();
        for (&n, s) in st.streams.iter_mut() {
            s.set_overflow(None, &self.budget);
            if let Some(r) = s.reader.take() {
                r.abort();
            }
            if let Some(sub) = s.sub.as_ref() {
                let (generation, at, has_id) = (sub.generation, sub.cursor, sub.has_id);
                // Part-way through an event, a client can be given nothing more: its body
                // just ends (see `poll_step`).
                let last = if sub.partial.is_some() {
                    Bytes::new()
                } else {
                    let ids = s.fail_unanswered(at);
                    control::session_closed(&self.cursor(n, at), has_id, &ids)
                };
                closing.push((n, generation, last));
            }
            if let Some(w) = s.sub.as_mut().and_then(|sub| sub.waker.take()) {
                w.wake();
            }
        }
        st.closing = closing;
        st.streams.clear();
        st.carried.clear();
        st.paused.clear();
        st.running.clear();
        st.inflight.clear();
        drop(st);
        self.closed_signal.notify_waiters();
    }

    /// Sweep work for one session: detaches clients that made no progress for the stall
    /// budget, closes connections stuck writing, frees oversized events no client may come
    /// back for any more, and wakes paused upstream readers (a guard may have run out, or the
    /// memory budget have room again). Returns whether the session is idle (no client
    /// attached), since when, and whether it is quiet: no client, no paused reader and no
    /// oversized event held, so nothing for a sweep to do until its TTL may have run out
    /// (the session says when that changes: [`Session::stir`]).
    fn sweep(&self, now: Instant) -> Swept {
        let stall = self.cfg.stall_timeout;
        let mut st = lock(&self.state);
        let st = &mut *st;
        let mut attached = false;
        let mut watched = false;
        for s in st.streams.values_mut() {
            watched |= s.paused_reader.is_some();
            s.wake_reader();
            if s.overflow
                .as_ref()
                .is_some_and(|o| !s.needs(o.seq, now, stall))
            {
                self.drop_overflow(s);
            }
            watched |= s.overflow.is_some();
            let stall_since = s.stall_since;
            let Some(sub) = s.sub.as_mut() else { continue };
            attached = true;
            match sub.detach {
                Some((at, _)) if now.duration_since(at) >= Duration::from_secs(1) => {
                    // The body was not polled since it was flagged: the connection is stuck
                    // writing. Close it; the client resumes from its last complete event.
                    if let Some(k) = sub.kill.take() {
                        k.notify_one();
                    }
                }
                Some(_) => {}
                None => {
                    if stall_since.is_some_and(|t| now.duration_since(t) >= stall) {
                        sub.detach = Some((now, Outcome::SlowConsumer));
                        self.metrics.slow_consumer_detaches.inc();
                        if let Some(w) = sub.waker.take() {
                            w.wake();
                        }
                    }
                }
            }
        }
        st.quiet = !attached && !watched;
        Swept {
            idle: !attached,
            since: st.last_activity,
            quiet: st.quiet,
        }
    }

    /// Retained window events and bytes (for tests and metrics).
    pub fn window_usage(&self) -> (usize, usize) {
        let st = lock(&self.state);
        (st.window.len(), st.window.bytes())
    }

    /// Evicts this session's oldest events until `excess` bytes are freed (the global budget
    /// is exceeded and no idle session is left to shed). Evicted events become gaps.
    fn trim(&self, excess: usize) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let before = st.window.bytes();
        while before - st.window.bytes() < excess {
            let Some(old) = st.window.evict_oldest() else {
                break;
            };
            note_eviction(&self.metrics, &mut st.streams, &old);
        }
        self.budget.adjust(before, st.window.bytes());
    }

    /// Since when no client has been attached, or `None` while one is.
    /// Since when the session has had no client attached (`None`: one is), and whether a
    /// client may still come back for something: a call still running upstream, or events
    /// not yet delivered within the stall budget. The session cap sheds the others first.
    fn idle_since(&self) -> Option<(bool, Instant)> {
        let st = lock(&self.state);
        if st.streams.values().any(|s| s.sub.is_some()) {
            return None;
        }
        let now = Instant::now();
        let wanted = st.streams.values().any(|s| {
            let running = s.end.is_none() && s.requests.iter().any(|r| r.answered_at.is_none());
            running || s.needs(s.last_seq, now, self.cfg.stall_timeout)
        });
        Some((wanted, st.last_activity))
    }

    /// Clients attached to this session's streams now.
    pub fn attached_clients(&self) -> usize {
        lock(&self.state)
            .streams
            .values()
            .filter(|s| s.sub.is_some())
            .count()
    }
}

#[cfg(test)]
mod tests;
