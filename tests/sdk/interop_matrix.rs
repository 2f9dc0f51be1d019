//! The interop matrix (GitHub issue 3): real MCP clients × real, unmodified MCP servers, with the
//! gateway between them and a fault-injecting relay in front of it:
//!
//! ```text
//! client ──> Relay (cuts, refusals) ──> mcp-reattach ──> upstream (no event store)
//! ```
//!
//! Clients (all pinned): the TypeScript SDK (`tests/interop/ts-driver.mjs`), the Python SDK
//! (`tests/interop/py-driver.py`), and rmcp (in this file). Upstreams: the TypeScript SDK server
//! in SSE and in JSON-response mode (`ts-server.mjs`), the Python SDK's FastMCP
//! (`py-server.py`), and `@modelcontextprotocol/server-everything`.
//!
//! Each test is one scenario against one upstream and runs the three clients concurrently (each
//! with its own gateway and relay), then asserts every pair and prints a table row per pair.
//! The scenarios are a table ([`Scenario`]: the plan, the faults and the verdict of each case)
//! driving one body ([`run_scenario`]).
//! Scenarios (numbers as in the issue and in docs/interop.md):
//!
//! 1. a progress-streaming call completes with every notification and the result exactly once,
//!    in order: (a) through 1 cut, (b) through 3 cuts, (c) through a cut and ~1.3 s of refused
//!    reconnects;
//! 2. a gap (window of 4 events, a disconnect longer than the 400 ms stall budget, which the
//!    upstream overflows): the pending call ends within seconds with the gateway's -32010
//!    error, and nothing is delivered twice;
//! 3. notifications on the standalone GET stream survive a cut;
//! 4. DELETE ends the session: the client's resume gets 404 (`unknown-session`);
//! 5. concurrent calls on one session, cut twice: no event of one call's stream ever shows up on
//!    another's (checked on the wire: every SSE event the client received is tapped).
//!
//! JSON-response mode (`ts-json`): concurrent calls each get their own result; a call cut 0.7 s
//! in (after the 200 ms upgrade grace) is delivered exactly once, because the gateway answered
//! its POST with a tagged SSE stream the client resumes (`json-call-cut`); with
//! `--json-upgrade false` the same cut fails the call at once (`json-call-cut-upgrade-off`).
//! Every upstream shape (stateless, JSON) of every SDK: tests/sdk/interop_shapes.rs.
//!
//! Controls (no gateway) show that the checks can fail. Needs Node.js >= 18, npm and Python >=
//! 3.10 (first runs install `tests/interop/node_modules` and `tests/interop/.venv`). Run with
//! `cargo test --test sdk interop_matrix:: -- --nocapture` to see every client's output.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use support::{
    complete, cut_on_progress, explained_by_py_bugs, gap_error, refuse_and_cut_at, run_pairs,
    tiny_window, with_gateway, Cl, Driver, Faults, Hook, Run, Upstream, ALL_CLIENTS,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

// ---------------------------------------------------------------------------------------------
// Clients and upstreams (the clients' drivers and runs: tests/support/clients.rs)
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Up {
    TsSse,
    TsJson,
    Py,
    Everything,
}

impl Up {
    async fn start(self) -> Upstream {
        support::install_interop_deps().await;
        match self {
            Up::TsSse => Upstream::ts("sse").await,
            Up::TsJson => Upstream::ts("json").await,
            Up::Py => Upstream::py().await,
            Up::Everything => Upstream::everything().await,
        }
    }

    /// A call that sends `steps` progress notifications `interval_ms` apart.
    fn slow(self, steps: u32, interval_ms: u32) -> Value {
        match self {
            Up::Everything => json!({
                "tool": "trigger-long-running-operation",
                "args": {"duration": f64::from(steps * interval_ms) / 1000.0, "steps": steps}
            }),
            _ => {
                json!({"tool": "slow_progress", "args": {"steps": steps, "interval_ms": interval_ms}})
            }
        }
    }

    /// Whether `text` is the result of `slow(steps, _)`.
    fn is_slow_result(self, text: &str, steps: u32) -> bool {
        match self {
            Up::Everything => text.contains(&format!("Steps: {steps}.")),
            _ => text == format!("done {steps}"),
        }
    }
}

/// Starts a client driver: the TS and Python processes, or the in-process rmcp driver.
fn spawn_driver(client: Cl, url: &str, plan: &Value) -> Driver {
    match client {
        Cl::Rmcp => {
            let (tx, lines) = mpsc::unbounded_channel();
            let log = Arc::new(Mutex::new(Vec::new()));
            let task = tokio::spawn(rmcp_driver::run(
                url.to_string(),
                plan.clone(),
                tx,
                log.clone(),
            ));
            Driver::Channel { lines, log, task }
        }
        _ => Driver::spawn_process(client, url, plan),
    }
}

/// Collects per-pair failures so one test reports every pair at once.
struct Verdicts {
    scenario: &'static str,
    upstream: &'static str,
    failures: Vec<String>,
}

impl Verdicts {
    fn new(scenario: &'static str, upstream: &Upstream) -> Verdicts {
        Verdicts {
            scenario,
            upstream: upstream.label,
            failures: Vec::new(),
        }
    }

    fn check(&mut self, run: &Run, outcome: Result<String, String>) {
        let client = run.client.map_or("?", Cl::label);
        match outcome {
            Ok(note) => eprintln!(
                "RESULT | {} | {client} | {} | {} | {note}",
                self.scenario,
                self.upstream,
                if note.starts_with("SDK BUG") {
                    "SDK-BUG"
                } else {
                    "PASS"
                }
            ),
            Err(why) => {
                eprintln!(
                    "RESULT | {} | {client} | {} | FAIL | {why}",
                    self.scenario, self.upstream
                );
                self.failures.push(format!(
                    "=== {client} × {}: {why}\n{}",
                    self.upstream,
                    run.report()
                ));
            }
        }
    }

    fn assert_all(self) {
        assert!(
            self.failures.is_empty(),
            "scenario {} against {}: {} pair(s) failed\n{}",
            self.scenario,
            self.upstream,
            self.failures.len(),
            self.failures.join("\n\n")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Checks ([`complete`] and [`explained_by_py_bugs`]: tests/support/clients.rs)
// ---------------------------------------------------------------------------------------------

/// rmcp 3.11.0 runs every notification handler in its own spawned task, so a burst of progress
/// (a replay after a resume arrives in one read) can reach `on_progress` out of the order it had
/// on the wire. For rmcp, "exactly once, in order" is therefore checked on the wire (the taps of
/// its HTTP client) and "exactly once" at the handler.
fn rmcp_wire_order(run: &Run, up: Up, call: &str, steps: u32) -> Result<String, String> {
    let want: Vec<u64> = (1..=u64::from(steps)).collect();
    let mut handler = run.progress_of(call);
    handler.sort_unstable();
    // rmcp replaces the request's `_meta.progressToken` with its own counter (0, 1, … in the
    // order the calls start), which is also how the driver names the calls.
    let token = call.to_string();
    let wire: Vec<u64> = run
        .taps()
        .iter()
        .filter(|t| {
            t["rpc"]["tok"].as_u64().map(|n| n.to_string()).as_deref() == Some(token.as_str())
        })
        .filter_map(|t| t["rpc"]["p"].as_f64().map(|p| p as u64))
        .collect();
    let result_ok = run
        .results
        .get(call)
        .is_some_and(|t| up.is_slow_result(t, steps));
    if handler == want && wire == want && result_ok && !run.errors.contains_key(call) {
        Ok(format!(
            "SDK BUG (rmcp): on the wire 1..={steps} in order, but the handler saw {:?}",
            run.progress_of(call)
        ))
    } else {
        Err(format!("wire order {wire:?}, handler (sorted) {handler:?}"))
    }
}

/// `complete`, or for the Python client the known SDK bugs (see above), or for rmcp the
/// handler reordering (see above).
fn complete_or_py_bug(run: &Run, up: Up, call: &str, steps: u32) -> Result<Option<String>, String> {
    let is_result = |t: &str| up.is_slow_result(t, steps);
    match complete(run, call, steps, &is_result) {
        Ok(()) => Ok(None),
        Err(e) if run.client == Some(Cl::Rmcp) => rmcp_wire_order(run, up, call, steps)
            .map(Some)
            .map_err(|why| format!("{e} ({why})")),
        Err(e) if run.client == Some(Cl::Py) => explained_by_py_bugs(run, call, steps, &is_result)
            .map(Some)
            .map_err(|why| format!("{e} ({why})")),
        Err(e) => Err(e),
    }
}

/// The gateway's cursor `<epoch>.<stream>.<seq>` → `(stream, seq)`.
fn cursor(id: &str) -> Option<(u32, u64)> {
    let mut parts = id.split('.');
    let (e, s, q) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || e.len() != 16 {
        return None;
    }
    Some((s.parse().ok()?, q.parse().ok()?))
}

/// Stream isolation on the wire, from the client's taps: each HTTP response carries events of
/// one gateway stream only (a resume: the stream its `Last-Event-ID` names); each stream carries
/// at most one request's progress token and response id, and no token or response id shows up
/// on two streams; no (stream, seq) is delivered twice on a response.
fn stream_isolation(run: &Run) -> Result<String, String> {
    let taps = run.taps();
    let mut conn_streams: BTreeMap<i64, BTreeSet<u32>> = BTreeMap::new();
    let mut stream_tokens: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
    let mut stream_rids: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
    let mut token_streams: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    let mut rid_streams: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut tagged = 0;
    for t in &taps {
        let Some(id) = t["id"].as_str() else { continue };
        let Some((stream, _seq)) = cursor(id) else {
            continue;
        };
        tagged += 1;
        let conn = t["conn"].as_i64().unwrap_or(-1);
        conn_streams.entry(conn).or_default().insert(stream);
        if let Some(lei) = t["lei"].as_str() {
            if let Some((want, _)) = cursor(lei) {
                if want != stream {
                    problems.push(format!(
                        "resume of stream {want} (Last-Event-ID {lei}) delivered event {id} of stream {stream}"
                    ));
                }
            }
        }
        let rpc = &t["rpc"];
        if let Some(tok) = rpc.get("tok").filter(|v| !v.is_null()) {
            let tok = tok.to_string();
            stream_tokens.entry(stream).or_default().insert(tok.clone());
            token_streams.entry(tok).or_default().insert(stream);
        }
        if rpc.get("m").is_none_or(Value::is_null) {
            if let Some(rid) = rpc.get("id").filter(|v| !v.is_null()) {
                let rid = rid.to_string();
                stream_rids.entry(stream).or_default().insert(rid.clone());
                rid_streams.entry(rid).or_default().insert(stream);
            }
        }
    }
    for (conn, streams) in &conn_streams {
        if streams.len() > 1 {
            problems.push(format!("connection {conn} carried streams {streams:?}"));
        }
    }
    for (s, toks) in &stream_tokens {
        if toks.len() > 1 {
            problems.push(format!("stream {s} carried progress tokens {toks:?}"));
        }
    }
    for (s, rids) in &stream_rids {
        if rids.len() > 1 {
            problems.push(format!("stream {s} carried responses {rids:?}"));
        }
    }
    for (tok, streams) in &token_streams {
        if streams.len() > 1 {
            problems.push(format!(
                "progress token {tok} showed up on streams {streams:?}"
            ));
        }
    }
    for (rid, streams) in &rid_streams {
        if streams.len() > 1 {
            problems.push(format!("response {rid} showed up on streams {streams:?}"));
        }
    }
    if tagged == 0 {
        problems.push("no gateway-tagged event was tapped".to_string());
    }
    if problems.is_empty() {
        Ok(format!(
            "{tagged} tagged events on {} streams, isolated",
            stream_tokens.len().max(stream_rids.len())
        ))
    } else {
        Err(problems.join("; "))
    }
}

/// Errors the clients report for a response they cannot match (a leak from another stream).
fn unknown_response_errors(run: &Run) -> Vec<String> {
    run.stderr
        .iter()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("unknown message id") || l.contains("unknown request id")
        })
        .cloned()
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The scenarios: a table of cases ([`Scenario`]), one body ([`run_scenario`])
// ---------------------------------------------------------------------------------------------

/// One case of the matrix: what every client runs, through what, and how each run is judged.
struct Scenario {
    /// Its name in the `RESULT` rows (numbered as in the issue and in docs/interop.md).
    name: &'static str,
    /// The clients, run concurrently, each through its own relay (and gateway).
    clients: &'static [Cl],
    /// The gateway's config; `None`: no gateway, the relay points at the upstream (a control).
    gateway: Option<fn(&mut mcp_reattach::Config)>,
    /// How long one client run may take.
    limit: Duration,
    /// The plan and the fault hook of one client run against `up` (a new hook per client).
    plan: fn(Up) -> (Value, Hook),
    /// The verdict on one run against `up`: a note for the table row, or why the pair failed.
    verdict: fn(&Run, Up) -> Result<String, String>,
    /// Whether a passing verdict is checked once more on the wire ([`resume_gets_404`]).
    raw_resume: bool,
}

/// The one body of every case: starts `up`, runs the clients of `s` against it, judges every
/// run, then fails with every failing pair.
async fn run_scenario(up: Up, s: &Scenario) {
    let upstream = up.start().await;
    let runs = run_pairs(
        &upstream,
        s.clients,
        s.gateway,
        s.limit,
        spawn_driver,
        |_| (s.plan)(up),
    )
    .await;
    let mut v = Verdicts::new(s.name, &upstream);
    for run in &runs {
        let mut outcome = (s.verdict)(run, up);
        if s.raw_resume {
            outcome = resume_gets_404(run, outcome).await;
        }
        v.check(run, outcome);
    }
    v.assert_all();
}

const S1A_ONE_CUT: Scenario = Scenario {
    name: "1a-one-cut",
    clients: &ALL_CLIENTS,
    gateway: Some(with_gateway),
    limit: Duration::from_secs(45),
    plan: |up| cuts_plan(up.slow(8, 150), &[3]),
    verdict: |run, up| cuts_verdict(run, up, 8, &[3]),
    raw_resume: false,
};

const S1B_THREE_CUTS: Scenario = Scenario {
    name: "1b-three-cuts",
    clients: &ALL_CLIENTS,
    gateway: Some(with_gateway),
    limit: Duration::from_secs(45),
    plan: |up| cuts_plan(up.slow(8, 750), &[2, 4, 6]),
    verdict: |run, up| cuts_verdict(run, up, 8, &[2, 4, 6]),
    raw_resume: false,
};

const S1C_CUT_THEN_REFUSAL: Scenario = Scenario {
    name: "1c-cut-then-refusal",
    clients: &ALL_CLIENTS,
    gateway: Some(with_gateway),
    limit: Duration::from_secs(30),
    plan: refusal_plan,
    verdict: refusal_verdict,
    raw_resume: false,
};

const S2_GAP: Scenario = Scenario {
    name: "2-gap",
    clients: &ALL_CLIENTS,
    gateway: Some(tiny_window),
    limit: Duration::from_secs(40),
    plan: gap_plan,
    verdict: gap_verdict,
    raw_resume: false,
};

const S3_STANDALONE: Scenario = Scenario {
    name: "3-standalone-notifications",
    clients: &ALL_CLIENTS,
    gateway: Some(with_gateway),
    limit: Duration::from_secs(40),
    plan: standalone_plan,
    verdict: standalone_verdict,
    raw_resume: false,
};

const S4_DELETE: Scenario = Scenario {
    name: "4-delete-then-resume",
    clients: &ALL_CLIENTS,
    gateway: Some(with_gateway),
    limit: Duration::from_secs(40),
    plan: delete_plan,
    verdict: delete_verdict,
    raw_resume: true,
};

const S5_CONCURRENT: Scenario = Scenario {
    name: "5-concurrent-calls",
    clients: &ALL_CLIENTS,
    gateway: Some(with_gateway),
    limit: Duration::from_secs(30),
    plan: concurrent_plan,
    verdict: concurrent_verdict,
    raw_resume: false,
};

const JSON_CALLS: Scenario = Scenario {
    name: "json-concurrent-calls-no-cut",
    clients: &ALL_CLIENTS,
    gateway: Some(with_gateway),
    limit: Duration::from_secs(30),
    plan: json_calls_plan,
    verdict: json_calls_verdict,
    raw_resume: false,
};

/// A JSON-mode call cut 0.7 s in (after the 200 ms upgrade grace): the gateway answered the
/// POST with a tagged SSE stream (priming event with an id, keep-alives), so the client resumes
/// and gets the JSON answer, exactly once.
const JSON_CUT: Scenario = Scenario {
    name: "json-call-cut",
    clients: &ALL_CLIENTS,
    gateway: Some(with_gateway),
    limit: Duration::from_secs(30),
    plan: json_cut_plan,
    verdict: json_cut_verdict,
    raw_resume: false,
};

/// The same cut with `--json-upgrade false`: the JSON answer passes through as it came, so there
/// is no stream to resume and the call fails at once (no hang).
const JSON_CUT_UPGRADE_OFF: Scenario = Scenario {
    name: "json-call-cut-upgrade-off",
    clients: &ALL_CLIENTS,
    gateway: Some(upgrade_off),
    limit: Duration::from_secs(30),
    plan: json_cut_plan,
    verdict: json_cut_upgrade_off_verdict,
    raw_resume: false,
};

/// The gateway without the JSON upgrade (`--json-upgrade false`).
fn upgrade_off(c: &mut mcp_reattach::Config) {
    c.json_upgrade = false;
}

/// Without the gateway, a server without an event store sets no ids: no client can resume, so
/// one cut loses the rest of the call.
const CONTROL_1A: Scenario = Scenario {
    name: "control-1a-no-gateway",
    clients: &ALL_CLIENTS,
    gateway: None,
    limit: Duration::from_secs(20),
    plan: control_1a_plan,
    verdict: control_1a_verdict,
    raw_resume: false,
};

/// server-everything resumes by itself (its own event store), but its store replays the events
/// of every stream after the cursor: concurrent calls cut at once see other calls' events. The
/// checks of scenario 5 catch it (this is the upstream bug the gateway's per-stream cursors
/// avoid).
const CONTROL_5_EVERYTHING: Scenario = Scenario {
    name: "control-5-everything-own-store",
    clients: &[Cl::Ts],
    gateway: None,
    limit: Duration::from_secs(30),
    plan: control_5_plan,
    verdict: control_5_verdict,
    raw_resume: false,
};

// ---------------------------------------------------------------------------------------------
// Scenario 1: a progress-streaming call through cuts and refusals
// ---------------------------------------------------------------------------------------------

/// 1a, 1b: `call`, cut after each progress value in `cuts`.
fn cuts_plan(call: Value, cuts: &'static [u64]) -> (Value, Hook) {
    (
        json!({"timeout_ms": 15000, "calls": [call]}),
        cut_on_progress(cuts),
    )
}

/// 1a, 1b: the call of `steps` completes through every cut in `cuts`, each resumed.
fn cuts_verdict(run: &Run, up: Up, steps: u32, cuts: &[u64]) -> Result<String, String> {
    complete_or_py_bug(run, up, "0", steps).and_then(|bug| {
        // A client that gave up (Python SDK bug) may leave later cuts nothing to hit.
        let want = if bug.is_some() { 1 } else { cuts.len() };
        if run.cuts_hit < want {
            return Err(format!(
                "only {} of {} cuts hit a live connection",
                run.cuts_hit,
                cuts.len()
            ));
        }
        let resumes = run.resumes();
        if resumes.len() < want {
            return Err(format!(
                "expected ≥ {} resumes, saw {resumes:?}",
                cuts.len()
            ));
        }
        stream_isolation(run)?;
        Ok(format!(
            "{} cut(s), {} resume GET(s)",
            run.cuts_hit,
            resumes.len()
        ))
    })
}

fn refusal_plan(up: Up) -> (Value, Hook) {
    (
        json!({"timeout_ms": 20000, "calls": [up.slow(10, 150)]}),
        refuse_and_cut_at(3.0, 1300),
    )
}

fn refusal_verdict(run: &Run, up: Up) -> Result<String, String> {
    complete_or_py_bug(run, up, "0", 10).and_then(|bug| {
        let failed: Vec<_> = run
            .resumes()
            .into_iter()
            .filter(|(_, out)| !out.starts_with("200"))
            .collect();
        if run.refused == 0 || failed.is_empty() {
            return Err(format!(
                "the refusal was never exercised (refused {}, failed resumes {failed:?})",
                run.refused
            ));
        }
        let note = format!(
            "{} refused connection(s), {} failed resume(s) first",
            run.refused,
            failed.len()
        );
        Ok(bug.map_or(note.clone(), |b| format!("{b}; {note}")))
    })
}

// ---------------------------------------------------------------------------------------------
// Scenario 2: a gap ends the pending call at once with the gateway's error
// ---------------------------------------------------------------------------------------------

fn gap_plan(up: Up) -> (Value, Hook) {
    (
        json!({"timeout_ms": 30000, "calls": [up.slow(30, 50)]}),
        refuse_and_cut_at(2.0, 1500),
    )
}

fn gap_verdict(run: &Run, _: Up) -> Result<String, String> {
    gap_error(run, "0")
}

// ---------------------------------------------------------------------------------------------
// Scenario 3: notifications on the standalone GET stream survive a cut
// ---------------------------------------------------------------------------------------------

fn standalone_plan(up: Up) -> (Value, Hook) {
    let everything = up == Up::Everything;
    let mut seen = 0;
    let plan = if everything {
        // Simulated logging: one message at once, then one every 5 s (random levels, no
        // sequence number). Expect 4, stop before the 4th is due: exactly 3 must come.
        json!({"timeout_ms": 20000, "notify": {"tool": "toggle-simulated-logging", "args": {}, "expect": 4, "wait_ms": 13000}})
    } else {
        json!({"timeout_ms": 20000, "notify": {"tool": "notify_standalone", "args": {"count": 8, "interval_ms": 300}, "expect": 8, "wait_ms": 12000}})
    };
    (
        plan,
        Box::new(move |v: &Value, f: &mut Faults| {
            if v["ev"] == "notify" {
                seen += 1;
                if seen == 2 {
                    if everything {
                        // Just before the 3rd is due, so it is sent while detached.
                        f.cut_later(Duration::from_millis(4400));
                        f.cuts_hit += 1;
                    } else {
                        f.cut();
                    }
                }
            }
        }),
    )
}

fn standalone_verdict(run: &Run, up: Up) -> Result<String, String> {
    if run.cuts_hit == 0 {
        return Err("the cut hit no live connection".to_string());
    }
    if up == Up::Everything {
        let times: Vec<f64> = run.notifies.iter().map(|(t, _)| t.as_secs_f64()).collect();
        if times.len() != 3 || times.windows(2).any(|w| w[1] - w[0] < 3.0) {
            return Err(format!(
                "want exactly 3 log notifications ~5 s apart, got them at {times:?} s"
            ));
        }
    } else {
        let seqs: Vec<u64> = run
            .notifies
            .iter()
            .map(|(_, d)| d["seq"].as_u64().unwrap_or(0))
            .collect();
        let want: Vec<u64> = (1..=8).collect();
        if seqs != want {
            // rmcp runs each notification handler in its own task (see
            // `rmcp_wire_order`): a burst (the replay after a resume) can reach the
            // handler out of order. Exactly once is still required, and 8 on the wire.
            let mut sorted = seqs.clone();
            sorted.sort_unstable();
            let on_wire = run
                .taps()
                .iter()
                .filter(|t| t["rpc"]["m"] == "notifications/message")
                .count();
            if run.client == Some(Cl::Rmcp) && sorted == want && on_wire == 8 {
                return Ok(format!(
                    "SDK BUG (rmcp): 8 on the wire once each, the handler saw {seqs:?}"
                ));
            }
            return Err(format!("want notifications 1..=8 once each, got {seqs:?}"));
        }
    }
    let resumes = run.resumes();
    if resumes.is_empty() {
        return Err("the standalone stream was never resumed".to_string());
    }
    Ok(format!(
        "{} notifications, resumed with {:?}",
        run.notifies.len(),
        resumes.iter().map(|(_, o)| o.as_str()).collect::<Vec<_>>()
    ))
}

// ---------------------------------------------------------------------------------------------
// Scenario 4: DELETE ends the session; a later resume gets 404 unknown-session
// ---------------------------------------------------------------------------------------------

/// A raw HTTP/1.1 request to `addr` (connection closed after it); returns (status, whole
/// response text). Bounded.
async fn raw_http(addr: SocketAddr, method: &str, headers: &[(&str, &str)]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let mut req = format!("{method} /mcp HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).to_string();
        let status = text.split(' ').nth(1)?.parse().ok()?;
        Some((status, text))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .ok()
        .flatten()
        .unwrap_or((0, "no response".to_string()))
}

/// The last gateway cursor the client received (from its taps).
fn last_cursor(run: &Run) -> Option<String> {
    run.taps()
        .iter()
        .filter_map(|t| t["id"].as_str().map(str::to_string))
        .rfind(|id| cursor(id).is_some())
}

fn delete_plan(up: Up) -> (Value, Hook) {
    let json_mode = up == Up::TsJson;
    let mut fired = false;
    // JSON mode has no POST stream: the standalone stream is the one resumed.
    let plan = if json_mode {
        json!({"timeout_ms": 6000, "notify": {"tool": "notify_standalone", "args": {"count": 10, "interval_ms": 300}, "expect": 10, "wait_ms": 7000}})
    } else {
        json!({"timeout_ms": 6000, "calls": [up.slow(10, 200)]})
    };
    let mut session = None;
    let mut protocol = String::new();
    (
        plan,
        Box::new(move |v: &Value, f: &mut Faults| {
            if v["ev"] == "session" {
                session = v["session"].as_str().map(str::to_string);
                protocol = v["protocol"].as_str().unwrap_or("").to_string();
            }
            let trigger = if json_mode {
                v["ev"] == "notify" && v["data"]["seq"] == 2
            } else {
                v["ev"] == "progress" && v["progress"].as_f64() == Some(3.0)
            };
            if !fired && trigger {
                fired = true;
                // Cut first (refusing reconnects briefly, as rmcp retries at once), then
                // DELETE while the client is detached.
                f.relay.refuse_for(Duration::from_millis(800));
                f.cut();
                let sid = session.clone().unwrap_or_default();
                let gw = f.gateway;
                let proto = protocol.clone();
                // DELETE straight to the gateway (as another component of the client
                // would), then cut the client's streams.
                let status = std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    rt.block_on(raw_http(
                        gw,
                        "DELETE",
                        &[("Mcp-Session-Id", &sid), ("MCP-Protocol-Version", &proto)],
                    ))
                    .0
                })
                .join()
                .unwrap_or(0);
                f.deleted = Some(format!("DELETE -> {status}"));
            }
        }),
    )
}

fn delete_verdict(run: &Run, up: Up) -> Result<String, String> {
    let json_mode = up == Up::TsJson;
    if run.deleted.as_deref() != Some("DELETE -> 200") {
        return Err(format!(
            "the DELETE was not answered 200: {:?}",
            run.deleted
        ));
    }
    // Resumes refused by the relay never reached the gateway; every other one is 404.
    let resumes: Vec<_> = run
        .resumes()
        .into_iter()
        .filter(|(_, out)| out.contains("404") || !out.contains("failed"))
        .collect();
    if resumes.is_empty() {
        return Err("no resume reached the gateway after the DELETE".to_string());
    }
    if let Some(bad) = resumes.iter().find(|(_, out)| !out.contains("404")) {
        return Err(format!(
            "a resume after the DELETE was not answered 404: {bad:?}"
        ));
    }
    if run.results.contains_key("0") {
        return Err("the call got a result from a deleted session".to_string());
    }
    Ok(format!(
        "{} resume(s), all 404; the call ended with {:?}",
        resumes.len(),
        run.errors.get(if json_mode { "notify" } else { "0" })
    ))
}

/// And the documented body, checked on a resume made here with the client's own cursor (after
/// a passing `outcome`): 404 -32001 `unknown-session`.
async fn resume_gets_404(run: &Run, outcome: Result<String, String>) -> Result<String, String> {
    let (Ok(note), Some(sid), Some(cur)) = (&outcome, &run.session, last_cursor(run)) else {
        return outcome;
    };
    let Some(gw) = run.gateway else {
        return outcome;
    };
    let (status, text) = raw_http(
        gw,
        "GET",
        &[
            ("Mcp-Session-Id", sid),
            ("Last-Event-ID", &cur),
            ("Accept", "text/event-stream"),
        ],
    )
    .await;
    if status != 404 || !text.contains("\"unknown-session\"") || !text.contains("-32001") {
        Err(format!(
            "a resume with cursor {cur} got {status}, want 404 -32001 unknown-session:\n{text}"
        ))
    } else {
        Ok(format!("{note}; raw resume: 404 -32001 unknown-session"))
    }
}

// ---------------------------------------------------------------------------------------------
// Scenario 5: concurrent calls, cut at different points: no cross-stream events
// ---------------------------------------------------------------------------------------------

const CONCURRENT: [(u32, u32); 3] = [(16, 150), (10, 250), (6, 450)];

fn concurrent_plan(up: Up) -> (Value, Hook) {
    let calls: Vec<Value> = CONCURRENT.iter().map(|&(s, i)| up.slow(s, i)).collect();
    (
        json!({"timeout_ms": 20000, "calls": calls}),
        cut_on_progress(&[3, 11]),
    )
}

fn concurrent_verdict(run: &Run, up: Up) -> Result<String, String> {
    let mut bugs = Vec::new();
    for (k, &(steps, _)) in CONCURRENT.iter().enumerate() {
        if let Some(b) = complete_or_py_bug(run, up, &k.to_string(), steps)? {
            bugs.push(format!("call {k}: {b}"));
        }
    }
    if run.cuts_hit < 2 {
        return Err(format!("only {} of 2 cuts hit", run.cuts_hit));
    }
    let unknown = unknown_response_errors(run);
    if !unknown.is_empty() {
        return Err(format!("responses for unknown requests: {unknown:?}"));
    }
    let iso = stream_isolation(run)?;
    if bugs.is_empty() {
        Ok(format!("3 calls complete through 2 cuts; {iso}"))
    } else {
        Ok(format!("SDK BUG: {}; {iso}", bugs.join("; ")))
    }
}

// ---------------------------------------------------------------------------------------------
// JSON-response mode: the upstream answers with one JSON body (and drops progress); the gateway
// upgrades the answer to a tagged SSE stream (on by default), which a client can resume
// ---------------------------------------------------------------------------------------------

fn json_calls_plan(up: Up) -> (Value, Hook) {
    let calls: Vec<Value> = CONCURRENT.iter().map(|&(s, _)| up.slow(s, 30)).collect();
    (
        json!({"timeout_ms": 20000, "calls": calls}),
        Box::new(|_: &Value, _: &mut Faults| {}),
    )
}

fn json_calls_verdict(run: &Run, up: Up) -> Result<String, String> {
    for (k, &(steps, _)) in CONCURRENT.iter().enumerate() {
        let key = k.to_string();
        match run.results.get(&key) {
            Some(t) if up.is_slow_result(t, steps) => {}
            other => return Err(format!("call {k}: result {other:?}")),
        }
        if !run.progress_of(&key).is_empty() {
            return Err(format!("call {k}: progress in JSON mode?"));
        }
    }
    Ok("3 results, each its own, no progress (the server drops it in JSON mode)".into())
}

/// An 8 × 150 ms call, cut 0.7 s after the client's session line (its call starts right
/// after): past the 200 ms upgrade grace, before the upstream answers.
fn json_cut_plan(up: Up) -> (Value, Hook) {
    (
        json!({"timeout_ms": 8000, "calls": [up.slow(8, 150)]}),
        Box::new(|v: &Value, f: &mut Faults| {
            if v["ev"] == "session" {
                f.cut_later(Duration::from_millis(700));
                f.cuts_hit += 1;
                f.cut_at = Some(Instant::now() + Duration::from_millis(700));
            }
        }),
    )
}

/// With the upgrade: the result exactly once after a resume, no progress (the upstream sends
/// none in JSON mode), and the call's stream tagged by the gateway.
fn json_cut_verdict(run: &Run, up: Up) -> Result<String, String> {
    let results = run
        .events
        .iter()
        .filter(|(_, v)| v["ev"] == "result" && v["call"] == 0)
        .count();
    match (run.results.get("0"), run.errors.get("0")) {
        (Some(t), None) if up.is_slow_result(t, 8) && results == 1 => {}
        (r, e) => {
            return Err(format!(
                "want the result once, got {results} result(s) {r:?}, error {e:?}"
            ))
        }
    }
    if !run.progress_of("0").is_empty() {
        return Err(format!("progress in JSON mode? {:?}", run.progress_of("0")));
    }
    let resumes = run.resumes();
    if resumes.is_empty() {
        return Err("the cut was not followed by a resume GET".to_string());
    }
    let iso = stream_isolation(run)?;
    Ok(format!(
        "upgraded to SSE: the result once after {} resume GET(s); {iso}",
        resumes.len()
    ))
}

/// With `--json-upgrade false`: the cut fails the call at once (nothing to resume).
fn json_cut_upgrade_off_verdict(run: &Run, _: Up) -> Result<String, String> {
    if let Some(r) = run.results.get("0") {
        return Err(format!("a JSON response survived the cut? {r}"));
    }
    let (key, (msg, code)) = run
        .errors
        .iter()
        .next()
        .ok_or("the client reported no error at all")?;
    let took = match (run.cut_at, run.error_at.get(key)) {
        (Some(c), Some(e)) => e.saturating_duration_since(c).as_secs_f64(),
        _ => f64::NAN,
    };
    Ok(format!(
        "no resumption possible (no stream): call {key} failed {took:.1} s after the cut with {code:?} {msg:?}"
    ))
}

// ---------------------------------------------------------------------------------------------
// Controls: no gateway (relay straight at the upstream): the same checks fail
// ---------------------------------------------------------------------------------------------

fn control_1a_plan(up: Up) -> (Value, Hook) {
    (
        json!({"timeout_ms": 4000, "calls": [up.slow(8, 150)]}),
        cut_on_progress(&[3]),
    )
}

fn control_1a_verdict(run: &Run, up: Up) -> Result<String, String> {
    if complete(run, "0", 8, &|t| up.is_slow_result(t, 8)).is_ok() {
        Err("the call completed without the gateway: the scenario cannot fail".to_string())
    } else if !run.resumes().is_empty() {
        Err(format!("a resume without ids? {:?}", run.resumes()))
    } else {
        Ok(format!(
            "as expected without the gateway: progress {:?}, error {:?}",
            run.progress_of("0"),
            run.errors.get("0")
        ))
    }
}

fn control_5_plan(up: Up) -> (Value, Hook) {
    let calls: Vec<Value> = CONCURRENT.iter().map(|&(s, i)| up.slow(s, i)).collect();
    (
        json!({"timeout_ms": 8000, "calls": calls}),
        cut_on_progress(&[3, 11]),
    )
}

fn control_5_verdict(run: &Run, up: Up) -> Result<String, String> {
    let all_complete = CONCURRENT
        .iter()
        .enumerate()
        .all(|(k, &(s, _))| complete(run, &k.to_string(), s, &|t| up.is_slow_result(t, s)).is_ok());
    let dupes: Vec<String> = CONCURRENT
        .iter()
        .enumerate()
        .map(|(k, _)| (k, run.progress_of(&k.to_string())))
        .filter(|(_, p)| p.windows(2).any(|w| w[0] >= w[1]))
        .map(|(k, p)| format!("call {k}: {p:?}"))
        .collect();
    let unknown = unknown_response_errors(run);
    if all_complete && dupes.is_empty() && unknown.is_empty() {
        Err("server-everything's own resumption delivered every stream cleanly; this control expects its cross-stream replay".to_string())
    } else {
        Ok(format!(
            "as expected, its own store mixes streams: duplicates {dupes:?}, unknown responses {}",
            unknown.len()
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// The tests: a table of rows `test name: upstream, case`
// ---------------------------------------------------------------------------------------------

/// One test per row: `name: upstream, case` runs `case` (a [`Scenario`]) against `upstream`.
macro_rules! matrix_tests {
    ($($name:ident: $up:expr, $case:ident;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                run_scenario($up, &$case).await;
            }
        )*
    };
}

/// Every numbered scenario against one upstream, in module `$modname`.
macro_rules! upstream_tests {
    ($modname:ident, $up:expr) => {
        mod $modname {
            use super::*;

            matrix_tests! {
                s1a_one_cut: $up, S1A_ONE_CUT;
                s1b_three_cuts: $up, S1B_THREE_CUTS;
                s1c_cut_then_refusal: $up, S1C_CUT_THEN_REFUSAL;
                s2_gap: $up, S2_GAP;
                s3_standalone_notifications: $up, S3_STANDALONE;
                s4_delete_then_resume: $up, S4_DELETE;
                s5_concurrent_calls: $up, S5_CONCURRENT;
            }
        }
    };
}

upstream_tests!(ts_sse, Up::TsSse);
upstream_tests!(py, Up::Py);
upstream_tests!(everything, Up::Everything);

mod ts_json {
    use super::*;

    matrix_tests! {
        concurrent_calls_no_cut: Up::TsJson, JSON_CALLS;
        call_cut_delivered_once: Up::TsJson, JSON_CUT;
        call_cut_fails_fast_with_upgrade_off: Up::TsJson, JSON_CUT_UPGRADE_OFF;
        s3_standalone_notifications: Up::TsJson, S3_STANDALONE;
        s4_delete_then_resume: Up::TsJson, S4_DELETE;
    }
}

matrix_tests! {
    control_ts_sse_without_gateway_loses_call: Up::TsSse, CONTROL_1A;
    control_py_without_gateway_loses_call: Up::Py, CONTROL_1A;
    control_everything_without_gateway_mixes_streams: Up::Everything, CONTROL_5_EVERYTHING;
}

// ---------------------------------------------------------------------------------------------
// The rmcp client driver (in process), same plan and output as the TS/Python drivers
// ---------------------------------------------------------------------------------------------

mod rmcp_driver {
    use super::*;
    use futures::stream::BoxStream;
    use futures::StreamExt;
    #[allow(deprecated)]
    use rmcp::model::{
        CallToolRequestParams, ClientConfig, LoggingMessageNotificationParam, NumberOrString,
        ProgressNotificationParam, ProgressToken, RequestMetaObject,
    };
    use rmcp::service::{NotificationContext, RoleClient};
    use rmcp::transport::streamable_http_client::{
        StreamableHttpClient, StreamableHttpClientTransportConfig, StreamableHttpError,
        StreamableHttpPostResponse, StreamableHttpResponseLimits,
    };
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::{ClientHandler, ServiceExt};

    type Out = mpsc::UnboundedSender<String>;
    type Log = Arc<Mutex<Vec<String>>>;

    fn emit(out: &Out, v: Value) {
        let _ = out.send(v.to_string());
    }

    /// reqwest with logging of every request and a tap on every SSE response.
    #[derive(Clone)]
    struct TapClient {
        inner: reqwest::Client,
        log: Log,
        conn: Arc<std::sync::atomic::AtomicU64>,
        started: std::time::Instant,
        session: Arc<Mutex<Option<String>>>,
        /// Progress notifications seen on the wire (the handler's count catches up with it).
        progress_on_wire: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl TapClient {
        fn line(&self, l: String) {
            let l = format!("+{:5}ms {l}", self.started.elapsed().as_millis());
            eprintln!("[rmcp-client] {l}");
            self.log.lock().unwrap().push(l);
        }

        fn tap(
            &self,
            conn: u64,
            method: &'static str,
            lei: Option<String>,
            s: BoxStream<'static, Result<sse_stream::Sse, sse_stream::Error>>,
        ) -> BoxStream<'static, Result<sse_stream::Sse, sse_stream::Error>> {
            let me = self.clone();
            s.inspect(move |item| {
                let entry = match item {
                    Ok(sse) => {
                        let rpc = sse.data.as_deref().and_then(|d| {
                            let m: Value = serde_json::from_str(d).ok()?;
                            if m["method"] == "notifications/progress" {
                                me.progress_on_wire
                                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            }
                            Some(json!({
                                "m": m.get("method"),
                                "id": m.get("id"),
                                "tok": m.pointer("/params/progressToken"),
                                "p": m.pointer("/params/progress"),
                                "err": m.pointer("/error/code"),
                            }))
                        });
                        json!({"conn": conn, "req": method, "lei": lei, "type": sse.event.as_deref().unwrap_or("message"), "id": sse.id, "rpc": rpc})
                    }
                    Err(e) => json!({"conn": conn, "req": method, "lei": lei, "end": format!("error: {e}")}),
                };
                me.line(format!("TAP {entry}"));
            })
            .boxed()
        }

        fn next_conn(&self) -> u64 {
            self.conn.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
        }
    }

    impl StreamableHttpClient for TapClient {
        type Error = reqwest::Error;

        async fn post_message(
            &self,
            uri: Arc<str>,
            message: rmcp::model::ClientJsonRpcMessage,
            session_id: Option<Arc<str>>,
            auth_header: Option<String>,
            custom_headers: HashMap<http::HeaderName, http::HeaderValue>,
        ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
            self.post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                StreamableHttpResponseLimits::default(),
            )
            .await
        }

        async fn post_message_with_response_limits(
            &self,
            uri: Arc<str>,
            message: rmcp::model::ClientJsonRpcMessage,
            session_id: Option<Arc<str>>,
            auth_header: Option<String>,
            custom_headers: HashMap<http::HeaderName, http::HeaderValue>,
            limits: StreamableHttpResponseLimits,
        ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
            if let Some(sid) = &session_id {
                *self.session.lock().unwrap() = Some(sid.to_string());
            }
            let conn = self.next_conn();
            let r = self
                .inner
                .post_message_with_response_limits(
                    uri,
                    message,
                    session_id,
                    auth_header,
                    custom_headers,
                    limits,
                )
                .await;
            match r {
                Ok(StreamableHttpPostResponse::Sse(s, sid)) => {
                    if let Some(sid) = &sid {
                        *self.session.lock().unwrap() = Some(sid.clone());
                    }
                    self.line(format!(
                        "HTTP POST lei=- conn={conn} -> 200 text/event-stream"
                    ));
                    Ok(StreamableHttpPostResponse::Sse(
                        self.tap(conn, "POST", None, s),
                        sid,
                    ))
                }
                Ok(StreamableHttpPostResponse::Json(m, sid)) => {
                    if let Some(sid) = &sid {
                        *self.session.lock().unwrap() = Some(sid.clone());
                    }
                    self.line(format!(
                        "HTTP POST lei=- conn={conn} -> 200 application/json"
                    ));
                    Ok(StreamableHttpPostResponse::Json(m, sid))
                }
                Ok(other) => {
                    self.line(format!("HTTP POST lei=- conn={conn} -> 202"));
                    Ok(other)
                }
                Err(e) => {
                    self.line(format!("HTTP POST lei=- conn={conn} -> failed: {e}"));
                    Err(e)
                }
            }
        }

        async fn delete_session(
            &self,
            uri: Arc<str>,
            session_id: Arc<str>,
            auth_header: Option<String>,
            custom_headers: HashMap<http::HeaderName, http::HeaderValue>,
        ) -> Result<(), StreamableHttpError<Self::Error>> {
            let conn = self.next_conn();
            let r = self
                .inner
                .delete_session(uri, session_id, auth_header, custom_headers)
                .await;
            match &r {
                Ok(()) => self.line(format!("HTTP DELETE lei=- conn={conn} -> 200")),
                Err(e) => self.line(format!("HTTP DELETE lei=- conn={conn} -> failed: {e}")),
            }
            r
        }

        async fn get_stream(
            &self,
            uri: Arc<str>,
            session_id: Option<Arc<str>>,
            last_event_id: Option<String>,
            auth_header: Option<String>,
            custom_headers: HashMap<http::HeaderName, http::HeaderValue>,
        ) -> Result<
            BoxStream<'static, Result<sse_stream::Sse, sse_stream::Error>>,
            StreamableHttpError<Self::Error>,
        > {
            self.get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                16 << 20,
            )
            .await
        }

        async fn get_stream_with_max_sse_event_size(
            &self,
            uri: Arc<str>,
            session_id: Option<Arc<str>>,
            last_event_id: Option<String>,
            auth_header: Option<String>,
            custom_headers: HashMap<http::HeaderName, http::HeaderValue>,
            max: usize,
        ) -> Result<
            BoxStream<'static, Result<sse_stream::Sse, sse_stream::Error>>,
            StreamableHttpError<Self::Error>,
        > {
            let conn = self.next_conn();
            let lei = last_event_id.clone();
            let what = format!("HTTP GET lei={} conn={conn}", lei.as_deref().unwrap_or("-"));
            let r = self
                .inner
                .get_stream_with_max_sse_event_size(
                    uri,
                    session_id,
                    last_event_id,
                    auth_header,
                    custom_headers,
                    max,
                )
                .await;
            match r {
                Ok(s) => {
                    self.line(format!("{what} -> 200 text/event-stream"));
                    Ok(self.tap(conn, "GET", lei, s))
                }
                Err(e) => {
                    self.line(format!("{what} -> failed: {e}"));
                    Err(e)
                }
            }
        }
    }

    #[derive(Clone)]
    struct Handler {
        out: Out,
        notify_count: Arc<std::sync::atomic::AtomicUsize>,
        notify_all: Arc<tokio::sync::Notify>,
        notify_expect: Arc<std::sync::atomic::AtomicUsize>,
        /// Progress notifications the handler has recorded.
        progress_handled: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl ClientHandler for Handler {
        async fn on_progress(
            &self,
            params: ProgressNotificationParam,
            _context: NotificationContext<RoleClient>,
        ) {
            let call = match &params.progress_token.0 {
                NumberOrString::String(s) => s.trim_start_matches("call-").to_string(),
                NumberOrString::Number(n) => n.to_string(),
            };
            let call: Value = call.parse::<u64>().map_or(json!(call), |n| json!(n));
            let p = params.progress;
            let progress = if p.fract() == 0.0 {
                json!(p as u64)
            } else {
                json!(p)
            };
            emit(
                &self.out,
                json!({"ev": "progress", "call": call, "progress": progress, "message": params.message}),
            );
            self.progress_handled
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }

        #[allow(deprecated)] // notifications/message, deprecated by SEP-2577, still what servers send
        async fn on_logging_message(
            &self,
            params: LoggingMessageNotificationParam,
            _context: NotificationContext<RoleClient>,
        ) {
            emit(&self.out, json!({"ev": "notify", "data": params.data}));
            let n = self
                .notify_count
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                + 1;
            if n >= self.notify_expect.load(std::sync::atomic::Ordering::SeqCst) {
                self.notify_all.notify_one();
            }
        }

        fn get_info(&self) -> ClientConfig {
            ClientConfig::default()
        }
    }

    async fn call(
        client: &rmcp::service::RunningService<RoleClient, Handler>,
        out: &Out,
        key: Value,
        spec: &Value,
        timeout: Duration,
    ) {
        let mut params =
            CallToolRequestParams::new(spec["tool"].as_str().unwrap_or("").to_string());
        params.arguments = spec["args"].as_object().cloned();
        let token = match &key {
            Value::Number(n) => format!("call-{n}"),
            other => format!("call-{}", other.as_str().unwrap_or("x")),
        };
        params.meta = Some(RequestMetaObject::with_progress_token(ProgressToken(
            NumberOrString::String(token.into()),
        )));
        match tokio::time::timeout(timeout, client.call_tool(params)).await {
            Ok(Ok(result)) => {
                let text: String = result
                    .content
                    .iter()
                    .filter_map(|c| c.as_text().map(|t| t.text.clone()))
                    .collect();
                emit(
                    out,
                    json!({"ev": "result", "call": key, "text": text, "is_error": result.is_error == Some(true)}),
                );
            }
            Ok(Err(rmcp::ServiceError::McpError(e))) => emit(
                out,
                json!({"ev": "error", "call": key, "message": e.message, "code": e.code.0}),
            ),
            Ok(Err(e)) => emit(
                out,
                json!({"ev": "error", "call": key, "message": e.to_string(), "code": null}),
            ),
            Err(_) => emit(
                out,
                json!({"ev": "error", "call": key, "message": format!("timed out after {timeout:?} (test harness)"), "code": null}),
            ),
        }
    }

    pub async fn run(url: String, plan: Value, out: Out, log: Log) {
        let timeout = Duration::from_millis(plan["timeout_ms"].as_u64().unwrap_or(20000));
        let tap = TapClient {
            inner: reqwest::Client::new(),
            log,
            conn: Default::default(),
            started: std::time::Instant::now(),
            session: Default::default(),
            progress_on_wire: Default::default(),
        };
        let transport = StreamableHttpClientTransport::with_client(
            tap.clone(),
            StreamableHttpClientTransportConfig::with_uri(url.as_str()),
        );
        let handler = Handler {
            out: out.clone(),
            notify_count: Default::default(),
            notify_all: Default::default(),
            notify_expect: Arc::new(usize::MAX.into()),
            progress_handled: Default::default(),
        };
        let client = match tokio::time::timeout(timeout, handler.clone().serve(transport)).await {
            Ok(Ok(c)) => c,
            other => {
                let msg = match other {
                    Ok(Err(e)) => e.to_string(),
                    _ => "initialize timed out".to_string(),
                };
                emit(
                    &out,
                    json!({"ev": "error", "call": "connect", "message": msg, "code": null}),
                );
                emit(&out, json!({"ev": "done"}));
                return;
            }
        };
        let protocol = client.peer_info().map(|i| i.protocol_version.to_string());
        let session = tap.session.lock().unwrap().clone();
        emit(
            &out,
            json!({"ev": "session", "session": session, "protocol": protocol}),
        );
        if let Some(n) = plan.get("notify").filter(|n| !n.is_null()) {
            // Give the standalone GET stream (opened right after initialize) a moment.
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline
                && !tap
                    .log
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|l| l.contains("HTTP GET lei=- ") && l.contains("-> 200"))
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            handler.notify_expect.store(
                n["expect"].as_u64().unwrap_or(1) as usize,
                std::sync::atomic::Ordering::SeqCst,
            );
            call(&client, &out, json!("notify"), n, timeout).await;
            let wait = Duration::from_millis(n["wait_ms"].as_u64().unwrap_or(10000));
            let _ = tokio::time::timeout(wait, handler.notify_all.notified()).await;
        }
        let calls = plan["calls"].as_array().cloned().unwrap_or_default();
        futures::future::join_all(
            calls
                .iter()
                .enumerate()
                .map(|(k, c)| call(&client, &out, json!(k), c, timeout)),
        )
        .await;
        // rmcp runs each notification handler in a task of its own, which may still be
        // pending when the call's result is in (the last progress and the result arrive in
        // one read): let the handler see what the wire carried before the session ends
        // (bounded: a notification on the wire twice would never be caught up with).
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline
            && handler
                .progress_handled
                .load(std::sync::atomic::Ordering::SeqCst)
                < tap
                    .progress_on_wire
                    .load(std::sync::atomic::Ordering::SeqCst)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Ends the session (rmcp sends DELETE when its worker stops), bounded.
        let _ = tokio::time::timeout(Duration::from_secs(3), client.cancel()).await;
        emit(&out, json!({"ev": "done"}));
    }
}
