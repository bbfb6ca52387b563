"""Ideal caches, zero-queue TTFT floors and offered load: what no router can beat."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kv_picker_bench.harness.floors import (
    decode_work_s,
    fastest_prefill_class,
    ideal_caches,
    load_of,
    scale_to_load,
    ttft_floors,
)
from kv_picker_bench.harness.simulator import OK, EndpointSetup
from kv_picker_bench.sim.engine import hardware_class
from tests.benchmarks.harness.conftest import make_trace, simulate, small_cluster, small_trace


def test_ideal_caches_count_reuse_and_the_pooled_lru_forgets() -> None:
    # Two requests of 4 blocks sharing the first 3; then 40 unrelated blocks; then the first again.
    trace = make_trace(
        [
            (0.0, 64, 1, [1, 2, 3, 4]),
            (1.0, 64, 1, [1, 2, 3, 5]),
            (2.0, 640, 1, list(range(100, 140))),
            (3.0, 64, 1, [1, 2, 3, 4]),
        ]
    )
    big = ideal_caches(trace, small_cluster(1, num_gpu_blocks=1000, cache_output_blocks=False))
    assert big.unbounded_cached == [0, 48, 0, 48]  # at most prompt - 1 tokens: 3 blocks of 16
    assert big.pooled_cached == big.unbounded_cached
    small = ideal_caches(trace, small_cluster(1, num_gpu_blocks=20, cache_output_blocks=False))
    assert small.unbounded_cached == big.unbounded_cached
    assert small.pooled_cached == [0, 48, 0, 0]  # 40 new blocks pushed the prefix out
    ratios = small.hit_ratios()
    assert 0 <= ratios["pooled_lru"] <= ratios["unbounded"] <= 1


def test_floors_are_isolated_prefills_on_the_fastest_class() -> None:
    trace = make_trace([(0.0, 4000, 8, list(range(1, 251))), (1.0, 4000, 8, list(range(1, 251)))])
    config = replace(
        small_cluster(2, num_gpu_blocks=2000),
        endpoints=(EndpointSetup("both", "A100"), EndpointSetup("both", "H100")),
    )
    assert fastest_prefill_class(config).name == "H100"
    floors = ttft_floors(trace, config)
    h100 = hardware_class("H100")
    timing = config.timing
    assert floors.strict_s[0] == pytest.approx(timing.isolated_prefill_s(h100, 4000, 0, 8192))
    # Whole blocks only: 249 of the 250 (the last token is recomputed, its block with it).
    assert floors.strict_s[1] == pytest.approx(timing.isolated_prefill_s(h100, 4000, 3984, 8192))
    assert floors.strict_s[1] < floors.strict_s[0] / 10  # the repeat computes one block
    assert floors.practical_s == floors.strict_s  # nothing evicted


@pytest.mark.parametrize("policy", ["kv-picker", "round-robin", "gie-default"])
def test_no_policy_beats_the_strict_floor(policy: str) -> None:
    trace = small_trace(150, rate=60.0)
    config = small_cluster(3)
    floors = ttft_floors(trace, config)
    result = simulate(trace, config, policy)
    for outcome in result.outcomes:
        if outcome.status == OK:
            assert outcome.ttft_s >= floors.strict_s[outcome.index] - 1e-9


def test_scaling_hits_the_offered_load_and_decode_can_bind() -> None:
    trace = small_trace(200)
    config = small_cluster(4)
    floors = ttft_floors(trace, config)
    for target in (0.3, 1.2):
        scaled = scale_to_load(trace, config, target, floors)
        load = load_of(scaled, config, floors)
        assert load.binding == pytest.approx(target)
        assert [r.input_tokens for r in scaled.requests] == [r.input_tokens for r in trace.requests]
    # Long answers to cached prompts: decode, not prefill, is what fills the cluster.
    chatty = make_trace([(i * 0.1, 64, 2000, [1, 2, 3, 4]) for i in range(50)])
    load = load_of(chatty, config)
    assert load.decode > load.prefill
    assert decode_work_s(chatty, config) > 0
