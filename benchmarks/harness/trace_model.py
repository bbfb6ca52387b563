"""What a trace is: requests whose prompts are chained block ids, and the cache namespaces.

Why a module of its own: the file formats (:mod:`~kv_picker_bench.harness.traces`) and the
synthetic workload families (:mod:`~kv_picker_bench.harness.families`) both build these
records, and the formats' spec parser needs the families; the records sit below both so that
neither imports the other in a cycle. :mod:`~kv_picker_bench.harness.traces` re-exports every
name here, and callers keep importing from it.

A request carries no tokens: its prompt is a list of *block ids*, one per ``block_tokens``-token
block, where equal ids at equal positions mean equal token blocks (and, because ids are chained
prefix hashes, equal prefixes). That is the Mooncake representation, and it is enough for exact
prefix-cache accounting.

Cache namespaces. vLLM folds a request's LoRA adapter into every block hash and its
``cache_salt`` into block 0's (so, through the chain, into all of them): equal text under
another adapter or salt is another cache entry. A trace keeps the two apart the same way. The
low :data:`CONTENT_ID_BITS` bits of an id name the block's *content*; a request with an adapter
or a salt adds its namespace's number above them::

    id = namespace << 40 | content id        namespace 0: no adapter, no salt

    tenant A, salt "a" (namespace 1):  hash_ids [1<<40 | 7, 1<<40 | 8]   content [7, 8]
    tenant B, salt "b" (namespace 2):  hash_ids [2<<40 | 7, 2<<40 | 8]   content [7, 8]

Every consumer of ``hash_ids`` (the simulator's cache keys, the hit-ratio bounds, the written
file's equivalence classes) therefore keeps namespaces apart without knowing about them, while
the synthesized prompt text reads :attr:`TraceRequest.content_ids`, so two tenants sending the
same system prompt send the same characters and only the salt separates them, as on the wire.
Namespaces are numbered per trace in order of first appearance (:class:`CacheNamespaces`); only
ids within one trace are ever compared.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BLOCK_TOKENS = 16
"""Block size of generated traces and of kv-picker JSONL without a header (vLLM's default)."""

CONTENT_ID_BITS = 40
"""Bits of a block id that name its content; a cache namespace's number sits above them."""

CONTENT_ID_LIMIT = 1 << CONTENT_ID_BITS
_CONTENT_MASK = CONTENT_ID_LIMIT - 1


class TraceError(ValueError):
    """A trace that cannot be used; the message names the file, line and field."""


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        index: Position in the trace after slicing (0-based), the request's id in results.
        arrival_s: Arrival time in seconds from the start of the trace.
        input_tokens: Prompt length in tokens.
        output_tokens: Tokens to generate (replays force exactly this many).
        hash_ids: One id per ``block_tokens`` prompt block; the last block may be partial.
            Includes the request's cache namespace (see the module docstring).
        session: Conversation or group the request belongs to, if known.
        prompt: Explicit prompt text, when the trace had text; else it is synthesized.
        line: Source line (1-based) for error messages, 0 for generated requests.
        output_ids: Block ids of prompt plus output, when known (a chat's next turn starts
            with them), so the blocks decode fills can be cached under the right keys.
        lora: The LoRA adapter the request names as its model; ``None`` for the base model.
        salt: The request's ``cache_salt`` (a non-empty string), or ``None``.
    """

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: list[int]
    session: str | None = None
    prompt: str | None = None
    line: int = 0
    output_ids: list[int] | None = None
    lora: str | None = None
    salt: str | None = None

    @property
    def namespaced(self) -> bool:
        """Whether the ids carry a cache namespace (an adapter or a salt)."""
        return self.lora is not None or self.salt is not None

    @property
    def content_ids(self) -> list[int]:
        """The prompt's block ids without the cache namespace: what its text is made of."""
        if not self.namespaced:
            return self.hash_ids
        return [hash_id & _CONTENT_MASK for hash_id in self.hash_ids]

    @property
    def output_content_ids(self) -> list[int] | None:
        """:attr:`output_ids` without the cache namespace."""
        if self.output_ids is None or not self.namespaced:
            return self.output_ids
        return [hash_id & _CONTENT_MASK for hash_id in self.output_ids]


@dataclass(slots=True)
class Trace:
    """A named, time-ordered list of requests with one block size.

    Attributes:
        name: Short name used in reports.
        block_tokens: Tokens per hash-id block.
        requests: Requests sorted by arrival.
        source: Where it came from (a path or a generator spec).
        notes: What was done to it (slicing, scaling), in order, for the report.
    """

    name: str
    block_tokens: int
    requests: list[TraceRequest]
    source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """Time from the first to the last arrival."""
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def summary(self) -> dict[str, Any]:
        """Counts for reports: requests, span, rate, mean token lengths."""
        count = len(self.requests)
        duration_s = self.duration_s
        return {
            "name": self.name,
            "source": self.source,
            "requests": count,
            "block_tokens": self.block_tokens,
            "duration_s": round(duration_s, 3),
            "rate_per_s": round(count / duration_s, 3) if duration_s > 0 else None,
            "mean_input_tokens": round(sum(r.input_tokens for r in self.requests) / count, 1)
            if count
            else 0.0,
            "mean_output_tokens": round(sum(r.output_tokens for r in self.requests) / count, 1)
            if count
            else 0.0,
            "notes": list(self.notes),
        }


class CacheNamespaces:
    """Numbers a trace's (adapter, salt) pairs in order of first appearance and applies them.

    Number 0 is "no adapter, no salt", so requests without either keep their ids as they are.
    """

    __slots__ = ("_numbers",)

    def __init__(self) -> None:
        self._numbers: dict[tuple[str | None, str | None], int] = {(None, None): 0}

    def offset(self, lora: str | None, salt: str | None) -> int:
        """What to add to a content id of a request with this adapter and salt."""
        key = (lora, salt)
        number = self._numbers.get(key)
        if number is None:
            number = self._numbers[key] = len(self._numbers)
        return number << CONTENT_ID_BITS

    def apply(self, content_ids: Sequence[int], lora: str | None, salt: str | None) -> list[int]:
        """Namespaced ids of content ids (each below :data:`CONTENT_ID_LIMIT`)."""
        offset = self.offset(lora, salt)
        return [offset | content_id for content_id in content_ids]


def renumber_by_arrival(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Sorts by arrival (stable: ties keep their order) and sets each ``index`` to its place."""
    if any(a.arrival_s > b.arrival_s for a, b in itertools.pairwise(requests)):
        requests = sorted(requests, key=lambda r: r.arrival_s)
    for index, request in enumerate(requests):
        request.index = index
    return requests
