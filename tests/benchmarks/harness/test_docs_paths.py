"""Docs and committed results speak of the repository only, never of this machine's folders.

Results folders, ``benchmarks/RESULTS.md`` and the README are read on other machines; a path
such as ``/work/shared/traces/...`` or ``/tmp/peers-vllm/bin/...`` means nothing there. Paths
in them are relative to the repository root (``../shared/traces/conversation_trace.jsonl``).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SUFFIXES = frozenset({".md", ".txt", ".json", ".yaml", ".yml"})
# Folders that hold checkouts, scratch files and home directories on common machines.
COMMON_PREFIXES = ("/work/", "/tmp/", "/root/", "/home/", "/Users/", "/private/var/")


def _machine_prefixes() -> list[str]:
    """Common prefixes, and the folders this machine keeps the checkout, scratch files and home in."""
    prefixes = set(COMMON_PREFIXES)
    for folder in (ROOT.parent, Path.home(), Path(tempfile.gettempdir())):
        if len(folder.parts) > 1:  # not the file system's root
            prefixes.add(f"{folder}/")
    return sorted(prefixes)


# A prefix counts only where a path starts: not inside a URL or a relative path (../tmp/x).
MACHINE_PATH = re.compile(
    r"(?<![\w.~/-])(?:" + "|".join(re.escape(p) for p in _machine_prefixes()) + r")[^\s\"'`)\]]*"
)


def machine_paths(text: str) -> list[str]:
    """The absolute paths of a machine that ``text`` names."""
    return MACHINE_PATH.findall(text)


def scan(files: Iterable[Path], root: Path) -> dict[str, list[str]]:
    """File (relative to ``root``) -> the machine paths it names, for files that name any."""
    found: dict[str, list[str]] = {}
    for path in files:
        hits = machine_paths(path.read_text(encoding="utf-8", errors="replace"))
        if hits:
            found[str(path.relative_to(root))] = hits
    return found


def documents(root: Path) -> list[Path]:
    """The README and every Markdown, text, JSON and YAML file under ``benchmarks/``."""
    files = [p for p in (root / "benchmarks").rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    return sorted([root / "README.md", *files])


def test_docs_and_results_name_no_path_of_this_machine() -> None:
    files = documents(ROOT)
    names = {str(p.relative_to(ROOT)) for p in files}
    # The scan covers what it is for: a vacuous file list would pass anything.
    assert {"README.md", "benchmarks/RESULTS.md"} <= names
    assert any(name.endswith("command.txt") for name in names)
    assert any(name.endswith("results.json") for name in names)
    assert scan(files, ROOT) == {}


@pytest.mark.parametrize(
    "text",
    [
        "kv-picker bench replay --trace /work/shared/traces/conversation_trace.jsonl",
        "# cwd: /work/main",
        "--vllm-router-bin /tmp/peers-vllm/bin/vllm-router",
        '"source": "/root/traces/x.jsonl"',
        "see (/home/alice/kv-picker/README.md)",
        "`/Users/bob/src/kv-picker`",
        f"{ROOT}/benchmarks/RESULTS.md",
    ],
)
def test_a_machine_path_is_found(text: str) -> None:
    assert machine_paths(text)


@pytest.mark.parametrize(
    "text",
    [
        "kv-picker bench replay --trace ../shared/traces/conversation_trace.jsonl",
        "--out benchmarks/results/conversation-x1 --vllm-router-bin vllm-router",
        "under `/usr/bin/time`",
        "https://github.com/org/repo/tree/main/work/tmp/notes.md",
        "python3 -m venv ../peers-vllm && ../tmp/x",
    ],
)
def test_repository_paths_pass(text: str) -> None:
    assert machine_paths(text) == []


def test_scan_reports_the_file_and_the_path(tmp_path: Path) -> None:
    results = tmp_path / "benchmarks" / "results" / "run"
    results.mkdir(parents=True)
    (tmp_path / "README.md").write_text("kv-picker bench replay --trace conversation\n")
    (results / "command.txt").write_text(
        "kv-picker bench replay --trace ../shared/traces/t.jsonl\n# cwd: /work/main\n"
    )
    (results / "results.json").write_text('{"source": "/tmp/traces/t.jsonl"}\n')
    (results / "plot.png").write_bytes(b"/work/not-a-document")
    assert scan(documents(tmp_path), tmp_path) == {
        "benchmarks/results/run/command.txt": ["/work/main"],
        "benchmarks/results/run/results.json": ["/tmp/traces/t.jsonl"],
    }
