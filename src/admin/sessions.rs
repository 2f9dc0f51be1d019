//! The operators' sessions on the admin listener:
//!
//! | request | answer |
//! |---|---|
//! | `GET /sessions` | every session ([`Listing`], JSON): with a store, the fleet's |
//! | `GET /sessions/{id}` | the session labelled `{id}` (a [`Listing`] of one), else 404 |
//! | `DELETE /sessions/{id}` | ends it as its client's `DELETE` would, upstream too; 404 when no replica holds it |
//! | `GET /ui`, `GET /ui/sessions/{id}` | the same, read-only, as HTML (`ui`) |
//!
//! `{id}` is a session's label (the hashed id logs and metrics show), never its id.

use bytes::Bytes;
use http::{Method, Request, StatusCode};

use super::access::Want;
use super::{ui, Admin, Answer};
use crate::session::Listing;

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
        let mut a = error(
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
    match (want, label, html) {
        (Want::End, Some(label), _) => match gateway.end_labelled(label).await {
            Some(by) => Answer::new(
                StatusCode::OK,
                JSON,
                serde_json::json!({ "ended": label, "by": by }).to_string(),
            ),
            None => not_found(false, "no replica holds a session of that id"),
        },
        (Want::End, None, _) => error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "end one session: DELETE /sessions/{id}",
        ),
        (Want::Read, None, false) => json(&gateway.sessions(None).await),
        (Want::Read, None, true) => Answer::new(
            StatusCode::OK,
            HTML,
            ui::list(&gateway.sessions(None).await),
        ),
        (Want::Read, Some(label), html) => {
            let one = gateway.sessions(Some(label)).await;
            match (one.sessions.first(), html) {
                (None, _) => not_found(html, "no replica holds a session of that id"),
                (Some(_), false) => json(&one),
                (Some(s), true) => Answer::new(StatusCode::OK, HTML, ui::session(&one, s)),
            }
        }
    }
}

/// A session label: 16 lowercase hex digits (`session::hash_id`).
fn is_label(s: &str) -> bool {
    s.len() == 16 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn json(listing: &Listing) -> Answer {
    match serde_json::to_vec(listing) {
        Ok(body) => Answer::new(StatusCode::OK, JSON, body),
        Err(_) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the list could not be written",
        ),
    }
}

/// An error as JSON: `{"error": kind, "message": why}`.
pub(super) fn error(status: StatusCode, kind: &str, why: &str) -> Answer {
    Answer::new(
        status,
        JSON,
        Bytes::from(serde_json::json!({ "error": kind, "message": why }).to_string()),
    )
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
        error(StatusCode::BAD_REQUEST, "bad-id", why)
    }
}

fn not_found(html: bool, why: &str) -> Answer {
    if html {
        Answer::new(StatusCode::NOT_FOUND, HTML, ui::message("Not found", why))
    } else {
        error(StatusCode::NOT_FOUND, "unknown-session", why)
    }
}
