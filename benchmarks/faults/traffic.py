"""Load for the fault suite: a mix of completions and chat, streamed and not, over N connections.

Every request is recorded as a :class:`Shot` with its start and end on the monotonic clock, so
a scenario can line requests up against the moment it killed something. A request counts as
served when the endpoint's reply arrived whole (a streamed one ends with ``data: [DONE]``), as a
*documented error* when the picker answered one of the errors of the wire contract (400, 404,
413, 429 or 503 with its ``x-llm-d-request-dropped-reason`` header), and as failed otherwise.

:class:`TrafficThread` runs the load in a thread of its own (its own event loop), so the
scenario's main thread can kill and restart processes meanwhile. Every request has a timeout
and every run a deadline.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from kv_picker.wire import DROPPED_REASON_HEADER
from kv_picker_bench.client import SERVED_BY_HEADER, percentile
from kv_picker_bench.workloads import words

# The picker's documented errors (DESIGN.md §2): each carries the dropped-reason header.
DOCUMENTED_STATUSES = frozenset({400, 404, 413, 429, 503})
KINDS = ("completions", "completions-stream", "chat", "chat-stream")

RequestFactory = Callable[[int], tuple[str, dict[str, object]]]


@dataclass(slots=True)
class Shot:
    """One request and what came back."""

    index: int
    kind: str
    start_s: float  # time.monotonic()
    end_s: float
    status: int  # 0: no HTTP answer (connection error or timeout)
    served_by: str = ""
    reason: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def documented(self) -> bool:
        return self.status in DOCUMENTED_STATUSES and bool(self.reason)

    @property
    def failed(self) -> bool:
        return not self.ok and not self.documented

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


def mixed_requests(
    model: str = "sim-model",
    seed: int = 0,
    groups: int = 8,
    questions_per_group: int = 32,
    context_words: int = 150,
    max_tokens: int = 4,
) -> RequestFactory:
    """Request ``i`` of a mix of the four :data:`KINDS`, in turn.

    Prompts are a group's shared context and one of the group's questions: a finite set, as a
    service's traffic repeats itself, so the picker's prefix index settles after a warm-up.
    """
    rng = random.Random(seed)
    contexts = [words(rng, context_words) for _ in range(groups)]
    questions = [[words(rng, 12) for _ in range(questions_per_group)] for _ in range(groups)]

    def request(i: int) -> tuple[str, dict[str, object]]:
        pick = random.Random(seed * 1_000_003 + i)
        group = pick.randrange(groups)
        context = contexts[group]
        question = questions[group][pick.randrange(questions_per_group)]
        return build(KINDS[i % len(KINDS)], model, context, question, max_tokens)

    return request


def unique_requests(
    model: str = "sim-model", seed: int = 0, prompt_words: int = 200, max_tokens: int = 2
) -> RequestFactory:
    """Request ``i`` has a prompt no other request shares, from its first block on."""
    rng = random.Random(seed)
    body_text = words(rng, prompt_words)

    def request(i: int) -> tuple[str, dict[str, object]]:
        return build("completions", model, f"request {seed}-{i} unique", body_text, max_tokens)

    return request


def build(
    kind: str, model: str, context: str, question: str, max_tokens: int
) -> tuple[str, dict[str, object]]:
    """(path, body) of one request of ``kind``."""
    stream = kind.endswith("-stream")
    if kind.startswith("chat"):
        body: dict[str, object] = {
            "model": model,
            "messages": [
                {"role": "system", "content": context},
                {"role": "user", "content": question},
            ],
            "max_tokens": max_tokens,
        }
        path = "/v1/chat/completions"
    else:
        body = {"model": model, "prompt": f"{context}\n{question}", "max_tokens": max_tokens}
        path = "/v1/completions"
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return path, body


async def send(
    session: aiohttp.ClientSession, base_url: str, index: int, path: str, body: dict[str, object]
) -> Shot:
    """Send one request; never raises."""
    kind = ("chat" if "chat" in path else "completions") + ("-stream" if body.get("stream") else "")
    start = time.monotonic()
    try:
        async with session.post(base_url + path, json=body) as response:
            served_by = response.headers.get(SERVED_BY_HEADER, "")
            reason = response.headers.get(DROPPED_REASON_HEADER, "")
            data = await response.read()
            error = ""
            if response.status == 200:
                if body.get("stream"):
                    if not data.rstrip().endswith(b"data: [DONE]"):
                        error = "stream ended without [DONE]"
                elif not data.startswith(b"{"):
                    error = "reply is not a JSON document"
                if not served_by:
                    error = error or "no endpoint header on the reply"
            return Shot(
                index, kind, start, time.monotonic(), response.status, served_by, reason, error
            )
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        message = f"{type(exc).__name__}: {exc}"[:200]
        return Shot(index, kind, start, time.monotonic(), 0, error=message)


class ShotCounter:
    """Where a long run's shots go: counted, and only failures kept (the first ``keep``)."""

    def __init__(self, keep: int = 100) -> None:
        self.sent = 0
        self.served = 0
        self.documented = 0
        self.failures: list[Shot] = []
        self._keep = keep

    def append(self, shot: Shot) -> None:
        self.sent += 1
        if shot.ok:
            self.served += 1
        elif shot.documented:
            self.documented += 1
        elif len(self.failures) < self._keep:
            self.failures.append(shot)

    @property
    def failed(self) -> int:
        return self.sent - self.served - self.documented

    def __len__(self) -> int:
        return self.sent


async def run_traffic(
    base_url: str,
    requests: RequestFactory,
    connections: int,
    total: int | None = None,
    duration_s: float | None = None,
    stop: threading.Event | None = None,
    timeout_s: float = 30.0,
    shots: list[Shot] | ShotCounter | None = None,
    rate_per_s: float | None = None,
) -> list[Shot] | ShotCounter:
    """Send requests over ``connections`` connections, each one at a time, until ``total`` were
    sent, ``duration_s`` passed or ``stop`` is set (at least one bound must be given).

    Shots are appended to ``shots`` as they finish (a list another thread may read, or a
    :class:`ShotCounter`). With ``rate_per_s`` the connections together send no faster.
    """
    if total is None and duration_s is None and stop is None:
        raise ValueError("traffic needs a bound: total, duration_s or stop")
    out: list[Shot] | ShotCounter = shots if shots is not None else []
    deadline = time.monotonic() + duration_s if duration_s is not None else float("inf")
    pause_s = connections / rate_per_s if rate_per_s else 0.0
    next_index = 0
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            nonlocal next_index
            while (
                (total is None or next_index < total)
                and time.monotonic() < deadline
                and not (stop is not None and stop.is_set())
            ):
                index = next_index
                next_index += 1
                path, body = requests(index)
                started = time.monotonic()
                out.append(await send(session, base_url, index, path, body))
                if pause_s:
                    await asyncio.sleep(max(0.0, pause_s - (time.monotonic() - started)))

        await asyncio.gather(*(worker() for _ in range(connections)))
    return out


class TrafficThread:
    """:func:`run_traffic` in a thread; :attr:`shots` fills as requests finish.

    Args:
        base_url: the gateway.
        requests: request factory.
        connections: concurrent connections.
        total: stop after this many requests (None: until :meth:`stop`).
        max_duration_s: stop after this long in any case.
        timeout_s: per request.
        rate_per_s: at most this many requests per second, all connections together.
        counter: count shots there instead of keeping them all in :attr:`shots` (long runs).
    """

    def __init__(
        self,
        base_url: str,
        requests: RequestFactory,
        connections: int,
        total: int | None = None,
        max_duration_s: float = 600.0,
        timeout_s: float = 30.0,
        rate_per_s: float | None = None,
        counter: ShotCounter | None = None,
    ) -> None:
        self.shots: list[Shot] = []
        self.counter = counter
        self._stop = threading.Event()
        self._error: BaseException | None = None

        def target() -> None:
            try:
                asyncio.run(
                    run_traffic(
                        base_url,
                        requests,
                        connections,
                        total,
                        max_duration_s,
                        self._stop,
                        timeout_s,
                        counter if counter is not None else self.shots,
                        rate_per_s,
                    )
                )
            except BaseException as exc:  # reported by stop()
                self._error = exc

        self._thread = threading.Thread(target=target, name="fault-traffic", daemon=True)

    def start(self) -> TrafficThread:
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float) -> bool:
        """Wait for a bounded run to end; False if it had not after ``timeout_s``."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self, timeout_s: float = 60.0) -> list[Shot]:
        """Stop sending, wait for the requests under way, return every shot."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"traffic did not stop within {timeout_s}s")
        if self._error is not None:
            raise RuntimeError("traffic thread failed") from self._error
        return list(self.shots)

    def __enter__(self) -> TrafficThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(60.0)


@dataclass(frozen=True)
class TrafficSummary:
    requests: int
    served: int
    documented_errors: int
    failed: int
    p50_ms: float
    p99_ms: float


def summarise(shots: Sequence[Shot]) -> TrafficSummary:
    served = [s.latency_s * 1000 for s in shots if s.ok]
    return TrafficSummary(
        len(shots),
        len(served),
        sum(1 for s in shots if s.documented),
        sum(1 for s in shots if s.failed),
        percentile(served, 0.5),
        percentile(served, 0.99),
    )


def failure_examples(shots: Sequence[Shot], limit: int = 3) -> list[str]:
    """A few failed shots, described for a report."""
    return [
        f"#{s.index} {s.kind}: status {s.status} {s.error or s.reason}".strip()
        for s in shots
        if s.failed
    ][:limit]
