"""``kv-picker bench <command>`` (also ``python -m kv_picker_bench <command>``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = {
    "overhead": "kv_picker_bench.overhead",
    "overload": "kv_picker_bench.overload",
    "workers": "kv_picker_bench.workers_bench",
    "pd": "kv_picker_bench.pd_bench",
    "kv-index": "kv_picker_bench.kv_index_bench",
    "precise-vs-approx": "kv_picker_bench.precise_vs_approx",
    "replay": "kv_picker_bench.harness.replay",
    "sweep": "kv_picker_bench.harness.sweep",
    "matrix": "kv_picker_bench.harness.matrix",
    "families": "kv_picker_bench.harness.families",
    "moves": "kv_picker_bench.harness.moves",
    "live": "kv_picker_bench.harness.live",
    "peers": "kv_picker_bench.harness.peers",
    "tracing": "kv_picker_bench.tracing_overhead",
    "prefix-match": "kv_picker_bench.prefix_match_cost",
    "scorer-cost": "kv_picker_bench.scorer_cost",
    "faults": "kv_picker_bench.faults.cli",
    "soak": "kv_picker_bench.faults.soak",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        print("usage: kv-picker bench {" + ",".join(COMMANDS) + "} [--help]")
        print("  overhead   latency/throughput added by kv-picker vs Envoy routing directly")
        print("  overload   offered vs served vs latency past one picker's capacity (shedding)")
        print("  workers    serve --workers N pinned to 1 or 2 cores: throughput, CPU per request")
        print("  pd         P/D vs aggregated (hardware-aware, -blind) on a heterogeneous pool")
        print("  kv-index   precise KV index: event ingestion, lookup latency, memory, Redis")
        print("  precise-vs-approx  KV-event routing vs approximate when caches evict/restart")
        print("  replay     offline trace replay: every routing policy on the cluster simulator")
        print("  sweep      offline replay at several offered loads x policies")
        print("  matrix     every policy on workload families x loads x clusters x timings")
        print("  families   the trace generators --trace accepts, their parameters and ranges")
        print("  moves      one matrix cell: requests placed away from their context's holder, why")
        print("  live       trace slice through real Envoy + kv-picker + simulated endpoints")
        print("  peers      the same slice through vllm-router / sglang-router")
        print("  tracing    per-request cost of OpenTelemetry tracing, off and on (in process)")
        print("  prefix-match  per-request cost of matching long prompts further (in process)")
        print("  scorer-cost  per-request cost of each of the default's scorers (in process)")
        print("  faults     fault suite: kills, bad reloads and inputs, gRPC abuse, outages")
        print("  soak       long run: steady load, restarts, reloads; RSS, fds, tasks over time")
        return 0 if args and args[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[args[0]])
    result: int = module.main(args[1:])
    return result


if __name__ == "__main__":
    sys.exit(main())
