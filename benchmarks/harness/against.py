"""``kv-picker bench matrix --against DIR``: judge candidate profiles as the default would be
judged, on a stored matrix, running only the candidates.

A full matrix runs every policy on every cell (minutes per draw on two cores); a candidate for
the default only needs its own runs, compared with the stored runs of the other policies. For
each stored draw (``DIR/matrix.json``, or ``DIR/draw-N/matrix.json`` for several draws; either
may be kept gzip-compressed as ``matrix.json.gz``), each ``--policy`` is run on the stored
cells and judged by the default's bar (TTFT mean and p90 within 5% of the best, throughput
within 5%, none worse than the GIE default) against the stored policies *other than the stored
default*, alone: candidates never compete with each other, and each is judged exactly as it
would be were it the default. The stored default is judged the same way, as the reference row.

Figures are compared at the stored precision (six decimals), as the matrix itself judges them
(:func:`~kv_picker_bench.harness.matrix.run_matrix` rounds each run's figures so): a verdict
here on the stored default is the stored verdict.

With several policy seeds, and the stored matrix's own runs of each seed kept beside its pooled
figures (``DIR/seed-N/draw-M/``, as a matrix run with several ``--seed`` writes them), each
seed is also judged alone: that seed's stored runs with the candidates' runs under the same
seed (:func:`per_seed_counts`), with each candidate's margins against the default on that
seed's runs. A pooled count moves by a few cells from seed to seed; the per-seed rows compare a
candidate with the default under the same tie-breaks, seed by seed.

The traces must be the ones the stored matrix replayed: every family's generator spec (and the
conversation window) is compared with the stored one, and a difference (another
``--family-seed``, ``--quick``) is refused before any run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kv_picker_bench.harness.args import UsageError
from kv_picker_bench.harness.matrix import (
    DEFAULT_POLICY,
    FAMILIES,
    HELD_OUT,
    TUNING,
    Cell,
    CellResult,
    MatrixPlan,
    cell_ratios,
    conversation_window,
    default_verdict,
    describe_passing,
    family_spec,
    geometric_mean,
    passing_policies,
    pooled_results,
    worst_judged_ratio,
)
from kv_picker_bench.harness.report import PolicyMetrics, at_stored_precision, read_json

STORED_NAMES = ("matrix.json", "matrix.json.gz")


def stored_figures(folder: Path) -> Path | None:
    """A folder's stored figures: ``matrix.json``, or ``matrix.json.gz`` (the same document,
    gzip-compressed, as large stored matrices are kept); None when it has neither."""
    for name in STORED_NAMES:
        if (folder / name).is_file():
            return folder / name
    return None


def stored_matrix_path(folder: Path, draw: int, draws: int) -> Path:
    """Where draw ``draw`` of a stored matrix is: ``draw-N/matrix.json`` (or ``.json.gz``), or
    ``matrix.json`` for a single-draw folder when only one draw is asked for."""
    nested = stored_figures(folder / f"draw-{draw}")
    if nested is not None:
        return nested
    flat = stored_figures(folder)
    if draws == 1 and flat is not None:
        return flat
    raise UsageError(
        f"no stored draw {draw} in {folder} "
        f"(expected {folder / f'draw-{draw}' / 'matrix.json'} or .json.gz)"
    )


def load_stored(path: Path, draw: int, quick: bool) -> dict[Cell, CellResult]:
    """A stored draw's cells, after checking it replayed the traces this run would.

    Raises:
        UsageError: unreadable, not a matrix, or other traces.
    """
    try:
        data = read_json(path)
        families = data["families"]
        seed = data["family_seed"]
        out = {}
        for item in data["cells"]:
            cell = Cell(item["family"], item["load"], item["cluster"], item["timing"])
            metrics = {name: PolicyMetrics(**m) for name, m in item["policies"].items()}
            out[cell] = CellResult(
                cell,
                item["requests"],
                item["rate_per_s"],
                metrics,
                item["floors"],
                item["hit_bounds"],
                item.get("prefill_load", math.nan),
                item.get("decode_load", math.nan),
            )
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{path} is not a stored matrix: {exc!r}") from None
    if seed != draw:
        raise UsageError(f"{path} is draw {seed}, not draw {draw}")
    for name, family in FAMILIES.items():
        stored = families.get(name, {}).get("spec") if isinstance(families, dict) else None
        wanted = family_spec(family, quick, draw)
        if stored is not None and stored != wanted:
            raise UsageError(
                f"{path} replayed {name} as {stored!r}; this run would replay "
                f"{wanted!r} (use the stored run's --family-seed and --quick)"
            )
    window = data.get("conversation_window_s")
    if window is not None and tuple(window) != conversation_window(draw):
        raise UsageError(f"{path} used another conversation window ({window})")
    return out


def stored_seeds(folder: Path, draws: Sequence[int]) -> list[int]:
    """The policy seeds a stored matrix's figures come from (``seeds`` in its ``matrix.json``;
    a matrix stored without them ran seed 0), the same for every draw asked for.

    Raises:
        UsageError: draws stored under different seeds.
    """
    found: dict[tuple[int, ...], int] = {}
    for draw in draws:
        path = stored_matrix_path(folder, draw, len(draws))
        try:
            seeds = tuple(int(seed) for seed in read_json(path).get("seeds", [0]))
        except (OSError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise UsageError(f"{path} is not a stored matrix: {exc!r}") from None
        found.setdefault(seeds, draw)
    if len(found) > 1:
        described = "; ".join(f"draw {d}: {', '.join(map(str, s))}" for s, d in found.items())
        raise UsageError(f"the stored draws ran under different policy seeds ({described})")
    return list(next(iter(found)))


def stored_cached_when(folder: Path, draws: Sequence[int], asked: str | None) -> str:
    """The engine model a stored matrix ran (``cached_when`` in its ``matrix.json``; a matrix
    stored without it ran ``computed``, the model before it was recorded), which the candidates
    must run too.

    Raises:
        UsageError: draws stored under different models, or ``asked`` (``--cached-when``) is
            another one.
    """
    found: dict[str, int] = {}
    for draw in draws:
        path = stored_matrix_path(folder, draw, len(draws))
        try:
            found.setdefault(str(read_json(path).get("cached_when", "computed")), draw)
        except (OSError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise UsageError(f"{path} is not a stored matrix: {exc!r}") from None
    if len(found) > 1:
        described = "; ".join(f"draw {d}: {m}" for m, d in found.items())
        raise UsageError(f"the stored draws ran different engine models ({described})")
    stored = next(iter(found))
    if asked is not None and asked != stored:
        raise UsageError(
            f"--cached-when {asked}: {folder} ran --cached-when {stored}; candidates are judged "
            "under the stored matrix's engine model (drop the flag, or give that one)"
        )
    return stored


def stored_seed_paths(
    folder: Path, seeds: Sequence[int], draws: Sequence[int]
) -> dict[int, dict[int, Path]] | None:
    """Each policy seed's own stored run of each draw (``seed-N/draw-M/matrix.json`` or
    ``.json.gz``), or None when the stored matrix lacks any of them (a matrix stored under one
    seed, or its seeds' runs not kept)."""
    if len(seeds) < 2:
        return None
    paths: dict[int, dict[int, Path]] = {}
    for seed in seeds:
        paths[seed] = {}
        for draw in draws:
            try:
                paths[seed][draw] = stored_matrix_path(folder / f"seed-{seed}", draw, len(draws))
            except UsageError:
                return None
    return paths


@dataclass(slots=True)
class SeedCounts:
    """Cells passed under one policy seed alone, over every cell: ``counts`` maps each policy
    (the stored default first, then the candidates) to its count with the draws pooled and its
    counts per draw; ``versus`` each candidate's margins against the stored default on that
    seed's runs (as :attr:`Judgement.versus_default`, over every cell with the draws pooled), so
    a margin's sign can be read seed by seed."""

    seed: int
    counts: dict[str, tuple[int, list[int]]]
    versus: dict[str, tuple[float, float, float, float] | None] = field(default_factory=dict)


def per_seed_counts(
    per_seed_draw: Mapping[int, Mapping[int, Sequence[CellResult]]], candidates: Sequence[str]
) -> list[SeedCounts]:
    """For each seed, the stored default and each candidate judged as the default (as
    :func:`judge`, over every cell) on that seed's runs alone."""
    out = []
    for seed, per_draw in per_seed_draw.items():
        counts = {}
        versus = {}
        for name in [DEFAULT_POLICY, *candidates]:
            (whole,) = [j for j in judge(per_draw, name, candidates) if j.split == "all"]
            counts[name] = (whole.pooled, whole.passed)
            if name != DEFAULT_POLICY:
                versus[name] = whole.versus_default
        out.append(SeedCounts(seed, counts, versus))
    return out


def restrict_plan(
    plan: MatrixPlan, stored: Mapping[Cell, CellResult], selected: set[Cell] | None = None
) -> None:
    """Keep only the plan's cells the stored draw has (and, given ``selected``, those of it)."""
    plan.cells = [
        cell for cell in plan.cells if cell in stored and (selected is None or cell in selected)
    ]


def select_cells(
    stored_draws: Mapping[int, Mapping[Cell, CellResult]], selection: str | set[Cell]
) -> set[Cell] | None:
    """``--cells``: the stored cells to run. ``all``: every one (None: no restriction);
    ``failing``: those the stored default fails with the draws pooled; ``nobody``: those no
    stored policy passes pooled (each judged as the default, against all the others); a set of
    cells: those, each of which every stored draw must have.

    Raises:
        UsageError: a cell of the set that a stored draw lacks.
    """
    if isinstance(selection, set):
        for draw, cells in stored_draws.items():
            missing = sorted(cell.label for cell in selection if cell not in cells)
            if missing:
                raise UsageError(f"--cells: stored draw {draw} has no cell {missing[0]}")
        return set(selection)
    if selection == "all":
        return None
    pooled = pooled_results({draw: list(cells.values()) for draw, cells in stored_draws.items()})
    chosen = set()
    for result in pooled:
        if selection == "nobody":
            if not passing_policies(result):
                chosen.add(result.cell)
        else:
            verdict = default_verdict(result)
            if verdict is not None and not verdict.passed:
                chosen.add(result.cell)
    return chosen


def merge(stored: Mapping[Cell, CellResult], fresh: Sequence[CellResult]) -> list[CellResult]:
    """The stored cells with the candidates' runs added, in the fresh run's cell order; the
    candidates' figures rounded as the stored ones were (six decimals), so that a tie is a tie
    whichever side ran now."""
    merged = []
    for result in fresh:
        base = stored[result.cell]
        metrics = dict(base.metrics)
        for name, figures in result.metrics.items():
            metrics[name] = at_stored_precision(figures)
        merged.append(replace(base, metrics=metrics))
    return merged


def merge_into(stored: Mapping[Cell, CellResult], fresh: Sequence[CellResult]) -> list[CellResult]:
    """Every stored cell, in the stored order, with the fresh runs laid over the cells they
    ran on (as :func:`merge` lays them) and the other cells as stored."""
    fresh_cells = {result.cell: result for result in merge(stored, fresh)}
    return [fresh_cells.get(cell, result) for cell, result in stored.items()]


def candidate_runs(path: Path) -> dict[int, dict[Cell, dict[str, PolicyMetrics]]]:
    """The candidates' own runs an ``against.json`` (or ``.json.gz``) keeps, per draw and cell:
    what :func:`merge` adds to the stored cells, read back so that a stored run can be judged
    again (with other policies among them) without running it again."""
    runs: dict[int, dict[Cell, dict[str, PolicyMetrics]]] = {}
    for draw, rows in read_json(path)["runs"].items():
        runs[int(draw)] = {
            Cell(r["family"], r["load"], r["cluster"], r["timing"]): {
                name: PolicyMetrics(**figures) for name, figures in r["policies"].items()
            }
            for r in rows
        }
    return runs


def judged_alone(result: CellResult, name: str, candidates: Sequence[str]) -> CellResult:
    """The cell as ``name`` is judged: it and the stored policies other than the stored
    default and the other candidates."""
    keep = {
        policy: metrics
        for policy, metrics in result.metrics.items()
        if policy == name or (policy != DEFAULT_POLICY and policy not in candidates)
    }
    return replace(result, metrics=keep)


@dataclass(slots=True)
class Judgement:
    """One policy judged as the default, over one split of the cells.

    ``passed``: cells passed per draw; ``pooled``: cells passed with the draws pooled; the
    geometric means and worst ratios are over the pooled cells (throughput as best ÷ this).
    ``versus_default``: the geometric means over the same cells of this policy's TTFT mean,
    TTFT p90, 1 ÷ throughput and end-to-end mean each divided by the stored default's (below
    1: better than it; the last is not judged); a verdict counts cells, this says by how much
    a candidate gains or loses where both pass or both fail. ``None`` when the stored matrix
    has no default.
    ``failures``: the pooled cells failed, with the reasons; ``who_passes``: for each of them,
    the policies of the judged cell that pass it, or the closest one when none does.
    """

    policy: str
    split: str
    cells: int
    passed: list[int]
    pooled: int
    geo_ttft_mean: float
    geo_ttft_p90: float
    worst_ttft_mean: tuple[float, str]
    worst_ttft_p90: tuple[float, str]
    worst_inverse_throughput: tuple[float, str]
    failures: list[tuple[str, list[str]]]
    who_passes: list[str]
    versus_default: tuple[float, float, float, float] | None


def judge(
    per_draw: Mapping[int, Sequence[CellResult]], name: str, candidates: Sequence[str]
) -> list[Judgement]:
    """``name`` judged as the default on each split (tuning, held-out, all)."""
    alone = {
        draw: [judged_alone(r, name, candidates) for r in results]
        for draw, results in per_draw.items()
    }
    pooled = pooled_results(alone)
    everyone = {result.cell: result for result in pooled_results(per_draw)}
    out = []
    for split in (TUNING, HELD_OUT, "all"):

        def chosen(results: Sequence[CellResult], split: str = split) -> list[CellResult]:
            return [r for r in results if split == "all" or FAMILIES[r.cell.family].split == split]

        cells = chosen(pooled)
        if not cells:
            continue
        passed = []
        for results in alone.values():
            verdicts = [default_verdict(r, name) for r in chosen(results)]
            passed.append(sum(1 for v in verdicts if v is not None and v.passed))
        ratios = [(r.cell.label, cell_ratios(r)[name]) for r in cells]
        inverse = [
            (1 / x.throughput if x.throughput > 0 else math.inf, label) for label, x in ratios
        ]
        failures = []
        who_passes = []
        count = 0
        for result in cells:
            verdict = default_verdict(result, name)
            if verdict is not None and verdict.passed:
                count += 1
            elif verdict is not None:
                failures.append((result.cell.label, list(verdict.reasons)))
                who_passes.append(describe_passing(result))
        out.append(
            Judgement(
                name,
                split,
                len(cells),
                passed,
                count,
                geometric_mean([x.ttft_mean for _, x in ratios]),
                geometric_mean([x.ttft_p90 for _, x in ratios]),
                _worst([(x.ttft_mean, label) for label, x in ratios]),
                _worst([(x.ttft_p90, label) for label, x in ratios]),
                _worst(inverse),
                failures,
                who_passes,
                _versus_default([everyone[r.cell] for r in cells], name),
            )
        )
    return out


@dataclass(slots=True)
class Reach:
    """Who passes one cell, pooled: ``stored`` describes the stored policies' verdicts (those
    that pass it, or the closest when none does); ``passing`` are the candidates that pass it,
    each judged alone as the default; ``closest`` is the candidate whose worst judged ratio
    (TTFT mean, TTFT p90, best ÷ throughput) is the smallest, among those that pass when any
    does, with that ratio, and ``closest_reasons`` why it fails (empty when it passes)."""

    cell: str
    stored: str
    passing: list[str]
    closest: tuple[str, float]
    closest_reasons: list[str]


def reach(per_draw: Mapping[int, Sequence[CellResult]], candidates: Sequence[str]) -> list[Reach]:
    """Per cell of the run, pooled over the draws: which candidates pass it (``--cells``).

    A cell no candidate passes either asks for figures no policy of this run reaches at once,
    or needs a policy unlike every one tried; one that some candidate passes is not out of
    reach of the scorers, though a default must pass it together with every other cell.
    """
    stored_only = pooled_results(
        {
            draw: [
                replace(r, metrics={n: m for n, m in r.metrics.items() if n not in candidates})
                for r in results
            ]
            for draw, results in per_draw.items()
        }
    )
    alone = {
        name: {
            r.cell: r
            for r in pooled_results(
                {
                    draw: [judged_alone(r, name, candidates) for r in results]
                    for draw, results in per_draw.items()
                }
            )
        }
        for name in candidates
    }
    out = []
    for result in stored_only:
        passing: list[str] = []
        closest: tuple[str, float, list[str]] | None = None
        for name in candidates:
            judged = alone[name].get(result.cell)
            if judged is None:
                continue
            verdict = default_verdict(judged, name)
            if verdict is None:
                continue
            if verdict.passed:
                passing.append(name)
            worst = worst_judged_ratio(cell_ratios(judged)[name])
            reasons = list(verdict.reasons)
            # A candidate that passes (no reasons) comes before any that fails, whatever the
            # ratios; then the smaller worst ratio, then the first named.
            if closest is None or (bool(reasons), worst) < (bool(closest[2]), closest[1]):
                closest = (name, worst, reasons)
        if closest is None:
            continue
        out.append(
            Reach(
                result.cell.label,
                describe_passing(result),
                passing,
                (closest[0], closest[1]),
                closest[2],
            )
        )
    return out


def _versus_default(
    cells: Sequence[CellResult], name: str
) -> tuple[float, float, float, float] | None:
    """Geometric means of ``name``'s TTFT mean, TTFT p90, 1 ÷ throughput and end-to-end mean
    over the stored default's, over ``cells`` (all policies, pooled)."""
    if not cells or any(DEFAULT_POLICY not in r.metrics for r in cells):
        return None
    mean, p90, inverse, e2e = [], [], [], []
    for result in cells:
        mine, default = result.metrics[name], result.metrics[DEFAULT_POLICY]
        mean.append(_ratio(mine.ttft_s["mean"], default.ttft_s["mean"]))
        p90.append(_ratio(mine.ttft_s["p90"], default.ttft_s["p90"]))
        inverse.append(_ratio(default.output_tokens_per_s, mine.output_tokens_per_s))
        e2e.append(_ratio(mine.e2e_s["mean"], default.e2e_s["mean"]))
    return geometric_mean(mean), geometric_mean(p90), geometric_mean(inverse), geometric_mean(e2e)


def _ratio(value: float, reference: float) -> float:
    if reference > 0:
        return value / reference
    return 1.0 if value == reference else math.inf


def _worst(items: Sequence[tuple[float, str]]) -> tuple[float, str]:
    return max(items, key=lambda item: item[0])


def against_report(
    title: str,
    command: str,
    folder: str,
    judgements: Sequence[Judgement],
    draws: Sequence[int],
    reach: Sequence[Reach] | None = None,
    seeds: tuple[Sequence[int], Sequence[int]] = ((0,), (0,)),
    per_seed: Sequence[SeedCounts] | None = None,
) -> str:
    """Markdown: each policy's verdicts as the default, per split, and its pooled failures;
    with ``reach`` (``--cells``), the candidates that pass each cell instead of the failures
    (a run of many candidates on a few cells); with ``per_seed``, each seed judged alone."""
    lines = [
        f"# {title}",
        "",
        f"Command: `{command}`",
        "",
        f"Judged on the stored matrix in `{folder}` (draws {', '.join(map(str, draws))}): each "
        "policy by the default's bar against the stored policies other than the stored default "
        f"(`{DEFAULT_POLICY}`, judged the same way in the first rows), never against another "
        "candidate. Pooled: the draws taken together (see `draws.md` of a matrix run). "
        "Geometric means and worst cells are over the pooled cells; throughput as best ÷ this. "
        "*Against the default*: the geometric means of this policy's TTFT mean, TTFT p90, "
        "1÷throughput and end-to-end mean (arrival to last token, which no verdict judges) "
        "over the stored default's, cell by cell (below 1: better than it), the margins the "
        "verdicts do not count.",
        "",
        *_seeds_lines(*seeds),
        "| policy | split | cells | pass, "
        + " / ".join(f"draw {d}" for d in draws)
        + " | pass, pooled | geo mean ratio: TTFT mean / p90 "
        "| against the default: TTFT mean / p90 / 1÷throughput / end-to-end mean "
        "| worst TTFT mean "
        "| worst TTFT p90 | worst 1÷throughput |",
        "|---|---|---:|---|---:|---|---|---|---|---|",
    ]
    for j in judgements:
        versus = " / ".join(f"{x:.4f}" for x in j.versus_default) if j.versus_default else "n/a"
        lines.append(
            f"| {j.policy} | {j.split} | {j.cells} | {' / '.join(map(str, j.passed))} "
            f"| {j.pooled} | {j.geo_ttft_mean:.3f} / {j.geo_ttft_p90:.3f} | {versus} "
            f"| {j.worst_ttft_mean[0]:.2f} ({j.worst_ttft_mean[1]}) "
            f"| {j.worst_ttft_p90[0]:.2f} ({j.worst_ttft_p90[1]}) "
            f"| {j.worst_inverse_throughput[0]:.2f} ({j.worst_inverse_throughput[1]}) |"
        )
    if per_seed:
        lines += _per_seed_lines(per_seed)
    if reach is not None:
        return "\n".join(lines + _reach_lines(reach)) + "\n"
    for j in judgements:
        if j.split != "all" or not j.failures:
            continue
        lines += ["", f"## {j.policy}: cells failed, pooled ({len(j.failures)})", ""]
        lines += [
            f"- {label}: {'; '.join(reasons)} (passed by: {who})"
            for (label, reasons), who in zip(j.failures, j.who_passes, strict=True)
        ]
    return "\n".join(lines) + "\n"


def _per_seed_lines(per_seed: Sequence[SeedCounts]) -> list[str]:
    names = list(per_seed[0].counts)
    lines = [
        "",
        "## Each policy seed alone",
        "",
        "Every cell judged under one policy seed at a time: the stored matrix's own runs of that "
        "seed (`seed-N/`) with the candidates' runs under the same seed, so that each candidate "
        "meets the default's tie-breaks. Cells passed with the draws pooled, and in brackets per "
        "draw. The default's own count moves from seed to seed by tie-breaks alone; a "
        "candidate's lead smaller than that is not yet a lead.",
        "",
        "| seed | " + " | ".join(names) + " |",
        "|---:|" + "---|" * len(names),
    ]
    for row in per_seed:
        cells = [
            f"{pooled} ({' / '.join(map(str, passed))})"
            for pooled, passed in (row.counts[name] for name in names)
        ]
        lines.append(f"| {row.seed} | " + " | ".join(cells) + " |")
    default = [row.counts[DEFAULT_POLICY][0] for row in per_seed]
    lines += ["", f"The default's pooled count ranges over {min(default)}–{max(default)}."]
    for name in names[1:]:
        diffs = [row.counts[name][0] - row.counts[DEFAULT_POLICY][0] for row in per_seed]
        more = sum(1 for d in diffs if d > 0)
        fewer = sum(1 for d in diffs if d < 0)
        lines[-1] += (
            f" {name}: more pooled cells than the default under {more} of {len(diffs)} seeds, "
            f"fewer under {fewer} (differences {', '.join(f'{d:+d}' for d in diffs)})."
        )
    if len(names) > 1:
        lines += [
            "",
            "Against the default under each seed: each candidate's TTFT mean / p90 / "
            "1÷throughput / end-to-end mean over the stored default's on that seed's runs, "
            "geometric means over every cell with the draws pooled (below 1: better). A margin "
            "whose sign changes from seed to seed is the tie-breaks', not the candidate's.",
            "",
            "| seed | " + " | ".join(names[1:]) + " |",
            "|---:|" + "---|" * (len(names) - 1),
        ]
        for row in per_seed:
            margins = [row.versus.get(name) for name in names[1:]]
            lines.append(
                f"| {row.seed} | "
                + " | ".join(
                    "n/a" if m is None else " / ".join(f"{x:.4f}" for x in m) for m in margins
                )
                + " |"
            )
    return lines


def _reach_lines(reach: Sequence[Reach]) -> list[str]:
    reached = [r for r in reach if r.passing]
    counts = Counter(name for r in reached for name in r.passing)
    lines = [
        "",
        f"## Who passes each cell, pooled ({len(reached)} of {len(reach)} passed by a candidate)",
        "",
        "Each candidate judged alone as the default, as above. *Stored*: the stored policies "
        "that pass the cell, or the closest when none does. *Closest candidate*: the smallest "
        "worst judged ratio (TTFT mean, TTFT p90, best ÷ throughput; 1.05 or less is within "
        "the bar's 5%; a candidate that passes, when one does), and why it fails the cell.",
        "",
    ]
    if counts:
        top = max(counts.values())
        best = sorted(name for name, count in counts.items() if count == top)
        lines += [
            f"Most cells passed by one candidate: {top} ({', '.join(best[:5])}"
            + (f" and {len(best) - 5} more" if len(best) > 5 else "")
            + ").",
            "",
        ]
    lines += [
        "| cell | stored | candidates passing | closest candidate | why it fails |",
        "|---|---|---:|---|---|",
    ]
    for r in reach:
        shown = ", ".join(r.passing[:3]) + (
            f" and {len(r.passing) - 3} more" if len(r.passing) > 3 else ""
        )
        lines.append(
            f"| {r.cell} | {r.stored} | {len(r.passing)}{f' ({shown})' if r.passing else ''} "
            f"| {r.closest[0]}, {r.closest[1]:.2f}x | {'; '.join(r.closest_reasons) or 'passes'} |"
        )
    return lines


def _seeds_lines(candidates: Sequence[int], stored: Sequence[int]) -> list[str]:
    """The report's line on policy seeds, when any run used other than seed 0 alone."""
    if list(candidates) == [0] and list(stored) == [0]:
        return []

    def listed(seeds: Sequence[int]) -> str:
        return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"

    text = f"Policy seeds: the candidates ran under {listed(candidates)}"
    text += (
        ", as the stored policies did"
        if list(candidates) == list(stored)
        else f", the stored policies under {listed(stored)}"
    )
    if len(candidates) > 1 or len(stored) > 1:
        text += " (several: each figure over one run per seed taken together)"
    return [text + ".", ""]


def against_json(
    command: str,
    folder: str,
    judgements: Sequence[Judgement],
    per_draw: Mapping[int, Sequence[CellResult]],
    candidates: Sequence[str],
    reach: Sequence[Reach] | None = None,
    seeds: tuple[Sequence[int], Sequence[int]] = ((0,), (0,)),
    per_seed: Sequence[SeedCounts] | None = None,
) -> dict[str, Any]:
    """The judgements, each cell's reach (``--cells``), each seed's counts judged alone
    (``per_seed``, when the stored matrix kept its seeds' runs), and every candidate's own
    metrics per draw and cell."""
    return {
        "command": command,
        "against": folder,
        **(
            {}
            if [list(s) for s in seeds] == [[0], [0]]
            else {"seeds": list(seeds[0]), "stored_seeds": list(seeds[1])}
        ),
        "judgements": [{name: getattr(j, name) for name in j.__slots__} for j in judgements],
        **(
            {}
            if not per_seed
            else {
                "per_seed": {
                    str(row.seed): {
                        name: {
                            "pooled": pooled,
                            "passed": passed,
                            **({"versus_default": row.versus[name]} if name in row.versus else {}),
                        }
                        for name, (pooled, passed) in row.counts.items()
                    }
                    for row in per_seed
                }
            }
        ),
        "reach": None
        if reach is None
        else [{name: getattr(r, name) for name in r.__slots__} for r in reach],
        "runs": {
            str(draw): [
                {
                    "family": r.cell.family,
                    "load": r.cell.load,
                    "cluster": r.cell.cluster,
                    "timing": r.cell.timing,
                    "policies": {
                        name: r.metrics[name].to_json() for name in candidates if name in r.metrics
                    },
                }
                for r in results
            ]
            for draw, results in per_draw.items()
        },
    }
