//! The gateway's own HTTP/1.1, as one layer, both sides: the client side's connections
//! (HTTP/2 stays hyper's) and every exchange with the upstream.
//!
//! | file | owns | must not know |
//! |---|---|---|
//! | `limits` | the bounds an upstream's messages are held to | |
//! | `error` | the one [`Error`]: a `Kind`, a `Peer`, each mapped to a status and a metric | I/O |
//! | `head` | heads, pure: the upstream's response heads ([`parse_head`], [`take_head`]), a client's request heads (`take_request`), the response heads written (`response_head`), a request head's lines (`request_line`, `header_line`, `end_request_head`), the framing a head says | I/O, clocks, what goes in a forwarded head (`X-Forwarded-*` is the upstream request builder's) |
//! | `body` | bodies, pure: the decoder ([`BodyDecoder`]) and the encoder's chunk framing (`encode_chunk`) | I/O |
//! | `read` | the one read policy: how a connection's bytes fill a buffer, under which bound | what the bytes mean |
//! | `client` | the upstream side's connection: a request written, its answer's head read, its body read on the connection by whoever polls it; whether the connection may carry another request | the pool, the bound on connections (`Release` is the caller's) |
//! | `server` | the client side's connection: requests read, bodies fed, responses written, pipelining, the drain's stop, its state named (`Reading`) | routes, sessions |
//!
//! Strict where a reverse proxy must be (RFC 9112 §6.3, §7.1): `Transfer-Encoding` with
//! `Content-Length`, differing lengths, a transfer coding other than `chunked` alone, a chunk
//! size that is not hex or overflows, a missing CRLF, a trailer line that is not a header
//! line (a name token, a colon, a value without control bytes), and oversized heads, extensions
//! or trailers are errors, never guesses. The pure parts know no I/O and no clocks (see
//! `docs/design.md`, "The upstream streams the gateway reads itself").

mod body;
pub(crate) mod client;
mod error;
mod head;
mod limits;
pub(crate) mod read;
pub(crate) mod server;

pub use self::body::{BodyDecoder, Framing};
pub use self::error::Error;
pub(crate) use self::error::Kind;
pub(crate) use self::head::{end_request_head, header_line, request_line};
pub use self::head::{parse_head, parse_request, take_head, Head};
