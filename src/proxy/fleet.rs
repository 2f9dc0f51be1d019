//! The fleet layer: how a request finds its session, the local registry first and then the
//! fleet's store (an adoption for the caller, a stranger's claim of its ids in a session it
//! is not given, a minted id that certifies itself when the store cannot say), how a POST's
//! ids claimed here are claimed in the fleet before it is forwarded, and what follows a
//! session's end in the fleet and upstream (the registry's one hook), the drain's hand-over. Without a store, a session is the registry's alone and this is a lookup.
//!
//! The rules it applies are the session core's (`session::verdict` for an id in flight,
//! `session::decide` for a cursor); this layer only says where the facts come from.

use std::sync::Arc;

use bytes::Bytes;
use http::Method;

use super::inbound::Inbound;
use super::{forward, Gateway, MCP_PROTOCOL_VERSION, MCP_SESSION_ID};
use crate::error::{ProxyError, Refusal};
use crate::session::{Owner, Session};
use crate::store::{Adoption, IdClaim, IdsHeld, Store};
use crate::upstream::{full_body, Upstream};

impl Gateway {
    /// The session `inb` names on its own endpoint's registry, or adopted from the fleet's
    /// store for its caller; with it, the claim of a stranger's ids in a session of the fleet
    /// it is not given (held until the answer's head). Refused (503 + `Retry-After`) where
    /// the store cannot say and forwarding might run a call twice.
    pub(super) async fn find(
        &self,
        // `&mut`, though only read: a shared reference held across the awaits would need the
        // request's body to be `Sync`.
        inb: &mut Inbound,
    ) -> Result<(Option<Arc<Session>>, Option<IdsHeld>), Refusal> {
        // A session is only named on its own endpoint: elsewhere its id is just a header.
        let held = inb
            .sid
            .as_deref()
            .filter(|_| !inb.modern)
            .and_then(|sid| self.registry.get(sid));
        // A stranger's POST into a session of the fleet this replica does not hold: its ids
        // claimed in the store all the same (held until the answer's head), so an id in
        // flight in the session is nobody else's here either.
        let mut strangers_claim = None;
        let held = match held {
            None if self.store.is_on() && !inb.modern => match inb.sid.clone() {
                Some(sid) => match self.adopt(&sid, Caller::of(inb)).await {
                    Ok(Adopted::Held(s)) => Some(s),
                    Ok(Adopted::NotYours) => {
                        // A minted session's stranger is answered 404 as for an id nobody
                        // holds (its stateless upstream never knew it): nothing to claim.
                        let minted = crate::session::is_minted_form(&sid);
                        strangers_claim = if carries_requests(inb) && !minted {
                            let single_id = inb.info.single_id.clone();
                            let ids = &inb.info.request_ids;
                            self.strangers_claim(&sid, inb.principal, ids, single_id)
                                .await?
                        } else {
                            None
                        };
                        None
                    }
                    // Right after the store's return, a session it does not have may be one
                    // whose record its holder has not written again yet: a POST that may be a
                    // retransmission is not forwarded as a stranger's on that account.
                    Ok(Adopted::None) if carries_requests(inb) && self.store.just_recovered() => {
                        return Err(
                            ProxyError::StoreUnanswered.for_request(inb.info.single_id.clone())
                        );
                    }
                    Ok(Adopted::None) => None,
                    // A resume the store could not say anything about: not a session this
                    // gateway never saw (404 ends a client's session), but a busy one: the
                    // client comes back after `Retry-After` (every client of a lost replica
                    // resuming here at once is paced so).
                    Err(Unanswered)
                        if inb.parts.method == Method::GET && inb.cursor().is_some() =>
                    {
                        return Err(ProxyError::StoreUnanswered.into());
                    }
                    // Nor is a POST carrying requests forwarded as into a session nobody
                    // knows: it may be a retransmission of a call another replica runs, and
                    // forwarded raw it would run again (STYLE 19: refused, never the unsafe
                    // action).
                    Err(Unanswered) if carries_requests(inb) => {
                        return Err(
                            ProxyError::StoreUnanswered.for_request(inb.info.single_id.clone())
                        );
                    }
                    Err(Unanswered) => None,
                },
                None => None,
            },
            held => held,
        };
        Ok((held, strangers_claim))
    }
}

/// What the fleet's store says of a POST's request ids claimed here ([`Gateway::claim_in_fleet`]).
pub(super) enum FleetClaim {
    /// Forward it: its ids are this replica's in the fleet until the guard drops (`None`:
    /// no store, or a first POST forwarded while the store did not answer).
    Ours(Option<IdsHeld>),
    /// A stream of another replica carries them: a retransmission, resumed from the store.
    Elsewhere(u32),
}

impl Gateway {
    /// A POST's request ids, claimed in `s` here, claimed in the fleet's store before it is
    /// forwarded (the one awaited write on a POST's path, STYLE 19): a retransmission whose
    /// claim cannot be made is refused (503 + `Retry-After`), never forwarded; one that
    /// another replica's stream carries is resumed from it; another's in flight is 409.
    pub(super) async fn claim_in_fleet(
        &self,
        inb: &mut Inbound,
        s: &Arc<Session>,
    ) -> Result<FleetClaim, Refusal> {
        if !self.store.is_on() {
            return Ok(FleetClaim::Ours(None));
        }
        let limit = self.cfg.upstream_header_timeout;
        let single_id = || inb.info.single_id.clone();
        // A POST with the client's cursor is a retransmission of a call it was cut
        // from: forwarded only once its claim is made (STYLE 19).
        let retransmitted = inb.cursor().is_some();
        let ids = &inb.info.request_ids;
        let claim = self
            .store
            .claim(s.id(), Some(s), inb.principal, ids, limit)
            .await;
        match claim {
            // Right after the store's return nothing claimed proves nothing: the
            // replica that ran the call may not have written its claim again yet.
            IdClaim::Ours(_) if retransmitted && self.store.just_recovered() => {
                Err(ProxyError::StoreUnanswered.for_request(single_id()))
            }
            IdClaim::Ours(held) => Ok(FleetClaim::Ours(Some(held))),
            IdClaim::Carried(stream) => Ok(FleetClaim::Elsewhere(stream)),
            IdClaim::InFlight => Err(forward::in_flight(
                inb.info.single_id.as_ref(),
                &inb.info.request_ids,
            )
            .for_request(single_id())),
            IdClaim::Pending => Err(ProxyError::StoreUnanswered.for_request(single_id())),
            IdClaim::Unanswered if retransmitted => {
                Err(ProxyError::StoreUnanswered.for_request(single_id()))
            }
            // A first POST of a session held here: forwarded (a store outage costs
            // cross-replica resumability, never availability); the stream it opens
            // writes its claim once the store is back (the writer defers it).
            IdClaim::Unanswered | IdClaim::Unknown => Ok(FleetClaim::Ours(None)),
        }
    }
}

/// The fleet's store said nothing of a session (see [`Adoption::Unanswered`]).
struct Unanswered;

/// Who asks for a session this replica does not hold, and where.
struct Caller<'a> {
    principal: crate::session::Principal,
    share: crate::session::Principal,
    path: &'a str,
    version: Option<&'a str>,
}

impl Caller<'_> {
    fn of(inb: &Inbound) -> Caller<'_> {
        Caller {
            principal: inb.principal,
            share: inb.share,
            path: inb.parts.uri.path(),
            version: inb
                .parts
                .headers
                .get(MCP_PROTOCOL_VERSION)
                .and_then(|v| v.to_str().ok()),
        }
    }
}

/// What the fleet's store made of a session this replica did not hold.
enum Adopted {
    /// Adopted: held from now on.
    Held(Arc<Session>),
    /// A live session of someone else's: not adopted for this caller.
    NotYours,
    /// No such session (or none that can be adopted).
    None,
}

/// Whether `inb` is a POST carrying requests (ids the upstream answers by).
fn carries_requests(inb: &Inbound) -> bool {
    inb.parts.method == Method::POST && !inb.info.request_ids.is_empty()
}

impl Gateway {
    /// A session this replica does not hold, adopted from the fleet's store when it is there,
    /// live and the caller's (any caller's with `--resume-auth none`): held from now on, with
    /// the epoch it was created with and stream numbers of a block of this replica's.
    async fn adopt(&self, sid: &str, caller: Caller<'_>) -> Result<Adopted, Unanswered> {
        let principal =
            (self.cfg.resume_auth != crate::config::ResumeAuth::None).then_some(caller.principal);
        let (record, first_stream) = match self.store.adopt(sid, principal).await {
            Adoption::Adopt(record, first_stream) => (record, first_stream),
            Adoption::None => return Ok(Adopted::None),
            Adoption::NotYours => return Ok(Adopted::NotYours),
            // A minted id certifies itself under the fleet's key: one that does not for this
            // caller is not its session, whatever the store would say (404, as a minted id's
            // stranger gets on the replica holding it).
            Adoption::Unanswered => {
                return match self.rebuild_minted(sid, &caller) {
                    Some(s) => Ok(Adopted::Held(s)),
                    None if crate::session::is_minted_form(sid) => Ok(Adopted::None),
                    None => Err(Unanswered),
                }
            }
        };
        let owner = Owner::new(record.principal, &record.endpoint)
            .in_share(record.share)
            .adopted(record.epoch, first_stream);
        let Ok(s) = self
            .registry
            .adopt(sid, owner, record.minted)
            .inspect_err(|_| tracing::warn!("session cap reached with every session in use: a session of the fleet is not adopted"))
        else {
            return Ok(Adopted::None);
        };
        if let Some(v) = &record.protocol_version {
            s.set_protocol_version(v);
        }
        tracing::debug!(mcp.session = %s.hashed_id(), "session adopted from the fleet's store");
        Ok(Adopted::Held(s))
    }

    /// A stranger's POST into session `sid` of the fleet (not adopted for it): its request
    /// ids claimed in the session as any POST's are ([`Store::claim`], the rule
    /// [`crate::session::verdict`]): refused while another's request with one of them is in
    /// flight, as the replica holding the session refuses it, never answered from another's
    /// stream; forwarded (untagged) with the claim held until the answer's head otherwise.
    async fn strangers_claim(
        &self,
        sid: &str,
        principal: crate::session::Principal,
        ids: &[String],
        single_id: Option<serde_json::Value>,
    ) -> Result<Option<crate::store::IdsHeld>, Refusal> {
        use crate::store::IdClaim;
        let limit = self.cfg.upstream_header_timeout;
        match self.store.claim(sid, None, principal, ids, limit).await {
            IdClaim::Ours(held) => Ok(Some(held)),
            IdClaim::Unknown => Ok(None),
            IdClaim::Carried(_) | IdClaim::InFlight => {
                Err(forward::in_flight(single_id.as_ref(), ids).for_request(single_id))
            }
            IdClaim::Pending | IdClaim::Unanswered => {
                Err(ProxyError::StoreUnanswered.for_request(single_id))
            }
        }
    }

    /// A minted session the store said nothing of (down, or restarted empty moments ago),
    /// held from its id alone when the id certifies itself under the fleet's key for this
    /// caller on this endpoint (`session::mint_fleet_id`): its epoch is in it, its streams
    /// numbered from a block of this replica's, and its record written once the store answers.
    fn rebuild_minted(&self, sid: &str, caller: &Caller<'_>) -> Option<Arc<Session>> {
        let epoch = self
            .registry
            .minted_epoch(sid, caller.principal, caller.path)?;
        let owner = Owner::new(caller.principal, caller.path)
            .in_share(caller.share)
            .adopted(epoch, Store::rebuilt_block());
        let s = self.registry.adopt(sid, owner, true).ok()?;
        if let Some(v) = caller.version {
            s.set_protocol_version(v);
        }
        self.store.rebuilt(&s);
        tracing::debug!(mcp.session = %s.hashed_id(), "minted session held from its id: the store did not say");
        Some(s)
    }

    /// The fleet's hand-over at the end of a drain: with a store, the calls this replica
    /// still reads upstream go on into the store (their clients resume on other replicas, from
    /// it) until they end, at most `--store-drain-timeout`; without one, nothing.
    pub(crate) async fn hand_over(&self) {
        let Some(limit) = self.cfg.store.as_ref().map(|s| s.drain_timeout) else {
            return;
        };
        let deadline = tokio::time::Instant::now() + limit;
        let mut running = self.registry.running_calls();
        if running > 0 {
            tracing::info!(
                calls = running,
                ?limit,
                "drained: reading the calls still running into the fleet's store"
            );
        }
        while running > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(HAND_OVER_POLL).await;
            running = self.registry.running_calls();
        }
        if running > 0 {
            tracing::warn!(calls = running, "--store-drain-timeout: calls still running are left (their followers get owner-lost)");
        }
    }

    /// The replica stops accepting: the clients it serves from the fleet's store resume
    /// elsewhere at once.
    pub(crate) fn drain_followers(&self) {
        self.store.drain_followers();
    }

    /// Ends `session` (DELETE, an operator's end): here, and through the registry's
    /// [`on_end`], upstream and in the fleet.
    pub(super) fn end_session(&self, session: &Session, why: crate::session::Eviction) {
        self.registry.remove(session.id(), why);
    }
}

/// How often the hand-over looks whether the calls it reads have ended.
const HAND_OVER_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Shed DELETEs in flight at most: beyond, a shed session is left to the upstream's own
/// expiry (a flood of sheds must not become a flood of upstream requests).
const MAX_SHED_DELETES: usize = 64;

/// What follows every end of a session here, whatever ended it (the registry's one hook):
/// the fleet learns of it ([`Store::ended`]: a tombstone and an announcement, unless another
/// replica announced it), and a session the gateway alone ended is ended upstream too. With a
/// store, a session that only idled out here may live on through another replica: the store
/// says whether the fleet let it idle out too before the upstream is asked ([`Store::idled`]).
pub(super) fn on_end(store: Store, shed: crate::session::EndUpstream) -> crate::session::OnEnd {
    crate::session::OnEnd(Box::new(move |s, why| {
        let upstream_too = why.ends_upstream() && !s.minted();
        if why == crate::session::Eviction::Ttl && store.is_on() {
            store.idled(s, upstream_too.then(|| shed.clone()));
            return;
        }
        store.ended(s, why);
        if upstream_too {
            shed(s);
        }
    }))
}

/// A `DELETE` to the upstream for a session the gateway ended alone (the cap, the budget, its
/// TTL, an operator), so the upstream does not keep a session the gateway dropped (its
/// client's next request then gets the upstream's 404 and initializes again). It carries the
/// session id and protocol version, not the client's credentials (the gateway keeps none): an
/// upstream that wants them on DELETE refuses it and keeps the session until its own expiry.
pub(super) fn end_upstream(
    upstream: Arc<Upstream>,
    limit: std::time::Duration,
) -> crate::session::EndUpstream {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_SHED_DELETES));
    Arc::new(move |s: &Session| {
        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
            tracing::debug!(mcp.session = %s.hashed_id(), "too many shed sessions being ended upstream: left to the upstream's expiry");
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut headers = http::HeaderMap::new();
        let (Ok(sid), Ok(uri)) = (
            http::HeaderValue::from_str(s.id()),
            s.endpoint().parse::<http::Uri>(),
        ) else {
            return;
        };
        headers.insert(MCP_SESSION_ID, sid);
        if let Some(v) = s
            .protocol_version()
            .and_then(|v| http::HeaderValue::from_str(&v).ok())
        {
            headers.insert(MCP_PROTOCOL_VERSION, v);
        }
        let req = upstream.request(
            &Method::DELETE,
            &uri,
            &headers,
            None,
            full_body(Bytes::new()),
            None,
        );
        let (upstream, session) = (upstream.clone(), s.hashed_id().clone());
        rt.spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(limit, upstream.send(req)).await {
                Ok(Ok(resp)) => tracing::debug!(mcp.session = %session, status = resp.status().as_u16(), "shed session ended upstream"),
                _ => tracing::debug!(mcp.session = %session, "shed session: the upstream did not answer its DELETE"),
            }
        });
    })
}
