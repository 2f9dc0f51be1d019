//! The `mcp-reattach` binary: parses flags, installs logging and signal handling (SIGTERM
//! graceful, SIGINT quick, SIGHUP reloads the TLS pair), binds the listeners and runs the
//! library. Exit code 64 for bad configuration.

use std::process::ExitCode;

use mcp_reattach::config::{self, Cli, Command, Config, GatewayArgs, LogFormat};
use mcp_reattach::{Reload, ServerTls};
use mcp_reattach::{Shutdown, ShutdownMode as Mode};
use tokio::net::TcpListener;
use tracing_subscriber::prelude::*;

/// mimalloc: a request allocates and frees many small blocks (header maps, bodies, futures),
/// and glibc's malloc/free was a large part of a short call (bench/notes.md, "Figure: the
/// allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const EX_USAGE: u8 = 64;

fn main() -> ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match Cli::parse_args(&argv) {
        Ok(c) => c,
        // --help, --version.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let explained = config::explain_error(&e, &argv, |var| std::env::var_os(var));
            if explained == e.render().to_string() {
                let _ = e.print(); // in colour on a terminal
            } else {
                eprint!("{explained}");
            }
            return ExitCode::from(EX_USAGE);
        }
    };
    let filter = match tracing_subscriber::EnvFilter::try_new(&cli.gateway.log_level) {
        Ok(f) => f,
        Err(e) => {
            eprintln!(
                "error: invalid value '{}' for '--log-level <LOG_LEVEL>'{}: {e}",
                cli.gateway.log_level,
                from_env("--log-level", &argv)
            );
            return ExitCode::from(EX_USAGE);
        }
    };
    // Log lines are written by a thread of their own, in batches (one line per request must
    // not cost each request a write, nor a wake-up of that thread); colours only on a terminal.
    let (writer, _log_flush) = match mcp_reattach::spawn_log_writer(std::io::stdout()) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: cannot start the log writer: {e}");
            return ExitCode::FAILURE;
        }
    };
    mcp_reattach::set_access_sink(writer.clone(), cli.gateway.log_format == LogFormat::Json);
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_writer(writer);
    let fmt = match cli.gateway.log_format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().flatten_event(true).boxed(),
    }
    .with_filter(filter);
    // Traces: only when asked for (the standard OTLP endpoint variables, or the flag).
    let traces = if cli.gateway.otlp_traces || mcp_reattach::otlp_wanted_by_env() {
        match mcp_reattach::otlp_layer() {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(EX_USAGE);
            }
        }
    } else {
        None
    };
    let (traces, _exporter) = traces.unzip();
    tracing_subscriber::registry().with(fmt).with(traces).init();
    // One worker (a container limited to one or two CPUs, a process pinned to one): the
    // current-thread scheduler, the same work without the work-stealing scheduler's
    // bookkeeping and wake-ups between threads (bench/notes.md, "Figure: the runtime on one
    // CPU"). More: one worker per CPU, as tokio sizes it.
    let mut builder = if worker_threads() == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Some(Command::Demo) => runtime.block_on(demo(cli.gateway)),
        Some(Command::Sessions(args)) => return runtime.block_on(sessions(&args, &cli.gateway)),
        None => {
            let Some(upstream) = cli.gateway.upstream.clone() else {
                eprintln!("error: the argument '--upstream <UPSTREAM>' is required (or MCP_REATTACH_UPSTREAM); try `mcp-reattach demo` to see the gateway in front of a demo server");
                return ExitCode::from(EX_USAGE);
            };
            runtime.block_on(run(Config::from_args(&cli.gateway, upstream), &cli.gateway))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut message = e.to_string();
            if let Some(flag) = e.flag() {
                let quoted = format!("'{flag}'");
                let named = format!("{quoted}{}", from_env(flag, &argv));
                message = message.replacen(&quoted, &named, 1);
            }
            eprintln!("error: {message}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// ` (from MCP_REATTACH_X)` when the value of `flag` came from its environment variable, for
/// an error that names the flag; empty otherwise.
fn from_env(flag: &str, argv: &[std::ffi::OsString]) -> String {
    config::value_from_env(flag, argv, |var| std::env::var_os(var))
        .map(|var| format!(" (from {var})"))
        .unwrap_or_default()
}

#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("cannot listen on {addr} for '{flag}': {source}")]
    Bind {
        flag: &'static str,
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Tls(#[from] mcp_reattach::TlsError),
    #[error("{0}")]
    Store(#[from] mcp_reattach::config::StoreError),
    #[error("{0}")]
    AdminToken(#[from] mcp_reattach::config::AdminTokenError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl StartError {
    /// The flag whose value could not be used, quoted in the message.
    fn flag(&self) -> Option<&'static str> {
        match self {
            StartError::Bind { flag, .. } => Some(flag),
            StartError::Tls(e) => Some(e.flag),
            StartError::Store(e) => Some(e.flag),
            StartError::AdminToken(_) => Some("--admin-token-file"),
            StartError::Io(_) => None,
        }
    }

    fn exit_code(&self) -> u8 {
        match self {
            StartError::Bind { .. }
            | StartError::Tls(_)
            | StartError::Store(_)
            | StartError::AdminToken(_) => EX_USAGE,
            StartError::Io(_) => 1,
        }
    }
}

/// Connections the kernel holds, handshake done, until the gateway accepts them: a reconnect
/// storm, or every `--max-connections` slot taken. tokio's `TcpListener::bind` asks for 128,
/// so the 129th client of a storm had its SYN dropped and retried a second later; the kernel
/// caps this at `net.core.somaxconn` (4096 by default).
const LISTEN_BACKLOG: u32 = 4096;

async fn bind(flag: &'static str, addr: std::net::SocketAddr) -> Result<TcpListener, StartError> {
    let listen = || {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        // As `TcpListener::bind`: a restarted gateway binds while old connections linger.
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(LISTEN_BACKLOG)
    };
    listen().map_err(|source| StartError::Bind { flag, addr, source })
}

async fn run(config: Config, args: &GatewayArgs) -> Result<(), StartError> {
    let mut config = config.load_tls(args)?.load_store(args)?;
    // Every connection is an fd: the soft open-file limit goes up to the hard one, and the
    // connection bounds are fitted to it.
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(nofile) => {
            let explicit = args.max_upstream_connections != 0;
            if let Some(lowered) = config.fit_to_fds(nofile, explicit) {
                // Lowering what an operator asked for is worth a warning; fitting the
                // defaults to the machine is what the defaults are for.
                if explicit
                    || args.max_connections != mcp_reattach::config::defaults::MAX_CONNECTIONS
                {
                    tracing::warn!("{lowered}");
                } else {
                    tracing::info!("{lowered}");
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read or raise the open-file limit; the connection bounds are not fitted to it")
        }
    }
    let listener = bind("--listen", args.listen).await?;
    let admin = bind("--admin-listen", args.admin_listen).await?;
    let access = config::AdminAccess::load(args)?;
    let shutdown = Shutdown::new();
    // Before anything is served: a signal with no handler yet takes its default action, which
    // for SIGHUP and SIGINT is to end the process on the spot.
    let signals = forward_signals(shutdown.clone(), config.tls.clone())
        .map_err(|e| std::io::Error::other(format!("cannot install the signal handlers: {e}")))?;
    let rt = tokio::runtime::Handle::current();
    let scheduler = match rt.runtime_flavor() {
        tokio::runtime::RuntimeFlavor::CurrentThread => "current-thread",
        _ => "multi-thread",
    };
    tracing::info!(listen = %listener.local_addr()?, admin = %admin.local_addr()?, upstream = %config.upstream, max_connections = config.max_connections, max_upstream_connections = config.max_upstream_connections, scheduler, workers = rt.metrics().num_workers(), "mcp-reattach started");
    let gateway = mcp_reattach::Gateway::new(config);
    let health = mcp_reattach::Health::new();
    // The admin listener answers until the drain is over.
    let admin_task = tokio::spawn(mcp_reattach::serve_admin(
        admin,
        health.clone(),
        gateway.clone(),
        access,
        shutdown.drained(),
    ));
    tokio::spawn(signals);
    let stop = shutdown.stop_accepting(health, args.drain_delay);
    // The accept loop runs on a worker, not on the thread blocked in `block_on`: a
    // connection's task then starts on the worker that accepted it, where a loop on this
    // thread woke a worker for every connection and was woken by one for every accept.
    match tokio::spawn(mcp_reattach::serve_gateway(listener, gateway, stop)).await {
        Ok(served) => served?,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
    let _ = admin_task.await;
    tracing::info!("stopped");
    Ok(())
}

/// The runtime's workers: `TOKIO_WORKER_THREADS` if set, else the CPUs this process may use
/// (`available_parallelism`: its affinity mask and its cgroup's CPU quota), except that two
/// CPUs get one worker too. With two, the gateway shares them with its server (a sidecar) or
/// its clients, and a second work-stealing worker cost more in wake-ups between threads than
/// it gave (bench/notes.md, "Figure: the runtime on one CPU").
fn worker_threads() -> usize {
    std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| {
            default_workers(std::thread::available_parallelism().map_or(1, |n| n.get()))
        })
}

/// One worker for up to two CPUs, else one per CPU.
fn default_workers(cpus: usize) -> usize {
    if cpus <= 2 {
        1
    } else {
        cpus
    }
}

/// Installs the signal handlers and returns the task that acts on them: SIGTERM asks for a
/// graceful shutdown, SIGINT for a quick one (also during a graceful one), and SIGHUP re-reads
/// the TLS certificate and key at once (the one thing that can be reloaded; everything else
/// needs a restart) and never stops the gateway: SIGHUP's default action would end the process
/// with every session, as an nginx or HAProxy habit of sending it to reload would.
#[cfg(unix)]
fn forward_signals(
    shutdown: Shutdown,
    tls: Option<ServerTls>,
) -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    Ok(async move {
        loop {
            tokio::select! {
                Some(()) = term.recv() => {
                    tracing::info!("SIGTERM: draining gracefully");
                    shutdown.request(Mode::Graceful);
                }
                Some(()) = int.recv() => {
                    tracing::info!("SIGINT: shutting down quickly");
                    shutdown.request(Mode::Quick);
                }
                Some(()) = hup.recv() => reload_on_sighup(tls.as_ref()),
                else => return,
            }
        }
    })
}

/// Ctrl-C asks for a quick shutdown.
#[cfg(not(unix))]
fn forward_signals(
    shutdown: Shutdown,
    _tls: Option<ServerTls>,
) -> std::io::Result<impl std::future::Future<Output = ()>> {
    Ok(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            shutdown.request(Mode::Quick);
        }
    })
}

/// SIGHUP: the TLS pair re-read now ([`ServerTls::reload_now`], whose own line gives the
/// reason for a refusal) and one line saying what came of it.
#[cfg(unix)]
fn reload_on_sighup(tls: Option<&ServerTls>) {
    let Some(tls) = tls else {
        tracing::info!("SIGHUP: nothing to reload (no --tls-cert; other settings need a restart); still serving");
        return;
    };
    match tls.reload_now() {
        Reload::Loaded => tracing::info!("SIGHUP: TLS certificate reloaded"),
        Reload::Unchanged => {
            tracing::info!("SIGHUP: TLS certificate and key unchanged; still serving them")
        }
        Reload::Refused => {
            tracing::info!("SIGHUP: new TLS certificate refused; still serving the previous one")
        }
    }
}

/// `mcp-reattach sessions list|show|end`: asks the admin listener, prints its answer.
async fn sessions(args: &config::SessionsArgs, gateway: &GatewayArgs) -> ExitCode {
    let token = match &gateway.admin_token_file {
        None => None,
        Some(path) => match std::fs::read(path) {
            Ok(t) => Some(t.trim_ascii().to_vec()),
            Err(e) => {
                eprintln!(
                    "error: cannot read '--admin-token-file' {}: {e}",
                    path.display()
                );
                return ExitCode::from(EX_USAGE);
            }
        },
    };
    let mut out = String::new();
    let result = mcp_reattach::run_sessions_command(args, token.as_deref(), &mut out).await;
    print!("{out}");
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `mcp-reattach demo`: the embedded legacy demo server on loopback, the gateway in front.
async fn demo(args: GatewayArgs) -> Result<(), StartError> {
    let upstream_listener = TcpListener::bind("127.0.0.1:0").await?;
    let upstream_addr = upstream_listener.local_addr()?;
    tokio::spawn(mcp_reattach::serve_demo_upstream(
        upstream_listener,
        std::future::pending(),
    ));
    let upstream: http::Uri = format!("http://{upstream_addr}")
        .parse()
        .map_err(|e| std::io::Error::other(format!("{e}")))?;
    let mut args = args;
    // The demo binds loopback unless told otherwise, so it never exposes anything.
    if args.listen == GatewayArgs::defaults().listen {
        args.listen = ([127, 0, 0, 1], 8080).into();
    }
    let config = Config::from_args(&args, upstream);
    println!(
        "mcp-reattach demo\n\
         \n  demo MCP server (legacy, no SSE ids, no event store): http://{upstream_addr}/mcp\
         \n  gateway in front of it:                              http://{listen}/mcp\
         \n  admin:                                               http://{admin}/healthz\
         \n\nTry it with any MCP client pointed at http://{listen}/mcp; the `countdown` tool\
         \nstreams progress slowly (steps, interval_ms). Cut the connection mid-call: the\
         \nclient resumes through the gateway and still gets every notification and the result.\
         \n\nOr by hand with curl:\
         \n  curl -si http://{listen}/mcp -H 'content-type: application/json' \\\
         \n    -H 'accept: application/json, text/event-stream' \\\
         \n    -d '{{\"jsonrpc\":\"2.0\",\"id\":0,\"method\":\"initialize\",\"params\":{{\"protocolVersion\":\"2025-11-25\",\"capabilities\":{{}},\"clientInfo\":{{\"name\":\"curl\",\"version\":\"0\"}}}}}}'\
         \n  # then, with the Mcp-Session-Id it returned, call the tool and interrupt curl mid-stream:\
         \n  curl -sN http://{listen}/mcp -H 'content-type: application/json' \\\
         \n    -H 'accept: application/json, text/event-stream' -H 'mcp-session-id: <ID>' \\\
         \n    -d '{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{{\"name\":\"countdown\",\"arguments\":{{\"steps\":20,\"interval_ms\":500}},\"_meta\":{{\"progressToken\":1}}}}}}'\
         \n  # and resume from the last `id:` you saw:\
         \n  curl -sN http://{listen}/mcp -H 'mcp-session-id: <ID>' -H 'last-event-id: <LAST ID>'\
         \n\nCtrl-C stops both.",
        listen = args.listen,
        admin = args.admin_listen,
    );
    run(config, &args).await
}

#[cfg(test)]
mod tests {
    use super::default_workers;

    #[test]
    fn two_cpus_get_one_worker_more_get_one_each() {
        let got: Vec<usize> = (1..=5).map(default_workers).collect();
        assert_eq!(got, [1, 1, 3, 4, 5]);
    }
}
