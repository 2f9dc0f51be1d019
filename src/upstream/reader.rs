//! The reader of a tagged upstream stream: it decodes events, hands them to the session,
//! pauses (stops polling the body, so TCP pushes back on the server) while the session's
//! window has no room, and resumes the upstream stream itself when a polling server closes it
//! early.
//!
//! Knows the upstream body and the session API; the rules of what may be evicted live in
//! `session`.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::{Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde_json::Value;
use tokio::time::Instant;

use super::conn::{OwnBody, ReadEnd};
use super::{hold, is_json, is_sse, Source};
use crate::jsonrpc::{self, Message};
use crate::metrics::{Metrics, UpgradeAnswer, UpstreamErrorKind};
use crate::session::{
    Charge, End, Eviction, OpenStream, Registry, Session, UpstreamFailure, Whole,
};
use crate::sse::{Decoder, Event};

/// The upstream's answer to a POST the gateway answers with an SSE stream of its own
/// (`--json-upgrade`): its response, or why there is none (for the log).
pub(crate) type Answer = Pin<Box<dyn Future<Output = Result<Response<OwnBody>, String>> + Send>>;

/// Most bytes of an error body the gateway reads to learn the upstream's JSON-RPC message.
const ERROR_BODY_BYTES: usize = 64 * 1024;

/// Most upstream bytes the reader takes in one go before tagging them. While the window has
/// no room these wait in the reader, so this also bounds what a paused upstream costs
/// beyond its connection.
const READ_BATCH_BYTES: usize = 64 * 1024;

/// Consecutive failed reconnects to an upstream stream before the gateway gives up on it.
const UPSTREAM_RESUME_ATTEMPTS: u32 = 3;
/// The longest `retry:` wait the gateway honours before reconnecting upstream.
const MAX_UPSTREAM_RETRY: Duration = Duration::from_secs(30);
/// The shortest: an upstream's `retry: 0` on a stream it keeps closing after one event would
/// otherwise be reconnected to in a tight loop (~600 a second, seen).
const MIN_UPSTREAM_RETRY: Duration = Duration::from_millis(100);

/// Reads the stream a client's request opened (`stream` of `session`) in a task of its own,
/// which the session stops when it closes. When a client's own standalone stream ends, the
/// session's holder takes over (after its rest).
pub(crate) fn spawn_reader(
    registry: Arc<Registry>,
    session: Arc<Session>,
    stream: u32,
    body: OwnBody,
    source: Source,
) {
    let s = session.clone();
    // Boxed: the task's cell then holds a pointer, not the ~1 KB future it would copy in
    // and out of its stages (~1 k instructions per short call, `bench/callgrind`).
    let reader = tokio::spawn(Box::pin(async move {
        read_stream(&registry, &session, stream, body, &source).await;
        if source.upstream.cfg.hold_standalone {
            hold::after_client_stream(&registry, &session, stream, source);
        }
    }));
    s.set_reader(stream, reader.abort_handle());
}

/// Waits for the upstream's `answer` to a POST whose client already has the gateway's SSE
/// stream `stream` (`--json-upgrade`), in a task of its own that the session stops when it
/// closes, and feeds the answer into the stream: an SSE stream is read as any other, a JSON
/// body becomes the stream's event(s), any other answer a JSON-RPC error per request (a 404
/// ends the session when `evict_on_404`: the request was the session's own).
pub(crate) fn spawn_answer_reader(
    registry: Arc<Registry>,
    session: Arc<Session>,
    stream: u32,
    answer: Answer,
    source: Source,
    evict_on_404: bool,
) {
    let s = session.clone();
    let reader = tokio::spawn(async move {
        let metrics = registry.metrics().clone();
        let resp = match answer.await {
            Ok(r) => r,
            Err(cause) => {
                metrics.json_upgrade(UpgradeAnswer::Failed);
                metrics.upstream_error(UpstreamErrorKind::Request);
                tracing::warn!(mcp.session = %session.hashed_id(), mcp.stream = stream, cause, "upstream failed to answer an upgraded POST");
                session.end_stream(stream, End::Failed(UpstreamFailure::Connection(cause)));
                return;
            }
        };
        let (status, headers) = (resp.status(), resp.headers());
        if status == StatusCode::OK && is_sse(headers) {
            metrics.json_upgrade(UpgradeAnswer::Sse);
            let body = resp.into_body();
            read_stream(&registry, &session, stream, body, &source).await;
            return;
        }
        if status == StatusCode::OK && is_json(headers) {
            metrics.json_upgrade(UpgradeAnswer::Json);
            let limit = source.upstream.cfg.max_event_bytes;
            let mut charge = registry.budget().charge();
            let end = match read_json(resp.into_body(), limit, &mut charge).await {
                Ok(body) => match json_answer(&metrics, &body, limit) {
                    Ok((events, _)) => {
                        drop(body);
                        let mut events = events.into();
                        deliver(&registry, &session, stream, &mut events, &mut charge, 0).await;
                        End::Complete
                    }
                    Err(end) => end,
                },
                Err(JsonRead::TooLarge) => {
                    metrics.upstream_error(UpstreamErrorKind::InvalidEvent);
                    End::Failed(too_large(limit))
                }
                Err(JsonRead::Failed(failure)) => {
                    metrics.upstream_error(UpstreamErrorKind::Stream);
                    End::Failed(failure)
                }
            };
            session.end_stream(stream, end);
            return;
        }
        metrics.json_upgrade(UpgradeAnswer::Status);
        let failure = if status == StatusCode::OK {
            let ct = headers
                .get(http::header::CONTENT_TYPE)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            UpstreamFailure::InvalidStream(format!(
                "the upstream answered 200 with Content-Type {ct:?}, neither JSON nor SSE"
            ))
        } else {
            let body = Limited::new(resp.into_body(), ERROR_BODY_BYTES)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            UpstreamFailure::Status {
                status: status.as_u16(),
                message: error_message(&body),
            }
        };
        tracing::debug!(mcp.session = %session.hashed_id(), mcp.stream = stream, %status, "upgraded POST answered without a result");
        session.end_stream(stream, End::Failed(failure));
        if status == StatusCode::NOT_FOUND && evict_on_404 {
            registry.remove(session.id(), Eviction::Upstream404);
        }
    });
    s.set_reader(stream, reader.abort_handle());
}

/// Why [`read_json`] has no body.
enum JsonRead {
    /// Larger than `--max-event-bytes`.
    TooLarge,
    Failed(UpstreamFailure),
}

/// An upgraded POST's JSON answer, read whole (at most `limit` bytes) and counted in the
/// budget from its first byte: past a read batch, more only while the budget has room.
async fn read_json(
    mut body: OwnBody,
    limit: usize,
    charge: &mut Charge,
) -> Result<Vec<u8>, JsonRead> {
    let mut json = Vec::new();
    loop {
        if json.len() >= READ_BATCH_BYTES {
            charge.set(json.capacity(), READ_BATCH_BYTES);
            charge.room_for(READ_BATCH_BYTES).await;
        }
        let read = body.read(READ_BATCH_BYTES, |data| {
            if json.len() + data.len() > limit {
                return Err(JsonRead::TooLarge);
            }
            json.extend_from_slice(data);
            Ok(())
        });
        let end = match read.await {
            Ok(end) => end,
            Err(e) => return Err(e),
        };
        charge.set(json.capacity(), READ_BATCH_BYTES);
        match end {
            ReadEnd::More => {}
            ReadEnd::Done => return Ok(json),
            ReadEnd::Connection(e) => return Err(JsonRead::Failed(UpstreamFailure::Connection(e))),
            ReadEnd::Framing(e) => {
                return Err(JsonRead::Failed(UpstreamFailure::InvalidStream(
                    e.to_string(),
                )))
            }
        }
    }
}

/// An answer that came whole with its head: its stream's events (`answers[i]`: the ids of
/// the responses `events[i]` is, when read already) and how the stream ends.
pub(crate) struct WholeAnswer {
    events: VecDeque<Event>,
    answers: Option<Vec<Vec<String>>>,
    end: End,
}

/// An upgraded POST's JSON answer that came whole with its head (`body`), as its stream.
pub(crate) fn whole_json(metrics: &Metrics, body: &[u8], limit: usize) -> WholeAnswer {
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
pub(crate) fn whole_sse(body: &mut OwnBody, max_event_bytes: usize) -> Option<WholeAnswer> {
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

/// Serves `answer` as the stream `open` opens, here and now, without a task (a short call's
/// usual case): [`Session::open_whole`]. Only when the window has no room for its events at
/// once does a task deliver the rest, then end the stream.
pub(crate) fn serve_whole(
    registry: &Arc<Registry>,
    session: &Arc<Session>,
    open: OpenStream<'_>,
    answer: WholeAnswer,
) -> Whole {
    let WholeAnswer {
        mut events,
        answers,
        end,
    } = answer;
    let whole = session.open_whole(open, &mut events, answers.as_deref(), end.clone());
    if registry.over_budget() {
        registry.enforce_budget(session);
    }
    if let Whole::Attached { attachment, .. } = &whole {
        if !events.is_empty() {
            let (registry, s, stream) = (registry.clone(), session.clone(), attachment.stream);
            let task = tokio::spawn(async move {
                let mut charge = registry.budget().charge();
                deliver(&registry, &s, stream, &mut events, &mut charge, 0).await;
                s.end_stream(stream, end);
            });
            session.set_reader(stream, task.abort_handle());
        }
    }
    whole
}

/// The events of an upgraded POST's JSON answer `body`, or how its stream ends when the answer
/// cannot be its events (larger than `limit`, `--max-event-bytes`; not JSON-RPC).
fn json_answer(
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

fn too_large(limit: usize) -> UpstreamFailure {
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

/// The `error.message` of a JSON-RPC error body, if that is what `body` is.
fn error_message(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let m = v.get("error")?.get("message")?.as_str()?;
    Some(m.chars().take(200).collect())
}

/// Waits for the body's next bytes, then takes everything that is already here (up to
/// [`READ_BATCH_BYTES`]) into `decoder`, its events into `events`: one lock, one wake of the
/// client and one write for a burst, instead of one per upstream chunk. The end of the stream
/// if it ended.
async fn read_batch(
    body: &mut OwnBody,
    decoder: &mut Decoder,
    events: &mut Vec<Event>,
    metrics: &crate::metrics::Metrics,
) -> Option<End> {
    let read = body.read(READ_BATCH_BYTES, |data| decoder.feed(data, events));
    match read.await {
        Ok(ReadEnd::More) => None,
        Ok(ReadEnd::Done) => Some(End::Complete),
        Ok(ReadEnd::Connection(e)) => {
            metrics.upstream_error(UpstreamErrorKind::Stream);
            Some(End::Failed(UpstreamFailure::Connection(e)))
        }
        Ok(ReadEnd::Framing(e)) => {
            metrics.upstream_error(UpstreamErrorKind::Stream);
            Some(End::Failed(UpstreamFailure::InvalidStream(e.to_string())))
        }
        Err(e) => {
            metrics.upstream_error(UpstreamErrorKind::InvalidEvent);
            Some(End::Failed(UpstreamFailure::InvalidStream(e.to_string())))
        }
    }
}

/// The event types the gateway writes itself (`mcp-reattach/...`) are its own: an upstream
/// event of such a type reaches the client as `upstream/mcp-reattach/...`, so a client can
/// always tell the gateway's control events from the server's.
fn disown_control_type(e: &mut crate::sse::Event) {
    if e.event().is_some_and(|t| t.starts_with(CONTROL_PREFIX)) {
        e.prefix_type("upstream/");
    }
}

/// The prefix of the gateway's own event types.
const CONTROL_PREFIX: &str = "mcp-reattach/";

/// Hands `events` to the session, waiting while its window has no room (flow control: the
/// body is not polled meanwhile, so the upstream's TCP window closes). Counts pauses. Events
/// waiting are counted in `charge`, on top of `base` (what the reader holds besides).
async fn deliver(
    registry: &Registry,
    session: &Session,
    stream: u32,
    events: &mut VecDeque<Event>,
    charge: &mut Charge,
    base: usize,
) {
    let mut paused: Option<Instant> = None;
    std::future::poll_fn(|cx| {
        // Not counted while the session takes them (it counts what it retains); a reader
        // that is the budget's mover stays it until its events are in the session.
        charge.set(base, 0);
        if session.push_events(stream, events, Some(cx.waker())) {
            std::task::Poll::Ready(())
        } else {
            let waiting: usize = events.iter().map(|e| e.body().len()).sum();
            charge.set(base + waiting, 0);
            if paused.is_none() {
                registry.metrics().upstream_pauses.inc();
                paused = Some(Instant::now());
            }
            std::task::Poll::Pending
        }
    })
    .await;
    if let Some(since) = paused {
        registry
            .metrics()
            .upstream_paused_seconds
            .inc_by(since.elapsed().as_secs_f64());
        tracing::trace!(mcp.session = %session.hashed_id(), mcp.stream = stream, paused = ?since.elapsed(), "upstream resumed after a pause");
    }
    if registry.over_budget() {
        registry.enforce_budget(session);
    }
}

/// Reads a tagged upstream stream to its end, whether or not a client is attached.
///
/// An upstream that sets its own ids may close a stream before it is done (2025-11-25 "SSE
/// polling"); the gateway then resumes it upstream with `Last-Event-ID` (honouring `retry:`),
/// the way a client would, and keeps appending to the same stream: while a POST stream still
/// has unanswered requests, and for the standalone stream while the session lives.
pub(crate) async fn read_stream(
    registry: &Registry,
    session: &Session,
    stream: u32,
    mut body: OwnBody,
    source: &Source,
) {
    let metrics = registry.metrics().clone();
    let max_event_bytes = source.upstream.cfg.max_event_bytes;
    let mut last_upstream_id: Option<String> = None;
    let mut retry: Option<u64> = None;
    let mut failures = 0;
    let mut charge = registry.budget().charge();
    let end = 'outer: loop {
        let mut decoder = Decoder::new(max_event_bytes);
        let mut events = Vec::new();
        let end = loop {
            if decoder.held() >= READ_BATCH_BYTES {
                // In the middle of a large event: more of it only while the budget has room
                // (else the upstream is not read, and TCP pushes back).
                charge.set(decoder.held(), READ_BATCH_BYTES);
                charge.room_for(READ_BATCH_BYTES).await;
            }
            let ended = read_batch(&mut body, &mut decoder, &mut events, &metrics).await;
            for e in &mut events {
                disown_control_type(e);
                if let Some(id) = e.id() {
                    last_upstream_id = Some(id.to_owned());
                }
                retry = e.retry().or(retry);
            }
            if !events.is_empty() {
                failures = 0;
            }
            // Delivered from a deque: a paused reader's events are taken a window's room at
            // a time, from the front, without moving the rest. (Both conversions keep the
            // buffer and move nothing: the deque is empty when delivered.)
            let mut delivering = VecDeque::from(std::mem::take(&mut events));
            let partial = decoder.held();
            deliver(
                registry,
                session,
                stream,
                &mut delivering,
                &mut charge,
                partial,
            )
            .await;
            charge.set(partial, READ_BATCH_BYTES);
            events = Vec::from(delivering);
            if let Some(end) = ended {
                break end;
            }
        };
        let Some(last_id) = last_upstream_id
            .clone()
            .filter(|_| session.wants_more(stream))
        else {
            break end;
        };
        if matches!(end, End::Failed(UpstreamFailure::InvalidStream(_))) {
            break end; // a protocol error will not heal by reconnecting
        }
        // Reconnect upstream, as a client of a polling server would.
        loop {
            if failures >= UPSTREAM_RESUME_ATTEMPTS {
                break 'outer End::Failed(UpstreamFailure::ResumeRefused(UPSTREAM_RESUME_ATTEMPTS));
            }
            failures += 1;
            let wait = Duration::from_millis(retry.unwrap_or(1000))
                .clamp(MIN_UPSTREAM_RETRY, MAX_UPSTREAM_RETRY);
            tokio::time::sleep(wait).await;
            tracing::debug!(mcp.session = %session.hashed_id(), mcp.stream = stream, "resuming the upstream stream");
            // Boxed: a reconnect's state would otherwise size every reader's task.
            match Box::pin(source.resume(&last_id)).await {
                Some(b) => {
                    body = b;
                    continue 'outer;
                }
                None => metrics.upstream_error(UpstreamErrorKind::Resume),
            }
        }
    };
    if let End::Failed(cause) = &end {
        tracing::warn!(mcp.session = %session.hashed_id(), mcp.stream = stream, cause = ?cause, "upstream stream failed");
    }
    session.end_stream(stream, end);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The events of a JSON answer, without their ids.
    fn json_events(body: &[u8]) -> Result<Vec<Event>, String> {
        json_answer_events(body).map(|(events, _)| events)
    }
    use crate::jsonrpc::{
        EVENT_RESUMED, EVENT_RESUMPTION_FAILED, EVENT_RESUMPTION_REQUIRED, EVENT_STREAM,
        EVENT_UPSTREAM_FAILED,
    };

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

    #[test]
    fn every_gateway_event_type_is_disowned_when_the_upstream_sends_it() {
        for t in [
            EVENT_RESUMED,
            EVENT_RESUMPTION_FAILED,
            EVENT_RESUMPTION_REQUIRED,
            EVENT_UPSTREAM_FAILED,
            EVENT_STREAM,
        ] {
            let mut e = crate::sse::Event::new(Some("7"), Some(t), Some("{}"), Some(5));
            disown_control_type(&mut e);
            assert_eq!(e.event(), Some(format!("upstream/{t}").as_str()));
            let rest = (e.id(), e.data(), e.retry());
            assert_eq!(rest, (Some("7"), Some("{}".into()), Some(5)));
        }
        let mut e = crate::sse::Event::message_of("{}");
        disown_control_type(&mut e);
        assert_eq!(e.event(), Some("message"));
    }
}
