// The TypeScript-SDK MCP client (Streamable HTTP, default reconnection options) driven by the
// interop matrix (tests/sdk/interop_matrix.rs). Same plan and output format as py-driver.py and the
// in-process rmcp driver.
//
// Usage: node ts-driver.mjs <url> '<plan json>'
// plan: {
//   "timeout_ms": 20000,                      request timeout of every call
//   "calls": [{"tool": "...", "args": {...}}], started together after connecting, each with a
//                                             progress callback
//   "notify": {"tool": "...", "args": {...}, "expect": N, "wait_ms": T}
//                                             optional, before the calls: waits (≤ 3 s) for the
//                                             standalone GET stream, calls the tool, then reports
//                                             log notifications until N arrived or T ms passed
//   "terminate": true                         DELETE the session at the end (default true)
// }
// stdout, one JSON object per line, written the moment it is known:
//   {"ev":"session","session":"<id>","protocol":"<version>"}
//   {"ev":"progress","call":k,"progress":p,"message":"..."}
//   {"ev":"result","call":k,"text":"...","is_error":false}
//   {"ev":"error","call":k,"message":"...","code":c}
//   {"ev":"notify","data":<the log notification's data>}
//   {"ev":"done"}
// stderr: `HTTP <method> lei=<last-event-id|-> -> <status>|failed: ...` for every request the
// transport makes, `TAP {...}` for every SSE event it receives (connection, request, event id,
// JSON-RPC summary), and `onerror: ...` for every transport error.

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { LoggingMessageNotificationSchema } from '@modelcontextprotocol/sdk/types.js';
import { EventSourceParserStream } from 'eventsource-parser/stream';

const [url, planArg] = process.argv.slice(2);
if (!url || !planArg) {
    console.error("usage: node ts-driver.mjs <url> '<plan json>'");
    process.exit(2);
}
const plan = JSON.parse(planArg);
const timeoutMs = plan.timeout_ms ?? 20000;

const started = Date.now();
const log = (...args) => console.error(`+${String(Date.now() - started).padStart(5)}ms`, ...args);
const emit = obj => process.stdout.write(JSON.stringify(obj) + '\n');

// --- fetch wrapper: logs every request and taps every SSE response --------------------------
let connSeq = 0;
let resolveGetOpen;
const getOpen = new Promise(resolve => (resolveGetOpen = resolve));

function rpcSummary(data) {
    if (!data) return null;
    try {
        const m = JSON.parse(data);
        return {
            m: m.method ?? null,
            id: m.id ?? null,
            tok: m.params?.progressToken ?? null,
            p: m.params?.progress ?? null,
            err: m.error?.code ?? null
        };
    } catch {
        return { unparsed: data.slice(0, 200) };
    }
}

async function tap(conn, method, lei, stream) {
    try {
        const reader = stream
            .pipeThrough(new TextDecoderStream())
            .pipeThrough(new EventSourceParserStream())
            .getReader();
        while (true) {
            const { value: ev, done } = await reader.read();
            if (done) break;
            console.error(
                'TAP ' +
                    JSON.stringify({ conn, req: method, lei, type: ev.event ?? 'message', id: ev.id ?? null, rpc: rpcSummary(ev.data) })
            );
        }
        console.error('TAP ' + JSON.stringify({ conn, req: method, lei, end: 'eof' }));
    } catch (err) {
        console.error('TAP ' + JSON.stringify({ conn, req: method, lei, end: `error: ${err?.message ?? err}` }));
    }
}

const tapFetch = async (input, init) => {
    const method = init?.method ?? 'GET';
    const headers = new Headers(init?.headers);
    const lei = headers.get('last-event-id');
    const conn = ++connSeq;
    const what = `HTTP ${method} lei=${lei ?? '-'} conn=${conn}`;
    let res;
    try {
        res = await fetch(input, init);
    } catch (err) {
        log(`${what} -> failed: ${err?.message ?? err}${err?.cause ? ` (${err.cause.code ?? err.cause.message ?? err.cause})` : ''}`);
        throw err;
    }
    const ct = res.headers.get('content-type') ?? '';
    log(`${what} -> ${res.status} ${ct}`);
    if (res.ok && ct.startsWith('text/event-stream') && res.body) {
        if (method === 'GET' && !lei) resolveGetOpen();
        const [forSdk, forTap] = res.body.tee();
        tap(conn, method, lei, forTap);
        return new Response(forSdk, { status: res.status, statusText: res.statusText, headers: res.headers });
    }
    return res;
};

// --- the client --------------------------------------------------------------------------------
const transport = new StreamableHTTPClientTransport(new URL(url), { fetch: tapFetch });
const client = new Client({ name: 'mcp-reattach-interop-ts-driver', version: '0.0.0' });
client.onerror = err => log(`onerror: ${err?.message ?? err}`);
client.setNotificationHandler(LoggingMessageNotificationSchema, n => emit({ ev: 'notify', data: n.params.data }));

async function runCall(k, call) {
    try {
        const result = await client.callTool({ name: call.tool, arguments: call.args ?? {} }, undefined, {
            timeout: timeoutMs,
            onprogress: p => emit({ ev: 'progress', call: k, progress: p.progress, message: p.message ?? null })
        });
        const text = (result.content ?? []).map(c => c.text ?? '').join('');
        emit({ ev: 'result', call: k, text, is_error: result.isError === true });
    } catch (err) {
        emit({ ev: 'error', call: k, message: err?.message ?? String(err), code: err?.code ?? null });
    }
}

async function runNotify(n) {
    const opened = await Promise.race([getOpen.then(() => true), new Promise(r => setTimeout(() => r(false), 3000).unref())]);
    log(opened ? 'standalone GET stream open' : 'standalone GET stream NOT open after 3 s');
    let count = 0;
    let resolveAll;
    const all = new Promise(r => (resolveAll = r));
    client.setNotificationHandler(LoggingMessageNotificationSchema, msg => {
        emit({ ev: 'notify', data: msg.params.data });
        if (++count >= n.expect) resolveAll();
    });
    await runCall('notify', { tool: n.tool, args: n.args });
    await Promise.race([all, new Promise(r => setTimeout(r, n.wait_ms ?? 10000).unref())]);
}

try {
    await client.connect(transport, { timeout: timeoutMs });
    emit({ ev: 'session', session: transport.sessionId ?? null, protocol: transport.protocolVersion ?? null });
    if (plan.notify) {
        await runNotify(plan.notify);
    }
    await Promise.all((plan.calls ?? []).map((c, k) => runCall(k, c)));
} catch (err) {
    emit({ ev: 'error', call: 'connect', message: err?.message ?? String(err), code: err?.code ?? null });
}

if (plan.terminate !== false) {
    try {
        await Promise.race([
            transport.terminateSession(),
            new Promise((_, reject) => setTimeout(() => reject(new Error('timed out after 2 s')), 2000).unref())
        ]);
        log('session terminated');
    } catch (err) {
        log(`terminateSession: ${err?.message ?? err}`);
    }
}
emit({ ev: 'done' });
await Promise.race([client.close().catch(err => log(`close: ${err?.message ?? err}`)), new Promise(r => setTimeout(r, 1000).unref())]);
process.exit(0);
