//! Issue 24: OpenTelemetry traces of the real binary, decoded with the official OTLP protobuf
//! schema (the `opentelemetry-proto` crate, generated from opentelemetry-proto's .proto files)
//! by a receiver of this test: a tool call continued from the client's `traceparent`, its
//! upstream exchange (whose `traceparent` the upstream sees), a cut, and the resume joining the
//! call's trace as a child of the call's span.

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;

use support::*;

/// An OTLP/HTTP receiver: every span of every `POST /v1/traces`, decoded.
struct Receiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Span>>>,
    /// `content-type` of the exports, as sent.
    content_types: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    async fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let content_types = Arc::new(Mutex::new(Vec::new()));
        let (s, c) = (spans.clone(), content_types.clone());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (s, c) = (s.clone(), c.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let (s, c) = (s.clone(), c.clone());
                        async move {
                            let path = req.uri().path().to_owned();
                            let ct = req
                                .headers()
                                .get("content-type")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_owned();
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            if path == "/v1/traces" {
                                c.lock().unwrap().push(ct);
                                let export = ExportTraceServiceRequest::decode(body)
                                    .expect("an ExportTraceServiceRequest");
                                let mut spans = s.lock().unwrap();
                                for rs in export.resource_spans {
                                    for ss in rs.scope_spans {
                                        spans.extend(ss.spans);
                                    }
                                }
                            }
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        Receiver {
            addr,
            spans,
            content_types,
        }
    }

    /// The spans received so far, once `ready` holds of them (10 s at most).
    async fn spans_when(&self, ready: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let spans = self.spans.lock().unwrap().clone();
            if ready(&spans) || tokio::time::Instant::now() > deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn attr(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
        .map(|v| match v {
            AnyValue::StringValue(s) => s.clone(),
            AnyValue::IntValue(i) => i.to_string(),
            AnyValue::BoolValue(b) => b.to_string(),
            AnyValue::DoubleValue(d) => d.to_string(),
            other => format!("{other:?}"),
        })
}

/// The span tree, as the closing note shows it: one line per span, children indented.
fn tree(spans: &[Span]) -> String {
    fn walk(spans: &[Span], parent: &[u8], depth: usize, out: &mut String) {
        for s in spans.iter().filter(|s| s.parent_span_id == parent) {
            out.push_str(&format!(
                "{}{} [{:?}] trace={} span={} method={} path={} mcp.method={} status={} outcome={}\n",
                "  ".repeat(depth),
                s.name,
                SpanKind::try_from(s.kind).unwrap_or(SpanKind::Unspecified),
                hex(&s.trace_id),
                hex(&s.span_id),
                attr(s, "http.request.method").unwrap_or_default(),
                attr(s, "url.path").unwrap_or_default(),
                attr(s, "mcp.method.name").unwrap_or_default(),
                attr(s, "http.response.status_code").unwrap_or_default(),
                attr(s, "outcome").unwrap_or_default(),
            ));
            walk(spans, &s.span_id, depth + 1, out);
        }
    }
    let mut out = String::new();
    let ids: Vec<&[u8]> = spans.iter().map(|s| s.span_id.as_slice()).collect();
    // Roots: spans whose parent is not among the received (the client's span, or none).
    let mut roots: Vec<Vec<u8>> = spans
        .iter()
        .filter(|s| !ids.contains(&s.parent_span_id.as_slice()))
        .map(|s| s.parent_span_id.clone())
        .collect();
    roots.dedup();
    for r in roots {
        out.push_str(&format!(
            "(parent {})\n",
            if r.is_empty() { "none".into() } else { hex(&r) }
        ));
        walk(spans, &r, 1, &mut out);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_and_resumed_call_is_one_trace_exported_over_otlp() {
    let receiver = Receiver::start().await;
    let mut mock = Mock::start().await;
    let endpoint = format!("http://{}", receiver.addr);
    let gw = Binary::start_with_env(
        mock.addr,
        &["--hold-standalone", "false", "--json-upgrade", "false"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("OTEL_SERVICE_NAME", "gateway-under-test"),
        ],
    )
    .await;
    let sid = init_session(&gw.addr, &mut mock, "s").await;
    // The client's trace: its call is a child of the client's span.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let mut call = post(
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"slow"}}"#,
        Some(&sid),
    );
    call.headers_mut().insert(
        "traceparent",
        format!("00-{client_trace}-{client_span}-01")
            .parse()
            .unwrap(),
    );
    let pending = tokio::spawn(send(gw.addr, call));
    let seen = mock.next().await;
    let upstream_parent = seen.headers["traceparent"].to_str().unwrap().to_owned();
    let writer = seen.respond_sse(Some(&sid));
    let mut reader = SseReader::new(pending.await.unwrap());
    writer
        .message(r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":1,"progress":1}}"#)
        .await;
    let first = reader.next().await.expect("the progress event");
    let cursor = first.id.clone().expect("an id");
    drop(reader); // the cut
                  // The resume, without a traceparent of its own.
    let resumed = send(gw.addr, get(&sid, Some(&cursor))).await;
    assert_eq!(resumed.status(), 200);
    let mut resumed = SseReader::new(resumed);
    writer
        .message(r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#)
        .await;
    drop(writer);
    // Read the resumed stream to its end: the span's outcome is what the gateway saw when
    // the upstream's stream ended, and a client that hung up on the result could beat it.
    let mut carried_result = false;
    while let Some(ev) = resumed.next().await {
        carried_result |= ev.data.as_deref().is_some_and(|d| d.contains("\"result\""));
    }
    assert!(
        carried_result,
        "the resumed stream carried the call's result"
    );
    drop(resumed);
    let spans = receiver
        .spans_when(|s| {
            s.iter()
                .filter(|s| {
                    s.kind == SpanKind::Server as i32
                        && attr(s, "http.request.method").as_deref() == Some("GET")
                })
                .count()
                >= 1
                && s.iter()
                    .filter(|s| s.kind == SpanKind::Client as i32)
                    .count()
                    >= 2
        })
        .await;
    let printed = tree(&spans);
    eprintln!("span tree as exported:\n{printed}");
    assert!(
        receiver
            .content_types
            .lock()
            .unwrap()
            .iter()
            .all(|c| c == "application/x-protobuf"),
        "{:?}",
        receiver.content_types.lock().unwrap()
    );
    let post = spans
        .iter()
        .find(|s| {
            s.kind == SpanKind::Server as i32
                && attr(s, "mcp.method.name").as_deref() == Some("tools/call")
        })
        .unwrap_or_else(|| panic!("the call's request span in\n{printed}"));
    assert_eq!(
        hex(&post.trace_id),
        client_trace,
        "continues the client's trace"
    );
    assert_eq!(
        hex(&post.parent_span_id),
        client_span,
        "a child of the client's span"
    );
    assert_eq!(post.name, "POST /mcp");
    assert_eq!(attr(post, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(attr(post, "gen_ai.tool.name").as_deref(), Some("slow"));
    assert!(attr(post, "outcome").is_some(), "{printed}");
    // Its upstream exchange: a client span, and the traceparent the upstream saw names it.
    let upstream = spans
        .iter()
        .find(|s| s.kind == SpanKind::Client as i32 && s.parent_span_id == post.span_id)
        .unwrap_or_else(|| panic!("the call's upstream span in\n{printed}"));
    assert_eq!(upstream.name, "POST");
    assert_eq!(
        upstream_parent,
        format!("00-{client_trace}-{}-01", hex(&upstream.span_id)),
        "the upstream's traceparent names the gateway's exchange"
    );
    // The resume: in the call's trace, a child of the call's span.
    let resume = spans
        .iter()
        .find(|s| {
            s.kind == SpanKind::Server as i32
                && attr(s, "http.request.method").as_deref() == Some("GET")
        })
        .unwrap_or_else(|| panic!("the resume's span in\n{printed}"));
    assert_eq!(hex(&resume.trace_id), client_trace, "{printed}");
    assert_eq!(resume.parent_span_id, post.span_id, "{printed}");
    // The stream's life on its span: the result it carried, how it ended.
    assert!(
        attr(resume, "events").is_some_and(|e| e.parse::<u64>().unwrap() >= 1),
        "events {:?}: {printed}",
        attr(resume, "events")
    );
    assert_eq!(attr(resume, "outcome").as_deref(), Some("completed"));
    // No span of a connection: a request without a traceparent starts a trace of its own.
    assert!(spans.iter().all(|s| s.name != "connection"), "{printed}");
    let init = spans
        .iter()
        .find(|s| attr(s, "mcp.method.name").as_deref() == Some("initialize"))
        .unwrap_or_else(|| panic!("the initialize span in\n{printed}"));
    assert!(init.parent_span_id.is_empty(), "{printed}");
    drop(gw);
}
