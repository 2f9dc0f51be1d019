//! The operator's questions to the whole fleet (the admin listener's `/sessions` with a
//! store): one replica publishes a question on one channel, every replica listening answers
//! with what it holds into a list named in the question, and the asker reads the answers
//! back until as many came as the channel had listeners, or [`ASK_WAIT`] passed. Nothing is
//! kept between questions: a fleet that is not asked pays nothing.
//!
//! An end asked of the fleet is carried out by one replica that holds the session (the first
//! to take the question's `once` key): it ends the session as its client's `DELETE` would,
//! upstream too, and announces the end so the others drop it without a second `DELETE`.
//!
//! Operators never share the request path's turns (issue 56, R5-4): every question, answer
//! and read of answers travels on the [`Operator`] connection, not `Shared::conn`, takes none
//! of its `awaited` turns, and its failures never count against the requests' `Breaker`. One
//! question at a time per replica ([`Busy`] meanwhile), a few answered at once (the rest
//! dropped), each answer a page ([`MAX_PAGE`] sessions, [`ANSWER_BYTES`]), and the answers
//! read bounded in number and size by the store itself.
//!
//! Questions and answers carry a MAC under the fleet's admin key (`Keys::admin`, derived
//! from `--store-key-file`'s secret): a message no replica made (a store writer's) is dropped
//! and logged at debug (issue 56, R5-11), as is one larger than [`MAX_MESSAGE`] or older than
//! [`FRESH`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
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

/// The most sessions one page of the list holds (the admin listener's `limit`).
pub(crate) const MAX_PAGE: usize = 1000;

/// The most JSON one replica's answer holds (past its first session): its page ends there.
pub(crate) const ANSWER_BYTES: usize = 1 << 20;

/// The largest answer the asker reads (an answer's page and its MAC): larger ones are left
/// in the store, unread.
const MAX_ANSWER_READ: usize = ANSWER_BYTES + (64 << 10);

/// The largest question a replica reads off the channel (they are a few hundred bytes).
const MAX_MESSAGE: usize = 4096;

/// How far a question's time may be from the answering replica's clock: an older one (a
/// replay of a question seen on the channel) is dropped.
const FRESH: Duration = Duration::from_secs(30);

/// Questions a replica answers at once; one more is dropped (its asker lists without it).
const ANSWERING: usize = 4;

/// The longest one operator's request to the store may take.
const OPERATOR_TIMEOUT: Duration = Duration::from_secs(1);

/// The Lua script reading the answers, one round trip: how many there are, and the first
/// `ARGV[1]` of them that are at most `ARGV[2]` bytes (larger ones never leave the store).
const READ_ANSWERS: &str = r"
local out = {}
for _, v in ipairs(redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  if string.len(v) <= tonumber(ARGV[2]) then out[#out + 1] = v end
end
return {redis.call('LLEN', KEYS[1]), out}
";

/// The operators' side of the store: a connection of its own, one question in flight, a few
/// answered at once.
pub(super) struct Operator {
    conn: ConnectionManager,
    asking: tokio::sync::Semaphore,
    answering: Arc<tokio::sync::Semaphore>,
    /// Messages dropped: no MAC of the fleet's, too large, stale, or not a question.
    dropped: AtomicU64,
}

impl Operator {
    pub(super) fn new(conn: ConnectionManager) -> Operator {
        Operator {
            conn,
            asking: tokio::sync::Semaphore::new(1),
            answering: Arc::new(tokio::sync::Semaphore::new(ANSWERING)),
            dropped: AtomicU64::new(0),
        }
    }

    /// Runs `pipe` on the operators' connection, bounded by [`OPERATOR_TIMEOUT`]; `None`
    /// (logged) when it failed. Never counted against the requests' breaker.
    async fn run<T: redis::FromRedisValue>(&self, pipe: &redis::Pipeline) -> Option<T> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(OPERATOR_TIMEOUT, pipe.query_async::<T>(&mut conn)).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "an operator's request to the store failed");
                None
            }
            Err(_) => {
                tracing::debug!("an operator's request to the store timed out");
                None
            }
        }
    }

    fn drop_message(&self, why: &'static str) {
        let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::debug!(why, dropped = n, "a message on the admin channel dropped");
    }
}

/// Another operator's question is out: asked again after `Retry-After`.
#[derive(Debug)]
pub(crate) struct Busy;

/// A question as it goes over the channel.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Question {
    /// `list` (every session, or the one labelled `label`) or `end` (the session labelled
    /// `label`).
    op: String,
    label: Option<String>,
    /// The list the answers go to.
    reply: String,
    /// A list's page: the sessions labelled after this one, at most `limit`.
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: usize,
    /// When it was asked (Unix ms).
    at: u64,
}

/// One replica's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Answer {
    pub replica: String,
    /// The sessions it holds (of the label asked, if one was; one page of them).
    pub sessions: Vec<SessionView>,
    /// For an end: this replica ended the session.
    pub ended: bool,
    /// It holds more sessions past its page.
    #[serde(default)]
    pub more: bool,
}

/// What the fleet answered a question.
pub(crate) struct Answers {
    /// How many replicas listened when it was asked (the asker included).
    pub listening: usize,
    pub answers: Vec<Answer>,
}

/// `text` sealed for the channel: the MAC of `context` and `text` under the fleet's admin
/// key, in hex, a space, `text`.
fn sealed(key: &[u8; 32], context: &str, text: &str) -> String {
    format!("{} {text}", mac(key, context, text).to_hex())
}

fn mac(key: &[u8; 32], context: &str, text: &str) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(context.as_bytes());
    h.update(b"\n");
    h.update(text.as_bytes());
    h.finalize()
}

/// The text of `message` if it carries the MAC of `context` and it under `key`.
fn opened<'a>(key: &[u8; 32], context: &str, message: &'a str) -> Option<&'a str> {
    let (tag, text) = message.split_once(' ')?;
    let tag = blake3::Hash::from_hex(tag).ok()?;
    // blake3's `Hash` compares in constant time.
    (tag == mac(key, context, text)).then_some(text)
}

/// A question's MAC context: what it is, on which channel.
const QUESTION: &str = "question mra:admin";

impl Store {
    /// Asks every replica for its sessions (those labelled `label` only, if given; else the
    /// page of those labelled after `after`, at most `limit`): `Ok(None)` without a store, or
    /// when the store did not take the question; [`Busy`] while another is out.
    pub(crate) async fn ask_list(
        &self,
        label: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Option<Answers>, Busy> {
        self.ask("list", label, after, limit).await
    }

    /// Asks the fleet to end the session labelled `label`; one replica that holds it does.
    pub(crate) async fn ask_end(&self, label: &str) -> Result<Option<Answers>, Busy> {
        self.ask("end", Some(label), None, 1).await
    }

    async fn ask(
        &self,
        op: &str,
        label: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Option<Answers>, Busy> {
        let Store::Redis(s) = self else {
            return Ok(None);
        };
        let o = &s.operator;
        let Ok(_turn) = o.asking.try_acquire() else {
            return Err(Busy);
        };
        if !s.breaker.allows() {
            return Ok(None);
        }
        let mut nonce = [0u8; 12];
        let _ = getrandom::getrandom(&mut nonce);
        let nonce: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        let question = Question {
            op: op.into(),
            label: label.map(str::to_owned),
            reply: format!("mra:{{adm:{nonce}}}:answers"),
            after: after.map(str::to_owned),
            limit: limit.clamp(1, MAX_PAGE),
            at: crate::session::unix_ms(std::time::SystemTime::now()),
        };
        let Ok(text) = serde_json::to_string(&question) else {
            return Ok(None);
        };
        let mut pipe = redis::pipe();
        pipe.publish(CHANNEL, sealed(&s.keys.admin, QUESTION, &text));
        let Some((listening,)): Option<(usize,)> = o.run(&pipe).await else {
            return Ok(None);
        };
        static SCRIPT: std::sync::LazyLock<redis::Script> =
            std::sync::LazyLock::new(|| redis::Script::new(READ_ANSWERS));
        let deadline = tokio::time::Instant::now() + ASK_WAIT;
        let mut raw: Vec<String> = Vec::new();
        let mut count = 0;
        while count < listening && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(ASK_POLL).await;
            let mut conn = o.conn.clone();
            let mut invocation = SCRIPT.key(&question.reply);
            // Room for a few strays beside the answers awaited.
            invocation.arg(listening * 2 + 4).arg(MAX_ANSWER_READ);
            if let Ok(Ok((n, got))) = tokio::time::timeout(
                OPERATOR_TIMEOUT,
                invocation.invoke_async::<(usize, Vec<String>)>(&mut conn),
            )
            .await
            {
                (count, raw) = (n, got);
            }
        }
        let mut pipe = redis::pipe();
        pipe.del(&question.reply).ignore();
        let _ = o.run::<()>(&pipe).await;
        let answers = raw
            .iter()
            .filter_map(|a| {
                let opened = opened(&s.keys.admin, &question.reply, a);
                if opened.is_none() {
                    o.drop_message("an answer without the fleet's MAC");
                }
                serde_json::from_str::<Answer>(opened?).ok()
            })
            .collect();
        Ok(Some(Answers { listening, answers }))
    }
}

/// Answers a question read from the channel (in a task of its own: an end waits on the
/// store once), if it is one the fleet asked.
pub(super) fn answer(s: Arc<Shared>, registry: Arc<Registry>, message: &str) {
    let o = &s.operator;
    if message.len() > MAX_MESSAGE {
        return o.drop_message("too large");
    }
    let Some(text) = opened(&s.keys.admin, QUESTION, message) else {
        return o.drop_message("no MAC of the fleet's");
    };
    let Ok(q) = serde_json::from_str::<Question>(text) else {
        return o.drop_message("not a question");
    };
    let now = crate::session::unix_ms(std::time::SystemTime::now());
    if now.abs_diff(q.at) > FRESH.as_millis() as u64 {
        return o.drop_message("stale");
    }
    let Ok(turn) = o.answering.clone().try_acquire_owned() else {
        return o.drop_message("too many questions at once");
    };
    tokio::spawn(async move {
        let _turn = turn;
        let name = s.display_name();
        let held = |label: &str| registry.find_label(label);
        let answer = match (q.op.as_str(), q.label.as_deref()) {
            ("list", None) => {
                let (sessions, more) = crate::session::page(
                    registry.views(&name),
                    q.after.as_deref(),
                    q.limit.clamp(1, MAX_PAGE),
                    ANSWER_BYTES,
                );
                Answer {
                    sessions,
                    replica: name,
                    ended: false,
                    more,
                }
            }
            ("list", Some(label)) => Answer {
                sessions: crate::session::page(
                    held(label).map(|x| x.view(&name)),
                    None,
                    1,
                    ANSWER_BYTES,
                )
                .0,
                replica: name,
                ended: false,
                more: false,
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
                            more: false,
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
                let first: Option<(Option<String>,)> = s.operator.run(&pipe).await;
                let ended = matches!(first, Some((Some(_),)));
                let view = crate::session::page([session.view(&name)], None, 1, ANSWER_BYTES).0;
                if ended {
                    end_here(&registry, &session);
                }
                Answer {
                    replica: name,
                    sessions: view,
                    ended,
                    more: false,
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
    pipe.rpush(key, sealed(&s.keys.admin, key, &text)).ignore();
    pipe.pexpire(key, ANSWER_TTL_MS).ignore();
    let _ = s.operator.run::<()>(&pipe).await;
}

/// Ends `session` as its client's `DELETE` would: dropped here and ended upstream (the
/// registry's shed path), its record a tombstone, its end announced to the fleet.
fn end_here(registry: &Registry, session: &crate::session::Session) {
    registry.remove(session.id(), Eviction::Admin);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_message_sealed_under_the_fleet_key_for_its_context_opens() {
        let key = [7u8; 32];
        let m = sealed(&key, QUESTION, "{\"op\":\"end\"}");
        assert_eq!(opened(&key, QUESTION, &m), Some("{\"op\":\"end\"}"));
        // Another key, another context (an answer's list), a changed text, no MAC at all.
        assert_eq!(opened(&[8u8; 32], QUESTION, &m), None);
        assert_eq!(opened(&key, "mra:{adm:x}:answers", &m), None);
        assert_eq!(opened(&key, QUESTION, &m.replace("end", "list")), None);
        assert_eq!(opened(&key, QUESTION, "{\"op\":\"end\"}"), None);
        assert_eq!(opened(&key, QUESTION, ""), None);
    }
}
