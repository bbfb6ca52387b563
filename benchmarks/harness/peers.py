"""``kv-picker bench peers``: the live replay through vllm-router and sglang-router.

The peer routers install from the package index (``pip install vllm-router sglang-router``,
each in its own virtual environment, as reference peers.md §1.1 describes); this command finds
them through ``--vllm-router-bin`` / ``--sglang-router-bin``, ``$VLLM_ROUTER_BIN`` /
``$SGLANG_ROUTER_BIN`` or PATH. It shares everything else with live mode
(:mod:`kv_picker_bench.harness.live`): same endpoints, client, schedule and table.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kv_picker_bench.harness.args import run_command
from kv_picker_bench.harness.live import run_live


def main(argv: Sequence[str] | None = None) -> int:
    """``kv-picker bench peers``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return run_command("peers", args, lambda: run_live(args, "peers"))
