"""prefix-cache-scorer: prefer endpoints that already hold the request's leading blocks.

Type: ``prefix-cache-scorer``

Formula: ``score = matched_blocks / total_blocks`` where ``matched_blocks`` is the number of
consecutive blocks, from block 0, the endpoint holds, and ``total_blocks`` the request's full
blocks. A prompt shorter than one block scores 0 everywhere.

Modes:
- ``approximate`` (default): no tokenizer, no events. The prompt's bytes are cut into
  ``blockSizeChars`` blocks with chained xxhash keys seeded by model, LoRA adapter and
  ``cache_salt`` (see :mod:`kv_picker.state.hashing`). After each pick the chosen endpoint (and the
  endpoint of a profile named ``prefill``, when one ran) is recorded as holding those blocks,
  each endpoint remembering its ``lruCapacityPerServer`` most recent keys.
- ``precise``: from the endpoints' own KV events (:mod:`kv_picker.sources.kv_events`) in the
  precise index (``index:`` section; in-process or Redis). The prompt is tokenized like the
  model server does (the model's ``tokenizer.json``, its chat template for chat requests, or
  the token ids a completion sent), cut into the index's ``blockSizeTokens`` blocks and keyed
  by model, LoRA adapter and ``cache_salt`` (:mod:`kv_picker.state.block_keys`); an endpoint's
  score is the run of leading blocks it really holds. A pick counts as holding the request's
  blocks for ``speculativeTtlSeconds`` only, until the endpoint's own ``BlockStored`` events
  (sent when its prefill has run) say so: requests for the same prefix arriving meanwhile
  follow it instead of spreading.

  Async work happens in ``prepare``, before the synchronous schedule: a prompt longer than
  ``tokenizeInlineMaxChars`` is tokenized on a thread pool, and with the Redis backend the
  lookup (one round trip) is fetched there. Without that hook (``kv-picker explain``) the
  prompt is tokenized inline and a Redis-backed index gives no signal. A tokenizer error,
  or an unavailable backend, means no cache signal (all scores 0), never a failed request.

Both modes publish, for other plugins, each endpoint's matched blocks
(:data:`kv_picker.scheduling.signals.PREFIX_MATCH`); precise mode also the exact prompt length
(:data:`kv_picker.scheduling.signals.PROMPT_TOKENS`).

Parameters (defaults):
- ``mode``: ``approximate``
- ``maxPrefixBlocksToMatch``: 256 (0 = unlimited); longer prompts are matched on their head
- approximate: ``blockSizeChars``: 64 (about 16 tokens of English text, vLLM's default block);
  ``lruCapacityPerServer``: 31250 blocks per endpoint
- precise: ``tokenizer``: path of the model directory holding ``tokenizer.json`` (and
  ``tokenizer_config.json`` with the chat template), or of ``tokenizer.json`` itself; required.
  ``tokenizeInlineMaxChars``: 8192 (longer prompts go to the thread pool);
  ``speculativeTtlSeconds``: 2.0 (0 = count only what events report)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kv_picker.scheduling.signals import (
    DEFAULT_CHARS_PER_TOKEN,
    PREFIX_MATCH,
    PROMPT_TOKENS,
    PrefixMatch,
)
from kv_picker.scheduling.types import BuildContext, LLMRequest, SchedulingResult
from kv_picker.state.approx_index import ApproximatePrefixIndex
from kv_picker.state.endpoints import Endpoint, EndpointStore
from kv_picker.state.hashing import char_block_keys, request_seed
from kv_picker.state.kv_index import EventKeys, KVBlockIndex, SpeculativeHolders, longest_runs
from kv_picker.state.redis_index import RedisKVIndex
from kv_picker.state.tokenization import PromptInput, PromptTokenizer, TokenizerError, prompt_input

log = logging.getLogger(__name__)

_KEYS_STATE = "prefix_cache.keys"
_PRECISE_KEYS_STATE = "prefix_cache.precise_keys"
_PRECISE_RUNS_STATE = "prefix_cache.precise_runs"  # address -> run, from a shared backend
_NO_KEYS: list[int] = []


@dataclass(frozen=True)
class PrefixCacheParams:
    mode: str = "approximate"
    blockSizeChars: int = 64
    maxPrefixBlocksToMatch: int = 256
    lruCapacityPerServer: int = 31250
    tokenizer: str = ""
    tokenizeInlineMaxChars: int = 8192
    speculativeTtlSeconds: float = 2.0

    def validate(self) -> None:
        if self.mode not in ("approximate", "precise"):
            raise ValueError(f"parameter 'mode' must be approximate or precise, got {self.mode!r}")
        if self.mode == "precise":
            if not self.tokenizer:
                raise ValueError(
                    "parameter 'tokenizer' is required in precise mode (the model's directory "
                    "with tokenizer.json, or the file)"
                )
            path = Path(self.tokenizer)
            if not (path / "tokenizer.json" if path.is_dir() else path).is_file():
                raise ValueError(f"parameter 'tokenizer': no tokenizer.json at {self.tokenizer}")
        if self.speculativeTtlSeconds < 0:
            raise ValueError("parameter 'speculativeTtlSeconds' must be >= 0")
        if self.tokenizeInlineMaxChars < 0:
            raise ValueError("parameter 'tokenizeInlineMaxChars' must be >= 0")
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
        self.precise: _PreciseMatcher | None = None
        if params.mode == "precise":
            self.precise = _PreciseMatcher(params, ctx)
            self.index = ApproximatePrefixIndex(1)  # unused in precise mode
            return
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

    def prepare(self, request: LLMRequest) -> Awaitable[None] | None:
        """Async work before scheduling (precise mode only; see the module docstring)."""
        return None if self.precise is None else self.precise.prepare(request)

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        if self.precise is not None:
            self.precise.score(request, candidates, out)
            return
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
        if self.precise is not None:
            self.precise.on_pick(request, result)
            return
        keys = self.keys(request)
        if not keys:
            return
        self.index.record(result.primary.targets[0].id, keys)
        prefill = result.profile_results.get("prefill")
        if prefill is not None and prefill.targets:
            self.index.record(prefill.targets[0].id, keys)


class _PreciseMatcher:
    """Precise mode: exact tokens, keys in the KV-event index's key space, real holders."""

    def __init__(self, params: PrefixCacheParams, ctx: BuildContext) -> None:
        self.params = params
        self.store: EndpointStore = ctx.store
        tokenizer_key = f"tokenizer:{Path(params.tokenizer).resolve()}"
        tokenizer = ctx.shared.get(tokenizer_key)
        if not isinstance(tokenizer, PromptTokenizer):
            try:
                tokenizer = PromptTokenizer.load(params.tokenizer)
            except TokenizerError as exc:
                raise ValueError(f"parameter 'tokenizer': {exc}") from exc
            ctx.shared[tokenizer_key] = tokenizer
        self.tokenizer = tokenizer
        index = ctx.kv_index
        if index is None:
            # No event source in this process (e.g. ``kv-picker explain``): an empty index.
            index = ctx.shared.get("kv-index:empty")
            if not isinstance(index, KVBlockIndex):
                index = ctx.shared["kv-index:empty"] = KVBlockIndex(EventKeys())
        self.index: KVBlockIndex | RedisKVIndex = index
        self.event_keys = index.event_keys
        self.max_blocks = params.maxPrefixBlocksToMatch
        self.max_tokens = self.max_blocks * self.event_keys.block_size_tokens
        self._runs: list[int] = []
        self._speculative_runs: list[int] = []
        self.speculative: SpeculativeHolders | None = None
        if params.speculativeTtlSeconds > 0:
            # Shared across reloads, like the approximate index: one removal callback only.
            key = f"speculative-holders:{params.speculativeTtlSeconds}"
            speculative = ctx.shared.get(key)
            if not isinstance(speculative, SpeculativeHolders):
                speculative = ctx.shared[key] = SpeculativeHolders(
                    params.speculativeTtlSeconds, ctx.clock
                )
                ctx.store.on_removed(speculative.forget_endpoint)
            self.speculative = speculative
        self.lookups = 0
        self.queried_blocks = 0
        self.hit_blocks = 0

    # -- keys -------------------------------------------------------------------------------

    def _input(self, request: LLMRequest) -> PromptInput:
        try:
            found = prompt_input(self.tokenizer, request.kind, request.body)
        except TokenizerError as exc:
            log.debug("request %s: %s; no cache signal", request.request_id, exc)
            return PromptInput(token_ids=_NO_KEYS)
        return found if found is not None else PromptInput(request.prompt)

    def _keys_of(self, request: LLMRequest, token_ids: list[int]) -> list[int]:
        if not self.max_tokens or len(token_ids) < self.max_tokens:
            request.state[PROMPT_TOKENS] = len(token_ids)  # exact unless only the head was read
        try:
            keys = self.event_keys.request_keys(
                token_ids,
                request.target_model,
                request.lora_adapter,
                request.cache_salt,
                self.max_blocks,
            )
        except (OverflowError, TypeError):  # token ids a client sent that are not uint32
            keys = _NO_KEYS
        request.state[_PRECISE_KEYS_STATE] = keys
        return keys

    def keys(self, request: LLMRequest) -> list[int]:
        """The request's keys, computed once (inline when ``prepare`` did not run)."""
        keys: list[int] | None = request.state.get(_PRECISE_KEYS_STATE)
        if keys is None:
            found = self._input(request)
            if found.token_ids is None:
                found.token_ids = self.tokenizer.encode(
                    found.text, found.add_special_tokens, self.max_tokens
                )
            keys = self._keys_of(request, found.token_ids)
        return keys

    # -- the two phases ---------------------------------------------------------------------

    def prepare(self, request: LLMRequest) -> Awaitable[None] | None:
        if _PRECISE_KEYS_STATE in request.state:
            return None
        found = self._input(request)
        offload = found.token_ids is None and len(found.text) > self.params.tokenizeInlineMaxChars
        if not offload and not isinstance(self.index, RedisKVIndex):
            return None  # score() tokenizes inline and looks up in memory
        return self._prepare(request, found, offload)

    async def _prepare(self, request: LLMRequest, found: PromptInput, offload: bool) -> None:
        if found.token_ids is None:
            if offload:
                found.token_ids = await self.tokenizer.encode_async(
                    found.text, found.add_special_tokens, self.max_tokens
                )
            else:
                found.token_ids = self.tokenizer.encode(
                    found.text, found.add_special_tokens, self.max_tokens
                )
        keys = self._keys_of(request, found.token_ids)
        if isinstance(self.index, RedisKVIndex):
            request.state[_PRECISE_RUNS_STATE] = await self.index.lookup(keys)

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        keys = self.keys(request)
        total = len(keys)
        matched: dict[int, int] = {}
        request.state[PREFIX_MATCH] = PrefixMatch(self.event_keys.block_size_tokens, total, matched)
        if not total:
            return
        index = self.index
        best = 0
        runs = self._runs
        size = len(self.store.endpoints)
        if len(runs) < size:
            runs.extend([0] * (size - len(runs)))
            self._speculative_runs.extend([0] * (size - len(self._speculative_runs)))
        mask = 0
        for endpoint in candidates:
            mask |= 1 << endpoint.id
        if isinstance(index, RedisKVIndex):
            by_address: dict[str, int] | None = request.state.get(_PRECISE_RUNS_STATE)
            speculative = self._speculative_runs
            guessed = 0
            if self.speculative is not None:
                guessed = longest_runs(keys, mask, speculative, {}, self.speculative.maps())
            if by_address or guessed:
                for i, endpoint in enumerate(candidates):
                    run = by_address.get(endpoint.address, 0) if by_address else 0
                    if guessed and speculative[endpoint.id] > run:
                        run = speculative[endpoint.id]
                    if run:
                        matched[endpoint.id] = run
                        out[i] = run / total
                        best = max(best, run)
        else:
            best = index.match_runs(keys, mask, runs, self.speculative)
            if best:
                for i, endpoint in enumerate(candidates):
                    run = runs[endpoint.id]
                    if run:
                        matched[endpoint.id] = run
                        out[i] = run / total
        self.lookups += 1
        self.queried_blocks += total
        self.hit_blocks += best

    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        speculative = self.speculative
        if speculative is None:
            return
        keys = request.state.get(_PRECISE_KEYS_STATE)
        if not keys:
            return
        speculative.record(result.primary.targets[0].id, keys)
        prefill = result.profile_results.get("prefill")
        if prefill is not None and prefill.targets:
            speculative.record(prefill.targets[0].id, keys)
