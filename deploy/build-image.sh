#!/usr/bin/env bash
# Builds the mcp-reattach OCI image without a registry or a Docker engine, then runs it once.
#
#   deploy/build-image.sh            # build, then smoke-test with podman
#   deploy/build-image.sh --no-run   # build only
#
# 1. A static binary on the host: the musl target when rustup has it (or can add it) and
#    musl-gcc is installed,
#    otherwise glibc with +crt-static (glibc's static resolver cannot load its NSS modules in
#    an empty image, so host names may not resolve: give --upstream an IP address then; the
#    sidecar's 127.0.0.1 is fine).
# 2. buildah builds deploy/Dockerfile.scratch (FROM scratch, USER 65532) from it.
# 3. podman runs the image once: `--version`; `demo` (gateway + embedded MCP server); a second
#    container in front of the first by host name (name resolution inside an empty image); an
#    MCP `initialize` and a tagged SSE `tools/call` through both; the process's uid; SIGTERM
#    and the exit code.
#
# Needs root with buildah, podman and runc (Debian: apt-get install buildah podman runc).
# Storage: vfs (works without overlay mounts). Environment:
#   IMAGE            image name           (default localhost/mcp-reattach:<crate version>)
#   CARGO_TARGET_DIR cargo's target dir   (default /tmp/mcp-reattach-image-target)
#   PODMAN_RUN_FLAGS extra `podman run` flags; by default the script uses plain `podman run`
#                    and, if that cannot start a container here, the flags that work in a
#                    restricted sandbox (runc, cgroupfs, host network, lowered ulimits).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
run=1
[[ "${1:-}" == "--no-run" ]] && run=0

version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1)"
image="${IMAGE:-localhost/mcp-reattach:$version}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/mcp-reattach-image-target}"
storage=(--storage-driver vfs)

for tool in cargo buildah; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found" >&2; exit 1; }
done

# --- 1. static binary ---------------------------------------------------------------------------
arch="$(uname -m)"
musl="$arch-unknown-linux-musl"
# ring (rustls' crypto) compiles C for the target: the musl target also needs musl-gcc
# (Debian: musl-tools).
if command -v musl-gcc >/dev/null \
   && { rustup target list --installed 2>/dev/null | grep -qx "$musl" \
        || rustup target add "$musl" >/dev/null 2>&1; }; then
  target="$musl"
  echo "== cargo build --release --target $target"
  (cd "$repo" && cargo build --release --locked --target "$target")
else
  target="$arch-unknown-linux-gnu"
  echo "== $musl unavailable; cargo build --release --target $target with +crt-static"
  (cd "$repo" && RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
    cargo build --release --locked --target "$target")
fi
bin="$CARGO_TARGET_DIR/$target/release/mcp-reattach"
if ! file "$bin" | grep -q 'static'; then
  echo "error: $bin is not statically linked: $(file -b "$bin")" >&2
  exit 1
fi

ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
strip -o "$ctx/mcp-reattach" "$bin"
echo "   binary: $(du -h "$ctx/mcp-reattach" | cut -f1) stripped, $(file -b "$bin" | cut -d, -f1-3)"

# --- 2. image -----------------------------------------------------------------------------------
echo "== buildah bud -f deploy/Dockerfile.scratch -t $image"
buildah "${storage[@]}" bud --quiet --isolation chroot -f "$repo/deploy/Dockerfile.scratch" \
  -t "$image" "$ctx" >/dev/null
buildah "${storage[@]}" inspect --type image \
  --format '   user={{.OCIv1.Config.User}} entrypoint={{.OCIv1.Config.Entrypoint}} env={{.OCIv1.Config.Env}}' \
  "$image"
echo
size="$(buildah "${storage[@]}" images --format '{{.Size}}' "$image" | head -n1)"
echo "   image size: $size"
[[ $run -eq 1 ]] || exit 0

# --- 3. run it once -----------------------------------------------------------------------------
command -v podman >/dev/null || { echo "error: podman not found" >&2; exit 1; }
command -v curl >/dev/null || { echo "error: curl not found" >&2; exit 1; }
podman_base=(podman "${storage[@]}")
if [[ -n "${PODMAN_RUN_FLAGS:-}" ]]; then
  read -r -a run_flags <<<"$PODMAN_RUN_FLAGS"
elif "${podman_base[@]}" run --rm --network host "$image" --version >/dev/null 2>&1; then
  run_flags=(--network host)
else
  echo "   plain 'podman run' cannot start a container here; using runc, cgroupfs, lowered ulimits"
  podman_base=(podman --runtime runc --cgroup-manager cgroupfs "${storage[@]}")
  run_flags=(--network host --ulimit nofile=4096:4096 --ulimit nproc=4096:4096)
fi
prun() { "${podman_base[@]}" run "${run_flags[@]}" "$@"; }

echo "== podman run $image --version"
prun --rm "$image" --version

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
p1="$(free_port)"; a1="$(free_port)"; p2="$(free_port)"; a2="$(free_port)"
c1="mcp-reattach-smoke-demo-$$"; c2="mcp-reattach-smoke-front-$$"
cleanup() {
  "${podman_base[@]}" rm -f "$c1" "$c2" >/dev/null 2>&1 || true
  rm -rf "$ctx"
}
trap cleanup EXIT

echo "== podman run $image demo (gateway :$p1 in front of the embedded MCP server)"
prun -d --name "$c1" "$image" demo --listen "127.0.0.1:$p1" --admin-listen "127.0.0.1:$a1" >/dev/null
echo "== podman run $image --upstream http://localhost:$p1 (:$p2; a host name, resolved in the image)"
prun -d --name "$c2" "$image" --upstream "http://localhost:$p1" \
  --listen "127.0.0.1:$p2" --admin-listen "127.0.0.1:$a2" --log-format json >/dev/null

wait_ok() {
  for _ in $(seq 1 50); do
    curl -fsS "$1" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "error: $1 did not answer" >&2
  "${podman_base[@]}" logs "$c1" >&2 || true
  "${podman_base[@]}" logs "$c2" >&2 || true
  return 1
}
wait_ok "http://127.0.0.1:$a1/readyz"
wait_ok "http://127.0.0.1:$a2/readyz"
echo "   /healthz: $(curl -fsS "http://127.0.0.1:$a2/healthz")   /readyz: $(curl -fsS "http://127.0.0.1:$a2/readyz")"
if metrics="$(curl -fsS "http://127.0.0.1:$a2/metrics" 2>/dev/null)"; then
  echo "   /metrics: $(grep -c '^mcp_reattach_' <<<"$metrics") mcp_reattach_* samples"
else
  echo "   /metrics: not served by this build"
fi

pid="$("${podman_base[@]}" inspect --format '{{.State.Pid}}' "$c2")"
uid="$(awk '/^Uid:/ {print $2}' "/proc/$pid/status")"
echo "   container process uid: $uid"
[[ "$uid" != "0" ]] || { echo "error: the container runs as root" >&2; exit 1; }

url="http://127.0.0.1:$p2/mcp"
hdrs="$(mktemp)"
curl -fsS -D "$hdrs" -o /dev/null "$url" \
  -H 'content-type: application/json' -H 'accept: application/json, text/event-stream' \
  -d '{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"build-image.sh","version":"0"}}}'
sid="$(awk 'tolower($1)=="mcp-session-id:" {print $2}' "$hdrs" | tr -d '\r')"
rm -f "$hdrs"
[[ -n "$sid" ]] || { echo "error: initialize returned no Mcp-Session-Id" >&2; exit 1; }
echo "   initialize through both containers: session $sid"
curl -fsS -o /dev/null "$url" -H 'content-type: application/json' \
  -H 'accept: application/json, text/event-stream' -H "mcp-session-id: $sid" \
  -H 'mcp-protocol-version: 2025-11-25' \
  -d '{"jsonrpc":"2.0","method":"notifications/initialized"}'
body="$(curl -fsS -N --max-time 20 "$url" -H 'content-type: application/json' \
  -H 'accept: application/json, text/event-stream' -H "mcp-session-id: $sid" \
  -H 'mcp-protocol-version: 2025-11-25' \
  -d '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"countdown","arguments":{"steps":3,"interval_ms":50},"_meta":{"progressToken":1}}}')"
ids="$(grep -c '^id: ' <<<"$body" || true)"
grep -q '"result"' <<<"$body" || { echo "error: no result in the tools/call stream:" >&2; echo "$body" >&2; exit 1; }
echo "   tools/call stream: $ids tagged events, ends with the result"

echo "== SIGTERM"
start=$(date +%s)
"${podman_base[@]}" stop --time 60 "$c2" >/dev/null
code="$("${podman_base[@]}" inspect --format '{{.State.ExitCode}}' "$c2")"
echo "   exit code $code after $(( $(date +%s) - start ))s"
"${podman_base[@]}" logs "$c2" 2>&1 | tail -n 3 | sed 's/^/   log: /'
[[ "$code" == "0" ]] || { echo "error: exit code $code on SIGTERM" >&2; exit 1; }
echo "image $image built and run"
