"""Every metric the chart's Grafana dashboard queries is exported by a picker serving traffic
through real Envoy (approximate and precise prefix scorers, KV events on)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_picker_bench.localstack import LocalStack
from tests.integration.conftest import post

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "kv-picker" / "dashboards" / "kv-picker.json"
TOKENIZER = str(ROOT / "benchmarks" / "tokenizer")
CONFIG = {
    "plugins": [
        {"type": "prefix-cache-scorer"},
        {"type": "precise-prefix-cache-scorer", "parameters": {"tokenizer": TOKENIZER}},
        {"type": "max-score-picker"},
    ],
}
# Series that appear only once something happens that healthy traffic on a static pool does
# not cause: a dropped KV event, a failed scrape, Kubernetes discovery. For these the scrape
# must declare the metric (HELP and TYPE), not carry a sample.
ON_EVENT_ONLY = {
    "kv_picker_kv_events_dropped_total",
    "kv_picker_scrape_errors_total",
    "kv_picker_discovery_events_total",
    "kv_picker_discovery_watch_restarts_total",
}
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "unknown": ("",),
}


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    return {name for expr in expressions for name in re.findall(r"\bkv_picker_\w+", expr)}


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    with LocalStack(
        sims=2, picker_config=CONFIG, time_scale=0.02, kv_events=True, tokenizer=TOKENIZER
    ) as local:
        yield local


def test_every_dashboard_metric_is_in_the_scrape(stack: LocalStack) -> None:
    shared = "You are a helpful assistant for the routing team. " * 40
    for i in range(12):
        body = {"model": stack.model, "prompt": f"{shared} Question {i}?", "max_tokens": 4}
        assert post(f"{stack.url}/v1/completions", body).status == 200
    time.sleep(0.5)  # a scrape of the endpoints after the last request

    declared: set[str] = set()
    sampled: set[str] = set()
    for family in text_string_to_metric_families(stack.picker_metrics_text()):
        declared |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
        sampled |= {sample.name for sample in family.samples}

    names = dashboard_metric_names()
    assert len(names) >= 20  # the regex found the queries
    missing = sorted(names - declared)
    assert not missing, f"the dashboard queries metrics the picker does not export: {missing}"
    unsampled = sorted(names - sampled - ON_EVENT_ONLY)
    assert not unsampled, f"no samples after traffic for: {unsampled}"
