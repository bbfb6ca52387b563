"""Flags of ``kv-picker bench replay|sweep|live|peers`` and what they turn into.

Why a module of its own: the offline commands (:mod:`~kv_picker_bench.harness.cli`) and the live
ones (:mod:`~kv_picker_bench.harness.live`, :mod:`~kv_picker_bench.harness.peers`) share their
trace, cluster, policy and output flags, their results folders and their error handling. Both
import this module, and it imports neither, so the commands do not import each other.

Errors: a bad flag value raises :class:`UsageError`; :func:`run_command` reports it, like a bad
trace or config, as ``kv-picker bench <command>: error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kv_picker.decode import parse_duration_s
from kv_picker.errors import ConfigError
from kv_picker_bench.harness.paths import (
    TRACES_ENV,
    find_trace,
    is_trace_name,
    portable_argv,
    portable_path,
    repository_root,
    traces_dir,
)
from kv_picker_bench.harness.policies import Policy, harness_registry, pd_variant, resolve_policies
from kv_picker_bench.harness.simulator import ClusterConfig, EndpointSetup
from kv_picker_bench.harness.traces import (
    GENERATORS,
    Trace,
    TraceError,
    parse_trace_spec,
    slice_trace,
)
from kv_picker_bench.sim.engine import CACHED_WHEN, HARDWARE_CLASSES
from kv_picker_bench.sim.timing import (
    DEFAULT_TIMING,
    TIMING_PROFILES,
    TimingModel,
    describe_profiles,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
RESULTS_DIR = Path("results")

PEER_ROUTERS = ("vllm-router", "sglang-router")
DEFAULT_PEERS = (
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
    "sglang-router:round_robin",
    "sglang-router:cache_aware",
)
"""What ``kv-picker bench peers`` runs without ``--peer``."""


class UsageError(Exception):
    """A bad flag value; reported as ``kv-picker bench: error: ...`` with exit code 2."""


# ------------------------------------------------------------------------------ parsers


def add_trace_arguments(
    parser: argparse.ArgumentParser, with_load: bool = True, with_cell: bool = False
) -> None:
    """Adds ``--trace``, ``--first``, ``--window`` and (unless a sweep) ``--load``.

    Args:
        parser: The command's parser.
        with_load: Add ``--load`` (a sweep has ``--loads`` instead).
        with_cell: Add ``--cell`` and ``--family-seed`` as the other way to name the requests
            (and the cluster): one routing-matrix cell. ``--trace`` is then optional, and the
            command checks that exactly one of the two is given (:func:`check_cell_arguments`).
    """
    group = parser.add_argument_group("trace")
    group.add_argument(
        "--trace",
        required=not with_cell,
        metavar="SPEC",
        help="a trace file (Mooncake JSONL or kv-picker JSONL, detected from the first line), "
        f"a trace NAME found as NAME_trace.jsonl or NAME.jsonl in ${TRACES_ENV} (default: "
        "shared/traces next to the repository; e.g. 'conversation' for Mooncake's "
        "conversation_trace.jsonl), or a generator NAME[:KEY=VALUE,...] with NAME one of "
        f"{', '.join(GENERATORS)} (e.g. 'zipf-prefix:seed=1,requests=400'; 'seed=N' draws the "
        "family's ranged parameters, 'llm-d' is llm-d's published workload and load ladder; "
        "'kv-picker bench families' lists their parameters)",
    )
    group.add_argument("--first", type=int, metavar="N", help="keep the first N requests")
    group.add_argument(
        "--window",
        metavar="START:END",
        help="keep requests arriving in [START, END) seconds of trace time (applied before --first)",
    )
    if with_cell:
        group.add_argument(
            "--cell",
            metavar="FAMILY/LOAD/CLUSTER/TIMING",
            help="instead of --trace and the cluster flags: one cell of 'kv-picker bench matrix', "
            "its requests at its load on its cluster, e.g. zipf-prefix/0.3/small4/"
            "llama-3.1-8b-h100 (the pd cluster runs offline only; --first N keeps its first N "
            "requests)",
        )
        group.add_argument(
            "--family-seed",
            type=int,
            default=None,
            metavar="N",
            help="with --cell: the family's draw, as the matrix's --family-seed (default 1)",
        )
    if with_load:
        group.add_argument(
            "--load",
            type=float,
            default=1.0,
            metavar="X",
            help="multiply the arrival rate by X (timestamps divided by X; default 1)",
        )


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the simulated cluster's flags: endpoints, capacity, batching, scraping and P/D.

    Args:
        parser: The command's parser.
    """
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--endpoints", type=int, default=16, help="identical H100 endpoints (default 16)"
    )
    group.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="ROLE[:HW[:BLOCKS]][xCOUNT]",
        help="heterogeneous cluster instead of --endpoints, repeatable: e.g. prefill:H100x4 "
        f"decode:H100x12 both:A100:16384x2; roles both|prefill|decode, hardware "
        f"{'|'.join(sorted(HARDWARE_CLASSES))}",
    )
    group.add_argument(
        "--timing",
        choices=tuple(TIMING_PROFILES),
        default=DEFAULT_TIMING.name,
        metavar="NAME",
        help=f"timing profile of an H100-class endpoint, scaled by hardware class (default "
        f"{DEFAULT_TIMING.name}): {describe_profiles()}",
    )
    group.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV capacity of an H100-class endpoint in blocks, scaled by hardware class "
        "(default: the timing profile's, e.g. "
        f"{DEFAULT_TIMING.kv_capacity_tokens:,} tokens for {DEFAULT_TIMING.name}, divided by "
        "--block-size)",
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="per endpoint (64)")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="step token budget (8192)"
    )
    group.add_argument(
        "--max-model-len", type=int, default=131_072, help="longest prompt+output (131072)"
    )
    group.add_argument(
        "--scrape-interval",
        default="50ms",
        help="simulated metrics scrape period; scorers see values up to this old (50ms)",
    )
    group.add_argument(
        "--cached-when",
        choices=CACHED_WHEN,
        default=CACHED_WHEN[0],
        help="when a prompt block becomes a cache hit on a simulated endpoint: scheduled (from "
        "the step that schedules its prefill chunk, as vLLM v1; the default) or computed (once "
        "that step has ended: the model of results stored before scheduled)",
    )
    group.add_argument(
        "--kv-event-delay",
        default="0",
        help="delay of KV events reaching event-driven plugins, e.g. 20ms (0)",
    )
    group.add_argument(
        "--pd",
        action="store_true",
        help="P/D: run each policy as a decode and a prefill profile under pd-profile-handler "
        "(give prefill and decode endpoints with --endpoint)",
    )
    group.add_argument(
        "--pd-threshold-tokens",
        type=int,
        default=1,
        help="with --pd: disaggregate when at least this many prompt tokens are not cached on "
        "the chosen decode endpoint (pd-profile-handler's nonCachedTokens; default 1)",
    )
    group.add_argument(
        "--transfer-gbps",
        type=float,
        default=200.0,
        help="P/D KV transfer bandwidth in Gbit/s (200)",
    )
    group.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="KV bytes per token, for transfer time and volume (default: the timing profile's, "
        f"e.g. {DEFAULT_TIMING.kv_bytes_per_token:,} for {DEFAULT_TIMING.name})",
    )


def add_policy_arguments(parser: argparse.ArgumentParser, offline: bool = True) -> None:
    """Adds ``--policy`` (repeatable) and ``--seed``.

    Args:
        parser: The command's parser.
        offline: Whether the command is an offline one (the flags are the same for both).
    """
    group = parser.add_argument_group("policies")
    group.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME|NAME=FILE|FILE",
        help="a baseline (random, round-robin, least-queue, gie-default, sglang-cache-aware, "
        "dynamo-cost, kv-picker), 'baselines' for all of them (the default), or an "
        "EndpointPickerConfig YAML file, optionally named; repeatable",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of the policies (0)")


def add_output_arguments(parser: argparse.ArgumentParser, offline: bool = True) -> None:
    """Adds the results folder, title, plots and progress flags.

    Args:
        parser: The command's parser.
        offline: Also add ``--jobs`` and ``--save-requests`` (offline commands only).
    """
    group = parser.add_argument_group("output")
    group.add_argument("--out", type=Path, help="results folder (default: results/<time>-...)")
    group.add_argument("--title", default="", help="title of the Markdown report")
    group.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    group.add_argument("--quiet", action="store_true", help="no progress bar")
    if offline:
        group.add_argument(
            "--jobs",
            type=int,
            default=min(2, os.cpu_count() or 1),
            help="worker processes for the (load, policy) jobs (default: up to 2)",
        )
        group.add_argument(
            "--save-requests",
            action="store_true",
            help="also write one JSONL line per request and policy",
        )


def add_live_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Adds the live replay's flags: time scale, client, Envoy body mode and peer routers.

    Args:
        parser: The command's parser.
        command: ``live`` or ``peers`` (only ``live`` runs Envoy, so only it has
            ``--body-mode``; only ``peers`` defaults ``--peer``).
    """
    group = parser.add_argument_group("live replay")
    group.add_argument(
        "--time-scale",
        type=float,
        default=0.05,
        help="wall seconds per model second, for the endpoints and the arrival schedule",
    )
    group.add_argument(
        "--timeout", type=float, default=300.0, help="per-request timeout in wall seconds"
    )
    group.add_argument(
        "--keep-alive",
        action="store_true",
        help="reuse client connections (default: one fresh connection per request)",
    )
    if command == "live":
        group.add_argument(
            "--body-mode",
            choices=("FULL_DUPLEX_STREAMED", "BUFFERED"),
            default="FULL_DUPLEX_STREAMED",
            help="Envoy's ext_proc request body mode",
        )
        group.add_argument(
            "--picker-workers",
            type=int,
            default=1,
            help="kv-picker serve --workers N (default 1: one process)",
        )
        group.add_argument(
            "--responses",
            choices=("full", "lean"),
            default="full",
            help="what Envoy shows the picker of each response: full (every chunk: the GIE's "
            "configuration) or lean (its headers and end only; a prefill ends when the "
            "endpoint's scraped first-token count says so)",
        )
        group.add_argument(
            "--no-offline",
            dest="offline",
            action="store_false",
            help="skip the offline counterpart (by default each --policy is also replayed "
            "offline, scraped as often in model time as live, and the report compares the two)",
        )
    group.add_argument(
        "--router-cpus",
        metavar="LIST",
        default=None,
        help="run the router (kv-picker with Envoy, or a peer router) on these CPUs and the "
        "endpoints and the client on the others, e.g. 1 on a 2-core host: each router then "
        "has CPUs of its own, as in a deployment, and its CPU cost does not slow the endpoints "
        "(Linux; default: every process shares every CPU)",
    )
    group.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="ROUTER:POLICY",
        help="a peer router run on the same endpoints, e.g. vllm-router:cache_aware, "
        "sglang-router:round_robin; repeatable"
        + (f" (default: {' '.join(DEFAULT_PEERS)})" if command == "peers" else ""),
    )
    group.add_argument(
        "--vllm-router-bin",
        default=None,
        help="vllm-router executable (default: $VLLM_ROUTER_BIN or PATH)",
    )
    group.add_argument(
        "--sglang-router-bin",
        default=None,
        help="sglang-router executable (default: $SGLANG_ROUTER_BIN or PATH)",
    )


def build_parser(command: str) -> argparse.ArgumentParser:
    """The argument parser of one harness command.

    Args:
        command: ``replay``, ``sweep``, ``live`` or ``peers``.
    """
    descriptions = {
        "replay": "Replay a trace offline through the cluster simulator, every policy on the "
        "same requests, and write a Markdown table, JSON and plots.",
        "sweep": "Offline replay at several offered loads (arrival rate multipliers) x policies; "
        "adds a TTFT-vs-load plot.",
        "live": "Replay a trace slice, time-scaled, through real Envoy + kv-picker + simulated "
        "vLLM endpoints over HTTP (kv-picker policies only).",
        "peers": "Replay a trace slice through vllm-router and/or sglang-router in front of the "
        "same simulated endpoints, for comparison with live mode.",
    }
    parser = argparse.ArgumentParser(
        prog=f"kv-picker bench {command}",
        description=descriptions[command],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter
        if command not in ("replay", "sweep")
        else argparse.HelpFormatter,
    )
    offline = command in ("replay", "sweep")
    add_trace_arguments(parser, with_load=command != "sweep", with_cell=not offline)
    if command == "sweep":
        parser.add_argument(
            "--loads",
            default="1,2,4,8",
            help="comma-separated arrival-rate multipliers (default 1,2,4,8)",
        )
    add_cluster_arguments(parser)
    if command != "peers":
        add_policy_arguments(parser, offline)
    add_output_arguments(parser, offline)
    if not offline:
        add_live_arguments(parser, command)
    return parser


# The flags --cell replaces: the requests' and the cluster's.
_CELL_REPLACES = (
    "window", "load", "endpoints", "endpoint", "timing", "num_gpu_blocks", "block_size",
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "scrape_interval",
    "kv_event_delay", "pd", "pd_threshold_tokens", "transfer_gbps", "kv_bytes_per_token",
)  # fmt: skip


def check_cell_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exactly one of ``--trace`` and ``--cell``; with ``--cell``, none of the flags it sets.

    Raises:
        UsageError: both or neither given, a flag the cell sets given too, or ``--family-seed``
            without ``--cell``.
    """
    cell = getattr(args, "cell", None)
    if (args.trace is None) == (cell is None):
        raise UsageError("give one of --trace and --cell")
    if cell is None:
        if args.family_seed is not None:
            raise UsageError("--family-seed draws a matrix family: it goes with --cell")
        return
    given = [
        "--" + dest.replace("_", "-")
        for dest in _CELL_REPLACES
        if hasattr(args, dest) and getattr(args, dest) != parser.get_default(dest)
    ]
    if given:
        raise UsageError(
            f"--cell {cell!r} sets the requests, their load and the cluster; drop "
            + ", ".join(given)
        )


# ------------------------------------------------------------------------------ values


def parse_window(text: str | None) -> tuple[float, float] | None:
    """``--window START:END`` as seconds of trace time; ``None`` when not given.

    Raises:
        UsageError: If the value is not two numbers.
    """
    if not text:
        return None
    start, _, end = text.partition(":")
    try:
        return float(start), float(end)
    except ValueError:
        raise UsageError(f"--window {text!r}: expected START:END in seconds") from None


_ENDPOINT_RE = re.compile(r"^(both|prefill|decode)(?::([A-Za-z0-9]+?))?(?::(\d+))?(?:x(\d+))?$")


def cluster_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The simulated cluster the cluster flags describe.

    ``--endpoint`` items (``ROLE[:HW[:BLOCKS]][xCOUNT]``) take precedence over ``--endpoints``.
    The ``--timing`` profile also gives the KV capacity and bytes per token not set explicitly.

    Raises:
        UsageError: If an endpoint item, a duration or a size is invalid.
    """
    endpoints: list[EndpointSetup] = []
    for item in args.endpoint:
        match = _ENDPOINT_RE.match(item)
        if not match:
            raise UsageError(
                f"--endpoint {item!r}: expected ROLE[:HW[:BLOCKS]][xCOUNT], e.g. decode:H100x4"
            )
        role, hardware, blocks, count = match.groups()
        hardware = hardware or "H100"
        if hardware not in HARDWARE_CLASSES:
            raise UsageError(
                f"--endpoint {item!r}: unknown hardware {hardware!r}; known: "
                f"{', '.join(sorted(HARDWARE_CLASSES))}"
            )
        setup = EndpointSetup(role, hardware, int(blocks) if blocks else None)
        endpoints.extend([setup] * int(count or 1))
    if not endpoints:
        if args.endpoints < 1:
            raise UsageError("--endpoints must be >= 1")
        endpoints = [EndpointSetup()] * args.endpoints
    timing: TimingModel = TIMING_PROFILES[args.timing]
    num_gpu_blocks: int | None = args.num_gpu_blocks
    if num_gpu_blocks is None:
        # A bad --block-size is reported by ClusterConfig, not as a division by zero here.
        num_gpu_blocks = timing.kv_capacity_tokens // max(args.block_size, 1)
    kv_bytes_per_token: int | None = args.kv_bytes_per_token
    if kv_bytes_per_token is None:
        kv_bytes_per_token = timing.kv_bytes_per_token
    try:
        return ClusterConfig(
            endpoints=tuple(endpoints),
            block_size=args.block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            scrape_interval_s=parse_duration_s(args.scrape_interval, "--scrape-interval"),
            kv_event_delay_s=_duration_or_zero(args.kv_event_delay, "--kv-event-delay"),
            cached_when=args.cached_when,
            transfer_bytes_per_s=args.transfer_gbps * 1e9 / 8,
            kv_bytes_per_token=kv_bytes_per_token,
            timing=timing,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _duration_or_zero(text: str, where: str) -> float:
    if text.strip() in ("0", "0s", "0ms"):
        return 0.0
    return parse_duration_s(text, where)


def trace_from_args(args: argparse.Namespace, load: float = 1.0) -> Trace:
    """The trace ``--trace`` names, sliced by ``--window`` and ``--first``, scaled by ``load``.

    A file trace's ``source`` is recorded as :func:`~.paths.portable_path` writes it.

    Raises:
        TraceError: If the trace cannot be read or generated, or nothing is left of it.
        UsageError: If ``--window`` is invalid.
    """
    spec: str = args.trace
    if spec.partition(":")[0] not in GENERATORS and is_trace_name(spec):
        directory = traces_dir()
        found = find_trace(spec, directory)
        if found is None:
            raise TraceError(
                f"--trace {spec!r}: not a file, a generator ({', '.join(GENERATORS)}) or a trace "
                f"in {directory} ({spec}_trace.jsonl or {spec}.jsonl; set {TRACES_ENV} to look "
                "elsewhere)"
            )
        spec = str(found)
    trace = parse_trace_spec(spec)
    if Path(spec).is_file():
        trace.source = portable_path(spec)
    return slice_trace(trace, first=args.first, window_s=parse_window(args.window), load=load)


def policies_from_args(args: argparse.Namespace) -> list[Policy]:
    """The ``--policy`` items (P/D variants with ``--pd``), each config checked up front.

    Raises:
        ConfigError: If an item names no baseline and no readable file, a name repeats, or a
            policy's config is invalid.
    """
    policies = resolve_policies(args.policy)
    if getattr(args, "pd", False):
        policies = [pd_variant(p, args.pd_threshold_tokens) for p in policies]
    registry = harness_registry()
    for policy in policies:
        policy.config(registry)  # fail before any work on a bad config
    return policies


def results_dir(args: argparse.Namespace, command: str, trace_name: str) -> Path:
    """Creates and returns the results folder: ``--out``, or ``results/<time>-<command>-<trace>``.

    Args:
        args: Parsed arguments (``out``).
        command: The command's name.
        trace_name: Short name of the trace, for the default folder name.
    """
    if args.out is not None:
        path = Path(args.out)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", trace_name)[:40]
        path = RESULTS_DIR / f"{stamp}-{command}-{safe}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def record_command(folder: Path, command: str, argv: Sequence[str]) -> str:
    """Writes ``command.txt`` into the results folder and returns the command line.

    Paths in the command are relative to the repository root (see :mod:`~.paths`), so the
    record reads the same on every machine and runs again from the root.

    Args:
        folder: The results folder.
        command: The command's name.
        argv: The command's arguments.
    """
    text = "kv-picker bench " + shlex.join([command, *portable_argv(argv)])
    where = "the repository root" if repository_root() else "the working directory of the run"
    (folder / "command.txt").write_text(
        f"{text}\n# paths are relative to {where}\n", encoding="utf-8"
    )
    return text


def parse_loads(text: str) -> list[float]:
    """``--loads`` as sorted, distinct positive multipliers.

    Raises:
        UsageError: If an item is not a positive number.
    """
    try:
        loads = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise UsageError(f"--loads {text!r}: expected numbers such as 1,2,4") from None
    if not loads or any(not (x > 0 and math.isfinite(x)) for x in loads):
        raise UsageError("--loads: give positive numbers such as 1,2,4")
    return sorted(set(loads))


def parse_peer(item: str) -> tuple[str, str]:
    """A ``--peer ROUTER:POLICY`` item as ``(router, policy)``.

    Raises:
        UsageError: If the router is unknown or the policy missing.
    """
    router, sep, policy = item.partition(":")
    if router not in PEER_ROUTERS or not sep or not policy:
        raise UsageError(
            f"--peer {item!r}: expected ROUTER:POLICY with ROUTER one of {', '.join(PEER_ROUTERS)}"
        )
    return router, policy


# ------------------------------------------------------------------------------ running


def run_command(command: str, argv: Sequence[str], body: Callable[[], int]) -> int:
    """Runs a command body, mapping the harness's errors to messages and exit codes.

    Args:
        command: The command's name, for error messages.
        argv: The command's arguments.
        body: The command itself, returning its exit code.

    Returns:
        The body's exit code; :data:`EXIT_USAGE` after a usage, trace or config error;
        :data:`EXIT_FAILURE` after Ctrl-C.
    """
    try:
        return body()
    except (UsageError, TraceError, ConfigError) as exc:
        print(f"kv-picker bench {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_FAILURE
