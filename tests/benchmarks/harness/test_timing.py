"""Timing profiles in the harness: the ``--timing`` flag end to end, the capacity and KV size it
implies, and the cluster simulator's idle TTFT matching the isolated-prefill floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_picker_bench.__main__ import main as bench_main
from kv_picker_bench.harness.args import build_parser, cluster_from_args
from kv_picker_bench.sim.engine import hardware_class
from kv_picker_bench.sim.timing import DEFAULT_TIMING, TIMING_PROFILES, TimingModel
from tests.benchmarks.harness.conftest import make_trace, simulate, small_cluster

H100 = hardware_class("H100")


def replay(out: Path, *extra: str) -> dict:
    argv = ["replay", "--trace", "chat:sessions=5,turns=2", "--endpoints", "2", *extra]
    assert bench_main([*argv, "--out", str(out), "--quiet"]) == 0
    document: dict = json.loads((out / "results.json").read_text())
    return document


def test_timing_flag_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mean_ttft: dict[str, float] = {}
    for name, profile in TIMING_PROFILES.items():
        document = replay(tmp_path / name, "--timing", name)
        cluster = document["cluster"]
        assert cluster["timing"]["profile"] == name
        assert cluster["timing"]["prefill_us_per_token"] == pytest.approx(
            profile.prefill_s_per_token * 1e6, abs=1e-6
        )
        # The profile sizes the KV cache and the KV transferred, unless given explicitly.
        blocks = profile.kv_capacity_tokens // 16
        assert [e["num_gpu_blocks"] for e in cluster["endpoints"]] == [blocks, blocks]
        assert cluster["kv_bytes_per_token"] == profile.kv_bytes_per_token
        policies = document["loads"]["1"]["policies"]
        assert all(p["ok"] == 10 for p in policies.values())
        mean_ttft[name] = policies["round-robin"]["ttft_s"]["mean"]
    capsys.readouterr()
    # Same requests, same routing: the 70B at TP4 prefills about three times slower.
    assert mean_ttft["llama-3.1-70b-h100-tp4"] > 2 * mean_ttft["llama-3.1-8b-h100"]
    assert len(set(mean_ttft.values())) == len(TIMING_PROFILES)


def test_explicit_capacity_and_kv_size_override_the_profile(tmp_path: Path) -> None:
    args = build_parser("replay").parse_args(
        ["--trace", "llm-d", "--timing", "llama-3.1-70b-h100-tp4", "--block-size", "32"]
    )
    config = cluster_from_args(args)
    assert config.timing is TIMING_PROFILES["llama-3.1-70b-h100-tp4"]
    assert config.num_gpu_blocks == 448_280 // 32
    assert config.kv_bytes_per_token == 327_680
    args = build_parser("live").parse_args(
        ["--trace", "llm-d", "--num-gpu-blocks", "500", "--kv-bytes-per-token", "1000"]
    )
    config = cluster_from_args(args)
    assert config.timing is DEFAULT_TIMING
    assert (config.num_gpu_blocks, config.kv_bytes_per_token) == (500, 1000)


def test_unknown_profile_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench_main(["replay", "--trace", "llm-d", "--timing", "gpt-5"])
    assert info.value.code == 2
    assert "llama-3.1-8b-h100" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["replay", "sweep", "live", "peers"])
def test_help_lists_the_profiles(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--timing NAME" in text
    for name in TIMING_PROFILES:
        assert name in text


@pytest.mark.parametrize("profile", TIMING_PROFILES.values(), ids=lambda p: p.name)
def test_idle_cluster_ttft_is_the_isolated_prefill(profile: TimingModel) -> None:
    # One endpoint: a cold 20,000-token prompt (three chunks), then, once idle, the same
    # prompt extended, which hits the first one's blocks.
    ids = list(range(1300))
    trace = make_trace([(0.0, 20_000, 4, ids[:1250]), (100.0, 20_800, 2, ids)])
    config = small_cluster(1, num_gpu_blocks=4096, timing=profile)
    cold, warm = simulate(trace, config, "round-robin").outcomes
    assert cold.ttft_s == pytest.approx(profile.isolated_prefill_s(H100, 20_000, 0, 8192))
    assert warm.cached_tokens == 20_000
    assert warm.ttft_s == pytest.approx(profile.isolated_prefill_s(H100, 20_800, 20_000, 8192))
