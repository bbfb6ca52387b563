"""precise-prefix-cache-scorer: prefer endpoints whose KV cache really holds the request's
leading blocks, as their own KV events report.

Type: ``precise-prefix-cache-scorer`` (llm-d's name; ``prefix-cache-scorer`` with
``mode: precise`` is accepted as a deprecated alias)

Formula: ``score = sum(weight(best tier holding block i) for i < matched_blocks) /
total_blocks``, where ``matched_blocks`` is the number of consecutive blocks, from block 0, the
endpoint holds in any tier (GPU, CPU, storage: vLLM's ``medium``), ``weight`` the tier's weight
(``index.tierWeights``; GPU 1.0, CPU 0.8, storage 0.5 by default, llm-d's GPU and CPU weights)
and ``total_blocks`` the request's full blocks. With GPU entries only it is
``matched_blocks / total_blocks``.

Inputs: the precise index (``index:`` section; in-process or Redis, both behind
:class:`kv_picker.state.kv_index.KVIndex`) fed by the endpoints' KV events (``kvEvents:``
section). The prompt is tokenized like the model server does (the model's ``tokenizer.json``,
its chat template for chat requests, or the token ids a completion sent), cut into the index's
``blockSizeTokens`` blocks and keyed by model (or LoRA adapter) and ``cache_salt``
(:mod:`kv_picker.state.block_keys`).
A pick counts as holding the request's blocks for ``speculativeTTL`` only, until the
endpoint's own ``BlockStored`` events (sent when its prefill has run) say so: requests for the
same prefix arriving meanwhile follow it instead of spreading.

Async work happens in ``prepare``, before the synchronous schedule: a prompt longer than
``tokenizeInlineMaxChars`` is tokenized on a thread pool, and the index's prefetch runs there
(one round trip with the Redis backend; nothing in process). Without that hook
(``kv-picker explain``) the prompt is tokenized inline and a Redis-backed index gives no signal
beyond the speculative holders. A tokenizer error, or an unavailable backend, means no cache
signal (all scores 0), never a failed request. Building the scorer fails when nothing feeds or
shares an index (no ``kvEvents`` and a memory backend).

Publishes, for other plugins, each endpoint's matched blocks, in any tier
(:data:`kv_picker.scheduling.signals.PREFIX_MATCH`) and the exact prompt length
(:data:`kv_picker.scheduling.signals.PROMPT_TOKENS`). Reports
``kv_picker_kv_index_hit_ratio`` on /metrics.

Parameters (defaults): ``tokenizer`` (required): the model directory holding
``tokenizer.json`` (and ``tokenizer_config.json`` with the chat template), or the file;
``maxPrefixBlocksToMatch`` (256; 0 = unlimited); ``tokenizeInlineMaxChars`` (8192; longer
prompts go to the thread pool); ``speculativeTTL`` (2s; 0 = count only what events report;
``speculativeTtlSeconds`` accepted); ``cappedMatchIsWhole`` (false): as for
``prefix-cache-scorer``, an endpoint matching every block looked up, with prompt past the
limit, is published as holding the whole prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar

from kv_picker.decode import Duration, FieldError, NonNegative, aliases
from kv_picker.scheduling.context import BuildContext, Lifetime
from kv_picker.scheduling.framework import (
    Endpoint,
    LLMRequest,
    PeerPick,
    PluginGauge,
    SchedulingResult,
)
from kv_picker.scheduling.signals import (
    PREFIX_MATCH,
    PROMPT_TOKENS,
    PrefixMatch,
    PublishesPrefixMatch,
    prompt_tokens,
)
from kv_picker.state.kv_index import KVIndex, Prefetched, SpeculativeHolders
from kv_picker.state.prefix_runs import mask_of
from kv_picker.state.tokenization import PromptInput, PromptTokenizer, TokenizerError, prompt_input

log = logging.getLogger(__name__)

_KEYS_STATE = "precise_prefix_cache.keys"
_PREFETCHED_STATE = "precise_prefix_cache.prefetched"  # what the index fetched in prepare
_NO_KEYS: list[int] = []


@dataclass(frozen=True)
class PrecisePrefixCacheParams:
    tokenizer: str = ""
    maxPrefixBlocksToMatch: Annotated[int, NonNegative] = 256
    tokenizeInlineMaxChars: Annotated[int, NonNegative] = 8192
    speculativeTTL: Annotated[Duration, NonNegative] = field(
        default=2.0, metadata=aliases("speculativeTtlSeconds")
    )
    cappedMatchIsWhole: bool = False

    def validate(self) -> None:
        if not self.tokenizer:
            raise FieldError(
                "tokenizer",
                "required: the model's directory with tokenizer.json, or the file",
            )
        path = Path(self.tokenizer)
        if not (path / "tokenizer.json" if path.is_dir() else path).is_file():
            raise FieldError("tokenizer", f"no tokenizer.json at {self.tokenizer}")


class PrecisePrefixCacheScorer(PublishesPrefixMatch):
    type_name: ClassVar[str] = "precise-prefix-cache-scorer"
    Params = PrecisePrefixCacheParams

    def __init__(self, name: str, params: PrecisePrefixCacheParams, ctx: BuildContext) -> None:
        self.name = name
        self.params = params
        index = ctx.kv_index
        if index is None:
            raise ValueError(
                "needs a kvEvents section (where the endpoints publish KV events), or "
                "index.backend: redis to read an index other replicas write"
            )
        self.index: KVIndex = index

        def load_tokenizer(lifetime: Lifetime) -> PromptTokenizer:
            try:
                return PromptTokenizer.load(params.tokenizer)
            except TokenizerError as exc:
                raise ValueError(f"parameter 'tokenizer': {exc}") from exc

        self.tokenizer = ctx.shared_resource(
            ("tokenizer", str(Path(params.tokenizer).resolve())), PromptTokenizer, load_tokenizer
        )
        self.event_keys = index.event_keys
        self.max_blocks = params.maxPrefixBlocksToMatch
        self.max_tokens = self.max_blocks * self.event_keys.block_size_tokens
        self._runs: list[int] = []  # by endpoint id, reused by every request
        self._weighted: list[float] = []  # likewise: weighted runs
        self.speculative: SpeculativeHolders | None = None
        if params.speculativeTTL > 0:
            ttl_s = params.speculativeTTL

            def create(lifetime: Lifetime) -> SpeculativeHolders:
                holders = SpeculativeHolders(ttl_s, ctx.clock)
                lifetime.hold(ctx.store.on_removed(holders.forget_endpoint))
                return holders

            # Shared across reloads, like the approximate index.
            self.speculative = ctx.shared_resource(
                ("speculative-holders", ttl_s), SpeculativeHolders, create
            )
        self.lookups = 0
        self.queried_blocks = 0
        self.hit_blocks = 0

    # -- keys -------------------------------------------------------------------------------

    def _input(self, request: LLMRequest) -> PromptInput:
        try:
            found = prompt_input(self.tokenizer, request.prompt)
        except TokenizerError as exc:
            log.debug("request %s: %s; no cache signal", request.request_id, exc)
            return PromptInput(token_ids=_NO_KEYS)
        return found if found is not None else PromptInput(request.prompt.text)

    def _keys_of(self, request: LLMRequest, token_ids: Sequence[int]) -> list[int]:
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
        request.state[_KEYS_STATE] = keys
        return keys

    def _encode(self, found: PromptInput) -> list[int]:
        if found.token_ids is None:
            found.token_ids = self.tokenizer.encode(
                found.text, found.add_special_tokens, self.max_tokens
            )
        return found.token_ids

    def keys(self, request: LLMRequest) -> list[int]:
        """The request's keys, computed once (inline when ``prepare`` did not run)."""
        keys: list[int] | None = request.state.get(_KEYS_STATE)
        if keys is None:
            keys = self._keys_of(request, self._encode(self._input(request)))
        return keys

    # -- the two phases ---------------------------------------------------------------------

    def prepare(self, request: LLMRequest) -> Awaitable[None] | None:
        if _KEYS_STATE in request.state:
            return None
        found = self._input(request)
        if found.token_ids is None and len(found.text) > self.params.tokenizeInlineMaxChars:
            return self._prepare_offloaded(request, found)
        # Short prompts are tokenized inline; only a backend that fetches needs a coroutine.
        fetching = self.index.prefetch(self._keys_of(request, self._encode(found)))
        return None if fetching is None else self._keep_prefetched(request, fetching)

    async def _prepare_offloaded(self, request: LLMRequest, found: PromptInput) -> None:
        found.token_ids = await self.tokenizer.encode_async(
            found.text, found.add_special_tokens, self.max_tokens
        )
        fetching = self.index.prefetch(self._keys_of(request, found.token_ids))
        if fetching is not None:
            await self._keep_prefetched(request, fetching)

    async def _keep_prefetched(
        self, request: LLMRequest, fetching: Awaitable[Prefetched | None]
    ) -> None:
        request.state[_PREFETCHED_STATE] = await fetching

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        keys = self.keys(request)
        total = len(keys)
        matched: dict[int, int] = {}
        block = self.event_keys.block_size_tokens
        # Past the limit the prompt's length is the tokenizer's count, or its characters / 4.
        capped = bool(self.max_blocks) and total == self.max_blocks
        capped = capped and prompt_tokens(request) >= (total + 1) * block
        whole = prompt_tokens(request) if capped and self.params.cappedMatchIsWhole else 0.0
        request.state[PREFIX_MATCH] = PrefixMatch(block, total, matched, capped, whole)
        if not total:
            return
        runs = self._runs
        weighted = self._weighted
        best = self.index.runs(
            keys,
            mask_of(candidates),
            runs,
            request.state.get(_PREFETCHED_STATE),
            self.speculative,
            weighted,
        )
        if best:
            for i, endpoint in enumerate(candidates):
                run = runs[endpoint.id]
                if run:
                    matched[endpoint.id] = run
                    out[i] = weighted[endpoint.id] / total
        self.lookups += 1
        self.queried_blocks += total
        self.hit_blocks += best

    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        speculative = self.speculative
        if speculative is None:
            return
        keys = request.state.get(_KEYS_STATE)
        if not keys:
            return
        speculative.record(result.destination.id, keys)
        prefill = result.prefill_endpoint
        if prefill is not None:
            speculative.record(prefill.id, keys)

    def pick_keys(self, request: LLMRequest) -> Sequence[int] | None:
        if self.speculative is None:
            return None
        return request.state.get(_KEYS_STATE) or None

    def record_peer_pick(self, pick: PeerPick, keys: Sequence[int]) -> None:
        speculative = self.speculative
        if speculative is not None:
            for endpoint_id in pick.ids:
                speculative.record(endpoint_id, keys)

    def collect_metrics(self) -> Iterable[PluginGauge]:
        if self.queried_blocks:
            yield PluginGauge(
                "kv_picker_kv_index_hit_ratio",
                "Best candidate's matched blocks over blocks looked up in the precise index, "
                "[0,1].",
                self.hit_blocks / self.queried_blocks,
            )
