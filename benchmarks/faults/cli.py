"""``kv-picker bench faults``: run the fault suite (or some of it), print the table, write JSON.

Exit code 0 when every scenario run passed, 1 when one failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kv_picker_bench.faults import abuse, scenarios
from kv_picker_bench.faults.report import ScenarioResult, format_table, write_results
from kv_picker_bench.faults.suite import FULL, QUICK, Sizes, with_cases

SCENARIOS: dict[str, Callable[[Sizes], ScenarioResult]] = {
    "load": scenarios.load,
    "endpoint-kill": scenarios.endpoint_kill,
    "picker-kill": scenarios.picker_kill,
    "bad-reloads": scenarios.bad_reloads,
    "bad-inputs": abuse.bad_inputs,
    "grpc-abuse": abuse.grpc_abuse,
    "prompt-flood": scenarios.prompt_flood,
    "valkey-outage": scenarios.valkey_outage,
    "fail-open": scenarios.fail_open,
}


def run(names: Sequence[str], sizes: Sizes, progress: bool = True) -> list[ScenarioResult]:
    """Run the named scenarios in order; each prints its row as it ends."""
    results = []
    for name in names:
        if progress:
            print(f"== {name} ...", flush=True)
        result = SCENARIOS[name](sizes)
        results.append(result)
        if progress:
            print(format_table([result]).splitlines()[-1], flush=True)
            for note in result.notes:
                print(f"   note: {note}", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench faults",
        description="The fault suite: real Envoy, kv-picker and simulated endpoints on "
        "loopback, hurt one way per scenario; prints a table of figures and verdicts.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes (the subset the test suite runs)"
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=tuple(SCENARIOS),
        metavar="NAME",
        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--cases",
        type=int,
        default=None,
        help="bad-inputs cases per body mode (default 10000; 250 with --quick)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write results.json, table.md, command.txt here"
    )
    args = parser.parse_args(argv)
    if args.cases is not None and args.cases < 1:
        parser.error("--cases must be positive")
    sizes = with_cases(QUICK if args.quick else FULL, args.cases)
    names = args.scenario or list(SCENARIOS)
    results = run(names, sizes)
    print()
    print(format_table(results))
    if args.out is not None:
        command = "kv-picker bench faults " + shlex.join(list(argv or sys.argv[1:]))
        write_results(results, args.out, command.strip())
    return 0 if all(r.passed for r in results) else 1
