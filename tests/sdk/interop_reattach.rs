//! Three re-attachment bugs, end to end with the real MCP SDKs, real processes and real
//! sockets on 127.0.0.1. The gateway is the real binary (`CARGO_BIN_EXE_mcp-reattach`, default
//! flags: window 256 events / 1 MiB, `--priming auto`), its admin listener scraped for
//! `/metrics`.
//!
//! 1. **Slow client link (flow control)**:
//!
//!    ```text
//!    ts-reattach-client.mjs ──> Relay::start_limited (1 MB/s) ──> mcp-reattach ──> upstream
//!    ```
//!
//!    The TypeScript SDK client calls the upstream's `flood` tool (3000 progress notifications
//!    of ~4000 bytes, sent with no delay: ~12 MB) with a 120 s timeout reset on progress. The
//!    upstream (TypeScript SDK server, then Python FastMCP) produces far faster than the client
//!    link drains. Expected: the call returns `flooded 3000` with exactly 3000 progress
//!    notifications, 1..=3000 in order, none twice; and the gateway slowed the upstream down
//!    instead of dropping events: `mcp_reattach_events_evicted_undelivered_total` is 0 and
//!    `mcp_reattach_upstream_pauses_total` > 0 (a missing metric is a failure).
//!    *Before the fix (4194148)*: the gateway read the upstream at full speed, the live client
//!    fell behind the window, and the call ended with the gateway's -32010 gap error after
//!    ~1100-1500 notifications (and neither metric existed).
//!
//! 2. **POST retransmission** (raw HTTP at protocol 2025-11-25, a recording [`Relay`] between
//!    the gateway and the upstream):
//!
//!    ```text
//!    this test (reqwest) ──> mcp-reattach ──> Relay::start_recording ──> upstream
//!    ```
//!
//!    `tools/call counter` (id 7, a progressToken) is POSTed; the client reads the SSE response
//!    up to the first event with an `id:` (the gateway's priming event) and drops the
//!    connection. 400 ms later (the tool has finished upstream) it retransmits the identical
//!    POST with `Mcp-Session-Id` and `Last-Event-ID: <that id>`. Expected: 200
//!    `text/event-stream` opening with `event: mcp-reattach/resumed` (with an id), then the
//!    events after the cursor including the result `applied 1` for id 7; the tool ran once, so
//!    the next call (id 8) returns `applied 2`; no request reaching the upstream carries a
//!    gateway-format `Last-Event-ID`. Second case: id 8 retransmitted *without*
//!    `Last-Event-ID` must not run the tool again either (id 9 returns `applied 3`); the reply is
//!    either the original stream replayed (`mcp-reattach/resumed`, then id 8's result) or a
//!    JSON-RPC error naming the duplicate id; the summary says which.
//!    *Before the fix*: both retransmissions were forwarded (with the gateway's
//!    `Last-Event-ID`) and ran the tool again: id 7's retransmission got a fresh `applied 2`,
//!    id 8 got `applied 3`, …
//!
//! 3. **Standalone stream closed by the server** (TypeScript SDK client and server):
//!
//!    ```text
//!    ts-reattach-client.mjs ──> mcp-reattach ──> Relay::start_recording ──> ts-server.mjs
//!    ```
//!
//!    The client opens its standalone GET stream and receives notification A on it; it calls
//!    `close_standalone` (the server ends the standalone stream: `closeStandaloneSSEStream()`),
//!    and at once `notify_standalone` with a 2 s delay, so B1..B3 are sent on the standalone
//!    stream after the client had time to reconnect (the SDK does it by itself: GET +
//!    `Last-Event-ID` after 1 s). Expected: B1..B3 each exactly once, A not twice.
//!    *Before the fix*: the gateway answered the reconnect with 409 (`stream-ended`), twice,
//!    the SDK gave up, nobody re-opened the upstream's standalone stream and B was lost.
//!
//! Against the gateway before issue 9 these tests failed as described (checked when they were
//! written); they pass now. Controls (`control_*`: the same client and upstream without the gateway) pass and
//! show that the harness, the SDKs and the throttled link can pass scenarios 1 and 3 (scenario
//! 2 needs the gateway's ids, so it has no control). Each test prints a `SUMMARY` line (counts,
//! timings) for reports. Needs Node.js >= 18, npm
//! and Python >= 3.10 (first runs install `tests/interop/node_modules` and
//! `tests/interop/.venv`). Run with `cargo test --test sdk interop_reattach:: -- --nocapture`.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::{
    http_client, metric_sum, Binary, ChildProc, Event, Relay, SseBody, SseEventExt, Upstream,
};
use tokio::time::Instant;

// ---------------------------------------------------------------------------------------------
// Upstreams and the gateway process ([`Binary`])
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Up {
    /// `ts-server.mjs sse` (TypeScript SDK, no event store).
    Ts,
    /// `py-server.py` (Python SDK FastMCP, no event store).
    Py,
}

impl Up {
    async fn start(self) -> Upstream {
        // Installs (first run only) before any clock starts.
        support::install_interop_deps().await;
        match self {
            Up::Ts => Upstream::ts("sse").await,
            Up::Py => Upstream::py().await,
        }
    }
}

/// The admin listener's `/metrics` (Prometheus text).
async fn scrape_metrics(gw: &Binary) -> String {
    gw.admin_get("/metrics")
        .await
        .unwrap_or_else(|e| panic!("scraping /metrics: {e}"))
}

/// A metric for a summary line: its value, `missing`, or `n/a` (no scrape: no gateway).
fn show_metric(text: &str, name: &str) -> String {
    if text.is_empty() {
        return "n/a".to_string();
    }
    metric_sum(text, name).map_or_else(|| "missing".to_string(), |v| v.to_string())
}

// ---------------------------------------------------------------------------------------------
// The TypeScript SDK client (tests/interop/ts-reattach-client.mjs)
// ---------------------------------------------------------------------------------------------

/// What one run of `ts-reattach-client.mjs` printed.
struct ClientRun {
    /// Every stdout event (JSON), in order.
    events: Vec<Value>,
    /// "eof" or "timeout" if no `done` line came.
    cut_short: Option<&'static str>,
    stderr: Vec<String>,
}

impl ClientRun {
    fn of(&self, ev: &str) -> impl Iterator<Item = &Value> {
        let ev = ev.to_string();
        self.events.iter().filter(move |v| v["ev"] == ev.as_str())
    }

    fn report(&self) -> String {
        let events: Vec<String> = self
            .events
            .iter()
            .filter(|v| v["ev"] != "tick")
            .map(|v| {
                let mut v = v.clone();
                // The progress list is summarised elsewhere; keep the report readable.
                if let Some(p) = v.get_mut("progress").and_then(Value::as_array_mut) {
                    let n = p.len();
                    *p = vec![json!(format!("<{n} values>"))];
                }
                v.to_string()
            })
            .collect();
        format!(
            "client cut short: {:?}\nstdout:\n  {}\nstderr:\n  {}",
            self.cut_short,
            events.join("\n  "),
            self.stderr.join("\n  ")
        )
    }
}

/// Runs `node ts-reattach-client.mjs <mode> <url> <plan>` until its `done` line, at most
/// `limit`.
async fn run_ts_client(mode: &str, url: &str, plan: &Value, limit: Duration) -> ClientRun {
    let plan = plan.to_string();
    let mut proc = ChildProc::spawn_node(
        "ts-client",
        "ts-reattach-client.mjs",
        &[mode, url, plan.as_str()],
    );
    let deadline = Instant::now() + limit;
    let mut run = ClientRun {
        events: Vec::new(),
        cut_short: None,
        stderr: Vec::new(),
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match proc.next_line(left).await.line() {
            Ok(l) => l,
            Err(why) => {
                run.cut_short = Some(why);
                break;
            }
        };
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            eprintln!("[ts-client] not JSON: {line}");
            continue;
        };
        if v["ev"] != "flood" {
            eprintln!("[ts-client stdout] {line}");
        }
        let done = v["ev"] == "done";
        run.events.push(v);
        if done {
            break;
        }
    }
    proc.wait_exit(Duration::from_secs(5)).await;
    proc.kill();
    run.stderr = proc.stderr_lines();
    run
}

// ---------------------------------------------------------------------------------------------
// Failures collected per test, so one run reports every broken expectation at once
// ---------------------------------------------------------------------------------------------

struct Failures {
    test: String,
    list: Vec<String>,
}

impl Failures {
    fn new(test: impl Into<String>) -> Failures {
        Failures {
            test: test.into(),
            list: Vec::new(),
        }
    }

    fn check(&mut self, ok: bool, why: impl FnOnce() -> String) {
        if !ok {
            self.list.push(why());
        }
    }

    fn assert_none(self, context: &str) {
        assert!(
            self.list.is_empty(),
            "{}: {} expectation(s) failed:\n  - {}\n{context}",
            self.test,
            self.list.len(),
            self.list.join("\n  - ")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Slow client link: flow control instead of eviction
// ---------------------------------------------------------------------------------------------

const FLOOD_COUNT: u64 = 3000;
const FLOOD_SIZE: u64 = 4000;
const LINK_BYTES_PER_SEC: u64 = 1_000_000;

/// Where the client's link leads: through the gateway, or (a control) straight to the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    Gateway,
    /// No gateway: shows the harness, the client and the upstream can pass the scenario.
    Direct,
}

async fn slow_client_link(up: Up, via: Via) {
    let name = format!("slow-client-link × {up:?} via {via:?}");
    let upstream = up.start().await;
    let gateway = match via {
        Via::Gateway => Some(Binary::start(upstream.addr, &[]).await),
        Via::Direct => None,
    };
    let link = Relay::start_limited(
        gateway.as_ref().map_or(upstream.addr, |g| g.addr),
        LINK_BYTES_PER_SEC,
    );
    let plan = json!({"count": FLOOD_COUNT, "size": FLOOD_SIZE, "timeout_ms": 120_000});
    let started = Instant::now();
    let run = run_ts_client("flood", &link.url("/mcp"), &plan, Duration::from_secs(170)).await;
    let took = started.elapsed();
    let metrics = match &gateway {
        Some(g) => scrape_metrics(g).await,
        None => String::new(),
    };
    // The upstream's own account of how long producing the flood took (it shows whether the
    // server felt any backpressure).
    let produced = upstream
        .proc
        .stderr_lines()
        .into_iter()
        .find(|l| l.starts_with("flood:"))
        .unwrap_or_else(|| "flood: (no report)".to_string());

    let flood = run.of("flood").next().cloned().unwrap_or(Value::Null);
    let progress: Vec<u64> = flood["progress"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|p| p.as_f64().unwrap_or(-1.0) as u64)
                .collect()
        })
        .unwrap_or_default();
    let in_order_prefix = progress
        .iter()
        .zip(1..)
        .take_while(|(p, want)| **p == *want)
        .count();
    let mut sorted = progress.clone();
    sorted.sort_unstable();
    sorted.dedup();
    let duplicates = progress.len() - sorted.len();
    let evicted_undelivered = "mcp_reattach_events_evicted_undelivered_total";
    let pauses = "mcp_reattach_upstream_pauses_total";
    let rate = link.down_bytes() as f64 / took.as_secs_f64() / 1000.0;

    eprintln!(
        "SUMMARY 1 slow-client-link | upstream {up:?} via {via:?} | result {:?} error {:?} (code {}) | \
         progress {} received, {} in order from 1, {} duplicated, last {:?} | call {} ms, first/last \
         progress at {}/{} ms | link {} bytes in {:.1} s ({rate:.0} kB/s) | upstream {produced:?} | \
         metrics: evicted_undelivered {}, upstream_pauses {}, window_evictions {}, \
         slow_consumer_detaches {}, events_tagged {}",
        flood["text"],
        flood["error"],
        flood["code"],
        progress.len(),
        in_order_prefix,
        duplicates,
        progress.last(),
        flood["elapsed_ms"],
        flood["first_ms"],
        flood["last_ms"],
        link.down_bytes(),
        took.as_secs_f64(),
        show_metric(&metrics, evicted_undelivered),
        show_metric(&metrics, pauses),
        show_metric(&metrics, "mcp_reattach_window_evictions_total"),
        show_metric(&metrics, "mcp_reattach_slow_consumer_detaches_total"),
        show_metric(&metrics, "mcp_reattach_events_tagged_total"),
    );

    let mut f = Failures::new(name);
    f.check(flood.is_object(), || {
        format!(
            "the client printed no flood outcome (cut short: {:?})",
            run.cut_short
        )
    });
    f.check(
        flood["text"] == format!("flooded {FLOOD_COUNT}").as_str() && flood["error"].is_null(),
        || {
            format!(
                "the call did not complete: result {}, error {} (code {}) after {} progress notifications",
                flood["text"], flood["error"], flood["code"], progress.len()
            )
        },
    );
    let want: Vec<u64> = (1..=FLOOD_COUNT).collect();
    f.check(progress == want, || {
        format!(
            "progress: {} received, want exactly 1..={FLOOD_COUNT} in order; {in_order_prefix} in order \
             from 1, {duplicates} duplicated, first out of place at index {in_order_prefix}: {:?}",
            progress.len(),
            progress.get(in_order_prefix)
        )
    });
    f.check(
        flood["min_message_bytes"].as_u64().unwrap_or(0) + 100 >= FLOOD_SIZE || progress.is_empty(),
        || {
            format!(
                "progress messages are not ~{FLOOD_SIZE} bytes: shortest {}",
                flood["min_message_bytes"]
            )
        },
    );
    match metric_sum(&metrics, evicted_undelivered) {
        _ if via == Via::Direct => {}
        None => f.list.push(format!(
            "metric {evicted_undelivered} is missing from /metrics (the gateway must count events \
             evicted before they were delivered to an attached client)"
        )),
        Some(v) => f.check(v == 0.0, || {
            format!("{evicted_undelivered} = {v}, want 0 (events were dropped before delivery)")
        }),
    }
    match metric_sum(&metrics, pauses) {
        _ if via == Via::Direct => {}
        None => f.list.push(format!(
            "metric {pauses} is missing from /metrics (the gateway must count the times it stopped \
             reading an upstream stream for a slow client)"
        )),
        Some(v) => f.check(v > 0.0, || {
            format!("{pauses} = {v}, want > 0 (the upstream was never paused for the slow client)")
        }),
    }
    f.assert_none(&run.report());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_client_link_ts_server() {
    slow_client_link(Up::Ts, Via::Gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_client_link_py_server() {
    slow_client_link(Up::Py, Via::Gateway).await;
}

/// Control: the same slow link straight to the upstream (no gateway, so no window to overflow)
/// completes, so a failure of the tests above is the gateway's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_slow_client_link_ts_server_without_gateway() {
    slow_client_link(Up::Ts, Via::Direct).await;
}

/// Control with the Python server (its report shows whether FastMCP felt backpressure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_slow_client_link_py_server_without_gateway() {
    slow_client_link(Up::Py, Via::Direct).await;
}

// ---------------------------------------------------------------------------------------------
// Raw HTTP at protocol 2025-11-25 (scenario 2)
// ---------------------------------------------------------------------------------------------

const PROTOCOL: &str = "2025-11-25";

/// Everything one POST got back.
struct Exchange {
    status: u16,
    content_type: String,
    /// SSE events (an SSE response).
    events: Vec<Event>,
    /// JSON-RPC messages: of the `message` events, or the JSON body.
    messages: Vec<Value>,
    /// Non-SSE body text.
    body: String,
    /// How reading ended: `answered` (the response for the id came), `eof`, `timeout`, …
    end: String,
    took: Duration,
}

impl Exchange {
    /// The response (result or error) for JSON-RPC `id`.
    fn response(&self, id: u64) -> Option<&Value> {
        self.messages
            .iter()
            .find(|m| m["id"] == id && (m.get("result").is_some() || m.get("error").is_some()))
    }

    /// The text of `id`'s result.
    fn result_text(&self, id: u64) -> Option<&str> {
        self.response(id)?["result"]["content"][0]["text"].as_str()
    }

    fn first_kind(&self) -> Option<&str> {
        self.events.first().map(|e| e.kind())
    }

    fn brief(&self) -> String {
        let body = if self.events.is_empty() {
            format!(
                " body {:?}",
                self.body.chars().take(300).collect::<String>()
            )
        } else {
            String::new()
        };
        format!(
            "{} {:?}, end {}, {} ms{body}\n      {}",
            self.status,
            self.content_type,
            self.end,
            self.took.as_millis(),
            self.events
                .iter()
                .map(|e| e.brief())
                .collect::<Vec<_>>()
                .join("\n      ")
        )
    }
}

/// A raw Streamable HTTP client session (legacy era, 2025-11-25).
struct Raw {
    http: reqwest::Client,
    url: String,
    session: Option<String>,
}

impl Raw {
    /// `initialize`, then `notifications/initialized`.
    async fn connect(url: &str) -> Raw {
        let mut raw = Raw {
            http: http_client(),
            url: url.to_string(),
            session: None,
        };
        let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": PROTOCOL,
            "capabilities": {},
            "clientInfo": {"name": "mcp-reattach-interop-raw", "version": "0.0.0"}
        }});
        let resp = raw.post(&init, None).await;
        raw.session = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let ex = read_exchange(resp, 1, Duration::from_secs(10)).await;
        assert!(
            ex.response(1).is_some_and(|r| r.get("result").is_some()) && raw.session.is_some(),
            "initialize failed (session {:?}): {}",
            raw.session,
            ex.brief()
        );
        let resp = raw
            .post(
                &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
                None,
            )
            .await;
        assert_eq!(resp.status().as_u16(), 202, "notifications/initialized");
        raw
    }

    fn session(&self) -> &str {
        self.session.as_deref().unwrap_or("")
    }

    /// POSTs `body` (with `Last-Event-ID` if given); the response as soon as its head arrived.
    async fn post(&self, body: &Value, last_event_id: Option<&str>) -> reqwest::Response {
        let mut req = self
            .http
            .post(&self.url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(serde_json::to_vec(body).expect("JSON body"));
        if let Some(sid) = &self.session {
            req = req
                .header("mcp-session-id", sid)
                .header("mcp-protocol-version", PROTOCOL);
        }
        if let Some(lei) = last_event_id {
            req = req.header("last-event-id", lei);
        }
        tokio::time::timeout(Duration::from_secs(10), req.send())
            .await
            .unwrap_or_else(|_| panic!("POST {body}: no response head within 10 s"))
            .unwrap_or_else(|e| panic!("POST {body}: {e}"))
    }

    /// A whole `tools/call counter` exchange (id `id`, progressToken `tok-<id>`).
    async fn call_counter(&self, id: u64) -> Exchange {
        let resp = self.post(&counter_call(id), None).await;
        read_exchange(resp, id, Duration::from_secs(10)).await
    }
}

/// `tools/call counter` with JSON-RPC id `id` and progressToken `tok-<id>`.
fn counter_call(id: u64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": "counter", "arguments": {}, "_meta": {"progressToken": format!("tok-{id}")}
    }})
}

/// Reads `resp` to the response for JSON-RPC `id`, the end of the body, or `limit`.
async fn read_exchange(resp: reqwest::Response, id: u64, limit: Duration) -> Exchange {
    let started = Instant::now();
    let deadline = started + limit;
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut ex = Exchange {
        status,
        content_type: content_type.clone(),
        events: Vec::new(),
        messages: Vec::new(),
        body: String::new(),
        end: String::new(),
        took: Duration::ZERO,
    };
    if content_type.starts_with("text/event-stream") {
        let mut body = SseBody::new(resp);
        ex.end = loop {
            match body.next(deadline).await {
                Ok(Some(ev)) => {
                    if let Some(m) = ev.json() {
                        ex.messages.push(m);
                    }
                    ex.events.push(ev);
                    if ex.response(id).is_some() {
                        break "answered".to_string();
                    }
                }
                Ok(None) => break "eof".to_string(),
                Err(e) => break e,
            }
        };
    } else {
        let left = deadline.saturating_duration_since(Instant::now());
        ex.end = match tokio::time::timeout(left, resp.text()).await {
            Ok(Ok(text)) => {
                match serde_json::from_str::<Value>(&text) {
                    Ok(Value::Array(a)) => ex.messages.extend(a),
                    Ok(v) => ex.messages.push(v),
                    Err(_) => {}
                }
                ex.body = text;
                "body".to_string()
            }
            Ok(Err(e)) => format!("read error: {e}"),
            Err(_) => "timeout".to_string(),
        };
    }
    ex.took = started.elapsed();
    ex
}

/// Whether `id` has the gateway's cursor form `<16 lowercase hex>.<u32>.<u64>`.
fn is_gateway_cursor(id: &str) -> bool {
    let parts: Vec<&str> = id.split('.').collect();
    parts.len() == 3
        && parts[0].len() == 16
        && parts[0]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        && parts[1].parse::<u32>().is_ok()
        && parts[2].parse::<u64>().is_ok()
}

/// The `Last-Event-ID` values of the recorded request heads.
fn last_event_ids(heads: &[String]) -> Vec<String> {
    heads
        .iter()
        .flat_map(|h| {
            h.lines().filter_map(|l| {
                let (n, v) = l.split_once(':')?;
                n.trim()
                    .eq_ignore_ascii_case("last-event-id")
                    .then(|| v.trim().to_string())
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 2. POST retransmission: replayed from the window, never run twice
// ---------------------------------------------------------------------------------------------

/// How the gateway answered a retransmission of an already-answered id without
/// `Last-Event-ID`.
fn classify_duplicate(ex: &Exchange, id: u64, original: &str) -> Result<String, String> {
    let error = ex.response(id).and_then(|r| r.get("error"));
    if ex.first_kind() == Some("mcp-reattach/resumed") && ex.result_text(id) == Some(original) {
        return Ok(format!(
            "replayed (resumed, then the original result {original:?})"
        ));
    }
    if let Some(e) = error {
        let message = e["message"].as_str().unwrap_or("");
        if message.contains(&id.to_string()) {
            return Ok(format!(
                "JSON-RPC error {} naming the duplicate id: {message:?}",
                e["code"]
            ));
        }
    }
    // The JSON-RPC error might also come as a plain JSON error body (id null).
    if let Some(e) = ex.messages.iter().find_map(|m| m.get("error")) {
        let message = e["message"].as_str().unwrap_or("");
        if message.contains(&id.to_string()) {
            return Ok(format!(
                "JSON-RPC error {} naming the duplicate id (HTTP {}): {message:?}",
                e["code"], ex.status
            ));
        }
    }
    Err(match ex.result_text(id) {
        Some(t) => format!("the tool ran again: a fresh result {t:?} (original {original:?})"),
        None => format!("neither a replay nor an error naming id {id}"),
    })
}

async fn post_retransmission(up: Up) {
    let name = format!("post-retransmission × {up:?}");
    let upstream = up.start().await;
    let tap = Relay::start_recording(upstream.addr);
    let gateway = Binary::start(tap.addr(), &[]).await;
    let raw = Raw::connect(&gateway.url()).await;
    let mut f = Failures::new(name);

    // The first attempt: read up to the first event with an id, then drop the connection.
    let call7 = counter_call(7);
    let t0 = Instant::now();
    let resp = raw.post(&call7, None).await;
    let first_status = resp.status().as_u16();
    let mut body = SseBody::new(resp);
    let mut before_cursor = Vec::new();
    let cursor = loop {
        match body.next(Instant::now() + Duration::from_secs(5)).await {
            Ok(Some(ev)) if ev.id.is_some() => break ev.id,
            Ok(Some(ev)) => before_cursor.push(ev.brief()),
            Ok(None) | Err(_) => break None,
        }
    };
    let cursor_ms = t0.elapsed().as_millis();
    drop(body);
    let Some(cursor) = cursor else {
        panic!(
            "{up:?}: the first POST (status {first_status}) had no event with an id within 5 s; \
             events: {before_cursor:?}"
        );
    };
    // The tool finishes upstream (2 notifications 100 ms apart) while no client is attached.
    tokio::time::sleep(Duration::from_millis(400)).await;

    // The retransmission, with the cursor.
    let resp = raw.post(&call7, Some(&cursor)).await;
    let retry7 = read_exchange(resp, 7, Duration::from_secs(8)).await;
    // The next call, normally.
    let call8 = raw.call_counter(8).await;
    // id 8 again, without Last-Event-ID (already answered).
    let resp = raw.post(&counter_call(8), None).await;
    let dup8 = read_exchange(resp, 8, Duration::from_secs(8)).await;
    let call9 = raw.call_counter(9).await;

    // Evidence from the upstream's side: what reached it, and how often the tool ran.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let heads = tap.recorded_request_heads();
    let upstream_leis = last_event_ids(&heads);
    let executions: Vec<String> = upstream
        .proc
        .stderr_lines()
        .into_iter()
        .filter(|l| l.starts_with("counter: applied"))
        .collect();
    let duplicate = classify_duplicate(&dup8, 8, "applied 2");

    eprintln!(
        "SUMMARY 2 post-retransmission | upstream {up:?} | cursor {cursor:?} after {cursor_ms} ms | \
         retransmit id 7 + Last-Event-ID: {} {:?}, first event {:?}, {} events, result {:?} in {} ms | \
         id 8: {:?} | id 8 again without Last-Event-ID: {} | id 9: {:?} | tool executions upstream: \
         {} | upstream requests {} with Last-Event-ID {:?}",
        retry7.status,
        retry7.content_type,
        retry7.first_kind(),
        retry7.events.len(),
        retry7.result_text(7),
        retry7.took.as_millis(),
        call8.result_text(8),
        match &duplicate {
            Ok(s) => s.clone(),
            Err(e) => format!("FAILED: {e}"),
        },
        call9.result_text(9),
        executions.len(),
        heads.len(),
        upstream_leis,
    );

    f.check(
        retry7.status == 200 && retry7.content_type.starts_with("text/event-stream"),
        || {
            format!(
                "retransmission of id 7 with Last-Event-ID: HTTP {} {:?}, want 200 text/event-stream",
                retry7.status, retry7.content_type
            )
        },
    );
    f.check(
        retry7.first_kind() == Some("mcp-reattach/resumed")
            && retry7.events.first().is_some_and(|e| e.id.is_some()),
        || {
            format!(
                "retransmission of id 7: first event {:?}, want `mcp-reattach/resumed` with an id",
                retry7.events.first().map(|e| e.brief())
            )
        },
    );
    f.check(retry7.result_text(7) == Some("applied 1"), || {
        format!(
            "retransmission of id 7: result {:?}, want the original \"applied 1\"",
            retry7.result_text(7)
        )
    });
    let mut datas: Vec<&str> = retry7
        .events
        .iter()
        .filter_map(|e| e.data.as_deref())
        .filter(|d| !d.is_empty())
        .collect();
    let n = datas.len();
    datas.sort_unstable();
    datas.dedup();
    f.check(datas.len() == n, || {
        "retransmission of id 7: an event was delivered twice".to_string()
    });
    f.check(call8.result_text(8) == Some("applied 2"), || {
        format!(
            "the next call (id 8) returned {:?}, want \"applied 2\": the retransmission ran the tool again",
            call8.result_text(8)
        )
    });
    if let Err(e) = &duplicate {
        f.list.push(format!(
            "retransmission of the answered id 8 without Last-Event-ID: {e}"
        ));
    }
    f.check(call9.result_text(9) == Some("applied 3"), || {
        format!(
            "the call after it (id 9) returned {:?}, want \"applied 3\"",
            call9.result_text(9)
        )
    });
    f.check(executions.len() == 3, || {
        format!(
            "the upstream ran the counter tool {} times for ids 7, 8, 9, want 3: {executions:?}",
            executions.len()
        )
    });
    let leaked: Vec<&String> = upstream_leis
        .iter()
        .filter(|id| is_gateway_cursor(id))
        .collect();
    f.check(leaked.is_empty(), || {
        format!("requests reaching the upstream carried the gateway's Last-Event-ID: {leaked:?}")
    });
    f.assert_none(&format!(
        "session {}\nretransmission of id 7: {}\nid 8: {}\nid 8 again: {}\nid 9: {}\nrequest heads \
         the upstream received:\n  {}",
        raw.session(),
        retry7.brief(),
        call8.brief(),
        dup8.brief(),
        call9.brief(),
        heads
            .iter()
            .map(|h| {
                let lei = last_event_ids(std::slice::from_ref(h));
                let line = h.lines().next().unwrap_or("");
                format!("{line}  last-event-id: {lei:?}")
            })
            .collect::<Vec<_>>()
            .join("\n  ")
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_retransmission_ts_server() {
    post_retransmission(Up::Ts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_retransmission_py_server() {
    post_retransmission(Up::Py).await;
}

// ---------------------------------------------------------------------------------------------
// 3. The server closes the standalone stream
// ---------------------------------------------------------------------------------------------

async fn standalone_closed(via: Via) {
    let upstream = Up::Ts.start().await;
    let tap = Relay::start_recording(upstream.addr);
    let gateway = match via {
        Via::Gateway => Some(Binary::start(tap.addr(), &[]).await),
        Via::Direct => None,
    };
    let url = gateway
        .as_ref()
        .map_or_else(|| tap.url("/mcp"), Binary::url);
    let plan = json!({"b_delay_ms": 2000, "b_interval_ms": 150});
    let run = run_ts_client("standalone", &url, &plan, Duration::from_secs(40)).await;

    let seqs = |tag: &str| -> Vec<u64> {
        run.of("notify")
            .filter(|n| n["tag"] == tag)
            .map(|n| n["seq"].as_u64().unwrap_or(0))
            .collect()
    };
    let (a, b) = (seqs("A"), seqs("B"));
    let closed_at = run
        .of("mark")
        .find(|m| m["what"] == "close_standalone returned")
        .and_then(|m| m["at_ms"].as_u64());
    // Every GET the SDK client sent, with what it got.
    let gets: Vec<String> = run
        .of("http")
        .filter(|h| h["method"] == "GET")
        .map(|h| {
            format!(
                "+{}ms GET last-event-id={} -> {} {}",
                h["at_ms"],
                h["lei"].as_str().unwrap_or("-"),
                h["status"],
                h["ct"].as_str().unwrap_or("")
            )
        })
        .collect();
    let reconnects: Vec<&Value> = run
        .of("http")
        .filter(|h| {
            h["method"] == "GET" && h["at_ms"].as_u64() > closed_at.map(|c| c.saturating_sub(50))
        })
        .collect();
    let heads = tap.recorded_request_heads();
    let upstream_gets: Vec<String> = heads
        .iter()
        .filter(|h| h.starts_with("GET "))
        .map(|h| {
            let lei = last_event_ids(std::slice::from_ref(h));
            format!("GET last-event-id={lei:?}")
        })
        .collect();
    let b_at: Vec<u64> = run
        .of("notify")
        .filter(|n| n["tag"] == "B")
        .filter_map(|n| n["at_ms"].as_u64())
        .collect();

    eprintln!(
        "SUMMARY 3 standalone-closed | via {via:?} | A received {}x, B seqs {b:?} (at {b_at:?} ms) | close at {:?} ms | \
         client GETs: [{}] | upstream GETs: [{}]",
        a.len(),
        closed_at,
        gets.join("; "),
        upstream_gets.join("; "),
    );

    let mut f = Failures::new(format!("standalone-closed-by-server × Ts via {via:?}"));
    f.check(run.cut_short.is_none(), || {
        format!("the client did not finish: {:?}", run.cut_short)
    });
    f.check(a == [1], || {
        format!(
            "notification A received {} times, want exactly once",
            a.len()
        )
    });
    f.check(b == [1, 2, 3], || {
        format!(
            "notifications B: got seqs {b:?}, want [1, 2, 3] each exactly once; the client's \
             reconnects after the server closed the standalone stream: {}",
            reconnects
                .iter()
                .map(|h| format!(
                    "GET last-event-id={} -> {}",
                    h["lei"].as_str().unwrap_or("-"),
                    h["status"]
                ))
                .collect::<Vec<_>>()
                .join(", ")
        )
    });
    f.assert_none(&run.report());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_stream_closed_by_server() {
    standalone_closed(Via::Gateway).await;
}

/// Control: without the gateway the SDK client re-opens its standalone stream (with no
/// `Last-Event-ID`: this server sets no ids) and gets B, so a failure above is the gateway's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_standalone_stream_closed_without_gateway() {
    standalone_closed(Via::Direct).await;
}
