"""The layering contracts in pyproject.toml hold, and a broken one is reported.

import-linter follows every import, direct or through other modules, in the installed
packages; the second test proves the check is not vacuous by asking it for a contract this
code base is known to break.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    script = "import sys; from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", script, "--no-cache", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_layering_contracts_hold() -> None:
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_broken_contract_is_reported(tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text(
        """
[tool.importlinter]
root_packages = ["kv_picker", "kv_picker_bench"]

[[tool.importlinter.contracts]]
name = "The benchmarks never import the service (false: they drive it)"
type = "forbidden"
source_modules = ["kv_picker_bench.harness.simulator"]
forbidden_modules = ["kv_picker.scheduling"]
"""
    )
    result = lint_imports("--config", str(config))
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert "kv_picker_bench.harness.simulator -> kv_picker.scheduling" in result.stdout
