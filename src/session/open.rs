//! Opening streams: a client's tagged stream, its first client attached at once, and the
//! standalone stream the gateway holds for a client to come, with the holder's phases around
//! it (the [`Hold`](super::hold::Hold) state machine, stepped under the session's lock).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::hold::{Attempt, HoldStart, Phase};
use super::state::{Books, Consts, State};
use super::stream::{Stream, StreamKind, Subscriber};
use super::{Attachment, Principal, Reattach, TraceParent};

/// Standalone stream numbers a session remembers after their metadata is forgotten, so a
/// client's very old standalone cursor still re-attaches to the session.
pub(super) const STANDALONE_HISTORY: usize = 8;

/// What [`Session::open_stream`](super::Session::open_stream) opens, and how its first client
/// is attached.
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

/// A stream just opened under the session's lock, its first client's opening event still to
/// be written (formatting it needs no lock).
pub(super) struct Opened<'a> {
    pub stream: u32,
    pub generation: u64,
    /// The opening position.
    seq: u64,
    prime: bool,
    announce: bool,
    reattach: Option<&'a Reattach>,
    /// What formatting the opening event needs, copied out of the state.
    consts: Consts,
}

impl Opened<'_> {
    /// The first client's attachment, with its opening event.
    pub(super) fn attachment(&self) -> Attachment {
        let opening = if self.announce {
            Some(self.consts.announcement(self.stream, self.seq))
        } else {
            self.consts
                .opening_event(self.stream, self.seq, self.prime, self.reattach)
        };
        Attachment {
            stream: self.stream,
            generation: self.generation,
            opening,
        }
    }
}

impl State {
    /// Opens a tagged stream and attaches its first client at the opening position: the
    /// stream opened, its opening event still to be written ([`Opened::attachment`]).
    pub(super) fn open<'a>(
        &mut self,
        books: Books<'_>,
        open: OpenStream<'a>,
        now: Instant,
    ) -> Opened<'a> {
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
        self.last_seq += 1;
        let seq = self.last_seq;
        let stream = self.next_stream;
        self.next_stream += 1;
        let generation = self.next_generation;
        self.next_generation += 1;
        let sub = Subscriber::new(
            generation,
            seq,
            kill,
            prime || announce || reattach.is_some(),
        );
        let mut opened = Stream::new(kind, seq, requests, initialize, Some(sub));
        opened.principal = principal;
        opened.trace = trace;
        self.carried.add(stream, &mut opened);
        self.running.insert(stream);
        self.streams.insert(stream, Box::new(opened));
        if kind == StreamKind::Standalone {
            self.set_standalone(stream);
        }
        books.metrics.streams_attached.inc();
        self.last_activity = now;
        self.stir();
        Opened {
            stream,
            generation,
            seq,
            prime,
            announce,
            reattach,
            consts: self.consts,
        }
    }

    fn set_standalone(&mut self, stream: u32) {
        self.standalone = Some(stream);
        self.standalone_history.push_back(stream);
        if self.standalone_history.len() > STANDALONE_HISTORY {
            self.standalone_history.pop_front();
        }
    }

    /// Remembers the task reading the upstream for `stream`, so closing the session stops it
    /// (a closed session, or a stream gone, stops it now).
    pub(super) fn set_reader(&mut self, stream: u32, handle: AbortHandle) {
        let closed = self.closed;
        match self.streams.get_mut(&stream) {
            Some(s) if !closed => s.reader = Some(handle),
            _ => handle.abort(),
        }
    }

    /// Opens the standalone stream the gateway holds for the session's client (none attached
    /// yet: its events are kept for the first client's `GET`). `None` if the session closed
    /// or a client's own standalone stream got there first (the holder then ends).
    pub(super) fn open_held_standalone(&mut self) -> Option<u32> {
        let opened = (!self.closed && !self.live_standalone()).then(|| {
            self.last_seq += 1;
            let seq = self.last_seq;
            let stream = self.next_stream;
            self.next_stream += 1;
            self.streams.insert(
                stream,
                Box::new(Stream::new(
                    StreamKind::Standalone,
                    seq,
                    Vec::new(),
                    false,
                    None,
                )),
            );
            self.running.insert(stream);
            self.set_standalone(stream);
            stream
        });
        self.hold.phase = if opened.is_some() {
            Phase::Holding
        } else {
            Phase::Idle
        };
        opened
    }

    /// Asks for the held stream now: starts the holder (`Idle`), or cuts a waiting holder's
    /// wait short (`Backoff`, `Resting`). Either way the phase is `Opening` when this returns
    /// something but [`HoldStart::Nothing`].
    pub(super) fn hold_start(&mut self) -> HoldStart {
        if self.closed || self.live_standalone() {
            return HoldStart::Nothing;
        }
        let start = match self.hold.phase {
            Phase::Idle => HoldStart::Spawn,
            Phase::Backoff | Phase::Resting => HoldStart::Kicked,
            Phase::Opening | Phase::Holding | Phase::Unsupported => return HoldStart::Nothing,
        };
        self.hold.phase = Phase::Opening;
        start
    }

    /// After a client's own standalone stream `stream` ended: how long the holder should wait
    /// before opening a new one (it is then `Resting`). `None`: not a standalone stream, or
    /// the session is closed, holds another, or a holder runs.
    pub(super) fn hold_after_client_stream(&mut self, stream: u32) -> Option<Duration> {
        if self.hold.phase != Phase::Idle {
            return None;
        }
        let delay = self.rest_delay(stream)?;
        self.hold.phase = Phase::Resting;
        Some(delay)
    }

    /// Remembers the holder task, so closing the session stops it (a closed session stops it
    /// now).
    pub(super) fn set_holder(&mut self, handle: AbortHandle) {
        if self.closed {
            handle.abort();
        } else {
            self.hold.set_task(handle);
        }
    }

    /// The holder, at the top of an attempt: `false` when there is nothing left to do (the
    /// session closed, or a client's own standalone stream got there first).
    pub(super) fn hold_attempt(&mut self) -> bool {
        let go = !self.closed && !self.live_standalone();
        self.hold.phase = if go { Phase::Opening } else { Phase::Idle };
        go
    }

    /// The holder, after an attempt that opened nothing: the phase `attempt` leads to.
    pub(super) fn hold_failed(&mut self, attempt: Attempt) {
        self.hold.phase = match attempt {
            Attempt::Unsupported => Phase::Unsupported,
            Attempt::Retry => Phase::Backoff,
            Attempt::GiveUp => Phase::Idle,
        };
    }

    /// The holder, after its held stream `stream` ended: how long to rest before reopening
    /// it (`None`: the session closed or holds another; the holder then ends).
    pub(super) fn hold_rest(&mut self, stream: u32) -> Option<Duration> {
        let delay = self.rest_delay(stream);
        self.hold.phase = if delay.is_some() {
            Phase::Resting
        } else {
            Phase::Idle
        };
        delay
    }

    /// The delay before reopening after the standalone stream `stream` ended: short when it
    /// carried events, doubling while the upstream keeps ending empty ones.
    fn rest_delay(&mut self, stream: u32) -> Option<Duration> {
        let carried = self
            .streams
            .get(&stream)
            .filter(|s| s.kind == StreamKind::Standalone)
            .map(|s| s.last_seq > s.first_seq)?;
        if self.closed || self.standalone.is_some() {
            return None;
        }
        Some(self.hold.rest(carried))
    }
}
