"""Command line: ``kv-picker serve | demo | sim-endpoint | explain | bench``.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or invalid config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from picker.errors import ConfigError, PickerError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _load(path: str | None):  # type: ignore[no-untyped-def]
    from picker.config import PickerConfig, load_config
    from picker.scheduling.registry import builtin_registry

    registry = builtin_registry()
    return (load_config(path, registry) if path else PickerConfig()), registry


def cmd_serve(args: argparse.Namespace) -> int:
    from picker.app import serve

    config, _ = _load(args.config)
    if args.event_loop == "uvloop":
        import uvloop

        uvloop.run(serve(args.config, config))
    else:
        asyncio.run(serve(args.config, config))
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    """Per-endpoint, per-scorer scores for one request body, without sending it.

    With ``--server`` the running picker answers (its live signals and KV index, through the
    ``kvpicker.v1.Admin`` API). Otherwise the picker is built from ``--config`` exactly as
    ``serve`` builds it, but no server starts; with ``--scrape`` the endpoints' metrics are
    read once, else every endpoint counts as ready and idle. Either way nothing is recorded.
    """
    from google.protobuf import json_format

    from picker.admin import dry_run
    from picker.api import admin_pb2

    try:
        body = Path(args.request).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{args.request}: cannot read request: {exc.strerror}") from exc
    headers = dict(_parse_header(h) for h in args.header)

    if args.server:
        import grpc

        from picker.api import admin_pb2_grpc

        async def ask() -> admin_pb2.ExplainResponse:
            async with grpc.aio.insecure_channel(args.server) as channel:
                stub = admin_pb2_grpc.AdminStub(channel)  # type: ignore[no-untyped-call]
                request = admin_pb2.ExplainRequest(path=args.path or "", body=body,
                                                   headers=headers)  # fmt: skip
                response: admin_pb2.ExplainResponse = await stub.Explain(request, timeout=10)
                return response

        try:
            response = asyncio.run(ask())
        except grpc.aio.AioRpcError as exc:
            print(f"kv-picker: {args.server}: {exc.details()}", file=sys.stderr)
            return EXIT_FAILURE
    else:
        if not args.config:
            raise ConfigError("explain needs --config FILE or --server HOST:PORT")
        from picker.app import PickerApp

        config, registry = _load(args.config)
        app = PickerApp(config, registry)

        async def offline() -> admin_pb2.ExplainResponse:
            if args.scrape:
                await app.scraper.scrape_once()
            else:
                for endpoint in app.store.all():
                    app.store.update_metrics(endpoint.id, waiting=0, running=0, kv_usage=0)
            return await dry_run(app.director, body, args.path or "", headers)

        response = asyncio.run(offline())
    document = json_format.MessageToDict(
        response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    print(json.dumps(document, indent=2))
    return EXIT_OK


def _parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ConfigError(f"--header must look like 'name: value', got {text!r}")
    return name.strip().lower(), value.strip()


def cmd_sim_endpoint(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from benchmarks.sim.server import main as sim_main

    return sim_main(list(rest))


def cmd_demo(args: argparse.Namespace) -> int:
    from benchmarks.demo import run_demo

    return run_demo(requests=args.requests, concurrency=args.concurrency, seed=args.seed)


def cmd_bench(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from benchmarks.__main__ import main as bench_main

    return bench_main(list(rest))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-picker",
        description="KV-cache-aware endpoint picker for LLM inference (Envoy ext_proc).",
    )
    parser.add_argument(
        "--log-level", default="info", help="debug, info, warning or error (default: info)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ext_proc service")
    serve.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="event loop (default asyncio); uvloop measured about 10%% lower added latency "
        "and higher throughput in `kv-picker bench overhead`",
    )
    serve.add_argument(
        "--config",
        help="EndpointPickerConfig YAML (reloaded when it changes); "
        "without it, the built-in default with no endpoints",
    )

    demo = sub.add_parser(
        "demo",
        help="local stack: Envoy + kv-picker + 4 simulated endpoints, "
        "replay a shared-prefix workload under two profiles, print a table",
    )
    demo.add_argument("--requests", type=int, default=160, help="requests per profile (160)")
    demo.add_argument("--concurrency", type=int, default=8, help="client connections (8)")
    demo.add_argument("--seed", type=int, default=7, help="workload seed (7)")

    explain = sub.add_parser("explain", help="show every scorer's score for one request")
    explain.add_argument("--config", help="EndpointPickerConfig YAML (offline explain)")
    explain.add_argument(
        "--server", help="ask a running picker instead (HOST:PORT of its ext_proc port)"
    )
    explain.add_argument("--request", required=True, help="JSON request body file")
    explain.add_argument(
        "--path",
        default=None,
        help="request path (default: chat completions when the body has "
        "'messages', else completions)",
    )
    explain.add_argument(
        "--scrape",
        action="store_true",
        help="offline: scrape the endpoints' /metrics first (default: all idle)",
    )
    explain.add_argument(
        "--header",
        action="append",
        default=[],
        help="request header 'name: value' (repeatable), e.g. a session token or objective",
    )

    sub.add_parser(
        "sim-endpoint",
        add_help=False,
        help="run one simulated vLLM endpoint (see sim-endpoint --help)",
    )
    sub.add_parser("bench", add_help=False, help="benchmarks (see bench --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # sim-endpoint and bench own their flags: hand the rest over untouched.
    for passthrough in ("sim-endpoint", "bench"):
        if passthrough in argv:
            position = argv.index(passthrough)
            args = parser.parse_args(argv[: position + 1])
            _setup_logging(args.log_level)
            rest = argv[position + 1 :]
            return (cmd_sim_endpoint if passthrough == "sim-endpoint" else cmd_bench)(args, rest)
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "explain":
            return cmd_explain(args)
        if args.command == "demo":
            return cmd_demo(args)
    except ConfigError as exc:
        print(f"kv-picker: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PickerError as exc:
        print(f"kv-picker: {exc.status} {exc.reason}: {exc.message}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE
