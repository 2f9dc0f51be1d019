//! The store's data as bytes, pure: the keys derived from the fleet's secret, key names (one
//! hash tag per session), the session's record, a stream's facts (its meta) and its entries
//! (one publication's events, packed). No I/O: `store` sends what this writes.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::session::{IdHolder, Principal, StreamKind};

/// The record's format version.
pub(super) const RECORD_VERSION: &str = "1";

/// Stream numbers a replica claims at once for a session it creates or adopts: the creator
/// numbers from 0, each adoption claims the next block (`sn` in the record), so two replicas
/// never give one number to two streams of a session.
pub(super) const STREAM_BLOCK: u32 = 1 << 16;

/// The bounds of a record read back (the longest field a replica writes is the endpoint,
/// which `--max-request-bytes`' head limit already bounds; the path is capped here): more
/// fields, a longer name or value, and the record is not adopted. Whole, a record is at most
/// `MAX_RECORD_FIELDS × (MAX_FIELD_NAME + MAX_RECORD_FIELD)`, about 18 KiB, and a few hundred
/// bytes in practice (`docs/design.md`, "Keys").
const MAX_RECORD_FIELDS: usize = 16;
const MAX_FIELD_NAME: usize = 8;
const MAX_RECORD_FIELD: usize = 1024;

/// Request ids longer than this are named by their keyed hash in the store's keys.
const MAX_PLAIN_ID: usize = 32;

/// The keys the fleet derives from its shared secret (`--store-key-file`), each for one use.
#[derive(Clone)]
pub(crate) struct Keys {
    /// Principals are keyed MACs under it: the same caller is the same principal on every
    /// replica, so a session's binding means the same everywhere.
    pub bind: [u8; 32],
    /// Key names: a session's hash tag is a keyed hash of its id (the id is never stored).
    names: [u8; 32],
    /// Events sealed at rest (`--store-seal`): each session's key is derived from it.
    seal: [u8; 32],
    /// Session labels (logs, metrics, the admin listener): the same on every replica.
    pub labels: [u8; 32],
    /// The admin channel's MACs (`ask`): a question or an answer no replica made is dropped.
    pub admin: [u8; 32],
    /// Minted session ids certify themselves under it (`session::mint_fleet_id`).
    pub minted: [u8; 32],
}

impl Keys {
    pub(crate) fn derive(secret: &[u8]) -> Keys {
        Keys {
            bind: blake3::derive_key("mcp-reattach 2026-12 principal binding", secret),
            names: blake3::derive_key("mcp-reattach 2026-12 store key names", secret),
            seal: blake3::derive_key("mcp-reattach 2026-12 store seal", secret),
            labels: blake3::derive_key("mcp-reattach 2026-12 session labels", secret),
            admin: blake3::derive_key("mcp-reattach 2026-12 admin channel", secret),
            minted: blake3::derive_key("mcp-reattach 2026-12 minted session ids", secret),
        }
    }

    /// The hash tag of session `id`: every key of the session carries it, so a Redis Cluster
    /// keeps a session on one slot.
    pub(crate) fn tag(&self, id: &str) -> Tag {
        let h = blake3::keyed_hash(&self.names, id.as_bytes());
        Tag(hex(&h.as_bytes()[..16]).into())
    }
}

/// A session's hash tag (32 hex digits).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tag(Arc<str>);

impl Tag {
    /// A tag made before (a session keeps its own: [`Tag::text`]).
    pub(crate) fn from_text(text: Arc<str>) -> Tag {
        Tag(text)
    }

    pub(crate) fn text(&self) -> &Arc<str> {
        &self.0
    }
}

impl Tag {
    /// The session's record.
    pub(super) fn record(&self) -> String {
        format!("mra:{{{}}}:rec", self.0)
    }

    /// Who holds request `id` in the session, whoever sent it (an id is in flight fleet-wide
    /// for its session): the value names the sender ([`held_by`]).
    pub(super) fn request(&self, keys: &Keys, id: &str) -> String {
        // The id's JSON text as it is (no secret in it): hashed only when it is long, so a key
        // stays short.
        let mut key = String::with_capacity(8 + self.0.len() + 5 + 1 + id.len().min(34));
        key.push_str("mra:{");
        key.push_str(&self.0);
        key.push_str("}:id:");
        if id.len() <= MAX_PLAIN_ID {
            key.push_str(id);
        } else {
            key.push('#');
            key.push_str(&hex(
                &blake3::keyed_hash(&keys.names, id.as_bytes()).as_bytes()[..16]
            ));
        }
        key
    }

    /// Stream `stream`'s facts ([`Meta`]).
    pub(super) fn meta(&self, stream: u32) -> String {
        format!("mra:{{{}}}:m:{stream}", self.0)
    }

    /// Where a client following stream `stream` from the store is: `<position>:<unix ms>`.
    pub(super) fn progress(&self, stream: u32) -> String {
        format!("mra:{{{}}}:a:{stream}", self.0)
    }

    /// The events of the session's stream `stream`.
    pub(super) fn events(&self, stream: u32) -> String {
        format!("mra:{{{}}}:ev:{stream}", self.0)
    }
}

/// A follower's progress as its field holds it.
pub(super) fn progress_value(at: u64, unix_ms: u64) -> String {
    format!("{at}:{unix_ms}")
}

/// A follower's progress read back: its position and when (unix ms).
pub(super) fn parse_progress(v: &str) -> Option<(u64, u64)> {
    let (at, ms) = v.split_once(':')?;
    Some((at.parse().ok()?, ms.parse().ok()?))
}

/// Milliseconds since the Unix epoch: the fleet's shared clock (replicas' clocks are assumed
/// within a fraction of `--stall-timeout` of each other).
pub(super) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The cause a stream's meta ends with when its owner lost its lease (as its clients are
/// told: `upstream-failed`, cause `owner-lost`).
pub(super) const OWNER_LOST: &str = "owner-lost: the replica reading this call upstream is gone";

/// The lease of the replica named `replica` (its own hash tag: one key per replica).
pub(super) fn lease_key(replica: &str) -> String {
    format!("mra:{{r:{replica}}}:alive")
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

fn unhex16(s: &str) -> Option<[u8; 16]> {
    if s.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// A session as the store knows it: enough for any replica to adopt it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    /// The gateway minted the id (a stateless upstream); else the id is the upstream's.
    pub minted: bool,
    pub epoch: u64,
    /// The path the session was created on.
    pub endpoint: String,
    /// Whom it is bound to, and whose share it counts in.
    pub principal: Principal,
    pub share: Principal,
    pub protocol_version: Option<String>,
    /// The session ended (DELETE, the upstream's 404): a tombstone, adopted by nobody.
    pub gone: bool,
}

impl Record {
    /// The record's fields, stream numbers handed out up to `sn` (the creator's block, from
    /// 0, claimed with them when the session is created).
    pub(super) fn fields(&self, sn: u32) -> Vec<(&'static str, String)> {
        let mut f = vec![
            ("v", RECORD_VERSION.to_owned()),
            (
                "kind",
                if self.minted { "minted" } else { "upstream" }.to_owned(),
            ),
            ("epoch", format!("{:016x}", self.epoch)),
            ("ep", self.endpoint.clone()),
            ("pr", hex(&self.principal.0)),
            ("share", hex(&self.share.0)),
            ("state", if self.gone { "gone" } else { "live" }.to_owned()),
            ("sn", sn.to_string()),
        ];
        if let Some(v) = &self.protocol_version {
            f.push(("ver", v.clone()));
        }
        f
    }

    /// The record read back (`HGETALL`'s pairs); `None` for anything but a record this
    /// version wrote whole.
    pub(super) fn parse(pairs: &[(String, Vec<u8>)]) -> Option<Record> {
        // A record is a few hundred bytes: a field past its bound was not written by a
        // replica (which bounds what it keeps), and is not held by one.
        if pairs.len() > MAX_RECORD_FIELDS
            || pairs
                .iter()
                .any(|(f, v)| f.len() > MAX_FIELD_NAME || v.len() > MAX_RECORD_FIELD)
        {
            return None;
        }
        let get = |k: &str| {
            pairs
                .iter()
                .find(|(f, _)| f == k)
                .and_then(|(_, v)| std::str::from_utf8(v).ok())
        };
        if get("v")? != RECORD_VERSION {
            return None;
        }
        Some(Record {
            minted: match get("kind")? {
                "minted" => true,
                "upstream" => false,
                _ => return None,
            },
            epoch: u64::from_str_radix(get("epoch")?, 16).ok()?,
            endpoint: get("ep")?.to_owned(),
            principal: Principal(unhex16(get("pr")?)?),
            share: Principal(unhex16(get("share")?)?),
            protocol_version: match get("ver") {
                Some(v) if !crate::jsonrpc::is_protocol_version(v) => return None,
                v => v.map(str::to_owned),
            },
            gone: get("state")? == "gone",
        })
    }
}

/// A request id's value while a replica forwards its POST: the claim's token, naming its
/// sender (`p:<principal>:<replica>:<nonce>`).
pub(super) fn pending(p: Principal, replica: &str, nonce: u64) -> String {
    format!("p:{}:{replica}:{nonce:016x}", principal_text(p))
}

/// A request id's value once stream `stream` of its sender carries it: `s:` while the stream
/// runs, `e:` once it ended (`<kind>:<principal>:<stream>`).
pub(super) fn carried(p: Principal, stream: u32, ended: bool) -> String {
    let kind = if ended { 'e' } else { 's' };
    format!("{kind}:{}:{stream}", principal_text(p))
}

/// Who holds a request id, read from its value; `None` for a value no replica wrote.
pub(super) fn held_by(value: &str) -> Option<IdHolder> {
    let (kind, rest) = value.split_once(':')?;
    let (pr, rest) = rest.split_once(':')?;
    let p = Principal(unhex16(pr)?);
    match kind {
        "p" => Some(IdHolder::Forwarding(p)),
        "s" => Some(IdHolder::Awaited(p, rest.parse().ok()?)),
        "e" => Some(IdHolder::Answered(p, rest.parse().ok()?)),
        _ => None,
    }
}

/// The principal's form in the store and in the adoption script's argument.
pub(super) fn principal_text(p: Principal) -> String {
    hex(&p.0)
}

/// A stream's facts in the record (field `s<n>`), written by its owner when it opens and when
/// it ends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Meta {
    /// The owner: the replica reading it upstream.
    pub o: String,
    /// `post` or `standalone`.
    pub k: String,
    /// Who opened it.
    pub pr: String,
    /// Its opening position.
    pub f: u64,
    /// The last position the owner had published when it wrote this meta (at the opening, at
    /// each answer, at the end, and when it writes a running stream's facts again after an
    /// outage): a stream whose entries the store lost still says how far it went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l: Option<u64>,
    /// Ended, and how: `None` while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<MetaEnd>,
    /// The request ids its POST carried, each with the position of the event that answered
    /// it (0: none yet), as of this meta's writing (at the opening, at each answer, at the end).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub req: Vec<(String, u64)>,
}

/// How a published stream ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct MetaEnd {
    /// Its last position.
    pub last: u64,
    /// The upstream's failure (`None`: it completed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

impl Meta {
    pub(super) fn kind(&self) -> StreamKind {
        if self.k == "standalone" {
            StreamKind::Standalone
        } else {
            StreamKind::Post
        }
    }

    pub(super) fn opened_by(&self, p: Principal) -> bool {
        self.pr == principal_text(p)
    }

    /// Whether a client at position `at` has no answer to some request (see
    /// [`Meta::unanswered_at`]).
    pub(super) fn unanswered_any(&self, at: u64) -> bool {
        self.req
            .iter()
            .any(|(_, answered)| *answered == 0 || *answered > at)
    }

    /// The requests a client at position `at` has no answer to: none came, or after `at`.
    pub(super) fn unanswered_at(&self, at: u64) -> Vec<String> {
        self.req
            .iter()
            .filter(|(_, answered)| *answered == 0 || *answered > at)
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// Appends one event to a packed publication: its position, its `event: message` flag, its
/// length and its body (the window's form: what follows the `id:` line on the wire).
pub(super) fn pack_event(out: &mut Vec<u8>, seq: u64, message: bool, body: &[u8]) {
    out.extend_from_slice(&seq.to_le_bytes());
    out.push(u8::from(message));
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
}

/// One event of a packed publication.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Packed<'a> {
    pub seq: u64,
    pub message: bool,
    pub body: &'a [u8],
}

/// The events of a packed publication, in order; `Err` at the first that is cut short or
/// out of order (a store that holds what the gateway did not write).
pub(super) fn unpack(mut b: &[u8]) -> Result<Vec<Packed<'_>>, &'static str> {
    let mut out = Vec::new();
    let mut last = 0;
    while !b.is_empty() {
        if b.len() < 13 {
            return Err("an event's head is cut short");
        }
        let seq = u64::from_le_bytes(b[..8].try_into().map_err(|_| "head")?);
        let message = match b[8] {
            0 => false,
            1 => true,
            _ => return Err("an event's flag is neither 0 nor 1"),
        };
        let len = u32::from_le_bytes(b[9..13].try_into().map_err(|_| "head")?) as usize;
        let body = b.get(13..13 + len).ok_or("an event's body is cut short")?;
        if seq <= last {
            return Err("events out of order");
        }
        last = seq;
        out.push(Packed { seq, message, body });
        b = &b[13 + len..];
    }
    Ok(out)
}

/// The AES-256-GCM key that seals session `tag`'s events, and the nonce and associated data of
/// the entry of `stream` whose last event is at `last`: an entry opens only under its own
/// session, stream and position (moved elsewhere in the store, it does not open). One writer
/// per stream and strictly increasing positions make each nonce used once under its key.
fn sealing(
    keys: &Keys,
    tag: &Tag,
    stream: u32,
    last: u64,
) -> (ring::aead::LessSafeKey, ring::aead::Nonce, Vec<u8>) {
    let mut material = Vec::with_capacity(32 + tag.0.len());
    material.extend_from_slice(&keys.seal);
    material.extend_from_slice(tag.0.as_bytes());
    let key = blake3::derive_key("mcp-reattach 2026-12 session seal", &material);
    let key = ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &key)
        .map(ring::aead::LessSafeKey::new)
        .expect("a 32-byte AES-256-GCM key");
    let mut nonce = [0u8; 12];
    nonce[..4].copy_from_slice(&stream.to_be_bytes());
    nonce[4..].copy_from_slice(&last.to_be_bytes());
    let mut aad = tag.0.as_bytes().to_vec();
    aad.extend_from_slice(&stream.to_be_bytes());
    aad.extend_from_slice(&last.to_be_bytes());
    (key, ring::aead::Nonce::assume_unique_for_key(nonce), aad)
}

/// Seals an entry's packed events in place (they grow by the 16-byte tag).
pub(super) fn seal(keys: &Keys, tag: &Tag, stream: u32, last: u64, packed: &mut Vec<u8>) {
    let (key, nonce, aad) = sealing(keys, tag, stream, last);
    // Sealing into a Vec only fails when it cannot grow: not a case to recover from.
    key.seal_in_place_append_tag(nonce, ring::aead::Aad::from(aad), packed)
        .expect("sealing in memory");
}

/// Opens a sealed entry in place; `Err` when it was not sealed by this fleet for this
/// session, stream and position.
pub(super) fn open(
    keys: &Keys,
    tag: &Tag,
    stream: u32,
    last: u64,
    sealed: &mut Vec<u8>,
) -> Result<(), ()> {
    let (key, nonce, aad) = sealing(keys, tag, stream, last);
    let len = key
        .open_in_place(nonce, ring::aead::Aad::from(aad), sealed)
        .map_err(|_| ())?
        .len();
    sealed.truncate(len);
    Ok(())
}

/// The position an entry's id (`0-<seq>`) names.
pub(super) fn entry_seq(id: &str) -> Option<u64> {
    id.strip_prefix("0-")?.parse().ok()
}

/// An entry's id in its stream: `0-<position of its last event>`.
pub(super) fn entry_id(last: u64) -> String {
    format!("0-{last}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_record_reads_back_as_written() {
        let r = Record {
            minted: true,
            epoch: 0x0123_4567_89ab_cdef,
            endpoint: "/mcp".into(),
            principal: Principal([7; 16]),
            share: Principal([9; 16]),
            protocol_version: Some("2025-06-18".into()),
            gone: false,
        };
        let pairs: Vec<(String, Vec<u8>)> = r
            .fields(STREAM_BLOCK)
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.into_bytes()))
            .collect();
        assert_eq!(Record::parse(&pairs), Some(r));
        let mut other = pairs.clone();
        other[0].1 = b"2".to_vec();
        assert_eq!(Record::parse(&other), None, "another version is not read");
        assert_eq!(Record::parse(&pairs[1..]), None, "nor a partial record");
    }

    #[test]
    fn a_session_tag_is_keyed_and_every_key_carries_it() {
        let (a, b) = (Keys::derive(&[1; 32]), Keys::derive(&[2; 32]));
        assert_ne!(a.tag("s"), b.tag("s"), "another secret, other names");
        assert_ne!(a.tag("s"), a.tag("t"));
        let t = a.tag("s");
        let braces = |k: String| {
            k.split('{')
                .nth(1)
                .and_then(|r| r.split('}').next())
                .map(str::to_owned)
        };
        assert_eq!(braces(t.record()).as_deref(), Some(&*t.0));
        assert_eq!(braces(t.events(3)).as_deref(), Some(&*t.0));
        assert_eq!(hex(&[0, 0x9f, 0xa0, 0xff]), "009fa0ff");
        assert_ne!(a.bind, Keys::derive(&[1; 32]).names, "one key per use");
    }

    #[test]
    fn a_request_key_is_the_sessions_and_short_whatever_its_id() {
        let keys = Keys::derive(&[5; 32]);
        let t = keys.tag("s");
        assert_ne!(
            t.request(&keys, "7"),
            t.request(&keys, "\"7\""),
            "per id as sent"
        );
        assert_ne!(t.request(&keys, "7"), keys.tag("s2").request(&keys, "7"));
        let long = "x".repeat(10_000);
        let k = t.request(&keys, &long);
        assert!(k.len() < 120, "{k}");
        assert_ne!(k, t.request(&keys, &"x".repeat(10_001)));
        assert!(t
            .request(&keys, "7")
            .starts_with(&format!("mra:{{{}}}:id:", t.0)));
    }

    #[test]
    fn a_request_ids_value_names_its_sender() {
        let (a, b) = (Principal([1; 16]), Principal([2; 16]));
        assert_eq!(held_by(&pending(a, "r1", 7)), Some(IdHolder::Forwarding(a)));
        assert_eq!(
            held_by(&carried(b, 9, false)),
            Some(IdHolder::Awaited(b, 9))
        );
        assert_eq!(
            held_by(&carried(b, 9, true)),
            Some(IdHolder::Answered(b, 9))
        );
        for junk in ["", "s:9", "x:0101:1", "s:zz:1", "p"] {
            assert_eq!(held_by(junk), None, "{junk}");
        }
        // The carrying script compares the principal at bytes 3..=34 of every form.
        for v in [
            pending(a, "r", 1),
            carried(a, 1, false),
            carried(a, 1, true),
        ] {
            assert_eq!(&v[2..34], principal_text(a));
        }
    }

    #[test]
    fn a_record_past_its_bounds_is_not_one() {
        let r = Record {
            minted: false,
            epoch: 7,
            endpoint: "/mcp".into(),
            principal: Principal([1; 16]),
            share: Principal([2; 16]),
            protocol_version: Some("2025-06-18".into()),
            gone: false,
        };
        let pairs = |f: Vec<(&str, String)>| -> Vec<(String, Vec<u8>)> {
            f.into_iter()
                .map(|(k, v)| (k.to_owned(), v.into_bytes()))
                .collect()
        };
        let fields = r.fields(64);
        assert!(Record::parse(&pairs(fields.clone())).is_some());
        let total: usize = fields.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(total < 300, "a record is a few hundred bytes: {total}");
        let mut huge = fields.clone();
        huge.retain(|(k, _)| *k != "ver");
        huge.push(("ver", "9".repeat(100_000)));
        assert!(
            Record::parse(&pairs(huge)).is_none(),
            "a field past its bound"
        );
        let mut odd = fields.clone();
        odd.retain(|(k, _)| *k != "ver");
        odd.push(("ver", "2025\u{1b}[2J".into()));
        assert!(Record::parse(&pairs(odd)).is_none(), "not a version");
        let mut many = pairs(fields);
        many.extend((0..20).map(|i| (format!("x{i}"), vec![b'1'])));
        assert!(Record::parse(&many).is_none(), "too many fields");
    }

    #[test]
    fn a_stream_meta_is_compact_json() {
        let m = Meta {
            o: "r1".into(),
            k: "post".into(),
            pr: principal_text(Principal([1; 16])),
            f: 4,
            l: None,
            end: None,
            req: vec![("1".into(), 0), ("2".into(), 9)],
        };
        let text = serde_json::to_string(&m).unwrap();
        assert!(!text.contains("end"));
        assert_eq!(serde_json::from_str::<Meta>(&text).unwrap(), m);
        assert!(m.opened_by(Principal([1; 16])) && !m.opened_by(Principal([2; 16])));
        assert_eq!(m.unanswered_at(9), vec!["1".to_owned()]);
        assert_eq!(m.unanswered_at(8), vec!["1".to_owned(), "2".to_owned()]);
    }

    #[test]
    fn a_followers_progress_reads_back() {
        assert_eq!(
            parse_progress(&progress_value(42, 1_700_000_000_123)),
            Some((42, 1_700_000_000_123))
        );
        assert_eq!(parse_progress("42"), None);
        assert_eq!(parse_progress("x:1"), None);
    }

    #[test]
    fn a_sealed_entry_opens_only_in_its_place_and_under_its_fleets_key() {
        let keys = Keys::derive(&[3; 32]);
        let (t, u) = (keys.tag("s"), keys.tag("t"));
        let mut packed = Vec::new();
        pack_event(&mut packed, 7, true, b"data: secret tool result\n\n");
        let plain = packed.clone();
        seal(&keys, &t, 2, 7, &mut packed);
        assert_eq!(packed.len(), plain.len() + 16);
        assert!(
            !packed.windows(6).any(|w| w == b"secret"),
            "nothing in the clear"
        );
        for (k, tag, stream, last) in [
            (&keys, &u, 2, 7),
            (&keys, &t, 3, 7),
            (&keys, &t, 2, 8),
            (&Keys::derive(&[4; 32]), &t, 2, 7),
        ] {
            let mut moved = packed.clone();
            assert!(open(k, tag, stream, last, &mut moved).is_err());
        }
        open(&keys, &t, 2, 7, &mut packed).unwrap();
        assert_eq!(packed, plain);
        assert_eq!(entry_seq(&entry_id(42)), Some(42));
        assert_eq!(entry_seq("1-42"), None);
    }

    proptest! {
        /// Whatever events a publication packs, they unpack as they were; cut anywhere
        /// inside, they do not.
        #[test]
        fn packed_events_unpack_as_packed(
            events in proptest::collection::vec((1u64..1000, any::<bool>(), proptest::collection::vec(any::<u8>(), 0..40)), 0..8),
            cut in 1usize..13,
        ) {
            let mut seq = 0;
            let mut packed = Vec::new();
            let mut want = Vec::new();
            for (gap, message, body) in &events {
                seq += gap;
                pack_event(&mut packed, seq, *message, body);
                want.push((seq, *message, body.clone()));
            }
            let got: Vec<_> = unpack(&packed).unwrap().into_iter().map(|p| (p.seq, p.message, p.body.to_vec())).collect();
            prop_assert_eq!(got, want);
            if !packed.is_empty() {
                let short = &packed[..packed.len() - cut.min(packed.len())];
                if short.len() != packed.len() {
                    // A cut at an event's boundary is a shorter publication; elsewhere an error.
                    if let Ok(got) = unpack(short) {
                        prop_assert!(got.len() < events.len());
                    }
                }
            }
        }
    }
}
