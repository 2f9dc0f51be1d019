// A TypeScript SDK v2 MCP server served by the v2 recommended HTTP entry `createMcpHandler`
// (npm @modelcontextprotocol/server 2.4.0, mounted on node:http with toNodeHandler from
// @modelcontextprotocol/node 2.1.2), used as an unmodified upstream by the mcp-reattach interop
// tests (tests/sdk/interop_shapes.rs).
//
// Usage: node ts2-server.mjs [--response-mode auto|sse|json] [port]
//   port defaults to 0 (an ephemeral port); always binds 127.0.0.1.
//   --response-mode  passed as createMcpHandler's `responseMode` (default: not set, i.e. 'auto').
//                    The option shapes only modern (2026-07-28) exchanges; 2025-era clients (every
//                    client of the interop tests) are served by the entry's default
//                    `legacy: 'stateless'` fallback whatever it says: a fresh server per request
//                    over a transport made with only `sessionIdGenerator: undefined` (no
//                    Mcp-Session-Id, SSE answers without ids, GET and DELETE answered 405).
//
// createMcpHandler's defaults otherwise, with the Host/Origin guards the node package's README
// puts in front of a plain node:http server (localhostHostValidation, localhostOriginValidation).
//
// Prints `LISTENING <port>` on stdout once it accepts connections. Logs go to stderr.
// Tools (the same contract as ../ts-server.mjs):
//   slow_progress {steps, interval_ms}   progress 1..steps (message `step i`), then `done <steps>`
//   counter {}                           increments a per-process counter, sends 2 notifications
//                                        (progress if the call has a progressToken, else log)
//                                        ~100 ms apart, then returns `applied <counter>`

import { createServer } from 'node:http';
import { localhostHostValidation, localhostOriginValidation, toNodeHandler } from '@modelcontextprotocol/node';
import { createMcpHandler, McpServer } from '@modelcontextprotocol/server';
import { z } from 'zod';

const argv = process.argv.slice(2);
let responseMode;
const rm = argv.indexOf('--response-mode');
if (rm >= 0) {
    responseMode = argv[rm + 1];
    argv.splice(rm, 2);
    if (!['auto', 'sse', 'json'].includes(responseMode)) {
        console.error(`unknown --response-mode ${JSON.stringify(responseMode)} (expected auto, sse or json)`);
        process.exit(2);
    }
}
const port = Number(argv[0] ?? 0);

const log = (...args) => console.error(...args);
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));

/** The `counter` tool's count, shared by every request of this process. */
let counterValue = 0;

function buildServer({ era }) {
    const server = new McpServer(
        { name: 'mcp-reattach-interop-ts2-server', version: '0.0.0' },
        { capabilities: { logging: {} } }
    );
    server.registerTool(
        'slow_progress',
        {
            description: 'Sends `steps` progress notifications, `interval_ms` apart, then returns `done <steps>`',
            inputSchema: z.object({ steps: z.number().int().min(0), interval_ms: z.number().int().min(0) })
        },
        async ({ steps, interval_ms }, ctx) => {
            const progressToken = ctx.mcpReq._meta?.progressToken;
            log(`slow_progress (${era} era) token ${JSON.stringify(progressToken)}`);
            for (let i = 1; i <= steps; i++) {
                log(`slow_progress ${i}/${steps}`);
                if (progressToken !== undefined) {
                    try {
                        await ctx.mcpReq.notify({
                            method: 'notifications/progress',
                            params: { progressToken, progress: i, total: steps, message: `step ${i}` }
                        });
                    } catch (err) {
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
        'counter',
        {
            description:
                'Increments a per-process counter, sends 2 notifications ~100 ms apart, then returns `applied <counter>`',
            inputSchema: z.object({})
        },
        async (_args, ctx) => {
            const n = ++counterValue;
            log(`counter: applied ${n} (JSON-RPC id ${JSON.stringify(ctx.mcpReq.id)})`);
            const progressToken = ctx.mcpReq._meta?.progressToken;
            for (let i = 1; i <= 2; i++) {
                try {
                    await ctx.mcpReq.notify(
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
    return server;
}

const handler = createMcpHandler(buildServer, {
    ...(responseMode ? { responseMode } : {}),
    onerror: err => log(`createMcpHandler onerror: ${err?.message ?? err}`)
});
const serve = toNodeHandler(handler, { onerror: err => log(`toNodeHandler onerror: ${err?.message ?? err}`) });
const validateHost = localhostHostValidation();
const validateOrigin = localhostOriginValidation();

const httpServer = createServer(async (req, res) => {
    log(`${req.method} ${req.url}${req.headers['mcp-session-id'] ? ` carrying Mcp-Session-Id ${req.headers['mcp-session-id']}` : ''}`);
    if (!validateHost(req, res) || !validateOrigin(req, res)) return;
    await serve(req, res);
});

httpServer.listen(port, '127.0.0.1', () => {
    process.stdout.write(`LISTENING ${httpServer.address().port}\n`);
});

const shutdown = async () => {
    await handler.close().catch(() => {});
    httpServer.close();
    process.exit(0);
};
process.on('SIGINT', shutdown);
process.on('SIGTERM', shutdown);
