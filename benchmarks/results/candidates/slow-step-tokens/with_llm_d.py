"""The screened candidates and the stored default judged with llm-d-default among the policies.

Each is judged as the default is (against the stored policies other than the stored default),
with llm-d's optimized baseline (benchmarks/results/llm-d-default/) added to every cell, on the
cells the screens ran (the mixed pool, draws 1-3, seeds 0-2, pooled). Run from the repository
root:

    .venv/bin/python benchmarks/results/candidates/slow-step-tokens/with_llm_d.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kv_picker_bench.harness import against
from kv_picker_bench.harness import matrix as m

STORED = Path("benchmarks/results/matrix-seeds")
HERE = Path("benchmarks/results/candidates/slow-step-tokens")
RUNS = {
    "llm-d-default": Path("benchmarks/results/llm-d-default/against.json.gz"),
    "slow-step": HERE / "screen-114400.json.gz",
    "slow-step-16k": HERE / "screen-16384.json.gz",
}
TUNING = {"conversation", "shared-prefix", "chat", "zipf-prefix", "agentic"}


def main() -> None:
    runs = {name: against.candidate_runs(path) for name, path in RUNS.items()}
    screened = [name for name in RUNS if name != "llm-d-default"]
    per_draw = {}
    for draw in (1, 2, 3):
        cells = against.load_stored(against.stored_figures(STORED / f"draw-{draw}"), draw, False)
        per_draw[draw] = [
            dataclasses.replace(
                r, metrics={**r.metrics, **{n: runs[n][draw][cell][n] for n in RUNS}}
            )
            for cell, r in cells.items()
            if all(cell in runs[n][draw] for n in RUNS)
        ]
    pooled = m.pooled_results(per_draw)
    for judged in ("kv-picker", *screened):
        # Judged as the default is: without the stored default and the other candidates.
        verdicts = [
            (r.cell, m.default_verdict(against.judged_alone(r, judged, screened), judged))
            for r in pooled
        ]
        passed = [cell for cell, v in verdicts if v is not None and v.passed]
        tuning = sum(cell.family in TUNING for cell in passed)
        print(
            f"{judged}: passes {len(passed)} of {len(verdicts)} cells "
            f"({tuning} tuning, {len(passed) - tuning} held-out) with llm-d-default among the policies"
        )


if __name__ == "__main__":
    main()
