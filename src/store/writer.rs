//! The one task that writes to the store what the replica queues (publications, touches,
//! tombstones): whatever is queued while a pipeline is out goes in the next one, so a burst
//! costs a round trip per batch, not per write. The queue is bounded in bytes (a sixteenth of
//! `--memory-budget`: past it, a publication's events are dropped and its stream's chain in
//! the store shows the hole, a reader answers the explicit gap, its facts still go) and in
//! writes ([`MAX_WRITES`]: past it, what can be lost is, see [`Queue::push`]); followers'
//! progress is coalesced per stream, outside the queue (only the last report counts).
//!
//! Fencing: a publication of a stream opened under a generation of the lease that is dead
//! (`lease`) writes no event; it ends the stream's meta `lost` instead, and an owner's meta
//! never replaces one that ended (the store decides which end came first: [`META`]).
//!
//! Knows the store's wire form and the Redis client; nothing of sessions' rules.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionManager;
use tokio::sync::mpsc;

use super::lease::Lease;
use super::wire::{self, entry_id, Meta, MetaEnd, Record, Tag};
use super::{lock, Breaker};
use crate::metrics::Metrics;
use crate::session::{End, Published, StreamKind};

/// Most writes in one pipeline.
const MAX_BATCH: usize = 64;

/// Writes queued at most that may be lost (publications of events only, touches): past it
/// they are dropped; the writes of a stream's or a session's facts, at most twice as many.
const MAX_WRITES: usize = 1 << 14;

/// How long a tombstone stays, so that replicas holding the session learn it ended.
const TOMBSTONE_MS: i64 = 60_000;

/// One write the replica wants in the store.
pub(super) enum Write {
    Publish {
        tag: Tag,
        /// The keys of the requests the stream carries (on its opening and its end): set to
        /// it at the opening, to its end (and its shorter TTL) at the end, unless another
        /// principal's request holds them ([`CARRY`]).
        carries: Vec<String>,
        /// The session's record, on the stream's opening and end: written (unless it is there)
        /// only when this publication was deferred (the store may have lost the record).
        record: Option<Record>,
        stream: u32,
        /// `<replica>/<generation>`: the owner, under the generation the stream opened in.
        owner: Arc<str>,
        generation: u64,
        published: Published,
        /// The events, packed (`wire::pack_event`); empty when dropped for the queue's bound.
        packed: Vec<u8>,
        /// The TTL of the stream's keys while it runs (`--session-ttl`), and once it ended
        /// (long enough for its client to come back for its end).
        ttl: i64,
        ended_ttl: i64,
    },
    /// A session's record, written unless one is there already, stream numbers handed out
    /// up to `sn`.
    Record {
        tag: Tag,
        record: Record,
        sn: u32,
        ttl: i64,
    },
    Gone {
        tag: Tag,
    },
    /// Where a client following `stream` from the store is (its owner polls it: flow
    /// control across replicas); `None`: it left, the field goes. Coalesced per stream: only
    /// the last one queued is written.
    Progress {
        tag: Tag,
        stream: u32,
        at: Option<String>,
        /// A report is worth nothing after the stall budget.
        ttl: i64,
    },
    /// Progress is waiting in the coalesced reports (the writer takes them all).
    Progressed,
    /// A POST's claimed request ids given back, unless a stream took them meanwhile.
    Release {
        keys: Vec<String>,
        token: String,
    },
}

/// Writes a session's record (`ARGV[2..]`: its fields and values) unless it exists already,
/// and sets its TTL (`ARGV[1]` ms): a record written again (a catch-up after an outage, a
/// creation whose answer timed out) never resets what other replicas claimed in it.
const RECORD: &str = "if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('HSET', KEYS[1], unpack(ARGV, 2)) end redis.call('PEXPIRE', KEYS[1], ARGV[1])";

/// Adds the commands that write `r` as `tag`'s record (see [`RECORD`]).
pub(super) fn record(pipe: &mut redis::Pipeline, tag: &Tag, r: &Record, sn: u32, ttl: i64) {
    let cmd = pipe
        .cmd("EVAL")
        .arg(RECORD)
        .arg(1)
        .arg(tag.record())
        .arg(ttl);
    for (k, v) in r.fields(sn) {
        cmd.arg(k).arg(v);
    }
    cmd.ignore();
}

/// Sets a stream's meta (`KEYS[1]`) to `ARGV[1]` for `ARGV[2]` ms unless the one there ended
/// (its owner's end, or `lost` decided by a follower, came first: a stream ends once).
/// `"end":` appears in a meta's JSON only as its key: a quote inside a string is escaped.
const META: &str = "local m = redis.call('GET', KEYS[1]) if m and string.find(m, '\"end\":', 1, true) then return 0 end redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1";

/// Ends a stream's meta (`KEYS[1]`) `lost` at `ARGV[1]` (cause `ARGV[2]`, JSON; kept
/// `ARGV[3]` ms) unless it ended already: `{1, meta}` when this call decided, `{0, meta}` when
/// the meta had ended, nil without a meta.
pub(super) const LOSE: &str = r#"
local m = redis.call('GET', KEYS[1])
if not m then return false end
if string.find(m, '"end":', 1, true) then return {0, m} end
m = string.sub(m, 1, -2) .. ',"end":{"last":' .. ARGV[1] .. ',"failed":' .. ARGV[2] .. '}}'
redis.call('SET', KEYS[1], m, 'PX', ARGV[3])
return {1, m}
"#;

/// Forgets the record's (`KEYS[1]`) held standalone stream if it is still `ARGV[1]`.
const UNHOLD: &str = "if redis.call('HGET', KEYS[1], 'hold') == ARGV[1] then redis.call('HDEL', KEYS[1], 'hold') end";

/// Sets each of `KEYS` (a stream's request ids) to `ARGV[1]` (what carries them) for `ARGV[3]`
/// ms, unless another principal than `ARGV[2]` holds it (an id another principal's call
/// answered is that call's until it expires).
const CARRY: &str = "for _, k in ipairs(KEYS) do local v = redis.call('GET', k) if not v or string.sub(v, 3, 2 + #ARGV[2]) == ARGV[2] then redis.call('SET', k, ARGV[1], 'PX', ARGV[3]) end end";

/// Deletes each of `KEYS` that still holds `ARGV[1]` (the claim's token).
const RELEASE: &str = "for _, k in ipairs(KEYS) do if redis.call('GET', k) == ARGV[1] then redis.call('DEL', k) end end";

/// Most writes kept while the store is away ([`Write::deferred`]): past it the oldest go
/// (counted in `store_dropped_bytes` as nothing: their facts are lost to the fleet).
const MAX_DEFERRED: usize = 16_384;

impl Write {
    /// What of this write is kept to be written once the store is back: the facts (a stream's
    /// opening, answers and end with its request ids' claims, and the session's record with
    /// them; records, ends, claims given back), never the events or a follower's progress.
    fn deferred(self, out: &mut std::collections::VecDeque<Write>) {
        let kept = match self {
            Write::Publish {
                tag,
                carries,
                record,
                stream,
                owner,
                generation,
                published,
                ttl,
                ended_ttl,
                packed: _,
            } if published.opened || published.answered || published.end.is_some() => {
                if let Some(r) = record {
                    out.push_back(Write::Record {
                        tag: tag.clone(),
                        record: r,
                        sn: super::rewritten_block(),
                        ttl,
                    });
                }
                Some(Write::Publish {
                    tag,
                    carries,
                    record: None,
                    stream,
                    owner,
                    generation,
                    published,
                    packed: Vec::new(),
                    ttl,
                    ended_ttl,
                })
            }
            Write::Publish { .. } | Write::Progress { .. } | Write::Progressed => None,
            w @ (Write::Record { .. } | Write::Gone { .. } | Write::Release { .. }) => Some(w),
        };
        out.extend(kept);
        while out.len() > MAX_DEFERRED {
            out.pop_front();
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Write::Publish { packed, .. } => packed.len(),
            _ => 0,
        }
    }

    /// Whether losing it costs the fleet no fact: a publication of events only (its
    /// stream's chain shows the hole), a touch (the next one writes it), a progress report.
    fn may_be_lost(&self) -> bool {
        match self {
            Write::Publish { published: p, .. } => !(p.opened || p.answered || p.end.is_some()),
            Write::Record { .. } | Write::Progress { .. } | Write::Progressed => true,
            Write::Gone { .. } | Write::Release { .. } => false,
        }
    }

    /// Adds this write's commands to `pipe`; `fenced`: a publication under a dead generation
    /// of the lease (its events are not written, its meta ends `lost`).
    fn commands(&self, pipe: &mut redis::Pipeline, fenced: bool) {
        match self {
            Write::Publish {
                tag,
                carries,
                record: _,
                stream,
                owner,
                generation: _,
                published: p,
                packed,
                ttl,
                ended_ttl,
            } => {
                let record = tag.record();
                let ttl = if p.end.is_some() || fenced {
                    *ended_ttl
                } else {
                    *ttl
                };
                // A fenced stream's requests still point at it (ended `lost`): a
                // retransmission elsewhere is told the explicit failure, never run again.
                if !carries.is_empty() {
                    pipe.cmd("EVAL")
                        .arg(CARRY)
                        .arg(carries.len())
                        .arg(carries)
                        .arg(wire::carried(
                            p.principal,
                            *stream,
                            p.end.is_some() || fenced,
                        ))
                        .arg(wire::principal_text(p.principal))
                        .arg(ttl)
                        .ignore();
                }
                if fenced {
                    return fenced_publication(pipe, tag, *stream, owner, p, ttl);
                }
                let meta = |end: Option<MetaEnd>| Meta {
                    o: owner.to_string(),
                    k: p.kind.as_str().to_owned(),
                    pr: wire::principal_text(p.principal),
                    f: p.first_seq,
                    l: Some(p.last.max(p.prev)),
                    end,
                    req: p
                        .requests
                        .iter()
                        .map(|(id, at)| (id.clone(), at.unwrap_or(0)))
                        .collect(),
                };
                let events = tag.events(*stream);
                if !packed.is_empty() {
                    // Trimmed to what the owner's window still holds of the stream (entries
                    // wholly before it go; `~`: whole nodes, so a little more stays).
                    pipe.cmd("XADD")
                        .arg(&events)
                        .arg("MINID")
                        .arg("~")
                        .arg(entry_id(p.low))
                        .arg(entry_id(p.last))
                        .arg("p")
                        .arg(p.prev)
                        .arg("e")
                        .arg(packed.as_slice())
                        .ignore();
                }
                if !packed.is_empty() || p.end.is_some() {
                    pipe.pexpire(&events, ttl).ignore();
                }
                // The session's standalone stream is held here: a replica whose client wants it
                // follows it from the store instead of asking the upstream for another.
                if p.kind == StreamKind::Standalone && p.opened && p.end.is_none() {
                    pipe.hset(&record, "hold", *stream).ignore();
                }
                if p.kind == StreamKind::Standalone && p.end.is_some() {
                    pipe.cmd("EVAL")
                        .arg(UNHOLD)
                        .arg(1)
                        .arg(&record)
                        .arg(*stream)
                        .ignore();
                }
                // The facts after the events they speak of: a reader that sees them sees those.
                if p.opened || p.answered || p.end.is_some() {
                    let end = p.end.as_ref().map(|end| MetaEnd {
                        last: p.last,
                        failed: match end {
                            End::Complete => None,
                            End::Failed(cause) => Some(cause.to_string()),
                        },
                    });
                    let m = serde_json::to_string(&meta(end)).unwrap_or_default();
                    set_meta(pipe, tag, *stream, &m, ttl);
                }
            }
            Write::Record {
                tag,
                record: r,
                sn,
                ttl,
            } => record(pipe, tag, r, *sn, *ttl),
            Write::Progress {
                tag,
                stream,
                at,
                ttl,
            } => progress(pipe, tag.progress(*stream), at.as_deref(), *ttl),
            Write::Progressed => {}
            Write::Release { keys, token } => {
                if !keys.is_empty() {
                    pipe.cmd("EVAL")
                        .arg(RELEASE)
                        .arg(keys.len())
                        .arg(keys)
                        .arg(token)
                        .ignore();
                }
            }
            Write::Gone { tag } => {
                pipe.publish(super::gone::CHANNEL, &**tag.text()).ignore();
                let record = tag.record();
                pipe.hset(&record, "state", "gone").ignore();
                pipe.pexpire(&record, TOMBSTONE_MS).ignore();
            }
        }
    }
}

/// Adds the commands that set a stream's meta to `m` unless it ended (see [`META`]).
fn set_meta(pipe: &mut redis::Pipeline, tag: &Tag, stream: u32, m: &str, ttl: i64) {
    pipe.cmd("EVAL")
        .arg(META)
        .arg(1)
        .arg(tag.meta(stream))
        .arg(m)
        .arg(ttl)
        .ignore();
}

/// A publication under a dead generation of the lease: no event of it is written, the
/// stream's meta ends `lost` where the store's events of it end (`p.prev`: what was published
/// before), unless it ended already.
fn fenced_publication(
    pipe: &mut redis::Pipeline,
    tag: &Tag,
    stream: u32,
    owner: &str,
    p: &Published,
    ttl: i64,
) {
    let meta = Meta {
        o: owner.to_owned(),
        k: p.kind.as_str().to_owned(),
        pr: wire::principal_text(p.principal),
        f: p.first_seq,
        l: Some(p.last.max(p.prev)),
        // At the last position the owner tagged, published or not: a client may have read
        // those events from the owner itself, and its cursor is then within the stream (the
        // events the fleet lacks are the explicit gap, the end its failure), never ahead.
        end: Some(MetaEnd {
            last: p.last.max(p.prev),
            failed: Some(wire::OWNER_LOST.to_owned()),
        }),
        req: p
            .requests
            .iter()
            .map(|(id, at)| (id.clone(), at.filter(|&at| at <= p.prev).unwrap_or(0)))
            .collect(),
    };
    let m = serde_json::to_string(&meta).unwrap_or_default();
    set_meta(pipe, tag, stream, &m, ttl);
    if p.kind == StreamKind::Standalone && (p.opened || p.end.is_some()) {
        pipe.cmd("EVAL")
            .arg(UNHOLD)
            .arg(1)
            .arg(tag.record())
            .arg(stream)
            .ignore();
    }
}

fn progress(pipe: &mut redis::Pipeline, key: String, at: Option<&str>, ttl: i64) {
    match at {
        Some(at) => pipe.cmd("SET").arg(key).arg(at).arg("PX").arg(ttl).ignore(),
        None => pipe.del(key).ignore(),
    };
}

/// Followers' reports, coalesced: the last one per progress key, with its TTL.
type Reports = Mutex<HashMap<String, (Option<String>, i64)>>;

/// The writer's queue: bounded in writes ([`MAX_WRITES`]) and in the bytes of their events.
pub(super) struct Queue {
    tx: mpsc::UnboundedSender<Write>,
    bytes: Arc<AtomicUsize>,
    writes: Arc<AtomicUsize>,
    reports: Arc<Reports>,
    limit: usize,
    metrics: Arc<Metrics>,
}

impl Queue {
    /// Queues `w`; its events are dropped (the store's chain shows the hole) when the queue
    /// holds its bound of bytes already. Past [`MAX_WRITES`] queued, a write that may be lost
    /// is dropped; past twice that, any (counted, and said once a while).
    pub(super) fn push(&self, mut w: Write) {
        if let Write::Progress {
            tag,
            stream,
            at,
            ttl,
        } = w
        {
            let mut reports = lock(&self.reports);
            let first = reports.is_empty();
            reports.insert(tag.progress(stream), (at, ttl));
            drop(reports);
            if !first {
                return;
            }
            w = Write::Progressed;
        }
        let queued = self.writes.load(Ordering::Relaxed);
        if queued >= 2 * MAX_WRITES || (queued >= MAX_WRITES && w.may_be_lost()) {
            self.metrics.store_dropped_writes.inc();
            if !w.may_be_lost() {
                tracing::warn!("the store's write queue is full: a stream's or a session's fact is not written to the fleet");
            }
            if let Write::Progressed = w {
                lock(&self.reports).clear();
            }
            return;
        }
        let len = w.bytes();
        if len > 0 && self.bytes.load(Ordering::Relaxed) + len > self.limit {
            if let Write::Publish { packed, .. } = &mut w {
                *packed = Vec::new();
            }
            self.metrics.store_dropped_bytes.inc_by(len as u64);
        } else {
            self.bytes.fetch_add(len, Ordering::Relaxed);
        }
        self.writes.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(w).is_err() {
            // The writer stopped with its owner: nothing is written any more.
            self.writes.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Starts the writer on `conn`, owned by `tasks`: each pipeline bounded by `timeout`, the
/// queue's events by `limit` bytes, what it publishes fenced by `lease`.
pub(super) fn spawn(
    tasks: &mut super::Tasks,
    conn: ConnectionManager,
    timeout: Duration,
    limit: usize,
    breaker: Arc<Breaker>,
    lease: Arc<Lease>,
    metrics: Arc<Metrics>,
) -> Queue {
    let (tx, rx) = mpsc::unbounded_channel();
    let queue = Queue {
        tx,
        bytes: Arc::new(AtomicUsize::new(0)),
        writes: Arc::new(AtomicUsize::new(0)),
        reports: Arc::default(),
        limit: limit.max(1 << 20),
        metrics: metrics.clone(),
    };
    tasks.spawn(run(Writer {
        conn,
        rx,
        bytes: queue.bytes.clone(),
        writes: queue.writes.clone(),
        reports: queue.reports.clone(),
        timeout,
        breaker,
        lease,
        metrics,
    }));
    queue
}

/// Whether a store's refusal of a pipeline may pass: its connection, a timeout, or a store
/// that cannot take writes for now (`OOM` under `noeviction`, a replica, loading, busy).
fn transient(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.code(),
            Some("OOM" | "READONLY" | "LOADING" | "BUSY" | "TRYAGAIN" | "MASTERDOWN")
        )
}

/// The writer task's own.
struct Writer {
    conn: ConnectionManager,
    rx: mpsc::UnboundedReceiver<Write>,
    bytes: Arc<AtomicUsize>,
    writes: Arc<AtomicUsize>,
    reports: Arc<Reports>,
    timeout: Duration,
    breaker: Arc<Breaker>,
    lease: Arc<Lease>,
    metrics: Arc<Metrics>,
}

async fn run(mut w: Writer) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    // What the store did not take while it was away: written first once it is back, so a
    // call forwarded meanwhile has its claim in the store as soon as it can be.
    let mut deferred = std::collections::VecDeque::new();
    loop {
        if deferred.is_empty() {
            if w.rx.recv_many(&mut batch, MAX_BATCH).await == 0 {
                return;
            }
        } else {
            // Nothing new for a probe's time: the deferred writes are tried again.
            let more = w.rx.recv_many(&mut batch, MAX_BATCH);
            if let Ok(0) = tokio::time::timeout(super::PROBE_EVERY, more).await {
                return;
            }
        }
        let held: usize = batch.iter().map(Write::bytes).sum();
        w.writes.fetch_sub(batch.len(), Ordering::Relaxed);
        let reports = std::mem::take(&mut *lock(&w.reports));
        if !w.breaker.allows() {
            // The store is down for this replica: the events it would have taken are lost to
            // it (a stream's chain shows the hole, a resume elsewhere the explicit gap); the
            // facts wait for it.
            w.bytes.fetch_sub(held, Ordering::Relaxed);
            w.metrics.store_dropped_bytes.inc_by(held as u64);
            for write in batch.drain(..) {
                write.deferred(&mut deferred);
            }
            continue;
        }
        let mut pipe = redis::pipe();
        let sending: Vec<Write> = deferred.drain(..).chain(batch.drain(..)).collect();
        for write in &sending {
            // Looked at for each, in order: a generation found dead mid-batch fences the rest.
            let fenced = match write {
                Write::Publish { generation, .. } => !w.lease.publishes(*generation),
                _ => false,
            };
            write.commands(&mut pipe, fenced);
        }
        for (key, (at, ttl)) in reports {
            progress(&mut pipe, key, at.as_deref(), ttl);
        }
        let sent = tokio::time::timeout(w.timeout, pipe.query_async::<()>(&mut w.conn)).await;
        w.bytes.fetch_sub(held, Ordering::Relaxed);
        let failed = match sent {
            Ok(Ok(())) => {
                w.breaker.succeeded();
                w.metrics.store_writes.inc_by(sending.len() as u64);
                false
            }
            Ok(Err(e)) => {
                w.breaker.failed();
                tracing::debug!(error = %e, writes = sending.len(), "store writes failed");
                // Kept for later only when the store may take them later (gone, full,
                // loading): a write it refuses for what it is would be refused forever, and
                // hold every later write back with it.
                transient(&e)
            }
            Err(_) => {
                w.breaker.failed();
                tracing::debug!(timeout = ?w.timeout, writes = sending.len(), "store writes timed out");
                true
            }
        };
        if failed {
            for write in sending {
                write.deferred(&mut deferred);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::Principal;

    fn queue() -> (Queue, mpsc::UnboundedReceiver<Write>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = Queue {
            tx,
            bytes: Arc::default(),
            writes: Arc::default(),
            reports: Arc::default(),
            limit: 1 << 20,
            metrics: Arc::new(Metrics::new()),
        };
        (queue, rx)
    }

    fn touch(n: usize) -> Write {
        Write::Record {
            tag: Tag::from_text(format!("{n:032x}").into()),
            record: Record {
                minted: false,
                epoch: 1,
                endpoint: "/mcp".into(),
                principal: Principal::default(),
                share: Principal::default(),
                protocol_version: None,
                gone: false,
            },
            sn: 0,
            ttl: 1000,
        }
    }

    #[test]
    fn the_queue_is_bounded_in_writes_and_keeps_facts_longest() {
        let (q, mut rx) = queue();
        for n in 0..MAX_WRITES + 10 {
            q.push(touch(n));
        }
        assert_eq!(
            q.writes.load(Ordering::Relaxed),
            MAX_WRITES,
            "touches stop at the bound"
        );
        for n in 0..2 * MAX_WRITES {
            q.push(Write::Gone {
                tag: Tag::from_text(format!("{n:032x}").into()),
            });
        }
        assert_eq!(
            q.writes.load(Ordering::Relaxed),
            2 * MAX_WRITES,
            "facts, at twice it"
        );
        assert_eq!(q.metrics.store_dropped_writes.get(), 10 + MAX_WRITES as u64);
        let mut n = 0;
        while rx.try_recv().is_ok() {
            n += 1;
        }
        assert_eq!(n, 2 * MAX_WRITES);
    }

    #[test]
    fn progress_is_coalesced_per_stream() {
        let (q, mut rx) = queue();
        let tag = Tag::from_text("0123".into());
        for at in 0..1000u64 {
            for stream in [1, 2] {
                q.push(Write::Progress {
                    tag: tag.clone(),
                    stream,
                    at: Some(format!("{at}:0")),
                    ttl: 100,
                });
            }
        }
        // One wake-up queued; the last report of each stream waits for the writer.
        assert!(matches!(rx.try_recv(), Ok(Write::Progressed)));
        assert!(rx.try_recv().is_err());
        let reports = lock(&q.reports);
        assert_eq!(reports.len(), 2);
        assert_eq!(reports[&tag.progress(1)].0.as_deref(), Some("999:0"));
    }
}
