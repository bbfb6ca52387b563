"""The request log on live traffic: a workload sent through real Envoy, kv-picker and simulated
endpoints, then its log replayed offline on the same cluster shape, gives the same hit ratio."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from kv_picker_bench.harness.live import live_picker_config, replay_open_loop, trace_requests
from kv_picker_bench.harness.policies import harness_registry, resolve_policy
from kv_picker_bench.harness.simulator import OK, run_policy, uniform_cluster
from kv_picker_bench.harness.traces import SharedPrefixSpec, load_mooncake, slice_trace
from kv_picker_bench.localstack import LocalStack, SimSpec

TIME_SCALE = 0.1  # wall seconds per model second, for the client and the endpoints alike
NUM_ENDPOINTS = 4
NUM_GPU_BLOCKS = 1024  # 16,384 tokens per endpoint: the workload's 8 groups fit in the pool


def token_hit_ratio(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> float:
    """Prompt tokens the endpoints served from their prefix caches, over those they looked up."""

    def delta(name: str) -> float:
        return sum(after[a].get(name, 0.0) - before[a].get(name, 0.0) for a in after)

    return delta("vllm:prefix_cache_hits_total") / delta("vllm:prefix_cache_queries_total")


def wait_for_rows(path: Path, count: int, timeout_s: float = 10.0) -> None:
    """The writer flushes about once a second: wait until it has written ``count`` rows."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{path}: fewer than {count} rows after {timeout_s}s")


def test_an_offline_replay_of_the_log_matches_the_live_hit_ratio(tmp_path: Path) -> None:
    # Groups share a 2,048-token context (four whole 512-token blocks); each user asks the same
    # 300-token question every time (a partial last block, which must match itself).
    trace = SharedPrefixSpec(
        groups=8,
        users=4,
        context_tokens=2048,
        question_tokens=300,
        output_tokens=32,
        requests=160,
        rate=4.0,
        seed=1,
    ).build()
    cluster = uniform_cluster(NUM_ENDPOINTS, num_gpu_blocks=NUM_GPU_BLOCKS)
    policy = resolve_policy("kv-picker")
    log_path = tmp_path / "requests.jsonl"
    document = live_picker_config(policy, cluster.scrape_interval_s, TIME_SCALE)
    document["requestLog"] = {"path": str(log_path)}
    sim_args = (
        *("--block-size", str(cluster.block_size)),
        *("--max-num-seqs", str(cluster.max_num_seqs)),
        *("--max-num-batched-tokens", str(cluster.max_num_batched_tokens)),
        *("--max-model-len", str(cluster.max_model_len)),
    )
    sims = [
        SimSpec(extra_args=("--num-gpu-blocks", str(NUM_GPU_BLOCKS))) for _ in range(NUM_ENDPOINTS)
    ]
    with LocalStack(
        sims=sims, picker_config=document, time_scale=TIME_SCALE, sim_args=sim_args
    ) as stack:
        before = stack.sim_metrics()
        outcomes, _ = asyncio.run(
            replay_open_loop(
                stack.url, trace_requests(trace, stack.model), TIME_SCALE, 60.0, keep_alive=False
            )
        )
        after = stack.sim_metrics()
        wait_for_rows(log_path, len(trace.requests))
    assert [o.status for o in outcomes if not o.ok] == []
    live = token_hit_ratio(before, after)

    logged = load_mooncake(log_path)
    assert len(logged.requests) == len(trace.requests)
    # The simulated endpoint makes one token of each four-character word: the log's
    # characters / 4 are the exact prompt lengths; the outputs come from the usage.
    assert {(r.input_tokens, r.output_tokens) for r in logged.requests} == {(2348, 32)}
    # Arrivals in wall time: the trace's schedule, scaled.
    assert abs(logged.duration_s - trace.duration_s * TIME_SCALE) < 0.5

    registry = harness_registry()
    result = run_policy(
        slice_trace(logged, load=TIME_SCALE),  # wall ms -> model seconds
        cluster,
        policy.config(registry),
        registry,
        policy.name,
    )
    served = [o for o in result.outcomes if o.status == OK]
    assert len(served) == len(trace.requests)
    offline = sum(o.cached_tokens for o in served) / sum(o.prompt_tokens for o in served)
    print(f"token hit ratio: live {live:.4f}, offline replay of the log {offline:.4f}")
    assert live > 0.5  # the workload has real reuse, and the live picker found it
    assert abs(offline - live) <= 0.10 * live
