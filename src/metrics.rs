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

/// Buckets of the request-latency histograms: 0.5 ms doubling to ~4.4 min (a tool call's
/// whole stream is one request).
const REQUEST_BUCKETS: u16 = 20;
/// Buckets of the stream-lifetime histogram: 1 s doubling to ~36 h.
const STREAM_BUCKETS: u16 = 18;
type Labels2 = [(&'static str, &'static str); 2];

/// The values of one label of a counter family, as an enum: a value the code counts is a
/// variant (a typo is a compile error), and [`LabelValue::ALL`] is what is pre-registered.
pub(crate) trait LabelValue: Copy + Send + Sync + 'static {
    /// The label's name.
    const KEY: &'static str;
    /// Every value, each exported at 0 from the start.
    const ALL: &'static [Self];
    /// The value as exported.
    fn as_str(self) -> &'static str;
    /// Its position in [`LabelValue::ALL`].
    fn index(self) -> usize;
}

/// Declares a [`LabelValue`] enum: its label name, then each variant with its exported value.
macro_rules! label_values {
    ($(#[$meta:meta])* $name:ident, $key:literal {
        $($(#[$vmeta:meta])* $variant:ident => $value:literal,)+
    }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in the order docs/operations.md lists them.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The value as exported.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $value,)+
                }
            }
        }

        impl LabelValue for $name {
            const KEY: &'static str = $key;
            const ALL: &'static [$name] = $name::ALL;
            fn as_str(self) -> &'static str {
                $name::as_str(self)
            }
            fn index(self) -> usize {
                // Fieldless, declared in `ALL`'s order.
                self as usize
            }
        }
    };
}

label_values! {
    /// `resumes_total{outcome}` (docs/operations.md lists their meaning).
    ResumeOutcome, "outcome" {
        Resumed => "resumed",
        /// A standalone cursor re-attached to its session.
        Reattached => "reattached",
        /// A retransmitted POST answered from its retained stream.
        Retransmission => "retransmission",
        Gap => "gap",
        MalformedCursor => "malformed_cursor",
        ForeignCursor => "foreign_cursor",
        CursorAhead => "cursor_ahead",
        StreamExpired => "stream_expired",
        StreamEnded => "stream_ended",
        UnknownSession => "unknown_session",
        Unauthorized => "unauthorized",
        DuplicateRequest => "duplicate_request",
    }
}

label_values! {
    /// `requests_rejected_total{reason}`.
    RejectReason, "reason" {
        BadSessionHeader => "bad_session_header",
        BodyTooLarge => "body_too_large",
        BodyRead => "body_read",
        BodyTimeout => "body_timeout",
        /// A body did not fit in what --max-buffered-request-bytes left.
        BodiesFull => "request_bodies_full",
        AtCapacity => "at_capacity",
        OriginNotAllowed => "origin_not_allowed",
        BadTarget => "bad_target",
        BadHost => "bad_host",
        Connect => "connect",
        /// A POST reused a request id in flight for another principal in its session.
        RequestInFlight => "request_in_flight",
        /// A request needed a new upstream connection at --max-upstream-connections, or its
        /// caller held its fair part of them.
        UpstreamConnections => "upstream_connections",
        /// A session already had --max-detached-calls calls running with no client.
        DetachedCalls => "detached_calls",
        /// A resume of a session or stream this replica does not hold, which the fleet's store
        /// did not answer for in time.
        StoreUnanswered => "store_unavailable",
    }
}

label_values! {
    /// Why a session's state was dropped: `session_evictions_total{reason}`.
    Eviction, "reason" {
        Ttl => "ttl",
        Delete => "delete",
        Upstream404 => "upstream_404",
        SessionCap => "session_cap",
        MemoryBudget => "memory_budget",
        /// An operator ended it (the admin listener's `DELETE /sessions/{id}`).
        Admin => "admin",
        /// Another replica of the fleet ended it and said so (`--store`): dropped here only.
        Fleet => "fleet",
    }
}

impl Eviction {
    /// Ended by the gateway alone (not by the upstream's 404, a `DELETE` it answered, or
    /// another replica): the upstream is asked to end it too, so it keeps no session the
    /// gateway no longer holds.
    pub(crate) fn ends_upstream(self) -> bool {
        match self {
            Eviction::SessionCap | Eviction::MemoryBudget | Eviction::Ttl | Eviction::Admin => true,
            Eviction::Delete | Eviction::Upstream404 | Eviction::Fleet => false,
        }
    }
}

label_values! {
    /// `upstream_errors_total{kind}`.
    UpstreamErrorKind, "kind" {
        Connect => "connect",
        Request => "request",
        Timeout => "timeout",
        Stream => "stream",
        InvalidEvent => "invalid_event",
        Hold => "hold",
        Resume => "resume",
    }
}

label_values! {
    /// `json_upgrades_total{answer}`: what the upstream's answer to a POST answered by the
    /// gateway's SSE stream (`--json-upgrade`) turned out to be.
    UpgradeAnswer, "answer" {
        /// A JSON body: served as the stream's event(s).
        Json => "json",
        /// An SSE stream after all: tagged as usual.
        Sse => "sse",
        /// Another status after the grace: a JSON-RPC error per request.
        Status => "status",
        /// No answer (connection failed): a JSON-RPC error per request.
        Failed => "failed",
    }
}

label_values! {
    /// `connection_errors_total{kind}`.
    ConnectionErrorKind, "kind" {
        HeaderTimeout => "header_timeout",
        HeadTooLarge => "head_too_large",
        ClientGone => "client_gone",
        Other => "other",
        PlaintextOnTls => "plaintext_on_tls",
        TlsHandshakeTimeout => "tls_handshake_timeout",
        TlsHandshake => "tls_handshake",
    }
}

/// A counter family with one label whose values are `L`, every value at 0 from the start (so
/// `rate()` and `increase()` see the first occurrence and scrapes declare every series).
/// Each value's counter is kept by its index: counting costs no hash of the label and no
/// lock of the family (bench/notes.md, "Figure: metrics by index").
struct Counters<L> {
    family: Family<Label, Counter>,
    counters: Box<[Counter]>,
    values: std::marker::PhantomData<L>,
}

impl<L: LabelValue> Counters<L> {
    fn new() -> Counters<L> {
        let family: Family<Label, Counter> = Family::default();
        let counters = L::ALL
            .iter()
            .map(|value| family.get_or_create(&[(L::KEY, value.as_str())]).clone())
            .collect();
        Counters {
            family,
            counters,
            values: std::marker::PhantomData,
        }
    }

    fn inc(&self, value: L) {
        self.counters[value.index()].inc();
    }
}

/// Handles to the series of a family, by the indices of their label values, each created in
/// the family on its first use: recording then costs an index, not a hash of the labels and
/// the family's lock (bench/notes.md, "Figure: metrics by index").
/// A series still appears in the exposition only once used, as with `get_or_create`.
struct Series<M> {
    slots: Box<[std::sync::OnceLock<M>]>,
    cols: usize,
}

impl<M: Clone> Series<M> {
    fn new(rows: usize, cols: usize) -> Series<M> {
        Series {
            slots: (0..rows * cols)
                .map(|_| std::sync::OnceLock::new())
                .collect(),
            cols,
        }
    }

    /// The series at `row`, `col`; `create` finds or makes it in the family the first time.
    fn get(&self, row: usize, col: usize, create: impl FnOnce() -> M) -> &M {
        self.slots[row * self.cols + col].get_or_init(create)
    }
}

/// The `status_class` label values, in [`status_class`]'s order.
const STATUS_CLASSES: usize = 5;
/// The `method` label values of `request_duration_seconds`, in [`http_method`]'s order.
const HTTP_METHODS: usize = 5;

/// Every metric the gateway exports (names prefixed `mcp_reattach_`).
pub struct Metrics {
    registry: Registry,
    pub sessions: Gauge,
    pub attached_clients: Gauge,
    pub held_standalone_streams: Gauge,
    pub window_events: Gauge,
    pub window_bytes: Gauge,
    pub memory_used_bytes: Gauge,
    /// Bytes of request bodies held now (at most --max-buffered-request-bytes).
    pub buffered_request_bytes: Gauge,
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
    /// Upstream connections open now, pooled idle ones included.
    pub upstream_connections: Gauge,
    /// `--max-upstream-connections` as fitted to the open-file limit.
    pub upstream_connections_max: Gauge,
    /// Sessions the gateway minted for a stateless upstream.
    pub sessions_minted: Counter,
    /// The fleet's store (`--store`): sessions adopted from it, writes done, requests to it
    /// that failed or timed out, event bytes dropped from its queue, resumes it served and
    /// the gaps among them.
    pub store_adoptions: Counter,
    pub store_writes: Counter,
    pub store_errors: Counter,
    /// Awaited requests to the store not sent: too many were ahead of them for too long.
    pub store_busy: Counter,
    pub store_dropped_bytes: Counter,
    pub store_dropped_writes: Counter,
    pub store_follows: Counter,
    pub store_follow_gaps: Counter,
    pub store_owners_lost: Counter,
    /// 1 while the fleet's store answers (or none is configured), 0 while it is down.
    pub store_up: Gauge,
    /// `--memory-budget`, so alerts can compare `window_bytes` with it.
    pub memory_budget_bytes: Gauge,
    /// Unix time the drain started (the gateway stopped accepting); 0 while serving.
    pub drain_started: Gauge<f64, AtomicU64>,
    /// How long the drain may take: `--drain-timeout` plus the final flush.
    pub drain_deadline: Gauge<f64, AtomicU64>,
    rejected: Counters<RejectReason>,
    connection_errors: Counters<ConnectionErrorKind>,
    resumes: Counters<ResumeOutcome>,
    session_evictions: Counters<Eviction>,
    upstream_errors: Counters<UpstreamErrorKind>,
    json_upgrades: Counters<UpgradeAnswer>,
    request_duration: Family<Labels2, Histogram>,
    /// Lifetimes of GET SSE streams (standalone streams, resumes): hours, not milliseconds.
    stream_duration: Histogram,
    /// Upstream time to the response head.
    upstream_response_time: Histogram,
    /// Per MCP method (`jsonrpc::METHODS`): POSTs by status class, and their durations.
    mcp_requests: Family<Labels2, Counter>,
    mcp_request_duration: Family<Label, Histogram>,
    /// `tools/call`s per tool, for at most `tool_names` distinct names (the rest `other`).
    tool_calls: Family<[(&'static str, ToolLabel); 1], Counter>,
    /// The series of `request_duration`, `mcp_requests` and `mcp_request_duration`, by index.
    request_duration_by: Series<Histogram>,
    mcp_requests_by: Series<Counter>,
    mcp_request_duration_by: Series<Histogram>,
    /// The names holding a `tool` label value: each took its slot when the upstream first
    /// answered a call of it with success.
    tool_names: std::sync::Mutex<std::collections::HashSet<String>>,
    tool_names_max: std::sync::atomic::AtomicUsize,
}

/// The longest tool name that gets a `tool` label value of its own.
const TOOL_NAME_MAX: usize = 128;

/// Whether `tool` may be a `tool` label value: a name of visible ASCII without quotes or
/// backslashes, as tool names are, and no longer than [`TOOL_NAME_MAX`]. Any other is the
/// client's text, not a tool's name, and counts as `other`.
fn labelable(tool: &str) -> bool {
    !tool.is_empty()
        && tool.len() <= TOOL_NAME_MAX
        && tool
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
}

/// A `tool` label value: a tool name, which is a client's text, so escaped as both text
/// formats say (prometheus-client writes label values as they are) even though only
/// [`labelable`] names become one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ToolLabel(Box<str>);

impl prometheus_client::encoding::EncodeLabelValue for ToolLabel {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use std::fmt::Write as _;
        let mut rest = &*self.0;
        while let Some(i) = rest.find(['\\', '"', '\n']) {
            encoder.write_str(&rest[..i])?;
            encoder.write_str(match rest.as_bytes()[i] {
                b'\\' => "\\\\",
                b'"' => "\\\"",
                _ => "\\n",
            })?;
            rest = &rest[i + 1..];
        }
        encoder.write_str(rest)
    }
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
            buffered_request_bytes: Gauge::default(),
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
            upstream_connections: Gauge::default(),
            upstream_connections_max: Gauge::default(),
            sessions_minted: Counter::default(),
            store_adoptions: Counter::default(),
            store_writes: Counter::default(),
            store_errors: Counter::default(),
            store_busy: Counter::default(),
            store_dropped_bytes: Counter::default(),
            store_dropped_writes: Counter::default(),
            store_follows: Counter::default(),
            store_follow_gaps: Counter::default(),
            store_owners_lost: Counter::default(),
            store_up: Gauge::default(),
            memory_budget_bytes: Gauge::default(),
            drain_started: Gauge::default(),
            drain_deadline: Gauge::default(),
            rejected: Counters::new(),
            connection_errors: Counters::new(),
            resumes: Counters::new(),
            session_evictions: Counters::new(),
            upstream_errors: Counters::new(),
            json_upgrades: Counters::new(),
            request_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0005, 2.0, REQUEST_BUCKETS))
            }),
            stream_duration: Histogram::new(exponential_buckets(1.0, 2.0, STREAM_BUCKETS)),
            upstream_response_time: Histogram::new(exponential_buckets(
                0.0005,
                2.0,
                REQUEST_BUCKETS,
            )),
            mcp_requests: Family::default(),
            mcp_request_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0005, 2.0, REQUEST_BUCKETS))
            }),
            tool_calls: Family::default(),
            request_duration_by: Series::new(HTTP_METHODS, STATUS_CLASSES),
            mcp_requests_by: Series::new(crate::jsonrpc::METHODS.len(), STATUS_CLASSES),
            mcp_request_duration_by: Series::new(crate::jsonrpc::METHODS.len(), 1),
            tool_names: Default::default(),
            tool_names_max: Default::default(),
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
        registry.register_with_unit(
            "buffered_request",
            "Bytes of request bodies held now, being read or on their way upstream (at most --max-buffered-request-bytes)",
            Unit::Bytes,
            m.buffered_request_bytes.clone(),
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
            "Events evicted before a client had them: never written to one (a client made no progress for --stall-timeout, or the memory budget trimmed a window), or written and lost in flight past the reserve (counted at the resume that shows it)",
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
        registry.register(
            "resumes",
            "Resume requests by outcome",
            m.resumes.family.clone(),
        );
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
        registry.register(
            "upstream_connections",
            "Upstream connections open now, pooled idle ones included (at most --max-upstream-connections)",
            m.upstream_connections.clone(),
        );
        registry.register(
            "upstream_connections_max",
            "The bound on upstream connections (--max-upstream-connections, fitted to the open-file limit)",
            m.upstream_connections_max.clone(),
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
            m.rejected.family.clone(),
        );
        registry.register(
            "connection_errors",
            "Client connections closed on an error, by kind",
            m.connection_errors.family.clone(),
        );
        registry.register(
            "session_evictions",
            "Sessions dropped, by reason",
            m.session_evictions.family.clone(),
        );
        registry.register(
            "upstream_errors",
            "Upstream failures, by kind",
            m.upstream_errors.family.clone(),
        );
        registry.register(
            "sessions_minted",
            "Sessions whose id the gateway minted because the upstream answered initialize without one (a stateless server)",
            m.sessions_minted.clone(),
        );
        registry.register(
            "store_up",
            "1 while the fleet's store (--store) answers this replica, 0 while it is down (the replica serves what it holds)",
            m.store_up.clone(),
        );
        for (name, help, c) in [
            ("store_adoptions", "Sessions this replica adopted from the fleet's store", &m.store_adoptions),
            ("store_writes", "Writes (publications, touches, tombstones) the fleet's store took", &m.store_writes),
            ("store_errors", "Requests to the fleet's store that failed or timed out", &m.store_errors),
            ("store_busy", "Requests to the fleet's store not sent: too many of this replica's were ahead of them for a second (a resume gets 503 + Retry-After)", &m.store_busy),
            ("store_dropped_bytes", "Event bytes not written to the fleet's store: its queue was full (a resume elsewhere gets the explicit gap)", &m.store_dropped_bytes),
            ("store_dropped_writes", "Writes not queued for the fleet's store: its queue held its bound of writes (events and touches first; a stream's facts past twice the bound)", &m.store_dropped_writes),
            ("store_follows", "Resumes served from the fleet's store (a stream another replica reads)", &m.store_follows),
            ("store_follow_gaps", "Resumes from the fleet's store that ended with the explicit gap", &m.store_follow_gaps),
            ("store_owners_lost", "Resumes from the fleet's store whose stream's owner (the replica reading it upstream) was gone: ended with the explicit upstream failure", &m.store_owners_lost),
        ] {
            registry.register(name, help, c.clone());
        }
        registry.register(
            "json_upgrades",
            "POSTs answered with the gateway's SSE stream (--json-upgrade), by what the upstream answered",
            m.json_upgrades.family.clone(),
        );
        registry.register_with_unit(
            "stream_duration",
            "Lifetime of GET SSE streams (standalone streams and resumes), from the request to the stream's end or the client leaving",
            Unit::Seconds,
            m.stream_duration.clone(),
        );
        registry.register_with_unit(
            "upstream_response_time",
            "Time from sending a request upstream to the upstream's response head",
            Unit::Seconds,
            m.upstream_response_time.clone(),
        );
        registry.register(
            "mcp_requests",
            "POSTs by MCP method (the first message's; batch for several) and HTTP status class",
            m.mcp_requests.clone(),
        );
        registry.register_with_unit(
            "mcp_request_duration",
            "Time from a POST to the end of its response (a call's whole stream), by MCP method",
            Unit::Seconds,
            m.mcp_request_duration.clone(),
        );
        registry.register(
            "tool_calls",
            "tools/call POSTs by tool, for the first --metrics-tool-names names the upstream answered with success (the rest: other)",
            m.tool_calls.clone(),
        );
        registry.register_with_unit(
            "request_duration",
            "Time from request to the end of the response (a POST's SSE answer included; GET streams are in stream_duration), by method and status class",
            Unit::Seconds,
            m.request_duration.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Counts a resume by its outcome.
    pub fn resume(&self, outcome: ResumeOutcome) {
        self.resumes.inc(outcome);
    }

    /// Counts a request the gateway refused itself.
    pub fn rejected(&self, reason: RejectReason) {
        self.rejected.inc(reason);
    }

    /// Counts a client connection that ended on an error.
    pub fn connection_error(&self, kind: ConnectionErrorKind) {
        self.connection_errors.inc(kind);
    }

    /// Counts a dropped session by reason.
    pub fn session_evicted(&self, reason: Eviction) {
        self.session_evictions.inc(reason);
    }

    /// Counts an upstream failure by kind.
    pub fn upstream_error(&self, kind: UpstreamErrorKind) {
        self.upstream_errors.inc(kind);
    }

    /// Counts a POST answered with the gateway's SSE stream by what the upstream answered.
    pub fn json_upgrade(&self, answer: UpgradeAnswer) {
        self.json_upgrades.inc(answer);
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
        let (m, method) = http_method(method);
        let (c, class) = status_class(status);
        self.request_duration_by
            .get(m, c, || {
                self.request_duration
                    .get_or_create(&[("method", method), ("status_class", class)])
                    .clone()
            })
            .observe(seconds);
    }

    /// A GET SSE stream ended after `seconds`.
    pub fn stream_done(&self, seconds: f64) {
        self.stream_duration.observe(seconds);
    }

    /// The upstream answered a request with its head after `seconds`.
    pub fn upstream_answered(&self, seconds: f64) {
        self.upstream_response_time.observe(seconds);
    }

    /// A POST of MCP method `method` (a [`crate::jsonrpc::METHODS`] label) ended with
    /// `status` after `seconds`; `tool` is the tool of a `tools/call`, and `succeeded` says
    /// whether the upstream answered it with success (only then may its name take one of the
    /// `tool` label's slots: names a client makes up must not keep the real tools out).
    pub fn mcp_request_done(
        &self,
        method: &'static str,
        tool: Option<&str>,
        succeeded: bool,
        status: http::StatusCode,
        seconds: f64,
    ) {
        let (c, class) = status_class(status);
        // A label that is not one of METHODS (none is passed) counts as `other`.
        let (m, method) = crate::jsonrpc::METHODS
            .iter()
            .position(|&m| m == method)
            .map_or((crate::jsonrpc::METHODS.len() - 1, "other"), |m| {
                (m, crate::jsonrpc::METHODS[m])
            });
        self.mcp_requests_by
            .get(m, c, || {
                self.mcp_requests
                    .get_or_create(&[("method", method), ("status_class", class)])
                    .clone()
            })
            .inc();
        self.mcp_request_duration_by
            .get(m, 0, || {
                self.mcp_request_duration
                    .get_or_create(&[("method", method)])
                    .clone()
            })
            .observe(seconds);
        if let Some(tool) = tool {
            self.tool_called(tool, succeeded);
        }
    }

    /// Counts a `tools/call` of `tool` under its name if that name holds a slot, or takes a
    /// free one now (`succeeded`, and a [`labelable`] name); else under `other`.
    fn tool_called(&self, tool: &str, succeeded: bool) {
        let max = self
            .tool_names_max
            .load(std::sync::atomic::Ordering::Relaxed);
        if max == 0 {
            return;
        }
        let named = labelable(tool) && {
            let mut seen = self.tool_names.lock().unwrap_or_else(|e| e.into_inner());
            seen.contains(tool) || (succeeded && seen.len() < max && seen.insert(tool.to_owned()))
        };
        let label = ToolLabel(if named { tool } else { "other" }.into());
        self.tool_calls.get_or_create(&[("tool", label)]).inc();
    }

    /// Counts `tools/call`s per tool for at most `max` distinct tool names (0: not at all).
    pub fn set_tool_names(&self, max: usize) {
        self.tool_names_max
            .store(max, std::sync::atomic::Ordering::Relaxed);
    }

    /// The OpenMetrics text exposition of every metric, the process's own (`process_*`,
    /// unprefixed, as every Prometheus client library names them) included.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        if let Some(body) = out.strip_suffix("# EOF\n") {
            let mut with = body.to_owned();
            process_metrics(&mut with);
            with.push_str("# EOF\n");
            out = with;
        }
        out
    }

    /// The classic Prometheus text format (0.0.4), which `promtool check metrics` and older
    /// scrapers read: the OpenMetrics exposition with counter and info families renamed to
    /// their sample names, `# UNIT` and `# EOF` left out.
    pub fn encode_prometheus(&self) -> String {
        to_prometheus_text(&self.encode())
    }
}

/// Appends the standard `process_*` metrics (read from `/proc/self`) in OpenMetrics text:
/// CPU seconds, resident and virtual memory, open and maximum fds, threads, start time.
/// Nothing where `/proc` cannot be read (not Linux).
fn process_metrics(out: &mut String) {
    use std::fmt::Write as _;
    // Clock ticks of /proc's times: USER_HZ, 100 on every Linux architecture.
    const TICKS: f64 = 100.0;
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // The fields after the command (which may hold spaces) in parentheses.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // Fields 14, 15 (utime, stime) and 22 (starttime), counted from 1 with pid and comm.
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
    };
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    });
    let fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as f64)
        .ok();
    let max_fds = rlimit::getrlimit(rlimit::Resource::NOFILE)
        .ok()
        .map(|(soft, _)| soft as f64);
    let mut family = |name: &str, kind: &str, unit: Option<&str>, help: &str, v: Option<f64>| {
        let Some(v) = v else { return };
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        if let Some(u) = unit {
            let _ = writeln!(out, "# UNIT {name} {u}");
        }
        let sample = if kind == "counter" { "_total" } else { "" };
        let _ = writeln!(out, "{name}{sample} {v}");
    };
    let cpu = field(14).zip(field(15)).map(|(u, s)| (u + s) / TICKS);
    family(
        "process_cpu_seconds",
        "counter",
        Some("seconds"),
        "Total user and system CPU time spent in seconds.",
        cpu,
    );
    family(
        "process_resident_memory_bytes",
        "gauge",
        Some("bytes"),
        "Resident memory size in bytes.",
        kib("VmRSS:").map(|k| k * 1024.0),
    );
    family(
        "process_virtual_memory_bytes",
        "gauge",
        Some("bytes"),
        "Virtual memory size in bytes.",
        kib("VmSize:").map(|k| k * 1024.0),
    );
    family(
        "process_open_fds",
        "gauge",
        None,
        "Number of open file descriptors.",
        fds,
    );
    family(
        "process_max_fds",
        "gauge",
        None,
        "Maximum number of open file descriptors.",
        max_fds,
    );
    family(
        "process_threads",
        "gauge",
        None,
        "Number of OS threads in the process.",
        kib("Threads:"),
    );
    let start = boot.zip(field(22)).map(|(b, t)| b + t / TICKS);
    family(
        "process_start_time_seconds",
        "gauge",
        Some("seconds"),
        "Start time of the process since unix epoch in seconds.",
        start,
    );
}

/// The `status_class` label of a status.
/// The `status_class` label of `status`, with its index (below [`STATUS_CLASSES`]).
fn status_class(status: http::StatusCode) -> (usize, &'static str) {
    match status.as_u16() {
        100..=199 => (0, "1xx"),
        200..=299 => (1, "2xx"),
        300..=399 => (2, "3xx"),
        400..=499 => (3, "4xx"),
        _ => (4, "5xx"),
    }
}

/// The `method` label of an HTTP method, with its index (below [`HTTP_METHODS`]).
fn http_method(method: &http::Method) -> (usize, &'static str) {
    match *method {
        http::Method::GET => (0, "GET"),
        http::Method::POST => (1, "POST"),
        http::Method::DELETE => (2, "DELETE"),
        http::Method::OPTIONS => (3, "OPTIONS"),
        _ => (4, "other"),
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

    /// Each labelled counter family's exported name and the values of its label.
    fn labelled() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
        fn of<L: LabelValue>(
            family: &'static str,
        ) -> (&'static str, &'static str, Vec<&'static str>) {
            (family, L::KEY, L::ALL.iter().map(|v| v.as_str()).collect())
        }
        vec![
            of::<ResumeOutcome>("resumes_total"),
            of::<RejectReason>("requests_rejected_total"),
            of::<Eviction>("session_evictions_total"),
            of::<UpstreamErrorKind>("upstream_errors_total"),
            of::<ConnectionErrorKind>("connection_errors_total"),
            of::<UpgradeAnswer>("json_upgrades_total"),
        ]
    }

    #[test]
    fn every_label_value_is_exported_at_zero_from_the_start() {
        let m = Metrics::new();
        for text in [m.encode(), m.encode_prometheus()] {
            for (family, key, values) in labelled() {
                for value in values {
                    let series = format!("mcp_reattach_{family}{{{key}=\"{value}\"}} 0\n");
                    assert!(text.contains(&series), "missing {series:?} in\n{text}");
                }
            }
        }
    }

    /// Each value counted goes to its own series (the counters are kept by index): the i-th
    /// value of every family counted i + 1 times reads back as such.
    #[test]
    fn each_value_counts_on_its_own_series() {
        fn count<L: LabelValue>(c: &Counters<L>) {
            for (i, &v) in L::ALL.iter().enumerate() {
                for _ in 0..=i {
                    c.inc(v);
                }
            }
        }
        let m = Metrics::new();
        count(&m.resumes);
        count(&m.rejected);
        count(&m.session_evictions);
        count(&m.upstream_errors);
        count(&m.connection_errors);
        count(&m.json_upgrades);
        let text = m.encode_prometheus();
        for (family, key, values) in labelled() {
            for (i, value) in values.iter().enumerate() {
                let series = format!("mcp_reattach_{family}{{{key}=\"{value}\"}} {}\n", i + 1);
                assert!(text.contains(&series), "missing {series:?} in\n{text}");
            }
        }
    }

    #[test]
    fn label_values_are_unique_snake_case() {
        for (family, _, values) in labelled() {
            let unique: std::collections::BTreeSet<_> = values.iter().collect();
            assert_eq!(unique.len(), values.len(), "{family}: {values:?}");
            for v in values {
                assert!(
                    v.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                    "{family}: {v}"
                );
            }
        }
    }

    /// docs/operations.md's metric table names every exported series and every label value.
    #[test]
    fn operations_md_lists_every_series_and_label_value() {
        let doc = include_str!("../docs/operations.md");
        let table: String = doc
            .split("\n## Metrics\n")
            .nth(1)
            .and_then(|rest| rest.split("\nQueries worth a panel").next())
            .expect("the Metrics section")
            .to_owned();
        let classic = Metrics::new().encode_prometheus();
        let mut process = 0;
        for line in classic.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let name = rest.split(' ').next().unwrap();
            let name = name.strip_prefix("mcp_reattach_").unwrap_or_else(|| {
                process += 1;
                name
            });
            assert!(
                table.contains(&format!("| `{name}` |")),
                "operations.md's metric tables lack `{name}`"
            );
        }
        #[cfg(target_os = "linux")]
        assert_eq!(process, 7, "the process metrics are exported:\n{classic}");
        for (family, _, values) in labelled() {
            for v in values {
                assert!(
                    table.contains(&format!("`{v}`")),
                    "operations.md's Metrics section lacks {family} value `{v}`"
                );
            }
        }
    }

    /// Tool names are a client's text (issue 46): one that is not a plain name never becomes
    /// a label value, and a name takes one of the slots only with a call the upstream
    /// answered with success; a name holding one counts every call of it.
    #[test]
    fn tool_names_take_a_slot_only_when_plain_and_answered() {
        let m = Metrics::new();
        m.set_tool_names(2);
        let call = |tool: &str, succeeded| {
            m.mcp_request_done(
                "tools/call",
                Some(tool),
                succeeded,
                http::StatusCode::OK,
                0.1,
            )
        };
        call("x\"} 1\nmcp_reattach_sessions 31337\n# \u{1b}[2J", true);
        call("made_up", false);
        call("back\\slash", true);
        call("", true);
        call(&"long".repeat(TOOL_NAME_MAX), true);
        call("search", true);
        call("made_up", false);
        call("search", false);
        call("fetch", true);
        call("third", true);
        for text in [m.encode(), m.encode_prometheus()] {
            let tools: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("mcp_reattach_tool_calls_total{"))
                .collect();
            let mut want = [
                "mcp_reattach_tool_calls_total{tool=\"fetch\"} 1",
                "mcp_reattach_tool_calls_total{tool=\"other\"} 7",
                "mcp_reattach_tool_calls_total{tool=\"search\"} 2",
            ];
            let mut tools = tools;
            tools.sort_unstable();
            want.sort_unstable();
            assert_eq!(tools, want, "{text}");
            assert!(!text.contains("31337"), "{text}");
        }
    }

    /// A `tool` label value is escaped as both text formats say, whatever it holds.
    #[test]
    fn tool_label_values_are_escaped() {
        let family: Family<[(&'static str, ToolLabel); 1], Counter> = Family::default();
        family
            .get_or_create(&[("tool", ToolLabel("a\"b\\c\nd\"} 1".into()))])
            .inc();
        let mut registry = Registry::default();
        registry.register("t", "t", family);
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        assert!(
            out.contains("\nt_total{tool=\"a\\\"b\\\\c\\nd\\\"} 1\"} 1\n"),
            "{out}"
        );
        assert_eq!(out.lines().filter(|l| l.starts_with("t_total")).count(), 1);
    }

    #[test]
    fn encodes_names_with_prefix_units_and_labels() {
        let m = Metrics::new();
        m.events_tagged.inc();
        m.resume(ResumeOutcome::Gap);
        m.session_evicted(Eviction::Ttl);
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
