// Many TypeScript-SDK MCP clients at once (one Client + StreamableHTTPClientTransport each,
// default reconnection options), driven by commands on stdin, for the scale-out test
// (tests/fleet/scale_out.rs: HAProxy in front of several mcp-reattach replicas).
//
// Usage: node ts-scale-client.mjs <url>
//
// A *client* is a logical user `<group>/<i>`: it holds one MCP session at a time. When a
// request of its session is answered 404 (the spec's "session not found": the session's pod is
// gone), the client does what the spec asks: it gives up that session (its pending call is
// ended at once, not left to time out), initializes a new one, and, for a call, runs the call
// again there, at most `reinit` times.
//
// stdin, one JSON command per line (commands run concurrently; each reports its end):
//   {"cmd":"open","group":"g","n":N,"reinit":R}
//        N clients connect; each then calls `whoami` to learn its replica
//        -> {"ev":"open","key","session","replica","ok","lost404","error"} per attempt,
//           then {"ev":"opened","group"}
//   {"cmd":"call","group":"g","steps":S,"interval_ms":I,"timeout_ms":T,"reinit":R,"round":k}
//        every client of the group that has a session calls `work` {key, steps, interval_ms}
//        -> {"ev":"midcall","group","round"} once every client has >= 2 progress events of
//           this call, {"ev":"call_end",…} per attempt, then {"ev":"calls_done","group","round"}
//   {"cmd":"close","group":"g"}   DELETE every session of the group -> {"ev":"closed","group"}
//   {"cmd":"exit"}                -> {"ev":"bye"}, exit 0
// stderr: diagnostics (every HTTP request that is not answered 2xx, transport errors).

import readline from 'node:readline';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { EventSourceParserStream } from 'eventsource-parser/stream';

const [url] = process.argv.slice(2);
if (!url) {
    console.error('usage: node ts-scale-client.mjs <url>');
    process.exit(2);
}

const started = Date.now();
const now = () => Date.now() - started;
const log = (...args) => console.error(`+${String(now()).padStart(6)}ms`, ...args);
const emit = obj => process.stdout.write(JSON.stringify({ ...obj, at_ms: now() }) + '\n');

/** `<epoch>.<stream>` of a gateway event id `<epoch>.<stream>.<seq>` (docs/protocol.md). */
const streamOf = id => (id ?? '').split('.').slice(0, 2).join('.');

/** Logical clients by key; groups by name (arrays of keys). */
const clients = new Map();
const groups = new Map();

/**
 * One MCP session of a client: the SDK client and transport, and what its requests saw.
 * `lost` is set (and `onLost` fired) on the first 404 answered to a request of the session.
 */
class Conn {
    constructor(client) {
        this.owner = client;
        this.session = null;
        this.replica = null;
        this.lost = null;
        this.onLost = [];
        this.onCallLost = [];
        /** Kind ('call' | 'standalone') of each tagged stream, by `<epoch>.<stream>`. */
        this.streamKind = new Map();
        this.callResumes = 0;
        this.standaloneResumes = 0;
        this.notFound = 0;
        this.transport = new StreamableHTTPClientTransport(new URL(url), { fetch: (i, init) => this.fetch(i, init) });
        this.sdk = new Client({ name: `scale-${client.key}`, version: '0.0.0' });
        this.sdk.onerror = err => log(`${client.key} onerror: ${err?.message ?? err}`);
    }

    async fetch(input, init) {
        const method = init?.method ?? 'GET';
        const headers = new Headers(init?.headers);
        const lei = headers.get('last-event-id');
        const sid = headers.get('mcp-session-id');
        let res;
        try {
            res = await fetch(input, init);
        } catch (err) {
            log(`${this.owner.key} ${method} lei=${lei ?? '-'} -> failed: ${err?.cause?.code ?? err?.message ?? err}`);
            throw err;
        }
        if (res.status === 404 && sid) {
            this.notFound++;
            const kind = method === 'POST' ? 'call' : lei ? this.streamKind.get(streamOf(lei)) ?? 'unknown' : 'standalone';
            const reason = `${method}${lei ? ` (resume of a ${kind} stream)` : ''} answered 404`;
            log(`${this.owner.key} ${method} lei=${lei ?? '-'} -> 404 (session ${sid} not found)`);
            if (!this.lost) {
                this.lost = reason;
                for (const f of this.onLost.splice(0)) f(reason);
            }
            // The pending call ends now when the 404 answers the call itself or its resume
            // (the standalone stream's 404 leaves a call that is still streaming alone: a
            // draining pod finishes it on its open connection).
            if (kind === 'call') {
                for (const f of this.onCallLost.splice(0)) f(reason);
            }
        } else if (!res.ok) {
            log(`${this.owner.key} ${method} lei=${lei ?? '-'} -> ${res.status}`);
        }
        const ct = res.headers.get('content-type') ?? '';
        if (res.ok && ct.startsWith('text/event-stream') && res.body) {
            const kind = method === 'POST' ? 'call' : lei ? this.streamKind.get(streamOf(lei)) ?? 'unknown' : 'standalone';
            if (lei) {
                if (kind === 'call') this.callResumes++;
                else this.standaloneResumes++;
            }
            const [forSdk, forTap] = res.body.tee();
            this.tap(kind, forTap);
            return new Response(forSdk, { status: res.status, statusText: res.statusText, headers: res.headers });
        }
        return res;
    }

    /** Reads a copy of an SSE response to learn which gateway stream it is. */
    async tap(kind, stream) {
        try {
            const reader = stream.pipeThrough(new TextDecoderStream()).pipeThrough(new EventSourceParserStream()).getReader();
            while (true) {
                const { value: ev, done } = await reader.read();
                if (done) break;
                if (ev.id && !this.streamKind.has(streamOf(ev.id))) this.streamKind.set(streamOf(ev.id), kind);
            }
        } catch {
            // The SDK's copy sees the same error and handles it.
        }
    }

    /** Resolves with the reason when the session is lost (any 404). */
    lostPromise() {
        return new Promise(resolve => (this.lost ? resolve(this.lost) : this.onLost.push(resolve)));
    }

    /** Resolves with the reason when a call request or a call stream's resume gets a 404. */
    callLostPromise() {
        return new Promise(resolve => this.onCallLost.push(resolve));
    }

    async close(terminate) {
        if (terminate && !this.lost) {
            try {
                await Promise.race([
                    this.transport.terminateSession(),
                    new Promise((_, reject) => setTimeout(() => reject(new Error('DELETE timed out after 3 s')), 3000))
                ]);
            } catch (err) {
                log(`${this.owner.key} terminateSession: ${err?.message ?? err}`);
            }
        }
        await Promise.race([this.sdk.close().catch(() => {}), new Promise(r => setTimeout(r, 1000))]);
    }
}

/** Connects a new session for `c`; Ok(conn) or the reason it failed. */
async function openConn(c, timeoutMs) {
    const conn = new Conn(c);
    const lost = conn.lostPromise().then(reason => {
        throw new Error(`session lost: ${reason}`);
    });
    lost.catch(() => {});
    try {
        await Promise.race([conn.sdk.connect(conn.transport, { timeout: timeoutMs }), lost]);
        conn.session = conn.transport.sessionId ?? null;
        const who = await Promise.race([conn.sdk.callTool({ name: 'whoami', arguments: {} }, undefined, { timeout: timeoutMs }), lost]);
        conn.replica = JSON.parse(who.content?.[0]?.text ?? '{}').replica ?? null;
        return { conn };
    } catch (err) {
        conn.session ??= conn.transport.sessionId ?? null;
        const error = err?.message ?? String(err);
        await conn.close(false);
        return { conn, error };
    }
}

/** Opens a session for `c`, re-initializing after a 404 at most `reinit` times. */
async function openClient(c, reinit, timeoutMs) {
    for (let attempt = 0; attempt <= reinit; attempt++) {
        if (attempt > 0) c.reinits++;
        const { conn, error } = await openConn(c, timeoutMs);
        emit({
            ev: 'open', key: c.key, attempt, session: conn.session, replica: conn.replica, ok: !error,
            lost404: conn.lost !== null, not_found: conn.notFound, error: error ?? null
        });
        if (!error) {
            c.conn = conn;
            return true;
        }
        if (!conn.lost) return false;
    }
    return false;
}

async function cmdOpen({ group, n, reinit = 0, timeout_ms = 15000 }) {
    const keys = groups.get(group) ?? [];
    const fresh = [];
    for (let i = keys.length; i < keys.length + n; i++) {
        const c = { key: `${group}/${i}`, conn: null, reinits: 0 };
        clients.set(c.key, c);
        fresh.push(c);
    }
    groups.set(group, keys.concat(fresh.map(c => c.key)));
    await Promise.all(fresh.map(c => openClient(c, reinit, timeout_ms)));
    emit({ ev: 'opened', group });
}

async function cmdCall({ group, round = 0, steps, interval_ms, timeout_ms = 30000, reinit = 0 }) {
    const members = (groups.get(group) ?? []).map(k => clients.get(k)).filter(c => c.conn);
    const progressOf = new Map(members.map(c => [c.key, 0]));
    let midcallSent = false;
    const checkMidcall = () => {
        if (!midcallSent && [...progressOf.values()].every(p => p >= 2)) {
            midcallSent = true;
            emit({ ev: 'midcall', group, round });
        }
    };
    const one = async c => {
        for (let attempt = 0; attempt <= reinit; attempt++) {
            if (!c.conn) {
                c.reinits++;
                if (!(await openClient(c, 0, 15000))) {
                    progressOf.delete(c.key);
                    checkMidcall();
                    emit({ ev: 'call_end', key: c.key, round, attempt, outcome: 'error', error: 'could not open a new session' });
                    return;
                }
            }
            const conn = c.conn;
            const key = `${c.key}#${round}.${attempt}`;
            const progress = [];
            const resumesBefore = conn.callResumes;
            const ac = new AbortController();
            conn.callLostPromise().then(reason => ac.abort(new Error(`session lost: ${reason}`)));
            const out = () => ({ ev: 'call_end', key: c.key, round, attempt, session: conn.session, replica: conn.replica, not_found: conn.notFound });
            try {
                const r = await conn.sdk.callTool({ name: 'work', arguments: { key, steps, interval_ms } }, undefined, {
                    timeout: timeout_ms,
                    signal: ac.signal,
                    onprogress: p => {
                        progress.push(p.progress);
                        if (attempt === 0) {
                            progressOf.set(c.key, progress.length);
                            checkMidcall();
                        }
                    }
                });
                const res = JSON.parse(r.content?.[0]?.text ?? '{}');
                emit({ ...out(), outcome: 'result', progress, resumes: conn.callResumes - resumesBefore, ran_on: res.replica, executions: res.executions ?? null });
                return;
            } catch (err) {
                const lost = conn.lost !== null && conn.notFound > 0;
                emit({ ...out(), outcome: lost ? 'lost_404' : 'error', error: err?.message ?? String(err), progress, resumes: conn.callResumes - resumesBefore });
                if (!lost) return;
                // The spec's answer to a 404: start a new session (and run the call there).
                c.conn = null;
                await conn.close(false);
                if (attempt === 0) {
                    progressOf.delete(c.key);
                    checkMidcall();
                }
            }
        }
    };
    await Promise.all(members.map(one));
    emit({ ev: 'calls_done', group, round });
}

async function cmdClose({ group }) {
    const members = (groups.get(group) ?? []).map(k => clients.get(k));
    await Promise.all(
        members.map(async c => {
            if (c.conn) await c.conn.close(true);
            emit({
                ev: 'client', key: c.key, reinits: c.reinits, session: c.conn?.session ?? null, replica: c.conn?.replica ?? null,
                standalone_resumes: c.conn?.standaloneResumes ?? 0
            });
            c.conn = null;
        })
    );
    emit({ ev: 'closed', group });
}

const commands = { open: cmdOpen, call: cmdCall, close: cmdClose };
const rl = readline.createInterface({ input: process.stdin });
rl.on('line', line => {
    if (!line.trim()) return;
    let cmd;
    try {
        cmd = JSON.parse(line);
    } catch (err) {
        emit({ ev: 'bad_command', line, error: String(err) });
        return;
    }
    if (cmd.cmd === 'exit') {
        emit({ ev: 'bye' });
        process.exit(0);
    }
    const run = commands[cmd.cmd];
    if (!run) {
        emit({ ev: 'bad_command', line, error: 'unknown command' });
        return;
    }
    run(cmd).catch(err => emit({ ev: 'command_failed', cmd: cmd.cmd, error: err?.stack ?? String(err) }));
});
rl.on('close', () => process.exit(0));
emit({ ev: 'ready' });
