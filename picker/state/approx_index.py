"""Approximate prefix index: which endpoints were *sent* which blocks.

Nothing here is known for sure: after each pick the chosen endpoint is recorded as holding
the request's blocks, and each endpoint keeps only its ``capacity_blocks`` most recently used
keys (a stand-in for the server's own LRU). Precise knowledge comes from KV events instead.

Layout:

```
holders: key -> int bitset of endpoint ids      (bit e set: endpoint e holds the block)
lru[e]:  OrderedDict key -> None, oldest first   (per-endpoint recency, bounded)
```

Lookup walks the request's keys once, intersecting the candidate bitset with each key's
holders; when a bit drops out at block i, that endpoint's run is i. That is
O(blocks + endpoints) with no per-block allocation beyond int operations.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class ApproximatePrefixIndex:
    """Bounded, router-side record of the blocks sent to each endpoint.

    Args:
        capacity_blocks: keys kept per endpoint before the least recently used is dropped.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._holders: dict[int, int] = {}
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self.lookups = 0
        self.hit_blocks = 0
        self.queried_blocks = 0

    def __len__(self) -> int:
        """Distinct keys indexed."""
        return len(self._holders)

    def num_entries(self) -> int:
        """(key, endpoint) pairs held, the figure bounded by capacity × endpoints."""
        return sum(len(lru) for lru in self._lru.values())

    def match_runs(self, keys: Sequence[int], candidate_mask: int) -> dict[int, int]:
        """Leading-run length per endpoint id, for endpoints in ``candidate_mask``.

        Endpoints with no match are absent from the result.
        """
        runs: dict[int, int] = {}
        mask = candidate_mask
        holders = self._holders
        position = 0
        for key in keys:
            held = mask & holders.get(key, 0)
            if held != mask:
                dropped = mask & ~held
                if position:
                    while dropped:
                        low = dropped & -dropped
                        runs[low.bit_length() - 1] = position
                        dropped ^= low
                mask = held
                if not mask:
                    break
            position += 1  # noqa: SIM113 (the count outlives the loop)
        else:
            while mask and position:
                low = mask & -mask
                runs[low.bit_length() - 1] = position
                mask ^= low
        self.lookups += 1
        self.queried_blocks += len(keys)
        if runs:
            self.hit_blocks += max(runs.values())
        return runs

    def record(self, endpoint_id: int, keys: Sequence[int]) -> None:
        """Note that ``endpoint_id`` now holds ``keys`` (most recently used last)."""
        if not keys:
            return
        bit = 1 << endpoint_id
        lru = self._lru.get(endpoint_id)
        if lru is None:
            lru = self._lru[endpoint_id] = OrderedDict()
        holders = self._holders
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                holders[key] = holders.get(key, 0) | bit
        overflow = len(lru) - self.capacity_blocks
        for _ in range(overflow):
            old_key, _ = lru.popitem(last=False)
            self._drop_holder(old_key, bit)

    def remove_endpoint(self, endpoint_id: int) -> None:
        """Forget everything recorded for an endpoint (it left the pool or restarted)."""
        lru = self._lru.pop(endpoint_id, None)
        if not lru:
            return
        bit = 1 << endpoint_id
        for key in lru:
            self._drop_holder(key, bit)

    def _drop_holder(self, key: int, bit: int) -> None:
        remaining = self._holders.get(key, 0) & ~bit
        if remaining:
            self._holders[key] = remaining
        else:
            self._holders.pop(key, None)
