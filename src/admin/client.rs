//! `mcp-reattach sessions list|show|end`: the admin listener's sessions for a terminal, as a
//! plain table or (`--json`) as the listener answers them.
//!
//! What it prints came partly from clients (a protocol version, an endpoint) through the
//! gateway, or from whatever answers at `--admin`: every control or invisible character in
//! it is escaped (`\u{1b}`), so no answer moves the terminal's cursor, rewrites its title or
//! forges a row; and an answer is read up to [`MAX_ANSWER`], refused past it.

use std::fmt::Write;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::config::{SessionsAction, SessionsArgs};
use crate::session::{Listing, SessionView};

/// The most of one admin answer the command reads (a page of the list is far less).
pub(crate) const MAX_ANSWER: usize = 16 << 20;

/// Why a `sessions` command failed; its text is the whole message.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ClientError(pub String);

/// Runs the command; what it prints goes to `out`.
pub async fn run(
    args: &SessionsArgs,
    token: Option<&[u8]>,
    out: &mut String,
) -> Result<(), ClientError> {
    let bad = |e: serde_json::Error| ClientError(format!("the admin listener's answer: {e}"));
    if let SessionsAction::List = &args.action {
        let l = list(&args.admin, token).await?;
        if args.json {
            let text = serde_json::to_string(&l).map_err(bad)?;
            out.push_str(&json_printable(&text));
            out.push('\n');
        } else {
            table(&l, out);
        }
        return Ok(());
    }
    let (method, path) = match &args.action {
        SessionsAction::List => (Method::GET, "/sessions".to_owned()),
        SessionsAction::Show { id } => (Method::GET, format!("/sessions/{id}")),
        SessionsAction::End { id } => (Method::DELETE, format!("/sessions/{id}")),
    };
    let body = asked(&args.admin, method, &path, token).await?;
    if args.json {
        // Written again by serde (which escapes C0 controls in strings), then the rest
        // escaped: still JSON, and the same value.
        let v: serde_json::Value = serde_json::from_slice(&body).map_err(bad)?;
        out.push_str(&json_printable(&v.to_string()));
        out.push('\n');
        return Ok(());
    }
    match &args.action {
        SessionsAction::List => {}
        SessionsAction::Show { .. } => {
            let l: Listing = serde_json::from_slice(&body).map_err(bad)?;
            if let Some(s) = l.sessions.first() {
                detail(s, out);
            }
        }
        SessionsAction::End { id } => {
            let v: serde_json::Value = serde_json::from_slice(&body).map_err(bad)?;
            let _ = writeln!(
                out,
                "ended {id} (by {})",
                printable(v["by"].as_str().unwrap_or("?"))
            );
        }
    }
    Ok(())
}

/// Every session: the list's pages one after the other (a gateway that does not page
/// answers all in one), as one [`Listing`], at most [`MAX_ANSWER`] of them read in all.
async fn list(base: &str, token: Option<&[u8]>) -> Result<Listing, ClientError> {
    let bad = |e: serde_json::Error| ClientError(format!("the admin listener's answer: {e}"));
    let mut all: Option<Listing> = None;
    let mut cursor: Option<String> = None;
    let mut read = 0usize;
    loop {
        let path = match &cursor {
            None => "/sessions?limit=1000".to_owned(),
            Some(c) => format!("/sessions?limit=1000&cursor={c}"),
        };
        let body = asked(base, Method::GET, &path, token).await?;
        read = read.saturating_add(body.len());
        if read > MAX_ANSWER {
            return Err(ClientError(format!(
                "{base}: the list is larger than 16 MiB; not read further"
            )));
        }
        let mut page: Listing = serde_json::from_slice(&body).map_err(bad)?;
        // A cursor that is no label, or does not move on, ends the walk.
        let next = page.next_cursor.take().filter(|c| {
            c.len() == 16
                && c.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                && cursor.as_ref().is_none_or(|was| c > was)
        });
        match &mut all {
            None => all = Some(page),
            Some(l) => {
                for r in page.replicas {
                    if !l.replicas.contains(&r) {
                        l.replicas.push(r);
                    }
                }
                l.replicas_asked = l.replicas_asked.max(page.replicas_asked);
                l.sessions.extend(page.sessions);
            }
        }
        match next {
            Some(n) => cursor = Some(n),
            None => break,
        }
    }
    all.ok_or_else(|| ClientError(format!("{base}: no answer")))
}

/// One request to the admin listener, asked again (at most [`BUSY_TRIES`] times) while it
/// answers 503 with `Retry-After` (another operator's question to the fleet is out): the
/// body of its success, or its refusal as the error.
async fn asked(
    base: &str,
    method: Method,
    path: &str,
    token: Option<&[u8]>,
) -> Result<Bytes, ClientError> {
    let mut tries = 0;
    loop {
        let (status, retry, body) = request(base, method.clone(), path, token).await?;
        if status.is_success() {
            return Ok(body);
        }
        tries += 1;
        if let (StatusCode::SERVICE_UNAVAILABLE, Some(after)) = (status, retry) {
            if tries < BUSY_TRIES {
                tokio::time::sleep(std::time::Duration::from_secs(after.clamp(1, 5))).await;
                continue;
            }
        }
        let why = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).trim().to_owned());
        return Err(ClientError(format!("{status}: {}", printable(&why))));
    }
}

/// How many times a request answered 503 + `Retry-After` is sent.
const BUSY_TRIES: usize = 5;

/// One request to the admin listener at `base` (`http://HOST:PORT`).
async fn request(
    base: &str,
    method: Method,
    path: &str,
    token: Option<&[u8]>,
) -> Result<(StatusCode, Option<u64>, Bytes), ClientError> {
    let uri: http::Uri = base
        .parse()
        .map_err(|e| ClientError(format!("--admin {base}: {e}")))?;
    if uri.scheme_str() != Some("http") {
        return Err(ClientError(format!(
            "--admin {base}: the admin listener speaks http://"
        )));
    }
    let Some(authority) = uri.authority().cloned() else {
        return Err(ClientError(format!("--admin {base}: no host")));
    };
    let port = authority.port_u16().unwrap_or(80);
    let tcp = tokio::net::TcpStream::connect((authority.host(), port))
        .await
        .map_err(|e| ClientError(format!("cannot reach the admin listener at {base}: {e}")))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .map_err(|e| ClientError(format!("{base}: {e}")))?;
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::HOST, authority.as_str())
        .header(http::header::ACCEPT, "application/json");
    if let Some(t) = token {
        let mut v = b"Bearer ".to_vec();
        v.extend_from_slice(t);
        req = req.header(http::header::AUTHORIZATION, v);
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|e| ClientError(format!("{e}")))?;
    let timeout = std::time::Duration::from_secs(10);
    let resp = tokio::time::timeout(timeout, send.send_request(req))
        .await
        .map_err(|_| ClientError(format!("{base}: no answer within {timeout:?}")))?
        .map_err(|e| ClientError(format!("{base}: {e}")))?;
    let status = resp.status();
    let retry = resp
        .headers()
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    let too_large = || {
        ClientError(format!(
            "{base}: the answer is larger than 16 MiB; not read further"
        ))
    };
    if resp
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .is_some_and(|n| n > MAX_ANSWER as u64)
    {
        return Err(too_large());
    }
    let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER);
    let body = tokio::time::timeout(timeout, body.collect())
        .await
        .map_err(|_| ClientError(format!("{base}: the answer did not end within {timeout:?}")))?
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                too_large()
            } else {
                ClientError(format!("{base}: {e}"))
            }
        })?
        .to_bytes();
    Ok((status, retry, body))
}

/// The list as a table, one session a line.
fn table(l: &Listing, out: &mut String) {
    let now = crate::session::unix_ms(std::time::SystemTime::now());
    let mut rows = vec![[
        "ID".to_owned(),
        "PRINCIPAL".into(),
        "SHAPE".into(),
        "PROTOCOL".into(),
        "IDLE".into(),
        "STREAMS".into(),
        "RUNNING".into(),
        "CLIENTS".into(),
        "WINDOW".into(),
        "REPLICAS".into(),
    ]];
    for s in &l.sessions {
        rows.push([
            printable(&s.id),
            printable(&s.principal),
            printable(&s.shape),
            printable(s.protocol_version.as_deref().unwrap_or("-")),
            ago(now, s.last_used_ms),
            s.streams.len().to_string(),
            s.streams
                .iter()
                .filter(|x| x.state != "ended")
                .count()
                .to_string(),
            s.attached_clients.to_string(),
            format!("{}/{}B", s.window_events, s.window_bytes),
            printable(&s.replicas.join(",")),
        ]);
    }
    write_rows(&rows, out);
    let _ = writeln!(
        out,
        "{} session{} on {}{}",
        l.sessions.len(),
        if l.sessions.len() == 1 { "" } else { "s" },
        printable(&l.replicas.join(", ")),
        if l.fleet && l.replicas.len() < l.replicas_asked {
            format!(
                " ({} of {} replicas answered)",
                l.replicas.len(),
                l.replicas_asked
            )
        } else {
            String::new()
        }
    );
}

/// One session, field by field, then its streams.
fn detail(s: &SessionView, out: &mut String) {
    let now = crate::session::unix_ms(std::time::SystemTime::now());
    let _ = writeln!(out, "id:               {}", printable(&s.id));
    let _ = writeln!(out, "principal:        {}", printable(&s.principal));
    let _ = writeln!(out, "shape:            {}", printable(&s.shape));
    let _ = writeln!(
        out,
        "protocol version: {}",
        printable(s.protocol_version.as_deref().unwrap_or("-"))
    );
    let _ = writeln!(out, "endpoint:         {}", printable(&s.endpoint));
    let _ = writeln!(out, "created:          {} ago", ago(now, s.created_ms));
    let _ = writeln!(out, "last used:        {} ago", ago(now, s.last_used_ms));
    let _ = writeln!(out, "attached clients: {}", s.attached_clients);
    let _ = writeln!(
        out,
        "window:           {}",
        super::ui::window(s.window_events, s.window_bytes)
    );
    let _ = writeln!(
        out,
        "replicas:         {}",
        printable(&s.replicas.join(", "))
    );
    out.push('\n');
    let mut rows = vec![[
        "STREAM".to_owned(),
        "KIND".into(),
        "STATE".into(),
        "CLIENT".into(),
        "POSITIONS".into(),
        "WINDOW".into(),
        "PENDING".into(),
        "REPLICA".into(),
    ]];
    for x in &s.streams {
        rows.push([
            x.number.to_string(),
            printable(&x.kind),
            printable(&x.state),
            if x.attached { "attached" } else { "-" }.into(),
            format!("{}-{}", x.first_seq, x.last_seq),
            format!("{}/{}B", x.window_events, x.window_bytes),
            x.pending_requests.to_string(),
            printable(&x.replica),
        ]);
    }
    write_rows(&rows, out);
}

/// Rows as columns padded to their widest cell.
fn write_rows<const N: usize>(rows: &[[String; N]], out: &mut String) {
    let mut widths = [0usize; N];
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    for r in rows {
        let mut line = String::new();
        for (i, (c, w)) in r.iter().zip(widths).enumerate() {
            if i + 1 == N {
                line.push_str(c);
            } else {
                let _ = write!(line, "{c:<w$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// Whether a terminal may be shown `c` as it is: not a control character (C0, DEL, C1: the
/// escape sequences' introducers among them), nor one that is invisible or reorders the text
/// around it (zero-width, bidirectional controls, separators, the byte-order mark).
fn shown_as_is(c: char) -> bool {
    !(c.is_control()
        || matches!(c, '\u{ad}' | '\u{61c}' | '\u{180e}' | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}' | '\u{2060}'..='\u{206f}' | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}'))
}

/// `s` for a terminal: every character not [`shown_as_is`] written `\u{1b}`.
fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if shown_as_is(c) {
            out.push(c);
        } else {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        }
    }
    out
}

/// JSON text (serde's, compact: a control character can only be inside a string) with every
/// character not [`shown_as_is`] written as JSON's `\u00XX`: still JSON, the same value.
fn json_printable(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if shown_as_is(c) {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{:04x}", u);
            }
        }
    }
    out
}

/// How long ago `then` was, in the largest whole unit.
fn ago(now: u64, then: u64) -> String {
    let s = now.saturating_sub(then) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_line_up_and_ages_round_down() {
        let mut out = String::new();
        write_rows(
            &[
                ["A".to_owned(), "LONGER".into(), "Z".into()],
                ["wide cell".into(), "b".into(), "end".into()],
            ],
            &mut out,
        );
        assert_eq!(out, "A          LONGER  Z\nwide cell  b       end\n");
        assert_eq!(ago(10_000, 9_500), "0s");
        assert_eq!(ago(200_000, 0), "3m");
        assert_eq!(ago(90_000_000, 0), "1d");
    }

    #[test]
    fn what_a_client_controls_is_escaped_for_the_terminal() {
        assert_eq!(printable("2025-11-25"), "2025-11-25");
        assert_eq!(printable("é ü 日本"), "é ü 日本");
        assert_eq!(
            printable("a\u{1b}[2J\nb\r\u{9b}\u{202e}\u{7f}\0"),
            "a\\u{1b}[2J\\u{a}b\\u{d}\\u{9b}\\u{202e}\\u{7f}\\u{0}"
        );
        let v = serde_json::json!({"p": "x\u{1b}\u{9b}\u{202e}\n", "q": ["é"]});
        let text = json_printable(&v.to_string());
        assert!(text.chars().all(shown_as_is), "{text}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&text).unwrap(), v);
    }
}
