//! Shared pieces of the benchmark harness: the clock shared by the mock upstream and the load
//! client, the event payload format, a minimal HTTP/1.1 client with an incremental chunked
//! decoder and SSE parser, and /proc sampling.

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
    //! sequence number and the send time.

    use std::fmt::Write;

    /// `data` of a progress event: exactly `size` bytes (or the minimum if smaller).
    pub fn event(seq: u64, ts: u64, size: usize, out: &mut Vec<u8>) {
        let mut head = String::with_capacity(128);
        let _ = write!(
            head,
            "{{\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{{\"level\":\"info\",\"data\":{{\"seq\":{seq},\"ts\":{ts},\"pad\":\""
        );
        pad_to(head.as_bytes(), b"\"}}}", size, out);
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

    fn number_after(data: &[u8], key: &[u8]) -> Option<u64> {
        let probe = &data[..data.len().min(160)];
        let at = memchr::memmem::find(probe, key)? + key.len();
        let mut n: u64 = 0;
        let mut any = false;
        for &b in &data[at..] {
            if !b.is_ascii_digit() {
                break;
            }
            n = n * 10 + u64::from(b - b'0');
            any = true;
        }
        any.then_some(n)
    }

    /// `(seq, ts, is_result)` of an event's data written by [`event`] or [`result`].
    pub fn parse(data: &[u8]) -> Option<(u64, u64, bool)> {
        let seq = number_after(data, b"\"seq\":")?;
        let ts = number_after(data, b"\"ts\":")?;
        let is_result = memchr::memmem::find(&data[..data.len().min(64)], b"\"result\"").is_some();
        Some((seq, ts, is_result))
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

    /// utime + stime of the processes, in seconds.
    pub fn cpu_seconds(pids: &[u32]) -> f64 {
        let tck = clk_tck() as f64;
        pids.iter()
            .filter_map(|&p| stat_fields(p))
            .map(|f| {
                // Fields after the comm: state is [0]; utime is field 14 → index 11, stime 12.
                let u: u64 = f[11].parse().unwrap_or(0);
                let s: u64 = f[12].parse().unwrap_or(0);
                (u + s) as f64 / tck
            })
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
}

pub mod http {
    //! A minimal HTTP/1.1 client: prebuilt requests, response heads, Content-Length and
    //! chunked bodies, read incrementally so SSE events are stamped when their bytes arrive.

    use std::io;
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use crate::clock::now_ns;

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
        pub stream: TcpStream,
        buf: Vec<u8>,
        pos: usize,
        /// Receive time of the latest read.
        pub last_read_ns: u64,
    }

    impl Conn {
        pub async fn connect(addr: SocketAddr) -> io::Result<Conn> {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            Ok(Conn {
                stream,
                buf: Vec::with_capacity(64 * 1024),
                pos: 0,
                last_read_ns: 0,
            })
        }

        pub async fn send(&mut self, req: &[u8]) -> io::Result<()> {
            self.stream.write_all(req).await
        }

        /// One read from the socket into the buffer; Ok(false) on EOF.
        async fn fill(&mut self) -> io::Result<bool> {
            if self.pos > 0 && self.pos == self.buf.len() {
                self.buf.clear();
                self.pos = 0;
            } else if self.pos > 32 * 1024 {
                self.buf.drain(..self.pos);
                self.pos = 0;
            }
            if self.buf.capacity() - self.buf.len() < 16 * 1024 {
                self.buf.reserve(64 * 1024);
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
                        out.extend_from_slice(avail);
                        self.pos = self.buf.len();
                    }
                    BodyKind::Length(_) => {
                        let n = avail.len().min(st.left);
                        out.extend_from_slice(&avail[..n]);
                        self.pos += n;
                        st.left -= n;
                        if st.left == 0 {
                            return Ok(false);
                        }
                    }
                    BodyKind::Chunked => match st.chunk {
                        Chunk::Size => {
                            let Some(nl) = memchr::memchr(b'\n', avail) else {
                                // Need more bytes for the size line.
                                if !self.fill().await? {
                                    return Err(io::Error::new(
                                        io::ErrorKind::UnexpectedEof,
                                        "eof in chunk size",
                                    ));
                                }
                                continue;
                            };
                            let line = std::str::from_utf8(&avail[..nl])
                                .map_err(|_| io::Error::other("bad chunk size"))?
                                .trim();
                            let hex = line.split(';').next().unwrap_or("");
                            let n = usize::from_str_radix(hex, 16).map_err(|_| {
                                io::Error::other(format!("bad chunk size {line:?}"))
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
                            out.extend_from_slice(&avail[..n]);
                            self.pos += n;
                            st.chunk = if n == left {
                                Chunk::DataEnd
                            } else {
                                Chunk::Data(left - n)
                            };
                        }
                        Chunk::DataEnd => {
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
    //! Incremental SSE parsing over a decoded body buffer.

    /// One event; slices borrow the buffer.
    #[derive(Debug, Default)]
    pub struct Ev<'a> {
        pub id: Option<&'a [u8]>,
        pub event: Option<&'a [u8]>,
        pub data: Option<&'a [u8]>,
        /// Only comment lines (keep-alive).
        pub comment_only: bool,
    }

    /// Calls `f` for each complete event in `buf[*start..]` and advances `*start`.
    /// Assumes LF line endings and single-line data (what the mock and the gateway write).
    pub fn parse<'a>(buf: &'a [u8], start: &mut usize, mut f: impl FnMut(Ev<'a>)) {
        let finder = memchr::memmem::Finder::new(b"\n\n");
        loop {
            let rest = &buf[*start..];
            // Skip a stray leading newline (a block that ended with CRLF handling etc.).
            let Some(end) = finder.find(rest) else { return };
            let block = &rest[..end];
            *start += end + 2;
            let mut ev = Ev {
                comment_only: true,
                ..Ev::default()
            };
            for line in block.split(|&b| b == b'\n') {
                if line.is_empty() {
                    continue;
                }
                if line[0] == b':' {
                    continue;
                }
                ev.comment_only = false;
                let (name, value) = match memchr::memchr(b':', line) {
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
            f(ev);
        }
    }

    /// The sequence part of a gateway id `<epoch>.<stream>.<seq>`.
    pub fn id_seq(id: &[u8]) -> Option<u64> {
        let dot = memchr::memrchr(b'.', id)?;
        std::str::from_utf8(&id[dot + 1..]).ok()?.parse().ok()
    }
}
