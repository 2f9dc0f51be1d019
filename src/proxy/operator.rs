//! What the admin listener asks of the gateway for operators: the sessions held here (with a
//! store, in the whole fleet: `store::ask`), and an end of one, named by its label.

use crate::session::{merge, Eviction, Listing, SessionView};

use super::Gateway;

impl Gateway {
    /// The sessions this replica holds, with a store every replica's (the one labelled
    /// `label` only, if given).
    pub(crate) async fn sessions(&self, label: Option<&str>) -> Listing {
        let me = self.store.display_name();
        let mut all: Vec<SessionView> = match label {
            None => self.registry.views(&me),
            Some(l) => self
                .registry
                .find_label(l)
                .map(|s| vec![s.view(&me)])
                .unwrap_or_default(),
        };
        let mut replicas = vec![me.clone()];
        let mut asked = 1;
        if let Some(fleet) = self.store.ask_list(label).await {
            asked = fleet.listening.max(1);
            for a in fleet.answers {
                // This replica answered itself too (it listens on the channel it asked on).
                if a.replica != me && !replicas.contains(&a.replica) {
                    replicas.push(a.replica);
                    all.extend(a.sessions);
                }
            }
        }
        Listing {
            replica: me,
            fleet: self.store.is_on(),
            replicas,
            replicas_asked: asked,
            sessions: merge(all),
        }
    }

    /// Ends the session labelled `label` as its client's `DELETE` would (upstream too, and in
    /// the fleet): here if held here, else by a replica of the fleet that holds it. The
    /// replica that ended it, or `None` when none holds it.
    pub(crate) async fn end_labelled(&self, label: &str) -> Option<String> {
        if let Some(s) = self.registry.find_label(label) {
            self.end_session(&s, Eviction::Admin);
            return Some(self.store.display_name());
        }
        let fleet = self.store.ask_end(label).await?;
        fleet
            .answers
            .into_iter()
            .find(|a| a.ended)
            .map(|a| a.replica)
    }
}
