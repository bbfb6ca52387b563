"""The Helm chart, rendered by Helm's own engine (helm-python-sdk binds Helm's Go SDK).

Every rendered manifest is checked the way a cluster would check it: built-in kinds against
the Kubernetes OpenAPI schemas (``kubernetes-validate``, strict: unknown fields are errors),
the InferencePool against its CRD's openAPIV3Schema and CEL rules, the HTTPRoute against
Gateway API's (both schemas vendored under ``schemas/`` with their source). The picker's config
is read by the picker's own loader and the bundled Envoy's by Envoy (``--mode validate``).
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="a dev dependency")
jsonschema = pytest.importorskip("jsonschema", reason="comes with kubernetes-validate")

from kv_picker.config import PickerConfig, load_config  # noqa: E402
from kv_picker.plugins import builtin_registry  # noqa: E402
from kv_picker_bench.localstack import (  # noqa: E402
    envoy_binary,
    envoy_bootstrap,
    picker_tls,
)
from tests.certificates import CertificateAuthority  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "charts" / "kv-picker"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
NAMESPACE = "llm"
# The oldest Kubernetes minor the chart supports and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# Kinds whose schema is not vendored: checked by the assertions of their own tests only.
UNVALIDATED_KINDS = {"ServiceMonitor"}

Manifest = dict[str, Any]

EVERYTHING_ON: dict[str, Any] = {
    "replicaCount": 3,
    "inferencePool": {
        "name": "llama-pool",
        "selector": {"matchLabels": {"app": "vllm-llama", "tier": "gpu"}},
        "targetPorts": [8000, 8001],
        "appProtocol": "kubernetes.io/h2c",
        "failureMode": "FailClose",
    },
    "httpRoute": {
        "enabled": True,
        "parentRefs": [{"name": "inference-gateway", "sectionName": "http"}],
        "hostnames": ["llm.example.com"],
        "timeout": "600s",
    },
    "envoy": {
        "enabled": True,
        "bodyMode": "BUFFERED",
        "maxBodyBytes": 4194304,
        "tls": {"secretName": "envoy-client"},
    },
    "valkey": {"enabled": True},
    "tls": {
        "enabled": True,
        "secretName": "picker-tls",
        "clientCA": {"enabled": True, "secretName": "gateway-ca"},
    },
    "metrics": {"port": 9191, "serviceMonitor": {"enabled": True}},
    "grpc": {"port": 9100},
    "podDisruptionBudget": {"enabled": True, "minAvailable": 2},
    "config": {"server": {"maxBodyBytes": 4194304}, "index": {"blockSizeTokens": 16}},
}
STATIC_ENDPOINTS: dict[str, Any] = {
    "inferencePool": {"enabled": False},
    "rbac": {"create": False},
    "dashboard": {"enabled": False},
    "config": {"endpoints": [{"address": "10.0.0.7:8000"}]},
}
# A gateway still on the Gateway API Inference Extension's v1alpha2 API, switching pickers: its
# pool stays as it is, and the chart points the picker, the Role and the route at it.
EXISTING_ALPHA_POOL: dict[str, Any] = {
    "inferencePool": {
        "create": False,
        "group": "inference.networking.x-k8s.io",
        "name": "vllm-llama3-8b-instruct",
    },
    "httpRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway"}]},
}
VALUE_SETS = {
    "defaults": {},
    "everything-on": EVERYTHING_ON,
    "static-endpoints": STATIC_ENDPOINTS,
    "existing-v1alpha2-pool": EXISTING_ALPHA_POOL,
}


def render(values: dict[str, Any] | None = None) -> list[Manifest]:
    chart = helm_python.Chart.load(str(CHART))
    files = chart.render(values, name="gw", namespace=NAMESPACE, is_install=True)
    manifests: list[Manifest] = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            manifests += [d for d in yaml.safe_load_all(text) if d]
    return manifests


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = [
        m
        for m in manifests
        if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def kinds(manifests: list[Manifest]) -> list[str]:
    return sorted(m["kind"] for m in manifests)


def load_picker_config(manifests: list[Manifest], tmp_path: Path) -> PickerConfig:
    """The rendered config, read from a file by the loader ``kv-picker serve`` uses."""
    path = tmp_path / "config.yaml"
    path.write_text(find(manifests, "ConfigMap", "gw-kv-picker")["data"]["config.yaml"])
    return load_config(path, builtin_registry(include_entry_points=False))


def envoy_config(manifests: list[Manifest]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(
        find(manifests, "ConfigMap", "gw-kv-picker-envoy")["data"]["envoy.yaml"]
    )
    return config


# -- schemas ------------------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """An OpenAPI v3 structural schema as JSON Schema with the API server's strictness: an
    object that lists its properties accepts no others (unknown fields are rejected under
    strict field validation) unless it preserves unknown fields."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        result["additionalProperties"] = False
    return result


def _crd_schema(path: Path, version: str) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema: dict[str, Any] = served["schema"]["openAPIV3Schema"]
    return schema


INFERENCE_POOL_SCHEMA = _crd_schema(
    SCHEMAS / "inference.networking.k8s.io_inferencepools.yaml", "v1"
)
HTTP_ROUTE_SCHEMA = yaml.safe_load(
    (SCHEMAS / "gateway.networking.k8s.io_httproutes.v1.schema.yaml").read_text()
)


def _endpoint_picker_ref_has_port(ref: dict[str, Any]) -> bool:
    return ref.get("kind", "Service") != "Service" or "port" in ref


def _ports_unique(ports: list[dict[str, Any]]) -> bool:
    numbers = [p["number"] for p in ports]
    return len(set(numbers)) == len(numbers)


# The CRD's CEL rules (x-kubernetes-validations), each with its Python equivalent, by the path
# of the value it applies to. A rule that is not listed here fails the test, so a newer CRD
# cannot add one that goes unchecked.
INFERENCE_POOL_RULES: dict[str, tuple[tuple[str, Callable[[Any], bool]], ...]] = {
    "spec.endpointPickerRef": (
        ("self.kind != 'Service' || has(self.port)", _endpoint_picker_ref_has_port),
    ),
    "spec.targetPorts": (
        ("self.all(p1, self.exists_one(p2, p1.number==p2.number))", _ports_unique),
    ),
}


def _cel_rules(schema: Any, path: str = "") -> dict[str, list[str]]:
    rules: dict[str, list[str]] = {}
    if isinstance(schema, dict):
        for validation in schema.get("x-kubernetes-validations", ()):
            rules.setdefault(path, []).append(validation["rule"])
        for name, child in schema.get("properties", {}).items():
            for where, found in _cel_rules(child, f"{path}.{name}".lstrip(".")).items():
                rules.setdefault(where, []).extend(found)
    return rules


def validate_inference_pool(pool: Manifest) -> None:
    jsonschema.validate(pool, _strict(INFERENCE_POOL_SCHEMA))
    for path, rules in _cel_rules(INFERENCE_POOL_SCHEMA).items():
        known = dict(INFERENCE_POOL_RULES.get(path, ()))
        value: Any = pool
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        for rule in rules:
            assert rule in known, f"CEL rule at {path} not checked by this test: {rule}"
            if value is not None:
                assert known[rule](value), f"{path}: violates {rule}"


def validate(manifest: Manifest) -> None:
    kind = manifest["kind"]
    if kind == "InferencePool":
        validate_inference_pool(manifest)
    elif kind == "HTTPRoute":
        jsonschema.validate(manifest, _strict(HTTP_ROUTE_SCHEMA))
    elif kind not in UNVALIDATED_KINDS:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(manifest, version, strict=True)


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_manifest_validates(values: dict[str, Any]) -> None:
    manifests = render(values)
    assert manifests
    for manifest in manifests:
        validate(manifest)


def test_the_validators_reject_what_a_cluster_would() -> None:
    manifests = render(EVERYTHING_ON)
    deployment = copy.deepcopy(find(manifests, "Deployment", "gw-kv-picker"))
    deployment["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    service = copy.deepcopy(find(manifests, "Service", "gw-kv-picker"))
    service["spec"]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service)
    pool = copy.deepcopy(find(manifests, "InferencePool"))
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    with pytest.raises(AssertionError, match="violates"):
        validate(pool)
    del pool["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)
    route = copy.deepcopy(find(manifests, "HTTPRoute"))
    route["spec"]["rules"][0]["backendRefs"][0]["weight"] = -1
    with pytest.raises(jsonschema.ValidationError):
        validate(route)


def test_defaults_deploy_the_pool_rbac_and_the_picker(tmp_path: Path) -> None:
    manifests = render()
    assert kinds(manifests) == [
        "ConfigMap",  # the picker's config
        "ConfigMap",  # the dashboard
        "Deployment",
        "InferencePool",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    pool = find(manifests, "InferencePool")
    assert pool["metadata"]["name"] == "gw-kv-picker"
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "vllm"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "gw-kv-picker",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    # The pool names a Service that exists and serves the gRPC port.
    service = find(manifests, "Service", "gw-kv-picker")
    assert {"name": "grpc", "port": 9002} in [
        {"name": p["name"], "port": p["port"]} for p in service["spec"]["ports"]
    ]
    config = load_picker_config(manifests, tmp_path)
    assert config.endpoints == ()
    assert config.discovery is not None
    kubernetes = config.discovery.kubernetes
    assert (kubernetes.namespace, kubernetes.inference_pool) == (NAMESPACE, "gw-kv-picker")
    assert (config.server.grpc_port, config.server.metrics_port) == (9002, 9090)
    # Health checks see it leave, then it drains, all within the pod's termination grace.
    grace_s = find(manifests, "Deployment")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert (config.server.shutdown_delay_s, config.server.drain_timeout_s) == (2.0, 25.0)
    assert config.server.shutdown_delay_s + config.server.drain_timeout_s < grace_s
    # The admin API stays on loopback in the pod, and out of the Service.
    assert (config.server.admin.host, config.server.admin.port) == ("127.0.0.1", 9004)
    assert 9004 not in [p["port"] for p in service["spec"]["ports"]]
    assert config.index.backend == "memory"
    container = find(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--config", "/etc/kv-picker/config/config.yaml"]
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}


def test_rbac_grants_read_on_pods_and_inferencepools_only() -> None:
    manifests = render()
    role = find(manifests, "Role")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    binding = find(manifests, "RoleBinding")
    account = find(manifests, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    pod_spec = find(manifests, "Deployment")["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == account["metadata"]["name"]


def test_everything_on(tmp_path: Path) -> None:
    manifests = render(EVERYTHING_ON)
    pool = find(manifests, "InferencePool")
    assert pool["metadata"]["name"] == "llama-pool"
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    assert pool["spec"]["appProtocol"] == "kubernetes.io/h2c"
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}

    route = find(manifests, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway", "sectionName": "http"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama-pool"}
    ]
    assert rule["timeouts"] == {"request": "600s"}

    assert find(manifests, "Deployment", "gw-kv-picker")["spec"]["replicas"] == 3
    config = load_picker_config(manifests, tmp_path)
    assert config.discovery is not None
    assert config.discovery.kubernetes.inference_pool == "llama-pool"
    # Several replicas share the precise index in the chart's Valkey.
    assert config.index.backend == "redis"
    assert config.index.url == "redis://gw-kv-picker-valkey:6379/0"
    assert config.index.block_size_tokens == 16  # the user's index settings stay
    assert config.server.max_body_bytes == 4194304
    assert config.server.tls is not None
    valkey = find(manifests, "Service", "gw-kv-picker-valkey")
    assert valkey["spec"]["ports"][0]["port"] == 6379

    # No selector of the picker's matches another component's pods.
    picker_selector = find(manifests, "Deployment", "gw-kv-picker")["spec"]["selector"]
    for name in ("gw-kv-picker-valkey", "gw-kv-picker-envoy"):
        labels = find(manifests, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert not picker_selector["matchLabels"].items() <= labels.items(), name
    assert find(manifests, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    assert find(manifests, "PodDisruptionBudget")["spec"]["minAvailable"] == 2


# Only each response's end reaches the picker (see the README's Envoy section).
LEAN_RESPONSES: dict[str, Any] = {"envoy": {"responses": "lean"}}
BUNDLED_ENVOYS = pytest.mark.parametrize(
    "values",
    [{}, EVERYTHING_ON, LEAN_RESPONSES, {"envoy": {"responses": "lean", "bodyMode": "BUFFERED"}}],
    ids=["full-duplex", "buffered", "lean", "buffered-lean"],
)


@BUNDLED_ENVOYS
def test_bundled_envoy_config_is_the_local_stacks(values: dict[str, Any]) -> None:
    """The chart's Envoy config and the local stack's (which the integration tests run) agree
    on everything but addresses: filters, processing modes, the ORIGINAL_DST cluster."""
    values = copy.deepcopy(values)
    values.setdefault("envoy", {})["enabled"] = True
    manifests = render(values)
    chart = envoy_config(manifests)
    envoy_values = {"bodyMode": "FULL_DUPLEX_STREAMED", "maxBodyBytes": 8388608, **values["envoy"]}
    fail_open = values.get("inferencePool", {}).get("failureMode", "FailOpen") == "FailOpen"
    stack = envoy_bootstrap(
        8080,
        19000,
        9002,
        body_mode=envoy_values["bodyMode"],
        max_body_bytes=envoy_values["maxBodyBytes"],
        failure_mode="FailOpen" if fail_open else "FailClose",
        pool_endpoints=["10.0.0.1:8000"] if fail_open else (),
        responses=envoy_values.get("responses", "full"),
    )

    def listener(config: dict[str, Any]) -> dict[str, Any]:
        (found,) = config["static_resources"]["listeners"]
        return dict(found)

    def manager(config: dict[str, Any]) -> dict[str, Any]:
        typed: dict[str, Any] = listener(config)["filter_chains"][0]["filters"][0]["typed_config"]
        return typed

    def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
        return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)

    assert manager(chart)["http_filters"] == manager(stack)["http_filters"]
    assert manager(chart)["route_config"] == manager(stack)["route_config"]
    # FailOpen: a client's destination header removed first, the fallback route to the pool.
    assert manager(chart).get("early_header_mutation_extensions") == manager(stack).get(
        "early_header_mutation_extensions"
    )
    assert (
        listener(chart)["per_connection_buffer_limit_bytes"]
        == listener(stack)["per_connection_buffer_limit_bytes"]
    )
    assert cluster(chart, "original_destination_cluster") == cluster(
        stack, "original_destination_cluster"
    )
    ext_proc = cluster(chart, "ext_proc")
    stack_ext_proc = cluster(stack, "ext_proc")
    assert (
        ext_proc["typed_extension_protocol_options"]
        == stack_ext_proc["typed_extension_protocol_options"]
    )
    (lb_endpoint,) = ext_proc["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = lb_endpoint["endpoint"]["address"]["socket_address"]
    # The headless Service: every picker replica.
    headless = find(manifests, "Service", "gw-kv-picker-pods")
    assert headless["spec"]["clusterIP"] == "None"
    assert address["address"] == f"gw-kv-picker-pods.{NAMESPACE}.svc.cluster.local"
    assert address["port_value"] == values.get("grpc", {}).get("port", 9002)
    # A dead picker is seen before a body is handed to it (FailOpen), as in the local stack.
    for key in ("health_checks", "outlier_detection", "common_lb_config", "circuit_breakers"):
        assert ext_proc.get(key) == stack_ext_proc.get(key), key
    names = {c["name"] for c in chart["static_resources"]["clusters"]}
    if not fail_open:
        assert "pool_fallback_cluster" not in names
        assert not [m for m in manifests if m["metadata"]["name"] == "gw-kv-picker-pool"]
        return
    fallback, stack_fallback = (
        cluster(chart, "pool_fallback_cluster"),
        cluster(stack, "pool_fallback_cluster"),
    )
    for key in ("lb_policy", "health_checks", "circuit_breakers"):
        assert fallback[key] == stack_fallback[key], key
    pool = find(manifests, "Service", "gw-kv-picker-pool")
    assert pool["spec"]["clusterIP"] == "None"
    assert pool["spec"]["selector"] == {"app": "vllm"}
    (target,) = fallback["load_assignment"]["endpoints"][0]["lb_endpoints"]
    socket = target["endpoint"]["address"]["socket_address"]
    assert socket == {
        "address": f"gw-kv-picker-pool.{NAMESPACE}.svc.cluster.local",
        "port_value": 8000,
    }


def _envoy_validate(config: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@BUNDLED_ENVOYS
def test_real_envoy_accepts_the_bundled_config(values: dict[str, Any], tmp_path: Path) -> None:
    values = copy.deepcopy(values)
    values.setdefault("envoy", {})["enabled"] = True
    manifests = render(values)
    config = envoy_config(manifests)
    # The files the pod mounts (TLS from Secrets, SDS files from the ConfigMap), made here so
    # that Envoy can load them.
    text = yaml.safe_dump(config)
    if "/etc/envoy/" in text:
        (tmp_path / "tls").mkdir()
        ca = CertificateAuthority("test CA")
        ca.issue("envoy", server=False).write(tmp_path / "tls", "tls")
        (tmp_path / "tls" / "ca.crt").write_bytes(ca.cert_pem)
        data = find(manifests, "ConfigMap", "gw-kv-picker-envoy")["data"]
        for name, content in data.items():
            if name.startswith("sds-"):
                (tmp_path / name).write_text(content.replace("/etc/envoy", str(tmp_path)))
        config = yaml.safe_load(text.replace("/etc/envoy", str(tmp_path)))
    result = _envoy_validate(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # ... and would refuse a broken one.
    config["static_resources"]["clusters"][0]["lb_policy"] = "NO_SUCH_POLICY"
    assert _envoy_validate(config, tmp_path).returncode != 0


DASHBOARD_PANELS = {
    "Scheduling latency",
    "Picks by endpoint and profile",
    "Prefix hit ratio",
    "Index size",
    "Index evictions",
    "Queued prefill tokens",
    "Admission decisions",
    "Endpoint readiness",
    "KV-event gaps and drops",
    "Config reloads",
}


def test_the_dashboard_ships_in_a_sidecar_configmap() -> None:
    manifests = render({"dashboard": {"annotations": {"grafana_folder": "LLM"}}})
    configmap = find(manifests, "ConfigMap", "gw-kv-picker-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    dashboard = json.loads(configmap["data"]["kv-picker.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "kv-picker.json").read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert titles >= DASHBOARD_PANELS
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    without = render({"dashboard": {"enabled": False}})
    assert [m["metadata"]["name"] for m in without if m["kind"] == "ConfigMap"] == ["gw-kv-picker"]


def test_an_existing_v1alpha2_pool_is_followed_not_created(tmp_path: Path) -> None:
    manifests = render(EXISTING_ALPHA_POOL)
    assert "InferencePool" not in kinds(manifests)
    config = load_picker_config(manifests, tmp_path)
    assert config.discovery is not None
    kubernetes = config.discovery.kubernetes
    assert (kubernetes.inference_pool, kubernetes.inference_pool_group) == (
        "vllm-llama3-8b-instruct",
        "inference.networking.x-k8s.io",
    )
    pool_rule = find(manifests, "Role")["rules"][1]
    assert pool_rule["apiGroups"] == ["inference.networking.x-k8s.io"]
    assert pool_rule["resources"] == ["inferencepools"]
    (rule,) = find(manifests, "HTTPRoute")["spec"]["rules"]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.x-k8s.io",
            "kind": "InferencePool",
            "name": "vllm-llama3-8b-instruct",
        }
    ]
    # An existing v1 pool: not rendered, and the config leaves the group at its default.
    v1 = {"inferencePool": {"create": False, "name": "llama"}}
    manifests = render(v1)
    assert "InferencePool" not in kinds(manifests)
    config = load_picker_config(manifests, tmp_path)
    assert config.discovery is not None
    assert config.discovery.kubernetes.inference_pool == "llama"
    assert config.discovery.kubernetes.inference_pool_group is None
    assert find(manifests, "Role")["rules"][1]["apiGroups"] == ["inference.networking.k8s.io"]


def test_static_endpoints_without_the_pool(tmp_path: Path) -> None:
    manifests = render(STATIC_ENDPOINTS)
    assert "InferencePool" not in kinds(manifests) and "Role" not in kinds(manifests)
    config = load_picker_config(manifests, tmp_path)
    assert config.discovery is None
    assert [e.address for e in config.endpoints] == ["10.0.0.7:8000"]


def test_user_config_passes_through_and_ports_follow_values(tmp_path: Path) -> None:
    values = {
        "grpc": {"port": 9100},
        "metrics": {"port": 9191},
        "config": {
            "server": {"maxBodyBytes": 1048576},
            "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
        },
    }
    config = load_picker_config(render(values), tmp_path)
    assert config.server.grpc_port == 9100 and config.server.metrics_port == 9191
    assert config.server.max_body_bytes == 1048576
    assert [p.type for p in config.plugins] == ["queue-scorer", "max-score-picker"]


def test_mutual_tls_mounts_the_client_ca_and_envoy_presents_its_certificate(
    tmp_path: Path,
) -> None:
    manifests = render(EVERYTHING_ON)
    spec = find(manifests, "Deployment", "gw-kv-picker")["spec"]["template"]["spec"]
    assert {
        "name": "client-ca",
        "secret": {"secretName": "gateway-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]},
    } in spec["volumes"]
    mounts = spec["containers"][0]["volumeMounts"]
    assert {"name": "client-ca", "mountPath": "/etc/kv-picker/client-ca", "readOnly": True} in (
        mounts
    )
    config = load_picker_config(manifests, tmp_path)
    assert config.server.tls is not None
    assert config.server.tls.client_ca_path == "/etc/kv-picker/client-ca/ca.crt"
    # The bundled Envoy verifies the picker and presents its client certificate.
    (ext_proc,) = [
        c
        for c in envoy_config(manifests)["static_resources"]["clusters"]
        if c["name"] == "ext_proc"
    ]
    # Through file-based SDS over the mounted Secret, as the real-Envoy rotation test runs it
    # (tests/integration/test_mtls.py): the same transport socket and SDS files.
    sni = f"gw-kv-picker.{NAMESPACE}.svc"
    transport_socket, sds_files = picker_tls("/etc/envoy/tls", "/etc/envoy", sni, True)
    assert ext_proc["transport_socket"] == transport_socket
    data = find(manifests, "ConfigMap", "gw-kv-picker-envoy")["data"]
    assert {name: yaml.safe_load(data[name]) for name in sds_files} == sds_files
    envoy_spec = find(manifests, "Deployment", "gw-kv-picker-envoy")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "envoy-client"}} in envoy_spec["volumes"]


def test_tls_mounts_the_secret_and_switches_probes(tmp_path: Path) -> None:
    manifests = render({"tls": {"enabled": True, "secretName": "picker-tls"}})
    spec = find(manifests, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "picker-tls"}} in spec["volumes"]
    container = spec["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    config = load_picker_config(manifests, tmp_path)
    assert config.server.tls is not None
    assert config.server.tls.cert_path == "/etc/kv-picker/tls/tls.crt"


def test_workers_run_under_a_supervisor_probed_over_http(tmp_path: Path) -> None:
    manifests = render({"workers": 3, "recycleRssMB": 1500, "envoy": {"enabled": True}})
    spec = find(manifests, "Deployment", "gw-kv-picker")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    args = container["args"]
    assert args[args.index("--workers") + 1] == "3"
    assert args[args.index("--worker-ports") + 1] == "9100,9101,9102"
    assert args[args.index("--recycle-rss") + 1] == "1500"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert [ports[f"worker-{i}"] for i in range(3)] == [9100, 9101, 9102]
    # A gRPC probe would reach one worker; /readyz is every worker's.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (run,) = [v for v in spec["volumes"] if v["name"] == "run"]
    assert "emptyDir" in run
    assert {"name": "run", "mountPath": "/tmp"} in container["volumeMounts"]
    chart = envoy_config(manifests)
    ext_proc = next(c for c in chart["static_resources"]["clusters"] if c["name"] == "ext_proc")
    # Envoy balances streams over every worker of every pod, by least requests.
    assert ext_proc["lb_policy"] == "LEAST_REQUEST"
    sockets = [e["endpoint"]["address"]["socket_address"]
               for e in ext_proc["load_assignment"]["endpoints"][0]["lb_endpoints"]]  # fmt: skip
    assert [s["port_value"] for s in sockets] == [9100, 9101, 9102]
    # A dead worker leaves the balancing at once (the local stack's failure detection).
    stack = envoy_bootstrap(8080, 19000, 9002, picker_worker_ports=[9100, 9101, 9102])
    stack_ext_proc = stack["static_resources"]["clusters"][1]
    for key in ("health_checks", "outlier_detection", "common_lb_config", "lb_policy"):
        assert ext_proc[key] == stack_ext_proc[key], key
    assert {s["address"] for s in sockets} == {f"gw-kv-picker-pods.{NAMESPACE}.svc.cluster.local"}
    assert _envoy_validate(chart, tmp_path).returncode == 0
    # One worker: the command and the probes of a single process.
    single = find(render({}), "Deployment", "gw-kv-picker")["spec"]["template"]["spec"]
    assert "--workers" not in single["containers"][0]["args"]
    assert "grpc" in single["containers"][0]["readinessProbe"]
    assert not [v for v in single["volumes"] if v["name"] == "run"]


@pytest.mark.parametrize(
    "values",
    [
        {"workers": 0},
        {"workers": "2"},
        {"workers": 2, "workerPortBase": 70000},
        {"workers": 2, "recycleRssMB": -1},
        {"replicaCount": "two"},
        {"grpc": {"port": 70000}},
        {"tls": {"enabled": True}},
        {"config": {"server": {"grpcPort": 1}}},
        {"config": {"server": {"admin": {"host": "0.0.0.0"}}}},
        {"logLevel": "loud"},
        # the pool owns discovery
        {"config": {"endpoints": [{"address": "10.0.0.7:8000"}]}},
        {"config": {"discovery": {"kubernetes": {"namespace": "x", "inferencePool": "y"}}}},
        {"inferencePool": {"selector": {"matchLabels": {"app": None}}}},  # null deletes
        {"inferencePool": {"targetPorts": list(range(8000, 8009))}},
        {"inferencePool": {"targetPorts": [8000, 8000]}},
        {"inferencePool": {"failureMode": "FailSometimes"}},
        {"inferencePool": {"create": False}},  # an existing pool must be named
        {"inferencePool": {"create": False, "name": ""}},
        {"inferencePool": {"group": "inference.networking.x-k8s.io"}},  # the chart renders v1
        {"inferencePool": {"create": False, "name": "p", "group": "inference.example.com"}},
        {"httpRoute": {"enabled": True}},  # no parentRefs
        {
            "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}]},
            "inferencePool": {"enabled": False},
            "config": {"endpoints": [{"address": "10.0.0.7:8000"}]},
        },
        {"envoy": {"enabled": True, "bodyMode": "STREAMED"}},
        {"envoy": {"enabled": True, "responses": "none"}},
        {"envoy": {"enabled": True}, "tls": {"enabled": True, "secretName": "t"}},
        {"valkey": {"enabled": True}, "config": {"index": {"backend": "memory"}}},
    ],
)
def test_bad_values_are_rejected_by_the_schema(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        render(values)


def test_lint_is_clean() -> None:
    report = helm_python.lint(str(CHART), strict=True)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report
