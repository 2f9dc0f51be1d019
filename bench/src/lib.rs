//! Shared pieces of the benchmark harness: the clock shared by the mock upstream and the load
//! client, the event payload format, a minimal HTTP/1.1 client with an incremental chunked
//! decoder and SSE parser, and /proc sampling; the worst minute's client ([`call_storm`]),
//! which tests/storm.rs runs too.

pub mod call_storm;

pub mod clock {
    /// CLOCK_MONOTONIC in nanoseconds: one clock for every process on the machine, so the
    /// mock's send stamp and the client's receive stamp can be subtracted.
    pub fn now_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into the timespec we pass.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

pub mod payload {
    //! Event payloads: JSON-RPC messages padded to an exact size, carrying a per-stream
    //! sequence number and the send time. Formatting and parsing avoid `fmt` and searches:
    //! the mock formats millions of events per second and the client parses them.

    use std::fmt::Write;

    /// Everything of a progress event's `data` before the sequence number.
    pub const EVENT_HEAD: &[u8] =
        br#"{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":{"seq":"#;
    const EVENT_TS: &[u8] = br#","ts":"#;
    const EVENT_PAD: &[u8] = br#","pad":""#;
    const EVENT_TAIL: &[u8] = br#""}}}"#;

    /// `n` in decimal, in `buf`.
    pub fn dec(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
        let mut i = buf.len();
        while n >= 100 {
            let r = (n % 100) as usize;
            n /= 100;
            i -= 2;
            buf[i] = b'0' + (r / 10) as u8;
            buf[i + 1] = b'0' + (r % 10) as u8;
        }
        if n >= 10 {
            i -= 2;
            buf[i] = b'0' + (n / 10) as u8;
            buf[i + 1] = b'0' + (n % 10) as u8;
        } else {
            i -= 1;
            buf[i] = b'0' + n as u8;
        }
        &buf[i..]
    }

    /// Length of the `data` [`event_dec`] writes for these arguments.
    pub fn event_len_dec(seq: &[u8], ts: &[u8], size: usize) -> usize {
        let fixed = EVENT_HEAD.len()
            + seq.len()
            + EVENT_TS.len()
            + ts.len()
            + EVENT_PAD.len()
            + EVENT_TAIL.len();
        size.max(fixed)
    }

    /// Length of the `data` [`event`] writes for these arguments.
    pub fn event_len(seq: u64, ts: u64, size: usize) -> usize {
        let (mut a, mut b) = ([0u8; 20], [0u8; 20]);
        event_len_dec(dec(seq, &mut a), dec(ts, &mut b), size)
    }

    /// `data` of a progress event: exactly `size` bytes (or the minimum if smaller).
    pub fn event(seq: u64, ts: u64, size: usize, out: &mut Vec<u8>) {
        let (mut a, mut b) = ([0u8; 20], [0u8; 20]);
        event_dec(dec(seq, &mut a), dec(ts, &mut b), size, out);
    }

    /// [`event`] with `seq` and `ts` already in decimal (a burst shares one stamp).
    pub fn event_dec(seq: &[u8], ts: &[u8], size: usize, out: &mut Vec<u8>) {
        let pad = event_len_dec(seq, ts, size) - event_len_dec(seq, ts, 0);
        out.extend_from_slice(EVENT_HEAD);
        out.extend_from_slice(seq);
        out.extend_from_slice(EVENT_TS);
        out.extend_from_slice(ts);
        out.extend_from_slice(EVENT_PAD);
        out.resize(out.len() + pad, b'x');
        out.extend_from_slice(EVENT_TAIL);
    }

    /// `data` of the final result of request `id`, padded to `size` bytes.
    pub fn result(id: &str, seq: u64, ts: u64, size: usize, out: &mut Vec<u8>) {
        let mut head = String::with_capacity(128);
        let _ = write!(
            head,
            "{{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":{{\"content\":[],\"seq\":{seq},\"ts\":{ts},\"pad\":\""
        );
        pad_to(head.as_bytes(), b"\"}}", size, out);
    }

    fn pad_to(head: &[u8], tail: &[u8], size: usize, out: &mut Vec<u8>) {
        out.extend_from_slice(head);
        let pad = size.saturating_sub(head.len() + tail.len());
        out.resize(out.len() + pad, b'x');
        out.extend_from_slice(tail);
    }

    /// The decimal number (at most 19 digits) at the start of `data`, and the bytes after it.
    fn leading_number(data: &[u8]) -> Option<(u64, &[u8])> {
        let mut n: u64 = 0;
        let mut i = 0;
        for &b in &data[..data.len().min(19)] {
            let d = b.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            n = n * 10 + u64::from(d);
            i += 1;
        }
        (i > 0).then(|| (n, &data[i..]))
    }

    fn number_after(data: &[u8], key: &[u8]) -> Option<u64> {
        let probe = &data[..data.len().min(160)];
        let at = memchr::memmem::find(probe, key)? + key.len();
        leading_number(&data[at..]).map(|(n, _)| n)
    }

    /// `(seq, ts, is_result)` of an event's data written by [`event`] or [`result`].
    pub fn parse(data: &[u8]) -> Option<(u64, u64, bool)> {
        // Fast path: a progress event exactly as [`event`] writes it (every event but one).
        if let Some(rest) = data.strip_prefix(EVENT_HEAD) {
            let (seq, rest) = leading_number(rest)?;
            let (ts, _) = leading_number(rest.strip_prefix(EVENT_TS)?)?;
            return Some((seq, ts, false));
        }
        let seq = number_after(data, b"\"seq\":")?;
        let ts = number_after(data, b"\"ts\":")?;
        let is_result = memchr::memmem::find(&data[..data.len().min(64)], b"\"result\"").is_some();
        Some((seq, ts, is_result))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn event_roundtrip_exact_size() {
            let mut b = [0u8; 20];
            for n in [0u64, 9, 10, 99, 100, 12345, u64::MAX] {
                assert_eq!(dec(n, &mut b), n.to_string().as_bytes());
            }
            for (seq, ts, size) in [
                (0, 1, 200),
                (12345, 987654321012, 200),
                (7, 9, 16384),
                (1, 1, 10),
            ] {
                let mut out = b"prefix".to_vec();
                event(seq, ts, size, &mut out);
                let d = &out[6..];
                assert_eq!(d.len(), event_len(seq, ts, size));
                assert!(size < 100 || d.len() == size);
                assert_eq!(parse(d), Some((seq, ts, false)));
                assert!(serde_json::from_slice::<serde_json::Value>(d).is_ok());
            }
            let mut r = Vec::new();
            result("3", 42, 77, 200, &mut r);
            assert_eq!(r.len(), 200);
            assert_eq!(parse(&r), Some((42, 77, true)));
        }
    }
}

pub mod procfs {
    //! CPU time from /proc/PID/stat and RSS from /proc/PID/status, summed over a process
    //! and its descendants (nginx's master and worker).

    use std::fs;

    pub fn clk_tck() -> u64 {
        // SAFETY: sysconf has no preconditions.
        let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if t > 0 {
            t as u64
        } else {
            100
        }
    }

    fn stat_fields(pid: u32) -> Option<Vec<String>> {
        let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let close = s.rfind(')')?;
        Some(s[close + 2..].split(' ').map(str::to_owned).collect())
    }

    /// `pid` and all its descendants.
    pub fn tree(pid: u32) -> Vec<u32> {
        let mut all = vec![pid];
        let mut parents: Vec<(u32, u32)> = Vec::new();
        if let Ok(rd) = fs::read_dir("/proc") {
            for e in rd.flatten() {
                if let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) {
                    if let Some(f) = stat_fields(p) {
                        if let Ok(pp) = f[1].parse::<u32>() {
                            parents.push((p, pp));
                        }
                    }
                }
            }
        }
        let mut i = 0;
        while i < all.len() {
            let cur = all[i];
            for &(p, pp) in &parents {
                if pp == cur && !all.contains(&p) {
                    all.push(p);
                }
            }
            i += 1;
        }
        all
    }

    /// utime and stime of the processes, in seconds: (user, system).
    pub fn cpu_split(pids: &[u32]) -> (f64, f64) {
        let tck = clk_tck() as f64;
        pids.iter()
            .filter_map(|&p| stat_fields(p))
            .map(|f| {
                // Fields after the comm: state is [0]; utime is field 14 → index 11, stime 12.
                let u: u64 = f[11].parse().unwrap_or(0);
                let s: u64 = f[12].parse().unwrap_or(0);
                (u as f64 / tck, s as f64 / tck)
            })
            .fold((0.0, 0.0), |(a, b), (u, s)| (a + u, b + s))
    }

    /// On-CPU time of the processes' live threads in ns (`/proc/PID/task/TID/schedstat`,
    /// first field): nanosecond resolution where [`cpu_seconds`] has clock ticks (10 ms).
    /// Threads that exit between two samples take their time with them, so use it over
    /// windows in which the process keeps its threads (a tokio runtime's workers, Node's).
    pub fn cpu_ns(pids: &[u32]) -> u64 {
        pids.iter()
            .filter_map(|&p| fs::read_dir(format!("/proc/{p}/task")).ok())
            .flat_map(|rd| rd.flatten())
            .filter_map(|t| fs::read_to_string(t.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }

    /// Sum of `field` (e.g. "VmRSS") over the processes, in KiB.
    pub fn status_kib(pids: &[u32], field: &str) -> u64 {
        pids.iter()
            .filter_map(|&p| fs::read_to_string(format!("/proc/{p}/status")).ok())
            .filter_map(|s| {
                s.lines()
                    .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            })
            .sum()
    }

    pub fn rss_kib(pids: &[u32]) -> u64 {
        status_kib(pids, "VmRSS")
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn cpu_ns_counts_this_process_on_cpu() {
            let me = [std::process::id()];
            let before = cpu_ns(&me);
            assert!(before > 0, "no schedstat for this process");
            // Spin until 5 ms more on-CPU time shows (bounded: 10 s of wall time).
            let t = std::time::Instant::now();
            let mut x = 0u64;
            while cpu_ns(&me) < before + 5_000_000 && t.elapsed().as_secs() < 10 {
                for i in 0..100_000u64 {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
                }
            }
            assert!(
                cpu_ns(&me) >= before + 5_000_000,
                "schedstat did not advance"
            );
        }
    }
}

pub mod http {
    //! A minimal HTTP/1.1 client: prebuilt requests, response heads, Content-Length and
    //! chunked bodies, read incrementally so SSE events are stamped when their bytes arrive.

    use std::io;
    use std::net::SocketAddr;
    use std::pin::Pin;
    use std::sync::{Arc, OnceLock};
    use std::task::{Context, Poll};

    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
    use tokio::net::TcpStream;

    use crate::clock::now_ns;

    static TLS: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();

    /// Makes every later [`Conn::connect`] speak TLS (HTTP/1.1 by ALPN), trusting the CA
    /// certificates in `ca_pem`.
    pub fn use_tls(ca_pem: &std::path::Path) -> io::Result<()> {
        use rustls_pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pki_types::CertificateDer::pem_file_iter(ca_pem)
            .map_err(|e| io::Error::other(e.to_string()))?
        {
            roots
                .add(c.map_err(|e| io::Error::other(e.to_string()))?)
                .map_err(|e| io::Error::other(e.to_string()))?;
        }
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| io::Error::other(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let _ = TLS.set(Arc::new(cfg));
        Ok(())
    }

    /// A connection to the target: plain TCP or TLS over it.
    pub enum Stream {
        Plain(TcpStream),
        Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    }

    impl AsyncRead for Stream {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            match self.get_mut() {
                Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
                Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            }
        }
    }

    impl AsyncWrite for Stream {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            match self.get_mut() {
                Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
                Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            }
        }

        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            match self.get_mut() {
                Stream::Plain(s) => Pin::new(s).poll_flush(cx),
                Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            }
        }

        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            match self.get_mut() {
                Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
                Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            }
        }
    }

    pub const PROTOCOL_VERSION: &str = "2025-06-18";

    pub fn request(
        method: &str,
        path: &str,
        host: &SocketAddr,
        session: Option<&str>,
        extra: &[(&str, &str)],
        body: &[u8],
    ) -> Vec<u8> {
        let mut r = Vec::with_capacity(256 + body.len());
        r.extend_from_slice(
            format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nAccept: application/json, text/event-stream\r\n")
                .as_bytes(),
        );
        if !body.is_empty() || method == "POST" {
            r.extend_from_slice(
                format!(
                    "Content-Type: application/json\r\nContent-Length: {}\r\n",
                    body.len()
                )
                .as_bytes(),
            );
        }
        if let Some(s) = session {
            r.extend_from_slice(
                format!("Mcp-Session-Id: {s}\r\nMCP-Protocol-Version: {PROTOCOL_VERSION}\r\n")
                    .as_bytes(),
            );
        }
        for (k, v) in extra {
            r.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
        }
        r.extend_from_slice(b"\r\n");
        r.extend_from_slice(body);
        r
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum BodyKind {
        Length(usize),
        Chunked,
        Close,
    }

    #[derive(Debug)]
    pub struct Head {
        pub status: u16,
        pub headers: Vec<(String, String)>,
        pub body: BodyKind,
    }

    impl Head {
        pub fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
    }

    #[derive(Debug, Clone, Copy)]
    enum Chunk {
        Size,
        Data(usize),
        DataEnd,
        Trailer,
        Done,
    }

    /// Incremental body decoder state.
    #[derive(Debug)]
    pub struct BodyState {
        kind: BodyKind,
        left: usize,
        chunk: Chunk,
    }

    impl BodyState {
        pub fn new(kind: BodyKind) -> BodyState {
            BodyState {
                kind,
                left: if let BodyKind::Length(n) = kind { n } else { 0 },
                chunk: Chunk::Size,
            }
        }

        pub fn done(&self) -> bool {
            match self.kind {
                BodyKind::Length(_) => self.left == 0,
                BodyKind::Chunked => matches!(self.chunk, Chunk::Done),
                BodyKind::Close => false,
            }
        }
    }

    pub struct Conn {
        pub stream: Stream,
        buf: Vec<u8>,
        pos: usize,
        /// Bytes asked of the kernel per `read` (the buffer grows to hold this much).
        read_size: usize,
        /// Receive time of the latest read.
        pub last_read_ns: u64,
    }

    impl Conn {
        pub async fn connect(addr: SocketAddr) -> io::Result<Conn> {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let stream = match TLS.get() {
                None => Stream::Plain(tcp),
                Some(cfg) => {
                    let name = rustls_pki_types::ServerName::IpAddress(addr.ip().into());
                    let tls = tokio_rustls::TlsConnector::from(cfg.clone())
                        .connect(name, tcp)
                        .await?;
                    Stream::Tls(Box::new(tls))
                }
            };
            Ok(Conn {
                stream,
                buf: Vec::with_capacity(16 * 1024),
                pos: 0,
                read_size: 16 * 1024,
                last_read_ns: 0,
            })
        }

        /// Large reads for a saturating stream: one `read` then takes everything the kernel
        /// holds, up to `n` bytes, instead of one wake-up per small piece.
        pub fn set_read_size(&mut self, n: usize) {
            self.read_size = n.max(4096);
        }

        pub async fn send(&mut self, req: &[u8]) -> io::Result<()> {
            self.stream.write_all(req).await
        }

        /// One read from the socket into the buffer; Ok(false) on EOF. Unconsumed bytes
        /// (at most a partial chunk header or event) move to the front first.
        async fn fill(&mut self) -> io::Result<bool> {
            if self.pos > 0 {
                self.buf.copy_within(self.pos.., 0);
                self.buf.truncate(self.buf.len() - self.pos);
                self.pos = 0;
            }
            let spare = self.buf.capacity() - self.buf.len();
            if spare < self.read_size {
                self.buf.reserve(self.read_size);
            }
            let n = self.stream.read_buf(&mut self.buf).await?;
            self.last_read_ns = now_ns();
            Ok(n > 0)
        }

        pub async fn read_head(&mut self) -> io::Result<Head> {
            loop {
                if let Some(end) = memchr::memmem::find(&self.buf[self.pos..], b"\r\n\r\n") {
                    let text = std::str::from_utf8(&self.buf[self.pos..self.pos + end])
                        .map_err(|_| io::Error::other("non-UTF-8 response head"))?
                        .to_owned();
                    self.pos += end + 4;
                    return parse_head(&text);
                }
                if !self.fill().await? {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed before a response head",
                    ));
                }
            }
        }

        /// Decodes whatever body bytes are buffered into `out`; reads from the socket once
        /// first when nothing is buffered. Returns Ok(false) at the end of the body.
        pub async fn read_body_some(
            &mut self,
            st: &mut BodyState,
            out: &mut Vec<u8>,
        ) -> io::Result<bool> {
            self.read_body_with(st, &mut |d: &[u8], _| out.extend_from_slice(d))
                .await
        }

        /// Like [`Conn::read_body_some`], but hands each decoded piece of the body to `f`
        /// in place (no copy), with the receive time of the read that brought it.
        pub async fn read_body_with(
            &mut self,
            st: &mut BodyState,
            f: &mut impl FnMut(&[u8], u64),
        ) -> io::Result<bool> {
            if st.done() {
                return Ok(false);
            }
            if self.pos == self.buf.len() && !self.fill().await? {
                if st.kind == BodyKind::Close {
                    st.kind = BodyKind::Length(0);
                    st.left = 0;
                    return Ok(false);
                }
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a body",
                ));
            }
            loop {
                let avail = &self.buf[self.pos..];
                if avail.is_empty() {
                    return Ok(!st.done());
                }
                match st.kind {
                    BodyKind::Close => {
                        f(avail, self.last_read_ns);
                        self.pos = self.buf.len();
                    }
                    BodyKind::Length(_) => {
                        let n = avail.len().min(st.left);
                        f(&avail[..n], self.last_read_ns);
                        self.pos += n;
                        st.left -= n;
                        if st.left == 0 {
                            return Ok(false);
                        }
                    }
                    BodyKind::Chunked => match st.chunk {
                        Chunk::Size => {
                            // Size lines are a few bytes: a short scan beats a memchr call.
                            let short = &avail[..avail.len().min(32)];
                            let nl = match short.iter().position(|&b| b == b'\n') {
                                Some(p) => Some(p),
                                None if avail.len() > 32 => memchr::memchr(b'\n', avail),
                                None => None,
                            };
                            let Some(nl) = nl else {
                                // Need more bytes for the size line.
                                if !self.fill().await? {
                                    return Err(io::Error::new(
                                        io::ErrorKind::UnexpectedEof,
                                        "eof in chunk size",
                                    ));
                                }
                                continue;
                            };
                            let n = chunk_size(&avail[..nl]).ok_or_else(|| {
                                io::Error::other(format!(
                                    "bad chunk size {:?}",
                                    String::from_utf8_lossy(&avail[..nl])
                                ))
                            })?;
                            self.pos += nl + 1;
                            st.chunk = if n == 0 {
                                Chunk::Trailer
                            } else {
                                Chunk::Data(n)
                            };
                        }
                        Chunk::Data(left) => {
                            let n = avail.len().min(left);
                            f(&avail[..n], self.last_read_ns);
                            self.pos += n;
                            st.chunk = if n == left {
                                Chunk::DataEnd
                            } else {
                                Chunk::Data(left - n)
                            };
                        }
                        Chunk::DataEnd => {
                            if avail.starts_with(b"\r\n") {
                                self.pos += 2;
                                st.chunk = Chunk::Size;
                                continue;
                            }
                            let Some(nl) = memchr::memchr(b'\n', avail) else {
                                if !self.fill().await? {
                                    return Err(io::Error::new(
                                        io::ErrorKind::UnexpectedEof,
                                        "eof after chunk",
                                    ));
                                }
                                continue;
                            };
                            self.pos += nl + 1;
                            st.chunk = Chunk::Size;
                        }
                        Chunk::Trailer => {
                            let Some(nl) = memchr::memchr(b'\n', avail) else {
                                if !self.fill().await? {
                                    return Err(io::Error::new(
                                        io::ErrorKind::UnexpectedEof,
                                        "eof in trailer",
                                    ));
                                }
                                continue;
                            };
                            let empty = avail[..nl].iter().all(|&b| b == b'\r');
                            self.pos += nl + 1;
                            if empty {
                                st.chunk = Chunk::Done;
                                return Ok(false);
                            }
                        }
                        Chunk::Done => return Ok(false),
                    },
                }
            }
        }

        pub async fn read_body_all(&mut self, kind: BodyKind) -> io::Result<Vec<u8>> {
            let mut st = BodyState::new(kind);
            let mut out = Vec::new();
            while self.read_body_some(&mut st, &mut out).await? {}
            Ok(out)
        }

        /// Sends `req` and reads the whole response.
        pub async fn roundtrip(&mut self, req: &[u8]) -> io::Result<(Head, Vec<u8>)> {
            self.send(req).await?;
            let head = self.read_head().await?;
            let body = self.read_body_all(head.body).await?;
            Ok((head, body))
        }
    }

    /// The size of a chunk-size line (without its LF): hex digits, then optional
    /// whitespace, extensions (`;…`) and CR.
    pub fn chunk_size(line: &[u8]) -> Option<usize> {
        let mut n: usize = 0;
        let mut digits = 0;
        for &b in line {
            let d = match b {
                b'0'..=b'9' => b - b'0',
                b'a'..=b'f' => b - b'a' + 10,
                b'A'..=b'F' => b - b'A' + 10,
                b'\r' | b';' | b' ' | b'\t' => break,
                _ => return None,
            };
            if digits == 15 {
                return None;
            }
            n = n * 16 + usize::from(d);
            digits += 1;
        }
        (digits > 0).then_some(n)
    }

    fn parse_head(text: &str) -> io::Result<Head> {
        let mut lines = text.split("\r\n");
        let status_line = lines.next().unwrap_or("");
        let status: u16 = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::other(format!("bad status line {status_line:?}")))?;
        let mut headers = Vec::new();
        let mut body = BodyKind::Close;
        let mut has_len = false;
        for l in lines {
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim().to_owned(), v.trim().to_owned());
                if k.eq_ignore_ascii_case("content-length") {
                    if let Ok(n) = v.parse() {
                        body = BodyKind::Length(n);
                        has_len = true;
                    }
                } else if k.eq_ignore_ascii_case("transfer-encoding")
                    && v.to_ascii_lowercase().contains("chunked")
                {
                    body = BodyKind::Chunked;
                }
                headers.push((k, v));
            }
        }
        if (status == 204 || status == 304 || (100..200).contains(&status)) && !has_len {
            body = BodyKind::Length(0);
        }
        Ok(Head {
            status,
            headers,
            body,
        })
    }
}

pub mod sse {
    //! Incremental SSE parsing over the decoded body, in place: complete events are parsed
    //! where they lie in the read buffer; only an event split across reads (or across HTTP
    //! chunks) is copied, once, into a carry-over buffer.

    /// One event; slices borrow the buffer.
    #[derive(Debug, Default)]
    pub struct Ev<'a> {
        pub id: Option<&'a [u8]>,
        pub event: Option<&'a [u8]>,
        pub data: Option<&'a [u8]>,
        /// Only comment lines (keep-alive).
        pub comment_only: bool,
    }

    /// Streaming parser. Assumes LF line endings and single-line data (what the mock and
    /// the gateway write; nginx passes them through).
    pub struct Parser {
        /// The start of an event whose end has not arrived yet.
        partial: Vec<u8>,
        finder: memchr::memmem::Finder<'static>,
    }

    impl Default for Parser {
        fn default() -> Self {
            Parser::new()
        }
    }

    impl Parser {
        pub fn new() -> Parser {
            Parser {
                partial: Vec::new(),
                finder: memchr::memmem::Finder::new(b"\n\n"),
            }
        }

        /// Bytes of an unfinished event held over.
        pub fn pending(&self) -> usize {
            self.partial.len()
        }

        /// Feeds the next piece of the body; calls `f` for each event it completes.
        pub fn feed(&mut self, mut data: &[u8], f: &mut impl FnMut(Ev<'_>)) {
            if !self.partial.is_empty() {
                // The end of the held event: "\n\n" in the new bytes, or split across.
                let end = if self.partial.last() == Some(&b'\n') && data.first() == Some(&b'\n') {
                    Some(1)
                } else {
                    self.finder.find(data).map(|e| e + 2)
                };
                let Some(n) = end else {
                    self.partial.extend_from_slice(data);
                    return;
                };
                self.partial.extend_from_slice(&data[..n]);
                let block = &self.partial[..self.partial.len() - 2];
                f(parse_block(block));
                self.partial.clear();
                data = &data[n..];
            }
            // In place, one pass: each line found with one `memchr`; a blank line ends
            // the event.
            let mut start = 0;
            let mut pos = 0;
            let mut ev = Ev {
                comment_only: true,
                ..Ev::default()
            };
            while pos < data.len() {
                // The blank line that ends an event: no memchr call for it.
                let nl = if data[pos] == b'\n' {
                    0
                } else {
                    match memchr::memchr(b'\n', &data[pos..]) {
                        Some(nl) => nl,
                        None => break,
                    }
                };
                let line = &data[pos..pos + nl];
                pos += nl + 1;
                if line.is_empty() {
                    f(std::mem::replace(
                        &mut ev,
                        Ev {
                            comment_only: true,
                            ..Ev::default()
                        },
                    ));
                    start = pos;
                } else {
                    field(line, &mut ev);
                }
            }
            self.partial.extend_from_slice(&data[start..]);
        }
    }

    /// One non-blank line of an event.
    #[inline]
    fn field<'a>(line: &'a [u8], ev: &mut Ev<'a>) {
        if line[0] == b':' {
            return;
        }
        ev.comment_only = false;
        // What the mock, nginx and the gateway write, without a search.
        if let Some(v) = line.strip_prefix(b"data: ") {
            ev.data = Some(v);
            return;
        }
        if let Some(v) = line.strip_prefix(b"event: ") {
            ev.event = Some(v);
            return;
        }
        let (name, value) = match memchr::memchr(b':', &line[..line.len().min(16)]) {
            Some(c) => {
                let v = &line[c + 1..];
                (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &line[..0]),
        };
        match name {
            b"id" => ev.id = Some(value),
            b"event" => ev.event = Some(value),
            b"data" => ev.data = Some(value),
            _ => {}
        }
    }

    /// One event block (without its terminating blank line).
    pub fn parse_block(block: &[u8]) -> Ev<'_> {
        let mut ev = Ev {
            comment_only: true,
            ..Ev::default()
        };
        let mut rest = block;
        while !rest.is_empty() {
            let (line, next) = match memchr::memchr(b'\n', rest) {
                Some(nl) => (&rest[..nl], &rest[nl + 1..]),
                None => (rest, &rest[rest.len()..]),
            };
            rest = next;
            if !line.is_empty() {
                field(line, &mut ev);
            }
        }
        ev
    }

    /// The sequence part of a gateway id `<epoch>.<stream>.<seq>`.
    pub fn id_seq(id: &[u8]) -> Option<u64> {
        let dot = memchr::memrchr(b'.', id)?;
        std::str::from_utf8(&id[dot + 1..]).ok()?.parse().ok()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn collect(pieces: &[&[u8]]) -> Vec<(Option<String>, Option<String>, Option<String>)> {
            let mut p = Parser::new();
            let mut out = Vec::new();
            let s = |x: Option<&[u8]>| x.map(|v| String::from_utf8_lossy(v).into_owned());
            for piece in pieces {
                p.feed(piece, &mut |ev: Ev<'_>| {
                    if !ev.comment_only {
                        out.push((s(ev.id), s(ev.event), s(ev.data)));
                    }
                });
            }
            out
        }

        #[test]
        fn any_split_gives_the_same_events() {
            let stream: &[u8] =
                b": keep-alive\n\nid: 1.0.1\nevent: message\ndata: {\"a\":1}\n\nevent: mcp-reattach/resumed\ndata: {}\n\ndata: x:y\n\n";
            let whole = collect(&[stream]);
            assert_eq!(whole.len(), 3);
            assert_eq!(whole[0].0.as_deref(), Some("1.0.1"));
            assert_eq!(whole[1].1.as_deref(), Some("mcp-reattach/resumed"));
            assert_eq!(whole[2].2.as_deref(), Some("x:y"));
            for i in 0..=stream.len() {
                for j in i..=stream.len() {
                    let got = collect(&[&stream[..i], &stream[i..j], &stream[j..]]);
                    assert_eq!(got, whole, "split at {i}, {j}");
                }
            }
        }
    }
}

pub mod checks {
    //! What the load client counts as a failed run, and why. A run fails on any of: a gap
    //! (the gateway's `mcp-reattach/resumption-failed` event or a JSON-RPC error -32010), any
    //! other control event or unexpected message, a sequence break in the payloads, gateway
    //! ids out of order, a missing final result, or an I/O or HTTP error. (The orchestrator
    //! adds `timeout` when the load client has to be killed.)

    use std::collections::BTreeMap;

    /// The gateway's event for a resume (or a live client) that needs evicted events.
    pub const RESUMPTION_FAILED: &str = "mcp-reattach/resumption-failed";
    /// The JSON-RPC error code the gateway answers a lost request with.
    pub const CODE_RESUMPTION_FAILED: i64 = -32010;

    /// Key under which a `message` event that is not one of the mock's payloads is counted:
    /// `jsonrpc-error <code> <reason>` for a JSON-RPC error (what the gateway writes),
    /// `unexpected-message` otherwise.
    pub fn message_key(data: &[u8]) -> String {
        let v: serde_json::Value = serde_json::from_slice(data).unwrap_or_default();
        match v.pointer("/error/code").and_then(serde_json::Value::as_i64) {
            Some(code) => {
                let reason = v
                    .pointer("/error/data/reason")
                    .and_then(serde_json::Value::as_str)
                    .map(|r| format!(" {r}"))
                    .unwrap_or_default();
                format!("jsonrpc-error {code}{reason}")
            }
            None => "unexpected-message".into(),
        }
    }

    /// Whether a control key means the gateway lost events (a gap).
    pub fn is_gap(key: &str) -> bool {
        key == RESUMPTION_FAILED
            || key
                .strip_prefix("jsonrpc-error ")
                .and_then(|r| r.split(' ').next())
                .and_then(|c| c.parse::<i64>().ok())
                == Some(CODE_RESUMPTION_FAILED)
    }

    /// What one load run saw, summed over its streams.
    #[derive(Default, Debug)]
    pub struct Seen<'a> {
        pub seq_errors: u64,
        pub id_errors: u64,
        pub results: u64,
        pub expected_results: u64,
        /// Control events and unexpected messages, by key, with counts.
        pub control: Option<&'a BTreeMap<String, u64>>,
        pub errors: &'a [String],
    }

    /// The reasons a run failed, each `<check>: <detail>`; empty when it passed. Checks:
    /// `gap`, `control event`, `sequence break`, `id order`, `missing result`, `error`.
    pub fn failures(s: &Seen<'_>) -> Vec<String> {
        let mut out = Vec::new();
        let empty = BTreeMap::new();
        let control = s.control.unwrap_or(&empty);
        let fmt = |it: &mut dyn Iterator<Item = (&String, &u64)>| {
            it.map(|(k, n)| format!("{k} ×{n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let gaps = fmt(&mut control.iter().filter(|(k, _)| is_gap(k)));
        if !gaps.is_empty() {
            out.push(format!("gap: {gaps}"));
        }
        let other = fmt(&mut control.iter().filter(|(k, _)| !is_gap(k)));
        if !other.is_empty() {
            out.push(format!("control event: {other}"));
        }
        if s.seq_errors > 0 {
            out.push(format!(
                "sequence break: {} event(s) out of sequence",
                s.seq_errors
            ));
        }
        if s.id_errors > 0 {
            out.push(format!(
                "id order: {} gateway id(s) not increasing",
                s.id_errors
            ));
        }
        if s.results < s.expected_results {
            out.push(format!(
                "missing result: {} of {} stream(s) ended without their result",
                s.expected_results - s.results,
                s.expected_results
            ));
        }
        if !s.errors.is_empty() {
            out.push(format!(
                "error: {} ({} in all)",
                s.errors
                    .iter()
                    .take(3)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("; "),
                s.errors.len()
            ));
        }
        out
    }

    /// The check named by a failure reason (the part before the first `:`).
    pub fn check_of(reason: &str) -> &str {
        reason.split(':').next().unwrap_or(reason).trim()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn gap_event_and_error_fail_the_run() {
            let err = br#"{"jsonrpc":"2.0","id":3,"error":{"code":-32010,"message":"mcp-reattach: resumption failed: gap","data":{"reason":"gap"}}}"#;
            let key = message_key(err);
            assert_eq!(key, "jsonrpc-error -32010 gap");
            assert!(is_gap(&key));
            assert!(is_gap(RESUMPTION_FAILED));
            assert!(!is_gap("mcp-reattach/resumed"));
            assert!(!is_gap("jsonrpc-error -32603"));

            let mut control = BTreeMap::new();
            control.insert(RESUMPTION_FAILED.to_owned(), 1);
            let f = failures(&Seen {
                control: Some(&control),
                results: 1,
                expected_results: 1,
                ..Seen::default()
            });
            assert_eq!(f.len(), 1);
            assert_eq!(check_of(&f[0]), "gap");

            let mut control = BTreeMap::new();
            control.insert(key, 1);
            let f = failures(&Seen {
                control: Some(&control),
                results: 0,
                expected_results: 1,
                ..Seen::default()
            });
            let checks: Vec<&str> = f.iter().map(|r| check_of(r)).collect();
            assert_eq!(checks, ["gap", "missing result"]);

            assert!(failures(&Seen {
                results: 8,
                expected_results: 8,
                ..Seen::default()
            })
            .is_empty());
        }
    }
}
