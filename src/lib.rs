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
//! | [`metrics`] | Prometheus metrics, their label values as enums, their exposition | HTTP, sessions |
//! | [`session`] | sessions, streams, attached clients: tagging, flow control, retention, re-attach, retransmissions, gaps, stalls, TTL (inside: `stream` one stream's bookkeeping, `reserve` the in-flight reserve, `batch` the frame one poll writes, `dedup` POST de-duplication, `control` the gateway's own events, `whole` an answer that came whole served under one lock, `registry` all sessions and the memory budget, readers' charges included) | HTTP, sockets |
//! | [`upstream`] | upstream client, request building (`head`: a forwarded request's head as it is written, `X-Forwarded-*` included), every upstream request written and its answer read on the socket by the task that wants it, over a small pool of idle keep-alive connections (`conn`: the HTTP client's policy on `http1::client`; `io`: a connection's transport, a plain one at its socket's size, TLS boxed), the bound on its connections (`limit`: a connector counting sockets, and each client share's fair part of them), the flow-controlled stream reader and its upstream resume, the answer reader of an upgraded POST, or its JSON answer served at once when it came whole, as a POST's SSE answer that came whole is (`reader`), the one holder task per session of its standalone stream (`hold`) | client requests, retention rules |
//! | [`attach`] | the SSE body of one attached client (pulls from its session, keep-alives) | requests, upstream |
//! | [`access`] | one log line and one duration sample per finished request or stream | payloads |
//! | [`logwriter`] | the log's writer: lines gathered in one bounded buffer, written to stdout in batches by a thread of its own | what a line says |
//! | [`error`] | `ProxyError` and the one error table: status, JSON-RPC code, reason, metric, log level, fault; the refusal response | sessions' internals |
//! | [`proxy`] | the HTTP handler as classify-then-dispatch: the request read once (`inbound`), a pure `classify` into routes, one handler per route (`resume`: resume and retransmission; `live`: live attach; `forward`: forward-and-tag, pass-through, the end of a minted session; `upgrade`: a JSON answer served as the gateway's SSE stream), `auth` decided once per request, `bodies` the bound of all request bodies held at once, `orphans` a POST whose client left: what its route learned of it, the bounds of those left to finish, the future that finishes on its own | retention rules |
//! | [`server`] | the proxy listener's accept loop (plain or TLS); per-connection and per-HTTP/2-stream stall kill; the first-request and idle timeouts of a connection; hands over to the drain; which HTTP a connection speaks (sniffed), HTTP/1.1 to [`http1`]'s server connection, HTTP/2 to hyper | sessions, routes |
//! | [`admin`] | the admin listener: `/healthz`, `/readyz`, `/metrics` | the proxy listener, sessions, the drain's phases |
//! | [`shutdown`] | a leaf the servers consume: the drain phases (not ready, drain delay, stop accepting, deadline, end streams) and all shutdown state: the [`shutdown::Shutdown`] trigger, [`Health`], the hurry signal and the admin listener's stop ([`shutdown::Draining`]) | the gateway, listeners, signals |
//! | [`telemetry`] | OpenTelemetry traces: the OTLP/HTTP exporter (on with the standard `OTEL_EXPORTER_OTLP_*` variables), the W3C trace context continued from clients, injected upstream, and kept by streams for their resumes | sessions' internals, routes |
//! | [`tls`] | rustls on both sides: listener certificate (reloaded when the files change, or at once on request), client certificates and their subject, plaintext-on-TLS answer, upstream roots | HTTP requests, sessions |
//! | [`demo`] | the embedded legacy MCP demo upstream used by `mcp-reattach demo` | the gateway |
//!
//! `main.rs` only sets the allocator (mimalloc), parses flags, installs logging, maps SIGTERM / SIGINT to a graceful / quick
//! [`shutdown::Shutdown`] and SIGHUP to [`tls::ServerTls::reload_now`], binds, and calls
//! [`serve_gateway`] and [`serve_admin`]. See `docs/design.md` for the decisions behind this shape.

// The public surface: what `main.rs`, the integration tests, the fuzz targets and the bench
// use (config, the pure core, the demo, TLS setup, shutdown, the access sink, and the session
// and attach types of the paused-time tests). The request path's layers are the crate's own.
pub mod access;
pub(crate) mod admin;
pub mod attach;
pub mod config;
pub mod cursor;
pub mod demo;
pub(crate) mod error;
pub(crate) mod exchange;
pub mod http1;
pub(crate) mod jsonrpc;
pub mod logwriter;
pub(crate) mod metrics;
pub(crate) mod proxy;
pub(crate) mod server;
pub mod session;
pub mod shutdown;
pub mod sse;
pub mod telemetry;
pub mod tls;
pub(crate) mod upstream;
pub mod window;

pub use admin::serve_admin;
pub use config::{Config, Priming};
pub use proxy::Gateway;
pub use server::serve_gateway;
pub use shutdown::Health;
