//! The drain, phase by phase, in the library (so it is tested in-process with paused time):
//!
//! 1. **not ready**: `/readyz` fails at once ([`Health`]);
//! 2. **drain delay**: the listener keeps accepting for `--drain-delay`, so load balancers
//!    notice and deregister (skipped when quick);
//! 3. **stop accepting**: the accept loop ends, every connection is told to finish gracefully
//!    (hyper-util's [`GracefulShutdown`]: no keep-alive, h2 GOAWAY), and clients of
//!    standalone GET streams, which never end on their own, are sent elsewhere at once;
//! 4. **deadline**: POST-started streams may finish until `--drain-timeout` (or until hurried);
//! 5. **end streams**: the remaining clients get `resumption-required` with a `retry:` hint,
//!    which gets [`FINAL_FLUSH`] to reach them.
//!
//! [`Shutdown`] is the trigger (`main` maps SIGTERM to [`Mode::Graceful`] and SIGINT to
//! [`Mode::Quick`]) and holds all of the shutdown's state: the mode asked for (a quick one
//! hurries the drain) and whether the drain is over ([`Shutdown::drained`], the admin
//! listener's stop). [`Shutdown::stop_accepting`] runs phases 1–2 and is the future the
//! proxy's accept loop stops on; it hands over a [`Draining`], on which [`drain`] runs
//! phases 3–5.
//!
//! A leaf the servers consume: knows the session registry, the metrics and hyper-util's
//! graceful shutdown; nothing of the gateway, its listeners or signals.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::server::graceful::GracefulShutdown;
use tokio::sync::watch;

use crate::session::Registry;

/// How long the last `retry:` hints get to reach clients after the drain deadline.
pub(crate) const FINAL_FLUSH: Duration = Duration::from_secs(2);

/// Liveness and readiness state shared with the admin listener: ready until a shutdown is
/// requested ([`Shutdown::stop_accepting`]).
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
}

impl Health {
    pub fn new() -> Arc<Health> {
        Arc::new(Health {
            ready: AtomicBool::new(true),
        })
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

/// How to shut down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Not ready, drain delay, then drain until `--drain-timeout` (SIGTERM).
    Graceful,
    /// Skip the waiting: stop accepting and end streams now (SIGINT; also cuts short a
    /// graceful shutdown already under way).
    Quick,
}

/// The shutdown trigger: cheap to clone; the strongest mode requested wins.
#[derive(Clone, Debug)]
pub struct Shutdown {
    state: Arc<State>,
}

#[derive(Debug)]
struct State {
    /// The mode requested so far.
    mode: watch::Sender<Option<Mode>>,
    /// Set when the drain is over (its [`Draining`] dropped).
    drained: watch::Sender<bool>,
}

impl Default for Shutdown {
    fn default() -> Shutdown {
        Shutdown::new()
    }
}

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown {
            state: Arc::new(State {
                mode: watch::channel(None).0,
                drained: watch::channel(false).0,
            }),
        }
    }

    /// Requests a shutdown (again: a quick request cuts a graceful one short).
    pub fn request(&self, mode: Mode) {
        self.state.mode.send_modify(|m| {
            *m = Some(match (*m, mode) {
                (Some(Mode::Quick), _) | (_, Mode::Quick) => Mode::Quick,
                _ => Mode::Graceful,
            });
        });
    }

    /// The mode requested so far, if any.
    pub fn requested(&self) -> Option<Mode> {
        *self.state.mode.borrow()
    }

    async fn wait_for(&self, pred: impl Fn(Option<Mode>) -> bool) -> Mode {
        let mut rx = self.state.mode.subscribe();
        // The sender lives in `self`: it cannot be gone while we wait.
        let mode = match rx.wait_for(|m| pred(*m)).await {
            Ok(m) => m.unwrap_or(Mode::Quick),
            Err(_) => Mode::Quick,
        };
        mode
    }

    /// Phases 1 and 2: resolves when the gateway should stop accepting, with the handle the
    /// drain runs on. Once a shutdown is requested, `health` turns not ready; a graceful one
    /// keeps accepting for `drain_delay`. A quick request, now or later during the drain,
    /// hurries it ([`Draining::hurried`]).
    pub fn stop_accepting(
        &self,
        health: Arc<Health>,
        drain_delay: Duration,
    ) -> impl Future<Output = Draining> + Send + 'static {
        let this = self.clone();
        async move {
            let mode = this.wait_for(|m| m.is_some()).await;
            health.set_ready(false);
            if mode == Mode::Graceful {
                tracing::info!(
                    ?drain_delay,
                    "shutting down: not ready; still accepting during the drain delay"
                );
                tokio::select! {
                    () = tokio::time::sleep(drain_delay) => {}
                    _ = this.wait_for(|m| m == Some(Mode::Quick)) => {}
                }
            }
            this.draining()
        }
    }

    /// The drain's handle, for a caller that decides itself when to stop accepting
    /// ([`Shutdown::stop_accepting`] hands one over).
    pub fn draining(&self) -> Draining {
        Draining {
            shutdown: self.clone(),
        }
    }

    /// Resolves once the drain is over (its [`Draining`] dropped): the admin listener's stop,
    /// so `/healthz`, `/readyz` and `/metrics` answer until the gateway is done.
    pub fn drained(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.state.drained.subscribe();
        async move {
            // The sender gone is the trigger gone: nothing is left to wait for either.
            let _ = rx.wait_for(|d| *d).await;
        }
    }
}

/// The drain's side of a [`Shutdown`]: says when a quick shutdown hurries the drain, and,
/// dropped when the drain is over, resolves [`Shutdown::drained`].
#[derive(Debug)]
pub struct Draining {
    shutdown: Shutdown,
}

impl Draining {
    /// Resolves once a quick shutdown is (or was already) requested.
    pub async fn hurried(&self) {
        self.shutdown.wait_for(|m| m == Some(Mode::Quick)).await;
    }
}

impl Drop for Draining {
    fn drop(&mut self) {
        self.shutdown.state.drained.send_replace(true);
    }
}

/// How a drain ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Drained {
    /// Every connection finished before the deadline.
    Finished,
    /// The deadline (or a quick shutdown) came first: the remaining streams were ended.
    Ended,
}

/// Phases 3 to 5, once the accept loop has stopped: tells every watched connection to finish
/// gracefully and the `registry`'s standalone clients to resume elsewhere, waits for the
/// connections until `drain_timeout` (or until [`Draining::hurried`]), then ends the
/// remaining streams and gives their hints [`FINAL_FLUSH`] to get out. `draining` is dropped
/// on return, which resolves [`Shutdown::drained`].
#[cfg(test)]
pub(crate) async fn drain(
    registry: &Registry,
    connections: GracefulShutdown,
    drain_timeout: Duration,
    draining: Draining,
) -> Drained {
    drain_then(
        registry,
        connections,
        drain_timeout,
        draining,
        std::future::ready(()),
    )
    .await
}

/// [`drain`], then `after` (the fleet's hand-over: calls read upstream into the store until
/// they end) before the drain is over (the admin listener answers until then), cut short by a
/// quick shutdown.
pub(crate) async fn drain_then(
    registry: &Registry,
    connections: GracefulShutdown,
    drain_timeout: Duration,
    draining: Draining,
    after: impl std::future::Future<Output = ()>,
) -> Drained {
    let drained = connections_drained(registry, connections, drain_timeout, &draining).await;
    tokio::select! {
        () = after => {}
        () = draining.hurried() => {}
    }
    drained
}

async fn connections_drained(
    registry: &Registry,
    connections: GracefulShutdown,
    drain_timeout: Duration,
    draining: &Draining,
) -> Drained {
    tracing::info!(
        connections = connections.count(),
        ?drain_timeout,
        "draining"
    );
    // The alerting rules compare the drain's age with this deadline (deploy/prometheus/).
    registry
        .metrics()
        .drain_started(drain_timeout + FINAL_FLUSH);
    let all_done = connections.shutdown();
    tokio::pin!(all_done);
    // Standalone GET streams never end on their own: send those clients elsewhere now.
    registry.end_clients(true);
    let finished = tokio::select! {
        () = &mut all_done => true,
        () = tokio::time::sleep(drain_timeout) => false,
        () = draining.hurried() => {
            tracing::info!("shutting down quickly");
            false
        }
    };
    if finished {
        tracing::info!("drained");
        return Drained::Finished;
    }
    tracing::info!("drain deadline: ending remaining streams");
    registry.end_clients(false);
    let _ = tokio::time::timeout(FINAL_FLUSH, all_done).await;
    tracing::info!("drained");
    Drained::Ended
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::AttachBody;
    use crate::config::Config;
    use crate::session::{OpenStream, Owner, Principal, StreamKind};
    use crate::sse::{Decoder, Event};
    use bytes::Bytes;
    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use hyper_util::rt::TokioIo;
    use std::convert::Infallible;
    use tokio::time::Instant;

    fn registry() -> Arc<Registry> {
        let cfg = Config::new("http://127.0.0.1:1".parse().unwrap());
        Arc::new(Registry::new(Arc::new(cfg), Arc::default()))
    }

    #[tokio::test(start_paused = true)]
    async fn graceful_is_not_ready_at_once_and_keeps_accepting_for_the_drain_delay() {
        let (shutdown, health) = (Shutdown::new(), Health::new());
        let stop = shutdown.stop_accepting(health.clone(), Duration::from_secs(5));
        let stop = tokio::spawn(stop);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(health.is_ready(), "nothing requested yet");
        assert!(!stop.is_finished());
        let t0 = Instant::now();
        shutdown.request(Mode::Graceful);
        tokio::task::yield_now().await;
        assert!(!health.is_ready(), "not ready at once");
        stop.await.unwrap();
        assert_eq!(
            t0.elapsed(),
            Duration::from_secs(5),
            "accepting for the delay"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn quick_cuts_the_drain_delay_short_and_hurries_the_drain() {
        let (shutdown, health) = (Shutdown::new(), Health::new());
        let stop = tokio::spawn(shutdown.stop_accepting(health.clone(), Duration::from_secs(5)));
        let t0 = Instant::now();
        shutdown.request(Mode::Graceful);
        tokio::time::sleep(Duration::from_secs(1)).await;
        shutdown.request(Mode::Quick);
        assert_eq!(shutdown.requested(), Some(Mode::Quick));
        let draining = stop.await.unwrap();
        assert_eq!(t0.elapsed(), Duration::from_secs(1));
        // The drain that follows is hurried: it ends streams without waiting its timeout.
        tokio::time::timeout(Duration::from_millis(1), draining.hurried())
            .await
            .expect("hurried");
        // A graceful request after a quick one stays quick.
        shutdown.request(Mode::Graceful);
        assert_eq!(shutdown.requested(), Some(Mode::Quick));
    }

    /// A client of one attached stream, served over an in-memory connection watched by
    /// `graceful`: the events it reads arrive on the returned channel.
    async fn client(
        registry: &Registry,
        graceful: &GracefulShutdown,
        kind: StreamKind,
    ) -> (u32, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let session = registry
            .get_or_create("s", Owner::new(Principal::default(), "/mcp"))
            .unwrap();
        let attachment = session.open_stream(OpenStream::new(kind, vec!["1".into()]));
        let stream = attachment.stream;
        let body = AttachBody::new(session, attachment, None);
        let (near, far) = tokio::io::duplex(64 << 10);
        let body = std::sync::Mutex::new(Some(body));
        let svc = hyper::service::service_fn(move |_req: http::Request<Incoming>| {
            let body = body.lock().unwrap().take().expect("one request");
            async move { Ok::<_, Infallible>(http::Response::new(body)) }
        });
        let conn =
            hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(far), svc);
        tokio::spawn(graceful.watch(conn));
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(near))
            .await
            .unwrap();
        tokio::spawn(conn);
        let resp = sender
            .send_request(
                http::Request::get("/mcp")
                    .body(http_body_util::Empty::<Bytes>::new())
                    .unwrap(),
            )
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut body = resp.into_body();
            let mut decoder = Decoder::new(1 << 20);
            while let Some(Ok(frame)) = body.frame().await {
                let mut out = Vec::new();
                if let Ok(d) = frame.into_data() {
                    decoder.feed(&d, &mut out).unwrap();
                }
                for e in out {
                    let _ = tx.send(e);
                }
            }
        });
        (stream, rx)
    }

    fn is_shutdown(e: &Event) -> bool {
        e.event() == Some(crate::jsonrpc::EVENT_RESUMPTION_REQUIRED)
            && e.data().is_some_and(|d| d.contains("shutdown"))
    }

    async fn next_real(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> Event {
        loop {
            let e = rx.recv().await.expect("an event");
            if e.data().is_some_and(|d| !d.is_empty()) {
                return e;
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn drain_sends_standalone_clients_away_at_once_and_ends_the_rest_at_the_deadline() {
        let (registry, shutdown) = (registry(), Shutdown::new());
        let graceful = GracefulShutdown::new();
        let (_, mut standalone) = client(&registry, &graceful, StreamKind::Standalone).await;
        let (post, mut call) = client(&registry, &graceful, StreamKind::Post).await;
        let session = registry.get("s").unwrap();
        let t0 = Instant::now();
        let drain = tokio::spawn({
            let (registry, draining) = (registry.clone(), shutdown.draining());
            async move { drain(&registry, graceful, Duration::from_secs(30), draining).await }
        });
        // Phase 3: the standalone client is sent elsewhere at once.
        let e = next_real(&mut standalone).await;
        assert!(is_shutdown(&e), "{e:?}");
        assert_eq!(t0.elapsed(), Duration::ZERO);
        // Phase 4: the POST-started stream keeps flowing until the deadline.
        tokio::time::sleep(Duration::from_secs(20)).await;
        let note = Event::message_of("{\"n\":1}");
        session.push_events(post, &mut [note].into(), None);
        assert_eq!(
            next_real(&mut call).await.data().as_deref(),
            Some("{\"n\":1}")
        );
        assert!(!drain.is_finished());
        // Phase 5: at the deadline the remaining client is told to resume elsewhere.
        let e = next_real(&mut call).await;
        assert!(is_shutdown(&e), "{e:?}");
        assert_eq!(t0.elapsed(), Duration::from_secs(30));
        assert_eq!(drain.await.unwrap(), Drained::Ended);
    }

    #[tokio::test(start_paused = true)]
    async fn drain_returns_as_soon_as_every_stream_finished() {
        let (registry, shutdown) = (registry(), Shutdown::new());
        let graceful = GracefulShutdown::new();
        let (post, mut call) = client(&registry, &graceful, StreamKind::Post).await;
        let session = registry.get("s").unwrap();
        let t0 = Instant::now();
        let drain = tokio::spawn({
            let (registry, draining) = (registry.clone(), shutdown.draining());
            async move { drain(&registry, graceful, Duration::from_secs(30), draining).await }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        let answer = Event::message_of("{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}");
        session.push_events(post, &mut [answer].into(), None);
        session.end_stream(post, crate::session::End::Complete);
        assert!(next_real(&mut call)
            .await
            .data()
            .unwrap()
            .contains("result"));
        assert_eq!(drain.await.unwrap(), Drained::Finished);
        assert_eq!(t0.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn the_admin_stop_resolves_once_the_drain_is_over() {
        let (registry, shutdown) = (registry(), Shutdown::new());
        let graceful = GracefulShutdown::new();
        let (post, _call) = client(&registry, &graceful, StreamKind::Post).await;
        let drained = tokio::spawn(shutdown.drained());
        let drain = tokio::spawn({
            let (registry, draining) = (registry.clone(), shutdown.draining());
            async move { drain(&registry, graceful, Duration::from_secs(30), draining).await }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            !drained.is_finished(),
            "the drain is still waiting for the call"
        );
        registry
            .get("s")
            .unwrap()
            .end_stream(post, crate::session::End::Complete);
        assert_eq!(drain.await.unwrap(), Drained::Finished);
        tokio::time::timeout(Duration::from_millis(1), drained)
            .await
            .expect("resolved with the drain")
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_hurried_drain_ends_streams_without_waiting_for_the_deadline() {
        let (registry, shutdown) = (registry(), Shutdown::new());
        let graceful = GracefulShutdown::new();
        let (_, mut call) = client(&registry, &graceful, StreamKind::Post).await;
        let t0 = Instant::now();
        shutdown.request(Mode::Quick);
        assert_eq!(
            drain(
                &registry,
                graceful,
                Duration::from_secs(30),
                shutdown.draining()
            )
            .await,
            Drained::Ended
        );
        assert!(is_shutdown(&next_real(&mut call).await));
        assert!(t0.elapsed() < Duration::from_secs(30));
    }
}
