"""The numpy ledger against the ordered-dict one, operation by operation: same entries in the same
recency order, same counts, same evictions, same keys released."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.state.block_ledger import BlockLedger
from kv_picker.state.compact_ledger import CompactLedger, _home, _home_scalar, _Lane

ENDPOINTS = 3
TIERS = 2
hashes = st.lists(st.integers(0, 12), min_size=1, max_size=16)
operation = st.one_of(
    st.tuples(
        st.just("store"),
        st.integers(0, ENDPOINTS - 1),
        st.integers(0, TIERS - 1),
        st.integers(0, 2),
        hashes,
        st.sampled_from([0, 0, 0, 1]),  # key salt: the same hash may map to another key
    ),
    st.tuples(
        st.just("remove"),
        st.integers(0, ENDPOINTS - 1),
        st.integers(0, TIERS - 1),
        st.integers(0, 2),
        hashes,
    ),
    st.tuples(st.just("clear"), st.integers(0, ENDPOINTS - 1), st.booleans()),
)


def ledgers(
    capacities: list[int], default: int, max_blocks: int
) -> tuple[BlockLedger, CompactLedger, list[list[tuple[int, int, int]]]]:
    released: list[list[tuple[int, int, int]]] = [[], []]
    reference = BlockLedger(
        default, max_blocks, capacities, lambda *a: released[0].append(a)
    )  # fmt: skip
    compact = CompactLedger(default, max_blocks, capacities, lambda *a: released[1].append(a))
    return reference, compact, released


@settings(max_examples=600, deadline=None)
@given(
    st.lists(operation, max_size=80),
    st.lists(st.integers(0, 10), min_size=ENDPOINTS, max_size=ENDPOINTS),
    st.integers(1, 12),
    st.integers(1, 40),
)
def test_same_as_the_ordered_dict_ledger(
    ops: list[tuple[Any, ...]], capacities: list[int], default: int, max_blocks: int
) -> None:
    reference, compact, released = ledgers(capacities, default, max_blocks)
    for op in ops:
        if op[0] == "store":
            _, endpoint, tier, group, engine_hashes, salt = op
            keys = [(h * 7919 + salt) % 50 + 1 for h in engine_hashes]
            for ledger in (reference, compact):
                ledger.store(endpoint, tier, group, engine_hashes, keys)
                ledger.trim(endpoint, tier)
        elif op[0] == "remove":
            _, endpoint, tier, group, engine_hashes = op
            hits = [
                ledger.remove(endpoint, tier, group, engine_hashes)
                for ledger in (reference, compact)
            ]
            assert hits[0] == hits[1]
        else:
            _, endpoint, forget = op
            dropped = [ledger.clear(endpoint, forget) for ledger in (reference, compact)]
            assert [(t, sorted(k)) for t, k in dropped[0]] == [
                (t, sorted(k)) for t, k in dropped[1]
            ]
        assert Counter(released[0]) == Counter(released[1]), op
        released[0].clear()
        released[1].clear()
        assert compact.size == reference.size
        assert compact.evicted_blocks == reference.evicted_blocks
        for endpoint in range(ENDPOINTS):
            assert list(compact.held(endpoint)) == list(reference.held(endpoint))
            for tier in range(TIERS):
                assert compact.count(endpoint, tier) == reference.count(endpoint, tier)
        assert compact.endpoint_ids() == reference.endpoint_ids()
    for endpoint in range(ENDPOINTS):
        for tier in range(TIERS):
            for group in range(3):
                for engine_hash in range(13):
                    assert compact.get(endpoint, engine_hash, tier, group) == reference.get(
                        endpoint, engine_hash, tier, group
                    )
                    assert compact.resolve(endpoint, tier, group, engine_hash) == (
                        reference.resolve(endpoint, tier, group, engine_hash)
                    )


def test_a_lane_grows_compacts_and_keeps_its_order() -> None:
    reference, compact, _ = ledgers([0], 1_000_000, 10**9)
    rng = np.random.default_rng(0)
    for round_ in range(40):
        batch = rng.integers(0, 2**64, 64, dtype=np.uint64).tolist()
        for ledger in (reference, compact):
            ledger.store(0, 0, 0, batch, [h ^ 1 for h in batch])
            # Remove half of an earlier batch: dead entries the next compaction drops.
            if round_ % 3 == 2:
                ledger.remove(0, 0, 0, batch[::2])
    assert list(compact.keys(0)) == list(reference.keys(0))
    lane = compact._lanes[0]
    assert lane.capacity >= lane.live
    assert lane.capacity <= 4 * lane.live  # compacted, not only grown
    assert len(lane.table) >= 2 * lane.capacity


def test_full_64_bit_hashes_and_keys_round_trip() -> None:
    _, compact, _ = ledgers([0], 100, 1000)
    top = (1 << 64) - 1
    compact.store(0, 0, 5, [top, 0, 1 << 63], [top, 1, 1 << 63])
    assert compact.get(0, top, group=5) == top
    assert compact.get(0, 0, group=5) == 1
    assert compact.resolve(0, 1, 0, 1 << 63) == 1 << 63  # through another tier and group
    assert compact.get(0, top) is None  # group 0


@pytest.mark.parametrize("group", [0, 1, 65_535])
def test_scalar_and_vector_homes_agree(group: int) -> None:
    values = [0, 1, 2**63, 2**64 - 1, 12345678901234567]
    groups = np.full(len(values), group, np.uint64)
    vector = _home(np.array(values, np.uint64), groups, 50).tolist()
    assert vector == [_home_scalar(v, group, 50) for v in values]


def test_groups_out_of_range_are_refused() -> None:
    _, compact, _ = ledgers([0], 100, 1000)
    with pytest.raises(ValueError, match="group"):
        compact.store(0, 0, 65_536, [1], [1])
    assert isinstance(compact._lanes[0], _Lane) and compact.size == 0


def test_the_total_bound_evicts_the_oldest_across_interleaved_lanes() -> None:
    reference, compact, released = ledgers([0, 0, 0], 100, 8)
    for ledger in (reference, compact):
        ledger.store(0, 0, 0, [1, 2, 3], [1, 2, 3])  # stamps 1-3
        ledger.store(1, 0, 0, [4], [4])  # 4
        ledger.store(0, 0, 0, [5], [5])  # 5
        ledger.store(1, 0, 0, [6], [6])  # 6
        ledger.store(2, 0, 0, [7, 8, 9, 10, 11], [7, 8, 9, 10, 11])  # 11 entries: 3 too many
        ledger.trim(2, 0)
    assert released[0] == released[1] == [(0, 0, 1), (0, 0, 2), (0, 0, 3)]
    reference.store(2, 0, 0, [12, 13], [12, 13])
    compact.store(2, 0, 0, [12, 13], [12, 13])
    reference.trim(2, 0)
    compact.trim(2, 0)
    assert released[1] == released[0] == [(0, 0, 1), (0, 0, 2), (0, 0, 3), (1, 0, 4), (0, 0, 5)]
    assert [list(c.held(e)) for c in (compact,) for e in range(3)] == [
        list(reference.held(e)) for e in range(3)
    ]


def test_a_lane_that_empties_gives_its_memory_back() -> None:
    reference, compact, _ = ledgers([0], 1_000_000, 10**9)
    hashes = list(range(1, 20_001))
    for ledger in (reference, compact):
        ledger.store(0, 0, 0, hashes, hashes)
    big = compact._lanes[0].capacity
    for ledger in (reference, compact):
        ledger.remove(0, 0, 0, hashes[:19_900])
        ledger.store(0, 0, 0, hashes[:100], hashes[:100])  # appends until the log is full
        for _ in range(200):
            ledger.store(0, 0, 0, hashes[19_900:], hashes[19_900:])  # refreshes: appends
    assert list(compact.keys(0)) == list(reference.keys(0))
    assert compact._lanes[0].capacity < big // 8


def test_a_store_that_meets_a_value_out_of_range_keeps_what_it_stored() -> None:
    _, compact, released = ledgers([0], 100, 1000)
    compact.store(0, 0, 0, [9], [9])
    with pytest.raises((ValueError, OverflowError)):
        compact.store(0, 0, 0, [1, 2, 9, 3], [1, 2, 1 << 64, 3])
    assert compact.size == 3 and list(compact.keys(0)) == [9, 1, 2]
    compact.store(0, 0, 0, [5], [5])
    assert list(compact.keys(0)) == [9, 1, 2, 5]
    assert compact.remove(0, 0, 0, [2, 9]) == 2
    assert compact.size == 2 and released[1] == [(0, 0, 2), (0, 0, 9)]
