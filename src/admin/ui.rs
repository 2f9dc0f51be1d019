//! The sessions as HTML for people (`/ui`): one table of sessions, one page per session.
//! Server-rendered, read-only, no script: readable with scripts off and in a text browser.
//! Every value that came from a client or the upstream is escaped.

use std::fmt::Write;

use crate::session::{Listing, SessionView};

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em}\
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}\
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}\
code{font-size:13px}.muted{color:#666}";

/// The page of every session.
pub(super) fn list(l: &Listing) -> String {
    let mut h = page_start("Sessions");
    let _ = write!(
        h,
        "<h1>Sessions</h1><p id=\"summary\">{} session{} held by {}.</p>",
        l.sessions.len(),
        if l.sessions.len() == 1 { "" } else { "s" },
        held_by(l),
    );
    if l.sessions.is_empty() {
        h.push_str("<p id=\"empty\">No sessions.</p>");
    } else {
        h.push_str(
            "<table id=\"sessions\"><thead><tr><th>id</th><th>principal</th><th>shape</th>\
             <th>protocol</th><th>created</th><th>last used</th><th>streams</th>\
             <th>running</th><th>clients</th><th>window</th><th>replicas</th></tr></thead><tbody>",
        );
        for s in &l.sessions {
            let running = s.streams.iter().filter(|x| x.state != "ended").count();
            let _ = write!(
                h,
                "<tr><td><a href=\"/ui/sessions/{id}\"><code>{id}</code></a></td>\
                 <td><code>{principal}</code></td><td>{shape}</td><td>{protocol}</td>\
                 <td>{created}</td><td>{used}</td><td class=\"n\">{streams}</td>\
                 <td class=\"n\">{running}</td><td class=\"n\">{clients}</td>\
                 <td class=\"n\">{window}</td><td>{replicas}</td></tr>",
                id = esc(&s.id),
                principal = esc(&s.principal),
                shape = esc(&s.shape),
                protocol = esc(s.protocol_version.as_deref().unwrap_or("-")),
                created = time(s.created_ms),
                used = time(s.last_used_ms),
                streams = s.streams.len(),
                clients = s.attached_clients,
                window = window(s.window_events, s.window_bytes),
                replicas = esc(&s.replicas.join(", ")),
            );
        }
        h.push_str("</tbody></table>");
    }
    if let Some(next) = &l.next_cursor {
        let _ = write!(
            h,
            "<p id=\"next\"><a href=\"/ui?cursor={c}\">Next page</a> (sessions after <code>{c}</code>).</p>",
            c = esc(next),
        );
    }
    h.push_str("<p class=\"muted\">JSON: <a href=\"/sessions\"><code>/sessions</code></a>.</p>");
    page_end(h)
}

/// What a window holds, as the pages (and `sessions show`) say it: `1 event, 312 B`, `3 events, 900 B`.
pub(super) fn window(events: usize, bytes: usize) -> String {
    let plural = if events == 1 { "" } else { "s" };
    format!("{events} event{plural}, {bytes} B")
}

/// The page of one session.
pub(super) fn session(l: &Listing, s: &SessionView) -> String {
    let mut h = page_start(&format!("Session {}", s.id));
    let _ = write!(
        h,
        "<p><a href=\"/ui\">All sessions</a></p><h1>Session <code>{}</code></h1>\
         <table id=\"session\"><tbody>",
        esc(&s.id)
    );
    let rows: [(&str, String); 10] = [
        ("principal", format!("<code>{}</code>", esc(&s.principal))),
        ("shape", esc(&s.shape)),
        (
            "protocol version",
            esc(s.protocol_version.as_deref().unwrap_or("-")),
        ),
        ("endpoint", format!("<code>{}</code>", esc(&s.endpoint))),
        ("created", time(s.created_ms)),
        ("last used", time(s.last_used_ms)),
        ("attached clients", s.attached_clients.to_string()),
        ("window", window(s.window_events, s.window_bytes)),
        ("replicas", esc(&s.replicas.join(", "))),
        ("seen by", held_by(l)),
    ];
    for (k, v) in rows {
        let _ = write!(h, "<tr><th>{k}</th><td>{v}</td></tr>");
    }
    h.push_str("</tbody></table><h2>Streams</h2>");
    if s.streams.is_empty() {
        h.push_str("<p id=\"no-streams\">No streams.</p>");
    } else {
        h.push_str(
            "<table id=\"streams\"><thead><tr><th>stream</th><th>kind</th><th>state</th>\
             <th>client</th><th>positions</th><th>in window</th><th>pending requests</th>\
             <th>replica</th></tr></thead><tbody>",
        );
        for x in &s.streams {
            let _ = write!(
                h,
                "<tr><td class=\"n\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td class=\"n\">{}–{}</td><td class=\"n\">{}</td>\
                 <td class=\"n\">{}</td><td>{}</td></tr>",
                x.number,
                esc(&x.kind),
                esc(&x.state),
                if x.attached { "attached" } else { "-" },
                x.first_seq,
                x.last_seq,
                window(x.window_events, x.window_bytes),
                x.pending_requests,
                esc(&x.replica),
            );
        }
        h.push_str("</tbody></table>");
    }
    let _ = write!(
        h,
        "<p class=\"muted\">JSON: <a href=\"/sessions/{id}\"><code>/sessions/{id}</code></a>. \
         End it with <code>mcp-reattach sessions end {id}</code>.</p>",
        id = esc(&s.id)
    );
    page_end(h)
}

/// A page that only says something (not found, a bad id).
pub(super) fn message(title: &str, text: &str) -> String {
    let mut h = page_start(title);
    let _ = write!(
        h,
        "<p><a href=\"/ui\">All sessions</a></p><h1>{}</h1><p id=\"message\">{}</p>",
        esc(title),
        esc(text)
    );
    page_end(h)
}

fn held_by(l: &Listing) -> String {
    let mut s = if l.fleet {
        format!(
            "{} of {} replica{} (a fleet sharing its sessions)",
            l.replicas.len(),
            l.replicas_asked,
            if l.replicas_asked == 1 { "" } else { "s" }
        )
    } else {
        "this gateway".to_owned()
    };
    let _ = write!(s, ": <code>{}</code>", esc(&l.replicas.join(", ")));
    s
}

fn page_start(title: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\">\
         <title>{} · mcp-reattach</title><style>{STYLE}</style></head><body>",
        esc(title)
    )
}

fn page_end(mut h: String) -> String {
    h.push_str("</body></html>");
    h
}

/// A Unix ms time as UTC `YYYY-MM-DD HH:MM:SS`.
fn time(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// `s` safe as HTML text and in a quoted attribute.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_said_in_the_singular_for_one_event() {
        assert_eq!(window(1, 312), "1 event, 312 B");
        assert_eq!(window(0, 0), "0 events, 0 B");
        assert_eq!(window(3, 900), "3 events, 900 B");
    }

    #[test]
    fn times_are_utc_dates() {
        assert_eq!(time(0), "1970-01-01 00:00:00");
        assert_eq!(time(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(time(1_796_553_296_000), "2026-12-06 10:34:56");
    }

    #[test]
    fn what_a_client_sent_is_escaped() {
        assert_eq!(
            esc("<script>\"x\"&'y'</script>"),
            "&lt;script&gt;&quot;x&quot;&amp;&#39;y&#39;&lt;/script&gt;"
        );
    }
}
