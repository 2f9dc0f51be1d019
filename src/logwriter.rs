//! The log's writer: every log and access line is appended to one in-memory buffer, and a
//! thread of its own writes that buffer to stdout: at once when it was waiting, otherwise
//! in one batch at most every [`BATCH_INTERVAL`]. A busy gateway pays a copy per line and
//! one `write` per batch, where tracing-appender's `non_blocking` paid a thread wake-up
//! (a `futex`, then ~3 `sched_yield` spins of its worker before it parks again) and a
//! `write` for every line: a large share of the gateway's system calls per short call, most
//! of them per resume in a reconnect storm (bench/notes.md, "Figure: the log's writer").
//!
//! Bounded: past [`LIMIT`] bytes of lines waiting or being written (stdout blocked), whole
//! lines are dropped and counted, never half-written, and the count is written as a line of its own once stdout
//! takes lines again. Two buffers take turns (lines gather in one while the other is
//! written), each keeping its capacity while lines keep coming: a busy gateway's batches
//! outgrew a buffer made afresh for each, and growing it again faulted in new pages every
//! batch (bench/notes.md, "Figure: the log's writer"). Both are
//! released (past [`KEEP`]) when the log goes idle; an idle gateway keeps none.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// Most bytes of lines waiting for stdout or being written to it; past it lines are dropped
/// (a second or more of a busy gateway's log while stdout is blocked).
pub(crate) const LIMIT: usize = 4 << 20;

/// How long the writer thread gathers lines after a write before it writes again: the
/// most a line waits while the log is busy.
pub(crate) const BATCH_INTERVAL: Duration = Duration::from_millis(20);

/// Capacity each buffer keeps when the log goes idle; a larger one is freed then.
const KEEP: usize = 64 << 10;

/// A handle that appends lines to the log (cheap to clone). As an [`std::io::Write`], each
/// `write` is one whole line or more; tracing-subscriber's formatter writes an event in one.
#[derive(Clone, Debug)]
pub struct LogWriter {
    shared: Arc<Shared>,
}

/// Stops the writer thread when dropped, after it has written every line appended before.
#[derive(Debug)]
pub struct Flush {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when a line arrives while the writer thread waits, and at the end.
    wake: Condvar,
    limit: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Lines gathering for the next batch.
    buf: Vec<u8>,
    /// The other buffer, emptied, between batches (the writer thread holds it while it
    /// writes a batch): the next batch's `buf`.
    spare: Vec<u8>,
    /// Bytes of the batch the writer thread is writing.
    writing: usize,
    /// The writer thread waits on [`Shared::wake`] (not gathering a batch).
    waiting: bool,
    dropped: u64,
    closed: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the buffer whole: keep logging.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Starts the writer thread on `out` (stdout in the binary). Lines go out in the order
/// they were appended.
pub fn spawn<W: Write + Send + 'static>(out: W) -> std::io::Result<(LogWriter, Flush)> {
    spawn_with(out, LIMIT, BATCH_INTERVAL)
}

fn spawn_with<W: Write + Send + 'static>(
    out: W,
    limit: usize,
    interval: Duration,
) -> std::io::Result<(LogWriter, Flush)> {
    let shared = Arc::new(Shared {
        state: Mutex::new(State::default()),
        wake: Condvar::new(),
        limit,
    });
    let s = shared.clone();
    let thread = std::thread::Builder::new()
        .name("log-writer".into())
        .spawn(move || run(&s, out, interval))?;
    Ok((
        LogWriter {
            shared: shared.clone(),
        },
        Flush {
            shared,
            thread: Some(thread),
        },
    ))
}

impl LogWriter {
    /// Appends `line` (one or more whole lines), or drops it when the log is full.
    pub fn append(&self, line: &[u8]) {
        let mut s = self.shared.lock();
        if s.buf.len() + s.writing + line.len() > self.shared.limit {
            s.dropped += 1;
            return;
        }
        let wake = s.waiting && s.buf.is_empty();
        s.buf.extend_from_slice(line);
        drop(s);
        if wake {
            self.shared.wake.notify_one();
        }
    }
}

impl Write for &LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.append(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = &'a LogWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self
    }
}

impl Drop for Flush {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The writer thread: waits for lines, writes what has gathered, pauses for `interval` so
/// the next batch gathers, until closed and empty.
fn run<W: Write>(shared: &Shared, mut out: W, interval: Duration) {
    loop {
        let (mut batch, dropped, closed) = {
            let mut s = shared.lock();
            while s.buf.is_empty() && s.dropped == 0 && !s.closed {
                if !s.waiting {
                    // Idle: the buffers a busy log kept are not kept for the next burst.
                    release(&mut s.buf);
                    release(&mut s.spare);
                }
                s.waiting = true;
                s = shared.wake.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            s.waiting = false;
            let next = std::mem::take(&mut s.spare);
            let batch = std::mem::replace(&mut s.buf, next);
            s.writing = batch.len();
            (batch, std::mem::take(&mut s.dropped), s.closed)
        };
        if dropped > 0 {
            batch.extend_from_slice(
                format!("mcp-reattach: {dropped} log line(s) dropped: stdout did not keep up\n")
                    .as_bytes(),
            );
        }
        // A failing stdout loses these lines and keeps the gateway serving.
        if !batch.is_empty() {
            let _ = out.write_all(&batch).and_then(|()| out.flush());
        }
        batch.clear();
        let mut s = shared.lock();
        s.writing = 0;
        s.spare = batch;
        if closed {
            if s.buf.is_empty() {
                return;
            }
            continue;
        }
        // Gather the next batch; only the end cuts this short (appenders do not signal it).
        drop(
            shared
                .wake
                .wait_timeout_while(s, interval, |s| !s.closed)
                .unwrap_or_else(|p| p.into_inner()),
        );
    }
}

/// Frees `buf`'s memory if it holds more than [`KEEP`] (it is empty).
fn release(buf: &mut Vec<u8>) {
    if buf.capacity() > KEEP {
        *buf = Vec::new();
    }
}

#[cfg(test)]
// The writer is a thread of its own, not a task: its tests pause real threads.
#[allow(clippy::disallowed_methods, clippy::disallowed_types)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// An `out` that records each write, optionally held until released.
    #[derive(Clone, Default)]
    struct Out {
        writes: Arc<Mutex<Vec<Vec<u8>>>>,
    }

    impl Write for Out {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.writes.lock().unwrap().push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Out {
        fn text(&self) -> String {
            String::from_utf8(self.writes.lock().unwrap().concat()).unwrap()
        }
        fn count(&self) -> usize {
            self.writes.lock().unwrap().len()
        }
    }

    /// An `out` whose first write waits for a signal (a blocked stdout).
    struct Blocked {
        out: Out,
        release: Option<mpsc::Receiver<()>>,
        started: Option<mpsc::Sender<()>>,
    }

    impl Write for Blocked {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if let Some(s) = self.started.take() {
                let _ = s.send(());
            }
            if let Some(r) = self.release.take() {
                let _ = r.recv();
            }
            self.out.write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A log of `limit` bytes on a stdout that blocks: "first" is appended and its write has
    /// begun when this returns; sending on the last value lets that write finish.
    fn blocked_after_first_line(limit: usize) -> (Out, LogWriter, Flush, mpsc::Sender<()>) {
        let out = Out::default();
        let (release, r) = mpsc::channel();
        let (started, s) = mpsc::channel();
        let blocked = Blocked {
            out: out.clone(),
            release: Some(r),
            started: Some(started),
        };
        let (w, flush) = spawn_with(blocked, limit, Duration::from_millis(1)).unwrap();
        w.append(b"first\n");
        s.recv().unwrap();
        (out, w, flush, release)
    }

    #[test]
    fn every_line_goes_out_in_order_and_drop_flushes_the_rest() {
        let out = Out::default();
        let (w, flush) = spawn_with(out.clone(), LIMIT, Duration::from_millis(5)).unwrap();
        let mut expected = String::new();
        for i in 0..1000 {
            let line = format!("line {i}\n");
            w.append(line.as_bytes());
            expected.push_str(&line);
        }
        drop(flush);
        assert_eq!(out.text(), expected);
    }

    #[test]
    fn a_line_to_an_idle_log_goes_out_without_waiting_for_the_next() {
        let out = Out::default();
        // A long interval: only the wake-up of a waiting writer can write the line soon.
        let (w, _flush) = spawn_with(out.clone(), LIMIT, Duration::from_secs(60)).unwrap();
        // Let the thread start waiting.
        std::thread::sleep(Duration::from_millis(50));
        w.append(b"first\n");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while out.text().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(out.text(), "first\n");
    }

    #[test]
    fn lines_appended_while_stdout_is_busy_go_out_in_one_write() {
        let (out, w, flush, release) = blocked_after_first_line(LIMIT);
        for i in 0..500 {
            w.append(format!("line {i}\n").as_bytes());
        }
        release.send(()).unwrap();
        drop(flush);
        assert_eq!(out.count(), 2, "the 500 lines in one write after the first");
        assert!(out.text().ends_with("line 499\n"));
    }

    #[test]
    fn a_full_log_drops_whole_lines_and_says_how_many() {
        let (out, w, flush, release) = blocked_after_first_line(106);
        // 10 lines of 10 bytes fit beside the 6 being written; the next 5 do not.
        for i in 0..15 {
            w.append(format!("line {i:04}\n").as_bytes());
        }
        release.send(()).unwrap();
        drop(flush);
        let text = out.text();
        let kept: Vec<&str> = text.lines().collect();
        assert_eq!(kept[0], "first");
        assert_eq!(
            kept[1..11],
            (0..10).map(|i| format!("line {i:04}")).collect::<Vec<_>>()
        );
        assert_eq!(
            kept[11],
            "mcp-reattach: 5 log line(s) dropped: stdout did not keep up"
        );
        assert_eq!(kept.len(), 12);
    }

    /// An `out` each write of which says it started and waits to be let through.
    struct Gated {
        out: Out,
        started: mpsc::Sender<()>,
        through: mpsc::Receiver<()>,
    }

    impl Write for Gated {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.started.send(());
            let _ = self.through.recv();
            self.out.write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_busy_log_reuses_its_buffers_and_an_idle_one_keeps_none() {
        let out = Out::default();
        let (started, started_rx) = mpsc::channel();
        let (through, through_rx) = mpsc::channel();
        let gated = Gated {
            out: out.clone(),
            started,
            through: through_rx,
        };
        let (w, flush) = spawn_with(gated, LIMIT, Duration::from_millis(1)).unwrap();
        let capacities = || {
            let s = w.shared.lock();
            (s.buf.capacity(), s.spare.capacity())
        };
        w.append(b"first\n");
        started_rx.recv().unwrap();
        // A burst while the first write is held: the lines gather in one large buffer.
        let line = [b'x'; 99]
            .iter()
            .copied()
            .chain([b'\n'])
            .collect::<Vec<u8>>();
        for _ in 0..3000 {
            w.append(&line);
        }
        let burst = capacities().0;
        assert!(burst >= 300_000, "{burst}");
        through.send(()).unwrap();
        // The burst's write, held; one more line keeps the log busy.
        started_rx.recv().unwrap();
        w.append(b"more\n");
        through.send(()).unwrap();
        // The write of "more", held: the buffer the burst was written from gathers the next
        // batch, not one made afresh.
        started_rx.recv().unwrap();
        assert_eq!(capacities().0, burst, "the burst's buffer is reused");
        through.send(()).unwrap();
        // No more lines: the writer goes idle and frees what it kept.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !w.shared.lock().waiting && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let (buf, spare) = capacities();
        assert!(
            buf <= KEEP && spare <= KEEP,
            "kept {buf} and {spare} bytes idle"
        );
        w.append(b"last\n");
        started_rx.recv().unwrap();
        through.send(()).unwrap();
        drop(flush);
        let text = out.text();
        assert!(text.starts_with("first\nxxx"));
        assert!(text.ends_with("xx\nmore\nlast\n"));
        assert_eq!(text.len(), 6 + 3000 * 100 + 5 + 5);
    }

    #[test]
    fn a_failing_stdout_does_not_stop_the_log() {
        struct Failing(Out, usize);
        impl Write for Failing {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.1 += 1;
                if self.1 == 1 {
                    return Err(std::io::Error::other("EPIPE"));
                }
                self.0.write(buf)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let out = Out::default();
        let (w, flush) =
            spawn_with(Failing(out.clone(), 0), LIMIT, Duration::from_millis(1)).unwrap();
        w.append(b"lost\n");
        std::thread::sleep(Duration::from_millis(100));
        w.append(b"kept\n");
        drop(flush);
        assert_eq!(out.text(), "kept\n");
    }
}
