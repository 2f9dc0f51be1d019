//! Issue 48, step 1: which Redis client crate the shared store is built on, by measurement.
//!
//! For one client (`--client redis`: redis-rs's `ConnectionManager`, a multiplexed connection
//! that reconnects; `--client fred`: fred's `Client`, also one multiplexed connection) against a
//! running `redis-server`, each arm for `--secs` seconds:
//!
//! - `xadd`: `--conc` tasks, each appending 200-byte events to a stream of its own, `--batch`
//!   `XADD key MINID ~ 0-<n-256> 0-<n> d <200 B>` per pipeline (one round trip), the way the
//!   store's sink writes a stream's events (explicit ids = the gateway's seq, trimmed by the
//!   lowest needed position). Prints events/s, the client process's CPU per event (utime + stime
//!   from /proc/self/stat) and, with `--server-pid`, redis-server's CPU per event.
//!   With `--pack N`, one entry holds N events (one XADD per upstream read batch, its id the
//!   batch's last seq, so `XRANGE (cursor` still starts at the entry holding cursor + 1).
//! - `xrange`: one stream of 10,000 entries; one task asks `XRANGE key (0-<c> + COUNT 100` (the
//!   100 entries after a cursor, the non-owner's resume) one after the other, bounded in time
//!   by the client's own response timeout (250 ms). Prints p50/p99/max latency and CPU per
//!   read.
//! - `--memory`: 1,000 streams × 256 entries of 200 B, `INFO memory`'s `used_memory` before and
//!   after: the store's bytes per retained event (the client does not matter).
//!
//! - `--aead`: sealing a 200 B event at rest (ring: AES-256-GCM and ChaCha20-Poly1305, a
//!   96-bit nonce from the stream and seq, the session's hashed id, stream and seq as
//!   associated data), ns per event on one core; no server needed (`--client none`).
//!
//! Every arm starts with `FLUSHDB`: point it at a server of its own.
//!
//!   store-client --client redis|fred --url redis://127.0.0.1:PORT [--secs 3]
//!                [--server-pid PID] [--conc 1,16] [--batches 1,8,64] [--memory]
//!   store-client --client none --url - --aead

use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;

#[derive(Parser)]
struct Args {
    /// `redis` (redis-rs) or `fred`.
    #[arg(long)]
    client: String,
    /// The server, e.g. redis://127.0.0.1:6390.
    #[arg(long)]
    url: String,
    /// Seconds per arm.
    #[arg(long, default_value_t = 3.0)]
    secs: f64,
    /// redis-server's pid, to report its CPU per event beside the client's.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Concurrent writer tasks (comma-separated list of arms).
    #[arg(long, default_value = "1,16")]
    conc: String,
    /// XADDs per pipeline (comma-separated list of arms).
    #[arg(long, default_value = "1,8,64")]
    batches: String,
    /// Events packed into one stream entry (one XADD per upstream read batch, entry id = the
    /// batch's last seq): a comma-separated list of arms; 1 = one entry per event.
    #[arg(long, default_value = "1")]
    pack: String,
    /// Run the memory arm too.
    #[arg(long)]
    memory: bool,
    /// Run the AEAD arm (with `--client none`, only it).
    #[arg(long)]
    aead: bool,
}

const TIMEOUT: Duration = Duration::from_millis(250);
const EVENT_BYTES: usize = 200;
/// What the window keeps per stream (--window-events' default is 256): MINID trims below it.
const KEEP: u64 = 256;

/// The two clients behind one face, issuing the same commands.
#[derive(Clone)]
enum Store {
    Redis(redis::aio::ConnectionManager),
    Fred(fred::prelude::Client),
}

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

impl Store {
    async fn connect(which: &str, url: &str) -> Res<Store> {
        match which {
            "redis" => {
                let client = redis::Client::open(url)?;
                let cfg = redis::aio::ConnectionManagerConfig::new()
                    .set_response_timeout(Some(TIMEOUT))
                    .set_connection_timeout(Some(TIMEOUT))
                    .set_number_of_retries(3);
                Ok(Store::Redis(
                    client.get_connection_manager_with_config(cfg).await?,
                ))
            }
            "fred" => {
                use fred::prelude::*;
                let cfg = Config::from_url(url)?;
                let client = Builder::from_config(cfg)
                    .with_performance_config(|p| p.default_command_timeout = TIMEOUT)
                    .with_connection_config(|c| c.connection_timeout = TIMEOUT)
                    .set_policy(ReconnectPolicy::new_exponential(0, 100, 2_000, 2))
                    .build()?;
                client.init().await?;
                Ok(Store::Fred(client))
            }
            other => Err(format!("unknown client {other}").into()),
        }
    }

    /// One pipeline: XADD of ids first..first+n, trimmed below (last - KEEP).
    async fn xadd_batch(&self, key: &str, first: u64, n: u64, payload: &Bytes) -> Res<()> {
        match self {
            Store::Redis(con) => {
                let mut con = con.clone();
                let mut p = redis::pipe();
                for seq in first..first + n {
                    p.cmd("XADD")
                        .arg(key)
                        .arg("MINID")
                        .arg("~")
                        .arg(format!("0-{}", seq.saturating_sub(KEEP)))
                        .arg(format!("0-{seq}"))
                        .arg("d")
                        .arg(&payload[..])
                        .ignore();
                }
                p.query_async::<()>(&mut con).await?;
            }
            Store::Fred(client) => {
                use fred::prelude::*;
                use fred::types::{ClusterHash, CustomCommand};
                let pipe = client.pipeline();
                for seq in first..first + n {
                    let args: Vec<Value> = vec![
                        key.into(),
                        "MINID".into(),
                        "~".into(),
                        format!("0-{}", seq.saturating_sub(KEEP)).into(),
                        format!("0-{seq}").into(),
                        "d".into(),
                        Value::Bytes(payload.clone()),
                    ];
                    pipe.custom::<(), _>(
                        CustomCommand::new_static("XADD", ClusterHash::FirstKey, false),
                        args,
                    )
                    .await?;
                }
                let _: Vec<Value> = pipe.all().await?;
            }
        }
        Ok(())
    }

    /// XRANGE key (0-after + COUNT count: how many entries came back.
    async fn xrange_after(&self, key: &str, after: u64, count: u64) -> Res<usize> {
        match self {
            Store::Redis(con) => {
                let mut con = con.clone();
                let v: redis::Value = redis::cmd("XRANGE")
                    .arg(key)
                    .arg(format!("(0-{after}"))
                    .arg("+")
                    .arg("COUNT")
                    .arg(count)
                    .query_async(&mut con)
                    .await?;
                Ok(match v {
                    redis::Value::Array(a) => a.len(),
                    _ => 0,
                })
            }
            Store::Fred(client) => {
                use fred::prelude::*;
                use fred::types::{ClusterHash, CustomCommand};
                let v: Value = client
                    .custom(
                        CustomCommand::new_static("XRANGE", ClusterHash::FirstKey, false),
                        vec![
                            Value::from(key),
                            format!("(0-{after}").into(),
                            "+".into(),
                            "COUNT".into(),
                            (count as i64).into(),
                        ],
                    )
                    .await?;
                Ok(match v {
                    Value::Array(a) => a.len(),
                    _ => 0,
                })
            }
        }
    }

    async fn simple(&self, cmd: &'static str, args: &[&str]) -> Res<String> {
        match self {
            Store::Redis(con) => {
                let mut con = con.clone();
                let mut c = redis::cmd(cmd);
                for a in args {
                    c.arg(*a);
                }
                let v: redis::Value = c.query_async(&mut con).await?;
                Ok(match v {
                    redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                    redis::Value::VerbatimString { text, .. } => text,
                    other => format!("{other:?}"),
                })
            }
            Store::Fred(client) => {
                use fred::prelude::*;
                use fred::types::{ClusterHash, CustomCommand};
                let args: Vec<Value> = args.iter().map(|a| Value::from(*a)).collect();
                let v: Value = client
                    .custom(
                        CustomCommand::new_static(cmd, ClusterHash::Random, false),
                        args,
                    )
                    .await?;
                Ok(v.as_string().unwrap_or_default())
            }
        }
    }
}

/// utime + stime of a process, in seconds.
fn cpu_secs(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // rest starts at field 3 (state): field k is f[k - 3].
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(14 - 3) + ticks(15 - 3)) / hz
}

struct Cpu {
    server: Option<String>,
    own: f64,
    srv: f64,
}

impl Cpu {
    fn start(server: &Option<u32>) -> Cpu {
        let server = server.map(|p| p.to_string());
        let srv = server.as_deref().map(cpu_secs).unwrap_or(0.0);
        Cpu {
            own: cpu_secs("self"),
            srv,
            server,
        }
    }
    /// (client µs, server µs) per unit.
    fn per(&self, units: u64) -> (f64, Option<f64>) {
        let own = (cpu_secs("self") - self.own) * 1e6 / units.max(1) as f64;
        let srv = self
            .server
            .as_deref()
            .map(|p| (cpu_secs(p) - self.srv) * 1e6 / units.max(1) as f64);
        (own, srv)
    }
}

fn payload() -> Bytes {
    // A JSON-RPC progress notification's shape, padded to 200 bytes.
    let mut s = String::from(
        r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":7,"progress":1,"message":""#,
    );
    while s.len() < EVENT_BYTES - 3 {
        s.push('x');
    }
    s.push_str(r#""}}"#);
    Bytes::from(s)
}

async fn xadd_arm(store: &Store, args: &Args, conc: u64, batch: u64, pack: u64) -> Res<()> {
    store.simple("FLUSHDB", &[]).await?;
    // `pack` events of 200 B in one entry's value (the gateway would frame them: a length each).
    let one = payload();
    let mut packed = Vec::with_capacity(one.len() * pack as usize);
    for _ in 0..pack {
        packed.extend_from_slice(&one);
    }
    let payload = Bytes::from(packed);
    let cpu = Cpu::start(&args.server_pid);
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(args.secs);
    let mut tasks = Vec::new();
    for t in 0..conc {
        let store = store.clone();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            // One session (hash tag) per task, one stream of it.
            let key = format!("mra:{{bench{t}}}:ev:1");
            let mut next = 1u64;
            while Instant::now() < deadline {
                store.xadd_batch(&key, next, batch, &payload).await?;
                next += batch;
            }
            Res::Ok((next - 1) * pack)
        }));
    }
    let mut events = 0;
    for t in tasks {
        events += t.await??;
    }
    let secs = t0.elapsed().as_secs_f64();
    let (own, srv) = cpu.per(events);
    println!(
        "client={:<5} arm=xadd   conc={:<2} batch={:<2} pack={:<2} events={:>8} events/s={:>9.0} client_cpu_us/event={:>6.2} server_cpu_us/event={}",
        args.client,
        conc,
        batch,
        pack,
        events,
        events as f64 / secs,
        own,
        srv.map_or("-".into(), |s| format!("{s:.2}")),
    );
    Ok(())
}

async fn xrange_arm(store: &Store, args: &Args) -> Res<()> {
    store.simple("FLUSHDB", &[]).await?;
    let key = "mra:{resume}:ev:1";
    let payload = payload();
    let total = 10_000u64;
    let mut n = 1;
    while n <= total {
        store
            .xadd_batch(key, n, 64.min(total - n + 1), &payload)
            .await?;
        n += 64;
    }
    // MINID ~ trimmed below total - KEEP: read after cursors within what is kept.
    let low = total - KEEP;
    let mut hist = Histogram::<u64>::new(3)?;
    let cpu = Cpu::start(&args.server_pid);
    let deadline = Instant::now() + Duration::from_secs_f64(args.secs);
    let mut x = 12345u64;
    let mut reads = 0u64;
    let mut short = 0u64;
    while Instant::now() < deadline {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let after = low + (x >> 33) % (KEEP - 100);
        let t = Instant::now();
        let got = store.xrange_after(key, after, 100).await?;
        hist.record(t.elapsed().as_micros() as u64)?;
        reads += 1;
        if got != 100 {
            short += 1;
        }
    }
    let (own, srv) = cpu.per(reads);
    println!(
        "client={:<5} arm=xrange count=100 reads={:>7} short={} p50_us={} p99_us={} max_us={} client_cpu_us/read={:.1} server_cpu_us/read={}",
        args.client,
        reads,
        short,
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.99),
        hist.max(),
        own,
        srv.map_or("-".into(), |s| format!("{s:.1}")),
    );
    Ok(())
}

fn used_memory(info: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

async fn memory_arm(store: &Store) -> Res<()> {
    store.simple("FLUSHDB", &[]).await?;
    let before = used_memory(&store.simple("INFO", &["memory"]).await?);
    let payload = payload();
    let (streams, entries) = (1_000u64, KEEP);
    for s in 0..streams {
        let key = format!("mra:{{mem{s}}}:ev:1");
        let mut n = 1;
        while n <= entries {
            store
                .xadd_batch(&key, n, 64.min(entries - n + 1), &payload)
                .await?;
            n += 64;
        }
    }
    let after = used_memory(&store.simple("INFO", &["memory"]).await?);
    let per = (after.saturating_sub(before)) as f64 / (streams * entries) as f64;
    println!(
        "arm=memory streams={streams} entries/stream={entries} event_bytes={EVENT_BYTES} used_memory_delta={} bytes/entry={per:.1}",
        after.saturating_sub(before)
    );
    store.simple("FLUSHDB", &[]).await?;
    Ok(())
}

fn list(s: &str) -> Vec<u64> {
    s.split(',').filter_map(|v| v.trim().parse().ok()).collect()
}

fn aead_arm(secs: f64) -> Res<()> {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305};
    let event = payload();
    for (name, alg) in [
        ("aes-256-gcm", &AES_256_GCM),
        ("chacha20-poly1305", &CHACHA20_POLY1305),
    ] {
        // A per-session key (derived once from the key file's key and the session), cached.
        let key = LessSafeKey::new(UnboundKey::new(alg, &[7u8; 32]).map_err(|_| "key")?);
        let session = b"0123456789abcdefghij"; // the hashed id: 20 bytes
        let mut buf = Vec::with_capacity(EVENT_BYTES + 16);
        let t0 = Instant::now();
        let cpu = Cpu::start(&None);
        let mut n = 0u64;
        let (stream, mut seq) = (3u32, 0u64);
        while t0.elapsed().as_secs_f64() < secs {
            for _ in 0..1000 {
                seq += 1;
                let mut nonce = [0u8; 12];
                nonce[..4].copy_from_slice(&stream.to_be_bytes());
                nonce[4..].copy_from_slice(&seq.to_be_bytes());
                let mut aad = [0u8; 32];
                aad[..20].copy_from_slice(session);
                aad[20..24].copy_from_slice(&stream.to_be_bytes());
                aad[24..].copy_from_slice(&seq.to_be_bytes());
                buf.clear();
                buf.extend_from_slice(&event);
                key.seal_in_place_append_tag(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from(aad),
                    &mut buf,
                )
                .map_err(|_| "seal")?;
                std::hint::black_box(&buf);
                n += 1;
            }
        }
        let (own, _) = cpu.per(n);
        println!(
            "arm=aead alg={name:<17} event_bytes={EVENT_BYTES} sealed_bytes={} events={n} ns/event={:.0} cpu_ns/event={:.0}",
            buf.len(),
            t0.elapsed().as_secs_f64() * 1e9 / n as f64,
            own * 1e3,
        );
    }
    Ok(())
}

fn main() -> Res<()> {
    let args = Args::parse();
    if args.aead {
        aead_arm(args.secs.min(2.0))?;
        if args.client == "none" {
            return Ok(());
        }
    }
    // One thread: the client's CPU per event is that thread's (and the driver tasks' it spawns).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let store = Store::connect(&args.client, &args.url).await?;
        for conc in list(&args.conc) {
            for batch in list(&args.batches) {
                for pack in list(&args.pack) {
                    xadd_arm(&store, &args, conc, batch, pack).await?;
                }
            }
        }
        xrange_arm(&store, &args).await?;
        if args.memory {
            memory_arm(&store).await?;
        }
        Res::Ok(())
    })
}
