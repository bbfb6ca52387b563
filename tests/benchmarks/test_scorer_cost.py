"""``kv-picker bench scorer-cost``: it measures the built-in default, one scorer out at a time."""

from __future__ import annotations

import pytest

from kv_picker.config import DEFAULT_PROFILE, parse_config
from kv_picker.plugins import builtin_registry
from kv_picker_bench.scorer_cost import WHOLE, default_scorers, document_without, main, measure


def test_the_whole_run_is_the_built_in_default() -> None:
    registry = builtin_registry(include_entry_points=False)
    assert parse_config(document_without(None), registry) == parse_config({"seed": 0}, registry)


def test_every_scorer_of_the_default_is_left_out_once_and_nothing_else_changes() -> None:
    registry = builtin_registry(include_entry_points=False)
    scorers = default_scorers()
    refs = [ref["pluginRef"] for ref in DEFAULT_PROFILE["plugins"]]
    assert scorers == [ref for ref in refs if ref.endswith("-scorer")]
    assert "recent-work-scorer" in scorers and "max-score-picker" not in scorers
    whole = parse_config(document_without(None), registry).profiles[0].entries
    for scorer in scorers:
        entries = parse_config(document_without(scorer), registry).profiles[0].entries
        assert scorer not in [e.plugin_ref for e in entries]
        assert entries == tuple(e for e in whole if e.plugin_ref != scorer)


def test_the_benchmark_runs_and_reports_each_scorers_share(capsys) -> None:  # type: ignore[no-untyped-def]
    results = measure([2000], requests=20, rounds=1)
    assert set(results) == {(2000, WHOLE), *((2000, s) for s in default_scorers())}
    assert all(micros > 0 for micros, _ in results.values())
    assert results[(2000, WHOLE)][1] == 0.0  # the whole run against itself
    assert all(-1.0 < share < 1.0 for _, share in results.values())
    assert main(["--prompt-chars", "3000", "--requests", "10", "--rounds", "1"]) == 0
    table = capsys.readouterr().out
    assert f"| 3,000 | {WHOLE} |" in table
    for scorer in default_scorers():
        assert f"| 3,000 | without {scorer} |" in table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-chars", "4k"], "comma list of integers"),
        (["--prompt-chars", "0"], "must be positive"),
        (["--requests", "0"], "must be positive"),
        (["--rounds", "0"], "must be positive"),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(args: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
