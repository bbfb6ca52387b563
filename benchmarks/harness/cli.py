"""Command line of the harness: ``kv-picker bench replay|sweep|live|peers`` (also
``python -m benchmarks ...``).

Every run writes a results folder (``results/<time>-<command>-<trace>/`` unless ``--out``):
``command.txt`` (the exact command and working directory), ``results.md``, ``results.json``
and PNG plots. Exit codes: 0 success, 1 runtime failure, 2 bad usage, trace or config.

Offline runs fan the (load, policy) jobs out over ``--jobs`` processes; each job is
deterministic under ``--seed``, so the result does not depend on the number of processes.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_picker.decode import parse_duration_s
from kv_picker.errors import ConfigError
from kv_picker_bench.harness.policies import Policy, harness_registry, pd_variant, resolve_policies
from kv_picker_bench.harness.report import (
    PolicyMetrics,
    cluster_json,
    describe_cluster,
    format_tokens,
    hit_ratio_bounds,
    markdown_table,
    plot_bars,
    plot_cdfs,
    plot_load_curve,
    summarize,
    write_json,
)
from kv_picker_bench.harness.simulator import ClusterConfig, EndpointSetup, run_policy
from kv_picker_bench.harness.traces import Trace, TraceError, parse_trace_spec, slice_trace
from kv_picker_bench.sim.engine import HARDWARE_CLASSES

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
RESULTS_DIR = Path("results")


class UsageError(Exception):
    """A bad flag value; reported as ``kv-picker bench: error: ...`` with exit code 2."""


# ------------------------------------------------------------------------------ parsing


def add_trace_arguments(parser: argparse.ArgumentParser, with_load: bool = True) -> None:
    group = parser.add_argument_group("trace")
    group.add_argument(
        "--trace",
        required=True,
        metavar="SPEC",
        help="a trace file (Mooncake JSONL or kv-picker JSONL, detected from the first line) or "
        "a generator: shared-prefix:groups=150,users=5,context=6000,question=1200,output=1000,"
        "requests=2000,rate=20 | llm-d (llm-d's published workload and load ladder) | "
        "chat:sessions=200,turns=5,system=1000,user=200,output=200,think=10,rate=2",
    )
    group.add_argument("--first", type=int, metavar="N", help="keep the first N requests")
    group.add_argument(
        "--window",
        metavar="START:END",
        help="keep requests arriving in [START, END) seconds of trace time (applied before --first)",
    )
    if with_load:
        group.add_argument(
            "--load",
            type=float,
            default=1.0,
            metavar="X",
            help="multiply the arrival rate by X (timestamps divided by X; default 1)",
        )


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--endpoints", type=int, default=16, help="identical H100 endpoints (default 16)"
    )
    group.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="ROLE[:HW[:BLOCKS]][xCOUNT]",
        help="heterogeneous cluster instead of --endpoints, repeatable: e.g. prefill:H100x4 "
        f"decode:H100x12 both:A100:16384x2; roles both|prefill|decode, hardware "
        f"{'|'.join(sorted(HARDWARE_CLASSES))}",
    )
    group.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=32_768,
        help="KV capacity of an H100-class endpoint in blocks, scaled by hardware class "
        "(default 32768 = 524,288 tokens of 16)",
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="per endpoint (64)")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="step token budget (8192)"
    )
    group.add_argument(
        "--max-model-len", type=int, default=131_072, help="longest prompt+output (131072)"
    )
    group.add_argument(
        "--scrape-interval",
        default="50ms",
        help="simulated metrics scrape period; scorers see values up to this old (50ms)",
    )
    group.add_argument(
        "--kv-event-delay",
        default="0",
        help="delay of KV events reaching event-driven plugins, e.g. 20ms (0)",
    )
    group.add_argument(
        "--pd",
        action="store_true",
        help="P/D: run each policy as a decode and a prefill profile under pd-profile-handler "
        "(give prefill and decode endpoints with --endpoint)",
    )
    group.add_argument(
        "--pd-threshold-tokens",
        type=int,
        default=1,
        help="with --pd: disaggregate when at least this many prompt tokens are not cached on "
        "the chosen decode endpoint (pd-profile-handler's nonCachedTokens; default 1)",
    )
    group.add_argument(
        "--transfer-gbps",
        type=float,
        default=200.0,
        help="P/D KV transfer bandwidth in Gbit/s (200)",
    )
    group.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=131_072,
        help="KV bytes per token, for transfer time and volume (131072: an 8B model in fp16)",
    )


def add_policy_arguments(parser: argparse.ArgumentParser, offline: bool = True) -> None:
    group = parser.add_argument_group("policies")
    group.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME|NAME=FILE|FILE",
        help="a baseline (random, round-robin, least-queue, gie-default, sglang-cache-aware, "
        "dynamo-cost, kv-picker), 'baselines' for all of them (the default), or an "
        "EndpointPickerConfig YAML file, optionally named; repeatable",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of the policies (0)")


def add_output_arguments(parser: argparse.ArgumentParser, offline: bool = True) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--out", type=Path, help="results folder (default: results/<time>-...)")
    group.add_argument("--title", default="", help="title of the Markdown report")
    group.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    group.add_argument("--quiet", action="store_true", help="no progress bar")
    if offline:
        group.add_argument(
            "--jobs",
            type=int,
            default=min(2, os.cpu_count() or 1),
            help="worker processes for the (load, policy) jobs (default: up to 2)",
        )
        group.add_argument(
            "--save-requests",
            action="store_true",
            help="also write one JSONL line per request and policy",
        )


def parse_window(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    start, _, end = text.partition(":")
    try:
        return float(start), float(end)
    except ValueError:
        raise UsageError(f"--window {text!r}: expected START:END in seconds") from None


_ENDPOINT_RE = re.compile(r"^(both|prefill|decode)(?::([A-Za-z0-9]+?))?(?::(\d+))?(?:x(\d+))?$")


def cluster_from_args(args: argparse.Namespace) -> ClusterConfig:
    endpoints: list[EndpointSetup] = []
    for item in args.endpoint:
        match = _ENDPOINT_RE.match(item)
        if not match:
            raise UsageError(
                f"--endpoint {item!r}: expected ROLE[:HW[:BLOCKS]][xCOUNT], e.g. decode:H100x4"
            )
        role, hardware, blocks, count = match.groups()
        hardware = hardware or "H100"
        if hardware not in HARDWARE_CLASSES:
            raise UsageError(
                f"--endpoint {item!r}: unknown hardware {hardware!r}; known: "
                f"{', '.join(sorted(HARDWARE_CLASSES))}"
            )
        setup = EndpointSetup(role, hardware, int(blocks) if blocks else None)
        endpoints.extend([setup] * int(count or 1))
    if not endpoints:
        if args.endpoints < 1:
            raise UsageError("--endpoints must be >= 1")
        endpoints = [EndpointSetup()] * args.endpoints
    try:
        return ClusterConfig(
            endpoints=tuple(endpoints),
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            scrape_interval_s=parse_duration_s(args.scrape_interval, "--scrape-interval"),
            kv_event_delay_s=_duration_or_zero(args.kv_event_delay, "--kv-event-delay"),
            transfer_bytes_per_s=args.transfer_gbps * 1e9 / 8,
            kv_bytes_per_token=args.kv_bytes_per_token,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _duration_or_zero(text: str, where: str) -> float:
    if text.strip() in ("0", "0s", "0ms"):
        return 0.0
    return parse_duration_s(text, where)


def trace_from_args(args: argparse.Namespace, load: float = 1.0) -> Trace:
    trace = parse_trace_spec(args.trace)
    return slice_trace(trace, first=args.first, window_s=parse_window(args.window), load=load)


def policies_from_args(args: argparse.Namespace) -> list[Policy]:
    policies = resolve_policies(args.policy)
    if getattr(args, "pd", False):
        policies = [pd_variant(p, args.pd_threshold_tokens) for p in policies]
    registry = harness_registry()
    for policy in policies:
        policy.config(registry)  # fail before any work on a bad config
    return policies


def results_dir(args: argparse.Namespace, command: str, trace_name: str) -> Path:
    if args.out is not None:
        path = Path(args.out)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", trace_name)[:40]
        path = RESULTS_DIR / f"{stamp}-{command}-{safe}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def record_command(folder: Path, command: str, argv: Sequence[str]) -> str:
    text = "kv-picker bench " + shlex.join([command, *argv])
    (folder / "command.txt").write_text(
        f"{text}\n# cwd: {Path.cwd()}\n# python: {shlex.join(sys.argv)}\n", encoding="utf-8"
    )
    return text


# ----------------------------------------------------------------------------- offline


@dataclass(slots=True)
class _Job:
    load: float
    policy: Policy


@dataclass(slots=True)
class _JobResult:
    load: float
    metrics: PolicyMetrics
    ttft_s: list[float]
    e2e_s: list[float]
    requests: list[dict[str, Any]]


_WORKER: dict[str, Any] = {}


def _init_worker(
    traces: dict[float, Trace], config: ClusterConfig, seed: int, counter: Any, save: bool
) -> None:
    _WORKER.update(traces=traces, config=config, seed=seed, counter=counter, save=save)


def _run_job(job: _Job) -> _JobResult:
    traces: dict[float, Trace] = _WORKER["traces"]
    config: ClusterConfig = _WORKER["config"]
    counter = _WORKER["counter"]
    done = [0]

    def progress(count: int) -> None:
        if counter is None:
            return
        if callable(counter):
            counter(count - done[0])
        else:
            with counter.get_lock():
                counter.value += count - done[0]
        done[0] = count

    registry = harness_registry()
    trace = traces[job.load]
    result = run_policy(
        trace,
        config,
        job.policy.config(registry),
        registry,
        job.policy.name,
        seed=_WORKER["seed"],
        progress=progress,
        needs_prompt=job.policy.needs_prompt,
    )
    metrics = summarize(result, config)
    rows: list[dict[str, Any]] = []
    if _WORKER["save"]:
        rows = [
            {
                "index": o.index,
                "arrival_s": o.arrival_s,
                "status": o.status,
                "endpoint": o.endpoint,
                "prefill_endpoint": o.prefill_endpoint,
                "ttft_s": o.ttft_s,
                "e2e_s": o.e2e_s,
                "prompt_tokens": o.prompt_tokens,
                "cached_tokens": o.cached_tokens,
                "output_tokens": o.output_tokens,
                "transferred_tokens": o.transferred_tokens,
            }
            for o in result.outcomes
        ]
    return _JobResult(
        job.load,
        metrics,
        [o.ttft_s for o in result.outcomes],
        [o.e2e_s for o in result.outcomes],
        rows,
    )


def run_offline(
    traces: dict[float, Trace],
    config: ClusterConfig,
    policies: Sequence[Policy],
    seed: int,
    jobs: int,
    quiet: bool,
    save_requests: bool = False,
) -> list[_JobResult]:
    """Run every (load, policy) pair; results in job order."""
    work = [_Job(load, policy) for load in traces for policy in policies]
    total = sum(len(traces[job.load].requests) for job in work)
    bar = None
    if not quiet:
        from tqdm import tqdm  # type: ignore[import-untyped]

        tqdm.monitor_interval = 0  # no monitor thread
        bar = tqdm(total=total, unit="req", desc="replay", smoothing=0.1, file=sys.stderr)
    results: list[_JobResult] = []
    if jobs <= 1 or len(work) == 1:
        _init_worker(traces, config, seed, bar.update if bar is not None else None, save_requests)
        for job in work:
            results.append(_run_job(job))
    else:
        # spawn, not fork: forking a process that has threads (an event loop's executor, a
        # test runner's helpers) is unsafe and deprecated from Python 3.12 on.
        context = multiprocessing.get_context("spawn")
        counter = context.Value("q", 0)
        with context.Pool(
            min(jobs, len(work)),
            initializer=_init_worker,
            initargs=(traces, config, seed, counter, save_requests),
        ) as pool:
            pending = pool.map_async(_run_job, work, chunksize=1)
            shown = 0
            while not pending.ready():
                pending.wait(0.25)
                if bar is not None:
                    value = counter.value
                    bar.update(value - shown)
                    shown = value
            results = pending.get()
            if bar is not None:
                bar.update(total - shown)
    if bar is not None:
        bar.close()
    return results


def _write_offline_report(
    folder: Path,
    command: str,
    title: str,
    traces: dict[float, Trace],
    config: ClusterConfig,
    bounds: dict[str, float],
    results: Sequence[_JobResult],
    wall_s: float,
    plots: bool,
) -> str:
    by_load: dict[float, list[PolicyMetrics]] = {}
    for result in results:
        by_load.setdefault(result.load, []).append(result.metrics)
    base = next(iter(traces.values()))
    summary = base.summary()
    lines = [
        f"# {title or 'Trace replay: ' + base.name}",
        "",
        f"Command: `{command}`",
        "",
        f"Trace: {summary['name']} ({summary['source']}), {summary['requests']:,} requests, "
        f"mean {summary['mean_input_tokens']:,.0f} input / {summary['mean_output_tokens']:,.0f} "
        f"output tokens{'; ' + ', '.join(summary['notes']) if summary['notes'] else ''}.",
        "",
        f"Cluster: {describe_cluster(config)}.",
        "",
        f"Token hit-ratio bounds from the trace: unbounded single cache "
        f"{bounds['unbounded']:.3f}; pooled LRU of the cluster's KV "
        f"({format_tokens(bounds['pooled_capacity_tokens'])} tokens) {bounds['pooled_lru']:.3f}.",
        "",
    ]
    rates: dict[float, float] = {}
    for load, rows in by_load.items():
        trace = traces[load]
        rate = trace.summary()["rate_per_s"] or 0.0
        rates[load] = rate
        lines += [
            f"## Load x{load:g} ({rate:.2f} requests/s offered, {trace.duration_s:,.0f} s)",
            "",
            markdown_table(rows, bounds),
            "",
        ]
    lines.append(f"Wall time of the whole run: {wall_s:.1f} s.")
    text = "\n".join(lines) + "\n"
    (folder / "results.md").write_text(text, encoding="utf-8")
    document = {
        "command": command,
        "trace": summary,
        "cluster": cluster_json(config),
        "bounds": bounds,
        "wall_s": wall_s,
        "loads": {
            f"{load:g}": {
                "rate_per_s": rates[load],
                "policies": {m.policy: m.to_json() for m in rows},
            }
            for load, rows in by_load.items()
        },
    }
    write_json(folder / "results.json", document)
    for result in results:
        if result.requests:
            import json

            path = folder / f"requests-x{result.load:g}-{result.metrics.policy}.jsonl"
            with path.open("w", encoding="utf-8") as handle:
                for row in result.requests:
                    handle.write(json.dumps(row) + "\n")
    if plots:
        for load, rows in by_load.items():
            suffix = f"-x{load:g}" if len(by_load) > 1 else ""
            chosen = [r for r in results if r.load == load]
            plot_cdfs(
                {r.metrics.policy: r.ttft_s for r in chosen},
                folder / f"ttft_cdf{suffix}.png",
                f"TTFT, {base.name}, load x{load:g}",
                "time to first token (s)",
            )
            plot_cdfs(
                {r.metrics.policy: r.e2e_s for r in chosen},
                folder / f"e2e_cdf{suffix}.png",
                f"End-to-end latency, {base.name}, load x{load:g}",
                "end-to-end latency (s)",
            )
            plot_bars(rows, bounds, folder / f"hit_imbalance{suffix}.png")
        if len(by_load) > 1:
            plot_load_curve(by_load, folder / "ttft_vs_load.png", rates)
    return text


def _offline(argv: Sequence[str], command: str, sweep: bool) -> int:
    parser = build_parser(command)
    args = parser.parse_args(list(argv))
    started = time.perf_counter()
    loads = _parse_loads(args.loads) if sweep else [args.load]
    config = cluster_from_args(args)
    policies = policies_from_args(args)
    base = trace_from_args(args)
    traces = {load: slice_trace(base, load=load) if load != 1.0 else base for load in loads}
    folder = results_dir(args, command, base.name)
    text = record_command(folder, command, argv)
    if not args.quiet:
        print(
            f"{command}: {len(base.requests):,} requests x {len(policies)} policies x "
            f"{len(loads)} load(s) over {len(config.endpoints)} endpoints -> {folder}",
            file=sys.stderr,
        )
    bounds = hit_ratio_bounds(base, config)
    results = run_offline(
        traces, config, policies, args.seed, args.jobs, args.quiet, args.save_requests
    )
    wall_s = time.perf_counter() - started
    report = _write_offline_report(
        folder, text, args.title, traces, config, bounds, results, wall_s, not args.no_plots
    )
    print(report)
    print(f"results: {folder}")
    return EXIT_OK


def _parse_loads(text: str) -> list[float]:
    try:
        loads = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise UsageError(f"--loads {text!r}: expected numbers such as 1,2,4") from None
    if not loads or any(not (x > 0 and math.isfinite(x)) for x in loads):
        raise UsageError("--loads: give positive numbers such as 1,2,4")
    return sorted(set(loads))


# ------------------------------------------------------------------------------ parsers


def build_parser(command: str) -> argparse.ArgumentParser:
    """The argument parser of one harness command."""
    descriptions = {
        "replay": "Replay a trace offline through the cluster simulator, every policy on the "
        "same requests, and write a Markdown table, JSON and plots.",
        "sweep": "Offline replay at several offered loads (arrival rate multipliers) x policies; "
        "adds a TTFT-vs-load plot.",
        "live": "Replay a trace slice, time-scaled, through real Envoy + kv-picker + simulated "
        "vLLM endpoints over HTTP (kv-picker policies only).",
        "peers": "Replay a trace slice through vllm-router and/or sglang-router in front of the "
        "same simulated endpoints, for comparison with live mode.",
    }
    parser = argparse.ArgumentParser(
        prog=f"kv-picker bench {command}",
        description=descriptions[command],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter
        if command not in ("replay", "sweep")
        else argparse.HelpFormatter,
    )
    offline = command in ("replay", "sweep")
    add_trace_arguments(parser, with_load=command != "sweep")
    if command == "sweep":
        parser.add_argument(
            "--loads",
            default="1,2,4,8",
            help="comma-separated arrival-rate multipliers (default 1,2,4,8)",
        )
    add_cluster_arguments(parser)
    if command != "peers":
        add_policy_arguments(parser, offline)
    add_output_arguments(parser, offline)
    if not offline:
        from kv_picker_bench.harness.live import add_live_arguments

        add_live_arguments(parser, command)
    return parser


def run_command(command: str, argv: Sequence[str], body: Callable[[], int]) -> int:
    """Run a command body, mapping the harness's errors to messages and exit codes."""
    try:
        return body()
    except (UsageError, TraceError, ConfigError) as exc:
        print(f"kv-picker bench {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_FAILURE


def replay_main(argv: Sequence[str]) -> int:
    return run_command("replay", argv, lambda: _offline(argv, "replay", sweep=False))


def sweep_main(argv: Sequence[str]) -> int:
    return run_command("sweep", argv, lambda: _offline(argv, "sweep", sweep=True))
