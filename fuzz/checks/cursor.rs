//! The cursor (event id) codec.
//!
//! Properties:
//! 1. `Cursor::parse` never panics, on any bytes.
//! 2. Only the canonical spelling parses: parsed → displayed is the input, byte for byte.
//! 3. Every cursor round-trips: parse(display(c)) == c, and its display is a valid SSE id of
//!    at most `MAX_CURSOR_LEN` bytes.
//!
//! Shared by the fuzz target (`fuzz/fuzz_targets/cursor.rs`) and the corpus replay
//! (`tests/fast/fuzz_corpora.rs`), so every input the fuzzer ever kept stays a regression test.

use mcp_reattach::internals::is_valid_id;
use mcp_reattach::internals::{Cursor, CursorError, MAX_CURSOR_LEN};

/// Checks every property above on one input; panics on a violation. Called by the fuzz
/// target and by the corpus replay in `tests/fast/fuzz_corpora.rs`.
pub fn check(input: &[u8]) {
    match Cursor::parse(input) {
        Ok(c) => {
            let text = c.to_string();
            assert_eq!(text.as_bytes(), input, "non-canonical spelling accepted");
            assert!(input.len() <= MAX_CURSOR_LEN);
        }
        Err(CursorError::TooLong) => assert!(input.len() > MAX_CURSOR_LEN),
        Err(CursorError::Malformed) => assert!(input.len() <= MAX_CURSOR_LEN),
    }
    // Structured: the first 20 bytes as a cursor.
    if input.len() >= 20 {
        let epoch = u64::from_le_bytes(input[0..8].try_into().unwrap());
        let stream = u32::from_le_bytes(input[8..12].try_into().unwrap());
        let seq = u64::from_le_bytes(input[12..20].try_into().unwrap());
        let c = Cursor { epoch, stream, seq };
        let text = c.to_string();
        assert!(text.len() <= MAX_CURSOR_LEN, "{text}");
        assert!(is_valid_id(&text), "{text:?}");
        assert_eq!(Cursor::parse(text.as_bytes()), Ok(c));
        // Any one-byte change of a canonical id either fails or is another canonical id.
        if input.len() > 21 {
            let mut t = text.into_bytes();
            let i = input[20] as usize % t.len();
            t[i] = input[21];
            if let Ok(c2) = Cursor::parse(&t) {
                assert_eq!(c2.to_string().as_bytes(), &t[..]);
            }
        }
    }
}
