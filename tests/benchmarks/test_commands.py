"""The benchmark package's commands, run as users run them: a real subprocess per command."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.picker.test_cli import kv_picker, processes_with_marker


def test_help_texts() -> None:
    for args in (
        ["demo", "--help"],
        ["sim-endpoint", "--help"],
        ["bench", "--help"],
        ["bench", "overhead", "--help"],
        ["bench", "workers", "--help"],
    ):
        result = kv_picker(*args, timeout_s=30)
        assert result.returncode == 0, (args, result.stderr)
        assert "usage" in result.stdout.lower()


def test_demo_prints_the_table_and_leaves_no_process() -> None:
    marker = f"KV_PICKER_TEST_MARK={uuid.uuid4()}"
    key, value = marker.split("=", 1)
    env = {**os.environ, key: value}
    result = kv_picker("demo", "--requests", "36", "--concurrency", "4", env=env, timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| random (cache-blind) | 36 | 0 |" in result.stdout
    assert "| kv-picker default | 36 | 0 |" in result.stdout
    assert processes_with_marker(marker) == []


def _small_overhead_run(tmp_path: Path, requests: int, connections: str, *args: str) -> Any:
    """``kv-picker bench overhead`` on 2 endpoints, one round of 200-token prompts."""
    return kv_picker(
        "--log-level",
        "warning",
        "bench",
        "overhead",
        "--endpoints",
        "2",
        "--requests",
        str(requests),
        "--connections",
        connections,
        "--rounds",
        "1",
        "--prompt-tokens",
        "200",
        *args,
        "--out",
        str(tmp_path),
        timeout_s=180,
    )


@pytest.mark.parametrize(
    ("mode", "processing"), [("approximate", "streamed,buffered,gie"), ("precise", "gie")]
)
def test_overhead_benchmark_smoke(tmp_path: Path, mode: str, processing: str) -> None:
    result = _small_overhead_run(tmp_path, 10, "1,2", "--mode", mode, "--modes", processing)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "overhead.json").read_text())
    modes = processing.split(",")
    assert [(row["mode"], row["connections"]) for row in rows] == [
        (m, c) for m in modes for c in (1, 2)
    ]
    # Every path served every request: the floor's echoed bodies reached the endpoints intact.
    for row in rows:
        for path in ("direct", "floor", "picker"):
            assert row[path]["errors"] == 0 and row[path]["requests"] == 10
            assert row[path]["p50_ms"] > 0
        assert row["throughput_ratio_to_floor"] == pytest.approx(
            row["picker"]["requests_per_s"] / row["floor"]["requests_per_s"]
        )
        # The CPU each path's ext_proc service and Envoy used per request (none for direct).
        # The kernel counts CPU in 10 ms ticks, coarse for ten small requests: only that the
        # figures are there and add up is checked here (tests/benchmarks/test_localstack_cpu.py
        # checks the counting).
        assert row["direct"]["ext_proc_cpu_ms"] == 0
        for path in ("direct", "floor", "picker"):
            assert row[path]["envoy_cpu_ms"] >= 0 and row[path]["ext_proc_cpu_ms"] >= 0
        if row["floor"]["ext_proc_cpu_ms"] > 0:
            assert row["ext_proc_cpu_ratio_to_floor"] == pytest.approx(
                row["picker"]["ext_proc_cpu_ms"] / row["floor"]["ext_proc_cpu_ms"]
            )
    assert "| added p50 ÷ floor's |" in result.stdout
    assert "| ext_proc CPU ms/req, floor / picker | CPU ÷ floor's |" in result.stdout


def test_overhead_benchmark_streams_tokens_through_every_path(tmp_path: Path) -> None:
    result = _small_overhead_run(tmp_path, 6, "2", "--modes", "gie", "--output-tokens", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads((tmp_path / "overhead.json").read_text())
    for path in ("direct", "floor", "picker"):
        figures = row["stream"][path]
        # Every token of every request came back as its own event, through every path.
        assert figures["output_tokens"] == 6 * 5, path
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
        assert 0 < figures["gap_p50_ms"] <= figures["gap_p99_ms"]
        assert figures["envoy_cpu_us_per_token"] >= 0
    assert row["stream"]["direct"]["ext_proc_cpu_us_per_token"] == 0
    assert row["added_ttft_p50_ms"] == pytest.approx(
        row["stream"]["picker"]["ttft_p50_ms"] - row["stream"]["direct"]["ttft_p50_ms"]
    )
    assert "| chunk gap p99 ms, direct / floor / picker |" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--output-tokens", "0"], "--output-tokens must be at least 1"),
        (["--output-tokens", "8", "--time-scale", "0"], "--time-scale must be positive"),
        (["--modes", "gie,leaner"], "--modes: unknown leaner"),
    ],
)
def test_overhead_benchmark_refuses_bad_stream_options(args: list[str], message: str) -> None:
    result = kv_picker("bench", "overhead", *args, timeout_s=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_pd_benchmark_smoke(tmp_path: Path) -> None:
    result = kv_picker(
        "bench",
        "pd",
        "--fast",
        "1",
        "--slow",
        "1",
        "--requests",
        "12",
        "--rate",
        "4",
        "--long-share",
        "0.5",
        "--long-words",
        "900",
        "--threshold",
        "256",
        "--time-scale",
        "0.02",
        "--out",
        str(tmp_path),
        timeout_s=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["policy"]: row for row in json.loads((tmp_path / "pd.json").read_text())}
    assert set(rows) == {"hardware-blind", "class-preference", "default", "pd"}
    assert all(row["errors"] == 0 for row in rows.values())
    assert rows["pd"]["disaggregated"] > 0
    assert rows["hardware-blind"]["disaggregated"] == rows["default"]["disaggregated"] == 0


def test_overload_benchmark_smoke(tmp_path: Path) -> None:
    result = kv_picker(
        "--log-level",
        "warning",
        "bench",
        "overload",
        "--mode",
        "approximate",
        "--endpoints",
        "2",
        "--prompt-tokens",
        "200",
        "--seconds",
        "1",
        "--bounds",
        "8,0",
        "--queue-delays",
        "5",
        "--factors",
        "0.5",
        "--out",
        str(tmp_path),
        timeout_s=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "overload.json").read_text())
    assert report["capacity_per_s"] > 0 and report["unloaded_p99_ms"] > 0
    steps = report["steps"]
    assert [(s["bound"], s["queue_delay_target_ms"], s["factor"]) for s in steps] == [
        (8, 5.0, 0.5),
        (0, 5.0, 0.5),
    ]
    for step in steps:
        assert step["served_per_s"] > 0 and step["failed"] == 0
        assert step["p99_ratio_to_unloaded"] == pytest.approx(
            step["p99_ms"] / report["unloaded_p99_ms"]
        )
        # Envoy's access log: what was added before the endpoint, within the client's latency.
        assert 0 < step["added_p50_ms"] <= step["added_p99_ms"] < step["p99_ms"]
        assert step["added_p99_ratio_to_unloaded"] == pytest.approx(
            step["added_p99_ms"] / report["unloaded_added_p99_ms"]
        )
    assert "| maxPendingRequests | queueDelayTarget |" in result.stdout


@pytest.mark.parametrize("model", ["sim-model", "another-model"])
def test_overhead_benchmark_runs_the_picker_on_the_given_config(tmp_path: Path, model: str) -> None:
    # With the benchmark's model the picker serves every request on the stack's endpoints (the
    # file's endpoint is replaced); with only another model every request through the picker gets
    # a 404, while the direct and floor paths, which never see the config, serve every request.
    config = tmp_path / "picker.yaml"
    config.write_text(
        f"models: [{{name: {model}}}]\n"
        "endpoints: [{address: 127.0.0.1:9}]\n"
        "plugins: [{type: random-picker}]\n"
    )
    result = _small_overhead_run(tmp_path, 6, "1", "--modes", "streamed", "--config", str(config))
    served = model == "sim-model"
    assert result.returncode == (0 if served else 1), result.stdout + result.stderr
    (row,) = json.loads((tmp_path / "overhead.json").read_text())
    assert row["direct"]["errors"] == 0 and row["floor"]["errors"] == 0
    assert row["picker"]["requests"] == 6
    assert row["picker"]["errors"] == (0 if served else 6)


def test_overhead_config_errors_name_the_file_and_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("plugins: [{type: prefix-cache-scorer, parameters: {blockSizeChars: 0}}]\n")
    result = kv_picker("bench", "overhead", "--config", str(config), timeout_s=30)
    assert result.returncode == 2
    assert "--config" in result.stderr and "bad.yaml" in result.stderr
    assert "blockSizeChars" in result.stderr
    precise = kv_picker(
        "bench", "overhead", "--config", str(config), "--mode", "precise", timeout_s=30
    )
    assert precise.returncode == 2 and "exclude each other" in precise.stderr
