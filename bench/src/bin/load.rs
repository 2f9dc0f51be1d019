//! SSE / JSON load client. Every mode checks what it receives (per-stream sequence
//! continuity from the payload, strictly increasing gateway ids where present, gateway
//! control events) and prints one JSON object on stdout.
//!
//! Modes:
//!   sse     K sessions, one POST-started stream each, saturating or paced; throughput and
//!           per-event latency (receive time − the mock's send stamp, one clock)
//!   json    small JSON POSTs (`ping`) on C keep-alive connections, saturating or paced; with
//!           `--tool-events N` short tool calls instead: each a `tools/call` the mock answers
//!           with an SSE stream of N progress events and the result
//!   idle    N sessions each holding a standalone GET stream; prints READY and holds until
//!           stdin closes
//!   window  N sessions each receive E events of S bytes on a POST stream; prints READY and
//!           holds until stdin closes
//!   storm   N sessions read E events on the standalone stream and detach; then all resume
//!           B events back at once; time from connect to the last replayed event. Through
//!           the gateway, or (`--plain-store`) against a server with its own event store
//!   resume  a fleet of two replicas on one store (`--target` A, `--other` B): per session, a
//!           call through A whose upstream writes its events `--gap-us` apart, cut after its
//!           first event, resumed on B (which never saw the session) with that event's id;
//!           time from the GET to the `mcp-reattach/resumed` event and to the first replayed
//!           event, and the age of the live tail's events as B serves them from the store
//!   call-storm  the worst minute (issue 50, `mcp_reattach_bench::call_storm`): N sessions
//!           each with a call in flight (`--targets`: one gateway, or a fleet's replicas),
//!           every connection cut at once (with `--kill-pid`, a replica killed with it), every
//!           session resuming at once until its call's result or explicit error; RSS and CPU
//!           of the `--watch-pids` gateways over the storm

use std::cell::RefCell;
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use hdrhistogram::Histogram;
use mcp_reattach_bench::clock::now_ns;
use mcp_reattach_bench::http::{self, BodyState, Conn, Head};
use mcp_reattach_bench::{call_storm, checks, payload, sse};
use serde_json::{json, Value};

#[derive(Parser)]
struct Cli {
    #[arg(long)]
    target: SocketAddr,
    /// Speak TLS to the target, trusting the CA certificates in this PEM file (the sse and
    /// json modes; json with --rate stays plain).
    #[arg(long)]
    tls_ca: Option<std::path::PathBuf>,
    #[arg(long, default_value = "/mcp")]
    path: String,
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    Sse {
        #[arg(long, default_value_t = 1)]
        streams: usize,
        #[arg(long, default_value_t = 200)]
        size: usize,
        /// Events per second per stream; 0 saturates.
        #[arg(long, default_value_t = 0.0)]
        rate: f64,
        #[arg(long, default_value_t = 2000)]
        duration_ms: u64,
        /// Events per stream instead of a duration (fixed work, e.g. under callgrind).
        #[arg(long, default_value_t = 0)]
        events: u64,
        /// Latency samples from events sent in the first this-many ms are dropped.
        #[arg(long, default_value_t = 200)]
        warmup_ms: u64,
        /// Random start phase within one period for each stream (paced mode).
        #[arg(long)]
        random_phase: bool,
        /// Saturating mode: the mock formats this many events into one buffer and writes
        /// them with one `write` (each still its own HTTP chunk, seq and send stamp), as a
        /// busy server does. 1 = one `write` per event.
        #[arg(long, default_value_t = 1)]
        burst: u64,
        /// KiB asked of the kernel per `read` on each stream (larger reads thrash the cache
        /// with 8 streams).
        #[arg(long, default_value_t = 64)]
        read_kib: usize,
    },
    Json {
        #[arg(long, default_value_t = 8)]
        conns: usize,
        /// Total requests per second; 0 saturates (closed loop).
        #[arg(long, default_value_t = 0.0)]
        rate: f64,
        #[arg(long, default_value_t = 2000)]
        duration_ms: u64,
        #[arg(long, default_value_t = 200)]
        warmup_ms: u64,
        /// Requests per connection instead of a duration (saturating mode only).
        #[arg(long, default_value_t = 0)]
        requests: u64,
        /// Short tool calls instead of pings: each a `tools/call` answered by an SSE stream of
        /// this many 200 B progress events and the result.
        #[arg(long)]
        tool_events: Option<u64>,
        /// With `--tool-events`: the upstream's pause before each event and the result, in
        /// µs (each its own write, as SDK servers stream a running tool's progress).
        #[arg(long, default_value_t = 0)]
        tool_gap_us: u64,
    },
    Idle {
        #[arg(long)]
        sessions: usize,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
    },
    Window {
        #[arg(long)]
        sessions: usize,
        #[arg(long, default_value_t = 300)]
        events: u64,
        #[arg(long, default_value_t = 200)]
        size: usize,
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Exit after reading instead of holding until stdin closes.
        #[arg(long)]
        no_hold: bool,
    },
    Storm {
        #[arg(long, default_value_t = 1000)]
        sessions: usize,
        #[arg(long, default_value_t = 200)]
        events: u64,
        #[arg(long, default_value_t = 100)]
        back: u64,
        #[arg(long, default_value_t = 200)]
        size: usize,
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// After the setup, print SETUP-DONE and wait for a line on stdin before the storm
        /// (lets a profiler zero its counters in between).
        #[arg(long)]
        wait_stdin: bool,
        /// The target is a server that resumes streams with its own event store (the
        /// `ts-eventstore` arm), not the gateway: its ids are opaque strings (not parsed for
        /// order) and a resume has no `mcp-reattach/resumed` event, just the replay.
        #[arg(long)]
        plain_store: bool,
    },
    Resume {
        /// The replica the calls are resumed on (B); `--target` is the one they run through (A).
        #[arg(long)]
        other: SocketAddr,
        #[arg(long, default_value_t = 300)]
        sessions: usize,
        /// Progress events per call (200 B, each its own upstream write, `--gap-us` apart).
        #[arg(long, default_value_t = 20)]
        events: u64,
        #[arg(long, default_value_t = 500)]
        gap_us: u64,
        /// Pause between the cut on A and the GET on B, in ms: the call goes on upstream
        /// meanwhile, so the events after the cursor are in the store to replay.
        #[arg(long, default_value_t = 2)]
        wait_ms: u64,
        #[arg(long, default_value_t = 4)]
        concurrency: usize,
        /// No session starts after this many ms (the run is bounded in time as in count).
        #[arg(long, default_value_t = 30_000)]
        max_ms: u64,
    },
    CallStorm {
        /// Comma-separated gateways (default: `--target`): session i is created and calls on
        /// the (i mod n)th; each resume goes to the next one.
        #[arg(long, value_delimiter = ',')]
        targets: Vec<SocketAddr>,
        #[arg(long, default_value_t = 1000)]
        sessions: usize,
        /// Progress events per call, the upstream's pause before each (and the result).
        #[arg(long, default_value_t = 40)]
        events: u64,
        #[arg(long, default_value_t = 150_000)]
        gap_us: u64,
        #[arg(long, default_value_t = 200)]
        size: usize,
        /// The cut comes once every session has read this many events.
        #[arg(long, default_value_t = 2)]
        cut_after: u64,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// The cut comes after this long at the latest.
        #[arg(long, default_value_t = 30_000)]
        setup_ms: u64,
        /// A call without its outcome this long after the cut is lost.
        #[arg(long, default_value_t = 20_000)]
        max_ms: u64,
        /// Resume GETs per session at most.
        #[arg(long, default_value_t = 20)]
        max_attempts: u32,
        /// Wait before a reconnect when the server sent no `retry:` (SDK clients: 1000).
        #[arg(long, default_value_t = 0)]
        reconnect_ms: u64,
        /// SIGKILL this process at the cut: the replica serving `--kill-target` dies.
        #[arg(long)]
        kill_pid: Option<u32>,
        /// Index in `--targets` of the replica `--kill-pid` is.
        #[arg(long, default_value_t = 0)]
        kill_target: usize,
        /// Comma-separated gateway pids whose RSS and CPU are sampled over the storm (in
        /// `--targets` order when there are as many).
        #[arg(long, value_delimiter = ',')]
        watch_pids: Vec<u32>,
        /// The target has no resumption (nginx): lost calls are reported, not failed.
        #[arg(long)]
        no_resumption: bool,
        /// Fail if the last resume is served later than this after the cut.
        #[arg(long)]
        bound_ms: Option<u64>,
        /// Every session the same anonymous caller (default: each its own principal).
        #[arg(long)]
        anonymous: bool,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Some(ca) = &cli.tls_ca {
        if let Err(e) = http::use_tls(ca) {
            println!("{}", json!({"error": format!("--tls-ca: {e}")}));
            std::process::exit(2);
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    let out = match cli.mode {
        Mode::Json {
            conns,
            rate,
            duration_ms,
            warmup_ms,
            tool_events,
            ..
        } if rate > 0.0 => match tool_events {
            // The paced client sends pings only.
            Some(_) => json!({"error": "--tool-events is saturating only (no --rate)"}),
            None => json_paced(&cli.target, &cli.path, conns, rate, duration_ms, warmup_ms),
        },
        _ => local.block_on(&rt, run(cli)),
    };
    // Why a run failed, on stderr (the orchestrator forwards it), besides the JSON.
    if out["checks"]["ok"].as_bool() == Some(false) {
        for f in out["checks"]["failures"].as_array().into_iter().flatten() {
            eprintln!("load: FAILED {}", f.as_str().unwrap_or_default());
        }
    }
    if let Some(e) = out["error"].as_str() {
        eprintln!("load: FAILED error: {e}");
    }
    println!("{out}");
}

async fn run(cli: Cli) -> Value {
    let t = cli.target;
    let p = cli.path.clone();
    match cli.mode {
        Mode::Sse {
            streams,
            size,
            rate,
            duration_ms,
            events,
            warmup_ms,
            random_phase,
            burst,
            read_kib,
        } => {
            let duration_ms = if events > 0 { 0 } else { duration_ms };
            sse_mode(
                t,
                p,
                SseOpts {
                    streams,
                    size,
                    rate,
                    duration_ms,
                    events,
                    warmup_ms,
                    random_phase,
                    burst,
                    read_kib,
                },
            )
            .await
        }
        Mode::Json {
            conns,
            duration_ms,
            warmup_ms,
            requests,
            tool_events,
            tool_gap_us,
            ..
        } => {
            let call = tool_events.map(|events| Call {
                events,
                gap_us: tool_gap_us,
            });
            json_saturate(t, p, conns, duration_ms, warmup_ms, requests, call).await
        }
        Mode::Idle {
            sessions,
            concurrency,
        } => idle_mode(t, p, sessions, concurrency).await,
        Mode::Window {
            sessions,
            events,
            size,
            concurrency,
            no_hold,
        } => window_mode(t, p, sessions, events, size, concurrency, no_hold).await,
        Mode::Storm {
            sessions,
            events,
            back,
            size,
            concurrency,
            wait_stdin,
            plain_store,
        } => {
            storm_mode(
                t,
                p,
                sessions,
                events,
                back,
                size,
                concurrency,
                wait_stdin,
                plain_store,
            )
            .await
        }
        Mode::Resume {
            other,
            sessions,
            events,
            gap_us,
            wait_ms,
            concurrency,
            max_ms,
        } => {
            resume_mode(
                t,
                other,
                p,
                ResumeOpts {
                    sessions,
                    events,
                    gap_us,
                    wait_ms,
                    concurrency,
                    max_ms,
                },
            )
            .await
        }
        Mode::CallStorm {
            targets,
            sessions,
            events,
            gap_us,
            size,
            cut_after,
            concurrency,
            setup_ms,
            max_ms,
            max_attempts,
            reconnect_ms,
            kill_pid,
            kill_target,
            watch_pids,
            no_resumption,
            bound_ms,
            anonymous,
        } => {
            let targets = if targets.is_empty() { vec![t] } else { targets };
            let per_target = watch_pids.len() == targets.len();
            let mut cfg = call_storm::Config::new(targets);
            cfg.path = p;
            cfg.sessions = sessions;
            cfg.events = events;
            cfg.gap_us = gap_us;
            cfg.size = size;
            cfg.cut_after = cut_after;
            cfg.concurrency = concurrency;
            cfg.setup_ms = setup_ms;
            cfg.max_ms = max_ms;
            cfg.max_attempts = max_attempts;
            cfg.reconnect_ms = reconnect_ms;
            cfg.killed = kill_pid.map(|_| kill_target);
            cfg.no_resumption = no_resumption;
            cfg.bound_ms = bound_ms;
            cfg.principals = !anonymous;
            cfg.watch = watch_pids
                .iter()
                .enumerate()
                .map(|(i, &pid)| (pid, per_target.then_some(i)))
                .collect();
            let kill: Box<dyn FnOnce() + Send> = Box::new(move || {
                if let Some(pid) = kill_pid {
                    // SAFETY: kill(2) with a pid and a signal number.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                }
            });
            call_storm::run(cfg, kill).await
        }
    }
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap()
}

fn pct_us(h: &Histogram<u64>) -> Value {
    let us = |v: u64| (v as f64 / 1000.0 * 10.0).round() / 10.0;
    json!({
        "count": h.len(),
        "p50_us": us(h.value_at_quantile(0.50)),
        "p90_us": us(h.value_at_quantile(0.90)),
        "p99_us": us(h.value_at_quantile(0.99)),
        "p999_us": us(h.value_at_quantile(0.999)),
        "max_us": us(h.max()),
        "mean_us": (h.mean() / 1000.0 * 10.0).round() / 10.0,
    })
}

static REQ_ID: AtomicU64 = AtomicU64::new(1);

fn rpc(method: &str, params: Value) -> Vec<u8> {
    let id = REQ_ID.fetch_add(1, Ordering::Relaxed);
    serde_json::to_vec(&json!({"jsonrpc":"2.0","id":id,"method":method,"params":params})).unwrap()
}

/// Connects and initializes a session; returns the connection (kept alive) and the id.
async fn initialize(target: SocketAddr, path: &str) -> std::io::Result<(Conn, String)> {
    let mut c = Conn::connect(target).await?;
    let body = rpc(
        "initialize",
        json!({"protocolVersion": http::PROTOCOL_VERSION, "capabilities": {}, "clientInfo": {"name":"bench","version":"0"}}),
    );
    let (head, _) = c
        .roundtrip(&http::request("POST", path, &target, None, &[], &body))
        .await?;
    let sid = head
        .header("mcp-session-id")
        .ok_or_else(|| {
            std::io::Error::other(format!(
                "initialize: status {} without Mcp-Session-Id",
                head.status
            ))
        })?
        .to_owned();
    Ok((c, sid))
}

/// What one SSE stream delivered, with its checks.
#[derive(Default, Debug)]
struct StreamStats {
    events: u64,
    data_bytes: u64,
    first_ns: u64,
    last_ns: u64,
    next_seq: u64,
    seq_errors: u64,
    ids: u64,
    last_id_seq: Option<u64>,
    id_errors: u64,
    control: Vec<String>,
    result: bool,
    /// Gateway ids of the data events, when asked to keep them.
    kept_ids: Option<Vec<String>>,
    /// `replay` of a resumed event.
    replay: Option<u64>,
    /// When the resumed event was read (0: none came).
    resumed_ns: u64,
}

struct ReadOpts<'a> {
    /// Latency samples for events sent at or after this time.
    record_from: u64,
    hist: Option<&'a mut Histogram<u64>>,
    /// Stop after this many data events (standalone streams never end).
    stop_after: Option<u64>,
    keep_ids: bool,
    /// The target sets its own opaque event ids (a server with an event store, no gateway):
    /// ids are not parsed for order; every data event must carry one.
    opaque_ids: bool,
}

/// Reads an SSE body to its end (or `stop_after` events), checking as it goes. The body is
/// parsed where it lies in the connection's read buffer (no copy, no allocation per event).
async fn read_sse(
    c: &mut Conn,
    head: &Head,
    start_seq: u64,
    o: ReadOpts<'_>,
) -> std::io::Result<StreamStats> {
    let mut r = Reader {
        st: StreamStats {
            next_seq: start_seq,
            kept_ids: o.keep_ids.then(Vec::new),
            ..StreamStats::default()
        },
        o,
        stop: false,
    };
    let mut body = BodyState::new(head.body);
    let mut parser = sse::Parser::new();
    loop {
        let more = c
            .read_body_with(&mut body, &mut |d: &[u8], now: u64| {
                parser.feed(d, &mut |ev| r.on_event(ev, now))
            })
            .await?;
        if !more || r.stop {
            return Ok(r.st);
        }
    }
}

/// The checks of [`read_sse`], event by event.
struct Reader<'a> {
    st: StreamStats,
    o: ReadOpts<'a>,
    /// `stop_after` reached: later events are ignored.
    stop: bool,
}

impl Reader<'_> {
    fn on_event(&mut self, ev: sse::Ev<'_>, now: u64) {
        if ev.comment_only || self.stop {
            return;
        }
        let st = &mut self.st;
        let kind = ev.event.unwrap_or(b"message");
        let parsed = if kind == b"message" {
            ev.data.and_then(payload::parse)
        } else {
            None
        };
        if self.o.opaque_ids {
            if ev.id.is_some() {
                st.ids += 1;
            } else if parsed.is_some() {
                st.id_errors += 1;
            }
        } else if let Some(id) = ev.id {
            st.ids += 1;
            // Ids of upstream events must strictly increase. The gateway's own events
            // (resumed, failures and their JSON-RPC errors) carry the client's cursor.
            if parsed.is_some() {
                match sse::id_seq(id) {
                    Some(s) => {
                        if st.last_id_seq.is_some_and(|l| s <= l) {
                            st.id_errors += 1;
                        }
                        st.last_id_seq = Some(s);
                    }
                    None => st.id_errors += 1,
                }
            }
        }
        if kind != b"message" {
            let k = String::from_utf8_lossy(kind).into_owned();
            if k == "mcp-reattach/resumed" {
                st.resumed_ns = now;
                if let Some(v) = ev
                    .data
                    .and_then(|d| serde_json::from_slice::<Value>(d).ok())
                {
                    st.replay = v.get("replay").and_then(Value::as_u64);
                }
            }
            st.control.push(k);
            return;
        }
        let Some(data) = ev.data else { return };
        let Some((seq, ts, is_result)) = parsed else {
            // A gateway-written JSON-RPC error (gap, upstream failure) or something else.
            st.control.push(checks::message_key(data));
            return;
        };
        if st.events == 0 {
            st.first_ns = now;
        }
        st.last_ns = now;
        st.data_bytes += data.len() as u64;
        if is_result {
            st.result = true;
        } else {
            st.events += 1;
            if seq != st.next_seq {
                st.seq_errors += 1;
            }
            st.next_seq = seq + 1;
        }
        if let (Some(k), Some(id)) = (st.kept_ids.as_mut(), ev.id) {
            k.push(String::from_utf8_lossy(id).into_owned());
        }
        if ts >= self.o.record_from {
            if let Some(h) = self.o.hist.as_deref_mut() {
                let _ = h.record(now.saturating_sub(ts).max(1));
            }
        }
        if self.o.stop_after.is_some_and(|n| st.events >= n) {
            self.stop = true;
        }
    }
}

struct SseOpts {
    streams: usize,
    size: usize,
    rate: f64,
    duration_ms: u64,
    events: u64,
    warmup_ms: u64,
    random_phase: bool,
    burst: u64,
    read_kib: usize,
}

async fn sse_mode(target: SocketAddr, path: String, o: SseOpts) -> Value {
    let SseOpts {
        streams,
        size,
        rate,
        duration_ms,
        events,
        warmup_ms,
        random_phase,
        burst,
        read_kib,
    } = o;
    // Sessions first, so every stream starts together.
    let mut conns = Vec::new();
    for _ in 0..streams {
        match initialize(target, &path).await {
            Ok(c) => conns.push(c),
            Err(e) => return json!({"error": format!("initialize: {e}")}),
        }
    }
    let hist = Rc::new(RefCell::new(hist()));
    let start = now_ns();
    let record_from = start + warmup_ms * 1_000_000;
    let mut tasks = Vec::new();
    let mut seed = start ^ 0x9e37_79b9_7f4a_7c15;
    for (c, sid) in conns {
        let phase_us = if random_phase && rate > 0.0 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % ((1e6 / rate) as u64).max(1)
        } else {
            0
        };
        let body = rpc(
            "tools/call",
            json!({"name":"stream","arguments":{"events":events,"size":size,"rate":rate,"phase_us":phase_us,"duration_ms":duration_ms,"burst":burst}}),
        );
        let req = http::request("POST", &path, &target, Some(&sid), &[], &body);
        let del = http::request("DELETE", &path, &target, Some(&sid), &[], b"");
        let hist = hist.clone();
        tasks.push(tokio::task::spawn_local(async move {
            let mut c = c;
            c.set_read_size(read_kib * 1024);
            c.send(&req).await?;
            let head = c.read_head().await?;
            if head.status != 200 {
                return Err(std::io::Error::other(format!("status {}", head.status)));
            }
            let mut h = hist.borrow().clone();
            h.reset();
            let st = read_sse(
                &mut c,
                &head,
                0,
                ReadOpts {
                    record_from,
                    hist: Some(&mut h),
                    stop_after: None,
                    keep_ids: false,
                    opaque_ids: false,
                },
            )
            .await?;
            hist.borrow_mut().add(&h).ok();
            let _ = c.roundtrip(&del).await;
            Ok::<_, std::io::Error>(st)
        }));
    }
    let mut agg = Agg::default();
    for t in tasks {
        match t.await.unwrap() {
            Ok(st) => agg.add(&st),
            Err(e) => agg.errors.push(e.to_string()),
        }
    }
    let secs = (agg.last_ns.saturating_sub(agg.first_ns)) as f64 / 1e9;
    let h = hist.borrow();
    json!({
        "mode": "sse", "streams": streams, "size": size, "rate_per_stream": rate, "burst": burst,
        "events": agg.events, "data_bytes": agg.data_bytes, "seconds": secs,
        "events_per_s": if secs > 0.0 { agg.events as f64 / secs } else { 0.0 },
        "data_mb_per_s": if secs > 0.0 { agg.data_bytes as f64 / secs / 1e6 } else { 0.0 },
        "latency": pct_us(&h),
        "checks": agg.checks(streams),
    })
}

/// Marks a checks object failed with one more reason.
fn fail(checks: &mut Value, reason: String) {
    checks["ok"] = json!(false);
    match checks["failures"].as_array_mut() {
        Some(a) => a.push(json!(reason)),
        None => checks["failures"] = json!([reason]),
    }
}

#[derive(Default)]
struct Agg {
    events: u64,
    data_bytes: u64,
    first_ns: u64,
    last_ns: u64,
    seq_errors: u64,
    id_errors: u64,
    ids: u64,
    results: u64,
    control: std::collections::BTreeMap<String, u64>,
    errors: Vec<String>,
}

impl Agg {
    fn add(&mut self, st: &StreamStats) {
        self.events += st.events;
        self.data_bytes += st.data_bytes;
        if st.events > 0 {
            if self.first_ns == 0 || st.first_ns < self.first_ns {
                self.first_ns = st.first_ns;
            }
            self.last_ns = self.last_ns.max(st.last_ns);
        }
        self.seq_errors += st.seq_errors;
        self.id_errors += st.id_errors;
        self.ids += st.ids;
        self.results += u64::from(st.result);
        for c in &st.control {
            *self.control.entry(c.clone()).or_default() += 1;
        }
    }

    /// The checks object of the output: `ok`, `failures` (each `<check>: <detail>`, see
    /// `checks::failures`) and the counts behind them.
    fn checks(&self, expected_results: usize) -> Value {
        let failures = checks::failures(&checks::Seen {
            seq_errors: self.seq_errors,
            id_errors: self.id_errors,
            results: self.results,
            expected_results: expected_results as u64,
            control: Some(&self.control),
            errors: &self.errors,
        });
        json!({
            "ok": failures.is_empty(), "failures": failures,
            "seq_errors": self.seq_errors, "id_errors": self.id_errors,
            "ids_seen": self.ids, "results": self.results, "control_events": self.control,
            "errors": self.errors.iter().take(5).collect::<Vec<_>>(), "error_count": self.errors.len(),
        })
    }
}

/// An SSE event carrying a JSON-RPC message.
const MESSAGE_EVENT: &[u8] = b"data: {\"jsonrpc\"";

/// A JSON-RPC answer: a JSON body, or (the gateway's `--json-upgrade`) an SSE stream that
/// carries it as an event.
fn is_answer(body: &[u8]) -> bool {
    body.starts_with(b"{\"jsonrpc\"")
        || body
            .windows(MESSAGE_EVENT.len())
            .any(|w| w == MESSAGE_EVENT)
}

/// A short tool call of the json mode: its progress events, and the upstream's pause before
/// each of its writes.
#[derive(Clone, Copy)]
struct Call {
    events: u64,
    gap_us: u64,
}

/// One request of the json mode, with a fresh id (as every client sends: one id sent again
/// is a retransmission, which the gateway answers from its window): a `ping`, or with
/// `call` a short tool call.
fn json_request(path: &str, target: &SocketAddr, sid: &str, call: Option<Call>) -> Vec<u8> {
    let body = match call {
        None => rpc("ping", json!({})),
        Some(Call { events, gap_us }) => rpc(
            "tools/call",
            json!({"name": "stream", "arguments": {"events": events, "size": 200, "gap_us": gap_us}}),
        ),
    };
    http::request("POST", path, target, Some(sid), &[], &body)
}

/// Whether `body` answers a request of the json mode whole: the answer, after exactly the
/// `tool_events` progress events of a tool call.
fn answered(body: &[u8], tool_events: Option<u64>) -> bool {
    match tool_events {
        None => is_answer(body),
        Some(n) => {
            let messages = body
                .windows(MESSAGE_EVENT.len())
                .filter(|w| *w == MESSAGE_EVENT)
                .count();
            messages as u64 == n + 1 && body.windows(7).any(|w| w == b"\"result")
        }
    }
}

async fn json_saturate(
    target: SocketAddr,
    path: String,
    conns: usize,
    duration_ms: u64,
    warmup_ms: u64,
    requests: u64,
    call: Option<Call>,
) -> Value {
    let (duration_ms, warmup_ms) = if requests > 0 {
        (u64::MAX / 4_000_000, 0)
    } else {
        (duration_ms, warmup_ms)
    };
    let mut cs = Vec::new();
    for _ in 0..conns {
        match initialize(target, &path).await {
            Ok(c) => cs.push(c),
            Err(e) => return json!({"error": format!("initialize: {e}")}),
        }
    }
    let start = now_ns();
    let measure_from = start + warmup_ms * 1_000_000;
    let end = measure_from + duration_ms * 1_000_000;
    let hist = Rc::new(RefCell::new(hist()));
    let mut tasks = Vec::new();
    for (mut c, sid) in cs {
        let hist = hist.clone();
        let path = path.clone();
        tasks.push(tokio::task::spawn_local(async move {
            let mut n = 0u64;
            let mut errors = 0u64;
            loop {
                let t0 = now_ns();
                if t0 >= end || (requests > 0 && n >= requests) {
                    break;
                }
                let req = json_request(&path, &target, &sid, call);
                match c.roundtrip(&req).await {
                    Ok((h, b)) if h.status == 200 && answered(&b, call.map(|c| c.events)) => {
                        let t1 = now_ns();
                        if t0 >= measure_from {
                            n += 1;
                            let _ = hist.borrow_mut().record(t1 - t0);
                        }
                    }
                    Ok(_) => errors += 1,
                    Err(_) => {
                        errors += 1;
                        break;
                    }
                }
            }
            (n, errors)
        }));
    }
    let (mut n, mut errors) = (0, 0);
    for t in tasks {
        let (a, b) = t.await.unwrap();
        n += a;
        errors += b;
    }
    let secs = if requests > 0 {
        (now_ns() - start) as f64 / 1e9
    } else {
        duration_ms as f64 / 1e3
    };
    json!({
        "mode": "json", "conns": conns, "requests": n, "seconds": secs,
        "requests_per_s": n as f64 / secs, "latency": pct_us(&hist.borrow()),
        "checks": {"ok": errors == 0, "errors": errors,
            "failures": if errors > 0 { vec![format!("error: {errors} request(s) failed")] } else { vec![] }},
    })
}

/// Open-loop JSON at a fixed total rate: one blocking thread per connection with precise
/// sleeps (tokio's timer has 1 ms granularity). Latency is from the actual send.
fn json_paced(
    target: &SocketAddr,
    path: &str,
    conns: usize,
    rate: f64,
    duration_ms: u64,
    warmup_ms: u64,
) -> Value {
    // SAFETY: prctl with PR_SET_TIMERSLACK takes an integer argument.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0u64, 0u64, 0u64) };
    let period = (1e9 * conns as f64 / rate) as u64;
    let start = now_ns() + 50_000_000;
    let measure_from = start + warmup_ms * 1_000_000;
    let end = measure_from + duration_ms * 1_000_000;
    let mut threads = Vec::new();
    for i in 0..conns {
        let target = *target;
        let path = path.to_owned();
        threads.push(std::thread::spawn(move || -> Result<(Histogram<u64>, u64, u64), String> {
            let mut s = TcpStream::connect(target).map_err(|e| e.to_string())?;
            s.set_nodelay(true).ok();
            let body = rpc(
                "initialize",
                json!({"protocolVersion": http::PROTOCOL_VERSION, "capabilities": {}, "clientInfo": {"name":"bench","version":"0"}}),
            );
            let (head, _) = blocking_roundtrip(&mut s, &http::request("POST", &path, &target, None, &[], &body))?;
            let sid = head_header(&head, "mcp-session-id").ok_or("no session id")?;
            let mut h = hist();
            let mut late = 0u64;
            let mut errors = 0u64;
            let mut k = 0u64;
            loop {
                let due = start + i as u64 * period / conns as u64 + k * period;
                if due >= end {
                    break;
                }
                k += 1;
                // Built before the wait.
                let req = json_request(&path, &target, &sid, None);
                let now = now_ns();
                if due > now {
                    std::thread::sleep(Duration::from_nanos(due - now));
                } else if now - due > 1_000_000 {
                    late += 1;
                }
                let t0 = now_ns();
                match blocking_roundtrip(&mut s, &req) {
                    Ok((hd, b)) if hd.starts_with("HTTP/1.1 200") && is_answer(&b) => {
                        if due >= measure_from {
                            let _ = h.record(now_ns() - t0);
                        }
                    }
                    _ => {
                        errors += 1;
                        break;
                    }
                }
            }
            Ok((h, late, errors))
        }));
    }
    let mut all = hist();
    let (mut late, mut errors) = (0, 0);
    let mut errs = Vec::new();
    for t in threads {
        match t.join().unwrap() {
            Ok((h, l, e)) => {
                all.add(&h).ok();
                late += l;
                errors += e;
            }
            Err(e) => errs.push(e),
        }
    }
    json!({
        "mode": "json-paced", "conns": conns, "rate": rate, "requests": all.len(),
        "latency": pct_us(&all),
        "checks": {"ok": errors == 0 && errs.is_empty(), "errors": errors, "late_sends": late,
            "failures": errs.iter().map(|e| format!("error: {e}"))
                .chain((errors > 0).then(|| format!("error: {errors} request(s) failed")))
                .collect::<Vec<_>>()},
    })
}

fn head_header(head: &str, name: &str) -> Option<String> {
    head.split("\r\n").find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_owned())
    })
}

/// Blocking request/response: a Content-Length body (a JSON answer) or a chunked one (the
/// gateway's `--json-upgrade`: the answer as an SSE stream), returned decoded.
fn blocking_roundtrip(s: &mut TcpStream, req: &[u8]) -> Result<(String, Vec<u8>), String> {
    s.write_all(req).map_err(|e| e.to_string())?;
    let mut buf = Vec::with_capacity(1024);
    let mut tmp = [0u8; 4096];
    let mut more = |buf: &mut Vec<u8>, what: &str| -> Result<(), String> {
        let n = s.read(&mut tmp).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!("eof in {what}"));
        }
        buf.extend_from_slice(&tmp[..n]);
        Ok(())
    };
    let end = loop {
        if let Some(end) = memchr::memmem::find(&buf, b"\r\n\r\n") {
            break end;
        }
        more(&mut buf, "head")?;
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let mut at = end + 4;
    if head_header(&head, "transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        let mut body = Vec::new();
        loop {
            let Some(eol) = memchr::memmem::find(&buf[at..], b"\r\n") else {
                more(&mut buf, "chunk size")?;
                continue;
            };
            let size = std::str::from_utf8(&buf[at..at + eol])
                .ok()
                .and_then(|v| usize::from_str_radix(v.trim(), 16).ok())
                .ok_or("bad chunk size")?;
            // The chunk, its CRLF (or for the last one, the CRLF that ends the body).
            while buf.len() < at + eol + 2 + size + 2 {
                more(&mut buf, "chunk")?;
            }
            body.extend_from_slice(&buf[at + eol + 2..at + eol + 2 + size]);
            at += eol + 2 + size + 2;
            if size == 0 {
                return Ok((head, body));
            }
        }
    }
    let len: usize = head_header(&head, "content-length")
        .and_then(|v| v.parse().ok())
        .ok_or("response with neither Content-Length nor chunked framing")?;
    while buf.len() < at + len {
        more(&mut buf, "body")?;
    }
    at += len;
    Ok((head, buf[end + 4..at].to_vec()))
}

/// Waits until stdin closes (the orchestrator's signal to release everything).
async fn hold_until_stdin_closes() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
    })
    .await;
}

fn ready(v: &Value) {
    println!("READY {v}");
    std::io::stdout().flush().ok();
}

async fn bounded<F, Fut, T>(n: usize, concurrency: usize, f: F) -> Vec<T>
where
    F: Fn(usize) -> Fut + 'static,
    Fut: std::future::Future<Output = T> + 'static,
    T: 'static,
{
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let f = Rc::new(f);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let f = f.clone();
        tasks.push(tokio::task::spawn_local(async move {
            let r = f(i).await;
            drop(permit);
            r
        }));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

async fn idle_mode(target: SocketAddr, path: String, sessions: usize, concurrency: usize) -> Value {
    let path = Rc::new(path);
    let t0 = now_ns();
    let held = bounded(sessions, concurrency, move |_| {
        let path = path.clone();
        async move {
            let (mut c, sid) = initialize(target, &path).await.map_err(|e| e.to_string())?;
            c.send(&http::request(
                "GET",
                &format!("{path}?events=0"),
                &target,
                Some(&sid),
                &[],
                b"",
            ))
            .await
            .map_err(|e| e.to_string())?;
            let head = c.read_head().await.map_err(|e| e.to_string())?;
            if head.status != 200 {
                return Err(format!("GET status {}", head.status));
            }
            Ok(c)
        }
    })
    .await;
    let ok = held.iter().filter(|r| r.is_ok()).count();
    let errs: Vec<String> = held
        .iter()
        .filter_map(|r| r.as_ref().err().cloned())
        .take(5)
        .collect();
    let v = json!({"mode":"idle","sessions":sessions,"held":ok,"setup_s": (now_ns()-t0) as f64/1e9,
    "checks":{"ok": ok == sessions, "errors": errs,
        "failures": if ok == sessions { vec![] } else {
            vec![format!("error: {} of {sessions} sessions not held ({})", sessions - ok, errs.join("; "))]
        }}});
    ready(&v);
    hold_until_stdin_closes().await;
    drop(held);
    v
}

#[allow(clippy::too_many_arguments)]
async fn window_mode(
    target: SocketAddr,
    path: String,
    sessions: usize,
    events: u64,
    size: usize,
    concurrency: usize,
    no_hold: bool,
) -> Value {
    let path = Rc::new(path);
    let t0 = now_ns();
    let res = bounded(sessions, concurrency, move |_| {
        let path = path.clone();
        async move {
            let (mut c, sid) = initialize(target, &path).await?;
            let body = rpc(
                "tools/call",
                json!({"name":"stream","arguments":{"events":events,"size":size,"rate":0}}),
            );
            c.send(&http::request(
                "POST",
                &path,
                &target,
                Some(&sid),
                &[],
                &body,
            ))
            .await?;
            let head = c.read_head().await?;
            if head.status != 200 {
                return Err(std::io::Error::other(format!("status {}", head.status)));
            }
            read_sse(
                &mut c,
                &head,
                0,
                ReadOpts {
                    record_from: u64::MAX,
                    hist: None,
                    stop_after: None,
                    keep_ids: false,
                    opaque_ids: false,
                },
            )
            .await
        }
    })
    .await;
    let mut agg = Agg::default();
    let mut short = 0;
    for r in &res {
        match r {
            Ok(st) => {
                if st.events != events {
                    short += 1;
                }
                agg.add(st)
            }
            Err(e) => agg.errors.push(e.to_string()),
        }
    }
    let mut checks = agg.checks(sessions);
    checks["short_streams"] = json!(short);
    if short > 0 {
        fail(
            &mut checks,
            format!("short stream: {short} stream(s) ended early"),
        );
    }
    let v = json!({"mode":"window","sessions":sessions,"events_per_session":events,"size":size,
        "events":agg.events,"ids_seen":agg.ids,"setup_s":(now_ns()-t0) as f64/1e9,"checks":checks});
    if !no_hold {
        ready(&v);
        hold_until_stdin_closes().await;
    }
    v
}

#[allow(clippy::too_many_arguments)]
async fn storm_mode(
    target: SocketAddr,
    path: String,
    sessions: usize,
    events: u64,
    back: u64,
    size: usize,
    concurrency: usize,
    wait_stdin: bool,
    plain_store: bool,
) -> Value {
    // Setup: each session reads `events` on its standalone stream, keeps the ids, detaches.
    let path = Rc::new(path);
    let p2 = path.clone();
    let setup = bounded(sessions, concurrency, move |_| {
        let path = p2.clone();
        async move {
            let (mut c, sid) = initialize(target, &path).await?;
            c.send(&http::request(
                "GET",
                &format!("{path}?events={events}&size={size}"),
                &target,
                Some(&sid),
                &[],
                b"",
            ))
            .await?;
            let head = c.read_head().await?;
            if head.status != 200 {
                return Err(std::io::Error::other(format!("status {}", head.status)));
            }
            let st = read_sse(
                &mut c,
                &head,
                0,
                ReadOpts {
                    record_from: u64::MAX,
                    hist: None,
                    stop_after: Some(events),
                    keep_ids: true,
                    opaque_ids: plain_store,
                },
            )
            .await?;
            let ids = st.kept_ids.unwrap_or_default();
            if ids.len() as u64 != events {
                return Err(std::io::Error::other(format!(
                    "got {} ids of {events}",
                    ids.len()
                )));
            }
            // Cursor: the id after which exactly `back` events follow.
            Ok((sid, ids[(events - back - 1) as usize].clone()))
        }
    })
    .await;
    let mut cursors = Vec::new();
    let mut errors = Vec::new();
    for r in setup {
        match r {
            Ok(x) => cursors.push(x),
            Err(e) => errors.push(format!("setup: {e}")),
        }
    }
    // Let the gateway see every detach before the storm.
    tokio::time::sleep(Duration::from_millis(300)).await;
    if wait_stdin {
        println!("SETUP-DONE");
        std::io::stdout().flush().ok();
        hold_until_stdin_closes().await;
    }
    let resumes = cursors.len();
    let go = Arc::new(tokio::sync::Barrier::new(cursors.len() + 1));
    let mut tasks = Vec::new();
    for (sid, cursor) in cursors {
        let go = go.clone();
        let path = path.clone();
        tasks.push(tokio::task::spawn_local(async move {
            let req = http::request(
                "GET",
                &path,
                &target,
                Some(&sid),
                &[("Last-Event-ID", &cursor)],
                b"",
            );
            go.wait().await;
            let t0 = now_ns();
            let mut c = Conn::connect(target).await?;
            c.send(&req).await?;
            let head = c.read_head().await?;
            if head.status != 200 {
                return Err(std::io::Error::other(format!(
                    "resume status {}",
                    head.status
                )));
            }
            let st = read_sse(
                &mut c,
                &head,
                events - back,
                ReadOpts {
                    record_from: u64::MAX,
                    hist: None,
                    stop_after: Some(back),
                    keep_ids: false,
                    opaque_ids: plain_store,
                },
            )
            .await?;
            Ok::<_, std::io::Error>((t0, st.last_ns, st))
        }));
    }
    go.wait().await;
    let mut h = hist();
    let (mut first, mut last) = (u64::MAX, 0u64);
    let mut agg = Agg::default();
    let mut bad_replay = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok((t0, t1, st)) => {
                first = first.min(t0);
                last = last.max(t1);
                let _ = h.record(t1.saturating_sub(t0).max(1));
                // Through the gateway, its `resumed` event states the replay; a server with
                // its own event store just replays.
                if (!plain_store && st.replay != Some(back)) || st.events != back {
                    bad_replay += 1;
                }
                // The resumed event is expected: do not count it as an anomaly.
                let mut st = st;
                st.control.retain(|c| c != "mcp-reattach/resumed");
                st.result = true;
                agg.add(&st);
            }
            Err(e) => agg.errors.push(e.to_string()),
        }
    }
    agg.errors.extend(errors);
    let mut checks = agg.checks(sessions);
    checks["bad_replay"] = json!(bad_replay);
    if bad_replay > 0 {
        fail(
            &mut checks,
            format!("bad replay: {bad_replay} resume(s) without exactly {back} replayed events"),
        );
    }
    json!({"mode":"storm","sessions":sessions,"resumes":resumes,"back":back,"plain_store":plain_store,"replayed_events":agg.events,
        "time_to_last_ms": if last > first { (last - first) as f64 / 1e6 } else { 0.0 },
        "per_session": pct_us(&h), "checks": checks})
}

struct ResumeOpts {
    sessions: usize,
    events: u64,
    gap_us: u64,
    wait_ms: u64,
    concurrency: usize,
    max_ms: u64,
}

/// One session's resume on the other replica.
struct Resumed {
    /// ns from the GET's send to the `resumed` event (`None`: it never came).
    to_resumed: Option<u64>,
    /// ns from the GET's send to the first replayed event (`None`: nothing was replayed).
    to_first: Option<u64>,
    st: StreamStats,
    /// Age (receive − the mock's send stamp) of the events the mock wrote after the GET was
    /// sent: the live tail, as the other replica serves it from the store.
    tail: Histogram<u64>,
}

/// A call through A, cut after its first event and resumed on B (`--target` A, `--other`
/// B): per session, time to the resumed event and to the first replayed event.
async fn resume_mode(a: SocketAddr, b: SocketAddr, path: String, o: ResumeOpts) -> Value {
    let ResumeOpts {
        sessions,
        events,
        gap_us,
        wait_ms,
        concurrency,
        max_ms,
    } = o;
    let path = Rc::new(path);
    let t_start = now_ns();
    let deadline = t_start + max_ms * 1_000_000;
    let res = bounded(sessions, concurrency, move |_| {
        let path = path.clone();
        async move {
            if now_ns() >= deadline {
                return Ok(None);
            }
            // The call through A, cut after its first event (seq 0); it goes on upstream.
            let (mut c, sid) = initialize(a, &path).await?;
            let body = rpc(
                "tools/call",
                json!({"name":"stream","arguments":{"events":events,"size":200,"gap_us":gap_us}}),
            );
            c.send(&http::request("POST", &path, &a, Some(&sid), &[], &body))
                .await?;
            let head = c.read_head().await?;
            if head.status != 200 {
                return Err(std::io::Error::other(format!(
                    "call status {}",
                    head.status
                )));
            }
            let first = read_sse(
                &mut c,
                &head,
                0,
                ReadOpts {
                    record_from: u64::MAX,
                    hist: None,
                    stop_after: Some(1),
                    keep_ids: true,
                    opaque_ids: false,
                },
            )
            .await?;
            let cursor = first
                .kept_ids
                .and_then(|ids| ids.into_iter().next())
                .ok_or_else(|| std::io::Error::other("the call's first event had no id"))?;
            drop(c);
            tokio::time::sleep(Duration::from_millis(wait_ms)).await;
            // The resume on B, which never saw the session: adopted, then followed from the
            // store. Timed from the GET's send (the connection is made before).
            let req = http::request(
                "GET",
                &path,
                &b,
                Some(&sid),
                &[("Last-Event-ID", &cursor)],
                b"",
            );
            let mut c = Conn::connect(b).await?;
            let mut tail = hist();
            let t0 = now_ns();
            c.send(&req).await?;
            let head = c.read_head().await?;
            if head.status != 200 {
                return Err(std::io::Error::other(format!(
                    "resume status {}",
                    head.status
                )));
            }
            let st = read_sse(
                &mut c,
                &head,
                1,
                ReadOpts {
                    record_from: t0,
                    hist: Some(&mut tail),
                    stop_after: None,
                    keep_ids: false,
                    opaque_ids: false,
                },
            )
            .await?;
            let to_resumed = (st.resumed_ns > 0).then(|| st.resumed_ns.saturating_sub(t0));
            let to_first = (st.replay.unwrap_or(0) > 0 && st.first_ns > 0)
                .then(|| st.first_ns.saturating_sub(t0));
            Ok::<_, std::io::Error>(Some(Resumed {
                to_resumed,
                to_first,
                st,
                tail,
            }))
        }
    })
    .await;
    let (mut to_resumed, mut to_first, mut tail) = (hist(), hist(), hist());
    let mut agg = Agg::default();
    let (mut resumes, mut skipped, mut no_resumed, mut no_replay, mut replayed) = (0, 0, 0, 0, 0);
    let mut short = 0;
    for r in res {
        match r {
            Ok(None) => skipped += 1,
            Ok(Some(mut r)) => {
                resumes += 1;
                match r.to_resumed {
                    Some(ns) => {
                        let _ = to_resumed.record(ns.max(1));
                    }
                    None => no_resumed += 1,
                }
                match r.to_first {
                    Some(ns) => {
                        let _ = to_first.record(ns.max(1));
                    }
                    None => no_replay += 1,
                }
                replayed += r.st.replay.unwrap_or(0);
                tail.add(&r.tail).ok();
                // Every event after the cursor (seq 1 on), once each, then the result.
                if r.st.events != events.saturating_sub(1) {
                    short += 1;
                }
                r.st.control.retain(|c| c != "mcp-reattach/resumed");
                agg.add(&r.st);
            }
            Err(e) => agg.errors.push(e.to_string()),
        }
    }
    let mut checks = agg.checks(resumes);
    checks["short_streams"] = json!(short);
    if short > 0 {
        fail(
            &mut checks,
            format!("short stream: {short} resumed call(s) without every event after the cursor"),
        );
    }
    if no_resumed > 0 {
        fail(
            &mut checks,
            format!("bad replay: {no_resumed} resume(s) without the resumed event"),
        );
    }
    json!({"mode":"resume","sessions":sessions,"resumes":resumes,"skipped":skipped,
        "events":events,"gap_us":gap_us,"wait_ms":wait_ms,"concurrency":concurrency,
        "replayed_events":replayed,"no_replay":no_replay,
        "seconds": (now_ns() - t_start) as f64 / 1e9,
        "to_resumed": pct_us(&to_resumed), "to_first_replayed": pct_us(&to_first),
        "tail_age": pct_us(&tail), "checks": checks})
}
