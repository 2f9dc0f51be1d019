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
//! Knows how a connection is opened ([`Dialer`]) and whose share a request is in; nothing else
//! of requests.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::io::{Dialer, UpIo};
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

impl Conns {
    /// A new connection to `uri`, opened only when it has a place: at the bound, refused at
    /// once ([`AtLimit`]).
    pub(crate) async fn connect(
        self: &Arc<Self>,
        dialer: &Dialer,
        uri: &Uri,
    ) -> Result<CountedIo<UpIo>, BoxError> {
        let Some(place) = self.take() else {
            return Err(AtLimit(self.max).into());
        };
        let io = dialer.connect(uri).await?;
        Ok(CountedIo { io, _place: place })
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

impl<T: AsyncRead> AsyncRead for CountedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.project().io.poll_read(cx, buf)
    }
}

impl<T: AsyncWrite> AsyncWrite for CountedIo<T> {
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
    #[tokio::test]
    async fn connections_past_the_bound_are_refused_and_places_come_back_on_close() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: Uri = format!("http://{}/", l.local_addr().unwrap())
            .parse()
            .unwrap();
        let dialer = Dialer::new(
            crate::tls::no_roots_client_config(),
            std::time::Duration::from_secs(5),
        );
        let conns = Arc::new(Conns::new(2));
        let a = conns.connect(&dialer, &uri).await.unwrap();
        let b = conns.connect(&dialer, &uri).await.unwrap();
        assert_eq!(conns.open(), 2);
        let refused = conns.connect(&dialer, &uri).await.unwrap_err();
        assert_eq!(AtLimit::find(&*refused), Some(2), "{refused}");
        drop(a);
        assert_eq!(conns.open(), 1);
        let _c = conns.connect(&dialer, &uri).await.unwrap();
        drop(b);
        assert_eq!(conns.open(), 1);
        // A connection that could not be opened gives its place back at once.
        drop(l);
        assert!(conns.connect(&dialer, &uri).await.is_err());
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
