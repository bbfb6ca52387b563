"""active-request-scorer: prefer endpoints with fewer requests in flight from this picker.

Type: ``active-request-scorer``

Formula: min-max over the candidates of ``n = requests routed to the endpoint and not yet
finished`` (counted by the picker itself, so it moves on every pick, not on every scrape):
``score = (max_n - n) / (max_n - min_n)``; all equal -> 1.0.

Why: scraped queue depth lags by a scrape interval. In a burst, a prefix-affine request stream
would keep landing on one endpoint until its queue shows up in ``/metrics``; the in-flight count
reacts at once and spreads the burst.

Inputs: the picker's in-flight accounting (incremented at the pick, decremented when the
response ends or the stream closes).
Parameters: none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from picker.scheduling.types import BuildContext, LLMRequest
from picker.state.endpoints import Endpoint
from scorers._minmax import write_min_max_inverse


@dataclass(frozen=True)
class ActiveRequestParams:
    pass


class ActiveRequestScorer:
    type_name: ClassVar[str] = "active-request-scorer"
    Params = ActiveRequestParams

    def __init__(self, name: str, params: ActiveRequestParams, ctx: BuildContext) -> None:
        self.name = name
        self._in_flight = ctx.store.in_flight

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        in_flight = self._in_flight
        write_min_max_inverse([in_flight[e.id] for e in candidates], out)
