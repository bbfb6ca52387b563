"""The fault suite's quick subset, through real Envoy, kv-picker, simulated endpoints and Valkey.

Each scenario must pass and show the figures that make it pass; fail-open has its own test
(tests/integration/test_fail_open.py). The report and the command are checked to fail when a
scenario fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kv_picker_bench.faults import cli
from kv_picker_bench.faults.report import ScenarioResult, format_table
from kv_picker_bench.faults.suite import QUICK, Sizes

SCENARIOS = [name for name in cli.SCENARIOS if name != "fail-open"]


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, ScenarioResult]]:
    yield {r.name: r for r in cli.run(SCENARIOS, QUICK, progress=False)}


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_passes(results: dict[str, ScenarioResult], name: str) -> None:
    result = results[name]
    assert result.checks, "a scenario without checks proves nothing"
    assert result.passed, (result.checks, result.notes)


def test_load_figures(results: dict[str, ScenarioResult]) -> None:
    figures = results["load"].figures
    assert figures["requests"] == QUICK.load_requests
    assert figures["served"] + figures["documented_errors"] == QUICK.load_requests
    assert figures["failed"] == 0 and figures["in_flight_after"] == 0
    assert figures["rss_after_warmup_mb"] > 0 and figures["rss_growth_pct"] < 10


def test_kill_figures(results: dict[str, ScenarioResult]) -> None:
    endpoint = results["endpoint-kill"].figures
    assert endpoint["last_failure_started_after_kill_s"] <= 0.2
    assert 0 < endpoint["restart_to_first_served_s"] < 10
    picker = results["picker-kill"].figures
    assert picker["served_while_down"] == 0 and picker["max_latency_while_down_ms"] < 1000
    assert picker["sigterm_streams_completed"] == picker["sigterm_streams_in_flight"] >= 4
    assert picker["sigterm_exit_code"] == 0


def test_bad_input_and_abuse_figures(results: dict[str, ScenarioResult]) -> None:
    bad = results["bad-inputs"].figures
    assert bad["families"] == 12
    for mode in ("streamed", "buffered"):
        assert bad[f"{mode} sent"] == QUICK.bad_input_cases
        assert bad[f"{mode} gateway_500"] == bad[f"{mode} hung"] == 0
        assert bad[f"{mode} 4xx"] > QUICK.bad_input_cases // 2  # most are refused with a reason
    grpc = results["grpc-abuse"].figures
    assert grpc["big_body_answer"] == "413"
    assert grpc["rss_after_mb"] - grpc["rss_baseline_mb"] < 10


def test_reload_flood_and_outage_figures(results: dict[str, ScenarioResult]) -> None:
    reloads = results["bad-reloads"].figures
    assert reloads["rejected"] == 3 and reloads["applied"] == 1 and reloads["failed"] == 0
    flood = results["prompt-flood"].figures
    assert flood["index_max_keys"] <= flood["index_bound_keys"] < flood["blocks_offered"]
    outage = results["valkey-outage"].figures
    assert outage["failed"] == 0 and outage["requests_during_outage"] > 0
    assert outage["index_rewritten_after_s"] >= 0


def test_a_failed_check_fails_the_scenario_the_table_and_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(sizes: Sizes) -> ScenarioResult:
        result = ScenarioResult("broken", {"failed": 3})
        result.check("no request failed", False)
        result.check("picker alive", True)
        return result

    assert not ScenarioResult("empty").passed  # no checks: nothing was shown
    monkeypatch.setitem(cli.SCENARIOS, "load", broken)
    code = cli.main(["--quick", "--scenario", "load", "--out", str(tmp_path)])
    assert code == 1
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["passed"] is False
    assert document["scenarios"][0]["verdict"] == "FAIL"
    table = (tmp_path / "table.md").read_text()
    assert "| broken | FAIL | failed 3" in table and "no request failed" in table
    assert (tmp_path / "command.txt").read_text().startswith("kv-picker bench faults --quick")


def test_a_scenario_that_raises_is_reported_not_crashed(monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_picker_bench.faults.suite import scenario

    def raising(sizes: Sizes) -> ScenarioResult:
        with scenario("raising") as result:
            raise RuntimeError("Envoy would not start")
        return result

    monkeypatch.setitem(cli.SCENARIOS, "load", raising)
    (result,) = cli.run(["load"], QUICK, progress=False)
    assert not result.passed and "Envoy would not start" in result.notes[0]
    assert "FAIL" in format_table([result])
