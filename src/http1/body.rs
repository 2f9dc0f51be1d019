//! HTTP/1.1 bodies, pure: the decoder of a body's framing ([`BodyDecoder`]: `Content-Length`,
//! `chunked` or close-delimited; one pass over each read, the data handed out as slices of
//! it), and the encoder's chunk framing ([`encode_chunk`], [`LAST_CHUNK`]).
//! Strict (RFC 9112 §7.1): a chunk size that is not hex or overflows, a missing CRLF, a
//! trailer line that is not a header line, oversized extensions or trailers are errors.
//! Its errors name the upstream as the peer; a caller decoding a client's body says so
//! ([`Error::of`](super::Error::of)).

use super::error::{Error, Kind, Peer};
use super::limits::{MAX_EXTENSION_BYTES, MAX_TRAILER_BYTES};

/// How the body of a response ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Exactly this many bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// At the end of the connection.
    Close,
}

/// Hands the next up to `left` bytes of `input` from `*i` to `data`, moves `*i` past them, and
/// returns how many bytes are left after them.
fn take<'a>(left: u64, input: &'a [u8], i: &mut usize, data: &mut impl FnMut(&'a [u8])) -> u64 {
    let n = usize::try_from(left)
        .unwrap_or(usize::MAX)
        .min(input.len() - *i);
    data(&input[*i..*i + n]);
    *i += n;
    left - n as u64
}

/// Where a chunked body's decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// In a chunk-size line: the size so far and its digit count.
    Size(u64, u8),
    /// After the size: whitespace before `;` or CR.
    SizeWs(u64),
    /// In a chunk extension (dropped).
    Ext(u64),
    /// After the size line's CR.
    SizeLf(u64),
    /// In a chunk's data, this many bytes left.
    Data(u64),
    /// After a chunk's data: its CR, then its LF.
    DataCr,
    DataLf,
    /// After the last chunk: at the start of a trailer line (or of the final CRLF).
    TrailerStart,
    /// In a trailer line's name.
    TrailerName,
    /// In a trailer line's value (after its colon).
    TrailerValue,
    /// After a trailer line's CR.
    TrailerLf,
    /// After the final CR.
    EndLf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Length(u64),
    Chunked(Chunk),
    Close,
    Done,
}

/// A whole chunk-size line without extensions at the start of `input` (1 to 16 hex digits,
/// then CRLF): the size and the line's length. `None` for anything else, complete or not: the
/// byte-by-byte path decides those (and gives the errors).
fn size_line(input: &[u8]) -> Option<(u64, usize)> {
    let mut n = 0u64;
    for (k, &b) in input.iter().enumerate().take(17) {
        match b {
            b'\r' if k > 0 => return (input.get(k + 1) == Some(&b'\n')).then_some((n, k + 2)),
            _ if k < 16 => n = n << 4 | u64::from((b as char).to_digit(16)?),
            _ => return None,
        }
    }
    None
}

/// Whether `b` may be in a header (or trailer) name: RFC 9110 §5.6.2's `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The incremental decoder of a response body: feed it each read, get the data as slices of
/// it. Bounded: it keeps a few integers, never bytes.
#[derive(Debug, Clone)]
pub struct BodyDecoder {
    state: State,
    /// Extension bytes seen so far (bounded).
    extension: usize,
    /// Trailer bytes still allowed.
    trailer_left: usize,
}

impl BodyDecoder {
    pub fn new(framing: Framing) -> BodyDecoder {
        BodyDecoder::with_trailer_limit(framing, MAX_TRAILER_BYTES)
    }

    /// A decoder whose trailers may have at most `max` bytes (and at most
    /// [`MAX_TRAILER_BYTES`]): a request's trailers are held to the request head's bound.
    pub fn with_trailer_limit(framing: Framing, max: usize) -> BodyDecoder {
        let state = match framing {
            Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(Chunk::Size(0, 0)),
            Framing::Close => State::Close,
        };
        BodyDecoder {
            state,
            extension: 0,
            trailer_left: max.min(MAX_TRAILER_BYTES),
        }
    }

    /// One more byte of trailers.
    fn trailer_byte(&mut self) -> Result<(), Error> {
        self.trailer_left = self.trailer_left.checked_sub(1).ok_or(Error::new(
            Kind::Chunk,
            Peer::Upstream,
            "trailers too large",
        ))?;
        Ok(())
    }

    /// The bytes of body data still to come, when the framing says (`Content-Length`).
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// Whether the body has ended (its length read, its last chunk and trailers read).
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Decodes `input`, handing each piece of body data to `data` in order. Returns how many
    /// bytes of `input` belong to the body: fewer than `input.len()` only once the body has
    /// ended (the rest is bytes the upstream wrote after it).
    pub fn decode<'a>(
        &mut self,
        input: &'a [u8],
        mut data: impl FnMut(&'a [u8]),
    ) -> Result<usize, Error> {
        let mut i = 0;
        while i < input.len() {
            match self.state {
                State::Done => return Ok(i),
                State::Close => {
                    data(&input[i..]);
                    return Ok(input.len());
                }
                State::Length(left) => {
                    let left = take(left, input, &mut i, &mut data);
                    self.state = if left == 0 {
                        State::Done
                    } else {
                        State::Length(left)
                    };
                }
                State::Chunked(Chunk::Data(left)) => {
                    let left = take(left, input, &mut i, &mut data);
                    self.state = State::Chunked(if left == 0 {
                        Chunk::DataCr
                    } else {
                        Chunk::Data(left)
                    });
                }
                // The common framing in one step when it is whole in this read: a bare size
                // line, the CRLF after a chunk's data. Anything else goes byte by byte.
                State::Chunked(Chunk::Size(0, 0))
                    if let Some((n, used)) = size_line(&input[i..]) =>
                {
                    // The usual small chunk whole in this read, the CRLF after its data too:
                    // taken at once, back at the next size line (one pass of this loop a
                    // chunk, not three).
                    let data_at = i + used;
                    let end = usize::try_from(n)
                        .ok()
                        .filter(|&len| len > 0)
                        .and_then(|len| data_at.checked_add(len))
                        .filter(|&end| {
                            end.checked_add(2).and_then(|e| input.get(end..e)) == Some(b"\r\n")
                        });
                    if let Some(end) = end {
                        data(&input[data_at..end]);
                        i = end + 2;
                        continue;
                    }
                    self.state = State::Chunked(if n == 0 {
                        Chunk::TrailerStart
                    } else {
                        Chunk::Data(n)
                    });
                    i += used;
                }
                State::Chunked(Chunk::DataCr) if input[i..].starts_with(b"\r\n") => {
                    self.state = State::Chunked(Chunk::Size(0, 0));
                    i += 2;
                }
                State::Chunked(c) => {
                    self.state = self.chunk_byte(c, input[i])?;
                    i += 1;
                }
            }
        }
        Ok(i)
    }

    /// One byte of chunked framing (everything but chunk data).
    fn chunk_byte(&mut self, c: Chunk, b: u8) -> Result<State, Error> {
        let next = match (c, b) {
            (Chunk::Size(n, digits), _) if b.is_ascii_hexdigit() => {
                if digits >= 16 {
                    return Err(Error::new(
                        Kind::Chunk,
                        Peer::Upstream,
                        "chunk size too large",
                    ));
                }
                let d = (b as char).to_digit(16).unwrap_or(0);
                Chunk::Size(n << 4 | u64::from(d), digits + 1)
            }
            (Chunk::Size(_, 0), _) => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "chunk size is not hex",
                ))
            }
            (Chunk::Size(n, _) | Chunk::SizeWs(n), b' ' | b'\t') => Chunk::SizeWs(n),
            (Chunk::Size(n, _) | Chunk::SizeWs(n), b';') => Chunk::Ext(n),
            (Chunk::Size(n, _) | Chunk::SizeWs(n) | Chunk::Ext(n), b'\r') => Chunk::SizeLf(n),
            (Chunk::Size(..) | Chunk::SizeWs(_), _) => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "invalid byte in the chunk size line",
                ))
            }
            (Chunk::Ext(_), b'\n') => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "bare LF in a chunk extension",
                ))
            }
            (Chunk::Ext(n), _) => {
                self.extension += 1;
                if self.extension > MAX_EXTENSION_BYTES {
                    return Err(Error::new(
                        Kind::Chunk,
                        Peer::Upstream,
                        "chunk extensions too large",
                    ));
                }
                Chunk::Ext(n)
            }
            (Chunk::SizeLf(0), b'\n') => Chunk::TrailerStart,
            (Chunk::SizeLf(n), b'\n') => Chunk::Data(n),
            (Chunk::SizeLf(_), _) => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "CR without LF after the chunk size",
                ))
            }
            (Chunk::DataCr, b'\r') => Chunk::DataLf,
            (Chunk::DataCr, _) => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "chunk data longer than its size",
                ))
            }
            (Chunk::DataLf, b'\n') => Chunk::Size(0, 0),
            (Chunk::DataLf, _) => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "CR without LF after chunk data",
                ))
            }
            // Trailer lines are header lines (RFC 9112 §7.1.2, §5): a name token, a colon, a
            // value without control bytes but HTAB; no obs-fold, no bare CR or LF.
            (Chunk::TrailerStart, b'\r') => Chunk::EndLf,
            (Chunk::TrailerStart | Chunk::TrailerName | Chunk::TrailerValue, b'\n') => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "bare LF in the trailers",
                ))
            }
            (Chunk::TrailerValue, b'\r') => Chunk::TrailerLf,
            (Chunk::TrailerName, b':') => {
                self.trailer_byte()?;
                Chunk::TrailerValue
            }
            (Chunk::TrailerStart | Chunk::TrailerName, _) if is_tchar(b) => {
                self.trailer_byte()?;
                Chunk::TrailerName
            }
            (Chunk::TrailerStart | Chunk::TrailerName, _) => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "a trailer line without a valid name and colon",
                ))
            }
            (Chunk::TrailerValue, _) if b == b'\t' || (b >= b' ' && b != 0x7f) => {
                self.trailer_byte()?;
                Chunk::TrailerValue
            }
            (Chunk::TrailerValue, _) => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "a control byte in a trailer value",
                ))
            }
            (Chunk::TrailerLf, b'\n') => Chunk::TrailerStart,
            (Chunk::TrailerLf, _) => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "CR without LF in the trailers",
                ))
            }
            (Chunk::EndLf, b'\n') => return Ok(State::Done),
            (Chunk::EndLf, _) => {
                return Err(Error::new(
                    Kind::Chunk,
                    Peer::Upstream,
                    "CR without LF at the end",
                ))
            }
            (Chunk::Data(_), _) => unreachable!("chunk data is taken in bulk"),
        };
        Ok(State::Chunked(next))
    }

    /// The connection ended: fine for a close-delimited body or one that had ended, an
    /// error of [`Kind::Closed`] otherwise.
    pub fn at_eof(&self) -> Result<(), Error> {
        match self.state {
            State::Close | State::Done => Ok(()),
            _ => Err(Error::new(
                Kind::Closed,
                Peer::Upstream,
                "before the end of the body",
            )),
        }
    }
}

/// The size line of one chunk of `n` bytes (`<hex>\r\n`) in `out`; its length.
pub(crate) fn chunk_size_line(n: usize, out: &mut [u8; 18]) -> usize {
    let digits = if n == 0 {
        1
    } else {
        (usize::BITS - n.leading_zeros()).div_ceil(4) as usize
    };
    for (i, d) in out[..digits].iter_mut().rev().enumerate() {
        *d = b"0123456789abcdef"[(n >> (4 * i)) & 0xf];
    }
    out[digits] = b'\r';
    out[digits + 1] = b'\n';
    digits + 2
}

/// The end of a chunked body: its last chunk and an empty trailer section.
pub(crate) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";
/// What follows each chunk's data.
pub(crate) const CHUNK_END: &[u8] = b"\r\n";

/// One chunk of `data` (not empty: an empty chunk is the last) as the three slices written
/// for it, gathered in one write: its size line (made in `size`), the data, its CRLF.
pub(crate) fn encode_chunk<'a>(data: &'a [u8], size: &'a mut [u8; 18]) -> [&'a [u8]; 3] {
    let n = chunk_size_line(data.len(), size);
    [&size[..n], data, CHUNK_END]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const EARLY_CLOSE: Error =
        Error::new(Kind::Closed, Peer::Upstream, "before the end of the body");

    /// Decodes `input` fed in pieces cut at `cuts`: the data, the bytes after the end, done.
    fn decode_split(
        framing: Framing,
        input: &[u8],
        cuts: &[usize],
    ) -> Result<(Vec<u8>, usize, bool), Error> {
        let mut d = BodyDecoder::new(framing);
        let mut out = Vec::new();
        let mut at = 0;
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        points.push(input.len());
        points.sort_unstable();
        for p in points {
            let piece = &input[at..p];
            let used = d.decode(piece, |s| out.extend_from_slice(s))?;
            if used < piece.len() {
                return Ok((out, input.len() - (at + used), d.is_done()));
            }
            at = p;
        }
        Ok((out, 0, d.is_done()))
    }

    #[test]
    fn a_whole_bare_size_line_is_taken_in_one_step_and_nothing_else_is() {
        assert_eq!(size_line(b"c8\r\ndata"), Some((0xc8, 4)));
        assert_eq!(size_line(b"0\r\n\r\n"), Some((0, 3)));
        assert_eq!(size_line(b"FFFFFFFFFFFFFFFF\r\n"), Some((u64::MAX, 18)));
        // Left to the byte-by-byte path: incomplete, extended, padded, too long, empty, bad.
        for line in [
            &b"c8"[..],
            b"c8\r",
            b"c8;x=1\r\n",
            b"c8 \r\n",
            b"1FFFFFFFFFFFFFFFF\r\n",
            b"\r\n",
            b"g\r\n",
            b"c8\rx",
        ] {
            assert_eq!(size_line(line), None, "{:?}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn chunked_bodies() {
        let body = b"5;name=v\r\nhello\r\n1 \r\n \r\n0\r\nx-t: 1\r\n\r\nAFTER";
        let (data, after, done) = decode_split(Framing::Chunked, body, &[]).unwrap();
        assert_eq!((data.as_slice(), after, done), (&b"hello "[..], 5, true));
        for bad in [
            &b"g\r\n"[..],
            b"\r\n",
            b"5\nhello\r\n",
            b"5\r\nhelloX\r\n",
            b"5\r\nhello\rX",
            b"11111111111111111\r\n",
            b"5 5\r\n",
            b"0\r\nx-t: 1\n\r\n",
            b"0\r\n\rX",
            b"-1\r\n",
            b"5;a\nb\r\n",
            // Trailer lines that are not header lines.
            b"0\r\nbad name: 1\r\n\r\n",
            b"0\r\nx-t : 1\r\n\r\n",
            b"0\r\n: 1\r\n\r\n",
            b"0\r\nno-colon\r\n\r\n",
            b"0\r\nx-t: 1\r\n folded\r\n\r\n",
            b"0\r\n\tx-t: 1\r\n\r\n",
            b"0\r\nx-t: a\0b\r\n\r\n",
            b"0\r\nx-t: a\rb\r\n\r\n",
            b"0\r\nx-t: a\x7fb\r\n\r\n",
            b"0\r\nx\xfft: 1\r\n\r\n",
        ] {
            assert!(
                decode_split(Framing::Chunked, bad, &[]).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Sixteen hex digits is the most a size may have.
        let mut d = BodyDecoder::new(Framing::Chunked);
        assert!(d.decode(b"ffffffffffffffff\r\n", |_| {}).is_ok());
        assert_eq!(d.at_eof(), Err(EARLY_CLOSE));
        let ext = format!("1;{}\r\n", "e".repeat(MAX_EXTENSION_BYTES + 1));
        assert!(decode_split(Framing::Chunked, ext.as_bytes(), &[]).is_err());
        let trailer = format!("0\r\nx: {}\r\n\r\n", "t".repeat(MAX_TRAILER_BYTES));
        assert!(decode_split(Framing::Chunked, trailer.as_bytes(), &[]).is_err());
        // Header lines are trailer lines: values with spaces, tabs and non-ASCII bytes, empty
        // values, several lines; within a smaller bound when one is given.
        let good = b"0\r\nx-t: a b\tc \xe9\r\nx-empty:\r\nX_Odd.Name~!: 1\r\n\r\nAFTER";
        let (data, after, done) = decode_split(Framing::Chunked, good, &[]).unwrap();
        assert_eq!((data.len(), after, done), (0, 5, true));
        let mut d = BodyDecoder::with_trailer_limit(Framing::Chunked, 8);
        assert!(d.decode(b"0\r\nx: 12345\r\n\r\n", |_| {}).is_ok());
        let mut d = BodyDecoder::with_trailer_limit(Framing::Chunked, 8);
        assert!(d.decode(b"0\r\nx: 123456\r\n\r\n", |_| {}).is_err());
    }

    #[test]
    fn length_and_close_bodies_and_early_close() {
        let (data, after, done) = decode_split(Framing::Length(3), b"abcdef", &[1]).unwrap();
        assert_eq!((data.as_slice(), after, done), (&b"abc"[..], 3, true));
        let mut d = BodyDecoder::new(Framing::Length(3));
        d.decode(b"ab", |_| {}).unwrap();
        assert_eq!(d.at_eof(), Err(EARLY_CLOSE));
        let mut d = BodyDecoder::new(Framing::Close);
        let mut got = Vec::new();
        d.decode(b"any bytes", |s| got.extend_from_slice(s))
            .unwrap();
        assert_eq!((got.as_slice(), d.at_eof()), (&b"any bytes"[..], Ok(())));
        let mut d = BodyDecoder::new(Framing::Chunked);
        d.decode(b"3\r\nab", |_| {}).unwrap();
        assert_eq!(d.at_eof(), Err(EARLY_CLOSE));
        assert!(BodyDecoder::new(Framing::Length(0)).is_done());
    }

    /// A chunked encoding of `chunks` (empty chunks left out: one would end the body), with
    /// optional extensions and trailers.
    fn chunked(chunks: &[Vec<u8>], ext: bool, trailer: bool, upper: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for c in chunks.iter().filter(|c| !c.is_empty()) {
            let size = if upper {
                format!("{:X}", c.len())
            } else {
                format!("{:x}", c.len())
            };
            out.extend_from_slice(size.as_bytes());
            if ext {
                out.extend_from_slice(b" ;a=\"b\"");
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(c);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n");
        if trailer {
            out.extend_from_slice(b"x-trailer: 1\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    proptest! {
        /// However the reads cut it, a chunked body decodes to exactly its data, ends where
        /// it ends, and leaves the bytes after it alone.
        #[test]
        fn chunked_round_trips_under_any_split(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..8),
            ext: bool,
            trailer: bool,
            upper: bool,
            after in proptest::collection::vec(any::<u8>(), 0..20),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut wire = chunked(&chunks, ext, trailer, upper);
            wire.extend_from_slice(&after);
            let (data, left, done) = decode_split(Framing::Chunked, &wire, &cuts).unwrap();
            prop_assert_eq!(data, chunks.concat());
            prop_assert_eq!(left, after.len());
            prop_assert!(done);
        }

        /// A length-delimited body is exactly its length, however it is cut.
        #[test]
        fn length_round_trips_under_any_split(
            body in proptest::collection::vec(any::<u8>(), 1..600),
            extra in proptest::collection::vec(any::<u8>(), 0..20),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut wire = body.clone();
            wire.extend_from_slice(&extra);
            let (data, left, done) = decode_split(Framing::Length(body.len() as u64), &wire, &cuts).unwrap();
            prop_assert_eq!(data, body);
            prop_assert_eq!(left, extra.len());
            prop_assert!(done);
        }

        /// Arbitrary bytes never panic the decoder, and the verdict does not depend on how
        /// the bytes were cut.
        #[test]
        fn arbitrary_bytes_decode_the_same_whatever_the_cuts(
            wire in proptest::collection::vec(any::<u8>(), 0..200),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let whole = decode_split(Framing::Chunked, &wire, &[]);
            let split = decode_split(Framing::Chunked, &wire, &cuts);
            prop_assert_eq!(whole, split);
        }
    }
}
