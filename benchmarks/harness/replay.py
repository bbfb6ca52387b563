"""``kv-picker bench replay``: offline trace replay of every policy (see :mod:`.cli`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kv_picker_bench.harness.cli import replay_main


def main(argv: Sequence[str] | None = None) -> int:
    return replay_main(list(sys.argv[1:] if argv is None else argv))
