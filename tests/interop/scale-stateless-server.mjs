// A stateless TypeScript-SDK MCP server (Streamable HTTP, legacy protocol) for the scale-out
// test with a stateless upstream (tests/fleet/scale_out.rs): `sessionIdGenerator: undefined`, a fresh
// server and transport per POST (as the SDK's examples/server/simpleStatelessStreamableHttp.js),
// no Mcp-Session-Id on any answer, SSE answers without ids (no event store); GET and DELETE
// are answered 405.
//
// Usage: node scale-stateless-server.mjs [port]   (default 0: an ephemeral port; binds 127.0.0.1)
//
// Prints `LISTENING <port>` on stdout once it accepts connections. Logs go to stderr.
// Tools (the same contract as ts-server.mjs's, which tests/interop/ts-scale-client.mjs uses):
//   work {key, steps, interval_ms}   progress 1..steps, `interval_ms` apart, then returns the JSON
//                                    text {"replica":…,"key":…,"executions":n}: $MCP_REPLICA and
//                                    how many times a call with this key has run in this process
//   whoami {}                        returns the JSON text {"replica":…} ($MCP_REPLICA)
//
// A request that carries Mcp-Session-Id is answered 400 (and logged as `UNEXPECTED
// Mcp-Session-Id`): this server never issued one, so a gateway in front of it that mints the
// client's session id must not forward it. (A stock stateless SDK server ignores the header.)

import http from 'node:http';
import { z } from 'zod';
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';

const port = Number(process.argv[2] ?? 0);
const replica = process.env.MCP_REPLICA ?? null;
const log = (...args) => console.error(`[${replica ?? 'stateless'}]`, ...args);
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));
/** How many times the `work` tool ran for each key in this process (across all requests). */
const workRuns = new Map();

function buildServer() {
    const server = new McpServer({ name: 'mcp-reattach-scale-stateless', version: '0.0.0' }, { capabilities: { logging: {} } });
    server.registerTool(
        'work',
        {
            description: 'Sends `steps` progress notifications, `interval_ms` apart, then returns {replica, key, executions}',
            inputSchema: { key: z.string(), steps: z.number().int().min(0), interval_ms: z.number().int().min(0) }
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
                if (i < steps) await sleep(interval_ms);
            }
            return { content: [{ type: 'text', text: JSON.stringify({ replica, key, executions }) }] };
        }
    );
    server.registerTool('whoami', { description: 'Returns {replica}', inputSchema: {} }, async () => ({
        content: [{ type: 'text', text: JSON.stringify({ replica }) }]
    }));
    return server;
}

const sendJson = (res, status, code, message, headers = {}) => {
    if (res.headersSent) return;
    res.writeHead(status, { 'Content-Type': 'application/json', ...headers });
    res.end(JSON.stringify({ jsonrpc: '2.0', error: { code, message }, id: null }));
};

const httpServer = http.createServer(async (req, res) => {
    const path = new URL(req.url ?? '/', 'http://localhost').pathname;
    const sid = req.headers['mcp-session-id'];
    try {
        if (path !== '/mcp') {
            sendJson(res, 404, -32000, 'Not found');
        } else if (sid !== undefined) {
            log(`UNEXPECTED Mcp-Session-Id ${sid} on ${req.method} (this server is stateless)`);
            sendJson(res, 400, -32000, 'Bad Request: this server is stateless and issued no Mcp-Session-Id');
        } else if (req.method === 'POST') {
            const server = buildServer();
            const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined });
            res.on('close', () => {
                transport.close();
                server.close();
            });
            await server.connect(transport);
            await transport.handleRequest(req, res);
        } else {
            log(`${req.method} -> 405`);
            sendJson(res, 405, -32000, 'Method not allowed.', { Allow: 'POST' });
        }
    } catch (err) {
        log('error handling request:', err);
        sendJson(res, 500, -32603, 'Internal server error');
    }
});
httpServer.listen(port, '127.0.0.1', () => {
    process.stdout.write(`LISTENING ${httpServer.address().port}\n`);
});
process.on('SIGINT', () => process.exit(0));
process.on('SIGTERM', () => process.exit(0));
