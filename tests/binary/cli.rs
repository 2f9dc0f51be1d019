//! The binary's command line: help text grouped under headings, exit code 64 for bad
//! configuration, env vars (and errors naming them), listen spellings, upstream URLs (and their
//! credentials never shown).
// The binary is a real process, timed with std's clock.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mcp-reattach"))
}

#[test]
fn help_states_units_and_defaults() {
    let out = bin().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--listen",
        "[default: 0.0.0.0:8080]",
        "--window-bytes",
        "[default: 1MiB]",
        "[default: 5m]",
        "--max-sessions",
        "--keepalive",
        "0 disables",
        "--retry-hint",
        "--stall-timeout",
        "--priming",
        "MCP_REATTACH_UPSTREAM",
        "duration",
        "size",
        "demo",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
}

#[test]
fn invalid_values_exit_64_naming_the_flag() {
    for (args, flag) in [
        (
            vec!["--upstream", "http://127.0.0.1:1", "--window-bytes", "lots"],
            "--window-bytes",
        ),
        (
            vec!["--upstream", "http://127.0.0.1:1", "--session-ttl", "5"],
            "--session-ttl",
        ),
        (vec!["--upstream", "ftp://x"], "--upstream"),
        (
            vec!["--upstream", "http://127.0.0.1:1", "--priming", "sometimes"],
            "--priming",
        ),
        (
            vec!["--upstream", "http://127.0.0.1:1", "--window-events", "0"],
            "--window-events",
        ),
        // Issue 22 item 7: a window of one event cannot flow (its in-flight reserve is the
        // whole window: 50 events took 78 s).
        (
            vec!["--upstream", "http://127.0.0.1:1", "--window-events", "1"],
            "--window-events",
        ),
        (
            vec!["--upstream", "http://127.0.0.1:1", "--log-level", "[[["],
            "--log-level",
        ),
        (vec![], "--upstream"),
    ] {
        let out = bin()
            .args(&args)
            .env_remove("MCP_REATTACH_UPSTREAM")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(64), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn flags_are_read_from_the_environment() {
    let out = bin()
        .env("MCP_REATTACH_UPSTREAM", "http://127.0.0.1:1")
        .env("MCP_REATTACH_KEEPALIVE", "soon")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--keepalive"));
}

#[test]
fn listen_address_in_use_exits_64() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = bin()
        .args([
            "--upstream",
            "http://127.0.0.1:1",
            "--listen",
            &addr,
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--listen"));
}

// ---------------------------------------------------------------------------------------------
// Issue 24: what an operator expects on day one
// ---------------------------------------------------------------------------------------------

/// How long a refused start may take; a binary still running then was not refused.
const REFUSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs the binary on loopback ports (unless `args` name others) with `envs` and no
/// MCP_REATTACH_* of this process, expecting it to refuse to start: (exit code, stderr).
/// `None`: it was still running after [`REFUSE_LIMIT`] (it is killed then).
fn refused(args: &[&str], envs: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = bin();
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("MCP_REATTACH_") {
            cmd.env_remove(k);
        }
    }
    let given = |flag: &str| {
        args.iter()
            .any(|a| a == &flag || a.starts_with(&format!("{flag}=")))
            || envs.iter().any(|(k, _)| {
                *k == format!(
                    "MCP_REATTACH_{}",
                    flag[2..].replace('-', "_").to_uppercase()
                )
            })
    };
    if !given("--listen") {
        cmd.args(["--listen", "127.0.0.1:0"]);
    }
    if !given("--admin-listen") {
        cmd.args(["--admin-listen", "127.0.0.1:0"]);
    }
    let mut child = cmd
        .args(args)
        .envs(envs.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let deadline = std::time::Instant::now() + REFUSE_LIMIT;
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    (code, reader.join().unwrap())
}

/// The binary, running, its stdout (the log) read line by line; killed on drop.
struct Running {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Running {
    fn start(args: &[&str]) -> Running {
        let mut child = bin()
            .args(args)
            .env_remove("MCP_REATTACH_LISTEN")
            .env_remove("MCP_REATTACH_ADMIN_LISTEN")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
                let Ok(l) = line else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Running { child, lines }
    }

    /// The first log line containing `needle`, within 10 s.
    fn line(&mut self, needle: &str) -> String {
        let deadline = std::time::Instant::now() + REFUSE_LIMIT;
        let mut seen = Vec::new();
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return l,
                Ok(l) => seen.push(l),
                Err(_) => break,
            }
        }
        panic!(
            "no log line with {needle:?}; exit {:?}; lines: {seen:#?}",
            self.child.try_wait()
        );
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The flags of `--help` by heading (the line ending in `:` above them): (heading, flag, its
/// line and help text up to the next flag).
fn help_sections(help: &str) -> Vec<(String, String, String)> {
    let mut out: Vec<(String, String, String)> = Vec::new();
    let mut heading = String::new();
    for line in help.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            heading = line.trim_end_matches(':').to_owned();
            continue;
        }
        let t = line.trim_start();
        if t.starts_with('-') && line.len() - t.len() <= 6 {
            let flag = t
                .split([' ', ','])
                .find(|w| w.starts_with("--"))
                .unwrap_or(t)
                .to_owned();
            out.push((heading.clone(), flag, format!("{t} ")));
        } else if let Some(last) = out.last_mut() {
            last.2.push_str(t);
            last.2.push(' ');
        }
    }
    out
}

#[test]
fn help_groups_every_flag_under_a_heading() {
    for arg in ["--help", "-h"] {
        let out = bin().arg(arg).output().unwrap();
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout);
        let sections = help_sections(&help);
        let headings: Vec<&str> = sections.iter().map(|s| s.0.as_str()).collect();
        for h in [
            "Listener",
            "Upstream",
            "Sessions and windows",
            "Streams",
            "Limits",
            "Access control",
            "TLS",
            "Shutdown",
            "Logging",
            "Admin",
        ] {
            assert!(headings.contains(&h), "{arg}: no {h:?} heading:\n{help}");
        }
        // A flag added without a heading lands in clap's default list: only --help and
        // --version may be there.
        for (heading, flag, _) in &sections {
            if heading == "Options" {
                assert!(
                    flag == "--help" || flag == "--version",
                    "{arg}: {flag} has no help heading:\n{help}"
                );
            }
        }
        assert!(sections.len() > 30, "{arg}: flags not found:\n{help}");
        let (heading, _, text) = sections
            .iter()
            .find(|s| s.1 == "--admin-listen")
            .expect("--admin-listen in --help");
        assert_eq!(heading, "Admin");
        for path in ["/healthz", "/readyz", "/metrics"] {
            assert!(
                text.contains(path),
                "{arg}: --admin-listen's help lacks {path}: {text}"
            );
        }
    }
}

#[test]
fn listen_accepts_the_usual_spellings() {
    // `:PORT` is every IPv4 interface (as nginx's `listen 8080`; the default is 0.0.0.0:8080
    // too), `localhost` is 127.0.0.1.
    let mut gw = Running::start(&[
        "--upstream",
        "http://127.0.0.1:9",
        "--listen",
        ":0",
        "--admin-listen",
        "localhost:0",
    ]);
    let started = gw.line("mcp-reattach started");
    assert!(started.contains("listen=0.0.0.0:"), "{started}");
    assert!(started.contains("admin=127.0.0.1:"), "{started}");
    drop(gw);
    let mut gw = Running::start(&[
        "--upstream",
        "http://127.0.0.1:9",
        "--listen",
        "[::1]:0",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    let started = gw.line("mcp-reattach started");
    assert!(started.contains("listen=[::1]:"), "{started}");
}

#[test]
fn listen_refuses_other_spellings_with_a_hint() {
    for (flag, value) in [
        ("--listen", "8080"),
        ("--listen", "example.com:8080"),
        ("--listen", "0.0.0.0"),
        ("--listen", "localhost"),
        ("--listen", ":99999"),
        ("--admin-listen", "9090"),
        ("--admin-listen", "http://127.0.0.1:9090"),
    ] {
        let (code, err) = refused(&["--upstream", "http://127.0.0.1:9", flag, value], &[]);
        assert_eq!(code, Some(64), "{flag} {value}: {err}");
        assert!(err.contains(flag), "{flag} {value}: {err}");
        for form in [":8080", "localhost:8080", "[::]:8080"] {
            assert!(
                err.contains(form),
                "{flag} {value}: no hint {form:?}: {err}"
            );
        }
    }
}
#[test]
fn max_header_bytes_below_the_minimum_is_refused_stating_it() {
    let (code, err) = refused(
        &[
            "--upstream",
            "http://127.0.0.1:9",
            "--max-header-bytes",
            "1KiB",
        ],
        &[],
    );
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("--max-header-bytes") && err.contains("8KiB"),
        "{err}"
    );
    let (code, err) = refused(
        &[
            "--upstream",
            "http://127.0.0.1:9",
            "--max-header-bytes",
            "8191",
        ],
        &[],
    );
    assert_eq!(code, Some(64), "{err}");
}
#[test]
fn upstream_urls_are_checked_and_credentials_never_shown() {
    for (url, reason) in [
        ("http://127.0.0.1:99999", "port"),
        ("http://127.0.0.1:0", "port"),
        ("http://127.0.0.1:", "port"),
        ("http://:3000", "host"),
        ("http://user:s3cret@127.0.0.1:3000", "credentials"),
        ("http://s3cret@127.0.0.1:3000", "credentials"),
        ("https://user:s3cret@127.0.0.1:99999/mcp", "credentials"),
        ("mailto:s3cret@example.com", "scheme"),
    ] {
        for (args, envs) in [
            (vec!["--upstream", url], vec![]),
            (vec![], vec![("MCP_REATTACH_UPSTREAM", url)]),
        ] {
            let (code, err) = refused(&args, &envs);
            assert_eq!(code, Some(64), "{url} {envs:?}: {err}");
            assert!(err.contains("--upstream"), "{url}: {err}");
            assert!(err.contains(reason), "{url}: no {reason:?} in {err}");
            assert!(!err.contains("s3cret"), "{url}: credentials shown: {err}");
        }
    }
    // Forgetting the flag does not show them either.
    let (code, err) = refused(&["http://user:s3cret@127.0.0.1:3000"], &[]);
    assert_eq!(code, Some(64), "{err}");
    assert!(!err.contains("s3cret"), "credentials shown: {err}");
}
#[test]
fn a_value_from_the_environment_is_named_by_its_variable() {
    for (var, value, flag) in [
        ("MCP_REATTACH_MAX_SESSIONS", "x", "--max-sessions"),
        ("MCP_REATTACH_WINDOW_BYTES", "lots", "--window-bytes"),
        ("MCP_REATTACH_PRIMING", "sometimes", "--priming"),
        ("MCP_REATTACH_LISTEN", "nowhere", "--listen"),
        ("MCP_REATTACH_LOG_LEVEL", "[[[", "--log-level"),
    ] {
        let (code, err) = refused(&["--upstream", "http://127.0.0.1:9"], &[(var, value)]);
        assert_eq!(code, Some(64), "{var}={value}: {err}");
        assert!(
            err.contains(flag) && err.contains(&format!("(from {var})")),
            "{var}={value}: {err}"
        );
    }
    // The same value on the command line is the flag's alone; a valid variable beside it
    // does not count.
    let (code, err) = refused(
        &["--upstream", "http://127.0.0.1:9", "--max-sessions", "x"],
        &[("MCP_REATTACH_MAX_SESSIONS", "5")],
    );
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("--max-sessions") && !err.contains("MCP_REATTACH_MAX_SESSIONS"),
        "{err}"
    );
    // A file that cannot be used, named by its variable.
    let (code, err) = refused(
        &["--upstream", "http://127.0.0.1:9"],
        &[
            ("MCP_REATTACH_TLS_CERT", "/nonexistent/tls.crt"),
            ("MCP_REATTACH_TLS_KEY", "/nonexistent/tls.key"),
        ],
    );
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("--tls-cert") && err.contains("(from MCP_REATTACH_TLS_CERT)"),
        "{err}"
    );
    // An address in use, too.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, err) = refused(
        &["--upstream", "http://127.0.0.1:9"],
        &[("MCP_REATTACH_ADMIN_LISTEN", &addr)],
    );
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("--admin-listen") && err.contains("(from MCP_REATTACH_ADMIN_LISTEN)"),
        "{err}"
    );
}

/// Issue 56 item 13: `sessions list --admin URL --json` (the form the docs use) is accepted as
/// `sessions --admin URL --json list` is, and the `sessions` command's help lists its own flags,
/// not every gateway flag. The gateway's and `demo`'s help are as they were.
#[test]
fn sessions_flags_follow_the_subcommand_and_its_help_is_its_own() {
    // Nothing listens on port 1: each form parses, then fails to reach the listener (exit 1,
    // not a usage error's 64).
    let url = "http://127.0.0.1:1";
    for args in [
        vec!["sessions", "list", "--admin", url, "--json"],
        vec!["sessions", "--admin", url, "--json", "list"],
        vec!["sessions", "--json", "list", "--admin", url],
        vec!["sessions", "show", "0123456789abcdef", "--admin", url],
        vec!["sessions", "end", "0123456789abcdef", "--admin", url],
    ] {
        let out = bin()
            .args(&args)
            .env_remove("MCP_REATTACH_ADMIN_URL")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("cannot reach the admin listener"),
            "{args:?}: {err}"
        );
    }
    let flags = |args: &[&str]| -> Vec<String> {
        let out = bin().args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        help_sections(&String::from_utf8_lossy(&out.stdout))
            .into_iter()
            .map(|s| s.1)
            .collect()
    };
    for args in [
        &["sessions", "--help"][..],
        &["sessions", "list", "--help"],
        &["sessions", "show", "--help"],
        &["help", "sessions", "list"],
    ] {
        let mut got = flags(args);
        got.sort();
        assert_eq!(
            got,
            ["--admin", "--admin-token-file", "--help", "--json"],
            "{args:?}"
        );
    }
    for args in [&["--help"][..], &["demo", "--help"]] {
        let got = flags(args);
        for f in ["--upstream", "--listen", "--store", "--admin-listen"] {
            assert!(got.iter().any(|g| g == f), "{args:?} lacks {f}: {got:?}");
        }
    }
}
