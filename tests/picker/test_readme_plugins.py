"""The README's plugin table against the plugins' Params: a parameter it names must exist (a
config copied from it would be refused as an unknown key), and every parameter must be named."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kv_picker.plugins import builtin_registry

README = Path(__file__).resolve().parents[2] / "README.md"
INTERNAL = "kv_picker.internal"
NAME = "kv_picker.key"


def _rows() -> list[tuple[list[str], str, str]]:
    """(plugin types, the whole row, its parameters cell) of the table under "### Plugins"."""
    section = README.read_text(encoding="utf-8").split("\n### Plugins\n", 1)[1]
    section = section.split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((re.findall(r"`([a-z-]+)`", cells[0]), line, cells[-1]))
    return rows


def _yaml_names(params: type) -> set[str]:
    names = set()
    for f in dataclasses.fields(params):
        if f.metadata.get(INTERNAL):
            continue
        names.add(f.metadata.get(NAME, f.name))
    return names


ROWS = _rows()


def test_the_table_lists_every_built_in_plugin() -> None:
    listed = {t for types, _, _ in ROWS for t in types}
    assert set(builtin_registry(include_entry_points=False).known()) <= listed


@pytest.mark.parametrize(("types", "row", "cell"), ROWS, ids=[" / ".join(r[0]) for r in ROWS])
def test_the_parameters_named_are_the_plugins_own(types: list[str], row: str, cell: str) -> None:
    registry = builtin_registry(include_entry_points=False)
    named = set(re.findall(r"`([A-Za-z][A-Za-z0-9]*)` \(", cell))  # `name` (default...)
    for type_name in types:
        own = _yaml_names(registry.get(type_name).Params)
        assert named <= own, f"{type_name}: the README names {sorted(named - own)}"
        mentioned = set(re.findall(r"`([A-Za-z][A-Za-z0-9]*)[`:]", row))  # or `name: value`
        assert own <= mentioned, f"{type_name}: the README omits {sorted(own - mentioned)}"
