//! Every upstream shape (GitHub issue 21): the real, unmodified MCP servers in each shape they
//! offer, with the real TypeScript and Python SDK clients, through the gateway and directly:
//!
//! ```text
//! client ──> Relay (cuts, refusals) ──> mcp-reattach ──> upstream
//! client ──> Relay (cuts)           ──────────────────> upstream   (the direct control)
//! ```
//!
//! Upstreams (each its own test, so they run in parallel): `ts1` (TypeScript SDK 1.32.2,
//! `tests/interop/ts-server.mjs`), `ts2` (TypeScript SDK v2's `createMcpHandler`,
//! `tests/interop/v2/ts2-server.mjs`; for 2025-era clients it serves only stateless SSE),
//! `py-mcp1` (Python SDK `mcp` 1.30.0 FastMCP, `tests/interop/py-server.py`), `fastmcp4`
//! (FastMCP 4.2.3 on the Python SDK 2, `tests/interop/fastmcp4/server.py`). Shapes:
//! `stateful-sse`, `stateless-sse` (no `Mcp-Session-Id`: the gateway mints `mra-<32 hex>`),
//! `stateful-json`, `stateless-json` (one JSON body per request: the gateway upgrades the
//! answer to a tagged SSE stream). Clients: `ts-client` (`ts-driver.mjs`), `py-client`
//! (`py-driver.py`), `raw-http` (this file, reqwest).
//!
//! Arms, per upstream × shape × client:
//! - `wire-direct` (raw-http, no gateway): what the shape is on the wire (session header or
//!   not, the content type of a `tools/call` answer, ids, the GET answer); asserts the fixture
//!   has the shape it claims.
//! - `gateway-1-cut`, `gateway-3-cuts`: a `slow_progress` call through a relay that cuts the
//!   client's connections mid-stream (SSE shapes: after progress 3 of 12 × 150 ms; after 2, 4, 6
//!   of 8 × 750 ms) or during the call (JSON shapes: 0.7 s after the call starts, i.e. after the
//!   200 ms upgrade grace, and for three cuts at 0.7, 2.3 and 3.9 s of a 10 × 550 ms call). The
//!   result must arrive exactly once with every progress event the shape carries (SSE: 1..=n
//!   once each, in order; JSON: the upstream sends none on the response); for the Python client
//!   exactly what its own resume cursor asks for (its SDK bugs, `explained_by_py_bugs`).
//! - `direct-1-cut`: the same single cut with no gateway loses the call (error or timeout).
//! - `gateway-gap`: a tiny window (4 events, 400 ms stall budget) and a 1.5 s outage: SSE
//!   shapes end the call fast with the gateway's -32010 `resumption failed`; a JSON answer is
//!   one event, which no window overflows, so it is delivered once after the outage.
//! - `gateway-retransmit` (raw-http; a recording relay between the gateway and the upstream):
//!   the seed's POST retransmission (`tools/call counter`, id 7, cut after the first event with
//!   an id, then the identical POST with `Last-Event-ID`) gets the original result and the tool
//!   runs once (id 8 gets the next count; the upstream logged two executions); no request that
//!   reached a stateless upstream carried `Mcp-Session-Id`.
//! - `gateway-delete` (raw-http, the same session): DELETE answers 200 (a minted session's by
//!   the gateway itself: no DELETE reaches the upstream) and a resume with the session's last
//!   cursor then gets 404.
//!
//! Every run prints `SHAPE | <upstream> | <shape> | <client> | <arm> | <outcome>`; a test fails
//! listing every failing row. Run with `cargo test --test sdk interop_shapes:: -- --nocapture`.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use support::{
    complete, cut_on_progress, explained_by_py_bugs, gap_error, http_client, install_shape_deps,
    refuse_and_cut_at, run_client, tiny_window, with_gateway, Cl, Driver, Event, Faults, Gw, Hook,
    Relay, Run, SseBody, SseEventExt, Upstream,
};
use tokio::time::Instant;

const PROTOCOL: &str = "2025-11-25";

// ---------------------------------------------------------------------------------------------
// Upstreams, shapes, arms
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Ts1,
    Ts2,
    Py,
    FastMcp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    StatefulSse,
    StatelessSse,
    StatefulJson,
    StatelessJson,
}

const ALL_SHAPES: [Shape; 4] = [
    Shape::StatefulSse,
    Shape::StatelessSse,
    Shape::StatefulJson,
    Shape::StatelessJson,
];

impl Shape {
    fn label(self) -> &'static str {
        match self {
            Shape::StatefulSse => "stateful-sse",
            Shape::StatelessSse => "stateless-sse",
            Shape::StatefulJson => "stateful-json",
            Shape::StatelessJson => "stateless-json",
        }
    }

    fn json(self) -> bool {
        matches!(self, Shape::StatefulJson | Shape::StatelessJson)
    }

    fn stateless(self) -> bool {
        matches!(self, Shape::StatelessSse | Shape::StatelessJson)
    }

    /// The Python fixtures' flags for this shape.
    fn py_flags(self) -> &'static [&'static str] {
        match self {
            Shape::StatefulSse => &[],
            Shape::StatelessSse => &["--stateless"],
            Shape::StatefulJson => &["--json"],
            Shape::StatelessJson => &["--stateless", "--json"],
        }
    }
}

impl Family {
    fn label(self) -> &'static str {
        match self {
            Family::Ts1 => "ts1",
            Family::Ts2 => "ts2",
            Family::Py => "py-mcp1",
            Family::FastMcp => "fastmcp4",
        }
    }

    /// The shapes this upstream offers a 2025-era client.
    fn shapes(self) -> &'static [Shape] {
        match self {
            // createMcpHandler serves legacy clients only through its stateless fallback (SSE;
            // its `responseMode` shapes modern exchanges only).
            Family::Ts2 => &[Shape::StatelessSse],
            _ => &ALL_SHAPES,
        }
    }

    async fn start(self, shape: Shape) -> Upstream {
        match self {
            Family::Ts1 => {
                Upstream::ts(match shape {
                    Shape::StatefulSse => "sse",
                    Shape::StatelessSse => "stateless-sse",
                    Shape::StatefulJson => "json",
                    Shape::StatelessJson => "stateless-json",
                })
                .await
            }
            Family::Ts2 => Upstream::ts2(&[]).await,
            Family::Py => Upstream::py_with(shape.py_flags()).await,
            Family::FastMcp => Upstream::fastmcp(shape.py_flags()).await,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arm {
    WireDirect,
    Cut1,
    Cut3,
    Direct,
    Gap,
    Retransmit,
    Delete,
}

/// The arms a real client runs, concurrently.
const CLIENT_ARMS: [Arm; 4] = [Arm::Cut1, Arm::Cut3, Arm::Direct, Arm::Gap];
const CLIENTS: [Cl; 2] = [Cl::Ts, Cl::Py];

impl Arm {
    fn label(self) -> &'static str {
        match self {
            Arm::WireDirect => "wire-direct",
            Arm::Cut1 => "gateway-1-cut",
            Arm::Cut3 => "gateway-3-cuts",
            Arm::Direct => "direct-1-cut",
            Arm::Gap => "gateway-gap",
            Arm::Retransmit => "gateway-retransmit",
            Arm::Delete => "gateway-delete",
        }
    }
}

/// One line of the table.
struct Row {
    family: Family,
    shape: Shape,
    client: &'static str,
    arm: Arm,
    outcome: Result<String, String>,
    /// What to show when the row failed (the client's output).
    detail: String,
}

impl Row {
    fn line(&self) -> String {
        let outcome = match &self.outcome {
            Ok(note) if note.starts_with("SDK BUG") => format!("SDK-BUG: {note}"),
            Ok(note) => format!("PASS: {note}"),
            Err(why) => format!("FAIL: {why}"),
        };
        format!(
            "SHAPE | {} | {} | {} | {} | {outcome}",
            self.family.label(),
            self.shape.label(),
            self.client,
            self.arm.label()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Client arms: plans, faults, verdicts
// ---------------------------------------------------------------------------------------------

/// `slow_progress {steps, interval_ms}`.
fn slow(steps: u32, interval_ms: u32) -> Value {
    json!({"tool": "slow_progress", "args": {"steps": steps, "interval_ms": interval_ms}})
}

/// At the client's `session` line (its call starts right after), cuts every live connection at
/// each offset in `at` (after refusing new connections for `refuse` from the first cut); counts
/// the cuts that hit a live connection in `hits`.
fn timed_cuts(at: &'static [u64], refuse: Option<Duration>, hits: Arc<AtomicUsize>) -> Hook {
    let mut fired = false;
    Box::new(move |v: &Value, f: &mut Faults| {
        if fired || v["ev"] != "session" {
            return;
        }
        fired = true;
        let relay = f.relay.clone();
        let hits = hits.clone();
        let start = std::time::Instant::now();
        std::thread::spawn(move || {
            for (k, &ms) in at.iter().enumerate() {
                let due = start + Duration::from_millis(ms);
                std::thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
                if k == 0 {
                    if let Some(r) = refuse {
                        relay.refuse_for(r);
                    }
                }
                if relay.cut_all() > 0 {
                    hits.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
    })
}

/// The steps of the call an arm makes, and how many cuts it aims for.
fn call_of(shape: Shape, arm: Arm) -> (u32, u32, usize) {
    match (shape.json(), arm) {
        (false, Arm::Cut3) => (8, 750, 3),
        (true, Arm::Cut3) => (10, 550, 3),
        (false, Arm::Gap) => (30, 50, 1),
        _ => (12, 150, 1),
    }
}

/// The plan and the fault hook of `arm` on `shape`.
fn plan_for(shape: Shape, arm: Arm, hits: Arc<AtomicUsize>) -> (Value, Hook) {
    let (steps, interval, _) = call_of(shape, arm);
    let timeout = if arm == Arm::Direct { 5000 } else { 15000 };
    let plan = json!({"timeout_ms": timeout, "calls": [slow(steps, interval)]});
    let hook = match (shape.json(), arm) {
        (false, Arm::Cut1 | Arm::Direct) => cut_on_progress(&[3]),
        (false, Arm::Cut3) => cut_on_progress(&[2, 4, 6]),
        (false, Arm::Gap) => refuse_and_cut_at(2.0, 1500),
        (true, Arm::Cut1 | Arm::Direct) => timed_cuts(&[700], None, hits),
        (true, Arm::Cut3) => timed_cuts(&[700, 2300, 3900], None, hits),
        (true, Arm::Gap) => timed_cuts(&[700], Some(Duration::from_millis(1500)), hits),
        (_, other) => unreachable!("{other:?} is not a client arm"),
    };
    (plan, hook)
}

/// How many `result` lines the client printed for call 0.
fn results_of_call0(run: &Run) -> usize {
    run.events
        .iter()
        .filter(|(_, v)| v["ev"] == "result" && v["call"] == 0)
        .count()
}

fn verdict(shape: Shape, arm: Arm, run: &Run, timed_hits: usize) -> Result<String, String> {
    let (steps, _, cuts) = call_of(shape, arm);
    let want_text = format!("done {steps}");
    let is_result = |t: &str| t == want_text;
    let hits = if shape.json() {
        timed_hits
    } else {
        run.cuts_hit
    };
    let progress = run.progress_of("0");
    if arm == Arm::Direct {
        if hits == 0 {
            return Err("the cut hit no live connection".into());
        }
        return match (run.results.get("0"), run.errors.get("0")) {
            (Some(r), _) => Err(format!(
                "the call completed without the gateway ({r:?}): the control cannot fail"
            )),
            (None, e) => Ok(format!(
                "call lost as expected: progress {progress:?}, {}",
                match (e, run.errors.iter().next()) {
                    (Some((m, c)), _) => format!("error {c:?} {m:?}"),
                    (None, Some((call, (m, c)))) => format!("error of {call}: {c:?} {m:?}"),
                    (None, None) => format!("no answer ({:?})", run.cut_short),
                }
            )),
        };
    }
    if arm == Arm::Gap && !shape.json() {
        return gap_error(run, "0");
    }
    if results_of_call0(run) > 1 {
        return Err(format!("{} results for one call", results_of_call0(run)));
    }
    // SSE: every progress 1..=steps once, in order. JSON: the upstream sends none on the
    // response, so none may arrive (and none twice).
    let want_steps = if shape.json() { 0 } else { steps };
    let bug = match complete(run, "0", want_steps, &is_result) {
        Ok(()) => None,
        Err(e) if run.client == Some(Cl::Py) => Some(
            explained_by_py_bugs(run, "0", steps, &is_result)
                .map_err(|why| format!("{e} ({why})"))?,
        ),
        Err(e) => return Err(e),
    };
    let want_hits = if bug.is_some() { 1 } else { cuts };
    if hits < want_hits {
        return Err(format!(
            "only {hits} of {cuts} cut(s) hit a live connection"
        ));
    }
    let resumes = run.resumes();
    if resumes.len() < want_hits {
        return Err(format!(
            "{hits} cut(s) but {} resume GET(s): {resumes:?}",
            resumes.len()
        ));
    }
    let progress = if progress.is_empty() {
        "progress none (JSON answer)".to_string()
    } else {
        format!("progress {progress:?}")
    };
    let note = format!(
        "{hits} cut(s), {} resume GET(s) (POST and standalone streams)",
        resumes.len()
    );
    Ok(match bug {
        Some(b) => format!("{b}; {note}"),
        None => format!("result once, {progress}; {note}"),
    })
}

/// One client run of `arm`: its own gateway (none for the direct control) and relay.
async fn client_arm(
    family: Family,
    shape: Shape,
    upstream_addr: std::net::SocketAddr,
    client: Cl,
    arm: Arm,
) -> Row {
    let base = format!("http://{upstream_addr}");
    let gw = match arm {
        Arm::Direct => None,
        Arm::Gap => Some(Gw::start(&base, tiny_window).await),
        _ => Some(Gw::start(&base, with_gateway).await),
    };
    let target = gw.as_ref().map_or(upstream_addr, |g| g.addr);
    let relay = Arc::new(Relay::start(target));
    let hits = Arc::new(AtomicUsize::new(0));
    let (plan, hook) = plan_for(shape, arm, hits.clone());
    let url = relay.url("/mcp");
    let mut faults = Faults {
        relay,
        gateway: target,
        cuts_hit: 0,
        deleted: None,
        cut_at: None,
    };
    let driver = Driver::spawn_process(client, &url, &plan);
    let run = run_client(client, driver, Duration::from_secs(40), &mut faults, hook).await;
    let outcome = verdict(shape, arm, &run, hits.load(Ordering::SeqCst));
    drop(gw);
    Row {
        family,
        shape,
        client: client.label(),
        arm,
        outcome,
        detail: run.report(),
    }
}

// ---------------------------------------------------------------------------------------------
// Raw HTTP arms: the shape on the wire, retransmission, DELETE
// ---------------------------------------------------------------------------------------------

/// One HTTP exchange, read to the JSON-RPC response for `id` (or the end of the body).
#[derive(Default)]
struct Exchange {
    status: u16,
    content_type: String,
    session: Option<String>,
    events: Vec<Event>,
    messages: Vec<Value>,
    end: String,
}

impl Exchange {
    fn result_text(&self, id: u64) -> Option<String> {
        let r = self.messages.iter().find(|m| m["id"] == id)?;
        Some(
            r["result"]["content"]
                .as_array()?
                .iter()
                .filter_map(|c| c["text"].as_str())
                .collect(),
        )
    }

    fn brief(&self) -> String {
        format!(
            "HTTP {} {:?} session {:?}, end {:?}, events [{}], messages {}",
            self.status,
            self.content_type,
            self.session,
            self.end,
            self.events
                .iter()
                .map(|e| e.brief())
                .collect::<Vec<_>>()
                .join(", "),
            self.messages.len()
        )
    }
}

/// A raw Streamable HTTP client on one session.
struct Raw {
    http: reqwest::Client,
    url: String,
    session: Option<String>,
}

impl Raw {
    fn new(url: String) -> Raw {
        Raw {
            http: http_client(),
            url,
            session: None,
        }
    }

    fn request(&self, method: reqwest::Method) -> reqwest::RequestBuilder {
        let mut req = self.http.request(method, &self.url);
        if let Some(sid) = &self.session {
            req = req
                .header("mcp-session-id", sid)
                .header("mcp-protocol-version", PROTOCOL);
        }
        req
    }

    async fn post(&self, body: &Value, lei: Option<&str>) -> Result<reqwest::Response, String> {
        let mut req = self
            .request(reqwest::Method::POST)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(body.to_string());
        if let Some(lei) = lei {
            req = req.header("last-event-id", lei);
        }
        match tokio::time::timeout(Duration::from_secs(10), req.send()).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(format!("POST: {e}")),
            Err(_) => Err("POST: no response head within 10 s".into()),
        }
    }

    /// POST `body` and read the answer to `id` (≤ 10 s).
    async fn exchange(&self, body: &Value, id: Option<u64>, lei: Option<&str>) -> Exchange {
        match self.post(body, lei).await {
            Ok(resp) => read_exchange(resp, id, Duration::from_secs(10)).await,
            Err(e) => Exchange {
                end: e,
                ..Exchange::default()
            },
        }
    }

    /// initialize + notifications/initialized; keeps the session id the answer carries.
    async fn initialize(&mut self) -> Result<Exchange, String> {
        let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": PROTOCOL, "capabilities": {},
            "clientInfo": {"name": "mcp-reattach-interop-shapes", "version": "0.0.0"}}});
        let ex = self.exchange(&init, Some(1), None).await;
        if ex.status != 200 || !ex.messages.iter().any(|m| m["id"] == 1) {
            return Err(format!("initialize: {}", ex.brief()));
        }
        self.session = ex.session.clone();
        let done = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        let ack = self.exchange(&done, None, None).await;
        if ack.status != 202 {
            return Err(format!("notifications/initialized: {}", ack.brief()));
        }
        Ok(ex)
    }

    /// The status and content type of a GET on the session (the body is not read).
    async fn get_head(&self, lei: Option<&str>) -> String {
        let mut req = self
            .request(reqwest::Method::GET)
            .header("accept", "text/event-stream");
        if let Some(lei) = lei {
            req = req.header("last-event-id", lei);
        }
        match tokio::time::timeout(Duration::from_secs(5), req.send()).await {
            Ok(Ok(r)) => format!(
                "{} {}",
                r.status().as_u16(),
                r.headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
            ),
            Ok(Err(e)) => format!("failed: {e}"),
            Err(_) => "no head within 5 s".into(),
        }
    }

    async fn delete(&self) -> u16 {
        match tokio::time::timeout(
            Duration::from_secs(5),
            self.request(reqwest::Method::DELETE).send(),
        )
        .await
        {
            Ok(Ok(r)) => r.status().as_u16(),
            _ => 0,
        }
    }
}

/// Reads `resp` to the response for `id` (any id if `None`), the end of the body, or `limit`.
async fn read_exchange(resp: reqwest::Response, id: Option<u64>, limit: Duration) -> Exchange {
    let deadline = Instant::now() + limit;
    let header = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let mut ex = Exchange {
        status: resp.status().as_u16(),
        content_type: header("content-type").unwrap_or_default(),
        session: header("mcp-session-id"),
        ..Exchange::default()
    };
    if ex.content_type.starts_with("text/event-stream") {
        let mut body = SseBody::new(resp);
        ex.end = loop {
            match body.next(deadline).await {
                Ok(Some(ev)) => {
                    let m = ev.json();
                    ex.events.push(ev);
                    if let Some(m) = m {
                        let answered =
                            m.get("method").is_none() && id.is_none_or(|id| m["id"] == id);
                        ex.messages.push(m);
                        if answered {
                            break "answered".into();
                        }
                    }
                }
                Ok(None) => break "eof".into(),
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
                "body".into()
            }
            Ok(Err(e)) => format!("read error: {e}"),
            Err(_) => "timeout".into(),
        };
    }
    ex
}

fn tools_call(id: u64, name: &str, args: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": name, "arguments": args, "_meta": {"progressToken": format!("tok-{id}")}}})
}

/// Whether `id` is a session id the gateway minted: `mra-` and 32 lowercase hex digits.
fn is_minted(id: &str) -> bool {
    id.strip_prefix("mra-").is_some_and(|h| {
        h.len() == 32
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// `wire-direct`: the fixture's shape, straight at the upstream.
async fn wire_direct(shape: Shape, upstream: &Upstream) -> Result<String, String> {
    let mut raw = Raw::new(format!("{}/mcp", upstream.base_url()));
    let init = raw.initialize().await?;
    let call = raw
        .exchange(
            &tools_call(2, "slow_progress", json!({"steps": 2, "interval_ms": 50})),
            Some(2),
            None,
        )
        .await;
    let get = raw.get_head(None).await;
    let ids = call.events.iter().filter(|e| e.id.is_some()).count();
    let progress = call
        .messages
        .iter()
        .filter(|m| m["method"] == "notifications/progress")
        .count();
    let note = format!(
        "session header {}; initialize answer {}; tools/call answer {} ({} progress, {} event ids, result {:?}); GET {get}",
        init.session.as_deref().map_or("none".to_string(), |s| format!("{s:?}")),
        init.content_type,
        call.content_type,
        progress,
        ids,
        call.result_text(2)
    );
    let mut wrong = Vec::new();
    if init.session.is_some() == shape.stateless() {
        wrong.push(if shape.stateless() {
            "a stateless shape answered initialize with Mcp-Session-Id"
        } else {
            "a stateful shape answered initialize without Mcp-Session-Id"
        });
    }
    let json_answer = call.content_type.starts_with("application/json");
    if json_answer != shape.json() {
        wrong.push("the tools/call answer's content type is not the shape's");
    }
    if call.result_text(2).as_deref() != Some("done 2") {
        wrong.push("no `done 2` result");
    }
    if wrong.is_empty() {
        Ok(note)
    } else {
        Err(format!("{}: {note}", wrong.join("; ")))
    }
}

/// `gateway-retransmit` and `gateway-delete` on one session through a gateway, with a
/// recording relay between the gateway and the upstream.
async fn retransmit_and_delete(
    shape: Shape,
    upstream: &Upstream,
) -> (Result<String, String>, Result<String, String>, String) {
    let tap = Relay::start_recording(upstream.addr);
    let gw = Gw::start(&format!("http://{}", tap.addr()), with_gateway).await;
    let mut raw = Raw::new(gw.url("/mcp"));
    let mut log = Vec::new();
    let retransmit = async {
        let init = raw.initialize().await?;
        log.push(format!("initialize: {}", init.brief()));
        let sid = init.session.clone().ok_or("no Mcp-Session-Id from the gateway")?;
        if shape.stateless() && !is_minted(&sid) {
            return Err(format!(
                "a stateless upstream's session id is {sid:?}, want one the gateway minted (mra-<32 hex>)"
            ));
        }
        // What a GET on the session gets through the gateway (a minted session's is forwarded
        // without the session header); reported, not judged.
        let get = raw.get_head(None).await;
        // The first attempt: up to the first event with an id, then the connection drops.
        let call7 = tools_call(7, "counter", json!({}));
        let resp = raw.post(&call7, None).await?;
        let first = format!(
            "{} {:?}",
            resp.status(),
            resp.headers().get("content-type")
        );
        let mut body = SseBody::new(resp);
        let mut cursor = None;
        while let Ok(Some(ev)) = body.next(Instant::now() + Duration::from_secs(5)).await {
            if ev.id.is_some() {
                cursor = ev.id;
                break;
            }
        }
        drop(body);
        let cursor = cursor.ok_or(format!(
            "the first POST of id 7 ({first}) had no event with an id within 5 s"
        ))?;
        // The tool finishes upstream (2 notifications 100 ms apart) while nobody is attached.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let again = raw.exchange(&call7, Some(7), Some(&cursor)).await;
        log.push(format!("id 7 again with Last-Event-ID {cursor}: {}", again.brief()));
        let call8 = raw
            .exchange(&tools_call(8, "counter", json!({})), Some(8), None)
            .await;
        log.push(format!("id 8: {}", call8.brief()));
        let n7 = again.result_text(7);
        let n8 = call8.result_text(8);
        let count = |t: &Option<String>| {
            t.as_deref()
                .and_then(|t| t.strip_prefix("applied "))
                .and_then(|n| n.parse::<u64>().ok())
        };
        let (Some(a), Some(b)) = (count(&n7), count(&n8)) else {
            return Err(format!(
                "results: id 7 again {n7:?}, id 8 {n8:?} (want `applied n`, `applied n+1`)"
            ));
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let runs = upstream
            .proc
            .stderr_lines()
            .iter()
            .filter(|l| l.contains("counter: applied"))
            .count();
        if b != a + 1 || runs != 2 {
            return Err(format!(
                "the tool ran again: id 7 again {n7:?}, id 8 {n8:?}, {runs} executions upstream (want 2)"
            ));
        }
        if again.events.first().map(|e| e.kind()) != Some("mcp-reattach/resumed") {
            return Err(format!(
                "the retransmission's first event is {:?}, want mcp-reattach/resumed",
                again.events.first().map(|e| e.brief())
            ));
        }
        Ok((sid, cursor, format!(
            "session {}, GET on it -> {get}; id 7 again: resumed, original {n7:?}; id 8 {n8:?}; 2 executions upstream",
            if shape.stateless() { "minted" } else { "the upstream's" }
        )))
    }
    .await;
    let heads = tap.recorded_request_heads();
    let carries = |h: &String, name: &str| {
        h.lines().skip(1).any(|l| {
            l.split_once(':')
                .is_some_and(|(n, _)| n.trim().eq_ignore_ascii_case(name))
        })
    };
    let leaked_session = heads
        .iter()
        .filter(|h| carries(h, "mcp-session-id"))
        .count();
    let leaked_lei = heads.iter().filter(|h| carries(h, "last-event-id")).count();
    let (retransmit, session) = match retransmit {
        Ok((sid, cursor, note)) => {
            if shape.stateless() && leaked_session > 0 {
                (
                    Err(format!(
                        "{leaked_session} of {} requests reaching the stateless upstream carried Mcp-Session-Id",
                        heads.len()
                    )),
                    None,
                )
            } else if leaked_lei > 0 {
                (
                    Err(format!(
                        "{leaked_lei} upstream requests carried Last-Event-ID"
                    )),
                    None,
                )
            } else {
                (
                    Ok(format!(
                        "{note}; no upstream request carried the session header or Last-Event-ID"
                    )),
                    Some((sid, cursor)),
                )
            }
        }
        Err(e) => (Err(e), None),
    };
    let delete = match session {
        None => Err("not run (the retransmission arm failed)".to_string()),
        Some((_sid, cursor)) => {
            let before = tap.recorded_request_heads().len();
            let status = raw.delete().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            let forwarded = tap.recorded_request_heads()[before..]
                .iter()
                .any(|h| h.starts_with("DELETE"));
            let resume = raw.get_head(Some(&cursor)).await;
            log.push(format!(
                "DELETE -> {status}, forwarded {forwarded}; resume -> {resume}"
            ));
            if status != 200 {
                Err(format!("DELETE answered {status}"))
            } else if shape.stateless() && forwarded {
                Err("the minted session's DELETE reached the upstream".into())
            } else if !resume.starts_with("404") {
                Err(format!("a resume after the DELETE got {resume}, want 404"))
            } else {
                Ok(format!(
                    "DELETE 200 ({}); resume with the last cursor -> {resume}",
                    if forwarded {
                        "forwarded to the upstream"
                    } else {
                        "answered by the gateway"
                    }
                ))
            }
        }
    };
    drop(gw);
    (retransmit, delete, log.join("\n  "))
}

// ---------------------------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------------------------

/// Every shape of `family`, one after the other; per shape the client arms run concurrently,
/// then the raw arms. Prints every row, then fails listing the failing ones.
async fn run_family(family: Family) {
    install_shape_deps().await;
    let mut rows = Vec::new();
    for &shape in family.shapes() {
        let upstream = family.start(shape).await;
        let raw_row = |arm, outcome, detail| Row {
            family,
            shape,
            client: "raw-http",
            arm,
            outcome,
            detail,
        };
        rows.push(raw_row(
            Arm::WireDirect,
            wire_direct(shape, &upstream).await,
            String::new(),
        ));
        let mut tasks = Vec::new();
        for arm in CLIENT_ARMS {
            for client in CLIENTS {
                tasks.push(tokio::spawn(client_arm(
                    family,
                    shape,
                    upstream.addr,
                    client,
                    arm,
                )));
            }
        }
        for t in tasks {
            let row = t.await.expect("client arm task");
            eprintln!("{}", row.line());
            rows.push(row);
        }
        let (retransmit, delete, log) = retransmit_and_delete(shape, &upstream).await;
        rows.push(raw_row(Arm::Retransmit, retransmit, log.clone()));
        rows.push(raw_row(Arm::Delete, delete, log));
    }
    let table: Vec<String> = rows.iter().map(Row::line).collect();
    eprintln!("\n{}\n", table.join("\n"));
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| r.outcome.is_err())
        .map(|r| format!("{}\n  {}", r.line(), r.detail.replace('\n', "\n  ")))
        .collect();
    assert!(
        failed.is_empty(),
        "{}: {} of {} rows failed:\n{}\n\nthe table:\n{}",
        family.label(),
        failed.len(),
        rows.len(),
        failed.join("\n\n"),
        table.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ts1_every_shape() {
    run_family(Family::Ts1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ts2_create_mcp_handler() {
    run_family(Family::Ts2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn py_mcp1_every_shape() {
    run_family(Family::Py).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fastmcp4_every_shape() {
    run_family(Family::FastMcp).await;
}
