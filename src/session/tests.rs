//! Unit tests of the session state machine, with paused time where clocks matter.

use super::life::MAX_ENDED_STREAMS;
use super::*;
use crate::jsonrpc::{EVENT_RESUMED, EVENT_RESUMPTION_FAILED, EVENT_RESUMPTION_REQUIRED};
use std::sync::atomic::Ordering;
use std::time::Duration;

fn cfg(f: impl FnOnce(&mut Config)) -> Arc<Config> {
    let mut c = Config::new("http://127.0.0.1:1".parse().unwrap());
    f(&mut c);
    Arc::new(c)
}

fn msg(data: &str) -> Event {
    Event::message_of(data)
}

fn session(c: Arc<Config>) -> Session {
    Session::new(
        "a".into(),
        c,
        Arc::default(),
        Arc::new(Budget::new(usize::MAX)),
        Owner::new(Principal::default(), "/mcp"),
        false,
    )
}

/// A registry configured by `f` holding one session, `a`.
fn registry_with_a(f: impl FnOnce(&mut Config)) -> (Registry, Arc<Session>) {
    let reg = Registry::new(cfg(f), Arc::default());
    let s = reg
        .get_or_create("a", Owner::new(Principal::default(), "/mcp"))
        .unwrap();
    (reg, s)
}

fn step(s: &Session, stream: u32, generation: u64) -> Step {
    s.poll_step(stream, generation, Waker::noop())
}

fn text(step: Step) -> String {
    match step {
        Step::Data(b, _) | Step::Finish(b, _) => String::from_utf8(b.to_vec()).unwrap(),
        Step::Pending => String::new(),
    }
}

#[tokio::test(start_paused = true)]
async fn ttl_counts_from_the_last_activity_and_only_without_clients() {
    let (reg, s) = registry_with_a(|c| c.session_ttl = Duration::from_secs(60));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
    tokio::time::advance(Duration::from_secs(120)).await;
    reg.sweep();
    assert_eq!(reg.len(), 1, "a client is attached");
    s.detach(stream, generation);
    tokio::time::advance(Duration::from_secs(59)).await;
    reg.sweep();
    assert_eq!(reg.len(), 1, "TTL counts from the detach");
    s.touch();
    tokio::time::advance(Duration::from_secs(59)).await;
    reg.sweep();
    assert_eq!(reg.len(), 1, "a request restarts the TTL");
    tokio::time::advance(Duration::from_secs(2)).await;
    reg.sweep();
    assert_eq!(reg.len(), 0);
    assert!(matches!(step(&s, stream, generation), Step::Finish(..)));
}

#[tokio::test(start_paused = true)]
async fn a_quiet_session_is_looked_at_again_only_at_its_ttl_or_when_stirred() {
    let (reg, s) = registry_with_a(|c| c.session_ttl = Duration::from_secs(60));
    assert_eq!(reg.sweep(), 1, "a new session is looked at");
    assert_eq!(reg.sweep(), 0, "nothing to watch: skipped");
    // A session created while every other is quiet, and attached to, is looked at.
    let b = reg
        .get_or_create("b", Owner::new(Principal::default(), "/mcp"))
        .unwrap();
    let attached = b.open_stream(OpenStream::new(StreamKind::Post, vec![]));
    assert_eq!(reg.sweep(), 1, "the new session, stirred by its client");
    b.detach(attached.stream, attached.generation);
    assert_eq!(reg.sweep(), 1, "found quiet");
    assert_eq!(reg.sweep(), 0);
    reg.remove("b", Eviction::Delete);
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
    assert_eq!(reg.sweep(), 1, "a client attached: looked at");
    assert_eq!(reg.sweep(), 1, "and at every sweep while it is");
    s.detach(stream, generation);
    assert_eq!(reg.sweep(), 1, "found quiet");
    tokio::time::advance(Duration::from_secs(59)).await;
    assert_eq!(reg.sweep(), 0);
    assert_eq!(reg.len(), 1);
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(reg.sweep(), 1, "its TTL may have run out");
    assert_eq!(reg.len(), 0, "and it did");
}

#[tokio::test(start_paused = true)]
async fn a_client_attached_to_a_quiet_session_is_still_detached_when_it_stalls() {
    let (reg, s) = registry_with_a(|c| {
        c.session_ttl = Duration::from_secs(300);
        c.stall_timeout = Duration::from_secs(30);
    });
    reg.sweep();
    assert_eq!(reg.sweep(), 0, "quiet");
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    s.push_events(stream, &mut VecDeque::from([msg("{\"n\":1}")]), None);
    tokio::time::advance(Duration::from_secs(31)).await;
    reg.sweep();
    let out = text(step(&s, stream, generation));
    assert!(
        out.contains("event: mcp-reattach/resumption-required"),
        "{out}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_reader_paused_in_a_quiet_session_is_woken_when_its_guard_runs_out() {
    let (reg, s) = registry_with_a(|c| {
        c.session_ttl = Duration::from_secs(300);
        c.stall_timeout = Duration::from_secs(30);
        c.window_events = 8;
    });
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Standalone, vec![]));
    let mut pending = numbered(0, 4, 10);
    assert!(s.push_events(stream, &mut pending, None));
    s.detach(stream, generation);
    reg.sweep();
    assert_eq!(reg.sweep(), 0, "quiet: no client, no paused reader");
    // The stream's detached client may come back for its events: the window fills and the
    // upstream reader waits.
    let (reader, wakes) = counting_waker();
    let mut pending = numbered(4, 40, 10);
    assert!(
        !s.push_events(stream, &mut pending, Some(&reader)),
        "paused"
    );
    tokio::time::advance(Duration::from_secs(31)).await;
    assert_eq!(reg.sweep(), 1, "a paused reader is watched");
    assert_eq!(wakes.load(Ordering::SeqCst), 1, "woken: the guard ran out");
    assert!(
        s.push_events(stream, &mut pending, Some(&reader)),
        "room now"
    );
}

#[tokio::test(start_paused = true)]
async fn stalled_client_gets_resumption_required_with_retry() {
    let s = session(cfg(|c| c.stall_timeout = Duration::from_secs(30)));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    s.push_events(stream, &mut VecDeque::from([msg("{\"n\":1}")]), None);
    assert!(text(step(&s, stream, generation)).contains("{\"n\":1}"));
    // The client stops polling while events keep coming.
    s.push_events(stream, &mut VecDeque::from([msg("{\"n\":2}")]), None);
    tokio::time::advance(Duration::from_secs(29)).await;
    s.sweep(Instant::now());
    s.push_events(stream, &mut VecDeque::from([msg("{\"n\":3}")]), None);
    tokio::time::advance(Duration::from_secs(2)).await;
    s.sweep(Instant::now());
    let out = text(step(&s, stream, generation));
    assert!(
        out.contains("event: mcp-reattach/resumption-required"),
        "{out}"
    );
    assert!(out.contains("retry: 1000"), "{out}");
    assert!(
        !out.contains("\"n\":2"),
        "nothing more is pushed to a detached client"
    );
    // It resumes from its last event and gets the rest.
    let here = Cursor {
        epoch: s.epoch,
        stream,
        seq: 2,
    };
    let Ok(Resume::Attached {
        attachment: Attachment { generation: g2, .. },
        replay,
    }) = s.resume(here, None)
    else {
        panic!("resumable")
    };
    assert_eq!(replay, 2);
    let out = text(step(&s, stream, g2));
    assert!(out.contains("\"n\":2") && out.contains("\"n\":3"));
}

#[tokio::test(start_paused = true)]
async fn a_client_that_keeps_up_is_never_detached() {
    let s = session(cfg(|c| c.stall_timeout = Duration::from_secs(1)));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Standalone, vec![]));
    for i in 0..100 {
        s.push_events(
            stream,
            &mut VecDeque::from([msg(&format!("{{\"n\":{i}}}"))]),
            None,
        );
        tokio::time::advance(Duration::from_millis(100)).await;
        s.sweep(Instant::now());
        assert!(matches!(step(&s, stream, generation), Step::Data(..)));
        assert!(matches!(step(&s, stream, generation), Step::Pending));
    }
}

#[tokio::test(start_paused = true)]
async fn eviction_by_count_or_bytes_after_the_stall_budget_makes_a_resume_a_gap() {
    for (events, bytes) in [(4, 1 << 20), (1000, 400)] {
        let s = session(cfg(|c| {
            c.window_events = events;
            c.window_bytes = bytes;
        }));
        let Attachment {
            stream, generation, ..
        } = s.open_stream(OpenStream::new(StreamKind::Standalone, vec![]));
        s.detach(stream, generation);
        let start = Cursor {
            epoch: s.epoch,
            stream,
            seq: 1,
        };
        for i in 0..3 {
            s.push_events(
                stream,
                &mut VecDeque::from([msg(&format!(
                    "{{\"n\":{i},\"pad\":\"{}\"}}",
                    "p".repeat(40)
                ))]),
                None,
            );
        }
        let Ok(Resume::Attached {
            attachment: Attachment { generation, .. },
            replay: 3,
        }) = s.resume(start, None)
        else {
            panic!("resumable")
        };
        s.detach(stream, generation);
        // The client may come back for them: the reader is held back, nothing is evicted.
        let mut more: VecDeque<Event> = (3..10)
            .map(|i| msg(&format!("{{\"n\":{i},\"pad\":\"{}\"}}", "p".repeat(40))))
            .collect();
        assert!(!s.push_events(stream, &mut more, None));
        assert!(!more.is_empty(), "events wait in the reader");
        assert!(matches!(s.resume(start, None), Ok(Resume::Attached { .. })));
        s.detach(stream, current_generation(&s, stream));
        // Once the stall budget has passed without the client, the window moves on.
        let stall = lock(&s.state).consts.stall;
        tokio::time::advance(stall).await;
        assert!(s.push_events(stream, &mut more, None));
        assert_eq!(s.resume(start, None).unwrap_err(), ResumeError::Gap);
        assert!(s.metrics.events_evicted_undelivered.get() > 0);
        let (n, b) = s.window_usage();
        assert!(n <= events && b <= bytes);
        // A cursor at the newest retained event still resumes.
        let last = Cursor {
            epoch: s.epoch,
            stream,
            seq: 11,
        };
        assert!(matches!(
            s.resume(last, None),
            Ok(Resume::Attached { replay: 0, .. })
        ));
    }
}

/// The gap frames of a resume from right after the first event of a POST stream carrying
/// requests `1` and `"b"`, once the window has moved past it: `first` pushes that event.
async fn gap_after_the_first_event(first: impl FnOnce(&Session, u32)) -> String {
    let s = session(cfg(|c| {
        c.window_events = 2;
        c.stall_timeout = Duration::ZERO;
    }));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(
        StreamKind::Post,
        vec!["1".into(), "\"b\"".into()],
    ));
    s.detach(stream, generation);
    first(&s, stream); // seq 2
    let after_first = Cursor {
        epoch: s.epoch,
        stream,
        seq: 2,
    };
    let stall = lock(&s.state).consts.stall;
    tokio::time::advance(stall).await;
    for _ in 0..3 {
        s.push_events(
            stream,
            &mut VecDeque::from([msg(r#"{"jsonrpc":"2.0","method":"p"}"#)]),
            None,
        );
    }
    let Ok(Resume::GapWithErrors { frames }) = s.resume(after_first, None) else {
        panic!("gap")
    };
    String::from_utf8(frames.to_vec()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn gap_answers_only_requests_not_answered_before_the_cursor() {
    let t = gap_after_the_first_event(|s, stream| {
        s.push_events(
            stream,
            &mut VecDeque::from([msg(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#)]),
            None,
        );
    })
    .await;
    assert!(t.contains("\"id\":\"b\""), "{t}");
    assert!(
        !t.contains("\"id\":1,"),
        "request 1 was answered before the cursor: {t}"
    );
}

/// An answer whose response ids were read already (an upgraded JSON answer's) is noted by
/// them: its data is not read again. Here the data names no response, so an end that
/// reports request 1 unanswered means the ids given were not used.
#[test]
fn an_answer_is_noted_by_the_ids_read_already() {
    let s = session(cfg(|_| {}));
    let answers = [vec!["1".to_owned()]];
    let whole = s.open_whole(
        OpenStream::new(StreamKind::Post, vec!["1".into(), "\"b\"".into()]),
        &mut VecDeque::from([msg(r#"{"jsonrpc":"2.0","method":"not-read"}"#)]),
        Some(&answers),
        End::Complete,
    );
    let Whole::Served { body, events, .. } = whole else {
        panic!("served whole: {whole:?}")
    };
    assert_eq!(events, 1);
    let t = String::from_utf8(body.to_vec()).unwrap();
    assert!(t.contains("\"id\":\"b\""), "{t}");
    assert!(!t.contains("\"id\":1,"), "request 1 was answered: {t}");
}

#[test]
fn ended_stream_metadata_is_bounded() {
    let s = session(cfg(|_| {}));
    for _ in 0..(MAX_ENDED_STREAMS + 50) {
        let Attachment {
            stream, generation, ..
        } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
        s.push_events(
            stream,
            &mut VecDeque::from([msg(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#)]),
            None,
        );
        s.detach(stream, generation);
        s.end_stream(stream, End::Complete);
    }
    let st = lock(&s.state);
    assert_eq!(st.streams.len(), MAX_ENDED_STREAMS);
    drop(st);
    let forgotten = Cursor {
        epoch: s.epoch,
        stream: 0,
        seq: 1,
    };
    assert_eq!(
        s.resume(forgotten, None).unwrap_err(),
        ResumeError::StreamExpired
    );
}

#[test]
fn detached_calls_are_the_running_posts_without_a_client() {
    let s = session(cfg(|_| {}));
    let open = |id: &str| s.open_stream(OpenStream::new(StreamKind::Post, vec![id.into()]));
    let (a, b, c) = (open("1"), open("2"), open("3"));
    assert_eq!(
        s.detached_calls(Principal::default()),
        0,
        "every call has its client"
    );
    s.detach(a.stream, a.generation);
    s.detach(b.stream, b.generation);
    assert_eq!(s.detached_calls(Principal::default()), 2);
    s.end_stream(a.stream, End::Complete);
    assert_eq!(
        s.detached_calls(Principal::default()),
        1,
        "an ended call holds nothing upstream"
    );
    // Many ended calls retained beside them change nothing.
    for n in 0..(MAX_ENDED_STREAMS + 10) {
        let d = open(&format!("\"e{n}\""));
        s.detach(d.stream, d.generation);
        s.end_stream(d.stream, End::Complete);
    }
    assert_eq!(s.detached_calls(Principal::default()), 1);
    s.detach(c.stream, c.generation);
    assert_eq!(s.detached_calls(Principal::default()), 2);
    // The forgotten streams' ids left the index with them; the retained ones are found.
    let st = lock(&s.state);
    assert_eq!(st.running.len(), 2);
    assert_eq!(
        st.carried.len(),
        st.streams.len(),
        "one id a retained call, no more"
    );
    assert!(st
        .carried
        .carrier(&st.streams, Principal::default(), &["\"e0\"".into()])
        .is_none());
    assert!(st
        .carried
        .carrier(&st.streams, Principal::default(), &["2".into()])
        .is_some());
    drop(st);
    assert!(
        s.carries_any(Principal::default(), &["\"e0\"".into()]),
        "retired, so still a duplicate"
    );
}

fn current_generation(s: &Session, stream: u32) -> u64 {
    lock(&s.state)
        .streams
        .get(&stream)
        .unwrap()
        .sub
        .as_ref()
        .expect("attached")
        .generation
}

fn numbered(from: u64, to: u64, pad: usize) -> VecDeque<Event> {
    (from..to)
        .map(|i| msg(&format!("{{\"n\":{i},\"pad\":\"{}\"}}", "p".repeat(pad))))
        .collect()
}

/// The `"n"` values of every `message` event in `text`, in order.
fn ns(text: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["n"].as_u64())
        .collect()
}

/// A waker that counts its wakes: stands in for the upstream reader's task.
fn counting_waker() -> (Waker, Arc<std::sync::atomic::AtomicUsize>) {
    struct W(Arc<std::sync::atomic::AtomicUsize>);
    impl std::task::Wake for W {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    (Waker::from(Arc::new(W(n.clone()))), n)
}

#[tokio::test(start_paused = true)]
async fn a_slow_reader_gets_everything_and_the_upstream_waits_for_it() {
    let s = session(cfg(|c| {
        c.window_events = 8;
        c.stall_timeout = Duration::from_secs(30);
    }));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let (reader, wakes) = counting_waker();
    let mut pending = numbered(0, 200, 10);
    let mut got = Vec::new();
    let mut pauses = 0;
    while !pending.is_empty() || got.len() < 200 {
        if !pending.is_empty() && !s.push_events(stream, &mut pending, Some(&reader)) {
            pauses += 1;
        }
        // The client reads one batch, slowly, but it always makes progress.
        tokio::time::advance(Duration::from_secs(5)).await;
        s.sweep(Instant::now());
        match step(&s, stream, generation) {
            Step::Data(b, _) => got.extend(ns(&String::from_utf8_lossy(&b))),
            other => panic!("{other:?}"),
        }
    }
    assert!(
        wakes.load(Ordering::SeqCst) > 0,
        "the paused reader was woken"
    );
    assert_eq!(
        got,
        (0..200).collect::<Vec<_>>(),
        "every event, once, in order"
    );
    assert!(pauses > 0, "the upstream was paused");
    assert_eq!(s.metrics.events_evicted_undelivered.get(), 0);
    assert_eq!(
        s.metrics.slow_consumer_detaches.get(),
        0,
        "progress is not a stall"
    );
    let (n, _) = s.window_usage();
    assert!(n <= 8);
}

#[tokio::test(start_paused = true)]
async fn written_events_in_the_reserve_survive_a_cut() {
    let s = session(cfg(|c| c.window_events = 8));
    // Written to the socket, then the connection dies before the client read it.
    let (stream, generation) = one_batch_written(&s);
    s.detach(stream, generation);
    // The upstream fills the window; the written-but-unconfirmed events stay.
    let mut more = numbered(4, 20, 10);
    assert!(!s.push_events(stream, &mut more, None));
    let (replay, got) = resume_from_the_opening(&s, stream, &mut more, 20);
    assert_eq!(replay, 8);
    assert_eq!(got, (0..20).collect::<Vec<_>>());
    assert_eq!(s.metrics.events_evicted_undelivered.get(), 0);
}

/// Opens a POST stream of `s`, pushes events 0..4 and has them written in one batch (the
/// reserve's size): the stream and the client's generation.
fn one_batch_written(s: &Session) -> (u32, u64) {
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let mut pending = numbered(0, 4, 10);
    assert!(s.push_events(stream, &mut pending, None));
    let Step::Data(b, 4) = step(s, stream, generation) else {
        panic!("one batch of the reserve's size")
    };
    assert_eq!(ns(&String::from_utf8_lossy(&b)), vec![0, 1, 2, 3]);
    (stream, generation)
}

/// Resumes `stream` from its opening position and reads `n` events, pushing `more` as room
/// allows: how many the resume replayed, and the numbers read.
fn resume_from_the_opening(
    s: &Session,
    stream: u32,
    more: &mut VecDeque<Event>,
    n: usize,
) -> (usize, Vec<u64>) {
    let opening = Cursor {
        epoch: s.epoch,
        stream,
        seq: 1,
    };
    let Ok(Resume::Attached {
        attachment: Attachment { generation, .. },
        replay,
    }) = s.resume(opening, None)
    else {
        panic!("the written events are still there")
    };
    let mut got = Vec::new();
    while got.len() < n {
        if !more.is_empty() {
            s.push_events(stream, more, None);
        }
        if let Step::Data(b, _) = step(s, stream, generation) {
            got.extend(ns(&String::from_utf8_lossy(&b)));
        }
    }
    (replay, got)
}

/// A connection that stopped taking writes (a path being cut, a peer that stopped reading)
/// keeps its written batches in the reserve however old they get: the upstream waits instead,
/// and the client that comes back gets every event. Released by age alone, they were evicted
/// and lost (tests/slow/flow_control.rs, a cut under a loaded CI: 1,411 events in a gap).
#[tokio::test(start_paused = true)]
async fn written_events_of_a_connection_that_stopped_taking_writes_are_not_aged_out() {
    let s = session(cfg(|c| c.window_events = 8));
    let (stream, generation) = one_batch_written(&s);
    // The client stays attached but its connection takes nothing more for seconds.
    tokio::time::advance(reserve::INFLIGHT_AGE * 2).await;
    let mut more = numbered(4, 20, 10);
    assert!(
        !s.push_events(stream, &mut more, None),
        "the upstream waits: the written batch is not taken as delivered"
    );
    assert_eq!(
        more.len(),
        12,
        "room for four more, not for the written ones' places"
    );
    // The cut shows; the client comes back within the budget and gets everything once.
    s.detach(stream, generation);
    let (replay, got) = resume_from_the_opening(&s, stream, &mut more, 20);
    assert_eq!(replay, 8);
    assert_eq!(got, (0..20).collect::<Vec<_>>());
    assert_eq!(s.metrics.events_evicted_undelivered.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn one_streams_traffic_never_evicts_anothers_undelivered_events() {
    let s = session(cfg(|c| c.window_events = 6));
    let Attachment {
        stream: a,
        generation: ga,
        ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let Attachment {
        stream: b,
        generation: gb,
        ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["2".into()]));
    let mut for_a = numbered(0, 3, 10);
    assert!(s.push_events(a, &mut for_a, None));
    s.detach(a, ga); // a's client is away, within its stall budget
    let mut for_b = numbered(100, 110, 10);
    assert!(
        !s.push_events(b, &mut for_b, None),
        "b waits rather than evict a's events"
    );
    // b's own client reads, so b moves on within the room a leaves it (b's written events
    // leave the in-flight reserve as b writes more, or once delivered for a second).
    let mut got_b = Vec::new();
    for _ in 0..20 {
        tokio::time::advance(Duration::from_millis(500)).await;
        if let Step::Data(bytes, _) = step(&s, b, gb) {
            got_b.extend(ns(&String::from_utf8_lossy(&bytes)));
        }
        if !for_b.is_empty() {
            s.push_events(b, &mut for_b, None);
        }
    }
    assert_eq!(got_b, (100..110).collect::<Vec<_>>());
    let opening_a = Cursor {
        epoch: s.epoch,
        stream: a,
        seq: 1,
    };
    assert!(matches!(
        s.resume(opening_a, None),
        Ok(Resume::Attached { replay: 3, .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn an_oversized_event_waits_for_its_client_and_is_never_dropped_silently() {
    let s = session(cfg(|c| c.window_bytes = 100));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let mut big = numbered(0, 3, 300);
    assert!(!s.push_events(stream, &mut big, None), "one overflow slot");
    assert_eq!(big.len(), 2);
    let mut got = Vec::new();
    for _ in 0..10 {
        if let Step::Data(b, _) = step(&s, stream, generation) {
            got.extend(ns(&String::from_utf8_lossy(&b)));
        }
        if !big.is_empty() {
            s.push_events(stream, &mut big, None);
        }
    }
    assert_eq!(got, vec![0, 1, 2]);
    assert_eq!(s.metrics.events_evicted_undelivered.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_stalled_client_is_detached_and_only_then_the_window_moves_on() {
    let s = session(cfg(|c| {
        c.window_events = 4;
        c.stall_timeout = Duration::from_secs(30);
    }));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let (reader, wakes) = counting_waker();
    let mut pending = numbered(0, 10, 10);
    assert!(!s.push_events(stream, &mut pending, Some(&reader)));
    // The client never reads: no progress for the stall budget.
    tokio::time::advance(Duration::from_secs(29)).await;
    s.sweep(Instant::now());
    assert!(!s.push_events(stream, &mut pending, Some(&reader)));
    tokio::time::advance(Duration::from_secs(2)).await;
    s.sweep(Instant::now());
    assert!(
        wakes.load(Ordering::SeqCst) > 0,
        "the sweep wakes the reader"
    );
    assert_eq!(s.metrics.slow_consumer_detaches.get(), 1);
    assert!(s.push_events(stream, &mut pending, Some(&reader)));
    let out = text(step(&s, stream, generation));
    assert!(out.contains(EVENT_RESUMPTION_REQUIRED), "{out}");
    assert!(s.metrics.events_evicted_undelivered.get() > 0);
    // Its resume from where it was is an explicit gap, never a silent one.
    let opening = Cursor {
        epoch: s.epoch,
        stream,
        seq: 1,
    };
    assert!(matches!(
        s.resume(opening, None),
        Ok(Resume::GapWithErrors { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_client_briefly_away_gets_everything_when_it_returns() {
    let s = session(cfg(|c| {
        c.window_events = 4;
        c.stall_timeout = Duration::from_secs(30);
    }));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Standalone, vec![]));
    s.detach(stream, generation);
    let mut pending = numbered(0, 10, 10);
    assert!(!s.push_events(stream, &mut pending, None));
    tokio::time::advance(Duration::from_millis(200)).await;
    s.sweep(Instant::now());
    assert!(!s.push_events(stream, &mut pending, None), "still held");
    let opening = Cursor {
        epoch: s.epoch,
        stream,
        seq: 1,
    };
    let Ok(Resume::Attached {
        attachment: Attachment { generation: g, .. },
        ..
    }) = s.resume(opening, None)
    else {
        panic!("resumable")
    };
    let mut got = Vec::new();
    for _ in 0..20 {
        if let Step::Data(b, _) = step(&s, stream, g) {
            got.extend(ns(&String::from_utf8_lossy(&b)));
        }
        if !pending.is_empty() {
            s.push_events(stream, &mut pending, None);
        }
    }
    assert_eq!(got, (0..10).collect::<Vec<_>>());
}

#[test]
fn a_retransmitted_request_is_a_resume_of_its_stream() {
    let s = session(cfg(|_| {}));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream {
        prime: true,
        ..OpenStream::new(StreamKind::Post, vec!["7".into()])
    });
    s.push_events(stream, &mut numbered(0, 2, 0), None);
    s.push_events(
        stream,
        &mut VecDeque::from([msg(r#"{"jsonrpc":"2.0","id":7,"result":{"n":9}}"#)]),
        None,
    );
    s.detach(stream, generation);
    let seen = Cursor {
        epoch: s.epoch,
        stream,
        seq: 2,
    };
    assert!(s.carries_any(Principal::default(), &["7".into()]));
    assert!(!s.carries_any(Principal::default(), &["8".into()]));
    assert!(matches!(
        s.retransmission(Principal::default(), &["8".into()], Some(seen), None),
        Retransmission::NotOne
    ));
    // With the stream's cursor: exactly what came after it.
    let Retransmission::Resumed(Resume::Attached { replay: 2, .. }) =
        s.retransmission(Principal::default(), &["7".into()], Some(seen), None)
    else {
        panic!("resume after the cursor")
    };
    // Without a usable cursor: the stream from its start, nothing of it being lost.
    let foreign = Cursor { epoch: 1, ..seen };
    let Retransmission::Resumed(Resume::Attached { replay: 3, .. }) =
        s.retransmission(Principal::default(), &["7".into()], Some(foreign), None)
    else {
        panic!("resume from the start")
    };
}

#[test]
fn a_stale_standalone_cursor_reattaches_to_the_session() {
    let s = session(cfg(|_| {}));
    let Attachment {
        stream: standalone,
        generation: g,
        ..
    } = s.open_stream(OpenStream::new(StreamKind::Standalone, vec![]));
    s.push_events(standalone, &mut numbered(0, 1, 0), None);
    let Step::Data(..) = step(&s, standalone, g) else {
        panic!()
    };
    s.end_stream(standalone, End::Complete);
    let at = Cursor {
        epoch: s.epoch,
        stream: standalone,
        seq: 2,
    };
    let err = s.resume(at, None).unwrap_err();
    assert_eq!(err, ResumeError::StreamEnded);
    let r = s.standalone_reattach(&at).expect("re-attach");
    assert!(!r.lost);
    // A POST stream's cursor keeps its 409.
    let Attachment { stream: post, .. } =
        s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    s.end_stream(post, End::Complete);
    let p = Cursor {
        epoch: s.epoch,
        stream: post,
        seq: 3,
    };
    assert!(s.standalone_reattach(&p).is_none());
    // The new standalone stream opens with an id-bearing control event saying so.
    let Attachment {
        stream: n, opening, ..
    } = s.open_stream(OpenStream {
        reattach: Some(&r),
        ..OpenStream::new(StreamKind::Standalone, vec![])
    });
    let opening = String::from_utf8(opening.unwrap().to_vec()).unwrap();
    assert!(
        opening.starts_with(&format!("id: {}\n", lock(&s.state).consts.cursor(n, 4))),
        "{opening}"
    );
    assert!(opening.contains(EVENT_RESUMED), "{opening}");
    let lost = Reattach {
        lost: true,
        ..r.clone()
    };
    let Attachment { opening, .. } = s.attach_standalone(false, Some(&lost), None).expect("held");
    assert!(String::from_utf8_lossy(&opening.unwrap()).contains(EVENT_RESUMPTION_FAILED));
}

mod model {
    //! Property: whatever the rates of the upstream and the client, and wherever the
    //! connection is cut (losing the batch in flight), a client that comes back within the
    //! stall budget receives every event exactly once, in order, and nothing is evicted
    //! undelivered.
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Upstream(u8),
        Read,
        Cut,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1u8..6).prop_map(Op::Upstream),
            4 => Just(Op::Read),
            1 => Just(Op::Cut),
        ]
    }

    proptest! {
        #[test]
        fn never_evicts_what_a_returning_client_needs(
            window_events in 2usize..10,
            pad in 0usize..40,
            ops in proptest::collection::vec(op(), 1..120),
        ) {
            let s = session(cfg(|c| {
                c.window_events = window_events;
                c.window_bytes = 4096;
            }));
            let Attachment { stream, mut generation, .. } =
                s.open_stream(OpenStream::new(StreamKind::Standalone, vec![]));
            let mut next = 0u64;
            let mut reader: VecDeque<Event> = VecDeque::new();
            let mut got: Vec<u64> = Vec::new();
            // What the client has processed, and its cursor; the last batch is in flight
            // until the next read confirms it.
            let mut confirmed = (0usize, 1u64);
            let mut in_flight = (0usize, 1u64);
            let mut attached = true;
            let last_id = |b: &Bytes| -> u64 {
                let t = String::from_utf8_lossy(b);
                let id = t.lines().filter_map(|l| l.strip_prefix("id: ")).next_back().unwrap().to_owned();
                Cursor::parse(id.as_bytes()).unwrap().seq
            };
            let drain = |s: &Session, g: u64, got: &mut Vec<u64>, reader: &mut VecDeque<Event>| -> Option<(usize, u64)> {
                let mut at = None;
                for _ in 0..1000 {
                    if !reader.is_empty() {
                        s.push_events(stream, reader, None);
                    }
                    match step(s, stream, g) {
                        Step::Data(b, _) => {
                            got.extend(ns(&String::from_utf8_lossy(&b)));
                            at = Some((got.len(), last_id(&b)));
                        }
                        _ => if reader.is_empty() { break },
                    }
                }
                at
            };
            for op in ops {
                match op {
                    Op::Upstream(n) => {
                        reader.extend(numbered(next, next + n as u64, pad));
                        next += n as u64;
                        s.push_events(stream, &mut reader, None);
                    }
                    Op::Read if attached => {
                        if let Step::Data(b, _) = step(&s, stream, generation) {
                            confirmed = in_flight;
                            got.extend(ns(&String::from_utf8_lossy(&b)));
                            in_flight = (got.len(), last_id(&b));
                        }
                    }
                    Op::Read => {
                        let at = Cursor { epoch: s.epoch, stream, seq: confirmed.1 };
                        got.truncate(confirmed.0);
                        match s.resume(at, None) {
                            Ok(Resume::Attached { attachment: Attachment { generation: g, .. }, .. }) => generation = g,
                            other => prop_assert!(false, "resume within the budget: {:?}", other),
                        }
                        in_flight = confirmed;
                        attached = true;
                    }
                    Op::Cut => {
                        if attached {
                            s.detach(stream, generation);
                            attached = false;
                        }
                    }
                }
            }
            if !attached {
                let at = Cursor { epoch: s.epoch, stream, seq: confirmed.1 };
                got.truncate(confirmed.0);
                let Ok(Resume::Attached { attachment: Attachment { generation: g, .. }, .. }) = s.resume(at, None) else {
                    panic!("resume at the end")
                };
                generation = g;
            }
            drain(&s, generation, &mut got, &mut reader);
            prop_assert_eq!(got, (0..next).collect::<Vec<_>>());
            prop_assert_eq!(s.metrics.events_evicted_undelivered.get(), 0);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_get_without_cursor_gets_what_no_client_was_sent() {
    let s = session(cfg(|c| c.window_events = 4));
    let Attachment {
        stream: standalone,
        generation: g,
        ..
    } = s.open_stream(OpenStream::new(StreamKind::Standalone, vec![]));
    assert!(s.push_events(standalone, &mut numbered(0, 1, 0), None));
    let Step::Data(..) = step(&s, standalone, g) else {
        panic!("sent")
    };
    assert!(s.push_events(standalone, &mut numbered(1, 3, 0), None));
    s.detach(standalone, g);
    // A new GET without Last-Event-ID: the stream's client now. It gets what the replaced
    // client was never sent (1, 2), not what it was (0).
    let Attachment { generation: g2, .. } = s.attach_standalone(false, None, None).expect("held");
    assert_eq!(ns(&text(step(&s, standalone, g2))), vec![1, 2]);
}

#[tokio::test(start_paused = true)]
async fn a_held_standalone_stream_keeps_messages_for_its_first_client() {
    let s = session(cfg(|c| {
        c.window_events = 4;
        c.stall_timeout = Duration::from_secs(1);
    }));
    assert_eq!(s.hold_start(), HoldStart::Spawn);
    assert_eq!(s.hold_start(), HoldStart::Nothing, "one attempt at a time");
    let held = s.open_held_standalone().expect("opened");
    assert_eq!(s.hold_start(), HoldStart::Nothing, "one held stream");
    // The server sends before any client GET; the window fills and the reader waits, however
    // long the client takes (the session TTL bounds this, not the stall budget).
    assert!(!s.push_events(held, &mut numbered(0, 6, 0), None));
    tokio::time::advance(Duration::from_secs(10)).await;
    s.sweep(Instant::now());
    let mut pending = numbered(4, 6, 0);
    assert!(!s.push_events(held, &mut pending, None));
    let Attachment {
        stream,
        generation: g,
        ..
    } = s.attach_standalone(false, None, None).expect("held");
    assert_eq!(stream, held);
    let mut got = Vec::new();
    for _ in 0..10 {
        if let Step::Data(b, _) = step(&s, stream, g) {
            got.extend(ns(&String::from_utf8_lossy(&b)));
        }
        if !pending.is_empty() {
            s.push_events(held, &mut pending, None);
        }
    }
    assert_eq!(got, (0..6).collect::<Vec<_>>(), "every message, once");
    assert_eq!(s.metrics.events_evicted_undelivered.get(), 0);
}

#[test]
fn a_405_marks_the_upstream_without_standalone_stream() {
    let s = session(cfg(|_| {}));
    assert_eq!(s.hold_start(), HoldStart::Spawn);
    s.hold_failed(Attempt::Unsupported);
    assert_eq!(
        s.hold_start(),
        HoldStart::Nothing,
        "no retry storm against an upstream that has none"
    );
    let t = session(cfg(|_| {}));
    assert_eq!(t.hold_start(), HoldStart::Spawn);
    t.hold_failed(Attempt::GiveUp);
    assert_eq!(
        t.hold_start(),
        HoldStart::Spawn,
        "a failed attempt may be retried"
    );
}

#[test]
fn a_waiting_holder_is_kicked_not_doubled() {
    let s = session(cfg(|_| {}));
    assert_eq!(s.hold_start(), HoldStart::Spawn);
    assert!(s.hold_attempt());
    s.hold_failed(Attempt::Retry);
    assert_eq!(s.hold_phase(), Phase::Backoff);
    // A client's GET during the backoff: the holder tries now, and the GET waits for it.
    assert_eq!(s.hold_start(), HoldStart::Kicked);
    assert_eq!(s.hold_phase(), Phase::Opening);
    assert_eq!(s.hold_start(), HoldStart::Nothing, "one attempt at a time");
    let held = s.open_held_standalone().expect("opened");
    assert_eq!(s.hold_phase(), Phase::Holding);
    // The upstream ends the held stream having sent nothing: the rest grows.
    s.end_stream(held, End::Complete);
    assert_eq!(s.hold_rest(held), Some(hold::REHOLD_MIN * 2));
    assert_eq!(s.hold_phase(), Phase::Resting);
    assert_eq!(s.hold_start(), HoldStart::Kicked);
}

#[test]
fn a_client_stream_that_ends_hands_the_session_to_a_holder_once() {
    let s = session(cfg(|_| {}));
    let stream = s
        .open_stream(OpenStream::new(StreamKind::Standalone, vec![]))
        .stream;
    let post = s
        .open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]))
        .stream;
    s.end_stream(post, End::Complete);
    assert_eq!(
        s.hold_after_client_stream(post),
        None,
        "not a standalone stream"
    );
    s.end_stream(stream, End::Complete);
    assert!(s.hold_after_client_stream(stream).is_some());
    assert_eq!(s.hold_phase(), Phase::Resting);
    assert_eq!(s.hold_after_client_stream(stream), None, "one holder");
}

#[tokio::test]
async fn closing_the_session_stops_its_holder() {
    let reg = Registry::new(cfg(|_| {}), Arc::default());
    let s = reg
        .get_or_create("s", Owner::new(Principal::default(), "/mcp"))
        .expect("created");
    let task = tokio::spawn(std::future::pending::<()>());
    s.set_holder(task.abort_handle());
    reg.remove("s", Eviction::Delete);
    assert!(task.await.expect_err("aborted").is_cancelled());
    assert_eq!(s.hold_phase(), Phase::Idle);
}

#[test]
fn failure_frames_carry_an_id_only_for_a_client_that_already_has_one() {
    for prime in [false, true] {
        let s = session(cfg(|_| {}));
        let Attachment {
            stream,
            generation: g,
            ..
        } = s.open_stream(OpenStream {
            prime,
            ..OpenStream::new(StreamKind::Post, vec!["1".into()])
        });
        // The upstream ends the stream before answering, having sent nothing.
        s.end_stream(stream, End::Complete);
        let out = text(step(&s, stream, g));
        assert!(out.contains(EVENT_RESUMPTION_FAILED), "{out}");
        assert!(out.contains("\"code\":-32010"), "{out}");
        assert_eq!(
            out.contains("id: "),
            prime,
            "no cursor for a client that was never given one: {out}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_forward_in_flight_holds_its_ids_until_it_settles() {
    let s = Arc::new(session(cfg(|_| {})));
    let ids = vec!["7".to_owned(), "8".to_owned()];
    let first = s
        .begin_forward(Principal::default(), &ids)
        .expect("nothing in flight yet");
    assert!(
        s.begin_forward(Principal::default(), &["8".to_owned()])
            .unwrap_err()
            == InFlight::Own,
        "8 is in flight"
    );
    assert!(
        s.begin_forward(Principal::default(), &["9".to_owned()])
            .is_ok(),
        "other ids are not held"
    );
    let waiter = {
        let s = s.clone();
        tokio::spawn(async move {
            s.forward_settled(Principal::default(), &["7".to_owned()])
                .await
        })
    };
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(
        !waiter.is_finished(),
        "waits while the forward is in flight"
    );
    drop(first);
    tokio::time::timeout(Duration::from_millis(1), waiter)
        .await
        .expect("settled when the guard drops")
        .unwrap();
    assert!(
        s.begin_forward(Principal::default(), &ids).is_ok(),
        "free again"
    );
}

/// Issue 46 item 2: a request id in flight for one principal (forwarded, or carried by a
/// running stream that has not answered it) is never forwarded for another; once answered,
/// another principal's request with the same id is its own.
#[test]
fn an_id_in_flight_for_one_principal_is_refused_for_another() {
    let s = Arc::new(session(cfg(|_| {})));
    let (owner, other) = (Principal([1; 16]), Principal([2; 16]));
    let five = vec!["5".to_owned()];
    let forwarding = s.begin_forward(owner, &five).expect("nothing in flight");
    assert_eq!(
        s.begin_forward(other, &five).unwrap_err(),
        InFlight::Another,
        "being forwarded for the owner"
    );
    let mut open = OpenStream::new(StreamKind::Post, five.clone());
    open.principal = owner;
    let a = s.open_stream(open);
    drop(forwarding);
    assert_eq!(
        s.begin_forward(other, &five).unwrap_err(),
        InFlight::Another,
        "its stream is still waiting for the answer"
    );
    assert!(
        s.begin_forward(other, &["6".to_owned()]).is_ok(),
        "other ids are free"
    );
    let mut answer = VecDeque::from([Event::message_of(r#"{"jsonrpc":"2.0","id":5,"result":{}}"#)]);
    assert!(s.push_events(a.stream, &mut answer, None));
    assert!(
        s.begin_forward(other, &five).is_ok(),
        "answered: no longer in flight"
    );
}

/// Issue 56 (STYLE 20): the replica's own state answers an id in flight as the fleet's store
/// does, one rule for both: at each phase of the owner's call (its POST forwarded, its stream
/// waiting for the answer, answered), the state's verdict for the owner and for anyone else is
/// the rule's for the holder the store's value names then (`store::wire::held_by`).
#[test]
fn an_ids_verdict_here_is_the_stores_for_the_same_holder() {
    let s = Arc::new(session(cfg(|_| {})));
    let (owner, other) = (Principal([1; 16]), Principal([2; 16]));
    let five = vec!["5".to_owned()];
    let both = |holder: IdHolder, phase: &str| {
        for p in [owner, other] {
            assert_eq!(
                s.id_verdict(p, &five),
                verdict(Some(holder), p),
                "{phase}, {}",
                if p == owner { "the owner" } else { "another" }
            );
        }
    };
    assert_eq!(
        s.id_verdict(other, &five),
        verdict(None, other),
        "nobody holds it"
    );
    let forwarding = s.begin_forward(owner, &five).expect("nothing in flight");
    both(IdHolder::Forwarding(owner), "forwarded");
    let mut open = OpenStream::new(StreamKind::Post, five.clone());
    open.principal = owner;
    let a = s.open_stream(open);
    drop(forwarding);
    both(IdHolder::Awaited(owner, a.stream), "awaited");
    let mut answer = VecDeque::from([Event::message_of(r#"{"jsonrpc":"2.0","id":5,"result":{}}"#)]);
    assert!(s.push_events(a.stream, &mut answer, None));
    both(IdHolder::Answered(owner, a.stream), "answered");
}

/// Issue 46 items 1 and 6: a call's stream is resumable only by the principal that sent the
/// call, and the detached-call quota counts each principal's own calls.
#[test]
fn a_calls_stream_and_its_quota_are_its_senders() {
    let s = session(cfg(|_| {}));
    let (owner, other) = (Principal([1; 16]), Principal([2; 16]));
    let open = |id: &str, p: Principal| {
        let mut o = OpenStream::new(StreamKind::Post, vec![id.into()]);
        o.principal = p;
        s.open_stream(o)
    };
    let mine = open("1", owner);
    let theirs = open("2", other);
    let at = |a: &Attachment| Cursor {
        epoch: s.epoch,
        stream: a.stream,
        seq: 0,
    };
    assert!(s.may_resume(&at(&mine), owner));
    assert!(!s.may_resume(&at(&mine), other), "the owner's call");
    assert!(!s.may_resume(&at(&theirs), owner), "the other's call");
    let standalone = s.open_stream(OpenStream::new(StreamKind::Standalone, vec![]));
    assert!(
        s.may_resume(&at(&standalone), owner),
        "the session's stream"
    );
    s.detach(theirs.stream, theirs.generation);
    assert_eq!(s.detached_calls(owner), 0);
    assert_eq!(s.detached_calls(other), 1);
    s.detach(mine.stream, mine.generation);
    assert_eq!(s.detached_calls(owner), 1);
}

/// Issue 22 item 6: at the session cap, one share's flood sheds its own sessions and never
/// another share's, and a share over its part loses even attached sessions to a newcomer
/// within its part; with a single share, attached sessions are never shed (503 instead).
#[tokio::test(start_paused = true)]
async fn at_the_cap_a_flooding_share_sheds_its_own_sessions_not_others() {
    let reg = Registry::new(cfg(|c| c.max_sessions = 10), Arc::default());
    let (a, b) = (Principal([1; 16]), Principal([2; 16]));
    let owner = |p: Principal| Owner::new(p, "/mcp");
    // B's two sessions: one with a client attached, one whose client just left mid-call.
    let b_live = reg.get_or_create("b-live", owner(b)).unwrap();
    b_live.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let b_away = reg.get_or_create("b-away", owner(b)).unwrap();
    let Attachment {
        stream, generation, ..
    } = b_away.open_stream(OpenStream::new(StreamKind::Post, vec!["2".into()]));
    b_away.detach(stream, generation);
    // A floods: each of its sessions holds a client.
    for i in 0..40 {
        tokio::time::advance(Duration::from_millis(10)).await;
        if let Ok(s) = reg.get_or_create(&format!("a-{i}"), owner(a)) {
            s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
        }
    }
    assert!(reg.get("b-live").is_some(), "B's attached session stays");
    assert!(reg.get("b-away").is_some(), "B's running call stays");
    // B, within its part, gets a new session: A (over its part) loses an attached one.
    let a_before = (0..40)
        .filter(|i| reg.get(&format!("a-{i}")).is_some())
        .count();
    assert!(reg.get_or_create("b-new", owner(b)).is_ok());
    let a_after = (0..40)
        .filter(|i| reg.get(&format!("a-{i}")).is_some())
        .count();
    assert_eq!((a_before, a_after), (8, 7));
    assert!(reg.get("b-live").is_some() && reg.get("b-away").is_some());

    // One share alone: attached sessions are never shed.
    let reg = Registry::new(cfg(|c| c.max_sessions = 2), Arc::default());
    for id in ["x", "y"] {
        let s = reg.get_or_create(id, owner(a)).unwrap();
        s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
    }
    assert!(reg.get_or_create("z", owner(a)).is_err());
    assert_eq!(reg.len(), 2);
}

/// Issue 22 item 6: the memory budget is shared the same way: a share whose windows hold more
/// than its part is the one that loses sessions when another share needs room.
#[tokio::test(start_paused = true)]
async fn the_memory_budget_sheds_the_share_over_its_part_first() {
    let reg = Registry::new(
        cfg(|c| {
            c.memory_budget = 90_000;
            c.window_bytes = 40_000;
        }),
        Arc::default(),
    );
    let (a, b) = (Principal([1; 16]), Principal([2; 16]));
    let owner = |p: Principal| Owner::new(p, "/mcp");
    let fill = |s: &Session, n: usize| {
        let Attachment {
            stream, generation, ..
        } = s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
        let mut events: VecDeque<Event> = (0..n).map(|i| msg(&format!("{i:0>990}"))).collect();
        assert!(s.push_events(stream, &mut events, None));
        s.detach(stream, generation);
    };
    // B's session, idle and older, holds 10 kB; A's two hold 40 kB each.
    let b_old = reg.get_or_create("b-old", owner(b)).unwrap();
    fill(&b_old, 10);
    tokio::time::advance(Duration::from_secs(1)).await;
    for id in ["a-1", "a-2"] {
        let s = reg.get_or_create(id, owner(a)).unwrap();
        fill(&s, 38);
    }
    tokio::time::advance(Duration::from_secs(60)).await;
    // Over 90% of the budget: a new session of B's sheds one of A's, not B's older one.
    assert!(reg.window_bytes() > 81_000, "{}", reg.window_bytes());
    assert!(reg.get_or_create("b-new", owner(b)).is_ok());
    assert!(reg.get("b-old").is_some(), "B's own session stays");
    assert_eq!(
        ["a-1", "a-2"]
            .iter()
            .filter(|id| reg.get(id).is_some())
            .count(),
        1
    );
}

/// Issue 22 item 7: events written to a client, pushed out of the in-flight reserve (taken as
/// delivered) and evicted, then lost on the way (the client's own buffers died with its
/// connection), are counted in `events_evicted_undelivered_total` when the client's resume
/// shows it never had them: once each, however often it resumes.
#[tokio::test(start_paused = true)]
async fn events_lost_in_flight_beyond_the_reserve_are_counted_when_a_resume_shows_it() {
    let s = session(cfg(|c| c.window_events = 8));
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    // 40 events, each batch written to the client as it comes.
    for i in 0..40 {
        let mut one = numbered(i, i + 1, 10);
        while !one.is_empty() {
            s.push_events(stream, &mut one, None);
            let _ = step(&s, stream, generation);
        }
    }
    while let Step::Data(..) = step(&s, stream, generation) {}
    assert_eq!(
        s.metrics.events_evicted_undelivered.get(),
        0,
        "all were written"
    );
    s.detach(stream, generation);
    // The client got nothing of it: it resumes at the stream's opening (position 1).
    let opening = Cursor {
        epoch: s.epoch,
        stream,
        seq: 1,
    };
    assert!(matches!(
        s.resume(opening, None),
        Ok(Resume::GapWithErrors { .. })
    ));
    let lost = s.metrics.events_evicted_undelivered.get();
    let (retained, _) = s.window_usage();
    assert_eq!(
        lost,
        40 - retained as u64,
        "every evicted event after the cursor"
    );
    assert_eq!(s.resume(opening, None).unwrap_err(), ResumeError::Gap);
    assert_eq!(
        s.metrics.events_evicted_undelivered.get(),
        lost,
        "counted once"
    );
}

/// A session whose memory budget is `budget` (shared, so a test can read it).
fn session_with_budget(c: Arc<Config>, budget: &Arc<Budget>) -> Session {
    Session::new(
        "a".into(),
        c,
        Arc::default(),
        budget.clone(),
        Owner::new(Principal::default(), "/mcp"),
        false,
    )
}

/// A `message` event whose data is a JSON object padded to about `n` bytes.
fn padded(n: usize) -> Event {
    msg(&format!("{{\"pad\":\"{}\"}}", "o".repeat(n)))
}

/// Steps the client until it has nothing more to send now; returns every byte it was given.
fn drain_client(s: &Session, stream: u32, generation: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        match step(s, stream, generation) {
            Step::Data(b, _) => out.extend_from_slice(&b),
            Step::Pending => return out,
            Step::Finish(b, _) => {
                out.extend_from_slice(&b);
                return out;
            }
        }
    }
}

/// Issue 22 item 5: an event larger than the window is written in pieces (each poll hands
/// hyper at most one batch of it, so a client that stops reading leaves at most that in
/// hyper's buffer), and its bytes stay counted in the memory budget until the client's body
/// is polled again after its last piece (hyper took it), not from the moment it was handed.
#[tokio::test(start_paused = true)]
async fn an_oversized_event_is_written_in_pieces_and_counted_until_its_client_took_it() {
    let budget = Arc::new(Budget::new(usize::MAX));
    let s = session_with_budget(cfg(|c| c.window_bytes = 8 << 10), &budget);
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let big = padded(300 << 10);
    assert!(s.push_events(stream, &mut VecDeque::from([big.clone()]), None));
    let held = budget.used();
    assert!(held > 300 << 10, "held for its client: {held}");
    let mut got = Vec::new();
    let mut pieces = 0;
    while let Step::Data(b, _) = step(&s, stream, generation) {
        pieces += 1;
        assert!(
            b.len() <= batch::BATCH_BYTES,
            "piece {pieces} is {} bytes: the event went to the client whole",
            b.len()
        );
        got.extend_from_slice(&b);
        assert_eq!(
            budget.used(),
            held,
            "still counted after piece {pieces}: the client's body was not polled past it"
        );
    }
    assert!(pieces > 4, "{pieces} pieces");
    assert_eq!(
        budget.used(),
        0,
        "released once the client was polled past it"
    );
    let text = String::from_utf8(got).unwrap();
    let data = big.data().unwrap();
    assert!(
        text.starts_with("id: ") && text.ends_with(&format!("event: message\ndata: {data}\n\n")),
        "the event, whole and once"
    );
}

/// Issue 22 item 5: stall detection runs until the client's body is polled again after a
/// write, so a client that never takes its last frame (hyper cannot flush it and never polls
/// again) is detached and its connection closed after --stall-timeout; one that takes it is
/// left alone.
#[tokio::test(start_paused = true)]
async fn a_client_that_never_takes_its_last_frame_is_closed_after_the_stall_timeout() {
    for flushed in [false, true] {
        let s = session(cfg(|c| c.stall_timeout = Duration::from_secs(30)));
        let kill = Arc::new(Notify::new());
        let Attachment {
            stream, generation, ..
        } = s.open_stream(OpenStream {
            kill: Some(kill.clone()),
            ..OpenStream::new(StreamKind::Post, vec!["1".into()])
        });
        let answer = msg(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
        assert!(s.push_events(stream, &mut VecDeque::from([answer]), None));
        s.end_stream(stream, End::Complete);
        assert!(matches!(step(&s, stream, generation), Step::Data(..)));
        if flushed {
            assert!(matches!(
                step(&s, stream, generation),
                Step::Finish(_, Outcome::Completed)
            ));
        }
        tokio::time::advance(Duration::from_secs(31)).await;
        s.sweep(Instant::now());
        tokio::time::advance(Duration::from_secs(1)).await;
        s.sweep(Instant::now());
        let closed = tokio::time::timeout(Duration::ZERO, kill.notified())
            .await
            .is_ok();
        assert_eq!(closed, !flushed, "flushed: {flushed}");
    }
}

/// Issue 22 item 5: an oversized event enters its stream's slot only while the memory budget
/// has room for it below 90% (like a new session), or when no other is held (so one always
/// moves); else its reader waits, and the budget never goes over for it.
#[tokio::test(start_paused = true)]
async fn an_oversized_event_waits_for_room_in_the_memory_budget() {
    let budget = Arc::new(Budget::new(1 << 20));
    let s = session_with_budget(cfg(|c| c.window_bytes = 8 << 10), &budget);
    let open = |id: &str| s.open_stream(OpenStream::new(StreamKind::Post, vec![id.into()]));
    let (a, b) = (open("1"), open("2"));
    assert!(s.push_events(a.stream, &mut VecDeque::from([padded(600 << 10)]), None));
    let mut second = VecDeque::from([padded(600 << 10)]);
    assert!(
        !s.push_events(b.stream, &mut second, None),
        "no room in the budget: it waits"
    );
    assert!(budget.used() <= 1 << 20, "{}", budget.used());
    // The first one's client takes it: room for the second.
    drain_client(&s, a.stream, a.generation);
    assert!(s.push_events(b.stream, &mut second, None));
    assert!(String::from_utf8(drain_client(&s, b.stream, b.generation))
        .unwrap()
        .contains("\"pad\":\"ooo"));
    assert_eq!(budget.used(), 0);
    // Alone, an event larger than the whole budget still moves.
    assert!(s.push_events(a.stream, &mut VecDeque::from([padded(2 << 20)]), None));
}

/// Issue 22 item 5: a client cut half-way through an oversized event gets it whole when it
/// resumes within --stall-timeout (its slot keeps it); a client stalled half-way through it
/// gets no control event glued to the half it has (its body just ends); once no client may
/// come back for it, the sweep frees it (a later resume is an explicit gap).
#[tokio::test(start_paused = true)]
async fn an_oversized_event_cut_half_way_is_resumed_whole_and_freed_once_nobody_may_come_back() {
    let budget = Arc::new(Budget::new(usize::MAX));
    let s = session_with_budget(
        cfg(|c| {
            c.window_bytes = 8 << 10;
            c.stall_timeout = Duration::from_secs(30);
        }),
        &budget,
    );
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["1".into()]));
    let big = padded(200 << 10);
    assert!(s.push_events(stream, &mut VecDeque::from([big.clone()]), None));
    assert!(matches!(step(&s, stream, generation), Step::Data(..)));
    s.detach(stream, generation);
    let opening = Cursor {
        epoch: s.epoch,
        stream,
        seq: 1,
    };
    let Ok(Resume::Attached {
        attachment: Attachment { generation: g2, .. },
        replay: 1,
    }) = s.resume(opening, None)
    else {
        panic!("the event is still held")
    };
    let text = String::from_utf8(drain_client(&s, stream, g2)).unwrap();
    assert!(
        text.ends_with(&format!("data: {}\n\n", big.data().unwrap())),
        "whole after the resume"
    );

    // Another one, and this client stalls half-way through it.
    let Attachment {
        stream, generation, ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["2".into()]));
    assert!(s.push_events(stream, &mut VecDeque::from([padded(200 << 10)]), None));
    assert!(matches!(step(&s, stream, generation), Step::Data(..)));
    tokio::time::advance(Duration::from_secs(31)).await;
    s.sweep(Instant::now());
    match step(&s, stream, generation) {
        Step::Finish(b, Outcome::SlowConsumer) => {
            assert!(b.is_empty(), "nothing glued to half an event: {b:?}")
        }
        other => panic!("{other:?}"),
    }
    // Nobody may come back for it once the stall budget has passed: the sweep frees it.
    assert!(budget.used() > 200 << 10);
    tokio::time::advance(Duration::from_secs(31)).await;
    s.sweep(Instant::now());
    assert_eq!(budget.used(), 0, "freed by the sweep");
    let opening = Cursor {
        epoch: s.epoch,
        stream,
        seq: lock(&s.state).streams.get(&stream).unwrap().first_seq,
    };
    assert!(matches!(
        s.resume(opening, None),
        Ok(Resume::GapWithErrors { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn room_is_made_behind_another_streams_needed_events() {
    let s = session(cfg(|c| {
        c.window_events = 6;
        c.stall_timeout = Duration::from_secs(1);
    }));
    // The oldest three belong to a stream whose client is attached and has read nothing:
    // they stay. The next three belong to a stream whose client left longer ago than the
    // stall budget: they may go.
    let Attachment { stream: a, .. } = s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
    assert!(s.push_events(a, &mut numbered(0, 3, 0), None));
    let Attachment {
        stream: b,
        generation: gb,
        ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
    assert!(s.push_events(b, &mut numbered(3, 6, 0), None));
    s.detach(b, gb);
    tokio::time::advance(Duration::from_secs(2)).await;
    // The window is full: room comes from behind the front, one eviction an event.
    assert!(s.push_events(b, &mut numbered(6, 8, 0), None));
    assert_eq!(s.metrics.window_evictions.get(), 2);
    // More than the window holds behind them: stream b's own go, oldest first.
    assert!(s.push_events(b, &mut numbered(8, 12, 0), None));
    assert_eq!(s.metrics.window_evictions.get(), 6);
    // Stream a's events are all still there for its client.
    let ga = current_generation(&s, a);
    assert_eq!(ns(&text(step(&s, a, ga))), vec![0, 1, 2]);
}

/// The body [`Session::open_whole`] makes, and what the usual steps make of the same answer
/// in another session (open, push, end, then the client's polls and its detach), with that
/// session's epoch written as the first's so both bodies can be compared byte for byte.
fn whole_and_stepped(
    requests: &[&str],
    answer: impl Fn() -> VecDeque<Event>,
    end: End,
) -> ((Session, Whole), String) {
    let open = || {
        let mut o = OpenStream::new(
            StreamKind::Post,
            requests.iter().map(|r| r.to_string()).collect(),
        );
        o.prime = true;
        o
    };
    let a = session(cfg(|_| {}));
    let whole = a.open_whole(open(), &mut answer(), None, end.clone());
    let b = session(cfg(|_| {}));
    let Attachment {
        stream,
        generation,
        opening,
    } = b.open_stream(open());
    assert!(b.push_events(stream, &mut answer(), None));
    b.end_stream(stream, end);
    let mut stepped = opening.unwrap().to_vec();
    stepped.extend(drain_client(&b, stream, generation));
    b.detach(stream, generation);
    let epoch =
        |s: &Session| String::from_utf8(crate::cursor::epoch_hex(s.epoch).to_vec()).unwrap();
    let stepped = String::from_utf8(stepped)
        .unwrap()
        .replace(&epoch(&b), &epoch(&a));
    ((a, whole), stepped)
}

#[test]
fn an_answer_served_whole_is_what_the_steps_make_and_stays_resumable() {
    let ((s, whole), stepped) = whole_and_stepped(&[], || numbered(0, 3, 0), End::Complete);
    let Whole::Served {
        body,
        events,
        outcome,
    } = whole
    else {
        panic!("served whole: {whole:?}")
    };
    assert_eq!((events, outcome), (3, Outcome::Completed));
    let t = String::from_utf8(body.to_vec()).unwrap();
    assert_eq!(t, stepped);
    assert_eq!(ns(&t), vec![0, 1, 2]);
    // Its client is detached as at the end of any body, and the stream is kept: a client
    // cut after the first event resumes from it.
    assert_eq!(s.attached_clients(), 0);
    assert_eq!(
        s.metrics.streams_attached.get(),
        s.metrics.streams_detached.get()
    );
    let first = t
        .lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .nth(1)
        .expect("the first event's id, after the priming event's");
    let Ok(Resume::Attached { attachment, replay }) =
        s.resume(Cursor::parse(first.as_bytes()).unwrap(), None)
    else {
        panic!("resumed")
    };
    assert_eq!(replay, 2);
    let rest = drain_client(&s, attachment.stream, attachment.generation);
    assert_eq!(ns(&String::from_utf8(rest).unwrap()), vec![1, 2]);
}

#[test]
fn an_answer_served_whole_ends_as_the_steps_end_it() {
    // A request left unanswered, and an upstream that failed: the same explicit end.
    let ((_, whole), stepped) = whole_and_stepped(
        &["7"],
        || numbered(0, 1, 0),
        End::Failed(UpstreamFailure::Connection("reset".into())),
    );
    let Whole::Served { body, outcome, .. } = whole else {
        panic!("served whole: {whole:?}")
    };
    assert_eq!(outcome, Outcome::UpstreamFailed);
    let t = String::from_utf8(body.to_vec()).unwrap();
    assert_eq!(t, stepped);
    assert!(t.contains("\"id\":7"), "{t}");
}

#[test]
fn an_answer_without_room_at_once_is_left_for_a_task_and_its_client_attached() {
    let s = session(cfg(|c| {
        c.window_events = 2;
        c.stall_timeout = Duration::ZERO;
    }));
    // Two events an attached client has not read fill the window: they must stay.
    let Attachment { stream: a, .. } = s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
    assert!(s.push_events(a, &mut numbered(0, 2, 0), None));
    let mut events = numbered(2, 4, 0);
    let whole = s.open_whole(
        OpenStream::new(StreamKind::Post, vec![]),
        &mut events,
        None,
        End::Complete,
    );
    let Whole::Attached { attachment, handed } = whole else {
        panic!("attached: {whole:?}")
    };
    assert_eq!(
        (handed, events.len()),
        (0, 2),
        "nothing taken, nothing lost"
    );
    // The client waits for them like any client of a running stream.
    assert!(matches!(
        step(&s, attachment.stream, attachment.generation),
        Step::Pending
    ));
    assert_eq!(s.attached_clients(), 2);
}

#[test]
fn an_answer_longer_than_one_frame_goes_on_as_an_attached_body() {
    let s = session(cfg(|c| c.window_bytes = 8 << 10));
    let big = padded(300 << 10);
    let whole = s.open_whole(
        OpenStream::new(StreamKind::Post, vec![]),
        &mut VecDeque::from([msg(r#"{"n":0}"#), big.clone()]),
        None,
        End::Complete,
    );
    let Whole::Attached { attachment, handed } = whole else {
        panic!("attached: {whole:?}")
    };
    assert_eq!(handed, 1, "the first event and pieces of the oversized one");
    let mut got = attachment.opening.expect("what was taken").to_vec();
    got.extend(drain_client(&s, attachment.stream, attachment.generation));
    let t = String::from_utf8(got).unwrap();
    assert_eq!(ns(&t), vec![0]);
    assert!(t.contains(&String::from_utf8(big.data_bytes().unwrap().to_vec()).unwrap()));
    assert_eq!(s.attached_clients(), 0, "its body ended");
}

/// Issue 46 item 3: what readers hold is counted from its first byte; past their part of the
/// budget, one reader (the mover) goes on and the others wait until it let go.
#[tokio::test(start_paused = true)]
async fn readers_take_more_only_with_room_and_one_always_moves() {
    let budget = Arc::new(Budget::new(1 << 20));
    let part = super::registry::transient_limit(1 << 20);
    let mut a = budget.charge();
    a.set(part - (32 << 10), 64 << 10);
    assert_eq!(
        budget.used(),
        part - (32 << 10),
        "counted from the first byte"
    );
    assert_eq!(budget.transient(), budget.used());
    let (mut b, mut c) = (budget.charge(), budget.charge());
    // No room for b's next batch within the readers' part: b becomes the mover.
    tokio::time::timeout(Duration::from_millis(1), b.room_for(64 << 10))
        .await
        .expect("the first to find no room moves");
    b.set(200 << 10, 64 << 10);
    // c finds neither room nor the mover's place.
    assert!(
        tokio::time::timeout(Duration::from_secs(5), c.room_for(64 << 10))
            .await
            .is_err(),
        "waits while b moves"
    );
    // b's event went into its session: b lets go, and c moves.
    b.set(0, 64 << 10);
    tokio::time::timeout(Duration::from_millis(100), c.room_for(64 << 10))
        .await
        .expect("the mover let go");
    drop((a, b, c));
    assert_eq!(budget.used(), 0, "every charge is given back");
}

// State's rules, called directly: no runtime, no lock, and time is whatever `now` they are
// given (no paused clock needed).

fn state(f: impl FnOnce(&mut Config)) -> State {
    let c = cfg(f);
    State::new(Consts::new(&c, 7), Principal::default(), Instant::now())
}

fn books<'a>(metrics: &'a Metrics, budget: &'a Budget) -> Books<'a> {
    Books { metrics, budget }
}

#[test]
fn state_refuses_an_id_in_flight_for_another_and_holds_it_for_its_own() {
    let mut st = state(|_| {});
    let (owner, other) = (Principal([1; 16]), Principal([2; 16]));
    st.set_principal(owner);
    let five = vec!["5".to_owned()];
    assert_eq!(st.begin_forward(owner, &five), Ok(()));
    assert_eq!(st.begin_forward(owner, &five), Err(InFlight::Own));
    assert_eq!(st.begin_forward(other, &five), Err(InFlight::Another));
    assert!(st.forwarding(owner, &five));
    // Rebinding the session takes the owner's ids in flight with it.
    let renewed = Principal([3; 16]);
    st.set_principal(renewed);
    assert_eq!(st.principal, renewed);
    assert!(!st.forwarding(owner, &five));
    assert_eq!(st.begin_forward(renewed, &five), Err(InFlight::Own));
    st.settle_forward(renewed, &five);
    assert!(!st.forwarding(renewed, &five));
    assert_eq!(
        st.begin_forward(other, &five),
        Ok(()),
        "settled, never carried"
    );
}

#[test]
fn state_may_resume_only_the_senders_call() {
    let (metrics, budget) = (Metrics::default(), Budget::new(usize::MAX));
    let mut st = state(|_| {});
    let now = Instant::now();
    let (owner, other) = (Principal([1; 16]), Principal([2; 16]));
    let mut open = OpenStream::new(StreamKind::Post, vec!["1".into()]);
    open.principal = owner;
    let call = st.open(books(&metrics, &budget), open, now).stream;
    let standalone = st
        .open(
            books(&metrics, &budget),
            OpenStream::new(StreamKind::Standalone, vec![]),
            now,
        )
        .stream;
    let at = |stream, epoch| Cursor {
        epoch,
        stream,
        seq: 1,
    };
    assert!(st.may_resume(&at(call, 7), owner));
    assert!(!st.may_resume(&at(call, 7), other), "the owner's call");
    assert!(st.may_resume(&at(standalone, 7), other), "the session's");
    assert!(
        st.may_resume(&at(call, 8), other),
        "left to resume to refuse"
    );
    assert!(st.may_resume(&at(99, 7), other), "left to resume to refuse");
    assert_eq!(
        st.resume(&metrics, at(call, 8), None, now).unwrap_err(),
        ResumeError::ForeignCursor
    );
    assert_eq!(
        st.resume(&metrics, at(99, 7), None, now).unwrap_err(),
        ResumeError::CursorAhead
    );
}

#[test]
fn state_pauses_the_reader_until_the_stall_timeout_then_evicts_into_a_gap() {
    let (metrics, budget) = (Metrics::default(), Budget::new(usize::MAX));
    let mut st = state(|c| c.window_events = 2);
    let stall = st.consts.stall;
    let t0 = Instant::now();
    let opened = st.open(
        books(&metrics, &budget),
        OpenStream::new(StreamKind::Post, vec![]),
        t0,
    );
    let (stream, generation) = (opened.stream, opened.generation);
    st.quiet = true;
    let mut events = numbered(0, 3, 0);
    let reader = Waker::noop();
    assert!(
        !st.push(
            books(&metrics, &budget),
            stream,
            &mut events,
            Some(reader),
            None,
            t0
        ),
        "the client still needs both retained events"
    );
    assert_eq!(events.len(), 1);
    assert_eq!(st.paused, vec![stream]);
    assert!(!st.quiet, "a paused reader stirs the session");
    st.detach(&metrics, stream, generation, t0);
    let half = t0 + stall / 2;
    assert!(
        !st.push(
            books(&metrics, &budget),
            stream,
            &mut events,
            Some(reader),
            None,
            half
        ),
        "a client that left is guarded for the stall timeout"
    );
    let later = t0 + stall;
    assert!(st.push(
        books(&metrics, &budget),
        stream,
        &mut events,
        Some(reader),
        None,
        later
    ));
    assert!(events.is_empty());
    assert_eq!(metrics.window_evictions.get(), 1);
    assert_eq!(metrics.events_evicted_undelivered.get(), 1);
    let at = |seq| Cursor {
        epoch: 7,
        stream,
        seq,
    };
    assert_eq!(
        st.resume(&metrics, at(1), None, later).unwrap_err(),
        ResumeError::Gap
    );
    let Ok(Resume::Attached { replay, .. }) = st.resume(&metrics, at(2), None, later) else {
        panic!("the events after the evicted one are retained");
    };
    assert_eq!(replay, 2);
}

#[test]
fn state_sweep_detaches_a_stalled_client_then_finds_the_session_quiet() {
    let (metrics, budget) = (Metrics::default(), Budget::new(usize::MAX));
    let mut st = state(|_| {});
    let stall = st.consts.stall;
    let t0 = Instant::now();
    let opened = st.open(
        books(&metrics, &budget),
        OpenStream::new(StreamKind::Post, vec![]),
        t0,
    );
    let (stream, generation) = (opened.stream, opened.generation);
    assert!(st.push(
        books(&metrics, &budget),
        stream,
        &mut numbered(0, 1, 0),
        None,
        None,
        t0
    ));
    let swept = st.sweep(books(&metrics, &budget), t0);
    assert!(!swept.idle && !swept.quiet);
    let late = t0 + stall;
    st.sweep(books(&metrics, &budget), late);
    assert_eq!(metrics.slow_consumer_detaches.get(), 1);
    let step = st.step(&budget, stream, generation, Waker::noop(), late);
    assert!(
        matches!(step, Step::Finish(_, Outcome::SlowConsumer)),
        "{step:?}"
    );
    assert!(text(step).contains(EVENT_RESUMPTION_REQUIRED));
    let swept = st.sweep(books(&metrics, &budget), late);
    assert!(swept.idle && swept.quiet, "no client, no reader paused");
    assert_eq!(swept.since, late);
}

#[test]
fn each_event_is_published_once_in_order_and_the_end_with_what_it_left_unanswered() {
    let s = session(cfg(|_| {}));
    let mut open = OpenStream::new(StreamKind::Post, vec!["1".into(), "2".into()]);
    open.principal = Principal([4; 16]);
    let a = s.open_stream(open);
    let collect = |s: &Session| {
        let mut seen = Vec::new();
        let p = s.unpublished(a.stream, |seq, message, body| {
            seen.push((seq, message, String::from_utf8(body.to_vec()).unwrap()))
        });
        (p, seen)
    };
    // Opened: its facts go out once, with no event yet.
    let (p, seen) = collect(&s);
    let p = p.expect("the opening is published");
    assert!(p.opened && seen.is_empty() && p.end.is_none());
    assert_eq!(
        (p.prev, p.last, p.principal),
        (p.first_seq, p.first_seq, Principal([4; 16]))
    );
    assert_eq!(
        p.requests,
        vec![("1".to_owned(), None), ("2".to_owned(), None)]
    );
    assert_eq!(collect(&s).0, None, "nothing new");
    let mut events: VecDeque<Event> = [
        msg(r#"{"jsonrpc":"2.0","method":"notifications/progress"}"#),
        msg(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#),
    ]
    .into();
    assert!(s.push_events(a.stream, &mut events, None));
    let (p, seen) = collect(&s);
    let p = p.unwrap();
    assert!(!p.opened && p.answered);
    assert_eq!(seen.len(), 2);
    assert_eq!(
        p.requests[0],
        ("1".to_owned(), Some(seen[1].0)),
        "answered there"
    );
    assert_eq!(p.prev, p.first_seq, "it follows the opening");
    assert_eq!(p.last, seen[1].0);
    assert!(seen[0].0 < seen[1].0 && seen.iter().all(|e| e.1));
    assert!(seen[1].2.contains("\"id\":1"));
    let before = p.last;
    s.end_stream(a.stream, End::Complete);
    let (p, seen) = collect(&s);
    let p = p.unwrap();
    assert!(seen.is_empty());
    assert_eq!((p.prev, p.last), (before, before));
    assert_eq!(p.end, Some(End::Complete));
    assert_eq!(
        p.requests[1],
        ("2".to_owned(), None),
        "2 was never answered"
    );
    assert!(!p.answered);
    assert_eq!(collect(&s).0, None, "the end is published once");
}

#[test]
fn events_lost_before_they_were_published_break_the_chain() {
    // A window of two events: four pushed at once, the first two evicted before publication.
    let s = session(cfg(|c| {
        c.window_events = 2;
        c.stall_timeout = Duration::ZERO;
    }));
    let a = s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
    let _ = s.unpublished(a.stream, |_, _, _| {});
    s.detach(a.stream, a.generation);
    let mut events: VecDeque<Event> = (0..4).map(|i| msg(&format!("{{\"n\":{i}}}"))).collect();
    let _ = s.push_events(a.stream, &mut events, None);
    let mut seen = Vec::new();
    let p = s.unpublished(a.stream, |seq, _, _| seen.push(seq)).unwrap();
    assert!(!seen.is_empty());
    assert!(p.prev > p.first_seq, "the chain names the hole: {p:?}");
    assert!(seen.iter().all(|&q| q > p.prev));
}

#[test]
fn an_adopted_session_keeps_its_epoch_and_numbers_streams_from_its_block() {
    let s = Session::new(
        "a".into(),
        cfg(|_| {}),
        Arc::default(),
        Arc::new(Budget::new(usize::MAX)),
        Owner::new(Principal::default(), "/mcp").adopted(0xfeed, 65536),
        false,
    );
    assert_eq!(s.epoch(), 0xfeed);
    let a = s.open_stream(OpenStream::new(StreamKind::Post, vec![]));
    assert_eq!(a.stream, 65536);
    assert!(s.holds_stream(65536) && !s.holds_stream(0));
}

#[test]
fn a_client_following_on_another_replica_guards_what_it_has_not_read_while_it_progresses() {
    let mut st = state(|c| c.stall_timeout = Duration::from_millis(300));
    let (metrics, budget) = (Metrics::default(), Budget::new(usize::MAX));
    let now = Instant::now();
    let opened = st.open(
        books(&metrics, &budget),
        OpenStream::new(StreamKind::Post, vec![]),
        now,
    );
    let stream = opened.stream;
    st.detach(&metrics, stream, opened.generation, now);
    let later = now + Duration::from_secs(5);
    let s = st.streams.get(&stream).unwrap();
    let first = s.first_seq;
    assert!(
        !s.needs(first + 1, later, st.consts.stall),
        "its local client's guard ran out"
    );
    assert!(st.remote_progress(stream, first + 3, later));
    let s = st.streams.get(&stream).unwrap();
    assert!(
        s.needs(first + 4, later, st.consts.stall),
        "after the follower's position"
    );
    assert!(!s.needs(first + 3, later, st.consts.stall), "what it has");
    let stale = later + Duration::from_millis(300);
    assert!(
        !s.needs(first + 4, stale, st.consts.stall),
        "a follower that made no progress for the stall budget lets go"
    );
    // Progress refreshes it; an older report does not move it back.
    assert!(st.remote_progress(stream, first + 6, stale));
    assert!(st.remote_progress(stream, first + 2, stale));
    let s = st.streams.get(&stream).unwrap();
    assert!(s.needs(first + 7, stale, st.consts.stall));
    assert!(!s.needs(first + 6, stale, st.consts.stall));
    assert!(!st.remote_progress(stream + 1, 0, stale), "no such stream");
}

/// A client whose connection died with its stream's end frames unread (the upstream failed
/// as the client's connection was reset) comes back at its last event and is told again; one
/// that read them holds the end's position, and has everything.
#[test]
fn a_streams_end_is_told_again_before_its_position_and_not_at_it() {
    let s = session(cfg(|_| {}));
    let Attachment {
        stream,
        generation: g,
        ..
    } = s.open_stream(OpenStream::new(StreamKind::Post, vec!["7".into()]));
    s.push_events(stream, &mut numbered(0, 2, 0), None);
    let seen = drain_client(&s, stream, g);
    let ids = |b: &[u8]| -> Vec<String> {
        String::from_utf8(b.to_vec())
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("id: ").map(str::to_owned))
            .collect()
    };
    let last = Cursor::parse(ids(&seen).last().unwrap().as_bytes()).unwrap();
    s.end_stream(
        stream,
        End::Failed(UpstreamFailure::Connection("reset".into())),
    );
    let end = drain_client(&s, stream, g);
    let end_text = String::from_utf8(end.clone()).unwrap();
    assert_eq!(ids(&end), vec![last.end().text()], "{end_text}");
    assert!(end_text.contains("\"id\":7"), "{end_text}");
    // Back at its last event: nothing to replay, the end again, at the same position.
    let Ok(Resume::Attached { attachment, replay }) = s.resume(last, None) else {
        panic!("resumed")
    };
    assert_eq!(replay, 0);
    let opening = String::from_utf8(attachment.opening.clone().unwrap().to_vec()).unwrap();
    assert!(opening.contains(EVENT_RESUMED), "{opening}");
    let again =
        String::from_utf8(drain_client(&s, attachment.stream, attachment.generation)).unwrap();
    assert_eq!(again, end_text);
    // Back before its last event: that event, then the end.
    let first = Cursor::parse(ids(&seen)[0].as_bytes()).unwrap();
    let Ok(Resume::Attached { attachment, replay }) = s.resume(first, None) else {
        panic!("resumed")
    };
    assert_eq!(replay, 1);
    let again =
        String::from_utf8(drain_client(&s, attachment.stream, attachment.generation)).unwrap();
    assert_eq!(ns(&again), vec![1]);
    assert!(again.ends_with(&end_text), "{again}");
    // At the end's position: it read them, nothing more will come.
    assert_eq!(
        s.resume(last.end(), None).unwrap_err(),
        ResumeError::StreamEnded
    );
}
