"""The commands this package adds to ``kv-picker``: ``demo``, ``sim-endpoint``, ``bench``, ``tune``.

They reach the service's command line through the ``kv_picker.commands`` entry-point group
(declared in setup.py), so the service never imports this package. Each command imports its
module only when it runs: ``kv-picker --help`` stays fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence


class Command:
    """An extension command of ``kv-picker``.

    Args:
        help: one line for ``kv-picker --help``.
        target: ``module:function`` taking the arguments after the command name and returning
            the exit code.
    """

    def __init__(self, help: str, target: str) -> None:
        self.help = help
        self._target = target

    def __call__(self, argv: Sequence[str]) -> int:
        module_name, _, function_name = self._target.partition(":")
        function = getattr(importlib.import_module(module_name), function_name)
        code: int = function(list(argv))
        return code


demo = Command(
    "local stack: Envoy + kv-picker + 4 simulated endpoints, replay a shared-prefix workload "
    "under two profiles, print a table",
    "kv_picker_bench.demo:main",
)
sim_endpoint = Command(
    "run one simulated vLLM endpoint (see sim-endpoint --help)", "kv_picker_bench.sim.cli:main"
)
bench = Command("benchmarks (see bench --help)", "kv_picker_bench.__main__:main")
tune = Command(
    "search profile weights and scorer parameters on a trace, judge them on held-out time "
    "windows, write the best as a config (see tune --help)",
    "kv_picker_bench.harness.tune:main",
)
