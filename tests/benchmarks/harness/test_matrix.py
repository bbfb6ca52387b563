"""The routing matrix: cells, ratios to the best policy, the default's verdict, and a quick
run through the command line (the full matrix is documented in benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from kv_picker_bench.harness import matrix
from kv_picker_bench.harness.matrix import (
    CLUSTERS,
    FAMILIES,
    HELD_OUT,
    TUNING,
    Cell,
    CellResult,
    cell_ratios,
    conversation_window,
    default_verdict,
    draws_json,
    draws_report,
    family_spec,
    family_trace,
    pooled_results,
    summarize_policies,
    versus_gie,
)
from kv_picker_bench.harness.report import PolicyMetrics


def metrics(name: str, mean: float, p90: float, throughput: float) -> PolicyMetrics:
    stats = {"mean": mean, "p50": mean, "p90": p90, "p99": p90}
    return PolicyMetrics(
        policy=name,
        requests=10,
        ok=10,
        rejected=0,
        shed=0,
        errors=0,
        ttft_s=stats,
        tpot_s=stats,
        e2e_s=stats,
        output_tokens_per_s=throughput,
        requests_per_s=1.0,
        sustained_tokens_per_s=throughput,
        hit_ratio=0.5,
        imbalance=1.0,
        imbalance_busy=1.0,
        transferred_tokens=0,
        transferred_bytes=0.0,
        makespan_s=10.0,
        wall_s=0.1,
    )


def cell_result(*rows: PolicyMetrics, family: str = "chat") -> CellResult:
    floors = {"strict": {"mean": 0.1, "p50": 0.1, "p90": 0.1, "p99": 0.1}}
    floors["practical"] = floors["strict"]
    return CellResult(
        Cell(family, 0.6, "small4", "llama-3.1-8b-h100"),
        10,
        1.0,
        {row.policy: row for row in rows},
        floors,
        {"unbounded": 0.5, "pooled_lru": 0.5, "pooled_capacity_tokens": 1000},
    )


def test_failures_that_only_trail_the_gie_default_by_a_hair_are_named_as_near_ties() -> None:
    """A default 0.1% below the GIE default's throughput, with half its TTFT, fails the bar
    (never worse than the GIE default) and is named a near tie; one 1% below is not; the
    report gives both ratios and the sustained rate's."""
    near = cell_result(
        metrics("kv-picker", 0.5, 0.5, 99.9), metrics("gie-default", 1.0, 1.0, 100.0)
    )
    far = cell_result(
        metrics("kv-picker", 0.5, 0.5, 99.0),
        metrics("gie-default", 1.0, 1.0, 100.0),
        family="rag",
    )
    slower = cell_result(  # 0.2% slower TTFT mean than the GIE default (whose p90 is worse),
        metrics("kv-picker", 1.002, 1.06, 100.0),  # but 6% off the best p90: not only the GIE
        metrics("gie-default", 1.0, 1.07, 100.0),
        metrics("round-robin", 2.0, 1.0, 100.0),
        family="lora",
    )
    p90 = cell_result(  # a p90 0.3% above the GIE default's, everything else the best
        metrics("kv-picker", 0.9, 1.003, 100.0),
        metrics("gie-default", 1.0, 1.0, 100.0),
        family="tenants",
    )
    near.metrics["kv-picker"].sustained_tokens_per_s = 100.2
    for result in (near, far, slower, p90):
        verdict = default_verdict(result)
        assert verdict is not None and not verdict.passed
    versus = versus_gie(near, "kv-picker")
    assert versus is not None
    assert versus.ttft_mean == 0.5 and versus.throughput == pytest.approx(0.999)
    assert versus.sustained == pytest.approx(1.002)
    assert versus.near_tie(["throughput"]) and not versus.near_tie([])
    far_versus = versus_gie(far, "kv-picker")
    assert far_versus is not None and not far_versus.near_tie(["throughput"])
    assert versus_gie(cell_result(metrics("kv-picker", 1, 1, 1)), "kv-picker") is None

    text = draws_report("t", "cmd", {1: [near, far, slower, p90], 2: [near, far, slower, p90]})
    assert (
        "2 of them fail only by trailing the GIE default, by less than 0.5% on each figure it "
        f"trails: {near.cell.label}, {p90.cell.label}." in text
    )
    row = next(line for line in text.splitlines() if line.startswith(f"| {near.cell.label} |"))
    assert "| 0.500 / 0.500 / 0.9990 (1.0020) |" in row
    document = draws_json("cmd", {1: [near, far], 2: [near, far]})
    cells = {c["family"]: c for c in document["pooled"]["cells"]}
    assert cells["chat"]["versus_gie_default"]["throughput"] == pytest.approx(0.999)
    assert cells["rag"]["versus_gie_default"]["throughput"] == pytest.approx(0.99)


def test_pooled_sustained_rate_weighs_each_draw_by_its_arrival_window() -> None:
    """Two draws of a cell: 10 requests at 1/s (a 10 s window) sustaining 100 tokens/s, and 10
    at 0.5/s (20 s) sustaining 40: pooled, 1,800 tokens over 30 s."""
    first = cell_result(metrics("kv-picker", 1.0, 1.0, 100.0))
    second = cell_result(metrics("kv-picker", 1.0, 1.0, 40.0))
    second = replace(second, offered_rate_per_s=0.5)
    (pooled,) = pooled_results({1: [first], 2: [second]})
    assert pooled.metrics["kv-picker"].sustained_tokens_per_s == pytest.approx(1800 / 30)
    unknown = replace(second, offered_rate_per_s=0.0)  # no window: the plain mean
    (pooled,) = pooled_results({1: [first], 2: [unknown]})
    assert pooled.metrics["kv-picker"].sustained_tokens_per_s == pytest.approx(70.0)


def test_ratios_are_to_the_best_of_the_cell() -> None:
    result = cell_result(
        metrics("kv-picker", 1.0, 2.0, 100.0),
        metrics("gie-default", 2.0, 2.0, 50.0),
        metrics("random", 4.0, 1.0, 80.0),
    )
    ratios = cell_ratios(result)
    assert ratios["kv-picker"].ttft_mean == 1.0 and ratios["random"].ttft_mean == 4.0
    assert ratios["kv-picker"].ttft_p90 == 2.0 and ratios["random"].ttft_p90 == 1.0
    assert ratios["gie-default"].throughput == 0.5


def test_the_verdict_names_every_reason() -> None:
    good = cell_result(metrics("kv-picker", 1.02, 1.0, 99.0), metrics("gie-default", 1.5, 2, 90))
    verdict = default_verdict(good)
    assert verdict is not None and verdict.passed and not verdict.reasons
    bad = cell_result(
        metrics("kv-picker", 1.2, 1.0, 90.0),
        metrics("gie-default", 1.1, 1.0, 95.0),
        metrics("dynamo-cost", 1.0, 1.0, 100.0),
    )
    verdict = default_verdict(bad)
    assert verdict is not None and not verdict.passed
    text = "; ".join(verdict.reasons)
    assert "TTFT mean 1.20x the best" in text
    assert "TTFT mean worse than gie-default" in text
    assert "throughput below gie-default" in text
    assert "p90" not in text
    assert default_verdict(cell_result(metrics("random", 1, 1, 1))) is None  # did not run


def test_who_passes_a_cell_and_how_close_the_closest_comes_when_nobody_does() -> None:
    """The bar takes each figure's best from whichever policy has it: when the fastest TTFT and
    the highest throughput belong to different policies, nobody may pass."""
    split = cell_result(
        metrics("kv-picker", 1.10, 1.0, 95.0),
        metrics("gie-default", 1.2, 1.2, 80.0),
        metrics("sglang-cache-aware", 1.0, 1.0, 85.0),
        metrics("dynamo-cost", 1.3, 1.1, 100.0),
    )
    assert matrix.passing_policies(split) == []
    # worst judged ratios: kv-picker 1.10 (mean); sglang 100/85 = 1.176; dynamo 1.30
    assert matrix.closest_policy(split) == ("kv-picker", pytest.approx(1.10))
    assert matrix.describe_passing(split) == "none (closest: kv-picker, 1.10x)"
    # Why: the policy near the best TTFT has 0.85 of the best throughput, the one with the best
    # throughput has 1.3x the best TTFT mean.
    assert matrix.why_nobody_passes(split) == (
        "near the best TTFT mean and p90: sglang-cache-aware (throughput 0.85x); "
        "near the best throughput: dynamo-cost (TTFT 1.30x / 1.10x)"
    )
    # Near every best, but behind the GIE default, which is far from the best throughput.
    bound = cell_result(
        metrics("kv-picker", 1.0, 1.04, 100.0),
        metrics("gie-default", 1.02, 1.0, 80.0),
    )
    assert matrix.passing_policies(bound) == []
    assert matrix.why_nobody_passes(bound) == (
        "within 5% of every best but behind gie-default: kv-picker (TTFT p90); gie-default "
        "itself 1.02x / 1.00x the best TTFT mean / p90, 0.80x the throughput"
    )
    # Nobody near both TTFT figures: each TTFT leader is named with its other figure.
    apart = cell_result(
        metrics("kv-picker", 1.0, 1.5, 100.0),
        metrics("round-robin", 1.5, 1.0, 100.0),
    )
    assert matrix.why_nobody_passes(apart) == (
        "none near the best TTFT mean and p90 at once (best mean: kv-picker, p90 1.50x; "
        "best p90: round-robin, mean 1.50x); near the best throughput: kv-picker "
        "(TTFT 1.00x / 1.50x), round-robin (TTFT 1.50x / 1.00x)"
    )
    one = cell_result(
        metrics("kv-picker", 1.10, 1.0, 95.0),
        metrics("gie-default", 1.0, 1.0, 99.0),
        metrics("random", 2.0, 2.0, 100.0),
    )
    assert matrix.passing_policies(one) == ["gie-default"]
    assert matrix.why_nobody_passes(one) == ""
    assert matrix.worst_judged_ratio(cell_ratios(one)["random"]) == 2.0
    # Within 5% of the best on every figure passes; worse than the GIE default on one does not.
    near = cell_result(
        metrics("kv-picker", 1.04, 1.0, 100.0),
        metrics("gie-default", 1.0, 1.0, 96.0),
    )
    assert matrix.passing_policies(near) == ["gie-default"]


def test_policy_summaries_take_the_worst_cell() -> None:
    results = [
        cell_result(metrics("kv-picker", 1.0, 1.0, 100), metrics("random", 2.0, 2.0, 50)),
        cell_result(
            metrics("kv-picker", 3.0, 1.0, 100), metrics("random", 1.0, 1.0, 100), family="rag"
        ),
    ]
    slow_start = results[1].metrics["kv-picker"]
    slow_start.e2e_s = {**slow_start.e2e_s, "mean": 1.0}  # its first token late, its answer not
    by_name = {s.policy: s for s in summarize_policies(results)}
    mine = by_name["kv-picker"]
    assert mine.worst_ttft_mean[0] == 3.0 and "rag" in mine.worst_ttft_mean[1]
    assert mine.geo_ttft_mean == pytest.approx(math.sqrt(3.0))
    assert mine.geo_e2e_mean == pytest.approx(1.0)  # end to end the best in both cells
    assert by_name["random"].geo_e2e_mean == pytest.approx(math.sqrt(2.0))
    assert by_name["random"].worst_throughput[0] == 0.5


def test_pooled_draws_weigh_every_request_and_every_second() -> None:
    """Two draws of one cell: the default trails in the first, leads in the second; pooled, the
    TTFT mean is over all served requests and the throughput over the summed makespans."""
    first = cell_result(
        metrics("kv-picker", 1.0, 2.0, 100.0), metrics("gie-default", 0.8, 2.0, 100)
    )
    second = cell_result(metrics("kv-picker", 1.0, 2.0, 100.0), metrics("gie-default", 1.3, 3, 100))
    gie = second.metrics["gie-default"]
    gie.ok, gie.makespan_s, gie.output_tokens_per_s = 30, 30.0, 60.0
    gie.ttft_s = {**gie.ttft_s, "p99": 5.0}
    assert not default_verdict(first).passed  # type: ignore[union-attr]
    (pooled,) = matrix.pooled_results({1: [first], 2: [second]})
    assert pooled.cell == first.cell and pooled.requests == 20
    row = pooled.metrics["gie-default"]
    assert row.ok == 40
    assert row.ttft_s["mean"] == pytest.approx((0.8 * 10 + 1.3 * 30) / 40)
    assert row.ttft_s["p90"] == pytest.approx(2.5)  # the mean of the draws' p90s
    assert row.ttft_s["p99"] == pytest.approx(3.5)
    assert row.output_tokens_per_s == pytest.approx((100 * 10 + 60 * 30) / 40)
    assert row.makespan_s == 40.0
    assert pooled.metrics["kv-picker"].ttft_s["mean"] == pytest.approx(1.0)
    verdict = default_verdict(pooled)
    assert verdict is not None and verdict.passed, verdict
    # A policy missing from a draw is not pooled; a cell missing from a draw neither.
    third = cell_result(metrics("kv-picker", 1.0, 2.0, 100.0), family="rag")
    assert matrix.pooled_results({1: [first], 2: [second, third]})[0].metrics.keys() == {
        "kv-picker",
        "gie-default",
    }
    assert len(matrix.pooled_results({1: [first], 2: [second, third]})) == 1
    lonely = matrix.pooled_results({1: [first], 2: [cell_result(metrics("kv-picker", 1, 1, 1))]})
    assert list(lonely[0].metrics) == ["kv-picker"]


def test_pooled_draws_pool_every_figure_not_only_the_judged_ones() -> None:
    """End-to-end latency, time per output token, hit ratio and the counts are the draws'
    together too, not the first draw's (a pooled table shows them next to the TTFT)."""
    first = cell_result(metrics("kv-picker", 1.0, 2.0, 100.0))
    second = cell_result(metrics("kv-picker", 1.0, 2.0, 100.0))
    one, two = first.metrics["kv-picker"], second.metrics["kv-picker"]
    one.e2e_s = {"mean": 10.0, "p50": 9.0, "p90": 20.0, "p99": 30.0}
    two.e2e_s = {"mean": 20.0, "p50": 19.0, "p90": 40.0, "p99": 50.0}
    one.tpot_s = {"mean": 0.01, "p50": 0.01, "p90": 0.02, "p99": 0.03}
    two.tpot_s = {"mean": 0.03, "p50": 0.03, "p90": 0.04, "p99": 0.05}
    two.ok, two.makespan_s, two.requests_per_s = 30, 30.0, 1.0
    one.hit_ratio, two.hit_ratio = 0.2, 0.6
    one.errors, two.errors, two.rejected = 1, 2, 3
    one.transferred_tokens, two.transferred_tokens = 5, 7
    (pooled,) = matrix.pooled_results({1: [first], 2: [second]})
    row = pooled.metrics["kv-picker"]
    assert row.e2e_s["mean"] == pytest.approx((10 * 10 + 20 * 30) / 40)
    assert row.e2e_s["p90"] == pytest.approx(30.0)  # the mean of the draws' p90s
    assert row.tpot_s["mean"] == pytest.approx((0.01 * 10 + 0.03 * 30) / 40)
    assert row.tpot_s["p99"] == pytest.approx(0.04)
    assert row.hit_ratio == pytest.approx((0.2 * 10 + 0.6 * 30) / 40)
    assert row.requests_per_s == pytest.approx((1.0 * 10 + 1.0 * 30) / 40)
    assert (row.errors, row.rejected, row.transferred_tokens) == (3, 3, 12)


def test_every_family_is_in_one_split_and_pd_only_for_long_prompts() -> None:
    splits = {f.split for f in FAMILIES.values()}
    assert splits == {TUNING, HELD_OUT}
    assert sum(f.split == TUNING for f in FAMILIES.values()) >= 4
    assert sum(f.split == HELD_OUT for f in FAMILIES.values()) >= 4
    assert CLUSTERS["pd"].pd and not CLUSTERS["small4"].pd


def test_another_draw_of_a_family_is_another_trace_of_the_same_shape() -> None:
    family = FAMILIES["chat"]
    assert family_spec(family, quick=True) == family.quick_spec  # draw 1: the reported one
    assert "seed=2" in family_spec(family, quick=True, draw=2)
    first = family_trace(family, quick=True)
    again = family_trace(family, quick=True, draw=1)
    second = family_trace(family, quick=True, draw=2)
    prompts = [r.input_tokens for r in first.requests]
    assert prompts == [r.input_tokens for r in again.requests]
    assert prompts != [r.input_tokens for r in second.requests]
    assert len(second.requests) > 0


def test_the_conversation_family_draws_later_windows_of_the_trace() -> None:
    assert conversation_window(1) == matrix.CONVERSATION_WINDOW_S
    start, end = conversation_window(2)
    assert start == matrix.CONVERSATION_WINDOW_S[1] and end - start == 200.0
    assert conversation_window(9) == conversation_window(1)  # eight windows, then again


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("--family-seed", "0", "--family-seed must be at least 1, not 0"),
        ("--family-seed", "-3", "--family-seed must be at least 1, not -3"),
        ("--family-seed", "1,x", "--family-seed: 'x' is not a whole number"),
        ("--family-seed", "2,2", "--family-seed: draw 2 is listed twice"),
        ("--seed", "-1", "--seed must be at least 0, not -1"),
        ("--seed", "0,y", "--seed: 'y' is not a whole number"),
        ("--seed", "1,0,1", "--seed: seed 1 is listed twice"),
    ],
)
def test_a_bad_family_or_policy_seed_is_refused_with_a_reason(
    option: str, value: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = matrix.main(["--quick", option, value, "--out", str(tmp_path), "--quiet"])
    assert code == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "matrix.json").exists()


def test_several_draws_report_each_and_the_verdicts_across_them(tmp_path: Path) -> None:
    code = matrix.main(
        ["--quick", "--families", "chat,rag", "--clusters", "small4", "--loads", "0.5",
         "--timing", "llama-3.1-8b-h100", "--policy", "kv-picker", "--policy", "gie-default",
         "--policy", "round-robin", "--family-seed", "1,3", "--out", str(tmp_path), "--quiet",
         "--jobs", "2", "--no-plots"]
    )  # fmt: skip
    assert code == 0
    verdicts = {}
    for draw in (1, 3):
        document = json.loads((tmp_path / f"draw-{draw}" / "matrix.json").read_text())
        assert document["family_seed"] == draw
        for cell in document["cells"]:  # the order asked for, not the order runs finished in
            assert list(cell["policies"]) == ["kv-picker", "gie-default", "round-robin"]
        assert f"seed={draw}" in document["families"]["chat"]["spec"]
        verdicts[draw] = {
            (c["family"], c["load"]): c["default_verdict"]["passed"] for c in document["cells"]
        }
    assert set(verdicts[1]) == set(verdicts[3]) == {("chat", 0.5), ("rag", 0.5)}
    summary = json.loads((tmp_path / "draws.json").read_text())
    assert summary["draws"] == [1, 3]
    rows = {row["family"]: row for row in summary["families"]}
    for family in ("chat", "rag"):
        key = (family, 0.5)
        assert rows[family]["passed"] == [int(verdicts[1][key]), int(verdicts[3][key])]
        assert rows[family]["passed_in_all"] == int(verdicts[1][key] and verdicts[3][key])
        assert rows[family]["failed_in_all"] == int(not (verdicts[1][key] or verdicts[3][key]))
    pooled = {c["family"]: c["default_verdict"]["passed"] for c in summary["pooled"]["cells"]}
    assert {f: int(p) for f, p in pooled.items()} == {
        f: rows[f]["passed_pooled"] for f in ("chat", "rag")
    }
    assert {s["policy"] for s in summary["pooled"]["summary"]} == {
        "round-robin", "gie-default", "kv-picker"
    }  # fmt: skip
    for row in summary["families"]:
        assert 0 <= row["nobody_passes_pooled"] <= row["cells"] - row["passed_pooled"]
    for cell in summary["pooled"]["cells"]:
        passing = cell["passing_policies"]
        assert ("kv-picker" in passing) == cell["default_verdict"]["passed"]
        assert cell["closest_policy"][0] in {"round-robin", "gie-default", "kv-picker"}
    text = (tmp_path / "draws.md").read_text()
    assert (
        "| pass, draw 1 | pass, draw 3 | pass in all | fail in all | pass, pooled "
        "| no policy passes, pooled |" in text
    )
    assert "| pooled | " in text
    assert summary["wall_s"] > 0 and text.endswith(f"draws: {summary['wall_s']:.1f} s.\n")
    assert not (tmp_path / "matrix.json").exists()  # one report per draw, in its folder


def test_a_stored_matrix_reports_again_from_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--report DIR`` runs nothing: the stored figures, judged and written by this version's
    report code, give the same reports, wall times included."""
    code = matrix.main(
        ["--quick", "--families", "chat", "--clusters", "small4", "--loads", "0.5",
         "--timing", "llama-3.1-8b-h100", "--policy", "kv-picker", "--policy", "gie-default",
         "--family-seed", "1,2", "--out", str(tmp_path), "--quiet", "--jobs", "1",
         "--no-plots"]
    )  # fmt: skip
    assert code == 0
    reports = [tmp_path / "draws.md", tmp_path / "draws.json", *tmp_path.glob("draw-*/matrix.*")]
    before = {path: path.read_text() for path in reports}
    (tmp_path / "draws.md").write_text("stale")
    (tmp_path / "draw-2" / "matrix.md").unlink()
    assert matrix.main(["--report", str(tmp_path), "--quick", "--no-plots"]) == 0
    for path, text in before.items():
        assert path.read_text() == text, path
    capsys.readouterr()
    # Not quick: the stored traces are not the ones this version's generators would draw.
    assert matrix.main(["--report", str(tmp_path), "--no-plots"]) == 2
    assert "use the stored run's --family-seed and --quick" in capsys.readouterr().err
    assert matrix.main(["--report", str(tmp_path / "draw-9"), "--quick"]) == 2
    assert "no matrix.json" in capsys.readouterr().err
    assert matrix.main(["--report", str(tmp_path), "--quick", "--policy", "random"]) == 2
    assert "runs nothing" in capsys.readouterr().err
    assert matrix.main(["--report", str(tmp_path), "--quick", "--seed", "0,1"]) == 2
    assert "takes no --against, --policy or --seed" in capsys.readouterr().err
    (tmp_path / "draw-2" / "matrix.json").write_text("{not json")
    assert matrix.main(["--report", str(tmp_path), "--quick", "--no-plots"]) == 2
    assert "draw-2/matrix.json is not a stored matrix" in capsys.readouterr().err
    assert (tmp_path / "draws.md").read_text() == before[tmp_path / "draws.md"]  # left alone


def test_a_quick_matrix_through_the_command_line(tmp_path: Path) -> None:
    code = matrix.main(
        [
            "--quick",
            "--families",
            "chat,rag",
            "--clusters",
            "small4",
            "--loads",
            "0.4,1.1",
            "--timing",
            "llama-3.1-8b-h100",
            "--policy",
            "round-robin",
            "--policy",
            "gie-default",
            "--policy",
            "kv-picker",
            "--out",
            str(tmp_path),
            "--quiet",
            "--jobs",
            "1",
        ]
    )
    assert code == 0
    document = json.loads((tmp_path / "matrix.json").read_text())
    cells = document["cells"]
    assert len(cells) == 4
    for cell in cells:
        assert set(cell["policies"]) == {"round-robin", "gie-default", "kv-picker"}
        assert max(cell["prefill_load"], cell["decode_load"]) == pytest.approx(cell["load"])
        assert min(r["ttft_mean"] for r in cell["ratios"].values()) == pytest.approx(1.0)
        assert cell["default_verdict"] is not None
        # The stored verdict is the one the stored figures give, to the last tie.
        stored = CellResult(
            Cell(cell["family"], cell["load"], cell["cluster"], cell["timing"]),
            cell["requests"],
            cell["rate_per_s"],
            {name: PolicyMetrics(**m) for name, m in cell["policies"].items()},
            cell["floors"],
            cell["hit_bounds"],
        )
        verdict = default_verdict(stored)
        assert verdict is not None
        assert verdict.passed == cell["default_verdict"]["passed"]
        assert list(verdict.reasons) == cell["default_verdict"]["reasons"]
        assert cell["passing_policies"] == matrix.passing_policies(stored)
        for policy in cell["policies"].values():  # nobody beats the zero-queue floor
            assert policy["ttft_s"]["mean"] >= cell["floors"]["strict"]["mean"] - 1e-9
    text = (tmp_path / "matrix.md").read_text()
    assert "## Summary: ratio to the best policy of each cell" in text
    assert "chat / 0.4 / small4 / llama-3.1-8b-h100" in text
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| policy | TTFT s"))
    header = lines[at]
    assert "end-to-end s mean / p99" in header
    row = next(line for line in lines[at:] if line.startswith("| kv-picker |"))
    assert row.count("|") == header.count("|")  # every row has the header's columns
    e2e = json.loads((tmp_path / "matrix.json").read_text())["cells"][0]["policies"]["kv-picker"]
    assert f"{e2e['e2e_s']['mean']:.2f} / {e2e['e2e_s']['p99']:.2f}" in row
    assert (tmp_path / "default_heatmap.png").stat().st_size > 0


def test_lean_responses_hide_first_bytes_from_every_cluster_of_the_matrix() -> None:
    from kv_picker_bench.harness.matrix import CLUSTERS, cluster_overrides

    for responses, seen in (("full", True), ("lean", False)):
        overrides = cluster_overrides(responses)("llama-3.1-70b-h100-tp4")
        config = CLUSTERS["small4"].config(**overrides)
        assert config.first_byte_seen is seen
        assert config.timing.name == "llama-3.1-70b-h100-tp4"


SEEDED = ["--quick", "--families", "chat", "--clusters", "small4", "--loads", "0.9",
          "--timing", "llama-3.1-8b-h100", "--policy", "kv-picker", "--policy", "random",
          "--quiet", "--jobs", "1", "--no-plots"]  # fmt: skip


def test_several_policy_seeds_pool_each_cells_runs_as_draws_are_pooled(tmp_path: Path) -> None:
    """``--seed 0,1``: every policy once per seed, each cell's figures over the runs together,
    exactly the pooling of the two one-seed runs; the trace's request count is the cell's."""
    runs = {}
    for seeds in ("0", "1", "0,1"):
        out = tmp_path / seeds.replace(",", "-")
        assert matrix.main([*SEEDED, "--seed", seeds, "--out", str(out)]) == 0
        runs[seeds] = json.loads((out / "matrix.json").read_text())
    one, two, both = runs["0"]["cells"][0], runs["1"]["cells"][0], runs["0,1"]["cells"][0]
    assert "seeds" not in runs["0"] and runs["1"]["seeds"] == [1] and runs["0,1"]["seeds"] == [0, 1]
    assert both["requests"] == one["requests"] == two["requests"]
    # The random picker's picks follow its seed: the two runs differ, so the pooling is seen.
    assert one["policies"]["random"]["ttft_s"] != two["policies"]["random"]["ttft_s"]
    for name in ("kv-picker", "random"):
        a, b, pooled = one["policies"][name], two["policies"][name], both["policies"][name]
        assert pooled["ok"] == a["ok"] + b["ok"]
        mean = (a["ttft_s"]["mean"] * a["ok"] + b["ttft_s"]["mean"] * b["ok"]) / pooled["ok"]
        assert pooled["ttft_s"]["mean"] == pytest.approx(mean, abs=1e-6)
        assert pooled["ttft_s"]["p90"] == pytest.approx(
            (a["ttft_s"]["p90"] + b["ttft_s"]["p90"]) / 2, abs=1e-6
        )
        tokens = (
            a["output_tokens_per_s"] * a["makespan_s"] + b["output_tokens_per_s"] * b["makespan_s"]
        )
        assert pooled["output_tokens_per_s"] == pytest.approx(
            tokens / (a["makespan_s"] + b["makespan_s"]), rel=1e-5
        )
        e2e = (a["e2e_s"]["mean"] * a["ok"] + b["e2e_s"]["mean"] * b["ok"]) / pooled["ok"]
        assert pooled["e2e_s"]["mean"] == pytest.approx(e2e, abs=1e-6)
    assert one["policies"]["random"]["e2e_s"] != both["policies"]["random"]["e2e_s"]
    text = (tmp_path / "0-1" / "matrix.md").read_text()
    assert "Policy seeds 0, 1: every policy ran once per seed" in text
    assert "## The default's verdict under each seed" in (tmp_path / "0-1" / "seeds.md").read_text()
    assert not (tmp_path / "1" / "seeds.md").exists()
    assert "Policy seed" not in (tmp_path / "0" / "matrix.md").read_text()
    assert "Policy seed 1." in (tmp_path / "1" / "matrix.md").read_text()
    # Each seed's own run is kept, as a one-seed run writes it.
    for seed, alone in (("0", one), ("1", two)):
        kept = json.loads((tmp_path / "0-1" / f"seed-{seed}" / "matrix.json").read_text())
        for name in ("kv-picker", "random"):
            assert dict(kept["cells"][0]["policies"][name], wall_s=0) == dict(
                alone["policies"][name], wall_s=0
            )
    # The stored figures report again as they were written, seeds included.
    reports = [tmp_path / "0-1" / name for name in ("matrix.md", "seeds.md", "seeds.json")]
    before = {path: path.read_text() for path in reports}
    (tmp_path / "0-1" / "seeds.md").unlink()
    assert matrix.main(["--report", str(tmp_path / "0-1"), "--quick", "--no-plots"]) == 0
    for path, text in before.items():
        assert path.read_text() == text, path
    # A draw pooled before every figure was: the first seed's end-to-end latency and hit ratio
    # next to pooled TTFT. Reported again, they are pooled from the seeds' runs.
    stored = tmp_path / "0-1" / "matrix.json"
    old = json.loads(stored.read_text())
    for key in ("e2e_s", "tpot_s", "hit_ratio"):
        old["cells"][0]["policies"]["random"][key] = one["policies"]["random"][key]
    stored.write_text(json.dumps(old))
    assert matrix.main(["--report", str(tmp_path / "0-1"), "--quick", "--no-plots"]) == 0
    again = json.loads(stored.read_text())["cells"][0]["policies"]["random"]
    assert again == both["policies"]["random"]
    # Seeds that would pool to other judged figures than the draw's are refused, unwritten.
    old["cells"][0]["policies"]["random"]["ttft_s"] = one["policies"]["random"]["ttft_s"]
    stored.write_text(json.dumps(old))
    assert matrix.main(["--report", str(tmp_path / "0-1"), "--quick", "--no-plots"]) == 2
    assert json.loads(stored.read_text()) == old


def test_a_failure_read_run_by_run_is_decided_only_beyond_the_runs_spread() -> None:
    """Two seeds, two draws: a default 2-3% slower than the GIE default in every run fails a
    decided figure; one whose pooled mean trails by 1% while it leads in three runs of four does
    not; a throughput 20% under the best policy's in every run is decided against that policy
    and its 5% bar. Cells the default passes are not read."""
    chat = [1.02, 1.03, 1.02, 1.03]  # the default's TTFT mean per run; the GIE default's is 1.0
    rag = [1.3, 0.9, 0.9, 0.95]
    runs = iter(range(4))

    def draw() -> list[CellResult]:
        i = next(runs)
        return [
            cell_result(metrics("kv-picker", chat[i], 2.0, 100.0),
                        metrics("gie-default", 1.0, 2.0, 100.0)),
            cell_result(metrics("kv-picker", rag[i], 2.0, 100.0),
                        metrics("gie-default", 1.0, 2.0, 100.0), family="rag"),
            cell_result(metrics("kv-picker", 1.0, 2.0, 80.0),
                        metrics("gie-default", 1.0, 2.0, 80.0),
                        metrics("round-robin", 1.0, 2.0, 100.0), family="lora"),
            cell_result(metrics("kv-picker", 1.0, 2.0, 100.0),
                        metrics("gie-default", 1.0, 2.0, 100.0), family="agentic"),
        ]  # fmt: skip

    per_seed = {0: {1: draw(), 2: draw()}, 1: {1: draw(), 2: draw()}}
    rows = {row.cell.split(" / ")[0]: row for row in matrix.run_by_run(per_seed)}
    assert set(rows) == {"chat", "rag", "lora"}
    assert rows["chat"].reference == "gie-default" and rows["chat"].bar == 1.0
    assert rows["chat"].pooled == pytest.approx(1.025)
    assert rows["chat"].beyond == 4 and rows["chat"].runs == 4 and rows["chat"].decided
    assert rows["rag"].pooled == pytest.approx(1.0125)  # fails pooled ...
    assert rows["rag"].beyond == 1 and not rows["rag"].decided  # ... within its runs' spread
    logs = [math.log(x) for x in rag]
    assert math.log(rows["rag"].paired) == pytest.approx(sum(logs) / 4)
    assert rows["rag"].spread == pytest.approx(statistics.stdev(logs) / 2)
    lora = rows["lora"]
    assert (lora.figure, lora.reference, lora.bar) == ("throughput", "round-robin", 1.05)
    assert lora.pooled == pytest.approx(1.25) and lora.paired == pytest.approx(1.25)
    assert lora.decided
    text = matrix.seeds_report("t", "cmd", per_seed)
    assert "2 of the 3 figures are decided, in 2 cells; the other 1 are within" in text
    assert "| rag / 0.6 / small4 / llama-3.1-8b-h100 | held-out | TTFT mean | gie-default | 1 " in (
        text
    )
    assert "| 1 of 4 | no |" in text
    stored = matrix.seeds_json("cmd", per_seed)["run_by_run"]
    assert [row["decided"] for row in stored] == [True, False, True]
    # The draws' report marks each failed cell with what its runs decide.
    per_draw = {d: matrix.pool_seeds({s: per_seed[s][d] for s in per_seed}) for d in (1, 2)}
    table = matrix.draws_report("t", "cmd", per_draw, [0, 1], matrix.run_by_run(per_seed))
    rows_md = {line.split(" / ")[0]: line for line in table.splitlines() if "/ small4 /" in line}
    assert rows_md["| chat"].endswith(f"| TTFT mean against gie-default ({rows['chat'].paired:.3f} ± "
                                      f"{rows['chat'].spread:.1%}) |")  # fmt: skip
    assert rows_md["| rag"].endswith("| no |")
    assert rows_md["| lora"].endswith("| throughput against round-robin (1.250 ± 0.0%) |")
    assert "decided by the runs |" in table
    assert "decided by the runs" not in matrix.draws_report("t", "cmd", per_draw, [0, 1])


def test_the_seeds_report_tells_the_verdicts_the_seed_decides() -> None:
    """Two seeds, two draws: a cell the default fails under one seed only is the seed's; a
    policy whose runs differ is counted against itself, one that ties never is."""
    stable = metrics("round-robin", 1.0, 2.0, 100.0)

    def cell(mine: float, other: float, family: str) -> CellResult:
        return cell_result(
            metrics("kv-picker", mine, 2.0, 100.0),
            metrics("gie-default", other, 2.0, 100.0),
            stable,
            family=family,
        )

    per_seed = {
        # seed 0: the default trails the GIE default on chat, in both draws
        0: {1: [cell(1.2, 1.0, "chat"), cell(1.0, 1.0, "rag")],
            2: [cell(1.2, 1.0, "chat"), cell(1.0, 1.0, "rag")]},
        # seed 1: it leads on chat; on rag the GIE default's run is 10% better in draw 2
        1: {1: [cell(1.0, 1.1, "chat"), cell(1.0, 1.0, "rag")],
            2: [cell(1.0, 1.1, "chat"), cell(1.0, 0.9, "rag")]},
    }  # fmt: skip
    rows = matrix.seed_verdicts(per_seed)
    assert [r.seed for r in rows] == [0, 1, None]
    assert rows[0].passed == [1, 1] and rows[0].passed_pooled == 1
    assert rows[0].failed == ["chat / 0.6 / small4 / llama-3.1-8b-h100"]
    assert rows[1].passed == [2, 1] and rows[1].passed_pooled == 1
    assert rows[1].failed == ["rag / 0.6 / small4 / llama-3.1-8b-h100"]
    # The default's worst cells move with the seed: 1.2x the best TTFT mean on chat under seed
    # 0; under seed 1, rag's 1.0 against the GIE default's pooled 0.95.
    assert rows[0].worst is not None and rows[1].worst is not None
    assert rows[0].worst[0] == (pytest.approx(1.2), "chat / 0.6 / small4 / llama-3.1-8b-h100")
    assert rows[1].worst[0] == (pytest.approx(1 / 0.95), "rag / 0.6 / small4 / llama-3.1-8b-h100")
    assert rows[0].worst[1][0] == pytest.approx(1.0) and rows[0].worst[2][0] == pytest.approx(1.0)
    spreads = {s.policy: s for s in matrix.self_spreads(per_seed)}
    assert spreads["round-robin"].spread_runs == 0 and spreads["round-robin"].largest == 1.0
    assert spreads["kv-picker"].cell_runs == 4 and spreads["kv-picker"].spread_runs == 2
    assert spreads["kv-picker"].largest == pytest.approx(1.2)
    assert spreads["gie-default"].spread_runs == 3  # chat twice, rag in draw 2
    text = matrix.seeds_report("t", "cmd", per_seed)
    assert "fails 0 cells under every seed and 2 under at least one: 2 cells" in text
    assert "| 0 | 1 | 1 | 1 | 0 | 1.200 (chat / 0.6 / small4 / llama-3.1-8b-h100) |" in text
    assert "| chat / 0.6 / small4 / llama-3.1-8b-h100 | tuning | 0 |" in text
    assert "| rag / 0.6 / small4 / llama-3.1-8b-h100 | held-out | 1 |" in text
