//! The fleet's shared store (`--store`, the Redis protocol): one seam, [`Store`], that the
//! routes and the feed layer hold. `Store::Off` (no `--store`) is the gateway as one process,
//! at its cost: every call below is a branch on it and nothing more.
//!
//! With a store, what any replica needs of a session another one created or serves is in it:
//!
//! - the session's record, written (awaited, bounded) when the session is created, read and
//!   adopted by a replica that does not hold the session, for its own principal only
//!   ([`Store::adopt`]), kept alive by the replicas that use it ([`Store::touch`]) and
//!   tombstoned when the session ends ([`Store::ended`]);
//! - each stream's facts and events, published by the replica that reads it upstream after
//!   each read ([`Store::publish`], queued, never awaited: `writer`), and served to a client
//!   that resumes it on another replica (`follow`).
//!
//! Inside: `wire` (keys, the record, a stream's meta, packed events: pure), `writer` (the one
//! task that sends every queued write, pipelined), `follow` (a resume served from the store).
//! The design, key by key: docs/design.md, "A fleet: the shared store".
//!
//! Knows the session API and the configuration; nothing of HTTP routes.

mod follow;
mod wire;
mod writer;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::aio::ConnectionManager;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::session::{Principal, Session};

pub(crate) use self::follow::{FollowBody, FollowError};
use self::wire::{Keys, Record, STREAM_BLOCK};

use self::writer::{Queue, Write};

/// The seam: no store, or a Redis-protocol one.
#[derive(Clone)]
pub(crate) enum Store {
    Off,
    Redis(Arc<Shared>),
}

/// A replica's side of the shared store.
pub(crate) struct Shared {
    conn: ConnectionManager,
    keys: Keys,
    /// This replica's name in the store (the owner of the streams it reads), random per process.
    replica: Arc<str>,
    /// The longest a request waits for the store (`--store-timeout`).
    timeout: Duration,
    session_ttl: Duration,
    window_events: usize,
    keepalive: Option<Duration>,
    queue: Queue,
    metrics: Arc<Metrics>,
    /// Milliseconds since the process started, from one clock (the touches' coalescing).
    started: tokio::time::Instant,
    /// Sessions touched in the store, by when (ms since `started`): at most one touch per
    /// session every quarter TTL.
    touched: Mutex<std::collections::HashMap<Arc<str>, u64>>,
}

/// What the store says of a session this replica does not hold.
pub(crate) enum Adoption {
    /// Adopt it: its record, and the first stream number of the block claimed for this replica.
    Adopt(Record, u32),
    /// Nothing to adopt: no such session, ended, or not the caller's (told apart nowhere: the
    /// caller gets what it would for a session the gateway never saw).
    None,
}

/// What the fleet says of a POST's request ids (see [`Store::claim`]).
pub(crate) enum IdClaim {
    /// Forward it: its ids are this replica's until the guard drops (given back then, unless a
    /// stream of this replica took them).
    Ours(IdsHeld),
    /// A stream of another replica carries them: a retransmission, resumed from the store.
    Carried(u32),
    /// No store, or it did not answer in time: as without one.
    Unknown,
}

/// A POST's request ids claimed in the store for this replica while it forwards the POST.
pub(crate) struct IdsHeld {
    shared: Arc<Shared>,
    keys: Vec<String>,
    token: String,
}

impl Drop for IdsHeld {
    fn drop(&mut self) {
        self.shared.queue.push(Write::Release {
            keys: std::mem::take(&mut self.keys),
            token: std::mem::take(&mut self.token),
        });
    }
}

/// The Lua script of a claim, one round trip: the first of `KEYS` (a POST's request ids)
/// someone else holds, or, when none is, all of them set to `ARGV[1]` (this claim's token) for
/// `ARGV[2]` ms.
const CLAIM: &str = r"
for _, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  if v and v ~= ARGV[1] then return v end
end
for _, k in ipairs(KEYS) do redis.call('SET', k, ARGV[1], 'PX', ARGV[2]) end
return false
";

/// How often a retransmission looks again while another replica forwards its ids and no
/// stream carries them yet.
const CLAIM_POLL: Duration = Duration::from_millis(20);

/// What an adoption claims: the end of the block of stream numbers, and the record's fields.
type Claimed = (i64, Vec<(String, Vec<u8>)>);

/// The Lua script of an adoption, one round trip: the record's fields, and a block of stream
/// numbers claimed for the adopting replica, only for a live record bound to the caller
/// (`ARGV[1]`: the caller's principal, `*` for any; `ARGV[2]`: the block; `ARGV[3]`: the TTL).
const ADOPT: &str = r"
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'live' then return false end
if ARGV[1] ~= '*' and redis.call('HGET', KEYS[1], 'pr') ~= ARGV[1] then return false end
local sn = redis.call('HINCRBY', KEYS[1], 'sn', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {sn, redis.call('HGETALL', KEYS[1])}
";

impl Store {
    /// The store `cfg` asks for, its writer started (needs the runtime); `Off` without one.
    pub(crate) fn new(cfg: &Config, metrics: &Arc<Metrics>) -> Store {
        let Some(settings) = &cfg.store else {
            return Store::Off;
        };
        let client = match redis::Client::open(settings.url.as_str()) {
            Ok(c) => c,
            Err(e) => {
                // The URL was checked for its scheme at startup; a client that cannot be made
                // of it is a configuration error the operator must see.
                tracing::error!(error = %e, "--store: not a Redis URL the client accepts; running without the store");
                return Store::Off;
            }
        };
        let manager = redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(settings.timeout))
            .set_connection_timeout(Some(settings.timeout.max(Duration::from_millis(500))))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let conn = match ConnectionManager::new_lazy_with_config(client, manager) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "--store: cannot make its connection; running without the store");
                return Store::Off;
            }
        };
        let mut replica = [0u8; 6];
        let _ = getrandom::getrandom(&mut replica);
        let replica: String = replica.iter().map(|b| format!("{b:02x}")).collect();
        let queue = writer::spawn(
            conn.clone(),
            settings.timeout,
            cfg.memory_budget / 16,
            metrics.clone(),
        );
        tokio::spawn(keep_lease(
            conn.clone(),
            wire::lease_key(&replica),
            settings.timeout,
        ));
        Store::Redis(Arc::new(Shared {
            conn,
            keys: Keys::derive(&settings.secret),
            replica: replica.into(),
            timeout: settings.timeout,
            session_ttl: cfg.session_ttl,
            window_events: cfg.window_events,
            keepalive: cfg.keepalive,
            queue,
            metrics: metrics.clone(),
            started: tokio::time::Instant::now(),
            touched: Default::default(),
        }))
    }

    /// The key principals are bound with: the fleet's (from its shared secret), so a session's
    /// binding means the same on every replica; `None` without a store (a key per process).
    pub(crate) fn binding_key(&self) -> Option<[u8; 32]> {
        match self {
            Store::Off => None,
            Store::Redis(s) => Some(s.keys.bind),
        }
    }

    pub(crate) fn is_on(&self) -> bool {
        matches!(self, Store::Redis(_))
    }

    /// Records a session this replica just created, before its creator hears of it (so its
    /// next request finds it on any replica): one round trip, bounded by `--store-timeout`
    /// (past it, the session is this replica's alone, and counted).
    pub(crate) async fn created(&self, session: &Session) {
        let Store::Redis(s) = self else { return };
        let record = Record {
            minted: session.minted(),
            epoch: session.epoch(),
            endpoint: session.endpoint().to_owned(),
            principal: session.principal(),
            share: session.share(),
            protocol_version: session.protocol_version(),
            gone: false,
        };
        let key = s.keys.tag(session.id()).record();
        let mut pipe = redis::pipe();
        pipe.hset_multiple(&key, &record.fields()).ignore();
        pipe.pexpire(&key, ttl_ms(s.session_ttl)).ignore();
        if s.run::<()>(&pipe, "create").await.is_none() {
            tracing::warn!(mcp.session = %session.hashed_id(), "the store did not take the new session's record: it is this replica's alone");
        }
        s.mark_touched(session);
    }

    /// What the store says of session `id`, which this replica does not hold, for a caller of
    /// `principal` (`None`: anyone may, `--resume-auth none`): one round trip, bounded by
    /// `--store-timeout` (past it: nothing to adopt, counted).
    pub(crate) async fn adopt(&self, id: &str, principal: Option<Principal>) -> Adoption {
        let Store::Redis(s) = self else {
            return Adoption::None;
        };
        let key = s.keys.tag(id).record();
        let who = principal.map_or_else(|| "*".to_owned(), wire::principal_text);
        let script = redis::Script::new(ADOPT);
        let mut invocation = script.key(&key);
        invocation
            .arg(who)
            .arg(STREAM_BLOCK)
            .arg(ttl_ms(s.session_ttl));
        let mut conn = s.conn.clone();
        let found: Option<Option<Claimed>> =
            match tokio::time::timeout(s.timeout, invocation.invoke_async(&mut conn)).await {
                Ok(Ok(v)) => Some(v),
                Ok(Err(e)) => {
                    s.failed("adopt", &e);
                    None
                }
                Err(_) => {
                    s.timed_out("adopt");
                    None
                }
            };
        let Some(Some((sn, pairs))) = found else {
            return Adoption::None;
        };
        let Some(record) = Record::parse(&pairs) else {
            return Adoption::None;
        };
        // The block claimed ends at `sn`.
        let first = u32::try_from(sn - i64::from(STREAM_BLOCK)).unwrap_or(u32::MAX);
        s.metrics.store_adoptions.inc();
        Adoption::Adopt(record, first)
    }

    /// Claims a POST's request `ids` (of `principal`, in `session`) for this replica before
    /// it forwards the POST, so a retransmission reaching another replica is answered from the
    /// stream that carries them, never run again: one round trip, bounded by
    /// `--store-timeout`. While another replica forwards them and no stream carries them yet,
    /// waits (at most `limit`) for it to open one or give them back.
    pub(crate) async fn claim(
        &self,
        session: &Session,
        principal: Principal,
        ids: &[String],
        limit: Duration,
    ) -> IdClaim {
        let Store::Redis(s) = self else {
            return IdClaim::Unknown;
        };
        if ids.is_empty() {
            return IdClaim::Unknown;
        }
        let tag = s.keys.tag(session.id());
        let keys: Vec<String> = ids
            .iter()
            .map(|id| tag.request(&s.keys, principal, id))
            .collect();
        let mut nonce = [0u8; 8];
        let _ = getrandom::getrandom(&mut nonce);
        let token = format!("p:{}:{:016x}", s.replica, u64::from_le_bytes(nonce));
        let script = redis::Script::new(CLAIM);
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let mut invocation = script.prepare_invoke();
            for k in &keys {
                invocation.key(k);
            }
            invocation.arg(&token).arg(ttl_ms(s.session_ttl));
            let mut conn = s.conn.clone();
            let held: Option<String> =
                match tokio::time::timeout(s.timeout, invocation.invoke_async(&mut conn)).await {
                    Ok(Ok(v)) => v,
                    Ok(Err(e)) => {
                        s.failed("claim", &e);
                        return IdClaim::Unknown;
                    }
                    Err(_) => {
                        s.timed_out("claim");
                        return IdClaim::Unknown;
                    }
                };
            match held.as_deref().map(|v| v.split_at(v.len().min(2))) {
                None => {
                    return IdClaim::Ours(IdsHeld {
                        shared: s.clone(),
                        keys,
                        token,
                    })
                }
                Some(("s:", stream)) => match stream.parse() {
                    Ok(n) => return IdClaim::Carried(n),
                    Err(_) => return IdClaim::Unknown,
                },
                // Another replica forwards them now: its stream opens, or it gives them back.
                Some(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(CLAIM_POLL).await;
                }
                Some(_) => return IdClaim::Unknown,
            }
        }
    }

    /// A request of `session` came: its record lives on in the store, refreshed at most once
    /// a quarter of `--session-ttl` by each replica that uses it (queued).
    pub(crate) fn touch(&self, session: &Session) {
        let Store::Redis(s) = self else { return };
        if !s.mark_touched(session) {
            return;
        }
        s.queue.push(Write::Touch {
            tag: s.keys.tag(session.id()),
            ttl: ttl_ms(s.session_ttl),
        });
    }

    /// The session ended (DELETE, the upstream's 404): its record becomes a tombstone nobody
    /// adopts (queued).
    pub(crate) fn ended(&self, session: &Session) {
        let Store::Redis(s) = self else { return };
        lock(&s.touched).remove(session.hashed_id());
        s.queue.push(Write::Gone {
            tag: s.keys.tag(session.id()),
        });
    }

    /// Publishes what the store does not have yet of `stream`, which this replica reads
    /// upstream: its new events, its facts when it opened, its end (queued, never awaited).
    pub(crate) fn publish(&self, session: &Session, stream: u32) {
        let Store::Redis(s) = self else { return };
        let mut packed = Vec::new();
        let Some(p) = session.unpublished(stream, |seq, message, body| {
            wire::pack_event(&mut packed, seq, message, body);
        }) else {
            return;
        };
        let tag = s.keys.tag(session.id());
        // The stream carries its requests from its opening on: a retransmission on any
        // replica finds it.
        let carries = if p.opened {
            p.requests
                .iter()
                .map(|(id, _)| tag.request(&s.keys, p.principal, id))
                .collect()
        } else {
            Vec::new()
        };
        s.queue.push(Write::Publish {
            carries,
            tag,
            stream,
            owner: s.replica.clone(),
            published: p,
            packed,
            keep: s.window_events,
            ttl: ttl_ms(s.session_ttl),
        });
    }
}

/// How long a replica's lease lasts without renewal: a follower of a stream whose owner's
/// lease lapsed answers the explicit failure, within this plus [`OWNER_CHECK`] and
/// `--store-timeout` of the owner's death (about 4.1 s by default).
pub(crate) const LEASE: Duration = Duration::from_secs(3);
/// How often a replica renews its lease, and a follower looks at its stream's owner's.
pub(crate) const OWNER_CHECK: Duration = Duration::from_secs(1);

/// Keeps this replica's lease in the store while the process lives: renewed every
/// [`OWNER_CHECK`] for [`LEASE`]. A renewal that fails is tried again at the next turn.
async fn keep_lease(mut conn: ConnectionManager, key: String, timeout: Duration) {
    let mut every = tokio::time::interval(OWNER_CHECK);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let mut renew = redis::cmd("SET");
        renew.arg(&key).arg(1).arg("PX").arg(ttl_ms(LEASE));
        let renewed = tokio::time::timeout(timeout, renew.exec_async(&mut conn)).await;
        if !matches!(renewed, Ok(Ok(()))) {
            tracing::debug!("the store did not take this replica's lease renewal");
        }
    }
}

impl Shared {
    /// Whether the replica named `owner` holds its lease: `None` when the store did not say.
    async fn alive(&self, owner: &str) -> Option<bool> {
        let mut pipe = redis::pipe();
        pipe.exists(wire::lease_key(owner));
        let (alive,): (bool,) = self.run(&pipe, "lease").await?;
        Some(alive)
    }

    /// Runs `pipe`, bounded by `--store-timeout`; `None` (counted, logged) when it failed.
    async fn run<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
        op: &'static str,
    ) -> Option<T> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.timeout, pipe.query_async::<T>(&mut conn)).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                self.failed(op, &e);
                None
            }
            Err(_) => {
                self.timed_out(op);
                None
            }
        }
    }

    fn failed(&self, op: &'static str, e: &redis::RedisError) {
        self.metrics.store_errors.inc();
        tracing::warn!(op, error = %e, "store request failed");
    }

    fn timed_out(&self, op: &'static str) {
        self.metrics.store_errors.inc();
        tracing::warn!(op, timeout = ?self.timeout, "store request timed out");
    }

    /// Whether `session` is due a touch (none for a quarter of the TTL), marked touched now.
    fn mark_touched(&self, session: &Session) -> bool {
        let now = self.started.elapsed().as_millis() as u64;
        let every = (self.session_ttl / 4).as_millis() as u64;
        let mut touched = lock(&self.touched);
        match touched.get_mut(session.hashed_id()) {
            Some(at) if now.saturating_sub(*at) < every => false,
            Some(at) => {
                *at = now;
                true
            }
            None => {
                if touched.len() >= 1 << 20 {
                    // Bounded: the oldest marks go first; a session touched again early
                    // costs one more write, nothing else.
                    touched.retain(|_, at| now.saturating_sub(*at) < every);
                }
                touched.insert(session.hashed_id().clone(), now);
                true
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A TTL in the store's milliseconds (at least 1).
fn ttl_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}
