"""prefix-cache-scorer: prefer endpoints the picker already sent the request's leading blocks.

Type: ``prefix-cache-scorer`` (approximate: no tokenizer, no events; for the endpoints' own
KV events see ``precise-prefix-cache-scorer``)

Formula: ``score = matched_blocks / total_blocks`` where ``matched_blocks`` is the number of
consecutive blocks, from block 0, recorded for the endpoint, and ``total_blocks`` the
request's full blocks. A prompt shorter than one block scores 0 everywhere.

Inputs: the prompt's text (:attr:`kv_picker.request.Prompt.text`) cut into ``blockSizeChars``
blocks of its UTF-8 bytes, keyed by the picker's chained block hash rooted in the model (or the
LoRA adapter) and ``cache_salt`` (:mod:`kv_picker.state.hashing`). After each pick the
destination is recorded as holding those blocks; each endpoint remembers its
``lruCapacityPerServer`` most recent keys. When the P/D handler disaggregated the request, the
prefill endpoint is recorded at the pick and the destination only once the prompt's KV has
reached it (the first response byte, or the prefill's end learned otherwise): until then the
destination does not hold the blocks, and a request sent there meanwhile, served there without
a prefill endpoint because the index said the prompt was cached, would compute the whole prompt
again on a decode endpoint. On the routing matrix's P/D cells of long documents (Llama 3.1 70B,
0.3 load, draws 1-3, policy seed 0), recording the destination at the pick gave TTFT means of
0.81, 1.10 and 0.54 s, against 0.35, 0.38 and 0.17 s with it recorded at the KV's arrival; on
draws 70-72, which no choice had seen, the default passed every P/D cell with it and 20 of 24
without (``benchmarks/RESULTS.md`` section 1). ``recordDestinationAt: pick`` records the destination
at the pick as well, as this scorer did before and llm-d's approximate scorer does. Other
workers of ``serve --workers`` record a peer's P/D destination at its pick either way.
The index outlives config reloads that keep its shape.

Publishes, for other plugins, each endpoint's matched blocks
(:data:`kv_picker.scheduling.signals.PREFIX_MATCH`), with about 4 characters per token.
Reports ``kv_picker_prefix_index_keys`` and ``kv_picker_prefix_index_hit_ratio`` on /metrics.

Parameters (defaults): ``blockSizeChars`` (64, about 16 tokens of English text, vLLM's default
block; upstream name ``hashBlockSize`` accepted), ``maxPrefixBlocksToMatch`` (256; 0 =
unlimited; longer prompts are matched on their head), ``lruCapacityPerServer`` (31250 blocks
per endpoint). ``mode: precise`` is the deprecated spelling of ``precise-prefix-cache-scorer``
(accepted with a warning). ``cappedMatchIsWhole`` (false): when the prompt goes on past
``maxPrefixBlocksToMatch`` blocks, an endpoint matching every block looked up is published as
holding the whole prompt (its score here is 1 either way). Every reader of the match then sees
it so: the latency estimate, the in-flight scorer's ``cachedScale``, the director's count of
the prefill queued at the pick, the P/D decision. Without it they count the rest of a long
cached context as uncached there, and `kv-picker bench moves` measured the latency estimate
3-25 times too high at such picks on the routing matrix, where the simulated caches held a
median 95-100% of those prompts (``benchmarks/RESULTS.md`` section 1). On the matrix it passed
more cells than the default on every draw set and lowered TTFT where long contexts are cached,
and on long documents at high load it kept questions with their documents' endpoints until
their decode slowed (down to 0.71 of the best output throughput). The built-in default sets it
together with the latency estimate's decode term for long prompts, which answers that
(``predicted-latency-scorer``'s ``decodeMinPromptTokens``).

``matchLengthWeight`` (0, at most 1) mixes in the matched length itself, as llm-d's scorer of
this name does: ``score = w * min(1, matched_tokens / matchLengthScaleTokens)^2 + (1 - w) *
matched_blocks / total_blocks`` with ``matchLengthScaleTokens`` (8192) and ``matched_tokens`` =
matched blocks x ``blockSizeChars`` / 4; so a long match outweighs a short prompt matched whole.
Configs written for llm-d's producer and scorer pair load as this scorer (:mod:`kv_picker.upstream`).

``pendingYieldTokens`` (0: off) stops a context still being computed from drawing requests
away from an endpoint that already holds it. The index records blocks at the pick, before the
endpoint has computed them. So when a long context is placed again on a second endpoint, the
requests that follow score the second as high as the first holder for the next seconds, and
some queue there behind the context's own prefill. With the option, a candidate scores 0
when:

- its match covers at least ``pendingYieldTokens`` tokens;
- the uncached prompt tokens this picker sent there and that have no first byte yet (the
  endpoint store's queued prefill) are at least its matched tokens, so the match may still be
  in the queue;
- another candidate matches at least as many blocks without such a queue (with
  ``pendingYieldDecode`` at k > 0, and decodes at most k times as much: the prompt tokens in
  flight there, per unit of its class's decode speed, are at most k times the first's, whose
  own count includes the context it is computing).

The published match is unchanged, so the latency estimate and the other readers still see the
context as held there. A context nobody has computed yet keeps its burst on the endpoint
computing it, since no candidate then holds it with a short queue. Judged at 8,192 tokens on
the routing matrix under three policy seeds, it passed more cells with a lower TTFT on the
held-out families and on draws no choice had seen, but the held-out half's worst throughput
cell was worse (long documents at high load: questions kept with a holder that decodes more),
so the built-in default does not set it (``benchmarks/RESULTS.md`` section 1). With
``pendingYieldDecode`` at 2 it lost less throughput there, and on draws no choice had seen it
passed one cell more than the default with the same TTFT on average, its worst TTFT p90 and
throughput cells better and its worst TTFT mean cell 0.7% worse, so that is not set either.

``fullYield`` (0: off; set it to the engines' ``--max-num-seqs``) stops a cache hit drawing
requests to an engine whose sequence slots are all taken. A request sent there waits for a
running one to end before its prefill, short as it is, can start; in a burst that fills the
holders of a hot prefix together, that is seconds, and an endpoint with a free slot computes the
prefix again sooner. With the option a candidate with at least ``fullYield`` requests in flight
from this picker scores 0 while some candidate has at least ``fullYieldFree`` (1) slots free;
otherwise the scores stand. In a burst that fills every endpoint within moments, the endpoint
with one slot free is as full by the time it has computed the prefix again; a larger
``fullYieldFree`` yields only to a candidate with room to spare. The published match is
unchanged: the latency estimate, which prices the slot wait, still sees the prompt as held
there. On the routing matrix (draws 58-60, seeds 0-2) it
took the calibrated profile at latency weight 1.5 from a worst TTFT mean cell of 1.38x the best
(a burst on a mixed pool) to 1.21x with 220 pooled cells against the default's 205; on the
fresh draws 61-63 that profile passed 215 against 213 with a lower TTFT mean, but its worst TTFT
mean cell was 1.33x the best where the default's is 1.09x, and with the default alone it raised
the TTFT mean (``benchmarks/RESULTS.md`` section 1): not set alone. With
``fullYieldFree`` 16 that profile kept its gains on both draw sets without the failing cell,
found after both were read; on the fresh draws 64-66 it passed 222 pooled cells against 216
with a lower TTFT mean and was not confirmed: a worst TTFT mean cell of 1.51x the best against
the default's 1.47x (long documents at light load, where its decode term from 8,192 prompt
tokens moves questions off their document's holder). With the latency estimate's blocking cost
below saturation it was confirmed on draws 67-69 (``benchmarks/RESULTS.md`` section 1, "An
eighth round"); the built-in default sets ``fullYield`` 64 with ``fullYieldFree`` 16 since then.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from kv_picker.decode import NonNegative, Positive, Range, aliases
from kv_picker.scheduling.context import BuildContext, Lifetime
from kv_picker.scheduling.framework import (
    Endpoint,
    EndpointId,
    LLMRequest,
    PeerPick,
    PluginGauge,
    SchedulingResult,
)
from kv_picker.scheduling.signals import (
    DEFAULT_CHARS_PER_TOKEN,
    PREFIX_MATCH,
    PrefixMatch,
    PublishesPrefixMatch,
    prompt_tokens,
)
from kv_picker.state.approx_index import ApproximatePrefixIndex
from kv_picker.state.hashing import chain_keys, chain_root
from kv_picker.state.prefix_runs import mask_of

_KEYS_STATE = "prefix_cache.keys"
_CAPPED_STATE = "prefix_cache.capped"

# Parameters of the approximate scorer that mean nothing to the precise one.
_APPROXIMATE_ONLY = ("mode", "blockSizeChars", "hashBlockSize", "lruCapacityPerServer")


@dataclass(frozen=True)
class PrefixCacheParams:
    blockSizeChars: Annotated[int, Range(ge=1)] = field(
        default=64, metadata=aliases("hashBlockSize")
    )
    maxPrefixBlocksToMatch: Annotated[int, NonNegative] = 256
    lruCapacityPerServer: Annotated[int, Range(ge=1)] = 31250
    mode: Literal["approximate", "precise"] = "approximate"
    cappedMatchIsWhole: bool = False
    pendingYieldTokens: Annotated[int, NonNegative] = 0
    pendingYieldDecode: Annotated[float, NonNegative] = 0.0
    fullYield: Annotated[int, NonNegative] = 0
    fullYieldFree: Annotated[int, Range(ge=1)] = 1
    matchLengthWeight: Annotated[float, Range(ge=0, le=1)] = 0.0
    matchLengthScaleTokens: Annotated[float, Positive] = 8192.0
    recordDestinationAt: Literal["landed", "pick"] = "landed"


MAX_LANDINGS = 65_536
"""Disaggregated requests whose KV may still be on its way to the destination, at most; past
it the oldest is forgotten (its destination is then never recorded as holding its blocks)."""


class Landings:
    """The blocks each disaggregated request's destination will hold once its KV arrives, by
    request (its serial, or another worker's name for it), oldest first."""

    def __init__(self, capacity: int = MAX_LANDINGS) -> None:
        self._capacity = capacity
        self._pending: dict[int | str, tuple[Endpoint, Sequence[int]]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def expect(self, request: int | str, destination: Endpoint, keys: Sequence[int]) -> None:
        pending = self._pending
        pending.pop(request, None)
        pending[request] = (destination, keys)
        if len(pending) > self._capacity:
            del pending[next(iter(pending))]

    def take(self, request: int | str) -> tuple[Endpoint, Sequence[int]] | None:
        return self._pending.pop(request, None)


@dataclass(slots=True)
class _PrefixState:
    """What a prefix scorer learned, kept across a config reload that keeps its shape."""

    index: ApproximatePrefixIndex
    landings: Landings


class PrefixCacheScorer(PublishesPrefixMatch):
    type_name: ClassVar[str] = "prefix-cache-scorer"
    Params = PrefixCacheParams

    @staticmethod
    def redirect(raw: Any) -> tuple[str, Any] | None:
        """``mode: precise`` is ``precise-prefix-cache-scorer`` (the older spelling)."""
        if isinstance(raw, Mapping) and raw.get("mode") == "precise":
            return "precise-prefix-cache-scorer", {
                k: v for k, v in raw.items() if k not in _APPROXIMATE_ONLY
            }
        return None

    def __init__(self, name: str, params: PrefixCacheParams, ctx: BuildContext) -> None:
        if params.pendingYieldDecode and not params.pendingYieldTokens:
            raise ValueError("pendingYieldDecode needs pendingYieldTokens (it narrows that yield)")
        if params.fullYieldFree != 1 and not params.fullYield:
            raise ValueError("fullYieldFree needs fullYield (it narrows that yield)")
        self.name = name
        self.params = params

        def create(lifetime: Lifetime) -> _PrefixState:
            index = ApproximatePrefixIndex(params.lruCapacityPerServer)
            lifetime.hold(ctx.store.on_removed(index.remove_endpoint))
            return _PrefixState(index, Landings())

        # The index outlives a config reload that keeps its shape, and so do the blocks on
        # their way to a P/D destination, which the reloaded scorer records when they land.
        key = ("prefix-index", name, params.blockSizeChars, params.lruCapacityPerServer)
        state = ctx.shared_resource(key, _PrefixState, create)
        self.index = state.index
        self._landings = state.landings
        self._runs: list[int] = []  # by endpoint id, reused by every request
        self._store = ctx.store
        self._hardware = ctx.hardware

    def keys(self, request: LLMRequest) -> list[int]:
        """The request's block keys, computed once per request."""
        keys: list[int] | None = request.state.get(_KEYS_STATE)
        if keys is None:
            root = chain_root(request.target_model, request.lora_adapter, request.cache_salt)
            data = request.prompt.text.encode()
            block = self.params.blockSizeChars
            keys = chain_keys(data, root, block, self.params.maxPrefixBlocksToMatch)
            request.state[_KEYS_STATE] = keys
            # Full blocks past the limit: the match cannot see them (PrefixMatch.capped).
            request.state[_CAPPED_STATE] = len(data) // block > len(keys)
        return keys

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        keys = self.keys(request)
        if not keys:
            return
        total = len(keys)
        matched: dict[int, int] = {}
        # Shared with the P/D handler and the latency scorer: how much each endpoint holds.
        capped = request.state.get(_CAPPED_STATE, False)
        request.state[PREFIX_MATCH] = PrefixMatch(
            self.params.blockSizeChars / DEFAULT_CHARS_PER_TOKEN,
            total,
            matched,
            capped,
            prompt_tokens(request) if capped and self.params.cappedMatchIsWhole else 0.0,
        )
        runs = self._runs
        if not self.index.runs(keys, mask_of(candidates), runs):
            return
        for i, endpoint in enumerate(candidates):
            run = runs[endpoint.id]
            if run:
                matched[endpoint.id] = run
                out[i] = run / total
        if self.params.matchLengthWeight:
            self._weigh_length(candidates, runs, out)
        if self.params.pendingYieldTokens and len(matched) > 1:
            self._yield_pending(candidates, runs, out)
        if self.params.fullYield:
            self._yield_full(candidates, out)

    def _weigh_length(
        self, candidates: Sequence[Endpoint], runs: list[int], out: list[float]
    ) -> None:
        """``matchLengthWeight``: part of the score from the matched tokens themselves."""
        weight = self.params.matchLengthWeight
        block_tokens = self.params.blockSizeChars / DEFAULT_CHARS_PER_TOKEN
        scale = self.params.matchLengthScaleTokens
        for i, endpoint in enumerate(candidates):
            run = runs[endpoint.id]
            if run:
                length = min(1.0, run * block_tokens / scale)
                out[i] = weight * length * length + (1.0 - weight) * out[i]

    def _yield_full(self, candidates: Sequence[Endpoint], out: list[float]) -> None:
        """Zero the score of a holder with ``fullYield`` requests in flight (every sequence
        slot taken) while some candidate has ``fullYieldFree`` slots free (``fullYield``)."""
        cap = self.params.fullYield
        in_flight = self._store.in_flight
        room = cap - self.params.fullYieldFree
        if all(in_flight[endpoint.id] > room for endpoint in candidates):
            return
        for i, endpoint in enumerate(candidates):
            if out[i] and in_flight[endpoint.id] >= cap:
                out[i] = 0.0

    def _yield_pending(
        self, candidates: Sequence[Endpoint], runs: list[int], out: list[float]
    ) -> None:
        """Zero the score of a long match that may still be queued where another candidate
        holds as much without such a queue (``pendingYieldTokens``)."""
        block_tokens = self.params.blockSizeChars / DEFAULT_CHARS_PER_TOKEN
        least = self.params.pendingYieldTokens
        queued = self._store.prefill_tokens
        decode = self.params.pendingYieldDecode
        pending: list[int] = []
        settled: list[tuple[int, float]] = []  # (run, decode load) of each settled holder
        for i, endpoint in enumerate(candidates):
            run = runs[endpoint.id]
            if not run:
                continue
            tokens = run * block_tokens
            if tokens >= least and queued[endpoint.id] >= tokens:
                pending.append(i)
            else:
                settled.append((run, self._decode_load(endpoint) if decode else 0.0))
        if not settled:
            return
        for i in pending:
            run = runs[candidates[i].id]
            load = self._decode_load(candidates[i]) if decode else 0.0
            if any(r >= run and (not decode or held <= decode * load) for r, held in settled):
                out[i] = 0.0

    def _decode_load(self, endpoint: Endpoint) -> float:
        """The KV the endpoint's decode steps read, per unit of its class's decode speed."""
        speed = self._hardware.of(endpoint.labels).decode_speed
        return self._store.in_flight_tokens[endpoint.id] / speed

    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        keys = self.keys(request)
        if keys:
            prefill = result.prefill_endpoint
            prefill_id = prefill.id if prefill is not None else None
            self._record(result.destination, prefill_id, keys, request.serial)

    def _record(
        self,
        destination: Endpoint | None,
        prefill: EndpointId | None,
        keys: Sequence[int],
        landing: int | str | None,
    ) -> None:
        """Record a pick, this worker's or another's (``destination`` None: one this worker
        does not know). Disaggregated, the prefill endpoint computes the blocks now and the
        destination holds them once their KV has arrived (``landing`` names that moment:
        :meth:`on_prompt_landed`, :meth:`record_peer_landing`; a pick without one is
        recorded at once)."""
        if prefill is not None and (destination is None or prefill != destination.id):
            self.index.record(prefill, keys)
            if self.params.recordDestinationAt == "landed" and landing is not None:
                if destination is not None:
                    self._landings.expect(landing, destination, keys)
                return
        if destination is not None:
            self.index.record(destination.id, keys)

    def on_prompt_landed(self, request: LLMRequest, result: SchedulingResult) -> None:
        self._land(request.serial)

    def _land(self, landing: int | str) -> None:
        pending = self._landings.take(landing)
        if pending is None:
            return
        destination, keys = pending
        if self._store.get(destination.id) is destination:  # not left (and its id reused)
            self.index.record(destination.id, keys)

    def pick_keys(self, request: LLMRequest) -> Sequence[int] | None:
        return self.keys(request) or None

    def record_peer_pick(self, pick: PeerPick, keys: Sequence[int]) -> None:
        destination = self._store.get(pick.destination) if pick.destination is not None else None
        self._record(destination, pick.prefill, keys, pick.landing)

    def record_peer_landing(self, landing: str) -> None:
        self._land(landing)

    def export_state(self, addresses: Mapping[int, str]) -> dict[str, list[int]]:
        return {
            address: keys
            for endpoint_id, address in addresses.items()
            if (keys := self.index.held(endpoint_id))
        }

    def import_state(self, state: Mapping[str, Sequence[int]], ids: Mapping[str, int]) -> int:
        learned = 0
        for address, keys in state.items():
            endpoint_id = ids.get(address)
            if endpoint_id is not None and keys:
                self.index.record(endpoint_id, keys)
                learned += len(keys)
        return learned

    def collect_metrics(self) -> Iterable[PluginGauge]:
        index = self.index
        yield PluginGauge(
            "kv_picker_prefix_index_keys",
            "Distinct block keys in the approximate prefix index.",
            len(index),
        )
        if index.queried_blocks:
            yield PluginGauge(
                "kv_picker_prefix_index_hit_ratio",
                "Blocks matched over blocks looked up in the approximate prefix index, [0,1].",
                index.hit_blocks / index.queried_blocks,
            )
