//! OpenTelemetry traces (issue 24): spans of the request path exported over OTLP/HTTP
//! (protobuf), and the W3C trace context continued from the client and propagated upstream.
//!
//! Off unless the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`
//! is set (or `--otlp-traces true`); the other standard variables are honoured by the
//! OpenTelemetry SDK and exporter (`OTEL_EXPORTER_OTLP_HEADERS`, `_TIMEOUT`, `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_SCHEDULE_DELAY`, ...). Off, nothing here runs on the
//! request path but one relaxed load ([`enabled`]): the spans stay the `debug` spans they
//! always were, disabled at the default log level.
//!
//! The spans: `request` (kind server; from the request to the end of its response body, a
//! stream's whole life, with its events, bytes and outcome), `upstream` (kind client; the
//! exchange with the MCP server, whose `traceparent` names it), and for a resume the request's
//! parent is the span of the request that opened the stream (same trace) unless the client sent
//! a `traceparent` of its own (then a link to it).
//!
//! Knows the OpenTelemetry crates and HTTP headers; nothing of sessions beyond [`TraceParent`].

use std::sync::atomic::{AtomicBool, Ordering};

use http::header::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    SpanContext, TraceContextExt, TraceFlags, TraceState, TracerProvider as _,
};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub(crate) use crate::session::TraceParent;

static ON: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported (set once at startup).
pub(crate) fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Whether the environment asks for trace export: the standard OTLP endpoint variables.
pub fn wanted_by_env() -> bool {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()))
}

/// The running exporter: flushes what is left and stops when dropped (at exit).
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// Why traces cannot be exported as configured.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTEL_EXPORTER_OTLP_PROTOCOL={0:?} is not supported: the gateway exports OTLP over HTTP with protobuf (http/protobuf, port 4318)")]
    Protocol(String),
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(String),
}

/// Starts the OTLP exporter and returns the tracing layer that feeds it (spans of this crate
/// and WARN or worse events), or why not. Sets [`enabled`].
pub fn layer<S>() -> Result<(impl tracing_subscriber::Layer<S>, Exporter), TelemetryError>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    for var in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Ok(p) = std::env::var(var) {
            if !p.is_empty() && p != "http/protobuf" {
                return Err(TelemetryError::Protocol(p));
            }
        }
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(
            std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "mcp-reattach".into()),
        )
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("mcp-reattach");
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    ON.store(true, Ordering::Relaxed);
    let filter = tracing_subscriber::filter::filter_fn(|m| {
        if m.is_span() {
            // Not the connection's span: a keep-alive connection is no trace of its own, and
            // a request without a traceparent starts a new trace.
            m.target().starts_with("mcp_reattach") && m.name() != "connection"
        } else {
            *m.level() <= tracing::Level::WARN
        }
    });
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_threads(false)
        .with_location(false)
        // Entering a span does not start it: a resume sets its parent (the call's span)
        // inside its request's span, before anything needs its context.
        .with_context_activation(false)
        .with_filter(filter);
    Ok((layer, Exporter { provider }))
}

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct HeadersMut<'a>(&'a mut HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// Continues the client's trace: `span` (a request's) becomes a child of the `traceparent`
/// in `headers`, if there is a valid one. Whether there was.
pub(crate) fn continue_from(span: &tracing::Span, headers: &HeaderMap) -> bool {
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    if !cx.span().span_context().is_valid() {
        return false;
    }
    let _ = span.set_parent(cx);
    true
}

/// Writes `span`'s context as the request's `traceparent` (and `tracestate`), replacing the
/// client's: the upstream's spans become children of the gateway's.
pub(crate) fn inject(span: &tracing::Span, headers: &mut HeaderMap) {
    let cx = span.context();
    TraceContextPropagator::new().inject_context(&cx, &mut HeadersMut(headers));
}

/// The current span's context when traces are exported: what a stream opened now keeps.
pub(crate) fn current() -> Option<TraceParent> {
    if !enabled() {
        return None;
    }
    context_of(&tracing::Span::current())
}

/// `span`'s own context, to be remembered (by a stream, for the resumes of it).
pub(crate) fn context_of(span: &tracing::Span) -> Option<TraceParent> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| TraceParent {
        trace_id: u128::from_be_bytes(sc.trace_id().to_bytes()),
        span_id: u64::from_be_bytes(sc.span_id().to_bytes()),
        sampled: sc.is_sampled(),
    })
}

/// A resume's `span` joins the trace of the request that opened its stream (`opened`): as
/// its child, or, when the client continued a trace of its own (`client_trace`), by a link.
pub(crate) fn join(span: &tracing::Span, opened: TraceParent, client_trace: bool) {
    let sc = SpanContext::new(
        opentelemetry::trace::TraceId::from_bytes(opened.trace_id.to_be_bytes()),
        opentelemetry::trace::SpanId::from_bytes(opened.span_id.to_be_bytes()),
        if opened.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        },
        true,
        TraceState::default(),
    );
    if client_trace {
        span.add_link(sc);
    } else {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
    }
}
