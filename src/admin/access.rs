//! Who may read and end sessions on the admin listener (docs/operations.md, "Sessions, seen
//! and ended"):
//!
//! - with `--admin-token-file`, ending a session needs the token (`Authorization: Bearer`, or
//!   Basic with the token as the password: what a browser sends), and reading needs it too
//!   with `--admin-token-for-reads`, or when the listener is off loopback;
//! - without it, sessions can be read and ended only on a loopback listener;
//! - on a loopback listener, a request let in without the token must name a loopback host
//!   (`Host`): a web page a browser on the same machine loads cannot reach the listener
//!   through a name rebound to 127.0.0.1, token configured or not.
//!
//! Probes and `/metrics` never come here.

use base64::Engine;
use http::{header, Request, StatusCode};

use super::Answer;
use crate::config::AdminAccess;

pub(super) struct Access {
    token: Option<blake3::Hash>,
    token_for_reads: bool,
    /// The listener is bound to a loopback address.
    loopback: bool,
}

/// What a request wants to do.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Want {
    Read,
    End,
}

impl Access {
    pub(super) fn new(access: AdminAccess, loopback: bool) -> Access {
        Access {
            token: access.token,
            token_for_reads: access.token_for_reads,
            loopback,
        }
    }

    /// `Ok` when `req` may do what it wants, else the answer that says why not. One table:
    ///
    /// | the request | loopback listener | listener off loopback |
    /// |---|---|---|
    /// | the token (when one is configured) | yes | yes |
    /// | another token | 401 | 401 |
    /// | none, to end, with a token configured | 401 | 401 |
    /// | none, to end, without a token | a loopback `Host` only, else 403 | 403 |
    /// | none, to read, `--admin-token-for-reads` | 401 | 401 |
    /// | none, to read, a token configured | a loopback `Host` only, else 403 | 401 |
    /// | none, to read, without a token | a loopback `Host` only, else 403 | 403 |
    ///
    /// The `Host` check holds whenever a loopback listener lets a request in without the
    /// token: a page in a browser on this machine reaches it through a name rebound to
    /// 127.0.0.1, and carries no token (issue 56, R5-10).
    pub(super) fn check<B>(&self, req: &Request<B>, want: Want) -> Result<(), Answer> {
        if let Some(token) = &self.token {
            match presented(req) {
                // blake3's `Hash` compares in constant time.
                Some(t) if blake3::hash(&t) == *token => return Ok(()),
                Some(_) => {
                    return Err(refused(
                        StatusCode::UNAUTHORIZED,
                        "the admin token is not the one in --admin-token-file",
                    ))
                }
                None if want == Want::End || self.token_for_reads || !self.loopback => {
                    return Err(refused(
                        StatusCode::UNAUTHORIZED,
                        "this needs the admin token (Authorization: Bearer <token>)",
                    ))
                }
                None => {}
            }
        }
        if !self.loopback {
            return Err(refused(
                StatusCode::FORBIDDEN,
                match want {
                    Want::End => "ending sessions on an admin listener outside loopback needs --admin-token-file",
                    Want::Read => "reading sessions on an admin listener outside loopback needs --admin-token-file",
                },
            ));
        }
        if !loopback_host(req) {
            return Err(refused(
                StatusCode::FORBIDDEN,
                "the admin listener on loopback answers only requests to a loopback host",
            ));
        }
        Ok(())
    }
}

/// A refusal as JSON, with the challenge a browser answers with a password prompt.
fn refused(status: StatusCode, why: &'static str) -> Answer {
    let mut a = Answer::error(status, "refused", why);
    if status == StatusCode::UNAUTHORIZED {
        a.headers.push((
            header::WWW_AUTHENTICATE,
            "Basic realm=\"mcp-reattach admin\", charset=\"UTF-8\"",
        ));
    }
    a
}

/// The token a request presents: a Bearer token, or a Basic password.
fn presented<B>(req: &Request<B>) -> Option<Vec<u8>> {
    let v = req.headers().get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, rest) = v.split_at(v.iter().position(|&b| b == b' ')?);
    let rest = rest.trim_ascii();
    if scheme.eq_ignore_ascii_case(b"bearer") {
        return Some(rest.to_vec());
    }
    if scheme.eq_ignore_ascii_case(b"basic") {
        let pair = base64::engine::general_purpose::STANDARD
            .decode(rest)
            .ok()?;
        let colon = pair.iter().position(|&b| b == b':')?;
        return Some(pair[colon + 1..].to_vec());
    }
    None
}

/// Whether `req` names a loopback host (`localhost`, `127.x.y.z`, `[::1]`, any port).
fn loopback_host<B>(req: &Request<B>) -> bool {
    let Some(host) = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
    else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(host: &str, auth: Option<&str>) -> Request<()> {
        let mut b = Request::builder().uri("/sessions").header("host", host);
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        b.body(()).unwrap()
    }

    fn access(token: Option<&str>, reads: bool, loopback: bool) -> Access {
        Access::new(
            AdminAccess {
                token: token.map(|t| blake3::hash(t.as_bytes())),
                token_for_reads: reads,
            },
            loopback,
        )
    }

    fn status(r: Result<(), Answer>) -> u16 {
        r.map_or_else(|a| a.status.as_u16(), |()| 200)
    }

    #[test]
    fn without_a_token_only_loopback_ends_and_only_for_a_loopback_host() {
        let a = access(None, false, true);
        assert_eq!(
            status(a.check(&req("127.0.0.1:9090", None), Want::End)),
            200
        );
        assert_eq!(
            status(a.check(&req("localhost:9090", None), Want::End)),
            200
        );
        assert_eq!(status(a.check(&req("[::1]:9090", None), Want::Read)), 200);
        // A name rebound to 127.0.0.1 by a web page's DNS.
        assert_eq!(
            status(a.check(&req("evil.example:9090", None), Want::Read)),
            403
        );
        let exposed = access(None, false, false);
        assert_eq!(
            status(exposed.check(&req("10.0.0.5:9090", None), Want::Read)),
            403
        );
        assert_eq!(
            status(exposed.check(&req("10.0.0.5:9090", None), Want::End)),
            403
        );
    }

    #[test]
    fn with_a_token_ending_needs_it_and_reading_when_asked() {
        let token = "0123456789abcdef0123";
        let a = access(Some(token), false, false);
        let bearer = format!("Bearer {token}");
        let basic = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("operator:{token}"))
        );
        // Off loopback, reading needs the token too.
        assert_eq!(status(a.check(&req("h", None), Want::Read)), 401);
        assert_eq!(status(a.check(&req("h", None), Want::End)), 401);
        assert_eq!(
            status(a.check(&req("h", Some("Bearer nope")), Want::End)),
            401
        );
        assert_eq!(
            status(a.check(&req("h", Some("Bearer nope")), Want::Read)),
            401
        );
        assert_eq!(status(a.check(&req("h", Some(&bearer)), Want::End)), 200);
        assert_eq!(status(a.check(&req("h", Some(&basic)), Want::End)), 200);
        // On loopback, reads left open keep the rebinding check (R5-10).
        let open = access(Some(token), false, true);
        assert_eq!(
            status(open.check(&req("127.0.0.1:9090", None), Want::Read)),
            200
        );
        assert_eq!(
            status(open.check(&req("evil.example:9090", None), Want::Read)),
            403
        );
        assert_eq!(
            status(open.check(&req("evil.example:9090", Some(&bearer)), Want::Read)),
            200
        );
        let reads = access(Some(token), true, true);
        assert_eq!(
            status(reads.check(&req("127.0.0.1", None), Want::Read)),
            401
        );
        assert_eq!(
            status(reads.check(&req("h", Some(&basic)), Want::Read)),
            200
        );
    }
}
