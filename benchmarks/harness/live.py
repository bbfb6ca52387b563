"""Live replay: the same trace slice over HTTP, through real routers, onto simulated endpoints.

Why: the offline simulator runs the service's scheduling code but not its wire path (Envoy,
ext_proc, scraping over HTTP, response streaming), nor the peers' routers. Live mode starts
real processes on 127.0.0.1 and sends the requests at their (time-scaled) arrival times, open
loop, so every target sees the same schedule, the same client and the same endpoints:

```
client (open loop, arrival_s × time_scale)
   ├──> Envoy ──ext_proc──> kv-picker (one run per policy, restarted in between)   live
   ├──> vllm-router --policy P                                                     peers
   └──> sglang-router launch --policy P                                            peers
            └──> simulated vLLM endpoints (started once; prefix caches reset between runs)
```

Prompts are the trace's synthesized text (one word per token for the simulated tokenizer), so
the endpoints see exactly ``input_tokens`` tokens with the trace's block structure. Latencies
are measured in wall time and divided by the time scale to give model seconds, comparable with
offline runs; fixed per-request costs (HTTP, the router, tokenizing on the endpoint) are
multiplied by ``1 / time_scale`` on the way, so small time scales inflate them. Hit ratios and
the request split come from the endpoints' own counters (``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``, ``vllm:request_success``).

Client connections: by default each request opens a fresh connection. sglang-router 0.3.2
stalls about 40 ms on every streamed response over a reused keep-alive connection (reference
peers.md §1.8); a fresh connection avoids that artefact for every target alike.
``--keep-alive`` reuses connections instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from kv_picker.plugins import builtin_registry
from kv_picker_bench.client import Outcome, send
from kv_picker_bench.harness.args import (
    DEFAULT_PEERS,
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    build_parser,
    check_cell_arguments,
    cluster_from_args,
    parse_peer,
    policies_from_args,
    record_command,
    results_dir,
    run_command,
    trace_from_args,
)
from kv_picker_bench.harness.floors import ideal_caches, ttft_floors
from kv_picker_bench.harness.matrix import CLUSTERS, DEFAULT_FAMILY_SEED, cell_workload
from kv_picker_bench.harness.policies import Policy, harness_registry
from kv_picker_bench.harness.report import (
    PolicyMetrics,
    cluster_json,
    describe_cluster,
    latency_stats,
    markdown_table,
    plot_bars,
    plot_cdfs,
    summarize,
    write_json,
)
from kv_picker_bench.harness.simulator import ClusterConfig
from kv_picker_bench.harness.traces import Trace, prompt_text, slice_trace
from kv_picker_bench.localstack import (
    LocalStack,
    ManagedProcess,
    SimSpec,
    free_port,
    http_get,
    on_cpus,
    tree_cpu_s,
)
from kv_picker_bench.workloads import WorkloadRequest

# Explicit, as peers.md §1.9 advises: the defaults differ between versions.
PEER_CACHE_FLAGS = (
    "--cache-threshold",
    "0.3",
    "--balance-abs-threshold",
    "64",
    "--balance-rel-threshold",
    "1.5",
)
_BIN_ENV = {"vllm-router": "VLLM_ROUTER_BIN", "sglang-router": "SGLANG_ROUTER_BIN"}


def router_binary(router: str, explicit: str | None = None) -> str | None:
    """The executable of a peer router: the flag, the environment variable, or PATH."""
    candidate = explicit or os.environ.get(_BIN_ENV[router]) or shutil.which(router)
    if candidate and (os.access(candidate, os.X_OK) or shutil.which(candidate)):
        return candidate
    return None


# ------------------------------------------------------------------------------ client


def trace_requests(trace: Trace, model: str) -> list[tuple[float, WorkloadRequest]]:
    """(arrival_s, request) pairs: streamed completions with the trace's text and lengths.

    A request with a LoRA adapter names it as the body's ``model``; one with a salt sends it
    as ``cache_salt`` (the endpoints must serve the adapters: ``--lora-modules``).
    """
    requests = []
    for request in trace.requests:
        body: dict[str, Any] = {
            "model": request.lora or model,  # an adapter is named as the model, as in vLLM
            "prompt": prompt_text(request, trace.block_tokens),
            "max_tokens": request.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.salt is not None:
            body["cache_salt"] = request.salt
        headers = {"x-session-id": request.session} if request.session else {}
        requests.append(
            (request.arrival_s, WorkloadRequest("/v1/completions", body, headers=headers))
        )
    return requests


async def replay_open_loop(
    base_url: str,
    requests: Sequence[tuple[float, WorkloadRequest]],
    time_scale: float,
    timeout_s: float,
    keep_alive: bool,
) -> tuple[list[Outcome], list[float]]:
    """Send each request at ``arrival_s × time_scale`` wall seconds after the start.

    Returns the outcomes in request order and each request's actual send offset (wall s).
    """
    connector = aiohttp.TCPConnector(limit=0, force_close=not keep_alive)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    sent_s = [0.0] * len(requests)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(index: int, arrival_s: float, request: WorkloadRequest) -> Outcome:
            delay = start + arrival_s * time_scale - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sent_s[index] = loop.time() - start
            return await send(session, base_url, request)

        outcomes = await asyncio.gather(
            *(one(i, arrival_s, request) for i, (arrival_s, request) in enumerate(requests))
        )
    return list(outcomes), sent_s


# ----------------------------------------------------------------------------- targets


@dataclass(slots=True)
class LiveRun:
    """One target's replay: its metrics and raw latencies (model seconds)."""

    metrics: PolicyMetrics
    ttft_s: list[float]
    e2e_s: list[float]
    # The CPUs the router's and the endpoints' processes could run on (Linux), read as the
    # replay started: what --router-cpus did, not what it asked for.
    cpus: dict[str, list[int]] = field(default_factory=dict)


def _counters(stack: LocalStack) -> list[dict[str, float]]:
    metrics = stack.sim_metrics()
    return [metrics[address] for address in stack.sim_addresses]


def summarize_live(
    name: str,
    outcomes: Sequence[Outcome],
    before: Sequence[dict[str, float]],
    after: Sequence[dict[str, float]],
    time_scale: float,
    wall_s: float,
) -> LiveRun:
    """Metrics of one live target, in model seconds (wall / time scale)."""
    ok = [o for o in outcomes if o.ok]

    def delta(key: str) -> list[float]:
        return [a.get(key, 0.0) - b.get(key, 0.0) for a, b in zip(after, before, strict=True)]

    queries = sum(delta("vllm:prefix_cache_queries_total"))
    hits = sum(delta("vllm:prefix_cache_hits_total"))
    served = delta("vllm:request_success_total")
    ttft = [o.ttft_s / time_scale for o in ok]
    e2e = [o.latency_s / time_scale for o in ok]
    tpot = [
        (o.latency_s - o.ttft_s) / time_scale / (o.completion_tokens - 1)
        for o in ok
        if o.completion_tokens > 1
    ]
    output_tokens = sum(o.completion_tokens for o in ok)
    makespan_s = wall_s / time_scale
    mean_served = sum(served) / len(served) if served else 0.0
    errors = [o for o in outcomes if not o.ok]
    metrics = PolicyMetrics(
        policy=name,
        requests=len(outcomes),
        ok=len(ok),
        rejected=sum(1 for o in errors if 400 <= o.status < 500 and o.status != 429),
        shed=sum(1 for o in errors if o.status == 429),
        errors=sum(1 for o in errors if not (400 <= o.status < 500)),
        ttft_s=latency_stats(ttft),
        tpot_s=latency_stats(tpot),
        e2e_s=latency_stats(e2e),
        output_tokens_per_s=output_tokens / makespan_s if makespan_s > 0 else 0.0,
        requests_per_s=len(ok) / makespan_s if makespan_s > 0 else 0.0,
        sustained_tokens_per_s=math.nan,  # offline only: needs each request's token times
        hit_ratio=hits / queries if queries else 0.0,
        imbalance=max(served) / mean_served if mean_served > 0 else math.nan,
        imbalance_busy=math.nan,
        transferred_tokens=0,
        transferred_bytes=0.0,
        makespan_s=makespan_s,
        wall_s=wall_s,
        extra={
            "served_per_endpoint": served,
            "errors_sample": sorted({f"{o.status} {o.error[:120]}" for o in errors})[:5],
        },
    )
    return LiveRun(metrics, ttft, e2e)


# The CPU each part of a run used, in ``extra``: every process shares this host's cores, so a
# router that costs more CPU slows the endpoints and the client too (``live_cpu_table``).
CPU_PARTS = (
    ("router_cpu_s", "router"),
    ("endpoints_cpu_s", "simulated endpoints"),
    ("client_cpu_s", "client"),
)


class _CpuClock:
    """CPU seconds of the router's processes, the endpoints' and this client's, since start."""

    def __init__(self, router: Sequence[ManagedProcess], endpoints: Sequence[ManagedProcess]):
        self._groups = [[p.process.pid for p in router], [p.process.pid for p in endpoints]]
        # With more than one router process (the picker and Envoy), each one's share too.
        self._parts = [(f"router_cpu_s.{p.name}", p.process.pid) for p in router]
        if len(self._parts) < 2:
            self._parts = []
        self._start = self._read()

    def _read(self) -> dict[str, float] | None:
        counted = tree_cpu_s([pid for group in self._groups for pid in group])
        if counted is None:
            return None
        own = os.times()
        totals = [sum(counted[pid] for pid in group) for group in self._groups]
        values = [*totals, own.user + own.system]
        out = dict(zip((key for key, _ in CPU_PARTS), values, strict=True))
        out.update((key, counted[pid]) for key, pid in self._parts)
        return out

    def used(self) -> dict[str, float]:
        now = self._read()
        if now is None or self._start is None:
            return {}
        return {key: round(value - self._start[key], 3) for key, value in now.items()}


def _replay_target(
    stack: LocalStack,
    name: str,
    base_url: str,
    trace: Trace,
    args: argparse.Namespace,
    router: Sequence[ManagedProcess],
) -> LiveRun:
    stack.reset_prefix_caches()
    before = _counters(stack)
    requests = trace_requests(trace, stack.model)
    cpu = _CpuClock(router, stack.sim_processes())
    cpus = {"router": _cpus_of(router), "endpoints": _cpus_of(stack.sim_processes())}
    started = time.perf_counter()
    outcomes, sent_s = asyncio.run(
        replay_open_loop(base_url, requests, args.time_scale, args.timeout, args.keep_alive)
    )
    wall_s = time.perf_counter() - started
    used = cpu.used()
    after = _counters(stack)  # an endpoint counts a request before its last chunk leaves
    scheduled = [arrival_s * args.time_scale for arrival_s, _ in requests]
    run = summarize_live(name, outcomes, before, after, args.time_scale, wall_s)
    run.cpus = cpus
    # How late the client sent requests (a loaded client distorts the schedule).
    lag = [max(0.0, s - a) for s, a in zip(sent_s, scheduled, strict=True)]
    run.metrics.extra["send_lag_p99_ms"] = 1000 * latency_stats(lag)["p99"]
    run.metrics.extra.update(used)
    if base_url == stack.url:
        for line in stack.picker_metrics_text().splitlines():
            if line.startswith("kv_picker_worker_requests_total{") and stack.picker_workers > 1:
                worker = line.split('"')[1]  # how the streams spread
                run.metrics.extra[f"worker_{worker}_requests"] = float(line.rsplit(" ", 1)[1])
            elif line.startswith("kv_picker_time_to_first_byte_seconds_count"):
                # The first bytes the picker saw: every request's with full responses, none
                # with lean ones.
                run.metrics.extra["picker_first_bytes"] = float(line.rsplit(" ", 1)[1])
    return run


def _cpus_of(processes: Sequence[ManagedProcess]) -> list[int]:
    """Every CPU one of ``processes`` may run on (none where that cannot be read)."""
    cpus: set[int] = set()
    if hasattr(os, "sched_getaffinity"):
        for process in processes:
            with contextlib.suppress(OSError):
                cpus |= os.sched_getaffinity(process.process.pid)
    return sorted(cpus)


LIVE_MIN_SCRAPE_S = 0.05
"""The shortest scrape period a live run gives the picker, in wall seconds: scraping N
endpoints over HTTP on the shared host stays cheap."""


def split_cpus(text: str | None) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """``--router-cpus`` as (the routers' CPUs, everything else's); (None, None) when not given.

    Raises:
        UsageError: not a list of CPU numbers this process may run on, or all of them (the
            endpoints and the client need one left).
    """
    if text is None:
        return None, None
    if not hasattr(os, "sched_setaffinity"):
        raise UsageError("--router-cpus needs Linux (sched_setaffinity)")
    try:
        wanted = frozenset(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise UsageError(f"--router-cpus {text!r}: expected CPU numbers, e.g. 1 or 2,3") from None
    allowed = frozenset(os.sched_getaffinity(0))
    if not wanted or not wanted <= allowed:
        raise UsageError(
            f"--router-cpus {text!r}: this process may run on CPUs {_cpu_list(allowed)} only"
        )
    rest = allowed - wanted
    if not rest:
        raise UsageError(
            f"--router-cpus {text!r}: leaves no CPU for the endpoints and the client "
            f"(this process may run on {_cpu_list(allowed)})"
        )
    return wanted, rest


def _cpu_list(cpus: Collection[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def live_scrape_wall_s(scrape_interval_s: float, time_scale: float) -> float:
    """The picker's scrape period in a live run, in wall seconds: the model-time period scaled,
    but not below :data:`LIVE_MIN_SCRAPE_S`."""
    return max(LIVE_MIN_SCRAPE_S, scrape_interval_s * time_scale)


def live_scrape_model_s(scrape_interval_s: float, time_scale: float) -> float:
    """The same period in model time: what an offline replay needs as ``--scrape-interval`` to
    see metrics as stale as the live picker did (at time scale 0.25, 50 ms of wall time is
    200 ms of model time, four times the default offline period)."""
    return live_scrape_wall_s(scrape_interval_s, time_scale) / time_scale


def live_picker_config(
    policy: Policy, scrape_interval_s: float, time_scale: float
) -> dict[str, Any]:
    """The policy's config for the service, validated against the service's own registry.

    The scrape interval is scaled to wall time (:func:`live_scrape_wall_s`) unless the policy
    sets its own ``metrics`` section.
    """
    document = dict(policy.document)
    try:
        policy.config(builtin_registry())
    except Exception as exc:
        raise UsageError(
            f"policy {policy.name}: live mode runs the service's plugins only ({exc})"
        ) from None
    if "metrics" not in document:
        wall_s = live_scrape_wall_s(scrape_interval_s, time_scale)
        document["metrics"] = {"scrapeInterval": f"{wall_s * 1000:.0f}ms"}
    return document


# ----------------------------------------------------------------- offline counterpart


@dataclass(frozen=True, slots=True)
class OfflineCounterpart:
    """The live run's kv-picker policies replayed offline, and how the two agree.

    Attributes:
        scrape_interval_s: Each policy's scrape period offline, in model seconds: the live
            picker's wall-clock period over the time scale.
        rows: Each policy's offline figures, in the live run's order.
        hit_ratio_difference: Each policy's offline hit ratio relative to its live one, minus 1.
        order: For ``ttft_mean`` and ``ttft_p90``, the policies from fastest to slowest, live
            and offline.
    """

    scrape_interval_s: dict[str, float]
    rows: list[PolicyMetrics]
    hit_ratio_difference: dict[str, float]
    order: dict[str, dict[str, list[str]]]

    @property
    def same_order(self) -> dict[str, bool]:
        return {key: o["live"] == o["offline"] for key, o in self.order.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "scrape_interval_s": self.scrape_interval_s,
            "policies": {m.policy: m.to_json() for m in self.rows},
            "hit_ratio_difference": self.hit_ratio_difference,
            "order": self.order,
            "same_order": self.same_order,
        }


def _ranked(rows: Sequence[PolicyMetrics], stat: str) -> list[str]:
    return [m.policy for m in sorted(rows, key=lambda m: (m.ttft_s[stat], m.policy))]


def offline_counterpart(
    trace: Trace,
    config: ClusterConfig,
    policies: Sequence[Policy],
    documents: Sequence[dict[str, Any]],
    live_rows: Sequence[PolicyMetrics],
    time_scale: float,
    seed: int,
    responses: str = "full",
) -> OfflineCounterpart:
    """Replay the live run's requests offline, each policy scraping as its live picker did.

    The simulator runs the same EndpointPickerConfig through the same ``Director``; what differs
    is the wire (Envoy, HTTP, scrapes over TCP) and time (the live endpoints run in scaled wall
    time on a shared host). The scrape period is the one thing the harness chose differently:
    live it is wall-clock, at least 50 ms, so at time scale 0.25 the picker's metrics are 200 ms
    old in model time, and a replay at the default 50 ms would see fresher ones.
    """
    registry = harness_registry()
    by_name = {m.policy: m for m in live_rows}
    rows: list[PolicyMetrics] = []
    intervals: dict[str, float] = {}
    for policy, document in zip(policies, documents, strict=True):
        live_config = Policy(policy.name, document, policy.source).config(registry)
        interval = live_config.metrics.scrape_interval_s / time_scale
        offline = replace(config, scrape_interval_s=interval, first_byte_seen=responses == "full")
        rows.append(summarize(policy.replay(trace, offline, seed), offline))
        intervals[policy.name] = interval
    live = [by_name[m.policy] for m in rows]
    difference = {
        m.policy: (m.hit_ratio / by_name[m.policy].hit_ratio - 1)
        if by_name[m.policy].hit_ratio > 0
        else math.nan
        for m in rows
    }
    order = {
        f"ttft_{stat}": {"live": _ranked(live, stat), "offline": _ranked(rows, stat)}
        for stat in ("mean", "p90")
    }
    return OfflineCounterpart(intervals, rows, difference, order)


def offline_section(
    counterpart: OfflineCounterpart, live_rows: Sequence[PolicyMetrics]
) -> list[str]:
    """The report's comparison of the live run with its offline counterpart (Markdown lines)."""
    by_name = {m.policy: m for m in live_rows}
    periods = sorted({f"{s * 1000:g} ms" for s in counterpart.scrape_interval_s.values()})
    lines = [
        "## Live against offline",
        "",
        "The same requests through the offline simulator (the same configs through the same "
        f"`Director`), scraped every {' or '.join(periods)} of model time as the live picker "
        "was. Latencies differ in scale (live ones include the gateway's, the client's and the "
        "endpoints' time on this host, divided by the time scale): compare hit ratios, and the "
        "order of the policies.",
        "",
        "| policy | token hit ratio, live / offline (difference) | TTFT mean s, live / offline "
        "| TTFT p90 s, live / offline |",
        "|---|---|---|---|",
    ]
    for m in counterpart.rows:
        live = by_name[m.policy]
        difference = counterpart.hit_ratio_difference[m.policy]
        lines.append(
            f"| {m.policy} | {live.hit_ratio:.4f} / {m.hit_ratio:.4f} ({difference:+.1%}) "
            f"| {live.ttft_s['mean']:.3f} / {m.ttft_s['mean']:.3f} "
            f"| {live.ttft_s['p90']:.3f} / {m.ttft_s['p90']:.3f} |"
        )
    lines.append("")
    finite = [abs(d) for d in counterpart.hit_ratio_difference.values() if math.isfinite(d)]
    if finite:
        lines.append(f"Hit ratios: the largest difference is {max(finite):.1%}.")
    if len(counterpart.rows) > 1:
        for key, label in (("ttft_mean", "TTFT mean"), ("ttft_p90", "TTFT p90")):
            order = counterpart.order[key]
            live_text = " < ".join(order["live"])
            if order["live"] == order["offline"]:
                lines.append(f"Order by {label}: {live_text}, live and offline.")
            else:
                lines.append(
                    f"Order by {label}: live {live_text}; offline {' < '.join(order['offline'])}."
                )
    lines.append("")
    return lines


def start_peer(
    router: str,
    policy: str,
    binary: str,
    urls: Sequence[str],
    workdir: Path,
    cpus: Collection[int] | None = None,
) -> tuple[ManagedProcess, str]:
    """Start a peer router on 127.0.0.1 (on ``cpus``, by default this process's) and wait until
    it reports every worker healthy."""
    port = free_port()
    metrics_port = free_port()
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--worker-startup-check-interval",
        "1",
        "--health-check-interval-secs",
        "5",
        *PEER_CACHE_FLAGS,
    ]
    argv = [binary, "launch", *common] if router == "sglang-router" else [binary, *common]
    log = workdir / f"{router}-{policy}.log"
    process = ManagedProcess(f"{router}:{policy}", argv, log, cpus=cpus)
    base_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        status, body = http_get(base_url + "/readiness", timeout_s=1.0)
        if status == 404:
            return http_get(base_url + "/health", timeout_s=1.0)[0] == 200
        if status != 200:
            return False
        document = json.loads(body or b"{}")
        return int(document.get("healthy_workers", 0)) >= len(urls)

    try:
        process.wait_until(ready, 60.0, f"{len(urls)} healthy workers")
    except BaseException:
        process.stop()
        raise
    return process, base_url


# -------------------------------------------------------------------------------- run


def run_live(argv: Sequence[str], command: str) -> int:
    parser = build_parser(command)
    args = parser.parse_args(list(argv))
    if not (args.time_scale > 0 and math.isfinite(args.time_scale)):
        raise UsageError("--time-scale must be a positive number")
    check_cell_arguments(parser, args)
    router_cpus, other_cpus = split_cpus(args.router_cpus)
    started = time.perf_counter()
    cell_line: list[str] = []
    cell_json: dict[str, Any] | None = None
    if args.cell is not None:
        draw = DEFAULT_FAMILY_SEED if args.family_seed is None else args.family_seed
        cell, trace, config, load = cell_workload(
            args.cell, draw, getattr(args, "responses", "full"), cached_when=args.cached_when
        )
        if CLUSTERS[cell.cluster].pd:
            raise UsageError(
                f"--cell {args.cell!r}: the pd cluster runs offline only (the simulated "
                "endpoints do not model P/D transfers)"
            )
        whole = len(trace.requests)
        trace = slice_trace(trace, first=args.first)
        kept = "" if len(trace.requests) == whole else f" (the first {len(trace.requests)})"
        cell_line = [
            f"Matrix cell: {cell.label}, draw {draw} (`kv-picker bench matrix --family-seed "
            f"{draw}`), {whole:,} requests{kept}: prefill load {load.prefill:.2f}, decode load "
            f"{load.decode:.2f}.",
            "",
        ]
        cell_json = {
            "cell": cell.label,
            "draw": draw,
            "requests": whole,
            "prefill_load": load.prefill,
            "decode_load": load.decode,
        }
    else:
        trace = trace_from_args(args, load=args.load)
        config = cluster_from_args(args)
    if args.pd or any(e.role != "both" for e in config.endpoints):
        raise UsageError(
            f"{command} mode: the simulated endpoints do not model P/D transfers; "
            "use role 'both' (offline replay covers P/D)"
        )
    policies: list[Policy] = []
    if command == "live":
        if not args.policy:
            args.policy = ["kv-picker"]
        policies = policies_from_args(args)
    documents = [live_picker_config(p, config.scrape_interval_s, args.time_scale) for p in policies]
    peer_items = args.peer or (list(DEFAULT_PEERS) if command == "peers" else [])
    peers = [parse_peer(item) for item in peer_items]
    binaries: dict[str, str] = {}
    missing = []
    for router, _ in peers:
        explicit = args.vllm_router_bin if router == "vllm-router" else args.sglang_router_bin
        found = router_binary(router, explicit)
        if found is None:
            missing.append(router)
        else:
            binaries[router] = found
    if missing:
        raise UsageError(
            f"peer router(s) not found: {', '.join(sorted(set(missing)))}; install them "
            "(pip install vllm-router sglang-router, in a separate venv) and pass "
            "--vllm-router-bin / --sglang-router-bin or set VLLM_ROUTER_BIN / SGLANG_ROUTER_BIN"
        )
    if not policies and not peers:
        raise UsageError("nothing to run: give --policy and/or --peer")

    sims = []
    for i, setup in enumerate(config.endpoints):
        extra = ("--num-gpu-blocks", str(config.capacity_blocks(i)))
        sims.append(SimSpec(role=setup.role, hardware_class=setup.hardware, extra_args=extra))
    sim_args = (
        "--timing",
        config.timing.name,
        "--kv-bytes-per-token",
        str(config.kv_bytes_per_token),
        "--block-size",
        str(config.block_size),
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--max-num-batched-tokens",
        str(config.max_num_batched_tokens),
        "--max-model-len",
        str(config.max_model_len),
        "--cached-when",
        config.cached_when,
    )
    adapters = sorted({r.lora for r in trace.requests if r.lora})
    if adapters:  # the endpoints must serve every adapter the trace names
        sim_args = (*sim_args, "--lora-modules", *adapters, "--max-loras", str(len(adapters)))
    folder = results_dir(args, command, trace.name)
    text = record_command(folder, command, argv)
    body_mode = getattr(args, "body_mode", "FULL_DUPLEX_STREAMED")
    runs: list[LiveRun] = []
    stack = LocalStack(
        router_cpus=router_cpus,
        sims=sims,
        picker_config=documents[0] if documents else {},
        body_mode=body_mode,
        picker_args=("--workers", str(getattr(args, "picker_workers", 1))),
        model=config.model,
        time_scale=args.time_scale,
        sim_args=sim_args,
        responses=getattr(args, "responses", "full"),
    )
    # The endpoints (started below) and the client (this thread) run on the other CPUs.
    with on_cpus(other_cpus):
        try:
            if documents:
                stack.start()
            else:
                stack.start_sims()
            if not args.quiet:
                print(
                    f"{command}: {len(trace.requests)} requests over {len(sims)} endpoints "
                    f"(time scale {args.time_scale:g}) -> {folder}",
                    file=sys.stderr,
                )
            for policy, document in zip(policies, documents, strict=True):
                stack.start_picker(document)
                router = [p for p in (stack.picker, stack.envoy) if p is not None]
                runs.append(_replay_target(stack, policy.name, stack.url, trace, args, router))
                _progress(args, runs[-1])
            urls = [f"http://{address}" for address in stack.sim_addresses]
            for router, policy_name in peers:
                process, base_url = start_peer(
                    router, policy_name, binaries[router], urls, stack.workdir, router_cpus
                )
                try:
                    name = f"{router}:{policy_name}"
                    runs.append(_replay_target(stack, name, base_url, trace, args, [process]))
                    _progress(args, runs[-1])
                finally:
                    process.stop()
        finally:
            stack.close()
    rows = [run.metrics for run in runs]
    counterpart = None
    if policies and getattr(args, "offline", False):
        counterpart = offline_counterpart(
            trace,
            config,
            policies,
            documents,
            rows,
            args.time_scale,
            args.seed,
            getattr(args, "responses", "full"),
        )
    wall_s = time.perf_counter() - started
    caches = ideal_caches(trace, config)
    bounds = caches.hit_ratios()
    floors = ttft_floors(trace, config, caches)
    summary = trace.summary()
    # The picker scraped on a wall-clock period: report it in model time, as every other figure.
    scrape_wall_s = live_scrape_wall_s(config.scrape_interval_s, args.time_scale)
    model_scrape_s = live_scrape_model_s(config.scrape_interval_s, args.time_scale)
    scraped = replace(config, scrape_interval_s=model_scrape_s)
    scrape_note = []
    if policies and not math.isclose(model_scrape_s, config.scrape_interval_s):
        scrape_note = [
            f"The picker scraped every {scrape_wall_s * 1000:g} ms of wall time, "
            f"{model_scrape_s * 1000:g} ms of model time (policies that set "
            "their own `metrics` section excepted): an offline replay of the same requests "
            f"sees metrics as stale with `--scrape-interval {model_scrape_s * 1000:g}ms`.",
            "",
        ]
    lines = [
        f"# {args.title or f'{command.capitalize()} replay: ' + trace.name}",
        "",
        f"Command: `{text}`",
        "",
        f"Trace: {summary['name']}, {summary['requests']:,} requests at "
        f"{summary['rate_per_s'] or 0:.2f} requests/s (model time); time scale "
        f"{args.time_scale:g}; {'keep-alive' if args.keep_alive else 'fresh'} client "
        "connections"
        + (
            "; Envoy shows the picker each response's headers and end, no chunk (`lean`)."
            if getattr(args, "responses", "full") == "lean"
            else "."
        ),
        "",
        *cell_line,
        f"Cluster: {describe_cluster(scraped)} (simulated endpoints over HTTP on 127.0.0.1).",
        "",
        *(
            []
            if router_cpus is None or other_cpus is None
            else [
                f"CPUs: the router (kv-picker and Envoy, or the peer router) on "
                f"{_cpu_list(router_cpus)}; the endpoints and the client on "
                f"{_cpu_list(other_cpus)}.",
                "",
            ]
        ),
        *scrape_note,
        markdown_table(rows, bounds, floors.stats()),
        "",
        *live_cpu_table(rows),
        *(offline_section(counterpart, rows) if counterpart is not None else []),
        f"Wall time of the whole run: {wall_s:.1f} s.",
    ]
    report = "\n".join(lines) + "\n"
    (folder / "results.md").write_text(report, encoding="utf-8")
    write_json(
        folder / "results.json",
        {
            "command": text,
            "mode": command,
            "time_scale": args.time_scale,
            "responses": getattr(args, "responses", "full"),
            "trace": summary,
            "cell": cell_json,
            "router_cpus": None if router_cpus is None else sorted(router_cpus),
            "process_cpus": {run.metrics.policy: run.cpus for run in runs},
            "cluster": cluster_json(scraped),
            "picker_scrape_interval_s": {
                "wall": scrape_wall_s,
                "model": model_scrape_s,
            },
            "bounds": bounds,
            "floors": floors.stats(),
            "wall_s": wall_s,
            "policies": {m.policy: m.to_json() for m in rows},
            "offline": counterpart.to_json() if counterpart is not None else None,
        },
    )
    if not args.no_plots and runs:
        plot_cdfs(
            {r.metrics.policy: r.ttft_s for r in runs},
            folder / "ttft_cdf.png",
            f"TTFT ({command}), {trace.name}",
            "time to first token (model s)",
            floor=floors.practical_s,
        )
        plot_cdfs(
            {r.metrics.policy: r.e2e_s for r in runs},
            folder / "e2e_cdf.png",
            f"End-to-end latency ({command}), {trace.name}",
            "end-to-end latency (model s)",
        )
        plot_bars(rows, bounds, folder / "hit_imbalance.png")
    print(report)
    print(f"results: {folder}")
    failed = [m.policy for m in rows if m.ok == 0]
    return EXIT_FAILURE if failed else EXIT_OK


def live_cpu_table(rows: Sequence[PolicyMetrics]) -> list[str]:
    """Markdown lines: the CPU each run's router, endpoints and client used (none without
    ``/proc``)."""
    measured = [m for m in rows if all(key in m.extra for key, _ in CPU_PARTS)]
    if not measured:
        return []
    lines = [
        "CPU seconds used during each run by the router (kv-picker with Envoy, or the peer "
        f"router), the simulated endpoints and the client, on this host's {os.cpu_count()} "
        "shared cores: a router that takes more CPU slows the endpoints and the client too, "
        "and that shows in every latency above.",
        "",
        "| policy | " + " | ".join(label for _, label in CPU_PARTS) + " | wall s |",
        "|---|" + "---:|" * (len(CPU_PARTS) + 1),
    ]
    for m in measured:
        cells = [f"{m.extra[key]:.1f}" for key, _ in CPU_PARTS]
        shares = [
            f"{key.partition('.')[2]} {value:.1f}"
            for key, value in m.extra.items()
            if key.startswith("router_cpu_s.")
        ]
        if shares:
            cells[0] += f" ({' + '.join(shares)})"
        lines.append(f"| {m.policy} | {' | '.join(cells)} | {m.wall_s:.1f} |")
    return [*lines, ""]


def _progress(args: argparse.Namespace, run: LiveRun) -> None:
    if args.quiet:
        return
    m = run.metrics
    print(
        f"  {m.policy}: {m.ok}/{m.requests} ok, TTFT p50 {m.ttft_s['p50']:.3f} s, "
        f"hit ratio {m.hit_ratio:.3f}, {m.wall_s:.1f} s wall",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``kv-picker bench live``."""
    args = list(sys.argv[1:] if argv is None else argv)
    with contextlib.suppress(BrokenPipeError):
        return run_command("live", args, lambda: run_live(args, "live"))
    return 1
