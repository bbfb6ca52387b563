"""The in-process precise index against a brute-force model, and its event-to-key rules."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.state.block_events import (
    DROP_BLOCK_SIZE,
    DROP_EXTRA_KEYS,
    DROP_LORA_ID,
    DROP_MEDIUM,
    DROP_TOKEN_COUNT,
    DROP_UNKNOWN_PARENT,
    BlockRemoved,
    BlockStored,
    EventKeys,
)
from kv_picker.state.block_ledger import BlockLedger
from kv_picker.state.hashing import chain_root, token_keys
from kv_picker.state.kv_index import KVBlockIndex

NUM_ENDPOINTS = 4


@dataclass
class Model:
    """What the index should hold: per endpoint, engine hash -> (key, stamp)."""

    capacities: list[int]
    max_blocks: int
    entries: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    stamp: int = 0

    def store(self, endpoint: int, hashes: list[int]) -> None:
        held = self.entries.setdefault(endpoint, {})
        for h in hashes:
            self.stamp += 1
            held.pop(h, None)
            held[h] = (h, self.stamp)  # strict mode: the key is the engine hash
        while len(held) > self.capacities[endpoint]:
            oldest = min(held, key=lambda h: held[h][1])
            del held[oldest]
        while sum(map(len, self.entries.values())) > self.max_blocks:
            victim, oldest = min(
                ((e, h) for e, hs in self.entries.items() for h in hs),
                key=lambda eh: self.entries[eh[0]][eh[1]][1],
            )
            del self.entries[victim][oldest]

    def remove(self, endpoint: int, hashes: list[int]) -> None:
        for h in hashes:
            self.entries.get(endpoint, {}).pop(h, None)

    def clear(self, endpoint: int) -> None:
        self.entries.pop(endpoint, None)

    def runs(self, keys: list[int], candidates: set[int]) -> dict[int, int]:
        out = {}
        for endpoint in candidates:
            have = {key for key, _ in self.entries.get(endpoint, {}).values()}
            run = 0
            for key in keys:
                if key not in have:
                    break
                run += 1
            out[endpoint] = run
        return out


operation = st.one_of(
    st.tuples(
        st.just("store"),
        st.integers(0, NUM_ENDPOINTS - 1),
        st.lists(st.integers(1, 12), max_size=6, unique=True),
    ),
    st.tuples(
        st.just("remove"),
        st.integers(0, NUM_ENDPOINTS - 1),
        st.lists(st.integers(1, 12), max_size=4),
    ),
    st.tuples(st.just("clear"), st.integers(0, NUM_ENDPOINTS - 1), st.just([])),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(operation, max_size=40),
    st.lists(st.integers(1, 12), max_size=8),
    st.sets(st.integers(0, NUM_ENDPOINTS - 1)),
    st.lists(st.integers(0, 6), min_size=NUM_ENDPOINTS, max_size=NUM_ENDPOINTS),
    st.integers(1, 30),
)
def test_matches_brute_force_model(
    ops: list[tuple[str, int, list[int]]],
    query: list[int],
    candidates: set[int],
    scraped_capacities: list[int],
    max_blocks: int,
) -> None:
    default_capacity = 5
    index = KVBlockIndex(
        EventKeys(key_mode="strict"),
        default_capacity_blocks=default_capacity,
        max_blocks=max_blocks,
        capacity_source=scraped_capacities,
    )
    model = Model([c or default_capacity for c in scraped_capacities], max_blocks)
    for kind, endpoint, hashes in ops:
        if kind == "store":
            index.apply_stored(endpoint, BlockStored(hashes, None, [], 16), "m")
            model.store(endpoint, hashes)
        elif kind == "remove":
            index.apply_removed(endpoint, BlockRemoved(hashes))
            model.remove(endpoint, hashes)
        else:
            index.clear_endpoint(endpoint)
            model.clear(endpoint)
        assert index.num_blocks() == sum(map(len, model.entries.values()))
        assert index.num_blocks() <= max_blocks
    for endpoint in range(NUM_ENDPOINTS):
        assert sorted(index.ledger.keys(endpoint)) == sorted(model.entries.get(endpoint, {}))
    runs_out = [-1] * NUM_ENDPOINTS
    mask = sum(1 << e for e in candidates)
    best = index.runs(query, mask, runs_out)
    expected = model.runs(query, candidates)
    assert {e: runs_out[e] for e in candidates} == expected
    assert all(runs_out[e] == -1 for e in range(NUM_ENDPOINTS) if e not in candidates)
    assert best == max(expected.values(), default=0)
    distinct = {key for held in model.entries.values() for key, _ in held.values()}
    assert index.num_keys() == len(distinct)


def dual_index(on_drop: Callable[[str, int], None] | None = None, **kwargs: Any) -> KVBlockIndex:
    return KVBlockIndex(EventKeys(block_size_tokens=4, on_drop=on_drop), **kwargs)


def request_keys(index: KVBlockIndex, tokens: list[int], **kwargs: str) -> list[int]:
    return index.event_keys.request_keys(
        tokens, kwargs.get("model", "m"), kwargs.get("lora"), kwargs.get("salt")
    )


def test_dual_keys_from_events_match_request_keys() -> None:
    index = dual_index()
    tokens = list(range(100, 124))  # six blocks of 4
    # Stored in two events, as prefill chunks arrive: the second continues from its parent.
    assert index.apply_stored(0, BlockStored([11, 12, 13], None, tokens[:12], 4), "m") == 3
    assert index.apply_stored(0, BlockStored([14, 15, 16], 13, tokens[12:], 4), "m") == 3
    keys = request_keys(index, [*tokens, 1, 2])
    assert len(keys) == 6
    runs = [0, 0]
    assert index.runs(keys, 0b11, runs) == 6
    assert runs == [6, 0]
    # Removal by engine hash cuts the run at that block.
    assert index.apply_removed(0, BlockRemoved([14, 99])) == 1
    index.runs(keys, 0b11, runs)
    assert runs == [3, 0]
    # Another endpoint holding the first two blocks.
    index.apply_stored(1, BlockStored([21, 22], None, tokens[:8], 4), "m")
    index.runs(keys, 0b11, runs)
    assert runs == [3, 2]
    assert index.clear_endpoint(0) == 5
    index.runs(keys, 0b11, runs)
    assert runs == [0, 2]


def test_model_salt_and_adapter_separate_chains() -> None:
    index = dual_index()
    tokens = list(range(16))
    index.apply_stored(
        0, BlockStored([1, 2, 3, 4], None, tokens, 4, extra_keys=[("s1",), None, None]), "m"
    )
    index.apply_stored(1, BlockStored([5, 6, 7, 8], None, tokens, 4), "m")
    index.apply_stored(
        2,
        BlockStored([9, 10, 11, 12], None, tokens, 4, lora_name="ad", extra_keys=[("ad",)] * 4),
        "m",
    )
    runs = [0, 0, 0]
    index.runs(request_keys(index, tokens, salt="s1"), 0b111, runs)
    assert runs == [4, 0, 0]
    index.runs(request_keys(index, tokens), 0b111, runs)
    assert runs == [0, 4, 0]
    index.runs(request_keys(index, tokens, salt="s2"), 0b111, runs)
    assert runs == [0, 0, 0]
    index.runs(request_keys(index, tokens, lora="ad"), 0b111, runs)
    assert runs == [0, 0, 4]
    index.runs(request_keys(index, tokens, model="other"), 0b111, runs)
    assert runs == [0, 0, 0]
    # Salt and adapter together: vLLM's block 0 extra keys are (lora, salt).
    index.apply_stored(
        0,
        BlockStored(
            [13, 14], None, tokens[:8], 4, lora_name="ad", extra_keys=[("ad", "s1"), ("ad",)]
        ),
        "m",
    )
    index.runs(request_keys(index, tokens, lora="ad", salt="s1"), 0b111, runs)
    assert runs == [2, 0, 0]


def test_what_is_not_indexed() -> None:
    drops: list[tuple[str, int]] = []
    index = dual_index(on_drop=lambda reason, n: drops.append((reason, n)))
    tokens = list(range(8))
    assert index.apply_stored(0, BlockStored([1, 2], 99, tokens, 4), "m") == 0
    assert index.apply_stored(0, BlockStored([1, 2], None, tokens, 16), "m") == 0
    assert index.apply_stored(0, BlockStored([1, 2], None, tokens[:7], 4), "m") == 0
    assert index.apply_stored(0, BlockStored([1, 2], None, tokens, 4, medium="CPU"), "m") == 0
    assert index.apply_stored(0, BlockStored([1, 2], None, tokens, 4, lora_id=3), "m") == 0
    # A multimodal key on block 1: block 0 is indexed, the rest is not.
    assert (
        index.apply_stored(
            0, BlockStored([1, 2], None, tokens, 4, extra_keys=[None, ("img",)]), "m"
        )
        == 1
    )
    assert drops == [
        (DROP_UNKNOWN_PARENT, 2),
        (DROP_BLOCK_SIZE, 2),
        (DROP_TOKEN_COUNT, 2),
        (DROP_MEDIUM, 2),
        (DROP_LORA_ID, 2),
        (DROP_EXTRA_KEYS, 1),
    ]
    assert (
        index.apply_stored(
            0, BlockStored([3], None, tokens[:4], 4, kv_cache_spec_kind="sliding_window"), "m"
        )
        == 0
    )
    assert index.apply_stored(0, BlockStored([3], None, [2**40] * 4, 4), "m") == 0
    assert index.num_blocks() == 1
    # GPU medium in either spelling, and no medium, are indexed.
    assert index.apply_stored(1, BlockStored([5], None, tokens[:4], 4, medium="GPU"), "m") == 1


def test_strict_mode_needs_no_tokens() -> None:
    index = KVBlockIndex(EventKeys(16, "strict", "xxhash", "0"))
    tokens = list(range(1, 33))
    wire = index.event_keys.request_keys(tokens, "m", None, None)
    assert index.apply_stored(3, BlockStored(wire, None, [], 16), "m") == 2
    runs = [0] * 4
    assert index.runs(wire, 0b1000, runs) == 2
    assert runs[3] == 2


def test_restored_block_refreshes_recency_and_capacity_follows_the_scrape() -> None:
    capacities = [0]
    index = dual_index(default_capacity_blocks=3, capacity_source=capacities)
    tokens = list(range(4))
    for engine_hash in (1, 2, 3):
        index.apply_stored(0, BlockStored([engine_hash], None, [engine_hash] * 4, 4), "m")
    index.apply_stored(0, BlockStored([1], None, [1] * 4, 4), "m")  # 1 is the most recent again
    index.apply_stored(0, BlockStored([4], None, tokens, 4), "m")
    assert list(index.ledger.keys(0)) == [
        token_keys(tokens_of, chain_root("m"), 4)[0] for tokens_of in ([3] * 4, [1] * 4, tokens)
    ]
    assert index.ledger.get(0, 2) is None
    capacities[0] = 1  # the scraper learned the real capacity
    index.apply_stored(0, BlockStored([5], None, [5] * 4, 4), "m")
    assert index.num_blocks() == 1 and index.ledger.get(0, 5) is not None
    assert index.num_evicted_blocks() == 4


def test_remove_endpoint_forgets_it() -> None:
    index = dual_index()
    index.apply_stored(2, BlockStored([1, 2], None, list(range(8)), 4), "m")
    index.remove_endpoint(2)
    assert index.num_blocks() == 0 and index.num_keys() == 0
    index.apply_stored(2, BlockStored([1], None, list(range(4)), 4), "m")
    assert index.num_blocks() == 1


def test_ledger_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        BlockLedger(0, 10, None, lambda e, k: None)
    with pytest.raises(ValueError):
        EventKeys(key_mode="fuzzy")


async def test_in_process_there_is_nothing_to_fetch_run_or_close() -> None:
    index = dual_index()
    tokens = list(range(8))
    index.apply_stored(0, BlockStored([1, 2], None, tokens, 4), "m")
    keys = request_keys(index, tokens)
    assert index.prefetch(keys) is None  # no coroutine: runs() reads memory
    runs = [0]
    assert index.runs(keys, 0b1, runs, None) == 2
    await asyncio.wait_for(index.run(), 1.0)  # returns at once
    await index.close()
