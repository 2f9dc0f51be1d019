//! The answer of an upgraded POST (`--json-upgrade`) whose client already has the gateway's
//! SSE stream: when it comes, an SSE stream is read as any other, a JSON body becomes the
//! stream's event(s), any other answer a JSON-RPC error per request.
//!
//! A future only: the layer (`feed`) spawns it, ends the stream with what it returns, and
//! ends the session on the upstream's 404 when the request was the session's own.

use std::future::Future;
use std::pin::Pin;

use http::{Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde_json::Value;

use super::read::{self, JsonRead};
use super::whole::{json_answer, too_large};
use crate::metrics::{UpgradeAnswer, UpstreamErrorKind};
use crate::session::{End, Registry, Session, UpstreamFailure};
use crate::upstream::{is_json, is_sse, OwnBody, Source};

/// The upstream's answer to a POST the gateway answers with an SSE stream of its own
/// (`--json-upgrade`): its response, or why there is none (for the log).
pub(crate) type Answer = Pin<Box<dyn Future<Output = Result<Response<OwnBody>, String>> + Send>>;

/// Most bytes of an error body the gateway reads to learn the upstream's JSON-RPC message.
const ERROR_BODY_BYTES: usize = 64 * 1024;

/// How an upgraded POST's stream ended, and whether the upstream answered 404 (the session
/// is gone upstream).
pub(super) struct Answered {
    pub end: End,
    pub not_found: bool,
}

/// Waits for the upstream's `answer` to the POST whose stream is `stream` of `session`, and
/// feeds it into the stream.
pub(super) async fn read(
    registry: &Registry,
    session: &Session,
    stream: u32,
    answer: Answer,
    source: &Source,
) -> Answered {
    let ended = |end| Answered {
        end,
        not_found: false,
    };
    let metrics = registry.metrics().clone();
    let resp = match answer.await {
        Ok(r) => r,
        Err(cause) => {
            metrics.json_upgrade(UpgradeAnswer::Failed);
            metrics.upstream_error(UpstreamErrorKind::Request);
            tracing::warn!(mcp.session = %session.hashed_id(), mcp.stream = stream, cause, "upstream failed to answer an upgraded POST");
            return ended(End::Failed(UpstreamFailure::Connection(cause)));
        }
    };
    let (status, headers) = (resp.status(), resp.headers());
    if status == StatusCode::OK && is_sse(headers) {
        metrics.json_upgrade(UpgradeAnswer::Sse);
        let body = resp.into_body();
        return ended(read::stream(registry, session, stream, body, source).await);
    }
    if status == StatusCode::OK && is_json(headers) {
        metrics.json_upgrade(UpgradeAnswer::Json);
        let limit = source.upstream.cfg.max_event_bytes;
        let mut charge = registry.budget().charge();
        let end = match read::json(resp.into_body(), limit, &mut charge).await {
            Ok(body) => match json_answer(&metrics, &body, limit) {
                Ok((events, _)) => {
                    drop(body);
                    let mut events = events.into();
                    read::deliver(registry, session, stream, &mut events, &mut charge, 0).await;
                    End::Complete
                }
                Err(end) => end,
            },
            Err(JsonRead::TooLarge) => {
                metrics.upstream_error(UpstreamErrorKind::InvalidEvent);
                End::Failed(too_large(limit))
            }
            Err(JsonRead::Failed(failure)) => {
                metrics.upstream_error(UpstreamErrorKind::Stream);
                End::Failed(failure)
            }
        };
        return ended(end);
    }
    metrics.json_upgrade(UpgradeAnswer::Status);
    let failure = if status == StatusCode::OK {
        let ct = headers
            .get(http::header::CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        UpstreamFailure::InvalidStream(format!(
            "the upstream answered 200 with Content-Type {ct:?}, neither JSON nor SSE"
        ))
    } else {
        let body = Limited::new(resp.into_body(), ERROR_BODY_BYTES)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        UpstreamFailure::Status {
            status: status.as_u16(),
            message: error_message(&body),
        }
    };
    tracing::debug!(mcp.session = %session.hashed_id(), mcp.stream = stream, %status, "upgraded POST answered without a result");
    Answered {
        end: End::Failed(failure),
        not_found: status == StatusCode::NOT_FOUND,
    }
}

/// The `error.message` of a JSON-RPC error body, if that is what `body` is.
fn error_message(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let m = v.get("error")?.get("message")?.as_str()?;
    Some(m.chars().take(200).collect())
}
