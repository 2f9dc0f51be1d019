//! The head of a request the gateway sends upstream, as it is written: the client's headers
//! less the framing ones and those the caller skips (hop-by-hop), the gateway's own, `Host`
//! when the client sent none, and `X-Forwarded-*`. Proxy policy, written with the HTTP/1.1
//! layer's lines ([`crate::http1::request_line`], [`crate::http1::header_line`]); the codec
//! knows none of it.

use http::header::{HeaderMap, HeaderName};

use crate::http1::{header_line, request_line};

/// What a proxy adds to the head of a request it forwards, as the head is written: the
/// client's address appended to the first `X-Forwarded-For` (which replaces any others; a
/// value that is not visible ASCII is replaced by the address alone), and
/// `X-Forwarded-Proto` unless the hop in front set one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Forwarded<'a> {
    /// The client's address; `None`: `X-Forwarded-For` is left as it is.
    pub(crate) for_addr: Option<&'a str>,
    /// `http` or `https`: how the client reached the gateway.
    pub(crate) proto: &'static str,
}

/// What the head of a forwarded request gets beside the client's headers.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Added<'a> {
    /// `Host`, when the client's headers have none (an HTTP/2 client's `:authority`).
    pub(crate) host: Option<&'a str>,
    /// Headers of the gateway's own (a trace context), written after the client's; a client
    /// header of the same name is left out.
    pub(crate) own: Option<&'a HeaderMap>,
    pub(crate) forwarded: Option<Forwarded<'a>>,
}

/// Writes the start of a request's head: the request line for `method` and
/// `path_and_query`, then `headers` (their values cannot hold a line break: `HeaderValue`
/// refuses them) less those `skip` names, then what `added` adds. The gateway sends every
/// body whole and frames it itself ([`crate::http1::end_request_head`]), so the framing
/// headers of `headers` are left out, and so is `Expect` (nothing waits for a `100 Continue`).
pub(crate) fn request_head(
    method: &http::Method,
    path_and_query: &str,
    headers: &HeaderMap,
    skip: impl Fn(&HeaderName) -> bool,
    added: Added<'_>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    request_line(&mut out, method, path_and_query);
    let line = header_line;
    let (mut for_written, mut proto_seen, mut host_seen) = (false, false, false);
    for (name, value) in headers {
        if name == http::header::CONTENT_LENGTH
            || name == http::header::TRANSFER_ENCODING
            || name == http::header::EXPECT
            || skip(name)
            || added.own.is_some_and(|own| own.contains_key(name))
        {
            continue;
        }
        host_seen |= name == http::header::HOST;
        if let Some(f) = added.forwarded {
            match name.as_str() {
                "x-forwarded-for" => {
                    if let Some(addr) = f.for_addr {
                        if !for_written {
                            out.extend_from_slice(b"x-forwarded-for: ");
                            if value.to_str().is_ok() {
                                out.extend_from_slice(value.as_bytes());
                                out.extend_from_slice(b", ");
                            }
                            out.extend_from_slice(addr.as_bytes());
                            out.extend_from_slice(b"\r\n");
                            for_written = true;
                        }
                        continue;
                    }
                }
                "x-forwarded-proto" => proto_seen = true,
                _ => {}
            }
        }
        line(&mut out, name.as_str().as_bytes(), value.as_bytes());
    }
    if let (Some(host), false) = (added.host, host_seen) {
        line(&mut out, b"host", host.as_bytes());
    }
    for (name, value) in added.own.into_iter().flatten() {
        line(&mut out, name.as_str().as_bytes(), value.as_bytes());
    }
    if let Some(f) = added.forwarded {
        if let (Some(addr), false) = (f.for_addr, for_written) {
            line(&mut out, b"x-forwarded-for", addr.as_bytes());
        }
        if !proto_seen {
            line(&mut out, b"x-forwarded-proto", f.proto.as_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http1::end_request_head;
    use http::header::HeaderValue;

    /// A whole request head: [`request_head`] then [`end_request_head`].
    fn whole_head(
        method: http::Method,
        h: &HeaderMap,
        skip: impl Fn(&HeaderName) -> bool,
        added: Added<'_>,
        body_len: Option<usize>,
    ) -> String {
        let mut out = request_head(&method, "/mcp?x=1", h, skip, added);
        end_request_head(&mut out, body_len);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn the_request_head_has_only_its_own_framing_and_one_line_per_header() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("up:3000"));
        h.append("x-a", HeaderValue::from_static("1"));
        h.append("x-a", HeaderValue::from_static("2"));
        h.insert("content-length", HeaderValue::from_static("9"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("expect", HeaderValue::from_static("100-continue"));
        let none = Added::default();
        assert_eq!(
            whole_head(http::Method::GET, &h, |_| false, none, None),
            "GET /mcp?x=1 HTTP/1.1\r\nhost: up:3000\r\nx-a: 1\r\nx-a: 2\r\n\r\n"
        );
        assert_eq!(
            whole_head(http::Method::POST, &h, |_| false, none, Some(42)),
            "POST /mcp?x=1 HTTP/1.1\r\nhost: up:3000\r\nx-a: 1\r\nx-a: 2\r\ncontent-length: 42\r\n\r\n"
        );
        // Skipped names are left out; Host only when the client sent none.
        let host = Added {
            host: Some("other:1"),
            ..none
        };
        assert_eq!(
            whole_head(http::Method::GET, &h, |n| n == "x-a", host, None),
            "GET /mcp?x=1 HTTP/1.1\r\nhost: up:3000\r\n\r\n"
        );
        h.remove("host");
        assert_eq!(
            whole_head(http::Method::GET, &h, |n| n == "x-a", host, None),
            "GET /mcp?x=1 HTTP/1.1\r\nhost: other:1\r\n\r\n"
        );
        // The gateway's own headers replace the client's of the same name, after the rest.
        let mut own = HeaderMap::new();
        own.insert("x-a", HeaderValue::from_static("mine"));
        h.insert("x-b", HeaderValue::from_static("b"));
        let own = Added {
            own: Some(&own),
            ..none
        };
        assert_eq!(
            whole_head(http::Method::GET, &h, |_| false, own, None),
            "GET /mcp?x=1 HTTP/1.1\r\nx-b: b\r\nx-a: mine\r\n\r\n"
        );
    }

    #[test]
    fn the_forwarded_headers_are_added_as_the_head_is_written() {
        let head = |pairs: &[(&str, &[u8])], forwarded| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(
                    HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    HeaderValue::from_bytes(v).unwrap(),
                );
            }
            let added = Added {
                forwarded,
                ..Added::default()
            };
            let mut out = request_head(&http::Method::GET, "/", &h, |_| false, added);
            end_request_head(&mut out, None);
            String::from_utf8_lossy(&out).into_owned()
        };
        let from = Some(Forwarded {
            for_addr: Some("10.0.0.7"),
            proto: "http",
        });
        // None there: both added, after the client's own headers.
        assert_eq!(
            head(&[("host", b"up")], from),
            "GET / HTTP/1.1\r\nhost: up\r\nx-forwarded-for: 10.0.0.7\r\nx-forwarded-proto: http\r\n\r\n"
        );
        // The hop in front's: the address appended to the first, in its place; the others
        // dropped; its proto kept.
        assert_eq!(
            head(
                &[
                    ("x-forwarded-for", b"1.1.1.1"),
                    ("x-forwarded-proto", b"https"),
                    ("x-forwarded-for", b"2.2.2.2"),
                    ("host", b"up"),
                ],
                from
            ),
            "GET / HTTP/1.1\r\nx-forwarded-for: 1.1.1.1, 10.0.0.7\r\nx-forwarded-proto: https\r\nhost: up\r\n\r\n"
        );
        // A value that is not visible ASCII is replaced by the address alone.
        assert_eq!(
            head(&[("x-forwarded-for", b"caf\xc3\xa9")], from),
            "GET / HTTP/1.1\r\nx-forwarded-for: 10.0.0.7\r\nx-forwarded-proto: http\r\n\r\n"
        );
        // A request the gateway sends on its own: the client's X-Forwarded-For as it is.
        let own = Some(Forwarded {
            for_addr: None,
            proto: "https",
        });
        assert_eq!(
            head(&[("x-forwarded-for", b"1.1.1.1")], own),
            "GET / HTTP/1.1\r\nx-forwarded-for: 1.1.1.1\r\nx-forwarded-proto: https\r\n\r\n"
        );
        assert_eq!(
            head(&[("x-forwarded-for", b"1.1.1.1")], None),
            "GET / HTTP/1.1\r\nx-forwarded-for: 1.1.1.1\r\n\r\n"
        );
    }
}
