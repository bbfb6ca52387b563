"""``kv-picker bench moves``: which requests a policy placed away from the endpoint holding their
context, and which of its scorers voted for that.

A cache-aware policy loses most where it recomputes a long context that another endpoint
already holds: a 50,000-token document costs seconds of prefill. This replays one cell of the
routing matrix (a family's draw, a load, a cluster shape, a timing profile) with one policy,
routing every request with ``explain`` so each scorer's scores are kept, and compares each pick
with the truth the simulator knows: how many of the request's leading prompt blocks each
endpoint holds in its cache or is computing for a request already there.

A *move* is a pick whose endpoint holds at least ``--min-tokens`` fewer of the prompt's tokens
than the endpoint holding the most (the *holder*). For each move the report gives what the
picker saw at the holder (its prefix match, which stops at the prefix scorer's
``maxPrefixBlocksToMatch``), each scorer's weighted score at the pick minus at the holder
(positive: it voted for the move), and the request's TTFT. The summary counts, per scorer, the
moves it voted for and its summed margin, and the moves where the picker saw less at the holder
than the holder had.

When the policy has a ``predicted-latency-scorer``, the report also says how far its estimate
was from what happened: for every request, the TTFT it predicted at the endpoint picked (before
the pick changed that endpoint's accounting) against the TTFT measured there, grouped by what
the estimate stood on at the pick: a prefix match cut short by ``maxPrefixBlocksToMatch`` at the
pick (the rest of the prompt counted as uncached, whatever the endpoint held), prefill of
earlier requests queued there, or neither.

The holder is the best of the endpoints the primary profile's scorers ranked (a filter may
have removed others). On the P/D pool the policy runs under the P/D profile handler, as in the
matrix: the pick is the decode endpoint (the primary profile's), the holder the decode endpoint
holding the most, the latency estimate the decode profile's at the pick, and the report also
counts the requests the handler sent through the prefill pool.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kv_picker.director import RoutedRequest
from kv_picker.endpoint import Endpoint
from kv_picker.errors import ConfigError
from kv_picker.request import LLMRequest
from kv_picker.scheduling.signals import PREFIX_MATCH, PrefixMatch
from kv_picker.scorers.predicted_latency import PredictedLatencyScorer
from kv_picker.state.endpoints import EndpointStore
from kv_picker_bench.client import percentile
from kv_picker_bench.harness.matrix import (
    CLUSTERS,
    DEFAULT_FAMILY_SEED,
    DEFAULT_POLICY,
    cell_workload,
)
from kv_picker_bench.harness.policies import (
    Policy,
    harness_registry,
    pd_variant,
    resolve_policy,
)
from kv_picker_bench.harness.simulator import OK, ClusterSimulator
from kv_picker_bench.harness.traces import TraceError, TraceRequest
from kv_picker_bench.sim.engine import CACHED_WHEN


@dataclass(slots=True)
class Move:
    """One request placed away from the endpoint holding the most of its prompt."""

    index: int
    arrival_s: float
    prompt_tokens: int
    holder: int
    pick: int
    holder_tokens: int  # held or being computed at the holder, in tokens
    pick_tokens: int
    seen_at_holder: float  # the picker's prefix match at the holder, in tokens (nan: no match)
    margins: dict[str, float]  # scorer -> weighted score at the pick minus at the holder
    ttft_s: float = math.nan

    @property
    def recomputed(self) -> int:
        return self.holder_tokens - self.pick_tokens


@dataclass(slots=True)
class ScorerVotes:
    """One scorer's part in the moves: how many it voted for, and by how much."""

    scorer: str
    weight: float
    for_move: int = 0
    margin_sum: float = 0.0


@dataclass(slots=True)
class Calibration:
    """The latency estimate against the TTFT measured, over one group of picks."""

    group: str
    requests: int
    ratio_p10: float  # measured / predicted TTFT
    ratio_median: float
    ratio_p90: float
    predicted_mean_s: float
    measured_mean_s: float


# The groups of picks, by what the estimate stood on at the pick (module docstring).
CAPPED, QUEUED, NEITHER = "match capped at the pick", "prefill queued at the pick", "neither"


@dataclass(slots=True)
class MovesReport:
    policy: str
    cell: str
    draw: int
    min_tokens: int
    requests: int
    uncached_tokens: int
    moves: list[Move]
    votes: list[ScorerVotes] = field(default_factory=list)
    ttft_mean_moved_s: float = math.nan
    ttft_mean_other_s: float = math.nan
    calibration: list[Calibration] = field(default_factory=list)
    disaggregated: int | None = None  # on the P/D pool: requests prefilled on the prefill pool

    @property
    def recomputed(self) -> int:
        return sum(m.recomputed for m in self.moves)

    @property
    def unseen(self) -> int:
        """Moves where the picker's match saw less at the holder than it held."""
        return sum(1 for m in self.moves if not m.seen_at_holder >= m.holder_tokens)


def _weights(policy: Policy, profile: str) -> dict[str, float]:
    config = policy.config(harness_registry())
    for entry in config.profiles:
        if entry.name == profile:
            return {e.plugin_ref: e.weight for e in entry.entries}
    return {}


def find_moves(
    cell_text: str,
    policy: Policy,
    draw: int = DEFAULT_FAMILY_SEED,
    min_tokens: int = 4096,
    responses: str = "full",
    seed: int = 0,
    quick: bool = False,
    cached_when: str = CACHED_WHEN[0],
) -> MovesReport:
    """Replay one matrix cell with ``policy`` and collect its moves (module docstring).

    Raises:
        ConfigError: a bad cell, policy or threshold.
        TraceError: the family cannot build its trace.
    """
    if min_tokens < 1:
        raise ConfigError(f"--min-tokens must be at least 1, not {min_tokens}")
    cell, trace, config, _ = cell_workload(cell_text, draw, responses, quick, cached_when)
    # On the P/D pool the matrix runs the policy under the P/D profile handler.
    pd = CLUSTERS[cell.cluster].pd
    run = pd_variant(policy) if pd else policy
    block = config.block_size
    moves: list[Move] = []
    weights: dict[str, dict[str, float]] = {}

    # request id -> (endpoint id -> the latency estimate there, and whether prefill was queued)
    estimates: dict[int, dict[int, tuple[float, bool]]] = {}
    # trace index -> (predicted TTFT at the pick, its group)
    predicted: dict[int, tuple[float, str]] = {}

    disaggregated = 0

    def observe(request: TraceRequest, routed: RoutedRequest, held: list[int]) -> None:
        nonlocal disaggregated
        if routed.prefill_endpoint is not None:
            disaggregated += 1
        result = routed.result
        estimate = estimates.pop(id(routed.request), {}).get(routed.endpoint.id)
        if estimate is not None and result is not None:
            match = (result.signals or {}).get(PREFIX_MATCH)
            capped = (
                isinstance(match, PrefixMatch)
                and match.capped
                and match.matched_blocks.get(routed.endpoint.id, 0) >= match.total_blocks
            )
            predicted[request.index] = (
                estimate[0],
                CAPPED if capped else QUEUED if estimate[1] else NEITHER,
            )
        if result is None or not held:
            return
        primary = result.primary
        ids = [e.id for e in primary.candidates]
        pick = routed.endpoint.id
        # The holder among the endpoints the scorers ranked (filters may have removed others).
        holder = max(ids, key=lambda e: (held[e], e == pick))
        holder_tokens = min(held[holder] * block, request.input_tokens)
        pick_tokens = min(held[pick] * block, request.input_tokens)
        if holder_tokens - pick_tokens < min_tokens:
            return
        profile = result.primary_profile
        if profile not in weights:
            weights[profile] = _weights(run, profile)
        margins: dict[str, float] = {}
        if primary.breakdown is not None:
            at_pick, at_holder = ids.index(pick), ids.index(holder)
            for scorer, scores in primary.breakdown.items():
                w = weights[profile].get(scorer, 1.0)
                margins[scorer] = w * (scores[at_pick] - scores[at_holder])
        match = (result.signals or {}).get(PREFIX_MATCH)
        seen = match.cached_tokens(holder) if isinstance(match, PrefixMatch) else math.nan
        moves.append(
            Move(
                request.index,
                request.arrival_s,
                request.input_tokens,
                holder,
                pick,
                holder_tokens,
                pick_tokens,
                seen,
                margins,
            )
        )

    simulator = ClusterSimulator(
        trace, config, run.config(harness_registry()), harness_registry(), run.name, seed,
        needs_prompt=run.needs_prompt, on_route=observe,
    )  # fmt: skip
    store = simulator.store
    for plugin in simulator.scheduler.plugins.values():
        if isinstance(plugin, PredictedLatencyScorer):
            plugin.score = _recording(plugin, store, estimates)  # type: ignore[method-assign,assignment]
    result = simulator.run()
    ttft = {o.index: o.ttft_s for o in result.outcomes if o.status == OK}
    moved = {m.index for m in moves}
    for m in moves:
        m.ttft_s = ttft.get(m.index, math.nan)
    report = MovesReport(
        policy.name,
        cell.label,
        draw,
        min_tokens,
        len(result.outcomes),
        sum(o.prompt_tokens - o.cached_tokens for o in result.outcomes if o.status == OK),
        moves,
        disaggregated=disaggregated if pd else None,
    )
    profile_weights = next(iter(weights.values()), _weights(run, "default"))
    votes = {name: ScorerVotes(name, w) for name, w in profile_weights.items()}
    for m in moves:
        for scorer, margin in m.margins.items():
            vote = votes.setdefault(scorer, ScorerVotes(scorer, 1.0))
            if margin > 0:
                vote.for_move += 1
            vote.margin_sum += margin
    report.votes = [v for v in votes.values() if any(v.scorer in m.margins for m in moves)]
    report.calibration = _calibration(predicted, ttft)
    moved_ttft = [t for i, t in ttft.items() if i in moved]
    other_ttft = [t for i, t in ttft.items() if i not in moved]
    if moved_ttft:
        report.ttft_mean_moved_s = sum(moved_ttft) / len(moved_ttft)
    if other_ttft:
        report.ttft_mean_other_s = sum(other_ttft) / len(other_ttft)
    return report


def _recording(
    scorer: PredictedLatencyScorer,
    store: EndpointStore,
    estimates: dict[int, dict[int, tuple[float, bool]]],
) -> Callable[[LLMRequest, Sequence[Endpoint], list[float]], None]:
    """``scorer.score`` that first keeps its estimate at every candidate, as it stands before
    the pick, for the report."""
    score = scorer.score

    def recording(request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        # Under P/D both profiles score the request, each over its own pool: keep both.
        estimates.setdefault(id(request), {}).update(
            (e.id, (scorer.predict_ttft_s(request, e), store.prefill_tokens[e.id] > 0))
            for e in candidates
        )
        score(request, candidates, out)

    return recording


def _calibration(
    predicted: dict[int, tuple[float, str]], ttft: dict[int, float]
) -> list[Calibration]:
    groups: dict[str, list[tuple[float, float]]] = {CAPPED: [], QUEUED: [], NEITHER: []}
    for index, (estimate, group) in predicted.items():
        measured = ttft.get(index)
        if measured is not None and estimate > 0:
            groups[group].append((estimate, measured))
    out = []
    for group, pairs in groups.items():
        if not pairs:
            continue
        ratios = [m / e for e, m in pairs]
        out.append(
            Calibration(
                group,
                len(pairs),
                percentile(ratios, 0.1),
                percentile(ratios, 0.5),
                percentile(ratios, 0.9),
                sum(e for e, _ in pairs) / len(pairs),
                sum(m for _, m in pairs) / len(pairs),
            )
        )
    return out


def _tokens(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:,.0f}"


def _biggest(biggest: list[Move], scorers: list[str]) -> list[str]:
    lines = [
        "",
        f"The {len(biggest)} largest moves by tokens recomputed (endpoints by index):",
        "",
        "| request | arrival s | prompt | holder: held / seen | pick: held | recomputed | TTFT s | "
        + " | ".join(scorers)
        + " |",
        "|---:|---:|---:|---|---|---:|---:|" + "---:|" * len(scorers),
    ]
    for m in biggest:
        cells = [f"{m.margins[s]:+.2f}" if s in m.margins else "–" for s in scorers]
        lines.append(
            f"| {m.index} | {m.arrival_s:.2f} | {m.prompt_tokens:,} | {m.holder}: "
            f"{m.holder_tokens:,} / {_tokens(m.seen_at_holder)} | {m.pick}: {m.pick_tokens:,} | "
            f"{m.recomputed:,} | {m.ttft_s:.2f} | " + " | ".join(cells) + " |"
        )
    return lines


def markdown(report: MovesReport, command: str, top: int) -> str:
    lines = [
        f"# Moves off the holder: `{report.policy}` on {report.cell}, draw {report.draw}",
        "",
        f"Command: `{command}`",
        "",
        f"{report.requests} requests. **{len(report.moves)} moves**: picks on an endpoint holding "
        f"at least {report.min_tokens:,} fewer of the request's prompt tokens than the endpoint "
        "holding the most (held: cached, or being computed for a request already there). They "
        f"recompute {report.recomputed:,} tokens; the run's uncached prompt tokens are "
        f"{report.uncached_tokens:,}. TTFT mean of the moved requests "
        f"{report.ttft_mean_moved_s:.2f} s, of the others {report.ttft_mean_other_s:.2f} s.",
        "",
        f"In {report.unseen} of the moves the picker's prefix match saw less at the holder than "
        "the holder had (its match stops at `maxPrefixBlocksToMatch`, or the index lagged)."
        + (
            ""
            if report.disaggregated is None
            else f" P/D: {report.disaggregated} of the {report.requests} requests were prefilled "
            "on the prefill pool; the picks and holders here are decode endpoints, and a move of "
            "such a request receives its tokens from the prefill pool rather than computing them."
        ),
        "",
        "Each scorer's vote: its weighted score at the pick minus at the holder, summed over the "
        "moves; *for the move* counts the moves where that difference is positive.",
        "",
        "| scorer | weight | for the move | weighted margin, sum | mean per move |",
        "|---|---:|---:|---:|---:|",
    ]
    for v in report.votes:
        mean = v.margin_sum / len(report.moves) if report.moves else 0.0
        lines.append(
            f"| {v.scorer} | {v.weight:g} | {v.for_move} | {v.margin_sum:+.2f} | {mean:+.3f} |"
        )
    scorers = [v.scorer for v in report.votes]
    biggest = sorted(report.moves, key=lambda m: -m.recomputed)[:top]
    if biggest:
        lines += _biggest(biggest, scorers)
    if report.calibration:
        lines += [
            "",
            "The latency estimate against what happened: for every request, the TTFT "
            "`predicted-latency-scorer` predicted at the endpoint picked (before the pick) and "
            "the TTFT measured there, grouped by what the estimate stood on at the pick (a prefix "
            "match cut short by `maxPrefixBlocksToMatch` counts the rest of the prompt as "
            "uncached there):",
            "",
            "| at the pick | requests | measured ÷ predicted: p10 / median / p90 | "
            "predicted mean s | measured mean s |",
            "|---|---:|---|---:|---:|",
        ]
        for c in report.calibration:
            lines.append(
                f"| {c.group} | {c.requests} | {c.ratio_p10:.2f} / {c.ratio_median:.2f} / "
                f"{c.ratio_p90:.2f} | {c.predicted_mean_s:.3f} | {c.measured_mean_s:.3f} |"
            )
    return "\n".join(lines) + "\n"


def to_json(report: MovesReport, command: str) -> dict[str, Any]:
    data = asdict(report)
    data["command"] = command
    data["recomputed"] = report.recomputed
    data["unseen"] = report.unseen
    for move in data["moves"]:
        move["recomputed"] = move["holder_tokens"] - move["pick_tokens"]
    return data


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench moves",
        description="Replay one routing-matrix cell with one policy and list the requests it "
        "placed away from the endpoint holding their context, with each scorer's vote.",
    )
    parser.add_argument(
        "cell", help="family/load/cluster/timing, e.g. long-doc-qa/0.3/small4/llama-3.1-8b-h100"
    )
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY, help="a baseline name, NAME=FILE.yaml or FILE.yaml "
        f"(default {DEFAULT_POLICY})",
    )  # fmt: skip
    parser.add_argument(
        "--family-seed", type=int, default=DEFAULT_FAMILY_SEED, help="the family's draw (1)"
    )
    parser.add_argument(
        "--min-tokens", type=int, default=4096,
        help="a move recomputes at least this many tokens the holder has (4096)",
    )  # fmt: skip
    parser.add_argument("--top", type=int, default=10, help="moves listed (10)")
    parser.add_argument(
        "--responses", choices=("full", "lean", "end-only"), default="full",
        help="what the gateway shows the picker of each response (see bench matrix --help)",
    )  # fmt: skip
    parser.add_argument(
        "--cached-when", choices=CACHED_WHEN, default=CACHED_WHEN[0],
        help="when a prompt block becomes a cache hit (see bench matrix --help; scheduled)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the policy's seed (0)")
    parser.add_argument("--quick", action="store_true", help="the matrix's small traces")
    parser.add_argument("--out", help="also write moves.md and moves.json into this folder")
    args = parser.parse_args(list(argv))
    command = "kv-picker bench moves " + shlex.join(list(argv))
    try:
        if args.top < 0:
            raise ConfigError(f"--top must be at least 0, not {args.top}")
        policy = resolve_policy(args.policy)
        report = find_moves(
            args.cell,
            policy,
            args.family_seed,
            args.min_tokens,
            args.responses,
            args.seed,
            args.quick,
            args.cached_when,
        )
    except (ConfigError, TraceError) as exc:
        print(f"kv-picker bench moves: error: {exc}", file=sys.stderr)
        return 2
    text = markdown(report, command, args.top)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "moves.md").write_text(text)
        data = _finite(to_json(report, command))
        (out / "moves.json").write_text(json.dumps(data, indent=2) + "\n")
    return 0
