"""``python -m benchmarks <command>`` (also ``kv-picker bench <command>``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = {
    "overhead": "benchmarks.overhead",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        print("usage: kv-picker bench {" + ",".join(COMMANDS) + "} [--help]")
        print("  overhead   latency/throughput added by kv-picker vs Envoy routing directly")
        return 0 if args and args[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[args[0]])
    result: int = module.main(args[1:])
    return result


if __name__ == "__main__":
    sys.exit(main())
