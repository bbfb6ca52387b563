"""hardware-class-scorer: prefer endpoints on faster hardware for the work at hand.

Type: ``hardware-class-scorer``

Formula: ``score = speed(class of endpoint) / max speed among the candidates``, where speed is
the class's relative prefill speed (``phase: prefill``: compute-bound, for prompt-heavy work and
prefill pools), decode speed (``phase: decode``: memory-bandwidth-bound, for decode pools), or
their geometric mean (``phase: both``, the default, for aggregated serving). The fastest
candidate scores 1; an L4 next to an H100 scores about 0.12 for prefill.

Inputs: each endpoint's class from its ``kv-picker.io/hardware-class`` label, looked up in the
hardware table (built-in datasheet-derived classes plus the config's ``hardwareClasses``);
unlabelled endpoints are the default class (H100).
Parameters: ``phase`` (both): prefill, decode or both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest
from kv_picker.state.hardware import HardwareClass, HardwareTable

_PHASES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class HardwareClassParams:
    phase: str = "both"

    def validate(self) -> None:
        if self.phase not in _PHASES:
            raise ValueError(f"parameter 'phase' must be one of {', '.join(_PHASES)}")


def class_speed(hardware: HardwareClass, phase: str) -> float:
    if phase == "prefill":
        return hardware.prefill_speed
    if phase == "decode":
        return hardware.decode_speed
    return math.sqrt(hardware.prefill_speed * hardware.decode_speed)


class HardwareClassScorer:
    type_name: ClassVar[str] = "hardware-class-scorer"
    Params = HardwareClassParams

    def __init__(self, name: str, params: HardwareClassParams, ctx: BuildContext) -> None:
        self.name = name
        self._phase = params.phase
        self._table: HardwareTable = ctx.hardware

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        speeds = [class_speed(self._table.of(e.labels), self._phase) for e in candidates]
        fastest = max(speeds)
        for i, speed in enumerate(speeds):
            out[i] = speed / fastest
