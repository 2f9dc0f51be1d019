//! A TCP fault proxy for tests: sits between a client and the gateway, or between the gateway
//! and its upstream, forwards bytes both ways and injects faults per direction.
//!
//! Use from a test file with `#[path = "common/faults.rs"] mod faults;`.
//!
//! Faults are armed per direction at any time ([`FaultProxy::arm`]); byte counts start at
//! arming and are per connection. Everything runs on the test's runtime and is aborted when
//! the proxy is dropped. Every wait a caller does on it is bounded.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// Which way bytes flow through the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// From the connecting side to the target (requests).
    ToTarget,
    /// From the target back to the connecting side (responses).
    ToClient,
}

/// What happens to the bytes of one direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward unchanged.
    Pass,
    /// Forward `n` more bytes, then reset both sockets of the connection (RST both ways).
    ResetAfter(usize),
    /// Forward `n` more bytes, then send FIN to the receiver (half-close); later bytes of this
    /// direction are read and dropped; the other direction goes on.
    HalfCloseAfter(usize),
    /// Forward `n` more bytes, then forward nothing more and stop reading (both sockets stay
    /// open, so the sender's socket buffer fills).
    StallAfter(usize),
    /// Forward one byte per write (one TCP segment each with NODELAY), `delay` apart.
    Trickle(Duration),
}

#[derive(Debug)]
struct Plan {
    generation: u64,
    to_target: Fault,
    to_client: Fault,
}

struct Shared {
    plan: Mutex<Plan>,
    bytes_to_target: AtomicU64,
    bytes_to_client: AtomicU64,
    accepted: AtomicUsize,
    live: AtomicUsize,
    /// Directions that reached their `StallAfter` limit and now hold their bytes.
    stalled: AtomicUsize,
    /// Per connection: its kill switch (Some(true) = RST, Some(false) = FIN).
    kills: Mutex<Vec<watch::Sender<Option<bool>>>>,
    tasks: Mutex<Vec<AbortHandle>>,
}

/// The proxy. Dropping it aborts its tasks, which closes every connection.
pub struct FaultProxy {
    pub addr: SocketAddr,
    pub target: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:0` and forwards each connection to `target`.
    pub async fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            plan: Mutex::new(Plan {
                generation: 0,
                to_target: Fault::Pass,
                to_client: Fault::Pass,
            }),
            bytes_to_target: AtomicU64::new(0),
            bytes_to_client: AtomicU64::new(0),
            accepted: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            stalled: AtomicUsize::new(0),
            kills: Mutex::new(Vec::new()),
            tasks: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                s.accepted.fetch_add(1, Ordering::SeqCst);
                let Ok(upstream) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                let (kill_tx, kill_rx) = watch::channel(None);
                s.kills.lock().unwrap().push(kill_tx.clone());
                let (cr, cw) = client.into_split();
                let (ur, uw) = upstream.into_split();
                s.live.fetch_add(1, Ordering::SeqCst);
                let live = Arc::new(LiveGuard(s.clone()));
                let a = tokio::spawn(pump(
                    cr,
                    uw,
                    Dir::ToTarget,
                    s.clone(),
                    kill_tx.clone(),
                    kill_rx.clone(),
                    live.clone(),
                ));
                let b = tokio::spawn(pump(
                    ur,
                    cw,
                    Dir::ToClient,
                    s.clone(),
                    kill_tx,
                    kill_rx,
                    live,
                ));
                let mut t = s.tasks.lock().unwrap();
                t.push(a.abort_handle());
                t.push(b.abort_handle());
            }
        });
        shared.tasks.lock().unwrap().push(accept.abort_handle());
        FaultProxy {
            addr,
            target,
            shared,
        }
    }

    /// Arms `fault` for direction `dir` on every connection, live or future; byte counts of
    /// `ResetAfter`/`HalfCloseAfter`/`StallAfter` start now.
    pub fn arm(&self, dir: Dir, fault: Fault) {
        let mut p = self.shared.plan.lock().unwrap();
        p.generation += 1;
        match dir {
            Dir::ToTarget => p.to_target = fault,
            Dir::ToClient => p.to_client = fault,
        }
    }

    /// Resets (RST) every live connection at once, as a crashed peer or middlebox would.
    pub fn reset_all(&self) {
        for k in self.shared.kills.lock().unwrap().iter() {
            let _ = k.send(Some(true));
        }
    }

    /// Bytes forwarded so far in `dir`, over all connections.
    pub fn bytes(&self, dir: Dir) -> u64 {
        match dir {
            Dir::ToTarget => self.shared.bytes_to_target.load(Ordering::SeqCst),
            Dir::ToClient => self.shared.bytes_to_client.load(Ordering::SeqCst),
        }
    }

    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Directions that hit their `StallAfter` limit so far (they hold everything after it).
    pub fn stalled(&self) -> usize {
        self.shared.stalled.load(Ordering::SeqCst)
    }

    /// Connections whose both directions have not finished yet.
    pub fn live(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }

    /// Waits (at most `d`) until no connection is live.
    pub async fn idle_within(&self, d: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + d;
        while self.live() > 0 {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        for t in self.shared.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

struct LiveGuard(Arc<Shared>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

fn current(shared: &Shared, dir: Dir) -> (u64, Fault) {
    let p = shared.plan.lock().unwrap();
    (
        p.generation,
        match dir {
            Dir::ToTarget => p.to_target,
            Dir::ToClient => p.to_client,
        },
    )
}

/// Forwards `src` → `dst` applying the armed fault of `dir`. On a kill it closes its halves
/// (after setting zero linger for an RST); the connection closes once both pumps are done.
async fn pump(
    mut src: OwnedReadHalf,
    mut dst: OwnedWriteHalf,
    dir: Dir,
    shared: Arc<Shared>,
    kill_tx: watch::Sender<Option<bool>>,
    mut kill_rx: watch::Receiver<Option<bool>>,
    _live: Arc<LiveGuard>,
) {
    let counter = match dir {
        Dir::ToTarget => &shared.bytes_to_target,
        Dir::ToClient => &shared.bytes_to_client,
    };
    let mut buf = vec![0u8; 16 * 1024];
    let mut generation = u64::MAX;
    let mut since = 0usize;
    let mut fault = Fault::Pass;
    let rst = |src: &OwnedReadHalf, dst: &OwnedWriteHalf| {
        let _ = src.as_ref().set_zero_linger();
        let _ = dst.as_ref().set_zero_linger();
    };
    loop {
        let n = tokio::select! {
            r = src.read(&mut buf) => r,
            k = kill_rx.wait_for(Option::is_some) => {
                if k.map(|v| *v == Some(true)).unwrap_or(false) {
                    rst(&src, &dst);
                }
                return;
            }
        };
        let n = match n {
            Ok(0) => {
                // Pass the FIN on; the other direction continues.
                let _ = dst.shutdown().await;
                return;
            }
            Ok(n) => n,
            Err(_) => {
                // The sender reset: reset the whole connection.
                rst(&src, &dst);
                let _ = kill_tx.send(Some(true));
                return;
            }
        };
        let (g, f) = current(&shared, dir);
        if g != generation {
            generation = g;
            fault = f;
            since = 0;
        }
        let data = &buf[..n];
        let limit = match fault {
            Fault::Pass => {
                if dst.write_all(data).await.is_err() {
                    let _ = kill_tx.send(Some(true));
                    return;
                }
                counter.fetch_add(n as u64, Ordering::SeqCst);
                continue;
            }
            Fault::Trickle(delay) => {
                for b in data {
                    if dst.write_all(std::slice::from_ref(b)).await.is_err() {
                        let _ = kill_tx.send(Some(true));
                        return;
                    }
                    let _ = dst.flush().await;
                    counter.fetch_add(1, Ordering::SeqCst);
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
            if dst.write_all(&data[..take]).await.is_err() {
                let _ = kill_tx.send(Some(true));
                return;
            }
            counter.fetch_add(take as u64, Ordering::SeqCst);
            since += take;
        }
        if since < limit {
            continue;
        }
        match fault {
            Fault::ResetAfter(_) => {
                let _ = dst.flush().await;
                // Let the forwarded bytes leave before the RST discards the send buffer.
                tokio::time::sleep(Duration::from_millis(20)).await;
                rst(&src, &dst);
                let _ = kill_tx.send(Some(true));
                return;
            }
            Fault::HalfCloseAfter(_) => {
                let _ = dst.shutdown().await;
                // Drain and drop the rest of this direction until the connection ends.
                loop {
                    tokio::select! {
                        r = src.read(&mut buf) => if matches!(r, Ok(0) | Err(_)) { return },
                        _ = kill_rx.wait_for(Option::is_some) => return,
                    }
                }
            }
            Fault::StallAfter(_) => {
                shared.stalled.fetch_add(1, Ordering::SeqCst);
                let k = kill_rx.wait_for(Option::is_some).await;
                if k.map(|v| *v == Some(true)).unwrap_or(false) {
                    rst(&src, &dst);
                }
                return;
            }
            Fault::Pass | Fault::Trickle(_) => unreachable!(),
        }
    }
}
