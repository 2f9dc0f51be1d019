//! The one task that writes to the store what the replica queues (publications, touches,
//! tombstones): whatever is queued while a pipeline is out goes in the next one, so a burst
//! costs a round trip per batch, not per write. The queue's bytes are bounded (a sixteenth of
//! `--memory-budget`): past it, a publication's events are dropped and its stream's chain in
//! the store shows the hole (a reader answers the explicit gap), its facts still go.
//!
//! Knows the store's wire form and the Redis client; nothing of sessions' rules.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use tokio::sync::mpsc;

use super::wire::{self, entry_id, Meta, MetaEnd, Record, Tag};
use super::Breaker;
use crate::metrics::Metrics;
use crate::session::{End, Published, StreamKind};

/// Most writes in one pipeline.
const MAX_BATCH: usize = 64;

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
        owner: Arc<str>,
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
    /// control across replicas); `None`: it left, the field goes.
    Progress {
        tag: Tag,
        stream: u32,
        at: Option<String>,
        /// A report is worth nothing after the stall budget.
        ttl: i64,
    },
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
                    published,
                    packed: Vec::new(),
                    ttl,
                    ended_ttl,
                })
            }
            Write::Publish { .. } | Write::Progress { .. } => None,
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

    /// Adds this write's commands to `pipe`.
    fn commands(&self, pipe: &mut redis::Pipeline) {
        match self {
            Write::Publish {
                tag,
                carries,
                record: _,
                stream,
                owner,
                published: p,
                packed,
                ttl,
                ended_ttl,
            } => {
                let record = tag.record();
                let ttl = if p.end.is_some() { *ended_ttl } else { *ttl };
                if !carries.is_empty() {
                    pipe.cmd("EVAL")
                        .arg(CARRY)
                        .arg(carries.len())
                        .arg(carries)
                        .arg(wire::carried(p.principal, *stream, p.end.is_some()))
                        .arg(wire::principal_text(p.principal))
                        .arg(ttl)
                        .ignore();
                }
                let meta = |end: Option<MetaEnd>| Meta {
                    o: owner.to_string(),
                    k: p.kind.as_str().to_owned(),
                    pr: wire::principal_text(p.principal),
                    f: p.first_seq,
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
                    pipe.cmd("SET")
                        .arg(tag.meta(*stream))
                        .arg(m)
                        .arg("PX")
                        .arg(ttl)
                        .ignore();
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
            } => {
                let key = tag.progress(*stream);
                match at {
                    Some(at) => pipe
                        .cmd("SET")
                        .arg(key)
                        .arg(at)
                        .arg("PX")
                        .arg(*ttl)
                        .ignore(),
                    None => pipe.del(key).ignore(),
                };
            }
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

/// The writer's queue: unbounded in writes, bounded in the bytes of their events.
pub(super) struct Queue {
    tx: mpsc::UnboundedSender<Write>,
    bytes: Arc<AtomicUsize>,
    limit: usize,
    metrics: Arc<Metrics>,
}

impl Queue {
    /// Queues `w`; its events are dropped (the store's chain shows the hole) when the queue
    /// holds its bound already.
    pub(super) fn push(&self, mut w: Write) {
        let len = w.bytes();
        if len > 0 && self.bytes.load(Ordering::Relaxed) + len > self.limit {
            if let Write::Publish { packed, .. } = &mut w {
                *packed = Vec::new();
            }
            self.metrics.store_dropped_bytes.inc_by(len as u64);
        } else {
            self.bytes.fetch_add(len, Ordering::Relaxed);
        }
        let _ = self.tx.send(w);
    }
}

/// Starts the writer on `conn`: each pipeline bounded by `timeout`, the queue's events by
/// `limit` bytes.
pub(super) fn spawn(
    conn: ConnectionManager,
    timeout: Duration,
    limit: usize,
    breaker: Arc<Breaker>,
    metrics: Arc<Metrics>,
) -> Queue {
    let (tx, rx) = mpsc::unbounded_channel();
    let bytes = Arc::new(AtomicUsize::new(0));
    tokio::spawn(run(
        conn,
        rx,
        bytes.clone(),
        timeout,
        breaker,
        metrics.clone(),
    ));
    Queue {
        tx,
        bytes,
        limit: limit.max(1 << 20),
        metrics,
    }
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

async fn run(
    mut conn: ConnectionManager,
    mut rx: mpsc::UnboundedReceiver<Write>,
    bytes: Arc<AtomicUsize>,
    timeout: Duration,
    breaker: Arc<Breaker>,
    metrics: Arc<Metrics>,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    // What the store did not take while it was away: written first once it is back, so a
    // call forwarded meanwhile has its claim in the store as soon as it can be.
    let mut deferred = std::collections::VecDeque::new();
    loop {
        if deferred.is_empty() {
            if rx.recv_many(&mut batch, MAX_BATCH).await == 0 {
                return;
            }
        } else {
            // Nothing new for a probe's time: the deferred writes are tried again.
            let more = rx.recv_many(&mut batch, MAX_BATCH);
            if let Ok(0) = tokio::time::timeout(super::PROBE_EVERY, more).await {
                return;
            }
        }
        let held: usize = batch.iter().map(Write::bytes).sum();
        if !breaker.allows() {
            // The store is down for this replica: the events it would have taken are lost to
            // it (a stream's chain shows the hole, a resume elsewhere the explicit gap); the
            // facts wait for it.
            bytes.fetch_sub(held, Ordering::Relaxed);
            metrics.store_dropped_bytes.inc_by(held as u64);
            for w in batch.drain(..) {
                w.deferred(&mut deferred);
            }
            continue;
        }
        let mut pipe = redis::pipe();
        let sending: Vec<Write> = deferred.drain(..).chain(batch.drain(..)).collect();
        for w in &sending {
            w.commands(&mut pipe);
        }
        let sent = tokio::time::timeout(timeout, pipe.query_async::<()>(&mut conn)).await;
        bytes.fetch_sub(held, Ordering::Relaxed);
        let failed = match sent {
            Ok(Ok(())) => {
                breaker.succeeded();
                metrics.store_writes.inc_by(sending.len() as u64);
                false
            }
            Ok(Err(e)) => {
                breaker.failed();
                tracing::debug!(error = %e, writes = sending.len(), "store writes failed");
                // Kept for later only when the store may take them later (gone, full,
                // loading): a write it refuses for what it is would be refused forever, and
                // hold every later write back with it.
                transient(&e)
            }
            Err(_) => {
                breaker.failed();
                tracing::debug!(?timeout, writes = sending.len(), "store writes timed out");
                true
            }
        };
        if failed {
            for w in sending {
                w.deferred(&mut deferred);
            }
        }
    }
}
