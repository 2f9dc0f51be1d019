//! mcp-reattach: a reverse proxy that makes an unmodified MCP server's Streamable HTTP SSE
//! streams resumable.
//!
//! Module map (pure core first, then the async layers built on it, then the edges):
//!
//! | module | owns | must not know |
//! |---|---|---|
//! | [`exchange`] | a leaf of the types one exchange is made of: a client's request body (`ClientBody`, the own HTTP/1.1's `ReqBody` and its feed), the per-connection `Conn`, the response and upstream body types, `BoxError`, the MCP header names | every other module of the crate |
//! | [`config`] | flags, env vars, their defaults ([`config::defaults`]), parsing of sizes and durations, [`Config`] | sockets, HTTP |
//! | [`sse`] | incremental SSE decoder and encoder | I/O, tokio, HTTP |
//! | [`http1`] | the gateway's own HTTP/1.1 as one layer, both sides: `limits`; `error` the one error (a kind and a peer, each mapped to a status and a metric); `head` heads, pure (an upstream's response heads, a client's request heads, the response heads written, a request head's lines); `body` the body decoder and the chunk encoder, pure; `read` the one read policy of both sides; `client` the upstream side's connection (a request written, its answer's head and body read on it, whether it may carry another); `server` the client side's connection (requests, bodies, pipelining, the drain's stop; HTTP/2 stays hyper's) | sessions, routes, `X-Forwarded-*` (the upstream request builder's) |
//! | [`cursor`] | event ids `<epoch>.<stream>.<seq>` | what a cursor means |
//! | [`window`] | the bounded ring of encoded events | clocks, locks, streams' meaning |
//! | [`jsonrpc`] | request/response ids, era detection, gateway error bodies | HTTP |
//! | [`metrics`] | Prometheus metrics, their label values as enums (a request's method and status class read from `http`'s types), their exposition | sockets, requests, sessions |
//! | [`session`] | sessions, streams, attached clients: tagging, flow control, retention, re-attach, retransmissions, gaps, stalls, TTL. `Session` is a thin shell (identity, its `Arc`s, one `Mutex<State>`, wakers); `state` holds `State` with its invariants, and the rules are `impl State` by concern: `open`, `tag`, `resume`, `deliver`, `life`, `whole` (an answer that came whole, under one lock). Pure parts beside: `decide` the one resume decision (what a cursor gets from what is known of its stream, held here or read from the store: both `resume` and `store::follow` act on it), `stream` one stream's bookkeeping, `reserve` the in-flight reserve, `batch` the frame one poll writes, `dedup` POST de-duplication (and `verdict`, the one rule of a request id in flight, the fleet's store's too), `control` the gateway's own events, `hold` the held standalone stream's phases; `view` what operators see of a session (no id, no payload); `registry` all sessions and the memory budget, readers' charges included | HTTP, sockets |
//! | [`upstream`] | the HTTP client to the upstream: request building (`head`: a forwarded request's head as it is written, `X-Forwarded-*` included), every upstream request written and its answer read on the socket by the task that wants it, over a small pool of idle keep-alive connections (`conn`: the HTTP client's policy on `http1::client`; `io`: how a connection is opened, TCP to each of the host's addresses within `--upstream-connect-timeout` and tokio-rustls for `https://`, and its transport, a plain one at its socket's size, TLS boxed; no hyper-util connector, no tower `Service`), the bound on its connections (`limit`: every connection opened only with a place, and each client share's fair part of them), the recipe to reopen a stream (`Source`) | client requests, sessions' streams, retention rules |
//! | [`feed`] | the one owner of what fills a session's streams, with one entry point each: a tagged SSE answer (read by a reader task, or served at once when a POST's answer came whole), an upgraded POST's JSON answer that came whole, an upgraded answer still to come, the holder of the standalone stream; every task spawned in `feed/mod.rs` (the holder's in `hold`), which ends the stream with what the task returns (inside: `read` the flow-controlled reader and its upstream resume, `whole` an answer that came whole as events, `answer` what an upgraded POST's answer becomes, `hold` the holder's loop) | client requests, retention rules |
//! | [`store`] | the fleet's shared store (`--store`, the Redis protocol) behind one seam, `Store::{Off, Redis}`, its tasks owned by `store::Tasks` (the gateway holds it): `wire` the keys derived from the fleet's secret, the session's record, a stream's meta and packed events (pure); `writer` the one task writing what is queued, pipelined, bounded in bytes and writes, fencing what a dead lease generation would publish; `lease` this replica's lease (its generation, renewed by compare-and-`PEXPIRE`, dead past its lease by the replica's own clock) and the store's birth mark (a store restarted empty is written again at once); `follow` a resume served from the store (another replica reads the stream), decided by `session`'s one resume decision from the stream's meta and entries; `progress` flow control across replicas (the owner polls its followers' progress); `gone` a session ended anywhere ends everywhere (pub/sub), and the listener of the fleet's channels; `ask` an operator's questions to every replica (the sessions each holds, a page at a time, an end; on a connection of its own, one in flight, MACed under the fleet's admin key). A session's record written when it is created and adopted by another replica for its principal only; a POST's request ids claimed in the session (whoever sent them) before it is forwarded, judged by `session::verdict` as the session's own state judges them, and a retransmission whose claim cannot be made refused with 503; each stream's content published by its owner through the session's publisher hook | HTTP routes, the session's rules |
//! | [`attach`] | the SSE body of one attached client (pulls from its session, keep-alives) | requests, upstream |
//! | [`access`] | one log line and one duration sample per finished request or stream | payloads |
//! | [`logwriter`] | the log's writer: lines gathered in one bounded buffer, written to stdout in batches by a thread of its own | what a line says |
//! | [`error`] | `ProxyError` and the one error table: status, JSON-RPC code, reason, metric, log level, fault; the refusal response | sessions' internals |
//! | [`proxy`] | the HTTP handler as classify-then-dispatch: the request read once (`inbound`), a pure `classify` into routes, one handler per route (`resume`: resume and retransmission; `live`: live attach; `forward`: forward-and-tag, pass-through, the end of a minted session; `upgrade`: a JSON answer served as the gateway's SSE stream), `fleet` the fleet layer (how a request finds its session: the registry first, then the store's adoption, a stranger's claim in a session it is not given, a minted id that certifies itself; a POST's ids claimed in the fleet after they are here; what follows every end of a session, upstream and in the fleet; the drain's hand-over), `auth` decided once per request, `bodies` the bound of all request bodies held at once, `orphans` a POST whose client left: what its route learned of it, the bounds of those left to finish, the future that finishes on its own, `operator` the sessions listed and ended for the admin listener | retention rules |
//! | [`server`] | the proxy listener's accept loop (plain or TLS); per-connection and per-HTTP/2-stream stall kill; the first-request and idle timeouts of a connection; hands over to the drain; which HTTP a connection speaks (sniffed), HTTP/1.1 to [`http1`]'s server connection, HTTP/2 to hyper | sessions, routes |
//! | [`admin`] | the admin listener: `/healthz`, `/readyz`, `/metrics`, and operators' sessions: `sessions` (`/sessions` JSON, `DELETE /sessions/{id}`), `ui` (the same read-only as HTML at `/ui`), `access` (who may read and end), `client` (`mcp-reattach sessions list\|show\|end`) | the proxy listener, sessions' internals (it reads `session::SessionView`s the gateway makes), the drain's phases |
//! | [`shutdown`] | a leaf the servers consume: the drain phases (not ready, drain delay, stop accepting, deadline, end streams) and all shutdown state: the [`shutdown::Shutdown`] trigger, [`Health`], the hurry signal and the admin listener's stop ([`shutdown::Draining`]) | the gateway, listeners, signals |
//! | [`telemetry`] | OpenTelemetry traces: the OTLP/HTTP exporter (on with the standard `OTEL_EXPORTER_OTLP_*` variables), the W3C trace context continued from clients, injected upstream, and kept by streams for their resumes | sessions' internals, routes |
//! | [`tls`] | rustls on both sides: listener certificate (reloaded when the files change, or at once on request), client certificates and their subject, plaintext-on-TLS answer, upstream roots | HTTP requests, sessions |
//! | [`demo`] | the embedded legacy MCP demo upstream used by `mcp-reattach demo` | the gateway |
//!
//! `main.rs` only sets the allocator (mimalloc), parses flags, installs logging, maps SIGTERM / SIGINT to a graceful / quick
//! [`shutdown::Shutdown`] and SIGHUP to [`tls::ServerTls::reload_now`], binds, and calls
//! [`serve_gateway`] and [`serve_admin`]. See `docs/design.md` for the decisions behind this shape.

#![warn(unreachable_pub)]

// The public surface is a small façade: the flags ([`config`]) and the handles `main.rs` wires
// together (below: the servers, the demo upstream, TLS setup, the sessions command). What the fuzz
// targets and the paused-time tests reach inside is behind [`internals`], not an API.
// Everything else is the crate's own.
mod access;
mod admin;
mod attach;
pub mod config;
mod cursor;
mod demo;
mod error;
mod exchange;
mod feed;
mod http1;
mod jsonrpc;
mod logwriter;
mod metrics;
mod proxy;
mod server;
mod session;
mod shutdown;
mod sse;
mod store;
mod telemetry;
mod tls;
mod upstream;
mod window;

pub use access::set_sink as set_access_sink;
pub use admin::client::run as run_sessions_command;
pub use admin::serve_admin;
pub use config::{Config, Priming};
pub use demo::serve_upstream as serve_demo_upstream;
pub use logwriter::spawn as spawn_log_writer;
pub use proxy::Gateway;
pub use server::serve_gateway;
pub use shutdown::{Health, Mode as ShutdownMode, Shutdown};
pub use telemetry::{layer as otlp_layer, wanted_by_env as otlp_wanted_by_env};
pub use tls::{upstream_client_config, Reload, ServerTls, TlsError};

/// The crate's insides that its fuzz targets, property checks and paused-time tests drive
/// directly (the pure core, a session and an attached client's body). Not an API: it
/// changes with the code.
#[doc(hidden)]
pub mod internals {
    pub use crate::attach::AttachBody;
    pub use crate::cursor::{Cursor, CursorError, MAX_CURSOR_LEN};
    pub use crate::http1::{
        parse_head, parse_request, take_head, BodyDecoder, Error as Http1Error, Framing, Head,
    };
    pub use crate::session::{hash_id, OpenStream, Owner, Principal, Registry, StreamKind};
    pub use crate::sse::{encode, is_valid_id, write_id, Decoder, Event, SseError, KEEPALIVE};
    pub use crate::window::{Entry, Window};
}
