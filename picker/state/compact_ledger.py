"""The ledger in numpy arrays: :class:`~kv_picker.state.block_ledger.BlockLedger`'s contract in
about a third of the memory per entry.

:class:`BlockLedger` keeps each (endpoint, tier, group, engine hash) entry in an ordered dict: an
int object for the hash, one for the packed value, a dict slot and a linked-list node, about
150 bytes. Here each (endpoint, tier) lane is an append-only log in numpy arrays, in recency
order, with an open-addressing table over it::

    log     hashes  u64   engine hash                       oldest ... newest
            keys    u64   our key
            stamps  u64   global store order (LRU across lanes)
            info    u32   count << 16 | group               0: dead
    table   i32[power of two >= 2 * log capacity]   log position + 1, 0 empty; linear probing
                                                    on a Fibonacci hash of (engine hash, group)

- A store appends (a refreshed entry is killed where it was and appended at the tail; its table
  slot moves with it), a removal kills its entry in place (its table slot stays, pointing at a
  dead entry: a tombstone the lookups step over), eviction kills from the head.
- When the log is full it is compacted: into the same capacity, into half as much again as is
  live when that leaves under a quarter free, or into twice what is live when most of it is
  dead; the table is rebuilt from the live entries (vectorized), which drops the tombstones.
  Every table slot points at a distinct log position, so the table is never more than half full
  and every probe ends.
- Entries are read and written one at a time through memoryviews of the arrays: at the 16 or so
  blocks an event carries, numpy's per-call overhead costs more than the work. Per log slot: 28
  bytes of log and 4–8 of table; the log is 67–100% live right after it grows.

Counting, groups, releases and bounds behave exactly as :class:`BlockLedger`'s (checked against
it operation by operation, and against the brute-force model). Groups are numbered below 65,536
(the event decoder refuses others) and counts saturate at 65,535. Hashes and keys are unsigned
64-bit; a store that meets another value raises, keeping what it stored before it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from kv_picker.state.block_events import GPU_TIER, MAX_TIERS
from kv_picker.state.block_ledger import BlockLedger, LedgerRules

_U64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: the product's high bits pick the slot
_GROUP_MIX = 0xBF58476D1CE4E5B9
_GROUP_BITS = 0xFFFF
_COUNT_SHIFT = 16
_COUNT_ONE = 1 << _COUNT_SHIFT
_COUNT_MAX = 0xFFFF
_MIN_LOG = 16

U64Array = npt.NDArray[np.uint64]
IntpArray = npt.NDArray[np.intp]


def _home_scalar(engine_hash: int, group: int, shift: int) -> int:
    return (((engine_hash ^ (group * _GROUP_MIX & _U64)) * _MIX) & _U64) >> shift


def _home(hashes: U64Array, groups: U64Array, shift: int) -> IntpArray:
    """Vectorized :func:`_home_scalar` (uint64 arithmetic wraps)."""
    mixed = (hashes ^ (groups * np.uint64(_GROUP_MIX))) * np.uint64(_MIX)
    return (mixed >> np.uint64(shift)).astype(np.intp)


class _Lane:
    """One (endpoint, tier)'s log and table (see the module docstring).

    The arrays are numpy (bulk work: compaction, rebuilds, listings); entries are read and
    written one at a time through memoryviews of them, which cost a fraction of numpy's
    per-call overhead at the few blocks an event carries.
    """

    __slots__ = (
        "groups",
        "hashes",
        "head",
        "info",
        "keys",
        "live",
        "mask",
        "mv_hashes",
        "mv_info",
        "mv_keys",
        "mv_stamps",
        "mv_table",
        "shift",
        "stamps",
        "table",
        "tail",
    )

    def __init__(self, groups: list[int] | None = None) -> None:
        self.groups: list[int] = groups if groups is not None else []
        self.live = 0
        self._allocate(_MIN_LOG)

    def _allocate(self, capacity: int) -> None:
        self.hashes = np.zeros(capacity, np.uint64)
        self.keys = np.zeros(capacity, np.uint64)
        self.stamps = np.zeros(capacity, np.uint64)
        self.info = np.zeros(capacity, np.uint32)
        bits = (2 * capacity - 1).bit_length()  # at most half full
        self.table = np.zeros(1 << bits, np.int32)
        self.mask = (1 << bits) - 1
        self.shift = 64 - bits
        self.mv_hashes = self.hashes.data
        self.mv_keys = self.keys.data
        self.mv_stamps = self.stamps.data
        self.mv_info = self.info.data
        self.mv_table = self.table.data
        self.head = 0
        self.tail = 0

    @property
    def capacity(self) -> int:
        return len(self.hashes)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.hashes, self.keys, self.stamps, self.info, self.table))

    def find(self, engine_hash: int, group: int) -> tuple[int, int]:
        """(log position of the live (hash, group) entry or -1, its table slot or the first
        empty one)."""
        table, hashes, info, mask = self.mv_table, self.mv_hashes, self.mv_info, self.mask
        slot = (((engine_hash ^ (group * _GROUP_MIX & _U64)) * _MIX) & _U64) >> self.shift
        while True:
            held = table[slot]
            if not held:
                return -1, slot
            meta = info[held - 1]
            if meta and hashes[held - 1] == engine_hash and meta & _GROUP_BITS == group:
                return held - 1, slot
            slot = (slot + 1) & mask

    def make_room(self) -> None:
        """Room for one append: compact in place, grow to half as much again as is live, or
        shrink to twice that when most of the log is dead; then rebuild the table."""
        live = np.flatnonzero(self.info[self.head : self.tail]) + self.head
        needed = len(live) + 1
        capacity = self.capacity
        if 4 * needed > 3 * capacity:
            capacity = max(_MIN_LOG, needed + needed // 2)
        elif 8 * needed < capacity:
            capacity = max(_MIN_LOG, 2 * needed)
        arrays = (self.hashes[live], self.keys[live], self.stamps[live], self.info[live])
        self._allocate(capacity)
        n = len(live)
        self.hashes[:n], self.keys[:n], self.stamps[:n], self.info[:n] = arrays
        self.tail = n
        self._place_all(n)

    def _place_all(self, n: int) -> None:
        """Table slots for log positions 0..n-1 (a fresh table): every position scatters into
        its probe slot, the one that reads back its own position won it, the others move on."""
        table, mask = self.table, self.mask
        positions = np.arange(n)
        slots = _home(self.hashes[:n], (self.info[:n] & _GROUP_BITS).astype(np.uint64), self.shift)
        while positions.size:
            free = table[slots] == 0
            claims, claimed = positions[free], slots[free]
            table[claimed] = claims + 1
            won = np.zeros(len(positions), bool)
            won[free] = table[claimed] == claims + 1
            # Whoever did not win (taken before, or by another this round) tries the next slot.
            positions, slots = positions[~won], (slots[~won] + 1) & mask

    def oldest(self, count: int) -> list[int]:
        """Log positions of the ``count`` oldest live entries (fewer if there are not)."""
        info, position, tail = self.mv_info, self.head, self.tail
        while position < tail and not info[position]:
            position += 1
        self.head = position
        found: list[int] = []
        while position < tail and len(found) < count:
            if info[position]:
                found.append(position)
            position += 1
        return found

    def head_stamp(self) -> int:
        """The oldest live entry's stamp (the lane is not empty)."""
        info, position = self.mv_info, self.head
        while not info[position]:
            position += 1
        self.head = position
        return int(self.mv_stamps[position])

    def live_positions(self) -> IntpArray:
        return np.flatnonzero(self.info[self.head : self.tail]) + self.head


class CompactLedger(LedgerRules):
    """:class:`~kv_picker.state.block_ledger.BlockLedger`'s contract in numpy logs (see the module
    docstring; the arguments are :class:`LedgerRules`')."""

    __slots__ = ("_in_heap", "_lanes")

    def _init_entries(self) -> None:
        self._lanes: dict[int, _Lane] = {}
        self._in_heap: set[int] = set()  # lanes with an entry in the heap (maybe stale)

    def nbytes(self) -> int:
        """Bytes held by the lanes' arrays."""
        return sum(lane.nbytes() for lane in self._lanes.values())

    def endpoint_ids(self) -> list[int]:
        """Ids of endpoints holding at least one block."""
        return sorted({lane // MAX_TIERS for lane, entries in self._lanes.items() if entries.live})

    def count(self, endpoint_id: int, tier: int | None = None) -> int:
        """Entries held for an endpoint (in one tier, or all)."""
        base = endpoint_id * MAX_TIERS
        tiers = range(MAX_TIERS) if tier is None else (tier,)
        return sum(entries.live for t in tiers if (entries := self._lanes.get(base + t)))

    # -- entries ----------------------------------------------------------------------------

    def resolve(self, endpoint_id: int, tier: int, group: int, engine_hash: int) -> int | None:
        """The key an engine hash maps to for an endpoint (recency unchanged), or None.

        The (tier, group) named first, then any other of the endpoint's (see
        :meth:`BlockLedger.resolve`).
        """
        base = endpoint_id * MAX_TIERS
        lane = self._lanes.get(base + tier)
        if lane is not None and lane.live:
            position = lane.find(engine_hash, group)[0]
            if position >= 0:
                return lane.mv_keys[position]
        for lane_id in range(base, base + MAX_TIERS):
            lane = self._lanes.get(lane_id)
            if lane is None or not lane.live:
                continue
            for other in lane.groups:
                position = lane.find(engine_hash, other)[0]
                if position >= 0:
                    return lane.mv_keys[position]
        return None

    def get(
        self, endpoint_id: int, engine_hash: int, tier: int = GPU_TIER, group: int = 0
    ) -> int | None:
        """The key of one (endpoint, tier, group)'s entry (recency unchanged), or None."""
        lane = self._lanes.get(endpoint_id * MAX_TIERS + tier)
        if lane is None or not lane.live:
            return None
        position = lane.find(engine_hash, group)[0]
        return None if position < 0 else lane.mv_keys[position]

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
        lane_id = endpoint_id * MAX_TIERS + tier
        lane = self._lanes.get(lane_id)
        if lane is None:
            lane = self._lanes[lane_id] = _Lane()
        if group not in lane.groups:
            if not 0 <= group <= _GROUP_BITS:
                raise ValueError(f"KV-cache group {group} is out of range")
            lane.groups.append(group)
        counted = tier != GPU_TIER
        stamp = self._stamp
        added = 0
        group_mix = group * _GROUP_MIX & _U64
        tail, capacity = lane.tail, lane.capacity
        hashes, stored_keys, stamps, info, table = (
            lane.mv_hashes, lane.mv_keys, lane.mv_stamps, lane.mv_info, lane.mv_table
        )  # fmt: skip
        mask, shift = lane.mask, lane.shift
        try:
            for engine_hash, key in zip(engine_hashes, keys, strict=False):
                if tail == capacity:
                    lane.tail = tail
                    lane.make_room()
                    tail, capacity = lane.tail, lane.capacity
                    hashes, stored_keys, stamps, info, table = (
                        lane.mv_hashes, lane.mv_keys, lane.mv_stamps, lane.mv_info, lane.mv_table
                    )  # fmt: skip
                    mask, shift = lane.mask, lane.shift
                # Into the free tail slot first: a value out of uint64's range raises here,
                # before anything else changed.
                hashes[tail] = engine_hash
                stored_keys[tail] = key
                # lane.find, inlined: this loop is the ingestion path.
                slot = (((engine_hash ^ group_mix) * _MIX) & _U64) >> shift
                while True:
                    held = table[slot]
                    if not held:
                        position = -1
                        break
                    meta = info[held - 1]
                    if meta and hashes[held - 1] == engine_hash and meta & _GROUP_BITS == group:
                        position = held - 1
                        break
                    slot = (slot + 1) & mask
                count = 1
                remapped = -1
                if position >= 0:
                    old = info[position]
                    info[position] = 0
                    old_key = stored_keys[position]
                    if old_key == key:
                        count = old >> _COUNT_SHIFT
                        if counted and count < _COUNT_MAX:
                            count += 1
                    else:
                        remapped = old_key
                else:
                    added += 1
                stamp += 1
                stamps[tail] = stamp
                info[tail] = count << _COUNT_SHIFT | group
                table[slot] = tail + 1  # a refreshed entry's slot follows it
                tail += 1
                if remapped >= 0:
                    lane.tail = tail
                    self._release(lane_id, lane, group, engine_hash, remapped)
        finally:  # what was stored before a bad value stays stored, and counted
            lane.tail = tail
            self._stamp = stamp
            if added:
                lane.live += added
                self.size += added
                if lane_id not in self._in_heap:
                    self._in_heap.add(lane_id)
                    heapq.heappush(self._heap, (lane.head_stamp(), lane_id))

    def remove(self, endpoint_id: int, tier: int, group: int, engine_hashes: Sequence[int]) -> int:
        """Apply removals of one (endpoint, tier, group); returns how many entries they hit.

        A counted entry stays until its count reaches zero.
        """
        lane_id = endpoint_id * MAX_TIERS + tier
        lane = self._lanes.get(lane_id)
        if lane is None or not lane.live:
            return 0
        info = lane.mv_info
        hit = 0
        for engine_hash in engine_hashes:
            position = lane.find(engine_hash, group)[0]
            if position < 0:
                continue
            hit += 1
            meta = info[position]
            if meta >> _COUNT_SHIFT > 1:
                info[position] = meta - _COUNT_ONE
                continue
            info[position] = 0
            lane.live -= 1
            self.size -= 1
            self._release(lane_id, lane, group, engine_hash, lane.mv_keys[position])
        return hit

    def _release(self, lane_id: int, lane: _Lane, group: int, engine_hash: int, key: int) -> None:
        """An entry of ``key`` left the lane: tell the backend unless another group holds it."""
        if len(lane.groups) > 1:
            for other in lane.groups:
                if other != group:
                    position = lane.find(engine_hash, other)[0]
                    if position >= 0 and lane.mv_keys[position] == key:
                        return
        self._on_unheld(lane_id // MAX_TIERS, lane_id % MAX_TIERS, key)

    def _evict(self, lane_id: int, lane: _Lane, positions: list[int]) -> None:
        """Evict live entries, oldest first, releasing their keys."""
        info = lane.mv_info
        for position in positions:
            group = info[position] & _GROUP_BITS
            info[position] = 0
            lane.live -= 1
            self.size -= 1
            self.evicted_blocks += 1
            self._release(lane_id, lane, group, lane.mv_hashes[position], lane.mv_keys[position])

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
        for lane_id in range(base, base + MAX_TIERS):
            lane = self._lanes.get(lane_id)
            if lane is None:
                continue
            if lane.live:
                keys = np.unique(lane.keys[lane.live_positions()]).tolist()
                dropped.append((lane_id - base, keys))
                self.size -= lane.live
            if forget:
                del self._lanes[lane_id]  # its heap entry, if any, is dropped when popped
            else:
                self._lanes[lane_id] = _Lane(lane.groups)
        return dropped

    def held(self, endpoint_id: int) -> Iterator[tuple[int, int]]:
        """(tier, key) of an endpoint's entries, oldest first per tier (a key may repeat)."""
        base = endpoint_id * MAX_TIERS
        for lane_id in range(base, base + MAX_TIERS):
            lane = self._lanes.get(lane_id)
            if lane is not None and lane.live:
                tier = lane_id - base
                for key in lane.keys[lane.live_positions()].tolist():
                    yield tier, key

    def keys(self, endpoint_id: int, tier: int = GPU_TIER) -> Iterator[int]:
        """Keys of an (endpoint, tier)'s entries, oldest first."""
        lane = self._lanes.get(endpoint_id * MAX_TIERS + tier)
        if lane is not None and lane.live:
            yield from lane.keys[lane.live_positions()].tolist()

    def trim(self, endpoint_id: int, tier: int = GPU_TIER) -> None:
        """Evict until the (endpoint, tier) and the total are within their bounds."""
        lane_id = endpoint_id * MAX_TIERS + tier
        lane = self._lanes.get(lane_id)
        if lane is not None:
            overflow = lane.live - self.capacity(endpoint_id, tier)
            if overflow > 0:
                self._evict(lane_id, lane, lane.oldest(overflow))
        heap = self._heap
        lanes = self._lanes
        while self.size > self.max_blocks and heap:
            stamp, victim_id = heapq.heappop(heap)
            victim = lanes.get(victim_id)
            if victim is None or not victim.live:
                self._in_heap.discard(victim_id)
                continue
            head_stamp = victim.head_stamp()
            if head_stamp != stamp:  # stale: the oldest entry changed since the push
                heapq.heappush(heap, (head_stamp, victim_id))
                continue
            self._evict(victim_id, victim, [victim.head])
            if victim.live:
                heapq.heappush(heap, (victim.head_stamp(), victim_id))
            else:
                self._in_heap.discard(victim_id)


LedgerLayout = Literal["compact", "dict"]
LEDGERS: dict[str, type[BlockLedger] | type[CompactLedger]] = {
    "compact": CompactLedger,
    "dict": BlockLedger,
}
"""The ledger class of each layout (the precise index's ``ledger`` setting)."""
