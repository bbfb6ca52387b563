"""``kv-picker bench sweep``: offline replay at several offered loads (see :mod:`.cli`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kv_picker_bench.harness.cli import sweep_main


def main(argv: Sequence[str] | None = None) -> int:
    return sweep_main(list(sys.argv[1:] if argv is None else argv))
