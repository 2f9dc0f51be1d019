//! The real `mcp-reattach` binary ([`Binary`]): spawned on free loopback ports with the flags a
//! test gives, ready once its admin listener answers, killed on drop; [`metric_sum`] reads its
//! `/metrics`.

use super::*;

/// How long the binary may take to answer on its admin listener.
const START_LIMIT: Duration = Duration::from_secs(15);

/// The real `mcp-reattach` binary (`CARGO_BIN_EXE_mcp-reattach`) on free loopback ports.
/// Its stdout (the log) is read line by line and its stderr forwarded and kept, as for any
/// [`ChildProc`]; it is killed when the handle drops.
pub struct Binary {
    pub proc: ChildProc,
    /// The proxy listener (`--listen`).
    pub addr: SocketAddr,
    /// The admin listener (`--admin-listen`: `/healthz`, `/readyz`, `/metrics`).
    pub admin: SocketAddr,
}

/// Why [`Binary::try_start`] has no gateway to hand back.
#[derive(Debug)]
pub struct NotStarted {
    /// The exit code; `None` if it was still not ready when time ran out (it is killed then).
    pub code: Option<i32>,
    /// Everything it wrote on stderr.
    pub stderr: String,
}

impl std::fmt::Display for NotStarted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit code {:?}; stderr:\n{}", self.code, self.stderr)
    }
}

impl Binary {
    /// Starts the binary (named `gateway` in its stderr lines) in front of
    /// `http://<upstream>` with default flags plus `extra`, and waits until its admin listener
    /// answers `/healthz`; panics (with its stderr) if it does not within 15 s.
    pub async fn start(upstream: SocketAddr, extra: &[&str]) -> Binary {
        Binary::try_start("gateway", upstream, extra, "/healthz")
            .await
            .unwrap_or_else(|e| panic!("the gateway (flags {extra:?}) did not start: {e}"))
    }

    /// [`Binary::start`] for a test that has no runtime of its own.
    pub fn start_blocking(upstream: SocketAddr, extra: &[&str]) -> Binary {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime to start the gateway on")
            .block_on(Binary::start(upstream, extra))
    }

    /// The launcher: spawns `mcp-reattach --upstream http://<upstream> --listen <free port>
    /// --admin-listen <free port> extra…` as `name`, and waits (at most 15 s) until `ready_path`
    /// on its admin listener answers 2xx. Err if it exits first (e.g. code 64 for a flag it
    /// does not know) or time runs out (then it is killed).
    pub async fn try_start(
        name: &str,
        upstream: SocketAddr,
        extra: &[&str],
        ready_path: &str,
    ) -> Result<Binary, NotStarted> {
        Binary::try_start_via(name, &[], upstream, extra, &[], ready_path).await
    }

    /// [`Binary::start`] with extra environment variables.
    pub async fn start_with_env(
        upstream: SocketAddr,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> Binary {
        Binary::try_start_via("gateway", &[], upstream, extra, envs, "/healthz")
            .await
            .unwrap_or_else(|e| {
                panic!("the gateway (flags {extra:?}, env {envs:?}) did not start: {e}")
            })
    }

    /// [`Binary::start`] with its open-file limit (soft and hard) set to `nofile` by
    /// `prlimit` (util-linux), which then runs the binary in its own place.
    pub async fn start_with_nofile(upstream: SocketAddr, nofile: u32, extra: &[&str]) -> Binary {
        let limit = format!("--nofile={nofile}:{nofile}");
        Binary::try_start_via(
            "gateway",
            &["prlimit", &limit],
            upstream,
            extra,
            &[],
            "/healthz",
        )
        .await
        .unwrap_or_else(|e| {
            panic!("the gateway (nofile {nofile}, flags {extra:?}) did not start: {e}")
        })
    }

    /// [`Binary::try_start`] run as `launcher… mcp-reattach …` (an empty launcher: directly).
    async fn try_start_via(
        name: &str,
        launcher: &[&str],
        upstream: SocketAddr,
        extra: &[&str],
        envs: &[(&str, &str)],
        ready_path: &str,
    ) -> Result<Binary, NotStarted> {
        // A port found free can be taken before the binary binds it (another test's outgoing
        // connection gets it as its ephemeral port): then the start is tried again on new
        // ports. Any other failure is the test's to see.
        let upstream_url = format!("http://{upstream}");
        let bin = env!("CARGO_BIN_EXE_mcp-reattach");
        for attempt in 1.. {
            let (addr, admin) = (free_port(), free_port());
            let (listen, admin_listen) = (addr.to_string(), admin.to_string());
            let mut args = vec![
                "--upstream",
                &upstream_url,
                "--listen",
                &listen,
                "--admin-listen",
                &admin_listen,
            ];
            args.extend_from_slice(extra);
            let mut proc = match launcher.split_first() {
                None => ChildProc::spawn_env(name, bin, &args, &repo_dir(), envs),
                Some((program, pre)) => {
                    let mut full = pre.to_vec();
                    full.push(bin);
                    full.extend_from_slice(&args);
                    ChildProc::spawn_env(name, program, &full, &repo_dir(), envs)
                }
            };
            let ready = format!("http://{admin}{ready_path}");
            let code = match poll_http_ok(&mut proc, &ready, START_LIMIT).await {
                Ok(()) => return Ok(Binary { proc, addr, admin }),
                Err(code) => code,
            };
            let stderr = proc.stderr_to_end(Duration::from_secs(2)).await.join("\n");
            if attempt == 3 || !stderr.contains("Address already in use") {
                return Err(NotStarted { code, stderr });
            }
        }
        unreachable!("the third attempt returns")
    }

    /// `http://<proxy listener>/mcp`.
    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// GET `path` on the admin listener (5 s at most): the body of a 2xx answer, or why not.
    pub async fn admin_get(&self, path: &str) -> Result<String, String> {
        let resp = http_client()
            .get(format!("http://{}{path}", self.admin))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(|e| format!("GET {path}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("GET {path}: {}", resp.status()));
        }
        resp.text()
            .await
            .map_err(|e| format!("reading {path}: {e}"))
    }
}

/// The sum of every sample of `series` in a Prometheus text exposition: the lines that start
/// with it followed by a space or `{` (a name sums over its label sets; a name with its labels
/// is one series). `None` if there is no such line.
pub fn metric_sum(text: &str, series: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(series) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

/// Polls `url` until it answers 2xx, at most `limit`: Err with the exit code if `proc` exits
/// first, Err(None) if time runs out (`proc` is killed then).
async fn poll_http_ok(proc: &mut ChildProc, url: &str, limit: Duration) -> Result<(), Option<i32>> {
    let http = http_client();
    let deadline = Instant::now() + limit;
    loop {
        let ok = http
            .get(url)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            return Ok(());
        }
        if let Some(status) = proc.wait_exit(Duration::ZERO).await {
            return Err(status.code());
        }
        if Instant::now() >= deadline {
            proc.kill();
            return Err(None);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
