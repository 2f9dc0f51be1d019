//! One unit: a POST whose client left before the upstream's head. What a request's route
//! learns of it ([`Facts`]: whether it may be cancelled, its session), the bounds of the
//! exchanges left to finish on their own ([`Orphans`]), and the future that finishes in a
//! task of its own when its waiter drops it ([`FinishOnDrop`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::access::{Learned, StreamStats};

/// What a request's route learns of it, for what comes after: what becomes of a POST whose
/// client leaves before the upstream's head (cancelled with its client, a modern-era request;
/// or else finishing on its own until its session, if it named one, ends), and for the access
/// line and the per-method metrics its MCP method, its tool and the upstream's time to the
/// response head. One allocation per request, shared by the route and `Gateway::handle`.
#[derive(Default)]
pub(crate) struct Facts {
    pub(super) cancel: AtomicBool,
    pub(super) session: std::sync::OnceLock<std::sync::Weak<crate::session::Session>>,
    /// The MCP method label of a POST ([`crate::jsonrpc::method_label`]) and its tool.
    pub(super) call: std::sync::OnceLock<(&'static str, Option<Box<str>>)>,
    /// Microseconds from sending the request upstream to its response head, plus one
    /// (0: never sent).
    upstream_us: std::sync::atomic::AtomicU64,
    /// The upstream's answer had a success status.
    upstream_succeeded: AtomicBool,
    /// The counts of the stream the response serves, if it serves one (an SSE response of
    /// the gateway's: `respond`). Here, not in the response's extensions: their map is
    /// allocated on the first insert, for every streamed answer (bench/notes.md, "Figure:
    /// a request's facts").
    pub(super) stream: std::sync::OnceLock<Arc<StreamStats>>,
}

impl Learned for Facts {
    fn call(&self) -> (Option<&'static str>, Option<&str>) {
        Facts::call(self)
    }

    fn upstream_time(&self) -> Option<std::time::Duration> {
        Facts::upstream_time(self)
    }

    fn upstream_succeeded(&self) -> bool {
        self.upstream_succeeded.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for Facts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Facts")
            .field("call", &self.call.get())
            .field("upstream_time", &self.upstream_time())
            .finish_non_exhaustive()
    }
}

impl Facts {
    /// The response serves a stream of the gateway's with these counts.
    pub(super) fn stream_stats(&self, stats: Arc<StreamStats>) {
        let _ = self.stream.set(stats);
    }

    /// The upstream answered with its head, of `status`, `took` after the request was sent.
    pub(crate) fn upstream_answered(&self, took: std::time::Duration, status: http::StatusCode) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX - 1);
        self.upstream_us.store(us + 1, Ordering::Relaxed);
        self.upstream_succeeded
            .store(status.is_success(), Ordering::Relaxed);
    }

    /// The upstream's time to the response head, if the request was sent.
    pub(crate) fn upstream_time(&self) -> Option<std::time::Duration> {
        match self.upstream_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(std::time::Duration::from_micros(us - 1)),
        }
    }

    /// The MCP method label and tool of the request (a POST's), if any.
    pub(crate) fn call(&self) -> (Option<&'static str>, Option<&str>) {
        match self.call.get() {
            Some((m, t)) => (Some(m), t.as_deref()),
            None => (None, None),
        }
    }
}

/// The bounds of POSTs abandoned before the upstream's head (issue 22): at most `max` at once
/// (`--max-connections`: each stood for a connection), each for at most `limit`
/// (`--session-ttl`). Past either, the exchange is ended (the upstream request cancelled).
pub(super) struct Orphans {
    count: std::sync::atomic::AtomicUsize,
    max: usize,
    limit: std::time::Duration,
}

impl Orphans {
    pub(super) fn new(max: usize, limit: std::time::Duration) -> Orphans {
        Orphans {
            count: Default::default(),
            max,
            limit,
        }
    }

    /// Takes a place for one more orphan, if there is one.
    fn adopt(self: &Arc<Self>) -> Option<OrphanPlace> {
        self.count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| OrphanPlace(self.clone()))
    }
}

/// One orphan's place, given back when it ends.
struct OrphanPlace(Arc<Orphans>);

impl Drop for OrphanPlace {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A future that, dropped before it is done, is not cancelled: it finishes in a task of its
/// own, within the [`Orphans`] bounds, and its output is dropped there; unless `cancel` was
/// set by then, in which case dropping it cancels it. The future is `Unpin` (the caller boxes
/// it): one allocation while the caller waits for it (`bench/callgrind` JSON POST 75.8 k ->
/// 77.6 k Ir; spawning every POST and joining it cost 82.0 k).
pub(super) struct FinishOnDrop<F: Future + Unpin + Send + 'static>
where
    F::Output: Send + 'static,
{
    fut: Option<F>,
    facts: Arc<Facts>,
    orphans: Arc<Orphans>,
}

impl<F: Future + Unpin + Send + 'static> FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    pub(super) fn new(fut: F, facts: Arc<Facts>, orphans: Arc<Orphans>) -> Self {
        FinishOnDrop {
            fut: Some(fut),
            facts,
            orphans,
        }
    }
}

impl<F: Future + Unpin + Send + 'static> Future for FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let fut = self
            .fut
            .as_mut()
            .expect("FinishOnDrop polled after completion");
        let out = std::task::ready!(Pin::new(fut).poll(cx));
        self.fut = None;
        Poll::Ready(out)
    }
}

impl<F: Future + Unpin + Send + 'static> Drop for FinishOnDrop<F>
where
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(fut) = self.fut.take() else { return };
        if self.facts.cancel.load(Ordering::Relaxed) {
            return; // dropped here: cancelled
        }
        let session = self.facts.session.get().and_then(std::sync::Weak::upgrade);
        let Some(place) = self.orphans.adopt() else {
            tracing::warn!(
                max = self.orphans.max,
                "too many requests abandoned before the upstream answered: this one is cancelled"
            );
            return;
        };
        // Outside a runtime (it is being torn down) there is nothing left to finish on.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let limit = self.orphans.limit;
            rt.spawn(async move {
                let _place = place;
                let session_ended = async {
                    match &session {
                        Some(s) => s.closed().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    done = tokio::time::timeout(limit, fut) => if done.is_err() {
                        tracing::debug!(?limit, "an abandoned request's exchange ended at its bound");
                    },
                    () = session_ended => {
                        tracing::debug!("an abandoned request's exchange ended with its session");
                    }
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn finish_on_drop<F: Future + Send + 'static>(
        fut: F,
        cancel: bool,
        limit: Duration,
    ) -> FinishOnDrop<Pin<Box<F>>>
    where
        F::Output: Send + 'static,
    {
        let orphans = Arc::new(Orphans::new(usize::MAX, limit));
        let facts = Facts {
            cancel: AtomicBool::new(cancel),
            ..Facts::default()
        };
        FinishOnDrop::new(Box::pin(fut), Arc::new(facts), orphans)
    }

    #[tokio::test(start_paused = true)]
    async fn abandoned_futures_beyond_the_cap_are_cancelled_and_places_come_back() {
        let orphans = Arc::new(Orphans::new(1, Duration::from_secs(60)));
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let abandon = |orphans: &Arc<Orphans>| {
            let r = ran.clone();
            let fut = FinishOnDrop::new(
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    r.fetch_add(1, Ordering::SeqCst);
                }),
                Arc::new(Facts::default()),
                orphans.clone(),
            );
            async move {
                let _ = tokio::time::timeout(Duration::from_millis(1), fut).await;
            }
        };
        abandon(&orphans).await;
        abandon(&orphans).await; // over the cap of 1: cancelled
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        assert_eq!(
            orphans.count.load(Ordering::SeqCst),
            0,
            "its place came back"
        );
        abandon(&orphans).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_dropped_before_it_is_done_finishes_in_its_own_task() {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let fut = finish_on_drop(
            async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                d.store(true, Ordering::SeqCst);
            },
            false,
            Duration::from_secs(60),
        );
        // The waiter gives up first (the client's connection closes).
        assert!(tokio::time::timeout(Duration::from_millis(10), fut)
            .await
            .is_err());
        assert!(!done.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(done.load(Ordering::SeqCst), "it ran to the end anyway");
    }

    #[tokio::test]
    async fn a_future_awaited_to_the_end_gives_its_output_once() {
        assert_eq!(
            finish_on_drop(async { 7 }, false, Duration::from_secs(1)).await,
            7
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_future_runs_to_its_limit_and_a_cancellable_one_not_at_all() {
        for (cancel, limit, want) in [(false, 5, false), (false, 60, true), (true, 60, false)] {
            let done = Arc::new(AtomicBool::new(false));
            let d = done.clone();
            let fut = finish_on_drop(
                async move {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    d.store(true, Ordering::SeqCst);
                },
                cancel,
                Duration::from_secs(limit),
            );
            assert!(tokio::time::timeout(Duration::from_millis(10), fut)
                .await
                .is_err());
            tokio::time::sleep(Duration::from_secs(20)).await;
            assert_eq!(
                done.load(Ordering::SeqCst),
                want,
                "cancel {cancel}, limit {limit} s"
            );
        }
    }
}
