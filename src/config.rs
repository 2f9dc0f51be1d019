//! Command-line flags and the validated runtime configuration.
//!
//! Owns parsing (clap, every flag also read from `MCP_REATTACH_<FLAG>`) and the plain
//! [`Config`] value the rest of the crate reads. Knows nothing of sockets or HTTP.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

/// When the gateway opens a tagged stream with a priming event (an id and empty data).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Priming {
    /// Only for sessions whose protocol version is 2025-11-25 or later.
    Auto,
    /// On every tagged stream.
    Always,
    /// Never.
    Never,
}

/// Who may re-attach to a session's streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ResumeAuth {
    /// The caller presents the same principal (keyed hash of its principal header) as the
    /// request that created the session.
    Principal,
    /// The upstream accepts a JSON-RPC `ping` with the caller's credentials and session id.
    Upstream,
    /// Anyone who knows the session id (only behind an authenticating layer).
    None,
}

/// What identifies the principal a session is bound to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PrincipalSource {
    /// The value of `--principal-header` (default `Authorization`).
    Header,
    /// The subject of the client certificate verified with `--tls-client-ca` (mTLS).
    ClientCert,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The default of every flag that has one, written once: clap's `default_value` (sizes,
/// durations, addresses and the log filter as text, so `--help` shows them as written) or
/// `default_value_t` (counts, switches and choices) names these, and [`Config::new`] is the
/// configuration they describe ([`GatewayArgs::defaults`]).
pub mod defaults {
    use super::{LogFormat, Priming, PrincipalSource, ResumeAuth};

    pub const LISTEN: &str = "0.0.0.0:8080";
    pub const ADMIN_LISTEN: &str = "127.0.0.1:9090";
    pub const WINDOW_EVENTS: u32 = 256;
    pub const WINDOW_BYTES: &str = "1MiB";
    pub const SESSION_TTL: &str = "5m";
    pub const MAX_SESSIONS: u32 = 10_000;
    pub const KEEPALIVE: &str = "15s";
    pub const STALL_TIMEOUT: &str = "30s";
    pub const HOLD_STANDALONE: bool = true;
    pub const JSON_UPGRADE: bool = true;
    pub const UPGRADE_GRACE: &str = "200ms";
    pub const PRIMING: Priming = Priming::Auto;
    pub const MAX_EVENT_BYTES: &str = "16MiB";
    pub const MAX_REQUEST_BYTES: &str = "4MiB";
    pub const MAX_BUFFERED_REQUEST_BYTES: &str = "64MiB";
    pub const DRAIN_DELAY: &str = "5s";
    pub const DRAIN_TIMEOUT: &str = "25s";
    pub const HEADER_READ_TIMEOUT: &str = "10s";
    pub const IDLE_TIMEOUT: &str = "75s";
    pub const MAX_HEADER_BYTES: &str = "64KiB";
    pub const MAX_HEADERS: u32 = 100;
    pub const MAX_CONNECTIONS: u32 = 10_000;
    /// `0`: fitted to the open-file limit ([`super::Config::fit_to_fds`]).
    pub const MAX_UPSTREAM_CONNECTIONS: u32 = 0;
    pub const MAX_DETACHED_CALLS: u32 = 32;
    pub const MEMORY_BUDGET: &str = "1GiB";
    pub const UPSTREAM_CONNECT_TIMEOUT: &str = "5s";
    pub const UPSTREAM_HEADER_TIMEOUT: &str = "30s";
    pub const PRINCIPAL_SOURCE: PrincipalSource = PrincipalSource::Header;
    pub const RESUME_AUTH: ResumeAuth = ResumeAuth::Principal;
    pub const TLS_RELOAD_INTERVAL: &str = "5s";
    pub const STORE_TIMEOUT: &str = "100ms";
    pub const STORE_DRAIN_TIMEOUT: &str = "60s";
    pub const LOG_FORMAT: LogFormat = LogFormat::Text;
    pub const LOG_LEVEL: &str = "info";
    pub const METRICS_TOOL_NAMES: u32 = 0;
    pub const READY_UPSTREAM: bool = false;
    pub const OTLP_TRACES: bool = false;
}

/// The headings `--help` groups the flags under, in the order shown; every flag has one (a
/// test of `--help` fails on a flag left in clap's default list).
pub mod headings {
    pub const LISTENER: &str = "Listener";
    pub const UPSTREAM: &str = "Upstream";
    pub const SESSIONS: &str = "Sessions and windows";
    pub const STREAMS: &str = "Streams";
    pub const LIMITS: &str = "Limits";
    pub const ACCESS: &str = "Access control";
    pub const TLS: &str = "TLS";
    pub const SHUTDOWN: &str = "Shutdown";
    pub const LOGGING: &str = "Logging";
    pub const ADMIN: &str = "Admin";
    pub const FLEET: &str = "Fleet";
}

/// Make an unmodified MCP server's Streamable HTTP SSE streams resumable.
///
/// Durations take a unit (`500ms`, `15s`, `5m`, `1h`); sizes take an optional unit
/// (`512`, `64KiB`, `1MiB`, `1MB`). Every flag can also be set from the environment as
/// `MCP_REATTACH_<FLAG>` (for example `MCP_REATTACH_UPSTREAM`).
#[derive(Debug, Parser)]
#[command(name = "mcp-reattach", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub gateway: GatewayArgs,
}

impl Cli {
    /// Parses the command line `argv` as [`Cli::try_parse_from`] would, except that the
    /// `sessions` command's help lists its own flags only. The gateway's flags are global
    /// (`mcp-reattach demo --listen ...`), so clap would copy them into every subcommand's
    /// help; `sessions` gets hidden copies instead (clap copies a global flag only into a
    /// subcommand that lacks it), still accepted there. `--admin-token-file`, the one it
    /// reads, stays shown.
    pub fn parse_args(
        argv: impl IntoIterator<Item = impl Into<std::ffi::OsString> + Clone>,
    ) -> Result<Cli, clap::Error> {
        use clap::{Args, CommandFactory, FromArgMatches};
        let gateway = GatewayArgs::augment_args(clap::Command::new("gateway"));
        let hidden: Vec<clap::Arg> = gateway
            .get_arguments()
            .filter(|a| a.is_global_set() && a.get_id() != "admin_token_file")
            .map(|a| a.clone().hide(true))
            .collect();
        let mut cmd = Cli::command().mut_subcommand("sessions", |s| s.args(hidden));
        let matches = cmd.try_get_matches_from_mut(argv)?;
        Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start an embedded legacy MCP demo server on loopback with the gateway in front of it.
    Demo,
    /// See and end a running gateway's sessions (with a shared store, the fleet's) through its
    /// admin listener.
    Sessions(SessionsArgs),
}

/// `mcp-reattach sessions`: what to ask the admin listener. The token, if the gateway needs
/// one, is read from --admin-token-file.
#[derive(Debug, Clone, clap::Args)]
pub struct SessionsArgs {
    /// The gateway's admin listener.
    #[arg(
        long,
        global = true,
        env = "MCP_REATTACH_ADMIN_URL",
        default_value = "http://127.0.0.1:9090"
    )]
    pub admin: String,
    /// Print the admin listener's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub action: SessionsAction,
}

#[derive(Debug, Clone, Subcommand)]
pub enum SessionsAction {
    /// Every session: its id (as logs show it), principal, shape, last use, streams, clients.
    List,
    /// One session and its streams.
    Show {
        /// The session's id as the list shows it (16 hex digits).
        id: String,
    },
    /// End a session as its client's DELETE would (upstream too, on every replica).
    End {
        /// The session's id as the list shows it (16 hex digits).
        id: String,
    },
}

/// The gateway's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// Address the proxy listens on: IP:PORT, [IPv6]:PORT, :PORT (every IPv4 interface) or
    /// localhost:PORT (127.0.0.1).
    #[arg(
        long,
        global = true,
        help_heading = headings::LISTENER,
        env = "MCP_REATTACH_LISTEN",
        default_value = defaults::LISTEN,
        value_parser = parse_listen
    )]
    pub listen: SocketAddr,

    /// Most client connections served at once; further connections wait in the listen
    /// backlog until one closes (count).
    #[arg(long, global = true, help_heading = headings::LISTENER, env = "MCP_REATTACH_MAX_CONNECTIONS", default_value_t = defaults::MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,

    /// Time a client may take to send a request's headers; slower connections are closed
    /// (duration).
    #[arg(long, global = true, help_heading = headings::LISTENER, env = "MCP_REATTACH_HEADER_READ_TIMEOUT", default_value = defaults::HEADER_READ_TIMEOUT, value_parser = parse_positive_duration)]
    pub header_read_timeout: Duration,

    /// Time a client connection may stay open with no request in flight and no response
    /// streaming (HTTP/1.1 keep-alive and HTTP/2 alike) before the gateway closes it; HTTP/2
    /// connections are also pinged every --keepalive and closed when a ping goes unanswered
    /// for 20s (duration).
    #[arg(long, global = true, help_heading = headings::LISTENER, env = "MCP_REATTACH_IDLE_TIMEOUT", default_value = defaults::IDLE_TIMEOUT, value_parser = parse_positive_duration)]
    pub idle_timeout: Duration,

    /// Base URL of the MCP server to proxy to (http or https), e.g. http://127.0.0.1:3000.
    /// Request paths and queries are forwarded as received. Required unless running `demo`.
    #[arg(long, global = true, help_heading = headings::UPSTREAM, env = "MCP_REATTACH_UPSTREAM", value_parser = parse_upstream)]
    pub upstream: Option<http::Uri>,

    /// Time to connect to the upstream (duration).
    #[arg(long, global = true, help_heading = headings::UPSTREAM, env = "MCP_REATTACH_UPSTREAM_CONNECT_TIMEOUT", default_value = defaults::UPSTREAM_CONNECT_TIMEOUT, value_parser = parse_positive_duration)]
    pub upstream_connect_timeout: Duration,

    /// Time to wait for the upstream's response headers on requests that cannot stream
    /// (DELETE, OPTIONS, POSTs without requests); SSE-capable requests have no timeout
    /// (duration).
    #[arg(long, global = true, help_heading = headings::UPSTREAM, env = "MCP_REATTACH_UPSTREAM_HEADER_TIMEOUT", default_value = defaults::UPSTREAM_HEADER_TIMEOUT, value_parser = parse_positive_duration)]
    pub upstream_header_timeout: Duration,

    /// Most connections to the upstream open at once, pooled idle ones included; held
    /// standalone streams take at most three quarters of them. At the bound, a request that
    /// needs a new connection gets 503 with Retry-After. 0: --max-connections plus
    /// --max-sessions, lowered to fit the open-file limit (which the gateway raises to its hard
    /// limit at startup) beside --max-connections (count).
    #[arg(long, global = true, help_heading = headings::UPSTREAM, env = "MCP_REATTACH_MAX_UPSTREAM_CONNECTIONS", default_value_t = defaults::MAX_UPSTREAM_CONNECTIONS)]
    pub max_upstream_connections: u32,

    /// Per-session window: most recent events retained for resumption (count, at least 2: a
    /// window of one has no room to read ahead of what its client may still need).
    #[arg(long, global = true, help_heading = headings::SESSIONS, env = "MCP_REATTACH_WINDOW_EVENTS", default_value_t = defaults::WINDOW_EVENTS, value_parser = clap::value_parser!(u32).range(2..))]
    pub window_events: u32,

    /// Per-session window: most recent bytes retained for resumption (size, e.g. 1MiB).
    #[arg(long, global = true, help_heading = headings::SESSIONS, env = "MCP_REATTACH_WINDOW_BYTES", default_value = defaults::WINDOW_BYTES, value_parser = parse_size)]
    pub window_bytes: u64,

    /// Drop a session's state after this long with no client attached and no client request
    /// (duration).
    #[arg(long, global = true, help_heading = headings::SESSIONS, env = "MCP_REATTACH_SESSION_TTL", default_value = defaults::SESSION_TTL, value_parser = parse_positive_duration)]
    pub session_ttl: Duration,

    /// Most sessions held at once. At the cap the least recently used session with no
    /// attached client is shed; if every session has a client attached, new sessions get 503
    /// with Retry-After.
    #[arg(long, global = true, help_heading = headings::SESSIONS, env = "MCP_REATTACH_MAX_SESSIONS", default_value_t = defaults::MAX_SESSIONS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_sessions: u32,

    /// A client that makes no progress for this long while it has events to receive, or that
    /// never takes its last frame, is detached with a resumption-required signal (and closed
    /// if it cannot even be written to); a detached client's undelivered events are protected
    /// (the upstream is paused) this long after its last progress (duration).
    #[arg(long, global = true, help_heading = headings::SESSIONS, env = "MCP_REATTACH_STALL_TIMEOUT", default_value = defaults::STALL_TIMEOUT, value_parser = parse_positive_duration)]
    pub stall_timeout: Duration,

    /// Most calls of one session still running upstream after their clients left (each holds
    /// an upstream connection until it ends or --session-ttl); the session's next call gets
    /// 429 with Retry-After until one ends or is resumed (count).
    #[arg(long, global = true, help_heading = headings::SESSIONS, env = "MCP_REATTACH_MAX_DETACHED_CALLS", default_value_t = defaults::MAX_DETACHED_CALLS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_detached_calls: u32,

    /// Interval of `: keepalive` comments on every SSE stream the gateway serves (duration,
    /// 0 disables).
    #[arg(long, global = true, help_heading = headings::STREAMS, env = "MCP_REATTACH_KEEPALIVE", default_value = defaults::KEEPALIVE, value_parser = parse_duration)]
    pub keepalive: Duration,

    /// When set, sent as `retry:` (milliseconds on the wire) on priming events and before any
    /// close the gateway initiates (duration; default unset).
    #[arg(long, global = true, help_heading = headings::STREAMS, env = "MCP_REATTACH_RETRY_HINT", value_parser = parse_duration)]
    pub retry_hint: Option<Duration>,

    /// Priming events: auto (protocol 2025-11-25 or later), always, never.
    #[arg(
        long,
        global = true,
        help_heading = headings::STREAMS,
        env = "MCP_REATTACH_PRIMING",
        value_enum,
        default_value_t = defaults::PRIMING
    )]
    pub priming: Priming,

    /// Open each legacy session's standalone GET stream upstream as soon as the session is
    /// initialized and hold it for the client, so server messages sent before the client's
    /// GET arrives are delivered when it does (true/false).
    #[arg(long, global = true, help_heading = headings::STREAMS, env = "MCP_REATTACH_HOLD_STANDALONE", default_value_t = defaults::HOLD_STANDALONE, action = clap::ArgAction::Set)]
    pub hold_standalone: bool,

    /// Answer a legacy POST carrying requests, from a client that accepts SSE, with an SSE
    /// stream of the gateway's (an id first, keep-alives, then the upstream's answer) even
    /// when the upstream answers with JSON, so a cut during the call is an ordinary resume
    /// (true/false).
    #[arg(long, global = true, help_heading = headings::STREAMS, env = "MCP_REATTACH_JSON_UPGRADE", default_value_t = defaults::JSON_UPGRADE, action = clap::ArgAction::Set)]
    pub json_upgrade: bool,

    /// How long an upgraded POST waits for the upstream's response head before the gateway
    /// commits to its SSE answer: an upstream error within it keeps its HTTP status
    /// (duration).
    #[arg(long, global = true, help_heading = headings::STREAMS, env = "MCP_REATTACH_UPGRADE_GRACE", default_value = defaults::UPGRADE_GRACE, value_parser = parse_duration)]
    pub upgrade_grace: Duration,

    /// Largest single SSE event accepted from the upstream (size); a larger one ends that
    /// stream with an explicit error.
    #[arg(long, global = true, help_heading = headings::LIMITS, env = "MCP_REATTACH_MAX_EVENT_BYTES", default_value = defaults::MAX_EVENT_BYTES, value_parser = parse_size)]
    pub max_event_bytes: u64,

    /// Largest request body, of any method (size); larger gets 413, a larger `Content-Length`
    /// before the body is read.
    #[arg(long, global = true, help_heading = headings::LIMITS, env = "MCP_REATTACH_MAX_REQUEST_BYTES", default_value = defaults::MAX_REQUEST_BYTES, value_parser = parse_size)]
    pub max_request_bytes: u64,

    /// Most bytes of request bodies held at once, all connections together (size): the
    /// gateway reads every body whole, so a body that would go over it is refused with 503
    /// and Retry-After (a declared Content-Length before the body is read).
    #[arg(long, global = true, help_heading = headings::LIMITS, env = "MCP_REATTACH_MAX_BUFFERED_REQUEST_BYTES", default_value = defaults::MAX_BUFFERED_REQUEST_BYTES, value_parser = parse_size)]
    pub max_buffered_request_bytes: u64,

    /// Largest request head (request line and headers) accepted; larger gets 431 (size, at
    /// least 8KiB).
    #[arg(long, global = true, help_heading = headings::LIMITS, env = "MCP_REATTACH_MAX_HEADER_BYTES", default_value = defaults::MAX_HEADER_BYTES, value_parser = parse_header_bytes)]
    pub max_header_bytes: u64,

    /// Most request headers accepted; more gets 431 (count).
    #[arg(long, global = true, help_heading = headings::LIMITS, env = "MCP_REATTACH_MAX_HEADERS", default_value_t = defaults::MAX_HEADERS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_headers: u32,

    /// Global budget for all session windows together and the events larger than a window
    /// held for their clients (size). Above it, the oldest idle sessions are shed first, then
    /// the filling session's oldest events; above 90%, new sessions get 503 with Retry-After
    /// and an oversized event waits upstream.
    #[arg(long, global = true, help_heading = headings::LIMITS, env = "MCP_REATTACH_MEMORY_BUDGET", default_value = defaults::MEMORY_BUDGET, value_parser = parse_size)]
    pub memory_budget: u64,

    /// Header naming the principal a session is bound to (e.g. one set by an authenticating
    /// ingress); default: Authorization.
    #[arg(long, global = true, help_heading = headings::ACCESS, env = "MCP_REATTACH_PRINCIPAL_HEADER")]
    pub principal_header: Option<http::HeaderName>,

    /// What the principal is: `header` (the value of --principal-header) or `client-cert`
    /// (the subject of the client's certificate; needs --tls-client-ca).
    #[arg(
        long,
        global = true,
        help_heading = headings::ACCESS,
        env = "MCP_REATTACH_PRINCIPAL_SOURCE",
        value_enum,
        default_value_t = defaults::PRINCIPAL_SOURCE
    )]
    pub principal_source: PrincipalSource,

    /// Who may re-attach to a session: `principal` (the same principal header value as the
    /// request that created it), `upstream` (whoever the upstream accepts a `ping` from, with
    /// the caller's credentials), or `none`.
    #[arg(
        long,
        global = true,
        help_heading = headings::ACCESS,
        env = "MCP_REATTACH_RESUME_AUTH",
        value_enum,
        default_value_t = defaults::RESUME_AUTH
    )]
    pub resume_auth: ResumeAuth,

    /// Comma-separated Origins allowed to call the gateway; others get 403. Requests without
    /// an Origin header are allowed. Default: any (the upstream validates Origin itself).
    #[arg(
        long,
        global = true,
        help_heading = headings::ACCESS,
        env = "MCP_REATTACH_ALLOWED_ORIGINS",
        value_delimiter = ','
    )]
    pub allowed_origins: Vec<String>,

    /// Serve TLS on --listen with this certificate (PEM; the chain after the leaf). Re-read
    /// when the file changes; a bad new certificate is refused and the old one kept.
    #[arg(
        long,
        global = true,
        help_heading = headings::TLS,
        env = "MCP_REATTACH_TLS_CERT",
        requires = "tls_key"
    )]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(
        long,
        global = true,
        help_heading = headings::TLS,
        env = "MCP_REATTACH_TLS_KEY",
        requires = "tls_cert"
    )]
    pub tls_key: Option<std::path::PathBuf>,

    /// How often the --tls-cert and --tls-key files are checked for changes (duration).
    #[arg(long, global = true, help_heading = headings::TLS, env = "MCP_REATTACH_TLS_RELOAD_INTERVAL", default_value = defaults::TLS_RELOAD_INTERVAL, value_parser = parse_positive_duration)]
    pub tls_reload_interval: Duration,

    /// Require client certificates signed by a CA in this PEM file (mTLS; needs --tls-cert).
    #[arg(
        long,
        global = true,
        help_heading = headings::TLS,
        env = "MCP_REATTACH_TLS_CLIENT_CA",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<std::path::PathBuf>,

    /// Trust only the CA certificates in this PEM file for an https --upstream (default: the
    /// platform's roots).
    #[arg(long, global = true, help_heading = headings::TLS, env = "MCP_REATTACH_UPSTREAM_CA")]
    pub upstream_ca: Option<std::path::PathBuf>,

    /// After SIGTERM, /readyz fails at once and the gateway keeps accepting this long so load
    /// balancers deregister it (duration).
    #[arg(long, global = true, help_heading = headings::SHUTDOWN, env = "MCP_REATTACH_DRAIN_DELAY", default_value = defaults::DRAIN_DELAY, value_parser = parse_duration)]
    pub drain_delay: Duration,

    /// Then it stops accepting; in-flight POST streams may finish until this deadline, after
    /// which remaining SSE streams end with a `retry:` hint (duration).
    #[arg(long, global = true, help_heading = headings::SHUTDOWN, env = "MCP_REATTACH_DRAIN_TIMEOUT", default_value = defaults::DRAIN_TIMEOUT, value_parser = parse_duration)]
    pub drain_timeout: Duration,

    /// Log format: text or json.
    #[arg(
        long,
        global = true,
        help_heading = headings::LOGGING,
        env = "MCP_REATTACH_LOG_FORMAT",
        value_enum,
        default_value_t = defaults::LOG_FORMAT
    )]
    pub log_format: LogFormat,

    /// Log filter (tracing-subscriber EnvFilter syntax), e.g. `info` or `mcp_reattach=debug`.
    #[arg(
        long,
        global = true,
        help_heading = headings::LOGGING,
        env = "MCP_REATTACH_LOG_LEVEL",
        default_value = defaults::LOG_LEVEL
    )]
    pub log_level: String,

    /// Export traces over OTLP/HTTP (protobuf). Also on whenever the standard
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set; without them
    /// the endpoint is http://localhost:4318/v1/traces. The other OTEL_* variables apply.
    #[arg(long, global = true, help_heading = headings::LOGGING, env = "MCP_REATTACH_OTLP_TRACES", default_value_t = defaults::OTLP_TRACES, action = clap::ArgAction::Set)]
    pub otlp_traces: bool,

    /// Address of the admin listener: /healthz (liveness), /readyz (readiness; fails from
    /// SIGTERM on) and /metrics (Prometheus text format).
    #[arg(
        long,
        global = true,
        help_heading = headings::ADMIN,
        env = "MCP_REATTACH_ADMIN_LISTEN",
        default_value = defaults::ADMIN_LISTEN,
        value_parser = parse_listen
    )]
    pub admin_listen: SocketAddr,

    /// Addresses of the proxies in front (comma-separated IPs or CIDRs, e.g.
    /// `10.0.0.0/8,127.0.0.1`): for a connection from one of them, the access line's
    /// `client.address` and an anonymous caller's share are the right-most X-Forwarded-For
    /// address that is not one of them; default: none (the connection's peer).
    #[arg(long, global = true, help_heading = headings::ACCESS, env = "MCP_REATTACH_TRUSTED_PROXIES", value_delimiter = ',', value_parser = parse_net)]
    pub trusted_proxies: Vec<Net>,

    /// A file holding the admin listener's token (at least 16 bytes, whitespace trimmed):
    /// ending a session (`DELETE /sessions/{id}`) then needs `Authorization: Bearer
    /// <token>` (or Basic with the token as the password), and so does reading them on an
    /// admin listener off loopback. Without it, sessions can be read and ended only on a
    /// loopback admin listener. Probes and /metrics never need it.
    #[arg(long, global = true, help_heading = headings::ADMIN, env = "MCP_REATTACH_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<std::path::PathBuf>,

    /// With --admin-token-file: reading the sessions (`/sessions`, `/ui`) needs the token too.
    #[arg(long, global = true, help_heading = headings::ADMIN, env = "MCP_REATTACH_ADMIN_TOKEN_FOR_READS", default_value_t = false, action = clap::ArgAction::Set)]
    pub admin_token_for_reads: bool,

    /// `/readyz` also requires the upstream to accept a TCP connection (within 1 s): a pod
    /// whose MCP server is down leaves the load balancer. Off by default: for a sidecar whose
    /// server restarts, or an upstream shared by every replica, it takes replicas out of
    /// service together (see docs/operations.md).
    #[arg(long, global = true, help_heading = headings::ADMIN, env = "MCP_REATTACH_READY_UPSTREAM", default_value_t = defaults::READY_UPSTREAM, action = clap::ArgAction::Set)]
    pub ready_upstream: bool,

    /// Count `tools/call`s per tool name (`mcp_reattach_tool_calls_total{tool}`) for at most
    /// this many distinct names, each taking its place with a call the upstream answered with
    /// success, the rest as `other`; 0: no per-tool metric (count).
    #[arg(long, global = true, help_heading = headings::ADMIN, env = "MCP_REATTACH_METRICS_TOOL_NAMES", default_value_t = defaults::METRICS_TOOL_NAMES)]
    pub metrics_tool_names: u32,

    /// Share sessions across a fleet of gateways through this Redis or Valkey server
    /// (`redis://[USER:PASSWORD@]HOST:PORT[/DB]`; never logged): any replica adopts a session
    /// for its own principal and resumes a call another replica owns. Without it every replica
    /// keeps its own sessions, as one process does.
    #[arg(long, global = true, help_heading = headings::FLEET, env = "MCP_REATTACH_STORE", hide_env_values = true)]
    pub store: Option<String>,

    /// The fleet's shared secret, needed with --store: a file of at least 32 random bytes
    /// mounted in every replica (a Kubernetes Secret), never in the store. Principals are
    /// bound, and the store's key names derived, with keys derived from it.
    #[arg(long, global = true, help_heading = headings::FLEET, env = "MCP_REATTACH_STORE_KEY_FILE")]
    pub store_key_file: Option<std::path::PathBuf>,

    /// The longest a request waits for the store before it is served as without one
    /// (duration).
    #[arg(long, global = true, help_heading = headings::FLEET, env = "MCP_REATTACH_STORE_TIMEOUT", default_value = defaults::STORE_TIMEOUT, value_parser = parse_positive_duration)]
    pub store_timeout: Duration,

    /// With --store, after the drain: the calls still read upstream go on into the store (their
    /// clients resume on other replicas) until they end, at most this long (duration). The
    /// pod's terminationGracePeriodSeconds must exceed --drain-delay + --drain-timeout + this.
    #[arg(long, global = true, help_heading = headings::FLEET, env = "MCP_REATTACH_STORE_DRAIN_TIMEOUT", default_value = defaults::STORE_DRAIN_TIMEOUT, value_parser = parse_duration)]
    pub store_drain_timeout: Duration,

    /// With --store: seal the events written to the store (tool results among them) with
    /// AES-256-GCM under a key derived from --store-key-file per session, the session, stream
    /// and position as associated data (true/false). Every replica must agree.
    #[arg(long, global = true, help_heading = headings::FLEET, env = "MCP_REATTACH_STORE_SEAL", default_value_t = false, action = clap::ArgAction::Set)]
    pub store_seal: bool,
}

/// An IP network: an address and a prefix length (a plain address is all of its bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Net {
    pub addr: std::net::IpAddr,
    pub prefix: u8,
}

impl Net {
    /// Whether `ip` is in this network (an IPv4-mapped IPv6 address counts as IPv4).
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr::{V4, V6};
        let ip = match ip {
            V6(v6) => v6.to_ipv4_mapped().map_or(V6(v6), V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (V4(n), V4(a)) => mask_eq(&n.octets(), &a.octets(), self.prefix),
            (V6(n), V6(a)) => mask_eq(&n.octets(), &a.octets(), self.prefix),
            _ => false,
        }
    }
}

fn mask_eq(net: &[u8], addr: &[u8], prefix: u8) -> bool {
    let bits = usize::from(prefix).min(net.len() * 8);
    let (whole, rest) = (bits / 8, bits % 8);
    if net[..whole] != addr[..whole] {
        return false;
    }
    rest == 0 || {
        let mask = 0xffu8 << (8 - rest);
        net[whole] & mask == addr[whole] & mask
    }
}

/// Parses `10.0.0.0/8`, `fd00::/8` or a plain address.
pub fn parse_net(s: &str) -> Result<Net, String> {
    let s = s.trim();
    let (addr, prefix) = match s.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (s, None),
    };
    let addr: std::net::IpAddr = addr
        .parse()
        .map_err(|_| format!("{s:?} is not an IP address or network (e.g. 10.0.0.0/8)"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let prefix = match prefix {
        None => max,
        Some(p) => p
            .parse::<u8>()
            .ok()
            .filter(|p| *p <= max)
            .ok_or_else(|| format!("{s:?}: the prefix length must be 0 to {max}"))?,
    };
    Ok(Net { addr, prefix })
}

impl GatewayArgs {
    /// Every flag at its default: what clap parses from no flags and no environment.
    pub fn defaults() -> GatewayArgs {
        use defaults::*;
        // The defaults are constants that parse (tested against clap's own parse).
        let addr = |s: &str| s.parse().expect("a default address");
        let size = |s| parse_size(s).expect("a default size");
        let duration = |s| parse_duration(s).expect("a default duration");
        GatewayArgs {
            listen: addr(LISTEN),
            upstream: None,
            admin_listen: addr(ADMIN_LISTEN),
            window_events: WINDOW_EVENTS,
            window_bytes: size(WINDOW_BYTES),
            session_ttl: duration(SESSION_TTL),
            max_sessions: MAX_SESSIONS,
            keepalive: duration(KEEPALIVE),
            retry_hint: None,
            stall_timeout: duration(STALL_TIMEOUT),
            hold_standalone: HOLD_STANDALONE,
            json_upgrade: JSON_UPGRADE,
            upgrade_grace: duration(UPGRADE_GRACE),
            priming: PRIMING,
            max_event_bytes: size(MAX_EVENT_BYTES),
            max_request_bytes: size(MAX_REQUEST_BYTES),
            max_buffered_request_bytes: size(MAX_BUFFERED_REQUEST_BYTES),
            drain_delay: duration(DRAIN_DELAY),
            drain_timeout: duration(DRAIN_TIMEOUT),
            header_read_timeout: duration(HEADER_READ_TIMEOUT),
            idle_timeout: duration(IDLE_TIMEOUT),
            max_header_bytes: size(MAX_HEADER_BYTES),
            max_headers: MAX_HEADERS,
            max_connections: MAX_CONNECTIONS,
            max_upstream_connections: MAX_UPSTREAM_CONNECTIONS,
            max_detached_calls: MAX_DETACHED_CALLS,
            memory_budget: size(MEMORY_BUDGET),
            upstream_connect_timeout: duration(UPSTREAM_CONNECT_TIMEOUT),
            upstream_header_timeout: duration(UPSTREAM_HEADER_TIMEOUT),
            principal_header: None,
            principal_source: PRINCIPAL_SOURCE,
            resume_auth: RESUME_AUTH,
            allowed_origins: Vec::new(),
            tls_cert: None,
            tls_key: None,
            tls_reload_interval: duration(TLS_RELOAD_INTERVAL),
            tls_client_ca: None,
            upstream_ca: None,
            log_format: LOG_FORMAT,
            log_level: LOG_LEVEL.to_owned(),
            trusted_proxies: Vec::new(),
            ready_upstream: READY_UPSTREAM,
            admin_token_file: None,
            admin_token_for_reads: false,
            otlp_traces: OTLP_TRACES,
            metrics_tool_names: METRICS_TOOL_NAMES,
            store: None,
            store_key_file: None,
            store_timeout: duration(STORE_TIMEOUT),
            store_drain_timeout: duration(STORE_DRAIN_TIMEOUT),
            store_seal: false,
        }
    }
}

/// The runtime configuration the gateway reads. Built from [`GatewayArgs`] or directly in tests.
#[derive(Clone, Debug)]
pub struct Config {
    /// Scheme and authority of the upstream (path and query come from each request).
    pub upstream: http::Uri,
    pub window_events: usize,
    pub window_bytes: usize,
    pub session_ttl: Duration,
    pub max_sessions: usize,
    /// `None` disables keep-alives.
    pub keepalive: Option<Duration>,
    pub retry_hint: Option<Duration>,
    pub stall_timeout: Duration,
    pub priming: Priming,
    pub hold_standalone: bool,
    /// See `Args::json_upgrade`.
    pub json_upgrade: bool,
    /// See `Args::upgrade_grace`.
    pub upgrade_grace: Duration,
    pub max_event_bytes: usize,
    pub max_request_bytes: usize,
    /// Bytes of request bodies held at once, all requests together.
    pub max_buffered_request_bytes: usize,
    /// How often the background sweep looks for expired sessions and stalled clients: a
    /// quarter of the shorter of `session_ttl` and `stall_timeout`, within 10 ms to 1 s.
    pub sweep_interval: Duration,
    /// How long POST-started streams may run after the gateway stops accepting.
    pub drain_timeout: Duration,
    pub header_read_timeout: Duration,
    /// A client connection with nothing in flight is closed after this long.
    pub idle_timeout: Duration,
    /// At least [`MIN_HEADER_BYTES`] (the flag refuses less; the server raises a smaller value
    /// set here directly to it).
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_connections: usize,
    /// Upstream connections open at once (never 0: resolved from the flag's `0`).
    pub max_upstream_connections: usize,
    /// Calls of one session running upstream with no client.
    pub max_detached_calls: usize,
    /// Budget for all windows together, in bytes.
    pub memory_budget: usize,
    pub upstream_connect_timeout: Duration,
    pub upstream_header_timeout: Duration,
    /// `None`: `Authorization`.
    pub principal_header: Option<http::HeaderName>,
    pub resume_auth: ResumeAuth,
    /// Empty: any Origin.
    pub allowed_origins: Vec<String>,
    pub principal_source: PrincipalSource,
    /// The proxies in front whose X-Forwarded-For is believed.
    pub trusted_proxies: Vec<Net>,
    /// Distinct tool names counted per tool (0: none).
    pub metrics_tool_names: usize,
    /// The fleet's shared store (`--store`), once its key file is read ([`Config::load_store`]).
    pub store: Option<StoreSettings>,
    /// `/readyz` also checks that the upstream accepts connections.
    pub ready_upstream: bool,
    /// TLS on the proxy listener (`--tls-cert`, `--tls-key`, `--tls-client-ca`).
    pub tls: Option<crate::tls::ServerTls>,
    /// The client config for an https upstream; `None`: the platform's roots.
    pub upstream_tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl Config {
    /// Defaults of every flag ([`defaults`]), in front of `upstream`.
    pub fn new(upstream: http::Uri) -> Config {
        Config::from_args(&GatewayArgs::defaults(), upstream)
    }

    /// The configuration the flags describe, with `upstream` already decided.
    pub fn from_args(args: &GatewayArgs, upstream: http::Uri) -> Config {
        let sweep = (args.session_ttl.min(args.stall_timeout) / 4)
            .clamp(Duration::from_millis(10), Duration::from_secs(1));
        Config {
            upstream,
            window_events: args.window_events as usize,
            window_bytes: usize::try_from(args.window_bytes).unwrap_or(usize::MAX),
            session_ttl: args.session_ttl,
            max_sessions: args.max_sessions as usize,
            keepalive: (!args.keepalive.is_zero()).then_some(args.keepalive),
            retry_hint: args.retry_hint,
            stall_timeout: args.stall_timeout,
            priming: args.priming,
            hold_standalone: args.hold_standalone,
            json_upgrade: args.json_upgrade,
            upgrade_grace: args.upgrade_grace,
            max_event_bytes: usize::try_from(args.max_event_bytes).unwrap_or(usize::MAX),
            max_request_bytes: usize::try_from(args.max_request_bytes).unwrap_or(usize::MAX),
            max_buffered_request_bytes: usize::try_from(args.max_buffered_request_bytes)
                .unwrap_or(usize::MAX),
            sweep_interval: sweep,
            drain_timeout: args.drain_timeout,
            header_read_timeout: args.header_read_timeout,
            idle_timeout: args.idle_timeout,
            max_header_bytes: usize::try_from(args.max_header_bytes).unwrap_or(usize::MAX),
            max_headers: args.max_headers as usize,
            max_connections: args.max_connections as usize,
            max_upstream_connections: match args.max_upstream_connections {
                0 => (args.max_connections as usize).saturating_add(args.max_sessions as usize),
                n => n as usize,
            },
            max_detached_calls: args.max_detached_calls as usize,
            memory_budget: usize::try_from(args.memory_budget).unwrap_or(usize::MAX),
            upstream_connect_timeout: args.upstream_connect_timeout,
            upstream_header_timeout: args.upstream_header_timeout,
            principal_header: args.principal_header.clone(),
            resume_auth: args.resume_auth,
            allowed_origins: args
                .allowed_origins
                .iter()
                .map(|o| o.trim().to_owned())
                .filter(|o| !o.is_empty())
                .collect(),
            principal_source: args.principal_source,
            trusted_proxies: args.trusted_proxies.clone(),
            metrics_tool_names: args.metrics_tool_names as usize,
            ready_upstream: args.ready_upstream,
            tls: None,
            upstream_tls: None,
            store: None,
        }
    }

    /// Fits the connection bounds to the process's open-file limit `nofile`: each client
    /// connection and each upstream connection is an fd, and [`RESERVED_FDS`] are kept for the
    /// listeners, the runtime and the log. When both bounds do not fit, an `auto` upstream bound
    /// (`explicit_upstream` false) takes what the clients leave, the clients at most half; what
    /// still does not fit is lowered. Returns what was lowered, for the startup log.
    pub fn fit_to_fds(&mut self, nofile: u64, explicit_upstream: bool) -> Option<String> {
        let budget = usize::try_from(nofile)
            .unwrap_or(usize::MAX)
            .saturating_sub(RESERVED_FDS)
            .max(4);
        if self
            .max_connections
            .saturating_add(self.max_upstream_connections)
            <= budget
        {
            return None;
        }
        let (clients, upstream) = (self.max_connections, self.max_upstream_connections);
        if !explicit_upstream {
            let clients_share = clients.min(budget / 2);
            self.max_upstream_connections = upstream.min(budget - clients_share);
        } else {
            self.max_upstream_connections = upstream.min(budget / 2);
        }
        self.max_connections = clients.min(budget - self.max_upstream_connections);
        Some(format!(
            "the open-file limit is {nofile}: --max-connections {clients} -> {}, --max-upstream-connections {upstream} -> {} (raise the limit, e.g. LimitNOFILE or ulimit -n, to keep them)",
            self.max_connections, self.max_upstream_connections
        ))
    }

    /// Loads the TLS material the flags name into `self` (`tls`, `upstream_tls`); the error
    /// names the flag of the file that cannot be used.
    pub fn load_tls(mut self, args: &GatewayArgs) -> Result<Config, crate::tls::TlsError> {
        if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
            let mut tls = crate::tls::ServerTls::load(cert, key, args.tls_client_ca.as_deref())?;
            tls.reload_interval = args.tls_reload_interval;
            self.tls = Some(tls);
        }
        if self.principal_source == PrincipalSource::ClientCert && args.tls_client_ca.is_none() {
            return Err(crate::tls::TlsError {
                flag: "--principal-source",
                path: "client-cert".into(),
                reason: "needs --tls-client-ca (clients must present certificates)".into(),
            });
        }
        if self.upstream.scheme_str() == Some("https") || args.upstream_ca.is_some() {
            self.upstream_tls = Some(std::sync::Arc::new(crate::tls::upstream_client_config(
                args.upstream_ca.as_deref(),
            )?));
        }
        Ok(self)
    }
}

/// The fleet's shared store: where it is, the secret the fleet shares, how long a request
/// waits for it. Its `Debug` shows neither the URL (it may hold a password) nor the secret.
#[derive(Clone)]
pub struct StoreSettings {
    pub url: String,
    /// The key file's contents, whitespace trimmed (at least [`MIN_STORE_KEY_BYTES`]).
    pub secret: Vec<u8>,
    pub timeout: Duration,
    /// `--store-drain-timeout`.
    pub drain_timeout: Duration,
    /// `--store-seal`.
    pub seal: bool,
}

impl std::fmt::Debug for StoreSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreSettings")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The least a `--store-key-file` holds: 32 bytes (256 bits) of secret.
pub const MIN_STORE_KEY_BYTES: usize = 32;

/// Why `--store` cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct StoreError {
    pub flag: &'static str,
    pub reason: String,
}

impl Config {
    /// Reads `--store-key-file` for `--store` (both, or neither).
    pub fn load_store(mut self, args: &GatewayArgs) -> Result<Config, StoreError> {
        let Some(url) = &args.store else {
            return Ok(self);
        };
        if !(url.starts_with("redis://") || url.starts_with("valkey://")) {
            return Err(StoreError {
                flag: "--store",
                reason: "'--store' must be a redis:// URL (redis://HOST:PORT[/DB])".into(),
            });
        }
        let Some(path) = &args.store_key_file else {
            return Err(StoreError {
                flag: "--store-key-file",
                reason: "'--store-key-file' is needed with --store: the fleet's shared secret"
                    .into(),
            });
        };
        let secret = std::fs::read(path).map_err(|e| StoreError {
            flag: "--store-key-file",
            reason: format!("cannot read '--store-key-file' {}: {e}", path.display()),
        })?;
        let secret = secret.trim_ascii().to_vec();
        if secret.len() < MIN_STORE_KEY_BYTES {
            return Err(StoreError {
                flag: "--store-key-file",
                reason: format!(
                    "'--store-key-file' {} holds {} bytes; at least {MIN_STORE_KEY_BYTES} are needed (e.g. `head -c 32 /dev/urandom | base64`)",
                    path.display(),
                    secret.len()
                ),
            });
        }
        self.store = Some(StoreSettings {
            url: url.replacen("valkey://", "redis://", 1),
            secret,
            timeout: args.store_timeout,
            drain_timeout: args.store_drain_timeout,
            seal: args.store_seal,
        });
        Ok(self)
    }
}

/// The least an `--admin-token-file` holds.
pub const MIN_ADMIN_TOKEN_BYTES: usize = 16;

/// Who may read and end sessions on the admin listener (`--admin-token-file`,
/// `--admin-token-for-reads`). Its `Debug` never shows the token.
#[derive(Clone, Default)]
pub struct AdminAccess {
    /// The token's hash (compared in constant time), if a token file is given.
    pub token: Option<blake3::Hash>,
    pub token_for_reads: bool,
}

impl std::fmt::Debug for AdminAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminAccess")
            .field("token", &self.token.map(|_| "<set>"))
            .field("token_for_reads", &self.token_for_reads)
            .finish()
    }
}

/// Why the admin token cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AdminTokenError(pub String);

impl AdminAccess {
    /// Reads `--admin-token-file`.
    pub fn load(args: &GatewayArgs) -> Result<AdminAccess, AdminTokenError> {
        let Some(path) = &args.admin_token_file else {
            if args.admin_token_for_reads {
                return Err(AdminTokenError(
                    "'--admin-token-for-reads' needs '--admin-token-file'".into(),
                ));
            }
            return Ok(AdminAccess::default());
        };
        let token = std::fs::read(path).map_err(|e| {
            AdminTokenError(format!(
                "cannot read '--admin-token-file' {}: {e}",
                path.display()
            ))
        })?;
        let token = token.trim_ascii();
        if token.len() < MIN_ADMIN_TOKEN_BYTES {
            return Err(AdminTokenError(format!(
                "'--admin-token-file' {} holds {} bytes; at least {MIN_ADMIN_TOKEN_BYTES} are needed (e.g. `head -c 24 /dev/urandom | base64`)",
                path.display(),
                token.len()
            )));
        }
        Ok(AdminAccess {
            token: Some(blake3::hash(token)),
            token_for_reads: args.admin_token_for_reads,
        })
    }
}

/// File descriptors [`Config::fit_to_fds`] keeps for everything but connections: the two
/// listeners, the runtime's epoll and wakers, the log, TLS files being reloaded, admin scrapes.
pub const RESERVED_FDS: usize = 64;

/// Parses an upstream base URL: `http(s)://host[:port]` with an optional trailing `/`.
///
/// `http::Uri` is the parser (the one hyper connects with, so what is checked is what is
/// used), and it is lenient where a base URL must not be: it keeps a port it cannot read as a
/// `u16` (`:99999`, `:`, `:+80`) and reports none, takes an empty host and user info. Those are
/// checked here. Credentials (`user:pw@`) are refused, not stripped: clients' `Authorization`
/// headers are what the upstream sees, and a URL with a secret in it ends up in logs.
pub fn parse_upstream(s: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = s.parse().map_err(|e| format!("not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(format!(
                "scheme {other:?} is not supported (use http or https)"
            ))
        }
        None => return Err("missing scheme (expected http://host:port or https://…)".into()),
    }
    let Some(authority) = uri.authority().map(|a| a.as_str()) else {
        return Err("missing host".into());
    };
    if authority.contains('@') {
        return Err(
            "credentials in the URL (user:password@) are not accepted; the upstream gets \
                    each client's own Authorization header"
                .into(),
        );
    }
    let host = uri.host().unwrap_or("");
    if host.is_empty() {
        return Err("missing host".into());
    }
    match authority.strip_prefix(host).unwrap_or(authority) {
        "" => {}
        port => {
            let digits = port.strip_prefix(':').unwrap_or(port);
            let valid = !digits.is_empty()
                && digits.len() <= 5
                && digits.bytes().all(|b| b.is_ascii_digit())
                && matches!(digits.parse::<u32>(), Ok(1..=65535));
            if !valid {
                return Err(format!("port {digits:?} is not 1 to 65535"));
            }
        }
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(
            "give only scheme, host and port; request paths are forwarded as received".into(),
        );
    }
    Ok(uri)
}

/// `value` with the user info of its URL authority, if any, replaced by `***`
/// (`http://user:pw@host/` → `http://***@host/`); anything else unchanged.
pub fn redact_userinfo(value: &str) -> std::borrow::Cow<'_, str> {
    let start = value.find("://").map_or(0, |i| i + 3);
    let end = value[start..]
        .find(['/', '?', '#'])
        .map_or(value.len(), |i| start + i);
    match value[start..end].rfind('@') {
        Some(at) => format!("{}***{}", &value[..start], &value[start + at..]).into(),
        None => value.into(),
    }
}

/// The environment variable the value of the flag `long` (`--max-sessions`) came from, if it
/// came from one: the flag is not on the command line `argv` (a flag there wins) and its
/// variable (`MCP_REATTACH_MAX_SESSIONS`) is set in `env`.
pub fn value_from_env(
    long: &str,
    argv: &[std::ffi::OsString],
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Option<String> {
    use clap::CommandFactory;
    let name = long.strip_prefix("--")?;
    let cmd = Cli::command();
    let var = cmd
        .get_arguments()
        .find(|a| a.get_long() == Some(name))?
        .get_env()?
        .to_string_lossy()
        .into_owned();
    let on_command_line = argv.iter().skip(1).any(|a| {
        let a = a.to_string_lossy();
        a == long
            || a.strip_prefix(long)
                .is_some_and(|rest| rest.starts_with('='))
    });
    (!on_command_line && env(&var).is_some()).then_some(var)
}

/// Renders clap's `err` about the command line `argv` (`env` reads the environment) for
/// printing: a refused value that came from an environment variable names it (`invalid value
/// 'x' for '--max-sessions <MAX_SESSIONS>' (from MCP_REATTACH_MAX_SESSIONS)`; clap names only
/// the flag), and the credentials of an upstream URL (`--upstream`'s value,
/// `MCP_REATTACH_UPSTREAM`, any argument that is a URL) never appear, whatever the error quotes.
pub fn explain_error(
    err: &clap::Error,
    argv: &[std::ffi::OsString],
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> String {
    use clap::error::{ContextKind, ContextValue};
    let mut text = err.render().to_string();
    if let Some(ContextValue::String(arg)) = err.get(ContextKind::InvalidArg) {
        // `--max-sessions <MAX_SESSIONS>`, quoted in the message.
        let long = arg.split_whitespace().next().unwrap_or(arg);
        if let Some(var) = value_from_env(long, argv, &env) {
            let quoted = format!("'{arg}'");
            text = text.replacen(&quoted, &format!("{quoted} (from {var})"), 1);
        }
    }
    let mut urls: Vec<String> = Vec::new();
    let mut after_upstream = false;
    for arg in argv.iter().skip(1).map(|a| a.to_string_lossy()) {
        let value = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => value,
            _ => &arg,
        };
        if after_upstream || arg.starts_with("--upstream=") || value.contains("://") {
            urls.push(value.to_owned());
        }
        after_upstream = arg == "--upstream";
    }
    urls.extend(env("MCP_REATTACH_UPSTREAM").map(|v| v.to_string_lossy().into_owned()));
    for url in urls {
        if let std::borrow::Cow::Owned(redacted) = redact_userinfo(&url) {
            text = text.replace(&url, &redacted);
        }
    }
    text
}

/// The spellings [`parse_listen`] accepts, for its errors.
const LISTEN_FORMS: &str = "expected IP:PORT (0.0.0.0:8080, 127.0.0.1:8080), [IPv6]:PORT \
([::]:8080, [::1]:8080), :PORT for every IPv4 interface (:8080) or localhost:PORT for \
127.0.0.1 (localhost:8080)";

/// Parses a listen address (`--listen`, `--admin-listen`): `IP:PORT`, `[IPv6]:PORT`, `:PORT`
/// or `*:PORT` (every IPv4 interface, `0.0.0.0`, as nginx's `listen *:8080`; the default
/// `--listen` is that too), or `localhost:PORT` (`127.0.0.1`, without a lookup). Port 0 picks
/// a free port. A bare port is refused rather than guessed (every interface, or loopback?), and
/// so is any other host name: a listener binds an address, not a name.
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if s.parse::<u16>().is_ok() {
        return Err(format!(
            "a bare port is ambiguous: :{s} listens on every IPv4 interface, 127.0.0.1:{s} on loopback only; {LISTEN_FORMS}"
        ));
    }
    let Some((host, port)) = s.rsplit_once(':').filter(|(h, _)| !h.ends_with(':')) else {
        return Err(format!("no port; {LISTEN_FORMS}"));
    };
    let ip: IpAddr = match host {
        "" | "*" => Ipv4Addr::UNSPECIFIED.into(),
        h if h.eq_ignore_ascii_case("localhost") => Ipv4Addr::LOCALHOST.into(),
        h if h.parse::<std::net::Ipv6Addr>().is_ok() => {
            return Err(format!(
                "an IPv6 address takes brackets ([{h}]:{port}); {LISTEN_FORMS}"
            ))
        }
        h => match h
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(h)
            .parse()
        {
            // The port is what is wrong: said below.
            Ok(ip) => ip,
            Err(_) if h.contains(['/', ':', '[', ']']) => {
                return Err(format!("not an address with a port; {LISTEN_FORMS}"))
            }
            Err(_) => {
                return Err(format!(
                "{h:?} is a host name: only localhost is known, give an IP address; {LISTEN_FORMS}"
            ))
            }
        },
    };
    let port: u16 = port
        .parse()
        .map_err(|_| format!("port {port:?} is not 0 to 65535; {LISTEN_FORMS}"))?;
    Ok(SocketAddr::new(ip, port))
}

/// The smallest `--max-header-bytes`: hyper's smallest HTTP/1.1 read buffer.
pub const MIN_HEADER_BYTES: u64 = 8 << 10;

/// Parses `--max-header-bytes`: a size of at least [`MIN_HEADER_BYTES`], refused (not raised)
/// below it.
fn parse_header_bytes(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if v < MIN_HEADER_BYTES {
        return Err(format!(
            "{v} bytes is below the minimum, 8KiB ({MIN_HEADER_BYTES} bytes: the smallest request-head buffer of the HTTP server)"
        ));
    }
    Ok(v)
}

/// Parses a duration with a unit (`250ms`, `15s`, `5m`); a bare `0` is zero.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(s.trim()).map_err(|e| format!("{e} (expected e.g. 500ms, 15s, 5m)"))
}

fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

/// Parses a byte size: a plain number of bytes or a number with `B`, `KB`, `KiB`, `MB`,
/// `MiB`, `GB`, `GiB` (case-insensitive).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (expected e.g. 65536, 64KiB, 1MiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "kib" | "k" => 1 << 10,
        "mb" => 1_000_000,
        "mib" | "m" => 1 << 20,
        "gb" => 1_000_000_000,
        "gib" | "g" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit {other:?} (use B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    let v = n
        .checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))?;
    if v == 0 {
        return Err("must be greater than zero".into());
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_new_is_what_the_cli_parses_from_no_flags() {
        use clap::{CommandFactory, FromArgMatches};
        // No flags and no environment: the MCP_REATTACH_* of this process do not count.
        let matches = Cli::command()
            .mut_args(|a| a.env(None::<&str>))
            .try_get_matches_from(["mcp-reattach"])
            .unwrap();
        let parsed = Cli::from_arg_matches(&matches).unwrap().gateway;
        assert_eq!(
            format!("{:#?}", GatewayArgs::defaults()),
            format!("{parsed:#?}")
        );
        let upstream: http::Uri = "http://127.0.0.1:3000".parse().unwrap();
        assert_eq!(
            format!("{:#?}", Config::new(upstream.clone())),
            format!("{:#?}", Config::from_args(&parsed, upstream))
        );
        assert_eq!(
            Config::new("http://h".parse().unwrap()).sweep_interval,
            Duration::from_secs(1)
        );
        // tls cannot name config (config loads through tls), so its own default for a
        // ServerTls loaded without the flags is a copy: kept equal here.
        assert_eq!(parsed.tls_reload_interval, crate::tls::RELOAD_INTERVAL);
    }

    #[test]
    fn connection_bounds_fit_the_open_file_limit() {
        let mut c = Config::new("http://h".parse().unwrap());
        assert_eq!(
            c.max_upstream_connections, 20_000,
            "auto: clients plus sessions"
        );
        assert_eq!(c.fit_to_fds(1 << 20, false), None, "they fit");
        assert_eq!(
            (c.max_connections, c.max_upstream_connections),
            (10_000, 20_000)
        );
        // 256 fds: 192 for connections, half each.
        let lowered = c.fit_to_fds(256, false).expect("lowered");
        assert!(lowered.contains("256"), "{lowered}");
        assert_eq!((c.max_connections, c.max_upstream_connections), (96, 96));
        // Few clients leave the rest to the upstream.
        let mut c = Config::new("http://h".parse().unwrap());
        c.max_connections = 50;
        c.max_upstream_connections = 10_050;
        c.fit_to_fds(256, false).expect("lowered");
        assert_eq!((c.max_connections, c.max_upstream_connections), (50, 142));
        // An explicit upstream bound that does not fit: at most half.
        let mut c = Config::new("http://h".parse().unwrap());
        c.max_upstream_connections = 1000;
        c.fit_to_fds(256, true).expect("lowered");
        assert_eq!((c.max_connections, c.max_upstream_connections), (96, 96));
        for nofile in [0, 1, 64, 65, 100, 1000, 5000] {
            let mut c = Config::new("http://h".parse().unwrap());
            c.fit_to_fds(nofile, false);
            assert!(
                c.max_connections >= 1 && c.max_upstream_connections >= 1,
                "{nofile}"
            );
            assert!(
                c.max_connections + c.max_upstream_connections
                    <= (nofile as usize).saturating_sub(RESERVED_FDS).max(4),
                "{nofile}"
            );
        }
    }

    #[test]
    fn networks() {
        let n = parse_net("10.0.0.0/8").unwrap();
        assert!(n.contains("10.1.2.3".parse().unwrap()));
        assert!(n.contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(!n.contains("11.0.0.1".parse().unwrap()));
        let n = parse_net("192.168.1.128/25").unwrap();
        assert!(n.contains("192.168.1.200".parse().unwrap()));
        assert!(!n.contains("192.168.1.100".parse().unwrap()));
        let n = parse_net("127.0.0.1").unwrap();
        assert!(n.contains("127.0.0.1".parse().unwrap()));
        assert!(!n.contains("127.0.0.2".parse().unwrap()));
        assert!(parse_net("fd00::/8")
            .unwrap()
            .contains("fd12::1".parse().unwrap()));
        assert!(parse_net("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        for bad in ["10.0.0.0/33", "nope", "10.0.0/8", "::/129", "1.2.3.4/x"] {
            assert!(parse_net(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("64kib"), Ok(65536));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("0").is_err());
        assert!(parse_size("1 parsec").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999GiB").is_err());
        assert_eq!(parse_header_bytes("8KiB"), Ok(8192));
        assert!(parse_header_bytes("8191").unwrap_err().contains("8KiB"));
        assert!(parse_header_bytes("1KiB").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("15s"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("15").is_err());
        assert!(parse_positive_duration("0").is_err());
    }

    #[test]
    fn listen_spellings() {
        let ok = |s: &str| {
            parse_listen(s)
                .unwrap_or_else(|e| panic!("{s}: {e}"))
                .to_string()
        };
        assert_eq!(ok("0.0.0.0:8080"), "0.0.0.0:8080");
        assert_eq!(ok("127.0.0.1:0"), "127.0.0.1:0");
        assert_eq!(ok("[::]:8080"), "[::]:8080");
        assert_eq!(ok("[::1]:9090"), "[::1]:9090");
        assert_eq!(ok(":8080"), "0.0.0.0:8080");
        assert_eq!(ok("*:8080"), "0.0.0.0:8080");
        assert_eq!(ok("localhost:8080"), "127.0.0.1:8080");
        assert_eq!(ok("LocalHost:8080"), "127.0.0.1:8080");
        assert_eq!(ok(" :8080 "), "0.0.0.0:8080");
        for bad in [
            "8080",
            "0.0.0.0",
            "localhost",
            "::1",
            "::1:8080",
            ":99999",
            ":",
            ":http",
            "example.com:8080",
            "http://127.0.0.1:8080",
            "[::1]",
            "0.0.0.0:99999",
            "",
        ] {
            let e = parse_listen(bad).expect_err(bad);
            assert!(
                e.contains("localhost:8080") && e.contains(":8080"),
                "{bad}: {e}"
            );
        }
        assert!(parse_listen("8080").unwrap_err().contains("127.0.0.1:8080"));
        assert!(parse_listen("example.com:1")
            .unwrap_err()
            .contains("host name"));
    }

    #[test]
    fn upstreams() {
        for ok in [
            "http://127.0.0.1:3000",
            "http://127.0.0.1:3000/",
            "https://x",
            "http://[::1]:3000",
            "http://h:1",
            "http://h:65535",
            "HTTP://H:80",
        ] {
            assert!(parse_upstream(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("ftp://x", "scheme"),
            ("127.0.0.1:3000", "scheme"),
            ("mailto:pw@example.com", "scheme"),
            ("http://h/mcp", "path"),
            ("http://h?q", "path"),
            ("http://h:99999", "port"),
            ("http://h:0", "port"),
            ("http://h:", "port"),
            ("http://h:+80", "port"),
            ("http://h:99999999999999999999", "port"),
            ("http://:3000", "host"),
            ("http://user:pw@h:3000", "credentials"),
            ("http://user@h", "credentials"),
            ("http://@h", "credentials"),
        ] {
            let e = parse_upstream(bad).expect_err(bad);
            assert!(e.contains(why), "{bad}: {e}");
            assert!(!e.contains("pw"), "{bad}: {e}");
        }
    }

    #[test]
    fn credentials_are_redacted() {
        assert_eq!(redact_userinfo("http://u:pw@h:1/x@y"), "http://***@h:1/x@y");
        assert_eq!(redact_userinfo("u:pw@h"), "***@h");
        assert_eq!(redact_userinfo("http://h:1/x@y"), "http://h:1/x@y");
        assert_eq!(redact_userinfo("x"), "x");
        let argv = |args: &[&str]| {
            std::iter::once("mcp-reattach")
                .chain(args.iter().copied())
                .map(std::ffi::OsString::from)
                .collect::<Vec<_>>()
        };
        for args in [
            &["--upstream", "http://u:pw@h:99999"][..],
            &["--upstream=http://u:pw@h:99999"],
            &["--upstream", "u:pw@h"],
            &["https://u:pw@h"],
        ] {
            let argv = argv(args);
            let err = Cli::try_parse_from(&argv).expect_err("refused");
            let text = explain_error(&err, &argv, |_| None);
            assert!(!text.contains("pw"), "{args:?}: {text}");
            assert!(text.contains("***@h"), "{args:?}: {text}");
        }
        let argv = argv(&["--window-events", "0"]);
        let err = Cli::try_parse_from(&argv).expect_err("refused");
        assert_eq!(
            explain_error(&err, &argv, |_| None),
            err.render().to_string()
        );
    }

    #[test]
    fn errors_name_the_variable_a_value_came_from() {
        let env = |var: &str| (var == "MCP_REATTACH_MAX_SESSIONS").then(|| "x".into());
        // The error clap gives for MCP_REATTACH_MAX_SESSIONS=x is the one for `--max-sessions x`
        // (made so here: the process's environment is shared by the tests), explained for a
        // command line without the flag.
        let err =
            Cli::try_parse_from(["mcp-reattach", "--max-sessions", "x"]).expect_err("refused");
        let argv: Vec<std::ffi::OsString> = vec!["mcp-reattach".into()];
        let text = explain_error(&err, &argv, env);
        assert!(
            text.contains("for '--max-sessions <MAX_SESSIONS>' (from MCP_REATTACH_MAX_SESSIONS):"),
            "{text}"
        );
        // On the command line, the flag wins: its error is the flag's alone.
        for argv in [
            vec!["mcp-reattach", "--max-sessions", "y"],
            vec!["mcp-reattach", "--max-sessions=y"],
        ] {
            let argv: Vec<std::ffi::OsString> = argv.into_iter().map(Into::into).collect();
            assert_eq!(value_from_env("--max-sessions", &argv, env), None);
            let err = Cli::try_parse_from(&argv).expect_err("refused");
            assert!(!explain_error(&err, &argv, env).contains("MCP_REATTACH"));
        }
        let argv: Vec<std::ffi::OsString> = vec!["mcp-reattach".into(), "--max-sessions-x".into()];
        assert_eq!(
            value_from_env("--max-sessions", &argv, env).as_deref(),
            Some("MCP_REATTACH_MAX_SESSIONS")
        );
        assert_eq!(value_from_env("--window-bytes", &argv, env), None);
        assert_eq!(value_from_env("--no-such-flag", &argv, env), None);
    }
}
