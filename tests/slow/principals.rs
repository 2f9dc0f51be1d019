//! Issue 46: every session, stream and answer is its principal's, tried as the second
//! adversarial review tried it: raw HTTP/1.1 clients with `Bearer victim` and `Bearer
//! attacker` credentials, through the gateway, in front of the real TypeScript SDK server
//! (`tests/interop/ts-server.mjs`, stateful SSE, stateful JSON and stateless shapes).

// Real sockets and processes run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use support::*;

const VICTIM: &str = "Bearer victim";
const ATTACKER: &str = "Bearer attacker";
const VERSION: &str = "2025-06-18";

fn as_(mut req: Request<Full<Bytes>>, auth: &str) -> Request<Full<Bytes>> {
    req.headers_mut()
        .insert("authorization", auth.parse().unwrap());
    req.headers_mut()
        .insert("mcp-protocol-version", VERSION.parse().unwrap());
    req
}

fn tool(id: u64, name: &str, args: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{name}","arguments":{args},"_meta":{{"progressToken":{id}}}}}}}"#
    )
}

fn ping(id: u64) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"ping"}}"#)
}

/// A request naming the session id it is given.
type MakeRequest = fn(&str) -> Request<Full<Bytes>>;

const INITIALIZED: &str = r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#;

/// The whole body of `resp` as text (bounded by the support client's wait).
async fn text(resp: http::Response<hyper::body::Incoming>) -> String {
    let body = tokio::time::timeout(WAIT, resp.into_body().collect())
        .await
        .expect("the body in time")
        .expect("a body")
        .to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// The session id an answer names.
fn session_id(resp: &http::Response<hyper::body::Incoming>) -> String {
    resp.headers()["mcp-session-id"]
        .to_str()
        .unwrap()
        .to_owned()
}

/// A session initialized by `auth` through the gateway at `gw` (with its
/// `notifications/initialized`), as an SDK client does; its id.
async fn initialize(gw: &Gw, auth: &str) -> String {
    let resp = send(gw.addr, as_(post(INITIALIZE, None), auth)).await;
    assert_eq!(resp.status(), 200);
    let sid = session_id(&resp);
    let body = text(resp).await;
    assert!(body.contains("serverInfo"), "{body}");
    let resp = send(gw.addr, as_(post(INITIALIZED, Some(&sid)), auth)).await;
    assert_eq!(resp.status(), 202);
    sid
}

/// TTL expiry: the gateway forgets the victim's session and ends it upstream (it sent no
/// DELETE before: the attacker's `ping` then re-created the session bound to the attacker).
#[tokio::test]
async fn a_session_the_gateway_forgets_is_ended_upstream_and_never_adopted() {
    let upstream = Upstream::ts("sse").await;
    let gw = gateway(upstream.addr, |c| {
        c.session_ttl = Duration::from_millis(500);
    })
    .await;
    let sid = initialize(&gw, VICTIM).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while gw.gateway.registry().get(&sid).is_some() {
        assert!(tokio::time::Instant::now() < deadline, "the TTL ran out");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The attacker names the forgotten id: the upstream no longer has it (the gateway's
    // DELETE is on its way, give it a moment), and the gateway never binds it to anyone.
    let mut statuses = Vec::new();
    for attempt in 0..20 {
        let resp = send(gw.addr, as_(post(&ping(attempt), Some(&sid)), ATTACKER)).await;
        statuses.push(resp.status().as_u16());
        text(resp).await;
        assert!(
            gw.gateway.registry().get(&sid).is_none(),
            "the forgotten session was adopted by the attacker (statuses {statuses:?})"
        );
        if statuses.last() == Some(&404) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        statuses.last(),
        Some(&404),
        "the upstream still had the session: {statuses:?}"
    );
}

/// A restart in place (a second gateway with no record, in front of the same upstream): an
/// id the upstream still accepts passes through untagged for whoever names it, and no
/// session, stream or cursor of the gateway's is created for the first caller.
#[tokio::test]
async fn an_id_the_upstream_still_accepts_passes_through_and_grants_nothing() {
    let upstream = Upstream::ts("sse").await;
    let before = gateway(upstream.addr, |_| {}).await;
    let sid = initialize(&before, VICTIM).await;
    let after = gateway(upstream.addr, |_| {}).await;
    // The attacker's ping is the upstream's to answer, and creates nothing here.
    let resp = send(after.addr, as_(post(&ping(1), Some(&sid)), ATTACKER)).await;
    assert_eq!(resp.status(), 200, "the upstream answers the ping");
    text(resp).await;
    assert!(
        after.gateway.registry().get(&sid).is_none(),
        "the gateway adopted an id it never saw for the first caller"
    );
    // The victim's call still works, untagged: the gateway holds nothing it could hand out.
    let call = tool(2, "slow_progress", r#"{"steps":2,"interval_ms":20}"#);
    let resp = send(after.addr, as_(post(&call, Some(&sid)), VICTIM)).await;
    assert_eq!(resp.status(), 200);
    let events = SseReader::new(resp).rest().await;
    assert!(
        events.iter().all(|e| e.id.is_none()),
        "untagged: {events:?}"
    );
    assert!(
        messages(&events).join("\n").contains("done 2"),
        "{events:?}"
    );
    assert!(after.gateway.registry().is_empty());
    // A cursor the attacker guesses finds nothing to resume.
    let guess = "0123456789abcdef.1.1";
    let resp = send(after.addr, as_(get(&sid, Some(guess)), ATTACKER)).await;
    assert_eq!(resp.status(), 404);
}

/// The owner's `tools/call` id 5 runs; another principal posts id 5 into the same session.
/// It is refused (409 `request-in-flight`), never forwarded, and the owner gets every event
/// and its result (before: the attacker's POST took the owner's progress and result).
async fn an_id_in_flight_is_never_forwarded_for_another_principal(mode: &str) {
    let upstream = Upstream::ts(mode).await;
    let gw = gateway(upstream.addr, |_| {}).await;
    let sid = initialize(&gw, VICTIM).await;
    let owners = tool(5, "slow_progress", r#"{"steps":10,"interval_ms":200}"#);
    let resp = send(gw.addr, as_(post(&owners, Some(&sid)), VICTIM)).await;
    assert_eq!(resp.status(), 200);
    let mut owner = SseReader::new(resp);
    // Wait until the call runs upstream: its first progress (or, upgraded, the stream's id).
    let first = owner.next().await.expect("the owner's stream starts");
    let hijack = tool(5, "slow_progress", r#"{"steps":1,"interval_ms":0}"#);
    let resp = send(gw.addr, as_(post(&hijack, Some(&sid)), ATTACKER)).await;
    let status = resp.status();
    let body = text(resp).await;
    assert_eq!(status, 409, "{mode}: {body}");
    let refusal: serde_json::Value = serde_json::from_str(&body).expect("a JSON-RPC error");
    assert_eq!(refusal["id"], 5, "{body}");
    assert_eq!(
        refusal["error"]["data"]["reason"], "request-in-flight",
        "{body}"
    );
    let mut events = vec![first];
    events.extend(owner.rest().await);
    let got = messages(&events).join("\n");
    assert!(got.contains("done 10"), "{mode}: the owner's result: {got}");
    // Once answered, the id is no longer in flight: the other principal's id 5 is its own.
    let resp = send(gw.addr, as_(post(&hijack, Some(&sid)), ATTACKER)).await;
    assert_eq!(resp.status(), 200, "{mode}");
    assert!(text(resp).await.contains("done 1"));
}

#[tokio::test]
async fn an_id_in_flight_is_never_forwarded_for_another_principal_sse() {
    an_id_in_flight_is_never_forwarded_for_another_principal("sse").await;
}

#[tokio::test]
async fn an_id_in_flight_is_never_forwarded_for_another_principal_json_upgraded() {
    an_id_in_flight_is_never_forwarded_for_another_principal("json").await;
}

/// The detached-call quota is the principal's that left the calls: another principal's
/// detached calls in the owner's session do not use up the owner's (before: the owner got
/// 429 once the attacker left `--max-detached-calls` calls).
#[tokio::test]
async fn another_principals_detached_calls_do_not_use_up_the_owners_quota() {
    let upstream = Upstream::ts("sse").await;
    let gw = gateway(upstream.addr, |c| c.max_detached_calls = 2).await;
    let sid = initialize(&gw, VICTIM).await;
    let slow = r#"{"steps":30,"interval_ms":100}"#;
    for id in [100, 101] {
        let resp = send(
            gw.addr,
            as_(post(&tool(id, "slow_progress", slow), Some(&sid)), ATTACKER),
        )
        .await;
        assert_eq!(resp.status(), 200);
        let mut left = SseReader::new(resp);
        assert!(left.next().await.is_some(), "the call runs");
        drop(left); // the attacker leaves the call running
    }
    // The attacker's own quota is spent.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let resp = send(
            gw.addr,
            as_(
                post(&tool(102, "slow_progress", slow), Some(&sid)),
                ATTACKER,
            ),
        )
        .await;
        let status = resp.status();
        drop(resp);
        if status == 429 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the attacker's quota: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The owner's is not.
    let call = tool(7, "slow_progress", r#"{"steps":1,"interval_ms":0}"#);
    let resp = send(gw.addr, as_(post(&call, Some(&sid)), VICTIM)).await;
    assert_eq!(resp.status(), 200, "the owner's call");
    assert!(messages(&SseReader::new(resp).rest().await)
        .join("\n")
        .contains("done 1"));
}

/// A minted session (stateless upstream) answers a stranger exactly as a minted id the
/// gateway does not hold (before: its POST was forwarded, a 200, while an unheld id got 404
/// `minted-session-gone`: whether a session exists was told).
#[tokio::test]
async fn a_minted_session_answers_strangers_as_an_unknown_one() {
    let upstream = Upstream::ts("stateless-sse").await;
    let gw = gateway(upstream.addr, |_| {}).await;
    let resp = send(gw.addr, as_(post(INITIALIZE, None), VICTIM)).await;
    assert_eq!(resp.status(), 200);
    let sid = session_id(&resp);
    text(resp).await;
    assert!(sid.starts_with("mra-"), "{sid}");
    // An id of the same form the gateway does not hold.
    let unheld = format!("mra-{}", "0".repeat(32));
    let answer = |sid: String, req: MakeRequest| {
        let addr = gw.addr;
        async move {
            let resp = send(addr, as_(req(&sid), ATTACKER)).await;
            (resp.status().as_u16(), text(resp).await)
        }
    };
    let requests: [(&str, MakeRequest); 4] = [
        ("POST", |s| post(&ping(1), Some(s))),
        ("GET", |s| get(s, None)),
        ("resume", |s| get(s, Some("0123456789abcdef.1.1"))),
        ("DELETE", |s| {
            Request::delete("/mcp")
                .header("host", "mcp.example")
                .header("mcp-session-id", s)
                .body(Full::new(Bytes::new()))
                .unwrap()
        }),
    ];
    for (what, req) in requests {
        let held = answer(sid.clone(), req).await;
        let not = answer(unheld.clone(), req).await;
        assert_eq!(held.0, 404, "{what} into the held session: {held:?}");
        assert_eq!(held, not, "{what}: the answers must be identical");
    }
    // The owner's session is untouched.
    let resp = send(gw.addr, as_(post(&ping(9), Some(&sid)), VICTIM)).await;
    assert_eq!(resp.status(), 200);
    assert!(gw.gateway.registry().get(&sid).is_some());
}
