"""The harness's commands share their flags through ``args`` and never import each other.

grimp (import-linter's import graph) sees every import in the installed package, those inside
functions included, so a lazy import that brings the cycle back fails here.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import grimp
import pytest

PACKAGE = "kv_picker_bench.harness"
COMMANDS = ("cli", "live", "peers", "replay", "sweep")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("kv_picker_bench", cache_dir=None)


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(module-level, nested) names of the package's modules that ``module`` imports from."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    every = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return top, every - top


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("cli", "live"),
        ("live", "cli"),
        ("args", "cli"),
        ("args", "live"),
        ("args", "peers"),
        ("args", "replay"),
        ("args", "sweep"),
    ],
)
def test_no_import_chain(graph: grimp.ImportGraph, importer: str, imported: str) -> None:
    chain = graph.find_shortest_chain(
        importer=f"{PACKAGE}.{importer}", imported=f"{PACKAGE}.{imported}"
    )
    assert chain is None, " -> ".join(chain or ())


@pytest.mark.parametrize("command", COMMANDS)
def test_commands_import_the_harness_at_module_level(command: str) -> None:
    top, nested = _imports(f"{PACKAGE}.{command}")
    assert not {name for name in nested if name.startswith(PACKAGE)}, nested
    if command in ("cli", "live", "peers"):
        assert f"{PACKAGE}.args" in top


def test_the_checks_see_imports_inside_functions(graph: grimp.ImportGraph) -> None:
    # traces.py imports the simulated tokenizer inside a function: both checks above see such
    # an import, so they would catch one between the commands.
    assert graph.direct_import_exists(
        importer=f"{PACKAGE}.traces", imported="kv_picker_bench.sim.tokenizer"
    )
    _, nested = _imports(f"{PACKAGE}.traces")
    assert "kv_picker_bench.sim.tokenizer" in nested
