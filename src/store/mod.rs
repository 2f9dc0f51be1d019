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
//! task that sends every queued write, pipelined), `lease` (this replica's lease, its
//! generation and the fence on what it publishes; the store's birth mark), `follow` (a resume
//! served from the store),
//! `progress` (followers' progress, polled by owners), `gone` (ends announced to the fleet,
//! and the listener of the fleet's channels), `ask` (an operator's questions to every
//! replica: the sessions each holds, an end).
//! The design, key by key: docs/design.md, "A fleet: the shared store".
//!
//! Knows the session API and the configuration; nothing of HTTP routes.

mod ask;
mod follow;
mod gone;
mod lease;
mod progress;
mod wire;
mod writer;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use redis::aio::ConnectionManager;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::session::{EndUpstream, Eviction, IdVerdict, Principal, Registry, Session};

pub(crate) use self::ask::{Busy, ANSWER_BYTES, MAX_PAGE};
pub(crate) use self::follow::{FollowBody, FollowError, Followed, Start};
use self::wire::{Keys, Record, Tag, STREAM_BLOCK};

use self::writer::{Queue, Write};

use self::lease::OWNER_CHECK;

/// Whether the store answers, as this replica sees it. After [`DOWN_AFTER`] failures in a
/// row it is down: no request tries it (none pays `--store-timeout`) but one probe a
/// [`PROBE_EVERY`]; the first success brings it back up. The replica meanwhile serves the
/// sessions it holds as without a store.
pub(crate) struct Breaker {
    failures: AtomicU32,
    /// It came back after being down: what this replica wrote may be lost with it (a store
    /// restarted empty), so each session's next request writes its record again.
    recovered: std::sync::atomic::AtomicBool,
    /// Milliseconds since `started` before which the store is not tried; 0: up.
    down_until: AtomicU64,
    /// Milliseconds since `started` (plus one) when the store last answered after failing
    /// (a request's, or the lease's renewal); 0: never. See [`Breaker::in_grace`].
    back_at: AtomicU64,
    /// The lease's renewal failed since the store last answered it.
    lease_failed: std::sync::atomic::AtomicBool,
    /// The store came back: the facts of the streams this replica runs are to be written to it
    /// again (taken by the owner's poll, `progress`).
    rewrite: std::sync::atomic::AtomicBool,
    started: tokio::time::Instant,
    metrics: Arc<Metrics>,
}

/// Failures in a row that take the store down for this replica.
const DOWN_AFTER: u32 = 3;
/// Awaited requests (adoptions, claims, follows' reads) out at the store at once; the rest
/// wait their turn, at most [`AWAITED_QUEUE`]. Enough to keep one connection's pipeline full
/// (bench/notes.md, "Issue 50: the worst minute").
const AWAITED_IN_FLIGHT: usize = 64;
const AWAITED_QUEUE: Duration = Duration::from_secs(1);
/// How often a store that is down is tried again.
pub(super) const PROBE_EVERY: Duration = Duration::from_secs(1);
/// How long after the store's return a replica treats a claim that found nothing as
/// unanswered ([`Breaker::in_grace`]): what the other replicas deferred is written within
/// about two probes and a reconnect of its return; five seconds leave room for a busy store.
const GRACE: Duration = Duration::from_secs(5);

impl Breaker {
    fn new(metrics: Arc<Metrics>) -> Breaker {
        metrics.store_up.set(1);
        Breaker {
            failures: AtomicU32::new(0),
            recovered: std::sync::atomic::AtomicBool::new(false),
            down_until: AtomicU64::new(0),
            back_at: AtomicU64::new(0),
            lease_failed: std::sync::atomic::AtomicBool::new(false),
            rewrite: std::sync::atomic::AtomicBool::new(false),
            started: tokio::time::Instant::now(),
            metrics,
        }
    }

    fn now(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Whether a request may try the store now.
    pub(super) fn allows(&self) -> bool {
        self.now() >= self.down_until.load(Ordering::Relaxed)
    }

    pub(super) fn succeeded(&self) {
        let failures = self.failures.swap(0, Ordering::Relaxed);
        if failures >= DOWN_AFTER {
            tracing::info!("the store answers again");
            self.recovered.store(true, Ordering::Relaxed);
        }
        if failures > 0 {
            self.came_back(failures >= DOWN_AFTER);
        }
        self.down_until.store(0, Ordering::Relaxed);
        self.metrics.store_up.set(1);
    }

    /// The lease's renewal was taken (`ok`) or not: every replica renews it every second, so
    /// each sees the store go and come back within a second of it, whether or not a request
    /// of its own tried the store meanwhile.
    fn lease(&self, ok: bool) {
        if !ok {
            self.lease_failed.store(true, Ordering::Relaxed);
        } else if self.lease_failed.swap(false, Ordering::Relaxed) {
            self.came_back(true);
        }
    }

    /// The store answers after failing: the grace begins, and after an outage (it was down
    /// for this replica, or did not take a lease renewal: a second at least) this replica's
    /// running streams' facts are written again (a store restarted empty lost them, and with
    /// them the claims that keep their calls from running twice).
    fn came_back(&self, outage: bool) {
        self.back_at.store(self.now() + 1, Ordering::Relaxed);
        if outage {
            self.rewrite.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the store came back since this was last asked.
    pub(super) fn take_rewrite(&self) -> bool {
        self.rewrite.swap(false, Ordering::Relaxed)
    }

    /// Whether the store came back less than [`GRACE`] ago: the replicas write what they
    /// deferred while it was away (their calls' claims among it) within about
    /// two [`PROBE_EVERY`] of its return, so until then a retransmission's claim that finds
    /// nothing proves nothing.
    pub(super) fn in_grace(&self) -> bool {
        let at = self.back_at.load(Ordering::Relaxed);
        at != 0 && self.now() + 1 < at + GRACE.as_millis() as u64
    }

    pub(super) fn failed(&self) {
        self.metrics.store_errors.inc();
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= DOWN_AFTER {
            let until = self.now() + PROBE_EVERY.as_millis() as u64;
            self.down_until.store(until, Ordering::Relaxed);
            self.metrics.store_up.set(0);
            if failures == DOWN_AFTER {
                tracing::warn!(
                    "the store does not answer: serving without it, trying it once a second"
                );
            }
        }
    }
}

/// The store's background tasks (the writer, the lease's renewal, the owners' poll of their
/// followers' progress, the listener of the fleet's channels): one owner, whose drop stops
/// them all (mini-redis's `DbDropGuard`). The gateway holds it; without it no replica renews
/// a lease it no longer serves under.
#[derive(Default)]
pub(crate) struct Tasks(Vec<tokio::task::AbortHandle>);

impl Tasks {
    fn spawn(&mut self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.0.push(tokio::spawn(task).abort_handle());
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

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
    /// `--store-seal`: events sealed at rest.
    seal: bool,
    /// This replica's name in the store (the owner of the streams it reads), random per process.
    replica: Arc<str>,
    /// Its lease, and the generation its streams are owned under ([`lease`]).
    lease: Arc<lease::Lease>,
    /// The longest a request waits for the store (`--store-timeout`).
    timeout: Duration,
    session_ttl: Duration,
    /// How long an ended stream's keys stay (ms): its `--stall-timeout`, at least 30 s, at most
    /// `--session-ttl`: long enough for a client cut at the end to come back for it.
    ended_ttl: i64,
    /// The most a follower reads of one entry's events or of one stream's meta: what an owner
    /// writes of one upstream read ([`writer`]: at most `--max-event-bytes` and a reader's
    /// batch, packed and sealed). Past it, a value in the store is none this replica wrote,
    /// and it is not read ([`follow`]: a hole, the explicit gap).
    max_entry_bytes: usize,
    /// How long a follower's report of its progress counts (ms): the stall budget.
    progress_ttl: i64,
    keepalive: Option<Duration>,
    queue: Queue,
    metrics: Arc<Metrics>,
    /// Milliseconds since the process started, from one clock (the touches' coalescing).
    started: tokio::time::Instant,
    /// Sessions touched in the store, by when (ms since `started`): at most one touch per
    /// session every quarter TTL.
    touched: Mutex<std::collections::HashMap<Arc<str>, u64>>,
    breaker: Arc<Breaker>,
    /// The awaited requests out at the store at once ([`AWAITED_IN_FLIGHT`]): a burst (every
    /// client of a lost replica resuming here at once) queues here, not on the connection, so
    /// `--store-timeout` bounds the store's answer, not the queue ahead of it.
    awaited: tokio::sync::Semaphore,
    /// Set when the replica drains: its followers tell their clients to resume elsewhere.
    draining: tokio::sync::watch::Sender<bool>,
    /// The sessions whose tag this replica made, by tag: which one an end announced on the
    /// store's channel is ([`gone`]).
    tags: Mutex<std::collections::HashMap<Arc<str>, Arc<str>>>,
    /// The streams this replica reads upstream (by session id and number): whose followers'
    /// progress it polls ([`progress`]).
    running: Mutex<std::collections::HashSet<(Arc<str>, u32)>>,
    /// The generation each stream this replica reads upstream was opened under (by session
    /// id and number): what it publishes is fenced with it ([`lease`]).
    owned: Mutex<std::collections::HashMap<(Arc<str>, u32), u64>>,
    /// The streams of this replica's that it found fenced when it published them (their
    /// generation dead): the fleet may have been told they were lost, so a resume of them
    /// here is answered from the store, as on any replica, not from the window.
    fenced: Mutex<std::collections::HashSet<(Arc<str>, u32)>>,
    /// Sessions created while the store did not take their record: written at their next
    /// request once it does (by hashed id).
    unrecorded: Mutex<std::collections::HashSet<Arc<str>>>,
    /// The operators' questions to the fleet and their answers, on a connection of their own
    /// ([`ask`]).
    operator: ask::Operator,
}

/// What the store says of a session this replica does not hold.
pub(crate) enum Adoption {
    /// Adopt it: its record, and the first stream number of the block claimed for this replica.
    Adopt(Record, u32),
    /// Nothing to adopt: no such session, or ended.
    None,
    /// A live session, not the caller's: not adopted for it (it gets what it would for a
    /// session the gateway never saw), but its request ids are the session's, in flight
    /// fleet-wide ([`Store::claim`]).
    NotYours,
    /// The store did not say (it failed, timed out, is down for this replica, or this
    /// replica's requests to it were queued too long): nothing is known of the session.
    Unanswered,
}

/// What the fleet says of a POST's request ids (see [`Store::claim`]), by the rule the
/// session's own state keeps ([`crate::session::verdict`]).
pub(crate) enum IdClaim {
    /// Forward it: its ids are this replica's until the guard drops (given back then, unless a
    /// stream of this replica took them).
    Ours(IdsHeld),
    /// A stream of the caller's carries them: a retransmission, resumed from the store.
    Carried(u32),
    /// Another principal's request with one of them is in flight: never forwarded.
    InFlight,
    /// The caller's own POST with them is still being forwarded elsewhere after the wait: a
    /// retransmission whose claim cannot be made now.
    Pending,
    /// The store did not answer (down, timed out, refused the write, queued too long): the
    /// claim is not made.
    Unanswered,
    /// No store, or no ids: as without one.
    Unknown,
}

/// A POST's request ids claimed in the store for this replica while it forwards the POST.
pub(crate) struct IdsHeld {
    shared: Arc<Shared>,
    keys: Vec<String>,
    token: String,
    /// Whose ids: when a stream of this replica carries them by the time the guard drops, the
    /// stream's publication took them in the store, and nothing is given back.
    session: std::sync::Weak<Session>,
    principal: Principal,
    ids: Vec<String>,
}

impl Drop for IdsHeld {
    fn drop(&mut self) {
        if self
            .session
            .upgrade()
            .is_some_and(|s| s.carries_any(self.principal, &self.ids))
        {
            return;
        }
        self.shared.queue.push(Write::Release {
            keys: std::mem::take(&mut self.keys),
            token: std::mem::take(&mut self.token),
        });
    }
}

/// The Lua script of a claim, one round trip: when one of `KEYS` (a POST's request ids in
/// its session) holds anything but `ARGV[1]` (this claim's token), the values of all of them
/// (false where absent), for [`crate::session::verdict`] to judge; else all of them set to the
/// token for `ARGV[2]` ms, and false.
const CLAIM: &str = r"
local vals, held = {}, false
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  vals[i] = v
  if v and v ~= ARGV[1] then held = true end
end
if held then return vals end
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
/// (`ARGV[1]`: the caller's principal, `*` for any; `ARGV[2]`: the block; `ARGV[3]`: the TTL);
/// `{-1, {}}` for a live record bound to someone else.
const ADOPT: &str = r"
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'live' then return false end
if ARGV[1] ~= '*' and redis.call('HGET', KEYS[1], 'pr') ~= ARGV[1] then return {-1, {}} end
local sn = redis.call('HINCRBY', KEYS[1], 'sn', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {sn, redis.call('HGETALL', KEYS[1])}
";

impl Store {
    /// The store `cfg` asks for, its tasks started (needs the runtime) and owned by the
    /// [`Tasks`] returned with it: the caller holds them as long as the store serves (their
    /// drop stops them); `Off` without one.
    pub(crate) fn new(cfg: &Config, registry: &Arc<Registry>) -> (Store, Tasks) {
        let metrics = registry.metrics();
        let mut tasks = Tasks::default();
        let Some(settings) = &cfg.store else {
            return (Store::Off, tasks);
        };
        let client = match redis::Client::open(settings.url.as_str()) {
            Ok(c) => c,
            Err(e) => {
                // The URL was checked for its scheme at startup; a client that cannot be made
                // of it is a configuration error the operator must see.
                tracing::error!(error = %e, "--store: not a Redis URL the client accepts; running without the store");
                return (Store::Off, tasks);
            }
        };
        // The connection's own bound is the writer's: a request bounds itself tighter
        // (`--store-timeout`), the writer and the lease are no request's path.
        let manager = redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(BACKGROUND_TIMEOUT))
            .set_connection_timeout(Some(settings.timeout.max(Duration::from_millis(500))))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        // Two connections: the requests' own (adoptions, claims, follows' reads), so an
        // awaited request never queues behind the writer's pipelines of events on the other.
        let connect = || ConnectionManager::new_lazy_with_config(client.clone(), manager.clone());
        let (conn, writes) = match (connect(), connect()) {
            (Ok(c), Ok(w)) => (c, w),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "--store: cannot make its connection; running without the store");
                return (Store::Off, tasks);
            }
        };
        // The operators' own (`ask`): their questions never take the requests' turns.
        let operator = match connect() {
            Ok(o) => ask::Operator::new(o),
            Err(e) => {
                tracing::error!(error = %e, "--store: cannot make its connection; running without the store");
                return (Store::Off, tasks);
            }
        };
        let mut replica = [0u8; 6];
        let _ = getrandom::getrandom(&mut replica);
        let replica: Arc<str> = replica
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
            .into();
        let breaker = Arc::new(Breaker::new(metrics.clone()));
        let lease = Arc::new(lease::Lease::new(replica.clone()));
        let queue = writer::spawn(
            &mut tasks,
            writes.clone(),
            BACKGROUND_TIMEOUT,
            cfg.memory_budget / 16,
            breaker.clone(),
            lease.clone(),
            metrics.clone(),
        );
        tasks.spawn(lease::keep(
            lease.clone(),
            writes,
            OWNER_CHECK,
            breaker.clone(),
        ));
        let shared = Arc::new(Shared {
            conn,
            keys: Keys::derive(&settings.secret),
            seal: settings.seal,
            replica,
            lease,
            timeout: settings.timeout,
            session_ttl: cfg.session_ttl,
            max_entry_bytes: cfg.max_event_bytes.max(64 << 10) + (128 << 10),
            ended_ttl: ttl_ms(
                cfg.stall_timeout
                    .max(Duration::from_secs(30))
                    .min(cfg.session_ttl),
            ),
            progress_ttl: ttl_ms(cfg.stall_timeout),
            keepalive: cfg.keepalive,
            queue,
            metrics: metrics.clone(),
            started: tokio::time::Instant::now(),
            touched: Default::default(),
            breaker,
            awaited: tokio::sync::Semaphore::new(AWAITED_IN_FLIGHT),
            unrecorded: Default::default(),
            running: Default::default(),
            owned: Default::default(),
            fenced: Default::default(),
            tags: Default::default(),
            draining: tokio::sync::watch::Sender::new(false),
            operator,
        });
        tasks.spawn(progress::poll(Arc::downgrade(&shared), registry.clone()));
        tasks.spawn(gone::listen(
            client,
            Arc::downgrade(&shared),
            registry.clone(),
        ));
        (Store::Redis(shared), tasks)
    }

    /// The key principals are bound with: the fleet's (from its shared secret), so a session's
    /// binding means the same on every replica; `None` without a store (a key per process).
    pub(crate) fn binding_key(&self) -> Option<[u8; 32]> {
        match self {
            Store::Off => None,
            Store::Redis(s) => Some(s.keys.bind),
        }
    }

    /// The key session labels are made with: the fleet's, so a label names one session on
    /// every replica; `None` without a store.
    pub(crate) fn label_key(&self) -> Option<[u8; 32]> {
        match self {
            Store::Off => None,
            Store::Redis(s) => Some(s.keys.labels),
        }
    }

    /// The key minted session ids certify themselves under: the fleet's; `None` without a
    /// store.
    pub(crate) fn mint_key(&self) -> Option<[u8; 32]> {
        match self {
            Store::Off => None,
            Store::Redis(s) => Some(s.keys.minted),
        }
    }

    /// A minted session this replica rebuilt from its id alone (the store did not say what it
    /// is): recorded in the store as soon as it answers, and a block of stream numbers of its
    /// own to number from (where a record written again hands them out: see
    /// [`rewritten_block`]).
    pub(crate) fn rebuilt(&self, session: &Session) {
        if let Store::Redis(s) = self {
            lock(&s.unrecorded).insert(session.hashed_id().clone());
        }
    }

    /// The first stream number of a block for a session rebuilt without the store.
    pub(crate) fn rebuilt_block() -> u32 {
        rewritten_block()
    }

    /// This replica as operators see it: its host's name, and with a store its name in the
    /// fleet.
    pub(crate) fn display_name(&self) -> String {
        match self {
            Store::Off => crate::session::host_name().to_owned(),
            Store::Redis(s) => s.display_name(),
        }
    }

    pub(crate) fn is_on(&self) -> bool {
        matches!(self, Store::Redis(_))
    }

    /// The replica stops accepting (a drain): the clients it serves from the store (followers)
    /// are told at once to resume, elsewhere: they read nothing this replica holds.
    pub(crate) fn drain_followers(&self) {
        if let Store::Redis(s) = self {
            s.draining.send_replace(true);
        }
    }

    /// Records a session this replica just created, before its creator hears of it (so its
    /// next request finds it on any replica): one round trip, bounded by `--store-timeout`
    /// (past it, the session is this replica's alone, and counted).
    pub(crate) async fn created(&self, session: &Session) {
        let Store::Redis(s) = self else { return };
        let record = record_of(session);
        let mut pipe = redis::pipe();
        writer::record(
            &mut pipe,
            &s.tag_of(session),
            &record,
            STREAM_BLOCK,
            ttl_ms(s.session_ttl),
        );
        if s.run::<()>(&pipe, "create").await.is_none() {
            tracing::warn!(mcp.session = %session.hashed_id(), "the store did not take the new session's record: this replica's alone until the store takes it");
            lock(&s.unrecorded).insert(session.hashed_id().clone());
            return;
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
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(ADOPT));
        let script = &*SCRIPT;
        let mut invocation = script.key(&key);
        invocation
            .arg(who)
            .arg(STREAM_BLOCK)
            .arg(ttl_ms(s.session_ttl));
        let mut conn = s.conn.clone();
        let found: Option<Option<Claimed>> =
            s.guarded("adopt", invocation.invoke_async(&mut conn)).await;
        let Some(found) = found else {
            return Adoption::Unanswered;
        };
        let Some((sn, pairs)) = found else {
            // No record: none, unless the store restarted empty moments ago and the replicas
            // holding the session have not written it again yet (then nothing is known).
            if s.newborn().await {
                s.metrics.store_busy.inc();
                return Adoption::Unanswered;
            }
            return Adoption::None;
        };
        if sn < 0 {
            return Adoption::NotYours;
        }
        let Some(record) = Record::parse(&pairs) else {
            tracing::warn!("a session record in the store is not one a replica wrote (a field past its bound): not adopted");
            return Adoption::None;
        };
        // The block claimed ends at `sn`; a session out of numbers is not adopted.
        let Ok(end) = u32::try_from(sn) else {
            tracing::warn!(
                "a session of the fleet has handed out all its stream numbers: not adopted"
            );
            return Adoption::None;
        };
        let first = end.saturating_sub(STREAM_BLOCK);
        s.metrics.store_adoptions.inc();
        Adoption::Adopt(record, first)
    }

    /// Claims a POST's request `ids` (of `principal`, in session `sid`, held here as
    /// `session` or not at all) for this replica before it forwards the POST, so a
    /// retransmission reaching another replica is answered from the stream that carries them,
    /// never run again, and nobody else's POST of them is forwarded while they are in flight:
    /// one round trip, bounded by `--store-timeout`. While the caller's own POST of them is
    /// forwarded elsewhere and no stream carries them yet, waits (at most `limit`) for it to
    /// open one or give them back.
    pub(crate) async fn claim(
        &self,
        sid: &str,
        session: Option<&Arc<Session>>,
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
        let tag = match session {
            Some(session) => s.tag_of(session),
            None => s.keys.tag(sid),
        };
        let mut keys: Vec<String> = ids.iter().map(|id| tag.request(&s.keys, id)).collect();
        let mut nonce = [0u8; 8];
        let _ = getrandom::getrandom(&mut nonce);
        let token = wire::pending(principal, &s.replica, u64::from_le_bytes(nonce));
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(CLAIM));
        let script = &*SCRIPT;
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let held: Option<Vec<Option<String>>> = if keys.is_empty() {
                None
            } else {
                let mut invocation = script.prepare_invoke();
                for k in &keys {
                    invocation.key(k);
                }
                invocation.arg(&token).arg(ttl_ms(s.session_ttl));
                let mut conn = s.conn.clone();
                let Some(held) = s.guarded("claim", invocation.invoke_async(&mut conn)).await
                else {
                    return IdClaim::Unanswered;
                };
                held
            };
            let Some(values) = held else {
                return IdClaim::Ours(IdsHeld {
                    shared: s.clone(),
                    keys,
                    token,
                    session: session.map_or_else(std::sync::Weak::new, Arc::downgrade),
                    principal,
                    ids: ids.to_vec(),
                });
            };
            let verdicts: Vec<IdVerdict> = values
                .iter()
                .map(|v| {
                    let holder = v.as_deref().filter(|v| *v != token).and_then(wire::held_by);
                    crate::session::verdict(holder, principal)
                })
                .collect();
            match verdicts.iter().max().copied().unwrap_or(IdVerdict::Free) {
                IdVerdict::Another => return IdClaim::InFlight,
                IdVerdict::Carried(n) => return IdClaim::Carried(n),
                // The caller's POST is forwarded elsewhere now: its stream opens, or it gives
                // them back.
                IdVerdict::Wait if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(CLAIM_POLL).await;
                }
                IdVerdict::Wait => return IdClaim::Pending,
                // Ids another principal's call answered: free for this one, and still that
                // call's (its sender's retransmission finds them); the rest claimed.
                IdVerdict::Free => {
                    keys = keys
                        .into_iter()
                        .zip(&values)
                        .filter(|(_, v)| v.is_none())
                        .map(|(k, _)| k)
                        .collect();
                }
            }
        }
    }

    /// Whether the store came back moments ago (for this replica): what other replicas did
    /// while it was away (the claims of calls they forwarded) may not be in it yet.
    pub(crate) fn just_recovered(&self) -> bool {
        match self {
            Store::Off => false,
            Store::Redis(s) => s.breaker.in_grace(),
        }
    }

    /// The session's standalone stream another replica holds (it reads the upstream's `GET`
    /// and publishes it), if the store names one: a live `GET` here follows it rather than
    /// ask the upstream for a second one (a stateful server refuses it). One round trip,
    /// bounded; `None` when there is none, or the store did not say.
    pub(crate) async fn held_elsewhere(&self, session: &Session) -> Option<u32> {
        let Store::Redis(s) = self else { return None };
        let tag = s.tag_of(session);
        let mut pipe = redis::pipe();
        pipe.hget(tag.record(), "hold");
        let (hold,): (Option<u32>,) = s.run(&pipe, "hold").await?;
        let stream = hold.filter(|&n| !session.holds_stream(n))?;
        // Held by a replica that is gone: nobody holds it (this replica may).
        let mut pipe = redis::pipe();
        pipe.get(tag.meta(stream));
        let (meta,): (Option<String>,) = s.run(&pipe, "hold").await?;
        let meta: wire::Meta = serde_json::from_str(&meta?).ok()?;
        if meta.end.is_some() || s.alive(&meta.o).await != Some(true) {
            return None;
        }
        Some(stream)
    }

    /// A request of `session` came: its record lives on in the store, refreshed at most once
    /// a quarter of `--session-ttl` by each replica that uses it (queued).
    pub(crate) fn touch(&self, session: &Session) {
        let Store::Redis(s) = self else { return };
        if !s.breaker.allows() {
            return;
        }
        // Created while the store did not answer: recorded now, whenever it was last touched.
        let unrecorded = lock(&s.unrecorded).remove(session.hashed_id());
        if !s.mark_touched(session) && !unrecorded {
            return;
        }
        // The record written unless it is there (it may have been lost with a restarted
        // store), and its TTL renewed.
        s.queue.push(Write::Record {
            tag: s.tag_of(session),
            record: record_of(session),
            sn: rewritten_block(),
            ttl: ttl_ms(s.session_ttl),
        });
    }

    /// Whether `stream`, which this replica reads upstream, is fenced (owned under a dead
    /// generation of its lease): the fleet may have ended it `lost`, so a resume of it is
    /// answered from the store, as another replica answers it, never from the window.
    pub(crate) fn fenced(&self, session: &Session, stream: u32) -> bool {
        let Store::Redis(s) = self else { return false };
        let at: (Arc<str>, u32) = (session.id().into(), stream);
        if lock(&s.fenced).contains(&at) {
            return true;
        }
        let generation = lock(&s.owned).get(&at).copied();
        generation.is_some_and(|g| !s.lease.publishes(g))
    }

    /// The session ended here (a DELETE, the upstream's 404, an operator, the cap or the
    /// budget): its record becomes a tombstone nobody adopts, and its end is announced
    /// (queued). One that another replica ended and announced ([`Eviction::Fleet`]) is
    /// only forgotten.
    pub(crate) fn ended(&self, session: &Session, why: Eviction) {
        let Store::Redis(s) = self else { return };
        if why == Eviction::Fleet {
            s.forget(session);
        } else {
            s.gone(session);
        }
    }

    /// The session idled out here (`--session-ttl` without a request to this replica). The
    /// fleet may still use it through another replica, which keeps its record alive (every
    /// replica's touch renews the record's TTL): only when the record is gone too did the
    /// fleet let it idle out, and `upstream` (the `DELETE` of a session the gateway ended
    /// alone) runs. When the store does not say, the session is left to the upstream's own
    /// expiry: a live session is never ended upstream on a guess.
    pub(crate) fn idled(&self, session: &Arc<Session>, upstream: Option<EndUpstream>) {
        let Store::Redis(s) = self else {
            if let Some(end) = upstream {
                end(session);
            }
            return;
        };
        s.forget(session);
        let Some(end) = upstream else { return };
        let (s, session) = (s.clone(), session.clone());
        tokio::spawn(async move {
            let mut pipe = redis::pipe();
            pipe.exists(s.tag_of(&session).record());
            match s.run::<(bool,)>(&pipe, "idled").await {
                Some((false,)) => end(&session),
                Some((true,)) => {
                    tracing::debug!(mcp.session = %session.hashed_id(), "idled out here, in use elsewhere in the fleet: not ended upstream")
                }
                None => {
                    tracing::debug!(mcp.session = %session.hashed_id(), "idled out here; the store did not say whether elsewhere: left to the upstream's expiry")
                }
            }
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
        let at: (Arc<str>, u32) = (session.id().into(), stream);
        // Owned under the generation it opened in, for its life: once that is dead, nothing
        // of it is published again (its meta says `lost`).
        let generation = if p.opened {
            // Published again (the store restarted empty): under the generation it opened in.
            *lock(&s.owned)
                .entry(at.clone())
                .or_insert_with(|| s.lease.generation())
        } else {
            lock(&s.owned).get(&at).copied().unwrap_or(0)
        };
        if !s.lease.publishes(generation) {
            lock(&s.fenced).insert(at.clone());
        }
        if p.end.is_some() {
            lock(&s.owned).remove(&at);
            lock(&s.running).remove(&at);
        } else if p.opened {
            lock(&s.running).insert(at);
        }
        let tag = s.tag_of(session);
        if s.seal && !packed.is_empty() {
            wire::seal(&s.keys, &tag, stream, p.last, &mut packed);
        }
        // The stream carries its requests from its opening on: a retransmission on any
        // replica finds it, another principal's POST of them is refused while it runs (until
        // its keys' TTL, shortened at its end).
        let carries = if p.opened || p.end.is_some() {
            p.requests
                .iter()
                .map(|(id, _)| tag.request(&s.keys, id))
                .collect()
        } else {
            Vec::new()
        };
        // Written again, should the store have lost it, with the facts a deferred write
        // keeps (the writer's, while the store is away).
        let record = (p.opened || p.end.is_some()).then(|| record_of(session));
        s.queue.push(Write::Publish {
            carries,
            record,
            tag,
            stream,
            owner: s.lease.owner(generation),
            generation,
            published: p,
            packed,
            ttl: ttl_ms(s.session_ttl),
            ended_ttl: s.ended_ttl,
        });
    }
}

/// The longest the writer waits for a pipeline: it is on no request's path, and a write
/// given up is an event lost to the fleet, so it waits longer than a request would (a busy
/// store is slow, not gone; a gone one trips the breaker at the requests' pace).
const BACKGROUND_TIMEOUT: Duration = Duration::from_secs(2);

impl Shared {
    /// Writes again what the store must know of `stream`, which this replica still reads
    /// upstream: the session's record (unless it is there) and the stream's facts with its
    /// request ids' claims (queued). After the store came back.
    fn republish(&self, session: &Session, stream: u32) {
        // Under the generation it opened in; a fenced stream (that generation dead) is not
        // written again: the fleet may have been told it was lost.
        let at: (Arc<str>, u32) = (session.id().into(), stream);
        let Some(generation) = lock(&self.owned)
            .get(&at)
            .copied()
            .filter(|&g| self.lease.publishes(g))
        else {
            return;
        };
        let Some(p) = session.republished(stream) else {
            return;
        };
        let tag = self.tag_of(session);
        self.queue.push(Write::Record {
            tag: tag.clone(),
            record: record_of(session),
            sn: rewritten_block(),
            ttl: ttl_ms(self.session_ttl),
        });
        let carries = p
            .requests
            .iter()
            .map(|(id, _)| tag.request(&self.keys, id))
            .collect();
        self.queue.push(Write::Publish {
            carries,
            record: Some(record_of(session)),
            tag,
            stream,
            owner: self.lease.owner(generation),
            generation,
            published: p,
            packed: Vec::new(),
            ttl: ttl_ms(self.session_ttl),
            ended_ttl: self.ended_ttl,
        });
    }

    /// `session` ended: its record a tombstone, its end announced (queued).
    fn gone(&self, session: &Session) {
        self.forget(session);
        self.queue.push(Write::Gone {
            tag: self.tag_of(session),
        });
    }

    /// `session` is no longer held here: nothing of it is kept for it.
    fn forget(&self, session: &Session) {
        lock(&self.touched).remove(session.hashed_id());
        lock(&self.unrecorded).remove(session.hashed_id());
    }

    /// How operators see this replica: its host's name and its name in the store.
    fn display_name(&self) -> String {
        format!("{}/{}", crate::session::host_name(), self.replica)
    }

    /// `session`'s hash tag, made once per session.
    fn tag_of(&self, session: &Session) -> Tag {
        Tag::from_text(session.store_tag(|| {
            let tag = self.keys.tag(session.id()).text().clone();
            lock(&self.tags).insert(tag.clone(), session.id().into());
            tag
        }))
    }

    /// Whether `owner` (`<replica>/<generation>`, as a meta names it) still holds its lease:
    /// `false` when the lease is gone or holds another generation; `None` when the store did
    /// not say.
    async fn alive(&self, owner: &str) -> Option<bool> {
        let mut pipe = redis::pipe();
        pipe.get(wire::lease_key(lease::replica_of(owner)));
        let (held,): (Option<String>,) = self.run(&pipe, "lease").await?;
        Some(lease::owner_holds(owner, held.as_deref()))
    }

    /// The owner of `stream` lost its lease: the stream's meta ends `lost` at `at` (the
    /// position the deciding follower's client is at), unless it ended already, in one
    /// compare-and-set, so one replica decides and the stream ends in the fleet once. The
    /// meta as it stands after, and whether this replica decided; `None` when the store did
    /// not answer; `Some(None)` when the stream has no meta any more.
    async fn lose(&self, tag: &Tag, stream: u32, at: u64) -> Option<Option<(bool, wire::Meta)>> {
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(writer::LOSE));
        let mut invocation = SCRIPT.key(tag.meta(stream));
        invocation
            .arg(at)
            .arg(serde_json::to_string(wire::OWNER_LOST).unwrap_or_default())
            .arg(self.ended_ttl);
        let mut conn = self.conn.clone();
        let reply: Option<(i64, String)> = self
            .guarded("lost", invocation.invoke_async(&mut conn))
            .await?;
        Some(reply.and_then(|(decided, meta)| {
            let meta = serde_json::from_str(&meta).ok()?;
            Some((decided == 1, meta))
        }))
    }

    /// Whether the store restarted empty moments ago (no replica has marked it born yet, or
    /// one found it restarted less than [`lease::RESTART_GRACE`] ago): what it lacks may be on
    /// its way from the replicas that hold it. One round trip, on the path of a session the
    /// store has no record of only; a store that does not say is taken as one that may have.
    async fn newborn(&self) -> bool {
        let mut pipe = redis::pipe();
        pipe.exists(lease::BORN).exists(lease::REBORN);
        let Some((born, reborn)) = self.run::<(bool, bool)>(&pipe, "born").await else {
            return true;
        };
        !born || reborn
    }

    /// The store restarted empty: every session this replica holds is recorded again, and
    /// every stream it reads upstream published again from its opening (what its window
    /// still holds), all queued at once, so a replica that finds no record waits for them
    /// ([`lease::RESTART_GRACE`]) rather than say there is no such session.
    fn write_again(self: &Arc<Self>, registry: &Registry) {
        lock(&self.touched).clear();
        let held: Vec<Arc<str>> = lock(&self.tags).values().cloned().collect();
        let mut sessions = 0;
        for id in held {
            let Some(session) = registry.get(&id) else {
                continue;
            };
            sessions += 1;
            self.mark_touched(&session);
            self.queue.push(Write::Record {
                tag: self.tag_of(&session),
                record: record_of(&session),
                sn: rewritten_block(),
                ttl: ttl_ms(self.session_ttl),
            });
        }
        // Streams fenced (their generation dead) stay so: the fleet may have been told they
        // were lost.
        let owned: Vec<(Arc<str>, u32)> = lock(&self.owned)
            .iter()
            .filter(|(_, &generation)| self.lease.publishes(generation))
            .map(|(at, _)| at.clone())
            .collect();
        let store = Store::Redis(self.clone());
        let mut streams = 0;
        for (id, stream) in owned {
            if let Some(session) = registry.get(&id).filter(|s| s.republish(stream)) {
                streams += 1;
                store.publish(&session, stream);
            }
        }
        tracing::info!(
            sessions,
            streams,
            "the store restarted empty: sessions recorded and streams published again"
        );
    }

    /// Runs `pipe`, bounded by `--store-timeout`; `None` (counted, logged) when it failed.
    async fn run<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
        op: &'static str,
    ) -> Option<T> {
        let mut conn = self.conn.clone();
        self.guarded(op, pipe.query_async::<T>(&mut conn)).await
    }

    /// Awaits one request to the store, bounded by `--store-timeout`, unless the store is down
    /// for this replica (then at once); `None` (counted) when it was not answered.
    async fn guarded<T>(
        &self,
        op: &'static str,
        request: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Option<T> {
        if !self.breaker.allows() {
            return None;
        }
        // A turn first: waiting for it is this replica's load, not the store's failure.
        let Ok(Ok(_turn)) = tokio::time::timeout(AWAITED_QUEUE, self.awaited.acquire()).await
        else {
            self.metrics.store_busy.inc();
            tracing::debug!(op, "store request not sent: too many ahead of it");
            return None;
        };
        match tokio::time::timeout(self.timeout, request).await {
            Ok(Ok(v)) => {
                self.breaker.succeeded();
                Some(v)
            }
            Ok(Err(e)) => {
                self.breaker.failed();
                tracing::debug!(op, error = %e, "store request failed");
                None
            }
            Err(_) => {
                self.breaker.failed();
                tracing::debug!(op, timeout = ?self.timeout, "store request timed out");
                None
            }
        }
    }

    /// Whether `session` is due a touch (none for a quarter of the TTL), marked touched now.
    fn mark_touched(&self, session: &Session) -> bool {
        let now = self.started.elapsed().as_millis() as u64;
        let every = (self.session_ttl / 4).as_millis() as u64;
        let mut touched = lock(&self.touched);
        if self.breaker.recovered.swap(false, Ordering::Relaxed) {
            touched.clear();
        }
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

/// Where a record written again (it was lost with the store, or never written) hands out
/// stream numbers from: a random block in the third quarter of the numbers, so replicas that
/// adopted the session before the loss (their blocks are low) and those that adopt it now do
/// not share a block but by a small chance (2^14 places), with 2^14 adoptions left at least.
fn rewritten_block() -> u32 {
    let mut b = [0u8; 2];
    let _ = getrandom::getrandom(&mut b);
    let k = u32::from(u16::from_le_bytes(b) & 0x7fff) | 0x8000;
    k.saturating_mul(STREAM_BLOCK)
        .min(u32::MAX - 64 * STREAM_BLOCK)
}

/// `session`'s record as its creator writes it.
fn record_of(session: &Session) -> Record {
    Record {
        minted: session.minted(),
        epoch: session.epoch(),
        endpoint: session.endpoint().to_owned(),
        principal: session.principal(),
        share: session.share(),
        protocol_version: session.protocol_version(),
        gone: false,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A TTL in the store's milliseconds (at least 1).
fn ttl_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}
