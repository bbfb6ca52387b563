"""Command line of one simulated endpoint: ``kv-picker sim-endpoint`` and
``python -m kv_picker_bench.sim``.

Why a module of its own: flags, process signals and exit codes concern a process, not the
endpoint; tests, the demo and the harness start endpoints in-process through
:func:`~kv_picker_bench.sim.endpoint.start_sim_endpoint` or as processes through this command.

Options that make it a precise-routing peer: ``--tokenizer DIR`` tokenizes with a Hugging Face
``tokenizer.json`` and the chat template of ``tokenizer_config.json`` (the built-in tokenizer
stays the default), and ``--kv-events-port`` publishes the prefix cache's changes as vLLM KV
events on a ZMQ PUB socket (``--kv-events-replay-port`` adds the replay socket,
``--kv-events-encoding`` picks the array or map event encoding; see
:mod:`kv_picker_bench.sim.events`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from kv_picker_bench.sim.endpoint import ROLES, SimEndpoint, SimEndpointConfig
from kv_picker_bench.sim.engine import CACHED_WHEN
from kv_picker_bench.sim.events import ENCODINGS
from kv_picker_bench.sim.openai_api import ENDPOINT_HEADER
from kv_picker_bench.sim.timing import DEFAULT_TIMING, TIMING_PROFILES, describe_profiles


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``sim-endpoint`` command."""
    parser = argparse.ArgumentParser(
        prog="kv-picker sim-endpoint",
        description="Run one simulated vLLM endpoint (OpenAI API, vLLM metrics, prefix cache).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, required=True, help="port to bind; 0 picks a free one")
    parser.add_argument(
        "--model", default="sim-model", help="served model name (default %(default)s)"
    )
    parser.add_argument(
        "--role", choices=ROLES, default="both", help="endpoint role (default %(default)s)"
    )
    parser.add_argument(
        "--hardware-class",
        default="H100",
        help="hardware class: H100, H200, A100, L4 or default (default %(default)s)",
    )
    parser.add_argument(
        "--timing",
        choices=tuple(TIMING_PROFILES),
        default=DEFAULT_TIMING.name,
        metavar="NAME",
        help="timing profile of the served model on an H100, scaled by the hardware class "
        f"(default %(default)s): {describe_profiles()}",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per model second; 0.01 runs 100x faster (default %(default)s)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)"
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV capacity in blocks (default: 2048 scaled by the hardware class)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="most running requests (default %(default)s)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="token budget per engine step (default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=32_768,
        help="longest prompt+output (default %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of generated tokens (default %(default)s)"
    )
    parser.add_argument(
        "--cached-when",
        choices=CACHED_WHEN,
        default=CACHED_WHEN[0],
        help="when a prompt block becomes a cache hit: scheduled (from the step that schedules "
        "its prefill chunk, as vLLM v1 caches blocks when it allocates them; the default) or "
        "computed (once that step has ended, the older model)",
    )
    parser.add_argument(
        "--hash-seed",
        default="0",
        help="PYTHONHASHSEED string of the emulated vLLM pod, the root of block hashes "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME[=PATH]",
        help="served LoRA adapters; requests may name them as the model",
    )
    parser.add_argument(
        "--max-loras", type=int, default=1, help="reported max_lora (default %(default)s)"
    )
    parser.add_argument(
        "--advertise-address",
        default=None,
        metavar="HOST:PORT",
        help=f"value of the {ENDPOINT_HEADER} header (default: the bound host:port)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenize with this model directory's tokenizer.json and chat template "
        "(default: the built-in tokenizer)",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="publish vLLM KV events on a ZMQ PUB socket bound to this port on --host",
    )
    parser.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=None,
        help="serve KV-event replays (ZMQ ROUTER) on this port",
    )
    parser.add_argument(
        "--kv-events-encoding",
        choices=ENCODINGS,
        default="array",
        help="event encoding: array (vLLM before 0.26) or map (newer) (default %(default)s)",
    )
    parser.add_argument(
        "--kv-events-topic",
        default=None,
        help="topic frame of KV events (default kv@<endpoint>@<model>)",
    )
    parser.add_argument(
        "--kv-transfer-gbps",
        type=float,
        default=200.0,
        help="P/D link bandwidth in Gbit/s, for the KV pulled from a prefill endpoint "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="KV bytes per token of the served model (default: the timing profile's, e.g. "
        f"{DEFAULT_TIMING.kv_bytes_per_token:,} for {DEFAULT_TIMING.name})",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level (default %(default)s)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> SimEndpointConfig:
    """Builds the endpoint configuration from parsed arguments.

    Raises:
        ValueError: If a value is invalid.
    """
    kv_bytes_per_token = args.kv_bytes_per_token
    if kv_bytes_per_token is None:
        kv_bytes_per_token = TIMING_PROFILES[args.timing].kv_bytes_per_token
    return SimEndpointConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        role=args.role,
        hardware_class=args.hardware_class,
        timing=args.timing,
        time_scale=args.time_scale,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        hash_seed=args.hash_seed,
        cached_when=args.cached_when,
        lora_modules=tuple(item.split("=", 1)[0] for item in args.lora_modules),
        max_loras=args.max_loras,
        advertise_address=args.advertise_address,
        tokenizer=args.tokenizer,
        kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port,
        kv_events_encoding=args.kv_events_encoding,
        kv_events_topic=args.kv_events_topic,
        kv_transfer_gbps=args.kv_transfer_gbps,
        kv_bytes_per_token=kv_bytes_per_token,
    )


async def serve(config: SimEndpointConfig, stop: asyncio.Event | None = None) -> int:
    """Runs an endpoint until SIGTERM/SIGINT (or ``stop`` is set).

    Prints ``ready http://HOST:PORT`` to stdout once listening.

    Returns:
        The process exit code: 0 after a clean stop, 1 if the address cannot be bound.
    """
    loop = asyncio.get_running_loop()
    stop_event = stop or asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop_event.set)
    try:
        endpoint = SimEndpoint(config)
        try:
            await endpoint.start()
        except OSError as exc:
            print(f"error: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
            return 1
        print(f"ready {endpoint.url}", flush=True)
        try:
            await stop_event.wait()
        finally:
            await endpoint.stop()
        return 0
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of one simulated endpoint.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit code (2 for invalid arguments, via argparse).
    """
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve(config))
