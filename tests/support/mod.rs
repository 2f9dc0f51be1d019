//! The one test harness of the integration tests (`mod support;` in each tier's `main.rs`,
//! then `use crate::support::*;` or named imports in its files). Every wait here is bounded.
//!
//! In-process (the gateway in the test's runtime):
//! - [`mock`]: the scriptable mock upstream [`Mock`]: each request reaches the test, which
//!   answers it with a full body (a JSON-RPC one: [`Seen::respond_json`], [`json_response`]) or
//!   with raw SSE bytes it writes when it likes; dropping the mock stops it and closes its
//!   connections.
//! - [`gateway`]: [`Gw`], the gateway under test on a loopback port (in front of the mock or of
//!   a real SDK server), a raw HTTP/1.1 client ([`send`]) whose connections can be dropped at
//!   will, the JSON-RPC messages tests send ([`post`], [`get`], [`call`], ...), and the steps
//!   tests share ([`init_session`], [`start_call`]).
//! - [`sse`]: one SSE parser written from the spec, independent of the crate's decoder, behind
//!   [`SseReader`] (hyper body) and [`SseBody`] (reqwest response).
//!
//! Between the parts:
//! - [`relay`]: [`Relay`], the one TCP relay with fault injection: cut every live connection
//!   (RST), refuse new ones for a while, a [`Fault`] per direction armed at any time for live
//!   and future connections (RST, half-close or stall after N more bytes, or one byte per
//!   segment), a slow client link (rate limit), or a tap that records what clients send; it
//!   counts connections, bytes per direction and stalled directions. It runs on its own small
//!   runtime, so its methods are synchronous and it keeps working whatever the test's runtime
//!   is doing.
//!
//! Real processes:
//! - [`process`]: [`ChildProc`], a spawned process whose stdout is read line by line with
//!   timeouts (stderr forwarded and kept; SIGTERM or any signal at will; killed on drop); [`free_port`];
//!   [`http_client`], the reqwest client for real processes.
//! - [`binary`]: [`Binary`], the one launcher of the real `mcp-reattach` binary: spawned with
//!   the test's flags on free loopback ports, ready once its admin listener answers (or
//!   [`NotStarted`], with its exit code and stderr), killed on drop; [`metric_sum`] reads its
//!   `/metrics`.
//! - [`haproxy`]: [`Haproxy`], real HAProxy with the shipped config (or [`control_config`]:
//!   it without its stick lines) in front of a test's three gateways; [`redis`]: [`Redis`], a
//!   `redis-server` of a test's own for the fleet's store, and [`key_file`].
//! - [`clients`]: the real MCP clients' drivers ([`Driver`]: the TypeScript and Python SDK
//!   clients, or an in-process one), a run of one ([`run_client`] → [`Run`], faults injected by
//!   a hook through [`Faults`]), several at once each through its own gateway ([`run_pairs`]),
//!   and the checks on a run ([`complete`], [`explained_by_py_bugs`]).
//! - [`upstream`]: [`Upstream`], the real SDK servers (TypeScript SDK 1.x and 2.x, Python SDK,
//!   FastMCP 4.x, `server-everything`), in every shape they offer (stateful or stateless, SSE or
//!   JSON answers).
//! - [`toolchains`]: installs what those need on first use (npm packages, TypeScript SDK v2's
//!   npm folder, Node.js 22, the Python SDK's and FastMCP 4.x's virtualenvs;
//!   [`install_interop_deps`] / [`install_shape_deps`] from an async test), guarded across test
//!   processes by lock directories.
// Each test crate uses a different part of the harness.
#![allow(dead_code, unused_imports)]
// The relay keeps its own clock on its own runtime, and the process helpers measure real
// processes: std's clock is right here (src/ stays on tokio's, see clippy.toml).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

pub mod binary;
pub mod clients;
pub mod gateway;
pub mod haproxy;
pub mod mock;
pub mod process;
pub mod redis;
pub mod relay;
pub mod sse;
pub mod toolchains;
pub mod upstream;

pub use binary::*;
pub use clients::*;
pub use gateway::*;
pub use haproxy::{control_config, haproxy_or_skip, Haproxy, CONFIG, PODS};
pub use mock::*;
pub use process::*;
pub use redis::{key_file, Redis};
pub use relay::*;
pub use sse::*;
pub use toolchains::*;
pub use upstream::*;

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use mcp_reattach::{Config, Gateway};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, oneshot};

/// How long any single wait of an in-process test may take before it fails.
pub const WAIT: Duration = Duration::from_secs(10);
