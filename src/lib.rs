//! mcp-reattach: a reverse proxy that makes an unmodified MCP server's Streamable HTTP SSE
//! streams resumable.
//!
//! Module map (pure core first, then the async layers built on it, then the edges):
//!
//! | module | owns | must not know |
//! |---|---|---|
//! | [`config`] | flags, env vars, parsing of sizes and durations, [`Config`] | sockets, HTTP |
//! | [`sse`] | incremental SSE decoder and encoder | I/O, tokio, HTTP |
//! | [`cursor`] | event ids `<epoch>.<stream>.<seq>` | what a cursor means |
//! | [`window`] | the bounded ring of encoded events | clocks, locks, streams' meaning |
//! | [`jsonrpc`] | request/response ids, era detection, gateway error bodies | HTTP |
//! | [`metrics`] | Prometheus metrics and their exposition | HTTP, sessions |
//! | [`session`] | sessions, streams, attached clients: tagging, flow control, retention, re-attach, retransmissions, gaps, stalls, TTL (inside: `stream` one stream's bookkeeping, `reserve` the in-flight reserve, `batch` the frame one poll writes, `dedup` POST de-duplication, `control` the gateway's own events, `registry` all sessions) | HTTP, sockets |
//! | [`upstream`] | upstream client, request building, the flow-controlled stream reader and its upstream resume | clients, retention rules |
//! | [`attach`] | the SSE body of one attached client (pulls from its session, keep-alives) | requests, upstream |
//! | [`access`] | one log line and one duration sample per finished request or stream | payloads |
//! | [`error`] | `ProxyError` and the one error table: status, JSON-RPC code, reason, metric, log level, fault; the refusal response | sessions' internals |
//! | [`proxy`] | the HTTP handler: resume, retransmission, live attach, forward, modern pass-through | retention rules |
//! | [`server`] | accept loops for the proxy (plain or TLS) and admin listeners; per-connection and per-HTTP/2-stream stall kill | protocol details |
//! | [`shutdown`] | the drain phases: not ready, drain delay, stop accepting, deadline, end streams; the [`shutdown::Shutdown`] trigger | signals, sockets |
//! | [`tls`] | rustls on both sides: listener certificate (reloaded when the files change), client certificates and their subject, plaintext-on-TLS answer, upstream roots | HTTP requests, sessions |
//! | [`demo`] | the embedded legacy MCP demo upstream used by `mcp-reattach demo` | the gateway |
//!
//! `main.rs` only parses flags, installs logging, maps SIGTERM / SIGINT to a graceful / quick
//! [`shutdown::Shutdown`], binds, and calls [`serve_gateway`] and [`serve_admin`]. See `docs/design.md` for the decisions behind this shape.

pub mod access;
pub mod attach;
pub mod config;
pub mod cursor;
pub mod demo;
pub mod error;
pub mod jsonrpc;
pub mod metrics;
pub mod proxy;
pub mod server;
pub mod session;
pub mod shutdown;
pub mod sse;
pub mod tls;
pub mod upstream;
pub mod window;

pub use config::{Config, Priming};
pub use proxy::Gateway;
pub use server::{serve, serve_admin, serve_gateway, Health};
