"""Workload families: seeded draws, overrides, the sharing each family promises, replays."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest

from kv_picker_bench.harness.cli import replay_main
from kv_picker_bench.harness.families import FAMILIES, GENERATORS, Range
from kv_picker_bench.harness.report import hit_ratio_bounds
from kv_picker_bench.harness.synthesis import PrefixBlocks, gamma_arrivals
from kv_picker_bench.harness.traces import (
    Trace,
    TraceError,
    parse_trace_spec,
)
from tests.benchmarks.harness.conftest import small_cluster

# Small members of each family: a few dozen requests, short prompts (seconds to replay).
SMALL: dict[str, dict[str, int | float]] = {
    "shared-prefix": {"requests": 40, "groups": 4, "context_tokens": 300},
    "chat": {"sessions": 10, "turns": 3, "system_tokens": 200},
}


def small(name: str, seed: int | None = 1, **overrides: float) -> Trace:
    return FAMILIES[name].build(seed, **{**SMALL[name], **overrides})


def rows(trace: Trace) -> list[tuple[object, ...]]:
    return [dataclasses.astuple(r) for r in trace.requests]


def test_every_family_is_registered_and_parsed() -> None:
    assert set(SMALL) == set(FAMILIES)
    assert set(GENERATORS) == set(FAMILIES) | {"llm-d"}
    for name, family in FAMILIES.items():
        assert family.name == name and family.description
        assert "\n" not in family.description and len(family.description) < 100
    trace = parse_trace_spec("chat:seed=3,sessions=2,turns=2,system=64")
    assert trace.name == "chat-s3" and trace.source.startswith("chat:seed=3")
    assert len({r.session for r in trace.requests}) == 2
    with pytest.raises(TraceError, match="unknown parameter 'colour=1'"):
        parse_trace_spec("chat:colour=1")
    with pytest.raises(TraceError, match="bad value"):
        parse_trace_spec("chat:seed=x")
    with pytest.raises(TraceError, match="unknown parameter 'colour'"):
        FAMILIES["chat"].build(1, colour=2)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_seed_gives_one_workload(name: str) -> None:
    assert rows(small(name, 7)) == rows(small(name, 7))
    assert rows(small(name, 7)) != rows(small(name, 8))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_seeds_draw_parameters_within_their_ranges(name: str) -> None:
    family = FAMILIES[name]
    ranges = family.ranges()
    assert ranges, "a family draws at least one parameter"
    draws = [family.draw(seed) for seed in range(12)]
    assert draws[1] != draws[2]
    for key, span in ranges.items():
        values = [draw[key] for draw in draws]
        assert all(span.low <= value <= span.high for value in values), key
        assert len(set(values)) > 1 or span.low == span.high, key
        assert span.low <= getattr(family.spec(), key) <= span.high, f"{key}: default"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_overrides_keep_the_other_draws_and_no_seed_keeps_the_defaults(name: str) -> None:
    family = FAMILIES[name]
    drawn = family.spec(5)
    key = next(iter(family.ranges()))
    forced = family.spec(5, **{key: getattr(drawn, key) + 1})
    assert getattr(forced, key) == getattr(drawn, key) + 1
    assert dataclasses.replace(forced, **{key: getattr(drawn, key)}) == drawn
    assert family.spec() == family.spec_type()
    assert drawn.seed == 5


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_requests_are_well_formed_and_ids_name_their_prefix(name: str) -> None:
    trace = small(name, 3)
    size = trace.block_tokens
    assert [r.index for r in trace.requests] == list(range(len(trace.requests)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(trace.requests))
    # Equal ids must mean equal prefixes: each id always sits at one position after one id.
    before: dict[int, tuple[int, int]] = {}
    for request in trace.requests:
        assert request.input_tokens >= 1 and request.output_tokens >= 1
        assert len(request.hash_ids) == -(-request.input_tokens // size)
        chains = [request.hash_ids]
        if request.output_ids is not None:
            total = request.input_tokens + request.output_tokens
            assert len(request.output_ids) == -(-total // size)
            chains.append(request.output_ids[: total // size])
        for chain in chains:
            for position, hash_id in enumerate(chain):
                previous = chain[position - 1] if position else -1
                assert before.setdefault(hash_id, (position, previous)) == (position, previous)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hit_ratio_bounds_are_ratios_in_order(name: str) -> None:
    trace = small(name, 2)
    for capacity in (50, 400, 100_000):
        bounds = hit_ratio_bounds(trace, small_cluster(2, num_gpu_blocks=capacity))
        assert 0.0 <= bounds["pooled_lru"] <= bounds["unbounded"] <= 1.0


def test_default_sizes_stay_replayable() -> None:
    for name, family in FAMILIES.items():
        for seed in (None, 1, 2):
            count = len(family.build(seed).requests)
            assert 200 <= count <= 2000, f"{name} seed {seed}: {count} requests"


# ------------------------------------------------------------------------ defaults


def test_chat_and_shared_prefix_keep_their_defaults_without_a_seed() -> None:
    assert rows(parse_trace_spec("chat")) == rows(FAMILIES["chat"].spec_type().build())
    assert len(parse_trace_spec("shared-prefix").requests) == 750
    drawn = FAMILIES["shared-prefix"].spec(1)
    assert drawn != FAMILIES["shared-prefix"].spec_type()


def test_a_family_without_randomized_parameters_only_seeds_the_build() -> None:
    llmd = GENERATORS["llm-d"]
    assert not llmd.ranges()
    assert llmd.spec(3) == dataclasses.replace(llmd.spec(), seed=3)
    assert {Range(1, 3).draw(random.Random(seed), "int") for seed in range(40)} == {1, 2, 3}
    rng = random.Random(0)
    sizes = [Range(2, 8, log=True).draw(rng, "float") for _ in range(400)]
    assert all(2 <= size <= 8 for size in sizes)
    # Log-uniform: 66% fall below the arithmetic middle (5), not half.
    assert 0.58 < sum(size < 5 for size in sizes) / len(sizes) < 0.74


# ------------------------------------------------------------------------ building blocks


def test_prefix_blocks_give_a_block_to_the_segment_that_ends_in_it() -> None:
    blocks = PrefixBlocks(16)
    system = blocks.child(blocks.root, "system", 40)
    assert blocks.prompt(system) == ([0, 1, 2], 40)  # two full blocks, a tail
    chunk_a = blocks.child(system, "a", 30)
    chunk_b = blocks.child(system, "b", 30)
    ids_a, tokens = blocks.prompt(chunk_a)
    ids_b, _ = blocks.prompt(chunk_b)
    assert tokens == 70 and ids_a[:2] == ids_b[:2] == [0, 1]
    assert ids_a[2] != 2 and ids_a[2] != ids_b[2]  # block 2 mixes system and chunk tokens
    assert blocks.child(system, "a", 30) is chunk_a
    with pytest.raises(ValueError, match="another length"):
        blocks.child(system, "a", 31)
    one, _ = blocks.prompt(blocks.unique(system, 8))
    two, _ = blocks.prompt(blocks.unique(system, 8))
    assert one[:2] == two[:2] and one[2] != two[2]


def test_gamma_arrivals_keep_the_rate_and_bunch_up_with_the_cv() -> None:
    smooth = gamma_arrivals(random.Random(1), 4000, 10.0, 1.0)
    bursty = gamma_arrivals(random.Random(1), 4000, 10.0, 3.0)
    for times in (smooth, bursty):
        assert times[-1] == pytest.approx(400.0, rel=0.15)

    def cv(times: list[float]) -> float:
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    assert cv(smooth) == pytest.approx(1.0, abs=0.1)
    assert cv(bursty) == pytest.approx(3.0, rel=0.2)


# ------------------------------------------------------------------------------ replays


def _spec_text(name: str) -> str:
    return f"{name}:seed=1," + ",".join(f"{k}={v}" for k, v in SMALL[name].items())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_replays_offline(name: str, tmp_path: Path) -> None:
    out = tmp_path / name
    argv = ["--trace", _spec_text(name), "--endpoints", "2", "--quiet", "--no-plots"]
    argv += ["--policy", "kv-picker", "--policy", "gie-default", "--jobs", "1"]
    assert replay_main([*argv, "--out", str(out)]) == 0
    document = json.loads((out / "results.json").read_text())
    count = len(small(name, 1).requests)
    assert document["trace"]["requests"] == count
    for metrics in document["loads"]["1"]["policies"].values():
        assert metrics["ok"] == count
        assert metrics["errors"] == metrics["rejected"] == metrics["shed"] == 0
