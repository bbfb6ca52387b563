"""The ledger of the precise index: per endpoint, the engine's block hash → our block key.

Why it exists: KV events name blocks by the engine's hash, while lookups use our keys (dual keys;
see :mod:`kv_picker.state.block_keys`). ``BlockStored.parent_block_hash`` and ``BlockRemoved``
carry engine hashes only, so each backend (in-process and Redis) keeps this map to resolve them,
and uses it to bound what is held: per endpoint by the endpoint's KV capacity
(``num_gpu_blocks`` from ``vllm:cache_config_info`` when scraped, else a configured default) and
in total, evicting least recently stored entries first::

    maps:  [endpoint id] OrderedDict engine_hash -> key | stamp << 64   (oldest first)
    heap:  (stamp of an endpoint's oldest entry, endpoint id)           for the total bound

Packing the stamp into the value keeps one int object per entry; the total bound uses a lazy
heap of each endpoint's oldest stamp (heads only get newer, so a stale entry is corrected when
popped), which makes global LRU eviction O(log endpoints) per entry. Evictions are reported to
the backend (``on_evict``), which drops the key's holder.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

_U64_MASK = (1 << 64) - 1
_STAMP_SHIFT = 64


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
