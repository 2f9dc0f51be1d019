//! Flow control across replicas, the owner's side: the progress of the clients that follow
//! this replica's streams from the store (each follower writes where it is, coalesced) is
//! polled for the streams no client of this replica is attached to, in one pipeline a round,
//! and handed to their sessions, which guard the events a follower still needs as they guard
//! a local client's: the upstream waits rather than lose them, within `--stall-timeout`.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::wire::{parse_progress, unix_ms};
use super::{lock, Shared};
use crate::session::Registry;

/// How often the owner looks at its followers' progress.
pub(super) const POLL: Duration = Duration::from_millis(100);

/// Rounds between two prunings of the tags of sessions no longer held (a minute).
const PRUNE_EVERY: u32 = 600;

/// Polls while the store lives (and prunes the tags now and then).
pub(super) async fn poll(shared: Weak<Shared>, registry: Arc<Registry>) {
    let mut every = tokio::time::interval(POLL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rounds: u32 = 0;
    loop {
        every.tick().await;
        let Some(s) = shared.upgrade() else { return };
        if s.lease.take_restarted() {
            s.write_again(&registry);
        }
        round(&s, &registry).await;
        rounds = rounds.wrapping_add(1);
        if rounds.is_multiple_of(PRUNE_EVERY) {
            super::gone::prune(&s, &registry);
        }
    }
}

/// One round: the streams this replica reads with no client of its own attached, their
/// followers' progress read in one pipeline, and each handed to its session.
async fn round(s: &Shared, registry: &Registry) {
    let running: Vec<(Arc<str>, u32)> = lock(&s.running).iter().cloned().collect();
    if s.breaker.take_rewrite() {
        // The store came back: what it must know of the streams read here is written again.
        for (id, stream) in &running {
            if let Some(session) = registry.get(id) {
                s.republish(&session, *stream);
            }
        }
    }
    let mut asked = Vec::new();
    let mut pipe = redis::pipe();
    for (id, stream) in running {
        let Some(session) = registry.get(&id) else {
            lock(&s.running).remove(&(id, stream));
            continue;
        };
        if session.attached_here(stream) {
            continue;
        }
        pipe.get(s.tag_of(&session).progress(stream));
        asked.push((id, stream, session));
    }
    if asked.is_empty() {
        return;
    }
    let Some(replies): Option<Vec<Option<String>>> = s.run(&pipe, "progress").await else {
        return;
    };
    let now = unix_ms();
    for ((id, stream, session), reply) in asked.into_iter().zip(replies) {
        let Some((at, ms)) = reply.as_deref().and_then(parse_progress) else {
            continue;
        };
        let age = Duration::from_millis(now.saturating_sub(ms));
        if !session.remote_progress(stream, at, age) {
            lock(&s.running).remove(&(id, stream));
        }
    }
}
