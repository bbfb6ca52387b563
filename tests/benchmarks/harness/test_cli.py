"""The harness's commands end to end on tiny inputs: results folders, exit codes, help."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_picker_bench.__main__ import main as bench_main
from kv_picker_bench.harness.cli import replay_main, sweep_main

TINY = "shared-prefix:groups=3,users=2,context=300,question=40,output=12,requests=40,rate=20"


def test_replay_writes_a_results_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    argv = [
        "--trace",
        TINY,
        "--endpoints",
        "3",
        "--num-gpu-blocks",
        "200",
        "--policy",
        "random",
        "--policy",
        "kv-picker",
        "--out",
        str(out),
        "--quiet",
        "--jobs",
        "1",
        "--save-requests",
    ]
    assert bench_main(["replay", *argv]) == 0
    printed = capsys.readouterr().out
    assert "| random | 40 | 0 | 0 |" in printed
    assert (out / "command.txt").read_text().startswith("kv-picker bench replay --trace")
    document = json.loads((out / "results.json").read_text())
    policies = document["loads"]["1"]["policies"]
    assert set(policies) == {"random", "kv-picker"}
    assert policies["kv-picker"]["ok"] == 40
    assert 0 <= document["bounds"]["pooled_lru"] <= document["bounds"]["unbounded"] <= 1
    for name in ("results.md", "ttft_cdf.png", "e2e_cdf.png", "hit_imbalance.png"):
        assert (out / name).stat().st_size > 0
    rows = (out / "requests-x1-random.jsonl").read_text().splitlines()
    assert len(rows) == 40 and json.loads(rows[0])["status"] == "ok"


def test_parallel_jobs_give_the_same_results(tmp_path: Path) -> None:
    common = ["--trace", TINY, "--endpoints", "3", "--quiet", "--no-plots"]
    common += ["--policy", "round-robin", "--policy", "gie-default", "--policy", "dynamo-cost"]
    assert replay_main([*common, "--jobs", "1", "--out", str(tmp_path / "a")]) == 0
    assert replay_main([*common, "--jobs", "2", "--out", str(tmp_path / "b")]) == 0

    def figures(folder: str) -> dict:
        document = json.loads((tmp_path / folder / "results.json").read_text())
        policies = document["loads"]["1"]["policies"]
        return {
            name: (m["ttft_s"], m["e2e_s"], m["hit_ratio"], m["imbalance"])
            for name, m in policies.items()
        }

    assert figures("a") == figures("b")


def test_sweep_over_loads(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["--trace", TINY, "--endpoints", "2", "--loads", "1,4", "--policy", "random"]
    argv += ["--policy", "kv-picker", "--out", str(out), "--quiet", "--jobs", "1"]
    assert sweep_main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert set(document["loads"]) == {"1", "4"}
    rates = [document["loads"][x]["rate_per_s"] for x in ("1", "4")]
    assert rates[1] == pytest.approx(4 * rates[0])
    assert (out / "ttft_vs_load.png").stat().st_size > 0
    assert (out / "ttft_cdf-x4.png").exists()


def test_pd_replay(tmp_path: Path) -> None:
    out = tmp_path / "pd"
    argv = ["--trace", TINY, "--endpoint", "prefill:H100x1", "--endpoint", "decode:H100x2"]
    argv += ["--pd", "--policy", "kv-picker", "--out", str(out), "--quiet", "--no-plots"]
    assert replay_main(argv) == 0
    metrics = json.loads((out / "results.json").read_text())["loads"]["1"]["policies"]
    assert metrics["kv-picker"]["ok"] == 40
    assert metrics["kv-picker"]["transferred_tokens"] > 0


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--trace", "/nonexistent/trace.jsonl"], "cannot read trace"),
        (["--trace", TINY, "--policy", "fastest"], "not a named policy"),
        (["--trace", TINY, "--endpoint", "gpu:x"], "expected ROLE[:HW[:BLOCKS]][xCOUNT]"),
        (["--trace", TINY, "--endpoint", "both:Z80"], "unknown hardware 'Z80'"),
        (["--trace", TINY, "--window", "later"], "expected START:END"),
        (["--trace", TINY, "--scrape-interval", "soon"], "expected a duration"),
        (["--trace", "chat:turns=0"], "must be >= 1"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert replay_main([*argv, "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert fragment in capsys.readouterr().err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("replay", "sweep", "live", "peers"):
        with pytest.raises(SystemExit) as info:
            bench_main([command, "--help"])
        assert info.value.code == 0
        assert f"kv-picker bench {command}" in capsys.readouterr().out
    assert bench_main(["--help"]) == 0
    assert "replay" in capsys.readouterr().out
