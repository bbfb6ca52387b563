"""An asyncio HTTP client that replays workload requests and measures each one.

TTFT is the time to the first non-empty SSE ``data:`` event of a streamed response (for a
non-streamed response, the whole response). The endpoint that served a request is read from
the simulated endpoints' ``x-kv-picker-sim-endpoint`` response header.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from kv_picker_bench.workloads import WorkloadRequest

SERVED_BY_HEADER = "x-kv-picker-sim-endpoint"


@dataclass(slots=True)
class Outcome:
    """What happened to one request."""

    status: int
    ttft_s: float
    latency_s: float
    served_by: str = ""
    error: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    group: int = 0
    # Streamed responses: the time between successive reads of the body that carried an SSE
    # event, as the client saw them (events that arrive together are one read).
    gaps_s: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[rank]


async def send(session: aiohttp.ClientSession, base_url: str, request: WorkloadRequest) -> Outcome:
    start = time.perf_counter()
    first_s = 0.0
    gaps: list[float] = []
    try:
        async with session.post(
            base_url + request.path, json=request.body, headers=request.headers
        ) as response:
            served_by = response.headers.get(SERVED_BY_HEADER, "")
            if response.status != 200:
                text = await response.text()
                elapsed = time.perf_counter() - start
                return Outcome(
                    response.status, elapsed, elapsed, served_by, text[:300], group=request.group
                )
            usage: dict[str, object] = {}
            if request.body.get("stream"):
                buffer = b""
                last_s = 0.0
                async for chunk in response.content.iter_any():
                    if b"data:" in chunk:
                        now = time.perf_counter()
                        if first_s:
                            gaps.append(now - last_s)
                        else:
                            first_s = now
                        last_s = now
                    buffer += chunk
                for line in buffer.split(b"\n"):
                    if line.startswith(b"data:") and b'"usage"' in line:
                        document = json.loads(line[5:])
                        usage = document.get("usage") or usage
                if not buffer.rstrip().endswith(b"data: [DONE]"):
                    raise ValueError("stream ended without [DONE]")
            else:
                document = await response.json()
                first_s = time.perf_counter()
                usage = document.get("usage") or {}
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        elapsed = time.perf_counter() - start
        return Outcome(
            0, elapsed, elapsed, error=f"{type(exc).__name__}: {exc}", group=request.group
        )
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        200,
        (first_s or end) - start,
        end - start,
        served_by,
        completion_tokens=int(usage.get("completion_tokens", 0) or 0),  # type: ignore[call-overload]
        cached_tokens=int(details.get("cached_tokens", 0) or 0) if isinstance(details, dict) else 0,
        group=request.group,
        gaps_s=tuple(gaps),
    )


async def replay(
    base_url: str,
    requests: Sequence[WorkloadRequest],
    concurrency: int,
    timeout_s: float = 120.0,
) -> list[Outcome]:
    """Send ``requests`` over ``concurrency`` connections, each connection one at a time.

    Returns outcomes in request order.
    """
    outcomes: list[Outcome | None] = [None] * len(requests)
    next_index = 0
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(requests):
                index = next_index
                next_index += 1
                outcomes[index] = await send(session, base_url, requests[index])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [o for o in outcomes if o is not None]
