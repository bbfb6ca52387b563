"""The Helm chart, rendered by Helm's own engine (helm-python-sdk binds Helm's Go SDK)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")

from kv_picker.config import parse_config  # noqa: E402
from kv_picker.plugins import builtin_registry  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "charts" / "kv-picker"


def render(values: dict[str, Any] | None = None) -> dict[str, Any]:
    chart = helm_python.Chart.load(str(CHART))
    manifests = chart.render(values, name="gw", namespace="llm", is_install=True)
    documents: dict[str, Any] = {}
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            document = yaml.safe_load(text)
            if document:
                documents[document["kind"]] = document
    return documents


def picker_config(documents: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(documents["ConfigMap"]["data"]["config.yaml"])
    return config


def test_defaults_render_and_the_config_loads_in_the_picker() -> None:
    documents = render()
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= set(documents)
    assert "ServiceMonitor" not in documents and "PodDisruptionBudget" not in documents
    config = picker_config(documents)
    parsed = parse_config(config, builtin_registry(include_entry_points=False))
    assert (parsed.server.grpc_port, parsed.server.metrics_port) == (9002, 9090)
    container = documents["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--config", "/etc/kv-picker/config/config.yaml"]
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    ports = {p["name"]: p["port"] for p in documents["Service"]["spec"]["ports"]}
    assert ports == {"grpc": 9002, "metrics": 9090}


def test_user_config_passes_through_and_ports_follow_values() -> None:
    values = {
        "grpc": {"port": 9100},
        "metrics": {"port": 9191},
        "config": {
            "endpoints": [
                {"address": "10.0.0.7:8000", "labels": {"kv-picker.io/hardware-class": "A100"}}
            ],
            "server": {"maxBodyBytes": 1048576},
            "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
        },
    }
    documents = render(values)
    parsed = parse_config(picker_config(documents), builtin_registry(include_entry_points=False))
    assert parsed.server.grpc_port == 9100 and parsed.server.metrics_port == 9191
    assert parsed.server.max_body_bytes == 1048576
    assert parsed.endpoints[0].address == "10.0.0.7:8000"
    assert [p.type for p in parsed.plugins] == ["queue-scorer", "max-score-picker"]


def test_tls_mounts_the_secret_and_switches_probes() -> None:
    documents = render({"tls": {"enabled": True, "secretName": "picker-tls"}})
    spec = documents["Deployment"]["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "picker-tls"}} in spec["volumes"]
    container = spec["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    parsed = parse_config(picker_config(documents), builtin_registry(include_entry_points=False))
    assert parsed.server.tls is not None
    assert parsed.server.tls.cert_path == "/etc/kv-picker/tls/tls.crt"


def test_optional_objects() -> None:
    documents = render(
        {
            "metrics": {"port": 9090, "serviceMonitor": {"enabled": True}},
            "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
        }
    )
    assert documents["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "metrics"
    assert documents["PodDisruptionBudget"]["spec"]["minAvailable"] == 1


@pytest.mark.parametrize(
    "values",
    [
        {"replicaCount": "two"},
        {"grpc": {"port": 70000}},
        {"tls": {"enabled": True}},
        {"config": {"server": {"grpcPort": 1}}},
        {"logLevel": "loud"},
    ],
)
def test_bad_values_are_rejected_by_the_schema(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        render(values)


def test_lint_is_clean() -> None:
    report = helm_python.lint(str(CHART), strict=True)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report
