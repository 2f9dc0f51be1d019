//! Reading the gateway's SSE output in tests. One parser, [`SseParser`], written from the SSE
//! spec and independent of the crate's own decoder (a decoder bug must not hide itself by
//! judging its own output), behind two readers: [`SseReader`] over a hyper body (in-process
//! tests) and [`SseBody`] over a reqwest response (interop tests). Both yield a plain
//! [`Event`] record (`id`, `event`, `data`, `retry`), the harness's own (the crate's event is
//! held in its wire form); [`SseEventExt`] adds what the interop tests print and inspect.

use super::*;

/// One event as a client reads it: its fields as sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Event {
    pub id: Option<String>,
    pub event: Option<String>,
    /// The `data` lines joined with LF; `None` when the block had no `data` line.
    pub data: Option<String>,
    pub retry: Option<u64>,
}

/// An incremental SSE parser (the WHATWG event-stream format, LF or CRLF line endings, which is
/// what the gateway and the SDKs write). A block with at least one field is one event (`data`
/// is `None` when the block had no `data` line); comment lines (`:` keep-alives) are skipped.
#[derive(Default)]
pub struct SseParser {
    line: Vec<u8>,
    current: Event,
    has_field: bool,
    started: bool,
}

impl SseParser {
    pub fn new() -> SseParser {
        SseParser::default()
    }

    /// Parses `bytes` (any split of the stream); every event they complete is appended to
    /// `out`. Err when a line is not UTF-8 (the stream cannot be SSE).
    pub fn feed(&mut self, mut bytes: &[u8], out: &mut Vec<Event>) -> Result<(), String> {
        if !self.started && !bytes.is_empty() {
            // A UTF-8 byte-order mark may open the stream (split across feeds or not).
            let bom = b"\xEF\xBB\xBF";
            let have = self.line.len();
            let take = (bom.len() - have).min(bytes.len());
            if bom[have..have + take] == bytes[..take] {
                self.line.extend_from_slice(&bytes[..take]);
                bytes = &bytes[take..];
                if self.line.len() < bom.len() {
                    return Ok(());
                }
                self.line.clear();
            }
            self.started = true;
        }
        for &b in bytes {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line =
                String::from_utf8(line).map_err(|e| format!("SSE line is not UTF-8: {e}"))?;
            self.line_done(&line, out);
        }
        Ok(())
    }

    fn line_done(&mut self, line: &str, out: &mut Vec<Event>) {
        if line.is_empty() {
            if std::mem::take(&mut self.has_field) {
                out.push(std::mem::take(&mut self.current));
            }
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        self.has_field = true;
        match field {
            "id" if !value.contains('\0') => self.current.id = Some(value.to_owned()),
            "event" => self.current.event = Some(value.to_owned()),
            "data" => match &mut self.current.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.current.data = Some(value.to_owned()),
            },
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                self.current.retry = value.parse().ok();
            }
            _ => {}
        }
    }
}

/// The complete events in `bytes` (an SSE byte string; a trailing partial event is left out).
pub fn parse_sse(bytes: &[u8]) -> Vec<Event> {
    let mut out = Vec::new();
    SseParser::new()
        .feed(bytes, &mut out)
        .expect("SSE from the gateway");
    out
}

/// A raw HTTP/1.1 response with a chunked body, possibly cut anywhere (what a client whose
/// connection broke had read): its head (lower-cased) and the de-chunked body bytes that
/// arrived (a last, partial chunk included). `None` until the head is complete. Panics on
/// chunk framing the gateway must never write.
pub fn split_chunked_response(raw: &[u8]) -> Option<(String, Vec<u8>)> {
    let h = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..h]).to_ascii_lowercase();
    let body = &raw[h + 4..];
    let mut data = Vec::new();
    let mut i = 0;
    while let Some(eol) = body[i..].windows(2).position(|w| w == b"\r\n") {
        let line = std::str::from_utf8(&body[i..i + eol]).expect("chunk size line is ASCII");
        let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
            .unwrap_or_else(|_| panic!("chunk size line {line:?}"));
        if size == 0 {
            break;
        }
        let start = i + eol + 2;
        let end = (start + size).min(body.len());
        data.extend_from_slice(&body[start..end]);
        if start + size + 2 > body.len() {
            break;
        }
        assert_eq!(&body[start + size..start + size + 2], b"\r\n", "chunk end");
        i = start + size + 2;
    }
    Some((head, data))
}

/// What the interop tests print and inspect of an event.
pub trait SseEventExt {
    /// The `event:` type (`message` when absent).
    fn kind(&self) -> &str;
    /// The JSON-RPC message of a `message` event with data.
    fn json(&self) -> Option<serde_json::Value>;
    /// A one-line summary for test output.
    fn brief(&self) -> String;
}

impl SseEventExt for Event {
    fn kind(&self) -> &str {
        self.event.as_deref().unwrap_or("message")
    }

    fn json(&self) -> Option<serde_json::Value> {
        let data = self.data.as_deref().filter(|d| !d.is_empty())?;
        (self.kind() == "message")
            .then(|| serde_json::from_str(data).ok())
            .flatten()
    }

    fn brief(&self) -> String {
        let data: String = self
            .data
            .as_deref()
            .unwrap_or("")
            .chars()
            .take(200)
            .collect();
        format!(
            "[{} id={}] {data}",
            self.kind(),
            self.id.as_deref().unwrap_or("-")
        )
    }
}

/// Reads SSE events from a hyper response body; every wait is bounded by [`WAIT`].
pub struct SseReader {
    body: Incoming,
    parser: SseParser,
    pending: std::collections::VecDeque<Event>,
    pub raw: Vec<u8>,
    pub ended: bool,
}

impl SseReader {
    pub fn new(resp: Response<Incoming>) -> SseReader {
        SseReader {
            body: resp.into_body(),
            parser: SseParser::new(),
            pending: Default::default(),
            raw: Vec::new(),
            ended: false,
        }
    }

    /// The next event, or `None` when the body ends.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            if self.ended {
                return None;
            }
            match tokio::time::timeout(WAIT, self.body.frame())
                .await
                .expect("SSE event in time")
            {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.raw.extend_from_slice(&d);
                        let mut out = Vec::new();
                        self.parser
                            .feed(&d, &mut out)
                            .expect("valid SSE from the gateway");
                        self.pending.extend(out);
                    }
                }
                Some(Err(_)) | None => self.ended = true,
            }
        }
    }

    /// All remaining events until the body ends.
    pub async fn rest(&mut self) -> Vec<Event> {
        let mut v = Vec::new();
        while let Some(e) = self.next().await {
            v.push(e);
        }
        v
    }
}

/// Data of `message` events (or untyped events) with non-empty data: what an MCP client acts on.
pub fn messages(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.event.as_deref().is_none_or(|t| t == "message"))
        .filter_map(|e| e.data.clone())
        .filter(|d| !d.is_empty())
        .collect()
}

/// Reads SSE events from a reqwest response.
pub struct SseBody {
    resp: reqwest::Response,
    parser: SseParser,
    pending: std::collections::VecDeque<Event>,
}

impl SseBody {
    pub fn new(resp: reqwest::Response) -> SseBody {
        SseBody {
            resp,
            parser: SseParser::new(),
            pending: Default::default(),
        }
    }

    /// The next event: Ok(None) at the end of the body, Err on a read error, bytes that are
    /// not SSE, or at `deadline`.
    pub async fn next(&mut self, deadline: tokio::time::Instant) -> Result<Option<Event>, String> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(Some(e));
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left, self.resp.chunk()).await {
                Ok(Ok(Some(chunk))) => {
                    let mut out = Vec::new();
                    self.parser.feed(&chunk, &mut out)?;
                    self.pending.extend(out);
                }
                Ok(Ok(None)) => return Ok(None),
                Ok(Err(e)) => return Err(format!("read error: {e}")),
                Err(_) => return Err("timeout".to_string()),
            }
        }
    }
}
