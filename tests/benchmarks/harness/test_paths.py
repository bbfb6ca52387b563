"""Recorded commands carry no absolute paths; ``--trace NAME`` finds a trace by its short name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_picker_bench.harness import paths
from kv_picker_bench.harness.args import record_command
from kv_picker_bench.harness.cli import replay_main
from kv_picker_bench.harness.paths import (
    TRACES_ENV,
    find_trace,
    portable_argv,
    portable_path,
    portable_trace,
    repository_root,
    traces_dir,
)

MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [0, 1]},
    {"timestamp": 500, "input_length": 700, "output_length": 8, "hash_ids": [0, 2]},
    {"timestamp": 900, "input_length": 1100, "output_length": 8, "hash_ids": [0, 1, 3]},
]


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A repository and, next to it, shared/traces with one Mooncake trace."""
    root = tmp_path / "work" / "repo"
    (root / "benchmarks" / "profiles").mkdir(parents=True)
    (root / "benchmarks" / "profiles" / "mine.yaml").write_text("plugins: []\n")
    traces = tmp_path / "work" / "shared" / "traces"
    traces.mkdir(parents=True)
    rows = "".join(json.dumps(row) + "\n" for row in MOONCAKE_ROWS)
    (traces / "conversation_trace.jsonl").write_text(rows)
    return root, traces


def test_paths_in_and_next_to_the_repository_are_relative_to_its_root(
    layout: tuple[Path, Path], tmp_path: Path
) -> None:
    root, traces = layout
    assert portable_path(root / "benchmarks" / "profiles", root) == "benchmarks/profiles"
    assert (
        portable_path(traces / "conversation_trace.jsonl", root)
        == "../shared/traces/conversation_trace.jsonl"
    )
    assert portable_path(root, root) == "."


def test_paths_elsewhere_keep_their_name_only(layout: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = layout
    assert portable_path(tmp_path / "peers-vllm" / "bin" / "vllm-router", root) == "vllm-router"


def test_a_repository_at_the_top_shares_nothing_with_its_parent() -> None:
    # Not ../tmp/run: the file system's root is no shared parent folder.
    assert portable_path("/tmp/run", Path("/repo")) == "run"
    assert portable_path("/repo/benchmarks", Path("/repo")) == "benchmarks"


def test_relative_paths_are_taken_from_the_working_directory(
    layout: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = layout
    monkeypatch.chdir(root / "benchmarks")
    assert portable_path("profiles/mine.yaml", root) == "benchmarks/profiles/mine.yaml"


def test_recorded_arguments(layout: tuple[Path, Path], tmp_path: Path) -> None:
    root, traces = layout
    trace = str(traces / "conversation_trace.jsonl")
    profile = str(root / "benchmarks" / "profiles" / "mine.yaml")
    argv = [
        "--trace",
        trace,
        "--policy",
        "kv-picker",
        "--policy",
        f"mine={profile}",
        "--policy",
        profile,
        "--title",
        "P/D: 4 prefill + 12 decode",
        "--vllm-router-bin",
        "/opt/peers-vllm/bin/vllm-router",
        f"--sglang-router-bin={tmp_path}/peers-sglang/bin/sglang-router",
        "--out",
        str(root / "benchmarks" / "results" / "run"),
        "--quiet",
        "--window",
        "-5:10",
    ]
    assert portable_argv(argv, root, traces) == [
        "--trace",
        "../shared/traces/conversation_trace.jsonl",
        "--policy",
        "kv-picker",
        "--policy",
        "mine=benchmarks/profiles/mine.yaml",
        "--policy",
        "benchmarks/profiles/mine.yaml",
        "--title",
        "P/D: 4 prefill + 12 decode",
        "--vllm-router-bin",
        "vllm-router",
        "--sglang-router-bin=sglang-router",
        "--out",
        "benchmarks/results/run",
        "--quiet",
        "--window",
        "-5:10",
    ]


def test_abbreviated_options_and_stray_absolute_paths_are_recorded_too(
    layout: tuple[Path, Path],
) -> None:
    root, traces = layout
    trace = str(traces / "conversation_trace.jsonl")
    assert portable_argv(["--trac", trace, "--title", "/srv/x"], root, traces) == [
        "--trac",
        "../shared/traces/conversation_trace.jsonl",
        "--title",
        "x",
    ]


def test_generators_and_short_names_are_recorded_as_given(layout: tuple[Path, Path]) -> None:
    root, traces = layout
    for spec in ("llm-d", "shared-prefix:groups=3,rate=2", "conversation"):
        assert portable_trace(spec, root, traces) == spec


def test_a_trace_outside_the_repository_is_recorded_by_its_short_name(tmp_path: Path) -> None:
    root = tmp_path / "checkout" / "repo"
    root.mkdir(parents=True)
    traces = tmp_path / "data"
    traces.mkdir()
    (traces / "toolagent_trace.jsonl").write_text("{}\n")
    (traces / "other.jsonl").write_text("{}\n")
    (tmp_path / "loose.jsonl").write_text("{}\n")
    assert portable_trace(str(traces / "toolagent_trace.jsonl"), root, traces) == "toolagent"
    assert portable_trace(str(traces / "other.jsonl"), root, traces) == "other"
    assert portable_trace(str(tmp_path / "loose.jsonl"), root, traces) == "loose.jsonl"


def test_find_trace(layout: tuple[Path, Path]) -> None:
    _, traces = layout
    assert find_trace("conversation", traces) == traces / "conversation_trace.jsonl"
    assert find_trace("conversation_trace.jsonl", traces) == traces / "conversation_trace.jsonl"
    assert find_trace("toolagent", traces) is None
    assert find_trace("../traces/conversation", traces) is None


def test_traces_dir(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    assert traces_dir(root, environ={}) == tmp_path / "shared" / "traces"
    assert traces_dir(root, environ={TRACES_ENV: str(tmp_path / "t")}) == tmp_path / "t"


def test_this_checkout_is_the_repository_root() -> None:
    root = repository_root()
    assert root is not None
    assert (root / "benchmarks" / "harness" / "paths.py").is_file()


@pytest.fixture
def checkout_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The repository root seen by the harness, in a folder of its own under ``tmp_path``: a
    checkout whose parent folder holds the temporary folders (one cloned into /tmp) would
    otherwise record them relative to itself, as it records ../shared/traces."""
    root = tmp_path / "checkout" / "repo"
    monkeypatch.setattr(paths, "repository_root", lambda: root)
    return root


@pytest.mark.usefixtures("checkout_elsewhere")
def test_command_txt_names_no_absolute_path(tmp_path: Path) -> None:
    argv = ["--trace", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "run")]
    text = record_command(tmp_path, "replay", argv)
    assert text == "kv-picker bench replay --trace x.jsonl --out run"
    recorded = (tmp_path / "command.txt").read_text()
    assert recorded == f"{text}\n# paths are relative to the repository root\n"


@pytest.mark.usefixtures("checkout_elsewhere")
def test_replay_by_short_name_records_no_absolute_path(
    layout: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, traces = layout
    monkeypatch.setenv(TRACES_ENV, str(traces))
    out = tmp_path / "run"
    argv = ["--trace", "conversation", "--endpoints", "2", "--policy", "random"]
    argv += ["--out", str(out), "--quiet", "--no-plots", "--jobs", "1"]
    assert replay_main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["command"].startswith("kv-picker bench replay --trace conversation ")
    assert document["trace"]["source"] == "conversation_trace.jsonl"
    assert document["trace"]["requests"] == len(MOONCAKE_ROWS)
    for name in ("command.txt", "results.md", "results.json"):
        assert str(tmp_path) not in (out / name).read_text()


def test_an_unknown_short_name_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    assert replay_main(["--trace", "nosuch", "--out", str(tmp_path / "x"), "--quiet"]) == 2
    error = capsys.readouterr().err
    assert "nosuch_trace.jsonl" in error and TRACES_ENV in error
