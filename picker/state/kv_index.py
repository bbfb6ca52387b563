"""The precise KV index: its contract, the in-process backend, and the speculative holders.

Which endpoint really holds which block, from the endpoints' own KV events. Two backends keep
it: :class:`KVBlockIndex` here, in the picker's memory (the default), and
:class:`~kv_picker.state.redis_index.RedisKVIndex`, in Redis or Valkey, shared by several
picker replicas. Everything else (the event subscriber, the precise scorer, the app's
lifecycle and /metrics) goes through :class:`KVIndex`, so it never asks which one it has.

The contract has to fit both a dict in memory and a network round trip while the scheduling
path stays synchronous, so a lookup is two steps::

    prepare (async, before the schedule)    prefetch(keys) -> awaitable | None
                                              in process: None (nothing to fetch)
                                              Redis: one EVALSHA, each endpoint's run by address
    score (sync)                            runs(keys, candidates, runs_out, prefetched,
                                                 speculative) -> best run
                                              writes each candidate's run by endpoint id

Both backends share the front half of applying events (records, tiers and keys:
:mod:`kv_picker.state.block_events`; engine hash -> key per (endpoint, tier, group) and the
bounds: :mod:`kv_picker.state.block_ledger`). The in-process index adds the lookup side::

    holders:  [tier] key -> int bitset of endpoint ids   (bit e set: endpoint e holds the block
                                                           in that tier, in some group)
    ledger:   [endpoint id, tier] (group, engine hash) -> key, LRU-bounded

A lookup is the picker's leading-run walk over the tiers' holders
(:func:`kv_picker.state.prefix_runs.tiered_runs`): a block counts for an endpoint when any tier
holds it, and weighs its best tier's weight. With only GPU entries it is the one-tier walk,
O(blocks + endpoints) with no allocation beyond int operations. Updates happen in place on the
event loop thread, so the synchronous scoring path never sees a half-applied event.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from kv_picker.state.block_events import BlockRemoved, BlockStored, EventKeys
from kv_picker.state.block_ledger import Ledger
from kv_picker.state.compact_ledger import LEDGERS, LedgerLayout
from kv_picker.state.prefix_runs import leading_runs, tiered_runs

Prefetched = Mapping[str, tuple[int, float]]
"""What :meth:`KVIndex.prefetch` fetched for one request, handed back to :meth:`KVIndex.runs`
as is (the Redis backend's: each endpoint's run and weighted run, by address)."""


class KVIndex(Protocol):
    """The precise KV index, whichever backend keeps it (see the module docstring).

    Attributes:
        event_keys: how events and requests become keys; the scorer computes a request's keys
            with it so both sides share one key space.
    """

    event_keys: EventKeys

    # -- events (the subscriber's side)

    def apply_stored(self, endpoint_id: int, event: BlockStored, model: str) -> int:
        """Apply a ``BlockStored`` of ``model``'s blocks; returns the number of blocks indexed."""
        ...

    def apply_removed(self, endpoint_id: int, event: BlockRemoved) -> int:
        """Apply a ``BlockRemoved`` of its (medium, group); returns the entries it hit."""
        ...

    def clear_endpoint(self, endpoint_id: int) -> int:
        """Apply ``AllBlocksCleared`` (or a lost event stream); returns blocks dropped."""
        ...

    def remove_endpoint(self, endpoint_id: int) -> None:
        """The endpoint left the pool: forget it (its id may be reused)."""
        ...

    # -- lookup (the scorer's side)

    def prefetch(self, keys: Sequence[int]) -> Awaitable[Prefetched | None] | None:
        """Start fetching what :meth:`runs` will need for ``keys``, before the schedule.

        Returns:
            An awaitable giving the fetched data (None: the backend is unavailable, no cache
            signal), or None when there is nothing to fetch (no coroutine is created). Never
            raises, and the awaitable never raises either.
        """
        ...

    def runs(
        self,
        keys: Sequence[int],
        candidate_mask: int,
        runs_out: list[int],
        prefetched: Prefetched | None = None,
        speculative: SpeculativeHolders | None = None,
        weighted_out: list[float] | None = None,
    ) -> int:
        """Each candidate's leading run, synchronously.

        A block counts when any tier of the endpoint holds it.

        Args:
            keys: the request's block keys, in order.
            candidate_mask: bitset of candidate endpoint ids.
            runs_out: indexed by endpoint id: receives each candidate's run (0 when it lacks
                block 0); other entries are left alone; grown to cover every candidate.
            prefetched: what the awaitable of :meth:`prefetch` gave for these keys, if any.
            speculative: blocks endpoints were just sent, counted as held (in the GPU tier).
            weighted_out: like ``runs_out``, receives each candidate's weighted run: the sum
                over its run's blocks of the weight of the best tier holding each.

        Returns:
            The longest run of any candidate.
        """
        ...

    # -- sizes (for /metrics)

    def num_blocks(self) -> int:
        """(endpoint, block) entries this picker tracks, the figure the bounds apply to."""
        ...

    def num_keys(self) -> int | None:
        """Distinct keys held by at least one endpoint, or None where that is not known."""
        ...

    def num_evicted_blocks(self) -> int:
        """Entries evicted to respect the bounds since start (a counter)."""
        ...

    # -- lifecycle

    async def run(self) -> None:
        """The backend's background work, until cancelled (returns at once when it has none)."""
        ...

    async def close(self) -> None:
        """Release connections (after :meth:`run` was cancelled)."""
        ...


class KVBlockIndex:
    """The in-process precise index (see the module docstring).

    Args:
        event_keys: key computation shared with the scorer (and where drops are reported).
        default_capacity_blocks: per-(endpoint, tier) bound when the KV capacity is not scraped.
        max_blocks: bound on (endpoint, tier, group, block) entries in total.
        capacity_source: per endpoint id, its ``num_gpu_blocks`` (0 = unknown).
        layout: the ledger's: ``compact`` (numpy logs, :mod:`kv_picker.state.compact_ledger`)
            or ``dict`` (ordered dicts, :mod:`kv_picker.state.block_ledger`).
    """

    def __init__(
        self,
        event_keys: EventKeys,
        default_capacity_blocks: int = 1_000_000,
        max_blocks: int = 10_000_000,
        capacity_source: Sequence[int] | None = None,
        layout: LedgerLayout = "compact",
    ) -> None:
        self.event_keys = event_keys
        self.tier_weights = event_keys.tiers.weights
        self._holders: list[dict[int, int]] = [{} for _ in self.tier_weights]
        self._scratch: list[float] = []
        self.ledger: Ledger = LEDGERS[layout](
            default_capacity_blocks, max_blocks, capacity_source, self._drop_holder
        )

    # -- events -----------------------------------------------------------------------------

    def apply_stored(self, endpoint_id: int, event: BlockStored, model: str) -> int:
        """Apply a ``BlockStored`` of ``model``'s blocks; returns the number of blocks indexed."""
        stored = self.event_keys.stored_keys(self.ledger, endpoint_id, event, model)
        if stored is None:
            return 0
        tier, group, engine_hashes, keys = stored
        ledger = self.ledger
        ledger.store(endpoint_id, tier, group, engine_hashes, keys)
        bit = 1 << endpoint_id
        holders = self._holders[tier]
        for key in keys:
            holders[key] = holders.get(key, 0) | bit
        ledger.trim(endpoint_id, tier)
        return len(keys)

    def apply_removed(self, endpoint_id: int, event: BlockRemoved) -> int:
        """Apply a ``BlockRemoved`` of its (medium, group); returns the entries it hit."""
        return self.event_keys.apply_removed(self.ledger, endpoint_id, event)

    def clear_endpoint(self, endpoint_id: int) -> int:
        """Apply ``AllBlocksCleared`` (or a lost event stream); returns blocks dropped.

        Every tier and group: the event names none, and a lost stream leaves all of them unknown.
        """
        before = self.ledger.size
        for tier, keys in self.ledger.clear(endpoint_id):
            for key in keys:
                self._drop_holder(endpoint_id, tier, key)
        return before - self.ledger.size

    def remove_endpoint(self, endpoint_id: int) -> None:
        """The endpoint left the pool: forget it (its id may be reused)."""
        for tier, keys in self.ledger.clear(endpoint_id, forget=True):
            for key in keys:
                self._drop_holder(endpoint_id, tier, key)

    def _drop_holder(self, endpoint_id: int, tier: int, key: int) -> None:
        holders = self._holders[tier]
        remaining = holders.get(key, 0) & ~(1 << endpoint_id)
        if remaining:
            holders[key] = remaining
        else:
            holders.pop(key, None)

    # -- lookup -----------------------------------------------------------------------------

    def prefetch(self, keys: Sequence[int]) -> None:
        """Nothing to fetch: the holders are in memory."""
        return None

    def runs(
        self,
        keys: Sequence[int],
        candidate_mask: int,
        runs_out: list[int],
        prefetched: Prefetched | None = None,
        speculative: SpeculativeHolders | None = None,
        weighted_out: list[float] | None = None,
    ) -> int:
        """Each candidate's leading run (see :meth:`KVIndex.runs`)."""
        overlay = speculative.maps() if speculative is not None else None
        if weighted_out is None:
            holders = self._holders
            if not any(holders[1:]):
                return leading_runs(keys, candidate_mask, runs_out, holders[0], overlay)
            weighted_out = self._scratch  # the caller wants runs only
        return tiered_runs(
            keys, candidate_mask, runs_out, weighted_out, self._holders, self.tier_weights, overlay
        )

    # -- sizes ------------------------------------------------------------------------------

    def num_blocks(self) -> int:
        """(endpoint, block) entries, the figure the bounds apply to."""
        return self.ledger.size

    def num_keys(self) -> int:
        """Distinct keys held by at least one endpoint (in any tier)."""
        holders = self._holders
        if len(holders) == 1 or not any(holders[1:]):
            return len(holders[0])
        return len(set().union(*holders))

    def num_evicted_blocks(self) -> int:
        """Entries evicted to respect the bounds since start."""
        return self.ledger.evicted_blocks

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self) -> None:
        """No background work: events apply in place as they arrive."""

    async def close(self) -> None:
        """Nothing to release."""


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
