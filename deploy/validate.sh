#!/usr/bin/env bash
# Validates everything under deploy/ offline: Kustomize and Helm rendering, strict schema
# checks of every object (Kubernetes, Istio, Gateway API, Envoy Gateway, Prometheus Operator,
# Envoy), consistency of the pod (probes, ports, grace period vs drain, memory vs the sizing
# formula), the chart's options (each value of ci/*-values.yaml where it belongs: pod knobs,
# admin port, ServiceMonitor/PodMonitor, TLS, the fleet's store), the gateway-tier example
# (replicas, Service without affinity, upstream, Redis, key Secret), Helm == Kustomize,
# hadolint on the Dockerfiles and shellcheck on the scripts.
#
# Installs its tools on first use (PyPI into .tools/deploy-venv, npm into
# deploy/tools/node_modules; both ignored by git) and reuses them afterwards. Needs python3,
# node and npm; uses `kubectl kustomize` as a second Kustomize when kubectl is on PATH.
# Exit status 0 when everything passed.
set -euo pipefail
deploy="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$deploy")"
venv="$repo/.tools/deploy-venv"
tools="$deploy/tools"

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }
pykustomize="pykustomize==0.1.4"

# --- Python tools -----------------------------------------------------------------------------
want="$( (cat "$tools/requirements.txt"; echo "$pykustomize") | sha256sum | cut -c1-16)"
if [[ ! -f "$venv/.stamp-$want" ]]; then
  echo "== installing Python tools into ${venv#"$repo"/}"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$tools/requirements.txt"
  # pykustomize (Kustomize's Go library) declares Python >= 3.14 but runs on 3.11; its only
  # dependency, cffi, comes from requirements.txt.
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
    --ignore-requires-python "$pykustomize"
  touch "$venv/.stamp-$want"
fi

# --- Node tools -------------------------------------------------------------------------------
want_node="$(stamp_of "$tools/package-lock.json")"
if [[ ! -f "$tools/node_modules/.stamp-$want_node" ]]; then
  echo "== installing npm tools into deploy/tools/node_modules"
  (cd "$tools" && npm ci --no-audit --no-fund --loglevel=error)
  touch "$tools/node_modules/.stamp-$want_node"
fi

failed=0
echo "== hadolint"
for f in "$deploy/Dockerfile" "$deploy/Dockerfile.scratch"; do
  # DL3006/DL3007: scratch has no tag to pin.
  if "$venv/bin/hadolint" --ignore DL3006 --ignore DL3007 "$f"; then
    echo "ok   hadolint ${f#"$repo"/}"
  else
    echo "FAIL hadolint ${f#"$repo"/}"; failed=1
  fi
done

echo "== shellcheck"
for f in "$deploy/validate.sh" "$deploy/build-image.sh"; do
  if "$venv/bin/shellcheck" "$f"; then
    echo "ok   shellcheck ${f#"$repo"/}"
  else
    echo "FAIL shellcheck ${f#"$repo"/}"; failed=1
  fi
done

echo "== haproxy"
# The HAProxy example is parsed by HAProxy itself (`haproxy -c`), with its environment set as a
# deployment would; tests/fleet/scale_out.rs runs it. Without HAProxy this is skipped, loudly, unless
# CI_REQUIRE_HAPROXY is set (.ci/run installs the Debian package and sets it).
haproxy_cfg="$deploy/loadbalancers/haproxy/haproxy.cfg"
haproxy_bin="${HAPROXY:-$(command -v haproxy || echo /usr/sbin/haproxy)}"
if [[ -x "$haproxy_bin" ]]; then
  if out="$(MCP_POD1=10.0.0.1:8080 MCP_POD2=10.0.0.2:8080 MCP_POD3=10.0.0.3:8080 \
      "$haproxy_bin" -c -f "$haproxy_cfg" 2>&1)"; then
    echo "ok   haproxy -c ${haproxy_cfg#"$repo"/} ($("$haproxy_bin" -v | head -n1 | cut -d' ' -f1-3))"
  else
    echo "FAIL haproxy -c ${haproxy_cfg#"$repo"/}:"; echo "$out"; failed=1
  fi
elif [[ -n "${CI_REQUIRE_HAPROXY:-}" ]]; then
  echo "FAIL haproxy: not installed but CI_REQUIRE_HAPROXY is set (apt-get install -y haproxy)"; failed=1
else
  echo "SKIP haproxy -c ${haproxy_cfg#"$repo"/}: HAProxy is not installed (apt-get install -y haproxy)"
fi

echo "== manifests"
"$venv/bin/python" "$tools/check_deploy.py" || failed=1

if [[ $failed -ne 0 ]]; then
  echo "deploy/validate.sh: FAILED"
  exit 1
fi
echo "deploy/validate.sh: all checks passed"
