"""The timing profiles: sane figures, attention over the context, and the isolated-prefill floor
matching what the engine does."""

from __future__ import annotations

import math
import random
from dataclasses import fields
from itertools import pairwise

import pytest

from kv_picker_bench.sim.engine import EngineConfig, SimEngine, hardware_class
from kv_picker_bench.sim.timing import (
    DEFAULT_TIMING,
    LEGACY,
    LLAMA_8B_H100,
    LLAMA_70B_H100_TP4,
    TIMING_PROFILES,
    TimingModel,
    timing_profile,
)

H100 = hardware_class("H100")
SOURCED = [p for p in TIMING_PROFILES.values() if p is not LEGACY]


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 32_000) for _ in range(length)]


def first_token_s(engine: SimEngine, req_id: str, now_s: float) -> float:
    """Steps an engine back to back until ``req_id`` has its first token; returns the time."""
    while True:
        result = engine.step(now_s)
        assert result.duration_s > 0
        now_s = result.end_s
        for event in result.tokens:
            if event.req_id == req_id and event.index == 0:
                return event.time_s


def drain(engine: SimEngine, now_s: float) -> float:
    while engine.has_work:
        now_s = engine.step(now_s).end_s
    return now_s


@pytest.mark.parametrize("profile", TIMING_PROFILES.values(), ids=lambda p: p.name)
def test_every_profile_is_positive_and_finite(profile: TimingModel) -> None:
    assert profile.summary
    for spec in fields(profile):
        value = getattr(profile, spec.name)
        if isinstance(value, str):
            continue
        assert math.isfinite(value) and value >= 0, spec.name
    for name in ("step_base_s", "prefill_s_per_token", "kv_bytes_per_token", "kv_capacity_tokens"):
        assert getattr(profile, name) > 0, name
    if profile is not LEGACY:
        assert profile.attention_s_per_token_pair > 0
        assert profile.kv_read_s_per_token > 0
        assert profile.step_per_seq_s > 0
    # A long prompt on the slowest class still costs a positive, finite time.
    slowest = hardware_class("H100-MIG-1g.10gb")
    floor_s = profile.isolated_prefill_s(slowest, 130_000, 0, 8192)
    assert 0 < floor_s < math.inf


def test_profiles_follow_the_documented_arithmetic() -> None:
    assert DEFAULT_TIMING is LLAMA_8B_H100 and timing_profile("llama-3.1-8b-h100") is LLAMA_8B_H100
    # 2 (K, V) x layers x 8 KV heads x 128 x 2 bytes.
    assert LLAMA_8B_H100.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert LLAMA_70B_H100_TP4.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    # 0.9 of 80 GB per GPU, less the BF16 weights.
    assert LLAMA_8B_H100.kv_capacity_tokens == (72e9 - 2 * 8_030_261_248) // 131_072
    assert LLAMA_70B_H100_TP4.kv_capacity_tokens == (4 * 72e9 - 2 * 70_553_706_496) // 327_680
    assert LLAMA_8B_H100.prefill_s_per_token == pytest.approx(21.71e-6, rel=1e-3)
    assert LLAMA_70B_H100_TP4.step_base_s == pytest.approx(21.33e-3, rel=1e-3)
    # The legacy figures are exactly the old model's.
    assert LEGACY.step_duration_s(H100, 1, [(1000, 0)]) == pytest.approx(0.020 + 1000 / 10_000)
    with pytest.raises(ValueError, match=r"known: llama-3\.1-8b-h100"):
        timing_profile("gpt-5")


def test_a_profile_rejects_meaningless_figures() -> None:
    with pytest.raises(ValueError, match="attention_s_per_token_pair"):
        TimingModel("x", 0.01, 0.0, 1e-5, -1e-9, 0.0, 1, 1)
    with pytest.raises(ValueError, match="step_base_s"):
        TimingModel("x", 0.0, 0.0, 1e-5, 0.0, 0.0, 1, 1)
    with pytest.raises(ValueError, match="kv_read_s_per_token"):
        TimingModel("x", 0.01, 0.0, 1e-5, 0.0, math.nan, 1, 1)


@pytest.mark.parametrize("profile", SOURCED, ids=lambda p: p.name)
def test_attention_makes_long_prompts_cost_more_than_linear(profile: TimingModel) -> None:
    one = profile.isolated_prefill_s(H100, 32_768, 0, 8192)
    two = profile.isolated_prefill_s(H100, 65_536, 0, 8192)
    # Steps and linear layers double; attention, n^2 / 2 token pairs in all, quadruples.
    steps = 32_768 // 8192
    fixed_s = steps * profile.step_base_s + 32_768 * profile.prefill_s_per_token
    attention_s = profile.attention_s_per_token_pair * 32_768**2 / 2
    assert one == pytest.approx(fixed_s + attention_s)
    assert two == pytest.approx(2 * fixed_s + 4 * attention_s)
    assert two / one > 2.3
    # A chunk's own cost: the same tokens further into the context cost more.
    near = profile.prefill_chunk_s(H100, 8192, 0)
    far = profile.prefill_chunk_s(H100, 8192, 100_000)
    assert far - near == pytest.approx(profile.attention_s_per_token_pair * 8192 * 100_000)
    assert far > 1.5 * near


def test_legacy_prefill_stays_linear() -> None:
    one = LEGACY.isolated_prefill_s(H100, 32_768, 0, 8192)
    two = LEGACY.isolated_prefill_s(H100, 65_536, 0, 8192)
    assert two == pytest.approx(2 * one)


@pytest.mark.parametrize("profile", TIMING_PROFILES.values(), ids=lambda p: p.name)
def test_decode_step_grows_with_the_kv_read(profile: TimingModel) -> None:
    a100 = hardware_class("A100")
    base = profile.step_duration_s(a100, 8)
    loaded = profile.step_duration_s(a100, 8, decode_context_tokens=40_000)
    assert loaded - base == pytest.approx(profile.kv_read_s(a100, 40_000))
    assert profile.kv_read_s(a100, 40_000) == pytest.approx(
        40_000 * profile.kv_read_s_per_token / a100.decode_speed
    )
    if profile is not LEGACY:
        assert loaded > base


@pytest.mark.parametrize("profile", SOURCED, ids=lambda p: p.name)
def test_chunked_prefill_costs_more_per_chunk_further_into_the_prompt(
    profile: TimingModel,
) -> None:
    engine = SimEngine(EngineConfig(timing=profile, max_model_len=65_536, num_gpu_blocks=4096))
    engine.add_request("long", prompt(1, 4 * 8192 + 100), 1, now_s=0.0)
    durations = []
    now_s = 0.0
    while engine.has_work:
        result = engine.step(now_s)
        durations.append(result.duration_s)
        now_s = result.end_s
    assert len(durations) == 5  # four full chunks, then the 100-token tail with the first token
    full = durations[:4]
    assert full == sorted(full) and len(set(full)) == 4
    # Each full chunk sits 8,192 tokens further in: it pays 8,192 x 8,192 more token pairs.
    for earlier, later in pairwise(full):
        assert later - earlier == pytest.approx(profile.attention_s_per_token_pair * 8192 * 8192)


@pytest.mark.parametrize("profile", TIMING_PROFILES.values(), ids=lambda p: p.name)
@pytest.mark.parametrize("hardware", ["H100", "A100", "H100-MIG-3g.40gb"])
@pytest.mark.parametrize("length", [1, 17, 8192, 8193, 20_000])
def test_isolated_prefill_is_the_idle_engine_ttft(
    profile: TimingModel, hardware: str, length: int
) -> None:
    config = EngineConfig(
        timing=profile,
        hardware=hardware_class(hardware),
        max_model_len=32_768,
        num_gpu_blocks=4096,
        max_num_batched_tokens=8192,
    )
    engine = SimEngine(config)
    tokens = prompt(length, length)
    engine.add_request("cold", tokens, 3, now_s=5.0)
    ttft_s = first_token_s(engine, "cold", 5.0) - 5.0
    assert ttft_s == pytest.approx(
        profile.isolated_prefill_s(config.hardware, length, 0, 8192), rel=1e-12
    )
    assert ttft_s == pytest.approx(engine.prefill_duration_s(length), rel=1e-12)

    # The same prompt extended, on the now idle engine: its cached blocks are not recomputed.
    now_s = drain(engine, 5.0) + 1.0
    longer = [*tokens, *prompt(length + 1, 500)]
    engine.add_request("warm", longer, 1, now_s=now_s)
    warm_s = first_token_s(engine, "warm", now_s) - now_s
    cached = engine.num_cached_prompt_tokens(tokens)
    assert cached == (length // 16) * 16
    assert warm_s == pytest.approx(
        profile.isolated_prefill_s(config.hardware, len(longer), cached, 8192), rel=1e-12
    )


def test_isolated_prefill_recomputes_the_last_prompt_token() -> None:
    whole = DEFAULT_TIMING.isolated_prefill_s(H100, 64, 64, 8192)
    assert whole == DEFAULT_TIMING.isolated_prefill_s(H100, 64, 63, 8192)
    assert whole == pytest.approx(DEFAULT_TIMING.step_duration_s(H100, 1, [(1, 63)]))
    with pytest.raises(ValueError):
        DEFAULT_TIMING.isolated_prefill_s(H100, 0, 0, 8192)
