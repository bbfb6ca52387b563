"""token-load-scorer: prefer the endpoint with the least prompt work queued, this request's own
included.

Type: ``token-load-scorer`` (llm-d's scorer of that name, whose configs load unchanged).

Formula: ``load = in-flight tokens + this request's uncached tokens there``, ``score = 1`` when
the load is 0, else ``1 - min(load, queueThresholdTokens) / queueThresholdTokens``.

Inputs: an endpoint's *in-flight tokens* are the uncached prompt tokens this picker sent it
that have not reached their first token (what llm-d's ``inflight-load-producer`` counts; the
picker keeps this count itself). The request's uncached tokens are its prompt tokens less the
ones the endpoint holds, from the prefix match a prefix scorer or ``prefix-cache-affinity-filter``
published for this request (without one: the whole prompt, exact when a tokenizer ran, else its
characters / 4).

Parameters: ``queueThresholdTokens`` (4194304, llm-d's: 128 requests of 32K tokens; 0 or less:
the default, as upstream). llm-d's ``inFlightLoadProducerName`` and ``nonTextTokenWeight`` are
accepted so its configs load; the prompts read here are text, so the weight changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest
from kv_picker.scheduling.signals import uncached_prompt_tokens

DEFAULT_THRESHOLD_TOKENS = 4_194_304


@dataclass(frozen=True)
class TokenLoadParams:
    queueThresholdTokens: int = DEFAULT_THRESHOLD_TOKENS
    inFlightLoadProducerName: str = ""
    nonTextTokenWeight: float = 1.0


class TokenLoadScorer:
    type_name: ClassVar[str] = "token-load-scorer"
    Params = TokenLoadParams

    def __init__(self, name: str, params: TokenLoadParams, ctx: BuildContext) -> None:
        self.name = name
        threshold = params.queueThresholdTokens
        self.threshold = float(threshold if threshold > 0 else DEFAULT_THRESHOLD_TOKENS)
        self._store = ctx.store

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        queued = self._store.prefill_tokens
        threshold = self.threshold
        for i, endpoint in enumerate(candidates):
            load = queued[endpoint.id] + uncached_prompt_tokens(request, endpoint.id)
            out[i] = 1.0 if load <= 0 else 1.0 - min(load, threshold) / threshold
