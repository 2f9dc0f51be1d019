//! Operators see and end sessions on the admin listener (issue 50): real gateway binaries in
//! front of the scriptable mock upstream, on 127.0.0.1 only.
//!
//! - `GET /sessions` lists every session by its label, with its running call's stream, and
//!   never a session id; `GET /sessions/{id}` shows one; `mcp-reattach sessions list|show`
//!   print the same.
//! - `DELETE /sessions/{id}` (or `mcp-reattach sessions end`) ends a session as its client's
//!   `DELETE` would: upstream too, and its running call's client is told.
//! - `--admin-token-file` guards ending, and with `--admin-token-for-reads` reading; without
//!   it, an admin listener off loopback refuses to end anything.
//! - With a shared store the list covers the fleet, and any replica ends a session another
//!   one holds (the `/ui` page in a browser: `tests/binary/admin_ui.rs`).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::time::Duration;

use serde_json::Value;
use support::*;

/// A request to the admin listener of `b`: status, `www-authenticate`, body.
async fn admin(
    b: &Binary,
    method: reqwest::Method,
    path: &str,
    auth: Option<&str>,
) -> (u16, Option<String>, String) {
    let mut req = http_client()
        .request(method, format!("http://{}{path}", b.admin))
        .timeout(Duration::from_secs(5));
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let resp = req.send().await.expect("the admin listener answers");
    let status = resp.status().as_u16();
    let challenge = resp
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, challenge, resp.text().await.unwrap())
}

async fn listing(b: &Binary) -> Value {
    let (status, _, body) = admin(b, reqwest::Method::GET, "/sessions", None).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// `mcp-reattach <args>`: exit code, stdout, stderr.
async fn cli(args: &[&str]) -> (i32, String, String) {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let run = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_mcp-reattach"))
            .args(&args)
            .output()
            .expect("the CLI runs")
    });
    let out = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the CLI ends")
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The session whose stream list holds a stream numbered `n`... or the one labelled `id`.
fn by_id<'a>(l: &'a Value, id: &str) -> &'a Value {
    l["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == id)
        .unwrap_or_else(|| panic!("no session {id} in {l}"))
}

/// Starts call `id` of `sid` through `gw` with a protocol version header, its first progress
/// event read by the client.
async fn running_call(gw: &Binary, mock: &mut Mock, sid: &str, id: u64) -> (SseReader, SseWriter) {
    let mut req = post(&call(id), Some(sid));
    req.headers_mut()
        .insert("mcp-protocol-version", "2025-06-18".parse().unwrap());
    let pending = tokio::spawn(send(gw.addr, req));
    let upstream = mock.next().await.respond_sse(Some(sid));
    let mut reader = SseReader::new(pending.await.unwrap());
    upstream.message(&progress(1)).await;
    loop {
        let e = reader.next().await.unwrap();
        if e.data.is_some() {
            break;
        }
    }
    (reader, upstream)
}

/// The label of the one session in `l` that has a running stream.
fn running_label(l: &Value) -> String {
    l["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| {
            s["streams"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x["state"] == "running")
        })
        .unwrap_or_else(|| panic!("no session with a running stream in {l}"))["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

const SECRET_1: &str = "session-id-never-shown-to-operators-1";
const SECRET_2: &str = "session-id-never-shown-to-operators-2";

#[tokio::test]
async fn an_operator_sees_sessions_and_running_calls_never_their_ids() {
    let mut mock = Mock::start().await;
    let gw = Binary::start(mock.addr, &["--hold-standalone", "false"]).await;
    init_session(&gw.addr, &mut mock, SECRET_1).await;
    init_session(&gw.addr, &mut mock, SECRET_2).await;
    let (_reader, upstream) = running_call(&gw, &mut mock, SECRET_1, 7).await;

    let l = listing(&gw).await;
    assert_eq!(l["fleet"], false);
    assert_eq!(l["sessions"].as_array().unwrap().len(), 2, "{l}");
    let label = running_label(&l);
    assert!(
        label.len() == 16 && label.bytes().all(|b| b.is_ascii_hexdigit()),
        "{label}"
    );
    let s = by_id(&l, &label);
    assert_eq!(s["shape"], "upstream");
    assert_eq!(s["endpoint"], "/mcp");
    assert_eq!(s["protocol_version"], "2025-06-18");
    assert_eq!(s["attached_clients"], 1);
    let stream = &s["streams"].as_array().unwrap()[1];
    assert_eq!(stream["kind"], "post", "{s}");
    assert_eq!(stream["state"], "running");
    assert_eq!(stream["attached"], true);
    assert_eq!(stream["pending_requests"], 1);
    assert!(stream["window_events"].as_u64().unwrap() >= 1, "{stream}");

    // One session by its label; a label nobody holds; not a label.
    let (status, _, one) = admin(
        &gw,
        reqwest::Method::GET,
        &format!("/sessions/{label}"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let one: Value = serde_json::from_str(&one).unwrap();
    assert_eq!(one["sessions"][0]["id"], label.as_str());
    assert_eq!(one["sessions"].as_array().unwrap().len(), 1);
    let (status, _, _) = admin(
        &gw,
        reqwest::Method::GET,
        "/sessions/0123456789abcdef",
        None,
    )
    .await;
    assert_eq!(status, 404);
    let (status, _, body) = admin(
        &gw,
        reqwest::Method::GET,
        &format!("/sessions/{SECRET_1}"),
        None,
    )
    .await;
    assert_eq!(status, 400, "a raw id is not a label: {body}");

    // The CLI prints the same sessions.
    let url = format!("http://{}", gw.admin);
    let (code, table, err) = cli(&["sessions", "--admin", &url, "list"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(table.starts_with("ID "), "{table}");
    for s in l["sessions"].as_array().unwrap() {
        assert!(table.contains(s["id"].as_str().unwrap()), "{table}");
    }
    assert!(table.contains("2 sessions on "), "{table}");
    let (code, shown, err) = cli(&["sessions", "--admin", &url, "show", &label]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        shown.contains(&format!("id:               {label}")),
        "{shown}"
    );
    assert!(
        shown
            .lines()
            .any(|l| l.contains("post") && l.contains("running") && l.contains("attached")),
        "{shown}"
    );
    let (code, json, _) = cli(&["sessions", "--admin", &url, "--json", "show", &label]).await;
    assert_eq!(code, 0);
    assert_eq!(serde_json::from_str::<Value>(&json).unwrap(), one);

    // The page runs no script and is framed nowhere, whatever it shows.
    let page = http_client()
        .get(format!("http://{}/ui", gw.admin))
        .send()
        .await
        .unwrap();
    let csp = page.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.starts_with("default-src 'none'"), "{csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert_eq!(page.headers()["x-content-type-options"], "nosniff");

    // Never a session id, anywhere an operator looks.
    let ui = gw.admin_get("/ui").await.unwrap();
    let ui_one = gw
        .admin_get(&format!("/ui/sessions/{label}"))
        .await
        .unwrap();
    for (what, text) in [
        ("/sessions", l.to_string()),
        ("/sessions/{id}", one.to_string()),
        ("/ui", ui),
        ("/ui/sessions/{id}", ui_one),
        ("sessions list", table),
        ("sessions show", shown),
    ] {
        for secret in [SECRET_1, SECRET_2] {
            assert!(!text.contains(secret), "{what} shows a session id: {text}");
        }
    }
    drop(upstream);
}

#[tokio::test]
async fn ending_a_session_ends_it_upstream_and_tells_its_running_call() {
    let mut mock = Mock::start().await;
    let gw = Binary::start(mock.addr, &["--hold-standalone", "false"]).await;
    init_session(&gw.addr, &mut mock, SECRET_1).await;
    let (mut reader, _upstream) = running_call(&gw, &mut mock, SECRET_1, 7).await;
    let label = running_label(&listing(&gw).await);

    let url = format!("http://{}", gw.admin);
    let ending =
        tokio::spawn(async move { cli(&["sessions", "--admin", &url, "end", &label]).await });
    // The upstream is told, with the session's id.
    let seen = mock.next().await;
    assert_eq!(seen.method, http::Method::DELETE);
    assert_eq!(seen.headers["mcp-session-id"], SECRET_1);
    seen.respond_json("");
    let (code, out, err) = ending.await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("ended "), "{out}");

    // The running call's client learns that it will get no answer.
    let mut told = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_secs(5), reader.next()).await {
        told.push(e);
        if told
            .iter()
            .any(|e| e.data.as_deref().is_some_and(|d| d.contains("\"id\":7")))
        {
            break;
        }
    }
    assert!(
        told.iter().any(|e| e
            .data
            .as_deref()
            .is_some_and(|d| d.contains("session-closed"))),
        "{told:?}"
    );
    assert!(
        told.iter().any(|e| e
            .data
            .as_deref()
            .is_some_and(|d| d.contains("\"id\":7") && d.contains("\"error\""))),
        "{told:?}"
    );

    assert!(listing(&gw).await["sessions"]
        .as_array()
        .unwrap()
        .is_empty());
    let text = gw.admin_get("/metrics").await.unwrap();
    assert_eq!(
        metric_sum(
            &text,
            "mcp_reattach_session_evictions_total{reason=\"admin\"}"
        ),
        Some(1.0)
    );
    // Once ended, it is nobody's to end again.
    let url = format!("http://{}", gw.admin);
    let (code, _, err) = cli(&["sessions", "--admin", &url, "end", "0123456789abcdef"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("404"), "{err}");
}

#[tokio::test]
async fn the_admin_token_guards_ending_and_reading_when_asked() {
    let token = "operator-token-0123456789";
    let file = key_file("admin-token", 0);
    std::fs::write(&file, format!("{token}\n")).unwrap();
    let file = file.to_str().unwrap();
    let mut mock = Mock::start().await;
    let gw = Binary::start(
        mock.addr,
        &["--hold-standalone", "false", "--admin-token-file", file],
    )
    .await;
    init_session(&gw.addr, &mut mock, SECRET_1).await;
    let label = listing(&gw).await["sessions"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/sessions/{label}");

    // Reading is open; ending needs the token.
    let (status, challenge, _) = admin(&gw, reqwest::Method::DELETE, &path, None).await;
    assert_eq!(status, 401);
    assert!(challenge.unwrap().starts_with("Basic realm="));
    let (status, _, _) = admin(
        &gw,
        reqwest::Method::DELETE,
        &path,
        Some("Bearer not-the-token"),
    )
    .await;
    assert_eq!(status, 401);
    assert_eq!(listing(&gw).await["sessions"].as_array().unwrap().len(), 1);
    let url = format!("http://{}", gw.admin);
    let (code, _, err) = cli(&["sessions", "--admin", &url, "end", &label]).await;
    assert_eq!(code, 1, "the CLI without the token is refused");
    assert!(err.contains("401"), "{err}");
    let ending = tokio::spawn({
        let url = url.clone();
        let label = label.clone();
        let file = file.to_owned();
        async move {
            cli(&[
                "sessions",
                "--admin",
                &url,
                "--admin-token-file",
                &file,
                "end",
                &label,
            ])
            .await
        }
    });
    mock.next().await.respond_json("");
    let (code, _, err) = ending.await.unwrap();
    assert_eq!(code, 0, "{err}");

    // With --admin-token-for-reads, reading needs it too; probes and metrics never do.
    let reads = Binary::start(
        mock.addr,
        &[
            "--admin-token-file",
            file,
            "--admin-token-for-reads",
            "true",
        ],
    )
    .await;
    for p in ["/sessions", "/ui"] {
        let (status, challenge, _) = admin(&reads, reqwest::Method::GET, p, None).await;
        assert_eq!(status, 401, "{p}");
        assert!(challenge.is_some());
        let (status, _, _) = admin(
            &reads,
            reqwest::Method::GET,
            p,
            Some(&format!("Bearer {token}")),
        )
        .await;
        assert_eq!(status, 200, "{p}");
    }
    for p in ["/healthz", "/readyz", "/metrics"] {
        assert!(reads.admin_get(p).await.is_ok(), "{p}");
    }

    // A token too short to be one does not start the gateway.
    let short = key_file("admin-token-short", 8);
    let refused = Binary::try_start(
        "gateway",
        mock.addr,
        &["--admin-token-file", short.to_str().unwrap()],
        "/healthz",
    )
    .await
    .err()
    .expect("a short token is refused");
    assert_eq!(refused.code, Some(64), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("--admin-token-file"),
        "{}",
        refused.stderr
    );
}

/// Spawns a gateway in front of `mock` whose admin listener is off loopback (`0.0.0.0`), with
/// `extra` flags, and waits until it answers: (the process, its proxy address, the admin
/// listener's base URL through 127.0.0.1).
async fn exposed_gateway(mock: &Mock, extra: &[&str]) -> (ChildProc, std::net::SocketAddr, String) {
    // The launcher binds the admin listener to loopback: this one is spawned by hand.
    let (listen, port) = (free_port(), free_port().port());
    let (upstream, listen_s, exposed) = (
        format!("http://{}", mock.addr),
        listen.to_string(),
        format!("0.0.0.0:{port}"),
    );
    let mut args = vec![
        "--upstream",
        &upstream,
        "--listen",
        &listen_s,
        "--admin-listen",
        &exposed,
        "--hold-standalone",
        "false",
    ];
    args.extend_from_slice(extra);
    let proc = ChildProc::spawn(
        "gateway",
        env!("CARGO_BIN_EXE_mcp-reattach"),
        &args,
        &repo_dir(),
    );
    let base = format!("http://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !http_client()
        .get(format!("{base}/healthz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gateway did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (proc, listen, base)
}

/// Issue 56, R5-4: an admin listener off loopback without a token reads nothing either (the
/// list was open to anyone who reached it), and with a token configured reading needs it
/// there even without `--admin-token-for-reads`. Probes and `/metrics` never need it.
#[tokio::test]
async fn an_admin_listener_off_loopback_without_a_token_reads_and_ends_nothing() {
    let mut mock = Mock::start().await;
    let (_proc, listen, base) = exposed_gateway(&mock, &[]).await;
    init_session(&listen, &mut mock, SECRET_1).await;
    for p in ["/sessions", "/ui", "/sessions/0123456789abcdef"] {
        let resp = http_client()
            .get(format!("{base}{p}"))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let body = resp.text().await.unwrap();
        assert_eq!(status, 403, "{p}: {body}");
        assert!(body.contains("--admin-token-file"), "{p}: {body}");
    }
    let resp = http_client()
        .delete(format!("{base}/sessions/0123456789abcdef"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    assert!(resp.text().await.unwrap().contains("--admin-token-file"));
    for p in ["/healthz", "/readyz", "/metrics"] {
        let resp = http_client()
            .get(format!("{base}{p}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{p}");
    }
    assert!(
        mock.nothing_within(Duration::from_millis(300)).await,
        "nothing reached the upstream"
    );

    // With a token, off loopback: reading needs it.
    let token = "operator-token-0123456789";
    let file = key_file("admin-token-exposed", 0);
    std::fs::write(&file, token).unwrap();
    let (_proc, _, base) =
        exposed_gateway(&mock, &["--admin-token-file", file.to_str().unwrap()]).await;
    for p in ["/sessions", "/ui"] {
        let resp = http_client()
            .get(format!("{base}{p}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401, "{p}");
        let resp = http_client()
            .get(format!("{base}{p}"))
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{p}");
    }
    for p in ["/healthz", "/readyz", "/metrics"] {
        let resp = http_client()
            .get(format!("{base}{p}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{p}");
    }
}

/// Issue 56, R5-10: with `--admin-token-file` and reads left open, a loopback listener still
/// answers an unauthenticated read only for a loopback `Host` (a DNS-rebinding page names its
/// own); the token is let in whatever the `Host`.
#[tokio::test]
async fn reads_left_open_beside_a_token_keep_the_rebinding_check() {
    let token = "operator-token-0123456789";
    let file = key_file("admin-token-rebinding", 0);
    std::fs::write(&file, token).unwrap();
    let mut mock = Mock::start().await;
    let gw = Binary::start(
        mock.addr,
        &[
            "--hold-standalone",
            "false",
            "--admin-token-file",
            file.to_str().unwrap(),
        ],
    )
    .await;
    init_session(&gw.addr, &mut mock, SECRET_1).await;
    let port = gw.admin.port();
    let get = |path: &'static str, host: String, auth: bool| {
        let mut req = http_client()
            .get(format!("http://{}{path}", gw.admin))
            .header("host", host);
        if auth {
            req = req.bearer_auth(token);
        }
        async move {
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            (status, resp.text().await.unwrap())
        }
    };
    for p in ["/sessions", "/ui"] {
        let (status, body) = get(p, format!("rebound.example:{port}"), false).await;
        assert_eq!(status, 403, "{p} for a rebound name: {body}");
        assert!(!body.contains(SECRET_1));
        let (status, _) = get(p, format!("127.0.0.1:{port}"), false).await;
        assert_eq!(status, 200, "{p} for loopback");
        let (status, _) = get(p, format!("localhost:{port}"), false).await;
        assert_eq!(status, 200, "{p} for localhost");
        let (status, _) = get(p, format!("rebound.example:{port}"), true).await;
        assert_eq!(status, 200, "{p} with the token");
    }
}

/// With a shared store: any replica lists the fleet's sessions and ends one another holds.
#[tokio::test]
async fn a_fleet_lists_and_ends_its_sessions_from_any_replica() {
    let Some(redis) = Redis::start("admin").await else {
        return;
    };
    let key = key_file("admin-fleet", 32);
    let mut mock = Mock::start().await;
    let store = |b: &Redis| {
        vec![
            "--store".to_owned(),
            b.url.clone(),
            "--store-key-file".to_owned(),
            key.to_str().unwrap().to_owned(),
            "--hold-standalone".to_owned(),
            "false".to_owned(),
        ]
    };
    let flags = store(&redis);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let a = Binary::start(mock.addr, &flags).await;
    let b = Binary::start(mock.addr, &flags).await;

    // One session created on A, its call running on B (which adopts it); one on B alone.
    init_session(&a.addr, &mut mock, SECRET_1).await;
    let (_reader, _upstream) = running_call(&b, &mut mock, SECRET_1, 7).await;
    init_session(&b.addr, &mut mock, SECRET_2).await;

    let from_a = listing(&a).await;
    let from_b = listing(&b).await;
    let (name_a, name_b) = (from_a["replica"].clone(), from_b["replica"].clone());
    assert_ne!(name_a, name_b);
    assert_eq!(from_a["fleet"], true);
    assert_eq!(from_a["replicas_asked"], 2, "{from_a}");
    assert_eq!(from_a["replicas"].as_array().unwrap().len(), 2, "{from_a}");
    assert_eq!(from_a["sessions"].as_array().unwrap().len(), 2, "{from_a}");
    // One label names one session on every replica.
    let shared = running_label(&from_a);
    assert_eq!(running_label(&from_b), shared);
    let s = by_id(&from_a, &shared);
    let mut replicas: Vec<_> = s["replicas"].as_array().unwrap().to_vec();
    replicas.sort_by_key(|v| v.to_string());
    let mut both = vec![name_a.clone(), name_b.clone()];
    both.sort_by_key(|v| v.to_string());
    assert_eq!(replicas, both, "{s}");
    let running = s["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["state"] == "running")
        .unwrap();
    assert_eq!(running["replica"], name_b, "the call is read by B: {s}");

    // A ends the session only B holds: B ends it upstream, once, and nobody holds it after.
    let only_b = from_a["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] != shared.as_str())
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/sessions/{only_b}");
    let ending = tokio::spawn({
        let a_admin = a.admin;
        let path = path.clone();
        async move {
            let resp = http_client()
                .delete(format!("http://{a_admin}{path}"))
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .unwrap();
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    });
    let seen = mock.next().await;
    assert_eq!(seen.method, http::Method::DELETE);
    assert_eq!(seen.headers["mcp-session-id"], SECRET_2);
    seen.respond_json("");
    let (status, ended) = ending.await.unwrap();
    assert_eq!(status, 200, "{ended}");
    assert_eq!(ended["by"], name_b);
    assert!(
        mock.nothing_within(Duration::from_millis(500)).await,
        "one DELETE upstream"
    );
    for r in [&a, &b] {
        let (status, _, _) = admin(r, reqwest::Method::GET, &path, None).await;
        assert_eq!(status, 404);
    }
    assert_eq!(listing(&a).await["sessions"].as_array().unwrap().len(), 1);
}

/// An admin listener of the test's own that answers every request with `head` and then
/// `body`, written `times` times (a hostile or broken gateway, as the CLI sees it).
async fn fake_admin(head: String, body: Vec<u8>, times: usize) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut tcp, _)) = listener.accept().await {
            let (head, body) = (head.clone(), body.clone());
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tcp.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                if tcp.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                for _ in 0..times {
                    if tcp.write_all(&body).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

/// Issue 56, R5-9: `sessions list|show` print what clients control (a protocol version, an
/// endpoint) with every control and invisible character escaped, so an answer cannot move the
/// operator's cursor, clear the screen or forge a row; `--json` prints JSON with them escaped
/// too.
#[tokio::test]
async fn the_cli_escapes_what_it_prints() {
    let hostile = serde_json::json!({
        "replica": "r\u{1b}]0;pwned\u{7}",
        "fleet": false,
        "replicas": ["r\u{1b}]0;pwned\u{7}"],
        "replicas_asked": 1,
        "sessions": [{
            "id": "0123456789abcdef",
            "principal": "0000000000000000",
            "shape": "upstream",
            "protocol_version": "2025\u{1b}[2J\u{1b}[1;1H\nffffffffffffffff  forged row\r",
            "endpoint": "/mcp\u{9b}31m\u{202e}",
            "created_ms": 0,
            "last_used_ms": 0,
            "attached_clients": 0,
            "window_events": 0,
            "window_bytes": 0,
            "streams": [{
                "number": 0, "kind": "post\u{8}\u{8}", "state": "running\u{7f}",
                "attached": false, "first_seq": 0, "last_seq": 0, "window_events": 0,
                "window_bytes": 0, "pending_requests": 0, "replica": "x\u{0}y"
            }],
            "replicas": ["r\u{1b}]0;pwned\u{7}"]
        }]
    });
    let body = hostile.to_string().into_bytes();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let url = fake_admin(head, body, 1).await;
    let clean = |what: &str, out: &str| {
        for c in out.chars() {
            assert!(
                c == '\n' || !(c.is_control() || ('\u{200b}'..='\u{206f}').contains(&c)),
                "{what} prints {c:?}: {out:?}"
            );
        }
    };
    let (code, table, err) = cli(&["sessions", "--admin", &url, "list"]).await;
    assert_eq!(code, 0, "{err}");
    clean("list", &table);
    assert_eq!(
        table.lines().count(),
        3,
        "a header, one row, the summary: {table}"
    );
    assert!(
        !table.lines().any(|l| l.starts_with("ffffffffffffffff")),
        "a forged row: {table}"
    );
    assert!(table.contains("2025\\u{1b}[2J"), "{table}");
    let (code, shown, err) = cli(&["sessions", "--admin", &url, "show", "0123456789abcdef"]).await;
    assert_eq!(code, 0, "{err}");
    clean("show", &shown);
    assert!(shown.contains("/mcp\\u{9b}31m\\u{202e}"), "{shown}");
    let (code, json, err) = cli(&["sessions", "--admin", &url, "--json", "list"]).await;
    assert_eq!(code, 0, "{err}");
    clean("--json list", &json);
    assert_eq!(serde_json::from_str::<Value>(&json).unwrap(), hostile);
}

/// Issue 56, R5-9: an answer past 16 MiB (64 MiB, chunked) is refused at 16 MiB, not read
/// whole (a hostile answer of 400 MiB took the CLI to 808 MiB).
#[tokio::test]
async fn the_cli_bounds_what_it_reads() {
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_owned();
    let mut chunk = format!("{:x}\r\n", 1 << 20).into_bytes();
    chunk.extend(std::iter::repeat_n(b' ', 1 << 20));
    chunk.extend_from_slice(b"\r\n");
    let url = fake_admin(head, chunk, 64).await;
    for json in [false, true] {
        let mut args = vec!["sessions", "--admin", &url];
        if json {
            args.push("--json");
        }
        args.push("list");
        let (code, out, err) = cli(&args).await;
        assert_eq!(code, 1, "{out:.200} {err}");
        assert!(err.contains("16 MiB"), "json {json}: {err}");
        assert!(out.len() < 1024, "json {json}: printed {} bytes", out.len());
    }
}

/// The flags of a replica of a fleet on `redis`, its secret in `key`.
fn fleet_flags(redis: &Redis, key: &std::path::Path) -> Vec<String> {
    vec![
        "--store".to_owned(),
        redis.url.clone(),
        "--store-key-file".to_owned(),
        key.to_str().unwrap().to_owned(),
        "--hold-standalone".to_owned(),
        "false".to_owned(),
    ]
}

/// Issue 56, R5-4: the fleet's list comes in pages (`?limit=`, at most 1000, then `cursor`
/// from `next_cursor`), one fleet question at a time per replica (another one meanwhile gets
/// 503 with `Retry-After`), and a burst of operators' reads leaves the request path's store
/// up.
#[tokio::test]
async fn a_fleet_lists_in_pages_one_question_at_a_time() {
    let Some(redis) = Redis::start("admin-pages").await else {
        return;
    };
    let key = key_file("admin-pages", 32);
    let mut mock = Mock::start().await;
    let flags = fleet_flags(&redis, &key);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let a = Binary::start(mock.addr, &flags).await;
    let b = Binary::start(mock.addr, &flags).await;
    init_session(&a.addr, &mut mock, SECRET_1).await;
    init_session(&b.addr, &mut mock, SECRET_2).await;
    init_session(&b.addr, &mut mock, "session-id-never-shown-to-operators-3").await;

    let all = listing(&a).await;
    assert_eq!(all["sessions"].as_array().unwrap().len(), 3, "{all}");
    assert!(all.get("next_cursor").is_none_or(Value::is_null), "{all}");

    // Pages of two: two, then the last one, every session once.
    let (status, _, first) = admin(&a, reqwest::Method::GET, "/sessions?limit=2", None).await;
    assert_eq!(status, 200, "{first}");
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["sessions"].as_array().unwrap().len(), 2, "{first}");
    let cursor = first["next_cursor"]
        .as_str()
        .expect("a next page")
        .to_owned();
    let (status, _, second) = admin(
        &a,
        reqwest::Method::GET,
        &format!("/sessions?limit=2&cursor={cursor}"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{second}");
    let second: Value = serde_json::from_str(&second).unwrap();
    assert_eq!(second["sessions"].as_array().unwrap().len(), 1, "{second}");
    assert!(
        second.get("next_cursor").is_none_or(Value::is_null),
        "{second}"
    );
    let mut seen: Vec<String> = [&first, &second]
        .iter()
        .flat_map(|l| l["sessions"].as_array().unwrap().iter())
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    seen.sort();
    let mut every: Vec<String> = all["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    every.sort();
    assert_eq!(seen, every);
    // A page larger than the most one may ask is refused, as is a cursor that is no label.
    for q in ["limit=100000", "limit=0", "limit=x", "cursor=nope"] {
        let (status, _, body) =
            admin(&a, reqwest::Method::GET, &format!("/sessions?{q}"), None).await;
        assert_eq!(status, 400, "{q}: {body}");
    }

    // Operators all at once: one fleet question at a time, the others told when to come back.
    let asks: Vec<_> = (0..8)
        .map(|_| {
            let admin = a.admin;
            tokio::spawn(async move {
                let resp = http_client()
                    .get(format!("http://{admin}/sessions"))
                    .timeout(Duration::from_secs(5))
                    .send()
                    .await
                    .unwrap();
                let retry = resp.headers().get("retry-after").cloned();
                (resp.status().as_u16(), retry)
            })
        })
        .collect();
    let mut busy = 0;
    for ask in asks {
        match ask.await.unwrap() {
            (200, _) => {}
            (503, Some(_)) => busy += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!(busy >= 1, "eight fleet questions at once, none paced");
    // The request path's store is untouched by them.
    let metrics = a.admin_get("/metrics").await.unwrap();
    assert_eq!(metric_sum(&metrics, "mcp_reattach_store_up"), Some(1.0));
    init_session(&a.addr, &mut mock, "session-id-never-shown-to-operators-4").await;
}

/// Issue 56, R5-11 (the admin channel): a message on `mra:admin` that no replica made (a
/// store writer's, without the fleet's secret) is dropped: a forged end ends nothing, a forged
/// question is not answered.
#[tokio::test]
async fn forged_admin_channel_messages_are_dropped() {
    let Some(redis) = Redis::start("admin-forged").await else {
        return;
    };
    let key = key_file("admin-forged", 32);
    let mut mock = Mock::start().await;
    let flags = fleet_flags(&redis, &key);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let a = Binary::start(mock.addr, &flags).await;
    let b = Binary::start(mock.addr, &flags).await;
    init_session(&b.addr, &mut mock, SECRET_1).await;
    let label = listing(&a).await["sessions"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();

    let mut store = ::redis::Client::open(redis.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let reply = "mra:{adm:forged}:answers";
    for op in ["end", "list"] {
        let forged = serde_json::json!({ "op": op, "label": label, "reply": reply }).to_string();
        let listeners: i64 = ::redis::cmd("PUBLISH")
            .arg("mra:admin")
            .arg(&forged)
            .query_async(&mut store)
            .await
            .unwrap();
        assert_eq!(listeners, 2, "both replicas listen");
    }
    assert!(
        mock.nothing_within(Duration::from_millis(1000)).await,
        "a forged end reached the upstream"
    );
    let answers: i64 = ::redis::cmd("LLEN")
        .arg(reply)
        .query_async(&mut store)
        .await
        .unwrap();
    assert_eq!(answers, 0, "a forged question was answered");
    assert_eq!(listing(&a).await["sessions"].as_array().unwrap().len(), 1);
    let metrics = b.admin_get("/metrics").await.unwrap();
    assert_eq!(
        metric_sum(
            &metrics,
            "mcp_reattach_session_evictions_total{reason=\"admin\"}"
        )
        .unwrap_or(0.0),
        0.0
    );
}

/// Issue 56, R5-4: operators' questions never count against the request path's store. The
/// store refuses this replica's questions (PUBLISH denied by an ACL): before, each refusal
/// was a failure of the requests' connection, and three took the store down for the replica
/// (`store_up` 0: resumes and claims went without it); now they fail alone.
#[tokio::test]
async fn operators_failing_questions_leave_the_request_path_up() {
    let Some(redis) = Redis::start("admin-breaker").await else {
        return;
    };
    let key = key_file("admin-breaker", 32);
    let mut mock = Mock::start().await;
    let flags = fleet_flags(&redis, &key);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let a = Binary::start(mock.addr, &flags).await;
    init_session(&a.addr, &mut mock, SECRET_1).await;
    let mut store = ::redis::Client::open(redis.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = ::redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("-publish")
        .query_async(&mut store)
        .await
        .unwrap();
    for _ in 0..5 {
        let (status, _, body) = admin(&a, reqwest::Method::GET, "/sessions", None).await;
        assert!(status == 200 || status == 503, "{status}: {body}");
    }
    let metrics = a.admin_get("/metrics").await.unwrap();
    assert_eq!(
        metric_sum(&metrics, "mcp_reattach_store_up"),
        Some(1.0),
        "operators' failed questions took the store down for the requests"
    );
    assert_eq!(
        metric_sum(&metrics, "mcp_reattach_store_errors_total").unwrap_or(0.0),
        0.0
    );
}
