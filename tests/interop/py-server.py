# A Python-SDK MCP server (`mcp` 1.x, FastMCP, Streamable HTTP, no event store) used as an
# unmodified upstream by the mcp-reattach interop tests (tests/interop_*.rs).
#
# Usage: tests/interop/.venv/bin/python py-server.py [--stateless] [--json] [port]
#   port defaults to 0 (a free ephemeral port, picked here); always binds 127.0.0.1.
#   --stateless  FastMCP(stateless_http=True): no Mcp-Session-Id, a fresh transport per request
#   --json       FastMCP(json_response=True): a request is answered with one JSON body
#
# Runs `FastMCP(...).run(transport="streamable-http")` on /mcp, exactly as a user would.
# Its SSE uses CRLF line endings and sends `: ping` comments (sse-starlette); with no event store
# it sets no event ids and cannot resume a stream by itself.
#
# Prints `LISTENING <port>` on stdout once the port accepts connections. Logs go to stderr.
# Tools:
#   slow_progress(steps, interval_ms)        progress 1..steps (message "step i"), then "done <steps>"
#   notify_standalone(count, interval_ms)    returns at once, then sends `count` log notifications
#                                            {"seq": i, "of": count} on the standalone GET stream
#   flood(count, size)                       `count` progress notifications with a message padded to
#                                            ~`size` bytes, no delay between them, then "flooded <count>"
#   counter()                                increments a per-process counter, sends 2 notifications
#                                            (progress if the call has a progressToken, else log)
#                                            ~100 ms apart, then returns "applied <counter>"

import argparse
import asyncio
import logging
import socket
import sys
import threading
import time

from mcp.server.fastmcp import Context, FastMCP


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


parser = argparse.ArgumentParser()
parser.add_argument("port", nargs="?", type=int, default=0)
parser.add_argument("--stateless", action="store_true", help="FastMCP(stateless_http=True)")
parser.add_argument("--json", action="store_true", help="FastMCP(json_response=True)")
args = parser.parse_args()
port = args.port or free_port()

logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
mcp = FastMCP(
    "mcp-reattach-interop-py-server",
    host="127.0.0.1",
    port=port,
    log_level="WARNING",
    stateless_http=args.stateless,
    json_response=args.json,
)

# Keeps the background notification tasks alive.
_background: set[asyncio.Task] = set()


@mcp.tool()
async def slow_progress(steps: int, interval_ms: int, ctx: Context) -> str:
    """Sends `steps` progress notifications, `interval_ms` apart, then returns `done <steps>`."""
    for i in range(1, steps + 1):
        print(f"slow_progress {i}/{steps}", file=sys.stderr, flush=True)
        try:
            await ctx.report_progress(i, steps, f"step {i}")
        except Exception as exc:  # keep going: a disconnect is not a cancel
            print(f"progress {i} not sent: {exc}", file=sys.stderr, flush=True)
        if i < steps:
            await asyncio.sleep(interval_ms / 1000)
    return f"done {steps}"


@mcp.tool()
async def notify_standalone(count: int, interval_ms: int, ctx: Context) -> str:
    """Returns at once; then sends `count` log notifications {"seq": i} on the standalone stream."""
    session = ctx.session

    async def send_all() -> None:
        for i in range(1, count + 1):
            await asyncio.sleep(interval_ms / 1000)
            print(f"notify_standalone {i}/{count}", file=sys.stderr, flush=True)
            try:
                # No related_request_id: the notification goes to the standalone GET stream.
                await session.send_log_message("info", {"seq": i, "of": count}, logger="interop")
            except Exception as exc:
                print(f"notification {i} not sent: {exc}", file=sys.stderr, flush=True)

    task = asyncio.get_running_loop().create_task(send_all())
    _background.add(task)
    task.add_done_callback(_background.discard)
    return f"scheduled {count}"


@mcp.tool()
async def flood(count: int, size: int, ctx: Context) -> str:
    """Sends `count` progress notifications (message padded to ~`size` bytes) with no delay, then
    returns `flooded <count>`."""
    started = time.monotonic()
    pad = "x" * max(0, size - 64)
    for i in range(1, count + 1):
        try:
            await ctx.report_progress(i, count, f"flood {i} {pad}")
        except Exception as exc:  # keep going: a disconnect is not a cancel
            print(f"flood: progress {i} not sent: {exc}", file=sys.stderr, flush=True)
    took = (time.monotonic() - started) * 1000
    print(f"flood: {count} notifications of ~{size} bytes sent in {took:.0f} ms", file=sys.stderr, flush=True)
    return f"flooded {count}"


# The `counter` tool's count, shared by every session of this process.
_counter = 0


@mcp.tool()
async def counter(ctx: Context) -> str:
    """Increments a per-process counter, sends 2 notifications ~100 ms apart, then returns
    `applied <counter>`."""
    global _counter
    _counter += 1
    n = _counter
    print(f"counter: applied {n} (JSON-RPC id {ctx.request_id!r})", file=sys.stderr, flush=True)
    has_token = ctx.request_context.meta is not None and ctx.request_context.meta.progressToken is not None
    for i in (1, 2):
        try:
            if has_token:
                await ctx.report_progress(i, 2, f"applied {n}, step {i}")
            else:
                await ctx.info(f"applied {n}, step {i}")
        except Exception as exc:
            print(f"counter: notification {i} not sent: {exc}", file=sys.stderr, flush=True)
        await asyncio.sleep(0.1)
    return f"applied {n}"


def announce_when_listening() -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                print(f"LISTENING {port}", flush=True)
                return
        except OSError:
            time.sleep(0.05)
    print("server did not start listening within 30 s", file=sys.stderr, flush=True)


threading.Thread(target=announce_when_listening, daemon=True).start()
mcp.run(transport="streamable-http")
