#!/usr/bin/env bash
# Fuzz smoke: runs each target for ~20 s (FUZZ_SECONDS) from its committed corpus, if a nightly
# toolchain and cargo-fuzz are installed; otherwise says so and exits 0. Fails on any crash.
# New corpus entries go to a scratch directory, so the committed corpora stay as they are.
set -euo pipefail
cd "$(dirname "$0")"
secs="${FUZZ_SECONDS:-20}"
if ! rustup toolchain list 2>/dev/null | grep -q '^nightly' || ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz smoke: skipped (needs a nightly toolchain and cargo-fuzz: cargo install cargo-fuzz)"
  exit 0
fi
targets=(sse_decoder cursor window_model http_connection h1_response h1_request)
cargo +nightly fuzz build 2>&1 | tail -n 1
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t" "$scratch/artifacts"
  echo "== fuzz smoke: $t (${secs}s)"
  cargo +nightly fuzz run "$t" "$scratch/$t" "corpus/$t" -- \
    -max_total_time="$secs" -print_final_stats=1 -rss_limit_mb=4096 -timeout=30 \
    -artifact_prefix="$scratch/artifacts/" 2>&1 | grep -E '^(stat::number_of_executed_units|==[0-9]+== ERROR|thread .* panicked)' || true
  if ls "$scratch/artifacts"/crash-* "$scratch/artifacts"/timeout-* "$scratch/artifacts"/oom-* >/dev/null 2>&1; then
    echo "fuzz smoke: $t found a failing input:" "$scratch"/artifacts/*
    cp "$scratch"/artifacts/* . 2>/dev/null || true
    exit 1
  fi
done
echo "fuzz smoke: ok"
