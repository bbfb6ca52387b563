"""context-length-aware: send each request to the endpoints set aside for prompts of its length.

Type: ``context-length-aware`` (llm-d's plugin of that name, whose configs load unchanged). It is
a filter and a scorer at once: a profile that lists it runs it among its filters (a pass-through
unless ``enableFiltering``) and among its scorers, its weight on the score.

Inputs: the prompt's length in tokens (exact when a tokenizer ran for the request, as
``precise-prefix-cache-scorer``'s does; otherwise its characters / ``charsPerToken``, rounded
down, as llm-d's 0.25 tokens per character), and each endpoint's ``label``
(``llm-d.ai/context-length-range`` by default): one or more inclusive ranges of prompt lengths,
``"0-8192"`` or ``"0-2048,8192-16384"``.

Score, per endpoint (as llm-d's):

```
no label                            0.5
a label that does not parse         0
no range holds the length           0
a range [lo, hi] holds it           max over such ranges of
                                      1                                       when lo == hi
                                      0.7 / (1 + (hi - lo) / 10000)           narrower is better
                                      + 0.3 * (hi - length) / (hi - lo)       headroom is better
```

Filter (``enableFiltering: true``): keeps the endpoints without the label and those with a range
that holds the length; an endpoint whose label does not parse is dropped. When it drops every
candidate the request is refused with the filter named, as for any filter.

A label that does not parse is logged once per value (not per request). Parsed labels are kept
by value, so the hot path parses each distinct label once.

Parameters: ``label`` (``llm-d.ai/context-length-range``), ``enableFiltering`` (false),
``charsPerToken`` (4). llm-d's ``modelName``, ``localTokenizerConfig`` and ``hfTokenizerConfig``
are accepted so its configs load; the tokenizer they name is not loaded here (a warning says
so), and the length is counted as above.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest
from kv_picker.scheduling.signals import DEFAULT_CHARS_PER_TOKEN, prompt_tokens

log = logging.getLogger(__name__)

DEFAULT_LABEL = "llm-d.ai/context-length-range"
UNLABELLED_SCORE = 0.5
WIDTH_SCALE_TOKENS = 10_000.0
WIDTH_SHARE = 0.7  # the rest is the headroom's share

Ranges = tuple[tuple[int, int], ...]
UNLABELLED: Ranges = ()  # an endpoint without the label (a parsed label is never empty)


def parse_ranges(value: str) -> Ranges:
    """``"lo-hi[,lo-hi...]"`` as ((lo, hi), ...), each inclusive.

    Raises:
        ValueError: empty, a part that is not ``lo-hi`` of non-negative integers, or lo > hi.
    """
    if not value.strip():
        raise ValueError("empty range")
    ranges = []
    for part in value.split(","):
        bounds = part.strip().split("-")
        if len(bounds) != 2:
            raise ValueError(f"range {part.strip()!r} is not 'min-max'")
        try:
            low, high = int(bounds[0].strip()), int(bounds[1].strip())
        except ValueError:
            raise ValueError(f"range {part.strip()!r} has a bound that is not an integer") from None
        if low > high:
            raise ValueError(f"range {part.strip()!r}: min is above max")
        ranges.append((low, high))
    return tuple(ranges)


def range_score(length: int, ranges: Ranges) -> float:
    """The best score of the ranges that hold ``length`` (0 when none does)."""
    best = 0.0
    for low, high in ranges:
        if not low <= length <= high:
            continue
        width = high - low
        if width == 0:
            return 1.0
        score = (
            WIDTH_SHARE / (1.0 + width / WIDTH_SCALE_TOKENS)
            + (1.0 - WIDTH_SHARE) * (high - length) / width
        )
        best = max(best, score)
    return best


@dataclass(frozen=True)
class ContextLengthParams:
    label: str = DEFAULT_LABEL
    enableFiltering: bool = False
    charsPerToken: float = DEFAULT_CHARS_PER_TOKEN
    # llm-d's tokenizer settings: accepted, not acted on (see the module docstring).
    modelName: str = ""
    localTokenizerConfig: Mapping[str, Any] | None = None
    hfTokenizerConfig: Mapping[str, Any] | None = None

    def validate(self) -> None:
        if not self.label:
            raise ValueError("parameter 'label' must be specified")
        if not self.charsPerToken > 0:
            raise ValueError("parameter 'charsPerToken' must be > 0")


class ContextLengthAware:
    type_name: ClassVar[str] = "context-length-aware"
    Params = ContextLengthParams

    def __init__(self, name: str, params: ContextLengthParams, ctx: BuildContext) -> None:
        self.name = name
        self.label = params.label
        self.enable_filtering = params.enableFiltering
        self._chars_per_token = params.charsPerToken
        # label value -> its ranges, or None when it does not parse (logged once).
        self._parsed: dict[str, Ranges | None] = {}
        if params.localTokenizerConfig is not None or params.hfTokenizerConfig is not None:
            log.warning(
                "plugin %r: its tokenizer settings are not loaded; the prompt's length is "
                "counted by a tokenizer that ran for the request (precise-prefix-cache-scorer's) "
                "or estimated from its characters",
                name,
            )

    def _ranges(self, endpoint: Endpoint) -> Ranges | None:
        """The endpoint's ranges: ``UNLABELLED`` without the label, None when it does not
        parse."""
        value = endpoint.labels.get(self.label)
        if value is None:
            return UNLABELLED
        try:
            return self._parsed[value]
        except KeyError:
            pass
        ranges: Ranges | None
        try:
            ranges = parse_ranges(value)
        except ValueError as exc:
            log.error(
                "plugin %r: label %s=%r of endpoint %s does not parse (%s); such endpoints "
                "score 0%s",
                self.name,
                self.label,
                value,
                endpoint.address,
                exc,
                " and are filtered out" if self.enable_filtering else "",
            )
            ranges = None
        if len(self._parsed) < 4096:  # label values are few; a flood of them is not kept
            self._parsed[value] = ranges
        return ranges

    def context_length(self, request: LLMRequest) -> int:
        """The prompt's length in tokens, as the ranges are compared with."""
        return int(prompt_tokens(request, self._chars_per_token))

    def filter(self, request: LLMRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        if not self.enable_filtering:
            return candidates
        length = self.context_length(request)
        kept = []
        for endpoint in candidates:
            ranges = self._ranges(endpoint)
            if ranges is UNLABELLED or (
                ranges is not None and any(low <= length <= high for low, high in ranges)
            ):
                kept.append(endpoint)
        return kept

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        length = self.context_length(request)
        for i, endpoint in enumerate(candidates):
            ranges = self._ranges(endpoint)
            if ranges is UNLABELLED:
                out[i] = UNLABELLED_SCORE
            elif ranges is None:
                out[i] = 0.0
            else:
                out[i] = range_score(length, ranges)
