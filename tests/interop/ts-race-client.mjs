// The TypeScript-SDK MCP client (Streamable HTTP, unmodified) in the standalone-stream race of
// issue 14, driven by tests/sdk/interop_standalone_race.rs.
//
// Usage: node ts-race-client.mjs <url> '{"tool":"notify_now"|"elicit_now","trials":12,"parallel":4,
//                                        "wait_ms":2000,"elicit_timeout_ms":3000}'
//
// Each trial is a new session, exactly as an application uses the SDK: a new
// StreamableHTTPClientTransport and Client (capabilities {elicitation: {}}, a handler answering
// every elicitation/create with {action: "accept", content: {answer: <tag>}}, a handler for log
// notifications), `await client.connect(transport)`, then AT ONCE (no wait for the standalone GET
// the SDK opens by itself after `notifications/initialized`) `callTool(<tool>, {tag})`:
//   notify_now  the server sends a log notification {tag} on its standalone GET stream before it
//               returns; the trial waits up to `wait_ms` after the result for it, then 300 ms more
//               (duplicates).
//   elicit_now  the server sends elicitation/create on its standalone GET stream and awaits the
//               answer (server-side timeout `elicit_timeout_ms`); the call's result carries it.
// `parallel` trials run at a time. Every trial then terminates its session (DELETE) and closes.
//
// stdout, one JSON object per line:
//   {"ev":"trial","i":…,"tag":…,"delivered":n,"result":"…"|null,"is_error":bool,"error":…|null,
//    "elicited":n,"requests":[{"kind":…,"method":…,"sent_ms":t,"status":s,"head_ms":t,
//    "headers":{…}}…],"ms":t}
//      `delivered`: notifications {tag} the client received; `elicited`: elicitation requests it
//      answered; `requests`: every HTTP request of the trial's transport in the order fetch was
//      called (kind = the JSON-RPC method, "response", or "GET"/"DELETE"), times relative to the
//      trial's start, `headers` as the SDK passed them to fetch (GET only)
//   {"ev":"done"} last.
// Diagnostics go to stderr.

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { ElicitRequestSchema, LoggingMessageNotificationSchema } from '@modelcontextprotocol/sdk/types.js';

const [url, planArg = '{}'] = process.argv.slice(2);
if (!url) {
    console.error("usage: node ts-race-client.mjs <url> '<plan json>'");
    process.exit(2);
}
const plan = JSON.parse(planArg);
const tool = plan.tool ?? 'notify_now';
if (!['notify_now', 'elicit_now'].includes(tool)) {
    console.error(`unknown tool ${JSON.stringify(tool)}`);
    process.exit(2);
}
const trials = plan.trials ?? 12;
const parallel = Math.max(1, plan.parallel ?? 4);
const waitMs = plan.wait_ms ?? 2000;
const elicitTimeoutMs = plan.elicit_timeout_ms ?? 3000;

const started = Date.now();
const log = (...args) => console.error(`+${String(Date.now() - started).padStart(5)}ms`, ...args);
const emit = obj => process.stdout.write(JSON.stringify(obj) + '\n');
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));

function kindOf(method, body) {
    if (method !== 'POST' || typeof body !== 'string') return method;
    try {
        const m = JSON.parse(body);
        return m.method ?? (m.result !== undefined || m.error !== undefined ? 'response' : 'POST');
    } catch {
        return 'POST';
    }
}

async function trial(i) {
    const t0 = Date.now();
    const at = () => Date.now() - t0;
    const tag = `sdk-${i}-${Math.random().toString(36).slice(2, 8)}`;
    const requests = [];
    const tapFetch = async (input, init) => {
        const method = init?.method ?? 'GET';
        const rec = { kind: kindOf(method, init?.body), method, sent_ms: at(), status: null, head_ms: null };
        if (method === 'GET') {
            rec.headers = Object.fromEntries(new Headers(init?.headers));
        }
        requests.push(rec);
        try {
            const res = await fetch(input, init);
            rec.status = res.status;
            rec.head_ms = at();
            return res;
        } catch (err) {
            rec.error = String(err?.cause?.code ?? err?.message ?? err);
            throw err;
        }
    };
    const transport = new StreamableHTTPClientTransport(new URL(url), { fetch: tapFetch });
    const client = new Client(
        { name: 'mcp-reattach-interop-race-client', version: '0.0.0' },
        { capabilities: { elicitation: {} } }
    );
    client.onerror = err => log(`trial ${i} onerror: ${err?.message ?? err}`);
    let delivered = 0;
    let elicited = 0;
    let wake = () => {};
    client.setNotificationHandler(LoggingMessageNotificationSchema, n => {
        if (n.params?.data?.tag === tag) {
            delivered++;
            wake();
        }
    });
    client.setRequestHandler(ElicitRequestSchema, async () => {
        elicited++;
        return { action: 'accept', content: { answer: tag } };
    });
    const out = { ev: 'trial', i, tag, delivered: 0, result: null, is_error: false, error: null, elicited: 0 };
    try {
        await client.connect(transport, { timeout: 10000 });
        const args = tool === 'elicit_now' ? { tag, timeout_ms: elicitTimeoutMs } : { tag };
        const r = await client.callTool({ name: tool, arguments: args }, undefined, {
            timeout: tool === 'elicit_now' ? elicitTimeoutMs + 5000 : 10000
        });
        out.result = (r.content ?? []).map(c => c.text ?? '').join('');
        out.is_error = r.isError === true;
        if (tool === 'notify_now') {
            if (delivered === 0) {
                await Promise.race([new Promise(resolve => (wake = resolve)), sleep(waitMs)]);
            }
            await sleep(300); // a duplicate would show up here
        }
    } catch (err) {
        out.error = err?.message ?? String(err);
    }
    out.delivered = delivered;
    out.elicited = elicited;
    try {
        await Promise.race([transport.terminateSession(), sleep(2000)]);
    } catch (err) {
        log(`trial ${i} terminateSession: ${err?.message ?? err}`);
    }
    await Promise.race([client.close().catch(() => {}), sleep(1000)]);
    emit({ ...out, requests, ms: at() });
}

let next = 0;
async function worker() {
    while (next < trials) {
        const i = next++;
        await trial(i);
    }
}
await Promise.all(Array.from({ length: parallel }, worker));
emit({ ev: 'done', at_ms: Date.now() - started });
process.exit(0);
