"""queue-scorer: prefer endpoints with fewer waiting requests.

Type: ``queue-scorer``

Formula: min-max over the candidates of ``q = vllm:num_requests_waiting``:
``score = (max_q - q) / (max_q - min_q)``; all equal -> 1.0.
An endpoint whose metrics are older than the staleness bound counts as the most loaded
(score 0 unless all are stale).

Inputs: scraped ``vllm:num_requests_waiting``.
Parameters: none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest
from kv_picker.scorers._minmax import write_min_max_inverse

_STALE_LOAD = float("inf")


@dataclass(frozen=True)
class QueueParams:
    pass


class QueueScorer:
    type_name: ClassVar[str] = "queue-scorer"
    Params = QueueParams

    def __init__(self, name: str, params: QueueParams, ctx: BuildContext) -> None:
        self.name = name
        self._store = ctx.store
        self._staleness_s = ctx.metrics_staleness_s

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        store = self._store
        waiting = store.waiting
        scraped_s = store.scraped_s
        oldest_fresh_s = store.now() - self._staleness_s
        loads = [
            waiting[e.id] if scraped_s[e.id] >= oldest_fresh_s else _STALE_LOAD for e in candidates
        ]
        finite = [load for load in loads if load != _STALE_LOAD]
        if len(finite) != len(loads):
            if not finite:
                for i in range(len(loads)):
                    out[i] = 1.0
                return
            worst = max(finite) + 1.0
            loads = [worst if load == _STALE_LOAD else load for load in loads]
        write_min_max_inverse(loads, out)
