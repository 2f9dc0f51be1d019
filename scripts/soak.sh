#!/usr/bin/env bash
# Soak test of the gateway on loopback, bounded in time (see scripts/soak.py for what it does
# and its pass criteria). Builds the release binary if needed.
#
#   scripts/soak.sh            # full: 300 abandoned sessions, 10 min churn, TTL 30s (~12 min)
#   scripts/soak.sh --quick    # ~60 s: 100 abandoned, 30 s churn, TTL 5s
#   scripts/soak.sh --out DIR  # where samples.csv, summary.json and gateway.log go
#
# Exit code 0 when every criterion passes, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    *) args+=("$1") ;;
  esac
  shift
done
ulimit -n 65536 2>/dev/null || ulimit -n 4096 || true
target="${CARGO_TARGET_DIR:-target}"
bin="$target/release/mcp-reattach"
if [ ! -x "$bin" ] || [ -n "$(find src Cargo.toml -newer "$bin" 2>/dev/null | head -1)" ]; then
  cargo build --release --quiet
fi
if [ "$quick" = 1 ]; then
  exec timeout 300 python3 scripts/soak.py --binary "$bin" --abandon 100 --churn 30 \
    --workers 8 --ttl 5 --out "${SOAK_OUT:-/tmp/mcp-reattach-soak-quick}" "${args[@]+"${args[@]}"}"
fi
exec timeout 1200 python3 scripts/soak.py --binary "$bin" --abandon 300 --churn 600 \
  --workers 16 --ttl 30 --budget 64MiB --out "${SOAK_OUT:-/tmp/mcp-reattach-soak}" "${args[@]+"${args[@]}"}"
