//! A session that ends anywhere ends everywhere: the replica that ends it (a `DELETE`, the
//! upstream's 404, an operator) tombstones its record and announces its hash tag on one
//! channel; every replica listens on one connection of its own and drops the session if it
//! holds it (without ending it upstream again). The same connection hears the operators'
//! questions to the fleet ([`super::ask`]).

use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_core::Stream;

use super::{lock, Shared};
use crate::session::{Eviction, Registry};

/// The channel the ended sessions' tags are announced on.
pub(super) const CHANNEL: &str = "mra:gone";

/// How long the listener waits before it subscribes again after losing its connection.
const RESUBSCRIBE: Duration = Duration::from_secs(1);

/// Listens while the store lives.
pub(super) async fn listen(client: redis::Client, shared: Weak<Shared>, registry: Arc<Registry>) {
    loop {
        match client.get_async_pubsub().await {
            Ok(mut pubsub) => match pubsub.subscribe(&[CHANNEL, super::ask::CHANNEL]).await {
                Ok(()) => {
                    let mut messages = pubsub.into_on_message();
                    while let Some(msg) =
                        std::future::poll_fn(|cx| Pin::new(&mut messages).poll_next(cx)).await
                    {
                        let Some(s) = shared.upgrade() else { return };
                        let Ok(text) = msg.get_payload::<String>() else {
                            continue;
                        };
                        if msg.get_channel_name() == CHANNEL {
                            ended(&s, &registry, &text);
                        } else {
                            super::ask::answer(s, registry.clone(), &text);
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "the store's channel of ended sessions: not subscribed")
                }
            },
            Err(e) => {
                tracing::debug!(error = %e, "the store's channel of ended sessions: no connection")
            }
        }
        if shared.upgrade().is_none() {
            return;
        }
        tokio::time::sleep(RESUBSCRIBE).await;
    }
}

/// The session tagged `tag` ended elsewhere: dropped here if held.
fn ended(s: &Shared, registry: &Registry, tag: &str) {
    let Some(id) = lock(&s.tags).remove(tag) else {
        return;
    };
    if registry.get(&id).is_some() {
        tracing::debug!("a session ended on another replica: dropped here");
        registry.remove(&id, Eviction::Fleet);
    }
}

/// Forgets the tags of sessions this replica no longer holds (the map only serves `ended`),
/// and the generations of their streams.
pub(super) fn prune(s: &Shared, registry: &Registry) {
    lock(&s.tags).retain(|_, id| registry.get(id).is_some());
    lock(&s.owned).retain(|(id, _), _| registry.get(id).is_some());
    lock(&s.fenced).retain(|(id, _)| registry.get(id).is_some());
}
