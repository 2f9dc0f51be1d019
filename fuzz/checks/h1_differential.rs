//! The gateway's HTTP/1.1 request reader against hyper's HTTP/1.1 server on the same bytes
//! (issue 47): they agree, or the gateway's is the stricter. Whenever the gateway's reader
//! takes a whole first request from the input (its head by `mcp_reattach::internals::parse_request`,
//! its body by `BodyDecoder`), hyper's server, given the same bytes on a connection, must
//! serve the same request: the same method, target, version and body. A request the gateway
//! refuses or that is not whole is not compared (stricter is allowed).
//!
//! Shared by the fuzz target (`fuzz/fuzz_targets/h1_differential.rs`) and the corpus replay
//! (`tests/fast/fuzz_corpora.rs`, over the `h1_request` corpus).

use std::time::Duration;

use http_body_util::BodyExt;
use mcp_reattach::internals::{parse_request, BodyDecoder};
use tokio::io::AsyncWriteExt;

/// What both sides are compared on.
type Request = (String, String, http::Version, Vec<u8>);

/// The first request the gateway's reader takes whole from `input`, if it does.
fn ours(input: &[u8]) -> Option<Request> {
    let (head, len) = parse_request(input, 100).ok()??;
    let mut decoder = BodyDecoder::new(head.framing);
    let mut body = Vec::new();
    decoder
        .decode(&input[len..], |d| body.extend_from_slice(d))
        .ok()?;
    if !decoder.is_done() {
        return None;
    }
    let p = &head.parts;
    Some((p.method.to_string(), p.uri.to_string(), p.version, body))
}

/// The first request hyper's HTTP/1.1 server serves from `input`, if it serves one within a
/// second.
fn hypers(input: &[u8]) -> Option<Request> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let (mut client, server) = tokio::io::duplex(input.len() + 64 * 1024);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let tx = tx.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect().await.map(|b| b.to_bytes().to_vec());
                if let Ok(body) = body {
                    let _ = tx.send((
                        parts.method.to_string(),
                        parts.uri.to_string(),
                        parts.version,
                        body,
                    ));
                }
                Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Empty::<
                    bytes::Bytes,
                >::new()))
            }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(server), svc);
        let served = tokio::spawn(conn);
        // The connection stays open (hyper would drop a request whose connection the client
        // closed before it was served): a request hyper waits on is not whole to it.
        client.write_all(input).await.ok()?;
        // Keep reading what hyper answers, so its writes never block.
        let drain = tokio::spawn(async move {
            let mut sink = tokio::io::sink();
            let _ = tokio::io::copy(&mut client, &mut sink).await;
        });
        let first = tokio::time::timeout(Duration::from_secs(1), rx.recv())
            .await
            .ok()
            .flatten();
        served.abort();
        drain.abort();
        first
    })
}

/// Panics when the gateway's reader takes a request that hyper's server does not serve, or
/// serves differently. Returns whether the input held a request the gateway took.
pub fn check(input: &[u8]) -> bool {
    let Some(ours) = ours(input) else {
        return false;
    };
    match hypers(input) {
        Some(theirs) => assert_eq!(ours, theirs, "the two readers took different requests"),
        None => panic!("the gateway's reader took a request hyper's server refuses: {ours:?}"),
    }
    true
}
