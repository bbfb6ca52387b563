"""The stored default judged with llm-d's optimized baseline among the policies it must match.

`against.md` judges llm-d-default as if it were the default. This script asks the other
question: with llm-d-default's runs added to every cell of the stored matrix (draws 1-3, seeds
0-2, pooled as the matrix pools them), how many cells does the stored default still pass, which
does it lose, and how do the two compare head to head. Run from the repository root:

    .venv/bin/python benchmarks/results/llm-d-default/rejudge.py

Another candidate run of the stored matrix is judged the same way with its file and name:

    .venv/bin/python benchmarks/results/llm-d-default/rejudge.py \
        benchmarks/results/llm-d-affinity/against.json.gz llm-d-affinity
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

from kv_picker_bench.harness import against
from kv_picker_bench.harness import matrix as m

STORED = Path("benchmarks/results/matrix-seeds")
RUN = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/llm-d-default/against.json.gz")
NAME = sys.argv[2] if len(sys.argv) > 2 else "llm-d-default"
FIGURES = ("TTFT mean", "TTFT p90", "throughput")


def main() -> None:
    runs = against.candidate_runs(RUN)
    per_draw = {}
    for draw in (1, 2, 3):
        cells = against.load_stored(against.stored_figures(STORED / f"draw-{draw}"), draw, False)
        per_draw[draw] = [
            dataclasses.replace(r, metrics={**r.metrics, NAME: runs[draw][cell][NAME]})
            for cell, r in cells.items()
        ]
    pooled = m.pooled_results(per_draw)
    without = [
        dataclasses.replace(r, metrics={k: v for k, v in r.metrics.items() if k != NAME})
        for r in pooled
    ]
    before = [m.default_verdict(r) for r in without]
    after = [m.default_verdict(r) for r in pooled]
    print(f"cells: {len(pooled)}")
    print(f"the default passes, the eight policies: {sum(v.passed for v in before)}")
    print(f"the default passes, with {NAME} too: {sum(v.passed for v in after)}")
    for r, b, a in zip(pooled, before, after, strict=True):
        if b.passed and not a.passed:
            print(f"  lost: {r.cell.label}: {'; '.join(a.reasons)}")
    ratios: dict[str, list[float]] = {f: [] for f in FIGURES}
    for r in pooled:
        ours, theirs = r.metrics["kv-picker"], r.metrics[NAME]
        ratios["TTFT mean"].append(ours.ttft_s["mean"] / theirs.ttft_s["mean"])
        ratios["TTFT p90"].append(ours.ttft_s["p90"] / theirs.ttft_s["p90"])
        ratios["throughput"].append(ours.output_tokens_per_s / theirs.output_tokens_per_s)
    for figure, values in ratios.items():
        geo = math.exp(sum(math.log(v) for v in values) / len(values))
        lower = figure != "throughput"
        worse = sum(v > 1.05 for v in values) if lower else sum(v < 1 / 1.05 for v in values)
        worst = max(values) if lower else min(values)
        print(
            f"the default over {NAME}, {figure}: geometric mean {geo:.3f}, "
            f"worse by more than 5% in {worse} cells, worst {worst:.2f}"
        )
    gie = [r.metrics["gie-default"].ttft_s["mean"] / r.metrics[NAME].ttft_s["mean"] for r in pooled]
    geo = math.exp(sum(math.log(v) for v in gie) / len(gie))
    print(f"gie-default over {NAME}, TTFT mean: geometric mean {geo:.3f}")


if __name__ == "__main__":
    main()
