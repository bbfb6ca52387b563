"""Precise (KV events) vs approximate prefix routing, when the caches do not do what routing did.

Approximate mode records "endpoint E holds these blocks" when it sends a request to E, and
forgets only by its own LRU. Two ordinary events make that record wrong, and this benchmark has
both, through the real stack (Envoy + kv-picker + simulated vLLM endpoints publishing KV events
over ZMQ):

- memory pressure: each endpoint's KV cache holds only a few groups' shared contexts, so
  endpoints evict what approximate mode still believes they hold;
- a restart: endpoint 0 goes down mid-run (traffic moves to the others, and approximate mode
  records it there too), then comes back with an empty cache. It is idle, so load signals pull
  traffic to it, and approximate mode believes it still holds its old groups.

The workload is chat: ``groups`` shared system prompts (Zipf-popular) with per-user questions,
sent over ``concurrency`` connections in three phases: warm, endpoint 0 down, endpoint 0 back.
Both policies share every scorer and weight (the default profile: prefix 3, queue 1,
kv-utilization 1, active requests 1) and differ only in the prefix scorer's mode. Hit ratio and
TTFT come from the endpoints' own metrics (``vllm:prefix_cache_hits/queries``,
``vllm:time_to_first_token_seconds``, in model seconds), per phase.

``kv-picker bench precise-vs-approx [--quick] [--out DIR]``.
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

from prometheus_client.parser import text_string_to_metric_families

from kv_picker_bench.client import Outcome, replay
from kv_picker_bench.localstack import LocalStack, http_get
from kv_picker_bench.workloads import WorkloadRequest, words

TOKENIZER = Path(__file__).resolve().parent / "tokenizer"
POLICIES = ("approximate", "precise")


def picker_config(mode: str, speculative_ttl_s: float = 2.0) -> dict[str, Any]:
    """The default profile with the prefix scorer in ``mode``."""
    params: dict[str, Any] = {"mode": mode}
    if mode == "precise":
        params["tokenizer"] = str(TOKENIZER)
        params["speculativeTtlSeconds"] = speculative_ttl_s
    return {
        "seed": 1,
        "plugins": [
            {"type": "prefix-cache-scorer", "parameters": params},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "active-request-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "queue-scorer", "weight": 1},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
                    {"pluginRef": "active-request-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


@dataclass(frozen=True)
class Workload:
    groups: int = 16
    context_words: int = 700
    question_words: int = 30
    output_tokens: int = 8
    requests_per_phase: tuple[int, int, int] = (240, 120, 240)
    zipf_s: float = 0.8
    seed: int = 0

    def phases(self, model: str) -> list[list[WorkloadRequest]]:
        rng = random.Random(self.seed)
        contexts = [
            f"You answer questions about topic {g}. " + words(rng, self.context_words)
            for g in range(self.groups)
        ]
        weights = [1.0 / (g + 1) ** self.zipf_s for g in range(self.groups)]
        phases = []
        for count in self.requests_per_phase:
            batch = []
            for _ in range(count):
                group = rng.choices(range(self.groups), weights)[0]
                body = {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": contexts[group]},
                        {"role": "user", "content": words(rng, self.question_words) + "?"},
                    ],
                    "max_tokens": self.output_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                batch.append(WorkloadRequest("/v1/chat/completions", body, group=group))
            phases.append(batch)
        return phases


# -- the endpoints' own metrics -------------------------------------------------------------------


@dataclass
class Counters:
    """Prefix-cache counters and the TTFT histogram, summed over endpoints."""

    queries: float = 0.0
    hits: float = 0.0
    ttft_count: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_buckets: dict[float, float] | None = None

    def add(self, other: Counters, sign: float = 1.0) -> Counters:
        buckets = dict(self.ttft_buckets or {})
        for bound, count in (other.ttft_buckets or {}).items():
            buckets[bound] = buckets.get(bound, 0.0) + sign * count
        return Counters(
            self.queries + sign * other.queries,
            self.hits + sign * other.hits,
            self.ttft_count + sign * other.ttft_count,
            self.ttft_sum_s + sign * other.ttft_sum_s,
            buckets,
        )

    def ttft_quantile_s(self, fraction: float) -> float:
        """Linear interpolation inside the cumulative histogram buckets."""
        buckets = sorted((self.ttft_buckets or {}).items())
        if not buckets or not self.ttft_count:
            return float("nan")
        target = fraction * self.ttft_count
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in buckets:
            if count >= target:
                if bound == float("inf"):
                    return lower_bound
                span = count - lower_count
                share = (target - lower_count) / span if span else 0.0
                return lower_bound + share * (bound - lower_bound)
            lower_bound, lower_count = bound, count
        return lower_bound


def endpoint_counters(address: str) -> Counters:
    status, body = http_get(f"http://{address}/metrics", timeout_s=5.0)
    if status != 200:
        raise RuntimeError(f"{address}/metrics answered {status}")
    counters = Counters(ttft_buckets={})
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "vllm:prefix_cache_queries_total":
                counters.queries += sample.value
            elif sample.name == "vllm:prefix_cache_hits_total":
                counters.hits += sample.value
            elif sample.name == "vllm:time_to_first_token_seconds_count":
                counters.ttft_count += sample.value
            elif sample.name == "vllm:time_to_first_token_seconds_sum":
                counters.ttft_sum_s += sample.value
            elif sample.name == "vllm:time_to_first_token_seconds_bucket":
                bound = float(sample.labels["le"])
                assert counters.ttft_buckets is not None
                counters.ttft_buckets[bound] = counters.ttft_buckets.get(bound, 0.0) + sample.value
    return counters


def snapshot(stack: LocalStack, skip: Sequence[int] = ()) -> dict[int, Counters]:
    return {
        i: endpoint_counters(address)
        for i, address in enumerate(stack.sim_addresses)
        if i not in skip
    }


def delta(after: dict[int, Counters], before: dict[int, Counters]) -> Counters:
    total = Counters(ttft_buckets={})
    for i, counters in after.items():
        total = total.add(counters)
        if i in before:
            total = total.add(before[i], -1.0)
    return total


# -- one policy -------------------------------------------------------------------------------------


@dataclass
class PhaseResult:
    policy: str
    phase: str
    requests: int
    errors: int
    hit_ratio: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    client_ttft_p50_wall_ms: float


def _phase_result(
    policy: str, phase: str, outcomes: Sequence[Outcome], counters: Counters
) -> PhaseResult:
    ok = sorted(o.ttft_s for o in outcomes if o.ok)
    return PhaseResult(
        policy,
        phase,
        len(outcomes),
        sum(not o.ok for o in outcomes),
        counters.hits / counters.queries if counters.queries else float("nan"),
        1000 * counters.ttft_sum_s / counters.ttft_count if counters.ttft_count else float("nan"),
        1000 * counters.ttft_quantile_s(0.5),
        1000 * counters.ttft_quantile_s(0.9),
        1000 * ok[len(ok) // 2] if ok else float("nan"),
    )


def run_policy(
    policy: str,
    workload: Workload,
    endpoints: int,
    num_gpu_blocks: int,
    concurrency: int,
    time_scale: float,
    downtime_s: float,
    speculative_ttl_s: float = 2.0,
) -> list[PhaseResult]:
    with LocalStack(
        sims=endpoints,
        # The TTL is wall time in the picker: scale the model-time TTL like the endpoints.
        picker_config=picker_config(policy, speculative_ttl_s * time_scale),
        time_scale=time_scale,
        kv_events=True,
        tokenizer=TOKENIZER,
        sim_args=("--num-gpu-blocks", str(num_gpu_blocks), "--max-num-seqs", "16"),
    ) as stack:
        warm, down, back = workload.phases(stack.model)
        results = []
        before = snapshot(stack)
        outcomes = asyncio.run(replay(stack.url, warm, concurrency))
        after = snapshot(stack)
        results.append(_phase_result(policy, "warm", outcomes, delta(after, before)))

        async def down_phase() -> list[Outcome]:
            # Endpoint 0 stops; traffic continues meanwhile; it comes back empty.
            restart = asyncio.to_thread(stack.restart_sim, 0, downtime_s)
            traffic = replay(stack.url, down, concurrency)
            outcomes, _ = await asyncio.gather(traffic, restart)
            return outcomes

        before = after
        outcomes = asyncio.run(down_phase())
        after = snapshot(stack)
        # Endpoint 0 counts from zero again: what it did before the restart is in `before`.
        down_counters = delta({i: c for i, c in after.items() if i}, before).add(after[0])
        results.append(_phase_result(policy, "down+restart", outcomes, down_counters))
        before = after
        outcomes = asyncio.run(replay(stack.url, back, concurrency))
        after = snapshot(stack)
        results.append(_phase_result(policy, "back", outcomes, delta(after, before)))
        return results


def run(
    quick: bool,
    endpoints: int = 4,
    num_gpu_blocks: int = 160,
    concurrency: int = 8,
    requests_per_phase: tuple[int, int, int] | None = None,
    speculative_ttl_s: float = 2.0,
) -> list[PhaseResult]:
    if requests_per_phase is None:
        requests_per_phase = (80, 40, 80) if quick else Workload().requests_per_phase
    workload = Workload(requests_per_phase=requests_per_phase)
    rows: list[PhaseResult] = []
    for policy in POLICIES:
        started = time.monotonic()
        rows += run_policy(
            policy,
            workload,
            endpoints,
            num_gpu_blocks,
            concurrency,
            time_scale=0.05,
            downtime_s=0.5 if quick else 1.5,
            speculative_ttl_s=speculative_ttl_s,
        )
        print(f"{policy}: {time.monotonic() - started:.1f} s", flush=True)
    return rows


def format_rows(rows: Sequence[PhaseResult]) -> str:
    lines = [
        "| policy | phase | requests | errors | hit ratio | TTFT mean ms | TTFT p50 ms | "
        "TTFT p90 ms | client TTFT p50 wall ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.policy} | {r.phase} | {r.requests} | {r.errors} | {r.hit_ratio:.3f} | "
            f"{r.ttft_mean_ms:.1f} | {r.ttft_p50_ms:.1f} | {r.ttft_p90_ms:.1f} | "
            f"{r.client_ttft_p50_wall_ms:.1f} |"
        )
    by_phase: dict[str, dict[str, PhaseResult]] = {}
    for r in rows:
        by_phase.setdefault(r.phase, {})[r.policy] = r
    lines += ["", "| phase | hit ratio precise / approx | TTFT mean precise / approx |"]
    lines.append("|---|---:|---:|")
    for phase, pair in by_phase.items():
        if len(pair) == 2:
            p, a = pair["precise"], pair["approximate"]
            lines.append(
                f"| {phase} | {_ratio(p.hit_ratio, a.hit_ratio):.2f} | "
                f"{_ratio(p.ttft_mean_ms, a.ttft_mean_ms):.2f} |"
            )
    return "\n".join(lines)


def _ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the baseline is 0 (e.g. no hit at all in a phase)."""
    return numerator / denominator if denominator else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench precise-vs-approx",
        description="Precise (KV-event) vs approximate prefix routing under eviction and restart.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--endpoints", type=int, default=4, help="simulated endpoints (4)")
    parser.add_argument(
        "--num-gpu-blocks", type=int, default=160, help="KV blocks per endpoint (160)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="client connections (8)")
    parser.add_argument(
        "--speculative-ttl",
        type=float,
        default=2.0,
        help="precise mode's speculativeTtlSeconds in model time, scaled like the endpoints "
        "(2.0; 0 = events only)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write precise_vs_approx.json here")
    args = parser.parse_args(argv)
    rows = run(
        args.quick,
        args.endpoints,
        args.num_gpu_blocks,
        args.concurrency,
        speculative_ttl_s=args.speculative_ttl,
    )
    print()
    print(
        "TTFT mean/p50/p90: the endpoints' histograms, model time (x0.05 = wall); "
        "client TTFT: wall time through Envoy and kv-picker."
    )
    print(format_rows(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "precise_vs_approx.json").write_text(
            json.dumps([asdict(r) for r in rows], indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
