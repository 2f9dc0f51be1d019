// A TypeScript-SDK MCP server (Streamable HTTP, legacy protocol) used as the upstream in the
// mcp-reattach end-to-end tests.
//
// Usage: node ts-server.mjs [sse|json|stateless-sse|stateless-json|sse-resumable] [port]
//   sse  (default) stateful; answers requests with SSE streams (no event ids: no eventStore)
//   json           stateful; answers requests with one JSON object (enableJsonResponse: true)
//   stateless-sse  stateless (`sessionIdGenerator: undefined`: no Mcp-Session-Id on any answer),
//                  a fresh server and transport per POST, closed when the response closes, as
//                  the SDK's example dist/esm/examples/server/simpleStatelessStreamableHttp.js
//                  does; GET and DELETE are answered 405 as there; SSE answers, no ids
//   stateless-json the same with enableJsonResponse: true
//   sse-resumable  SSE with a small in-memory event store, so the SDK server itself sets ids
//                  and answers `Last-Event-ID`; a positive control for the test harness only
//                  (the gateway exists for servers that do NOT do this)
//   port           defaults to 0 (an ephemeral port); always binds 127.0.0.1
//
// Prints `LISTENING <port>` on stdout once it accepts connections. Logs go to stderr.
// Tools:
//   slow_progress {steps, interval_ms}   progress 1..steps, `interval_ms` apart, then `done <steps>`
//   notify_standalone {count, interval_ms, delay_ms?, tag?}
//                                        returns at once; then, after `delay_ms` (default 0), sends
//                                        `count` log notifications {seq: i, of: count, tag}, each
//                                        `interval_ms` after the previous, on the standalone GET
//                                        stream
//   flood {count, size}                  `count` progress notifications with a `message` padded to
//                                        ~`size` bytes, with no delay between them, then
//                                        `flooded <count>` (flow control: tests/sdk/interop_reattach.rs)
//   counter {}                           increments a per-process counter, sends 2 notifications
//                                        (progress if the call has a progressToken, else log)
//                                        ~100 ms apart, then returns `applied <counter>`
//                                        (retransmission: it must run once per JSON-RPC request)
//   close_standalone {}                  closes this session's standalone GET stream from the
//                                        server side (transport.closeStandaloneSSEStream(), the
//                                        2025-11-25 "SSE polling" close); returns `closed`
//   notify_now {tag}                     at once (before returning) sends one log notification
//                                        {tag} NOT related to the call, so the SDK routes it to the
//                                        standalone GET stream (and drops it silently when no GET
//                                        is open: no event store); returns the JSON text
//                                        {"tag":…,"standalone_open":bool} (whether a standalone
//                                        stream was registered when it was sent)
//                                        (tests/sdk/interop_standalone_race.rs)
//   elicit_now {tag, timeout_ms?}        at once sends `elicitation/create` (form: {answer: string})
//                                        NOT related to the call (server.elicitInput without
//                                        relatedRequestId: the standalone GET stream), awaits the
//                                        client's answer (at most `timeout_ms`, default 10000), and
//                                        returns the JSON text {"tag":…,"action":…,"answer":…,
//                                        "standalone_open":bool}; isError with the cause if the
//                                        request failed or timed out
//   work {key, steps, interval_ms}       progress 1..steps, `interval_ms` apart, then returns the JSON
//                                        text {"replica":…,"key":…,"executions":n}: the process's
//                                        $MCP_REPLICA and how many times a call with this key has
//                                        run in this process (exactly-once checks: tests/fleet/scale_out.rs)
//   whoami {}                            returns the JSON text {"replica":…} ($MCP_REPLICA)
// Routing follows the SDK example dist/esm/examples/server/simpleStreamableHttp.js, on node:http.

import { randomUUID } from 'node:crypto';
import http from 'node:http';
import { z } from 'zod';
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { isInitializeRequest } from '@modelcontextprotocol/sdk/types.js';

const mode = process.argv[2] ?? 'sse';
const MODES = ['sse', 'json', 'stateless-sse', 'stateless-json', 'sse-resumable'];
if (!MODES.includes(mode)) {
    console.error(`unknown mode ${JSON.stringify(mode)} (expected one of ${MODES.join(', ')})`);
    process.exit(2);
}
const stateless = mode.startsWith('stateless-');
const jsonResponse = mode === 'json' || mode === 'stateless-json';
const port = Number(process.argv[3] ?? 0);

const log = (...args) => console.error(...args);
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));

/** Whether `server`'s session has a standalone GET stream registered (undefined: unknown). */
const standaloneOpen = server =>
    server.server.transport?._webStandardTransport?._streamMapping?.has('_GET_stream');

function buildServer() {
    const server = new McpServer(
        { name: 'mcp-reattach-interop-server', version: '0.0.0' },
        { capabilities: { logging: {} } }
    );
    server.registerTool(
        'slow_progress',
        {
            description: 'Sends `steps` progress notifications, `interval_ms` apart, then returns `done <steps>`',
            inputSchema: {
                steps: z.number().int().min(0),
                interval_ms: z.number().int().min(0)
            }
        },
        async ({ steps, interval_ms }, extra) => {
            const progressToken = extra._meta?.progressToken;
            for (let i = 1; i <= steps; i++) {
                log(`slow_progress ${i}/${steps}`);
                if (progressToken !== undefined) {
                    try {
                        await extra.sendNotification({
                            method: 'notifications/progress',
                            params: { progressToken, progress: i, total: steps, message: `step ${i}` }
                        });
                    } catch (err) {
                        // Keep going if a notification cannot be sent, so the tool still
                        // finishes (in the legacy protocol a disconnect is not a cancel).
                        log(`progress ${i} not sent: ${err?.message ?? err}`);
                    }
                }
                if (i < steps) {
                    await sleep(interval_ms);
                }
            }
            return { content: [{ type: 'text', text: `done ${steps}` }] };
        }
    );
    server.registerTool(
        'notify_standalone',
        {
            description:
                'Returns at once; then, after `delay_ms`, sends `count` log notifications {seq: i, of: count, tag}, `interval_ms` apart, on the standalone GET stream',
            inputSchema: {
                count: z.number().int().min(0),
                interval_ms: z.number().int().min(0),
                delay_ms: z.number().int().min(0).optional(),
                tag: z.string().optional()
            }
        },
        async ({ count, interval_ms, delay_ms, tag }) => {
            (async () => {
                await sleep(delay_ms ?? 0);
                for (let i = 1; i <= count; i++) {
                    await sleep(interval_ms);
                    log(`notify_standalone ${tag ?? ''} ${i}/${count}`);
                    const data = tag === undefined ? { seq: i, of: count } : { seq: i, of: count, tag };
                    try {
                        // No relatedRequestId: the notification goes to the standalone GET stream.
                        await server.server.notification({
                            method: 'notifications/message',
                            params: { level: 'info', logger: 'interop', data }
                        });
                    } catch (err) {
                        log(`notification ${i} not sent: ${err?.message ?? err}`);
                    }
                }
            })();
            return { content: [{ type: 'text', text: `scheduled ${count}` }] };
        }
    );
    server.registerTool(
        'flood',
        {
            description:
                'Sends `count` progress notifications with a message padded to ~`size` bytes, with no delay between them, then returns `flooded <count>`',
            inputSchema: {
                count: z.number().int().min(0),
                size: z.number().int().min(0)
            }
        },
        async ({ count, size }, extra) => {
            const progressToken = extra._meta?.progressToken;
            const started = Date.now();
            if (progressToken !== undefined) {
                const pad = 'x'.repeat(Math.max(0, size - 64));
                for (let i = 1; i <= count; i++) {
                    try {
                        // Awaiting only hands the event to the transport (it has no backpressure).
                        await extra.sendNotification({
                            method: 'notifications/progress',
                            params: { progressToken, progress: i, total: count, message: `flood ${i} ${pad}` }
                        });
                    } catch (err) {
                        log(`flood: progress ${i} not sent: ${err?.message ?? err}`);
                    }
                }
            }
            log(`flood: ${count} notifications of ~${size} bytes handed to the transport in ${Date.now() - started} ms`);
            return { content: [{ type: 'text', text: `flooded ${count}` }] };
        }
    );
    server.registerTool(
        'counter',
        {
            description:
                'Increments a per-process counter, sends 2 notifications ~100 ms apart, then returns `applied <counter>`',
            inputSchema: {}
        },
        async (_args, extra) => {
            const n = ++counterValue;
            log(`counter: applied ${n} (JSON-RPC id ${JSON.stringify(extra.requestId)})`);
            const progressToken = extra._meta?.progressToken;
            for (let i = 1; i <= 2; i++) {
                try {
                    await extra.sendNotification(
                        progressToken !== undefined
                            ? { method: 'notifications/progress', params: { progressToken, progress: i, total: 2, message: `applied ${n}, step ${i}` } }
                            : { method: 'notifications/message', params: { level: 'info', logger: 'counter', data: { applied: n, step: i } } }
                    );
                } catch (err) {
                    log(`counter: notification ${i} not sent: ${err?.message ?? err}`);
                }
                await sleep(100);
            }
            return { content: [{ type: 'text', text: `applied ${n}` }] };
        }
    );
    server.registerTool(
        'close_standalone',
        {
            description: "Closes this session's standalone GET SSE stream from the server side, then returns `closed`",
            inputSchema: {}
        },
        async () => {
            // server.server is the Protocol instance; its transport is this session's
            // StreamableHTTPServerTransport (SDK >= 1.2x has closeStandaloneSSEStream()).
            const transport = server.server.transport;
            const open = transport?._webStandardTransport?._streamMapping?.has('_GET_stream');
            log(`close_standalone: standalone stream ${open === undefined ? 'state unknown' : open ? 'open' : 'NOT open'}; closing it`);
            transport?.closeStandaloneSSEStream();
            return { content: [{ type: 'text', text: 'closed' }] };
        }
    );
    server.registerTool(
        'notify_now',
        {
            description:
                'Sends one log notification {tag} on the standalone GET stream at once (not related to this call), then returns',
            inputSchema: { tag: z.string() }
        },
        async ({ tag }) => {
            const open = standaloneOpen(server);
            log(`notify_now ${tag}: standalone stream ${open === undefined ? 'state unknown' : open ? 'open' : 'NOT open (the notification is dropped)'}`);
            try {
                // No relatedRequestId: the SDK sends it on the standalone GET stream, or nowhere.
                await server.server.notification({
                    method: 'notifications/message',
                    params: { level: 'info', logger: 'interop', data: { tag, seq: 1, of: 1 } }
                });
            } catch (err) {
                log(`notify_now ${tag}: not sent: ${err?.message ?? err}`);
            }
            return { content: [{ type: 'text', text: JSON.stringify({ tag, standalone_open: open ?? null }) }] };
        }
    );
    server.registerTool(
        'elicit_now',
        {
            description:
                'Sends elicitation/create on the standalone GET stream at once (not related to this call), awaits the answer, returns it',
            inputSchema: { tag: z.string(), timeout_ms: z.number().int().min(1).optional() }
        },
        async ({ tag, timeout_ms }) => {
            const open = standaloneOpen(server);
            log(`elicit_now ${tag}: standalone stream ${open === undefined ? 'state unknown' : open ? 'open' : 'NOT open (the request is dropped)'}`);
            try {
                // No relatedRequestId: the request goes to the standalone GET stream.
                const r = await server.server.elicitInput(
                    {
                        message: `interop elicitation ${tag}`,
                        requestedSchema: {
                            type: 'object',
                            properties: { answer: { type: 'string' } },
                            required: ['answer']
                        }
                    },
                    { timeout: timeout_ms ?? 10000 }
                );
                log(`elicit_now ${tag}: ${r.action} ${JSON.stringify(r.content ?? null)}`);
                return {
                    content: [
                        {
                            type: 'text',
                            text: JSON.stringify({ tag, action: r.action, answer: r.content?.answer ?? null, standalone_open: open ?? null })
                        }
                    ]
                };
            } catch (err) {
                log(`elicit_now ${tag}: failed: ${err?.message ?? err}`);
                return {
                    isError: true,
                    content: [{ type: 'text', text: `elicitation failed (standalone stream was ${open ? 'open' : 'not open'}): ${err?.message ?? err}` }]
                };
            }
        }
    );
    server.registerTool(
        'work',
        {
            description:
                'Sends `steps` progress notifications, `interval_ms` apart, then returns {replica, key, executions}',
            inputSchema: {
                key: z.string(),
                steps: z.number().int().min(0),
                interval_ms: z.number().int().min(0)
            }
        },
        async ({ key, steps, interval_ms }, extra) => {
            const executions = (workRuns.get(key) ?? 0) + 1;
            workRuns.set(key, executions);
            log(`work ${key}: execution ${executions}`);
            const progressToken = extra._meta?.progressToken;
            for (let i = 1; i <= steps; i++) {
                if (progressToken !== undefined) {
                    try {
                        await extra.sendNotification({
                            method: 'notifications/progress',
                            params: { progressToken, progress: i, total: steps, message: `${key} ${i}` }
                        });
                    } catch (err) {
                        log(`work ${key}: progress ${i} not sent: ${err?.message ?? err}`);
                    }
                }
                if (i < steps) {
                    await sleep(interval_ms);
                }
            }
            return { content: [{ type: 'text', text: JSON.stringify({ replica, key, executions }) }] };
        }
    );
    server.registerTool('whoami', { description: 'Returns {replica}', inputSchema: {} }, async () => ({
        content: [{ type: 'text', text: JSON.stringify({ replica }) }]
    }));
    return server;
}

/** The `counter` tool's count, shared by every session of this process. */
let counterValue = 0;
/** This process's name for the `work` and `whoami` tools ($MCP_REPLICA). */
const replica = process.env.MCP_REPLICA ?? null;
/** How many times the `work` tool ran for each key in this process. */
const workRuns = new Map();

/**
 * A minimal EventStore for `sse-resumable` (one per session). Ids are `<streamId>.<seq>` with a
 * per-store counter, and replay follows insertion order. (The SDK's example
 * InMemoryEventStore sorts ids made of `Date.now()` and a random suffix, so two events stored
 * in the same millisecond, e.g. the last progress and the result, can replay swapped.)
 */
class OrderedEventStore {
    constructor() {
        this.seq = 0;
        /** @type {{ id: string, streamId: string, message: object }[]} */
        this.events = [];
    }
    async storeEvent(streamId, message) {
        const id = `${streamId}.${++this.seq}`;
        this.events.push({ id, streamId, message });
        return id;
    }
    async getStreamIdForEventId(eventId) {
        return this.events.find(e => e.id === eventId)?.streamId;
    }
    async replayEventsAfter(lastEventId, { send }) {
        const at = this.events.findIndex(e => e.id === lastEventId);
        if (at < 0) {
            throw new Error(`unknown event id ${lastEventId}`);
        }
        const { streamId } = this.events[at];
        for (const e of this.events.slice(at + 1)) {
            // Priming events are stored with an empty message; only replay real messages.
            if (e.streamId === streamId && e.message && Object.keys(e.message).length > 0) {
                await send(e.id, e.message);
            }
        }
        return streamId;
    }
}

/** @type {Map<string, StreamableHTTPServerTransport>} */
const transports = new Map();

function sendJson(res, status, body) {
    if (res.headersSent) {
        res.end();
        return;
    }
    res.writeHead(status, { 'Content-Type': 'application/json' });
    res.end(JSON.stringify(body));
}

const jsonRpcError = (code, message) => ({ jsonrpc: '2.0', error: { code, message }, id: null });

async function readJsonBody(req) {
    const chunks = [];
    for await (const chunk of req) {
        chunks.push(chunk);
    }
    const text = Buffer.concat(chunks).toString('utf8');
    return JSON.parse(text);
}

async function handlePost(req, res) {
    const sessionId = req.headers['mcp-session-id'];
    let body;
    try {
        body = await readJsonBody(req);
    } catch (err) {
        sendJson(res, 400, jsonRpcError(-32700, `Parse error: ${err?.message ?? err}`));
        return;
    }
    let transport = sessionId ? transports.get(sessionId) : undefined;
    if (transport) {
        await transport.handleRequest(req, res, body);
        return;
    }
    if (sessionId) {
        sendJson(res, 404, jsonRpcError(-32001, 'Session not found'));
        return;
    }
    if (!isInitializeRequest(body)) {
        sendJson(res, 400, jsonRpcError(-32000, 'Bad Request: No valid session ID provided'));
        return;
    }
    transport = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => randomUUID(),
        enableJsonResponse: jsonResponse,
        eventStore: mode === 'sse-resumable' ? new OrderedEventStore() : undefined,
        onsessioninitialized: sid => {
            log(`session initialized ${sid}`);
            transports.set(sid, transport);
        }
    });
    transport.onclose = () => {
        const sid = transport.sessionId;
        if (sid && transports.get(sid) === transport) {
            log(`session closed ${sid}`);
            transports.delete(sid);
        }
    };
    await buildServer().connect(transport);
    await transport.handleRequest(req, res, body);
}

/** `stateless-*`: a fresh server and transport for every POST (the SDK's stateless example). */
async function handleStatelessPost(req, res) {
    let body;
    try {
        body = await readJsonBody(req);
    } catch (err) {
        sendJson(res, 400, jsonRpcError(-32700, `Parse error: ${err?.message ?? err}`));
        return;
    }
    const server = buildServer();
    const transport = new StreamableHTTPServerTransport({
        sessionIdGenerator: undefined,
        enableJsonResponse: jsonResponse
    });
    res.on('close', () => {
        transport.close();
        server.close();
    });
    await server.connect(transport);
    await transport.handleRequest(req, res, body);
}

/** `stateless-*`: GET and DELETE as the SDK's stateless example answers them. */
function statelessMethodNotAllowed(req, res) {
    log(`${req.method} answered 405 (stateless)`);
    res.writeHead(405).end(JSON.stringify(jsonRpcError(-32000, 'Method not allowed.')));
}

async function handleGetOrDelete(req, res) {
    const sessionId = req.headers['mcp-session-id'];
    if (!sessionId) {
        sendJson(res, 400, jsonRpcError(-32000, 'Bad Request: Missing session ID'));
        return;
    }
    const transport = transports.get(sessionId);
    if (!transport) {
        sendJson(res, 404, jsonRpcError(-32001, 'Session not found'));
        return;
    }
    if (req.method === 'DELETE') {
        log(`DELETE ${sessionId}`);
    } else {
        const lastEventId = req.headers['last-event-id'];
        log(lastEventId ? `GET with Last-Event-ID ${lastEventId}${mode === 'sse-resumable' ? '' : ' (no event store: treated as a new standalone stream)'}` : 'GET without Last-Event-ID (standalone stream)');
    }
    await transport.handleRequest(req, res);
}

const httpServer = http.createServer(async (req, res) => {
    const path = new URL(req.url ?? '/', 'http://localhost').pathname;
    try {
        if (path !== '/mcp') {
            sendJson(res, 404, jsonRpcError(-32000, 'Not found'));
        } else if (req.method === 'POST' && stateless) {
            log(`POST (stateless)${req.headers['mcp-session-id'] ? ` carrying Mcp-Session-Id ${req.headers['mcp-session-id']}` : ''}`);
            await handleStatelessPost(req, res);
        } else if (stateless && (req.method === 'GET' || req.method === 'DELETE')) {
            statelessMethodNotAllowed(req, res);
        } else if (req.method === 'POST') {
            log(`POST ${req.headers['mcp-session-id'] ?? '(no session)'}`);
            await handlePost(req, res);
        } else if (req.method === 'GET' || req.method === 'DELETE') {
            await handleGetOrDelete(req, res);
        } else {
            res.writeHead(405, { Allow: 'GET, POST, DELETE' });
            res.end();
        }
    } catch (err) {
        log('error handling request:', err);
        sendJson(res, 500, jsonRpcError(-32603, 'Internal server error'));
    }
});

httpServer.listen(port, '127.0.0.1', () => {
    const addr = httpServer.address();
    process.stdout.write(`LISTENING ${addr.port}\n`);
});

const shutdown = async () => {
    for (const transport of transports.values()) {
        await transport.close().catch(() => {});
    }
    httpServer.close();
    process.exit(0);
};
process.on('SIGINT', shutdown);
process.on('SIGTERM', shutdown);
