//! This replica's lease in the store, and the fence it puts on what the replica publishes.
//!
//! A replica holds one key, `mra:{r:<replica>}:alive`, whose value is its **generation**;
//! each stream's meta names its owner as `<replica>/<generation>`. The lease is renewed every
//! [`OWNER_CHECK`] by a compare-and-`PEXPIRE` (it renews its own generation only) for
//! [`LEASE`]. A follower declares a stream's owner lost only when the key is gone or holds
//! another generation ([`owner_holds`]), and then decides the stream's end once, by a
//! compare-and-set on its meta (`follow`).
//!
//! The fence: the replica knows, from its own monotonic clock, until when its generation is
//! surely held (the send time of its last renewal that held, plus the lease, less a margin).
//! Past that (its renewals failed for that long, or the process was paused, SIGSTOP or a
//! stalled VM), the generation is dead for good: nothing is published under it again (the
//! writer writes its streams' metas `lost` instead of their events), and the next renewal
//! that reaches the store takes a new generation. So a paused or partitioned owner never
//! writes into a stream the fleet may already have declared lost; its local clients keep
//! being served from its window.
//!
//! Knows the store's client and its keys; nothing of sessions.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::ConnectionManager;
use tokio::sync::Notify;

/// How long a replica's lease lasts without renewal: a follower of a stream whose owner's
/// lease lapsed answers the explicit failure, within this plus [`OWNER_CHECK`] and
/// `--store-timeout` of the owner's death (about 4.1 s by default).
pub(crate) const LEASE: Duration = Duration::from_secs(3);
/// How often a replica renews its lease, and a follower looks at its stream's owner's.
pub(crate) const OWNER_CHECK: Duration = Duration::from_secs(1);
/// How much of the lease the replica does not count on: the store's clock may run a little
/// faster than the replica's, and its expiry runs from when it took the renewal, which is
/// after it was sent.
const MARGIN: Duration = Duration::from_millis(500);

/// Renews `KEYS[1]` for `ARGV[2]` ms only if it holds `ARGV[1]` (this replica's generation):
/// 1 when it did, 0 when the key is gone or holds another generation.
/// -1 when it holds another generation.
const RENEW: &str = "local v = redis.call('GET', KEYS[1]) if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end if v then return -1 end return 0";

/// Reads the store's birth mark (`KEYS[1]`), setting it to `ARGV[1]` when absent; when it was
/// absent and this replica had read one before (`ARGV[2]` = 1: the store restarted empty),
/// marks the store reborn (`KEYS[2]`) for `ARGV[3]` ms in the same step, so no replica sees
/// the new birth mark without the reborn one.
const MARK: &str = "local b = redis.call('GET', KEYS[1]) if b then return b end redis.call('SET', KEYS[1], ARGV[1]) if ARGV[2] == '1' then redis.call('SET', KEYS[2], 1, 'PX', ARGV[3]) end return ARGV[1]";

/// This replica's lease: its name, its generation, and until when that is surely held.
pub(super) struct Lease {
    replica: std::sync::Arc<str>,
    key: String,
    /// The generation the replica publishes under now.
    generation: AtomicU64,
    /// Every generation up to this one is dead: nothing is published under it again.
    dead: AtomicU64,
    /// Milliseconds since `started` until which `generation` is surely held (0: not yet).
    held_until: AtomicU64,
    started: tokio::time::Instant,
    /// Wakes the renewal at once (the writer found the generation dead).
    renew_now: Notify,
    /// The store's birth mark as last read ([`BORN`]): another one, the store restarted empty.
    born: std::sync::Mutex<Option<String>>,
    /// The store was found restarted empty and the replica has not written again what it
    /// holds yet (`progress` does, at its next round).
    restarted: std::sync::atomic::AtomicBool,
}

/// The store's birth mark: the Unix time (ms) a replica first found the store without it.
/// Every replica sets it (if absent) and reads it at each turn of its lease: changed, the
/// store restarted empty (or was flushed) since, and what the replica holds is written again
/// at once ([`Lease::take_restarted`]), and the replica marks the store [`REBORN`] for
/// [`RESTART_GRACE`]. A replica that finds no record of a session while the store has no
/// birth mark or is marked reborn does not say there is none: the holders may not have
/// written it again yet.
pub(super) const BORN: &str = "mra:{fleet}:born";
/// Set, for [`RESTART_GRACE`], by each replica that finds the store restarted empty.
pub(super) const REBORN: &str = "mra:{fleet}:reborn";

/// How long after a replica found the store restarted empty a missing record is not taken
/// for a session's absence: each holder finds the restart within [`OWNER_CHECK`] of it (its
/// lease's next turn; the store has no birth mark until the first does) and queues its
/// records and streams at its next progress round (100 ms), written within the writer's
/// round trip; the lease (3 s) on top covers a holder slow to turn, so 4 s in all.
pub(crate) const RESTART_GRACE: Duration = Duration::from_secs(4);

impl Lease {
    pub(super) fn new(replica: std::sync::Arc<str>) -> Lease {
        let key = super::wire::lease_key(&replica);
        let started = tokio::time::Instant::now();
        Lease {
            replica,
            key,
            generation: AtomicU64::new(1),
            dead: AtomicU64::new(0),
            // The first renewal takes the lease; until it answers the replica publishes under
            // generation 1 for one lease (a store that never answers takes nothing anyway).
            held_until: AtomicU64::new(ms(LEASE - MARGIN)),
            started,
            renew_now: Notify::new(),
            born: std::sync::Mutex::new(None),
            restarted: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether the store was found restarted empty since the last call.
    pub(super) fn take_restarted(&self) -> bool {
        self.restarted.swap(false, Ordering::AcqRel)
    }

    /// Sets the store's birth mark if it has none, and reads it: a mark other than the one
    /// read last means the store restarted empty since (see [`BORN`]).
    async fn mark_born(&self, conn: &mut ConnectionManager, timeout: Duration) {
        let seen = super::lock(&self.born).is_some();
        let now = super::wire::unix_ms().to_string();
        let mut mark = redis::cmd("EVAL");
        mark.arg(MARK)
            .arg(2)
            .arg(BORN)
            .arg(REBORN)
            .arg(&now)
            .arg(u8::from(seen))
            .arg(super::ttl_ms(RESTART_GRACE));
        let Ok(Ok(born)) = tokio::time::timeout(timeout, mark.query_async::<String>(conn)).await
        else {
            return;
        };
        let restarted = {
            let mut last = super::lock(&self.born);
            let restarted = last.as_ref().is_some_and(|last| *last != born);
            *last = Some(born.clone());
            restarted
        };
        if restarted {
            tracing::warn!("the store restarted empty: this replica writes again what it holds");
            self.restarted.store(true, Ordering::Release);
            if born == now {
                // This replica's mark: the store was marked reborn with it.
                return;
            }
            // Another replica set the new mark: the grace runs from this one's finding too.
            let mut reborn = redis::cmd("SET");
            reborn
                .arg(REBORN)
                .arg(1)
                .arg("PX")
                .arg(super::ttl_ms(RESTART_GRACE));
            let _ = tokio::time::timeout(timeout, reborn.exec_async(conn)).await;
        }
    }

    fn now(&self) -> u64 {
        ms(self.started.elapsed())
    }

    /// The generation streams opened now are owned under.
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// `<replica>/<generation>`: an owner as a stream's meta names it.
    pub(super) fn owner(&self, generation: u64) -> std::sync::Arc<str> {
        format!("{}/{generation}", self.replica).into()
    }

    /// Whether what was opened under `generation` may still be published: the generation is
    /// surely held now. Past its lease it is dead from now on, and the renewal is woken to
    /// take the next one.
    pub(super) fn publishes(&self, generation: u64) -> bool {
        if generation <= self.dead.load(Ordering::Acquire) {
            return false;
        }
        if self.now() < self.held_until.load(Ordering::Acquire) {
            return true;
        }
        self.kill(self.generation());
        generation > self.dead.load(Ordering::Acquire)
    }

    /// `generation` (and all before it) is dead.
    fn kill(&self, generation: u64) {
        if self.dead.fetch_max(generation, Ordering::AcqRel) < generation {
            tracing::warn!(
                generation,
                "this replica's lease may have lapsed (its renewals failed, or the process was paused): its streams are lost to the fleet, a new generation is taken"
            );
            self.renew_now.notify_one();
        }
    }

    /// One turn of the renewal: renews the generation, or takes the next when the current is
    /// dead (its lease lapsed, or the store holds another). Whether the store answered.
    async fn renew(&self, conn: &mut ConnectionManager, timeout: Duration) -> bool {
        let sent = self.now();
        if sent >= self.held_until.load(Ordering::Acquire) {
            self.kill(self.generation());
        }
        let generation = self.generation();
        if generation > self.dead.load(Ordering::Acquire) {
            let mut renew = redis::cmd("EVAL");
            renew
                .arg(RENEW)
                .arg(1)
                .arg(&self.key)
                .arg(generation)
                .arg(super::ttl_ms(LEASE));
            match tokio::time::timeout(timeout, renew.query_async::<i64>(conn)).await {
                Ok(Ok(1)) => {
                    self.held_until
                        .fetch_max(sent + ms(LEASE - MARGIN), Ordering::AcqRel);
                    return true;
                }
                // Gone while surely held (it was never taken, or the store restarted empty and
                // its followers wait for the replicas to write again: see `BORN`): taken again.
                Ok(Ok(0)) => {}
                // Another generation: this one is dead.
                Ok(Ok(_)) => self.kill(generation),
                _ => {
                    tracing::debug!("the store did not take this replica's lease renewal");
                    return false;
                }
            }
        }
        // A new generation (or the first), taken whatever the key holds: it is this
        // replica's own key, and every generation it held before is dead.
        let next = if generation > self.dead.load(Ordering::Acquire) {
            generation
        } else {
            generation + 1
        };
        let mut take = redis::cmd("SET");
        take.arg(&self.key)
            .arg(next)
            .arg("PX")
            .arg(super::ttl_ms(LEASE));
        let taken = matches!(
            tokio::time::timeout(timeout, take.exec_async(conn)).await,
            Ok(Ok(()))
        );
        if taken {
            self.generation.store(next, Ordering::Release);
            self.held_until
                .store(sent + ms(LEASE - MARGIN), Ordering::Release);
            if next > 1 {
                tracing::info!(generation = next, "this replica holds its lease again");
            }
        }
        taken
    }
}

/// Keeps this replica's lease in the store while its owner lives (see [`Lease`]): renewed
/// every [`OWNER_CHECK`], and at once when the writer found the generation dead.
pub(super) async fn keep(
    lease: std::sync::Arc<Lease>,
    mut conn: ConnectionManager,
    timeout: Duration,
    breaker: std::sync::Arc<super::Breaker>,
) {
    let mut every = tokio::time::interval(OWNER_CHECK);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            () = lease.renew_now.notified() => {}
        }
        // Every replica renews every second: each learns of an outage, and of the store's
        // return, within a second of it, whether or not it has requests of its own.
        let answered = lease.renew(&mut conn, timeout).await;
        breaker.lease(answered);
        lease.mark_born(&mut conn, timeout).await;
    }
}

/// Whether the lease `value` read from the store holds the generation `owner` (a meta's
/// `<replica>/<generation>`) names: `false` when the key is gone or holds another. An owner
/// named without a generation (written before generations) holds while its key exists.
pub(super) fn owner_holds(owner: &str, value: Option<&str>) -> bool {
    match (owner.rsplit_once('/'), value) {
        (_, None) => false,
        (Some((_, generation)), Some(v)) => v == generation,
        (None, Some(_)) => true,
    }
}

/// The replica part of an owner's name.
pub(super) fn replica_of(owner: &str) -> &str {
    owner.rsplit_once('/').map_or(owner, |(r, _)| r)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_holds_only_its_own_generation() {
        assert!(owner_holds("ab12/3", Some("3")));
        assert!(!owner_holds("ab12/3", Some("4")));
        assert!(!owner_holds("ab12/3", None));
        assert!(owner_holds("ab12", Some("1")), "named before generations");
        assert!(!owner_holds("ab12", None));
        assert_eq!(replica_of("ab12/3"), "ab12");
        assert_eq!(replica_of("ab12"), "ab12");
    }

    #[tokio::test(start_paused = true)]
    async fn a_generation_past_its_lease_is_dead_for_good() {
        let lease = Lease::new("r".into());
        assert!(lease.publishes(1));
        assert_eq!(&*lease.owner(1), "r/1");
        tokio::time::advance(LEASE).await;
        // Nothing renewed it: dead from now on, whatever comes after.
        assert!(!lease.publishes(1));
        lease
            .held_until
            .store(lease.now() + 10_000, Ordering::Release);
        assert!(!lease.publishes(1), "a dead generation stays dead");
        lease.generation.store(2, Ordering::Release);
        assert!(lease.publishes(2));
    }
}
