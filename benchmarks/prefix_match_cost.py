"""``kv-picker bench prefix-match``: what matching more of a long prompt costs per request.

The built-in default profile's prefix scorer matches up to 2,048 blocks of a prompt (about
32,000 tokens); the upstream default is 256 (about 4,000). The latency estimate takes its cached
tokens from that match, so the longer match is what lets it see a long cached context, and it
costs hashing and index work on the hot path in proportion to the prompt, up to the limit.

In process, with nothing on the network: each request is parsed from its JSON body, scheduled
by the default profile over 16 endpoints and accounted (first byte, end), as the ext_proc
handler does. Prompts are drawn from 20 distinct documents of ``--prompt-chars`` characters,
each followed by a distinct question, so most requests match a long prefix somewhere. Each
limit runs ``--rounds`` rounds, interleaved with the others, and reports the median per-request
time of its rounds, and its ratio to the 256-block run of the same sizes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kv_picker.config import DEFAULT_PLUGINS, DEFAULT_PROFILE, parse_config
from kv_picker.director import Director
from kv_picker.endpoint import EndpointSpec
from kv_picker.metrics import PickerMetrics
from kv_picker.plugins import builtin_registry
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.scheduler import Scheduler
from kv_picker.state.endpoints import EndpointStore

NUM_ENDPOINTS = 16
NUM_DOCUMENTS = 20
BASELINE_BLOCKS = 256
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "this",
    "be",
    "are",
    "from",
    "at",
    "or",
    "an",
    "was",
    "it",
]


def default_document(max_blocks: int) -> dict[str, Any]:
    """The built-in default profile with the prefix scorer's limit set to ``max_blocks``."""
    plugins = []
    for plugin in DEFAULT_PLUGINS:
        plugin = dict(plugin)
        if plugin["type"] == "prefix-cache-scorer":
            plugin["parameters"] = {
                **plugin.get("parameters", {}),
                "maxPrefixBlocksToMatch": max_blocks,
            }
        plugins.append(plugin)
    return {"seed": 0, "plugins": plugins, "schedulingProfiles": [dict(DEFAULT_PROFILE)]}


def build_director(max_blocks: int) -> Director:
    return director_for(default_document(max_blocks))


def director_for(document: Mapping[str, Any]) -> Director:
    """A director running ``document``'s profile over ``NUM_ENDPOINTS`` idle endpoints, as the
    ext_proc handler's, with nothing on the network."""
    store = EndpointStore(time.monotonic)
    store.set_endpoints(EndpointSpec(f"10.0.0.{i + 1}:8000", {}) for i in range(NUM_ENDPOINTS))
    for endpoint in store.all():
        store.update_metrics(endpoint.id, waiting=0.0, running=0.0, kv_usage=0.0)
    registry = builtin_registry(include_entry_points=False)
    config = parse_config(dict(document), registry)
    ctx = BuildContext(store, random.Random(0), store.now, metrics_staleness_s=3600.0)
    metrics = PickerMetrics()
    return Director(config, store, Scheduler(config, registry, ctx, metrics), ctx.rng, metrics)


def bodies(prompt_chars: int, requests: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    documents = []
    for _ in range(NUM_DOCUMENTS):
        words: list[str] = []
        length = 0
        while length < prompt_chars:
            word = rng.choice(WORDS)
            words.append(word)
            length += len(word) + 1
        documents.append(" ".join(words)[:prompt_chars])
    return [
        json.dumps(
            {"model": "m", "prompt": f"{documents[i % NUM_DOCUMENTS]} question {i}?"}
        ).encode()
        for i in range(requests)
    ]


def run_round(director: Director, prepared: Sequence[bytes]) -> float:
    """Seconds per request over one round."""
    started = time.perf_counter()
    for body in prepared:
        routed = director.route(director.parse(body, {}))
        routed.first_byte()
        routed.finish(4)
    return (time.perf_counter() - started) / len(prepared)


def measure(
    sizes: Sequence[int], limits: Sequence[int], requests: int, rounds: int
) -> dict[tuple[int, int], float]:
    """Median microseconds per request by (prompt characters, blocks matched at most)."""
    results: dict[tuple[int, int], float] = {}
    for chars in sizes:
        prepared = bodies(chars, requests)
        directors = {limit: build_director(limit) for limit in limits}
        for director in directors.values():  # warm-up: the index holds every document
            run_round(director, prepared[: min(2 * NUM_DOCUMENTS, requests)])
        samples: dict[int, list[float]] = {limit: [] for limit in limits}
        for _ in range(rounds):
            for limit, director in directors.items():
                samples[limit].append(run_round(director, prepared))
        for limit, values in samples.items():
            results[(chars, limit)] = statistics.median(values) * 1e6
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-picker bench prefix-match", description=__doc__)
    parser.add_argument(
        "--prompt-chars",
        default="4000,40000,200000",
        help="comma list of prompt lengths in characters (about 4 per token)",
    )
    parser.add_argument(
        "--blocks",
        default="256,2048",
        help="comma list of maxPrefixBlocksToMatch values; ratios are to 256",
    )
    parser.add_argument("--requests", type=int, default=200, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per limit")
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) for x in args.prompt_chars.split(",") if x.strip()]
        limits = [int(x) for x in args.blocks.split(",") if x.strip()]
    except ValueError as exc:
        parser.error(f"--prompt-chars and --blocks take comma lists of integers: {exc}")
    if not sizes or min(sizes) <= 0 or not limits or min(limits) < 0 or args.requests <= 0:
        parser.error("--prompt-chars, --blocks and --requests must be positive")
    if BASELINE_BLOCKS not in limits:
        limits = [BASELINE_BLOCKS, *limits]
    results = measure(sizes, limits, args.requests, max(1, args.rounds))
    print(
        "| prompt characters | blocks matched at most | µs per request (median of rounds) | vs 256 |"
    )
    print("|---:|---:|---:|---:|")
    for chars in sizes:
        base = results[(chars, BASELINE_BLOCKS)]
        for limit in limits:
            micros = results[(chars, limit)]
            print(f"| {chars:,} | {limit or 'all'} | {micros:.0f} | {micros / base:.2f}x |")
    return 0
