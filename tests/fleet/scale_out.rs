//! Scale-out behind a real load balancer, end to end, on 127.0.0.1 only.
//!
//! - **HAProxy** (the Debian package) runs the shipped `deploy/loadbalancers/haproxy/haproxy.cfg`
//!   itself; only its environment variables (listen ports, the three pods) come from the test.
//! - **Three replicas**, each a real legacy MCP server (TypeScript SDK, no event store:
//!   `tests/interop/ts-server.mjs sse`, named by `$MCP_REPLICA`) with the real `mcp-reattach`
//!   binary in front of it, as in a pod.
//! - **Many real TypeScript-SDK clients** in one process (`tests/interop/ts-scale-client.mjs`),
//!   reaching HAProxy through a [`Relay`] that can cut every connection.
//!
//! Four cases, each printing one `SUMMARY` line with its numbers, each asserting on them:
//! `sticky` (sessions spread over the replicas, every call resumes exactly once through a cut),
//! `non-sticky control` (the same config without its `stick` lines: sessions break with 404),
//! `drain` (one replica gets SIGTERM: in-flight calls finish or end with an explicit 404, new
//! sessions go elsewhere, the other replicas' sessions are untouched) and `kill` (one replica is
//! killed with SIGKILL: its sessions end with the explicit 404, clients re-initialize elsewhere,
//! nothing is silently lost).
//!
//! `sticky` and `non-sticky control` run a second time with a **stateless** upstream in every
//! pod (`tests/interop/scale-stateless-server.mjs`, TypeScript SDK with `sessionIdGenerator:
//! undefined`): the session id HAProxy learns is the one the gateway mints (`mra-<32 hex>`), with
//! the shipped config unchanged (GitHub issue 21).
//!
//! `non-sticky fleet with --store` runs the control's config in front of the stateless upstream
//! with every gateway on one real `redis-server` (issue 48): nothing breaks.
//!
//! Without HAProxy the tests say so on stderr and pass, unless `CI_REQUIRE_HAPROXY` is set
//! (`.ci/run` sets it and installs the package). The cases run one at a time (a lock), each on
//! its own processes; every wait is bounded.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use support::{
    control_config, ensure_npm_deps, haproxy_or_skip, interop_dir, key_file, metric_sum, node_bin,
    repo_dir, wait_listening, Binary, ChildProc, Haproxy, NextLine, Redis, Relay, CONFIG, PODS,
};
use tokio::time::Instant;

/// The cases share the machine's two cores with other test binaries: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------------------------
// HAProxy
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Replicas: a TypeScript-SDK MCP server with mcp-reattach in front
// ---------------------------------------------------------------------------------------------

struct Replica {
    name: &'static str,
    /// Its own MCP server (a pod); `None` in a gateway tier, whose replicas share one.
    server: Option<ChildProc>,
    /// Its proxy listener is what HAProxy sends requests to; its admin listener serves
    /// `/readyz` for HAProxy's health checks, and `/metrics`.
    gateway: Binary,
}

/// The MCP server of every replica: a script under `tests/interop` and its arguments.
#[derive(Clone, Copy)]
struct Shape {
    /// For `SUMMARY` lines.
    label: &'static str,
    server: &'static [&'static str],
}

/// Stateful, SSE answers without ids (the TypeScript SDK without an event store).
const STATEFUL: Shape = Shape {
    label: "stateful upstream",
    server: &["ts-server.mjs", "sse"],
};

/// Stateless (`sessionIdGenerator: undefined`, no `Mcp-Session-Id` on any answer, GET and
/// DELETE answered 405, a request carrying `Mcp-Session-Id` answered 400): the session id the
/// client and HAProxy see is the one the gateway mints, `mra-<32 hex>`.
const STATELESS: Shape = Shape {
    label: "stateless upstream",
    server: &["scale-stateless-server.mjs"],
};

impl Replica {
    async fn start(name: &'static str, shape: Shape, gateway_flags: &[&str]) -> Replica {
        ensure_npm_deps();
        let mut server = ChildProc::spawn_env(
            &format!("{name}-server"),
            &node_bin(),
            shape.server,
            &interop_dir(),
            &[("MCP_REPLICA", name)],
        );
        let port = wait_listening(&mut server, Duration::from_secs(20)).await;
        let mut flags = vec!["--retry-hint", "300ms"];
        flags.extend_from_slice(gateway_flags);
        let gateway = Binary::try_start(
            &format!("{name}-gateway"),
            SocketAddr::from(([127, 0, 0, 1], port)),
            &flags,
            "/readyz",
        )
        .await
        .unwrap_or_else(|e| panic!("{name}'s gateway did not start: {e}"));
        Replica {
            name,
            server: Some(server),
            gateway,
        }
    }

    /// A replica of a gateway tier: the gateway alone, in front of the shared server on
    /// `port`.
    async fn in_tier(name: &'static str, port: u16, gateway_flags: &[&str]) -> Replica {
        let mut flags = vec!["--retry-hint", "300ms"];
        flags.extend_from_slice(gateway_flags);
        let gateway = Binary::try_start(
            &format!("{name}-gateway"),
            SocketAddr::from(([127, 0, 0, 1], port)),
            &flags,
            "/readyz",
        )
        .await
        .unwrap_or_else(|e| panic!("{name}'s gateway did not start: {e}"));
        Replica {
            name,
            server: None,
            gateway,
        }
    }

    /// A sample of the gateway's `/metrics`: the sum over label sets of the lines that start
    /// with `prefix` (a name, or a name and its labels).
    async fn metric(&self, prefix: &str) -> f64 {
        let text = self
            .gateway
            .admin_get("/metrics")
            .await
            .unwrap_or_else(|e| panic!("scraping /metrics: {e}"));
        metric_sum(&text, prefix).unwrap_or(0.0)
    }

    fn sigterm(&self) {
        self.gateway.proc.sigterm();
    }

    /// The pod dies: SIGKILL to the gateway and to its MCP server.
    fn kill9(&mut self) {
        self.gateway.proc.kill();
        if let Some(server) = &mut self.server {
            server.kill();
        }
    }
}

async fn start_replicas(shape: Shape, gateway_flags: &[&str]) -> Vec<Replica> {
    let mut replicas = Vec::new();
    for name in PODS {
        replicas.push(Replica::start(name, shape, gateway_flags).await);
    }
    replicas
}

// ---------------------------------------------------------------------------------------------
// The clients (tests/interop/ts-scale-client.mjs)
// ---------------------------------------------------------------------------------------------

struct Clients {
    proc: ChildProc,
    /// Every event printed so far, in order.
    events: Vec<Value>,
}

impl Clients {
    async fn start(url: &str) -> Clients {
        ensure_npm_deps();
        let proc = ChildProc::spawn_with_stdin(
            "clients",
            &node_bin(),
            &["ts-scale-client.mjs", url],
            &interop_dir(),
            &[],
        );
        let mut clients = Clients {
            proc,
            events: Vec::new(),
        };
        clients
            .wait(|e| e["ev"] == "ready", Duration::from_secs(20))
            .await;
        clients
    }

    fn send(&mut self, cmd: Value) {
        eprintln!("[test] -> clients: {cmd}");
        self.proc.send_line(&cmd.to_string());
    }

    /// The first event (already printed or still to come, at most `limit` from now) that
    /// `pred` accepts.
    async fn wait(&mut self, pred: impl Fn(&Value) -> bool, limit: Duration) -> Value {
        if let Some(e) = self.events.iter().find(|e| pred(e)) {
            return e.clone();
        }
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.proc.next_line(left).await {
                NextLine::Line(l) => {
                    let Ok(e) = serde_json::from_str::<Value>(&l) else {
                        eprintln!("[clients stdout] {l}");
                        continue;
                    };
                    assert!(
                        e["ev"] != "command_failed" && e["ev"] != "bad_command",
                        "the client script failed: {e}"
                    );
                    self.events.push(e.clone());
                    if pred(&e) {
                        return e;
                    }
                }
                other => panic!(
                    "clients: no matching event within {limit:?} ({other:?}); events so far:\n{}",
                    self.events
                        .iter()
                        .map(|e| e.to_string())
                        .collect::<Vec<_>>()
                        .join("\n")
                ),
            }
        }
    }

    /// Waits for `{"ev": ev, "group": group}`.
    async fn wait_ev(&mut self, ev: &str, group: &str, limit: Duration) -> Value {
        self.wait(|e| e["ev"] == ev && e["group"] == group, limit)
            .await
    }

    /// Opens `n` clients of `group` and returns their `open` events.
    async fn open(&mut self, group: &str, n: usize, reinit: usize) -> Vec<Value> {
        self.send(json!({"cmd": "open", "group": group, "n": n, "reinit": reinit}));
        self.wait_ev("opened", group, Duration::from_secs(30)).await;
        self.of(group, "open")
    }

    /// Events `ev` of the clients of `group`.
    /// Opens `n` sessions in `group`, every one of them successfully.
    async fn open_all(&mut self, group: &str, n: usize) {
        let opens = self.open(group, n, 0).await;
        assert!(
            opens.iter().all(|e| e["ok"] == true),
            "every session opens: {opens:?}"
        );
    }

    /// Starts round `round` of `group`'s calls (`steps` progress steps 150 ms apart, 30 s
    /// timeout) and returns once the calls are midway.
    async fn call_midway(&mut self, group: &str, round: u64, steps: u64) {
        self.send(json!({"cmd": "call", "group": group, "round": round,
            "steps": steps, "interval_ms": 150, "timeout_ms": 30000}));
        self.wait(
            |e| e["ev"] == "midcall" && e["round"] == round,
            Duration::from_secs(20),
        )
        .await;
    }

    fn of(&self, group: &str, ev: &str) -> Vec<Value> {
        let prefix = format!("{group}/");
        self.events
            .iter()
            .filter(|e| e["ev"] == ev && e["key"].as_str().is_some_and(|k| k.starts_with(&prefix)))
            .cloned()
            .collect()
    }

    /// `call_end` events of `group` in `round`.
    fn call_ends(&self, group: &str, round: u64) -> Vec<Value> {
        self.of(group, "call_end")
            .into_iter()
            .filter(|e| e["round"] == round)
            .collect()
    }
}

/// The replica each client of `opens` holds its session on (the last successful open).
fn placement(opens: &[Value]) -> BTreeMap<String, String> {
    opens
        .iter()
        .filter(|e| e["ok"] == true)
        .map(|e| (s(&e["key"]), s(&e["replica"])))
        .collect()
}

/// How many clients per pod (every pod listed, 0 included).
fn per_pod(placement: &BTreeMap<String, String>) -> BTreeMap<String, usize> {
    let mut n: BTreeMap<String, usize> = PODS.iter().map(|p| (p.to_string(), 0)).collect();
    for pod in placement.values() {
        *n.entry(pod.clone()).or_default() += 1;
    }
    n
}

fn show(n: &BTreeMap<String, usize>) -> String {
    n.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn s(v: &Value) -> String {
    v.as_str().unwrap_or("").to_string()
}

/// `[1, 2, …, steps]`.
fn full_progress(steps: u64) -> Value {
    Value::from((1..=steps).collect::<Vec<_>>())
}

/// Asserts that `e` is a result of a call that ran exactly once, with every progress event
/// exactly once and in order.
fn assert_clean_result(e: &Value, steps: u64) {
    assert_eq!(e["outcome"], "result", "{e}");
    assert_eq!(
        e["progress"],
        full_progress(steps),
        "progress exactly once: {e}"
    );
    assert_eq!(e["executions"], 1, "the tool ran once for this call: {e}");
    assert_eq!(
        e["ran_on"], e["replica"],
        "ran on the session's replica: {e}"
    );
}

/// One cluster: three replicas, HAProxy with `config`, a relay in front, the clients.
struct Cluster {
    replicas: Vec<Replica>,
    lb: Haproxy,
    relay: Relay,
    clients: Clients,
}

impl Cluster {
    async fn start(haproxy: &Path, config: &Path, gateway_flags: &[&str]) -> Cluster {
        Cluster::start_shape(haproxy, config, STATEFUL, gateway_flags).await
    }

    async fn start_shape(
        haproxy: &Path,
        config: &Path,
        shape: Shape,
        gateway_flags: &[&str],
    ) -> Cluster {
        let replicas = start_replicas(shape, gateway_flags).await;
        let gateways: Vec<&Binary> = replicas.iter().map(|r| &r.gateway).collect();
        let lb = Haproxy::start(haproxy, config, &gateways).await;
        let relay = Relay::start(lb.addr);
        let clients = Clients::start(&relay.url("/mcp")).await;
        Cluster {
            replicas,
            lb,
            relay,
            clients,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sticky_sessions_spread_and_resume_exactly_once_through_cuts() {
    sticky_case(STATEFUL).await;
}

/// The same with a stateless upstream behind every gateway (GitHub issue 21): the shipped
/// config unchanged. The upstream's `initialize` answer has no `Mcp-Session-Id`; the gateway
/// mints one (`mra-<32 hex>`) and returns it, so HAProxy's stick table learns it from the
/// response header exactly as it learns a stateful server's, and every later request of the
/// session (the calls, their resumes after the cuts, the DELETE) reaches the pod holding it.
/// The upstream answers any request carrying `Mcp-Session-Id` with 400: none may reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stateless_upstream_sticky_sessions_spread_and_resume_exactly_once_through_cuts() {
    sticky_case(STATELESS).await;
}

/// `mra-` and 32 lowercase hex digits: the session id the gateway mints for a stateless
/// upstream.
fn is_minted(id: &str) -> bool {
    id.strip_prefix("mra-").is_some_and(|hex| {
        hex.len() == 32
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Lines of the replicas' MCP servers' stderr that contain `what` (`scale-stateless-server.mjs`
/// logs `UNEXPECTED Mcp-Session-Id …` for a request carrying the header, `GET -> 405` and
/// `DELETE -> 405` for those methods).
fn server_log_lines(replicas: &[Replica], what: &str) -> Vec<String> {
    replicas
        .iter()
        .flat_map(|r| r.server.iter().flat_map(ChildProc::stderr_lines))
        .filter(|l| l.contains(what))
        .collect()
}

async fn sticky_case(shape: Shape) {
    let _serial = SERIAL.lock().await;
    let Some(haproxy) = haproxy_or_skip("scale_out", &format!("sticky ({})", shape.label)) else {
        return;
    };
    let mut c = Cluster::start_shape(&haproxy, &repo_dir().join(CONFIG), shape, &[]).await;
    const SESSIONS: usize = 12;
    const ROUNDS: u64 = 2;
    const STEPS: u64 = 10;
    let stateless = shape.server == STATELESS.server;

    let opens = c.clients.open("s", SESSIONS, 0).await;
    assert!(opens.iter().all(|e| e["ok"] == true), "{opens:?}");
    let minted = opens
        .iter()
        .filter(|e| is_minted(&s(&e["session"])))
        .count();
    if stateless {
        assert_eq!(
            minted, SESSIONS,
            "every session id is one the gateway minted: {opens:?}"
        );
    } else {
        assert_eq!(minted, 0, "a stateful upstream's own ids: {opens:?}");
    }
    let place = placement(&opens);
    let spread = per_pod(&place);
    assert!(
        spread.values().all(|n| *n >= 1),
        "sessions land on every replica: {spread:?}"
    );
    // The gateways agree on where the sessions are.
    for r in &c.replicas {
        let held = r.metric("mcp_reattach_sessions").await;
        assert_eq!(
            held as usize, spread[r.name],
            "{} holds its sessions",
            r.name
        );
    }

    let mut cuts = 0;
    for round in 0..ROUNDS {
        c.clients.call_midway("s", round, STEPS).await;
        cuts += c.relay.cut_all();
        c.clients
            .wait(
                |e| e["ev"] == "calls_done" && e["round"] == round,
                Duration::from_secs(40),
            )
            .await;
    }
    c.clients.send(json!({"cmd": "close", "group": "s"}));
    c.clients
        .wait_ev("closed", "s", Duration::from_secs(20))
        .await;

    let mut calls = 0;
    let mut call_resumes = 0;
    for round in 0..ROUNDS {
        let ends = c.clients.call_ends("s", round);
        assert_eq!(ends.len(), SESSIONS, "one end per call: {ends:?}");
        for e in &ends {
            assert_clean_result(e, STEPS);
            assert_eq!(e["attempt"], 0, "no re-initialization: {e}");
            assert_eq!(e["not_found"], 0, "no 404: {e}");
            assert_eq!(e["resumes"], 1, "cut once, resumed exactly once: {e}");
            assert_eq!(place[&s(&e["key"])], s(&e["replica"]), "same session: {e}");
            calls += 1;
            call_resumes += e["resumes"].as_u64().unwrap_or(0);
        }
    }
    let standalone_resumes: u64 = c
        .clients
        .of("s", "client")
        .iter()
        .map(|e| e["standalone_resumes"].as_u64().unwrap_or(0))
        .sum();
    let reinits: u64 = c
        .clients
        .of("s", "client")
        .iter()
        .map(|e| e["reinits"].as_u64().unwrap_or(0))
        .sum();
    let (mut gw_resumed, mut gw_unknown) = (0.0, 0.0);
    for r in &c.replicas {
        gw_resumed += r
            .metric("mcp_reattach_resumes_total{outcome=\"resumed\"}")
            .await;
        gw_unknown += r
            .metric("mcp_reattach_resumes_total{outcome=\"unknown_session\"}")
            .await;
    }
    let leaked = server_log_lines(&c.replicas, "UNEXPECTED Mcp-Session-Id");
    let (gets, deletes) = if stateless {
        (
            server_log_lines(&c.replicas, "GET -> 405").len(),
            server_log_lines(&c.replicas, "DELETE -> 405").len(),
        )
    } else {
        (0, 0)
    };
    println!(
        "SUMMARY sticky ({}): sessions={SESSIONS} (gateway-minted ids: {minted}) per replica: {} | \
         calls={calls} results={calls} cuts={cuts} call resumes={call_resumes} (each call exactly 1) \
         standalone resumes={standalone_resumes} gateway resumes_total{{resumed}}={gw_resumed} \
         {{unknown_session}}={gw_unknown} | 404s=0 re-inits={reinits} losses=0 duplicate executions=0 \
         | requests with Mcp-Session-Id at a stateless upstream={} (GETs it answered 405: {gets}, \
         DELETEs that reached it: {deletes})",
        shape.label,
        show(&spread),
        leaked.len()
    );
    assert!(leaked.is_empty(), "{leaked:?}");
    if stateless {
        assert!(
            gets >= SESSIONS,
            "each session's standalone GET reached the upstream without the header (405)"
        );
        assert_eq!(
            deletes, 0,
            "the gateway answers DELETE of a minted session itself"
        );
    }
    assert_eq!(reinits, 0);
    assert_eq!(call_resumes, calls);
    assert!(
        cuts >= SESSIONS * ROUNDS as usize,
        "every call's stream was cut"
    );
    assert_eq!(
        gw_resumed as u64,
        call_resumes + standalone_resumes,
        "every resume the clients made reached the replica holding its session"
    );
    assert_eq!(
        gw_unknown, 0.0,
        "no resume reached a replica without the session"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_sticky_control_breaks_sessions() {
    non_sticky_case(STATEFUL).await;
}

/// The control with a stateless upstream: the upstream keeps nothing between requests, but the
/// gateway in each pod holds the session (its minted id, its streams' windows), so without the
/// stick lines the sessions break with 404 just as with a stateful upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stateless_upstream_non_sticky_control_breaks_sessions() {
    non_sticky_case(STATELESS).await;
}

async fn non_sticky_case(shape: Shape) {
    let _serial = SERIAL.lock().await;
    let Some(haproxy) = haproxy_or_skip(
        "scale_out",
        &format!("non-sticky control ({})", shape.label),
    ) else {
        return;
    };
    let mut c = Cluster::start_shape(&haproxy, &control_config(), shape, &[]).await;
    const SESSIONS: usize = 12;

    let opens = c.clients.open("c", SESSIONS, 0).await;
    let opened = opens.iter().filter(|e| e["ok"] == true).count();
    let open_404 = opens
        .iter()
        .filter(|e| e["ok"] == false && e["lost404"] == true)
        .count();
    c.clients
        .send(json!({"cmd": "call", "group": "c", "round": 0,
        "steps": 3, "interval_ms": 50, "timeout_ms": 15000}));
    c.clients
        .wait_ev("calls_done", "c", Duration::from_secs(30))
        .await;
    let ends = c.clients.call_ends("c", 0);
    let results = ends.iter().filter(|e| e["outcome"] == "result").count();
    let call_404 = ends.iter().filter(|e| e["outcome"] == "lost_404").count();
    let other_errors = opens
        .iter()
        .filter(|e| e["ok"] == false && e["lost404"] == false)
        .count()
        + ends
            .iter()
            .filter(|e| e["outcome"] != "result" && e["outcome"] != "lost_404")
            .count();
    let not_found: u64 = opens
        .iter()
        .chain(ends.iter())
        .map(|e| e["not_found"].as_u64().unwrap_or(0))
        .sum();
    let broken = SESSIONS - results;
    let mut created = BTreeMap::new();
    for r in &c.replicas {
        created.insert(
            r.name.to_string(),
            r.metric("mcp_reattach_sessions").await as usize,
        );
    }
    println!(
        "SUMMARY non-sticky control ({}; shipped config minus its 3 stick lines): sessions={SESSIONS} \
         held per replica (gateways' sessions gauge): {} | opened={opened} failed to open with 404={open_404} \
         calls={} results={results} calls ended by 404={call_404} | broken sessions={broken} \
         404s={not_found} other errors={other_errors}",
        shape.label,
        show(&created),
        ends.len()
    );
    assert!(
        broken * 3 >= SESSIONS * 2,
        "without stickiness most sessions break ({broken} of {SESSIONS})"
    );
    assert!(
        not_found as usize >= broken,
        "each broken session saw a 404"
    );
    assert_eq!(
        other_errors, 0,
        "the failure is the explicit 404, nothing else"
    );
}

/// The fleet's store (issue 48): the same config without its stick lines, in front of the
/// stateless upstream, each gateway with `--store` on one real `redis-server`. Round robin
/// sends a session's requests to every replica: each adopts the session from the store for its
/// client, and a call cut on one replica is resumed on whichever replica the resume reaches,
/// from the store. Every session opens, every call is cut and resumed exactly once, with every
/// progress event once and its result; no 404, no re-initialization.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stateless_upstream_non_sticky_fleet_with_a_store_resumes_every_call() {
    let _serial = SERIAL.lock().await;
    let Some(haproxy) = haproxy_or_skip("scale_out", "non-sticky fleet with --store") else {
        return;
    };
    let Some(redis) = Redis::start("scale_out non-sticky fleet").await else {
        return;
    };
    let key = key_file("scale-out", 32);
    let flags = [
        "--store",
        redis.url.as_str(),
        "--store-key-file",
        key.to_str().unwrap(),
    ];
    let mut c = Cluster::start_shape(&haproxy, &control_config(), STATELESS, &flags).await;
    const SESSIONS: usize = 12;
    const ROUNDS: u64 = 2;
    const STEPS: u64 = 10;

    c.clients.open_all("f", SESSIONS).await;
    let mut cuts = 0;
    for round in 0..ROUNDS {
        c.clients.call_midway("f", round, STEPS).await;
        cuts += c.relay.cut_all();
        c.clients
            .wait(
                |e| e["ev"] == "calls_done" && e["round"] == round,
                Duration::from_secs(40),
            )
            .await;
    }
    c.clients.send(json!({"cmd": "close", "group": "f"}));
    c.clients
        .wait_ev("closed", "f", Duration::from_secs(20))
        .await;
    let mut calls = 0;
    let mut elsewhere = 0;
    for round in 0..ROUNDS {
        let ends = c.clients.call_ends("f", round);
        assert_eq!(ends.len(), SESSIONS, "one end per call: {ends:?}");
        for e in &ends {
            assert_eq!(e["outcome"], "result", "{e}");
            assert_eq!(
                e["progress"],
                full_progress(STEPS),
                "progress exactly once: {e}"
            );
            assert_eq!(e["executions"], 1, "the tool ran once for this call: {e}");
            assert_eq!(e["attempt"], 0, "no re-initialization: {e}");
            assert_eq!(e["not_found"], 0, "no 404: {e}");
            assert_eq!(e["resumes"], 1, "cut once, resumed exactly once: {e}");
            calls += 1;
            elsewhere += usize::from(e["ran_on"] != e["replica"]);
        }
    }
    let (mut adoptions, mut follows, mut gaps, mut unknown) = (0.0, 0.0, 0.0, 0.0);
    for r in &c.replicas {
        adoptions += r.metric("mcp_reattach_store_adoptions_total").await;
        follows += r.metric("mcp_reattach_store_follows_total").await;
        gaps += r.metric("mcp_reattach_store_follow_gaps_total").await;
        unknown += r
            .metric("mcp_reattach_resumes_total{outcome=\"unknown_session\"}")
            .await;
    }
    println!(
        "SUMMARY non-sticky fleet with --store (stateless upstream; shipped config minus its 3 \
         stick lines): sessions={SESSIONS} calls={calls} results={calls} cuts={cuts} \
         adoptions={adoptions} resumes from the store={follows} (gaps {gaps}) \
         calls answered on another replica than their POST's={elsewhere} | 404s=0 re-inits=0"
    );
    assert!(
        cuts >= SESSIONS * ROUNDS as usize,
        "every call's stream was cut"
    );
    assert!(
        adoptions >= 2.0,
        "round robin spreads each session over the replicas"
    );
    assert!(
        follows >= 1.0,
        "some resumes reached another replica than the call's"
    );
    assert_eq!(gaps, 0.0);
    assert_eq!(unknown, 0.0, "no resume found its session unknown");
}

/// A gateway tier in front of one **stateful** server (TypeScript SDK, no event store): three
/// gateways with `--store` on one `redis-server`, HAProxy without its stick lines. Every
/// request of a session may land on any gateway: each adopts the session, forwards to the one
/// server (which knows it), and a client's standalone `GET` on a gateway that does not hold
/// the session's standalone stream follows it from the store instead of asking the server for
/// a second one (which it refuses with 409). Every call is cut and resumed exactly once; no
/// 404, no 409, no re-initialization.
/// A gateway tier sharing a store: one stateful TypeScript SDK server (`MCP_REPLICA=tier`), a
/// gateway per pod in front of it on one real `redis-server`, HAProxy with the shipped config
/// minus its stick lines, a relay between it and the TypeScript clients (to cut every client
/// connection), and the clients. Fields drop in order: clients first, the store last.
struct Tier {
    clients: Clients,
    relay: Relay,
    _lb: Haproxy,
    replicas: Vec<Replica>,
    server: ChildProc,
    _redis: Redis,
}

impl Tier {
    /// `None` (the test passes, saying so) without HAProxy or `redis-server`, unless CI
    /// requires them.
    async fn start(case: &str) -> Option<Tier> {
        let haproxy = haproxy_or_skip("scale_out", case)?;
        let redis = Redis::start(&format!("scale_out {case}")).await?;
        ensure_npm_deps();
        let mut server = ChildProc::spawn_env(
            "tier-server",
            &node_bin(),
            STATEFUL.server,
            &interop_dir(),
            &[("MCP_REPLICA", "tier")],
        );
        let port = wait_listening(&mut server, Duration::from_secs(20)).await;
        let key = key_file("gateway-tier", 32);
        let flags = [
            "--store",
            redis.url.as_str(),
            "--store-key-file",
            key.to_str().unwrap(),
        ];
        let mut replicas = Vec::new();
        for name in PODS {
            replicas.push(Replica::in_tier(name, port, &flags).await);
        }
        let gateways: Vec<&Binary> = replicas.iter().map(|r| &r.gateway).collect();
        let lb = Haproxy::start(&haproxy, &control_config(), &gateways).await;
        let relay = Relay::start(lb.addr);
        let clients = Clients::start(&relay.url("/mcp")).await;
        Some(Tier {
            clients,
            relay,
            _lb: lb,
            replicas,
            server,
            _redis: redis,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stateful_gateway_tier_non_sticky_with_a_store_resumes_every_call() {
    let _serial = SERIAL.lock().await;
    let Some(tier) = Tier::start("stateful gateway tier with --store").await else {
        return;
    };
    let Tier {
        server,
        replicas,
        relay,
        mut clients,
        ..
    } = tier;
    const SESSIONS: usize = 12;
    const STEPS: u64 = 10;
    clients.open_all("t", SESSIONS).await;
    clients.call_midway("t", 0, STEPS).await;
    let cuts = relay.cut_all();
    clients
        .wait(
            |e| e["ev"] == "calls_done" && e["round"] == 0,
            Duration::from_secs(40),
        )
        .await;
    clients.send(json!({"cmd": "close", "group": "t"}));
    clients
        .wait_ev("closed", "t", Duration::from_secs(20))
        .await;
    let ends = clients.call_ends("t", 0);
    assert_eq!(ends.len(), SESSIONS, "one end per call: {ends:?}");
    for e in &ends {
        assert_eq!(e["outcome"], "result", "{e}");
        assert_eq!(
            e["progress"],
            full_progress(STEPS),
            "progress exactly once: {e}"
        );
        assert_eq!(e["executions"], 1, "the tool ran once for this call: {e}");
        assert_eq!(e["attempt"], 0, "no re-initialization: {e}");
        assert_eq!(e["not_found"], 0, "no 404: {e}");
        assert_eq!(e["resumes"], 1, "cut once, resumed exactly once: {e}");
    }
    let refused: Vec<String> = clients
        .proc
        .stderr_lines()
        .into_iter()
        .filter(|l| l.contains("-> 409") || l.contains("-> 5"))
        .collect();
    let (mut adoptions, mut follows) = (0.0, 0.0);
    for r in &replicas {
        adoptions += r.metric("mcp_reattach_store_adoptions_total").await;
        follows += r.metric("mcp_reattach_store_follows_total").await;
    }
    println!(
        "SUMMARY stateful gateway tier with --store (one TypeScript SDK server, three gateways, \
         shipped config minus its 3 stick lines): sessions={SESSIONS} calls={} results={} \
         cuts={cuts} adoptions={adoptions} served from the store={follows} | 404s=0 \
         409s/5xx seen by the clients={}",
        ends.len(),
        ends.len(),
        refused.len()
    );
    assert!(
        refused.is_empty(),
        "no request refused by the fleet: {refused:?}"
    );
    assert!(cuts >= SESSIONS, "every call's stream was cut");
    assert!(adoptions >= 2.0);
    drop(server);
}

/// How many times `replicas` told a client its stream's owner was lost.
async fn owners_lost_told(replicas: &[&Replica]) -> f64 {
    let mut n = 0.0;
    for r in replicas {
        n += r.metric("mcp_reattach_store_owners_lost_total").await;
    }
    n
}

/// A gateway of a tier sharing a store dies mid-call (SIGKILL; the MCP server lives on). Its
/// calls' clients (the TypeScript SDK's, reconnecting through HAProxy to the survivors) get the
/// call's explicit error, -32011 `owner-lost`, once the dead replica's lease lapses. The SDK
/// resumes any stream that ends without a result, and an error is not one: it comes back at the
/// failure's id, the stream's end position, and gets 409 `stream-ended`, so it is told once,
/// never again and again. The other calls are delivered exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateway_in_a_tier_ends_its_calls_with_owner_lost_once() {
    let _serial = SERIAL.lock().await;
    let Some(tier) = Tier::start("killed gateway in a tier with --store").await else {
        return;
    };
    let Tier {
        mut replicas,
        mut clients,
        ..
    } = tier;
    const SESSIONS: usize = 12;
    const STEPS: u64 = 40; // × 150 ms: longer than the dead replica's lease (3 s)
    clients.open_all("o", SESSIONS).await;
    clients.call_midway("o", 0, STEPS).await;
    replicas[1].kill9();
    clients
        .wait(
            |e| e["ev"] == "calls_done" && e["round"] == 0,
            Duration::from_secs(40),
        )
        .await;
    let ends = clients.call_ends("o", 0);
    assert_eq!(ends.len(), SESSIONS, "one end per call: {ends:?}");
    let (mut results, mut lost) = (0, Vec::new());
    for e in &ends {
        if e["outcome"] == "result" {
            assert_eq!(
                e["progress"],
                full_progress(STEPS),
                "progress exactly once: {e}"
            );
            assert_eq!(e["executions"], 1, "the tool ran once for this call: {e}");
            results += 1;
        } else {
            assert_eq!(e["outcome"], "error", "{e}");
            let error = s(&e["error"]);
            assert!(error.contains("owner-lost"), "the explicit error: {e}");
            lost.push(s(&e["key"]));
        }
    }
    assert!(!lost.is_empty(), "the killed replica ran calls: {ends:?}");
    // The SDK resumes after the error (every 300 ms, the gateways' `--retry-hint`); each
    // resume at the end position is a 409, so it gives up after its two retries. Told the
    // error again instead (a 200), it would resume for good.
    let gave_up = |lines: &[String], key: &str| {
        let says = format!("{key} onerror: Maximum reconnection attempts");
        lines.iter().any(|l| l.contains(&says))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines = clients.proc.stderr_lines();
        if lost.iter().all(|k| gave_up(&lines, k)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "each lost call's client stops resuming within 10 s of its error: {lost:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The survivors' count of owner-lost told (calls, and the standalone streams the dead
    // replica held) has stopped.
    let settled = owners_lost_told(&[&replicas[0], &replicas[2]]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let later = owners_lost_told(&[&replicas[0], &replicas[2]]).await;
    let ended: Vec<String> = clients
        .proc
        .stderr_lines()
        .into_iter()
        .filter(|l| l.contains("GET") && l.contains(".18446744073709551615 -> 409"))
        .collect();
    println!(
        "SUMMARY killed gateway in a tier with --store: calls={SESSIONS} results={results} \
         owner-lost errors={} | owner-lost told by the survivors (calls and held \
         standalone streams)={settled}, 1 s later {later} | the SDK's resumes at the end \
         position, answered 409={}",
        lost.len(),
        ended.len()
    );
    assert!(settled >= lost.len() as f64, "every lost call was told");
    assert_eq!(
        later, settled,
        "nothing told again: the SDK's resumes at the end position are 409"
    );
    assert!(
        ended.len() >= lost.len(),
        "each lost call's client came back at the end position and was answered 409: {ended:?}"
    );
    clients.send(json!({"cmd": "close", "group": "o"}));
    clients
        .wait_ev("closed", "o", Duration::from_secs(20))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drained_replica_finishes_its_calls_and_gets_no_new_sessions() {
    let _serial = SERIAL.lock().await;
    let Some(haproxy) = haproxy_or_skip("scale_out", "drain") else {
        return;
    };
    // Drain budget 2 s + 2 s: the short calls below finish inside it, the long ones do not.
    let mut c = Cluster::start(
        &haproxy,
        &repo_dir().join(CONFIG),
        &["--drain-delay", "2s", "--drain-timeout", "2s"],
    )
    .await;
    const SHORT: u64 = 12; // × 200 ms
    const LONG: u64 = 30; // × 200 ms, beyond the drain budget

    let place_a = placement(&c.clients.open("a", 9, 0).await);
    let place_l = placement(&c.clients.open("l", 3, 0).await);
    assert_eq!(place_a.len() + place_l.len(), 12, "every session opened");
    let before = per_pod(
        &place_a
            .iter()
            .chain(&place_l)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    );
    assert!(
        place_a.values().any(|p| p == "pod1") && place_l.values().any(|p| p == "pod1"),
        "pod1 holds short and long calls: {place_a:?} {place_l:?}"
    );
    c.clients
        .send(json!({"cmd": "call", "group": "l", "round": 0,
        "steps": LONG, "interval_ms": 200, "timeout_ms": 30000, "reinit": 1}));
    c.clients
        .send(json!({"cmd": "call", "group": "a", "round": 0,
        "steps": SHORT, "interval_ms": 200, "timeout_ms": 30000}));
    c.clients
        .wait_ev("midcall", "a", Duration::from_secs(20))
        .await;
    c.clients
        .wait_ev("midcall", "l", Duration::from_secs(20))
        .await;

    let t0 = Instant::now();
    c.replicas[0].sigterm();
    let marked_down =
        c.lb.wait_status("pod1", "DOWN", Duration::from_secs(3))
            .await;
    assert!(
        marked_down < Duration::from_millis(2000),
        "HAProxy takes pod1 out within --drain-delay ({marked_down:?})"
    );
    // Every connection is cut while pod1 is out of the rotation but still accepting: its
    // sessions' resumes must still reach it (`option persist`), not another pod.
    let cut_during_drain = c.relay.cut_all();
    // New sessions while pod1 drains: none may land on it.
    let opens_b = c.clients.open("b", 6, 0).await;
    let place_b = placement(&opens_b);
    let during = per_pod(&place_b);
    assert_eq!(place_b.len(), 6, "{opens_b:?}");
    c.clients
        .send(json!({"cmd": "call", "group": "b", "round": 0,
        "steps": 3, "interval_ms": 50, "timeout_ms": 15000}));
    c.clients
        .wait_ev("calls_done", "b", Duration::from_secs(20))
        .await;
    c.clients
        .wait_ev("calls_done", "a", Duration::from_secs(20))
        .await;
    // Drain delay + drain timeout + up to 2 s of final writes, plus a margin.
    let exit = c.replicas[0]
        .gateway
        .proc
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("the drained gateway exits");
    let exited_after = t0.elapsed();
    c.clients
        .wait_ev("calls_done", "l", Duration::from_secs(40))
        .await;

    // Next round for group a: pod1's clients find their session gone (404) and move.
    c.clients
        .send(json!({"cmd": "call", "group": "a", "round": 1,
        "steps": 3, "interval_ms": 50, "timeout_ms": 15000, "reinit": 1}));
    c.clients
        .wait(
            |e| e["ev"] == "calls_done" && e["group"] == "a" && e["round"] == 1,
            Duration::from_secs(30),
        )
        .await;

    let (mut finished, mut ended_404, mut rerun_ok, mut others, mut others_bad) = (0, 0, 0, 0, 0);
    for e in c.clients.call_ends("a", 0) {
        assert_clean_result(&e, SHORT);
        assert_eq!(
            e["resumes"], 1,
            "cut during the drain, resumed on its pod: {e}"
        );
        if e["replica"] == "pod1" {
            finished += 1;
        } else {
            others += 1;
            others_bad += e["not_found"].as_u64().unwrap_or(0);
        }
    }
    for e in c.clients.call_ends("b", 0) {
        assert_clean_result(&e, 3);
        assert_ne!(e["replica"], "pod1", "{e}");
        others += 1;
        others_bad += e["not_found"].as_u64().unwrap_or(0);
    }
    for e in c.clients.call_ends("l", 0) {
        let on_pod1 = place_l[&s(&e["key"])] == "pod1";
        match (on_pod1, e["attempt"].as_u64()) {
            (true, Some(0)) => {
                assert_eq!(
                    e["outcome"], "lost_404",
                    "cut by the drain, resume answered 404: {e}"
                );
                assert_eq!(
                    e["resumes"], 1,
                    "the resume during the drain reached pod1: {e}"
                );
                ended_404 += 1;
            }
            (true, Some(1)) => {
                assert_clean_result(&e, LONG);
                assert_ne!(e["replica"], "pod1", "{e}");
                rerun_ok += 1;
            }
            (false, Some(0)) => {
                assert_clean_result(&e, LONG);
                assert_eq!(e["resumes"], 1, "{e}");
                others += 1;
                others_bad += e["not_found"].as_u64().unwrap_or(0);
            }
            _ => panic!("unexpected call end {e}"),
        }
    }
    let (mut moved, mut moved_ok) = (0, 0);
    for e in c.clients.call_ends("a", 1) {
        if place_a[&s(&e["key"])] == "pod1" {
            if e["attempt"] == 0 {
                assert_eq!(e["outcome"], "lost_404", "{e}");
                moved += 1;
            } else {
                assert_clean_result(&e, 3);
                assert_ne!(e["replica"], "pod1");
                moved_ok += 1;
            }
        } else {
            assert_clean_result(&e, 3);
            assert_eq!(e["attempt"], 0, "{e}");
            assert_eq!(e["not_found"], 0, "{e}");
        }
    }
    let in_flight_pod1 = place_a.values().filter(|p| *p == "pod1").count()
        + place_l.values().filter(|p| *p == "pod1").count();
    println!(
        "SUMMARY drain: sessions before: {} | SIGTERM pod1: HAProxy marked it DOWN after {} ms, \
         then every connection was cut ({cut_during_drain}) and resumed on its own pod; pod1 \
         exited {:?} after {} ms | pod1 in-flight calls={in_flight_pod1}: finished={finished} \
         ended explicitly (404 on resume)={ended_404} re-run elsewhere ok={rerun_ok} lost=0 | new \
         sessions during drain: {} | other replicas' calls={others} results={others} 404s={others_bad} \
         | next round: pod1 clients got 404={moved} re-initialized elsewhere ok={moved_ok}",
        show(&before),
        marked_down.as_millis(),
        exit.code(),
        exited_after.as_millis(),
        show(&during),
    );
    assert_eq!(exit.code(), Some(0), "the drained gateway exits 0");
    assert_eq!(during["pod1"], 0, "no new session on the draining replica");
    assert_eq!(
        finished + ended_404,
        in_flight_pod1,
        "every pod1 call accounted for"
    );
    assert!(finished >= 1 && ended_404 >= 1, "both outcomes exercised");
    assert_eq!(rerun_ok, ended_404);
    assert_eq!(others_bad, 0, "the other replicas' sessions are untouched");
    assert_eq!(moved, place_a.values().filter(|p| *p == "pod1").count());
    assert_eq!(moved_ok, moved);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_replica_sessions_end_with_404_and_move_elsewhere() {
    let _serial = SERIAL.lock().await;
    let Some(haproxy) = haproxy_or_skip("scale_out", "kill") else {
        return;
    };
    let mut c = Cluster::start(&haproxy, &repo_dir().join(CONFIG), &[]).await;
    const STEPS: u64 = 16; // × 150 ms

    let place = placement(&c.clients.open("k", 9, 0).await);
    assert_eq!(place.len(), 9);
    let before = per_pod(&place);
    assert!(before["pod2"] >= 1, "{before:?}");
    c.clients
        .send(json!({"cmd": "call", "group": "k", "round": 0,
        "steps": STEPS, "interval_ms": 150, "timeout_ms": 30000, "reinit": 1}));
    let mid = c
        .clients
        .wait_ev("midcall", "k", Duration::from_secs(20))
        .await;
    c.replicas[1].kill9();
    let killed_at = mid["at_ms"].as_u64().unwrap_or(0);
    c.clients
        .wait_ev("calls_done", "k", Duration::from_secs(40))
        .await;
    c.clients
        .send(json!({"cmd": "call", "group": "k", "round": 1,
        "steps": 2, "interval_ms": 50, "timeout_ms": 15000}));
    c.clients
        .wait(
            |e| e["ev"] == "calls_done" && e["round"] == 1,
            Duration::from_secs(20),
        )
        .await;

    let (mut ended_404, mut slowest_404_ms, mut rerun_ok, mut others, mut others_404) =
        (0, 0, 0, 0, 0);
    let mut moved_to: BTreeMap<String, usize> = BTreeMap::new();
    for e in c.clients.call_ends("k", 0) {
        if place[&s(&e["key"])] == "pod2" {
            if e["attempt"] == 0 {
                assert_eq!(
                    e["outcome"], "lost_404",
                    "the killed pod's call ends with 404: {e}"
                );
                ended_404 += 1;
                slowest_404_ms = slowest_404_ms.max(e["at_ms"].as_u64().unwrap_or(0) - killed_at);
            } else {
                assert_clean_result(&e, STEPS);
                assert_ne!(e["replica"], "pod2", "{e}");
                *moved_to.entry(s(&e["replica"])).or_default() += 1;
                rerun_ok += 1;
            }
        } else {
            assert_clean_result(&e, STEPS);
            assert_eq!(e["attempt"], 0, "{e}");
            others += 1;
            others_404 += e["not_found"].as_u64().unwrap_or(0);
        }
    }
    let next = c.clients.call_ends("k", 1);
    for e in &next {
        assert_clean_result(e, 2);
        assert_eq!(e["attempt"], 0, "{e}");
        assert_ne!(e["replica"], "pod2", "{e}");
    }
    println!(
        "SUMMARY kill: sessions before: {} | kill -9 pod2 (gateway and MCP server) mid-call | its \
         in-flight calls={}: ended with 404={ended_404} (slowest {slowest_404_ms} ms after the \
         kill) clients re-initialized={rerun_ok} on {:?} re-run results={rerun_ok} | other \
         replicas' calls={others} results={others} 404s={others_404} | next round calls={} \
         results={} | timeouts or silent losses=0",
        show(&before),
        before["pod2"],
        moved_to,
        next.len(),
        next.len(),
    );
    assert_eq!(ended_404, before["pod2"]);
    assert_eq!(rerun_ok, ended_404);
    assert!(
        slowest_404_ms < 10_000,
        "the loss is answered at once, not at the request timeout ({slowest_404_ms} ms)"
    );
    assert_eq!(others_404, 0, "the other replicas' sessions are untouched");
    assert_eq!(next.len(), 9);
}
