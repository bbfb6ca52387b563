"""Command line: ``kv-picker serve | explain`` and the commands other packages add.

The service's own commands are ``serve`` and ``explain``. Other installed packages may add
commands through the ``kv_picker.commands`` entry-point group: each entry point names an object
with a ``help`` string that is called with the arguments after the command's name and returns
the exit code. The benchmark package (``kv-picker[bench]``) adds ``demo``, ``sim-endpoint`` and
``bench`` that way, so the service never imports it.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or invalid config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Coroutine, Sequence
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, Protocol

from kv_picker.errors import ConfigError, PickerError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

COMMANDS_GROUP = "kv_picker.commands"


class ExtensionCommand(Protocol):
    """A command another package adds to ``kv-picker`` (see the module docstring)."""

    help: str

    def __call__(self, argv: Sequence[str]) -> int: ...


def extension_commands() -> dict[str, EntryPoint]:
    """Installed extension commands by name (the service's own names cannot be taken)."""
    found = {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}
    for own in ("serve", "explain"):
        found.pop(own, None)
    return found


def _setup_logging(level: str, worker: str | None = None) -> None:
    # A worker of serve --workers names itself: its lines share the supervisor's output.
    index = (worker or "").partition("/")[0]
    origin = f"[worker {index}] " if index.isdigit() else ""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s {origin}%(name)s: %(message)s",
    )


def _load(path: str | None):  # type: ignore[no-untyped-def]
    from kv_picker.config import PickerConfig, load_config
    from kv_picker.plugins import builtin_registry

    registry = builtin_registry()
    return (load_config(path, registry) if path else PickerConfig()), registry


def cmd_serve(args: argparse.Namespace) -> int:
    from kv_picker.app import serve
    from kv_picker.workers import Supervisor, parse_ports, supervise, worker_spec

    config, _ = _load(args.config)
    if args.workers < 1:
        print("kv-picker serve: --workers must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    main: Coroutine[Any, Any, None]
    if args.worker is not None:  # one of a supervisor's workers
        try:
            spec = worker_spec(args.worker, args.worker_dir, args.grpc_port, args.admin_port,
                               own_port=args.worker_port)  # fmt: skip
        except ValueError as exc:
            print(f"kv-picker serve: bad --worker arguments: {exc}", file=sys.stderr)
            return EXIT_USAGE
        main = serve(args.config, config, spec)
    elif args.workers > 1:
        try:
            ports = parse_ports(args.worker_ports, args.workers) if args.worker_ports else []
        except ValueError as exc:
            print(f"kv-picker serve: --worker-ports: {exc}", file=sys.stderr)
            return EXIT_USAGE
        supervisor = Supervisor(config, args.config, args.workers,
                                ["--event-loop", args.event_loop], args.log_level, ports,
                                int(args.recycle_rss * 2**20), args.recycle_min_uptime)  # fmt: skip
        main = supervise(supervisor)
    elif args.worker_ports or args.recycle_rss:
        print("kv-picker serve: --worker-ports and --recycle-rss need --workers 2 or more",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    else:
        main = serve(args.config, config)
    if args.event_loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    """Per-endpoint, per-scorer scores for one request body, without sending it.

    With ``--server`` the running picker answers (its live signals and KV index, through the
    ``kvpicker.v1.Admin`` API). Otherwise the picker is built from ``--config`` exactly as
    ``serve`` builds it, but no server starts; with ``--scrape`` the endpoints' metrics are
    read once, else every endpoint counts as ready and idle. Either way nothing is recorded.
    """
    from google.protobuf import json_format

    from kv_picker.admin import dry_run
    from kv_picker.api import admin_pb2

    try:
        body = Path(args.request).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{args.request}: cannot read request: {exc.strerror}") from exc
    headers = dict(_parse_header(h) for h in args.header)

    if args.server:
        import grpc

        from kv_picker.api import admin_pb2_grpc

        channel_credentials = _admin_credentials(args)

        async def ask() -> admin_pb2.ExplainResponse:
            channel = (
                grpc.aio.secure_channel(args.server, channel_credentials)
                if channel_credentials is not None
                else grpc.aio.insecure_channel(args.server)
            )
            async with channel:
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
        from kv_picker.app import PickerApp

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


def _admin_credentials(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Channel credentials for ``--server`` from ``--tls-ca`` (and ``--tls-cert``/``--tls-key``
    for an admin port that verifies clients), or None for plaintext."""
    import grpc

    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc

    return grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca),
        private_key=read(args.tls_key),
        certificate_chain=read(args.tls_cert),
    )


def _parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ConfigError(f"--header must look like 'name: value', got {text!r}")
    return name.strip().lower(), value.strip()


def cmd_extension(entry_point: EntryPoint, rest: Sequence[str]) -> int:
    """Run an extension command; a package that cannot be imported is a usage error."""
    try:
        command: ExtensionCommand = entry_point.load()
    except ImportError as exc:
        print(
            f"kv-picker {entry_point.name}: cannot load {entry_point.value} ({exc}); "
            "install the package that provides it (the benchmark commands: kv-picker[bench])",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return command(rest)


def _extension_help(entry_point: EntryPoint) -> str:
    try:
        return str(getattr(entry_point.load(), "help", ""))
    except ImportError:
        return f"(not available: {entry_point.value} cannot be imported)"


def build_parser(extensions: dict[str, EntryPoint] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-picker",
        description="KV-cache-aware endpoint picker for LLM inference (Envoy ext_proc).",
    )
    parser.add_argument(
        "--log-level", default="info", help="debug, info, warning or error (default: info)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    extensions = extension_commands() if extensions is None else extensions

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
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="picker processes sharing the ext_proc port (SO_REUSEPORT), their picks and "
        "in-flight counts shared, under a supervisor that serves the metrics port (default 1: "
        "one process)",
    )
    serve.add_argument(
        "--worker-ports",
        metavar="P1,...,PN",
        help="with --workers N: worker i also listens on Pi alone, for a gateway that balances "
        "streams over the workers itself (list those ports as its endpoints)",
    )
    serve.add_argument(
        "--recycle-rss",
        type=float,
        default=0.0,
        metavar="MB",
        help="with --workers N: stop and start again, one at a time, a worker whose resident "
        "memory passes MB (it drains first; its replacement copies what the others learned)",
    )
    serve.add_argument(
        "--recycle-min-uptime",
        type=float,
        default=60.0,
        metavar="S",
        help="with --recycle-rss: no worker is recycled before it has run S seconds (60)",
    )
    # Set by the supervisor for each worker it starts (kv_picker.workers).
    serve.add_argument("--worker", help=argparse.SUPPRESS)
    serve.add_argument("--worker-dir", help=argparse.SUPPRESS)
    serve.add_argument("--grpc-port", type=int, default=0, help=argparse.SUPPRESS)
    serve.add_argument("--admin-port", type=int, default=0, help=argparse.SUPPRESS)
    serve.add_argument("--worker-port", type=int, default=0, help=argparse.SUPPRESS)

    explain = sub.add_parser("explain", help="show every scorer's score for one request")
    explain.add_argument("--config", help="EndpointPickerConfig YAML (offline explain)")
    explain.add_argument(
        "--server",
        help="ask a running picker instead (HOST:PORT of its admin port, server.admin: "
        "127.0.0.1:9004 by default; kubectl port-forward reaches it in a pod)",
    )
    explain.add_argument(
        "--tls-ca", help="--server speaks TLS: verify it with this CA bundle (PEM)"
    )
    explain.add_argument("--tls-cert", help="--server wants a client certificate: this one (PEM)")
    explain.add_argument("--tls-key", help="the client certificate's key (PEM)")
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

    for name, entry_point in extensions.items():
        help_text = _extension_help(entry_point)
        sub.add_parser(name, add_help=False, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extensions = extension_commands()
    parser = build_parser(extensions)
    # Extension commands own their flags: hand everything after the name over untouched.
    for position, word in enumerate(argv):
        if word in extensions:
            args = parser.parse_args(argv[: position + 1])
            _setup_logging(args.log_level)
            return cmd_extension(extensions[word], argv[position + 1 :])
        if not word.startswith("-") and (position == 0 or argv[position - 1] != "--log-level"):
            break  # the first positional word is the command
    args = parser.parse_args(argv)
    _setup_logging(args.log_level, getattr(args, "worker", None))
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "explain":
            return cmd_explain(args)
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
