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
