"""load-aware-scorer: a bounded penalty for queued requests (llm-d's formula).

Type: ``load-aware-scorer``

Formula, with ``q = vllm:num_requests_waiting``: ``q == 0`` -> 0.5;
otherwise ``0.5 * (1 - min(q, threshold) / threshold)``. Unlike the min-max ``queue-scorer``,
the score depends only on the endpoint itself, so one queued request more than a neighbour costs
little while a long queue costs up to 0.5. Stale metrics score 0.

Inputs: scraped ``vllm:num_requests_waiting``.
Parameters: ``threshold`` (128): the queue length that scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from kv_picker.decode import Range
from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest


@dataclass(frozen=True)
class LoadAwareParams:
    threshold: Annotated[int, Range(ge=1)] = 128


class LoadAwareScorer:
    type_name: ClassVar[str] = "load-aware-scorer"
    Params = LoadAwareParams

    def __init__(self, name: str, params: LoadAwareParams, ctx: BuildContext) -> None:
        self.name = name
        self._threshold = float(params.threshold)
        self._store = ctx.store
        self._staleness_s = ctx.metrics_staleness_s

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        store = self._store
        oldest_fresh_s = store.now() - self._staleness_s
        threshold = self._threshold
        for i, endpoint in enumerate(candidates):
            if store.scraped_s[endpoint.id] < oldest_fresh_s:
                continue
            waiting = store.waiting[endpoint.id]
            out[i] = 0.5 if waiting <= 0 else 0.5 * (1.0 - min(waiting, threshold) / threshold)
