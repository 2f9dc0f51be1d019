//! The state behind a session's one lock: [`State`], the invariants it keeps, the constants
//! its rules need ([`Consts`]) and where they count what they did beyond the session
//! ([`Books`]). The rules themselves are `impl State` blocks by concern (`open`, `tag`,
//! `resume`, `deliver`, `life`, `whole`). Pure: no locks, no I/O, no runtime needed.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::dedup::{Carried, Forwarded, Retired};
use super::hold::Hold;
use super::reserve::Reserve;
use super::stream::{StreamKind, Streams};
use super::{batch, control, Budget, Principal, Reattach, TraceParent};
use crate::config::Config;
use crate::cursor::Cursor;
use crate::metrics::Metrics;
use crate::window::Window;

/// What a session's rules need of the configuration and of the session's identity, fixed for
/// its life.
#[derive(Clone, Copy, Debug)]
pub(super) struct Consts {
    /// The session's epoch: every cursor it issues names it.
    pub epoch: u64,
    /// `id: <epoch hex>.`: how every event id line this session writes begins.
    pub id_prefix: [u8; 21],
    /// The window's (and the in-flight reserve's) limits.
    pub window_events: usize,
    pub window_bytes: usize,
    /// `--stall-timeout`: how long a client may make no progress before it is detached, and
    /// how long a detached client's undelivered events stay guarded.
    pub stall: Duration,
    /// The `retry:` hint of the gateway's own events.
    pub retry_hint: Option<Duration>,
}

impl Consts {
    pub(super) fn new(cfg: &Config, epoch: u64) -> Consts {
        Consts {
            epoch,
            id_prefix: batch::id_prefix(epoch),
            window_events: cfg.window_events,
            window_bytes: cfg.window_bytes,
            stall: cfg.stall_timeout,
            retry_hint: cfg.retry_hint,
        }
    }

    /// The cursor (event id) of position `seq` of `stream`.
    pub(super) fn cursor(&self, stream: u32, seq: u64) -> String {
        Cursor {
            epoch: self.epoch,
            stream,
            seq,
        }
        .text()
    }

    /// The first event of a stream the client attaches to at `stream`/`seq` (see
    /// [`control::opening`]).
    pub(super) fn opening_event(
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
        control::opening(&here, stream, prime, reattach, self.retry_hint)
    }

    /// The `mcp-reattach/stream` event that gives a client an id on a new stream without a
    /// priming event (see `OpenStream::announce`).
    pub(super) fn announcement(&self, stream: u32, seq: u64) -> Bytes {
        control::announce(&self.cursor(stream, seq), stream, self.retry_hint)
    }
}

/// Where the rules count what they did beyond the session: the gateway's metrics, and the
/// memory budget all sessions share. The shell's `Arc`s, lent for one call.
#[derive(Clone, Copy, Debug)]
pub(super) struct Books<'a> {
    pub metrics: &'a Metrics,
    pub budget: &'a Budget,
}

/// A session's state, behind its one lock; its rules are its methods.
///
/// Invariants (every rule keeps them; a rule that breaks one is the bug):
///
/// - Positions: `last_seq` is the last position issued, session-wide and in order, never
///   reused; every stream's `first_seq..=last_seq`, every retained event and every client's
///   cursor is at or before it. `next_stream` and `next_generation` are past every stream
///   number and client generation issued: a client is named by (stream, generation), and a
///   later attachment to a stream replaces the earlier.
/// - Retention: every event in `window` (and in a stream's overflow slot) belongs to a stream
///   in `streams`; a stream leaves `streams` with its events. An event after its stream's
///   `acked`, whose client may still come back for it (within `--stall-timeout` of its last
///   progress), is never evicted: the upstream reader waits instead. An event evicted or
///   dropped raises its stream's `lost_upto`, so a resume before it is an explicit gap.
/// - Bookkeeping beside `streams`: `running` is exactly the streams not ended; `ended` lists
///   the ended ones in the order they ended, at most `MAX_ENDED_STREAMS` (`life`) of them retained
///   but those a client still reads; `carried` indexes exactly the request ids of the
///   retained streams, `retired` those of the forgotten ones; every stream with a paused
///   reader is in `paused`.
/// - Standalone: `standalone`, when set, is a retained standalone stream not ended;
///   `standalone_history` holds the last `STANDALONE_HISTORY` (`open`) standalone stream numbers.
/// - Principal: `principal` is whom the session is bound to; its streams and forwarded ids
///   follow it when it is rebound.
/// - Budget: what `window` and the overflow slots hold is what the session counts in the
///   shared memory budget ([`Books::budget`]), adjusted with every change.
/// - Quiet: `quiet` is set only by a sweep that found nothing to watch; whatever begins
///   that a sweep watches clears it ([`State::stir`]), and the shell then tells the registry.
/// - Closed: once `closed`, always; `streams`, `carried`, `running`, `paused` and `inflight`
///   are empty, the window holds nothing, and `closing` holds the last frames of the clients
///   that were attached.
#[derive(Debug)]
pub(super) struct State {
    pub consts: Consts,
    /// Keyed hash of the principal the session is bound to (see `proxy`).
    pub principal: Principal,
    pub window: Window,
    pub last_seq: u64,
    pub next_stream: u32,
    pub streams: Streams,
    pub ended: VecDeque<u32>,
    pub last_activity: Instant,
    pub protocol_version: Option<String>,
    pub standalone: Option<u32>,
    pub standalone_history: VecDeque<u32>,
    pub hold: Hold,
    pub closed: bool,
    pub next_generation: u64,
    /// The in-flight reserve: the most recent batches written to clients (any stream).
    pub inflight: Reserve,
    /// Request ids of POSTs forwarded and not yet settled.
    pub forwarded: Forwarded,
    /// Request ids of streams no longer retained.
    pub retired: Retired,
    /// Which of `streams` carried each request id.
    pub carried: Carried,
    /// Streams whose upstream reader paused since [`State::wake_readers`] last ran (some may
    /// have been woken since, or be gone): a session retains many ended streams, which have
    /// none.
    pub paused: Vec<u32>,
    /// The streams of `streams` not ended yet: a session retains many ended ones.
    pub running: BTreeSet<u32>,
    /// The last frames of the clients attached when the session closed, by (stream,
    /// generation): each learns explicitly that its calls will not be answered.
    pub closing: Vec<(u32, u64, Bytes)>,
    /// The last sweep found nothing to watch (see [`State::sweep`]): the registry's sweeper
    /// skips the session until its TTL could run out, unless told otherwise ([`State::stir`]).
    pub quiet: bool,
}

impl State {
    /// A session's state at its start, bound to `principal`, its last activity `now`.
    pub(super) fn new(consts: Consts, principal: Principal, now: Instant) -> State {
        let carried = Carried::default();
        let retired = Retired::keyed_as(&carried);
        State {
            consts,
            principal,
            window: Window::new(consts.window_events, consts.window_bytes),
            last_seq: 0,
            next_stream: 0,
            streams: Streams::default(),
            ended: VecDeque::new(),
            last_activity: now,
            protocol_version: None,
            standalone: None,
            standalone_history: VecDeque::new(),
            hold: Hold::new(),
            closed: false,
            next_generation: 0,
            inflight: Reserve::new(consts.window_events, consts.window_bytes),
            forwarded: Forwarded::default(),
            retired,
            carried,
            paused: Vec::new(),
            running: BTreeSet::new(),
            closing: Vec::new(),
            // Nothing to watch yet: whatever begins stirs it (see `Registry::sweep`).
            quiet: true,
        }
    }

    /// Something the sweeper watches began (a client attached, an upstream reader paused,
    /// an oversized event held): a session the last sweep found quiet is visited again at
    /// the next one. The shell sees `quiet` go and tells the registry (`Session::with_state`).
    pub(super) fn stir(&mut self) {
        self.quiet = false;
    }

    /// Wakes every paused upstream reader of the session (room may have been made): those of
    /// `paused`, the streams whose readers paused since the last time (the others have none).
    pub(super) fn wake_readers(&mut self) {
        for n in self.paused.drain(..) {
            if let Some(s) = self.streams.get_mut(&n) {
                s.wake_reader();
            }
        }
    }

    /// Rebinds the session (after the upstream accepted the caller's new credentials), and
    /// with it what its owner sent.
    pub(super) fn set_principal(&mut self, p: Principal) {
        let old = std::mem::replace(&mut self.principal, p);
        if old != p {
            // The owner's credentials were refreshed: its streams and ids go with it.
            for s in self.streams.values_mut().filter(|s| s.principal == old) {
                s.principal = p;
            }
            self.forwarded.rebind(old, p);
            self.retired.rebind(old, p);
        }
    }

    /// Records `v` as the session's protocol version (allocating only when it changed).
    pub(super) fn set_protocol_version(&mut self, v: &str) {
        // What a client sends is kept only when it is a version: bounded, plain characters
        // (a 100 KB "version" would be held here and in the session's record in the store).
        if !crate::jsonrpc::is_protocol_version(v) {
            return;
        }
        if self.protocol_version.as_deref() != Some(v) {
            self.protocol_version = Some(v.to_owned());
        }
    }

    /// The trace of the request that opened `stream`, if it was traced.
    pub(super) fn stream_trace(&self, stream: u32) -> Option<TraceParent> {
        self.streams.get(&stream).and_then(|s| s.trace)
    }

    /// Whether the session still holds a live standalone upstream stream.
    pub(super) fn live_standalone(&self) -> bool {
        self.standalone
            .is_some_and(|s| self.streams.get(&s).is_some_and(|s| s.end.is_none()))
    }

    /// Whether an upstream stream that closed should be resumed upstream: a POST stream with
    /// requests still unanswered, or the standalone stream, while the session lives.
    pub(super) fn wants_more(&self, stream: u32) -> bool {
        !self.closed
            && self.streams.get(&stream).is_some_and(|s| match s.kind {
                StreamKind::Post => s.requests.iter().any(|r| r.answered_at.is_none()),
                StreamKind::Standalone => true,
            })
    }

    /// Calls (POST streams) still read from the upstream with no client attached, of
    /// `principal` (see `Session::detached_calls`).
    pub(super) fn detached_calls(&self, principal: Principal) -> usize {
        self.running
            .iter()
            .filter_map(|n| self.streams.get(n))
            .filter(|s| {
                s.kind == StreamKind::Post
                    && s.end.is_none()
                    && s.sub.is_none()
                    && s.principal == principal
            })
            .count()
    }

    /// Clients attached to this session's streams now.
    pub(super) fn attached_clients(&self) -> usize {
        self.streams.values().filter(|s| s.sub.is_some()).count()
    }
}
