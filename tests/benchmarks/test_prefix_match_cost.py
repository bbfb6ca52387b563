"""``kv-picker bench prefix-match``: it measures the built-in default, and runs."""

from __future__ import annotations

import pytest

from kv_picker.config import parse_config
from kv_picker.plugins import builtin_registry
from kv_picker_bench.prefix_match_cost import default_document, main, measure


def test_the_benchmark_varies_only_the_limit_of_the_built_in_default() -> None:
    registry = builtin_registry(include_entry_points=False)
    built_in = parse_config({"seed": 0}, registry)
    assert parse_config(default_document(2048), registry) == built_in
    varied = parse_config(default_document(256), registry)
    assert varied != built_in
    assert varied.profiles == built_in.profiles


def test_the_benchmark_runs_and_reports_ratios_to_256_blocks(capsys) -> None:  # type: ignore[no-untyped-def]
    results = measure([2000, 20000], [256, 2048], requests=30, rounds=1)
    assert set(results) == {(2000, 256), (2000, 2048), (20000, 256), (20000, 2048)}
    assert all(micros > 0 for micros in results.values())
    assert (
        main(["--prompt-chars", "3000", "--blocks", "1024", "--requests", "10", "--rounds", "1"])
        == 0
    )
    table = capsys.readouterr().out
    assert "| 3,000 | 256 |" in table and "| 3,000 | 1024 |" in table and "| 1.00x |" in table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-chars", "4k"], "comma lists of integers"),
        (["--blocks", "256,x"], "comma lists of integers"),
        (["--prompt-chars", "0"], "must be positive"),
        (["--requests", "0"], "must be positive"),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(args: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
