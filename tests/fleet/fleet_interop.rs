//! A fleet without sticky routing, with the real SDK clients (issue 48): "a call cut and
//! resumed on another replica with no request refused (no 404, 409 or 5xx from the fleet)",
//! shown with the TypeScript SDK and the Python SDK clients in front of three real servers.
//!
//! ```text
//! SDK client ──> Relay (cuts) ──> HAProxy (round robin, no stick lines) ──┬─> mcp-reattach pod1 ─┐
//!                                                                          ├─> mcp-reattach pod2 ─┼─> one MCP server
//!                                                                          └─> mcp-reattach pod3 ─┘
//!                                          the three gateways: --store redis://… (one real redis-server)
//! ```
//!
//! - **The fleet**: one real `redis-server` ([`Redis`]), three real `mcp-reattach` binaries
//!   with `--store`, `--store-key-file` and `--retry-hint 300ms` in front of **one** upstream
//!   process (a gateway tier), and HAProxy (the Debian package) running the shipped
//!   `deploy/loadbalancers/haproxy/haproxy.cfg` minus its three `stick` lines: every request
//!   (not only every session) goes round robin to the next gateway, so a session's requests land
//!   on every replica.
//! - **Servers**: the TypeScript SDK 1.x stateful server (`tests/interop/ts-server.mjs sse`, no
//!   event store: the session id is the server's), TypeScript SDK v2's `createMcpHandler`
//!   (`tests/interop/v2/ts2-server.mjs`, stateless for 2025-era clients: the gateway mints the
//!   session id) and a stateless FastMCP 4.x server (`tests/interop/fastmcp4/server.py
//!   --stateless`: minted too).
//! - **Clients**: the TypeScript SDK (`ts-driver.mjs`) and the Python SDK (`py-driver.py`)
//!   drivers, each running [`CALLS`] `slow_progress` calls of [`STEPS`] steps at once. The relay
//!   cuts every connection of the client after progress 3 of call 0 (the TypeScript client also
//!   after 6 and 9; the Python client only once: a *resumed* stream that breaks again hits its
//!   SDK's known resume bugs, see `explained_by_py_bugs`, which are not what this shows).
//!
//! Each case (server × client) asserts: every call completes with progress 1..=[`STEPS`] once
//! each, in order, and exactly one result; every cut hit the client's live streams and the
//! client resumed (GETs with `Last-Event-ID`); no request of the run was answered 404, 409 or
//! 5xx, checked three ways: the client's own log of every HTTP request it made, every
//! gateway's access lines (`--log-format json`), and HAProxy's log; the replicas adopted the
//! session from the store and at least one resume was served from the store by another replica
//! than the one reading the call (`store_follows_total`), with no explicit gap; the session id is
//! the server's for the stateful server and one the gateway minted (`mra-<80 hex>`, self-certifying in a fleet) for the
//! stateless ones. Each case prints one `SUMMARY` line with its numbers.
//!
//! **The stateful server's standalone stream.** A replica holds it (`--hold-standalone`,
//! opened upstream when `notifications/initialized` reaches it) and names it in the store when
//! it opens; the client's live `GET` on another replica follows it from the store (a second
//! `GET` upstream would be refused 409 by the stateful server), and a resume of it on another
//! replica is served from the store. These two cases failed with 409s before the held stream
//! was published at its opening (it was published with its first event, which a quiet server
//! never sends).
//!
//! Without HAProxy (or `redis-server`) the cases say so on stderr and pass, unless
//! `CI_REQUIRE_HAPROXY` (or `CI_REQUIRE_REDIS`) is set. The cases run one at a time (a lock),
//! each on its own processes; every wait is bounded. Run with
//! `cargo test --test fleet fleet_interop:: -- --nocapture`.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use support::{
    complete, control_config, cut_on_progress, haproxy_or_skip, install_shape_deps, key_file,
    metric_sum, run_client, Binary, ChildProc, Cl, Driver, Faults, Haproxy, NextLine, Redis, Relay,
    Run, Upstream, PODS,
};
use tokio::time::Instant;

/// The cases share the machine's two cores with other test binaries: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Calls each client runs at once, and the steps of each (`INTERVAL_MS` apart). Not a multiple
/// of 3: the calls' POSTs take `CALLS` consecutive turns of the round robin over the 3
/// replicas and, after a cut, their resumes take the `CALLS` turns after them, so the replicas
/// the resumes reach are not those the POSTs reached, whatever order the resumes come in: at
/// least one call is resumed on another replica than the one reading it (a multiple of 3 would
/// send every resume back to its own call's replica whenever they come in the calls' order).
const CALLS: usize = 4;
const STEPS: u32 = 12;
const INTERVAL_MS: u32 = 200;

// ---------------------------------------------------------------------------------------------
// HAProxy (tests/support/haproxy.rs), and what its log says
// ---------------------------------------------------------------------------------------------

impl Haproxy {
    /// The requests HAProxy logged so far (its `option httplog` lines on stdout) that went to
    /// the `mcp_reattach` backend.
    async fn requests(&mut self) -> Vec<Forwarded> {
        let mut out = Vec::new();
        for line in drain_stdout(&mut self.proc).await {
            let words: Vec<&str> = line.split_whitespace().collect();
            let Some(at) = words.iter().position(|w| w.starts_with("mcp_reattach/")) else {
                continue;
            };
            let pod = words[at].trim_start_matches("mcp_reattach/").to_string();
            // `<backend>/<server> Tq/Tw/Tc/Tr/Ta <status> …`
            let status = words
                .get(at + 2)
                .and_then(|s| s.parse::<i32>().ok())
                .map_or(0, |s| u16::try_from(s).unwrap_or(0));
            let method = line
                .split_once('"')
                .and_then(|(_, r)| r.split_whitespace().next())
                .unwrap_or("-")
                .to_string();
            out.push(Forwarded {
                pod,
                status,
                method,
                line,
            });
        }
        out
    }
}

/// A request HAProxy forwarded to a pod, from its log line.
struct Forwarded {
    pod: String,
    status: u16,
    method: String,
    line: String,
}

/// Every stdout line `proc` wrote so far (it is given 300 ms to write what it still holds).
async fn drain_stdout(proc: &mut ChildProc) -> Vec<String> {
    let mut lines = Vec::new();
    while let NextLine::Line(l) = proc.next_line(Duration::from_millis(300)).await {
        lines.push(l);
    }
    lines
}

// ---------------------------------------------------------------------------------------------
// The fleet: one redis-server, one upstream, three gateways, HAProxy
// ---------------------------------------------------------------------------------------------

/// The one MCP server behind the gateway tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    /// `ts-server.mjs sse`: TypeScript SDK 1.x, stateful, SSE answers, no event store.
    Ts1Stateful,
    /// `v2/ts2-server.mjs`: TypeScript SDK v2's `createMcpHandler`, stateless for 2025-era
    /// clients.
    Ts2Handler,
    /// `fastmcp4/server.py --stateless`: FastMCP 4.x, `stateless_http=True`, SSE answers.
    FastMcpStateless,
}

impl Server {
    fn label(self) -> &'static str {
        match self {
            Server::Ts1Stateful => "ts1 stateful server",
            Server::Ts2Handler => "ts2 createMcpHandler",
            Server::FastMcpStateless => "fastmcp4 stateless server",
        }
    }

    /// Whether the server has no sessions: the gateway mints the session id.
    fn stateless(self) -> bool {
        self != Server::Ts1Stateful
    }

    async fn start(self) -> Upstream {
        match self {
            Server::Ts1Stateful => Upstream::ts("sse").await,
            Server::Ts2Handler => Upstream::ts2(&[]).await,
            Server::FastMcpStateless => Upstream::fastmcp(&["--stateless"]).await,
        }
    }
}

struct Fleet {
    _redis: Redis,
    upstream: Upstream,
    /// pod1..pod3, in [`PODS`] order.
    gateways: Vec<Binary>,
    lb: Haproxy,
}

impl Fleet {
    /// The fleet in front of `server`, or None (after saying why) when HAProxy or
    /// `redis-server` is missing and not required.
    async fn start(server: Server, case: &str) -> Option<Fleet> {
        let haproxy = haproxy_or_skip("fleet_interop", case)?;
        let redis = Redis::start(&format!("fleet_interop {case}")).await?;
        // A clean clone installs the npm packages and the virtualenvs here, before any clock.
        install_shape_deps().await;
        let upstream = server.start().await;
        let key = key_file("fleet-interop", 32);
        let flags = [
            "--store",
            redis.url.as_str(),
            "--store-key-file",
            key.to_str().expect("UTF-8 path"),
            "--retry-hint",
            "300ms",
            "--log-format",
            "json",
        ];
        let mut gateways = Vec::new();
        for pod in PODS {
            gateways.push(
                Binary::try_start(&format!("{pod}-gateway"), upstream.addr, &flags, "/readyz")
                    .await
                    .unwrap_or_else(|e| panic!("{pod}'s gateway did not start: {e}")),
            );
        }
        let pods: Vec<&Binary> = gateways.iter().collect();
        let lb = Haproxy::start(&haproxy, &control_config(), &pods).await;
        Some(Fleet {
            _redis: redis,
            upstream,
            gateways,
            lb,
        })
    }

    /// The sum over the gateways of the `/metrics` samples of `series`.
    async fn metric(&self, series: &str) -> f64 {
        let mut sum = 0.0;
        for g in &self.gateways {
            let text = g
                .admin_get("/metrics")
                .await
                .unwrap_or_else(|e| panic!("scraping /metrics: {e}"));
            sum += metric_sum(&text, series).unwrap_or(0.0);
        }
        sum
    }

    /// Every gateway's access lines so far, each with its pod's name, and its other log lines
    /// (for a failure message).
    async fn logs(&mut self) -> (Vec<Access>, Vec<String>) {
        let mut out = Vec::new();
        let mut other = Vec::new();
        for (pod, g) in PODS.iter().zip(&mut self.gateways) {
            for line in drain_stdout(&mut g.proc).await {
                let v = serde_json::from_str::<Value>(&line).unwrap_or_default();
                if v["message"] != "request finished" {
                    other.push(format!("{pod}: {line}"));
                    continue;
                }
                let text = |k: &str| v[k].as_str().unwrap_or("-").to_string();
                out.push(Access {
                    pod,
                    method: text("http.request.method"),
                    status: v["http.response.status_code"]
                        .as_u64()
                        .and_then(|s| u16::try_from(s).ok())
                        .unwrap_or(0),
                    mcp_method: text("mcp.method.name"),
                    replayed: v["replayed"].as_u64().unwrap_or(0),
                    error: text("error.type"),
                    line,
                });
            }
        }
        (out, other)
    }
}

/// One access line of a gateway.
#[derive(Debug)]
struct Access {
    pod: &'static str,
    method: String,
    status: u16,
    mcp_method: String,
    replayed: u64,
    error: String,
    /// The whole line, for a failure message.
    line: String,
}

/// A status the fleet must never answer here: 404, 409 or any 5xx.
fn refused(status: u16) -> bool {
    status == 404 || status == 409 || status >= 500
}

/// `mra-` and 80 lowercase hex digits: a session id a fleet's gateway minted (random, the
/// epoch and the fleet's MAC; 32 without a store).
fn is_minted(id: &str) -> bool {
    id.strip_prefix("mra-").is_some_and(|h| {
        h.len() == 80
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// `name=count` for every pod, 0 included.
fn per_pod<'a>(pods: impl Iterator<Item = &'a str>) -> String {
    let mut n: BTreeMap<&str, usize> = PODS.iter().map(|p| (*p, 0)).collect();
    for p in pods {
        *n.entry(p).or_default() += 1;
    }
    n.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

// ---------------------------------------------------------------------------------------------
// One case: a client's calls through the fleet, cut and resumed
// ---------------------------------------------------------------------------------------------

async fn case(server: Server, client: Cl) {
    let _serial = SERIAL.lock().await;
    let name = format!("{} × {}", server.label(), client.label());
    let Some(mut fleet) = Fleet::start(server, &name).await else {
        return;
    };
    let started = Instant::now();
    let relay = Arc::new(Relay::start(fleet.lb.addr));
    // The TypeScript client resumes a resumed stream again correctly: three cuts. The Python
    // client's SDK does not (`explained_by_py_bugs`): one cut, every stream resumed once.
    let cut_after: &'static [u64] = match client {
        Cl::Py => &[3],
        _ => &[3, 6, 9],
    };
    let call = json!({"tool": "slow_progress",
        "args": {"steps": STEPS, "interval_ms": INTERVAL_MS}});
    let plan = json!({"timeout_ms": 20000, "calls": vec![call; CALLS]});
    let mut faults = Faults {
        relay: relay.clone(),
        gateway: fleet.lb.addr,
        cuts_hit: 0,
        deleted: None,
        cut_at: None,
    };
    let driver = Driver::spawn_process(client, &relay.url("/mcp"), &plan);
    let run = run_client(
        client,
        driver,
        Duration::from_secs(40),
        &mut faults,
        cut_on_progress(cut_after),
    )
    .await;
    let took = started.elapsed();
    // Let every replica write the lines of the streams the client closed last.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut failures: Vec<String> = Vec::new();
    let want = format!("done {STEPS}");
    for k in 0..CALLS {
        let key = k.to_string();
        if let Err(e) = complete(&run, &key, STEPS, &|t| t == want) {
            failures.push(e);
        }
        let results = run
            .events
            .iter()
            .filter(|(_, v)| v["ev"] == "result" && v["call"] == k)
            .count();
        if results != 1 {
            failures.push(format!("call {k}: {results} results"));
        }
    }
    if run.exit_code != Some(0) || run.cut_short.is_some() {
        failures.push(format!(
            "the client did not finish cleanly: exit {:?}, cut short {:?}",
            run.exit_code, run.cut_short
        ));
    }
    if run.cuts_hit != cut_after.len() {
        failures.push(format!(
            "{} of {} cuts hit a live connection",
            run.cuts_hit,
            cut_after.len()
        ));
    }
    let session = run.session.clone().unwrap_or_default();
    if is_minted(&session) != server.stateless() {
        failures.push(format!(
            "session id {session:?}: want {}",
            if server.stateless() {
                "one the gateway minted"
            } else {
                "the server's own"
            }
        ));
    }

    // What the client saw: every HTTP request it made, with its status.
    let http = run.http();
    let resumes = run.resumes();
    let client_refused: Vec<String> = http
        .iter()
        .filter(|(_, _, out)| {
            out.split_whitespace()
                .next()
                .and_then(|s| s.parse::<u16>().ok())
                .is_some_and(refused)
        })
        .map(|(m, lei, out)| format!("{m} lei={lei} -> {out}"))
        .collect();
    if client_refused.is_empty() && resumes.len() < cut_after.len() {
        failures.push(format!(
            "{} cut(s) but {} resume GET(s)",
            cut_after.len(),
            resumes.len()
        ));
    }
    // What the gateways answered, and what HAProxy forwarded.
    let (access, gw_log) = fleet.logs().await;
    let lb_log = fleet.lb.requests().await;
    let gw_refused: Vec<String> = access
        .iter()
        .filter(|a| refused(a.status))
        .map(|a| {
            format!(
                "{}: {} {} -> {} ({})",
                a.pod, a.method, a.mcp_method, a.status, a.error
            )
        })
        .collect();
    let lb_refused: Vec<String> = lb_log
        .iter()
        .filter(|f| refused(f.status))
        .map(|f| format!("{}: {} -> {}", f.pod, f.method, f.status))
        .collect();
    let calls_on = per_pod(
        access
            .iter()
            .filter(|a| a.method == "POST" && a.mcp_method == "tools/call")
            .map(|a| a.pod),
    );
    let replays_on = per_pod(
        access
            .iter()
            .filter(|a| a.method == "GET" && a.replayed > 0)
            .map(|a| a.pod),
    );
    let adoptions = fleet.metric("mcp_reattach_store_adoptions_total").await;
    let follows = fleet.metric("mcp_reattach_store_follows_total").await;
    let gaps = fleet.metric("mcp_reattach_store_follow_gaps_total").await;
    let owners_lost = fleet.metric("mcp_reattach_store_owners_lost_total").await;
    let resumed = fleet
        .metric("mcp_reattach_resumes_total{outcome=\"resumed\"}")
        .await;
    let upstream_alive = fleet
        .upstream
        .proc
        .wait_exit(Duration::ZERO)
        .await
        .is_none();

    println!(
        "SUMMARY fleet {name}: session {} | requests through HAProxy={} per replica: {} | \
         calls={CALLS} results={} progress 1..={STEPS} once each: {} | cuts={} resume GETs={} \
         (gateways' resumes_total{{resumed}}={resumed}) | tools/call POSTs per replica: {calls_on}; \
         GETs that replayed events per replica: {replays_on} | store: adoptions={adoptions} \
         resumes served from the store={follows} gaps={gaps} owners lost={owners_lost} | \
         404/409/5xx: client saw {} gateways answered {} HAProxy logged {} | {} ms",
        if server.stateless() {
            "minted by the gateway"
        } else {
            "the server's"
        },
        lb_log.len(),
        per_pod(lb_log.iter().map(|f| f.pod.as_str())),
        run.results.len(),
        (0..CALLS).all(|k| run.progress_of(&k.to_string()) == (1..=u64::from(STEPS)).collect::<Vec<_>>()),
        run.cuts_hit,
        resumes.len(),
        client_refused.len(),
        gw_refused.len(),
        lb_refused.len(),
        took.as_millis(),
    );

    if !client_refused.is_empty() {
        failures.push(format!("the client was refused: {client_refused:?}"));
    }
    if !gw_refused.is_empty() {
        failures.push(format!("the gateways refused: {gw_refused:?}"));
    }
    if !lb_refused.is_empty() {
        failures.push(format!("HAProxy logged: {lb_refused:?}"));
    }
    let pods_used = PODS
        .iter()
        .filter(|p| lb_log.iter().any(|f| f.pod == **p))
        .count();
    if pods_used < 3 {
        failures.push(format!("round robin reached {pods_used} of 3 replicas"));
    }
    if adoptions < 2.0 {
        failures.push(format!(
            "{adoptions} adoptions: the session's requests did not spread"
        ));
    }
    if follows < 1.0 {
        failures.push("no resume was served from the store by another replica".into());
    }
    if gaps > 0.0 || owners_lost > 0.0 {
        failures.push(format!(
            "resumes from the store ended with {gaps} gap(s), {owners_lost} lost owner(s)"
        ));
    }
    if !upstream_alive {
        failures.push("the upstream exited".into());
    }
    assert!(
        failures.is_empty(),
        "fleet {name}:\n  {}\n\n{}",
        failures.join("\n  "),
        report(&run, &access, &gw_log, &lb_log)
    );
}

/// The client's run, the gateways' logs and HAProxy's log, for a failure message.
fn report(run: &Run, access: &[Access], gw_log: &[String], lb_log: &[Forwarded]) -> String {
    let lines: Vec<String> = access
        .iter()
        .map(|a| format!("{}: {}", a.pod, a.line))
        .collect();
    let forwarded: Vec<&str> = lb_log.iter().map(|f| f.line.as_str()).collect();
    format!(
        "{}\ngateways' access lines:\n  {}\ngateways' other log lines:\n  {}\nHAProxy's log:\n  {}",
        run.report(),
        lines.join("\n  "),
        gw_log.join("\n  "),
        forwarded.join("\n  ")
    )
}

// ---------------------------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------------------------

/// The client's live `GET` lands on a replica that does not hold the session's standalone
/// stream: it follows the one held elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ts_client_through_a_non_sticky_fleet_in_front_of_a_stateful_ts_server() {
    case(Server::Ts1Stateful, Cl::Ts).await;
}

/// The client's resume of its standalone stream lands on another replica than the one
/// holding it: served from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn py_client_through_a_non_sticky_fleet_in_front_of_a_stateful_ts_server() {
    case(Server::Ts1Stateful, Cl::Py).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ts_client_through_a_non_sticky_fleet_in_front_of_ts2_create_mcp_handler() {
    case(Server::Ts2Handler, Cl::Ts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn py_client_through_a_non_sticky_fleet_in_front_of_ts2_create_mcp_handler() {
    case(Server::Ts2Handler, Cl::Py).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ts_client_through_a_non_sticky_fleet_in_front_of_a_stateless_fastmcp_server() {
    case(Server::FastMcpStateless, Cl::Ts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn py_client_through_a_non_sticky_fleet_in_front_of_a_stateless_fastmcp_server() {
    case(Server::FastMcpStateless, Cl::Py).await;
}
