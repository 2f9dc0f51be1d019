//! Orchestrator: starts each arm (direct, naive pass-through, nginx, mcp-reattach; for the
//! storm also ts-eventstore, the TypeScript SDK resuming streams itself; mcp-reattach-store,
//! the gateway with the fleet's store on a `redis-server` of the run's own) as its own
//! processes on 127.0.0.1, runs the scenarios interleaved for N rounds (arm order rotated
//! each round), samples /proc for the proxy's (and the store's) CPU and RSS, and prints a
//! ratio table plus JSON; writes docs/benchmarks.md.
//!
//! Placement (2 cores): the proxy under test on core 1; the mock upstream and the load
//! client on core 0, in every arm (direct included), so the endpoints get the same CPU in
//! every arm and the hop gets its own core.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use mcp_reattach_bench::checks::check_of;
use mcp_reattach_bench::procfs;
use serde_json::{json, Value};

#[derive(Parser, Clone)]
struct Args {
    /// 1 round, short durations, fewer sessions: a smoke test.
    #[arg(long)]
    quick: bool,
    #[arg(long)]
    rounds: Option<usize>,
    /// Rounds for the memory scenarios (slow to set up; default 2, quick 1).
    #[arg(long)]
    memory_rounds: Option<usize>,
    /// Comma-separated scenario keys to run (default: all). Keys: json, calls, calls-unpinned,
    /// calls-streamed (each event its own write, 100 µs apart, unpinned), calls-streamed-pinned,
    /// json-paced,
    /// sse-200-1, sse-200-8, sse-16k-1, sse-16k-8 (saturating, the mock writes bursts of
    /// events), the same with `-single` (one `write` per event), sse-200-1-unpinned,
    /// sse-200-8-unpinned (the burst scenarios unpinned, with the store arm), paced-1, paced-50,
    /// idle-N, window-N, storm, resume-other (a call cut on one replica of a fleet, resumed on
    /// another from the store), call-storm (the worst minute: every call in flight cut at once
    /// and resumed together; a fleet that loses a replica; nginx). Groups: `saturating` (the four pinned burst scenarios),
    /// `sse-single` (the four single ones), `sse` (all), `idle`, `window`, `store` (every
    /// scenario with the mcp-reattach-store arm).
    #[arg(long)]
    only: Option<String>,
    /// Comma-separated arms to run (default: all): direct, naive, nginx, mcp-reattach,
    /// ts-eventstore (storm only), nginx-tls, mcp-reattach-tls (the TLS arms: json and saturating SSE only),
    /// mcp-reattach-store (the gateway with `--store` on a `redis-server` of each run's own).
    #[arg(long)]
    arms: Option<String>,
    /// The `redis-server` of the mcp-reattach-store arm (Debian's `redis-server` package); the
    /// arm is skipped when it is missing.
    #[arg(long, default_value = "redis-server")]
    redis_server: PathBuf,
    /// The ts-eventstore arm's Node package (`server.mjs`, its `node_modules` installed by
    /// `bench/run`); the arm is skipped when `node` or the package's modules are missing.
    #[arg(long, default_value = "bench/ts-eventstore")]
    ts_eventstore: PathBuf,
    /// SO_SNDBUF of the mock's connections in the SSE scenarios, KiB (the kernel doubles it);
    /// 0 (default) leaves the kernel's autotuning, as a real server has. 512 makes direct
    /// 16 KiB × 8 about twice as fast (less in flight, warm in cache), but it also hides the
    /// gateway's missing backpressure: the mock can no longer get megabytes ahead, and the
    /// sse-16k runs that end in gaps with autotuning pass.
    #[arg(long, default_value_t = 0)]
    mock_sndbuf_kib: u32,
    /// Duration of each saturating SSE run in ms (default 2000, quick 1000).
    #[arg(long)]
    sse_ms: Option<u64>,
    /// The gateway binary.
    #[arg(long, default_value = "target/release/mcp-reattach")]
    gateway: PathBuf,
    /// Directory of the bench binaries.
    #[arg(long, default_value = "bench/target/release")]
    bin: PathBuf,
    /// Where the report goes (default docs/benchmarks.md; with --pinned
    /// docs/benchmarks-pinned.md).
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, default_value = "bench/target/results.json")]
    json_out: PathBuf,
    /// The second view: pin each process to its core (the proxy under test on core 1, the
    /// mock and the load client on core 0). Default: nothing pinned, each process with its
    /// default threading, as users deploy (a scenario named `-pinned` or `-unpinned` is
    /// placed as its name says either way).
    #[arg(long)]
    pinned: bool,
    /// Pin the paced-latency scenarios too (default: those run unpinned, see the method notes).
    #[arg(long)]
    pin_paced: bool,
    /// Run the proxy under test with SCHED_FIFO priority 1 (`chrt -f 1`) instead of `nice`,
    /// so other work on the shared machine cannot take its core (runs are seconds long).
    #[arg(long)]
    no_rt: bool,
    /// Niceness of the mock upstream: lower priority than the load client on their shared
    /// core, so a producer the proxy never pushes back on cannot starve the consumer.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    mock_nice: i32,
    /// Niceness of the load client and (with --no-rt) the proxy (the machine is shared: a negative value keeps
    /// other work from preempting the measured processes; 0 leaves it alone).
    #[arg(long, default_value_t = -10, allow_negative_numbers = true)]
    nice: i32,
    /// Do not write docs/benchmarks.md (results JSON is still written).
    #[arg(long)]
    no_doc: bool,
    /// Run nothing: re-render docs/benchmarks.md (and the table) from a results JSON file.
    #[arg(long)]
    render: Option<PathBuf>,
}

impl Args {
    /// Where the report goes.
    fn report_path(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| {
            if self.pinned {
                "docs/benchmarks-pinned.md".into()
            } else {
                "docs/benchmarks.md".into()
            }
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
enum Arm {
    Direct,
    Naive,
    Nginx,
    Reattach,
    /// No gateway: the TypeScript SDK's StreamableHTTPServerTransport with its
    /// InMemoryEventStore serves the storm itself (bench/ts-eventstore/server.mjs).
    TsEventStore,
    /// nginx terminating TLS (the client speaks TLS 1.3 to it).
    NginxTls,
    /// mcp-reattach terminating TLS (--tls-cert/--tls-key).
    ReattachTls,
    /// mcp-reattach with `--json-upgrade false`: JSON answers pass through as they came
    /// (json only: the other scenarios are answered with SSE either way).
    ReattachPlain,
    /// nginx serving the storm's events from files (storm only): what sending the same bytes
    /// on a fresh connection costs a server that computes nothing, the floor of a resume.
    NginxFile,
    /// mcp-reattach with the fleet's store (`--store`, `--store-key-file`) on a fresh
    /// `redis-server` started for the run (issue 48); the store's CPU is sampled beside the
    /// gateway's.
    ReattachStore,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Arm::Direct => "direct",
            Arm::Naive => "naive",
            Arm::Nginx => "nginx",
            Arm::Reattach => "mcp-reattach",
            Arm::TsEventStore => "ts-eventstore",
            Arm::NginxTls => "nginx-tls",
            Arm::ReattachTls => "mcp-reattach-tls",
            Arm::ReattachPlain => "mcp-reattach-plain",
            Arm::NginxFile => "nginx-file",
            Arm::ReattachStore => "mcp-reattach-store",
        }
    }

    fn tls(self) -> bool {
        matches!(self, Arm::NginxTls | Arm::ReattachTls)
    }

    fn is_nginx(self) -> bool {
        matches!(self, Arm::Nginx | Arm::NginxTls | Arm::NginxFile)
    }

    /// Arms whose server keeps no gateway ids: the storm's client takes the ids as opaque.
    fn plain_store(self) -> bool {
        matches!(self, Arm::TsEventStore | Arm::NginxFile)
    }
}

const ALL: [Arm; 4] = [Arm::Direct, Arm::Naive, Arm::Nginx, Arm::Reattach];
const PROXIES: [Arm; 3] = [Arm::Naive, Arm::Nginx, Arm::Reattach];
/// The TLS arms, run in the json and saturating SSE scenarios.
const TLS_ARMS: [Arm; 2] = [Arm::NginxTls, Arm::ReattachTls];
/// Every arm, for summaries and for reading results back (the storm-only and TLS ones too).
const EVERY: [Arm; 10] = [
    Arm::Direct,
    Arm::Naive,
    Arm::Nginx,
    Arm::Reattach,
    Arm::TsEventStore,
    Arm::NginxTls,
    Arm::ReattachTls,
    Arm::ReattachPlain,
    Arm::NginxFile,
    Arm::ReattachStore,
];
/// The short-call scenarios users run unpinned, with the store arm beside the others.
const WITH_STORE: [Arm; 5] = [
    Arm::Direct,
    Arm::Naive,
    Arm::Nginx,
    Arm::Reattach,
    Arm::ReattachStore,
];

#[derive(Clone)]
enum Kind {
    /// The load client runs to completion.
    Run,
    /// The load client prints READY, holds; RSS is sampled; then released.
    Hold,
}

#[derive(Clone)]
struct Scenario {
    key: String,
    group: &'static str,
    title: String,
    arms: Vec<Arm>,
    load: Vec<String>,
    #[allow(dead_code)]
    kind: Kind,
    gateway_flags: Vec<String>,
    /// Run with no process pinned, each with its default threading (the gateway picks its
    /// scheduler for the CPUs it sees), as a sidecar is deployed, whatever `--pinned` says.
    unpinned: bool,
    /// Sessions for per-session memory metrics.
    sessions: u64,
    /// Retained events per session (window scenario).
    window_events: u64,
    timeout: Duration,
}

#[derive(Clone, Debug)]
struct Record {
    scenario: String,
    arm: Arm,
    round: usize,
    metrics: BTreeMap<String, f64>,
    ok: bool,
    /// Why the run failed, each `<check>: <detail>` (check: gap, control event, sequence
    /// break, id order, missing result, short stream, bad replay, timeout, error).
    failures: Vec<String>,
    note: String,
    raw: Value,
}

struct Tmp(PathBuf);

fn main() {
    let mut a = Args::parse();
    if let Some(path) = a.render.clone() {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        a.quick = v["quick"].as_bool().unwrap_or(false);
        let scenarios = scenarios(&a);
        let records: Vec<Record> = v["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| Record {
                scenario: r["scenario"].as_str().unwrap_or("").to_owned(),
                arm: EVERY
                    .into_iter()
                    .find(|a| a.name() == r["arm"].as_str().unwrap_or(""))
                    .unwrap_or(Arm::Direct),
                round: r["round"].as_u64().unwrap_or(1) as usize - 1,
                metrics: serde_json::from_value(r["metrics"].clone()).unwrap_or_default(),
                ok: r["ok"].as_bool().unwrap_or(false),
                failures: serde_json::from_value(r["failures"].clone()).unwrap_or_default(),
                note: r["note"].as_str().unwrap_or("").to_owned(),
                raw: r["load"].clone(),
            })
            .collect();
        let summary = summarize(&scenarios, &records);
        let goals = goals(&summary, &records);
        let table = ratio_table(&summary, &goals);
        println!("{table}");
        let md = markdown(
            &a,
            &scenarios,
            &summary,
            &records,
            &v["machine"],
            &table,
            v["rounds"].as_u64().unwrap_or(0) as usize,
            v["memory_rounds"].as_u64().unwrap_or(0) as usize,
            v["duration_s"].as_f64().unwrap_or(0.0),
        );
        let out = a.report_path();
        std::fs::write(&out, md).unwrap();
        println!("wrote {}", out.display());
        return;
    }
    let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 5 });
    let mem_rounds = a
        .memory_rounds
        .unwrap_or(if a.quick { 1 } else { 2 })
        .min(rounds);
    let tmp = Tmp(std::env::temp_dir().join(format!("mcp-reattach-bench-{}", std::process::id())));
    std::fs::create_dir_all(&tmp.0).unwrap();
    for b in ["mock-upstream", "naive-proxy", "load"] {
        assert!(
            a.bin.join(b).exists(),
            "missing {}",
            a.bin.join(b).display()
        );
    }
    assert!(
        a.gateway.exists(),
        "missing gateway binary {}",
        a.gateway.display()
    );
    let nginx = which("nginx");
    if nginx.is_none() {
        eprintln!("warning: nginx not found; the nginx arm is skipped");
    }
    let ts_ok = ts_eventstore_ready(&a);
    if !ts_ok {
        eprintln!(
            "warning: node or {}/node_modules not found (bench/run installs them); the ts-eventstore arm is skipped",
            a.ts_eventstore.display()
        );
    }
    let redis = redis_server(&a);
    if redis.is_none() {
        eprintln!(
            "warning: {} not found (apt-get install redis-server); the mcp-reattach-store arm is skipped",
            a.redis_server.display()
        );
    }
    let certs = match make_certs(&tmp.0) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("warning: no TLS certificates ({e}); the TLS arms are skipped");
            None
        }
    };
    let scenarios = scenarios(&a);
    // Commit and worktree state now: the binaries were just built from them.
    let machine = machine_info(&a);
    let started = Instant::now();
    let mut records: Vec<Record> = Vec::new();
    let tools = Tools {
        nginx: nginx.as_deref(),
        certs: certs.as_ref(),
        redis: redis.as_deref(),
    };
    for round in 0..rounds {
        for (si, sc) in scenarios.iter().enumerate() {
            let memory = sc.group == "memory";
            if memory && round >= mem_rounds {
                continue;
            }
            let mut arms: Vec<Arm> = sc
                .arms
                .iter()
                .copied()
                .filter(|&arm| !arm.is_nginx() || nginx.is_some())
                .filter(|&arm| !arm.tls() || certs.is_some())
                .filter(|&arm| arm != Arm::TsEventStore || ts_ok)
                .filter(|&arm| arm != Arm::ReattachStore || redis.is_some())
                .filter(|&arm| {
                    a.arms
                        .as_deref()
                        .is_none_or(|l| l.split(',').any(|n| n.trim() == arm.name()))
                })
                .collect();
            let n = arms.len().max(1);
            arms.rotate_left((round + si) % n);
            for arm in arms {
                let t = Instant::now();
                let rec = run_one(&a, &tmp, sc, arm, round, &tools);
                eprintln!(
                    "[{:>5.0}s] round {} {:<18} {:<18} {:>5.1}s {} {}",
                    started.elapsed().as_secs_f64(),
                    round + 1,
                    sc.key,
                    arm.name(),
                    t.elapsed().as_secs_f64(),
                    if rec.ok { "ok " } else { "FAIL" },
                    brief(&rec)
                );
                for f in &rec.failures {
                    eprintln!(
                        "        FAILED {} {} round {}: {f}",
                        sc.key,
                        arm.name(),
                        round + 1
                    );
                }
                records.push(rec);
            }
        }
    }
    let total = started.elapsed().as_secs_f64();
    let summary = summarize(&scenarios, &records);
    let goals = goals(&summary, &records);
    let table = ratio_table(&summary, &goals);
    println!("{table}");
    let out = json!({
        "machine": machine,
        "rounds": rounds,
        "memory_rounds": mem_rounds,
        "quick": a.quick,
        "duration_s": total,
        "summary": summary,
        "goals": goals,
        "runs": records.iter().map(|r| json!({
            "scenario": r.scenario, "arm": r.arm.name(), "round": r.round + 1,
            "ok": r.ok, "failures": r.failures, "note": r.note, "metrics": r.metrics, "load": r.raw,
        })).collect::<Vec<_>>(),
    });
    if let Some(p) = a.json_out.parent() {
        let _ = std::fs::create_dir_all(p);
    }
    std::fs::write(&a.json_out, serde_json::to_string_pretty(&out).unwrap()).unwrap();
    println!("JSON: {}", a.json_out.display());
    if !a.no_doc {
        let md = markdown(
            &a, &scenarios, &summary, &records, &machine, &table, rounds, mem_rounds, total,
        );
        let out = a.report_path();
        std::fs::write(&out, md).unwrap();
        println!("wrote {}", out.display());
    }
    let _ = std::fs::remove_dir_all(&tmp.0);
}

fn brief(r: &Record) -> String {
    let keys = [
        "events_per_s",
        "mb_per_s",
        "req_per_s",
        "cpu_us_per_event",
        "cpu_us_per_req",
        "store_us_per_event",
        "store_us_per_req",
        "store_dropped_mb",
        "p99_us",
        "to_resumed_p99_us",
        "store_bytes_per_event",
        "kb_per_session",
        "bytes_per_event",
        "time_to_last_ms",
        "cpu_us_per_resume",
        "cut_to_last_resumed_ms",
        "delivered",
        "explicit_error",
        "lost",
        "gw_rss_peak_kib",
        "gw_cpu_ms",
    ];
    let mut s: Vec<String> = keys
        .iter()
        .filter_map(|k| r.metrics.get(*k).map(|v| format!("{k}={v:.1}")))
        .collect();
    if !r.note.is_empty() {
        s.push(r.note.clone());
    }
    if !r.failures.is_empty() {
        let checks: Vec<&str> = r.failures.iter().map(|f| check_of(f)).collect();
        s.push(format!("failed: {}", checks.join(", ")));
    }
    s.join(" ")
}

fn scenarios(a: &Args) -> Vec<Scenario> {
    let q = a.quick;
    let dur = if q { "1000" } else { "2000" }.to_string();
    let paced = if q { "1000" } else { "3000" }.to_string();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let mut out = vec![
        Scenario {
            key: "json".into(),
            group: "json",
            title: "Small JSON POST, saturating (8 keep-alive connections, closed loop)".into(),
            arms: ALL
                .iter()
                .chain(&TLS_ARMS)
                .chain(&[Arm::ReattachPlain])
                .copied()
                .collect(),
            load: s(&["json", "--conns", "8", "--duration-ms", &dur]),
            kind: Kind::Run,
            gateway_flags: vec![],
            unpinned: false,
            sessions: 0,
            window_events: 0,
            timeout: Duration::from_secs(60),
        },
        Scenario {
            key: "calls".into(),
            group: "json",
            title: "Short tool calls, saturating (16 sessions back to back on keep-alive connections, each call answered by SSE: 2 progress events of 200 B and the result)".into(),
            arms: ALL.to_vec(),
            load: s(&[
                "json",
                "--conns",
                "16",
                "--tool-events",
                "2",
                "--duration-ms",
                &dur,
            ]),
            kind: Kind::Run,
            gateway_flags: vec![],
            unpinned: false,
            sessions: 0,
            window_events: 0,
            timeout: Duration::from_secs(60),
        },
        Scenario {
            key: "calls-unpinned".into(),
            group: "json",
            title: "Short tool calls as `calls`, unpinned: no process pinned, each with its default threading (the gateway's scheduler for 2 CPUs), as a sidecar is deployed".into(),
            arms: WITH_STORE.to_vec(),
            load: s(&["json", "--conns", "16", "--tool-events", "2", "--duration-ms", &dur]),
            kind: Kind::Run,
            gateway_flags: vec![],
            unpinned: true,
            sessions: 0,
            window_events: 0,
            timeout: Duration::from_secs(60),
        },
        Scenario {
            key: "calls-streamed".into(),
            group: "json",
            title: "Short tool calls streamed as SDK servers stream them, unpinned (16 sessions back to back; the upstream writes the head, each of 2 progress events of 200 B and the result as its own write, 100 µs apart, so no answer comes whole with its head; no process pinned, default threading)".into(),
            arms: WITH_STORE.to_vec(),
            load: s(&["json", "--conns", "16", "--tool-events", "2", "--tool-gap-us", "100", "--duration-ms", &dur]),
            kind: Kind::Run,
            gateway_flags: vec![],
            unpinned: true,
            sessions: 0,
            window_events: 0,
            timeout: Duration::from_secs(60),
        },
        Scenario {
            key: "calls-streamed-pinned".into(),
            group: "json",
            title: "Short tool calls streamed as `calls-streamed`, pinned (each process on its core, as the other scenarios)".into(),
            arms: ALL.to_vec(),
            load: s(&["json", "--conns", "16", "--tool-events", "2", "--tool-gap-us", "100", "--duration-ms", &dur]),
            kind: Kind::Run,
            gateway_flags: vec![],
            unpinned: false,
            sessions: 0,
            window_events: 0,
            timeout: Duration::from_secs(60),
        },
        Scenario {
            key: "json-paced".into(),
            group: "json",
            title: "Small JSON POST at a fixed 2000 req/s (4 connections, open loop)".into(),
            arms: ALL.to_vec(),
            load: s(&[
                "json",
                "--conns",
                "4",
                "--rate",
                "2000",
                "--duration-ms",
                &paced,
            ]),
            kind: Kind::Run,
            gateway_flags: vec![],
            unpinned: false,
            sessions: 0,
            window_events: 0,
            timeout: Duration::from_secs(60),
        },
    ];
    let sse_dur = a.sse_ms.map_or(dur.clone(), |ms| ms.to_string());
    // Saturating SSE: the mock writes bursts of events (one `write` each), so it outruns
    // every proxy (the `direct / fastest proxy` goal checks it); the `-single` variants
    // write one event per `write` (the mock is then about as fast as the hops).
    for single in [false, true] {
        for (size, label) in [(200, "200 B"), (16384, "16 KiB")] {
            for streams in [1, 8] {
                let burst = if single { 1 } else { sse_burst(size) };
                out.push(Scenario {
                    key: format!(
                        "sse-{}-{}{}",
                        if size == 200 { "200" } else { "16k" },
                        streams,
                        if single { "-single" } else { "" }
                    ),
                    group: "sse",
                    title: if single {
                        format!("SSE saturating, {label} events, {streams} stream(s), one write per event")
                    } else {
                        format!("SSE saturating, {label} events, {streams} stream(s), {burst} events per upstream write")
                    },
                    arms: ALL.iter().chain(&TLS_ARMS).copied().collect(),
                    load: s(&[
                        "sse",
                        "--streams",
                        &streams.to_string(),
                        "--size",
                        &size.to_string(),
                        "--duration-ms",
                        &sse_dur,
                        "--warmup-ms",
                        "0",
                        "--burst",
                        &burst.to_string(),
                    ]),
                    kind: Kind::Run,
                    gateway_flags: vec![],
                    unpinned: false,
                    sessions: 0,
                    window_events: 0,
                    timeout: Duration::from_secs(120),
                });
            }
        }
    }
    // The 200 B burst scenarios unpinned, as a fleet's replica is deployed: the gateway
    // without and with the store (whose redis-server then shares the two cores too).
    for streams in [1, 8] {
        let burst = sse_burst(200);
        out.push(Scenario {
            key: format!("sse-200-{streams}-unpinned"),
            group: "sse",
            title: format!("SSE saturating, 200 B events, {streams} stream(s), {burst} events per upstream write, unpinned (no process pinned, default threading; the store arm's redis-server too)"),
            arms: vec![Arm::Direct, Arm::Nginx, Arm::Reattach, Arm::ReattachStore],
            load: s(&[
                "sse",
                "--streams",
                &streams.to_string(),
                "--size",
                "200",
                "--duration-ms",
                &sse_dur,
                "--warmup-ms",
                "0",
                "--burst",
                &burst.to_string(),
            ]),
            kind: Kind::Run,
            gateway_flags: vec![],
            unpinned: true,
            sessions: 0,
            window_events: 0,
            timeout: Duration::from_secs(120),
        });
    }
    out.push(Scenario {
        key: "paced-1".into(),
        group: "paced",
        title: "SSE paced: 1 stream at 1000 events/s, 200 B".into(),
        arms: ALL.to_vec(),
        load: s(&[
            "sse",
            "--streams",
            "1",
            "--rate",
            "1000",
            "--duration-ms",
            &paced,
        ]),
        kind: Kind::Run,
        gateway_flags: vec![],
        unpinned: false,
        sessions: 0,
        window_events: 0,
        timeout: Duration::from_secs(60),
    });
    out.push(Scenario {
        key: "paced-50".into(),
        group: "paced",
        title: "SSE paced: 50 streams at 100 events/s each (5000/s total), random phases, 200 B"
            .into(),
        arms: ALL.to_vec(),
        load: s(&[
            "sse",
            "--streams",
            "50",
            "--rate",
            "100",
            "--random-phase",
            "--duration-ms",
            &paced,
        ]),
        kind: Kind::Run,
        gateway_flags: vec![],
        unpinned: false,
        sessions: 0,
        window_events: 0,
        timeout: Duration::from_secs(60),
    });
    for n in if q { vec![200, 1000] } else { vec![1000, 5000] } {
        out.push(Scenario {
            key: format!("idle-{n}"),
            group: "memory",
            title: format!("Memory: {n} idle sessions, each holding a GET stream"),
            arms: PROXIES.to_vec(),
            load: s(&["idle", "--sessions", &n.to_string(), "--concurrency", "64"]),
            kind: Kind::Hold,
            gateway_flags: vec![],
            unpinned: false,
            sessions: n,
            window_events: 0,
            timeout: Duration::from_secs(120),
        });
    }
    let wn = if q { 200 } else { 1000 };
    // Two window sizes give the marginal cost of one retained event (the slope) apart from
    // the per-session overhead; 600 events per session make the ring wrap (steady state).
    for we in [256u64, 128] {
        out.push(Scenario {
            key: format!("window-{we}"),
            group: "memory",
            title: format!("Memory: {wn} sessions, each with a full {we}-event window of 200 B events (600 sent)"),
            // The store arm at 256: what the store holds per retained event (`INFO memory`).
            arms: if we == 256 { vec![Arm::Reattach, Arm::ReattachStore] } else { vec![Arm::Reattach] },
            load: s(&["window", "--sessions", &wn.to_string(), "--events", "600", "--size", "200", "--concurrency", "8"]),
            kind: Kind::Hold,
            gateway_flags: s(&["--window-events", &we.to_string()]),
            unpinned: false,
            sessions: wn,
            window_events: we,
            timeout: Duration::from_secs(240),
        });
    }
    let sn = if q { 200 } else { 1000 };
    out.push(Scenario {
        key: "storm".into(),
        group: "storm",
        title: format!("Reconnect storm: {sn} sessions resume 100 events back at once"),
        // ts-eventstore: the same storm served by the TypeScript SDK's own event store.
        // nginx-file: nginx sending the same events from files, the floor of a resume.
        arms: vec![Arm::Reattach, Arm::TsEventStore, Arm::NginxFile],
        // --wait-stdin: the client stops between setup and storm, so the serving process's
        // CPU is sampled for the storm alone.
        load: s(&[
            "storm",
            "--sessions",
            &sn.to_string(),
            "--events",
            "200",
            "--back",
            "100",
            "--wait-stdin",
        ]),
        kind: Kind::Run,
        gateway_flags: vec![],
        unpinned: false,
        sessions: sn,
        window_events: 0,
        // The TS server's setup (200 notifications per session through the SDK) is slow.
        timeout: Duration::from_secs(300),
    });
    let rn = if q { 100 } else { 500 };
    out.push(Scenario {
        key: "resume-other".into(),
        group: "resume",
        title: format!("Resume on a replica that does not own the stream: two gateways on one store, {rn} sessions, each a call through A (20 events of 200 B, 500 µs apart) cut after its first event and resumed on B 2 ms later, 4 at a time, unpinned"),
        // Two gateways (A and B) on one redis-server; `--other` is added with B's address.
        arms: vec![Arm::ReattachStore],
        load: s(&[
            "resume",
            "--sessions",
            &rn.to_string(),
            "--events",
            "20",
            "--gap-us",
            "500",
            "--wait-ms",
            "2",
            "--concurrency",
            "4",
            "--max-ms",
            if q { "10000" } else { "30000" },
        ]),
        kind: Kind::Run,
        gateway_flags: vec![],
        unpinned: true,
        sessions: rn,
        window_events: 0,
        timeout: Duration::from_secs(120),
    });
    let cn = if q { 300 } else { 1000 };
    out.push(Scenario {
        key: "call-storm".into(),
        group: "call-storm",
        title: format!("The worst minute (issue 50): {cn} sessions each with a tool call in flight (40 events of 200 B, 150 ms apart), every client connection reset at once, every session resuming at once until its result or explicit error; mcp-reattach-store: three replicas on one store, the first killed (SIGKILL) at the cut, each session resumed on another replica than its call's; nginx: `proxy_buffering off`, no resumption; unpinned"),
        arms: vec![Arm::Reattach, Arm::ReattachStore, Arm::Nginx],
        // `--targets`, `--kill-pid`, `--watch-pids`, `--max-ms` and `--no-resumption` are
        // added per arm (run_one).
        load: s(&[
            "call-storm",
            "--sessions",
            &cn.to_string(),
            "--events",
            "40",
            "--gap-us",
            "150000",
        ]),
        kind: Kind::Run,
        gateway_flags: vec![],
        unpinned: true,
        sessions: cn,
        window_events: 0,
        timeout: Duration::from_secs(120),
    });
    if let Some(only) = &a.only {
        let keys: Vec<&str> = only.split(',').collect();
        out.retain(|s| {
            keys.iter().any(|k| {
                s.key == *k
                    || (*k == "sse" && s.group == "sse")
                    || (*k == "saturating" && SATURATING.contains(&s.key.as_str()))
                    || (*k == "sse-single" && s.group == "sse" && s.key.ends_with("-single"))
                    || (*k == "idle" && s.key.starts_with("idle"))
                    || (*k == "window" && s.key.starts_with("window"))
                    || (*k == "store" && s.arms.contains(&Arm::ReattachStore))
            })
        });
    }
    out
}

/// The saturating SSE scenarios whose mock writes bursts (the goals' scenarios).
const SATURATING: [&str; 4] = ["sse-200-1", "sse-200-8", "sse-16k-1", "sse-16k-8"];

/// Events per upstream `write` in the saturating scenarios: 64 KiB of event data per write.
fn sse_burst(size: usize) -> u64 {
    65536usize.div_ceil(size.max(1)) as u64
}

/// `node` is on PATH and the ts-eventstore package has its modules installed.
fn ts_eventstore_ready(a: &Args) -> bool {
    which("node").is_some()
        && a.ts_eventstore.join("server.mjs").exists()
        && a.ts_eventstore
            .join("node_modules/@modelcontextprotocol/sdk/package.json")
            .exists()
}

/// Starts the ts-eventstore server (the storm's serving process, placed as a proxy under
/// test is) and returns it with its address.
fn start_ts_eventstore(a: &Args, pin: bool) -> Result<(Proc, SocketAddr), String> {
    let node = which("node").ok_or("node not found")?;
    let mut c = pinned_rt(a, pin, !a.no_rt, 1, &node);
    c.arg(a.ts_eventstore.join("server.mjs"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = c.spawn().map_err(|e| format!("start ts-eventstore: {e}"))?;
    let mut line = String::new();
    let _ = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
    let p = Proc {
        child,
        graceful: true,
    };
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("LISTEN ")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| format!("ts-eventstore printed {line:?}, not LISTEN <addr>"))?;
    Ok((p, addr))
}

fn which(name: &str) -> Option<PathBuf> {
    for dir in std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
    {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return Some(p);
        }
    }
    None
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_port(addr: SocketAddr, max: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < max {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

fn pinned_if(a: &Args, pin: bool, core: u32, prog: &Path) -> Command {
    pinned_rt(a, pin, false, core, prog)
}

/// `[nice -n N | chrt -f 1] [taskset -c CORE] PROG`
fn pinned_rt(a: &Args, pin: bool, rt: bool, core: u32, prog: &Path) -> Command {
    let mut argv: Vec<String> = Vec::new();
    if rt {
        argv.extend(["chrt".into(), "-f".into(), "1".into()]);
    } else if a.nice != 0 {
        argv.extend(["nice".into(), "-n".into(), a.nice.to_string()]);
    }
    if pin {
        argv.extend(["taskset".into(), "-c".into(), core.to_string()]);
    }
    argv.push(prog.display().to_string());
    let mut c = Command::new(&argv[0]);
    c.args(&argv[1..]);
    c
}

struct Proc {
    child: Child,
    /// SIGTERM first (nginx stops its workers; the mock exits); otherwise SIGKILL at once
    /// (the gateway drains for seconds on SIGTERM, and its numbers are already taken).
    graceful: bool,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if !self.graceful {
            let _ = self.child.kill();
            let _ = self.child.wait();
            return;
        }
        // SAFETY: kill on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_mock(a: &Args, pin: bool, extra: &[String]) -> (Proc, SocketAddr) {
    let mock_args = Args {
        nice: a.mock_nice,
        ..a.clone()
    };
    let mut c = pinned_if(&mock_args, pin, 0, &a.bin.join("mock-upstream"));
    c.arg("--listen")
        .arg("127.0.0.1:0")
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = c.spawn().expect("start mock-upstream");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("LISTEN ")
        .unwrap()
        .parse()
        .unwrap();
    (
        Proc {
            child,
            graceful: true,
        },
        addr,
    )
}

fn nginx_conf(dir: &Path, listen: u16, upstream: SocketAddr, tls: Option<&Certs>) -> PathBuf {
    let conf = dir.join("nginx.conf");
    for d in ["logs", "tmp"] {
        let _ = std::fs::create_dir_all(dir.join(d));
    }
    let text = format!(
        r#"# What a user would put in front of an MCP server for SSE (proxy_buffering off); access log
# on (nginx's default, like the gateway's one line per request).
user root;
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/logs/error.log warn;
worker_rlimit_nofile 20000;
events {{ worker_connections 16384; }}
http {{
    access_log {dir}/logs/access.log;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    keepalive_requests 1000000;
    upstream mcp {{ server {upstream}; keepalive 64; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{listen}{ssl} backlog=4096;{certs}
        location / {{
            proxy_pass http://mcp;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;
        }}
    }}
}}
"#,
        dir = dir.display(),
        ssl = if tls.is_some() { " ssl" } else { "" },
        certs = tls.map_or(String::new(), |c| format!(
            "\n        ssl_certificate {};\n        ssl_certificate_key {};\n        ssl_protocols TLSv1.2 TLSv1.3;",
            c.cert.display(),
            c.key.display()
        )),
    );
    std::fs::write(&conf, text).unwrap();
    conf
}

/// The storm's events as files for the nginx-file arm, and its configuration: `initialize`
/// answered with a session id, a GET without `Last-Event-ID` sent the 200 events of the
/// setup, one with it the 100 after the storm's cursor, each under an id as long as the
/// gateway's and in the mock's payload (200 B `data`, the sequence the client checks).
fn nginx_file_conf(dir: &Path, listen: u16) -> PathBuf {
    for d in ["logs", "tmp", "www"] {
        let _ = std::fs::create_dir_all(dir.join(d));
    }
    let events = |from: u64| {
        let mut out = Vec::new();
        for seq in from..200 {
            out.extend_from_slice(
                format!("id: 0123456789abcdef.1.{seq}\nevent: message\ndata: ").as_bytes(),
            );
            mcp_reattach_bench::payload::event(seq, 13_000_000_000_000 + seq, 200, &mut out);
            out.extend_from_slice(b"\n\n");
        }
        out
    };
    std::fs::write(dir.join("www/setup.sse"), events(0)).unwrap();
    std::fs::write(dir.join("www/resume.sse"), events(100)).unwrap();
    let conf = dir.join("nginx.conf");
    let text = format!(
        r#"# The storm's floor: nginx sending the same events from files (access log on, as the
# gateway's one line per request).
user root;
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/logs/error.log warn;
worker_rlimit_nofile 20000;
events {{ worker_connections 16384; }}
http {{
    access_log {dir}/logs/access.log;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    keepalive_requests 1000000;
    map $http_last_event_id $events {{ "" /setup.sse; default /resume.sse; }}
    server {{
        listen 127.0.0.1:{listen} backlog=4096;
        root {dir}/www;
        location = /mcp {{
            if ($request_method = POST) {{
                add_header Mcp-Session-Id nginx-file always;
                return 200 '{{"jsonrpc":"2.0","id":1,"result":{{"protocolVersion":"2025-03-26","capabilities":{{}},"serverInfo":{{"name":"nginx-file","version":"0"}}}}}}';
            }}
            default_type text/event-stream;
            rewrite ^ $events break;
        }}
    }}
}}
"#,
        dir = dir.display(),
    );
    std::fs::write(&conf, text).unwrap();
    conf
}

/// The `redis-server` binary the store arm runs: `--redis-server` as a path, or found on PATH.
fn redis_server(a: &Args) -> Option<PathBuf> {
    let p = &a.redis_server;
    if p.components().count() > 1 {
        p.exists().then(|| p.clone())
    } else {
        which(p.to_str()?)
    }
}

/// The mcp-reattach-store arm's `redis-server`: one per arm-run on a free loopback port,
/// persisting nothing and evicting nothing (`noeviction`, as docs/design.md asks of the
/// store), killed after the run.
struct StoreProc {
    proc: Proc,
    url: String,
    /// The fleet's shared secret (`--store-key-file`): 32 random bytes, one file per job.
    key: PathBuf,
    /// `used_memory` of the empty server, before a gateway wrote to it.
    base_used: u64,
}

/// Starts the store arm's `redis-server`, placed as the proxy under test is (its core when
/// pinned, SCHED_FIFO unless `--no-rt`): the store is part of the tier measured.
fn start_store(a: &Args, tmp: &Tmp, redis: &Path, pin: bool) -> Result<StoreProc, String> {
    use std::io::Read;
    let key = tmp.0.join("store.key");
    if !key.exists() {
        let mut secret = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut secret))
            .and_then(|()| std::fs::write(&key, secret))
            .map_err(|e| format!("the store's key file: {e}"))?;
    }
    let port = free_port();
    let dir = tmp.0.join(format!("redis-{port}"));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut c = pinned_rt(a, pin, !a.no_rt, 1, redis);
    c.arg("--port")
        .arg(port.to_string())
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--maxmemory-policy", "noeviction", "--dir"])
        .arg(&dir)
        .arg("--logfile")
        .arg(dir.join("redis.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let child = c
        .spawn()
        .map_err(|e| format!("start {}: {e}", redis.display()))?;
    let proc = Proc {
        child,
        graceful: false,
    };
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    if !wait_port(addr, Duration::from_secs(10)) {
        return Err(format!("redis-server did not listen on {addr}"));
    }
    let url = format!("redis://{addr}");
    let base_used =
        store_stats::used_memory(&url).map_err(|e| format!("redis-server on {addr}: {e}"))?;
    Ok(StoreProc {
        proc,
        url,
        key,
        base_used,
    })
}

/// The gateway's own counts of its store (`/metrics` on its admin listener): bytes its
/// writer dropped (queue full), requests that failed, resumes served from the store and those
/// that ended in the explicit gap.
fn gateway_store_metrics(admin: SocketAddr) -> Vec<(String, f64)> {
    use std::io::{Read, Write};
    let text = (|| -> std::io::Result<String> {
        let mut s = TcpStream::connect_timeout(&admin, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(
            format!("GET /metrics HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })()
    .unwrap_or_default();
    let value = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.split([' ', '{']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    vec![
        (
            "store_dropped_mb".into(),
            value("mcp_reattach_store_dropped_bytes_total") / 1e6,
        ),
        (
            "store_errors".into(),
            value("mcp_reattach_store_errors_total"),
        ),
        (
            "store_follows".into(),
            value("mcp_reattach_store_follows_total"),
        ),
        (
            "store_follow_gaps".into(),
            value("mcp_reattach_store_follow_gaps_total"),
        ),
    ]
}

/// What the store holds after a run (the mcp-reattach-store arm), read with redis-rs's
/// blocking client: `INFO memory`'s `used_memory`, and every stream key's entries and events
/// (an entry packs one upstream read's events of one stream, src/store/wire.rs).
mod store_stats {
    use std::time::Duration;

    pub struct Stats {
        pub used: u64,
        pub keys: u64,
        pub streams: u64,
        pub entries: u64,
        pub events: u64,
        /// The events of the stream that holds the most.
        pub max_stream_events: u64,
        /// `MEMORY USAGE` of the stream keys, summed.
        pub stream_bytes: u64,
        /// `INFO commandstats` before the inspection's own commands: per command, its calls
        /// and the µs the server spent in them.
        pub commands: Vec<(String, u64, f64)>,
    }

    fn connect(url: &str) -> Result<redis::Connection, String> {
        let con = redis::Client::open(url)
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        con.set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(|e| e.to_string())?;
        Ok(con)
    }

    fn used(con: &mut redis::Connection) -> Result<u64, String> {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query(con)
            .map_err(|e| e.to_string())?;
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| "INFO memory without used_memory".to_owned())
    }

    pub fn used_memory(url: &str) -> Result<u64, String> {
        used(&mut connect(url)?)
    }

    /// The events packed in an entry's `e` field, each `<seq u64> <flag u8> <len u32> <body>`.
    fn packed_events(mut b: &[u8]) -> u64 {
        let mut n = 0;
        while b.len() >= 13 {
            let len = u32::from_le_bytes([b[9], b[10], b[11], b[12]]) as usize;
            b = b.get(13 + len..).unwrap_or(&[]);
            n += 1;
        }
        n
    }

    /// `cmdstat_<name>:calls=N,usec=U,…` lines.
    fn commandstats(info: &str) -> Vec<(String, u64, f64)> {
        info.lines()
            .filter_map(|l| {
                let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
                let field = |k: &str| {
                    rest.split(',')
                        .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
                        .and_then(|v| v.parse::<f64>().ok())
                };
                Some((name.to_owned(), field("calls")? as u64, field("usec")?))
            })
            .collect()
    }

    pub fn inspect(url: &str) -> Result<Stats, String> {
        let mut con = connect(url)?;
        let e = |e: redis::RedisError| e.to_string();
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut con)
            .map_err(e)?;
        let commands = commandstats(&info);
        let used = used(&mut con)?;
        let keys: u64 = redis::cmd("DBSIZE").query(&mut con).map_err(e)?;
        let mut st = Stats {
            used,
            keys,
            streams: 0,
            entries: 0,
            events: 0,
            max_stream_events: 0,
            stream_bytes: 0,
            commands,
        };
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg("mra:*:ev:*")
                .arg("COUNT")
                .arg(1000)
                .query(&mut con)
                .map_err(e)?;
            if !batch.is_empty() {
                let mut pipe = redis::pipe();
                for k in &batch {
                    pipe.cmd("MEMORY").arg("USAGE").arg(k).arg("SAMPLES").arg(0);
                    pipe.cmd("XRANGE").arg(k).arg("-").arg("+");
                }
                let replies: Vec<redis::Value> = pipe.query(&mut con).map_err(e)?;
                for pair in replies.chunks(2) {
                    if let redis::Value::Int(b) = pair[0] {
                        st.stream_bytes += b.max(0) as u64;
                    }
                    let Some(redis::Value::Array(entries)) = pair.get(1) else {
                        continue;
                    };
                    st.streams += 1;
                    let before = st.events;
                    for entry in entries {
                        // [id, [field, value, …]]
                        let redis::Value::Array(parts) = entry else {
                            continue;
                        };
                        let Some(redis::Value::Array(fields)) = parts.get(1) else {
                            continue;
                        };
                        st.entries += 1;
                        for fv in fields.chunks(2) {
                            if let [redis::Value::BulkString(f), redis::Value::BulkString(v)] = fv {
                                if f == b"e" {
                                    st.events += packed_events(v);
                                }
                            }
                        }
                    }
                    st.max_stream_events = st.max_stream_events.max(st.events - before);
                }
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        Ok(st)
    }

    impl Stats {
        /// `{command: {calls, usec}}`, for the run's raw record.
        pub fn commandstats_json(&self) -> serde_json::Value {
            self.commands
                .iter()
                .map(|(name, calls, usec)| {
                    (
                        name.clone(),
                        serde_json::json!({"calls": calls, "usec": usec}),
                    )
                })
                .collect::<serde_json::Map<_, _>>()
                .into()
        }

        /// The run's metrics, `used_memory` taken relative to the empty server's (`base`).
        pub fn metrics(&self, base: u64) -> Vec<(String, f64)> {
            let delta = self.used.saturating_sub(base) as f64;
            let mut m = vec![
                ("store_used_mib".to_owned(), delta / 1048576.0),
                ("store_keys".to_owned(), self.keys as f64),
                ("store_streams".to_owned(), self.streams as f64),
                ("store_entries".to_owned(), self.entries as f64),
                ("store_events".to_owned(), self.events as f64),
                (
                    "store_events_max_stream".to_owned(),
                    self.max_stream_events as f64,
                ),
            ];
            if self.events > 0 {
                let n = self.events as f64;
                m.push(("store_bytes_per_event".to_owned(), delta / n));
                m.push((
                    "store_stream_bytes_per_event".to_owned(),
                    self.stream_bytes as f64 / n,
                ));
            }
            m.push((
                "store_commands".to_owned(),
                self.commands.iter().map(|c| c.1 as f64).sum(),
            ));
            m.push((
                "store_command_us".to_owned(),
                self.commands.iter().map(|c| c.2).sum(),
            ));
            if self.streams > 0 {
                m.push((
                    "store_events_per_stream".to_owned(),
                    self.events as f64 / self.streams as f64,
                ));
            }
            m
        }
    }
}

/// A CA and a server certificate for 127.0.0.1 (ECDSA P-256), made with openssl.
struct Certs {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn make_certs(dir: &Path) -> Result<Certs, String> {
    let d = dir.join("tls");
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    let p = |n: &str| d.join(n).to_string_lossy().into_owned();
    std::fs::write(
        d.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .map_err(|e| e.to_string())?;
    let steps: [Vec<String>; 3] = [
        [
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &p("ca.key"),
            "-out",
            &p("ca.pem"),
            "-days",
            "2",
            "-subj",
            "/CN=bench CA",
        ]
        .map(str::to_owned)
        .to_vec(),
        [
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &p("key.pem"),
            "-out",
            &p("leaf.csr"),
            "-subj",
            "/CN=localhost",
        ]
        .map(str::to_owned)
        .to_vec(),
        [
            "x509",
            "-req",
            "-in",
            &p("leaf.csr"),
            "-CA",
            &p("ca.pem"),
            "-CAkey",
            &p("ca.key"),
            "-CAcreateserial",
            "-out",
            &p("cert.pem"),
            "-days",
            "2",
            "-extfile",
            &p("ext.cnf"),
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    for args in steps {
        let out = Command::new("openssl")
            .args(&args)
            .output()
            .map_err(|e| format!("openssl: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "openssl {}: {}",
                args[0],
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    Ok(Certs {
        ca: d.join("ca.pem"),
        cert: d.join("cert.pem"),
        key: d.join("key.pem"),
    })
}

/// A started proxy: the process (None for direct), the address the client targets and, for
/// the gateway, its admin listener (`/metrics`).
type Started = (Option<Proc>, SocketAddr, Option<SocketAddr>);

/// Starts the arm's proxy (None for direct); returns it and the address the client targets.
// One parameter per thing an arm may need; a struct for them would only move the list.
#[allow(clippy::too_many_arguments)]
fn start_proxy(
    a: &Args,
    tmp: &Tmp,
    arm: Arm,
    upstream: SocketAddr,
    extra: &[String],
    nginx: Option<&Path>,
    pin: bool,
    certs: Option<&Certs>,
) -> Result<Started, String> {
    if arm == Arm::Direct {
        return Ok((None, upstream, None));
    }
    let port = free_port();
    let listen: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut admin = None;
    let mut c = match arm {
        Arm::Naive => {
            let mut c = pinned_rt(a, pin, !a.no_rt, 1, &a.bin.join("naive-proxy"));
            c.arg(listen.to_string()).arg(upstream.to_string());
            c
        }
        Arm::Nginx | Arm::NginxTls => {
            let dir = tmp.0.join(format!("nginx-{port}"));
            let _ = std::fs::create_dir_all(&dir);
            let tls = if arm.tls() {
                Some(certs.ok_or("no certificates for the TLS arm")?)
            } else {
                None
            };
            let conf = nginx_conf(&dir, port, upstream, tls);
            let mut c = pinned_rt(a, pin, !a.no_rt, 1, nginx.unwrap());
            c.arg("-p").arg(&dir).arg("-c").arg(conf);
            c
        }
        Arm::NginxFile => {
            let dir = tmp.0.join(format!("nginx-file-{port}"));
            let _ = std::fs::create_dir_all(&dir);
            let conf = nginx_file_conf(&dir, port);
            let mut c = pinned_rt(a, pin, !a.no_rt, 1, nginx.unwrap());
            c.arg("-p").arg(&dir).arg("-c").arg(conf);
            c
        }
        Arm::Reattach | Arm::ReattachTls | Arm::ReattachPlain | Arm::ReattachStore => {
            let mut c = pinned_rt(a, pin, !a.no_rt, 1, &a.gateway);
            let admin_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            admin = Some(admin_addr);
            c.arg("--upstream")
                .arg(format!("http://{upstream}"))
                .arg("--listen")
                .arg(listen.to_string())
                .arg("--admin-listen")
                .arg(admin_addr.to_string())
                .args(extra);
            if arm == Arm::ReattachPlain {
                c.arg("--json-upgrade").arg("false");
            }
            if arm.tls() {
                let certs = certs.ok_or("no certificates for the TLS arm")?;
                c.arg("--tls-cert")
                    .arg(&certs.cert)
                    .arg("--tls-key")
                    .arg(&certs.key);
            }
            c
        }
        Arm::Direct | Arm::TsEventStore => unreachable!(),
    };
    // The gateway's access log (one line per request or stream, on stdout) goes to a file,
    // as a container runtime would capture it.
    let log = std::fs::File::create(tmp.0.join(format!("{}-{port}.log", arm.name()))).unwrap();
    c.stdout(log.try_clone().unwrap()).stderr(log);
    let child = c
        .spawn()
        .map_err(|e| format!("start {}: {e}", arm.name()))?;
    let p = Proc {
        child,
        graceful: arm.is_nginx(),
    };
    if !wait_port(listen, Duration::from_secs(10)) {
        return Err(format!("{} did not listen on {listen}", arm.name()));
    }
    Ok((Some(p), listen, admin))
}

/// What the arms need beyond the harness's own binaries, found once per job.
struct Tools<'a> {
    nginx: Option<&'a Path>,
    certs: Option<&'a Certs>,
    redis: Option<&'a Path>,
}

fn run_one(a: &Args, tmp: &Tmp, sc: &Scenario, arm: Arm, round: usize, tools: &Tools) -> Record {
    let (nginx, certs) = (tools.nginx, tools.certs);
    let mut rec = Record {
        scenario: sc.key.clone(),
        arm,
        round,
        metrics: BTreeMap::new(),
        ok: false,
        failures: Vec::new(),
        note: String::new(),
        raw: Value::Null,
    };
    let pin = sc.key.ends_with("-pinned")
        || (a.pinned && !sc.unpinned && (sc.group != "paced" || a.pin_paced));
    let mock_flags = if sc.group == "sse" && a.mock_sndbuf_kib > 0 {
        vec!["--sndbuf-kib".to_owned(), a.mock_sndbuf_kib.to_string()]
    } else {
        vec![]
    };
    // The store arm: a fresh redis-server for this run, started first (killed after).
    let store = if arm == Arm::ReattachStore {
        match tools
            .redis
            .ok_or_else(|| "no redis-server".to_owned())
            .and_then(|r| start_store(a, tmp, r, pin))
        {
            Ok(st) => Some(st),
            Err(e) => {
                rec.failures.push(format!("error: {e}"));
                return rec;
            }
        }
    } else {
        None
    };
    let mut gateway_flags = sc.gateway_flags.clone();
    if let Some(st) = &store {
        gateway_flags.extend([
            "--store".to_owned(),
            st.url.clone(),
            "--store-key-file".to_owned(),
            st.key.display().to_string(),
        ]);
    }
    // The resume scenario's second replica (B): the same gateway on the same store, where the
    // calls made through the first (A) are resumed.
    let mut other: Option<(Proc, SocketAddr, Option<SocketAddr>)> = None;
    // The call storm's fleet: the replicas beside the first (which is killed at the cut).
    let mut fleet: Vec<(Proc, SocketAddr)> = Vec::new();
    let mut admin = None;
    // The ts-eventstore arm has no upstream: its server is the serving process.
    let (mock, proxy, target) = if arm == Arm::TsEventStore {
        match start_ts_eventstore(a, pin) {
            Ok((p, addr)) => (None, Some(p), addr),
            Err(e) => {
                rec.failures.push(format!("error: {e}"));
                return rec;
            }
        }
    } else {
        let (mock, upstream) = start_mock(a, pin, &mock_flags);
        let started = start_proxy(a, tmp, arm, upstream, &gateway_flags, nginx, pin, certs);
        let started = started.and_then(|(p, t, adm)| {
            admin = adm;
            if sc.group == "resume" {
                let (b, bt, badm) =
                    start_proxy(a, tmp, arm, upstream, &gateway_flags, nginx, pin, certs)?;
                other = b.map(|b| (b, bt, badm));
            }
            if sc.group == "call-storm" && arm == Arm::ReattachStore {
                // The fleet: two more replicas on the same store, in front of the same mock.
                for _ in 0..2 {
                    let (p, t, _) =
                        start_proxy(a, tmp, arm, upstream, &gateway_flags, nginx, pin, certs)?;
                    fleet.extend(p.map(|p| (p, t)));
                }
            }
            Ok((p, t))
        });
        match started {
            Ok((p, t)) => (Some(mock), p, t),
            Err(e) => {
                rec.failures.push(format!("error: {e}"));
                return rec;
            }
        }
    };
    // Let the proxy settle before the base sample.
    std::thread::sleep(Duration::from_millis(200));
    let pids = proxy
        .as_ref()
        .map(|p| procfs::tree(p.pid()))
        .unwrap_or_default();
    let other_pids = other
        .as_ref()
        .map(|(p, ..)| procfs::tree(p.pid()))
        .unwrap_or_default();
    let store_pids = store
        .as_ref()
        .map(|st| procfs::tree(st.proc.pid()))
        .unwrap_or_default();
    let rss0 = procfs::rss_kib(&pids);
    let split0 = procfs::cpu_split(&pids);
    let store0 = procfs::cpu_split(&store_pids);
    // On-CPU ns of A, B and the store (schedstat): the resume scenario is too short for
    // clock ticks (10 ms).
    let ns0 = [&pids, &other_pids, &store_pids].map(|p| procfs::cpu_ns(p));
    let mut load = pinned_if(a, pin, 0, &a.bin.join("load"));
    load.arg("--target").arg(target.to_string());
    if arm.tls() {
        if let Some(c) = certs {
            load.arg("--tls-ca").arg(&c.ca);
        }
    }
    load.args(&sc.load);
    if let Some((_, b, _)) = &other {
        load.arg("--other").arg(b.to_string());
    }
    if sc.group == "call-storm" {
        // Every gateway is watched (RSS, CPU over the storm); the fleet's first is killed at
        // the cut; nginx resumes nothing, so its clients wait as long as a call still runs.
        let mut targets = vec![target.to_string()];
        let mut watch: Vec<String> = pids.iter().map(u32::to_string).collect();
        for (p, t) in &fleet {
            targets.push(t.to_string());
            watch.push(p.pid().to_string());
        }
        load.arg("--targets").arg(targets.join(","));
        load.arg("--watch-pids").arg(watch.join(","));
        if arm == Arm::ReattachStore {
            if let Some(p) = &proxy {
                load.arg("--kill-pid").arg(p.pid().to_string());
                load.arg("--kill-target").arg("0");
            }
        }
        if arm.is_nginx() {
            load.args(["--no-resumption", "--max-ms", "10000"]);
        }
    }
    if arm.plain_store() {
        load.arg("--plain-store");
    }
    load.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::piped());
    let t0 = Instant::now();
    let mut child = match load.spawn() {
        Ok(c) => c,
        Err(e) => {
            rec.failures.push(format!("error: load: {e}"));
            return rec;
        }
    };
    let mut stdin: Option<ChildStdin> = child.stdin.take();
    let stdout = child.stdout.take().unwrap();
    // The load client's stderr (its failure reasons, any panic) goes to ours, indented.
    let stderr = child.stderr.take().unwrap();
    let err_fwd = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("        {line}");
        }
    });
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut rss_held = None;
    let mut cpu_held = None;
    let mut store_held = None;
    // The serving process's CPU (ns) when the storm's setup was done.
    let mut cpu_setup_done: Option<u64> = None;
    let mut ready_json = Value::Null;
    let mut last_line = None;
    let deadline = t0 + sc.timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left.max(Duration::from_millis(1))) {
            Ok(line) => {
                if let Some(j) = line.strip_prefix("READY ") {
                    ready_json = serde_json::from_str(j).unwrap_or(Value::Null);
                    // Let the last closes and wake-ups settle before sampling.
                    std::thread::sleep(Duration::from_millis(500));
                    rss_held = proxy
                        .as_ref()
                        .map(|p| procfs::rss_kib(&procfs::tree(p.pid())));
                    cpu_held = Some(procfs::cpu_split(&pids));
                    store_held = Some(procfs::cpu_split(&store_pids));
                    drop(stdin.take());
                } else if line == "SETUP-DONE" {
                    cpu_setup_done = Some(procfs::cpu_ns(&pids));
                    // Closing stdin starts the storm.
                    drop(stdin.take());
                } else {
                    last_line = Some(line);
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                rec.failures.push(format!(
                    "timeout: the load client was killed after {:?}",
                    sc.timeout
                ));
                break;
            }
        }
    }
    let _ = child.wait();
    let _ = err_fwd.join();
    let wall = t0.elapsed().as_secs_f64();
    let split1 = cpu_held.unwrap_or_else(|| procfs::cpu_split(&pids));
    let ns1 = [&pids, &other_pids, &store_pids].map(|p| procfs::cpu_ns(p));
    // µs of on-CPU time over the run: A (the proxy), B (the resume scenario's other replica),
    // the store.
    let ns_us = |i: usize| ns1[i].saturating_sub(ns0[i]) as f64 / 1e3;
    let store1 = store_held.unwrap_or_else(|| procfs::cpu_split(&store_pids));
    let cpu1_ns = procfs::cpu_ns(&pids);
    let rss1 = rss_held.unwrap_or_else(|| procfs::rss_kib(&pids));
    // What the store holds once the run is over, and what the gateway says of it, before
    // anything is stopped.
    let store_seen = store.as_ref().map(|st| {
        // The gateways' own counts of the store (both replicas' in the resume scenario).
        let mut seen: BTreeMap<String, f64> = BTreeMap::new();
        for adm in [admin, other.as_ref().and_then(|o| o.2)]
            .into_iter()
            .flatten()
        {
            for (k, v) in gateway_store_metrics(adm) {
                *seen.entry(k).or_default() += v;
            }
        }
        let mut commandstats = Value::Null;
        match store_stats::inspect(&st.url) {
            Ok(x) => {
                seen.extend(x.metrics(st.base_used));
                commandstats = x.commandstats_json();
            }
            Err(e) => eprintln!("        the store could not be inspected: {e}"),
        }
        (seen, commandstats)
    });
    drop(other);
    drop(fleet);
    drop(proxy);
    drop(mock);
    drop(store);
    let raw: Value = last_line
        .as_deref()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    let mut raw = if raw.is_null() { ready_json } else { raw };
    if raw.is_null() {
        if rec.failures.is_empty() {
            rec.failures
                .push("error: the load client printed no result".into());
        }
        return rec;
    }
    if raw["checks"]["ok"].as_bool() != Some(true) {
        let reasons: Vec<String> = raw["checks"]["failures"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| f.as_str().map(str::to_owned))
            .collect();
        if reasons.is_empty() {
            let e = raw["error"]
                .as_str()
                .map_or_else(|| format!("checks {}", raw["checks"]), str::to_owned);
            rec.failures.push(format!("error: {e}"));
        }
        rec.failures.extend(reasons);
    }
    rec.ok = rec.failures.is_empty();
    let m = &mut rec.metrics;
    // User and system time apart: where a proxy's CPU goes (its own work or the kernel's).
    let (user, system) = (split1.0 - split0.0, split1.1 - split0.1);
    let cpu = user + system;
    // "proxy": the process under test (for ts-eventstore, the server itself).
    let has_proxy = arm != Arm::Direct;
    m.insert("wall_s".into(), wall);
    if has_proxy {
        m.insert("proxy_cpu_s".into(), cpu);
        m.insert("proxy_rss_base_kib".into(), rss0 as f64);
        m.insert("proxy_rss_kib".into(), rss1 as f64);
    }
    let lat = |m: &mut BTreeMap<String, f64>, v: &Value| {
        for k in ["p50_us", "p99_us", "p999_us", "max_us"] {
            if let Some(x) = v[k].as_f64() {
                m.insert(k.into(), x);
            }
        }
    };
    match sc.group {
        "json" => {
            if let Some(r) = raw["requests_per_s"].as_f64() {
                m.insert("req_per_s".into(), r);
            }
            lat(m, &raw["latency"]);
            let n = raw["requests"].as_f64().unwrap_or(0.0);
            if has_proxy && n > 0.0 {
                m.insert("cpu_us_per_req".into(), cpu * 1e6 / n);
                m.insert("user_us_per_req".into(), user * 1e6 / n);
                m.insert("sys_us_per_req".into(), system * 1e6 / n);
            }
        }
        "sse" | "paced" => {
            let ev = raw["events"].as_f64().unwrap_or(0.0);
            m.insert(
                "events_per_s".into(),
                raw["events_per_s"].as_f64().unwrap_or(0.0),
            );
            m.insert(
                "mb_per_s".into(),
                raw["data_mb_per_s"].as_f64().unwrap_or(0.0),
            );
            lat(m, &raw["latency"]);
            if has_proxy && ev > 0.0 {
                m.insert("cpu_us_per_event".into(), cpu * 1e6 / ev);
                m.insert("user_us_per_event".into(), user * 1e6 / ev);
                m.insert("sys_us_per_event".into(), system * 1e6 / ev);
                let secs = raw["seconds"].as_f64().unwrap_or(wall);
                m.insert("proxy_cpu_util".into(), cpu / secs.max(1e-3));
            }
        }
        "memory" => {
            let n = sc.sessions as f64;
            let delta = (rss1 as f64 - rss0 as f64) * 1024.0;
            m.insert("kb_per_session".into(), delta / n / 1000.0);
            if sc.window_events > 0 {
                m.insert("bytes_per_session".into(), delta / n);
                m.insert(
                    "bytes_per_event".into(),
                    delta / n / sc.window_events as f64,
                );
            }
        }
        "storm" => {
            m.insert(
                "time_to_last_ms".into(),
                raw["time_to_last_ms"].as_f64().unwrap_or(0.0),
            );
            lat(m, &raw["per_session"]);
            let resumes = raw["resumes"].as_f64().unwrap_or(0.0);
            if let (Some(c0), true) = (cpu_setup_done, resumes > 0.0) {
                let ns = cpu1_ns.saturating_sub(c0) as f64;
                m.insert("cpu_us_per_resume".into(), ns / 1e3 / resumes);
            }
        }
        "resume" => {
            for (from, to) in [
                ("to_resumed", "to_resumed"),
                ("to_first_replayed", "to_first"),
                ("tail_age", "tail_age"),
            ] {
                for k in ["p50_us", "p99_us", "max_us"] {
                    if let Some(x) = raw[from][k]
                        .as_f64()
                        .filter(|_| raw[from]["count"].as_u64() > Some(0))
                    {
                        m.insert(format!("{to}_{k}"), x);
                    }
                }
            }
            let resumes = raw["resumes"].as_f64().unwrap_or(0.0);
            if resumes > 0.0 {
                // B, the replica that does not own the calls: all its work is the resumes'.
                m.insert("cpu_us_per_resume".into(), ns_us(1) / resumes);
                // A: the session, the call read upstream and published, the cut.
                m.insert("owner_cpu_us_per_call".into(), ns_us(0) / resumes);
                m.insert(
                    "replayed_per_resume".into(),
                    raw["replayed_events"].as_f64().unwrap_or(0.0) / resumes,
                );
            }
        }
        "call-storm" => {
            // Times only when something was resumed (nginx resumes nothing).
            if raw["resumes_served"].as_u64() > Some(0) {
                for (k, from) in [
                    ("cut_to_last_resumed_ms", "/cut_to_last_resumed_ms"),
                    ("resume_p50_ms", "/resume_ms/p50"),
                    ("resume_p99_ms", "/resume_ms/p99"),
                ] {
                    if let Some(v) = raw.pointer(from).and_then(Value::as_f64) {
                        m.insert(k.into(), v);
                    }
                }
            }
            if let Some(v) = raw["cut_to_last_outcome_ms"].as_f64() {
                m.insert("cut_to_last_outcome_ms".into(), v);
            }
            for (k, from) in [
                ("delivered", "/outcomes/delivered"),
                ("explicit_error", "/outcomes/explicit_error"),
                ("lost", "/outcomes/lost"),
                ("refused", "/outcomes/refused"),
                ("duplicates", "/duplicates"),
                ("skipped", "/skipped"),
                ("unexpected_5xx", "/unexpected_5xx"),
                ("retry_after_honoured", "/retry_after_honoured"),
            ] {
                m.insert(
                    k.into(),
                    raw.pointer(from).and_then(Value::as_f64).unwrap_or(0.0),
                );
            }
            // Each gateway over the storm (the killed one is not sampled after the cut):
            // the largest peak RSS and the CPU of the busiest.
            let gws = raw["gateways"].as_array().cloned().unwrap_or_default();
            let most = |key: &str| {
                gws.iter()
                    .filter_map(|g| g[key].as_f64())
                    .fold(0.0f64, f64::max)
            };
            m.insert("gw_rss_peak_kib".into(), most("rss_kib_peak"));
            m.insert("gw_rss_at_cut_kib".into(), most("rss_kib_at_cut"));
            m.insert("gw_cpu_ms".into(), most("cpu_ms_cut_to_end"));
        }
        _ => {}
    }
    if let Some((seen, commandstats)) = store_seen {
        // The store's CPU beside the gateway's, per unit of the scenario's work, and summed.
        let scpu = (store1.0 - store0.0) + (store1.1 - store0.1);
        m.insert("store_cpu_s".into(), scpu);
        let (units, unit) = match sc.group {
            "json" => (raw["requests"].as_f64(), "req"),
            "sse" | "paced" => (raw["events"].as_f64(), "event"),
            "resume" => (raw["resumes"].as_f64(), "resume"),
            _ => (None, ""),
        };
        if let Some(n) = units.filter(|&n| n > 0.0) {
            if sc.group == "resume" {
                // In ns (schedstat), and both replicas' in the sum: A's calls, B's resumes.
                m.insert("store_us_per_resume".into(), ns_us(2) / n);
                m.insert(
                    "total_us_per_resume".into(),
                    (ns_us(0) + ns_us(1) + ns_us(2)) / n,
                );
            } else {
                m.insert(format!("store_us_per_{unit}"), scpu * 1e6 / n);
                m.insert(format!("total_us_per_{unit}"), (cpu + scpu) * 1e6 / n);
            }
            // The commands the store ran, and its own time in them (`INFO commandstats`):
            // the rest of its CPU is reading and writing its connections.
            for (k, name) in [
                ("store_commands", "store_cmds_per"),
                ("store_command_us", "store_cmd_us_per"),
            ] {
                if let Some(v) = seen.get(k) {
                    m.insert(format!("{name}_{unit}"), v / n);
                }
            }
        }
        if sc.group == "sse" {
            let secs = raw["seconds"].as_f64().unwrap_or(wall);
            m.insert("store_cpu_util".into(), scpu / secs.max(1e-3));
        }
        raw["store_commandstats"] = commandstats;
        let dropped = seen.get("store_dropped_mb").copied().unwrap_or(0.0);
        let errors = seen.get("store_errors").copied().unwrap_or(0.0);
        if dropped > 0.0 || errors > 0.0 {
            // Not a failed check (the clients got every event), but the store has holes: a
            // resume elsewhere would get the explicit gap.
            rec.note =
                format!("the store dropped {dropped:.1} MB of events, {errors:.0} store errors");
        }
        m.extend(seen);
    }
    rec.raw = raw;
    rec
}

// ---------------------------------------------------------------------------------------

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn stat(mut v: Vec<f64>) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let n = v.len();
    json!({"median": median(&mut v), "min": min, "max": max, "n": n})
}

/// summary[scenario][arm][metric] = {median,min,max,n}; plus "added_*" latency metrics per
/// arm (arm − direct in the same round).
fn summarize(scs: &[Scenario], recs: &[Record]) -> Value {
    let mut out = serde_json::Map::new();
    for sc in scs {
        let mut per_arm = serde_json::Map::new();
        for arm in EVERY {
            let rs: Vec<&Record> = recs
                .iter()
                .filter(|r| r.scenario == sc.key && r.arm == arm)
                .collect();
            if rs.is_empty() {
                continue;
            }
            let mut metrics: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            // Failed runs (a check failed: gap, short stream, error) are counted, not averaged.
            for r in rs.iter().filter(|r| r.ok) {
                for (k, v) in &r.metrics {
                    if v.is_finite() {
                        metrics.entry(k.clone()).or_default().push(*v);
                    }
                }
                if arm != Arm::Direct && matches!(sc.group, "json" | "paced") {
                    if let Some(d) = recs.iter().find(|d| {
                        d.scenario == sc.key && d.arm == Arm::Direct && d.round == r.round
                    }) {
                        for k in ["p50_us", "p99_us", "p999_us"] {
                            if let (Some(x), Some(y)) = (r.metrics.get(k), d.metrics.get(k)) {
                                metrics.entry(format!("added_{k}")).or_default().push(x - y);
                            }
                        }
                    }
                }
            }
            let mut mm = serde_json::Map::new();
            for (k, v) in metrics {
                mm.insert(k, stat(v));
            }
            mm.insert("runs".into(), json!(rs.len()));
            mm.insert("failed".into(), json!(rs.iter().filter(|r| !r.ok).count()));
            per_arm.insert(arm.name().into(), Value::Object(mm));
        }
        out.insert(sc.key.clone(), Value::Object(per_arm));
    }
    Value::Object(out)
}

fn med(s: &Value, sc: &str, arm: Arm, metric: &str) -> Option<f64> {
    s[sc][arm.name()][metric]["median"].as_f64()
}

/// The payload of each retained event in the window scenario: its 200-B `data`. (On the wire
/// the frame is 250 B: "id: " + 22-char id + "\n" + "event: message\n" + "data: " + 200 + "\n\n".)
const WINDOW_PAYLOAD_BYTES: f64 = 200.0;

/// Median of `metric` over every run of the arm, failed ones included.
fn med_all(recs: &[Record], sc: &str, arm: Arm, metric: &str) -> Option<f64> {
    let mut v: Vec<f64> = recs
        .iter()
        .filter(|r| r.scenario == sc && r.arm == arm)
        .filter_map(|r| r.metrics.get(metric).copied())
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    (!v.is_empty()).then(|| median(&mut v))
}

/// A saturating scenario's two rows against nginx: events/s at least nginx's, proxy CPU per
/// event at most nginx's.
fn versus_nginx(s: &Value, sc: &str) -> [(String, Option<f64>, String, Option<bool>); 2] {
    let ratio = |m: &str| {
        med(s, sc, Arm::Reattach, m)
            .zip(med(s, sc, Arm::Nginx, m))
            .map(|(a, b)| a / b)
    };
    let (rate, cpu) = (ratio("events_per_s"), ratio("cpu_us_per_event"));
    [
        (
            format!("{sc}: events/s mcp-reattach / nginx"),
            rate,
            "≥ 1.00".into(),
            rate.map(|v| v >= 1.0),
        ),
        (
            format!("{sc}: proxy CPU per event mcp-reattach / nginx"),
            cpu,
            "≤ 1.00".into(),
            cpu.map(|v| v <= 1.0),
        ),
    ]
}

fn goals(s: &Value, recs: &[Record]) -> Value {
    let mut g = Vec::new();
    // Precondition of every saturating comparison: the upstream (mock + client, the direct
    // arm) outruns the fastest hop by a wide margin, or the ratios measure the mock. Failed
    // runs count here (a run that ended in a gap still measured how fast the hop moved).
    for sc in SATURATING {
        let d = med_all(recs, sc, Arm::Direct, "events_per_s");
        let fastest = PROXIES
            .into_iter()
            .filter_map(|a| med_all(recs, sc, a, "events_per_s").map(|v| (a, v)))
            .max_by(|x, y| x.1.total_cmp(&y.1));
        if d.is_none() && fastest.is_none() {
            continue;
        }
        let v = d.zip(fastest).map(|(d, (_, f))| d / f);
        g.push(json!({
            "goal": format!(
                "{sc}: events/s direct / fastest proxy{}",
                fastest.map_or(String::new(), |(a, _)| format!(" ({})", a.name()))
            ),
            "value": v, "target": "≥ 3.00",
            "met": v.map_or(json!("n/a"), |v| json!(v >= 3.0)),
        }));
    }
    // Runs whose checks failed are left out of the medians; say so next to the goal.
    let failed_note = |sc: &str| {
        let mut notes = Vec::new();
        for arm in [Arm::Reattach, Arm::ReattachStore] {
            let rs: Vec<&Record> = recs
                .iter()
                .filter(|r| r.scenario == sc && r.arm == arm)
                .collect();
            let f = rs.iter().filter(|r| !r.ok).count();
            if f > 0 {
                notes.push(format!("{}: {f} of {} runs failed", arm.name(), rs.len()));
            }
        }
        if notes.is_empty() {
            String::new()
        } else {
            format!(" ({}, left out)", notes.join("; "))
        }
    };
    let mut push = |name: String, value: Option<f64>, target: String, met: Option<bool>| {
        let sc = name.split(':').next().unwrap_or("").to_owned();
        let name = format!("{name}{}", failed_note(&sc));
        g.push(json!({"goal": name, "value": value, "target": target,
            "met": met.map_or(json!("n/a"), |b| json!(b))}));
    };
    // The goals of issue 10, each a comparison within this job (vs nginx, naive or direct)
    // or an absolute bound where the issue states one.
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
    // SSE, the upstream writing bursts, 200 B × 1 and × 8 streams.
    for sc in ["sse-200-1", "sse-200-8"] {
        let v = ratio(
            med(s, sc, Arm::Reattach, "events_per_s"),
            med(s, sc, Arm::Nginx, "events_per_s"),
        );
        push(
            format!("{sc}: events/s mcp-reattach / nginx"),
            v,
            "≥ 1.00".into(),
            v.map(|v| v >= 1.0),
        );
        let c = med(s, sc, Arm::Reattach, "cpu_us_per_event");
        push(
            format!("{sc}: proxy CPU per event, mcp-reattach (µs)"),
            c,
            "≤ 1.00".into(),
            c.map(|v| v <= 1.0),
        );
        let v = ratio(c, med(s, sc, Arm::Nginx, "cpu_us_per_event"));
        // Issue 23: at most twice nginx's (issue 10 had three times).
        push(
            format!("{sc}: proxy CPU per event mcp-reattach / nginx"),
            v,
            "≤ 2.00".into(),
            v.map(|v| v <= 2.0),
        );
    }
    // One event per upstream write (the same sizes and stream counts).
    for sc in ["sse-200-1-single", "sse-200-8-single"] {
        for (name, v, target, met) in versus_nginx(s, sc) {
            push(name, v, target, met);
        }
        let rt = med(s, sc, Arm::ReattachTls, "events_per_s");
        let xt = med(s, sc, Arm::NginxTls, "events_per_s");
        let v = rt.zip(xt).map(|(a, b)| a / b);
        push(
            format!("{sc}: events/s mcp-reattach-tls / nginx-tls"),
            v,
            "≥ 1.00".into(),
            v.map(|v| v >= 1.0),
        );
    }
    for sc in ["sse-16k-1", "sse-16k-8"] {
        let v = ratio(
            med(s, sc, Arm::Reattach, "mb_per_s"),
            med(s, sc, Arm::Direct, "mb_per_s"),
        );
        push(
            format!("{sc}: MB/s mcp-reattach / direct"),
            v,
            "≥ 0.90".into(),
            v.map(|v| v >= 0.9),
        );
    }
    // Event age through the hop at saturation.
    for sc in SATURATING {
        let v = ratio(
            med(s, sc, Arm::Reattach, "p50_us"),
            med(s, sc, Arm::Nginx, "p50_us"),
        );
        push(
            format!("{sc}: event age p50 mcp-reattach / nginx"),
            v,
            "≤ 2.00".into(),
            v.map(|v| v <= 2.0),
        );
    }
    let a1 = med(s, "paced-1", Arm::Reattach, "added_p99_us");
    push(
        "paced-1: added p99 per-event latency (µs)".into(),
        a1,
        "≤ 150".into(),
        a1.map(|v| v <= 150.0),
    );
    // Added p99 (arm − direct, same round) at a fixed rate: no more than nginx's.
    for (sc, what) in [
        ("paced-50", "per-event latency, 50 streams × 100/s"),
        ("json-paced", "request latency, 2000 req/s"),
    ] {
        let r = med(s, sc, Arm::Reattach, "added_p99_us");
        let x = med(s, sc, Arm::Nginx, "added_p99_us");
        push(
            format!("{sc}: added p99 {what}, mcp-reattach (µs)"),
            r,
            format!(
                "≤ nginx's ({})",
                x.map_or("–".into(), |x| format!("{x:.0}"))
            ),
            r.zip(x).map(|(r, x)| r <= x),
        );
    }
    // Short tool calls (issue 23), and the same for a JSON-mode upstream with the upgrade on
    // (the json scenario: every answer JSON, served as the gateway's SSE stream): throughput,
    // CPU and added tail latency against nginx.
    for (sc, label, unit) in [
        ("calls", "calls", "call"),
        ("calls-unpinned", "calls (unpinned)", "call"),
        ("calls-streamed", "streamed calls (unpinned)", "call"),
        ("calls-streamed-pinned", "streamed calls (pinned)", "call"),
        ("json", "json (JSON upstream, upgrade on)", "request"),
    ] {
        // (metric, what, bound, whether the ratio must be at least the bound or at most)
        for (metric, what, bound, at_least) in [
            ("req_per_s", format!("{unit}s/s"), 1.0, true),
            (
                "cpu_us_per_req",
                format!("proxy CPU per {unit}"),
                1.25,
                false,
            ),
            (
                "added_p99_us",
                if unit == "call" {
                    "added p99 call latency"
                } else {
                    "added p99 latency"
                }
                .into(),
                1.5,
                false,
            ),
        ] {
            let v = ratio(
                med(s, sc, Arm::Reattach, metric),
                med(s, sc, Arm::Nginx, metric),
            );
            push(
                format!("{label}: {what} mcp-reattach / nginx"),
                v,
                format!("{} {bound:.2}", if at_least { "≥" } else { "≤" }),
                v.map(|v| if at_least { v >= bound } else { v <= bound }),
            );
        }
    }
    // Issue 48: the fleet's store, measured unpinned as a replica is deployed, against the
    // same gateway without it in the same job; the CPU rows sum the gateway's and
    // redis-server's.
    for (sc, label) in [
        ("calls-unpinned", "calls (unpinned)"),
        ("calls-streamed", "streamed calls (unpinned)"),
    ] {
        let v = ratio(
            med(s, sc, Arm::ReattachStore, "req_per_s"),
            med(s, sc, Arm::Reattach, "req_per_s"),
        );
        push(
            format!("{label}: calls/s mcp-reattach-store / mcp-reattach"),
            v,
            "≥ 0.60".into(),
            v.map(|v| v >= 0.6),
        );
        let v = ratio(
            med(s, sc, Arm::ReattachStore, "total_us_per_req"),
            med(s, sc, Arm::Reattach, "cpu_us_per_req"),
        );
        push(
            format!("{label}: CPU per call (gateway + store) mcp-reattach-store / mcp-reattach"),
            v,
            "–".into(),
            None,
        );
    }
    for sc in ["sse-200-1-unpinned", "sse-200-8-unpinned"] {
        // Issue 49: saturating events unpinned, as deployed, against nginx.
        for (name, v, target, met) in versus_nginx(s, sc) {
            push(name, v, target, met);
        }
        let v = ratio(
            med(s, sc, Arm::ReattachStore, "events_per_s"),
            med(s, sc, Arm::Reattach, "events_per_s"),
        );
        push(
            format!("{sc}: events/s mcp-reattach-store / mcp-reattach"),
            v,
            "≥ 0.50".into(),
            v.map(|v| v >= 0.5),
        );
        let v = ratio(
            med(s, sc, Arm::ReattachStore, "total_us_per_event"),
            med(s, sc, Arm::Reattach, "cpu_us_per_event"),
        );
        push(
            format!("{sc}: CPU per event (gateway + store) mcp-reattach-store / mcp-reattach"),
            v,
            "–".into(),
            None,
        );
    }
    let p99 = med(s, "resume-other", Arm::ReattachStore, "to_resumed_p99_us").map(|v| v / 1e3);
    push(
        "resume-other: p99 from the GET to `resumed` on a replica that does not own the call (ms)"
            .into(),
        p99,
        "< 5.00".into(),
        p99.map(|v| v < 5.0),
    );
    // Issue 50, the worst minute: the last resume served within 5 s of the cut; no call lost
    // (failed runs, which lose calls or see a 5xx, are counted in the last row).
    for (arm, what) in [
        (Arm::Reattach, "one gateway"),
        (Arm::ReattachStore, "a fleet losing a replica"),
    ] {
        let v = med(s, "call-storm", arm, "cut_to_last_resumed_ms");
        push(
            format!("call-storm, {what}: the cut to the last `resumed` (ms)"),
            v,
            "< 5000".into(),
            v.map(|v| v < 5000.0),
        );
    }
    let b = med(s, "window-256", Arm::ReattachStore, "store_bytes_per_event");
    push(
        "window-256: store memory per retained event, used_memory (bytes)".into(),
        b,
        "–".into(),
        None,
    );
    let v = ratio(
        med(s, "json", Arm::ReattachPlain, "cpu_us_per_req"),
        med(s, "json", Arm::Naive, "cpu_us_per_req"),
    );
    push(
        "json (upgrade off): CPU per request mcp-reattach-plain / naive".into(),
        v,
        "≤ 1.15".into(),
        v.map(|v| v <= 1.15),
    );
    let v = ratio(
        med(s, "json", Arm::Reattach, "cpu_us_per_req"),
        med(s, "json", Arm::Naive, "cpu_us_per_req"),
    );
    push(
        "json (upgrade on): CPU per request mcp-reattach / naive".into(),
        v,
        "–".into(),
        None,
    );
    for sc in ["idle-1000", "idle-5000", "idle-200"] {
        if let Some(v) = med(s, sc, Arm::Reattach, "kb_per_session") {
            let n = med(s, sc, Arm::Naive, "kb_per_session");
            push(
                format!("{sc}: RSS per idle held session, mcp-reattach (KB)"),
                Some(v),
                format!(
                    "≤ 24 and < naive's ({})",
                    n.map_or("–".into(), |n| format!("{n:.0}"))
                ),
                Some(v <= 24.0 && n.is_none_or(|n| v < n)),
            );
        }
    }
    // Window: the marginal cost of a retained event (slope between the 128- and 256-event
    // windows) and the all-in cost (RSS delta / sessions / 256), each minus the 200-B payload.
    let b256 = med(s, "window-256", Arm::Reattach, "bytes_per_session");
    let b128 = med(s, "window-128", Arm::Reattach, "bytes_per_session");
    if let Some(b) = b256 {
        let all_in = b / 256.0 - WINDOW_PAYLOAD_BYTES;
        push(
            format!(
                "window: all-in RSS bytes per retained event − payload ({WINDOW_PAYLOAD_BYTES} B)"
            ),
            Some(all_in),
            "≤ 96".into(),
            Some(all_in <= 96.0),
        );
    }
    if let (Some(b), Some(c)) = (b256, b128) {
        let slope = (b - c) / 128.0 - WINDOW_PAYLOAD_BYTES;
        push(
            "window: marginal RSS bytes per retained event − payload".into(),
            Some(slope),
            "≤ 96".into(),
            Some(slope <= 96.0),
        );
        let per_session = b - 256.0 * (slope + WINDOW_PAYLOAD_BYTES);
        push(
            "window: per-session overhead (bytes, for the formula)".into(),
            Some(per_session),
            "–".into(),
            None,
        );
    }
    // Reconnect storm: no later than the TypeScript SDK's own event store serving the same
    // storm, and CPU per resume (the storm alone, not its setup).
    let v = ratio(
        med(s, "storm", Arm::Reattach, "time_to_last_ms"),
        med(s, "storm", Arm::TsEventStore, "time_to_last_ms"),
    );
    push(
        "storm: time to the last replayed event mcp-reattach / ts-eventstore".into(),
        v,
        "≤ 1.00".into(),
        v.map(|v| v <= 1.0),
    );
    let c = med(s, "storm", Arm::Reattach, "cpu_us_per_resume");
    push(
        "storm: CPU per resume, mcp-reattach (µs)".into(),
        c,
        "≤ 50".into(),
        c.map(|v| v <= 50.0),
    );
    // The floor under that goal: the same bytes sent on a fresh connection by a server that
    // computes nothing (context, no line of its own).
    let f = med(s, "storm", Arm::NginxFile, "cpu_us_per_resume");
    push(
        "storm: CPU per resume, nginx-file, the same bytes from a file (µs)".into(),
        f,
        "–".into(),
        None,
    );
    let v = ratio(c, f);
    push(
        "storm: CPU per resume mcp-reattach / nginx-file".into(),
        v,
        "–".into(),
        None,
    );
    let failed = recs.iter().filter(|r| !r.ok).count();
    // By check (a run can fail more than one).
    let mut by: BTreeMap<&str, usize> = BTreeMap::new();
    for r in recs.iter().filter(|r| !r.ok) {
        let mut cs: Vec<&str> = r.failures.iter().map(|f| check_of(f)).collect();
        if cs.is_empty() {
            cs.push("error");
        }
        cs.dedup();
        for c in cs {
            *by.entry(c).or_default() += 1;
        }
    }
    let by = by
        .iter()
        .map(|(c, n)| format!("{c} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    g.push(json!({
        "goal": if failed > 0 {
            format!("runs with failed checks (of {}; by check: {by})", recs.len())
        } else {
            format!("runs with failed checks (of {})", recs.len())
        },
        "value": failed as f64, "target": "0", "met": failed == 0,
    }));
    Value::Array(g)
}

fn fmt(v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    let a = v.abs();
    if a >= 1_000_000.0 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 100_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn cell(s: &Value, sc: &str, arm: &str, metric: &str) -> String {
    let v = &s[sc][arm][metric];
    match (
        v["median"].as_f64(),
        v["min"].as_f64(),
        v["max"].as_f64(),
        v["n"].as_u64(),
    ) {
        (Some(m), Some(lo), Some(hi), Some(n)) if n > 1 => {
            format!("{} [{}–{}]", fmt(m), fmt(lo), fmt(hi))
        }
        (Some(m), ..) => fmt(m),
        _ => "–".into(),
    }
}

fn ratio_table(s: &Value, goals: &Value) -> String {
    let mut t = String::new();
    t.push_str("| goal | value (median of rounds) | target | met |\n|---|---|---|---|\n");
    for g in goals.as_array().unwrap() {
        let v = g["value"].as_f64().map_or("–".into(), |v| {
            if v.abs() < 10.0 {
                format!("{v:.2}")
            } else {
                format!("{v:.0}")
            }
        });
        let met = match &g["met"] {
            Value::Bool(true) => "yes",
            Value::Bool(false) => "**NO**",
            _ => "–",
        };
        t.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            g["goal"].as_str().unwrap(),
            v,
            g["target"].as_str().unwrap(),
            met
        ));
    }
    let _ = s;
    t
}

fn arm_table(s: &Value, sc: &Scenario, cols: &[(&str, &str)]) -> String {
    let mut t = format!(
        "| arm | {} |\n|---|{}\n",
        cols.iter().map(|c| c.1).collect::<Vec<_>>().join(" | "),
        "---|".repeat(cols.len())
    );
    for arm in &sc.arms {
        if s[&sc.key][arm.name()].is_null() {
            continue;
        }
        let failed = s[&sc.key][arm.name()]["failed"].as_u64().unwrap_or(0);
        let cells: Vec<String> = cols
            .iter()
            .map(|c| cell(s, &sc.key, arm.name(), c.0))
            .collect();
        t.push_str(&format!(
            "| {}{} | {} |\n",
            arm.name(),
            if failed > 0 {
                format!(" ({failed} failed)")
            } else {
                String::new()
            },
            cells.join(" | ")
        ));
    }
    t
}

/// Every failed run and why (the load client's checks, or timeout / error).
fn failed_runs(runs: &[Record]) -> String {
    let failed: Vec<&Record> = runs.iter().filter(|r| !r.ok).collect();
    if failed.is_empty() {
        return String::new();
    }
    let mut t = String::from(
        "### Failed runs\n\n| scenario | arm | round | failed check(s) |\n|---|---|---|---|\n",
    );
    for r in failed {
        let why = if r.failures.is_empty() {
            "error: (no reason recorded)".to_owned()
        } else {
            r.failures.join("; ")
        };
        t.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            r.scenario,
            r.arm.name(),
            r.round + 1,
            why.replace('|', "\\|")
        ));
    }
    t.push('\n');
    t
}

fn machine_info(a: &Args) -> Value {
    let sh = |c: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(c)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    // What touching a page left alone for a second costs (bench/src/bin/cold-pages.rs): tens
    // of ns on most machines, tens of µs on some VMs, where a storm on sessions that sat idle
    // pays it per page (bench/notes.md, twelfth step). The slowest of two passes, in µs.
    let cold = |huge: bool| {
        let mut c = Command::new(a.bin.join("cold-pages"));
        c.args(["--pages", "500", "--idle-ms", "1000", "--rounds", "2"]);
        if huge {
            c.arg("--huge");
        }
        let out = c.output().ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split(": ").nth(1)?.split(' ').next()?.parse::<f64>().ok())
            .reduce(f64::max)
            .map(|ns| ns / 1000.0)
    };
    json!({
        "cold_page_us": cold(false),
        "cold_huge_page_us": cold(true),
        "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"),
        "cores": sh("nproc"),
        "memory": sh("free -h | awk '/Mem:/{print $2}'"),
        "kernel": sh("uname -r"),
        "os": sh(". /etc/os-release; echo $PRETTY_NAME"),
        "rustc": sh("rustc --version"),
        "nginx": sh("nginx -v 2>&1 | cut -d/ -f2"),
        "commit": sh("git rev-parse --short HEAD"),
        "dirty": sh("git status --porcelain -- src Cargo.toml Cargo.lock | wc -l") != "0",
        "date": sh("date -u +%Y-%m-%dT%H:%MZ"),
        "loadavg_at_start": sh("cat /proc/loadavg"),
        "clk_tck": procfs::clk_tck(),
    })
}

#[allow(clippy::too_many_arguments)]
fn markdown(
    a: &Args,
    scs: &[Scenario],
    s: &Value,
    runs: &[Record],
    m: &Value,
    table: &str,
    rounds: usize,
    mem_rounds: usize,
    total: f64,
) -> String {
    let mut o = String::new();
    let placement = if a.pinned {
        "pinned (`--pinned`, the second view): the proxy under test on core 1, the mock and the load client on core 0; the unpinned view, as users deploy, is [benchmarks.md](benchmarks.md)"
    } else {
        "unpinned: no process pinned, each with its default threading, as users deploy (scenarios named `-pinned` excepted); the pinned view is [benchmarks-pinned.md](benchmarks-pinned.md)"
    };
    o.push_str("# Benchmarks\n\nGenerated by `bench/run` (issue 6). Every number below comes from one job: the arms ran\ninterleaved (arm order rotated each round), each arm-run on fresh processes on 127.0.0.1.\nCells are `median [min–max]` over the rounds.\n\n");
    o.push_str(&format!(
        "## Machine and build\n\n| | |\n|---|---|\n| placement | {} |\n| commit | `{}`{} |\n| date | {} |\n| CPU | {} × {} |\n| memory | {} |\n| OS / kernel | {} / {} |\n| rustc | {} |\n| nginx | {} (Debian) |\n| load average at start | {} |\n| a 4 KiB page untouched for 1 s, touched again (`cold-pages`) | {} |\n| rounds | {} (memory and storm: {}) |\n| job time | {:.0} s |\n\n",
        placement,
        m["commit"].as_str().unwrap_or(""),
        if m["dirty"].as_bool() == Some(true) { " (the worktree differed in src/, Cargo.toml or Cargo.lock)" } else { "" },
        m["date"].as_str().unwrap_or(""),
        m["cores"].as_str().unwrap_or(""),
        m["cpu"].as_str().unwrap_or(""),
        m["memory"].as_str().unwrap_or(""),
        m["os"].as_str().unwrap_or(""),
        m["kernel"].as_str().unwrap_or(""),
        m["rustc"].as_str().unwrap_or(""),
        m["nginx"].as_str().unwrap_or(""),
        m["loadavg_at_start"].as_str().unwrap_or(""),
        match (m["cold_page_us"].as_f64(), m["cold_huge_page_us"].as_f64()) {
            (Some(p), Some(h)) => format!("{p:.1} µs (in a 2 MiB page: {h:.2} µs)"),
            _ => "–".to_owned(),
        },
        rounds,
        mem_rounds,
        total,
    ));
    o.push_str("## Goals (ratios within this run)\n\n");
    o.push_str(table);
    o.push('\n');
    o.push_str(&failed_runs(runs));
    o.push_str("## Results per scenario\n\n");
    for sc in scs {
        o.push_str(&format!("### {} (`{}`)\n\n", sc.title, sc.key));
        let mut cols: Vec<(&str, &str)> = match sc.group {
            "json" if sc.key == "json" || sc.key.starts_with("calls") => vec![
                ("req_per_s", "req/s"),
                ("cpu_us_per_req", "proxy CPU µs/req"),
                ("user_us_per_req", "of it user µs"),
                ("sys_us_per_req", "system µs"),
                ("p50_us", "p50 µs"),
                ("p99_us", "p99 µs"),
            ],
            "json" => vec![
                ("p50_us", "p50 µs"),
                ("p99_us", "p99 µs"),
                ("p999_us", "p99.9 µs"),
                ("added_p50_us", "added p50 µs"),
                ("added_p99_us", "added p99 µs"),
                ("added_p999_us", "added p99.9 µs"),
            ],
            "sse" => vec![
                ("events_per_s", "events/s"),
                ("mb_per_s", "data MB/s"),
                ("cpu_us_per_event", "proxy CPU µs/event"),
                ("user_us_per_event", "of it user µs"),
                ("sys_us_per_event", "system µs"),
                ("proxy_cpu_util", "proxy CPU util"),
                ("p50_us", "event age p50 µs"),
            ],
            "paced" => vec![
                ("p50_us", "p50 µs"),
                ("p99_us", "p99 µs"),
                ("p999_us", "p99.9 µs"),
                ("added_p50_us", "added p50 µs"),
                ("added_p99_us", "added p99 µs"),
                ("added_p999_us", "added p99.9 µs"),
                ("cpu_us_per_event", "proxy CPU µs/event"),
            ],
            "memory" if sc.window_events > 0 => vec![
                ("proxy_rss_base_kib", "base RSS KiB"),
                ("proxy_rss_kib", "RSS KiB"),
                ("bytes_per_session", "bytes/session"),
                ("bytes_per_event", "bytes/retained event (all-in)"),
            ],
            "memory" => vec![
                ("proxy_rss_base_kib", "base RSS KiB"),
                ("proxy_rss_kib", "RSS KiB held"),
                ("kb_per_session", "KB per held session"),
            ],
            "resume" => vec![
                ("to_resumed_p50_us", "to `resumed` p50 µs"),
                ("to_resumed_p99_us", "to `resumed` p99 µs"),
                ("to_resumed_max_us", "to `resumed` max µs"),
                ("to_first_p50_us", "to first replayed p50 µs"),
                ("to_first_p99_us", "to first replayed p99 µs"),
                ("replayed_per_resume", "replayed events per resume"),
                ("tail_age_p50_us", "live tail's event age p50 µs"),
                ("tail_age_p99_us", "live tail's event age p99 µs"),
                ("cpu_us_per_resume", "B CPU µs/resume"),
                ("owner_cpu_us_per_call", "A CPU µs/call"),
            ],
            "call-storm" => vec![
                ("cut_to_last_resumed_ms", "cut to the last `resumed` (ms)"),
                ("resume_p50_ms", "resume p50 ms"),
                ("resume_p99_ms", "resume p99 ms"),
                ("delivered", "calls delivered"),
                ("explicit_error", "explicit errors"),
                ("lost", "calls lost"),
                ("duplicates", "duplicates"),
                ("unexpected_5xx", "5xx (not 503 + Retry-After)"),
                ("cut_to_last_outcome_ms", "cut to the last outcome (ms)"),
                ("gw_rss_at_cut_kib", "RSS at the cut, KiB (largest gateway)"),
                ("gw_rss_peak_kib", "peak RSS KiB (largest gateway)"),
                ("gw_cpu_ms", "CPU ms, cut to end (busiest gateway)"),
            ],
            _ => vec![
                (
                    "time_to_last_ms",
                    "time to last replayed event, all sessions (ms)",
                ),
                ("p50_us", "per session p50 µs"),
                ("p99_us", "per session p99 µs"),
                ("max_us", "per session max µs"),
                ("cpu_us_per_resume", "CPU µs per resume (serving process)"),
            ],
        };
        // The store arm: redis-server's CPU beside the gateway's, and what the store holds.
        if sc.arms.contains(&Arm::ReattachStore) {
            cols.extend(match sc.group {
                "json" => vec![
                    ("store_us_per_req", "store CPU µs/req"),
                    ("total_us_per_req", "gateway + store µs/req"),
                    ("store_cmds_per_req", "store commands/req"),
                    ("store_cmd_us_per_req", "of its CPU in commands µs/req"),
                    ("store_used_mib", "store MiB at end"),
                ],
                "sse" => vec![
                    ("store_us_per_event", "store CPU µs/event"),
                    ("total_us_per_event", "gateway + store µs/event"),
                    ("store_cmd_us_per_event", "of its CPU in commands µs/event"),
                    ("store_cpu_util", "store CPU util"),
                    (
                        "store_events_max_stream",
                        "store events retained, longest stream",
                    ),
                ],
                "memory" => vec![
                    (
                        "store_bytes_per_event",
                        "store bytes/retained event (used_memory)",
                    ),
                    (
                        "store_stream_bytes_per_event",
                        "the streams' keys alone (MEMORY USAGE)",
                    ),
                    (
                        "store_events_max_stream",
                        "store events retained, longest stream",
                    ),
                ],
                "resume" => vec![
                    ("store_us_per_resume", "store CPU µs/resume"),
                    (
                        "store_cmds_per_resume",
                        "store commands/session (A's + B's)",
                    ),
                    ("total_us_per_resume", "A + B + store µs/resume"),
                ],
                _ => vec![],
            });
            cols.push(("store_dropped_mb", "store dropped MB"));
        }
        o.push_str(&arm_table(s, sc, &cols));
        o.push('\n');
    }
    o.push_str(
        &METHOD
            .replace("{BURST_200}", &sse_burst(200).to_string())
            .replace("{BURST_16K}", &sse_burst(16384).to_string())
            .replace("{SNDBUF}", &a.mock_sndbuf_kib.to_string()),
    );
    // Hand-written profiles and findings (each stamped with the commit it was taken on).
    if let Ok(notes) = std::fs::read_to_string("bench/notes.md") {
        o.push('\n');
        o.push_str(&notes);
    }
    o
}

const METHOD: &str = r#"## Method

- **Arms.** `direct` (load client → mock upstream), `naive` (a ~50-line hyper 1 + hyper-util
  pass-through, `bench/src/bin/naive-proxy.rs`: the cost floor of one hop built from the same
  libraries), `nginx` (Debian's nginx, `proxy_buffering off`, HTTP/1.1 upstream keep-alive,
  one worker: the config is in `bench/src/bin/bench.rs`), `mcp-reattach` (the release binary,
  default flags unless a scenario says otherwise). The storm has two more arms,
  `ts-eventstore`: no gateway and no mock, the TypeScript MCP SDK resuming streams itself
  (`bench/ts-eventstore/server.mjs`: `StreamableHTTPServerTransport`, stateful sessions, the
  SDK's `InMemoryEventStore`, one per session as in the SDK's example server), placed and
  measured as a proxy under test is; and `nginx-file`: nginx sending the same events from
  files, a server that computes nothing (its CPU per resume is the floor of the connection
  and the bytes).  In the `json` and saturating SSE scenarios
  also `nginx-tls` and `mcp-reattach-tls`: the same two terminating TLS (ECDSA P-256
  certificate made with openssl per job; the load client speaks TLS 1.3 with rustls and ring,
  HTTP/1.1 by ALPN; the upstream hop stays plain). `mcp-reattach-store` is the same gateway
  with the fleet's store (below).
- **The fleet's store (issue 48).** The `mcp-reattach-store` arm runs the gateway with
  `--store redis://127.0.0.1:<port>` and `--store-key-file` (32 random bytes, one file per
  job) against a `redis-server` (Debian's) started fresh for each arm-run on a free loopback
  port (`--save "" --appendonly no --maxmemory-policy noeviction`) and killed after it. The
  store is part of the tier measured: redis-server is placed as the proxy under test is
  (SCHED_FIFO 1 unless `--no-rt`; the proxy's core when pinned). Its scenarios run unpinned,
  as a fleet's replica is deployed: `calls-unpinned`, `calls-streamed`, `sse-200-1-unpinned`
  and `sse-200-8-unpinned` (the burst scenarios unpinned, beside the gateway without the
  store), and `window-256` (memory). *Store CPU* = utime + stime of redis-server from
  `/proc/PID/stat` over the load run, per call or event, beside the gateway's and summed with
  it. After each run, before anything stops: `INFO memory`'s `used_memory` less the empty
  server's, and every stream key (`mra:*:ev:*`) read back (`XRANGE`, each entry's packed
  events counted; `MEMORY USAGE … SAMPLES 0` summed), so *store bytes per retained event* =
  used_memory's growth / the events the streams hold (records, request ids and leases
  included); `INFO commandstats` (the commands per call, and the part of the store's CPU
  spent executing them rather than on its connections; per command in `results.json`); and
  the gateway's own counts (`/metrics`: the bytes its store writer dropped with
  its queue full, failed store requests). A run whose store dropped events is noted, not
  failed: its clients got every event, but a resume elsewhere would get the explicit gap.
- **Resume on another replica** (`resume-other`, `load resume`). Two gateways, A and B, on one
  store in front of one mock, unpinned. Per session: `initialize` through A, a tool call
  through A whose upstream writes 20 events of 200 B 500 µs apart (the mock's `gap_us`), the
  first event read and the connection dropped (the call goes on upstream, A publishing it),
  2 ms later a `GET` on B (which never saw the session: it adopts it from the store, then
  serves the stream from it) with `Last-Event-ID` = that event's id. Timed from sending the GET
  (on a connection already made) to the `mcp-reattach/resumed` event and to the first replayed
  event; *live tail's event age* = receive time − the mock's send stamp of the events the mock
  wrote after the GET was sent (B polls the store for them). Checks: every event after the
  cursor once, in order, then the result. CPU per resume is on-CPU ns (schedstat) of B, of A
  per call, and of the store.
- **The worst minute** (`call-storm`, `load call-storm`, issue 50; its client is
  `bench/src/call_storm.rs`, which `tests/storm.rs` runs too). N sessions, each `initialize`
  and a `tools/call` whose upstream writes 40 progress events of 200 B 150 ms apart (6 s);
  once every session has read two events, every client connection is reset at once
  (SO_LINGER 0) and every session resumes at once with `GET` + `Last-Event-ID`, again on any
  later cut, honouring `Retry-After` (503/429) and `retry:`, until its result or its explicit
  error (at most 20 GETs, 20 s). `mcp-reattach`: one gateway. `mcp-reattach-store`: three
  replicas on one store, session *i* created and called on replica *i* mod 3, the first
  replica killed with SIGKILL at the cut (the load client sends it), each resume sent to the
  next replica (the dead one refuses and is skipped), so no call is resumed where it runs.
  `nginx`: no resumption; its clients wait 10 s. Checks: every event once, in order, then
  the result; the killed replica's calls the explicit error (-32011 `owner-lost`) instead; no
  duplicates, no silent gap, no 5xx but 503 + `Retry-After`. Figures: the cut to the last
  `mcp-reattach/resumed` received, each resume's GET to its `resumed`, and RSS (`VmRSS`) and
  CPU (schedstat) of each gateway over the storm, sampled by the load client (the tables give
  the largest and the busiest).
- **Placement.** By default nothing is pinned and every process runs with its default
  threading (the gateway picks its scheduler for the CPUs it sees: one worker on two), as
  users deploy a sidecar; the scheduler places the proxy, the mock and the load client. With
  `--pinned` (the second view, docs/benchmarks-pinned.md), two cores: the proxy under test is
  pinned to core 1; the mock upstream and the load client share core 0 in every arm, direct
  included. A scenario named `-pinned` or `-unpinned` is placed as its name says in both
  views. Each arm-run starts fresh processes.
  The paced-latency scenarios run unpinned (`--pin-paced` pins them too): on this VM a wake-up
  across cores to an idle vCPU costs milliseconds at the tail for every proxy, nginx included,
  which would measure the hypervisor, not the hop. The proxy under test runs with SCHED_FIFO
  priority 1 (`chrt -f 1`; `--no-rt` for `nice` instead): with other work on the shared machine,
  a proxy at normal priority got 30–40 % of its core and every ratio measured the neighbours.
  The load client runs at `nice -10` (`--nice`), the mock at `nice 0` (`--mock-nice`): on
  their shared core the consumer outranks the producer, so a proxy that never pushes back on
  the upstream (mcp-reattach reads the upstream regardless of its client) cannot let the mock
  starve the client.
  The machine is shared with other work, so absolute numbers move between runs; compare arms
  within one run, and prefer the CPU-per-unit metrics, which contention disturbs least.
- **Mock upstream** (`bench/src/bin/mock-upstream.rs`): a legacy-era Streamable HTTP server
  (protocol 2025-06-18, so no priming events) that hands out `Mcp-Session-Id`s, sets no event
  ids and keeps no event store, like most deployed servers. One blocking thread per connection;
  each SSE event is one HTTP chunk carrying a per-stream sequence number and a CLOCK_MONOTONIC
  send stamp (the clock the load client reads after each `read`); data sizes are exact (200 B
  or 16 KiB, the final result padded too). In the saturating scenarios the mock writes like a
  busy server: it formats a *burst* of events (64 KiB: {BURST_200} of 200 B, {BURST_16K} of 16 KiB; still
  one chunk each, all stamped just before the write) into one buffer and issues one `write`;
  the `-single` variants write one event per `write`. Paced streams write each event on its own.
  The mock's send buffers autotune, as a real server's do (`--mock-sndbuf-kib`, {SNDBUF} KiB in
  this job; 0 = autotuning). A 512 KiB buffer makes direct 16 KiB × 8 about twice as
  fast, but it also hides a gateway that does not push back on its upstream: the mock can no
  longer get megabytes ahead, and 16 KiB runs that end in gaps with autotuning pass.
- **Upstream-speed precondition.** A ratio between hops means something only if the upstream
  (mock + load client, i.e. the `direct` arm) is much faster than every hop; otherwise every
  arm measures the mock. The goal row `direct / fastest proxy events/s` (target ≥ 3, failed
  runs included) states it for each saturating scenario in every job. With one `write` per
  event the mock is about as fast as the hops (direct ≈ 60–70 k events/s at 200 B), which is
  why the `-single` variants are not used for goals.
- **Load client** (`bench/src/bin/load.rs`): its own HTTP/1.1 client, chunked decoder and SSE
  parser; hdrhistogram. Saturating streams read up to 64 KiB per `read`; the chunked decoder
  hands the body to the SSE parser in place, which finds line ends with `memchr`
  and copies only an event split across reads; no allocation per event. It checks sequence
  continuity, strictly increasing gateway ids (`<epoch>.<stream>.<seq>`), one final result per
  stream, and gateway control events. A run fails on any of: **gap** (the gateway's
  `mcp-reattach/resumption-failed` event or a JSON-RPC error -32010), **control event** (any
  other gateway event or unexpected message), **sequence break**, **id order**, **missing
  result**, **error** (I/O, HTTP status), or **timeout** (the orchestrator killed the load
  client). The reasons are printed on stderr as the run ends, listed under *Failed runs*, and
  counted in the goal row *runs with failed checks*; failed runs are left out of the medians.
  *Saturating* SSE: the mock writes as fast as its socket takes them for the duration;
  events/s counts from the first to the last event received. *Paced*: the mock sleeps to each
  event's due time (1 ns timer slack); latency = receive − send stamp; *added* latency = the
  arm's percentile − direct's, same round. JSON: `ping` POSTs with the session header on
  keep-alive connections; paced JSON uses one blocking thread per connection and measures from
  the actual send.
- **CPU** = utime + stime of the proxy's processes from `/proc/PID/stat` (clock ticks) over the
  load run, divided by the events or requests the client received; the JSON, calls and SSE
  tables also give the two apart (*of it user*: the proxy's own work; *system*: the kernel's
  on its behalf, its socket reads and writes first). **RSS** = `VmRSS` from
  `/proc/PID/status`, summed over the proxy's processes, sampled 0.5 s after the client
  reported READY, minus the RSS of the fresh proxy before the load.
- **Window memory.** Each session: `initialize`, then one POST stream of 600 events of exactly
  200 B `data` (+ result), read to the end; the stream ends and the window keeps the last N
  events (the ring has wrapped: steady state). The payload of a retained event is its 200-B
  `data` (on the wire the frame is 250 B: `id: ` + 22-char id + `\n` + `event: message\n` +
  `data: ` + 200 + `\n\n`). Runs at `--window-events` 256 and 128 separate the per-event cost
  (slope) from the per-session overhead (intercept): memory ≈ base + sessions × (events ×
  (payload + per-event overhead) + per-session overhead). RSS of the same work varies between
  runs (allocator arenas), hence the median of several rounds.
- **Reconnect storm.** Each session reads 200 events on its standalone GET stream and detaches;
  then every session, at once, connects and resumes with the `Last-Event-ID` that has 100
  events after it. Per session: time from `connect` to the 100th replayed event; the storm's
  time is from the first `connect` to the last replayed event of all sessions. The load client
  stops between setup and storm (`--wait-stdin`), so **CPU per resume** covers the storm alone
  (and the clients closing after it): on-CPU ns of the serving process's threads
  (`/proc/PID/task/*/schedstat`; ticks would be 10 ms) from then until the client exits, divided
  by the resumes. In the `ts-eventstore` arm the server sends the 200 events on the standalone
  stream through the SDK (`notification`, the store assigning the ids) once the GET is
  registered, and on resume the transport replays from the store; the client checks the same
  sequence continuity and replay length, takes the ids as opaque strings (`--plain-store`) and
  expects no gateway `resumed` event. The store is the SDK's with two id methods overridden:
  as shipped it derives the stream from an id with `split('_')[0]`, which is empty for the
  standalone stream (`_GET_stream`), so such a resume replays nothing (`node
  bench/ts-eventstore/server.mjs --ids sdk` shows it), and it replays in `localeCompare` order
  of `<stream>_<ms>_<random>` ids, which scrambles events stored in the same millisecond. Its
  storing and its replay (which sorts all of the session's events on every resume) are the
  SDK's.
- **Run it.** `bench/run` (full) or `bench/run --quick` (smoke). `bench/run --only
  saturating,paced-1` runs a subset (`saturating`: the four burst scenarios; `sse-single`: the
  one-write-per-event ones; `sse`: both). Raw per-run numbers are in `bench/target/results.json`.
"#;
