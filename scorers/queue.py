"""queue-scorer: prefer endpoints with fewer waiting requests (and running-requests-size-scorer,
fewer running ones).

Types: ``queue-scorer``, ``running-requests-size-scorer`` (llm-d's)

Formula: min-max over the candidates of ``q = vllm:num_requests_waiting`` (the queue scorer) or
``vllm:num_requests_running`` (the running-requests scorer):
``score = (max_q - q) / (max_q - min_q)``; all equal -> 1.0.
An endpoint whose metrics are older than the staleness bound counts as the most loaded
(score 0 unless all are stale).

Inputs: the scraped gauge. Parameters: none.
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
    signal: ClassVar[str] = "waiting"  # the EndpointStore column scored

    def __init__(self, name: str, params: QueueParams, ctx: BuildContext) -> None:
        self.name = name
        self._store = ctx.store
        self._staleness_s = ctx.metrics_staleness_s

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        store = self._store
        gauge = getattr(store, self.signal)
        scraped_s = store.scraped_s
        oldest_fresh_s = store.now() - self._staleness_s
        loads = [
            gauge[e.id] if scraped_s[e.id] >= oldest_fresh_s else _STALE_LOAD for e in candidates
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


class RunningRequestsScorer(QueueScorer):
    type_name: ClassVar[str] = "running-requests-size-scorer"
    signal: ClassVar[str] = "running"
