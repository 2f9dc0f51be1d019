//! Every input the fuzzers ever kept (`fuzz/corpus/<target>/`), replayed through the same
//! check the fuzz target calls (`fuzz/checks/<target>.rs`), so CI guards them on stable Rust
//! without libFuzzer: `cursor`, `sse_decoder`, `h1_response`, `h1_request`, `window_model` (decoded with the same
//! `arbitrary` version as the fuzz target), `h1_request` again against hyper's HTTP/1.1 server
//! (`h1_differential`), and `http_connection` (each input a real
//! connection to an in-process gateway; the check waits for the gateway to close or to fall
//! silent for 50 ms, so the whole corpus takes seconds).
//!
//! One limit: the SSE target's bounded-memory property needs its counting global allocator
//! (unsafe code, forbidden in this crate), so it is checked by the fuzzer only.

#[path = "../../fuzz/checks/cursor.rs"]
mod cursor;
#[path = "../../fuzz/checks/h1_differential.rs"]
mod h1_differential;
#[path = "../../fuzz/checks/h1_request.rs"]
mod h1_request;
#[path = "../../fuzz/checks/h1_response.rs"]
mod h1_response;
#[path = "../../fuzz/checks/http_connection.rs"]
mod http_connection;
#[path = "../../fuzz/checks/sse_decoder.rs"]
mod sse_decoder;
#[path = "../../fuzz/checks/window_model.rs"]
mod window_model;

use std::path::{Path, PathBuf};

fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} has inputs", dir.display());
    files
}

/// Runs `check` on every corpus file of `target`; a failing input is named. Returns what
/// `check` returned for each input.
fn replay<T>(target: &str, check: fn(&[u8]) -> T) -> Vec<T> {
    corpus(target)
        .iter()
        .map(|f| {
            let input = std::fs::read(f).unwrap();
            std::panic::catch_unwind(|| check(&input)).unwrap_or_else(|_| {
                panic!("{target}: corpus input {} fails its check", f.display())
            })
        })
        .collect()
}

#[test]
fn cursor_corpus() {
    let n = replay("cursor", cursor::check).len();
    eprintln!("replayed {n} cursor corpus inputs");
}

/// The corpus holds the framings a client may send; the ambiguous one (CL with TE) is refused.
#[test]
fn h1_request_corpus() {
    let framings = replay("h1_request", h1_request::check);
    assert!(framings.contains(&Some(mcp_reattach::internals::Framing::Chunked)));
    assert!(framings.contains(&Some(mcp_reattach::internals::Framing::Length(5))));
    assert!(framings.contains(&None), "cl-te refused");
    eprintln!("replayed {} h1_request corpus inputs", framings.len());
}

/// Issue 47: the gateway's request reader against hyper's server on every request input the
/// corpus holds: they agree, or the gateway's is the stricter.
#[test]
fn h1_request_corpus_against_hyper() {
    let taken = replay("h1_request", h1_differential::check);
    let n = taken.iter().filter(|t| **t).count();
    assert!(n >= 10, "the corpus holds requests the gateway takes: {n}");
    eprintln!(
        "compared {} h1_request corpus inputs with hyper's server ({n} taken by the gateway's reader)",
        taken.len()
    );
}

#[test]
fn h1_response_corpus() {
    let n = replay("h1_response", h1_response::check).len();
    eprintln!("replayed {n} h1_response corpus inputs");
}

#[test]
fn sse_decoder_corpus() {
    let n = replay("sse_decoder", sse_decoder::check).len();
    eprintln!("replayed {n} sse_decoder corpus inputs");
}

#[test]
fn window_model_corpus() {
    let decoded = replay("window_model", window_model::check);
    // libFuzzer keeps no input the typed target rejected: one that no longer decodes means
    // `Case` changed shape and the corpus checks nothing any more.
    for (f, ok) in corpus("window_model").iter().zip(&decoded) {
        assert!(
            ok,
            "window_model: corpus input {} no longer decodes into a case",
            f.display()
        );
    }
    eprintln!(
        "replayed {} window_model corpus inputs, each decoded into a case",
        decoded.len()
    );
}

#[test]
fn http_connection_corpus() {
    let n = replay("http_connection", http_connection::check).len();
    eprintln!("replayed {n} http_connection corpus inputs");
}
