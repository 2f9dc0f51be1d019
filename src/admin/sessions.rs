//! The operators' sessions on the admin listener:
//!
//! | request | answer |
//! |---|---|
//! | `GET /sessions[?limit=N&cursor=ID]` | a page of the sessions ([`Listing`], JSON; with a store, the fleet's) by id: at most `limit` (default [`DEFAULT_PAGE`], at most [`MAX_PAGE`]), those after `cursor`; `next_cursor` names the next page |
//! | `GET /sessions/{id}` | the session labelled `{id}` (a [`Listing`] of one), else 404 |
//! | `DELETE /sessions/{id}` | ends it as its client's `DELETE` would, upstream too; 404 when no replica holds it |
//! | `GET /ui`, `GET /ui/sessions/{id}` | the same, read-only, as HTML (`ui`) |
//!
//! `{id}` is a session's label (the hashed id logs and metrics show), never its id. With a
//! store, while another operator's question to the fleet is out, a read or an end that needs
//! the fleet gets 503 with `Retry-After` (one question at a time per replica: `store::ask`).

use http::{Method, Request, StatusCode};

use super::access::Want;
use super::{ui, Admin, Answer};
use crate::proxy::Asked;
use crate::session::Listing;
pub(super) use crate::store::MAX_PAGE;

/// The sessions a page holds when `limit` is not given.
pub(super) const DEFAULT_PAGE: usize = 100;

const JSON: &str = "application/json";
const HTML: &str = "text/html; charset=utf-8";

pub(super) async fn route<B>(admin: &Admin, req: &Request<B>) -> Answer {
    let mut a = answer(admin, req).await;
    // No script, no frame, no guessing of types, no cache: the page only shows, and what a
    // client sent stays text even if escaping ever broke.
    a.headers.extend([
        (
            http::header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
        (http::header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (http::header::CACHE_CONTROL, "no-store"),
    ]);
    a
}

async fn answer<B>(admin: &Admin, req: &Request<B>) -> Answer {
    let path = req.uri().path();
    let method = req.method();
    let read = matches!(*method, Method::GET | Method::HEAD);
    let html = path == "/ui" || path.starts_with("/ui/");
    let want = if *method == Method::DELETE && !html {
        Want::End
    } else if read {
        Want::Read
    } else {
        let mut a = Answer::error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "sessions are read with GET and ended with DELETE",
        );
        a.headers.push((
            http::header::ALLOW,
            if html {
                "GET, HEAD"
            } else {
                "GET, HEAD, DELETE"
            },
        ));
        return a;
    };
    if let Err(refused) = admin.access.check(req, want) {
        return refused;
    }
    let gateway = &admin.gateway;
    let label = match path
        .strip_prefix("/sessions")
        .or_else(|| path.strip_prefix("/ui/sessions"))
    {
        Some("" | "/") => None,
        Some(rest) => match rest.strip_prefix('/').filter(|l| is_label(l)) {
            Some(l) => Some(l),
            None => return bad_label(html),
        },
        // `/ui`, `/ui/`, or another page under it.
        None if path == "/ui" || path == "/ui/" => None,
        None => return not_found(html, "no such page"),
    };
    let (after, limit) = match page_asked(req.uri().query()) {
        Ok(p) => p,
        Err(why) => return bad_query(html, why),
    };
    match (want, label, html) {
        (Want::End, Some(label), _) => match gateway.end_labelled(label).await {
            Ok(Some(by)) => Answer::new(
                StatusCode::OK,
                JSON,
                serde_json::json!({ "ended": label, "by": by }).to_string(),
            ),
            Ok(None) => not_found(false, "no replica holds a session of that id"),
            Err(_) => busy(false),
        },
        (Want::End, None, _) => Answer::error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "end one session: DELETE /sessions/{id}",
        ),
        (Want::Read, None, html) => match gateway.sessions(Asked::Page { after, limit }).await {
            Ok(l) if html => Answer::new(StatusCode::OK, HTML, ui::list(&l)),
            Ok(l) => json(&l),
            Err(_) => busy(html),
        },
        (Want::Read, Some(label), html) => {
            let Ok(one) = gateway.sessions(Asked::One(label)).await else {
                return busy(html);
            };
            match (one.sessions.first(), html) {
                (None, _) => not_found(html, "no replica holds a session of that id"),
                (Some(_), false) => json(&one),
                (Some(s), true) => Answer::new(StatusCode::OK, HTML, ui::session(&one, s)),
            }
        }
    }
}

/// The page a query asks for: `cursor` (a label: the page starts after it) and `limit` (1 to
/// [`MAX_PAGE`], [`DEFAULT_PAGE`] without it); anything else in the query is ignored.
fn page_asked(query: Option<&str>) -> Result<(Option<&str>, usize), &'static str> {
    let (mut after, mut limit) = (None, DEFAULT_PAGE);
    for pair in query.unwrap_or("").split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "cursor" if is_label(v) => after = Some(v),
            "cursor" => return Err("cursor: a session id as the list shows it, 16 hex digits"),
            "limit" => match v.parse::<usize>() {
                Ok(n) if (1..=MAX_PAGE).contains(&n) => limit = n,
                _ => return Err("limit: a number of sessions from 1 to 1000"),
            },
            _ => {}
        }
    }
    Ok((after, limit))
}

/// Another operator's question to the fleet is out.
fn busy(html: bool) -> Answer {
    let why = "another operator's question to the fleet is out; ask again in a second";
    let mut a = if html {
        Answer::new(
            StatusCode::SERVICE_UNAVAILABLE,
            HTML,
            ui::message("Busy", why),
        )
    } else {
        Answer::error(StatusCode::SERVICE_UNAVAILABLE, "busy", why)
    };
    a.headers.push((http::header::RETRY_AFTER, "1"));
    a
}

fn bad_query(html: bool, why: &str) -> Answer {
    if html {
        Answer::new(
            StatusCode::BAD_REQUEST,
            HTML,
            ui::message("Not a page of the list", why),
        )
    } else {
        Answer::error(StatusCode::BAD_REQUEST, "bad-query", why)
    }
}

/// A session label: 16 lowercase hex digits (`session::hash_id`).
fn is_label(s: &str) -> bool {
    s.len() == 16 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn json(listing: &Listing) -> Answer {
    match serde_json::to_vec(listing) {
        Ok(body) => Answer::new(StatusCode::OK, JSON, body),
        Err(_) => Answer::error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the list could not be written",
        ),
    }
}

fn bad_label(html: bool) -> Answer {
    let why = "a session is named by its id as the list shows it: 16 hex digits";
    if html {
        Answer::new(
            StatusCode::BAD_REQUEST,
            HTML,
            ui::message("Not a session id", why),
        )
    } else {
        Answer::error(StatusCode::BAD_REQUEST, "bad-id", why)
    }
}

fn not_found(html: bool, why: &str) -> Answer {
    if html {
        Answer::new(StatusCode::NOT_FOUND, HTML, ui::message("Not found", why))
    } else {
        Answer::error(StatusCode::NOT_FOUND, "unknown-session", why)
    }
}
