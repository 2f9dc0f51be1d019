// A TypeScript-SDK MCP client (Streamable HTTP) used by the mcp-reattach end-to-end tests.
//
// Usage: node ts-client.mjs <url> [steps=8] [interval_ms=150] [timeout_ms=20000]
//
// Connects to <url> (e.g. http://127.0.0.1:PORT/mcp), calls the `slow_progress` tool with
// {steps, interval_ms} and a progress callback, using `timeout_ms` as the request timeout.
// stdout, one JSON object per line, each written the moment it is known:
//   {"progress": <n>}      for every progress notification, as it arrives
//   {"result": <CallToolResult>}   or   {"error": "<message>"}   exactly once, last
// then closes and exits 0. Usage errors exit 2.
// stderr: timestamped diagnostics: every HTTP request the transport makes (method,
// last-event-id, status) and every transport error, including the SDK's reconnect attempts.
// The transport uses the SDK's default reconnection options (2 attempts, 1 s then 1.5 s,
// unless the server sent `retry:`).

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const [url, stepsArg = '8', intervalArg = '150', timeoutArg = '20000'] = process.argv.slice(2);
if (!url) {
    console.error('usage: node ts-client.mjs <url> [steps] [interval_ms] [timeout_ms]');
    process.exit(2);
}
const steps = Number(stepsArg);
const intervalMs = Number(intervalArg);
const timeoutMs = Number(timeoutArg);
if (![steps, intervalMs, timeoutMs].every(Number.isFinite)) {
    console.error('steps, interval_ms and timeout_ms must be numbers');
    process.exit(2);
}

const started = Date.now();
const log = (...args) => console.error(`+${String(Date.now() - started).padStart(5)}ms`, ...args);
// Writes to a pipe are synchronous on Linux, so each line leaves the process at once.
const emit = obj => process.stdout.write(JSON.stringify(obj) + '\n');

// Wraps fetch only to log what the transport does; requests are passed on unchanged.
const loggingFetch = async (input, init) => {
    const method = init?.method ?? 'GET';
    const headers = new Headers(init?.headers);
    const lastEventId = headers.get('last-event-id');
    const what = `${method}${lastEventId !== null ? ` last-event-id=${JSON.stringify(lastEventId)}` : ''}`;
    try {
        const res = await fetch(input, init);
        log(`${what} -> ${res.status} ${res.headers.get('content-type') ?? ''}`);
        return res;
    } catch (err) {
        log(`${what} -> failed: ${err?.message ?? err}${err?.cause ? ` (${err.cause.code ?? err.cause.message ?? err.cause})` : ''}`);
        throw err;
    }
};

const transport = new StreamableHTTPClientTransport(new URL(url), { fetch: loggingFetch });
const client = new Client({ name: 'mcp-reattach-interop-client', version: '0.0.0' });
client.onerror = err => log(`onerror: ${err?.message ?? err}`);

let outcome;
try {
    await client.connect(transport, { timeout: timeoutMs });
    log(`connected, session ${transport.sessionId}, protocol ${transport.protocolVersion}`);
    const result = await client.callTool(
        { name: 'slow_progress', arguments: { steps, interval_ms: intervalMs } },
        undefined,
        {
            timeout: timeoutMs,
            onprogress: progress => emit({ progress: progress.progress })
        }
    );
    outcome = { result };
} catch (err) {
    outcome = { error: err?.message ?? String(err) };
}
emit(outcome);

// Best effort, bounded: end the session (DELETE), then close the transport.
try {
    await Promise.race([
        transport.terminateSession(),
        new Promise((_, reject) => setTimeout(() => reject(new Error('timed out after 2 s')), 2000).unref())
    ]);
    log('session terminated');
} catch (err) {
    log(`terminateSession: ${err?.message ?? err}`);
}
await client.close().catch(err => log(`close: ${err?.message ?? err}`));
process.exit(0);
