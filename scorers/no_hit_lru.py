"""no-hit-lru-scorer: spread requests no endpoint holds any of, least recently seeded first.

Type: ``no-hit-lru-scorer`` (llm-d's scorer of that name, part of its "optimized baseline"
profile: prefix 3, queue 2, KV-cache utilization 2, this 2)

A request is *cold* when no candidate holds a block of its prompt, as the prefix scorer that ran
before this one in the profile published it (``prefix-cache-scorer`` or
``precise-prefix-cache-scorer``; none ran: every request is cold). A cold request computes its
whole prompt wherever it lands and leaves new KV there, so sending the cold requests around in
turn spreads the cache's growth over the pool.

Formula, over the ``N`` candidates of a cold request:

```
never-seeded candidates (no cold request picked them yet), in candidate order, the i-th:
    score = 1 - i / (N - 1)
seeded candidates, p = position in the LRU of cold picks (0: the least recent), k = the
never-seeded candidates' count:
    score = max(0, 1 - (k + p) / (N - 1))
```

A request some candidate holds (a hit) scores 0.5 everywhere: it leaves the choice to the other
scorers. One candidate scores 1. After each pick of a cold request the destination (the primary
profile's target) and, under P/D, the prefill endpoint picked for it become the most recently
seeded. The LRU is shared by every profile (a P/D pool's prefill and decode endpoints are ranked
in one order) and keeps the last ``lruSize`` endpoints; an endpoint that leaves the pool leaves
it. The order outlives a config reload that keeps this plugin's name and ``lruSize``, and
reaches the other workers of ``serve --workers N`` with each pick (a worker started again
begins with an empty order).

Parameters (defaults): ``lruSize`` (1024; 0 or less: the default, as upstream).
``prefixPluginName``, ``prefixPluginType`` and ``prefixMatchInfoProducerName`` are accepted for
configs written for llm-d, where they name the prefix plugin to read; here the match comes from
whichever prefix scorer ran before this one in the profile, so list that one first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kv_picker.endpoint import Endpoint, EndpointId
from kv_picker.scheduling.context import BuildContext, Lifetime
from kv_picker.scheduling.framework import LLMRequest, PeerPick, SchedulingResult
from kv_picker.scheduling.signals import PREFIX_MATCH, PrefixMatch

DEFAULT_LRU_SIZE = 1024
HIT_SCORE = 0.5


@dataclass(frozen=True)
class NoHitLruParams:
    lruSize: int = 0
    prefixPluginName: str = ""
    prefixPluginType: str = ""
    prefixMatchInfoProducerName: str = ""


class ColdPickOrder:
    """Endpoints in the order cold requests were last sent to them, least recent first."""

    __slots__ = ("_order", "_positions", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._order: OrderedDict[EndpointId, None] = OrderedDict()
        self._positions: dict[EndpointId, int] | None = {}

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, endpoint_id: EndpointId) -> None:
        """``endpoint_id`` was just sent a cold request: it becomes the most recent."""
        order = self._order
        if endpoint_id in order:
            order.move_to_end(endpoint_id)
        else:
            order[endpoint_id] = None
            while len(order) > self.size:
                order.popitem(last=False)
        self._positions = None

    def remove(self, endpoint_id: EndpointId) -> None:
        if self._order.pop(endpoint_id, 0) is None:
            self._positions = None

    def positions(self) -> dict[EndpointId, int]:
        """Endpoint id -> its place in the order (0: the least recent); absent: never sent."""
        positions = self._positions
        if positions is None:
            positions = self._positions = {e: i for i, e in enumerate(self._order)}
        return positions

    def ids(self) -> list[EndpointId]:
        return list(self._order)


class NoHitLruScorer:
    type_name: ClassVar[str] = "no-hit-lru-scorer"
    Params = NoHitLruParams

    def __init__(self, name: str, params: NoHitLruParams, ctx: BuildContext) -> None:
        self.name = name
        size = params.lruSize if params.lruSize > 0 else DEFAULT_LRU_SIZE

        def create(lifetime: Lifetime) -> ColdPickOrder:
            order = ColdPickOrder(size)
            lifetime.hold(ctx.store.on_removed(order.remove))
            return order

        self.order = ctx.shared_resource(("no-hit-lru", name, size), ColdPickOrder, create)
        # Whether this request was cold when scored, for on_pick (the last profile's word).
        self._state_key = f"no-hit-lru.cold.{name}"

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        match = request.state.get(PREFIX_MATCH)
        cold = not (isinstance(match, PrefixMatch) and any(match.matched_blocks.values()))
        request.state[self._state_key] = cold
        count = len(candidates)
        if not cold:
            for i in range(count):
                out[i] = HIT_SCORE
            return
        if count == 1:
            out[0] = 1.0
            return
        span = count - 1
        positions = self.order.positions()
        never = 0
        for i, endpoint in enumerate(candidates):
            if endpoint.id not in positions:
                out[i] = 1.0 - never / span
                never += 1
        for i, endpoint in enumerate(candidates):
            position = positions.get(endpoint.id)
            if position is not None:
                out[i] = max(0.0, 1.0 - (never + position) / span)

    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        if not request.state.get(self._state_key):
            return
        for endpoint_id in self._seeded(result):
            self.order.touch(endpoint_id)

    def _seeded(self, result: SchedulingResult) -> list[EndpointId]:
        seeded = []
        primary = result.profile_results.get(result.primary_profile)
        if primary is not None and primary.targets:
            seeded.append(primary.targets[0].id)
        prefill = result.prefill_endpoint
        if prefill is not None:
            seeded.append(prefill.id)
        return seeded

    def pick_keys(self, request: LLMRequest) -> Sequence[int] | None:
        """A cold pick reaches the other workers as one key; the endpoints travel with it."""
        return (1,) if request.state.get(self._state_key) else None

    def record_peer_pick(self, pick: PeerPick, keys: Sequence[int]) -> None:
        if keys:
            for endpoint_id in pick.ids:
                self.order.touch(endpoint_id)
