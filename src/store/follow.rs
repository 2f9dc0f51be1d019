//! A resume served from the store: the client's cursor names a stream another replica reads
//! upstream. Its answer is what the owner's would be: `mcp-reattach/resumed` at the cursor,
//! exactly the events after it (from the stream's entries), then the live tail as the owner
//! publishes it, then the stream's end (the JSON-RPC errors of an upstream that ended early,
//! as the owner's clients get them); a hole in the stream's chain is the explicit gap, never
//! a silent one.
//!
//! The live tail is read by polling the stream's entries (a few milliseconds apart while
//! events come, backing off to [`MAX_POLL`] while they do not, [`MAX_POLL_STANDALONE`] on a
//! standalone stream, which carries the server's rare messages for hours): one round trip per poll on the
//! shared connection, no connection held per follower.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use redis::streams::StreamRangeReply;
use tokio::sync::mpsc;

use super::wire::{self, Meta, Tag};
use super::writer::Write;
use super::{Shared, Store};
use crate::cursor::Cursor;
use crate::session::{
    decide, gap_frames, opening_frame, resumed_frame, upstream_ended_frames, Decision, Known,
    Principal, Reattach, ResumeError, Session, Stored,
};
use crate::session::{Charge, End, StreamKind};

/// A stream the store does not know is looked for again this many times, this far apart: its
/// owner's first write may be on its way.
const UNKNOWN_TRIES: u32 = 10;
const UNKNOWN_WAIT: Duration = Duration::from_millis(5);

/// How often a follower says where its client is (coalesced), for its owner's flow control.
const REPORT_EVERY: Duration = Duration::from_millis(100);

/// Entries read per round trip. An entry is one upstream read's events (at most a reader's
/// batch, 64 KiB, or one event up to `--max-event-bytes`): what a follower holds is counted in
/// the memory budget like a reader's ([`Charge`]), and it reads only while the budget has room.
const READ_ENTRIES: usize = 16;
/// What a follower asks the budget for before each read.
const READ_ROOM: usize = 64 * 1024;
/// The first poll's wait for new entries, doubled while none come, up to [`MAX_POLL`].
const MIN_POLL: Duration = Duration::from_millis(2);
const MAX_POLL: Duration = Duration::from_millis(50);
const MAX_POLL_STANDALONE: Duration = Duration::from_millis(500);

/// The last position an entry was added at to a stream of events (its last id, which
/// trimming does not lower), or nil: only the id leaves the store, never an entry.
const LAST_ADDED: &str = "if redis.call('EXISTS', KEYS[1]) == 0 then return false end \
local info = redis.call('XINFO', 'STREAM', KEYS[1]) \
for i = 1, #info, 2 do if info[i] == 'last-generated-id' then return info[i + 1] end end \
return false";

/// Why a cursor is not followed from the store.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FollowError {
    /// The store has no such stream (or no store): the local rules decide, as for a cursor
    /// of a stream this replica does not retain.
    NotInStore,
    /// The store did not answer (it failed, timed out, or this replica's requests to it were
    /// queued too long): the stream may well be there, so nothing is decided from it.
    Unanswered,
    /// A call's stream of another principal: answered as for an unknown session.
    NotTheCallers,
    /// Refused, as the owner refuses it (the one decision, `session::decide`).
    Refused(ResumeError),
    /// A standalone cursor that cannot be resumed exactly: the client re-attaches to the
    /// session instead, told whether events after its cursor are lost to it, and why.
    Reattach { lost: bool, reason: &'static str },
}

/// Where a follower starts in the cursor's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// After the cursor's position: a client's resume, decided as the owner decides it.
    After,
    /// At the stream's opening, whatever its position (the cursor's is not looked at): a
    /// retransmission's resume (decided from there), or a live attach to a standalone stream
    /// (no resume: always followed, as a local attach to the held stream is).
    Opening,
}

/// A cursor followed from the store.
pub(crate) enum Followed {
    /// The follower's body, and how many events it replays before the live tail.
    Body(FollowBody, usize),
    /// Events after the cursor are lost and requests unanswered: the explicit gap's frames
    /// (a failure event and an error per request), the whole body, as on the owner.
    Gap(Bytes),
}

/// A stream's meta (`KEYS[1]`) unless it is longer than `ARGV[1]` bytes (then none).
const META_BOUNDED: &str = "local m = redis.call('GET', KEYS[1]) if m and #m > tonumber(ARGV[1]) then return false end return m";

/// `XRANGE KEYS[1] ARGV[1] + COUNT ARGV[2]`, each field value longer than `ARGV[3]` bytes
/// replaced by the integer 0: no event, a hole in the stream's chain (the explicit gap).
const RANGE_BOUNDED: &str = r"
local r = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
local max = tonumber(ARGV[3])
for _, e in ipairs(r) do
  local f = e[2]
  for j = 2, #f, 2 do
    if #f[j] > max then f[j] = 0 end
  end
end
return r
";

/// The body of a follower: frames from its task.
pub(crate) struct FollowBody {
    rx: mpsc::Receiver<Bytes>,
}

impl http_body::Body for FollowBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.rx
            .poll_recv(cx)
            .map(|b| b.map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// One read: the stream's meta and its entries after a position, in one transaction.
struct Read {
    meta: Option<Meta>,
    entries: Vec<Entry>,
    /// The last position an entry of the stream was added at (read only for a resume's
    /// decision).
    last_added: Option<u64>,
}

struct Entry {
    prev: u64,
    events: Vec<u8>,
}

impl Store {
    /// Follows `cursor`'s stream of `session` from the store for a caller of `principal`
    /// (`None`: anyone may), from `start`: the first read is awaited (bounded by
    /// `--store-timeout`), the rest is the body's task. What a resume gets is what the owner's
    /// would be: the one decision (`session::decide`) made from what the store says of the
    /// stream.
    pub(crate) async fn follow(
        &self,
        session: &Arc<Session>,
        cursor: Cursor,
        start: Start,
        principal: Option<Principal>,
        reattach: Option<&Reattach>,
        mut charge: Charge,
    ) -> Result<Followed, FollowError> {
        let Store::Redis(s) = self else {
            return Err(FollowError::NotInStore);
        };
        let tag = s.tag_of(session);
        charge.room_for(READ_ROOM).await;
        let cursor = match start {
            // Before every stream's opening: what is read is the whole stream.
            Start::Opening => Cursor { seq: 0, ..cursor },
            Start::After => cursor,
        };
        // A stream the store does not know yet, or not as far as the cursor, may be one whose
        // owner's writes are on their way (the client came back within milliseconds): looked
        // at again, briefly, before it is decided from.
        let mut tries = 0;
        let first = loop {
            let read = s
                .read(&tag, cursor.stream, cursor.seq, true)
                .await
                .ok_or(FollowError::Unanswered)?;
            let caught_up = read.meta.as_ref().is_some_and(|m| {
                m.end.is_some()
                    || !read.entries.is_empty()
                    || start == Start::Opening
                    || read.last_added.max(m.l).unwrap_or(m.f).max(m.f) >= cursor.seq
            });
            if caught_up || tries == UNKNOWN_TRIES {
                break read;
            }
            tries += 1;
            tokio::time::sleep(UNKNOWN_WAIT).await;
        };
        let meta = first.meta.clone().ok_or(FollowError::NotInStore)?;
        if principal.is_some_and(|p| meta.kind() == StreamKind::Post && !meta.opened_by(p)) {
            return Err(FollowError::NotTheCallers);
        }
        let live = start == Start::Opening && meta.kind() == StreamKind::Standalone;
        let cursor = match start {
            Start::Opening => Cursor {
                seq: meta.f,
                ..cursor
            },
            Start::After => cursor,
        };
        if !live {
            // Whether the owner is gone is the store's to know (asked only where it changes
            // the answer: a standalone cursor, or a call's end position); the rest is the
            // rule's.
            let owner_gone = meta.end.is_none()
                && (meta.kind() == StreamKind::Standalone || cursor.seq == Cursor::END)
                && s.alive(&meta.o).await == Some(false);
            let stored = Stored {
                kind: meta.kind(),
                first: meta.f,
                end_last: meta.end.as_ref().map(|e| e.last),
                // How far the stream went: its entries say, or its meta when the store lost
                // them (restarted empty, its running calls' facts written again).
                last_added: first.last_added.max(meta.l),
                next_prev: first.entries.first().map(|e| e.prev),
                owner_gone,
                unanswered: meta.unanswered_any(cursor.seq),
            };
            let known = Known::from_store(&stored, cursor.seq);
            match decide(&cursor, session.epoch(), &known) {
                Decision::Attach => {}
                Decision::GapWithErrors => {
                    s.metrics.store_follow_gaps.inc();
                    let ids = meta.unanswered_at(cursor.seq);
                    return Ok(Followed::Gap(gap_frames(&cursor.text(), true, &ids)));
                }
                Decision::Refuse(e) => return Err(FollowError::Refused(e)),
                Decision::Reattach { lost, reason, .. } => {
                    return Err(FollowError::Reattach { lost, reason })
                }
            }
        }
        let mut follower = Follower {
            shared: s.clone(),
            tag,
            cursor,
            at: cursor.seq,
            meta,
            reported: None,
            reported_at: 0,
        };
        let mut out = BytesMut::new();
        let (replay, done) = follower.take(first, &mut out);
        let ended = done.is_some();
        let here = cursor.text();
        // A client re-attaching to the session (its own standalone cursor could not be
        // resumed) is told so, and whether it lost events, as a local re-attach tells it.
        let first = match reattach
            .and_then(|r| opening_frame(&here, cursor.stream, false, Some(r), None))
        {
            Some(frame) => frame,
            None => resumed_frame(&here, cursor.stream, follower.meta.kind(), replay, ended),
        };
        let mut opening = BytesMut::from(&first[..]);
        opening.put_slice(&out);
        if let Some(last) = done {
            opening.put_slice(&last);
        }
        // One frame waits for the client at a time: what the follower holds is that frame and
        // the one it reads next, both counted.
        let (tx, rx) = mpsc::channel(1);
        charge.set(opening.len(), 0);
        let _ = tx.try_send(opening.freeze());
        if !ended {
            follower.report(true);
            tokio::spawn(follower.run(tx, charge));
        }
        s.metrics.store_follows.inc();
        Ok(Followed::Body(FollowBody { rx }, replay))
    }
}

impl Shared {
    /// The meta of `stream` and its entries after position `after`, in one transaction, with
    /// the stream's last added position if `last`; `None` when the store did not answer
    /// (counted).
    async fn read(&self, tag: &Tag, stream: u32, after: u64, last: bool) -> Option<Read> {
        // Bounded in the store, before anything is sent: a meta or an entry's value larger than
        // an owner writes (a store writer's, not a replica's) is not read into this replica's
        // memory (R5-11: a follower read a 200 MiB entry whole, past its budget).
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("EVAL")
            .arg(META_BOUNDED)
            .arg(1)
            .arg(tag.meta(stream))
            .arg(self.max_entry_bytes)
            .cmd("EVAL")
            .arg(RANGE_BOUNDED)
            .arg(1)
            .arg(tag.events(stream))
            // The end's position is after every entry; one past it is no entry id.
            .arg(format!("({}", wire::entry_id(after.min(Cursor::END - 1))))
            .arg(READ_ENTRIES)
            .arg(self.max_entry_bytes);
        let (meta, range, last_added) = if last {
            pipe.cmd("EVAL")
                .arg(LAST_ADDED)
                .arg(1)
                .arg(tag.events(stream));
            let (meta, range, last): (Option<String>, StreamRangeReply, Option<String>) =
                self.run(&pipe, "follow").await?;
            (meta, range, last.as_deref().and_then(wire::entry_seq))
        } else {
            let (meta, range): (Option<String>, StreamRangeReply) =
                self.run(&pipe, "follow").await?;
            (meta, range, None)
        };
        let meta = meta.and_then(|m| serde_json::from_str::<Meta>(&m).ok());
        // A stream ended (by its owner, or `lost` by a follower when the owner's lease lapsed)
        // is what the store held up to its end: entries an owner fenced too late wrote after
        // it are nothing.
        let end = meta.as_ref().and_then(|m| m.end.as_ref()).map(|e| e.last);
        let entries = range
            .ids
            .into_iter()
            .filter(|id| end.is_none_or(|last| wire::entry_seq(&id.id).is_none_or(|s| s <= last)))
            .map(|id| {
                let prev = match id.map.get("p") {
                    Some(redis::Value::BulkString(b)) => {
                        std::str::from_utf8(b).ok().and_then(|p| p.parse().ok())
                    }
                    Some(redis::Value::Int(n)) => u64::try_from(*n).ok(),
                    _ => None,
                };
                let mut events = match id.map.get("e") {
                    Some(redis::Value::BulkString(b)) => Some(b.clone()),
                    _ => None,
                };
                if self.seal {
                    // Sealed by the owner under this session, stream and position: one that
                    // does not open was not (another key, moved, altered) and is no event.
                    let last = wire::entry_seq(&id.id);
                    events = events.and_then(|mut e| {
                        wire::open(&self.keys, tag, stream, last?, &mut e).ok()?;
                        Some(e)
                    });
                }
                match (prev, events) {
                    (Some(prev), Some(events)) => Entry { prev, events },
                    // An entry that does not read is a hole in the chain: the gap.
                    _ => Entry {
                        prev: u64::MAX,
                        events: Vec::new(),
                    },
                }
            })
            .collect();
        Some(Read {
            meta,
            entries,
            last_added,
        })
    }
}

/// A follower's state: where its client is in the stream.
struct Follower {
    shared: Arc<Shared>,
    tag: Tag,
    cursor: Cursor,
    /// The last position written to the client.
    at: u64,
    meta: Meta,
    /// When the follower last said in the store where it is (flow control: the owner guards
    /// the events after it), and the position it said.
    reported: Option<tokio::time::Instant>,
    reported_at: u64,
}

impl Follower {
    /// Writes to `out` the events of `read` after the client's position, and, when the stream
    /// is over for this client (it ended and all was written, or a hole), its last frames.
    /// Returns how many events were written and the last frames, if over.
    fn take(&mut self, read: Read, out: &mut BytesMut) -> (usize, Option<Bytes>) {
        if let Some(m) = read.meta {
            self.meta = m;
        }
        let mut written = 0;
        for entry in &read.entries {
            if entry.prev > self.at {
                return (written, Some(self.gap()));
            }
            let Ok(events) = wire::unpack(&entry.events) else {
                tracing::warn!(
                    mcp.stream = self.cursor.stream,
                    "an entry in the store does not unpack: answered as a gap"
                );
                return (written, Some(self.gap()));
            };
            for e in events {
                if e.seq <= self.at {
                    continue;
                }
                let id = Cursor {
                    seq: e.seq,
                    ..self.cursor
                }
                .text();
                out.put_slice(b"id: ");
                out.put_slice(id.as_bytes());
                out.put_u8(b'\n');
                if e.message {
                    out.put_slice(b"event: message\n");
                }
                out.put_slice(e.body);
                self.at = e.seq;
                written += 1;
            }
        }
        let Some(end) = &self.meta.end else {
            return (written, None);
        };
        if self.at >= end.last {
            // At the end's own position, as the owner's clients are told: a client that
            // comes back before it did not read these, and is told again.
            let here = self.cursor.end().text();
            let open = self.meta.unanswered_at(self.at);
            let last = match &end.failed {
                // As the owner's clients are told: the cause as the owner wrote it.
                Some(cause) => crate::jsonrpc::upstream_failure_frames(&here, true, cause, &open),
                None if !open.is_empty() => {
                    upstream_ended_frames(&here, true, &End::Complete, &open)
                }
                None => Bytes::new(),
            };
            return (written, Some(last));
        }
        if read.entries.len() < READ_ENTRIES {
            // Ended, and the events before its end are not in the store: lost.
            return (written, Some(self.gap()));
        }
        (written, None)
    }

    fn here(&self) -> String {
        Cursor {
            seq: self.at,
            ..self.cursor
        }
        .text()
    }

    /// The explicit gap: the client's requests still unanswered get their errors.
    fn gap(&self) -> Bytes {
        self.shared.metrics.store_follow_gaps.inc();
        gap_frames(&self.here(), true, &self.meta.unanswered_at(self.at))
    }

    /// Says in the store where the client is, at most every [`REPORT_EVERY`] unless `now`.
    fn report(&mut self, now: bool) {
        if !now && self.reported.is_some_and(|t| t.elapsed() < REPORT_EVERY) {
            return;
        }
        self.reported = Some(tokio::time::Instant::now());
        self.reported_at = self.at;
        self.shared.queue.push(Write::Progress {
            tag: self.tag.clone(),
            stream: self.cursor.stream,
            at: Some(wire::progress_value(self.at, wire::unix_ms())),
            ttl: self.shared.progress_ttl,
        });
    }

    /// The live tail, then the follower's progress taken back from the store.
    async fn run(mut self, tx: mpsc::Sender<Bytes>, charge: Charge) {
        self.tail(tx, charge).await;
        self.shared.queue.push(Write::Progress {
            tag: self.tag.clone(),
            stream: self.cursor.stream,
            at: None,
            ttl: self.shared.progress_ttl,
        });
    }

    /// Polls the stream's entries until the stream is over for this client, or the client
    /// is gone.
    async fn tail(&mut self, tx: mpsc::Sender<Bytes>, mut charge: Charge) {
        let mut wait = MIN_POLL;
        let keepalive = self.shared.keepalive;
        let mut quiet = Duration::ZERO;
        // Looked at first at once: an owner may be gone before its client came back.
        let mut owner_checked: Option<tokio::time::Instant> = None;
        let mut draining = self.shared.draining.subscribe();
        loop {
            if *draining.borrow_and_update() {
                let _ = tx.send(self.resume_elsewhere()).await;
                return;
            }
            if owner_checked.is_none_or(|t| t.elapsed() >= super::OWNER_CHECK)
                && self.meta.end.is_none()
            {
                owner_checked = Some(tokio::time::Instant::now());
                // A store restarted empty moments ago lost every lease with it: the owners
                // take theirs again, and are not dead for it.
                if self.shared.alive(&self.meta.o).await == Some(false)
                    && !self.shared.newborn().await
                {
                    // The owner's lease lapsed (it died, or was paused or cut off long enough:
                    // it publishes nothing under that lease again). The stream ends `lost` in
                    // the store where this client is, unless it ended first: one end in the
                    // fleet, told to whoever resumes it. Said at once, never left to the
                    // client's timeout.
                    match self
                        .shared
                        .lose(&self.tag, self.cursor.stream, self.at)
                        .await
                    {
                        Some(Some((decided, meta))) => {
                            if decided {
                                self.owner_lost_counted();
                            }
                            // The end, as the store has it, is served by the next read.
                            self.meta = meta;
                        }
                        Some(None) => {
                            self.owner_lost_counted();
                            let _ = tx.send(self.owner_lost()).await;
                            return;
                        }
                        // The store did not say: looked at again at the next check.
                        None => {}
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = tx.closed() => return,
                _ = draining.changed() => continue,
            }
            // The frame sent last may still wait in the channel: counted until the next one.
            charge.room_for(READ_ROOM).await;
            let Some(read) = self
                .shared
                .read(&self.tag, self.cursor.stream, self.at, false)
                .await
            else {
                // The store did not answer: the client is told to resume (it comes back, to
                // this replica or another, from where it is).
                let _ = tx.send(self.resume_elsewhere()).await;
                return;
            };
            let full = read.entries.len() == READ_ENTRIES;
            let mut out = BytesMut::new();
            let (written, done) = self.take(read, &mut out);
            charge.set(charge.held().max(out.len()), 0);
            if let Some(last) = done {
                out.put_slice(&last);
                let _ = tx.send(out.freeze()).await;
                return;
            }
            if written > 0 {
                quiet = Duration::ZERO;
                wait = MIN_POLL;
                let len = out.len();
                if tx.send(out.freeze()).await.is_err() {
                    return;
                }
                // The channel holds one frame: the one before it was taken.
                charge.set(len, 0);
                self.report(false);
                if full {
                    wait = Duration::ZERO;
                }
            } else {
                // Nothing new: the owner may be waiting for this client's progress to make
                // room (flow control), so where it is is said now; and while it waits, that it
                // still waits (a client that takes what comes is not stalled: the owner keeps
                // guarding what it has not read, as for a local client).
                self.report(self.at > self.reported_at);
                quiet += wait;
                let most = if self.meta.kind() == StreamKind::Standalone {
                    MAX_POLL_STANDALONE
                } else {
                    MAX_POLL
                };
                wait = (wait * 2).min(most);
                if keepalive.is_some_and(|k| quiet >= k) {
                    quiet = Duration::ZERO;
                    if tx
                        .send(Bytes::from_static(crate::sse::KEEPALIVE))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    }

    /// The end of a stream whose owner is gone: the upstream failure, and an error for each
    /// request its client has no answer to.
    fn owner_lost(&self) -> Bytes {
        crate::jsonrpc::upstream_failure_frames(
            &self.cursor.end().text(),
            true,
            wire::OWNER_LOST,
            &self.meta.unanswered_at(self.at),
        )
    }

    /// This replica found the stream's owner gone: counted and said.
    fn owner_lost_counted(&self) {
        self.shared.metrics.store_owners_lost.inc();
        tracing::info!(mcp.stream = self.cursor.stream, owner = %self.meta.o, "the replica reading this stream upstream is gone");
    }

    /// The client's last frame when the store stops answering, or this replica drains: resume
    /// from where it is (elsewhere).
    fn resume_elsewhere(&self) -> Bytes {
        crate::session::resumption_required_frame(&self.here())
    }
}
