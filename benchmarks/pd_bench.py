"""P/D disaggregation and hardware classes on a heterogeneous pool, through the real stack.

Six simulated endpoints (2 x H100, 4 x A100 by default) behind real Envoy and kv-picker, one
mixed workload (a share of long, mostly unique documents among short chat turns, Poisson
arrivals), four policies in one run, endpoint caches reset between them:

- ``hardware-blind``: the previous built-in default (prefix 3, queue 1, kv-utilization 1,
  active requests 1) over all six, roles and classes ignored;
- ``class-preference``: the same plus ``hardware-class-scorer`` (weight 2), a static
  preference for the faster class;
- ``default``: the built-in default, aggregated (its latency estimate and its in-flight load
  divide by each endpoint's class speed);
- ``pd``: the H100s prefill only, the A100s decode, ``pd-profile-handler`` disaggregating
  prompts with at least ``--threshold`` uncached tokens (shorter ones stay on a decode
  endpoint); both profiles score with the default's four scorers.

TTFT and TPOT are the simulated endpoints' own model-time figures for each request (the prefill
leg and the KV transfer included), so host noise does not enter them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kv_picker.config import DEFAULT_PLUGINS, DEFAULT_PROFILE
from kv_picker_bench.client import percentile
from kv_picker_bench.localstack import LocalStack, SimSpec
from kv_picker_bench.workloads import words

CLASS_LABEL = "kv-picker.io/hardware-class"
ROLE_LABEL = "llm-d.ai/role"

_PREVIOUS = [
    {"type": "prefix-cache-scorer"},
    {"type": "queue-scorer"},
    {"type": "kv-cache-utilization-scorer"},
    {"type": "active-request-scorer", "name": "active-requests"},
]
_PREVIOUS_REFS = [
    {"pluginRef": "prefix-cache-scorer", "weight": 3},
    {"pluginRef": "queue-scorer"},
    {"pluginRef": "kv-cache-utilization-scorer"},
    {"pluginRef": "active-requests"},
]
# The built-in default's scorers (everything but its picker), for the P/D profiles too.
_DEFAULT = [dict(p) for p in DEFAULT_PLUGINS if p["type"] != "max-score-picker"]
_DEFAULT_REFS = [
    dict(r) for r in DEFAULT_PROFILE["plugins"] if r["pluginRef"] != "max-score-picker"
]


def policies(threshold: int) -> dict[str, dict[str, Any]]:
    """The four configs, by name."""
    return {
        "hardware-blind": {
            "plugins": _PREVIOUS,
            "schedulingProfiles": [{"name": "default", "plugins": _PREVIOUS_REFS}],
        },
        "class-preference": {
            "plugins": [*_PREVIOUS, {"type": "hardware-class-scorer"}],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        *_PREVIOUS_REFS,
                        {"pluginRef": "hardware-class-scorer", "weight": 2},
                    ],
                }
            ],
        },
        "default": {},
        "pd": {
            "plugins": [
                *_DEFAULT,
                {"type": "decode-filter"},
                {"type": "prefill-filter"},
                {"type": "pd-profile-handler", "parameters": {"nonCachedTokens": threshold}},
            ],
            "schedulingProfiles": [
                {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}, *_DEFAULT_REFS]},
                {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}, *_DEFAULT_REFS]},
            ],
        },
    }


@dataclass
class Request:
    arrival_s: float
    long: bool
    body: dict[str, Any]


def mixed_workload(
    count: int, rate_per_s: float, long_share: float, long_words: int, seed: int
) -> list[Request]:
    """Poisson arrivals (model seconds); long documents are unique, short turns share a
    system prompt."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + words(rng, 120)
    requests, now = [], 0.0
    for i in range(count):
        now += rng.expovariate(rate_per_s)
        if rng.random() < long_share:
            prompt = f"Document {i}. " + words(rng, long_words) + "\nSummarise it."
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 48}
            requests.append(Request(now, True, body))
        else:
            prompt = f"{system}\nUser {i}: {words(rng, 30)}?"
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 96}
            requests.append(Request(now, False, body))
    return requests


@dataclass
class PolicyResult:
    policy: str
    requests: int
    errors: int
    disaggregated: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    long_ttft_p50_s: float
    short_ttft_p50_s: float
    wall_s: float


async def _replay(url: str, requests: Sequence[Request], time_scale: float) -> list[Any]:
    """Open loop: each request leaves at its arrival time (scaled to wall time)."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()

        async def one(request: Request) -> Any:
            delay = request.arrival_s * time_scale - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                async with session.post(url + "/v1/completions", json=request.body) as reply:
                    if reply.status != 200:
                        return None
                    return (await reply.json())["kv_picker_sim"]
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                return None

        return await asyncio.gather(*(one(r) for r in requests))


def run(
    fast: int,
    slow: int,
    slow_class: str,
    count: int,
    rate_per_s: float,
    long_share: float,
    long_words: int,
    threshold: int,
    time_scale: float,
    seed: int,
    only: Sequence[str] = (),
) -> list[PolicyResult]:
    specs = [SimSpec(hardware_class="H100") for _ in range(fast)] + [
        SimSpec(hardware_class=slow_class) for _ in range(slow)
    ]
    workload = mixed_workload(count, rate_per_s, long_share, long_words, seed)
    results = []
    with LocalStack(sims=specs, time_scale=time_scale) as stack:
        for name, config in policies(threshold).items():
            if only and name not in only:
                continue
            for i, spec in enumerate(stack.sim_specs):
                role = "both" if name != "pd" else ("prefill" if i < fast else "decode")
                spec.labels = {CLASS_LABEL: spec.hardware_class, ROLE_LABEL: role}
            stack.start_picker(config)
            stack.reset_prefix_caches()
            started = time.perf_counter()
            timings = asyncio.run(_replay(stack.url, workload, time_scale))
            wall_s = time.perf_counter() - started
            ok = [(r, t) for r, t in zip(workload, timings, strict=True) if t is not None]
            ttft = [t["ttft_s"] for _, t in ok]
            tpot = [t["tpot_s"] * 1000 for _, t in ok if t["tpot_s"] > 0]
            results.append(
                PolicyResult(
                    policy=name,
                    requests=len(workload),
                    errors=len(workload) - len(ok),
                    disaggregated=sum(1 for _, t in ok if t["prefill_endpoint"]),
                    ttft_p50_s=percentile(ttft, 0.5),
                    ttft_p90_s=percentile(ttft, 0.9),
                    tpot_p50_ms=percentile(tpot, 0.5),
                    tpot_p90_ms=percentile(tpot, 0.9),
                    long_ttft_p50_s=percentile([t["ttft_s"] for r, t in ok if r.long], 0.5),
                    short_ttft_p50_s=percentile([t["ttft_s"] for r, t in ok if not r.long], 0.5),
                    wall_s=wall_s,
                )
            )
            print(format_table(results[-1:]), flush=True)
    return results


def format_table(rows: Sequence[PolicyResult]) -> str:
    lines = [
        "| policy | requests | errors | disaggregated | TTFT p50 s | TTFT p90 s | TPOT p50 ms "
        "| TPOT p90 ms | long TTFT p50 s | short TTFT p50 s | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.policy} | {r.requests} | {r.errors} | {r.disaggregated} | "
            f"{r.ttft_p50_s:.3f} | {r.ttft_p90_s:.3f} | {r.tpot_p50_ms:.1f} | "
            f"{r.tpot_p90_ms:.1f} | {r.long_ttft_p50_s:.3f} | {r.short_ttft_p50_s:.3f} | "
            f"{r.wall_s:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench pd",
        description="P/D with a threshold vs the aggregated default vs a static class preference "
        "vs hardware-blind routing on a "
        "heterogeneous pool of simulated endpoints, through real Envoy and kv-picker.",
    )
    parser.add_argument("--fast", type=int, default=2, help="H100 endpoints (2)")
    parser.add_argument("--slow", type=int, default=4, help="slower endpoints (4)")
    parser.add_argument("--slow-class", default="A100", help="their hardware class (A100)")
    parser.add_argument("--requests", type=int, default=600, help="requests per policy (600)")
    parser.add_argument("--rate", type=float, default=6.0, help="arrivals per model second (6.0)")
    parser.add_argument(
        "--long-share", type=float, default=0.25, help="share of long documents (0.25)"
    )
    parser.add_argument(
        "--long-words",
        type=int,
        default=2500,
        help="words per long document, ~1.6 tokens each (2500)",
    )
    parser.add_argument(
        "--threshold", type=int, default=1024, help="pd-profile-handler nonCachedTokens (1024)"
    )
    parser.add_argument(
        "--time-scale", type=float, default=0.1, help="wall seconds per model second (0.1)"
    )
    parser.add_argument("--seed", type=int, default=1, help="workload seed (1)")
    parser.add_argument(
        "--policy", action="append", default=[], help="run only these policies (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write pd.json here")
    args = parser.parse_args(argv)
    if min(args.fast, args.slow, args.requests) < 1 or not 0 <= args.long_share <= 1:
        parser.error("--fast, --slow, --requests must be >= 1 and --long-share in [0, 1]")
    unknown = set(args.policy) - set(policies(0))
    if unknown:
        parser.error(
            f"unknown policy {', '.join(sorted(unknown))}; known: {', '.join(policies(0))}"
        )
    rows = run(
        args.fast,
        args.slow,
        args.slow_class,
        args.requests,
        args.rate,
        args.long_share,
        args.long_words,
        args.threshold,
        args.time_scale,
        args.seed,
        args.policy,
    )
    print()
    print(format_table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pd.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.errors == 0 for r in rows) else 1
