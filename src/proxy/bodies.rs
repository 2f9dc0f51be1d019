//! The bound of all request bodies held at once (`--max-buffered-request-bytes`): the gateway
//! reads every body whole (to learn what a POST carries, then forwards it byte-identical), so
//! without a global bound, many slow bodies each within `--max-request-bytes` add up to what
//! the process has. A body takes its room as it is read ([`Room`]) and holds it until its bytes
//! are dropped ([`held`]: after they were sent upstream, or the request is done).
//!
//! Knows request bodies as bytes; nothing of what they carry or of routes.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::exchange::{BoxError, UpBody};

/// The bytes of all request bodies held now, against their bound.
#[derive(Debug)]
pub(crate) struct Bodies {
    used: AtomicUsize,
    limit: usize,
}

impl Bodies {
    pub(super) fn new(limit: usize) -> Bodies {
        Bodies {
            used: AtomicUsize::new(0),
            limit,
        }
    }

    /// Bytes of request bodies held now (the `buffered_request_bytes` gauge).
    pub(super) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The bound (`--max-buffered-request-bytes`).
    pub(super) fn limit(&self) -> usize {
        self.limit
    }

    /// Takes `n` more bytes if they fit under the bound.
    fn take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.limit)
            })
            .is_ok()
    }
}

/// The room one request body holds in [`Bodies`], given back when dropped.
#[derive(Debug)]
pub(crate) struct Room {
    bodies: Arc<Bodies>,
    held: usize,
}

impl Room {
    pub(super) fn new(bodies: &Arc<Bodies>) -> Room {
        Room {
            bodies: bodies.clone(),
            held: 0,
        }
    }

    /// Makes the room at least `n` bytes (a declared length up front, or what has arrived);
    /// `false` when the rest does not fit under the bound (the room stays as it was).
    pub(super) fn cover(&mut self, n: usize) -> bool {
        let more = n.saturating_sub(self.held);
        if more == 0 || self.bodies.take(more) {
            self.held += more;
            true
        } else {
            false
        }
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        self.bodies.used.fetch_sub(self.held, Ordering::AcqRel);
    }
}

/// The bound was reached: the error a body being read ends with (see [`Counted`]).
#[derive(Debug, thiserror::Error)]
#[error("the request bodies held at once are at --max-buffered-request-bytes")]
pub(crate) struct Full;

/// A body being read that takes its room in [`Bodies`] as its chunks arrive, and ends with
/// [`Full`] when the next one does not fit.
pub(crate) struct Counted<'a, B> {
    pub body: B,
    pub room: &'a mut Room,
    pub read: usize,
}

impl<B> Body for Counted<'_, B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match std::task::ready!(Pin::new(&mut this.body).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    this.read += data.len();
                    if !this.room.cover(this.read) {
                        return Poll::Ready(Some(Err(Box::new(Full))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(e.into()))),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A body read whole, as sent upstream: it keeps its `room` until it is dropped.
pub(crate) fn held(bytes: Bytes, room: Room) -> UpBody {
    Held {
        bytes: (!bytes.is_empty()).then_some(bytes),
        _room: room,
    }
    .boxed_unsync()
}

struct Held {
    bytes: Option<Bytes>,
    _room: Room,
}

impl Body for Held {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(self.bytes.take().map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.bytes.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.bytes.as_ref().map_or(0, |b| b.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_share_the_bound_and_give_it_back() {
        let bodies = Arc::new(Bodies::new(100));
        let mut a = Room::new(&bodies);
        assert!(a.cover(60));
        assert!(a.cover(40), "no more than it holds");
        let mut b = Room::new(&bodies);
        assert!(!b.cover(41), "over the bound");
        assert!(b.cover(40));
        assert_eq!(bodies.used(), 100);
        assert!(!b.cover(41), "not even one byte more");
        assert_eq!(bodies.used(), 100, "a refusal takes nothing");
        drop(a);
        assert_eq!(bodies.used(), 40);
        let body = held(Bytes::from_static(b"{}"), b);
        assert_eq!(body.size_hint().exact(), Some(2));
        assert_eq!(bodies.used(), 40, "held with its bytes");
        drop(body);
        assert_eq!(bodies.used(), 0);
    }
}
