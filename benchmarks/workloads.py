"""Synthetic workloads.

Shared-prefix (the shape of llm-d's published benchmark and SGLang's generated-shared-prefix):
``groups`` × a shared context of ``shared_context_tokens`` × ``users_per_group`` users, each
asking a ``question_tokens`` question and receiving ``output_tokens``. Requests of all groups
are interleaved in a seeded random order, so a router has to keep groups apart by itself.

Text is made of words from a fixed vocabulary, about one token per word for the simulated
endpoints' tokenizer; equal seeds give byte-identical workloads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

_VOCABULARY = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "cache",
    "block",
    "prefix",
    "token",
    "model",
    "serve",
    "route",
    "pick",
    "queue",
    "batch",
    "decode",
    "prefill",
    "memory",
    "tensor",
    "layer",
    "head",
    "weight",
    "kernel",
    "stream",
    "event",
    "index",
    "score",
    "policy",
    "load",
    "pool",
    "shard",
    "replica",
    "gateway",
    "envoy",
]


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: where to send it and what."""

    path: str
    body: dict[str, Any]
    group: int = 0
    arrival_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(count))


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Parameters of the shared-prefix generator (token counts are approximate)."""

    groups: int = 12
    users_per_group: int = 12
    shared_context_tokens: int = 1500
    question_tokens: int = 40
    output_tokens: int = 16
    model: str = "sim-model"
    stream: bool = True
    seed: int = 0

    def requests(self) -> list[WorkloadRequest]:
        rng = random.Random(self.seed)
        contexts = [
            f"Group {g} shared context. " + words(rng, self.shared_context_tokens)
            for g in range(self.groups)
        ]
        requests = []
        for g in range(self.groups):
            for u in range(self.users_per_group):
                prompt = f"{contexts[g]}\nUser {u} asks: {words(rng, self.question_tokens)}?"
                body: dict[str, Any] = {
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": self.output_tokens,
                    "ignore_eos": True,
                    "stream": self.stream,
                }
                if self.stream:
                    body["stream_options"] = {"include_usage": True}
                requests.append(WorkloadRequest("/v1/completions", body, group=g))
        rng.shuffle(requests)
        return requests


def long_prompt_requests(
    count: int,
    prompt_tokens: int,
    model: str = "sim-model",
    seed: int = 0,
    output_tokens: int = 1,
    stream: bool = False,
) -> list[WorkloadRequest]:
    """Distinct long prompts (no shared prefix), for overhead measurements.

    ``stream``: answered as server-sent events, one per token, with a final usage event, and
    exactly ``output_tokens`` of them (``ignore_eos``).
    """
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        body: dict[str, Any] = {
            "model": model,
            "prompt": f"request {i}: " + words(rng, prompt_tokens),
            "max_tokens": output_tokens,
            "stream": stream,
        }
        if stream:
            body["ignore_eos"] = True
            body["stream_options"] = {"include_usage": True}
        requests.append(WorkloadRequest("/v1/completions", body))
    return requests
