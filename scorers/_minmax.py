"""Min-max scoring shared by the load scorers: the least loaded candidate scores 1."""

from __future__ import annotations

from collections.abc import Sequence


def write_min_max_inverse(loads: Sequence[float], out: list[float]) -> None:
    """``out[i] = (max - loads[i]) / (max - min)``; all equal -> 1 for everyone."""
    low = min(loads)
    high = max(loads)
    if high == low:
        for i in range(len(loads)):
            out[i] = 1.0
        return
    span = high - low
    for i, load in enumerate(loads):
        out[i] = (high - load) / span
