"""``kv-picker bench matrix``: every policy on every cell of workload family × offered load ×
cluster shape (× timing profile), and how far each policy is from the best in each cell.

A default routing profile has to be good on traffic it was never tuned on, so it is judged on a
matrix rather than on one trace:

```
family (tuning | held-out)     load (binding resource)   cluster              timing
conversation, shared-prefix,   0.3  0.6  0.9  1.2        h100x16, mixed,      8B on H100,
chat, zipf-prefix, agentic |                             small4, pd (long     70B at TP4
long-doc-qa, rag, mixed,                                 prompts only)
lora, tenants
```

- **Families** are trace generators with randomized parameters under a seed
  (:mod:`~kv_picker_bench.harness.traces`), plus a window of the Mooncake conversation trace.
  Each is in the *tuning* set (defaults and weights may be chosen on it) or the *held-out* set
  (reported, never tuned on): :data:`FAMILIES` names the split.
- **Load** is the share of the cluster's binding resource a perfect router would keep busy
  (:func:`~kv_picker_bench.harness.floors.scale_to_load`): prefill (each request's practical
  zero-queue floor, summed over the arrival span, over the prefill capacity) or decode (output
  tokens at full batches over the decode capacity), whichever is larger. 1.0 means even
  perfect routing with a pooled cache keeps that resource busy all the time. Prefill alone is
  not enough: with 95% prefix reuse, 30% of prefill capacity already fills every decode batch.
- **Clusters**: 16 identical H100s; a mixed H100/A100/L4 pool; 4 H100s; P/D (4 prefill + 12
  decode H100s, policies under the service's pd-profile-handler) for long-prompt families.
- Every cell runs every policy: the six baselines, the built-in default (``kv-picker``) and
  any ``--policy`` candidates. Per cell the best value of each metric is found; each policy's
  ratio to it (TTFT mean, p90, p99: higher is worse; output throughput: lower is worse) is
  reported with its worst cell. Throughput is output tokens over the makespan (the harness's
  figure everywhere); the cell tables also give the *sustained* rate, tokens produced while
  requests arrive (:func:`~kv_picker_bench.harness.report.sustained_tokens_per_s`), which the
  drain of the last stragglers does not move, and each policy's end-to-end latency (mean and
  p99: what a request sent to a slow class waits in all, which no verdict scores). The default
  passes a cell when its TTFT mean and p90 are
  within 5% of the best (or better) and its throughput within 5%, and it is never worse than
  the GIE default.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kv_picker.errors import ConfigError
from kv_picker_bench.harness.args import (
    EXIT_OK,
    UsageError,
    parse_loads,
    record_command,
    results_dir,
    run_command,
)
from kv_picker_bench.harness.floors import (
    Floors,
    IdealCaches,
    Load,
    floor_ratios,
    ideal_caches,
    load_of,
    scale_to_load,
    ttft_floors,
)
from kv_picker_bench.harness.paths import TRACES_ENV, find_trace, portable_path, traces_dir
from kv_picker_bench.harness.policies import (
    Policy,
    harness_registry,
    pd_variant,
    resolve_policies,
    resolve_policy,
)
from kv_picker_bench.harness.report import (
    PolicyMetrics,
    at_stored_precision,
    read_json,
    stored_precision,
    summarize,
    write_json,
)
from kv_picker_bench.harness.simulator import ClusterConfig, EndpointSetup, run_policy
from kv_picker_bench.harness.space import (
    DEFAULT_SPACE,
    DEFAULT_SPACE_SOURCE,
    RandomChooser,
    load_space,
)
from kv_picker_bench.harness.traces import Trace, parse_trace_spec, slice_trace
from kv_picker_bench.sim.engine import CACHED_WHEN
from kv_picker_bench.sim.timing import TIMING_PROFILES, describe_profiles, timing_profile

TUNING = "tuning"
HELD_OUT = "held-out"

DEFAULT_POLICY = "kv-picker"
GIE_DEFAULT = "gie-default"
PASS_RATIO = 1.05
"""A cell passes when the default is within 5% of the best policy on each criterion."""


@dataclass(frozen=True, slots=True)
class Family:
    """One workload family of the matrix.

    Attributes:
        name: short name in reports.
        spec: the trace spec (``--trace``) of its full-size workload.
        quick_spec: a small version for ``--quick``.
        split: ``tuning`` or ``held-out``.
        long_prompts: whether P/D is worth a cell (prompts long enough to disaggregate).
    """

    name: str
    spec: str
    quick_spec: str
    split: str
    long_prompts: bool = False


# The Mooncake conversation trace: a window from its middle, where caches are warm enough to
# matter (requests from 1,800 s to 2,000 s of the hour).
CONVERSATION_WINDOW_S = (1800.0, 2000.0)
# Other draws of the conversation family (``--family-seed``) take the following 200-second
# windows of the trace's second half: draw k starts (k - 1) mod 8 windows later.
_CONVERSATION_WINDOWS = 8

DEFAULT_FAMILY_SEED = 1
"""The draw of every family the reports in ``benchmarks/RESULTS.md`` use."""

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # Tuning set: defaults and weights may be chosen on these.
        Family("conversation", "conversation", "conversation", TUNING, long_prompts=True),
        Family(
            "shared-prefix",
            "shared-prefix:seed=1,requests=600",
            "shared-prefix:seed=1,requests=120,groups=12",
            TUNING,
        ),
        Family("chat", "chat:seed=1,sessions=120", "chat:seed=1,sessions=25", TUNING),
        Family(
            "zipf-prefix",
            "zipf-prefix:seed=1,requests=600",
            "zipf-prefix:seed=1,requests=120",
            TUNING,
        ),
        Family(
            "agentic",
            "agentic:seed=1,sessions=24",
            "agentic:seed=1,sessions=6",
            TUNING,
            long_prompts=True,
        ),
        # Held out: reported, never tuned on.
        Family(
            "long-doc-qa",
            "long-doc-qa:seed=1,sessions=60",
            "long-doc-qa:seed=1,sessions=12",
            HELD_OUT,
            long_prompts=True,
        ),
        Family("rag", "rag:seed=1,requests=600", "rag:seed=1,requests=120", HELD_OUT),
        Family(
            "mixed",
            "mixed:seed=1,requests=600",
            "mixed:seed=1,requests=120",
            HELD_OUT,
            long_prompts=True,
        ),
        Family("lora", "lora:seed=1,requests=600", "lora:seed=1,requests=120", HELD_OUT),
        Family("tenants", "tenants:seed=1,requests=600", "tenants:seed=1,requests=120", HELD_OUT),
    )
}
"""The matrix's families and their split (module docstring)."""


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """A cluster the matrix runs on.

    Attributes:
        name: short name in reports.
        endpoints: ``(role, hardware, count)`` triples.
        pd: run policies under the P/D profile handler.
    """

    name: str
    endpoints: tuple[tuple[str, str, int], ...]
    pd: bool = False

    def config(self, **overrides: Any) -> ClusterConfig:
        setups = tuple(
            EndpointSetup(role, hardware)
            for role, hardware, count in self.endpoints
            for _ in range(count)
        )
        return ClusterConfig(endpoints=setups, **overrides)


CLUSTERS: dict[str, ClusterShape] = {
    "h100x16": ClusterShape("h100x16", (("both", "H100", 16),)),
    "mixed": ClusterShape("mixed", (("both", "H100", 4), ("both", "A100", 6), ("both", "L4", 6))),
    "small4": ClusterShape("small4", (("both", "H100", 4),)),
    "pd": ClusterShape("pd", (("prefill", "H100", 4), ("decode", "H100", 12)), pd=True),
}

DEFAULT_LOADS = (0.3, 0.6, 0.9, 1.2)


@dataclass(frozen=True, slots=True)
class Cell:
    family: str
    load: float
    cluster: str
    timing: str

    @property
    def label(self) -> str:
        return f"{self.family} / {self.load:g} / {self.cluster} / {self.timing}"


@dataclass(slots=True)
class CellResult:
    """Every policy's metrics on one cell, with the cell's floors."""

    cell: Cell
    requests: int
    offered_rate_per_s: float
    metrics: dict[str, PolicyMetrics]
    floors: dict[str, dict[str, float]]
    hit_bounds: dict[str, float]
    prefill_load: float = math.nan
    decode_load: float = math.nan


def conversation_window(draw: int) -> tuple[float, float]:
    """The conversation family's window of the Mooncake trace for draw ``draw`` (seconds)."""
    start, end = CONVERSATION_WINDOW_S
    shift = (end - start) * ((draw - 1) % _CONVERSATION_WINDOWS)
    return start + shift, end + shift


def family_spec(family: Family, quick: bool, draw: int = DEFAULT_FAMILY_SEED) -> str:
    """The family's trace spec for one draw: its generator's seed is ``draw``."""
    spec = family.quick_spec if quick else family.spec
    if draw == DEFAULT_FAMILY_SEED or ":" not in spec:
        return spec
    name, _, params = spec.partition(":")
    fields = [f"seed={draw}" if item.startswith("seed=") else item for item in params.split(",")]
    return f"{name}:{','.join(fields)}"


def family_trace(family: Family, quick: bool, draw: int = DEFAULT_FAMILY_SEED) -> Trace:
    """The family's workload (the conversation family: a window of the Mooncake trace).

    ``draw`` picks another sample of the same family: the generators' seed, or the
    conversation trace's window (:func:`conversation_window`).
    """
    spec = family_spec(family, quick, draw)
    if spec == "conversation":
        found = find_trace("conversation", traces_dir())
        if found is None:
            raise UsageError(
                f"the conversation family needs conversation_trace.jsonl in {traces_dir()} "
                f"(set {TRACES_ENV}), or leave it out with --families"
            )
        trace = parse_trace_spec(str(found))
        trace = slice_trace(trace, window_s=conversation_window(draw), first=150 if quick else None)
    else:
        trace = parse_trace_spec(spec)
    trace.name = family.name
    return trace


# ----------------------------------------------------------------------------- running


@dataclass(slots=True)
class _Job:
    cell: Cell
    policy: Policy


_WORKER: dict[str, Any] = {}


def _init_worker(traces: dict[Cell, Trace], configs: dict[Cell, ClusterConfig], seed: int) -> None:
    _WORKER.update(traces=traces, configs=configs, seed=seed)


def _run_job(job: _Job) -> tuple[Cell, PolicyMetrics]:
    registry = harness_registry()
    config: ClusterConfig = _WORKER["configs"][job.cell]
    trace: Trace = _WORKER["traces"][job.cell]
    result = run_policy(
        trace,
        config,
        job.policy.config(registry),
        registry,
        job.policy.name,
        seed=_WORKER["seed"],
        needs_prompt=job.policy.needs_prompt,
    )
    return job.cell, summarize(result, config)


@dataclass(slots=True)
class MatrixPlan:
    """What to run: cells, their traces and clusters, and the policies."""

    cells: list[Cell]
    traces: dict[Cell, Trace]
    configs: dict[Cell, ClusterConfig]
    floors: dict[Cell, Floors]
    caches: dict[Cell, IdealCaches]
    loads: dict[Cell, Load]
    policies: list[Policy]
    pd_policies: list[Policy] = field(default_factory=list)

    def jobs(self) -> list[_Job]:
        work = []
        for cell in self.cells:
            shape = CLUSTERS[cell.cluster]
            for policy in self.pd_policies if shape.pd else self.policies:
                work.append(_Job(cell, policy))
        return work


def plan_matrix(
    families: Sequence[str],
    loads: Sequence[float],
    clusters: Sequence[str],
    timings: Sequence[str],
    policies: Sequence[Policy],
    quick: bool,
    cluster_overrides: Callable[[str], dict[str, Any]],
    draw: int = DEFAULT_FAMILY_SEED,
) -> MatrixPlan:
    """Build every cell's trace (scaled to its load) and cluster.

    Args:
        cluster_overrides: per timing profile name, the ``ClusterConfig`` fields it sets
            (the timing model, KV capacity, KV bytes per token).
        draw: which sample of each family (:func:`family_trace`).
    """
    cells: list[Cell] = []
    traces: dict[Cell, Trace] = {}
    configs: dict[Cell, ClusterConfig] = {}
    floors: dict[Cell, Floors] = {}
    caches: dict[Cell, IdealCaches] = {}
    cell_loads: dict[Cell, Load] = {}
    base_traces: dict[str, Trace] = {}
    for name in families:
        family = FAMILIES[name]
        base_traces[name] = family_trace(family, quick, draw)
    for timing in timings:
        for name in families:
            family = FAMILIES[name]
            for cluster_name in clusters:
                shape = CLUSTERS[cluster_name]
                if shape.pd and not family.long_prompts:
                    continue
                config = shape.config(**cluster_overrides(timing))
                base = slice_trace(base_traces[name])
                cell_caches = ideal_caches(base, config)
                base_floors = ttft_floors(base, config, cell_caches)
                for load in loads:
                    cell = Cell(name, load, cluster_name, timing)
                    trace = scale_to_load(base, config, load, base_floors)
                    cells.append(cell)
                    traces[cell] = trace
                    configs[cell] = config
                    floors[cell] = base_floors  # the floors do not depend on arrival times
                    caches[cell] = cell_caches
                    cell_loads[cell] = load_of(trace, config, base_floors)
    pd_policies = [pd_variant(p) for p in policies]
    return MatrixPlan(
        cells, traces, configs, floors, caches, cell_loads, list(policies), pd_policies
    )


def run_matrix(plan: MatrixPlan, seed: int, jobs: int, quiet: bool) -> list[CellResult]:
    """Run every job of the plan; results in cell order.

    Each cell's figures are kept at the precision ``matrix.json`` stores (six decimals), so the
    verdicts and tables in the Markdown report are the ones the stored figures give: a TTFT equal to
    another policy's to the microsecond is a tie, not a loss by float summation order.
    """
    work = plan.jobs()
    bar = None
    if not quiet:
        from tqdm import tqdm  # type: ignore[import-untyped]

        tqdm.monitor_interval = 0
        bar = tqdm(total=len(work), unit="run", desc="matrix", file=sys.stderr)
    done: list[tuple[Cell, PolicyMetrics]] = []
    if jobs <= 1:
        _init_worker(plan.traces, plan.configs, seed)
        for job in work:
            done.append(_run_job(job))
            if bar is not None:
                bar.update(1)
    else:
        context = multiprocessing.get_context("spawn")
        with context.Pool(
            min(jobs, len(work)),
            initializer=_init_worker,
            initargs=(plan.traces, plan.configs, seed),
        ) as pool:
            for item in pool.imap_unordered(_run_job, work, chunksize=1):
                done.append(item)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    # In the plan's policy order, whichever job finished first: reports do not reorder rows.
    order = {(job.cell, job.policy.name): i for i, job in enumerate(work)}
    done.sort(key=lambda item: order[(item[0], item[1].policy)])
    by_cell: dict[Cell, dict[str, PolicyMetrics]] = {cell: {} for cell in plan.cells}
    for cell, metrics in done:
        by_cell[cell][metrics.policy] = at_stored_precision(metrics)
    results = []
    for cell in plan.cells:
        trace = plan.traces[cell]
        summary = trace.summary()
        results.append(
            CellResult(
                cell,
                summary["requests"],
                stored_precision(summary["rate_per_s"] or 0.0),
                by_cell[cell],
                stored_precision(plan.floors[cell].stats()),
                stored_precision(plan.caches[cell].hit_ratios()),
                _stored_float(plan.loads[cell].prefill),
                _stored_float(plan.loads[cell].decode),
            )
        )
    return results


def run_seeds(
    plan: MatrixPlan, seeds: Sequence[int], jobs: int, quiet: bool
) -> tuple[list[CellResult], dict[int, list[CellResult]]]:
    """:func:`run_matrix` once per policy seed: each cell's figures pooled over the seeds
    (:func:`pool_seeds`; one seed's own with one), and each seed's run."""
    per_seed = {seed: run_matrix(plan, seed, jobs, quiet) for seed in seeds}
    if len(seeds) == 1:
        return per_seed[seeds[0]], per_seed
    return pool_seeds(per_seed), per_seed


def pool_seeds(per_seed: Mapping[int, Sequence[CellResult]]) -> list[CellResult]:
    """The same cells run under several policy seeds, pooled as draws are
    (:func:`pooled_results`): the seeds differ only in the policies' tie-breaks and random
    picks, so a cell's figures are the policy's over every seed's run. The cell keeps one
    trace's request count; each policy's served and request counts are summed over the seeds
    (the weights of a later pooling over draws). Figures at the stored precision, as
    :func:`run_matrix` keeps them."""
    first = {result.cell: result for result in next(iter(per_seed.values()))}
    pooled = []
    for result in pooled_results(per_seed):
        metrics = {name: at_stored_precision(m) for name, m in result.metrics.items()}
        pooled.append(replace(result, requests=first[result.cell].requests, metrics=metrics))
    return pooled


def seeds_sentence(seeds: Sequence[int]) -> str:
    """The report's line on the policy seeds its figures come from."""
    if len(seeds) == 1:
        return f"Policy seed {seeds[0]}."
    return (
        f"Policy seeds {', '.join(map(str, seeds))}: every policy ran once per seed on every cell "
        "(the seeds differ only in tie-breaks and random picks), and each figure is over the "
        f"{len(seeds)} runs taken together: TTFT mean over every request, TTFT percentiles the "
        "mean of the runs', output tokens over the summed makespans."
    )


def parse_policy_seeds(text: str) -> list[int]:
    """``--seed``: one policy seed or a comma list of them, each at least 0, no repeats."""
    return _whole_numbers(text, "--seed", "seed", 0)


def _whole_numbers(text: str, option: str, item_name: str, least: int) -> list[int]:
    """A comma list of whole numbers, each at least ``least``, none listed twice."""
    numbers: list[int] = []
    for item in text.split(","):
        item = item.strip()
        try:
            number = int(item)
        except ValueError:
            raise UsageError(f"{option}: {item!r} is not a whole number") from None
        if number < least:
            raise UsageError(f"{option} must be at least {least}, not {number}")
        if number in numbers:
            raise UsageError(f"{option}: {item_name} {number} is listed twice")
        numbers.append(number)
    return numbers


def _stored_float(value: float) -> float:
    stored = stored_precision(value)
    return math.nan if stored is None else float(stored)


# ----------------------------------------------------------------------------- scoring


@dataclass(frozen=True, slots=True)
class Ratios:
    """One policy's figures on one cell over the cell's best (TTFT: >= 1; throughput: <= 1)."""

    ttft_mean: float
    ttft_p90: float
    ttft_p99: float
    throughput: float
    e2e_mean: float = math.nan  # end to end (arrival to last token): reported, not judged


def cell_ratios(result: CellResult) -> dict[str, Ratios]:
    """Every policy's ratios to the best policy of the cell."""
    rows = result.metrics
    best_mean = min(m.ttft_s["mean"] for m in rows.values())
    best_p90 = min(m.ttft_s["p90"] for m in rows.values())
    best_p99 = min(m.ttft_s["p99"] for m in rows.values())
    best_throughput = max(m.output_tokens_per_s for m in rows.values())
    best_e2e = min(m.e2e_s["mean"] for m in rows.values())
    return {
        name: Ratios(
            _ratio(m.ttft_s["mean"], best_mean),
            _ratio(m.ttft_s["p90"], best_p90),
            _ratio(m.ttft_s["p99"], best_p99),
            _ratio(m.output_tokens_per_s, best_throughput),
            _ratio(m.e2e_s["mean"], best_e2e),
        )
        for name, m in rows.items()
    }


def _ratio(value: float, best: float) -> float:
    if best > 0:
        return value / best
    return 1.0 if value == best else math.inf


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the default met the bar on a cell, and why not."""

    passed: bool
    reasons: tuple[str, ...]


def default_verdict(result: CellResult, default: str = DEFAULT_POLICY) -> Verdict | None:
    """The default's verdict on a cell (None when the default did not run there)."""
    ratios = cell_ratios(result)
    mine = ratios.get(default)
    if mine is None:
        return None
    reasons = []
    if mine.ttft_mean > PASS_RATIO:
        reasons.append(f"TTFT mean {mine.ttft_mean:.2f}x the best")
    if mine.ttft_p90 > PASS_RATIO:
        reasons.append(f"TTFT p90 {mine.ttft_p90:.2f}x the best")
    if mine.throughput < 1 / PASS_RATIO:
        reasons.append(f"throughput {mine.throughput:.2f}x the best")
    for figure in trails_gie_default(result, default):
        below = "below" if figure == "throughput" else "worse than"
        reasons.append(f"{figure} {below} gie-default")
    return Verdict(not reasons, tuple(reasons))


def trails_gie_default(result: CellResult, name: str) -> list[str]:
    """The figures ("TTFT mean", "TTFT p90", "throughput") on which policy ``name`` is worse
    than the GIE default in the cell (none when the GIE default did not run there)."""
    gie = result.metrics.get(GIE_DEFAULT)
    ours = result.metrics[name]
    if gie is None:
        return []
    figures = []
    if ours.ttft_s["mean"] > gie.ttft_s["mean"]:
        figures.append("TTFT mean")
    if ours.ttft_s["p90"] > gie.ttft_s["p90"]:
        figures.append("TTFT p90")
    if ours.output_tokens_per_s < gie.output_tokens_per_s:
        figures.append("throughput")
    return figures


#: A figure on which a policy trails the GIE default by less than this share is reported as a
#: near tie: at the matrix's light loads the makespan throughput of two policies differs by the
#: last request's finish, by less than the GIE default's own spread over policy seeds.
NEAR_TIE = 0.005


@dataclass(frozen=True, slots=True)
class VersusGie:
    """One policy's figures over the GIE default's in a cell: TTFT mean and p90 (below 1:
    lower), output throughput over the makespan and the sustained rate (above 1: higher)."""

    ttft_mean: float
    ttft_p90: float
    throughput: float
    sustained: float

    def near_tie(self, trailed: Sequence[str]) -> bool:
        """Whether every figure in ``trailed`` (names as :func:`trails_gie_default` gives them)
        is within :data:`NEAR_TIE` of the GIE default's."""
        shortfall = {
            "TTFT mean": self.ttft_mean - 1.0,
            "TTFT p90": self.ttft_p90 - 1.0,
            "throughput": 1.0 - self.throughput,
        }
        return bool(trailed) and all(shortfall[figure] < NEAR_TIE for figure in trailed)


def versus_gie(result: CellResult, name: str) -> VersusGie | None:
    """Policy ``name``'s figures over the GIE default's in the cell (None when either did not
    run there, or a judged figure of the GIE default is not positive; the sustained ratio is
    NaN where the GIE default's sustained rate is not positive)."""
    gie = result.metrics.get(GIE_DEFAULT)
    ours = result.metrics.get(name)
    if gie is None or ours is None:
        return None
    judged = (
        (ours.ttft_s["mean"], gie.ttft_s["mean"]),
        (ours.ttft_s["p90"], gie.ttft_s["p90"]),
        (ours.output_tokens_per_s, gie.output_tokens_per_s),
    )
    if any(not reference > 0.0 for _, reference in judged):
        return None
    sustained = gie.sustained_tokens_per_s
    return VersusGie(
        *(value / reference for value, reference in judged),
        ours.sustained_tokens_per_s / sustained if sustained > 0.0 else math.nan,
    )


def passing_policies(result: CellResult) -> list[str]:
    """The policies of the cell that meet the default's bar there, each judged as the default
    is (against all the others, the GIE default included)."""
    return [
        name
        for name in result.metrics
        if (verdict := default_verdict(result, name)) is not None and verdict.passed
    ]


def worst_judged_ratio(ratios: Ratios) -> float:
    """The worst of the three figures the bar judges, as ratios to the cell's best that are
    >= 1: TTFT mean, TTFT p90, and best throughput over this one's."""
    inverse = 1 / ratios.throughput if ratios.throughput > 0 else math.inf
    return max(ratios.ttft_mean, ratios.ttft_p90, inverse)


def closest_policy(result: CellResult) -> tuple[str, float]:
    """The policy whose worst judged ratio (:func:`worst_judged_ratio`) is the smallest, and
    that ratio: how close any one policy of the run comes to the best of every figure at once.

    The bar compares each figure with the best policy *for that figure*; when the best TTFT
    and the best throughput belong to different policies, no policy may reach it. Above 1.05,
    no policy of the run passes the cell on the ratios.
    """
    ratios = cell_ratios(result)
    return min(
        ((name, worst_judged_ratio(x)) for name, x in ratios.items()), key=lambda item: item[1]
    )


def _named(items: Sequence[tuple[str, str]], limit: int = 2) -> str:
    """``a (x), b (y)`` for the first ``limit`` items, ``and N more`` past them."""
    text = ", ".join(f"{name} ({detail})" for name, detail in items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def why_nobody_passes(result: CellResult) -> str:
    """Markdown, for a cell no policy passes (empty when one does): the trade-off that stops
    every policy, with the figures that show it.

    Either no policy is within 5% of the best TTFT and of the best throughput at once (the
    policies near the best TTFT mean and p90, with their throughput, against those near the
    best throughput, with their TTFT), or the ones that are trail the GIE default on a figure
    (the GIE default need not be near the best itself: the bar asks for both).
    """
    if passing_policies(result):
        return ""
    ratios = cell_ratios(result)
    order = sorted(ratios, key=lambda name: worst_judged_ratio(ratios[name]))
    near_all = [name for name in order if worst_judged_ratio(ratios[name]) <= PASS_RATIO]
    if near_all:
        gie = ratios.get(GIE_DEFAULT)
        behind = [(name, "; ".join(trails_gie_default(result, name))) for name in near_all]
        text = "within 5% of every best but behind gie-default: " + _named(behind)
        if gie is not None:
            text += (
                f"; gie-default itself {gie.ttft_mean:.2f}x / {gie.ttft_p90:.2f}x the best TTFT "
                f"mean / p90, {gie.throughput:.2f}x the throughput"
            )
        return text
    fast = [
        (name, f"throughput {ratios[name].throughput:.2f}x")
        for name in order
        if max(ratios[name].ttft_mean, ratios[name].ttft_p90) <= PASS_RATIO
    ]
    busy = [
        (name, f"TTFT {ratios[name].ttft_mean:.2f}x / {ratios[name].ttft_p90:.2f}x")
        for name in order
        if ratios[name].throughput >= 1 / PASS_RATIO
    ]
    if fast:
        left = "near the best TTFT mean and p90: " + _named(fast)
    else:
        mean_best = min(ratios, key=lambda name: ratios[name].ttft_mean)
        p90_best = min(ratios, key=lambda name: ratios[name].ttft_p90)
        left = (
            f"none near the best TTFT mean and p90 at once (best mean: {mean_best}, "
            f"p90 {ratios[mean_best].ttft_p90:.2f}x; best p90: {p90_best}, "
            f"mean {ratios[p90_best].ttft_mean:.2f}x)"
        )
    return f"{left}; near the best throughput: {_named(busy)}"


def describe_passing(result: CellResult) -> str:
    """Markdown: the policies that pass the cell, or the closest one when none does."""
    passing = passing_policies(result)
    if passing:
        return ", ".join(passing)
    name, worst = closest_policy(result)
    return f"none (closest: {name}, {worst:.2f}x)"


@dataclass(slots=True)
class PolicySummary:
    """One policy over all cells: geometric-mean and worst ratios to the best."""

    policy: str
    cells: int
    geo_ttft_mean: float
    geo_ttft_p90: float
    geo_ttft_p99: float
    geo_throughput: float
    worst_ttft_mean: tuple[float, str]
    worst_ttft_p90: tuple[float, str]
    worst_ttft_p99: tuple[float, str]
    worst_throughput: tuple[float, str]
    geo_e2e_mean: float = math.nan


def geometric_mean(values: Sequence[float]) -> float:
    """Geometric mean of the positive finite values (NaN when there are none)."""
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, finite)) / len(finite)) if finite else math.nan


def summarize_policies(results: Sequence[CellResult]) -> list[PolicySummary]:
    per_policy: dict[str, list[tuple[Cell, Ratios]]] = {}
    for result in results:
        for name, ratios in cell_ratios(result).items():
            per_policy.setdefault(name, []).append((result.cell, ratios))
    summaries = []
    for name, items in per_policy.items():

        def worst(
            pick: Callable[[Ratios], float],
            highest: bool,
            items: list[tuple[Cell, Ratios]] = items,
        ) -> tuple[float, str]:
            cell, ratios = (max if highest else min)(items, key=lambda item: pick(item[1]))
            return pick(ratios), cell.label

        summaries.append(
            PolicySummary(
                name,
                len(items),
                geometric_mean([r.ttft_mean for _, r in items]),
                geometric_mean([r.ttft_p90 for _, r in items]),
                geometric_mean([r.ttft_p99 for _, r in items]),
                geometric_mean([r.throughput for _, r in items]),
                worst(lambda r: r.ttft_mean, True),
                worst(lambda r: r.ttft_p90, True),
                worst(lambda r: r.ttft_p99, True),
                worst(lambda r: r.throughput, False),
                geometric_mean([r.e2e_mean for _, r in items]),
            )
        )
    summaries.sort(key=lambda s: s.geo_ttft_mean)
    return summaries


# ----------------------------------------------------------------------------- report


def _cell_table(result: CellResult) -> list[str]:
    practical = result.floors["practical"]
    lines = [
        f"#### {result.cell.label} ({result.requests} requests, "
        f"{result.offered_rate_per_s:.2f} req/s; prefill load {result.prefill_load:.2f}, "
        f"decode load {result.decode_load:.2f})",
        "",
        "| policy | TTFT s mean / p90 / p99 | x floor (mean / p90) | output tok/s "
        "| sustained tok/s | hit ratio | end-to-end s mean / p99 "
        "| ratio to best: mean / p90 / p99 / throughput |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    ratios = cell_ratios(result)
    for name, m in result.metrics.items():
        r = ratios[name]
        to_floor = floor_ratios(m.ttft_s, practical)
        lines.append(
            f"| {name} | {m.ttft_s['mean']:.2f} / {m.ttft_s['p90']:.2f} / {m.ttft_s['p99']:.2f} "
            f"| {to_floor['mean']:.2f} / {to_floor['p90']:.2f} | {m.output_tokens_per_s:,.0f} "
            f"| {m.sustained_tokens_per_s:,.0f} "
            f"| {m.hit_ratio:.3f} | {m.e2e_s['mean']:.2f} / {m.e2e_s['p99']:.2f} "
            f"| {r.ttft_mean:.2f} / {r.ttft_p90:.2f} / {r.ttft_p99:.2f} / {r.throughput:.2f} |"
        )
    lines.append(
        f"| *floor, pooled LRU (hit {result.hit_bounds['pooled_lru']:.3f})* "
        f"| {practical['mean']:.2f} / {practical['p90']:.2f} / {practical['p99']:.2f} | 1 / 1 "
        f"| | | {result.hit_bounds['pooled_lru']:.3f} | | |"
    )
    strict = result.floors["strict"]
    lines.append(
        f"| *floor, unbounded (hit {result.hit_bounds['unbounded']:.3f})* "
        f"| {strict['mean']:.2f} / {strict['p90']:.2f} / {strict['p99']:.2f} | | | "
        f"| {result.hit_bounds['unbounded']:.3f} | | |"
    )
    return lines


def markdown_report(
    title: str,
    command: str,
    results: Sequence[CellResult],
    wall_s: float,
    seeds: Sequence[int] = (0,),
) -> str:
    summaries = summarize_policies(results)
    lines = [f"# {title}", "", f"Command: `{command}`", ""]
    if list(seeds) != [0]:
        lines += [seeds_sentence(seeds), ""]
    for split in (TUNING, HELD_OUT):
        chosen = [r for r in results if FAMILIES[r.cell.family].split == split]
        if not chosen:
            continue
        families = sorted({r.cell.family for r in chosen})
        lines += [f"Families ({split}): {', '.join(families)}.", ""]
    lines += [
        "## Summary: ratio to the best policy of each cell",
        "",
        "Geometric mean over cells, and the worst cell (TTFT: higher is worse; throughput: "
        "lower is worse). End to end: the mean time from arrival to the last token, which "
        "the verdicts do not judge.",
        "",
        "| policy | cells | TTFT mean | TTFT p90 | TTFT p99 | throughput | end-to-end mean "
        "| worst TTFT mean | worst TTFT p90 | worst throughput |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s.policy} | {s.cells} | {s.geo_ttft_mean:.3f} | {s.geo_ttft_p90:.3f} "
            f"| {s.geo_ttft_p99:.3f} | {s.geo_throughput:.3f} | {s.geo_e2e_mean:.3f} "
            f"| {s.worst_ttft_mean[0]:.2f} ({s.worst_ttft_mean[1]}) "
            f"| {s.worst_ttft_p90[0]:.2f} ({s.worst_ttft_p90[1]}) "
            f"| {s.worst_throughput[0]:.2f} ({s.worst_throughput[1]}) |"
        )
    verdicts = [(r, default_verdict(r)) for r in results]
    judged = [(r, v) for r, v in verdicts if v is not None]
    if judged:
        failed = [(r, v) for r, v in judged if not v.passed]
        lines += [
            "",
            f"## The default (`{DEFAULT_POLICY}`): {len(judged) - len(failed)} of {len(judged)} "
            "cells pass",
            "",
            "A cell passes when the default's TTFT mean and p90 are within 5% of the best "
            "policy's (or better), its output throughput within 5%, and none of the three is "
            "worse than gie-default's.",
            "",
        ]
        if failed:
            nobody = sum(1 for r, _ in failed if not passing_policies(r))
            lines += [
                f"In {nobody} of the {len(failed)} cells it fails, no policy of the run passes "
                "the same bar: none is within 5% of the best TTFT mean, p90 and throughput at "
                'once, or the ones that are trail the GIE default on a figure ("closest": the '
                "policy whose worst ratio among TTFT mean, p90 and best ÷ throughput is "
                "smallest, and that ratio; the last column says which).",
                "",
                "| cell | split | why | policies that pass | why no policy passes |",
                "|---|---|---|---|---|",
            ]
            for r, v in failed:
                lines.append(
                    f"| {r.cell.label} | {FAMILIES[r.cell.family].split} "
                    f"| {'; '.join(v.reasons)} | {describe_passing(r)} "
                    f"| {why_nobody_passes(r) or '–'} |"
                )
    lines += ["", "## Cells", ""]
    for result in results:
        lines += [*_cell_table(result), ""]
    lines.append(f"Wall time of the whole run: {wall_s:.1f} s.")
    return "\n".join(lines) + "\n"


def results_json(
    command: str,
    results: Sequence[CellResult],
    wall_s: float,
    draw: int = DEFAULT_FAMILY_SEED,
    quick: bool = False,
    seeds: Sequence[int] = (0,),
    cached_when: str = CACHED_WHEN[0],
) -> dict[str, Any]:
    return {
        "command": command,
        "wall_s": wall_s,
        "family_seed": draw,
        **({} if list(seeds) == [0] else {"seeds": list(seeds)}),
        # A matrix stored without it ran the older engine model (see --cached-when).
        "cached_when": cached_when,
        "conversation_window_s": list(conversation_window(draw)),
        "families": {
            name: {
                "spec": family_spec(f, quick, draw),
                "split": f.split,
                "long_prompts": f.long_prompts,
            }
            for name, f in FAMILIES.items()
        },
        "summary": [
            s.__dict__ if hasattr(s, "__dict__") else _slots(s) for s in summarize_policies(results)
        ],
        "cells": [
            {
                "family": r.cell.family,
                "load": r.cell.load,
                "cluster": r.cell.cluster,
                "timing": r.cell.timing,
                "requests": r.requests,
                "rate_per_s": r.offered_rate_per_s,
                "prefill_load": r.prefill_load,
                "decode_load": r.decode_load,
                "floors": r.floors,
                "hit_bounds": r.hit_bounds,
                "default_verdict": _verdict_json(default_verdict(r)),
                "passing_policies": passing_policies(r),
                "closest_policy": list(closest_policy(r)),
                "policies": {name: m.to_json() for name, m in r.metrics.items()},
                "ratios": {name: _slots(x) for name, x in cell_ratios(r).items()},
            }
            for r in results
        ],
    }


def _slots(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


def _slots_or_none(obj: Any) -> dict[str, Any] | None:
    return None if obj is None else _slots(obj)


def _verdict_json(verdict: Verdict | None) -> dict[str, Any] | None:
    if verdict is None:
        return None
    return {"passed": verdict.passed, "reasons": list(verdict.reasons)}


# ----------------------------------------------------------------------------- plots


def plot_default_heatmap(results: Sequence[CellResult], path: Path) -> None:
    """The default's worst ratio to the best policy per cell (TTFT mean, p90, best ÷ throughput);
    a cell no policy passes is marked with an asterisk."""
    from kv_picker_bench.harness.report import _pyplot

    plt = _pyplot()
    rows = sorted({(r.cell.family, r.cell.cluster, r.cell.timing) for r in results})
    loads = sorted({r.cell.load for r in results})
    values = [[math.nan] * len(loads) for _ in rows]
    nobody: set[tuple[int, int]] = set()
    for result in results:
        mine = cell_ratios(result).get(DEFAULT_POLICY)
        if mine is None:
            continue
        row = rows.index((result.cell.family, result.cell.cluster, result.cell.timing))
        column = loads.index(result.cell.load)
        values[row][column] = min(worst_judged_ratio(mine), 9.0)
        if not passing_policies(result):
            nobody.add((row, column))
    figure, axes = plt.subplots(figsize=(6, 0.28 * len(rows) + 1.5))
    image = axes.imshow(values, aspect="auto", cmap="RdYlGn_r", vmin=1.0, vmax=1.5)
    axes.set_xticks(range(len(loads)), [f"{load:g}" for load in loads])
    axes.set_yticks(range(len(rows)), [" / ".join(row) for row in rows], fontsize=7)
    axes.set_xlabel("offered load (share of the binding resource)")
    axes.set_title(
        f"{DEFAULT_POLICY}: worst ratio to the best policy per cell\n"
        "(TTFT mean, p90, best ÷ throughput; * nobody passes)",
        fontsize=9,
    )
    for i, row_values in enumerate(values):
        for j, value in enumerate(row_values):
            if not math.isnan(value):
                mark = "*" if (i, j) in nobody else ""
                axes.text(j, i, f"{value:.2f}{mark}", ha="center", va="center", fontsize=6)
    figure.colorbar(image, ax=axes, fraction=0.04)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_policy_ratios(summaries: Sequence[PolicySummary], path: Path) -> None:
    """Geometric-mean and worst-cell TTFT ratios to the best, per policy."""
    from kv_picker_bench.harness.report import _pyplot

    plt = _pyplot()
    names = [s.policy for s in summaries]
    figure, axes = plt.subplots(figsize=(7, 3.2))
    positions = range(len(names))
    axes.bar([p - 0.2 for p in positions], [s.geo_ttft_mean for s in summaries], 0.4,
             label="TTFT mean, geometric mean over cells")  # fmt: skip
    axes.bar([p + 0.2 for p in positions], [s.worst_ttft_mean[0] for s in summaries], 0.4,
             label="TTFT mean, worst cell")  # fmt: skip
    axes.axhline(PASS_RATIO, color="grey", linewidth=0.8, linestyle="--")
    axes.set_yscale("log")
    axes.set_xticks(list(positions), names, rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("ratio to the best policy of the cell")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ----------------------------------------------------------------------------- command


def _timing_overrides(name: str) -> dict[str, Any]:
    profile = timing_profile(name)
    return {
        "timing": profile,
        "num_gpu_blocks": profile.kv_capacity_tokens // 16,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
    }


RESPONSES = ("full", "lean", "end-only")


def parse_cell(text: str) -> tuple[str, float, str, str]:
    """``family/load/cluster/timing`` (spaces around the slashes allowed), as the matrix names
    its cells.

    Raises:
        ConfigError: a malformed cell or an unknown part, naming the known ones.
    """
    parts = [p.strip() for p in text.split("/")]
    if len(parts) != 4 or not all(parts):
        raise ConfigError(
            f"cell {text!r}: expected family/load/cluster/timing, "
            "e.g. long-doc-qa/0.3/small4/llama-3.1-70b-h100-tp4"
        )
    family, load_text, cluster, timing = parts
    for name, known, what in (
        (family, FAMILIES, "family"),
        (cluster, CLUSTERS, "cluster"),
        (timing, TIMING_PROFILES, "timing profile"),
    ):
        if name not in known:
            raise ConfigError(f"cell {text!r}: unknown {what} {name!r}; known: {', '.join(known)}")
    try:
        load = float(load_text)
    except ValueError:
        load = math.nan
    if not (math.isfinite(load) and load > 0):
        raise ConfigError(f"cell {text!r}: the load must be a positive number, not {load_text!r}")
    if CLUSTERS[cluster].pd and not FAMILIES[family].long_prompts:
        long = ", ".join(name for name, f in FAMILIES.items() if f.long_prompts)
        raise ConfigError(
            f"cell {text!r}: the matrix has no pd cell for {family} (its prompts are too short "
            f"to disaggregate); pd cells: {long}"
        )
    return family, load, cluster, timing


CELL_SELECTIONS = ("all", "failing", "nobody")
"""``--cells`` keywords (see :func:`kv_picker_bench.harness.against.select_cells`)."""


def parse_cells(text: str) -> str | set[Cell]:
    """``--cells``: a keyword of :data:`CELL_SELECTIONS`, or a comma list of cells.

    Raises:
        ConfigError: a malformed or unknown cell, named.
    """
    if text.strip() in CELL_SELECTIONS:
        return text.strip()
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"--cells: give {', '.join(CELL_SELECTIONS)} or a comma list of cells")
    return {Cell(*parse_cell(item)) for item in items}


def cell_workload(
    cell_text: str,
    draw: int = DEFAULT_FAMILY_SEED,
    responses: str = "full",
    quick: bool = False,
    cached_when: str = CACHED_WHEN[0],
) -> tuple[Cell, Trace, ClusterConfig, Load]:
    """One matrix cell's requests (at its load) and cluster, as ``kv-picker bench matrix``
    builds them for ``--family-seed draw`` (and ``--quick``), and the load they offer.

    Raises:
        ConfigError: a bad cell (:func:`parse_cell`).
        TraceError: the family cannot build its trace.
    """
    family, load, cluster, timing = parse_cell(cell_text)
    plan = plan_matrix(
        [family], [load], [cluster], [timing], [], quick,
        cluster_overrides(responses, cached_when), draw,
    )  # fmt: skip
    cell = plan.cells[0]
    return cell, plan.traces[cell], plan.configs[cell], plan.loads[cell]


def cluster_overrides(
    responses: str, cached_when: str = CACHED_WHEN[0]
) -> Callable[[str], dict[str, Any]]:
    """The cluster overrides of each timing profile, seen through ``--responses``, with the
    endpoints' ``--cached-when``."""
    seen = {
        "first_byte_seen": responses == "full",
        "first_tokens_scraped": responses != "end-only",
        "cached_when": cached_when,
    }

    def overrides(name: str) -> dict[str, Any]:
        return {**_timing_overrides(name), **seen}

    return overrides


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"--{what}: unknown {', '.join(unknown) or 'nothing'}; known: "
                         f"{', '.join(known)}")  # fmt: skip
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench matrix",
        description="Every policy on every cell of workload family x offered load x cluster "
        "shape x timing profile, offline; each policy's ratio to the best per cell, and "
        "whether the default is within 5% of the best everywhere.",
    )
    parser.add_argument(
        "--families",
        default="all",
        help="comma list, or tuning, held-out, all (default); families: "
        + ", ".join(f"{f.name} ({f.split})" for f in FAMILIES.values()),
    )
    parser.add_argument(
        "--loads",
        default=",".join(f"{load:g}" for load in DEFAULT_LOADS),
        help="offered loads as fractions of the cluster's capacity: the share of its binding "
        "resource, prefill or decode, a perfect router keeps busy (default 0.3,0.6,0.9,1.2)",
    )
    parser.add_argument(
        "--clusters",
        default=",".join(CLUSTERS),
        help=f"comma list of {', '.join(CLUSTERS)} (default all; pd runs on long-prompt "
        "families only)",
    )
    parser.add_argument(
        "--timing",
        default=",".join(name for name in TIMING_PROFILES if name != "legacy"),
        help=f"comma list of timing profiles (default all but legacy): {describe_profiles()}",
    )
    parser.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME|NAME=FILE|FILE",
        help="policies (default: the six baselines and the built-in default); repeatable",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small traces, for a smoke run (the test suite runs one)",
    )
    parser.add_argument(
        "--responses",
        choices=RESPONSES,
        default="full",
        help="what the gateway shows the picker of each response: full (every chunk, so the "
        "first byte and the end: the GIE's configuration; the default), lean (the end only: "
        "response trailers alone, see kv-picker bench overhead --modes lean; a prefill ends "
        "when the endpoint's scraped first-token count says so) or end-only (lean, with "
        "servers that export no first-token count: a prefill ends with its request)",
    )
    parser.add_argument(
        "--cached-when",
        choices=CACHED_WHEN,
        default=None,
        help="when a prompt block becomes a cache hit on a simulated endpoint: scheduled (from "
        "the step that schedules its prefill chunk, as vLLM v1 caches blocks when it allocates "
        "them; the default) or computed (once that step has ended: the model of the matrices "
        "stored before scheduled, which record no cached_when); with --against or --refresh, "
        "the stored matrix's",
    )
    parser.add_argument(
        "--seed",
        metavar="N[,N...]",
        help="seed of the policies' generators (tie-breaks, random pickers; default 0, and with "
        "--against the stored matrix's seeds); several run every policy once per seed on every "
        "cell and pool each cell's figures over them as draws are pooled (TTFT mean over every "
        "request, percentiles averaged, output tokens over the summed makespans), so a verdict "
        "rests less on one run's tie-breaks",
    )
    parser.add_argument(
        "--family-seed",
        default=str(DEFAULT_FAMILY_SEED),
        metavar="N[,N...]",
        help=f"which draw of every family ({DEFAULT_FAMILY_SEED}): the generators' seed, and "
        "for the conversation family the N-th 200-second window from 1,800 s of the trace "
        f"(cycling after {_CONVERSATION_WINDOWS}); several draws run one after the other, each "
        "into draw-N/, with a summary of the default's verdicts across them in draws.md",
    )
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes"
    )
    parser.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="a stored matrix (a results folder of this command): run only the --policy "
        "candidates on its cells and judge each as the default would be judged, against the "
        "stored policies other than the stored default (against.md, against.json)",
    )
    parser.add_argument(
        "--cells",
        default="all",
        metavar="all|failing|nobody|CELL[,CELL...]",
        help="with --against: the stored cells to run, of those the other options select: all "
        "(the default), failing (those the stored default fails with the draws pooled), "
        "nobody (those no stored policy passes pooled), or a comma list of cells "
        "(family/load/cluster/timing, e.g. long-doc-qa/0.3/small4/llama-3.1-70b-h100-tp4); "
        "but for all, a report section then lists, per cell, the candidates that pass it",
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=0,
        metavar="N",
        help="with --against: also judge N profiles drawn evenly from kv-picker tune's "
        "built-in search space (kv-picker tune --print-space), named sample-1 ... and written "
        "to the results folder's samples/ (0: none)",
    )
    parser.add_argument(
        "--sample-seed",
        type=int,
        default=0,
        help="seed of --sample's draws (0): the same seed draws the same profiles",
    )
    parser.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="run nothing: write the reports of a stored matrix (a results folder of this "
        "command) again from its matrix.json files, with this version's report code "
        "(give --quick if the stored run was quick)",
    )
    parser.add_argument(
        "--refresh",
        type=Path,
        metavar="DIR",
        help="a stored matrix: run the built-in default (kv-picker) alone again on its draws, "
        "cells and policy seeds, and write a whole matrix to --out with every other stored "
        "policy's runs kept as they are: after a change to the default, its figures without "
        "running the baselines again (each policy's run is independent of the others' and "
        "deterministic under its seed); with --policy, those stored policies in its place "
        "(after a fix to a baseline), and with --families, --loads, --clusters or --timing, "
        "on those cells only, every other stored cell kept as it is",
    )
    parser.add_argument("--out", type=Path, help="results folder (default: results/<time>-...)")
    parser.add_argument("--title", default="", help="title of the Markdown report")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _families(text: str) -> list[str]:
    if text in ("all", TUNING, HELD_OUT):
        return [f.name for f in FAMILIES.values() if text in ("all", f.split)]
    return _names(text, list(FAMILIES), "families")


def _matrix(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    started = time.perf_counter()
    draws = parse_family_seeds(args.family_seed)
    seeds = None if args.seed is None else parse_policy_seeds(args.seed)
    families = _families(args.families)
    loads = parse_loads(args.loads)
    clusters = _names(args.clusters, list(CLUSTERS), "clusters")
    timings = _names(args.timing, list(TIMING_PROFILES), "timing")
    # With --against the candidates are the --policy and --sample ones, never the baselines.
    policies = resolve_policies(args.policy) if args.policy or args.against is None else []
    registry = harness_registry()
    for policy in policies:
        policy.config(registry)  # fail before any work on a bad config
    if args.report is not None:
        if args.against is not None or args.policy or args.seed is not None:
            raise UsageError("--report runs nothing: it takes no --against, --policy or --seed")
        return _rewrite_reports(args)
    if args.refresh is not None:
        if args.against is not None or args.seed is not None or args.sample:
            raise UsageError(
                "--refresh runs stored policies again on the stored matrix's own seeds: it "
                "takes no --against, --seed or --sample"
            )
        rerun = policies if args.policy else []
        return _refresh(args, argv, draws, families, loads, clusters, timings, rerun)
    cells = parse_cells(args.cells)
    if args.against is None and (args.cells != "all" or args.sample):
        raise UsageError("--cells and --sample judge candidates on a stored matrix: give --against")
    if args.sample < 0:
        raise UsageError(f"--sample must be at least 0, not {args.sample}")
    if args.against is not None:
        return _against(
            args, argv, draws, seeds, families, loads, clusters, timings, policies, cells
        )
    seeds = seeds or [0]
    args.cached_when = args.cached_when or CACHED_WHEN[0]
    folder = results_dir(args, "matrix", "matrix")
    command = record_command(folder, "matrix", argv)
    title = args.title or "Routing-policy matrix"
    per_draw: dict[int, list[CellResult]] = {}
    per_seed: dict[int, dict[int, list[CellResult]]] = {seed: {} for seed in seeds}
    for draw in draws:
        plan = plan_matrix(
            families,
            loads,
            clusters,
            timings,
            policies,
            args.quick,
            cluster_overrides(args.responses, args.cached_when),
            draw,
        )
        out = folder / draw_folder(draw, len(draws))
        out.mkdir(parents=True, exist_ok=True)
        results, seed_runs, wall_s = _timed_run(
            plan, seeds, args,
            f"matrix{'' if len(draws) == 1 else f' draw {draw}'}: {len(plan.cells)} cells x "
            f"{len(policies)} policies ({len(plan.jobs())} runs) -> {out}",
        )  # fmt: skip
        text = _write_draw(
            args, folder, command, title, draw, len(draws), results, seed_runs, wall_s
        )
        if len(seeds) > 1:
            for seed, seed_results in seed_runs.items():
                per_seed[seed][draw] = seed_results
        per_draw[draw] = results
    text = _write_summaries(folder, title, command, per_draw, per_seed, started) or text
    print(text)
    print(f"results: {folder}")
    return EXIT_OK


def _timed_run(
    plan: MatrixPlan, seeds: Sequence[int], args: argparse.Namespace, progress: str
) -> tuple[list[CellResult], dict[int, list[CellResult]], float]:
    """:func:`run_seeds` with its wall time in seconds, after a progress line on stderr
    (unless ``--quiet``)."""
    if not args.quiet:
        print(progress, file=sys.stderr)
    started = time.perf_counter()
    pooled, per_seed = run_seeds(plan, seeds, args.jobs, args.quiet)
    return pooled, per_seed, time.perf_counter() - started


def _write_draw(
    args: argparse.Namespace,
    folder: Path,
    command: str,
    title: str,
    draw: int,
    draws: int,
    results: Sequence[CellResult],
    seed_runs: Mapping[int, Sequence[CellResult]],
    wall_s: float,
) -> str:
    """One draw of a matrix written out: each seed's figures (``seed-N/``, with several seeds),
    the draw's report and figures (the seeds pooled) and its plots; returns the report."""
    seeds = list(seed_runs)
    if len(seeds) > 1:
        for seed, seed_results in seed_runs.items():
            seed_out = folder / f"seed-{seed}" / draw_folder(draw, draws)
            seed_out.mkdir(parents=True, exist_ok=True)
            write_json(
                seed_out / "matrix.json",
                results_json(
                    command, seed_results, math.nan, draw, args.quick, [seed], args.cached_when
                ),
            )
    out = folder / draw_folder(draw, draws)
    out.mkdir(parents=True, exist_ok=True)
    draw_title = title if draws == 1 else f"{title}, draw {draw}"
    text = markdown_report(draw_title, command, results, wall_s, seeds)
    (out / "matrix.md").write_text(text, encoding="utf-8")
    write_json(
        out / "matrix.json",
        results_json(command, results, wall_s, draw, args.quick, seeds, args.cached_when),
    )
    if not args.no_plots:
        plot_default_heatmap(results, out / "default_heatmap.png")
        plot_policy_ratios(summarize_policies(results), out / "policy_ratios.png")
    return text


def _write_summaries(
    folder: Path,
    title: str,
    command: str,
    per_draw: Mapping[int, Sequence[CellResult]],
    per_seed: Mapping[int, Mapping[int, Sequence[CellResult]]],
    started: float,
) -> str:
    """The summaries over several draws (``draws.md``, ``draws.json``) and several seeds
    (``seeds.md``, ``seeds.json``); returns the draws' report ("" for one draw)."""
    seeds = list(per_seed)
    text = ""
    if len(per_draw) > 1:
        runs = run_by_run(per_seed) if len(seeds) > 1 else None
        text = draws_report(title, command, per_draw, seeds, runs)
        wall_s = time.perf_counter() - started
        text += f"\nWall time of all draws: {wall_s:.1f} s.\n"
        (folder / "draws.md").write_text(text, encoding="utf-8")
        write_json(folder / "draws.json", draws_json(command, per_draw, wall_s, seeds))
    if len(seeds) > 1:
        _write_seeds_reports(folder, title, command, per_seed)
    return text


def draw_folder(draw: int, draws: int) -> str:
    """Where a draw's reports go in a results folder: ``draw-N``, or the folder itself for a
    run of one draw."""
    return "." if draws == 1 else f"draw-{draw}"


def _write_seeds_reports(
    folder: Path,
    title: str,
    command: str,
    per_seed: Mapping[int, Mapping[int, Sequence[CellResult]]],
) -> None:
    (folder / "seeds.md").write_text(seeds_report(title, command, per_seed), encoding="utf-8")
    write_json(folder / "seeds.json", seeds_json(command, per_seed))


def _stored_header(path: Path) -> dict[str, Any]:
    try:
        data = read_json(path)
        return {"command": str(data["command"]), "wall_s": float(data["wall_s"]),
                "draw": int(data["family_seed"]),
                "seeds": [int(seed) for seed in data.get("seeds", [0])],
                "cached_when": str(data.get("cached_when", "computed"))}  # fmt: skip
    except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--report: {path} is not a stored matrix: {exc!r}") from None


def _stored_total_wall(folder: Path, summed_s: float) -> float:
    """The whole stored run's wall time: from ``draws.json``, else from the line ``draws.md``
    ends with (summaries written before ``draws.json`` kept it), else the draws' own, summed."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return float(json.loads((folder / "draws.json").read_text(encoding="utf-8"))["wall_s"])
    with contextlib.suppress(OSError):
        text = (folder / "draws.md").read_text(encoding="utf-8")
        found = re.findall(r"^Wall time of all draws: ([0-9.]+) s\.$", text, re.MULTILINE)
        if found:
            return float(found[-1])
    return summed_s


def _rewrite_reports(args: argparse.Namespace) -> int:
    """``--report DIR``: a stored matrix's reports written again from its ``matrix.json``
    files (one, or one per ``draw-N/``; plain or gzip-compressed, each written back as it was)
    by this version's report code. The figures are the stored ones; the verdicts, tables and
    plots are recomputed from them."""
    from kv_picker_bench.harness import against

    folder: Path = args.report
    flat = against.stored_figures(folder)
    if flat is not None:
        paths = [flat]
    else:
        found = []
        for draw_folder in folder.glob("draw-*"):
            suffix = draw_folder.name.removeprefix("draw-")
            stored = against.stored_figures(draw_folder) if suffix.isdigit() else None
            if stored is not None:
                found.append((int(suffix), stored))
        paths = [path for _, path in sorted(found)]
    if not paths:
        raise UsageError(
            f"--report: no matrix.json (or matrix.json.gz) in {folder} or in its draw-N/ folders"
        )
    title = args.title or "Routing-policy matrix"
    per_draw: dict[int, list[CellResult]] = {}
    command = ""
    total_s = 0.0
    draws = len(paths)
    for path in paths:
        header = _stored_header(path)
        draw, wall_s, command = header["draw"], header["wall_s"], header["command"]
        seeds = header["seeds"]
        results = list(against.load_stored(path, draw, args.quick).values())
        if len(seeds) > 1:
            results = _pooled_again(folder, draw, draws, seeds, results, args.quick)
        draw_title = title if path == flat else f"{title}, draw {draw}"
        (path.parent / "matrix.md").write_text(
            markdown_report(draw_title, command, results, wall_s, seeds), encoding="utf-8"
        )
        write_json(
            path,
            results_json(command, results, wall_s, draw, args.quick, seeds, header["cached_when"]),
        )
        if not args.no_plots:
            plot_default_heatmap(results, path.parent / "default_heatmap.png")
            plot_policy_ratios(summarize_policies(results), path.parent / "policy_ratios.png")
        per_draw[draw] = results
        total_s += wall_s
    per_seed = None
    if len(seeds) > 1:
        per_seed = {
            seed: {draw: _stored_seed(folder, seed, draw, draws, args.quick) for draw in per_draw}
            for seed in seeds
        }
    if path != flat:
        total_s = _stored_total_wall(folder, total_s)
        runs = None if per_seed is None else run_by_run(per_seed)
        text = draws_report(title, command, per_draw, seeds, runs)
        text += f"\nWall time of all draws: {total_s:.1f} s.\n"
        (folder / "draws.md").write_text(text, encoding="utf-8")
        write_json(folder / "draws.json", draws_json(command, per_draw, total_s, seeds))
    if per_seed is not None:
        _write_seeds_reports(folder, title, command, per_seed)
    print(f"reports written again from the stored figures: {folder}")
    return EXIT_OK


def _stored_seed(folder: Path, seed: int, draw: int, draws: int, quick: bool) -> list[CellResult]:
    from kv_picker_bench.harness import against

    path = against.stored_matrix_path(folder / f"seed-{seed}", draw, draws)
    return list(against.load_stored(path, draw, quick).values())


def _judged_figures(m: PolicyMetrics) -> tuple[Any, ...]:
    return (m.ok, m.ttft_s, m.output_tokens_per_s, m.sustained_tokens_per_s, m.makespan_s)


def _pooled_again(
    folder: Path,
    draw: int,
    draws: int,
    seeds: Sequence[int],
    stored: Sequence[CellResult],
    quick: bool,
) -> list[CellResult]:
    """A draw of a run under several policy seeds, pooled again from its ``seed-N/`` figures.

    Runs written before every figure was pooled kept the first seed's hit ratio, time per
    output token and end-to-end latency in the pooled draw; pooled again, every figure is the
    seeds' together. The judged figures (TTFT, throughput, sustained rate) must come out as
    stored, else the folder's seeds are not its draw's and nothing is rewritten.

    Raises:
        UsageError: a seed's figures missing or unreadable, or pooling to other judged figures.
    """
    per_seed = {seed: _stored_seed(folder, seed, draw, draws, quick) for seed in seeds}
    again = {result.cell: result for result in pool_seeds(per_seed)}
    out = []
    for result in stored:
        found = again.get(result.cell)
        if found is None or found.metrics.keys() != result.metrics.keys():
            raise UsageError(
                f"--report: the seed-N/ runs of {folder} do not hold every policy of "
                f"{result.cell.label} in draw {draw}"
            )
        for name, metrics in result.metrics.items():
            if _judged_figures(found.metrics[name]) != _judged_figures(metrics):
                raise UsageError(
                    f"--report: {name} on {result.cell.label} (draw {draw}) pools to other "
                    f"figures from the seed-N/ runs of {folder} than its stored draw holds"
                )
        out.append(replace(result, metrics=found.metrics))
    return out


def _plan_on_stored(
    args: argparse.Namespace,
    option: str,
    draw: int,
    stored: Mapping[Cell, CellResult],
    policies: Sequence[Policy],
    grid: tuple[Sequence[str], Sequence[float], Sequence[str], Sequence[str]],
    selected: set[Cell] | None = None,
) -> MatrixPlan:
    """The plan of ``policies`` on the cells of a stored draw that the options select (the
    families, loads, clusters and timings of ``grid``; of ``selected`` only, given it).

    Raises:
        UsageError: none of them is stored.
    """
    from kv_picker_bench.harness import against

    families, loads, clusters, timings = grid
    plan = plan_matrix(
        families, loads, clusters, timings, policies, args.quick,
        cluster_overrides(args.responses, args.cached_when), draw,
    )  # fmt: skip
    against.restrict_plan(plan, stored, selected)
    if not plan.cells:
        raise UsageError(f"{option}: draw {draw} has none of the cells asked for")
    return plan


def _refresh(
    args: argparse.Namespace,
    argv: Sequence[str],
    draws: Sequence[int],
    families: Sequence[str],
    loads: Sequence[float],
    clusters: Sequence[str],
    timings: Sequence[str],
    policies: Sequence[Policy],
) -> int:
    """``--refresh DIR``: the built-in default (or the stored ``policies`` given) run again on
    a stored matrix's cells that the options select, under each of its policy seeds, with the
    stored runs of every other policy and every other cell kept; written as a whole matrix
    (each seed's figures, the seeds pooled, the reports) to ``--out``."""
    from kv_picker_bench.harness import against

    if args.out is not None and args.out.resolve() == args.refresh.resolve():
        raise UsageError("--refresh writes a new matrix: give an --out other than the stored one")
    stored_draws = {
        draw: against.load_stored(
            against.stored_matrix_path(args.refresh, draw, len(draws)), draw, args.quick
        )
        for draw in draws
    }
    seeds = against.stored_seeds(args.refresh, draws)
    args.cached_when = against.stored_cached_when(args.refresh, draws, args.cached_when)
    seed_paths = against.stored_seed_paths(args.refresh, seeds, draws)
    if len(seeds) > 1 and seed_paths is None:
        raise UsageError(
            f"--refresh: {args.refresh} pools policy seeds {', '.join(map(str, seeds))} but has "
            "not kept each seed's runs (seed-N/draw-M/), which the refresh replaces one by one"
        )
    rerun = list(policies) or resolve_policies([DEFAULT_POLICY])
    stored_names = {n for cells in stored_draws.values() for r in cells.values() for n in r.metrics}
    for policy in rerun:
        if policy.name not in stored_names:
            raise UsageError(
                f"--refresh --policy {policy.name}: the stored matrix has no policy of that "
                f"name (it has {', '.join(sorted(stored_names))})"
            )
    names = ", ".join(policy.name for policy in rerun)
    folder = results_dir(args, "matrix", "matrix")
    command = record_command(folder, "matrix", argv)
    title = args.title or "Routing-policy matrix"
    per_draw: dict[int, list[CellResult]] = {}
    per_seed: dict[int, dict[int, list[CellResult]]] = {seed: {} for seed in seeds}
    started = time.perf_counter()
    for draw, stored in stored_draws.items():
        grid = (families, loads, clusters, timings)
        plan = _plan_on_stored(args, "--refresh", draw, stored, rerun, grid)
        _, fresh, wall_s = _timed_run(
            plan, seeds, args,
            f"refresh draw {draw}: {len(plan.cells)} cells, {names} under seeds "
            f"{', '.join(map(str, seeds))}",
        )  # fmt: skip
        seed_results = {}
        for seed in seeds:
            own = (
                stored
                if seed_paths is None
                else against.load_stored(seed_paths[seed][draw], draw, args.quick)
            )
            seed_results[seed] = against.merge_into(own, fresh[seed])
            if len(seeds) > 1:
                per_seed[seed][draw] = seed_results[seed]
        results = pool_seeds(seed_results) if len(seeds) > 1 else seed_results[seeds[0]]
        text = _write_draw(
            args, folder, command, title, draw, len(draws), results, seed_results, wall_s
        )
        per_draw[draw] = results
    text = _write_summaries(folder, title, command, per_draw, per_seed, started) or text
    print(text)
    print(f"results: {folder}")
    return EXIT_OK


def _against(
    args: argparse.Namespace,
    argv: Sequence[str],
    draws: Sequence[int],
    seeds: list[int] | None,
    families: Sequence[str],
    loads: Sequence[float],
    clusters: Sequence[str],
    timings: Sequence[str],
    policies: Sequence[Policy],
    cells: str | set[Cell],
) -> int:
    """``--against DIR``: the candidates' runs only, judged on the stored draws."""
    from kv_picker_bench.harness import against

    if not args.policy and not args.sample:
        raise UsageError(
            "--against needs the candidates to judge: --policy NAME=FILE, or --sample N"
        )
    stored_draws = {
        draw: against.load_stored(
            against.stored_matrix_path(args.against, draw, len(draws)), draw, args.quick
        )
        for draw in draws
    }
    stored_seeds = against.stored_seeds(args.against, draws)
    args.cached_when = against.stored_cached_when(args.against, draws, args.cached_when)
    seeds = seeds or stored_seeds
    stored_names = {n for cells in stored_draws.values() for r in cells.values() for n in r.metrics}
    names = [policy.name for policy in policies]
    for name in names:
        if name in stored_names:
            raise UsageError(
                f"--policy {name}: the stored matrix has a policy of that name; name the "
                "candidate otherwise (NAME=FILE)"
            )
    for number in range(1, args.sample + 1):
        if (name := sample_name(number)) in stored_names or name in names:
            raise UsageError(
                f"--sample: {name} is a name already taken (a --policy, or a stored policy); "
                "name that candidate otherwise"
            )
    if isinstance(cells, set):
        for cell in sorted(cells, key=lambda c: c.label):
            if not (
                cell.family in families
                and cell.load in loads
                and cell.cluster in clusters
                and cell.timing in timings
            ):
                raise UsageError(
                    f"--cells: {cell.label} is not among the cells --families, --loads, "
                    "--clusters and --timing select"
                )
    selected = against.select_cells(stored_draws, cells)
    if selected is not None and not selected:
        raise UsageError(f"--cells {args.cells}: the stored matrix has no such cell")
    folder = results_dir(args, "matrix", "against")
    command = record_command(folder, "matrix", argv)
    if args.sample:
        policies = [*policies, *sample_policies(args.sample, args.sample_seed, folder / "samples")]
        names = [policy.name for policy in policies]
    seed_paths = (
        against.stored_seed_paths(args.against, seeds, draws)
        if set(seeds) <= set(stored_seeds)
        else None
    )
    per_seed_draw: dict[int, dict[int, list[CellResult]]] = {seed: {} for seed in seeds}
    per_draw: dict[int, list[CellResult]] = {}
    for draw, stored in stored_draws.items():
        grid = (families, loads, clusters, timings)
        plan = _plan_on_stored(args, "--against", draw, stored, policies, grid, selected)
        if not args.quiet:
            print(
                f"against draw {draw}: {len(plan.cells)} cells x {len(policies)} candidates "
                f"({len(plan.jobs())} runs)",
                file=sys.stderr,
            )
        pooled, per_seed = run_seeds(plan, seeds, args.jobs, args.quiet)
        per_draw[draw] = against.merge(stored, pooled)
        if seed_paths is not None:
            for seed in seeds:
                own = against.load_stored(seed_paths[seed][draw], draw, args.quick)
                per_seed_draw[seed][draw] = against.merge(own, per_seed[seed])
    judgements = [
        j for name in [DEFAULT_POLICY, *names] for j in against.judge(per_draw, name, names)
    ]
    reach = against.reach(per_draw, names) if selected is not None else None
    seed_counts = against.per_seed_counts(per_seed_draw, names) if seed_paths is not None else None
    title = args.title or "Candidates judged as the default"
    shown = portable_path(str(args.against))
    text = against.against_report(
        title, command, shown, judgements, list(per_draw), reach, (seeds, stored_seeds),
        seed_counts,
    )  # fmt: skip
    (folder / "against.md").write_text(text, encoding="utf-8")
    write_json(folder / "against.json", against.against_json(
        command, shown, judgements, per_draw, names, reach, (seeds, stored_seeds),
        seed_counts))  # fmt: skip
    print(text)
    print(f"results: {folder}")
    return EXIT_OK


def sample_name(number: int) -> str:
    """The name of ``--sample``'s ``number``-th profile (from 1)."""
    return f"sample-{number}"


def sample_policies(count: int, seed: int, folder: Path) -> list[Policy]:
    """``--sample``: ``count`` profiles drawn evenly from ``kv-picker tune``'s built-in space
    around the built-in default, each written to ``folder/sample-N.yaml`` (so any of them can
    be run again by name) and read back as a policy."""
    registry = harness_registry()
    space = load_space(DEFAULT_SPACE, DEFAULT_SPACE_SOURCE, {}, "built-in default", registry)
    chooser = RandomChooser(random.Random(seed))
    folder.mkdir(parents=True, exist_ok=True)
    policies = []
    for number in range(1, count + 1):
        document, _ = space.build(chooser)
        name = sample_name(number)
        path = folder / f"{name}.yaml"
        header = (
            f"# Drawn by kv-picker bench matrix --sample (seed {seed}, draw {number} of "
            f"{count}) from kv-picker tune's built-in search space.\n"
        )
        path.write_text(header + yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
        policy = resolve_policy(f"{name}={path}")
        policy.config(registry)
        policies.append(policy)
    return policies


def main(argv: Sequence[str] | None = None) -> int:
    """``kv-picker bench matrix``: returns the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    return run_command("matrix", arguments, lambda: _matrix(arguments))


# ----------------------------------------------------------------------------- several draws


def parse_family_seeds(text: str) -> list[int]:
    """``--family-seed``: one draw or a comma list of them, each at least 1, no repeats."""
    return _whole_numbers(text, "--family-seed", "draw", 1)


@dataclass(slots=True)
class FamilyDraws:
    """The default's verdicts on one family's cells over several draws.

    ``passed_pooled``: cells the default passes on the draws pooled (:func:`pooled_results`);
    ``nobody_passes_pooled``: cells, pooled, that no policy of the run passes (the default
    among them fails too).
    """

    family: str
    split: str
    cells: int
    passed: list[int]
    passed_in_all: int
    failed_in_all: int
    passed_pooled: int = 0
    nobody_passes_pooled: int = 0


def _common_cells(per_draw: Mapping[int, Sequence[CellResult]]) -> list[Cell]:
    """The cells present in every draw, in the first draw's order."""
    found = [{result.cell for result in results} for results in per_draw.values()]
    first = next(iter(per_draw.values()), ())
    return [result.cell for result in first if all(result.cell in cells for cells in found)]


def _pooled_sustained(results: Sequence[CellResult], runs: Sequence[PolicyMetrics]) -> float:
    """The runs' sustained rates pooled over their draws' arrival windows (see
    :func:`pooled_results`)."""
    windows = [
        r.requests / r.offered_rate_per_s if r.offered_rate_per_s > 0 else math.nan for r in results
    ]
    rates = [m.sustained_tokens_per_s for m in runs]
    if all(w > 0 for w in windows):
        return sum(rate * w for rate, w in zip(rates, windows, strict=True)) / sum(windows)
    return sum(rates) / len(rates)


def _pooled_stats(
    runs: Sequence[PolicyMetrics], stats: Callable[[PolicyMetrics], dict[str, float]]
) -> dict[str, float]:
    """Per-request figures over several runs: the mean over every served request, each
    percentile the mean of the runs' (see :func:`pooled_results`)."""
    first = stats(runs[0])
    out = {key: sum(stats(m)[key] for m in runs) / len(runs) for key in first}
    served = sum(m.ok for m in runs)
    if served and "mean" in out:
        out["mean"] = sum(stats(m)["mean"] * m.ok for m in runs) / served
    return out


def _pooled_rate(runs: Sequence[PolicyMetrics], rate: Callable[[PolicyMetrics], float]) -> float:
    """A per-second figure over several runs: their amounts over their summed makespans."""
    makespan = sum(m.makespan_s for m in runs)
    return sum(rate(m) * m.makespan_s for m in runs) / makespan if makespan > 0 else 0.0


def pooled_results(per_draw: Mapping[int, Sequence[CellResult]]) -> list[CellResult]:
    """Each cell's figures over all its draws, as if the draws had run back to back.

    One draw is one sample of a family; a verdict on it carries that sample's noise, and the
    best of eight noisy policies is biased low. Pooled, per policy:

    - TTFT, time per output token and end-to-end latency, means: the mean over every served
      request of every draw (exact);
    - their p50 / p90 / p99: the mean of the draws' percentiles (the requests themselves are
      not kept; the union's percentile would differ a little);
    - output tokens/s and requests/s: all draws' output tokens (requests) over the sum of their
      makespans (exact);
    - sustained tokens/s: the draws' sustained rates weighted by their arrival windows (each
      draw's requests over its offered rate), so tokens produced while requests arrive over
      the summed windows; the plain mean where a draw's rate is unknown;
    - hit ratio: the draws' weighted by their served requests (their prompt tokens are not
      kept); imbalance: the draws' mean; request, error and transfer counts and wall time:
      summed.

    Only cells present in every draw and policies run in every draw are pooled; the floors
    and bounds are the first draw's.
    """
    by_cell = [{result.cell: result for result in results} for results in per_draw.values()]
    pooled = []
    for cell in _common_cells(per_draw):
        results = [found[cell] for found in by_cell]
        names = [n for n in results[0].metrics if all(n in r.metrics for r in results[1:])]
        metrics = {}
        for name in names:
            runs = [r.metrics[name] for r in results]
            served = sum(m.ok for m in runs)
            makespan = sum(m.makespan_s for m in runs)
            metrics[name] = replace(
                runs[0],
                requests=sum(m.requests for m in runs),
                ok=served,
                rejected=sum(m.rejected for m in runs),
                shed=sum(m.shed for m in runs),
                errors=sum(m.errors for m in runs),
                ttft_s=_pooled_stats(runs, lambda m: m.ttft_s),
                tpot_s=_pooled_stats(runs, lambda m: m.tpot_s),
                e2e_s=_pooled_stats(runs, lambda m: m.e2e_s),
                output_tokens_per_s=_pooled_rate(runs, lambda m: m.output_tokens_per_s),
                requests_per_s=_pooled_rate(runs, lambda m: m.requests_per_s),
                sustained_tokens_per_s=_pooled_sustained(results, runs),
                hit_ratio=(
                    sum(m.hit_ratio * m.ok for m in runs) / served
                    if served
                    else sum(m.hit_ratio for m in runs) / len(runs)
                ),
                imbalance=sum(m.imbalance for m in runs) / len(runs),
                imbalance_busy=sum(m.imbalance_busy for m in runs) / len(runs),
                transferred_tokens=sum(m.transferred_tokens for m in runs),
                transferred_bytes=sum(m.transferred_bytes for m in runs),
                makespan_s=makespan,
                wall_s=sum(m.wall_s for m in runs),
            )
        first = results[0]
        pooled.append(
            CellResult(
                cell,
                sum(r.requests for r in results),
                first.offered_rate_per_s,
                metrics,
                first.floors,
                first.hit_bounds,
                first.prefill_load,
                first.decode_load,
            )
        )
    return pooled


def family_draws(per_draw: Mapping[int, Sequence[CellResult]]) -> list[FamilyDraws]:
    """Per family: how many cells the default passes in each draw, in every one, in none, and
    on the draws pooled.

    A cell is the same family x load x cluster x timing in every draw; only cells present in
    every draw count.
    """
    draws = list(per_draw)
    verdicts: list[dict[Cell, bool]] = []
    pooled = pooled_results(per_draw)
    nobody = {result.cell for result in pooled if not passing_policies(result)}
    for results in [*per_draw.values(), pooled]:
        found: dict[Cell, bool] = {}
        for result in results:
            verdict = default_verdict(result)
            if verdict is not None:
                found[result.cell] = verdict.passed
        verdicts.append(found)
    rows: dict[str, FamilyDraws] = {}
    for cell in _common_cells(per_draw):
        if not all(cell in v for v in verdicts):
            continue
        row = rows.get(cell.family)
        if row is None:
            split = FAMILIES[cell.family].split
            row = rows[cell.family] = FamilyDraws(cell.family, split, 0, [0] * len(draws), 0, 0)
        outcomes = [v[cell] for v in verdicts[: len(draws)]]
        row.cells += 1
        for i, passed in enumerate(outcomes):
            row.passed[i] += passed
        row.passed_in_all += all(outcomes)
        row.failed_in_all += not any(outcomes)
        row.passed_pooled += verdicts[-1][cell]
        row.nobody_passes_pooled += cell in nobody
    order = list(FAMILIES)
    return sorted(rows.values(), key=lambda r: order.index(r.family))


def draws_report(
    title: str,
    command: str,
    per_draw: Mapping[int, Sequence[CellResult]],
    seeds: Sequence[int] = (0,),
    runs: Sequence[RunByRun] | None = None,
) -> str:
    """Markdown: the default's verdicts across draws, per family, and each draw's summary;
    with ``runs`` (:func:`run_by_run` of a run under several seeds), whether each failed cell's
    runs decide its failure."""
    draws = list(per_draw)
    rows = family_draws(per_draw)
    lines = [
        f"# {title}: {len(draws)} draws of every family",
        "",
        f"Command: `{command}`",
        "",
        *([seeds_sentence(seeds), ""] if list(seeds) != [0] else []),
        "Each draw replays every family with another generator seed (the conversation family: "
        "another window of the trace); each draw's full report is in `draw-N/matrix.md`. A "
        "verdict that holds in every draw is a property of the policy; one that flips is the "
        "draw's.",
        "",
        "*Pooled*: the same bar on each cell's draws taken together, as if they had run back "
        "to back (TTFT mean over every request of every draw; TTFT p90 the mean of the draws' "
        "p90s; output tokens over the summed makespans). It is not the per-draw bar: it "
        "estimates a policy's figures on the family with less of one sample's noise.",
        "",
        "## The default's verdict per family",
        "",
        "| family | split | cells | "
        + " | ".join(f"pass, draw {d}" for d in draws)
        + " | pass in all | fail in all | pass, pooled | no policy passes, pooled |",
        "|---|---|---:|" + "---:|" * (len(draws) + 4),
    ]

    def line(name: str, split: str, chosen: list[FamilyDraws]) -> str:
        passed = [sum(r.passed[i] for r in chosen) for i in range(len(draws))]
        return (
            f"| {name} | {split} | {sum(r.cells for r in chosen)} | "
            + " | ".join(str(p) for p in passed)
            + f" | {sum(r.passed_in_all for r in chosen)} "
            f"| {sum(r.failed_in_all for r in chosen)} "
            f"| {sum(r.passed_pooled for r in chosen)} "
            f"| {sum(r.nobody_passes_pooled for r in chosen)} |"
        )

    for row in rows:
        lines.append(line(row.family, row.split, [row]))
    for split in (TUNING, HELD_OUT):
        chosen = [r for r in rows if r.split == split]
        if chosen:
            lines.append(line(f"**{split}**", "", chosen))
    lines.append(line("**all**", "", rows))
    pooled = pooled_results(per_draw)
    failed = [
        (result, verdict)
        for result in pooled
        if (verdict := default_verdict(result)) is not None and not verdict.passed
    ]
    if failed:
        near: list[str] = []
        for result, _ in failed:
            trailed = trails_gie_default(result, DEFAULT_POLICY)
            versus = versus_gie(result, DEFAULT_POLICY)
            ratios = cell_ratios(result)[DEFAULT_POLICY]
            within = (
                ratios.ttft_mean <= PASS_RATIO
                and ratios.ttft_p90 <= PASS_RATIO
                and ratios.throughput >= 1 / PASS_RATIO
            )
            if within and versus is not None and versus.near_tie(trailed):
                near.append(result.cell.label)
        lines += [
            "",
            f"## The cells the default fails, pooled ({len(failed)})",
            "",
            f"{len(near)} of them fail only by trailing the GIE default, by less than "
            f"{NEAR_TIE:.1%} on each figure it trails"
            + (f": {', '.join(near)}." if near else ".")
            + " *Against gie-default*: the default's TTFT mean / p90 and throughput over the "
            "GIE default's, and in brackets its sustained rate (tokens produced while requests "
            "arrive) over the GIE default's, which the last request's finish does not move.",
            "",
            "*Policies that pass*: the policies meeting the same bar on the pooled cell, each "
            "judged as the default is. Where none does, none is within 5% of the best TTFT "
            "mean, p90 and throughput at once, or the ones that are trail the GIE default on a "
            "figure; *closest* is the policy whose worst ratio among TTFT "
            "mean, p90 and best ÷ throughput is smallest, and that ratio, next to the "
            "default's. *Why no policy passes*: the policies within 5% of the best TTFT mean and "
            "p90, with their throughput, against those within 5% of the best throughput, with "
            "their TTFT mean / p90 (two of each, the closest first); or, where some policy is "
            "within 5% of every best, what it trails the GIE default on."
            + (
                ""
                if runs is None
                else " *Decided by the runs*: the figures on which the default's runs (each seed "
                f"of each draw) put it above the bar by more than {DECIDED_SE:g} standard "
                "errors, each against the policy it fails against (`seeds.md`, \"The default's "
                "failures, run by run\"; throughput as the reference's over the default's, so "
                "above 1 is worse); *no* where every failing figure is within the runs' own "
                "spread."
            ),
            "",
            "| cell | split | why | against gie-default | policies that pass "
            "| the default's worst ratio | why no policy passes |"
            + ("" if runs is None else " decided by the runs |"),
            "|---|---|---|---|---|---:|---|" + ("" if runs is None else "---|"),
        ]
        for result, verdict in failed:
            ours = worst_judged_ratio(cell_ratios(result)[DEFAULT_POLICY])
            versus = versus_gie(result, DEFAULT_POLICY)
            against = (
                "–"
                if versus is None
                else f"{versus.ttft_mean:.3f} / {versus.ttft_p90:.3f} / "
                f"{versus.throughput:.4f} ({versus.sustained:.4f})"
            )
            decided = "" if runs is None else f" {_decided_by_runs(runs, result.cell.label)} |"
            lines.append(
                f"| {result.cell.label} | {FAMILIES[result.cell.family].split} "
                f"| {'; '.join(verdict.reasons)} | {against} | {describe_passing(result)} "
                f"| {ours:.2f}x | {why_nobody_passes(result) or '–'} |" + decided
            )
    lines += [
        "",
        "## Each draw: the default against the other policies",
        "",
        "Ratio to the best policy of each cell, geometric mean over cells, and the worst cell.",
        "",
        "| draw | default TTFT mean / p90 | best other policy (TTFT mean) | worst TTFT mean "
        "| worst TTFT p90 | worst throughput |",
        "|---|---|---|---|---|---|",
    ]
    labelled: list[tuple[str, Sequence[CellResult]]] = [(str(d), per_draw[d]) for d in draws]
    for label, results in [*labelled, ("pooled", pooled)]:
        summaries = summarize_policies(results)
        mine = next((s for s in summaries if s.policy == DEFAULT_POLICY), None)
        others = [s for s in summaries if s.policy != DEFAULT_POLICY]
        if mine is None:
            continue
        other = f"{others[0].policy} ({others[0].geo_ttft_mean:.3f})" if others else "–"
        lines.append(
            f"| {label} | {mine.geo_ttft_mean:.3f} / {mine.geo_ttft_p90:.3f} | {other} "
            f"| {mine.worst_ttft_mean[0]:.2f} ({mine.worst_ttft_mean[1]}) "
            f"| {mine.worst_ttft_p90[0]:.2f} ({mine.worst_ttft_p90[1]}) "
            f"| {mine.worst_throughput[0]:.2f} ({mine.worst_throughput[1]}) |"
        )
    return "\n".join(lines) + "\n"


def draws_json(
    command: str,
    per_draw: Mapping[int, Sequence[CellResult]],
    wall_s: float = math.nan,
    seeds: Sequence[int] = (0,),
) -> dict[str, Any]:
    pooled = pooled_results(per_draw)
    return {
        "command": command,
        "wall_s": wall_s,
        "draws": list(per_draw),
        **({} if list(seeds) == [0] else {"seeds": list(seeds)}),
        "families": [_slots(row) for row in family_draws(per_draw)],
        "summary": {
            str(draw): [_slots(s) for s in summarize_policies(results)]
            for draw, results in per_draw.items()
        },
        "pooled": {
            "summary": [_slots(s) for s in summarize_policies(pooled)],
            "cells": [
                {
                    **_slots(result.cell),
                    "default_verdict": _verdict_json(default_verdict(result)),
                    "passing_policies": passing_policies(result),
                    "closest_policy": list(closest_policy(result)),
                    "why_nobody_passes": why_nobody_passes(result),
                    "versus_gie_default": _slots_or_none(versus_gie(result, DEFAULT_POLICY)),
                }
                for result in pooled
            ],
        },
    }


# ----------------------------------------------------------------------------- several seeds

#: How far apart two runs of one policy on one cell may be, on any judged figure, and still be
#: the same figure at the bar's resolution.
SEED_SPREAD = 1.05


@dataclass(slots=True)
class SeedVerdicts:
    """The default's verdicts under one policy seed (or, ``seed`` None, the seeds pooled):
    cells passed per draw, and with the draws pooled (None for one draw); and its worst ratios
    to the best policy over the judged cells (TTFT mean, TTFT p90, the best throughput over
    its own),
    with their cells, which tell how far a worst cell moves with the tie-breaks alone."""

    seed: int | None
    passed: list[int]
    passed_pooled: int | None
    nobody_passes_pooled: int | None
    failed: list[str]
    worst: list[tuple[float, str]] | None = None


@dataclass(slots=True)
class SelfSpread:
    """How far one policy's runs under the seeds are from each other: the cell runs (a cell in
    one draw) and the cells pooled over the draws where the largest over the smallest of TTFT
    mean, p90 or output throughput exceeds :data:`SEED_SPREAD`."""

    policy: str
    cell_runs: int
    spread_runs: int
    cells: int
    spread_pooled: int
    largest: float
    largest_cell: str


def _judged_pooled(per_draw: Mapping[int, Sequence[CellResult]]) -> list[CellResult]:
    return list(pooled_results(per_draw)) if len(per_draw) > 1 else list(*per_draw.values())


def seed_verdicts(per_seed: Mapping[int, Mapping[int, Sequence[CellResult]]]) -> list[SeedVerdicts]:
    """The default's verdicts under each seed, then with the seeds pooled."""
    draws = list(next(iter(per_seed.values())))
    pooled_seeds = {
        draw: pool_seeds({seed: runs[draw] for seed, runs in per_seed.items()}) for draw in draws
    }
    rows = []
    for seed, runs in [*per_seed.items(), (None, pooled_seeds)]:
        passed = [sum(_passes(r) for r in runs[draw]) for draw in draws]
        judged = _judged_pooled(runs)
        failed = [r.cell.label for r in judged if default_verdict(r) is not None and not _passes(r)]
        several = len(draws) > 1
        mine = next((x for x in summarize_policies(judged) if x.policy == DEFAULT_POLICY), None)
        worst = (
            None
            if mine is None
            else [
                mine.worst_ttft_mean,
                mine.worst_ttft_p90,
                (1.0 / mine.worst_throughput[0], mine.worst_throughput[1])
                if mine.worst_throughput[0] > 0
                else (math.inf, mine.worst_throughput[1]),
            ]
        )
        rows.append(
            SeedVerdicts(
                seed,
                passed,
                sum(_passes(r) for r in judged) if several else None,
                sum(not passing_policies(r) for r in judged) if several else None,
                failed,
                worst,
            )
        )
    return rows


def _passes(result: CellResult) -> bool:
    verdict = default_verdict(result)
    return verdict is not None and verdict.passed


def _figures(metrics: PolicyMetrics) -> tuple[float, float, float]:
    return metrics.ttft_s["mean"], metrics.ttft_s["p90"], metrics.output_tokens_per_s


def _spread(runs: Sequence[PolicyMetrics]) -> float:
    """The largest, over TTFT mean, p90 and output throughput, of the largest run's figure over
    the smallest one's (1: the runs agree)."""
    figures = [_figures(m) for m in runs]
    worst = 1.0
    for i in range(3):
        values = [f[i] for f in figures]
        low, high = min(values), max(values)
        if low > 0:
            worst = max(worst, high / low)
        elif high > 0:
            worst = math.inf
    return worst


def self_spreads(per_seed: Mapping[int, Mapping[int, Sequence[CellResult]]]) -> list[SelfSpread]:
    """Each policy against itself under the other seeds, cell by cell."""
    seeds = list(per_seed)
    draws = list(per_seed[seeds[0]])
    by_cell = {
        seed: {draw: {r.cell: r for r in runs[draw]} for draw in draws}
        for seed, runs in per_seed.items()
    }
    cells = [r.cell for r in per_seed[seeds[0]][draws[0]]]
    names = list(dict.fromkeys(n for r in per_seed[seeds[0]][draws[0]] for n in r.metrics))
    rows = []
    for name in names:
        row = SelfSpread(name, 0, 0, 0, 0, 1.0, "")
        for cell in cells:
            runs = [[by_cell[s][d].get(cell) for d in draws] for s in seeds]
            found = [[r for r in per_draw if r is not None] for per_draw in runs]
            if any(len(f) < len(draws) or any(name not in r.metrics for r in f) for f in found):
                continue
            for i in range(len(draws)):
                row.cell_runs += 1
                row.spread_runs += _spread([f[i].metrics[name] for f in found]) > SEED_SPREAD
            row.cells += 1
            pooled = [
                _judged_pooled(dict(zip(draws, ([r] for r in f), strict=True))) for f in found
            ]
            spread = _spread([p[0].metrics[name] for p in pooled])
            row.spread_pooled += spread > SEED_SPREAD
            if spread > row.largest:
                row.largest, row.largest_cell = spread, cell.label
        rows.append(row)
    return rows


#: A failure read run by run is decided when the runs' mean log ratio is above the bar's by more
#: than this many standard errors.
DECIDED_SE = 2.0

# Each judged figure as a cost (higher: worse), so that a policy's over another's is above 1
# where it is worse: output throughput enters as its inverse.
_COSTS: dict[str, Callable[[PolicyMetrics], float]] = {
    "TTFT mean": lambda m: m.ttft_s["mean"],
    "TTFT p90": lambda m: m.ttft_s["p90"],
    "throughput": lambda m: 1.0 / m.output_tokens_per_s if m.output_tokens_per_s > 0 else math.inf,
}


@dataclass(frozen=True, slots=True)
class RunByRun:
    """One figure on which the default fails a pooled cell, read run by run (each policy seed
    of each draw): the default's cost over ``reference``'s (TTFT, or the reference's throughput
    over the default's), above 1 where the default is worse.

    Attributes:
        cell: the cell's label.
        figure: "TTFT mean", "TTFT p90" or "throughput".
        reference: the GIE default (bar 1: never worse) or the policy best on the figure in the
            pooled cell (bar :data:`PASS_RATIO`).
        bar: the ratio the default must not exceed.
        pooled: the ratio of the pooled figures (the verdict's).
        paired: the geometric mean of the runs' ratios.
        spread: the standard error of the runs' mean log ratio.
        beyond: the runs whose ratio is above the bar.
        runs: the runs read (both policies ran, both figures finite and positive).
    """

    cell: str
    figure: str
    reference: str
    bar: float
    pooled: float
    paired: float
    spread: float
    beyond: int
    runs: int

    @property
    def decided(self) -> bool:
        """Whether the runs put the default above the bar by more than :data:`DECIDED_SE`
        standard errors; if not, its runs' own spread could pass the figure."""
        return math.log(self.paired / self.bar) > DECIDED_SE * self.spread


def _best_on(result: CellResult, figure: str) -> str:
    cost = _COSTS[figure]
    return min(result.metrics, key=lambda name: cost(result.metrics[name]))


def run_by_run(per_seed: Mapping[int, Mapping[int, Sequence[CellResult]]]) -> list[RunByRun]:
    """Every figure on which the default fails a cell with the seeds (and draws) pooled, against
    the policy it fails against, read in each run."""
    draws = list(next(iter(per_seed.values())))
    pooled_seeds = {
        draw: pool_seeds({seed: runs[draw] for seed, runs in per_seed.items()}) for draw in draws
    }
    by_cell = [{r.cell: r for r in runs[draw]} for runs in per_seed.values() for draw in draws]
    rows = []
    for result in _judged_pooled(pooled_seeds):
        verdict = default_verdict(result)
        if verdict is None or verdict.passed:
            continue
        ours = result.metrics[DEFAULT_POLICY]
        failures = []
        for figure, cost in _COSTS.items():
            best = _best_on(result, figure)
            if cost(ours) > PASS_RATIO * cost(result.metrics[best]):
                failures.append((figure, best, PASS_RATIO))
        failures += [(f, GIE_DEFAULT, 1.0) for f in trails_gie_default(result, DEFAULT_POLICY)]
        for figure, reference, bar in failures:
            cost = _COSTS[figure]
            logs = []
            for cells in by_cell:
                run = cells.get(result.cell)
                if run is None or reference not in run.metrics or DEFAULT_POLICY not in run.metrics:
                    continue
                mine, theirs = cost(run.metrics[DEFAULT_POLICY]), cost(run.metrics[reference])
                if 0.0 < mine < math.inf and 0.0 < theirs < math.inf:
                    logs.append(math.log(mine / theirs))
            if len(logs) < 2:
                continue
            rows.append(
                RunByRun(
                    result.cell.label,
                    figure,
                    reference,
                    bar,
                    _ratio(cost(ours), cost(result.metrics[reference])),
                    math.exp(statistics.fmean(logs)),
                    statistics.stdev(logs) / math.sqrt(len(logs)),
                    sum(x > math.log(bar) for x in logs),
                    len(logs),
                )
            )
    return rows


def _decided_by_runs(runs: Sequence[RunByRun], cell: str) -> str:
    """The figures of ``cell`` its runs decide, each with its reference and paired ratio, or
    "no"."""
    found = [r for r in runs if r.cell == cell and r.decided]
    return (
        "; ".join(
            f"{r.figure} against {r.reference} ({r.paired:.3f} ± {r.spread:.1%})" for r in found
        )
        or "no"
    )


def _run_by_run_lines(rows: Sequence[RunByRun], several: bool) -> list[str]:
    cells = len({row.cell for row in rows})
    decided = [row for row in rows if row.decided]
    lines = [
        "## The default's failures, run by run",
        "",
        f"Each figure on which the default fails a cell with the seeds"
        f"{' and draws' if several else ''} pooled ({len(rows)} "
        f"figures in {cells} cells), read in each run (one seed of one draw): the default's "
        "figure over the reference policy's, the GIE default's (bar 1: never worse) or the "
        f"best policy's on that figure in the pooled cell (bar {PASS_RATIO}), throughput as the "
        "reference's over the default's, so that above 1 is worse. *Paired*: the geometric "
        "mean of the runs' ratios, ± the standard error of its logarithm; *beyond the bar*: "
        f"the runs above the bar; *decided*: the paired ratio is above the bar by more than "
        f"{DECIDED_SE:g} standard errors. A failure not decided is within the runs' own "
        "spread: other tie-breaks and draws of the same policy could pass it. The runs of one "
        "draw replay the same requests, so the standard error counts them as more independent "
        "than they are, which makes a failure look decided sooner, not later.",
        "",
        f"{len(decided)} of the {len(rows)} figures are decided, in "
        f"{len({row.cell for row in decided})} cells; the other "
        f"{len(rows) - len(decided)} are within the runs' spread.",
        "",
    ]
    if not rows:
        return lines
    lines += [
        "| cell | split | figure | against | bar | pooled | paired | beyond the bar | decided |",
        "|---|---|---|---|---:|---:|---|---:|---|",
    ]
    for row in rows:
        family = row.cell.split(" / ", 1)[0]
        lines.append(
            f"| {row.cell} | {FAMILIES[family].split} | {row.figure} | {row.reference} "
            f"| {row.bar:g} | {row.pooled:.4f} | {row.paired:.4f} ± {row.spread:.2%} "
            f"| {row.beyond} of {row.runs} | {'yes' if row.decided else 'no'} |"
        )
    lines.append("")
    return lines


def seeds_report(
    title: str, command: str, per_seed: Mapping[int, Mapping[int, Sequence[CellResult]]]
) -> str:
    """Markdown: how much of the default's verdict is the policies' tie-breaks."""
    seeds = list(per_seed)
    draws = list(per_seed[seeds[0]])
    several = len(draws) > 1
    verdicts = seed_verdicts(per_seed)
    lines = [
        f"# {title}: {len(seeds)} policy seeds",
        "",
        f"Command: `{command}`",
        "",
        "Every policy ran once per seed on every cell; the seeds differ only in the policies' "
        "tie-breaks and random picks (the simulator has no other randomness). Each seed's "
        "figures are in `seed-N/`; the reports beside this one are the seeds pooled. A verdict "
        "that changes with the seed is decided by tie-breaks, not by the policy.",
        "",
        "## The default's verdict under each seed",
        "",
        "| seeds | "
        + " | ".join(f"pass, draw {d}" for d in draws)
        + (" | pass, draws pooled | no policy passes, pooled |" if several else " |")
        + " worst TTFT mean | worst TTFT p90 | worst best ÷ throughput |",
        "|---|" + "---:|" * (len(draws) + (2 if several else 0)) + "---|---|---|",
    ]
    for row in verdicts:
        label = "pooled" if row.seed is None else str(row.seed)
        tail = f" | {row.passed_pooled} | {row.nobody_passes_pooled} |" if several else " |"
        worst = " – | – | – |"
        if row.worst is not None:
            worst = "".join(f" {value:.3f} ({cell}) |" for value, cell in row.worst)
        lines.append(f"| {label} | " + " | ".join(map(str, row.passed)) + tail + worst)
    own = [set(row.failed) for row in verdicts if row.seed is not None]
    always, sometimes = set.intersection(*own), set.union(*own)
    where = "with the draws pooled" if several else "in the draw"
    lines += [
        "",
        f"## Cells whose verdict is the seed's ({where})",
        "",
        f"The default fails {len(always)} cells under every seed and {len(sometimes)} under "
        f"at least one: {len(sometimes - always)} cells pass or fail by the seed alone.",
        "",
    ]
    if sometimes - always:
        lines += ["| cell | split | fails under seeds |", "|---|---|---|"]
        for label in sorted(sometimes - always):
            failing = [str(s) for s, failed in zip(seeds, own, strict=True) if label in failed]
            family = label.split(" / ", 1)[0]
            lines.append(f"| {label} | {FAMILIES[family].split} | {', '.join(failing)} |")
        lines.append("")
    lines += _run_by_run_lines(run_by_run(per_seed), several)
    lines += [
        "## Each policy against itself",
        "",
        "Cell runs (one cell in one draw) where the policy's runs under the seeds are more than "
        f"{SEED_SPREAD - 1:.0%} apart on TTFT mean, TTFT p90 or output throughput (the largest "
        "over the smallest), the same over the cells with the draws pooled, and the cell where "
        "they are furthest apart. A policy with no ties to break gives the same runs.",
        "",
        "| policy | cell runs | more than 5% apart | cells, draws pooled | more than 5% apart "
        "| furthest apart (pooled) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for spread in self_spreads(per_seed):
        furthest = (
            f"{spread.largest:.2f}x ({spread.largest_cell})" if spread.largest_cell else "1.00x"
        )
        lines.append(
            f"| {spread.policy} | {spread.cell_runs} | {spread.spread_runs} | {spread.cells} "
            f"| {spread.spread_pooled} | {furthest} |"
        )
    return "\n".join(lines) + "\n"


def seeds_json(
    command: str, per_seed: Mapping[int, Mapping[int, Sequence[CellResult]]]
) -> dict[str, Any]:
    return {
        "command": command,
        "seeds": list(per_seed),
        "draws": list(next(iter(per_seed.values()))),
        "verdicts": [_slots(row) for row in seed_verdicts(per_seed)],
        "self_spread": [_slots(row) for row in self_spreads(per_seed)],
        "run_by_run": [{**_slots(row), "decided": row.decided} for row in run_by_run(per_seed)],
    }
