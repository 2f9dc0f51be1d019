//! The registry of live sessions: lookup and creation, the session cap with shedding of the
//! least recently used idle session, the global memory budget shared by all windows, the TTL
//! sweep, and gauges of current state.
//!
//! Knows sessions only through their public API and a few crate-private hooks (`close`,
//! `sweep`, `trim`, `idle_since`); knows nothing of HTTP.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio::time::Instant;

use super::{lock, Session, Stirred};
use crate::config::Config;
/// Why a session's state was dropped (the `session_evictions_total` label).
pub(crate) use crate::metrics::Eviction;
use crate::metrics::Metrics;

/// The global byte budget shared by all windows, the oversized events held for their
/// clients, and what upstream readers hold outside any session: an event partly decoded,
/// decoded events waiting for room (`--memory-budget`).
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    /// The part of `used` held in streams' overflow slots.
    oversized: AtomicUsize,
    /// The part of `used` held by readers ([`Charge`]s).
    transient: AtomicUsize,
    /// The one reader that may go on decoding a large event however full the budget is (one
    /// always moves): its charge's number; 0 for none.
    mover: AtomicU64,
    charges: AtomicU64,
    /// Woken when the mover lets go or an oversized event leaves its slot: readers waiting
    /// for room look again.
    freed: Notify,
    limit: usize,
}

/// The most that upstream readers hold together outside sessions (events being decoded or
/// waiting for room), beyond one reader's event ([`Charge::room_for`]): an eighth of
/// `--memory-budget`, counted on top of what the sessions retain (docs/operations.md's
/// sizing formula).
pub(super) fn transient_limit(budget: usize) -> usize {
    budget / 8
}

/// How often a reader waiting for room in the budget looks again without being woken: room
/// also comes from windows that shrink, which do not wake anyone.
const ROOM_RECHECK: std::time::Duration = std::time::Duration::from_millis(50);

impl Budget {
    pub fn new(limit: usize) -> Budget {
        Budget {
            used: AtomicUsize::new(0),
            oversized: AtomicUsize::new(0),
            transient: AtomicUsize::new(0),
            mover: AtomicU64::new(0),
            charges: AtomicU64::new(0),
            freed: Notify::new(),
            limit,
        }
    }

    /// A reader's account in the budget, empty for now.
    pub fn charge(self: &Arc<Self>) -> Charge {
        Charge {
            budget: self.clone(),
            held: 0,
            number: self.charges.fetch_add(1, Ordering::Relaxed) + 1,
            moving: false,
        }
    }

    /// Bytes held by readers now ([`Charge`]).
    pub fn transient(&self) -> usize {
        self.transient.load(Ordering::Relaxed)
    }

    /// Bytes retained by sessions (windows and overflow slots): what shedding and trimming
    /// can free, and all they answer for.
    fn sessions(&self) -> usize {
        self.used().saturating_sub(self.transient())
    }

    /// Room for a reader to take `more` bytes: readers together hold at most an eighth of
    /// the budget ([`transient_limit`]), and only while everything held stays below 90% of it
    /// (the room new sessions are admitted in).
    fn room_for(&self, more: usize) -> bool {
        self.transient().saturating_add(more) <= transient_limit(self.limit)
            && self.used().saturating_add(more) <= self.limit - self.limit / 10
    }

    /// Bytes retained by all windows and overflow slots now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Whether an oversized event of `len` bytes may enter its stream's overflow slot: while
    /// it leaves the budget below 90% (the room new sessions are admitted in, so the windows
    /// of the sessions held keep theirs), or when no other is held anywhere (one always moves,
    /// whatever its size). Otherwise its reader waits.
    pub(super) fn admits_oversized(&self, len: usize) -> bool {
        self.oversized.load(Ordering::Relaxed) == 0
            || self.sessions().saturating_add(len) <= self.limit - self.limit / 10
    }

    /// Applies an overflow slot's size change from `before` to `after`.
    pub(super) fn adjust_oversized(&self, before: usize, after: usize) {
        if after >= before {
            self.oversized.fetch_add(after - before, Ordering::Relaxed);
        } else {
            self.oversized.fetch_sub(before - after, Ordering::Relaxed);
        }
        self.adjust(before, after);
        if after < before {
            self.freed.notify_waiters();
        }
    }

    /// How far the sessions are over the budget. What readers hold is not: it is bounded
    /// by making them wait ([`Charge::room_for`]), never by dropping what sessions retain.
    pub(super) fn over(&self) -> usize {
        self.sessions().saturating_sub(self.limit)
    }

    /// New sessions are admitted only below 90% of the budget, so the sessions already held
    /// keep some room to grow before their windows must be trimmed.
    pub(super) fn admits_new(&self) -> bool {
        self.sessions() < self.limit - self.limit / 10
    }

    /// Applies a window's size change from `before` to `after`.
    pub(super) fn adjust(&self, before: usize, after: usize) {
        if after >= before {
            self.used.fetch_add(after - before, Ordering::Relaxed);
        } else {
            self.used.fetch_sub(before - after, Ordering::Relaxed);
        }
    }
}

/// What one upstream reader holds outside any session (an event partly decoded, decoded
/// events waiting for room), counted in the [`Budget`] from its first byte, so the flags
/// bound it: a reader in the middle of a large event takes more bytes only while the budget
/// has room for them ([`Charge::room_for`]), else the upstream is not read (TCP pushes back).
#[derive(Debug)]
pub struct Charge {
    budget: Arc<Budget>,
    held: usize,
    number: u64,
    /// This reader is the budget's mover (see [`Charge::room_for`]).
    moving: bool,
}

impl Charge {
    /// Bytes this charge counts now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// The reader holds `held` bytes now. Below `released`, it no longer needs to be the
    /// budget's mover (its large event is decoded and handed on).
    pub fn set(&mut self, held: usize, released: usize) {
        if held != self.held {
            let b = &self.budget;
            if held > self.held {
                b.transient.fetch_add(held - self.held, Ordering::Relaxed);
            } else {
                b.transient.fetch_sub(self.held - held, Ordering::Relaxed);
            }
            b.adjust(self.held, held);
            self.held = held;
        }
        if self.moving && held < released {
            self.let_go();
        }
    }

    fn let_go(&mut self) {
        let b = &self.budget;
        self.moving = false;
        if b.mover
            .compare_exchange(self.number, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            b.freed.notify_waiters();
        }
    }

    /// Waits until the reader may take `more` bytes: while readers hold less than their part
    /// of the budget and everything held stays below 90% of it, or as the budget's one mover
    /// (taken when no other reader is), so that one large event always gets through however
    /// full the windows are.
    pub async fn room_for(&mut self, more: usize) {
        let b = self.budget.clone();
        loop {
            let freed = b.freed.notified();
            if b.room_for(more) {
                return;
            }
            match b
                .mover
                .compare_exchange(0, self.number, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.moving = true;
                    return;
                }
                Err(n) if n == self.number => return,
                Err(_) => {}
            }
            let _ = tokio::time::timeout(ROOM_RECHECK, freed).await;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.set(0, usize::MAX);
    }
}

/// All live sessions, keyed by the upstream's session id.
#[derive(Debug)]
pub struct Registry {
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    budget: Arc<Budget>,
    sessions: Mutex<Sessions>,
    /// Sessions that stopped being quiet since the last sweep (see [`Registry::sweep`]).
    stirred: Arc<Stirred>,
    /// Set when the last sweep left every session quiet: the earliest time one's TTL may run
    /// out. Until then a sweep with nothing stirred does not walk the sessions at all. Taken
    /// under the `sessions` lock.
    walk_after: Mutex<Option<Instant>>,
    /// Places taken by `initialize`s on their way to the upstream ([`Reservation`]s); they
    /// count against the session cap like sessions. Raised only under the `sessions` lock.
    reserved: Arc<AtomicUsize>,
    /// Told of each session the gateway ends on its own (the cap, the budget, the TTL): the
    /// proxy ends it upstream too. Called under the registry's lock: it may only hand the
    /// work on.
    on_end: std::sync::OnceLock<OnEnd>,
    /// Told of every change to a stream's content the fleet's store must learn (see
    /// [`Registry::on_publish`]); unset without a store.
    on_publish: std::sync::OnceLock<Arc<Publisher>>,
    /// The fleet's key for minted ids (with a store): a minted id then certifies itself on
    /// every replica ([`mint_fleet_id`]); unset, a minted id is random only.
    mint_key: std::sync::OnceLock<[u8; 32]>,
}

type Sessions = HashMap<String, Slot>;

/// A live session and when the sweeper next needs to look at it.
#[derive(Debug)]
struct Slot {
    session: Arc<Session>,
    /// `None`: at every sweep. A quiet session (nothing to watch) is next looked at when its
    /// TTL may have run out, or sooner when it says so ([`Stirred`]): the sweep does not
    /// touch the memory of sessions that only wait.
    next_visit: Option<Instant>,
}

/// What is told of a stream whose content changed (opened, events tagged, ended): the
/// fleet's store publishes it (see [`Registry::on_publish`]). Called after the session's lock
/// is released; it may lock the session again.
pub struct Publisher(pub Box<PublishFn>);

/// What a [`Publisher`] calls: the session, and the stream that changed.
pub(crate) type PublishFn = dyn Fn(&Session, u32) + Send + Sync;

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Publisher")
    }
}

/// What is done, besides dropping its state, with every session that ends here, whatever
/// ended it (see [`Registry::on_end`]): the one place the gateway's other layers (the
/// upstream's `DELETE` of a shed session, the fleet's tombstone) learn of an end.
pub struct OnEnd(pub Box<OnEndFn>);

/// What an [`OnEnd`] calls: the session that ended, and what ended it.
pub(crate) type OnEndFn = dyn Fn(&Arc<Session>, Eviction) + Send + Sync;

/// Ends a session upstream (a `DELETE`), for a session the gateway ended alone.
pub(crate) type EndUpstream = Arc<dyn Fn(&Session) + Send + Sync>;

impl std::fmt::Debug for OnEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnEnd")
    }
}

/// Who a caller is, as sessions and streams are bound to it: a keyed MAC of its credential
/// (see `proxy::auth`: keyed BLAKE3 under a key drawn from the OS at startup, 128 bits kept),
/// never the credential itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Principal(pub [u8; 16]);

/// Who a new session belongs to: the principal of the request that created it and the
/// endpoint (path) it was created on. Only that endpoint is the session's: a request on
/// another path that names the session neither resumes, retransmits into, nor ends it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub principal: Principal,
    pub endpoint: Box<str>,
    /// Whose share of the session cap and of the memory budget the session counts against:
    /// the principal, or for an anonymous caller its address (see `proxy::auth`).
    pub share: Principal,
    /// A session adopted from the fleet's store keeps the epoch it was created with there,
    /// and numbers its streams from the block this replica claimed (`None`: a new session,
    /// a fresh epoch, streams from 0).
    pub adopted: Option<(u64, u32)>,
}

impl Owner {
    /// An owner counted in its principal's share.
    pub fn new(principal: Principal, endpoint: &str) -> Owner {
        Owner {
            principal,
            endpoint: endpoint.into(),
            share: principal,
            adopted: None,
        }
    }

    /// The same owner, for a session adopted from the fleet's store with `epoch`, its streams
    /// numbered from `first_stream`.
    pub fn adopted(self, epoch: u64, first_stream: u32) -> Owner {
        Owner {
            adopted: Some((epoch, first_stream)),
            ..self
        }
    }

    /// The same owner, counted in `share`'s share instead.
    pub fn in_share(self, share: Principal) -> Owner {
        Owner { share, ..self }
    }
}

/// A place for one new session under the cap, taken before an `initialize` is forwarded and
/// turned into the session by [`Registry::create_reserved`]; dropping it (the upstream did
/// not create a session, the request failed) gives the place back.
#[derive(Debug)]
#[must_use = "a reservation holds a place under the session cap until dropped"]
pub struct Reservation {
    reserved: Arc<AtomicUsize>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.reserved.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The session cap is reached and every session has a client attached.
#[derive(Debug, thiserror::Error)]
#[error("the gateway holds its maximum number of sessions, all in use")]
pub struct AtCapacity;

impl Registry {
    pub fn new(cfg: Arc<Config>, metrics: Arc<Metrics>) -> Registry {
        let budget = Arc::new(Budget::new(cfg.memory_budget));
        Registry {
            cfg,
            metrics,
            budget,
            sessions: Mutex::new(HashMap::new()),
            stirred: Arc::default(),
            walk_after: Mutex::new(None),
            reserved: Arc::new(AtomicUsize::new(0)),
            on_end: std::sync::OnceLock::new(),
            on_publish: std::sync::OnceLock::new(),
            mint_key: std::sync::OnceLock::new(),
        }
    }

    /// Mints ids that certify themselves under the fleet's `key` from now on (once, before
    /// any session: the fleet's store).
    pub fn set_mint_key(&self, key: [u8; 32]) {
        let _ = self.mint_key.set(key);
    }

    /// The epoch of minted session `id` when it certifies itself under the fleet's key for a
    /// caller of `principal` on `endpoint` (see [`mint_fleet_id`]): any replica may then hold
    /// it without the store. `None` without a fleet key or for any other id.
    pub fn minted_epoch(&self, id: &str, principal: Principal, endpoint: &str) -> Option<u64> {
        verify_minted(self.mint_key.get()?, id, principal, endpoint)
    }

    /// Sets who is told of every stream change of the sessions created from now on (once,
    /// before any: the fleet's store).
    pub fn on_publish(&self, f: Publisher) {
        let _ = self.on_publish.set(Arc::new(f));
    }

    /// Sets what is done with every session that ends here, besides dropping its state
    /// (once, before any ends).
    pub fn on_end(&self, f: OnEnd) {
        let _ = self.on_end.set(f);
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The memory budget all sessions and upstream readers share.
    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        lock(&self.sessions).get(id).map(|e| e.session.clone())
    }

    /// The session `id`, created if the gateway has not seen it (sheds an idle session at
    /// the cap; errs when every session is in use).
    pub fn get_or_create(&self, id: &str, owner: Owner) -> Result<Arc<Session>, AtCapacity> {
        let mut map = lock(&self.sessions);
        if let Some(e) = map.get(id) {
            return Ok(e.session.clone());
        }
        self.make_room(&mut map, owner.share)?;
        Ok(self.insert(&mut map, id, owner))
    }

    /// The session `id`, created in the place `reservation` holds (so it cannot fail), or
    /// the existing one (the reservation is then given back).
    pub fn create_reserved(
        &self,
        id: &str,
        owner: Owner,
        reservation: Reservation,
    ) -> Arc<Session> {
        let mut map = lock(&self.sessions);
        let s = match map.get(id) {
            Some(e) => e.session.clone(),
            None => self.insert(&mut map, id, owner),
        };
        // Released under the lock: the new session takes the reservation's place atomically.
        drop(reservation);
        s
    }

    /// The session `id` of the fleet, adopted from its store (`owner` says with which epoch
    /// and stream numbers), or the one held already (adopted meanwhile). Makes room like
    /// [`Registry::get_or_create`].
    pub fn adopt(&self, id: &str, owner: Owner, minted: bool) -> Result<Arc<Session>, AtCapacity> {
        let mut map = lock(&self.sessions);
        if let Some(e) = map.get(id) {
            return Ok(e.session.clone());
        }
        self.make_room(&mut map, owner.share)?;
        Ok(self.insert_as(&mut map, id, owner, minted))
    }

    /// A session of the gateway's own for an upstream that answered `initialize` without a
    /// session id (a stateless server): its id is minted here ([`mint_id`]) and never sent
    /// upstream. Takes `reservation`'s place, or makes room like [`Registry::get_or_create`].
    pub fn create_minted(
        &self,
        owner: Owner,
        reservation: Option<Reservation>,
    ) -> Result<Arc<Session>, AtCapacity> {
        let mut map = lock(&self.sessions);
        if reservation.is_none() {
            self.make_room(&mut map, owner.share)?;
        }
        let key = self.mint_key.get();
        // In a fleet the id carries its epoch, under the fleet's key.
        let owner = match key {
            Some(_) => owner.adopted(crate::cursor::new_epoch(), 0),
            None => owner,
        };
        let id = loop {
            let id = match (key, owner.adopted) {
                (Some(key), Some((epoch, _))) => {
                    mint_fleet_id(key, epoch, owner.principal, &owner.endpoint)
                }
                _ => mint_id(),
            };
            if !map.contains_key(&id) {
                break id;
            }
        };
        let s = self.insert_as(&mut map, &id, owner, true);
        drop(reservation);
        self.metrics.sessions_minted.inc();
        Ok(s)
    }

    fn insert(&self, map: &mut Sessions, id: &str, owner: Owner) -> Arc<Session> {
        self.insert_as(map, id, owner, false)
    }

    fn insert_as(&self, map: &mut Sessions, id: &str, owner: Owner, minted: bool) -> Arc<Session> {
        let s = Arc::new(
            Session::new(
                id.to_owned(),
                self.cfg.clone(),
                self.metrics.clone(),
                self.budget.clone(),
                owner,
                minted,
            )
            .stirring(self.stirred.clone())
            .publishing(self.on_publish.get().cloned()),
        );
        map.insert(
            id.to_owned(),
            Slot {
                session: s.clone(),
                next_visit: None,
            },
        );
        tracing::debug!(mcp.session = %s.hashed_id(), "session created");
        s
    }

    /// Takes a place for one new session (shedding an idle one at the cap), before an
    /// `initialize` is forwarded, so the upstream never creates a session the gateway cannot
    /// hold: concurrent `initialize`s at the cap cannot all pass, each holds its own place.
    pub fn reserve(&self, share: Principal) -> Result<Reservation, AtCapacity> {
        let mut map = lock(&self.sessions);
        self.make_room(&mut map, share)?;
        self.reserved.fetch_add(1, Ordering::SeqCst);
        Ok(Reservation {
            reserved: self.reserved.clone(),
        })
    }

    /// Room for one more session of `share`: under the session cap (sessions and
    /// reservations) and the memory budget, shedding sessions if needed ([`Registry::shed_one`]).
    fn make_room(&self, map: &mut Sessions, share: Principal) -> Result<(), AtCapacity> {
        while map.len() + self.reserved.load(Ordering::SeqCst) >= self.cfg.max_sessions {
            self.shed_one(map, Eviction::SessionCap, share)?;
        }
        while !self.budget.admits_new() {
            self.shed_one(map, Eviction::MemoryBudget, share)?;
        }
        Ok(())
    }

    /// Keeps all windows within `--memory-budget` after `filling` grew: sheds the least
    /// recently used idle sessions first, then trims `filling`'s own oldest events.
    pub fn enforce_budget(&self, filling: &Session) {
        while self.budget.over() > 0 {
            let shed = {
                let mut map = lock(&self.sessions);
                self.shed_one(&mut map, Eviction::MemoryBudget, filling.share())
                    .is_ok()
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

    /// Sheds one session to make room for `asker`'s share (a new session, or a window that
    /// grew). Fair shares first: with more than one share in the registry, a share holding
    /// more than its fair part of the cap (`--max-sessions`, or `--memory-budget` in bytes,
    /// divided by the shares there are, the asker's included) loses its sessions first, even
    /// one with a client attached when the asker is within its own part; an asker over its part
    /// sheds only its own sessions or those of shares over theirs. Within that, sessions
    /// nobody is attached to, then those nobody may come back for, then the least recently
    /// used. One caller (an `initialize` flood, sessions that never read) so cannot lock the
    /// others out; with one share this is the plain order of idleness.
    fn shed_one(
        &self,
        map: &mut Sessions,
        why: Eviction,
        asker: Principal,
    ) -> Result<(), AtCapacity> {
        let by_bytes = why == Eviction::MemoryBudget;
        let facts: Vec<_> = map
            .iter()
            .map(|(k, e)| {
                let s = &e.session;
                let used = if by_bytes { s.window_usage().1 } else { 1 };
                (k, s.share(), s.idle_since(), used)
            })
            .collect();
        let mut per_share: HashMap<Principal, usize> = HashMap::new();
        for (_, share, _, used) in &facts {
            *per_share.entry(*share).or_default() += used;
        }
        let shares = per_share.len() + usize::from(!per_share.contains_key(&asker));
        let limit = if by_bytes {
            self.cfg.memory_budget
        } else {
            self.cfg.max_sessions
        };
        let fair = limit / shares.max(1);
        let over =
            |share: &Principal| shares > 1 && per_share.get(share).copied().unwrap_or(0) > fair;
        let asker_over = shares > 1
            && per_share.get(&asker).copied().unwrap_or(0) + usize::from(!by_bytes) > fair;
        let victim = facts
            .iter()
            .filter_map(|(k, share, idle, _)| {
                let over = over(share);
                let eligible = match idle {
                    None => over && !asker_over,
                    Some(_) => over || !asker_over || *share == asker,
                };
                // Over their part first, then unattached, then unwanted, then the oldest.
                eligible.then(|| ((!over, idle.is_none(), *idle), *k))
            })
            .min()
            .map(|(_, k)| k.clone())
            .ok_or(AtCapacity)?;
        if let Some(e) = map.remove(&victim) {
            self.closed(&e.session, why);
        }
        Ok(())
    }

    fn closed(&self, s: &Arc<Session>, why: Eviction) {
        s.close();
        if let Some(f) = self.on_end.get() {
            (f.0)(s, why);
        }
        self.metrics.session_evicted(why);
        tracing::info!(mcp.session = %s.hashed_id(), reason = why.as_str(), "session dropped");
    }

    /// Drops the session `id`'s state (DELETE, upstream 404).
    pub fn remove(&self, id: &str, why: Eviction) {
        let e = lock(&self.sessions).remove(id);
        if let Some(e) = e {
            self.closed(&e.session, why);
        }
    }

    pub fn len(&self) -> usize {
        lock(&self.sessions).len()
    }

    /// Calls (POST streams) of every session still read from the upstream.
    pub fn running_calls(&self) -> usize {
        self.all().iter().map(|(_, s)| s.running_calls()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every session as `replica` holds it, the most recently used first.
    pub fn views(&self, replica: &str) -> Vec<super::SessionView> {
        let mut v: Vec<_> = self.all().iter().map(|(_, s)| s.view(replica)).collect();
        v.sort_by(|a, b| b.last_used_ms.cmp(&a.last_used_ms).then(a.id.cmp(&b.id)));
        v
    }

    /// The session labelled `label` ([`hash_id`]), if held here.
    pub fn find_label(&self, label: &str) -> Option<Arc<Session>> {
        lock(&self.sessions)
            .values()
            .find(|e| &**e.session.hashed_id() == label)
            .map(|e| e.session.clone())
    }

    fn all(&self) -> Vec<(String, Arc<Session>)> {
        lock(&self.sessions)
            .iter()
            .map(|(k, e)| (k.clone(), e.session.clone()))
            .collect()
    }

    /// One sweep: flags stalled clients and drops sessions idle for longer than the TTL.
    /// Sessions the last sweep found quiet are looked at again only when their TTL may have
    /// run out or they stopped being quiet ([`Slot::next_visit`]): an idle session costs no
    /// work per sweep. Returns how many sessions were looked at.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let stirred = self.stirred.take();
        // The earliest TTL of a quiet session, and whether every session is quiet.
        let mut earliest: Option<Instant> = None;
        let mut all_quiet = true;
        let due: Vec<(String, Arc<Session>)> = {
            let mut map = lock(&self.sessions);
            let mut walk_after = lock(&self.walk_after);
            if stirred.is_empty() && walk_after.is_some_and(|t| now < t) {
                return 0;
            }
            *walk_after = None;
            drop(walk_after);
            for id in &stirred {
                if let Some(e) = map.get_mut(id) {
                    e.next_visit = None;
                }
            }
            map.iter()
                .filter(|(_, e)| match e.next_visit {
                    Some(t) if t > now => {
                        earliest = Some(earliest.map_or(t, |x| x.min(t)));
                        false
                    }
                    _ => true,
                })
                .map(|(k, e)| (k.clone(), e.session.clone()))
                .collect()
        };
        let looked_at = due.len();
        for (id, s) in due {
            let swept = s.sweep(now);
            let expired = swept.idle && now.duration_since(swept.since) >= self.cfg.session_ttl;
            let mut map = lock(&self.sessions);
            let Some(e) = map.get_mut(&id).filter(|e| Arc::ptr_eq(&e.session, &s)) else {
                continue;
            };
            if expired {
                map.remove(&id);
                drop(map);
                self.closed(&s, Eviction::Ttl);
            } else if swept.quiet {
                // Stirred since its sweep: in `stirred` for the next one, which clears this.
                let t = swept.since + self.cfg.session_ttl;
                e.next_visit = Some(t);
                earliest = Some(earliest.map_or(t, |x| x.min(t)));
            } else {
                all_quiet = false;
            }
        }
        if all_quiet {
            // A session created since is quiet until stirred, and its TTL runs out after
            // `earliest`: nothing is missed by not walking until then.
            let _map = lock(&self.sessions);
            *lock(&self.walk_after) = earliest;
        }
        looked_at
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
        for (_, s) in self.all() {
            s.end_clients(standalone_only);
        }
    }

    /// Sets the gauges of current state (called at scrape time).
    pub fn refresh_gauges(&self) {
        let (mut events, mut bytes, mut clients, mut held) = (0, 0, 0, 0);
        let all = self.all();
        for (_, s) in &all {
            let (e, b) = s.window_usage();
            events += e;
            bytes += b;
            clients += s.attached_clients();
            held += i64::from(s.has_standalone());
        }
        let m = &self.metrics;
        m.sessions.set(all.len() as i64);
        m.window_events.set(events as i64);
        m.window_bytes.set(bytes as i64);
        m.memory_used_bytes.set(self.budget.used() as i64);
        m.attached_clients.set(clients as i64);
        m.held_standalone_streams.set(held);
    }

    /// Bytes counted against `--memory-budget`: all windows and every oversized event held
    /// in a stream's overflow slot.
    pub fn window_bytes(&self) -> usize {
        self.budget.used()
    }
}

/// How every session id the gateway mints begins.
pub(super) const MINTED_PREFIX: &str = "mra-";

/// A new session id of the gateway's own: [`MINTED_PREFIX`] and 128 random bits as 32
/// lowercase hex digits (visible ASCII, unguessable, and told apart from an upstream's by
/// [`is_minted_form`]).
pub(super) fn mint_id() -> String {
    let mut raw = [0u8; 16];
    getrandom::getrandom(&mut raw).expect("the OS random number generator, for a session id");
    let mut id = String::with_capacity(MINTED_PREFIX.len() + 32);
    id.push_str(MINTED_PREFIX);
    for b in raw {
        use std::fmt::Write;
        let _ = write!(id, "{b:02x}");
    }
    id
}

/// Hex digits of a fleet's minted id after [`MINTED_PREFIX`]: 16 random bytes, the epoch
/// (8), the MAC (16).
const FLEET_MINTED_HEX: usize = 80;

/// A new session id of a fleet's (a store and its key): [`MINTED_PREFIX`], 16 random bytes,
/// the session's epoch and a MAC of them, the caller's principal and the endpoint under the
/// fleet's key (keyed BLAKE3, 16 bytes), as 80 lowercase hex digits. Any replica that sees
/// it from that caller on that endpoint knows it is the fleet's, and with which epoch,
/// without the store ([`verify_minted`]): a stateless upstream's fleet holds a live minted
/// session on any replica, even one that reaches the store only after it restarted empty.
pub(super) fn mint_fleet_id(
    key: &[u8; 32],
    epoch: u64,
    principal: Principal,
    endpoint: &str,
) -> String {
    let mut random = [0u8; 16];
    getrandom::getrandom(&mut random).expect("the OS random number generator, for a session id");
    let mac = minted_mac(key, &random, epoch, principal, endpoint);
    let mut id = String::with_capacity(MINTED_PREFIX.len() + FLEET_MINTED_HEX);
    id.push_str(MINTED_PREFIX);
    for b in random.iter().chain(&epoch.to_be_bytes()).chain(&mac) {
        use std::fmt::Write;
        let _ = write!(id, "{b:02x}");
    }
    id
}

fn minted_mac(
    key: &[u8; 32],
    random: &[u8; 16],
    epoch: u64,
    principal: Principal,
    endpoint: &str,
) -> [u8; 16] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(b"mcp-reattach minted session v1\0");
    h.update(random);
    h.update(&epoch.to_be_bytes());
    h.update(&principal.0);
    h.update(endpoint.as_bytes());
    let mut mac = [0u8; 16];
    mac.copy_from_slice(&h.finalize().as_bytes()[..16]);
    mac
}

/// The epoch of `id` when it is a fleet's minted id made under `key` for `principal` on
/// `endpoint` ([`mint_fleet_id`]); `None` otherwise. The MAC is compared in constant time.
pub(crate) fn verify_minted(
    key: &[u8; 32],
    id: &str,
    principal: Principal,
    endpoint: &str,
) -> Option<u64> {
    let hex = id.strip_prefix(MINTED_PREFIX)?;
    if hex.len() != FLEET_MINTED_HEX {
        return None;
    }
    let mut raw = [0u8; FLEET_MINTED_HEX / 2];
    for (i, b) in raw.iter_mut().enumerate() {
        let pair = hex.get(2 * i..2 * i + 2)?;
        if !pair
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        {
            return None;
        }
        *b = u8::from_str_radix(pair, 16).ok()?;
    }
    let random: [u8; 16] = raw[..16].try_into().ok()?;
    let epoch = u64::from_be_bytes(raw[16..24].try_into().ok()?);
    let mac = minted_mac(key, &random, epoch, principal, endpoint);
    let given: [u8; 16] = raw[24..].try_into().ok()?;
    (blake3::Hash::from(pad(mac)) == blake3::Hash::from(pad(given))).then_some(epoch)
}

/// A 16-byte MAC in a BLAKE3 hash's 32 bytes, for its constant-time comparison.
fn pad(mac: [u8; 16]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&mac);
    out
}

/// Whether `id` has the form of an id [`mint_id`] or [`mint_fleet_id`] makes.
pub(crate) fn is_minted_form(id: &str) -> bool {
    id.strip_prefix(MINTED_PREFIX).is_some_and(|hex| {
        (hex.len() == 32 || hex.len() == FLEET_MINTED_HEX)
            && hex
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    })
}

/// The key of session labels ([`hash_id`]): the fleet's (from its shared secret, so every
/// replica labels a session alike: the admin listener names sessions by their labels across
/// the fleet), else drawn from the OS at the first label. Set before any session is made.
static LABEL_KEY: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();

/// Labels sessions with `key` from now on ([`hash_id`]); `false` when labels were already
/// keyed (a second gateway in one process keeps the first's key).
pub(crate) fn set_label_key(key: [u8; 32]) -> bool {
    LABEL_KEY.set(key).is_ok()
}

/// A short label for a session id in logs, metrics and the admin listener: keyed BLAKE3
/// under [`LABEL_KEY`], 64 bits, so a label cannot be turned back into a guessable session
/// id without the key.
pub fn hash_id(id: impl AsRef<[u8]>) -> String {
    let key = LABEL_KEY.get_or_init(|| {
        let mut k = [0u8; 32];
        getrandom::getrandom(&mut k).expect("the OS random number generator, for the label key");
        k
    });
    // The id's bytes as they came (a header value need not be UTF-8: no lossy copy first).
    let h = blake3::keyed_hash(key, id.as_ref());
    let mut n = [0u8; 8];
    n.copy_from_slice(&h.as_bytes()[..8]);
    hex16(u64::from_be_bytes(n))
}

/// `n` as 16 lowercase hex digits (`format!("{n:016x}")` without the formatter, and the
/// digits put in place rather than collected as chars: the label is made for every request's
/// access line).
fn hex16(n: u64) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    for (i, d) in digits.iter_mut().enumerate() {
        *d = HEX[((n >> ((15 - i) * 4)) & 0xf) as usize];
    }
    // ASCII by construction.
    String::from_utf8(digits.to_vec()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_label_is_its_hash_in_16_hex_digits() {
        for n in [0, 1, 0xabc, 0x0123_4567_89ab_cdef, u64::MAX] {
            assert_eq!(hex16(n), format!("{n:016x}"));
        }
        let a = hash_id("4f9c-session");
        assert_eq!(a, hash_id("4f9c-session"));
        assert_ne!(a, hash_id("4f9c-session2"));
        assert_eq!(a.len(), 16);
    }

    #[test]
    fn a_fleets_minted_id_certifies_itself_for_its_caller_only() {
        let key = [7u8; 32];
        let alice = Principal([1; 16]);
        let id = mint_fleet_id(&key, 0x0123_4567_89ab_cdef, alice, "/mcp");
        assert!(is_minted_form(&id), "{id}");
        assert_eq!(
            verify_minted(&key, &id, alice, "/mcp"),
            Some(0x0123_4567_89ab_cdef)
        );
        assert_eq!(
            verify_minted(&key, &id, Principal([2; 16]), "/mcp"),
            None,
            "another caller"
        );
        assert_eq!(
            verify_minted(&key, &id, alice, "/other"),
            None,
            "another endpoint"
        );
        assert_eq!(
            verify_minted(&[8u8; 32], &id, alice, "/mcp"),
            None,
            "another fleet"
        );
        let mut forged = id.clone().into_bytes();
        let last = forged.len() - 1;
        forged[last] = if forged[last] == b'0' { b'1' } else { b'0' };
        let forged = String::from_utf8(forged).unwrap();
        assert_eq!(verify_minted(&key, &forged, alice, "/mcp"), None, "altered");
        assert_eq!(
            verify_minted(&key, &mint_id(), alice, "/mcp"),
            None,
            "a random one"
        );
        assert_ne!(
            id,
            mint_fleet_id(&key, 0x0123_4567_89ab_cdef, alice, "/mcp")
        );
    }

    #[test]
    fn minted_ids_are_unguessable_visible_ascii_of_one_form() {
        let a = mint_id();
        let b = mint_id();
        assert_ne!(a, b);
        for id in [&a, &b] {
            assert!(is_minted_form(id), "{id}");
            assert!(id.bytes().all(|c| (0x21..=0x7e).contains(&c)));
            assert_eq!(id.len(), MINTED_PREFIX.len() + 32);
        }
        for other in [
            "mra-",
            "mra-0123",
            "MRA-0123456789abcdef0123456789abcdef",
            "mra-0123456789ABCDEF0123456789abcdef",
            "mra-0123456789abcdef0123456789abcdef0",
            "4f9c-upstream",
        ] {
            assert!(!is_minted_form(other), "{other}");
        }
    }
}
