//! One access-log line and one duration sample per finished request or stream, emitted when
//! the response body ends or is dropped (completed, or cut by the client), never earlier.
//!
//! Knows hyper's `Body` trait and the metrics; never sees payloads, raw session ids or
//! credentials.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use http::{Method, StatusCode};
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::session::Outcome;

/// Counters an SSE body updates while it runs, read by its [`AccessLog`] at the end.
#[derive(Debug, Default)]
pub struct StreamStats {
    events: AtomicU64,
    replayed: AtomicU64,
    /// Set once, when the body decides how the stream ends (the first reason wins).
    outcome: OnceLock<Outcome>,
}

impl StreamStats {
    pub fn new(replayed: u64) -> Arc<StreamStats> {
        Arc::new(StreamStats {
            replayed: AtomicU64::new(replayed),
            ..StreamStats::default()
        })
    }

    pub fn add_events(&self, n: u64) {
        self.events.fetch_add(n, Ordering::Relaxed);
    }

    pub fn set_outcome(&self, o: Outcome) {
        let _ = self.outcome.set(o);
    }

    fn outcome(&self) -> Option<Outcome> {
        self.outcome.get().copied()
    }
}

/// What is known of a request when its response starts.
#[derive(Debug)]
pub struct AccessLog {
    pub method: Method,
    pub status: StatusCode,
    pub start: Instant,
    /// Hashed session id, if any.
    pub session: Option<String>,
    pub stream: Option<Arc<StreamStats>>,
    pub metrics: Arc<Metrics>,
    bytes: u64,
    ended: bool,
}

impl AccessLog {
    pub fn new(
        method: Method,
        status: StatusCode,
        start: Instant,
        session: Option<String>,
        stream: Option<Arc<StreamStats>>,
        metrics: Arc<Metrics>,
    ) -> AccessLog {
        AccessLog {
            method,
            status,
            start,
            session,
            stream,
            metrics,
            bytes: 0,
            ended: false,
        }
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        let elapsed = self.start.elapsed();
        self.metrics
            .request_done(&self.method, self.status, elapsed.as_secs_f64());
        let outcome = match (&self.stream, self.ended) {
            (Some(s), _) => s.outcome().map_or("detached", Outcome::as_str),
            (None, true) => "completed",
            (None, false) => "cancelled",
        };
        let (events, replayed) = self.stream.as_ref().map_or((0, 0), |s| {
            (
                s.events.load(Ordering::Relaxed),
                s.replayed.load(Ordering::Relaxed),
            )
        });
        let line = Line {
            method: self.method.as_str(),
            status: self.status.as_u16(),
            duration_ms: elapsed.as_millis() as u64,
            bytes: self.bytes,
            events,
            replayed,
            outcome,
            session: self.session.as_deref().unwrap_or("-"),
        };
        match SINK.get() {
            Some(sink) if tracing::enabled!(tracing::Level::INFO) => sink.write(&line),
            Some(_) => {}
            None => tracing::info!(
                http.method = line.method,
                http.status = line.status,
                duration_ms = line.duration_ms,
                bytes = line.bytes,
                events = line.events,
                replayed = line.replayed,
                outcome = line.outcome,
                mcp.session = line.session,
                "request finished"
            ),
        }
    }
}

/// The fields of one access line.
struct Line<'a> {
    method: &'a str,
    status: u16,
    duration_ms: u64,
    bytes: u64,
    events: u64,
    replayed: u64,
    outcome: &'static str,
    session: &'a str,
}

/// Where the binary writes access lines: the log's own writer, formatted here. One line per
/// request through tracing-subscriber's formatter (field visitors, `Debug` of every value)
/// was a sixth of a small POST's CPU; these fields are few, fixed and need no escaping
/// (a method token, numbers, a static outcome, a hex hash). Without a sink (the library in
/// tests) lines go through `tracing` as usual. Either way `--log-level` filters them.
struct Sink {
    writer: tracing_appender::non_blocking::NonBlocking,
    json: bool,
}

static SINK: OnceLock<Sink> = OnceLock::new();

/// Sends access lines to `writer` (the log's non-blocking stdout writer) in the log format.
pub fn set_sink(writer: tracing_appender::non_blocking::NonBlocking, json: bool) {
    let _ = SINK.set(Sink { writer, json });
}

impl Sink {
    fn write(&self, l: &Line<'_>) {
        use std::fmt::Write as _;
        use std::io::Write as _;
        let now = humantime::format_rfc3339_micros(std::time::SystemTime::now());
        let mut out = String::with_capacity(256);
        // Writing into a String cannot fail.
        let Line {
            method,
            status,
            duration_ms,
            bytes,
            events,
            replayed,
            outcome,
            session,
        } = l;
        let _ = if self.json {
            writeln!(
                out,
                "{{\"timestamp\":\"{now}\",\"level\":\"INFO\",\"message\":\"request finished\",\
                 \"http.method\":\"{method}\",\"http.status\":{status},\"duration_ms\":{duration_ms},\
                 \"bytes\":{bytes},\"events\":{events},\"replayed\":{replayed},\
                 \"outcome\":\"{outcome}\",\"mcp.session\":\"{session}\"}}"
            )
        } else {
            writeln!(
                out,
                "{now}  INFO request finished http.method={method} http.status={status} \
                 duration_ms={duration_ms} bytes={bytes} events={events} replayed={replayed} \
                 outcome=\"{outcome}\" mcp.session=\"{session}\""
            )
        };
        let _ = self.writer.clone().write_all(out.as_bytes());
    }
}

pin_project_lite::pin_project! {
    /// A response body that logs and measures its request when it ends or is dropped.
    pub struct Observed<B> {
        #[pin]
        inner: B,
        log: AccessLog,
    }
}

impl<B> Observed<B> {
    pub fn new(inner: B, mut log: AccessLog) -> Observed<B>
    where
        B: Body,
    {
        // An empty body (a 202, a 404 without content) is never polled: it is complete now.
        log.ended = inner.is_end_stream();
        Observed { inner, log }
    }
}

impl<B: Body> Body for Observed<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let mut inner = this.inner;
        let polled = inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    this.log.bytes += bytes::Buf::remaining(d) as u64;
                }
                // hyper stops polling a body that says it has ended.
                if inner.is_end_stream() {
                    this.log.ended = true;
                }
            }
            Poll::Ready(None) => this.log.ended = true,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_reaches_the_log_as_itself_and_the_first_one_wins() {
        let all = [
            Outcome::Completed,
            Outcome::Replaced,
            Outcome::SessionClosed,
            Outcome::SlowConsumer,
            Outcome::Shutdown,
            Outcome::Gap,
            Outcome::UpstreamFailed,
        ];
        for o in all {
            let s = StreamStats::new(0);
            assert_eq!(s.outcome(), None, "none before the stream ends");
            s.set_outcome(o);
            s.set_outcome(Outcome::Completed);
            assert_eq!(s.outcome(), Some(o));
        }
    }
}
