// The TypeScript-SDK client for the conformance suite's client scenarios (tests/sdk/interop_conformance.rs).
//
// Usage (by the runner): node conformance-client.mjs <server-url>
//   `conformance client --command "node conformance-client.mjs" --scenario sse-retry` appends the
//   URL of its scenario server and sets MCP_CONFORMANCE_SCENARIO.
//   MCP_REATTACH_BIN=<path>: start that mcp-reattach binary in front of <server-url> (loopback,
//   ephemeral port) and connect through it instead.
//
// Scenario sse-retry: connect, call `test_reconnection`, print the result. Any other scenario:
// connect, list the tools, call each without arguments. Default reconnection options.

import { spawn } from 'node:child_process';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const serverUrl = process.argv[process.argv.length - 1];
const scenario = process.env.MCP_CONFORMANCE_SCENARIO ?? '';
const started = Date.now();
const log = (...a) => console.error(`+${String(Date.now() - started).padStart(5)}ms`, ...a);

async function startGateway(bin, upstream) {
    const child = spawn(bin, ['--upstream', upstream, '--listen', '127.0.0.1:0', '--admin-listen', '127.0.0.1:0'], {
        stdio: ['ignore', 'pipe', 'pipe'],
        env: { ...process.env, NO_COLOR: '1' }
    });
    child.stderr.on('data', d => process.stderr.write(`[gateway] ${d}`));
    const addr = await new Promise((resolve, reject) => {
        let buf = '';
        const timer = setTimeout(() => reject(new Error('the gateway did not report its address in 10 s')), 10000);
        child.stdout.on('data', d => {
            buf += d.toString();
            process.stderr.write(`[gateway] ${d}`);
            // eslint-disable-next-line no-control-regex
            const m = buf.replace(/\x1b\[[0-9;]*m/g, '').match(/listen=(\S+)/);
            if (m) {
                clearTimeout(timer);
                resolve(m[1]);
            }
        });
        child.on('exit', code => reject(new Error(`the gateway exited (${code})`)));
    });
    return { child, url: `http://${addr}/` };
}

let gateway;
let url = serverUrl;
if (process.env.MCP_REATTACH_BIN) {
    gateway = await startGateway(process.env.MCP_REATTACH_BIN, new URL(serverUrl).origin);
    url = gateway.url;
    log(`through mcp-reattach at ${url} (upstream ${serverUrl})`);
}

const loggingFetch = async (input, init) => {
    const method = init?.method ?? 'GET';
    const lei = new Headers(init?.headers).get('last-event-id');
    try {
        const res = await fetch(input, init);
        log(`HTTP ${method} lei=${lei ?? '-'} -> ${res.status} ${res.headers.get('content-type') ?? ''}`);
        return res;
    } catch (err) {
        log(`HTTP ${method} lei=${lei ?? '-'} -> failed: ${err?.message ?? err}`);
        throw err;
    }
};

let code = 0;
const transport = new StreamableHTTPClientTransport(new URL(url), { fetch: loggingFetch });
const client = new Client({ name: 'mcp-reattach-conformance-client', version: '0.0.0' });
client.onerror = err => log(`onerror: ${err?.message ?? err}`);
try {
    await client.connect(transport, { timeout: 10000 });
    if (scenario === 'sse-retry') {
        const result = await client.callTool({ name: 'test_reconnection', arguments: {} }, undefined, { timeout: 10000 });
        console.log(JSON.stringify({ result }));
    } else {
        const { tools } = await client.listTools();
        for (const tool of tools) {
            const result = await client.callTool({ name: tool.name, arguments: {} }, undefined, { timeout: 10000 });
            console.log(JSON.stringify({ tool: tool.name, result }));
        }
    }
} catch (err) {
    console.log(JSON.stringify({ error: err?.message ?? String(err) }));
    code = 1;
}
await Promise.race([client.close().catch(() => {}), new Promise(r => setTimeout(r, 1000).unref())]);
gateway?.child.kill('SIGKILL');
process.exit(code);
