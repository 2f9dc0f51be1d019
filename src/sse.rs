//! Incremental Server-Sent Events codec: a decoder that turns arbitrary byte chunks into
//! events (LF, CR and CRLF line ends, multi-line `data`, comments, `retry`, a leading BOM),
//! and an encoder that writes events back with the gateway's own id.
//!
//! Pure: no I/O, no tokio, no HTTP. Decoding any split of a byte stream yields the same
//! events as decoding it in one piece (property-tested below).

use bytes::{BufMut, Bytes, BytesMut};

/// One dispatched SSE event block (any block that carried at least one field), held in the
/// form the gateway writes it: everything after the `id:` line, built while the block is
/// decoded (one pass over the upstream's bytes: no field strings to join and encode again).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// `event:` (not when `message`), `retry:`, one `data:` line per data line, the blank line.
    body: Vec<u8>,
    /// The `id` field as sent by the upstream, if any (the gateway replaces it).
    id: Option<Box<str>>,
    /// The fields most events lack, out of line: events are moved by value through the
    /// reader's batch, so the event is kept small (bench/notes.md, "Figure: an event's size").
    rare: Option<Box<Rare>>,
    /// Where the `data:` lines start in `body` ([`NO_DATA`]: the block had no `data` field).
    data_at: u32,
    /// How many `data:` lines.
    data_lines: u32,
    /// The `event` field is `message` (written as no `event:` line: it is the default type).
    message: bool,
}

/// [`Event::data_at`] of an event without a `data` field.
const NO_DATA: u32 = u32::MAX;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Rare {
    /// The `event` field (event type) unless it is `message`.
    event: Option<String>,
    /// The `retry` field in milliseconds.
    retry: Option<u64>,
}

impl Event {
    /// The event of these fields (`data` lines split on LF; no field holds CR, or LF but `data`).
    pub fn new(
        id: Option<&str>,
        event: Option<&str>,
        data: Option<&str>,
        retry: Option<u64>,
    ) -> Event {
        let mut p = Partial {
            id: id.map(|i| i.as_bytes().to_vec()),
            retry,
            ..Partial::default()
        };
        p.set_event(event.map(str::as_bytes));
        if let Some(d) = data {
            for line in d.split('\n') {
                p.push_data(line.as_bytes());
            }
        }
        p.finish().expect("fields given as text are UTF-8")
    }

    /// A `message` event carrying `data` (one line).
    pub fn message_of(data: &str) -> Event {
        if memchr::memchr(b'\n', data.as_bytes()).is_some() {
            return Event::new(None, Some("message"), Some(data), None);
        }
        // One line, the usual message (an upgraded JSON answer): written at once, not
        // split into lines and assembled field by field.
        let mut body = Vec::with_capacity(data.len() + 8);
        body.extend_from_slice(b"data: ");
        body.extend_from_slice(data.as_bytes());
        body.extend_from_slice(b"\n\n");
        Event {
            body,
            id: None,
            rare: None,
            data_at: 0,
            data_lines: 1,
            message: true,
        }
    }

    /// The upstream's own id.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The event type as sent (`message` included).
    pub fn event(&self) -> Option<&str> {
        if self.message {
            Some("message")
        } else {
            self.rare.as_ref().and_then(|r| r.event.as_deref())
        }
    }

    /// Whether the type is an explicit `message` (left out of [`Event::body`]).
    pub fn message(&self) -> bool {
        self.message
    }

    pub fn retry(&self) -> Option<u64> {
        self.rare.as_ref().and_then(|r| r.retry)
    }

    /// The `data` lines joined with LF (borrowed when there is one line, the usual case);
    /// `None` when the block had no `data` field. UTF-8, checked when decoded.
    #[inline]
    pub fn data_bytes(&self) -> Option<std::borrow::Cow<'_, [u8]>> {
        if self.data_at == NO_DATA {
            return None;
        }
        let lines = &self.body[self.data_at as usize..self.body.len() - 1];
        if self.data_lines == 1 {
            return Some(std::borrow::Cow::Borrowed(&lines[6..lines.len() - 1]));
        }
        Some(std::borrow::Cow::Owned(self.joined_data(lines)))
    }

    /// The `data` lines of a multi-line event, joined with LF.
    fn joined_data(&self, lines: &[u8]) -> Vec<u8> {
        let mut joined = Vec::with_capacity(lines.len());
        for (i, line) in lines
            .split(|b| *b == b'\n')
            .take(self.data_lines as usize)
            .enumerate()
        {
            if i > 0 {
                joined.push(b'\n');
            }
            joined.extend_from_slice(&line[6..]);
        }
        joined
    }

    /// The `data` lines joined with LF, as text (borrowed when there is one line). Checked
    /// when decoded; converted here by the SIMD validator, cheap next to parsing it.
    pub fn data(&self) -> Option<std::borrow::Cow<'_, str>> {
        use std::borrow::Cow;
        Some(match self.data_bytes()? {
            Cow::Borrowed(b) => simdutf8::basic::from_utf8(b)
                .map_or_else(|_| String::from_utf8_lossy(b), Cow::Borrowed),
            Cow::Owned(v) => Cow::Owned(
                String::from_utf8(v)
                    .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
            ),
        })
    }

    /// What follows the `id:` line on the wire: `write_id` + (`event: message\n` when
    /// [`Event::message`]) + this is [`encode`]'s output, less an explicit `event: message`.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// Takes [`Event::body`] out (the event is spent).
    pub fn take_body(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.body)
    }

    /// The same event with `prefix` before its type (only when it has a type other than
    /// `message`).
    pub fn prefix_type(&mut self, prefix: &str) {
        if let Some(t) = self.rare.as_ref().and_then(|r| r.event.as_ref()) {
            let typed = format!("{prefix}{t}");
            let data = self.data();
            *self = Event::new(self.id(), Some(&typed), data.as_deref(), self.retry());
        }
    }
}

/// Why the decoder refused its input. The stream it came from cannot continue.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("SSE event larger than {limit} bytes")]
    TooLarge { limit: usize },
    #[error("SSE event is not valid UTF-8")]
    InvalidUtf8,
}

/// Capacity a decoder keeps for the lines it assembles across chunks between events.
const KEPT_LINE_BYTES: usize = 16 * 1024;

/// Stateful, incremental SSE decoder.
#[derive(Debug)]
pub struct Decoder {
    max_event_bytes: usize,
    /// Bytes of the current, not yet terminated line.
    line: Vec<u8>,
    /// The previous chunk ended in CR: a leading LF of the next chunk belongs to it.
    after_cr: bool,
    /// Still at the very start of the stream (a BOM may follow).
    at_start: bool,
    /// Fields of the event being built.
    cur: Partial,
    /// Bytes accounted to the event being built (line bytes included).
    cur_bytes: usize,
}

#[derive(Debug, Default)]
struct Partial {
    id: Option<Vec<u8>>,
    /// The `event` type unless `message`.
    event: Option<Vec<u8>>,
    message: bool,
    /// The `data:` lines as written ([`Event::body`]'s tail, less the blank line).
    data: Vec<u8>,
    data_lines: u32,
    retry: Option<u64>,
}

impl Partial {
    fn is_empty(&self) -> bool {
        self.id.is_none()
            && self.event.is_none()
            && !self.message
            && self.data_lines == 0
            && self.retry.is_none()
    }

    fn set_event(&mut self, t: Option<&[u8]>) {
        self.message = t == Some(b"message");
        self.event = t.filter(|_| !self.message).map(<[u8]>::to_vec);
    }

    fn push_data(&mut self, line: &[u8]) {
        if self.data_lines == 0 {
            // One line is the usual event: its `data: `, LF and the blank line fit exactly.
            self.data.reserve_exact(line.len() + 8);
        }
        self.data.extend_from_slice(b"data: ");
        self.data.extend_from_slice(line);
        self.data.push(b'\n');
        self.data_lines += 1;
    }

    /// The event, its body written: the `data:` lines are already in place when there is no
    /// `event:` or `retry:` line to put before them (the usual event), else copied once.
    fn finish(self) -> Result<Event, SseError> {
        let utf8 = |v: Vec<u8>| String::from_utf8(v).map_err(|_| SseError::InvalidUtf8);
        let id = self.id.map(utf8).transpose()?.map(String::into_boxed_str);
        let event = self.event.map(utf8).transpose()?;
        let rare = (event.is_some() || self.retry.is_some()).then(|| {
            Box::new(Rare {
                event,
                retry: self.retry,
            })
        });
        let (mut body, at) = match &rare {
            None => (self.data, 0),
            Some(r) => {
                let mut b = Vec::with_capacity(self.data.len() + 40);
                if let Some(t) = &r.event {
                    b.extend_from_slice(b"event: ");
                    b.extend_from_slice(t.as_bytes());
                    b.push(b'\n');
                }
                if let Some(n) = r.retry {
                    b.extend_from_slice(b"retry: ");
                    b.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
                    b.push(b'\n');
                }
                let at = b.len();
                b.extend_from_slice(&self.data);
                (b, at)
            }
        };
        body.push(b'\n');
        // Where the data starts: within the decoder's limit, far below 4 GiB.
        let data_at = match u32::try_from(at) {
            Ok(at) if self.data_lines > 0 => at,
            _ => NO_DATA,
        };
        Ok(Event {
            body,
            id,
            rare,
            data_at,
            data_lines: self.data_lines,
            message: self.message,
        })
    }
}

impl Decoder {
    /// A decoder refusing any single event (all of its lines) larger than `max_event_bytes`.
    pub fn new(max_event_bytes: usize) -> Decoder {
        Decoder {
            max_event_bytes,
            line: Vec::new(),
            after_cr: false,
            at_start: true,
            cur: Partial::default(),
            cur_bytes: 0,
        }
    }

    /// Bytes the decoder holds of an event not yet complete (its line and data buffers, as
    /// allocated); none between events (the spare capacity it keeps for lines is the
    /// connection's).
    pub fn held(&self) -> usize {
        if self.line.is_empty() && self.cur_bytes == 0 {
            return 0;
        }
        self.line.capacity() + self.cur.data.capacity()
    }

    /// Feeds one chunk; complete events are appended to `out` in order.
    pub fn feed(&mut self, mut chunk: &[u8], out: &mut Vec<Event>) -> Result<(), SseError> {
        if self.at_start && !chunk.is_empty() {
            // A UTF-8 BOM may open the stream; it can arrive split across chunks.
            let bom = b"\xEF\xBB\xBF";
            let have = self.line.len();
            let take = (bom.len() - have).min(chunk.len());
            if bom[have..have + take] == chunk[..take] {
                if have + take == bom.len() {
                    self.line.clear();
                    self.at_start = false;
                    chunk = &chunk[take..];
                } else {
                    self.line.extend_from_slice(&chunk[..take]);
                    return Ok(());
                }
            } else {
                // Not a BOM after all: the bytes held back are the start of the first line.
                self.at_start = false;
                self.grow(have)?;
            }
        }
        while !chunk.is_empty() {
            // At an event's start, the usual event whole in this chunk: decoded at once.
            // (Every field line counts at least a byte: none since the last event when none is
            // counted.)
            if !self.after_cr && self.line.is_empty() && self.cur_bytes == 0 {
                debug_assert!(self.cur.is_empty());
                if let Some((ev, used)) = self.whole_event(chunk) {
                    out.push(ev);
                    chunk = &chunk[used..];
                    continue;
                }
            }
            if self.after_cr {
                self.after_cr = false;
                if chunk[0] == b'\n' {
                    chunk = &chunk[1..];
                    continue;
                }
            }
            // The blank line that ends an event (every other line here) is seen without a
            // search.
            let end = if chunk[0] == b'\n' || chunk[0] == b'\r' {
                Some(0)
            } else {
                memchr::memchr2(b'\n', b'\r', chunk)
            };
            match end {
                Some(i) => {
                    self.grow(i)?;
                    let line = &chunk[..i];
                    let rest = if chunk[i] == b'\r' {
                        if chunk.get(i + 1) == Some(&b'\n') {
                            &chunk[i + 2..]
                        } else {
                            self.after_cr = i + 1 == chunk.len();
                            &chunk[i + 1..]
                        }
                    } else {
                        &chunk[i + 1..]
                    };
                    if self.line.is_empty() {
                        // The whole line is in this chunk (the usual case): no copy.
                        self.process_line(line, out)?;
                    } else {
                        self.line.extend_from_slice(line);
                        let mut line = std::mem::take(&mut self.line);
                        self.process_line(&line, out)?;
                        line.clear();
                        // A long line (a large event's data) is not kept as spare capacity
                        // for the rest of the stream: its event holds those bytes already.
                        line.shrink_to(KEPT_LINE_BYTES);
                        self.line = line;
                    }
                    chunk = rest;
                }
                None => {
                    self.grow(chunk.len())?;
                    self.line.extend_from_slice(chunk);
                    chunk = &[];
                }
            }
        }
        Ok(())
    }

    /// The usual event, when `chunk` begins with the whole of it: an optional
    /// `event: message` line, then one `data:` line, then the blank line, every line ending in
    /// LF or CRLF (what the TypeScript and Python SDKs write). Returns it and how
    /// many bytes of `chunk` it took, or `None` for anything else (another shape, an event cut
    /// by the chunk's end, an event over the limit or with invalid UTF-8): the line-by-line
    /// path then decodes it, errors included. Decodes to exactly what that path would (the
    /// property tests below compare the two): one search for the data line's end instead of
    /// one per line and no field-by-field assembly (bench/notes.md, "Figure: an event's size").
    fn whole_event(&self, chunk: &[u8]) -> Option<(Event, usize)> {
        const TYPE: &[u8] = b"event: message";
        // Compared as two words (a call to `memcmp` otherwise).
        let typed = chunk.len() > TYPE.len()
            && chunk[..8] == TYPE[..8]
            && chunk[TYPE.len() - 8..TYPE.len()] == TYPE[TYPE.len() - 8..];
        let (message, at) = match &chunk[if typed { TYPE.len() } else { 0 }..] {
            _ if !typed => (false, 0),
            [b'\n', ..] => (true, TYPE.len() + 1),
            [b'\r', b'\n', ..] => (true, TYPE.len() + 2),
            _ => return None,
        };
        let line = &chunk[at..];
        let value_at = if line.starts_with(b"data: ") {
            6
        } else if line.starts_with(b"data:") {
            5
        } else {
            return None;
        };
        let end = value_at + memchr::memchr2(b'\n', b'\r', &line[value_at..])?;
        // The blank line ends as the data line does.
        let ending = match line[end..] {
            [b'\n', b'\n', ..] => 2,
            [b'\r', b'\n', b'\r', b'\n', ..] => 4,
            _ => return None,
        };
        // What the line-by-line path counts toward the limit: the lines, less their ends.
        let counted = if message { TYPE.len() } else { 0 } + end;
        if counted > self.max_event_bytes {
            return None;
        }
        let value = &line[value_at..end];
        simdutf8::basic::from_utf8(value).ok()?;
        let mut body = Vec::with_capacity(value.len() + 8);
        body.extend_from_slice(b"data: ");
        body.extend_from_slice(value);
        body.extend_from_slice(b"\n\n");
        let ev = Event {
            body,
            id: None,
            rare: None,
            data_at: 0,
            data_lines: 1,
            message,
        };
        Some((ev, at + end + ending))
    }

    fn grow(&mut self, n: usize) -> Result<(), SseError> {
        self.cur_bytes += n;
        if self.cur_bytes > self.max_event_bytes {
            return Err(SseError::TooLarge {
                limit: self.max_event_bytes,
            });
        }
        Ok(())
    }

    fn process_line(&mut self, line: &[u8], out: &mut Vec<Event>) -> Result<(), SseError> {
        if line.is_empty() {
            let cur = std::mem::take(&mut self.cur);
            self.cur_bytes = 0;
            if !cur.is_empty() {
                out.push(cur.finish()?);
            }
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(()); // comment
        }
        // The usual line, without the general field match below.
        if let Some(v) = line.strip_prefix(b"data:") {
            let value = v.strip_prefix(b" ").unwrap_or(v);
            simdutf8::basic::from_utf8(value).map_err(|_| SseError::InvalidUtf8)?;
            self.cur.push_data(value);
            return Ok(());
        }
        // The usual fields by their prefix; others (and `data` without a colon) by a search.
        let split = match line[0] {
            b'd' if line.starts_with(b"data:") => Some(4),
            b'e' if line.starts_with(b"event:") => Some(5),
            _ => memchr::memchr(b':', line),
        };
        let (name, value) = match split {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match name {
            b"data" => {
                simdutf8::basic::from_utf8(value).map_err(|_| SseError::InvalidUtf8)?;
                self.cur.push_data(value);
            }
            b"event" => self.cur.set_event(Some(value)),
            b"id" if !value.contains(&0) => self.cur.id = Some(value.to_vec()),
            b"retry" if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                self.cur.retry = std::str::from_utf8(value).ok().and_then(|s| s.parse().ok());
            }
            _ => {} // unknown fields are ignored, as the SSE standard says
        }
        Ok(())
    }
}

/// Writes `ev` as one SSE block with `id` as its id (the upstream's id is not written).
pub fn encode(id: &str, ev: &Event, out: &mut BytesMut) {
    debug_assert!(is_valid_id(id));
    out.reserve(32 + id.len() + ev.body.len());
    out.put_slice(b"id: ");
    out.put_slice(id.as_bytes());
    out.put_u8(b'\n');
    if ev.message {
        out.put_slice(b"event: message\n");
    }
    out.put_slice(&ev.body);
}

/// Writes an `id:` line.
pub fn write_id(id: impl std::fmt::Display, out: &mut BytesMut) {
    use std::fmt::Write;
    out.put_slice(b"id: ");
    // Writing into a BytesMut cannot fail.
    let _ = write!(out, "{id}");
    out.put_u8(b'\n');
}

/// Writes a gateway-made event: `id`, an optional `event` type, an optional `retry`, and `data`
/// (a single line of JSON or empty).
pub(crate) fn control(
    id: Option<&str>,
    event: Option<&str>,
    retry_ms: Option<u64>,
    data: &str,
) -> Bytes {
    debug_assert!(!data.contains(['\n', '\r']));
    let mut out = BytesMut::with_capacity(64 + data.len());
    if let Some(id) = id {
        out.put_slice(b"id: ");
        out.put_slice(id.as_bytes());
        out.put_u8(b'\n');
    }
    if let Some(t) = event {
        out.put_slice(b"event: ");
        out.put_slice(t.as_bytes());
        out.put_u8(b'\n');
    }
    if let Some(r) = retry_ms {
        write_retry(r, &mut out);
    }
    out.put_slice(b"data: ");
    out.put_slice(data.as_bytes());
    out.put_slice(b"\n\n");
    out.freeze()
}

fn write_retry(ms: u64, out: &mut BytesMut) {
    out.put_slice(b"retry: ");
    out.put_slice(ms.to_string().as_bytes());
    out.put_u8(b'\n');
}

/// The keep-alive comment the gateway sends on idle streams.
pub const KEEPALIVE: &[u8] = b": keepalive\n\n";

/// An SSE id the gateway may emit: non-empty visible ASCII (no CR, LF, NUL or spaces).
pub fn is_valid_id(id: &str) -> bool {
    !id.is_empty() && id.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(input: &[u8]) -> Vec<Event> {
        let mut d = Decoder::new(1 << 20);
        let mut out = Vec::new();
        d.feed(input, &mut out).expect("decodes");
        out
    }

    fn ev(data: &str) -> Event {
        Event::new(None, None, Some(data), None)
    }

    /// `e` with `id` as its id.
    fn with_id(e: &Event, id: &str) -> Event {
        Event::new(Some(id), e.event(), e.data().as_deref(), e.retry())
    }

    #[test]
    fn line_endings_are_equivalent() {
        let lf = decode_all(b"data: a\n\ndata: b\n\n");
        let cr = decode_all(b"data: a\r\rdata: b\r\r");
        let crlf = decode_all(b"data: a\r\n\r\ndata: b\r\n\r\n");
        assert_eq!(lf, vec![ev("a"), ev("b")]);
        assert_eq!(lf, cr);
        assert_eq!(lf, crlf);
    }

    #[test]
    fn crlf_split_across_chunks_is_one_line_end() {
        let mut d = Decoder::new(1024);
        let mut out = Vec::new();
        d.feed(b"data: a\r", &mut out).unwrap();
        d.feed(b"\n\r", &mut out).unwrap();
        d.feed(b"\ndata: b\r\n\r\n", &mut out).unwrap();
        assert_eq!(out, vec![ev("a"), ev("b")]);
    }

    #[test]
    fn fields_comments_and_multiline_data() {
        let out = decode_all(
            b": ping - 2025\nid: up-1\nevent: message\nretry: 1500\ndata: {\"a\":\ndata:1}\nx-unknown: y\n\n",
        );
        assert_eq!(
            out,
            vec![Event::new(
                Some("up-1"),
                Some("message"),
                Some("{\"a\":\n1}"),
                Some(1500)
            )]
        );
    }

    #[test]
    fn empty_data_and_id_only_blocks_are_events_comment_blocks_are_not() {
        let out = decode_all(b"id: 1\ndata:\n\n: only a comment\n\nid: 2\n\n\n\nretry: x1\n\n");
        assert_eq!(
            out,
            vec![
                Event::new(Some("1"), None, Some(""), None),
                Event::new(Some("2"), None, None, None),
            ]
        );
        // Two empty data lines make one LF.
        assert_eq!(decode_all(b"data\ndata\n\n"), vec![ev("\n")]);
    }

    #[test]
    fn an_event_is_decoded_into_the_form_the_gateway_writes() {
        let out = decode_all(
            b"event: message\ndata: {\"a\":1}\n\nretry: 5\ndata: x\r\nevent: t\ndata:y\nid: 9\n\n",
        );
        assert_eq!(out[0].body(), b"data: {\"a\":1}\n\n");
        assert!(out[0].message());
        assert!(matches!(
            out[0].data_bytes(),
            Some(std::borrow::Cow::Borrowed(b"{\"a\":1}"))
        ));
        // `event:` and `retry:` first, whatever order they came in; the id is not written.
        assert_eq!(out[1].body(), b"event: t\nretry: 5\ndata: x\ndata: y\n\n");
        assert!(!out[1].message());
        assert_eq!(out[1].data_bytes().as_deref(), Some(&b"x\ny"[..]));
        assert_eq!((out[1].id(), out[1].retry()), (Some("9"), Some(5)));
        // The last `event:` line wins, `message` or not.
        let out = decode_all(b"event: message\nevent: t\n\nevent: t\nevent: message\n\n");
        assert_eq!(
            (out[0].event(), out[0].body()),
            (Some("t"), &b"event: t\n\n"[..])
        );
        assert_eq!(
            (out[1].event(), out[1].body()),
            (Some("message"), &b"\n"[..])
        );
        assert_eq!(out[1].data_bytes(), None);
    }

    #[test]
    fn an_event_is_small_enough_to_move() {
        // Events are moved by value through the reader's batch (and shifted when flow control
        // leaves some behind): their fields most events lack are out of line.
        assert!(std::mem::size_of::<Event>() <= 64);
    }

    #[test]
    fn unterminated_event_is_not_dispatched() {
        assert!(decode_all(b"data: a\n").is_empty());
        assert!(decode_all(b"data: a").is_empty());
    }

    #[test]
    fn bom_is_stripped_once_even_when_split() {
        let mut d = Decoder::new(1024);
        let mut out = Vec::new();
        d.feed(b"\xEF", &mut out).unwrap();
        d.feed(b"\xBB\xBFdata: a\n\n\xEF\xBB\xBFdata: b\n\n", &mut out)
            .unwrap();
        assert_eq!(out[0], ev("a"));
        // A BOM later in the stream is part of a field name, so that block has no data field.
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn oversized_event_is_refused() {
        let mut d = Decoder::new(16);
        let mut out = Vec::new();
        assert_eq!(
            d.feed(b"data: 0123456789abcdef\n", &mut out),
            Err(SseError::TooLarge { limit: 16 })
        );
        // The limit counts the whole event, not one line.
        let mut d = Decoder::new(16);
        assert!(d.feed(b"data: 012345\n", &mut out).is_ok());
        assert!(d.feed(b"data: 012345\n", &mut out).is_err());
        // ... and resets after each event.
        let mut d = Decoder::new(16);
        for _ in 0..10 {
            d.feed(b"data: 0123\n\n", &mut out).unwrap();
        }
    }

    #[test]
    fn a_held_back_bom_like_prefix_counts_toward_the_limit() {
        let input = b"\xEFdata: x\n\n"; // an 8-byte line
        let mut whole = Decoder::new(7);
        assert!(whole.feed(input, &mut Vec::new()).is_err());
        let mut split = Decoder::new(7);
        let first = split.feed(&input[..1], &mut Vec::new());
        assert!(first
            .and_then(|()| split.feed(&input[1..], &mut Vec::new()))
            .is_err());
    }

    #[test]
    fn invalid_utf8_is_refused() {
        let mut d = Decoder::new(1024);
        let mut out = Vec::new();
        assert_eq!(
            d.feed(b"data: \xff\xfe\n\n", &mut out),
            Err(SseError::InvalidUtf8)
        );
    }

    #[test]
    fn encode_round_trips_and_replaces_id() {
        let e = Event::new(
            Some("upstream"),
            Some("message"),
            Some("line1\nline2\n"),
            Some(10),
        );
        let mut buf = BytesMut::new();
        encode("gw.1", &e, &mut buf);
        let back = decode_all(&buf);
        assert_eq!(back, vec![with_id(&e, "gw.1")]);
    }

    #[test]
    fn control_events_decode() {
        let b = control(Some("x.1"), Some("mcp-reattach/resumed"), Some(500), "{}");
        assert_eq!(
            decode_all(&b),
            vec![Event::new(
                Some("x.1"),
                Some("mcp-reattach/resumed"),
                Some("{}"),
                Some(500)
            )]
        );
    }

    fn arb_event() -> impl Strategy<Value = Event> {
        let text = "[a-zA-Z0-9 {}\":,é]{0,12}";
        (
            proptest::option::of("[!-~]{1,10}"),
            proptest::option::of(prop_oneof![Just("message".to_owned()), "[a-z/]{1,8}"]),
            proptest::option::of(proptest::collection::vec(text, 1..4).prop_map(|v| v.join("\n"))),
            proptest::option::of(0u64..100_000),
        )
            .prop_filter("a block needs a field", |(i, e, d, r)| {
                i.is_some() || e.is_some() || d.is_some() || r.is_some()
            })
            .prop_map(|(id, event, data, retry)| {
                Event::new(id.as_deref(), event.as_deref(), data.as_deref(), retry)
            })
    }

    fn write_raw(events: &[Event], eol: &str, comments: bool) -> Vec<u8> {
        let mut s = String::new();
        for e in events {
            if comments {
                s.push_str(": ping");
                s.push_str(eol);
            }
            if let Some(i) = e.id() {
                s.push_str(&format!("id: {i}{eol}"));
            }
            if let Some(t) = e.event() {
                s.push_str(&format!("event:{t}{eol}"));
            }
            if let Some(r) = e.retry() {
                s.push_str(&format!("retry: {r}{eol}"));
            }
            if let Some(d) = e.data() {
                for l in d.split('\n') {
                    s.push_str(&format!("data: {l}{eol}"));
                }
            }
            s.push_str(eol);
        }
        s.into_bytes()
    }

    proptest! {
        /// A message made at once is the one built field by field, for data of one line or
        /// of several.
        #[test]
        fn message_of_is_the_message_built_by_fields(
            data in prop_oneof!["[^\r\n]{0,40}", "[a-z{}\n]{0,20}"],
        ) {
            prop_assert_eq!(
                Event::message_of(&data),
                Event::new(None, Some("message"), Some(&data), None)
            );
        }

        #[test]
        fn body_encoding_matches_full_encoding(e in arb_event(), id in "[!-~]{1,20}") {
            let mut wire = BytesMut::new();
            write_id(&id, &mut wire);
            if e.message() {
                wire.put_slice(b"event: message\n");
            }
            wire.put_slice(e.body());
            prop_assert_eq!(decode_all(&wire), vec![with_id(&e, &id)]);
        }

        #[test]
        fn any_split_gives_the_same_events(
            events in proptest::collection::vec(arb_event(), 0..8),
            eol in prop_oneof![Just("\n"), Just("\r"), Just("\r\n")],
            comments in any::<bool>(),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..12),
        ) {
            let raw = write_raw(&events, eol, comments);
            let whole = decode_all(&raw);
            prop_assert_eq!(&whole, &events);
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(raw.len() + 1)).collect();
            points.sort_unstable();
            let mut d = Decoder::new(1 << 20);
            let mut out = Vec::new();
            let mut prev = 0;
            for p in points.into_iter().chain(std::iter::once(raw.len())) {
                d.feed(&raw[prev..p], &mut out).unwrap();
                prev = p;
            }
            prop_assert_eq!(out, whole);
        }

        #[test]
        fn byte_at_a_time_equals_whole(events in proptest::collection::vec(arb_event(), 0..5)) {
            let raw = write_raw(&events, "\r\n", true);
            let mut d = Decoder::new(1 << 20);
            let mut out = Vec::new();
            for b in &raw {
                d.feed(std::slice::from_ref(b), &mut out).unwrap();
            }
            prop_assert_eq!(out, events);
        }

        #[test]
        fn the_whole_event_path_decodes_as_line_by_line(
            blocks in proptest::collection::vec(
                (
                    prop_oneof![Just(""), Just("event: message"), Just("event: messages"), Just("event:message")],
                    prop_oneof![Just("data: "), Just("data:"), Just("data:  "), Just("dat: ")],
                    prop_oneof![
                        "[a-z]{0,6}".prop_map(String::into_bytes),
                        "[a-zA-Z0-9 {}\":,é]{0,24}".prop_map(String::into_bytes),
                        Just(b"bad \xC3 utf-8".to_vec()),
                    ],
                    proptest::collection::vec(prop_oneof![Just("\n"), Just("\r\n"), Just("\r")], 3),
                ),
                1..5,
            ),
            limit in prop_oneof![0usize..32, Just(1 << 20)],
        ) {
            // Events in the shapes the SDKs write and near misses of them, each line with any
            // line end: decoded whole (the fast path where it applies), then a byte at a time
            // (never whole in a chunk: line by line), the same events and the same error.
            let mut raw = Vec::new();
            for (ty, field, value, eols) in &blocks {
                if !ty.is_empty() {
                    raw.extend_from_slice(ty.as_bytes());
                    raw.extend_from_slice(eols[0].as_bytes());
                }
                raw.extend_from_slice(field.as_bytes());
                raw.extend_from_slice(value);
                raw.extend_from_slice(eols[1].as_bytes());
                raw.extend_from_slice(eols[2].as_bytes());
            }
            let decode = |pieces: &mut dyn Iterator<Item = &[u8]>| {
                let mut d = Decoder::new(limit);
                let mut out = Vec::new();
                for p in pieces {
                    if let Err(e) = d.feed(p, &mut out) {
                        return (out, Some(e));
                    }
                }
                (out, None)
            };
            let whole = decode(&mut std::iter::once(&raw[..]));
            let bytes = decode(&mut raw.chunks(1));
            prop_assert_eq!(whole, bytes);
        }

        #[test]
        fn encode_decode_round_trip(e in arb_event(), id in "[!-~]{1,20}") {
            let mut buf = BytesMut::new();
            encode(&id, &e, &mut buf);
            let back = decode_all(&buf);
            prop_assert_eq!(back, vec![with_id(&e, &id)]);
        }
    }
}
