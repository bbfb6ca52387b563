"""Report pieces: percentiles, the trace's hit-ratio bounds, the table."""

from __future__ import annotations

import math

import pytest

from kv_picker_bench.harness.report import (
    hit_ratio_bounds,
    latency_stats,
    markdown_table,
    summarize,
)
from tests.benchmarks.harness.conftest import make_trace, simulate, small_cluster, small_trace


def test_latency_stats_nearest_rank() -> None:
    stats = latency_stats([float(v) for v in range(1, 101)] + [math.nan])
    assert stats == {"mean": 50.5, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert math.isnan(latency_stats([])["p90"])


def test_bounds_on_a_hand_made_trace() -> None:
    # Block size 16; each id is one block. Request 2 repeats request 1's first two blocks,
    # request 3 repeats all of request 1 (but the last prompt token is always recomputed).
    trace = make_trace(
        [
            (0.0, 48, 1, [1, 2, 3]),
            (1.0, 48, 1, [1, 2, 4]),
            (2.0, 48, 1, [1, 2, 3]),
            (3.0, 48, 1, [5, 6, 7]),
            (4.0, 48, 1, [1, 2, 3]),
        ]
    )
    tiny = small_cluster(1, num_gpu_blocks=6)
    bounds = hit_ratio_bounds(trace, tiny)
    # Unbounded: 0 + 32 + 32 (3 blocks held, 2 usable) + 0 + 32 = 96 of 240 tokens.
    assert bounds["unbounded"] == pytest.approx(96 / 240)
    # LRU of 6 blocks: after r3 it holds 4,1,2,3 (most recent last); r4 inserts 5,6,7 and
    # evicts 4; r5 still finds 1,2,3: 32 tokens. Total 32 + 32 + 0 + 32 = 96.
    assert bounds["pooled_lru"] == pytest.approx(96 / 240)
    smaller = hit_ratio_bounds(trace, small_cluster(1, num_gpu_blocks=3))
    assert smaller["pooled_lru"] < bounds["pooled_lru"]
    assert bounds["pooled_capacity_tokens"] == 6 * 16


def test_no_policy_beats_the_unbounded_bound() -> None:
    trace = small_trace(150)
    config = small_cluster(4)
    bounds = hit_ratio_bounds(trace, config)
    for policy in ("random", "kv-picker", "sglang-cache-aware"):
        metrics = summarize(simulate(trace, config, policy, check=False), config)
        assert 0.0 < metrics.hit_ratio <= bounds["unbounded"]
        assert metrics.ok == 150 and metrics.errors == metrics.shed == 0
        assert metrics.imbalance >= 1.0


def test_markdown_table_rows() -> None:
    trace = small_trace(40)
    config = small_cluster(2)
    rows = [
        summarize(simulate(trace, config, p, check=False), config) for p in ("random", "kv-picker")
    ]
    text = markdown_table(rows, hit_ratio_bounds(trace, config))
    lines = text.splitlines()
    assert lines[0].startswith("| policy | ok | errors | shed | TTFT s (mean / p50 / p90 / p99)")
    assert lines[2].startswith("| random | 40 | 0 | 0 | ")
    assert lines[3].startswith("| kv-picker | 40 |")
    assert "bound: unbounded single cache" in lines[4]
    assert "bound: pooled LRU" in lines[5]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
