//! The operator's questions to the whole fleet (the admin listener's `/sessions` with a
//! store): one replica publishes a question on one channel, every replica listening answers
//! with what it holds into a list named in the question, and the asker reads the answers
//! back until as many came as the channel had listeners, or [`ASK_WAIT`] passed. Nothing is
//! kept between questions: a fleet that is not asked pays nothing.
//!
//! An end asked of the fleet is carried out by one replica that holds the session (the first
//! to take the question's `once` key): it ends the session as its client's `DELETE` would,
//! upstream too, and announces the end so the others drop it without a second `DELETE`.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Shared, Store};
use crate::session::{Eviction, Registry, SessionView};

/// The channel questions are published on.
pub(super) const CHANNEL: &str = "mra:admin";

/// The longest an asker waits for the fleet's answers.
const ASK_WAIT: Duration = Duration::from_secs(1);

/// How often the asker looks for answers.
const ASK_POLL: Duration = Duration::from_millis(10);

/// How long answers stay in the store unread.
const ANSWER_TTL_MS: i64 = 10_000;

/// A question as it goes over the channel.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Question {
    /// `list` (every session, or the one labelled `label`) or `end` (the session labelled
    /// `label`).
    op: String,
    label: Option<String>,
    /// The list the answers go to.
    reply: String,
}

/// One replica's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Answer {
    pub replica: String,
    /// The sessions it holds (of the label asked, if one was).
    pub sessions: Vec<SessionView>,
    /// For an end: this replica ended the session.
    pub ended: bool,
}

/// What the fleet answered a question.
pub(crate) struct Answers {
    /// How many replicas listened when it was asked (the asker included).
    pub listening: usize,
    pub answers: Vec<Answer>,
}

impl Store {
    /// Asks every replica for its sessions (those labelled `label` only, if given): `None`
    /// without a store, or when the store did not take the question.
    pub(crate) async fn ask_list(&self, label: Option<&str>) -> Option<Answers> {
        self.ask("list", label).await
    }

    /// Asks the fleet to end the session labelled `label`; one replica that holds it does.
    pub(crate) async fn ask_end(&self, label: &str) -> Option<Answers> {
        self.ask("end", Some(label)).await
    }

    async fn ask(&self, op: &str, label: Option<&str>) -> Option<Answers> {
        let Store::Redis(s) = self else { return None };
        let mut nonce = [0u8; 12];
        let _ = getrandom::getrandom(&mut nonce);
        let nonce: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        let question = Question {
            op: op.into(),
            label: label.map(str::to_owned),
            reply: format!("mra:{{adm:{nonce}}}:answers"),
        };
        let text = serde_json::to_string(&question).ok()?;
        let mut pipe = redis::pipe();
        pipe.publish(CHANNEL, text);
        let (listening,): (usize,) = s.run(&pipe, "ask").await?;
        let deadline = tokio::time::Instant::now() + ASK_WAIT;
        let mut raw: Vec<String> = Vec::new();
        while raw.len() < listening && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(ASK_POLL).await;
            let mut pipe = redis::pipe();
            pipe.lrange(&question.reply, 0, -1);
            if let Some((got,)) = s.run::<(Vec<String>,)>(&pipe, "ask").await {
                raw = got;
            }
        }
        let mut pipe = redis::pipe();
        pipe.del(&question.reply).ignore();
        let _ = s.run::<()>(&pipe, "ask").await;
        let answers = raw
            .iter()
            .filter_map(|a| serde_json::from_str::<Answer>(a).ok())
            .collect();
        Some(Answers { listening, answers })
    }
}

/// Answers a question read from the channel (in a task of its own: an end waits on the
/// store once).
pub(super) fn answer(s: Arc<Shared>, registry: Arc<Registry>, text: &str) {
    let Ok(q) = serde_json::from_str::<Question>(text) else {
        return;
    };
    tokio::spawn(async move {
        let name = s.display_name();
        let held = |label: &str| registry.find_label(label);
        let answer = match (q.op.as_str(), q.label.as_deref()) {
            ("list", None) => Answer {
                sessions: registry.views(&name),
                replica: name,
                ended: false,
            },
            ("list", Some(label)) => Answer {
                sessions: held(label).map(|x| vec![x.view(&name)]).unwrap_or_default(),
                replica: name,
                ended: false,
            },
            ("end", Some(label)) => {
                let Some(session) = held(label) else {
                    // Holds nothing of it: no answer to wait for but the count's.
                    return reply(
                        &s,
                        &q.reply,
                        &Answer {
                            replica: name,
                            sessions: Vec::new(),
                            ended: false,
                        },
                    )
                    .await;
                };
                // The first holder to take the question's `once` key ends it.
                let mut pipe = redis::pipe();
                pipe.cmd("SET")
                    .arg(format!("{}:once", q.reply))
                    .arg(&*s.replica)
                    .arg("NX")
                    .arg("PX")
                    .arg(ANSWER_TTL_MS);
                let first: Option<(Option<String>,)> = s.run(&pipe, "ask").await;
                let ended = matches!(first, Some((Some(_),)));
                let view = session.view(&name);
                if ended {
                    end_here(&registry, &session);
                }
                Answer {
                    replica: name,
                    sessions: vec![view],
                    ended,
                }
            }
            _ => return,
        };
        reply(&s, &q.reply, &answer).await;
    });
}

async fn reply(s: &Shared, key: &str, answer: &Answer) {
    let Ok(text) = serde_json::to_string(answer) else {
        return;
    };
    let mut pipe = redis::pipe();
    pipe.rpush(key, text).ignore();
    pipe.pexpire(key, ANSWER_TTL_MS).ignore();
    let _ = s.run::<()>(&pipe, "ask").await;
}

/// Ends `session` as its client's `DELETE` would: dropped here and ended upstream (the
/// registry's shed path), its record a tombstone, its end announced to the fleet.
fn end_here(registry: &Registry, session: &crate::session::Session) {
    registry.remove(session.id(), Eviction::Admin);
}
