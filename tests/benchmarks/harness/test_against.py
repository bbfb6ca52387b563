"""``kv-picker bench matrix --against``: candidates run alone and judged on a stored matrix as
the default would be, never against each other."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
from pathlib import Path

import pytest
import yaml

from kv_picker.config import DEFAULT_PLUGINS, DEFAULT_PROFILE
from kv_picker_bench.harness import matrix
from kv_picker_bench.harness.against import (
    against_json,
    against_report,
    candidate_runs,
    judge,
    load_stored,
    per_seed_counts,
    reach,
    select_cells,
)
from kv_picker_bench.harness.matrix import Cell, CellResult
from tests.benchmarks.harness.test_matrix import cell_result, metrics

SMALL = ["--quick", "--families", "chat,rag", "--clusters", "small4", "--loads", "0.5",
         "--timing", "llama-3.1-8b-h100", "--quiet", "--jobs", "2", "--no-plots"]  # fmt: skip


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stored")
    code = matrix.main(
        [*SMALL, "--policy", "kv-picker", "--policy", "gie-default", "--policy", "round-robin",
         "--family-seed", "1,3", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    return out


def default_profile(path: Path) -> Path:
    """The built-in default profile written as a candidate's YAML file."""
    document = {"plugins": list(DEFAULT_PLUGINS), "schedulingProfiles": [DEFAULT_PROFILE]}
    path.write_text(yaml.safe_dump(json.loads(json.dumps(document))))
    return path


def test_a_candidate_equal_to_the_default_gets_the_stored_defaults_verdicts(
    stored: Path, tmp_path: Path
) -> None:
    profile = default_profile(tmp_path / "same.yaml")
    out = tmp_path / "out"
    code = matrix.main(
        [*SMALL, "--family-seed", "1,3", "--against", str(stored), "--policy",
         f"same={profile}", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    report = json.loads((out / "against.json").read_text())
    rows = {(j["policy"], j["split"]): j for j in report["judgements"]}
    # The simulator is deterministic: the candidate's runs are the stored default's.
    for draw in ("1", "3"):
        stored_cells = json.loads((stored / f"draw-{draw}" / "matrix.json").read_text())["cells"]
        runs = {(c["family"], c["load"]): c["policies"]["same"] for c in report["runs"][draw]}
        for cell in stored_cells:
            mine = dict(runs[(cell["family"], cell["load"])], policy="kv-picker", wall_s=0)
            assert mine == dict(cell["policies"]["kv-picker"], wall_s=0)
    summary = json.loads((stored / "draws.json").read_text())
    for split in ("tuning", "held-out"):
        families = [f for f in summary["families"] if f["split"] == split]
        passed = [sum(f["passed"][i] for f in families) for i in range(2)]
        pooled = sum(f["passed_pooled"] for f in families)
        for name in ("kv-picker", "same"):
            assert rows[(name, split)]["passed"] == passed
            assert rows[(name, split)]["pooled"] == pooled
    assert rows[("same", "all")]["cells"] == 2
    # Read back, the runs are the stored default's figures cell by cell.
    back = candidate_runs(out / "against.json")
    assert sorted(back) == [1, 3]
    for draw, cells in back.items():
        stored_cells = load_stored(stored / f"draw-{draw}" / "matrix.json", draw, True)
        assert set(cells) == set(stored_cells)
        for cell, policies in cells.items():
            assert list(policies) == ["same"]
            mine = dataclasses.replace(policies["same"], policy="kv-picker", wall_s=0.0)
            assert mine == dataclasses.replace(stored_cells[cell].metrics["kv-picker"], wall_s=0.0)
    text = (out / "against.md").read_text()
    assert "| same | all | 2 |" in text and "| kv-picker | all | 2 |" in text


def test_each_candidate_is_judged_without_the_others_and_without_the_stored_default() -> None:
    cells = {
        1: [
            cell_result(
                metrics("kv-picker", 0.5, 0.5, 100.0),  # the stored default: better than all
                metrics("gie-default", 1.0, 1.0, 100.0),
                metrics("fast", 0.5, 0.5, 100.0),
                metrics("slow", 1.04, 1.04, 100.0),
            )
        ]
    }
    rows = {j.policy: j for name in ("fast", "slow") for j in judge(cells, name, ["fast", "slow"])
            if j.split == "all"}  # fmt: skip
    # Judged against gie-default alone, "slow" is within 5% of the best; it only fails the
    # never-worse-than-the-GIE-default rule, not the ratios "fast" or the default would set.
    assert rows["fast"].pooled == 1 and rows["fast"].geo_ttft_mean == pytest.approx(1.0)
    assert rows["slow"].pooled == 0
    assert rows["slow"].geo_ttft_mean == pytest.approx(1.04)  # not 2.08: "fast" is not there
    assert rows["slow"].failures == [(cells[1][0].cell.label, [
        "TTFT mean worse than gie-default", "TTFT p90 worse than gie-default"])]  # fmt: skip
    assert rows["slow"].who_passes == ["gie-default"]  # judged alone: "fast" is not there
    # The margins against the stored default, which the verdicts do not count.
    assert rows["fast"].versus_default == pytest.approx((1.0, 1.0, 1.0, 1.0))
    assert rows["slow"].versus_default == pytest.approx((2.08, 2.08, 1.0, 2.08))


def test_each_seed_alone_counts_the_default_and_each_candidate_on_that_seeds_runs() -> None:
    def draw(default_ttft: float, candidate_ttft: float) -> list[CellResult]:
        return [
            cell_result(
                metrics("kv-picker", default_ttft, default_ttft, 100.0),
                metrics("gie-default", 1.0, 1.0, 100.0),
                metrics("cand", candidate_ttft, candidate_ttft, 100.0),
            )
        ]

    # Seed 0: the candidate passes where the default trails the GIE default; seed 1: both pass;
    # seed 2: the default passes and the candidate does not.
    per_seed = {0: {1: draw(1.2, 0.9)}, 1: {1: draw(0.9, 0.9)}, 2: {1: draw(0.9, 1.2)}}
    rows = per_seed_counts(per_seed, ["cand"])
    assert [(r.seed, r.counts) for r in rows] == [
        (0, {"kv-picker": (0, [0]), "cand": (1, [1])}),
        (1, {"kv-picker": (1, [1]), "cand": (1, [1])}),
        (2, {"kv-picker": (1, [1]), "cand": (0, [0])}),
    ]
    # The margins against the default, seed by seed: 0.75, 1 and 1.33 on the TTFT figures.
    assert [r.versus["cand"] for r in rows] == [
        pytest.approx((0.75, 0.75, 1.0, 0.75)),
        pytest.approx((1.0, 1.0, 1.0, 1.0)),
        pytest.approx((4 / 3, 4 / 3, 1.0, 4 / 3)),
    ]
    text = against_report("t", "c", "f", [], [1], None, ((0, 1, 2), (0, 1, 2)), rows)
    assert "| 0 | 0 (0) | 1 (1) |" in text and "| 2 | 1 (1) | 0 (0) |" in text
    assert "The default's pooled count ranges over 0–1." in text
    assert (
        "cand: more pooled cells than the default under 1 of 3 seeds, fewer under 1 "
        "(differences +1, +0, -1)." in text
    )
    assert "| 0 | 0.7500 / 0.7500 / 1.0000 / 0.7500 |" in text
    assert "| 2 | 1.3333 / 1.3333 / 1.0000 / 1.3333 |" in text
    stored = against_json("c", "f", [], {}, ["cand"], None, ((0, 1, 2), (0, 1, 2)), rows)
    assert stored["per_seed"]["2"]["cand"]["versus_default"] == pytest.approx(
        (4 / 3, 4 / 3, 1.0, 4 / 3)
    )
    assert "versus_default" not in stored["per_seed"]["2"]["kv-picker"]


def test_the_margin_against_the_default_is_a_geometric_mean_over_the_cells() -> None:
    cells = {
        1: [
            cell_result(
                metrics("kv-picker", 1.0, 2.0, 100.0),
                metrics("gie-default", 3.0, 3.0, 100.0),
                metrics("new", 2.0, 1.0, 50.0),
            ),
            cell_result(
                metrics("kv-picker", 2.0, 1.0, 100.0),
                metrics("gie-default", 3.0, 3.0, 100.0),
                metrics("new", 1.0, 1.0, 200.0),
                family="rag",
            ),
        ]
    }
    first_new = cells[1][0].metrics["new"]
    first_new.e2e_s = {**first_new.e2e_s, "mean": 4.0}  # end to end: 4 and 0.5
    (row,) = [j for j in judge(cells, "new", ["new"]) if j.split == "all"]
    # TTFT mean: 2 and 0.5; p90: 0.5 and 1; 1/throughput: 2 and 0.5.
    assert row.versus_default == pytest.approx((1.0, 0.5**0.5, 1.0, 2**0.5))
    (reference,) = [j for j in judge(cells, "kv-picker", ["new"]) if j.split == "all"]
    assert reference.versus_default == pytest.approx((1.0, 1.0, 1.0, 1.0))
    without = {
        1: [cell_result(metrics("gie-default", 3.0, 3.0, 100.0), metrics("new", 2.0, 1.0, 50.0))]
    }
    (alone,) = [j for j in judge(without, "new", ["new"]) if j.split == "all"]
    assert alone.versus_default is None


STORED = "<the stored matrix>"  # replaced by the stored fixture's folder in the refusals below
CELL = ["--family-seed", "1,3", "--against", STORED, "--sample", "1", "--cells"]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--against", STORED, "--family-seed", "2", "--policy", "least-queue"],
         "no stored draw 2"),
        (["--against", STORED, "--family-seed", "1,3"], "needs the candidates to judge"),
        (["--against", STORED, "--family-seed", "1,3", "--policy", "gie-default"],
         "has a policy of that name"),
        (["--cells", "failing", "--policy", "round-robin"], "give --against"),
        (["--sample", "2"], "give --against"),
        (["--sample", "-1", "--against", STORED], "at least 0"),
        ([*CELL, "rag/0.5/small4/no-such-profile"], "unknown timing profile"),
        ([*CELL, "rag/0.5/small4"], "expected family/load/cluster/timing"),
        ([*CELL, "rag/0.7/small4/llama-3.1-8b-h100", "--loads", "0.5,0.7"],
         "stored draw 1 has no cell rag / 0.7 / small4"),
        ([*CELL, ","], "or a comma list of cells"),
        ([*CELL, "rag/0.5/small4/llama-3.1-8b-h100", "--families", "chat"],
         "is not among the cells --families, --loads, --clusters and --timing select"),
    ],
)  # fmt: skip
def test_a_run_that_cannot_be_judged_on_the_stored_matrix_is_refused(
    stored: Path, tmp_path: Path, extra: list[str], reason: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = tmp_path / "out"
    extra = [str(stored) if item == STORED else item for item in extra]
    code = matrix.main([*SMALL, "--out", str(out), *extra])
    assert code == 2
    assert reason in capsys.readouterr().err
    assert not out.exists()


def test_other_traces_than_the_stored_ones_are_refused(
    stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = [a for a in SMALL if a != "--quick"]  # the stored run was --quick
    code = matrix.main(
        [*full, "--family-seed", "1", "--against", str(stored / "draw-1"), "--policy",
         "round-robin2=" + str(Path(__file__).parents[3] / "benchmarks" / "profiles"
                               / "recent-work.yaml"), "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 2
    assert "this run would replay" in capsys.readouterr().err


def _refused_naming(folder: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--against folder`` exits 2 naming ``name`` as not a stored matrix, writing nothing."""
    code = matrix.main([*SMALL, "--family-seed", "1", "--against", str(folder), "--policy",
                        "least-queue", "--out", str(folder / "out")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "is not a stored matrix" in err and name in err
    assert not (folder / "out" / "against.json").exists()


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", '{"cells": [], "families": {}}',
     '{"family_seed": 1, "families": {}, "cells": [{"family": "chat"}]}',
     '{"family_seed": 1, "families": {}, "cells": [{"family": "chat", "load": 0.5, '
     '"cluster": "small4", "timing": "t", "policies": {"x": {"unknown": 1}}}]}'],
)  # fmt: skip
def test_a_stored_matrix_that_is_not_one_is_refused_naming_the_file(
    tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "matrix.json").write_text(content)
    _refused_naming(tmp_path, "matrix.json", capsys)


def test_a_stored_matrix_kept_gzip_compressed_judges_as_the_plain_one(
    stored: Path, tmp_path: Path
) -> None:
    """Large stored matrices are kept as ``matrix.json.gz``: the same figures, so the same
    judgements, and ``--report`` writes them back compressed."""
    packed = tmp_path / "packed"
    shutil.copytree(stored, packed)
    for draw in ("1", "3"):
        plain = packed / f"draw-{draw}" / "matrix.json"
        (plain.parent / "matrix.json.gz").write_bytes(gzip.compress(plain.read_bytes()))
        plain.unlink()
    judged = {}
    for name, folder in (("plain", stored), ("packed", packed)):
        out = tmp_path / f"out-{name}"
        code = matrix.main([*SMALL, "--family-seed", "1,3", "--against", str(folder),
                            "--policy", "least-queue", "--out", str(out)])  # fmt: skip
        assert code == 0
        judged[name] = json.loads((out / "against.json").read_text())["judgements"]
    assert judged["packed"] == judged["plain"]
    assert any(row["policy"] == "least-queue" for row in judged["packed"])

    stale = packed / "draw-3" / "matrix.md"
    stale.write_text("stale")
    assert matrix.main(["--report", str(packed), "--quick", "--no-plots"]) == 0
    assert stale.read_text() == (stored / "draw-3" / "matrix.md").read_text()
    assert not (packed / "draw-3" / "matrix.json").exists()
    rewritten = json.loads(gzip.decompress((packed / "draw-3" / "matrix.json.gz").read_bytes()))
    assert rewritten == json.loads((stored / "draw-3" / "matrix.json").read_text())


def test_a_gzip_stored_matrix_cut_short_is_refused_naming_the_file(
    stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = gzip.compress((stored / "draw-1" / "matrix.json").read_bytes())
    (tmp_path / "matrix.json.gz").write_bytes(whole[: len(whole) // 2])
    _refused_naming(tmp_path, "matrix.json.gz", capsys)


def _stored_draws(*cells: CellResult) -> dict[int, dict[Cell, CellResult]]:
    return {1: {c.cell: c for c in cells}}


def test_cells_selects_the_stored_defaults_failures_or_the_cells_nobody_passes() -> None:
    won = cell_result(
        metrics("kv-picker", 1.0, 1.0, 100.0), metrics("gie-default", 2.0, 2.0, 100.0)
    )
    # The default trails the GIE default; the GIE default itself passes.
    lost = cell_result(
        metrics("kv-picker", 1.2, 1.2, 100.0),
        metrics("gie-default", 1.0, 1.0, 100.0),
        family="rag",
    )
    # The best TTFT and the best throughput belong to different policies: nobody passes.
    split = cell_result(
        metrics("kv-picker", 1.0, 1.0, 50.0),
        metrics("gie-default", 2.0, 2.0, 100.0),
        family="mixed",
    )
    draws = _stored_draws(won, lost, split)
    assert select_cells(draws, "all") is None
    assert select_cells(draws, "failing") == {lost.cell, split.cell}
    assert select_cells(draws, "nobody") == {split.cell}


def test_reach_names_the_candidates_that_pass_each_cell_judged_alone() -> None:
    stored = [
        metrics("kv-picker", 1.0, 1.0, 50.0),
        metrics("gie-default", 2.0, 2.0, 100.0),
    ]
    per_draw = {
        1: [
            cell_result(
                *stored,
                metrics("both", 1.02, 1.0, 100.0),  # within 5% of every best: passes
                metrics("fast", 0.9, 0.9, 60.0),  # the best TTFT, 0.6 of the best throughput
                metrics("busy", 1.9, 1.9, 100.0),  # a little better than the GIE default
            ),
            cell_result(
                *stored,
                metrics("both", 3.0, 3.0, 50.0),
                metrics("fast", 3.0, 3.0, 50.0),
                metrics("busy", 3.0, 3.0, 50.0),
                family="rag",
            ),
        ]
    }
    rows = {r.cell: r for r in reach(per_draw, ["both", "fast", "busy"])}
    first, second = (c.cell.label for c in per_draw[1])
    # Judged alone, each candidate's best is its own and the stored policies' but the
    # default's: "busy" passes with the GIE default's throughput and a lower TTFT; "fast" has
    # 0.6 of the GIE default's throughput. The stored default, judged with the stored
    # policies only, has half the GIE default's throughput.
    assert rows[first].passing == ["both", "busy"]
    assert rows[first].stored == "none (closest: kv-picker, 2.00x)"
    assert rows[first].closest == ("both", pytest.approx(1.0)) and not rows[first].closest_reasons
    assert rows[second].passing == []
    # Every candidate: 1.5x the GIE default's TTFT, half its throughput.
    assert rows[second].closest == ("both", pytest.approx(2.0))
    assert "throughput 0.50x the best" in rows[second].closest_reasons
    text = against_report("t", "c", "f", [], [1], list(rows.values()))
    assert "(1 of 2 passed by a candidate)" in text
    assert "Most cells passed by one candidate: 1 (both, busy)." in text
    assert (
        f"| {first} | none (closest: kv-picker, 2.00x) | 2 (both, busy) | both, 1.00x | passes |"
        in text
    )


def test_sample_draws_the_same_profiles_from_the_same_seed(tmp_path: Path) -> None:
    first = matrix.sample_policies(3, 7, tmp_path / "a")
    again = matrix.sample_policies(3, 7, tmp_path / "b")
    other = matrix.sample_policies(3, 8, tmp_path / "c")
    assert [p.name for p in first] == ["sample-1", "sample-2", "sample-3"]
    assert [p.document for p in first] == [p.document for p in again]
    assert [p.document for p in first] != [p.document for p in other]
    assert len({json.dumps(p.document, sort_keys=True) for p in first}) == 3
    written = yaml.safe_load((tmp_path / "a" / "sample-2.yaml").read_text())
    assert written == first[1].document


def test_sampled_candidates_on_the_cells_the_default_fails(stored: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = matrix.main(
        [*SMALL, "--family-seed", "1,3", "--against", str(stored), "--sample", "2",
         "--sample-seed", "3", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    report = json.loads((out / "against.json").read_text())
    assert report["reach"] is None  # --cells all: the usual report
    # Only the sampled candidates run: no baseline is added when --policy is not given.
    assert {j["policy"] for j in report["judgements"]} == {"kv-picker", "sample-1", "sample-2"}
    assert (out / "samples" / "sample-2.yaml").is_file()
    # A copy of the stored matrix where the GIE default is twice as fast on rag in both draws:
    # the default fails rag there and passes chat.
    edited = tmp_path / "edited"
    shutil.copytree(stored, edited)
    for draw in ("1", "3"):
        path = edited / f"draw-{draw}" / "matrix.json"
        data = json.loads(path.read_text())
        for cell in data["cells"]:
            if cell["family"] == "rag":
                gie = cell["policies"]["gie-default"]
                for key in ("mean", "p90"):
                    gie["ttft_s"][key] = cell["policies"]["kv-picker"]["ttft_s"][key] / 2
        path.write_text(json.dumps(data))
    draws = {int(d): load_stored(edited / f"draw-{d}" / "matrix.json", int(d), True) for d in "13"}
    (rag,) = select_cells(draws, "failing") or [None]
    assert rag is not None and rag.family == "rag"
    out = tmp_path / "failing"
    code = matrix.main(
        [*SMALL, "--family-seed", "1,3", "--against", str(edited), "--cells", "failing",
         "--sample", "2", "--sample-seed", "3", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    report = json.loads((out / "against.json").read_text())
    assert [r["cell"] for r in report["reach"]] == [rag.label]
    for draw in ("1", "3"):
        assert [r["family"] for r in report["runs"][draw]] == ["rag"]
    text = (out / "against.md").read_text()
    assert "## Who passes each cell, pooled" in text and f"| {rag.label} |" in text


def test_a_sample_name_already_taken_is_refused_before_any_run(
    stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = default_profile(tmp_path / "mine.yaml")
    out = tmp_path / "out"
    code = matrix.main(
        [*SMALL, "--family-seed", "1,3", "--against", str(stored), "--policy",
         f"sample-2={profile}", "--sample", "3", "--out", str(out)]
    )  # fmt: skip
    assert code == 2
    assert "sample-2 is a name already taken" in capsys.readouterr().err
    assert not out.exists()


def test_cells_may_name_the_cells_to_run(stored: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cell = "rag/0.5/small4/llama-3.1-8b-h100"
    code = matrix.main(
        [*SMALL, "--family-seed", "1,3", "--against", str(stored), "--cells", cell,
         "--sample", "1", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    report = json.loads((out / "against.json").read_text())
    assert [r["cell"] for r in report["reach"]] == ["rag / 0.5 / small4 / llama-3.1-8b-h100"]
    assert [r["family"] for r in report["runs"]["3"]] == ["rag"]


def test_candidates_run_under_the_stored_matrixs_policy_seeds(tmp_path: Path) -> None:
    """A matrix stored with ``--seed 0,1`` judges a candidate over both seeds unless told
    otherwise: a copy of the default then gets the stored default's pooled figures exactly."""
    stored = tmp_path / "stored"
    seeded = [*SMALL, "--family-seed", "1,3", "--seed", "0,1"]
    code = matrix.main([*seeded, "--policy", "kv-picker", "--policy", "gie-default",
                        "--policy", "random", "--out", str(stored)])  # fmt: skip
    assert code == 0
    profile = default_profile(tmp_path / "same.yaml")
    out = tmp_path / "out"
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--against", str(stored),
                        "--policy", f"same={profile}", "--out", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads((out / "against.json").read_text())
    assert report["seeds"] == report["stored_seeds"] == [0, 1]
    stored_cells = json.loads((stored / "draw-3" / "matrix.json").read_text())["cells"]
    runs = {(c["family"], c["load"]): c["policies"]["same"] for c in report["runs"]["3"]}
    for cell in stored_cells:
        mine = dict(runs[(cell["family"], cell["load"])], policy="kv-picker", wall_s=0)
        assert mine == dict(cell["policies"]["kv-picker"], wall_s=0)
    assert (
        "the candidates ran under seeds 0, 1, as the stored policies did"
        in (out / "against.md").read_text()
    )
    # Each seed judged alone: a copy of the default gets the stored default's own count under
    # that seed, which is the stored matrix's per-seed verdict (seeds.json).
    per_seed = report["per_seed"]
    verdicts = json.loads((stored / "seeds.json").read_text())["verdicts"]
    verdicts = [v for v in verdicts if v["seed"] is not None]  # the last row: seeds pooled
    assert sorted(per_seed) == ["0", "1"] and len(verdicts) == 2
    for verdict in verdicts:
        row = per_seed[str(verdict["seed"])]
        expected = {"pooled": verdict["passed_pooled"], "passed": verdict["passed"]}
        assert row["kv-picker"] == expected
        # A copy of the default is level with it under every seed.
        assert row["same"] == dict(expected, versus_default=[1.0, 1.0, 1.0, 1.0])
    text = (out / "against.md").read_text()
    assert "## Each policy seed alone" in text
    assert "same: more pooled cells than the default under 0 of 2 seeds, fewer under 0" in text
    # Asked for another seed, the candidate runs under it alone, and the report says so.
    other = tmp_path / "other"
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--against", str(stored), "--seed", "2",
                        "--policy", f"same={profile}", "--out", str(other)])  # fmt: skip
    assert code == 0
    report = json.loads((other / "against.json").read_text())
    assert report["seeds"] == [2] and report["stored_seeds"] == [0, 1]
    assert "per_seed" not in report
    assert (
        "the candidates ran under seed 2, the stored policies under seeds 0, 1"
        in (other / "against.md").read_text()
    )


def test_stored_draws_under_different_policy_seeds_are_refused(
    stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(stored, copy)
    path = copy / "draw-3" / "matrix.json"
    document = json.loads(path.read_text())
    path.write_text(json.dumps({**document, "seeds": [1]}))
    out = tmp_path / "out"
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--against", str(copy),
                        "--policy", "least-queue", "--out", str(out)])  # fmt: skip
    assert code == 2
    assert "different policy seeds (draw 1: 0; draw 3: 1)" in capsys.readouterr().err
    assert not out.exists()
    path.write_text(json.dumps({**document, "seeds": ["one"]}))
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--against", str(copy),
                        "--policy", "least-queue", "--out", str(out)])  # fmt: skip
    assert code == 2
    assert "draw-3/matrix.json is not a stored matrix" in capsys.readouterr().err
    assert not out.exists()


def test_candidates_run_under_the_stored_matrixs_engine_model(
    stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for draw in (1, 3):
        assert (
            json.loads((stored / f"draw-{draw}" / "matrix.json").read_text())["cached_when"]
            == "scheduled"
        )
    out = tmp_path / "out"
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--against", str(stored),
                        "--cached-when", "computed", "--policy", "least-queue",
                        "--out", str(out)])  # fmt: skip
    assert code == 2
    assert "ran --cached-when scheduled; candidates are judged under the stored" in (
        capsys.readouterr().err
    )
    assert not out.exists()
    # A matrix stored before the field ran the older model, and says so.
    copy = tmp_path / "copy"
    shutil.copytree(stored, copy)
    for draw in (1, 3):
        path = copy / f"draw-{draw}" / "matrix.json"
        document = json.loads(path.read_text())
        del document["cached_when"]
        path.write_text(json.dumps(document))
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--against", str(copy),
                        "--cached-when", "scheduled", "--policy", "least-queue",
                        "--out", str(out)])  # fmt: skip
    assert code == 2
    assert f"{copy} ran --cached-when computed" in capsys.readouterr().err
    # Mixed draws are refused.
    path = copy / "draw-3" / "matrix.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "cached_when": "scheduled"}))
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--against", str(copy),
                        "--policy", "least-queue", "--out", str(out)])  # fmt: skip
    assert code == 2
    assert "different engine models (draw 1: computed; draw 3: scheduled)" in (
        capsys.readouterr().err
    )


def _cells(path: Path) -> dict[tuple[str, float], dict[str, dict]]:
    """A stored matrix.json's figures per cell and policy, without the run's wall time."""
    cells = json.loads(path.read_text())["cells"]
    return {
        (c["family"], c["load"]): {n: dict(m, wall_s=0) for n, m in c["policies"].items()}
        for c in cells
    }


def _edited_copy(stored: Path, edited: Path, parts: tuple[str, ...]) -> Path:
    """A copy of a stored matrix with two policies' figures edited in the given parts: the
    default's TTFT mean set to 99 s and the GIE default's p90 to 77 s in every cell."""
    shutil.copytree(stored, edited)
    for part in parts:
        path = edited / part / "matrix.json"
        document = json.loads(path.read_text())
        for cell in document["cells"]:
            cell["policies"]["kv-picker"]["ttft_s"]["mean"] = 99.0
            cell["policies"]["gie-default"]["ttft_s"]["p90"] = 77.0
        path.write_text(json.dumps(document))
    return edited


def test_refresh_runs_the_default_again_and_keeps_every_other_stored_run(
    tmp_path: Path,
) -> None:
    seeded = [*SMALL, "--family-seed", "1,3", "--seed", "0,1"]
    stored = tmp_path / "stored"
    code = matrix.main([*seeded, "--policy", "kv-picker", "--policy", "gie-default",
                        "--policy", "random", "--out", str(stored)])  # fmt: skip
    assert code == 0
    # Unchanged, the refresh is the stored matrix again: every seed's figures, the pooled ones
    # and the verdicts (the simulator is deterministic under a seed).
    again = tmp_path / "again"
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--refresh", str(stored),
                        "--out", str(again)])  # fmt: skip
    assert code == 0
    for part in ("draw-1", "draw-3", "seed-0/draw-1", "seed-1/draw-3"):
        assert _cells(again / part / "matrix.json") == _cells(stored / part / "matrix.json")
    summary = json.loads((stored / "draws.json").read_text())["families"]
    assert json.loads((again / "draws.json").read_text())["families"] == summary
    # The stored default's figures edited, and a baseline's: the refresh runs the default
    # again (its true figures come back) and keeps the baseline's stored run as it is.
    edited = _edited_copy(stored, tmp_path / "edited", ("draw-1", "seed-0/draw-1", "seed-1/draw-1"))
    out = tmp_path / "out"
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--refresh", str(edited),
                        "--out", str(out)])  # fmt: skip
    assert code == 0
    for part in ("draw-1", "seed-0/draw-1", "seed-1/draw-1"):
        fresh, kept = _cells(out / part / "matrix.json"), _cells(stored / part / "matrix.json")
        for cell, policies in fresh.items():
            assert policies["kv-picker"] == kept[cell]["kv-picker"]
            assert policies["random"] == kept[cell]["random"]
            assert policies["gie-default"]["ttft_s"]["p90"] == 77.0
    # The pooled draw is pooled again from the seeds' runs, the edited baseline's included.
    pooled = _cells(out / "draw-1" / "matrix.json")
    assert all(p["gie-default"]["ttft_s"]["p90"] == 77.0 for p in pooled.values())
    assert (out / "seeds.md").is_file() and (out / "draws.md").is_file()


def test_refresh_runs_the_named_stored_policies_on_the_cells_asked_and_keeps_the_rest(
    stored: Path, tmp_path: Path
) -> None:
    # Two loads stored; a baseline's and the default's figures edited in both. Refreshing the
    # baseline on one load brings its true figures back there only: the default's edits, and
    # every figure of the other load, are kept as stored.
    two_loads = [*SMALL[:5], "--loads", "0.5,0.9", *SMALL[7:]]
    both = tmp_path / "both"
    code = matrix.main([*two_loads, "--policy", "kv-picker", "--policy", "gie-default",
                        "--family-seed", "1", "--out", str(both)])  # fmt: skip
    assert code == 0
    edited = _edited_copy(both, tmp_path / "edited", ("",))
    out = tmp_path / "out"
    code = matrix.main([*SMALL, "--family-seed", "1", "--refresh", str(edited),
                        "--policy", "gie-default", "--out", str(out)])  # fmt: skip
    assert code == 0
    fresh, kept = _cells(out / "matrix.json"), _cells(both / "matrix.json")
    assert set(fresh) == set(kept)  # every stored cell is written, not only those refreshed
    for (family, load), policies in fresh.items():
        assert policies["kv-picker"]["ttft_s"]["mean"] == 99.0
        if load == 0.5:
            assert policies["gie-default"] == kept[(family, load)]["gie-default"]
        else:
            assert policies["gie-default"]["ttft_s"]["p90"] == 77.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "random"], "--refresh --policy random: the stored matrix has no policy"),
        (["--seed", "1"], "takes no --against, --seed or --sample"),
    ],
)
def test_refresh_takes_only_the_stored_matrixs_own_policies_and_seeds(
    stored: Path, tmp_path: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--refresh", str(stored), *extra,
                        "--out", str(tmp_path / "out")])  # fmt: skip
    assert code != 0
    assert message in capsys.readouterr().err


def test_refresh_refuses_to_write_over_the_stored_matrix_or_without_its_seeds_runs(
    stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--refresh", str(stored),
                        "--out", str(stored)])  # fmt: skip
    assert code != 0
    assert "give an --out other than the stored one" in capsys.readouterr().err
    # A matrix that pools two seeds but has lost its seed-N/ folders cannot be refreshed.
    copy = tmp_path / "copy"
    shutil.copytree(stored, copy)
    for draw in ("draw-1", "draw-3"):
        path = copy / draw / "matrix.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "seeds": [0, 1]}))
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--refresh", str(copy),
                        "--out", str(tmp_path / "out")])  # fmt: skip
    assert code != 0
    assert "has not kept each seed's runs (seed-N/draw-M/)" in capsys.readouterr().err
    # A folder that holds no stored matrix, or a stored draw that is not one, is named.
    empty = tmp_path / "empty"
    empty.mkdir()
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--refresh", str(empty),
                        "--out", str(tmp_path / "out2")])  # fmt: skip
    assert code != 0
    assert f"no stored draw 1 in {empty}" in capsys.readouterr().err
    (copy / "draw-3" / "matrix.json").write_text("{not json")
    code = matrix.main([*SMALL, "--family-seed", "1,3", "--refresh", str(copy),
                        "--out", str(tmp_path / "out3")])  # fmt: skip
    assert code != 0
    assert "matrix.json is not a stored matrix" in capsys.readouterr().err
