"""Timing and scheduling model of a simulated vLLM engine (pure, synchronous, clock injected).

The engine does no I/O and never reads a clock: the caller passes the model time ``now_s`` to
:meth:`SimEngine.add_request` and :meth:`SimEngine.step`, and advances its own clock by the
returned step duration. The HTTP server drives it in real time (scaled), the offline cluster
simulator drives it from an event queue, and both see the same cache and timing behaviour.

Scheduling follows vLLM v1 at the level a router can observe:

    waiting (FIFO) ──admit when the blocks fit──> running (≤ max_num_seqs) ──max_tokens──> done
                                                    │
    each step: running requests first (prefill chunk or one decode token each), then admit
    waiting ones, all within a budget of max_num_batched_tokens tokens (chunked prefill)

- At admission a request pins its cached leading blocks and reserves slots for the rest of its
  prompt and its whole output, so no request is ever preempted. A request waits while its
  blocks do not fit; one that could never fit, even in an empty cache, is rejected up front.
- Like vLLM, at most ``prompt_len - 1`` tokens are served from the cache: the last prompt
  token is always recomputed to produce the first output token.
- Step duration: :class:`~kv_picker_bench.sim.timing.TimingModel` prices each prefill chunk
  by its new tokens and by the context they attend to (the tokens already computed or cached
  before the chunk), and each decoding sequence by the KV it reads (its prompt plus the outputs
  so far), on top of a fixed cost per step, scaled by the hardware class's ``prefill_speed`` and
  ``decode_speed``. A named profile (``llama-3.1-8b-h100`` by default) gives the figures, so
  prefill time grows with the *uncached* prompt tokens and faster than linearly with the context.
- Output tokens are pseudo-random but deterministic (seeded by the prompt and ``seed``), and
  every request generates exactly ``max_tokens`` tokens (finish reason ``length``).
- A prompt block is cached from the step that schedules its prefill chunk, as vLLM v1 caches
  full blocks when it allocates their slots (``KVCacheManager.allocate_slots``), not when their
  KV has been written: a request admitted later in the same step, or in a later one, hits the
  blocks a running request is computing, and computes only the rest (in a forward pass each
  layer writes the batch's KV before its attention reads it). ``cached_when="computed"`` keeps
  the older model, where a block is hit only after its chunk's step has ended; results measured
  before the change reproduce with it. Blocks of prompt tail plus output are cached as decode
  fills them (the KV of an output token exists from the step after it was sampled). A listener
  hears every stored block together with the storing request's LoRA adapter and cache salt,
  which vLLM's ``BlockStored`` events carry and the cache itself does not know.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import xxhash

from kv_picker.state.hardware import BUILTIN_HARDWARE_CLASSES
from kv_picker.state.hardware import HardwareClass as HardwareClass  # re-exported
from kv_picker_bench.sim.cache import BlockHasher, CacheEventListener, PrefixCache, StoredBlock
from kv_picker_bench.sim.cache import _digest as _block_digest  # keys must equal BlockHasher's
from kv_picker_bench.sim.timing import DEFAULT_TIMING
from kv_picker_bench.sim.timing import TimingModel as TimingModel  # re-exported
from kv_picker_bench.sim.tokenizer import RESERVED_IDS, VOCAB_SIZE

CACHED_WHEN = ("scheduled", "computed")
"""When a prompt block becomes a cache hit (see the module's docstring); the first is vLLM's."""

DEFAULT_NUM_GPU_BLOCKS = 2048
"""KV capacity (blocks) of the reference hardware class when none is configured."""


# One table for the picker's scorers and the simulated endpoints' timing (datasheet-derived
# prefill, decode and KV-capacity factors relative to an H100; see kv_picker.state.hardware).
H100 = BUILTIN_HARDWARE_CLASSES["H100"]

HARDWARE_CLASSES: Mapping[str, HardwareClass] = MappingProxyType(
    {**BUILTIN_HARDWARE_CLASSES, "default": H100}
)


def hardware_class(name: str) -> HardwareClass:
    """Looks up a built-in hardware class.

    Args:
        name: A key of :data:`HARDWARE_CLASSES` (case-sensitive).

    Returns:
        The class.

    Raises:
        ValueError: If the name is unknown; the message lists the known names.
    """
    try:
        return HARDWARE_CLASSES[name]
    except KeyError:
        known = ", ".join(sorted(HARDWARE_CLASSES))
        raise ValueError(f"unknown hardware class {name!r}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Static configuration of one simulated engine.

    Attributes:
        block_size: Tokens per KV block.
        num_gpu_blocks: KV capacity in blocks; ``None`` scales :data:`DEFAULT_NUM_GPU_BLOCKS`
            by the hardware class's ``kv_capacity``.
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Token budget of one step (prefill chunks plus decodes).
        max_model_len: Longest prompt plus output, in tokens.
        hardware: Hardware class.
        timing: Timing profile of the reference hardware (H100), scaled by ``hardware``.
        hash_seed: ``PYTHONHASHSEED`` string of the emulated pod (root of the block hashes).
        seed: Seed of the generated output tokens.
        cached_when: When a prompt block becomes a cache hit: ``scheduled`` (from the step
            that schedules its chunk, as vLLM v1) or ``computed`` (once that step has ended).
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32_768
    hardware: HardwareClass = H100
    timing: TimingModel = DEFAULT_TIMING
    hash_seed: str = "0"
    seed: int = 0
    cached_when: str = "scheduled"

    def __post_init__(self) -> None:
        if self.cached_when not in CACHED_WHEN:
            raise ValueError(
                f"cached_when must be one of {', '.join(CACHED_WHEN)}, got {self.cached_when!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {self.num_gpu_blocks}")

    @property
    def resolved_num_gpu_blocks(self) -> int:
        """The KV capacity in blocks after applying the hardware default."""
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        return max(1, round(DEFAULT_NUM_GPU_BLOCKS * self.hardware.kv_capacity))


class RequestRejected(ValueError):
    """A request that the engine can never serve (empty, too long, larger than the cache)."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token.

    Attributes:
        req_id: The request.
        token_id: The generated id.
        index: Position in the output, 0 for the first token.
        time_s: Model time at which the token was produced (end of its step).
        finished: Whether this is the request's last token.
    """

    req_id: str
    token_id: int
    index: int
    time_s: float
    finished: bool


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """Summary of a request that left the engine.

    Attributes:
        req_id: The request.
        finish_reason: ``"length"`` (generated ``max_tokens``) or ``"abort"``.
        num_prompt_tokens: Prompt length.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        num_output_tokens: Tokens generated.
        arrival_s: Model time it was added.
        scheduled_s: Model time it was admitted, ``None`` if it never was.
        first_token_s: Model time of its first token, ``None`` if none.
        finish_s: Model time it left.
    """

    req_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    arrival_s: float
    scheduled_s: float | None
    first_token_s: float | None
    finish_s: float

    @property
    def ttft_s(self) -> float | None:
        """Time to first token in model seconds, ``None`` if no token was produced."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        """End-to-end latency in model seconds."""
        return self.finish_s - self.arrival_s


@dataclass(slots=True)
class StepResult:
    """What one engine step did.

    Attributes:
        start_s: Model time the step started.
        duration_s: Model seconds it took; 0.0 when there was nothing to do.
        num_prefill_tokens: Prompt tokens computed.
        num_decode_seqs: Sequences that decoded one token.
        tokens: Tokens produced, available at ``end_s``.
        finished: Requests that finished at ``end_s``.
    """

    start_s: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    tokens: list[TokenEvent]
    finished: list[FinishedRequest]

    @property
    def end_s(self) -> float:
        """Model time the step's tokens become available."""
        return self.start_s + self.duration_s


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters of one engine (the sources of vLLM's counters).

    Attributes:
        prompt_tokens: Prompt tokens of requests whose prefill completed (cached ones included).
        generation_tokens: Output tokens generated.
        finished_by_reason: Finished requests per finish reason.
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    transferred_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Request:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    block_keys: list[int]
    lora_name: str | None
    arrival_s: float
    output_seed: int
    num_blocks_total: int
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # Leading entries of block_keys on which this request holds a cache reference.
    num_held_keys: int = 0
    num_private_blocks: int = 0
    num_output_tokens: int = 0
    scheduled_s: float | None = None
    first_token_s: float | None = None
    cache_salt: str | None = None
    # Digest of the last full block hashed (the chain continues from it as decode fills blocks).
    last_digest: bytes | None = None
    # Leading prompt tokens computed elsewhere and transferred in (P/D).
    num_transferred_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)


class _RequestListener:
    """Forwards cache notifications, adding the storing request's LoRA name and cache salt.

    A listener with ``on_stored_for_request(blocks, lora_name, cache_salt)`` (the KV-event
    publisher) gets them; any other listener gets plain ``on_stored(blocks)``.
    """

    __slots__ = ("cache_salt", "listener", "lora_name")

    def __init__(self, listener: CacheEventListener) -> None:
        self.listener = listener
        self.lora_name: str | None = None
        self.cache_salt: str | None = None

    def on_stored(self, blocks: Sequence[StoredBlock]) -> None:
        with_request = getattr(self.listener, "on_stored_for_request", None)
        if with_request is not None:
            with_request(blocks, self.lora_name, self.cache_salt)
        else:
            self.listener.on_stored(blocks)

    def on_removed(self, block_hashes: Sequence[int]) -> None:
        self.listener.on_removed(block_hashes)

    def on_cleared(self) -> None:
        self.listener.on_cleared()


_EMPTY_TOKENS: list[TokenEvent] = []
_EMPTY_FINISHED: list[FinishedRequest] = []
_OUTPUT_SPAN = VOCAB_SIZE - RESERVED_IDS


class SimEngine:
    """A continuous-batching engine with a prefix cache and a timing model.

    See the module docstring for the model. All times are model seconds supplied by the
    caller; the engine never reads a clock.
    """

    def __init__(self, config: EngineConfig, listener: CacheEventListener | None = None) -> None:
        """Creates an idle engine with an empty cache.

        Args:
            config: Static configuration.
            listener: Optional receiver of the cache's stored/removed/cleared notifications.
        """
        self.config = config
        self.hasher = BlockHasher(config.block_size, config.hash_seed)
        self._none_hash = _block_digest(config.hash_seed)
        self._listener = _RequestListener(listener) if listener is not None else None
        self.cache = PrefixCache(config.resolved_num_gpu_blocks, self._listener)
        self.stats = EngineStats()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}

    # ----------------------------------------------------------------------------- state

    @property
    def num_waiting(self) -> int:
        """Requests added but not admitted yet."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished."""
        return len(self._running)

    @property
    def has_work(self) -> bool:
        """Whether :meth:`step` would do anything."""
        return bool(self._waiting or self._running)

    def lora_names(self) -> tuple[set[str], set[str]]:
        """Returns the LoRA adapters of (running, waiting) requests."""
        running = {r.lora_name for r in self._running if r.lora_name}
        waiting = {r.lora_name for r in self._waiting if r.lora_name}
        return running, waiting

    def prefill_duration_s(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float:
        """Model seconds an otherwise idle engine needs from a request's arrival to its first token.

        Args:
            num_prompt_tokens: Prompt length.
            num_cached_tokens: Leading prompt tokens served from the cache.
        """
        config = self.config
        return config.timing.isolated_prefill_s(
            config.hardware, num_prompt_tokens, num_cached_tokens, config.max_num_batched_tokens
        )

    # -------------------------------------------------------------------------- requests

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        now_s: float,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        num_transferred_tokens: int = 0,
    ) -> None:
        """Queues a request.

        Args:
            req_id: Unique id among requests in the engine.
            prompt_token_ids: The prompt (at least one token).
            max_tokens: Tokens to generate (at least one).
            now_s: Model time of arrival.
            cache_salt: Optional salt isolating the request's cached blocks.
            lora_name: Optional LoRA adapter (part of the block hashes, as in vLLM).
            num_transferred_tokens: Leading prompt tokens whose KV arrived from a prefill
                endpoint (P/D disaggregation): at admission they are stored as computed, with
                no prefill cost, beyond what the local cache already holds.

        Raises:
            RequestRejected: If the request can never be served.
            ValueError: If ``req_id`` is already in the engine.
        """
        if req_id in self._by_id:
            raise ValueError(f"duplicate request id {req_id!r}")
        config = self.config
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty")
        if max_tokens < 1:
            raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}")
        if num_prompt_tokens + max_tokens > config.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {config.max_model_len} tokens; "
                f"the request has {num_prompt_tokens} prompt tokens and asks for "
                f"{max_tokens} more"
            )
        # KV exists for every token but the last generated one.
        num_kv_tokens = num_prompt_tokens + max_tokens - 1
        num_blocks_total = -(-num_kv_tokens // config.block_size)
        if num_blocks_total > self.cache.num_gpu_blocks:
            raise RequestRejected(
                f"the request needs {num_blocks_total} KV blocks; the cache holds "
                f"{self.cache.num_gpu_blocks}"
            )
        prompt = list(prompt_token_ids)
        keys, last_digest = self._hash_blocks(prompt, 0, None, lora_name, cache_salt)
        output_seed = xxhash.xxh32_intdigest(
            array("I", prompt).tobytes(), seed=config.seed & 0xFFFFFFFF
        )
        request = _Request(
            req_id=req_id,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            block_keys=keys,
            lora_name=lora_name,
            arrival_s=now_s,
            output_seed=output_seed,
            num_blocks_total=num_blocks_total,
            cache_salt=cache_salt,
            last_digest=last_digest,
            num_transferred_tokens=max(0, num_transferred_tokens),
        )
        self._by_id[req_id] = request
        self._waiting.append(request)

    def abort_request(self, req_id: str, now_s: float) -> FinishedRequest | None:
        """Removes a request (e.g. its client went away) and frees its blocks.

        Args:
            req_id: The request.
            now_s: Model time of the abort.

        Returns:
            Its summary with finish reason ``"abort"``, or ``None`` if it is not in the engine.
        """
        request = self._by_id.pop(req_id, None)
        if request is None:
            return None
        if request.scheduled_s is None:
            self._waiting.remove(request)
        else:
            self._running.remove(request)
            self._release(request)
        return self._finish(request, "abort", now_s)

    def reset_prefix_cache(self) -> int:
        """Drops every cached block no running request holds; returns how many."""
        return self.cache.reset()

    # ------------------------------------------------------------------------------ step

    def step(self, now_s: float) -> StepResult:
        """Schedules and runs one step starting at ``now_s``.

        The returned tokens and finished requests take effect at ``result.end_s``; the caller
        should deliver them once its clock reaches that time and call ``step`` again then.

        Args:
            now_s: Model time the step starts.

        Returns:
            The step's duration and outcome.
        """
        config = self.config
        budget_tokens = config.max_num_batched_tokens
        at_schedule = config.cached_when == "scheduled"
        # (request, prompt tokens computed in this step; 0 means a decode)
        scheduled: list[tuple[_Request, int]] = []
        num_prefill_tokens = 0
        num_decode_seqs = 0

        for request in self._running:
            if budget_tokens <= 0:
                break
            remaining = len(request.prompt_token_ids) - request.num_computed_tokens
            if remaining > 0:
                chunk = min(remaining, budget_tokens)
                scheduled.append((request, chunk))
                if at_schedule:
                    self._store_prompt_blocks(request, request.num_computed_tokens + chunk)
                num_prefill_tokens += chunk
                budget_tokens -= chunk
            else:
                scheduled.append((request, 0))
                num_decode_seqs += 1
                budget_tokens -= 1

        while self._waiting and budget_tokens > 0 and len(self._running) < config.max_num_seqs:
            request = self._waiting[0]
            if not self._admit(request, now_s):
                # FIFO: a request that does not fit blocks the ones behind it, as in vLLM.
                break
            self._waiting.popleft()
            self._running.append(request)
            chunk = min(len(request.prompt_token_ids) - request.num_computed_tokens, budget_tokens)
            scheduled.append((request, chunk))
            if at_schedule and chunk > 0:
                self._store_prompt_blocks(request, request.num_computed_tokens + chunk)
            num_prefill_tokens += chunk
            budget_tokens -= chunk

        if not scheduled:
            return StepResult(now_s, 0.0, 0, 0, _EMPTY_TOKENS, _EMPTY_FINISHED)

        # Each chunk is priced at its context position: the tokens computed before it.
        prefill_chunks: list[tuple[int, int]] = []
        decode_context_tokens = 0
        for request, chunk in scheduled:
            if chunk > 0:
                prefill_chunks.append((chunk, request.num_computed_tokens))
            else:
                decode_context_tokens += len(request.prompt_token_ids) + request.num_output_tokens
        duration_s = config.timing.step_duration_s(
            config.hardware, len(scheduled), prefill_chunks, decode_context_tokens
        )
        end_s = now_s + duration_s
        tokens: list[TokenEvent] = []
        finished: list[FinishedRequest] = []
        for request, chunk in scheduled:
            if chunk > 0:
                self._complete_prefill_chunk(request, chunk)
                if request.num_computed_tokens < len(request.prompt_token_ids):
                    continue
                request.first_token_s = end_s
                self.stats.prompt_tokens += len(request.prompt_token_ids)
            index = request.num_output_tokens
            request.num_output_tokens = index + 1
            self.stats.generation_tokens += 1
            done = request.num_output_tokens >= request.max_tokens
            token_id = self._output_token(request, index)
            if index > 0:
                # This step computed the KV of the previous output token.
                self._store_filled_blocks(request, len(request.prompt_token_ids) + index)
            request.output_token_ids.append(token_id)
            tokens.append(TokenEvent(request.req_id, token_id, index, end_s, done))
            if done:
                finished.append(self._finish(request, "length", end_s))

        if finished:
            done_ids = {summary.req_id for summary in finished}
            self._running = [r for r in self._running if r.req_id not in done_ids]
            # In finishing order, not set order: eviction order must not depend on the hash seed.
            for summary in finished:
                self._release(self._by_id.pop(summary.req_id))
        return StepResult(now_s, duration_s, num_prefill_tokens, num_decode_seqs, tokens, finished)

    # ---------------------------------------------------------------------------- helpers

    def _admit(self, request: _Request, now_s: float) -> bool:
        cache = self.cache
        block_size = self.config.block_size
        num_prompt_tokens = len(request.prompt_token_ids)
        # The last prompt token is always recomputed: its logits give the first output token.
        max_hit_blocks = (num_prompt_tokens - 1) // block_size
        num_hit_blocks = min(cache.lookup(request.block_keys), max_hit_blocks)
        hit_keys = request.block_keys[:num_hit_blocks]
        num_new_blocks = request.num_blocks_total - num_hit_blocks
        if not cache.allocate(hit_keys, num_new_blocks):
            return False
        num_hit_tokens = num_hit_blocks * block_size
        cache.record_query(num_prompt_tokens, num_hit_tokens)
        request.num_held_keys = num_hit_blocks
        request.num_private_blocks = num_new_blocks
        request.num_computed_tokens = num_hit_tokens
        request.num_cached_tokens = num_hit_tokens
        request.scheduled_s = now_s
        # KV transferred from a prefill endpoint: computed already, stored like a prefill.
        num_transferred = min(request.num_transferred_tokens, num_prompt_tokens - 1)
        if num_transferred > num_hit_tokens:
            self._complete_prefill_chunk(request, num_transferred - num_hit_tokens)
            self.stats.transferred_tokens += num_transferred - num_hit_tokens
        return True

    def num_cached_prompt_tokens(
        self,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> int:
        """Leading prompt tokens the cache holds now (what a transfer need not send)."""
        keys, _ = self._hash_blocks(list(prompt_token_ids), 0, None, lora_name, cache_salt)
        return self.cache.lookup(keys) * self.config.block_size

    def _complete_prefill_chunk(self, request: _Request, chunk: int) -> None:
        request.num_computed_tokens += chunk
        self._store_prompt_blocks(request, request.num_computed_tokens)

    def _store_prompt_blocks(self, request: _Request, num_tokens: int) -> None:
        """Cache the request's full prompt blocks within its first ``num_tokens`` tokens."""
        keys = request.block_keys
        num_full = min(num_tokens // self.config.block_size, len(keys))
        first = request.num_held_keys
        if num_full <= first:
            return
        block_size = self.config.block_size
        prompt = request.prompt_token_ids
        blocks = [
            StoredBlock(
                keys[index],
                keys[index - 1] if index > 0 else None,
                tuple(prompt[index * block_size : (index + 1) * block_size]),
            )
            for index in range(first, num_full)
        ]
        self._store(request, blocks)
        request.num_held_keys = num_full
        request.num_private_blocks -= len(blocks)

    def _store_filled_blocks(self, request: _Request, num_kv_tokens: int) -> None:
        """Cache the blocks decode has filled: full blocks of prompt tail plus output."""
        block_size = self.config.block_size
        keys = request.block_keys
        num_full = num_kv_tokens // block_size
        first = len(keys)
        if num_full <= first or request.num_held_keys < first:
            return  # nothing new, or the prompt's own blocks are not all cached yet
        prompt = request.prompt_token_ids
        start = first * block_size
        outputs = request.output_token_ids
        sequence = (
            prompt[start:] + outputs[max(0, start - len(prompt)) : num_kv_tokens - len(prompt)]
        )
        new_keys, request.last_digest = self._hash_blocks(
            sequence, first, request.last_digest, request.lora_name, request.cache_salt
        )
        blocks = [
            StoredBlock(
                key,
                keys[-1] if i == 0 and keys else (new_keys[i - 1] if i else None),
                tuple(sequence[i * block_size : (i + 1) * block_size]),
            )
            for i, key in enumerate(new_keys)
        ]
        keys.extend(new_keys)
        self._store(request, blocks)
        request.num_held_keys = len(keys)
        request.num_private_blocks -= len(blocks)

    def _store(self, request: _Request, blocks: list[StoredBlock]) -> None:
        listener = self._listener
        if listener is not None:
            listener.lora_name = request.lora_name
            listener.cache_salt = request.cache_salt
        self.cache.store(blocks)

    def _hash_blocks(
        self,
        token_ids: Sequence[int],
        first_index: int,
        parent: bytes | None,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> tuple[list[int], bytes | None]:
        """Keys of the full blocks of ``token_ids``, numbered from ``first_index``.

        The same chain as :meth:`BlockHasher.block_keys` (vLLM's ``xxhash`` algorithm), kept
        resumable: returns the last digest, from which the next block continues.
        """
        block_size = self.config.block_size
        lora_keys: tuple[str, ...] = (lora_name,) if lora_name else ()
        rest_extra = lora_keys or None
        first_extra = (*lora_keys, cache_salt) if cache_salt else rest_extra
        digest = parent if parent is not None else self._none_hash
        keys: list[int] = []
        for i in range(len(token_ids) // block_size):
            index = first_index + i
            block = tuple(token_ids[i * block_size : (i + 1) * block_size])
            digest = _block_digest((digest, block, first_extra if index == 0 else rest_extra))
            keys.append(int.from_bytes(digest[-8:], "big"))
        return keys, (digest if keys else parent)

    def _release(self, request: _Request) -> None:
        self.cache.release(request.block_keys[: request.num_held_keys], request.num_private_blocks)
        request.num_held_keys = 0
        request.num_private_blocks = 0

    def _finish(self, request: _Request, reason: str, now_s: float) -> FinishedRequest:
        by_reason = self.stats.finished_by_reason
        by_reason[reason] = by_reason.get(reason, 0) + 1
        return FinishedRequest(
            req_id=request.req_id,
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            arrival_s=request.arrival_s,
            scheduled_s=request.scheduled_s,
            first_token_s=request.first_token_s,
            finish_s=now_s,
        )

    @staticmethod
    def _output_token(request: _Request, index: int) -> int:
        mixed = xxhash.xxh32_intdigest(index.to_bytes(4, "little"), seed=request.output_seed)
        return RESERVED_IDS + mixed % _OUTPUT_SPAN
