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
    /// A short label for reports (`ts-sse`, `ts-json`, `py`, `everything`).
    pub label: &'static str,
}

impl Upstream {
    /// `tests/interop/ts-server.mjs <mode>` (TypeScript SDK, no event store unless
    /// `sse-resumable`).
    pub async fn ts(mode: &str) -> Upstream {
        let label = match mode {
            "sse" => "ts-sse",
            "json" => "ts-json",
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
    /// no event store).
    pub async fn py() -> Upstream {
        let python = ensure_python_venv();
        let mut proc = ChildProc::spawn(
            "py",
            python.to_str().expect("UTF-8 path"),
            &["py-server.py"],
            &interop_dir(),
        );
        let port = wait_listening(&mut proc, Duration::from_secs(30)).await;
        Upstream {
            proc,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            label: "py",
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
