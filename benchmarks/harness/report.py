"""Results: per-policy metrics, the trace's hit-ratio bounds, Markdown, JSON and PNG plots.

Why the bounds: a token hit ratio means little alone. Two figures computed from the trace
put it in context, both with the engines' own rules (block keys of ``block_size`` tokens, the
last prompt token always recomputed):

- *unbounded*: one cache that never forgets and sees every request (all reuse in the trace);
- *pooled LRU*: one LRU cache as large as the whole cluster's KV capacity. A router spreads the
  same memory over separate endpoints and cannot share blocks between them, so this is the
  practical ceiling for any router (LRU is not an optimal policy, so a lucky split could in
  principle edge past it; a policy above it would deserve a look).

Latencies are model seconds (offline) or converted from wall time (live, divided by the time
scale). Percentiles are nearest-rank: the ``ceil(p * n)``-th smallest value.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kv_picker_bench.harness.floors import ideal_caches
from kv_picker_bench.harness.simulator import (
    ERROR,
    OK,
    REJECTED,
    SHED,
    ClusterConfig,
    RequestOutcome,
    SimulationResult,
)
from kv_picker_bench.harness.stats import latency_stats
from kv_picker_bench.harness.traces import Trace

# ----------------------------------------------------------------------------- bounds


def hit_ratio_bounds(trace: Trace, config: ClusterConfig) -> dict[str, float]:
    """Token hit ratios of an unbounded single cache and of a pooled LRU of the cluster's size
    (:func:`~kv_picker_bench.harness.floors.ideal_caches`)."""
    return ideal_caches(trace, config).hit_ratios()


# ---------------------------------------------------------------------------- metrics


@dataclass(slots=True)
class PolicyMetrics:
    """The figures of one policy's run (also the row of the Markdown table)."""

    policy: str
    requests: int
    ok: int
    rejected: int
    shed: int
    errors: int
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    e2e_s: dict[str, float]
    output_tokens_per_s: float
    requests_per_s: float
    sustained_tokens_per_s: float
    hit_ratio: float
    imbalance: float
    imbalance_busy: float
    transferred_tokens: int
    transferred_bytes: float
    makespan_s: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def _max_over_mean(values: Sequence[float]) -> float:
    if not values:
        return math.nan
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else math.nan


def sustained_tokens_per_s(outcomes: Sequence[RequestOutcome]) -> float:
    """Output tokens per second produced while requests arrive (first to last arrival).

    Why not total tokens over the makespan: once arrivals stop, the makespan is the drain of
    the slowest stragglers (one long answer decoding on a slow endpoint can double it), so it
    measures the tail, not the rate a policy sustains under the offered load. A request's
    tokens are taken as produced evenly from its first token to its finish.
    """
    if not outcomes:
        return 0.0
    start_s = min(o.arrival_s for o in outcomes)
    end_s = max(o.arrival_s for o in outcomes)
    if not end_s > start_s:
        return 0.0
    produced = 0.0
    for o in outcomes:
        if o.status != OK or not o.output_tokens:
            continue
        first_s, finish_s = o.first_token_s, o.finish_s
        if start_s <= first_s <= end_s:
            produced += 1
        rest = o.output_tokens - 1
        if rest > 0 and finish_s > first_s:
            overlap_s = min(finish_s, end_s) - max(first_s, start_s)
            if overlap_s > 0:
                produced += rest * overlap_s / (finish_s - first_s)
    return produced / (end_s - start_s)


def summarize(result: SimulationResult, config: ClusterConfig) -> PolicyMetrics:
    """Per-policy metrics of an offline run."""
    outcomes = result.outcomes
    ok = [o for o in outcomes if o.status == OK]
    serving = [i for i, e in enumerate(config.endpoints) if e.role != "prefill"]
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    transferred = sum(o.transferred_tokens for o in ok)
    makespan_s = result.makespan_s
    return PolicyMetrics(
        policy=result.policy,
        requests=len(outcomes),
        ok=len(ok),
        rejected=sum(o.status == REJECTED for o in outcomes),
        shed=sum(o.status == SHED for o in outcomes),
        errors=sum(o.status == ERROR for o in outcomes),
        ttft_s=latency_stats(o.ttft_s for o in ok),
        tpot_s=latency_stats(o.tpot_s for o in ok),
        e2e_s=latency_stats(o.e2e_s for o in ok),
        output_tokens_per_s=output_tokens / makespan_s if makespan_s > 0 else 0.0,
        requests_per_s=len(ok) / makespan_s if makespan_s > 0 else 0.0,
        sustained_tokens_per_s=sustained_tokens_per_s(outcomes),
        hit_ratio=sum(o.cached_tokens for o in ok) / prompt_tokens if prompt_tokens else 0.0,
        imbalance=_max_over_mean([result.endpoints[i].requests for i in serving]),
        imbalance_busy=_max_over_mean([e.busy_s for e in result.endpoints]),
        transferred_tokens=transferred,
        transferred_bytes=float(transferred * config.kv_bytes_per_token),
        makespan_s=makespan_s,
        wall_s=result.wall_s,
        extra={
            "events": result.num_events,
            "schedule_calls": result.num_schedule_calls,
            "errors_sample": sorted({o.detail for o in outcomes if o.status != OK})[:5],
            **result.extra,
        },
    )


# ----------------------------------------------------------------------------- tables


def format_tokens(count: float) -> str:
    """``8.4M``, ``524k``, ``960``: token counts at a glance."""
    if count >= 1e6:
        return f"{count / 1e6:.1f}M"
    if count >= 1e3:
        return f"{count / 1e3:.0f}k"
    return f"{count:.0f}"


def _fmt(value: float, scale: float = 1.0, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value * scale:.{digits}f}"


def _quad(stats: Mapping[str, float], scale: float = 1.0, digits: int = 2) -> str:
    return " / ".join(_fmt(stats[k], scale, digits) for k in ("mean", "p50", "p90", "p99"))


def markdown_table(
    rows: Sequence[PolicyMetrics],
    bounds: Mapping[str, float] | None,
    floors: Mapping[str, Mapping[str, float]] | None = None,
) -> str:
    """One row per policy; latency cells are mean / p50 / p90 / p99.

    Args:
        rows: the policies' metrics.
        bounds: the trace's hit-ratio bounds (two rows at the end).
        floors: the zero-queue TTFT floors' statistics, ``strict`` and ``practical``
            (:mod:`~kv_picker_bench.harness.floors`): two more rows, and each policy's TTFT
            over the practical floor (mean to mean, p90 to p90).
    """
    practical = floors["practical"] if floors else None
    lines = [
        "| policy | ok | errors | shed | TTFT s (mean / p50 / p90 / p99) "
        + ("| TTFT ÷ floor (mean / p90) " if practical else "")
        + "| TPOT ms (mean / p50 / p90 / p99) | E2E s (mean / p50 / p90 / p99) "
        "| output tok/s | token hit ratio | imbalance (max/mean) | P/D transfer GB |",
        "|---|---:|---:|---:|---|" + ("---|" if practical else "") + "---|---|---:|---:|---:|---:|",
    ]
    gap = "| " if practical else ""
    for row in rows:
        to_floor = ""
        if practical:
            mean = row.ttft_s["mean"] / practical["mean"] if practical["mean"] > 0 else math.nan
            p90 = row.ttft_s["p90"] / practical["p90"] if practical["p90"] > 0 else math.nan
            to_floor = f"| {_fmt(mean)} / {_fmt(p90)} "
        lines.append(
            f"| {row.policy} | {row.ok} | {row.errors + row.rejected} | {row.shed} "
            f"| {_quad(row.ttft_s)} {to_floor}| {_quad(row.tpot_s, 1000.0, 1)} "
            f"| {_quad(row.e2e_s)} "
            f"| {row.output_tokens_per_s:,.0f} | {row.hit_ratio:.3f} | {_fmt(row.imbalance)} "
            f"| {row.transferred_bytes / 1e9:.1f} |"
        )
    if floors:
        for name, label in (("practical", "pooled LRU"), ("strict", "unbounded cache")):
            lines.append(
                f"| *floor: zero queue, {label}* | | | | {_quad(floors[name])} {gap}| | | | | | |"
            )
    if bounds:
        lines.append(
            f"| *bound: unbounded single cache* | | | | {gap}| | | | {bounds['unbounded']:.3f} "
            "| | |"
        )
        lines.append(
            f"| *bound: pooled LRU ({format_tokens(bounds['pooled_capacity_tokens'])} tokens)* "
            f"| | | | {gap}| | | | {bounds['pooled_lru']:.3f} | | |"
        )
    return "\n".join(lines)


def describe_cluster(config: ClusterConfig) -> str:
    counts: dict[tuple[str, str, int], int] = {}
    for i, setup in enumerate(config.endpoints):
        key = (setup.role, setup.hardware, config.capacity_blocks(i))
        counts[key] = counts.get(key, 0) + 1
    parts = [
        f"{n} × {hw} {role} ({format_tokens(blocks * config.block_size)} tokens KV)"
        for (role, hw, blocks), n in counts.items()
    ]
    return (
        ", ".join(parts) + f"; block {config.block_size} tokens, max_num_seqs "
        f"{config.max_num_seqs}, max_num_batched_tokens {config.max_num_batched_tokens}, "
        f"scrape every {config.scrape_interval_s * 1000:g} ms"
    )


def cluster_json(config: ClusterConfig) -> dict[str, Any]:
    return {
        "endpoints": [
            {"role": e.role, "hardware": e.hardware, "num_gpu_blocks": config.capacity_blocks(i)}
            for i, e in enumerate(config.endpoints)
        ],
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": config.max_model_len,
        # The profile's name says which sourced figures produced the results; its numbers are
        # kept as well, so a result stays readable if a profile is later re-derived. Units keep
        # them clear of write_json's rounding to six decimals.
        "timing": {
            "profile": config.timing.name,
            "step_base_ms": config.timing.step_base_s * 1e3,
            "step_per_seq_us": config.timing.step_per_seq_s * 1e6,
            "prefill_us_per_token": config.timing.prefill_s_per_token * 1e6,
            "attention_ns_per_token_pair": config.timing.attention_s_per_token_pair * 1e9,
            "kv_read_ns_per_token": config.timing.kv_read_s_per_token * 1e9,
        },
        "scrape_interval_s": config.scrape_interval_s,
        "kv_event_delay_s": config.kv_event_delay_s,
        "cached_when": config.cached_when,
        "transfer_latency_s": config.transfer_latency_s,
        "transfer_bytes_per_s": config.transfer_bytes_per_s,
        "kv_bytes_per_token": config.kv_bytes_per_token,
    }


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else round(value, 6)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def stored_precision(value: Any) -> Any:
    """A value (a float, or dicts and lists of them) as :func:`write_json` stores it: floats
    to six decimals, NaN and infinities as None."""
    return _clean(value)


def at_stored_precision(metrics: PolicyMetrics) -> PolicyMetrics:
    """The figures as :func:`write_json` stores them (six decimals, NaN as None).

    A verdict on these is the verdict anyone re-reading the stored report gets: two policies
    whose TTFT p90 differ by float summation order alone are a tie here, as in the file.
    """
    return PolicyMetrics(**_clean(metrics.to_json()))


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    """A report's figures as JSON; gzip-compressed when ``path`` ends in ``.gz`` (no name or
    time in the gzip header, so the same figures give the same bytes)."""
    text = json.dumps(_clean(dict(document)), indent=2) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
    else:
        path.write_text(text, encoding="utf-8")


def read_json(path: Path) -> Any:
    """A document :func:`write_json` wrote, plain or gzip-compressed (by its ``.gz`` name).

    Raises:
        OSError: unreadable, or not gzip although named ``.gz``.
        EOFError: a ``.gz`` file cut short.
        ValueError: not JSON (or not UTF-8).
    """
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return json.loads(raw.decode("utf-8"))


# ------------------------------------------------------------------------------ plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(
    latencies: Mapping[str, Sequence[float]],
    path: Path,
    title: str,
    xlabel: str,
    floor: Sequence[float] | None = None,
) -> None:
    """Empirical CDF per policy on a log x axis (and the zero-queue floor's, dashed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    series = [(name, values, "-") for name, values in latencies.items()]
    if floor is not None:
        series.append(("floor: zero queue, pooled LRU", floor, "--"))
    for name, values, style in series:
        ordered = sorted(v for v in values if not math.isnan(v) and v > 0)
        if not ordered:
            continue
        count = len(ordered)
        color = "black" if style == "--" else None
        ax.plot(ordered, [(i + 1) / count for i in range(count)], style, label=name,
                linewidth=1.4, color=color)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bars(
    rows: Sequence[PolicyMetrics], bounds: Mapping[str, float] | None, path: Path
) -> None:
    """Token hit ratio (with the trace's bounds) and load imbalance per policy."""
    plt = _pyplot()
    names = [r.policy for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=100)
    left.bar(names, [r.hit_ratio for r in rows], color="tab:blue")
    if bounds:
        left.axhline(bounds["unbounded"], color="tab:red", linestyle="--", label="unbounded cache")
        left.axhline(bounds["pooled_lru"], color="tab:orange", linestyle=":", label="pooled LRU")
        left.legend(fontsize=8)
    left.set_ylabel("token hit ratio")
    left.set_title("prefix-cache token hit ratio")
    right.bar(names, [r.imbalance for r in rows], color="tab:green")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_ylabel("max / mean requests per endpoint")
    right.set_title("load imbalance")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=35, labelsize=8)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_load_curve(
    by_load: Mapping[float, Sequence[PolicyMetrics]], path: Path, rates: Mapping[float, float]
) -> None:
    """TTFT (mean and p90) against offered load, one line per policy."""
    plt = _pyplot()
    loads = sorted(by_load)
    names = [r.policy for r in by_load[loads[0]]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=100)
    xs = [rates.get(load, load) for load in loads]
    for name in names:
        rows = [next(r for r in by_load[load] if r.policy == name) for load in loads]
        left.plot(xs, [r.ttft_s["mean"] for r in rows], marker="o", label=name)
        right.plot(xs, [r.ttft_s["p90"] for r in rows], marker="o", label=name)
    for ax, what in ((left, "mean"), (right, "p90")):
        ax.set_yscale("log")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(f"TTFT {what} (s)")
        ax.grid(True, which="both", alpha=0.3)
    left.set_title("TTFT vs offered load (mean)")
    right.set_title("TTFT vs offered load (p90)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
