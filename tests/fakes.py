"""Shared test doubles: a manual clock, stores with given signals, requests, built schedulers."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from kv_picker.config import PickerConfig, parse_config
from kv_picker.director import Director
from kv_picker.endpoint import EndpointSpec
from kv_picker.metrics import PickerMetrics
from kv_picker.plugins import builtin_registry
from kv_picker.request import LLMRequest, Prompt
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.scheduler import Scheduler
from kv_picker.state.endpoints import EndpointStore


class ManualClock:
    """A monotonic clock that moves only when told."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make_store(
    count: int,
    *,
    waiting: Sequence[float] | None = None,
    running: Sequence[float] | None = None,
    kv_usage: Sequence[float] | None = None,
    labels: Sequence[dict[str, str]] | None = None,
    clock: ManualClock | None = None,
) -> EndpointStore:
    """A store with ``count`` ready endpoints 10.0.0.{i+1}:8000 and the given signals."""
    clock = clock or ManualClock()
    store = EndpointStore(clock)
    store.set_endpoints(
        EndpointSpec(f"10.0.0.{i + 1}:8000", (labels[i] if labels else {})) for i in range(count)
    )
    for endpoint in store.all():
        i = endpoint.id
        store.update_metrics(
            endpoint.id,
            waiting=waiting[i] if waiting else 0.0,
            running=running[i] if running else 0.0,
            kv_usage=kv_usage[i] if kv_usage else 0.0,
        )
    return store


def make_request(prompt: str = "hello world " * 40, **fields: Any) -> LLMRequest:
    """A completions request whose prompt text is ``prompt`` (``kind=`` to change the kind)."""
    fields.setdefault("model", "m")
    fields.setdefault("target_model", fields["model"])
    return LLMRequest(
        request_id=fields.pop("request_id", "r1"),
        path=fields.pop("path", "/v1/completions"),
        prompt=Prompt(fields.pop("kind", "completions"), prompt),
        **fields,
    )


def make_context(store: EndpointStore, seed: int = 0) -> BuildContext:
    return BuildContext(store, random.Random(seed), store.now, metrics_staleness_s=2.0)


def one_scorer_document(plugin_type: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An EndpointPickerConfig document of one ``plugin_type`` with ``parameters`` and a
    max-score picker: what a test of a plugin's parameter checks loads."""
    return {
        "plugins": [
            {"type": plugin_type, "parameters": parameters},
            {"type": "max-score-picker"},
        ],
    }


def make_scheduler(document: dict[str, Any], store: EndpointStore, seed: int = 0) -> Scheduler:
    config = parse_config(document, builtin_registry(include_entry_points=False))
    return Scheduler(config, builtin_registry(False), make_context(store, seed), PickerMetrics())


def make_director(
    document: dict[str, Any] | None = None, store: EndpointStore | None = None, seed: int = 0
) -> Director:
    registry = builtin_registry(include_entry_points=False)
    config: PickerConfig = parse_config(document or {}, registry)
    store = store or make_store(4)
    ctx = make_context(store, seed)
    metrics = PickerMetrics()
    return Director(config, store, Scheduler(config, registry, ctx, metrics), ctx.rng, metrics)
