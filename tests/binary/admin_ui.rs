//! The operators' page `/ui` of the admin listener in a real browser: Debian's headless
//! Chromium, driven by playwright-core (`tests/interop/ui-check.mjs`), against the real binary
//! and the sessions real requests made through it.
//!
//! Two gateways in front of the mock upstream: one with an open loopback admin listener,
//! holding three sessions (one with a call streaming and its standalone stream open, one whose
//! call was answered, one whose client sent markup as its `MCP-Protocol-Version`), and one
//! with `--admin-token-file` and `--admin-token-for-reads true`, holding one. The script
//! checks, with JavaScript off: the `#sessions` table has one row per session of `GET
//! /sessions`, every cell as the JSON says, no `<script>`, laid out with a size; a click on
//! the busy session's id opens its page, whose facts and `#streams` rows are `GET
//! /sessions/{id}`'s, and "All sessions" leads back; an unknown id renders the 404 page and a
//! bad one the 400 page. With JavaScript on, a client's markup sent as its protocol version
//! is not kept (issue 56, R5-2: no page shows it) and the list makes no element of anything
//! (a control shows the same markup unescaped does run). On the guarded listener the
//! page without credentials is a 401 with a Basic challenge, a wrong password is refused, and
//! the token as the Basic password (what a browser sends after the challenge) shows the page.
//! Screenshots go to this test's temp dir.
//!
//! Needs Node.js >= 20 (playwright-core), the npm packages of `tests/interop` (installed on
//! first use) and Debian's `chromium` (`/usr/bin/chromium`, or `$CHROMIUM`): without it the
//! test says it skipped, unless `CI_REQUIRE_CHROMIUM` is set (CI installs it).

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::*;

/// What a client sends as its protocol version: every character the page must escape, an
/// element with a handler that runs if it is not, and an entity that must not be decoded.
const HOSTILE: &str = "\"'><img src=x onerror=alert(1)><b>&amp;</b>";

/// The admin token of the guarded gateway.
const TOKEN: &str = "ui-test-token-0123456789abcdef";

/// How long the browser script may take (it takes a few seconds).
const SCRIPT_LIMIT: Duration = Duration::from_secs(45);

/// Debian's Chromium (`$CHROMIUM`, else `/usr/bin/chromium`), or `None` after saying the test
/// skipped; with `CI_REQUIRE_CHROMIUM` set, a missing Chromium fails the test instead.
fn chromium_or_skip(test: &str) -> Option<PathBuf> {
    let bin =
        std::env::var_os("CHROMIUM").map_or_else(|| "/usr/bin/chromium".into(), PathBuf::from);
    let runs = std::process::Command::new(&bin)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout.starts_with(b"Chromium"));
    if runs {
        return Some(bin);
    }
    assert!(
        std::env::var_os("CI_REQUIRE_CHROMIUM").is_none(),
        "Chromium is required (CI_REQUIRE_CHROMIUM is set) but `{} --version` did not run: \
         install the Debian package `chromium` (.ci/run does) or set CHROMIUM=/path/to/chromium",
        bin.display()
    );
    eprintln!(
        "\n*** SKIPPED {test}: Debian's Chromium is not installed (apt-get install -y chromium; \
         CI installs it and sets CI_REQUIRE_CHROMIUM=1) ***\n"
    );
    None
}

/// Panics unless Node.js >= 20 runs: playwright-core needs it.
fn require_node20() {
    let out = std::process::Command::new(node_bin())
        .arg("--version")
        .output()
        .expect("running node --version");
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        node_major(&version) >= 20,
        "playwright-core needs Node.js >= 20; `node --version` is {version:?} (set NODE=...)"
    );
}

/// GET `path` of an admin listener as JSON (with `token` as a Bearer token if given).
async fn admin_json(admin: std::net::SocketAddr, path: &str, token: Option<&str>) -> Value {
    let mut req = http_client()
        .get(format!("http://{admin}{path}"))
        .timeout(Duration::from_secs(5));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.expect("an admin answer");
    assert_eq!(resp.status(), 200, "GET {path}");
    resp.json().await.expect("JSON")
}

/// A request of session `sid` the mock answers with a JSON result, carrying `version` as its
/// `MCP-Protocol-Version`: what the session then reports as its protocol version.
async fn ping_with_version(gw: &Binary, mock: &mut Mock, sid: &str, version: &str) {
    let mut req = post(r#"{"jsonrpc":"2.0","id":7,"method":"ping"}"#, Some(sid));
    req.headers_mut()
        .insert("mcp-protocol-version", version.parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, req));
    mock.next()
        .await
        .respond_json(r#"{"jsonrpc":"2.0","id":7,"result":{}}"#);
    assert_eq!(pending.await.unwrap().status(), 200);
}

/// Opens the standalone stream (`GET`) of session `sid`, answered by the mock with an SSE
/// stream it keeps open; returns the client's reader and the upstream's writer.
async fn open_standalone(gw: &Binary, mock: &mut Mock, sid: &str) -> (SseReader, SseWriter) {
    let pending = tokio::spawn(send(gw.addr, get(sid, None)));
    let seen = mock.next().await;
    assert_eq!(seen.method, http::Method::GET);
    let writer = seen.respond_sse(Some(sid));
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    (SseReader::new(resp), writer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sessions_page_in_headless_chromium() {
    let test = "admin_ui::the_sessions_page_in_headless_chromium";
    let Some(chromium) = chromium_or_skip(test) else {
        return;
    };
    tokio::task::spawn_blocking(|| {
        ensure_npm_deps();
        require_node20();
    })
    .await
    .unwrap();
    let started = Instant::now();
    let out =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("admin-ui-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let token_file = out.join("admin.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();

    let mut mock = Mock::start().await;
    let open = Binary::start(mock.addr, &[]).await;
    let guarded = Binary::try_start(
        "guarded",
        mock.addr,
        &[
            "--admin-token-file",
            token_file.to_str().unwrap(),
            "--admin-token-for-reads",
            "true",
        ],
        "/healthz",
    )
    .await
    .unwrap_or_else(|e| panic!("the guarded gateway did not start: {e}"));

    // A session with a slow call streaming (one progress event so far, its client attached)
    // and its standalone stream open.
    init_session(&open.addr, &mut mock, "s-busy").await;
    let (mut busy, busy_up) = start_call(&open.addr, &mut mock, "s-busy", 1).await;
    busy_up.message(&progress(1)).await;
    assert!(busy
        .next()
        .await
        .unwrap()
        .data
        .unwrap()
        .contains("progress"));
    let (_standalone, _standalone_up) = open_standalone(&open, &mut mock, "s-busy").await;
    // A session whose call was answered: its streams have ended.
    init_session(&open.addr, &mut mock, "s-done").await;
    let (mut done, done_up) = start_call(&open.addr, &mut mock, "s-done", 2).await;
    done_up.message(&result(2)).await;
    drop(done_up);
    assert_eq!(messages(&done.rest().await), vec![result(2)]);
    // A session whose client sent markup as its protocol version. The header is the one field
    // of the page a client sets freely: the version an `initialize` names (header or body)
    // gives way to the one the upstream answers, and a path with `<` never makes a session
    // (hyper answers 400).
    init_session(&open.addr, &mut mock, "s-hostile").await;
    ping_with_version(&open, &mut mock, "s-hostile", HOSTILE).await;
    // The guarded gateway's session, a call streaming.
    init_session(&guarded.addr, &mut mock, "s-guarded").await;
    let (_guarded_call, _guarded_up) = start_call(&guarded.addr, &mut mock, "s-guarded", 3).await;

    // What the JSON says before the browser looks: the scenario is the one described.
    let listing = admin_json(open.admin, "/sessions", None).await;
    let sessions = listing["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 3, "{listing}");
    let states = |s: &Value| -> Vec<String> {
        s["streams"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| {
                format!(
                    "{}:{}",
                    x["kind"].as_str().unwrap(),
                    x["state"].as_str().unwrap()
                )
            })
            .collect()
    };
    let busy_view = sessions
        .iter()
        .find(|s| states(s).contains(&"standalone:running".to_owned()))
        .unwrap_or_else(|| panic!("no session with its standalone stream running: {listing}"));
    assert!(
        states(busy_view).contains(&"post:running".to_owned()),
        "{busy_view}"
    );
    assert_eq!(busy_view["attached_clients"], 2, "{busy_view}");
    // Issue 56, R5-2: a protocol version that is not 1-32 bytes of [A-Za-z0-9._-] is never
    // kept, so the hostile one reaches no page (the escaping itself: src/admin/ui.rs's test).
    assert!(
        !sessions.iter().any(|s| s["protocol_version"] == HOSTILE),
        "a client's hostile version is kept: {listing}"
    );
    let guarded_listing = admin_json(guarded.admin, "/sessions", Some(TOKEN)).await;
    assert_eq!(guarded_listing["sessions"].as_array().unwrap().len(), 1);

    let cfg = serde_json::json!({
        "chromium": chromium,
        "open": format!("http://{}", open.admin),
        "guarded": format!("http://{}", guarded.admin),
        "token": TOKEN,
        "hostile": HOSTILE,
        "out": out,
    })
    .to_string();
    let mut script = ChildProc::spawn_node("ui-check", "ui-check.mjs", &[&cfg]);
    let mut lines = Vec::new();
    let verdict = loop {
        match script.next_line(SCRIPT_LIMIT).await {
            NextLine::Line(l) if l.starts_with("RESULT ") || l.starts_with("FAILED ") => break l,
            NextLine::Line(l) => lines.push(l),
            end => {
                break format!(
                    "FAILED the script printed no verdict ({end:?}); stderr:\n{}",
                    script.stderr_lines().join("\n")
                )
            }
        }
    };
    let status = script.wait_exit(Duration::from_secs(10)).await;
    let Some(result) = verdict.strip_prefix("RESULT ") else {
        panic!("the browser check failed: {verdict}\nstdout before it: {lines:?}");
    };
    assert!(
        status.is_some_and(|s| s.success()),
        "ui-check.mjs exited {status:?}"
    );
    let r: Value = serde_json::from_str(result).expect("RESULT is JSON");

    // What the browser saw, against what this test made.
    assert_eq!(r["rows"], 3, "{r}");
    assert_eq!(r["clicked"]["id"], busy_view["id"], "{r}");
    let streams: Vec<&str> = r["clicked"]["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert!(
        streams
            .iter()
            .any(|s| s.ends_with(":post:running:attached"))
            && streams
                .iter()
                .any(|s| s.ends_with(":standalone:running:attached")),
        "{streams:?}"
    );
    assert_eq!(r["hostile"]["kept"], false, "{r}");
    assert_eq!(
        (
            &r["hostile"]["img"],
            &r["hostile"]["b"],
            &r["hostile"]["dialogs"]
        ),
        (&Value::from(0), &Value::from(0), &Value::from(0)),
        "{r}"
    );
    assert_eq!(r["errors"]["/ui/sessions/0123456789abcdef"], 404, "{r}");
    assert_eq!(r["errors"]["/ui/sessions/not-a-session"], 400, "{r}");
    assert_eq!(r["guarded"]["without"][0], 401, "{r}");
    assert_eq!(r["guarded"]["wrong"][0], 401, "{r}");
    assert_eq!(r["guarded"]["with"], serde_json::json!([200, 1]), "{r}");
    println!(
        "SUMMARY admin_ui: {browser}; JS off: /ui {rows} rows = GET /sessions, no script, \
         table {w}x{h} px; clicked {id}: streams {streams} = GET /sessions/{{id}}, back ok; \
         hostile version not kept (0 img, 0 b, 0 dialogs; unescaped control ran); \
         404/400 pages ok; guarded: {g0} Basic challenge, wrong password {wrong}, token 200; \
         {checks} checks in {total:.1} s; screenshots in {out}",
        browser = r["browser"].as_str().unwrap_or("?"),
        rows = r["rows"],
        w = r["table_px"][0],
        h = r["table_px"][1],
        id = r["clicked"]["id"].as_str().unwrap_or("?"),
        streams = streams.join(" "),
        g0 = r["guarded"]["without"][0],
        wrong = r["guarded"]["wrong"][0],
        checks = r["checks"],
        total = started.elapsed().as_secs_f64(),
        out = out.display(),
    );
    drop((busy, busy_up));
}
