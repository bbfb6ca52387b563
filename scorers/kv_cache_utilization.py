"""kv-cache-utilization-scorer: prefer endpoints with free KV-cache memory.

Type: ``kv-cache-utilization-scorer``

Formula: ``score = 1 - kv_usage`` with ``kv_usage = vllm:kv_cache_usage_perc`` in [0,1]
(the older ``vllm:gpu_cache_usage_perc`` is read when the new name is absent).
An endpoint whose metrics are stale scores 0 (counted as full).

Inputs: scraped KV-cache usage.
Parameters: none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest


@dataclass(frozen=True)
class KVCacheUtilizationParams:
    pass


class KVCacheUtilizationScorer:
    type_name: ClassVar[str] = "kv-cache-utilization-scorer"
    Params = KVCacheUtilizationParams

    def __init__(self, name: str, params: KVCacheUtilizationParams, ctx: BuildContext) -> None:
        self.name = name
        self._store = ctx.store
        self._staleness_s = ctx.metrics_staleness_s

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        store = self._store
        kv_usage = store.kv_usage
        scraped_s = store.scraped_s
        oldest_fresh_s = store.now() - self._staleness_s
        for i, endpoint in enumerate(candidates):
            if scraped_s[endpoint.id] >= oldest_fresh_s:
                out[i] = 1.0 - kv_usage[endpoint.id]
