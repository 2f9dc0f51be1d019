//! One tagged stream of a session: its positions, the requests its POST carried, its upstream
//! reader and the client attached to it, and the two facts flow control needs: how far the
//! stream's client is known to have its events (`acked`), and whether that client may still
//! come back for the rest (`guarding`).
//!
//! Pure bookkeeping: no locks, no I/O; the session holds these under its lock.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::window::Entry;

/// What started a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// The SSE response to a POST; it ends after the upstream's response.
    Post,
    /// The standalone GET stream, held open upstream while the session lives.
    Standalone,
}

impl StreamKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamKind::Post => "post",
            StreamKind::Standalone => "standalone",
        }
    }
}

/// Why the upstream side of a stream failed. Only a broken connection is worth reconnecting
/// for; the others will not heal by trying again.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamFailure {
    /// The connection failed mid-stream (reset, truncated chunking, ...). The library's text
    /// is for the log (`Debug`); clients are told only that the connection failed.
    #[error("upstream connection failed")]
    Connection(String),
    /// The upstream sent bytes that are not a valid SSE stream, or an event over the limit.
    #[error("{0}")]
    InvalidStream(String),
    /// The upstream closed a stream it had not finished and refused every attempt to resume it.
    #[error("the upstream closed the stream and refused {0} attempts to resume it")]
    ResumeRefused(u32),
    /// The upstream answered a POST the gateway was already answering with its own SSE
    /// stream (`--json-upgrade`) with this HTTP status, and the upstream's error message if
    /// its body was a JSON-RPC error.
    #[error("the upstream answered HTTP {status}{}", message.as_deref().map(|m| format!(": {m}")).unwrap_or_default())]
    Status {
        status: u16,
        message: Option<String>,
    },
}

/// How an upstream stream ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// The upstream ended the response normally.
    Complete,
    /// The upstream's stream failed.
    Failed(UpstreamFailure),
}

/// A JSON-RPC request carried by the POST that started a stream.
#[derive(Debug)]
pub(super) struct PendingRequest {
    /// The request id as canonical JSON text.
    pub id: String,
    /// Sequence number of the event that carried its response, once seen.
    pub answered_at: Option<u64>,
    /// The gateway answered it with an error that stands at the client's own position (a
    /// gap, the session's end); a client that reconnects after that error is not told again.
    /// The errors of a stream's end are not marked: they sit at the end's own position
    /// ([`Cursor::END`](crate::cursor::Cursor::END)), so a client that comes back before it
    /// did not read them and is told again.
    pub reported: bool,
    /// Its id's keyed hash, as `dedup::Carried` indexed it (and
    /// `dedup::Retired` keeps it, under the same key): the id is not read
    /// and hashed again when the stream is forgotten.
    pub hash: u64,
}

/// The client attached to a stream.
#[derive(Debug)]
pub(super) struct Subscriber {
    pub generation: u64,
    /// Sequence number of the last event handed to this client.
    pub cursor: u64,
    pub waker: Option<Waker>,
    /// Set when the client must resume (it stalled, or the gateway is shutting down); the
    /// body then ends the stream.
    pub detach: Option<(Instant, super::Outcome)>,
    /// Closes the client's connection when the body cannot even be polled.
    pub kill: Option<Arc<Notify>>,
    /// The client was given an id on this stream (priming, resumed event, or an event).
    pub has_id: bool,
    /// The client is part-way through the stream's oversized event at this position: it was
    /// given this many bytes of its wire form. Nothing else may be written to it before the
    /// rest (its body ends instead).
    pub partial: Option<(u64, usize)>,
}

impl Subscriber {
    pub(super) fn new(
        generation: u64,
        cursor: u64,
        kill: Option<Arc<Notify>>,
        has_id: bool,
    ) -> Subscriber {
        Subscriber {
            generation,
            cursor,
            waker: None,
            detach: None,
            kill,
            has_id,
            partial: None,
        }
    }

    /// Whether the client was told to go away because it made no progress.
    fn stalled(&self) -> bool {
        matches!(self.detach, Some((_, super::Outcome::SlowConsumer)))
    }
}

/// A session's streams by number, in number order: a sorted ring buffer. A session has a few
/// streams at once (its standalone stream, its POSTs in flight, a bounded number of ended
/// ones) and tagging an event looks its stream up, several times per event, cheaper in a
/// short sorted ring than a `BTreeMap`'s search. Boxed: a stream is large, and an insert or
/// a removal moves only a pointer per stream on its shorter side. A ring, not a vector: a
/// new stream goes at the back and the one forgotten is mostly the oldest, at the front (a
/// vector moved every retained stream behind it on every short call). Figures:
/// bench/notes.md, "Figure: a session's streams".
#[derive(Debug, Default)]
pub(super) struct Streams(VecDeque<(u32, Box<Stream>)>);

/// Where number `n` is in `ring`, sorted by number (`Err`: where it would go), as a binary
/// search says. Numbers are given out in order and streams are mostly forgotten oldest first,
/// so the newest ones (a running call's) sit at their distance from the back: looked at there
/// first, searched for only when not.
fn locate<T>(ring: &VecDeque<(u32, T)>, n: u32) -> Result<usize, usize> {
    let len = ring.len();
    if let Some(&(last, _)) = ring.back() {
        if n >= last {
            return if n == last { Ok(len - 1) } else { Err(len) };
        }
        let back = (last - n) as usize;
        if back < len && ring[len - 1 - back].0 == n {
            return Ok(len - 1 - back);
        }
    }
    ring.binary_search_by_key(&n, |(k, _)| *k)
}

#[cfg(test)]
mod locate_tests {
    use super::locate;
    use std::collections::VecDeque;

    proptest::proptest! {
        /// Whatever numbers a session holds (holes anywhere), the lookup answers exactly what
        /// a binary search does, for numbers held and not.
        #[test]
        fn locate_is_a_binary_search(held in proptest::collection::btree_set(0u32..200, 0..40), asked in 0u32..210) {
            let ring: VecDeque<(u32, ())> = held.iter().map(|&n| (n, ())).collect();
            let want = ring.binary_search_by_key(&asked, |(k, _)| *k);
            proptest::prop_assert_eq!(locate(&ring, asked), want);
        }
    }

    #[test]
    fn the_newest_streams_are_found_at_their_distance_from_the_back() {
        // The standalone stream 1, then calls 40..=60 after a hole.
        let ring: VecDeque<(u32, ())> =
            std::iter::once(1).chain(40..=60).map(|n| (n, ())).collect();
        assert_eq!(locate(&ring, 60), Ok(21));
        assert_eq!(locate(&ring, 45), Ok(6));
        assert_eq!(locate(&ring, 1), Ok(0));
        assert_eq!(locate(&ring, 61), Err(22));
        assert_eq!(locate(&ring, 20), Err(1));
    }
}

impl Streams {
    fn at(&self, n: u32) -> Result<usize, usize> {
        locate(&self.0, n)
    }

    pub(super) fn get(&self, n: &u32) -> Option<&Stream> {
        self.at(*n).ok().map(|i| &*self.0[i].1)
    }

    pub(super) fn get_mut(&mut self, n: &u32) -> Option<&mut Stream> {
        self.at(*n).ok().map(|i| &mut *self.0[i].1)
    }

    pub(super) fn contains_key(&self, n: &u32) -> bool {
        self.at(*n).is_ok()
    }

    /// Adds stream `n`, or replaces it (the replaced one is returned).
    pub(super) fn insert(&mut self, n: u32, s: Box<Stream>) -> Option<Box<Stream>> {
        match self.at(n) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, s)),
            Err(i) => {
                self.0.insert(i, (n, s));
                None
            }
        }
    }

    pub(super) fn remove(&mut self, n: &u32) -> Option<Box<Stream>> {
        let i = self.at(*n).ok()?;
        self.0.remove(i).map(|(_, s)| s)
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    /// Drops every stream and the vector's room.
    pub(super) fn clear(&mut self) {
        self.0 = VecDeque::new();
    }

    /// The streams with their numbers, in number order.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (&u32, &Stream)> {
        self.0.iter().map(|(n, s)| (n, &**s))
    }

    /// The streams with their numbers, in number order.
    pub(super) fn numbered(&self) -> impl Iterator<Item = (u32, &Stream)> {
        self.0.iter().map(|(n, s)| (*n, &**s))
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = (&u32, &mut Stream)> {
        self.0.iter_mut().map(|(n, s)| (&*n, &mut **s))
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Stream> {
        self.0.iter().map(|(_, s)| &**s)
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut Stream> {
        self.0.iter_mut().map(|(_, s)| &mut **s)
    }
}

impl FromIterator<(u32, Box<Stream>)> for Streams {
    fn from_iter<I: IntoIterator<Item = (u32, Box<Stream>)>>(iter: I) -> Streams {
        let mut streams = Streams::default();
        for (n, s) in iter {
            streams.insert(n, s);
        }
        streams
    }
}

#[derive(Debug)]
pub(super) struct Stream {
    pub kind: StreamKind,
    /// The stream's opening position: a cursor here means "before any event of this stream".
    pub first_seq: u64,
    /// The highest position issued on this stream.
    pub last_seq: u64,
    /// Highest sequence number of this stream that can no longer be delivered.
    pub lost_upto: u64,
    /// Every event of this stream up to here is taken as delivered: handed to a client and
    /// then pushed out of the session's in-flight reserve by later sends. Events after it
    /// are never evicted while [`Stream::guarding`] holds.
    pub acked: u64,
    /// The highest position written to any client of this stream.
    pub sent: u64,
    /// Since when the stream's client has had something to receive and made no progress
    /// (`None`: caught up, or progressing). Runs on while no client is attached.
    pub stall_since: Option<Instant>,
    /// An event too large for the window, kept for the attached client until its body was
    /// polled again after the last piece of it (hyper took it), or until no client may come
    /// back for it. Counted in the memory budget: change it only through
    /// [`Stream::set_overflow`].
    pub overflow: Option<Entry>,
    pub requests: Vec<PendingRequest>,
    /// The principal of the POST that opened the stream: a retransmission of its requests
    /// is one only from the same principal.
    pub principal: super::Principal,
    /// The POST that opened this stream was `initialize`.
    pub initialize: bool,
    pub end: Option<End>,
    pub sub: Option<Subscriber>,
    pub reader: Option<AbortHandle>,
    /// A standalone stream the gateway opened itself, before any client attached: its
    /// events are kept for the first client (guarded until then; the session TTL bounds it).
    pub awaiting_client: bool,
    /// The upstream reader, paused until the window has room (woken by client progress,
    /// an attach, or the stall budget running out).
    pub paused_reader: Option<Waker>,
    /// The positions this stream's events took, as runs of consecutive sequence numbers
    /// (positions are session-wide, so streams interleave), the newest [`MAX_RUNS`]: how
    /// many of its events lie between two positions.
    runs: Vec<(u64, u64)>,
    /// Events written to a client and then lost on the way are counted up to here.
    loss_counted_upto: u64,
    /// The trace of the request that opened the stream (see [`super::TraceParent`]).
    pub trace: Option<super::TraceParent>,
    /// What the fleet's store has of this stream (`publish`): `None` until its first
    /// publication, then the last position published.
    pub published: Option<u64>,
    /// The stream's end was published: nothing more ever is.
    pub published_end: bool,
    /// A client following this stream on another replica (through the fleet's store): the
    /// position it has, and when it last made progress. Its events after that position are
    /// guarded as a local client's are, within `--stall-timeout` of that progress.
    pub remote: Option<(u64, Instant)>,
}

/// Runs of positions a stream remembers (see [`Stream::tagged`]): one while it is the only
/// stream tagging, one more each time another stream's event comes between two of its own.
const MAX_RUNS: usize = 32;

impl Stream {
    /// Puts `entry` in the overflow slot (or empties it), keeping the memory budget's count
    /// of the slot's bytes: an oversized event held for a client is memory like any other.
    pub(super) fn set_overflow(&mut self, entry: Option<Entry>, budget: &super::Budget) {
        let before = self.overflow.as_ref().map_or(0, |o| o.body.len());
        let after = entry.as_ref().map_or(0, |e| e.body.len());
        self.overflow = entry;
        budget.adjust_oversized(before, after);
    }

    pub(super) fn new(
        kind: StreamKind,
        seq: u64,
        requests: Vec<String>,
        initialize: bool,
        sub: Option<Subscriber>,
    ) -> Stream {
        Stream {
            kind,
            first_seq: seq,
            last_seq: seq,
            lost_upto: 0,
            acked: seq,
            sent: seq,
            stall_since: None,
            overflow: None,
            requests: requests
                .into_iter()
                .map(|id| PendingRequest {
                    id,
                    answered_at: None,
                    reported: false,
                    hash: 0,
                })
                .collect(),
            initialize,
            principal: super::Principal::default(),
            end: None,
            awaiting_client: sub.is_none(),
            sub,
            reader: None,
            paused_reader: None,
            runs: Vec::new(),
            loss_counted_upto: seq,
            trace: None,
            published: None,
            published_end: false,
            remote: None,
        }
    }

    /// The stream's next event took position `seq` (the session's newest).
    pub(super) fn tagged(&mut self, seq: u64) {
        self.last_seq = seq;
        match self.runs.last_mut() {
            Some((_, end)) if *end + 1 == seq => *end = seq,
            _ => {
                if self.runs.len() == MAX_RUNS {
                    self.runs.remove(0);
                }
                self.runs.push((seq, seq));
            }
        }
    }

    /// How many of this stream's events have a position in `(after, upto]` (at least; older
    /// positions than the runs remember are not counted).
    fn events_between(&self, after: u64, upto: u64) -> u64 {
        self.runs
            .iter()
            .map(|&(a, b)| {
                let (lo, hi) = (a.max(after + 1), b.min(upto));
                hi.saturating_sub(lo) + u64::from(hi >= lo)
            })
            .sum()
    }

    /// A client resuming at `cursor` into a gap: how many of the lost events after its
    /// cursor had been written to a client (evicted as delivered, then lost in flight), each
    /// counted once whoever resumes. Events evicted before they were written were counted
    /// at their eviction.
    pub(super) fn lost_in_flight(&mut self, cursor: u64) -> u64 {
        let from = cursor.max(self.loss_counted_upto);
        let upto = self.lost_upto.min(self.sent);
        if upto <= from {
            return 0;
        }
        self.loss_counted_upto = upto;
        self.events_between(from, upto)
    }

    /// Whether the stream's client may still come back for events it was not sent: while it
    /// is attached (until it is detached for making no progress), after it left until
    /// `stall` has passed without progress, and for a held standalone stream until its first
    /// client comes.
    pub(super) fn guarding(&self, now: Instant, stall: Duration) -> bool {
        match &self.sub {
            Some(sub) => !sub.stalled(),
            None => {
                self.awaiting_client
                    || self
                        .stall_since
                        .is_some_and(|t| now.duration_since(t) < stall)
            }
        }
    }

    /// Whether the event `seq` of this stream must stay: not known delivered, and its client
    /// may still need it.
    pub(super) fn needs(&self, seq: u64, now: Instant, stall: Duration) -> bool {
        self.needed_after(now, stall)
            .is_some_and(|acked| seq > acked)
    }

    /// The position after which this stream's events must stay ([`Stream::needs`] for all of
    /// them at once); `None` when none must.
    pub(super) fn needed_after(&self, now: Instant, stall: Duration) -> Option<u64> {
        let local = self.guarding(now, stall).then_some(self.acked);
        let remote = self
            .remote
            .filter(|&(_, at)| now.duration_since(at) < stall)
            .map(|(acked, _)| acked);
        match (local, remote) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Wakes the paused upstream reader, if any (room may have been made).
    pub(super) fn wake_reader(&mut self) {
        if let Some(w) = self.paused_reader.take() {
            w.wake();
        }
    }

    /// Whether a request with id `id` (JSON text) was carried by this stream's POST.
    pub(super) fn carries(&self, id: &str) -> bool {
        self.requests.iter().any(|r| r.id == id)
    }

    /// Whether the stream carried request `id` and has not answered it yet.
    pub(super) fn awaits(&self, id: &str) -> bool {
        self.requests
            .iter()
            .any(|r| r.id == id && r.answered_at.is_none())
    }

    pub(super) fn unanswered_after(&self, cursor: u64) -> impl Iterator<Item = &PendingRequest> {
        self.requests
            .iter()
            .filter(move |r| !r.reported && r.answered_at.is_none_or(|s| s > cursor))
    }

    /// Ids of the requests whose response the client at `cursor` has not seen and that were
    /// not answered with an error that stands ([`PendingRequest::reported`]): what a stream's
    /// end frames answer, again at every resume before the end's position.
    pub(super) fn unanswered_ids(&self, cursor: u64) -> Vec<String> {
        self.unanswered_after(cursor)
            .map(|r| r.id.clone())
            .collect()
    }

    /// Ids of the requests whose response the client at `cursor` has not seen, marked as
    /// reported: the caller answers each with a JSON-RPC error.
    pub(super) fn fail_unanswered(&mut self, cursor: u64) -> Vec<String> {
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
