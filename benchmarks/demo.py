"""``kv-picker demo``: the whole path on loopback, two routing profiles, one table.

Starts 4 simulated vLLM endpoints, kv-picker and a real Envoy, then replays the same
shared-prefix workload through Envoy twice: once with a random picker (the cache-blind
baseline), once with kv-picker's default profile. Each endpoint's prefix cache holds only a
few groups' contexts, so where a group's requests land decides whether they hit. Endpoint
caches are reset between runs, and hit ratios come from the endpoints' own counters
(``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from kv_picker_bench.client import Outcome, percentile, replay
from kv_picker_bench.localstack import LocalStack
from kv_picker_bench.workloads import SharedPrefixWorkload

RANDOM_PROFILE = {
    "plugins": [{"type": "random-picker"}],
    "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "random-picker"}]}],
}
# Small KV caches: one endpoint holds about four groups' shared contexts.
SIM_ARGS = ("--num-gpu-blocks", "512")
TIME_SCALE = 0.05


@dataclass
class RunSummary:
    profile: str
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    hit_ratio: float
    endpoints_used: int
    wall_s: float


def _prefix_counters(stack: LocalStack) -> tuple[float, float]:
    queries = hits = 0.0
    for values in stack.sim_metrics().values():
        queries += values.get("vllm:prefix_cache_queries_total", 0.0)
        hits += values.get("vllm:prefix_cache_hits_total", 0.0)
    return queries, hits


def run_profile(
    stack: LocalStack,
    name: str,
    config: dict[str, object] | None,
    workload: SharedPrefixWorkload,
    concurrency: int,
) -> RunSummary:
    stack.start_picker(config or {})
    stack.reset_prefix_caches()
    queries_before, hits_before = _prefix_counters(stack)
    started = time.perf_counter()
    outcomes: list[Outcome] = asyncio.run(replay(stack.url, workload.requests(), concurrency))
    wall_s = time.perf_counter() - started
    queries_after, hits_after = _prefix_counters(stack)
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s * 1000 for o in ok]
    queried = queries_after - queries_before
    return RunSummary(
        profile=name,
        requests=len(outcomes),
        errors=len(outcomes) - len(ok),
        ttft_p50_ms=percentile(ttfts, 0.5),
        ttft_p90_ms=percentile(ttfts, 0.9),
        hit_ratio=(hits_after - hits_before) / queried if queried else 0.0,
        endpoints_used=len({o.served_by for o in ok}),
        wall_s=wall_s,
    )


def format_table(rows: list[RunSummary]) -> str:
    lines = [
        "| profile | requests | errors | TTFT p50 ms | TTFT p90 ms | prefix-cache hit ratio "
        "| endpoints used | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.profile} | {r.requests} | {r.errors} | {r.ttft_p50_ms:.1f} | "
            f"{r.ttft_p90_ms:.1f} | {r.hit_ratio:.3f} | {r.endpoints_used} | {r.wall_s:.1f} |"
        )
    return "\n".join(lines)


def run_demo(
    requests: int = 160, concurrency: int = 8, seed: int = 7, out: TextIO = sys.stdout
) -> int:
    groups = 12
    workload = SharedPrefixWorkload(
        groups=groups, users_per_group=max(1, requests // groups), seed=seed
    )
    print(
        f"kv-picker demo: 4 simulated endpoints (time scale {TIME_SCALE}), real Envoy, "
        f"{workload.groups} groups x {workload.users_per_group} users, "
        f"~{workload.shared_context_tokens}-token shared contexts, {concurrency} connections",
        file=out,
        flush=True,
    )
    started = time.perf_counter()
    with LocalStack(
        sims=4, picker_config=RANDOM_PROFILE, time_scale=TIME_SCALE, sim_args=SIM_ARGS
    ) as stack:
        print(
            f"stack up in {time.perf_counter() - started:.1f}s: Envoy on {stack.url}",
            file=out,
            flush=True,
        )
        rows = [
            run_profile(stack, "random (cache-blind)", RANDOM_PROFILE, workload, concurrency),
            run_profile(stack, "kv-picker default", None, workload, concurrency),
        ]
    print(format_table(rows), file=out)
    baseline, ours = rows
    if ours.errors or baseline.errors:
        print("errors occurred: see above", file=out)
        return 1
    print(
        f"hit ratio {ours.hit_ratio:.3f} vs {baseline.hit_ratio:.3f}; TTFT p50 "
        f"{ours.ttft_p50_ms:.1f} ms vs {baseline.ttft_p50_ms:.1f} ms; "
        f"total {time.perf_counter() - started:.1f}s",
        file=out,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kv-picker demo``: the flags, then :func:`run_demo`."""
    parser = argparse.ArgumentParser(
        prog="kv-picker demo",
        description="Local stack: Envoy + kv-picker + 4 simulated endpoints; replay a "
        "shared-prefix workload under a random picker and the default profile, print a table.",
    )
    parser.add_argument("--requests", type=int, default=160, help="requests per profile (160)")
    parser.add_argument("--concurrency", type=int, default=8, help="client connections (8)")
    parser.add_argument("--seed", type=int, default=7, help="workload seed (7)")
    args = parser.parse_args(None if argv is None else list(argv))
    return run_demo(requests=args.requests, concurrency=args.concurrency, seed=args.seed)
