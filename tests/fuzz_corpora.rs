//! Every input the fuzzers ever kept (`fuzz/corpus/<target>/`), replayed through the same
//! check the fuzz target calls (`fuzz/checks/<target>.rs`), so CI guards them on stable Rust
//! without libFuzzer.
//!
//! The SSE target's bounded-memory property needs its counting global allocator (unsafe
//! code, forbidden in this crate), so it is checked by the fuzzer only.
//! Not replayed here: `window_model` (its inputs are decoded with the `arbitrary` crate, a
//! fuzz-only dependency) and `http_connection` (a whole connection per input, minutes for
//! the corpus; `fuzz/smoke.sh` runs it).

#[path = "../fuzz/checks/cursor.rs"]
mod cursor;
#[path = "../fuzz/checks/sse_decoder.rs"]
mod sse_decoder;

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

/// Runs `check` on every corpus file of `target`; a failing input is named.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let files = corpus(target);
    for f in &files {
        let input = std::fs::read(f).unwrap();
        if std::panic::catch_unwind(|| check(&input)).is_err() {
            panic!("{target}: corpus input {} fails its check", f.display());
        }
    }
    files.len()
}

#[test]
fn every_fuzz_corpus_input_passes_its_check() {
    let cursors = replay("cursor", cursor::check);
    let sse = replay("sse_decoder", sse_decoder::check);
    eprintln!("replayed {cursors} cursor and {sse} sse_decoder corpus inputs");
}
