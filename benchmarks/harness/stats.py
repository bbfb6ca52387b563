"""Latency statistics shared by every report: mean and nearest-rank percentiles."""

from __future__ import annotations

import math
from collections.abc import Iterable

QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


def latency_stats(values: Iterable[float]) -> dict[str, float]:
    """Mean and nearest-rank p50/p90/p99 of the finite values (nan when there are none)."""
    ordered = sorted(v for v in values if not math.isnan(v))
    stats: dict[str, float] = {"mean": sum(ordered) / len(ordered) if ordered else math.nan}
    for name, fraction in QUANTILES:
        if not ordered:
            stats[name] = math.nan
            continue
        rank = max(0, min(len(ordered) - 1, math.ceil(fraction * len(ordered) - 1e-9) - 1))
        stats[name] = ordered[rank]
    return stats
