//! The little JSON-RPC/MCP knowledge the gateway needs: which requests a POST carries, which
//! responses an event carries, protocol-era detection, and the JSON-RPC error bodies the
//! gateway writes itself.
//!
//! Pure: works on byte slices and strings; never rewrites a message it forwards.

use std::sync::LazyLock;

use bytes::{BufMut, Bytes, BytesMut};
use memchr::memmem::Finder;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::sse;

/// First protocol version of the modern (sessionless, cancel-on-disconnect) era.
pub(crate) const FIRST_MODERN_VERSION: &str = "2026-07-28";
/// First protocol version whose servers prime streams (SEP-1699).
pub(crate) const FIRST_PRIMING_VERSION: &str = "2025-11-25";

/// What the gateway needs to know of a POST body.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct PostInfo {
    /// Ids (canonical JSON text) of the requests in the body.
    pub request_ids: Vec<String>,
    /// The body holds an `initialize` request.
    pub initialize: bool,
    /// The body holds the `notifications/initialized` notification.
    pub initialized: bool,
    /// The protocol version the body names (`_meta` version, or `initialize`'s requested one).
    pub version: Option<String>,
    /// A single request's id, for error bodies the gateway writes for this POST.
    pub single_id: Option<Value>,
    /// The version named by a `_meta` entry (the modern era's per-request version).
    pub meta_version: Option<String>,
    /// The MCP method of the body's first message ([`method_label`]), `batch` for several.
    pub method: Option<&'static str>,
    /// The tool a single `tools/call` names.
    pub tool: Option<String>,
}

impl PostInfo {
    /// Whether the body names a modern-era version in `_meta` (an `initialize`'s requested
    /// version does not count: `initialize` exists only in the legacy eras).
    pub(crate) fn modern(&self) -> bool {
        self.meta_version.as_deref().is_some_and(is_modern)
    }
}

#[derive(Deserialize)]
struct Msg {
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    params: Option<Params>,
}

#[derive(Deserialize)]
struct Params {
    #[serde(default, rename = "protocolVersion")]
    protocol_version: Option<String>,
    /// A `tools/call`'s tool (and a `prompts/get`'s prompt: only read for `tools/call`).
    #[serde(default)]
    name: Option<String>,
    #[serde(default, rename = "_meta")]
    meta: Option<Meta>,
}

#[derive(Deserialize)]
struct Meta {
    /// The `_meta` key carrying the protocol version in modern-era requests.
    #[serde(default, rename = "io.modelcontextprotocol/protocolVersion")]
    version: Option<String>,
}

/// A JSON-RPC message or a batch of them, told apart by the first byte (an untagged serde
/// enum would buffer the whole document and try each shape: most of a POST's parsing cost).
/// `None` when `body` is neither an object nor an array of objects of this shape.
fn one_or_many<T: serde::de::DeserializeOwned>(body: &[u8]) -> Option<(Vec<T>, bool)> {
    match body.iter().find(|b| !b.is_ascii_whitespace())? {
        b'[' => serde_json::from_slice::<Vec<T>>(body)
            .ok()
            .map(|v| (v, false)),
        b'{' => serde_json::from_slice::<T>(body)
            .ok()
            .map(|m| (vec![m], true)),
        _ => None,
    }
}

/// Reads a POST body. Anything that is not JSON-RPC yields the default (the upstream judges it).
pub(crate) fn inspect_post(body: &[u8]) -> PostInfo {
    let Some((msgs, single)) = one_or_many::<Msg>(body) else {
        return PostInfo::default();
    };
    let mut info = PostInfo::default();
    let several = msgs.len() > 1;
    for mut m in msgs {
        let Some(method) = &m.method else { continue };
        if info.method.is_none() {
            info.method = Some(if several {
                "batch"
            } else {
                method_label(method)
            });
            if !several && method == "tools/call" {
                info.tool = m.params.as_mut().and_then(|p| p.name.take());
            }
        }
        if method == "notifications/initialized" {
            info.initialized = true;
        }
        if method == "initialize" {
            info.initialize = true;
            if let Some(v) = m.params.as_ref().and_then(|p| p.protocol_version.clone()) {
                info.version.get_or_insert(v);
            }
        }
        if let Some(v) = m
            .params
            .as_ref()
            .and_then(|p| p.meta.as_ref())
            .and_then(|m| m.version.clone())
        {
            info.version = Some(v.clone());
            info.meta_version = Some(v);
        }
        if let Some(id) = m.id {
            if single {
                info.single_id = Some(id.clone());
            }
            info.request_ids.push(id.to_string());
        }
    }
    info
}

/// MCP methods a client sends (requests and notifications, every protocol version so far):
/// the values of the `method` label of the per-method metrics and the access line's
/// `mcp.method.name`. Anything else is `other`, so the label's values are bounded.
pub(crate) const METHODS: [&str; 27] = [
    "initialize",
    "ping",
    "tools/list",
    "tools/call",
    "resources/list",
    "resources/templates/list",
    "resources/read",
    "resources/subscribe",
    "resources/unsubscribe",
    "prompts/list",
    "prompts/get",
    "completion/complete",
    "logging/setLevel",
    "tasks/get",
    "tasks/result",
    "tasks/list",
    "tasks/cancel",
    "notifications/initialized",
    "notifications/cancelled",
    "notifications/progress",
    "notifications/roots/list_changed",
    "notifications/tasks/status",
    "sampling/createMessage",
    "elicitation/create",
    "roots/list",
    "batch",
    "other",
];

/// The label for a JSON-RPC method: itself if it is an MCP method ([`METHODS`]), else `other`.
pub(crate) fn method_label(method: &str) -> &'static str {
    METHODS
        .iter()
        .find(|m| **m == method)
        .copied()
        .unwrap_or("other")
}

#[derive(Deserialize)]
struct Reply<'a> {
    #[serde(default, borrow)]
    id: Option<&'a RawValue>,
    #[serde(default)]
    method: Option<IgnoredAny>,
    #[serde(default)]
    result: Option<IgnoredAny>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

/// Ids (canonical JSON text) of the JSON-RPC responses in an event's data. Inlined: for
/// most events of a stream (notifications) it is the first member's check alone.
#[inline]
pub(crate) fn response_ids<D: AsRef<[u8]> + ?Sized>(data: &D) -> Vec<String> {
    // Progress and other notifications are most of a stream: skip them without parsing.
    // The searchers are built once: building one per event cost more than the search.
    // A response has an `id` (null at worst) and a `result` or an `error`; a notification,
    // most of a stream, usually has no `id` at all, so one pass rules it out.
    let b = data.as_ref();
    if names_method_first(b) {
        return Vec::new();
    }
    checked_response_ids(b)
}

/// [`response_ids`] of data that is not a notification's.
fn checked_response_ids(b: &[u8]) -> Vec<String> {
    // As text (SIMD-checked), so the parse does not check each string it meets again.
    simdutf8::basic::from_utf8(b).map_or_else(|_| Vec::new(), parsed_response_ids)
}

/// [`response_ids`] without the check of the first member.
fn parsed_response_ids(data: &str) -> Vec<String> {
    let b = data.as_bytes();
    static ID: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"id\""));
    static RESULT: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"result\""));
    static ERROR: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"error\""));
    if ID.find(b).is_none() || (RESULT.find(b).is_none() && ERROR.find(b).is_none()) {
        return Vec::new();
    }
    let is_response =
        |r: &Reply<'_>| r.method.is_none() && (r.result.is_some() || r.error.is_some());
    let canonical = |r: Reply<'_>| r.id.map(canonical_id);
    // The usual event answers one request: no vector of messages for it.
    match b.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => serde_json::from_str::<Reply<'_>>(data)
            .ok()
            .filter(is_response)
            .and_then(canonical)
            .into_iter()
            .collect(),
        Some(b'[') => serde_json::from_str::<Vec<Reply<'_>>>(data)
            .map(|msgs| {
                msgs.into_iter()
                    .filter(is_response)
                    .filter_map(canonical)
                    .collect()
            })
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// One message of an upstream's JSON answer (a body, or a member of a batch), read by
/// [`read_message`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Message {
    /// JSON, but not a JSON-RPC 2.0 message.
    NotRpc,
    /// A JSON-RPC 2.0 message, and the ids (canonical JSON text) of the responses it is:
    /// what [`response_ids`] reads from it.
    Rpc(Vec<String>),
}

/// Reads message `m`: whether it is JSON-RPC 2.0 and, if it is a response, its id. An object
/// (the usual message) is parsed once: the upgraded JSON answer's envelope is checked before
/// its events are tagged, and tagging them parsed each again for its id (bench/notes.md,
/// "Figure: one parse per message"). `Err`: `m` is not JSON at all.
pub(crate) fn read_message(m: &str) -> Result<Message, serde_json::Error> {
    #[derive(Deserialize)]
    struct Enveloped<'a> {
        #[serde(default, borrow)]
        jsonrpc: Option<&'a str>,
        #[serde(default, borrow)]
        id: Option<&'a RawValue>,
        #[serde(default)]
        method: Option<IgnoredAny>,
        #[serde(default)]
        result: Option<IgnoredAny>,
        #[serde(default)]
        error: Option<IgnoredAny>,
    }
    if m.trim_ascii_start().starts_with('{') {
        match serde_json::from_str::<Enveloped<'_>>(m) {
            Ok(e) if e.jsonrpc == Some("2.0") => {
                // As `response_ids` reads it: a `method` member first rules it out even when
                // it is null.
                let response = e.method.is_none()
                    && (e.result.is_some() || e.error.is_some())
                    && !names_method_first(m.as_bytes());
                let id = e.id.filter(|_| response).map(canonical_id);
                return Ok(Message::Rpc(id.into_iter().collect()));
            }
            Ok(_) => return Ok(Message::NotRpc),
            Err(e) if e.classify() != serde_json::error::Category::Data => return Err(e),
            // JSON, but not of this shape (a member twice, an envelope that is not a
            // string): read as the two parses it stands for.
            Err(_) => {}
        }
    }
    read_message_twice(m)
}

/// [`read_message`] as two parses: the envelope's, then the one that reads the response ids
/// of any event's data ([`response_ids`]).
fn read_message_twice(m: &str) -> Result<Message, serde_json::Error> {
    #[derive(Deserialize)]
    struct Envelope<'a> {
        #[serde(borrow)]
        jsonrpc: Option<&'a str>,
    }
    match serde_json::from_str::<Envelope<'_>>(m) {
        Ok(e) if e.jsonrpc == Some("2.0") => Ok(Message::Rpc(response_ids(m))),
        Ok(_) => Ok(Message::NotRpc),
        Err(e) if e.classify() == serde_json::error::Category::Data => Ok(Message::NotRpc),
        Err(e) => Err(e),
    }
}

/// Whether `b` opens a JSON object whose first member, or second after `"jsonrpc":"2.0"`, is
/// `"method"`: a request or a notification as the SDKs write them (a progress notification is
/// most of a stream), never a response. Exact: an object with a `method` member is not a
/// response, whatever follows (and a duplicate member fails the parse), so skipping the
/// search and the parse changes no answer; it saves both (bench/notes.md, "Figure: one parse
/// per message").
#[inline]
fn names_method_first(b: &[u8]) -> bool {
    let Some(rest) = b.trim_ascii_start().strip_prefix(b"{") else {
        return false;
    };
    let rest = rest.strip_prefix(br#""jsonrpc":"2.0","#).unwrap_or(rest);
    rest.starts_with(br#""method":"#)
}

/// An id's canonical JSON text (as [`Value`] writes it, as request ids are recorded). The
/// usual ids, a string with no escape or a short integer, are that as sent; only others are
/// parsed and written again.
fn canonical_id(raw: &RawValue) -> String {
    let text = raw.get();
    let digits = text.strip_prefix('-').unwrap_or(text);
    let plain = if text.starts_with('"') {
        !text.contains('\\')
    } else {
        // Up to 18 digits is an exact integer either way; `-0` is written `-0.0`.
        (1..=18).contains(&digits.len())
            && digits.bytes().all(|c| c.is_ascii_digit())
            && text != "-0"
    };
    if plain {
        return text.to_owned();
    }
    serde_json::from_str::<Value>(text).map_or_else(|_| text.to_owned(), |v| v.to_string())
}

#[derive(Deserialize)]
struct InitReply {
    result: InitResult,
}

#[derive(Deserialize)]
struct InitResult {
    #[serde(rename = "protocolVersion")]
    protocol_version: String,
}

/// The negotiated protocol version, if `data` is an `InitializeResult` response.
pub(crate) fn initialize_version<D: AsRef<[u8]> + ?Sized>(data: &D) -> Option<String> {
    serde_json::from_slice::<InitReply>(data.as_ref())
        .ok()
        .map(|r| r.result.protocol_version)
}

/// The longest protocol version the gateway keeps (a session's, its record's in the store).
pub(crate) const MAX_PROTOCOL_VERSION: usize = 32;

/// Whether `v` may be kept as a session's protocol version: 1 to [`MAX_PROTOCOL_VERSION`]
/// bytes of `[A-Za-z0-9._-]` (every version the specification names is a date). What a
/// client sends that fails is not kept (it is still forwarded: the upstream answers it).
pub(crate) fn is_protocol_version(v: &str) -> bool {
    (1..=MAX_PROTOCOL_VERSION).contains(&v.len())
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Whether a protocol version string (`YYYY-MM-DD`) is of the modern era.
pub(crate) fn is_modern(version: &str) -> bool {
    is_date(version) && version >= FIRST_MODERN_VERSION
}

/// Whether sessions of this protocol version get priming events under `--priming auto`.
pub(crate) fn primes(version: &str) -> bool {
    is_date(version) && version >= FIRST_PRIMING_VERSION
}

fn is_date(v: &str) -> bool {
    let b = v.as_bytes();
    b.len() == 10
        && b.iter().enumerate().all(|(i, c)| {
            if i == 4 || i == 7 {
                *c == b'-'
            } else {
                c.is_ascii_digit()
            }
        })
}

/// A JSON-RPC error response body written by the gateway.
pub(crate) fn error_body(id: Option<&Value>, code: i64, message: &str, reason: &str) -> Bytes {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id.cloned().unwrap_or(Value::Null),
        "error": { "code": code, "message": message, "data": { "reason": reason } },
    });
    Bytes::from(body.to_string())
}

/// JSON-RPC error code the gateway uses for requests whose result cannot be delivered
/// (resumption failed: a gap, a duplicate request id it cannot serve).
pub(crate) const ERROR_CODE_RESUMPTION_FAILED: i64 = -32010;
/// JSON-RPC error code for requests whose upstream stream failed.
pub(crate) const ERROR_CODE_UPSTREAM_FAILED: i64 = -32011;

/// Event types of the gateway's own control events (never `message`, so clients that do
/// not know them ignore their data).
pub(crate) const EVENT_RESUMED: &str = "mcp-reattach/resumed";
pub(crate) const EVENT_RESUMPTION_FAILED: &str = "mcp-reattach/resumption-failed";
pub(crate) const EVENT_RESUMPTION_REQUIRED: &str = "mcp-reattach/resumption-required";
pub(crate) const EVENT_UPSTREAM_FAILED: &str = "mcp-reattach/upstream-failed";
/// Opens an upgraded JSON answer's stream with an id where no priming event is sent.
pub(crate) const EVENT_STREAM: &str = "mcp-reattach/stream";

pub(crate) const GAP_MESSAGE: &str = "mcp-reattach: resumption failed: the events after the client's last event id were evicted from the gateway's window, so this request's result cannot be delivered";
pub(crate) const SESSION_CLOSED_MESSAGE: &str = "mcp-reattach: the session ended at the gateway (deleted, forgotten by the upstream, or shed) before this request was answered";
pub(crate) const UPSTREAM_ENDED_MESSAGE: &str =
    "mcp-reattach: the upstream server ended the stream without answering this request";

/// SSE frames that end a stream explicitly: a `resumption-failed` control event at `here`,
/// then one JSON-RPC error per request id (JSON text) whose result the client will not get.
/// The event carries `here` as its id only when `with_id` (the client already holds a cursor
/// on this stream): a client that was never given an id must not get one now, or it would
/// try to resume a stream that has nothing more.
pub(crate) fn failure_frames(
    here: &str,
    with_id: bool,
    reason: &str,
    ids: &[String],
    message: &str,
) -> Bytes {
    let info = serde_json::json!({ "reason": reason, "at": here, "requests": ids.len() });
    let mut out = BytesMut::from(
        &sse::control(
            with_id.then_some(here),
            Some(EVENT_RESUMPTION_FAILED),
            None,
            &info.to_string(),
        )[..],
    );
    for id in ids {
        out.put_slice(&error_event(
            id,
            ERROR_CODE_RESUMPTION_FAILED,
            message,
            reason,
        ));
    }
    out.freeze()
}

/// Like [`failure_frames`], for a stream whose upstream failed with `cause`.
pub(crate) fn upstream_failure_frames(
    here: &str,
    with_id: bool,
    cause: &str,
    ids: &[String],
) -> Bytes {
    let info = serde_json::json!({ "reason": "upstream-failed", "cause": cause, "at": here });
    let mut out = BytesMut::from(
        &sse::control(
            with_id.then_some(here),
            Some(EVENT_UPSTREAM_FAILED),
            None,
            &info.to_string(),
        )[..],
    );
    let message = format!(
        "mcp-reattach: the upstream stream failed before this request was answered: {cause}"
    );
    for id in ids {
        out.put_slice(&error_event(
            id,
            ERROR_CODE_UPSTREAM_FAILED,
            &message,
            "upstream-failed",
        ));
    }
    out.freeze()
}

/// A `message` event carrying a JSON-RPC error response for request `id` (JSON text).
fn error_event(id: &str, code: i64, message: &str, reason: &str) -> Bytes {
    let id: Value = serde_json::from_str(id).unwrap_or(Value::Null);
    let body = error_body(Some(&id), code, message, reason);
    sse::control(None, Some("message"), None, &String::from_utf8_lossy(&body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inspects_requests_notifications_and_batches() {
        let i = inspect_post(br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"x","_meta":{"progressToken":1}}}"#);
        assert_eq!(i.request_ids, vec!["7"]);
        assert_eq!(i.single_id, Some(Value::from(7)));
        assert!(!i.initialize);
        let i = inspect_post(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
        assert!(i.request_ids.is_empty());
        assert!(i.initialized);
        let i = inspect_post(br#"[{"jsonrpc":"2.0","id":"a","method":"ping"},{"jsonrpc":"2.0","id":2,"method":"ping"},{"jsonrpc":"2.0","method":"n"}]"#);
        assert_eq!(i.request_ids, vec!["\"a\"", "2"]);
        assert_eq!(i.single_id, None);
        let i = inspect_post(br#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18"}}"#);
        assert!(i.initialize);
        assert_eq!(i.version.as_deref(), Some("2025-06-18"));
        assert_eq!(inspect_post(b"not json"), PostInfo::default());
    }

    #[test]
    fn meta_version_is_read() {
        let i = inspect_post(br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}}"#);
        assert_eq!(i.version.as_deref(), Some("2026-07-28"));
        assert!(is_modern(i.version.as_deref().unwrap()));
    }

    #[test]
    fn finds_response_ids_only() {
        assert_eq!(
            response_ids(r#"{"jsonrpc":"2.0","id":7,"result":{}}"#),
            vec!["7"]
        );
        assert_eq!(
            response_ids(r#"{"jsonrpc":"2.0","id":"x","error":{"code":1,"message":"m"}}"#),
            vec!["\"x\""]
        );
        // A server-to-client request with an id is not a response.
        assert!(response_ids(
            r#"{"jsonrpc":"2.0","id":7,"method":"sampling/createMessage","params":{"result":1}}"#
        )
        .is_empty());
        assert!(
            response_ids(r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{}}"#)
                .is_empty()
        );
        assert_eq!(
            response_ids(
                r#"[{"jsonrpc":"2.0","id":1,"result":{}},{"jsonrpc":"2.0","id":2,"result":{}}]"#
            ),
            vec!["1", "2"]
        );
        assert!(response_ids("garbage \"result\"").is_empty());
        // Ids in the form requests are recorded in, however the upstream wrote them.
        assert_eq!(
            response_ids(r#"{"id" : "\u0078", "result":{}, "jsonrpc":"2.0"}"#),
            vec!["\"x\""]
        );
        assert_eq!(response_ids(r#"{"id":1e2,"result":{}}"#), vec!["100.0"]);
        assert!(response_ids(r#"{"id":null,"error":{}}"#).is_empty());
    }

    /// A JSON text near an upstream's JSON answer message: an object of some of a message's
    /// members and an unknown one, in any order, sometimes one twice, with values of any kind
    /// (well formed or not); or an array of one, a scalar, a cut-off text, trailing bytes.
    fn near_message() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let value = |usual: &'static str| {
            prop_oneof![
                2 => Just(usual),
                1 => proptest::sample::select(vec![
                    r#""1.0""#,
                    "7",
                    "-0",
                    "1.5e3",
                    r#""a\"b""#,
                    r#""\u0032.0""#,
                    "null",
                    "true",
                    r#"[1,{"id":3}]"#,
                    "tru",
                ]),
            ]
        };
        let members = (
            proptest::option::weighted(0.9, value(r#""2.0""#)),
            proptest::option::weighted(0.8, value("7")),
            proptest::option::weighted(0.3, value(r#""tools/call""#)),
            proptest::option::weighted(0.5, value(r#"{"content":[]}"#)),
            proptest::option::weighted(0.3, value(r#"{"code":-1,"message":"m"}"#)),
            proptest::option::weighted(0.2, value("{}")),
            proptest::option::weighted(0.1, value("[]")),
        );
        let space = prop_oneof![Just(""), Just(" "), Just("\n ")];
        let object = (
            members,
            space,
            any::<bool>(),
            any::<proptest::sample::Index>(),
        )
            .prop_flat_map(
                |((j, id, method, result, error, params, x), sp, twice, which)| {
                    let mut m: Vec<(&str, &str)> = [
                        ("jsonrpc", j),
                        ("id", id),
                        ("method", method),
                        ("result", result),
                        ("error", error),
                        ("params", params),
                        ("x", x),
                    ]
                    .into_iter()
                    .filter_map(|(k, v)| v.map(|v| (k, v)))
                    .collect();
                    if twice && !m.is_empty() {
                        m.push(m[which.index(m.len())]);
                    }
                    Just(m).prop_shuffle().prop_map(move |m| {
                        let body: Vec<String> = m
                            .into_iter()
                            .map(|(k, v)| format!("{sp}\"{k}\":{sp}{v}"))
                            .collect();
                        format!("{{{}}}", body.join(","))
                    })
                },
            );
        prop_oneof![
            12 => object.clone(),
            1 => object.clone().prop_map(|o| format!("[{o}]")),
            1 => object.clone().prop_map(|o| o[..o.len() / 2].to_owned()),
            1 => object.prop_map(|o| format!("{o} x")),
            1 => Just("1".to_owned()),
            1 => Just(r#""text""#.to_owned()),
        ]
    }

    proptest::proptest! {
        /// One parse reads a message as the envelope's parse and the response ids' parse
        /// did: whether it is JSON at all, whether it is JSON-RPC 2.0, which responses.
        #[test]
        fn a_message_read_once_is_read_as_twice(m in near_message()) {
            let once = read_message(&m).map_err(|e| e.classify());
            let twice = read_message_twice(&m).map_err(|e| e.classify());
            proptest::prop_assert_eq!(once, twice, "{}", m);
        }

        /// An id as an upstream may write it reads as the text `Value` writes for it, which
        /// is how the ids of requests are recorded.
        #[test]
        fn response_ids_are_canonical(
            int in proptest::num::i64::ANY,
            big in proptest::num::u64::ANY,
            float in proptest::num::f64::NORMAL,
            s in "\\PC{0,12}",
            escaped in proptest::bool::ANY,
            digits in "-?[1-9][0-9]{0,30}|-?0",
        ) {
            let string = if escaped {
                // Every character escaped, as some writers do.
                let mut t = String::from("\"");
                for u in s.encode_utf16() {
                    t.push_str(&format!("\\u{u:04x}"));
                }
                t + "\""
            } else {
                serde_json::to_string(&s).unwrap()
            };
            for id in [int.to_string(), big.to_string(), float.to_string(), string, digits] {
                let data = format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{}}}}"#);
                let want = serde_json::from_str::<Value>(&id).unwrap().to_string();
                proptest::prop_assert_eq!(response_ids(&data), vec![want]);
            }
        }

        /// The check of the first member answers as the parse would, whatever the members
        /// and their order (`method` first or after `jsonrpc` among them).
        #[test]
        fn a_message_naming_its_method_first_is_never_a_response(
            members in proptest::sample::subsequence(
                vec![
                    r#""jsonrpc":"2.0""#,
                    r#""method":"notifications/progress""#,
                    r#""id":3"#,
                    r#""result":{"method":1}"#,
                    r#""error":{}"#,
                    r#""params":{"id":1}"#,
                ],
                0..=6,
            ),
            order in proptest::collection::vec(proptest::num::usize::ANY, 6),
            space in proptest::bool::ANY,
        ) {
            let mut members = members;
            for (i, o) in order.iter().enumerate().take(members.len()) {
                let j = o % members.len();
                members.swap(i, j);
            }
            let data = format!("{}{{{}}}", if space { " " } else { "" }, members.join(","));
            proptest::prop_assert_eq!(
                response_ids(&data),
                parsed_response_ids(&data),
                "{}",
                data
            );
        }
    }

    #[test]
    fn eras() {
        assert!(!is_modern("2025-11-25"));
        assert!(is_modern("2026-07-28"));
        assert!(is_modern("2027-01-01"));
        assert!(!is_modern("garbage"));
        assert!(!is_modern("2026-07-2x"));
        assert!(primes("2025-11-25"));
        assert!(!primes("2025-06-18"));
    }

    #[test]
    fn a_protocol_version_kept_is_short_and_plain() {
        for ok in ["2025-06-18", "2024-11-05", "draft.1_x", &"a".repeat(32)] {
            assert!(is_protocol_version(ok), "{ok}");
        }
        for bad in [
            "",
            &"9".repeat(33),
            "2025 06 18",
            "2025\u{1b}[31m",
            "é",
            "a/b",
        ] {
            assert!(!is_protocol_version(bad), "{bad:?}");
        }
    }

    #[test]
    fn initialize_result_version() {
        assert_eq!(
            initialize_version(r#"{"jsonrpc":"2.0","id":0,"result":{"protocolVersion":"2025-11-25","capabilities":{}}}"#).as_deref(),
            Some("2025-11-25")
        );
        assert_eq!(
            initialize_version(r#"{"jsonrpc":"2.0","id":0,"result":{}}"#),
            None
        );
    }
}
