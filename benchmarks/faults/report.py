"""What a scenario found: figures, checks and a verdict; the table and the JSON of a run."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

Figure = float | int | str


@dataclass
class ScenarioResult:
    """One scenario's outcome.

    Attributes:
        name: the scenario.
        figures: what was measured, with units in the names.
        checks: each pass condition and whether it held.
        notes: anything a reader needs to interpret the figures (failure examples, errors).
        duration_s: wall time of the scenario.
    """

    name: str
    figures: dict[str, Figure] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def check(self, description: str, holds: bool) -> bool:
        self.checks[description] = bool(holds)
        return bool(holds)


def _format(value: Figure) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return value


def format_table(results: Sequence[ScenarioResult]) -> str:
    """A Markdown table: scenario, verdict, figures, failed checks."""
    lines = [
        "| scenario | verdict | figures | failed checks |",
        "|---|---|---|---|",
    ]
    for result in results:
        figures = "; ".join(f"{k} {_format(v)}" for k, v in result.figures.items())
        failed = "; ".join(k for k, ok in result.checks.items() if not ok) or "-"
        lines.append(f"| {result.name} | {result.verdict} | {figures} | {failed} |")
    return "\n".join(lines)


def write_results(results: Sequence[ScenarioResult], out_dir: Path, command: str) -> None:
    """``results.json`` (every figure, check and note), ``table.md`` and ``command.txt``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "passed": all(r.passed for r in results),
        "scenarios": [{**asdict(r), "verdict": r.verdict} for r in results],
    }
    (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    (out_dir / "table.md").write_text(format_table(results) + "\n")
    (out_dir / "command.txt").write_text(command + "\n")
