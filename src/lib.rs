//! mcp-reattach: a reverse proxy that makes an unmodified MCP server's Streamable HTTP SSE
//! streams resumable.
//!
//! Module map (pure core first, then the async layers built on it, then the edges):
//!
//! | module | owns | must not know |
//! |---|---|---|
//! | [`config`] | flags, env vars, parsing of sizes and durations, [`Config`] | sockets, HTTP |
//! | [`server`] | accept loops for the proxy and admin listeners, shutdown | protocol details |
//! | [`demo`] | the embedded legacy MCP demo upstream used by `mcp-reattach demo` | the gateway |

pub mod access;
pub mod attach;
pub mod config;
pub mod cursor;
pub mod demo;
pub mod jsonrpc;
pub mod metrics;
pub mod proxy;
pub mod server;
pub mod session;
pub mod sse;
pub mod window;

pub use config::{Config, Priming};
pub use proxy::Gateway;
pub use server::{serve, serve_admin, serve_gateway, Health};
