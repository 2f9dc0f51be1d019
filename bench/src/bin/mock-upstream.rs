//! Mock MCP upstream (Streamable HTTP, legacy era, no event ids, no event store), one
//! blocking thread per connection. Each SSE event is its own HTTP chunk, stamped with
//! CLOCK_MONOTONIC when it is written. By default each event is one `write`, like a server
//! that writes each event as it is produced; with `burst` N > 1 a saturating stream formats
//! N events (N chunks) into one buffer and issues one `write` for them, like a busy server
//! whose writer has a backlog — so the mock can outrun any proxy.
//!
//! POST `initialize` → JSON result + a new `Mcp-Session-Id`; notifications → 202;
//! `ping` → a small JSON result; `tools/call` with `arguments` `{events, size, rate,
//! phase_us, duration_ms, burst, gap_us}` → an SSE stream of progress events (`seq`, `ts` =
//! CLOCK_MONOTONIC ns at send) then the padded result (with `gap_us`, the head, each event
//! and the result are written `gap_us` apart, as an SDK server writes them while its tool
//! runs: the proxy sees the head alone first); GET with the same parameters in the
//! query → the standalone SSE stream, held open after its events until the peer closes;
//! DELETE → 200.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::Parser;
use mcp_reattach_bench::clock::now_ns;
use mcp_reattach_bench::payload;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Events per `write` for saturating streams whose request names no `burst`.
    #[arg(long, default_value_t = 1)]
    burst: u64,
    /// SO_SNDBUF of each connection in KiB (0: the kernel's autotuning).
    #[arg(long, default_value_t = 0)]
    sndbuf_kib: usize,
}

static SNDBUF: AtomicU64 = AtomicU64::new(0);

/// `--burst`, the default for requests that name none.
static DEFAULT_BURST: AtomicU64 = AtomicU64::new(1);

static SESSIONS: AtomicU64 = AtomicU64::new(0);

#[derive(Clone, Copy, Default, Debug)]
struct StreamSpec {
    events: u64,
    size: usize,
    /// Events per second; 0 = as fast as the socket takes them.
    rate: f64,
    phase_us: u64,
    duration_ms: u64,
    /// Saturating streams: events formatted into one buffer and written with one `write`
    /// (all stamped just before it). Paced streams write each event on its own.
    burst: u64,
    /// A tool call's pause before each of its writes after the head (its events, one per
    /// write, and its result): 0 for none.
    gap_us: u64,
}

struct Req {
    method: String,
    path: String,
    session: Option<String>,
    body: Vec<u8>,
}

fn main() {
    let args = Args::parse();
    DEFAULT_BURST.store(args.burst.max(1), Ordering::Relaxed);
    SNDBUF.store(args.sndbuf_kib as u64 * 1024, Ordering::Relaxed);
    // Precise sleeps for paced streams (the default timer slack is 50 µs).
    // SAFETY: prctl with PR_SET_TIMERSLACK takes an integer argument.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0u64, 0u64, 0u64) };
    let l = TcpListener::bind(&args.listen).expect("bind");
    println!("LISTEN {}", l.local_addr().unwrap());
    io::stdout().flush().ok();
    for conn in l.incoming() {
        let Ok(conn) = conn else { continue };
        let _ = std::thread::Builder::new()
            .stack_size(128 * 1024)
            .spawn(move || {
                let _ = serve(conn);
            });
    }
}

fn serve(mut s: TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    let sndbuf = SNDBUF.load(Ordering::Relaxed) as libc::c_int;
    if sndbuf > 0 {
        use std::os::fd::AsRawFd;
        // SAFETY: setsockopt on our own socket with a c_int option value.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&sndbuf as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
    let mut buf = Vec::with_capacity(8192);
    loop {
        let Some(req) = read_request(&mut s, &mut buf)? else {
            return Ok(());
        };
        match req.method.as_str() {
            "POST" => post(&mut s, &req)?,
            "GET" => {
                let spec = spec_from_query(&req.path);
                let sid = req.session.clone();
                sse_head(&mut s, sid.as_deref())?;
                stream_events(&mut s, spec, None)?;
                // The standalone stream stays open until the peer closes it.
                let mut sink = [0u8; 1024];
                while s.read(&mut sink)? > 0 {}
                return Ok(());
            }
            "DELETE" => respond(&mut s, "200 OK", None, None, b"")?,
            _ => respond(&mut s, "405 Method Not Allowed", None, None, b"")?,
        }
    }
}

fn post(s: &mut TcpStream, req: &Req) -> io::Result<()> {
    let v: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
    let method = v.get("method").and_then(|m| m.as_str()).unwrap_or("");
    let id = v.get("id").map(|i| i.to_string());
    match (method, id) {
        (_, None) => respond(s, "202 Accepted", None, None, b""),
        ("initialize", Some(id)) => {
            let n = SESSIONS.fetch_add(1, Ordering::Relaxed);
            let sid = format!("bench-{:08x}-{n}", std::process::id());
            let body = format!(
                "{{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":{{\"protocolVersion\":\"2025-06-18\",\"capabilities\":{{\"tools\":{{}}}},\"serverInfo\":{{\"name\":\"bench-mock\",\"version\":\"0\"}}}}}}"
            );
            respond(
                s,
                "200 OK",
                Some("application/json"),
                Some(&sid),
                body.as_bytes(),
            )
        }
        ("tools/call", Some(id)) => {
            let a = v.pointer("/params/arguments").cloned().unwrap_or_default();
            let spec = StreamSpec {
                events: a.get("events").and_then(|x| x.as_u64()).unwrap_or(0),
                size: a.get("size").and_then(|x| x.as_u64()).unwrap_or(200) as usize,
                rate: a.get("rate").and_then(|x| x.as_f64()).unwrap_or(0.0),
                phase_us: a.get("phase_us").and_then(|x| x.as_u64()).unwrap_or(0),
                duration_ms: a.get("duration_ms").and_then(|x| x.as_u64()).unwrap_or(0),
                burst: a
                    .get("burst")
                    .and_then(|x| x.as_u64())
                    .unwrap_or_else(|| DEFAULT_BURST.load(Ordering::Relaxed)),
                gap_us: a.get("gap_us").and_then(|x| x.as_u64()).unwrap_or(0),
            };
            sse_head(s, req.session.as_deref())?;
            stream_events(s, spec, Some(&id))?;
            s.write_all(b"0\r\n\r\n")
        }
        (_, Some(id)) => {
            let body = format!("{{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":{{}}}}");
            respond(s, "200 OK", Some("application/json"), None, body.as_bytes())
        }
    }
}

fn spec_from_query(path: &str) -> StreamSpec {
    let mut spec = StreamSpec {
        size: 200,
        burst: DEFAULT_BURST.load(Ordering::Relaxed),
        ..StreamSpec::default()
    };
    let Some((_, q)) = path.split_once('?') else {
        return spec;
    };
    for kv in q.split('&') {
        let Some((k, v)) = kv.split_once('=') else {
            continue;
        };
        match k {
            "events" => spec.events = v.parse().unwrap_or(0),
            "size" => spec.size = v.parse().unwrap_or(200),
            "rate" => spec.rate = v.parse().unwrap_or(0.0),
            "phase_us" => spec.phase_us = v.parse().unwrap_or(0),
            "duration_ms" => spec.duration_ms = v.parse().unwrap_or(0),
            "burst" => spec.burst = v.parse().unwrap_or(1),
            _ => {}
        }
    }
    spec
}

fn sse_head(s: &mut TcpStream, sid: Option<&str>) -> io::Result<()> {
    let mut h = String::from("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n");
    if let Some(sid) = sid {
        h.push_str(&format!("Mcp-Session-Id: {sid}\r\n"));
    }
    h.push_str("\r\n");
    s.write_all(h.as_bytes())
}

fn sleep_until(deadline: u64) {
    let now = now_ns();
    if deadline > now {
        std::thread::sleep(Duration::from_nanos(deadline - now));
    }
}

/// Writes the stream's events, one chunk per event and one `write` per event (paced, or
/// `burst` 1) or per `burst` events (saturating); then the result when `result_id` is set.
/// Stops after `events` (if non-zero) or `duration_ms` (if non-zero).
fn stream_events(s: &mut TcpStream, spec: StreamSpec, result_id: Option<&str>) -> io::Result<()> {
    let start = now_ns() + spec.phase_us * 1000;
    let period = if spec.rate > 0.0 {
        (1e9 / spec.rate) as u64
    } else {
        0
    };
    let burst = if period > 0 || spec.gap_us > 0 {
        1
    } else {
        spec.burst.max(1)
    };
    let gap = Duration::from_micros(spec.gap_us);
    let end = (spec.duration_ms > 0).then(|| now_ns() + spec.duration_ms * 1_000_000);
    let mut out = Vec::with_capacity((spec.size + 128) * burst.min(1024) as usize);
    let mut seq = 0u64;
    loop {
        if spec.events > 0 && seq >= spec.events {
            break;
        }
        if period > 0 {
            let due = start + seq * period;
            if end.is_some_and(|e| due >= e) {
                break;
            }
            sleep_until(due);
        } else if spec.phase_us > 0 && seq == 0 {
            sleep_until(start);
        } else if !gap.is_zero() {
            std::thread::sleep(gap);
        }
        if spec.events == 0 && end.is_none() {
            break;
        }
        let ts = now_ns();
        if end.is_some_and(|e| ts >= e) {
            break;
        }
        let n = if spec.events > 0 {
            burst.min(spec.events - seq)
        } else {
            burst
        };
        out.clear();
        let mut tsb = [0u8; 20];
        let ts = payload::dec(ts, &mut tsb);
        for _ in 0..n {
            event_chunk(seq, ts, spec.size, &mut out);
            seq += 1;
        }
        s.write_all(&out)?;
    }
    if let Some(id) = result_id {
        if !gap.is_zero() {
            std::thread::sleep(gap);
        }
        let mut data = Vec::with_capacity(spec.size + 128);
        payload::result(id, seq, now_ns(), spec.size, &mut data);
        out.clear();
        frame(&data, &mut out);
        s.write_all(&out)?;
    }
    Ok(())
}

const EVENT_PREFIX: &[u8] = b"event: message\ndata: ";

/// Appends one progress event as one HTTP chunk (`fmt`-free: millions per second); `ts` is
/// the send stamp in decimal.
fn event_chunk(seq: u64, ts: &[u8], size: usize, out: &mut Vec<u8>) {
    let mut sb = [0u8; 20];
    let seq = payload::dec(seq, &mut sb);
    let len = EVENT_PREFIX.len() + payload::event_len_dec(seq, ts, size) + 2;
    push_hex(out, len);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(EVENT_PREFIX);
    payload::event_dec(seq, ts, size, out);
    out.extend_from_slice(b"\n\n\r\n");
}

fn push_hex(out: &mut Vec<u8>, mut n: usize) {
    let mut tmp = [0u8; 16];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b"0123456789abcdef"[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&tmp[i..]);
}

/// One SSE event as one HTTP chunk.
fn frame(data: &[u8], chunk: &mut Vec<u8>) {
    let len = EVENT_PREFIX.len() + data.len() + 2;
    push_hex(chunk, len);
    chunk.extend_from_slice(b"\r\n");
    chunk.extend_from_slice(EVENT_PREFIX);
    chunk.extend_from_slice(data);
    chunk.extend_from_slice(b"\n\n\r\n");
}

fn respond(
    s: &mut TcpStream,
    status: &str,
    ctype: Option<&str>,
    sid: Option<&str>,
    body: &[u8],
) -> io::Result<()> {
    let mut r = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n", body.len());
    if let Some(c) = ctype {
        r.push_str(&format!("Content-Type: {c}\r\n"));
    }
    if let Some(sid) = sid {
        r.push_str(&format!("Mcp-Session-Id: {sid}\r\n"));
    }
    r.push_str("\r\n");
    let mut out = r.into_bytes();
    out.extend_from_slice(body);
    s.write_all(&out)
}

/// Reads one request (head + Content-Length or chunked body). Ok(None) on a clean EOF.
fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<Option<Req>> {
    let head_end = loop {
        if let Some(p) = memchr::memmem::find(buf, b"\r\n\r\n") {
            break p;
        }
        if !fill(s, buf)? {
            return Ok(None);
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    buf.drain(..head_end + 4);
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let method = first.next().unwrap_or("").to_owned();
    let path = first.next().unwrap_or("/").to_owned();
    let mut len = 0usize;
    let mut chunked = false;
    let mut session = None;
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            let v = v.trim();
            if k.eq_ignore_ascii_case("content-length") {
                len = v.parse().unwrap_or(0);
            } else if k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked") {
                chunked = true;
            } else if k.eq_ignore_ascii_case("mcp-session-id") {
                session = Some(v.to_owned());
            }
        }
    }
    let body = if chunked {
        let mut body = Vec::new();
        loop {
            let nl = loop {
                if let Some(p) = memchr::memmem::find(buf, b"\r\n") {
                    break p;
                }
                if !fill(s, buf)? {
                    return Ok(None);
                }
            };
            let n = usize::from_str_radix(
                String::from_utf8_lossy(&buf[..nl])
                    .split(';')
                    .next()
                    .unwrap_or("")
                    .trim(),
                16,
            )
            .unwrap_or(0);
            buf.drain(..nl + 2);
            while buf.len() < n + 2 {
                if !fill(s, buf)? {
                    return Ok(None);
                }
            }
            body.extend_from_slice(&buf[..n]);
            buf.drain(..n + 2);
            if n == 0 {
                break;
            }
        }
        body
    } else {
        while buf.len() < len {
            if !fill(s, buf)? {
                return Ok(None);
            }
        }
        buf.drain(..len).collect()
    };
    Ok(Some(Req {
        method,
        path,
        session,
        body,
    }))
}

fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<bool> {
    let mut tmp = [0u8; 16384];
    let n = s.read(&mut tmp)?;
    buf.extend_from_slice(&tmp[..n]);
    Ok(n > 0)
}
