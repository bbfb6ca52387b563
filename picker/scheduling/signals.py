"""Per-request signals that one plugin computes and others read, with their keys.

Plugins share results through ``LLMRequest.state`` rather than recomputing them: the prefix
scorer's per-endpoint match is what the P/D handler needs to decide whether to disaggregate, and
what the latency-predicting scorer needs to estimate uncached prefill work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kv_picker.endpoint import Endpoint
from kv_picker.request import LLMRequest

PREFIX_MATCH = "signals.prefix_match"
PROMPT_TOKENS = "signals.prompt_tokens"
# predicted-latency-scorer's ranking cost per candidate: (the candidates, their costs in the same
# order), each the predicted time to first token in seconds with the decode excess and miss cost
# it adds; for the active-request scorer's latencyBand.
PREDICTED_COST = "signals.predicted_cost"

# Without a tokenizer, English text averages about four characters per token.
DEFAULT_CHARS_PER_TOKEN = 4.0


@dataclass(slots=True)
class PrefixMatch:
    """How much of a request's prompt each endpoint already holds.

    Attributes:
        block_tokens: tokens per block (estimated in approximate mode).
        total_blocks: the request's full blocks that were looked up.
        matched_blocks: endpoint id -> leading blocks held (absent: none).
        capped: the prompt has full blocks past ``total_blocks`` that the scorer's
            ``maxPrefixBlocksToMatch`` left unhashed, so a match of all ``total_blocks`` says
            nothing about the rest.
        whole_tokens: when above 0 (the scorer's ``cappedMatchIsWhole``) and ``capped``, an
            endpoint matching all ``total_blocks`` counts as holding this many tokens (the
            whole prompt) rather than the blocks looked up: a context cached that far is
            usually cached whole.
    """

    block_tokens: float
    total_blocks: int
    matched_blocks: dict[int, int] = field(default_factory=dict)
    capped: bool = False
    whole_tokens: float = 0.0

    def cached_tokens(self, endpoint_id: int) -> float:
        return self._tokens(self.matched_blocks.get(endpoint_id, 0))

    def most_cached_tokens(self, endpoint_ids: Iterable[int]) -> float:
        """The most prompt tokens any of ``endpoint_ids`` holds: ``max(cached_tokens(i))``
        with one dictionary read per endpoint (cached tokens grow with the blocks held)."""
        get = self.matched_blocks.get
        return self._tokens(max((get(i, 0) for i in endpoint_ids), default=0))

    def _tokens(self, blocks: int) -> float:
        if self.whole_tokens and self.capped and blocks >= self.total_blocks:
            # The prompt's length may be an estimate (characters / 4): never below the match.
            return max(self.whole_tokens, blocks * self.block_tokens)
        return blocks * self.block_tokens


class PublishesPrefixMatch:
    """For a prefix scorer, whose :meth:`score` publishes ``PREFIX_MATCH``: :meth:`match` looks
    the request up for a plugin that reads the match before the scorers run
    (``prefix-cache-affinity-filter``)."""

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        raise NotImplementedError

    def match(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> PrefixMatch | None:
        """The request's match on ``candidates``, published as :meth:`score` publishes it; None
        when the prompt has no full block."""
        self.score(request, candidates, [0.0] * len(candidates))
        found = request.state.get(PREFIX_MATCH)
        return found if isinstance(found, PrefixMatch) and found.total_blocks else None


def prompt_tokens(request: LLMRequest, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> float:
    """The prompt's length in tokens: exact when a tokenizer ran, estimated otherwise."""
    exact = request.state.get(PROMPT_TOKENS)
    if isinstance(exact, int | float):
        return float(exact)
    return len(request.prompt.text) / chars_per_token


def cached_tokens(request: LLMRequest, endpoint_id: int) -> float:
    """Prompt tokens ``endpoint_id`` holds for this request (0 when no prefix scorer ran)."""
    match = request.state.get(PREFIX_MATCH)
    if isinstance(match, PrefixMatch):
        return match.cached_tokens(endpoint_id)
    return 0.0


def uncached_prompt_tokens(
    request: LLMRequest, endpoint_id: int, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
) -> float:
    """Prompt tokens ``endpoint_id`` would have to prefill for this request."""
    return max(0.0, prompt_tokens(request, chars_per_token) - cached_tokens(request, endpoint_id))
