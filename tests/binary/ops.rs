//! Operating the real binary: admin endpoints, metrics (checked with `promtool` when it is
//! installed, as CI does), the graceful drain on SIGTERM, and SIGHUP logged and survived.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

/// A blocking one-shot HTTP/1.0 GET; returns (status, body).
fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    http_get_accept(addr, path, "*/*")
}

/// [`http_get`] asking for the media type `accept`.
fn http_get_accept(addr: SocketAddr, path: &str, accept: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: x\r\nAccept: {accept}\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// `/metrics` of the admin listener at `admin`, off the runtime ([`http_get`] blocks):
/// (status, body).
async fn scrape_metrics(admin: SocketAddr) -> (u16, String) {
    tokio::task::spawn_blocking(move || http_get(admin, "/metrics").unwrap())
        .await
        .unwrap()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_during_a_resume_pass_promtool() {
    let mut mock = Mock::start().await;
    let gw = Binary::start(mock.addr, &["--priming", "always"]).await;
    init_session(&gw.addr, &mut mock, "s1").await;
    let pending = tokio::spawn(send(gw.addr, post(&call(1), Some("s1"))));
    let writer = mock.next().await.respond_sse(Some("s1"));
    let mut reader = SseReader::new(pending.await.unwrap());
    let cursor = reader.next().await.unwrap().id.unwrap();
    drop(reader);
    writer.message(&progress(1)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut resumed = SseReader::new(send(gw.addr, get("s1", Some(&cursor))).await);
    assert_eq!(
        resumed.next().await.unwrap().event.as_deref(),
        Some("mcp-reattach/resumed")
    );
    assert!(resumed
        .next()
        .await
        .unwrap()
        .data
        .unwrap()
        .contains("progress"));
    // A failing resume too, so the outcome label shows up.
    let _ = send(gw.addr, get("s1", Some("garbage"))).await;

    // Scrape while the resumed stream is attached.
    let (status, text) = scrape_metrics(gw.admin).await;
    assert_eq!(status, 200);
    eprintln!("{text}");
    assert_eq!(metric(&text, "mcp_reattach_sessions"), 1.0);
    assert_eq!(metric(&text, "mcp_reattach_attached_clients"), 1.0);
    // The progress event, and the `initialize`'s JSON answer upgraded to a stream.
    assert_eq!(metric(&text, "mcp_reattach_events_tagged_total"), 2.0);
    assert_eq!(metric(&text, "mcp_reattach_events_replayed_total"), 1.0);
    assert_eq!(
        metric(&text, "mcp_reattach_resumes_total{outcome=\"resumed\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "mcp_reattach_resumes_total{outcome=\"malformed_cursor\"}"
        ),
        1.0
    );
    assert!(metric(&text, "mcp_reattach_window_bytes") > 0.0);
    assert!(text.contains("mcp_reattach_request_duration_seconds_bucket"));
    assert!(text.contains("mcp_reattach_build_info{version="));
    // Every series of the live scrape is in docs/operations.md's metric tables.
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"),
    )
    .unwrap();
    let mut names = 0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap();
            let short = name.strip_prefix("mcp_reattach_").unwrap_or(name);
            assert!(
                doc.contains(&format!("| `{short}` |")),
                "docs/operations.md lacks the exported `{name}`"
            );
            names += 1;
        }
    }
    assert!(names > 40, "{names} series");
    assert!(metric(&text, "process_resident_memory_bytes") > 0.0);
    assert!(metric(&text, "process_open_fds") > 0.0);
    if let Some(out) = promtool_check(&text) {
        assert!(out.0, "promtool check metrics failed:\n{}", out.1);
        eprintln!("promtool check metrics: OK {}", out.1);
    } else {
        assert!(
            std::env::var_os("CI_REQUIRE_PROMTOOL").is_none(),
            "promtool is required in CI"
        );
        eprintln!("promtool not installed; skipped the promtool check (CI installs it)");
    }
    drop(writer);
}

/// The alerting rules and the dashboard in deploy/prometheus name only metrics a running
/// gateway exports, and the rules pass `promtool check rules` and `promtool test rules`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_rules_and_dashboard_use_only_exported_metrics() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus");
    let rules = std::fs::read_to_string(dir.join("mcp-reattach.rules.yml")).unwrap();
    let dashboard = std::fs::read_to_string(dir.join("mcp-reattach-dashboard.json")).unwrap();

    // A gateway after some traffic: a session, a call streamed, a failed resume.
    let mut mock = Mock::start().await;
    let gw = Binary::start(mock.addr, &["--memory-budget", "64MiB"]).await;
    init_session(&gw.addr, &mut mock, "s1").await;
    let pending = tokio::spawn(send(gw.addr, post(&call(1), Some("s1"))));
    let writer = mock.next().await.respond_sse(Some("s1"));
    let mut reader = SseReader::new(pending.await.unwrap());
    writer.message(&result(1)).await;
    drop(writer);
    assert_eq!(messages(&reader.rest().await), vec![result(1)]);
    let _ = send(gw.addr, get("s1", Some("garbage"))).await;
    let (status, text) = scrape_metrics(gw.admin).await;
    assert_eq!(status, 200);
    assert_eq!(
        metric(&text, "mcp_reattach_memory_budget_bytes"),
        (64u64 << 20) as f64
    );

    // What the exposition declares: every family has a TYPE line, samples or not.
    let mut exported = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            exported.insert(name.to_owned());
            if kind == "histogram" {
                for suffix in ["_bucket", "_sum", "_count"] {
                    exported.insert(format!("{name}{suffix}"));
                }
            }
        }
    }
    for (what, source) in [("rules", &rules), ("dashboard", &dashboard)] {
        let used = metric_names(source);
        assert!(used.len() >= 8, "{what} use only {used:?}");
        let missing: Vec<_> = used.difference(&exported).collect();
        assert!(
            missing.is_empty(),
            "{what} use metrics the gateway does not export: {missing:?}\nexported: {exported:?}"
        );
        eprintln!("{what}: {} metric names, all exported", used.len());
    }

    match promtool(&["check", "rules", "mcp-reattach.rules.yml"], &dir) {
        Some((ok, out)) => {
            assert!(ok, "promtool check rules failed:\n{out}");
            eprintln!("promtool check rules: {out}");
            let (ok, out) =
                promtool(&["test", "rules", "mcp-reattach.rules.test.yml"], &dir).unwrap();
            assert!(ok, "promtool test rules failed:\n{out}");
            eprintln!("promtool test rules: {out}");
        }
        None => {
            assert!(
                std::env::var_os("CI_REQUIRE_PROMTOOL").is_none(),
                "promtool is required in CI"
            );
            eprintln!("promtool not installed; skipped the rule checks (CI installs it)");
        }
    }
}

/// Every `mcp_reattach_…` identifier in `text`.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("mcp_reattach_") {
        let preceded = rest[..i].chars().next_back().is_some_and(ident);
        let tail = &rest[i..];
        let end = tail.find(|c: char| !ident(c)).unwrap_or(tail.len());
        if !preceded {
            out.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    out
}

fn promtool(args: &[&str], dir: &std::path::Path) -> Option<(bool, String)> {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    let msg = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), msg))
}

fn promtool_check(text: &str) -> Option<(bool, String)> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(text.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    let msg = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), msg))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_calls_ends_get_streams_and_exits_zero() {
    sigterm_drains(
        &[("TOKIO_WORKER_THREADS", "2")],
        "scheduler=\"multi-thread\" workers=2",
    )
    .await;
}

/// With one CPU to run on (here: one worker asked for), the gateway runs tokio's
/// current-thread scheduler; the same calls, streams and drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_current_thread_scheduler_sigterm_drains_the_same() {
    sigterm_drains(
        &[("TOKIO_WORKER_THREADS", "1")],
        "scheduler=\"current-thread\" workers=1",
    )
    .await;
}

async fn sigterm_drains(envs: &[(&str, &str)], started: &str) {
    let mut mock = Mock::start().await;
    let mut gw = Binary::start_with_env(
        mock.addr,
        &[
            "--drain-delay",
            "300ms",
            "--drain-timeout",
            "3s",
            "--retry-hint",
            "750ms",
        ],
        envs,
    )
    .await;
    let line = gw
        .proc
        .wait_line_blocking(Duration::from_secs(5), |l| {
            l.contains("mcp-reattach started")
        })
        .expect("the started line");
    assert!(line.contains(started), "{line}");
    init_session(&gw.addr, &mut mock, "s1").await;
    // A standalone GET stream and a tool call, both in flight.
    let pending = tokio::spawn(send(gw.addr, get("s1", None)));
    let get_writer = mock.next().await.respond_sse(Some("s1"));
    let mut get_stream = SseReader::new(pending.await.unwrap());
    let pending = tokio::spawn(send(gw.addr, post(&call(7), Some("s1"))));
    let call_writer = mock.next().await.respond_sse(Some("s1"));
    let mut call_stream = SseReader::new(pending.await.unwrap());
    call_writer.message(&progress(1)).await;
    assert!(call_stream
        .next()
        .await
        .unwrap()
        .data
        .unwrap()
        .contains("progress"));

    let t0 = Instant::now();
    gw.proc.sigterm();
    let admin = gw.admin;
    let (status, _) = tokio::task::spawn_blocking(move || {
        std::thread::sleep(Duration::from_millis(50));
        http_get(admin, "/readyz").unwrap()
    })
    .await
    .unwrap();
    assert_eq!(status, 503, "/readyz fails at once");
    // Still accepting during the drain delay.
    let pending = tokio::spawn(send(
        gw.addr,
        post(r#"{"jsonrpc":"2.0","id":2,"method":"ping"}"#, Some("s1")),
    ));
    mock.next()
        .await
        .respond_json(r#"{"jsonrpc":"2.0","id":2,"result":{}}"#);
    assert_eq!(
        pending.await.unwrap().status(),
        200,
        "accepting during --drain-delay"
    );

    // The GET stream is told to resume elsewhere, with the retry hint.
    let events = get_stream.rest().await;
    let last = events.last().unwrap();
    assert_eq!(
        last.event.as_deref(),
        Some("mcp-reattach/resumption-required"),
        "{events:?}"
    );
    assert_eq!(last.retry, Some(750));
    assert!(last.data.as_deref().unwrap().contains("shutdown"));
    eprintln!("GET stream ended {:?} after SIGTERM", t0.elapsed());
    // Ended by the drain (its deadline is 3 s), not left open: the margin past the deadline
    // is a busy machine's, not the gateway's.
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    // The drain is visible to the McpReattachDrainOverdue alert: when it started, its deadline.
    let (_, text) = scrape_metrics(admin).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = metric(&text, "mcp_reattach_drain_started_timestamp_seconds");
    assert!(
        started > now - 5.0 && started <= now + 1.0,
        "{started} vs {now}"
    );
    assert_eq!(metric(&text, "mcp_reattach_drain_deadline_seconds"), 5.0);

    // The in-flight call completes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    call_writer.message(&progress(2)).await;
    call_writer.message(&result(7)).await;
    drop(call_writer);
    let rest = messages(&call_stream.rest().await);
    assert_eq!(
        rest,
        vec![progress(2), result(7)],
        "the in-flight call completes during the drain"
    );

    let status = gw
        .proc
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("gateway did not exit");
    eprintln!("exited {status:?} {:?} after SIGTERM", t0.elapsed());
    assert_eq!(status.code(), Some(0));
    drop(get_writer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_deadline_ends_streams_that_do_not_finish() {
    let mut mock = Mock::start().await;
    let mut gw = Binary::start(
        mock.addr,
        &["--drain-delay", "0s", "--drain-timeout", "500ms"],
    )
    .await;
    init_session(&gw.addr, &mut mock, "s1").await;
    let pending = tokio::spawn(send(gw.addr, post(&call(7), Some("s1"))));
    let call_writer = mock.next().await.respond_sse(Some("s1"));
    let mut call_stream = SseReader::new(pending.await.unwrap());
    let t0 = Instant::now();
    gw.proc.sigterm();
    let events = call_stream.rest().await;
    let last = events.last().unwrap();
    assert_eq!(
        last.event.as_deref(),
        Some("mcp-reattach/resumption-required")
    );
    assert_eq!(last.retry, Some(1000), "default retry hint");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(450) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    let status = gw
        .proc
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("gateway did not exit");
    assert_eq!(status.code(), Some(0));
    drop(call_writer);
}

/// SIGHUP, which operators used to nginx or HAProxy send to reload, neither kills the gateway
/// (its default action) nor drains it: it is logged, the TLS certificate is re-read
/// (tests/binary/tls.rs), and the gateway keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_is_logged_and_the_gateway_keeps_serving() {
    let mut mock = Mock::start().await;
    let mut gw = Binary::start(mock.addr, &[]).await;
    init_session(&gw.addr, &mut mock, "s1").await;
    for _ in 0..2 {
        gw.proc.signal("HUP");
        let line = loop {
            match gw.proc.next_line(Duration::from_secs(10)).await {
                NextLine::Line(l) if l.contains("SIGHUP") => break l,
                NextLine::Line(_) => {}
                other => panic!("no SIGHUP line: {other:?}"),
            }
        };
        assert!(line.contains("INFO"), "{line}");
    }
    // Still up, still ready (no drain began), still serving: the session goes on, and a new
    // one starts.
    assert!(gw
        .proc
        .wait_exit(Duration::from_millis(200))
        .await
        .is_none());
    let admin = gw.admin;
    let readyz = tokio::task::spawn_blocking(move || http_get(admin, "/readyz").unwrap())
        .await
        .unwrap();
    assert_eq!(readyz, (200, "ready\n".into()));
    let pending = tokio::spawn(send(
        gw.addr,
        post(r#"{"jsonrpc":"2.0","id":2,"method":"ping"}"#, Some("s1")),
    ));
    mock.next()
        .await
        .respond_json(r#"{"jsonrpc":"2.0","id":2,"result":{}}"#);
    assert_eq!(pending.await.unwrap().status(), 200);
    init_session(&gw.addr, &mut mock, "s2").await;
}

#[test]
fn admin_endpoints() {
    let dead = free_port();
    let gw = Binary::start_blocking(dead, &[]);
    assert_eq!(
        http_get(gw.admin, "/healthz").unwrap(),
        (200, "ok\n".into())
    );
    assert_eq!(
        http_get(gw.admin, "/readyz").unwrap(),
        (200, "ready\n".into())
    );
    assert_eq!(http_get(gw.admin, "/nope").unwrap().0, 404);
}

/// The binary formats its access lines itself (not through tracing's formatter): in either
/// `--log-format` each finished request is one line with the documented fields (OpenTelemetry
/// names), the JSON one a valid object: the client's address, the path without its query, the
/// user agent, the trace id of its `traceparent`, the MCP method and tool of a POST, and the
/// reason of a refusal.
#[test]
fn access_lines_in_both_log_formats() {
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for format in ["json", "text"] {
        let mut gateway = Binary::start_blocking(free_port(), &["--log-format", format]);
        // Refused by the gateway itself (a minted session id it does not hold): no upstream.
        let get = format!(
            "GET /mcp?x=1 HTTP/1.0\r\nHost: x\r\nAccept: text/event-stream\r\nMcp-Session-Id: mra-{}\r\nUser-Agent: probe/1.0 \"q\"\r\ntraceparent: {traceparent}\r\n\r\n",
            "0".repeat(32)
        );
        // A tool call to an upstream that is not there: 502, but its method and tool logged.
        let call = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo"}}"#;
        let post = format!(
            "POST /mcp HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\n\r\n{call}",
            call.len()
        );
        for (request, want_status) in [(get, 404u16), (post, 502)] {
            let mut s = TcpStream::connect(gateway.addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(request.as_bytes()).unwrap();
            let mut response = String::new();
            s.read_to_string(&mut response).unwrap();
            let status: u16 = response[9..12].parse().unwrap();
            assert_eq!(status, want_status, "{response}");
            let line = gateway
                .proc
                .wait_line_blocking(Duration::from_secs(10), |l| l.contains("request finished"))
                .expect("an access line on stdout");
            let get = want_status == 404;
            let want: Vec<(&str, serde_json::Value)> = vec![
                (
                    "http.request.method",
                    (if get { "GET" } else { "POST" }).into(),
                ),
                ("url.path", "/mcp".into()),
                ("http.response.status_code", status.into()),
                ("client.address", "127.0.0.1".into()),
                (
                    "user_agent.original",
                    (if get { "probe/1.0 _q_" } else { "-" }).into(),
                ),
                (
                    "trace_id",
                    (if get {
                        "4bf92f3577b34da6a3ce929d0e0e4736"
                    } else {
                        "-"
                    })
                    .into(),
                ),
                (
                    "mcp.method.name",
                    (if get { "-" } else { "tools/call" }).into(),
                ),
                ("gen_ai.tool.name", (if get { "-" } else { "echo" }).into()),
                (
                    "error.type",
                    (if get {
                        "unknown-session"
                    } else {
                        "upstream-unavailable"
                    })
                    .into(),
                ),
                ("upstream.address", "-".into()),
            ];
            if format == "json" {
                let v: serde_json::Value = serde_json::from_str(&line).expect("one JSON object");
                assert_eq!(v["level"], "INFO", "{line}");
                assert_eq!(v["message"], "request finished", "{line}");
                for (field, value) in &want {
                    assert_eq!(&v[*field], value, "{field}: {line}");
                }
                assert!(v["upstream.duration_ms"].is_null(), "{line}");
                for field in [
                    "timestamp",
                    "duration_ms",
                    "bytes",
                    "events",
                    "replayed",
                    "outcome",
                ] {
                    assert!(v.get(field).is_some(), "{field} missing: {line}");
                }
            } else {
                assert!(line.contains(" INFO request finished "), "{line}");
                for (field, value) in &want {
                    let shown = match value {
                        serde_json::Value::String(s) if *field == "http.request.method" => {
                            format!("{field}={s} ")
                        }
                        serde_json::Value::String(s) => format!("{field}=\"{s}\""),
                        other => format!("{field}={other} "),
                    };
                    assert!(line.contains(&shown), "{shown:?} missing: {line}");
                }
                assert!(line.contains("upstream.duration_ms=- "), "{line}");
                assert!(line.contains("outcome=\""), "{line}");
            }
        }
    }
}

/// Issue 24: with `--ready-upstream true`, `/readyz` is 503 while the upstream refuses
/// connections and 200 once it accepts them; without it, the upstream is not asked.
#[test]
fn readiness_can_follow_the_upstream() {
    let upstream = free_port();
    let gateway = Binary::start_blocking(upstream, &["--ready-upstream", "true"]);
    let (status, body) = http_get(gateway.admin, "/readyz").unwrap();
    assert_eq!((status, body.as_str()), (503, "upstream unreachable\n"));
    let plain = Binary::start_blocking(upstream, &[]);
    assert_eq!(http_get(plain.admin, "/readyz").unwrap().0, 200);
    let _listening = std::net::TcpListener::bind(upstream).unwrap();
    assert_eq!(
        http_get(gateway.admin, "/readyz").unwrap(),
        (200, "ready\n".into())
    );
}

/// The access line of a served stream counts it: a tool call's SSE answer (its events, how
/// it ended), the same answer upgraded from JSON (`--json-upgrade`, written whole with its
/// length), and a resume of the call (what was replayed). The counts travel from the route
/// to the line beside the response, so a route that forgot them would log `events=0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_lines_count_the_streams_served() {
    let mut mock = Mock::start().await;
    let mut gw = Binary::start(mock.addr, &["--log-format", "json"]).await;
    let sid = init_session(&gw.addr, &mut mock, "s1").await;
    // The access line of the next request finished with this method and MCP method, as JSON.
    async fn line_of(gw: &mut Binary, method: &str, mcp: &str) -> serde_json::Value {
        loop {
            match gw.proc.next_line(Duration::from_secs(10)).await {
                NextLine::Line(l) if l.contains("request finished") => {
                    let v: serde_json::Value = serde_json::from_str(&l).expect("a JSON line");
                    if v["http.request.method"] == method && v["mcp.method.name"] == mcp {
                        return v;
                    }
                }
                NextLine::Line(_) => {}
                other => panic!("no access line of a {method}: {other:?}"),
            }
        }
    }
    // A call answered by SSE: a progress notification, then the result.
    let (mut reader, writer) = start_call(&gw.addr, &mut mock, &sid, 7).await;
    writer.message(&progress(1)).await;
    writer.message(&result(7)).await;
    drop(writer);
    let events = reader.rest().await;
    assert_eq!(messages(&events), [progress(1), result(7)]);
    let called = line_of(&mut gw, "POST", "tools/call").await;
    assert_eq!(called["mcp.method.name"], "tools/call", "{called}");
    assert_eq!(called["events"], 2, "{called}");
    assert_eq!(called["replayed"], 0, "{called}");
    assert_eq!(called["outcome"], "completed", "{called}");
    // Its resume from the first event: the result replayed.
    let first = events[0].id.clone().expect("an id");
    let resp = send(gw.addr, get(&sid, Some(&first))).await;
    assert_eq!(resp.status(), 200);
    let resumed = SseReader::new(resp).rest().await;
    assert_eq!(messages(&resumed), [result(7)]);
    let resume = line_of(&mut gw, "GET", "-").await;
    assert_eq!(resume["replayed"], 1, "{resume}");
    assert!(resume["events"].as_u64().unwrap() >= 1, "{resume}");
    assert_eq!(resume["outcome"], "completed", "{resume}");
    // A JSON answer, upgraded: one event, written whole.
    let pending = tokio::spawn(send(gw.addr, post(&call(8), Some(&sid))));
    mock.next().await.respond_json(result(8));
    let resp = pending.await.unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert!(resp.headers().contains_key("content-length"));
    assert_eq!(messages(&SseReader::new(resp).rest().await), [result(8)]);
    let upgraded = line_of(&mut gw, "POST", "tools/call").await;
    assert_eq!(upgraded["events"], 1, "{upgraded}");
    assert_eq!(upgraded["outcome"], "completed", "{upgraded}");
}

/// Tool names are the client's text (issue 46): one with a quote, a newline and an escape
/// sequence neither forges a sample nor puts control bytes in the page, and a name takes one
/// of the `--metrics-tool-names` label slots only once the upstream answered its call with
/// success, so names a client makes up to fill them cannot keep a real tool out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_tool_names_neither_forge_samples_nor_keep_the_label_slots() {
    let mut mock = Mock::start().await;
    let gw = Binary::start(mock.addr, &["--metrics-tool-names", "1"]).await;
    let sid = init_session(&gw.addr, &mut mock, "s1").await;
    let hostile = "x\"} 1\nmcp_reattach_sessions 31337\n# \u{1b}[2J\u{1b}[31m";
    // Call `id` of `tool`, answered by the upstream with `status`, its body read to its end.
    async fn call_tool(gw: &Binary, mock: &mut Mock, sid: &str, id: u64, tool: &str, status: u16) {
        use http_body_util::BodyExt;
        let body = serde_json::json!({
            "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool}
        })
        .to_string();
        let pending = tokio::spawn(send(gw.addr, post(&body, Some(sid))));
        mock.next()
            .await
            .respond(json_response(status, &[], result(id)));
        let resp = pending.await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
            .await
            .expect("the answer ends")
            .expect("the answer's body");
    }
    call_tool(&gw, &mut mock, &sid, 1, hostile, 200).await;
    // Refused by the upstream: no slot, whatever the name.
    call_tool(&gw, &mut mock, &sid, 2, "made_up", 403).await;
    call_tool(&gw, &mut mock, &sid, 3, "search", 200).await;
    // The counts are written when each response's log ends: a few scrapes at most.
    let mut text = String::new();
    for _ in 0..50 {
        text = scrape_metrics(gw.admin).await.1;
        if metric_sum(&text, "mcp_reattach_tool_calls_total") == Some(3.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("{text}");
    let admin = gw.admin;
    let open = tokio::task::spawn_blocking(move || {
        http_get_accept(admin, "/metrics", "application/openmetrics-text").unwrap()
    })
    .await
    .unwrap()
    .1;
    for page in [&text, &open] {
        assert!(
            !page
                .lines()
                .any(|l| l.starts_with("mcp_reattach_sessions 31337")),
            "a tool name forged a sample:\n{page}"
        );
        assert!(
            !page.bytes().any(|b| b.is_ascii_control() && b != b'\n'),
            "control bytes in the page:\n{page:?}"
        );
    }
    assert_eq!(metric(&open, "mcp_reattach_sessions"), 1.0);
    assert_eq!(metric(&text, "mcp_reattach_sessions"), 1.0);
    assert_eq!(
        metric(&text, "mcp_reattach_tool_calls_total{tool=\"search\"}"),
        1.0,
        "the first name the upstream answered holds the slot:\n{text}"
    );
    assert_eq!(
        metric(&text, "mcp_reattach_tool_calls_total{tool=\"other\"}"),
        2.0
    );
    match promtool_check(&text) {
        Some((ok, out)) => {
            assert!(ok, "promtool check metrics failed:\n{out}");
            eprintln!("promtool check metrics: OK {out}");
        }
        None => {
            assert!(
                std::env::var_os("CI_REQUIRE_PROMTOOL").is_none(),
                "promtool is required in CI"
            );
            eprintln!("promtool not installed; skipped the promtool check (CI installs it)");
        }
    }
}
