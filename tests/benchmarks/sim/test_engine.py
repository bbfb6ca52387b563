"""Tests of the engine's scheduling and timing model (pure, driven with model time)."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise

import pytest

from kv_picker_bench.sim.engine import (
    HARDWARE_CLASSES,
    EngineConfig,
    FinishedRequest,
    RequestRejected,
    SimEngine,
    TokenEvent,
    hardware_class,
)
from kv_picker_bench.sim.timing import LEGACY
from tests.benchmarks.sim.conftest import RecordingListener


@dataclass
class Run:
    tokens: dict[str, list[TokenEvent]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, FinishedRequest] = field(default_factory=dict)
    durations_s: list[float] = field(default_factory=list)
    end_s: float = 0.0


def run_until_idle(engine: SimEngine, now_s: float = 0.0, max_steps: int = 100_000) -> Run:
    """Steps the engine back to back until it has no work, as the server's loop does."""
    run = Run(end_s=now_s)
    for _ in range(max_steps):
        if not engine.has_work:
            return run
        result = engine.step(run.end_s)
        assert result.duration_s > 0
        run.durations_s.append(result.duration_s)
        run.end_s = result.end_s
        for event in result.tokens:
            run.tokens[event.req_id].append(event)
        for summary in result.finished:
            run.finished[summary.req_id] = summary
        engine.cache.check_invariants()
    raise AssertionError("the engine did not drain")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 32_000) for _ in range(length)]


def test_repeated_prompt_has_lower_ttft_and_counts_hits() -> None:
    engine = SimEngine(EngineConfig())
    tokens = prompt(1, 1000)
    engine.add_request("a", tokens, 4, now_s=0.0)
    first = run_until_idle(engine).finished["a"]
    engine.add_request("b", tokens, 4, now_s=10.0)
    second = run_until_idle(engine, 10.0).finished["b"]

    assert first.num_cached_tokens == 0
    # 62 full blocks of 16; all are hits (the last prompt token, in the partial block, is
    # recomputed anyway).
    assert second.num_cached_tokens == 992
    assert first.ttft_s is not None and second.ttft_s is not None
    assert second.ttft_s < first.ttft_s / 3
    # One step each: the whole prompt, then the 8 tokens after the 992 cached ones.
    timing, h100 = engine.config.timing, engine.config.hardware
    assert first.ttft_s == pytest.approx(timing.step_duration_s(h100, 1, [(1000, 0)]))
    assert second.ttft_s == pytest.approx(timing.step_duration_s(h100, 1, [(8, 992)]))
    assert engine.cache.queries_tokens == 2000
    assert engine.cache.hits_tokens == 992
    assert engine.stats.prompt_tokens == 2000
    assert engine.stats.generation_tokens == 8


def test_fully_cached_prompt_still_recomputes_its_last_token() -> None:
    engine = SimEngine(EngineConfig())
    tokens = prompt(2, 32)
    engine.add_request("a", tokens, 1, now_s=0.0)
    run_until_idle(engine)
    engine.add_request("b", tokens, 1, now_s=1.0)
    assert run_until_idle(engine, 1.0).finished["b"].num_cached_tokens == 16


def test_prefill_time_grows_with_uncached_tokens() -> None:
    ttfts = []
    for length in (100, 1000, 4000):
        engine = SimEngine(EngineConfig())
        engine.add_request("r", prompt(length, length), 1, now_s=0.0)
        summary = run_until_idle(engine).finished["r"]
        assert summary.ttft_s is not None
        ttfts.append(summary.ttft_s)
    assert ttfts[0] < ttfts[1] < ttfts[2]


def test_decode_step_grows_with_batch_size() -> None:
    timing = LEGACY
    h100 = HARDWARE_CLASSES["H100"]
    assert timing.step_duration_s(h100, 1) == pytest.approx(0.020)
    assert timing.step_duration_s(h100, 33) == pytest.approx(0.036)
    assert timing.step_duration_s(h100, 0) == 0.0

    def mean_inter_token_s(batch: int) -> float:
        engine = SimEngine(EngineConfig())
        for i in range(batch):
            engine.add_request(f"r{i}", prompt(i, 64), 20, now_s=0.0)
        run = run_until_idle(engine)
        gaps = [
            later.time_s - earlier.time_s
            for events in run.tokens.values()
            for earlier, later in pairwise(events)
        ]
        return sum(gaps) / len(gaps)

    assert mean_inter_token_s(1) < mean_inter_token_s(8) < mean_inter_token_s(32)


def test_hardware_class_scales_time_and_capacity() -> None:
    def ttft(name: str) -> float:
        engine = SimEngine(EngineConfig(hardware=hardware_class(name)))
        engine.add_request("r", prompt(3, 2000), 1, now_s=0.0)
        summary = run_until_idle(engine).finished["r"]
        assert summary.ttft_s is not None
        return summary.ttft_s

    assert ttft("H100") < ttft("A100") < ttft("L4")
    assert hardware_class("default") == hardware_class("H100")
    # The shared datasheet table: an L4 has 24 of an H100's 80 GB.
    assert EngineConfig(hardware=hardware_class("L4")).resolved_num_gpu_blocks == round(2048 * 0.3)
    with pytest.raises(ValueError, match=r"known: 1g\.10gb"):
        hardware_class("TPU")


def test_no_request_is_lost_under_load() -> None:
    # A small cache and batch force waiting, eviction and chunked prefill at once.
    engine = SimEngine(EngineConfig(num_gpu_blocks=128, max_num_seqs=8, max_num_batched_tokens=256))
    rng = random.Random(7)
    shared = prompt(99, 160)
    expected: dict[str, int] = {}
    finished: dict[str, FinishedRequest] = {}
    num_tokens: dict[str, int] = defaultdict(int)
    now_s = 0.0
    for i in range(60):
        own = prompt(i, rng.randrange(1, 400))
        tokens = shared + own if i % 2 else own
        max_tokens = rng.randrange(1, 40)
        engine.add_request(f"r{i}", tokens, max_tokens, now_s=now_s)
        expected[f"r{i}"] = max_tokens
        # Interleave arrivals with steps.
        if i % 5 == 0:
            result = engine.step(now_s)
            now_s = result.end_s
            for event in result.tokens:
                num_tokens[event.req_id] += 1
            finished.update((s.req_id, s) for s in result.finished)
        assert engine.num_running <= 8
    run = run_until_idle(engine, now_s)
    finished.update(run.finished)
    for req_id, events in run.tokens.items():
        num_tokens[req_id] += len(events)

    assert set(finished) == set(expected)
    assert dict(num_tokens) == expected
    for req_id, summary in finished.items():
        assert summary.finish_reason == "length"
        assert summary.num_output_tokens == expected[req_id]
    assert engine.num_waiting == engine.num_running == 0
    assert engine.cache.usage == 0.0
    assert engine.cache.hits_tokens > 0
    assert engine.stats.finished_by_reason["length"] == 60


def test_every_request_gets_exactly_max_tokens_in_order() -> None:
    engine = SimEngine(EngineConfig(num_gpu_blocks=64, max_num_seqs=4))
    for i in range(12):
        engine.add_request(f"r{i}", prompt(i, 50 + i), 5 + i, now_s=0.0)
    run = run_until_idle(engine)
    assert set(run.finished) == {f"r{i}" for i in range(12)}
    for i in range(12):
        events = run.tokens[f"r{i}"]
        assert [e.index for e in events] == list(range(5 + i))
        assert [e.finished for e in events] == [False] * (4 + i) + [True]
        summary = run.finished[f"r{i}"]
        assert summary.first_token_s == events[0].time_s
        assert summary.finish_s == events[-1].time_s


def test_request_waits_until_its_blocks_fit() -> None:
    engine = SimEngine(EngineConfig(num_gpu_blocks=10, block_size=16))
    engine.add_request("a", prompt(1, 100), 10, now_s=0.0)  # 7 blocks
    engine.add_request("b", prompt(2, 100), 10, now_s=0.0)  # 7 blocks: waits for a
    engine.step(0.0)
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    run = run_until_idle(engine)
    a, b = run.finished["a"], run.finished["b"]
    assert b.scheduled_s is not None
    assert b.scheduled_s >= a.finish_s


def test_impossible_requests_are_rejected_up_front() -> None:
    engine = SimEngine(EngineConfig(num_gpu_blocks=4, block_size=16, max_model_len=1000))
    with pytest.raises(RequestRejected, match="KV blocks"):
        engine.add_request("big", prompt(1, 100), 1, now_s=0.0)
    with pytest.raises(RequestRejected, match="maximum context length"):
        engine.add_request("long", prompt(1, 990), 20, now_s=0.0)
    with pytest.raises(RequestRejected):
        engine.add_request("empty", [], 1, now_s=0.0)
    with pytest.raises(RequestRejected):
        engine.add_request("zero", [1], 0, now_s=0.0)
    engine.add_request("ok", prompt(1, 40), 8, now_s=0.0)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("ok", prompt(1, 40), 8, now_s=0.0)
    assert engine.num_waiting == 1


def test_chunked_prefill_respects_the_token_budget() -> None:
    engine = SimEngine(EngineConfig(max_num_batched_tokens=512))
    engine.add_request("r", prompt(5, 2000), 2, now_s=0.0)
    steps = []
    now_s = 0.0
    while engine.has_work:
        result = engine.step(now_s)
        now_s = result.end_s
        steps.append(result)
        assert result.num_prefill_tokens + result.num_decode_seqs <= 512
    # ceil(2000 / 512) = 4 prefill steps, the last one also samples the first token.
    assert [s.num_prefill_tokens for s in steps] == [512, 512, 512, 464, 0]
    assert [len(s.tokens) for s in steps] == [0, 0, 0, 1, 1]


def test_max_num_seqs_bounds_the_batch() -> None:
    engine = SimEngine(EngineConfig(max_num_seqs=3))
    for i in range(5):
        engine.add_request(f"r{i}", prompt(i, 20), 3, now_s=0.0)
    engine.step(0.0)
    assert (engine.num_running, engine.num_waiting) == (3, 2)


def test_cache_salt_isolates_prefixes() -> None:
    engine = SimEngine(EngineConfig())
    tokens = prompt(8, 200)
    engine.add_request("a", tokens, 1, now_s=0.0, cache_salt="tenant-a")
    run_until_idle(engine)
    engine.add_request("b", tokens, 1, now_s=1.0, cache_salt="tenant-b")
    engine.add_request("c", tokens, 1, now_s=1.0)
    run = run_until_idle(engine, 1.0)
    assert run.finished["b"].num_cached_tokens == 0
    assert run.finished["c"].num_cached_tokens == 0
    engine.add_request("d", tokens, 1, now_s=2.0, cache_salt="tenant-a")
    assert run_until_idle(engine, 2.0).finished["d"].num_cached_tokens == 192


def test_abort_frees_blocks_and_counts() -> None:
    engine = SimEngine(EngineConfig())
    engine.add_request("a", prompt(1, 100), 50, now_s=0.0)
    engine.add_request("w", prompt(2, 100), 50, now_s=0.0)
    engine.step(0.0)
    assert engine.cache.usage > 0
    summary = engine.abort_request("a", 0.5)
    assert summary is not None and summary.finish_reason == "abort"
    assert engine.abort_request("w", 0.5) is not None
    assert engine.abort_request("missing", 0.5) is None
    assert engine.cache.usage == 0.0
    assert not engine.has_work
    assert engine.stats.finished_by_reason == {"abort": 2}


def test_listener_sees_stored_blocks_with_tokens_and_parents() -> None:
    listener = RecordingListener()
    engine = SimEngine(EngineConfig(max_num_batched_tokens=40), listener)
    tokens = prompt(4, 70)
    engine.add_request("a", tokens, 1, now_s=0.0)
    run_until_idle(engine)
    keys = engine.hasher.block_keys(tokens)
    assert [b.block_hash for b in listener.stored] == keys
    assert [b.parent_hash for b in listener.stored] == [None, *keys[:-1]]
    assert [list(b.token_ids) for b in listener.stored] == [
        tokens[i * 16 : (i + 1) * 16] for i in range(4)
    ]
    engine.reset_prefix_cache()
    assert listener.cleared == 1


def test_output_is_deterministic() -> None:
    def outputs(seed: int) -> list[int]:
        engine = SimEngine(EngineConfig(seed=seed))
        engine.add_request("r", prompt(1, 30), 10, now_s=0.0)
        return [e.token_id for e in run_until_idle(engine).tokens["r"]]

    assert outputs(0) == outputs(0)
    assert outputs(0) != outputs(1)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError):
        EngineConfig(num_gpu_blocks=0)


@pytest.mark.parametrize(("cached_when", "hit"), [("scheduled", 192), ("computed", 0)])
def test_a_prompt_admitted_in_the_same_step_hits_the_blocks_scheduled_before_it(
    cached_when: str, hit: int
) -> None:
    # vLLM v1 caches full blocks when it allocates their slots: the second request, scheduled
    # after the first in the same step, finds the first's 12 full blocks (the last prompt
    # token is always recomputed). The older model hits only blocks whose step has ended.
    engine = SimEngine(EngineConfig(cached_when=cached_when))
    tokens = prompt(21, 200)
    engine.add_request("a", tokens, 2, now_s=0.0)
    engine.add_request("b", tokens, 2, now_s=0.0)
    run = run_until_idle(engine)
    assert run.finished["a"].num_cached_tokens == 0
    assert run.finished["b"].num_cached_tokens == hit
    assert engine.cache.hits_tokens == hit


@pytest.mark.parametrize(("cached_when", "hit"), [("scheduled", 992), ("computed", 512)])
def test_a_prompt_admitted_beside_a_running_chunk_hits_that_chunks_blocks(
    cached_when: str, hit: int
) -> None:
    # A 1,000-token prompt in 512-token chunks: the second request waits behind the first
    # chunk's step and is admitted with the last chunk, which is scheduled before it.
    engine = SimEngine(EngineConfig(max_num_batched_tokens=512, cached_when=cached_when))
    tokens = prompt(22, 1000)
    engine.add_request("a", tokens, 2, now_s=0.0)
    first = engine.step(0.0)
    assert first.num_prefill_tokens == 512
    engine.add_request("b", tokens, 2, now_s=first.end_s)
    run = run_until_idle(engine, first.end_s)
    assert run.finished["b"].num_cached_tokens == hit


def test_cached_when_must_be_a_known_model() -> None:
    with pytest.raises(ValueError, match="cached_when must be one of scheduled, computed"):
        EngineConfig(cached_when="written")
