"""Approximate prefix index: which endpoints were *sent* which blocks.

Nothing here is known for sure: after each pick the chosen endpoint is recorded as holding
the request's blocks, and each endpoint keeps only its ``capacity_blocks`` most recently used
keys (a stand-in for the server's own LRU). Precise knowledge comes from KV events instead.

Layout:

```
holders: key -> int bitset of endpoint ids      (bit e set: endpoint e holds the block)
lru[e]:  OrderedDict key -> None, oldest first   (per-endpoint recency, bounded)
```

Lookup is the picker's one leading-run walk over ``holders``
(:func:`kv_picker.state.prefix_runs.leading_runs`): O(blocks + endpoints), no per-block
allocation beyond int operations. The index counts what its lookups matched for the scorer's
hit ratio on /metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kv_picker.state.prefix_runs import leading_runs


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

    def runs(self, keys: Sequence[int], candidate_mask: int, runs_out: list[int]) -> int:
        """Each candidate's leading run, by endpoint id, into ``runs_out``.

        Args:
            keys: the request's block keys, in order.
            candidate_mask: bitset of the candidate endpoint ids.
            runs_out: indexed by endpoint id; see
                :func:`~kv_picker.state.prefix_runs.leading_runs`.

        Returns:
            The longest run of any candidate.
        """
        best = leading_runs(keys, candidate_mask, runs_out, self._holders)
        self.lookups += 1
        self.queried_blocks += len(keys)
        self.hit_blocks += best
        return best

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

    def held(self, endpoint_id: int) -> list[int]:
        """The keys recorded for an endpoint, least recently used first."""
        lru = self._lru.get(endpoint_id)
        return list(lru) if lru else []

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
