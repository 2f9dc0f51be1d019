// The TypeScript-SDK MCP client (Streamable HTTP, default reconnection options) driven by
// tests/sdk/interop_reattach.rs. Two scenarios:
//
// Usage: node ts-reattach-client.mjs flood <url> '{"count":3000,"size":4000,"timeout_ms":120000}'
//   Calls the server's `flood` tool with a progress callback (timeout `timeout_ms`, reset on
//   every progress notification) and records every progress notification. Prints one
//   {"ev":"tick","n":k,"at_ms":t} every 250 notifications and, at the end,
//   {"ev":"flood","text":"flooded N"|null,"error":"…"|null,"code":c|null,"progress":[…],
//    "min_message_bytes":m,"elapsed_ms":t,"first_ms":t1,"last_ms":t2}
//
// Usage: node ts-reattach-client.mjs standalone <url> '{"b_delay_ms":2000,"b_interval_ms":150}'
//   1. connects and waits (≤ 3 s) for its standalone GET stream;
//   2. calls notify_standalone {count: 1, tag: "A"} and waits (≤ 3 s) for notification A;
//   3. calls close_standalone (the server closes the standalone stream; the SDK client
//      reconnects it by itself, GET + Last-Event-ID, after its backoff);
//   4. at once calls notify_standalone {count: 3, tag: "B", delay_ms: b_delay_ms}, then waits
//      (≤ b_delay_ms + 6 s) for B1..B3, and 600 ms more to catch duplicates.
//   Prints {"ev":"notify","tag":…,"seq":…,"at_ms":t} per log notification,
//   {"ev":"call","tool":…,"text"|"error":…,"at_ms":t} per tool call, {"ev":"mark","what":…} at
//   each step.
//
// Both: {"ev":"session",…} first, {"ev":"done"} last; {"ev":"http","method":…,"lei":…,
// "status":…,"ct":…,"at_ms":t,"headers":{…}} for every HTTP request the SDK transport makes
// (stdout, so the test can assert on the reconnects), and for GET SSE responses
// {"ev":"sse","conn":k,"type":…,"id":…,"at_ms":t} per event and {"ev":"sse_end","conn":k,…}.
// Diagnostics (`onerror: …`) go to stderr.

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { LoggingMessageNotificationSchema } from '@modelcontextprotocol/sdk/types.js';
import { EventSourceParserStream } from 'eventsource-parser/stream';

const [mode, url, planArg = '{}'] = process.argv.slice(2);
if (!['flood', 'standalone'].includes(mode) || !url) {
    console.error("usage: node ts-reattach-client.mjs flood|standalone <url> '<plan json>'");
    process.exit(2);
}
const plan = JSON.parse(planArg);

const started = Date.now();
const now = () => Date.now() - started;
const log = (...args) => console.error(`+${String(now()).padStart(5)}ms`, ...args);
const emit = obj => process.stdout.write(JSON.stringify(obj) + '\n');
// Timers stay referenced: with no stream open, an unref'd wait would let Node exit mid-scenario.
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));

// --- fetch wrapper: reports every request; taps GET event streams (low volume) -----------------
let connSeq = 0;
let resolveGetOpen;
const getOpen = new Promise(resolve => (resolveGetOpen = resolve));

async function tapGet(conn, stream) {
    try {
        const reader = stream
            .pipeThrough(new TextDecoderStream())
            .pipeThrough(new EventSourceParserStream())
            .getReader();
        while (true) {
            const { value: ev, done } = await reader.read();
            if (done) break;
            emit({ ev: 'sse', conn, type: ev.event ?? 'message', id: ev.id ?? null, data: ev.data.slice(0, 300), at_ms: now() });
        }
        emit({ ev: 'sse_end', conn, end: 'eof', at_ms: now() });
    } catch (err) {
        emit({ ev: 'sse_end', conn, end: `error: ${err?.message ?? err}`, at_ms: now() });
    }
}

const tapFetch = async (input, init) => {
    const method = init?.method ?? 'GET';
    const headers = new Headers(init?.headers);
    const lei = headers.get('last-event-id');
    const conn = ++connSeq;
    const sent = {};
    for (const [k, v] of headers) {
        if (k !== 'content-type' && k !== 'content-length') sent[k] = v;
    }
    let res;
    try {
        res = await fetch(input, init);
    } catch (err) {
        emit({ ev: 'http', conn, method, lei, status: null, error: String(err?.cause?.code ?? err?.message ?? err), at_ms: now(), headers: sent });
        throw err;
    }
    const ct = res.headers.get('content-type') ?? '';
    emit({ ev: 'http', conn, method, lei, status: res.status, ct, at_ms: now(), headers: sent });
    if (method === 'GET' && res.ok && ct.startsWith('text/event-stream') && res.body) {
        if (!lei) resolveGetOpen();
        const [forSdk, forTap] = res.body.tee();
        tapGet(conn, forTap);
        return new Response(forSdk, { status: res.status, statusText: res.statusText, headers: res.headers });
    }
    return res;
};

const transport = new StreamableHTTPClientTransport(new URL(url), { fetch: tapFetch });
const client = new Client({ name: 'mcp-reattach-interop-reattach-client', version: '0.0.0' });
client.onerror = err => log(`onerror: ${err?.message ?? err}`);

// --- scenario: flood (flow control) ----------------------------------------------------------
async function flood() {
    const progress = [];
    let minMessage = Infinity;
    let firstMs = null;
    let lastMs = null;
    const out = { ev: 'flood', text: null, error: null, code: null };
    const t0 = now();
    try {
        const result = await client.callTool({ name: 'flood', arguments: { count: plan.count, size: plan.size } }, undefined, {
            timeout: plan.timeout_ms ?? 120000,
            resetTimeoutOnProgress: true,
            maxTotalTimeout: (plan.timeout_ms ?? 120000) + 30000,
            onprogress: p => {
                progress.push(p.progress);
                minMessage = Math.min(minMessage, (p.message ?? '').length);
                firstMs ??= now();
                lastMs = now();
                if (progress.length % 250 === 0) emit({ ev: 'tick', n: progress.length, at_ms: lastMs });
            }
        });
        out.text = (result.content ?? []).map(c => c.text ?? '').join('');
    } catch (err) {
        out.error = err?.message ?? String(err);
        out.code = err?.code ?? null;
    }
    emit({
        ...out,
        progress,
        min_message_bytes: Number.isFinite(minMessage) ? minMessage : null,
        elapsed_ms: now() - t0,
        first_ms: firstMs,
        last_ms: lastMs
    });
}

// --- scenario: the server closes the standalone stream ----------------------------------------
async function standalone() {
    const waiters = [];
    const seen = [];
    client.setNotificationHandler(LoggingMessageNotificationSchema, n => {
        const d = n.params.data ?? {};
        seen.push(d);
        emit({ ev: 'notify', tag: d.tag ?? null, seq: d.seq ?? null, at_ms: now() });
        for (const w of waiters) w();
    });
    // Resolves once `pred()` holds, or after `ms`; returns whether it held.
    const until = (pred, ms) =>
        new Promise(resolve => {
            if (pred()) return resolve(true);
            const timer = setTimeout(() => resolve(pred()), ms);
            waiters.push(() => {
                if (pred()) {
                    clearTimeout(timer);
                    resolve(true);
                }
            });
        });
    const call = async (tool, args) => {
        try {
            const r = await client.callTool({ name: tool, arguments: args }, undefined, { timeout: 10000 });
            const text = (r.content ?? []).map(c => c.text ?? '').join('');
            emit({ ev: 'call', tool, text, at_ms: now() });
        } catch (err) {
            emit({ ev: 'call', tool, error: err?.message ?? String(err), at_ms: now() });
        }
    };
    const count = tag => seen.filter(d => d.tag === tag).length;

    const opened = await Promise.race([getOpen.then(() => true), sleep(3000).then(() => false)]);
    emit({ ev: 'mark', what: opened ? 'standalone GET open' : 'standalone GET NOT open after 3 s', at_ms: now() });
    await call('notify_standalone', { count: 1, interval_ms: 0, tag: 'A' });
    const gotA = await until(() => count('A') >= 1, 3000);
    emit({ ev: 'mark', what: gotA ? 'A received' : 'A NOT received within 3 s', at_ms: now() });
    await call('close_standalone', {});
    emit({ ev: 'mark', what: 'close_standalone returned', at_ms: now() });
    const delay = plan.b_delay_ms ?? 2000;
    await call('notify_standalone', { count: 3, interval_ms: plan.b_interval_ms ?? 150, delay_ms: delay, tag: 'B' });
    const gotB = await until(() => count('B') >= 3, delay + 6000);
    emit({ ev: 'mark', what: gotB ? 'B1..B3 received' : `only ${count('B')} of B1..B3 received`, at_ms: now() });
    await sleep(600); // duplicates would show up here
}

try {
    await client.connect(transport, { timeout: 20000 });
    emit({ ev: 'session', session: transport.sessionId ?? null, protocol: transport.protocolVersion ?? null, at_ms: now() });
    if (mode === 'flood') {
        await flood();
    } else {
        await standalone();
    }
} catch (err) {
    emit({ ev: 'error', message: err?.message ?? String(err), code: err?.code ?? null });
}

try {
    await Promise.race([
        transport.terminateSession(),
        new Promise((_, reject) => setTimeout(() => reject(new Error('timed out after 2 s')), 2000).unref())
    ]);
} catch (err) {
    log(`terminateSession: ${err?.message ?? err}`);
}
emit({ ev: 'done', at_ms: now() });
await Promise.race([client.close().catch(err => log(`close: ${err?.message ?? err}`)), sleep(1000)]);
process.exit(0);
