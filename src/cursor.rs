//! The gateway's SSE event ids (cursors): `<epoch>.<stream>.<seq>`.
//!
//! * `epoch`: 16 lowercase hex digits, random per session state. A session the gateway
//!   forgets and meets again, or a restarted gateway, gets a new epoch, so an id from another
//!   session or an earlier run never parses as a valid cursor for this one.
//! * `stream`: decimal number of the stream within the session (POST response or GET).
//! * `seq`: decimal sequence number, strictly increasing across all streams of the session;
//!   [`Cursor::END`] is no event's: the position of a stream's end frames (the errors of an
//!   upstream that ended or failed without answering), after every event of the session.
//!
//! Pure: parsing and formatting only; what a cursor means is decided by the session layer.

use std::fmt;

/// Longest `Last-Event-ID` the gateway will look at. Ours are at most 16+1+10+1+20 bytes.
pub const MAX_CURSOR_LEN: usize = 64;

/// A parsed gateway event id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cursor {
    pub epoch: u64,
    pub stream: u32,
    pub seq: u64,
}

/// Why a `Last-Event-ID` is not a gateway cursor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CursorError {
    #[error("Last-Event-ID is longer than {MAX_CURSOR_LEN} bytes")]
    TooLong,
    #[error("Last-Event-ID is not an id this gateway issued (expected <epoch>.<stream>.<seq>)")]
    Malformed,
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}.{}.{}", self.epoch, self.stream, self.seq)
    }
}

impl Cursor {
    /// The position of a stream's end frames (`18446744073709551615`): a client that read
    /// them holds it, and a client at any event's position did not read them. The end frames
    /// are told again at a resume from an event's position; a resume at this one has had
    /// everything the stream will ever carry.
    pub const END: u64 = u64::MAX;

    /// The same stream's end position (see [`Cursor::END`]).
    pub fn end(self) -> Cursor {
        Cursor {
            seq: Self::END,
            ..self
        }
    }

    /// Appends the canonical text of this cursor to `out` (what `Display` writes, without
    /// the formatting machinery: this runs once per event sent).
    pub fn write_to(&self, out: &mut impl bytes::BufMut) {
        out.put_slice(&epoch_hex(self.epoch));
        out.put_u8(b'.');
        write_position(self.stream, self.seq, out);
    }

    /// The canonical text (what `Display` writes, without the formatting machinery, which was
    /// a visible part of every resume: bench/notes.md, "Figure: cursors").
    pub fn text(&self) -> String {
        let mut out = Vec::with_capacity(16 + 1 + POSITION_LEN);
        self.write_to(&mut out);
        String::from_utf8(out).expect("a cursor's text is ASCII")
    }

    /// Parses the canonical form only (no leading zeros, no sign, lowercase hex), so each
    /// position has exactly one spelling.
    pub fn parse(s: &[u8]) -> Result<Cursor, CursorError> {
        if s.len() > MAX_CURSOR_LEN {
            return Err(CursorError::TooLong);
        }
        // Read in one pass (splitting and `from_str_radix` cost more: bench/notes.md,
        // "Figure: cursors"): 16 hex digits and a dot, then `<stream>.<seq>`.
        let (Some(epoch), Some(b'.')) = (s.get(..16), s.get(16)) else {
            return Err(CursorError::Malformed);
        };
        let mut e = 0u64;
        for &b in epoch {
            let d = match b {
                b'0'..=b'9' => b - b'0',
                b'a'..=b'f' => b - b'a' + 10,
                _ => return Err(CursorError::Malformed),
            };
            e = e << 4 | u64::from(d);
        }
        let rest = &s[17..];
        let dot = rest
            .iter()
            .position(|&b| b == b'.')
            .ok_or(CursorError::Malformed)?;
        Ok(Cursor {
            epoch: e,
            stream: u32::try_from(decimal(&rest[..dot])?).map_err(|_| CursorError::Malformed)?,
            seq: decimal(&rest[dot + 1..])?,
        })
    }
}

/// The epoch as a cursor spells it: 16 lowercase hex digits. A session computes it once.
pub(crate) fn epoch_hex(epoch: u64) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [0u8; 16];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = HEX[((epoch >> ((15 - i) * 4)) & 0xf) as usize];
    }
    buf
}

/// Appends what follows `<epoch>.` in a cursor, `<stream>.<seq>`, in one piece.
pub(crate) fn write_position(stream: u32, seq: u64, out: &mut impl bytes::BufMut) {
    let mut buf = [0u8; POSITION_LEN];
    let n = put_position(stream, seq, &mut buf);
    out.put_slice(&buf[..n]);
}

/// The longest `<stream>.<seq>`: 10 + 1 + 20 digits.
pub(crate) const POSITION_LEN: usize = 31;

/// Writes `<stream>.<seq>` at the start of `out` (at least [`POSITION_LEN`] bytes),
/// returning its length.
pub(crate) fn put_position(stream: u32, seq: u64, out: &mut [u8]) -> usize {
    let mut n = put_decimal(u64::from(stream), out);
    out[n] = b'.';
    n += 1;
    n + put_decimal(seq, &mut out[n..])
}

/// Writes `n` in decimal at the start of `out` (room for its digits: 20 for any `u64`),
/// returning its length. In place, last digit first: formatting into a buffer and copying the digits out was a
/// `memcpy` call of a few bytes for every event id a batch writes.
pub(crate) fn put_decimal(mut n: u64, out: &mut [u8]) -> usize {
    let len = n.checked_ilog10().map_or(1, |l| l as usize + 1);
    for d in out[..len].iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    len
}

/// A canonical decimal (digits only, no leading zero but in `0`) that fits in a `u64`.
fn decimal(b: &[u8]) -> Result<u64, CursorError> {
    if b.is_empty() || (b[0] == b'0' && b.len() > 1) {
        return Err(CursorError::Malformed);
    }
    b.iter().try_fold(0u64, |n, &c| {
        if !c.is_ascii_digit() {
            return Err(CursorError::Malformed);
        }
        n.checked_mul(10)
            .and_then(|n| n.checked_add(u64::from(c - b'0')))
            .ok_or(CursorError::Malformed)
    })
}

/// A fresh random epoch for a new session state.
pub(crate) fn new_epoch() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::getrandom(&mut b).is_err() {
        // No OS randomness: fall back to std's randomly keyed SipHash over the time.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        return h.finish();
    }
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn formats_as_visible_ascii() {
        let c = Cursor {
            epoch: 0xab,
            stream: 3,
            seq: 42,
        };
        assert_eq!(c.to_string(), "00000000000000ab.3.42");
        assert!(crate::sse::is_valid_id(&c.to_string()));
    }

    #[test]
    fn the_end_position_round_trips_and_fits() {
        let c = Cursor {
            epoch: u64::MAX,
            stream: u32::MAX,
            seq: 7,
        }
        .end();
        let text = c.text();
        assert_eq!(text, "ffffffffffffffff.4294967295.18446744073709551615");
        assert!(text.len() <= MAX_CURSOR_LEN);
        assert_eq!(Cursor::parse(text.as_bytes()), Ok(c));
        assert_eq!(c.seq, Cursor::END);
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            &b""[..],
            b"1",
            b"e1",
            b"00000000000000ab.3",
            b"00000000000000ab.3.42.1",
            b"00000000000000AB.3.42",
            b"0000000000000ab.3.42",
            b"00000000000000ab.03.42",
            b"00000000000000ab.3.+42",
            b"00000000000000ab.3.-1",
            b"00000000000000ab.3.",
            b"00000000000000ab.99999999999.1",
            b"00000000000000ab.3.99999999999999999999999",
            b"00000000000000ab.4294967296.1",
            b"00000000000000ab.3.18446744073709551616",
            b"00000000000000ab..42",
            b"00000000000000ab.3.4.",
            b"00000000000000ab3.42",
            b"00000000000000ab.3.4 2",
            b"\xff\xfe",
        ] {
            assert_eq!(Cursor::parse(bad), Err(CursorError::Malformed), "{bad:?}");
        }
        assert_eq!(Cursor::parse(&[b'1'; 65]), Err(CursorError::TooLong));
    }

    #[test]
    fn epochs_differ() {
        assert_ne!(new_epoch(), new_epoch());
    }

    proptest! {
        #[test]
        fn round_trip(epoch in any::<u64>(), stream in any::<u32>(), seq in any::<u64>()) {
            let c = Cursor { epoch, stream, seq };
            let s = c.to_string();
            let mut fast = Vec::new();
            c.write_to(&mut fast);
            prop_assert_eq!(fast, s.as_bytes().to_vec());
            prop_assert_eq!(c.text(), s.clone());
            prop_assert!(s.len() <= MAX_CURSOR_LEN);
            prop_assert_eq!(Cursor::parse(s.as_bytes()), Ok(c));
        }

        #[test]
        fn put_decimal_is_std_decimal(n in prop_oneof![any::<u64>(), 0..1000u64, Just(u64::MAX)]) {
            let mut out = [0u8; 20];
            let len = put_decimal(n, &mut out);
            let std = n.to_string();
            prop_assert_eq!(&out[..len], std.as_bytes());
        }

        #[test]
        fn a_cursor_one_edit_away_parses_only_when_canonical(
            epoch in any::<u64>(),
            stream in prop_oneof![any::<u32>(), 0..20u32, Just(u32::MAX)],
            seq in prop_oneof![any::<u64>(), 0..20u64, Just(u64::MAX)],
            at in any::<proptest::sample::Index>(),
            edit in 0u8..3,
            byte in proptest::sample::select(b"0123456789afAF.-+ x".to_vec()),
        ) {
            // Near misses of a real cursor (random bytes almost never are one): a byte
            // replaced, inserted or removed. Whatever parses must be what it spells.
            let mut s = Cursor { epoch, stream, seq }.to_string().into_bytes();
            let i = at.index(s.len() + 1);
            match edit {
                0 if i < s.len() => s[i] = byte,
                1 => s.insert(i, byte),
                _ if i < s.len() => { s.remove(i); }
                _ => s.push(byte),
            }
            match Cursor::parse(&s) {
                Ok(c) => prop_assert_eq!(c.to_string().into_bytes(), s),
                Err(e) => prop_assert_eq!(e, CursorError::Malformed),
            }
        }

        #[test]
        fn parse_never_panics_and_only_accepts_canonical(s in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok(c) = Cursor::parse(&s) {
                let text = c.to_string();
                prop_assert_eq!(text.as_bytes(), &s[..]);
            }
        }
    }
}
