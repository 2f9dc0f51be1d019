# The Python-SDK MCP client (`mcp` 1.x, `streamable_http_client` + `ClientSession`, default
# reconnection behaviour) driven by the interop matrix (tests/sdk/interop_matrix.rs). Same plan and
# output format as ts-driver.mjs (see there) and the in-process rmcp driver.
#
# Usage: tests/interop/.venv/bin/python py-driver.py <url> '<plan json>'
#
# stdout: one JSON object per line ({"ev": "session" | "progress" | "result" | "error" |
# "notify" | "done", ...}), flushed at once.
# stderr: `HTTP <method> lei=<last-event-id|-> conn=<n> -> <status>|failed: ...` for every request
# the SDK makes, `TAP {...}` for every SSE event it receives, `onerror: ...` for every exception
# the transport hands to the session.

import asyncio
import json
import sys
import time
from datetime import timedelta

import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import McpError

STARTED = time.monotonic()


def log(msg: str) -> None:
    print(f"+{int((time.monotonic() - STARTED) * 1000):5d}ms {msg}", file=sys.stderr, flush=True)


def emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def rpc_summary(data: str):
    if not data:
        return None
    try:
        m = json.loads(data)
    except ValueError:
        return {"unparsed": data[:200]}
    params = m.get("params") or {}
    return {
        "m": m.get("method"),
        "id": m.get("id"),
        "tok": params.get("progressToken"),
        "p": params.get("progress"),
        "err": (m.get("error") or {}).get("code"),
    }


class SseTap:
    """An incremental SSE parser that logs every event (`TAP {...}`) of one response."""

    def __init__(self, conn: int, method: str, lei: str | None) -> None:
        self.base = {"conn": conn, "req": method, "lei": lei}
        self.buf = ""
        self.pending_cr = False
        self.fields: dict[str, str] = {}
        self.data: list[str] = []

    def feed(self, chunk: bytes) -> None:
        text = chunk.decode("utf-8", errors="replace")
        if self.pending_cr and text.startswith("\n"):
            text = text[1:]
        self.pending_cr = text.endswith("\r")
        self.buf += text.replace("\r\n", "\n").replace("\r", "\n")
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.line(line)

    def line(self, line: str) -> None:
        if line == "":
            if self.data or "id" in self.fields or "event" in self.fields:
                data = "\n".join(self.data)
                print(
                    "TAP "
                    + json.dumps(
                        {
                            **self.base,
                            "type": self.fields.get("event", "message"),
                            "id": self.fields.get("id"),
                            "rpc": rpc_summary(data),
                        }
                    ),
                    file=sys.stderr,
                    flush=True,
                )
            self.fields, self.data = {}, []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self.data.append(value)
        elif name in ("id", "event", "retry"):
            self.fields[name] = value

    def end(self, how: str) -> None:
        print("TAP " + json.dumps({**self.base, "end": how}), file=sys.stderr, flush=True)


class TapStream(httpx.AsyncByteStream):
    def __init__(self, inner, tap: SseTap) -> None:
        self.inner = inner
        self.tap = tap

    async def __aiter__(self):
        try:
            async for chunk in self.inner:
                self.tap.feed(chunk)
                yield chunk
        except BaseException as exc:
            self.tap.end(f"error: {exc!r}")
            raise
        self.tap.end("eof")

    async def aclose(self) -> None:
        await self.inner.aclose()


class TapTransport(httpx.AsyncBaseTransport):
    """Logs every request and taps every SSE response; the bytes pass through unchanged."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.conn = 0
        self.get_open = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.conn += 1
        conn = self.conn
        lei = request.headers.get("last-event-id")
        what = f"HTTP {request.method} lei={lei or '-'} conn={conn}"
        try:
            response = await self.inner.handle_async_request(request)
        except Exception as exc:
            log(f"{what} -> failed: {exc!r}")
            raise
        ct = response.headers.get("content-type", "")
        log(f"{what} -> {response.status_code} {ct}")
        if response.status_code == 200 and ct.startswith("text/event-stream"):
            if request.method == "GET" and not lei:
                self.get_open.set()
            return httpx.Response(
                status_code=response.status_code,
                headers=response.headers,
                stream=TapStream(response.stream, SseTap(conn, request.method, lei)),
                extensions=response.extensions,
                request=request,
            )
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def main() -> None:
    url, plan = sys.argv[1], json.loads(sys.argv[2])
    timeout = timedelta(milliseconds=plan.get("timeout_ms", 20000))
    transport = TapTransport()
    notify_state = {"count": 0, "expect": None, "all": asyncio.Event()}

    async def on_log(params) -> None:
        emit({"ev": "notify", "data": params.data})
        notify_state["count"] += 1
        if notify_state["expect"] is not None and notify_state["count"] >= notify_state["expect"]:
            notify_state["all"].set()

    async def on_message(message) -> None:
        if isinstance(message, Exception):
            log(f"onerror: {message!r}")

    async def run_call(session: ClientSession, k, call) -> None:
        async def on_progress(progress, total, message) -> None:
            p = int(progress) if float(progress).is_integer() else progress
            emit({"ev": "progress", "call": k, "progress": p, "message": message})

        try:
            result = await session.call_tool(
                call["tool"], call.get("args") or {}, read_timeout_seconds=timeout, progress_callback=on_progress
            )
            text = "".join(getattr(c, "text", "") for c in result.content)
            emit({"ev": "result", "call": k, "text": text, "is_error": bool(result.isError)})
        except McpError as exc:
            emit({"ev": "error", "call": k, "message": exc.error.message, "code": exc.error.code})
        except Exception as exc:
            emit({"ev": "error", "call": k, "message": repr(exc), "code": None})

    http = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(30, read=300))
    try:
        async with http:
            async with streamable_http_client(
                url, http_client=http, terminate_on_close=plan.get("terminate", True)
            ) as (read, write, get_session_id):
                async with ClientSession(read, write, logging_callback=on_log, message_handler=on_message) as session:
                    init = await session.initialize()
                    emit({"ev": "session", "session": get_session_id(), "protocol": str(init.protocolVersion)})
                    notify = plan.get("notify")
                    if notify:
                        try:
                            await asyncio.wait_for(transport.get_open.wait(), 3)
                            log("standalone GET stream open")
                        except asyncio.TimeoutError:
                            log("standalone GET stream NOT open after 3 s")
                        notify_state["expect"] = notify["expect"]
                        await run_call(session, "notify", {"tool": notify["tool"], "args": notify.get("args")})
                        try:
                            await asyncio.wait_for(notify_state["all"].wait(), notify.get("wait_ms", 10000) / 1000)
                        except asyncio.TimeoutError:
                            pass
                    await asyncio.gather(*(run_call(session, k, c) for k, c in enumerate(plan.get("calls") or [])))
    except BaseException as exc:  # e.g. an ExceptionGroup from the transport's task group
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        emit({"ev": "error", "call": "transport", "message": repr(exc), "code": None})
    emit({"ev": "done"})


asyncio.run(main())
