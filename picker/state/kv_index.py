"""Precise KV block index: which endpoint really holds which block, from its own KV events.

Two parts, shared by the in-process index here and the Redis-backed one
(:mod:`kv_picker.state.redis_index`):

- :class:`BlockLedger`: per endpoint, the engine's block hash → our block key, in LRU order.
  It resolves ``BlockStored.parent_block_hash`` and ``BlockRemoved`` hashes (which are engine
  hashes) to keys, and bounds what is held: per endpoint by the endpoint's KV capacity
  (``num_gpu_blocks`` from ``vllm:cache_config_info`` when scraped, else a configured default)
  and in total, evicting least recently stored entries first.
- :class:`EventKeys`: turns a ``BlockStored`` into keys (our dual keys computed from the
  event's ``token_ids``, or vLLM's own hashes in strict mode; see :mod:`kv_picker.state.block_keys`)
  and decides what is not indexed (other media than GPU, non-full-attention groups, multimodal
  blocks, blocks whose parent is unknown).

The in-process :class:`KVBlockIndex` adds the lookup side::

    holders:  key -> int bitset of endpoint ids           (bit e set: endpoint e holds the block)
    ledger:   [endpoint id] OrderedDict engine_hash -> key | stamp << 64   (oldest first)
    heap:     (stamp of an endpoint's oldest entry, endpoint id)   for the total bound

A lookup is the picker's one leading-run walk over ``holders``
(:func:`kv_picker.state.prefix_runs.leading_runs`): O(blocks + endpoints) with no allocation
beyond int operations. Updates happen in place on the event loop thread, so the synchronous
scoring path never sees a half-applied event.

Packing the stamp into the ledger value keeps one int object per entry; the total bound uses a
lazy heap of each endpoint's oldest stamp (heads only get newer, so a stale entry is corrected
when popped), which makes global LRU eviction O(log endpoints) per entry.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kv_picker.state.block_keys import VllmBlockHasher
from kv_picker.state.hashing import chain_root, token_keys
from kv_picker.state.prefix_runs import leading_runs

log = logging.getLogger(__name__)

KEY_MODES = ("dual", "strict")
_U64_MASK = (1 << 64) - 1
_STAMP_SHIFT = 64

# Why a stored event (or part of it) was not indexed; label values of the dropped-events metric.
DROP_UNKNOWN_PARENT = "unknown_parent"
DROP_BLOCK_SIZE = "block_size"
DROP_TOKEN_COUNT = "token_count"
DROP_EXTRA_KEYS = "extra_keys"
DROP_MEDIUM = "medium"
DROP_ATTENTION = "attention_kind"
DROP_LORA_ID = "lora_id_only"
DROP_BAD_TOKENS = "bad_token_ids"

_INDEXED_MEDIA = (None, "GPU", "gpu")
_INDEXED_KINDS = (None, "full_attention")


class BlockLedger:
    """Engine hash → key per endpoint, LRU-bounded per endpoint and in total.

    Args:
        default_capacity_blocks: per-endpoint bound when the endpoint's capacity is unknown.
        max_blocks: bound on (endpoint, block) entries over all endpoints.
        capacity_source: per endpoint id, its KV capacity in blocks (0 = unknown); read, never
            written (the endpoint store's ``num_gpu_blocks``, filled by the scraper).
        on_evict: called with (endpoint id, key) for every entry dropped to respect a bound.
    """

    __slots__ = (
        "_heap",
        "_in_heap",
        "_maps",
        "_on_evict",
        "_stamp",
        "capacity_source",
        "default_capacity_blocks",
        "evicted_blocks",
        "max_blocks",
        "size",
    )

    def __init__(
        self,
        default_capacity_blocks: int,
        max_blocks: int,
        capacity_source: Sequence[int] | None,
        on_evict: Callable[[int, int], None],
    ) -> None:
        if default_capacity_blocks <= 0 or max_blocks <= 0:
            raise ValueError("capacities must be positive")
        self.default_capacity_blocks = default_capacity_blocks
        self.max_blocks = max_blocks
        self.capacity_source = capacity_source
        self._on_evict = on_evict
        self._maps: list[OrderedDict[int, int] | None] = []
        self._heap: list[tuple[int, int]] = []
        self._in_heap: list[bool] = []
        self._stamp = 0
        self.size = 0
        self.evicted_blocks = 0

    def _map(self, endpoint_id: int) -> OrderedDict[int, int]:
        maps = self._maps
        if endpoint_id >= len(maps):
            grow = endpoint_id + 1 - len(maps)
            maps.extend([None] * grow)
            self._in_heap.extend([False] * grow)
        entries = maps[endpoint_id]
        if entries is None:
            entries = maps[endpoint_id] = OrderedDict()
        return entries

    def capacity(self, endpoint_id: int) -> int:
        """The endpoint's bound in blocks."""
        source = self.capacity_source
        if source is not None and endpoint_id < len(source) and source[endpoint_id] > 0:
            return source[endpoint_id]
        return self.default_capacity_blocks

    def endpoint_ids(self) -> list[int]:
        """Ids of endpoints holding at least one block."""
        return [e for e, entries in enumerate(self._maps) if entries]

    def count(self, endpoint_id: int) -> int:
        """Blocks held for an endpoint."""
        maps = self._maps
        entries = maps[endpoint_id] if endpoint_id < len(maps) else None
        return len(entries) if entries else 0

    def get(self, endpoint_id: int, engine_hash: int) -> int | None:
        """The key an engine hash maps to (recency unchanged), or None."""
        maps = self._maps
        entries = maps[endpoint_id] if endpoint_id < len(maps) else None
        if not entries:
            return None
        value = entries.get(engine_hash)
        return None if value is None else value & _U64_MASK

    def add(self, endpoint_id: int, engine_hash: int, key: int) -> int | None:
        """Record (or refresh) an entry as the endpoint's most recent.

        Returns:
            The key this engine hash mapped to before when it differs from ``key`` (the caller
            drops that key's holder), else None.
        """
        entries = self._map(endpoint_id)
        stamp = self._stamp = self._stamp + 1
        old = entries.get(engine_hash)
        entries[engine_hash] = key | stamp << _STAMP_SHIFT
        if old is None:
            self.size += 1
            if not self._in_heap[endpoint_id]:
                self._in_heap[endpoint_id] = True
                heapq.heappush(self._heap, (stamp, endpoint_id))
            return None
        entries.move_to_end(engine_hash)
        old_key = old & _U64_MASK
        return old_key if old_key != key else None

    def pop(self, endpoint_id: int, engine_hash: int) -> int | None:
        """Remove an entry; returns its key, or None when the hash is not held."""
        maps = self._maps
        entries = maps[endpoint_id] if endpoint_id < len(maps) else None
        if not entries:
            return None
        value = entries.pop(engine_hash, None)
        if value is None:
            return None
        self.size -= 1
        return value & _U64_MASK

    def clear(self, endpoint_id: int, forget: bool = False) -> list[int]:
        """Drop every entry of an endpoint; returns the keys it held.

        Args:
            forget: also release the endpoint's slot (it left the pool).
        """
        maps = self._maps
        entries = maps[endpoint_id] if endpoint_id < len(maps) else None
        if entries is None:
            return []
        keys = [value & _U64_MASK for value in entries.values()]
        self.size -= len(entries)
        if forget:
            maps[endpoint_id] = None
        else:
            entries.clear()
        return keys

    def keys(self, endpoint_id: int) -> Iterator[int]:
        """Keys held for an endpoint, oldest first."""
        maps = self._maps
        entries = maps[endpoint_id] if endpoint_id < len(maps) else None
        if entries:
            for value in entries.values():
                yield value & _U64_MASK

    def trim(self, endpoint_id: int) -> None:
        """Evict until the endpoint and the total are within their bounds."""
        maps = self._maps
        entries = maps[endpoint_id] if endpoint_id < len(maps) else None
        on_evict = self._on_evict
        if entries:
            overflow = len(entries) - self.capacity(endpoint_id)
            if overflow > 0:
                self.size -= overflow
                self.evicted_blocks += overflow
                for _ in range(overflow):
                    _, value = entries.popitem(last=False)
                    on_evict(endpoint_id, value & _U64_MASK)
        heap = self._heap
        in_heap = self._in_heap
        while self.size > self.max_blocks and heap:
            stamp, victim = heapq.heappop(heap)
            victim_entries = maps[victim] if victim < len(maps) else None
            if not victim_entries:
                in_heap[victim] = False
                continue
            _, head = next(iter(victim_entries.items()))
            head_stamp = head >> _STAMP_SHIFT
            if head_stamp != stamp:  # stale: the oldest entry changed since the push
                heapq.heappush(heap, (head_stamp, victim))
                continue
            victim_entries.popitem(last=False)
            self.size -= 1
            self.evicted_blocks += 1
            on_evict(victim, head & _U64_MASK)
            if victim_entries:
                _, head = next(iter(victim_entries.items()))
                heapq.heappush(heap, (head >> _STAMP_SHIFT, victim))
            else:
                in_heap[victim] = False


class EventKeys:
    """From a ``BlockStored`` event to the keys the index records.

    Args:
        block_size_tokens: tokens per block; must equal vLLM's ``--block-size``.
        key_mode: ``dual`` (our keys from ``token_ids``) or ``strict`` (vLLM's hashes).
        hash_algo: strict mode's ``--prefix-caching-hash-algo``.
        hash_seed: strict mode's ``PYTHONHASHSEED``.
    """

    __slots__ = ("block_size_tokens", "key_mode", "strict_hasher")

    def __init__(
        self,
        block_size_tokens: int = 16,
        key_mode: str = "dual",
        hash_algo: str = "sha256",
        hash_seed: str = "0",
    ) -> None:
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be positive, got {block_size_tokens}")
        if key_mode not in KEY_MODES:
            raise ValueError(f"key mode must be dual or strict, got {key_mode!r}")
        self.block_size_tokens = block_size_tokens
        self.key_mode = key_mode
        self.strict_hasher = (
            VllmBlockHasher(hash_algo, hash_seed, block_size_tokens)
            if key_mode == "strict"
            else None
        )

    def request_keys(
        self,
        token_ids: Sequence[int],
        model: str,
        lora_name: str | None,
        cache_salt: str | None,
        max_blocks: int = 0,
    ) -> list[int]:
        """A request's block keys, in the same key space as the stored events'."""
        if self.strict_hasher is not None:
            return self.strict_hasher.block_keys(token_ids, lora_name, cache_salt, max_blocks)
        root = chain_root(model, lora_name, cache_salt)
        return token_keys(token_ids, root, self.block_size_tokens, max_blocks)

    def stored_keys(
        self,
        ledger: BlockLedger,
        endpoint_id: int,
        engine_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        model: str,
        lora_name: str | None,
        extra_keys: Sequence[Any] | None,
        medium: str | None = None,
        kind: str | None = None,
        lora_id: int | None = None,
    ) -> tuple[list[int], str]:
        """Keys for the leading blocks of a stored event that can be indexed.

        Returns:
            (keys aligned with ``engine_hashes[:len(keys)]``, reason the rest was dropped or "").
        """
        if medium not in _INDEXED_MEDIA:
            return [], DROP_MEDIUM
        if kind not in _INDEXED_KINDS:
            return [], DROP_ATTENTION
        if self.strict_hasher is not None:
            # vLLM's hashes are the keys: no tokens needed, nothing to resolve.
            return list(engine_hashes), ""
        if lora_id is not None and not lora_name:
            return [], DROP_LORA_ID  # an adapter we cannot name would look like the base model
        size = self.block_size_tokens
        if block_size != size:
            return [], DROP_BLOCK_SIZE
        num_blocks = len(engine_hashes)
        if len(token_ids) != num_blocks * size:
            return [], DROP_TOKEN_COUNT
        salt: str | None = None
        reason = ""
        if extra_keys:
            usable = num_blocks
            for i in range(min(len(extra_keys), num_blocks)):
                extra = extra_keys[i]
                if extra is None:
                    continue
                items = list(extra) if isinstance(extra, list | tuple) else [extra]
                if lora_name and items and items[0] == lora_name:
                    del items[0]
                if not items:
                    continue
                if i == 0 and parent_hash is None and len(items) == 1 and isinstance(items[0], str):
                    salt = items[0]  # vLLM puts cache_salt in block 0's extra keys only
                    continue
                # Multimodal or embedding keys: a text request can never produce this block.
                usable = i
                reason = DROP_EXTRA_KEYS
                break
            num_blocks = usable
            if not num_blocks:
                return [], reason
        if parent_hash is None:
            parent = chain_root(model, lora_name, salt)
        else:
            resolved = ledger.get(endpoint_id, parent_hash)
            if resolved is None:
                return [], DROP_UNKNOWN_PARENT
            parent = resolved
        try:
            keys = token_keys(token_ids[: num_blocks * size], parent, size)
        except (OverflowError, TypeError):
            return [], DROP_BAD_TOKENS
        return keys, reason


class KVBlockIndex:
    """The in-process precise index (see the module docstring).

    Args:
        event_keys: key computation shared with the scorer.
        default_capacity_blocks: per-endpoint bound when its KV capacity is not scraped.
        max_blocks: bound on (endpoint, block) entries in total.
        capacity_source: per endpoint id, its ``num_gpu_blocks`` (0 = unknown).
        on_drop: called with (reason, blocks) when a stored event is not (fully) indexed.
    """

    backend = "memory"

    def __init__(
        self,
        event_keys: EventKeys,
        default_capacity_blocks: int = 1_000_000,
        max_blocks: int = 10_000_000,
        capacity_source: Sequence[int] | None = None,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        self.event_keys = event_keys
        self.block_size_tokens = event_keys.block_size_tokens
        self._holders: dict[int, int] = {}
        self.ledger = BlockLedger(
            default_capacity_blocks, max_blocks, capacity_source, self._drop_holder
        )
        self._on_drop = on_drop
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.cleared_endpoints = 0

    # -- sizes ------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Distinct keys held by at least one endpoint."""
        return len(self._holders)

    def num_blocks(self) -> int:
        """(endpoint, block) entries, the figure the bounds apply to."""
        return self.ledger.size

    def holders(self, key: int) -> int:
        """Bitset of endpoint ids holding ``key``."""
        return self._holders.get(key, 0)

    # -- events -----------------------------------------------------------------------------

    def apply_stored(
        self,
        endpoint_id: int,
        engine_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        model: str,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        medium: str | None = None,
        kind: str | None = None,
        lora_id: int | None = None,
    ) -> int:
        """Apply a ``BlockStored``; returns the number of blocks indexed."""
        keys, reason = self.event_keys.stored_keys(
            self.ledger,
            endpoint_id,
            engine_hashes,
            parent_hash,
            token_ids,
            block_size,
            model,
            lora_name,
            extra_keys,
            medium,
            kind,
            lora_id,
        )
        if reason and self._on_drop is not None:
            self._on_drop(reason, len(engine_hashes) - len(keys))
        if not keys:
            return 0
        bit = 1 << endpoint_id
        holders = self._holders
        ledger = self.ledger
        for engine_hash, key in zip(engine_hashes, keys, strict=False):
            replaced = ledger.add(endpoint_id, engine_hash, key)
            if replaced is not None:
                self._drop_holder(endpoint_id, replaced)
            holders[key] = holders.get(key, 0) | bit
        ledger.trim(endpoint_id)
        self.stored_blocks += len(keys)
        return len(keys)

    def apply_removed(self, endpoint_id: int, engine_hashes: Sequence[int]) -> int:
        """Apply a ``BlockRemoved``; returns the number of blocks that were indexed."""
        removed = 0
        ledger = self.ledger
        for engine_hash in engine_hashes:
            key = ledger.pop(endpoint_id, engine_hash)
            if key is not None:
                self._drop_holder(endpoint_id, key)
                removed += 1
        self.removed_blocks += removed
        return removed

    def clear_endpoint(self, endpoint_id: int) -> int:
        """Apply ``AllBlocksCleared`` (or a lost event stream); returns blocks dropped."""
        keys = self.ledger.clear(endpoint_id)
        for key in keys:
            self._drop_holder(endpoint_id, key)
        self.cleared_endpoints += 1
        return len(keys)

    def remove_endpoint(self, endpoint_id: int) -> None:
        """The endpoint left the pool: forget it (its id may be reused)."""
        for key in self.ledger.clear(endpoint_id, forget=True):
            self._drop_holder(endpoint_id, key)

    def _drop_holder(self, endpoint_id: int, key: int) -> None:
        holders = self._holders
        remaining = holders.get(key, 0) & ~(1 << endpoint_id)
        if remaining:
            holders[key] = remaining
        else:
            holders.pop(key, None)

    # -- lookup -----------------------------------------------------------------------------

    def runs(
        self,
        keys: Sequence[int],
        candidate_mask: int,
        runs_out: list[int],
        speculative: SpeculativeHolders | None = None,
    ) -> int:
        """Leading-run length of every candidate.

        Args:
            keys: the request's block keys, in order.
            candidate_mask: bitset of candidate endpoint ids.
            runs_out: indexed by endpoint id: receives each candidate's run (0 when it lacks
                block 0); other entries are left alone.
            speculative: blocks endpoints were just sent, counted as held.

        Returns:
            The longest run of any candidate.
        """
        overlay = speculative.maps() if speculative is not None else None
        return leading_runs(keys, candidate_mask, runs_out, self._holders, overlay)


class SpeculativeHolders:
    """Blocks endpoints were just sent, held until their own KV events can say so.

    Between a pick and the endpoint's ``BlockStored`` (its prefill time) the index cannot know
    the endpoint is computing those blocks, and requests for the same prefix arriving meanwhile
    would spread over endpoints. A pick records the request's keys here for ``ttl_s``; entries
    live in two generations of ``ttl_s / 2`` rotated by the clock, so expiry costs nothing per
    entry (an entry lives between ``ttl_s / 2`` and ``ttl_s``).

    Args:
        ttl_s: how long a pick counts as holding its blocks.
        clock: monotonic clock in seconds.
    """

    __slots__ = ("_clock", "_newer", "_older", "_rotate_at", "half_ttl_s")

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.half_ttl_s = ttl_s / 2
        self._clock = clock
        self._newer: dict[int, int] = {}
        self._older: dict[int, int] = {}
        self._rotate_at = clock() + self.half_ttl_s

    def maps(self) -> tuple[dict[int, int], dict[int, int]]:
        """(newer, older) key -> endpoint bitset, after expiring what is due."""
        now = self._clock()
        if now >= self._rotate_at:
            if now >= self._rotate_at + self.half_ttl_s:
                self._older = {}  # both generations are past their time
                self._newer = {}
            else:
                self._older = self._newer
                self._newer = {}
            self._rotate_at = now + self.half_ttl_s
        return self._newer, self._older

    def record(self, endpoint_id: int, keys: Sequence[int]) -> None:
        newer, _ = self.maps()
        bit = 1 << endpoint_id
        for key in keys:
            newer[key] = newer.get(key, 0) | bit

    def forget_endpoint(self, endpoint_id: int) -> None:
        """The endpoint left, or restarted: nothing it was sent counts any more."""
        keep = ~(1 << endpoint_id)
        for generation in (self._newer, self._older):
            for key in [k for k, v in generation.items() if v & ~keep]:
                remaining = generation[key] & keep
                if remaining:
                    generation[key] = remaining
                else:
                    del generation[key]
