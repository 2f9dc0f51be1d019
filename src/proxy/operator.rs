//! What the admin listener asks of the gateway for operators: the sessions held here (with a
//! store, in the whole fleet: `store::ask`), a page at a time, and an end of one, named by its
//! label.

use crate::session::{merge, page, Eviction, Listing, SessionView};
use crate::store::{Busy, ANSWER_BYTES};

use super::Gateway;

/// Which sessions an operator asks for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Asked<'a> {
    /// The one labelled so.
    One(&'a str),
    /// A page: those labelled after `after` (from the first without it), at most `limit`.
    Page {
        after: Option<&'a str>,
        limit: usize,
    },
}

impl Gateway {
    /// The sessions this replica holds, with a store every replica's: the one labelled so,
    /// or a page of them by label ([`Listing::next_cursor`] names the next). [`Busy`] while
    /// another operator's question to the fleet is out.
    pub(crate) async fn sessions(&self, asked: Asked<'_>) -> Result<Listing, Busy> {
        let me = self.store.display_name();
        let (label, after, limit) = match asked {
            Asked::One(l) => (Some(l), None, 1),
            Asked::Page { after, limit } => (None, after, limit),
        };
        let mine: (Vec<SessionView>, bool) = match label {
            None => page(self.registry.views(&me), after, limit, ANSWER_BYTES),
            Some(l) => (
                page(
                    self.registry.find_label(l).map(|s| s.view(&me)),
                    None,
                    1,
                    ANSWER_BYTES,
                )
                .0,
                false,
            ),
        };
        let mut pages = vec![mine];
        let mut replicas = vec![me.clone()];
        let mut asked = 1;
        if let Some(fleet) = self.store.ask_list(label, after, limit).await? {
            asked = fleet.listening.max(1);
            for a in fleet.answers {
                // This replica answered itself too (it listens on the channel it asked on).
                if a.replica != me && !replicas.contains(&a.replica) {
                    replicas.push(a.replica);
                    pages.push((a.sessions, a.more));
                }
            }
        }
        let (all, next_cursor) = combine(pages, limit);
        let next_cursor = next_cursor.filter(|_| label.is_none());
        Ok(Listing {
            replica: me,
            fleet: self.store.is_on(),
            replicas,
            replicas_asked: asked,
            sessions: all,
            next_cursor,
        })
    }

    /// Ends the session labelled `label` as its client's `DELETE` would (upstream too, and in
    /// the fleet): here if held here, else by a replica of the fleet that holds it. The
    /// replica that ended it, or `None` when none holds it; [`Busy`] while another
    /// operator's question to the fleet is out.
    pub(crate) async fn end_labelled(&self, label: &str) -> Result<Option<String>, Busy> {
        if let Some(s) = self.registry.find_label(label) {
            self.end_session(&s, Eviction::Admin);
            return Ok(Some(self.store.display_name()));
        }
        let Some(fleet) = self.store.ask_end(label).await? else {
            return Ok(None);
        };
        Ok(fleet
            .answers
            .into_iter()
            .find(|a| a.ended)
            .map(|a| a.replica))
    }
}

/// The replicas' pages of one question (each by label, `true` with one its replica cut
/// short) as one page of at most `limit` sessions, and the cursor of the next page when
/// sessions may follow. A page cut short covers its replica's sessions up to its largest
/// label only: the page is cut at the smallest such label, so no replica's session before
/// the next cursor is left out.
fn combine(
    pages: Vec<(Vec<SessionView>, bool)>,
    limit: usize,
) -> (Vec<SessionView>, Option<String>) {
    let boundary: Option<String> = pages
        .iter()
        .filter(|(_, more)| *more)
        .filter_map(|(views, _)| views.iter().map(|v| &v.id).max())
        .min()
        .cloned();
    let mut all: Vec<SessionView> = pages.into_iter().flat_map(|(views, _)| views).collect();
    if let Some(b) = &boundary {
        all.retain(|v| v.id <= *b);
    }
    let mut labels: Vec<&str> = all.iter().map(|v| v.id.as_str()).collect();
    labels.sort_unstable();
    labels.dedup();
    let cut = labels
        .get(limit.max(1) - 1)
        .filter(|_| labels.len() > limit)
        .map(|l| (*l).to_owned());
    if let Some(c) = &cut {
        all.retain(|v| v.id <= *c);
    }
    let next = cut.or(boundary);
    (merge(all), next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(id: &str, replica: &str) -> SessionView {
        SessionView {
            id: id.into(),
            principal: "00".repeat(8),
            shape: "upstream".into(),
            protocol_version: None,
            endpoint: "/mcp".into(),
            created_ms: 0,
            last_used_ms: 0,
            attached_clients: 0,
            window_events: 0,
            window_bytes: 0,
            streams: Vec::new(),
            replicas: vec![replica.into()],
        }
    }

    fn ids(v: &[SessionView]) -> Vec<&str> {
        let mut ids: Vec<&str> = v.iter().map(|v| v.id.as_str()).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn replicas_pages_combine_by_label_and_a_short_page_bounds_the_next_cursor() {
        let a = |ids: &[&str], more| (ids.iter().map(|i| view(i, "a")).collect(), more);
        let b = |ids: &[&str], more| (ids.iter().map(|i| view(i, "b")).collect(), more);
        // Whole pages: the first `limit` labels of all, a session held by both once.
        let (p, next) = combine(vec![a(&["1", "3"], false), b(&["2", "3", "4"], false)], 3);
        assert_eq!((ids(&p), next.as_deref()), (vec!["1", "2", "3"], Some("3")));
        assert_eq!(p.iter().find(|v| v.id == "3").unwrap().replicas, ["a", "b"]);
        let (p, next) = combine(vec![a(&["1"], false), b(&["2"], false)], 3);
        assert_eq!((ids(&p), next), (vec!["1", "2"], None));
        // B's page was cut short at 2 (bytes): nothing past 2 yet, whatever A holds.
        let (p, next) = combine(vec![a(&["1", "3", "5"], false), b(&["2"], true)], 10);
        assert_eq!((ids(&p), next.as_deref()), (vec!["1", "2"], Some("2")));
        // Both bounds: the smaller wins.
        let (p, next) = combine(vec![a(&["1", "2", "3"], true), b(&["4"], true)], 2);
        assert_eq!((ids(&p), next.as_deref()), (vec!["1", "2"], Some("2")));
    }
}
