//! The bounds the HTTP/1.1 layer holds messages to, beside the client side's configured ones
//! (`--max-header-bytes`, `--max-headers`).

/// Most bytes of a response head (status line and headers).
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers in a response head.
pub(crate) const MAX_HEADERS: usize = 100;
/// Most bytes of chunk extensions over one body (they carry nothing the gateway uses).
pub(crate) const MAX_EXTENSION_BYTES: usize = 16 * 1024;
/// Most bytes of trailers after the last chunk (read and dropped); a client's request body
/// is held to the smaller of this and its head bound (`BodyDecoder::with_trailer_limit`).
pub(crate) const MAX_TRAILER_BYTES: usize = 16 * 1024;
/// Most interim (`1xx`) heads before a response's final head: an upstream that sends more
/// (an endless stream of them) is refused, not read for as long as it writes.
pub(crate) const MAX_INTERIM_HEADS: usize = 16;
