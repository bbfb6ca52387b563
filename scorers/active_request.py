"""active-request-scorer: prefer endpoints with fewer requests in flight from this picker.

Type: ``active-request-scorer``

Formula: with ``n`` = requests routed to the endpoint and not yet finished (counted by the
picker itself, so it moves on every pick, not on every scrape) and ``max_n`` the largest ``n``
among the candidates: ``n <= idleThreshold`` -> 1.0, else ``(max_n - n) / max_n``.
Relative to the busiest candidate rather than min-max, so one request more than a neighbour
costs a little, not everything.

Why: scraped queue depth lags by a scrape interval. In a burst, a prefix-affine request stream
would keep landing on one endpoint until its queue shows up in ``/metrics``; the in-flight count
reacts at once and spreads the burst.

Inputs: the picker's in-flight accounting (incremented at the pick, decremented when the
response ends or the stream closes).
Parameters: ``idleThreshold`` (0): an endpoint with at most this many requests in flight
counts as idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from kv_picker.decode import NonNegative
from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest


@dataclass(frozen=True)
class ActiveRequestParams:
    idleThreshold: Annotated[int, NonNegative] = 0


class ActiveRequestScorer:
    type_name: ClassVar[str] = "active-request-scorer"
    Params = ActiveRequestParams

    def __init__(self, name: str, params: ActiveRequestParams, ctx: BuildContext) -> None:
        self.name = name
        self._in_flight = ctx.store.in_flight
        self._idle = params.idleThreshold

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        in_flight = self._in_flight
        busiest = max(in_flight[e.id] for e in candidates)
        idle = self._idle
        for i, endpoint in enumerate(candidates):
            count = in_flight[endpoint.id]
            out[i] = 1.0 if count <= idle else (busiest - count) / busiest
