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
        let (mut all, mut more): (Vec<SessionView>, bool) = match label {
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
        // The largest label every replica's page covered: past it, one that stopped early
        // may hold sessions not asked for yet.
        let mut boundary: Option<String> = if more {
            all.last().map(|v| v.id.clone())
        } else {
            None
        };
        let mut replicas = vec![me.clone()];
        let mut asked = 1;
        if let Some(fleet) = self.store.ask_list(label, after, limit).await? {
            asked = fleet.listening.max(1);
            for a in fleet.answers {
                // This replica answered itself too (it listens on the channel it asked on).
                if a.replica != me && !replicas.contains(&a.replica) {
                    replicas.push(a.replica);
                    if a.more {
                        if let Some(last) = a.sessions.iter().map(|v| &v.id).max() {
                            if boundary.as_ref().is_none_or(|b| last < b) {
                                boundary = Some(last.clone());
                            }
                        }
                    }
                    all.extend(a.sessions);
                }
            }
        }
        if let Some(b) = &boundary {
            all.retain(|v| v.id <= *b);
        }
        let mut labels: Vec<&str> = all.iter().map(|v| v.id.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        let mut cut: Option<String> = None;
        if labels.len() > limit {
            cut = Some(labels[limit - 1].to_owned());
        }
        if let Some(c) = &cut {
            all.retain(|v| v.id <= *c);
        }
        more = cut.is_some() || boundary.is_some();
        let next_cursor = if more && label.is_none() {
            cut.or(boundary)
        } else {
            None
        };
        Ok(Listing {
            replica: me,
            fleet: self.store.is_on(),
            replicas,
            replicas_asked: asked,
            sessions: merge(all),
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
