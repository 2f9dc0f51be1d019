# A FastMCP 4.x server (PyPI `fastmcp` 4.2.3, on the Python SDK 2) used as an unmodified upstream
# by the mcp-reattach interop tests (tests/sdk/interop_shapes.rs).
#
# Usage: tests/interop/.venv-fastmcp/bin/python fastmcp4/server.py [--stateless] [--json] [port]
#   port defaults to 0 (a free ephemeral port, picked here); always binds 127.0.0.1.
#   --stateless  run(..., stateless_http=True): no Mcp-Session-Id, a fresh transport per request
#   --json       run(..., json_response=True): a request is answered with one JSON body
#
# Runs `FastMCP(...).run(transport="http", host=..., port=..., stateless_http=..., json_response=...)`
# on /mcp, exactly as a user would (FastMCP's defaults otherwise: stateful, SSE answers, no event
# store, so no event ids).
#
# Prints `LISTENING <port>` on stdout once the port accepts connections. Logs go to stderr.
# Tools (the same contract as ../py-server.py and ../ts-server.mjs):
#   slow_progress(steps, interval_ms)   progress 1..steps (message "step i"), then "done <steps>"
#   counter()                           increments a per-process counter, sends 2 notifications
#                                       (progress if the call has a progressToken, else log)
#                                       ~100 ms apart, then returns "applied <counter>"

import argparse
import asyncio
import socket
import sys
import threading
import time

from fastmcp import Context, FastMCP


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


parser = argparse.ArgumentParser()
parser.add_argument("port", nargs="?", type=int, default=0)
parser.add_argument("--stateless", action="store_true", help="run(..., stateless_http=True)")
parser.add_argument("--json", action="store_true", help="run(..., json_response=True)")
args = parser.parse_args()
port = args.port or free_port()

mcp = FastMCP("mcp-reattach-interop-fastmcp4-server")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@mcp.tool
async def slow_progress(steps: int, interval_ms: int, ctx: Context) -> str:
    """Sends `steps` progress notifications, `interval_ms` apart, then returns `done <steps>`."""
    for i in range(1, steps + 1):
        log(f"slow_progress {i}/{steps}")
        try:
            await ctx.report_progress(i, steps, f"step {i}")
        except Exception as exc:  # keep going: a disconnect is not a cancel
            log(f"progress {i} not sent: {exc}")
        if i < steps:
            await asyncio.sleep(interval_ms / 1000)
    return f"done {steps}"


# The `counter` tool's count, shared by every session of this process.
_counter = 0


def has_progress_token(ctx: Context) -> bool:
    # The same lookup Context.report_progress makes (fastmcp 4.2.3).
    try:
        meta = ctx.request_context._srctx.meta
        return meta is not None and meta.get("progress_token") is not None
    except Exception:
        return False


@mcp.tool
async def counter(ctx: Context) -> str:
    """Increments a per-process counter, sends 2 notifications ~100 ms apart, then returns
    `applied <counter>`."""
    global _counter
    _counter += 1
    n = _counter
    log(f"counter: applied {n} (JSON-RPC id {ctx.request_id!r})")
    token = has_progress_token(ctx)
    for i in (1, 2):
        try:
            if token:
                await ctx.report_progress(i, 2, f"applied {n}, step {i}")
            else:
                await ctx.info(f"applied {n}, step {i}")
        except Exception as exc:
            log(f"counter: notification {i} not sent: {exc}")
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
    log("server did not start listening within 30 s")


threading.Thread(target=announce_when_listening, daemon=True).start()
mcp.run(
    transport="http",
    host="127.0.0.1",
    port=port,
    stateless_http=args.stateless,
    json_response=args.json,
    show_banner=False,
    log_level="WARNING",
)
