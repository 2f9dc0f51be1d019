//! An answer that came whole with its head, as its stream's events: a POST's SSE answer
//! that needs nothing of a reader, an upgraded POST's JSON answer (one message or a batch,
//! each a `message` event carrying the upstream's own text). Pure: the layer (`feed`) serves
//! them under one lock of the session.

use std::collections::VecDeque;

use serde_json::Value;

use super::read::disown_control_type;
use crate::jsonrpc::{self, Message};
use crate::metrics::{Metrics, UpgradeAnswer, UpstreamErrorKind};
use crate::session::{End, UpstreamFailure};
use crate::sse::{Decoder, Event};
use crate::upstream::OwnBody;

/// An answer that came whole with its head: its stream's events (`answers[i]`: the ids of
/// the responses `events[i]` is, when read already) and how the stream ends.
pub(crate) struct WholeAnswer {
    pub(super) events: VecDeque<Event>,
    pub(super) answers: Option<Vec<Vec<String>>>,
    pub(super) end: End,
}

/// An upgraded POST's JSON answer that came whole with its head (`body`), as its stream.
pub(super) fn json(metrics: &Metrics, body: &[u8], limit: usize) -> WholeAnswer {
    metrics.json_upgrade(UpgradeAnswer::Json);
    match json_answer(metrics, body, limit) {
        Ok((events, answers)) => WholeAnswer {
            events: events.into(),
            answers: Some(answers),
            end: End::Complete,
        },
        Err(end) => WholeAnswer {
            events: VecDeque::new(),
            answers: None,
            end,
        },
    }
}

/// A POST's SSE answer that came whole with its head (`body`), as its stream, when it needs
/// nothing of a reader: every event well formed, none with an id of the upstream's own (a
/// stream the reader could have to resume upstream). If not, `body` is as it was, for the
/// reader.
pub(super) fn sse(body: &mut OwnBody, max_event_bytes: usize) -> Option<WholeAnswer> {
    let mut decoder = Decoder::new(max_event_bytes);
    let mut events = Vec::new();
    let mut bad = false;
    let whole = body.peek_whole(|data| {
        if !bad {
            bad = decoder.feed(data, &mut events).is_err();
        }
    });
    let used = whole.filter(|_| !bad && events.iter().all(|e| e.id().is_none()))?;
    body.finish_early(used);
    for e in &mut events {
        disown_control_type(e);
    }
    Some(WholeAnswer {
        events: events.into(),
        answers: None,
        end: End::Complete,
    })
}

/// The events of an upgraded POST's JSON answer `body`, or how its stream ends when the answer
/// cannot be its events (larger than `limit`, `--max-event-bytes`; not JSON-RPC).
pub(super) fn json_answer(
    metrics: &Metrics,
    body: &[u8],
    limit: usize,
) -> Result<(Vec<Event>, Vec<Vec<String>>), End> {
    if body.len() > limit {
        metrics.upstream_error(UpstreamErrorKind::InvalidEvent);
        return Err(End::Failed(too_large(limit)));
    }
    json_answer_events(body).map_err(|why| {
        metrics.upstream_error(UpstreamErrorKind::InvalidEvent);
        End::Failed(UpstreamFailure::InvalidStream(why))
    })
}

pub(super) fn too_large(limit: usize) -> UpstreamFailure {
    UpstreamFailure::InvalidStream(format!(
        "the upstream's JSON answer is larger than {limit} bytes (--max-event-bytes)"
    ))
}

/// The events of an upstream's JSON answer: the message, or each message of a batch, as a
/// `message` event carrying the upstream's own text, with the ids of the responses each is
/// (what tagging it would read from it again: [`Session::open_whole`]). Anything that is
/// not JSON-RPC is refused with why.
fn json_answer_events(body: &[u8]) -> Result<(Vec<Event>, Vec<Vec<String>>), String> {
    use serde_json::value::RawValue;
    let text = std::str::from_utf8(body)
        .map_err(|_| "the upstream's JSON answer is not UTF-8".to_owned())?
        .trim();
    let not_json = |e: serde_json::Error| format!("the upstream's JSON answer is not JSON: {e}");
    let not_rpc = || "the upstream's JSON answer is not a JSON-RPC message or batch".to_owned();
    let messages: Vec<(&str, Vec<String>)> = if text.starts_with('[') {
        let raw: Vec<&RawValue> = serde_json::from_str(text).map_err(not_json)?;
        if raw.is_empty() {
            return Err(not_rpc());
        }
        raw.into_iter()
            .map(|m| match jsonrpc::read_message(m.get()) {
                Ok(Message::Rpc(ids)) => Ok((m.get(), ids)),
                _ => Err(not_rpc()),
            })
            .collect::<Result<_, _>>()?
    } else {
        // One message, the usual answer: one parse reads (and checks) it whole.
        match jsonrpc::read_message(text) {
            Ok(Message::Rpc(ids)) => vec![(text, ids)],
            Ok(Message::NotRpc) => return Err(not_rpc()),
            Err(e) => return Err(not_json(e)),
        }
    };
    let mut events = Vec::with_capacity(messages.len());
    let mut answers = Vec::with_capacity(messages.len());
    for (raw, ids) in messages {
        // An SSE data line cannot hold a line break: a message that spans lines is sent
        // compact (and its ids read from what is sent).
        if memchr::memchr2(b'\n', b'\r', raw.as_bytes()).is_some() {
            let compact = serde_json::from_str::<Value>(raw)
                .map_or_else(|_| raw.to_owned(), |v| v.to_string());
            answers.push(jsonrpc::response_ids(&compact));
            events.push(Event::message_of(&compact));
        } else {
            answers.push(ids);
            events.push(Event::message_of(raw));
        }
    }
    Ok((events, answers))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The events of a JSON answer, without their ids.
    fn json_events(body: &[u8]) -> Result<Vec<Event>, String> {
        json_answer_events(body).map(|(events, _)| events)
    }

    #[test]
    fn a_json_answer_is_its_messages_as_the_upstream_wrote_them() {
        let data = |body: &str| -> Result<Vec<String>, String> {
            json_events(body.as_bytes()).map(|v| {
                v.iter()
                    .map(|e| e.data().unwrap_or_default().into_owned())
                    .collect()
            })
        };
        let one = r#"{"jsonrpc":"2.0","id":1,"result":{"b":1,"a":2}}"#;
        assert_eq!(data(&format!("{one}\n")).unwrap(), vec![one]);
        let two = r#"{"jsonrpc":"2.0","id":2,"result":{}}"#;
        assert_eq!(data(&format!("[{one}, {two}]")).unwrap(), vec![one, two]);
        // Pretty-printed: compact, so each message is one data line.
        let pretty = "{\n  \"jsonrpc\": \"2.0\",\n  \"id\": 3,\n  \"result\": {}\n}";
        let got = data(pretty).unwrap();
        assert!(!got[0].contains('\n'));
        assert_eq!(serde_json::from_str::<Value>(&got[0]).unwrap()["id"], 3);
        for bad in [
            "",
            "not json",
            "[]",
            "[1]",
            r#"{"id":1}"#,
            r#"{"jsonrpc":"1.0"}"#,
            "\u{fffd}",
        ] {
            assert!(data(bad).is_err(), "{bad:?} is refused");
        }
        assert!(json_events(&[0xff, 0xfe]).is_err());
        // Why, for one message as for a batch: not JSON at all, or JSON but not JSON-RPC.
        for (bad, why) in [
            ("{\"jsonrpc\":", "is not JSON"),
            ("[{\"jsonrpc\":\"2.0\"", "is not JSON"),
            (r#"{"jsonrpc":"2.0"} x"#, "is not JSON"),
            (r#"{"id":1}"#, "not a JSON-RPC"),
            (r#""text""#, "not a JSON-RPC"),
            (r#"[{"id":1}]"#, "not a JSON-RPC"),
        ] {
            let e = data(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    /// A JSON-RPC message with an id and an arbitrary result, written compact or pretty.
    fn message() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[ -~\\n\u{e9}\u{1F600}]{0,12}".prop_map(Value::from),
        ];
        let result = leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::btree_map("[a-z]{1,4}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        });
        (any::<u32>(), result)
            .prop_map(|(id, r)| serde_json::json!({"jsonrpc": "2.0", "id": id, "result": r}))
    }

    proptest::proptest! {
        /// Whatever the upstream's JSON answer (one message or a batch, compact or pretty),
        /// the events carry exactly its messages in order, each on one data line.
        #[test]
        fn a_json_answer_becomes_exactly_its_messages(
            msgs in proptest::collection::vec(message(), 1..5),
            batch: bool,
            pretty: bool,
        ) {
            let write = |v: &Value| if pretty { serde_json::to_string_pretty(v).unwrap() } else { v.to_string() };
            let (body, want) = if batch || msgs.len() > 1 {
                (write(&Value::from(msgs.clone())), msgs.clone())
            } else {
                (write(&msgs[0]), vec![msgs[0].clone()])
            };
            let events = json_events(body.as_bytes()).unwrap();
            let got: Vec<Value> = events
                .iter()
                .map(|e| {
                    let d = e.data().unwrap();
                    assert!(!d.contains(['\n', '\r']), "one data line: {d:?}");
                    serde_json::from_str(&d).unwrap()
                })
                .collect();
            proptest::prop_assert_eq!(got, want);
        }
    }
}
