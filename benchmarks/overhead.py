"""What does kv-picker add to a request? Envoy direct, Envoy + a trivial ext_proc, Envoy + kv-picker.

Three paths run in the same process tree at the same time, against the same simulated endpoints
(whose model time is scaled to almost nothing, so the figures are the gateway's):

```
direct:   client ──(sets x-gateway-destination-endpoint, round robin)──> Envoy ──> endpoint
floor:    client ──> Envoy ──ext_proc──> trivial service (fixed pick, body echoed) ──> endpoint
picker:   client ──> Envoy ──ext_proc──> kv-picker (default profile) ──> endpoint
```

``--config FILE`` runs the picker on another configuration (its plugins, profiles, models and
other sections; the stack supplies ``server`` and ``endpoints``), so a profile's cost through
Envoy can be compared with the default's: run the command once per profile; each run measures its
own floor, and the ratios to it compare across runs.

The floor is the least any ext_proc picker written in Python costs (the protocol, the body's
round trip, gRPC): kv-picker's own work is what it adds beyond the floor's added latency. Each
processing mode gets its own Envoy pair (floor and picker on the same configuration):

- ``streamed``: request body ``FULL_DUPLEX_STREAMED``, responses not sent to the processor;
- ``buffered``: request body ``BUFFERED``, responses not sent;
- ``gie``: the GIE reference configuration: full-duplex request and response bodies, response
  headers and trailers processed too (what kv-picker needs to see first bytes and usage);
- ``lean``: request body ``FULL_DUPLEX_STREAMED``, response headers and trailers but no response
  body: the stream lasts to the response's end (Envoy ends it then even when the upstream sends
  no trailers), so the picker sees the response start and end, but no chunk, hence neither the
  first byte (it reads prefills' ends from the endpoints' first-token counts) nor the usage.

Rounds alternate between the paths so drift on a shared machine hits all alike. Reported per
mode and connection count: p50/p99 and requests per second per path, the added p50 over direct
of the floor and of the picker, and the ratios picker/floor of added p50 and of throughput.

``--output-tokens N`` (N > 1) streams the responses, one server-sent event per token, from
endpoints running in real time (``--time-scale``), so tokens come one decode step apart. Each
path then also reports its TTFT, the gaps between the chunks its client read (a path that holds
chunks up, or a placement that puts a new prompt's prefill next to a decoding request, shows in
their tail) and its CPU per output token. Only ``gie`` shows the picker the responses; ``lean``
their ends; in ``streamed`` and ``buffered`` Envoy ends the ext_proc stream once the request has
gone, and the picker stops counting the request as in flight then.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from kv_picker.config import (
    DEFAULT_PLUGINS,
    DEFAULT_PROFILE,
    parse_config_text,
    read_config_text,
)
from kv_picker.errors import ConfigError
from kv_picker.plugins import builtin_registry
from kv_picker.wire import DESTINATION_HEADER
from kv_picker_bench.client import Outcome, percentile, replay
from kv_picker_bench.localstack import (
    LocalStack,
    ManagedProcess,
    envoy_bootstrap,
    free_port,
    tree_cpu_s,
)
from kv_picker_bench.workloads import WorkloadRequest, long_prompt_requests

MODES = ("streamed", "buffered", "gie", "lean")
DEFAULT_MODES = MODES[:3]
PATHS = ("direct", "floor", "picker")


@dataclass
class PathResult:
    path: str
    connections: int
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    requests_per_s: float
    # CPU milliseconds per request while this path ran: its ext_proc service's (0 for direct;
    # the picker's includes its scraping, which runs whatever the traffic) and its Envoy's.
    # None when not measured (no /proc).
    ext_proc_cpu_ms: float | None
    envoy_cpu_ms: float | None


@dataclass
class StreamFigures:
    """One path's streamed responses (``--output-tokens`` above 1), as the client saw them."""

    output_tokens: int  # completion tokens, from the responses' usage
    ttft_p50_ms: float
    ttft_p99_ms: float
    # Time between successive reads of a response body that carried an SSE event, pooled over
    # every response: the endpoint's decode step plus whatever the path delays a chunk by.
    gap_p50_ms: float
    gap_p99_ms: float
    # CPU microseconds per output token while the path ran (the whole requests' CPU, request
    # path included, over their output tokens); None when not measured.
    ext_proc_cpu_us_per_token: float | None
    envoy_cpu_us_per_token: float | None


def stream_figures(
    outcomes: Sequence[Outcome], cpu_s: tuple[float, float] | None = None
) -> StreamFigures:
    """The streamed-response figures of one path; ``cpu_s`` as for :func:`summarise`."""
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.completion_tokens for o in ok)
    gaps = [g * 1000 for o in ok for g in o.gaps_s]
    ttfts = [o.ttft_s * 1000 for o in ok]
    per_token: list[float | None] = (
        [1e6 * x / tokens for x in cpu_s] if cpu_s is not None and tokens else [None, None]
    )
    return StreamFigures(
        tokens,
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
        percentile(gaps, 0.5),
        percentile(gaps, 0.99),
        *per_token,
    )


def _http_filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters: list[dict[str, Any]] = hcm["typed_config"]["http_filters"]
    return filters


def _direct_envoy(stack: LocalStack) -> tuple[ManagedProcess, int]:
    port, admin = free_port(), free_port()
    bootstrap = envoy_bootstrap(port, admin, ext_proc_port=0)
    # Same listener and ORIGINAL_DST cluster, no ext_proc filter: the client picks.
    filters = _http_filters(bootstrap)
    filters[:] = [f for f in filters if f["name"] == "envoy.filters.http.router"]
    bootstrap["static_resources"]["clusters"] = bootstrap["static_resources"]["clusters"][:1]
    process = stack.launch_envoy("envoy-direct", bootstrap, admin)
    return process, port


def mode_bootstrap(
    mode: str,
    port: int,
    admin: int,
    ext_proc_port: int,
    picker_worker_ports: Sequence[int] = (),
) -> dict[str, Any]:
    """The Envoy configuration of one processing mode (see the module docstring)."""
    body_mode = "BUFFERED" if mode == "buffered" else "FULL_DUPLEX_STREAMED"
    bootstrap = envoy_bootstrap(
        port,
        admin,
        ext_proc_port,
        body_mode,
        picker_worker_ports=picker_worker_ports,
        responses="lean" if mode == "lean" else "full",
    )
    if mode in ("streamed", "buffered"):
        (ext_proc,) = [
            f for f in _http_filters(bootstrap) if f["name"] == "envoy.filters.http.ext_proc"
        ]
        processing = ext_proc["typed_config"]["processing_mode"]
        processing.update(
            response_header_mode="SKIP", response_body_mode="NONE", response_trailer_mode="SKIP"
        )
    return bootstrap


def prompt_seed(mode: str, connections: int, path: str, round_index: int, stream: bool) -> int:
    """The seed of one batch's prompts (round -1: the warm-up).

    One-token responses use the same prompts on every path and round: the endpoints' time is
    scaled to almost nothing, so what they cache does not matter. Streamed ones run in real
    time, where a prompt that an earlier mode, path or round left cached would be a shorter
    prefill, and would draw the picker to the endpoint holding it: each batch gets fresh ones.
    """
    if not stream:
        return connections
    batch = ((MODES.index(mode) + 1) * 10_000 + connections) * 10_000 + round_index + 1
    return batch * len(PATHS) + PATHS.index(path)


def prompts(
    path: str,
    seed: int,
    count: int,
    words_per_prompt: int,
    output_tokens: int,
    addresses: Sequence[str],
) -> list[WorkloadRequest]:
    """One batch of distinct prompts; the direct path's name their endpoint, round robin."""
    made = long_prompt_requests(
        count, words_per_prompt, seed=seed, output_tokens=output_tokens, stream=output_tokens > 1
    )
    if path != "direct":
        return made
    return [
        WorkloadRequest(r.path, r.body, headers={DESTINATION_HEADER: addresses[i % len(addresses)]})
        for i, r in enumerate(made)
    ]


def _floor_service(stack: LocalStack, event_loop: str) -> tuple[ManagedProcess, int]:
    port = free_port()
    argv = [sys.executable, "-m", "kv_picker_bench.trivial_extproc", "--port", str(port),
            "--event-loop", event_loop]  # fmt: skip
    for address in stack.sim_addresses:
        argv += ["--endpoint", address]
    process = ManagedProcess("trivial-extproc", argv, stack.workdir / "trivial-extproc.log")
    stack.processes.append(process)
    process.wait_until(lambda: "ready" in process.log_tail(), 30.0, "the trivial ext_proc")
    return process, port


def summarise(
    path: str,
    connections: int,
    outcomes: Sequence[Outcome],
    wall_s: float,
    cpu_s: tuple[float, float] | None = None,
) -> PathResult:
    """One path's figures; ``cpu_s``: its ext_proc service's and its Envoy's CPU seconds."""
    ok = [o.latency_s * 1000 for o in outcomes if o.ok]
    per_request = [1000 * x / len(outcomes) for x in cpu_s] if cpu_s and outcomes else [None] * 2
    return PathResult(
        path,
        connections,
        len(outcomes),
        len(outcomes) - len(ok),
        percentile(ok, 0.5),
        percentile(ok, 0.99),
        len(ok) / wall_s,
        *per_request,
    )


def _cpu_s(processes: Sequence[ManagedProcess | None]) -> list[float] | None:
    """CPU seconds so far of each process (with what it started); 0 for None."""
    pids = [p.process.pid for p in processes if p is not None]
    counted = tree_cpu_s(pids)
    if counted is None:
        return None
    return [0.0 if p is None else counted[p.process.pid] for p in processes]


TOKENIZER = Path(__file__).resolve().parent / "tokenizer"


def add_mode_argument(parser: argparse.ArgumentParser) -> None:
    """``--mode approximate|precise``: the prefix scorer of the picker's default profile."""
    parser.add_argument(
        "--mode",
        choices=("approximate", "precise"),
        default="approximate",
        help="prefix scorer of the picker's default profile: approximate (the built-in "
        "default) or precise (KV events from the endpoints, the shipped tokenizer)",
    )


def precise_profile() -> dict[str, Any]:
    """The built-in default profile with its prefix scorer in precise mode (KV events, the
    shipped tokenizer)."""
    plugins = [dict(p) for p in DEFAULT_PLUGINS]
    for plugin in plugins:
        if plugin["type"] == "prefix-cache-scorer":
            plugin["parameters"] = {"mode": "precise", "tokenizer": str(TOKENIZER)}
    return {"plugins": plugins, "schedulingProfiles": [dict(DEFAULT_PROFILE)]}


STACK_SECTIONS = ("server", "endpoints", "discovery")
"""Sections of a ``--config`` file the benchmark's stack supplies itself."""


def picker_config_file(path: Path) -> dict[str, Any]:
    """The picker configuration of ``--config``: validated as ``kv-picker serve`` would, without
    the sections the stack supplies (:data:`STACK_SECTIONS`).

    Raises:
        ConfigError: unreadable or invalid, naming the file and the field.
    """
    text = read_config_text(path)  # one read: the text validated is the text used
    parse_config_text(text, builtin_registry(include_entry_points=True), source=str(path))
    document = yaml.safe_load(text) or {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: the config must be a mapping")
    return {key: value for key, value in document.items() if key not in STACK_SECTIONS}


def run(
    endpoints: int,
    prompt_tokens: int,
    requests: int,
    connections: Sequence[int],
    rounds: int,
    out_dir: Path | None,
    mode: str = "approximate",
    event_loop: str = "asyncio",
    processing_modes: Sequence[str] = DEFAULT_MODES,
    scraper: str = "process",
    picker_config: dict[str, Any] | None = None,
    output_tokens: int = 1,
    time_scale: float | None = None,
) -> list[dict[str, object]]:
    """Measure every path; ``picker_config`` (from :func:`picker_config_file`) replaces the
    built-in default profile of the picker path (not with ``mode`` precise).

    ``output_tokens`` above 1 streams the responses (one server-sent event per token) and adds
    each path's :class:`StreamFigures` to its row. ``time_scale``: the simulated endpoints'
    wall seconds per model second; by default almost nothing (0.0001) with one output token,
    so that the figures are the gateway's, and real time (1.0) with more, so that tokens come
    one decode step apart, as from a GPU, rather than all at once.
    """
    if output_tokens < 1:
        raise ValueError("output_tokens must be at least 1")
    stream = output_tokens > 1
    if time_scale is None:
        time_scale = 1.0 if stream else 0.0001
    words_per_prompt = int(prompt_tokens / 1.6)  # the simulated tokenizer's ~1.6 tokens/word
    precise = mode == "precise"
    if precise and picker_config is not None:
        raise ValueError("a picker config and the precise mode exclude each other")
    stack_options: dict[str, Any] = (
        {"picker_config": precise_profile(), "kv_events": True, "tokenizer": TOKENIZER}
        if precise
        else {"picker_config": copy.deepcopy(picker_config or {})}
    )
    metrics = stack_options["picker_config"].get("metrics") or {}
    stack_options["picker_config"]["metrics"] = {**metrics, "scraper": scraper}
    picker_args = ("--event-loop", event_loop)
    with LocalStack(
        sims=endpoints,
        time_scale=time_scale,
        picker_args=picker_args,
        start_envoy=False,
        **stack_options,
    ) as stack:
        direct_envoy, direct_port = _direct_envoy(stack)
        floor, floor_grpc = _floor_service(stack, event_loop)
        urls: dict[str, dict[str, str]] = {}
        # Per mode and path: (its ext_proc service, its Envoy), for the CPU each one used.
        parts: dict[str, dict[str, tuple[ManagedProcess | None, ManagedProcess]]] = {}
        for name in processing_modes:
            urls[name] = {"direct": f"http://127.0.0.1:{direct_port}"}
            parts[name] = {"direct": (None, direct_envoy)}
            for path, grpc_port, service in (
                ("floor", floor_grpc, floor),
                ("picker", stack.picker_grpc_port, stack.picker),
            ):
                port, admin = free_port(), free_port()
                bootstrap = mode_bootstrap(name, port, admin, grpc_port)
                envoy = stack.launch_envoy(f"envoy-{path}-{name}", copy.deepcopy(bootstrap), admin)
                urls[name][path] = f"http://127.0.0.1:{port}"
                parts[name][path] = (service, envoy)
        addresses = stack.sim_addresses
        rows: list[dict[str, object]] = []
        for name in processing_modes:
            for conns in connections:
                # Warm every path (connections, caches of the processes) before measuring.
                for path in PATHS:
                    seed = prompt_seed(name, conns, path, -1, stream)
                    warm = prompts(
                        path, seed, 4 * conns, words_per_prompt, output_tokens, addresses
                    )
                    asyncio.run(replay(urls[name][path], warm, conns))
                results: dict[str, list[Outcome]] = {path: [] for path in PATHS}
                walls = dict.fromkeys(PATHS, 0.0)
                cpu: dict[str, list[float] | None] = {path: [0.0, 0.0] for path in PATHS}
                for round_index in range(rounds):
                    for path in PATHS:
                        seed = prompt_seed(name, conns, path, round_index, stream)
                        sent = prompts(
                            path, seed, requests, words_per_prompt, output_tokens, addresses
                        )
                        before = _cpu_s(parts[name][path])
                        started = time.perf_counter()
                        results[path] += asyncio.run(replay(urls[name][path], sent, conns))
                        walls[path] += time.perf_counter() - started
                        after = _cpu_s(parts[name][path])
                        total = cpu[path]
                        if before is None or after is None or total is None:
                            cpu[path] = None
                        else:
                            cpu[path] = [
                                t + a - b for t, a, b in zip(total, after, before, strict=True)
                            ]
                summary = {
                    path: summarise(path, conns, results[path], walls[path], _pair(cpu[path]))
                    for path in PATHS
                }
                row = _row(name, conns, summary)
                if stream:
                    row.update(
                        _stream_row(
                            {
                                path: stream_figures(results[path], _pair(cpu[path]))
                                for path in PATHS
                            }
                        )
                    )
                rows.append(row)
                print(format_rows(rows[-1:]), flush=True)
                if stream:
                    print(format_stream_rows(rows[-1:]), flush=True)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "overhead.json").write_text(json.dumps(rows, indent=2))
        return rows


def _pair(values: list[float] | None) -> tuple[float, float] | None:
    return None if values is None else (values[0], values[1])


def _row(mode: str, connections: int, summary: dict[str, PathResult]) -> dict[str, object]:
    direct, floor, picker = summary["direct"], summary["floor"], summary["picker"]
    floor_added = floor.p50_ms - direct.p50_ms
    picker_added = picker.p50_ms - direct.p50_ms
    cpu_ratio = None
    if picker.ext_proc_cpu_ms is not None and floor.ext_proc_cpu_ms:
        cpu_ratio = picker.ext_proc_cpu_ms / floor.ext_proc_cpu_ms
    return {
        "mode": mode,
        "connections": connections,
        "direct": asdict(direct),
        "floor": asdict(floor),
        "picker": asdict(picker),
        "floor_added_p50_ms": floor_added,
        "added_p50_ms": picker_added,
        "added_p99_ms": picker.p99_ms - direct.p99_ms,
        "added_p50_ratio_to_floor": picker_added / floor_added if floor_added > 0 else None,
        "throughput_ratio_to_floor": picker.requests_per_s / floor.requests_per_s,
        "throughput_ratio_to_direct": picker.requests_per_s / direct.requests_per_s,
        "ext_proc_cpu_ratio_to_floor": cpu_ratio,
    }


def _stream_row(figures: dict[str, StreamFigures]) -> dict[str, object]:
    direct, floor, picker = figures["direct"], figures["floor"], figures["picker"]
    cpu_ratio = None
    if picker.ext_proc_cpu_us_per_token is not None and floor.ext_proc_cpu_us_per_token:
        cpu_ratio = picker.ext_proc_cpu_us_per_token / floor.ext_proc_cpu_us_per_token
    return {
        "stream": {path: asdict(f) for path, f in figures.items()},
        "floor_added_ttft_p50_ms": floor.ttft_p50_ms - direct.ttft_p50_ms,
        "added_ttft_p50_ms": picker.ttft_p50_ms - direct.ttft_p50_ms,
        "floor_added_gap_p99_ms": floor.gap_p99_ms - direct.gap_p99_ms,
        "added_gap_p99_ms": picker.gap_p99_ms - direct.gap_p99_ms,
        "ext_proc_cpu_per_token_ratio_to_floor": cpu_ratio,
    }


def format_stream_rows(rows: Sequence[dict[str, object]]) -> str:
    """The streamed-response figures of ``rows`` (those that have them) as a Markdown table."""
    lines = [
        "| mode | connections | output tokens/request | TTFT p50 ms, direct / floor / picker "
        "| chunk gap p50 ms, direct / floor / picker | chunk gap p99 ms, direct / floor / picker "
        "| ext_proc CPU µs/token, floor / picker | CPU ÷ floor's "
        "| Envoy CPU µs/token, direct / floor / picker |",
        "|---|---:|---:|---|---|---|---|---:|---|",
    ]
    for row in rows:
        figures = row.get("stream")
        if not isinstance(figures, dict):
            continue
        d, f, p = figures["direct"], figures["floor"], figures["picker"]
        requests = row["picker"]["requests"]  # type: ignore[index]
        per_request = p["output_tokens"] / requests if requests else float("nan")

        def three(key: str, d: Any = d, f: Any = f, p: Any = p) -> str:
            return " / ".join(_maybe(x[key]) for x in (d, f, p))

        lines.append(
            f"| {row['mode']} | {row['connections']} | {per_request:.1f} | "
            f"{three('ttft_p50_ms')} | {three('gap_p50_ms')} | {three('gap_p99_ms')} | "
            f"{_maybe(f['ext_proc_cpu_us_per_token'])} / {_maybe(p['ext_proc_cpu_us_per_token'])} "
            f"| {_maybe(row.get('ext_proc_cpu_per_token_ratio_to_floor'))} | "
            f"{three('envoy_cpu_us_per_token')} |"
        )
    return "\n".join(lines)


def format_rows(rows: Sequence[dict[str, object]]) -> str:
    lines = [
        "| mode | connections | direct p50 ms | floor p50 ms | picker p50 ms | floor added p50 ms "
        "| picker added p50 ms | added p50 ÷ floor's | picker p99 ms | direct req/s "
        "| floor req/s | picker req/s | req/s ÷ floor's | ext_proc CPU ms/req, floor / picker "
        "| CPU ÷ floor's | Envoy CPU ms/req, floor / picker | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        d, f, p = row["direct"], row["floor"], row["picker"]
        assert isinstance(d, dict) and isinstance(f, dict) and isinstance(p, dict)
        ratio = row["added_p50_ratio_to_floor"]
        cpu_ratio = row.get("ext_proc_cpu_ratio_to_floor")
        errors = d["errors"] + f["errors"] + p["errors"]
        lines.append(
            f"| {row['mode']} | {row['connections']} | {d['p50_ms']:.2f} | {f['p50_ms']:.2f} | "
            f"{p['p50_ms']:.2f} | {row['floor_added_p50_ms']:.2f} | {row['added_p50_ms']:.2f} | "
            f"{_maybe(ratio)} | {p['p99_ms']:.2f} | "
            f"{d['requests_per_s']:.0f} | {f['requests_per_s']:.0f} | {p['requests_per_s']:.0f} | "
            f"{row['throughput_ratio_to_floor']:.2f} | "
            f"{_maybe(f.get('ext_proc_cpu_ms'))} / {_maybe(p.get('ext_proc_cpu_ms'))} | "
            f"{_maybe(cpu_ratio)} | "
            f"{_maybe(f.get('envoy_cpu_ms'))} / {_maybe(p.get('envoy_cpu_ms'))} | {errors} |"
        )
    return "\n".join(lines)


def _maybe(value: object) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench overhead",
        description="Latency and throughput added by kv-picker: Envoy direct, Envoy + a trivial "
        "ext_proc service (the floor) and Envoy + kv-picker, in each processing mode.",
    )
    parser.add_argument("--endpoints", type=int, default=16, help="simulated endpoints (16)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=4000, help="approximate prompt length in tokens (4000)"
    )
    parser.add_argument(
        "--requests", type=int, default=300, help="requests per path per round (300)"
    )
    parser.add_argument(
        "--connections", default="1,16", help="comma list of client connection counts (1,16)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    add_mode_argument(parser)
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the picker's event loop (kv-picker serve --event-loop; default asyncio)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help="comma list of Envoy processing modes: streamed, buffered, gie, lean "
        "(default: streamed,buffered,gie)",
    )
    parser.add_argument(
        "--scraper",
        choices=("process", "inline"),
        default="process",
        help="the picker's metrics.scraper: in a child process (the default) or on its loop",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="the picker's configuration (an EndpointPickerConfig YAML) instead of the built-in "
        "default; its server, endpoints and discovery sections are the stack's",
    )
    parser.add_argument(
        "--output-tokens",
        type=int,
        default=1,
        help="tokens per response (1); above 1 the responses stream, one event per token, and "
        "each path's TTFT, gaps between chunks and CPU per output token are reported too",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="the simulated endpoints' wall seconds per model second (0.0001 with one output "
        "token, 1.0 with more: tokens one decode step apart)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write overhead.json here")
    args = parser.parse_args(argv)
    if args.output_tokens < 1:
        parser.error("--output-tokens must be at least 1")
    if args.time_scale is not None and not args.time_scale > 0:
        parser.error("--time-scale must be positive")
    picker_config = None
    if args.config is not None:
        if args.mode == "precise":
            parser.error("--config and --mode precise exclude each other")
        try:
            picker_config = picker_config_file(args.config)
        except ConfigError as exc:
            parser.error(f"--config: {exc}")
    try:
        connections = [int(c) for c in args.connections.split(",") if c.strip()]
    except ValueError:
        parser.error("--connections must be a comma list of integers")
    if not connections or min(connections) < 1 or args.requests < 1 or args.endpoints < 1:
        parser.error("--connections, --requests and --endpoints must be positive")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if not modes or unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    rows = run(
        args.endpoints,
        args.prompt_tokens,
        args.requests,
        connections,
        args.rounds,
        args.out,
        args.mode,
        args.event_loop,
        modes,
        args.scraper,
        picker_config,
        args.output_tokens,
        args.time_scale,
    )
    print()
    print(format_rows(rows))
    if args.output_tokens > 1:
        print()
        print(format_stream_rows(rows))
    return (
        0
        if all(
            r[path]["errors"] == 0  # type: ignore[index]
            for r in rows
            for path in ("direct", "floor", "picker")
        )
        else 1
    )
