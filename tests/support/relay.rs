//! The fault-injecting TCP relay (see [`Relay`]).

use super::*;

use tokio::sync::Notify;

/// A TCP relay on `127.0.0.1:0` that forwards bytes both ways to `target` and injects faults:
/// it cuts every live connection ([`Relay::cut_all`]), refuses new ones for a while
/// ([`Relay::refuse_for`]), applies a [`Fault`] per direction armed at any time
/// ([`Relay::arm`]), caps the target→client rate ([`Relay::start_limited`]) or records what
/// clients send ([`Relay::start_recording`]).
///
/// It runs on its own one-worker runtime, so its methods are synchronous and usable from any
/// test (sync or async, any runtime flavour); only [`Relay::idle_within`], which waits for
/// the relay's peers to do something, is async. Dropping it stops it and closes every
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
    /// second: a token bucket (one [`CHUNK`] of burst) that the relay must hold tokens from
    /// before it even reads from the target, with small socket buffers on both sides, so the
    /// target feels the slow link through TCP flow control, as it would on a real one.
    pub down_bytes_per_sec: Option<u64>,
    /// Keeps a copy of every byte forwarded from clients to the target
    /// ([`Relay::recorded_up`]).
    pub record_up: bool,
    /// The small socket buffers of a rate-limited relay without its rate cap: what the path
    /// holds in flight stays in kilobytes (with a client whose receive buffer is small too,
    /// [`super::send_small_window`]), not in the megabytes loopback's autotuning allows.
    pub small_buffers: bool,
}

impl RelayOptions {
    /// Whether the relay's sockets get [`LIMITED_SOCKET_BUFFER`]s: a rate-limited relay's,
    /// or one asked for [`RelayOptions::small_buffers`].
    fn small_sockets(&self) -> bool {
        self.down_bytes_per_sec.is_some() || self.small_buffers
    }
}

/// Which way bytes flow through a [`Relay`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// From the connecting side to the target (requests): "up".
    ToTarget,
    /// From the target back to the connecting side (responses): "down".
    ToClient,
}

/// What a [`Relay`] does to the bytes of one direction ([`Relay::arm`]). Counts of bytes start
/// when the fault is armed and are per connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward unchanged (the default).
    Pass,
    /// Forward `n` more bytes, then reset both sockets of the connection (RST both ways).
    ResetAfter(usize),
    /// Forward `n` more bytes, then send FIN to the receiver (half-close); later bytes of this
    /// direction are read and dropped; the other direction goes on.
    HalfCloseAfter(usize),
    /// Forward `n` more bytes, then forward nothing more and stop reading (both sockets stay
    /// open, so the sender's socket buffer fills) until the connection is cut.
    StallAfter(usize),
    /// Forward one byte per write (one TCP segment each with NODELAY), `delay` apart.
    Trickle(Duration),
}

/// Largest read of a relay's pump, and the burst of a rate-limited relay's bucket.
pub const CHUNK: usize = 16 * 1024;

/// Socket buffer size a rate-limited or small-buffered relay asks for (the kernel doubles it): the receive
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
    /// The fault armed per direction (indexed by `Dir as usize`), with how many times that
    /// direction was armed: a pump that sees a new count starts counting bytes afresh.
    armed: Mutex<[(u64, Fault); 2]>,
    /// Directions that reached their `StallAfter` limit and now hold their bytes.
    stalled: AtomicUsize,
    /// Bytes forwarded target→client, all connections.
    down_bytes: AtomicU64,
    /// Bytes forwarded client→target, all connections.
    up_bytes: AtomicU64,
    /// Token bucket of the target→client direction (rate-limited relays only).
    bucket: Mutex<TokenBucket>,
    /// With `record_up`: every connection's client→target bytes, by connection id.
    recorded: Mutex<Vec<(u64, Vec<u8>)>>,
}

impl RelayShared {
    fn counter(&self, dir: Dir) -> &AtomicU64 {
        match dir {
            Dir::ToTarget => &self.up_bytes,
            Dir::ToClient => &self.down_bytes,
        }
    }
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
    /// Tells the connection's task to close both sockets abruptly (RST).
    reset: Arc<Notify>,
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
            if options.small_sockets() {
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
            armed: Mutex::new([(0, Fault::Pass); 2]),
            stalled: AtomicUsize::new(0),
            down_bytes: AtomicU64::new(0),
            up_bytes: AtomicU64::new(0),
            bucket: Mutex::new(TokenBucket::new(
                options.down_bytes_per_sec.unwrap_or(1),
                CHUNK,
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

    /// Arms `fault` for direction `dir` on every connection, live or future, in place of the
    /// one armed before; the byte counts of `ResetAfter`/`HalfCloseAfter`/`StallAfter` start
    /// now (a live connection's pump takes the new fault with its next read). A direction
    /// that already stalled or half-closed stays so.
    pub fn arm(&self, dir: Dir, fault: Fault) {
        let mut armed = self.shared.armed.lock().unwrap();
        let slot = &mut armed[dir as usize];
        *slot = (slot.0 + 1, fault);
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
                // Stored as a permit if the task is not waiting yet: never lost.
                h.reset.notify_one();
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

    /// Connections currently being relayed (connecting to the target, or either direction
    /// still open, including a stalled one).
    pub fn live(&self) -> usize {
        self.shared.conns.lock().unwrap().len()
    }

    /// Directions that hit their [`Fault::StallAfter`] limit so far (each holds everything
    /// after it).
    pub fn stalled(&self) -> usize {
        self.shared.stalled.load(Ordering::SeqCst)
    }

    /// Waits (at most `within`, wall clock) until no connection is live; false if some still
    /// are. Async because what ends them (the relay's peers closing) may run on the
    /// caller's runtime.
    pub async fn idle_within(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while self.live() > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
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
        let reset = Arc::new(Notify::new());
        let (done_tx, done_rx) = std_mpsc::channel::<()>();
        shared.conns.lock().unwrap().insert(
            id,
            ConnHandle {
                reset: reset.clone(),
                done: done_rx,
            },
        );
        tokio::spawn(relay_conn(
            id,
            client,
            target,
            shared.clone(),
            reset,
            done_tx,
        ));
    }
}

/// One connection: connects to the target, then runs a [`pump`] per direction until both
/// directions have ended (each passes its FIN on) or the connection is reset (by
/// [`Relay::cut_all`], a [`Fault::ResetAfter`], or a reset or write error on either side),
/// which closes both sockets with an RST.
async fn relay_conn(
    id: u64,
    mut client: TcpStream,
    target: SocketAddr,
    shared: Arc<RelayShared>,
    reset: Arc<Notify>,
    done_tx: std_mpsc::Sender<()>,
) {
    let _ = client.set_nodelay(true);
    let small = shared.options.small_sockets();
    let connect = async move {
        let socket = TcpSocket::new_v4()?;
        if small {
            // A small receive window towards the target: what the relay does not read yet
            // stays in the target's send buffer (it must feel the slow link).
            socket.set_recv_buffer_size(LIMITED_SOCKET_BUFFER)?;
        }
        socket.connect(target).await
    };
    let upstream = tokio::select! {
        r = tokio::time::timeout(Duration::from_secs(5), connect) => r,
        _ = reset.notified() => {
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
    let rst = {
        let (mut client_r, mut client_w) = client.split();
        let (mut upstream_r, mut upstream_w) = upstream.split();
        let up = pump(Dir::ToTarget, &mut client_r, &mut upstream_w, id, &shared);
        let down = pump(Dir::ToClient, &mut upstream_r, &mut client_w, id, &shared);
        tokio::select! {
            r = async { tokio::try_join!(up, down) } => r.is_err(),
            _ = reset.notified() => true,
        }
    };
    if rst {
        let _ = client.set_zero_linger();
        let _ = upstream.set_zero_linger();
    }
    drop(client);
    drop(upstream);
    shared.conns.lock().unwrap().remove(&id);
    drop(done_tx);
}

/// A pump's verdict that the whole connection must be reset (RST both ways).
struct Reset;

/// Forwards one direction of a connection (`from` → `to`) under the fault armed for `dir`,
/// until `from` ends (its FIN is passed on: Ok) or the connection must be reset (Err). A
/// rate-limited relay's target→client pump takes tokens from the shared bucket before each
/// read and reads no more than it holds.
async fn pump(
    dir: Dir,
    from: &mut (impl AsyncRead + Unpin),
    to: &mut (impl AsyncWrite + Unpin),
    id: u64,
    shared: &RelayShared,
) -> Result<(), Reset> {
    let bucket = match dir {
        Dir::ToClient if shared.options.down_bytes_per_sec.is_some() => Some(&shared.bucket),
        _ => None,
    };
    let mut buf = vec![0u8; CHUNK];
    // The fault in force and the bytes forwarded under it; `u64::MAX`: take the armed one at
    // the first read.
    let mut generation = u64::MAX;
    let mut fault = Fault::Pass;
    let mut since = 0usize;
    loop {
        let allowed = match bucket {
            // At least 4 KiB per read: sleeps of a few ms, not a busy loop of tiny reads.
            Some(bucket) => loop {
                let taken = bucket.lock().unwrap().take(CHUNK, 4096);
                match taken {
                    Ok(n) => break n,
                    Err(wait) => tokio::time::sleep(wait.max(Duration::from_millis(1))).await,
                }
            },
            None => CHUNK,
        };
        let read = from.read(&mut buf[..allowed]).await;
        if let Some(bucket) = bucket {
            let used = read.as_ref().map_or(0, |n| *n);
            bucket.lock().unwrap().give_back(allowed - used);
        }
        let n = match read {
            Ok(0) => {
                // Pass the FIN on; the other direction goes on.
                let _ = to.shutdown().await;
                return Ok(());
            }
            Ok(n) => n,
            // The sender reset: reset the whole connection.
            Err(_) => return Err(Reset),
        };
        let (g, f) = shared.armed.lock().unwrap()[dir as usize];
        if g != generation {
            generation = g;
            fault = f;
            since = 0;
        }
        let data = &buf[..n];
        let limit = match fault {
            Fault::Pass => {
                forward(to, data, dir, id, shared).await?;
                continue;
            }
            Fault::Trickle(delay) => {
                for b in data {
                    forward(to, std::slice::from_ref(b), dir, id, shared).await?;
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                }
                continue;
            }
            Fault::ResetAfter(l) | Fault::HalfCloseAfter(l) | Fault::StallAfter(l) => l,
        };
        let take = limit.saturating_sub(since).min(n);
        if take > 0 {
            forward(to, &data[..take], dir, id, shared).await?;
            since += take;
        }
        if since < limit {
            continue;
        }
        match fault {
            Fault::ResetAfter(_) => {
                // Let the forwarded bytes leave before the RST discards the send buffer.
                tokio::time::sleep(Duration::from_millis(20)).await;
                return Err(Reset);
            }
            Fault::HalfCloseAfter(_) => {
                let _ = to.shutdown().await;
                // Drain and drop the rest of this direction until the sender ends it.
                loop {
                    if let Ok(0) | Err(_) = from.read(&mut buf).await {
                        return Ok(());
                    }
                }
            }
            Fault::StallAfter(_) => {
                shared.stalled.fetch_add(1, Ordering::SeqCst);
                // Read nothing more: the sender's socket buffer fills. Ends with a reset.
                return std::future::pending().await;
            }
            Fault::Pass | Fault::Trickle(_) => unreachable!(),
        }
    }
}

/// Writes `data` to `to` (the receiver's error resets the connection) and counts it, and
/// with `record_up` records what went to the target.
async fn forward(
    to: &mut (impl AsyncWrite + Unpin),
    data: &[u8],
    dir: Dir,
    id: u64,
    shared: &RelayShared,
) -> Result<(), Reset> {
    to.write_all(data).await.map_err(|_| Reset)?;
    shared
        .counter(dir)
        .fetch_add(data.len() as u64, Ordering::SeqCst);
    if dir == Dir::ToTarget && shared.options.record_up {
        let mut recorded = shared.recorded.lock().unwrap();
        match recorded.iter_mut().find(|(c, _)| *c == id) {
            Some((_, bytes)) => bytes.extend_from_slice(data),
            None => recorded.push((id, data.to_vec())),
        }
    }
    Ok(())
}
