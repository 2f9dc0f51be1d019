// A stateful TypeScript-SDK MCP server (Streamable HTTP, legacy protocol) used as the
// upstream in the mcp-reattach end-to-end tests.
//
// Usage: node ts-server.mjs [sse|json] [port]
//   sse  (default) answers requests with SSE streams (no event ids: there is no eventStore)
//   json           answers requests with one JSON object (enableJsonResponse: true)
//   port           defaults to 0 (an ephemeral port); always binds 127.0.0.1
//
// Prints `LISTENING <port>` on stdout once it accepts connections. Logs go to stderr.
// Routing follows the SDK example dist/esm/examples/server/simpleStreamableHttp.js, on node:http.

import { randomUUID } from 'node:crypto';
import http from 'node:http';
import { z } from 'zod';
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { isInitializeRequest } from '@modelcontextprotocol/sdk/types.js';

const mode = process.argv[2] ?? 'sse';
if (mode !== 'sse' && mode !== 'json') {
    console.error(`unknown mode ${JSON.stringify(mode)} (expected sse or json)`);
    process.exit(2);
}
const port = Number(process.argv[3] ?? 0);

const log = (...args) => console.error('[ts-server]', ...args);
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));

function buildServer() {
    const server = new McpServer({ name: 'mcp-reattach-interop-server', version: '0.0.0' });
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
                if (progressToken !== undefined) {
                    try {
                        await extra.sendNotification({
                            method: 'notifications/progress',
                            params: { progressToken, progress: i, total: steps, message: `step ${i}` }
                        });
                    } catch (err) {
                        // The SDK throws when the request's stream is gone; keep going so the
                        // tool still finishes (a legacy disconnect is not a cancel).
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
    return server;
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
        enableJsonResponse: mode === 'json',
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
    if (req.method === 'GET') {
        const lastEventId = req.headers['last-event-id'];
        log(lastEventId ? `GET with Last-Event-ID ${lastEventId} (no event store: ignored)` : 'GET standalone stream');
    }
    await transport.handleRequest(req, res);
}

const httpServer = http.createServer(async (req, res) => {
    const path = new URL(req.url ?? '/', 'http://localhost').pathname;
    log(`${req.method} ${req.url}`);
    try {
        if (path !== '/mcp') {
            sendJson(res, 404, jsonRpcError(-32000, 'Not found'));
        } else if (req.method === 'POST') {
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
