#!/usr/bin/env python3
"""Offline validation of everything under deploy/ (run by deploy/validate.sh, which installs
the tools this imports into an ignored virtualenv).

What is checked, and with what:

* Kustomize base and overlay render with Kustomize itself (pykustomize, the Go library), and
  with `kubectl kustomize` too when kubectl is on PATH; both renderings must agree.
* The Helm chart lints (Helm's own linter, strict) and renders with Helm's Go SDK
  (helm-python-sdk, Helm v4), with the default values and with ci/*-values.yaml; invalid
  values are rejected by values.schema.json.
* Every rendered or hand-written Kubernetes object of a built-in kind validates strictly
  (unknown fields are errors) against the OpenAPI schemas of the oldest and newest Kubernetes
  versions we claim (kubernetes-validate).
* Istio objects: the cloudcoil models generated from Istio's CRDs, plus an unknown-field check;
  the Envoy config inside the EnvoyFilter against Envoy's protobuf API (xds-protos).
* Gateway API Gateway and HTTPRoute: the schema generated from the Gateway API CRDs
  (@kubernetes-models/gateway-api, via node).
* The Envoy bootstrap: parsed strictly into envoy.config.bootstrap.v3.Bootstrap (xds-protos):
  unknown fields, wrong types and unknown `@type`s are errors.
* Consistency of the pod: probes on the admin port, Service on the sidecar port, grace period
  covering drain-delay + drain-timeout, the MCP server's preStop covering the drain, memory
  limit at least the sizing formula of docs/operations.md for the flags given, non-root.
* Helm defaults render the same pod, Service and PDB as the Kustomize base, and nothing else.
* Chart options (ci/*-values.yaml): each pod knob set there is in the rendered pod (or
  ServiceAccount, or Service); the Service has the admin port exactly when asked for or when a
  ServiceMonitor needs it; the ServiceMonitor / PodMonitor select this release's Service / pods
  and scrape GET /metrics over HTTP on the admin port; with TLS the --tls-* flags name files of
  the named Secrets, mounted read-only without subPath. The MCP server's probes run in its
  container (it listens on 127.0.0.1). values.yaml says above replicaCount what several
  replicas need. With store.* (ci/store-values.yaml, and a plain store.url rendered here):
  MCP_REATTACH_STORE is the URL (a value, or a secretKeyRef to store.existingSecret), the key
  file is the named Secret's key mounted read-only without subPath in the gateway only, the
  timeouts are store.timeout and store.drainTimeoutSeconds, no --store flag in args, the grace
  period and the server's preStop also cover --store-drain-timeout (the hand-over after the
  drain); without a store URL none of it; the chart
  refuses a store URL without store.keySecret (and a URL given both ways, a key without a
  store). Broken renders must fail each of these checks.
* The gateway tier (deploy/kubernetes/gateway-tier, Kustomize): several mcp-reattach replicas
  alone in their pods (the shared checks of the pod: probes, drain and hand-over, memory with
  the store's write queue, non-root), a Service over them without session affinity, --upstream the
  Service of another Deployment (the stateless MCP server), the store URL the Service of a
  single Redis with maxmemory-policy noeviction, no persistence and maxmemory below its
  limit, the key file from the shipped Secret whose placeholder is too short to start a fleet,
  a NetworkPolicy that lets the gateways reach Redis. Broken copies must fail.
* The runtime stage of deploy/Dockerfile and deploy/Dockerfile.scratch are identical.
* The HAProxy example (deploy/loadbalancers/haproxy/haproxy.cfg; HAProxy itself parses it in
  validate.sh): the stick table learnt from the Mcp-Session-Id response header and matched on
  the request header, `option persist` + `option redispatch`, /readyz health checks on the admin
  port fast enough for --drain-delay, idle timeouts above the keep-alive interval, no compression
  and no hash balancing.
* Monitoring: the chart's PrometheusRule (off by default) carries exactly the rules of
  deploy/prometheus/mcp-reattach.rules.yml (only the runbook prefix may differ) and passes
  `promtool check rules` when promtool is on PATH; every alert has a severity, a summary and a
  runbook link to an existing section of docs/operations.md; the dashboard ConfigMap carries
  exactly deploy/prometheus/mcp-reattach-dashboard.json; the chart's copies in files/ are
  identical to deploy/prometheus/.
* Prometheus Operator kinds (PrometheusRule, ServiceMonitor, PodMonitor): the cloudcoil models
  generated from prometheus-operator v0.80.1's CRDs (patterns, enums, required fields), plus
  an unknown-field check, as for Istio.

* Envoy Gateway kinds (EnvoyPatchPolicy, BackendTrafficPolicy): the openAPIV3Schema of
  Envoy Gateway v1.9's CRDs (vendored in tools/crds/) with jsonschema, plus an unknown-field
  check; the session pin: the EnvoyPatchPolicy inserts the envelope stateful session on
  mcp-session-id before the router, on the listener and cluster names Envoy Gateway generates
  from the shipped Gateway and HTTPRoute, honours pins to DRAINING hosts, is enabled in the
  shipped EnvoyGateway config; no HTTPRoute uses sessionPersistence type Header. Mutated copies
  must fail each check.

Not checkable offline here: that Envoy Gateway applies the patch (needs its control plane) and
the ingress-nginx annotation values (the Ingress object itself is validated).
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent
REPO = DEPLOY.parent
K8S_VERSIONS = ["1.30.0", "1.37.0"]
RELEASE = "mcp-reattach"

# docs/operations.md, "Memory sizing" (measured; rounded up).
BASE_BYTES = 12 << 20
EVENT_OVERHEAD = 56
SESSION_OVERHEAD = 9 << 10
CONNECTION_BYTES = 64 << 10
READ_BATCH_BYTES = 64 << 10

failures: list[str] = []
passes = 0


def check(name: str, fn, *args, **kwargs):
    """Runs one check; records and prints its outcome. Returns fn's result or None."""
    global passes
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
        detail = str(e).strip() or type(e).__name__
        if os.environ.get("DEPLOY_VALIDATE_TRACE"):
            traceback.print_exc()
        print(f"FAIL {name}: {detail}")
        failures.append(name)
        return None
    print(f"ok   {name}")
    passes += 1
    return result


def rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def load_all(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def kustomize(path: Path) -> list[dict]:
    from pykustomize import build

    docs = load_all(asyncio.run(build(str(path))).yaml)
    if not docs:
        raise AssertionError("rendered nothing")
    if shutil.which("kubectl"):
        out = subprocess.run(
            ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120
        )
        if out.returncode != 0:
            raise AssertionError(f"kubectl kustomize failed: {out.stderr.strip()}")
        if load_all(out.stdout) != docs:
            raise AssertionError("kubectl kustomize and pykustomize render differently")
    return docs


def helm_lint(chart: Path):
    import helm_python as helm

    for kube in ("v" + K8S_VERSIONS[0], "v" + K8S_VERSIONS[-1]):
        report = helm.lint(str(chart), strict=True, namespace="mcp", kube_version=kube)
        bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
        if report.get("errors") or bad:
            raise AssertionError(json.dumps({"errors": report.get("errors"), "messages": bad}))


def helm_render(chart: Path, values: dict | None) -> list[dict]:
    import helm_python as helm

    c = helm.Chart.load(str(chart))
    try:
        c.validate_schema(values or {})
        rendered = c.render(values, name=RELEASE, namespace="mcp", is_install=True)
    finally:
        c.close()
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml") or path.endswith(".yml"):
            docs.extend(load_all(text))
    if not docs:
        raise AssertionError("rendered nothing")
    return docs


def helm_rejects(chart: Path, values: dict):
    import helm_python as helm

    c = helm.Chart.load(str(chart))
    try:
        c.validate_schema(values)
    except Exception:  # noqa: BLE001 - the point is that it fails
        return
    finally:
        c.close()
    raise AssertionError(f"values.schema.json accepted {values}")


# ---------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------


def k8s_validate(obj: dict):
    import kubernetes_validate

    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"Kubernetes {version}: {e.message} at {list(e.path)}") from None


def strict_roundtrip(model, obj: dict):
    """Validates with a pydantic model and fails on fields the model does not know."""
    parsed = model.model_validate(obj)
    dumped = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    unknown = []

    def walk(a, b, path):
        if isinstance(a, dict):
            if not isinstance(b, dict):
                unknown.append(path)
                return
            for k, v in a.items():
                if k not in b:
                    unknown.append(f"{path}.{k}")
                else:
                    walk(v, b[k], f"{path}.{k}")
        elif isinstance(a, list) and isinstance(b, list):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")

    # Envoy config inside an EnvoyFilter is a free-form Struct: checked against Envoy's API.
    o = copy.deepcopy(obj)
    d = copy.deepcopy(dumped)
    if obj.get("kind") == "EnvoyFilter":
        for p in o["spec"].get("configPatches", []):
            p.get("patch", {}).pop("value", None)
        for p in d["spec"].get("configPatches", []):
            p.get("patch", {}).pop("value", None)
    walk(o, d, "")
    if unknown:
        raise AssertionError(f"fields the schema does not know: {unknown}")


def istio_validate(obj: dict):
    version = obj["apiVersion"].split("/")[1]
    module = __import__(
        f"cloudcoil.models.istio.networking.{version}", fromlist=[obj["kind"]]
    )
    strict_roundtrip(getattr(module, obj["kind"]), obj)
    if obj["kind"] == "EnvoyFilter":
        for p in obj["spec"]["configPatches"]:
            if p["applyTo"] != "HTTP_FILTER":
                raise AssertionError(f"unexpected applyTo {p['applyTo']}")
            envoy_parse(
                p["patch"]["value"],
                "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter",
            )


def envoy_parse(data: dict, message: str):
    import importlib
    import pkgutil

    from google.protobuf import descriptor_pool, json_format, message_factory

    # Import every Envoy API module once, so `@type`s resolve.
    if not getattr(envoy_parse, "loaded", False):
        import envoy  # noqa: F401 - the xds-protos package

        for mod in pkgutil.walk_packages(envoy.__path__, "envoy."):
            if mod.name.endswith("_pb2"):
                try:
                    importlib.import_module(mod.name)
                except Exception:  # noqa: BLE001 - a few optional modules need extra deps
                    pass
        envoy_parse.loaded = True
    cls = message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(message))
    json_format.ParseDict(data, cls(), ignore_unknown_fields=False)


def gateway_api_validate(objects: list[tuple[str, dict]]):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"source": s, "object": o} for s, o in objects], f)
        name = f.name
    try:
        out = subprocess.run(
            ["node", str(DEPLOY / "tools" / "check-gateway-api.mjs"), name],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=DEPLOY / "tools",
        )
    finally:
        os.unlink(name)
    if out.returncode != 0:
        raise AssertionError((out.stdout + out.stderr).strip())
    return out.stdout.strip()


# ---------------------------------------------------------------------------------------------
# Envoy Gateway (CRDs vendored in tools/crds/; no schema package exists for these kinds)
# ---------------------------------------------------------------------------------------------

EG_CRDS = DEPLOY / "tools" / "crds" / "envoy-gateway-v1.9.0"


def crd_schema(api_version: str, kind: str) -> dict:
    group, version = api_version.split("/")
    for f in sorted(EG_CRDS.glob("*.yaml")):
        for crd in load_all(f.read_text()):
            spec = crd["spec"]
            if spec["group"] != group or spec["names"]["kind"] != kind:
                continue
            for v in spec["versions"]:
                if v["name"] == version and v.get("served"):
                    return v["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {api_version} {kind} in {rel(EG_CRDS)}")


def unknown_fields(schema: dict, value, path: str, out: list[str]):
    """Fields the API server would prune (structural schema): reported as errors."""
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        for k, v in value.items():
            if props is not None and k in props:
                unknown_fields(props[k], v, f"{path}.{k}", out)
            elif isinstance(addl, dict):
                unknown_fields(addl, v, f"{path}.{k}", out)
            elif props is not None or addl is False:
                out.append(f"{path}.{k}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            unknown_fields(schema["items"], v, f"{path}[{i}]", out)


def crd_validate(obj: dict):
    """Validates against the CRD's openAPIV3Schema; unknown fields are errors."""
    import jsonschema

    schema = crd_schema(obj["apiVersion"], obj["kind"])
    errors = sorted(
        jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path)
    )
    if errors:
        e = errors[0]
        raise AssertionError(f"{e.message} at {list(e.absolute_path)} ({len(errors)} errors)")
    unknown: list[str] = []
    unknown_fields(schema, obj, "", unknown)
    if unknown:
        raise AssertionError(f"fields the schema does not know: {unknown}")


ENVELOPE_FILTER = "type.googleapis.com/envoy.extensions.filters.http.stateful_session.v3.StatefulSession"
ENVELOPE_STATE = "type.googleapis.com/envoy.extensions.http.stateful_session.envelope.v3.EnvelopeSessionState"


def check_envoy_gateway_pin(objects: list[tuple[str, dict]]):
    """The Envoy Gateway example pins sessions with the envelope state, on the xDS resources
    that Envoy Gateway generates from the shipped Gateway and HTTPRoute (its default naming),
    and EnvoyPatchPolicy is enabled. No HTTPRoute uses header sessionPersistence."""
    objs = [o for _, o in objects]

    def of(kind):
        return [o for o in objs if o["kind"] == kind]

    for route in of("HTTPRoute"):
        for rule in route["spec"].get("rules", []):
            sp = rule.get("sessionPersistence")
            if sp and sp.get("type", "Cookie") == "Header":
                raise AssertionError(
                    f"HTTPRoute {route['metadata']['name']}: sessionPersistence type Header "
                    "overwrites the server's Mcp-Session-Id with the gateway's token"
                )

    configs = [c for c in of("ConfigMap") if c["metadata"]["name"] == "envoy-gateway-config"]
    if len(configs) != 1:
        raise AssertionError("expected one ConfigMap envoy-gateway-config (Envoy Gateway's config)")
    eg = yaml.safe_load(configs[0]["data"]["envoy-gateway.yaml"])
    if eg.get("kind") != "EnvoyGateway" or (eg.get("extensionApis") or {}).get(
        "enableEnvoyPatchPolicy"
    ) is not True:
        raise AssertionError("envoy-gateway-config does not set extensionApis.enableEnvoyPatchPolicy: true")

    policies = of("EnvoyPatchPolicy")
    if len(policies) != 1:
        raise AssertionError(f"expected one EnvoyPatchPolicy, found {len(policies)}")
    pol = policies[0]
    ns, spec = pol["metadata"].get("namespace"), pol["spec"]
    if spec.get("type") != "JSONPatch":
        raise AssertionError(f"EnvoyPatchPolicy type {spec.get('type')}, expected JSONPatch")
    ref = spec["targetRef"]
    if (ref.get("group"), ref.get("kind")) != ("gateway.networking.k8s.io", "Gateway"):
        raise AssertionError(f"targetRef {ref}: expected a Gateway")
    gateways = [g for g in of("Gateway")
                if g["metadata"]["name"] == ref["name"] and g["metadata"].get("namespace") == ns]
    if not gateways:
        raise AssertionError(f"targetRef Gateway {ns}/{ref['name']}: no such Gateway in the example "
                             "(the policy must live in the Gateway's namespace)")
    gw = gateways[0]

    # The HTTPRoute attached to that Gateway, and the Gateway listeners it attaches to.
    attached = []
    for route in of("HTTPRoute"):
        rns = route["metadata"]["namespace"]
        for p in route["spec"].get("parentRefs", []):
            if p["name"] == ref["name"] and p.get("namespace", rns) == ns:
                attached.append((route, p.get("sectionName")))
    if not attached:
        raise AssertionError(f"no HTTPRoute is attached to Gateway {ns}/{ref['name']}")
    listeners = {}
    for route, section in attached:
        for lis in gw["spec"]["listeners"]:
            if section in (None, lis["name"]):
                listeners[f"{ns}/{ref['name']}/{lis['name']}"] = lis
    clusters = {}
    for route, _ in attached:
        for i, rule in enumerate(route["spec"].get("rules", [])):
            if any(b["name"] == RELEASE for b in rule.get("backendRefs", [])):
                clusters[f"httproute/{route['metadata']['namespace']}/{route['metadata']['name']}/rule/{i}"] = rule

    patches = spec.get("jsonPatches", [])
    lpatches = [p for p in patches if p["type"].endswith("envoy.config.listener.v3.Listener")]
    cpatches = [p for p in patches if p["type"].endswith("envoy.config.cluster.v3.Cluster")]
    if len(lpatches) != 1 or len(cpatches) != 1:
        raise AssertionError("expected one Listener patch (the filter) and one Cluster patch (DRAINING)")

    lp = lpatches[0]
    if lp["name"] not in listeners:
        raise AssertionError(f"Listener patch targets {lp['name']!r}; Envoy Gateway names the "
                             f"route's listeners {sorted(listeners)}")
    lis = listeners[lp["name"]]
    op = lp["operation"]
    chain = "/default_filter_chain/" if lis["protocol"] == "HTTP" else "/filter_chains/"
    m = re.fullmatch(r"(/(?:default_filter_chain|filter_chains/\d+)/)filters/0/typed_config/http_filters/(\d+)",
                     op.get("path", ""))
    if op.get("op") != "add" or not m:
        raise AssertionError(f"Listener patch {op.get('op')} {op.get('path')}: expected add at "
                             "<filter chain>/filters/0/typed_config/http_filters/<index> (before the router)")
    if not m.group(1).startswith(chain):
        raise AssertionError(f"{lis['protocol']} listener: its HTTP filters are under {chain}")
    if int(m.group(2)) != 0:
        raise AssertionError("insert the filter at index 0: the router is last, and filters after it never run")
    value = op["value"]
    envoy_parse(value, "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter")
    tc = value.get("typed_config", {})
    state = tc.get("session_state", {})
    if tc.get("@type") != ENVELOPE_FILTER or state.get("name") != "envoy.http.stateful_session.envelope" \
            or state.get("typed_config", {}).get("@type") != ENVELOPE_STATE:
        raise AssertionError("the filter must be the stateful session with the envelope state "
                             "(envoy.http.stateful_session.envelope)")
    header = state["typed_config"].get("header", {}).get("name")
    if (header or "").lower() != "mcp-session-id":  # Envoy lower-cases header names
        raise AssertionError(f"envelope header {header!r}, expected mcp-session-id")

    cp = cpatches[0]
    if cp["name"] not in clusters:
        raise AssertionError(f"Cluster patch targets {cp['name']!r}; Envoy Gateway names the "
                             f"route's clusters {sorted(clusters)}")
    cop = cp["operation"]
    if (cop.get("op"), cop.get("path")) != ("add", "/common_lb_config/override_host_status"):
        raise AssertionError(f"Cluster patch {cop.get('op')} {cop.get('path')}: expected add "
                             "/common_lb_config/override_host_status")
    envoy_parse(cop["value"], "envoy.config.core.v3.HealthStatusSet")
    statuses = set(cop["value"].get("statuses", []))
    if not {"HEALTHY", "DRAINING"} <= statuses:
        raise AssertionError(f"override_host_status {sorted(statuses)}: needs HEALTHY and DRAINING "
                             "(a draining pod still serves its sessions)")

    for btp in of("BackendTrafficPolicy"):
        for t in btp["spec"].get("targetRefs", []):
            if t["kind"] == "HTTPRoute" and not any(
                    r["metadata"]["name"] == t["name"] for r, _ in attached):
                raise AssertionError(f"BackendTrafficPolicy targets HTTPRoute {t['name']}, not shipped")
    return (f"listener {lp['name']} ({lis['protocol']}) gets the envelope filter on "
            f"mcp-session-id; cluster {cp['name']} honours pins to {sorted(statuses)}")


def eg_pin_rejects(objects: list[tuple[str, dict]], mutate):
    """The check above fails on a broken copy of the example."""
    broken = copy.deepcopy(objects)
    mutate({o["kind"]: o for _, o in broken})
    try:
        check_envoy_gateway_pin(broken)
    except Exception as e:  # noqa: BLE001 - an assertion, or Envoy's parser refusing the value
        return str(e)
    raise AssertionError("the broken copy passed")


def eg_schema_rejects(obj: dict, mutate):
    broken = copy.deepcopy(obj)
    mutate(broken)
    try:
        crd_validate(broken)
    except AssertionError as e:
        return str(e)
    raise AssertionError("the broken copy passed")


def _patch(kinds, i):
    return kinds["EnvoyPatchPolicy"]["spec"]["jsonPatches"][i]["operation"]


EG_PIN_BREAKS = {
    "header name changed": lambda k: _patch(k, 0)["value"]["typed_config"]["session_state"]
    ["typed_config"]["header"].update(name="session-id"),
    "header state instead of envelope": lambda k: _patch(k, 0)["value"]["typed_config"]
    ["session_state"].update(name="envoy.http.stateful_session.header", typed_config={
        "@type": "type.googleapis.com/envoy.extensions.http.stateful_session.header.v3.HeaderBasedSessionState",
        "name": "mcp-session-id"}),
    "a field Envoy does not know": lambda k: _patch(k, 0)["value"]["typed_config"]["session_state"]
    ["typed_config"].update(headers={"name": "mcp-session-id"}),
    "listener name of another listener": lambda k: k["EnvoyPatchPolicy"]["spec"]["jsonPatches"][0]
    .update(name="gateways/public/https"),
    "filter appended after the router": lambda k: _patch(k, 0).update(
        path="/default_filter_chain/filters/0/typed_config/http_filters/-"),
    "HTTPS filter chain path on an HTTP listener": lambda k: _patch(k, 0).update(
        path="/filter_chains/0/filters/0/typed_config/http_filters/0"),
    "targets another Gateway": lambda k: k["EnvoyPatchPolicy"]["spec"]["targetRef"].update(name="other"),
    "policy outside the Gateway's namespace": lambda k: k["EnvoyPatchPolicy"]["metadata"].update(namespace="mcp"),
    "cluster name of another rule": lambda k: k["EnvoyPatchPolicy"]["spec"]["jsonPatches"][1]
    .update(name="httproute/mcp/mcp-reattach/rule/1"),
    "pins not honoured while draining": lambda k: _patch(k, 1)["value"].update(statuses=["HEALTHY"]),
    "EnvoyPatchPolicy not enabled": lambda k: k["ConfigMap"]["data"].update(
        {"envoy-gateway.yaml": "apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: EnvoyGateway\n"}),
    "HTTPRoute with sessionPersistence type Header": lambda k: k["HTTPRoute"]["spec"]["rules"][0]
    .update(sessionPersistence={"type": "Header", "sessionName": "Mcp-Session-Id"}),
}

EG_SCHEMA_BREAKS = {
    "EnvoyPatchPolicy": {
        "targetRef.namespace (not in LocalPolicyTargetReference)":
            lambda o: o["spec"]["targetRef"].update(namespace="gateways"),
        "type Merge (not in the enum)": lambda o: o["spec"].update(type="Merge"),
        "operation without op": lambda o: o["spec"]["jsonPatches"][0]["operation"].pop("op"),
    },
    "BackendTrafficPolicy": {
        "consistentHash type Cookies (not in the enum)":
            lambda o: o["spec"]["loadBalancer"]["consistentHash"].update(type="Cookies"),
    },
}


# ---------------------------------------------------------------------------------------------
# Consistency of the pod
# ---------------------------------------------------------------------------------------------


def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", s)
    if not m:
        raise AssertionError(f"not a size: {s!r}")
    unit = m.group(2).lower()
    mult = {
        "": 1, "b": 1, "kb": 10**3, "kib": 1 << 10, "k": 1 << 10, "mb": 10**6,
        "mib": 1 << 20, "m": 1 << 20, "gb": 10**9, "gib": 1 << 30, "g": 1 << 30,
    }[unit]
    return int(m.group(1)) * mult


def parse_duration(s: str) -> float:
    if s.strip() == "0":
        return 0.0
    total, pos = 0.0, 0
    for m in re.finditer(r"(\d+)(ms|s|m|h)", s):
        if m.start() != pos:
            break
        total += int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]
        pos = m.end()
    if pos != len(s) or pos == 0:
        raise AssertionError(f"not a duration: {s!r}")
    return total


def k8s_quantity(q) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T|m)?", str(q))
    if not m:
        raise AssertionError(f"not a quantity: {q!r}")
    mult = {
        None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
        "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "m": 0.001,
    }[m.group(2)]
    return float(m.group(1)) * mult


def flags(args: list[str]) -> dict[str, str]:
    out = {}
    for a in args:
        if not a.startswith("--") or "=" not in a:
            raise AssertionError(f"write flags as --flag=value: {a!r}")
        k, v = a[2:].split("=", 1)
        if k in out:
            raise AssertionError(f"--{k} given twice")
        out[k] = v
    return out


# Defaults of the gateway's flags (README.md / docs/operations.md).
DEFAULTS = {
    "window-events": "256", "window-bytes": "1MiB", "max-sessions": "10000",
    "memory-budget": "1GiB", "max-buffered-request-bytes": "64MiB", "max-event-bytes": "16MiB",
    "drain-delay": "5s", "drain-timeout": "25s", "keepalive": "15s",
    "admin-listen": "127.0.0.1:9090", "listen": "0.0.0.0:8080", "store-drain-timeout": "60s",
}


def memory_estimate(f: dict[str, str], store: bool = False) -> int:
    events = int(f.get("window-events", DEFAULTS["window-events"]))
    window = parse_size(f.get("window-bytes", DEFAULTS["window-bytes"]))
    sessions = int(f.get("max-sessions", DEFAULTS["max-sessions"]))
    budget = parse_size(f.get("memory-budget", DEFAULTS["memory-budget"]))
    bodies = parse_size(f.get("max-buffered-request-bytes", DEFAULTS["max-buffered-request-bytes"]))
    # The windows' retained bytes and the oversized events held for clients share
    # --memory-budget; the windows alone never hold more than their own bound.
    held = max(budget, sessions * window)
    event = parse_size(f.get("max-event-bytes", DEFAULTS["max-event-bytes"]))
    per_session = events * EVENT_OVERHEAD + SESSION_OVERHEAD
    # What upstream readers hold outside the sessions: an eighth of the budget, one answer
    # decoded past it, and a read batch per upstream connection (one per session's held
    # stream or call, counted as the client connections are).
    readers = budget // 8 + event + sessions * READ_BATCH_BYTES
    # With --store, the queue of writes to the store holds up to a sixteenth of the budget
    # (src/store/writer.rs); past it events are dropped (the explicit gap).
    queue = budget // 16 if store else 0
    return (BASE_BYTES + held + sessions * per_session + sessions * CONNECTION_BYTES + bodies
            + readers + queue)


def uses_store(gw: dict) -> bool:
    """The container runs with --store (as a flag or its environment variable)."""
    return any(a.startswith("--store=") for a in gw.get("args", [])) or any(
        e["name"] == "MCP_REATTACH_STORE" for e in gw.get("env", []))


def store_drain_seconds(gw: dict) -> float:
    """--store-drain-timeout of a container with --store (flag, else its variable, else the
    default): after the drain the replica reads its running calls into the store this long at
    most, and the pod's grace period must exceed the whole. 0 without a store."""
    if not uses_store(gw):
        return 0.0
    f = flags(gw["args"])
    env = {e["name"]: e.get("value") for e in gw.get("env", [])}
    value = f.get("store-drain-timeout") or env.get("MCP_REATTACH_STORE_DRAIN_TIMEOUT") \
        or DEFAULTS["store-drain-timeout"]
    return parse_duration(value)


def check_gateway(pod: dict, gw: dict):
    """What every mcp-reattach container needs, as a sidecar or in a gateway tier: its flags
    and ports agree, probes on the admin port (plain HTTP), keep-alive on, a grace period that
    covers the drain, a memory limit at least the sizing formula (with the store's queue under
    --store), volumes and mounts that exist, non-root with a read-only root filesystem.
    Returns (flags, container ports, drain seconds, grace seconds, bytes needed)."""
    f = flags(gw["args"])
    for required in ("upstream", "listen", "admin-listen", "drain-delay", "drain-timeout"):
        if required not in f:
            raise AssertionError(f"mcp-reattach has no --{required}")
    ports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    admin_host, admin_port = f["admin-listen"].rsplit(":", 1)
    if admin_host != "0.0.0.0":
        raise AssertionError("--admin-listen must be 0.0.0.0:<port> so the kubelet can probe it")
    if int(admin_port) != ports["admin"]:
        raise AssertionError("--admin-listen port differs from the `admin` containerPort")
    if int(f["listen"].rsplit(":", 1)[1]) != ports["mcp"]:
        raise AssertionError("--listen port differs from the `mcp` containerPort")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = gw[probe]["httpGet"]
        if get["path"] != path or get["port"] not in ("admin", ports["admin"]):
            raise AssertionError(f"{probe} must be GET {path} on the admin port")
        if get.get("scheme", "HTTP") != "HTTP":
            raise AssertionError(f"{probe}: the admin listener speaks plain HTTP, also with TLS")
    handover = store_drain_seconds(gw)
    drain = parse_duration(f["drain-delay"]) + parse_duration(f["drain-timeout"]) + handover
    grace = pod["terminationGracePeriodSeconds"]
    if grace < drain + 5:
        raise AssertionError(
            f"terminationGracePeriodSeconds {grace} < drain-delay + drain-timeout"
            f"{f' + store-drain-timeout ({handover:g}s)' if handover else ''} + 5s margin"
        )
    keepalive = parse_duration(f.get("keepalive", DEFAULTS["keepalive"]))
    if keepalive == 0:
        raise AssertionError("keep --keepalive on in a pod: idle-timeouts of proxies would cut streams")
    store = uses_store(gw)
    need = memory_estimate(f, store)
    res = gw["resources"]
    limit = k8s_quantity(res["limits"]["memory"])
    request = k8s_quantity(res["requests"]["memory"])
    if limit < need:
        raise AssertionError(
            f"memory limit {res['limits']['memory']} < {need / (1 << 20):.0f} MiB "
            f"the sizing formula gives for these flags{' and the store' if store else ''}"
        )
    if request > limit:
        raise AssertionError("memory request above the limit")
    volumes = [v["name"] for v in pod.get("volumes", [])]
    if len(set(volumes)) != len(volumes):
        raise AssertionError(f"volume names repeat: {volumes}")
    for c in pod["containers"]:
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                raise AssertionError(f"container {c['name']} mounts {m['name']!r}, not a pod volume")
        paths = [m["mountPath"] for m in c.get("volumeMounts", [])]
        if len(set(paths)) != len(paths):
            raise AssertionError(f"container {c['name']}: mount paths repeat: {paths}")
    sc = pod["securityContext"]
    if not sc.get("runAsNonRoot") or sc.get("runAsUser", 0) == 0:
        raise AssertionError("the pod must run as non-root")
    for c in pod["containers"]:
        csc = c.get("securityContext", {})
        if csc.get("allowPrivilegeEscalation", True) or not csc.get("readOnlyRootFilesystem"):
            raise AssertionError(f"container {c['name']}: privilege escalation or writable root")
    return f, ports, drain, grace, need


def check_pod(docs: list[dict]):
    deps = [d for d in docs if d["kind"] == "Deployment"]
    svcs = [d for d in docs if d["kind"] == "Service"]
    if len(deps) != 1 or len(svcs) != 1:
        raise AssertionError("expected one Deployment and one Service")
    dep, svc = deps[0], svcs[0]
    pod = dep["spec"]["template"]["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    containers = {c["name"]: c for c in pod["containers"]}
    gw, server = containers["mcp-reattach"], containers["mcp-server"]
    f, ports, drain, grace, need = check_gateway(pod, gw)
    if not f["upstream"].startswith("http://127.0.0.1:"):
        raise AssertionError("a sidecar's --upstream is the MCP server on 127.0.0.1")
    # The MCP server listens on 127.0.0.1 (--upstream): the kubelet's httpGet/tcpSocket/grpc
    # probes connect to the pod IP and would never reach it, so its probes run in the
    # container, and name the server's port.
    upstream_port = f["upstream"].rsplit(":", 1)[1].split("/")[0]
    for probe in ("readinessProbe", "livenessProbe"):
        pr = server.get(probe)
        if not pr:
            raise AssertionError(f"the MCP server container has no {probe}")
        if set(pr) & {"httpGet", "tcpSocket", "grpc"}:
            raise AssertionError(f"MCP server {probe}: the kubelet connects to the pod IP, a server "
                                 "on 127.0.0.1 never answers it; use exec")
        if not any(re.search(rf"\b{upstream_port}\b", w) for w in pr.get("exec", {}).get("command", [])):
            raise AssertionError(f"MCP server {probe} does not name the server's port {upstream_port}")
    # Clients reach the sidecar's port; the admin port may be on the Service too (for a
    # ServiceMonitor); the MCP server's port never is.
    targets = [p["targetPort"] for p in svc["spec"]["ports"]]
    if sum(t in ("mcp", ports["mcp"]) for t in targets) != 1 or any(
            t not in ("mcp", ports["mcp"], "admin", ports["admin"]) for t in targets):
        raise AssertionError(f"the Service targets {targets}: the sidecar's port once, the admin "
                             "port at most, never the server's")
    if any(labels.get(k) != v for k, v in svc["spec"]["selector"].items()):
        raise AssertionError("the Service selector does not match the pod labels")
    sleep = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    if not drain <= sleep < grace:
        raise AssertionError(f"MCP server preStop sleep {sleep}s must cover the drain and end before the grace period")
    limit = gw["resources"]["limits"]["memory"]
    return f"{need / (1 << 20):.0f} MiB needed, limit {limit}, grace {grace}s"


def same_pod(a: list[dict], b: list[dict]):
    def pick(docs, kind):
        return [d for d in docs if d["kind"] == kind][0]

    for kind, paths in (
        ("Deployment", [("spec", "template", "spec"), ("spec", "strategy"), ("spec", "replicas"),
                        ("spec", "selector"), ("spec", "template", "metadata")]),
        ("Service", [("spec",)]),
        ("PodDisruptionBudget", [("spec",)]),
    ):
        x, y = pick(a, kind), pick(b, kind)
        for p in paths:
            vx, vy = x, y
            for k in p:
                vx, vy = vx[k], vy[k]
            if vx != vy:
                diff = difflib.unified_diff(
                    yaml.safe_dump(vx, sort_keys=True).splitlines(),
                    yaml.safe_dump(vy, sort_keys=True).splitlines(),
                    "kustomize", "helm", lineterm="", n=1,
                )
                raise AssertionError(f"{kind} .{'.'.join(p)} differs:\n" + "\n".join(diff))


def dockerfiles_agree():
    def runtime(path: Path) -> list[str]:
        lines = path.read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("# --- runtime"))
        body = [line for line in lines[start + 1:] if not line.startswith("COPY ")]
        if not any(line.startswith("USER ") and not line.startswith("USER 0") for line in body):
            raise AssertionError(f"{rel(path)}: no non-root USER")
        return body

    a = runtime(DEPLOY / "Dockerfile")
    b = runtime(DEPLOY / "Dockerfile.scratch")
    if a != b:
        raise AssertionError("the runtime stages of Dockerfile and Dockerfile.scratch differ")


# ---------------------------------------------------------------------------------------------
# HAProxy example
# ---------------------------------------------------------------------------------------------


def haproxy_sections(text: str) -> dict[str, list[str]]:
    """`{"defaults": [...], "backend mcp_reattach": [...], ...}`: each section's directive lines,
    comments and blank lines dropped, whitespace collapsed."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if not raw[0].isspace():
            current = " ".join(words[:2]) if words[0] in ("frontend", "backend", "listen") else words[0]
            sections[current] = []
        elif current is not None:
            sections[current].append(" ".join(words))
    return sections


def haproxy_time(value: str) -> float:
    """An HAProxy time (a bare number is milliseconds); `"${VAR-default}"` gives its default."""
    m = re.fullmatch(r'"?\$\{[A-Z0-9_]+-([^}]+)\}"?', value)
    if m:
        value = m.group(1)
    if re.fullmatch(r"\d+", value):
        return int(value) / 1000
    if re.fullmatch(r"\d+us", value):
        return int(value[:-2]) / 1e6
    return parse_duration(value)


def check_haproxy(path: Path):
    """The session pin, drain and SSE settings docs/operations.md relies on are all there."""
    sec = haproxy_sections(path.read_text())
    backend, defaults = sec.get("backend mcp_reattach"), sec.get("defaults")
    if backend is None or defaults is None:
        raise AssertionError(f"expected a defaults section and backend mcp_reattach: {list(sec)}")
    everything = [line for lines in sec.values() for line in lines]
    required = {
        "stick-table type string": backend,
        "stick store-response res.hdr(mcp-session-id)": backend,
        "stick match req.hdr(mcp-session-id)": backend,
        "option persist": backend,
        "option httpchk": backend,
        "http-check send meth GET uri /readyz": backend,
        "http-check expect status 200": backend,
        "option redispatch": defaults,
        "mode http": defaults,
    }
    for directive, lines in required.items():
        if not any(line.startswith(directive) for line in lines):
            raise AssertionError(f"missing `{directive}`")
    for line in everything:
        if line.startswith("compression"):
            raise AssertionError(f"`{line}`: a compressor buffers SSE events")
        if line.startswith("balance") and ("hdr(" in line or "uri" in line):
            raise AssertionError(f"`{line}`: hashing cannot find the pod that answered initialize")
    keepalive = parse_duration(DEFAULTS["keepalive"])
    timeouts = {l.split()[1]: haproxy_time(l.split()[2]) for l in defaults if l.startswith("timeout ")}
    for name in ("client", "server", "tunnel"):
        if timeouts.get(name, 0) < 2 * keepalive:
            raise AssertionError(
                f"timeout {name} {timeouts.get(name)} s is not above twice --keepalive ({keepalive} s)"
            )
    ds = next((l.split() for l in backend if l.startswith("default-server")), None)
    if not ds or "inter" not in ds or "fall" not in ds:
        raise AssertionError("default-server must set inter and fall")
    detect = haproxy_time(ds[ds.index("inter") + 1]) * int(ds[ds.index("fall") + 1])
    drain_delay = parse_duration(DEFAULTS["drain-delay"])
    if detect >= drain_delay:
        raise AssertionError(
            f"health checks take {detect} s to mark a draining pod down, not below --drain-delay ({drain_delay} s)"
        )
    servers = [l for l in backend if l.startswith("server ")]
    admin_port = DEFAULTS["admin-listen"].rsplit(":", 1)[1]
    for srv in servers:
        words = srv.split()
        if "check" not in words or "port" not in words:
            raise AssertionError(f"`{srv}`: health check on the admin port expected")
        port = words[words.index("port") + 1]
        m = re.fullmatch(r'"?\$\{[A-Z0-9_]+-(\d+)\}"?', port)
        if (m.group(1) if m else port) != admin_port:
            raise AssertionError(f"`{srv}`: admin port {port}, the pods use {admin_port}")
    if not servers:
        raise AssertionError("no servers")
    return (f"{len(servers)} servers; detection of a draining pod {detect} s < drain-delay "
            f"{drain_delay} s; timeouts client/server/tunnel {timeouts['client']}/"
            f"{timeouts['server']}/{timeouts['tunnel']} s > 2 x keepalive {keepalive} s")


# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Monitoring: alerting rules and the Grafana dashboard
# ---------------------------------------------------------------------------------------------

PROM = DEPLOY / "prometheus"
RULES = PROM / "mcp-reattach.rules.yml"
DASHBOARD = PROM / "mcp-reattach-dashboard.json"


def github_anchors(md: str) -> set[str]:
    anchors = set()
    fenced = False
    for line in md.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = not fenced and re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            text = m.group(1).strip().lower()
            text = re.sub(r"[^\w\- ]", "", text)
            anchors.add(text.replace(" ", "-"))
    return anchors


def chart_files_match(chart: Path):
    for f in (RULES, DASHBOARD):
        copy_ = chart / "files" / f.name
        if copy_.read_bytes() != f.read_bytes():
            raise AssertionError(f"{rel(copy_)} differs from {rel(f)}: copy it again")


def rules_well_formed():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    anchors = github_anchors((REPO / "docs" / "operations.md").read_text())
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    if not alerts:
        raise AssertionError("no alerts")
    for r in alerts:
        name = r["alert"]
        if r.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
            raise AssertionError(f"{name}: no severity label")
        ann = r.get("annotations", {})
        if not ann.get("summary"):
            raise AssertionError(f"{name}: no summary")
        link = ann.get("runbook_url", "")
        page, _, anchor = link.partition("#")
        if page != "docs/operations.md" or anchor not in anchors:
            raise AssertionError(f"{name}: runbook_url {link!r} is not a section of docs/operations.md")
    return f"{len(alerts)} alerts, each with a runbook section"


def prometheus_operator_validate(obj: dict):
    """PrometheusRule, ServiceMonitor, PodMonitor against the models generated from the
    prometheus-operator CRDs; unknown fields are errors."""
    from cloudcoil.models.prometheus_operator import v1

    if obj["apiVersion"] != "monitoring.coreos.com/v1" or not hasattr(v1, obj["kind"]):
        raise AssertionError(f"no model for {obj['apiVersion']} {obj['kind']}")
    strict_roundtrip(getattr(v1, obj["kind"]), obj)


def prometheus_operator_rejects(obj: dict, mutate):
    broken = copy.deepcopy(obj)
    mutate(broken)
    try:
        prometheus_operator_validate(broken)
    except Exception as e:  # noqa: BLE001 - pydantic's error or the unknown-field check
        return str(e)
    raise AssertionError("the broken copy passed")


# Broken copies the prometheus-operator models must refuse (shows the validation is strict).
PO_SCHEMA_BREAKS = {
    "PrometheusRule": {
        "`for: 5 minutes` (not a Prometheus duration)":
            lambda o: o["spec"]["groups"][0]["rules"][0].update({"for": "5 minutes"}),
        "a misspelt field (`fro`)": lambda o: o["spec"]["groups"][0]["rules"][0].update(fro="5m"),
    },
    "ServiceMonitor": {
        "scheme tcp (not in the enum)": lambda o: o["spec"]["endpoints"][0].update(scheme="tcp"),
        "interval 30 (no unit)": lambda o: o["spec"]["endpoints"][0].update(interval="30"),
        "a numeric port (a Service port name is a string)":
            lambda o: o["spec"]["endpoints"][0].update(port=9090),
        "no selector (required)": lambda o: o["spec"].pop("selector"),
        "a misspelt field (`endpoint`)": lambda o: o["spec"].update(endpoint=o["spec"].pop("endpoints")),
    },
    "PodMonitor": {
        "a misspelt field (`podMetricEndpoints`)": lambda o: o["spec"].update(
            podMetricEndpoints=o["spec"].pop("podMetricsEndpoints")),
        "scrapeTimeout 5 seconds": lambda o: o["spec"]["podMetricsEndpoints"][0].update(
            scrapeTimeout="5 seconds"),
    },
}


def prometheus_rule_validate(obj: dict, base_url: str):
    if obj["apiVersion"] != "monitoring.coreos.com/v1" or obj["kind"] != "PrometheusRule":
        raise AssertionError(f"unexpected {obj['apiVersion']} {obj['kind']}")
    if set(obj) != {"apiVersion", "kind", "metadata", "spec"} or set(obj["spec"]) != {"groups"}:
        raise AssertionError(f"unexpected fields: {sorted(obj)} / {sorted(obj['spec'])}")
    groups = copy.deepcopy(obj["spec"]["groups"])
    for g in groups:
        for r in g["rules"]:
            url = r.get("annotations", {}).get("runbook_url", "")
            if base_url:
                if not url.startswith(base_url):
                    raise AssertionError(f"{r.get('alert')}: runbook_url {url!r} lacks {base_url!r}")
                r["annotations"]["runbook_url"] = url[len(base_url):]
    if groups != yaml.safe_load(RULES.read_text())["groups"]:
        raise AssertionError(f"spec.groups differ from {rel(RULES)}")
    if shutil.which("promtool"):
        with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
            yaml.safe_dump({"groups": obj["spec"]["groups"]}, f)
            f.flush()
            out = subprocess.run(["promtool", "check", "rules", f.name],
                                 capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise AssertionError(f"promtool check rules: {out.stdout}{out.stderr}")


def dashboard_configmap_validate(obj: dict):
    data = obj.get("data", {})
    if list(data) != ["mcp-reattach.json"]:
        raise AssertionError(f"unexpected keys {list(data)}")
    if json.loads(data["mcp-reattach.json"]) != json.loads(DASHBOARD.read_text()):
        raise AssertionError(f"dashboard differs from {rel(DASHBOARD)}")


def renders(docs: list[dict], kind: str):
    if not any(d["kind"] == kind for d in docs):
        raise AssertionError(f"no {kind}")


def options_off_by_default(docs: list[dict]):
    """The defaults render the Kustomize base's objects and nothing optional."""
    extra = [d["kind"] + " " + d["metadata"]["name"] for d in docs
             if d["kind"] not in ("Deployment", "Service", "PodDisruptionBudget")]
    if extra:
        raise AssertionError(f"rendered by default: {extra}")


# ---------------------------------------------------------------------------------------------
# Chart options: what a ci/*-values.yaml file sets must land where it belongs in the render
# ---------------------------------------------------------------------------------------------


def only(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    if len(found) != 1:
        raise AssertionError(f"expected one {kind}, found {len(found)}")
    return found[0]


def pod_parts(docs: list[dict]):
    """(Deployment, pod template, pod spec, containers by name)."""
    dep = only(docs, "Deployment")
    tmpl = dep["spec"]["template"]
    return dep, tmpl, tmpl["spec"], {c["name"]: c for c in tmpl["spec"]["containers"]}


# The pod knobs (values keys) that ci/knobs-values.yaml must set, so that each is checked.
POD_KNOBS = [
    "podAnnotations", "podLabels", "imagePullSecrets", "priorityClassName", "nodeSelector",
    "tolerations", "affinity", "topologySpreadConstraints", "extraVolumes", "serviceAccount",
    "mcpServer.extraVolumeMounts", "gateway.extraEnv", "gateway.extraVolumeMounts",
    "service.sessionAffinity",
]


def value_at(values: dict, dotted: str):
    v = values
    for k in dotted.split("."):
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v


def knobs_all_set(values: dict):
    unset = [k for k in POD_KNOBS if not value_at(values, k)]
    if unset:
        raise AssertionError(f"ci/knobs-values.yaml leaves unset (so unchecked): {unset}")


def check_knobs(docs: list[dict], values: dict):
    """Every pod knob in `values` is in the rendered pod (or ServiceAccount), as given."""
    dep, tmpl, pod, containers = pod_parts(docs)
    gw, server = containers["mcp-reattach"], containers["mcp-server"]
    problems = []

    def want(where: str, got, expected):
        if got != expected:
            problems.append(f"{where} is {got!r}, the values give {expected!r}")

    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName"):
        if key in values:
            want(f"pod .{key}", pod.get(key), values[key])
    selector = dep["spec"]["selector"]["matchLabels"]
    if "topologySpreadConstraints" in values:
        # A constraint without labelSelector gets the pod's selector labels.
        expected = [{"labelSelector": {"matchLabels": selector}, **c}
                    for c in values["topologySpreadConstraints"]]
        want("pod .topologySpreadConstraints", pod.get("topologySpreadConstraints"), expected)
    labels, annotations = tmpl["metadata"].get("labels", {}), tmpl["metadata"].get("annotations", {})
    for k, v in selector.items():
        want(f"pod label {k} (a selector label)", labels.get(k), v)
    for k, v in values.get("podLabels", {}).items():
        if k not in selector:
            want(f"pod label {k}", labels.get(k), v)
    for k, v in values.get("podAnnotations", {}).items():
        want(f"pod annotation {k}", annotations.get(k), v)

    sa = values.get("serviceAccount", {})
    accounts = [d for d in docs if d["kind"] == "ServiceAccount"]
    automount = sa.get("automount", False)
    want("pod .automountServiceAccountToken", pod.get("automountServiceAccountToken"), automount)
    if sa.get("create"):
        if len(accounts) != 1:
            problems.append(f"serviceAccount.create: {len(accounts)} ServiceAccounts rendered")
        else:
            acc = accounts[0]
            want("pod .serviceAccountName", pod.get("serviceAccountName"), acc["metadata"]["name"])
            want("ServiceAccount annotations", acc["metadata"].get("annotations"),
                 sa.get("annotations") or None)
            want("ServiceAccount .automountServiceAccountToken",
                 acc.get("automountServiceAccountToken"), automount)
    else:
        if accounts:
            problems.append("a ServiceAccount rendered without serviceAccount.create")
        want("pod .serviceAccountName", pod.get("serviceAccountName"), sa.get("name") or None)

    def contains(where: str, items: list, expected: list):
        for item in expected:
            if item not in items:
                problems.append(f"{where} lacks {item!r}")

    svc = only(docs, "Service")["spec"]
    affinity = value_at(values, "service.sessionAffinity") or "None"
    want("Service .sessionAffinity", svc.get("sessionAffinity", "None"), affinity)
    if affinity == "ClientIP":
        want("Service .sessionAffinityConfig.clientIP.timeoutSeconds",
             svc.get("sessionAffinityConfig", {}).get("clientIP", {}).get("timeoutSeconds"),
             value_at(values, "service.sessionAffinityTimeoutSeconds") or 10800)
    contains("pod .volumes", pod.get("volumes", []), values.get("extraVolumes", []))
    contains("mcp-reattach .env", gw.get("env", []), value_at(values, "gateway.extraEnv") or [])
    contains("mcp-reattach .volumeMounts", gw.get("volumeMounts", []),
             value_at(values, "gateway.extraVolumeMounts") or [])
    contains("mcp-server .volumeMounts", server.get("volumeMounts", []),
             value_at(values, "mcpServer.extraVolumeMounts") or [])
    if problems:
        raise AssertionError("; ".join(problems))


def render_rejects(fn, docs: list[dict], mutate, *args):
    """`fn` (a check of rendered objects) fails on a copy that `mutate` broke."""
    broken = copy.deepcopy(docs)
    mutate(broken)
    try:
        fn(broken, *args)
    except AssertionError as e:
        return str(e)
    raise AssertionError("the broken copy passed")


def _pod(docs):
    return pod_parts(docs)[2]


def _container(docs, name):
    return pod_parts(docs)[3][name]


# A render without each knob: check_knobs must fail on every one.
KNOB_BREAKS = {
    **{f"no {k}": (lambda k: lambda d: _pod(d).pop(k))(k) for k in
       ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName",
        "topologySpreadConstraints", "serviceAccountName")},
    "a topology spread constraint without the selector labels":
        lambda d: _pod(d)["topologySpreadConstraints"][0].pop("labelSelector"),
    "no podAnnotations": lambda d: pod_parts(d)[1]["metadata"].update(
        annotations={k: v for k, v in pod_parts(d)[1]["metadata"]["annotations"].items()
                     if k.startswith("prometheus.io/")}),
    "no podLabels": lambda d: pod_parts(d)[1]["metadata"].update(
        labels=dict(pod_parts(d)[0]["spec"]["selector"]["matchLabels"])),
    "podLabels overriding a selector label": lambda d: pod_parts(d)[1]["metadata"]["labels"]
    .update({"app.kubernetes.io/name": "not-the-selector"}),
    "no ServiceAccount": lambda d: d.remove(only(d, "ServiceAccount")),
    "no ServiceAccount annotations": lambda d: only(d, "ServiceAccount")["metadata"].pop("annotations"),
    "the API token mounted": lambda d: _pod(d).update(automountServiceAccountToken=True),
    "no extraVolumes": lambda d: _pod(d).update(volumes=_pod(d)["volumes"][:1]),
    "no gateway.extraEnv": lambda d: _container(d, "mcp-reattach").pop("env"),
    "no gateway.extraVolumeMounts": lambda d: _container(d, "mcp-reattach").pop("volumeMounts"),
    "no Service sessionAffinity": lambda d: only(d, "Service")["spec"].pop("sessionAffinity"),
    "another sessionAffinity timeout": lambda d: only(d, "Service")["spec"]["sessionAffinityConfig"]
    ["clientIP"].update(timeoutSeconds=10800),
    "no mcpServer.extraVolumeMounts": lambda d: _container(d, "mcp-server").update(
        volumeMounts=_container(d, "mcp-server")["volumeMounts"][:1]),
}


def chart_values(chart: Path, values: dict | None) -> dict:
    """values.yaml with `values` merged over it, as Helm does (maps merge, the rest replaces)."""
    def merge(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: merge(a.get(k), b[k]) if k in b else a[k] for k in {**a, **b}}
        return copy.deepcopy(b)
    return merge(yaml.safe_load((chart / "values.yaml").read_text()), values or {})


def admin_listen_port(gw: dict) -> int:
    host, port = flags(gw["args"])["admin-listen"].rsplit(":", 1)
    if host != "0.0.0.0":
        raise AssertionError(f"--admin-listen on {host}: a scrape from another pod cannot reach it")
    return int(port)


def check_admin_port(docs: list[dict], values: dict):
    """The Service has the `admin` port exactly when service.admin.enabled or
    serviceMonitor.enabled, on service.admin.port, to the admin container port."""
    svc = only(docs, "Service")
    _, _, _, containers = pod_parts(docs)
    admin = [p for p in svc["spec"]["ports"] if p["name"] == "admin"]
    wanted = values["service"]["admin"]["enabled"] or values["serviceMonitor"]["enabled"]
    if not wanted:
        if admin:
            raise AssertionError("the Service has an admin port nobody asked for")
        return "no admin port on the Service"
    if len(admin) != 1:
        raise AssertionError("no `admin` port on the Service")
    port = admin[0]
    cports = {p["name"]: p["containerPort"] for p in containers["mcp-reattach"]["ports"]}
    if port["port"] != values["service"]["admin"]["port"]:
        raise AssertionError(f"Service admin port {port['port']}, service.admin.port is "
                             f"{values['service']['admin']['port']}")
    if port["targetPort"] not in ("admin", cports["admin"]):
        raise AssertionError(f"Service admin port targets {port['targetPort']}, not the admin container port")
    if cports["admin"] != admin_listen_port(containers["mcp-reattach"]):
        raise AssertionError("the admin container port is not --admin-listen's")
    return f"Service port admin {port['port']} -> container port admin {cports['admin']}"


def check_monitors(docs: list[dict], values: dict):
    """A ServiceMonitor / PodMonitor exactly when enabled; it selects this release's Service /
    pods and scrapes GET /metrics over HTTP on the admin port, with the values' interval,
    scrapeTimeout and labels."""
    dep, tmpl, pod, containers = pod_parts(docs)
    svc = only(docs, "Service")
    gw = containers["mcp-reattach"]
    admin_port = admin_listen_port(gw)
    cports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    out = []
    for kind, key, endpoints in (("ServiceMonitor", "serviceMonitor", "endpoints"),
                                 ("PodMonitor", "podMonitor", "podMetricsEndpoints")):
        found = [d for d in docs if d["kind"] == kind]
        v = values[key]
        if not v["enabled"]:
            if found:
                raise AssertionError(f"a {kind} without {key}.enabled")
            continue
        if len(found) != 1:
            raise AssertionError(f"{key}.enabled but {len(found)} {kind}s rendered")
        mon = found[0]
        labels = mon["metadata"].get("labels", {})
        for k, val in v["labels"].items():
            if labels.get(k) != val:
                raise AssertionError(f"{kind} label {k}={labels.get(k)!r}, {key}.labels gives {val!r}")
        sel = mon["spec"]["selector"].get("matchLabels", {})
        if set(mon["spec"]["selector"]) != {"matchLabels"} or not sel:
            raise AssertionError(f"{kind} selector {mon['spec']['selector']}: expected matchLabels")
        target_labels = svc["metadata"].get("labels", {}) if kind == "ServiceMonitor" else tmpl["metadata"]["labels"]
        if any(target_labels.get(k) != val for k, val in sel.items()):
            raise AssertionError(f"{kind} selector {sel} does not match the "
                                 f"{'Service' if kind == 'ServiceMonitor' else 'pod'} labels {target_labels}")
        if kind == "PodMonitor" and any(dep["spec"]["selector"]["matchLabels"].get(k) != val
                                        for k, val in sel.items()):
            raise AssertionError(f"PodMonitor selector {sel} reaches beyond the Deployment's pods")
        eps = mon["spec"].get(endpoints, [])
        if len(eps) != 1:
            raise AssertionError(f"{kind}: expected one entry in {endpoints}")
        ep = eps[0]
        if ep.get("path") != "/metrics" or ep.get("scheme", "http") != "http":
            raise AssertionError(f"{kind} scrapes {ep.get('scheme')}://…{ep.get('path')}: the admin "
                                 "listener serves /metrics over plain HTTP")
        if kind == "ServiceMonitor":
            named = [p for p in svc["spec"]["ports"] if p["name"] == ep.get("port")]
            if not named:
                raise AssertionError(f"ServiceMonitor port {ep.get('port')!r} is not a Service port")
            target = named[0]["targetPort"]
            if target not in ("admin", cports["admin"]):
                raise AssertionError(f"ServiceMonitor port {ep['port']!r} leads to {target!r}, not the admin port")
        elif cports.get(ep.get("port")) != admin_port:
            raise AssertionError(f"PodMonitor port {ep.get('port')!r} is not the admin container port")
        for field in ("interval", "scrapeTimeout"):
            if ep.get(field, "") != v[field]:
                raise AssertionError(f"{kind} {field} {ep.get(field)!r}, {key}.{field} is {v[field]!r}")
        if ep.get("interval") and ep.get("scrapeTimeout") and \
                parse_duration(ep["scrapeTimeout"]) > parse_duration(ep["interval"]):
            raise AssertionError(f"{kind} scrapeTimeout above its interval (the operator rejects it)")
        out.append(f"{kind} -> {ep['port']} /metrics every {ep.get('interval') or 'global interval'}")
    return "; ".join(out) or "no monitors"


def _endpoint(docs, kind):
    mon = only(docs, kind)
    return mon["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"][0]


def _svc_ports(docs):
    return only(docs, "Service")["spec"]["ports"]


# Renders broken in one way each: check_monitors / check_admin_port must fail on every one.
SERVICE_MONITOR_BREAKS = {
    "the ServiceMonitor on the client port": lambda d: _endpoint(d, "ServiceMonitor").update(port="http-mcp"),
    "no admin port on the Service": lambda d: _svc_ports(d).pop(),
    "the Service admin port to the MCP server's port":
        lambda d: _svc_ports(d)[-1].update(targetPort=3000),
    "a ServiceMonitor selecting other Services":
        lambda d: only(d, "ServiceMonitor")["spec"]["selector"]["matchLabels"].update(app="other"),
    "the ServiceMonitor scraping /readyz": lambda d: _endpoint(d, "ServiceMonitor").update(path="/readyz"),
    "the ServiceMonitor scraping over https":
        lambda d: _endpoint(d, "ServiceMonitor").update(scheme="https"),
    "no interval": lambda d: _endpoint(d, "ServiceMonitor").pop("interval"),
    "no serviceMonitor.labels": lambda d: only(d, "ServiceMonitor")["metadata"]["labels"].pop("release"),
    "no ServiceMonitor": lambda d: d.remove(only(d, "ServiceMonitor")),
    "the admin listener on 127.0.0.1": lambda d: _container(d, "mcp-reattach").update(args=[
        a.replace("--admin-listen=0.0.0.0", "--admin-listen=127.0.0.1")
        for a in _container(d, "mcp-reattach")["args"]]),
}
POD_MONITOR_BREAKS = {
    "the PodMonitor on the client port": lambda d: _endpoint(d, "PodMonitor").update(port="mcp"),
    "a PodMonitor selecting other pods":
        lambda d: only(d, "PodMonitor")["spec"]["selector"]["matchLabels"].update(app="other"),
    "the PodMonitor scraping /healthz": lambda d: _endpoint(d, "PodMonitor").update(path="/healthz"),
    "an interval other than podMonitor.interval": lambda d: _endpoint(d, "PodMonitor").update(interval="5m"),
    "no PodMonitor": lambda d: d.remove(only(d, "PodMonitor")),
    "an admin port on the Service nobody asked for": lambda d: _svc_ports(d).append(
        {"name": "admin", "port": 9090, "targetPort": "admin", "protocol": "TCP"}),
}


def check_tls(docs: list[dict], values: dict):
    """tls.enabled: --tls-cert/--tls-key are tls.crt/tls.key of the tls.secretName Secret,
    mounted read-only as a directory (a subPath mount never sees a renewed Secret);
    tls.clientCa: --tls-client-ca likewise; the client port's appProtocol is https. Off: no
    TLS flag and appProtocol http."""
    _, _, pod, containers = pod_parts(docs)
    gw = containers["mcp-reattach"]
    f = flags(gw["args"])
    svc_port = [p for p in only(docs, "Service")["spec"]["ports"] if p["targetPort"] == "mcp"][0]
    tls = values["tls"]
    if not tls["enabled"]:
        if any(k.startswith("tls-") for k in f):
            raise AssertionError(f"TLS flags without tls.enabled: {[k for k in f if k.startswith('tls-')]}")
        if svc_port.get("appProtocol") != "http":
            raise AssertionError(f"client port appProtocol {svc_port.get('appProtocol')!r} without TLS")
        return "no TLS"
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = gw.get("volumeMounts", [])

    def secret_file(flag: str, secret: str, key: str):
        if flag not in f:
            raise AssertionError(f"tls: no --{flag}")
        path = Path(f[flag])
        found = [m for m in mounts if Path(m["mountPath"]) == path.parent]
        if len(found) != 1:
            raise AssertionError(f"--{flag}={path}: no volume mounted at {path.parent}")
        m = found[0]
        if not m.get("readOnly") or m.get("subPath") or m.get("subPathExpr"):
            raise AssertionError(f"--{flag}: mount {m['name']} must be read-only and without "
                                 "subPath (a subPath mount never sees a renewed Secret)")
        vol = volumes.get(m["name"], {})
        if vol.get("secret", {}).get("secretName") != secret:
            raise AssertionError(f"--{flag}: volume {m['name']} is not the Secret {secret!r}")
        items = {i["path"]: i["key"] for i in vol["secret"].get("items", [])}
        if items.get(path.name, path.name) != key:
            raise AssertionError(f"--{flag}={path}: not the Secret's {key!r}")

    secret_file("tls-cert", tls["secretName"], "tls.crt")
    secret_file("tls-key", tls["secretName"], "tls.key")
    ca = tls["clientCa"]
    if ca["secretName"]:
        secret_file("tls-client-ca", ca["secretName"], ca["key"])
    elif "tls-client-ca" in f:
        raise AssertionError("--tls-client-ca without tls.clientCa.secretName")
    if svc_port.get("appProtocol") != "https":
        raise AssertionError(f"client port appProtocol {svc_port.get('appProtocol')!r}: the port speaks TLS")
    return (f"--tls-cert/--tls-key from Secret {tls['secretName']}"
            + (f", --tls-client-ca from Secret {ca['secretName']}" if ca["secretName"] else ""))


def _tls_mount(d, name):
    return [m for m in _container(d, "mcp-reattach")["volumeMounts"] if m["name"] == name][0]


def _drop_arg(d, prefix):
    gw = _container(d, "mcp-reattach")
    gw["args"] = [a for a in gw["args"] if not a.startswith(prefix)]


def _replace_arg(d, prefix, new):
    gw = _container(d, "mcp-reattach")
    gw["args"] = [new if a.startswith(prefix) else a for a in gw["args"]]


# Renders with TLS broken in one way each: check_tls (or check_pod) must fail on every one.
TLS_BREAKS = {
    "no --tls-cert": lambda d: _drop_arg(d, "--tls-cert="),
    "no --tls-client-ca": lambda d: _drop_arg(d, "--tls-client-ca="),
    "--tls-key pointing at the certificate":
        lambda d: _replace_arg(d, "--tls-key=", "--tls-key=/etc/mcp-reattach/tls/tls.crt"),
    "--tls-cert outside the mounted Secret":
        lambda d: _replace_arg(d, "--tls-cert=", "--tls-cert=/etc/tls/tls.crt"),
    "a writable Secret mount": lambda d: _tls_mount(d, "tls").pop("readOnly"),
    "a subPath mount of the key": lambda d: _tls_mount(d, "tls").update(subPath="tls.key"),
    "another Secret": lambda d: [v for v in _pod(d)["volumes"] if v["name"] == "tls"][0]
    ["secret"].update(secretName="other"),
    "the client port still appProtocol http": lambda d: _svc_ports(d)[0].update(appProtocol="http"),
    "an HTTPS readiness probe": lambda d: _container(d, "mcp-reattach")["readinessProbe"]
    ["httpGet"].update(scheme="HTTPS"),
}


def tls_and_pod(docs: list[dict], values: dict):
    check_pod(docs)
    return check_tls(docs, values)


def _server_probe(d, probe):
    return _container(d, "mcp-server")[probe]


# Renders whose MCP server probes are broken: check_pod must fail on every one.
SERVER_PROBE_BREAKS = {
    "no MCP server readinessProbe": lambda d: _container(d, "mcp-server").pop("readinessProbe"),
    "no MCP server livenessProbe": lambda d: _container(d, "mcp-server").pop("livenessProbe"),
    "an httpGet readiness probe on the server's port (the pod IP)":
        lambda d: _container(d, "mcp-server").update(
            readinessProbe={"httpGet": {"path": "/", "port": int(_container(d, "mcp-reattach")
                                                               ["args"][0].rsplit(":", 1)[1])}}),
    "a tcpSocket liveness probe": lambda d: _container(d, "mcp-server").update(
        livenessProbe={"tcpSocket": {"port": 3000}}),
    "a liveness probe on another port than --upstream's": lambda d: _server_probe(d, "livenessProbe")
    ["exec"].update(command=[re.sub(r"\b3[01]00\b", "3999", w)
                             for w in _server_probe(d, "livenessProbe")["exec"]["command"]]),
}


# ---------------------------------------------------------------------------------------------
# The fleet's store (--store): the chart's store.* values and the gateway-tier example
# ---------------------------------------------------------------------------------------------

STORE_ENV = ("MCP_REATTACH_STORE", "MCP_REATTACH_STORE_KEY_FILE", "MCP_REATTACH_STORE_TIMEOUT",
             "MCP_REATTACH_STORE_DRAIN_TIMEOUT")
MIN_STORE_KEY_BYTES = 32  # src/config.rs


def secret_file(pod: dict, container: dict, path_str: str, what: str) -> tuple[str, str]:
    """(Secret name, key) of the file `path_str` in `container`: a Secret volume mounted
    read-only as a directory (a subPath mount never sees a new Secret), projecting the file."""
    path = Path(path_str)
    found = [m for m in container.get("volumeMounts", []) if Path(m["mountPath"]) == path.parent]
    if len(found) != 1:
        raise AssertionError(f"{what}={path}: no volume mounted at {path.parent}")
    m = found[0]
    if not m.get("readOnly") or m.get("subPath") or m.get("subPathExpr"):
        raise AssertionError(f"{what}: mount {m['name']} must be read-only and without subPath")
    vol = {v["name"]: v for v in pod.get("volumes", [])}.get(m["name"], {})
    sec = vol.get("secret")
    if not sec:
        raise AssertionError(f"{what}: volume {m['name']} is not a Secret")
    items = sec.get("items")
    if items is None:
        return sec["secretName"], path.name
    keys = [i["key"] for i in items if i["path"] == path.name]
    if not keys:
        raise AssertionError(f"{what}={path}: the volume projects no {path.name!r} "
                             f"(items {[i['path'] for i in items]})")
    return sec["secretName"], keys[0]


def store_settings(gw: dict) -> dict[str, dict]:
    """The store's settings of an mcp-reattach container, by variable name, each as its env
    entry; --store and --store-key-file are refused as flags (they would silently win over
    the environment, and a URL in args shows in every process listing)."""
    f = flags(gw["args"])
    for flag in ("store", "store-key-file"):
        if flag in f:
            raise AssertionError(f"--{flag} in args: give it as {STORE_ENV[0 if flag == 'store' else 1]} "
                                 "(a URL may hold a password)")
    env = [e for e in gw.get("env", []) if e["name"] in STORE_ENV]
    names = [e["name"] for e in env]
    if len(set(names)) != len(names):
        raise AssertionError(f"store variables given twice: {names}")
    return {e["name"]: e for e in env}


def key_secret_mounted_only_in_gateway(pod: dict, secret: str):
    for c in pod["containers"]:
        if c["name"] == "mcp-reattach":
            continue
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            if vols.get(m["name"], {}).get("secret", {}).get("secretName") == secret:
                raise AssertionError(f"container {c['name']} mounts the fleet's key Secret {secret!r}")


def check_store(docs: list[dict], values: dict):
    """store.url or store.existingSecret: MCP_REATTACH_STORE is the URL (a plain value, or a
    secretKeyRef to existingSecret/urlKey), MCP_REATTACH_STORE_KEY_FILE is keySecretKey of the
    Secret keySecret mounted read-only without subPath in the gateway only, and
    MCP_REATTACH_STORE_TIMEOUT is store.timeout. Without a store URL: none of them and no key
    volume."""
    _, _, pod, containers = pod_parts(docs)
    gw = containers["mcp-reattach"]
    env = store_settings(gw)
    s = values["store"]
    if not (s["url"] or s["existingSecret"]):
        if env or any(v["name"] == "store-key" for v in pod.get("volumes", [])):
            raise AssertionError(f"store settings without a store URL: {sorted(env)}")
        return "no store"
    missing = [n for n in STORE_ENV if n not in env]
    if missing:
        raise AssertionError(f"a store URL but no {missing}")
    url = env["MCP_REATTACH_STORE"]
    if s["existingSecret"]:
        ref = url.get("valueFrom", {}).get("secretKeyRef")
        if "value" in url or ref != {"name": s["existingSecret"], "key": s["urlKey"]}:
            raise AssertionError(f"MCP_REATTACH_STORE is {url}, not the Secret "
                                 f"{s['existingSecret']}/{s['urlKey']}")
        origin = f"Secret {s['existingSecret']}/{s['urlKey']}"
    else:
        if url.get("value") != s["url"] or "valueFrom" in url:
            raise AssertionError(f"MCP_REATTACH_STORE is {url}, store.url is {s['url']!r}")
        origin = "store.url"
    key_file = env["MCP_REATTACH_STORE_KEY_FILE"].get("value", "")
    got = secret_file(pod, gw, key_file, "MCP_REATTACH_STORE_KEY_FILE")
    if got != (s["keySecret"], s["keySecretKey"]):
        raise AssertionError(f"MCP_REATTACH_STORE_KEY_FILE is {got[0]}/{got[1]}, the values give "
                             f"{s['keySecret']}/{s['keySecretKey']}")
    key_secret_mounted_only_in_gateway(pod, s["keySecret"])
    timeout = env["MCP_REATTACH_STORE_TIMEOUT"].get("value")
    if timeout != s["timeout"]:
        raise AssertionError(f"MCP_REATTACH_STORE_TIMEOUT {timeout!r}, store.timeout is {s['timeout']!r}")
    handover = env["MCP_REATTACH_STORE_DRAIN_TIMEOUT"].get("value")
    if handover != f"{s['drainTimeoutSeconds']}s":
        raise AssertionError(f"MCP_REATTACH_STORE_DRAIN_TIMEOUT {handover!r}, store.drainTimeoutSeconds "
                             f"is {s['drainTimeoutSeconds']}")
    return (f"--store from {origin}, --store-key-file {key_file} from Secret "
            f"{s['keySecret']}/{s['keySecretKey']}, --store-timeout {timeout}, "
            f"--store-drain-timeout {handover}")


def check_admin_token(docs: list[dict], values: dict):
    """admin.tokenSecret: MCP_REATTACH_ADMIN_TOKEN_FILE is tokenSecretKey of that Secret,
    mounted read-only without subPath in the gateway only, and MCP_REATTACH_ADMIN_TOKEN_FOR_READS
    is admin.tokenForReads. Without it: neither variable and no token volume."""
    _, _, pod, containers = pod_parts(docs)
    gw = containers["mcp-reattach"]
    env = {e["name"]: e for e in gw.get("env", []) if e["name"].startswith("MCP_REATTACH_ADMIN_TOKEN")}
    a = values["admin"]
    if not a["tokenSecret"]:
        if env or any(v["name"] == "admin-token" for v in pod.get("volumes", [])):
            raise AssertionError(f"admin token settings without admin.tokenSecret: {sorted(env)}")
        return "no admin token (ending sessions on the admin port refused)"
    if "MCP_REATTACH_ADMIN_TOKEN_FILE" not in env:
        raise AssertionError("admin.tokenSecret but no MCP_REATTACH_ADMIN_TOKEN_FILE")
    token_file = env["MCP_REATTACH_ADMIN_TOKEN_FILE"].get("value", "")
    got = secret_file(pod, gw, token_file, "MCP_REATTACH_ADMIN_TOKEN_FILE")
    if got != (a["tokenSecret"], a["tokenSecretKey"]):
        raise AssertionError(f"MCP_REATTACH_ADMIN_TOKEN_FILE is {got[0]}/{got[1]}, the values give "
                             f"{a['tokenSecret']}/{a['tokenSecretKey']}")
    key_secret_mounted_only_in_gateway(pod, a["tokenSecret"])
    reads = env.get("MCP_REATTACH_ADMIN_TOKEN_FOR_READS", {}).get("value")
    if reads != str(a["tokenForReads"]).lower():
        raise AssertionError(f"MCP_REATTACH_ADMIN_TOKEN_FOR_READS {reads!r}, admin.tokenForReads "
                             f"is {a['tokenForReads']!r}")
    return f"--admin-token-file {token_file} from Secret {got[0]}/{got[1]}, for reads too: {reads}"


def _env(d, name):
    return [e for e in _container(d, "mcp-reattach")["env"] if e["name"] == name][0]


def _store_mount(d):
    return [m for m in _container(d, "mcp-reattach")["volumeMounts"] if m["name"] == "store-key"][0]


def _store_volume(d):
    return [v for v in _pod(d)["volumes"] if v["name"] == "store-key"][0]


def _admin_token_mount(d):
    return [m for m in _container(d, "mcp-reattach")["volumeMounts"] if m["name"] == "admin-token"][0]


# Renders with the admin token broken in one way each: check_admin_token must fail on every one.
ADMIN_TOKEN_BREAKS = {
    "no MCP_REATTACH_ADMIN_TOKEN_FILE": lambda d: _container(d, "mcp-reattach").update(env=[
        e for e in _container(d, "mcp-reattach")["env"] if e["name"] != "MCP_REATTACH_ADMIN_TOKEN_FILE"]),
    "the token file outside its mount": lambda d: _env(d, "MCP_REATTACH_ADMIN_TOKEN_FILE").update(
        value="/etc/mcp-reattach/token"),
    "the token mount writable": lambda d: _admin_token_mount(d).update(readOnly=False),
    "reads open though tokenForReads": lambda d: _env(d, "MCP_REATTACH_ADMIN_TOKEN_FOR_READS").update(
        value="false"),
}


# Renders with the store broken in one way each: check_store (or check_pod) must fail on every one.
STORE_BREAKS = {
    "no MCP_REATTACH_STORE": lambda d: _container(d, "mcp-reattach").update(env=[
        e for e in _container(d, "mcp-reattach")["env"] if e["name"] != "MCP_REATTACH_STORE"]),
    "the URL from another key of the Secret": lambda d: _env(d, "MCP_REATTACH_STORE")["valueFrom"]
    ["secretKeyRef"].update(key="other"),
    "the URL as a plain value beside the Secret": lambda d: _env(d, "MCP_REATTACH_STORE")
    .update(value="redis://redis:6379"),
    "the URL in args (--store)": lambda d: _container(d, "mcp-reattach")["args"].append(
        "--store=redis://redis:6379"),
    "the key file outside the mounted Secret": lambda d: _env(d, "MCP_REATTACH_STORE_KEY_FILE")
    .update(value="/etc/mcp-reattach/key"),
    "the key file named after another item": lambda d: _env(d, "MCP_REATTACH_STORE_KEY_FILE")
    .update(value="/etc/mcp-reattach/store-key/secret"),
    "a writable key mount": lambda d: _store_mount(d).pop("readOnly"),
    "a subPath key mount": lambda d: _store_mount(d).update(subPath="fleet-key"),
    "the key from another Secret": lambda d: _store_volume(d)["secret"].update(secretName="other"),
    "the key Secret mounted in the MCP server too": lambda d: _container(d, "mcp-server")
    ["volumeMounts"].append({"name": "store-key", "mountPath": "/etc/store-key", "readOnly": True}),
    "another store timeout": lambda d: _env(d, "MCP_REATTACH_STORE_TIMEOUT").update(value="1s"),
    "another store drain timeout": lambda d: _env(d, "MCP_REATTACH_STORE_DRAIN_TIMEOUT").update(value="30s"),
    "a grace period without the store's hand-over": lambda d: _pod(d).update(
        terminationGracePeriodSeconds=40),
    "the MCP server's preStop ending before the hand-over": lambda d: _container(d, "mcp-server")
    ["lifecycle"]["preStop"]["sleep"].update(seconds=30),
    "a memory limit without room for the store's queue": lambda d: _container(d, "mcp-reattach")
    ["resources"]["limits"].update(memory="490Mi"),
}


def store_and_pod(docs: list[dict], values: dict):
    check_pod(docs)
    return check_store(docs, values)


def secret_value(secret: dict, key: str) -> str | None:
    import base64

    if key in secret.get("stringData", {}):
        return secret["stringData"][key]
    if key in secret.get("data", {}):
        return base64.b64decode(secret["data"][key]).decode("utf-8", "replace")
    return None


def redis_options(container: dict) -> dict[str, str]:
    """`--name value` pairs of a redis-server command line (the official image's entrypoint
    prepends redis-server to arguments starting with --)."""
    words = list(container.get("command", [])) + list(container.get("args", []))
    if words and words[0] in ("redis-server", "valkey-server"):
        words = words[1:]
    out, i = {}, 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--"):
            raise AssertionError(f"redis option {w!r}: expected --name value")
        if i + 1 >= len(words) or words[i + 1].startswith("--"):
            raise AssertionError(f"redis option {w} has no value")
        out[w[2:]] = words[i + 1]
        i += 2
    return out


def redis_bytes(v: str) -> int:
    """A Redis memory value: 1k = 1000, 1kb = 1024, likewise m/mb and g/gb."""
    m = re.fullmatch(r"(\d+)(k|kb|m|mb|g|gb)?", v.strip().lower())
    if not m:
        raise AssertionError(f"not a Redis memory value: {v!r}")
    return int(m.group(1)) * {None: 1, "k": 10**3, "kb": 1 << 10, "m": 10**6, "mb": 1 << 20,
                              "g": 10**9, "gb": 1 << 30}[m.group(2)]


def check_gateway_tier(docs: list[dict]):
    """deploy/kubernetes/gateway-tier: mcp-reattach replicas (no sidecar) with --store behind a
    Service without affinity, their --upstream the Service of the MCP server's Deployment, the
    store URL the Service of a single Redis that evicts nothing, keeps nothing on disk and
    stops below its memory limit, the key file from the shipped Secret (a placeholder too short
    to start a fleet), and a NetworkPolicy (if any) that lets the gateways reach Redis."""
    from urllib.parse import urlsplit

    def of(kind):
        return [d for d in docs if d["kind"] == kind]

    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    if len(namespaces) != 1:
        raise AssertionError(f"objects in several namespaces: {namespaces}")
    ns = namespaces.pop()

    def template_labels(dep):
        return dep["spec"]["template"]["metadata"].get("labels", {})

    def matches(selector: dict, labels: dict) -> bool:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    def backends(svc) -> list[dict]:
        return [d for d in of("Deployment") if matches(svc["spec"].get("selector", {}), template_labels(d))]

    def service_of(url: str, what: str) -> tuple[dict, dict, dict]:
        """The Service a URL's host names (name, name.ns, name.ns.svc[.cluster.local]), its
        port, and the one Deployment behind it."""
        u = urlsplit(url)
        parts = (u.hostname or "").split(".")
        if len(parts) > 1 and (parts[1] != ns or parts[2:] not in ([], ["svc"], ["svc", "cluster", "local"])):
            raise AssertionError(f"{what} {u.hostname}: not a Service of namespace {ns}")
        svcs = [s for s in of("Service") if s["metadata"]["name"] == parts[0]]
        if len(svcs) != 1:
            raise AssertionError(f"{what} {u.hostname}: no such Service in the example")
        svc = svcs[0]
        port = u.port or {"http": 80, "https": 443}.get(u.scheme)
        sports = [p for p in svc["spec"]["ports"] if p["port"] == port]
        if not sports:
            raise AssertionError(f"{what}: Service {svc['metadata']['name']} has no port {port}")
        deps = backends(svc)
        if len(deps) != 1:
            raise AssertionError(f"{what}: Service {svc['metadata']['name']} selects "
                                 f"{[d['metadata']['name'] for d in deps]}, expected one Deployment")
        target = sports[0]["targetPort"]
        cports = [p for c in deps[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
        if not any(target in (p.get("name"), p["containerPort"]) for p in cports):
            raise AssertionError(f"{what}: Service port {port} targets {target!r}, not a container "
                                 f"port of {deps[0]['metadata']['name']}")
        return svc, sports[0], deps[0]

    tier = [d for d in of("Deployment")
            if any(c["name"] == "mcp-reattach" for c in d["spec"]["template"]["spec"]["containers"])]
    if len(tier) != 1:
        raise AssertionError(f"expected one Deployment of mcp-reattach, found {len(tier)}")
    dep = tier[0]
    pod = dep["spec"]["template"]["spec"]
    if [c["name"] for c in pod["containers"]] != ["mcp-reattach"]:
        raise AssertionError(f"the gateway pod runs {[c['name'] for c in pod['containers']]}: "
                             "mcp-reattach alone (the MCP server is its own Deployment)")
    gw = pod["containers"][0]
    f, ports, drain, grace, need = check_gateway(pod, gw)
    if dep["spec"].get("replicas", 1) < 2:
        raise AssertionError(f"replicas {dep['spec'].get('replicas', 1)}: a tier of one shares nothing")
    labels = template_labels(dep)

    # The clients' Service: the gateways only, the client port, no affinity.
    front = [s for s in of("Service") if matches(s["spec"].get("selector", {}), labels)]
    if len(front) != 1:
        raise AssertionError(f"expected one Service over the gateways, found {len(front)}")
    svc = front[0]
    if [d["metadata"]["name"] for d in backends(svc)] != [dep["metadata"]["name"]]:
        raise AssertionError(f"the gateways' Service also selects {[d['metadata']['name'] for d in backends(svc)]}")
    targets = [p["targetPort"] for p in svc["spec"]["ports"]]
    if sum(t in ("mcp", ports["mcp"]) for t in targets) != 1 or any(
            t not in ("mcp", ports["mcp"], "admin", ports["admin"]) for t in targets):
        raise AssertionError(f"the gateways' Service targets {targets}: the client port once, the admin port at most")
    if svc["spec"].get("sessionAffinity", "None") != "None":
        raise AssertionError(f"the gateways' Service has sessionAffinity {svc['spec']['sessionAffinity']}: "
                             "with the store none is needed in front of a stateless server")

    # The upstream: another Deployment's Service.
    up = urlsplit(f["upstream"])
    if up.scheme not in ("http", "https"):
        raise AssertionError(f"--upstream {f['upstream']}: not http(s)")
    _, _, server = service_of(f["upstream"], "--upstream")
    if server is dep:
        raise AssertionError("--upstream leads back to the gateways")

    # The store.
    env = store_settings(gw)
    missing = [n for n in STORE_ENV[:2] if n not in env]
    if missing:
        raise AssertionError(f"no {missing}: the tier shares nothing")
    url_env = env["MCP_REATTACH_STORE"]
    if "value" in url_env:
        url = url_env["value"]
    else:
        ref = url_env.get("valueFrom", {}).get("secretKeyRef", {})
        secrets = [s for s in of("Secret") if s["metadata"]["name"] == ref.get("name")]
        url = secret_value(secrets[0], ref.get("key")) if secrets else None
        if url is None:
            raise AssertionError(f"MCP_REATTACH_STORE from {ref}: no such Secret key in the example")
    if urlsplit(url).scheme not in ("redis", "valkey"):
        raise AssertionError(f"the store URL's scheme {urlsplit(url).scheme!r}: redis:// or valkey://")
    _, rport, redis = service_of(url, "the store URL")
    if redis is dep or redis is server:
        raise AssertionError("the store URL leads to the gateways or the MCP server")
    if redis["spec"].get("replicas", 1) != 1:
        raise AssertionError(f"Redis replicas {redis['spec'].get('replicas')}: independent Redis "
                             "pods behind one Service are separate stores")
    rc = redis["spec"]["template"]["spec"]["containers"]
    if len(rc) != 1:
        raise AssertionError("the Redis pod: one container expected")
    opts = redis_options(rc[0])
    if opts.get("maxmemory-policy") != "noeviction":
        raise AssertionError(f"Redis maxmemory-policy {opts.get('maxmemory-policy')!r}: noeviction "
                             "(an evicted key is a hole in a stream)")
    if opts.get("save") != "" or opts.get("appendonly", "no") != "no":
        raise AssertionError(f"Redis persistence: --save {opts.get('save')!r} --appendonly "
                             f"{opts.get('appendonly')!r}; expected --save \"\" and no appendonly")
    if "maxmemory" not in opts:
        raise AssertionError("Redis without --maxmemory: it grows until the kernel kills it")
    rlimit = k8s_quantity(rc[0]["resources"]["limits"]["memory"])
    if redis_bytes(opts["maxmemory"]) >= rlimit:
        raise AssertionError(f"Redis --maxmemory {opts['maxmemory']} is not below its memory "
                             f"limit {rc[0]['resources']['limits']['memory']}")

    # The key: the shipped Secret, a placeholder that cannot start a fleet.
    key_file = env["MCP_REATTACH_STORE_KEY_FILE"].get("value", "")
    secret_name, key = secret_file(pod, gw, key_file, "MCP_REATTACH_STORE_KEY_FILE")
    secrets = [s for s in of("Secret") if s["metadata"]["name"] == secret_name]
    if not secrets:
        raise AssertionError(f"the key Secret {secret_name!r} is not in the example")
    value = secret_value(secrets[0], key)
    if value is None:
        raise AssertionError(f"the key Secret {secret_name} has no {key!r}")
    if len(value.strip().encode()) >= MIN_STORE_KEY_BYTES:
        raise AssertionError(f"the shipped key Secret holds {len(value.strip())} bytes: a usable key "
                             "that every copy of the example would share; ship a placeholder "
                             f"shorter than {MIN_STORE_KEY_BYTES} bytes (the gateways then refuse to start)")
    if "MCP_REATTACH_STORE_TIMEOUT" in env and parse_duration(env["MCP_REATTACH_STORE_TIMEOUT"]["value"]) <= 0:
        raise AssertionError("MCP_REATTACH_STORE_TIMEOUT must be positive")

    # A NetworkPolicy over Redis must let the gateways in on the Redis port.
    rlabels = template_labels(redis)
    rtarget = rport["targetPort"]
    policies = [p for p in of("NetworkPolicy") if matches(p["spec"]["podSelector"].get("matchLabels", {}), rlabels)]
    for pol in policies:
        ok = False
        for rule in pol["spec"].get("ingress", []):
            peers = rule.get("from", [])
            lets_in = not peers or any(
                "podSelector" in p and "namespaceSelector" not in p
                and all(labels.get(k) == v for k, v in p["podSelector"].get("matchLabels", {}).items())
                for p in peers)
            on_port = not rule.get("ports") or any(
                p.get("port") in (rtarget, rport["port"]) or p.get("port") in
                [cp.get("name") for cp in rc[0].get("ports", []) if cp["containerPort"] == rport["port"]]
                for p in rule["ports"])
            ok = ok or (lets_in and on_port)
        if not ok:
            raise AssertionError(f"NetworkPolicy {pol['metadata']['name']} keeps the gateways out of Redis")
    return (f"{dep['spec']['replicas']} gateways -> {f['upstream']} ({server['metadata']['name']}), "
            f"grace {grace}s for a {drain:g}s drain and hand-over; "
            f"store {redis['metadata']['name']} (noeviction, no persistence, maxmemory "
            f"{opts['maxmemory']}); key {secret_name}/{key}; {need / (1 << 20):.0f} MiB needed, "
            f"limit {gw['resources']['limits']['memory']}; {len(policies)} NetworkPolicy")


def _obj(d, kind, name):
    return [o for o in d if o["kind"] == kind and o["metadata"]["name"] == name][0]


def _tier_gw(d):
    return _obj(d, "Deployment", "mcp-reattach")["spec"]["template"]["spec"]["containers"][0]


def _tier_env(d, name):
    return [e for e in _tier_gw(d)["env"] if e["name"] == name][0]


def _redis(d):
    return _obj(d, "Deployment", "mcp-reattach-redis")["spec"]["template"]["spec"]["containers"][0]


def _redis_opt(d, name, value):
    args = _redis(d)["args"]
    args[args.index(f"--{name}") + 1] = value


# Copies of the gateway tier broken in one way each: check_gateway_tier must fail on every one.
GATEWAY_TIER_BREAKS = {
    "a sticky Service (sessionAffinity ClientIP)": lambda d: _obj(d, "Service", "mcp-reattach")
    ["spec"].update(sessionAffinity="ClientIP"),
    "one replica": lambda d: _obj(d, "Deployment", "mcp-reattach")["spec"].update(replicas=1),
    "a sidecar's --upstream (127.0.0.1)": lambda d: _tier_gw(d).update(args=[
        "--upstream=http://127.0.0.1:3000" if a.startswith("--upstream=") else a for a in _tier_gw(d)["args"]]),
    "--upstream on a port the server's Service lacks": lambda d: _tier_gw(d).update(args=[
        "--upstream=http://mcp-server:8080" if a.startswith("--upstream=") else a for a in _tier_gw(d)["args"]]),
    "the server's Service selecting the gateways": lambda d: _obj(d, "Service", "mcp-server")["spec"]
    .update(selector=dict(_obj(d, "Service", "mcp-reattach")["spec"]["selector"])),
    "no MCP_REATTACH_STORE": lambda d: _tier_gw(d).update(env=[
        e for e in _tier_gw(d)["env"] if e["name"] != "MCP_REATTACH_STORE"]),
    "the store URL on another port": lambda d: _tier_env(d, "MCP_REATTACH_STORE")
    .update(value="redis://mcp-reattach-redis:6380/0"),
    "the store URL naming no Service": lambda d: _tier_env(d, "MCP_REATTACH_STORE")
    .update(value="redis://redis:6379/0"),
    "the store URL in args": lambda d: _tier_gw(d)["args"].append("--store=redis://mcp-reattach-redis:6379"),
    "Redis evicting keys (allkeys-lru)": lambda d: _redis_opt(d, "maxmemory-policy", "allkeys-lru"),
    "Redis saving snapshots": lambda d: _redis_opt(d, "save", "3600 1"),
    "Redis with an append-only file": lambda d: _redis_opt(d, "appendonly", "yes"),
    "Redis maxmemory above its memory limit": lambda d: _redis_opt(d, "maxmemory", "2gb"),
    "two Redis replicas": lambda d: _obj(d, "Deployment", "mcp-reattach-redis")["spec"].update(replicas=2),
    "the key file outside the mounted Secret": lambda d: _tier_env(d, "MCP_REATTACH_STORE_KEY_FILE")
    .update(value="/etc/mcp-reattach/key"),
    "a writable key mount": lambda d: _tier_gw(d)["volumeMounts"][0].pop("readOnly"),
    "a key Secret the example does not ship": lambda d: _obj(d, "Deployment", "mcp-reattach")["spec"]
    ["template"]["spec"]["volumes"][0]["secret"].update(secretName="other"),
    "a usable key in the shipped Secret": lambda d: _obj(d, "Secret", "mcp-reattach-store-key")
    .update(stringData={"key": "q2Vh0jv7rX8mJm3yWf9eQk1V1z8m0dZ6b1g0o7c1Xh8="}),
    "a NetworkPolicy that lets other pods in, not the gateways": lambda d: _obj(d, "NetworkPolicy", "mcp-reattach-redis")
    ["spec"]["ingress"][0]["from"][0]["podSelector"].update(matchLabels={"app": "other"}),
    "a memory limit without room for the store's queue": lambda d: _tier_gw(d)["resources"]["limits"]
    .update(memory="490Mi"),
    "a grace period shorter than the drain": lambda d: _obj(d, "Deployment", "mcp-reattach")["spec"]
    ["template"]["spec"].update(terminationGracePeriodSeconds=20),
    "a grace period without the store's hand-over": lambda d: _obj(d, "Deployment", "mcp-reattach")
    ["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=40),
    "a longer store drain timeout than the grace period covers": lambda d: _tier_env(
        d, "MCP_REATTACH_STORE_DRAIN_TIMEOUT").update(value="2m"),
}


def gateway_tier_explains_key(tier: Path):
    """The shipped key Secret says how to make a real key."""
    text = (tier / "store-key-secret.yaml").read_text()
    if "head -c 32 /dev/urandom | base64" not in text:
        raise AssertionError("store-key-secret.yaml does not say how to generate the key "
                             "(head -c 32 /dev/urandom | base64)")


def monitors_checked(docs: list[dict], values: dict):
    return f"{check_admin_port(docs, values)}; {check_monitors(docs, values)}"


def helm_render_fails(chart: Path, values: dict, message: str):
    try:
        helm_render(chart, values)
    except Exception as e:  # noqa: BLE001 - the point is that it fails
        if message not in str(e):
            raise AssertionError(f"failed, but not with {message!r}: {e}") from None
        return
    raise AssertionError(f"rendered with {values}")


def replicas_comment_names_stickiness(chart: Path):
    """values.yaml says, above replicaCount, what several replicas need (issue: a plain
    Service and no word of it) and where the load-balancer examples are."""
    lines = (chart / "values.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("replicaCount:"))
    block = []
    for line in reversed(lines[:at]):
        if not line.startswith("#"):
            break
        block.insert(0, line)
    text = " ".join(block)
    for needed in ("Mcp-Session-Id", "deploy/loadbalancers/README.md", "docs/operations.md",
                   "sessionAffinity", "initialize"):
        if needed not in text:
            raise AssertionError(f"the comment above replicaCount does not mention {needed}")
    if not (REPO / "deploy" / "loadbalancers" / "README.md").exists():
        raise AssertionError("deploy/loadbalancers/README.md is gone")


# Values the chart's schema must refuse (it is strict: a misspelt key is an error).
SCHEMA_REJECTS = {
    "an unknown top-level key (nodeselector)": {"nodeselector": {"kubernetes.io/os": "linux"}},
    "an unknown gateway key (extraArg)": {"gateway": {"extraArg": ["--retry-hint=2s"]}},
    "an imagePullSecrets entry without name": {"imagePullSecrets": [{"secret": "x"}]},
    "a gateway.extraEnv entry without name": {"gateway": {"extraEnv": [{"value": "x"}]}},
    "a volume mount without mountPath": {"gateway": {"extraVolumeMounts": [{"name": "x"}]}},
    "serviceAccount.automount=\"no\"": {"serviceAccount": {"automount": "no"}},
    "a podLabels value that is a number": {"podLabels": {"tier": 1}},
    "serviceMonitor.interval=30 (no unit)": {"serviceMonitor": {"interval": "30"}},
    "podMonitor.enabled=\"yes\"": {"podMonitor": {"enabled": "yes"}},
    "service.admin.port=0": {"service": {"admin": {"port": 0}}},
    "service.sessionAffinity=Sticky": {"service": {"sessionAffinity": "Sticky"}},
    "tls.enabled without tls.secretName": {"tls": {"enabled": True}},
    "tls.clientCa without tls.enabled": {"tls": {"clientCa": {"secretName": "clients-ca"}}},
    "a probe with a misspelt field (periodSecond)": {"mcpServer": {"readinessProbe": {"periodSecond": 5}}},
    "store.url=http://redis:6379 (not redis://)": {"store": {"url": "http://redis:6379", "keySecret": "k"}},
    "store.timeout=100 (no unit)": {"store": {"timeout": "100"}},
    "store.timeout=0s (must be positive)": {"store": {"timeout": "0s"}},
    "an unknown store key (keyFile)": {"store": {"keyFile": "/etc/key"}},
    "store.keySecretKey with a slash": {"store": {"keySecretKey": "a/b"}},
}

# Store values the chart must refuse to render, with the message it must give.
STORE_RENDER_FAILS = {
    "a store URL without store.keySecret": ({"store": {"url": "redis://redis:6379/0"}}, "needs store.keySecret"),
    "a store Secret without store.keySecret": ({"store": {"existingSecret": "store"}}, "needs store.keySecret"),
    "store.url and store.existingSecret together": (
        {"store": {"url": "redis://redis:6379", "existingSecret": "store", "keySecret": "k"}}, "one way"),
    "store.keySecret without a store": ({"store": {"keySecret": "k"}}, "without a store"),
}

# The other way to give the URL (ci/store-values.yaml takes it from a Secret).
STORE_PLAIN_URL = {"store": {"url": "redis://mcp-reattach-redis:6379/0", "keySecret": "mcp-reattach-store-key",
                             "timeout": "250ms"}}


def store_url_from_secret(values: dict):
    s = values["store"]
    if not (s["existingSecret"] and s["urlKey"] and s["keySecret"]):
        raise AssertionError("set store.existingSecret, store.urlKey and store.keySecret, so the "
                             "secretKeyRef path is the one checked")


def plain_store_url(chart: Path):
    docs = helm_render(chart, STORE_PLAIN_URL)
    check_pod(docs)
    return check_store(docs, chart_values(chart, STORE_PLAIN_URL))


def main() -> int:
    sets: dict[str, list[dict]] = {}
    base = DEPLOY / "kubernetes" / "base"
    overlay = DEPLOY / "kubernetes" / "overlays" / "example"
    tier = DEPLOY / "kubernetes" / "gateway-tier"
    chart = DEPLOY / "helm" / "mcp-reattach"
    how = "pykustomize, same as kubectl kustomize" if shutil.which("kubectl") else "pykustomize"
    sets["kustomize base"] = check(f"kustomize build {rel(base)} ({how})", kustomize, base) or []
    sets["kustomize overlay"] = (
        check(f"kustomize build {rel(overlay)} ({how})", kustomize, overlay) or []
    )
    # The gateway tier is not a sidecar pod: it has checks of its own (check_gateway_tier).
    tier_docs = check(f"kustomize build {rel(tier)} ({how})", kustomize, tier) or []
    check(f"helm lint --strict {rel(chart)}", helm_lint, chart)
    sets["helm defaults"] = check(f"helm template {rel(chart)}", helm_render, chart, None) or []
    for vf in sorted((chart / "ci").glob("*-values.yaml")):
        values = yaml.safe_load(vf.read_text())
        sets[f"helm {vf.name}"] = (
            check(f"helm template {rel(chart)} -f {rel(vf)}", helm_render, chart, values) or []
        )
    check("helm values.schema.json rejects logFormat=xml", helm_rejects, chart,
          {"gateway": {"logFormat": "xml"}})
    check("helm values.schema.json rejects a bare extraArgs word", helm_rejects, chart,
          {"gateway": {"extraArgs": ["retry-hint=2s"]}})
    check("helm values.schema.json rejects prometheusRule.enabled=\"yes\"", helm_rejects, chart,
          {"prometheusRule": {"enabled": "yes"}})
    for what, bad in SCHEMA_REJECTS.items():
        check(f"helm values.schema.json rejects {what}", helm_rejects, chart, bad)
    if sets["helm defaults"]:
        check("helm defaults render only a Deployment, a Service and a PDB (no ServiceAccount, "
              "PrometheusRule, dashboard, monitor)", options_off_by_default, sets["helm defaults"])
    check("values.yaml says above replicaCount what stickiness several replicas need",
          replicas_comment_names_stickiness, chart)
    knob_values = yaml.safe_load((chart / "ci" / "knobs-values.yaml").read_text())
    check("ci/knobs-values.yaml sets every pod knob", knobs_all_set, knob_values)
    knobbed = sets.get("helm knobs-values.yaml") or []
    if knobbed:
        check("helm knobs-values.yaml: every knob lands in the pod", check_knobs, knobbed,
              knob_values)
        for what, mutate in KNOB_BREAKS.items():
            check(f"knob check rejects a render with {what}", render_rejects, check_knobs,
                  knobbed, mutate, knob_values)
    for name, docs in sets.items():
        if name.startswith("helm ") and docs:
            vf = name.removeprefix("helm ")
            values = None if vf == "defaults" else yaml.safe_load((chart / "ci" / vf).read_text())
            detail = check(f"{name}: Service admin port and monitors as the values say",
                           monitors_checked, docs, chart_values(chart, values))
            if detail:
                print(f"       {detail}")
            detail = check(f"{name}: TLS as the values say", check_tls, docs,
                           chart_values(chart, values))
            if detail:
                print(f"       {detail}")
            detail = check(f"{name}: store as the values say", check_store, docs,
                           chart_values(chart, values))
            if detail:
                print(f"       {detail}")
            detail = check(f"{name}: admin token as the values say", check_admin_token, docs,
                           chart_values(chart, values))
            if detail:
                print(f"       {detail}")
    tls_docs = sets.get("helm tls-values.yaml") or []
    if tls_docs:
        tls_values = chart_values(chart, yaml.safe_load((chart / "ci" / "tls-values.yaml").read_text()))
        for what, mutate in TLS_BREAKS.items():
            check(f"TLS check rejects a render with {what}", render_rejects, tls_and_pod,
                  tls_docs, mutate, tls_values)
    store_docs = sets.get("helm store-values.yaml") or []
    if store_docs:
        store_values = chart_values(chart, yaml.safe_load((chart / "ci" / "store-values.yaml").read_text()))
        check("ci/store-values.yaml takes the URL from a Secret (the plain URL is rendered below)",
              store_url_from_secret, store_values)
        for what, mutate in STORE_BREAKS.items():
            check(f"store check rejects a render with {what}", render_rejects, store_and_pod,
                  store_docs, mutate, store_values)
        for what, mutate in ADMIN_TOKEN_BREAKS.items():
            check(f"admin token check rejects a render with {what}", render_rejects,
                  check_admin_token, store_docs, mutate, store_values)
    detail = check("helm store.url (a plain value): store and pod as the values say",
                   plain_store_url, chart)
    if detail:
        print(f"       {detail}")
    for what, (bad, message) in STORE_RENDER_FAILS.items():
        check(f"helm refuses {what}", helm_render_fails, chart, bad, message)
    for vf, breaks in (("monitoring-values.yaml", SERVICE_MONITOR_BREAKS),
                       ("podmonitor-values.yaml", POD_MONITOR_BREAKS)):
        docs = sets.get(f"helm {vf}") or []
        values = chart_values(chart, yaml.safe_load((chart / "ci" / vf).read_text()))
        if docs:
            for what, mutate in breaks.items():
                check(f"monitor check rejects a render with {what}", render_rejects,
                      monitors_checked, docs, mutate, values)
    check("helm refuses serviceMonitor and podMonitor together", helm_render_fails, chart,
          {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}, "turn on one of them")
    check(f"{rel(chart)}/files are copies of {rel(PROM)}", chart_files_match, chart)
    detail = check(f"alerts in {rel(RULES)} have severity, summary, runbook section",
                   rules_well_formed)
    if detail:
        print(f"       {detail}")
    monitoring_values = yaml.safe_load((chart / "ci" / "monitoring-values.yaml").read_text())
    base_url = monitoring_values["prometheusRule"]["runbookBaseUrl"]
    monitored = sets.get("helm monitoring-values.yaml") or []
    for kind in ("PrometheusRule", "ConfigMap"):
        check(f"helm monitoring-values.yaml renders a {kind}", renders, monitored, kind)

    # Hand-written objects of the load-balancer examples.
    lb = DEPLOY / "loadbalancers"
    loose: list[tuple[str, dict]] = []
    for f in sorted(lb.rglob("*.yaml")):
        if f.name == "envoy.yaml":
            continue
        for d in load_all(f.read_text()):
            loose.append((rel(f), d))

    objects: list[tuple[str, dict]] = [
        (name, d) for name, docs in sets.items() for d in docs
    ] + [(rel(tier), d) for d in tier_docs] + loose
    gateway_api = []
    for source, obj in objects:
        label = f"{source}: {obj['kind']} {obj['metadata'].get('name')}"
        group = obj["apiVersion"].split("/")[0]
        if group == "monitoring.coreos.com":
            check(f"prometheus-operator v0.80 CRD strict  {label}", prometheus_operator_validate,
                  obj)
            for what, mutate in PO_SCHEMA_BREAKS.get(obj["kind"], {}).items() if \
                    source.startswith("helm monitoring") or source.startswith("helm podmonitor") else ():
                check(f"prometheus-operator CRD rejects a {obj['kind']} with {what}",
                      prometheus_operator_rejects, obj, mutate)
            if obj["kind"] == "PrometheusRule":
                check(f"rules == {rel(RULES)}, promtool  {label}", prometheus_rule_validate, obj,
                      base_url)
            continue
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"].endswith("-dashboard"):
            check(f"dashboard == {rel(DASHBOARD)}  {label}", dashboard_configmap_validate, obj)
        if group == "networking.istio.io":
            check(f"istio schema  {label}", istio_validate, obj)
        elif group == "gateway.networking.k8s.io":
            gateway_api.append((source, obj))
        elif group == "gateway.envoyproxy.io":
            check(f"envoy gateway v1.9 CRD strict  {label}", crd_validate, obj)
            for what, mutate in EG_SCHEMA_BREAKS.get(obj["kind"], {}).items():
                check(f"envoy gateway CRD rejects a copy with {what}", eg_schema_rejects, obj, mutate)
        else:
            check(f"k8s {'/'.join(K8S_VERSIONS)} strict  {label}", k8s_validate, obj)
    if gateway_api:
        out = check("gateway-api schema (@kubernetes-models/gateway-api)", gateway_api_validate,
                    gateway_api)
        if out:
            print("\n".join("       " + line for line in out.splitlines()))

    eg = [(s, o) for s, o in loose if s.startswith(rel(lb / "gateway-api"))]
    detail = check("envoy gateway session pin (EnvoyPatchPolicy envelope on mcp-session-id)",
                   check_envoy_gateway_pin, eg)
    if detail:
        print(f"       {detail}")
    for what, mutate in EG_PIN_BREAKS.items():
        check(f"envoy gateway pin check rejects a copy with {what}", eg_pin_rejects, eg, mutate)

    haproxy = lb / "haproxy" / "haproxy.cfg"
    detail = check(f"haproxy session pin, drain and SSE settings  {rel(haproxy)}", check_haproxy,
                   haproxy)
    if detail:
        print(f"       {detail}")

    envoy = lb / "envoy" / "envoy.yaml"
    check(f"envoy v3 API strict  {rel(envoy)}", envoy_parse, yaml.safe_load(envoy.read_text()),
          "envoy.config.bootstrap.v3.Bootstrap")

    for name, docs in sets.items():
        if docs:
            detail = check(f"pod consistency  {name}", check_pod, docs)
            if detail:
                print(f"       {detail}")
    for name in ("kustomize base", "helm probes-values.yaml"):
        for what, mutate in SERVER_PROBE_BREAKS.items():
            if sets.get(name):
                check(f"pod check rejects {name} with {what}", render_rejects,
                      check_pod, sets[name], mutate)
    if tier_docs:
        detail = check(f"gateway tier: replicas, Service without affinity, upstream, store, key  {rel(tier)}",
                       check_gateway_tier, tier_docs)
        if detail:
            print(f"       {detail}")
        for what, mutate in GATEWAY_TIER_BREAKS.items():
            check(f"gateway tier check rejects a copy with {what}", render_rejects,
                  check_gateway_tier, tier_docs, mutate)
    check(f"{rel(tier)}/store-key-secret.yaml says how to generate the key",
          gateway_tier_explains_key, tier)
    if sets["kustomize base"] and sets["helm defaults"]:
        check("helm defaults == kustomize base (pod, Service, PDB)", same_pod,
              sets["kustomize base"], sets["helm defaults"])
    check("Dockerfile and Dockerfile.scratch runtime stages agree", dockerfiles_agree)

    print(f"deploy: {passes} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
