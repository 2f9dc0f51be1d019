//! Sessions: the registry of live sessions and, per session, its streams, its window and
//! the clients attached to its streams.
//!
//! This is where the product's rules live: tagging (session-wide sequence numbers), bounded
//! retention, detach without loss, re-attach strictly after a cursor, explicit gaps, stall
//! detection and TTL expiry. It knows the SSE codec, the cursor format and the window; it
//! knows nothing of HTTP requests or sockets (the proxy layer calls it, the attach body reads
//! from it). Locks are `std::sync::Mutex`, held briefly and never across an `.await`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::config::Config;
use crate::cursor::{new_epoch, Cursor};
use crate::jsonrpc;
use crate::metrics::Metrics;
use crate::sse::{self, Event};
use crate::window::{Entry, Window};

/// Ended streams whose metadata (pending request ids, loss marks) a session keeps so that a
/// late resume of them still gets an exact answer. Older ended streams are forgotten.
const MAX_ENDED_STREAMS: usize = 64;

/// Most bytes of retained events one poll of an attached client copies into a single frame.
const BATCH_BYTES: usize = 64 * 1024;

/// Event types of the gateway's own control events (never `message`, so clients that do
/// not know them ignore their data).
pub const EVENT_RESUMED: &str = "mcp-reattach/resumed";
pub const EVENT_RESUMPTION_FAILED: &str = "mcp-reattach/resumption-failed";
pub const EVENT_RESUMPTION_REQUIRED: &str = "mcp-reattach/resumption-required";
pub const EVENT_UPSTREAM_FAILED: &str = "mcp-reattach/upstream-failed";

/// What started a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// The SSE response to a POST; it ends after the upstream's response.
    Post,
    /// The standalone GET stream, held open upstream while the session lives.
    Standalone,
}

/// How an upstream stream ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// The upstream ended the response normally.
    Complete,
    /// The upstream's stream failed (connection error, invalid or oversized event).
    UpstreamFailed(String),
}

/// Why a session's state was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eviction {
    Ttl,
    Delete,
    Upstream404,
    SessionCap,
    MemoryBudget,
}

/// A JSON-RPC request carried by the POST that started a stream.
#[derive(Debug)]
struct PendingRequest {
    /// The request id as canonical JSON text.
    id: String,
    /// Sequence number of the event that carried its response, once seen.
    answered_at: Option<u64>,
    /// The gateway already answered it with an error (gap, upstream failure); a client that
    /// reconnects after that error is not told again.
    reported: bool,
}

#[derive(Debug)]
struct Subscriber {
    generation: u64,
    /// Sequence number of the last event handed to this client.
    cursor: u64,
    waker: Option<Waker>,
    /// Since when this client has had unsent events without catching up.
    backlog_since: Option<Instant>,
    /// Set when the client must resume (it stalled, or the gateway is shutting down); the
    /// body then ends the stream.
    detach: Option<(Instant, Outcome)>,
    /// Closes the client's connection when the body cannot even be polled.
    kill: Option<Arc<Notify>>,
}

#[derive(Debug)]
struct Stream {
    kind: StreamKind,
    /// The stream's opening position: a cursor here means "before any event of this stream".
    first_seq: u64,
    /// The highest position issued on this stream.
    last_seq: u64,
    /// Highest sequence number of this stream that can no longer be delivered.
    lost_upto: u64,
    /// An event too large for the window, kept for the attached client only.
    overflow: Option<Entry>,
    requests: Vec<PendingRequest>,
    /// The POST that opened this stream was `initialize`.
    initialize: bool,
    end: Option<End>,
    sub: Option<Subscriber>,
    reader: Option<AbortHandle>,
}

impl Stream {
    fn unanswered_after(&self, cursor: u64) -> impl Iterator<Item = &PendingRequest> {
        self.requests
            .iter()
            .filter(move |r| !r.reported && r.answered_at.is_none_or(|s| s > cursor))
    }

    /// Ids of the requests whose response the client at `cursor` has not seen, marked as
    /// reported: the caller answers each with a JSON-RPC error.
    fn fail_unanswered(&mut self, cursor: u64) -> Vec<String> {
        self.requests
            .iter_mut()
            .filter(|r| !r.reported && r.answered_at.is_none_or(|s| s > cursor))
            .map(|r| {
                r.reported = true;
                r.id.clone()
            })
            .collect()
    }
}

#[derive(Debug)]
struct State {
    window: Window,
    last_seq: u64,
    next_stream: u32,
    streams: BTreeMap<u32, Stream>,
    ended: VecDeque<u32>,
    last_activity: Instant,
    protocol_version: Option<String>,
    standalone: Option<u32>,
    closed: bool,
    next_generation: u64,
}

/// One MCP session as the gateway sees it.
#[derive(Debug)]
pub struct Session {
    id: String,
    epoch: u64,
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    budget: Arc<Budget>,
    /// Keyed hash of the principal the session is bound to (see `proxy`).
    principal: AtomicU64,
    state: Mutex<State>,
}

/// The global byte budget shared by all windows (`--memory-budget`).
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    limit: usize,
}

impl Budget {
    pub fn new(limit: usize) -> Budget {
        Budget {
            used: AtomicUsize::new(0),
            limit,
        }
    }

    /// Bytes retained by all windows now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    fn over(&self) -> usize {
        self.used().saturating_sub(self.limit)
    }

    /// New sessions are admitted only below 90% of the budget, so the sessions already held
    /// keep some room to grow before their windows must be trimmed.
    fn admits_new(&self) -> bool {
        self.used() < self.limit - self.limit / 10
    }

    /// Applies a window's size change from `before` to `after`.
    fn adjust(&self, before: usize, after: usize) {
        if after >= before {
            self.used.fetch_add(after - before, Ordering::Relaxed);
        } else {
            self.used.fetch_sub(before - after, Ordering::Relaxed);
        }
    }
}

/// The answer to a resume request that the gateway can serve.
#[derive(Debug)]
pub enum Resume {
    /// Attached: the body starts with `prelude` (the resumed event) then replays.
    Attached {
        stream: u32,
        generation: u64,
        prelude: Bytes,
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

impl Session {
    fn new(
        id: String,
        cfg: Arc<Config>,
        metrics: Arc<Metrics>,
        budget: Arc<Budget>,
        principal: u64,
    ) -> Session {
        Session {
            id,
            epoch: new_epoch(),
            state: Mutex::new(State {
                window: Window::new(cfg.window_events, cfg.window_bytes),
                last_seq: 0,
                next_stream: 0,
                streams: BTreeMap::new(),
                ended: VecDeque::new(),
                last_activity: Instant::now(),
                protocol_version: None,
                standalone: None,
                closed: false,
                next_generation: 0,
            }),
            cfg,
            metrics,
            budget,
            principal: AtomicU64::new(principal),
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The keyed hash of the principal this session is bound to.
    pub fn principal(&self) -> u64 {
        self.principal.load(Ordering::Relaxed)
    }

    /// Rebinds the session (after the upstream accepted the caller's new credentials).
    pub fn set_principal(&self, p: u64) {
        self.principal.store(p, Ordering::Relaxed);
    }

    fn cursor(&self, stream: u32, seq: u64) -> String {
        Cursor {
            epoch: self.epoch,
            stream,
            seq,
        }
        .to_string()
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

    /// Whether the session still holds a live standalone upstream stream.
    pub fn has_standalone(&self) -> bool {
        let st = lock(&self.state);
        st.standalone
            .is_some_and(|s| st.streams.get(&s).is_some_and(|s| s.end.is_none()))
    }

    /// Opens a tagged stream and attaches its first client at the opening position.
    /// Returns the stream number, the subscriber generation and the priming frame, if asked.
    pub fn open_stream(
        &self,
        kind: StreamKind,
        requests: Vec<String>,
        initialize: bool,
        prime: bool,
        kill: Option<Arc<Notify>>,
    ) -> (u32, u64, Option<Bytes>) {
        let mut st = lock(&self.state);
        st.last_seq += 1;
        let seq = st.last_seq;
        let stream = st.next_stream;
        st.next_stream += 1;
        let generation = st.next_generation;
        st.next_generation += 1;
        st.streams.insert(
            stream,
            Stream {
                kind,
                first_seq: seq,
                last_seq: seq,
                lost_upto: 0,
                overflow: None,
                requests: requests
                    .into_iter()
                    .map(|id| PendingRequest {
                        id,
                        answered_at: None,
                        reported: false,
                    })
                    .collect(),
                initialize,
                end: None,
                sub: Some(Subscriber::new(generation, seq, kill)),
                reader: None,
            },
        );
        if kind == StreamKind::Standalone {
            st.standalone = Some(stream);
        }
        self.metrics.streams_attached.inc();
        st.last_activity = Instant::now();
        let priming = prime.then(|| {
            let retry = self.cfg.retry_hint.map(|d| d.as_millis() as u64);
            sse::control(Some(&self.cursor(stream, seq)), None, retry, "")
        });
        (stream, generation, priming)
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

    /// Tags and retains decoded upstream events of `stream`, then wakes its client.
    pub fn push_events(&self, stream: u32, events: &mut Vec<Event>) {
        if events.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut st = lock(&self.state);
        let st = &mut *st;
        if st.closed {
            events.clear();
            return;
        }
        let mut learned_version = None;
        let bytes_before = st.window.bytes();
        self.metrics.events_tagged.inc_by(events.len() as u64);
        for ev in events.drain(..) {
            st.last_seq += 1;
            let seq = st.last_seq;
            let Some(s) = st.streams.get_mut(&stream) else {
                return;
            };
            let mut body = Vec::with_capacity(sse::body_len(&ev));
            let message = sse::encode_body(&ev, &mut body);
            s.last_seq = seq;
            if let Some(data) = ev.data.as_deref() {
                if s.requests.iter().any(|r| r.answered_at.is_none()) {
                    for rid in jsonrpc::response_ids(data) {
                        if let Some(r) = s
                            .requests
                            .iter_mut()
                            .find(|r| r.id == rid && r.answered_at.is_none())
                        {
                            r.answered_at = Some(seq);
                        }
                    }
                    if s.initialize {
                        learned_version = jsonrpc::initialize_version(data).or(learned_version);
                    }
                }
            }
            let entry = Entry {
                seq,
                stream,
                message,
                body: body.into_boxed_slice(),
            };
            let streams = &mut st.streams;
            let metrics = &self.metrics;
            if let Err(big) = st.window.push(entry, |old| {
                metrics.window_evictions.inc();
                if let Some(o) = streams.get_mut(&old.stream) {
                    o.lost_upto = o.lost_upto.max(old.seq);
                }
            }) {
                // Too large to retain: only the attached client can still get it.
                if let Some(s) = streams.get_mut(&stream) {
                    if let Some(prev) = s.overflow.replace(big) {
                        s.lost_upto = s.lost_upto.max(prev.seq);
                    }
                    if s.sub.is_none() {
                        if let Some(o) = s.overflow.take() {
                            s.lost_upto = s.lost_upto.max(o.seq);
                        }
                    }
                }
            }
        }
        self.budget.adjust(bytes_before, st.window.bytes());
        if let Some(v) = learned_version {
            st.protocol_version = Some(v);
        }
        if let Some(sub) = st.streams.get_mut(&stream).and_then(|s| s.sub.as_mut()) {
            sub.backlog_since.get_or_insert(now);
            if let Some(w) = sub.waker.take() {
                w.wake();
            }
        }
    }

    /// Marks `stream` ended by its upstream and wakes its client.
    pub fn end_stream(&self, stream: u32, end: End) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(s) = st.streams.get_mut(&stream) else {
            return;
        };
        s.end = Some(end);
        s.reader = None;
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
            st.streams.remove(&old);
            let before = st.window.bytes();
            st.window.remove_stream(old);
            self.budget.adjust(before, st.window.bytes());
        }
    }

    /// Re-attaches a client to the stream of `cursor` (a `GET` with `Last-Event-ID`).
    pub fn resume(&self, cursor: Cursor, kill: Option<Arc<Notify>>) -> Result<Resume, ResumeError> {
        if cursor.epoch != self.epoch {
            return Err(ResumeError::ForeignCursor);
        }
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.last_activity = Instant::now();
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
            let ids = s.fail_unanswered(cursor.seq);
            if ids.is_empty() {
                return Err(ResumeError::Gap);
            }
            return Ok(Resume::GapWithErrors {
                frames: failure_frames(&here, "gap", &ids, GAP_MESSAGE),
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
        if let Some(old) = s.sub.replace(Subscriber::new(generation, cursor.seq, kill)) {
            if let Some(w) = old.waker {
                w.wake();
            }
        }
        let data = serde_json::json!({
            "stream": cursor.stream,
            "kind": match s.kind { StreamKind::Post => "post", StreamKind::Standalone => "standalone" },
            "after": here,
            "replay": replay,
            "ended": s.end.is_some(),
        });
        let prelude = sse::control(Some(&here), Some(EVENT_RESUMED), None, &data.to_string());
        Ok(Resume::Attached {
            stream: cursor.stream,
            generation,
            prelude,
            replay,
        })
    }

    /// Attaches a client live (no history) to the held standalone stream, replacing any
    /// older client. Returns `None` when no standalone stream is held.
    pub fn attach_standalone(
        &self,
        prime: bool,
        kill: Option<Arc<Notify>>,
    ) -> Option<(u32, u64, Option<Bytes>)> {
        let mut st = lock(&self.state);
        let st = &mut *st;
        st.last_activity = Instant::now();
        let stream = st.standalone?;
        let s = st.streams.get_mut(&stream)?;
        if s.end.is_some() {
            return None;
        }
        let generation = st.next_generation;
        st.next_generation += 1;
        // Live: nothing already emitted is replayed; what is not yet delivered is not lost
        // either, since it stays in the window for a resume of the older client.
        let at = s.last_seq;
        self.metrics.streams_attached.inc();
        if let Some(old) = s.sub.replace(Subscriber::new(generation, at, kill)) {
            if let Some(w) = old.waker {
                w.wake();
            }
        }
        let priming = prime.then(|| {
            let retry = self.cfg.retry_hint.map(|d| d.as_millis() as u64);
            sse::control(Some(&self.cursor(stream, at)), None, retry, "")
        });
        Some((stream, generation, priming))
    }

    /// The next step for the client `generation` attached to `stream`.
    pub fn poll_step(&self, stream: u32, generation: u64, waker: &Waker) -> Step {
        let mut st = lock(&self.state);
        let st = &mut *st;
        if st.closed {
            return Step::Finish(Bytes::new(), Outcome::SessionClosed);
        }
        let Some(s) = st.streams.get_mut(&stream) else {
            return Step::Finish(Bytes::new(), Outcome::SessionClosed);
        };
        let Some(sub) = s.sub.as_mut().filter(|sub| sub.generation == generation) else {
            return Step::Finish(Bytes::new(), Outcome::Replaced);
        };
        let cursor = sub.cursor;
        let here = Cursor {
            epoch: self.epoch,
            stream,
            seq: cursor,
        }
        .to_string();
        if let Some((_, why)) = sub.detach {
            s.sub = None;
            st.last_activity = Instant::now();
            let retry = self
                .cfg
                .retry_hint
                .unwrap_or(Duration::from_secs(1))
                .as_millis() as u64;
            let reason = match why {
                Outcome::Shutdown => "shutdown",
                _ => "slow-consumer",
            };
            let data = serde_json::json!({ "reason": reason, "resume_from": here });
            let frame = sse::control(
                Some(&here),
                Some(EVENT_RESUMPTION_REQUIRED),
                Some(retry),
                &data.to_string(),
            );
            return Step::Finish(frame, why);
        }
        if s.lost_upto > cursor {
            // This client fell behind the window: the same explicit failure as a late resume.
            let ids = s.fail_unanswered(cursor);
            let frames = failure_frames(&here, "gap", &ids, GAP_MESSAGE);
            s.sub = None;
            return Step::Finish(frames, Outcome::Gap);
        }
        let mut out = BytesMut::new();
        let mut events = 0;
        let mut last = cursor;
        let mut overflow = s.overflow.as_ref().filter(|o| o.seq > cursor);
        for e in st.window.after(stream, cursor) {
            if out.len() >= BATCH_BYTES {
                break;
            }
            if let Some(o) = overflow.filter(|o| o.seq < e.seq) {
                self.write_entry(o, &mut out);
                events += 1;
                last = o.seq;
                overflow = None;
                if out.len() >= BATCH_BYTES {
                    break;
                }
            }
            self.write_entry(e, &mut out);
            events += 1;
            last = e.seq;
        }
        if let Some(o) = overflow.filter(|o| o.seq > last && out.len() < BATCH_BYTES) {
            self.write_entry(o, &mut out);
            events += 1;
            last = o.seq;
        }
        if let Some(o) = s.overflow.as_ref().filter(|o| o.seq <= last) {
            // Handed to the client: from now on a resume before it is a gap.
            s.lost_upto = s.lost_upto.max(o.seq);
            s.overflow = None;
        }
        let Some(sub) = s.sub.as_mut() else {
            return Step::Finish(Bytes::new(), Outcome::Replaced);
        };
        if !out.is_empty() {
            sub.cursor = last;
            if last >= s.last_seq {
                sub.backlog_since = None;
            }
            return Step::Data(out.freeze(), events);
        }
        sub.backlog_since = None;
        let Some(end) = s.end.clone() else {
            sub.waker = Some(waker.clone());
            return Step::Pending;
        };
        s.sub = None;
        let ids = s.fail_unanswered(cursor);
        match end {
            End::Complete if ids.is_empty() => Step::Finish(Bytes::new(), Outcome::Completed),
            End::Complete => Step::Finish(
                failure_frames(&here, "upstream-ended", &ids, UPSTREAM_ENDED_MESSAGE),
                Outcome::UpstreamFailed,
            ),
            End::UpstreamFailed(cause) => Step::Finish(
                upstream_failure_frames(&here, &cause, &ids),
                Outcome::UpstreamFailed,
            ),
        }
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

    /// Writes a retained event as sent on the wire: its gateway id, then its body.
    fn write_entry(&self, e: &Entry, out: &mut BytesMut) {
        let mut id = Vec::with_capacity(64);
        id.extend_from_slice(b"id: ");
        Cursor {
            epoch: self.epoch,
            stream: e.stream,
            seq: e.seq,
        }
        .write_to(&mut id);
        id.push(b'\n');
        if e.message {
            id.extend_from_slice(b"event: message\n");
        }
        out.reserve(id.len() + e.body.len());
        out.put_slice(&id);
        out.put_slice(&e.body);
    }

    /// The client `generation` of `stream` went away (its body was dropped).
    pub fn detach(&self, stream: u32, generation: u64) {
        self.metrics.streams_detached.inc();
        let mut st = lock(&self.state);
        st.last_activity = Instant::now();
        if let Some(s) = st.streams.get_mut(&stream) {
            if s.sub
                .as_ref()
                .is_some_and(|sub| sub.generation == generation)
            {
                s.sub = None;
                if let Some(o) = s.overflow.take() {
                    s.lost_upto = s.lost_upto.max(o.seq);
                }
            }
        }
    }

    /// Drops all state: stops upstream readers, ends attached clients, frees the window.
    fn close(&self) {
        let mut st = lock(&self.state);
        st.closed = true;
        self.budget.adjust(st.window.bytes(), 0);
        st.window = Window::new(1, 0);
        for s in st.streams.values_mut() {
            if let Some(r) = s.reader.take() {
                r.abort();
            }
            if let Some(w) = s.sub.as_mut().and_then(|sub| sub.waker.take()) {
                w.wake();
            }
        }
        st.streams.clear();
    }

    /// Sweep work for one session: flags stalled clients. Returns whether the session is
    /// idle (no client attached) and since when.
    fn sweep(&self, now: Instant) -> (bool, Instant) {
        let stall = self.cfg.stall_timeout;
        let mut st = lock(&self.state);
        let mut attached = false;
        for s in st.streams.values_mut() {
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
                    if sub
                        .backlog_since
                        .is_some_and(|t| now.duration_since(t) >= stall)
                    {
                        sub.detach = Some((now, Outcome::SlowConsumer));
                        self.metrics.slow_consumer_detaches.inc();
                        if let Some(w) = sub.waker.take() {
                            w.wake();
                        }
                    }
                }
            }
        }
        (!attached, st.last_activity)
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
            self.metrics.window_evictions.inc();
            if let Some(s) = st.streams.get_mut(&old.stream) {
                s.lost_upto = s.lost_upto.max(old.seq);
            }
        }
        self.budget.adjust(before, st.window.bytes());
    }

    /// Since when no client has been attached, or `None` while one is.
    fn idle_since(&self) -> Option<Instant> {
        let st = lock(&self.state);
        st.streams
            .values()
            .all(|s| s.sub.is_none())
            .then_some(st.last_activity)
    }

    fn attached_clients(&self) -> usize {
        lock(&self.state)
            .streams
            .values()
            .filter(|s| s.sub.is_some())
            .count()
    }
}

impl Subscriber {
    fn new(generation: u64, cursor: u64, kill: Option<Arc<Notify>>) -> Subscriber {
        Subscriber {
            generation,
            cursor,
            waker: None,
            backlog_since: None,
            detach: None,
            kill,
        }
    }
}

const GAP_MESSAGE: &str = "mcp-reattach: resumption failed: the events after the client's last event id were evicted from the gateway's window, so this request's result cannot be delivered";
const UPSTREAM_ENDED_MESSAGE: &str =
    "mcp-reattach: the upstream server ended the stream without answering this request";

/// JSON-RPC error code the gateway uses for requests whose result cannot be delivered.
pub const ERROR_CODE_RESUMPTION_FAILED: i64 = -32010;
/// JSON-RPC error code for requests whose upstream stream failed.
pub const ERROR_CODE_UPSTREAM_FAILED: i64 = -32011;

fn failure_frames(here: &str, reason: &str, ids: &[String], message: &str) -> Bytes {
    let info = serde_json::json!({ "reason": reason, "at": here, "requests": ids.len() });
    let mut out = BytesMut::from(
        &sse::control(
            Some(here),
            Some(EVENT_RESUMPTION_FAILED),
            None,
            &info.to_string(),
        )[..],
    );
    for id in ids {
        out.put_slice(&error_event(
            id,
            ERROR_CODE_RESUMPTION_FAILED,
            message,
            reason,
        ));
    }
    out.freeze()
}

fn upstream_failure_frames(here: &str, cause: &str, ids: &[String]) -> Bytes {
    let info = serde_json::json!({ "reason": "upstream-failed", "cause": cause, "at": here });
    let mut out = BytesMut::from(
        &sse::control(
            Some(here),
            Some(EVENT_UPSTREAM_FAILED),
            None,
            &info.to_string(),
        )[..],
    );
    let message = format!(
        "mcp-reattach: the upstream stream failed before this request was answered: {cause}"
    );
    for id in ids {
        out.put_slice(&error_event(
            id,
            ERROR_CODE_UPSTREAM_FAILED,
            &message,
            "upstream-failed",
        ));
    }
    out.freeze()
}

/// A `message` event carrying a JSON-RPC error response for request `id` (JSON text).
fn error_event(id: &str, code: i64, message: &str, reason: &str) -> Bytes {
    let id: serde_json::Value = serde_json::from_str(id).unwrap_or(serde_json::Value::Null);
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": { "code": code, "message": message, "data": { "reason": reason } },
    });
    sse::control(None, Some("message"), None, &body.to_string())
}

/// All live sessions, keyed by the upstream's session id.
#[derive(Debug)]
pub struct Registry {
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    budget: Arc<Budget>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
}

/// The session cap is reached and every session has a client attached.
#[derive(Debug, thiserror::Error)]
#[error("the gateway holds its maximum number of sessions, all in use")]
pub struct AtCapacity;

impl Eviction {
    pub fn as_str(self) -> &'static str {
        match self {
            Eviction::Ttl => "ttl",
            Eviction::Delete => "delete",
            Eviction::Upstream404 => "upstream_404",
            Eviction::SessionCap => "session_cap",
            Eviction::MemoryBudget => "memory_budget",
        }
    }
}

impl Registry {
    pub fn new(cfg: Arc<Config>, metrics: Arc<Metrics>) -> Registry {
        let budget = Arc::new(Budget::new(cfg.memory_budget));
        Registry {
            cfg,
            metrics,
            budget,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        lock(&self.sessions).get(id).cloned()
    }

    /// The session `id`, created if the gateway has not seen it (sheds an idle session at
    /// the cap; errs when every session is in use).
    pub fn get_or_create(&self, id: &str, principal: u64) -> Result<Arc<Session>, AtCapacity> {
        let mut map = lock(&self.sessions);
        if let Some(s) = map.get(id) {
            return Ok(s.clone());
        }
        self.make_room(&mut map)?;
        let s = Arc::new(Session::new(
            id.to_owned(),
            self.cfg.clone(),
            self.metrics.clone(),
            self.budget.clone(),
            principal,
        ));
        map.insert(id.to_owned(), s.clone());
        tracing::debug!(mcp.session = %hash_id(id), "session created");
        Ok(s)
    }

    /// Makes room for one new session if at the cap (called before forwarding an
    /// `initialize`, so the upstream never creates a session the gateway cannot hold).
    pub fn reserve(&self) -> Result<(), AtCapacity> {
        self.make_room(&mut lock(&self.sessions))
    }

    /// Room for one more session: under the session cap and the memory budget, shedding the
    /// least recently used idle sessions if needed.
    fn make_room(&self, map: &mut HashMap<String, Arc<Session>>) -> Result<(), AtCapacity> {
        if map.len() >= self.cfg.max_sessions {
            self.shed_one(map, Eviction::SessionCap)?;
        }
        while !self.budget.admits_new() {
            self.shed_one(map, Eviction::MemoryBudget)?;
        }
        Ok(())
    }

    /// Keeps all windows within `--memory-budget` after `filling` grew: sheds the least
    /// recently used idle sessions first, then trims `filling`'s own oldest events.
    pub fn enforce_budget(&self, filling: &Session) {
        while self.budget.over() > 0 {
            let shed = {
                let mut map = lock(&self.sessions);
                self.shed_one(&mut map, Eviction::MemoryBudget).is_ok()
            };
            if !shed {
                filling.trim(self.budget.over());
                break;
            }
        }
    }

    /// Whether all windows together are over the budget.
    pub fn over_budget(&self) -> bool {
        self.budget.over() > 0
    }

    fn shed_one(
        &self,
        map: &mut HashMap<String, Arc<Session>>,
        why: Eviction,
    ) -> Result<(), AtCapacity> {
        let victim = map
            .iter()
            .filter_map(|(k, s)| s.idle_since().map(|since| (since, k)))
            .min()
            .map(|(_, k)| k.clone())
            .ok_or(AtCapacity)?;
        if let Some(s) = map.remove(&victim) {
            self.closed(&victim, &s, why);
        }
        Ok(())
    }

    fn closed(&self, id: &str, s: &Session, why: Eviction) {
        s.close();
        self.metrics.session_evicted(why.as_str());
        tracing::info!(mcp.session = %hash_id(id), reason = why.as_str(), "session dropped");
    }

    /// Drops the session `id`'s state (DELETE, upstream 404).
    pub fn remove(&self, id: &str, why: Eviction) {
        let s = lock(&self.sessions).remove(id);
        if let Some(s) = s {
            self.closed(id, &s, why);
        }
    }

    pub fn len(&self) -> usize {
        lock(&self.sessions).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn all(&self) -> Vec<(String, Arc<Session>)> {
        lock(&self.sessions)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// One sweep: flags stalled clients and drops sessions idle for longer than the TTL.
    pub fn sweep(&self) {
        let now = Instant::now();
        for (id, s) in self.all() {
            let (idle, since) = s.sweep(now);
            if idle && now.duration_since(since) >= self.cfg.session_ttl {
                let mut map = lock(&self.sessions);
                if map.get(&id).is_some_and(|cur| Arc::ptr_eq(cur, &s)) {
                    map.remove(&id);
                    drop(map);
                    self.closed(&id, &s, Eviction::Ttl);
                }
            }
        }
    }

    /// Runs [`Registry::sweep`] every `sweep_interval` until the registry is dropped.
    pub fn spawn_sweeper(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let every = self.cfg.sweep_interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(reg) = weak.upgrade() else { return };
                reg.sweep();
            }
        })
    }

    /// Tells attached clients to resume elsewhere (graceful shutdown): those of standalone
    /// streams only, or all of them.
    pub fn end_clients(&self, standalone_only: bool) {
        let kind = standalone_only.then_some(StreamKind::Standalone);
        for (_, s) in self.all() {
            s.end_clients(kind);
        }
    }

    /// Sets the gauges of current state (called at scrape time).
    pub fn refresh_gauges(&self) {
        let (mut events, mut bytes, mut clients) = (0, 0, 0);
        let all = self.all();
        for (_, s) in &all {
            let (e, b) = s.window_usage();
            events += e;
            bytes += b;
            clients += s.attached_clients();
        }
        let m = &self.metrics;
        m.sessions.set(all.len() as i64);
        m.window_events.set(events as i64);
        m.window_bytes.set(bytes as i64);
        m.attached_clients.set(clients as i64);
    }

    /// Total retained window bytes over all sessions.
    pub fn window_bytes(&self) -> usize {
        self.budget.used()
    }
}

/// A short, stable, non-reversible label for a session id in logs.
pub fn hash_id(id: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    format!("{:012x}", h.finish() & 0xffff_ffff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(f: impl FnOnce(&mut Config)) -> Arc<Config> {
        let mut c = Config::new("http://127.0.0.1:1".parse().unwrap());
        f(&mut c);
        Arc::new(c)
    }

    fn msg(data: &str) -> Event {
        Event {
            event: Some("message".into()),
            data: Some(data.into()),
            ..Event::default()
        }
    }

    fn session(c: Arc<Config>) -> Session {
        Session::new(
            "a".into(),
            c,
            Arc::default(),
            Arc::new(Budget::new(usize::MAX)),
            0,
        )
    }

    fn step(s: &Session, stream: u32, generation: u64) -> Step {
        s.poll_step(stream, generation, Waker::noop())
    }

    fn text(step: Step) -> String {
        match step {
            Step::Data(b, _) | Step::Finish(b, _) => String::from_utf8(b.to_vec()).unwrap(),
            Step::Pending => String::new(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn ttl_counts_from_the_last_activity_and_only_without_clients() {
        let reg = Registry::new(
            cfg(|c| c.session_ttl = Duration::from_secs(60)),
            Arc::default(),
        );
        let s = reg.get_or_create("a", 0).unwrap();
        let (stream, generation, _) = s.open_stream(StreamKind::Post, vec![], false, false, None);
        tokio::time::advance(Duration::from_secs(120)).await;
        reg.sweep();
        assert_eq!(reg.len(), 1, "a client is attached");
        s.detach(stream, generation);
        tokio::time::advance(Duration::from_secs(59)).await;
        reg.sweep();
        assert_eq!(reg.len(), 1, "TTL counts from the detach");
        s.touch();
        tokio::time::advance(Duration::from_secs(59)).await;
        reg.sweep();
        assert_eq!(reg.len(), 1, "a request restarts the TTL");
        tokio::time::advance(Duration::from_secs(2)).await;
        reg.sweep();
        assert_eq!(reg.len(), 0);
        assert!(matches!(step(&s, stream, generation), Step::Finish(..)));
    }

    #[tokio::test(start_paused = true)]
    async fn stalled_client_gets_resumption_required_with_retry() {
        let s = session(cfg(|c| c.stall_timeout = Duration::from_secs(30)));
        let (stream, generation, _) =
            s.open_stream(StreamKind::Post, vec!["1".into()], false, false, None);
        s.push_events(stream, &mut vec![msg("{\"n\":1}")]);
        assert!(text(step(&s, stream, generation)).contains("{\"n\":1}"));
        // The client stops polling while events keep coming.
        s.push_events(stream, &mut vec![msg("{\"n\":2}")]);
        tokio::time::advance(Duration::from_secs(29)).await;
        s.sweep(Instant::now());
        s.push_events(stream, &mut vec![msg("{\"n\":3}")]);
        tokio::time::advance(Duration::from_secs(2)).await;
        s.sweep(Instant::now());
        let out = text(step(&s, stream, generation));
        assert!(
            out.contains("event: mcp-reattach/resumption-required"),
            "{out}"
        );
        assert!(out.contains("retry: 1000"), "{out}");
        assert!(
            !out.contains("\"n\":2"),
            "nothing more is pushed to a detached client"
        );
        // It resumes from its last event and gets the rest.
        let here = Cursor {
            epoch: s.epoch,
            stream,
            seq: 2,
        };
        let Ok(Resume::Attached {
            generation: g2,
            replay,
            ..
        }) = s.resume(here, None)
        else {
            panic!("resumable")
        };
        assert_eq!(replay, 2);
        let out = text(step(&s, stream, g2));
        assert!(out.contains("\"n\":2") && out.contains("\"n\":3"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_keeps_up_is_never_detached() {
        let s = session(cfg(|c| c.stall_timeout = Duration::from_secs(1)));
        let (stream, generation, _) =
            s.open_stream(StreamKind::Standalone, vec![], false, false, None);
        for i in 0..100 {
            s.push_events(stream, &mut vec![msg(&format!("{{\"n\":{i}}}"))]);
            tokio::time::advance(Duration::from_millis(100)).await;
            s.sweep(Instant::now());
            assert!(matches!(step(&s, stream, generation), Step::Data(..)));
            assert!(matches!(step(&s, stream, generation), Step::Pending));
        }
    }

    #[test]
    fn eviction_by_count_or_bytes_makes_a_resume_a_gap() {
        for (events, bytes) in [(4, 1 << 20), (1000, 400)] {
            let s = session(cfg(|c| {
                c.window_events = events;
                c.window_bytes = bytes;
            }));
            let (stream, generation, _) =
                s.open_stream(StreamKind::Standalone, vec![], false, false, None);
            s.detach(stream, generation);
            let start = Cursor {
                epoch: s.epoch,
                stream,
                seq: 1,
            };
            for i in 0..3 {
                s.push_events(
                    stream,
                    &mut vec![msg(&format!(
                        "{{\"n\":{i},\"pad\":\"{}\"}}",
                        "p".repeat(40)
                    ))],
                );
            }
            assert!(matches!(
                s.resume(start, None),
                Ok(Resume::Attached { replay: 3, .. })
            ));
            for i in 3..10 {
                s.push_events(
                    stream,
                    &mut vec![msg(&format!(
                        "{{\"n\":{i},\"pad\":\"{}\"}}",
                        "p".repeat(40)
                    ))],
                );
            }
            assert_eq!(s.resume(start, None).unwrap_err(), ResumeError::Gap);
            let (n, b) = s.window_usage();
            assert!(n <= events && b <= bytes);
            // A cursor at the newest retained event still resumes.
            let last = Cursor {
                epoch: s.epoch,
                stream,
                seq: 11,
            };
            assert!(matches!(
                s.resume(last, None),
                Ok(Resume::Attached { replay: 0, .. })
            ));
        }
    }

    #[test]
    fn gap_answers_only_requests_not_answered_before_the_cursor() {
        let s = session(cfg(|c| c.window_events = 2));
        let (stream, generation, _) = s.open_stream(
            StreamKind::Post,
            vec!["1".into(), "\"b\"".into()],
            false,
            false,
            None,
        );
        s.detach(stream, generation);
        s.push_events(
            stream,
            &mut vec![msg(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#)],
        ); // seq 2
        let after_first = Cursor {
            epoch: s.epoch,
            stream,
            seq: 2,
        };
        for _ in 0..3 {
            s.push_events(stream, &mut vec![msg(r#"{"jsonrpc":"2.0","method":"p"}"#)]);
        }
        let Ok(Resume::GapWithErrors { frames }) = s.resume(after_first, None) else {
            panic!("gap")
        };
        let t = String::from_utf8(frames.to_vec()).unwrap();
        assert!(t.contains("\"id\":\"b\""), "{t}");
        assert!(
            !t.contains("\"id\":1,"),
            "request 1 was answered before the cursor: {t}"
        );
    }

    #[test]
    fn ended_stream_metadata_is_bounded() {
        let s = session(cfg(|_| {}));
        for _ in 0..(MAX_ENDED_STREAMS + 50) {
            let (stream, generation, _) =
                s.open_stream(StreamKind::Post, vec!["1".into()], false, false, None);
            s.push_events(
                stream,
                &mut vec![msg(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#)],
            );
            s.detach(stream, generation);
            s.end_stream(stream, End::Complete);
        }
        let st = lock(&s.state);
        assert_eq!(st.streams.len(), MAX_ENDED_STREAMS);
        drop(st);
        let forgotten = Cursor {
            epoch: s.epoch,
            stream: 0,
            seq: 1,
        };
        assert_eq!(
            s.resume(forgotten, None).unwrap_err(),
            ResumeError::StreamExpired
        );
    }
}
