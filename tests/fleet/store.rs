//! A fleet shares its sessions through a real `redis-server` (issue 48): real gateway
//! binaries with `--store`, in front of the scriptable mock upstream, on 127.0.0.1 only.
//!
//! - A session created through one replica is adopted by another for its creator's requests,
//!   with the epoch it was created with, and by nobody else.
//! - A call read upstream by one replica and cut is resumed on another: the resumed event at
//!   the cursor, exactly the events after it, the live tail and the result, once each.
//! - A stranger gets nothing from the store: not the session, not the call.
//! - `--store` without its key file, or with a short one, does not start.
//!
//! Without `redis-server` the tests say so on stderr and pass, unless `CI_REQUIRE_REDIS` is set
//! (`.ci/run` sets it and installs the Debian package).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::*;

const ALICE: &str = "Bearer alice";
const BOB: &str = "Bearer bob";

async fn replica(mock: &Mock, redis: &Redis, key: &std::path::Path) -> Binary {
    replica_with(mock, redis, key, &["--hold-standalone", "false"]).await
}

async fn replica_with(mock: &Mock, redis: &Redis, key: &std::path::Path, extra: &[&str]) -> Binary {
    let mut flags = vec![
        "--store",
        &redis.url,
        "--store-key-file",
        key.to_str().unwrap(),
    ];
    flags.extend_from_slice(extra);
    Binary::start(mock.addr, &flags).await
}

/// A fleet of two replicas, A and B, with the default test flags on a real `redis-server`
/// named `case`, in front of one mock upstream, and the fleet's key file; `None` without
/// `redis-server` (the test says so and passes, unless `CI_REQUIRE_REDIS` is set).
async fn two_replicas(case: &str) -> Option<(Redis, std::path::PathBuf, Mock, Binary, Binary)> {
    let redis = Redis::start(case).await?;
    let key = key_file(case, 32);
    let mock = Mock::start().await;
    let a = replica(&mock, &redis, &key).await;
    let b = replica(&mock, &redis, &key).await;
    Some((redis, key, mock, a, b))
}

fn as_(principal: &str, mut req: Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    req.headers_mut()
        .insert("authorization", principal.parse().unwrap());
    req
}

async fn metric(b: &Binary, series: &str) -> f64 {
    let text = b.admin_get("/metrics").await.expect("metrics");
    metric_sum(&text, series).unwrap_or(0.0)
}

/// Creates session `sid` through `gw` (the mock answers `initialize` with it), for ALICE.
async fn initialize(gw: &Binary, mock: &mut Mock, sid: &str) {
    let pending = tokio::spawn(send(gw.addr, as_(ALICE, post(INITIALIZE, None))));
    mock.next().await.respond_initialized(sid);
    assert_eq!(pending.await.unwrap().status(), 200);
}

/// A session ALICE creates through `gw` in front of a stateless upstream (the mock answers
/// `initialize` without a session): the gateway mints its id. Returns it.
async fn minted(gw: &Binary, mock: &mut Mock) -> String {
    let pending = tokio::spawn(send(gw.addr, as_(ALICE, post(INITIALIZE, None))));
    mock.next().await.respond_json(
        r#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-06-18","capabilities":{},"serverInfo":{"name":"mock","version":"0"}}}"#,
    );
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    let sid = resp.headers()["mcp-session-id"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(sid.starts_with("mra-"), "{sid}");
    sid
}

/// ALICE's call `id` through `gw`: the upstream's stream (returned, still open) sends its first
/// progress event, the client reads it and is cut. Returns the client's cursor.
async fn cut_after_first(gw: &Binary, mock: &mut Mock, sid: &str, id: u64) -> (String, SseWriter) {
    let pending = tokio::spawn(send(gw.addr, as_(ALICE, post(&call(id), Some(sid)))));
    let upstream = mock.next().await.respond_sse(Some(sid));
    let mut reader = SseReader::new(pending.await.unwrap());
    upstream.message(&progress(1)).await;
    let mut first = reader.next().await.unwrap();
    while first.data.is_none() {
        first = reader.next().await.unwrap();
    }
    (first.id.unwrap(), upstream)
}

/// A connection of the test's own to the store.
async fn store_conn(redis: &Redis) -> ::redis::aio::MultiplexedConnection {
    ::redis::Client::open(redis.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Every byte string in a Redis reply, concatenated.
fn flatten(v: &::redis::Value, out: &mut Vec<u8>) {
    match v {
        ::redis::Value::BulkString(b) => out.extend_from_slice(b),
        ::redis::Value::Array(items) => items.iter().for_each(|i| flatten(i, out)),
        _ => {}
    }
}

/// The epoch part of a gateway cursor (`<epoch>.<stream>.<seq>`).
fn epoch(id: &str) -> &str {
    id.split('.').next().unwrap()
}

fn stream(id: &str) -> u32 {
    id.split('.').nth(1).unwrap().parse().unwrap()
}

#[tokio::test]
async fn a_call_cut_on_one_replica_is_resumed_on_another_for_its_caller_only() {
    let Some(redis) = Redis::start("resume").await else {
        return;
    };
    let key = key_file("resume", 32);
    let mut mock = Mock::start().await;
    let (a, b, c) = (
        replica(&mock, &redis, &key).await,
        replica(&mock, &redis, &key).await,
        replica(&mock, &redis, &key).await,
    );
    const SID: &str = "fleet-session";

    // Created through A (the creator's first stream is numbered in A's block: 0…).
    initialize(&a, &mut mock, SID).await;

    // A call through B: B never saw the session and adopts it for its creator.
    let pending = tokio::spawn(send(b.addr, as_(ALICE, post(&call(1), Some(SID)))));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["id"], 1);
    assert_eq!(
        seen.headers["mcp-session-id"], SID,
        "B forwards the upstream's id"
    );
    let upstream = seen.respond_sse(Some(SID));
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut on_b = SseReader::new(resp);
    assert_eq!(metric(&b, "mcp_reattach_store_adoptions_total").await, 1.0);
    upstream.message(&progress(1)).await;
    let mut first = on_b.next().await.unwrap();
    while first
        .data
        .as_deref()
        .is_none_or(|d| !d.contains("progress"))
    {
        first = on_b.next().await.unwrap();
    }
    let cursor = first.id.clone().expect("a gateway id");
    assert!(
        stream(&cursor) >= 1 << 16,
        "B numbers from a block of its own: {cursor}"
    );
    // The client is cut; the call goes on upstream.
    drop(on_b);
    for i in 2..=4 {
        upstream.message(&progress(i)).await;
    }
    upstream.message(&result(1)).await;
    drop(upstream);

    // A stranger on A or C gets exactly what an unknown session gets.
    for gw in [&a, &c] {
        let resp = send(gw.addr, as_(BOB, get(SID, Some(&cursor)))).await;
        assert_eq!(resp.status(), 404, "a stranger gets nothing");
    }
    assert_eq!(metric(&c, "mcp_reattach_store_adoptions_total").await, 0.0);

    // The caller resumes on A, which does not read the call: served from the store.
    let resp = send(a.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 200);
    let events = SseReader::new(resp).rest().await;
    let resumed = &events[0];
    assert_eq!(resumed.event.as_deref(), Some("mcp-reattach/resumed"));
    assert_eq!(resumed.id.as_deref(), Some(cursor.as_str()));
    let rest: Vec<&Event> = events[1..].iter().collect();
    let data: Vec<String> = rest.iter().filter_map(|e| e.data.clone()).collect();
    assert_eq!(
        data,
        vec![progress(2), progress(3), progress(4), result(1)],
        "exactly the events after the cursor, once each, then the end"
    );
    let ids: Vec<&str> = rest.iter().filter_map(|e| e.id.as_deref()).collect();
    assert_eq!(ids.len(), 4);
    assert!(ids
        .iter()
        .all(|id| epoch(id) == epoch(&cursor) && stream(id) == stream(&cursor)));
    assert!(metric(&a, "mcp_reattach_store_follows_total").await >= 1.0);
    assert_eq!(
        metric(&a, "mcp_reattach_store_adoptions_total").await,
        0.0,
        "A created it"
    );

    // Resumed again from the middle on C (which adopts the session now): the same events.
    let middle = ids[1];
    let resp = send(c.addr, as_(ALICE, get(SID, Some(middle)))).await;
    assert_eq!(resp.status(), 200);
    let events = SseReader::new(resp).rest().await;
    let data: Vec<String> = events
        .iter()
        .skip(1)
        .filter_map(|e| e.data.clone())
        .collect();
    assert_eq!(data, vec![progress(4), result(1)]);
}

#[tokio::test]
async fn the_live_tail_of_another_replicas_call_follows_as_it_is_read() {
    let Some(redis) = Redis::start("tail").await else {
        return;
    };
    let key = key_file("tail", 40);
    let mut mock = Mock::start().await;
    let (a, b) = (
        replica(&mock, &redis, &key).await,
        replica(&mock, &redis, &key).await,
    );
    const SID: &str = "tail-session";
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 7).await;
    // Resumed on B while the call runs on A: B follows the tail as A publishes it.
    let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 200);
    let mut on_b = SseReader::new(resp);
    assert_eq!(
        on_b.next().await.unwrap().event.as_deref(),
        Some("mcp-reattach/resumed")
    );
    for i in 2..=3 {
        upstream.message(&progress(i)).await;
        let e = on_b.next().await.unwrap();
        assert_eq!(e.data, Some(progress(i)), "the tail, in order");
    }
    upstream.message(&result(7)).await;
    drop(upstream);
    let rest = on_b.rest().await;
    let data: Vec<String> = rest.iter().filter_map(|e| e.data.clone()).collect();
    assert_eq!(data, vec![result(7)]);
    assert!(on_b.ended);
}

#[tokio::test]
async fn a_store_that_lost_a_calls_events_answers_the_explicit_gap() {
    let Some((redis, _key, mut mock, a, b)) = two_replicas("gap").await else {
        return;
    };
    const SID: &str = "gap-session";
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 3).await;
    upstream.message(&progress(2)).await;
    upstream.message(&result(3)).await;
    drop(upstream);
    // The store loses the call's events (a flush, an eviction by a misconfigured policy).
    let mut conn = store_conn(&redis).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let keys = loop {
        let keys: Vec<String> = ::redis::cmd("KEYS")
            .arg("mra:*:ev:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        let meta: Vec<String> = ::redis::cmd("KEYS")
            .arg(format!("mra:*:m:{}", stream(&cursor)))
            .query_async(&mut conn)
            .await
            .unwrap();
        let ended: Option<String> = match meta.first() {
            Some(k) => ::redis::cmd("GET")
                .arg(k)
                .query_async(&mut conn)
                .await
                .unwrap(),
            None => None,
        };
        if !keys.is_empty() && ended.is_some_and(|m| m.contains("\"end\"")) {
            break keys;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the call reached the store"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The writer's pipeline is not atomic: the meta's end can be seen before the same
    // pipeline's last events are added, which would bring the key back after a DEL. Deleted
    // until none comes back.
    let mut keys = keys;
    for _ in 0..20 {
        let _: () = ::redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        keys = ::redis::cmd("KEYS")
            .arg("mra:*:ev:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        if keys.is_empty() {
            break;
        }
    }
    assert!(keys.is_empty(), "the call's events stay deleted: {keys:?}");
    // Resumed on B: not a silent nothing, the explicit gap, with the call's error, as the
    // owner answers a gap (issue 56 finding 12: one rule): its frames are the whole body.
    let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 200);
    let events = SseReader::new(resp).rest().await;
    let kinds: Vec<Option<&str>> = events.iter().map(|e| e.event.as_deref()).collect();
    assert_eq!(
        kinds[0],
        Some("mcp-reattach/resumption-failed"),
        "the gap is said: {events:?}"
    );
    assert_eq!(
        events[0].id.as_deref(),
        Some(cursor.as_str()),
        "at the cursor"
    );
    let error = events
        .iter()
        .filter_map(|e| e.data.as_deref())
        .find(|d| d.contains("\"error\""))
        .expect("a JSON-RPC error for the call");
    assert!(error.contains("\"id\":3"), "{error}");
    assert!(
        events
            .iter()
            .all(|e| e.data.as_deref() != Some(result(3).as_str())),
        "nothing the store does not have"
    );
    assert_eq!(
        metric(&b, "mcp_reattach_store_follow_gaps_total").await,
        1.0
    );
}

#[tokio::test]
async fn a_retransmission_on_another_replica_is_a_resume_never_a_second_run() {
    let Some((_redis, _key, mut mock, a, b)) = two_replicas("retransmission").await else {
        return;
    };
    const SID: &str = "retransmitted-session";
    initialize(&a, &mut mock, SID).await;

    // The call reaches the upstream through A, which has not answered yet.
    let first = tokio::spawn(send(a.addr, as_(ALICE, post(&call(5), Some(SID)))));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["id"], 5);
    // The client gives up on A and sends it again; it lands on B, while A still waits.
    let again = tokio::spawn(send(b.addr, as_(ALICE, post(&call(5), Some(SID)))));
    assert!(
        mock.nothing_within(Duration::from_millis(300)).await,
        "B does not forward a request A forwards"
    );
    let upstream = seen.respond_sse(Some(SID));
    upstream.message(&progress(1)).await;
    drop(first.await.unwrap());
    let resp = again.await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut on_b = SseReader::new(resp);
    let resumed = on_b.next().await.unwrap();
    assert_eq!(resumed.event.as_deref(), Some("mcp-reattach/resumed"));
    let e = on_b.next().await.unwrap();
    assert_eq!(e.data, Some(progress(1)), "from the call's first event");
    upstream.message(&result(5)).await;
    drop(upstream);
    let data: Vec<String> = on_b
        .rest()
        .await
        .into_iter()
        .filter_map(|e| e.data)
        .collect();
    assert_eq!(data, vec![result(5)]);

    // Sent once more after it ended, to either replica: answered from its stream again.
    for gw in [&a, &b] {
        let resp = send(gw.addr, as_(ALICE, post(&call(5), Some(SID)))).await;
        assert_eq!(resp.status(), 200);
        let data: Vec<String> = SseReader::new(resp)
            .rest()
            .await
            .into_iter()
            .filter(|e| {
                e.event
                    .as_deref()
                    .is_none_or(|t| !t.starts_with("mcp-reattach/"))
            })
            .filter_map(|e| e.data)
            .collect();
        assert_eq!(data, vec![progress(1), result(5)]);
    }
    assert!(
        mock.nothing_within(Duration::from_millis(200)).await,
        "the tool ran once"
    );
}

#[tokio::test]
async fn a_call_whose_replica_died_ends_explicitly_and_the_session_goes_on() {
    let Some(redis) = Redis::start("crash").await else {
        return;
    };
    let key = key_file("crash", 32);
    let mut mock = Mock::start().await;
    let (mut a, b) = (
        replica(&mock, &redis, &key).await,
        replica(&mock, &redis, &key).await,
    );
    const SID: &str = "crash-session";
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 4).await;
    // What A read is in the store (its writer sends within a few milliseconds)...
    let mut conn = store_conn(&redis).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let keys: Vec<String> = ::redis::cmd("KEYS")
            .arg(format!("mra:*:ev:{}", stream(&cursor)))
            .query_async(&mut conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the call reached the store"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // ...then A dies mid-call (SIGKILL: no drain, no goodbye); its client comes back on B.
    a.proc.kill();
    let started = tokio::time::Instant::now();
    let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 200);
    let events = SseReader::new(resp).rest().await;
    let took = started.elapsed();
    let failed = events
        .iter()
        .find(|e| e.event.as_deref() == Some("mcp-reattach/upstream-failed"))
        .unwrap_or_else(|| panic!("the explicit failure: {events:?}"));
    assert!(
        failed.data.as_deref().unwrap().contains("owner-lost"),
        "{failed:?}"
    );
    let error = events
        .iter()
        .filter_map(|e| e.data.as_deref())
        .find(|d| d.contains("\"error\""))
        .expect("the call's error");
    assert!(error.contains("\"id\":4"), "{error}");
    assert!(took < Duration::from_secs(5), "within the bound: {took:?}");
    println!("owner lost: the resume on another replica ended explicitly after {took:?}");
    assert_eq!(
        metric(&b, "mcp_reattach_store_owners_lost_total").await,
        1.0
    );
    // The failure stands at the stream end's own position: a client that read it and comes
    // back anyway (the TypeScript SDK resumes any stream that ends without a result) is told
    // it has everything, not the failure again (which it would take as a stream to resume,
    // forever).
    let end = failed.id.clone().expect("the failure event carries an id");
    assert!(end.ends_with(".18446744073709551615"), "{end}");
    let resp = send(b.addr, as_(ALICE, get(SID, Some(&end)))).await;
    assert_eq!(resp.status(), 409);
    assert_eq!(
        body_json(resp).await["error"]["data"]["reason"],
        "stream-ended"
    );
    drop(upstream);
    // The session goes on: its next call works on B.
    let pending = tokio::spawn(send(b.addr, as_(ALICE, post(&call(9), Some(SID)))));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["id"], 9);
    let upstream = seen.respond_sse(Some(SID));
    upstream.message(&result(9)).await;
    drop(upstream);
    let data: Vec<String> = SseReader::new(pending.await.unwrap())
        .rest()
        .await
        .into_iter()
        .filter_map(|e| e.data)
        .filter(|d| d.contains("\"id\":9"))
        .collect();
    assert_eq!(data, vec![result(9)]);
}

#[tokio::test]
async fn a_drained_replica_hands_its_call_over_every_event_once() {
    let Some(redis) = Redis::start("drain").await else {
        return;
    };
    let key = key_file("drain", 32);
    let mut mock = Mock::start().await;
    let drain = [
        "--drain-delay",
        "0s",
        "--drain-timeout",
        "300ms",
        "--hold-standalone",
        "false",
    ];
    let mut a = replica_with(&mock, &redis, &key, &drain).await;
    let b = replica(&mock, &redis, &key).await;
    const SID: &str = "drain-session";
    initialize(&a, &mut mock, SID).await;
    let pending = tokio::spawn(send(a.addr, as_(ALICE, post(&call(6), Some(SID)))));
    let upstream = mock.next().await.respond_sse(Some(SID));
    let mut on_a = SseReader::new(pending.await.unwrap());
    upstream.message(&progress(1)).await;
    // A is drained mid-call: its client is told to resume, the call goes on upstream.
    a.proc.sigterm();
    let mut seen_on_a = Vec::new();
    let mut last_id = None;
    let mut told = None;
    while let Some(e) = on_a.next().await {
        if e.event.as_deref() == Some("mcp-reattach/resumption-required") {
            told = Some(e.clone());
        } else if e.data.is_some() {
            seen_on_a.extend(e.data.clone());
        }
        last_id = e.id.clone().or(last_id);
    }
    let told = told.expect("the drain tells the client to resume");
    assert!(told.data.unwrap().contains("shutdown"));
    let cursor = last_id.unwrap();
    for i in 2..=4 {
        upstream.message(&progress(i)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The client comes back on B while A still reads the call into the store.
    let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 200);
    let mut on_b = SseReader::new(resp);
    assert_eq!(
        on_b.next().await.unwrap().event.as_deref(),
        Some("mcp-reattach/resumed")
    );
    assert!(
        a.proc.wait_exit(Duration::from_millis(200)).await.is_none(),
        "A goes on reading its call after its drain"
    );
    upstream.message(&result(6)).await;
    drop(upstream);
    let mut all: Vec<String> = seen_on_a
        .into_iter()
        .filter(|d| !d.contains("\"reason\""))
        .collect();
    all.extend(on_b.rest().await.into_iter().filter_map(|e| e.data));
    assert_eq!(
        all,
        vec![
            progress(1),
            progress(2),
            progress(3),
            progress(4),
            result(6)
        ],
        "every event once across the hand-over"
    );
    let status = a
        .proc
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("A exits once its call ended");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn a_store_outage_costs_the_fleet_not_the_sessions_a_replica_holds() {
    let Some((mut redis, _key, mut mock, a, b)) = two_replicas("outage").await else {
        return;
    };
    const SID: &str = "outage-session";
    const LATE: &str = "created-during-the-outage";
    initialize(&a, &mut mock, SID).await;

    redis.stop().await;
    // The store is gone: A serves what it holds, at its usual pace, and creates sessions.
    let started = tokio::time::Instant::now();
    for id in 10..15 {
        let pending = tokio::spawn(send(a.addr, as_(ALICE, post(&call(id), Some(SID)))));
        let upstream = mock.next().await.respond_sse(Some(SID));
        upstream.message(&result(id)).await;
        drop(upstream);
        let data: Vec<String> = SseReader::new(pending.await.unwrap())
            .rest()
            .await
            .into_iter()
            .filter_map(|e| e.data)
            .filter(|d| d.contains("result"))
            .collect();
        assert_eq!(data, vec![result(id)], "a held session's call, served");
    }
    let pending = tokio::spawn(send(a.addr, as_(ALICE, post(INITIALIZE, None))));
    mock.next().await.respond_initialized(LATE);
    assert_eq!(pending.await.unwrap().status(), 200);
    let took = started.elapsed();
    println!("five calls and an initialize with the store down: {took:?}");
    assert!(
        took < Duration::from_secs(2),
        "no request waits on a dead store: {took:?}"
    );
    assert_eq!(metric(&a, "mcp_reattach_store_up").await, 0.0);

    // It comes back (empty): A's next request of each session records it again, after which
    // B adopts it for its creator.
    redis.restart().await;
    // A's requests go on; its breaker tries the store again within a second and finds it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut id = 20;
    loop {
        for sid in [SID, LATE] {
            // A new call each time (the same id again would be a retransmission).
            id += 1;
            let pending = tokio::spawn(send(a.addr, as_(ALICE, post(&call(id), Some(sid)))));
            let upstream = mock.next().await.respond_sse(Some(sid));
            upstream.message(&result(id)).await;
            drop(upstream);
            assert_eq!(pending.await.unwrap().status(), 200);
        }
        if metric(&a, "mcp_reattach_store_up").await == 1.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "A finds the store again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Each session's next request through A writes its record again (the late one was never
    // recorded; the other was lost with the store).
    for sid in [SID, LATE] {
        id += 1;
        let pending = tokio::spawn(send(a.addr, as_(ALICE, post(&call(id), Some(sid)))));
        let upstream = mock.next().await.respond_sse(Some(sid));
        upstream.message(&result(id)).await;
        drop(upstream);
        assert_eq!(pending.await.unwrap().status(), 200);
    }
    // A's writer sends them: B finds them shortly, one session after the other.
    for (n, sid) in [LATE, SID].into_iter().enumerate() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            id += 1;
            let pending = tokio::spawn(send(b.addr, as_(ALICE, post(&call(id), Some(sid)))));
            let upstream = mock.next().await.respond_sse(Some(sid));
            upstream.message(&result(id)).await;
            drop(upstream);
            assert_eq!(pending.await.unwrap().status(), 200);
            if metric(&b, "mcp_reattach_store_adoptions_total").await >= (n + 1) as f64 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "B adopts {sid} once A recorded it again"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Issue 50: a resume the store cannot answer for (down, or, in a reconnect storm, this
/// replica's requests to it queued too long) is paced, not refused: 503 + `Retry-After`, never
/// the 404 that ends a client's session nor a `stream-expired` that is not so. Whether the
/// replica never saw the session (its adoption unanswered) or holds it while another replica
/// reads the stream (the stream's read unanswered).
#[tokio::test]
async fn a_resume_the_store_cannot_answer_for_is_paced_not_refused() {
    let Some((mut redis, _key, mut mock, a, b)) = two_replicas("unanswered").await else {
        return;
    };
    const SID: &str = "unanswered-session";
    const OTHER: &str = "unanswered-other";
    initialize(&a, &mut mock, SID).await;
    initialize(&a, &mut mock, OTHER).await;
    // B adopts SID (a call through it); then a call of each session through A is cut.
    let pending = tokio::spawn(send(b.addr, as_(ALICE, post(&call(1), Some(SID)))));
    let upstream = mock.next().await.respond_sse(Some(SID));
    upstream.message(&result(1)).await;
    drop(upstream);
    assert_eq!(pending.await.unwrap().status(), 200);
    assert_eq!(metric(&b, "mcp_reattach_store_adoptions_total").await, 1.0);
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 2).await;
    let (other_cursor, other_upstream) = cut_after_first(&a, &mut mock, OTHER, 3).await;

    redis.stop().await;
    for (sid, cursor, what) in [
        (SID, &cursor, "B holds the session, A reads the stream"),
        (OTHER, &other_cursor, "B never saw the session"),
    ] {
        let resp = send(b.addr, as_(ALICE, get(sid, Some(cursor)))).await;
        assert_eq!(resp.status(), 503, "{what}");
        assert_eq!(resp.headers()["retry-after"], "1", "{what}");
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body["error"]["data"]["reason"], "store-unavailable",
            "{what}: {body}"
        );
    }
    assert_eq!(
        metric(
            &b,
            r#"mcp_reattach_requests_rejected_total{reason="store_unavailable"}"#
        )
        .await,
        2.0
    );
    // A reads both calls: it resumes them as ever.
    for (sid, cursor) in [(SID, &cursor), (OTHER, &other_cursor)] {
        let resp = send(a.addr, as_(ALICE, get(sid, Some(cursor)))).await;
        assert_eq!(resp.status(), 200);
        let mut reader = SseReader::new(resp);
        let first = reader.next().await.unwrap();
        assert_eq!(first.event.as_deref(), Some("mcp-reattach/resumed"));
    }
    drop((upstream, other_upstream));
}

#[tokio::test]
async fn a_live_get_on_another_replica_follows_the_standalone_stream_held_elsewhere() {
    let Some(redis) = Redis::start("standalone").await else {
        return;
    };
    let key = key_file("standalone", 32);
    let mut mock = Mock::start().await;
    let (a, b) = (
        replica_with(&mock, &redis, &key, &[]).await,
        replica_with(&mock, &redis, &key, &[]).await,
    );
    const SID: &str = "standalone-session";
    initialize(&a, &mut mock, SID).await;
    // Initialized through A: A holds the session's standalone GET upstream.
    let pending = tokio::spawn(send(
        a.addr,
        as_(
            ALICE,
            post(
                r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
                Some(SID),
            ),
        ),
    ));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["method"], "notifications/initialized");
    seen.respond(
        http::Response::builder()
            .status(202)
            .header("mcp-session-id", SID)
            .body(Full::new(Bytes::new()))
            .unwrap(),
    );
    let held = mock.next().await;
    assert_eq!(
        held.method,
        http::Method::GET,
        "A opens the standalone stream"
    );
    let standalone = held.respond_sse(Some(SID));
    assert_eq!(pending.await.unwrap().status(), 202);
    let note = |n: u64| {
        format!(r#"{{"jsonrpc":"2.0","method":"notifications/message","params":{{"n":{n}}}}}"#)
    };
    standalone.message(&note(1)).await;
    // The store names A's stream as held (A's writer sends it within a few milliseconds; a
    // GET on B before that would try to hold one of its own, which a stateful server refuses,
    // and then follow A's: tests/fleet/scale_out.rs's gateway tier covers that race).
    let mut conn = store_conn(&redis).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let recs: Vec<String> = ::redis::cmd("KEYS")
            .arg("mra:*:rec")
            .query_async(&mut conn)
            .await
            .unwrap();
        let hold: Option<String> = match recs.first() {
            Some(r) => ::redis::cmd("HGET")
                .arg(r)
                .arg("hold")
                .query_async(&mut conn)
                .await
                .unwrap(),
            None => None,
        };
        if hold.is_some() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hold reached the store"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The client's GET lands on B: B follows A's stream, it asks the upstream for none (a
    // stateful server would refuse a second one with 409).
    let resp = send(b.addr, as_(ALICE, get(SID, None))).await;
    assert_eq!(resp.status(), 200);
    let mut on_b = SseReader::new(resp);
    let mut data = Vec::new();
    while data.is_empty() {
        let e = on_b.next().await.unwrap();
        if e.event
            .as_deref()
            .is_none_or(|t| !t.starts_with("mcp-reattach/"))
        {
            data.extend(e.data);
        }
    }
    standalone.message(&note(2)).await;
    let e = on_b.next().await.unwrap();
    data.extend(e.data);
    assert_eq!(
        data,
        vec![note(1), note(2)],
        "what A's stream carries, live"
    );
    assert!(
        mock.nothing_within(Duration::from_millis(200)).await,
        "no second standalone GET upstream"
    );
}

#[tokio::test]
async fn sealed_events_are_nothing_in_the_store_and_whole_to_the_client() {
    let Some(redis) = Redis::start("seal").await else {
        return;
    };
    let key = key_file("seal", 32);
    let mut mock = Mock::start().await;
    let sealed = ["--store-seal", "true", "--hold-standalone", "false"];
    let (a, b) = (
        replica_with(&mock, &redis, &key, &sealed).await,
        replica_with(&mock, &redis, &key, &sealed).await,
    );
    // A replica of another fleet (another key) on the same store, and one that does not seal.
    let stranger_key = key_file("seal-other", 40);
    let c = replica_with(&mock, &redis, &key, &["--hold-standalone", "false"]).await;
    let d = replica_with(&mock, &redis, &stranger_key, &sealed).await;
    const SID: &str = "sealed-session";
    const SECRET: &str = "the-tool-result-nobody-may-read";
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 8).await;
    let answer = format!(
        r#"{{"jsonrpc":"2.0","id":8,"result":{{"content":[{{"type":"text","text":"{SECRET}"}}]}}}}"#
    );
    upstream.message(&answer).await;
    drop(upstream);
    // In the store: entries, and nowhere the result's text.
    let mut conn = store_conn(&redis).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let keys: Vec<String> = ::redis::cmd("KEYS")
            .arg("mra:*:ev:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut raw = Vec::new();
        for k in &keys {
            // The entries as stored: each field's bytes, flattened.
            let entries: ::redis::Value = ::redis::cmd("XRANGE")
                .arg(k)
                .arg("-")
                .arg("+")
                .query_async(&mut conn)
                .await
                .unwrap();
            flatten(&entries, &mut raw);
        }
        assert!(
            !raw.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "the result is sealed at rest"
        );
        // The call's stream (the initialize's answer was upgraded into a stream of its own).
        let call = format!(":ev:{}", stream(&cursor));
        let entries: usize = match keys.iter().find(|k| k.ends_with(&call)) {
            Some(k) => ::redis::cmd("XLEN")
                .arg(k)
                .query_async(&mut conn)
                .await
                .unwrap(),
            None => 0,
        };
        if entries >= 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the call reached the store"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Resumed on B (same key, sealing): whole.
    let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    let data: Vec<String> = SseReader::new(resp)
        .rest()
        .await
        .into_iter()
        .skip(1)
        .filter_map(|e| e.data)
        .collect();
    assert_eq!(data, vec![answer.clone()]);
    // On C, which does not open sealed entries: the explicit gap, not bytes it cannot read.
    let resp = send(c.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    let events = SseReader::new(resp).rest().await;
    assert!(
        events
            .iter()
            .any(|e| e.event.as_deref() == Some("mcp-reattach/resumption-failed")),
        "{events:?}"
    );
    assert!(events
        .iter()
        .all(|e| e.data.as_deref() != Some(answer.as_str())));
    // On D, of a fleet with another secret: the session is not even found.
    let resp = send(d.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 404);
}

/// Reads a client's stream of call `id` to its end: the data of its non-gateway events, its
/// last id, and whether it was told to resume.
async fn read_call(reader: &mut SseReader) -> (Vec<String>, Option<String>, bool) {
    let (mut data, mut last, mut told) = (Vec::new(), None, false);
    while let Some(e) = reader.next().await {
        last = e.id.clone().or(last);
        match e.event.as_deref() {
            Some("mcp-reattach/resumption-required") => told = true,
            Some(t) if t.starts_with("mcp-reattach/") => {}
            _ => data.extend(e.data.filter(|d| !d.is_empty())),
        }
    }
    (data, last, told)
}

#[tokio::test]
async fn a_fleet_replaced_one_replica_at_a_time_loses_no_call() {
    let Some(redis) = Redis::start("rolling").await else {
        return;
    };
    let key = key_file("rolling", 32);
    let mut mock = Mock::start().await;
    let flags = [
        "--drain-delay",
        "0s",
        "--drain-timeout",
        "300ms",
        "--hold-standalone",
        "false",
    ];
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(replica_with(&mock, &redis, &key, &flags).await);
    }
    const SID: &str = "rolling-session";
    initialize(&fleet[0], &mut mock, SID).await;
    let mut id = 100;
    for round in 0..3 {
        // A call in flight on the replica about to be replaced.
        id += 1;
        let old = fleet.remove(round);
        let pending = tokio::spawn(send(old.addr, as_(ALICE, post(&call(id), Some(SID)))));
        let upstream = mock.next().await.respond_sse(Some(SID));
        let mut on_old = SseReader::new(pending.await.unwrap());
        upstream.message(&progress(1)).await;
        // The rollout: the old replica is drained, a new one takes its place.
        old.proc.sigterm();
        let new = replica_with(&mock, &redis, &key, &flags).await;
        fleet.insert(round, new);
        upstream.message(&progress(2)).await;
        let (mut got, last, told) = read_call(&mut on_old).await;
        assert!(
            told,
            "round {round}: the drained replica's client is told to resume"
        );
        upstream.message(&progress(3)).await;
        // The session keeps calling on the others meanwhile.
        id += 1;
        let other = &fleet[(round + 1) % 3];
        let pending = tokio::spawn(send(other.addr, as_(ALICE, post(&call(id), Some(SID)))));
        let side = mock.next().await.respond_sse(Some(SID));
        side.message(&result(id)).await;
        drop(side);
        let (side_data, _, _) = read_call(&mut SseReader::new(pending.await.unwrap())).await;
        assert_eq!(
            side_data,
            vec![result(id)],
            "round {round}: a call on another replica"
        );
        // The cut client resumes on the new replica, from the store.
        let resp = send(
            fleet[round].addr,
            as_(ALICE, get(SID, Some(&last.unwrap()))),
        )
        .await;
        assert_eq!(resp.status(), 200, "round {round}");
        let mut resumed = SseReader::new(resp);
        upstream.message(&result(id - 1)).await;
        drop(upstream);
        let (rest, _, _) = read_call(&mut resumed).await;
        got.extend(rest);
        assert_eq!(
            got,
            vec![progress(1), progress(2), progress(3), result(id - 1)],
            "round {round}: every event of the drained replica's call once"
        );
        let mut old = old;
        let status = old
            .proc
            .wait_exit(Duration::from_secs(15))
            .await
            .expect("the old replica exits once its call ended");
        assert!(status.success(), "{status:?}");
    }
    // Every replica of the first fleet is gone: the session lives on in the new one.
    id += 1;
    let pending = tokio::spawn(send(fleet[2].addr, as_(ALICE, post(&call(id), Some(SID)))));
    let upstream = mock.next().await.respond_sse(Some(SID));
    upstream.message(&result(id)).await;
    drop(upstream);
    let (data, _, _) = read_call(&mut SseReader::new(pending.await.unwrap())).await;
    assert_eq!(data, vec![result(id)]);
}

#[tokio::test]
async fn the_owner_waits_for_a_slow_client_following_on_another_replica() {
    let Some(redis) = Redis::start("flow").await else {
        return;
    };
    let key = key_file("flow", 32);
    let mut mock = Mock::start().await;
    // A small window and a short stall budget on the owner: without the follower's progress,
    // it would drop what the slow client on B has not read within 1 s.
    let owner = [
        "--window-events",
        "8",
        "--stall-timeout",
        "1s",
        "--hold-standalone",
        "false",
    ];
    let a = replica_with(&mock, &redis, &key, &owner).await;
    let b = replica(&mock, &redis, &key).await;
    const SID: &str = "flow-session";
    const EVENTS: u64 = 300;
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 2).await;
    let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 200);
    let mut on_b = SseReader::new(resp);
    // The upstream writes as fast as it is let; the client on B reads slowly.
    let writer = tokio::spawn(async move {
        for i in 2..=EVENTS {
            upstream.message(&progress(i)).await;
        }
        upstream.message(&result(2)).await;
    });
    let mut got = Vec::new();
    let mut failed = Vec::new();
    while let Some(e) = on_b.next().await {
        match e.event.as_deref() {
            Some(t) if t.starts_with("mcp-reattach/resumption-failed") => failed.push(e),
            Some(t) if t.starts_with("mcp-reattach/") => {}
            _ => {
                got.extend(e.data);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    writer.await.unwrap();
    assert!(failed.is_empty(), "no gap: {failed:?}");
    let mut want: Vec<String> = (2..=EVENTS).map(progress).collect();
    want.push(result(2));
    assert_eq!(got.len(), want.len(), "every event once");
    assert_eq!(got, want);
    let paused = metric(&a, "mcp_reattach_upstream_pauses_total").await;
    println!("the owner paused its upstream {paused} times for the client on another replica");
    assert!(paused >= 1.0, "the owner waited for the follower");
}

#[tokio::test]
async fn a_session_ended_on_one_replica_is_ended_on_every_one() {
    let Some((_redis, _key, mut mock, a, b)) = two_replicas("delete").await else {
        return;
    };
    // A stateless upstream: the gateway mints the session, the upstream never knows it.
    let sid = minted(&a, &mut mock).await;
    // B adopts it for a call.
    let pending = tokio::spawn(send(b.addr, as_(ALICE, post(&call(1), Some(&sid)))));
    let upstream = mock.next().await.respond_sse(None);
    upstream.message(&result(1)).await;
    drop(upstream);
    assert_eq!(pending.await.unwrap().status(), 200);
    assert_eq!(metric(&b, "mcp_reattach_store_adoptions_total").await, 1.0);
    // Its client ends it through A.
    let mut delete = as_(ALICE, get(&sid, None));
    *delete.method_mut() = http::Method::DELETE;
    assert_eq!(send(a.addr, delete).await.status(), 200);
    // B learns it: the session is gone there too, and nothing reaches the upstream for it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let status = send(b.addr, as_(ALICE, post(&call(2), Some(&sid))))
            .await
            .status();
        if status == 404 {
            break;
        }
        // Not yet known on B: its call went upstream; answer it.
        mock.next().await.respond_json(result(2));
        assert!(
            tokio::time::Instant::now() < deadline,
            "B learns the session ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(mock.nothing_within(Duration::from_millis(100)).await);
}

/// A session the gateway sheds (here: `--max-sessions 1` on A) is ended upstream and in the
/// fleet: another replica does not adopt it from a record left live.
#[tokio::test]
async fn a_shed_session_is_ended_in_the_fleet_too() {
    let Some(redis) = Redis::start("shed").await else {
        return;
    };
    let key = key_file("shed", 32);
    let mut mock = Mock::start().await;
    let a = replica_with(
        &mock,
        &redis,
        &key,
        &["--hold-standalone", "false", "--max-sessions", "1"],
    )
    .await;
    let b = replica(&mock, &redis, &key).await;
    initialize(&a, &mut mock, "shed-1").await;
    // The second session takes the only place: the first is shed, and ended upstream.
    let pending = tokio::spawn(send(a.addr, as_(ALICE, post(INITIALIZE, None))));
    // Two requests reach the upstream, in either order: the new session's `initialize` and
    // the shed one's `DELETE`.
    let mut deleted = 0;
    for _ in 0..2 {
        let seen = mock.next().await;
        if seen.method == http::Method::DELETE {
            assert_eq!(seen.headers["mcp-session-id"], "shed-1");
            deleted += 1;
            seen.respond_json("");
        } else {
            seen.respond_initialized("shed-2");
        }
    }
    assert_eq!(deleted, 1, "the shed session is ended upstream");
    assert_eq!(pending.await.unwrap().status(), 200);
    assert_eq!(
        metric(
            &a,
            "mcp_reattach_session_evictions_total{reason=\"session_cap\"}"
        )
        .await,
        1.0
    );
    // In the store, the shed session's record is a tombstone (queued: looked at until it is).
    let mut conn = store_conn(&redis).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let recs: Vec<String> = ::redis::cmd("KEYS")
            .arg("mra:*:rec")
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut states = Vec::new();
        for r in &recs {
            let st: Option<String> = ::redis::cmd("HGET")
                .arg(r)
                .arg("state")
                .query_async(&mut conn)
                .await
                .unwrap();
            states.push(st.unwrap_or_default());
        }
        states.sort();
        if states == ["gone", "live"] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the shed session's record is tombstoned: {states:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Through B, its client's next request is not adopted: forwarded as for a session B never
    // saw, and the upstream (which ended it) answers its 404.
    let pending = tokio::spawn(send(b.addr, as_(ALICE, post(&call(2), Some("shed-1")))));
    let seen = mock.next().await;
    let mut gone = http::Response::new(http_body_util::Full::new(Bytes::new()));
    *gone.status_mut() = http::StatusCode::NOT_FOUND;
    seen.respond(gone);
    assert_eq!(pending.await.unwrap().status(), 404);
    assert_eq!(metric(&b, "mcp_reattach_store_adoptions_total").await, 0.0);
}

/// A session that idles out on the replica that created it while its client goes on through
/// another is not ended upstream by the first: the fleet still uses it.
#[tokio::test]
async fn a_session_idle_here_but_used_elsewhere_is_not_ended_upstream() {
    let Some(redis) = Redis::start("idle").await else {
        return;
    };
    let key = key_file("idle", 32);
    let mut mock = Mock::start().await;
    let flags = ["--hold-standalone", "false", "--session-ttl", "2s"];
    let a = replica_with(&mock, &redis, &key, &flags).await;
    let b = replica_with(&mock, &redis, &key, &flags).await;
    initialize(&a, &mut mock, "idle-1").await;
    // Its client goes on through B only, for well past A's TTL.
    let until = tokio::time::Instant::now() + Duration::from_millis(4_500);
    let mut id = 10;
    while tokio::time::Instant::now() < until {
        id += 1;
        let ping = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"ping"}}"#);
        let pending = tokio::spawn(send(b.addr, as_(ALICE, post(&ping, Some("idle-1")))));
        let seen = mock.next().await;
        assert_ne!(
            seen.method,
            http::Method::DELETE,
            "a replica ended upstream a session the fleet still uses"
        );
        seen.respond_json(result(id));
        assert_eq!(pending.await.unwrap().status(), 200);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(mock.nothing_within(Duration::from_millis(500)).await);
    // A did drop its own copy (its TTL), without ending the session.
    assert_eq!(
        metric(&a, "mcp_reattach_session_evictions_total{reason=\"ttl\"}").await,
        1.0
    );
}

#[tokio::test]
async fn a_draining_replicas_followers_resume_elsewhere_at_once() {
    let Some(redis) = Redis::start("drain-followers").await else {
        return;
    };
    let key = key_file("drain-followers", 32);
    let mut mock = Mock::start().await;
    let a = replica(&mock, &redis, &key).await;
    let b = replica_with(
        &mock,
        &redis,
        &key,
        &["--drain-delay", "0s", "--hold-standalone", "false"],
    )
    .await;
    const SID: &str = "drain-followers-session";
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 3).await;
    // The client follows A's call on B; then B is drained.
    let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 200);
    let mut on_b = SseReader::new(resp);
    upstream.message(&progress(2)).await;
    let started = tokio::time::Instant::now();
    b.proc.sigterm();
    let (got, last, told) = read_call(&mut on_b).await;
    let took = started.elapsed();
    assert!(told, "told to resume: {got:?}");
    assert!(
        took < Duration::from_secs(5),
        "at once, not at --drain-timeout: {took:?}"
    );
    // It resumes on A, which reads the call: the rest, once.
    let resp = send(a.addr, as_(ALICE, get(SID, Some(&last.unwrap())))).await;
    let mut on_a = SseReader::new(resp);
    upstream.message(&result(3)).await;
    drop(upstream);
    let (rest, _, _) = read_call(&mut on_a).await;
    let mut all = got;
    all.extend(rest);
    assert_eq!(all, vec![progress(2), result(3)], "every event once");
}

#[tokio::test]
async fn a_store_needs_the_fleets_secret() {
    let mock = Mock::start().await;
    let missing = Binary::try_start(
        "gateway",
        mock.addr,
        &["--store", "redis://127.0.0.1:1"],
        "/healthz",
    )
    .await
    .err()
    .expect("no key file: it does not start");
    assert_eq!(missing.code, Some(64));
    assert!(
        missing.stderr.contains("--store-key-file"),
        "{}",
        missing.stderr
    );
    let short = key_file("short", 16);
    let refused = Binary::try_start(
        "gateway",
        mock.addr,
        &[
            "--store",
            "redis://127.0.0.1:1",
            "--store-key-file",
            short.to_str().unwrap(),
        ],
        "/healthz",
    )
    .await
    .err()
    .expect("a short key: it does not start");
    assert_eq!(refused.code, Some(64));
    assert!(refused.stderr.contains("at least 32"), "{}", refused.stderr);
}

/// The status and `data.reason` a resume at `cursor` through `gw` gets, within a second for
/// the head (a 200 whose stream waits is a 200), with its first event's type if it is a 200.
async fn resume_answer(gw: &Binary, sid: &str, cursor: &str) -> (u16, String) {
    let resp = tokio::time::timeout(
        Duration::from_secs(2),
        send(gw.addr, as_(ALICE, get(sid, Some(cursor)))),
    )
    .await
    .expect("a resume's answer head");
    let status = resp.status().as_u16();
    if status == 200 {
        let first = tokio::time::timeout(Duration::from_secs(2), SseReader::new(resp).next())
            .await
            .ok()
            .flatten()
            .and_then(|e| e.event);
        return (status, first.unwrap_or_default());
    }
    let body = body_json(resp).await;
    let reason = body["error"]["data"]["reason"].as_str().unwrap_or("?");
    (status, reason.to_owned())
}

/// Waits until the store holds the end of a stream of the session (its meta says `end`).
async fn store_has_an_end(redis: &Redis) {
    use ::redis::AsyncCommands;
    let mut conn = store_conn(redis).await;
    for _ in 0..200 {
        let keys: Vec<String> = conn.keys("mra:*:m:*").await.unwrap();
        for k in keys {
            let m: Option<String> = conn.get(&k).await.unwrap();
            if m.is_some_and(|m| m.contains("\"end\"")) {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the stream's end never reached the store");
}

/// Issue 56 finding 12: one resume rule. The same cursor gets the same answer from the replica
/// that owns its stream and from one that follows it from the store: the last event of an
/// ended call (everything delivered) is 409 `stream-ended` on both (a 200 that ends at once
/// makes the TypeScript client loop), and a cursor 50 positions ahead is 409 `cursor-ahead` on
/// both (not a 200 that waits for positions that will never come).
#[tokio::test]
async fn a_cursor_gets_the_same_answer_from_the_owner_and_from_another_replica() {
    let Some((redis, _key, mut mock, a, b)) = two_replicas("one-rule").await else {
        return;
    };
    const SID: &str = "one-rule-session";
    initialize(&a, &mut mock, SID).await;

    // (b) A call running on A, its client cut after its first event: 50 positions ahead.
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 3).await;
    let (head, seq) = cursor.rsplit_once('.').unwrap();
    let ahead = format!("{head}.{}", seq.parse::<u64>().unwrap() + 50);
    let on_a = resume_answer(&a, SID, &ahead).await;
    assert_eq!(on_a, (409, "cursor-ahead".to_owned()), "the owner");
    let on_b = resume_answer(&b, SID, &ahead).await;
    assert_eq!(
        on_b, on_a,
        "a running call's cursor 50 ahead, on the other replica"
    );

    // (a) The call ends; its client read everything, the result last.
    let resp = send(a.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 200);
    let mut reader = SseReader::new(resp);
    assert_eq!(
        reader.next().await.unwrap().event.as_deref(),
        Some("mcp-reattach/resumed")
    );
    upstream.message(&result(3)).await;
    drop(upstream);
    let rest = reader.rest().await;
    let last = rest
        .iter()
        .rev()
        .find(|e| e.data.as_deref() == Some(result(3).as_str()))
        .and_then(|e| e.id.clone())
        .expect("the result, with an id");
    store_has_an_end(&redis).await;
    let on_a = resume_answer(&a, SID, &last).await;
    assert_eq!(on_a, (409, "stream-ended".to_owned()), "the owner");
    let on_b = resume_answer(&b, SID, &last).await;
    assert_eq!(
        on_b, on_a,
        "the last event of an ended call, on the other replica"
    );
    // The same call's other cursors: 50 ahead of its last event, inside it, its end position,
    // before its opening, another epoch, malformed.
    let (head, seq) = last.rsplit_once('.').unwrap();
    let (epoch_hex, stream_no) = head.split_once('.').unwrap();
    let other_epoch = format!("{:016x}", u64::from_str_radix(epoch_hex, 16).unwrap() ^ 1);
    for (case, at, want) in [
        (
            "50 ahead",
            format!("{head}.{}", seq.parse::<u64>().unwrap() + 50),
            (409, "cursor-ahead"),
        ),
        ("inside", cursor.clone(), (200, "mcp-reattach/resumed")),
        (
            "the end position",
            format!("{head}.{}", u64::MAX),
            (409, "stream-ended"),
        ),
        (
            "before its opening",
            format!("{head}.0"),
            (409, "foreign-cursor"),
        ),
        (
            "another epoch",
            format!("{other_epoch}.{stream_no}.{seq}"),
            (409, "foreign-cursor"),
        ),
        (
            "malformed",
            format!("{head}.0{seq}"),
            (400, "malformed-cursor"),
        ),
    ] {
        let on_a = resume_answer(&a, SID, &at).await;
        assert_eq!(on_a, (want.0, want.1.to_owned()), "{case}: the owner");
        let on_b = resume_answer(&b, SID, &at).await;
        assert_eq!(on_b, on_a, "{case}: the other replica");
    }
}

/// The events of a call's stream as a client reads them: whether it got the call's result,
/// and whether it got the explicit `owner-lost` failure (with the call's -32011 error).
fn result_or_lost(events: &[Event], id: u64) -> (bool, bool) {
    let got_result = events
        .iter()
        .filter_map(|e| e.data.as_deref())
        .any(|d| d == result(id));
    let lost = events.iter().any(|e| {
        e.event.as_deref() == Some("mcp-reattach/upstream-failed")
            && e.data.as_deref().is_some_and(|d| d.contains("owner-lost"))
    });
    if lost {
        let error = events
            .iter()
            .filter_map(|e| e.data.as_deref())
            .find(|d| d.contains("\"error\"") && d.contains(&format!("\"id\":{id}")));
        assert!(
            error.is_some(),
            "owner-lost carries the call's error: {events:?}"
        );
    }
    (got_result, lost)
}

/// Issue 56, R5-6: an owner only paused (SIGSTOP) long enough for its lease to lapse is
/// dead to the fleet, and stays so for that call: its follower's client gets exactly one of
/// the result or `owner-lost`, and once told `owner-lost` the fleet never serves the result
/// the owner read after it woke (its lease's generation is dead: it publishes nothing under
/// it, and the stream ended once, in the store).
#[tokio::test]
async fn a_paused_owner_never_answers_a_call_the_fleet_told_lost() {
    let Some((got_result, lost)) = paused_owner("paused", Duration::from_secs(5)).await else {
        return;
    };
    assert!(
        lost,
        "paused past its lease: the owner is lost to the fleet"
    );
    assert!(!got_result);
}

/// A pause shorter than the lease is no death: the follower's client gets the result.
#[tokio::test]
async fn an_owner_paused_within_its_lease_answers_its_call() {
    let Some((got_result, lost)) = paused_owner("paused-briefly", Duration::from_millis(800)).await
    else {
        return;
    };
    assert!(got_result && !lost, "the result, not owner-lost");
}

/// A call of A's followed from B, A paused for `pause` mid-call and its upstream's result read
/// after it wakes: what B's client got (the result, owner-lost), once it was checked that it
/// got exactly one and that a later resume of the call through B agrees.
async fn paused_owner(case: &str, pause: Duration) -> Option<(bool, bool)> {
    let redis = Redis::start(case).await?;
    let key = key_file(case, 32);
    let mut mock = Mock::start().await;
    let (a, b) = (
        replica(&mock, &redis, &key).await,
        replica(&mock, &redis, &key).await,
    );
    const SID: &str = "paused-session";
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 4).await;
    // The client comes back on B, which follows A's stream from the store.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut follow = loop {
        let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
        if resp.status() == 200 {
            let mut reader = SseReader::new(resp);
            let first = reader.next().await.unwrap();
            assert_eq!(first.event.as_deref(), Some("mcp-reattach/resumed"));
            break reader;
        }
        assert!(tokio::time::Instant::now() < deadline, "B follows the call");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let writes_before = metric(&a, "mcp_reattach_store_writes_total").await;
    // A is paused longer than its lease (3 s); B's client learns what B can.
    a.proc.signal("STOP");
    let paused = tokio::time::Instant::now();
    let told = tokio::spawn(async move { follow.rest().await });
    tokio::time::sleep(pause).await;
    a.proc.signal("CONT");
    println!("A paused for {:?}", paused.elapsed());
    // A wakes and its upstream answers the call: A reads the result.
    upstream.message(&result(4)).await;
    drop(upstream);
    let told = told.await.unwrap();
    let (got_result, lost) = result_or_lost(&told, 4);
    println!("B's client: result {got_result}, owner-lost {lost}");
    assert!(
        got_result != lost,
        "exactly one of the result or owner-lost: {told:?}"
    );
    // Whatever A writes once awake is in the store...
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while metric(&a, "mcp_reattach_store_writes_total").await <= writes_before {
        assert!(tokio::time::Instant::now() < deadline, "A writes again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...and a later resume of the same call, from the same cursor, through B or through A
    // (awake, its window holding the result), agrees with what the client was told.
    for (gw, on) in [(&b, "B"), (&a, "A")] {
        let resp = send(gw.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
        assert_eq!(resp.status(), 200, "on {on}");
        let again = SseReader::new(resp).rest().await;
        let (again_result, again_lost) = result_or_lost(&again, 4);
        assert_eq!(
            (again_result, again_lost),
            (got_result, lost),
            "the fleet tells one end of the call: first {told:?}, then on {on} {again:?}"
        );
    }
    Some((got_result, lost))
}

/// Issue 56: the store's tasks have one owner. A gateway dropped stops renewing its lease
/// (and its writer, poll and listener stop with it): its lease lapses in the store.
#[tokio::test]
async fn a_dropped_gateway_stops_renewing_its_lease() {
    let Some(redis) = Redis::start("dropped").await else {
        return;
    };
    let key = key_file("dropped", 32);
    let mut cfg = mcp_reattach::Config::new("http://127.0.0.1:1".parse().unwrap());
    cfg.store = Some(mcp_reattach::config::StoreSettings {
        url: redis.url.clone(),
        secret: std::fs::read(&key).unwrap(),
        timeout: Duration::from_millis(100),
        drain_timeout: Duration::from_secs(1),
        seal: false,
    });
    let gateway = mcp_reattach::Gateway::new(cfg);
    let mut conn = store_conn(&redis).await;
    let leases = |conn: &mut ::redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        async move {
            ::redis::cmd("KEYS")
                .arg("mra:{r:*}:alive")
                .query_async::<Vec<String>>(&mut conn)
                .await
                .unwrap()
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while leases(&mut conn).await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the lease is taken");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Held while the gateway lives (renewed every second for 3 s)...
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(leases(&mut conn).await.len(), 1, "renewed while it lives");
    // ...and lapses once it is dropped.
    drop(gateway);
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(
        leases(&mut conn).await,
        Vec::<String>::new(),
        "nobody renews a dropped gateway's lease"
    );
}

/// Issue 56, R5-7: the store restarted empty mid-call. A resume through a replica that never
/// held the session is never told the session does not exist (404 ends a client's session)
/// while it lives on the replica that reads its call: it is paced (503 + `Retry-After`) until
/// that replica has written the session and its stream again, then served.
#[tokio::test]
async fn a_store_restarted_empty_never_ends_a_live_session() {
    let Some((mut redis, _key, mut mock, a, b)) = two_replicas("reborn").await else {
        return;
    };
    const SID: &str = "reborn-session";
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 4).await;
    // The replicas have seen the store (their leases' first turns).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    redis.restart().await;
    let restarted = tokio::time::Instant::now();
    let deadline = restarted + Duration::from_secs(15);
    let mut statuses = Vec::new();
    let resp = loop {
        let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
        let status = resp.status().as_u16();
        if statuses.last() != Some(&status) {
            statuses.push(status);
        }
        if status == 200 {
            break resp;
        }
        assert_eq!(status, 503, "paced, never refused: {statuses:?}");
        assert_eq!(resp.headers()["retry-after"], "1");
        assert!(
            tokio::time::Instant::now() < deadline,
            "served: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!(
        "after the store restarted empty, B answered {statuses:?}, served after {:?}",
        restarted.elapsed()
    );
    let mut reader = SseReader::new(resp);
    let first = reader.next().await.unwrap();
    assert_eq!(first.event.as_deref(), Some("mcp-reattach/resumed"));
    upstream.message(&result(4)).await;
    drop(upstream);
    let data: Vec<String> = reader
        .rest()
        .await
        .into_iter()
        .filter_map(|e| e.data)
        .filter(|d| d.contains("\"id\":4"))
        .collect();
    assert_eq!(data, vec![result(4)], "the call's result, once");
}

/// Issue 56, R5-7, a stateless upstream's fleet: a minted session id certifies itself under
/// the fleet's key, so a replica that never saw the session holds it from its id alone when
/// the store cannot say (it was flushed, restarted empty): the session's next request is
/// served, never a 404; a stranger with the same id is still told nothing.
#[tokio::test]
async fn a_minted_session_lives_on_any_replica_when_the_store_forgot_it() {
    let Some((redis, _key, mut mock, a, b)) = two_replicas("minted-reborn").await else {
        return;
    };
    let sid = minted(&a, &mut mock).await;
    // The store forgets everything (as one restarted without persistence).
    let mut conn = store_conn(&redis).await;
    let () = ::redis::cmd("FLUSHALL")
        .query_async(&mut conn)
        .await
        .unwrap();
    // A stranger naming the id on B: nothing.
    let resp = send(b.addr, as_(BOB, post(&call(1), Some(&sid)))).await;
    assert_eq!(resp.status(), 404, "a stranger gets nothing");
    // Its owner's next request lands on B, which never saw it: served.
    let mut pending = tokio::spawn(send(b.addr, as_(ALICE, post(&call(2), Some(&sid)))));
    let seen = tokio::select! {
        seen = mock.next() => seen,
        resp = &mut pending => panic!(
            "answered without reaching the upstream: {}",
            resp.unwrap().status()
        ),
    };
    assert_eq!(seen.json_body()["id"], 2);
    assert!(
        seen.headers.get("mcp-session-id").is_none(),
        "the stateless upstream never sees the gateway's id"
    );
    let upstream = seen.respond_sse(None);
    upstream.message(&result(2)).await;
    drop(upstream);
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200, "a live minted session is never a 404");
    let data: Vec<String> = SseReader::new(resp)
        .rest()
        .await
        .into_iter()
        .filter_map(|e| e.data)
        .filter(|d| d.contains("\"id\":2"))
        .collect();
    assert_eq!(data, vec![result(2)]);
}

/// `req` carrying the client's `Last-Event-ID` (a retransmission of a POST it was cut from).
fn with_cursor(cursor: &str, mut req: Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    req.headers_mut()
        .insert("last-event-id", cursor.parse().unwrap());
    req
}

/// The refusal's reason, and its `Retry-After` if any.
async fn refusal(resp: http::Response<hyper::body::Incoming>) -> (u16, Option<String>, String) {
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let Ok(body) = tokio::time::timeout(
        Duration::from_secs(3),
        http_body_util::BodyExt::collect(resp.into_body()),
    )
    .await
    else {
        return (status, retry, "a body that does not end (forwarded)".into());
    };
    let body = body.unwrap().to_bytes();
    let reason = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|b| b["error"]["data"]["reason"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
    (status, retry, reason)
}

/// Issue 56, R5-1: a request id is in flight fleet-wide for its session. While the owner's
/// call id 6 runs through A, the same id posted into the session through B by anyone else
/// (another token, or none) is refused exactly as A refuses it (409 `request-in-flight`),
/// never forwarded, and the owner gets its result (before: B forwarded it untagged, and the
/// stranger took the owner's remaining progress and result).
#[tokio::test]
async fn a_stranger_through_another_replica_never_takes_the_owners_call() {
    let Some((_redis, _key, mut mock, a, b)) = two_replicas("stranger").await else {
        return;
    };
    const SID: &str = "strangers-session";
    initialize(&a, &mut mock, SID).await;
    let pending = tokio::spawn(send(a.addr, as_(ALICE, post(&call(6), Some(SID)))));
    let upstream = mock.next().await.respond_sse(Some(SID));
    let mut owner = SseReader::new(pending.await.unwrap());
    upstream.message(&progress(1)).await;
    let mut first = owner.next().await.unwrap();
    while first.data.is_none() {
        first = owner.next().await.unwrap();
    }
    for (who, gw) in [("bob through B", &b), ("bob through A", &a)] {
        let resp = send(gw.addr, as_(BOB, post(&call(6), Some(SID)))).await;
        let (status, _, reason) = refusal(resp).await;
        assert_eq!(
            (status, reason.as_str()),
            (409, "request-in-flight"),
            "{who}"
        );
    }
    let resp = send(b.addr, post(&call(6), Some(SID))).await;
    let (status, _, reason) = refusal(resp).await;
    assert_eq!(
        (status, reason.as_str()),
        (409, "request-in-flight"),
        "anonymous through B"
    );
    assert!(
        mock.nothing_within(Duration::from_millis(200)).await,
        "no stranger's id 6 is forwarded"
    );
    upstream.message(&progress(2)).await;
    upstream.message(&result(6)).await;
    drop(upstream);
    let data: Vec<String> = owner
        .rest()
        .await
        .into_iter()
        .filter_map(|e| e.data)
        .collect();
    assert_eq!(
        data,
        vec![progress(2), result(6)],
        "the owner's answer is the owner's"
    );

    // Once answered, the id is free for bob through B as through A (the one rule), and his
    // POST of it takes nothing of the owner's: the owner's retransmission through B is still
    // answered from the owner's stream, never forwarded.
    let pending = tokio::spawn(send(b.addr, as_(BOB, post(&call(6), Some(SID)))));
    let seen = mock.next().await;
    assert_eq!(seen.json_body()["id"], 6, "bob's own id 6, forwarded");
    seen.respond_json(result(6));
    assert_eq!(pending.await.unwrap().status(), 200);
    let resp = send(
        b.addr,
        with_cursor(
            &first.id.clone().unwrap(),
            as_(ALICE, post(&call(6), Some(SID))),
        ),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let data: Vec<String> = SseReader::new(resp)
        .rest()
        .await
        .into_iter()
        .filter(|e| {
            e.event
                .as_deref()
                .is_none_or(|t| !t.starts_with("mcp-reattach/"))
        })
        .filter_map(|e| e.data)
        .collect();
    assert_eq!(
        data,
        vec![progress(2), result(6)],
        "the owner's stream, from its cursor"
    );
    assert!(
        mock.nothing_within(Duration::from_millis(200)).await,
        "the owner's call ran once"
    );
}

/// Issue 56, R5-3: a store that refuses writes (`maxmemory` reached under `noeviction`)
/// cannot take a retransmission's claim: B answers 503 + `Retry-After`, never forwards it
/// (before: the claim failed open and the tool ran a second time).
#[tokio::test]
async fn a_retransmission_whose_claim_the_full_store_refuses_is_paced_not_run() {
    let Some((redis, _key, mut mock, a, b)) = two_replicas("full").await else {
        return;
    };
    const SID: &str = "full-store-session";
    initialize(&a, &mut mock, SID).await;
    // B adopts the session (a call through it).
    let pending = tokio::spawn(send(b.addr, as_(ALICE, post(&call(1), Some(SID)))));
    let upstream = mock.next().await.respond_sse(Some(SID));
    upstream.message(&result(1)).await;
    drop(upstream);
    assert_eq!(pending.await.unwrap().status(), 200);
    // The store fills up: it refuses every write from now on. The call through A is held
    // there and forwarded (a store that cannot take its claim costs cross-replica
    // resumability, not availability); the client is cut.
    let mut conn = store_conn(&redis).await;
    let _: () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query_async(&mut conn)
        .await
        .unwrap();
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 6).await;
    // Its retransmission through B: the claim cannot be made there either.
    for _ in 0..3 {
        let resp = send(
            b.addr,
            with_cursor(&cursor, as_(ALICE, post(&call(6), Some(SID)))),
        )
        .await;
        let (status, retry, reason) = refusal(resp).await;
        assert_eq!(
            (status, retry.as_deref(), reason.as_str()),
            (503, Some("1"), "store-unavailable")
        );
    }
    assert!(
        mock.nothing_within(Duration::from_millis(300)).await,
        "the tool ran once"
    );
    drop(upstream);
}

/// Issue 56, R5-5: `redis-server` stopped mid-call. Retransmissions through the other replica
/// get 503 + `Retry-After` while it is down, and after it comes back (empty) none is run
/// again: the owner's claims are written once it is back, and right after its return a
/// retransmission nobody claimed is paced (before: 197 of 208 ran the tool again during the
/// outage, 58 more in the 2.5 s after).
#[tokio::test]
async fn a_store_outage_never_runs_a_retransmission_twice() {
    let Some((mut redis, _key, mut mock, a, b)) = two_replicas("outage-twice").await else {
        return;
    };
    const SID: &str = "outage-twice-session";
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 6).await;

    redis.stop().await;
    let retransmit = || {
        send(
            b.addr,
            with_cursor(&cursor, as_(ALICE, post(&call(6), Some(SID)))),
        )
    };
    for _ in 0..5 {
        let (status, retry, reason) = refusal(retransmit().await).await;
        assert_eq!(
            (status, retry.as_deref(), reason.as_str()),
            (503, Some("1"), "store-unavailable"),
            "during the outage"
        );
    }
    // The call goes on and ends on A meanwhile.
    upstream.message(&progress(2)).await;
    upstream.message(&result(6)).await;
    drop(upstream);
    redis.restart().await;
    let until = tokio::time::Instant::now() + Duration::from_secs(6);
    let mut seen = std::collections::BTreeMap::new();
    while tokio::time::Instant::now() < until {
        let (status, _, _) = refusal(retransmit().await).await;
        *seen.entry(status).or_insert(0) += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("after the store's return: {seen:?}");
    assert!(seen.keys().all(|s| [200, 409, 503].contains(s)), "{seen:?}");
    assert!(
        mock.nothing_within(Duration::from_millis(300)).await,
        "the tool ran once"
    );
}

/// Every session record in the store: its key and the length of its longest field.
async fn records(conn: &mut ::redis::aio::MultiplexedConnection) -> Vec<(String, usize)> {
    let keys: Vec<String> = ::redis::cmd("KEYS")
        .arg("mra:*:rec")
        .query_async(conn)
        .await
        .unwrap();
    let mut out = Vec::new();
    for k in keys {
        let fields: Vec<(String, Vec<u8>)> = ::redis::cmd("HGETALL")
            .arg(&k)
            .query_async(conn)
            .await
            .unwrap();
        let longest = fields.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
        out.push((k, longest));
    }
    out
}

/// Issue 56, R5-2: what a client sends that is kept is bounded. An `initialize` carrying a
/// 100 KB `protocolVersion` (or the header) does not put it in the session's record (before:
/// a 100 KB field in every record, kept by every adopting replica outside the budget), and a
/// record with a field past the record's bound, written into the store by hand, is not
/// adopted.
#[tokio::test]
async fn a_clients_oversized_protocol_version_is_never_kept() {
    let Some((redis, _key, mut mock, a, b)) = two_replicas("version").await else {
        return;
    };
    let huge = "9".repeat(100_000);
    let init = INITIALIZE.replace("2025-06-18", &huge);
    let pending = tokio::spawn(send(a.addr, as_(ALICE, post(&init, None))));
    mock.next()
        .await
        .respond_initialized("huge-version-session");
    assert_eq!(pending.await.unwrap().status(), 200);
    let mut conn = store_conn(&redis).await;
    let recs = records(&mut conn).await;
    assert_eq!(recs.len(), 1);
    assert!(
        recs[0].1 <= 64,
        "the record's longest field: {} bytes",
        recs[0].1
    );

    // A record whose version field is past the bound: B does not adopt it.
    initialize(&a, &mut mock, "tampered-session").await;
    let recs = records(&mut conn).await;
    for (k, _) in &recs {
        let _: () = ::redis::cmd("HSET")
            .arg(k)
            .arg("ver")
            .arg(&huge)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let pending = tokio::spawn(send(b.addr, as_(ALICE, get("tampered-session", None))));
    if let Ok(seen) = tokio::time::timeout(Duration::from_secs(2), mock.next()).await {
        seen.respond(json_response(404, &[], ""));
    }
    let resp = pending.await.unwrap();
    assert_ne!(resp.status(), 200, "not served as an adopted session");
    assert_eq!(
        metric(&b, "mcp_reattach_store_adoptions_total").await,
        0.0,
        "a record past its bound is not adopted"
    );
}

/// Issue 56, R5-5: a call that says nothing while the store is away (restarted empty) has
/// nothing deferred to write; its owner writes what the store must know of it again once it
/// is back, so a retransmission through the other replica, well past the grace, is answered
/// from its stream, never run again (before: the claim was lost with the store, and after the
/// grace B forwarded the retransmission). When the outage outlasted the owner's lease, that
/// stream ended `lost` in the fleet at the last position the owner tagged: the answer is then
/// its explicit failure (before the end's position was fixed: a false 409).
#[tokio::test]
async fn a_call_running_across_an_empty_restart_is_claimed_again() {
    let Some((mut redis, _key, mut mock, a, b)) = two_replicas("restarted-empty").await else {
        return;
    };
    const SID: &str = "restarted-empty-session";
    initialize(&a, &mut mock, SID).await;
    let (cursor, upstream) = cut_after_first(&a, &mut mock, SID, 6).await;
    redis.stop().await;
    // Long enough for every replica to see it gone (their leases fail every second).
    tokio::time::sleep(Duration::from_secs(2)).await;
    redis.restart().await;
    // Past the grace: whatever B gets now, it is not a second run.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let resp = send(
        b.addr,
        with_cursor(&cursor, as_(ALICE, post(&call(6), Some(SID)))),
    )
    .await;
    let status = resp.status();
    assert!(
        mock.nothing_within(Duration::from_millis(300)).await,
        "the tool ran once (B answered {status})"
    );
    assert_eq!(status, 200, "resumed from the store");
    let mut on_b = SseReader::new(resp);
    let first = on_b.next().await.unwrap();
    assert_eq!(first.event.as_deref(), Some("mcp-reattach/resumed"));
    upstream.message(&result(6)).await;
    drop(upstream);
    let events = on_b.rest().await;
    // The owner's lease held through the outage: the call's result, from its stream. Or it
    // lapsed (the outage outlasted it, as it may on a busy machine): the owner's streams are
    // lost to the fleet (fenced), and the client is told so with its call's -32011. Never
    // both, never nothing.
    let (got_result, lost) = result_or_lost(&events, 6);
    assert!(
        got_result != lost,
        "the result or the explicit failure: {events:?}"
    );
}

/// Issue 56, R5-11: what a follower reads of the store is bounded by what an owner writes. A
/// store writer's entry larger than any owner's (one upstream read, at most
/// `--max-event-bytes` and a reader's batch) is not read into the follower's memory: a hole in
/// the stream, the explicit gap (before: read whole and served, 2 MiB past a 256 KiB bound).
#[tokio::test]
async fn a_follower_reads_no_entry_larger_than_an_owner_writes() {
    let Some(redis) = Redis::start("huge-entry").await else {
        return;
    };
    let key = key_file("huge-entry", 32);
    let mut mock = Mock::start().await;
    let flags = ["--hold-standalone", "false", "--max-event-bytes", "256KiB"];
    let a = replica_with(&mock, &redis, &key, &flags).await;
    let b = replica_with(&mock, &redis, &key, &flags).await;
    const SID: &str = "huge-entry-session";
    initialize(&a, &mut mock, SID).await;
    let (cursor, _upstream) = cut_after_first(&a, &mut mock, SID, 3).await;
    let seq: u64 = cursor.rsplit('.').next().unwrap().parse().unwrap();
    // The call's events in the store, once its first is there.
    let mut conn = store_conn(&redis).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let events = loop {
        let keys: Vec<String> = ::redis::cmd("KEYS")
            .arg(format!("mra:*:ev:{}", stream(&cursor)))
            .query_async(&mut conn)
            .await
            .unwrap();
        if let Some(k) = keys.into_iter().next() {
            break k;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the call's events in the store"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // A well-formed packed event of 2 MiB right after the client's cursor, as no owner with
    // this bound writes one.
    let body = format!("data: {}\n\n", "x".repeat(2 << 20));
    let mut packed = Vec::new();
    packed.extend_from_slice(&(seq + 1).to_le_bytes());
    packed.push(1);
    packed.extend_from_slice(&(body.len() as u32).to_le_bytes());
    packed.extend_from_slice(body.as_bytes());
    let () = ::redis::cmd("XADD")
        .arg(&events)
        .arg(format!("0-{}", seq + 1))
        .arg("p")
        .arg(seq)
        .arg("e")
        .arg(packed)
        .query_async(&mut conn)
        .await
        .unwrap();
    let resp = send(b.addr, as_(ALICE, get(SID, Some(&cursor)))).await;
    assert_eq!(resp.status(), 200);
    let read = SseReader::new(resp).rest().await;
    let longest = read
        .iter()
        .filter_map(|e| e.data.as_ref())
        .map(String::len)
        .max()
        .unwrap_or(0);
    assert!(
        longest < 256 << 10,
        "the follower served an event of {longest} bytes, past what an owner writes"
    );
    assert!(
        read.iter()
            .any(|e| e.event.as_deref() == Some("mcp-reattach/resumption-failed")),
        "the hole is the explicit gap: {:?}",
        read.iter().map(|e| e.event.clone()).collect::<Vec<_>>()
    );
}
