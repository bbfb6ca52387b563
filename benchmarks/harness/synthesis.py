"""Building blocks of synthetic workloads: arrival processes, samplers and prefix block ids.

Why apart from the families: every family (:mod:`~kv_picker_bench.harness.families`) needs the
same three things, and getting them subtly wrong breaks cache accounting or determinism:

- *Arrivals* with a shape: Poisson (open-loop clients), Gamma renewals whose coefficient of
  variation above 1 gives bursts (BurstGPT, Wang et al., arXiv:2401.17644, fits Gamma
  inter-arrival times to Azure OpenAI traffic; S-LoRA's synthetic workloads vary the same
  ``cv``), staged ladders (llm-d-benchmark).
- *Samplers* drawing only from a :class:`random.Random` the caller seeded, never the global
  generator, so a seed gives one workload in every process.
- *Block ids* that are equal exactly when prefixes are equal. :class:`PrefixBlocks` builds a
  prompt as a path of segments (system prompt, document, chunk, question, tool output, ...)
  from a root; a block's id belongs to the *last* segment that touches it::

      segments   | system (40 tok)    | chunk 7 (30 tok)  | question (10 tok)|
      blocks     [ 0  ][ 1  ][2 ....][.. 3 ][ 4  ][5 ..][ 6 ]                16 tokens each
      owner       system system chunk7 chunk7 chunk7 question
                                ^ block 2 holds system and chunk tokens: its id is chunk 7's
                                  (after this system prompt), so it matches only that order

  so two prompts share block i exactly when they share every segment up to the one that ends
  inside or after block i, which is vLLM's chained block hash reduced to ids. A prompt that ends
  inside a block gets a *tail* id for that partial block, which a longer prompt never reuses
  (its block there has more tokens).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kv_picker_bench.harness.trace_model import TraceError

# ---------------------------------------------------------------------------- arrivals


def parse_stages(text: str) -> list[tuple[float, float]]:
    """``"15x50/3x20"`` -> [(15 req/s, 50 s), (3 req/s, 20 s)]."""
    stages = []
    for item in text.split("/"):
        rate_text, sep, duration_text = item.partition("x")
        try:
            rate, duration = float(rate_text), float(duration_text)
        except ValueError:
            raise TraceError(f"stage {item!r}: expected RATExSECONDS, e.g. 15x50") from None
        if not sep or rate <= 0 or duration <= 0:
            raise TraceError(f"stage {item!r}: expected RATExSECONDS with positive numbers")
        stages.append((rate, duration))
    return stages


def poisson_arrivals(
    rng: random.Random, count: int, rate_start: float, rate_end: float
) -> list[float]:
    """``count`` Poisson arrival times whose rate moves linearly from start to end.

    With a ramp, arrivals are spaced evenly in expected count, so the rate at the k-th arrival
    is ``rate_start + (rate_end - rate_start) * k / count``.
    """
    if rate_start <= 0 or rate_end <= 0:
        raise TraceError("rates must be positive")
    times = []
    now_s = 0.0
    for k in range(count):
        rate = rate_start + (rate_end - rate_start) * k / max(1, count)
        now_s += rng.expovariate(rate)
        times.append(now_s)
    return times


def staged_arrivals(rng: random.Random, stages: Sequence[tuple[float, float]]) -> list[float]:
    """Poisson arrivals for consecutive constant-rate stages (llm-d-benchmark style)."""
    times = []
    start_s = 0.0
    for rate, duration_s in stages:
        now_s = start_s
        while True:
            now_s += rng.expovariate(rate)
            if now_s >= start_s + duration_s:
                break
            times.append(now_s)
        start_s += duration_s
    return times


def gamma_arrivals(rng: random.Random, count: int, rate: float, cv: float) -> list[float]:
    """``count`` arrivals of a renewal process with Gamma gaps of mean ``1 / rate``.

    Args:
        rng: The generator.
        count: Arrivals to draw.
        rate: Mean arrivals per second.
        cv: Coefficient of variation of the gaps: 1 is Poisson; above 1 clusters arrivals into
            bursts separated by lulls at the same mean rate.

    Raises:
        TraceError: A rate or cv that is not positive.
    """
    if not (rate > 0 and cv > 0):
        raise TraceError(f"arrivals: rate and cv must be positive, got {rate} and {cv}")
    shape = 1.0 / (cv * cv)
    scale = cv * cv / rate
    return list(itertools.accumulate(rng.gammavariate(shape, scale) for _ in range(count)))


# ---------------------------------------------------------------------------- samplers


def zipf_cum_weights(count: int, exponent: float) -> list[float]:
    """Cumulative weights of ranks ``0..count-1`` under a Zipf law (rank r weighs
    ``(r + 1) ** -exponent``; exponent 0 is uniform), for ``random.choices(cum_weights=...)``.
    """
    return list(itertools.accumulate((rank + 1) ** -exponent for rank in range(count)))


def pick(rng: random.Random, cum_weights: Sequence[float]) -> int:
    """One rank drawn with the given cumulative weights."""
    return bisect.bisect_right(cum_weights, rng.random() * cum_weights[-1])


def pick_distinct(rng: random.Random, cum_weights: Sequence[float], count: int) -> list[int]:
    """``count`` distinct ranks, drawn one after the other by weight (without replacement).

    Popular ranks tend to come first, as the best-scored chunks do in a retriever's answer.
    """
    if count > len(cum_weights):
        raise TraceError(f"cannot pick {count} distinct items out of {len(cum_weights)}")
    chosen: list[int] = []
    while len(chosen) < count:
        rank = pick(rng, cum_weights)
        if rank not in chosen:  # rejection: count is small next to the pool
            chosen.append(rank)
    return chosen


def around(rng: random.Random, mean: float, spread: float = 0.5) -> int:
    """An integer uniform in ``mean * [1 - spread, 1 + spread]``, at least 1."""
    return max(1, round(mean * rng.uniform(1.0 - spread, 1.0 + spread)))


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    """A number whose logarithm is uniform between ``log(low)`` and ``log(high)``."""
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def heavy_tailed(rng: random.Random, mean: float, cap: float = 8.0) -> int:
    """An exponential length of the given mean, at least 16 tokens and at most ``cap`` means
    (tool outputs: mostly short, now and then a whole file)."""
    return max(16, min(round(cap * mean), round(rng.expovariate(1.0 / mean))))


# ----------------------------------------------------------------------------- prefixes


@dataclass(slots=True, eq=False)
class PromptNode:
    """A prompt prefix: the end of a path of segments from the root.

    Attributes:
        number: The node's own number, which keys its children.
        end_tokens: Tokens from the root to the end of this segment.
        ids: Ids of every full block of the path.
        tail_id: Id of the partial last block of a prompt ending here (-1 until needed).
    """

    number: int
    end_tokens: int
    ids: list[int]
    tail_id: int = -1


class PrefixBlocks:
    """Block ids of prompts built as paths of segments (see the module docstring).

    Args:
        block_tokens: Tokens per block of the trace.
    """

    __slots__ = ("_children", "_next_id", "_next_number", "block_tokens", "root")

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise TraceError(f"block tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.root = PromptNode(0, 0, [])
        self._children: dict[tuple[int, Hashable], PromptNode] = {}
        self._next_id = 0
        self._next_number = 1

    def child(self, parent: PromptNode, key: Hashable, num_tokens: int) -> PromptNode:
        """The segment ``key`` of ``num_tokens`` tokens after ``parent``, shared by every
        prompt that reaches it through the same path.

        Raises:
            ValueError: ``key`` was used after ``parent`` with another length (a generator
                bug: equal keys must mean equal content).
        """
        node = self._children.get((parent.number, key))
        if node is None:
            node = self._extend(parent, num_tokens)
            self._children[(parent.number, key)] = node
        elif node.end_tokens != parent.end_tokens + num_tokens:
            raise ValueError(f"segment {key!r} reused with another length")
        return node

    def unique(self, parent: PromptNode, num_tokens: int) -> PromptNode:
        """A segment no other prompt has (a fresh question): new ids, not looked up again.

        Its node can still have children (a session's own history grows from it).
        """
        return self._extend(parent, num_tokens)

    def prompt(self, node: PromptNode) -> tuple[list[int], int]:
        """``(hash_ids, input_tokens)`` of a prompt that ends at ``node``."""
        if node.end_tokens % self.block_tokens == 0:
            return list(node.ids), node.end_tokens
        if node.tail_id < 0:
            node.tail_id = self._take(1)[0]
        return [*node.ids, node.tail_id], node.end_tokens

    def _extend(self, parent: PromptNode, num_tokens: int) -> PromptNode:
        if num_tokens < 0:
            raise ValueError(f"a segment cannot have {num_tokens} tokens")
        number = self._next_number
        self._next_number += 1
        end = parent.end_tokens + num_tokens
        # Full blocks ending after the parent's end and by this segment's end are this
        # segment's (one of them may start in the parent: it still differs per segment).
        count = end // self.block_tokens - parent.end_tokens // self.block_tokens
        return PromptNode(number, end, parent.ids + self._take(count))

    def _take(self, count: int) -> list[int]:
        start = self._next_id
        self._next_id += count
        return list(range(start, start + count))
