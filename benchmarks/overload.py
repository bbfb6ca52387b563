"""What happens past what one picker process can serve: offered vs served vs added latency.

Through the real stack (Envoy + kv-picker + simulated endpoints with model time scaled to almost
nothing, so the picker is the bottleneck):

1. the unloaded latency: one connection, one request at a time (p50, p99);
2. the capacity: requests per second served with many connections in flight;
3. open-loop Poisson arrivals at multiples of that capacity (default 0.5, 1, 2, 3), each for a
   few seconds, once per pair of pending-request bound (``admission.maxPendingRequests``;
   0 = none) and queue-delay target (``admission.queueDelayTarget``; 0 = off).

For every step: the offered rate asked for and the rate the client reached (the client shares
the machine), served and shed (503 ``overloaded``) per second, other failures, the latency the
client saw for the served requests, and the latency the picker added to them with its p99 as a
ratio to the unloaded one. The added latency is Envoy's own measure, from its access log: from
the request's first byte to the first byte sent upstream (the ext_proc exchange, and Envoy's
work around it). The client's figure also holds its own queueing: on this machine it shares the
cores with everything else, and past capacity its event loop is late too.
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

from kv_picker.wire import DROPPED_REASON_HEADER
from kv_picker_bench.client import percentile, replay
from kv_picker_bench.localstack import LocalStack
from kv_picker_bench.overhead import TOKENIZER, precise_profile
from kv_picker_bench.workloads import WorkloadRequest, long_prompt_requests


@dataclass
class Step:
    bound: int
    queue_delay_target_ms: float
    factor: float
    offered_per_s: float
    sent_per_s: float
    served_per_s: float
    shed_per_s: float
    failed: int
    p50_ms: float
    p99_ms: float
    p99_ratio_to_unloaded: float
    added_p50_ms: float
    added_p99_ms: float
    added_p99_ratio_to_unloaded: float


class AddedLatency:
    """Reads the stack's Envoy access log (``ACCESS_LOG_FORMAT``) a step at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def take(self) -> list[float]:
        """Milliseconds added to each request served (200) since the last call."""
        time.sleep(0.5)  # the stack's Envoy flushes its access log every 0.2 s
        data = self.path.read_bytes() if self.path.exists() else b""
        end = data.rfind(b"\n") + 1
        if end <= self.offset:
            return []
        lines, self.offset = data[self.offset : end].decode().splitlines(), end
        added = []
        for line in lines:
            status, _, micros = line.partition(" ")
            if status == "200" and micros.strip().isdigit():
                added.append(int(micros) / 1000)
        return added


async def _open_loop(
    url: str, requests: Sequence[WorkloadRequest], rate: float, seconds: float, seed: int
) -> tuple[int, float, float, list[float], int, int]:
    """Poisson arrivals at ``rate`` for ``seconds``; returns sent, the sending time, the time
    until the last answer, served latencies, shed, other failures."""
    rng = random.Random(seed)
    latencies: list[float] = []
    shed = failed = 0
    reasons: dict[str, int] = {}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(request: WorkloadRequest) -> None:
            nonlocal shed, failed
            started = time.perf_counter()
            try:
                async with session.post(url + request.path, json=request.body) as response:
                    await response.read()
                    if response.status == 200:
                        latencies.append(time.perf_counter() - started)
                    elif response.headers.get(DROPPED_REASON_HEADER) == "overloaded":
                        shed += 1
                    else:
                        failed += 1
                        reasons[str(response.status)] = reasons.get(str(response.status), 0) + 1
            except (TimeoutError, aiohttp.ClientError) as exc:
                failed += 1
                reasons[type(exc).__name__] = reasons.get(type(exc).__name__, 0) + 1

        loop = asyncio.get_running_loop()
        start = loop.time()
        due = start
        index = 0
        while due - start < seconds:
            due += rng.expovariate(rate)
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(requests[index % len(requests)])))
            index += 1
        sent_wall = loop.time() - start
        await asyncio.gather(*tasks)
        drained_wall = loop.time() - start
    if reasons:
        print("failures:", reasons, flush=True)
    return index, sent_wall, drained_wall, latencies, shed, failed


def run(
    bounds: Sequence[int],
    queue_delays_ms: Sequence[float],
    factors: Sequence[float],
    seconds: float,
    endpoints: int,
    prompt_tokens: int,
    out_dir: Path | None,
    mode: str = "precise",
) -> dict[str, object]:
    requests = long_prompt_requests(2000, int(prompt_tokens / 1.6), seed=7)
    steps: list[Step] = []
    profile = precise_profile() if mode == "precise" else {}
    options: dict[str, Any] = (
        {"kv_events": True, "tokenizer": TOKENIZER} if mode == "precise" else {}
    )
    with LocalStack(
        sims=endpoints, time_scale=0.0001, picker_config=profile, access_log=True, **options
    ) as stack:
        log = AddedLatency(stack.access_log_path)
        asyncio.run(replay(stack.url, requests[:50], 4))  # warm up
        log.take()
        unloaded = asyncio.run(replay(stack.url, requests[:300], 1))
        base = [o.latency_s * 1000 for o in unloaded if o.ok]
        unloaded_p50, unloaded_p99 = percentile(base, 0.5), percentile(base, 0.99)
        base_added = log.take()
        unloaded_added_p50 = percentile(base_added, 0.5)
        unloaded_added_p99 = percentile(base_added, 0.99)
        started = time.perf_counter()
        closed = asyncio.run(replay(stack.url, requests[:1200], 32))
        capacity = sum(o.ok for o in closed) / (time.perf_counter() - started)
        print(
            f"unloaded p50 {unloaded_p50:.2f} ms, p99 {unloaded_p99:.2f} ms "
            f"(added: p50 {unloaded_added_p50:.2f} ms, p99 {unloaded_added_p99:.2f} ms); "
            f"capacity {capacity:.0f} req/s",
            flush=True,
        )
        policies = [(bound, delay) for bound in bounds for delay in queue_delays_ms]
        for bound, delay in policies:
            admission = {"maxPendingRequests": bound, "queueDelayTarget": f"{delay:g}ms"}
            stack.start_picker({**profile, "admission": admission})
            asyncio.run(replay(stack.url, requests[:50], 4))
            log.take()
            for factor in factors:
                rate = factor * capacity
                sent, wall, drained, latencies, shed, failed = asyncio.run(
                    _open_loop(stack.url, requests, rate, seconds, seed=int(factor * 100))
                )
                served_ms = [s * 1000 for s in latencies]
                p99 = percentile(served_ms, 0.99)
                added = log.take()
                added_p99 = percentile(added, 0.99)
                step = Step(
                    bound,
                    delay,
                    factor,
                    rate,
                    sent / wall,
                    len(latencies) / drained,
                    shed / drained,
                    failed,
                    percentile(served_ms, 0.5),
                    p99,
                    p99 / unloaded_p99,
                    percentile(added, 0.5),
                    added_p99,
                    added_p99 / unloaded_added_p99,
                )
                steps.append(step)
                print(format_steps([step], header=not steps[:-1]), flush=True)
    report: dict[str, object] = {
        "unloaded_p50_ms": unloaded_p50,
        "unloaded_p99_ms": unloaded_p99,
        "unloaded_added_p50_ms": unloaded_added_p50,
        "unloaded_added_p99_ms": unloaded_added_p99,
        "capacity_per_s": capacity,
        "steps": [asdict(s) for s in steps],
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "overload.json").write_text(json.dumps(report, indent=2))
    return report


def format_steps(steps: Sequence[Step], header: bool = True) -> str:
    lines = (
        [
            "| maxPendingRequests | queueDelayTarget | × capacity | offered req/s | sent req/s | served req/s "
            "| shed req/s | failed | client p99 ms | added p50 ms | added p99 ms "
            "| added p99 ÷ unloaded |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        if header
        else []
    )
    for s in steps:
        lines.append(
            f"| {s.bound or 'none'} "
            f"| {f'{s.queue_delay_target_ms:g} ms' if s.queue_delay_target_ms else 'off'} "
            f"| {s.factor:g} | {s.offered_per_s:.0f} | {s.sent_per_s:.0f} "
            f"| {s.served_per_s:.0f} | {s.shed_per_s:.0f} | {s.failed} | {s.p99_ms:.1f} "
            f"| {s.added_p50_ms:.2f} | {s.added_p99_ms:.2f} | {s.added_p99_ratio_to_unloaded:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench overload",
        description="Offered vs served vs latency past one picker process's capacity.",
    )
    parser.add_argument(
        "--bounds", default="512", help="comma list of admission.maxPendingRequests (512)"
    )
    parser.add_argument(
        "--queue-delays",
        default="5,0",
        help="comma list of admission.queueDelayTarget in ms, 0 = off (5,0)",
    )
    parser.add_argument(
        "--factors", default="0.5,1,2,3", help="offered load as multiples of capacity"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each step (5)")
    parser.add_argument("--endpoints", type=int, default=4, help="simulated endpoints (4)")
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="prompt length (4000)")
    parser.add_argument(
        "--mode",
        choices=("precise", "approximate"),
        default="precise",
        help="prefix scorer: precise (tokenizes every prompt: the costly path) or approximate",
    )
    parser.add_argument("--out", type=Path, default=None, help="write overload.json here")
    args = parser.parse_args(argv)
    try:
        bounds = [int(b) for b in args.bounds.split(",") if b.strip()]
        delays = [float(d) for d in args.queue_delays.split(",") if d.strip()]
        factors = [float(f) for f in args.factors.split(",") if f.strip()]
    except ValueError:
        parser.error("--bounds, --queue-delays and --factors must be comma lists of numbers")
    if not bounds or min(bounds) < 0 or not delays or min(delays) < 0:
        parser.error("--bounds and --queue-delays must be >= 0")
    if not factors or min(factors) <= 0:
        parser.error("--factors must be > 0")
    if args.seconds <= 0 or args.endpoints < 1 or args.prompt_tokens < 1:
        parser.error("--seconds, --endpoints and --prompt-tokens must be positive")
    run(
        bounds,
        delays,
        factors,
        args.seconds,
        args.endpoints,
        args.prompt_tokens,
        args.out,
        args.mode,
    )
    return 0
