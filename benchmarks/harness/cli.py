"""The offline commands of the harness: ``kv-picker bench replay`` and ``kv-picker bench sweep``.

Their flags, and those the live commands share, are in :mod:`~kv_picker_bench.harness.args`.
Every run writes a results folder (``results/<time>-<command>-<trace>/`` unless ``--out``):
``command.txt`` (the command, its paths relative to the repository root), ``results.md``,
``results.json`` and PNG plots. Exit codes: 0 success, 1 runtime failure, 2 bad usage, trace
or config.

Offline runs fan the (load, policy) jobs out over ``--jobs`` processes; each job is
deterministic under ``--seed``, so the result does not depend on the number of processes.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_picker_bench.harness.args import (
    EXIT_OK,
    build_parser,
    cluster_from_args,
    parse_loads,
    policies_from_args,
    record_command,
    results_dir,
    run_command,
    trace_from_args,
)
from kv_picker_bench.harness.floors import Floors, ideal_caches, ttft_floors
from kv_picker_bench.harness.policies import Policy
from kv_picker_bench.harness.report import (
    PolicyMetrics,
    cluster_json,
    describe_cluster,
    format_tokens,
    markdown_table,
    plot_bars,
    plot_cdfs,
    plot_load_curve,
    summarize,
    write_json,
)
from kv_picker_bench.harness.simulator import ClusterConfig
from kv_picker_bench.harness.traces import Trace, slice_trace

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

    result = job.policy.replay(traces[job.load], config, _WORKER["seed"], progress)
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
    floors: Floors,
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
        "Zero-queue TTFT floors: each request's uncached prompt (under the unbounded cache, or "
        "the pooled LRU: the practical floor) computed alone on an idle endpoint of the fastest "
        "class that may prefill it; TTFT ÷ floor compares a policy with the practical one.",
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
            markdown_table(rows, bounds, floors.stats()),
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
        "floors": floors.stats(),
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
                floor=floors.practical_s,
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
    loads = parse_loads(args.loads) if sweep else [args.load]
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
    caches = ideal_caches(base, config)
    bounds = caches.hit_ratios()
    floors = ttft_floors(base, config, caches)  # arrival times do not move them
    results = run_offline(
        traces, config, policies, args.seed, args.jobs, args.quiet, args.save_requests
    )
    wall_s = time.perf_counter() - started
    report = _write_offline_report(
        folder,
        text,
        args.title,
        traces,
        config,
        bounds,
        floors,
        results,
        wall_s,
        not args.no_plots,
    )
    print(report)
    print(f"results: {folder}")
    return EXIT_OK


def replay_main(argv: Sequence[str]) -> int:
    """``kv-picker bench replay``: returns the exit code."""
    return run_command("replay", argv, lambda: _offline(argv, "replay", sweep=False))


def sweep_main(argv: Sequence[str]) -> int:
    """``kv-picker bench sweep``: returns the exit code."""
    return run_command("sweep", argv, lambda: _offline(argv, "sweep", sweep=True))
