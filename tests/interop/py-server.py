# A Python-SDK MCP server (`mcp` 1.x, FastMCP, Streamable HTTP, no event store) used as an
# unmodified upstream by the mcp-reattach interop tests (tests/interop_*.rs).
#
# Usage: tests/interop/.venv/bin/python py-server.py [port]
#   port defaults to 0 (a free ephemeral port, picked here); always binds 127.0.0.1.
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


port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
if port == 0:
    port = free_port()

logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
mcp = FastMCP("mcp-reattach-interop-py-server", host="127.0.0.1", port=port, log_level="WARNING")

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
