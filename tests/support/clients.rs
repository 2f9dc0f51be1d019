//! Real MCP client drivers and their runs, shared by the interop tests that drive them
//! (tests/sdk/interop_matrix.rs, tests/sdk/interop_shapes.rs): [`Driver`] (the TypeScript SDK's
//! `tests/interop/ts-driver.mjs`, the Python SDK's `tests/interop/py-driver.py`, or an in-process
//! driver such as the matrix's rmcp one), [`run_client`] (reads its JSON event lines into a
//! [`Run`] while a hook injects [`Faults`] through the client's [`Relay`]), [`run_pairs`]
//! (several clients at once, each through its own gateway and relay), and the checks on a run
//! ([`complete`], [`explained_by_py_bugs`]).

use super::*;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use tokio::time::Instant;

/// A real MCP client: the TypeScript SDK, the Python SDK, rmcp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cl {
    Ts,
    Py,
    Rmcp,
}

/// Every client the matrix runs.
pub const ALL_CLIENTS: [Cl; 3] = [Cl::Ts, Cl::Py, Cl::Rmcp];

impl Cl {
    /// Its name in report rows.
    pub fn label(self) -> &'static str {
        match self {
            Cl::Ts => "ts-client",
            Cl::Py => "py-client",
            Cl::Rmcp => "rmcp-client",
        }
    }
}

/// A running client driver: a process (TS, Python) or an in-process task (rmcp), both printing
/// JSON event lines and keeping diagnostic lines (`HTTP …`, `TAP {…}`).
pub enum Driver {
    Proc(ChildProc),
    /// An in-process driver: its event lines, its diagnostic lines, its task.
    Channel {
        lines: mpsc::UnboundedReceiver<String>,
        log: Arc<Mutex<Vec<String>>>,
        task: tokio::task::JoinHandle<()>,
    },
}

impl Driver {
    /// Spawns the TypeScript or Python driver process (`tests/interop/ts-driver.mjs`,
    /// `tests/interop/py-driver.py`) with `plan` against `url`. rmcp runs in process: its driver
    /// lives in tests/sdk/interop_matrix.rs, which builds [`Driver::Channel`] itself.
    pub fn spawn_process(client: Cl, url: &str, plan: &Value) -> Driver {
        let plan_s = plan.to_string();
        match client {
            Cl::Ts => Driver::Proc(ChildProc::spawn_node(
                "ts-client",
                "ts-driver.mjs",
                &[url, &plan_s],
            )),
            Cl::Py => {
                let python = ensure_python_venv();
                Driver::Proc(ChildProc::spawn(
                    "py-client",
                    python.to_str().expect("UTF-8 path"),
                    &["py-driver.py", url, &plan_s],
                    &interop_dir(),
                ))
            }
            Cl::Rmcp => panic!("the rmcp driver runs in process (tests/sdk/interop_matrix.rs)"),
        }
    }

    pub async fn next_line(&mut self, timeout: Duration) -> NextLine {
        match self {
            Driver::Proc(p) => p.next_line(timeout).await,
            Driver::Channel { lines, .. } => {
                match tokio::time::timeout(timeout, lines.recv()).await {
                    Ok(Some(l)) => NextLine::Line(l),
                    Ok(None) => NextLine::Eof,
                    Err(_) => NextLine::Timeout,
                }
            }
        }
    }

    pub fn stderr_lines(&self) -> Vec<String> {
        match self {
            Driver::Proc(p) => p.stderr_lines(),
            Driver::Channel { log, .. } => log.lock().unwrap().clone(),
        }
    }

    /// Waits (bounded) for the driver to finish; kills it if it does not.
    pub async fn finish(&mut self, timeout: Duration) -> Option<i32> {
        match self {
            Driver::Proc(p) => {
                let code = p.wait_exit(timeout).await.map(|s| s.code().unwrap_or(-1));
                p.kill();
                code
            }
            Driver::Channel { task, .. } => {
                let done = tokio::time::timeout(timeout, &mut *task).await.is_ok();
                task.abort();
                done.then_some(0)
            }
        }
    }
}

/// What a fault-injection hook sees and can do.
pub struct Faults {
    pub relay: Arc<Relay>,
    pub gateway: SocketAddr,
    /// Cuts that hit at least one live connection.
    pub cuts_hit: usize,
    /// Set by scenario 4: (session, protocol, DELETE status).
    pub deleted: Option<String>,
    pub cut_at: Option<Instant>,
}

impl Faults {
    pub fn cut(&mut self) {
        if self.relay.cut_all() > 0 {
            self.cuts_hit += 1;
        }
        self.cut_at.get_or_insert_with(Instant::now);
    }

    /// Cuts after `delay` without blocking the run loop.
    pub fn cut_later(&mut self, delay: Duration) {
        let relay = self.relay.clone();
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            relay.cut_all();
        });
    }
}

/// Everything one client run produced.
#[derive(Default)]
pub struct Run {
    pub client: Option<Cl>,
    /// Every stdout event, with its arrival time since the start.
    pub events: Vec<(Duration, Value)>,
    pub session: Option<String>,
    pub protocol: Option<String>,
    /// progress values per call key ("0", "1", …, "notify").
    pub progress: BTreeMap<String, Vec<f64>>,
    pub results: BTreeMap<String, String>,
    pub errors: BTreeMap<String, (String, Option<i64>)>,
    /// Arrival time (since the start) of each error event.
    pub error_at: BTreeMap<String, Instant>,
    pub notifies: Vec<(Duration, Value)>,
    pub cut_short: Option<&'static str>,
    pub exit_code: Option<i32>,
    pub stderr: Vec<String>,
    pub cuts_hit: usize,
    pub refused: usize,
    pub cut_at: Option<Instant>,
    pub deleted: Option<String>,
    /// What the relay forwarded to (the gateway, or the upstream in a control).
    pub gateway: Option<SocketAddr>,
}

impl Run {
    pub fn report(&self) -> String {
        let stdout: Vec<String> = self
            .events
            .iter()
            .map(|(t, v)| format!("{:>6}ms {v}", t.as_millis()))
            .collect();
        format!(
            "client {:?}: cuts hit {}, refused {}, cut short {:?}, exit {:?}\nstdout:\n  {}\nstderr (HTTP/TAP/diagnostics):\n  {}",
            self.client,
            self.cuts_hit,
            self.refused,
            self.cut_short,
            self.exit_code,
            stdout.join("\n  "),
            self.stderr.join("\n  ")
        )
    }

    /// `(method, last-event-id, outcome)` of every HTTP request the client made.
    pub fn http(&self) -> Vec<(String, String, String)> {
        self.stderr
            .iter()
            .filter_map(|l| {
                let rest = &l[l.find("HTTP ")? + 5..];
                let (method, rest) = rest.split_once(' ')?;
                let rest = rest.strip_prefix("lei=")?;
                let (lei, rest) = rest.split_once(' ')?;
                let outcome = rest.split_once("-> ")?.1;
                Some((method.to_string(), lei.to_string(), outcome.to_string()))
            })
            .collect()
    }

    /// GETs carrying `Last-Event-ID`: the client's resumes.
    pub fn resumes(&self) -> Vec<(String, String)> {
        self.http()
            .into_iter()
            .filter(|(m, lei, _)| m == "GET" && lei != "-")
            .map(|(_, lei, out)| (lei, out))
            .collect()
    }

    /// Every SSE event the client's HTTP layer received.
    pub fn taps(&self) -> Vec<Value> {
        self.stderr
            .iter()
            .filter_map(|l| serde_json::from_str(&l[l.find("TAP ")? + 4..]).ok())
            .collect()
    }

    pub fn progress_of(&self, call: &str) -> Vec<u64> {
        self.progress
            .get(call)
            .map(|v| v.iter().map(|p| *p as u64).collect())
            .unwrap_or_default()
    }
}

/// Reads `driver` (the `client` just spawned) until its `done` line (or `limit`), calling
/// `hook(event, faults)` after every event line.
pub async fn run_client(
    client: Cl,
    mut driver: Driver,
    limit: Duration,
    faults: &mut Faults,
    mut hook: impl FnMut(&Value, &mut Faults) + Send,
) -> Run {
    let started = Instant::now();
    let deadline = started + limit;
    let mut run = Run {
        client: Some(client),
        ..Run::default()
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match driver.next_line(left).await.line() {
            Ok(l) => l,
            Err(why) => {
                run.cut_short = Some(why);
                break;
            }
        };
        let at = started.elapsed();
        eprintln!("[{} stdout {:>6}ms] {line}", client.label(), at.as_millis());
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            eprintln!("[{}] not JSON: {line}", client.label());
            continue;
        };
        run.events.push((at, v.clone()));
        let call = match &v["call"] {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => String::new(),
        };
        match v["ev"].as_str().unwrap_or("") {
            "session" => {
                run.session = v["session"].as_str().map(str::to_string);
                run.protocol = v["protocol"].as_str().map(str::to_string);
            }
            "progress" => run
                .progress
                .entry(call)
                .or_default()
                .push(v["progress"].as_f64().unwrap_or(-1.0)),
            "result" => {
                run.results
                    .insert(call, v["text"].as_str().unwrap_or("").to_string());
            }
            "error" => {
                run.error_at.insert(call.clone(), Instant::now());
                run.errors.insert(
                    call,
                    (
                        v["message"].as_str().unwrap_or("").to_string(),
                        v["code"].as_i64(),
                    ),
                );
            }
            "notify" => run.notifies.push((at, v["data"].clone())),
            "done" => {
                hook(&v, faults);
                break;
            }
            _ => {}
        }
        hook(&v, faults);
    }
    run.exit_code = driver.finish(Duration::from_secs(8)).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    run.stderr = driver.stderr_lines();
    run.cuts_hit = faults.cuts_hit;
    run.refused = faults.relay.refused();
    run.cut_at = faults.cut_at;
    run.deleted = faults.deleted.clone();
    run.gateway = Some(faults.gateway);
    run
}

/// A fault-injection hook: called with every event line the client printed.
pub type Hook = Box<dyn FnMut(&Value, &mut Faults) + Send>;

/// How a test starts a client driver ([`Driver::spawn_process`], or one that adds rmcp).
pub type Spawn = fn(Cl, &str, &Value) -> Driver;

/// Runs every client in `clients` concurrently against `upstream`, each through its own
/// gateway (configured by `tweak`; `None` = no gateway: the relay points at the upstream) and
/// relay, with the plan and hook `make` returns for it, started by `spawn`.
pub async fn run_pairs(
    upstream: &Upstream,
    clients: &[Cl],
    tweak: Option<fn(&mut mcp_reattach::Config)>,
    limit: Duration,
    spawn: Spawn,
    make: impl Fn(Cl) -> (Value, Hook),
) -> Vec<Run> {
    // Installs (first run only) before any clock starts.
    install_interop_deps().await;
    let mut tasks = Vec::new();
    for &client in clients {
        let target = match tweak {
            Some(t) => Gw::start(&upstream.base_url(), t).await.addr,
            None => upstream.addr,
        };
        let relay = Arc::new(Relay::start(target));
        let (plan, hook) = make(client);
        let url = relay.url("/mcp");
        tasks.push(tokio::spawn(async move {
            let mut faults = Faults {
                relay,
                gateway: target,
                cuts_hit: 0,
                deleted: None,
                cut_at: None,
            };
            let driver = spawn(client, &url, &plan);
            run_client(client, driver, limit, &mut faults, hook).await
        }));
    }
    let mut runs = Vec::new();
    for t in tasks {
        runs.push(t.await.expect("client run task"));
    }
    runs
}

/// The gateway with its defaults.
pub fn with_gateway(_: &mut mcp_reattach::Config) {}

/// A window of 4 events and a stall budget shorter than the scenario's outage: the client is
/// away longer than the gateway holds the upstream back for it, so the window moves on.
pub fn tiny_window(c: &mut mcp_reattach::Config) {
    c.window_events = 4;
    c.stall_timeout = Duration::from_millis(400);
    c.sweep_interval = Duration::from_millis(50);
}

/// Cuts after each progress value in `cut_after` of call 0 (once each).
pub fn cut_on_progress(cut_after: &'static [u64]) -> Hook {
    let mut done = BTreeSet::new();
    Box::new(move |v, f| {
        if v["ev"] == "progress" && v["call"] == 0 {
            let p = v["progress"].as_f64().unwrap_or(0.0) as u64;
            if cut_after.contains(&p) && done.insert(p) {
                f.cut();
            }
        }
    })
}

/// Once, at the first progress value `p` (of any call): refuses new connections for
/// `refuse_ms`, then cuts.
pub fn refuse_and_cut_at(p: f64, refuse_ms: u64) -> Hook {
    let mut fired = false;
    Box::new(move |v: &Value, f: &mut Faults| {
        if !fired && v["ev"] == "progress" && v["progress"].as_f64() == Some(p) {
            fired = true;
            f.relay.refuse_for(Duration::from_millis(refuse_ms));
            f.cut();
        }
    })
}

/// Call `call` saw progress 1..=steps exactly once each, in order, then its own result (a
/// result text `is_result` accepts).
pub fn complete(
    run: &Run,
    call: &str,
    steps: u32,
    is_result: &dyn Fn(&str) -> bool,
) -> Result<(), String> {
    let want: Vec<u64> = (1..=u64::from(steps)).collect();
    let got = run.progress_of(call);
    if got != want {
        return Err(format!("call {call}: progress {got:?}, want {want:?}"));
    }
    match (run.results.get(call), run.errors.get(call)) {
        (Some(text), None) if is_result(text) => Ok(()),
        (r, e) => Err(format!(
            "call {call}: want the result of {steps} steps, got result {r:?}, error {e:?}"
        )),
    }
}

/// Two bugs of the Python SDK client (mcp 1.30.0, `StreamableHTTPTransport._handle_reconnection`)
/// show when a *resumed* stream breaks again:
/// - stale cursor: it retries with the cursor it resumed *from*, not the last id it received,
///   so the gateway (correctly) replays what the broken resumed stream had already delivered;
/// - spent budget: the attempt counter is not reset by a successful resume, so the second
///   break of a resumed stream ends its retries silently and the call waits for its timeout.
///
/// When `complete` fails for the Python client, this checks that the failure is exactly these
/// bugs: the first occurrences of the progress values are 1..=k in order, every duplicate is a
/// replay after a reused `Last-Event-ID`, and the call either completed or timed out after its
/// last resume had succeeded (no further attempt).
pub fn explained_by_py_bugs(
    run: &Run,
    call: &str,
    steps: u32,
    is_result: &dyn Fn(&str) -> bool,
) -> Result<String, String> {
    let got = run.progress_of(call);
    let mut first: Vec<u64> = Vec::new();
    for p in &got {
        if !first.contains(p) {
            first.push(*p);
        }
    }
    if first != (1..=first.len() as u64).collect::<Vec<_>>() || first.len() > steps as usize {
        return Err(format!("progress is not a prefix of 1..={steps}: {got:?}"));
    }
    let resumes = run.resumes();
    let taps = run.taps();
    let delivered_after = |lei: &str| {
        taps.iter()
            .any(|t| t["lei"] == lei && t["rpc"].get("tok").is_some_and(|v| !v.is_null()))
    };
    let reused = resumes.iter().enumerate().any(|(i, (lei, out))| {
        out.starts_with("200")
            && delivered_after(lei)
            && resumes[i + 1..].iter().any(|(l, _)| l == lei)
    });
    let mut notes = Vec::new();
    if first.len() < got.len() {
        if !reused {
            return Err(format!(
                "duplicates without a reused cursor: progress {got:?}, resumes {resumes:?}"
            ));
        }
        notes.push(format!(
            "stale resume cursor: events replayed twice, progress {got:?}"
        ));
    }
    let result_ok = run.results.get(call).is_some_and(|t| is_result(t));
    if !result_ok {
        let timed_out = run.errors.get(call).is_some_and(|(_, c)| *c == Some(408));
        let last_ok = resumes.last().is_some_and(|(_, o)| o.starts_with("200"));
        if !(timed_out && last_ok && resumes.len() >= 2) {
            return Err(format!(
                "no result, and not the spent-retry-budget hang: error {:?}, resumes {resumes:?}",
                run.errors.get(call)
            ));
        }
        notes.push(format!(
            "gave up silently after a resumed stream broke again (progress up to {}), call timed out",
            first.len()
        ));
    }
    if notes.is_empty() {
        return Err("complete() failed but no Python SDK bug explains it".into());
    }
    Ok(format!("SDK BUG (python-sdk): {}", notes.join("; ")))
}

/// Scenario 2's verdict on call `call` (a gap: the window moved on while the client was away
/// longer than the stall budget): it ended within 8 s of the cut with the gateway's -32010
/// `resumption failed` error, no result, and no progress delivered twice or out of order.
pub fn gap_error(run: &Run, call: &str) -> Result<String, String> {
    let got = run.progress_of(call);
    if got.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!("progress delivered twice or out of order: {got:?}"));
    }
    if let Some(r) = run.results.get(call) {
        return Err(format!(
            "a result arrived although the window overflowed: {r}"
        ));
    }
    let Some((msg, code)) = run.errors.get(call) else {
        return Err("the call did not end with an error".to_string());
    };
    if *code != Some(-32010) || !msg.contains("resumption failed") {
        return Err(format!(
            "want the gateway's -32010 `resumption failed` error, got {code:?} {msg:?}"
        ));
    }
    let took = match (run.cut_at, run.error_at.get(call)) {
        (Some(c), Some(e)) => e.saturating_duration_since(c),
        _ => Duration::MAX,
    };
    if took > Duration::from_secs(8) {
        return Err(format!("the error came {took:?} after the cut"));
    }
    Ok(format!(
        "error -32010 {:.1} s after the cut; progress before it {got:?}",
        took.as_secs_f64()
    ))
}
