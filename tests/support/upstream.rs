//! The real SDK servers the interop tests put behind the gateway ([`Upstream`]).

use super::*;

/// Reads `proc`'s stdout until a `LISTENING <port>` line (other lines are skipped), at most
/// `timeout`; panics with the process's stderr if none comes.
pub async fn wait_listening(proc: &mut ChildProc, timeout: Duration) -> u16 {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match proc.next_line(left).await {
            NextLine::Line(l) => {
                if let Some(port) = l
                    .strip_prefix("LISTENING ")
                    .and_then(|p| p.trim().parse::<u16>().ok())
                {
                    return port;
                }
                eprintln!("[{} stdout] {l}", proc.name());
            }
            other => panic!(
                "{} did not report its port ({other:?}); stderr:\n{}",
                proc.name(),
                proc.stderr_lines().join("\n")
            ),
        }
    }
}

/// One of the real upstream servers the interop tests put behind the gateway.
pub struct Upstream {
    pub proc: ChildProc,
    pub addr: SocketAddr,
    /// A short label for reports (`ts-sse`, `ts-json`, `ts1-stateless-sse`, `py`,
    /// `py-stateless-json`, `fastmcp4-json`, `ts2`, `everything`, …).
    pub label: &'static str,
}

/// `prefix` followed by each flag without its leading dashes (`py`, `--stateless`, `--json` →
/// `py-stateless-json`), leaked: a label lives as long as the test process.
fn flags_label(prefix: &str, flags: &[&str]) -> &'static str {
    let mut label = prefix.to_string();
    for f in flags {
        label.push('-');
        label.push_str(f.trim_start_matches('-'));
    }
    Box::leak(label.into_boxed_str())
}

impl Upstream {
    /// `tests/interop/ts-server.mjs <mode>` (TypeScript SDK 1.x, no event store unless
    /// `sse-resumable`): `sse` and `json` are stateful, `stateless-sse` and `stateless-json` the
    /// SDK's stateless idiom (a fresh transport per POST, no `Mcp-Session-Id`, GET/DELETE 405).
    pub async fn ts(mode: &str) -> Upstream {
        let label = match mode {
            "sse" => "ts-sse",
            "json" => "ts-json",
            "stateless-sse" => "ts1-stateless-sse",
            "stateless-json" => "ts1-stateless-json",
            _ => "ts-sse-resumable",
        };
        let mut proc = ChildProc::spawn_node(label, "ts-server.mjs", &[mode]);
        let port = wait_listening(&mut proc, Duration::from_secs(20)).await;
        Upstream {
            proc,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            label,
        }
    }

    /// `tests/interop/py-server.py` (Python SDK `FastMCP(...).run(transport="streamable-http")`,
    /// no event store), stateful with SSE answers.
    pub async fn py() -> Upstream {
        Upstream::py_with(&[]).await
    }

    /// `tests/interop/py-server.py <flags>`: `--stateless` (`FastMCP(stateless_http=True)`),
    /// `--json` (`json_response=True`). Label `py`, `py-stateless`, `py-json`,
    /// `py-stateless-json`.
    pub async fn py_with(flags: &[&str]) -> Upstream {
        let python = ensure_python_venv();
        let python = python.to_str().expect("UTF-8 path");
        let label = flags_label("py", flags);
        Upstream::script(label, python, "py-server.py", flags, &interop_dir(), 30).await
    }

    /// `tests/interop/fastmcp4/server.py <flags>`: FastMCP 4.x (PyPI `fastmcp`, on the Python
    /// SDK 2) `run(transport="http", stateless_http=…, json_response=…)` with `--stateless` /
    /// `--json`; its defaults otherwise (stateful, SSE). Label `fastmcp4`, `fastmcp4-stateless`, …
    pub async fn fastmcp(flags: &[&str]) -> Upstream {
        let python = ensure_fastmcp_venv();
        let python = python.to_str().expect("UTF-8 path");
        let label = flags_label("fastmcp4", flags);
        Upstream::script(
            label,
            python,
            "fastmcp4/server.py",
            flags,
            &interop_dir(),
            45,
        )
        .await
    }

    /// `tests/interop/v2/ts2-server.mjs <flags>`: TypeScript SDK v2's `createMcpHandler`
    /// (`@modelcontextprotocol/server` + `@modelcontextprotocol/node`) with its defaults, which
    /// serve 2025-era clients statelessly (SSE answers, no `Mcp-Session-Id`, GET/DELETE 405).
    /// `--response-mode auto|sse|json` sets its `responseMode` (modern exchanges only). Label
    /// `ts2`, `ts2-response-mode-json`, …
    pub async fn ts2(flags: &[&str]) -> Upstream {
        ensure_npm_v2_deps();
        let label = flags_label("ts2", flags);
        let node = node_bin();
        Upstream::script(label, &node, "ts2-server.mjs", flags, &interop_v2_dir(), 20).await
    }

    /// `program script flags…` in `dir`, once it prints `LISTENING <port>` (within
    /// `wait_s` seconds).
    async fn script(
        label: &'static str,
        program: &str,
        script: &str,
        flags: &[&str],
        dir: &std::path::Path,
        wait_s: u64,
    ) -> Upstream {
        let mut args = vec![script];
        args.extend_from_slice(flags);
        let mut proc = ChildProc::spawn(label, program, &args, dir);
        let port = wait_listening(&mut proc, Duration::from_secs(wait_s)).await;
        Upstream {
            proc,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            label,
        }
    }

    /// `@modelcontextprotocol/server-everything streamableHttp`, unmodified; the preload
    /// `loopback-listen.mjs` only makes it listen on 127.0.0.1 with an ephemeral port.
    pub async fn everything() -> Upstream {
        ensure_npm_deps();
        let mut proc = ChildProc::spawn(
            "everything",
            &node_bin(),
            &[
                "--import",
                "./loopback-listen.mjs",
                "node_modules/@modelcontextprotocol/server-everything/dist/index.js",
                "streamableHttp",
            ],
            &interop_dir(),
        );
        let port = wait_listening(&mut proc, Duration::from_secs(20)).await;
        Upstream {
            proc,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            label: "everything",
        }
    }

    /// `http://127.0.0.1:<port>` (no path), the form the gateway's upstream takes.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }
}
