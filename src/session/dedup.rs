//! POST de-duplication: the request ids of POSTs being forwarded right now ([`Forwarded`]),
//! which retained stream of the session already carried one of a POST's ids ([`Carried`]),
//! so that a retransmission is answered from that stream and never forwarded, and the ids of
//! requests whose streams the session no longer retains ([`Retired`]), so that their
//! retransmission is refused as a duplicate instead. Every id is its principal's: another
//! principal's POST with the same id is not a retransmission of it.
//!
//! Pure bookkeeping under the session's lock: no locks, no waiting, nothing of HTTP or of how
//! a retransmission is answered (the session resumes the stream; the proxy responds).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::hash::BuildHasher;

use super::stream::{Stream, Streams};
use super::Principal;

/// A map keyed by a keyed 64-bit hash of a request id: the key is already SipHash under the
/// map's own random key, so the map uses it as its hash instead of hashing it a second time.
type ByHash<V> = HashMap<u64, V, std::hash::BuildHasherDefault<KeyIsHash>>;

/// The [`ByHash`] maps' hasher: a `u64` key is its own hash.
#[derive(Default)]
struct KeyIsHash(u64);

impl std::hash::Hasher for KeyIsHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys reach here (`write_u64`); any other input still hashes.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Who holds one request id of a session, wherever that is known: this replica's state, or
/// the fleet's store (a request id is in flight fleet-wide for its session, whoever sent it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IdHolder {
    /// A POST of this principal carrying it is being forwarded (no stream for it yet).
    Forwarding(Principal),
    /// A stream of this principal carries it and has not answered it yet.
    Awaited(Principal, u32),
    /// A stream of this principal carried it and answered it (or ended).
    Answered(Principal, u32),
}

/// What a POST of a principal may do with one of its request ids, given its holder
/// ([`verdict`]). Ordered: a POST with several ids gets the strictest of its ids' verdicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum IdVerdict {
    /// Nobody holds it for this principal: forward it.
    Free,
    /// This principal's stream carries it: a retransmission, answered from that stream.
    Carried(u32),
    /// This principal's POST carrying it is being forwarded: wait for its stream, then it is a
    /// retransmission.
    Wait,
    /// Another principal's request with it is in flight: upstreams route answers by request id
    /// within a session, so this POST would take the other's answer. Refused, never forwarded.
    Another,
}

/// The one rule of a request id in flight, for the replica's own state and for the fleet's
/// store alike: a retransmission is only its sender's, an id in flight is nobody else's, and
/// an id another principal's call has answered is free again.
pub(crate) fn verdict(holder: Option<IdHolder>, me: Principal) -> IdVerdict {
    match holder {
        None => IdVerdict::Free,
        Some(IdHolder::Forwarding(p)) if p == me => IdVerdict::Wait,
        Some(IdHolder::Awaited(p, n) | IdHolder::Answered(p, n)) if p == me => {
            IdVerdict::Carried(n)
        }
        Some(IdHolder::Forwarding(_) | IdHolder::Awaited(..)) => IdVerdict::Another,
        Some(IdHolder::Answered(..)) => IdVerdict::Free,
    }
}

/// Request ids of POSTs forwarded and not yet settled (no stream opened for them, no answer
/// yet): a retransmission of one waits for it instead of being forwarded again.
#[derive(Debug, Default)]
pub(super) struct Forwarded {
    ids: Vec<(Principal, String)>,
}

impl Forwarded {
    /// Whether a POST of `principal` carrying one of `ids` is in flight.
    pub(super) fn any(&self, principal: Principal, ids: &[String]) -> bool {
        ids.iter()
            .any(|id| self.ids.iter().any(|(p, f)| *p == principal && f == id))
    }

    /// The principals forwarding `id` now.
    pub(super) fn holders<'a>(&'a self, id: &'a str) -> impl Iterator<Item = IdHolder> + 'a {
        self.ids
            .iter()
            .filter(move |(_, f)| f == id)
            .map(|(p, _)| IdHolder::Forwarding(*p))
    }

    /// Marks `ids` as forwarded; `false`, marking nothing, while one of them is in flight.
    pub(super) fn begin(&mut self, principal: Principal, ids: &[String]) -> bool {
        if self.any(principal, ids) {
            return false;
        }
        self.ids
            .extend(ids.iter().map(|id| (principal, id.clone())));
        true
    }

    /// The session's owner is now `to` (its credentials were refreshed): `from`'s ids are its.
    pub(super) fn rebind(&mut self, from: Principal, to: Principal) {
        for (p, _) in &mut self.ids {
            if *p == from {
                *p = to;
            }
        }
    }

    /// The POST that carried `ids` settled: they are free again.
    pub(super) fn settle(&mut self, principal: Principal, ids: &[String]) {
        for id in ids {
            if let Some(i) = self
                .ids
                .iter()
                .position(|(p, f)| *p == principal && f == id)
            {
                self.ids.swap_remove(i);
            }
        }
    }
}

/// Most request ids a session remembers after their streams are forgotten (a 64-bit hash and
/// the principal, ~32 bytes each with the map's overhead: at most ~128 KiB a session). Past it, the oldest forgotten streams'
/// retransmissions are forwarded again; docs/reliability.md states the bound.
pub(super) const MAX_RETIRED_IDS: usize = 4096;

/// The request ids of streams the session no longer retains, as keyed 64-bit hashes, each
/// with the principal that sent it. Keyed as its session's [`Carried`] is, so a forgotten
/// stream's ids go from one to the other as the hashes they were indexed by.
#[derive(Debug)]
pub(super) struct Retired {
    hashes: ByHash<Principal>,
    key: std::collections::hash_map::RandomState,
}

impl Retired {
    /// The retired ids of the session whose streams `carried` indexes (under its key).
    pub(super) fn keyed_as(carried: &Carried) -> Retired {
        Retired {
            hashes: ByHash::default(),
            key: carried.key.clone(),
        }
    }

    fn hash(&self, id: &str) -> u64 {
        self.key.hash_one(id)
    }

    /// The session's owner is now `to`: `from`'s ids are its.
    pub(super) fn rebind(&mut self, from: Principal, to: Principal) {
        for p in self.hashes.values_mut() {
            if *p == from {
                *p = to;
            }
        }
    }

    /// Remembers the requests of a stream the session forgets.
    pub(super) fn retire(&mut self, stream: &Stream) {
        for r in &stream.requests {
            if self.hashes.len() >= MAX_RETIRED_IDS {
                return;
            }
            self.hashes.entry(r.hash).or_insert(stream.principal);
        }
    }

    /// The first of `ids` that `principal` already sent in a stream now forgotten.
    pub(super) fn find<'a>(&self, principal: Principal, ids: &'a [String]) -> Option<&'a str> {
        if self.hashes.is_empty() {
            return None; // most sessions: no hash to compute
        }
        ids.iter()
            .find(|id| self.hashes.get(&self.hash(id)) == Some(&principal))
            .map(String::as_str)
    }
}

/// A retained stream that was started by a POST carrying one of a retransmission's ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Carrier<'a> {
    pub stream: u32,
    /// The stream's opening position.
    pub first_seq: u64,
    /// The id it carried.
    pub id: &'a str,
}

/// The retained streams that carried one request id: almost always one, held without an
/// allocation of its own (a `Vec` per id was an allocation and a free per call).
#[derive(Debug)]
enum Carriers {
    One(u32),
    Many(Vec<u32>),
}

impl Carriers {
    fn as_slice(&self) -> &[u32] {
        match self {
            Carriers::One(n) => std::slice::from_ref(n),
            Carriers::Many(v) => v,
        }
    }

    fn add(&mut self, stream: u32) {
        match self {
            Carriers::One(n) if *n == stream => {}
            Carriers::One(n) => *self = Carriers::Many(vec![*n, stream]),
            Carriers::Many(v) if v.contains(&stream) => {}
            Carriers::Many(v) => v.push(stream),
        }
    }

    /// Takes `stream` out; whether none is left.
    fn remove(&mut self, stream: u32) -> bool {
        match self {
            Carriers::One(n) => *n == stream,
            Carriers::Many(v) => {
                v.retain(|&c| c != stream);
                v.is_empty()
            }
        }
    }
}

/// Which retained streams carried each request id, by a keyed hash of the id. Every POST asks
/// whether one of its ids was sent before, and a session retains up to
/// `MAX_ENDED_STREAMS` ended streams besides the running ones, too many to scan on every
/// call (bench/notes.md, "Figure: carried ids"). Kept beside the session's streams: a stream
/// is added when it is opened with requests and removed when it is forgotten.
#[derive(Debug, Default)]
pub(super) struct Carried {
    streams: ByHash<Carriers>,
    key: std::collections::hash_map::RandomState,
}

impl Carried {
    fn hash(&self, id: &str) -> u64 {
        self.key.hash_one(id)
    }

    /// `s`, stream `stream`, carries its requests' ids (each keeps its hash).
    pub(super) fn add(&mut self, stream: u32, s: &mut Stream) {
        for r in &mut s.requests {
            r.hash = self.key.hash_one(r.id.as_str());
            match self.streams.entry(r.hash) {
                Entry::Vacant(v) => {
                    v.insert(Carriers::One(stream));
                }
                Entry::Occupied(mut o) => o.get_mut().add(stream),
            }
        }
    }

    /// `s`, stream `stream`, is forgotten.
    pub(super) fn remove(&mut self, stream: u32, s: &Stream) {
        for r in &s.requests {
            if let Some(carriers) = self.streams.get_mut(&r.hash) {
                if carriers.remove(stream) {
                    self.streams.remove(&r.hash);
                }
            }
        }
    }

    /// Every stream is forgotten.
    pub(super) fn clear(&mut self) {
        self.streams.clear();
    }

    /// Ids indexed (each with its streams).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.streams.len()
    }

    /// The retained streams that carried `id`, each as its holder.
    pub(super) fn holders<'a>(
        &'a self,
        streams: &'a Streams,
        id: &'a str,
    ) -> impl Iterator<Item = IdHolder> + 'a {
        let carriers = if self.streams.is_empty() {
            &[][..]
        } else {
            self.streams
                .get(&self.hash(id))
                .map(Carriers::as_slice)
                .unwrap_or_default()
        };
        carriers.iter().filter_map(move |&n| {
            let s = streams.get(&n).filter(|s| s.carries(id))?;
            Some(if s.end.is_none() && s.awaits(id) {
                IdHolder::Awaited(s.principal, n)
            } else {
                IdHolder::Answered(s.principal, n)
            })
        })
    }

    /// What [`carrier`] finds in `streams`, asking only the streams that carried one of
    /// `ids` (a hash that collides is told apart by `carries`).
    pub(super) fn carrier<'a>(
        &self,
        streams: &Streams,
        principal: Principal,
        ids: &'a [String],
    ) -> Option<Carrier<'a>> {
        if self.streams.is_empty() {
            return None;
        }
        let carries = |s: &Stream| s.principal == principal && ids.iter().any(|id| s.carries(id));
        let stream = ids
            .iter()
            .filter_map(|id| self.streams.get(&self.hash(id)).map(Carriers::as_slice))
            .flatten()
            .copied()
            .filter(|n| streams.get(n).is_some_and(&carries))
            .min()?;
        let s = streams.get(&stream)?;
        let id = ids.iter().find(|id| s.carries(id))?;
        Some(Carrier {
            stream,
            first_seq: s.first_seq,
            id,
        })
    }
}

/// The first retained stream (in stream order) opened by `principal` that carried one of
/// `ids`, with the first of `ids` it carried; `None`: no retained stream answers for it.
/// What [`Carried::carrier`] answers without scanning; the tests' model of it.
#[cfg(test)]
pub(super) fn carrier<'a>(
    streams: &Streams,
    principal: Principal,
    ids: &'a [String],
) -> Option<Carrier<'a>> {
    streams
        .iter()
        .filter(|(_, s)| s.principal == principal)
        .find_map(|(&stream, s)| {
            ids.iter().find(|id| s.carries(id)).map(|id| Carrier {
                stream,
                first_seq: s.first_seq,
                id,
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::StreamKind;

    fn p(n: u8) -> Principal {
        Principal([n; 16])
    }

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|&i| i.to_owned()).collect()
    }

    /// The one rule of an id in flight, as a table: the replica's state and the fleet's store
    /// both answer through it.
    #[test]
    fn an_ids_verdict_is_its_senders_retransmission_and_nobody_elses() {
        let (me, other) = (p(1), p(2));
        let table = [
            (None, IdVerdict::Free),
            (Some(IdHolder::Forwarding(me)), IdVerdict::Wait),
            (Some(IdHolder::Forwarding(other)), IdVerdict::Another),
            (Some(IdHolder::Awaited(me, 3)), IdVerdict::Carried(3)),
            (Some(IdHolder::Awaited(other, 3)), IdVerdict::Another),
            (Some(IdHolder::Answered(me, 3)), IdVerdict::Carried(3)),
            (Some(IdHolder::Answered(other, 3)), IdVerdict::Free),
        ];
        for (holder, want) in table {
            assert_eq!(verdict(holder, me), want, "{holder:?}");
        }
        // A POST of several ids gets the strictest.
        assert!(IdVerdict::Another > IdVerdict::Wait);
        assert!(IdVerdict::Wait > IdVerdict::Carried(9));
        assert!(IdVerdict::Carried(0) > IdVerdict::Free);
    }

    #[test]
    fn ids_in_flight_are_held_until_their_post_settles() {
        let mut f = Forwarded::default();
        assert!(f.begin(p(1), &ids(&["7", "8"])));
        assert!(f.any(p(1), &ids(&["1", "8"])));
        assert!(!f.begin(p(1), &ids(&["8", "9"])), "8 is in flight");
        assert!(!f.any(p(1), &ids(&["9"])), "a refused begin marks nothing");
        assert!(f.begin(p(1), &ids(&["9"])), "other ids are not held");
        f.settle(p(1), &ids(&["7", "8"]));
        assert!(!f.any(p(1), &ids(&["7", "8"])));
        assert!(f.any(p(1), &ids(&["9"])), "another POST's ids stay");
        assert!(f.begin(p(1), &ids(&["7", "8"])), "free again");
    }

    #[test]
    fn a_post_that_repeats_an_id_frees_it_entirely() {
        let mut f = Forwarded::default();
        assert!(f.begin(p(1), &ids(&["7", "7"])));
        f.settle(p(1), &ids(&["7", "7"]));
        assert!(!f.any(p(1), &ids(&["7"])));
        f.settle(p(1), &ids(&["7"])); // settling what is not held is harmless
        assert!(f.begin(p(1), &ids(&["7"])));
    }

    #[test]
    fn the_carrier_is_the_first_stream_that_carried_one_of_the_ids() {
        let post = |seq, requests: &[&str]| {
            Box::new(Stream::new(
                StreamKind::Post,
                seq,
                ids(requests),
                false,
                None,
            ))
        };
        let streams = Streams::from_iter([
            (
                0,
                Box::new(Stream::new(
                    StreamKind::Standalone,
                    1,
                    Vec::new(),
                    false,
                    None,
                )),
            ),
            (2, post(5, &["\"a\"", "3"])),
            (4, post(9, &["4", "5"])),
        ]);
        let dup = ids(&["5", "3"]);
        assert_eq!(
            carrier(&streams, p(0), &dup),
            Some(Carrier {
                stream: 2,
                first_seq: 5,
                id: "3"
            })
        );
        let dup = ids(&["1", "5", "4"]);
        assert_eq!(
            carrier(&streams, p(0), &dup).map(|c| (c.stream, c.id)),
            Some((4, "5"))
        );
        assert_eq!(
            carrier(&streams, p(0), &ids(&["a", "6"])),
            None,
            "ids are JSON text"
        );
        assert_eq!(carrier(&streams, p(0), &[]), None);
    }

    proptest::proptest! {
        /// The index finds what a scan of every stream finds, as streams come and go.
        #[test]
        fn the_index_finds_the_carrier_a_scan_finds(
            opened in proptest::collection::vec(
                (0u8..3, proptest::collection::vec(0u8..8, 0..4), proptest::bool::ANY),
                0..24,
            ),
            asks in proptest::collection::vec((0u8..3, proptest::collection::vec(0u8..8, 0..4)), 1..16),
        ) {
            let id = |n: u8| n.to_string();
            let mut streams = Streams::default();
            let mut index = Carried::default();
            for (n, (principal, requests, forgotten)) in opened.into_iter().enumerate() {
                let n = n as u32;
                let mut s = Stream::new(StreamKind::Post, u64::from(n) * 10, requests.into_iter().map(id).collect(), false, None);
                s.principal = p(principal);
                index.add(n, &mut s);
                streams.insert(n, Box::new(s));
                if forgotten {
                    // An older stream is forgotten (the oldest ended one, in the session).
                    let oldest = streams.iter().next().map(|(&n, _)| n);
                    if let Some(old) = oldest {
                        let gone = streams.remove(&old).unwrap();
                        index.remove(old, &gone);
                    }
                }
            }
            for (principal, ask) in asks {
                let ask: Vec<String> = ask.into_iter().map(id).collect();
                proptest::prop_assert_eq!(
                    index.carrier(&streams, p(principal), &ask),
                    carrier(&streams, p(principal), &ask)
                );
            }
        }
    }

    #[test]
    fn another_principals_ids_are_its_own() {
        let mut f = Forwarded::default();
        assert!(f.begin(p(1), &ids(&["2"])));
        assert!(!f.any(p(2), &ids(&["2"])), "not in flight for principal 2");
        assert!(f.begin(p(2), &ids(&["2"])));
        f.settle(p(1), &ids(&["2"]));
        assert!(
            f.any(p(2), &ids(&["2"])),
            "principal 2's POST stays in flight"
        );
        let mut theirs = Stream::new(StreamKind::Post, 1, ids(&["2"]), false, None);
        theirs.principal = p(2);
        let streams = Streams::from_iter([(0, Box::new(theirs))]);
        assert_eq!(carrier(&streams, p(1), &ids(&["2"])), None);
        assert_eq!(
            carrier(&streams, p(2), &ids(&["2"])).map(|c| c.stream),
            Some(0)
        );
    }

    /// A session's ids of its streams and of its forgotten ones, under one key.
    fn keyed() -> (Carried, Retired) {
        let c = Carried::default();
        let r = Retired::keyed_as(&c);
        (c, r)
    }

    /// `s` opened (its ids indexed, as the session does) and then forgotten.
    fn retire(c: &mut Carried, r: &mut Retired, mut s: Stream) {
        c.add(0, &mut s);
        c.remove(0, &s);
        r.retire(&s);
    }

    #[test]
    fn retired_ids_are_remembered_per_principal_up_to_the_bound() {
        let (mut c, mut r) = keyed();
        let mut s = Stream::new(StreamKind::Post, 1, ids(&["2", "3"]), false, None);
        s.principal = p(7);
        retire(&mut c, &mut r, s);
        assert_eq!(r.find(p(7), &ids(&["9", "3"])), Some("3"));
        assert_eq!(r.find(p(8), &ids(&["3"])), None, "another principal's 3");
        let many: Vec<String> = (0..MAX_RETIRED_IDS + 10)
            .map(|i| format!("\"x{i}\""))
            .collect();
        retire(
            &mut c,
            &mut r,
            Stream::new(StreamKind::Post, 1, many.clone(), false, None),
        );
        assert_eq!(r.hashes.len(), MAX_RETIRED_IDS);
        assert_eq!(r.find(p(0), &many[..1]), Some(many[0].as_str()));
        assert_eq!(
            r.find(p(0), &many[many.len() - 1..]),
            None,
            "past the bound"
        );
    }

    #[test]
    fn a_rebind_moves_the_owners_ids_and_only_those() {
        let mut f = Forwarded::default();
        assert!(f.begin(p(1), &ids(&["2"])));
        assert!(f.begin(p(3), &ids(&["4"])));
        f.rebind(p(1), p(2));
        assert!(f.any(p(2), &ids(&["2"])));
        assert!(!f.any(p(1), &ids(&["2"])));
        assert!(f.any(p(3), &ids(&["4"])), "another principal's stay");
        let (mut c, mut r) = keyed();
        let mut s = Stream::new(StreamKind::Post, 1, ids(&["5"]), false, None);
        s.principal = p(1);
        retire(&mut c, &mut r, s);
        r.rebind(p(1), p(2));
        assert_eq!(r.find(p(2), &ids(&["5"])), Some("5"));
        assert_eq!(r.find(p(1), &ids(&["5"])), None);
    }
}
