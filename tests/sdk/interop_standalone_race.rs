//! Issue 14: a server-initiated message sent on the standalone stream before the client's
//! standalone `GET` reached the server is lost. End to end with real processes and sockets on
//! 127.0.0.1 (no fixed ports): the real gateway binary (`CARGO_BIN_EXE_mcp-reattach`, default
//! flags unless a scenario says otherwise), the TypeScript SDK server `ts-server.mjs sse` (no
//! event store: with no standalone stream registered, the SDK's `send()` drops a message that is
//! not related to a request, silently) and, in scenario 3, the unmodified TypeScript SDK client.
//!
//! ```text
//! this test (reqwest) or ts-race-client.mjs ──> [mcp-reattach] ──> ts-server.mjs sse
//! ```
//!
//! The SDK clients open the standalone `GET` by themselves as soon as `notifications/initialized`
//! was answered 202, without waiting for it, and the application's first tool call follows at
//! once; through a gateway the `GET` reaches the upstream later than it would directly. The
//! fix under test: for a legacy session the gateway opens the upstream standalone `GET` itself
//! as soon as the upstream accepted `notifications/initialized`, tags and retains its events,
//! and serves the client's `GET` from it (a first `GET` without `Last-Event-ID` gets everything
//! that stream carried and no client was sent; reconnects resume exactly). `--hold-standalone=false`
//! turns it off.
//!
//! 1. **Race probe** (`race_probe_raw_http`; raw HTTP at protocol 2025-11-25). Per trial, a new
//!    session: `initialize` + `notifications/initialized`, then the standalone `GET` and a
//!    `tools/call notify_now {tag}` POST are started at the same moment (two spawned tasks, two
//!    connections; which one is spawned first alternates). The tool sends a log notification
//!    `{tag}` that is *not* related to the call (so the SDK routes it to the standalone stream,
//!    or nowhere) before it returns; its result says whether the server had a standalone stream
//!    registered at that moment. The trial then reads the `GET` stream for the notification
//!    (at most 2 s after the call's result, then 300 ms more for a duplicate) and counts it on
//!    both streams. [`TRIALS`] trials, [`PARALLEL`] at a time, against three targets:
//!    - (a) the server directly: a control showing the race exists (losses are printed, never
//!      asserted: on an idle machine the `GET` may win every time);
//!    - (b) the gateway (default flags): **every trial must get the notification exactly once
//!      on the `GET` stream** (and the `GET` answered 200, the call answered);
//!    - (c) the gateway with `--hold-standalone=false`: printed only; skipped (with a note) when
//!      the binary rejects the flag (exit code 64: a gateway before the fix).
//!
//!    One observation is printed per target as well: what a second concurrent `GET` (no
//!    `Last-Event-ID`) on a session whose standalone stream is open gets back.
//!    A `SUMMARY 1` line gives every rate.
//!
//! 2. **Elicitation while no `GET` is open** (`elicitation_without_get_raw_http`). A session whose
//!    client declared `capabilities.elicitation`; `tools/call elicit_now {tag}` is POSTed with
//!    no standalone `GET` open: the tool at once sends `elicitation/create` unrelated to the
//!    call (the standalone stream) and awaits the answer (server-side timeout 4 s). 500 ms
//!    later the client opens its `GET` (no `Last-Event-ID`), reads the `elicitation/create`
//!    request from it, and POSTs the JSON-RPC response `{action: "accept", content: {answer:
//!    <tag>}}`. Through the gateway: **the request is delivered (exactly once) on the `GET`,
//!    the response is accepted (202) and the call's result carries the answer**. Directly (the
//!    control, printed only): the request went nowhere, nothing comes on the `GET`, and the
//!    call ends with the server's elicitation timeout. `SUMMARY 2` prints both outcomes and
//!    `mcp_reattach_held_standalone_streams` scraped while no client `GET` was open.
//!
//! 3. **The real TypeScript SDK client** (`race_ts_sdk_client`; `ts-race-client.mjs`). Per
//!    trial a new `Client` (elicitation capability, a handler accepting with `{answer: <tag>}`)
//!    does `await connect()` and at once `callTool`, exactly as an application does (the SDK
//!    opens its `GET` by itself in between): `notify_now` trials (the notification must reach
//!    the client's handler exactly once) and `elicit_now` trials (the call must return the
//!    answer). Directly: printed (control); through the gateway: **every trial must pass**.
//!    `SUMMARY 3` also reports how the SDK orders its `GET` and its first call.
//!
//! Against the gateway before the fix the gateway assertions fail (messages are lost: the
//! upstream's standalone stream is opened only when the client's `GET` reaches it). The tests
//! of this file run one at a time (a lock), to keep their timing (and the race) independent of
//! each other. Needs Node.js >= 18 and npm (the first run installs `tests/interop/node_modules`).
//! Run with `cargo test --test sdk interop_standalone_race:: -- --nocapture`.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::cell::Cell;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use support::{
    http_client, metric_sum, Binary, ChildProc, NextLine, NotStarted, SseBody, SseEventExt,
    Upstream,
};
use tokio::time::Instant;

const PROTOCOL: &str = "2025-11-25";
/// Trials per target in scenario 1.
const TRIALS: usize = 40;
/// Trials of scenario 1 in flight at a time.
const PARALLEL: usize = 8;
/// How long after the call's result a trial waits for the notification on the `GET` stream.
const NOTIFY_WAIT: Duration = Duration::from_secs(2);
/// How long a trial keeps reading after the notification came (a duplicate would show).
const DUPLICATE_WAIT: Duration = Duration::from_millis(300);
/// The gateway's exit code for a bad command line (`--hold-standalone` unknown before the fix).
const EX_USAGE: i32 = 64;

/// One test of this file at a time (see the module doc).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn start_upstream() -> Upstream {
    // Installs (first run only) before any clock starts.
    tokio::task::spawn_blocking(support::ensure_npm_deps)
        .await
        .expect("installing the interop dependencies");
    Upstream::ts("sse").await
}

// ---------------------------------------------------------------------------------------------
// The gateway process ([`Binary`])
// ---------------------------------------------------------------------------------------------

/// The admin listener's `/metrics` (Prometheus text); empty if it cannot be scraped.
async fn scrape_metrics(gw: &Binary) -> String {
    gw.admin_get("/metrics").await.unwrap_or_default()
}

/// Metric `name` summed over its label sets, as text: its value, or `missing`.
fn show_metric(text: &str, name: &str) -> String {
    metric_sum(text, name).map_or_else(|| "missing".to_string(), |v| v.to_string())
}

const HELD_GAUGE: &str = "mcp_reattach_held_standalone_streams";

// ---------------------------------------------------------------------------------------------
// Raw HTTP (legacy era, 2025-11-25)
// ---------------------------------------------------------------------------------------------

/// The JSON-RPC messages of a response: its SSE `message` events, or its JSON body.
struct Reply {
    status: u16,
    content_type: String,
    messages: Vec<Value>,
    /// Every SSE event (brief form), or the body text.
    seen: Vec<String>,
    /// How reading ended: `answered`, `eof`, `timeout`, `body`, …
    end: String,
}

impl Reply {
    fn response(&self, id: &Value) -> Option<&Value> {
        self.messages
            .iter()
            .find(|m| m["id"] == *id && (m.get("result").is_some() || m.get("error").is_some()))
    }

    fn brief(&self) -> String {
        format!(
            "{} {:?}, end {}: {}",
            self.status,
            self.content_type,
            self.end,
            self.seen.join(" | ")
        )
    }
}

/// Reads `resp` until the response for JSON-RPC `id`, the end of the body, or `limit`.
async fn read_reply(resp: reqwest::Response, id: &Value, limit: Duration) -> Reply {
    let deadline = Instant::now() + limit;
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut reply = Reply {
        status,
        content_type: content_type.clone(),
        messages: Vec::new(),
        seen: Vec::new(),
        end: String::new(),
    };
    if content_type.starts_with("text/event-stream") {
        let mut body = SseBody::new(resp);
        reply.end = loop {
            match body.next(deadline).await {
                Ok(Some(ev)) => {
                    reply.seen.push(ev.brief());
                    if let Some(m) = ev.json() {
                        reply.messages.push(m);
                    }
                    if reply.response(id).is_some() {
                        break "answered".to_string();
                    }
                }
                Ok(None) => break "eof".to_string(),
                Err(e) => break e,
            }
        };
    } else {
        let left = deadline.saturating_duration_since(Instant::now());
        reply.end = match tokio::time::timeout(left, resp.text()).await {
            Ok(Ok(text)) => {
                if let Ok(v) = serde_json::from_str::<Value>(&text) {
                    reply.messages.push(v);
                }
                reply.seen.push(text.chars().take(300).collect());
                "body".to_string()
            }
            Ok(Err(e)) => format!("read error: {e}"),
            Err(_) => "timeout".to_string(),
        };
    }
    reply
}

/// A raw Streamable HTTP client session.
struct Raw {
    http: reqwest::Client,
    url: String,
    session: String,
}

impl Raw {
    /// `initialize` (with `capabilities`), then `notifications/initialized` (must be 202).
    async fn connect(url: &str, capabilities: Value) -> Result<Raw, String> {
        let http = http_client();
        let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": PROTOCOL,
            "capabilities": capabilities,
            "clientInfo": {"name": "mcp-reattach-interop-race-probe", "version": "0.0.0"}
        }});
        let resp = send_bounded(post_request(&http, url, None, &init)).await?;
        let session = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let reply = read_reply(resp, &json!(1), Duration::from_secs(10)).await;
        let Some(session) = session.filter(|_| {
            reply
                .response(&json!(1))
                .is_some_and(|r| r.get("result").is_some())
        }) else {
            return Err(format!("initialize failed: {}", reply.brief()));
        };
        let raw = Raw {
            http,
            url: url.to_string(),
            session,
        };
        let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        let resp = send_bounded(raw.post(&initialized)).await?;
        if resp.status().as_u16() != 202 {
            return Err(format!("notifications/initialized: {}", resp.status()));
        }
        Ok(raw)
    }

    fn post(&self, body: &Value) -> reqwest::RequestBuilder {
        post_request(&self.http, &self.url, Some(&self.session), body)
    }

    /// The standalone stream: `GET` without `Last-Event-ID`.
    fn get(&self) -> reqwest::RequestBuilder {
        self.http
            .get(&self.url)
            .header("accept", "text/event-stream")
            .header("mcp-session-id", &self.session)
            .header("mcp-protocol-version", PROTOCOL)
    }

    /// Ends the session (DELETE; at most 2 s, outcome ignored).
    async fn delete(&self) {
        let req = self
            .http
            .delete(&self.url)
            .header("mcp-session-id", &self.session)
            .header("mcp-protocol-version", PROTOCOL)
            .timeout(Duration::from_secs(2));
        let _ = req.send().await;
    }
}

fn post_request(
    http: &reqwest::Client,
    url: &str,
    session: Option<&str>,
    body: &Value,
) -> reqwest::RequestBuilder {
    let mut req = http
        .post(url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(serde_json::to_vec(body).expect("JSON body"));
    if let Some(sid) = session {
        req = req
            .header("mcp-session-id", sid)
            .header("mcp-protocol-version", PROTOCOL);
    }
    req
}

/// Sends `req`, waiting at most 10 s for the response head.
async fn send_bounded(req: reqwest::RequestBuilder) -> Result<reqwest::Response, String> {
    match tokio::time::timeout(Duration::from_secs(10), req.send()).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(format!("request failed: {e}")),
        Err(_) => Err("no response head within 10 s".to_string()),
    }
}

fn tool_call(id: u64, tool: &str, arguments: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": tool, "arguments": arguments
    }})
}

/// The tool result's text parsed as JSON (the interop tools answer JSON text), if any.
fn result_json(reply: &Reply, id: &Value) -> Option<Value> {
    let text = reply.response(id)?["result"]["content"][0]["text"].as_str()?;
    serde_json::from_str(text).ok()
}

/// Whether `m` is the `notify_now` log notification for `tag`.
fn is_tagged_notification(m: &Value, tag: &str) -> bool {
    m["method"] == "notifications/message" && m["params"]["data"]["tag"] == tag
}

// ---------------------------------------------------------------------------------------------
// 1. Race probe: GET and tools/call at the same moment
// ---------------------------------------------------------------------------------------------

/// What one race trial saw.
#[derive(Debug, Default)]
struct Trial {
    tag: String,
    /// Setup or request failure (no verdict on the race).
    error: Option<String>,
    get_status: Option<u16>,
    /// The notification on the GET stream / on the POST stream.
    on_get: usize,
    on_post: usize,
    /// The call was answered with a result.
    answered: bool,
    /// The server's view: a standalone stream was registered when it sent the notification.
    upstream_standalone_open: Option<bool>,
    /// How reading the GET ended, and its events (for reports).
    get_end: String,
    get_events: Vec<String>,
}

impl Trial {
    fn delivered_once(&self) -> bool {
        self.error.is_none()
            && self.get_status == Some(200)
            && self.on_get == 1
            && self.on_post == 0
            && self.answered
    }

    fn lost(&self) -> bool {
        self.error.is_none() && self.on_get + self.on_post == 0
    }

    fn brief(&self) -> String {
        format!(
            "{}: GET {:?} (end {}), on GET {}, on POST {}, answered {}, upstream standalone open {:?}{} events [{}]",
            self.tag,
            self.get_status,
            self.get_end,
            self.on_get,
            self.on_post,
            self.answered,
            self.upstream_standalone_open,
            self.error
                .as_ref()
                .map(|e| format!(", ERROR {e}"))
                .unwrap_or_default(),
            self.get_events.join(" | ")
        )
    }
}

async fn race_trial(url: String, tag: String, get_first: bool) -> Trial {
    let mut t = Trial {
        tag: tag.clone(),
        ..Trial::default()
    };
    let raw = match Raw::connect(&url, json!({})).await {
        Ok(r) => r,
        Err(e) => {
            t.error = Some(e);
            return t;
        }
    };
    let call = tool_call(2, "notify_now", json!({"tag": tag}));
    // Both requests leave at the same moment, from two tasks, on two connections.
    let (get, post) = if get_first {
        let get = tokio::spawn(send_bounded(raw.get()));
        let post = tokio::spawn(send_bounded(raw.post(&call)));
        (get, post)
    } else {
        let post = tokio::spawn(send_bounded(raw.post(&call)));
        let get = tokio::spawn(send_bounded(raw.get()));
        (get, post)
    };
    let (get, post) = (get.await.expect("GET task"), post.await.expect("POST task"));
    let (get, post) = match (get, post) {
        (Ok(g), Ok(p)) => (g, p),
        (g, p) => {
            t.error = Some(format!(
                "GET: {:?}, POST: {:?}",
                g.map(|r| r.status()),
                p.map(|r| r.status())
            ));
            raw.delete().await;
            return t;
        }
    };
    t.get_status = Some(get.status().as_u16());
    let get_is_sse = get
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("text/event-stream"));

    let id = json!(2);
    // When the call was answered (both readers run in this task).
    let answered_at: Cell<Option<Instant>> = Cell::new(None);
    let read_post = async {
        let reply = read_reply(post, &id, Duration::from_secs(8)).await;
        answered_at.set(Some(Instant::now()));
        reply
    };
    let read_get = async {
        let mut events = Vec::new();
        let mut on_get = 0;
        if !get_is_sse {
            let body = tokio::time::timeout(Duration::from_secs(2), get.text())
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            events.push(body.chars().take(200).collect());
            return (0, "not an event stream".to_string(), events);
        }
        let mut body = SseBody::new(get);
        // Until the call is answered (at most 8 s), then NOTIFY_WAIT; after the first
        // delivery, DUPLICATE_WAIT more.
        let hard = Instant::now() + Duration::from_secs(8) + NOTIFY_WAIT;
        let mut after_first: Option<Instant> = None;
        let end = loop {
            let deadline = after_first
                .or_else(|| answered_at.get().map(|at| at + NOTIFY_WAIT))
                .unwrap_or(hard)
                .min(hard);
            if Instant::now() >= deadline {
                break "waited".to_string();
            }
            // Short steps, so that the answer's arrival shortens the wait.
            let step = deadline.min(Instant::now() + Duration::from_millis(50));
            match body.next(step).await {
                Ok(Some(ev)) => {
                    if ev.json().is_some_and(|m| is_tagged_notification(&m, &tag)) {
                        on_get += 1;
                        if on_get == 1 {
                            after_first = Some(Instant::now() + DUPLICATE_WAIT);
                        }
                    }
                    events.push(ev.brief());
                }
                Ok(None) => break "eof".to_string(),
                Err(e) if e == "timeout" => continue,
                Err(e) => break e,
            }
        };
        (on_get, end, events)
    };
    let (reply, (on_get, get_end, get_events)) = tokio::join!(read_post, read_get);
    t.on_get = on_get;
    t.get_end = get_end;
    t.get_events = get_events;
    t.on_post = reply
        .messages
        .iter()
        .filter(|m| is_tagged_notification(m, &tag))
        .count();
    t.answered = reply
        .response(&id)
        .is_some_and(|r| r.get("result").is_some());
    t.upstream_standalone_open =
        result_json(&reply, &id).and_then(|v| v["standalone_open"].as_bool());
    if !t.answered {
        t.error = Some(format!("the call was not answered: {}", reply.brief()));
    }
    raw.delete().await;
    t
}

/// Runs [`TRIALS`] race trials against `url`, [`PARALLEL`] at a time.
async fn race_trials(url: &str, label: &str) -> Vec<Trial> {
    let url = url.to_string();
    let label = label.to_string();
    futures::stream::iter(0..TRIALS)
        .map(|i| race_trial(url.clone(), format!("{label}-{i}"), i % 2 == 0))
        .buffer_unordered(PARALLEL)
        .collect()
        .await
}

/// Counts of one target's trials.
struct Rates {
    delivered_once: usize,
    lost: usize,
    duplicated: usize,
    errors: usize,
    /// Trials whose notification the upstream sent while no standalone stream was registered.
    upstream_had_no_get: usize,
}

impl Rates {
    fn of(trials: &[Trial]) -> Rates {
        Rates {
            delivered_once: trials.iter().filter(|t| t.delivered_once()).count(),
            lost: trials.iter().filter(|t| t.lost()).count(),
            duplicated: trials
                .iter()
                .filter(|t| t.error.is_none() && t.on_get + t.on_post > 1)
                .count(),
            errors: trials.iter().filter(|t| t.error.is_some()).count(),
            upstream_had_no_get: trials
                .iter()
                .filter(|t| t.upstream_standalone_open == Some(false))
                .count(),
        }
    }

    fn show(&self, n: usize) -> String {
        format!(
            "lost {}/{n} ({:.0}%), delivered once {}/{n}, duplicated {}, errors {}, upstream had no GET {}",
            self.lost,
            100.0 * self.lost as f64 / n.max(1) as f64,
            self.delivered_once,
            self.duplicated,
            self.errors,
            self.upstream_had_no_get
        )
    }
}

/// What a second concurrent `GET` (no `Last-Event-ID`) gets while the first is open.
async fn second_get_observation(url: &str) -> String {
    let raw = match Raw::connect(url, json!({})).await {
        Ok(r) => r,
        Err(e) => return format!("setup failed: {e}"),
    };
    let first = match send_bounded(raw.get()).await {
        Ok(r) => r,
        Err(e) => return format!("first GET: {e}"),
    };
    let first_status = first.status().as_u16();
    let second = send_bounded(raw.get()).await;
    let out = match second {
        Ok(r) => {
            let status = r.status().as_u16();
            let ct = r
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let body = if ct.starts_with("text/event-stream") {
                "(event stream)".to_string()
            } else {
                tokio::time::timeout(Duration::from_secs(2), r.text())
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or_default()
            };
            // Is the first GET still open 500 ms later? (A replaced attachment would end.)
            let mut first_body = SseBody::new(first);
            let deadline = Instant::now() + Duration::from_millis(500);
            let mut first_events = Vec::new();
            let first_state = loop {
                match first_body.next(deadline).await {
                    Ok(Some(ev)) => first_events.push(ev.brief()),
                    Ok(None) => break "ended".to_string(),
                    Err(e) if e == "timeout" => break "still open".to_string(),
                    Err(e) => break e,
                }
            };
            let first_state = format!(
                "first GET {first_state} 500 ms later (events [{}])",
                first_events.join(" | ")
            );
            format!("first GET {first_status}; second GET {status} {ct:?} {body}; {first_state}")
        }
        Err(e) => format!("first GET {first_status}; second GET: {e}"),
    };
    raw.delete().await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_probe_raw_http() {
    let _serial = SERIAL.lock().await;
    let upstream = start_upstream().await;
    let direct_url = format!("{}/mcp", upstream.base_url());

    // (a) Direct: the control.
    let started = Instant::now();
    let direct = race_trials(&direct_url, "direct").await;
    let direct_ms = started.elapsed().as_millis();
    let direct_second_get = second_get_observation(&direct_url).await;

    // (b) Through the gateway, default flags.
    let gateway = Binary::start(upstream.addr, &[]).await;
    let started = Instant::now();
    let via = race_trials(&gateway.url(), "gateway").await;
    let via_ms = started.elapsed().as_millis();
    let via_second_get = second_get_observation(&gateway.url()).await;
    let via_metrics = scrape_metrics(&gateway).await;
    drop(gateway);

    // (c) Through the gateway with --hold-standalone=false (printed only).
    let no_hold = match Binary::try_start(
        "gateway",
        upstream.addr,
        &["--hold-standalone=false"],
        "/healthz",
    )
    .await
    {
        Ok(g) => {
            let trials = race_trials(&g.url(), "nohold").await;
            Ok(trials)
        }
        Err(NotStarted {
            code: Some(EX_USAGE),
            stderr,
        }) => Err(format!(
            "skipped: the gateway rejects --hold-standalone (exit 64: {})",
            stderr.lines().next().unwrap_or("")
        )),
        Err(NotStarted { code, stderr }) => panic!(
            "the gateway with --hold-standalone=false did not start (exit code {code:?}):\n{stderr}"
        ),
    };

    let (rd, rv) = (Rates::of(&direct), Rates::of(&via));
    if rd.lost == 0 {
        eprintln!(
            "NOTE: the race did not reproduce directly against the TypeScript server in {TRIALS} \
             trials (the GET won every time); the control shows no loss this run"
        );
    }
    let no_hold_text = match &no_hold {
        Ok(trials) => Rates::of(trials).show(trials.len()),
        Err(note) => note.clone(),
    };
    eprintln!(
        "SUMMARY 1 race-probe | {TRIALS} trials/target, {PARALLEL} parallel, GET and tools/call \
         started together | direct: {} ({direct_ms} ms) | gateway: {} ({via_ms} ms) | gateway \
         --hold-standalone=false: {no_hold_text} | {HELD_GAUGE} after the gateway trials: {} | \
         second concurrent GET: direct [{direct_second_get}], gateway [{via_second_get}]",
        rd.show(direct.len()),
        rv.show(via.len()),
        show_metric(&via_metrics, HELD_GAUGE),
    );
    for t in direct.iter().filter(|t| !t.delivered_once()) {
        eprintln!("  direct, not delivered once: {}", t.brief());
    }
    if let Ok(trials) = &no_hold {
        for t in trials.iter().filter(|t| !t.delivered_once()) {
            eprintln!("  nohold, not delivered once: {}", t.brief());
        }
    }

    // The harness itself: the direct calls were all answered.
    let direct_errors: Vec<String> = direct
        .iter()
        .filter(|t| t.error.is_some())
        .map(Trial::brief)
        .collect();
    assert!(
        direct_errors.is_empty(),
        "the control (direct) had trials that failed for another reason than the race:\n  {}",
        direct_errors.join("\n  ")
    );
    let failed: Vec<String> = via
        .iter()
        .filter(|t| !t.delivered_once())
        .map(Trial::brief)
        .collect();
    assert!(
        failed.is_empty(),
        "through the gateway, {} of {TRIALS} trials did not deliver the standalone notification \
         exactly once on the client's GET stream ({}):\n  {}",
        failed.len(),
        rv.show(via.len()),
        failed.join("\n  ")
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Elicitation sent while the client has no GET open
// ---------------------------------------------------------------------------------------------

/// The server's elicitation timeout (it ends the call with an error after this).
const ELICIT_TIMEOUT_MS: u64 = 4000;

/// What one elicitation run saw.
#[derive(Debug, Default)]
struct Elicitation {
    error: Option<String>,
    get_status: Option<u16>,
    /// `elicitation/create` requests read from the GET stream.
    requests: usize,
    get_events: Vec<String>,
    /// The status the POSTed JSON-RPC response got.
    answer_status: Option<u16>,
    /// The call's result: `answer` and `action`, or the error text.
    answer: Option<String>,
    result: String,
    call_ms: u128,
    /// `mcp_reattach_held_standalone_streams` while no client GET was open (gateway only).
    held_gauge: Option<String>,
}

impl Elicitation {
    fn ok(&self, tag: &str) -> bool {
        self.error.is_none()
            && self.get_status == Some(200)
            && self.requests == 1
            && self.answer_status == Some(202)
            && self.answer.as_deref() == Some(tag)
    }

    fn brief(&self) -> String {
        format!(
            "GET {:?}, elicitation/create on GET {}, response POST {:?}, call result after {} ms: {}{} | GET events [{}]",
            self.get_status,
            self.requests,
            self.answer_status,
            self.call_ms,
            self.result,
            self.error
                .as_ref()
                .map(|e| format!(", ERROR {e}"))
                .unwrap_or_default(),
            self.get_events.join(" | ")
        )
    }
}

async fn elicit_without_get(url: &str, tag: &str, gateway: Option<&Binary>) -> Elicitation {
    let mut out = Elicitation::default();
    let raw = match Raw::connect(url, json!({"elicitation": {}})).await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(e);
            return out;
        }
    };
    let id = json!(2);
    let call = tool_call(
        2,
        "elicit_now",
        json!({"tag": tag, "timeout_ms": ELICIT_TIMEOUT_MS}),
    );
    let started = Instant::now();
    let post = raw.post(&call);
    let call_id = id.clone();
    let call_task = tokio::spawn(async move {
        match send_bounded(post).await {
            Ok(resp) => Ok(read_reply(
                resp,
                &call_id,
                Duration::from_millis(ELICIT_TIMEOUT_MS + 4000),
            )
            .await),
            Err(e) => Err(e),
        }
    });
    // No GET while the tool sends its request.
    tokio::time::sleep(Duration::from_millis(250)).await;
    if let Some(g) = gateway {
        out.held_gauge = Some(show_metric(&scrape_metrics(g).await, HELD_GAUGE));
    }
    tokio::time::sleep(Duration::from_millis(250)).await;

    match send_bounded(raw.get()).await {
        Err(e) => out.error = Some(format!("GET: {e}")),
        Ok(get) => {
            out.get_status = Some(get.status().as_u16());
            let mut body = SseBody::new(get);
            let mut deadline = Instant::now() + Duration::from_secs(3);
            while let Ok(Some(ev)) = body.next(deadline).await {
                out.get_events.push(ev.brief());
                let Some(m) = ev.json() else { continue };
                if m["method"] != "elicitation/create" {
                    continue;
                }
                out.requests += 1;
                if out.requests > 1 {
                    continue;
                }
                let answer = json!({"jsonrpc": "2.0", "id": m["id"], "result": {
                    "action": "accept", "content": {"answer": tag}
                }});
                out.answer_status = match send_bounded(raw.post(&answer)).await {
                    Ok(r) => Some(r.status().as_u16()),
                    Err(e) => {
                        out.error = Some(format!("POSTing the elicitation response: {e}"));
                        None
                    }
                };
                // Keep reading a little: a second delivery would show.
                deadline = Instant::now() + DUPLICATE_WAIT;
            }
        }
    }
    match tokio::time::timeout(Duration::from_millis(ELICIT_TIMEOUT_MS + 6000), call_task).await {
        Ok(Ok(Ok(reply))) => {
            out.call_ms = started.elapsed().as_millis();
            match reply.response(&id) {
                Some(r) if r["result"]["isError"] == true => {
                    out.result = format!(
                        "isError: {}",
                        r["result"]["content"][0]["text"].as_str().unwrap_or("")
                    );
                }
                Some(r) if r.get("result").is_some() => {
                    let v = result_json(&reply, &id).unwrap_or(Value::Null);
                    out.answer = v["answer"].as_str().map(str::to_string);
                    out.result = v.to_string();
                }
                Some(r) => out.result = format!("JSON-RPC error {}", r["error"]),
                None => out.result = format!("no response: {}", reply.brief()),
            }
        }
        Ok(Ok(Err(e))) => out.result = format!("POST failed: {e}"),
        Ok(Err(e)) => out.result = format!("call task: {e}"),
        Err(_) => out.result = "no response within the limit".to_string(),
    }
    raw.delete().await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elicitation_without_get_raw_http() {
    let _serial = SERIAL.lock().await;
    let upstream = start_upstream().await;

    let direct = elicit_without_get(
        &format!("{}/mcp", upstream.base_url()),
        "direct-elicit",
        None,
    )
    .await;
    let gateway = Binary::start(upstream.addr, &[]).await;
    let via = elicit_without_get(&gateway.url(), "gateway-elicit", Some(&gateway)).await;

    eprintln!(
        "SUMMARY 2 elicitation-without-get | GET opened 500 ms after tools/call elicit_now | \
         direct: {} ({}) | gateway: {} ({}) | {HELD_GAUGE} while no client GET was open: {}",
        if direct.ok("direct-elicit") {
            "answered"
        } else {
            "LOST"
        },
        direct.brief(),
        if via.ok("gateway-elicit") {
            "answered"
        } else {
            "LOST"
        },
        via.brief(),
        via.held_gauge.as_deref().unwrap_or("n/a"),
    );
    assert!(
        via.ok("gateway-elicit"),
        "through the gateway, the elicitation/create the server sent while the client had no GET \
         open must be delivered once on the client's first GET, its answer accepted (202) and the \
         call must return the answer \"gateway-elicit\": {}",
        via.brief()
    );
}

// ---------------------------------------------------------------------------------------------
// 3. The real TypeScript SDK client
// ---------------------------------------------------------------------------------------------

/// Runs `ts-race-client.mjs <url> <plan>`: every `trial` line, and whether `done` came.
async fn run_sdk_client(url: &str, plan: &Value, limit: Duration) -> (Vec<Value>, bool) {
    let plan = plan.to_string();
    let mut proc = ChildProc::spawn_node("ts-race-client", "ts-race-client.mjs", &[url, &plan]);
    let deadline = Instant::now() + limit;
    let mut trials = Vec::new();
    let done = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match proc.next_line(left).await {
            NextLine::Line(l) => match serde_json::from_str::<Value>(&l) {
                Ok(v) if v["ev"] == "trial" => trials.push(v),
                Ok(v) if v["ev"] == "done" => break true,
                _ => eprintln!("[ts-race-client stdout] {l}"),
            },
            NextLine::Eof | NextLine::Timeout => break false,
        }
    };
    proc.wait_exit(Duration::from_secs(3)).await;
    proc.kill();
    (trials, done)
}

/// The kind of the `n`-th request of a trial, and when it was sent / answered.
fn request_times(trial: &Value, kind: &str) -> Option<(u64, Option<u64>)> {
    let r = trial["requests"]
        .as_array()?
        .iter()
        .find(|r| r["kind"] == kind)?;
    Some((r["sent_ms"].as_u64()?, r["head_ms"].as_u64()))
}

/// How the SDK ordered its standalone GET and its first tools/call, over `trials`.
fn ordering(trials: &[Value]) -> String {
    let (mut get_sent_first, mut get_head_first, mut both) = (0, 0, 0);
    let mut gaps = Vec::new();
    for t in trials {
        let (Some((gs, gh)), Some((ps, ph))) =
            (request_times(t, "GET"), request_times(t, "tools/call"))
        else {
            continue;
        };
        both += 1;
        if gs <= ps {
            get_sent_first += 1;
        }
        if let (Some(gh), Some(ph)) = (gh, ph) {
            if gh <= ph {
                get_head_first += 1;
            }
        }
        gaps.push(ps as i64 - gs as i64);
    }
    gaps.sort_unstable();
    format!(
        "GET handed to fetch before tools/call in {get_sent_first}/{both} (tools/call sent \
         {}..{} ms after it), GET answered first in {get_head_first}/{both}",
        gaps.first().copied().unwrap_or(0),
        gaps.last().copied().unwrap_or(0)
    )
}

fn sdk_trial_ok(t: &Value, tool: &str) -> bool {
    if !t["error"].is_null() || t["is_error"] == true {
        return false;
    }
    let result: Value = t["result"]
        .as_str()
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or(Value::Null);
    match tool {
        "notify_now" => t["delivered"] == 1 && result["tag"] == t["tag"],
        _ => t["elicited"] == 1 && result["answer"] == t["tag"],
    }
}

fn sdk_trial_brief(t: &Value) -> String {
    let reqs: Vec<String> = t["requests"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|r| {
                    format!(
                        "{} +{}ms->{}@{}",
                        r["kind"].as_str().unwrap_or("?"),
                        r["sent_ms"],
                        r["status"],
                        r["head_ms"]
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    format!(
        "{}: delivered {}, elicited {}, result {}, isError {}, error {} | {}",
        t["tag"].as_str().unwrap_or("?"),
        t["delivered"],
        t["elicited"],
        t["result"],
        t["is_error"],
        t["error"],
        reqs.join(", ")
    )
}

/// One batch of SDK trials against `url`: (passed, total, failures, ordering, done).
async fn sdk_batch(url: &str, plan: Value) -> (usize, Vec<Value>, bool) {
    let tool = plan["tool"].as_str().unwrap_or("notify_now").to_string();
    let (trials, done) = run_sdk_client(url, &plan, Duration::from_secs(60)).await;
    let passed = trials.iter().filter(|t| sdk_trial_ok(t, &tool)).count();
    (passed, trials, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn race_ts_sdk_client() {
    let _serial = SERIAL.lock().await;
    let upstream = start_upstream().await;
    let direct_url = format!("{}/mcp", upstream.base_url());
    let gateway = Binary::start(upstream.addr, &[]).await;
    let notify = json!({"tool": "notify_now", "trials": 16, "parallel": 4, "wait_ms": 2000});
    let elicit =
        json!({"tool": "elicit_now", "trials": 8, "parallel": 4, "elicit_timeout_ms": 3000});

    let (d_n_ok, d_n, d_n_done) = sdk_batch(&direct_url, notify.clone()).await;
    let (d_e_ok, d_e, d_e_done) = sdk_batch(&direct_url, elicit.clone()).await;
    let (g_n_ok, g_n, g_n_done) = sdk_batch(&gateway.url(), notify.clone()).await;
    let (g_e_ok, g_e, g_e_done) = sdk_batch(&gateway.url(), elicit.clone()).await;

    let get_headers = d_n
        .iter()
        .find_map(|t| {
            t["requests"]
                .as_array()?
                .iter()
                .find(|r| r["kind"] == "GET")
                .map(|r| r["headers"].to_string())
        })
        .unwrap_or_default();
    let all: Vec<Value> = d_n.iter().chain(&g_n).cloned().collect();
    eprintln!(
        "SUMMARY 3 ts-sdk-client | connect() then callTool at once | notify_now: direct {d_n_ok}/{} \
         delivered once, gateway {g_n_ok}/{} | elicit_now: direct {d_e_ok}/{} answered, gateway \
         {g_e_ok}/{} | SDK order: {} | GET headers the SDK sets: {get_headers}",
        d_n.len(),
        g_n.len(),
        d_e.len(),
        g_e.len(),
        ordering(&all),
    );
    for (label, tool, trials) in [
        ("direct", "notify_now", &d_n),
        ("direct", "elicit_now", &d_e),
        ("gateway", "notify_now", &g_n),
        ("gateway", "elicit_now", &g_e),
    ] {
        for t in trials.iter().filter(|t| !sdk_trial_ok(t, tool)) {
            eprintln!("  {label} {tool} failed: {}", sdk_trial_brief(t));
        }
    }

    assert!(
        d_n_done && d_e_done && d_n.len() == 16 && d_e.len() == 8,
        "the SDK client did not finish its direct (control) trials: {} + {} trial lines",
        d_n.len(),
        d_e.len()
    );
    let mut failures = Vec::new();
    if !(g_n_done && g_e_done && g_n.len() == 16 && g_e.len() == 8) {
        failures.push(format!(
            "the SDK client did not finish its trials through the gateway: {} + {} trial lines",
            g_n.len(),
            g_e.len()
        ));
    }
    for t in g_n.iter().filter(|t| !sdk_trial_ok(t, "notify_now")) {
        failures.push(format!(
            "notify_now: the standalone notification did not reach the SDK client exactly once: {}",
            sdk_trial_brief(t)
        ));
    }
    for t in g_e.iter().filter(|t| !sdk_trial_ok(t, "elicit_now")) {
        failures.push(format!(
            "elicit_now: the call did not return the client's answer: {}",
            sdk_trial_brief(t)
        ));
    }
    assert!(
        failures.is_empty(),
        "through the gateway, {} SDK client trial(s) failed:\n  - {}",
        failures.len(),
        failures.join("\n  - ")
    );
}
