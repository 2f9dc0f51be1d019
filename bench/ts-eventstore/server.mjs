// The `ts-eventstore` arm of the reconnect storm (bench/src/bin/bench.rs): an MCP server that
// resumes streams itself, the way the TypeScript SDK does it: StreamableHTTPServerTransport
// (stateful sessions, sessionIdGenerator) with the SDK's InMemoryEventStore, one store per
// session as in the SDK's example server (dist/esm/examples/server/simpleStreamableHttp.js).
// It serves what `load storm` asks of the mock upstream (bench/src/bin/mock-upstream.rs):
//
//   POST initialize                 a new session (JSON answer, enableJsonResponse)
//   GET ?events=E&size=S            the standalone stream; once it is registered, E log
//                                   notifications {seq, ts, pad} of exactly S bytes of `data`
//                                   are sent on it, each stored (and given its id) by the store
//   GET + Last-Event-ID             the transport replays from the store (no gateway involved)
//
// Usage: node server.mjs [--port N] [--ids ordered|sdk]
//   --ids ordered (default)  InMemoryEventStore with two id methods overridden (below); its
//                            storeEvent and replayEventsAfter (the work of a resume) are the SDK's
//   --ids sdk                the store exactly as shipped; it cannot serve this storm (the
//                            standalone stream replays nothing), kept to show why
// Prints `LISTEN 127.0.0.1:<port>` on stdout once it accepts connections. Errors go to stderr.
//
// Why the ids are overridden: the shipped store's ids are `${streamId}_${Date.now()}_${random}`
// and it recovers the stream from an id with `id.split('_')[0]`. The standalone stream's id is
// `_GET_stream`, so that gives '' and a resume of the standalone stream replays nothing; and it
// replays in `localeCompare` order of the ids, so events stored in the same millisecond (a
// burst) come back in the order of their random suffixes. Ordered ids
// `${streamId}#${12-digit counter}` fix both without touching the store's data structure or
// its replay (which sorts all of the session's stored events on every resume).

import { randomUUID } from 'node:crypto';
import http from 'node:http';
import { Server } from '@modelcontextprotocol/sdk/server/index.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { InMemoryEventStore } from '@modelcontextprotocol/sdk/examples/shared/inMemoryEventStore.js';
import { isInitializeRequest } from '@modelcontextprotocol/sdk/types.js';

function arg(name, dflt) {
    const i = process.argv.indexOf(`--${name}`);
    return i > 0 && i + 1 < process.argv.length ? process.argv[i + 1] : dflt;
}
const port = Number(arg('port', '0'));
const ids = arg('ids', 'ordered');
if (!['ordered', 'sdk'].includes(ids)) {
    console.error(`unknown --ids ${JSON.stringify(ids)} (expected ordered or sdk)`);
    process.exit(2);
}

class OrderedIdEventStore extends InMemoryEventStore {
    #n = 0;
    generateEventId(streamId) {
        this.#n += 1;
        return `${streamId}#${String(this.#n).padStart(12, '0')}`;
    }
    getStreamIdFromEventId(eventId) {
        const at = eventId.lastIndexOf('#');
        return at > 0 ? eventId.slice(0, at) : '';
    }
}

/** sessionId → { server, transport } */
const sessions = new Map();

const STANDALONE = '_GET_stream';
const standaloneOpen = transport => transport._webStandardTransport?._streamMapping?.has(STANDALONE);

/** Resolves once `transport`'s standalone stream is registered (at most `ms`), else throws. */
async function standaloneRegistered(transport, ms) {
    const until = Date.now() + ms;
    while (!standaloneOpen(transport)) {
        if (Date.now() > until) {
            throw new Error(`standalone stream not registered within ${ms} ms`);
        }
        await new Promise(resolve => setImmediate(resolve));
    }
}

/** `data` of event `seq`: the load client's payload (bench/src/lib.rs `payload`), `size` bytes. */
function progress(seq, size) {
    // CLOCK_MONOTONIC ns, the clock the load client reads (unused by the storm's checks).
    const ts = Number(process.hrtime.bigint());
    const params = { level: 'info', data: { seq, ts, pad: '' } };
    // The transport writes JSON.stringify of { method, params, jsonrpc }.
    const bare = JSON.stringify({ method: 'notifications/message', params, jsonrpc: '2.0' }).length;
    params.data.pad = 'x'.repeat(Math.max(0, size - bare));
    return { method: 'notifications/message', params };
}

async function readJson(req) {
    const parts = [];
    for await (const p of req) parts.push(p);
    const text = Buffer.concat(parts).toString('utf8');
    return text ? JSON.parse(text) : undefined;
}

function jsonError(res, status, message) {
    res.writeHead(status, { 'Content-Type': 'application/json' });
    res.end(JSON.stringify({ jsonrpc: '2.0', error: { code: -32000, message }, id: null }));
}

async function newSession(req, res, body) {
    const eventStore = ids === 'sdk' ? new InMemoryEventStore() : new OrderedIdEventStore();
    const server = new Server({ name: 'bench-ts-eventstore', version: '0.0.0' }, { capabilities: { logging: {} } });
    const transport = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => randomUUID(),
        eventStore,
        enableJsonResponse: true,
        onsessioninitialized: sid => sessions.set(sid, { server, transport })
    });
    transport.onclose = () => {
        if (transport.sessionId) sessions.delete(transport.sessionId);
    };
    await server.connect(transport);
    await transport.handleRequest(req, res, body);
}

async function getStream(req, res, session) {
    const url = new URL(req.url, 'http://localhost');
    const events = Number(url.searchParams.get('events') ?? 0);
    const size = Number(url.searchParams.get('size') ?? 200);
    const served = session.transport.handleRequest(req, res);
    if (req.headers['last-event-id'] === undefined && events > 0) {
        await standaloneRegistered(session.transport, 10_000);
        for (let seq = 0; seq < events; seq++) {
            // No relatedRequestId: the transport stores it (assigning its id) and writes it
            // on the standalone stream.
            await session.server.notification(progress(seq, size));
        }
    }
    await served;
}

async function handle(req, res) {
    const sid = req.headers['mcp-session-id'];
    if (req.method === 'POST') {
        const body = await readJson(req);
        if (sid === undefined) {
            if (!isInitializeRequest(body)) return jsonError(res, 400, 'Bad Request: no session and not initialize');
            return newSession(req, res, body);
        }
        const s = sessions.get(sid);
        if (!s) return jsonError(res, 404, 'Session not found');
        return s.transport.handleRequest(req, res, body);
    }
    const s = sid === undefined ? undefined : sessions.get(sid);
    if (!s) return jsonError(res, sid === undefined ? 400 : 404, 'Session not found');
    if (req.method === 'GET') return getStream(req, res, s);
    return s.transport.handleRequest(req, res);
}

const httpServer = http.createServer((req, res) => {
    handle(req, res).catch(err => {
        console.error(`${req.method} ${req.url}: ${err?.stack ?? err}`);
        if (!res.headersSent) jsonError(res, 500, String(err?.message ?? err));
        else res.destroy();
    });
});
// A storm opens every connection at once.
httpServer.listen(port, '127.0.0.1', 4096, () => {
    process.stdout.write(`LISTEN 127.0.0.1:${httpServer.address().port}\n`);
});
for (const sig of ['SIGTERM', 'SIGINT']) {
    process.on(sig, () => process.exit(0));
}
