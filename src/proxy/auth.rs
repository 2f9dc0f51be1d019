//! Who the caller is and whether it may attach to a session's streams: the principal (a keyed
//! MAC, keyed BLAKE3 truncated to 128 bits, of its principal header or client certificate) and
//! the `--resume-auth` decision, taken at most once per request (with `upstream`, one `ping`
//! to the session's endpoint).
//!
//! Knows request headers and the upstream client; nothing of routes.

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::Method;
use http_body_util::{BodyExt, Limited};

use super::inbound::Inbound;
use super::Gateway;
use crate::config::{PrincipalSource, ResumeAuth};
use crate::exchange::Conn;
use crate::session::{Principal, Session};
use crate::upstream::{full_body, own_request_headers};

impl Gateway {
    /// The caller's principal: a keyed MAC of its principal header (`Authorization` unless
    /// `--principal-header`), absent header included, or of its verified client
    /// certificate's subject. The key is random per process.
    /// The caller's principal, and whose share a session it creates counts against
    /// (`creates`: an `initialize`): the principal of a caller that presented a credential
    /// (a `--principal-header`, a client certificate), else a keyed MAC of its address, so
    /// anonymous callers on different addresses have shares of their own. Behind a proxy
    /// every anonymous caller has the proxy's address: one share, as without shares.
    pub(super) fn principal_and_share(
        &self,
        headers: &HeaderMap,
        conn: &Conn,
        creates: bool,
    ) -> (Principal, Principal) {
        let principal = self.principal(headers, conn);
        if !creates || self.credential(headers, conn) {
            return (principal, principal);
        }
        let mut mac = blake3::Hasher::new_keyed(&self.principal_key);
        mac.update(&[3]);
        match self.client_ip(headers, conn.remote.ip()) {
            std::net::IpAddr::V4(a) => mac.update(&a.octets()),
            std::net::IpAddr::V6(a) => mac.update(&a.octets()),
        };
        let mut p = [0u8; 16];
        p.copy_from_slice(&mac.finalize().as_bytes()[..16]);
        (principal, Principal(p))
    }

    /// The client's address: the connection's `peer`, or for a peer in `--trusted-proxies`
    /// the right-most `X-Forwarded-For` address that is not a trusted proxy (each hop appends
    /// the address it saw; only the trusted hops' additions are believed).
    pub(super) fn client_ip(
        &self,
        headers: &HeaderMap,
        peer: std::net::IpAddr,
    ) -> std::net::IpAddr {
        let trusted =
            |ip: std::net::IpAddr| self.cfg.trusted_proxies.iter().any(|n| n.contains(ip));
        if self.cfg.trusted_proxies.is_empty() || !trusted(peer) {
            return peer;
        }
        let forwarded = headers
            .get_all(http::header::HeaderName::from_static("x-forwarded-for"))
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect::<Vec<_>>();
        let mut client = peer;
        for hop in forwarded.iter().rev() {
            match hop.parse::<std::net::IpAddr>() {
                Ok(ip) => {
                    client = ip;
                    if !trusted(ip) {
                        break;
                    }
                }
                // Not an address (a hostname, garbage): the last believed hop is the client.
                Err(_) => break,
            }
        }
        client
    }

    /// Whether the caller presented a credential its principal is made of.
    fn credential(&self, headers: &HeaderMap, conn: &Conn) -> bool {
        if self.cfg.principal_source == PrincipalSource::ClientCert {
            return conn.client_subject.is_some();
        }
        let name = self
            .cfg
            .principal_header
            .as_ref()
            .unwrap_or(&header::AUTHORIZATION);
        headers.contains_key(name)
    }

    pub(super) fn principal(&self, headers: &HeaderMap, conn: &Conn) -> Principal {
        let mut mac = blake3::Hasher::new_keyed(&self.principal_key);
        if self.cfg.principal_source == PrincipalSource::ClientCert {
            // The verified certificate's subject; the connection was refused without one.
            mac.update(&[2]);
            mac.update(conn.client_subject.as_deref().unwrap_or("").as_bytes());
        } else {
            let name = self
                .cfg
                .principal_header
                .as_ref()
                .unwrap_or(&header::AUTHORIZATION);
            match headers.get(name) {
                Some(v) => {
                    mac.update(&[1]);
                    mac.update(v.as_bytes());
                }
                None => {
                    mac.update(&[0]);
                }
            }
        }
        let tag = mac.finalize();
        let mut p = [0u8; 16];
        p.copy_from_slice(&tag.as_bytes()[..16]);
        Principal(p)
    }

    /// Whether the caller of `inb` may attach to `session`'s streams, per `--resume-auth`:
    /// decided on first use and remembered for the rest of the request.
    pub(super) async fn authorized(&self, inb: &mut Inbound, session: &Session) -> bool {
        if let Some(known) = inb.authorized {
            return known;
        }
        let ok = match self.cfg.resume_auth {
            ResumeAuth::None => true,
            ResumeAuth::Principal => session.principal() == inb.principal,
            // The upstream never knew a minted session: it can vouch for credentials, not
            // for whose session it is.
            ResumeAuth::Upstream if session.minted() => session.principal() == inb.principal,
            ResumeAuth::Upstream => {
                // Asked of the session's own endpoint, whatever path the caller used.
                let endpoint = http::Uri::try_from(session.endpoint()).unwrap_or_default();
                let ok = self.upstream_accepts(&inb.parts.headers, &endpoint).await;
                if ok {
                    // Credentials rotate (token refresh): bind to the latest accepted one.
                    session.set_principal(inb.principal);
                }
                ok
            }
        };
        inb.authorized = Some(ok);
        ok
    }

    /// Asks the upstream whether the caller's credentials are good for this session: a
    /// JSON-RPC `ping` with the caller's headers must succeed.
    async fn upstream_accepts(&self, headers: &HeaderMap, uri: &http::Uri) -> bool {
        const PING_ID: &str = "mcp-reattach-resume-auth";
        let headers = own_request_headers(
            headers,
            Some("application/json"),
            "application/json, text/event-stream",
        );
        let body = format!(r#"{{"jsonrpc":"2.0","id":"{PING_ID}","method":"ping"}}"#);
        let body = full_body(Bytes::from(body));
        let upstream = self
            .upstream
            .request(&Method::POST, uri, &headers, None, body, None);
        let check = async {
            let resp = self.upstream.send(upstream).await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let bytes = Limited::new(resp.into_body(), 1 << 20)
                .collect()
                .await
                .ok()?
                .to_bytes();
            // JSON or SSE: either way the answer is a response to our id with a result.
            let text = String::from_utf8_lossy(&bytes);
            let answered = text.lines().any(|l| {
                let json = l.strip_prefix("data:").map_or(l, str::trim_start);
                serde_json::from_str::<serde_json::Value>(json)
                    .is_ok_and(|v| v["id"] == PING_ID && v.get("result").is_some())
            });
            answered.then_some(())
        };
        matches!(
            tokio::time::timeout(self.cfg.upstream_header_timeout, check).await,
            Ok(Some(()))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use http::header::HeaderValue;

    #[test]
    fn the_principal_is_a_keyed_mac_of_the_credential() {
        let conn = Conn {
            remote: "127.0.0.1:1".parse().unwrap(),
            kill: Default::default(),
            client_subject: None,
        };
        let of = |gw: &Gateway, auth: Option<&str>| {
            let mut h = HeaderMap::new();
            if let Some(a) = auth {
                h.insert(header::AUTHORIZATION, HeaderValue::from_str(a).unwrap());
            }
            gw.principal(&h, &conn)
        };
        let gw = Gateway::new(Config::new("http://127.0.0.1:1".parse().unwrap()));
        let other = Gateway::new(Config::new("http://127.0.0.1:1".parse().unwrap()));
        let a = of(&gw, Some("Bearer a"));
        assert_eq!(a, of(&gw, Some("Bearer a")), "stable within a process");
        assert_ne!(a, of(&gw, Some("Bearer b")));
        assert_ne!(
            of(&gw, None),
            of(&gw, Some("")),
            "no header is not an empty one"
        );
        assert_ne!(
            a,
            of(&other, Some("Bearer a")),
            "the key is random per gateway"
        );
        assert_ne!(a.0, [0; 16]);
    }
}
