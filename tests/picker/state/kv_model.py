"""A brute-force model of the precise index, tier by tier and group by group, and the hypothesis
operations both backends' property tests replay against it.

The model keeps every entry as (endpoint, tier, group, engine hash) -> [key, count, stamp] in a
flat dict and recomputes everything by scanning it: bounds evict the smallest stamp, a block is
held by (endpoint, tier) when any of its entries has the key, a run walks the request's keys
per endpoint. Strict keys (the engine hash is the key), as the index's own structures are what
is under test here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from kv_picker.state.block_events import (
    FULL_ATTENTION_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Tiers,
)

NUM_ENDPOINTS = 3
NUM_KEYS = 4
MEDIA = (None, "GPU", "cpu", "CPU", "STORAGE", "NVME")  # NVME has no tier: not indexed
KINDS = (None, None, "full_attention", "mla_attention", "sink_full_attention", "sliding_window")
TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "storage": 0.5}


@dataclass
class Model:
    """What the index should hold (see the module docstring)."""

    capacities: list[int]  # GPU tier, per endpoint
    default_capacity: int
    max_blocks: int
    tiers: Tiers = field(default_factory=lambda: Tiers(TIER_WEIGHTS))
    entries: dict[tuple[int, int, int, int], list[int]] = field(default_factory=dict)
    kinds: dict[tuple[int, int], bool] = field(default_factory=dict)
    stamp: int = 0

    def apply(self, endpoint: int, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.store(endpoint, event)
        elif isinstance(event, BlockRemoved):
            self.remove(endpoint, event)
        else:
            self.clear(endpoint)

    def store(self, endpoint: int, event: BlockStored) -> None:
        tier = self.tiers.id_of(event.medium)
        group = event.group_idx or 0
        if tier is None:
            return
        if event.kv_cache_spec_kind is not None:
            self.kinds[endpoint, group] = event.kv_cache_spec_kind in FULL_ATTENTION_KINDS
        if not self.kinds.get((endpoint, group), True):
            return
        for engine_hash in event.block_hashes:
            self.stamp += 1
            entry = self.entries.get((endpoint, tier, group, engine_hash))
            if entry is None:
                self.entries[endpoint, tier, group, engine_hash] = [engine_hash, 1, self.stamp]
            else:
                entry[1] += tier != 0  # other tiers than GPU count repeated stores
                entry[2] = self.stamp
        lane = [e for e in self.entries if e[:2] == (endpoint, tier)]
        capacity = self.capacities[endpoint] if tier == 0 else self.default_capacity
        for oldest in sorted(lane, key=lambda e: self.entries[e][2])[
            : max(0, len(lane) - capacity)
        ]:
            del self.entries[oldest]
        while len(self.entries) > self.max_blocks:
            del self.entries[min(self.entries, key=lambda e: self.entries[e][2])]

    def remove(self, endpoint: int, event: BlockRemoved) -> None:
        tier = self.tiers.id_of(event.medium)
        for engine_hash in event.block_hashes:
            where = (endpoint, tier, event.group_idx or 0, engine_hash)
            entry = self.entries.get(where)  # type: ignore[arg-type]
            if entry is None:
                continue
            entry[1] -= 1
            if not entry[1]:
                del self.entries[where]  # type: ignore[arg-type]

    def clear(self, endpoint: int) -> None:
        for where in [e for e in self.entries if e[0] == endpoint]:
            del self.entries[where]

    def held(self, endpoint: int, tier: int) -> set[int]:
        return {v[0] for e, v in self.entries.items() if e[:2] == (endpoint, tier)}

    def runs(self, keys: list[int], candidates: set[int]) -> dict[int, tuple[int, float]]:
        """Per candidate: (run, weighted run)."""
        weights = self.tiers.weights
        out = {}
        for endpoint in candidates:
            held = [self.held(endpoint, t) for t in range(len(weights))]
            run, weighted = 0, 0.0
            for key in keys:
                best = max((weights[t] for t in range(len(weights)) if key in held[t]), default=0)
                if not best:
                    break
                run += 1
                weighted += best
            out[endpoint] = (run, weighted)
        return out


# Few hashes, groups and endpoints, so that removals and stores often meet the same entries.
hashes = st.lists(st.integers(1, NUM_KEYS), max_size=4)
groups = st.one_of(st.none(), st.integers(0, 1))
stored = st.builds(
    BlockStored,
    block_hashes=hashes,
    parent_block_hash=st.none(),
    token_ids=st.just([]),
    block_size=st.just(16),
    medium=st.sampled_from(MEDIA),
    group_idx=groups,
    kv_cache_spec_kind=st.sampled_from(KINDS),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=hashes,
    medium=st.sampled_from(MEDIA),
    group_idx=groups,
)
operations = st.lists(
    st.tuples(
        st.integers(0, NUM_ENDPOINTS - 1),
        st.one_of(stored, removed, st.just(AllBlocksCleared())),
    ),
    min_size=5,
    max_size=30,
)
queries = st.lists(st.integers(1, NUM_KEYS), max_size=5)
