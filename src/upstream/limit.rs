//! The bound on upstream connections (`--max-upstream-connections`, issue 22): every
//! connection the upstream client opens takes a place, given back when the connection closes,
//! so the count is of sockets (fds), pooled idle ones included. At the bound, a new
//! connection is refused at once ([`AtLimit`]: the request gets 503 with `Retry-After`) instead
//! of the process running out of fds, where `accept` fails too and every client gets nothing.
//!
//! The held standalone streams (one per session, with no client needed) may take only part of
//! the places ([`Conns::room_to_hold`]): the rest is kept for the requests of clients.
//!
//! Clients' requests take the places in fair shares (issue 46), by the share each request
//! counts in (its principal, or for an anonymous caller its address, as the session cap
//! counts them): a request holds its share's place from its admission ([`Conns::admit`])
//! until its answer's body ends. No one share may hold the last quarter of the places, so
//! another caller always finds one free when it comes; and once the free places are within
//! that quarter, a share holding at least its fair part (the bound divided by the shares
//! holding places, the asker's included) is refused while the others are still let in. A
//! running call is never cut to make room: a share over its part gets no more until its own
//! calls end.
//!
//! Knows the connector interface of hyper-util's client and whose share a request is in;
//! nothing else of requests.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use pin_project_lite::pin_project;

use super::BoxError;
use crate::session::Principal;

/// The share of the places the held standalone streams may take: three quarters.
const HOLD_SHARE: (usize, usize) = (3, 4);
/// The part of the places no one share may take for its requests: a quarter, kept for the
/// other callers.
const RESERVE: (usize, usize) = (1, 4);

/// The places clients' requests hold now, by share; a share holding none has no entry.
type Held = std::collections::HashMap<Principal, usize, std::hash::BuildHasherDefault<MacBits>>;

/// Hashes a [`Principal`] by its first bytes: it is a keyed MAC already.
#[derive(Default)]
struct MacBits(u64);

impl std::hash::Hasher for MacBits {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes.iter().take(8) {
            self.0 = self.0 << 8 | u64::from(b);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The open upstream connections and their bound.
#[derive(Debug)]
pub(crate) struct Conns {
    open: AtomicUsize,
    max: usize,
    held: std::sync::Mutex<Held>,
}

impl Conns {
    pub(crate) fn new(max: usize) -> Conns {
        Conns {
            open: AtomicUsize::new(0),
            max: max.max(1),
            held: Default::default(),
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a request of `share` to a connection, pooled or new: its share's place, held
    /// until the [`Admitted`] is dropped. Refused ([`AtLimit`], as at the bound) when the
    /// share already holds all but the reserved quarter of the places, or, once the free
    /// places are within that quarter, at least its fair part of them.
    pub(crate) fn admit(self: &Arc<Self>, share: Principal) -> Result<Admitted, AtLimit> {
        let mut held = self.held();
        let mine = held.get(&share).copied().unwrap_or(0);
        let shares = held.len() + usize::from(mine == 0);
        let reserve = self.max * RESERVE.0 / RESERVE.1;
        let fair = self.max / shares;
        let free = self.max.saturating_sub(self.open());
        if mine >= self.max - reserve || (free <= reserve && mine >= fair) {
            return Err(AtLimit(self.max));
        }
        *held.entry(share).or_default() += 1;
        Ok(Admitted {
            conns: self.clone(),
            share,
        })
    }

    /// The places `share`'s requests hold now.
    #[cfg(test)]
    fn held_by(&self, share: Principal) -> usize {
        self.held().get(&share).copied().unwrap_or(0)
    }

    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// Whether a held standalone stream may take a connection now: the held streams leave a
    /// quarter of the places to clients' requests.
    pub(crate) fn room_to_hold(&self) -> bool {
        self.open() < self.max * HOLD_SHARE.0 / HOLD_SHARE.1
    }

    fn take(self: &Arc<Self>) -> Option<Place> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| Place(self.clone()))
    }
}

/// A request's place in its share, given back when its answer ends (or it failed).
#[derive(Debug)]
pub(crate) struct Admitted {
    conns: Arc<Conns>,
    share: Principal,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut held = self.conns.held();
        if let std::collections::hash_map::Entry::Occupied(mut e) = held.entry(self.share) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }
}

/// One open connection's place, given back when it closes.
#[derive(Debug)]
struct Place(Arc<Conns>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The connection was not opened: `--max-upstream-connections` are open, or the request's
/// share holds its part of them.
#[derive(Debug, thiserror::Error)]
#[error("no upstream connection: the bound of {0} (--max-upstream-connections) is reached, or the caller's share of it")]
pub(crate) struct AtLimit(pub usize);

impl AtLimit {
    /// The bound, if `e` (an upstream client error) is this one anywhere in its source chain.
    pub(crate) fn find(e: &(dyn std::error::Error + 'static)) -> Option<usize> {
        let mut cur = Some(e);
        while let Some(e) = cur {
            if let Some(AtLimit(max)) = e.downcast_ref::<AtLimit>() {
                return Some(*max);
            }
            cur = e.source();
        }
        None
    }
}

/// A connector that opens a connection only when it has a place for it.
#[derive(Clone, Debug)]
pub(crate) struct Counted<C> {
    inner: C,
    conns: Arc<Conns>,
}

impl<C> Counted<C> {
    pub(crate) fn new(inner: C, conns: Arc<Conns>) -> Counted<C> {
        Counted { inner, conns }
    }
}

impl<C> tower_service::Service<Uri> for Counted<C>
where
    C: tower_service::Service<Uri>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = CountedIo<C::Response>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let Some(place) = self.conns.take() else {
            let max = self.conns.max;
            return Box::pin(async move { Err(AtLimit(max).into()) });
        };
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let io = connecting.await.map_err(Into::into)?;
            Ok(CountedIo { io, _place: place })
        })
    }
}

pin_project! {
    /// An upstream connection holding its place until it is dropped (closed).
    #[derive(Debug)]
    pub(crate) struct CountedIo<T> {
        #[pin]
        io: T,
        _place: Place,
    }
}

impl<T> CountedIo<T> {
    /// The connection itself.
    pub(crate) fn get_ref(&self) -> &T {
        &self.io
    }
}

impl<T: Connection> Connection for CountedIo<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

impl<T: hyper::rt::Read> hyper::rt::Read for CountedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.project().io.poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write> hyper::rt::Write for CountedIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write_vectored(cx, bufs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_service::Service;

    /// A connector that always connects (to nothing: a unit value stands for the socket).
    #[derive(Clone)]
    struct Always;

    impl Service<Uri> for Always {
        type Response = ();
        type Error = BoxError;
        type Future = std::future::Ready<Result<(), BoxError>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: Uri) -> Self::Future {
            std::future::ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn connections_past_the_bound_are_refused_and_places_come_back_on_close() {
        let conns = Arc::new(Conns::new(2));
        let mut c = Counted::new(Always, conns.clone());
        let uri: Uri = "http://u".parse().unwrap();
        let a = c.call(uri.clone()).await.unwrap();
        let b = c.call(uri.clone()).await.unwrap();
        assert_eq!(conns.open(), 2);
        let refused = c.call(uri.clone()).await.unwrap_err();
        assert_eq!(AtLimit::find(&*refused), Some(2), "{refused}");
        drop(a);
        assert_eq!(conns.open(), 1);
        let _c = c.call(uri).await.unwrap();
        drop(b);
        assert_eq!(conns.open(), 1);
    }

    /// Issue 46: no one share takes the last quarter of the places; once the free places are
    /// within it, a share holding its fair part is refused while another is let in; a share's
    /// places come back as its calls end.
    #[test]
    fn a_share_at_its_fair_part_is_refused_while_another_gets_in() {
        let conns = Arc::new(Conns::new(8));
        let (a, b) = (Principal([1; 16]), Principal([2; 16]));
        // An admitted call on a connection of its own, as a running call holds them.
        let call = |share| conns.admit(share).map(|adm| (adm, conns.take().unwrap()));
        let mut a_calls: Vec<_> = (0..6).map(|_| call(a).unwrap()).collect();
        assert!(call(a).is_err(), "alone, a leaves a quarter to the others");
        let b_call = call(b).expect("b, within its part, gets in");
        assert!(call(a).is_err(), "a holds more than its half");
        let b_again = call(b).expect("b gets the last place");
        assert_eq!(
            (conns.held_by(a), conns.held_by(b), conns.open()),
            (6, 2, 8)
        );
        // Three of a's calls end: a may grow again only up to its part.
        a_calls.truncate(3);
        a_calls.push(call(a).expect("room outside the reserve"));
        assert!(
            call(a).is_err(),
            "a at its half, the free places within the reserve"
        );
        assert!(call(b).is_ok(), "b below its half still gets in");
        drop((a_calls, b_call, b_again));
        assert_eq!(
            (conns.held_by(a), conns.held_by(b), conns.open()),
            (0, 0, 0)
        );
        // One place: the one share holds it, as before.
        let one = Arc::new(Conns::new(1));
        let only = one.admit(a).expect("the one place");
        assert!(one.admit(a).is_err());
        drop(only);
        assert!(one.admit(a).is_ok());
    }

    #[test]
    fn held_streams_leave_a_quarter_to_clients() {
        let conns = Arc::new(Conns::new(8));
        let places: Vec<_> = (0..6).map(|_| conns.take().unwrap()).collect();
        assert!(!conns.room_to_hold(), "6 of 8 open");
        drop(places);
        assert!(conns.room_to_hold());
    }
}
