//! The binary's command line: help text, exit code 64 for bad configuration, env vars.

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
