//! Child processes read line by line ([`ChildProc`]), free ports ([`free_port`]) and the HTTP
//! client for real processes ([`http_client`]).

use super::*;

/// What [`ChildProc::next_line`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NextLine {
    Line(String),
    /// stdout closed (the process exited or closed it).
    Eof,
    Timeout,
}

impl NextLine {
    /// The line, or why there is none: `"eof"` or `"timeout"` (what a client run records as
    /// cut short).
    pub fn line(self) -> Result<String, &'static str> {
        match self {
            NextLine::Line(l) => Ok(l),
            NextLine::Eof => Err("eof"),
            NextLine::Timeout => Err("timeout"),
        }
    }
}

/// A child process with piped stdout read line by line (on a thread, so lines are available
/// the moment the child writes them). Its stderr is forwarded to the test's stderr with a
/// `[name]` prefix and also kept ([`ChildProc::stderr_lines`]). Killed on drop.
pub struct ChildProc {
    name: String,
    child: Child,
    /// Piped stdin, for processes spawned with [`ChildProc::spawn_with_stdin`].
    stdin: Option<std::process::ChildStdin>,
    lines: mpsc::UnboundedReceiver<String>,
    stderr: Arc<Mutex<Vec<String>>>,
    /// Set when the stderr forwarder reached the end of the pipe.
    stderr_done: Arc<AtomicBool>,
}

impl ChildProc {
    /// Spawns `program args…` in `cwd`.
    pub fn spawn(name: &str, program: &str, args: &[&str], cwd: &Path) -> ChildProc {
        ChildProc::spawn_env(name, program, args, cwd, &[])
    }

    /// Spawns `program args…` in `cwd` with extra environment variables.
    pub fn spawn_env(
        name: &str,
        program: &str,
        args: &[&str],
        cwd: &Path,
        envs: &[(&str, &str)],
    ) -> ChildProc {
        ChildProc::spawn_inner(name, program, args, cwd, envs, false)
    }

    /// Spawns `program args…` in `cwd` with extra environment variables and a piped stdin
    /// ([`ChildProc::send_line`]).
    pub fn spawn_with_stdin(
        name: &str,
        program: &str,
        args: &[&str],
        cwd: &Path,
        envs: &[(&str, &str)],
    ) -> ChildProc {
        ChildProc::spawn_inner(name, program, args, cwd, envs, true)
    }

    fn spawn_inner(
        name: &str,
        program: &str,
        args: &[&str],
        cwd: &Path,
        envs: &[(&str, &str)],
        piped_stdin: bool,
    ) -> ChildProc {
        let mut child = Command::new(program)
            .args(args)
            .envs(envs.iter().copied())
            .current_dir(cwd)
            .stdin(if piped_stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name} ({program} {args:?}): {e}"));
        let (tx, lines) = mpsc::unbounded_channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(l).is_err() {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let kept = stderr.clone();
        let stderr_done = Arc::new(AtomicBool::new(false));
        let done = stderr_done.clone();
        let child_stderr = child.stderr.take().expect("piped stderr");
        let prefix = name.to_string();
        // Threads spawned by a test inherit its output capture, so this shows with the test.
        std::thread::spawn(move || {
            for line in BufReader::new(child_stderr).lines() {
                let Ok(l) = line else { break };
                eprintln!("[{prefix}] {l}");
                kept.lock().unwrap().push(l);
            }
            done.store(true, Ordering::SeqCst);
        });
        let stdin = child.stdin.take();
        ChildProc {
            name: name.to_string(),
            child,
            stdin,
            lines,
            stderr,
            stderr_done,
        }
    }

    /// Writes `line` and a newline to the process's stdin (spawned with
    /// [`ChildProc::spawn_with_stdin`]); panics if it cannot.
    pub fn send_line(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self
            .stdin
            .as_mut()
            .unwrap_or_else(|| panic!("{} has no piped stdin", self.name));
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|()| stdin.flush())
            .unwrap_or_else(|e| panic!("writing to {}'s stdin: {e}", self.name));
    }

    /// Spawns `node tests/interop/<script> args…` after making sure npm deps are installed.
    pub fn spawn_node(name: &str, script: &str, args: &[&str]) -> ChildProc {
        ensure_npm_deps();
        let dir = interop_dir();
        let mut full = vec![script];
        full.extend_from_slice(args);
        ChildProc::spawn(name, &node_bin(), &full, &dir)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The next stdout line, waiting at most `timeout`.
    pub async fn next_line(&mut self, timeout: Duration) -> NextLine {
        match tokio::time::timeout(timeout, self.lines.recv()).await {
            Ok(Some(l)) => NextLine::Line(l),
            Ok(None) => NextLine::Eof,
            Err(_) => NextLine::Timeout,
        }
    }

    /// Blocking variant of [`ChildProc::next_line`] for non-async tests.
    pub fn next_line_blocking(&mut self, timeout: Duration) -> NextLine {
        let deadline = Instant::now() + timeout;
        loop {
            match self.lines.try_recv() {
                Ok(l) => return NextLine::Line(l),
                Err(mpsc::error::TryRecvError::Disconnected) => return NextLine::Eof,
                Err(mpsc::error::TryRecvError::Empty) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                Err(mpsc::error::TryRecvError::Empty) => return NextLine::Timeout,
            }
        }
    }

    /// stderr lines so far.
    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    /// Every stderr line, once the pipe has ended (the process exited and the forwarder took
    /// its last lines), or what there is after `timeout` (a child of the process may hold the
    /// pipe open).
    pub async fn stderr_to_end(&self, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        while !self.stderr_done.load(Ordering::SeqCst) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.stderr_lines()
    }

    /// Waits at most `timeout` for the process to exit.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                _ => return None,
            }
        }
    }

    /// Sends SIGTERM (`kill -TERM <pid>`); panics if `kill` fails.
    pub fn sigterm(&self) {
        self.signal("TERM");
    }

    /// Sends the signal `name` (`HUP`, `TERM`, ...: `kill -<name> <pid>`); panics if `kill`
    /// fails.
    pub fn signal(&self, name: &str) {
        let id = self.child.id();
        let ok = Command::new("kill")
            .args([&format!("-{name}"), &id.to_string()])
            .status()
            .expect("running kill")
            .success();
        assert!(ok, "kill -{name} {id}");
    }

    /// Blocking: reads stdout lines until one satisfies `want` and returns it; Err with the
    /// lines read meanwhile if none does within `timeout` (or stdout ends first).
    pub fn wait_line_blocking(
        &mut self,
        timeout: Duration,
        want: impl Fn(&str) -> bool,
    ) -> Result<String, Vec<String>> {
        let deadline = Instant::now() + timeout;
        let mut skipped = Vec::new();
        loop {
            match self.next_line_blocking(deadline.saturating_duration_since(Instant::now())) {
                NextLine::Line(l) if want(&l) => return Ok(l),
                NextLine::Line(l) => skipped.push(l),
                NextLine::Eof | NextLine::Timeout => return Err(skipped),
            }
        }
    }

    /// Kills the process (if still running) and reaps it.
    pub fn kill(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A port that was free a moment ago (the process under test binds it right after).
pub fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("picking a free port")
}

/// A reqwest client for the real processes of the tests: no proxy, a new connection per request
/// (two requests of a test race on two connections, as they do from the SDK clients), a 5 s
/// connect timeout.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .connect_timeout(Duration::from_secs(5))
        .build()
        .expect("reqwest client")
}

/// The crate's root directory (the repository).
pub fn repo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}
