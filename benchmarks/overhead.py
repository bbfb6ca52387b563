"""What does kv-picker add to a request? Envoy routed directly vs Envoy + kv-picker.

Both paths run in the same process tree at the same time, against the same simulated
endpoints (whose model time is scaled to almost nothing, so the figures are the gateway's):

```
direct:  client ──(sets x-gateway-destination-endpoint, round robin)──> Envoy A ──> endpoint
picker:  client ──> Envoy B ──ext_proc──> kv-picker (default profile) ──> endpoint
```

Rounds alternate between the two paths so drift on a shared machine hits both alike. Reported:
latency p50/p99 per path, the added latency (picker - direct), and ratios picker/direct for
p50, p99 and requests per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kv_picker.wire import DESTINATION_HEADER
from kv_picker_bench.client import Outcome, percentile, replay
from kv_picker_bench.localstack import (
    LocalStack,
    ManagedProcess,
    envoy_bootstrap,
    free_port,
)
from kv_picker_bench.workloads import WorkloadRequest, long_prompt_requests


@dataclass
class PathResult:
    path: str
    connections: int
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    requests_per_s: float


def _direct_envoy(stack: LocalStack) -> tuple[ManagedProcess, int]:
    port, admin = free_port(), free_port()
    bootstrap = envoy_bootstrap(port, admin, ext_proc_port=0)
    # Same listener and ORIGINAL_DST cluster, no ext_proc filter: the client picks.
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["http_filters"] = hcm["typed_config"]["http_filters"][1:]
    bootstrap["static_resources"]["clusters"] = bootstrap["static_resources"]["clusters"][:1]
    process = stack.launch_envoy("envoy-direct", bootstrap, admin)
    return process, port


def _summarise(
    path: str, connections: int, outcomes: Sequence[Outcome], wall_s: float
) -> PathResult:
    ok = [o.latency_s * 1000 for o in outcomes if o.ok]
    return PathResult(
        path,
        connections,
        len(outcomes),
        len(outcomes) - len(ok),
        percentile(ok, 0.5),
        percentile(ok, 0.99),
        len(ok) / wall_s,
    )


TOKENIZER = Path(__file__).resolve().parent / "tokenizer"


def precise_profile() -> dict[str, object]:
    """The default profile with the prefix scorer in precise mode (KV events, a tokenizer)."""
    return {
        "plugins": [
            {"type": "prefix-cache-scorer",
             "parameters": {"mode": "precise", "tokenizer": str(TOKENIZER)}},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "active-request-scorer"},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
            {"pluginRef": "queue-scorer"},
            {"pluginRef": "kv-cache-utilization-scorer"},
            {"pluginRef": "active-request-scorer"},
        ]}],
    }  # fmt: skip


def run(
    endpoints: int,
    prompt_tokens: int,
    requests: int,
    connections: Sequence[int],
    rounds: int,
    out_dir: Path | None,
    mode: str = "approximate",
    event_loop: str = "asyncio",
) -> list[dict[str, object]]:
    words_per_prompt = int(prompt_tokens / 1.6)  # the simulated tokenizer's ~1.6 tokens/word
    precise = mode == "precise"
    stack_options: dict[str, Any] = (
        {"picker_config": precise_profile(), "kv_events": True, "tokenizer": TOKENIZER}
        if precise
        else {}
    )
    picker_args = ("--event-loop", event_loop)
    with LocalStack(
        sims=endpoints, time_scale=0.0001, picker_args=picker_args, **stack_options
    ) as stack:
        _, direct_port = _direct_envoy(stack)
        direct_url = f"http://127.0.0.1:{direct_port}"
        addresses = stack.sim_addresses
        rows: list[dict[str, object]] = []
        for conns in connections:
            base = long_prompt_requests(requests, words_per_prompt, seed=conns)
            direct_requests = [
                WorkloadRequest(
                    r.path, r.body, headers={DESTINATION_HEADER: addresses[i % len(addresses)]}
                )
                for i, r in enumerate(base)
            ]
            # Warm both paths (connections, caches of the processes) before measuring.
            asyncio.run(replay(direct_url, direct_requests[: 4 * conns], conns))
            asyncio.run(replay(stack.url, base[: 4 * conns], conns))
            results: dict[str, list[Outcome]] = {"direct": [], "picker": []}
            walls = {"direct": 0.0, "picker": 0.0}
            for _ in range(rounds):
                for name, url, batch in (
                    ("direct", direct_url, direct_requests),
                    ("picker", stack.url, base),
                ):
                    started = time.perf_counter()
                    results[name] += asyncio.run(replay(url, batch, conns))
                    walls[name] += time.perf_counter() - started
            direct = _summarise("direct", conns, results["direct"], walls["direct"])
            picked = _summarise("picker", conns, results["picker"], walls["picker"])
            prompt_tokens_seen = next((o.completion_tokens for o in results["picker"] if o.ok), 0)
            del prompt_tokens_seen
            rows.append(
                {
                    "connections": conns,
                    "direct": asdict(direct),
                    "picker": asdict(picked),
                    "added_p50_ms": picked.p50_ms - direct.p50_ms,
                    "added_p99_ms": picked.p99_ms - direct.p99_ms,
                    "p50_ratio": picked.p50_ms / direct.p50_ms,
                    "p99_ratio": picked.p99_ms / direct.p99_ms,
                    "throughput_ratio": picked.requests_per_s / direct.requests_per_s,
                }
            )
            print(format_rows(rows[-1:]), flush=True)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "overhead.json").write_text(json.dumps(rows, indent=2))
        return rows


def format_rows(rows: Sequence[dict[str, object]]) -> str:
    lines = [
        "| connections | direct p50 ms | picker p50 ms | added p50 ms | direct p99 ms | "
        "picker p99 ms | added p99 ms | direct req/s | picker req/s | p50 ratio | p99 ratio "
        "| req/s ratio | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        d, p = row["direct"], row["picker"]
        assert isinstance(d, dict) and isinstance(p, dict)
        lines.append(
            f"| {row['connections']} | {d['p50_ms']:.2f} | {p['p50_ms']:.2f} | "
            f"{row['added_p50_ms']:.2f} | {d['p99_ms']:.2f} | {p['p99_ms']:.2f} | "
            f"{row['added_p99_ms']:.2f} | {d['requests_per_s']:.0f} | {p['requests_per_s']:.0f} | "
            f"{row['p50_ratio']:.2f} | {row['p99_ratio']:.2f} | {row['throughput_ratio']:.2f} | "
            f"{d['errors'] + p['errors']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench overhead",
        description="Latency and throughput added by kv-picker: Envoy direct vs Envoy + picker.",
    )
    parser.add_argument("--endpoints", type=int, default=16, help="simulated endpoints (16)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=4000, help="approximate prompt length in tokens (4000)"
    )
    parser.add_argument(
        "--requests", type=int, default=300, help="requests per path per round (300)"
    )
    parser.add_argument(
        "--connections", default="1,16", help="comma list of client connection counts (1,16)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    parser.add_argument(
        "--mode",
        choices=("approximate", "precise"),
        default="approximate",
        help="prefix scorer of the picker's default profile: approximate (the built-in "
        "default) or precise (KV events from the endpoints, the shipped tokenizer)",
    )
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the picker's event loop (kv-picker serve --event-loop; default asyncio)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write overhead.json here")
    args = parser.parse_args(argv)
    try:
        connections = [int(c) for c in args.connections.split(",") if c.strip()]
    except ValueError:
        parser.error("--connections must be a comma list of integers")
    if not connections or min(connections) < 1 or args.requests < 1 or args.endpoints < 1:
        parser.error("--connections, --requests and --endpoints must be positive")
    rows = run(
        args.endpoints,
        args.prompt_tokens,
        args.requests,
        connections,
        args.rounds,
        args.out,
        args.mode,
        args.event_loop,
    )
    print()
    print(format_rows(rows))
    return (
        0
        if all(
            r["direct"]["errors"] == 0 and r["picker"]["errors"] == 0  # type: ignore[index]
            for r in rows
        )
        else 1
    )
