// `@modelcontextprotocol/server-everything` (the pinned npm package, its own server factory
// `createServer` from dist/server/index.js, so every tool, resource and prompt the conformance
// suite uses) behind the TypeScript SDK's StreamableHTTPServerTransport in the two other shapes
// real servers come in. The package itself has no switch for either (its `streamableHttp`
// transport is always stateful, SSE answers, with an event store; it reads only `PORT`), so
// this file is its dist/transports/streamableHttp.js with the transport options a user would
// change (tests/sdk/interop_conformance.rs).
//
// Usage: node conf-everything-server.mjs <stateless|json|stateless-json>
//   stateless       `sessionIdGenerator: undefined`: a fresh server and transport per POST (as
//                   the SDK's examples/server/simpleStatelessStreamableHttp.js), no
//                   Mcp-Session-Id on any answer, SSE answers, no event store; GET and DELETE
//                   are answered 405
//   json            stateful like the package (session ids, its event store for the standalone
//                   GET stream), `enableJsonResponse: true`: every request answered with one
//                   JSON body
//   stateless-json  both: stateless and JSON answers
//
// Always listens on 127.0.0.1 with an ephemeral port and prints `LISTENING <port>` on stdout
// once it accepts connections. Logs go to stderr.

import { randomUUID } from 'node:crypto';
import express from 'express';
import cors from 'cors';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { createServer } from '@modelcontextprotocol/server-everything/dist/server/index.js';

const mode = process.argv[2];
if (!['stateless', 'json', 'stateless-json'].includes(mode)) {
    console.error(`unknown mode ${JSON.stringify(mode)} (expected stateless, json or stateless-json)`);
    process.exit(2);
}
const stateless = mode.startsWith('stateless');
const enableJsonResponse = mode.endsWith('json');
const log = (...args) => console.error(...args);

// The package's InMemoryEventStore (dist/transports/streamableHttp.js), unchanged.
class InMemoryEventStore {
    events = new Map();
    async storeEvent(streamId, message) {
        const eventId = randomUUID();
        this.events.set(eventId, { streamId, message });
        return eventId;
    }
    async replayEventsAfter(lastEventId, { send }) {
        const entries = Array.from(this.events.entries());
        const startIndex = entries.findIndex(([id]) => id === lastEventId);
        if (startIndex === -1) return lastEventId;
        let lastId = lastEventId;
        for (let i = startIndex + 1; i < entries.length; i++) {
            const [eventId, { message }] = entries[i];
            await send(eventId, message);
            lastId = eventId;
        }
        return lastId;
    }
}

const app = express();
app.use(
    cors({
        origin: '*',
        methods: 'GET,POST,DELETE',
        preflightContinue: false,
        optionsSuccessStatus: 204,
        exposedHeaders: ['mcp-session-id', 'last-event-id', 'mcp-protocol-version']
    })
);

const badSession = (req, res) =>
    res.status(400).json({
        jsonrpc: '2.0',
        error: { code: -32000, message: 'Bad Request: No valid session ID provided' },
        id: req?.body?.id
    });
const internalError = (res, message) => {
    if (!res.headersSent) {
        res.status(500).json({ jsonrpc: '2.0', error: { code: -32603, message }, id: null });
    }
};

if (stateless) {
    app.post('/mcp', async (req, res) => {
        log(`POST (stateless${enableJsonResponse ? ', json' : ''})`);
        const { server, cleanup } = createServer();
        const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined, enableJsonResponse });
        res.on('close', () => {
            transport.close();
            server.close();
            cleanup(undefined);
        });
        try {
            await server.connect(transport);
            await transport.handleRequest(req, res);
        } catch (error) {
            log('Error handling MCP request:', error);
            internalError(res, 'Internal server error');
        }
    });
    const notAllowed = (req, res) => {
        log(`${req.method} -> 405 (stateless)`);
        res.writeHead(405, { Allow: 'POST' }).end(
            JSON.stringify({ jsonrpc: '2.0', error: { code: -32000, message: 'Method not allowed.' }, id: null })
        );
    };
    app.get('/mcp', notAllowed);
    app.delete('/mcp', notAllowed);
} else {
    const transports = new Map();
    app.post('/mcp', async (req, res) => {
        const sessionId = req.headers['mcp-session-id'];
        log(`POST ${sessionId ?? '(no session)'}`);
        try {
            if (sessionId && transports.has(sessionId)) {
                await transports.get(sessionId).handleRequest(req, res);
                return;
            }
            if (sessionId) {
                badSession(req, res);
                return;
            }
            const { server, cleanup } = createServer();
            const transport = new StreamableHTTPServerTransport({
                sessionIdGenerator: () => randomUUID(),
                enableJsonResponse,
                eventStore: new InMemoryEventStore(),
                onsessioninitialized: sid => {
                    log(`Session initialized with ID: ${sid}`);
                    transports.set(sid, transport);
                }
            });
            server.server.onclose = async () => {
                const sid = transport.sessionId;
                if (sid && transports.has(sid)) {
                    transports.delete(sid);
                    cleanup(sid);
                }
            };
            await server.connect(transport);
            await transport.handleRequest(req, res);
        } catch (error) {
            log('Error handling MCP request:', error);
            internalError(res, 'Internal server error');
        }
    });
    const withSession = async (req, res) => {
        const sessionId = req.headers['mcp-session-id'];
        log(`${req.method} ${sessionId ?? '(no session)'} last-event-id=${req.headers['last-event-id'] ?? '-'}`);
        if (!sessionId || !transports.has(sessionId)) {
            badSession(req, res);
            return;
        }
        try {
            await transports.get(sessionId).handleRequest(req, res);
        } catch (error) {
            log(`Error handling ${req.method}:`, error);
            internalError(res, 'Internal server error');
        }
    };
    app.get('/mcp', withSession);
    app.delete('/mcp', withSession);
}

const httpServer = app.listen(0, '127.0.0.1', () => {
    process.stdout.write(`LISTENING ${httpServer.address().port}\n`);
});
process.on('SIGTERM', () => process.exit(0));
process.on('SIGINT', () => process.exit(0));
