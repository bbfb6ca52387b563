"""``kv-picker bench scorer-cost``: what each scorer of the built-in default costs per request.

In process, with nothing on the network, as ``kv-picker bench prefix-match`` does: each request
is parsed from its JSON body, scheduled over 16 endpoints and accounted (first byte, end), as
the ext_proc handler does. The built-in default runs whole, and once without each of its
scorers (the other scorers and their weights unchanged); the runs interleave, round by round,
in a shuffled order, so a slow spell of the machine hits them all alike. A scorer's share is,
within each round, the time per request the whole default takes minus the time without the
scorer, over the whole default's; the table gives the median over the rounds. That ratio,
taken within one round, is the figure to read, not the microseconds.

Prompts are drawn from 20 documents of ``--prompt-chars`` characters, each followed by a
distinct question, so most requests match a long prefix somewhere and every scorer has work.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kv_picker.config import DEFAULT_PLUGINS, DEFAULT_PROFILE
from kv_picker_bench.prefix_match_cost import NUM_DOCUMENTS, bodies, director_for, run_round

WHOLE = "the whole default"


def default_scorers() -> list[str]:
    """The scorers of the built-in default's profile, in its order."""
    types = {p.get("name", p["type"]): p["type"] for p in DEFAULT_PLUGINS}
    return [
        ref["pluginRef"]
        for ref in DEFAULT_PROFILE["plugins"]
        if types[ref["pluginRef"]].endswith("-scorer")
    ]


def document_without(scorer: str | None) -> dict[str, Any]:
    """The built-in default, without ``scorer`` (None: whole)."""
    plugins = [
        dict(p) for p in DEFAULT_PLUGINS if scorer is None or p.get("name", p["type"]) != scorer
    ]
    profile: Mapping[str, Any] = {
        **DEFAULT_PROFILE,
        "plugins": [
            dict(ref)
            for ref in DEFAULT_PROFILE["plugins"]
            if scorer is None or ref["pluginRef"] != scorer
        ],
    }
    return {"seed": 0, "plugins": plugins, "schedulingProfiles": [profile]}


def measure(
    sizes: Sequence[int], requests: int, rounds: int
) -> dict[tuple[int, str], tuple[float, float]]:
    """By (prompt characters, run): the median microseconds per request over the rounds, and
    the median over the rounds of the share of the whole default's time that leaving the
    scorer out saves, each round's runs compared with each other (0 for ``WHOLE``). The runs
    of a round go in a shuffled order, so none always follows another."""
    variants: list[str | None] = [None, *default_scorers()]
    order = random.Random(0)
    results: dict[tuple[int, str], tuple[float, float]] = {}
    for chars in sizes:
        prepared = bodies(chars, requests)
        directors = {v: director_for(document_without(v)) for v in variants}
        for director in directors.values():  # warm-up: the index holds every document
            run_round(director, prepared[: min(2 * NUM_DOCUMENTS, requests)])
        samples: dict[str | None, list[float]] = {v: [] for v in variants}
        for _ in range(rounds):
            shuffled = list(variants)
            order.shuffle(shuffled)
            for variant in shuffled:
                samples[variant].append(run_round(directors[variant], prepared))
        whole = samples[None]
        for variant, values in samples.items():
            shares = [1.0 - v / w for v, w in zip(values, whole, strict=True)]
            results[(chars, variant or WHOLE)] = (
                statistics.median(values) * 1e6,
                statistics.median(shares),
            )
    return results


def table(results: Mapping[tuple[int, str], tuple[float, float]], sizes: Sequence[int]) -> str:
    lines = [
        "| prompt characters | run | µs per request (median of rounds) "
        "| share of the whole default's time the scorer costs (median of rounds) |",
        "|---:|---|---:|---:|",
    ]
    for chars in sizes:
        whole, _ = results[(chars, WHOLE)]
        lines.append(f"| {chars:,} | {WHOLE} | {whole:.0f} | |")
        for scorer in default_scorers():
            without, share = results[(chars, scorer)]
            lines.append(f"| {chars:,} | without {scorer} | {without:.0f} | {share:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-picker bench scorer-cost", description=__doc__)
    parser.add_argument(
        "--prompt-chars",
        default="4000,40000",
        help="comma list of prompt lengths in characters (about 4 per token)",
    )
    parser.add_argument("--requests", type=int, default=100, help="requests per round")
    parser.add_argument("--rounds", type=int, default=21, help="rounds per run")
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) for x in args.prompt_chars.split(",") if x.strip()]
    except ValueError as exc:
        parser.error(f"--prompt-chars takes a comma list of integers: {exc}")
    if not sizes or min(sizes) <= 0 or args.requests <= 0 or args.rounds <= 0:
        parser.error("--prompt-chars, --requests and --rounds must be positive")
    print(table(measure(sizes, args.requests, args.rounds), sizes))
    return 0
