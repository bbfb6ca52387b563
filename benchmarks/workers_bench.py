"""How ``kv-picker serve --workers N`` scales: the same load through one Envoy, with the picker's
processes pinned (``sched_setaffinity``, as ``taskset`` does) to one core or two.

```
client (aiohttp, C connections) ──> Envoy (ext_proc streamed; with W > 1, the workers' own
                                      ports, least-request) ──> kv-picker [--workers W], pinned
                                      to CPUS ──> endpoints
```

Each configuration (workers × CPUs) runs on the same stack, Envoy and requests (distinct ~16 KB
prompts, as in ``bench overhead``); only the picker is restarted between them, and rounds
alternate between the configurations so drift on a shared machine hits all alike. Envoy, the
client and the simulated endpoints are not pinned: they share the machine's cores with the
picker, as a sidecar deployment would.

Reported per configuration and connection count: requests per second, p50 and p99 latency,
errors, the picker's CPU seconds per request (its processes' user + system time over the run:
what the exchange between workers costs shows here), and the throughput ratio to one worker on
one core measured in the same run.

``--exchange RATES`` measures the exchange alone instead: one process sends what a worker
routing RATE requests a second would (a pick of ``--exchange-keys`` block keys, 250 by default,
about a 4,000-token prompt; its first byte and its end; over 16 endpoints), another applies them
as a worker does (approximate index records, counts), and the receiver's CPU time per request
received is reported: what each extra worker adds to every other worker's work per request.
Four fifths of each pick's keys are one of 20 shared prefixes, the rest new.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import resource
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kv_picker.endpoint import EndpointSpec
from kv_picker.peers import PeerSync
from kv_picker.scheduling.framework import PeerPick
from kv_picker.state.approx_index import ApproximatePrefixIndex
from kv_picker.state.endpoints import EndpointStore
from kv_picker_bench.client import Outcome, replay
from kv_picker_bench.localstack import LocalStack, free_port, tree_cpu_s
from kv_picker_bench.overhead import (
    TOKENIZER,
    PathResult,
    add_mode_argument,
    mode_bootstrap,
    precise_profile,
    summarise,
)
from kv_picker_bench.workloads import long_prompt_requests


@dataclass(frozen=True)
class Setup:
    workers: int
    cpus: tuple[int, ...]

    @property
    def name(self) -> str:
        cores = f"{len(self.cpus)} core" + ("s" if len(self.cpus) > 1 else "")
        return f"{self.workers} worker{'s' if self.workers > 1 else ''}, {cores}"


@dataclass
class Result(PathResult):
    """One setup's load figures (``path`` is the setup's name), with the picker's CPU cost."""

    workers: int
    cpus: list[int]
    picker_cpu_ms_per_request: float


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        try:
            text = Path(f"/proc/{current}/task/{current}/children").read_text()
        except OSError:
            continue
        queue.extend(int(child) for child in text.split())
    return found


def pin(pid: int, cpus: Sequence[int]) -> None:
    """Pin a process and its descendants to ``cpus`` (children started later inherit it)."""
    for member in process_tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(member, set(cpus))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a managed process with everything it started, children that
    exited included (:func:`~kv_picker_bench.localstack.tree_cpu_s`)."""
    counted = tree_cpu_s([pid])
    if counted is None:
        raise RuntimeError("the workers benchmark reads CPU time from /proc (Linux only)")
    return counted[pid]


def start(stack: LocalStack, setup: Setup, mode: str = "streamed") -> str:
    """The picker of ``setup``, pinned, and an Envoy in front of it (its workers' own ports,
    balanced by least requests, when there are several); returns Envoy's URL."""
    if stack.envoy is not None:
        stack.envoy.stop()
        stack.processes.remove(stack.envoy)
        stack.envoy = None
    stack.picker_args = ["--workers", str(setup.workers)]
    stack.start_picker()
    assert stack.picker is not None
    pin(stack.picker.process.pid, setup.cpus)
    port, admin = free_port(), free_port()
    ports = stack.picker_worker_ports if setup.workers > 1 else ()
    bootstrap = mode_bootstrap(mode, port, admin, stack.picker_grpc_port, ports)
    stack.envoy = stack.launch_envoy("envoy-workers", bootstrap, admin)
    time.sleep(0.5)  # the workers' scrapes and peer sockets settle after the restart
    return f"http://127.0.0.1:{port}"


def run(
    setups: Sequence[Setup],
    connections: Sequence[int],
    requests: int,
    rounds: int,
    endpoints: int,
    prompt_tokens: int,
    out_dir: Path | None,
    mode: str = "approximate",
) -> list[Result]:
    words_per_prompt = int(prompt_tokens / 1.6)  # the simulated tokenizer's ~1.6 tokens/word
    options: dict[str, Any] = (
        {"picker_config": precise_profile(), "kv_events": True, "tokenizer": TOKENIZER}
        if mode == "precise"
        else {}
    )
    with LocalStack(sims=endpoints, time_scale=0.0001, start_envoy=False, **options) as stack:
        outcomes: dict[tuple[Setup, int], list[Outcome]] = {}
        walls: dict[tuple[Setup, int], float] = {}
        cpu: dict[tuple[Setup, int], float] = {}
        for round_index in range(rounds):
            for setup in setups:
                url = start(stack, setup)
                assert stack.picker is not None
                for conns in connections:
                    batch = long_prompt_requests(requests, words_per_prompt, seed=conns)
                    asyncio.run(replay(url, batch[: 4 * conns], conns))  # warm the connections
                    key = (setup, conns)
                    before = cpu_seconds(stack.picker.process.pid)
                    started = time.perf_counter()
                    result = asyncio.run(replay(url, batch, conns))
                    walls[key] = walls.get(key, 0.0) + time.perf_counter() - started
                    cpu[key] = cpu.get(key, 0.0) + cpu_seconds(stack.picker.process.pid) - before
                    outcomes.setdefault(key, []).extend(result)
                print(f"round {round_index + 1}/{rounds}: {setup.name} done", flush=True)
        results = []
        for conns in connections:
            for setup in setups:
                key = (setup, conns)
                figures = summarise(setup.name, conns, outcomes[key], walls[key])
                results.append(
                    Result(
                        **asdict(figures),
                        workers=setup.workers,
                        cpus=list(setup.cpus),
                        picker_cpu_ms_per_request=1000 * cpu[key] / max(1, figures.requests),
                    )
                )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "workers.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
        (out_dir / "workers.md").write_text(format_results(results) + "\n")
    return results


def format_results(results: Sequence[Result]) -> str:
    lines = [
        "| picker | connections | req/s | req/s ÷ 1 worker, 1 core | p50 ms | p99 ms "
        "| picker CPU ms/request | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base: dict[int, float] = {}
    for r in results:
        if r.workers == 1 and len(r.cpus) == 1:
            base[r.connections] = r.requests_per_s
    for r in results:
        ratio = r.requests_per_s / base[r.connections] if r.connections in base else None
        lines.append(
            f"| {r.path} | {r.connections} | {r.requests_per_s:.0f} | "
            f"{'-' if ratio is None else format(ratio, '.2f')} | {r.p50_ms:.2f} | "
            f"{r.p99_ms:.2f} | {r.picker_cpu_ms_per_request:.2f} | {r.errors} |"
        )
    return "\n".join(lines)


# -- the exchange alone -----------------------------------------------------------------------

_EXCHANGE_ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(16)]


def _exchange_store() -> EndpointStore:
    store = EndpointStore(time.monotonic)
    store.set_endpoints(EndpointSpec(address) for address in _EXCHANGE_ENDPOINTS)
    return store


async def _exchange_sender(directory: str, rate: float, seconds: float, keys_per_pick: int) -> int:
    store = _exchange_store()
    sync = PeerSync(store, lambda records, pick: None, directory, 0, 2)
    sync.start()
    await asyncio.sleep(1.0)  # the receiver connects
    rng = random.Random(1)
    shared = keys_per_pick * 4 // 5
    prefixes = [[rng.getrandbits(64) for _ in range(shared)] for _ in range(20)]
    started = time.monotonic()
    sent = 0
    open_requests = []
    while time.monotonic() - started < seconds:
        due = int((time.monotonic() - started) * rate)
        while sent < due:
            endpoint = store.by_address[_EXCHANGE_ENDPOINTS[sent % 16]]
            keys = prefixes[sent % 20] + [
                rng.getrandbits(64) for _ in range(keys_per_pick - shared)
            ]
            sync.picked(endpoint, None, 4000.0, 800.0, 1e6, [("prefix-cache-scorer", keys)])
            open_requests.append(endpoint)
            sent += 1
            if len(open_requests) > 16:
                done = open_requests.pop(0)
                sync.prefilled(done, 800.0, 1e6, False)
                sync.released(done, 4000.0)
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.5)
    sync.close()
    return sent


def _exchange_receiver(
    directory: str, seconds: float, results: Any, ready: Any, finished: Any
) -> None:
    async def receive() -> tuple[float, int]:
        index = ApproximatePrefixIndex(31_250)

        def record(records: Sequence[tuple[str, Sequence[int]]], pick: PeerPick) -> None:
            for _, keys in records:
                for endpoint_id in pick.ids:
                    index.record(endpoint_id, keys)

        sync = PeerSync(_exchange_store(), record, directory, 1, 2)
        sync.start()
        await asyncio.sleep(0.8)
        before = resource.getrusage(resource.RUSAGE_SELF)
        # The sender starts only now: a subscriber misses what was sent before it connected,
        # and starting this process can take seconds on a loaded machine.
        ready.set()
        deadline = time.monotonic() + seconds + 60.0
        while not finished.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the last messages in flight
        after = resource.getrusage(resource.RUSAGE_SELF)
        sync.close()
        cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return cpu_s, sync.received

    results.put(asyncio.run(receive()))


def exchange_cost(rate: float, seconds: float = 8.0, keys_per_pick: int = 250) -> dict[str, float]:
    """The receiving worker's CPU per request another worker routed (see the docstring)."""
    directory = tempfile.mkdtemp(prefix="kv-picker-exchange-")
    context = multiprocessing.get_context("spawn")
    results: Any = context.Queue()
    ready = context.Event()
    finished = context.Event()
    receiver = context.Process(
        target=_exchange_receiver, args=(directory, seconds, results, ready, finished)
    )
    receiver.start()
    try:
        if not ready.wait(60.0):
            raise RuntimeError("the receiving worker did not start within 60 s")
        sent = asyncio.run(_exchange_sender(directory, rate, seconds, keys_per_pick))
        finished.set()
        cpu_s, received = results.get(timeout=90.0)
    finally:
        finished.set()
        receiver.join(10)
    return {
        "rate": rate,
        "keys_per_pick": keys_per_pick,
        "requests": sent,
        "messages_received": received,
        "receiver_cpu_s": cpu_s,
        "cpu_us_per_request": 1e6 * cpu_s / max(1, sent),
        "core_fraction": cpu_s / seconds,
    }


def parse_setup(text: str) -> Setup:
    """``W@CPUS``, e.g. ``2@0,1``: W workers pinned to those CPUs."""
    workers_text, _, cpus_text = text.partition("@")
    workers = int(workers_text)
    cpus = tuple(int(c) for c in cpus_text.split(",") if c.strip())
    if workers < 1 or not cpus:
        raise ValueError(f"{text!r}: expected WORKERS@CPU[,CPU...], e.g. 2@0,1")
    available = os.sched_getaffinity(0)
    if not set(cpus) <= available:
        raise ValueError(f"{text!r}: CPUs {sorted(set(cpus) - available)} are not available")
    return Setup(workers, cpus)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench workers",
        description="Throughput and latency of kv-picker serve --workers N, the picker pinned "
        "to chosen CPUs, through one Envoy, against one worker on one core.",
    )
    parser.add_argument(
        "--setups",
        default="1@1;2@1;1@0,1;2@0,1",
        help="semicolon-separated WORKERS@CPUS (default '1@1;2@1;1@0,1;2@0,1')",
    )
    parser.add_argument("--connections", default="16,64", help="comma list (16,64)")
    parser.add_argument("--requests", type=int, default=600, help="per setup per round (600)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    parser.add_argument("--endpoints", type=int, default=16, help="simulated endpoints (16)")
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="prompt length (4000)")
    add_mode_argument(parser)
    parser.add_argument(
        "--exchange",
        default=None,
        metavar="RATES",
        help="measure only the exchange between workers at these request rates (e.g. "
        "100,300,1000): the receiving worker's CPU per request",
    )
    parser.add_argument(
        "--exchange-keys",
        type=int,
        default=250,
        help="block keys per pick in --exchange (250: a ~4,000-token prompt; the default "
        "profile matches up to 2,048)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write workers.json/.md here")
    args = parser.parse_args(argv)
    if args.exchange is not None:
        try:
            rates = [float(r) for r in args.exchange.split(",") if r.strip()]
        except ValueError:
            parser.error("--exchange must be a comma list of rates")
        if args.exchange_keys < 1:
            parser.error("--exchange-keys must be positive")
        rows = [exchange_cost(rate, keys_per_pick=args.exchange_keys) for rate in rates]
        lines = ["| requests/s routed by the other worker | receiver CPU µs per request "
                 "| receiver CPU (% of a core) |", "|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['rate']:.0f} | {r['cpu_us_per_request']:.0f} | "
                  f"{100 * r['core_fraction']:.1f} |" for r in rows]  # fmt: skip
        print("\n".join(lines))
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "exchange.json").write_text(json.dumps(rows, indent=2))
            (args.out / "exchange.md").write_text("\n".join(lines) + "\n")
        return 0
    try:
        setups = [parse_setup(item.strip()) for item in args.setups.split(";") if item.strip()]
        connections = [int(c) for c in args.connections.split(",") if c.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if not connections or min(connections) < 1 or args.requests < 1 or args.rounds < 1:
        parser.error("--connections, --requests and --rounds must be positive")
    results = run(setups, connections, args.requests, args.rounds, args.endpoints,
                  args.prompt_tokens, args.out, args.mode)  # fmt: skip
    print()
    print(format_results(results))
    return 0 if all(r.errors == 0 for r in results) else 1
