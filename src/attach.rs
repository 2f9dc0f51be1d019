//! The response body of a client attached to a tagged stream: it pulls retained events from
//! its session (several per frame when several are ready), sends keep-alive comments while
//! idle, and tells the session when the client goes away (a detach, never a cancel).
//!
//! Knows the session API and hyper's `Body` trait; nothing of requests or the upstream.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio::time::{Instant, Sleep};

use crate::access::StreamStats;
use crate::session::{Attachment, Session, Step};
use crate::sse::KEEPALIVE;

/// Body of a gateway-served SSE response for one attached client.
pub struct AttachBody {
    session: Arc<Session>,
    stream: u32,
    generation: u64,
    prelude: Option<Bytes>,
    keepalive: Option<(Duration, Pin<Box<Sleep>>)>,
    done: bool,
    stats: Arc<StreamStats>,
}

impl AttachBody {
    pub fn new(
        session: Arc<Session>,
        attachment: Attachment,
        keepalive: Option<Duration>,
    ) -> AttachBody {
        AttachBody {
            session,
            stream: attachment.stream,
            generation: attachment.generation,
            prelude: attachment.opening,
            keepalive: None,
            done: false,
            stats: StreamStats::new(0),
        }
        .keep_alive(keepalive)
    }

    /// Sends keep-alive comments every `every` while the client waits for events.
    pub fn keep_alive(mut self, every: Option<Duration>) -> AttachBody {
        self.keepalive = every.map(|d| (d, Box::pin(tokio::time::sleep(d))));
        self
    }

    fn reset_keepalive(&mut self) {
        if let Some((d, sleep)) = &mut self.keepalive {
            sleep.as_mut().reset(Instant::now() + *d);
        }
    }

    /// Counts this body reports to the access log.
    pub fn stats(&self) -> Arc<StreamStats> {
        self.stats.clone()
    }

    /// Records that `n` retained events were replayed to this client.
    pub fn with_replayed(mut self, n: usize) -> AttachBody {
        self.stats = StreamStats::new(n as u64);
        self
    }

    fn data(&mut self, b: Bytes) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(Some(Ok(Frame::data(b))))
    }
}

impl Body for AttachBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(p) = this.prelude.take() {
            this.reset_keepalive();
            return this.data(p);
        }
        match this
            .session
            .poll_step(this.stream, this.generation, cx.waker())
        {
            Step::Data(b, events) => {
                this.stats.add_events(events);
                this.reset_keepalive();
                this.data(b)
            }
            Step::Finish(b, outcome) => {
                this.done = true;
                this.stats.set_outcome(outcome);
                if b.is_empty() {
                    Poll::Ready(None)
                } else {
                    this.data(b)
                }
            }
            Step::Pending => {
                if let Some((d, sleep)) = &mut this.keepalive {
                    if sleep.as_mut().poll(cx).is_ready() {
                        sleep.as_mut().reset(Instant::now() + *d);
                        return this.data(Bytes::from_static(KEEPALIVE));
                    }
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

impl Drop for AttachBody {
    fn drop(&mut self) {
        self.session.detach(self.stream, self.generation);
    }
}
