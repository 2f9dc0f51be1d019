//! Prometheus metrics: one [`Metrics`] value shared by every layer, encoded in the text
//! format by the admin listener. Counters are atomics, cheap enough for the hot path;
//! gauges of current state (sessions, clients, window sizes) are read from the registry at
//! scrape time, so they can never drift.
//!
//! Knows nothing of HTTP or sessions; callers say what happened.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

type Label = [(&'static str, &'static str); 1];
type Labels2 = [(&'static str, &'static str); 2];

/// `resumes_total` outcomes (docs/operations.md lists their meaning).
const RESUME_OUTCOMES: [&str; 11] = [
    "resumed",
    "reattached",
    "gap",
    "malformed_cursor",
    "foreign_cursor",
    "cursor_ahead",
    "stream_expired",
    "stream_ended",
    "unknown_session",
    "unauthorized",
    "duplicate_request",
];
/// `requests_rejected_total` reasons.
const REJECT_REASONS: [&str; 6] = [
    "bad_session_header",
    "body_too_large",
    "body_read",
    "body_timeout",
    "at_capacity",
    "origin_not_allowed",
];
/// `session_evictions_total` reasons.
const SESSION_EVICTION_REASONS: [&str; 5] = [
    "ttl",
    "delete",
    "upstream_404",
    "session_cap",
    "memory_budget",
];
/// `upstream_errors_total` kinds.
const UPSTREAM_ERROR_KINDS: [&str; 7] = [
    "connect",
    "request",
    "timeout",
    "stream",
    "invalid_event",
    "hold",
    "resume",
];
/// `connection_errors_total` kinds.
const CONNECTION_ERROR_KINDS: [&str; 7] = [
    "header_timeout",
    "head_too_large",
    "client_gone",
    "other",
    "plaintext_on_tls",
    "tls_handshake_timeout",
    "tls_handshake",
];

/// Every metric the gateway exports (names prefixed `mcp_reattach_`).
pub struct Metrics {
    registry: Registry,
    pub sessions: Gauge,
    pub attached_clients: Gauge,
    pub held_standalone_streams: Gauge,
    pub window_events: Gauge,
    pub window_bytes: Gauge,
    pub memory_used_bytes: Gauge,
    pub streams_attached: Counter,
    pub streams_detached: Counter,
    pub events_tagged: Counter,
    pub events_replayed: Counter,
    pub window_evictions: Counter,
    pub slow_consumer_detaches: Counter,
    pub stalled_closes: Counter,
    pub events_evicted_undelivered: Counter,
    pub upstream_pauses: Counter,
    pub upstream_paused_seconds: Counter<f64, AtomicU64>,
    pub connections: Gauge,
    pub connections_accepted: Counter,
    /// `--memory-budget`, so alerts can compare `window_bytes` with it.
    pub memory_budget_bytes: Gauge,
    /// Unix time the drain started (the gateway stopped accepting); 0 while serving.
    pub drain_started: Gauge<f64, AtomicU64>,
    /// How long the drain may take: `--drain-timeout` plus the final flush.
    pub drain_deadline: Gauge<f64, AtomicU64>,
    rejected: Family<Label, Counter>,
    connection_errors: Family<Label, Counter>,
    resumes: Family<Label, Counter>,
    session_evictions: Family<Label, Counter>,
    upstream_errors: Family<Label, Counter>,
    request_duration: Family<Labels2, Histogram>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("mcp_reattach");
        let m = Metrics {
            registry: Registry::default(),
            sessions: Gauge::default(),
            attached_clients: Gauge::default(),
            held_standalone_streams: Gauge::default(),
            window_events: Gauge::default(),
            window_bytes: Gauge::default(),
            memory_used_bytes: Gauge::default(),
            streams_attached: Counter::default(),
            streams_detached: Counter::default(),
            events_tagged: Counter::default(),
            events_replayed: Counter::default(),
            window_evictions: Counter::default(),
            slow_consumer_detaches: Counter::default(),
            stalled_closes: Counter::default(),
            events_evicted_undelivered: Counter::default(),
            upstream_pauses: Counter::default(),
            upstream_paused_seconds: Counter::default(),
            connections: Gauge::default(),
            connections_accepted: Counter::default(),
            memory_budget_bytes: Gauge::default(),
            drain_started: Gauge::default(),
            drain_deadline: Gauge::default(),
            rejected: Family::default(),
            connection_errors: Family::default(),
            resumes: Family::default(),
            session_evictions: Family::default(),
            upstream_errors: Family::default(),
            request_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0005, 2.0, 16))
            }),
        };
        registry.register(
            "build",
            "Build information",
            Info::new([("version", env!("CARGO_PKG_VERSION"))]),
        );
        registry.register(
            "sessions",
            "Sessions whose state the gateway holds",
            m.sessions.clone(),
        );
        registry.register(
            "attached_clients",
            "Clients attached to tagged streams",
            m.attached_clients.clone(),
        );
        registry.register(
            "held_standalone_streams",
            "Sessions whose standalone GET stream the gateway holds open upstream",
            m.held_standalone_streams.clone(),
        );
        registry.register(
            "window_events",
            "Events retained in all session windows",
            m.window_events.clone(),
        );
        registry.register_with_unit(
            "window",
            "Bytes retained in all session windows",
            Unit::Bytes,
            m.window_bytes.clone(),
        );
        registry.register_with_unit(
            "memory_used",
            "Bytes counted against --memory-budget: all windows plus oversized events held for their clients",
            Unit::Bytes,
            m.memory_used_bytes.clone(),
        );
        registry.register(
            "streams_attached",
            "Client attachments to tagged streams (new streams, resumes, live attaches)",
            m.streams_attached.clone(),
        );
        registry.register(
            "streams_detached",
            "Client attachments that ended or were cut",
            m.streams_detached.clone(),
        );
        registry.register(
            "events_tagged",
            "Upstream SSE events tagged with a gateway id",
            m.events_tagged.clone(),
        );
        registry.register(
            "events_replayed",
            "Retained events sent to resuming clients",
            m.events_replayed.clone(),
        );
        registry.register(
            "window_evictions",
            "Events evicted from session windows by the count or byte bound",
            m.window_evictions.clone(),
        );
        registry.register(
            "slow_consumer_detaches",
            "Clients detached because they stalled",
            m.slow_consumer_detaches.clone(),
        );
        registry.register(
            "stalled_closes",
            "Stalled clients whose body could not even be polled, closed: the HTTP/1.1 connection, or only the HTTP/2 stream",
            m.stalled_closes.clone(),
        );
        registry.register(
            "events_evicted_undelivered",
            "Events evicted before they were ever written to a client (0 unless a client made no progress for --stall-timeout, or the memory budget trimmed a window)",
            m.events_evicted_undelivered.clone(),
        );
        registry.register(
            "upstream_pauses",
            "Times an upstream stream was paused (flow control: the window held only events a client still needs)",
            m.upstream_pauses.clone(),
        );
        registry.register_with_unit(
            "upstream_paused",
            "Time upstream streams spent paused by flow control",
            Unit::Seconds,
            m.upstream_paused_seconds.clone(),
        );
        registry.register("resumes", "Resume requests by outcome", m.resumes.clone());
        registry.register(
            "connections",
            "Client connections open now (at most --max-connections)",
            m.connections.clone(),
        );
        registry.register(
            "connections_accepted",
            "Client connections accepted",
            m.connections_accepted.clone(),
        );
        registry.register_with_unit(
            "memory_budget",
            "The budget for all session windows together (--memory-budget)",
            Unit::Bytes,
            m.memory_budget_bytes.clone(),
        );
        registry.register_with_unit(
            "drain_started_timestamp",
            "Unix time the drain started (the gateway stopped accepting); 0 while serving",
            Unit::Seconds,
            m.drain_started.clone(),
        );
        registry.register_with_unit(
            "drain_deadline",
            "Longest the drain may take once started (--drain-timeout plus the final flush)",
            Unit::Seconds,
            m.drain_deadline.clone(),
        );
        registry.register(
            "requests_rejected",
            "Requests the gateway refused itself, by reason",
            m.rejected.clone(),
        );
        registry.register(
            "connection_errors",
            "Client connections closed on an error, by kind (header_timeout, head_too_large, other)",
            m.connection_errors.clone(),
        );
        registry.register(
            "session_evictions",
            "Sessions dropped, by reason",
            m.session_evictions.clone(),
        );
        registry.register(
            "upstream_errors",
            "Upstream failures, by kind",
            m.upstream_errors.clone(),
        );
        registry.register_with_unit(
            "request_duration",
            "Time from request to the end of the response (streams included), by method and status class",
            Unit::Seconds,
            m.request_duration.clone(),
        );
        // The label values alerts and dashboards select on exist from the start (at 0), so
        // `rate()` and `increase()` see the first occurrence and scrapes declare every family.
        for outcome in RESUME_OUTCOMES {
            let _ = m.resumes.get_or_create(&[("outcome", outcome)]);
        }
        for reason in REJECT_REASONS {
            let _ = m.rejected.get_or_create(&[("reason", reason)]);
        }
        for reason in SESSION_EVICTION_REASONS {
            let _ = m.session_evictions.get_or_create(&[("reason", reason)]);
        }
        for kind in UPSTREAM_ERROR_KINDS {
            let _ = m.upstream_errors.get_or_create(&[("kind", kind)]);
        }
        for kind in CONNECTION_ERROR_KINDS {
            let _ = m.connection_errors.get_or_create(&[("kind", kind)]);
        }
        Metrics { registry, ..m }
    }

    /// Counts a resume by its outcome (`resumed`, `gap`, `malformed_cursor`, ...).
    pub fn resume(&self, outcome: &'static str) {
        self.resumes.get_or_create(&[("outcome", outcome)]).inc();
    }

    /// Counts a request the gateway refused itself (`body_too_large`, `origin_not_allowed`, ...).
    pub fn rejected(&self, reason: &'static str) {
        self.rejected.get_or_create(&[("reason", reason)]).inc();
    }

    /// Counts a client connection that ended on an error.
    pub fn connection_error(&self, kind: &'static str) {
        self.connection_errors
            .get_or_create(&[("kind", kind)])
            .inc();
    }

    /// Counts a dropped session by reason (`ttl`, `delete`, `upstream_404`, `session_cap`).
    pub fn session_evicted(&self, reason: &'static str) {
        self.session_evictions
            .get_or_create(&[("reason", reason)])
            .inc();
    }

    /// Counts an upstream failure by kind (`connect`, `stream`, `invalid_event`).
    pub fn upstream_error(&self, kind: &'static str) {
        self.upstream_errors.get_or_create(&[("kind", kind)]).inc();
    }

    /// Records that the drain started now and may take `deadline`.
    pub fn drain_started(&self, deadline: std::time::Duration) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.drain_deadline.set(deadline.as_secs_f64());
        self.drain_started.set(now);
    }

    /// Records one finished request.
    pub fn request_done(&self, method: &http::Method, status: http::StatusCode, seconds: f64) {
        let method = match *method {
            http::Method::GET => "GET",
            http::Method::POST => "POST",
            http::Method::DELETE => "DELETE",
            http::Method::OPTIONS => "OPTIONS",
            _ => "other",
        };
        let class = match status.as_u16() {
            100..=199 => "1xx",
            200..=299 => "2xx",
            300..=399 => "3xx",
            400..=499 => "4xx",
            _ => "5xx",
        };
        self.request_duration
            .get_or_create(&[("method", method), ("status_class", class)])
            .observe(seconds);
    }

    /// The OpenMetrics text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// The classic Prometheus text format (0.0.4), which `promtool check metrics` and older
    /// scrapers read: the OpenMetrics exposition with counter and info families renamed to
    /// their sample names, `# UNIT` and `# EOF` left out.
    pub fn encode_prometheus(&self) -> String {
        to_prometheus_text(&self.encode())
    }
}

/// Converts prometheus-client's OpenMetrics text to the Prometheus 0.0.4 text format.
pub(crate) fn to_prometheus_text(open: &str) -> String {
    let mut out = String::with_capacity(open.len());
    let mut renamed: Option<(String, String)> = None;
    let mut help: Option<String> = None;
    for line in open.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            // Held until the TYPE line says whether the family is renamed.
            help = Some(rest.to_owned());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (new_name, new_kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                other => (name.to_owned(), other),
            };
            if let Some(h) = help.take() {
                let text = h.split_once(' ').map_or("", |(_, t)| t);
                out.push_str(&format!("# HELP {new_name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {new_name} {new_kind}\n"));
            renamed = (new_name != name).then(|| (name.to_owned(), new_name));
            continue;
        }
        if let Some((_, new)) = &renamed {
            // Counter families may also carry `_created` samples; keep only the main series.
            if !line.starts_with(new.as_str()) {
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_names_with_prefix_units_and_labels() {
        let m = Metrics::new();
        m.events_tagged.inc();
        m.resume("gap");
        m.session_evicted("ttl");
        m.request_done(&http::Method::POST, http::StatusCode::OK, 0.01);
        m.window_bytes.set(42);
        let text = m.encode();
        let classic = m.encode_prometheus();
        assert!(classic.contains("# TYPE mcp_reattach_events_tagged_total counter\nmcp_reattach_events_tagged_total 1"), "{classic}");
        assert!(
            classic.contains("# TYPE mcp_reattach_build_info gauge"),
            "{classic}"
        );
        assert!(!classic.contains("# EOF") && !classic.contains("# UNIT"));
        for needle in [
            "mcp_reattach_build_info{version=\"",
            "mcp_reattach_events_tagged_total 1",
            "mcp_reattach_resumes_total{outcome=\"gap\"} 1",
            "mcp_reattach_session_evictions_total{reason=\"ttl\"} 1",
            "mcp_reattach_window_bytes 42",
            "mcp_reattach_request_duration_seconds_bucket{le=",
            "method=\"POST\",status_class=\"2xx\"",
            "# EOF",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
    }
}
