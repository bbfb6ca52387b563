"""Pickers: turn the summed scores into an ordered choice of endpoints.

| type | behaviour | parameters |
|---|---|---|
| `max-score-picker` | highest total first; ties broken uniformly at random | `maxNumOfEndpoints` (1) |
| `random-picker` | uniform random order, scores ignored | `maxNumOfEndpoints` (1) |
| `weighted-random-picker` | sampled in proportion to the total (A-Res keys `u^(1/total)`); endpoints with total <= 0 only after the rest; all zero -> uniform | `maxNumOfEndpoints` (1) |

All randomness comes from the seeded generator in the build context, so a run is repeatable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from kv_picker.decode import Range
from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest


@dataclass(frozen=True)
class PickerParams:
    maxNumOfEndpoints: Annotated[int, Range(ge=1)] = 1


class MaxScorePicker:
    type_name: ClassVar[str] = "max-score-picker"
    Params = PickerParams

    def __init__(self, name: str, params: PickerParams, ctx: BuildContext) -> None:
        self.name = name
        self._limit = params.maxNumOfEndpoints
        self._rng = ctx.rng

    def pick(
        self, request: LLMRequest, candidates: Sequence[Endpoint], totals: Sequence[float]
    ) -> list[Endpoint]:
        if self._limit == 1:
            best = max(totals)
            tied = [i for i, total in enumerate(totals) if total == best]
            index = tied[0] if len(tied) == 1 else tied[self._rng.randrange(len(tied))]
            return [candidates[index]]
        order = list(range(len(candidates)))
        self._rng.shuffle(order)
        order.sort(key=totals.__getitem__, reverse=True)  # stable: shuffled ties stay random
        return [candidates[i] for i in order[: self._limit]]


class RandomPicker:
    type_name: ClassVar[str] = "random-picker"
    Params = PickerParams

    def __init__(self, name: str, params: PickerParams, ctx: BuildContext) -> None:
        self.name = name
        self._limit = params.maxNumOfEndpoints
        self._rng = ctx.rng

    def pick(
        self, request: LLMRequest, candidates: Sequence[Endpoint], totals: Sequence[float]
    ) -> list[Endpoint]:
        if self._limit == 1:
            return [candidates[self._rng.randrange(len(candidates))]]
        return self._rng.sample(list(candidates), min(self._limit, len(candidates)))


class WeightedRandomPicker:
    type_name: ClassVar[str] = "weighted-random-picker"
    Params = PickerParams

    def __init__(self, name: str, params: PickerParams, ctx: BuildContext) -> None:
        self.name = name
        self._limit = params.maxNumOfEndpoints
        self._rng = ctx.rng

    def pick(
        self, request: LLMRequest, candidates: Sequence[Endpoint], totals: Sequence[float]
    ) -> list[Endpoint]:
        rng = self._rng
        keyed: list[tuple[float, int]] = []
        for i, total in enumerate(totals):
            # log(u)/w orders like u^(1/w) without underflow; non-positive totals sort last.
            key = math.log(rng.random() or 1e-300) / total if total > 0 else -math.inf
            keyed.append((key, i))
        if all(key == -math.inf for key, _ in keyed):
            order = list(range(len(candidates)))
            rng.shuffle(order)
        else:
            rng.shuffle(keyed)  # random order among the -inf ones
            keyed.sort(key=lambda pair: pair[0], reverse=True)
            order = [i for _, i in keyed]
        return [candidates[i] for i in order[: self._limit]]


BUILTIN_PICKERS = (MaxScorePicker, RandomPicker, WeightedRandomPicker)
