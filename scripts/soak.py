#!/usr/bin/env python3
"""Soak driver for mcp-reattach (Python stdlib only; loopback only; bounded in time).

Runs a legacy MCP upstream (asyncio, in this process), starts the gateway binary in front of
it, and drives it:

  1. abandon: N sessions (default 300) start a long tool call at once and are abandoned
     mid-stream: a third reset (RST), a third half-closed, a third stop reading;
  2. churn: for --churn seconds, W workers loop: initialize, tool call; a share cut the stream
     mid-way and resume with Last-Event-ID (checked: exactly the rest, no duplicate, no gap),
     a share send DELETE, the rest walk away (TTL);
  3. cool-down: load stops; the gateway must return to zero sessions within TTL + sweep, and
     its fds and threads to their baseline.

Every second it samples the gateway's RSS, open fds and threads (/proc/PID) and, from
/metrics on the admin port, sessions, window bytes, attached clients and open connections.
Writes the samples as CSV and a JSON summary; exits 1 if a pass criterion fails:
  - window bytes never exceed --memory-budget;
  - sessions reach 0 within TTL + sweep interval (+1 s scrape slack) after load stops;
  - RSS plateaus: the last minute of churn at most 5% above the end of warm-up;
  - fds and threads return to baseline after cool-down (idle pooled upstream connections
    are reported separately as upstream_fds);
  - every resume was exact, or an explicitly documented failure (counted).
"""

import argparse
import asyncio
import csv
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid

# ------------------------------------------------------------------------------------------
# Upstream: a legacy MCP server (no SSE ids, no event store), CRLF SSE, chunked.
# ------------------------------------------------------------------------------------------

UP_STATS = {"requests": 0, "streams": 0, "streams_cut": 0}


async def read_request(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = b""
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    return method, target, headers, body


def response(status, headers, body=b""):
    reason = {200: "OK", 202: "Accepted", 404: "Not Found", 405: "Method Not Allowed"}[status]
    h = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"HTTP/1.1 {status} {reason}\r\n{h}content-length: {len(body)}\r\n\r\n".encode() + body


async def upstream_conn(reader, writer):
    try:
        while True:
            try:
                method, _target, headers, body = await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                return
            UP_STATS["requests"] += 1
            sid = headers.get("mcp-session-id")
            if method == "DELETE":
                writer.write(response(200, {}))
            elif method != "POST":
                writer.write(response(405, {"allow": "POST, DELETE"}))
            else:
                msg = json.loads(body or b"{}")
                if msg.get("method") == "initialize":
                    out = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": {
                        "protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                        "serverInfo": {"name": "soak-upstream", "version": "0"}}}).encode()
                    writer.write(response(200, {"content-type": "application/json",
                                                "mcp-session-id": uuid.uuid4().hex}, out))
                elif "id" not in msg:
                    writer.write(response(202, {}))
                else:
                    args = msg.get("params", {}).get("arguments", {})
                    if not await stream(writer, sid, msg["id"], int(args.get("steps", 5)),
                                        int(args.get("interval_ms", 50)), int(args.get("pad", 0))):
                        return
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        return
    finally:
        writer.close()


async def stream(writer, sid, rid, steps, interval_ms, pad):
    UP_STATS["streams"] += 1
    writer.write(("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                  f"mcp-session-id: {sid}\r\ntransfer-encoding: chunked\r\n\r\n").encode())
    filler = "x" * pad
    try:
        for i in range(1, steps + 1):
            data = json.dumps({"jsonrpc": "2.0", "method": "notifications/progress",
                               "params": {"progressToken": rid, "progress": i, "pad": filler}})
            ev = f"event: message\r\ndata: {data}\r\n\r\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await writer.drain()
            await asyncio.sleep(interval_ms / 1000)
        data = json.dumps({"jsonrpc": "2.0", "id": rid, "result": {"content": [
            {"type": "text", "text": f"done {steps}"}]}})
        ev = f"event: message\r\ndata: {data}\r\n\r\n".encode()
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(ev), ev))
        await writer.drain()
        return True
    except ConnectionError:
        UP_STATS["streams_cut"] += 1
        return False


# ------------------------------------------------------------------------------------------
# Client side: a minimal HTTP/1.1 client with SSE parsing.
# ------------------------------------------------------------------------------------------

class Conn:
    def __init__(self, reader, writer):
        self.r, self.w = reader, writer
        self.buf = b""  # de-chunked SSE bytes not yet parsed
        self.chunked = False
        self.done = False

    @classmethod
    async def open(cls, addr):
        r, w = await asyncio.wait_for(asyncio.open_connection(*addr), 10)
        return cls(r, w)

    async def request(self, method, body=None, headers=None, timeout=10):
        h = {"host": "soak.example", "accept": "application/json, text/event-stream"}
        h.update(headers or {})
        data = b""
        if body is not None:
            data = json.dumps(body).encode()
            h["content-type"] = "application/json"
        h["content-length"] = str(len(data))
        req = f"{method} /mcp HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        self.w.write(req.encode() + data)
        await self.w.drain()
        head = await asyncio.wait_for(self.r.readuntil(b"\r\n\r\n"), timeout)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        hdrs = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                hdrs[k.strip().lower()] = v.strip()
        self.chunked = hdrs.get("transfer-encoding", "").lower() == "chunked"
        self.done = False
        self.buf = b""
        if not self.chunked:
            n = int(hdrs.get("content-length", "0"))
            self.body = await asyncio.wait_for(self.r.readexactly(n), timeout) if n else b""
            self.done = True
        return status, hdrs

    async def _more(self, timeout):
        size = int((await asyncio.wait_for(self.r.readuntil(b"\r\n"), timeout)).split(b";")[0], 16)
        if size == 0:
            await asyncio.wait_for(self.r.readuntil(b"\r\n"), timeout)
            self.done = True
            return
        self.buf += await asyncio.wait_for(self.r.readexactly(size + 2), timeout)
        self.buf = self.buf[:-2] if self.buf.endswith(b"\r\n") else self.buf

    async def event(self, timeout=15):
        """The next SSE event as a dict (None when the body ends). Comments are skipped."""
        while True:
            while b"\n\n" in self.buf:
                block, self.buf = self.buf.split(b"\n\n", 1)
                ev = {}
                for line in block.decode().split("\n"):
                    if not line or line.startswith(":"):
                        continue
                    k, _, v = line.partition(":")
                    v = v[1:] if v.startswith(" ") else v
                    ev[k] = ev[k] + "\n" + v if k == "data" and k in ev else v
                if ev:
                    return ev
            if self.done:
                return None
            await self._more(timeout)

    def reset(self):
        sock = self.w.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.w.transport.abort()

    def close(self):
        self.w.close()


INIT = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "soak", "version": "0"}}}


async def initialize(addr):
    c = await Conn.open(addr)
    status, h = await c.request("POST", INIT)
    if status != 200:
        c.close()
        return None, status
    sid = h["mcp-session-id"]
    await c.request("POST", {"jsonrpc": "2.0", "method": "notifications/initialized"},
                    {"mcp-session-id": sid})
    c.close()
    return sid, 200


def call(rid, steps, interval_ms, pad):
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "countdown", "arguments": {"steps": steps, "interval_ms": interval_ms, "pad": pad},
        "_meta": {"progressToken": rid}}}


def progress_of(ev):
    if ev.get("event", "message") != "message" or not ev.get("data"):
        return None
    j = json.loads(ev["data"])
    if j.get("method") == "notifications/progress":
        return ("p", j["params"]["progress"])
    if "result" in j:
        return ("r", None)
    if "error" in j:
        return ("e", j["error"]["data"].get("reason"))
    return None


# ------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------

STATS = {"abandoned": 0, "abandon_failed": 0, "cycles": 0, "resumes": 0, "resumes_exact": 0,
         "documented_failures": {}, "errors": [], "deletes": 0, "ttl_walkaways": 0,
         "init_503": 0}
HELD = []  # sockets held open by half-closed and stopped readers until load stops


def documented(reason):
    STATS["documented_failures"][reason] = STATS["documented_failures"].get(reason, 0) + 1


async def abandon_one(addr, i, steps, pad):
    try:
        sid, st = await initialize(addr)
        if sid is None:
            STATS["abandon_failed"] += 1
            return
        c = await Conn.open(addr)
        status, _ = await c.request("POST", call(1, steps, 100, pad), {"mcp-session-id": sid})
        if status != 200:
            STATS["abandon_failed"] += 1
            return
        for _ in range(3):
            await c.event()
        mode = i % 3
        if mode == 0:
            c.reset()
        elif mode == 1:
            c.w.transport.write_eof()  # half-close; never read again
            HELD.append(c)
        else:
            HELD.append(c)  # stops reading
        STATS["abandoned"] += 1
    except Exception as e:  # noqa: BLE001
        STATS["abandon_failed"] += 1
        STATS["errors"].append(f"abandon: {e!r}")


async def churn_worker(addr, deadline, rng, worker):
    rid = 1000 * worker
    while time.monotonic() < deadline:
        rid += 1
        try:
            await churn_cycle(addr, rng, rid)
            STATS["cycles"] += 1
        except Exception as e:  # noqa: BLE001
            STATS["errors"].append(f"cycle: {e!r}")
            await asyncio.sleep(0.2)


async def churn_cycle(addr, rng, rid):
    sid, st = await initialize(addr)
    if sid is None:
        if st == 503:
            STATS["init_503"] += 1
            await asyncio.sleep(0.5)
            return
        raise RuntimeError(f"initialize status {st}")
    steps = rng.randint(5, 20)
    c = await Conn.open(addr)
    status, _ = await c.request("POST", call(rid, steps, rng.choice([10, 20, 50]), rng.choice([0, 200, 2000])),
                                {"mcp-session-id": sid})
    if status != 200:
        raise RuntimeError(f"call status {status}")
    roll = rng.random()
    got = []
    last_id = None
    if roll < 0.35:
        # Cut mid-stream, then resume from the last complete id.
        cut_after = rng.randint(0, steps)
        while len(got) < cut_after:
            ev = await c.event()
            if ev is None:
                break
            last_id = ev.get("id", last_id)
            p = progress_of(ev)
            if p:
                got.append(p)
        c.reset() if rng.random() < 0.5 else c.close()
        await asyncio.sleep(rng.choice([0, 0.05, 0.3]))
        STATS["resumes"] += 1
        if last_id is None:
            documented("no-id-before-cut")
            return
        r = await Conn.open(addr)
        status, _ = await r.request("GET", None, {"mcp-session-id": sid, "last-event-id": last_id})
        if status != 200:
            body = json.loads(r.body or b"{}")
            reason = body.get("error", {}).get("data", {}).get("reason", str(status))
            # stream-ended only when everything (result included) had been received.
            if reason == "stream-ended" and got and got[-1][0] == "r":
                STATS["resumes_exact"] += 1
            else:
                documented(f"{status}-{reason}")
            r.close()
            return
        first = await r.event()
        if first.get("event") != "mcp-reattach/resumed":
            raise RuntimeError(f"resume began with {first}")
        while True:
            ev = await r.event()
            if ev is None:
                break
            p = progress_of(ev)
            if p:
                got.append(p)
            if ev.get("event") == "mcp-reattach/resumption-failed":
                documented("gap")
        r.close()
        want = [("p", i) for i in range(1, steps + 1)] + [("r", None)]
        if got == want:
            STATS["resumes_exact"] += 1
        elif any(g[0] == "e" for g in got):
            documented("error-event")
        else:
            raise RuntimeError(f"resume not exact: got {got[:3]}..{got[-3:]} want {len(want)}")
    else:
        while True:
            ev = await c.event()
            if ev is None:
                break
        c.close()
        if roll < 0.7:
            d = await Conn.open(addr)
            status, _ = await d.request("DELETE", None, {"mcp-session-id": sid})
            d.close()
            STATS["deletes"] += 1
        else:
            STATS["ttl_walkaways"] += 1


# ------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------

def socket_peers(pid):
    """Remote ports of the gateway's TCP sockets, by inode (from /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[9] in inodes:
                        ports.append(int(cols[2].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return ports


def proc_sample(pid):
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds, threads


def scrape(admin):
    try:
        with socket.create_connection(admin, timeout=2) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while True:
                b = s.recv(65536)
                if not b:
                    break
                data += b
    except OSError:
        return {}
    out = {}
    for line in data.decode(errors="replace").split("\n"):
        m = re.match(r"^(mcp_reattach_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line.strip())
        if m:
            key = m.group(1) + (m.group(2) or "")
            out[key] = float(m.group(3))
    return out


async def sampler(pid, admin, samples, t0, phase, up_port):
    while True:
        try:
            rss, fds, threads = proc_sample(pid)
            upstream_fds = sum(1 for p in socket_peers(pid) if p == up_port)
        except FileNotFoundError:
            return
        m = await asyncio.get_running_loop().run_in_executor(None, scrape, admin)
        samples.append({
            "t": round(time.monotonic() - t0, 1), "phase": phase[0], "rss": rss, "fds": fds,
            "threads": threads, "upstream_fds": upstream_fds, "sessions": m.get("mcp_reattach_sessions", -1),
            "window_bytes": m.get("mcp_reattach_window_bytes", -1),
            "attached": m.get("mcp_reattach_attached_clients", -1),
            "connections": m.get("mcp_reattach_connections", -1),
            "evicted_budget": m.get('mcp_reattach_session_evictions_total{reason="memory_budget"}', 0),
            "evicted_ttl": m.get('mcp_reattach_session_evictions_total{reason="ttl"}', 0),
        })
        await asyncio.sleep(1)


# ------------------------------------------------------------------------------------------

async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--abandon", type=int, default=300)
    ap.add_argument("--abandon-steps", type=int, default=100)
    ap.add_argument("--abandon-pad", type=int, default=3000)
    ap.add_argument("--churn", type=float, default=600)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--ttl", type=float, default=30)
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--out", default="soak-out")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    budget = int(a.budget[:-3]) << {"KiB": 10, "MiB": 20, "GiB": 30}[a.budget[-3:]] \
        if a.budget[-3:] in ("KiB", "MiB", "GiB") else int(a.budget)
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)

    up = await asyncio.start_server(upstream_conn, "127.0.0.1", 0, backlog=1024)
    up_port = up.sockets[0].getsockname()[1]
    log = open(os.path.join(a.out, "gateway.log"), "w")
    gw = subprocess.Popen(
        [a.binary, "--upstream", f"http://127.0.0.1:{up_port}", "--listen", "127.0.0.1:0",
         "--admin-listen", "127.0.0.1:0", "--session-ttl", f"{int(a.ttl)}s",
         "--memory-budget", a.budget, "--log-level", "warn,mcp_reattach=info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    listen = admin = None
    deadline = time.monotonic() + 15
    while listen is None and time.monotonic() < deadline:
        line = await asyncio.get_running_loop().run_in_executor(None, gw.stdout.readline)
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        log.write(line)
        m = re.search(r"listen=(\S+).*admin=(\S+)", line)
        if m:
            h, p = m.group(1).rsplit(":", 1)
            listen = (h, int(p))
            h, p = m.group(2).rsplit(":", 1)
            admin = (h, int(p))
    if listen is None:
        print("gateway did not start", file=sys.stderr)
        gw.kill()
        return 2

    async def pump_log():
        while True:
            line = await asyncio.get_running_loop().run_in_executor(None, gw.stdout.readline)
            if not line:
                return
            log.write(re.sub(r"\x1b\[[0-9;]*m", "", line))
    asyncio.ensure_future(pump_log())

    sweep = max(0.01, min(1.0, min(a.ttl, 30) / 4))
    t0 = time.monotonic()
    samples = []
    phase = ["baseline"]
    await asyncio.sleep(1.5)
    base_rss, base_fds, base_threads = proc_sample(gw.pid)
    smp = asyncio.ensure_future(sampler(gw.pid, admin, samples, t0, phase, up_port))
    await asyncio.sleep(2)

    phase[0] = "abandon"
    print(f"[{time.monotonic()-t0:6.1f}s] abandoning {a.abandon} sessions mid-stream", flush=True)
    await asyncio.gather(*(abandon_one(listen, i, a.abandon_steps, a.abandon_pad) for i in range(a.abandon)))
    print(f"[{time.monotonic()-t0:6.1f}s] abandoned {STATS['abandoned']} (failed {STATS['abandon_failed']})", flush=True)

    phase[0] = "churn"
    churn_start = time.monotonic()
    churn_end = churn_start + a.churn
    print(f"[{time.monotonic()-t0:6.1f}s] churn for {a.churn:.0f}s with {a.workers} workers", flush=True)
    workers = [asyncio.ensure_future(churn_worker(listen, churn_end, random.Random(rng.random()), w + 1))
               for w in range(a.workers)]
    # The held sockets (half-closed, stopped readers) are released half-way through churn.
    await asyncio.sleep(min(60, a.churn / 2))
    for c in HELD:
        c.reset()
    HELD.clear()
    await asyncio.gather(*workers)
    stop = time.monotonic()
    phase[0] = "cooldown"
    print(f"[{stop-t0:6.1f}s] load stopped: {STATS['cycles']} cycles, {STATS['resumes']} resumes", flush=True)

    # Cool-down: sessions to zero within TTL + sweep; fds and threads back to baseline.
    zero_at = None
    limit = stop + a.ttl + sweep + 1 + 90
    while time.monotonic() < limit:
        await asyncio.sleep(1)
        s = samples[-1] if samples else {}
        if zero_at is None and s.get("sessions") == 0:
            zero_at = time.monotonic()
        if zero_at is not None and s.get("fds", 1e9) <= base_fds and s.get("threads", 1e9) <= base_threads:
            break
    await asyncio.sleep(1)
    smp.cancel()
    gw.send_signal(signal.SIGINT)
    try:
        gw.wait(timeout=10)
    except subprocess.TimeoutExpired:
        gw.kill()
    up.close()

    with open(os.path.join(a.out, "samples.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(samples[0].keys()))
        w.writeheader()
        w.writerows(samples)

    churn_s = [s for s in samples if s["phase"] == "churn"]
    warm_end = churn_start - t0 + a.churn * 0.25
    warm = [s["rss"] for s in churn_s if warm_end - 30 <= s["t"] <= warm_end] or [churn_s[0]["rss"]]
    late = [s["rss"] for s in churn_s if s["t"] >= stop - t0 - 60] or [churn_s[-1]["rss"]]
    rss_warm, rss_late = max(warm), max(late)
    growth = rss_late / rss_warm - 1
    max_window = max(s["window_bytes"] for s in samples)
    final = samples[-1]
    summary = {
        "config": {"abandon": a.abandon, "churn_s": a.churn, "workers": a.workers, "ttl_s": a.ttl,
                   "budget_bytes": budget, "sweep_s": sweep},
        "stats": STATS | {"errors": STATS["errors"][:20], "error_count": len(STATS["errors"])},
        "upstream": UP_STATS,
        "baseline": {"rss": base_rss, "fds": base_fds, "threads": base_threads},
        "max": {k: max(s[k] for s in samples) for k in ("rss", "fds", "upstream_fds", "threads", "sessions", "window_bytes", "attached", "connections")},
        "rss_warmup": rss_warm, "rss_last_minute": rss_late, "rss_growth": round(growth, 4),
        "sessions_zero_after_stop_s": None if zero_at is None else round(zero_at - stop, 1),
        "final": final,
    }
    checks = {
        "window_bytes_within_budget": max_window <= budget,
        "sessions_zero_within_ttl_plus_sweep": zero_at is not None and zero_at - stop <= a.ttl + sweep + 2,
        # Too short to judge a plateau in --quick runs (under 5 minutes of churn).
        "rss_plateau_5pct": growth <= 0.05 or a.churn < 300,
        "fds_back_to_baseline": final["fds"] <= base_fds,
        # The same, not counting idle pooled connections to the upstream.
        "client_fds_back_to_baseline": final["fds"] - final["upstream_fds"] <= base_fds,
        "threads_back_to_baseline": final["threads"] <= base_threads,
        "no_driver_errors": not STATS["errors"],
        "resumes_exact_or_documented": STATS["resumes"] == STATS["resumes_exact"] + sum(STATS["documented_failures"].values()),
    }
    summary["checks"] = checks
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    ok = all(checks.values())
    print("SOAK", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
