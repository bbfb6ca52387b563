"""The ledger of the precise index: per (endpoint, tier, group), the engine's block hash → our key.

Why it exists: KV events name blocks by the engine's hash, while lookups use our keys (dual keys;
see :mod:`kv_picker.state.block_keys`). ``BlockStored.parent_block_hash`` and ``BlockRemoved``
carry engine hashes only, so each backend (in-process and Redis) keeps this map to resolve them,
and uses it to bound what is held: per endpoint and tier (the GPU tier by the endpoint's KV
capacity, ``num_gpu_blocks`` from ``vllm:cache_config_info`` when scraped, other tiers and
unscraped endpoints by a configured default) and in total, evicting least recently stored
entries first::

    lanes:  [endpoint id * MAX_TIERS + tier]  OrderedDict                       (oldest first)
                engine_hash | group << 64  ->  key | count << 64 | stamp << 80
    heap:   (stamp of a lane's oldest entry, lane)                              for the total bound
    groups: [lane] the KV-cache groups seen in it; kinds: endpoint -> group -> full attention?

An entry belongs to one (endpoint, tier, group): a removal names all three (``medium`` and
``group_idx``), so evicting a block from the CPU tier, or from another KV-cache group, leaves the
GPU full-attention entry alone. A key stays *held* by (endpoint, tier) while any group's entry
maps to it; when the last one goes (removal, eviction, or an engine hash remapped), the backend
is told (``on_unheld``) and drops the key's holder. Groups of one lane share engine hashes (vLLM
hashes a block once for every group of the same block size), so "another group holds it" is one
probe per group of the lane.

Counting: in tiers other than GPU a repeated store of the same (group, hash) counts, and it
takes as many removals to drop it. vLLM's offloading connector announces a shared block once per
offloaded chunk overlapping it and expects consumers to count; its GPU block pool announces a
block once (a re-announcement, e.g. ``kv_cache_report_mode=full``, only refreshes it).

Packing count and stamp into the value keeps one int object per entry; the total bound uses a
lazy heap of each lane's oldest stamp (heads only get newer, so a stale entry is corrected when
popped), which makes global LRU eviction O(log lanes) per entry.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from kv_picker.state.block_events import GPU_TIER, MAX_TIERS

_U64_MASK = (1 << 64) - 1
_GROUP_SHIFT = 64
_COUNT_SHIFT = 64
_COUNT_ONE = 1 << _COUNT_SHIFT
_COUNT_MAX = 0xFFFF
_STAMP_SHIFT = 80


class Ledger(Protocol):
    """What the backends and the event rules use of a ledger, whichever layout keeps it
    (:class:`BlockLedger` here, :class:`~kv_picker.state.compact_ledger.CompactLedger`)."""

    size: int
    evicted_blocks: int

    def capacity(self, endpoint_id: int, tier: int = GPU_TIER) -> int: ...
    def endpoint_ids(self) -> list[int]: ...
    def count(self, endpoint_id: int, tier: int | None = None) -> int: ...
    def learn_group(self, endpoint_id: int, group: int, full_attention: bool) -> None: ...
    def group_is_full(self, endpoint_id: int, group: int) -> bool: ...
    def learn_multiple(self, endpoint_id: int, tier: int, group: int, multiple: int) -> None: ...
    def multiple(self, endpoint_id: int, tier: int, group: int) -> int: ...
    def resolve(self, endpoint_id: int, tier: int, group: int, engine_hash: int) -> int | None: ...
    def get(
        self, endpoint_id: int, engine_hash: int, tier: int = GPU_TIER, group: int = 0
    ) -> int | None: ...
    def store(
        self,
        endpoint_id: int,
        tier: int,
        group: int,
        engine_hashes: Sequence[int],
        keys: Sequence[int],
    ) -> None: ...
    def remove(
        self, endpoint_id: int, tier: int, group: int, engine_hashes: Sequence[int]
    ) -> int: ...
    def clear(self, endpoint_id: int, forget: bool = False) -> list[tuple[int, list[int]]]: ...
    def held(self, endpoint_id: int) -> Iterator[tuple[int, int]]: ...
    def keys(self, endpoint_id: int, tier: int = GPU_TIER) -> Iterator[int]: ...
    def trim(self, endpoint_id: int, tier: int = GPU_TIER) -> None: ...


class LedgerRules:
    """What every ledger layout shares: bounds, group kinds, block-size multiples, counters.

    Args:
        default_capacity_blocks: per-(endpoint, tier) bound when the capacity is unknown (and
            for every tier but GPU).
        max_blocks: bound on entries over all endpoints, tiers and groups.
        capacity_source: per endpoint id, its GPU KV capacity in blocks (0 = unknown); read,
            never written (the endpoint store's ``num_gpu_blocks``, filled by the scraper).
        on_unheld: called with (endpoint id, tier, key) when no entry of (endpoint, tier) maps
            to ``key`` any more (removed, evicted, remapped; not on ``clear``).
    """

    __slots__ = (
        "_heap",
        "_kinds",
        "_multiples",
        "_on_unheld",
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
        on_unheld: Callable[[int, int, int], None],
    ) -> None:
        if default_capacity_blocks <= 0 or max_blocks <= 0:
            raise ValueError("capacities must be positive")
        self.default_capacity_blocks = default_capacity_blocks
        self.max_blocks = max_blocks
        self.capacity_source = capacity_source
        self._on_unheld = on_unheld
        self._heap: list[tuple[int, int]] = []
        self._kinds: dict[int, dict[int, bool]] = {}
        # (endpoint, tier, group) -> our blocks per engine block, where that is not 1.
        self._multiples: dict[tuple[int, int, int], int] = {}
        self._stamp = 0
        self.size = 0
        self.evicted_blocks = 0
        self._init_entries()

    def _init_entries(self) -> None:
        """The layout's own empty structures (each ledger class sets its own)."""
        raise NotImplementedError

    def capacity(self, endpoint_id: int, tier: int = GPU_TIER) -> int:
        """The (endpoint, tier)'s bound in blocks."""
        source = self.capacity_source
        if (
            tier == GPU_TIER
            and source is not None
            and endpoint_id < len(source)
            and source[endpoint_id] > 0
        ):
            return source[endpoint_id]
        return self.default_capacity_blocks

    def forget_rules(self, endpoint_id: int) -> None:
        """Forget an endpoint's group kinds and block-size multiples (it left the pool)."""
        self._kinds.pop(endpoint_id, None)
        for known in [k for k in self._multiples if k[0] == endpoint_id]:
            del self._multiples[known]

    # -- group kinds ------------------------------------------------------------------------

    def learn_group(self, endpoint_id: int, group: int, full_attention: bool) -> None:
        """Remember whether an endpoint's KV-cache group is full attention (from its events)."""
        kinds = self._kinds.get(endpoint_id)
        if kinds is None:
            self._kinds[endpoint_id] = {group: full_attention}
        elif kinds.get(group) is not full_attention:
            kinds[group] = full_attention

    def group_is_full(self, endpoint_id: int, group: int) -> bool:
        """Whether a group counts as full attention (True until its events say otherwise)."""
        kinds = self._kinds.get(endpoint_id)
        return True if kinds is None else kinds.get(group, True)

    # -- block sizes ------------------------------------------------------------------------

    def learn_multiple(self, endpoint_id: int, tier: int, group: int, multiple: int) -> None:
        """Remember how many of our blocks one engine block of (endpoint, tier, group) spans."""
        if multiple == 1:
            if self._multiples:
                self._multiples.pop((endpoint_id, tier, group), None)
        else:
            self._multiples[endpoint_id, tier, group] = multiple

    def multiple(self, endpoint_id: int, tier: int, group: int) -> int:
        """Our blocks per engine block of (endpoint, tier, group): what its stored events said,
        else what another tier's said for the group (events without tokens name blocks stored
        elsewhere), else 1."""
        multiples = self._multiples
        if not multiples:
            return 1
        found = multiples.get((endpoint_id, tier, group))
        if found is not None:
            return found
        for other in range(MAX_TIERS):
            found = multiples.get((endpoint_id, other, group))
            if found is not None:
                return found
        return 1


class BlockLedger(LedgerRules):
    """Engine hash → key per (endpoint, tier, group), LRU-bounded per (endpoint, tier) and in
    total, in ordered dicts (see the module docstring; the arguments are
    :class:`LedgerRules`')."""

    __slots__ = ("_groups", "_in_heap", "_maps")

    def _init_entries(self) -> None:
        self._maps: list[OrderedDict[int, int] | None] = []
        self._groups: list[list[int]] = []
        self._in_heap: list[bool] = []

    # -- lanes ------------------------------------------------------------------------------

    def _lane(self, lane: int) -> OrderedDict[int, int] | None:
        maps = self._maps
        return maps[lane] if lane < len(maps) else None

    def _map(self, lane: int, group: int) -> OrderedDict[int, int]:
        maps = self._maps
        if lane >= len(maps):
            grow = lane + 1 - len(maps)
            maps.extend([None] * grow)
            self._in_heap.extend([False] * grow)
            self._groups.extend([] for _ in range(grow))
        entries = maps[lane]
        if entries is None:
            entries = maps[lane] = OrderedDict()
        groups = self._groups[lane]
        if group not in groups:
            groups.append(group)
        return entries

    def endpoint_ids(self) -> list[int]:
        """Ids of endpoints holding at least one block."""
        return sorted({lane // MAX_TIERS for lane, entries in enumerate(self._maps) if entries})

    def count(self, endpoint_id: int, tier: int | None = None) -> int:
        """Entries held for an endpoint (in one tier, or all)."""
        base = endpoint_id * MAX_TIERS
        tiers = range(MAX_TIERS) if tier is None else (tier,)
        return sum(len(entries) for t in tiers if (entries := self._lane(base + t)))

    # -- entries ----------------------------------------------------------------------------

    def resolve(self, endpoint_id: int, tier: int, group: int, engine_hash: int) -> int | None:
        """The key an engine hash maps to for an endpoint (recency unchanged), or None.

        The (tier, group) named first, then any other of the endpoint's: the engine names a
        block the same wherever it is kept, so a CPU-tier event resolves through the GPU entry.
        """
        base = endpoint_id * MAX_TIERS
        entries = self._lane(base + tier)
        if entries:
            value = entries.get(engine_hash | group << _GROUP_SHIFT if group else engine_hash)
            if value is not None:
                return value & _U64_MASK
        for lane in range(base, min(base + MAX_TIERS, len(self._maps))):
            entries = self._maps[lane]
            if not entries:
                continue
            for other in self._groups[lane]:
                value = entries.get(engine_hash | other << _GROUP_SHIFT if other else engine_hash)
                if value is not None:
                    return value & _U64_MASK
        return None

    def get(
        self, endpoint_id: int, engine_hash: int, tier: int = GPU_TIER, group: int = 0
    ) -> int | None:
        """The key of one (endpoint, tier, group)'s entry (recency unchanged), or None."""
        entries = self._lane(endpoint_id * MAX_TIERS + tier)
        if not entries:
            return None
        value = entries.get(engine_hash | group << _GROUP_SHIFT if group else engine_hash)
        return None if value is None else value & _U64_MASK

    def store(
        self,
        endpoint_id: int,
        tier: int,
        group: int,
        engine_hashes: Sequence[int],
        keys: Sequence[int],
    ) -> None:
        """Record (or refresh) entries as the (endpoint, tier)'s most recent; ``keys`` aligned
        with the first ``len(keys)`` hashes. Call :meth:`trim` afterwards."""
        lane = endpoint_id * MAX_TIERS + tier
        entries = self._map(lane, group)
        counted = tier != GPU_TIER
        group_bits = group << _GROUP_SHIFT
        stamp = self._stamp
        added = 0
        for engine_hash, key in zip(engine_hashes, keys, strict=False):
            stamp += 1
            # Group 0 keys the entry by the event's own hash object: ``hash | 0`` would be a
            # new int per entry (36 bytes each).
            slot = engine_hash | group_bits if group_bits else engine_hash
            old = entries.get(slot)
            if old is None:
                entries[slot] = key | _COUNT_ONE | stamp << _STAMP_SHIFT
                added += 1
                continue
            old_key = old & _U64_MASK
            count = 1
            if old_key == key:
                count = (old >> _COUNT_SHIFT) & _COUNT_MAX
                if counted and count < _COUNT_MAX:
                    count += 1
            entries[slot] = key | count << _COUNT_SHIFT | stamp << _STAMP_SHIFT
            entries.move_to_end(slot)
            if old_key != key:
                self._release(lane, group, engine_hash, old_key)
        self._stamp = stamp
        if added:
            self.size += added
            if not self._in_heap[lane]:
                self._in_heap[lane] = True
                head = next(iter(entries.values()))
                heapq.heappush(self._heap, (head >> _STAMP_SHIFT, lane))

    def remove(self, endpoint_id: int, tier: int, group: int, engine_hashes: Sequence[int]) -> int:
        """Apply removals of one (endpoint, tier, group); returns how many entries they hit.

        A counted entry (see the module docstring) stays until its count reaches zero.
        """
        lane = endpoint_id * MAX_TIERS + tier
        entries = self._lane(lane)
        if not entries:
            return 0
        group_bits = group << _GROUP_SHIFT
        hit = 0
        for engine_hash in engine_hashes:
            slot = engine_hash | group_bits if group_bits else engine_hash
            value = entries.get(slot)
            if value is None:
                continue
            hit += 1
            if (value >> _COUNT_SHIFT) & _COUNT_MAX > 1:
                entries[slot] = value - _COUNT_ONE
                continue
            del entries[slot]
            self.size -= 1
            self._release(lane, group, engine_hash, value & _U64_MASK)
        return hit

    def _release(self, lane: int, group: int, engine_hash: int, key: int) -> None:
        """An entry of ``key`` left the lane: tell the backend unless another group holds it."""
        groups = self._groups[lane]
        if len(groups) > 1:
            entries = self._maps[lane]
            assert entries is not None
            for other in groups:
                if other != group:
                    value = entries.get(engine_hash | other << _GROUP_SHIFT)
                    if value is not None and value & _U64_MASK == key:
                        return
        self._on_unheld(lane // MAX_TIERS, lane % MAX_TIERS, key)

    def clear(self, endpoint_id: int, forget: bool = False) -> list[tuple[int, list[int]]]:
        """Drop every entry of an endpoint, all tiers and groups (``on_unheld`` is not called).

        Args:
            forget: also forget the endpoint's group kinds (it left the pool).

        Returns:
            (tier, keys held) of every tier that held something.
        """
        if forget:
            self.forget_rules(endpoint_id)
        base = endpoint_id * MAX_TIERS
        dropped: list[tuple[int, list[int]]] = []
        for lane in range(base, min(base + MAX_TIERS, len(self._maps))):
            entries = self._maps[lane]
            if entries is None:
                continue
            if entries:
                dropped.append(
                    (lane - base, list({value & _U64_MASK for value in entries.values()}))
                )
                self.size -= len(entries)
            if forget:
                self._maps[lane] = None
                self._groups[lane] = []
            else:
                entries.clear()
        return dropped

    def held(self, endpoint_id: int) -> Iterator[tuple[int, int]]:
        """(tier, key) of an endpoint's entries, oldest first per tier (a key may repeat)."""
        base = endpoint_id * MAX_TIERS
        for lane in range(base, min(base + MAX_TIERS, len(self._maps))):
            entries = self._maps[lane]
            if entries:
                for value in entries.values():
                    yield lane - base, value & _U64_MASK

    def keys(self, endpoint_id: int, tier: int = GPU_TIER) -> Iterator[int]:
        """Keys of an (endpoint, tier)'s entries, oldest first."""
        entries = self._lane(endpoint_id * MAX_TIERS + tier)
        if entries:
            for value in entries.values():
                yield value & _U64_MASK

    def trim(self, endpoint_id: int, tier: int = GPU_TIER) -> None:
        """Evict until the (endpoint, tier) and the total are within their bounds."""
        lane = endpoint_id * MAX_TIERS + tier
        entries = self._lane(lane)
        if entries:
            overflow = len(entries) - self.capacity(endpoint_id, tier)
            if overflow > 0:
                self.size -= overflow
                self.evicted_blocks += overflow
                for _ in range(overflow):
                    slot, value = entries.popitem(last=False)
                    self._release(lane, slot >> _GROUP_SHIFT, slot & _U64_MASK, value & _U64_MASK)
        heap = self._heap
        in_heap = self._in_heap
        maps = self._maps
        while self.size > self.max_blocks and heap:
            stamp, victim = heapq.heappop(heap)
            victim_entries = maps[victim] if victim < len(maps) else None
            if not victim_entries:
                in_heap[victim] = False
                continue
            slot, head = next(iter(victim_entries.items()))
            head_stamp = head >> _STAMP_SHIFT
            if head_stamp != stamp:  # stale: the oldest entry changed since the push
                heapq.heappush(heap, (head_stamp, victim))
                continue
            victim_entries.popitem(last=False)
            self.size -= 1
            self.evicted_blocks += 1
            self._release(victim, slot >> _GROUP_SHIFT, slot & _U64_MASK, head & _U64_MASK)
            if victim_entries:
                _, head = next(iter(victim_entries.items()))
                heapq.heappush(heap, (head >> _STAMP_SHIFT, victim))
            else:
                in_heap[victim] = False
