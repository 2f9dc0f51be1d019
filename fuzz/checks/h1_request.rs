//! The client side's request reader (`mcp_reattach::internals::parse_request`, then the body's
//! framing) against arbitrary bytes, as the gateway's own HTTP/1.1 reads a client's request.
//!
//! Properties:
//! 1. No panic, whatever the bytes.
//! 2. Prefix consistency: a head that parses from a prefix of the input parses the same
//!    (method, target, version, headers, framing, length) from the whole input, and every
//!    shorter prefix of a complete head is incomplete or the same error.
//! 3. Never ambiguous: an accepted head never has both `Transfer-Encoding` and
//!    `Content-Length`, a transfer coding other than `chunked` alone, a `Transfer-Encoding`
//!    in HTTP/1.0, or differing lengths; its framing is a length or chunked, never the
//!    connection's end.
//! 4. The body decoder, fed the rest of the input, hands out only bytes of it, in order.
//!
//! Shared by the fuzz target (`fuzz/fuzz_targets/h1_request.rs`) and the corpus replay
//! (`tests/fast/fuzz_corpora.rs`).

use bytes::Bytes;
use mcp_reattach::internals::{parse_request, BodyDecoder, Framing};

/// What a parse gave, comparably.
fn summary(input: &Bytes) -> Result<Option<(String, usize, Framing, bool)>, String> {
    match parse_request(input, 100) {
        Ok(Some((head, len))) => {
            let p = &head.parts;
            let text = format!("{} {} {:?} {:?}", p.method, p.uri, p.version, p.headers);
            Ok(Some((text, len, head.framing, head.keep_alive)))
        }
        Ok(None) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

pub fn check(input: &[u8]) -> Option<Framing> {
    let whole = Bytes::copy_from_slice(input);
    let parsed = parse_request(&whole, 100);
    let (head, len) = match parsed {
        Ok(Some(h)) => h,
        Ok(None) | Err(_) => return None,
    };
    assert!(len <= input.len());
    // 3. Never ambiguous.
    let headers = &head.parts.headers;
    let te = headers
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .count();
    let cl = headers.get_all(http::header::CONTENT_LENGTH).iter().count();
    assert!(!(te > 0 && cl > 0), "TE and CL accepted together");
    match head.framing {
        Framing::Chunked => {
            assert!(te > 0 && head.parts.version == http::Version::HTTP_11);
            let codings: Vec<&[u8]> = headers
                .get_all(http::header::TRANSFER_ENCODING)
                .iter()
                .flat_map(|v| v.as_bytes().split(|&b| b == b','))
                .map(<[u8]>::trim_ascii)
                .filter(|c| !c.is_empty())
                .collect();
            assert!(codings.len() == 1 && codings[0].eq_ignore_ascii_case(b"chunked"));
        }
        Framing::Length(n) => {
            assert!(te == 0);
            if cl == 0 {
                assert_eq!(n, 0);
            }
        }
        Framing::Close => panic!("a request body framed by the connection's end"),
    }
    // 2. Prefix consistency.
    let full = summary(&whole.slice(..len));
    assert_eq!(
        full,
        summary(&whole),
        "the head's own bytes parse as the whole input does"
    );
    for cut in [len / 2, len.saturating_sub(1)] {
        if cut >= len {
            continue;
        }
        match summary(&whole.slice(..cut)) {
            Ok(None) | Err(_) => {}
            Ok(Some(s)) => panic!("a prefix of {cut} bytes of a {len}-byte head parsed: {s:?}"),
        }
    }
    // 4. The body's bytes are the input's.
    let body = &input[len..];
    let mut decoder = BodyDecoder::new(head.framing);
    let mut out = Vec::new();
    if let Ok(used) = decoder.decode(body, |d| out.extend_from_slice(d)) {
        assert!(used <= body.len());
        assert!(out.len() <= used);
    }
    Some(head.framing)
}
