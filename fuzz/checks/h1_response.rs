//! The upstream response reader (`mcp_reattach::http1`: head and body framing) against arbitrary
//! bytes, as the gateway reads its own upstream `GET`s.
//!
//! Input: `[split seeds...][0xFF separator][response bytes]` (no separator: no seeds).
//!
//! Properties:
//! 1. No panic, whatever the bytes.
//! 2. Split invariance: reading the response in arbitrary pieces (the head re-parsed as bytes
//!    accumulate, as `upstream::get` does; then the body decoder fed each piece) gives the same
//!    head, the same body data, the same end, and the same error, as reading it whole.
//! 3. The decoder hands out only bytes of its input, in order, never more than it was given,
//!    and says it used the whole input unless the body ended.
//! 4. Round trip: the body bytes, chunked at sizes taken from the seeds (with an extension and
//!    a trailer when the first seed says so), decode to exactly themselves, ending at the end.
//!
//! Shared by the fuzz target (`fuzz/fuzz_targets/h1_response.rs`) and the corpus replay
//! (`tests/fast/fuzz_corpora.rs`).

use mcp_reattach::internals::{parse_head, take_head, BodyDecoder, Framing, Http1Error as Error};

/// What reading a response gave: its head (status, framing, header count, length), its body
/// data, whether the body ended, how many bytes followed its end, the first error.
#[derive(Debug, PartialEq, Eq)]
struct Read {
    head: Option<(u16, Framing, usize, usize)>,
    data: Vec<u8>,
    done: bool,
    after: usize,
    error: Option<Error>,
}

/// Property: `take_head` on a read buffer holding `wire` gives what `parse_head` gives, and
/// leaves exactly the bytes after the head in the buffer. Returns `parse_head`'s result.
fn agreed_head(wire: &[u8]) -> Result<Option<(mcp_reattach::internals::Head, usize)>, Error> {
    let parsed = parse_head(wire);
    let mut buf = bytes::BytesMut::from(wire);
    match (&parsed, take_head(&mut buf)) {
        (Ok(Some((p, len))), Ok(Some(t))) => {
            assert_eq!(
                (p.status, p.framing, p.keep_alive, &p.headers),
                (t.status, t.framing, t.keep_alive, &t.headers)
            );
            assert_eq!(&wire[*len..], &buf[..]);
        }
        (Ok(None), Ok(None)) => {}
        (Err(a), Err(b)) => assert_eq!(a, &b),
        (p, t) => panic!("parse_head gave {p:?} but take_head {t:?}"),
    }
    parsed
}

/// Reads `wire` cut at `points` (sorted, in range).
fn read(wire: &[u8], points: &[usize]) -> Read {
    let mut r = Read {
        head: None,
        data: Vec::new(),
        done: false,
        after: 0,
        error: None,
    };
    let mut decoder: Option<BodyDecoder> = None;
    let mut prev = 0;
    for &p in points.iter().chain(std::iter::once(&wire.len())) {
        let (from, to) = (prev, p);
        prev = p;
        let piece = match &mut decoder {
            Some(_) => &wire[from..to],
            None => match agreed_head(&wire[..to]) {
                Err(e) => {
                    r.error = Some(e);
                    return r;
                }
                Ok(None) => continue,
                Ok(Some((head, len))) => {
                    r.head = Some((head.status.as_u16(), head.framing, head.headers.len(), len));
                    decoder = Some(BodyDecoder::new(head.framing));
                    &wire[len..to]
                }
            },
        };
        let d = decoder.as_mut().expect("set above");
        let before = r.data.len();
        let mut next = 0;
        match d.decode(piece, |s| {
            // Property 3: each slice is the next bytes of the piece's body data.
            assert!(s.len() <= piece.len());
            r.data.extend_from_slice(s);
            next += s.len();
        }) {
            Err(e) => {
                r.error = Some(e);
                return r;
            }
            Ok(used) => {
                assert!(
                    used <= piece.len() && next <= used,
                    "used {used} of {}",
                    piece.len()
                );
                assert!(r.data.len() - before <= piece.len());
                if used < piece.len() {
                    assert!(d.is_done(), "input left over before the end");
                    r.after = wire.len() - (to - piece.len() + used);
                    r.done = true;
                    return r;
                }
            }
        }
        r.done = d.is_done();
        if r.done {
            r.after = wire.len() - to;
            // Nothing more is read once the body ended.
            return r;
        }
    }
    if let (Some(d), None) = (&decoder, &r.error) {
        if let Err(e) = d.at_eof() {
            r.error = Some(e);
        }
    }
    r
}

fn points(seeds: &[u8], len: usize) -> Vec<usize> {
    let mut p: Vec<usize> = seeds
        .chunks(2)
        .map(|c| c.iter().fold(0usize, |a, &b| (a << 8) | b as usize) % (len + 1))
        .collect();
    p.sort_unstable();
    p.dedup();
    p
}

pub fn check(input: &[u8]) {
    let (seeds, wire) = match input.iter().position(|&b| b == 0xFF) {
        Some(i) => (&input[..i], &input[i + 1..]),
        None => (&[][..], input),
    };
    let whole = read(wire, &[]);
    let split = read(wire, &points(seeds, wire.len()));
    assert_eq!(whole, split, "split invariance");

    // Round trip of the body bytes as a chunked body.
    let body = wire;
    let mut chunked = Vec::new();
    let mut at = 0;
    let mut sizes = seeds.iter().map(|&s| s as usize + 1).cycle();
    let decorate = seeds.first().is_some_and(|s| s & 1 == 1);
    while at < body.len() {
        let n = sizes.next().unwrap_or(body.len()).min(body.len() - at);
        chunked.extend_from_slice(format!("{n:x}").as_bytes());
        if decorate {
            chunked.extend_from_slice(b";x=y");
        }
        chunked.extend_from_slice(b"\r\n");
        chunked.extend_from_slice(&body[at..at + n]);
        chunked.extend_from_slice(b"\r\n");
        at += n;
    }
    chunked.extend_from_slice(if decorate {
        b"0\r\nt: 1\r\n\r\n"
    } else {
        b"0\r\n\r\n"
    });
    let mut d = BodyDecoder::new(Framing::Chunked);
    let mut got = Vec::new();
    let cut = points(seeds, chunked.len());
    let mut prev = 0;
    for p in cut.into_iter().chain(std::iter::once(chunked.len())) {
        let used = d
            .decode(&chunked[prev..p], |s| got.extend_from_slice(s))
            .expect("a well-formed chunked body decodes");
        assert_eq!(used, p - prev);
        prev = p;
    }
    assert!(d.is_done(), "the chunked body ended");
    assert_eq!(got, body, "round trip");
}
