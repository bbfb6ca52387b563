"""prefix-cache-scorer: prefer endpoints that already hold the request's leading blocks.

Type: ``prefix-cache-scorer``

Formula: ``score = matched_blocks / total_blocks`` where ``matched_blocks`` is the number of
consecutive blocks, from block 0, the endpoint holds, and ``total_blocks`` the request's full
blocks. A prompt shorter than one block scores 0 everywhere.

Modes:
- ``approximate`` (default): no tokenizer, no events. The prompt's bytes are cut into
  ``blockSizeChars`` blocks with chained xxhash keys seeded by model, LoRA adapter and
  ``cache_salt`` (see :mod:`picker.state.hashing`). After each pick the chosen endpoint (and the
  endpoint of a profile named ``prefill``, when one ran) is recorded as holding those blocks,
  each endpoint remembering its ``lruCapacityPerServer`` most recent keys.
- ``precise``: from the endpoints' own KV events. Not built yet: selecting it is a config error.

Parameters (defaults):
- ``mode``: ``approximate``
- ``blockSizeChars``: 64 (about 16 tokens of English text, vLLM's default block)
- ``maxPrefixBlocksToMatch``: 256 (0 = unlimited); longer prompts are matched on their head
- ``lruCapacityPerServer``: 31250 blocks per endpoint
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from picker.scheduling.signals import DEFAULT_CHARS_PER_TOKEN, PREFIX_MATCH, PrefixMatch
from picker.scheduling.types import BuildContext, LLMRequest, SchedulingResult
from picker.state.approx_index import ApproximatePrefixIndex
from picker.state.endpoints import Endpoint
from picker.state.hashing import char_block_keys, request_seed

_KEYS_STATE = "prefix_cache.keys"


@dataclass(frozen=True)
class PrefixCacheParams:
    mode: str = "approximate"
    blockSizeChars: int = 64
    maxPrefixBlocksToMatch: int = 256
    lruCapacityPerServer: int = 31250

    def validate(self) -> None:
        if self.mode not in ("approximate", "precise"):
            raise ValueError(f"parameter 'mode' must be approximate or precise, got {self.mode!r}")
        if self.mode == "precise":
            raise ValueError(
                "parameter 'mode': precise mode needs the KV-event index, which this build "
                "does not have yet; use mode: approximate"
            )
        if self.blockSizeChars < 1:
            raise ValueError("parameter 'blockSizeChars' must be >= 1")
        if self.maxPrefixBlocksToMatch < 0:
            raise ValueError("parameter 'maxPrefixBlocksToMatch' must be >= 0")
        if self.lruCapacityPerServer < 1:
            raise ValueError("parameter 'lruCapacityPerServer' must be >= 1")


class PrefixCacheScorer:
    type_name: ClassVar[str] = "prefix-cache-scorer"
    Params = PrefixCacheParams

    def __init__(self, name: str, params: PrefixCacheParams, ctx: BuildContext) -> None:
        self.name = name
        self.params = params
        # The index outlives a config reload when its shape is unchanged.
        shared_key = f"prefix-index:{name}:{params.blockSizeChars}:{params.lruCapacityPerServer}"
        index = ctx.shared.get(shared_key)
        if not isinstance(index, ApproximatePrefixIndex):
            index = ApproximatePrefixIndex(params.lruCapacityPerServer)
            ctx.shared[shared_key] = index
            ctx.store.on_removed(index.remove_endpoint)
        self.index = index

    def keys(self, request: LLMRequest) -> list[int]:
        """The request's block keys, computed once per request."""
        keys: list[int] | None = request.state.get(_KEYS_STATE)
        if keys is None:
            seed = request_seed(request.target_model, request.lora_adapter, request.cache_salt)
            keys = char_block_keys(
                request.prompt.encode(),
                seed,
                self.params.blockSizeChars,
                self.params.maxPrefixBlocksToMatch,
            )
            request.state[_KEYS_STATE] = keys
        return keys

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        keys = self.keys(request)
        if not keys:
            return
        mask = 0
        for endpoint in candidates:
            mask |= 1 << endpoint.id
        runs = self.index.match_runs(keys, mask)
        # Shared with the P/D handler and the latency scorer: how much each endpoint holds.
        request.state[PREFIX_MATCH] = PrefixMatch(
            self.params.blockSizeChars / DEFAULT_CHARS_PER_TOKEN, len(keys), runs
        )
        if not runs:
            return
        total = len(keys)
        for i, endpoint in enumerate(candidates):
            run = runs.get(endpoint.id)
            if run:
                out[i] = run / total

    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        keys = self.keys(request)
        if not keys:
            return
        self.index.record(result.primary.targets[0].id, keys)
        prefill = result.profile_results.get("prefill")
        if prefill is not None and prefill.targets:
            self.index.record(prefill.targets[0].id, keys)
