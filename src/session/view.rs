//! What an operator sees of a session (the admin listener's `/sessions` and `/ui`): its
//! labels, shape, times, streams and clients, as plain data. Never a payload, a credential or
//! the session's id: the session is named by its label ([`super::hash_id`]), its principal by
//! a prefix of its keyed MAC.

use serde::{Deserialize, Serialize};

use super::state::State;
use super::stream::StreamKind;
use super::Session;

/// One session as one replica holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionView {
    /// The session's label: the hashed id logs and metrics show.
    pub id: String,
    /// The first 8 bytes of the principal's keyed MAC, in hex (anonymous callers are one
    /// principal, or one per address: `proxy::auth`).
    pub principal: String,
    /// `upstream` (the upstream issued the id) or `minted` (a stateless upstream: the
    /// gateway's own id).
    pub shape: String,
    pub protocol_version: Option<String>,
    /// The path the session was created on.
    pub endpoint: String,
    /// When this replica made or adopted the session (Unix ms).
    pub created_ms: u64,
    /// The session's last request or client activity (Unix ms).
    pub last_used_ms: u64,
    /// Clients attached to its streams now.
    pub attached_clients: usize,
    /// Events and bytes its window holds.
    pub window_events: usize,
    pub window_bytes: usize,
    pub streams: Vec<StreamView>,
    /// The replicas that hold it (one without a fleet).
    pub replicas: Vec<String>,
}

/// One stream of a session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamView {
    pub number: u32,
    /// `post` (a call's answer) or `standalone` (the session's GET stream).
    pub kind: String,
    /// `running` (read from the upstream), `paused` (its reader waits for room in the
    /// window), `ended`.
    pub state: String,
    /// A client is attached to it on the replica that reports it.
    pub attached: bool,
    /// The stream's opening position and the last one issued on it.
    pub first_seq: u64,
    pub last_seq: u64,
    /// Its events in the session's window now.
    pub window_events: usize,
    pub window_bytes: usize,
    /// Its requests not answered yet.
    pub pending_requests: usize,
    /// The replica that reads (or read) it from the upstream.
    pub replica: String,
}

impl Session {
    /// The session as `replica` holds it now.
    pub fn view(&self, replica: &str) -> SessionView {
        let st = super::lock(&self.state);
        let now = std::time::SystemTime::now();
        let last_used = now
            .checked_sub(st.last_activity.elapsed())
            .unwrap_or(std::time::UNIX_EPOCH);
        SessionView {
            id: self.hashed_id().to_string(),
            principal: principal_label(&st),
            shape: if self.minted() { "minted" } else { "upstream" }.into(),
            protocol_version: st.protocol_version.clone(),
            endpoint: self.endpoint().to_owned(),
            created_ms: self.created_ms,
            last_used_ms: unix_ms(last_used),
            attached_clients: st.attached_clients(),
            window_events: st.window.len(),
            window_bytes: st.window.bytes(),
            streams: streams(&st, replica),
            replicas: vec![replica.to_owned()],
        }
    }
}

fn principal_label(st: &State) -> String {
    st.principal.0[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn streams(st: &State, replica: &str) -> Vec<StreamView> {
    let mut out: Vec<StreamView> = st
        .streams
        .numbered()
        .map(|(n, s)| StreamView {
            number: n,
            kind: match s.kind {
                StreamKind::Post => "post",
                StreamKind::Standalone => "standalone",
            }
            .into(),
            state: if s.end.is_some() {
                "ended"
            } else if s.paused_reader.is_some() {
                "paused"
            } else {
                "running"
            }
            .into(),
            attached: s.sub.is_some(),
            first_seq: s.first_seq,
            last_seq: s.last_seq,
            window_events: 0,
            window_bytes: 0,
            pending_requests: s
                .requests
                .iter()
                .filter(|r| s.end.is_none() && r.answered_at.is_none() && !r.reported)
                .count(),
            replica: replica.to_owned(),
        })
        .collect();
    for e in st.window.entries() {
        if let Ok(i) = out.binary_search_by_key(&e.stream, |s| s.number) {
            out[i].window_events += 1;
            out[i].window_bytes += e.len();
        }
    }
    out
}

/// Milliseconds since the Unix epoch.
pub(crate) fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// This host's name (`/proc/sys/kernel/hostname`, else `HOSTNAME`, else `gateway`): how
/// operators tell replicas apart (a pod's name in Kubernetes). Read once.
pub(crate) fn host_name() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic()))
            .unwrap_or_else(|| "gateway".to_owned())
    })
}

/// The sessions of a gateway, or of a fleet, as the admin listener answers `/sessions`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Listing {
    /// The replica that answered.
    pub replica: String,
    /// Whether the list covers a fleet (a shared store), not one process.
    pub fleet: bool,
    /// The replicas whose sessions are in it (this one first).
    pub replicas: Vec<String>,
    /// With a fleet: how many replicas listened when they were asked, the answering one
    /// included. Fewer in `replicas`: some did not answer within a second.
    pub replicas_asked: usize,
    pub sessions: Vec<SessionView>,
    /// More sessions follow: the next page is asked for with this as its `cursor` (the
    /// largest label of this page; pages go by label).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// The longest protocol version an operator's page carries of a session: a client's own text,
/// cut there (at a character's boundary) so one session cannot fill a page.
pub(crate) const VIEW_PROTOCOL_CHARS: usize = 64;

/// One page of `views`: those labelled after `after` (all without it), by label, at most
/// `limit` of them and, past the first, at most `bytes` of JSON. `true` with it when some were
/// left for a next page. Each view's protocol version is cut at [`VIEW_PROTOCOL_CHARS`].
pub(crate) fn page(
    views: impl IntoIterator<Item = SessionView>,
    after: Option<&str>,
    limit: usize,
    bytes: usize,
) -> (Vec<SessionView>, bool) {
    let mut all: Vec<SessionView> = views
        .into_iter()
        .filter(|v| after.is_none_or(|a| v.id.as_str() > a))
        .collect();
    all.sort_by(|a, b| a.id.cmp(&b.id));
    let mut out = Vec::new();
    let mut used = 0usize;
    let total = all.len();
    for mut v in all {
        if out.len() >= limit {
            break;
        }
        if let Some(p) = &mut v.protocol_version {
            if let Some((cut, _)) = p.char_indices().nth(VIEW_PROTOCOL_CHARS) {
                p.truncate(cut);
            }
        }
        let size = serde_json::to_vec(&v).map_or(usize::MAX, |j| j.len());
        if !out.is_empty() && used.saturating_add(size) > bytes {
            break;
        }
        used = used.saturating_add(size);
        out.push(v);
    }
    let more = out.len() < total;
    (out, more)
}

/// One session's views from the replicas that hold it, as one: its streams from all of them
/// (each from the replica that reads it), its clients and windows summed, its first creation
/// and last use, the most recently used first.
pub(crate) fn merge(held: impl IntoIterator<Item = SessionView>) -> Vec<SessionView> {
    let mut by_id: std::collections::BTreeMap<String, SessionView> = Default::default();
    for v in held {
        match by_id.entry(v.id.clone()) {
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(v);
            }
            std::collections::btree_map::Entry::Occupied(mut e) => {
                let m = e.get_mut();
                m.created_ms = m.created_ms.min(v.created_ms);
                m.last_used_ms = m.last_used_ms.max(v.last_used_ms);
                m.attached_clients += v.attached_clients;
                m.window_events += v.window_events;
                m.window_bytes += v.window_bytes;
                if m.protocol_version.is_none() {
                    m.protocol_version = v.protocol_version;
                }
                for s in v.streams {
                    if let Err(i) = m.streams.binary_search_by_key(&s.number, |x| x.number) {
                        m.streams.insert(i, s);
                    }
                }
                for r in v.replicas {
                    if !m.replicas.contains(&r) {
                        m.replicas.push(r);
                    }
                }
                m.replicas.sort();
            }
        }
    }
    let mut all: Vec<SessionView> = by_id.into_values().collect();
    all.sort_by(|a, b| b.last_used_ms.cmp(&a.last_used_ms).then(a.id.cmp(&b.id)));
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(id: &str, replica: &str, streams: &[u32], used: u64) -> SessionView {
        SessionView {
            id: id.into(),
            principal: "00".repeat(8),
            shape: "upstream".into(),
            protocol_version: None,
            endpoint: "/mcp".into(),
            created_ms: used,
            last_used_ms: used,
            attached_clients: 1,
            window_events: streams.len(),
            window_bytes: 10,
            streams: streams
                .iter()
                .map(|&n| StreamView {
                    number: n,
                    kind: "post".into(),
                    state: "running".into(),
                    attached: true,
                    first_seq: 0,
                    last_seq: 1,
                    window_events: 1,
                    window_bytes: 10,
                    pending_requests: 1,
                    replica: replica.into(),
                })
                .collect(),
            replicas: vec![replica.into()],
        }
    }

    #[test]
    fn a_session_held_by_two_replicas_is_one_row_with_both_sides() {
        let mut b = view("s1", "b", &[65536, 2], 20);
        b.protocol_version = Some("2025-06-18".into());
        let merged = merge([view("s1", "a", &[0, 2], 10), view("s2", "a", &[], 30), b]);
        assert_eq!(merged.len(), 2);
        // The most recently used first.
        assert_eq!(merged[0].id, "s2");
        let s1 = &merged[1];
        let numbers: Vec<u32> = s1.streams.iter().map(|s| s.number).collect();
        assert_eq!(numbers, [0, 2, 65536]);
        // Stream 2 is reported by the first view only once; 65536 keeps its replica.
        assert_eq!(s1.streams[2].replica, "b");
        assert_eq!(s1.replicas, ["a", "b"]);
        assert_eq!(
            (s1.attached_clients, s1.window_events, s1.window_bytes),
            (2, 4, 20)
        );
        assert_eq!((s1.created_ms, s1.last_used_ms), (10, 20));
        assert_eq!(s1.protocol_version.as_deref(), Some("2025-06-18"));
    }

    #[test]
    fn pages_go_by_label_bounded_in_count_and_bytes() {
        let views: Vec<SessionView> = ["c", "a", "d", "b"]
            .iter()
            .map(|id| view(id, "r", &[0], 0))
            .collect();
        let ids = |p: &[SessionView]| p.iter().map(|v| v.id.clone()).collect::<Vec<_>>();
        let (p, more) = page(views.clone(), None, 2, usize::MAX);
        assert_eq!((ids(&p), more), (vec!["a".into(), "b".into()], true));
        let (p, more) = page(views.clone(), Some("b"), 2, usize::MAX);
        assert_eq!((ids(&p), more), (vec!["c".into(), "d".into()], false));
        // The bytes bound keeps the first view whatever its size, and stops before the next.
        let (p, more) = page(views.clone(), None, 10, 1);
        assert_eq!((ids(&p), more), (vec!["a".into()], true));
        let mut long = view("e", "r", &[], 0);
        long.protocol_version = Some("é".repeat(1000));
        let (p, _) = page([long], None, 1, usize::MAX);
        assert_eq!(
            p[0].protocol_version.as_deref().map(|v| v.chars().count()),
            Some(VIEW_PROTOCOL_CHARS)
        );
    }
}
