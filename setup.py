"""Which import packages the distribution installs, and from which folders.

One import root for the service, mapped from the repository's fixed folders::

    kv_picker          <- picker/
    kv_picker.scorers  <- scorers/
    kv_picker_bench    <- benchmarks/      (the harness, simulator and local stack)

Everything else is in pyproject.toml. This file exists for one decision pyproject.toml cannot
express: the service image (Dockerfile) copies picker/ and scorers/ only, and must build a
wheel without the benchmark package or the commands it adds to ``kv-picker``.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
FOLDERS = {"kv_picker": "picker", "kv_picker.scorers": "scorers"}
if (ROOT / "benchmarks" / "__init__.py").exists():
    FOLDERS["kv_picker_bench"] = "benchmarks"


def _packages() -> list[str]:
    packages = []
    for root_package, folder in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / folder)
            packages.append(".".join((root_package, *relative.parts)))
    return sorted(set(packages))


ENTRY_POINTS = {"console_scripts": ["kv-picker = kv_picker.cli:main"]}
if "kv_picker_bench" in FOLDERS:
    # Extension commands of `kv-picker` (see kv_picker.cli): the service never imports them.
    ENTRY_POINTS["kv_picker.commands"] = [
        "demo = kv_picker_bench.commands:demo",
        "sim-endpoint = kv_picker_bench.commands:sim_endpoint",
        "bench = kv_picker_bench.commands:bench",
        "tune = kv_picker_bench.commands:tune",
    ]

setup(package_dir=FOLDERS, packages=_packages(), entry_points=ENTRY_POINTS)
