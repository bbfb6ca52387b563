"""The screened candidates and the stored default judged with llm-d-default among the policies.

Each is judged as the default is (against the stored policies other than the stored default),
with llm-d's optimized baseline (benchmarks/results/llm-d-default/) added to every cell, on the
cells the screens ran (the mixed pool, draws 1-3, seeds 0-2, pooled). Run from the repository
root:

    .venv/bin/python benchmarks/results/candidates/slow-step-tokens/with_llm_d.py
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

from kv_picker_bench.harness import against
from kv_picker_bench.harness import matrix as m
from kv_picker_bench.harness.report import PolicyMetrics

STORED = Path("benchmarks/results/matrix-seeds")
HERE = Path("benchmarks/results/candidates/slow-step-tokens")
RUNS = {
    "llm-d-default": Path("benchmarks/results/llm-d-default/against.json.gz"),
    "slow-step": HERE / "screen-114400.json.gz",
    "slow-step-16k": HERE / "screen-16384.json.gz",
}
TUNING = {"conversation", "shared-prefix", "chat", "zipf-prefix", "agentic"}


def main() -> None:
    runs = {name: json.loads(gzip.decompress(path.read_bytes())) for name, path in RUNS.items()}
    screened = [name for name in RUNS if name != "llm-d-default"]
    per_draw = {}
    for draw in (1, 2, 3):
        cells = against.load_stored(against.stored_figures(STORED / f"draw-{draw}"), draw, False)
        added: dict[m.Cell, dict[str, PolicyMetrics]] = {}
        for name, data in runs.items():
            for r in data["runs"][str(draw)]:
                cell = m.Cell(r["family"], r["load"], r["cluster"], r["timing"])
                added.setdefault(cell, {})[name] = PolicyMetrics(**r["policies"][name])
        per_draw[draw] = [
            dataclasses.replace(r, metrics={**r.metrics, **added[cell]})
            for cell, r in cells.items()
            if set(added.get(cell, {})) == set(RUNS)
        ]
    pooled = m.pooled_results(per_draw)
    for judged in ("kv-picker", *screened):
        drop = {n for n in screened if n != judged} | (
            {"kv-picker"} if judged != "kv-picker" else set()
        )
        verdicts = [
            (
                r.cell,
                m.default_verdict(
                    dataclasses.replace(
                        r, metrics={k: v for k, v in r.metrics.items() if k not in drop}
                    ),
                    judged,
                ),
            )
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
