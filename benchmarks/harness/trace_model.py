"""What a trace is: requests whose prompts are chained block ids.

Why a module of its own: the file formats (:mod:`~kv_picker_bench.harness.traces`) and the
synthetic workload families (:mod:`~kv_picker_bench.harness.families`) both build these
records, and the formats' spec parser needs the families; the records sit below both so that
neither imports the other in a cycle. :mod:`~kv_picker_bench.harness.traces` re-exports every
name here, and callers keep importing from it.

A request carries no tokens: its prompt is a list of *block ids*, one per ``block_tokens``-token
block, where equal ids at equal positions mean equal token blocks (and, because ids are chained
prefix hashes, equal prefixes). That is the Mooncake representation, and it is enough for exact
prefix-cache accounting.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BLOCK_TOKENS = 16
"""Block size of generated traces and of kv-picker JSONL without a header (vLLM's default)."""


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
        session: Conversation or group the request belongs to, if known.
        prompt: Explicit prompt text, when the trace had text; else it is synthesized.
        line: Source line (1-based) for error messages, 0 for generated requests.
        output_ids: Block ids of prompt plus output, when known (a chat's next turn starts
            with them), so the blocks decode fills can be cached under the right keys.
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


def renumber_by_arrival(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Sorts by arrival (stable: ties keep their order) and sets each ``index`` to its place."""
    if any(a.arrival_s > b.arrival_s for a, b in itertools.pairwise(requests)):
        requests = sorted(requests, key=lambda r: r.arrival_s)
    for index, request in enumerate(requests):
        request.index = index
    return requests
