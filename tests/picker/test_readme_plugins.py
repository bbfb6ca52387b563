"""The README against the code: the plugin table's parameters are the plugins' own (a config
copied from it would be refused for an unknown key), every parameter is named, and every
example config is accepted."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from kv_picker.config import parse_config
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


def _config_blocks() -> list[str]:
    """The README's YAML blocks that are EndpointPickerConfig documents or sections of one (not
    `kv-picker tune`'s search spaces)."""
    text = README.read_text(encoding="utf-8")
    return [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "dimensions:" not in b]


CONFIG_BLOCKS = _config_blocks()


@pytest.mark.parametrize(
    "block", CONFIG_BLOCKS, ids=[f"block{i}" for i in range(len(CONFIG_BLOCKS))]
)
def test_every_config_in_the_readme_is_accepted(block: str) -> None:
    # The one path a reader must supply (a tokenizer directory) points at the shipped one.
    tokenizer = Path(__file__).resolve().parents[2] / "benchmarks" / "tokenizer"
    document = yaml.safe_load(block.replace("/models/llama", str(tokenizer)))
    assert isinstance(document, dict)
    parse_config(document, builtin_registry(include_entry_points=False))


def test_the_readme_has_its_config_examples() -> None:
    assert len(CONFIG_BLOCKS) >= 5
