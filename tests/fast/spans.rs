//! Tracing spans: one per connection and one per request (`http.request.method`,
//! `mcp.session.id`, OpenTelemetry's names: the same spans are exported as traces), so
//! a debug log of one session can be followed.

use crate::support;

use std::io::Write;
use std::sync::{Arc, Mutex};

use support::*;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// The current-thread runtime keeps every task on this thread, so the thread-local
/// subscriber sees the gateway's log lines.
#[tokio::test]
async fn log_lines_carry_the_connection_and_request_spans() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let mut mock = Mock::start().await;
    let gw = gateway(mock.addr, |_| {}).await;
    let sid = init_session(&gw, &mut mock, "span-session").await;
    let hashed = mcp_reattach::internals::hash_id(&sid);
    // A refused resume logs at debug inside its request span.
    let resp = send(gw.addr, get(&sid, Some("not-a-cursor"))).await;
    assert_eq!(resp.status(), 400);

    let text = captured.text();
    let refused = text
        .lines()
        .find(|l| l.contains("request refused"))
        .unwrap_or_else(|| panic!("a refusal line in:\n{text}"));
    assert!(
        refused.contains("connection{remote=127.0.0.1:"),
        "{refused}"
    );
    assert!(
        refused.contains(&format!(
            "request{{otel.kind=\"server\" http.request.method=GET mcp.session.id={hashed}}}"
        )),
        "{refused}"
    );
    // Every access line names the session hashed as the span does: the initialize's from
    // the id its answer created, the refused GET's from the session the route found, and a
    // request naming a session the gateway does not hold from the id it sent.
    let unknown = tokio::spawn(send(gw.addr, get("not-a-session", None)));
    mock.next().await.respond(json_response(404, &[], "{}"));
    assert_eq!(unknown.await.unwrap().status(), 404);
    let text = captured.text();
    let finished: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("request finished"))
        .collect();
    assert_eq!(finished.len(), 3, "{text}");
    for line in &finished[..2] {
        assert!(
            line.contains(&format!("mcp.session.id=\"{hashed}\"")),
            "{line}"
        );
    }
    let other = mcp_reattach::internals::hash_id("not-a-session");
    assert!(
        finished[2].contains(&format!("mcp.session.id=\"{other}\"")),
        "{}",
        finished[2]
    );
    // The session the upstream created during initialize is recorded on its request span.
    let created = text
        .lines()
        .find(|l| l.contains("session created"))
        .unwrap_or_else(|| panic!("a session-created line in:\n{text}"));
    assert!(
        created.contains("request{otel.kind=\"server\" http.request.method=POST"),
        "{created}"
    );
}
