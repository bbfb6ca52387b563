"""Building blocks of synthetic workloads: arrival processes and samplers.

Why apart from the families: every family (:mod:`~kv_picker_bench.harness.families`) draws its
arrivals and lengths with these, always from a :class:`random.Random` the caller seeded, never
the global generator, so a seed gives one workload in every process.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from kv_picker_bench.harness.trace_model import TraceError

# ---------------------------------------------------------------------------- arrivals


def parse_stages(text: str) -> list[tuple[float, float]]:
    """``"15x50/3x20"`` -> [(15 req/s, 50 s), (3 req/s, 20 s)]."""
    stages = []
    for item in text.split("/"):
        rate_text, sep, duration_text = item.partition("x")
        try:
            rate, duration = float(rate_text), float(duration_text)
        except ValueError:
            raise TraceError(f"stage {item!r}: expected RATExSECONDS, e.g. 15x50") from None
        if not sep or rate <= 0 or duration <= 0:
            raise TraceError(f"stage {item!r}: expected RATExSECONDS with positive numbers")
        stages.append((rate, duration))
    return stages


def poisson_arrivals(
    rng: random.Random, count: int, rate_start: float, rate_end: float
) -> list[float]:
    """``count`` Poisson arrival times whose rate moves linearly from start to end.

    With a ramp, arrivals are spaced evenly in expected count, so the rate at the k-th arrival
    is ``rate_start + (rate_end - rate_start) * k / count``.
    """
    if rate_start <= 0 or rate_end <= 0:
        raise TraceError("rates must be positive")
    times = []
    now_s = 0.0
    for k in range(count):
        rate = rate_start + (rate_end - rate_start) * k / max(1, count)
        now_s += rng.expovariate(rate)
        times.append(now_s)
    return times


def staged_arrivals(rng: random.Random, stages: Sequence[tuple[float, float]]) -> list[float]:
    """Poisson arrivals for consecutive constant-rate stages (llm-d-benchmark style)."""
    times = []
    start_s = 0.0
    for rate, duration_s in stages:
        now_s = start_s
        while True:
            now_s += rng.expovariate(rate)
            if now_s >= start_s + duration_s:
                break
            times.append(now_s)
        start_s += duration_s
    return times


# ---------------------------------------------------------------------------- samplers


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    """A number whose logarithm is uniform between ``log(low)`` and ``log(high)``."""
    return math.exp(rng.uniform(math.log(low), math.log(high)))
