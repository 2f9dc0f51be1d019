//! The HTTP/1.1 layer's one read policy, for the server and the client side alike: how a
//! connection's bytes come into a read buffer ([`poll_fill`]), and how much of them a buffer
//! may hold ([`Fill`]). A buffer a connection keeps as long as it lives grows by what came,
//! never to a read's full size; one that must stay within a bound never passes it, in length
//! or in capacity; one handed on whole (an upstream's response head with the body's first
//! bytes) is read into in place.

use std::future::Future;
use std::mem::MaybeUninit;
use std::pin::{pin, Pin};
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, ReadBuf};

/// Most bytes one read takes into a connection's kept buffer.
pub(crate) const READ_BYTES: usize = 8 * 1024;

/// How a read fills its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fill {
    /// Up to [`READ_BYTES`], read into the stack first and appended, so the buffer grows by
    /// what came, never to a read's full size (a held stream's head keeps its buffer as long
    /// as the stream lives).
    Append,
    /// As [`Fill::Append`], but never past this many bytes, in length or in capacity (above
    /// the buffer's length): what a connection keeps of a next request while a response is
    /// written stays within the head bound the memory sizing assumes.
    Bounded(usize),
    /// Straight into the buffer's free room, its capacity doubled first when it is full: a
    /// buffer read once and handed on (an upstream's response head, and what followed it).
    InPlace,
}

/// One read from `io` into `into`, as `fill` says: how many bytes (0: the peer closed).
pub(crate) fn poll_fill<IO: AsyncRead + Unpin>(
    io: &mut IO,
    cx: &mut Context<'_>,
    into: &mut BytesMut,
    fill: Fill,
) -> Poll<std::io::Result<usize>> {
    let bound = match fill {
        Fill::Append => usize::MAX,
        Fill::Bounded(bound) => bound,
        Fill::InPlace => {
            if into.len() == into.capacity() {
                into.reserve(into.len().max(1));
            }
            return pin!(tokio::io::AsyncReadExt::read_buf(io, into)).poll(cx);
        }
    };
    let room = bound.saturating_sub(into.len()).min(READ_BYTES);
    let mut buf = [MaybeUninit::<u8>::uninit(); READ_BYTES];
    let mut rb = ReadBuf::uninit(&mut buf[..room]);
    ready!(Pin::new(io).poll_read(cx, &mut rb))?;
    let read = rb.filled();
    if fill != Fill::Append && into.capacity() - into.len() < read.len() {
        // Grown here rather than by `extend_from_slice`, which may double past the bound.
        let want = (into.len() + read.len())
            .max(into.capacity() * 2)
            .min(bound);
        let mut grown = BytesMut::with_capacity(want);
        grown.extend_from_slice(into);
        *into = grown;
    }
    into.extend_from_slice(read);
    Poll::Ready(Ok(read.len()))
}
